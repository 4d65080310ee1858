"""The placement engine: one engine, pure and deterministic for a given state.

`ClusterState` keeps per-GPU free vectors (numpy arrays, updated incrementally on every
`apply` / `release`) and per-node aggregates, so a decision over 1,000 nodes x 8 GPUs is a
handful of vector operations. `decide()` filters candidate GPUs (health, model constraint,
include/exclude, free core, free memory, slice count, host CPU/memory), picks a node with the
node-level policy and then GPU(s) on it with the GPU-level policy. Host-only workloads (CPU
and memory, no GPU) go through `Engine.place_host` / `ClusterState.apply_host`, so they take
node capacity in the same vectors.

Policies plug in through the `Policy` interface and the `register_policy` registry; policy
names come from `qgpu.model.PlacementPolicy` (the one list of names).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from qgpu.errors import NoFit
from qgpu.model import (
    DEFAULT_PLACEMENT,
    WHOLE_GPU_CORE,
    Allocation,
    GpuDevice,
    NodeInventory,
    PlacementPolicy,
    SliceRequest,
)
from qgpu.node_fit import NodeFit, NodeFitCache
from qgpu.node_groups import NodeGroups

UNLIMITED = np.int64(2**62)


@dataclass(frozen=True)
class Decision:
    """Where a request goes: one node and one GPU (share) or N GPUs (whole cards)."""

    node: str
    gpu_uuids: tuple[str, ...]
    core_per_gpu: int
    memory_gib_per_gpu: tuple[int, ...]


@dataclass
class _Held:
    gpus: np.ndarray  # empty for a host-only placement (no GPU)
    core: int
    memory: np.ndarray
    cpu_milli: int
    host_memory_mib: int
    node: int


HELD_LOG = 4096  # placements and releases a ClusterState remembers (`held_changed_since`)


class ClusterState:
    """Free capacity of a set of nodes, as numpy vectors over all GPUs (grouped by node)."""

    def __init__(self, nodes: Iterable[NodeInventory]) -> None:
        self.nodes: list[NodeInventory] = list(nodes)
        names = [n.name for n in self.nodes]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise ValueError(f"node name {dup!r} appears twice")
        self.node_index = {n.name: i for i, n in enumerate(self.nodes)}
        gpus: list[GpuDevice] = []
        gpu_node: list[int] = []
        max_slices: list[int] = []
        starts: list[int] = []
        for i, node in enumerate(self.nodes):
            starts.append(len(gpus))
            for gpu in node.gpus:
                gpus.append(gpu)
                gpu_node.append(i)
                max_slices.append(gpu.max_slices(node.max_slices_per_gpu, node.fixed_slices))
        self.gpus = gpus
        self.uuid_index = {g.uuid: i for i, g in enumerate(gpus)}
        if len(self.uuid_index) != len(gpus):
            raise ValueError("a GPU UUID appears on two nodes")
        n_gpu = len(gpus)
        self.gpu_node = np.asarray(gpu_node, dtype=np.int32)
        self.node_start = np.asarray(starts, dtype=np.int64)
        self.node_gpu_count = np.asarray([len(n.gpus) for n in self.nodes], dtype=np.int64)
        counts = set(self.node_gpu_count.tolist())
        # the GPU count of every node where all have the same (and some), else 0
        self._gpus_per_node = counts.pop() if len(counts) == 1 else 0
        self.cap_core = np.full(n_gpu, WHOLE_GPU_CORE, dtype=np.int32)
        self.free_core = self.cap_core.copy()
        self.cap_mem = np.asarray([g.memory_gib for g in gpus], dtype=np.int32)
        self.free_mem = self.cap_mem.copy()
        self.slices = np.zeros(n_gpu, dtype=np.int32)
        self.max_slices = np.asarray(max_slices, dtype=np.int32)
        self.healthy = np.asarray([g.healthy for g in gpus], dtype=bool)
        self.numa = np.asarray(
            [-1 if g.numa_node is None else g.numa_node for g in gpus], dtype=np.int32
        )
        self.model_names = sorted({g.model for g in gpus})
        model_id = {m: i for i, m in enumerate(self.model_names)}
        self.gpu_model = np.asarray([model_id[g.model] for g in gpus], dtype=np.int32)
        self.node_cap_cpu = np.asarray(
            [UNLIMITED if n.cpu_milli is None else n.cpu_milli for n in self.nodes],
            dtype=np.int64,
        )
        self.node_cap_hostmem = np.asarray(
            [UNLIMITED if n.memory_mib is None else n.memory_mib for n in self.nodes],
            dtype=np.int64,
        )
        self.node_free_cpu = self.node_cap_cpu.copy()
        self.node_free_hostmem = self.node_cap_hostmem.copy()
        self.node_cap_core = self.node_gpu_count * WHOLE_GPU_CORE
        self.node_free_core = self.node_cap_core.copy()
        self.node_cap_mem = np.zeros(len(self.nodes), dtype=np.int64)
        np.add.at(self.node_cap_mem, self.gpu_node, self.cap_mem)
        self.node_free_mem = self.node_cap_mem.copy()
        self.held: dict[str, _Held] = {}
        self._model_mask_cache: dict[tuple[str, ...], np.ndarray] = {}
        # bumped by every change of the free vectors, slice counts or health: what a policy
        # or the engine computed from the state stays valid while it is unchanged. Code that
        # writes the vectors directly (not through apply/release) calls `touch()`.
        self.version = 0
        # per node, the `version` at which that node last changed (what is cached per node
        # stays valid while its entry is unchanged)
        self.node_version = np.zeros(len(self.nodes), dtype=np.int64)
        # (version, slice id) of the latest placements and releases (`held_changed_since`)
        self._held_log: deque[tuple[int, str]] = deque(maxlen=HELD_LOG)
        self._node_groups: NodeGroups | None = None

    def node_groups(self) -> NodeGroups:
        """The nodes grouped by exact state (`qgpu.node_groups`), made on first use and
        shared by everyone who scores over this state; call its `current()` for the groups
        as the state is now."""
        if self._node_groups is None:
            self._node_groups = NodeGroups(self)
        return self._node_groups

    def held_changed_since(self, version: int) -> set[str] | None:
        """The ids placed or released since `version` (what a policy that follows `held`
        must look at again), or None when that is further back than the log keeps."""
        log = self._held_log
        if len(log) == log.maxlen and log[0][0] > version + 1:
            return None
        out = set()
        for v, sid in reversed(log):
            if v <= version:
                break
            out.add(sid)
        return out

    def touch(self) -> None:
        """Record a change made to the vectors directly (see `version`): every node."""
        self.version += 1
        self.node_version[:] = self.version

    # -- bookkeeping -------------------------------------------------------------------

    @property
    def gpu_total(self) -> int:
        return len(self.gpus)

    def gpus_of(self, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(the GPU indices of these nodes, node after node; where each node's GPUs start
        in that array)."""
        if self._gpus_per_node:  # every node has as many GPUs: no counting
            each = self._gpus_per_node
            gpus = self.node_start[nodes][:, None] + np.arange(each, dtype=np.int64)
            return gpus.reshape(-1), np.arange(0, each * len(nodes), each, dtype=np.int64)
        counts = self.node_gpu_count[nodes]
        offsets = np.zeros(len(counts), dtype=np.int64)
        np.cumsum(counts[:-1], out=offsets[1:])
        gpus = np.repeat(self.node_start[nodes] - offsets, counts) + np.arange(int(counts.sum()))
        return gpus, offsets

    def model_mask(self, names: tuple[str, ...]) -> np.ndarray | None:
        """Boolean mask of GPUs whose model matches the constraint (None = any)."""
        if not names:
            return None
        cached = self._model_mask_cache.get(names)
        if cached is None:
            probe = [
                GpuDevice(uuid="probe", index=0, model=m, memory_mib=1).matches_model(names)
                for m in self.model_names
            ]
            allowed = np.asarray(probe, dtype=bool)
            cached = allowed[self.gpu_model] if len(self.gpus) else np.zeros(0, dtype=bool)
            self._model_mask_cache[names] = cached
        return cached

    def apply(
        self,
        slice_id: str,
        gpu_ids: Iterable[int],
        core_per_gpu: int,
        memory_per_gpu: Iterable[int],
        cpu_milli: int = 0,
        host_memory_mib: int = 0,
    ) -> None:
        """Record a placed slice; raises ValueError if it would over-commit anything."""
        if slice_id in self.held:
            raise ValueError(f"slice {slice_id!r} is already placed")
        idx = np.asarray(list(gpu_ids), dtype=np.int64)
        mem = np.asarray(list(memory_per_gpu), dtype=np.int32)
        if len(idx) == 0 or len(idx) != len(mem) or len(set(idx.tolist())) != len(idx):
            raise ValueError("a slice needs distinct GPUs, one memory amount per GPU")
        nodes = set(self.gpu_node[idx].tolist())
        if len(nodes) != 1:
            raise ValueError("all GPUs of a slice must be on one node")
        node = nodes.pop()
        if np.any(self.free_core[idx] < core_per_gpu) or np.any(self.free_mem[idx] < mem):
            raise ValueError(f"slice {slice_id!r} would over-commit a GPU")
        if np.any(self.slices[idx] >= self.max_slices[idx]):
            raise ValueError(f"slice {slice_id!r} would exceed a GPU's slice limit")
        if self.node_free_cpu[node] < cpu_milli or self.node_free_hostmem[node] < host_memory_mib:
            raise ValueError(f"slice {slice_id!r} would over-commit the node's CPU or memory")
        self.version += 1
        self.node_version[node] = self.version
        self.free_core[idx] -= core_per_gpu
        self.free_mem[idx] -= mem
        self.slices[idx] += 1
        self.node_free_core[node] -= core_per_gpu * len(idx)
        self.node_free_mem[node] -= int(mem.sum())
        self.node_free_cpu[node] -= cpu_milli
        self.node_free_hostmem[node] -= host_memory_mib
        self.held[slice_id] = _Held(idx, core_per_gpu, mem, cpu_milli, host_memory_mib, node)
        self._held_log.append((self.version, slice_id))

    def apply_host(
        self, slice_id: str, node: int | str, cpu_milli: int, host_memory_mib: int
    ) -> None:
        """Record a host-only placement (CPU and memory on a node, no GPU).

        Workloads without a GPU share the nodes with slices (the trace replay's CPU-only
        pods); they take node CPU and memory, so they change what fits. Released with
        `release` like any slice; raises ValueError if it would over-commit the node.
        """
        if slice_id in self.held:
            raise ValueError(f"slice {slice_id!r} is already placed")
        n = self.node_index[node] if isinstance(node, str) else int(node)
        if cpu_milli < 0 or host_memory_mib < 0:
            raise ValueError("host CPU and memory must be >= 0")
        if self.node_free_cpu[n] < cpu_milli or self.node_free_hostmem[n] < host_memory_mib:
            raise ValueError(f"{slice_id!r} would over-commit the node's CPU or memory")
        self.version += 1
        self.node_version[n] = self.version
        self.node_free_cpu[n] -= cpu_milli
        self.node_free_hostmem[n] -= host_memory_mib
        empty = np.zeros(0, dtype=np.int64)
        self.held[slice_id] = _Held(
            empty, 0, np.zeros(0, dtype=np.int32), cpu_milli, host_memory_mib, n
        )
        self._held_log.append((self.version, slice_id))

    def apply_allocation(self, alloc: Allocation, cpu_milli: int = 0, host_mib: int = 0) -> None:
        ids = [self.uuid_index[u] for u in alloc.gpu_uuids]
        self.apply(
            alloc.slice_id, ids, alloc.core, [alloc.memory_gib] * len(ids), cpu_milli, host_mib
        )

    def apply_decision(self, slice_id: str, decision: Decision, req: SliceRequest) -> None:
        ids = [self.uuid_index[u] for u in decision.gpu_uuids]
        self.apply(
            slice_id,
            ids,
            decision.core_per_gpu,
            decision.memory_gib_per_gpu,
            req.cpu_milli,
            req.host_memory_mib,
        )

    def release(self, slice_id: str) -> bool:
        """Forget a slice; False when it was not placed (release is idempotent)."""
        held = self.held.pop(slice_id, None)
        if held is None:
            return False
        idx = held.gpus
        node = held.node
        self.version += 1
        self.node_version[node] = self.version
        self.free_core[idx] += held.core
        self.free_mem[idx] += held.memory
        self.slices[idx] -= 1
        self.node_free_core[node] += held.core * len(idx)
        self.node_free_mem[node] += int(held.memory.sum())
        self.node_free_cpu[node] += held.cpu_milli
        self.node_free_hostmem[node] += held.host_memory_mib
        self._held_log.append((self.version, slice_id))
        return True

    def check_invariants(self) -> None:
        """Assert free vectors equal capacity minus live slices (used by tests)."""
        core = self.cap_core.copy()
        mem = self.cap_mem.copy()
        slices = np.zeros_like(self.slices)
        for held in self.held.values():
            core[held.gpus] -= held.core
            mem[held.gpus] -= held.memory
            slices[held.gpus] += 1
        assert np.array_equal(core, self.free_core), "free core drifted"
        assert np.array_equal(mem, self.free_mem), "free memory drifted"
        assert np.array_equal(slices, self.slices), "slice counts drifted"
        assert np.all(self.free_core >= 0) and np.all(self.free_mem >= 0), "over-committed"
        assert np.all(self.slices <= self.max_slices), "too many slices on a GPU"
        node_core = np.zeros(len(self.nodes), dtype=np.int64)
        np.add.at(node_core, self.gpu_node, self.free_core)
        assert np.array_equal(node_core, self.node_free_core), "node core drifted"
        cpu = self.node_cap_cpu.copy()
        hostmem = self.node_cap_hostmem.copy()
        for held in self.held.values():
            cpu[held.node] -= held.cpu_milli
            hostmem[held.node] -= held.host_memory_mib
        assert np.array_equal(cpu, self.node_free_cpu), "node CPU drifted"
        assert np.array_equal(hostmem, self.node_free_hostmem), "node memory drifted"
        assert np.all(self.node_free_cpu >= 0), "node CPU over-committed"
        assert np.all(self.node_free_hostmem >= 0), "node memory over-committed"


