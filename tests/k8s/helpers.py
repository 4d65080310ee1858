"""Helpers of the Kubernetes bridge tests: nodes, pods, a served ASGI app, a mini scheduler."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import uvicorn

from k8s_bridge.protocol import PublishedInventory
from k8s_bridge.resources import Names
from qgpu.model import GpuDevice
from tests.fakes.apiserver import FakeApiserver, node_object

NAMES = Names()


def gpu(node: str, i: int, gib: int = 16, model: str = "T4") -> GpuDevice:
    return GpuDevice(uuid=f"GPU-{node}-{i}", index=i, model=model, memory_mib=gib * 1024)


def publish_node(
    srv: FakeApiserver,
    name: str,
    gpus: list[GpuDevice],
    policy: str | None = None,
    max_slices: int = 16,
) -> dict[str, Any]:
    inv = PublishedInventory(gpus=gpus, max_slices_per_gpu=max_slices, published_at=time.time())
    labels = {NAMES.policy_label: policy} if policy else {}
    obj = node_object(name, labels, **{NAMES.inventory_annotation: inv.model_dump_json()})
    return srv.store.create("nodes", obj)


def pod_object(
    name: str,
    containers: list[tuple[int, int | None]] | None = None,
    annotations: dict[str, str] | None = None,
    requests_too: bool = True,
    namespace: str = "default",
) -> dict[str, Any]:
    """A pod whose containers c0, c1, ... ask for (core, memory GiB) each."""
    out = []
    for i, (core, mem) in enumerate(containers or []):
        limits: dict[str, str] = {NAMES.core: str(core)}
        if mem is not None:
            limits[NAMES.memory] = str(mem)
        res: dict[str, Any] = {"limits": dict(limits)}
        if requests_too:
            res["requests"] = dict(limits)
        out.append({"name": f"c{i}", "image": "cuda:12", "resources": res})
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "annotations": annotations or {}},
        "spec": {"containers": out or [{"name": "c0", "image": "busybox"}]},
    }


def wait_until(cond: Callable[[], Any], timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServedApp:
    """An ASGI app served by uvicorn on a loopback port in a thread."""

    def __init__(self, app: Any) -> None:
        self.port = free_port()
        cfg = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServedApp:
        self.thread.start()
        wait_until(lambda: self.server.started, 10, "uvicorn to start")
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(5)


class MiniScheduler:
    """What kube-scheduler does with an extender (nodeCacheCapable): filter, prioritize, bind.

    Picks the highest extender score (ties: first node in the list), as a scheduler whose
    only scoring plugin is the extender would.
    """

    def __init__(self, extender_url: str, srv: FakeApiserver, node_names: list[str]) -> None:
        self.http = httpx.Client(base_url=extender_url, timeout=30)
        self.srv = srv
        self.node_names = node_names

    def schedule(self, namespace: str, name: str) -> tuple[str | None, str]:
        pod = self.srv.store.get("pods", namespace, name)
        args = {"Pod": pod, "Nodes": None, "NodeNames": self.node_names}
        fr = self.http.post("/filter", json=args).json()
        if fr.get("Error"):
            return None, fr["Error"]
        ok = fr.get("NodeNames") or []
        if not ok:
            failed = {**fr.get("FailedNodes", {}), **fr.get("FailedAndUnresolvableNodes", {})}
            return None, "; ".join(f"{k}: {v}" for k, v in sorted(failed.items()))
        pr = self.http.post("/prioritize", json={**args, "NodeNames": ok}).json()
        best = max(pr, key=lambda hp: (hp["Score"], -ok.index(hp["Host"])))["Host"]
        br = self.http.post(
            "/bind",
            json={
                "PodName": name,
                "PodNamespace": namespace,
                "PodUID": pod["metadata"]["uid"],
                "Node": best,
            },
        ).json()
        if br.get("Error"):
            return None, br["Error"]
        return best, ""

    def close(self) -> None:
        self.http.close()
