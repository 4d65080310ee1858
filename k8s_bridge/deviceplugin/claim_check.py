"""Checking the plugin's claims against the container kubelet actually gave the device IDs.

A claim (`k8s_bridge.deviceplugin.claims`) is the plugin's guess, at Allocate, of which
pod container kubelet is allocating: kubelet names device IDs only. Two cases guess wrong:
a pod that reached kubelet without an assignment the plugin takes (it bypassed the
extender: ``spec.nodeName`` preset, ``pods/binding`` RBAC) is matched to a bound, not yet
admitted pod of the same layout and handed its slice; two bound pods of one layout on
different GPUs admitted out of binding order take each other's slices.

Kubelet records a container's devices when Allocate returns and lists them on its
pod-resources API (`k8s_bridge.deviceplugin.pod_resources`). `ClaimCheck` uses that:

- `before_match`: before matching an Allocate (or GetPreferredAllocation), every claim not
  yet confirmed is looked up; one whose IDs kubelet lists under another container is
  withdrawn (annotation and the plugin's record), so the pod it was made for can be
  admitted with its own slice, and that other container is never matched again (kubelet
  has allocated it already, under a wrong claim);
- `at_pre_start`: at PreStartContainer the IDs must be listed under the claimed container,
  else the start is refused (the Allocate answer, the other pod's slice, is already in
  kubelet and cannot be changed: refusing is the only safe answer) and the wrong claims of
  that container withdrawn. A confirmed claim is not looked up again.

Claims whose IDs kubelet lists under no container are left alone (kubelet records them
right after Allocate returns: an admission in flight).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from k8s_bridge.deviceplugin.claim_record import ClaimRecord
from k8s_bridge.deviceplugin.claims import Candidate, claim_patch
from k8s_bridge.deviceplugin.pod_resources import ContainerRef, PodResourcesClient, owner_in
from k8s_bridge.kube import Conflict, Kube, KubeError
from k8s_bridge.protocol import Kind, load_allocated
from k8s_bridge.resources import Names
from qgpu.errors import QgpuError

log = logging.getLogger(__name__)

Held = dict[tuple[ContainerRef, str], frozenset[str]]


class Misclaimed(Exception):
    """PreStartContainer for IDs kubelet gave another container than the claimed one."""


def ref_of(c: Candidate) -> ContainerRef:
    meta = c.pod.metadata
    return ContainerRef(namespace=meta.namespace, pod=meta.name, container=c.container)


class ClaimCheck:
    """The confirmed claims, the containers kubelet allocated under a wrong claim, and the
    withdrawal of wrong claims. Callers hold the plugin's allocation lock."""

    def __init__(
        self,
        client: PodResourcesClient,
        kube: Kube,
        names: Names,
        record: ClaimRecord,
        retries: int,
    ) -> None:
        self.client = client
        self.kube = kube
        self.names = names
        self.record = record
        self.retries = retries
        self._confirmed: set[tuple[str, str, Kind]] = set()  # (pod uid, container, kind)
        self._taken: set[tuple[ContainerRef, Kind]] = set()  # allocated under a wrong claim

    def resource(self, kind: Kind) -> str:
        return self.names.core if kind == "core" else self.names.memory

    def forget_gone(self, candidates: list[Candidate]) -> None:
        live = {c.uid for c in candidates}
        refs = {ref_of(c) for c in candidates}
        self._confirmed = {e for e in self._confirmed if e[0] in live}
        self._taken = {e for e in self._taken if e[0] in refs}

    def taken(self, c: Candidate, kind: Kind) -> bool:
        """kubelet allocated this container's `kind` already (under another's claim)."""
        return (ref_of(c), kind) in self._taken

    def before_match(self, candidates: list[Candidate]) -> bool:
        """Withdraw the unconfirmed claims kubelet shows under another container; True
        when any was withdrawn (the candidates must then be read again)."""
        open_claims = [
            (c, k)
            for c in candidates
            for k in sorted(c.allocated.claimed(c.container))
            if (c.uid, c.container, k) not in self._confirmed
            and c.allocated.claimed_ids(c.container, k)
        ]
        if not open_claims:
            return False
        held = self.client.devices()
        wrong: dict[tuple[str, str], tuple[Candidate, set[Kind], ContainerRef]] = {}
        for c, k in open_claims:
            owner = owner_in(held, self.resource(k), c.allocated.claimed_ids(c.container, k) or [])
            if owner is None:
                continue
            if owner == ref_of(c):
                self._confirmed.add((c.uid, c.container, k))
            else:
                wrong.setdefault((c.uid, c.container), (c, set(), owner))[1].add(k)
        for c, kinds, owner in wrong.values():
            self._withdraw(c, kinds, owner)
        return bool(wrong)

    def at_pre_start(self, c: Candidate | None, kind: Kind, ids: list[str]) -> ContainerRef:
        """The container kubelet gave `ids` to; `Misclaimed` (after withdrawing `c`'s
        wrong claims) when that is not `c`'s container; LookupError when kubelet lists
        these IDs under no container."""
        held = self.client.devices()
        owner = owner_in(held, self.resource(kind), ids)
        if owner is None:
            raise LookupError(
                f"kubelet's pod-resources API lists no container holding exactly these {kind} "
                "IDs"
            )
        if c is None:
            return owner
        if owner == ref_of(c):
            self._confirmed.add((c.uid, c.container, kind))
            return owner
        kinds = {kind} | {
            k
            for k in c.allocated.claimed(c.container)
            if owner_in(held, self.resource(k), c.allocated.claimed_ids(c.container, k) or [])
            not in (None, ref_of(c))
        }
        self._withdraw(c, kinds, owner)
        raise Misclaimed(
            f"kubelet gave these {kind} IDs to {owner} (its pod-resources API), but they were "
            "claimed for another pod's container, whose slice this container would get: "
            "refused, and that claim withdrawn (details in the device plugin's log)"
        )

    def _withdraw(self, c: Candidate, kinds: set[Kind], owner: ContainerRef) -> None:
        """Remove `c`'s claims of `kinds` from the pod's annotation and the plugin's record."""
        log.warning(
            "withdrawing the %s claim(s) of %s/%s (uid %s): kubelet gave those device IDs to "
            "%s (pod-resources API), which may not start with that slice",
            ",".join(sorted(kinds)),
            c.pod.key,
            c.container,
            c.uid,
            owner,
        )
        for k in kinds:
            self._taken.add((owner, k))
            self._confirmed.discard((c.uid, c.container, k))
        meta = c.pod.metadata
        self._patch(meta.namespace, meta.name, c.uid, lambda text: _without(text, c, kinds))
        recorded = self.record.get(c.uid)
        if recorded is not None:
            try:
                self.record.put(c.uid, recorded.without(c.container, kinds))
            except OSError as exc:
                log.warning("cannot update the claim record for %s: %s", c.pod.key, exc)

    def _patch(
        self, namespace: str, name: str, uid: str, change: Callable[[str | None], str | None]
    ) -> None:
        ann = self.names.allocated_annotation
        for _ in range(self.retries):
            try:
                pod = self.kube.get_pod(namespace, name)
            except KubeError as exc:
                log.warning("cannot read pod %s/%s to withdraw a claim: %s", namespace, name, exc)
                return
            meta = pod.get("metadata") or {}
            if meta.get("uid") != uid:
                return
            old = (meta.get("annotations") or {}).get(ann)
            new = change(old)
            if new == old:
                return
            try:
                self.kube.patch_pod(
                    namespace, name, claim_patch(self.names, meta.get("resourceVersion"), new)
                )
                return
            except Conflict:
                continue
            except KubeError as exc:
                log.warning("cannot withdraw the claim on %s/%s: %s", namespace, name, exc)
                return


def _without(text: str | None, c: Candidate, kinds: Iterable[Kind]) -> str | None:
    try:
        allocated = load_allocated(text)
    except QgpuError:
        return text  # a malformed annotation makes the pod no candidate anyway
    return allocated.without(c.container, kinds).model_dump_json()
