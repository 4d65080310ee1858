"""A process that shares device memory through the (simulated) driver, driven line by line by
a test (run as a script): ``sharer.py [SOCKET_FD]``, then one command per line on stdin and
one JSON object per line on stdout, always with ``r`` (the CUresult, 0 for local steps).

VMM: ``create MIB TYPES [host]`` -> h; ``export H [TYPE]`` -> fd; ``import FD [TYPE]`` -> h;
``props H``; ``map H MIB`` (reserve + map) -> va; ``unmap VA MIB``; ``release H``.
Descriptors over the unix socket SOCKET_FD: ``send FD``, ``recv`` -> fd; ``close FD``.
Plain memory and legacy IPC: ``alloc MIB [managed|async]`` -> p; ``free P``; ``ipcget P`` ->
hex; ``ipcopen HEX [FLAGS]`` -> p; ``ipcclose P``; ``range P`` -> base, size.
``used`` -> used (cuMemGetInfo: total - free); ``attr N`` -> value.
Pools: ``pool TYPES`` -> pool; ``palloc POOL MIB`` -> p; ``pfree P`` (cuMemFreeAsync, then
synchronised); ``pexport POOL [TYPE]`` -> fd; ``pimport FD [TYPE]`` -> pool; ``pexportptr P``
-> hex; ``pimportptr POOL HEX`` -> p; ``ptrim POOL MIB``; ``pdestroy POOL``; ``pattr POOL N``
-> value; ``sync``.
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import sys
from ctypes import POINTER, Structure, byref, c_char, c_int, c_size_t, c_uint, c_uint64, c_void_p
from typing import Any

from enforcement.simcuda import MemAllocationProp, MemPoolProps

MIB = 1 << 20
POSIX_FD = 1


class IpcMemHandle(Structure):
    _fields_ = [("reserved", c_char * 64)]


class PoolPtrExportData(Structure):
    _fields_ = [("reserved", c_char * 64)]


def driver() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    p = POINTER
    sigs: dict[str, list[Any]] = {
        "cuMemCreate": [p(c_uint64), c_size_t, c_void_p, c_uint64],
        "cuMemRelease": [c_uint64],
        "cuMemExportToShareableHandle": [c_void_p, c_uint64, c_int, c_uint64],
        "cuMemImportFromShareableHandle": [p(c_uint64), c_void_p, c_int],
        "cuMemGetAllocationPropertiesFromHandle": [c_void_p, c_uint64],
        "cuMemAddressReserve": [p(c_uint64), c_size_t, c_size_t, c_uint64, c_uint64],
        "cuMemMap": [c_uint64, c_size_t, c_size_t, c_uint64, c_uint64],
        "cuMemUnmap": [c_uint64, c_size_t],
        "cuMemAlloc_v2": [p(c_uint64), c_size_t],
        "cuMemAllocManaged": [p(c_uint64), c_size_t, c_uint],
        "cuMemAllocAsync": [p(c_uint64), c_size_t, c_void_p],
        "cuMemFree_v2": [c_uint64],
        "cuIpcGetMemHandle": [p(IpcMemHandle), c_uint64],
        "cuIpcOpenMemHandle_v2": [p(c_uint64), IpcMemHandle, c_uint],
        "cuIpcCloseMemHandle": [c_uint64],
        "cuMemGetAddressRange_v2": [p(c_uint64), p(c_size_t), c_uint64],
        "cuMemGetInfo_v2": [p(c_size_t), p(c_size_t)],
        "cuDeviceGetAttribute": [p(c_int), c_int, c_int],
        "cuMemPoolCreate": [p(c_void_p), c_void_p],
        "cuMemAllocFromPoolAsync": [p(c_uint64), c_size_t, c_void_p, c_void_p],
        "cuMemFreeAsync": [c_uint64, c_void_p],
        "cuMemPoolExportToShareableHandle": [c_void_p, c_void_p, c_int, c_uint64],
        "cuMemPoolImportFromShareableHandle": [p(c_void_p), c_void_p, c_int, c_uint64],
        "cuMemPoolExportPointer": [p(PoolPtrExportData), c_uint64],
        "cuMemPoolImportPointer": [p(c_uint64), c_void_p, p(PoolPtrExportData)],
        "cuMemPoolTrimTo": [c_void_p, c_size_t],
        "cuMemPoolDestroy": [c_void_p],
        "cuMemPoolGetAttribute": [c_void_p, c_int, c_void_p],
    }
    for name, args in sigs.items():
        getattr(lib, name).argtypes = args
    assert lib.cuInit(0) == 0
    ctx = c_void_p()
    assert lib.cuDevicePrimaryCtxRetain(byref(ctx), 0) == 0 and lib.cuCtxSetCurrent(ctx) == 0
    return lib


def pool_command(lib: ctypes.CDLL, cmd: str, a: list[str]) -> dict[str, Any]:
    if cmd == "pool":
        props = MemPoolProps()
        props.allocType, props.handleTypes = 1, int(a[0])
        props.location.type, props.location.id = 1, 0
        pool = c_void_p()
        return {"r": lib.cuMemPoolCreate(byref(pool), byref(props)), "pool": pool.value}
    if cmd == "palloc":
        ptr = c_uint64()
        r = lib.cuMemAllocFromPoolAsync(byref(ptr), int(a[1]) * MIB, int(a[0]), None)
        return {"r": r or lib.cuCtxSynchronize(), "p": ptr.value}
    if cmd == "pfree":
        return {"r": lib.cuMemFreeAsync(int(a[0]), None) or lib.cuCtxSynchronize()}
    if cmd == "pexport":
        fd = c_int(-1)
        t = int(a[1]) if a[1:] else POSIX_FD
        return {"r": lib.cuMemPoolExportToShareableHandle(byref(fd), int(a[0]), t, 0),
                "fd": fd.value}  # fmt: skip
    if cmd == "pimport":
        pool = c_void_p()
        t = int(a[1]) if a[1:] else POSIX_FD
        return {"r": lib.cuMemPoolImportFromShareableHandle(byref(pool), int(a[0]), t, 0),
                "pool": pool.value}  # fmt: skip
    if cmd == "pexportptr":
        data = PoolPtrExportData()
        return {"r": lib.cuMemPoolExportPointer(byref(data), int(a[0])), "hex": bytes(data).hex()}
    if cmd == "pimportptr":
        data = PoolPtrExportData.from_buffer_copy(bytes.fromhex(a[1]))
        ptr = c_uint64()
        return {"r": lib.cuMemPoolImportPointer(byref(ptr), int(a[0]), byref(data)),
                "p": ptr.value}  # fmt: skip
    if cmd == "ptrim":
        return {"r": lib.cuMemPoolTrimTo(int(a[0]), int(a[1]) * MIB)}
    if cmd == "pdestroy":
        return {"r": lib.cuMemPoolDestroy(int(a[0]))}
    if cmd == "pattr":
        v = c_uint64()
        return {"r": lib.cuMemPoolGetAttribute(int(a[0]), int(a[1]), byref(v)), "value": v.value}
    if cmd == "sync":
        return {"r": lib.cuCtxSynchronize()}
    return {"r": -1, "error": f"unknown command {cmd}"}


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1])) if len(sys.argv) > 1 else None
    lib = driver()
    for line in sys.stdin:
        cmd, *a = line.split()
        out: dict[str, Any] = {"r": 0}
        if cmd == "create":
            prop = MemAllocationProp()
            prop.type, prop.requestedHandleTypes = 1, int(a[1])
            prop.location.type = 2 if a[2:] == ["host"] else 1
            h = c_uint64()
            out = {"r": lib.cuMemCreate(byref(h), int(a[0]) * MIB, byref(prop), 0), "h": h.value}
        elif cmd == "export":
            fd = c_int(-1)
            t = int(a[1]) if a[1:] else POSIX_FD
            out = {
                "r": lib.cuMemExportToShareableHandle(byref(fd), int(a[0]), t, 0),
                "fd": fd.value,
            }
        elif cmd == "import":
            h = c_uint64()
            t = int(a[1]) if a[1:] else POSIX_FD
            out = {"r": lib.cuMemImportFromShareableHandle(byref(h), int(a[0]), t), "h": h.value}
        elif cmd == "props":
            prop = MemAllocationProp()
            out = {"r": lib.cuMemGetAllocationPropertiesFromHandle(byref(prop), int(a[0]))}
            out.update(type=prop.type, types=prop.requestedHandleTypes,
                       loc=[prop.location.type, prop.location.id])  # fmt: skip
        elif cmd == "map":
            va = c_uint64()
            size = int(a[1]) * MIB
            r = lib.cuMemAddressReserve(byref(va), size, 0, 0, 0)
            out = {"r": r or lib.cuMemMap(va.value, size, 0, int(a[0]), 0), "va": va.value}
        elif cmd == "unmap":
            out = {"r": lib.cuMemUnmap(int(a[0]), int(a[1]) * MIB)}
        elif cmd == "release":
            out = {"r": lib.cuMemRelease(int(a[0]))}
        elif cmd == "send":
            assert sock is not None
            socket.send_fds(sock, [b"F"], [int(a[0])])
        elif cmd == "recv":
            assert sock is not None
            _, fds, _, _ = socket.recv_fds(sock, 1, 1)
            out["fd"] = fds[0] if fds else -1
        elif cmd == "close":
            os.close(int(a[0]))
        elif cmd == "alloc":
            p = c_uint64()
            size, kind = int(a[0]) * MIB, a[1] if a[1:] else "plain"
            if kind == "managed":
                r = lib.cuMemAllocManaged(byref(p), size, 1)
            elif kind == "async":
                r = lib.cuMemAllocAsync(byref(p), size, None)
            else:
                r = lib.cuMemAlloc_v2(byref(p), size)
            out = {"r": r, "p": p.value}
        elif cmd == "free":
            out = {"r": lib.cuMemFree_v2(int(a[0]))}
        elif cmd == "ipcget":
            ipc = IpcMemHandle()
            out = {"r": lib.cuIpcGetMemHandle(byref(ipc), int(a[0])), "hex": bytes(ipc).hex()}
        elif cmd == "ipcopen":
            ipc = IpcMemHandle.from_buffer_copy(bytes.fromhex(a[0]))
            p = c_uint64()
            flags = int(a[1]) if a[1:] else 1
            out = {"r": lib.cuIpcOpenMemHandle_v2(byref(p), ipc, flags), "p": p.value}
        elif cmd == "ipcclose":
            out = {"r": lib.cuIpcCloseMemHandle(int(a[0]))}
        elif cmd == "range":
            base, size_out = c_uint64(), c_size_t()
            r = lib.cuMemGetAddressRange_v2(byref(base), byref(size_out), int(a[0]))
            out = {"r": r, "base": base.value, "size": size_out.value}
        elif cmd == "used":
            free, total = c_size_t(), c_size_t()
            out = {"r": lib.cuMemGetInfo_v2(byref(free), byref(total))}
            out["used"] = total.value - free.value
        elif cmd == "attr":
            v = c_int()
            out = {"r": lib.cuDeviceGetAttribute(byref(v), int(a[0]), 0), "value": v.value}
        elif cmd.startswith("p") or cmd == "sync":
            out = pool_command(lib, cmd, a)
        else:
            out = {"r": -1, "error": f"unknown command {cmd}"}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
