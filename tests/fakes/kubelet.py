"""A fake kubelet device manager: real gRPC (deviceplugin/v1beta1) over unix sockets.

It does what kubelet's device manager does with a device plugin, and nothing else:
- serves ``Registration/Register`` on ``<dir>/kubelet.sock`` (checks the API version and
  the resource name, refuses a second live plugin for one resource);
- on registration dials the plugin's endpoint, calls ``GetDevicePluginOptions`` and keeps
  a ``ListAndWatch`` stream open, tracking each device's health;
- `admit(pod)`: admission, then container start, as kubelet does them. Admission: for each
  container and each extended resource it asks for, picks from the healthy unallocated
  devices, asks ``GetPreferredAllocation`` when the plugin offers it (and uses the answer
  only if it is valid, as kubelet does), calls ``Allocate`` with ONE container per call and
  records the devices (kubelet's checkpoint) as soon as Allocate returns; an error rejects
  the pod (it is no longer an active pod). Start (`start_containers(pod)`): for each container, for
  each of its resources, ``PreStartContainer`` with the container's device IDs when the
  plugin asked for it; the first error stops that container's start (`StartError`: kubelet
  reports it and retries the start; the pod stays active and keeps its devices);
- the pod-resources API (``v1.PodResourcesLister/List``) on its own socket
  (`pod_resources_socket`, ``<dir>-podres/kubelet.sock``; kubelet's is
  ``/var/lib/kubelet/pod-resources/kubelet.sock``): every active pod (admitted, or being
  admitted, and not released), each of its containers with, per resource, the devices
  recorded so far, one ``ContainerDevices`` entry per NUMA node the devices sit on (as
  kubelet groups them); ``Get`` and ``GetAllocatableResources`` are not served
  (UNIMPLEMENTED), CPU, memory and DRA fields stay empty;
- `restart()`: kubelet restarting: its servers stop, every socket in the device-plugin
  directory is deleted, ``kubelet.sock`` and the pod-resources socket are created again;
  the checkpoint and the active pods survive.
Pods are plain v1.Pod JSON (e.g. from the fake apiserver).
"""

from __future__ import annotations

import random
import threading
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from k8s_bridge.deviceplugin.v1beta1 import api_pb2 as pb
from k8s_bridge.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from k8s_bridge.podresources.v1 import api_pb2 as pr
from k8s_bridge.podresources.v1 import api_pb2_grpc as pr_grpc

SOCKET = "kubelet.sock"
HEALTHY = "Healthy"


