"""A Ray cluster on this machine with qgpu nodes: real GPUs, or simulated ones.

`LocalCluster` starts ``ray.cluster_utils.Cluster`` nodes that each advertise their GPUs
(totals, per-GPU resources, labels, and Ray's ``GPU``) and run their workers with the
interposer, the worker hook and (on simulated GPUs) the simulated driver; it connects the
driver and runs the reaper of slices bound in workers. It serves ``make demo``, the
examples and the tests, and lets users try their Ray code on simulated GPUs.

`init_local` is the one-node shortcut: ``qgpu_ray.init_local(sim="2xH100-80GB")``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from enforcement.agent.local import LocalAgent, default_gpus
from qgpu.model import NodeInventory, PlacementPolicy
from qgpu_ray import compat
from qgpu_ray.fraction import FractionRule
from qgpu_ray.provider import sim_node, worker_environment
from qgpu_ray.reaper import Reaper
from qgpu_ray.resources import gpu_order, node_labels, node_resources


@dataclass
class LocalNode:
    name: str
    inventory: NodeInventory
    state_dir: Path
    sim_config: Path | None
    ray_node: Any
    env: dict[str, str]
    agent: LocalAgent | None = None


@contextmanager
def _keep_ld_preload() -> Iterator[None]:
    """While Ray starts a node from this process, keep its jemalloc set-up from replacing the
    node's LD_PRELOAD (Ray swaps in jemalloc when the *starting* process has no LD_PRELOAD)."""
    key = compat.RAY_JEMALLOC_ENV
    old = os.environ.get(key)
    os.environ[key] = ""
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old


def _real_gpu_node(name: str, root: Path) -> tuple[NodeInventory, None]:
    from enforcement.discovery import discover, open_backend

    backend = open_backend("nvml", state_dir=root)
    try:
        return discover(backend, name), None
    finally:
        backend.close()


class LocalCluster:
    """Ray nodes on this machine, each with its own (simulated or real) GPUs."""

    def __init__(
        self,
        nodes: list[str] | None = None,
        *,
        root: str | Path | None = None,
        policy: PlacementPolicy | str = PlacementPolicy.BINPACK,
        cpus_per_node: int = 2,
        head_cpus: int = 1,
        connect: bool = True,
        reaper_interval: float = 0.5,
        ray_init_kwargs: dict[str, Any] | None = None,
        extra_node_args: dict[str, Any] | None = None,
        agents: bool = True,
        fraction: FractionRule | None = None,
    ) -> None:
        """`nodes` lists one simulated-GPU spec per node (``["2xH100-80GB", "T4"]``);
        the special spec ``"real"`` uses this machine's GPUs through NVML. With `agents`,
        each node gets its own `qgpu agent` (its GPUs, ledger, metrics) that records the
        node's Ray slices; without, the nodes are configured directly. `fraction` is what
        ``num_gpus=f`` means on the nodes (`qgpu_ray.fraction`; default: in proportion)."""
        from ray.cluster_utils import Cluster

        compat.check()
        if "num_gpus" in (extra_node_args or {}):
            raise ValueError("extra_node_args: num_gpus is set from each node's GPUs")
        self.fraction = fraction or FractionRule()
        self._own_root = root is None
        self.root = Path(root or tempfile.mkdtemp(prefix="qgpu-ray-", dir="/tmp"))
        self.policy = PlacementPolicy.parse(policy, "policy")
        self.cpus_per_node = cpus_per_node
        self.extra_node_args = dict(extra_node_args or {})
        self.agents = agents
        self.cluster = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": head_cpus, "include_dashboard": False},
        )
        self.nodes: list[LocalNode] = []
        self.reaper: Reaper | None = None
        for spec in nodes or ["2xH100-80GB"]:
            self.add_node(spec)
        if connect:
            import ray

            ray.init(address=self.cluster.address, **(ray_init_kwargs or {}))
            self.reaper = Reaper(interval=reaper_interval).start()

    @property
    def address(self) -> str:
        return self.cluster.address

    def add_node(self, spec: str, name: str | None = None) -> LocalNode:
        name = name or f"qgpu-node-{len(self.nodes)}"
        node_root = self.root / name
        node_root.mkdir(parents=True, exist_ok=True)
        agent = None
        if self.agents:
            agent = LocalAgent(node_root / "agent", gpus=spec, policy=self.policy, node_name=name)
            inventory = agent.node.inventory
            sim_config = agent.node.workload_env.get("QGPU_SIM_CONFIG")
            state_dir = Path(agent.node.workload_env["QGPU_STATE_DIR"])
        elif spec == "real":
            inventory, sim_config = _real_gpu_node(name, node_root)
            state_dir = node_root / "state"
        else:
            inventory, sim_config = sim_node(spec, name, node_root)
            state_dir = node_root / "state"
        state_dir.mkdir(parents=True, exist_ok=True)
        env = worker_environment(
            state_dir,
            inventory=inventory,
            fraction=self.fraction,
            sim_config=sim_config,
            policy=self.policy,
        )
        if agent is not None:
            env["QGPU_AGENT_SOCKET"] = str(agent.socket)
        with _keep_ld_preload():
            ray_node = self.cluster.add_node(
                num_cpus=self.cpus_per_node,
                num_gpus=len(gpu_order(inventory)),
                resources=node_resources(inventory),
                labels=node_labels(inventory),
                env_vars=env,
                **self.extra_node_args,
            )
        node = LocalNode(name, inventory, state_dir, sim_config, ray_node, env, agent)
        self.nodes.append(node)
        return node

    def remove_node(self, node: LocalNode) -> None:
        self.cluster.remove_node(node.ray_node)
        self.nodes.remove(node)
        if node.agent is not None:
            node.agent.stop()

    def node_of(self, gpu_uuid: str) -> LocalNode:
        for node in self.nodes:
            if any(g.uuid == gpu_uuid for g in node.inventory.gpus):
                return node
        raise KeyError(gpu_uuid)

    def shutdown(self) -> None:
        import ray

        if self.reaper is not None:
            self.reaper.stop()
        if ray.is_initialized():
            ray.shutdown()
        self.cluster.shutdown()
        for node in self.nodes:
            if node.agent is not None:
                node.agent.stop()
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def init_local(
    sim: str | None = None, *, policy: PlacementPolicy | str = "binpack", **kwargs: Any
) -> LocalCluster:
    """One qgpu node on this machine: this machine's GPUs, or ``sim`` simulated ones.

    Without ``sim`` the real GPUs are used when NVML is available, else ``2xH100-80GB``.
    """
    return LocalCluster([sim or default_gpus()], policy=policy, **kwargs)
