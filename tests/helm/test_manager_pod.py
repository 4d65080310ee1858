"""qgpu-manager's containers started with the chart's own commands (simulated GPUs), the host
directories given as chart values, next to the in-repo fake kubelet and fake apiserver.

The init container `install-interposer` installs the hook into `manager.interposerDir`;
`agent` and `device-plugin` run their rendered argv (the device plugin also gets
``--apiserver``: in the pod it uses its ServiceAccount). The device plugin registers both
resources with kubelet, publishes the node's inventory, and finds the agent on the socket
the agent listens on; the example pod, bound by the extender, is admitted by kubelet and
its slice is recorded by the agent, with the limits file and mounts at host paths under the
chart's state directory.
"""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helm.chart import command, containers, render
from tests.helpers import stop_processes

ROOT = Path(__file__).resolve().parents[2]
NODE = "gpu-node-1"


def _native() -> Any:
    from enforcement import native

    native.hook_library_path()  # built by `make`/pip install: missing is a failure
    native.sim_library_dir()
    return native


def _start(argv: list[str], extra: list[str]) -> subprocess.Popen[str]:
    assert argv[0] == "qgpu"
    return subprocess.Popen(
        [sys.executable, "-m", "qgpu.cli", *argv[1:], *extra],
        env={**os.environ, "PYTHONPATH": str(ROOT), "NODE_NAME": NODE},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.fixture(scope="module")
def manager() -> Iterator[dict[str, Any]]:
    from tests.agent.conftest import free_port
    from tests.fakes.apiserver import FakeApiserver, node_object
    from tests.fakes.kubelet import FakeKubelet
    from tests.k8s.helpers import NAMES

    _native()
    tmp = Path(tempfile.mkdtemp(dir="/tmp", prefix="qm"))  # short: unix socket paths
    values = {
        "manager": {
            "gpuBackend": "sim",
            "simulatedGpus": "2xT4-16GB",
            "stateDir": str(tmp / "state"),
            "interposerDir": str(tmp / "lib"),
            "pluginDir": str(tmp / "dp"),
            "kubeletPodsDir": str(tmp / "pods"),
        },
        "policies": {"isolation": "fixed-share"},
        "metrics": {"port": free_port()},
    }
    rendered = render(values)
    init = containers(rendered.manager, init=True)["install-interposer"]
    init_env = {e["name"]: e["value"] for e in init["env"]}
    subprocess.run([sys.executable, *command(init)[1:]], env={**os.environ, **init_env}, check=True)
    srv = FakeApiserver().start()
    labels = {NAMES.policy_label: "fixed-share", NAMES.slices_label: "6"}
    srv.store.create("nodes", node_object(NODE, labels))
    # label-node hands the node's slices-per-GPU label to both containers (a file)
    label = containers(rendered.manager, init=True)["label-node"]
    label_env = {e["name"]: e["value"] for e in label["env"] if "value" in e}
    label_env.update(NODE_NAME=NODE, QGPU_APISERVER=srv.url)
    subprocess.run(
        [sys.executable, *command(label)[1:]], env={**os.environ, **label_env}, check=True
    )
    kubelet = FakeKubelet(tmp / "dp").start()
    cs = containers(rendered.manager)
    # the chart's assignment-key Secret, mounted at a path of this test (the flags the
    # chart gives point into the container's /etc/qgpu-assignment-key)
    keydir = tmp / "assignment-key"
    keydir.mkdir()
    secret = rendered.get("Secret", "qgpu-assignment-key")
    for name, data in secret["data"].items():
        (keydir / name).write_bytes(base64.b64decode(data))
    moved = [
        f"--assignment-key-file={keydir / 'key'}",
        f"--assignment-previous-key-file={keydir / 'previous'}",
        f"--pod-resources-socket={kubelet.pod_resources_socket}",
    ]
    procs = [
        _start(command(cs["agent"], NODE_NAME=NODE), []),
        _start(
            command(cs["device-plugin"], NODE_NAME=NODE), [f"--apiserver={srv.url}", *moved]
        ),
    ]
    try:
        deadline = time.monotonic() + 90
        while True:
            for p in procs:
                if p.poll() is not None:
                    raise AssertionError(f"{p.args} exited: {p.stderr.read() if p.stderr else ''}")
            try:
                kubelet.wait_ready([NAMES.core, NAMES.memory], timeout=1)
                break
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise
        yield {
            "tmp": tmp,
            "srv": srv,
            "kubelet": kubelet,
            "rendered": rendered,
            "key": (keydir / "key").read_bytes(),
        }
    finally:
        stop_processes(procs)
        kubelet.stop()
        srv.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def test_device_plugin_registers_and_publishes_the_node(manager: dict[str, Any]) -> None:
    from k8s_bridge.protocol import load_inventory
    from tests.k8s.helpers import NAMES

    kubelet = manager["kubelet"]
    assert len(kubelet.plugins[NAMES.core].devices) == 200  # 100 IDs per GPU
    assert len(kubelet.plugins[NAMES.memory].devices) == 32  # one per GiB
    node = manager["srv"].store.get("nodes", "", NODE)
    inv = load_inventory(node["metadata"]["annotations"][NAMES.inventory_annotation])
    assert [g.memory_mib // 1024 for g in inv.gpus] == [16, 16]
    # the node label qgpu-slices-per-gpu=6 won over the chart's floor-gib (16 GiB: 4)
    assert (inv.max_slices_per_gpu, inv.fixed_slices) == (6, True)


def test_agent_metrics_port_of_the_chart_serves_metrics_only(manager: dict[str, Any]) -> None:
    """The rendered agent's `metrics` container port answers GET /metrics; the slice API
    is not reachable there."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    (port,) = containers(manager["rendered"].manager)["agent"]["ports"]
    assert port["name"] == "metrics"
    with httpx.Client(base_url=f"http://127.0.0.1:{port['containerPort']}", timeout=10) as http:
        got = http.get("/metrics")
        assert got.status_code == 200
        limits = [
            s.value
            for fam in text_string_to_metric_families(got.text)
            for s in fam.samples
            if s.name == "qgpu_device_max_slices"
        ]
        assert limits == [6.0, 6.0]  # the node label's fixed count, on both GPUs
        assert (
            http.post("/v1/slices", json={"request": {"core": 10, "memory": 1}}).status_code == 404
        )


def test_example_pod_gets_its_slice_recorded_by_the_agent(manager: dict[str, Any]) -> None:
    from enforcement.agent.client import AgentClient
    from k8s_bridge.assignment_mac import AssignmentKeys
    from k8s_bridge.extender.app import create_app
    from k8s_bridge.extender.service import Extender, ExtenderConfig
    from k8s_bridge.kube import Kube
    from tests.k8s.helpers import NAMES, MiniScheduler, ServedApp

    srv, kubelet, tmp = manager["srv"], manager["kubelet"], manager["tmp"]
    pod = yaml.safe_load((ROOT / "examples" / "pod.yaml").read_text())
    pod["metadata"]["namespace"] = "default"
    created = srv.store.create("pods", pod)
    # the extender signs with the chart's key, which the device plugin checks
    keys = AssignmentKeys(manager["key"])
    ext = Extender(Kube(srv.client(), NAMES), ExtenderConfig(watch=False), keys)
    ext.start()
    served = ServedApp(create_app(ext)).start()
    try:
        node, why = MiniScheduler(served.url, srv, [NODE]).schedule(
            "default", created["metadata"]["name"]
        )
    finally:
        served.stop()
        ext.stop()
    assert node == NODE, why
    bound = srv.store.get("pods", "default", created["metadata"]["name"])
    result = kubelet.admit(bound)["cuda"]
    assert result.envs["QGPU_CORE_LIMIT"] == "30"
    assert result.envs["QGPU_MEMORY_LIMIT"] == str(8 << 30)
    assert result.envs["QGPU_ISOLATION"] == "fixed-share"
    state = tmp / "state"
    hosts = {m.container_path: m.host_path for m in result.mounts}
    assert hosts["/usr/local/qgpu/lib/libqgpu_hook.so"] == str(tmp / "lib" / "libqgpu_hook.so")
    assert hosts["/etc/ld.so.preload"] == str(state / "k8s" / "ld.so.preload")
    limits = Path(result.envs["QGPU_LIMITS_FILE"])
    assert hosts[str(limits)] == str(limits) and limits.is_relative_to(state)
    assert "QGPU_CORE_LIMIT=30" in limits.read_text()
    agent_argv = command(containers(manager["rendered"].manager)["agent"])
    socket_path = next(a.split("=", 1)[1] for a in agent_argv if a.startswith("--socket="))
    with AgentClient(socket_path) as agent:
        slices = agent.slices().slices
    (recorded,) = [s for s in slices if s.owner.id == bound["metadata"]["uid"]]
    assert (recorded.core, recorded.memory_gib) == (30, 8)
