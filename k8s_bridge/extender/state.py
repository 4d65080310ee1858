"""The extender's in-memory view: nodes' GPUs and every assigned slice, in a ClusterState.

Owns the scheduling decisions the extender makes, all through `qgpu.placement.Engine`:
- `filter_nodes`: which of the given nodes can take the pod (every container at once),
  with a reason per node that cannot;
- `score_nodes`: 0..10 per node from the node-level policy (pod annotation override or
  the configured default);
- `assume`: hold the GPU(s) of the node prioritize ranked first until bind (or a short
  expiry), so the next pod's filter sees a pod whose asynchronous bind is in flight;
- `reserve` / `unreserve`: at bind, keep that assumption when kube-scheduler chose the same
  node, or choose GPU(s) on the bound node with the GPU-level policy; hold them under the
  pod's UID until released.

The state of record is the apiserver: node inventories (``<prefix>/qgpu-inventory``) and
pod assignments (``<prefix>/qgpu-assignment``). `load_nodes` / `load_pods` rebuild
everything from them after a restart; `apply_pod` / `release_pod` follow the pod watch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from itertools import compress

import numpy as np

from k8s_bridge.assignment_mac import AssignmentKeys
from k8s_bridge.extender.models import MAX_SCORE, HostPriorityTable
from k8s_bridge.protocol import (
    Assignment,
    ContainerAssignment,
    load_assignment,
    node_inventory,
    split_ids,
)
from k8s_bridge.resources import (
    TERMINATED_PHASES,
    ContainerRequest,
    Names,
    PodModel,
    pod_slice_requests,
)
from qgpu.errors import NoFit, QgpuError, RuleViolation
from qgpu.model import (
    NodeInventory,
    PlacementPolicy,
    SliceRequest,
    SlicesPerGpu,
)
from qgpu.placement import CandidateView, ClusterState, Engine, Policy

log = logging.getLogger(__name__)


@dataclass
class PodRecord:
    """An assigned pod as the extender holds it."""

    uid: str
    namespace: str
    name: str
    node: str
    assignment: Assignment
    resource_version: int = 0
    applied: bool = True
    assignment_text: str = ""  # the annotation as written (events carrying it change nothing)


@dataclass
class Assumed:
    """GPUs held for a pod between prioritize and bind (a hint: dropped whenever in the way)."""

    node: str
    expires: float
    assignment: Assignment


@dataclass
class FilterResult:
    nodes: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    unresolvable: dict[str, str] = field(default_factory=dict)
    rules: Counter[str] = field(default_factory=Counter)  # refused nodes per rule (metrics)


NO_INVENTORY = "node publishes no qgpu GPU inventory (is the qgpu device plugin running?)"


def _why(cr: ContainerRequest, rule: str | None) -> str:
    """Why a node cannot take a container: the same text for every node failing the same
    way, so kube-scheduler's event counts them ("0/1000 nodes are available: 150 qgpu:
    ...") instead of listing a line per node."""
    req = cr.request
    n = req.gpu_count
    gpus = "no GPU" if n == 1 else f"fewer than {n} GPUs"
    memory = (
        f"qgpu-memory-percentage={req.memory_percent}"
        if req.memory_percent is not None
        else f"qgpu-memory={req.memory_gib} GiB"
    )
    if rule == "GPU count":
        text = "node has no GPUs" if n == 1 else f"node has fewer than {n} GPUs"
    elif rule == "unhealthy":
        text = f"{gpus} healthy"
    elif rule == "model":
        text = f"{gpus} of model {'|'.join(req.model_names)}"
    elif rule == "excluded":
        text = f"{gpus} allowed by the pod's GPU include/exclude list"
    elif req.is_whole_gpu and rule == "memory":
        text = f"{gpus} with {req.memory_gib} GiB"
    elif req.is_whole_gpu:
        text = "no empty GPU" if n == 1 else f"fewer than {n} empty GPUs"
    elif rule == "slice limit":
        text = "every GPU is at its slice limit"
    elif rule == "core":
        text = f"no GPU with qgpu-core={req.core} free"
    elif rule == "memory" and req.memory_percent is not None:
        text = f"no GPU with qgpu-core={req.core} and {req.memory_percent}% of its memory free"
    else:
        text = f"no GPU with qgpu-core={req.core} and {memory} free"
    return f"qgpu: container {cr.container}: {text}"


def slice_id(uid: str, container: str) -> str:
    return f"{uid}/{container}"


