"""Which pod container is kubelet allocating? Matching device IDs to pending assignments.

Kubelet's Allocate names device IDs only, never the pod. The extender wrote each pod's
assignment (per container: GPU(s) and how many IDs of each resource per GPU) before the
Binding, and our IDs name their GPU, so a call for N IDs of one resource, laid out per GPU
as in an assignment, matches the containers whose assignment has exactly that layout and
whose resource is not claimed yet. Among several, the order is:

1. a container whose other resource is already claimed (kubelet is mid-way through it);
2. a container of a pod that already has claims (kubelet admits one pod at a time);
3. the pod bound first (``lock_epoch``, then ``bound_at``: binds to one node are
   serialized by the node lock, whose epoch grows with every bind, and kubelet's watch
   delivers that node's pods in binding order), then the oldest pod (kubelet sorts a batch
   of new pods by creation time), then namespace/name.

Only pods whose ``spec.schedulerName`` is the qgpu scheduler's count: the extender binds
no other, so an assignment on another pod was written by its author. With assignment keys
(`k8s_bridge.assignment_mac`), only assignments whose MAC the extender wrote for this pod
and node count: a tenant's patch of its own bound pod, a copy of another pod's assignment,
or an assignment on a pod that bypassed the webhook is ignored, and the reason reported.

The claim is written to the pod (``<prefix>/qgpu-allocated``) with a resourceVersion
precondition, so plugin restarts lose nothing and two claims never take one container. It
records kubelet's device IDs: a claimed container is found again (kubelet repeating an
Allocate, PreStartContainer) only by exactly those IDs, so another container that asks for
the same layout cannot be handed a claimed container's slice.
Equal containers on different GPUs remain ambiguous only if kubelet admits them out of
binding order (a batch delivered at once, as after a kubelet restart), and a pod that
bypassed the extender is matched to a bound pod of its layout: kubelet's pod-resources API
shows both afterwards, and `k8s_bridge.deviceplugin.claim_check` withdraws such claims and
refuses the container's start; kubelet's own per-GPU accounting (device IDs) stays exact
in every case.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from k8s_bridge.assignment_mac import AssignmentKeys
from k8s_bridge.protocol import (
    Allocated,
    Assignment,
    ContainerAssignment,
    Kind,
    load_allocated,
    load_assignment,
)
from k8s_bridge.resources import ContainerRequest, Names, PodModel, pod_slice_requests
from qgpu.errors import QgpuError


@dataclass(frozen=True)
class Candidate:
    pod: PodModel
    assignment: Assignment
    allocated: Allocated  # the plugin's record merged with the pod's claim annotation
    container: str
    record: Allocated | None = None  # the plugin's own record of the pod's claims

    def recorded_ids(self, kind: Kind) -> list[str] | None:
        return None if self.record is None else self.record.claimed_ids(self.container, kind)

    @property
    def slice(self) -> ContainerAssignment:
        return self.assignment.containers[self.container]

    @property
    def uid(self) -> str:
        return self.pod.metadata.uid


Rejected = Callable[[PodModel, str], None]


def pending_pods(
    names: Names,
    node: str,
    pod_objs: list[dict[str, Any]],
    scheduler_name: str,
    keys: AssignmentKeys | None = None,
    rejected: Rejected | None = None,
    recorded: Mapping[str, Allocated] | None = None,
) -> list[Candidate]:
    """Every (pod, container) assigned to `node` on a live pod of `scheduler_name`, claimed or
    not. A pod of another scheduler was never bound by the extender: an assignment on it is
    forged (its author wrote the annotation and spec.nodeName), so it is not a candidate.
    With `keys`, an assignment on this node whose MAC is missing or wrong is not one either,
    and `rejected(pod, reason)` is told. `recorded` (pod UID -> claims, the plugin's own
    record) wins over the pod's claim annotation, which only adds what it lacks."""
    out: list[Candidate] = []
    for obj in pod_objs:
        pod = PodModel.model_validate(obj)
        if pod.terminated or pod.metadata.deletion_timestamp:
            continue
        if pod.spec.scheduler_name != scheduler_name:
            continue
        text = pod.annotations.get(names.assignment_annotation)
        if not text:
            continue
        try:
            assignment = load_assignment(text)
            allocated = load_allocated(pod.annotations.get(names.allocated_annotation))
        except QgpuError:
            continue
        if assignment.node != node:
            continue
        if keys is not None:
            mac = pod.annotations.get(names.assignment_mac_annotation)
            why = keys.check(pod.metadata.uid, node, text, mac)
            if why is not None:
                if rejected is not None:
                    rejected(pod, why)
                continue
        try:
            asked = {r.container: r for r in pod_slice_requests(names, pod)}
        except QgpuError:
            continue
        record = (recorded or {}).get(pod.metadata.uid)
        allocated = merge_claims(allocated, record)
        for cname, given in assignment.containers.items():
            # the assignment must be of what the pod's own container asks for: one forged on
            # a pod that asks for less (or nothing) is not a candidate
            if cname in asked and _grants(given, asked[cname]):
                out.append(Candidate(pod, assignment, allocated, cname, record))
    return out


