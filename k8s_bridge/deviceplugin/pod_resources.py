"""Which pod container did kubelet give these device IDs? kubelet's pod-resources API.

Kubelet's Allocate and PreStartContainer name device IDs only, never the pod. Kubelet
records a container's devices (its device manager's ``podDevices``, checkpointed) as soon
as the plugin's Allocate returns, before it calls PreStartContainer, and serves them on
its pod-resources socket (``/var/lib/kubelet/pod-resources/kubelet.sock``, gRPC
``v1.PodResourcesLister``, vendored in `k8s_bridge.podresources.v1`): ``List`` answers
every active pod on the node with, per container, ``ContainerDevices`` entries
(``resource_name``, ``device_ids``; one entry per NUMA node a resource's devices sit on).

This module owns the client: `PodResourcesClient.owner(resource, ids)` is the container
that holds exactly these IDs of that resource (the union of its entries), or None. The
device plugin asks it at PreStartContainer (`k8s_bridge.deviceplugin.server`).
"""

from __future__ import annotations

import threading
from pathlib import Path

import grpc
from pydantic import BaseModel, ConfigDict

from k8s_bridge.podresources.v1 import api_pb2 as pr
from k8s_bridge.podresources.v1 import api_pb2_grpc as pr_grpc

DEFAULT_POD_RESOURCES_SOCKET = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
# kubelet's answer grows with the pods and devices of a node; dcgm-exporter reads it with
# a 16 MiB limit too (gRPC's default is 4 MiB)
MAX_MESSAGE_BYTES = 16 * 1024 * 1024


class PodResourcesUnavailable(Exception):
    """kubelet's pod-resources API did not answer (message says where and why)."""


class ContainerRef(BaseModel):
    """A container as kubelet's pod-resources API names it (no pod UID there)."""

    model_config = ConfigDict(frozen=True)

    namespace: str
    pod: str
    container: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.pod}/{self.container}"


class PodResourcesClient:
    """A client of kubelet's ``v1.PodResourcesLister`` on a unix socket (one channel,
    reconnected by gRPC when kubelet restarts)."""

    def __init__(self, socket: Path, timeout_s: float = 5.0) -> None:
        self.socket = Path(socket)
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._channel: grpc.Channel | None = None
        self._stub: pr_grpc.PodResourcesListerStub | None = None

    def _lister(self) -> pr_grpc.PodResourcesListerStub:
        with self._lock:
            if self._stub is None:
                self._channel = grpc.insecure_channel(
                    f"unix://{self.socket}",
                    options=[
                        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                        # kubelet restarts recreate the socket: reconnect within a second
                        ("grpc.initial_reconnect_backoff_ms", 100),
                        ("grpc.max_reconnect_backoff_ms", 1000),
                    ],
                )
                self._stub = pr_grpc.PodResourcesListerStub(self._channel)
            return self._stub

    def close(self) -> None:
        with self._lock:
            if self._channel is not None:
                self._channel.close()
            self._channel = self._stub = None

    def devices(self) -> dict[tuple[ContainerRef, str], frozenset[str]]:
        """(container, resource name) -> the device IDs kubelet holds for it, now."""
        try:
            # wait_for_ready: a kubelet restarting answers within the timeout
            resp = self._lister().List(
                pr.ListPodResourcesRequest(), timeout=self.timeout_s, wait_for_ready=True
            )
        except grpc.RpcError as exc:
            raise PodResourcesUnavailable(
                f"kubelet's pod-resources API on {self.socket} did not answer List: "
                f"{exc.code().name}: {exc.details()}"
            ) from exc
        out: dict[tuple[ContainerRef, str], frozenset[str]] = {}
        for pod in resp.pod_resources:
            for c in pod.containers:
                ref = ContainerRef(namespace=pod.namespace, pod=pod.name, container=c.name)
                for dev in c.devices:
                    key = (ref, dev.resource_name)
                    out[key] = out.get(key, frozenset()) | frozenset(dev.device_ids)
        return out

    def owner(self, resource: str, ids: list[str]) -> ContainerRef | None:
        """The container kubelet holds exactly `ids` of `resource` for (None: no one)."""
        return owner_in(self.devices(), resource, ids)


def owner_in(
    held: dict[tuple[ContainerRef, str], frozenset[str]], resource: str, ids: list[str]
) -> ContainerRef | None:
    """In one `PodResourcesClient.devices()` answer: who holds exactly `ids` of `resource`."""
    want = frozenset(ids)
    for (ref, name), have in held.items():
        if name == resource and have == want:
            return ref
    return None
