"""Ledger: atomic reserve/release, idempotency, owners, restart survival, invariants."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, rule

from qgpu.errors import NoFit, RuleViolation
from qgpu.ledger import Ledger, OverCommit, UnknownNode
from qgpu.model import Allocation, Owner, OwnerKind, SliceRequest
from tests.helpers import make_node


@pytest.fixture
def ledger(tmp_path, two_nodes):
    led = Ledger(tmp_path / "ledger.db")
    for node in two_nodes:
        led.put_node(node)
    return led


def test_reserve_records_owner_and_limits(ledger):
    owner = Owner(kind=OwnerKind.PID, id="1234", meta={"cmd": "python"})
    alloc = ledger.reserve(SliceRequest(core=30, memory=8, isolation="fs"), owner, node="n1")
    assert alloc.node == "n1" and alloc.core == 30 and alloc.memory_gib == 8
    assert alloc.isolation == "fixed-share"
    got = ledger.get(alloc.slice_id)
    assert got == alloc
    assert got.owner.meta == {"cmd": "python"}


def test_node_default_isolation_applies(tmp_path):
    led = Ledger(tmp_path / "l.db")
    led.put_node(make_node("x", gpus=1, default_isolation="bs"))
    assert led.reserve(SliceRequest(core=10, memory=4)).isolation == "burst-share"


def test_release_is_idempotent(ledger):
    alloc = ledger.reserve(SliceRequest(core=30, memory=8))
    assert ledger.release(alloc.slice_id) is True
    assert ledger.release(alloc.slice_id) is False
    assert ledger.get(alloc.slice_id) is None


def test_repeated_slice_id_returns_existing(ledger):
    owner = Owner(kind=OwnerKind.POD, id="uid-1")
    a = ledger.reserve(SliceRequest(core=30, memory=8), owner, slice_id="s-1")
    b = ledger.reserve(SliceRequest(core=30, memory=8), owner, slice_id="s-1")
    assert a == b
    assert len(ledger.allocations()) == 1
    with pytest.raises(RuleViolation) as info:
        ledger.reserve(
            SliceRequest(core=30, memory=8), Owner(kind="pod", id="uid-2"), slice_id="s-1"
        )
    assert info.value.field == "slice_id"


def test_no_fit_leaves_no_trace(ledger):
    for _ in range(8):
        ledger.reserve(SliceRequest(core=100))
    with pytest.raises(NoFit):
        ledger.reserve(SliceRequest(core=10, memory=1))
    assert len(ledger.allocations()) == 8


def test_memory_above_every_card_is_a_rule_violation(ledger):
    with pytest.raises(RuleViolation) as info:
        ledger.reserve(SliceRequest(core=10, memory=81))
    assert info.value.field == "qgpu-memory"


def test_record_checks_capacity_in_transaction(ledger):
    def alloc(i, core):
        return Allocation(
            slice_id=f"r{i}", node="n0", gpu_uuids=["GPU-n0-0"], core=core, memory_gib=4
        )

    ledger.record(alloc(1, 60))
    with pytest.raises(OverCommit):
        ledger.record(alloc(2, 50))
    assert ledger.get("r2") is None
    ledger.record(alloc(3, 40))
    assert next(u.core_used for u in ledger.usage("n0")) == 100


def test_record_rejects_foreign_gpu(ledger):
    bad = Allocation(slice_id="r", node="n0", gpu_uuids=["GPU-n1-0"], core=10, memory_gib=1)
    with pytest.raises(RuleViolation) as info:
        ledger.record(bad)
    assert info.value.field == "gpu_uuids"


def test_unknown_node(ledger):
    with pytest.raises(UnknownNode):
        ledger.reserve(SliceRequest(core=10, memory=1), node="nope")


def test_release_owner_and_remove_node(ledger):
    pod = Owner(kind=OwnerKind.POD, id="uid-9")
    a = ledger.reserve(SliceRequest(core=10, memory=1), pod, node="n0")
    b = ledger.reserve(SliceRequest(core=10, memory=1), pod, node="n1")
    assert sorted(ledger.release_owner("pod", "uid-9")) == sorted([a.slice_id, b.slice_id])
    c = ledger.reserve(SliceRequest(core=10, memory=1), node="n1")
    assert ledger.remove_node("n1") == [c.slice_id]
    assert [n.name for n in ledger.nodes()] == ["n0"]
    assert ledger.allocations() == []


def test_whole_gpu_rows_per_gpu(ledger):
    a = ledger.reserve(SliceRequest(core=200))
    assert len(a.gpu_uuids) == 2 and a.memory_gib == 80
    used = {u.uuid: u for u in ledger.usage()}
    assert all(used[g].core_used == 100 and used[g].memory_used_gib == 80 for g in a.gpu_uuids)


def test_survives_kill_9_of_the_writer(tmp_path, two_nodes):
    path = tmp_path / "ledger.db"
    led = Ledger(path)
    for node in two_nodes:
        led.put_node(node)
    script = textwrap.dedent(
        f"""
        import os, sys, time
        from qgpu.ledger import Ledger
        from qgpu.model import SliceRequest, Owner
        led = Ledger({str(path)!r})
        for i in range(5):
            led.reserve(SliceRequest(core=10, memory=2), Owner(kind="pid", id=str(os.getpid())),
                        slice_id=f"k{{i}}")
        print("ready", flush=True)
        time.sleep(60)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    again = Ledger(path)
    assert sorted(a.slice_id for a in again.allocations()) == [f"k{i}" for i in range(5)]
    again.state().check_invariants()


