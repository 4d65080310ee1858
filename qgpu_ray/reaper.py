"""Release slices bound in workers whose worker or node is gone.

A plain ``resources=`` worker and a ``num_gpus`` worker hold their GPU's per-GPU resources
through a holder placement group named ``qgpu-hold:<slice>:<node_id>:<pid>:<start_time>``
(see `qgpu_ray.bind`). Ray ties such a group to the job, not to the worker, so this reaper
removes it when the worker process has exited (killed, crashed or finished: checked by pid
and start time, on the node where the reaper runs) or when its node is dead (checked
cluster-wide).

``qgpu-ray start`` runs one reaper per node; `qgpu_ray.local.init_local` runs one as a
thread of the driver. A node's reaper ends when its node's raylet does (`local_raylet`:
``ray stop`` stops the raylet, not the reaper, which Ray does not know). A ``num_gpus``
*task* gets a fresh worker that exits after it (Ray's ``max_calls=1`` for GPU tasks), so
its slice ends with the task. SDK-path slices need no reaper: they are plain Ray
resources of the actor or task and Ray frees them itself.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from qgpu_ray.bind import parse_holder_name, process_start_time

log = logging.getLogger("qgpu.ray.reaper")


def _pid_alive(pid: int, start_time: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return process_start_time(pid) == start_time


def local_raylet(node_id: str) -> tuple[int, int] | None:
    """The pid and start time of node `node_id`'s raylet if it runs on this machine (its
    command line carries ``--node_id=<id>``), else None."""
    flag = f"--node_id={node_id}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if args and os.path.basename(args[0]) == b"raylet" and flag in args:
            pid = int(entry.name)
            return pid, process_start_time(pid)
    return None


def raylet_alive(raylet: tuple[int, int]) -> bool:
    return _pid_alive(*raylet)


def reap_once(local_node_ids: set[str] | None = None) -> list[str]:
    """Remove holder groups of dead workers (on `local_node_ids`; None = every node is
    local, as in a one-machine cluster) and of dead nodes. Returns the removed slice ids."""
    import ray
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    alive_nodes = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    removed = []
    for pg_id, info in ray.util.placement_group_table().items():
        parsed = parse_holder_name(info.get("name", ""))
        if parsed is None or info.get("state") == "REMOVED":
            continue
        slice_id, node_id, pid, start = parsed
        node_dead = node_id not in alive_nodes
        local = local_node_ids is None or node_id in local_node_ids
        if node_dead or (local and not _pid_alive(pid, start)):
            remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))))
            removed.append(slice_id)
            log.info("released slice %s (%s)", slice_id, "node dead" if node_dead else "exited")
    return removed


class Reaper:
    """Runs `reap_once` every `interval` seconds on a daemon thread."""

    def __init__(self, interval: float = 1.0, local_node_ids: set[str] | None = None) -> None:
        self.interval = interval
        self.local_node_ids = local_node_ids
        self.released: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="qgpu-reaper", daemon=True)

    def start(self) -> Reaper:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.released.extend(reap_once(self.local_node_ids))
            except Exception:
                log.exception("reaper pass failed")
