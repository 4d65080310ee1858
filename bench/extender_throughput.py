"""Scheduler-extender throughput: filter + prioritize + bind over HTTP, nodeCacheCapable.

Three processes, as in a cluster: the fake apiserver (tests/fakes/apiserver.py, real HTTP,
seeded with N nodes x G GPUs and the pending pods), the extender (``k8s_bridge`` served by
uvicorn, watches on), and this driver playing kube-scheduler: for each pod, ``/filter``
with all node names, ``/prioritize`` with the survivors, pick the best score, and hand the
``/bind`` to a pool of binding workers (kube-scheduler binds asynchronously, one goroutine
per pod). Prints pods/s (first filter to last bind) and p50/p99 per verb. No assertions.

``--pin`` (the default) gives the extender a CPU of its own and the apiserver and the
driver the other CPU(s), as in a cluster, where the extender's pod has its own CPU;
``--no-pin`` lets the three processes share every CPU (the scheduler then moves them
between the cores, and the extender's CPU per pod rises by about a tenth).

    .venv/bin/python bench/extender_throughput.py [--nodes 1000] [--gpus 8] [--pods 1000]
        [--policy binpack|spread|frag[,...]] [--rounds 1] [--bind-workers 16]
        [--extender-bind-threads 4] [--nodes-per-pod all|kube|N] [--pin | --no-pin]

``--policy`` defaults to the extender's own default node policy (qgpu's default, frag);
several policies (``--policy binpack,frag --rounds 3``) run one after the other in one
invocation, alternating, with a summary line per run (pods/s, the extender's CPU per pod,
the load average) at the end: compare policies within one invocation, not across days.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import operator
import os
import socket
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SHAPES: list[tuple[int, int | None]] = [
    (10, 2),
    (20, 4),
    (25, 8),
    (30, 8),
    (50, 16),
    (15, 4),
    (100, None),
    (40, 10),
]


def cluster_nodes(nodes: int, gpus: int) -> list[dict[str, Any]]:
    """The bench's Node objects: `nodes` nodes of `gpus` H100s, each publishing its
    inventory (also `bench/extender_decisions.py`'s cluster)."""
    from k8s_bridge.protocol import PublishedInventory
    from k8s_bridge.resources import Names
    from qgpu.model import GpuDevice
    from tests.fakes.apiserver import node_object

    ann = Names().inventory_annotation
    out = []
    for n in range(nodes):
        inv = PublishedInventory(
            gpus=[
                GpuDevice(
                    uuid=f"GPU-{n:08x}-0000-4000-8000-{g:012x}",
                    index=g,
                    model="H100-80GB",
                    memory_mib=81920,
                )
                for g in range(gpus)
            ],
            max_slices_per_gpu=16,
            published_at=0,
        )
        out.append(node_object(f"node-{n:04d}", None, **{ann: inv.model_dump_json()}))
    return out


def _apiserver(nodes: int, gpus: int, pods: int, out: Any) -> None:
    from tests.fakes.apiserver import FakeApiserver
    from tests.k8s.helpers import pod_object

    srv = FakeApiserver()
    for node in cluster_nodes(nodes, gpus):
        srv.store.create("nodes", node)
    for i in range(pods):
        pod = pod_object(f"pod-{i:05d}", [SHAPES[i % len(SHAPES)]])
        pod["spec"]["schedulerName"] = "qgpu-scheduler"
        srv.store.create("pods", pod)
    srv.start()
    out.put(srv.url)
    while True:
        time.sleep(3600)


def _extender(
    api_url: str,
    policy: str,
    port: int,
    bind_threads: int,
    transport: str,
    ready: Any,
    sign: bool = True,
) -> None:
    import logging

    from k8s_bridge.extender.app import create_app
    from k8s_bridge.extender.service import Extender, ExtenderConfig
    from k8s_bridge.http_serving import serve
    from k8s_bridge.kube import Kube, make_api_client
    from k8s_bridge.resources import Names

    logging.basicConfig(level=logging.WARNING)
    kube = Kube(make_api_client(api_url), Names(), transport=transport)
    from k8s_bridge.assignment_mac import AssignmentKeys

    keys = AssignmentKeys(os.urandom(32).hex().encode()) if sign else None  # the chart's default
    ext = Extender(kube, ExtenderConfig(node_policy=policy), keys)
    ext.start()
    ready.put(len(ext.state.inventories))
    serve(create_app(ext, bind_threads=bind_threads), host="127.0.0.1", port=port)


# the CPUs this driver may use, as it started (`_pin` narrows the driver's own set; a later
# run in the same invocation starts from this again)
_CPUS = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def _unpin() -> None:
    """Give the driver back every CPU it started with (before a run spawns its processes,
    which inherit the driver's set)."""
    if _CPUS:
        for task in Path(f"/proc/{os.getpid()}/task").iterdir():
            os.sched_setaffinity(int(task.name), set(_CPUS))


def _pin(extender_pid: int, others: list[int]) -> str:
    """The extender on the last CPU we may use, everything else on the rest; what was done."""
    if not hasattr(os, "sched_setaffinity"):
        return "not pinned (no sched_setaffinity here)"
    cpus = _CPUS
    if len(cpus) < 2:
        return "not pinned (one CPU)"
    for pid, where in [(extender_pid, {cpus[-1]})] + [(p, set(cpus[:-1])) for p in others]:
        for task in Path(f"/proc/{pid}/task").iterdir():  # every thread started so far;
            os.sched_setaffinity(int(task.name), where)  # later ones inherit it
    return f"extender pinned to CPU {cpus[-1]}, apiserver and driver to CPU(s) {cpus[:-1]}"


def _cpu_s(pid: int | None) -> tuple[float, float]:
    """(user, system) CPU seconds of a process so far (Linux /proc)."""
    if pid is None:
        return float("nan"), float("nan")
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


class _Conn:
    """A keep-alive HTTP/1.1 connection per thread, spoken over a plain socket.

    The driver stands in for kube-scheduler, whose Go HTTP client and JSON take a few
    microseconds per call. ``http.client`` parses every reply's headers with the ``email``
    package, and that costs about 0.1 ms of Python per call. On this shared 2-core machine,
    that time would be charged to the extender's round trips. So this client writes the
    request line and headers itself and reads the status, the headers, and a Content-Length
    or chunked body. The replies are decoded with orjson.
    """

    def __init__(self, port: int) -> None:
        self.port = port
        self.local = threading.local()

    def _socket(self) -> socket.socket:
        sock = getattr(self.local, "sock", None)
        if sock is None:
            sock = socket.create_connection(("127.0.0.1", self.port))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.local.sock = sock
            self.local.buf = b""
        return sock

    def _read_until(self, sock: socket.socket, buf: bytes, marker: bytes) -> tuple[bytes, int]:
        while (at := buf.find(marker)) < 0:
            chunk = sock.recv(262144)
            if not chunk:
                raise ConnectionError("the extender closed the connection")
            buf += chunk
        return buf, at

    def _read_n(self, sock: socket.socket, buf: bytes, n: int) -> bytes:
        while len(buf) < n:
            chunk = sock.recv(max(262144, n - len(buf)))
            if not chunk:
                raise ConnectionError("the extender closed the connection")
            buf += chunk
        return buf

    def post(self, path: str, body: bytes) -> Any:
        sock = self._socket()
        sock.sendall(
            b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(body), body)
        )
        buf, at = self._read_until(sock, self.local.buf, b"\r\n\r\n")
        head, buf = buf[:at].decode("latin-1"), buf[at + 4 :]
        status_line, *lines = head.split("\r\n")
        status = int(status_line.split(" ", 2)[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines)}
        if "content-length" in headers:
            n = int(headers["content-length"])
            buf = self._read_n(sock, buf, n)
            data, buf = buf[:n], buf[n:]
        elif headers.get("transfer-encoding", "").lower() == "chunked":
            parts = []
            while True:
                buf, at = self._read_until(sock, buf, b"\r\n")
                size = int(buf[:at].split(b";")[0], 16)
                buf = self._read_n(sock, buf, at + 2 + size + 2)
                parts.append(buf[at + 2 : at + 2 + size])
                buf = buf[at + 2 + size + 2 :]
                if size == 0:
                    break
            data = b"".join(parts)
        else:
            raise RuntimeError(f"{path}: a reply with neither Content-Length nor chunks")
        self.local.buf = buf
        if status != 200:
            raise RuntimeError(f"{path}: HTTP {status}: {data[:200]!r}")
        return orjson.loads(data)


