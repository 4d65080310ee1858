"""Node agent throughput: reserve/release operations per second and latency over the unix socket.

Starts ``qgpu agent --sim 2xH100-80GB`` in a private state directory, then runs, side by
side in one process:
- sequential: one client, reserve then release, N times;
- concurrent: C asyncio workers, each looping reserve -> release (slices of 5% / 4 GiB, so
  at most 32 are held at once and placement is always contended).
Every operation's latency is recorded; the script prints ops/s, p50 and p99 per mode.

    .venv/bin/python bench/agent_load.py [--ops 2000] [--concurrency 1 16 64]
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


def start_agent(state_dir: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "qgpu.cli",
            "agent",
            "--sim",
            "2xH100-80GB",
            "--state-dir",
            str(state_dir),
            "--test-mode",
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


async def run_concurrent(sock: Path, ops: int, workers: int) -> tuple[float, list[float], int]:
    """`ops` operations (reserve and release each count one) by `workers` loops."""
    latencies: list[float] = []
    no_fit = 0
    per_worker = max(2, ops // workers)
    conns = [await RawConnection.open(sock) for _ in range(workers)]

    async def worker(w: int) -> None:
        nonlocal no_fit
        conn = conns[w]
        done = 0
        body = {"request": {"core": 5, "memory": 4}, "owner": {"id": f"w{w}"}}
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


def run_sequential(sock: Path, ops: int) -> tuple[float, list[float], int]:
    """One AgentClient (the library adapters use), reserve then release."""
    latencies: list[float] = []
    with AgentClient(sock) as client:
        start = time.perf_counter()
        for _ in range(ops // 2):
            t0 = time.perf_counter()
            res = client.reserve({"core": 5, "memory": 4})
            t1 = time.perf_counter()
            client.release(res.slice_id)
            t2 = time.perf_counter()
            latencies += [t1 - t0, t2 - t1]
        elapsed = time.perf_counter() - start
    return elapsed, latencies, 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=2000, help="operations per mode")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    args = parser.parse_args()
    state = Path(tempfile.mkdtemp(prefix="qb", dir="/tmp"))
    proc = start_agent(state)
    sock = state / "agent.sock"
    try:
        run_sequential(sock, 100)  # warm-up
        print(f"qgpu agent over a unix socket, simulated 2xH100-80GB, {os.cpu_count()} CPUs")
        print(f"{'mode':<16}{'ops':>7}{'ops/s':>10}{'p50 ms':>10}{'p99 ms':>10}{'409s':>7}")
        for c in args.concurrency:
            if c == 1:
                elapsed, lat, no_fit = run_sequential(sock, args.ops)
                mode = "sequential"
            else:
                elapsed, lat, no_fit = asyncio.run(run_concurrent(sock, args.ops, c))
                mode = f"concurrent x{c}"
            print(
                f"{mode:<16}{len(lat):>7}{len(lat) / elapsed:>10.0f}"
                f"{statistics.median(lat) * 1e3:>10.2f}{pct(lat, 0.99) * 1e3:>10.2f}{no_fit:>7}"
            )
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(state, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
