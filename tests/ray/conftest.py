"""A real multi-node Ray cluster on this machine with simulated GPUs (ray.cluster_utils).

One cluster per test module: a GPU-less head and two nodes with two simulated 40 GiB GPUs
each. Ray's temp dir is private to the session (RAY_TMPDIR).
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from tests.helpers import wait_until

ray = pytest.importorskip("ray")


@pytest.fixture(scope="session", autouse=True)
def _private_ray_tmpdir():
    path = tempfile.mkdtemp(prefix="qgpu-raytmp-", dir="/tmp")
    old = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = path
    yield path
    if old is None:
        os.environ.pop("RAY_TMPDIR", None)
    else:
        os.environ["RAY_TMPDIR"] = old
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster():
    from qgpu_ray.local import LocalCluster

    c = LocalCluster(["2xA100-40GB", "2xA100-40GB"], cpus_per_node=4)
    yield c
    c.shutdown()


def gpu_free(uuid: str, kind: str = "qgpu-core") -> float:
    from ray._private.state import available_resources_per_node

    return sum(v.get(f"{kind}/{uuid}", 0.0) for v in available_resources_per_node().values())


def all_free(cluster) -> bool:
    return all(
        gpu_free(g.uuid) == 100 and gpu_free(g.uuid, "qgpu-memory") == g.memory_gib
        for n in cluster.nodes
        for g in n.inventory.gpus
    )


def holders() -> list[str]:
    """Live holder placement groups of plain-path slices."""
    return [
        v["name"]
        for v in ray.util.placement_group_table().values()
        if v["name"].startswith("qgpu-hold:") and v["state"] != "REMOVED"
    ]


@pytest.fixture(autouse=True)
def _clean(request):
    """Actors a test appends here are killed after it; every test ends with all GPUs free."""
    actors: list = []
    yield actors
    if "cluster" not in request.fixturenames:
        return
    import qgpu_ray

    cluster = request.getfixturevalue("cluster")
    for a in actors:
        ray.kill(a)
    wait_until(lambda: all_free(cluster) and not holders())
    qgpu_ray.view.PENDING.clear()
