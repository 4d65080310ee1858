"""A ``qgpu-dask-worker`` restarted under its ``--name`` gets back the slice it held.

Real pieces: a `distributed` scheduler, ``qgpu-dask-worker`` processes (nanny and worker),
a ``qgpu agent`` on simulated GPUs whose reconcile runs only every 10 minutes, so the slice
of a killed worker is still held when its successor starts — the case where a second slice
used to be placed beside the orphaned first one.
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator

import pytest
from distributed import Client

from qgpu_dask.agent import LocalAgent, worker_slice_id
from tests.dask import workloads
from tests.dask.conftest import live_slices, local_agent
from tests.dask.test_worker_cli import client, joined, scheduler, start_worker
from tests.helpers import wait_until

__all__ = ["client", "scheduler"]  # fixtures shared with test_worker_cli

pytestmark = pytest.mark.slow


@pytest.fixture
def slow_agent() -> Iterator[LocalAgent]:
    with local_agent(600) as agent:
        yield agent


def _kill(proc: subprocess.Popen[str], client: Client) -> None:
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    wait_until(lambda: not client.scheduler_info()["workers"], timeout=60)


def test_a_restarted_worker_takes_back_its_slice(scheduler, client, slow_agent) -> None:
    agent = slow_agent
    expected_id = worker_slice_id(scheduler.scheduler_address, "w-restart")
    procs: list[subprocess.Popen[str]] = []
    try:
        first = start_worker(scheduler, agent, "--name", "w-restart")
        procs.append(first)
        joined(client, first)
        (held,) = live_slices(agent)
        assert held.slice_id == expected_id
        assert held.owner.meta["pid"] == str(first.pid)

        # a second worker under the same name cannot take the slice of a running one
        twin = start_worker(scheduler, agent, "--name", "w-restart")
        out = twin.communicate(timeout=120)[0]
        assert twin.returncode == 2, out
        assert "invalid --name w-restart: another worker of this name" in out, out
        assert f"process {first.pid}, which is still running" in out, out
        # the same slice, untouched (its live usage figures may move between two reads)
        assert [s.model_dump(exclude={"usage"}) for s in live_slices(agent)] == [
            held.model_dump(exclude={"usage"})
        ]

        # killed and restarted: the same slice on the same GPU, now held by the new process
        _kill(first, client)
        again = start_worker(scheduler, agent, "--name", "w-restart")
        procs.append(again)
        joined(client, again)
        (taken,) = live_slices(agent)
        assert (taken.slice_id, taken.device_uuid) == (held.slice_id, held.device_uuid)
        assert taken.owner.meta["pid"] == str(again.pid)
        inside = client.submit(workloads.where, pure=False).result(timeout=60)
        assert inside["QGPU_SLICE_ID"] == expected_id

        # restarted with another request: its old slice is replaced, under the same id
        _kill(again, client)
        bigger = start_worker(scheduler, agent, "--name", "w-restart", "--core", "50")
        procs.append(bigger)
        joined(client, bigger)
        (replaced,) = live_slices(agent)
        assert (replaced.slice_id, replaced.core, replaced.memory_gib) == (expected_id, 50, 8)

        bigger.send_signal(signal.SIGTERM)
        assert bigger.wait(timeout=60) == 0
        assert live_slices(agent) == []
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
