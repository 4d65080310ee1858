"""Nodes in identical states, grouped: one exact group per distinct node state.

Owns `NodeGroups`. A policy scores a node from that node's own state (its GPUs' free core
and memory, slice counts and limits, health, models and card sizes, its free host CPU and
memory, its free and total GPU core and memory) and the request -- never from its name or
its position -- so nodes whose states are equal get equal scores, and a large cluster has
few distinct states: the empty nodes are all alike, and only the nodes that took slices
differ. `NodeGroups` keeps, for one `ClusterState`, a group number (a *slot*) per node --
equal numbers exactly when the states are equal (an exact key, not a hash) -- and brings it
up to date for the nodes whose `ClusterState.node_version` moved since it last looked (a
pod's placement changes one).

For what is remembered per group across calls (frag's score cache), each slot carries a
generation number (`gen`): a slot handed to another state gets a new one, so (slot, gen)
names one node state for the life of the object. A group whose last node left is kept for
a while (a node often returns to a state it had: a slice placed and released), so that its
slot and generation, and what was remembered for them, are found again.

Per GPU, `rank` is the index of its state among its node's distinct GPU states (sorted):
(slot, gen, rank) names one (node state, GPU state) pair exactly.

`ClusterState.node_groups()` makes one for a state on first use, shared by whoever scores
over that state (frag's score cache, `qgpu.frag`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from qgpu.model import SliceRequest
    from qgpu.placement import ClusterState

# every per-GPU vector a policy or the engine's candidate rules read
_GPU_FIELDS = (
    "free_core",
    "free_mem",
    "slices",
    "max_slices",
    "cap_core",
    "cap_mem",
    "healthy",
    "gpu_model",
    "numa",
)
# and every per-node vector (the aggregates too: a direct writer may leave them unlike
# the sums of the GPU vectors)
_NODE_FIELDS = (
    "node_free_cpu",
    "node_free_hostmem",
    "node_cap_cpu",
    "node_cap_hostmem",
    "node_free_core",
    "node_cap_core",
    "node_free_mem",
    "node_cap_mem",
)
_KEEP_IDLE = 64  # idle groups kept beyond one per node before they are forgotten


def groupable(req: SliceRequest) -> bool:
    """Whether nodes in equal states are equal candidates for `req`: not when it names
    GPUs (include/exclude lists single out cards of particular nodes)."""
    return not req.include_uuids and not req.exclude_uuids


class NodeGroups:
    """Per node of one `ClusterState`, the slot of its state's group (see the module)."""

    def __init__(self, state: ClusterState) -> None:
        self.state = state
        n = len(state.nodes)
        # key -> slot; per slot its key, live nodes and generation; slots free for reuse
        self._index: dict[tuple, int] = {}
        self._slot_key: list[tuple | None] = []
        self._members: list[int] = []
        self._free: list[int] = []
        self._idle = 0  # slots whose group has no node now (kept, see the module)
        self._keys: list[tuple | None] = [None] * n
        self._next_gen = 0
        self.ids = np.zeros(n, dtype=np.int64)
        self.gen = np.zeros(16, dtype=np.int64)
        self.rank = np.zeros(state.gpu_total, dtype=np.int64)
        self._seen = state.node_version.copy()
        self._seen_version = state.version
        if n:
            self._relabel(np.arange(n, dtype=np.int64))

    @property
    def slots(self) -> int:
        """How many slot numbers are in use (live or idle): every slot is below this."""
        return len(self._members)

    def _relabel(self, nodes: np.ndarray) -> None:
        """Key `nodes` again and move each to its key's group; ranks of their GPUs too."""
        keys = [self._key_of_one(int(nodes[0]))] if len(nodes) == 1 else self._keys_of(nodes)
        index, members, known = self._index, self._members, self._keys
        for node, key in zip(nodes.tolist(), keys, strict=True):
            old = known[node]
            if old == key:
                continue
            if old is not None:
                slot = index[old]
                members[slot] -= 1
                if members[slot] == 0:
                    self._idle += 1
            slot = index.get(key, -1)
            if slot < 0:
                slot = self._new_slot(key)
            elif members[slot] == 0:
                self._idle -= 1
            members[slot] += 1
            known[node] = key
            self.ids[node] = slot
        if self._idle > len(known) + _KEEP_IDLE:
            self._forget_idle()

    def _host(self, nodes: np.ndarray | slice) -> list:
        s = self.state
        vectors = [getattr(s, name) for name in _NODE_FIELDS]
        return np.stack([v[nodes] for v in vectors], axis=-1).tolist()

    def _keys_of(self, nodes: np.ndarray) -> list[tuple]:
        """The exact keys of `nodes` (each node's GPU rows sorted, as bytes, and its node
        vectors), and their GPUs' ranks written to `rank`."""
        s = self.state
        gpus, offsets = s.gpus_of(nodes)
        counts = s.node_gpu_count[nodes]
        columns = [getattr(s, name)[gpus].astype(np.int64) for name in _GPU_FIELDS]
        owner = np.repeat(np.arange(len(nodes), dtype=np.int64), counts)
        # node after node (`owner`, the primary key), each node's GPU rows sorted
        order = np.lexsort((*reversed(columns), owner))
        rows = np.stack(columns, axis=1)[order]
        if len(rows):
            new = np.ones(len(rows), dtype=bool)
            new[1:] = (rows[1:] != rows[:-1]).any(axis=1)
            new[offsets[counts > 0]] = True  # each node's first row starts its ranks
            distinct = np.cumsum(new) - 1
            starts = distinct[np.minimum(offsets, len(rows) - 1)]  # (a node without GPUs
            self.rank[gpus[order]] = distinct - starts[owner]  # owns no row)
        raw = rows.tobytes()
        width = rows.shape[1] * rows.itemsize
        return [
            (raw[start * width : (start + count) * width], *host)
            for start, count, host in zip(
                offsets.tolist(), counts.tolist(), self._host(nodes), strict=True
            )
        ]

    def _key_of_one(self, node: int) -> tuple:
        """`_keys_of` for one node (what a placement changes), in Python over its few GPUs:
        the same key (rows sorted as tuples sort, the same bytes) and ranks."""
        s = self.state
        start = int(s.node_start[node])
        end = start + int(s.node_gpu_count[node])
        columns = [getattr(s, name)[start:end].tolist() for name in _GPU_FIELDS]
        rows = list(zip(*columns, strict=True))
        order = sorted(range(len(rows)), key=rows.__getitem__)
        ranks = [0] * len(rows)
        rank, last = -1, None
        for i in order:
            if rows[i] != last:
                rank, last = rank + 1, rows[i]
            ranks[i] = rank
        self.rank[start:end] = ranks
        raw = np.array([rows[i] for i in order], dtype=np.int64).reshape(-1).tobytes()
        return (raw, *(int(getattr(s, name)[node]) for name in _NODE_FIELDS))

    def _new_slot(self, key: tuple) -> int:
        if self._free:
            slot = self._free.pop()
            self._slot_key[slot] = key
        else:
            slot = len(self._members)
            self._members.append(0)
            self._slot_key.append(key)
            if slot >= len(self.gen):
                self.gen = np.concatenate([self.gen, np.zeros(len(self.gen), dtype=np.int64)])
        self._next_gen += 1
        self.gen[slot] = self._next_gen
        self._index[key] = slot
        return slot

    def _forget_idle(self) -> None:
        for slot, (key, count) in enumerate(zip(self._slot_key, self._members, strict=True)):
            if key is not None and count == 0:
                del self._index[key]
                self._slot_key[slot] = None
                self._free.append(slot)
        self._idle = 0

    def current(self) -> np.ndarray:
        """The slot of every node, up to date with the state (read it, do not keep it: it
        changes in place; `gen` and `rank` are brought up to date with it)."""
        s = self.state
        if s.version == self._seen_version:
            return self.ids
        changed = np.flatnonzero(s.node_version != self._seen)
        if len(changed):
            self._relabel(changed)
            self._seen[changed] = s.node_version[changed]
        self._seen_version = s.version
        return self.ids
