"""Helpers of the Kubernetes bridge tests: nodes, pods, a served ASGI app, a mini scheduler."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from k8s_bridge.assignment_mac import AssignmentKeys
from k8s_bridge.protocol import PublishedInventory
from k8s_bridge.resources import Names
from qgpu.model import GpuDevice
from tests.fakes.apiserver import FakeApiserver, json_patch, node_object

NAMES = Names()
# the assignment key the extender and the device plugins of a `Cluster` share (the chart's
# Secret): assignments are signed, and checked, in every end-to-end test
TEST_KEYS = AssignmentKeys(b"qgpu-test-assignment-key-0123456789abcdef")


def U(node: str, i: int) -> str:
    """A well-formed, deterministic GPU UUID for GPU `i` of `node` (what NVML reports)."""
    return f"GPU-{hashlib.sha1(node.encode()).hexdigest()[:8]}-0000-4000-8000-{i:012x}"


def gpu(node: str, i: int, gib: int = 16, model: str = "T4") -> GpuDevice:
    return GpuDevice(uuid=U(node, i), index=i, model=model, memory_mib=gib * 1024)


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
    scheduler_name: str | None = "qgpu-scheduler",
) -> dict[str, Any]:
    """A pod whose containers c0, c1, ... ask for (core, memory GiB) each; one that asks is
    routed to `scheduler_name` (as the webhook would have done; None: left unset)."""
    out = []
    for i, (core, mem) in enumerate(containers or []):
        limits: dict[str, str] = {NAMES.core: str(core)}
        if mem is not None:
            limits[NAMES.memory] = str(mem)
        res: dict[str, Any] = {"limits": dict(limits)}
        if requests_too:
            res["requests"] = dict(limits)
        out.append({"name": f"c{i}", "image": "cuda:12", "resources": res})
    spec: dict[str, Any] = {"containers": out or [{"name": "c0", "image": "busybox"}]}
    if out and scheduler_name:
        spec["schedulerName"] = scheduler_name
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "annotations": annotations or {}},
        "spec": spec,
    }


def run_qgpu(*args: str) -> subprocess.CompletedProcess[str]:
    """`qgpu <args>` as a process of this checkout (text output captured, 60 s at most)."""
    return subprocess.run(
        [sys.executable, "-m", "qgpu.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )


def one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    """The command's one `error:` line (exit 2, no traceback), or an assertion."""
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    return errors[0]


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
    """An ASGI app served by uvicorn on a loopback port in a thread, as the bridge's CLI
    serves its apps (`k8s_bridge.http_serving.config`: limits, optional TLS)."""

    def __init__(self, app: Any, limits: Any = None, tls: Any = None) -> None:
        from k8s_bridge.http_serving import DEFAULT_LIMITS, config

        self.port = free_port()
        self.tls = tls
        cfg = config(app, "127.0.0.1", self.port, limits or DEFAULT_LIMITS, tls)
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

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


