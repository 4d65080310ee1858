"""The fragmentation-aware placement policy ``frag`` (DESIGN.md §4).

Owns `FragPolicy`: the request mix it learns from `observe`, the fragmentation measure and
the node/GPU scores derived from it. It registers itself under `PlacementPolicy.FRAG` when
imported (``qgpu.placement`` imports it, so every entry point knows the name).

The idea is FGD's (Weng et al., "Beware of Fragmentation: Scheduling GPU-Sharing Workloads
with Fragmentation Gradient Descent", USENIX ATC'23), implemented here from the paper's
description. Free GPU capacity on a node is *fragmented for a request type* when that type
cannot use it; the *expected* fragmentation of a node averages this over the request mix
seen so far (`observe`), weighted by how often each type arrived. A candidate (node, GPU)
is scored by how much placing the request there grows the node's expected fragmentation --
equivalently, how much expected *usable* capacity it destroys beyond the request's own
share -- and the smallest growth wins. A node is scored by its best GPU, so node and GPU are
chosen jointly. Exact ties (common: many empty nodes) go to binpack's choice, the fuller node
and GPU.

Two measures of "usable by a type" (``measure=``):

- ``"fgd"``, the paper's: all free core of a GPU is usable by a share type once one request of
  the type fits there (free core, memory, slice room); a whole-GPU type can use the node's
  free whole GPUs if there are at least as many as it asks for; a node without the host CPU /
  memory for one request of the type gives it nothing.
- ``"fill"`` (the default, measured better on the Alibaba trace, see docs/placement.md):
  usable is what copies of the type could actually fill: per GPU ``k`` copies, where ``k``
  is limited by free core, free memory and slice room; per node at most as many copies as its
  free host CPU and memory can feed. A GPU with 19% free core is then worth 16 to a 16%
  type, not 19, and a node with GPUs free but CPU for one more pod is worth one pod. Where
  the node's host feeds the mix as a whole on all its free GPU core (at the host term's
  average rates, below), the host bounds no type's copies in GPU placements: each type is
  judged as if it alone filled the node, and there the rest of the mix would use the CPU a
  CPU-heavy type cannot (`_feeds_mix`).

The node score adds a **host term** (``host_weight``, fill measure only): the GPU core a
placement strands behind the node's host CPU and memory, judged with the mix's *average*
host CPU and memory per qgpu-core. A node's aggregate usable core is
``min(free core, free CPU / cpu per core, free memory / memory per core)``; a placement that
lowers it by more than its own core strands the difference, and that counts ``host_weight``
times as much as expected fragmentation. The per-type measure alone misses this: each type
is judged as if it alone filled the node, so a CPU-heavy pod on a CPU-poor node looks
harmless to the CPU-light types that could still use the GPUs, yet the mix as a whole can
no longer fill them (on the Alibaba trace: 60 of ~285 idle GPUs were behind exhausted host
CPU at the end, 8 with the host term).

**Gap values** (``gap_weight``, fill measure only) add, for the GPU a share goes to, the
change of the value ``V(free core)`` of its gap: the share sizes of the mix are priced by the
linear program of packing the mix into GPUs (`qgpu.gap_prices`), and ``V(x)`` is the best
sum of the sizes' values that fits into ``x``. The per-type copies value each type alone;
``V`` sees which gaps the mix as a whole closes well: beside a 65% share a 35% gap is
worth all of a 32% share, beside a 47% one a 53% gap is worth only what another 47% fills,
and a lone 81% leaves 19% that almost nothing closes -- so a 32% share goes to the 65, and
GPUs fill with the combinations that waste least when the cluster runs full.

Request types weigh by how often they arrived (``weight="count"``, the paper's popularity);
``"demand"`` (arrivals x qgpu-core) and ``"gpus"`` (arrivals x GPU count) are there for
experiments and measured worse with the fill measure (docs/placement.md).

Vectorised over GPUs x request types; the engine's per-node and per-GPU vectors are read
directly, usable counts per GPU are kept incrementally, and candidates in identical
situations (same node state, same GPU state) are scored once.

A policy that has observed nothing (an engine made for one decision, as the Ray SDK does, or
the node agent's ledger's, kept with its state) takes the slices already placed in the
cluster as the mix, and keeps following them (placed and released ones) while it observes
nothing; in an empty cluster it then chooses exactly like binpack.

Before the mix is known (fill measure only): frag counts a prior (`qgpu.mix_prior`) as
arrivals, and while the cluster's GPU core is less than half allocated a share never opens
an empty GPU that a used one could spare, and a share or whole-GPU request that needs empty
GPUs takes them on the node with the fewest (``keep_empty``) -- until 400 requests have been
seen (``keep_empty_until``), when the mix's proportions are known to within the repricing
drift and frag's own scores decide. The rule is insurance for whole-GPU requests, and it is
not taken where it cannot pay out: while the cluster has more empty nodes of its largest
size than requests can still arrive before the lapse (`_spare_whole_nodes`), every request
until then finds a whole empty node whatever the shares do.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import Literal

import numpy as np

from qgpu.gap_prices import NO_PRICES, GapPrices, price_gaps, warm_up
from qgpu.mix_prior import PriorSetting, configured_prior, resolve_prior
from qgpu.model import WHOLE_GPU_CORE, PlacementPolicy, SliceRequest
from qgpu.node_groups import groupable
from qgpu.placement import (
    CandidateView,
    ClusterState,
    HostView,
    Policy,
    _fill_of,
    _Held,
    _host_fill,
    _leftover,
    _node_fill,
    register_policy,
)

Measure = Literal["fill", "fgd"]
Weight = Literal["demand", "count", "gpus"]

# Scores are sums of integers (weights are integer counts or qgpu-core demands, usable
# capacity is whole copies x qgpu-core), so they are exact in float64 and two candidates tie
# only when they really are equal; the binpack tie-break is scaled below 1 so it can only
# decide between exact ties.
_TIE_WEIGHT = 0.2
_MANY = float(1 << 40)  # copies a node can feed when a type needs no host CPU/memory
_MIX = np.uint64(0x9E3779B97F4A7C15)
_ALL = slice(None)
_log = logging.getLogger(__name__)
_FEW_GPUS = 64  # below this many GPUs, grouping equal states costs more than it saves
# the score cache (`FragPolicy._cached_scores`): on by default; tests and benches compare
# against a policy without it (same scores, bit for bit)
CACHE_SCORES = True
_CACHED_NODES = 256  # at most this many distinct node states scored through the cache ...
_CACHE_BACKOFF = 64  # ... else the next this many calls go the vectorised way directly
_CACHE_ROWS = 1 << 14  # loss rows a cache keeps before it starts over
_CACHE_TABLES = 1 << 22  # entries of its (shape, host mode) tables likewise (16 MiB)
# how much more a qgpu-core stranded behind host CPU / memory counts than a qgpu-core of
# expected fragmentation (measured on the Alibaba trace: 4 to 100 all gain, 8-16 most)
HOST_WEIGHT = 16.0
# how much a qgpu-core of gap value (`qgpu.gap_prices`) counts, fill measure only (measured
# on the Alibaba traces: 6 gains most of it, 30 and more all of it; see docs/placement.md)
GAP_WEIGHT = 30.0
# the mix is priced again when its proportions (by share size and whole-GPU count) have
# moved this far (L1) since they were last priced -- or, while fewer than 1 / drift**2 (400)
# requests have arrived, by more than 1 / sqrt(arrivals), the proportions' own sampling
# noise -- or a new size arrives
REPRICE_DRIFT = 0.05
# below this fill of the cluster's GPU core, a share never opens an empty GPU while a used
# GPU can take it (fill measure only; see `FragPolicy.keep_empty`) ...
KEEP_EMPTY_BELOW = 0.5
# ... until this many requests have been seen: then the mix's proportions are known to within
# `REPRICE_DRIFT` (their sampling noise 1 / sqrt(arrivals)), the precision at which frag
# already treats the mix as known, and frag's own scores decide (docs/placement.md)
KEEP_EMPTY_EVIDENCE = round(1 / REPRICE_DRIFT**2)


class FragPolicy(Policy):
    """Place where the expected fragmented GPU capacity grows least (FGD-style)."""

    name = PlacementPolicy.FRAG.value

    def __init__(
        self,
        measure: Measure = "fill",
        weight: Weight = "count",
        host_weight: float | None = None,
        gap_weight: float | None = None,
        prior: PriorSetting | Literal["configured"] = "configured",
        keep_empty: float | None = None,
        keep_empty_until: int | None = None,
        cache: bool | None = None,
    ) -> None:
        if measure not in ("fill", "fgd") or weight not in ("demand", "count", "gpus"):
            raise ValueError(f"unknown frag settings measure={measure!r} weight={weight!r}")
        for name, value in (("host_weight", host_weight), ("gap_weight", gap_weight)):
            if value is not None and not value >= 0:
                raise ValueError(f"{name} must be >= 0, got {value!r}")
        if keep_empty is not None and not 0 <= keep_empty <= 1:
            raise ValueError(f"keep_empty must be a fill between 0 and 1, got {keep_empty!r}")
        if keep_empty_until is not None and not (
            isinstance(keep_empty_until, int) and keep_empty_until >= 0
        ):
            raise ValueError(
                f"keep_empty_until must be a whole number of requests >= 0 (0: never lapses), "
                f"got {keep_empty_until!r}"
            )
        self.measure: Measure = measure
        self.weight: Weight = weight
        # the host term is part of frag's own measure; "fgd" stays the paper's
        if host_weight is None:
            host_weight = HOST_WEIGHT if measure == "fill" else 0.0
        self.host_weight = float(host_weight)
        if gap_weight is None:
            gap_weight = GAP_WEIGHT if measure == "fill" else 0.0
        self.gap_weight = float(gap_weight)
        # while the cluster's GPU core is filled less than this, a share goes into a used
        # GPU whenever one can take it, and opens an empty GPU only when none can: the early
        # decisions keep whole GPUs free like binpack's, whatever the mix seen so far says
        if keep_empty is None:
            keep_empty = KEEP_EMPTY_BELOW if measure == "fill" else 0.0
        self.keep_empty = float(keep_empty)
        # ... until this many requests have been seen (observed arrivals, or the live slices
        # an engine made for one decision starts from; the prior does not count): by then
        # the mix is known and whole-GPU requests, if they come, are part of it; 0 = never
        if keep_empty_until is None:
            keep_empty_until = KEEP_EMPTY_EVIDENCE
        self.keep_empty_until = keep_empty_until
        # the request-mix prior (`qgpu.mix_prior`): counted as arrivals before the first
        # decision; "configured" is QGPU_MIX_PRIOR (the paper's measure has none)
        if prior == "configured":
            prior = configured_prior() if measure == "fill" else None
        self.prior: PriorSetting = prior
        # score through the cache of loss rows (`_cached_scores`); None: `CACHE_SCORES`
        self.cache = CACHE_SCORES if cache is None else bool(cache)
        self._score_cache: _ScoreCache | None = None
        self._gate: tuple[ClusterState | None, int, int] = (None, 0, 0)
        self._last_shift: tuple[float | None] | None = None  # the last view's, when cached
        # the last `_cached_scores`: (state, (its version, the mix's, request shape), scores
        # by (group slot, GPU rank))
        self._base_memo: tuple[ClusterState | None, tuple, dict] = (None, (), {})
        self._started = False
        self._observed = 0  # real arrivals counted (not the prior)
        # while nothing is observed, the live slices counted in the mix (`_follow_live`):
        # slice id -> the state's record of it, the state and its version when counted
        self._live: dict[str, _Held] | None = None
        self._live_state: ClusterState | None = None
        self._live_version = -1
        self._live_counted = 0  # live GPU slices counted in the mix (`_count_live`)
        # the priced mix (gap values), and the mix and slice limit it was priced for
        self.prices: GapPrices | None = None
        self._priced_mix: dict[int, float] = {}
        self._priced_slots = 0
        self._size_mix: tuple[int, dict[int, float], float] = (-1, {}, 0.0)
        self._slots_for: tuple[ClusterState | None, int] = (None, 0)
        self._pricing_failed = False
        # request classes: what a GPU must offer (core and memory per GPU, count, models)
        self._class_index: dict[tuple[int, int, int, tuple[str, ...]], int] = {}
        self._k_core: list[int] = []
        self._k_mem: list[int] = []
        self._k_count: list[int] = []
        self._k_models: list[tuple[str, ...]] = []
        # request types: a class plus the host CPU / memory a node must offer
        self._type_index: dict[tuple[int, int, int], int] = {}
        self._t_class: list[int] = []
        self._t_cpu: list[int] = []
        self._t_hostmem: list[int] = []
        self._t_weight: list[int] = []
        self._arrays_version = -1
        self._arrays_shape = (-1, -1)  # (classes, types) the type arrays were built for
        self._version = 0
        self._allowed_for: tuple[ClusterState, int] | None = None
        self._allowed = np.zeros((0, 0), dtype=bool)
        self._cache_key: tuple[ClusterState, int] | None = None
        self._seen = np.zeros(0, dtype=np.int64)  # node_version the per-GPU copies reflect
        self._per_gpu = np.zeros((0, 0))
        self._per_node = np.zeros((0, 0))
        self._gpu_cols = self._node_cols = _Columns(np.zeros((0, 0)))
        self._last_view: CandidateView | None = None
        # the state version the incremental per-GPU copies were last brought up to date at
        self._snap_version = -1
        # the last `_score`: (state, what it depends on, per-GPU scores); see `_score`
        self._score_memo: tuple[ClusterState, tuple, np.ndarray] | None = None
        self._last_gpu_scores = np.zeros(0)
        self._keys: _StateKeys | None = None
        # per node the host CPU and memory its GPUs' copies need (`_host_need`)
        self._need_key: tuple[ClusterState, tuple[int, int]] | None = None
        self._need_seen = np.zeros(0, dtype=np.int64)
        self._need = np.zeros((0, 2))

    # -- the request mix ------------------------------------------------------------------

    def observe(self, request: SliceRequest) -> None:
        """Count one arrival of the request's type (the mix frag optimises for)."""
        self._observed += 1
        self._live = None  # the mix now learns from arrivals; the live slices stay counted
        self._count_request(request)

    def _count_request(self, request: SliceRequest, arrivals: int = 1) -> None:
        self._count(
            request.core_per_gpu,
            request.memory_gib_per_gpu or 0,
            request.gpu_count,
            request.model_names,
            request.cpu_milli,
            request.host_memory_mib,
            arrivals,
        )

    def _start(self, state: ClusterState) -> None:
        """Before the first decision: count the prior's shapes, and with nothing observed
        the live slices (see `_seed_from_live`); before every later one, while nothing is
        observed, follow the live slices (`_follow_live`)."""
        if self._started:
            self._follow_live(state)
            return
        self._started = True
        prior = resolve_prior(self.prior, state.nodes)
        if prior is not None:
            for shape, arrivals in prior.counts():
                self._count_request(shape.request(), arrivals)
        if self._observed == 0:
            self._seed_from_live(state)

    def _seed_from_live(self, state: ClusterState) -> None:
        """With nothing observed, take the live slices as the mix seen so far (beside the
        prior).

        Engines that never call `observe` (the ledger's `reserve`, the Ray SDK) decide from
        the slices already placed: they are then the best record of the requests this
        cluster gets. Model constraints are not recorded in the state, so the seeded types
        allow any model.
        """
        self._live = {}
        self._live_state = state
        self._live_version = state.version
        for sid, held in state.held.items():
            self._live[sid] = held
            self._count_live(held, 1)

    def _follow_live(self, state: ClusterState) -> None:
        """A policy kept across decisions without observing (the node agent's ledger keeps
        one with its state): the mix stays the live slices, updated by what was placed and
        released since the last decision -- the same mix a fresh policy would seed, without
        counting every live slice again."""
        live = self._live
        if live is None or (state is self._live_state and state.version == self._live_version):
            return
        held = state.held
        ids = state.held_changed_since(self._live_version) if state is self._live_state else None
        if ids is None:  # another state, or further back than its log: compare every record
            ids = {sid for sid, h in held.items() if live.get(sid) is not h}
            ids.update(live.keys() - held.keys())
        changed = [(sid, live.get(sid), held.get(sid)) for sid in ids]
        for sid, before, after in changed:
            if before is after:
                continue  # placed and released again since (or unchanged)
            if before is not None:
                self._count_live(before, -1)
                del live[sid]
            if after is not None:
                self._count_live(after, 1)
                live[sid] = after
        self._live_state = state
        self._live_version = state.version

    def _count_live(self, held: _Held, arrivals: int) -> None:
        """Count a live slice of the state (its shape) as `arrivals` arrivals (-1: gone)."""
        count = len(held.gpus)
        if count == 0:
            return  # host-only work does not use GPUs
        memory = 0 if held.core >= WHOLE_GPU_CORE else int(held.memory[0])
        self._count(held.core, memory, count, (), held.cpu_milli, held.host_memory_mib, arrivals)
        self._live_counted += arrivals

    def _count(
        self,
        core: int,
        memory: int,
        count: int,
        models: tuple[str, ...],
        cpu_milli: int,
        host_memory_mib: int,
        arrivals: int = 1,
    ) -> None:
        ckey = (core, memory, count, models)
        k = self._class_index.get(ckey)
        if k is None:
            k = self._class_index[ckey] = len(self._k_core)
            self._k_core.append(core)
            self._k_mem.append(memory)
            self._k_count.append(count)
            self._k_models.append(models)
        tkey = (k, cpu_milli, host_memory_mib)
        t = self._type_index.get(tkey)
        if t is None:
            t = self._type_index[tkey] = len(self._t_class)
            self._t_class.append(k)
            self._t_cpu.append(cpu_milli)
            self._t_hostmem.append(host_memory_mib)
            self._t_weight.append(0)
        if self.weight == "demand":
            self._t_weight[t] += core * count * arrivals
        elif self.weight == "gpus":
            self._t_weight[t] += count * arrivals
        else:
            self._t_weight[t] += arrivals
        self._version += 1

    @property
    def observed_types(self) -> int:
        """How many distinct request types frag has seen."""
        return len(self._t_class)

    def mix(self) -> dict[tuple[int, int, int, int], float]:
        """The observed mix: (core per GPU, GPU count, CPU milli, host MiB) -> weight share."""
        total = sum(self._t_weight) or 1
        out: dict[tuple[int, int, int, int], float] = {}
        for t, k in enumerate(self._t_class):
            if not self._t_weight[t]:
                continue  # a type whose live slices are all gone (`_follow_live`)
            key = (self._k_core[k], self._k_count[k], self._t_cpu[t], self._t_hostmem[t])
            out[key] = out.get(key, 0.0) + self._t_weight[t] / total
        return out

    def _refresh_types(self) -> None:
        """The arrays that describe the classes and types (not their weights)."""
        self.k_core = np.asarray(self._k_core, dtype=np.int64)
        self.k_mem = np.asarray(self._k_mem, dtype=np.int64)
        self.k_count = np.asarray(self._k_count, dtype=np.int64)
        self.k_whole = self.k_core >= WHOLE_GPU_CORE
        self.whole_cols = np.flatnonzero(self.k_whole)
        self.share_cols = np.flatnonzero(~self.k_whole)
        self.k_core_f = self.k_core.astype(np.float64)  # a class asks for core >= 1
        self.k_mem_f = np.maximum(self.k_mem, 1).astype(np.float64)
        self.t_class = np.asarray(self._t_class, dtype=np.int64)
        # types grouped by class (every class has at least one type)
        self.t_by_class = np.argsort(self.t_class, kind="stable")
        self.class_starts = np.searchsorted(
            self.t_class[self.t_by_class], np.arange(len(self._k_core))
        )
        self.t_cpu = np.asarray(self._t_cpu, dtype=np.int64)
        self.t_hostmem = np.asarray(self._t_hostmem, dtype=np.int64)
        # 1 / need, and for types that need none of it an unlimited number of copies
        self.t_inv_cpu = np.where(self.t_cpu > 0, 1.0 / np.maximum(self.t_cpu, 1), 0.0)
        self.t_inv_hostmem = np.where(self.t_hostmem > 0, 1.0 / np.maximum(self.t_hostmem, 1), 0.0)
        self.t_free_cpu = np.where(self.t_cpu > 0, 0.0, _MANY)
        self.t_free_hostmem = np.where(self.t_hostmem > 0, 0.0, _MANY)
        # qgpu-core one copy of a type fills: its share, or 100 x its GPU count ("fgd"
        # counts usable core and usable whole GPUs directly, see _copies/_gpu_copies)
        if self.measure == "fgd":
            unit = np.where(self.k_whole, WHOLE_GPU_CORE, 1)
        else:
            unit = np.where(self.k_whole, WHOLE_GPU_CORE * self.k_count, self.k_core)
        self.t_unit = unit[self.t_class].astype(np.float64)
        self.host_types = bool(self.t_cpu.any() or self.t_hostmem.any())
        self._arrays_shape = (len(self._k_core), len(self._t_class))

    def _refresh_weights(self) -> None:
        """What follows from the types' weights (every arrival changes them)."""
        self.t_weight = np.asarray(self._t_weight, dtype=np.float64)
        # the mix's average host CPU and memory per qgpu-core (the host term's rates)
        self.total_weight = float(self.t_weight.sum())
        core = float(self.t_weight @ self.t_unit)
        self.cpu_per_core = float(self.t_weight @ self.t_cpu) / core if core else 0.0
        self.hostmem_per_core = float(self.t_weight @ self.t_hostmem) / core if core else 0.0
        self.t_values = self.t_weight * self.t_unit  # what one copy of each type is worth

    def _refresh(self, state: ClusterState) -> None:
        if self._arrays_version != self._version:
            if self._arrays_shape != (len(self._k_core), len(self._t_class)):
                self._refresh_types()  # a new class or type arrived
            self._refresh_weights()
            self._arrays_version = self._version
        # keyed on the state object itself (held, so its id cannot be reused by another);
        # classes only ever get added, so a known state only needs the new columns
        k = len(self._k_core)
        known = self._allowed_for is not None and self._allowed_for[0] is state
        start = self._allowed.shape[1] if known else 0
        if not known or start < k:
            cols = [np.zeros(state.gpu_total, dtype=bool)]  # keeps the stack 2-D when k == 0
            for c in range(start, k):
                mask = state.model_mask(self._k_models[c])
                col = np.ones(state.gpu_total, dtype=bool) if mask is None else mask.copy()
                if self.k_whole[c]:
                    col &= state.cap_mem >= self.k_mem[c]
                cols.append(col)
            new = np.stack(cols, axis=1)[:, 1:]
            self._allowed = np.concatenate([self._allowed, new], axis=1) if known else new
            self._allowed_for = (state, k)

    # -- the measure ----------------------------------------------------------------------

    def _copies(
        self, core: np.ndarray, mem: np.ndarray, room: np.ndarray, cls: slice = slice(None)
    ) -> np.ndarray:
        """Per GPU x class (classes `cls`): copies of a share class a GPU with this free
        core, memory and slice room holds ("fgd": all its free core once one copy fits)."""
        room = _clamped(room, 0, 255)
        core = _clamped(core, -1, 1 << 20)
        mem = _clamped(mem, -1, 1 << 19)
        at: np.ndarray | slice = _ALL
        if len(room) <= _FEW_GPUS:  # a few GPUs (one node's): directly
            u_core, u_mem, u_room = core[:, None], mem[:, None], room[:, None]
        else:  # GPUs repeat the same few states: each distinct (core, memory, room) once
            key = ((core + 1) << 28) | ((mem + 1) << 8) | room
            states, at = np.unique(key, return_inverse=True)
            u_core = ((states >> 28) - 1)[:, None]
            u_mem = (((states >> 8) & ((1 << 20) - 1)) - 1)[:, None]
            u_room = (states & 255)[:, None]
        k_core = self.k_core[None, cls]
        k_mem = self.k_mem[None, cls]
        if self.measure == "fgd":
            fits = (u_core >= k_core) & (u_mem >= k_mem) & (u_room >= 1)
            return (fits * u_core).astype(np.float64)[at]
        # floor(free / need) in float64: exact (integers below 2**21, so a true quotient
        # that is not whole is at least 1 / need >> 2**-32 away from the next whole number),
        # and several times faster than integer division
        per = np.minimum(u_core / self.k_core_f[None, cls], u_mem / self.k_mem_f[None, cls])
        return np.minimum(np.floor(per, out=per), u_room, out=per)[at]

    def _rows(self, s: ClusterState, idx: np.ndarray, cls: slice = slice(None)) -> np.ndarray:
        """Per GPU x class (classes `cls`): copies of a share class, or 1 for a free whole
        GPU."""
        room = np.where(s.healthy[idx], s.max_slices[idx] - s.slices[idx], 0)
        share = self._copies(s.free_core[idx], s.free_mem[idx], room, cls)
        full = (s.slices[idx] == 0) & (s.free_core[idx] == s.cap_core[idx]) & s.healthy[idx]
        rows = np.where(self.k_whole[None, cls], full[:, None], share)
        return rows * self._allowed[idx][:, cls]

    def _usable_per_gpu(self, s: ClusterState) -> tuple[np.ndarray, np.ndarray]:
        """(per GPU x class copies, the same summed per node), kept incrementally: only the
        GPUs of nodes that changed since the last call (`ClusterState.node_version`) are
        recomputed (a decision touches one node)."""
        k = len(self._k_core)
        if self._cache_key is None or self._cache_key[0] is not s:
            self._cache_key = (s, k)
            self._seen = s.node_version.copy()
            self._gpu_cols = _Columns(self._rows(s, np.arange(s.gpu_total)))
            self._node_cols = _Columns(_sum_per_node(s, self._gpu_cols.table))
            self._per_gpu, self._per_node = self._gpu_cols.table, self._node_cols.table
            self._snap_version = s.version
            return self._per_gpu, self._per_node
        known = self._cache_key[1]
        if known == k and self._snap_version == s.version:
            return self._per_gpu, self._per_node  # nothing changed since the last call
        if known < k:  # new classes: their columns from the current state
            new = self._rows(s, np.arange(s.gpu_total), slice(known, k))
            self._per_gpu = self._gpu_cols.append(new)
            self._per_node = self._node_cols.append(_sum_per_node(s, new))
            self._cache_key = (s, k)
        nodes = np.flatnonzero(s.node_version != self._seen)
        if len(nodes):
            changed, offsets = s.gpus_of(nodes)
            rows = self._rows(s, changed)
            # each node's change, summed over its GPUs (a GPU of a changed node that did not
            # change itself adds exactly 0; whole numbers, so the sums are exact)
            has = s.node_gpu_count[nodes] > 0  # (reduceat cannot sum an empty node)
            if has.any():
                diff = rows - self._per_gpu[changed]
                self._per_node[nodes[has]] += np.add.reduceat(diff, offsets[has])
            self._per_gpu[changed] = rows
            self._seen[nodes] = s.node_version[nodes]
        self._snap_version = s.version
        return self._per_gpu, self._per_node

    def _gpu_copies(self, sums: np.ndarray) -> np.ndarray:
        """Per node (or candidate) x class -> per type: copies the node's GPUs can hold."""
        copies = sums.astype(np.float32)
        cols = self.whole_cols
        if len(cols):
            copies[:, cols] = self._whole(sums[:, cols], cols)
        return copies[:, self.t_class]

    def _whole(self, free: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """Copies of whole classes `cols` that `free` whole GPUs (per row) hold ("fgd": all
        of them once there are enough for one copy)."""
        count = self.k_count[cols][None, :]
        if self.measure == "fgd":
            return np.where(free >= count, free, 0.0)
        return np.floor_divide(free, count)

    def _host_copies(self, cpu: np.ndarray, hostmem: np.ndarray) -> np.ndarray:
        """Per node x type: copies the node's free host CPU and memory can feed."""
        if self.measure == "fgd":
            ok = (cpu[:, None] >= self.t_cpu[None, :]) & (hostmem[:, None] >= self.t_hostmem)
            return np.where(ok, _MANY, 0.0).astype(np.float32)
        # floor(free / need) in float64: exact for these magnitudes (free and need are
        # integers below 2**50, so a true quotient's fraction is at least 1 / need >> 1e-9)
        cpu_f = _clamped(cpu, 0, int(_MANY)).astype(np.float64)[:, None]
        mem_f = _clamped(hostmem, 0, int(_MANY)).astype(np.float64)[:, None]
        copies = np.minimum(
            cpu_f * self.t_inv_cpu + self.t_free_cpu,
            mem_f * self.t_inv_hostmem + self.t_free_hostmem,
        )
        copies += 1e-9
        return np.floor(copies, out=copies).astype(np.float32)

    def _expected_usable(self, gpu_copies: np.ndarray, host_copies: np.ndarray) -> np.ndarray:
        """Expected usable qgpu-core (times the total weight): sum over types of weight x
        copies x core per copy. Copies are small whole numbers (or the 2**40 cap), exact in
        float32; the weighted sum is taken in float64, where it is exact too."""
        copies = np.minimum(gpu_copies, host_copies)
        return copies.astype(np.float64) @ (self.t_weight * self.t_unit)

    def _score(self, view: CandidateView) -> np.ndarray:
        """Per GPU (length gpu_total): minus the growth of expected fragmentation if the
        request went there (= change of expected usable core); -inf for non-candidates."""
        s = view.state
        req = view.request
        out = np.full(s.gpu_total, -np.inf)
        in_nodes = np.zeros(len(s.nodes), dtype=bool)
        in_nodes[view.node_ids] = True
        cand = np.flatnonzero(view.gpu_mask & in_nodes[s.gpu_node])
        if len(cand) == 0:
            return out
        self._start(s)
        if not self._k_core:
            out[cand] = 0.0
            return out
        # A GPU's score depends on the state, the mix and these parts of the request only,
        # not on which other GPUs are candidates: a view of GPUs the last call already
        # scored (the extender places a pod on the node it has just ranked first) reuses it.
        depends = (
            s.version,
            self._version,
            view.core,
            req.gpu_count,
            None if req.is_whole_gpu else (req.memory_gib_per_gpu, req.memory_percent),
            req.cpu_milli,
            req.host_memory_mib,
        )
        memo = self._score_memo
        if memo is not None and memo[0] is s and memo[1] == depends:
            scored = memo[2][cand]
            if np.isfinite(scored).all():
                out[cand] = scored
                return out
        self._refresh(s)
        per_gpu, per_node = self._usable_per_gpu(s)
        # Where the node's host can still feed every copy its GPUs hold of every type after
        # the request, the score is exactly minus the sum of the dropped copies' values
        # (`_lost_on_roomy_hosts`); so it is where the host feeds the mix as a whole on all
        # the node's free GPU core before and after the request (`_feeds_mix`: the host
        # limits no type there); elsewhere the full measure (`_full_scores`).
        roomy = self._roomy_after(s, per_node, cand, req.cpu_milli, req.host_memory_mib)
        if not roomy.all():
            nodes, at = np.unique(s.gpu_node[cand], return_inverse=True)
            core = req.core_per_gpu * req.gpu_count
            feeds = self._feeds_mix(s, nodes, 0, 0, 0)
            feeds &= self._feeds_mix(s, nodes, core, req.cpu_milli, req.host_memory_mib)
            roomy |= feeds[at]
        if roomy.all():
            out[cand] = 0.0 - self._lost_on_roomy_hosts(view, cand, per_gpu, per_node)
        else:
            easy, hard = cand[roomy], cand[~roomy]
            if len(easy):
                out[easy] = 0.0 - self._lost_on_roomy_hosts(view, easy, per_gpu, per_node)
            out[hard] = self._full_scores(view, hard, per_gpu, per_node)
        if self.gap_weight and view.core < WHOLE_GPU_CORE:
            # gap values: what the GPU's gap is worth afterwards, less what it was worth (a
            # gap holds at most as many more shares as the GPU has slices left)
            free = s.free_core[cand]
            by_room = self.gap_by_room(s)
            top = by_room.shape[0] - 1
            room = np.minimum(s.max_slices[cand] - s.slices[cand], top)
            after = by_room[np.maximum(room - 1, 0), free - view.core]
            out[cand] += self.gap_weight * self.total_weight * (after - by_room[room, free])
        self._score_memo = (s, depends, out)
        return out

    def _drop(self, view: CandidateView, gpus: np.ndarray, per_gpu: np.ndarray) -> np.ndarray:
        """Per GPU of `gpus` x class: copies of each share class the request takes away from
        the GPU (times its GPU count); for a whole class, 1 per GPU count where the GPU is a
        free whole GPU (turned into whole copies per node by `_whole`)."""
        s = view.state
        room_after = np.where(s.healthy[gpus], s.max_slices[gpus] - s.slices[gpus] - 1, 0)
        share_after = self._copies(
            s.free_core[gpus] - view.core, s.free_mem[gpus] - view.memory[gpus], room_after
        )
        after_gpu = np.where(self.k_whole[None, :], 0.0, share_after) * self._allowed[gpus]
        return view.request.gpu_count * (per_gpu[gpus] - after_gpu)

    def _full_scores(
        self, view: CandidateView, cand: np.ndarray, per_gpu: np.ndarray, per_node: np.ndarray
    ) -> np.ndarray:
        """Per GPU of `cand`: the change of expected usable core (times the total weight)
        if the request went there -- the measure itself, host copies before and after
        included (see the module docstring)."""
        s = view.state
        req = view.request
        # score each distinct (node state, GPU state) once
        reps, inverse, gpu_key = self._state_keys(s).distinct(cand)
        g = cand[reps]
        n = s.gpu_node[g]
        nodes, at = np.unique(n, return_inverse=True)  # host terms are per node
        cpu = s.node_free_cpu[nodes]
        hostmem = s.node_free_hostmem[nodes]
        values = self.t_weight * self.t_unit
        gpu_before = self._gpu_copies(per_node[nodes])
        host_after = self._host_copies(cpu - req.cpu_milli, hostmem - req.host_memory_mib)
        host_before = self._host_copies(cpu, hostmem)
        # a host that feeds the mix on all the node's free GPU core limits no type
        core = req.core_per_gpu * req.gpu_count
        host_before[self._feeds_mix(s, nodes, 0, 0, 0)] = _MANY
        host_after[self._feeds_mix(s, nodes, core, req.cpu_milli, req.host_memory_mib)] = _MANY
        before = self._expected_usable(gpu_before, host_before)
        host_only = self._expected_usable(gpu_before, host_after)  # GPUs untouched
        # copies of each class the candidate GPU(s) would take away from their node
        # (computed once per distinct GPU state, then spread to the candidates)
        _, first, state_of = np.unique(gpu_key[g], return_index=True, return_inverse=True)
        drop = self._drop(view, g[first], per_gpu)[state_of]
        cols = self.whole_cols
        if len(cols):  # whole classes count groups of `count` free GPUs: not linear
            free = per_node[:, cols][n]
            drop[:, cols] = self._whole(free, cols) - self._whole(free - drop[:, cols], cols)
        # A type loses min(G, H) - min(G - d, H) = clip(H - G + d, 0, d) copies, G and H
        # the copies its node's GPUs and host (after the request) hold, d the drop. Where
        # the host has slack (H >= G) that is all of d: summed per class, a cheap product.
        slack = host_after - gpu_before
        has_slack = slack >= 0
        by_class = np.add.reduceat(
            (has_slack * values)[:, self.t_by_class], self.class_starts, axis=1
        )
        lost = np.einsum("rk,rk->r", drop, by_class[at])
        tight = np.flatnonzero(~has_slack.all(axis=0))
        if len(tight):  # types the host limits somewhere: only the part beyond the slack
            short = slack[:, tight][at]
            d = drop[:, self.t_class[tight]]
            lost += np.where(short < 0, np.maximum(short + d, 0.0), 0.0) @ values[tight]
        return (host_only[at] - lost - before[at])[inverse]

    def _lost_on_roomy_hosts(
        self, view: CandidateView, cand: np.ndarray, per_gpu: np.ndarray, per_node: np.ndarray
    ) -> np.ndarray:
        """`_full_scores` negated, for GPUs whose node's host has slack for every type after
        the request (`_roomy_after`): host copies limit nothing there, so a type loses all
        of its drop, and the score is minus the dropped copies' values -- sum over classes
        of drop x the class's value. Share classes' drops depend on the GPU's state alone
        (each distinct state once); whole classes' on the node's free whole GPUs too.
        Integers throughout: bit for bit what `_full_scores` gives."""
        values = self.t_weight * self.t_unit
        by_class = np.add.reduceat(values[self.t_by_class], self.class_starts)
        # each distinct (node state, GPU state) once, as in `_full_scores`
        reps, inverse, gpu_key = self._state_keys(view.state).distinct(cand)
        g = cand[reps]
        _, first, state_of = np.unique(gpu_key[g], return_index=True, return_inverse=True)
        drop = self._drop(view, g[first], per_gpu)
        cols = self.whole_cols
        if not len(cols):
            return (drop @ by_class)[state_of][inverse]
        shares = self.share_cols
        lost = (drop[:, shares] @ by_class[shares])[state_of]
        # only a free whole GPU drops whole copies (a share on a used GPU drops none)
        hit = np.flatnonzero(drop[:, cols].any(axis=1)[state_of])
        if len(hit):
            free = per_node[:, cols][view.state.gpu_node[g[hit]]]
            d = drop[:, cols][state_of[hit]]
            lost[hit] += (self._whole(free, cols) - self._whole(free - d, cols)) @ by_class[cols]
        return lost[inverse]

    def _feeds_mix(
        self, s: ClusterState, nodes: np.ndarray, core: int, cpu: int, hostmem: int
    ) -> np.ndarray:
        """Per node of `nodes`: once `core`, `cpu` and `hostmem` are taken, can its host
        still feed the mix, at the mix's average host CPU and memory per qgpu-core, on all
        of its free GPU core (the host term's `_aggregate` caps nothing)? If so, its host
        limits no type's copies (fill measure only): the per-type host bound judges each
        type as if it alone filled the node, and on such a node that is an artefact -- it
        made an empty 8-GPU node whose CPU could not feed 16 copies of a CPU-heavy 47%
        type look cheaper to break than the last free GPUs of a used node (docs/placement.md,
        "The host feeds the mix")."""
        if self.measure != "fill":
            return np.zeros(len(nodes), dtype=bool)
        return self._aggregate(s, nodes, core, cpu, hostmem) >= s.node_free_core[nodes] - core

    def _roomy_after(
        self, s: ClusterState, per_node: np.ndarray, cand: np.ndarray, cpu: int, hostmem: int
    ) -> np.ndarray:
        """Per GPU of `cand`: does its node keep, after `cpu` and `hostmem` are taken, the
        host CPU and memory to feed every copy of every type its GPUs hold (H >= G for all
        types in `_full_scores`)? A sufficient test, exact in float64."""
        need = self._host_need(s, per_node)
        if not need.any():
            return np.ones(len(cand), dtype=bool)
        n = s.gpu_node[cand]
        free_cpu = np.minimum(s.node_free_cpu[n] - cpu, np.int64(_MANY))
        free_mem = np.minimum(s.node_free_hostmem[n] - hostmem, np.int64(_MANY))
        return (free_cpu >= need[n, 0]) & (free_mem >= need[n, 1])

    def _host_need(self, s: ClusterState, per_node: np.ndarray) -> np.ndarray:
        """Per node: (host CPU, host memory) that feeding every copy its GPUs hold of the
        hungriest type would take; kept per node like the copies (`_usable_per_gpu`), and
        afresh when a type arrives."""
        types = self._arrays_shape
        if self._need_key is None or self._need_key[0] is not s or self._need_key[1] != types:
            self._need_key = (s, types)
            self._need_seen = s.node_version.copy()
            self._need = np.zeros((len(s.nodes), 2))
            if self.t_cpu.any() or self.t_hostmem.any():
                self._need = self._need_of(per_node)
            return self._need
        if not (self.t_cpu.any() or self.t_hostmem.any()):
            return self._need
        nodes = np.flatnonzero(s.node_version != self._need_seen)
        if len(nodes):
            self._need[nodes] = self._need_of(per_node[nodes])
            self._need_seen[nodes] = s.node_version[nodes]
        return self._need

    def _need_of(self, per_node: np.ndarray) -> np.ndarray:
        copies = self._gpu_copies(per_node).astype(np.float64)
        return np.stack(
            [(copies * self.t_cpu).max(axis=1), (copies * self.t_hostmem).max(axis=1)], axis=1
        )

    def gap_values(self, state: ClusterState) -> np.ndarray:
        """V[x], x = 0..100: what a gap of x free qgpu-core is worth to the mix
        (`qgpu.gap_prices`), priced again when the mix has moved (`REPRICE_DRIFT`), a new
        share size or GPU count arrived, or the cluster's typical slice limit differs."""
        mix, arrived = self._mix_by_size()
        slots = self._typical_slots(state)
        prices = self.prices
        if (
            prices is None
            or slots != self._priced_slots
            or mix.keys() != self._priced_mix.keys()
            or sum(abs(p - self._priced_mix[k]) for k, p in mix.items())
            > reprice_threshold(arrived)
        ):
            shares = {k: p for k, p in mix.items() if k > 0}
            whole = {-k: p for k, p in mix.items() if k < 0}
            try:
                prices = price_gaps(shares, whole, slots)
            except RuntimeError as exc:  # the LP solver gave up: place without gap values
                if not self._pricing_failed:  # once per run of failures
                    _log.warning(
                        "frag: pricing the request mix failed (%s); placing "
                        "without gap values until it succeeds",
                        exc,
                    )
                self._pricing_failed = True
                prices = NO_PRICES  # every gap worth 0: the term drops out
            else:
                self._pricing_failed = False
            self.prices = prices
            self._priced_mix = mix
            self._priced_slots = slots
        return prices.values

    def _requests_seen(self) -> int:
        """Requests frag has seen (the keep-empty rule's evidence): arrivals observed and the
        live slices counted in the mix; the prior's pseudo-arrivals do not count."""
        return self._observed + self._live_counted

    def _keep_empty(self, view: CandidateView, per_gpu: np.ndarray) -> np.ndarray:
        """Below `keep_empty` fill, while fewer than `keep_empty_until` requests have been
        seen: `per_gpu` with every empty candidate GPU ranked below every used one, and the
        empty ones by how many empty candidates their node has, fewest first (shifts in
        whole multiples of one larger than any other difference of the scores, the host
        term's at the node level included; frag's order stands within a tier). Applied to a
        copy, after the memoised scores (`_score`)."""
        cand = np.flatnonzero(np.isfinite(per_gpu))
        shift = self._empty_shift(view, cand, per_gpu[cand], view.state.gpu_node[cand])
        if shift is None:
            return per_gpu
        out = per_gpu.copy()
        out[cand[shift[1]]] -= shift[0] * shift[2]
        return out

    def _empty_shift(
        self,
        view: CandidateView,
        cand: np.ndarray | None,
        scores: np.ndarray,
        node_of: np.ndarray,
        empties: Callable[[], np.ndarray] | None = None,
    ) -> tuple[float, np.ndarray, np.ndarray] | None:
        """`_keep_empty` for candidate GPUs `cand` scored `scores` (every candidate of the
        view, or one per distinct state: the same spread, the same empties or none), on the
        nodes `node_of` names (any label per node): None where the rule does not apply, else
        (the shift, which of `cand` it lowers, by how many shifts each). With `empties`
        instead of `cand`: which candidates are empty GPUs, when asked.

        An empty GPU is lowered once per empty candidate GPU of its node, so that among the
        empty GPUs a share opens one on the node with the fewest: the largest blocks of
        empty GPUs, which the multi-GPU requests need, are broken last (`_empty_weights`)."""
        if not self.keep_empty:
            return None
        if self.keep_empty_until and self._requests_seen() >= self.keep_empty_until:
            return None
        s = view.state
        cap = float(s.cap_core.sum())
        if cap <= 0 or 1.0 - float(s.free_core.sum()) / cap >= self.keep_empty:
            return None
        if self.keep_empty_until:
            to_come = self.keep_empty_until - self._requests_seen()
            if self._spare_whole_nodes(s) > to_come:
                return None
        if empties is not None:
            empty = empties()
        else:
            assert cand is not None
            empty = (s.slices[cand] == 0) & (s.free_core[cand] >= s.cap_core[cand])
        if not empty.any():
            return None
        if empty.all():
            # only empty GPUs can take it: which one, by the node's empty GPUs, once the
            # cluster is in use (in an empty cluster frag's own scores choose)
            if float(s.free_core.sum()) >= cap:
                return None
            weights = _empty_weights(node_of, empty)
            if weights.min() == weights.max():
                return None  # every candidate lowered alike: nothing changes
        else:
            weights = _empty_weights(node_of, empty)
        spread = float(np.ptp(scores))
        bound = (1.0 + self.host_weight + self.gap_weight) * self.total_weight * WHOLE_GPU_CORE
        return 2.0 * (spread + bound) + 1.0, empty, weights

    @staticmethod
    def _spare_whole_nodes(s: ClusterState) -> int:
        """Nodes of the cluster's largest GPU count whose GPUs are all empty and healthy.

        The keep-empty rule guards whole-GPU requests that arrive before the mix is known.
        Each request, a share or a whole-GPU request (one node's GPUs), breaks at most one
        such node; so while there are more of them than requests can still arrive before
        the rule lapses, every request until then finds a node with as many empty GPUs as
        any node has, wherever the shares go, and the rule cannot save one: frag's own
        scores decide (docs/placement.md, "Issue 22: the keep-empty rule where it cannot
        pay out")."""
        if not len(s.nodes):
            return 0
        size = int(s.node_gpu_count.max())
        if size == 0:
            return 0
        # empty: no slice on the node (a slice takes at least 1 qgpu-core of its GPU)
        nodes = np.flatnonzero((s.node_gpu_count == size) & (s.node_free_core == s.node_cap_core))
        if not len(nodes):
            return 0
        gpus, _ = s.gpus_of(nodes)
        sick = gpus[~s.healthy[gpus]]
        if not len(sick):
            return len(nodes)
        return len(nodes) - int(np.isin(nodes, s.gpu_node[sick]).sum())

    def gap_by_room(self, state: ClusterState) -> np.ndarray:
        """V[r, x]: `gap_values` for a gap with room for at most r more slices."""
        self.gap_values(state)
        assert self.prices is not None
        return self.prices.by_room

    def _mix_by_size(self) -> tuple[dict[int, float], float]:
        """The mix's proportions by share core (> 0) and by whole-GPU count (as -count), and
        its total weight (the number of arrivals, with the default weights)."""
        if self._size_mix[0] != self._version:
            weights: dict[int, float] = {}
            for t, k in enumerate(self._t_class):
                core = self._k_core[k]
                key = core if core < WHOLE_GPU_CORE else -self._k_count[k]
                weights[key] = weights.get(key, 0.0) + self._t_weight[t]
            total = sum(weights.values())
            mix = {k: w / total for k, w in weights.items()} if total else {}
            self._size_mix = (self._version, mix, total)
        return self._size_mix[1], self._size_mix[2]

    def _typical_slots(self, state: ClusterState) -> int:
        """The slice limit of the cluster's typical GPU (the median), for the patterns."""
        if self._slots_for[0] is not state:
            slots = int(np.median(state.max_slices)) if state.gpu_total else 1
            self._slots_for = (state, max(1, slots))
        return self._slots_for[1]

    def _aggregate(
        self, s: ClusterState, ids: np.ndarray, core: int, cpu: int, hostmem: int
    ) -> np.ndarray:
        """Per node `ids`: the GPU core the mix as a whole could use once `core`, `cpu` and
        `hostmem` are taken: free core, capped by free host CPU and memory at the mix's
        average rates per qgpu-core (a rate of 0 caps nothing)."""
        usable = (s.node_free_core[ids] - core).astype(np.float64)
        for free, rate in (
            (s.node_free_cpu[ids] - cpu, self.cpu_per_core),
            (s.node_free_hostmem[ids] - hostmem, self.hostmem_per_core),
        ):
            if rate > 0:
                usable = np.minimum(usable, free.astype(np.float64) / rate)
        return usable

    def _host_term(
        self, s: ClusterState, ids: np.ndarray, core: int, cpu: int, hostmem: int
    ) -> np.ndarray:
        """Per node `ids`: minus the core a placement of (`core`, `cpu`, `hostmem`) strands
        behind host CPU and memory (the drop of aggregate usable core beyond `core`), times
        `host_weight` and the total weight (the scale of the fragmentation scores). Exactly
        0 where the host has room for the mix on all the node's free GPU core."""
        if self.host_weight == 0 or not self._k_core:
            return np.zeros(len(ids))
        self._refresh(s)
        if self.cpu_per_core == 0 and self.hostmem_per_core == 0:
            # the mix asks for no host CPU or memory: the aggregate is the free core, the
            # drop exactly `core`, and the term below -w x 0.0 = -0.0 for every node
            return np.full(len(ids), -0.0)
        drop = self._aggregate(s, ids, 0, 0, 0) - self._aggregate(s, ids, core, cpu, hostmem)
        return -self.host_weight * self.total_weight * (drop - core)

    # -- Policy interface -----------------------------------------------------------------

    def _state_keys(self, s: ClusterState) -> _StateKeys:
        """The GPU and node state keys of `s`, brought up to date (only changed nodes)."""
        if self._keys is None or self._keys.state is not s:
            self._keys = _StateKeys(s)
        else:
            self._keys.update()
        return self._keys

    def prepare(self, state: ClusterState) -> None:
        """Load the LP solver (`qgpu.gap_prices.warm_up`) and key the state's GPUs and
        nodes, so that the first decision costs what any other does (fill measure only:
        the paper's measure prices nothing)."""
        if self.gap_weight:
            warm_up()
        self._state_keys(state)

    def node_scores(self, view: CandidateView) -> np.ndarray:
        cached = self._cached_node_scores(view)
        if cached is not None:
            return cached
        per_gpu = self._keep_empty(view, self._score(view))
        self._last_view = view
        self._last_gpu_scores = per_gpu
        self._last_shift = None
        s = view.state
        best = _best_per_node(s, per_gpu)
        req = view.request
        host = self._host_term(
            s,
            view.node_ids,
            req.core_per_gpu * req.gpu_count,
            req.cpu_milli,
            req.host_memory_mib,
        )
        return best[view.node_ids] + host + _TIE_WEIGHT * _node_fill(view) / 2

    def gpu_scores(self, view: CandidateView, gpu_ids: np.ndarray) -> np.ndarray:
        per_gpu: np.ndarray | None = None
        if view is self._last_view and self._last_shift is not None:
            per_gpu = self._cached_gpu_scores(view, gpu_ids, self._last_shift[0])
        elif view is self._last_view:
            per_gpu = self._last_gpu_scores[gpu_ids]
        else:
            per_gpu = self._cached_view_gpu_scores(view, gpu_ids)
        if per_gpu is None:
            per_gpu = self._keep_empty(view, self._score(view))[gpu_ids]
        # binpack's GPU preference (least left over) breaks ties between equal GPUs
        return per_gpu - _TIE_WEIGHT * _leftover(view, gpu_ids) / 2

    # -- the score cache ------------------------------------------------------------------
    #
    # A candidate GPU's score is 0.0 - (its loss row) . (the types' values) + its gap term,
    # where the loss row -- per type, the copies the request there takes from its node,
    # host limits included -- depends only on the node's exact state, the GPU's, the
    # request's shape, the request types known and the node's host mode (which of the host
    # rules apply: `_node_modes`), never on the types' weights. Every arrival changes the
    # weights, so scores cannot be kept from one pod to the next, but loss rows can: they
    # are kept per (request shape, host mode, node state, GPU state) -- the node state and
    # GPU state named exactly by `qgpu.node_groups` -- and a call computes rows only for
    # states it has not met, then one product with the values. Rows are sums of whole
    # copies and values are whole numbers, so every product and sum is exact in float64
    # and the scores equal those of `_score` bit for bit. Nodes in the same state get the
    # same score, so a view of many nodes is scored one node per distinct state.

    def _cache_open(self, s: ClusterState) -> bool:
        """Whether this call may go through the cache: from a policy's second call on a
        state on (an engine made for one decision, as the Ray SDK's, groups no nodes), and
        not for `_CACHE_BACKOFF` calls after one found too many distinct node states."""
        if not self.cache:
            return False
        state, calls, skip = self._gate
        if state is not s:
            state, calls, skip = s, 0, 0
        calls += 1
        self._gate = (state, calls, max(skip - 1, 0))
        return calls >= 2 and skip == 0

    def _cache_for(self, s: ClusterState) -> _ScoreCache:
        """The loss rows kept for `s` and the current request types (afresh when either
        changes: a new type changes every row's width and the hosts' needs)."""
        cache = self._score_cache
        if cache is None or cache.state is not s or cache.types != self._arrays_shape:
            cache = self._score_cache = _ScoreCache(s, self._arrays_shape)
        return cache

    def _cached_node_scores(self, view: CandidateView) -> np.ndarray | None:
        """`node_scores` through the cache: one node per distinct state (every node for a
        request that names GPUs); None where the cache does not apply (see `_cached_scores`)
        -- the caller then scores the vectorised way, with the same result."""
        s = view.state
        req = view.request
        nodes = view.node_ids
        if not len(nodes) or not self._cache_open(s):
            return None
        groups = s.node_groups()
        slots = groups.current()
        at: np.ndarray | None = None
        if groupable(req):
            nodes, at = _one_per_group(slots[nodes], nodes, groups.slots)
        if len(nodes) > _CACHED_NODES:
            state, calls, _ = self._gate
            self._gate = (state, calls, _CACHE_BACKOFF)
            return None
        if at is not None and self._started:
            grouped = self._grouped_node_scores(view, nodes, at, slots)
            if grouped is not None:
                return grouped
        scored = self._cached_scores(view, nodes)
        if scored is None:
            return None
        cand, owner, per_gpu = scored
        shift = self._empty_shift(view, cand, per_gpu, owner)
        if shift is not None:
            per_gpu = per_gpu.copy()
            per_gpu[shift[1]] -= shift[0] * shift[2]
        self._last_view = view
        self._last_shift = (None if shift is None else shift[0],)
        best = np.full(len(nodes), -np.inf)
        starts = np.flatnonzero(np.concatenate([[True], owner[1:] != owner[:-1]]))
        best[owner[starts]] = np.maximum.reduceat(per_gpu, starts)
        host = self._host_term(
            s, nodes, req.core_per_gpu * req.gpu_count, req.cpu_milli, req.host_memory_mib
        )
        out = best + host + _TIE_WEIGHT * _fill_of(s, nodes) / 2
        return out if at is None else out[at]

    def _cached_gpu_scores(
        self, view: CandidateView, gpu_ids: np.ndarray, shift: float | None
    ) -> np.ndarray | None:
        """`gpu_scores` for the view `_cached_node_scores` scored last: its scores of
        `gpu_ids` (one node's), lowered by `shift` where the keep-empty rule lowered the
        empty GPUs; -inf for a GPU that is not the view's candidate."""
        s = view.state
        out = np.full(len(gpu_ids), -np.inf)
        node = s.gpu_node[gpu_ids[:1]].astype(np.int64)
        if not len(gpu_ids) or not (view.node_ids == node[0]).any():
            return out
        scored = self._cached_scores(view, node)
        if scored is None:
            return None
        cand, _, per_gpu = scored
        if shift is not None:
            empty = (s.slices[cand] == 0) & (s.free_core[cand] >= s.cap_core[cand])
            per_gpu = per_gpu.copy()
            per_gpu[empty] -= shift * int(empty.sum())  # `_empty_weights` on one node
        return _scores_of(gpu_ids, cand, per_gpu, out)

    def _cached_view_gpu_scores(
        self, view: CandidateView, gpu_ids: np.ndarray
    ) -> np.ndarray | None:
        """`gpu_scores` through the cache for another view (the extender's hold on the node
        it ranked first: a view of that node alone): every candidate of the view scored, the
        keep-empty rule applied over them, then `gpu_ids`' scores."""
        if not len(view.node_ids) or len(view.node_ids) > _CACHED_NODES:
            return None
        if not self._cache_open(view.state):
            return None
        scored = self._cached_scores(view, view.node_ids)
        if scored is None:
            return None
        cand, owner, per_gpu = scored
        shift = self._empty_shift(view, cand, per_gpu, owner)
        if shift is not None:
            per_gpu = per_gpu.copy()
            per_gpu[shift[1]] -= shift[0] * shift[2]
        return _scores_of(gpu_ids, cand, per_gpu, np.full(len(gpu_ids), -np.inf))

    def _cached_scores(
        self, view: CandidateView, nodes: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """(the view's candidate GPUs on `nodes`, node after node; for each the position of
        its node in `nodes`; their scores before the keep-empty rule), as `_score` gives
        them; None where there is no candidate, no request type, or a node without the host
        room for the request (whose scoring `_score` decides by the whole cluster).

        The scores of the last call are kept by (node state, GPU state) until the state,
        the mix or the request shape changes: the extender's hold on the node it has just
        ranked first (and the engine's GPU choice there) reads them."""
        s = view.state
        if len(nodes) == 1:  # one node (the extender's hold): its GPUs' range
            start = int(s.node_start[nodes[0]])
            end = start + int(s.node_gpu_count[nodes[0]])
            cand = np.flatnonzero(view.gpu_mask[start:end]) + start
            owner = np.zeros(len(cand), dtype=np.int64)
        else:
            gpus, _ = s.gpus_of(nodes)
            keep = view.gpu_mask[gpus]
            cand = gpus[keep]
            owner = np.repeat(np.arange(len(nodes), dtype=np.int64), s.node_gpu_count[nodes])
            owner = owner[keep]
        if not len(cand):
            return None
        groups = s.node_groups()
        slot = groups.current()[nodes]
        rank = groups.rank[cand]
        shape = _shape_of(view)
        memo = self._base_memo
        if memo[0] is s and memo[1] == (s.version, self._version, shape):
            kept = memo[2]
            got = [kept.get(k) for k in zip(slot[owner].tolist(), rank.tolist(), strict=True)]
            if None not in got:
                return cand, owner, np.asarray(got, dtype=np.float64)
        self._start(s)
        if not self._k_core:
            return None
        self._refresh(s)
        cache = self._cache_for(s)
        cache.make_room()
        gen = groups.gen[slot]
        mode = self._node_modes(view, nodes, cache, slot, gen)
        if mode is None:
            return None
        per_gpu = self._cached_base(
            view, cache, shape, cand, slot[owner], gen[owner], rank, mode[owner]
        )
        keys = zip(slot[owner].tolist(), rank.tolist(), strict=True)
        self._base_memo = (
            s,
            (s.version, self._version, shape),
            dict(zip(keys, per_gpu.tolist(), strict=True)),
        )
        return cand, owner, per_gpu

    def _node_modes(
        self,
        view: CandidateView,
        nodes: np.ndarray,
        cache: _ScoreCache,
        slot: np.ndarray,
        gen: np.ndarray,
    ) -> np.ndarray | None:
        """Per node: 0 where its host keeps room for every copy its GPUs hold after the
        request (`_roomy_after`) or feeds the mix before and after it (`_feeds_mix`), else
        1 + (feeds before) + 2 x (feeds after): which host rule `_full_scores` applies.
        None when a node lacks the host room for the request itself."""
        if not self.host_types:
            return np.zeros(len(nodes), dtype=np.int64)
        s = view.state
        req = view.request
        cpu, hostmem = req.cpu_milli, req.host_memory_mib
        free_cpu = s.node_free_cpu[nodes]
        free_mem = s.node_free_hostmem[nodes]
        if (free_cpu < cpu).any() or (free_mem < hostmem).any():
            return None
        need = cache.need_of(slot, gen)
        miss = np.flatnonzero(np.isnan(need[:, 0]))
        if len(miss):
            _, per_node = self._usable_per_gpu(s)
            need[miss] = cache.set_need(slot[miss], gen[miss], self._need_of(per_node[nodes[miss]]))
        roomy = (np.minimum(free_cpu - cpu, np.int64(_MANY)) >= need[:, 0]) & (
            np.minimum(free_mem - hostmem, np.int64(_MANY)) >= need[:, 1]
        )
        mode = np.zeros(len(nodes), dtype=np.int64)
        if not roomy.all():
            hard = np.flatnonzero(~roomy)
            core = req.core_per_gpu * req.gpu_count
            before = self._feeds_mix(s, nodes[hard], 0, 0, 0)
            after = self._feeds_mix(s, nodes[hard], core, cpu, hostmem)
            mode[hard] = np.where(before & after, 0, 1 + before + 2 * after)
        return mode

    def _cached_base(
        self,
        view: CandidateView,
        cache: _ScoreCache,
        shape: tuple,
        cand: np.ndarray,
        slot: np.ndarray,
        gen: np.ndarray,
        rank: np.ndarray,
        mode: np.ndarray,
    ) -> np.ndarray:
        """Per GPU of `cand` (with its node's group slot and generation, its rank and its
        node's host mode): its score as `_score` gives it, from the loss rows kept for the
        request's `shape` (`_shape_of`)."""
        idx = self._row_numbers(view, cache, shape, cand, slot, gen, rank, mode)
        s = view.state
        return self._row_scores(
            view,
            cache,
            idx,
            lambda new: (s.free_core[cand[new]], s.max_slices[cand[new]] - s.slices[cand[new]]),
        )

    def _row_numbers(
        self,
        view: CandidateView,
        cache: _ScoreCache,
        shape: tuple,
        cand: np.ndarray,
        slot: np.ndarray,
        gen: np.ndarray,
        rank: np.ndarray,
        mode: np.ndarray,
    ) -> np.ndarray:
        """The kept rows of `cand` (see `_cached_base`); rows not kept yet are computed
        (one GPU per missing key) and kept."""
        idx = cache.lookup(shape, slot, gen, rank, mode)
        miss = np.flatnonzero(idx < 0)
        if len(miss):
            first: dict[tuple[int, int, int], int] = {}
            keys = zip(mode[miss].tolist(), slot[miss].tolist(), rank[miss].tolist(), strict=True)
            for i, key in zip(miss.tolist(), keys, strict=True):
                first.setdefault(key, i)
            pick = np.fromiter(first.values(), np.int64, len(first))
            rows = self._loss_rows(view, cand[pick], mode[pick])
            cache.store(shape, slot[pick], gen[pick], rank[pick], mode[pick], rows)
            idx = cache.lookup(shape, slot, gen, rank, mode)
        return idx

    def _row_scores(
        self,
        view: CandidateView,
        cache: _ScoreCache,
        idx: np.ndarray,
        gap_of: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]],
    ) -> np.ndarray:
        """Scores of rows `idx`: 0.0 - row . values, plus the gap term as in `_score` (the
        change of the GPU's gap value, kept per row for the prices it was read from;
        `gap_of(positions)` gives the free core and free slices of those rows' GPUs)."""
        lost = cache.rows[idx] @ self.t_values
        out = 0.0 - lost
        if self.gap_weight and view.core < WHOLE_GPU_CORE:
            by_room = self.gap_by_room(view.state)
            gap = cache.gaps(self.prices)[idx]
            new = np.flatnonzero(np.isnan(gap))
            if len(new):
                free, room = gap_of(new)
                room = np.minimum(room, by_room.shape[0] - 1)
                after = by_room[np.maximum(room - 1, 0), free - view.core]
                gap[new] = after - by_room[room, free]
                cache.gap[idx[new]] = gap[new]
            out += self.gap_weight * self.total_weight * gap
        return out

    def _grouped_node_scores(
        self,
        view: CandidateView,
        nodes: np.ndarray,
        at: np.ndarray,
        slots: np.ndarray,
    ) -> np.ndarray | None:
        """`_cached_node_scores` for a request whose candidates are the same on every node
        of a group, where no type asks for host CPU or memory (every node's host mode is 0):
        per (request shape, model constraint, group) its candidate GPUs' row numbers, their
        keep-empty flags, free core and slices, and the node's fill are kept
        (`_ScoreCache.entries`), so a call reads one entry per group of `nodes` (one node of
        each group) and scores their rows together. None: not applicable here."""
        s = view.state
        req = view.request
        if self._live is not None and not view.gpu_mask[s.gpus_of(nodes)[0]].any():
            return None  # no candidate: `_score` would not follow the live slices
        self._start(s)
        if not self._k_core:
            return None
        self._refresh(s)
        if self.host_types:
            return None
        cache = self._cache_for(s)
        cache.make_room()
        groups = s.node_groups()
        shape = _shape_of(view)
        kept = cache.entries
        key = (shape, req.model_names)
        slot_of = slots[nodes]
        names = list(zip(slot_of.tolist(), groups.gen[slot_of].tolist(), strict=True))
        found = [kept.get((key, name)) for name in names]
        if None in found:
            missing = np.asarray([i for i, e in enumerate(found) if e is None], dtype=np.int64)
            for i, entry in zip(
                missing.tolist(),
                self._group_entries(view, cache, shape, nodes[missing]),
                strict=True,
            ):
                found[i] = kept[(key, names[i])] = entry
        sizes = [len(e[0]) for e in found]
        if not sum(sizes):
            return None
        idx = np.concatenate([e[0] for e in found])
        per_gpu = self._row_scores(
            view,
            cache,
            idx,
            lambda new: (
                np.concatenate([e[2] for e in found])[new],
                np.concatenate([e[3] for e in found])[new],
            ),
        )
        # the scores by (slot, rank), for the GPU choice on one of these nodes next
        by_key = {}
        values = per_gpu.tolist()
        at_value = 0
        for (slot, _), entry in zip(names, found, strict=True):
            for r in entry[5]:
                by_key[(slot, r)] = values[at_value]
                at_value += 1
        self._base_memo = (s, (s.version, self._version, shape), by_key)
        shift = self._empty_shift(
            view,
            None,
            per_gpu,
            np.repeat(np.arange(len(sizes)), sizes),
            lambda: np.concatenate([e[1] for e in found]),
        )
        if shift is not None:
            per_gpu = per_gpu.copy()
            per_gpu[shift[1]] -= shift[0] * shift[2]
        self._last_view = view
        self._last_shift = (None if shift is None else shift[0],)
        # each node's best GPU (numpy's maximum, as `_best_per_node`), then the node terms
        # as `node_scores` adds them, in Python floats: a few nodes, the same operations
        starts = list(itertools.accumulate(sizes[:-1], initial=0))
        has = [i for i, size in enumerate(sizes) if size]
        if len(has) == len(sizes):
            best = np.maximum.reduceat(per_gpu, starts).tolist()
        else:
            best = [-np.inf] * len(sizes)
            top = np.maximum.reduceat(per_gpu, [starts[i] for i in has]).tolist()
            for i, value in zip(has, top, strict=True):
                best[i] = value
        host = self._host_term(
            s, nodes, req.core_per_gpu * req.gpu_count, req.cpu_milli, req.host_memory_mib
        ).tolist()
        out = [b + h + _TIE_WEIGHT * e[4] / 2 for b, h, e in zip(best, host, found, strict=True)]
        return np.asarray(out, dtype=np.float64)[at]

    def _group_entries(
        self, view: CandidateView, cache: _ScoreCache, shape: tuple, nodes: np.ndarray
    ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, float, list[int]]]:
        """Per node of `nodes` (each of another group): (its candidate GPUs' row numbers,
        node GPU order; which of them are empty; their free core; their free slices; the
        node's fill, `_fill_of`; their ranks)."""
        s = view.state
        if len(nodes) == 1:  # the node the last pod went to (its new state): its range
            start = int(s.node_start[nodes[0]])
            end = start + int(s.node_gpu_count[nodes[0]])
            cand = np.flatnonzero(view.gpu_mask[start:end]) + start
            owner = np.zeros(len(cand), dtype=np.int64)
        else:
            gpus, _ = s.gpus_of(nodes)
            keep = view.gpu_mask[gpus]
            cand = gpus[keep]
            counts = s.node_gpu_count[nodes]
            owner = np.repeat(np.arange(len(nodes), dtype=np.int64), counts)[keep]
        groups = s.node_groups()
        slot = groups.current()[nodes][owner]
        idx = self._row_numbers(
            view,
            cache,
            shape,
            cand,
            slot,
            groups.gen[slot],
            groups.rank[cand],
            np.zeros(len(cand), dtype=np.int64),
        )
        empty = (s.slices[cand] == 0) & (s.free_core[cand] >= s.cap_core[cand])
        free = s.free_core[cand]
        room = s.max_slices[cand] - s.slices[cand]
        fill = _fill_of(s, nodes).tolist()
        ranks = groups.rank[cand].tolist()
        if len(nodes) == 1:
            return [(idx, empty, free, room, fill[0], ranks)]
        bounds = np.searchsorted(owner, np.arange(len(nodes) + 1)).tolist()
        return [
            (idx[a:b], empty[a:b], free[a:b], room[a:b], fill[i], ranks[a:b])
            for i, (a, b) in enumerate(itertools.pairwise(bounds))
        ]

    def _loss_rows(self, view: CandidateView, gpus: np.ndarray, mode: np.ndarray) -> np.ndarray:
        """Per GPU of `gpus` x type: the copies the request there takes from its node (times
        nothing: the weights come later), host limits as `mode` says (`_node_modes`) --
        `_lost_on_roomy_hosts` (mode 0) and `_full_scores` (1-3) written per type, so that
        a score is 0.0 - row . values. Every entry is a whole number."""
        s = view.state
        req = view.request
        per_gpu, per_node = self._usable_per_gpu(s)
        drop = self._drop(view, gpus, per_gpu)
        n = s.gpu_node[gpus]
        cols = self.whole_cols
        if len(cols):  # whole classes count groups of `count` free GPUs (`_full_scores`)
            free = per_node[:, cols][n]
            drop[:, cols] = self._whole(free, cols) - self._whole(free - drop[:, cols], cols)
        loss = drop[:, self.t_class]
        hard = np.flatnonzero(mode)
        if len(hard):
            nodes = n[hard]
            cpu = s.node_free_cpu[nodes]
            hostmem = s.node_free_hostmem[nodes]
            gpu_before = self._gpu_copies(per_node[nodes])
            host_after = self._host_copies(cpu - req.cpu_milli, hostmem - req.host_memory_mib)
            host_before = self._host_copies(cpu, hostmem)
            rule = mode[hard] - 1
            host_before[(rule & 1) > 0] = _MANY
            host_after[(rule & 2) > 0] = _MANY
            # a type loses d where the host has slack after the request, else only what
            # goes beyond the shortfall (`_full_scores`); and the host's own change
            slack = host_after - gpu_before
            d = loss[hard]
            lost = np.where(slack >= 0, d, np.maximum(slack + d, 0.0))
            lost += np.minimum(gpu_before, host_before).astype(np.float64)
            lost -= np.minimum(gpu_before, host_after).astype(np.float64)
            loss[hard] = lost
        return loss

    def host_scores(self, view: HostView) -> np.ndarray:
        """A host-only workload only changes how many copies of each type a node can feed."""
        s = view.state
        fill = _TIE_WEIGHT * _host_fill(view) / 2
        self._start(s)
        if not self._k_core:
            return fill
        self._refresh(s)
        _, per_node = self._usable_per_gpu(s)
        # score each distinct node state once
        _, reps, inverse = np.unique(
            self._state_keys(s).node_hash[view.node_ids], return_index=True, return_inverse=True
        )
        ids = view.node_ids[reps]
        gpu_copies = self._gpu_copies(per_node[ids])
        cpu = s.node_free_cpu[ids]
        hostmem = s.node_free_hostmem[ids]
        # every type's host bound counts here, even where the host feeds the mix on all its
        # free GPU core (`_feeds_mix`): CPU-only work spends exactly the host, and the bound
        # is what tells a CPU-poor node from a rich one while the mix's average rate is low
        # (a fresh cluster's prior of whole GPUs asks for no CPU)
        before = self._expected_usable(gpu_copies, self._host_copies(cpu, hostmem))
        after = self._expected_usable(
            gpu_copies, self._host_copies(cpu - view.cpu_milli, hostmem - view.host_memory_mib)
        )
        host = self._host_term(s, ids, 0, view.cpu_milli, view.host_memory_mib)
        return (after - before + host)[inverse] + fill