def _rv(text: str | None) -> int:
    try:
        return int(text or 0)
    except ValueError:
        return 0


POSITIONS_MEMO = 8  # node-name lists whose positions are remembered (see `_positions`)


class ExtenderState:
    """Nodes, held slices and the placement engine, behind one lock."""

    def __init__(
        self,
        names: Names,
        node_policy: PlacementPolicy | str | None = None,
        gpu_policy: PlacementPolicy | str | None = None,
        assume_ttl_s: float = 10.0,
        keys: AssignmentKeys | None = None,
    ) -> None:
        self.names = names
        self.assume_ttl_s = assume_ttl_s
        self.keys = keys  # with keys: a held pod's assignment changes only to a signed one
        self.assumed: dict[str, Assumed] = {}
        self.node_policy_name = PlacementPolicy.parse(node_policy) if node_policy else None
        self.gpu_policy_name = PlacementPolicy.parse(gpu_policy) if gpu_policy else None
        self.lock = threading.RLock()
        self.inventories: dict[str, NodeInventory] = {}
        self.broken: dict[str, str] = {}  # node -> why its inventory or qgpu labels are unusable
        self.pods: dict[str, PodRecord] = {}
        self._new_engine([])
        self._node_sources: dict[str, tuple[str | None, tuple[tuple[str, str], ...]]] = {}
        self._last_bound_at: dict[str, float] = {}
        self._positions_of: ClusterState | None = None
        self._positions_memo: dict[str, np.ndarray] = {}
        self._priority_table: tuple[ClusterState, HostPriorityTable] | None = None
        # an `assume` prioritize asked for, not made yet (`hold_after_reply`)
        self._pending_hold: tuple[str, list[ContainerRequest], str] | None = None

    # -- construction ----------------------------------------------------------------

    def _new_engine(self, nodes: list[NodeInventory]) -> None:
        self.state = ClusterState(nodes)
        self.engine = Engine(self.state, self.node_policy_name, self.gpu_policy_name)

    def load_nodes(self, node_objs: list[dict]) -> None:
        """Replace the node set from Node objects (those publishing an inventory)."""
        invs: dict[str, NodeInventory] = {}
        broken: dict[str, str] = {}
        for obj in node_objs:
            inv, problem = self._inventory_of(obj)
            if inv is not None:
                invs[inv.name] = inv
            elif problem is not None:
                broken[obj["metadata"]["name"]] = problem
        with self.lock:
            self.inventories = invs
            self.broken = broken
            self._node_sources = {}
            self._rebuild()

    def update_node(self, obj: dict, deleted: bool = False) -> bool:
        """Follow one Node event; True when the node set or a node's GPUs changed."""
        meta = obj["metadata"]
        name = meta["name"]
        # Most Node events are our own lock writes or kubelet status: skip them cheaply.
        source = (
            None
            if deleted
            else (
                (meta.get("annotations") or {}).get(self.names.inventory_annotation),
                tuple(sorted((meta.get("labels") or {}).items())),
            )
        )
        if source is not None and self._node_sources.get(name) == source:
            return False
        inv, problem = (None, None) if deleted else self._inventory_of(obj)
        with self.lock:
            if problem is None:
                self.broken.pop(name, None)
            else:
                self.broken[name] = problem
            if source is None:
                self._node_sources.pop(name, None)
            else:
                self._node_sources[name] = source
            old = self.inventories.get(name)
            if inv == old:
                return False
            if inv is None:
                self.inventories.pop(name, None)
            else:
                self.inventories[name] = inv
            self._rebuild()
            return True

    def _inventory_of(self, obj: dict) -> tuple[NodeInventory | None, str | None]:
        """The node's inventory, or None and why it cannot be used (None: it has none)."""
        meta = obj.get("metadata") or {}
        labels = meta.get("labels") or {}
        try:
            slices = labels.get(self.names.slices_label)
            if slices:
                SlicesPerGpu.parse(slices, f"node label {self.names.slices_label}")
            return node_inventory(
                meta["name"],
                labels,
                meta.get("annotations") or {},
                self.names.inventory_annotation,
                self.names.policy_label,
            ), None
        except QgpuError as exc:
            log.warning("node %s: ignoring its qgpu inventory: %s", meta.get("name"), exc)
            return None, f"qgpu cannot use this node: {exc}"

    def _rebuild(self) -> None:
        self._new_engine(list(self.inventories.values()))
        self.assumed = {}  # their slices went with the old state
        for rec in self.pods.values():
            rec.applied = self._apply(rec)

    def _apply(self, rec: PodRecord) -> bool:
        """Hold a bound pod's assignment; assumptions on its node give way if needed."""
        if rec.node not in self.state.node_index:
            return False
        if self._try_apply(rec, quiet=True):
            return True
        self._drop_assumed_on(rec.node)
        return self._try_apply(rec, quiet=False)

    def _try_apply(self, rec: PodRecord, quiet: bool) -> bool:
        applied: list[str] = []
        try:
            for cname, ca in rec.assignment.containers.items():
                sid = slice_id(rec.uid, cname)
                ids = [self.state.uuid_index[u] for u in ca.gpus]
                self.state.apply(sid, ids, ca.core, ca.memory_gib)
                applied.append(sid)
        except (KeyError, ValueError) as exc:
            for sid in applied:
                self.state.release(sid)
            if not quiet:
                log.error(
                    "pod %s/%s: its assignment cannot be held: %s", rec.namespace, rec.name, exc
                )
            return False
        return True

    def load_pods(self, pod_objs: list[dict]) -> None:
        """Replace all held slices with the assignments found on these pods."""
        with self.lock:
            self.pods = {}
            for obj in pod_objs:
                rec = self._record_of(obj)
                if rec is not None:
                    self.pods[rec.uid] = rec
            self._rebuild()

    def _record_of(self, obj: dict) -> PodRecord | None:
        pod = PodModel.model_validate(obj)
        text = pod.annotations.get(self.names.assignment_annotation)
        if not text or pod.terminated or not pod.metadata.uid:
            return None
        try:
            assignment = load_assignment(text)
        except QgpuError as exc:
            log.error("pod %s: unreadable assignment: %s", pod.key, exc)
            return None
        return PodRecord(
            pod.metadata.uid,
            pod.metadata.namespace,
            pod.metadata.name,
            assignment.node,
            assignment,
            _rv(pod.metadata.resource_version),
            assignment_text=text,
        )

    def apply_pod(self, obj: dict) -> None:
        """Follow a pod event: hold a new assignment, release a finished or cleared one."""
        if self._unchanged(obj):
            return
        pod = PodModel.model_validate(obj)
        uid = pod.metadata.uid
        rv = _rv(pod.metadata.resource_version)
        with self.lock:
            known = self.pods.get(uid)
            if known is not None and rv and rv < known.resource_version:
                return  # an event older than our own last write of this pod
            rec = self._record_of(obj)
            if rec is None:
                self.release_pod(uid)
                return
            if known is not None and known.assignment == rec.assignment:
                known.resource_version = max(known.resource_version, rv)
                return
            if known is not None and self.keys is not None:
                mac = pod.annotations.get(self.names.assignment_mac_annotation)
                why = self.keys.check(uid, rec.node, rec.assignment_text or "", mac)
                if why is not None:
                    # rewritten after our bind (the device plugin refuses it too): keep
                    # holding what we bound, so that GPU is not handed to another pod
                    log.warning(
                        "pod %s: keeping the assignment this extender bound; the pod's "
                        "new one is not signed: %s",
                        pod.key,
                        why,
                    )
                    known.resource_version = max(known.resource_version, rv)
                    return
            self.release_pod(uid)
            rec.applied = self._apply(rec)
            self.pods[uid] = rec

    def _unchanged(self, obj: dict) -> bool:
        """A running pod whose assignment text is exactly the one we hold (most pod events:
        our own Binding, kubelet's status updates): nothing to parse or do."""
        meta = obj.get("metadata")
        if not isinstance(meta, dict):
            return False
        known = self.pods.get(meta.get("uid") or "")
        if known is None or not known.assignment_text:
            return False
        status = obj.get("status")
        phase = status.get("phase") if isinstance(status, dict) else None
        annotations = meta.get("annotations")
        text = annotations.get(self.names.assignment_annotation) if annotations else None
        if phase in TERMINATED_PHASES or text != known.assignment_text:
            return False
        with self.lock:
            if self.pods.get(known.uid) is known:
                known.resource_version = max(
                    known.resource_version, _rv(meta.get("resourceVersion"))
                )
        return True

    def release_pod(self, uid: str, resource_version: int = 0) -> bool:
        with self.lock:
            rec = self.pods.get(uid)
            if rec is None or (resource_version and resource_version < rec.resource_version):
                return False
            del self.pods[uid]
            for cname in rec.assignment.containers:
                self.state.release(slice_id(uid, cname))
            return True

    def resync_node(self, node: str, pod_objs: list[dict]) -> None:
        """Replace what is held on `node` with the assignments of these pods."""
        with self.lock:
            self._drop_assumed_on(node)
            for uid in [u for u, r in self.pods.items() if r.node == node]:
                self.release_pod(uid)
            for obj in pod_objs:
                rec = self._record_of(obj)
                if rec is not None and rec.node == node:
                    self.release_pod(rec.uid)
                    rec.applied = self._apply(rec)
                    self.pods[rec.uid] = rec

    # -- decisions -------------------------------------------------------------------

    def requests(self, pod: PodModel) -> list[ContainerRequest]:
        return pod_slice_requests(self.names, pod)

    def observe(self, reqs: list[ContainerRequest]) -> None:
        """Count a pod's containers in the policies' request mix (once per pod: `_place`
        does not count them again)."""
        with self.lock:
            for cr in reqs:
                self.engine.observe(cr.request)

    def _node_policy(self, req: SliceRequest) -> Policy:
        # the engine's own instance: prioritize scores with the policy (and the request mix
        # it has learnt) that will decide the placement
        return self.engine.node_policy_for(req)

    def _on_node(self, req: SliceRequest, node: str) -> SliceRequest:
        """The same request, restricted to the GPUs of one node."""
        inv = self.inventories[node]
        mine = [g.uuid for g in inv.gpus]
        if req.include_uuids:
            mine = [u for u in mine if u in set(req.include_uuids)]
        if not mine:
            raise NoFit(f"no GPU on node {node} is in the pod's include list", {})
        return req.model_copy(update={"include_uuids": mine})

    def filter_nodes(
        self, reqs: list[ContainerRequest], node_names: list[str], uid: str = ""
    ) -> FilterResult:
        out = FilterResult()
        with self.lock:
            self._settle()
            self._expire_assumed()
            self._drop_assumed(uid)  # a pod scheduled again competes without its old hint
            s = self.state
            pos = self._positions(node_names)
            known = pos >= 0
            every = bool(known.all())
            if not every:
                for j in np.flatnonzero(~known).tolist():  # preemption cannot help here
                    name = node_names[j]
                    problem = self.broken.get(name)
                    out.unresolvable[name] = problem or NO_INVENTORY
                    out.rules["broken node" if problem else "no inventory"] += 1
                if not known.any():
                    return out
            idx = pos[known]
            ok = np.ones(len(idx), dtype=bool)
            why: dict[int, str] = {}
            for cr in reqs:
                node_fit = self.engine.node_fit(cr.request)
                fits = node_fit.fits[idx]
                failing = np.flatnonzero(ok & ~fits)
                if len(failing):
                    rules = node_fit.rules[idx[failing]].tolist()
                    texts = {rule: _why(cr, rule) for rule in set(rules)}
                    for j, rule in zip(failing.tolist(), rules, strict=True):
                        why[j] = texts[rule]
                    out.rules.update(rules)
                ok &= fits
            if len(reqs) > 1:
                for j in np.flatnonzero(ok):
                    problem = self._fits_together(reqs, s.nodes[int(idx[j])].name)
                    if problem:
                        ok[j] = False
                        why[int(j)] = problem
                        out.rules["containers together"] += 1
            known_names = node_names if every else list(compress(node_names, known))
            out.nodes = list(known_names) if ok.all() else list(compress(known_names, ok.tolist()))
            for j, problem in why.items():
                out.failed[known_names[j]] = problem
        return out

    def _positions(self, node_names: list[str]) -> np.ndarray:
        """Each name's node index in the state (-1: not a qgpu node), read-only.

        kube-scheduler sends the same lists again and again (all nodes to filter; the nodes
        that passed to prioritize), so the answer is remembered for the last few lists, keyed
        by the names joined into one string: one join and one hash instead of a dictionary
        lookup per name. The memory belongs to the state object and goes with it when the
        node set changes.
        """
        state = self.state
        if state is not self._positions_of:
            self._positions_of, self._positions_memo = state, {}
        memo = self._positions_memo
        key = "\n".join(node_names)
        if key.count("\n") != len(node_names) - 1:
            key = ""  # a name with a newline in it (no valid node name has one): not memoized
        hit = memo.pop(key, None) if key else None
        if hit is None:
            index = state.node_index
            try:
                hit = np.fromiter(map(index.__getitem__, node_names), np.int64, len(node_names))
            except KeyError:  # some names are not qgpu nodes
                get = index.get
                hit = np.fromiter((get(n, -1) for n in node_names), np.int64, len(node_names))
            hit.flags.writeable = False
            if len(memo) >= POSITIONS_MEMO:
                del memo[next(iter(memo))]  # the least recently used
        if key:
            memo[key] = hit
        return hit

    def priority_list_json(self, node_names: list[str], scores: np.ndarray) -> bytes:
        """The ``HostPriorityList`` reply for these names and their 0..10 scores."""
        with self.lock:
            state = self.state
            if self._priority_table is None or self._priority_table[0] is not state:
                names = [node.name for node in state.nodes]
                self._priority_table = (state, HostPriorityTable(names))
            table = self._priority_table[1]
            positions = self._positions(node_names)
        return table.dumps(node_names, positions, scores)

    def _fits_together(self, reqs: list[ContainerRequest], node: str) -> str | None:
        placed: list[str] = []
        try:
            for cr in reqs:
                sid = f"__probe__/{cr.container}"
                req = self._on_node(cr.request, node)
                try:
                    self.state.apply_decision(sid, self.engine.decide(req), req)
                except NoFit as exc:
                    return f"containers do not fit together: {cr.container}: {exc}"
                placed.append(sid)
            return None
        finally:
            for sid in placed:
                self.state.release(sid)

    def score_nodes(self, reqs: list[ContainerRequest], node_names: list[str]) -> np.ndarray:
        """0..10 per node (int64), in the order given (nodes we cannot score get 0)."""
        out = np.zeros(len(node_names), dtype=np.int64)
        if not reqs:
            return out
        with self.lock:
            self._settle()
            s = self.state
            pos = self._positions(node_names)
            known = pos >= 0
            if not known.any():
                return out
            req = reqs[0].request
            mask, memory, _ = self.engine.candidates(req, explain=False)
            # frag scores one node per group of identical nodes itself (`qgpu.frag`)
            view = CandidateView(s, req, mask, req.core_per_gpu, memory, pos[known])
            raw = np.asarray(self._node_policy(req).node_scores(view), dtype=float)
        # Policies may score a node that cannot take the request -inf (frag does): 0 here.
        finite = np.isfinite(raw)
        norm = np.where(raw == np.inf, MAX_SCORE, 0).astype(np.int64)
        if finite.any():
            lo, hi = float(raw[finite].min()), float(raw[finite].max())
            if hi - lo <= 1e-12:
                norm[finite] = MAX_SCORE
            else:
                scaled = (raw[finite] - lo) / (hi - lo) * MAX_SCORE
                norm[finite] = np.rint(scaled).astype(np.int64)
        out[known] = norm
        return out

    def _place(self, uid: str, reqs: list[ContainerRequest], node: str) -> Assignment:
        """Choose GPU(s) on `node` for every container and apply them (all or nothing)."""
        if node not in self.inventories:
            raise NoFit(f"node {node}: {self.broken.get(node) or NO_INVENTORY}", {})
        inv = self.inventories[node]
        containers: dict[str, ContainerAssignment] = {}
        placed: list[str] = []
        try:
            for cr in reqs:
                sid = slice_id(uid, cr.container)
                decision = self.engine.place(sid, self._on_node(cr.request, node), observe=False)
                placed.append(sid)
                gpus = list(decision.gpu_uuids)
                devices: dict = {"core": dict.fromkeys(gpus, decision.core_per_gpu)}
                if cr.request.memory_gib is not None:
                    if cr.request.is_whole_gpu:
                        devices["memory"] = split_ids(cr.request.memory_gib, gpus)
                    else:
                        devices["memory"] = {gpus[0]: cr.request.memory_gib}
                containers[cr.container] = ContainerAssignment(
                    gpus=gpus,
                    core=decision.core_per_gpu,
                    memory_gib=list(decision.memory_gib_per_gpu),
                    isolation=cr.request.effective_isolation(inv.default_isolation),
                    devices=devices,
                )
        except (NoFit, RuleViolation):
            for sid in placed:
                self.state.release(sid)
            raise
        return Assignment(node=node, containers=containers, bound_at=time.time())

    def assume(self, uid: str, reqs: list[ContainerRequest], node: str) -> bool:
        """Hold the pod's GPUs on the node prioritize ranked first, until bind or expiry.

        kube-scheduler binds asynchronously: without this, the next pod's filter would not
        see a pod whose bind is still in flight and could be sent to the same last GPU.
        """
        with self.lock:
            self._settle()
            return self._assume(uid, reqs, node)

    def hold_after_reply(self, uid: str, reqs: list[ContainerRequest], node: str) -> None:
        """`assume`, made by `settle` -- after prioritize's reply has left, which is when
        the HTTP layer calls it -- or first thing in the next call that decides anything
        (`filter_nodes`, `score_nodes`, `assume`, `reserve`), whichever comes first.

        kube-scheduler waits for prioritize's answer before it goes on, so the hold is
        taken off that wait; every later decision still sees it, as if it had been made
        before the reply."""
        with self.lock:
            self._settle()
            self._pending_hold = (uid, reqs, node)

    def settle(self) -> None:
        """Make the hold `hold_after_reply` left pending (nothing if none is)."""
        with self.lock:
            self._settle()

    def _settle(self) -> None:
        pending = self._pending_hold
        if pending is None:
            return
        self._pending_hold = None
        try:
            self._assume(*pending)
        except Exception:  # a hold is a hint: its failure must not fail another pod's call
            log.exception(
                "holding GPUs for pod %s on node %s failed; bind will place it afresh",
                pending[0],
                pending[2],
            )

    def _assume(self, uid: str, reqs: list[ContainerRequest], node: str) -> bool:
        self._expire_assumed()
        self._drop_assumed(uid)
        if uid in self.pods or not reqs:
            return False
        try:
            assignment = self._place(uid, reqs, node)
        except NoFit:
            return False
        self.assumed[uid] = Assumed(node, time.monotonic() + self.assume_ttl_s, assignment)
        return True

    def reserve(
        self,
        uid: str,
        namespace: str,
        name: str,
        reqs: list[ContainerRequest],
        node: str,
        lock_epoch: int = 0,
    ) -> Assignment:
        """Hold the pod's GPU(s) on `node` (its assumption there, or a new choice)."""
        with self.lock:
            self._settle()
            if uid in self.pods:
                raise NoFit(f"pod {namespace}/{name} already holds GPUs on {self.pods[uid].node}")
            held = self.assumed.pop(uid, None)
            if held is not None and held.node == node:
                assignment = held.assignment
            else:
                if held is not None:
                    self._release_slices(uid, held.assignment)
                assignment = self._place(uid, reqs, node)
            # stamped under the node's lock: the order kubelet will see the binds in (binds
            # sharing one lock epoch are told apart by bound_at, kept strictly increasing)
            bound_at = max(time.time(), self._last_bound_at.get(node, 0.0) + 1e-6)
            self._last_bound_at[node] = bound_at
            assignment = assignment.model_copy(
                update={"bound_at": bound_at, "lock_epoch": lock_epoch}
            )
            self.pods[uid] = PodRecord(
                uid, namespace, name, node, assignment, assignment_text=assignment.dumps()
            )
            return assignment

    def _release_slices(self, uid: str, assignment: Assignment) -> None:
        for cname in assignment.containers:
            self.state.release(slice_id(uid, cname))

    def _drop_assumed(self, uid: str) -> None:
        if self._pending_hold is not None and self._pending_hold[0] == uid:
            self._pending_hold = None
        held = self.assumed.pop(uid, None)
        if held is not None:
            self._release_slices(uid, held.assignment)

    def _expire_assumed(self) -> None:
        # `assumed` is in insertion order (`assume` drops a pod's old entry before adding
        # the new one) and every entry lives `assume_ttl_s`, so it is in expiry order too:
        # only the expired head is looked at, not every pod whose bind is in flight.
        now = time.monotonic()
        expired: list[str] = []
        for uid, held in self.assumed.items():
            if held.expires >= now:
                break
            expired.append(uid)
        for uid in expired:
            self._drop_assumed(uid)

    def _drop_assumed_on(self, node: str) -> bool:
        if self._pending_hold is not None and self._pending_hold[2] == node:
            self._pending_hold = None
        uids = [u for u, a in self.assumed.items() if a.node == node]
        for uid in uids:
            self._drop_assumed(uid)
        return bool(uids)

    def unreserve(self, uid: str) -> None:
        self.release_pod(uid)
