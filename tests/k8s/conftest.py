"""Fixtures for the Kubernetes bridge tests: a fake apiserver and served ASGI apps."""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.fakes.apiserver import FakeApiserver  # noqa: E402
from tests.fakes.certs import TestPKI  # noqa: E402
from tests.k8s.helpers import ServedApp  # noqa: E402


@pytest.fixture
def apiserver() -> Iterator[FakeApiserver]:
    srv = FakeApiserver().start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def serve() -> Iterator[Callable[[Any], str]]:
    started: list[ServedApp] = []

    def run(app: Any) -> str:
        served = ServedApp(app).start()
        started.append(served)
        return served.url

    yield run
    for s in started:
        s.stop()

@pytest.fixture(scope="module")
def pki() -> Iterator[TestPKI]:
    """A test CA that issues server and client certificates (in a short /tmp dir)."""
    d = Path(tempfile.mkdtemp(prefix="qpki", dir="/tmp"))
    try:
        yield TestPKI(d)
    finally:
        shutil.rmtree(d, ignore_errors=True)