_score = operator.itemgetter("Score")


def _nodes_per_pod(setting: str, nodes: int) -> int:
    """How many node names each filter gets: ``all``, ``kube`` (kube-scheduler's default
    percentageOfNodesToScore: it stops looking after this many feasible nodes and sends
    those to the extenders; 420 of 1,000) or a number."""
    if setting == "all":
        return nodes
    if setting == "kube":
        if nodes < 100:
            return nodes
        percentage = max(5, 50 - nodes // 125)
        return max(100, nodes * percentage // 100)
    try:
        n = int(setting)
    except ValueError:
        raise SystemExit(f"--nodes-per-pod={setting!r}: must be all, kube or a number") from None
    if not 1 <= n <= nodes:
        raise SystemExit(f"--nodes-per-pod={n}: must be 1..{nodes} (the cluster's nodes)")
    return n


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def main(argv: list[str] | None = None) -> int:
    from k8s_bridge.extender.service import ExtenderConfig
    from qgpu.model import PlacementPolicy

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--pods", type=int, default=1000)
    ap.add_argument(
        "--policy",
        default=ExtenderConfig().node_policy.value,
        help="the extender's node policy (default: the extender's own, qgpu's default); "
        "several, comma-separated (binpack,frag), are run one after the other, side by side",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the policies this many times, alternating (a summary line per run at the end)",
    )
    ap.add_argument("--bind-workers", type=int, default=16)
    ap.add_argument(
        "--nodes-per-pod",
        default="all",
        help="node names per filter: all (default), kube (kube-scheduler's default "
        "percentageOfNodesToScore sampling: 420 of 1,000, rotating) or a number",
    )
    ap.add_argument(
        "--extender-bind-threads", type=int, default=4, help="the extender's bind threads"
    )
    ap.add_argument(
        "--apiserver-client",
        default="lean",
        choices=["lean", "library"],
        help="the extender's per-bind apiserver calls: over k8s_bridge.lean_http (lean, the "
        "extender's default) or the official client's own urllib3 pool (library)",
    )
    ap.add_argument(
        "--sign",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the extender signs every assignment (the chart's default; --no-sign: unsigned)",
    )
    ap.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="give the extender a CPU of its own, as in a cluster (default: yes)",
    )
    args = ap.parse_args(argv)
    policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    known = [p.value for p in PlacementPolicy]
    for policy in policies:
        if policy not in known:
            raise SystemExit(f"--policy {policy!r}: must be one of {', '.join(known)}")
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    runs = []
    for _ in range(args.rounds):
        for policy in policies:
            runs.append(_run(args, policy))
    if len(runs) > 1:
        print("summary, in the order run:")
        for r in runs:
            print(
                f"  {r['policy']:<8} {r['pods_s']:5.0f} pods/s  extender CPU "
                f"{r['extender_ms']:.2f} ms/pod  prioritize p50 {r['prioritize_p50']:.2f} ms  "
                f"load average {r['load']:.1f}  bind errors {r['errors']}"
            )
    return 0


def _run(args: argparse.Namespace, policy: str) -> dict[str, Any]:
    """One run of the bench with `policy` (fresh apiserver and extender); prints its report
    and returns the summary figures."""
    import httpx

    from tests.k8s.helpers import free_port

    _unpin()  # an earlier run of this invocation pinned the driver to its CPUs
    ctx = mp.get_context("spawn")
    q: Any = ctx.Queue()
    t0 = time.perf_counter()
    api = ctx.Process(target=_apiserver, args=(args.nodes, args.gpus, args.pods, q), daemon=True)
    api.start()
    api_url = q.get(timeout=300)
    port = free_port()
    ext = ctx.Process(
        target=_extender,
        args=(
            api_url,
            policy,
            port,
            args.extender_bind_threads,
            args.apiserver_client,
            q,
            args.sign,
        ),
        daemon=True,
    )
    ext.start()
    n_nodes = q.get(timeout=300)
    if args.pin:
        cpus = _pin(ext.pid, [api.pid, os.getpid()])
    else:
        cpus = "not pinned (--no-pin): the processes share every CPU"
    url = f"http://127.0.0.1:{port}"
    http = httpx.Client(base_url=url, timeout=60, limits=httpx.Limits(max_connections=64))
    deadline = time.monotonic() + 60
    while True:
        try:
            http.get("/healthz")
            break
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    setup_s = time.perf_counter() - t0
    node_names = [f"node-{n:04d}" for n in range(args.nodes)]
    pods = [
        http.get(f"{api_url}/api/v1/namespaces/default/pods/pod-{i:05d}").json()
        for i in range(args.pods)
    ]

    lat: dict[str, list[float]] = {"filter": [], "prioritize": [], "bind": []}
    failures: list[str] = []

    conn = _Conn(port)

    def bind(pod: dict[str, Any], node: str) -> None:
        t = time.perf_counter()
        body = {
            "PodName": pod["metadata"]["name"],
            "PodNamespace": "default",
            "PodUID": pod["metadata"]["uid"],
            "Node": node,
        }
        r = conn.post("/bind", orjson.dumps(body))
        lat["bind"].append(time.perf_counter() - t)
        if r.get("Error"):
            failures.append(r["Error"])

    per_pod = _nodes_per_pod(args.nodes_per_pod, len(node_names))
    names_json = orjson.dumps(node_names)
    next_start = 0

    def candidates_json() -> bytes:
        """The names kube-scheduler hands the extender: all nodes, or (with its default
        sampling) the next `per_pod` feasible nodes from a rotating start."""
        nonlocal next_start
        if per_pod >= len(node_names):
            return names_json
        window = [node_names[(next_start + i) % len(node_names)] for i in range(per_pod)]
        next_start = (next_start + per_pod) % len(node_names)
        return orjson.dumps(window)

    cpu0 = {
        "extender": _cpu_s(ext.pid),
        "apiserver": _cpu_s(api.pid),
        "driver": _cpu_s(os.getpid()),
    }
    start = time.perf_counter()
    unschedulable = 0
    with ThreadPoolExecutor(args.bind_workers) as pool:
        for pod in pods:
            # kube-scheduler (Go) encodes fast; all 1,000 names are encoded once here
            pod_json = orjson.dumps(pod)
            body = b'{"Pod":%s,"Nodes":null,"NodeNames":%s}' % (pod_json, candidates_json())
            t = time.perf_counter()
            fr = conn.post("/filter", body)
            lat["filter"].append(time.perf_counter() - t)
            ok = fr.get("NodeNames") or []
            if not ok:
                unschedulable += 1
                continue
            t = time.perf_counter()
            body = b'{"Pod":%s,"Nodes":null,"NodeNames":%s}' % (pod_json, orjson.dumps(ok))
            pr = conn.post("/prioritize", body)
            lat["prioritize"].append(time.perf_counter() - t)
            best = max(pr, key=_score)["Host"]  # the first of the highest, as kube-scheduler
            pool.submit(bind, pod, best)
    wall = time.perf_counter() - start
    cpu1 = {
        "extender": _cpu_s(ext.pid),
        "apiserver": _cpu_s(api.pid),
        "driver": _cpu_s(os.getpid()),
    }
    cpu = {who: (cpu1[who][0] - cpu0[who][0], cpu1[who][1] - cpu0[who][1]) for who in cpu0}
    http.close()
    ext.terminate()  # the extender first: its lock releaser would find the apiserver gone
    ext.join(timeout=30)
    api.terminate()

    bound = args.pods - unschedulable - len(failures)
    print(
        f"extender throughput: {args.pods} pods, {n_nodes} nodes x {args.gpus} GPUs, "
        f"policy {policy}, nodeCacheCapable, {per_pod} node names per filter, "
        f"{args.bind_workers} binding workers, apiserver client {args.apiserver_client}"
    )
    print(f"  setup (seed apiserver, extender list+watch): {setup_s:.1f} s")
    print(f"  CPUs: {cpus}")
    print(f"  bound {bound}, unschedulable {unschedulable}, bind errors {len(failures)}")
    print(f"  wall {wall:.2f} s -> {args.pods / wall:.0f} pods/s (goal >= 500)")
    print(
        f"  load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs "
        "(other work on the machine inflates wall time)"
    )
    for who, (user, system) in cpu.items():
        secs = user + system
        print(
            f"  CPU {who:<9} {secs:6.2f} s = {secs / args.pods * 1e3:5.2f} ms/pod "
            f"(user {user / args.pods * 1e3:4.2f} + system {system / args.pods * 1e3:4.2f}; "
            f"-> {args.pods / secs if secs > 0 else float('inf'):5.0f} pods/s per core)"
        )
    for verb, values in lat.items():
        print(
            f"  {verb:<10} n={len(values):5d}  p50 {_pct(values, 0.5) * 1e3:6.2f} ms  "
            f"p99 {_pct(values, 0.99) * 1e3:6.2f} ms  mean "
            f"{(statistics.fmean(values) if values else float('nan')) * 1e3:6.2f} ms"
        )
    if failures:
        print(f"  first bind error: {failures[0]}")
    ext_cpu = sum(cpu["extender"])
    return {
        "policy": policy,
        "pods_s": args.pods / wall,
        "extender_ms": ext_cpu / args.pods * 1e3,
        "prioritize_p50": _pct(lat["prioritize"], 0.5) * 1e3,
        "load": os.getloadavg()[0],
        "errors": len(failures),
    }


if __name__ == "__main__":
    sys.exit(main())
