"""The fragmentation-aware placement policy ``frag`` (DESIGN.md §4).

Owns `FragPolicy`: the request mix it learns from `observe`, the fragmentation measure and
the node/GPU scores derived from it. It registers itself under `PlacementPolicy.FRAG` when
imported (``qgpu.placement`` imports it, so every entry point knows the name).

The idea is FGD's (Weng et al., "Beware of Fragmentation: Scheduling GPU-Sharing Workloads
with Fragmentation Gradient Descent", USENIX ATC'23), implemented here from the paper's
description. Free GPU capacity on a node is *fragmented for a request type* when that type
could not use it: the node lacks host CPU/memory for the type (then all of the node's free
GPU capacity is lost to it), or a GPU has less free core / memory / slice room than the type
needs (that GPU's free core is lost to it; a whole-GPU type can only use fully free GPUs, and
only when the node has as many as it asks for). The *expected* fragmentation of a node is
the average over the request mix seen so far, weighted by how often each type arrived.

A candidate (node, GPU) is scored by how much placing the request there grows the node's
expected fragmentation, i.e. by how much expected *usable* capacity it destroys beyond the
request's own share; the smallest growth wins. A node is scored by its best GPU, so node and
GPU are chosen jointly. Exact ties (common: many empty nodes) go to binpack's choice, the
fuller node and GPU, and before any request has been observed frag behaves like binpack.

Everything is vectorised over GPUs x request classes; a request class is (core per GPU,
memory per GPU, GPU count, model constraint) and a request type adds the host CPU and
memory, which decide whether a node can take the type at all.
"""

from __future__ import annotations

import numpy as np

from qgpu.model import WHOLE_GPU_CORE, PlacementPolicy, SliceRequest
from qgpu.placement import (
    CandidateView,
    ClusterState,
    HostView,
    Policy,
    _host_fill,
    _leftover,
    _node_fill,
    register_policy,
)

# Scores are rounded to this many decimals (of qgpu-core) before the binpack tie-break is
# added, so float noise in the sums cannot outweigh a real preference.
_DECIMALS = 6
_TIE_WEIGHT = 1e-8


