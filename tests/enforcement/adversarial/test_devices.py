"""A slice is one GPU (our addition): a tenant that drops CUDA_VISIBLE_DEVICES sees every
GPU of the node (a bare Ray or Dask worker can), and must not take memory, contexts or pools
on a GPU that is not its slice's. Two simulated 16 GiB GPUs: the hostile 4 GiB slice on
GPU 0, a victim slice of the whole 16 GiB of GPU 1 (as another tenant's would be). The
ground truth is the simulator's accounting of GPU 1."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from enforcement.sim import process_memory, write_sim_config

from ..conftest import GIB, Sim, Worker
from .conftest import CTX, Arena, Programs

INVALID_DEVICE = 101


@pytest.fixture
def two_gpus(short_tmp: Path) -> Iterator[Arena]:
    cfg = write_sim_config(short_tmp / "two.conf", "2xT4-16GB", node=f"dev2-{short_tmp.name}")
    sim = Sim(cfg, short_tmp / "ledgers")
    victim = Worker(sim.slice_env("gpu1-owner", gpu=1, memory=16 * GIB))
    arena = Arena(sim, victim)
    try:
        victim.start()
        yield arena
    finally:
        for h in arena.hostiles:
            if h.proc.poll() is None:
                h.proc.kill()
                h.proc.wait()
        victim.kill()


@pytest.mark.parametrize(
    "way", ["primary", "create", "vmm", "pool", "default", "location", "graph"]
)
def test_a_tenant_takes_nothing_on_a_gpu_that_is_not_its_slices(
    two_gpus: Arena, programs: Programs, way: str
) -> None:
    env = two_gpus.hostile_env(gpu=0)
    env.pop("CUDA_VISIBLE_DEVICES", None)  # every GPU of the node, as a bare process sees
    h = two_gpus.start([programs.c("other_device"), two_gpus.sim.uuid(0), way], env)
    assert h.one("devices") == 2 and h.one("other") >= 0
    on_other = process_memory(two_gpus.sim.config, 1).get(h.pid, 0)
    assert on_other == 0, f"{way}: the tenant holds {on_other / GIB:.2f} GiB on GPU 1"
    refused = h.all("context") + h.all("pool") + h.all("grab")
    assert refused and all(r == INVALID_DEVICE for r in refused), h.lines
    status, ident = two_gpus.victim.alloc("alloc", 16 * GIB - CTX)
    assert status == "ok", f"GPU 1's owner lost memory it was promised (CUresult {ident})"
    h.finish()


def test_its_own_gpu_still_works_with_every_gpu_visible(
    two_gpus: Arena, programs: Programs
) -> None:
    """The fence is the slice's GPU, not an ordinal: with every GPU visible, the slice's
    own GPU (ordinal 0 here) still gives a context and memory up to the cap."""
    env = two_gpus.hostile_env(gpu=0)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    h = two_gpus.start([programs.c("other_device"), two_gpus.sim.uuid(1), "primary"], env)
    assert h.one("context") == 0
    assert h.all("grab")[:3] == [0, 0, 0]
    h.finish()
