"""The qgpu device plugin (kubelet deviceplugin/v1beta1 over gRPC on unix sockets).

Owns the node side of the Kubernetes bridge:
- two plugins, ``<prefix>/qgpu-core`` (100 IDs per GPU) and ``<prefix>/qgpu-memory`` (one
  ID per GiB), each served on its own socket in the device-plugin directory and registered
  with kubelet (``kubelet.sock``);
- ListAndWatch with each GPU's health (and NUMA node), re-sent when the inventory changes;
- GetPreferredAllocation steering kubelet to the GPU the extender chose;
- Allocate: finds the pod container from the assignment annotations
  (`k8s_bridge.deviceplugin.claims`), claims it on the pod, and answers with the
  interposer's env and mounts (`k8s_bridge.deviceplugin.allocation`);
- PreStartContainer: checks the container's claim and limits file are in place and, with
  kubelet's pod-resources API (`k8s_bridge.deviceplugin.claim_check`), that kubelet gave
  these device IDs to the claimed container: a pod that bypassed the extender, or a pod
  admitted out of binding order, is refused instead of starting with another pod's slice;
- publishing the node's GPU inventory as the Node annotation ``<prefix>/qgpu-inventory``;
- re-registering when kubelet restarts (its socket is recreated, ours are deleted).

Every failure is a gRPC error with a message; nothing is ever answered with a made-up
allocation.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
from pydantic import BaseModel, ConfigDict, Field

from k8s_bridge.assignment_mac import AssignmentKeys
from k8s_bridge.deviceplugin.allocation import (
    AllocationError,
    AllocationPaths,
    container_identity,
    container_response,
    k8s_slice_id,
    limits_file_for,
)
from k8s_bridge.deviceplugin.claim_check import ClaimCheck, Misclaimed
from k8s_bridge.deviceplugin.claim_record import ClaimRecord
from k8s_bridge.deviceplugin.claims import (
    claim_patch,
    claimed,
    claimed_match,
    matching,
    pending_pods,
)
from k8s_bridge.deviceplugin.pod_resources import (
    DEFAULT_POD_RESOURCES_SOCKET,
    PodResourcesClient,
    PodResourcesUnavailable,
)
from k8s_bridge.deviceplugin.v1beta1 import api_pb2 as pb
from k8s_bridge.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from k8s_bridge.kube import Conflict, Kube, KubeError
from k8s_bridge.pod_guard import as_state_dir, check_pod
from k8s_bridge.protocol import (
    KINDS,
    Kind,
    PublishedInventory,
    device_id,
    ids_per_gpu,
    parse_device_id,
)
from k8s_bridge.resources import PodModel
from qgpu.errors import QgpuError, RuleViolation, safe_text
from qgpu.model import NodeInventory

log = logging.getLogger(__name__)

API_VERSION = "v1beta1"
DEFAULT_PLUGIN_DIR = "/var/lib/kubelet/device-plugins"
KUBELET_SOCKET = "kubelet.sock"
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
MAX_MESSAGE = 1000  # characters of an error message sent back to kubelet


class PluginConfig(BaseModel):
    """Device plugin settings (CLI flags / chart values)."""

    model_config = ConfigDict(extra="forbid")

    node_name: str = Field(min_length=1)
    scheduler_name: str = Field(
        default="qgpu-scheduler",
        min_length=1,
        description="the spec.schedulerName of the pods whose assignments are honoured",
    )
    prefix: str = "tke.cloud.tencent.com"
    plugin_dir: Path = Path(DEFAULT_PLUGIN_DIR)
    kubelet_socket: str = KUBELET_SOCKET
    poll_s: float = Field(default=1.0, gt=0)
    register_timeout_s: float = Field(default=5.0, gt=0)
    claim_retries: int = Field(default=8, ge=1)
    publish_inventory: bool = True
    pod_resources_socket: Path | None = Field(
        default=DEFAULT_POD_RESOURCES_SOCKET,
        description="kubelet's pod-resources API, asked at PreStartContainer which container "
        "got the device IDs; None: not asked (a pod that bypassed the extender can then take "
        "the slice of a bound, not yet admitted pod of the same layout)",
    )


class PluginError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class _Servicer(pb_grpc.DevicePluginServicer):
    """One resource's DevicePlugin service; the work is done by `QgpuDevicePlugin`."""

    def __init__(self, plugin: QgpuDevicePlugin, kind: Kind, stop: threading.Event) -> None:
        self.plugin = plugin
        self.kind = kind
        self.stop = stop

    def _guard(self, context: grpc.ServicerContext, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        # Messages are cut short: a status message travels as a gRPC header (16 KiB at
        # most), and one that echoes a long device ID would be lost for RESOURCE_EXHAUSTED.
        except PluginError as exc:
            log.warning("%s: %s", self.kind, safe_text(str(exc), MAX_MESSAGE))
            context.abort(exc.code, safe_text(str(exc), MAX_MESSAGE))
        except RuleViolation as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, safe_text(str(exc), MAX_MESSAGE))
        except (QgpuError, AllocationError) as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, safe_text(str(exc), MAX_MESSAGE))

    def GetDevicePluginOptions(self, request: pb.Empty, context: Any) -> pb.DevicePluginOptions:
        return pb.DevicePluginOptions(
            pre_start_required=True, get_preferred_allocation_available=True
        )

    def ListAndWatch(self, request: pb.Empty, context: Any) -> Iterator[pb.ListAndWatchResponse]:
        seen = -1
        while not self.stop.is_set() and context.is_active():
            version, devices = self.plugin.devices(self.kind, seen, timeout=0.5)
            if version != seen:
                seen = version
                yield pb.ListAndWatchResponse(devices=devices)

    def GetPreferredAllocation(
        self, request: pb.PreferredAllocationRequest, context: Any
    ) -> pb.PreferredAllocationResponse:
        out = []
        for creq in request.container_requests:
            ids = self._guard(
                context,
                self.plugin.preferred,
                self.kind,
                list(creq.available_deviceIDs),
                list(creq.must_include_deviceIDs),
                int(creq.allocation_size),
            )
            out.append(pb.ContainerPreferredAllocationResponse(deviceIDs=ids))
        return pb.PreferredAllocationResponse(container_responses=out)

    def Allocate(self, request: pb.AllocateRequest, context: Any) -> pb.AllocateResponse:
        out = [
            self._guard(context, self.plugin.allocate, self.kind, list(creq.devices_ids))
            for creq in request.container_requests
        ]
        return pb.AllocateResponse(container_responses=out)

    def PreStartContainer(
        self, request: pb.PreStartContainerRequest, context: Any
    ) -> pb.PreStartContainerResponse:
        self._guard(context, self.plugin.pre_start, self.kind, list(request.devices_ids))
        return pb.PreStartContainerResponse()


