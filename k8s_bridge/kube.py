"""Apiserver access for the bridge: the official `kubernetes` client, raw JSON in and out.

Owns how the bridge talks to the apiserver: building an `ApiClient` (in-cluster, kubeconfig
or an explicit host), reading objects as plain JSON (``_preload_content=False``, then the
bridge's own pydantic models — faster than the client's model layer and tolerant of fields
the client does not know), patches with the right content types, the Binding call (checked
for HTTP 201, never retried on a client-side error) and the per-node lock. The calls made
for every bind (get pod, patch node, Binding) skip the client's model layer: over
`k8s_bridge.lean_http.LeanTransport` when it covers the configuration (the default: a
quarter of the CPU of a library call, see docs/results.md), else straight over the official
client's own urllib3 pool (`k8s_bridge.apiserver_http.ApiserverHTTP`); both use the same
host, TLS settings and credentials as the client. Every name that goes into a URL is
escaped as one path segment (`api_path`).
"""

from __future__ import annotations

import http.client
import json
import logging
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import urllib3
from kubernetes import client, config
from kubernetes.client.rest import ApiException

from k8s_bridge.apiserver_http import ApiserverHTTP, api_path
from k8s_bridge.lean_http import LeanTransport
from k8s_bridge.protocol import NodeLock, load_lock
from k8s_bridge.resources import Names
from qgpu.errors import QgpuError

Obj = dict[str, Any]
log = logging.getLogger(__name__)

TRANSPORTS = ("auto", "lean", "library")
MERGE = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"


