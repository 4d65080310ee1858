"""Ray resource names and node labels for qgpu (DESIGN.md §5).

A node advertises the totals ``qgpu-core`` (100 x GPUs) and ``qgpu-memory`` (sum of whole
GiB) and, per physical GPU, a cluster-unique triple named after the GPU's UUID:
``qgpu-core/<uuid>`` (100), ``qgpu-memory/<uuid>`` (card GiB) and ``qgpu-slots/<uuid>``
(the slice limit of that GPU). A slice consumes the totals plus its GPU's triple, so Ray's
own accounting never over-commits a GPU in core, memory or slice count. Each node also
advertises ``qgpu-isolation/<policy>`` markers (see ISOLATION_PREFIX).

The node's GPUs are also Ray's ``GPU`` resource (``--num-gpus``, with the raylet's
``CUDA_VISIBLE_DEVICES`` listing their UUIDs in `gpu_order`), so unchanged ``num_gpus`` work
runs there too and Ray's GPU ids are the UUIDs; `qgpu_ray.bind` books it in the same per-GPU
resources.

Labels: ``qgpu.io/node`` (the agent's node name), ``qgpu.io/gpu-model`` (the model, or
``mixed``), ``qgpu.io/gpu-count``, ``qgpu.io/isolation`` (the node's default isolation),
``qgpu.io/worker-hook`` (``ray``: its workers run the bind hook, see `qgpu_ray.hook`) and,
per GPU, ``qgpu.io/model.<uuid>``.

Environment of the node's raylet (its workers inherit it): ``QGPU_RAY_NODE`` (the node's
inventory, JSON) and ``QGPU_RAY_FRACTION`` (`qgpu_ray.fraction.FractionRule`).
"""

from __future__ import annotations

import re

from qgpu.model import IsolationPolicy, NodeInventory
from qgpu.units import CORE_FIELD, MEMORY_FIELD

TOTAL_CORE = CORE_FIELD  # "qgpu-core"
TOTAL_MEMORY = MEMORY_FIELD  # "qgpu-memory"
SLOTS = "qgpu-slots"
GPU_KINDS = (TOTAL_CORE, TOTAL_MEMORY, SLOTS)
# Isolation markers: every qgpu node advertises ISOLATION_CAPACITY of each; a worker that
# asks for ISOLATION_AMOUNT of one carries its isolation policy in its assigned resources
# (the SDK's resource-only mode), without a runtime_env.
ISOLATION_PREFIX = "qgpu-isolation/"
ISOLATION_CAPACITY = 1000.0
ISOLATION_AMOUNT = 0.001

LABEL_NODE = "qgpu.io/node"
LABEL_MODEL = "qgpu.io/gpu-model"
LABEL_COUNT = "qgpu.io/gpu-count"
LABEL_ISOLATION = "qgpu.io/isolation"
LABEL_GPU_MODEL_PREFIX = "qgpu.io/model."
LABEL_HOOK = "qgpu.io/worker-hook"

NODE_ENV = "QGPU_RAY_NODE"
FRACTION_ENV = "QGPU_RAY_FRACTION"
POLICY_ENV = "QGPU_RAY_POLICY"  # the GPU choice of work that binds in the worker
BIND_ENV = "QGPU_BIND"  # named in the interposer's message when a bind fails

_LABEL_VALUE_RE = re.compile(r"[^A-Za-z0-9_.-]")


def gpu_resource(kind: str, uuid: str) -> str:
    """Per-GPU resource name, e.g. ``qgpu-core/GPU-5f3c...``."""
    if kind not in GPU_KINDS:
        raise ValueError(f"unknown per-GPU resource kind {kind!r}")
    return f"{kind}/{uuid}"


def parse_gpu_resource(name: str) -> tuple[str, str] | None:
    """(kind, uuid) for a per-GPU resource name; None for anything else (group names too)."""
    kind, sep, uuid = name.partition("/")
    if not sep or kind not in GPU_KINDS or "_group_" in uuid or not uuid:
        return None
    return kind, uuid


def label_value(text: str) -> str:
    """A Ray label value: at most 63 characters of [A-Za-z0-9_.-]."""
    return _LABEL_VALUE_RE.sub("_", text)[:63]


def gpu_order(inventory: NodeInventory) -> list[str]:
    """UUIDs of the healthy GPUs in the order of Ray's GPU ids on the node (0, 1, ...)."""
    return [g.uuid for g in sorted(inventory.gpus, key=lambda g: g.index) if g.healthy]


def node_resources(inventory: NodeInventory) -> dict[str, float]:
    """The custom resources a node with these GPUs advertises to Ray (healthy GPUs only)."""
    gpus = [g for g in inventory.gpus if g.healthy]
    out: dict[str, float] = {
        TOTAL_CORE: float(100 * len(gpus)),
        TOTAL_MEMORY: float(sum(g.memory_gib for g in gpus)),
    }
    for gpu in gpus:
        out[gpu_resource(TOTAL_CORE, gpu.uuid)] = 100.0
        out[gpu_resource(TOTAL_MEMORY, gpu.uuid)] = float(gpu.memory_gib)
        out[gpu_resource(SLOTS, gpu.uuid)] = float(gpu.max_slices(inventory.max_slices_per_gpu))
    if gpus:
        for policy in IsolationPolicy:
            out[ISOLATION_PREFIX + policy.value] = ISOLATION_CAPACITY
    return out


def node_labels(inventory: NodeInventory, *, worker_hook: bool = True) -> dict[str, str]:
    """Labels describing the node's GPUs (usable in ``label_selector``)."""
    models = sorted({g.model for g in inventory.gpus})
    labels = {
        LABEL_NODE: label_value(inventory.name),
        LABEL_MODEL: label_value(models[0] if len(models) == 1 else "mixed"),
        LABEL_COUNT: str(len(inventory.gpus)),
        LABEL_ISOLATION: inventory.default_isolation.value,
    }
    if worker_hook:
        labels[LABEL_HOOK] = "ray"
    for gpu in inventory.gpus:
        labels[LABEL_GPU_MODEL_PREFIX + label_value(gpu.uuid)] = label_value(gpu.model)
    return labels
