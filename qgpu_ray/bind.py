"""The plain ``resources=`` path: bind a Ray worker to a fitting GPU before CUDA starts.

``@ray.remote(resources={"qgpu-core": 30, "qgpu-memory": 8})`` makes Ray reserve the node
totals only. Which GPU of the node the worker uses is decided here, in the worker, at the
last moment before CUDA starts:

1. Every worker on a qgpu node runs with the interposer preloaded and this module's
   ``install()`` as Ray's worker-process setup hook. ``install()`` registers ``bind()`` as
   the interposer's bind callback.
2. The first ``cuInit`` of the worker finds no slice limits and calls back into ``bind()``,
   which reads the worker's assigned resources, picks a GPU on this node with the core
   placement engine over Ray's live per-GPU availability, and reserves that GPU's
   per-GPU resources with a small "holder" placement group named ``qgpu-hold:...`` (so
   Ray's accounting of that GPU stays exact for the SDK path too).
3. ``bind()`` puts the device and the caps into the process environment; the interposer
   then reads them and the real ``cuInit`` sees ``CUDA_VISIBLE_DEVICES``.

When the node's free capacity exists only in fragments (no single GPU has the share),
``bind()`` fails with a message that says so and points at the SDK; ``cuInit`` then fails.
Holder placement groups of dead workers or dead nodes are removed by `qgpu_ray.reaper`.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
import uuid
from dataclasses import dataclass

from qgpu.errors import NoFit, RuleViolation
from qgpu.model import Allocation, IsolationPolicy, PlacementPolicy, SliceRequest
from qgpu.placement import Decision, Engine
from qgpu_ray import agent_link
from qgpu_ray.env import slice_env
from qgpu_ray.resources import (
    ISOLATION_PREFIX,
    LABEL_ISOLATION,
    SLOTS,
    TOTAL_CORE,
    TOTAL_MEMORY,
    gpu_resource,
    parse_gpu_resource,
)
from qgpu_ray.view import live_state, ray_nodes

HOLD_PREFIX = "qgpu-hold"
POLICY_ENV = "QGPU_RAY_POLICY"
BIND_ENV = "QGPU_BIND"
HOLD_TIMEOUT_S = 10.0
ATTEMPTS = 3

_BIND_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int)
_lock = threading.Lock()
_callback_ref: object | None = None


class FragmentedError(RuntimeError):
    """The node has the total capacity but no single GPU with the share."""


@dataclass(frozen=True)
class Binding:
    allocation: Allocation
    env: dict[str, str]
    holder_name: str


_binding: Binding | None = None
_last_error: str | None = None
_recorded = False


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
    for name in assigned:
        if name.startswith(ISOLATION_PREFIX):
            return IsolationPolicy.parse(name.removeprefix(ISOLATION_PREFIX))
    return IsolationPolicy.parse(
        os.environ.get("QGPU_RAY_ISOLATION") or node_default or "best-effort"
    )


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


def _hold(decision: Decision, name: str) -> object | None:
    """Reserve the decision's per-GPU resources with a holder placement group."""
    from ray.util.placement_group import placement_group, remove_placement_group

    bundle: dict[str, float] = {}
    for uuid_, mem in zip(decision.gpu_uuids, decision.memory_gib_per_gpu, strict=True):
        bundle[gpu_resource(TOTAL_CORE, uuid_)] = float(decision.core_per_gpu)
        bundle[gpu_resource(TOTAL_MEMORY, uuid_)] = float(mem)
        bundle[gpu_resource(SLOTS, uuid_)] = 1.0
    pg = placement_group([bundle], strategy="STRICT_PACK", name=name)
    if pg.wait(HOLD_TIMEOUT_S):
        return pg
    remove_placement_group(pg)
    return None


def _apply(alloc: Allocation, req: SliceRequest, path: str, holder: str = "") -> Binding:
    """Record the slice with the node agent and put device and caps into the environment."""
    global _binding
    agent_link.record(alloc, req, _ray_meta(path))
    env = slice_env(alloc)
    env.pop("LD_PRELOAD", None)  # already loaded in this process
    os.environ.update(env)
    _binding = Binding(alloc, env, holder)
    return _binding


