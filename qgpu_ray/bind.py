"""Binding a Ray worker to its slice, in the worker, before CUDA starts.

Three kinds of work bind in the worker (`qgpu_ray.hook` calls `bind` when Ray starts the
task or actor, and again, as a backstop, at the worker's first CUDA call):

- plain resources, ``@ray.remote(resources={"qgpu-core": 30, "qgpu-memory": 8})``: Ray
  reserved the node totals only; the GPU is decided here with the core placement engine
  (policy ``QGPU_RAY_POLICY``, default binpack) over Ray's live per-GPU availability;
- the SDK's resource-only form (``qgpu_ray.options(..., via="resources")``, the default on
  qgpu nodes): the GPU is named by the per-GPU resources Ray already holds for the worker;
- unchanged ``num_gpus=f``: Ray chose the GPU (its ids are the GPUs' UUIDs on a qgpu
  node); the slice is `qgpu_ray.fraction`'s rule on that GPU.

Plain and ``num_gpus`` work then reserves its GPU's per-GPU resources (``qgpu-core/<uuid>``,
``qgpu-memory/<uuid>``, ``qgpu-slots/<uuid>``) with a small "holder" placement group named
``qgpu-hold:<slice>:<node>:<pid>:<start>``; ``num_gpus`` holders also take the node totals.
So every user of a GPU — SDK, plain, ``num_gpus`` — is booked in ONE ledger, that GPU's
per-GPU resources, which Ray keeps atomically: no path can over-commit another. Ray's own
``GPU`` count sees only ``num_gpus`` users, so when the GPU Ray chose is held by qgpu slices
the worker takes another GPU of its node that has room (its GPU ids follow), or waits for
room (``QGPU_RAY_WAIT_S``, default 60 s) and then fails with a message that says why.

Finally the device (``CUDA_VISIBLE_DEVICES``) and the caps go into the process environment,
where the interposer reads them at ``cuInit``, and the slice is recorded with the node
agent. Holder groups of exited workers and dead nodes are removed by `qgpu_ray.reaper`.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from qgpu.errors import NoFit, RuleViolation
from qgpu.model import Allocation, IsolationPolicy, NodeInventory, PlacementPolicy, SliceRequest
from qgpu_ray import agent_link
from qgpu_ray.env import slice_env
from qgpu_ray.fraction import FractionRule, FractionSlice, fraction_slice, whole_gpus
from qgpu_ray.hook import GPU, ray_gpu_ids
from qgpu_ray.resources import (
    FRACTION_ENV,
    ISOLATION_PREFIX,
    LABEL_ISOLATION,
    NODE_ENV,
    POLICY_ENV,
    SLOTS,
    TOTAL_CORE,
    TOTAL_MEMORY,
    gpu_resource,
    parse_gpu_resource,
)
from qgpu_ray.view import RayNode, available_flat, live_state, ray_nodes

HOLD_PREFIX = "qgpu-hold"
WAIT_ENV = "QGPU_RAY_WAIT_S"
DEFAULT_WAIT_S = 60.0
HOLD_TIMEOUT_S = 2.0  # a holder that fits is placed in ~10 ms; one that lost a race waits
ATTEMPTS = 5

_lock = threading.RLock()


class FragmentedError(RuntimeError):
    """The node has the capacity in total but no single GPU that can take the slice."""


class GpuBusyError(FragmentedError):
    """A ``num_gpus`` worker found no GPU of its node with room within its wait."""


@dataclass(frozen=True)
class Binding:
    allocation: Allocation
    env: dict[str, str]
    holder_name: str
    path: str


_binding: Binding | None = None
_last_error: str | None = None
_recorded = False
_waited = False  # a num_gpus bind already waited its time in this process
# seconds this worker spent in each step of binding, wall clock and CPU of the binding
# thread (read by bench/ray_overhead.py --breakdown)
PHASES: dict[str, float] = {}
PHASES_CPU: dict[str, float] = {}


@contextmanager
def _phase(name: str) -> Iterator[None]:
    start, cpu = time.perf_counter(), time.thread_time()
    try:
        yield
    finally:
        PHASES[name] = PHASES.get(name, 0.0) + time.perf_counter() - start
        PHASES_CPU[name] = PHASES_CPU.get(name, 0.0) + time.thread_time() - cpu


def holder_name(slice_id: str, node_id: str, pid: int, start_time: int) -> str:
    return f"{HOLD_PREFIX}:{slice_id}:{node_id}:{pid}:{start_time}"


def parse_holder_name(name: str) -> tuple[str, str, int, int] | None:
    parts = name.split(":")
    if len(parts) != 5 or parts[0] != HOLD_PREFIX:
        return None
    try:
        return parts[1], parts[2], int(parts[3]), int(parts[4])
    except ValueError:
        return None


def process_start_time(pid: int) -> int:
    """Start time of a process in clock ticks since boot (guards against pid reuse)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return -1
    return int(stat.rsplit(")", 1)[1].split()[19])


