"""The device plugin's own record of its claims, on the node, where tenants cannot write.

The claim annotation (``<prefix>/qgpu-allocated``) lives on the pod, and a tenant who may
patch its pods can remove or rewrite it: removing it would make its running containers look
unallocated, so that another pod's Allocate with the same layout is answered with the
tenant's slice. The plugin therefore also keeps every claim it writes in a root-owned file
under its state directory (``<state-dir>/k8s/claims.json``, mode 0600, replaced atomically)
and `k8s_bridge.deviceplugin.claims` trusts it over the annotation: the annotation only adds
claims the record lacks (a plugin that died between the apiserver write and this file, or
claims written by an older plugin). Entries of pods no longer on the node are dropped.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterable
from pathlib import Path

from k8s_bridge.protocol import Allocated
from qgpu.errors import QgpuError

log = logging.getLogger(__name__)


class ClaimRecord:
    """pod UID -> the `Allocated` this plugin wrote for it (persisted in one JSON file)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._claims: dict[str, Allocated] = self._load()

    def _load(self) -> dict[str, Allocated]:
        try:
            raw = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            # unreadable: start empty (the annotations still hold every claim) and say so
            log.warning("ignoring the claim record %s: %s", self.path, exc)
            return {}
        out: dict[str, Allocated] = {}
        for uid, obj in raw.items() if isinstance(raw, dict) else []:
            try:
                out[str(uid)] = Allocated.model_validate(obj)
            except (QgpuError, ValueError) as exc:
                log.warning("ignoring the claim record of pod uid %s: %s", uid, exc)
        return out

    def get(self, uid: str) -> Allocated | None:
        with self._lock:
            return self._claims.get(uid)

    def snapshot(self) -> dict[str, Allocated]:
        with self._lock:
            return dict(self._claims)

    def put(self, uid: str, allocated: Allocated) -> None:
        with self._lock:
            self._claims[uid] = allocated
            self._write()

    def keep_only(self, live: Iterable[str]) -> None:
        """Drop the claims of pods that are no longer on the node."""
        alive = set(live)
        with self._lock:
            gone = [u for u in self._claims if u not in alive]
            if gone:
                for u in gone:
                    del self._claims[u]
                self._write()

    def _write(self) -> None:
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        text = json.dumps({u: a.model_dump(mode="json") for u, a in self._claims.items()})
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, self.path)
