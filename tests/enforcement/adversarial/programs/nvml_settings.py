"""A tenant changes its GPU's settings for everyone on it (our addition), with NVIDIA's own
client (nvidia-ml-py's pynvml). NVIDIA's driver lets root make these calls, and a Ray or
Dask worker in a container is often root. On the slice's own GPU: compute mode
EXCLUSIVE_PROCESS (no other process gets a new context: the slice's neighbours, and new
processes of other slices, are locked out) or PROHIBITED (argv[1] names which), accounting
mode off (every process's records forgotten) and the ended processes' accounting records
cleared. Reports each call's NVML result (``compute_mode``, ``accounting``, ``clear_pids``;
0 = done), then holds. It takes no context of its own."""

from __future__ import annotations

import sys
from collections.abc import Callable

import pynvml as nv
from hostile_cb import hold, say

MODES = {
    "exclusive": nv.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS,
    "prohibited": nv.NVML_COMPUTEMODE_PROHIBITED,
}


def attempt(key: str, call: Callable[..., object], *args: object) -> None:
    try:
        call(*args)
        say(key, 0)
    except nv.NVMLError as e:
        say(key, e.value)


def main() -> None:
    nv.nvmlInit()
    h = nv.nvmlDeviceGetHandleByIndex(0)
    attempt("compute_mode", nv.nvmlDeviceSetComputeMode, h, MODES[sys.argv[1]])
    attempt("accounting", nv.nvmlDeviceSetAccountingMode, h, nv.NVML_FEATURE_DISABLED)
    attempt("clear_pids", nv.nvmlDeviceClearAccountingPids, h)
    hold()


if __name__ == "__main__":
    main()