class Cluster:
    """Fake apiserver + per node a fake kubelet and the real device plugin, the extender and
    the webhook served over HTTP, and a MiniScheduler: the whole path a pod takes."""

    def __init__(
        self,
        srv: FakeApiserver,
        nodes: dict[str, list[GpuDevice]],
        node_policy: str = "binpack",
        gpu_policy: str | None = None,
        policies: dict[str, str] | None = None,
        shuffle_resources: bool = False,
        watch: bool = True,
        keys: Any = TEST_KEYS,
    ) -> None:
        from k8s_bridge.deviceplugin.allocation import AllocationPaths
        from k8s_bridge.deviceplugin.server import PluginConfig, QgpuDevicePlugin
        from k8s_bridge.extender.app import create_app as extender_app
        from k8s_bridge.extender.service import Extender, ExtenderConfig
        from k8s_bridge.kube import Kube
        from k8s_bridge.webhook import create_app as webhook_app
        from qgpu.model import NodeInventory
        from tests.fakes.kubelet import FakeKubelet

        self.srv = srv
        self.tmp = Path(tempfile.mkdtemp(dir="/tmp", prefix="qk"))
        self.hook = self.tmp / "libqgpu_hook.so"
        self.hook.write_bytes(b"\x7fELF test stand-in")
        self.kubelets: dict[str, FakeKubelet] = {}
        self.plugins: dict[str, QgpuDevicePlugin] = {}
        self.served: list[ServedApp] = []
        for i, (name, gpus) in enumerate(nodes.items()):
            labels = {}
            if policies and name in policies:
                labels[NAMES.policy_label] = policies[name]
            srv.store.create("nodes", node_object(name, labels))
            kl = FakeKubelet(self.tmp / f"dp{i}", shuffle_resources=shuffle_resources, seed=i)
            self.kubelets[name] = kl.start()
            plugin = QgpuDevicePlugin(
                PluginConfig(
                    node_name=name,
                    plugin_dir=kl.dir,
                    poll_s=0.05,
                    pod_resources_socket=kl.pod_resources_socket,
                ),
                Kube(srv.client(), NAMES),
                NodeInventory(name=name, gpus=gpus),
                AllocationPaths(state_dir=self.tmp / f"state{i}", hook_library=self.hook),
                keys,
            )
            plugin.start()
            self.plugins[name] = plugin
            kl.wait_ready([NAMES.core, NAMES.memory])
        self.extender = Extender(
            Kube(srv.client(), NAMES),
            ExtenderConfig(node_policy=node_policy, gpu_policy=gpu_policy, watch=watch),
            keys,
        )
        self.extender.start()
        ext = ServedApp(extender_app(self.extender)).start()
        hook = ServedApp(webhook_app(NAMES, "qgpu-scheduler")).start()
        self.served += [ext, hook]
        self.webhook = httpx.Client(base_url=hook.url, timeout=30)
        self.scheduler = MiniScheduler(ext.url, srv, list(nodes))

    def submit(self, pod: dict[str, Any]) -> dict[str, Any]:
        """Send the pod through the webhook (applying its patch), then create it."""
        return submit_through_webhook(self.webhook, self.srv, pod)

    def run(self, pod: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """submit -> filter -> prioritize -> bind -> kubelet admission; (node, results)."""
        created = self.submit(pod)
        ns, name = created["metadata"]["namespace"], created["metadata"]["name"]
        node, why = self.scheduler.schedule(ns, name)
        if node is None:
            raise Unschedulable(why)
        bound = self.srv.store.get("pods", ns, name)
        return node, self.kubelets[node].admit(bound)

    def close(self) -> None:
        self.scheduler.close()
        self.webhook.close()
        for s in self.served:
            s.stop()
        self.extender.stop()
        for p in self.plugins.values():
            p.stop()
        for k in self.kubelets.values():
            k.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)


class PodDenied(Exception):
    pass


def submit_through_webhook(
    webhook: httpx.Client, srv: FakeApiserver, pod: dict[str, Any]
) -> dict[str, Any]:
    """What the apiserver does on pod CREATE with a mutating webhook: review, patch, store."""
    review = {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {"uid": str(uuid.uuid4()), "operation": "CREATE", "object": pod},
    }
    resp = webhook.post("/mutate", json=review).json()["response"]
    if not resp["allowed"]:
        raise PodDenied(resp["status"]["message"])
    if resp.get("patch"):
        assert resp["patchType"] == "JSONPatch"
        pod = json_patch(pod, json.loads(base64.b64decode(resp["patch"])))
    return srv.store.create("pods", pod)


class Unschedulable(Exception):
    pass


def assignment_of(srv: FakeApiserver, name: str, namespace: str = "default") -> Any:
    from k8s_bridge.protocol import load_assignment

    pod = srv.store.get("pods", namespace, name)
    return load_assignment(pod["metadata"]["annotations"][NAMES.assignment_annotation])


def gpu_usage(srv: FakeApiserver) -> dict[str, dict[str, int]]:
    """Per GPU: core, memory and slices held by live pods' assignments (from annotations)."""
    from k8s_bridge.protocol import load_assignment

    use: dict[str, dict[str, int]] = {}
    items, _ = srv.store.list("pods", None, None, "spec.nodeName!=")
    for pod in items:
        if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        if NAMES.assignment_annotation not in (pod["metadata"].get("annotations") or {}):
            continue
        a = load_assignment(pod["metadata"]["annotations"][NAMES.assignment_annotation])
        for ca in a.containers.values():
            for u, mem in zip(ca.gpus, ca.memory_gib, strict=True):
                row = use.setdefault(u, {"core": 0, "memory": 0, "slices": 0})
                row["core"] += ca.core
                row["memory"] += mem
                row["slices"] += 1
    return use