@dataclass
class CandidateView:
    """What a policy sees while scoring: the state, the request and the fitting GPUs."""

    state: ClusterState
    request: SliceRequest
    gpu_mask: np.ndarray
    core: int
    memory: np.ndarray  # memory each GPU would give (GiB), per GPU
    node_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))


@dataclass
class HostView:
    """What a policy sees while placing a host-only workload (CPU and memory, no GPU)."""

    state: ClusterState
    cpu_milli: int
    host_memory_mib: int
    node_ids: np.ndarray


class Policy(ABC):
    """A placement policy: scores nodes and GPUs, higher is better; ties go to lower index.

    `node_scores` may look at `view.gpu_mask` (the GPUs that fit) to score a node by its
    best GPU, as the fragmentation-aware policy does; `gpu_scores` is then called with the
    same view for the chosen node. When only one node can take the request, `decide` does
    not call `node_scores` at all: `gpu_scores` must not depend on it having run.
    """

    name: str

    @abstractmethod
    def node_scores(self, view: CandidateView) -> np.ndarray:
        """One score per node in `view.node_ids`."""

    @abstractmethod
    def gpu_scores(self, view: CandidateView, gpu_ids: np.ndarray) -> np.ndarray:
        """One score per GPU in `gpu_ids` (all on one node, all fitting)."""

    def observe(self, request: SliceRequest) -> None:  # noqa: B027 - optional hook
        """See a request arrive (policies that learn the request mix override this)."""

    def prepare(self, state: ClusterState) -> None:  # noqa: B027 - optional hook
        """Do, when an engine is made over `state`, the one-time work the first decision
        would otherwise pay for (imports, tables); must not change any decision."""

    def host_scores(self, view: HostView) -> np.ndarray:
        """One score per node in `view.node_ids` for a host-only workload.

        The default fills the fullest node first (by host CPU and memory in use).
        """
        return _host_fill(view)