class AdmissionError(Exception):
    """kubelet would fail the pod with UnexpectedAdmissionError; `code` is the gRPC status."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code


class StartError(AdmissionError):
    """The pod was admitted (its devices allocated) but a container could not start
    (PreStartContainer failed): kubelet keeps the pod and its devices and retries."""


@dataclass
class _Plugin:
    resource: str
    endpoint: str
    options: pb.DevicePluginOptions
    channel: grpc.Channel
    stub: pb_grpc.DevicePluginStub
    devices: dict[str, str] = field(default_factory=dict)
    numa: dict[str, int | None] = field(default_factory=dict)  # device -> its NUMA node
    updates: int = 0
    stream: Any = None
    alive: bool = True


@dataclass
class ContainerResult:
    envs: dict[str, str] = field(default_factory=dict)
    mounts: list[pb.Mount] = field(default_factory=list)
    devices: list[pb.DeviceSpec] = field(default_factory=list)
    ids: dict[str, list[str]] = field(default_factory=dict)


class _Registration(pb_grpc.RegistrationServicer):
    def __init__(self, kubelet: FakeKubelet) -> None:
        self.kubelet = kubelet

    def Register(self, request: pb.RegisterRequest, context: Any) -> pb.Empty:
        if request.version != "v1beta1":
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"unsupported version {request.version}"
            )
        if "/" not in request.resource_name:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "resource name must be <domain>/<name>")
        self.kubelet._connect(request)
        return pb.Empty()


class _PodResources(pr_grpc.PodResourcesListerServicer):
    def __init__(self, kubelet: FakeKubelet) -> None:
        self.kubelet = kubelet

    def List(
        self, request: pr.ListPodResourcesRequest, context: Any
    ) -> pr.ListPodResourcesResponse:
        return self.kubelet.list_pod_resources()


def _serve(socket: Path, add: Any, servicer: Any) -> grpc.Server:
    """A gRPC server for one servicer on a (fresh) unix socket."""
    socket.parent.mkdir(parents=True, exist_ok=True)
    socket.unlink(missing_ok=True)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    add(servicer, server)
    server.add_insecure_port(f"unix://{socket}")
    server.start()
    return server


class FakeKubelet:
    def __init__(self, plugin_dir: str | Path, shuffle_resources: bool = False, seed: int = 0):
        self.dir = Path(plugin_dir)
        self.plugins: dict[str, _Plugin] = {}
        self.allocated: dict[tuple[str, str, str], list[str]] = {}  # the checkpoint
        self.results: dict[tuple[str, str], ContainerResult] = {}
        # active pods, in admission order: uid -> (namespace, name, container names)
        self.active: dict[str, tuple[str, str, list[str]]] = {}
        self.calls: list[str] = []
        self.shuffle = shuffle_resources
        self.rng = random.Random(seed)
        self.lock = threading.RLock()
        self.registered = threading.Condition(self.lock)
        self._server: grpc.Server | None = None
        self._pod_resources: grpc.Server | None = None

    @property
    def socket(self) -> Path:
        return self.dir / SOCKET

    @property
    def pod_resources_socket(self) -> Path:
        return self.dir.with_name(f"{self.dir.name}-podres") / SOCKET

    # -- lifecycle --
    def start(self) -> FakeKubelet:
        self._server = _serve(
            self.socket, pb_grpc.add_RegistrationServicer_to_server, _Registration(self)
        )
        self._pod_resources = _serve(
            self.pod_resources_socket,
            pr_grpc.add_PodResourcesListerServicer_to_server,
            _PodResources(self),
        )
        return self

    def stop(self) -> None:
        for server in (self._server, self._pod_resources):
            if server is not None:
                server.stop(0).wait(2)
        self._server = self._pod_resources = None
        self.pod_resources_socket.unlink(missing_ok=True)
        with self.lock:
            for p in self.plugins.values():
                p.alive = False
                if p.stream is not None:
                    p.stream.cancel()
                p.channel.close()
            self.plugins = {}

    def restart(self) -> None:
        """kubelet restarts: all sockets in the directory go, kubelet.sock comes back."""
        self.stop()
        for sock in self.dir.glob("*.sock"):
            sock.unlink(missing_ok=True)
        self.start()

    # -- registration and ListAndWatch --
    def _connect(self, req: pb.RegisterRequest) -> None:
        channel = grpc.insecure_channel(f"unix://{self.dir / req.endpoint}")
        stub = pb_grpc.DevicePluginStub(channel)
        options = stub.GetDevicePluginOptions(pb.Empty(), timeout=5)
        self.calls.append(f"GetDevicePluginOptions {req.resource_name}")
        plugin = _Plugin(req.resource_name, req.endpoint, options, channel, stub)
        with self.lock:
            old = self.plugins.get(req.resource_name)
            if old is not None and old.alive:
                old.alive = False
                if old.stream is not None:
                    old.stream.cancel()
            self.plugins[req.resource_name] = plugin
        threading.Thread(target=self._list_and_watch, args=(plugin,), daemon=True).start()

    def _list_and_watch(self, plugin: _Plugin) -> None:
        stream = plugin.stub.ListAndWatch(pb.Empty())
        plugin.stream = stream
        try:
            for resp in stream:
                with self.registered:
                    plugin.devices = {d.ID: d.health for d in resp.devices}
                    plugin.numa = {
                        d.ID: d.topology.nodes[0].ID if d.topology.nodes else None
                        for d in resp.devices
                    }
                    plugin.updates += 1
                    self.registered.notify_all()
        except grpc.RpcError:
            pass
        with self.registered:
            plugin.alive = False
            self.registered.notify_all()

    def wait_ready(self, resources: list[str], timeout: float = 10.0) -> None:
        """Until every resource has a live plugin that has listed its devices."""
        with self.registered:
            ok = self.registered.wait_for(
                lambda: all(
                    r in self.plugins and self.plugins[r].alive and self.plugins[r].updates > 0
                    for r in resources
                ),
                timeout,
            )
        if not ok:
            raise TimeoutError(f"plugins for {resources} did not register and list devices")

    def capacity(self, resource: str) -> tuple[int, int]:
        """(healthy devices, allocatable now) of a resource, as kubelet reports it."""
        with self.lock:
            p = self.plugins.get(resource)
            if p is None:
                return 0, 0
            healthy = {d for d, h in p.devices.items() if h == HEALTHY}
            used = {d for (_, _, r), ids in self.allocated.items() if r == resource for d in ids}
            return len(healthy), len(healthy - used)

    # -- admission and start --
    def admit(self, pod: dict[str, Any]) -> dict[str, ContainerResult]:
        """Admit the pod (Allocate every extended resource of every container), then start
        its containers (PreStartContainer), as kubelet does."""
        out = self.admit_only(pod)
        self.start_containers(pod)
        return out

    def admit_only(self, pod: dict[str, Any]) -> dict[str, ContainerResult]:
        """Admission: allocate; an error rejects the pod (no longer active)."""
        meta = pod["metadata"]
        uid = meta["uid"]
        names = [c["name"] for c in pod["spec"]["containers"]]
        with self.lock:
            self.active[uid] = (meta.get("namespace", "default"), meta["name"], names)
        out: dict[str, ContainerResult] = {}
        try:
            for c in pod["spec"]["containers"]:
                limits = (c.get("resources") or {}).get("limits") or {}
                resources = [r for r in limits if "/" in r]  # extended resources only
                if self.shuffle:
                    self.rng.shuffle(resources)
                result = self.results.setdefault((uid, c["name"]), ContainerResult())
                for resource in resources:
                    self.allocate_resource(
                        uid, c["name"], resource, int(limits[resource]), result
                    )
                out[c["name"]] = result
        except AdmissionError:
            with self.lock:
                self.active.pop(uid, None)  # rejected: not an active pod any more
            raise
        return out

    def start_containers(self, pod: dict[str, Any]) -> None:
        """Start each container: PreStartContainer per resource with its devices (when the
        plugin asked for it). `StartError` on the first refusal; the pod keeps its devices."""
        uid = pod["metadata"]["uid"]
        for c in pod["spec"]["containers"]:
            key = (uid, c["name"])
            with self.lock:
                held = {r: ids for (u, n, r), ids in self.allocated.items() if (u, n) == key}
            for resource, ids in held.items():
                self.pre_start(resource, ids)

    def pre_start(self, resource: str, ids: list[str]) -> None:
        with self.lock:
            plugin = self.plugins.get(resource)
        if plugin is None or not plugin.alive:
            raise StartError(f"no device plugin for {resource}")
        if not plugin.options.pre_start_required:
            return
        try:
            plugin.stub.PreStartContainer(pb.PreStartContainerRequest(devices_ids=ids), timeout=10)
            self.calls.append(f"PreStartContainer {resource}")
        except grpc.RpcError as exc:
            raise StartError(f"PreStartContainer {resource}: {exc.details()}", exc.code()) from exc

    def list_pod_resources(self) -> pr.ListPodResourcesResponse:
        """The pod-resources API's List: active pods, devices recorded so far."""
        with self.lock:
            pods = []
            for uid, (namespace, name, containers) in self.active.items():
                out = []
                for cname in containers:
                    devices = []
                    for (u, n, resource), ids in self.allocated.items():
                        if (u, n) != (uid, cname):
                            continue
                        numa = self.plugins[resource].numa if resource in self.plugins else {}
                        by_node: dict[int | None, list[str]] = {}
                        for d in ids:
                            by_node.setdefault(numa.get(d), []).append(d)
                        for node, group in by_node.items():
                            topo = (
                                pr.TopologyInfo(nodes=[pr.NUMANode(ID=node)])
                                if node is not None
                                else None
                            )
                            devices.append(
                                pr.ContainerDevices(
                                    resource_name=resource, device_ids=group, topology=topo
                                )
                            )
                    out.append(pr.ContainerResources(name=cname, devices=devices))
                pods.append(pr.PodResources(name=name, namespace=namespace, containers=out))
        return pr.ListPodResourcesResponse(pod_resources=pods)

    def allocate_resource(
        self, uid: str, cname: str, resource: str, n: int, out: ContainerResult
    ) -> None:
        """One resource of one container (kubelet's devicemanager.Allocate for it): the
        devices are recorded when Allocate returns (PreStartContainer comes at `start`)."""
        with self.lock:
            plugin = self.plugins.get(resource)
            if plugin is None or not plugin.alive:
                raise AdmissionError(f"no device plugin for {resource}")
            key = (uid, cname, resource)
            ask = False
            free: list[str] = []
            if key in self.allocated:  # kubelet re-uses the checkpointed devices
                ids = self.allocated[key]
            else:
                used = {d for k, v in self.allocated.items() if k[2] == resource for d in v}
                free = sorted(
                    d for d, h in plugin.devices.items() if h == HEALTHY and d not in used
                )
                if len(free) < n:
                    raise AdmissionError(f"{resource}: requested {n}, available {len(free)}")
                ids = free[:n]
                ask = plugin.options.get_preferred_allocation_available
        # kubelet unlocks its device manager around the GetPreferredAllocation call (the
        # plugin may read the pod-resources API meanwhile)
        if key not in self.allocated and ask:
            ids = self._preferred(plugin, free, n) or ids
        try:
            resp = plugin.stub.Allocate(
                pb.AllocateRequest(
                    container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)]
                ),
                timeout=10,
            )
            self.calls.append(f"Allocate {resource} {len(ids)}")
        except grpc.RpcError as exc:
            raise AdmissionError(f"Allocate {resource}: {exc.details()}", exc.code()) from exc
        if len(resp.container_responses) != 1:
            raise AdmissionError(f"Allocate {resource}: {len(resp.container_responses)} answers")
        with self.lock:
            self.allocated[(uid, cname, resource)] = list(ids)
        r = resp.container_responses[0]
        out.envs.update(dict(r.envs))
        out.mounts.extend(r.mounts)
        out.devices.extend(r.devices)
        out.ids[resource] = list(ids)

    def _preferred(self, plugin: _Plugin, free: list[str], n: int) -> list[str] | None:
        try:
            resp = plugin.stub.GetPreferredAllocation(
                pb.PreferredAllocationRequest(
                    container_requests=[
                        pb.ContainerPreferredAllocationRequest(
                            available_deviceIDs=free, must_include_deviceIDs=[], allocation_size=n
                        )
                    ]
                ),
                timeout=10,
            )
            self.calls.append(f"GetPreferredAllocation {plugin.resource} {n}")
        except grpc.RpcError as exc:
            raise AdmissionError(
                f"GetPreferredAllocation {plugin.resource}: {exc.details()}", exc.code()
            ) from exc
        ids = list(resp.container_responses[0].deviceIDs) if resp.container_responses else []
        if len(ids) != n or len(set(ids)) != n or not set(ids) <= set(free):
            return None  # kubelet ignores an invalid preference
        return ids

    def release(self, pod_uid: str) -> None:
        """The pod is gone: its devices return to the pool."""
        with self.lock:
            self.active.pop(pod_uid, None)
            for key in [k for k in self.allocated if k[0] == pod_uid]:
                del self.allocated[key]
            for key in [k for k in self.results if k[0] == pod_uid]:
                del self.results[key]
