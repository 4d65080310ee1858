"""A tenant changes its GPU's settings for everyone on it (our addition). NVIDIA's driver lets
root set a GPU's compute mode, clocks, power limit, ECC, MIG mode and accounting through
NVML, and Ray and Dask workers in containers often run as root. Before the hook fenced these
calls, the tenant below (NVIDIA's pynvml, no context of its own) won on the simulator, whose
NVML does what NVIDIA's does for root (it keeps the setting in the GPU's state, for every
process): EXCLUSIVE_PROCESS or PROHIBITED, and a new process of the victim's slice could no
longer get a context (CUDA_ERROR_DEVICE_UNAVAILABLE); accounting off, and every process's
records were gone. The ground truth is read by the node's operator, outside any slice."""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pynvml
import pytest

from enforcement.native import hook_library_path

from ..conftest import Worker
from .conftest import VICTIM_CAP, Arena, Programs, make_arena

NO_PERMISSION = 4  # NVML_ERROR_NO_PERMISSION
OPERATOR = """
import sys, pynvml as nv
nv.nvmlInit()
h = nv.nvmlDeviceGetHandleByIndex(0)
for mode in map(int, sys.argv[1:]):
    nv.nvmlDeviceSetComputeMode(h, mode)
accounting = nv.nvmlDeviceGetAccountingMode(h)
pids = nv.nvmlDeviceGetAccountingPids(h) if accounting == nv.NVML_FEATURE_ENABLED else []
print(nv.nvmlDeviceGetComputeMode(h), accounting, *pids)
"""


@pytest.fixture
def accounted(short_tmp: Path) -> Iterator[Arena]:
    """The arena with NVML accounting on, as an administrator would have it."""
    yield from make_arena(short_tmp, accounting=True)


def operator(arena: Arena, *set_modes: int, hook: bool = False) -> list[int]:
    """The node's operator's view (no slice): compute mode, accounting mode, accounted pids,
    after setting the compute modes given (with the hook preloaded when `hook`)."""
    env = arena.sim.base_env()
    if hook:
        env["LD_PRELOAD"] = str(hook_library_path())
    done = subprocess.run(
        [sys.executable, "-c", OPERATOR, *map(str, set_modes)],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return [int(v) for v in done.stdout.split()]


@pytest.mark.parametrize("mode", ["exclusive", "prohibited"])
def test_a_tenant_cannot_change_its_gpus_settings_for_its_neighbours(
    accounted: Arena, mode: str
) -> None:
    # not root: the driver itself refuses (NVML's setters are root's), the same answer
    victim_pid = accounted.victim.pid
    h = accounted.python("nvml_settings.py", mode)
    compute, accounting, *pids = operator(accounted)
    assert compute == pynvml.NVML_COMPUTEMODE_DEFAULT, f"compute mode now {compute}: {h.lines}"
    assert accounting == pynvml.NVML_FEATURE_ENABLED and victim_pid in pids, h.lines
    assert h.one("compute_mode") == h.one("accounting") == h.one("clear_pids") == NO_PERMISSION
    # a new process of the victim's slice still gets its context and memory
    second = Worker(accounted.sim.slice_env("victim", memory=VICTIM_CAP))
    try:
        second.start()
    finally:
        second.kill()
    accounted.victim_gets_its_promise()
    assert "nvmlDeviceSetComputeMode refused in slice hostile" in h.finish()


def test_outside_a_slice_the_settings_are_the_drivers(arena: Arena, programs: Programs) -> None:
    """The operator, with the hook preloaded but in no slice, still sets the GPU's compute
    mode (through the hook's forwarding wrapper), and the simulator holds every new context
    to it as the driver would; then sets it back."""
    if os.geteuid() != 0:  # an operator without the privilege is refused by the driver
        with pytest.raises(AssertionError, match="Insufficient Permissions"):
            operator(arena, pynvml.NVML_COMPUTEMODE_PROHIBITED, hook=True)
        return
    assert operator(arena, pynvml.NVML_COMPUTEMODE_PROHIBITED, hook=True)[0] == 2
    try:
        late = Worker(arena.sim.slice_env("late", memory=1 << 30))
        try:
            assert late.ask("init") == ["ok", "0"]
            assert late.ask("ctx") != ["ok"]  # CUDA_ERROR_DEVICE_UNAVAILABLE, no context
        finally:
            late.kill()
    finally:
        assert operator(arena, pynvml.NVML_COMPUTEMODE_DEFAULT, hook=True)[0] == 0


# NVML calls whose names look like changes but change nothing of the GPU's: event sets are
# the caller's own, CPU affinity is the calling thread's, the rest read
NOT_SETTINGS = re.compile(
    r"nvml(System)?EventSet\w*|nvmlDevice(Set|Clear)CpuAffinity|nvml\w*Register\w*Events\w*"
    r"|nvml\w*Get\w*"
)
SETTING = re.compile(r"(Set|Reset|Clear|Create|Destroy|Modify|Remove|Discover|Freeze|Activate"
                     r"|Update)")  # fmt: skip


def test_every_setting_nvidias_client_knows_is_fenced() -> None:
    """Every NVML entry point that nvidia-ml-py (NVIDIA's bindings, which follow nvml.h) can
    call to change a GPU or the node is one the hook exports and refuses in a slice, so a
    new NVML release fails here until the list in hook.h has caught up."""
    source = Path(pynvml.__file__).read_text()
    names = set(re.findall(r'_nvmlGetFunctionPointer\("(nvml\w+)"\)', source))
    assert len(names) > 300, "pynvml no longer names its entry points the way this test reads"
    settings = {n for n in names if SETTING.search(n) and not NOT_SETTINGS.fullmatch(n)}
    hook = ctypes.CDLL(str(hook_library_path()), mode=os.RTLD_LOCAL)
    missing = sorted(n for n in settings if not hasattr(hook, n))
    assert not missing, f"NVML settings the hook does not fence: {missing}"
    assert "nvmlDeviceSetComputeMode" in settings and len(settings) >= 60
