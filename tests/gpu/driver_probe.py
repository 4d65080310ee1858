"""NVIDIA's driver through ctypes, for tests/gpu/test_driver_facts.py (no framework needed).

driver_probe.py grab BYTES      cuMemAlloc_v2 of BYTES until refused; "count N", "ready",
                                then holds it all until stdin closes
driver_probe.py managed BYTES   cuMemAllocManaged of BYTES prefetched to GPU 0; "ready",
                                then holds it until stdin closes
driver_probe.py alloc BYTES     one cuMemAlloc_v2 of BYTES; prints its CUresult
driver_probe.py paint BYTES     cuMemAlloc_v2 of BYTES filled with 0xA5, then exits without
                                freeing it (the driver frees it with the process)
driver_probe.py peek BYTES      cuMemAlloc_v2 of BYTES, copied to the host unwritten;
                                prints how many of its bytes are 0xA5 and how many non-zero
"""

from __future__ import annotations

import ctypes
import sys
from ctypes import POINTER, Structure, byref, c_int, c_size_t, c_uint, c_uint64, c_void_p


class Location(Structure):
    _fields_ = [("type", c_int), ("id", c_int)]


DEVICE_LOCATION = 1  # CU_MEM_LOCATION_TYPE_DEVICE
ATTACH_GLOBAL = 1
PAINT = 0xA5  # what a neighbour leaves in its memory


def main() -> int:
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuMemAlloc_v2.argtypes = [POINTER(c_uint64), c_size_t]
    cuda.cuMemAllocManaged.argtypes = [POINTER(c_uint64), c_size_t, c_uint]
    cuda.cuMemPrefetchAsync_v2.argtypes = [c_uint64, c_size_t, Location, c_uint, c_void_p]
    ctx = c_void_p()
    if cuda.cuInit(0) or cuda.cuDevicePrimaryCtxRetain(byref(ctx), 0):
        print("init failed", flush=True)
        return 2
    cuda.cuCtxSetCurrent(ctx)
    mode, size = sys.argv[1], int(sys.argv[2])
    ptr = c_uint64()
    if mode == "alloc":
        print(cuda.cuMemAlloc_v2(byref(ptr), size), flush=True)
        return 0
    if mode == "paint":
        cuda.cuMemsetD8_v2.argtypes = [c_uint64, ctypes.c_ubyte, c_size_t]
        r = cuda.cuMemAlloc_v2(byref(ptr), size) or cuda.cuMemsetD8_v2(ptr.value, PAINT, size)
        print(r or cuda.cuCtxSynchronize(), flush=True)
        return 0
    if mode == "peek":
        cuda.cuMemcpyDtoH_v2.argtypes = [c_void_p, c_uint64, c_size_t]
        host = (ctypes.c_ubyte * size)()
        r = cuda.cuMemAlloc_v2(byref(ptr), size) or cuda.cuMemcpyDtoH_v2(host, ptr.value, size)
        if r:
            print(f"peek failed {r}", flush=True)
            return 3
        data = bytes(host)
        print(f"{data.count(PAINT)} {size - data.count(0)}", flush=True)
        return 0
    if mode == "grab":
        count = 0
        while count < 1_000_000 and cuda.cuMemAlloc_v2(byref(ptr), size) == 0:
            count += 1
        print(f"count {count}", flush=True)
    elif mode == "managed":
        r = cuda.cuMemAllocManaged(byref(ptr), size, ATTACH_GLOBAL)
        r = r or cuda.cuMemPrefetchAsync_v2(ptr.value, size, Location(DEVICE_LOCATION, 0), 0, None)
        r = r or cuda.cuCtxSynchronize()
        if r:
            print(f"managed failed {r}", flush=True)
            return 3
    print("ready", flush=True)
    sys.stdin.read()
    return 0


if __name__ == "__main__":
    sys.exit(main())
