"""Memory pools (issue 17), as frameworks use them (PyTorch's and CuPy's cudaMallocAsync
backends raise the release threshold so the pool keeps its memory): a pool keeps what it
grew by after cuMemFreeAsync, so freed pool memory must stay charged while the pool holds
it. Modes (argv[1]):
  threshold  the device's default pool with its release threshold raised to the maximum
  setpool    a new pool (cuMemPoolCreate) made the device's current pool (cuDeviceSetMemPool)
  frompool   a new pool used through cuMemAllocFromPoolAsync
  grow       a pool grown twice without frees
  import     cuMemPoolImportPointer into a pool of its own (refused: not an imported pool)
Each mode takes 3 GiB through the pool, gives it back to the pool, then asks for 3 GiB with
cuMemAlloc: the pool still holds the first 3 GiB, so that must be refused."""

from __future__ import annotations

import sys

from cuda.bindings import driver as cuda
from hostile_cb import GIB, alloc, code, hold, say, setup

UINT64_MAX = (1 << 64) - 1


def keep_everything(pool: object) -> None:
    threshold = cuda.cuuint64_t(UINT64_MAX)
    attr = cuda.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD
    assert code(cuda.cuMemPoolSetAttribute(pool, attr, threshold)) == 0


def new_pool() -> object:
    props = cuda.CUmemPoolProps()
    props.allocType = cuda.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    props.location.type = cuda.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    props.location.id = 0
    err, pool = cuda.cuMemPoolCreate(props)
    assert int(err) == 0, err
    return pool


def main() -> None:
    mode = sys.argv[1]
    setup()
    _, stream = cuda.cuStreamCreate(0)
    _, dev = cuda.cuDeviceGet(0)
    pool = None
    if mode == "threshold":
        _, pool = cuda.cuDeviceGetDefaultMemPool(dev)
    elif mode in ("setpool", "frompool", "grow"):
        pool = new_pool()
        if mode == "setpool":
            assert code(cuda.cuDeviceSetMemPool(dev, pool)) == 0
    elif mode == "import":
        data = cuda.CUmemPoolPtrExportData()
        say("import", code(cuda.cuMemPoolImportPointer(new_pool(), data)))
        alloc(3 * GIB)
        hold()
        return
    keep_everything(pool)

    def take(size: int) -> tuple[int, int]:
        if mode == "frompool":
            err, ptr = cuda.cuMemAllocFromPoolAsync(size, pool, stream)
        else:
            err, ptr = cuda.cuMemAllocAsync(size, stream)
        return int(err), int(ptr) if int(err) == 0 else 0

    err, ptr = take(3 * GIB)
    say("pool", err)
    if mode == "grow":
        say("pool", take(3 * GIB)[0])
    else:
        say("free", code(cuda.cuMemFreeAsync(ptr, stream)))
        say("sync", code(cuda.cuStreamSynchronize(stream)))
        alloc(3 * GIB)
    hold()


main()
