"""A small ctypes client of the CUDA driver API: the "GPU work" of Python workloads, tests
and demos in simulation mode (and a thin driver client on a real GPU).

Functions are resolved either by ``dlsym`` (ctypes attribute lookup, like a runtime that
dlopens the driver) or through ``cuGetProcAddress_v2`` (like CUDA >= 11.3 runtimes), so both
interposition paths of the hook can be exercised. Every call raises ``CudaError`` on a
non-zero CUresult; ``try_*`` variants return the code instead.

On the simulated driver, ``launch_busy(ns)`` occupies the device for ``ns`` nanoseconds
(the kernel-duration rule of ``qgpu_sim_busy``; see docs/enforcement.md).
"""

from __future__ import annotations

import collections
import ctypes
from collections.abc import Callable
from ctypes import (
    POINTER,
    byref,
    c_char_p,
    c_float,
    c_int,
    c_size_t,
    c_uint,
    c_uint64,
    c_ulonglong,
    c_void_p,
)
from dataclasses import dataclass
from typing import Any, Literal

CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_NOT_INITIALIZED = 3
CUDA_ERROR_NO_DEVICE = 100
CUDA_ERROR_NOT_FOUND = 500
CUDA_ERROR_NOT_READY = 600

ERROR_NAMES = {
    0: "CUDA_SUCCESS",
    1: "CUDA_ERROR_INVALID_VALUE",
    2: "CUDA_ERROR_OUT_OF_MEMORY",
    3: "CUDA_ERROR_NOT_INITIALIZED",
    4: "CUDA_ERROR_DEINITIALIZED",
    100: "CUDA_ERROR_NO_DEVICE",
    101: "CUDA_ERROR_INVALID_DEVICE",
    201: "CUDA_ERROR_INVALID_CONTEXT",
    400: "CUDA_ERROR_INVALID_HANDLE",
    500: "CUDA_ERROR_NOT_FOUND",
    600: "CUDA_ERROR_NOT_READY",
    999: "CUDA_ERROR_UNKNOWN",
}

AllocApi = Literal["alloc", "pitch", "managed", "create", "async", "pool", "array", "array3d"]
ALLOC_APIS: tuple[str, ...] = (
    "alloc",
    "pitch",
    "managed",
    "create",
    "async",
    "pool",
    "array",
    "array3d",
)
LaunchApi = Literal["kernel", "ex", "coop", "graph"]
BUSY_KERNEL = b"qgpu_sim_busy"


class CudaError(RuntimeError):
    """A driver call returned an error CUresult."""

    def __init__(self, call: str, code: int) -> None:
        self.call = call
        self.code = code
        self.error_name = ERROR_NAMES.get(code, f"CUresult {code}")
        super().__init__(f"{call} failed: {self.error_name} ({code})")


