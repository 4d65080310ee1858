"""VMM map-then-release (issue 17), the pattern of NVIDIA's vectorAddMMAP sample:
cuMemCreate -> cuMemAddressReserve -> cuMemMap -> cuMemSetAccess -> cuMemRelease while the
memory stays mapped. The driver keeps the memory until the last unmap; before the fix the
hook gave the charge back at the release: five rounds mapped 15 GiB under 4 GiB."""

from __future__ import annotations

from cuda.bindings import driver as cuda
from hostile_cb import GIB, code, hold, say, setup


def main() -> None:
    setup()
    prop = cuda.CUmemAllocationProp()
    prop.type = cuda.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cuda.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = 0
    access = cuda.CUmemAccessDesc()
    access.location = prop.location
    access.flags = cuda.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    size = 3 * GIB
    for _ in range(5):
        err, handle = cuda.cuMemCreate(size, prop, 0)
        say("create", int(err))
        if int(err):
            continue
        err, va = cuda.cuMemAddressReserve(size, 0, 0, 0)
        assert int(err) == 0, err
        say("map", code(cuda.cuMemMap(va, size, 0, handle, 0)))
        say("access", code(cuda.cuMemSetAccess(va, size, [access], 1)))
        say("release", code(cuda.cuMemRelease(handle)))  # still mapped: memory kept
    hold()


main()
