"""Size overflow (issue 17): a request of about 2**64 bytes that the driver then refuses.
Before the fix the hook's `used + bytes` wrapped, so the request passed the cap, and the
failed call's release clamped the slice's count to 0: five rounds held 15 GiB under 4 GiB.
Each round: one overflowing request through API (argv[1]), then a 3 GiB cuMemAlloc."""

from __future__ import annotations

import sys

from cuda.bindings import driver as cuda
from hostile_cb import GIB, SIZE_MAX, alloc, code, hold, say, setup


def attempt(api: str) -> int:
    if api == "alloc":
        return code(cuda.cuMemAlloc(SIZE_MAX))
    if api == "managed":
        return code(cuda.cuMemAllocManaged(SIZE_MAX, 1))
    if api == "pitch":
        return code(cuda.cuMemAllocPitch(1 << 62, 8, 16))
    if api == "create":  # a bad device, as the issue says: the driver refuses after the hook
        prop = cuda.CUmemAllocationProp()
        prop.type = cuda.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cuda.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = 7
        return code(cuda.cuMemCreate(SIZE_MAX - (1 << 21) + 1, prop, 0))
    if api == "async":
        return code(cuda.cuMemAllocAsync(SIZE_MAX, 0))
    if api == "array3d":
        d = cuda.CUDA_ARRAY3D_DESCRIPTOR()
        d.Width, d.Height, d.Depth = 1 << 40, 1 << 20, 1 << 10
        d.Format = cuda.CUarray_format.CU_AD_FORMAT_FLOAT
        d.NumChannels = 4
        return code(cuda.cuArray3DCreate(d))
    if api == "heap":
        return code(cuda.cuCtxSetLimit(cuda.CUlimit.CU_LIMIT_MALLOC_HEAP_SIZE, SIZE_MAX))
    raise SystemExit(f"unknown api {api}")


def main() -> None:
    setup()
    for _ in range(5):
        say("attempt", attempt(sys.argv[1]))
        alloc(3 * GIB)
    hold()


main()
