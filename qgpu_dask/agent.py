"""The node agent as the Dask adapter uses it: a private agent for a local cluster, the
slice owner a Dask worker is recorded under, and slice requests checked by the core model.

The private agent itself is `enforcement.agent.local.LocalAgent` (shared with the Ray
adapter's local clusters); it is re-exported here.

`worker_owner` builds the ``dask-worker`` owner of a slice: its ``meta.pid`` is the process
that runs the worker's nanny (the worker process is its child and dies with it). The agent
pins that pid's start time, and its reconcile releases the slice once that process is gone,
so a SIGKILLed worker does not keep its slice.

`worker_slice_id` derives a worker's slice id from its node, scheduler and name, so a
worker restarted under the same name reserves the same id: the agent hands it the slice
its previous process held (idempotent ``slice_id``, the owner taken over once that process
is gone) instead of placing a second one beside it.
"""

from __future__ import annotations

import hashlib
import os
import socket
from collections.abc import Mapping
from typing import Any

from enforcement.agent.local import REAL_GPUS, LocalAgent, default_gpus
from qgpu.model import Owner, OwnerKind, PlacementPolicy, SliceRequest


def parse_request(value: SliceRequest | Mapping[str, Any], where: str = "slice") -> SliceRequest:
    """A slice request validated by the core model; a broken rule raises `RuleViolation`."""
    return SliceRequest.parse(value, where)


def with_policy(request: SliceRequest, policy: PlacementPolicy | None) -> SliceRequest:
    """The request with the cluster's placement policy, unless it names its own."""
    if policy is None or request.placement is not None or request.gpu_placement is not None:
        return request
    return request.model_copy(update={"placement": policy})


def worker_owner(worker_id: str, pid: int | None = None) -> Owner:
    """The owner recorded for the slice of a Dask worker whose nanny runs in ``pid``."""
    return Owner(
        kind=OwnerKind.DASK_WORKER,
        id=worker_id[:256],
        meta={"pid": str(pid if pid is not None else os.getpid())},
    )


def worker_slice_id(scheduler: str, name: str, node: str | None = None) -> str:
    """The stable slice id of the worker `name` of `scheduler` on `node` (this host):
    ``dask-`` and 24 hex digits of their SHA-256, within the slice id rule."""
    key = "\0".join((node or socket.gethostname(), scheduler, name))
    return "dask-" + hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:24]


__all__ = [
    "REAL_GPUS",
    "LocalAgent",
    "default_gpus",
    "parse_request",
    "with_policy",
    "worker_owner",
    "worker_slice_id",
]
