"""`SliceCluster`: a local Dask cluster with one worker per GPU slice.

The slices are reserved from a qgpu node agent, so the core placement engine chooses the
GPUs and the agent's ledger records them: the agent at ``agent_socket``, or one the cluster
starts itself on simulated GPUs (``sim="2xH100-80GB"``) or on this machine's GPUs (NVML).
Every slice gets a `SliceNanny` whose worker process starts with the slice's environment
(device, interposer, caps) and advertises the slice as Dask resources ``qgpu-core`` /
``qgpu-memory``. The scheduler runs `NoFitPlugin`, so a task asking for more than any slice
holds fails with `NoSliceFits` instead of waiting forever. Closing the cluster stops the
workers and then releases the slices; if this process dies instead, the agent's reconcile
releases them (their owner is this process).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from distributed import Scheduler, SpecCluster

from enforcement.agent.client import AgentClient, AgentError
from enforcement.agent.models import Reservation
from qgpu.errors import NoFit, QgpuError, RuleViolation
from qgpu.model import PlacementPolicy, SliceRequest
from qgpu_dask.agent import LocalAgent, default_gpus, parse_request, with_policy, worker_owner
from qgpu_dask.nanny import SliceNanny, check_spawn_method
from qgpu_dask.nofit import NoFitPlugin
from qgpu_dask.resources import slice_resources

log = logging.getLogger("qgpu.dask.cluster")


class SliceCluster(SpecCluster):
    """One Dask worker per slice; see the module docstring.

    Args:
        slices: one request per worker, as the core model takes it
            (``{"core": 30, "memory": 8, "isolation": "fs"}`` or a `SliceRequest`).
        policy: placement policy for slices that name none (``binpack``, ``spread``,
            ``frag``); ``None`` leaves the choice to the agent (frag for an agent the cluster
            starts).
        sim: simulated GPUs for an agent the cluster starts (e.g. ``"2xH100-80GB"``);
            ``"real"`` uses this machine's GPUs. Default: the real GPUs when NVML works,
            else ``2xH100-80GB``.
        agent_socket: use the node agent listening there instead of starting one.
        threads_per_worker: threads of each slice worker (they share the slice).
        no_fit_grace: seconds a task that fits no slice may wait before it fails.
        worker_options, scheduler_options: extra `Nanny` / `Scheduler` arguments.
    """

    def __init__(
        self,
        slices: Sequence[SliceRequest | Mapping[str, Any]],
        *,
        policy: PlacementPolicy | str | None = None,
        sim: str | None = None,
        agent_socket: str | os.PathLike[str] | None = None,
        threads_per_worker: int = 1,
        no_fit_grace: float = 0.0,
        name: str | None = None,
        root: str | os.PathLike[str] | None = None,
        asynchronous: bool = False,
        loop: Any = None,
        silence_logs: int | bool = logging.WARNING,
        worker_options: Mapping[str, Any] | None = None,
        scheduler_options: Mapping[str, Any] | None = None,
    ) -> None:
        if not slices:
            raise RuleViolation("slices", [], "a SliceCluster needs at least one slice")
        if sim is not None and agent_socket is not None:
            raise RuleViolation("sim", sim, "give either sim (own agent) or agent_socket")
        check_spawn_method()
        placement = None if policy is None else PlacementPolicy.parse(policy, "policy")
        requests = [
            with_policy(parse_request(s, f"slices[{i}]"), placement) for i, s in enumerate(slices)
        ]
        self.cluster_id = name or f"qgpu-dask-{uuid.uuid4().hex[:8]}"
        self._own_root = root is None
        self.root = Path(root or tempfile.mkdtemp(prefix="qgpu-dask-", dir="/tmp"))
        self.agent: LocalAgent | None = None
        if agent_socket is None:
            try:
                self.agent = LocalAgent(
                    self.root / "agent",
                    gpus=sim or default_gpus(),
                    policy=placement or PlacementPolicy.FRAG,
                )
            except BaseException:
                if self._own_root:
                    shutil.rmtree(self.root, ignore_errors=True)
                raise
            self.client = self.agent.client
        else:
            self.client = AgentClient(agent_socket, timeout=30.0)
        self.slices: dict[str, Reservation] = {}
        try:
            for i, request in enumerate(requests):
                worker_name = f"slice-{i}"
                owner = worker_owner(f"{self.cluster_id}/{worker_name}")
                try:
                    self.slices[worker_name] = self.client.reserve(request, owner=owner)
                except AgentError as exc:
                    if exc.is_no_fit:
                        raise NoFit(
                            f"slices[{i}] ({_describe(request)}) does not fit on the GPUs "
                            f"left: {exc.rule}",
                            exc.reasons,
                        ) from exc
                    if exc.status != 422:
                        raise
                    violation = exc.as_violation()
                    raise RuleViolation(
                        f"slices[{i}].{violation.field}", violation.value, violation.rule
                    ) from exc
            workers = {
                worker_name: {
                    "cls": SliceNanny,
                    "options": {
                        "nthreads": threads_per_worker,
                        "host": "127.0.0.1",
                        "resources": slice_resources(res),
                        "slice_env": res.env,
                        "silence_logs": silence_logs,
                        **dict(worker_options or {}),
                    },
                }
                for worker_name, res in self.slices.items()
            }
            scheduler = {
                "cls": Scheduler,
                "options": {
                    "host": "127.0.0.1",
                    "dashboard": False,
                    "dashboard_address": None,
                    "plugins": [
                        NoFitPlugin(
                            grace=no_fit_grace,
                            slices=[slice_resources(r) for r in self.slices.values()],
                        )
                    ],
                    **dict(scheduler_options or {}),
                },
            }
            super().__init__(
                workers=workers,
                scheduler=scheduler,
                asynchronous=asynchronous,
                loop=loop,
                silence_logs=silence_logs,
                name=self.cluster_id,
            )
        except BaseException:
            self._release_slices()
            raise

    def scale(self, n: int = 0, memory: Any = None, cores: Any = None) -> Any:
        """Only scaling to zero (closing) is meaningful: a worker exists per slice."""
        if n not in (0, len(self.worker_spec)):
            raise QgpuError(
                f"a SliceCluster runs one worker per reserved slice ({len(self.slices)}); "
                "start another SliceCluster, or qgpu-dask-worker, for more slices"
            )
        return super().scale(n, memory=memory, cores=cores)

    def slice_of(self, worker_name: str) -> Reservation:
        """The reservation of a worker (names are ``slice-0``, ``slice-1``, ...)."""
        return self.slices[worker_name]

    def _release_slices(self) -> None:
        for worker_name, res in list(self.slices.items()):
            try:
                self.client.release(res.slice_id)
            except QgpuError as exc:
                log.warning("could not release slice %s of %s: %s", res.slice_id, worker_name, exc)
            else:
                del self.slices[worker_name]
        if self.agent is not None:
            self.agent.stop()
            self.agent = None
        else:
            self.client.close()
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    async def _close(self) -> None:
        try:
            await super()._close()
        finally:
            if self.slices or self.agent is not None:
                # blocking HTTP and the agent's exit: keep them off the event loop, except
                # at interpreter exit, when no new thread can be started
                try:
                    await asyncio.to_thread(self._release_slices)
                except RuntimeError:
                    self._release_slices()


def _describe(request: SliceRequest) -> str:
    text = f"qgpu-core={request.core}"
    if request.memory_gib is not None:
        text += f", qgpu-memory={request.memory_gib}"
    return text


__all__ = ["SliceCluster"]
