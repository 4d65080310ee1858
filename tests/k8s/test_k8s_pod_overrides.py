"""A pod that asks for a slice cannot override what the device plugin injects into it.

The attack: a 4 GiB share pod that also mounts a file of its own (a ConfigMap key is
enough) where the plugin mounts ``/etc/ld.so.preload``, or its own root-owned
``limits.conf`` at the trusted limits path. kubelet hands the runtime the pod's mounts after
the plugin's and the runtime mounts the later one on top (`tests.fakes.runtime`), so the
workload ran with no interposer, or under caps it wrote itself: 8 GiB on the simulated
16 GiB T4, measured by the simulator's own accounting. Written first; against the code
before `k8s_bridge.pod_guard` the device plugin answered Allocate for such a pod and the
webhook admitted it. Now both refuse it, naming the field and the rule.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from enforcement.sim import process_memory
from k8s_bridge.container_paths import (
    CONTAINER_LIMITS_FILE,
    CONTAINER_PRELOAD,
    INJECTED_DIRS,
    INJECTED_FILES,
)
from k8s_bridge.deviceplugin.v1beta1 import api_pb2 as pb
from k8s_bridge.extender.models import ExtenderBindingArgs
from k8s_bridge.pod_guard import clean, pod_violations, reserved_env
from k8s_bridge.resources import parse_pod
from k8s_bridge.webhook import AdmissionRequest, review
from tests.fakes.apiserver import FakeApiserver
from tests.fakes.runtime import Mount, RuntimeContainer, runtime_order
from tests.k8s.container import WORKER
from tests.k8s.helpers import NAMES, U, pod_object
from tests.k8s.test_k8s_deviceplugin import Node
from tests.k8s.test_k8s_gpu_state import allocate, node  # noqa: F401  (a fixture)

GIB = 1 << 30
needs_root = pytest.mark.skipif(
    shutil.which("unshare") is None or os.geteuid() != 0,
    reason="needs root and unshare(1) for private mount namespaces",
)


@pytest.fixture
def volume() -> Iterator[Path]:
    """Host files standing in for a pod's volumes (a ConfigMap's files are root's, 0644)."""
    d = Path(tempfile.mkdtemp(prefix="qv", dir="/tmp"))
    (d / "empty").write_text("")
    (d / "limits.conf").write_text(f"QGPU_MEMORY_LIMIT={16 * GIB}\nQGPU_CORE_LIMIT=100\n")
    for f in d.iterdir():
        os.chmod(f, 0o644)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def grab_8_gib(sim, answer, pod_mounts: list[Mount]) -> tuple[list[str], int]:
    """Runs the worker in the container laid out from `answer` and the pod's own mounts;
    returns its answer to an 8 GiB cuMemAlloc and what the simulated GPU says it holds."""
    mounts = runtime_order(answer.mounts, pod_mounts)
    c = RuntimeContainer(mounts, dict(answer.envs), [sys.executable, str(WORKER), "serve"])
    try:
        assert c.ask("init") == ["ok", "0"]
        assert c.ask("ctx") == ["ok"]
        reply = c.ask(f"alloc alloc {8 * GIB}")
        return reply, process_memory(sim.config.path).get(c.proc.pid, 0)
    finally:
        c.close()


@needs_root
def test_the_container_layout_enforces_the_slice(node) -> None:  # noqa: F811
    """The model of the runtime with the plugin's mounts alone: the interposer, loaded by the
    mounted /etc/ld.so.preload, refuses 8 GiB in the 4 GiB slice."""
    sim, paths, gpu = node
    reply, held = grab_8_gib(sim, allocate(paths, gpu, "pod-a", 30, "fs"), [])
    assert reply[0] == "err" and held < 4 * GIB, (reply, held)


@needs_root
@pytest.mark.parametrize("target", ["preload", "limits"])
def test_a_pod_mount_over_what_the_plugin_injects_would_lift_the_cap(
    node,  # noqa: F811
    volume: Path,
    target: str,
) -> None:
    """Why the plugin and the webhook must refuse such a pod: laid out as the runtime would,
    the pod's own file wins, and the workload takes 8 GiB in its 4 GiB slice."""
    sim, paths, gpu = node
    own = (
        Mount(str(CONTAINER_PRELOAD), str(volume / "empty"), True)
        if target == "preload"
        else Mount(str(CONTAINER_LIMITS_FILE), str(volume / "limits.conf"), True)
    )
    reply, held = grab_8_gib(sim, allocate(paths, gpu, "pod-b", 30, "fs"), [own])
    assert reply[0] == "ok" and held >= 8 * GIB, (reply, held)


