"""Ray adapter: node resource provider, SDK (options/remote/placement groups), Serve helpers.

Imports the core ``qgpu`` package; the core never imports this one.

    import qgpu_ray
    actor = Model.options(**qgpu_ray.options(core=30, memory="8Gi")).remote()

The names below load on first use, so a Ray worker that imports `qgpu_ray.hook` (every
worker of a qgpu node) does not pay for the SDK, the placement engine or the agent client.
See docs/ray.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from qgpu_ray import view
    from qgpu_ray.local import LocalCluster, init_local
    from qgpu_ray.sdk import SlicePlacementGroup, options, placement_group, remote

_EXPORTS = {
    "LocalCluster": "qgpu_ray.local",
    "init_local": "qgpu_ray.local",
    "SlicePlacementGroup": "qgpu_ray.sdk",
    "options": "qgpu_ray.sdk",
    "placement_group": "qgpu_ray.sdk",
    "remote": "qgpu_ray.sdk",
}

__all__ = [
    "LocalCluster",
    "SlicePlacementGroup",
    "init_local",
    "options",
    "placement_group",
    "remote",
    "view",
]


def __getattr__(name: str) -> Any:
    if name == "view":
        return importlib.import_module("qgpu_ray.view")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'qgpu_ray' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
