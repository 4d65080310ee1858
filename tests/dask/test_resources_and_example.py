"""task_resources validates through the core model; the no-fit message; the runnable example."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from qgpu.errors import RuleViolation
from qgpu_dask import task_resources
from qgpu_dask.nofit import no_fit_message

REPO = Path(__file__).resolve().parents[2]


def test_task_resources_accept_the_model_units():
    assert task_resources("30", "8Gi") == {"qgpu-core": 30.0, "qgpu-memory": 8.0}
    assert task_resources(30, "8192Mi") == {"qgpu-core": 30.0, "qgpu-memory": 8.0}
    assert task_resources(200) == {"qgpu-core": 200.0}


@pytest.mark.parametrize(
    ("core", "memory", "field"),
    [(150, 8, "qgpu-core"), (0, 8, "qgpu-core"), (30, None, "qgpu-memory"), (30, 0, "qgpu-memory")],
)
def test_task_resources_reject_what_the_model_rejects(core, memory, field):
    with pytest.raises(RuleViolation) as err:
        task_resources(core, memory)
    assert err.value.field == field


def test_no_fit_message_names_the_request_and_the_largest_slices():
    offers = [{"qgpu-core": 30.0, "qgpu-memory": 8.0}, {"qgpu-core": 20.0, "qgpu-memory": 40.0}]
    text = no_fit_message("k", {"qgpu-core": 40.0, "qgpu-memory": 10.0}, offers)
    assert "asks for qgpu-core=40, qgpu-memory=10" in text
    assert "largest slice: qgpu-core=30, qgpu-memory=8" in text
    assert "most memory: qgpu-core=20, qgpu-memory=40" in text
    assert "no slice workers are connected" in no_fit_message("k", {"qgpu-core": 1.0}, [])


def test_the_example_runs_on_simulated_gpus():
    proc = subprocess.run(
        [sys.executable, "examples/dask_inference.py", "--placement", "spread"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert out.count("oversized load -> CUDA_ERROR_OUT_OF_MEMORY") == 6
    assert "qgpu-core=20 qgpu-memory=8 fixed-share" in out
    # the large batches (40 %, 16 GiB) fit only the 40 %/24 GiB slices
    for line in out.splitlines():
        if line.strip().startswith(("batch 2:", "batch 3:", "batch 4:", "batch 5:")):
            assert "sees 24.0 GiB" in line and "core cap 40%" in line
    assert "batch 99 refused" in out and "qgpu-core=60, qgpu-memory=40" in out


class _FakeLoop:
    def __init__(self):
        self.later: list = []

    def call_later(self, delay, fn, *args):
        self.later.append((delay, fn, args))


class _FakeScheduler:
    """What NoFitPlugin reads from the scheduler, and what it calls to fail a task."""

    def __init__(self, tasks, workers):
        self.tasks = tasks
        self.workers = workers
        self.unrunnable = {ts: 0.0 for ts in tasks.values() if ts.state == "no-worker"}
        self.loop = _FakeLoop()
        self.erred: list = []

    def transition(self, key, finish, stimulus_id, **kwargs):
        self.erred.append((key, finish, kwargs["exception_text"]))
        return {}

    def transitions(self, recommendations, stimulus_id):
        assert recommendations == {}


class _Task:
    def __init__(self, key, state, restrictions):
        self.key = key
        self.state = state
        self.resource_restrictions = restrictions


def _task(state, restrictions, key="k"):
    return _Task(key, state, restrictions)


def test_declared_slices_count_while_their_worker_is_away():
    import asyncio
    from types import SimpleNamespace

    from qgpu_dask import NoFitPlugin

    wanted = {
        "fits-away": {"qgpu-core": 50},
        "too-big": {"qgpu-core": 60},
        "other": {"GPU": 1},
        "fits-connected": {"qgpu-memory": 30},
    }
    tasks = {key: _task("no-worker", r, key) for key, r in wanted.items()}
    workers = {"w": SimpleNamespace(resources={"qgpu-core": 10, "qgpu-memory": 30})}
    sched = _FakeScheduler(tasks, workers)
    plugin = NoFitPlugin(grace=2.0, slices=[{"qgpu-core": 50, "qgpu-memory": 20}])
    asyncio.run(plugin.start(sched))
    # tasks already waiting when the plugin starts are checked after the grace period
    scheduled = sorted(args[0] for _delay, _fn, args in sched.loop.later)
    assert scheduled == ["fits-away", "fits-connected", "too-big"]
    assert {delay for delay, _fn, _args in sched.loop.later} == {2.0}
    for _delay, fn, args in sched.loop.later:
        fn(*args)
    assert [(k, f) for k, f, _ in sched.erred] == [("too-big", "erred")]
    assert "largest slice: qgpu-core=50, qgpu-memory=20" in sched.erred[0][2]


def test_the_nanny_keeps_inherited_preloads_after_the_interposer(monkeypatch):
    import asyncio

    from qgpu_dask import SliceNanny

    monkeypatch.setenv("LD_PRELOAD", "/opt/libjemalloc.so /hook/libqgpu_hook.so")

    async def build() -> dict[str, str]:
        nanny = SliceNanny(
            "tcp://127.0.0.1:9",
            slice_env={"LD_PRELOAD": "/hook/libqgpu_hook.so", "QGPU_SLICE_ID": "s-1"},
        )
        return dict(nanny.pre_spawn_env)

    env = asyncio.run(build())
    assert env["LD_PRELOAD"] == "/hook/libqgpu_hook.so:/opt/libjemalloc.so"
    assert env["QGPU_SLICE_ID"] == "s-1"
