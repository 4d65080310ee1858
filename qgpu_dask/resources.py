"""Dask worker/task resources of a slice: ``qgpu-core`` and ``qgpu-memory``.

A slice worker advertises what its slice holds (a share: its core percent and GiB; whole
GPUs: 100 per GPU and the cards' GiB), the same totals Ray nodes advertise. A task asks with
``client.submit(f, resources={"qgpu-core": 30, "qgpu-memory": 8})``; `task_resources`
builds that mapping from the core model's request (so ``memory="8Gi"`` and the rules of
§1 apply on the client too).
"""

from __future__ import annotations

from typing import Any

from enforcement.agent.models import Reservation
from qgpu.model import SliceRequest

CORE = "qgpu-core"
MEMORY = "qgpu-memory"
QGPU_RESOURCES = (CORE, MEMORY)


def slice_resources(reservation: Reservation) -> dict[str, float]:
    """What the worker of this slice offers to tasks."""
    gpus = max(1, len(reservation.device_uuids))
    return {CORE: float(reservation.core * gpus), MEMORY: float(reservation.memory_gib * gpus)}


def task_resources(core: Any, memory: Any = None) -> dict[str, float]:
    """``resources=`` for a task that needs ``core`` percent and ``memory`` GiB of a slice,
    validated by the core model (a share needs memory; whole GPUs may omit it)."""
    from qgpu_dask.agent import parse_request

    fields: dict[str, Any] = {"core": core}
    if memory is not None:
        fields["memory"] = memory
    request: SliceRequest = parse_request(fields, "resources")
    out = {CORE: float(request.core)}
    if request.memory_gib is not None:
        out[MEMORY] = float(request.memory_gib * request.gpu_count)
    return out


__all__ = ["CORE", "MEMORY", "QGPU_RESOURCES", "slice_resources", "task_resources"]