def current_binding() -> Binding | None:
    return _binding


def last_error() -> str | None:
    return _last_error


def _assigned() -> dict[str, float]:
    import ray

    return ray.get_runtime_context().get_assigned_resources()


def _assigned_request(assigned: dict[str, float]) -> SliceRequest | None:
    core = assigned.get(TOTAL_CORE)
    if not core:
        return None
    memory = assigned.get(TOTAL_MEMORY)
    raw: dict[str, object] = {"core": core}
    if memory:
        raw["memory"] = memory
    return SliceRequest.model_validate(raw)


def _pinned_gpus(assigned: dict[str, float]) -> list[str]:
    """GPUs named by per-GPU resources (the SDK's resource-only mode chose them)."""
    out = []
    for name in assigned:
        parsed = parse_gpu_resource(name)
        if parsed and parsed[0] == TOTAL_CORE:
            out.append(parsed[1])
    return sorted(out)


def _isolation(assigned: dict[str, float], node_default: str | None) -> IsolationPolicy:
    """The SDK's marker, else ``QGPU_ISOLATION`` from the runtime_env, else the node's."""
    for name in assigned:
        if name.startswith(ISOLATION_PREFIX):
            return IsolationPolicy.parse(name.removeprefix(ISOLATION_PREFIX))
    own = os.environ.get("QGPU_ISOLATION")
    if own:
        return IsolationPolicy.parse(own, "QGPU_ISOLATION")
    return IsolationPolicy.parse(node_default or "best-effort", "qgpu.io/isolation")


