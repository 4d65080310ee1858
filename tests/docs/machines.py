"""Machines for the docs' multi-node recipes: each one a set of Linux namespaces on this host.

A recipe written for the nodes of a cluster (``qgpu agent &`` then ``qgpu-ray start ...`` on
every node, ``ray stop`` to leave) runs here as written on two or more *machines* that are
namespaces, not containers or VMs, and need no root:

- one unprivileged user namespace (``unshare --user --map-root-user``), inside which the
  commands run as root, as the recipes say, while on the host they are the test's own user;
- per machine, its own network namespace (its own address on a private bridge, its own
  loopback and ports: two machines both listen on 6379 without meeting each other or the
  host), PID namespace (``ps``, ``kill`` and ``ray stop`` see that machine's processes only,
  and when the machine's first process ends every process of the machine ends with it),
  UTS namespace (its own hostname, so its agent's node name and simulated GPUs' UUIDs are
  its own) and mount namespace with private ``/run``, ``/var/lib`` and ``/dev/shm``
  (tmpfs: the agent's ``/var/lib/qgpu`` and ``/run/qgpu/agent.sock`` are the machine's
  own and vanish with it) and a private ``/tmp`` (a directory of the test, so Ray's
  session logs stay readable from outside);
- an ``/etc/hosts`` that names every machine, as a cluster's DNS would, and an
  ``/etc/resolv.conf`` with no server (there is none on the private network: other names
  fail at once instead of after the resolver's timeouts).

The rest of the file system (the repository, its ``.venv``) is shared, as a fleet built
from one image shares its software; where the checkout, its venv or the interpreter lie
under one of the private directories (a clone in ``/tmp``), each machine gets them bound
back at the same path. A machine's first process is a shell reading its
commands from the test: if the test dies, the shell reads end-of-file and exits, and the
machine's processes end with it. Where user namespaces (or veth/bridge devices in them)
are not allowed, `problem()` says why in one line, naming the command and its error.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from functools import cache
from pathlib import Path

SUBNET = "10.213.0"  # addresses exist only on the namespaces' private bridge
NEST = ["nsenter", "--user", "--net", "--mount", "-t"]
MACHINE_NS = [
    *("unshare", "--net", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc"),
    "--uts",
]
# run as the machine's first process: its mounts, hostname and network, then a shell that
# reads its commands from stdin (it runs as PID 1, so every process of the machine ends
# with it)
SETUP = r"""
set -e
name=$1 addr=$2 link=$3 io=$4 etc=$5
shift 5  # the rest: host paths under those mounted below that the machine must see
exec 2>"$io/.setup.log"
i=0
for keep in "$@"; do  # held aside before the private mounts can hide them
    mkdir -p "$io/.keep/$i"; mount --rbind "$keep" "$io/.keep/$i"; i=$((i + 1))
done
mount --bind "$etc/hosts" /etc/hosts
mount --bind "$etc/resolv.conf" /etc/resolv.conf
mount --rbind "$io" /tmp  # with the paths held aside under it
mount -t tmpfs machine-run /run
mount -t tmpfs machine-var-lib /var/lib
mount -t tmpfs machine-shm /dev/shm
i=0
for keep in "$@"; do  # put back where it was (e.g. a checkout under /tmp)
    mkdir -p "$keep"; mount --rbind "/tmp/.keep/$i" "$keep"
    i=$((i + 1))
done
hostname "$name"
ip link set lo up
n=0; until ip link show "$link" >/dev/null 2>&1; do
    n=$((n + 1)); [ $n -lt 400 ] || { echo "no $link after 20 s" >&2; exit 1; }; sleep 0.05
