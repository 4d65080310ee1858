"""Escapes a native program reaches: loader tricks (dlvsym, RTLD_DEEPBIND, dlmopen), the v1
entry points and cuGetProcAddress below 3020, mipmapped arrays, graph memory nodes,
contexts and context limits, threads racing the cap, fork, and the hook's own mapping of
the ledger. Each C program is compiled here against the toolkit's cuda.h."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from enforcement.native import sim_library_dir
from enforcement.sim import MODELS

from ..test_config import build_hook_with_default
from .conftest import (
    CTX,
    GIB,
    HOSTILE_CAP,
    MIB,
    OOM,
    Arena,
    Hostile,
    Programs,
    make_arena,
    spawn,
)

NOT_FOUND = -1


def test_dlvsym_reaches_no_raw_driver(arena: Arena, programs: Programs) -> None:
    h = arena.start([programs.c("dlvsym")])
    assert h.all("grab") == [0]
    tried = h.all("via_dlsym") + h.all("via_dlvsym") + h.all("direct")
    assert set(tried) <= {OOM, NOT_FOUND}, h.lines
    assert tried.count(OOM) >= 8, h.lines  # libc's dlsym/dlvsym were found and came back to us
    arena.contained(h)


@pytest.mark.parametrize("mode", ["deepbind", "deepbind-local"])
def test_plugin_loaded_with_deepbind_is_capped(arena: Arena, programs: Programs, mode: str) -> None:
    plugin = programs.shared("plugin")
    h = arena.start([programs.c("loader"), mode, plugin])
    assert h.all("grab") == [0] and h.all("loaded") == [1]
    assert h.all("plugin") == [OOM, OOM, OOM]
    arena.contained(h)


@pytest.mark.parametrize("mode", ["dlmopen", "dlmopen-driver"])
def test_dlmopen_into_a_new_namespace_is_refused(
    arena: Arena, programs: Programs, mode: str
) -> None:
    """LD_PRELOAD is never applied in a new link-map namespace, and glibc refuses
    RTLD_GLOBAL there, so the hook cannot come first in it: loading into one is refused."""
    h = arena.run_to_end([programs.c("loader"), mode, programs.shared("plugin")])
    assert h.all("grab") == [0] and h.all("loaded") == [0]
    assert "dlmopen" in h.stderr and "refused" in h.stderr
    arena.contained(h)


@pytest.mark.parametrize("mode", ["alloc", "pitch", "array"])
def test_v1_entry_points_are_capped(arena: Arena, programs: Programs, mode: str) -> None:
    h = arena.start([programs.c("v1"), mode])
    assert h.all("v1") == [0, 0, 0]
    assert h.all("grab") == [OOM]  # the 3 GiB taken through v1 names were charged
    arena.contained(h)


def test_v1_views_report_the_slice(arena: Arena, programs: Programs) -> None:
    h = arena.start([programs.c("v1"), "info"])
    cap32 = min(HOSTILE_CAP, 0xFFFFFFFF)  # a 32-bit view of a 4 GiB cap
    assert h.one("total") == cap32 and h.one("devtotal") == cap32
    assert h.one("free") == HOSTILE_CAP - CTX


def test_cuGetProcAddress_serves_the_hook_by_name_version_and_flags(
    arena: Arena, programs: Programs
) -> None:
    h = arena.start([programs.c("v1"), "resolve"])
    assert h.all("hook") == [1] * 16


def test_mipmapped_arrays_are_capped(arena: Arena, programs: Programs) -> None:
    h = arena.start([programs.c("mipmap")])
    assert h.all("mipmap") == [0, 0, OOM]
    arena.contained(h)


GRAPH_MODES = [
    "launch",
    "upload",
    "params",
    "legacy",
    "launch_ptsz",
    "upload_ptsz",
    "params_ptsz",
    "addnode",
    "addnode_v2",
]


@pytest.mark.parametrize("mode", GRAPH_MODES)
def test_graph_memory_nodes_are_charged_when_they_allocate(
    arena: Arena, programs: Programs, mode: str
) -> None:
    h = arena.start([programs.c("graphmem"), mode])
    assert h.all("grab") == [0] and h.all("node") == [0]
    assert h.all("run") == [OOM]
    arena.contained(h)


GRAPH_PLACEMENTS = [
    "child_move",
    "child_move_nested",
    "capture_to_graph",
    "capture_to_child",
    "raw_add",
]


@pytest.mark.parametrize("mode", GRAPH_PLACEMENTS)
def test_graph_memory_is_charged_however_it_got_into_the_graph(
    arena: Arena, programs: Programs, mode: str
) -> None:
    """A 3 GiB allocation node that reaches the instantiated graph through a moved child
    graph (CUDA 12.9+), capture into an existing graph (12.3+), or the raw driver: the
    executable graph's need is what the driver says the graph holds at instantiation."""
    h = arena.start([programs.c("graphmem"), mode])
    assert h.all("grab") == [0] and set(h.all("node") + h.all("move")) == {0}
    assert h.all("instantiate") == [0] and h.all("run") == [OOM]
    arena.contained(h)


