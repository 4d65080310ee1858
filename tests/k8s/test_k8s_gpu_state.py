"""A hostile container with only what the device plugin mounts into it attacks the state
the slices of its GPU share.

Two pods' containers get their slices on one simulated T4 from the device plugin's Allocate
answer (`container_response`, the plugin writing the slice files itself). Each runs in a
private mount namespace holding of the node's state tree exactly what the answer mounts
(`tests.k8s.container`), as root, as containers often do: what it may write is decided by
the mounts, not by file modes. The victim is a best-effort slice, alone in using the GPU:
it should get all of it. The hostile container writes false state into every file of its
view it can open for writing: a fake 99 % fixed-share slice that is always active (before
the fix the GPU's region file was mounted writable into every container, and the victim
was gated to about 1 %). The victim's compute is measured on the simulated GPU's timeline.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from enforcement.native import hook_library_path
from enforcement.sim import load_sim_config, sim_environment, write_sim_config
from k8s_bridge.deviceplugin.allocation import AllocationPaths, container_response
from k8s_bridge.protocol import ContainerAssignment
from qgpu.model import GpuDevice, IsolationPolicy
from tests.enforcement.conftest import Sim, finish, measure_shares, wait_ready
from tests.k8s.container import WORKER, Container

pytestmark = pytest.mark.skipif(
    shutil.which("unshare") is None or os.geteuid() != 0,
    reason="needs root and unshare(1) for private mount namespaces",
)

# Run inside the hostile container: every file under QGPU_STATE_DIR it can open for writing
# gets a fake always-active 99 % fixed-share slice, by the layout its magic names (the
# legacy per-GPU region, a GPU roster, an activity file). Prints what happened per file.
FORGE = r"""
import errno, json, mmap, os, struct, sys
state = os.environ["QGPU_STATE_DIR"]
FAR = (1 << 62) - 1
REGION, ROSTER, ACT = 0x3247455255504751, 0x31534F5255504751, 0x3154434155504751
seen = {}
for d, _, files in os.walk(state):
    for name in files:
        path = os.path.join(d, name)
        rel = os.path.relpath(path, state)
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            seen[rel] = errno.errorcode.get(exc.errno, str(exc))
            continue
        if os.fstat(fd).st_size == 0 and name.endswith(".activity"):  # its own, unused yet
            os.pwrite(fd, struct.pack("<QIIqqiI", ACT, 1, 64, FAR, FAR, 1, 0), 0)
            seen[rel] = "own"
            os.close(fd)
            continue
        try:
            m = mmap.mmap(fd, 0)
        except (OSError, ValueError):
            seen[rel] = "opened"
            os.close(fd)
            continue
        magic = struct.unpack_from("<Q", m, 0)[0]
        if magic == REGION:  # an entry of init's pid in the last slot: never reclaimed
            start = int(open("/proc/1/stat").read().rsplit(")", 1)[1].split()[19])
            struct.pack_into("<72sqiiiiQq", m, 128 + 127 * 128, b"ghost", FAR, 1, 99, 1, 0,
                             start, 0)
            seen[rel] = "forged"
        elif magic == ROSTER:
            struct.pack_into("<72siiI", m, 64 + 127 * 96, b"ghost", 1, 99, 1)
            seen[rel] = "forged"
        elif magic == ACT:  # its own: it may say anything about itself
            struct.pack_into("<qqi", m, 16, FAR, FAR, 1)
            seen[rel] = "own"
        else:
            seen[rel] = "opened"
        m.close()
        os.close(fd)
for rel in ("ghost.activity",):
    for d in [d for d, _, _ in os.walk(state) if os.path.basename(d).startswith(".gpu-")]:
        try:
            with open(os.path.join(d, rel), "wb") as f:
                f.write(struct.pack("<QIIqqiI", ACT, 1, 64, FAR, FAR, 1, 0))
            seen[os.path.relpath(os.path.join(d, rel), state)] = "created"
        except OSError as exc:
            seen[os.path.relpath(os.path.join(d, rel), state)] = errno.errorcode[exc.errno]
print(json.dumps(seen))
"""


@pytest.fixture
def node() -> Iterator[tuple[Sim, AllocationPaths, GpuDevice]]:
    tmp = Path(tempfile.mkdtemp(prefix="qk", dir="/tmp"))
    os.chmod(tmp, 0o755)
    cfg = write_sim_config(tmp / "sim" / "gpus.conf", "T4", node=f"k-{tmp.name}")
    cfg = load_sim_config(cfg.path)
    g = cfg.gpus[0]
    gpu = GpuDevice(
        uuid=g.uuid, index=0, model="T4-16GB", memory_mib=g.memory_bytes >> 20, sm_count=g.sms
    )
    paths = AllocationPaths(
        state_dir=tmp / "state",
        hook_library=hook_library_path(),
        workload_env={k: str(v) for k, v in sim_environment(cfg.path).items()},
    )
    try:
        yield Sim(cfg, paths.state_dir / "slices"), paths, gpu
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def allocate(paths: AllocationPaths, gpu: GpuDevice, pod: str, core: int, isolation: str):
    ca = ContainerAssignment(
        gpus=[gpu.uuid],
        core=core,
        memory_gib=[4],
        isolation=IsolationPolicy.parse(isolation),
        devices={"core": {gpu.uuid: core}, "memory": {gpu.uuid: 4}},
    )
    return container_response(paths, pod, "c0", ca, [gpu], "core")


def test_a_container_cannot_gate_its_best_effort_neighbour(node) -> None:
    sim, paths, gpu = node
    victim_res = allocate(paths, gpu, "victim-pod", 50, "be")
    hostile_res = allocate(paths, gpu, "hostile-pod", 10, "be")
    burn = [sys.executable, str(WORKER), "burn", "--ns", "5000000", "--depth", "8"]
    victim = Container(dict(victim_res.envs), victim_res.mounts, burn)
    hostile = None
    try:
        wait_ready([victim.proc])
        forge = [sys.executable, "-c", FORGE]
        hostile = Container(dict(hostile_res.envs), hostile_res.mounts, forge)
        out, err = hostile.proc.communicate(timeout=60)
        assert hostile.proc.returncode == 0, err
        forged = json.loads(out.strip().splitlines()[-1])
        (share,) = measure_shares(sim, [(0, victim.proc)])
        finish([victim.proc])
    finally:
        for c in (victim, hostile):
            if c is not None and c.proc.poll() is None:
                c.proc.kill()
                c.proc.wait()
            if c is not None:
                shutil.rmtree(c.stage, ignore_errors=True)
    assert share > 90, f"victim {share:.1f} % alone on its GPU; the hostile container: {forged}"
    assert "forged" not in forged.values() and "created" not in forged.values(), forged
    assert "own" in forged.values(), forged  # its own activity file: the one it may write
