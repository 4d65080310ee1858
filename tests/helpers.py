"""Helpers shared by the test suites: small GPU/node inventories, polling."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

from qgpu.model import GpuDevice, NodeInventory

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout: float = 30.0, interval: float = 0.1) -> T:
    """Poll `predicate` until it returns something truthy (returned); fail after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s")


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


def stop_processes(procs: Iterable[subprocess.Popen], timeout: float = 10.0) -> None:
    """SIGTERM every process, then wait for each; SIGKILL whatever is still running."""
    procs = list(procs)
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