def this_node() -> tuple[RayNode, FractionRule]:
    """This worker's node: from the raylet's environment (set by ``qgpu-ray start`` and
    `LocalCluster`), else from Ray's node table."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    rule = FractionRule.from_text(os.environ.get(FRACTION_ENV))
    text = os.environ.get(NODE_ENV)
    if text:
        inv = NodeInventory.model_validate_json(text)
        slots = {g.uuid: g.max_slices(inv.max_slices_per_gpu) for g in inv.gpus}
        labels = {LABEL_ISOLATION: inv.default_isolation.value}
        return RayNode(node_id, inv.name, inv, slots, labels), rule
    nodes = [n for n in ray_nodes() if n.node_id == node_id]
    if not nodes:
        raise FragmentedError(f"qgpu: node {node_id} advertises no qgpu GPUs")
    return nodes[0], rule


def _fragment_message(req: SliceRequest, node: str, state, exc: NoFit) -> str:
    free = ", ".join(
        f"#{g.index} core {int(state.free_core[i])}/mem {int(state.free_mem[i])} GiB"
        for i, g in enumerate(state.gpus)
    )
    return (
        f"qgpu: this worker holds qgpu-core={req.core} qgpu-memory={req.memory_gib} on node "
        f"{node}, but no single GPU there can take it ({exc}); free per GPU: {free}. "
        "The node's total fits only in fragments. Use qgpu_ray.options(core=..., memory=...) "
        "or @qgpu_ray.remote(...) so that the GPU is chosen before Ray schedules the work."
    )


def _hold(bundle: dict[str, float], name: str, timeout: float = HOLD_TIMEOUT_S) -> object | None:
    """Reserve `bundle` (per-GPU resources of this node) with a holder placement group."""
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group([bundle], strategy="STRICT_PACK", name=name)
    if pg.wait(timeout):
        return pg
    remove_placement_group(pg)
    return None


def _gpu_bundle(uuids: list[str], core: float, memory: list[int]) -> dict[str, float]:
    bundle: dict[str, float] = {}
    for uuid_, mem in zip(uuids, memory, strict=True):
        bundle[gpu_resource(TOTAL_CORE, uuid_)] = float(core)
        bundle[gpu_resource(TOTAL_MEMORY, uuid_)] = float(mem)
        bundle[gpu_resource(SLOTS, uuid_)] = 1.0
    return bundle


def _new_holder(prefix: str, node_id: str) -> tuple[str, str]:
    pid = os.getpid()
    slice_id = f"{prefix}-{uuid.uuid4().hex[:16]}"
    return slice_id, holder_name(slice_id, node_id, pid, process_start_time(pid))


def _apply(alloc: Allocation, path: str, holder: str = "") -> Binding:
    """Record the slice with the node agent and put device and caps into the environment."""
    global _binding
    # the request the allocation satisfies, isolation included (not the Ray amounts)
    with _phase("record"):
        agent_link.record(alloc, agent_link.request_of(alloc), _ray_meta(path))
    with _phase("env"):
        env = slice_env(alloc)
        env.pop("LD_PRELOAD", None)  # already loaded in this process
        os.environ.update(env)
    _binding = Binding(alloc, env, holder, path)
    return _binding


def _apply_held(alloc: Allocation, path: str, holder_name_: str, holder: object) -> Binding:
    """`_apply` for a slice reserved by a holder group; the group goes if the agent refuses."""
    from ray.util.placement_group import remove_placement_group

    try:
        return _apply(alloc, path, holder_name_)
    except agent_link.AgentRefused:
        remove_placement_group(holder)
        raise


def bind(ray_ids: list | None = None) -> Binding | None:
    """Bind this worker to a GPU slice of its node (idempotent). None = no slice to bind
    (not qgpu work, or the SDK's runtime_env form, which arrives bound).

    Raises RuleViolation for invalid amounts, FragmentedError / GpuBusyError when no GPU
    of the node can take the slice and agent_link.AgentRefused when the agent refuses it.
    """
    with _lock:
        if _binding is not None:
            return _binding
        if os.environ.get("QGPU_SLICE_ID"):
            return None  # the SDK's runtime_env form put this worker in a slice
        with _phase("assigned"):
            assigned = _assigned()
        req = _assigned_request(assigned)
        gpus = assigned.get(GPU, 0.0)
        if req is None and not gpus:
            return None
        if req is not None and gpus:
            raise RuleViolation(
                "num_gpus", gpus, "ask for num_gpus or for qgpu-core/qgpu-memory, not both"
            )
        with _phase("node"):
            node, rule = this_node()
        isolation = _isolation(assigned, node.labels.get(LABEL_ISOLATION))
        if req is None:
            ids = ray_gpu_ids() if ray_ids is None else ray_ids
            return _bind_num_gpus(gpus, [str(i) for i in ids], node, rule, isolation)
        pinned = _pinned_gpus(assigned)
        if pinned:  # the SDK chose the GPU(s); Ray already holds their per-GPU resources
            alloc = Allocation(
                slice_id="r-" + uuid.uuid4().hex[:16],
                node=node.name,
                gpu_uuids=pinned,
                core=req.core_per_gpu,
                memory_gib=req.memory_gib or 1,
                isolation=isolation,
            )
            return _apply(alloc, "sdk-resources")
        return _bind_plain(req, node, isolation)


def _bind_plain(req: SliceRequest, node: RayNode, isolation: IsolationPolicy) -> Binding:
    from qgpu.placement import Engine

    policy = _policy()
    for attempt in range(ATTEMPTS):
        with _phase("choose"):
            state = live_state([node]).state
            try:
                decision = Engine(state, policy).decide(req)
            except NoFit as exc:
                raise FragmentedError(_fragment_message(req, node.name, state, exc)) from exc
        slice_id, name = _new_holder("p", node.node_id)
        bundle = _gpu_bundle(
            list(decision.gpu_uuids), decision.core_per_gpu, list(decision.memory_gib_per_gpu)
        )
        with _phase("hold"):
            holder = _hold(bundle, name)
        if holder is None:
            time.sleep(0.2 * (attempt + 1))
            continue  # another worker won the race for that GPU: decide again
        alloc = Allocation(
            slice_id=slice_id,
            node=decision.node,
            gpu_uuids=list(decision.gpu_uuids),
            core=decision.core_per_gpu,
            memory_gib=min(decision.memory_gib_per_gpu),
            isolation=isolation,
        )
        return _apply_held(alloc, "plain", name, holder)
    raise FragmentedError(
        f"qgpu: could not reserve a GPU for qgpu-core={req.core} "
        f"qgpu-memory={req.memory_gib} on node {node.name} after {ATTEMPTS} attempts"
    )


@dataclass(frozen=True)
class _Choice:
    uuids: list[str]
    booked_core: float
    memory: list[int]
    alloc_core: int


def _choose_num_gpus(
    amount: float,
    ray_ids: list[str],
    node: RayNode,
    rule: FractionRule,
) -> _Choice | None:
    """Ray's GPU(s) when their qgpu ledger has room, else the node's policy over the GPUs
    that have room; None when no GPU of the node can take it now."""
    available = available_flat([node])
    gpus = {g.uuid: g for g in node.inventory.gpus}

    def free(kind: str, u: str) -> float:
        return available.get(gpu_resource(kind, u), 0.0)

    def decide(req: SliceRequest) -> list[str]:
        """The node's policy over the engine's state (numpy: only when Ray's choice fails)."""
        from qgpu.placement import Engine

        view = live_state([node], {node.node_id: available}, include_pending=False)
        return list(Engine(view.state, _policy()).decide(req).gpu_uuids)

    whole = whole_gpus(amount)
    if whole is not None:

        def empty(u: str) -> bool:
            return (
                free(TOTAL_CORE, u) >= 100 - 1e-6
                and free(TOTAL_MEMORY, u) >= gpus[u].memory_gib - 1e-6
                and free(SLOTS, u) >= node.slots[u]
            )

        preferred = [u for u in ray_ids if u in gpus]
        picked = preferred if len(preferred) == whole and all(map(empty, preferred)) else None
        if picked is None:
            req = SliceRequest(core=100 * whole)
            try:
                picked = decide(req)
            except NoFit:
                return None
        mem = [gpus[u].memory_gib for u in picked]
        return _Choice(picked, 100.0, mem, 100)

    def size(u: str) -> FractionSlice | None:
        try:
            return fraction_slice(amount, gpus[u].memory_gib, rule)
        except RuleViolation:
            if u in ray_ids:
                raise  # the card Ray chose cannot hold this fraction: say why
            return None  # a smaller card of a mixed node: not a candidate

    sizes = {u: size(u) for u in gpus}

    def fits(u: str) -> bool:
        s = sizes[u]
        return (
            s is not None
            and free(TOTAL_CORE, u) >= s.booked_core - 1e-6
            and free(TOTAL_MEMORY, u) >= s.memory_gib - 1e-6
            and free(SLOTS, u) >= 1 - 1e-6
        )

    candidates = [u for u in gpus if fits(u)]
    preferred = [u for u in ray_ids if u in candidates]
    if preferred:
        chosen = preferred[0]
    elif not candidates:
        return None
    else:
        fitting = [s for u, s in sizes.items() if u in candidates and s is not None]
        req = SliceRequest(
            core=max(1, min(99, math.ceil(min(s.booked_core for s in fitting) - 1e-6))),
            memory=min(s.memory_gib for s in fitting),
            include_uuids=candidates,
        )
        try:
            chosen = decide(req)[0]
        except NoFit:
            chosen = candidates[0]
    s = fraction_slice(amount, gpus[chosen].memory_gib, rule)
    return _Choice([chosen], s.booked_core, [s.memory_gib], s.core)


def _policy() -> PlacementPolicy:
    return PlacementPolicy.parse(os.environ.get(POLICY_ENV, "binpack"), POLICY_ENV)


def _wait_seconds() -> float:
    if _waited:
        return 0.0  # the first CUDA call after a failed wait: look once more, do not wait
    raw = os.environ.get(WAIT_ENV, str(DEFAULT_WAIT_S))
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value < 0:
        raise RuleViolation(WAIT_ENV, raw, "must be a number of seconds >= 0")
    return value


def _busy_message(amount: float, ray_ids: list[str], node: RayNode, waited: float) -> str:
    available = available_flat([node])
    free = ", ".join(
        f"{g.uuid} core {available.get(gpu_resource(TOTAL_CORE, g.uuid), 0):g}"
        f"/mem {available.get(gpu_resource(TOTAL_MEMORY, g.uuid), 0):g} GiB"
        f"/slots {available.get(gpu_resource(SLOTS, g.uuid), 0):g}"
        for g in node.inventory.gpus
    )
    return (
        f"qgpu: Ray gave this worker num_gpus={amount:g} of {','.join(ray_ids) or 'a GPU'} on "
        f"node {node.name}, but no GPU there has room for its slice after {waited:.0f} s "
        f"({WAIT_ENV}); free per GPU: {free}. Ray's GPU count does not see qgpu-core/"
        "qgpu-memory slices: the GPUs are held by them."
    )


def _bind_num_gpus(
    amount: float,
    ray_ids: list[str],
    node: RayNode,
    rule: FractionRule,
    isolation: IsolationPolicy,
) -> Binding:
    """Book a ``num_gpus`` worker in its GPU's qgpu ledger (see the module docstring)."""
    wait = _wait_seconds()
    start = time.monotonic()
    said = False
    while True:
        with _phase("choose"):
            choice = _choose_num_gpus(amount, ray_ids, node, rule)
        if choice is not None:
            slice_id, name = _new_holder("n", node.node_id)
            bundle = _gpu_bundle(choice.uuids, choice.booked_core, choice.memory)
            bundle[TOTAL_CORE] = choice.booked_core * len(choice.uuids)
            bundle[TOTAL_MEMORY] = float(sum(choice.memory))
            with _phase("hold"):
                holder = _hold(bundle, name)
            if holder is not None:
                alloc = Allocation(
                    slice_id=slice_id,
                    node=node.name,
                    gpu_uuids=choice.uuids,
                    core=choice.alloc_core,
                    memory_gib=min(choice.memory),
                    isolation=isolation,
                )
                return _apply_held(alloc, "num_gpus", name, holder)
            # else another worker took that room first: look again (within the wait)
        waited = time.monotonic() - start
        if waited >= wait:
            global _waited
            _waited = True
            raise GpuBusyError(_busy_message(amount, ray_ids, node, waited))
        if not said:
            print(
                f"qgpu: num_gpus={amount:g}: waiting up to {wait:.0f} s for room on a GPU of "
                f"node {node.name} (its GPUs are held by qgpu slices)",
                file=sys.stderr,
                flush=True,
            )
            said = True
        time.sleep(0.25)


BIND_ERRORS = (FragmentedError, RuleViolation, agent_link.AgentRefused)


def bind_quietly(ray_ids: list | None = None) -> Binding | None:
    """`bind`, keeping a failure for `last_error` (and stderr) instead of raising: used when
    Ray starts the task; the worker's first CUDA call then refuses with the same reason."""
    global _last_error
    try:
        return bind(ray_ids)
    except BIND_ERRORS as exc:
        _last_error = str(exc)
    except Exception as exc:
        _last_error = f"qgpu: binding this worker to a GPU failed: {exc!r}"
    print(_last_error, file=sys.stderr, flush=True)
    return None


def on_cuinit() -> int:
    """The interposer's bind callback: 0 = go on with cuInit, non-zero = refuse it."""
    if os.environ.get("QGPU_SLICE_ID") and _binding is None:
        try:
            _record_sdk_slice()
            return 0
        except BIND_ERRORS as exc:
            global _last_error
            _last_error = str(exc)
            print(_last_error, file=sys.stderr, flush=True)
            return 1
    return 0 if _binding is not None or bind_quietly() is not None or not _wants() else 1


def _wants() -> bool:
    from qgpu_ray.hook import wants_slice

    return wants_slice(_assigned())


def _ray_meta(path: str) -> dict[str, str]:
    import ray

    ctx = ray.get_runtime_context()
    meta = {"path": path, "ray_node": ctx.get_node_id()}
    actor = ctx.get_actor_id()
    if actor:
        meta["ray_actor"] = actor
    return meta


def _record_sdk_slice() -> None:
    """SDK path: the slice came in the environment; an actor has its node agent record it.

    Tasks are not recorded: their worker outlives the task (Ray reuses it), so the agent
    could not tell when the slice ends; Ray's own accounting covers them.
    """
    global _recorded
    if _recorded:
        return
    alloc = agent_link.allocation_from_env()
    if alloc is None:
        return
    meta = _ray_meta("sdk")
    if "ray_actor" in meta:
        agent_link.record(alloc, agent_link.request_of(alloc), meta)
    _recorded = True