@pytest.mark.parametrize("mode", ["exec_update", "exec_update_v1", "exec_child", "exec_node"])
def test_executable_graph_updated_to_more_memory_is_charged(
    arena: Arena, programs: Programs, mode: str
) -> None:
    """An executable graph instantiated with a 1 MiB allocation node and then updated with a
    topologically identical graph holding 3 GiB (cuda.h names no restriction on allocation
    nodes there, so the simulator lets it through)."""
    h = arena.start([programs.c("graphmem"), mode])
    assert h.all("grab") == [0] and h.all("instantiate") == [0] and h.all("update") == [0]
    assert h.all("run") == [OOM]
    arena.contained(h)


@pytest.mark.parametrize("hook", [True, False], ids=["hooked", "driver-alone"])
@pytest.mark.parametrize(
    "mode",
    ["refused_child", "refused_clone", "refused_set", "refused_owned", "refused_conditional"],
)
def test_graph_changes_the_driver_refuses_add_no_memory(
    arena: Arena, programs: Programs, mode: str, hook: bool
) -> None:
    """What cuda.h says NVIDIA's driver refuses for graphs with allocation nodes (cloning
    them, CLONE ownership, changing an allocation node, adding one to a graph a node owns or
    to a conditional body, instantiating a moved graph) is refused, by the simulated driver
    alone too; what is left runs."""
    h = arena.start([programs.c("graphmem"), mode], arena.hostile_env(hook=hook))
    refused = h.all("node")
    assert h.all("grab") == [0] and refused and 0 not in refused, h.lines
    assert h.all("run") == [0]
    arena.contained(h)


def test_a_child_graph_replaced_again_and_again_counts_once(
    arena: Arena, programs: Programs
) -> None:
    """Three updates of a child graph node to 256 MiB leave 256 MiB in the executable graph:
    the launch fits in the 512 MiB left (1 MiB + 3 x 256 MiB would not)."""
    h = arena.start([programs.c("graphmem"), "exec_child_fits"])
    assert h.all("update") == [0, 0, 0] and h.all("run") == [0]
    arena.contained(h)


def test_graph_memory_in_a_moved_child_graph_counts_against_the_slice(
    arena: Arena, programs: Programs
) -> None:
    h = arena.start([programs.c("graphmem"), "child_move_fits"])
    assert h.all("move") == [0] and h.all("run") == [0]
    assert h.all("after") == [OOM]  # 3 GiB + the context + 256 MiB: no room for 512 MiB
    arena.contained(h)


@pytest.mark.parametrize("mode", ["v1", "v2", "v3", "v4", "green"])
def test_every_context_is_charged(arena: Arena, programs: Programs, mode: str) -> None:
    h = arena.start([programs.c("contexts"), mode])
    fit = (HOSTILE_CAP - CTX) // CTX  # on top of the primary context
    assert h.all("ctx") == [0] * fit + [OOM] * (10 - fit)
    arena.contained(h)


def test_primary_context_recreated_after_reset_is_charged(arena: Arena, programs: Programs) -> None:
    h = arena.start([programs.c("contexts"), "primary"])
    assert h.all("reset") == [0] * 10 and h.all("ctx") == [0] * 10
    assert h.all("grab") == [0, OOM]
    arena.contained(h)


HOPPER_CTX = MODELS["h100-80gb"].context_memory  # more than the hook's default charge


@pytest.fixture
def hopper_ctx_arena(short_tmp: Path) -> Iterator[Arena]:
    """The arena's card with contexts that cost what the simulator's H100 takes for one, green
    contexts as much (on top of the primary context they retain): more than the hook's
    default charge per context (QGPU_CONTEXT_MEMORY, 512 MiB)."""
    yield from make_arena(short_tmp, context_memory=HOPPER_CTX, green_context_memory=HOPPER_CTX)


