"""Ray adapter: node resource provider, SDK (options/remote/placement groups), Serve helpers.

Imports the core ``qgpu`` package; the core never imports this one.

    import qgpu_ray
    actor = Model.options(**qgpu_ray.options(core=30, memory="8Gi")).remote()

See docs/ray.md.
"""

from qgpu_ray import view
from qgpu_ray.local import LocalCluster, init_local
from qgpu_ray.sdk import SlicePlacementGroup, options, placement_group, remote

__all__ = [
    "LocalCluster",
    "SlicePlacementGroup",
    "init_local",
    "options",
    "placement_group",
    "remote",
    "view",
]
