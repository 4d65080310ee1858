"""Dask adapter: slice-per-worker clusters and worker/nanny plugins.

- `SliceCluster` (cluster): a local cluster with one worker per slice reserved from a node
  agent.
- `SliceNanny` (nanny): a nanny that spawns its worker inside a slice (pre-spawn env).
- `NoFitPlugin` / `NoSliceFits` (nofit): tasks no slice can run fail instead of hanging.
- `task_resources` / `slice_resources` (resources): the ``qgpu-core`` / ``qgpu-memory``
  Dask resources.
- ``qgpu-dask-worker`` (worker_cli): one slice worker joining any scheduler.

Imports the core ``qgpu`` package; the core never imports this one.
"""

from qgpu_dask.cluster import SliceCluster
from qgpu_dask.nanny import SliceNanny
from qgpu_dask.nofit import NoFitPlugin, NoSliceFits
from qgpu_dask.resources import CORE, MEMORY, slice_resources, task_resources

__all__ = [
    "CORE",
    "MEMORY",
    "NoFitPlugin",
    "NoSliceFits",
    "SliceCluster",
    "SliceNanny",
    "slice_resources",
    "task_resources",
]
