"""Shared pytest fixtures for the core tests, and unique test ids for parallel runs.

`make test` runs the suite in parallel with pytest-xdist, which schedules tests by node id.
Schemathesis gives every API operation of one test the same node id (the operation is only
in the item's name), and xdist would then run one of them per id and silently drop the
rest; `pytest_collection_modifyitems` gives each such item the id its name says, and
fails the collection if any id is still shared.
"""

from __future__ import annotations

from collections import Counter

import pytest
from _pytest.nodeid import coerce_node_id  # pytest 9 keeps an item's id here

from qgpu.model import NodeInventory
from tests.helpers import make_node


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