class KubeError(QgpuError):
    """An apiserver call failed; `status` is the HTTP code (0 when none came back)."""

    def __init__(self, message: str, status: int = 0, reason: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason


class Conflict(KubeError):
    """HTTP 409: a resourceVersion precondition or an already-bound pod."""


def _wrap(exc: ApiException, what: str) -> KubeError:
    return _status_error(what, exc.status or 0, exc.reason or "", exc.body)


def _status_error(what: str, status: int, reason: str, body: Any) -> KubeError:
    """The apiserver's error answer (a Status object, usually) as a KubeError."""
    message = ""
    try:
        data = json.loads(body or "{}")
        reason = data.get("reason") or reason
        message = data.get("message") or ""
    except (json.JSONDecodeError, TypeError, AttributeError):
        message = str(body or "")[:200]
    cls = Conflict if status == 409 else KubeError
    return cls(f"{what}: HTTP {status} {reason}: {message}".strip(), status, reason)


@contextmanager
def _calling(what: str) -> Iterator[None]:
    """Map a failed call to `KubeError`: the apiserver's answer (`_wrap`), or status 0 when
    no answer came (connection refused/reset, timeout): the caller then cannot know whether
    a write happened."""
    try:
        yield
    except ApiException as exc:
        raise _wrap(exc, what) from exc
    except (urllib3.exceptions.HTTPError, OSError) as exc:
        raise KubeError(f"{what}: no answer from the apiserver: {exc}") from exc


def make_api_client(host: str | None = None, kubeconfig: str | None = None) -> client.ApiClient:
    """An ApiClient for `host` (tests, proxies), a kubeconfig, or the in-cluster account."""
    if host:
        cfg = client.Configuration()
        cfg.host = host
        return client.ApiClient(cfg)
    if kubeconfig:
        return config.new_client_from_config(config_file=kubeconfig)
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()


def _rv(obj: Obj) -> int:
    try:
        return int(obj["metadata"].get("resourceVersion") or 0)
    except ValueError:
        return 0


def _pointer(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


class Kube:
    """The handful of apiserver calls the bridge makes, as JSON dicts."""

    def __init__(self, api_client: client.ApiClient, names: Names, transport: str = "auto") -> None:
        self.api_client = api_client
        self.core = client.CoreV1Api(api_client)
        self.names = names
        # the per-bind calls (get pod, patch node, Binding); everything else goes through
        # the official client
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, not {transport!r}")
        lean = (
            LeanTransport.for_configuration(api_client.configuration)
            if transport != "library"
            else None
        )
        if transport == "lean" and lean is None:
            raise ValueError("the lean transport does not cover this client configuration")
        self.http: LeanTransport | ApiserverHTTP = lean or ApiserverHTTP(api_client)

    def _call(
        self, what: str, method: str, path: str, body: Any = None, content_type: str = ""
    ) -> tuple[int, bytes]:
        """One call over the client's pool; any non-2xx answer raises KubeError."""
        data = None if body is None else json.dumps(body).encode()
        try:
            status, raw = self.http.request(method, path, data, content_type or None)
        except (OSError, http.client.HTTPException, urllib3.exceptions.HTTPError) as exc:
            raise KubeError(f"{what}: no answer from the apiserver: {exc}") from exc
        if not 200 <= status <= 299:
            raise _status_error(what, status, "", raw)
        return status, raw

    @staticmethod
    def _json(resp: Any) -> Obj:
        return json.loads(resp.data)

    # -- reads --
    def get_node(self, name: str) -> Obj:
        with _calling(f"get node {name}"):
            return self._json(self.core.read_node(name, _preload_content=False))

    def list_nodes(self) -> tuple[list[Obj], str]:
        with _calling("list nodes"):
            body = self._json(self.core.list_node(_preload_content=False))
        return body.get("items") or [], body["metadata"].get("resourceVersion", "")

    def get_pod(self, namespace: str, name: str) -> Obj:
        what = f"get pod {namespace}/{name}"
        path = api_path("api", "v1", "namespaces", namespace, "pods", name)
        return json.loads(self._call(what, "GET", path)[1])

    def list_pods(
        self, label_selector: str = "", field_selector: str = ""
    ) -> tuple[list[Obj], str]:
        with _calling("list pods"):
            body = self._json(
                self.core.list_pod_for_all_namespaces(
                    label_selector=label_selector,
                    field_selector=field_selector,
                    _preload_content=False,
                )
            )
        return body.get("items") or [], body["metadata"].get("resourceVersion", "")

    def pods_on_node(self, node: str) -> list[Obj]:
        """Pods bound to `node` (the device plugin's view of its node)."""
        return self.list_pods(field_selector=f"spec.nodeName={node}")[0]

    # -- writes --
    def patch_node(self, name: str, body: Any, content_type: str = MERGE) -> Obj:
        path = api_path("api", "v1", "nodes", name)
        return json.loads(self._call(f"patch node {name}", "PATCH", path, body, content_type)[1])

    def patch_pod(self, namespace: str, name: str, body: Any, content_type: str = MERGE) -> Obj:
        with _calling(f"patch pod {namespace}/{name}"):
            return self._json(
                self.core.patch_namespaced_pod(
                    name, namespace, body, _content_type=content_type, _preload_content=False
                )
            )

    def bind(
        self,
        namespace: str,
        name: str,
        uid: str,
        node: str,
        annotations: dict[str, str] | None = None,
        resource_version: str | None = None,
    ) -> None:
        """Create the Binding; raise KubeError unless the apiserver answered 201.

        The apiserver copies the Binding's annotations onto the pod in the same write that
        binds it, and checks the UID and resourceVersion preconditions (409 Conflict).
        Made over `ApiserverHTTP` (the official client cannot deserialize the Status the
        apiserver returns); a bind whose answer did not come back may have succeeded on the
        server, so it is never retried blindly.
        """
        meta: Obj = {"name": name, "namespace": namespace, "uid": uid}
        if annotations:
            meta["annotations"] = dict(annotations)
        if resource_version:
            meta["resourceVersion"] = resource_version
        body = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": meta,
            "target": {"apiVersion": "v1", "kind": "Node", "name": node},
        }
        what = f"bind pod {namespace}/{name} to {node}"
        path = api_path("api", "v1", "namespaces", namespace, "pods", name, "binding")
        status, _ = self._call(what, "POST", path, body, "application/json")
        if status != 201:
            raise KubeError(f"bind pod {namespace}/{name}: HTTP {status}", status)

    def publish_node_annotations(self, node: str, annotations: dict[str, str | None]) -> Obj:
        return self.patch_node(node, {"metadata": {"annotations": annotations}})


# --- the per-node lock -------------------------------------------------------------------


@dataclass
class LockHandle:
    node: str
    lock: NodeLock
    text: str
    previous_epoch: int
    epoch: int


class NodeLockError(KubeError):
    """The node's lock could not be taken before the deadline."""


def node_epoch(node_obj: Obj, names: Names) -> int:
    text = ((node_obj.get("metadata") or {}).get("annotations") or {}).get(names.epoch_annotation)
    try:
        return int(text) if text else 0
    except ValueError:
        return 0


def current_lock(node_obj: Obj, names: Names) -> NodeLock | None:
    text = ((node_obj.get("metadata") or {}).get("annotations") or {}).get(names.lock_annotation)
    if not text:
        return None
    try:
        return load_lock(text)
    except QgpuError:
        return None  # an unreadable lock is treated as absent: it can never be released


@dataclass(frozen=True)
class HolderPod:
    """The pod a lock holder runs in (from the downward API): its lock names it, so a lock
    whose pod is gone can be taken over."""

    namespace: str
    name: str
    uid: str

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}"


GONE_CHECK_S = 1.0  # a holder found alive is not asked about again for this long