def _leftover(view: CandidateView, gpu_ids: np.ndarray) -> np.ndarray:
    s = view.state
    core_left = (s.free_core[gpu_ids] - view.core) / WHOLE_GPU_CORE
    mem_left = (s.free_mem[gpu_ids] - view.memory[gpu_ids]) / np.maximum(s.cap_mem[gpu_ids], 1)
    return core_left + mem_left


def _node_fill(view: CandidateView) -> np.ndarray:
    return _fill_of(view.state, view.node_ids)


def _fill_of(s: ClusterState, ids: np.ndarray) -> np.ndarray:
    """Per node `ids`: the share of its GPU core and GPU memory in use (binpack's score)."""
    used_core = 1.0 - s.node_free_core[ids] / np.maximum(s.node_cap_core[ids], 1)
    used_mem = 1.0 - s.node_free_mem[ids] / np.maximum(s.node_cap_mem[ids], 1)
    return used_core + used_mem


def _host_fill(view: HostView) -> np.ndarray:
    s = view.state
    ids = view.node_ids
    cap_cpu = s.node_cap_cpu[ids].astype(np.float64)
    cap_mem = s.node_cap_hostmem[ids].astype(np.float64)
    used_cpu = 1.0 - s.node_free_cpu[ids] / np.maximum(cap_cpu, 1.0)
    used_mem = 1.0 - s.node_free_hostmem[ids] / np.maximum(cap_mem, 1.0)
    return used_cpu + used_mem


