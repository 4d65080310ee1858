"""A slice is one GPU (our addition): a tenant that drops CUDA_VISIBLE_DEVICES sees every
GPU of the node (a bare Ray or Dask worker can), and must not take memory, contexts or pools
on a GPU that is not its slice's, nor move memory there. Two simulated 16 GiB GPUs: the
hostile 4 GiB slice on GPU 0, a victim slice of the whole 16 GiB of GPU 1 (as another
tenant's would be). The ground truth is the simulator's accounting of GPU 1.

Managed memory (cuMemAllocManaged) is charged to the slice on its own GPU; a prefetch to
GPU 1 moved it there (the simulator keeps it on the GPU it lives on, as NVIDIA's driver
does), which won against the hook before the prefetch forms were fenced: 3 GiB on GPU 1,
the victim short of its 16 GiB. Advice naming GPU 1 (SET_PREFERRED_LOCATION,
SET_ACCESSED_BY) moves nothing by itself (cuda.h), but keeps the memory there once it is
there and is a placement policy on another tenant's GPU: it is refused as well."""

from __future__ import annotations

import pytest

from enforcement.sim import process_memory

from ..conftest import GIB
from .conftest import CTX, Arena, Programs

INVALID_DEVICE = 101


MANAGED_WAYS = [
    "prefetch", "prefetch_getproc", "prefetch_ptsz", "prefetch_v1", "prefetch_v1_ptsz",
    "batch", "batch_ptsz", "discard_prefetch", "discard_prefetch_ptsz",
    "preferred", "preferred_v1", "accessed_by", "accessed_by_v1",
]  # fmt: skip


@pytest.mark.parametrize(
    "way", ["primary", "create", "vmm", "pool", "default", "location", "graph", *MANAGED_WAYS]
)
def test_a_tenant_takes_nothing_on_a_gpu_that_is_not_its_slices(
    two_gpus: Arena, programs: Programs, way: str
) -> None:
    env = two_gpus.hostile_env(gpu=0)
    env.pop("CUDA_VISIBLE_DEVICES", None)  # every GPU of the node, as a bare process sees
    h = two_gpus.start([programs.c("other_device"), two_gpus.sim.uuid(0), way], env)
    assert h.one("devices") == 2 and h.one("other") >= 0
    assert h.all("managed") == ([0] if way in MANAGED_WAYS else [])  # 3 GiB on its own GPU
    on_other = process_memory(two_gpus.sim.config, 1).get(h.pid, 0)
    assert on_other == 0, f"{way}: the tenant holds {on_other / GIB:.2f} GiB on GPU 1"
    if way in MANAGED_WAYS:  # where it was charged, and stays
        assert process_memory(two_gpus.sim.config, 0).get(h.pid, 0) == CTX + 3 * GIB
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


def test_managed_memory_moves_between_its_own_gpu_and_the_host(
    two_gpus: Arena, programs: Programs
) -> None:
    """What the fence leaves: with every GPU visible, the slice's managed memory is
    prefetched, batch-prefetched and advised to its own GPU and to the host in every form."""
    env = two_gpus.hostile_env(gpu=0)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    h = two_gpus.start([programs.c("other_device"), two_gpus.sim.uuid(0), "own"], env)
    assert h.one("managed") == 0
    assert h.all("own") == [0] * (len(MANAGED_WAYS) + 1)
    assert h.all("host") == [0] * len(MANAGED_WAYS)
    assert h.one("other") == 1 and h.one("last_prefetch") == 0  # its own GPU, ordinal 0
    assert process_memory(two_gpus.sim.config, 0).get(h.pid, 0) == CTX + 3 * GIB
    assert process_memory(two_gpus.sim.config, 1).get(h.pid, 0) == 0
    h.finish()
