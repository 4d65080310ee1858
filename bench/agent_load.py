"""Node agent throughput: reserve/release operations per second and latency over the unix socket.

For each number of live slices L (``--live``, default 10 100 1000), side by side in one run,
starts a fresh ``qgpu agent --sim 64xH100-80GB --max-slices-per-gpu 20`` in a private state
directory, fills it with L held slices (1 % / 1 GiB each, spread over the GPUs), then runs:
- sequential: one client (`AgentClient`, what the adapters use), reserve then release;
- concurrent: C asyncio workers, each looping reserve -> release (slices of 5 % / 4 GiB).
Every operation's latency is recorded; the script prints ops/s, p50 and p99 per mode and
live count, the agent process's CPU time per operation (user + system, from
``/proc/<pid>/stat``: what the agent itself spends, whatever else runs on the machine),
each mode's ops/s as a ratio to the smallest live count (a flat curve is 1.00: the
cost of a reservation does not grow with the slices already held) and the machine's
1-minute load average when the mode ended.

The agent runs with ``--test-mode`` (files keep the bench's owner, no slice cgroups) unless
``--as-root``: then, run as root, it owns the slice files as in production (chown to the
slices' users) and makes a cgroup for each slice owned by a process. ``--pid-owners``
makes the loop's slices owned by live processes (one ``sleep`` per connection, owner kind
``pid``), as Ray's, Dask's and ``qgpu run``'s slices are; with ``--as-root`` each such
reservation moves its owner into a new cgroup and its release moves it back.

Each level also prints what creating files costs in the state root at that moment
(``fs probe``: CPU per mkdir, per file creation; a new slice makes two directories and
three files): on a shared disk it can change tenfold within minutes, whatever the agent
does. ``--state-root`` picks the file system (default /tmp).

    .venv/bin/python bench/agent_load.py [--ops 2000] [--concurrency 1 16] [--live 10 100 1000]
        [--state-root DIR] [--as-root] [--pid-owners]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from enforcement.agent.client import AgentClient, AgentUnavailable

REPO = Path(__file__).resolve().parents[1]


def start_agent(state_dir: Path, *, as_root: bool = False) -> subprocess.Popen:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "qgpu.cli",
            "agent",
            "--sim",
            "64xH100-80GB",
            "--max-slices-per-gpu",
            "20",
            "--state-dir",
            str(state_dir),
            *([] if as_root else ["--test-mode"]),
            "--log-level",
            "warning",
        ],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with AgentClient(state_dir / "agent.sock", timeout=2) as c:
                c.health()
            return proc
        except AgentUnavailable:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("the agent did not start")


async def fill(sock: Path, live: int, workers: int = 8) -> None:
    """Hold `live` small slices (they stay until the agent stops)."""
    conns = [await RawConnection.open(sock) for _ in range(workers)]

    async def worker(w: int) -> None:
        for i in range(w, live, workers):
            body = {"request": {"core": 1, "memory": 1}, "owner": {"id": f"held-{i}"}}
            status, res = await conns[w].request("POST", "/v1/slices", body)
            if status != 201:
                raise SystemExit(f"filling: reserve answered {status}: {res}")

    await asyncio.gather(*(worker(w) for w in range(workers)))
    for conn in conns:
        conn.close()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def load1() -> float:
    """The machine's 1-minute load average."""
    return os.getloadavg()[0]