def reprice_threshold(arrived: float) -> float:
    """How far (L1) the mix's proportions must move before frag prices it again:
    `REPRICE_DRIFT`, or while few requests have arrived, their sampling noise
    1 / sqrt(arrivals)."""
    return max(REPRICE_DRIFT, 1.0 / max(arrived, 1.0) ** 0.5)


def _empty_weights(node_of: np.ndarray, empty: np.ndarray) -> np.ndarray:
    """For each empty candidate (`empty`, over candidates on the nodes `node_of` labels): how
    many empty candidates its node has."""
    _, inverse, counts = np.unique(node_of[empty], return_inverse=True, return_counts=True)
    return counts[inverse].astype(np.float64)


def _clamped(values: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """``np.clip(values, lo, hi)`` of integers, as a new int64 array: the same values
    without np.clip's dispatch, which costs ~10 us on the few GPUs of one node."""
    out = values.astype(np.int64)
    np.maximum(out, lo, out=out)
    return np.minimum(out, hi, out=out)


def _best_per_node(state: ClusterState, per_gpu: np.ndarray) -> np.ndarray:
    """Per node the best of its GPUs' scores (-inf for a node without a candidate GPU)."""
    best = np.full(len(state.nodes), -np.inf)
    has = np.flatnonzero(state.node_gpu_count > 0)  # (reduceat cannot take an empty node)
    if len(has):
        best[has] = np.maximum.reduceat(per_gpu, state.node_start[has])
    return best


def _shape_of(view: CandidateView) -> tuple:
    """What of a view's request a GPU's loss row depends on (with its node's and its own
    state): core per GPU, GPU count, the memory it takes per GPU, host CPU and memory."""
    req = view.request
    return (
        view.core,
        req.core_per_gpu,
        req.gpu_count,
        None if req.is_whole_gpu else (req.memory_gib_per_gpu, req.memory_percent),
        req.cpu_milli,
        req.host_memory_mib,
    )


def _scores_of(
    gpu_ids: np.ndarray, cand: np.ndarray, scores: np.ndarray, out: np.ndarray
) -> np.ndarray:
    """`out` with, for each of `gpu_ids` that is in `cand`, its score there."""
    if len(gpu_ids) == len(cand) and gpu_ids.tolist() == cand.tolist():
        return scores  # the usual question: the candidates themselves
    order = np.argsort(cand, kind="stable")
    pos = np.minimum(np.searchsorted(cand[order], gpu_ids), len(cand) - 1)
    found = cand[order][pos] == gpu_ids
    out[found] = scores[order][pos[found]]
    return out


def _one_per_group(
    slots: np.ndarray, nodes: np.ndarray, capacity: int
) -> tuple[np.ndarray, np.ndarray]:
    """(one node of `nodes` per distinct group slot, in slot order; for each of `nodes` the
    position of its group's node in that list). `slots`: each node's slot, below
    `capacity`."""
    present = np.zeros(capacity, dtype=bool)
    present[slots] = True
    used = np.flatnonzero(present)
    member = np.empty(capacity, dtype=np.int64)
    member[slots] = nodes  # some node of each group (which one does not matter)
    position = np.empty(capacity, dtype=np.int64)
    position[used] = np.arange(len(used), dtype=np.int64)
    return member[used], position[slots]


class _ScoreCache:
    """frag's loss rows for one `ClusterState` and one set of request types (see
    `FragPolicy._cached_base`): per request shape and host mode, a table over the node
    groups' slots (`qgpu.node_groups`) and their GPUs' ranks of row numbers, valid for the
    slot's generation it records; and per slot the host CPU and memory its GPUs' copies
    need (`FragPolicy._need_of`). Starts over when it holds `_CACHE_ROWS` rows or group
    entries, or its tables `_CACHE_TABLES` entries."""

    def __init__(self, state: ClusterState, types: tuple[int, int]) -> None:
        self.state = state
        self.types = types
        self.groups = state.node_groups()
        self.width = max(1, int(state.node_gpu_count.max())) if len(state.nodes) else 1
        self.rows = np.zeros((64, types[1]))
        self.count = 0
        # per row its gap term's change of gap value (NaN: not read yet) for `_gap_prices`
        self.gap = np.full(64, np.nan)
        self._gap_prices: object = None
        # (shape, mode) -> (per slot its generation, per slot x rank the row or -1)
        self.tables: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        # ((shape, models), (slot, generation)) -> a group's candidates' rows and more
        # (`FragPolicy._grouped_node_scores`)
        self.entries: dict[tuple, tuple] = {}
        self._need_gen = np.zeros(0, dtype=np.int64)
        self._need = np.zeros((0, 2))

    def gaps(self, prices: object) -> np.ndarray:
        """The rows' gap changes, kept while the prices they were read from are the
        current ones (`FragPolicy.prices`)."""
        if prices is not self._gap_prices:
            self.gap[:] = np.nan
            self._gap_prices = prices
        return self.gap

    def make_room(self) -> None:
        """Start over when full (before a call looks anything up)."""
        table = len(self.groups.gen) * (self.width + 1)  # one table's entries
        if (
            self.count >= _CACHE_ROWS
            or (len(self.tables) + 1) * table > _CACHE_TABLES
            or len(self.entries) >= _CACHE_ROWS
        ):
            self.tables = {}
            self.entries = {}
            self.count = 0

    def _table(self, shape: tuple, mode: int) -> tuple[np.ndarray, np.ndarray]:
        slots = len(self.groups.gen)
        table = self.tables.get((shape, mode))
        if table is None or len(table[0]) < slots:
            gens = np.zeros(slots, dtype=np.int64)  # generations start at 1
            rows = np.full((slots, self.width), -1, dtype=np.int32)
            if table is not None:
                gens[: len(table[0])] = table[0]
                rows[: len(table[0])] = table[1]
            table = self.tables[(shape, mode)] = (gens, rows)
        return table

    def lookup(
        self, shape: tuple, slot: np.ndarray, gen: np.ndarray, rank: np.ndarray, mode: np.ndarray
    ) -> np.ndarray:
        """Per entry the row kept for (shape, mode, slot, gen, rank), -1 where none is."""
        if not mode.any():
            gens, rows = self._table(shape, 0)
            return np.where(gens[slot] == gen, rows[slot, rank], -1)
        out = np.full(len(slot), -1, dtype=np.int64)
        for m in np.unique(mode).tolist():
            at = np.flatnonzero(mode == m)
            gens, rows = self._table(shape, m)
            out[at] = np.where(gens[slot[at]] == gen[at], rows[slot[at], rank[at]], -1)
        return out

    def store(
        self,
        shape: tuple,
        slot: np.ndarray,
        gen: np.ndarray,
        rank: np.ndarray,
        mode: np.ndarray,
        rows: np.ndarray,
    ) -> None:
        """Keep `rows` for these distinct keys (a slot met with a newer generation forgets
        the rows of the old one)."""
        end = self.count + len(rows)
        if end > len(self.rows):
            grown = np.zeros((max(end, 2 * len(self.rows)), self.rows.shape[1]))
            grown[: self.count] = self.rows[: self.count]
            self.rows = grown
            gap = np.full(len(grown), np.nan)
            gap[: self.count] = self.gap[: self.count]
            self.gap = gap
        self.rows[self.count : end] = rows
        self.gap[self.count : end] = np.nan
        numbers = np.arange(self.count, end, dtype=np.int64)
        self.count = end
        for m in np.unique(mode).tolist() if mode.any() else (0,):
            at = np.flatnonzero(mode == m)
            gens, table = self._table(shape, m)
            stale = at[gens[slot[at]] != gen[at]]
            table[slot[stale]] = -1
            gens[slot[stale]] = gen[stale]
            table[slot[at], rank[at]] = numbers[at]

    def need_of(self, slot: np.ndarray, gen: np.ndarray) -> np.ndarray:
        """Per slot the (CPU, memory) need kept for its generation; NaN where none is."""
        self._fit_need()
        need = self._need[slot]
        need[self._need_gen[slot] != gen] = np.nan
        return need

    def set_need(self, slot: np.ndarray, gen: np.ndarray, need: np.ndarray) -> np.ndarray:
        self._fit_need()
        self._need[slot] = need
        self._need_gen[slot] = gen
        return need

    def _fit_need(self) -> None:
        slots = len(self.groups.gen)
        if len(self._need_gen) < slots:
            gens = np.zeros(slots, dtype=np.int64)
            need = np.zeros((slots, 2))
            gens[: len(self._need_gen)] = self._need_gen
            need[: len(self._need)] = self._need
            self._need_gen, self._need = gens, need


def _sum_per_node(state: ClusterState, per_gpu: np.ndarray) -> np.ndarray:
    """Sum rows of a (GPU x class) array per node (GPUs are stored grouped by node)."""
    csum = np.zeros((per_gpu.shape[0] + 1, per_gpu.shape[1]), dtype=np.float64)
    np.cumsum(per_gpu, axis=0, out=csum[1:])
    start = state.node_start
    return csum[start + state.node_gpu_count] - csum[start]


class _Columns:
    """A float table that grows by columns (a class arriving adds one): a buffer with
    spare columns, so that appending does not copy the whole table each time."""

    def __init__(self, table: np.ndarray) -> None:
        self._buf = np.empty((table.shape[0], max(16, 2 * table.shape[1])))
        self._buf[:, : table.shape[1]] = table
        self.table = self._buf[:, : table.shape[1]]

    def append(self, new: np.ndarray) -> np.ndarray:
        """The table with `new`'s columns appended (also as `table`)."""
        have, add = self.table.shape[1], new.shape[1]
        if have + add > self._buf.shape[1]:
            buf = np.empty((self._buf.shape[0], 2 * (have + add)))
            buf[:, :have] = self.table
            self._buf = buf
        self._buf[:, have : have + add] = new
        self.table = self._buf[:, : have + add]
        return self.table


def _mixed(values: np.ndarray) -> np.ndarray:
    """A 64-bit hash of non-negative integers (wrapping arithmetic, splitmix-style)."""
    x = values.astype(np.uint64) * _MIX
    return x ^ (x >> np.uint64(31))


def _gpu_hash(s: ClusterState, gpus: np.ndarray | slice = _ALL) -> np.ndarray:
    """Per GPU (of `gpus`): a key of its state (model, card memory, free core, free memory,
    slice count, slice limit, health)."""
    key = (
        s.free_core[gpus].astype(np.uint64)
        | (s.free_mem[gpus].astype(np.uint64) << np.uint64(8))
        | (s.slices[gpus].astype(np.uint64) << np.uint64(24))
        | (s.max_slices[gpus].astype(np.uint64) << np.uint64(32))
        | (s.healthy[gpus].astype(np.uint64) << np.uint64(40))
        | (s.gpu_model[gpus].astype(np.uint64) << np.uint64(41))
    )
    return key ^ _mixed(s.cap_mem[gpus].astype(np.uint64) + np.uint64(1 << 20))


def _node_hash(s: ClusterState, gpu_key: np.ndarray) -> np.ndarray:
    """Per node: a hash of the multiset of its GPU states and its free host CPU and memory
    (sums wrap modulo 2**64, so a node's sum is the same however it is taken)."""
    h = _mixed(gpu_key)
    csum = np.zeros(len(h) + 1, dtype=np.uint64)
    np.cumsum(h, out=csum[1:])
    node_hash = csum[s.node_start + s.node_gpu_count] - csum[s.node_start]
    return _with_host(s, node_hash, _ALL)


def _with_host(s: ClusterState, gpu_sum: np.ndarray, nodes: np.ndarray | slice) -> np.ndarray:
    gpu_sum ^= _mixed(s.node_free_cpu[nodes].astype(np.uint64) + np.uint64(3))
    gpu_sum += _mixed(_mixed(s.node_free_hostmem[nodes].astype(np.uint64) + np.uint64(7)))
    return gpu_sum


def _full_key(gpu_key: np.ndarray, node_hash_of_gpu: np.ndarray) -> np.ndarray:
    return _mixed(node_hash_of_gpu ^ gpu_key) ^ _mixed(gpu_key)


class _StateKeys:
    """Per GPU its state key, per node its hash, and per GPU the (node, GPU) key that tells
    equal candidates apart, for one `ClusterState`: computed once, then only for the nodes
    whose `node_version` moved.

    Keys are 64-bit hashes: a collision (never seen, ~2**-64 per pair) would only give one
    candidate another's score, never an infeasible placement (the engine filters those)."""

    def __init__(self, s: ClusterState) -> None:
        self.state = s
        self.seen = s.node_version.copy()
        self.gpu_key = _gpu_hash(s)
        self.node_hash = _node_hash(s, self.gpu_key)
        self.key = _full_key(self.gpu_key, self.node_hash[s.gpu_node])

    def update(self) -> None:
        s = self.state
        nodes = np.flatnonzero(s.node_version != self.seen)
        if len(nodes) == 0:
            return
        gpus, offsets = s.gpus_of(nodes)
        self.gpu_key[gpus] = _gpu_hash(s, gpus)
        h = _mixed(self.gpu_key[gpus])
        sums = np.zeros(len(nodes), dtype=np.uint64)
        has = s.node_gpu_count[nodes] > 0  # (reduceat cannot sum an empty node)
        if has.any():
            sums[has] = np.add.reduceat(h, offsets[has])
        self.node_hash[nodes] = _with_host(s, sums, nodes)
        self.key[gpus] = _full_key(self.gpu_key[gpus], self.node_hash[s.gpu_node[gpus]])
        self.seen[nodes] = s.node_version[nodes]

    def distinct(self, cand: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Indices into `cand` of one GPU per distinct (node state, GPU state), lowest
        first; for each candidate the index of its representative; every GPU's state key."""
        _, reps, inverse = np.unique(self.key[cand], return_index=True, return_inverse=True)
        return reps, inverse, self.gpu_key


register_policy(PlacementPolicy.FRAG, FragPolicy)

__all__ = ["FragPolicy"]
