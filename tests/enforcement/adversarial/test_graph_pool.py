"""Graph memory the way NVIDIA's driver keeps it (cuda.h, graph memory nodes): an allocation
a graph does not free stays allocated after the launch until something frees it, the
device's graph pool grows by what is in use at once, and cuDeviceGraphMemTrim gives back
only what nothing uses. First what the simulated driver does on its own (every number
checked), then attacks on the hook's graph accounting that only such a driver can show."""

from __future__ import annotations

import pytest

from .conftest import CTX, GIB, HOSTILE_CAP, MIB, OOM, Arena, Programs

SUCCESS, INVALID_VALUE = 0, 1
G = GIB // MIB  # 1 GiB in the program's MiB reports


def driver_alone(arena: Arena, programs: Programs, mode: str) -> dict[str, list[int]]:
    h = arena.start([programs.c("graphpool"), mode], arena.hostile_env(hook=False))
    out: dict[str, list[int]] = {}
    for k, v in h.lines:
        out.setdefault(k, []).append(v)
    return out


def test_a_graph_allocation_lives_until_it_is_freed(arena: Arena, programs: Programs) -> None:
    """Kept after the launch, its graph relaunch refused, kept through a trim and through
    destroying its graph; cuMemFree frees it at once (once), and only then can a trim take
    the memory back."""
    out = driver_alone(arena, programs, "lifetime")
    assert out["run"] == [SUCCESS] and out["relaunch"] == [INVALID_VALUE]
    assert out["used_launched"] == [G] and out["reserved_launched"] == [G]
    assert out["used_trimmed"] == [G] and out["reserved_trimmed"] == [G]
    assert out["used_destroyed"] == [G] and out["reserved_destroyed"] == [G]
    assert out["free"] == [SUCCESS] and out["free_again"] == [INVALID_VALUE]
    assert out["used_freed"] == [0] and out["reserved_freed"] == [G]
    assert out["used_end"] == [0] and out["reserved_end"] == [0]


def test_a_running_graph_keeps_its_memory_through_a_trim(arena: Arena, programs: Programs) -> None:
    out = driver_alone(arena, programs, "in_flight")
    assert out["run"] == [SUCCESS] * 4 and out["trim"] == [SUCCESS, SUCCESS]
    assert out["used_running"] == [G] and out["reserved_running"] == [G]
    assert out["used_done"] == [0] and out["reserved_done"] == [G]
    assert out["used_trimmed"] == [0] and out["reserved_trimmed"] == [0]
    assert out["used_end"] == [0] and out["reserved_end"] == [G]  # launches after reuse it


def test_stream_ordered_free_of_graph_memory(arena: Arena, programs: Programs) -> None:
    out = driver_alone(arena, programs, "stream_free")
    assert out["run"] == [SUCCESS, SUCCESS] and out["free"] == [SUCCESS]
    assert out["used_queued"] == [G] and out["used_reached"] == [0]
    assert out["used_end"] == [G] and out["reserved_end"] == [G]


def test_another_graphs_free_node_frees_it(arena: Arena, programs: Programs) -> None:
    out = driver_alone(arena, programs, "free_node")
    assert out["node"] == [SUCCESS] and out["run"] == [SUCCESS] * 3
    assert out["used_kept"] == [G] and out["used_freed"] == [0] and out["used_end"] == [G]
    assert out["reserved_end"] == [G]


def test_auto_free_on_launch_relaunches_in_place(arena: Arena, programs: Programs) -> None:
    out = driver_alone(arena, programs, "auto_free")
    assert out["run"] == [SUCCESS] * 3
    assert out["used_end"] == [G] and out["reserved_end"] == [G]


def test_what_two_graphs_keep_adds_up(arena: Arena, programs: Programs) -> None:
    out = driver_alone(arena, programs, "two_graphs")
    assert out["run"] == [SUCCESS, SUCCESS]
    assert out["used_end"] == [2 * G] and out["reserved_end"] == [2 * G]


def test_each_graph_allocation_takes_whole_granules(arena: Arena, programs: Programs) -> None:
    out = driver_alone(arena, programs, "granules")
    assert out["run"] == [SUCCESS]
    assert out["used_end"] == [200] and out["reserved_end"] == [200]  # 100 x 2 MiB


def test_graph_frees_the_driver_refuses(arena: Arena, programs: Programs) -> None:
    """cuda.h: a free node names an allocation node's address, once per graph, never in
    both its own graph and another; memory not allocated now cannot be freed."""
    out = driver_alone(arena, programs, "refusals")
    for refused in ("bogus", "interior", "twice", "elsewhere", "own_after"):
        assert out[refused] == [INVALID_VALUE], refused
    assert out["ok"] == [SUCCESS, SUCCESS]
    assert out["unlaunched_free"] == [INVALID_VALUE]
    assert out["unlaunched_async"] == [INVALID_VALUE]
    assert out["run"] == [SUCCESS] and out["temp_free"] == [INVALID_VALUE]
    assert out["kept_free"] == [SUCCESS] and out["relaunch"] == [SUCCESS]


def test_graph_memory_the_card_cannot_hold_is_refused(arena: Arena, programs: Programs) -> None:
    out = driver_alone(arena, programs, "too_big")
    assert out["run"] == [OOM] and out["used_end"] == [0] and out["reserved_end"] == [0]


ROOM = (HOSTILE_CAP - CTX) // (512 * MIB)  # 512 MiB chunks that fit beside the context


@pytest.mark.parametrize("mode", ["attack_two", "attack_trim", "attack_auto", "attack_free"])
def test_graph_memory_kept_after_a_launch_stays_charged(
    arena: Arena, programs: Programs, mode: str
) -> None:
    """Two graphs each keeping 3 GiB; one kept and trimmed; AUTO_FREE_ON_LAUNCH relaunched;
    one freed by cuMemFreeAsync and another launched: each 3 GiB stays charged while the
    driver keeps it, so nothing beyond the cap fits."""
    h = arena.start([programs.c("graphpool"), mode])
    arena.contained(h)


@pytest.mark.parametrize("mode", ["attack_granules", "attack_upload"])
def test_many_small_graph_allocations_are_charged_whole_granules(
    arena: Arena, programs: Programs, mode: str
) -> None:
    """1700 allocation nodes of 4 KiB (7 MiB asked) take 1700 granules (3400 MiB) when the
    graph is launched or uploaded."""
    h = arena.start([programs.c("graphpool"), mode])
    arena.contained(h)
    assert h.all("run") == [OOM], h.lines


def test_a_slice_can_relaunch_its_graphs(arena: Arena, programs: Programs) -> None:
    """What a workload does in a 4 GiB slice: a graph allocating and freeing 3 GiB relaunched
    back to back, graphs keeping 3 GiB one after another once the last was freed, an
    AUTO_FREE_ON_LAUNCH graph relaunched. The whole need is charged again at each launch;
    the hook makes room by having the driver give back the graph memory nothing uses."""
    h = arena.start([programs.c("graphpool"), "relaunch"])
    assert h.all("run") == [SUCCESS] * 8 and h.all("free") == [SUCCESS] * 2, h.lines
    assert h.all("reserved_end") == [1024]
    # 1 GiB of graph memory kept, and the executable graphs' own work (a few nodes, 4 KiB
    # each on the simulator) takes the last of the room a fifth 512 MiB chunk needed
    assert h.all("grab") == [SUCCESS] * (ROOM - 3) + [OOM]
    arena.contained(h)
