"""A small, faithful fake Kubernetes apiserver: real HTTP on loopback, for the official client.

Serves only what qgpu's Kubernetes bridge uses, with the apiserver's semantics:
- ``/api/v1/nodes`` list/watch, ``/api/v1/nodes/{name}`` get/patch/delete;
- ``/api/v1/pods`` and ``/api/v1/namespaces/{ns}/pods`` list/watch/create,
  ``.../pods/{name}`` get/patch/delete, ``.../pods/{name}/binding`` create (UID and
  resourceVersion preconditions; the Binding's annotations are copied onto the pod in the
  same write, as the real binding storage does);
- list/watch take ``labelSelector`` (``k``, ``!k``, ``k=v``, ``k==v``, ``k!=v``,
  ``k in (a,b)``, ``k notin (a,b)``) and ``fieldSelector`` (``metadata.name``,
  ``metadata.namespace``, ``spec.nodeName``, ``spec.schedulerName``, ``status.phase`` with
  ``=``/``==``/``!=``);
- patches: ``application/json-patch+json`` (add/remove/replace/test/copy/move),
  ``application/merge-patch+json`` (RFC 7386) and ``application/strategic-merge-patch+json``
  (merge semantics for maps; lists are replaced, which is all the bridge relies on);
  a ``metadata.resourceVersion`` in the patch is a precondition -> 409 Conflict;
- every object carries a ``resourceVersion`` from one global counter; watches stream
  newline-delimited events from a bounded history (an object entering a watch's selector
  arrives as ADDED, one leaving it as DELETED) (an older resourceVersion gets an ERROR
  event with a 410 Expired Status, as the real server sends);
- errors are ``Status`` objects with the real reasons and codes; a Binding returns a 201
  Success Status (the reply the Python client fails to deserialize).

Tests drive it over HTTP through the `kubernetes` client and inspect/seed it through
`FakeApiserver.store` directly. `FakeApiserver.fail_next(...)` injects faults.

``FakeApiserver(tls=ctx, token=...)`` serves HTTPS with a server-side `ssl.SSLContext`
(make it ``CERT_OPTIONAL`` with a client CA to accept client certificates) and, as the real
apiserver without anonymous access, answers 401 Unauthorized to a request that brings
neither the bearer token nor a verified client certificate.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import re
import socket
import ssl
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

Obj = dict[str, Any]

_HISTORY = 20_000


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str, details: Obj | None = None):
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details or {}

    def status(self) -> Obj:
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "details": self.details,
            "code": self.code,
        }


def _not_found(kind: str, name: str) -> ApiError:
    return ApiError(404, "NotFound", f'{kind} "{name}" not found', {"name": name, "kind": kind})


def _conflict(kind: str, name: str, why: str) -> ApiError:
    return ApiError(
        409,
        "Conflict",
        f'Operation cannot be fulfilled on {kind} "{name}": {why}',
        {"name": name, "kind": kind},
    )


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# --- selectors ---------------------------------------------------------------------------

_SET_RE = re.compile(r"^\s*([^\s!=]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")


def _split_selector(text: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur)
    return [p.strip() for p in parts if p.strip()]


def label_matcher(text: str | None) -> Callable[[dict[str, str]], bool]:
    if not text:
        return lambda _labels: True
    tests: list[Callable[[dict[str, str]], bool]] = []
    for term in _split_selector(text):
        m = _SET_RE.match(term)
        if m:
            key, op, values = m.group(1), m.group(2), {v.strip() for v in m.group(3).split(",")}
            if op == "in":
                tests.append(lambda ls, k=key, vs=values: ls.get(k) in vs)
            else:
                tests.append(lambda ls, k=key, vs=values: ls.get(k) not in vs)
        elif "!=" in term:
            key, value = (s.strip() for s in term.split("!=", 1))
            tests.append(lambda ls, k=key, v=value: ls.get(k) != v)
        elif "=" in term:
            key, value = (s.strip() for s in re.split(r"==?", term, maxsplit=1))
            tests.append(lambda ls, k=key, v=value: ls.get(k) == v)
        elif term.startswith("!"):
            absent = term[1:].strip()
            tests.append(lambda ls, k=absent: k not in ls)
        else:
            tests.append(lambda ls, k=term: k in ls)
    return lambda labels: all(t(labels) for t in tests)


_FIELDS = {
    "metadata.name": ("metadata", "name"),
    "metadata.namespace": ("metadata", "namespace"),
    "spec.nodeName": ("spec", "nodeName"),
    "spec.schedulerName": ("spec", "schedulerName"),
    "status.phase": ("status", "phase"),
}


def field_matcher(text: str | None) -> Callable[[Obj], bool]:
    if not text:
        return lambda _obj: True
    tests: list[Callable[[Obj], bool]] = []
    for term in _split_selector(text):
        neg = "!=" in term
        key, value = (s.strip() for s in re.split(r"!=|==?", term, maxsplit=1))
        if key not in _FIELDS:
            raise ApiError(
                400, "BadRequest", f'field label not supported: "{key}"', {"kind": "fieldSelector"}
            )
        a, b = _FIELDS[key]

        def get(obj: Obj, a: str = a, b: str = b) -> str:
            return str((obj.get(a) or {}).get(b) or "")

        if neg:
            tests.append(lambda o, g=get, v=value: g(o) != v)
        else:
            tests.append(lambda o, g=get, v=value: g(o) == v)
    return lambda obj: all(t(obj) for t in tests)


# --- patches -----------------------------------------------------------------------------


def merge_patch(target: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise ApiError(422, "Invalid", f"invalid JSON pointer {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _walk(doc: Any, parts: list[str]) -> Any:
    for p in parts:
        if isinstance(doc, list):
            doc = doc[int(p)]
        elif isinstance(doc, dict):
            doc = doc[p]
        else:
            raise KeyError(p)
    return doc


def json_patch(doc: Obj, ops: list[Obj]) -> Obj:
    doc = copy.deepcopy(doc)
    for op in ops:
        kind = op.get("op")
        parts = _pointer(op.get("path", ""))
        try:
            if kind == "test":
                if _walk(doc, parts) != op.get("value"):
                    raise ApiError(422, "Invalid", f"test operation failed at {op['path']}")
                continue
            if kind in ("copy", "move"):
                src = _pointer(op["from"])
                value = copy.deepcopy(_walk(doc, src))
                if kind == "move":
                    parent = _walk(doc, src[:-1])
                    del parent[int(src[-1]) if isinstance(parent, list) else src[-1]]
                kind, op = "add", {"op": "add", "path": op["path"], "value": value}
            parent = _walk(doc, parts[:-1])
            last = parts[-1]
            if kind == "add":
                if isinstance(parent, list):
                    parent.insert(len(parent) if last == "-" else int(last), op["value"])
                else:
                    parent[last] = op["value"]
            elif kind == "replace":
                if isinstance(parent, list):
                    parent[int(last)] = op["value"]
                else:
                    if last not in parent:
                        raise KeyError(last)
                    parent[last] = op["value"]
            elif kind == "remove":
                if isinstance(parent, list):
                    del parent[int(last)]
                else:
                    del parent[last]
            else:
                raise ApiError(422, "Invalid", f"unknown JSON patch op {kind!r}")
        except (KeyError, IndexError, ValueError, TypeError) as exc:
            raise ApiError(
                422, "Invalid", f"the JSON patch cannot be applied at {op.get('path')}: {exc}"
            ) from exc
    return doc


# --- the store ---------------------------------------------------------------------------


class Store:
    """Objects by (kind, namespace, name), a global resourceVersion and an event history."""

    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.rv = 1
        self.objects: dict[str, dict[tuple[str, str], Obj]] = {"nodes": {}, "pods": {}}
        self.history: deque[tuple[int, str, str, Obj, Obj | None]] = deque(maxlen=_HISTORY)
        self.counts: dict[str, int] = {}

    def _bump(self, kind: str, event: str, obj: Obj, prev: Obj | None = None) -> None:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        self.history.append((self.rv, kind, event, copy.deepcopy(obj), prev))
        self.lock.notify_all()

    def create(self, kind: str, obj: Obj, namespace: str = "") -> Obj:
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        if kind == "pods":
            meta["namespace"] = meta.get("namespace") or namespace or "default"
            obj.setdefault("spec", {}).setdefault("schedulerName", "default-scheduler")
            obj.setdefault("status", {}).setdefault("phase", "Pending")
            obj.setdefault("apiVersion", "v1")
            obj.setdefault("kind", "Pod")
        else:
            meta.pop("namespace", None)
            obj.setdefault("apiVersion", "v1")
            obj.setdefault("kind", "Node")
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        name = meta.get("name")
        if not name:
            raise ApiError(422, "Invalid", "metadata.name: Required value")
        key = (meta.get("namespace", ""), name)
        with self.lock:
            if key in self.objects[kind]:
                raise ApiError(
                    409,
                    "AlreadyExists",
                    f'{kind} "{name}" already exists',
                    {"name": name, "kind": kind},
                )
            meta["uid"] = meta.get("uid") or str(uuid.uuid4())
            meta.setdefault("creationTimestamp", _now())
            self.objects[kind][key] = obj
            self._bump(kind, "ADDED", obj)
            return copy.deepcopy(obj)

    def get(self, kind: str, namespace: str, name: str) -> Obj:
        with self.lock:
            obj = self.objects[kind].get((namespace, name))
            if obj is None:
                raise _not_found(kind, name)
            return copy.deepcopy(obj)

    def list(self, kind: str, namespace: str | None, labels: str | None, fields: str | None):
        lm, fm = label_matcher(labels), field_matcher(fields)
        with self.lock:
            items = [
                copy.deepcopy(o)
                for (ns, _), o in sorted(self.objects[kind].items())
                if (namespace is None or ns == namespace)
                and lm(o["metadata"].get("labels") or {})
                and fm(o)
            ]
            return items, str(self.rv)

    def update(self, kind: str, namespace: str, name: str, fn: Callable[[Obj], Obj]) -> Obj:
        """Replace an object with fn(copy); enforces a resourceVersion precondition."""
        with self.lock:
            cur = self.objects[kind].get((namespace, name))
            if cur is None:
                raise _not_found(kind, name)
            new = fn(copy.deepcopy(cur))
            meta = new.setdefault("metadata", {})
            want = meta.get("resourceVersion")
            if want is not None and want != cur["metadata"]["resourceVersion"]:
                raise _conflict(
                    kind,
                    name,
                    "the object has been modified; please apply your changes to the latest "
                    "version and try again",
                )
            for fixed in ("uid", "name", "namespace", "creationTimestamp"):
                if fixed in cur["metadata"]:
                    meta[fixed] = cur["metadata"][fixed]
            if new == cur:
                return copy.deepcopy(cur)
            self.objects[kind][(namespace, name)] = new
            self._bump(kind, "MODIFIED", new, cur)
            return copy.deepcopy(new)

    def delete(self, kind: str, namespace: str, name: str) -> Obj:
        with self.lock:
            obj = self.objects[kind].pop((namespace, name), None)
            if obj is None:
                raise _not_found(kind, name)
            self._bump(kind, "DELETED", obj)
            return copy.deepcopy(obj)

    def events_after(self, kind: str, rv: int) -> list[tuple[int, str, Obj, Obj | None]]:
        if not self.history:
            return []
        start = max(0, rv - self.history[0][0] + 1)  # rvs in the history are consecutive
        return [
            (r, e, o, p)
            for r, k, e, o, p in itertools.islice(self.history, start, None)
            if r > rv and k == kind
        ]

    def oldest_rv(self) -> int:
        return self.history[0][0] - 1 if self.history else self.rv

    # conveniences for tests
    def set_phase(self, namespace: str, name: str, phase: str) -> Obj:
        def fn(o: Obj) -> Obj:
            o.setdefault("status", {})["phase"] = phase
            return o

        return self.update("pods", namespace, name, fn)


_ROUTES = [
    (re.compile(r"^/api/v1/nodes$"), "nodes", False, False),
    (re.compile(r"^/api/v1/nodes/(?P<name>[^/]+)$"), "nodes", True, False),
    (re.compile(r"^/api/v1/pods$"), "pods", False, False),
    (re.compile(r"^/api/v1/namespaces/(?P<ns>[^/]+)/pods$"), "pods", False, False),
    (re.compile(r"^/api/v1/namespaces/(?P<ns>[^/]+)/pods/(?P<name>[^/]+)$"), "pods", True, False),
    (
        re.compile(r"^/api/v1/namespaces/(?P<ns>[^/]+)/pods/(?P<name>[^/]+)/binding$"),
        "pods",
        True,
        True,
    ),
]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def setup(self) -> None:
        super().setup()
        # Headers and body go out in separate writes: without this, Nagle's algorithm and
        # the client's delayed ACK add ~40 ms to every response.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format: str, *args: Any) -> None:
        pass

    # -- plumbing --
    def _send(self, code: int, body: Obj) -> None:
        if getattr(self, "_drop_reply", False):
            self._hang_up()
            return
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _hang_up(self) -> None:
        """Close the connection without an answer (a crashed or partitioned apiserver)."""
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)

    def _body(self) -> Any:
        raw = self._raw
        if not raw:
            return None
        try:
            return json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ApiError(400, "BadRequest", f"invalid JSON body: {exc}") from exc

    def _route(self) -> tuple[str, str | None, str | None, bool, dict[str, list[str]]]:
        url = urlsplit(self.path)
        for pattern, kind, _named, binding in _ROUTES:
            m = pattern.match(url.path)
            if m:
                gd = m.groupdict()
                ns = gd.get("ns")
                if kind == "nodes":
                    ns = ""
                return kind, ns, gd.get("name"), binding, parse_qs(url.query)
        raise ApiError(
            404, "NotFound", f"the server could not find the requested resource {url.path}"
        )

    def _authenticated(self) -> bool:
        owner = self.server.owner
        if owner.token is None and owner.tls is None:
            return True
        if owner.token is not None and self.headers.get("Authorization") == (
            f"Bearer {owner.token}"
        ):
            return True
        conn = self.connection
        return isinstance(conn, ssl.SSLSocket) and bool(conn.getpeercert())

    def _dispatch(self, method: str) -> None:
        # Read the whole body first, so an early error leaves the keep-alive stream clean.
        n = int(self.headers.get("Content-Length") or 0)
        self._raw = self.rfile.read(n) if n else b""
        self._drop_reply = False
        try:
            if not self._authenticated():
                raise ApiError(401, "Unauthorized", "Unauthorized")
            self.server.owner.count(method)
            drop = self.server.owner.take_drop(method, self.path)
            if drop == "before":
                self._hang_up()
                return
            self._drop_reply = drop == "after"
            fault = self.server.owner.take_fault(method, self.path)
            if fault is not None:
                raise fault
            kind, ns, name, binding, query = self._route()
            store = self.server.owner.store
            if method == "GET" and name is None:
                self._list_or_watch(kind, ns, query)
            elif method == "GET":
                self._send(200, store.get(kind, ns or "", name or ""))
            elif method == "POST" and binding:
                self._bind(ns or "", name or "")
            elif method == "POST" and name is None:
                self._send(201, store.create(kind, self._body() or {}, ns or ""))
            elif method == "PATCH" and name is not None:
                self._patch(kind, ns or "", name)
            elif method == "DELETE" and name is not None:
                self._send(200, store.delete(kind, ns or "", name))
            else:
                raise ApiError(405, "MethodNotAllowed", f"{method} is not supported here")
        except ApiError as exc:
            self._send(exc.code, exc.status())

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PATCH(self) -> None:
        self._dispatch("PATCH")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    # -- verbs --
    def _patch(self, kind: str, ns: str, name: str) -> None:
        ctype = (self.headers.get("Content-Type") or "").split(";")[0].strip()
        body = self._body()
        if ctype == "application/json-patch+json":
            if not isinstance(body, list):
                raise ApiError(400, "BadRequest", "a JSON patch must be a list of operations")

            def fn(o: Obj) -> Obj:
                rv = o["metadata"]["resourceVersion"]
                out = json_patch(o, body)
                if out["metadata"].get("resourceVersion") == rv:
                    out["metadata"].pop("resourceVersion", None)
                return out

        elif ctype in ("application/merge-patch+json", "application/strategic-merge-patch+json"):
            if not isinstance(body, dict):
                raise ApiError(400, "BadRequest", "a merge patch must be a JSON object")

            def fn(o: Obj) -> Obj:
                want = (body.get("metadata") or {}).get("resourceVersion")
                out = merge_patch(o, body)
                if want is None:
                    out["metadata"].pop("resourceVersion", None)
                return out

        else:
            raise ApiError(
                415, "UnsupportedMediaType", f"the body of type {ctype!r} is not supported"
            )
        self._send(200, self.server.owner.store.update(kind, ns, name, fn))

    def _bind(self, ns: str, name: str) -> None:
        body = self._body() or {}
        target = (body.get("target") or {}).get("name")
        if not target:
            raise ApiError(422, "Invalid", "target.name: Required value")
        store = self.server.owner.store

        meta = body.get("metadata") or {}

        def fn(o: Obj) -> Obj:
            # As the binding REST storage does: UID and resourceVersion preconditions, then
            # "already assigned", then nodeName + the Binding's annotations in one write.
            if meta.get("uid") and meta["uid"] != o["metadata"]["uid"]:
                raise _conflict("pods", name, "Precondition failed: UID in precondition")
            rv = meta.get("resourceVersion")
            if rv and rv != o["metadata"]["resourceVersion"]:
                raise _conflict(
                    "pods", name, f"the resourceVersion {rv} does not match the object's"
                )
            current = (o.get("spec") or {}).get("nodeName")
            if current:
                raise ApiError(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on pods/binding "{name}": pod {name} is '
                    f'already assigned to node "{current}"',
                    {"name": name, "kind": "pods/binding"},
                )
            o["spec"]["nodeName"] = target
            o["metadata"].setdefault("annotations", {}).update(meta.get("annotations") or {})
            conditions = o.setdefault("status", {}).setdefault("conditions", [])
            conditions[:] = [c for c in conditions if c.get("type") != "PodScheduled"]
            conditions.append({"type": "PodScheduled", "status": "True"})
            o["metadata"].pop("resourceVersion", None)
            return o

        store.update("pods", ns, name, fn)
        self._send(
            201,
            {
                "kind": "Status",
                "apiVersion": "v1",
                "metadata": {},
                "status": "Success",
                "code": 201,
            },
        )

    def _list_or_watch(self, kind: str, ns: str | None, query: dict[str, list[str]]) -> None:
        labels = (query.get("labelSelector") or [None])[0]
        fields = (query.get("fieldSelector") or [None])[0]
        namespace = ns if kind == "pods" and ns is not None else None
        store = self.server.owner.store
        if (query.get("watch") or ["false"])[0] in ("true", "1"):
            rv = (query.get("resourceVersion") or [""])[0]
            timeout = float((query.get("timeoutSeconds") or ["30"])[0])
            self._watch(kind, namespace, labels, fields, rv, timeout)
            return
        items, rv = store.list(kind, namespace, labels, fields)
        self._send(
            200,
            {
                "kind": "NodeList" if kind == "nodes" else "PodList",
                "apiVersion": "v1",
                "metadata": {"resourceVersion": rv},
                "items": items,
            },
        )

    def _watch(self, kind, namespace, labels, fields, rv_text, timeout) -> None:
        store = self.server.owner.store
        lm, fm = label_matcher(labels), field_matcher(fields)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def chunk(obj: Obj) -> None:
            data = (json.dumps(obj) + "\n").encode()
            self.wfile.write(f"{len(data):X}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

        def wanted(o: Obj) -> bool:
            meta = o["metadata"]
            if namespace is not None and meta.get("namespace") != namespace:
                return False
            return lm(meta.get("labels") or {}) and fm(o)

        deadline = time.monotonic() + timeout
        try:
            with store.lock:
                if rv_text in ("", "0"):
                    last = store.rv
                    initial = [o for o in store.objects[kind].values() if wanted(o)]
                    pending: list[Obj] = [
                        {"type": "ADDED", "object": copy.deepcopy(o)} for o in initial
                    ]
                else:
                    last = int(rv_text)
                    pending = []
                    if last < store.oldest_rv():
                        pending = [
                            {
                                "type": "ERROR",
                                "object": ApiError(
                                    410, "Expired", f"too old resource version: {last}"
                                ).status(),
                            }
                        ]
                        last = -1
            for ev in pending:
                chunk(ev)
            while last >= 0 and not self.server.owner.stopping.is_set():
                with store.lock:
                    events = store.events_after(kind, last)
                    if not events:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            break
                        store.lock.wait(min(left, 0.2))
                        events = store.events_after(kind, last)
                if events:
                    last = events[-1][0]
                for _, event, obj, prev in events:
                    # As the real watch cache does: an object entering the selector is ADDED,
                    # one leaving it is DELETED.
                    now_in = wanted(obj)
                    was_in = prev is not None and wanted(prev)
                    if event == "MODIFIED" and now_in and not was_in:
                        chunk({"type": "ADDED", "object": obj})
                    elif event == "MODIFIED" and was_in and not now_in:
                        chunk({"type": "DELETED", "object": obj})
                    elif now_in:
                        chunk({"type": event, "object": obj})
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass
        self.close_connection = True


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 256
    owner: FakeApiserver

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that hangs up (a watcher that stops, a process that exits) is normal, and
        # so is one that fails the TLS handshake (a client that does not trust us).
        if isinstance(sys.exc_info()[1], ConnectionError | ssl.SSLError):
            return
        super().handle_error(request, client_address)


class FakeApiserver:
    """Run the fake on 127.0.0.1:<free port>; `url` is the client's host."""

    def __init__(self, tls: ssl.SSLContext | None = None, token: str | None = None) -> None:
        self.store = Store()
        self.stopping = threading.Event()
        self.tls = tls
        self.token = token
        self._faults: list[tuple[str, re.Pattern[str], ApiError]] = []
        self._drops: list[tuple[str, re.Pattern[str], str]] = []
        self._fault_lock = threading.Lock()
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.owner = self
        if tls is not None:  # the handshake happens in the connection's own thread
            self._server.socket = tls.wrap_socket(
                self._server.socket, server_side=True, do_handshake_on_connect=False
            )
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self.requests: dict[str, int] = {}

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"{'https' if self.tls else 'http'}://{host}:{port}"

    def start(self) -> FakeApiserver:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        with self.store.lock:
            self.store.lock.notify_all()
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> FakeApiserver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def count(self, method: str) -> None:
        with self._fault_lock:
            self.requests[method] = self.requests.get(method, 0) + 1

    def fail_next(self, method: str, path_regex: str, code: int, reason: str, message: str) -> None:
        """Make the next request matching method and path fail with this Status."""
        with self._fault_lock:
            self._faults.append((method, re.compile(path_regex), ApiError(code, reason, message)))

    def drop_next(self, method: str, path_regex: str, when: str) -> None:
        """Hang up on the next request matching method and path without answering:
        ``when="before"`` it is not carried out, ``"after"`` it is (the client cannot tell)."""
        if when not in ("before", "after"):
            raise ValueError(f"when must be 'before' or 'after', not {when!r}")
        with self._fault_lock:
            self._drops.append((method, re.compile(path_regex), when))

    def take_drop(self, method: str, path: str) -> str | None:
        with self._fault_lock:
            for i, (m, pattern, when) in enumerate(self._drops):
                if m == method and pattern.search(path):
                    del self._drops[i]
                    return when
        return None

    def take_fault(self, method: str, path: str) -> ApiError | None:
        with self._fault_lock:
            for i, (m, pattern, err) in enumerate(self._faults):
                if m == method and pattern.search(path):
                    del self._faults[i]
                    return err
        return None

    def client(self) -> Any:
        """A `kubernetes.client.ApiClient` pointed at this server."""
        from kubernetes import client

        cfg = client.Configuration()
        cfg.host = self.url
        return client.ApiClient(cfg)


def node_object(name: str, labels: dict[str, str] | None = None, **annotations: str) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": labels or {}, "annotations": dict(annotations)},
        "status": {"capacity": {}, "allocatable": {}},
    }
