"""Shared pytest fixtures for the core tests, and unique test ids for parallel runs.

`make test` runs the suite in parallel with pytest-xdist, which schedules tests by node id.
Schemathesis gives every API operation of one test the same node id (the operation is only
in the item's name), and xdist would then run one of them per id and silently drop the
rest; `pytest_collection_modifyitems` gives each such item the id its name says, and
fails the collection if any id is still shared.

gRPC's fork support is switched off for the test processes, before anything loads gRPC:
with it on, a child forked (not vforked) from a process where gRPC's threads run (Ray,
the device plugin's tests) crashes before exec about one time in five, and the tests that
start programs as other users (`subprocess.run(user=...)`, which must fork) then see a
child that never ran. No test forks a child that uses gRPC.
"""

from __future__ import annotations

import os
import sys

assert "grpc" not in sys.modules, "gRPC was loaded before the suite could configure it"
os.environ["GRPC_ENABLE_FORK_SUPPORT"] = "false"

from collections import Counter  # noqa: E402

import pytest  # noqa: E402
from _pytest.nodeid import coerce_node_id  # noqa: E402 - pytest 9 keeps an item's id here

from qgpu.model import NodeInventory  # noqa: E402
from tests.helpers import make_node  # noqa: E402


@pytest.fixture
def two_nodes() -> list[NodeInventory]:
    return [make_node("n0"), make_node("n1")]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    counts = Counter(item.nodeid for item in items)
    for item in items:
        if counts[item.nodeid] > 1 and item.nodeid.rsplit("::", 1)[-1] != item.name:
            item._id = coerce_node_id(f"{item.nodeid.rsplit('::', 1)[0]}::{item.name}")
    duplicates = [nodeid for nodeid, n in Counter(i.nodeid for i in items).items() if n > 1]
    assert not duplicates, f"test ids must be unique for parallel runs: {duplicates}"