@pytest.mark.parametrize("mode", ["v1", "v2", "v3", "v4", "green"])
def test_contexts_that_cost_more_than_the_charge_are_measured(
    hopper_ctx_arena: Arena, programs: Programs, mode: str
) -> None:
    """Charged the configured 512 MiB each, seven contexts fit beside the primary one and the
    tenant held 8 x 640 MiB = 5 GiB of its 4 GiB (won against the hook that charged the
    configured size). Charged what the driver took, five fit."""
    assert HOPPER_CTX > 512 * MIB
    h = hopper_ctx_arena.start([programs.c("contexts"), mode])
    hopper_ctx_arena.contained(h)
    fit = (HOSTILE_CAP - HOPPER_CTX) // HOPPER_CTX  # on top of the primary context
    assert h.all("ctx") == [0] * fit + [OOM] * (10 - fit)


def test_a_recreated_primary_context_gives_its_measured_charge_back(
    hopper_ctx_arena: Arena, programs: Programs
) -> None:
    """Ten resets and retains of the primary context: each new one is charged what the
    driver took for it and each reset gives that back, so 3 GiB still fit beside it."""
    h = hopper_ctx_arena.start([programs.c("contexts"), "primary"])
    assert h.all("reset") == [0] * 10 and h.all("ctx") == [0] * 10
    assert h.all("grab") == [0, OOM]
    hopper_ctx_arena.contained(h)


def test_many_processes_each_with_a_context_that_costs_more(
    hopper_ctx_arena: Arena, programs: Programs
) -> None:
    """Ten processes of the slice, each holding only its primary context: charged 512 MiB
    each, eight started and held 5 GiB together under a 4 GiB cap (won against the hook that
    charged the configured size). Measured, six fit and the rest are refused their context."""
    a = hopper_ctx_arena
    started: list[Hostile] = []
    refused = 0
    for _ in range(10):
        h = Hostile(spawn([programs.c("contexts"), "hold"], a.hostile_env()))
        a.hostiles.append(h)
        try:
            h.read_until_ready()
            started.append(h)
        except AssertionError:  # setup() reported the refused context and exited
            assert ("ctx", OOM) in h.lines, h.lines
            refused += 1
    held = sum(a.held(h.pid) for h in started)
    assert held <= HOSTILE_CAP, f"the slice's processes hold {held / GIB:.2f} GiB"
    assert len(started) == HOSTILE_CAP // HOPPER_CTX and refused == 10 - len(started)
    a.victim_gets_its_promise()


def test_without_nvml_contexts_are_measured_by_the_devices_free_memory(
    hopper_ctx_arena: Arena, programs: Programs, short_tmp: Path
) -> None:
    """No NVML in the process (the hook falls back to the device's used memory, here the
    driver's cuMemGetInfo): the first context cannot be measured (cuMemGetInfo needs a
    context) and is charged the configured 512 MiB; every later one what the device's free
    memory shows it took, so the tenant stays under its cap."""
    a = hopper_ctx_arena
    bare = short_tmp / "no-nvml"
    bare.mkdir()
    (bare / "libcuda.so.1").symlink_to(sim_library_dir() / "libcuda.so.1")
    env = a.hostile_env()
    env["LD_LIBRARY_PATH"] = str(bare)
    h = a.start([programs.c("contexts"), "v2"], env)
    fit = (HOSTILE_CAP - 512 * MIB) // HOPPER_CTX  # the primary context charged the floor
    assert h.all("ctx") == [0] * fit + [OOM] * (10 - fit)
    a.contained(h)


def test_contexts_cheaper_than_the_charge_are_charged_the_configured_size(
    short_tmp: Path, programs: Programs
) -> None:
    """Where the driver takes less than QGPU_CONTEXT_MEMORY for a context (256 MiB here),
    the configured size is charged: it is a floor, charged before the driver is called."""
    for a in make_arena(short_tmp, context_memory=256 * MIB):
        h = a.start([programs.c("contexts"), "v2"])
        fit = (HOSTILE_CAP - 512 * MIB) // (512 * MIB)
        assert h.all("ctx") == [0] * fit + [OOM] * (10 - fit)
        assert a.held(h.pid) == (fit + 1) * 256 * MIB
        a.contained(h)


@pytest.mark.parametrize("limit", ["heap", "stack"])
def test_context_limits_that_reserve_memory_are_capped(
    arena: Arena, programs: Programs, limit: str
) -> None:
    h = arena.start([programs.c("contexts"), limit])
    assert h.all("limit") == [OOM]
    assert h.all("grab") == [0, 0, 0, OOM]
    arena.contained(h)


