"""Builders of small GPU/node inventories shared by the core tests."""

from __future__ import annotations

from qgpu.model import GpuDevice, NodeInventory


def make_gpu(node: str, index: int, model: str = "H100-80GB", gib: int = 80, numa: int = 0):
    return GpuDevice(
        uuid=f"GPU-{node}-{index}",
        index=index,
        model=model,
        memory_mib=gib * 1024,
        sm_count=132,
        numa_node=numa,
    )


def make_node(name: str, gpus: int = 4, model: str = "H100-80GB", gib: int = 80, **kw):
    return NodeInventory(
        name=name,
        gpus=[make_gpu(name, i, model, gib, numa=i // 2) for i in range(gpus)],
        **kw,
    )
