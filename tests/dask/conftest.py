"""Fixtures of the Dask tests: a node agent on simulated GPUs (its own process, reconcile
every second) and polling helpers. Sockets live in short /tmp directories."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

pytest.importorskip("distributed")

from qgpu_dask.agent import LocalAgent


@contextmanager
def local_agent(reconcile_interval: float) -> Iterator[LocalAgent]:
    """An agent on two simulated H100s in a fresh short directory, stopped and removed after."""
    root = Path(tempfile.mkdtemp(prefix="qgpu-dask-t-", dir="/tmp"))
    try:
        a = LocalAgent(root / "agent", gpus="2xH100-80GB", reconcile_interval=reconcile_interval)
        try:
            yield a
        finally:
            a.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def agent() -> Iterator[LocalAgent]:
    """An agent shared by a module's tests (each leaves it empty), reconciling twice a second."""
    with local_agent(0.5) as a:
        yield a


def live_slices(agent: LocalAgent) -> list:
    return agent.client.slices().slices