class NodeLocker:
    """Per-node lock: an annotation (holder, expiry) taken with a resourceVersion precondition.

    `acquire` patches the lock in with the node's last-seen resourceVersion (cached from the
    previous release, so an uncontended bind costs one call) and bumps the node's epoch
    annotation in the same write; a 409 re-reads the node and retries. The caller compares
    `LockHandle.previous_epoch` with the epoch it last wrote: a difference means another
    writer locked the node in between, so its view of that node must be re-read. A lock held
    by someone else is waited on until it is released or expires (`ttl_s`) -- or taken over
    at once when its holder is provably gone: its lock names a pod (`HolderPod`) and that
    pod no longer exists, has another UID, or has terminated. A lock held under our own
    holder name (a restarted extender with a stable name: the same pod) is ours again.
    `release` removes it with a JSON-patch ``test`` of our own value (a lock that expired
    and was taken over is left alone).
    """

    def __init__(
        self,
        kube: Kube,
        holder: str | None = None,
        ttl_s: float = 30.0,
        pod: HolderPod | None = None,
    ) -> None:
        self.kube = kube
        self.names = kube.names
        self.holder = holder or f"qgpu-extender-{uuid.uuid4().hex[:8]}"
        self.ttl_s = ttl_s
        self.pod = pod
        self._seen: dict[str, Obj] = {}
        self._alive: dict[tuple[str, str], float] = {}  # (pod, uid) -> monotonic checked

    def holder_gone(self, lock: NodeLock) -> bool:
        """Is the lock's holder provably gone (its pod deleted, replaced or terminated)?
        False when the lock names no pod or the apiserver cannot tell."""
        if not lock.pod or not lock.pod_uid or "/" not in lock.pod:
            return False
        key = (lock.pod, lock.pod_uid)
        checked = self._alive.get(key)
        if checked is not None and time.monotonic() - checked < GONE_CHECK_S:
            return False
        namespace, name = lock.pod.split("/", 1)
        try:
            pod = self.kube.get_pod(namespace, name)
        except KubeError as exc:  # no answer, or not allowed to look: not provably gone
            return exc.status == 404
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        if meta.get("uid") != lock.pod_uid or status.get("phase") in ("Succeeded", "Failed"):
            return True
        self._alive[key] = time.monotonic()
        return False

    def remember(self, node_obj: Obj) -> None:
        """Cache the node as seen (a watch event may be older than our own last write)."""
        name = node_obj["metadata"]["name"]
        known = self._seen.get(name)
        if known is not None and _rv(node_obj) < _rv(known):
            return
        self._seen[name] = node_obj

    def acquire(self, node: str, timeout_s: float = 5.0) -> tuple[LockHandle, Obj]:
        """Take the node's lock; returns the handle and the node as it was when taken."""
        deadline = time.monotonic() + timeout_s
        obj = self._seen.get(node)
        delay = 0.005
        while True:
            if obj is None:
                obj = self.kube.get_node(node)
            now = time.time()
            held = current_lock(obj, self.names)
            if (
                held is not None
                and held.expires > now
                and held.holder != self.holder
                and not self.holder_gone(held)
            ):
                if time.monotonic() >= deadline:
                    raise NodeLockError(
                        f"node {node} is locked by {held.holder} until {held.expires:.0f}",
                        409,
                        "Locked",
                    )
                time.sleep(delay)
                delay = min(delay * 2, 0.1)
                obj = None
                continue
            if held is not None and held.expires > now and held.holder != self.holder:
                log.warning(
                    "node %s: taking over the lock of %s (its pod %s is gone)",
                    node,
                    held.holder,
                    held.pod,
                )
            lock = NodeLock(
                holder=self.holder,
                expires=now + self.ttl_s,
                pod=self.pod.ref if self.pod else None,
                pod_uid=self.pod.uid if self.pod else None,
            )
            text = lock.model_dump_json(exclude_none=True)
            previous = node_epoch(obj, self.names)
            body = {
                "metadata": {
                    "resourceVersion": obj["metadata"]["resourceVersion"],
                    "annotations": {
                        self.names.lock_annotation: text,
                        self.names.epoch_annotation: str(previous + 1),
                    },
                }
            }
            try:
                new = self.kube.patch_node(node, body)
            except Conflict:
                if time.monotonic() >= deadline:
                    raise
                obj = None
                continue
            self._seen[node] = new
            return LockHandle(node, lock, text, previous, previous + 1), obj

    def still_ours(self, handle: LockHandle) -> bool:
        """Does the node, as last seen (watch events, our own writes), still carry our lock?"""
        obj = self._seen.get(handle.node)
        if obj is None:
            return False
        annotations = obj["metadata"].get("annotations") or {}
        return annotations.get(self.names.lock_annotation) == handle.text

    def release(self, handle: LockHandle) -> None:
        key = _pointer(self.names.lock_annotation)
        ops: list[Obj] = [
            {"op": "test", "path": f"/metadata/annotations/{key}", "value": handle.text},
            {"op": "remove", "path": f"/metadata/annotations/{key}"},
        ]
        try:
            self._seen[handle.node] = self.kube.patch_node(handle.node, ops, JSON_PATCH)
        except KubeError:
            # Our lock expired and was taken over (test failed) or the call failed: forget the
            # cached node so the next acquire re-reads it. An unreleased lock expires by itself.
            self._seen.pop(handle.node, None)
            raise
