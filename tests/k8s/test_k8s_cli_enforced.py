"""The shipped commands end to end, and the slice really enforced.

``qgpu device-plugin`` (simulated GPUs through `enforcement.discovery`), ``qgpu extender``
and ``qgpu webhook`` run as separate processes against the fake apiserver and the fake
kubelet, once with the plugin writing the limits itself and once recording the slice with
a running ``qgpu agent``; a pod goes webhook -> filter -> prioritize -> bind -> Allocate;
then a workload runs with exactly what kubelet would give the container: the Allocate env,
and the mounts reproduced in a private mount namespace (`tests.k8s.container`). The
compiled interposer (named by the mounted ``ld.so.preload`` file, loaded here with
LD_PRELOAD) reads the mounted limits file and caps the simulated GPU.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from enforcement.sim import CONTEXT_MEMORY
from tests.fakes.apiserver import FakeApiserver, node_object
from tests.fakes.kubelet import FakeKubelet
from tests.helpers import stop_processes
from tests.k8s.container import Container
from tests.k8s.helpers import NAMES, MiniScheduler, free_port, pod_object, submit_through_webhook

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "enforcement" / "worker.py"
GIB = 1 << 30
OOM = 2  # CUDA_ERROR_OUT_OF_MEMORY


def _environment_ready() -> str | None:
    """The test needs root and unshare(1) for a private mount namespace (CI has both).
    The native libraries are not checked here: they are part of the install, and a missing
    one fails the test."""
    if shutil.which("unshare") is None or os.geteuid() != 0:
        return "needs root and unshare(1) for a private mount namespace"
    return None


pytestmark = pytest.mark.skipif(_environment_ready() is not None, reason=str(_environment_ready()))


def _qgpu(*args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "qgpu.cli", *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_http(url: str, ok, proc: subprocess.Popen[str], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{proc.args} exited: {proc.stderr.read() if proc.stderr else ''}")
        try:
            if ok(httpx.get(url, timeout=2)):
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} not ready")


@pytest.fixture(params=["plugin-writes-limits", "node-agent-records"])
def stack(apiserver: FakeApiserver, request: pytest.FixtureRequest) -> Iterator[dict]:
    tmp = Path(tempfile.mkdtemp(dir="/tmp", prefix="qc"))
    apiserver.store.create("nodes", node_object("n0", {NAMES.policy_label: "fs"}))
    kubelet = FakeKubelet(tmp / "dp").start()
    procs: list[subprocess.Popen[str]] = []
    agent_socket = None
    key = tmp / "assignment.key"  # the chart's Secret: the extender signs, the plugin checks
    key.write_text(secrets.token_urlsafe(48))
    signing = f"--assignment-key-file={key}"
    try:
        extra = [signing]
        if request.param == "node-agent-records":
            agent_socket = tmp / "agent" / "agent.sock"
            agent = _qgpu(
                "agent", "--sim=2xT4-16GB", "--node-name=n0", f"--state-dir={tmp / 'agent'}"
            )
            procs.append(agent)
            extra.append(f"--agent-socket={agent_socket}")
        plugin = _qgpu(
            "device-plugin",
            "--node-name=n0",
            f"--plugin-dir={tmp / 'dp'}",
            f"--state-dir={tmp / 'state'}",
            "--backend=sim",
            "--sim=2xT4-16GB",
            f"--apiserver={apiserver.url}",
            f"--pod-resources-socket={kubelet.pod_resources_socket}",
            *extra,
        )
        procs.append(plugin)
        kubelet.wait_ready([NAMES.core, NAMES.memory], timeout=60)
        ext_port, hook_port = free_port(), free_port()
        ext = _qgpu(
            "extender",
            f"--apiserver={apiserver.url}",
            "--host=127.0.0.1",
            f"--port={ext_port}",
            "--placement=spread",
            signing,
        )
        procs.append(ext)
        web = _qgpu("webhook", "--host=127.0.0.1", f"--port={hook_port}", "--insecure-http")
        procs.append(web)
        ext_url, hook_url = f"http://127.0.0.1:{ext_port}", f"http://127.0.0.1:{hook_port}"
        _wait_http(f"{ext_url}/healthz", lambda r: r.json()["nodes"] == 1, ext)
        _wait_http(f"{hook_url}/healthz", lambda r: r.status_code == 200, web)
        yield {
            "tmp": tmp,
            "kubelet": kubelet,
            "ext": ext_url,
            "hook": hook_url,
            "agent": agent_socket,
        }
    finally:
        stop_processes(procs)
        kubelet.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def test_commands_place_and_the_interposer_enforces(apiserver: FakeApiserver, stack) -> None:
    with httpx.Client(base_url=stack["hook"], timeout=10) as webhook:
        pod = submit_through_webhook(webhook, apiserver, pod_object("job", [(30, 4)]))
    assert pod["spec"]["schedulerName"] == "qgpu-scheduler"
    scheduler = MiniScheduler(stack["ext"], apiserver, ["n0"])
    node, why = scheduler.schedule("default", "job")
    scheduler.close()
    assert node == "n0", why
    res = stack["kubelet"].admit(apiserver.store.get("pods", "default", "job"))["c0"]
    envs = res.envs
    assert envs["QGPU_CORE_LIMIT"] == "30" and envs["QGPU_ISOLATION"] == "fixed-share"
    assert envs["QGPU_MEMORY_LIMIT"] == str(4 * GIB) and "QGPU_SIM_CONFIG" in envs
    mounts = {m.container_path: m.host_path for m in res.mounts}
    preload = Path(mounts["/etc/ld.so.preload"]).read_text().split()
    assert preload == ["/usr/local/qgpu/lib/libqgpu_hook.so"]
    assert "LD_PRELOAD" not in envs  # the mounted /etc/ld.so.preload loads the interposer
    if stack["agent"] is not None:  # the node agent recorded the pod's slice and owns it
        from enforcement.agent.client import AgentClient

        with AgentClient(stack["agent"]) as agent:
            (held,) = [x for x in agent.slices().slices if x.slice_id == envs["QGPU_SLICE_ID"]]
        assert held.owner.kind.value == "pod" and held.core == 30 and held.memory_gib == 4
        assert held.limits_file == envs["QGPU_LIMITS_FILE"]

    w = Container(envs, res.mounts)
    try:
        assert w.ask("init") == ["ok", "0"]
        assert w.ask("ctx") == ["ok"]
        assert w.ask("totalmem") == ["ok", str(4 * GIB)]  # the card shows the slice
        assert w.ask(f"alloc alloc {3 * GIB}")[0] == "ok"
        assert w.ask(f"alloc alloc {2 * GIB}") == ["err", str(OOM)]  # over the 4 GiB cap
        _, free, total = w.ask("meminfo")
        # 3 GiB and the process's context are charged to the slice
        assert (int(free), int(total)) == (GIB - CONTEXT_MEMORY, 4 * GIB)
    finally:
        w.close()
    # the slice's shared ledger lives in the host directory that was mounted, and that
    # (with its GPU's directory, read-only, and its own activity file in it) is all of the
    # state tree the container was given
    state = envs["QGPU_STATE_DIR"].rstrip("/") + "/"
    under = sorted(c for c in mounts if c.startswith(state))
    assert len(under) == (4 if stack["agent"] is not None else 3), under
    (ledger,) = [mounts[c] for c in under if c.endswith("/ledger")]
    assert any(Path(ledger).iterdir())
