"""Nodes in identical states, grouped, so that prioritize scores one node per group.

A node-level policy scores a node from that node's own state (its GPUs' free core and
memory, slice counts and limits, health, models and card sizes, its free host CPU and
memory) and the request -- never from its name or its position. Nodes whose states are
equal therefore get equal scores, and a large cluster has few distinct states: the empty
nodes are all alike, and only the nodes that took slices differ. `NodeGroups` keeps, for
one `ClusterState`, a group number per node -- equal numbers exactly when the states are
equal (an exact key, not a hash) -- and brings it up to date for the nodes whose
`ClusterState.node_version` moved since it last looked (a pod's placement changes one).

`ExtenderState.score_nodes` scores one representative per group and gives every node its
group's score: the same scores as scoring every node, for a fraction of the work when the
policy's cost grows with the nodes it looks at (frag's does). The representative of a group
is its first node in the candidate list, so "the first of the highest" -- kube-scheduler's
pick, and the node `ExtenderState.assume` places on -- is a representative too.
"""

from __future__ import annotations

import numpy as np

from qgpu.model import SliceRequest
from qgpu.placement import ClusterState


def groupable(req: SliceRequest) -> bool:
    """Whether nodes in equal states are equal candidates for `req`: not when it names
    GPUs (include/exclude lists single out cards of particular nodes)."""
    return not req.include_uuids and not req.exclude_uuids


class NodeGroups:
    """Per node of one `ClusterState`, the number of its state's group (see the module)."""

    def __init__(self, state: ClusterState) -> None:
        self.state = state
        s = state
        # key -> group, group -> nodes in it, node -> key; a group whose last node left is
        # forgotten and its number used again (the numbers stay below the node count)
        self._index: dict[tuple, int] = {}
        self._members: list[int] = []
        self._free: list[int] = []
        self._keys: list[tuple | None] = [None] * len(s.nodes)
        self.ids = np.zeros(len(s.nodes), dtype=np.int64)
        self._seen = s.node_version.copy()
        self._relabel(np.arange(len(s.nodes)))

    def _key(self, node: int) -> tuple:
        s = self.state
        start = int(s.node_start[node])
        gpus = slice(start, start + int(s.node_gpu_count[node]))
        # every per-GPU vector a policy reads, as it is now: a writer of the vectors that
        # bypasses apply/release (`ClusterState.touch`) is followed too
        rows = np.stack(
            [
                a[gpus]
                for a in (
                    s.free_core,
                    s.free_mem,
                    s.slices,
                    s.max_slices,
                    s.cap_core,
                    s.cap_mem,
                    s.healthy,
                    s.gpu_model,
                    s.numa,
                )
            ],
            axis=1,
        )
        return (
            tuple(sorted(map(tuple, rows.tolist()))),
            int(s.node_free_cpu[node]),
            int(s.node_free_hostmem[node]),
            int(s.node_cap_cpu[node]),
            int(s.node_cap_hostmem[node]),
        )

    def _relabel(self, nodes: np.ndarray) -> None:
        index, members, keys = self._index, self._members, self._keys
        for node in nodes.tolist():
            key = self._key(node)
            old = keys[node]
            if old == key:
                continue
            if old is not None:
                group = index[old]
                members[group] -= 1
                if members[group] == 0:
                    del index[old]
                    self._free.append(group)
            group = index.get(key)
            if group is None:
                if self._free:
                    group = self._free.pop()
                else:
                    group = len(members)
                    members.append(0)
                index[key] = group
            members[group] += 1
            keys[node] = key
            self.ids[node] = group

    def current(self) -> np.ndarray:
        """The group number of every node, up to date with the state (read it, do not
        keep it: it changes in place)."""
        s = self.state
        changed = np.flatnonzero(s.node_version != self._seen)
        if len(changed):
            self._relabel(changed)
            self._seen[changed] = s.node_version[changed]
        return self.ids

    def representatives(self, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(the first node of each group among `nodes` (indices into the state), in the
        order given; for each of `nodes` the position of its group's representative in
        that list)."""
        ids = self.current()[nodes]
        n = len(ids)
        # per group its first position among `nodes`, then the groups present in that order
        first = np.full(len(self._members), n, dtype=np.int64)
        np.minimum.at(first, ids, np.arange(n, dtype=np.int64))
        at = np.sort(first[first < n])
        rank = np.empty(len(self._members), dtype=np.int64)
        rank[ids[at]] = np.arange(len(at), dtype=np.int64)
        return nodes[at], rank[ids]