class _Endpoint:
    """A served plugin socket for one resource."""

    def __init__(self, plugin: QgpuDevicePlugin, kind: Kind) -> None:
        self.kind = kind
        self.socket = plugin.cfg.plugin_dir / f"qgpu-{kind}.sock"
        self.stop = threading.Event()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        pb_grpc.add_DevicePluginServicer_to_server(_Servicer(plugin, kind, self.stop), self.server)
        self.socket.unlink(missing_ok=True)
        if self.server.add_insecure_port(f"unix://{self.socket}") == 0:
            raise OSError(f"cannot listen on {self.socket}")
        self.server.start()

    def close(self) -> None:
        self.stop.set()
        self.server.stop(grace=0).wait(2)
        self.socket.unlink(missing_ok=True)


class QgpuDevicePlugin:
    """Both resources of one node: serving, registration, allocation and restarts."""

    def __init__(
        self,
        cfg: PluginConfig,
        kube: Kube,
        inventory: NodeInventory,
        paths: AllocationPaths,
        keys: AssignmentKeys | None = None,
    ) -> None:
        self.cfg = cfg
        self.kube = kube
        self.names = kube.names
        self.paths = paths
        self.keys = keys  # None: assignments are taken unsigned (no --assignment-key-file)
        self.record = ClaimRecord(paths.state_dir / "k8s" / "claims.json")
        self._rejected: dict[str, str] = {}  # pod UID -> the reason last logged
        self._inventory = inventory
        self._version = 0
        self._changed = threading.Condition()
        self._alloc_lock = threading.Lock()
        self._endpoints: dict[Kind, _Endpoint] = {}
        self._kubelet_id: tuple[int, int] | None = None
        self._stop = threading.Event()
        self._monitor: threading.Thread | None = None
        self.registrations = 0
        self.check: ClaimCheck | None = None
        if cfg.pod_resources_socket is not None:
            self.check = ClaimCheck(
                PodResourcesClient(cfg.pod_resources_socket),
                kube,
                self.names,
                self.record,
                cfg.claim_retries,
            )

    # -- lifecycle -------------------------------------------------------------------

    @property
    def kubelet_socket(self) -> Path:
        return self.cfg.plugin_dir / self.cfg.kubelet_socket

    def start(self) -> None:
        if self.cfg.publish_inventory:
            self.publish()
        try:
            self._serve_and_register()
        except (grpc.RpcError, OSError) as exc:
            # kubelet not up yet (node boot): the monitor registers as soon as it is
            log.warning("registration with kubelet failed (will retry): %s", exc)
            self._kubelet_id = None
        self._monitor = threading.Thread(target=self._watch_kubelet, daemon=True)
        self._monitor.start()

    def stop(self) -> None:
        self._stop.set()
        with self._changed:
            self._changed.notify_all()
        for ep in self._endpoints.values():
            ep.close()
        self._endpoints = {}
        if self._monitor is not None:
            self._monitor.join(5)
        if self.check is not None:
            self.check.client.close()

    def _kubelet_identity(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.kubelet_socket)
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_ctime_ns)

    def _serve_and_register(self) -> None:
        for ep in self._endpoints.values():
            ep.close()
        self._endpoints = {kind: _Endpoint(self, kind) for kind in KINDS}
        self._kubelet_id = self._kubelet_identity()
        for kind, ep in self._endpoints.items():
            self._register(kind, ep)

    def _register(self, kind: Kind, ep: _Endpoint) -> None:
        resource = self.names.core if kind == "core" else self.names.memory
        with grpc.insecure_channel(f"unix://{self.kubelet_socket}") as channel:
            stub = pb_grpc.RegistrationStub(channel)
            stub.Register(
                pb.RegisterRequest(
                    version=API_VERSION,
                    endpoint=ep.socket.name,
                    resource_name=resource,
                    options=pb.DevicePluginOptions(
                        pre_start_required=True, get_preferred_allocation_available=True
                    ),
                ),
                timeout=self.cfg.register_timeout_s,
            )
        self.registrations += 1
        log.info("registered %s with kubelet (%s)", resource, ep.socket)

    def _watch_kubelet(self) -> None:
        """Re-serve and re-register when kubelet restarts (new kubelet.sock, ours deleted)."""
        while not self._stop.wait(self.cfg.poll_s):
            ours_gone = any(not ep.socket.exists() for ep in self._endpoints.values())
            ident = self._kubelet_identity()
            if ident is None:
                continue  # kubelet is down; wait for its socket
            if ours_gone or ident != self._kubelet_id:
                log.info("kubelet restarted; registering again")
                try:
                    self._serve_and_register()
                except (grpc.RpcError, OSError) as exc:
                    log.warning("re-registration failed (will retry): %s", exc)
                    self._kubelet_id = None

    # -- inventory -------------------------------------------------------------------

    @property
    def inventory(self) -> NodeInventory:
        return self._inventory

    def set_inventory(self, inventory: NodeInventory) -> None:
        """A new inventory (health changes): re-publish and re-send ListAndWatch."""
        with self._changed:
            self._inventory = inventory
            self._version += 1
            self._changed.notify_all()
        if self.cfg.publish_inventory:
            self.publish()

    def publish(self) -> None:
        inv = self._inventory
        text = PublishedInventory(
            gpus=inv.gpus,
            max_slices_per_gpu=inv.max_slices_per_gpu,
            fixed_slices=inv.fixed_slices,
            published_at=time.time(),
        ).model_dump_json()
        self.kube.publish_node_annotations(
            self.cfg.node_name, {self.names.inventory_annotation: text}
        )

    def devices(self, kind: Kind, seen: int, timeout: float) -> tuple[int, list[pb.Device]]:
        with self._changed:
            if self._version == seen:
                self._changed.wait(timeout)
            version, inv = self._version, self._inventory
        out = []
        for g in inv.gpus:
            count = 100 if kind == "core" else g.memory_gib
            health = HEALTHY if g.healthy else UNHEALTHY
            topo = (
                pb.TopologyInfo(nodes=[pb.NUMANode(ID=g.numa_node)])
                if g.numa_node is not None
                else None
            )
            for i in range(count):
                out.append(pb.Device(ID=device_id(g.uuid, kind, i), health=health, topology=topo))
        return version, out

    def _gpus(self, uuids: list[str]) -> list[Any]:
        by_uuid = {g.uuid: g for g in self._inventory.gpus}
        missing = [u for u in uuids if u not in by_uuid]
        if missing:
            raise PluginError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"GPU(s) {', '.join(missing)} are not on node {self.cfg.node_name}",
            )
        return [by_uuid[u] for u in uuids]

    # -- kubelet calls ---------------------------------------------------------------

    def _candidates(self, rejected: list[str] | None = None) -> list[Any]:
        """The containers assigned to this node; `rejected` gets one entry per pod whose
        assignment was ignored (MAC missing or wrong), each logged once per pod and reason."""
        try:
            pods = self.kube.pods_on_node(self.cfg.node_name)
        except KubeError as exc:
            raise PluginError(grpc.StatusCode.UNAVAILABLE, f"cannot list pods: {exc}") from exc

        def reject(pod: PodModel, why: str) -> None:
            if rejected is not None:
                rejected.append(pod.key)
            if self._rejected.get(pod.metadata.uid) != why:
                self._rejected[pod.metadata.uid] = why
                log.warning(
                    "ignoring the qgpu assignment of pod %s (uid %s) on node %s: %s",
                    pod.key,
                    pod.metadata.uid,
                    self.cfg.node_name,
                    why,
                )

        self.record.keep_only((p.get("metadata") or {}).get("uid", "") for p in pods)
        out = pending_pods(
            self.names,
            self.cfg.node_name,
            pods,
            self.cfg.scheduler_name,
            self.keys,
            reject,
            self.record.snapshot(),
        )
        if self.check is not None:
            self.check.forget_gone(out)
        return out

    def _checked_candidates(self, rejected: list[str]) -> list[Any]:
        """`_candidates`, after withdrawing the claims kubelet's pod-resources API shows
        under another container (callers hold the allocation lock)."""
        candidates = self._candidates(rejected)
        if self.check is None:
            return candidates
        try:
            withdrawn = self.check.before_match(candidates)
        except PodResourcesUnavailable as exc:
            raise PluginError(grpc.StatusCode.UNAVAILABLE, str(exc)) from exc
        if not withdrawn:
            return candidates
        rejected.clear()
        return self._candidates(rejected)

    def _pending(self, candidates: list[Any], kind: Kind, per_gpu: Any, size: int) -> list[Any]:
        """`matching`, without containers kubelet allocated already under a wrong claim."""
        found = matching(candidates, kind, per_gpu, size)
        if self.check is None:
            return found
        return [c for c in found if not self.check.taken(c, kind)]

    def _not_found(self, what: str, rejected: list[str]) -> PluginError:
        """NOT_FOUND for kubelet (which puts it in the pod's events): what was looked for
        and how many assignments were ignored (the names are in the plugin's log only)."""
        msg = f"no pod assigned to node {self.cfg.node_name} waits for {what}"
        if rejected:
            msg += (
                f"; ignored {len(rejected)} assignment(s) on this node whose MAC is missing "
                "or wrong (not written by the qgpu extender for that pod: see the device "
                "plugin's log)"
            )
        return PluginError(grpc.StatusCode.NOT_FOUND, msg)

    def preferred(self, kind: Kind, available: list[str], must: list[str], size: int) -> list[str]:
        by_gpu: dict[str, list[str]] = {}
        for dev in available:
            uuid, k = parse_device_id(dev)
            if k == kind:
                by_gpu.setdefault(uuid, []).append(dev)
        must_by_gpu: dict[str, list[str]] = {}
        for dev in must:
            must_by_gpu.setdefault(parse_device_id(dev)[0], []).append(dev)
        rejected: list[str] = []
        with self._alloc_lock:
            candidates = self._checked_candidates(rejected)
        # Containers waiting for this resource first.
        for cand in self._pending(candidates, kind, None, size):
            layout = cand.slice.devices[kind]
            if any(u not in layout or len(ids) > layout[u] for u, ids in must_by_gpu.items()):
                continue
            if any(len(by_gpu.get(u, [])) < n for u, n in layout.items()):
                continue
            chosen: list[str] = []
            for u, n in layout.items():
                first = must_by_gpu.get(u, [])
                rest = sorted(
                    (d for d in by_gpu[u] if d not in set(first)),
                    key=lambda d: int(d.rpartition("_")[2][1:]),
                )
                chosen += (first + rest)[:n]
            return chosen
        # Then containers that already claimed it: kubelet asks again when its Allocate got
        # no answer (the plugin died after the claim reached the apiserver), and the IDs
        # they recorded are then available again: exactly those are offered, or none
        # (Allocate finds a claimed container by its IDs only).
        free = set(available)
        for cand in claimed(candidates, kind, size):
            recorded = cand.allocated.claimed_ids(cand.container, kind) or []
            if set(must) <= set(recorded) <= free:
                return recorded
        raise self._not_found(
            f"{size} {kind} IDs available here (was the pod scheduled by the qgpu extender?)",
            rejected,
        )

    def allocate(self, kind: Kind, ids: list[str]) -> pb.ContainerAllocateResponse:
        if not ids:
            raise PluginError(grpc.StatusCode.INVALID_ARGUMENT, "Allocate with no device IDs")
        kinds, per_gpu = ids_per_gpu(ids)
        if kinds != {kind}:
            raise PluginError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the {kind} plugin was asked for IDs of {sorted(kinds)}",
            )
        self._gpus(list(per_gpu))
        with self._alloc_lock:
            for _ in range(self.cfg.claim_retries):
                rejected: list[str] = []
                candidates = self._checked_candidates(rejected)
                found = self._pending(candidates, kind, per_gpu, len(ids))
                if not found:
                    again = claimed_match(candidates, kind, ids)
                    if again is not None:
                        # kubelet allocating a container again (its answer was lost, or from
                        # its checkpoint): the same device IDs, the same answer.
                        return self._response(again, kind)
                    raise self._not_found(f"{kind} IDs laid out as {per_gpu}", rejected)
                c = found[0]
                resp = self._response(c, kind)
                claim = c.allocated.with_claim(c.container, kind, ids)
                body = claim_patch(
                    self.names, c.pod.metadata.resource_version, claim.model_dump_json()
                )
                try:
                    self.kube.patch_pod(c.pod.metadata.namespace, c.pod.metadata.name, body)
                except Conflict:
                    continue  # the pod changed (another claim): look again
                except KubeError as exc:
                    raise PluginError(
                        grpc.StatusCode.UNAVAILABLE, f"cannot record the claim: {exc}"
                    ) from exc
                try:
                    self.record.put(c.uid, claim)
                except OSError as exc:  # the annotation holds the claim; say what is lost
                    log.warning("cannot record the claim of %s on the node: %s", c.pod.key, exc)
                log.info("allocated %s of %s/%s to %s", kind, c.pod.key, c.container, c.slice.gpus)
                return resp
        raise PluginError(
            grpc.StatusCode.ABORTED, f"the claim kept conflicting ({self.cfg.claim_retries} tries)"
        )

    def _response(self, c: Any, kind: Kind) -> pb.ContainerAllocateResponse:
        """The Allocate answer for candidate `c`'s container (makes its slice's files), for
        a pod that overrides none of it (`k8s_bridge.pod_guard`: refused with the rule,
        whatever the webhook let through)."""
        check_pod(self.names, c.pod, as_state_dir(self.paths.state_dir))
        return container_response(
            self.paths,
            c.uid,
            c.container,
            c.slice,
            self._gpus(c.slice.gpus),
            kind,
            container_identity(c.pod, c.container),
        )

    def pre_start(self, kind: Kind, ids: list[str]) -> None:
        kinds, _ = ids_per_gpu(ids)
        if kinds != {kind}:
            raise PluginError(grpc.StatusCode.INVALID_ARGUMENT, f"not {kind} IDs: {sorted(kinds)}")
        owner = None
        with self._alloc_lock:
            c = claimed_match(self._candidates(), kind, ids)
            if self.check is not None:
                try:
                    owner = self.check.at_pre_start(c, kind, ids)
                except Misclaimed as exc:
                    raise PluginError(grpc.StatusCode.PERMISSION_DENIED, str(exc)) from exc
                except LookupError as exc:
                    raise PluginError(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from exc
                except PodResourcesUnavailable as exc:
                    raise PluginError(grpc.StatusCode.UNAVAILABLE, str(exc)) from exc
        if c is None:
            whose = f" (kubelet gave them to {owner})" if owner is not None else ""
            raise PluginError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"no allocated container on node {self.cfg.node_name} holds these {kind} "
                f"IDs{whose}",
            )
        if kind == "core" and c.slice.core < 100:
            sid = k8s_slice_id(c.uid, c.container)
            path = limits_file_for(self.paths, sid)
            if self.paths.agent is not None:
                try:
                    held = self.paths.agent.get(sid)
                except QgpuError as exc:  # the agent's errors and its absence
                    raise PluginError(
                        grpc.StatusCode.FAILED_PRECONDITION,
                        f"the node agent does not hold slice {sid}: {exc}",
                    ) from exc
                path = Path(held.limits_file or "/nonexistent")
            if not path.is_file():
                raise PluginError(
                    grpc.StatusCode.FAILED_PRECONDITION, f"the limits file {path} is missing"
                )
