"""Workload process for the enforcement tests and benchmarks (run as a script).

``worker.py burn --ns N --depth D [--seconds S] [--api kernel|ex|coop|graph]`` keeps the
(simulated) device busy with N-ns kernels, at most D in flight, until its stdin is closed
(or S seconds passed).

``worker.py serve`` reads commands on stdin and answers one line each on stdout:
``init`` -> ``ok <CUresult of cuInit>``; ``ctx``; ``alloc API BYTES`` -> ``ok ID`` or
``err CODE``; ``free ID``; ``sync`` (cuCtxSynchronize); ``meminfo`` -> ``ok FREE TOTAL``;
``totalmem``; ``quit``.
The process survives every driver error (it reports the code), so tests can check that the
host program keeps running.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

from enforcement.simcuda import CUDA_SUCCESS, Allocation, CudaError, Driver
from enforcement.simcuda import burn as run_burn


def burn(args: argparse.Namespace) -> int:
    drv = Driver(resolve=args.resolve)
    drv.init()
    drv.context(drv.device(0))
    end = time.monotonic() + args.seconds
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    print("ready", flush=True)
    run_burn(drv, args.ns, args.depth, lambda: stop.is_set() or time.monotonic() >= end, args.api)
    return 0


def serve(args: argparse.Namespace) -> int:
    drv = Driver(resolve=args.resolve)
    allocs: dict[int, Allocation] = {}
    next_id = 1
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        cmd, rest = words[0], words[1:]
        try:
            if cmd == "init":
                reply = f"ok {drv.try_init()}"
            elif cmd == "ctx":
                drv.context(drv.device(0))
                reply = "ok"
            elif cmd == "alloc":
                code, alloc = drv.try_mem_alloc(int(rest[1]), rest[0])
                if code == CUDA_SUCCESS and alloc is not None:
                    allocs[next_id] = alloc
                    reply = f"ok {next_id}"
                    next_id += 1
                else:
                    reply = f"err {code}"
            elif cmd == "free":
                drv.mem_free(allocs.pop(int(rest[0])))
                reply = "ok"
            elif cmd == "sync":
                drv.ctx_synchronize()
                reply = "ok"
            elif cmd == "meminfo":
                free, total = drv.mem_get_info()
                reply = f"ok {free} {total}"
            elif cmd == "totalmem":
                reply = f"ok {drv.device_total_mem(0)}"
            elif cmd == "quit":
                print("ok", flush=True)
                return 0
            else:
                reply = f"bad {cmd}"
        except CudaError as exc:
            reply = f"err {exc.code}"
        print(reply, flush=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--resolve", choices=("dlsym", "getproc"), default="dlsym")
    sub = p.add_subparsers(dest="mode", required=True)
    b = sub.add_parser("burn")
    b.add_argument("--ns", type=int, default=2_000_000)
    b.add_argument("--depth", type=int, default=4)
    b.add_argument("--seconds", type=float, default=120.0)
    b.add_argument("--api", default="kernel")
    sub.add_parser("serve")
    args = p.parse_args()
    return burn(args) if args.mode == "burn" else serve(args)


if __name__ == "__main__":
    sys.exit(main())
