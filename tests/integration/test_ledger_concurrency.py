"""8 processes x 500 reserve/release against one ledger file, with a concurrent auditor.

The ledger re-checks every touched GPU inside the reservation's transaction; this test
checks from outside too: an auditor process samples consistent snapshots while the
workers run, and at the end the ledger holds exactly the slices the workers still hold.
"""

from __future__ import annotations

import multiprocessing as mp
import random

from qgpu.errors import NoFit
from qgpu.ledger import Ledger, OverCommit
from qgpu.model import Allocation, Owner, OwnerKind, SliceRequest
from tests.helpers import make_node

WORKERS = 8
ITERATIONS = 500


def _worker(path: str, seed: int, out: mp.Queue) -> None:
    rng = random.Random(seed)
    ledger = Ledger(path, synchronous="NORMAL")
    owner = Owner(kind=OwnerKind.PID, id=str(seed))
    held: list[str] = []
    reserved = released = nofit = 0
    for _ in range(ITERATIONS):
        if held and (len(held) >= 3 or rng.random() < 0.45):
            sid = held.pop(rng.randrange(len(held)))
            assert ledger.release(sid) is True
            released += 1
            continue
        core = rng.choice([10, 20, 30, 50, 100])
        req = SliceRequest(
            core=core,
            memory=rng.randint(1, 12) if core < 100 else None,
            placement=rng.choice(["binpack", "spread"]),
        )
        try:
            held.append(ledger.reserve(req, owner).slice_id)
            reserved += 1
        except NoFit:
            nofit += 1
    out.put((seed, held, reserved, released, nofit))


def _auditor(path: str, ready, go, stop, out: mp.Queue) -> None:
    """Samples the ledger from `go` (the workers are started) until `stop`; `ready` once it
    has the ledger open, so its start-up never overlaps the workers' run."""
    ledger = Ledger(path, synchronous="NORMAL")
    ledger.usage()
    ready.set()
    go.wait()
    samples = violations = 0
    while not stop.is_set():
        for usage in ledger.usage():
            if (
                usage.core_used > 100
                or usage.memory_used_gib > usage.memory_capacity_gib
                or usage.slices > usage.max_slices
            ):
                violations += 1
        samples += 1
    out.put((samples, violations))


def _racer(path: str, i: int, out: mp.Queue) -> None:
    ledger = Ledger(path, synchronous="NORMAL")
    alloc = Allocation(
        slice_id=f"race-{i}", node="n0", gpu_uuids=["GPU-n0-0"], core=30, memory_gib=1
    )
    try:
        ledger.record(alloc)
        out.put(True)
    except OverCommit:
        out.put(False)


def test_eight_processes_never_overcommit(tmp_path):
    path = str(tmp_path / "ledger.db")
    ledger = Ledger(path)
    ledger.put_node(make_node("n0", gpus=2, gib=32))
    ledger.put_node(make_node("n1", gpus=1, gib=24))
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    audit_q: mp.Queue = ctx.Queue()
    ready, go, stop = ctx.Event(), ctx.Event(), ctx.Event()
    auditor = ctx.Process(target=_auditor, args=(path, ready, go, stop, audit_q))
    auditor.start()
    # a spawned auditor can take longer to start than the workers take to finish: without
    # this wait it sampled nothing in a fresh-clone run
    assert ready.wait(timeout=120)
    procs = [ctx.Process(target=_worker, args=(path, s, results)) for s in range(WORKERS)]
    for p in procs:
        p.start()
    go.set()
    outcomes = [results.get(timeout=240) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    stop.set()
    samples, violations = audit_q.get(timeout=30)
    auditor.join(timeout=30)

    assert violations == 0
    assert samples > 0
    still_held = sorted(sid for _, held, *_ in outcomes for sid in held)
    in_ledger = sorted(a.slice_id for a in ledger.allocations())
    assert in_ledger == still_held, "lost or duplicated slices"
    total_reserved = sum(r for *_, r, _, _ in outcomes)
    total_released = sum(r for *_, _, r, _ in outcomes)
    assert total_reserved - total_released == len(still_held)
    assert total_reserved > ITERATIONS  # real contention happened
    ledger.state().check_invariants()


def test_conflicting_records_admit_exactly_what_fits(tmp_path):
    path = str(tmp_path / "ledger.db")
    Ledger(path).put_node(make_node("n0", gpus=1, gib=32))
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_racer, args=(path, i, q)) for i in range(8)]
    for p in procs:
        p.start()
    wins = [q.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    assert wins.count(True) == 3  # 3 x 30% fit on one GPU, the other 5 are refused