def fs_probe(root: Path, n: int = 200) -> tuple[float, float]:
    """CPU microseconds per mkdir and per file creation (each undone) in `root` now."""
    d = Path(tempfile.mkdtemp(prefix="qf", dir=root))
    try:
        t0 = time.thread_time()
        for i in range(n):
            os.mkdir(d / f"d{i}")
        t1 = time.thread_time()
        for i in range(n):
            os.close(os.open(d / f"f{i}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        t2 = time.thread_time()
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return (t1 - t0) / n * 1e6, (t2 - t1) / n * 1e6


def owner_processes(count: int) -> list[subprocess.Popen]:
    """Live processes to own slices (`--pid-owners`)."""
    return [subprocess.Popen(["sleep", "3600"]) for _ in range(count)]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class RawConnection:
    """A minimal HTTP/1.1 keep-alive client on one unix-socket connection.

    httpx's async pool costs more CPU per request than the agent does once dozens of
    connections are open; on a 2-core machine it would measure the client, not the agent.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, sock: Path) -> RawConnection:
        return cls(*await asyncio.open_unix_connection(str(sock)))

    async def request(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        payload = json.dumps(body).encode() if body is not None else b""
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: agent\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n"
        )
        self.writer.write(head.encode() + payload)
        status_line = await self.reader.readline()
        length = 0
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            if name.lower() == "content-length":
                length = int(value)
        data = await self.reader.readexactly(length)
        return int(status_line.split()[1]), json.loads(data)

    def close(self) -> None:
        self.writer.close()


async def run_concurrent(
    sock: Path, ops: int, workers: int, owners: list[int] | None = None
) -> tuple[float, list[float], int]:
    """`ops` operations (reserve and release each count one) by `workers` loops (each
    owner a live process of `owners` when given)."""
    latencies: list[float] = []
    no_fit = 0
    per_worker = max(2, ops // workers)
    conns = [await RawConnection.open(sock) for _ in range(workers)]

    async def worker(w: int) -> None:
        nonlocal no_fit
        conn = conns[w]
        done = 0
        owner = {"kind": "pid", "id": str(owners[w])} if owners else {"id": f"w{w}"}
        body = {"request": {"core": 5, "memory": 4}, "owner": owner}
        while done < per_worker:
            t0 = time.perf_counter()
            status, res = await conn.request("POST", "/v1/slices", body)
            latencies.append(time.perf_counter() - t0)
            done += 1
            if status == 409:
                no_fit += 1
                continue
            if status != 201:
                raise SystemExit(f"reserve answered {status}: {res}")
            t1 = time.perf_counter()
            status, _ = await conn.request("DELETE", f"/v1/slices/{res['slice_id']}")
            latencies.append(time.perf_counter() - t1)
            done += 1

    start = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(workers)))
    elapsed = time.perf_counter() - start
    for conn in conns:
        conn.close()
    return elapsed, latencies, no_fit


def run_sequential(
    sock: Path, ops: int, owner: int | None = None
) -> tuple[float, list[float], int]:
    """One AgentClient (the library adapters use), reserve then release."""
    latencies: list[float] = []
    who = {"kind": "pid", "id": str(owner)} if owner else None
    with AgentClient(sock) as client:
        start = time.perf_counter()
        for _ in range(ops // 2):
            t0 = time.perf_counter()
            res = client.reserve({"core": 5, "memory": 4}, who)
            t1 = time.perf_counter()
            client.release(res.slice_id)
            t2 = time.perf_counter()
            latencies += [t1 - t0, t2 - t1]
        elapsed = time.perf_counter() - start
    return elapsed, latencies, 0


def measure(
    live: int,
    ops: int,
    concurrency: list[int],
    *,
    root: Path = Path("/tmp"),
    as_root: bool = False,
    pid_owners: bool = False,
) -> tuple[dict[str, tuple], tuple[float, float]]:
    """ops/s, p50, p99, 409 count, agent CPU per op and load per mode, with `live` slices
    held throughout; and the file system probe of the state root."""
    state = Path(tempfile.mkdtemp(prefix="qb", dir=root))
    proc = start_agent(state, as_root=as_root)
    sock = state / "agent.sock"
    owners = owner_processes(max(concurrency)) if pid_owners else []
    pids = [o.pid for o in owners]
    rows: dict[str, tuple] = {}
    try:
        asyncio.run(fill(sock, live))
        run_sequential(sock, 100, pids[0] if pids else None)  # warm-up
        probe = fs_probe(root)
        for c in concurrency:
            cpu0 = cpu_seconds(proc.pid)
            if c == 1:
                elapsed, lat, no_fit = run_sequential(sock, ops, pids[0] if pids else None)
                mode = "sequential"
            else:
                elapsed, lat, no_fit = asyncio.run(run_concurrent(sock, ops, c, pids or None))
                mode = f"concurrent x{c}"
            rows[mode] = (
                len(lat),
                len(lat) / elapsed,
                statistics.median(lat) * 1e3,
                pct(lat, 0.99) * 1e3,
                no_fit,
                (cpu_seconds(proc.pid) - cpu0) / len(lat) * 1e3,
                load1(),
            )
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        for o in owners:
            o.kill()
            o.wait()
        shutil.rmtree(state, ignore_errors=True)
    return rows, probe


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=2000, help="operations per mode")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--live", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument(
        "--state-root",
        type=Path,
        default=Path("/tmp"),
        help="where the agents' state directories go (their file system is probed)",
    )
    parser.add_argument(
        "--as-root",
        action="store_true",
        help="run the agent without --test-mode (needs root): production ownership, cgroups",
    )
    parser.add_argument(
        "--pid-owners", action="store_true", help="slices owned by live processes (kind pid)"
    )
    args = parser.parse_args()
    if max(args.live) > 64 * 20 - 128:
        parser.error(f"--live: at most {64 * 20 - 128} (64 GPUs x 20 slices, room to work)")
    if args.as_root and os.geteuid() != 0:
        parser.error("--as-root needs root")
    started = os.getloadavg()
    results = {
        live: measure(
            live,
            args.ops,
            args.concurrency,
            root=args.state_root,
            as_root=args.as_root,
            pid_owners=args.pid_owners,
        )
        for live in args.live
    }
    base = min(args.live)
    how = "as root" if args.as_root else "--test-mode"
    how += ", pid owners" if args.pid_owners else ""
    print(
        f"qgpu agent over a unix socket, simulated 64xH100-80GB, {os.cpu_count()} CPUs, "
        f"state in {args.state_root}, {how}; load average at start "
        + " ".join(f"{x:.2f}" for x in started)
    )
    print(
        f"{'live':>6}  {'mode':<16}{'ops':>7}{'ops/s':>10}{'p50 ms':>10}{'p99 ms':>10}"
        f"{'409s':>7}{'cpu ms/op':>11}{'ratio':>8}{'load':>7}"
    )
    for live, (rows, (mkdir_us, creat_us)) in results.items():
        for mode, (n, rate, p50, p99, no_fit, cpu, load) in rows.items():
            ratio = rate / results[base][0][mode][1]
            print(
                f"{live:>6}  {mode:<16}{n:>7}{rate:>10.0f}{p50:>10.2f}{p99:>10.2f}"
                f"{no_fit:>7}{cpu:>11.2f}{ratio:>8.2f}{load:>7.2f}"
            )
        print(f"{'':>8}fs probe: mkdir {mkdir_us:.0f} us, file creation {creat_us:.0f} us CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