done
ip addr add "$addr/24" dev "$link"
ip link set "$link" up
ip route add default dev "$link"
touch /tmp/.ready  # the machine's /tmp is $io
exec 2>&1
set +e
exec bash --noprofile --norc
"""


PRIVATE = ("/tmp", "/run", "/var/lib", "/dev/shm")  # each machine's own (SETUP mounts them)


def _kept_paths(cwd: Path) -> list[str]:
    """What the machines run from (the checkout, the venv, the interpreter) where it lies
    under a directory a machine makes private (a clone in /tmp, as CI's may be): SETUP
    puts these back, so every machine still sees them."""
    used = {cwd.resolve(), Path(sys.prefix), Path(sys.base_prefix)}
    used.add(Path(sys.executable).resolve().parent)
    hidden = {p for p in used if any(p.is_relative_to(d) for d in PRIVATE)}
    # a path inside another kept one comes along with it
    return sorted(str(p) for p in hidden if not any(p != q and p.is_relative_to(q) for q in hidden))


def _run(cmd: Sequence[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)


def _holder() -> subprocess.Popen[bytes]:
    """The user namespace (and the bridge's network namespace) that the machines live in:
    a ``cat`` that ends when its stdin closes, or when the test process dies."""
    proc = subprocess.Popen(
        ["unshare", "--user", "--map-root-user", "--net", "--mount", "cat"],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and proc.poll() is None:
        with contextlib.suppress(OSError):
            if Path(f"/proc/{proc.pid}/comm").read_text().strip() == "cat":
                return proc  # unshare has set up the namespaces and exec'd cat
        time.sleep(0.01)
    proc.kill()
    _, err = proc.communicate()
    raise OSError(f"unshare --user --map-root-user --net --mount: {err.decode().strip()}")


def _in_holder(holder: subprocess.Popen[bytes], *cmd: str) -> None:
    out = _run([*NEST, str(holder.pid), *cmd])
    if out.returncode != 0:
        raise OSError(f"{' '.join(cmd)} (in the namespace): {out.stderr.strip()}")


@cache
def problem() -> str | None:
    """Why machines cannot be made here (one line), or None."""
    missing = [c for c in ("unshare", "nsenter", "ip", "mount") if shutil.which(c) is None]
    if missing:
        return f"util-linux/iproute2 commands missing: {', '.join(missing)}"
    try:
        holder = _holder()
    except OSError as exc:
        return f"an unprivileged user namespace is not allowed here ({exc})"
    try:
        _in_holder(holder, "ip", "link", "add", "probe0", "type", "bridge")
        out = _run([*NEST, str(holder.pid), *MACHINE_NS, "true"])
        if out.returncode != 0:
            return f"{' '.join(MACHINE_NS)} true failed here: {out.stderr.strip()}"
    except OSError as exc:
        return f"a bridge in a user namespace is not allowed here ({exc})"
    finally:
        holder.kill()
        holder.wait()
    return None


class Machines:
    """Named machines on one private network; ``machines.proc[name]`` is that machine's
    shell (stdin: its commands; stdout and stderr: its setup's failures) and its ``/tmp``
    is ``root / name`` here."""

    def __init__(self, names: Sequence[str], root: Path, env: dict[str, str], cwd: Path) -> None:
        self.root = root
        self.cwd = cwd
        self.address = {name: f"{SUBNET}.{i + 1}" for i, name in enumerate(names)}
        self.proc: dict[str, subprocess.Popen[str]] = {}
        self.holder = _holder()
        try:
            _in_holder(self.holder, "ip", "link", "add", "lan", "type", "bridge")
            _in_holder(self.holder, "ip", "link", "set", "lan", "up")
            etc = root / ".etc"
            etc.mkdir(parents=True)
            hosts = [f"{addr}\t{name}" for name, addr in self.address.items()]
            (etc / "hosts").write_text("\n".join(["127.0.0.1\tlocalhost", *hosts, ""]))
            (etc / "resolv.conf").write_text("# no DNS server on the machines' network\n")
            for i, name in enumerate(names):
                self._start(name, f"m{i}", env)
            for name, proc in self.proc.items():
                self._wait_ready(name, proc)
        except BaseException:
            self.close()
            raise

    def _start(self, name: str, link: str, env: dict[str, str]) -> None:
        io = self.root / name
        io.mkdir(parents=True)
        proc = subprocess.Popen(
            [
                *NEST,
                str(self.holder.pid),
                *MACHINE_NS,
                "bash",
                "-c",
                SETUP,
                "machine",
                name,
                self.address[name],
                "eth0",
                str(io),
                str(self.root / ".etc"),
                *_kept_paths(self.cwd),
            ],
            cwd=self.cwd,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        self.proc[name] = proc
        # nsenter enters the holder's namespaces, then execs unshare (no fork without
        # --pid), which makes the machine's: wait until it is in a netns of its own
        before = {os.readlink(f"/proc/{pid}/ns/net") for pid in (os.getpid(), self.holder.pid)}
        deadline = time.monotonic() + 10
        while True:
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{proc.pid}/ns/net") not in before:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise OSError(f"machine {name}: {' '.join(MACHINE_NS)} did not start")
            time.sleep(0.01)
        _in_holder(
            self.holder,
            "ip",
            "link",
            "add",
            link,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            str(proc.pid),
        )
        _in_holder(self.holder, "ip", "link", "set", link, "master", "lan", "up")

    def _wait_ready(self, name: str, proc: subprocess.Popen[str]) -> None:
        io = self.root / name
        deadline = time.monotonic() + 30
        while not (io / ".ready").exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                log = io / ".setup.log"
                raise OSError(
                    f"machine {name} did not come up: "
                    f"{log.read_text().strip() if log.exists() else 'no log'}"
                )
            time.sleep(0.02)

    def shell_pid(self, name: str) -> int:
        """The host's pid of machine `name`'s shell (its PID 1; unshare's only child)."""
        pid = self.proc[name].pid
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        assert len(children) == 1, f"machine {name}: unshare has children {children}"
        return int(children[0])

    def close(self) -> None:
        """End every machine (every process in them ends with its PID 1) and the holder."""
        for proc in self.proc.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        self.holder.kill()
        self.holder.wait()
