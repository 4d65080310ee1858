"""Slice files per slice: who owns what under the state directory, and what another user
can do with a foreign slice's files (nothing). The attacks run as real other users (a
forked child that drops to another uid), so these tests need root and skip without it."""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from enforcement.agent.config import AgentConfig
from enforcement.agent.models import ReserveRequest
from enforcement.agent.service import Agent
from enforcement.discovery import open_backend
from enforcement.native import hook_library_path
from enforcement.state_tree import world_writable
from qgpu.model import SliceRequest
from tests.agent.conftest import FakeBackend, h100

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as other users")

VICTIM, ATTACKER = 40001, 40002  # uids without passwd entries: their group is their uid
SHARE = SliceRequest(core=30, memory_gib=4)


def as_user(uid: int, fn: Callable[[], object]) -> object:
    """Run `fn` in a forked child as `uid`/`gid uid` with no supplementary groups."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(read)
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            out = {"ok": fn()}
        except BaseException as exc:
            out = {"error": f"{type(exc).__name__}: {exc}"}
        os.write(write, json.dumps(out).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        data = f.read()
    os.waitpid(pid, 0)
    out = json.loads(data)
    assert "error" not in out, out["error"]
    return out["ok"]


def attempt(action: Callable[[], object]) -> str:
    """'ok' or the errno name an action fails with."""
    try:
        action()
    except OSError as exc:
        return errno.errorcode.get(exc.errno or 0, str(exc))
    return "ok"


@pytest.fixture
def root_agent(state_dir: Path) -> Iterator[Agent]:
    """An agent that owns its files as in production (root, no test mode)."""
    agent = Agent(
        AgentConfig(node_name="node-a", state_dir=state_dir, test_mode=False),
        FakeBackend([h100(0), h100(1)]),
    )
    yield agent
    agent.close()


@needs_root
def test_every_slice_has_its_own_directory_owned_as_documented(
    root_agent: Agent, state_dir: Path
) -> None:
    res = root_agent.reserve(ReserveRequest(request=SHARE, uid=VICTIM))
    assert (res.uid, res.gid) == (VICTIM, VICTIM)
    root = state_dir / "slices"
    d = root / res.slice_id
    expected = {
        root: (0, 0, 0o711),
        d: (0, VICTIM, 0o750),
        d / "limits.conf": (0, VICTIM, 0o440),
        d / "ledger": (VICTIM, VICTIM, 0o700),
        d / "ledger" / f"slice-{res.slice_id}.ledger": (VICTIM, VICTIM, 0o600),
        root / f".gpu-{h100(0).uuid}": (0, 0, 0o750),
        root / f".gpu-{h100(0).uuid}" / "roster": (0, 0, 0o640),
        root / f".gpu-{h100(0).uuid}" / f"{res.slice_id}.activity": (VICTIM, 0, 0o640),
    }
    for path, (uid, gid, mode) in expected.items():
        st = path.lstat()
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (uid, gid, mode), path
    assert res.limits_file == str(d / "limits.conf")
    assert res.env["QGPU_STATE_DIR"] == str(root)
    assert world_writable(state_dir) == []


@needs_root
def test_another_user_cannot_open_a_foreign_slice(root_agent: Agent, state_dir: Path) -> None:
    victim = root_agent.reserve(ReserveRequest(request=SHARE, uid=VICTIM))
    mine = root_agent.reserve(ReserveRequest(request=SHARE, uid=ATTACKER))
    root = state_dir / "slices"
    v = root / victim.slice_id
    ledger = v / "ledger" / f"slice-{victim.slice_id}.ledger"
    gpu = root / f".gpu-{victim.device_uuid}"
    own = root / mine.slice_id / "ledger" / f"slice-{mine.slice_id}.ledger"

    def probe() -> dict[str, str]:
        return {
            "write victim ledger": attempt(lambda: os.close(os.open(ledger, os.O_RDWR))),
            "read victim ledger": attempt(lambda: os.close(os.open(ledger, os.O_RDONLY))),
            "read victim limits": attempt(lambda: Path(v / "limits.conf").read_bytes()),
            "list victim dir": attempt(lambda: os.listdir(v)),
            "create in victim dir": attempt(lambda: (v / "x").write_text("x")),
            "replace victim ledger dir": attempt(lambda: os.rename(v / "ledger", v / "old")),
            "list the slices": attempt(lambda: os.listdir(root)),
            "squat a new slice": attempt(lambda: (root / "s-squat").mkdir()),
            # the GPU's shared state is the workload group's (--workload-gid, 0 here)
            "read the GPU roster": attempt(lambda: (gpu / "roster").read_bytes()),
            "write victim activity": attempt(
                lambda: os.close(os.open(gpu / f"{victim.slice_id}.activity", os.O_RDWR))
            ),
            "open own ledger": attempt(lambda: os.close(os.open(own, os.O_RDWR))),
            "read own limits": attempt(
                lambda: Path(root / mine.slice_id / "limits.conf").read_bytes()
            ),
        }

    seen = as_user(ATTACKER, probe)
    assert seen == {
        "write victim ledger": "EACCES",
        "read victim ledger": "EACCES",
        "read victim limits": "EACCES",
        "list victim dir": "EACCES",
        "create in victim dir": "EACCES",
        "replace victim ledger dir": "EACCES",
        "list the slices": "EACCES",
        "squat a new slice": "EACCES",
        "read the GPU roster": "EACCES",
        "write victim activity": "EACCES",
        "open own ledger": "ok",
        "read own limits": "ok",
    }
    # and the owner can use its own, but not loosen its caps
    victim_view = as_user(
        VICTIM,
        lambda: {
            "open ledger": attempt(lambda: os.close(os.open(ledger, os.O_RDWR))),
            "rewrite limits": attempt(lambda: Path(v / "limits.conf").write_text("x")),
            "replace limits": attempt(lambda: os.rename(v / "limits.conf", v / "l")),
        },
    )
    assert victim_view == {
        "open ledger": "ok",
        "rewrite limits": "EACCES",
        "replace limits": "EACCES",
    }


# A CUDA program in C (the Python of this machine is not readable by other users): cuInit,
# a context, then one allocation of N GiB per argument; prints "init <code>" or ok/oom.
ALLOC_C = r"""
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
typedef int (*init_t)(unsigned);
typedef int (*get_t)(int *, int);
typedef int (*retain_t)(void **, int);
typedef int (*cur_t)(void *);
typedef int (*alloc_t)(unsigned long long *, size_t);
int main(int argc, char **argv) {
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (!cuda) { printf("dlopen %s\n", dlerror()); return 0; }
    int dev, rc = ((init_t)dlsym(cuda, "cuInit"))(0);
    if (rc) { printf("init %d\n", rc); return 0; }
    void *ctx;
    ((get_t)dlsym(cuda, "cuDeviceGet"))(&dev, 0);
    ((retain_t)dlsym(cuda, "cuDevicePrimaryCtxRetain"))(&ctx, dev);
    ((cur_t)dlsym(cuda, "cuCtxSetCurrent"))(ctx);
    alloc_t alloc = (alloc_t)dlsym(cuda, "cuMemAlloc_v2");
    for (int i = 1; i < argc; i++) {
        unsigned long long p;
        printf(i > 1 ? " %s" : "%s", alloc(&p, (size_t)atoi(argv[i]) << 30) ? "oom" : "ok");
    }
    printf("\n");
    return 0;
}
"""


@needs_root
def test_interposer_of_another_user_cannot_join_or_shrink_a_slice(state_dir: Path) -> None:
    """The attack of issue 18: a process of another user used a victim slice's ledger to
    make the victim's allocations fail early. Now it cannot even open it."""
    hook = hook_library_path()  # built by the install: a missing one is a failure
    os.chmod(state_dir, 0o755)
    backend = open_backend("sim", sim_spec="1xH100-80GB", state_dir=state_dir, node_name="n")
    agent = Agent(
        AgentConfig(node_name="n", state_dir=state_dir, hook_path=hook, test_mode=False), backend
    )
    try:
        victim = agent.reserve(ReserveRequest(request=SHARE, uid=VICTIM))

        prog = state_dir / "alloc"
        (state_dir / "alloc.c").write_text(ALLOC_C)
        subprocess.run(
            ["cc", "-O1", "-o", str(prog), str(state_dir / "alloc.c"), "-ldl"],
            check=True,
            timeout=60,
        )

        def run(uid: int, *gib: int) -> str:
            out = subprocess.run(
                [str(prog), *map(str, gib)],
                env={**os.environ, **victim.env},
                user=uid,
                group=uid,
                extra_groups=[],
                capture_output=True,
                text=True,
                cwd="/",
                timeout=60,
            )
            return out.stdout.strip() or out.stderr.strip()[-300:]

        assert run(ATTACKER, 1).startswith("init")  # refused at cuInit: no ledger for it
        assert run(VICTIM, 3) == "ok"  # the victim's whole cap is still its own
        assert run(VICTIM, 3, 1) == "ok oom"
    finally:
        agent.close()
        backend.close()
