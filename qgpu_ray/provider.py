"""Node resource provider: what a qgpu node tells Ray, and the environment of its workers.

`ray_start_arguments` turns a node inventory into ``ray start`` flags (totals, per-GPU
resources, labels, and the GPUs as Ray's ``GPU``); `worker_environment` is the raylet
environment that every worker on the node inherits: the interposer preloaded node-wide
(its limits are read at ``cuInit``, so one preload serves every worker and no slice needs a
runtime_env), the worker hook (`qgpu_ray.hook`), ``CUDA_VISIBLE_DEVICES`` listing the GPUs'
UUIDs (so Ray's GPU ids are UUIDs), the node's inventory and ``num_gpus`` rule, the
interposer's state directory and, on simulated GPUs, the simulated driver.
`sim_node` builds a simulated node (config + inventory) for laptops, CI and tests.
"""

from __future__ import annotations

import json
from pathlib import Path

from qgpu.model import GpuDevice, IsolationPolicy, NodeInventory, PlacementPolicy
from qgpu.units import MIB_PER_GIB
from qgpu_ray.compat import RAY_LD_PRELOAD_ENV, RAY_SETUP_HOOK_ENV
from qgpu_ray.fraction import FractionRule
from qgpu_ray.resources import (
    BIND_ENV,
    FRACTION_ENV,
    NODE_ENV,
    POLICY_ENV,
    gpu_order,
    node_labels,
    node_resources,
)

SETUP_HOOK = "qgpu_ray.hook.install"


def worker_environment(
    state_dir: str | Path,
    *,
    inventory: NodeInventory | None = None,
    fraction: FractionRule | None = None,
    sim_config: str | Path | None = None,
    policy: PlacementPolicy | str = PlacementPolicy.BINPACK,
    preload: bool = True,
    setup_hook_env: bool = True,
) -> dict[str, str]:
    """Environment for the raylet of a qgpu node (its workers inherit it)."""
    from enforcement.native import hook_library_path

    env = {
        "QGPU_STATE_DIR": str(Path(state_dir).resolve()),
        POLICY_ENV: PlacementPolicy.parse(policy, "policy").value,
        BIND_ENV: "ray",
    }
    if inventory is not None:
        rule = fraction or FractionRule()
        rule.check_cards([g.memory_gib for g in inventory.gpus if g.healthy])
        healthy = inventory.model_copy(update={"gpus": [g for g in inventory.gpus if g.healthy]})
        env[NODE_ENV] = healthy.model_dump_json(
            include={"name", "gpus", "max_slices_per_gpu", "default_isolation"}
        )
        env[FRACTION_ENV] = rule.to_text()
        # Ray's GPU ids on this node are these UUIDs (a num_gpus worker gets its GPU's UUID
        # in CUDA_VISIBLE_DEVICES and from ray.get_gpu_ids(), like an SDK slice)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_order(inventory))
    if preload:
        env["LD_PRELOAD"] = str(hook_library_path())
        # the raylet strips LD_PRELOAD from its workers unless told to keep it
        env[RAY_LD_PRELOAD_ENV] = "1"
    if setup_hook_env:
        env[RAY_SETUP_HOOK_ENV] = SETUP_HOOK
    if sim_config is not None:
        from enforcement.sim import sim_environment

        env.update(sim_environment(sim_config))
    return env


def ray_start_arguments(inventory: NodeInventory) -> list[str]:
    """``ray start`` flags advertising the node's GPUs (append the user's own flags)."""
    return [
        f"--num-gpus={len(gpu_order(inventory))}",
        "--resources=" + json.dumps(node_resources(inventory), sort_keys=True),
        "--labels=" + ",".join(f"{k}={v}" for k, v in sorted(node_labels(inventory).items())),
    ]


def sim_node(
    spec: str,
    node_name: str,
    root: str | Path,
    *,
    max_slices_per_gpu: int = 16,
    default_isolation: IsolationPolicy | str = IsolationPolicy.BEST_EFFORT,
) -> tuple[NodeInventory, Path]:
    """A simulated node: writes its GPU config under `root`; returns inventory and config."""
    from enforcement.sim import write_sim_config

    root = Path(root)
    config = write_sim_config(root / "sim.conf", spec, node=node_name, state_dir=root / "sim")
    gpus = [
        GpuDevice(
            uuid=g.uuid,
            index=g.index,
            model=g.model,
            memory_mib=g.memory_gib * MIB_PER_GIB,
            sm_count=g.sms,
            numa_node=0,
        )
        for g in config.gpus
    ]
    inventory = NodeInventory(
        name=node_name,
        gpus=gpus,
        max_slices_per_gpu=max_slices_per_gpu,
        default_isolation=IsolationPolicy.parse(default_isolation, "default_isolation"),
        labels={"qgpu.io/backend": "sim"},
    )
    return inventory, config.path
