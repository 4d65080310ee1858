"""Dask "inference" on GPU slices — runnable without a GPU (simulated H100s).

    .venv/bin/python examples/dask_inference.py [--placement frag|binpack|spread]
                                                [--sim 2xH100-80GB]

Starts a `qgpu_dask.SliceCluster` with three slices (a small one and two larger ones),
submits batches that ask for what they need through the ``qgpu-core`` / ``qgpu-memory``
resources, and each batch does its "GPU work" through the CUDA driver API (the simulated
driver, through the interposer preloaded in its worker): load "weights" into device memory,
run "kernels", and try to load a model that does not fit the slice. Each result says where
it ran: worker, slice, GPU, the memory the driver reports, and the refused allocation.
Finally a batch that no slice can hold fails with a clear error instead of waiting forever.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

GIB = 1 << 30


def infer(batch: int, weights_gib: int, kernel_ms: int = 20) -> dict[str, Any]:
    """One batch: weights into device memory, a few kernels, and an oversized load."""
    from distributed import get_worker

    from enforcement import simcuda

    drv = simcuda.Driver()
    drv.init()
    drv.context(0)
    _free, total = drv.mem_get_info()
    weights = drv.mem_alloc(weights_gib * GIB)
    start = time.monotonic()
    for _ in range(5):
        drv.launch_busy(kernel_ms * 1_000_000)
    drv.ctx_synchronize()
    elapsed = time.monotonic() - start
    oversized, _ = drv.try_mem_alloc(total + GIB)
    drv.mem_free(weights)
    return {
        "batch": batch,
        "worker": get_worker().name,
        "slice": os.environ.get("QGPU_SLICE_ID", ""),
        "gpu": drv.device_uuid(0),
        "core_limit": os.environ.get("QGPU_CORE_LIMIT", ""),
        "visible_gib": round(total / GIB, 1),
        "kernels_s": round(elapsed, 3),
        "oversized_load": simcuda.ERROR_NAMES.get(oversized, str(oversized)),
    }


def main(argv: list[str] | None = None) -> int:
    from distributed import Client

    from qgpu.cli_common import add_placement_options
    from qgpu.model import DEFAULT_PLACEMENT
    from qgpu_dask import NoSliceFits, SliceCluster, task_resources

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_placement_options(
        p,
        default=DEFAULT_PLACEMENT.value,
        gpu=False,
        old=["--policy"],
        help=f"where the slices land: binpack, spread or frag (default: {DEFAULT_PLACEMENT.value})",
    )
    p.add_argument("--sim", default="2xH100-80GB", help="simulated GPUs")
    args = p.parse_args(argv)

    slices = [
        {"core": 20, "memory": 8, "isolation": "fixed-share"},
        {"core": 40, "memory": 24},
        {"core": 40, "memory": 24},
    ]
    cluster = SliceCluster(slices, policy=args.placement, sim=args.sim)
    with cluster, Client(cluster) as client:
        print(f"{args.placement}: slices on the simulated GPUs")
        for name, res in cluster.slices.items():
            print(
                f"  {name}: {res.slice_id} on {res.device_uuid} "
                f"qgpu-core={res.core} qgpu-memory={res.memory_gib} {res.isolation.value}"
            )
        small = [
            client.submit(infer, i, 4, resources=task_resources(20, 8), pure=False)
            for i in range(2)
        ]
        large = [
            client.submit(infer, i, 16, resources=task_resources(40, 16), pure=False)
            for i in range(2, 6)
        ]
        for result in client.gather(small + large):
            print(
                f"  batch {result['batch']}: {result['worker']} slice {result['slice']} "
                f"gpu {result['gpu']} sees {result['visible_gib']} GiB, "
                f"core cap {result['core_limit']}%, 5 kernels in {result['kernels_s']} s, "
                f"oversized load -> {result['oversized_load']}"
            )
        too_big = client.submit(infer, 99, 40, resources=task_resources(60, 40), pure=False)
        try:
            too_big.result(timeout=60)
        except NoSliceFits as exc:
            print(f"  batch 99 refused: {exc}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