def bind() -> Binding | None:
    """Bind this worker to a GPU slice of its node (idempotent). None = not a qgpu worker.

    Raises RuleViolation for invalid amounts, FragmentedError when only fragments fit and
    agent_link.AgentRefused when the node agent refuses the slice.
    """
    with _lock:
        if _binding is not None:
            return _binding
        if os.environ.get("QGPU_SLICE_ID"):
            return None  # the SDK path already put this worker in a slice
        import ray

        assigned = _assigned()
        req = _assigned_request(assigned)
        if req is None:
            return None
        node_id = ray.get_runtime_context().get_node_id()
        nodes = [n for n in ray_nodes() if n.node_id == node_id]
        if not nodes:
            raise FragmentedError(f"qgpu: node {node_id} advertises no qgpu GPUs")
        isolation = _isolation(assigned, nodes[0].labels.get(LABEL_ISOLATION))
        pinned = _pinned_gpus(assigned)
        if pinned:  # the SDK chose the GPU(s); Ray already holds their per-GPU resources
            alloc = Allocation(
                slice_id="r-" + uuid.uuid4().hex[:16],
                node=nodes[0].name,
                gpu_uuids=pinned,
                core=req.core_per_gpu,
                memory_gib=req.memory_gib or 1,
                isolation=isolation,
            )
            return _apply(alloc, req, "sdk-resources")
        return _bind_plain(req, node_id, nodes, isolation)


def _bind_plain(
    req: SliceRequest, node_id: str, nodes: list, isolation: IsolationPolicy
) -> Binding:
    from ray.util.placement_group import remove_placement_group

    policy = PlacementPolicy.parse(os.environ.get(POLICY_ENV, "binpack"), POLICY_ENV)
    pid = os.getpid()
    for attempt in range(ATTEMPTS):
        if attempt:
            nodes = [n for n in ray_nodes() if n.node_id == node_id]
        state = live_state(nodes).state
        try:
            decision = Engine(state, policy).decide(req)
        except NoFit as exc:
            raise FragmentedError(_fragment_message(req, nodes[0].name, state, exc)) from exc
        slice_id = "p-" + uuid.uuid4().hex[:16]
        name = holder_name(slice_id, node_id, pid, process_start_time(pid))
        holder = _hold(decision, name)
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
        try:
            return _apply(alloc, req, "plain", name)
        except agent_link.AgentRefused:
            remove_placement_group(holder)
            raise
    raise FragmentedError(
        f"qgpu: could not reserve a GPU for qgpu-core={req.core} "
        f"qgpu-memory={req.memory_gib} on node {node_id} after {ATTEMPTS} attempts"
    )


def _on_cuinit() -> int:
    """The interposer's bind callback: 0 = go on with cuInit, non-zero = refuse it."""
    global _last_error
    try:
        if os.environ.get("QGPU_SLICE_ID"):
            _record_sdk_slice()
        else:
            bind()
        return 0
    except (FragmentedError, RuleViolation, agent_link.AgentRefused) as exc:
        _last_error = str(exc)
    except Exception as exc:
        _last_error = f"qgpu: binding this worker to a GPU failed: {exc!r}"
    print(_last_error, file=sys.stderr, flush=True)
    return 1


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


def install() -> None:
    """Ray worker-process setup hook: register the bind callback with the interposer.

    At the worker's first CUDA call the callback binds a plain-path worker to a GPU, or
    records an SDK-path actor's slice with the node agent."""
    global _callback_ref
    os.environ.setdefault(BIND_ENV, "ray")
    try:
        register = ctypes.CDLL(None).qgpu_hook_set_bind_callback
    except AttributeError:
        return  # the interposer is not preloaded in this worker: nothing to bind
    callback = _BIND_CALLBACK(_on_cuinit)
    _callback_ref = callback  # keep it alive for the life of the process
    register.argtypes = [_BIND_CALLBACK]
    register.restype = ctypes.c_int
    register(callback)
