"""The link from a Ray worker to its node's qgpu agent.

A Ray slice is placed by Ray's accounting (SDK path) or by the worker's binder (plain path);
the node agent then records it (``POST /v1/slices/record``) so that the node's one view of
its GPUs — ``qgpu status``, ``/metrics``, the watchdog, non-Ray reservations — includes it.
The owner is the worker's pid: the agent's reconcile releases the record when the worker
process is gone. A node without an agent (``QGPU_AGENT_SOCKET`` unset) skips this step;
an agent that refuses the record (the GPU is already committed to non-Ray slices) makes
the binding fail, so a GPU is never over-committed between Ray and other users.
"""

from __future__ import annotations

import os
import sys
import time

from qgpu.model import Allocation, Owner, OwnerKind, SliceRequest

AGENT_SOCKET_ENV = "QGPU_AGENT_SOCKET"
RECORD_ATTEMPTS = 4


class AgentRefused(RuntimeError):
    """The node agent refused to record the slice (field/value/rule in the message)."""


def _socket() -> str | None:
    path = os.environ.get(AGENT_SOCKET_ENV)
    return path if path and os.path.exists(path) else None


def record(alloc: Allocation, request: SliceRequest, ray_meta: dict[str, str]) -> bool:
    """Record `alloc` with the node agent; False when the node has no agent."""
    path = _socket()
    if path is None:
        return False
    from enforcement.agent.client import AgentClient, AgentError, AgentUnavailable

    owner = Owner(kind=OwnerKind.PID, id=str(os.getpid()), meta=ray_meta)
    client = AgentClient(path, timeout=10.0)
    for attempt in range(RECORD_ATTEMPTS):
        try:
            client.record(alloc.slice_id, request, list(alloc.gpu_uuids), owner)
            return True
        except AgentError as exc:
            # 409: the GPU still holds a slice whose worker Ray has just killed and that is
            # still exiting; the agent reconciles on conflict, so try again shortly.
            if exc.status != 409 or attempt == RECORD_ATTEMPTS - 1:
                raise AgentRefused(
                    f"qgpu: the node agent refused slice {alloc.slice_id}: {exc}"
                ) from exc
            time.sleep(0.5 * (attempt + 1))
        except AgentUnavailable as exc:
            print(f"qgpu: warning: slice {alloc.slice_id} not recorded: {exc}", file=sys.stderr)
            return False
    return False


def request_of(alloc: Allocation) -> SliceRequest:
    """The request an allocation satisfies (what the agent re-checks)."""
    if alloc.is_whole_gpu:
        return SliceRequest(core=100 * len(alloc.gpu_uuids))
    return SliceRequest(core=alloc.core, memory=alloc.memory_gib, isolation=alloc.isolation)


def allocation_from_env(env: dict[str, str] | None = None) -> Allocation | None:
    """The SDK path's slice, read back from the worker's environment."""
    env = dict(os.environ if env is None else env)
    slice_id = env.get("QGPU_SLICE_ID")
    devices = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
    if not slice_id or not devices:
        return None
    if "QGPU_MEMORY_LIMIT" not in env:  # whole GPUs
        return Allocation(slice_id=slice_id, node="", gpu_uuids=devices, core=100, memory_gib=1)
    return Allocation(
        slice_id=slice_id,
        node="",
        gpu_uuids=devices[:1],
        core=int(env.get("QGPU_CORE_LIMIT", "100")),
        memory_gib=int(env["QGPU_MEMORY_LIMIT"]) >> 30,
        isolation=env.get("QGPU_ISOLATION", "best-effort"),
    )