class FragPolicy(Policy):
    """Place where the expected fragmented GPU capacity grows least (FGD-style)."""

    name = PlacementPolicy.FRAG.value

    def __init__(self) -> None:
        # request classes: what a GPU must offer
        self._class_index: dict[tuple[int, int, int, tuple[str, ...]], int] = {}
        self._k_core: list[int] = []
        self._k_mem: list[int] = []
        self._k_count: list[int] = []
        self._k_models: list[tuple[str, ...]] = []
        # request types: a class plus the host CPU/memory a node must offer
        self._type_index: dict[tuple[int, int, int], int] = {}
        self._t_class: list[int] = []
        self._t_cpu: list[int] = []
        self._t_hostmem: list[int] = []
        self._t_weight: list[float] = []
        self._arrays_version = -1
        self._version = 0
        self._allowed_for: tuple[int, int] | None = None
        self._allowed: np.ndarray = np.zeros((0, 0), dtype=bool)
        self._last_view: CandidateView | None = None
        self._last_gpu_scores: np.ndarray = np.zeros(0)

    # -- the request mix ------------------------------------------------------------------

    def observe(self, request: SliceRequest) -> None:
        """Count one arrival of the request's type (the mix frag optimises for)."""
        core = request.core_per_gpu
        memory = request.memory_gib or 0
        count = request.gpu_count
        ckey = (core, memory, count, request.model_names)
        k = self._class_index.get(ckey)
        if k is None:
            k = len(self._k_core)
            self._class_index[ckey] = k
            self._k_core.append(core)
            self._k_mem.append(memory)
            self._k_count.append(count)
            self._k_models.append(request.model_names)
        tkey = (k, request.cpu_milli, request.host_memory_mib)
        t = self._type_index.get(tkey)
        if t is None:
            t = len(self._t_class)
            self._type_index[tkey] = t
            self._t_class.append(k)
            self._t_cpu.append(request.cpu_milli)
            self._t_hostmem.append(request.host_memory_mib)
            self._t_weight.append(0.0)
        self._t_weight[t] += 1.0
        self._version += 1

    @property
    def observed(self) -> int:
        """How many requests frag has seen."""
        return int(sum(self._t_weight))

    def _refresh(self, state: ClusterState) -> None:
        if self._arrays_version != self._version:
            self.k_core = np.asarray(self._k_core, dtype=np.int64)
            self.k_mem = np.asarray(self._k_mem, dtype=np.int64)
            self.k_count = np.asarray(self._k_count, dtype=np.int64)
            self.k_whole = self.k_core >= WHOLE_GPU_CORE
            self.t_cpu = np.asarray(self._t_cpu, dtype=np.int64)
            self.t_hostmem = np.asarray(self._t_hostmem, dtype=np.int64)
            weights = np.asarray(self._t_weight, dtype=np.float64)
            p = weights / max(weights.sum(), 1.0)
            # type -> class matrix carrying each type's probability
            self.type_class = np.zeros((len(p), len(self._k_core)), dtype=np.float64)
            self.type_class[np.arange(len(p)), np.asarray(self._t_class, dtype=np.int64)] = p
            self._arrays_version = self._version
        key = (id(state), len(self._k_core))
        if self._allowed_for != key:
            cols = []
            for names, whole, need in zip(
                self._k_models, self.k_whole, self.k_mem, strict=True
            ):
                mask = state.model_mask(names)
                col = np.ones(state.gpu_total, dtype=bool) if mask is None else mask.copy()
                if whole:
                    col &= state.cap_mem >= need
                cols.append(col)
            self._allowed = (
                np.stack(cols, axis=1) if cols else np.zeros((state.gpu_total, 0), dtype=bool)
            )
            self._allowed_for = key

    # -- the measure ----------------------------------------------------------------------

    def _usable(self, state: ClusterState) -> tuple[np.ndarray, np.ndarray]:
        """Per GPU x class: usable core for share classes, 1 for a free whole GPU for whole
        classes; and the same summed per node."""
        s = state
        fc = s.free_core[:, None]
        fits = (
            (fc >= self.k_core[None, :])
            & (s.free_mem[:, None] >= self.k_mem[None, :])
            & (s.slices < s.max_slices)[:, None]
        )
        full = ((s.slices == 0) & (s.free_core == s.cap_core))[:, None]
        per_gpu = np.where(self.k_whole[None, :], full, fits * fc) * self._allowed
        per_gpu = per_gpu.astype(np.float64)
        return per_gpu, _sum_per_node(s, per_gpu)

    def _host_weights(
        self, state: ClusterState, node_ids: np.ndarray, cpu: int, hostmem: int
    ) -> np.ndarray:
        """Per node x class: probability mass of types whose host needs the node meets
        after taking `cpu` / `hostmem` from it."""
        free_cpu = state.node_free_cpu[node_ids] - cpu
        free_mem = state.node_free_hostmem[node_ids] - hostmem
        ok = (free_cpu[:, None] >= self.t_cpu[None, :]) & (
            free_mem[:, None] >= self.t_hostmem[None, :]
        )
        return ok.astype(np.float64) @ self.type_class

    def _score(self, view: CandidateView) -> np.ndarray:
        """Per GPU (length gpu_total): minus the growth of expected fragmentation if the
        request went there; -inf for GPUs that are not candidates."""
        s = view.state
        req = view.request
        node_ids = view.node_ids
        out = np.full(s.gpu_total, -np.inf)
        in_nodes = np.zeros(len(s.nodes), dtype=bool)
        in_nodes[node_ids] = True
        cand = np.flatnonzero(view.gpu_mask & in_nodes[s.gpu_node])
        if len(cand) == 0:
            return out
        if not self._k_core:
            out[cand] = 0.0
            return out
        self._refresh(s)
        per_gpu, node_sums_all = self._usable(s)
        node_usable = _whole_usable(node_sums_all, self.k_whole, self.k_count)
        row = np.full(len(s.nodes), -1, dtype=np.int64)
        row[node_ids] = np.arange(len(node_ids))
        q_before = self._host_weights(s, node_ids, 0, 0)
        q_after = self._host_weights(s, node_ids, req.cpu_milli, req.host_memory_mib)
        before = np.einsum("nk,nk->n", q_before, node_usable[node_ids])

        g_node = s.gpu_node[cand]
        count = req.gpu_count
        core_after = (s.free_core[cand] - view.core)[:, None]
        mem_after = (s.free_mem[cand] - view.memory[cand])[:, None]
        room_after = (s.slices[cand] + 1 < s.max_slices[cand])[:, None]
        allowed = self._allowed[cand]
        fits_after = (
            (core_after >= self.k_core[None, :])
            & (mem_after >= self.k_mem[None, :])
            & room_after
        )
        share_after = np.where(self.k_whole[None, :], 0, fits_after * core_after) * allowed
        lost = per_gpu[cand] - share_after  # for whole classes: 1 if a free GPU is taken
        after_sums = node_sums_all[g_node] - count * lost
        usable_after = _whole_usable(after_sums, self.k_whole, self.k_count)
        after = np.einsum("gk,gk->g", q_after[row[g_node]], usable_after)
        delta = np.round(after - before[row[g_node]], _DECIMALS)
        out[cand] = delta
        return out

    # -- Policy interface -----------------------------------------------------------------

    def node_scores(self, view: CandidateView) -> np.ndarray:
        per_gpu = self._score(view)
        self._last_view = view
        self._last_gpu_scores = per_gpu
        s = view.state
        best = np.full(len(s.nodes), -np.inf)
        finite = np.isfinite(per_gpu)
        np.maximum.at(best, s.gpu_node[finite], per_gpu[finite])
        return best[view.node_ids] + _TIE_WEIGHT * _node_fill(view)

    def gpu_scores(self, view: CandidateView, gpu_ids: np.ndarray) -> np.ndarray:
        per_gpu = self._last_gpu_scores if view is self._last_view else self._score(view)
        # binpack's GPU preference (least left over) breaks ties between equal GPUs
        return per_gpu[gpu_ids] - _TIE_WEIGHT * _leftover(view, gpu_ids)

    def host_scores(self, view: HostView) -> np.ndarray:
        """A host-only workload only changes which types a node can still take."""
        s = view.state
        fill = _TIE_WEIGHT * _host_fill(view)
        if not self._k_core:
            return fill
        self._refresh(s)
        _, node_sums = self._usable(s)
        node_usable = _whole_usable(node_sums, self.k_whole, self.k_count)
        ids = view.node_ids
        q_before = self._host_weights(s, ids, 0, 0)
        q_after = self._host_weights(s, ids, view.cpu_milli, view.host_memory_mib)
        delta = np.einsum("nk,nk->n", q_after - q_before, node_usable[ids])
        return np.round(delta, _DECIMALS) + fill


def _sum_per_node(state: ClusterState, per_gpu: np.ndarray) -> np.ndarray:
    """Sum rows of a (GPU x class) array per node (GPUs are stored grouped by node)."""
    csum = np.zeros((per_gpu.shape[0] + 1, per_gpu.shape[1]), dtype=np.float64)
    np.cumsum(per_gpu, axis=0, out=csum[1:])
    start = state.node_start
    return csum[start + state.node_gpu_count] - csum[start]


def _whole_usable(sums: np.ndarray, whole: np.ndarray, count: np.ndarray) -> np.ndarray:
    """Per node (or candidate) x class: usable core. Share classes: the summed usable core.
    Whole classes: the free whole GPUs' core, but only if there are at least `count`."""
    usable_whole = WHOLE_GPU_CORE * sums * (sums >= count[None, :])
    return np.where(whole[None, :], usable_whole, sums)


register_policy(PlacementPolicy.FRAG, FragPolicy)

__all__ = ["FragPolicy"]
