"""The annotation protocol between extender, device plugin and node (JSON in annotations).

Owns the wire formats that outlive a process, so both sides can rebuild their state after a
restart from the apiserver alone:
- `Assignment` (pod annotation ``<prefix>/qgpu-assignment``): chosen by the extender and
  set by the Binding itself (in the same write as ``spec.nodeName``): node, per-container
  GPU(s), caps, isolation, and how many device IDs of each resource kubelet must hand out
  from each GPU.
- `Allocated` (pod annotation ``<prefix>/qgpu-allocated``): written by the device plugin as
  kubelet allocates: per container, which resources ("core", "memory") are claimed and
  with which of kubelet's device IDs.
- `PublishedInventory` (node annotation ``<prefix>/qgpu-inventory``): the node's GPUs.
- `NodeLock` (node annotation ``<prefix>/qgpu-node-lock``): holder and expiry (with an
  epoch annotation ``<prefix>/qgpu-node-epoch`` bumped by every lock).
- Device IDs: ``<gpu-uuid>_c<i>`` (100 per GPU) and ``<gpu-uuid>_m<i>`` (one per GiB); GPU
  UUIDs never contain ``_``, so the GPU of every ID kubelet hands out is known and kubelet's
  own accounting is exact per GPU.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from qgpu.errors import RuleViolation, first_violation
from qgpu.model import (
    WHOLE_GPU_CORE,
    GpuDevice,
    IsolationPolicy,
    NodeInventory,
)

_M = TypeVar("_M", bound=BaseModel)
Kind = Literal["core", "memory"]
KINDS: tuple[Kind, ...] = ("core", "memory")
_ID_TAG: dict[Kind, str] = {"core": "c", "memory": "m"}
_TAG_KIND: dict[str, Kind] = {v: k for k, v in _ID_TAG.items()}


def device_id(uuid: str, kind: Kind, i: int) -> str:
    return f"{uuid}_{_ID_TAG[kind]}{i}"


def parse_device_id(dev: str) -> tuple[str, Kind]:
    """(GPU UUID, kind) of a device ID; RuleViolation when it is not one of ours."""
    uuid, sep, tail = dev.rpartition("_")
    if not sep or not uuid or not tail or tail[0] not in _TAG_KIND or not tail[1:].isdigit():
        raise RuleViolation("deviceID", dev, "is not a qgpu device ID (<gpu-uuid>_c<n>|_m<n>)")
    return uuid, _TAG_KIND[tail[0]]


def ids_per_gpu(ids: Iterable[str]) -> tuple[set[Kind], dict[str, int]]:
    """Kinds present and the number of IDs per GPU UUID in a list of device IDs."""
    kinds: set[Kind] = set()
    count: Counter[str] = Counter()
    for dev in ids:
        uuid, kind = parse_device_id(dev)
        kinds.add(kind)
        count[uuid] += 1
    return kinds, dict(count)


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ContainerAssignment(_Wire):
    """One container's slice: GPU(s), per-GPU caps, and device IDs per GPU per resource."""

    gpus: list[str] = Field(min_length=1)
    core: int = Field(ge=1, le=WHOLE_GPU_CORE, description="per GPU")
    memory_gib: list[int] = Field(min_length=1, description="memory cap per GPU, GiB")
    isolation: IsolationPolicy
    devices: dict[Kind, dict[str, int]] = Field(
        description="resource -> GPU UUID -> device IDs kubelet hands out from that GPU"
    )

    @property
    def kinds(self) -> set[Kind]:
        return {k for k, per in self.devices.items() if sum(per.values()) > 0}


class Assignment(_Wire):
    node: str
    containers: dict[str, ContainerAssignment]
    bound_at: float = Field(description="unix time of the bind")
    lock_epoch: int = Field(
        default=0,
        ge=0,
        description="the node's lock epoch this bind held: binds to one node are serialized "
        "by its lock, so this is the order in which the node's kubelet sees its pods",
    )

    def dumps(self) -> str:
        return self.model_dump_json()


