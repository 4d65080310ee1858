"""The live cluster as qgpu sees it through Ray: inventories and free vectors per GPU.

Built from ``ray.nodes()`` (totals and labels) and per-node available resources, so the
core placement engine decides over exactly what Ray will grant. A process-local list of
recent decisions (not yet visible in Ray's availability) is subtracted for a short time so
that several ``options()`` calls in a row see each other.

Workers that bind import this module too: numpy and the engine's state are imported only
when a `LiveView` is built (`available_flat` alone needs neither).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from qgpu.model import GpuDevice, NodeInventory
from qgpu.units import MIB_PER_GIB
from qgpu_ray.resources import (
    LABEL_GPU_MODEL_PREFIX,
    LABEL_MODEL,
    LABEL_NODE,
    SLOTS,
    TOTAL_CORE,
    TOTAL_MEMORY,
    gpu_resource,
    label_value,
    parse_gpu_resource,
)

if TYPE_CHECKING:
    from qgpu.placement import ClusterState

PENDING_TTL_S = 10.0


@dataclass
class RayNode:
    node_id: str
    name: str
    inventory: NodeInventory
    slots: dict[str, int] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)


@dataclass
class _Pending:
    expires: float
    amounts: dict[str, float]
    baseline: dict[str, float]  # free amount of each key the decision was made against


@dataclass
class _PendingBook:
    """Decisions this process made that Ray's availability may not show yet.

    An entry is dropped as soon as Ray's availability of each of its keys has fallen by
    its amount (Ray has absorbed it), or after a short TTL (the work never started).
    """

    lock: threading.Lock = field(default_factory=threading.Lock)
    items: list[_Pending] = field(default_factory=list)

    def add(
        self,
        amounts: dict[str, float],
        baseline: dict[str, float],
        ttl: float = PENDING_TTL_S,
    ) -> object:
        """Record a decision; returns a token for `discard` once Ray surely shows it."""
        entry = _Pending(
            time.monotonic() + ttl, dict(amounts), {k: baseline.get(k, 0.0) for k in amounts}
        )
        with self.lock:
            self.items.append(entry)
        return entry

    def discard(self, tokens: list[object]) -> None:
        with self.lock:
            self.items = [p for p in self.items if all(p is not t for t in tokens)]

    def outstanding(self, available: dict[str, float]) -> dict[str, float]:
        """Amounts still to subtract from `available` (flat: resource name -> amount)."""
        now = time.monotonic()

        def absorbed(p: _Pending) -> bool:
            return all(
                available.get(k, 0.0) <= p.baseline[k] - v + 1e-6 for k, v in p.amounts.items()
            )

        with self.lock:
            self.items = [p for p in self.items if p.expires > now and not absorbed(p)]
            total: dict[str, float] = {}
            for p in self.items:
                for k, v in p.amounts.items():
                    total[k] = total.get(k, 0.0) + v
            return total

    def clear(self) -> None:
        with self.lock:
            self.items.clear()


PENDING = _PendingBook()


def ray_nodes() -> list[RayNode]:
    """Alive Ray nodes that advertise qgpu GPUs, as inventories (GPU order by UUID)."""
    import ray

    out = []
    for info in ray.nodes():
        if not info.get("Alive", False):
            continue
        totals: dict[str, float] = info.get("Resources", {})
        labels: dict[str, str] = info.get("Labels", {}) or {}
        per_gpu: dict[str, dict[str, float]] = {}
        for name, amount in totals.items():
            parsed = parse_gpu_resource(name)
            if parsed:
                per_gpu.setdefault(parsed[1], {})[parsed[0]] = amount
        if not per_gpu:
            continue
        gpus = []
        for index, uuid in enumerate(sorted(per_gpu)):
            amounts = per_gpu[uuid]
            model = labels.get(LABEL_GPU_MODEL_PREFIX + label_value(uuid)) or labels.get(
                LABEL_MODEL, "unknown"
            )
            gpus.append(
                GpuDevice(
                    uuid=uuid,
                    index=index,
                    model=model,
                    memory_mib=int(amounts.get(TOTAL_MEMORY, 0)) * MIB_PER_GIB or 1,
                )
            )
        node_id = info["NodeID"]
        slots = {g.uuid: int(per_gpu[g.uuid].get(SLOTS, g.max_slices())) for g in gpus}
        inventory = NodeInventory(
            name=labels.get(LABEL_NODE) or node_id,
            gpus=gpus,
            max_slices_per_gpu=max(slots.values()) if slots else 16,
        )
        out.append(
            RayNode(
                node_id=node_id,
                name=inventory.name,
                inventory=inventory,
                slots=slots,
                labels=labels,
            )
        )
    return out


def available_per_node() -> dict[str, dict[str, float]]:
    from ray._private.state import available_resources_per_node

    return available_resources_per_node()


def _free(avail: dict[str, float], pending: dict[str, float], kind: str, uuid: str) -> float:
    name = gpu_resource(kind, uuid)
    return max(0.0, avail.get(name, 0.0) - pending.get(name, 0.0))


def available_flat(
    nodes: list[RayNode], available: dict[str, dict[str, float]] | None = None
) -> dict[str, float]:
    """Ray's available per-GPU resources of `nodes`, flat: resource name -> amount."""
    available = available_per_node() if available is None else available
    flat: dict[str, float] = {}
    for node in nodes:
        for key, amount in available.get(node.node_id, {}).items():
            if parse_gpu_resource(key):
                flat[key] = amount
    return flat


@dataclass
class LiveView:
    """The engine's state over Ray's live resources, with what it was built from."""

    state: ClusterState
    nodes: dict[str, RayNode]  # by node name
    available: dict[str, float]  # flat: per-GPU resource name -> Ray's available amount
    effective: dict[str, float]  # the same minus this process's not-yet-visible decisions


def live_state(
    nodes: list[RayNode] | None = None,
    available: dict[str, dict[str, float]] | None = None,
    include_pending: bool = True,
) -> LiveView:
    """A ClusterState whose free vectors are Ray's available per-GPU resources, minus this
    process's decisions that Ray does not show yet."""
    import numpy as np

    from qgpu.placement import ClusterState

    nodes = ray_nodes() if nodes is None else nodes
    flat = available_flat(nodes, available)
    pending = PENDING.outstanding(flat) if include_pending else {}
    state = ClusterState([n.inventory for n in nodes])
    for node in nodes:
        for gpu in node.inventory.gpus:
            i = state.uuid_index[gpu.uuid]
            state.max_slices[i] = node.slots[gpu.uuid]
            state.free_core[i] = int(_free(flat, pending, TOTAL_CORE, gpu.uuid))
            state.free_mem[i] = int(_free(flat, pending, TOTAL_MEMORY, gpu.uuid))
            state.slices[i] = node.slots[gpu.uuid] - int(_free(flat, pending, SLOTS, gpu.uuid))
    state.node_free_core[:] = 0
    state.node_free_mem[:] = 0
    np.add.at(state.node_free_core, state.gpu_node, state.free_core)
    np.add.at(state.node_free_mem, state.gpu_node, state.free_mem)
    state.touch()
    effective = {k: v - pending.get(k, 0.0) for k, v in flat.items()}
    return LiveView(state, {n.name: n for n in nodes}, flat, effective)