def hostile_pod(name: str, **override: object) -> dict:
    """A 30 % / 4 GiB pod with one of the overrides the guard refuses."""
    pod = pod_object(name, [(30, 4)])
    c = pod["spec"]["containers"][0]
    if "mount" in override:
        pod["spec"]["volumes"] = [{"name": "v", "configMap": {"name": "x"}}]
        c["volumeMounts"] = [{"name": "v", "mountPath": override["mount"], "subPath": "k"}]
    if "env" in override:
        c["env"] = [{"name": override["env"], "value": "all"}]
    if "env_from" in override:
        c["envFrom"] = [{"configMapRef": {"name": "x"}, **override["env_from"]}]  # type: ignore[dict-item]
    if "security" in override:
        c["securityContext"] = override["security"]
    if "host_path" in override:
        pod["spec"]["volumes"] = [{"name": "h", "hostPath": {"path": override["host_path"]}}]
    if "host_pid" in override:
        pod["spec"]["hostPID"] = True
    return pod


OVERRIDES = {
    "preload": ({"mount": "/etc/ld.so.preload"}, "spec.containers[0].volumeMounts[0].mountPath"),
    "preload, uncleaned": ({"mount": "//etc/./ld.so.preload/"}, "volumeMounts[0].mountPath"),
    "limits": ({"mount": "/etc/qgpu/limits.conf"}, "volumeMounts[0].mountPath"),
    "hook": ({"mount": "/usr/local/qgpu/lib/libqgpu_hook.so"}, "volumeMounts[0].mountPath"),
    "state": ({"mount": "/run/qgpu/slices/x/ledger"}, "volumeMounts[0].mountPath"),
    "node state": ({"mount": "/var/lib/qgpu/slices"}, "volumeMounts[0].mountPath"),
    "devices": ({"env": "NVIDIA_VISIBLE_DEVICES"}, "spec.containers[0].env[0].name"),
    "contract": ({"env": "QGPU_MEMORY_LIMIT"}, "env[0].name"),
    "graphics": ({"env": "NVIDIA_DRIVER_CAPABILITIES"}, "env[0]"),
    "envFrom": ({"env_from": {}}, "envFrom[0].prefix"),
    "envFrom prefix": ({"env_from": {"prefix": "NVIDIA_"}}, "envFrom[0].prefix"),
    "privileged": ({"security": {"privileged": True}}, "securityContext.privileged"),
    "SYS_ADMIN": (
        {"security": {"capabilities": {"add": ["SYS_ADMIN"]}}},
        "securityContext.capabilities.add[0]",
    ),
    "hostPath /": ({"host_path": "/"}, "spec.volumes[0].hostPath.path"),
    "hostPath dev": ({"host_path": "/dev/nvidia0"}, "spec.volumes[0].hostPath.path"),
    "hostPath MPS": ({"host_path": "/tmp/nvidia-mps"}, "spec.volumes[0].hostPath.path"),
    "hostPath tmp": ({"host_path": "/tmp"}, "spec.volumes[0].hostPath.path"),
    "hostPID": ({"host_pid": True}, "spec.hostPID"),
}


@pytest.mark.parametrize("case", list(OVERRIDES))
def test_the_guard_names_each_override(case: str) -> None:
    override, field = OVERRIDES[case]
    found = pod_violations(NAMES, parse_pod(hostile_pod("p", **override)))
    assert len(found) == 1 and found[0].field.endswith(field), found
    assert found[0].rule


