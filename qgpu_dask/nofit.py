"""A scheduler plugin that fails tasks no slice can ever run, instead of leaving them
pending forever.

Dask keeps a task whose resource restrictions no worker satisfies in the ``no-worker``
state until such a worker joins — with a fixed set of slices that never happens, and the
user's ``future.result()`` hangs. `NoFitPlugin` watches tasks entering ``no-worker`` with a
``qgpu-*`` restriction; if after ``grace`` seconds still no single worker offers all of
the requested amounts, the task is failed with `NoSliceFits`, whose message names the
request and the largest slices of the cluster. Tasks without qgpu restrictions are left
alone, and a worker that joins within the grace period (``qgpu-dask-worker`` on another
node) is used as usual.

A cluster that knows its slices up front (`SliceCluster`) declares them as ``slices``: they
count as offers even while their worker is away (restarting after a crash), so a task
waiting for a restarting slice is not failed.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.protocol import pickle

from qgpu.errors import QgpuError
from qgpu_dask.resources import CORE, MEMORY, QGPU_RESOURCES

log = logging.getLogger("qgpu.dask.nofit")

PLUGIN_NAME = "qgpu-no-fit"


class NoSliceFits(QgpuError):
    """A task asks for more than any slice worker of the cluster offers."""

    def __init__(self, message: str) -> None:
        super().__init__(message)


def _fmt(amounts: dict[str, float]) -> str:
    return ", ".join(f"{k}={v:g}" for k, v in sorted(amounts.items())) or "nothing"


def no_fit_message(key: Any, wanted: dict[str, float], offers: list[dict[str, float]]) -> str:
    """The error text: the request, and the largest slice per qgpu dimension."""
    if not offers:
        return (
            f"task {key!r} asks for {_fmt(wanted)}, but no worker of this cluster offers "
            "qgpu resources (no slice workers are connected)"
        )
    largest = max(offers, key=lambda o: (o.get(CORE, 0.0), o.get(MEMORY, 0.0)))
    most_memory = max(offers, key=lambda o: (o.get(MEMORY, 0.0), o.get(CORE, 0.0)))
    text = (
        f"task {key!r} asks for {_fmt(wanted)}, more than any slice of this cluster offers "
        f"(largest slice: {_fmt(largest)}"
    )
    if most_memory != largest:
        text += f"; most memory: {_fmt(most_memory)}"
    return text + f"; {len(offers)} slice(s) known). Ask for at most what one slice holds."


class NoFitPlugin(SchedulerPlugin):
    """Fail qgpu-restricted tasks that no connected worker can ever run."""

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self, grace: float = 0.0, slices: Sequence[Mapping[str, float]] = ()) -> None:
        self.grace = float(grace)
        self.slices = [{k: float(v) for k, v in s.items()} for s in slices]
        self.scheduler: Any = None

    async def start(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        # tasks that entered no-worker before the plugin was installed (a qgpu-dask-worker
        # installs it on a running scheduler) are checked too
        for key in [ts.key for ts in scheduler.unrunnable if self._wanted(ts)]:
            scheduler.loop.call_later(self.grace, self._check, key)

    def transition(self, key: Any, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        if finish != "no-worker" or self.scheduler is None:
            return
        ts = self.scheduler.tasks.get(key)
        if ts is None or not self._wanted(ts):
            return
        # never transition from inside a transition: check on the event loop
        self.scheduler.loop.call_later(self.grace, self._check, key)

    @staticmethod
    def _wanted(ts: Any) -> dict[str, float]:
        restrictions = ts.resource_restrictions or {}
        if not any(name in restrictions for name in QGPU_RESOURCES):
            return {}
        return {k: float(v) for k, v in restrictions.items()}

    def _offers(self) -> list[dict[str, float]]:
        out = list(self.slices)
        for ws in self.scheduler.workers.values():
            offer = {k: float(v) for k, v in (ws.resources or {}).items()}
            if any(name in offer for name in QGPU_RESOURCES) and offer not in self.slices:
                out.append(offer)
        return out

    def _check(self, key: Any) -> None:
        ts = self.scheduler.tasks.get(key)
        if ts is None or ts.state != "no-worker":
            return
        wanted = self._wanted(ts)
        if not wanted:
            return
        offers = self._offers()
        if any(all(o.get(k, 0.0) >= v for k, v in wanted.items()) for o in offers):
            return  # a fitting worker exists; the task waits for other reasons
        qgpu_offers = [{k: o.get(k, 0.0) for k in QGPU_RESOURCES} for o in offers]
        message = no_fit_message(key, wanted, qgpu_offers)
        log.info("%s", message)
        stimulus_id = f"qgpu-no-fit-{key}"
        recommendations = self.scheduler.transition(
            key,
            "erred",
            stimulus_id=stimulus_id,
            exception=pickle.dumps(NoSliceFits(message)),
            cause=key,
            exception_text=message,
        )
        self.scheduler.transitions(recommendations, stimulus_id)


__all__ = ["PLUGIN_NAME", "NoFitPlugin", "NoSliceFits", "no_fit_message"]
