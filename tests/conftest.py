"""Shared pytest fixtures for the core tests."""

from __future__ import annotations

import pytest

from qgpu.model import NodeInventory
from tests.helpers import make_node


@pytest.fixture
def two_nodes() -> list[NodeInventory]:
    return [make_node("n0"), make_node("n1")]