def test_what_the_guard_allows() -> None:
    """Ordinary pods pass: mounts elsewhere (even /etc/qgpu itself, which the plugin's file
    mount lies deeper than, so it lands on top), env of their own, envFrom with a prefix,
    compute and utility capabilities, a sidecar without qgpu resources mounting anything,
    and pods that ask for no qgpu resources at all."""
    pod = pod_object("ok", [(30, 4)])
    c = pod["spec"]["containers"][0]
    pod["spec"]["volumes"] = [
        {"name": "v", "emptyDir": {}},
        {"name": "d", "hostPath": {"path": "/data"}},
    ]
    c["volumeMounts"] = [
        {"name": "v", "mountPath": "/etc/qgpu"},
        {"name": "v", "mountPath": "/models"},
        {"name": "d", "mountPath": "/run/other"},
    ]
    c["env"] = [
        {"name": "MODEL", "value": "x"},
        {"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "compute,utility"},
    ]
    c["envFrom"] = [{"prefix": "APP_", "configMapRef": {"name": "x"}}]
    pod["spec"]["containers"].append(
        {
            "name": "side",
            "image": "busybox",
            "volumeMounts": [{"name": "v", "mountPath": "/etc/ld.so.preload"}],
        }
    )
    assert pod_violations(NAMES, parse_pod(pod)) == []
    plain = pod_object("plain", [])
    plain["spec"]["hostPID"] = True
    assert pod_violations(NAMES, parse_pod(plain)) == []


def test_a_whole_gpu_pod_keeps_its_mounts_but_not_the_rest() -> None:
    """A whole GPU gets no interposer, so its mounts override nothing; its env and
    privileges still reach the other GPUs' slices."""
    pod = hostile_pod("whole", mount="/etc/ld.so.preload")
    pod["spec"]["containers"][0]["resources"] = {
        "limits": {NAMES.core: "100"},
        "requests": {NAMES.core: "100"},
    }
    assert pod_violations(NAMES, parse_pod(pod)) == []
    pod["spec"]["containers"][0]["env"] = [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]
    assert [v.field for v in pod_violations(NAMES, parse_pod(pod))] == [
        "spec.containers[0].env[0].name"
    ]


def test_the_webhook_denies_an_override_with_the_rule() -> None:
    req = AdmissionRequest.model_validate(
        {"uid": "u1", "operation": "CREATE", "object": hostile_pod("p", mount="/etc/ld.so.preload")}
    )
    resp = review(NAMES, "qgpu-scheduler", req)
    assert not resp.allowed and resp.status is not None
    message = resp.status.message
    assert "spec.containers[0].volumeMounts[0].mountPath='/etc/ld.so.preload'" in message
    assert "the interposer's preload" in message


@pytest.fixture
def plugin_node(apiserver: FakeApiserver) -> Iterator[Node]:
    n = Node(apiserver)
    yield n
    n.close()


@pytest.mark.parametrize("case", ["preload", "limits", "devices", "privileged"])
def test_the_device_plugin_refuses_a_pod_that_got_past_the_webhook(
    plugin_node: Node, case: str
) -> None:
    """The pod is in the apiserver and bound (the webhook down, or failurePolicy Ignore):
    Allocate is refused over real gRPC with the rule, so kubelet never starts it."""
    override, field = OVERRIDES[case]
    pod = plugin_node.srv.store.create("pods", hostile_pod("h", **override))
    args = ExtenderBindingArgs(
        PodName="h", PodNamespace="default", PodUID=pod["metadata"]["uid"], Node="n0"
    )
    assert plugin_node.extender.bind(args).error == ""
    ids = [f"{U('n0', 0)}_c{i}" for i in range(30)]
    req = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)])
    with pytest.raises(grpc.RpcError) as info:
        plugin_node.stub("core").Allocate(req, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # the pod's spec
    assert field in info.value.details(), info.value.details()


def test_every_path_and_name_the_plugin_injects_is_guarded(node) -> None:  # noqa: F811
    """The guard's lists and the plugin's answer cannot drift apart: every env name a real
    Allocate answer sets is reserved (but what simulation mode adds to reach the simulated
    driver), every mount it makes is guarded."""
    _, paths, gpu = node
    answer = allocate(paths, gpu, "pod-c", 30, "fs")
    names = [k for k in answer.envs if k not in paths.workload_env or k.startswith("QGPU_")]
    assert names and all(reserved_env(k) for k in names), names
    for m in answer.mounts:
        p = clean(m.container_path)
        assert p in INJECTED_FILES or any(p == d or d in p.parents for d in INJECTED_DIRS), p
