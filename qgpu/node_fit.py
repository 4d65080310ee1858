"""Which nodes can take a request, and why the others cannot, kept per request shape.

kube-scheduler asks the extender to filter every pod against every node, and pods come in a
few shapes (a Deployment's replicas ask alike). Between two pods of one shape only the nodes
that took or gave back a slice have changed. `NodeFitCache` keeps, per shape, each node's
answer -- None when enough of its GPUs pass every rule, else the first rule that leaves it
short (`Engine.shortfall`) -- and `ClusterState.node_version` tells it which nodes to ask
again. The answers are exactly those of asking every node afresh; only the work differs.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from qgpu.model import SliceRequest

SHAPES_KEPT = 32

Shortfall = Callable[[SliceRequest, np.ndarray], list[str | None]]
ShapeKey = tuple[int, int | None, tuple[str, ...], tuple[str, ...], tuple[str, ...]]


@dataclass
class NodeFit:
    """Per node of the state, in node order (both arrays read-only)."""

    fits: np.ndarray  # bool: enough GPUs pass every rule
    rules: np.ndarray  # object: None where it fits, else the rule that leaves it short


@dataclass
class _Entry:
    fit: NodeFit
    seen: np.ndarray  # node_version of each node when its answer was computed


def shape_key(req: SliceRequest) -> ShapeKey:
    """What the per-GPU rules read of a request (`Engine._checks`, and the GPU count)."""
    return (
        req.core,
        req.memory_gib if req.memory_percent is None else -req.memory_percent,
        req.model_names,
        tuple(req.include_uuids),
        tuple(req.exclude_uuids),
    )


class NodeFitCache:
    """The last `SHAPES_KEPT` shapes' answers for one `ClusterState`."""

    def __init__(self, state: object, shortfall: Shortfall, kept: int = SHAPES_KEPT) -> None:
        self.state = state
        self.shortfall = shortfall
        self.kept = kept
        self._entries: OrderedDict[ShapeKey, _Entry] = OrderedDict()

    def get(self, req: SliceRequest, node_version: np.ndarray) -> NodeFit:
        key = shape_key(req)
        entry = self._entries.pop(key, None)
        if entry is None:
            everyone = np.arange(len(node_version), dtype=np.int64)
            entry = self._compute(req, everyone, node_version)
        else:
            changed = np.flatnonzero(entry.seen != node_version)
            if len(changed):
                entry = self._refresh(req, entry, changed, node_version)
        self._entries[key] = entry
        while len(self._entries) > self.kept:
            self._entries.popitem(last=False)  # the least recently asked shape
        return entry.fit

    def _compute(self, req: SliceRequest, nodes: np.ndarray, version: np.ndarray) -> _Entry:
        rules = np.empty(len(nodes), dtype=object)
        rules[:] = self.shortfall(req, nodes)
        return _Entry(_frozen(np.equal(rules, None).astype(bool), rules), version.copy())

    def _refresh(
        self, req: SliceRequest, entry: _Entry, changed: np.ndarray, version: np.ndarray
    ) -> _Entry:
        # copies: callers may still hold the old answer
        rules, fits, seen = entry.fit.rules.copy(), entry.fit.fits.copy(), entry.seen.copy()
        now = self.shortfall(req, changed)
        rules[changed] = now
        fits[changed] = [rule is None for rule in now]
        seen[changed] = version[changed]
        return _Entry(_frozen(fits, rules), seen)


def _frozen(fits: np.ndarray, rules: np.ndarray) -> NodeFit:
    rules.flags.writeable = False
    fits.flags.writeable = False
    return NodeFit(fits, rules)
