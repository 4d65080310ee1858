"""Fixtures of the Dask tests: a node agent on simulated GPUs (its own process, reconcile
every second) and polling helpers. Sockets live in short /tmp directories."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("distributed")

from qgpu_dask.agent import LocalAgent


@pytest.fixture(scope="module")
def agent() -> Iterator[LocalAgent]:
    """An agent on two simulated H100s, shared by a module's tests (each leaves it empty)."""
    root = Path(tempfile.mkdtemp(prefix="qgpu-dask-t-", dir="/tmp"))
    a = LocalAgent(root / "agent", gpus="2xH100-80GB", reconcile_interval=0.5)
    yield a
    a.stop()
    shutil.rmtree(root, ignore_errors=True)


def live_slices(agent: LocalAgent) -> list:
    return agent.client.slices().slices