class Allocated(_Wire):
    containers: dict[str, list[Kind]] = Field(default_factory=dict)
    devices: dict[str, dict[Kind, list[str]]] = Field(
        default_factory=dict,
        description="container -> resource -> the device IDs kubelet allocated (sorted): a "
        "claimed container is recognised by them, never by its layout alone (claims written "
        "before this field have none and are never matched again)",
    )

    def with_claim(self, container: str, kind: Kind, ids: Iterable[str]) -> Allocated:
        now = dict(self.containers)
        now[container] = sorted(set(now.get(container, [])) | {kind})
        devices = {c: dict(per) for c, per in self.devices.items()}
        devices.setdefault(container, {})[kind] = sorted(ids)
        return Allocated(containers=now, devices=devices)

    def without(self, container: str, kinds: Iterable[Kind]) -> Allocated:
        """This claim with `container`'s claims of `kinds` withdrawn."""
        gone = set(kinds)
        now = {
            c: [k for k in ks if c != container or k not in gone]
            for c, ks in self.containers.items()
        }
        devices = {
            c: {k: ids for k, ids in per.items() if c != container or k not in gone}
            for c, per in self.devices.items()
        }
        return Allocated(
            containers={c: ks for c, ks in now.items() if ks},
            devices={c: per for c, per in devices.items() if per},
        )

    def claimed(self, container: str) -> set[Kind]:
        return set(self.containers.get(container, []))

    def claimed_ids(self, container: str, kind: Kind) -> list[str] | None:
        """The device IDs kubelet allocated to `container`'s `kind` (None: not recorded)."""
        return self.devices.get(container, {}).get(kind)


class PublishedInventory(_Wire):
    gpus: list[GpuDevice]
    max_slices_per_gpu: int = Field(ge=1, le=64)
    fixed_slices: bool = Field(
        default=False, description="max_slices_per_gpu is the count (not floor(GiB/4))"
    )
    published_at: float


class NodeLock(_Wire):
    """A node's bind lock: who holds it, until when, and (when the holder runs in a pod) the
    pod, so that a lock whose holder is provably gone can be taken over before it expires."""

    holder: str
    expires: float
    pod: str | None = None  # "<namespace>/<name>" of the holder's pod
    pod_uid: str | None = None


def _load(model: type[_M], text: str, what: str) -> _M:
    try:
        return model.model_validate(json.loads(text))
    except (json.JSONDecodeError, TypeError) as exc:
        raise RuleViolation(what, text[:80], f"is not valid JSON: {exc}") from exc
    except ValidationError as exc:
        v = first_violation(exc)
        raise RuleViolation(f"{what}: {v.field}", v.value, v.rule) from exc


def load_assignment(text: str) -> Assignment:
    return _load(Assignment, text, "assignment annotation")


def load_allocated(text: str | None) -> Allocated:
    return Allocated() if not text else _load(Allocated, text, "allocated annotation")


def load_inventory(text: str) -> PublishedInventory:
    return _load(PublishedInventory, text, "inventory annotation")


def load_lock(text: str) -> NodeLock:
    return _load(NodeLock, text, "node lock annotation")


def node_inventory(
    name: str,
    labels: dict[str, str],
    annotations: dict[str, str],
    inventory_key: str,
    policy_label: str,
) -> NodeInventory | None:
    """The NodeInventory a Node object publishes, or None when it publishes none.

    Raises RuleViolation naming the annotation or the label that is wrong."""
    text = annotations.get(inventory_key)
    if not text:
        return None
    inv = load_inventory(text)
    policy = labels.get(policy_label)
    return NodeInventory(
        name=name,
        gpus=inv.gpus,
        labels=dict(labels),
        max_slices_per_gpu=inv.max_slices_per_gpu,
        fixed_slices=inv.fixed_slices,
        default_isolation=IsolationPolicy.parse(policy, f"node label {policy_label}")
        if policy
        else IsolationPolicy.BEST_EFFORT,
    )


def split_ids(total: int, gpus: list[str]) -> dict[str, int]:
    """Spread `total` IDs over GPUs as evenly as possible (first GPUs take the remainder)."""
    base, extra = divmod(total, len(gpus))
    return {u: base + (1 if i < extra else 0) for i, u in enumerate(gpus)}
