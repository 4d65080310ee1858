"""`SliceNanny`: a Dask nanny whose worker process starts inside a slice.

The interposer must be in the worker's environment when the process is created: the
dynamic loader reads ``LD_PRELOAD`` only at exec, and the interposer reads its caps at
``cuInit``. In Dask 2026.8 only the nanny's *pre-spawn* environment is applied before the
worker process is spawned (``Nanny(env=...)`` and ``distributed.nanny.environ`` are
applied inside the already running child — fine for ``CUDA_VISIBLE_DEVICES``, too late for
``LD_PRELOAD``). `SliceNanny` therefore adds the slice's whole environment to
``pre_spawn_env`` (and to ``env``, so a worker restart gets it too). Preloads the worker
would otherwise inherit (``LD_PRELOAD`` of the parent or of the pre-spawn config) are kept
after the interposer.

Dask applies the pre-spawn environment by updating ``os.environ`` of the nanny's process
and never undoing it. With several nannies in one process (a `SliceCluster`) that would
leak one slice's caps into the next worker and into everything the parent starts later.
`instantiate` therefore runs under a process-wide lock and restores the keys it touched.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Mapping
from typing import Any

import dask
from distributed import Nanny
from distributed.core import Status

from qgpu.errors import QgpuError

_SPAWN_LOCK = threading.Lock()
_LOCK_POLL_S = 0.01


def check_spawn_method() -> None:
    """Workers must be started by exec (``spawn``): a forkserver child inherits the
    forkserver's environment, not the pre-spawn one, and would run without the caps."""
    method = dask.config.get("distributed.worker.multiprocessing-method", default="spawn")
    if method != "spawn":
        raise QgpuError(
            f"distributed.worker.multiprocessing-method={method!r}: slice workers need "
            "'spawn' so the interposer (LD_PRELOAD) and caps apply when the worker process "
            "is created"
        )


class SliceNanny(Nanny):
    """A nanny that spawns its worker with ``slice_env`` (a reservation's ``env``) applied
    before the process exists. All other arguments are `distributed.Nanny`'s."""

    def __init__(
        self, *args: Any, slice_env: Mapping[str, str] | None = None, **kwargs: Any
    ) -> None:
        check_spawn_method()
        super().__init__(*args, **kwargs)
        self.slice_env = {str(k): str(v) for k, v in (slice_env or {}).items()}
        hook = self.slice_env.get("LD_PRELOAD")
        inherited = self.pre_spawn_env.get("LD_PRELOAD") or os.environ.get("LD_PRELOAD", "")
        if hook and inherited:
            # keep the user's preloads (jemalloc, ...) after the interposer
            others = [p for p in inherited.replace(" ", ":").split(":") if p and p != hook]
            self.slice_env["LD_PRELOAD"] = ":".join([hook, *others])
        self.pre_spawn_env.update(self.slice_env)
        self.env.update(self.slice_env)

    async def instantiate(self) -> Status:
        while not _SPAWN_LOCK.acquire(blocking=False):
            await asyncio.sleep(_LOCK_POLL_S)
        keys = list(self.pre_spawn_env)
        saved = {k: os.environ.get(k) for k in keys}
        try:
            return await super().instantiate()
        finally:
            for k in keys:
                old = saved[k]
                if old is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = old
            _SPAWN_LOCK.release()


__all__ = ["SliceNanny", "check_spawn_method"]