_P = POINTER
_SIGNATURES: dict[str, list[Any]] = {
    "cuInit": [c_uint],
    "cuDriverGetVersion": [_P(c_int)],
    "cuDeviceGetCount": [_P(c_int)],
    "cuDeviceGet": [_P(c_int), c_int],
    "cuDeviceGetName": [c_char_p, c_int, c_int],
    "cuDeviceGetUuid_v2": [c_void_p, c_int],
    "cuDeviceTotalMem_v2": [_P(c_size_t), c_int],
    "cuDeviceGetAttribute": [_P(c_int), c_int, c_int],
    "cuCtxCreate_v2": [_P(c_void_p), c_uint, c_int],
    "cuCtxDestroy_v2": [c_void_p],
    "cuCtxSetCurrent": [c_void_p],
    "cuCtxSynchronize": [],
    "cuDevicePrimaryCtxRetain": [_P(c_void_p), c_int],
    "cuModuleLoadData": [_P(c_void_p), c_char_p],
    "cuModuleGetFunction": [_P(c_void_p), c_void_p, c_char_p],
    "cuMemAlloc_v2": [_P(c_uint64), c_size_t],
    "cuMemAllocPitch_v2": [_P(c_uint64), _P(c_size_t), c_size_t, c_size_t, c_uint],
    "cuMemAllocManaged": [_P(c_uint64), c_size_t, c_uint],
    "cuMemFree_v2": [c_uint64],
    "cuMemGetInfo_v2": [_P(c_size_t), _P(c_size_t)],
    "cuMemCreate": [_P(c_uint64), c_size_t, c_void_p, c_ulonglong],
    "cuMemRelease": [c_uint64],
    "cuMemAllocAsync": [_P(c_uint64), c_size_t, c_void_p],
    "cuMemAllocFromPoolAsync": [_P(c_uint64), c_size_t, c_void_p, c_void_p],
    "cuMemFreeAsync": [c_uint64, c_void_p],
    "cuMemPoolCreate": [_P(c_void_p), c_void_p],
    "cuMemPoolDestroy": [c_void_p],
    "cuArrayCreate_v2": [_P(c_void_p), c_void_p],
    "cuArray3DCreate_v2": [_P(c_void_p), c_void_p],
    "cuArrayDestroy": [c_void_p],
    "cuStreamCreate": [_P(c_void_p), c_uint],
    "cuStreamDestroy_v2": [c_void_p],
    "cuStreamSynchronize": [c_void_p],
    "cuEventCreate": [_P(c_void_p), c_uint],
    "cuEventRecord": [c_void_p, c_void_p],
    "cuEventSynchronize": [c_void_p],
    "cuEventQuery": [c_void_p],
    "cuEventElapsedTime": [_P(c_float), c_void_p, c_void_p],
    "cuEventDestroy_v2": [c_void_p],
    "cuLaunchKernel": [
        c_void_p,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_void_p,
        c_void_p,
        c_void_p,
    ],
    "cuLaunchCooperativeKernel": [
        c_void_p,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_void_p,
        c_void_p,
    ],
    "cuLaunchKernelEx": [c_void_p, c_void_p, c_void_p, c_void_p],
    "cuGraphCreate": [_P(c_void_p), c_uint],
    "cuGraphAddKernelNode_v2": [_P(c_void_p), c_void_p, c_void_p, c_size_t, c_void_p],
    "cuGraphInstantiateWithFlags": [_P(c_void_p), c_void_p, c_ulonglong],
    "cuGraphLaunch": [c_void_p, c_void_p],
    "cuGraphExecDestroy": [c_void_p],
    "cuGraphDestroy": [c_void_p],
    "cuGetProcAddress_v2": [c_char_p, _P(c_void_p), c_int, c_uint64, _P(c_int)],
}


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", c_int), ("id", c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class MemAllocationProp(ctypes.Structure):
    _fields_ = [
        ("type", c_int),
        ("requestedHandleTypes", c_int),
        ("location", _MemLocation),
        ("win32HandleMetaData", c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class MemPoolProps(ctypes.Structure):
    _fields_ = [
        ("allocType", c_int),
        ("handleTypes", c_int),
        ("location", _MemLocation),
        ("win32SecurityAttributes", c_void_p),
        ("maxSize", c_size_t),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 54),
    ]


class ArrayDescriptor(ctypes.Structure):
    _fields_ = [
        ("Width", c_size_t),
        ("Height", c_size_t),
        ("Format", c_int),
        ("NumChannels", c_uint),
    ]


class Array3DDescriptor(ctypes.Structure):
    _fields_ = [
        ("Width", c_size_t),
        ("Height", c_size_t),
        ("Depth", c_size_t),
        ("Format", c_int),
        ("NumChannels", c_uint),
        ("Flags", c_uint),
    ]


class LaunchConfig(ctypes.Structure):
    _fields_ = [
        ("gridDimX", c_uint),
        ("gridDimY", c_uint),
        ("gridDimZ", c_uint),
        ("blockDimX", c_uint),
        ("blockDimY", c_uint),
        ("blockDimZ", c_uint),
        ("sharedMemBytes", c_uint),
        ("hStream", c_void_p),
        ("attrs", c_void_p),
        ("numAttrs", c_uint),
    ]


class KernelNodeParams(ctypes.Structure):
    _fields_ = [
        ("func", c_void_p),
        ("gridDimX", c_uint),
        ("gridDimY", c_uint),
        ("gridDimZ", c_uint),
        ("blockDimX", c_uint),
        ("blockDimY", c_uint),
        ("blockDimZ", c_uint),
        ("sharedMemBytes", c_uint),
        ("kernelParams", c_void_p),
        ("extra", c_void_p),
        ("kern", c_void_p),
        ("ctx", c_void_p),
    ]


CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_AD_FORMAT_FLOAT = 0x20
CU_MEM_ATTACH_GLOBAL = 1


@dataclass
class Allocation:
    """Device memory obtained through one of the allocation APIs."""

    api: str
    handle: int
    size: int


class Driver:
    """The driver API through ctypes. ``resolve="dlsym"`` looks functions up by name;
    ``resolve="getproc"`` asks ``cuGetProcAddress_v2`` for the base names."""

    def __init__(
        self,
        library: str = "libcuda.so.1",
        resolve: Literal["dlsym", "getproc"] = "dlsym",
        cuda_version: int = 12040,
    ) -> None:
        self.lib = ctypes.CDLL(library, mode=ctypes.RTLD_GLOBAL)
        self.resolve = resolve
        self.cuda_version = cuda_version
        self._fns: dict[str, Any] = {}
        self._busy_fn: int | None = None
        self._pool: int | None = None
        self._arrays: dict[int, Any] = {}

    # -- plumbing --
    def function(self, name: str) -> Any:
        """The callable for an exported driver symbol, resolved the configured way."""
        fn = self._fns.get(name)
        if fn is not None:
            return fn
        argtypes = _SIGNATURES[name]
        if self.resolve == "dlsym" or name == "cuGetProcAddress_v2":
            fn = getattr(self.lib, name)
            fn.argtypes = argtypes
            fn.restype = c_int
        else:
            base = name[:-3] if name[-3:] in ("_v2", "_v3") else name
            ptr = c_void_p()
            status = c_int()
            code = self.function("cuGetProcAddress_v2")(
                base.encode(), byref(ptr), self.cuda_version, 0, byref(status)
            )
            if code != CUDA_SUCCESS or not ptr.value:
                raise CudaError(f"cuGetProcAddress_v2({base})", code or CUDA_ERROR_NOT_FOUND)
            fn = ctypes.CFUNCTYPE(c_int, *argtypes)(ptr.value)
        self._fns[name] = fn
        return fn

    def address(self, name: str) -> int:
        """The address a lookup of ``name`` yields (to see whose function it is)."""
        fn = self.function(name)
        return ctypes.cast(fn, c_void_p).value or 0

    def call(self, name: str, *args: Any) -> int:
        return int(self.function(name)(*args))

    def check(self, name: str, *args: Any) -> None:
        code = self.call(name, *args)
        if code != CUDA_SUCCESS:
            raise CudaError(name, code)

    # -- init and devices --
    def try_init(self) -> int:
        return self.call("cuInit", 0)

    def init(self) -> None:
        self.check("cuInit", 0)

    def device_count(self) -> int:
        n = c_int()
        self.check("cuDeviceGetCount", byref(n))
        return n.value

    def device(self, ordinal: int = 0) -> int:
        d = c_int()
        self.check("cuDeviceGet", byref(d), ordinal)
        return d.value

    def device_name(self, dev: int = 0) -> str:
        buf = ctypes.create_string_buffer(256)
        self.check("cuDeviceGetName", buf, 256, dev)
        return buf.value.decode()

    def device_uuid(self, dev: int = 0) -> str:
        raw = (ctypes.c_ubyte * 16)()
        self.check("cuDeviceGetUuid_v2", raw, dev)
        h = bytes(raw).hex()
        return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"

    def device_total_mem(self, dev: int = 0) -> int:
        v = c_size_t()
        self.check("cuDeviceTotalMem_v2", byref(v), dev)
        return v.value

    def device_attribute(self, attribute: int, dev: int = 0) -> int:
        v = c_int()
        self.check("cuDeviceGetAttribute", byref(v), attribute, dev)
        return v.value

    def context(self, dev: int = 0) -> int:
        """Retain the primary context of ``dev`` and make it current."""
        ctx = c_void_p()
        self.check("cuDevicePrimaryCtxRetain", byref(ctx), dev)
        self.check("cuCtxSetCurrent", ctx)
        return ctx.value or 0

    def ctx_synchronize(self) -> None:
        self.check("cuCtxSynchronize")

    # -- memory --
    def mem_get_info(self) -> tuple[int, int]:
        free, total = c_size_t(), c_size_t()
        self.check("cuMemGetInfo_v2", byref(free), byref(total))
        return free.value, total.value

    def try_mem_alloc(self, size: int, api: str = "alloc") -> tuple[int, Allocation | None]:
        """Allocate ``size`` bytes through ``api``; returns (CUresult, allocation)."""
        out = c_uint64()
        if api == "alloc":
            code = self.call("cuMemAlloc_v2", byref(out), size)
        elif api == "pitch":
            pitch = c_size_t()
            # rows of 1 MiB (a multiple of the pitch alignment): exactly `size` bytes
            width = 1 << 20
            code = self.call(
                "cuMemAllocPitch_v2", byref(out), byref(pitch), width, max(1, size // width), 4
            )
        elif api == "managed":
            code = self.call("cuMemAllocManaged", byref(out), size, CU_MEM_ATTACH_GLOBAL)
        elif api == "create":
            prop = MemAllocationProp()
            prop.type = CU_MEM_ALLOCATION_TYPE_PINNED
            prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE
            prop.location.id = 0
            code = self.call("cuMemCreate", byref(out), size, byref(prop), 0)
        elif api == "async":
            code = self.call("cuMemAllocAsync", byref(out), size, None)
        elif api == "pool":
            code = self.call("cuMemAllocFromPoolAsync", byref(out), size, self.pool(), None)
        elif api in ("array", "array3d"):
            return self._try_array(size, api)
        else:
            raise ValueError(f"api must be one of {', '.join(ALLOC_APIS)}, not {api!r}")
        return code, (Allocation(api, out.value, size) if code == CUDA_SUCCESS else None)

    def _try_array(self, size: int, api: str) -> tuple[int, Allocation | None]:
        arr = c_void_p()
        width = 1 << 16  # 64 Ki floats per row: 256 KiB
        rows = max(1, size // (width * 4))
        if api == "array":
            d = ArrayDescriptor(width, rows, CU_AD_FORMAT_FLOAT, 1)
            code = self.call("cuArrayCreate_v2", byref(arr), byref(d))
        else:
            d3 = Array3DDescriptor(width, rows, 1, CU_AD_FORMAT_FLOAT, 1, 0)
            code = self.call("cuArray3DCreate_v2", byref(arr), byref(d3))
        if code != CUDA_SUCCESS:
            return code, None
        return code, Allocation(api, arr.value or 0, size)

    def mem_alloc(self, size: int, api: str = "alloc") -> Allocation:
        code, alloc = self.try_mem_alloc(size, api)
        if code != CUDA_SUCCESS or alloc is None:
            raise CudaError(f"allocation via {api}", code)
        return alloc

    def mem_free(self, alloc: Allocation) -> None:
        if alloc.api in ("alloc", "pitch", "managed"):
            self.check("cuMemFree_v2", alloc.handle)
        elif alloc.api == "create":
            self.check("cuMemRelease", alloc.handle)
        elif alloc.api in ("async", "pool"):
            self.check("cuMemFreeAsync", alloc.handle, None)
        else:
            self.check("cuArrayDestroy", alloc.handle)

    def pool(self) -> int:
        if self._pool is None:
            props = MemPoolProps()
            props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED
            props.location.type = CU_MEM_LOCATION_TYPE_DEVICE
            props.location.id = 0
            p = c_void_p()
            self.check("cuMemPoolCreate", byref(p), byref(props))
            self._pool = p.value or 0
        return self._pool

    # -- streams, events --
    def stream(self) -> int:
        s = c_void_p()
        self.check("cuStreamCreate", byref(s), 0)
        return s.value or 0

    def stream_synchronize(self, stream: int | None = None) -> None:
        self.check("cuStreamSynchronize", stream)

    def event(self) -> int:
        e = c_void_p()
        self.check("cuEventCreate", byref(e), 0)
        return e.value or 0

    def event_record(self, event: int, stream: int | None = None) -> None:
        self.check("cuEventRecord", event, stream)

    def event_synchronize(self, event: int) -> None:
        self.check("cuEventSynchronize", event)

    def event_query(self, event: int) -> int:
        return self.call("cuEventQuery", event)

    def event_elapsed_ms(self, start: int, end: int) -> float:
        ms = c_float()
        self.check("cuEventElapsedTime", byref(ms), start, end)
        return ms.value

    def event_destroy(self, event: int) -> None:
        self.check("cuEventDestroy_v2", event)

    # -- launches --
    def busy_function(self) -> int:
        """The simulator's ``qgpu_sim_busy`` kernel (its first parameter is nanoseconds)."""
        if self._busy_fn is None:
            mod, fn = c_void_p(), c_void_p()
            self.check("cuModuleLoadData", byref(mod), b"qgpu-sim-module")
            self.check("cuModuleGetFunction", byref(fn), mod, BUSY_KERNEL)
            self._busy_fn = fn.value or 0
        return self._busy_fn

    def try_launch_busy(self, ns: int, stream: int | None = None, api: str = "kernel") -> int:
        """Launch a kernel that occupies the simulated device for ``ns`` nanoseconds."""
        fn = self.busy_function()
        arg = c_uint64(ns)
        params = (c_void_p * 1)(ctypes.cast(byref(arg), c_void_p))
        if api == "kernel":
            return self.call("cuLaunchKernel", fn, 1, 1, 1, 1, 1, 1, 0, stream, params, None)
        if api == "coop":
            return self.call("cuLaunchCooperativeKernel", fn, 1, 1, 1, 1, 1, 1, 0, stream, params)
        if api == "ex":
            cfg = LaunchConfig(1, 1, 1, 1, 1, 1, 0, stream, None, 0)
            return self.call("cuLaunchKernelEx", byref(cfg), fn, params, None)
        if api == "graph":
            return self._launch_graph(fn, params, stream)
        raise ValueError(f"api must be kernel, ex, coop or graph, not {api!r}")

    def _launch_graph(self, fn: int, params: Any, stream: int | None) -> int:
        graph, node, exe = c_void_p(), c_void_p(), c_void_p()
        self.check("cuGraphCreate", byref(graph), 0)
        p = KernelNodeParams(
            fn, 1, 1, 1, 1, 1, 1, 0, ctypes.cast(params, c_void_p), None, None, None
        )
        self.check("cuGraphAddKernelNode_v2", byref(node), graph, None, 0, byref(p))
        self.check("cuGraphInstantiateWithFlags", byref(exe), graph, 0)
        code = self.call("cuGraphLaunch", exe, stream)
        self.check("cuGraphExecDestroy", exe)
        self.check("cuGraphDestroy", graph)
        return code

    def launch_busy(self, ns: int, stream: int | None = None, api: str = "kernel") -> None:
        code = self.try_launch_busy(ns, stream, api)
        if code != CUDA_SUCCESS:
            raise CudaError(f"launch via {api}", code)


def open_driver(resolve: Literal["dlsym", "getproc"] = "dlsym", device: int = 0) -> Driver:
    """cuInit + primary context of ``device``: ready for allocations and launches."""
    drv = Driver(resolve=resolve)
    drv.init()
    drv.context(drv.device(device))
    return drv


def burn(
    drv: Driver,
    ns: int,
    depth: int,
    should_stop: Callable[[], bool],
    api: str = "kernel",
) -> int:
    """Keep the device busy with ``ns``-nanosecond kernels, at most ``depth`` in flight,
    until ``should_stop()``; returns the number of launches."""
    free_events: list[int] = []
    inflight: collections.deque[int] = collections.deque()
    launches = 0
    while not should_stop():
        drv.launch_busy(ns, api=api)
        launches += 1
        ev = free_events.pop() if free_events else drv.event()
        drv.event_record(ev)
        inflight.append(ev)
        if len(inflight) >= depth:
            done = inflight.popleft()
            drv.event_synchronize(done)
            free_events.append(done)
    drv.ctx_synchronize()
    return launches


def _main(argv: list[str] | None = None) -> int:
    """``python -m enforcement.simcuda burn``: a saturating workload that runs until its
    stdin closes (or ``--seconds``); prints ``ready`` once its context exists."""
    import argparse
    import sys
    import threading
    import time

    p = argparse.ArgumentParser(prog="python -m enforcement.simcuda")
    p.add_argument("mode", choices=["burn"])
    p.add_argument("--ns", type=int, default=5_000_000, help="kernel duration")
    p.add_argument("--depth", type=int, default=8, help="kernels in flight")
    p.add_argument("--seconds", type=float, default=120.0)
    p.add_argument("--api", default="kernel", choices=["kernel", "ex", "coop", "graph"])
    p.add_argument("--resolve", default="dlsym", choices=["dlsym", "getproc"])
    args = p.parse_args(argv)
    drv = open_driver(args.resolve)
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    end = time.monotonic() + args.seconds
    print("ready", flush=True)
    burn(drv, args.ns, args.depth, lambda: stop.is_set() or time.monotonic() >= end, args.api)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
