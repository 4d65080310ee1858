"""The extender's verbs (filter, prioritize, bind) and its sync with the apiserver.

Owns the bind protocol:
1. read the pod from the apiserver (never trust the request): it must be unbound, have the
   UID kube-scheduler named, name this extender's scheduler (``spec.schedulerName``) and
   ask for qgpu resources -- anything else is refused with an error, never bound;
2. take the node's lock (`k8s_bridge.kube.NodeLocker`: annotation with holder + expiry,
   resourceVersion precondition); if the node's epoch moved since our last lock, another
   writer assigned pods there: re-read the pods bound to that node first. A lock this
   extender still holds from a bind moments ago is used again instead (see 5);
3. choose GPU(s) on the node (`ExtenderState.reserve`, the placement engine);
4. create the Binding carrying the assignment (and, with keys, its MAC over pod UID, node
   and text: `k8s_bridge.assignment_mac`) as annotations, with the pod's UID and
   resourceVersion as preconditions: the apiserver's binding subresource copies a
   Binding's annotations onto the pod in the same write that sets ``spec.nodeName``, so a
   bound pod always carries its assignment and a failed bind leaves nothing behind
   (HTTP 201 checked; a client-side failure is resolved by reading the pod, never by
   binding again; a stale resourceVersion means: read the pod and try once more);
5. release the lock, or keep it for `ExtenderConfig.lock_linger_s` (default 0.2 s) so
   that the next bind to the same node -- binpack sends many in a row -- costs one apiserver
   write instead of three; a background thread releases locks left idle that long, no lock
   is reused after `lock_max_hold_s` or within half its TTL of expiring, `stop()` releases
   all, and a failed write releases at once. While we hold the lock no other writer can
   assign on that node, so our view of it stays exact. Any failure after 3 undoes the
   reservation.

`start()` lists the nodes and the bound pods (the restart path) and follows both with
watches.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
from kubernetes import watch
from kubernetes.client.rest import ApiException
from pydantic import BaseModel, ConfigDict, Field

from k8s_bridge.assignment_mac import AssignmentKeys
from k8s_bridge.compat import foreign_reason
from k8s_bridge.extender.background import as_background_thread
from k8s_bridge.extender.models import (
    ExtenderArgs,
    ExtenderBindingArgs,
    ExtenderBindingResult,
    ExtenderFilterResult,
    HostPriority,
    NodeList,
)
from k8s_bridge.extender.state import ExtenderState, FilterResult
from k8s_bridge.kube import Conflict, HolderPod, Kube, KubeError, LockHandle, NodeLocker
from k8s_bridge.metrics import ExtenderMetrics
from k8s_bridge.resources import ContainerRequest, Names, PodModel, parse_pod
from qgpu.errors import NoFit, QgpuError, RuleViolation
from qgpu.model import DEFAULT_PLACEMENT, PlacementPolicy

log = logging.getLogger(__name__)

BOUND = "spec.nodeName!="  # pods bound to some node: the only ones holding assignments


class PodChanged(Conflict):
    """The pod changed since kube-scheduler read it (our write's precondition failed)."""


class NotOurs(QgpuError):
    """A bind asked for a pod this extender does not bind (another scheduler's, or one
    that asks for no qgpu resources)."""


@dataclass
class _Lease:
    """A node lock held between binds (`ExtenderConfig.lock_linger_s`)."""

    handle: LockHandle
    taken: float  # time.monotonic() when acquired
    used: float  # time.monotonic() when a bind last finished with it


class ExtenderConfig(BaseModel):
    """Extender settings (CLI flags / chart values)."""

    model_config = ConfigDict(extra="forbid")

    prefix: str = "tke.cloud.tencent.com"
    scheduler_name: str = Field(
        default="qgpu-scheduler",
        min_length=1,
        description="the only spec.schedulerName whose pods bind accepts",
    )
    node_policy: PlacementPolicy = DEFAULT_PLACEMENT  # qgpu's one default (frag)
    gpu_policy: PlacementPolicy | None = None
    lock_ttl_s: float = Field(default=30.0, gt=0)
    lock_timeout_s: float = Field(default=5.0, gt=0)
    lock_linger_s: float = Field(
        default=0.2,
        ge=0,
        description="keep a node's lock this long after a bind for the next bind there "
        "(0: release after every bind)",
    )
    lock_max_hold_s: float = Field(
        default=2.0, gt=0, description="never reuse one node lock for longer than this"
    )
    assume_ttl_s: float = Field(
        default=10.0, ge=0, description="hold prioritize's best node until bind (0: never)"
    )
    holder: str = Field(
        default_factory=lambda: f"qgpu-extender-{uuid.uuid4().hex[:8]}",
        description="this replica's name in node locks: stable across restarts of its pod "
        "(the pod's namespace/name), so a restarted extender takes its own locks back",
    )
    holder_pod: HolderPod | None = Field(
        default=None, description="the pod this replica runs in, named in its node locks"
    )
    compat: bool = Field(
        default=False,
        description="compat mode is on (the webhook translates HAMi/Koordinator names): only "
        "changes the reason a qgpu node gives a pod that still asks for them",
    )
    watch: bool = True
    watch_timeout_s: int = Field(default=300, ge=1)


class Extender:
    """kube-scheduler's extender: decisions from `ExtenderState`, writes through `Kube`."""

    def __init__(
        self, kube: Kube, cfg: ExtenderConfig | None = None, keys: AssignmentKeys | None = None
    ) -> None:
        self.cfg = cfg or ExtenderConfig()
        self.keys = keys  # signs every assignment it binds (None: unsigned)
        self.names: Names = kube.names
        self.kube = kube
        self.state = ExtenderState(
            self.names, self.cfg.node_policy, self.cfg.gpu_policy, self.cfg.assume_ttl_s, keys
        )
        self.metrics = ExtenderMetrics()
        self.metrics.state = self.state
        self.locker = NodeLocker(kube, self.cfg.holder, self.cfg.lock_ttl_s, self.cfg.holder_pod)
        self.epochs: dict[str, int] = {}
        self._node_locks: dict[str, threading.Lock] = {}
        self._node_locks_guard = threading.Lock()
        self._requests: OrderedDict[str, tuple[PodModel, list[ContainerRequest]]] = OrderedDict()
        self._requests_guard = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._leases: dict[str, _Lease] = {}
        self._releaser: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------

    def sync(self) -> tuple[str, str]:
        """(Re)build all state from the apiserver; returns the lists' resourceVersions."""
        nodes, nodes_rv = self.kube.list_nodes()
        pods, pods_rv = self.kube.list_pods(field_selector=BOUND)
        self.state.load_nodes(nodes)
        self.state.load_pods(pods)
        for obj in nodes:
            self.locker.remember(obj)
            ann = obj["metadata"].get("annotations") or {}
            try:
                self.epochs[obj["metadata"]["name"]] = int(ann.get(self.names.epoch_annotation, 0))
            except ValueError:
                self.epochs[obj["metadata"]["name"]] = 0
        return nodes_rv, pods_rv

    def start(self) -> None:
        nodes_rv, pods_rv = self.sync()
        if not self.cfg.watch:
            return
        for kind, rv in (("nodes", nodes_rv), ("pods", pods_rv)):
            t = threading.Thread(
                target=self._watch_loop, args=(kind, rv), name=f"qgpu-watch-{kind}", daemon=True
            )
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        """Stop the watches and give back every node lock still held."""
        self._stop.set()
        for node in list(self._leases):
            with self._node_lock(node):
                lease = self._leases.pop(node, None)
                if lease is not None:
                    self._release_lock(lease.handle)

    def _watch_loop(self, kind: str, rv: str) -> None:
        as_background_thread()  # events wait a moment rather than preempt the verbs
        while not self._stop.is_set():
            try:
                rv = self._watch_once(kind, rv)
            except ApiException as exc:
                if exc.status == 410:
                    log.info("%s watch expired; relisting", kind)
                else:
                    log.warning("%s watch failed: %s; relisting", kind, exc)
                    self._stop.wait(1.0)
                rv = self._relist(kind)
            except Exception as exc:  # the watch must survive any transport error
                log.warning("%s watch broke: %s; relisting", kind, exc)
                self._stop.wait(1.0)
                rv = self._relist(kind)

    def _relist(self, kind: str) -> str:
        try:
            if kind == "nodes":
                nodes, rv = self.kube.list_nodes()
                self.state.load_nodes(nodes)
                return rv
            pods, rv = self.kube.list_pods(field_selector=BOUND)
            self.state.load_pods(pods)
            return rv
        except KubeError as exc:
            log.warning("relist of %s failed: %s", kind, exc)
            return ""

    def _watch_once(self, kind: str, rv: str) -> str:
        w = watch.Watch()
        core = self.kube.core
        kwargs: dict[str, Any] = {}
        # Plain wrappers (no return annotation or docstring): the client's watch then skips
        # building model objects and hands out the raw JSON, which is all we read.
        if kind == "nodes":

            def func(**kw: Any) -> Any:
                return core.list_node(**kw)

        else:
            kwargs = {"field_selector": BOUND}

            def func(**kw: Any) -> Any:
                return core.list_pod_for_all_namespaces(**kw)

        for event in w.stream(
            func, resource_version=rv, timeout_seconds=self.cfg.watch_timeout_s, **kwargs
        ):
            if self._stop.is_set():
                w.stop()
                break
            obj = event["raw_object"]
            rv = obj["metadata"].get("resourceVersion", rv)
            if kind == "nodes":
                deleted = event["type"] == "DELETED"
                if not deleted:
                    self.locker.remember(obj)
                self.state.update_node(obj, deleted=deleted)
            elif event["type"] == "DELETED":
                self.state.release_pod(obj["metadata"]["uid"], int(rv or 0))
            else:
                self.state.apply_pod(obj)
        return rv

    # -- verbs ------------------------------------------------------------------------

    def _pod_requests(self, pod: PodModel) -> list[ContainerRequest]:
        """The pod's requests, cached by UID with the pod as kube-scheduler sent it.

        A pod seen for the first time is also counted in the placement policy's request mix
        (frag learns from it): once per pod, however often it is filtered or placed again.
        (A pod that has dropped out of the cache's last 10,000 counts again.)"""
        uid = pod.metadata.uid
        with self._requests_guard:
            hit = self._requests.get(uid) if uid else None
        if hit is not None and hit[0].metadata.resource_version == pod.metadata.resource_version:
            return hit[1]
        reqs = self.state.requests(pod)
        if hit is None:
            self.state.observe(reqs)
        if uid:
            with self._requests_guard:
                self._requests[uid] = (pod, reqs)
                while len(self._requests) > 10_000:
                    self._requests.popitem(last=False)
        return reqs

    def _parse_pod(self, raw: dict[str, Any]) -> tuple[PodModel, list[ContainerRequest]]:
        """The pod kube-scheduler sent and its requests; a pod seen before (same UID and
        resourceVersion: the apiserver changes the version with every write) is not parsed
        again, so filter and prioritize of one pod parse it once."""
        meta = raw.get("metadata")
        if isinstance(meta, dict):
            uid, rv = meta.get("uid"), meta.get("resourceVersion")
            if uid and rv:
                with self._requests_guard:
                    hit = self._requests.get(uid)
                if hit is not None and hit[0].metadata.resource_version == rv:
                    return hit
        pod = parse_pod(raw)
        return pod, self._pod_requests(pod)

    def filter(self, args: ExtenderArgs) -> ExtenderFilterResult:
        names = args.candidate_names()
        try:
            pod, reqs = self._parse_pod(args.pod)
        except RuleViolation as exc:
            reason = f"pod rejected by qgpu: {exc}"
            res = FilterResult(unresolvable=dict.fromkeys(names, reason))
            res.rules["pod rejected"] = len(names)
            return self._filtered(args, res, "rejected")
        if not reqs:
            foreign = foreign_reason(self.names, args.pod, self.cfg.compat)
            if foreign is None:
                return self._filtered(args, FilterResult(nodes=names), "not-qgpu")
            return self._filtered(args, self._refuse_qgpu_nodes(names, foreign), "foreign")
        res = self.state.filter_nodes(reqs, names, pod.metadata.uid)
        return self._filtered(args, res, "schedulable" if res.nodes else "unschedulable")

    def _refuse_qgpu_nodes(self, names: list[str], reason: str) -> FilterResult:
        """A pod asking for HAMi/Koordinator names: nothing on a qgpu node would isolate it,
        so those nodes refuse it (other nodes may run the project whose names it uses)."""
        res = FilterResult()
        with self.state.lock:
            qgpu_nodes = set(self.state.inventories) | set(self.state.broken)
        for name in names:
            if name in qgpu_nodes:
                res.unresolvable[name] = reason
            else:
                res.nodes.append(name)
        res.rules["foreign resources"] = len(res.unresolvable)
        return res

    def _filtered(
        self, args: ExtenderArgs, res: FilterResult, outcome: str
    ) -> ExtenderFilterResult:
        m = self.metrics
        m.requests.labels("filter", outcome).inc()
        for result, n in (
            ("passed", len(res.nodes)),
            ("failed", len(res.failed)),
            ("unresolvable", len(res.unresolvable)),
        ):
            if n:
                m.filter_nodes.labels(result).inc(n)
        for rule, n in res.rules.items():
            m.filter_refusals.labels(rule).inc(n)
        return self._filter_reply(args, res.nodes, res.failed, res.unresolvable)

    @staticmethod
    def _filter_reply(
        args: ExtenderArgs, ok: list[str], failed: dict[str, str], unresolvable: dict[str, str]
    ) -> ExtenderFilterResult:
        if args.node_names is not None or args.nodes is None:
            return ExtenderFilterResult(
                NodeNames=ok, FailedNodes=failed, FailedAndUnresolvableNodes=unresolvable
            )
        keep = set(ok)
        items = [n for n in args.nodes.items if n["metadata"]["name"] in keep]
        return ExtenderFilterResult(
            Nodes=NodeList(items=items),
            FailedNodes=failed,
            FailedAndUnresolvableNodes=unresolvable,
        )

    def prioritize(self, args: ExtenderArgs) -> list[HostPriority]:
        names, scores = self.prioritize_scores(args)
        return [HostPriority(Host=n, Score=v) for n, v in zip(names, scores.tolist(), strict=True)]

    def prioritize_scores(
        self, args: ExtenderArgs, hold_after_reply: bool = False
    ) -> tuple[list[str], np.ndarray]:
        """The candidate names and their 0..10 scores (the HTTP layer serializes them).

        The pod's GPUs on the best node are held until bind (`ExtenderState.assume`); with
        `hold_after_reply` the hold is left to `ExtenderState.settle`, which the caller
        runs once the reply has gone (`ExtenderState.hold_after_reply`)."""
        names = args.candidate_names()
        try:
            pod, reqs = self._parse_pod(args.pod)
        except RuleViolation:
            pod, reqs = None, []
        scores = self.state.score_nodes(reqs, names)
        if pod is not None and pod.metadata.uid and reqs and names and self.cfg.assume_ttl_s > 0:
            best = int(np.argmax(scores))  # the first of the highest, as kube-scheduler's pick
            if hold_after_reply:
                self.state.hold_after_reply(pod.metadata.uid, reqs, names[best])
            else:
                self.state.assume(pod.metadata.uid, reqs, names[best])
        self.metrics.requests.labels("prioritize", "scored" if reqs else "not-qgpu").inc()
        return names, scores

    def _node_lock(self, node: str) -> threading.Lock:
        with self._node_locks_guard:
            lock = self._node_locks.get(node)
            if lock is None:
                lock = self._node_locks[node] = threading.Lock()
            return lock

    def bind(self, args: ExtenderBindingArgs) -> ExtenderBindingResult:
        try:
            self._bind(args)
        except (QgpuError, RuleViolation) as exc:
            log.info(
                "bind %s/%s -> %s failed: %s", args.pod_namespace, args.pod_name, args.node, exc
            )
            result = (
                "no-fit"
                if isinstance(exc, NoFit)
                else "conflict"
                if isinstance(exc, Conflict)
                else "invalid"
                if isinstance(exc, RuleViolation)
                else "error"
            )
            self.metrics.binds.labels(result).inc()
            self.metrics.requests.labels("bind", "failed").inc()
            return ExtenderBindingResult(Error=str(exc))
        self.metrics.binds.labels("bound").inc()
        self.metrics.requests.labels("bind", "bound").inc()
        return ExtenderBindingResult()

    def _bind(self, args: ExtenderBindingArgs) -> None:
        # The pod as the apiserver has it (the request only names it); its resourceVersion
        # is the precondition of our write, so a pod changed since is read once more.
        for attempt in (1, 2):
            found = self._read_pod(args)
            if found is None:
                return
            pod, reqs = found
            try:
                self._bind_pod(pod, reqs, args.node)
                return
            except PodChanged:
                if attempt == 2:
                    raise

    def _read_pod(
        self, args: ExtenderBindingArgs
    ) -> tuple[PodModel, list[ContainerRequest]] | None:
        """The pod as it is now and its requests, when this extender may bind it; None when
        it is already bound where it was sent. Raises NotOurs / KubeError otherwise."""
        ns, name, node = args.pod_namespace, args.pod_name, args.node
        pod = parse_pod(self.kube.get_pod(ns, name))
        if pod.metadata.uid != args.pod_uid:
            raise NotOurs(f"pod {ns}/{name} has UID {pod.metadata.uid!r}, not {args.pod_uid!r}")
        if pod.spec.scheduler_name != self.cfg.scheduler_name:
            raise NotOurs(
                f"pod {ns}/{name} has schedulerName {pod.spec.scheduler_name!r}: qgpu binds "
                f"only pods of {self.cfg.scheduler_name!r}"
            )
        if pod.spec.node_name:
            if pod.spec.node_name == node:
                return None  # a repeated bind of a bound pod: it is already where it was sent
            raise KubeError(f"pod {ns}/{name} is already bound to node {pod.spec.node_name}")
        reqs = self._pod_requests(pod)
        if not reqs:
            raise NotOurs(f"pod {ns}/{name} asks for no qgpu resources: qgpu does not bind it")
        return pod, reqs

    def _bind_pod(self, pod: PodModel, reqs: list[ContainerRequest], node: str) -> None:
        with self._node_lock(node):
            lease = self._take_lease(node)
            keep = False
            try:
                self._write_and_bind(pod, reqs, node, lease.handle.epoch)
                keep = True
            except (NoFit, PodChanged):
                keep = True  # the lock itself is fine: the node is full, or the pod moved on
                raise
            finally:
                self._end_lease(node, lease, keep)

    def _take_lease(self, node: str) -> _Lease:
        """Our lock on `node`: the one still held from a bind moments ago, or a new one.

        Called under the node's thread lock. A new lock whose epoch we did not write (or a
        node we never locked) means another writer assigned pods there: re-read them first.
        """
        lease = self._leases.pop(node, None)
        if lease is not None:
            if self._reusable(lease):
                self.metrics.locks.labels("reused").inc()
                return lease
            self._release_lock(lease.handle)
        start = time.perf_counter()
        try:
            handle, _ = self.locker.acquire(node, self.cfg.lock_timeout_s)
        except QgpuError:
            self.metrics.locks.labels("timeout").inc()
            raise
        finally:
            self.metrics.lock_wait.observe(time.perf_counter() - start)
        self.metrics.locks.labels("acquired").inc()
        try:
            if self.epochs.get(node) != handle.previous_epoch:
                self.metrics.resyncs.inc()
                on_node = self.kube.list_pods(field_selector=f"spec.nodeName={node}")[0]
                self.state.resync_node(node, on_node)
        except BaseException:
            self._release_lock(handle)
            raise
        self.epochs[node] = handle.epoch
        now = time.monotonic()
        return _Lease(handle, now, now)

    def _reusable(self, lease: _Lease) -> bool:
        """Held briefly enough, far enough from expiry for one more bind, and the node as
        last seen (watch, our writes) still carries it."""
        return (
            time.monotonic() - lease.taken < self.cfg.lock_max_hold_s
            and lease.handle.lock.expires - time.time() > self.cfg.lock_ttl_s / 2
            and self.locker.still_ours(lease.handle)
        )

    def _end_lease(self, node: str, lease: _Lease, keep: bool) -> None:
        """After a bind: keep the lock for the next bind to this node, or release it."""
        if keep and self.cfg.lock_linger_s > 0 and not self._stop.is_set():
            lease.used = time.monotonic()
            self._leases[node] = lease
            self._start_releaser()
        else:
            self._release_lock(lease.handle)

    def _release_lock(self, handle: LockHandle) -> None:
        try:
            self.locker.release(handle)
        except KubeError as exc:
            log.warning("releasing the lock of node %s: %s", handle.node, exc)

    def _start_releaser(self) -> None:
        with self._node_locks_guard:
            if self._releaser is not None:
                return
            self._releaser = threading.Thread(
                target=self._release_idle_loop, name="qgpu-lock-releaser", daemon=True
            )
        self._releaser.start()

    def _release_idle_loop(self) -> None:
        as_background_thread()
        period = max(0.01, self.cfg.lock_linger_s / 2)
        while not self._stop.wait(period):
            try:
                self.release_idle_locks()
            except Exception:  # the releaser must outlive any one failure
                log.exception("releasing idle node locks")

    def release_idle_locks(self, idle_s: float | None = None) -> int:
        """Release the node locks no bind used for `idle_s` (default: the linger time);
        a node busy binding right now is left to its bind. Returns how many were released."""
        idle = self.cfg.lock_linger_s if idle_s is None else idle_s
        released = 0
        for node in list(self._leases):
            lock = self._node_lock(node)
            if not lock.acquire(blocking=False):
                continue
            try:
                lease = self._leases.get(node)
                if lease is not None and time.monotonic() - lease.used >= idle:
                    del self._leases[node]
                    self._release_lock(lease.handle)
                    released += 1
            finally:
                lock.release()
        return released

    def held_locks(self) -> list[str]:
        """Nodes whose lock this extender holds between binds."""
        return sorted(self._leases)

    def _write_and_bind(
        self, pod: PodModel, reqs: list[ContainerRequest], node: str, lock_epoch: int
    ) -> None:
        uid, ns, name = pod.metadata.uid, pod.metadata.namespace, pod.metadata.name
        try:
            assignment = self.state.reserve(uid, ns, name, reqs, node, lock_epoch)
        except NoFit as exc:
            raise NoFit(f"node {node} cannot take pod {ns}/{name}: {exc}", exc.reasons) from exc
        text = assignment.dumps()
        annotations = {self.names.assignment_annotation: text}
        if self.keys is not None:
            annotations[self.names.assignment_mac_annotation] = self.keys.sign(uid, node, text)
        try:
            self._create_binding(pod, node, annotations)
        except QgpuError as exc:
            self.state.unreserve(uid)
            if isinstance(exc, Conflict):  # stale pod, or bound meanwhile: read it again
                raise PodChanged(str(exc), exc.status, exc.reason) from exc
            raise

    def _create_binding(self, pod: PodModel, node: str, annotations: dict[str, str]) -> None:
        ns, name = pod.metadata.namespace, pod.metadata.name
        try:
            self.kube.bind(
                ns,
                name,
                pod.metadata.uid,
                node,
                annotations=annotations,
                resource_version=pod.metadata.resource_version,
            )
        except KubeError as exc:
            if exc.status:
                raise  # the apiserver answered: the bind did not happen
            # No answer: the bind may have happened. Read the pod instead of binding again.
            deadline = time.monotonic() + 5.0
            while True:
                try:
                    now = self.kube.get_pod(ns, name)
                    break
                except KubeError:
                    if time.monotonic() > deadline:
                        raise exc from None
                    time.sleep(0.1)
            ann = (now.get("metadata") or {}).get("annotations") or {}
            mine = ann.get(self.names.assignment_annotation) == annotations.get(
                self.names.assignment_annotation
            )
            if (now.get("spec") or {}).get("nodeName") != node or not mine:
                raise