@pytest.mark.parametrize("limit", ["pending", "sync_depth"])
def test_device_runtime_limits_that_reserve_memory_are_capped(
    arena: Arena, programs: Programs, limit: str
) -> None:
    """The pending launch count raised by 65536 launches at a time, or the sync depth a
    level at a time (the simulated T4: 160 MiB a level), until refused: the driver reserves
    device memory for them (cuda.h), so the slice's cap must hold it."""
    h = arena.start([programs.c("contexts"), limit])
    arena.contained(h)
    refused = h.all("limit")
    assert refused[-1] == OOM and set(refused[:-1]) <= {0}, h.lines


def test_device_runtime_limits_given_back_when_lowered(arena: Arena, programs: Programs) -> None:
    """Raised a little and lowered back to their defaults: all of the slice comes back."""
    h = arena.start([programs.c("contexts"), "devrt_fits"])
    assert h.all("limit") == [0, 0] and h.all("back") == [0, 0]
    room = (HOSTILE_CAP - CTX) // (512 * MIB)
    assert h.all("grab") == [0] * room + [OOM]
    arena.contained(h)


@pytest.fixture
def costly_arena(short_tmp: Path) -> Iterator[Arena]:
    """A driver whose pending launches cost 64 KiB each: more than the hook's own bound."""
    yield from make_arena(short_tmp, devrt_launch_bytes=64 << 10)


def test_device_runtime_reservation_learned_from_the_driver(
    costly_arena: Arena, programs: Programs
) -> None:
    """The hook cannot know what a real driver reserves per pending launch; where the driver
    takes more than the hook's bound, the free memory it reports across the call shows it,
    and the slice is charged that."""
    h = costly_arena.start([programs.c("contexts"), "pending"])
    costly_arena.contained(h)
    assert h.all("limit")[-1] == OOM, h.lines


def test_threads_racing_the_cap(arena: Arena, programs: Programs) -> None:
    h = arena.start([programs.c("race")])
    assert h.one("peak") <= HOSTILE_CAP - CTX
    assert h.one("peak") >= HOSTILE_CAP - CTX - 256 * MIB  # the cap was reached
    assert (h.one("free"), h.one("total")) == (HOSTILE_CAP - CTX, HOSTILE_CAP)
    arena.contained(h)


def test_a_forked_child_cannot_give_back_its_parents_charge(
    arena: Arena, programs: Programs
) -> None:
    h = arena.start([programs.c("fork")])
    assert h.all("grab") == [0] and h.all("child_exit") == [0]
    assert h.all("again") == [OOM]
    arena.contained(h)


def test_replacing_the_ledger_mapping_is_no_escape(arena: Arena, programs: Programs) -> None:
    h = arena.start([programs.c("ledger_map"), "swap"])
    assert h.all("tampered") == [1]
    assert h.all("grab") == [0, OOM]
    arena.contained(h)


def test_unmapping_the_ledger_only_crashes_the_tenant(arena: Arena, programs: Programs) -> None:
    h = arena.run_to_end([programs.c("ledger_map"), "unmap"])
    assert h.all("grab") == [0] and h.all("tampered") == [1]
    assert h.proc.returncode == -signal.SIGSEGV
    arena.victim_gets_its_promise()


def test_environment_cannot_override_a_trusted_limits_file(
    arena: Arena, programs: Programs, short_tmp: Path
) -> None:
    """A root-owned, read-only limits file at the default path wins over QGPU_* variables
    the tenant sets (in its environment, or with setenv before cuInit)."""
    if os.geteuid() != 0:
        pytest.skip("a trusted limits file is owned by root; this test runs as another user")
    trusted = short_tmp / "trusted-limits.conf"
    trusted.write_text(
        f"QGPU_SLICE_ID=hostile\nQGPU_DEVICE_UUID={arena.sim.uuid(0)}\n"
        f"QGPU_MEMORY_LIMIT={HOSTILE_CAP}\nQGPU_STATE_DIR={arena.sim.state_dir}\n"
    )
    trusted.chmod(0o444)
    env = arena.hostile_env()
    env["LD_PRELOAD"] = str(build_hook_with_default(short_tmp, trusted))
    env.update(QGPU_SLICE_ID="elsewhere", QGPU_MEMORY_LIMIT=str(16 * GIB))
    h = arena.start([programs.c("env_override")], env)
    assert h.all("grab") == [0, 0, 0, OOM]
    arena.contained(h)