class BinpackPolicy(Policy):
    """Fill the fullest node and the fullest fitting GPU first (best fit)."""

    name = PlacementPolicy.BINPACK.value

    def node_scores(self, view: CandidateView) -> np.ndarray:
        return _node_fill(view)

    def gpu_scores(self, view: CandidateView, gpu_ids: np.ndarray) -> np.ndarray:
        return -_leftover(view, gpu_ids)


class SpreadPolicy(Policy):
    """Use the emptiest node and the emptiest GPU first (worst fit)."""

    name = PlacementPolicy.SPREAD.value

    def node_scores(self, view: CandidateView) -> np.ndarray:
        return -_node_fill(view)

    def host_scores(self, view: HostView) -> np.ndarray:
        return -_host_fill(view)

    def gpu_scores(self, view: CandidateView, gpu_ids: np.ndarray) -> np.ndarray:
        return _leftover(view, gpu_ids)


_REGISTRY: dict[str, Callable[[], Policy]] = {
    PlacementPolicy.BINPACK.value: BinpackPolicy,
    PlacementPolicy.SPREAD.value: SpreadPolicy,
}


def register_policy(name: PlacementPolicy | str, factory: Callable[[], Policy]) -> None:
    """Plug a policy in under a name that `qgpu.model.PlacementPolicy` defines."""
    _REGISTRY[PlacementPolicy.parse(name).value] = factory


