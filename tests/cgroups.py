"""Cgroups that a test makes and removes itself: a private subtree of the cgroup v2
hierarchy (``qtest-<random>`` under the v2 mount), fake kubelet layouts inside it, and
moving test processes in.

Where cgroup v2 is not mounted at all (a cgroup v1-only host) the tests that need it are
skipped, saying so. Where it is mounted but this process cannot make a cgroup in it (not
root, a read-only mount), they fail: the attribution they test would not work on such a
node either, and a silent skip would hide that.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

NOT_MOUNTED = (
    "cgroup v2 is not mounted on this machine (no cgroup2 entry in /proc/self/mountinfo): "
    "the agent's per-slice cgroups and Kubernetes pod attribution need the unified hierarchy"
)


def v2_mount() -> Path | None:
    """Where cgroup v2 is mounted (the hybrid layout's /sys/fs/cgroup/unified included)."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        left, _, right = line.partition(" - ")
        fields = left.split()
        if right.split()[:1] == ["cgroup2"] and len(fields) >= 5 and fields[3] == "/":
            return Path(fields[4])
    return None


def own_cgroup(pid: int | str = "self") -> str:
    """The v2 path of a process (its ``0::`` line)."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return line[3:]
    raise AssertionError(f"process {pid} has no cgroup v2 line")


class Sandbox:
    """A private cgroup subtree; everything made in it is removed by `close`."""

    def __init__(self, mount: Path) -> None:
        self.mount = mount
        self.root = mount / f"qtest-{secrets.token_hex(4)}"
        try:
            self.root.mkdir()
        except OSError as exc:
            pytest.fail(f"cgroup v2 at {mount} is mounted but not writable here: {exc}")
        self.home = mount / own_cgroup().lstrip("/")  # where leftovers are moved back to

    def path(self, rel: str) -> str:
        """The v2 path (as /proc/<pid>/cgroup shows it) of `rel` inside the sandbox."""
        return "/" + str((self.root / rel).relative_to(self.mount))

    def make(self, rel: str) -> Path:
        d = self.root / rel
        d.mkdir(parents=True, exist_ok=True)
        return d

    def move(self, pid: int, rel: str) -> None:
        (self.make(rel) / "cgroup.procs").write_text(str(pid))

    def close(self) -> None:
        """Move out what still runs in the sandbox (children of the agent's own slice
        cgroups included), then remove every directory, deepest first."""
        for _ in range(50):
            dirs = sorted(
                (Path(d) for d, _subs, _files in os.walk(self.root)),
                key=lambda p: len(p.parts),
                reverse=True,
            )
            for d in dirs:
                with contextlib.suppress(OSError):
                    for pid in (d / "cgroup.procs").read_text().split():
                        with contextlib.suppress(OSError):
                            (self.home / "cgroup.procs").write_text(pid)
                with contextlib.suppress(OSError):
                    d.rmdir()
            if not self.root.exists():
                return
            time.sleep(0.05)  # a process just killed leaves its cgroup a moment later
        raise AssertionError(f"could not remove the test cgroups under {self.root}")


@pytest.fixture
def cgroup_sandbox() -> Iterator[Sandbox]:
    mount = v2_mount()
    if mount is None:
        pytest.skip(NOT_MOUNTED)
    box = Sandbox(mount)
    try:
        yield box
    finally:
        box.close()


def systemd_pod(qos: str, uid: str, container: str) -> str:
    """A container's cgroup as kubelet's systemd driver names it (QoS ``guaranteed``
    has no class level)."""
    u = uid.replace("-", "_")
    if qos == "guaranteed":
        return f"kubepods.slice/kubepods-pod{u}.slice/cri-containerd-{container}.scope"
    return (
        f"kubepods.slice/kubepods-{qos}.slice/kubepods-{qos}-pod{u}.slice/"
        f"cri-containerd-{container}.scope"
    )


def cgroupfs_pod(qos: str, uid: str, container: str) -> str:
    """A container's cgroup as kubelet's cgroupfs driver names it."""
    if qos == "guaranteed":
        return f"kubepods/pod{uid}/{container}"
    return f"kubepods/{qos}/pod{uid}/{container}"