def claim_patch(names: Names, resource_version: str | None, text: str | None) -> dict[str, Any]:
    """The merge patch that sets a pod's claim annotation to `text`, only if the pod is
    still at `resource_version` (else the apiserver answers 409: read it again)."""
    return {
        "metadata": {
            "resourceVersion": resource_version,
            "annotations": {names.allocated_annotation: text},
        }
    }


def merge_claims(annotated: Allocated, record: Allocated | None) -> Allocated:
    """The plugin's record of a pod's claims, plus what only the annotation has (a claim
    the plugin wrote to the apiserver but died before recording, or an older plugin's):
    a tenant can add claims to its own pod this way, never remove or change recorded ones."""
    if record is None:
        return annotated
    containers = {c: set(kinds) for c, kinds in record.containers.items()}
    devices = {c: dict(per) for c, per in record.devices.items()}
    for c, kinds in annotated.containers.items():
        have = containers.setdefault(c, set())
        for k in kinds:
            if k in have:
                continue
            have.add(k)
            ids = annotated.claimed_ids(c, k)
            if ids is not None:
                devices.setdefault(c, {})[k] = ids
    return Allocated(
        containers={c: sorted(k) for c, k in containers.items()}, devices=devices
    )


def _grants(given: ContainerAssignment, asked: ContainerRequest) -> bool:
    """Whether `given` is the slice `asked` requests: its GPU count, per-GPU core and, for a
    request in GiB, its memory on each GPU."""
    req = asked.request
    if req.gpu_count != len(given.gpus) or given.core != req.core_per_gpu:
        return False
    per_gpu = req.memory_gib_per_gpu
    return per_gpu is None or all(m == per_gpu for m in given.memory_gib)


def _rank(c: Candidate, kind: Kind) -> tuple[int, int, int, float, str, str]:
    other = c.allocated.claimed(c.container) - {kind}
    in_progress = 0 if other else 1
    pod_started = 0 if c.allocated.containers else 1
    return (
        in_progress,
        pod_started,
        c.assignment.lock_epoch,
        c.assignment.bound_at,
        c.pod.metadata.creation_timestamp or "",
        c.pod.key,
    )


def matching(
    candidates: list[Candidate], kind: Kind, per_gpu: dict[str, int] | None, size: int
) -> list[Candidate]:
    """Unclaimed containers whose `kind` layout equals `per_gpu` (or totals `size`), best first."""
    found = []
    for c in candidates:
        layout = c.slice.devices.get(kind) or {}
        if sum(layout.values()) == 0 or kind in c.allocated.claimed(c.container):
            continue
        if per_gpu is not None and layout != per_gpu:
            continue
        if per_gpu is None and sum(layout.values()) != size:
            continue
        found.append(c)
    return sorted(found, key=lambda c: _rank(c, kind))


def claimed(candidates: list[Candidate], kind: Kind, size: int) -> list[Candidate]:
    """Containers that already claimed `size` IDs of `kind` and recorded them (the
    GetPreferredAllocation of a container whose Allocate answer was lost), best first."""
    found = [
        c
        for c in candidates
        if kind in c.allocated.claimed(c.container)
        and len(c.allocated.claimed_ids(c.container, kind) or []) == size
    ]
    return sorted(found, key=lambda c: _rank(c, kind))


def claimed_match(candidates: list[Candidate], kind: Kind, ids: list[str]) -> Candidate | None:
    """The container that claimed exactly these device IDs of `kind` (kubelet repeating an
    Allocate from its checkpoint, PreStartContainer). Never by layout alone: another
    container asking for the same layout gets other IDs from kubelet."""
    want = sorted(ids)
    # the plugin's own record first: IDs that only a pod's annotation names could have been
    # written there by the pod's owner
    for c in candidates:
        if c.recorded_ids(kind) == want:
            return c
    for c in candidates:
        if kind in c.allocated.claimed(c.container) and (
            c.allocated.claimed_ids(c.container, kind) == want
        ):
            return c
    return None