class LedgerMachine(RuleBasedStateMachine):
    """Random reserve/release sequences never over-commit; free = capacity - live."""

    held = Bundle("held")

    def __init__(self) -> None:
        super().__init__()
        import tempfile

        self.dir = tempfile.mkdtemp(prefix="qgpu-ledger-")
        self.ledger = Ledger(os.path.join(self.dir, "l.db"), synchronous="NORMAL")
        self.ledger.put_node(make_node("a", gpus=2, gib=16))
        self.ledger.put_node(make_node("b", gpus=1, gib=24, max_slices_per_gpu=3))
        self.live: dict[str, tuple[int, tuple[str, ...], int]] = {}

    def teardown(self) -> None:
        self.ledger.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    @rule(
        target=held,
        core=st.one_of(st.integers(1, 99), st.sampled_from([100, 200])),
        mem=st.integers(1, 24),
        policy=st.sampled_from(["binpack", "spread"]),
    )
    def reserve(self, core, mem, policy):
        req = SliceRequest(core=core, memory=mem if core < 100 else None)
        try:
            alloc = self.ledger.reserve(req, policy=policy)
        except (NoFit, RuleViolation):
            return None
        self.live[alloc.slice_id] = (alloc.core, tuple(alloc.gpu_uuids), alloc.memory_gib)
        return alloc.slice_id

    @rule(slice_id=held)
    def release(self, slice_id):
        if slice_id is None:
            return
        expected = slice_id in self.live
        assert self.ledger.release(slice_id) is expected
        self.live.pop(slice_id, None)

    @rule()
    def release_unknown(self):
        assert self.ledger.release("s-never-existed") is False

    @invariant()
    def never_overcommitted_and_vectors_exact(self):
        state = self.ledger.state()
        state.check_invariants()
        assert set(state.held) == set(self.live)
        for usage in self.ledger.usage():
            assert usage.core_used <= 100
            assert usage.memory_used_gib <= usage.memory_capacity_gib
            assert usage.slices <= usage.max_slices
        cap = {g.uuid: g.memory_gib for n in self.ledger.nodes() for g in n.gpus}
        for uuid, i in state.uuid_index.items():
            core = sum(c for c, gpus, _ in self.live.values() if uuid in gpus)
            mem = sum(
                (cap[uuid] if c >= 100 else m) for c, gpus, m in self.live.values() if uuid in gpus
            )
            assert state.free_core[i] == 100 - core
            assert state.free_mem[i] == cap[uuid] - mem


TestLedgerMachine = LedgerMachine.TestCase
TestLedgerMachine.settings = settings(
    max_examples=40,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
