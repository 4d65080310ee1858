"""The Ray internals qgpu depends on, checked against the Ray that is installed.

qgpu puts its slices into Ray workers through hooks that Ray honours but does not promise:

- ``__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR``: every worker runs the function it names
  before its first task (`qgpu_ray.hook.install`);
- ``RAY_LD_PRELOAD_ON_WORKERS``: the raylet keeps its ``LD_PRELOAD`` (the interposer) for
  the workers it starts instead of stripping it;
- ``RAY_JEMALLOC_LIB_PATH``: set empty while a node starts, so Ray does not replace the
  node's ``LD_PRELOAD`` with its jemalloc (`qgpu_ray.local`);
- ``ray._private.worker.Worker.get_accelerator_ids_for_accelerator_resource``: the lookup
  behind ``ray.get_gpu_ids()``, ``get_accelerator_ids()`` and the ``CUDA_VISIBLE_DEVICES``
  Ray sets for a task; qgpu answers it with the slice's GPU and binds there;
- the raylet's ``CUDA_VISIBLE_DEVICES`` becomes the node's GPU ids
  (``Worker.original_visible_accelerator_ids``);
- ``ray._private.state.available_resources_per_node``: Ray's live per-GPU availability.

`check` verifies what can be verified without a cluster and raises `RayInternalsChanged`
naming the variable when one is gone; `qgpu-ray start` and `LocalCluster` call it, so a Ray
upgrade that drops a hook fails loudly at start instead of silently running slices
uncapped. tests/ray/test_compat.py checks `check`; tests/ray/test_numgpus.py
(``test_ray_still_honours_the_hooks``) checks the behaviour of each hook on a real cluster.
"""

from __future__ import annotations

import inspect
from pathlib import Path

from qgpu.errors import QgpuError

RAY_SETUP_HOOK_ENV = "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR"
RAY_LD_PRELOAD_ENV = "RAY_LD_PRELOAD_ON_WORKERS"
RAY_JEMALLOC_ENV = "RAY_JEMALLOC_LIB_PATH"
ACCELERATOR_LOOKUP = "get_accelerator_ids_for_accelerator_resource"
ORIGINAL_IDS = "original_visible_accelerator_ids"
# Ray versions this release is tested with (docs/ray.md); others are checked by `check`.
TESTED_RAY_VERSIONS = ("2.60",)


class RayInternalsChanged(QgpuError):
    """The installed Ray no longer has an internal hook qgpu relies on."""

    def __init__(self, variable: str, detail: str) -> None:
        import ray

        self.variable = variable
        super().__init__(
            f"{variable}: the installed Ray {ray.__version__} {detail}; qgpu cannot put "
            f"slices into Ray workers without it (tested with Ray "
            f"{', '.join(TESTED_RAY_VERSIONS)}; see docs/ray.md)"
        )


def ray_version_tested() -> bool:
    import ray

    return any(ray.__version__.startswith(v + ".") for v in TESTED_RAY_VERSIONS)


def check() -> None:
    """Raise RayInternalsChanged (naming the variable) when a hook is gone from Ray."""
    import ray
    import ray._private.ray_constants as constants
    import ray._private.services as services
    import ray._private.state as state
    import ray._private.worker as worker

    if getattr(constants, "WORKER_PROCESS_SETUP_HOOK_ENV_VAR", None) != RAY_SETUP_HOOK_ENV:
        raise RayInternalsChanged(
            RAY_SETUP_HOOK_ENV, "no longer names its worker-process setup hook this way"
        )
    default_worker = Path(ray.__file__).parent / "_private" / "workers" / "default_worker.py"
    if "WORKER_PROCESS_SETUP_HOOK_ENV_VAR" not in _read(default_worker):
        raise RayInternalsChanged(RAY_SETUP_HOOK_ENV, "workers no longer read it")
    if getattr(services, "RAY_JEMALLOC_LIB_PATH", None) != RAY_JEMALLOC_ENV:
        raise RayInternalsChanged(RAY_JEMALLOC_ENV, "no longer reads it when a node starts")
    if RAY_LD_PRELOAD_ENV not in _read(Path(services.__file__)):
        raise RayInternalsChanged(RAY_LD_PRELOAD_ENV, "no longer passes it to the raylet")
    lookup = getattr(worker.Worker, ACCELERATOR_LOOKUP, None)
    if lookup is None or list(inspect.signature(lookup).parameters) != [
        "self",
        "resource_name",
        "resource_regex",
    ]:
        raise RayInternalsChanged(
            f"ray._private.worker.Worker.{ACCELERATOR_LOOKUP}",
            "no longer has this accelerator-id lookup (self, resource_name, resource_regex)",
        )
    if ORIGINAL_IDS not in _read(Path(worker.__file__)):
        raise RayInternalsChanged(
            f"ray._private.worker.Worker.{ORIGINAL_IDS}",
            "no longer maps GPU ids through the raylet's CUDA_VISIBLE_DEVICES",
        )
    if not callable(getattr(state, "available_resources_per_node", None)):
        raise RayInternalsChanged(
            "ray._private.state.available_resources_per_node", "no longer has it"
        )


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""