def make_policy(name: PlacementPolicy | str | None) -> Policy:
    """A fresh policy object for a validated policy name (None = the cluster default)."""
    policy = PlacementPolicy.parse(name) if name is not None else DEFAULT_PLACEMENT
    return _REGISTRY[policy.value]()


# Reasons, in the order they are checked; counts of GPUs (or nodes) ruled out by each.
REASONS = (
    "unhealthy",
    "model",
    "excluded",
    "slice limit",
    "core",
    "memory",
    "not empty (whole GPU)",
)


class Engine:
    """Decides placements over a ClusterState with a node-level and a GPU-level policy."""

    def __init__(
        self,
        state: ClusterState,
        node_policy: Policy | PlacementPolicy | str | None = None,
        gpu_policy: Policy | PlacementPolicy | str | None = None,
    ) -> None:
        self.state = state
        self.node_policy = (
            node_policy if isinstance(node_policy, Policy) else make_policy(node_policy)
        )
        if gpu_policy is None:
            self.gpu_policy = self.node_policy
        elif isinstance(gpu_policy, Policy):
            self.gpu_policy = gpu_policy
        else:
            self.gpu_policy = make_policy(gpu_policy)
        self._per_request: dict[str, Policy] = {}
        # the last `candidates` answer: (request object, state version, mask, memory); the
        # extender asks again for the same pod's request between its filter and prioritize
        self._candidates_memo: tuple[SliceRequest, int, np.ndarray, np.ndarray] | None = None
        self._node_fit = NodeFitCache(state, self.shortfall)
        self.node_policy.prepare(state)
        if self.gpu_policy is not self.node_policy:
            self.gpu_policy.prepare(state)

    def node_policy_for(self, req: SliceRequest) -> Policy:
        """The node-level policy that decides `req` (its own ``placement``, or the engine's)."""
        return self._policy_for(req.placement, self.node_policy)

    def _policy_for(self, name: PlacementPolicy | None, default: Policy) -> Policy:
        if name is None or name.value == default.name:
            return default
        if name.value not in self._per_request:
            self._per_request[name.value] = make_policy(name)
        return self._per_request[name.value]

    def _checks(
        self, req: SliceRequest, gpus: np.ndarray | slice | None = None
    ) -> Iterator[tuple[str, np.ndarray]]:
        """The per-GPU rules a request must pass, in order: (reason name, GPUs that pass),
        over every GPU, or over `gpus` (indices, or a range of them) only."""
        s = self.state
        sub = slice(None) if gpus is None else gpus
        few = range(gpus.start, gpus.stop) if isinstance(gpus, slice) else gpus
        yield "unhealthy", s.healthy[sub]
        model = s.model_mask(req.model_names)
        if model is not None:
            yield "model", model[sub]
        for name, uuids, allowed in (
            ("excluded", req.include_uuids, True),
            ("excluded", req.exclude_uuids, False),
        ):
            if uuids:
                listed = [s.uuid_index[u] for u in uuids if u in s.uuid_index]
                if few is not None and len(few) <= 64:  # a few GPUs: no cluster-wide array
                    marked = set(listed)
                    yield (
                        name,
                        np.fromiter(((int(g) in marked) == allowed for g in few), bool, len(few)),
                    )
                    continue
                keep = np.full(s.gpu_total, not allowed, dtype=bool)
                keep[listed] = allowed
                yield name, keep[sub]
        if req.is_whole_gpu:
            yield "memory", s.cap_mem[sub] >= (req.memory_gib or 0)
            yield (
                "not empty (whole GPU)",
                (s.slices[sub] == 0) & (s.free_core[sub] == s.cap_core[sub]),
            )
        else:
            yield "slice limit", s.slices[sub] < s.max_slices[sub]
            yield "core", s.free_core[sub] >= req.core_per_gpu
            if req.memory_percent is None:
                yield "memory", s.free_mem[sub] >= req.memory_gib_per_gpu
            else:  # a percentage of each card: at least 1 GiB of it, and that much free
                need = s.cap_mem[sub] * req.memory_percent // 100
                yield "memory", (need >= 1) & (s.free_mem[sub] >= need)

    def candidates(
        self, req: SliceRequest, explain: bool = True
    ) -> tuple[np.ndarray, np.ndarray, dict[str, int]]:
        """(fitting-GPU mask, memory each GPU would give, GPUs ruled out per reason); the
        reasons are left empty with ``explain=False`` (callers that only need the mask)."""
        s = self.state
        n = s.gpu_total
        memo = self._candidates_memo
        if not explain and memo is not None and memo[0] is req and memo[1] == s.version:
            return memo[2], memo[3], {}  # the same request object, nothing changed since
        reasons: dict[str, int] = {}
        if req.include_uuids and not explain:
            # a request pinned to a few GPUs (one node's, when the extender places a pod on
            # the node kube-scheduler chose): the rules run over those GPUs only
            ok = np.zeros(n, dtype=bool)
            pinned = np.fromiter(
                {s.uuid_index[u] for u in req.include_uuids if u in s.uuid_index}, np.int64
            )
            if len(pinned):
                keep_pinned = np.ones(len(pinned), dtype=bool)
                for _name, keep in self._checks(req, pinned):
                    keep_pinned &= keep
                ok[pinned] = keep_pinned
        else:
            ok = np.ones(n, dtype=bool)
            for name, keep in self._checks(req):
                if explain:
                    dropped = int(np.count_nonzero(ok & ~keep))
                    if dropped:
                        reasons[name] = reasons.get(name, 0) + dropped
                ok &= keep
        if req.is_whole_gpu:
            memory = s.cap_mem
        elif req.memory_percent is not None:
            memory = (s.cap_mem * req.memory_percent // 100).astype(np.int32)
        else:
            memory = np.full(n, req.memory_gib_per_gpu, dtype=np.int32)
        ok.flags.writeable = False  # shared with later callers through the memo
        if memory is not s.cap_mem:
            memory.flags.writeable = False
        self._candidates_memo = (req, s.version, ok, memory)
        return ok, memory, reasons

    def node_fit(self, req: SliceRequest) -> NodeFit:
        """Per node: can it take `req` (enough GPUs pass every rule), and if not, the first
        rule that leaves it short -- `shortfall` over every node, answered from what was
        computed for the same request shape on the nodes that have not changed since."""
        if self._node_fit.state is not self.state:
            self._node_fit = NodeFitCache(self.state, self.shortfall)
        return self._node_fit.get(req, self.state.node_version)

    def shortfall(self, req: SliceRequest, nodes: np.ndarray) -> list[str | None]:
        """Per node (indices): the first rule (a `candidates` reason name) after which the
        node has fewer fitting GPUs than the request needs, ``"GPU count"`` for a node that
        has fewer GPUs than that at all; None where it has enough."""
        s = self.state
        need = req.gpu_count
        nodes = np.asarray(nodes, dtype=np.int64)
        has_enough = s.node_gpu_count[nodes] >= need
        open_ = nodes[has_enough]  # the others lack GPUs at all
        if len(open_) == 0:
            return ["GPU count"] * len(nodes)
        # A node runs short at the rule where fewer than `need` of its GPUs are left: the
        # need-th highest of its GPUs' first failing rules (all passed: it fits).
        if len(open_) == 1:  # one node (what changed since the last pod): its GPUs' range
            start, count = int(s.node_start[open_[0]]), int(s.node_gpu_count[open_[0]])
            names, first_fail = self._first_failures(req, slice(start, start + count))
            short_at = np.sort(first_fail)[count - need : count - need + 1]
        else:  # the open nodes' GPUs, node after node: only those are looked at
            counts = s.node_gpu_count[open_]
            gpus, offsets = s.gpus_of(open_)
            names, first_fail = self._first_failures(req, gpus)
            if need == 1:
                short_at = np.maximum.reduceat(first_fail, offsets)
            else:
                order = np.lexsort((-first_fail, np.repeat(np.arange(len(open_)), counts)))
                short_at = first_fail[order][offsets + need - 1]
        if len(open_) == len(nodes):
            return names[short_at].tolist()
        out = np.full(len(nodes), "GPU count", dtype=object)
        out[has_enough] = names[short_at]
        return out.tolist()

    def _first_failures(
        self, req: SliceRequest, gpus: np.ndarray | slice
    ) -> tuple[np.ndarray, np.ndarray]:
        """(the rule names, then None; per GPU of `gpus` the index of the first rule it
        fails, or of that None when it passes them all)."""
        rules = list(self._checks(req, gpus))
        first_fail = np.full(len(rules[0][1]), len(rules), dtype=np.int16)
        for r in range(len(rules) - 1, -1, -1):
            first_fail[~rules[r][1]] = r
        names = np.asarray([name for name, _ in rules] + [None], dtype=object)
        return names, first_fail

    def decide(self, req: SliceRequest) -> Decision:
        """Choose where `req` goes; raise NoFit (with reasons) when nothing fits."""
        s = self.state
        if s.gpu_total == 0:
            raise NoFit("no GPUs in the cluster", {})
        node_policy = self.node_policy_for(req)
        gpu_policy = self._policy_for(req.gpu_placement or req.placement, self.gpu_policy)
        mask, memory, _ = self.candidates(req, explain=False)
        per_node = np.bincount(s.gpu_node[mask], minlength=len(s.nodes))
        node_ok = per_node >= req.gpu_count
        host_ok = (s.node_free_cpu >= req.cpu_milli) & (s.node_free_hostmem >= req.host_memory_mib)
        node_ids = np.flatnonzero(node_ok & host_ok)
        if len(node_ids) == 0:  # only now are the reasons counted
            _, _, reasons = self.candidates(req)
            short = int(np.count_nonzero((per_node > 0) & ~node_ok))
            if short:
                reasons[f"fewer than {req.gpu_count} fitting GPUs on one node"] = short
            host_short = int(np.count_nonzero(node_ok & ~host_ok))
            if host_short:
                reasons["host CPU or memory (nodes)"] = host_short
            raise NoFit(_no_fit_message(req, reasons), reasons)
        view = CandidateView(s, req, mask, req.core_per_gpu, memory, node_ids)
        if len(node_ids) == 1:  # one node can take it (a request pinned to a node's GPUs,
            node = int(node_ids[0])  # as the extender places a pod): nothing to rank
        else:
            node = int(node_ids[int(np.argmax(node_policy.node_scores(view)))])
        start = int(s.node_start[node])
        local = np.flatnonzero(mask[start : start + int(s.node_gpu_count[node])]) + start
        scores = gpu_policy.gpu_scores(view, local)
        chosen = _pick_gpus(s, local, scores, req.gpu_count)
        return Decision(
            node=s.nodes[node].name,
            gpu_uuids=tuple(s.gpus[i].uuid for i in chosen),
            core_per_gpu=req.core_per_gpu,
            memory_gib_per_gpu=tuple(int(memory[i]) for i in chosen),
        )

    def decide_host(
        self, cpu_milli: int, host_memory_mib: int, placement: PlacementPolicy | None = None
    ) -> str:
        """Choose a node for a host-only workload (no GPU); raise NoFit when none has room.

        Scored by the node-level policy's `host_scores` (or `placement`'s, when given).
        """
        s = self.state
        policy = self._policy_for(placement, self.node_policy)
        ok = (s.node_free_cpu >= cpu_milli) & (s.node_free_hostmem >= host_memory_mib)
        node_ids = np.flatnonzero(ok)
        if len(node_ids) == 0:
            raise NoFit(
                f"no node has {cpu_milli} mCPU and {host_memory_mib} MiB free",
                {"host CPU or memory (nodes)": len(s.nodes)},
            )
        scores = policy.host_scores(HostView(s, cpu_milli, host_memory_mib, node_ids))
        return s.nodes[int(node_ids[int(np.argmax(scores))])].name

    def place_host(
        self,
        slice_id: str,
        cpu_milli: int,
        host_memory_mib: int,
        placement: PlacementPolicy | None = None,
    ) -> str:
        """Decide and apply a host-only workload; returns the node's name."""
        node = self.decide_host(cpu_milli, host_memory_mib, placement)
        self.state.apply_host(slice_id, node, cpu_milli, host_memory_mib)
        return node

    def observe(self, req: SliceRequest) -> None:
        """Tell the policies a request arrived (before deciding it)."""
        self.node_policy.observe(req)
        if self.gpu_policy is not self.node_policy:
            self.gpu_policy.observe(req)
        for extra in self._per_request.values():
            extra.observe(req)

    def place(self, slice_id: str, req: SliceRequest, observe: bool = True) -> Decision:
        """Observe, decide and apply in one step (the usual path). ``observe=False`` for a
        caller that counts arrivals itself (the extender counts each pod once, when it first
        sees it, however many times it is placed)."""
        if observe:
            self.observe(req)
        decision = self.decide(req)
        s = self.state
        ids = [s.uuid_index[u] for u in decision.gpu_uuids]
        s.apply(
            slice_id,
            ids,
            decision.core_per_gpu,
            decision.memory_gib_per_gpu,
            req.cpu_milli,
            req.host_memory_mib,
        )
        return decision


def _pick_gpus(s: ClusterState, local: np.ndarray, scores: np.ndarray, count: int) -> list[int]:
    """Best-scored GPUs; for several GPUs prefer one NUMA node that can hold them all."""
    order = np.lexsort((local, -scores))  # score desc, then index asc
    ranked = local[order]
    if count == 1:
        return [int(ranked[0])]
    numa = s.numa[ranked]
    groups = {int(g): int(np.count_nonzero(numa == g)) for g in np.unique(numa) if g >= 0}
    fitting = sorted((size, g) for g, size in groups.items() if size >= count)
    if fitting:
        group = fitting[0][1]  # the smallest NUMA group that fits keeps larger ones whole
        ranked = ranked[numa == group]
    return sorted(int(i) for i in ranked[:count])


def describe_share(req: SliceRequest) -> str:
    """A share in the words of its resources, per GPU for a multi-GPU share."""
    memory = (
        f"qgpu-memory-percentage={req.memory_percent}"
        if req.memory_percent is not None
        else f"qgpu-memory={req.memory_gib}"
    )
    if req.is_multi_gpu_share:
        per = (
            f"{req.memory_percent}% of each card"
            if req.memory_percent is not None
            else f"{req.memory_gib_per_gpu} GiB"
        )
        return (
            f"qgpu-core={req.core} {memory} ({req.gpu_count} GPUs of one node, each "
            f"{req.core_per_gpu} core and {per})"
        )
    return f"qgpu-core={req.core} {memory}"


def _no_fit_message(req: SliceRequest, reasons: dict[str, int]) -> str:
    what = f"{req.gpu_count} whole GPU(s)" if req.is_whole_gpu else describe_share(req)
    if not reasons:
        return f"no GPU can take {what}"
    detail = ", ".join(f"{k}: {v}" for k, v in reasons.items())
    return f"no GPU can take {what} ({detail})"


# The fragmentation-aware policy lives in its own module and registers itself on import;
# importing it here means every entry point that can make a policy knows "frag".
from qgpu import frag as _frag  # noqa: E402, F401
