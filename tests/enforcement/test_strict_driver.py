"""The simulated driver follows NVIDIA's documented rules, not the interposer's assumptions
(issue 16, "What to build" 1): cuGetProcAddress resolves (name, cudaVersion, flags) as
cudaTypedefs.h states and hands out internal entry points, the unversioned v1 exports exist,
cuDriverGetVersion answers the configured 12.x/13.x version before cuInit, cuCtxCreate_v4,
green contexts, device attributes NVML-driven limiters need, cuGetExportTable, and a
statically linked program can load it. Each test here failed on the simulator before
commit 4b11bae (see docs/enforcement.md, "The simulated driver")."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import enforcement.native
from enforcement.native import sim_library_dir
from enforcement.sim import GREEN_CONTEXT_MEMORY, write_sim_config

from .conftest import CTX, GIB, Sim, run_json

SUCCESS, NOT_FOUND, INVALID_VALUE, NOT_SUPPORTED = 0, 500, 1, 801
# CUdriverProcAddressQueryResult
FOUND, SYMBOL_NOT_FOUND, VERSION_NOT_SUFFICIENT = 0, 1, 2
LEGACY, PER_THREAD = 1, 2  # CU_GET_PROC_ADDRESS_* flags


def make_sim(tmp: Path, name: str, **options: object) -> Sim:
    cfg = write_sim_config(tmp / f"{name}.conf", "H100-80GB,T4", node=f"strict-{name}", **options)
    return Sim(cfg, tmp / f"{name}-ledgers")


# Asks cuGetProcAddress_v2 for each (name, cudaVersion, flags) of argv[1] and tells which
# exported symbol (of argv[2]) each answer is, by address.
PROCADDR = """
import ctypes, json, sys
from ctypes import POINTER, byref, c_char_p, c_int, c_uint64, c_void_p
lib = ctypes.CDLL("libcuda.so.1")
gpa = lib.cuGetProcAddress_v2
gpa.argtypes = [c_char_p, POINTER(c_void_p), c_int, c_uint64, POINTER(c_int)]
def address(name):
    try:
        return ctypes.cast(getattr(lib, name), c_void_p).value
    except AttributeError:
        return None
symbols = {address(n): n for n in json.loads(sys.argv[2]) if address(n)}
out = []
for name, version, flags in json.loads(sys.argv[1]):
    p, st = c_void_p(), c_int(-1)
    r = gpa(name.encode(), byref(p), version, flags, byref(st))
    out.append([r, st.value, symbols.get(p.value, p.value and hex(p.value))])
print(json.dumps(out))
"""

# (name, cudaVersion, flags) -> the exported symbol a 13.0 driver serves for it
RESOLVES_13000 = [
    (("cuMemAlloc", 2000, 0), "cuMemAlloc"),
    (("cuMemAlloc", 3010, 0), "cuMemAlloc"),
    (("cuMemAlloc", 3020, 0), "cuMemAlloc_v2"),
    (("cuMemAlloc", 13000, 0), "cuMemAlloc_v2"),
    (("cuMemGetInfo", 2000, 0), "cuMemGetInfo"),
    (("cuDeviceTotalMem", 2000, 0), "cuDeviceTotalMem"),
    (("cuArrayCreate", 2000, 0), "cuArrayCreate"),
    (("cuCtxCreate", 2000, 0), "cuCtxCreate"),
    (("cuCtxCreate", 3020, 0), "cuCtxCreate_v2"),
    (("cuCtxCreate", 11040, 0), "cuCtxCreate_v3"),
    (("cuCtxCreate", 12040, 0), "cuCtxCreate_v3"),
    (("cuCtxCreate", 12050, 0), "cuCtxCreate_v4"),
    (("cuCtxCreate", 13000, 0), "cuCtxCreate_v4"),
    (("cuStreamSynchronize", 13000, 0), "cuStreamSynchronize"),
    (("cuStreamSynchronize", 13000, LEGACY), "cuStreamSynchronize"),
    (("cuStreamSynchronize", 13000, PER_THREAD), "cuStreamSynchronize_ptsz"),
    (("cuLaunchKernel", 13000, PER_THREAD), "cuLaunchKernel_ptsz"),
    (("cuMemFreeAsync", 13000, PER_THREAD), "cuMemFreeAsync_ptsz"),
    (("cuDriverGetVersion", 13000, PER_THREAD), "cuDriverGetVersion"),  # no ptsz form
    (("cuGetProcAddress", 11030, 0), "cuGetProcAddress"),
    (("cuGetProcAddress", 13000, 0), "cuGetProcAddress_v2"),
    (("cuEventElapsedTime", 12000, 0), "cuEventElapsedTime"),
    (("cuEventElapsedTime", 13000, 0), "cuEventElapsedTime_v2"),
    (("cuGreenCtxCreate", 13000, 0), "cuGreenCtxCreate"),
]
# (name, cudaVersion, flags) -> (CUresult, query status) of a 13.0 driver
REFUSES_13000 = [
    (("cuMemGetInfo", 1000, 0), (NOT_FOUND, VERSION_NOT_SUFFICIENT)),
    (("cuGreenCtxCreate", 12030, 0), (NOT_FOUND, VERSION_NOT_SUFFICIENT)),
    (("cuCtxCreate_v4", 13000, 0), (NOT_FOUND, SYMBOL_NOT_FOUND)),  # base names only
    (("cuQgpuNoSuchEntryPoint", 13000, 0), (NOT_FOUND, SYMBOL_NOT_FOUND)),
]
# what a 12.4 driver serves: nothing newer than 12.4, whatever the caller was built for
RESOLVES_12040 = [
    (("cuCtxCreate", 13000, 0), "cuCtxCreate_v3"),
    (("cuEventElapsedTime", 13000, 0), "cuEventElapsedTime"),
    (("cuGreenCtxCreate", 13000, 0), "cuGreenCtxCreate"),
    (("cuMemAlloc", 13000, 0), "cuMemAlloc_v2"),
]
REFUSES_12040 = [
    (("cuCheckpointProcessCheckpoint", 13000, 0), (NOT_FOUND, SYMBOL_NOT_FOUND)),  # 12.8
]


def ask(sim: Sim, queries: list[tuple[str, int, int]], symbols: set[str]) -> list[list]:
    return run_json(sim.base_env(), PROCADDR, json.dumps(queries), json.dumps(sorted(symbols)))


@pytest.mark.parametrize(
    ("version", "resolves", "refuses"),
    [(13000, RESOLVES_13000, REFUSES_13000), (12040, RESOLVES_12040, REFUSES_12040)],
)
def test_strict_getprocaddress_follows_cudatypedefs(
    short_tmp: Path,
    version: int,
    resolves: list,
    refuses: list,
) -> None:
    """With `procaddr = exported` an answer is the exported symbol itself, so which form the
    driver chose can be read off its address."""
    sim = make_sim(short_tmp, f"pa{version}", cuda_version=version, procaddr="exported")
    queries = [q for q, _ in resolves] + [q for q, _ in refuses]
    symbols = {s for _, s in resolves} | {q[0] for q in queries}
    symbols |= {f"{q[0]}{sfx}" for q in queries for sfx in ("_v2", "_v3", "_v4", "_ptsz")}
    answers = ask(sim, queries, symbols)
    for (query, symbol), (code, status, got) in zip(resolves, answers, strict=False):
        assert (code, status, got) == (SUCCESS, FOUND, symbol), query
    refused = answers[len(resolves) :]
    for (query, expected), (code, status, got) in zip(refuses, refused, strict=True):
        assert (code, status, got) == (*expected, None), query


BAD_FLAGS = """
import ctypes, json
from ctypes import POINTER, byref, c_char_p, c_int, c_uint64, c_void_p
lib = ctypes.CDLL("libcuda.so.1")
gpa = lib.cuGetProcAddress_v2
gpa.argtypes = [c_char_p, POINTER(c_void_p), c_int, c_uint64, POINTER(c_int)]
p = c_void_p()
print(json.dumps([gpa(b"cuMemAlloc", byref(p), 13000, 4, None),
                  gpa(b"cuMemAlloc", None, 13000, 0, None), gpa(None, byref(p), 13000, 0, None)]))
"""


def test_strict_getprocaddress_refuses_bad_arguments(sim: Sim) -> None:
    assert run_json(sim.base_env(), BAD_FLAGS) == [INVALID_VALUE] * 3


# Internal entry points: the addresses cuGetProcAddress returns are not dlsym's, yet they are
# the functions (called here through them).
INTERNAL = """
import ctypes, json, sys
from ctypes import CFUNCTYPE, POINTER, byref, c_char_p, c_int, c_size_t, c_uint, c_uint64, c_void_p
lib = ctypes.CDLL("libcuda.so.1")
gpa = lib.cuGetProcAddress_v2
gpa.argtypes = [c_char_p, POINTER(c_void_p), c_int, c_uint64, POINTER(c_int)]
def get(name, version=13000):
    p = c_void_p()
    assert gpa(name.encode(), byref(p), version, 0, None) == 0, name
    return p.value
names = ["cuInit", "cuDriverGetVersion", "cuMemAlloc", "cuMemGetInfo", "cuGetProcAddress",
         "cuLaunchKernel", "cuCtxCreate", "cuMemcpyHtoD"]
exported = {ctypes.cast(getattr(lib, n + s), c_void_p).value
            for n in names for s in ("", "_v2", "_v3", "_v4") if hasattr(lib, n + s)}
got = {n: get(n) for n in names}
version = c_int()
CFUNCTYPE(c_int, POINTER(c_int))(got["cuDriverGetVersion"])(byref(version))
init = CFUNCTYPE(c_int, c_uint)(got["cuInit"])(0)
ctx = c_void_p()
create = CFUNCTYPE(c_int, POINTER(c_void_p), c_void_p, c_uint, c_int)(got["cuCtxCreate"])
created = create(byref(ctx), None, 0, 0)
free, total = c_size_t(), c_size_t()
getinfo = CFUNCTYPE(c_int, POINTER(c_size_t), POINTER(c_size_t))(get("cuMemGetInfo"))
getinfo(byref(free), byref(total))
# the getter handed out by the getter works too
inner = c_void_p()
CFUNCTYPE(c_int, c_char_p, POINTER(c_void_p), c_int, c_uint64, POINTER(c_int))(
    got["cuGetProcAddress"])(b"cuDriverGetVersion", byref(inner), 13000, 0, None)
copy = CFUNCTYPE(c_int, c_uint64, c_void_p, c_size_t)(got["cuMemcpyHtoD"])(0, None, 0)
print(json.dumps({
    "distinct": sorted(set(got) - {n for n, a in got.items() if a in exported}),
    "version": version.value, "init": init, "created": created, "total": total.value,
    "inner_is_internal": inner.value not in exported, "memcpy": copy,
}))
"""


def test_strict_getprocaddress_hands_out_internal_entry_points(short_tmp: Path) -> None:
    sim = make_sim(short_tmp, "internal", cuda_version=12080)
    out = run_json(sim.base_env(), INTERNAL)
    assert out["distinct"] == sorted(
        ["cuInit", "cuDriverGetVersion", "cuMemAlloc", "cuMemGetInfo", "cuGetProcAddress",
         "cuLaunchKernel", "cuCtxCreate", "cuMemcpyHtoD"]
    )  # fmt: skip
    assert out["version"] == 12080 and out["init"] == SUCCESS and out["created"] == SUCCESS
    assert out["total"] == 80 * GIB
    assert out["inner_is_internal"]
    # an entry point the simulator does not model answers NOT_SUPPORTED, never crashes
    assert out["memcpy"] == NOT_SUPPORTED


V1 = """
import ctypes, json
from ctypes import POINTER, Structure, byref, c_int, c_size_t, c_uint, c_void_p
lib = ctypes.CDLL("libcuda.so.1")
assert lib.cuInit(0) == 0
ctx = c_void_p()
created = lib.cuCtxCreate(byref(ctx), c_uint(0), c_int(0))
def info_v2():
    f, t = c_size_t(), c_size_t()
    assert lib.cuMemGetInfo_v2(byref(f), byref(t)) == 0
    return f.value
after_ctx = info_v2()
ptr = c_uint()
alloc = lib.cuMemAlloc(byref(ptr), c_uint(64 << 20))
after_alloc = info_v2()
f1, t1 = c_uint(), c_uint()
info1 = lib.cuMemGetInfo(byref(f1), byref(t1))
tm = c_uint()
total1 = lib.cuDeviceTotalMem(byref(tm), c_int(0))
class Desc(Structure):
    _fields_ = [("Width", c_uint), ("Height", c_uint), ("Format", c_int), ("NumChannels", c_uint)]
arr = c_void_p()
array = lib.cuArrayCreate(byref(arr), byref(Desc(4096, 4096, 0x20, 1)))  # 64 MiB of floats
after_array = info_v2()
freed = lib.cuMemFree(ptr)
destroyed_arr = lib.cuArrayDestroy(arr)
after_free = info_v2()
destroyed = lib.cuCtxDestroy(ctx)
print(json.dumps({"created": created, "alloc": alloc, "ptr": ptr.value, "info1": info1,
    "free1": f1.value, "total1": t1.value, "totalmem1": [total1, tm.value], "array": array,
    "freed": [freed, destroyed_arr, destroyed], "ctx_cost": 80 * 2**30 - after_ctx,
    "alloc_cost": after_ctx - after_alloc, "array_cost": after_alloc - after_array,
    "back": after_free == after_ctx}))
"""


def test_strict_v1_exports_exist_and_behave(sim: Sim) -> None:
    """The unversioned CUDA 2.0 ABI: 32-bit sizes and pointers, saturating on big cards."""
    out = run_json(sim.base_env(), V1)
    assert out["created"] == out["alloc"] == out["info1"] == out["array"] == SUCCESS
    assert 0 < out["ptr"] < 1 << 32
    assert out["free1"] == out["total1"] == 0xFFFFFFFF  # 80 GiB does not fit 32 bits
    assert out["totalmem1"] == [SUCCESS, 0xFFFFFFFF]
    assert out["ctx_cost"] == CTX  # cuCtxCreate (v1) costs a context's memory
    assert out["alloc_cost"] == 64 << 20 and out["array_cost"] == 64 << 20
    assert out["freed"] == [SUCCESS, SUCCESS, SUCCESS] and out["back"]


VERSIONS = """
import ctypes, json
from ctypes import byref, c_int, create_string_buffer
cuda = ctypes.CDLL("libcuda.so.1")
before = c_int()
r_before = cuda.cuDriverGetVersion(byref(before))
init = cuda.cuInit(0)
after = c_int()
cuda.cuDriverGetVersion(byref(after))
nvml = ctypes.CDLL("libnvidia-ml.so.1")
assert nvml.nvmlInit_v2() == 0
nv, buf = c_int(), create_string_buffer(80)
nvml.nvmlSystemGetCudaDriverVersion_v2(byref(nv))
nvml.nvmlSystemGetDriverVersion(buf, 80)
print(json.dumps([r_before, before.value, init, after.value, nv.value, buf.value.decode()]))
"""


@pytest.mark.parametrize(("version", "driver"), [(12020, "535."), (12080, "570."), (13000, "580.")])
def test_strict_driver_version_before_cuinit_is_the_configured_one(
    short_tmp: Path, version: int, driver: str
) -> None:
    """NVIDIA's runtime asks cuDriverGetVersion before cuInit (and needs >= 13000 for 13.x);
    NVML reports the same CUDA version and a driver of that release."""
    sim = make_sim(short_tmp, f"v{version}", cuda_version=version)
    r, before, init, after, nvml_cuda, nvml_driver = run_json(sim.base_env(), VERSIONS)
    assert (r, before, init, after, nvml_cuda) == (SUCCESS, version, SUCCESS, version, version)
    assert nvml_driver.startswith(driver)


CTX_V4 = """
import ctypes, json
from ctypes import POINTER, Structure, byref, c_int, c_size_t, c_uint, c_void_p
lib = ctypes.CDLL("libcuda.so.1")
class Params(Structure):
    _fields_ = [("execAffinityParams", c_void_p), ("numExecAffinityParams", c_int),
                ("cigParams", c_void_p)]
lib.cuCtxCreate_v4.argtypes = [POINTER(c_void_p), c_void_p, c_uint, c_int]
assert lib.cuInit(0) == 0
primary = c_void_p()
assert lib.cuDevicePrimaryCtxRetain(byref(primary), 0) == 0
assert lib.cuCtxSetCurrent(primary) == 0
def used():
    f, t = c_size_t(), c_size_t()
    assert lib.cuMemGetInfo_v2(byref(f), byref(t)) == 0
    return t.value - f.value
base = used()
ctx, bad = c_void_p(), c_void_p()
announced, plain = Params(None, 1, None), Params(None, 0, None)
bad_params = lib.cuCtxCreate_v4(byref(bad), ctypes.addressof(announced), 0, 0)
created = lib.cuCtxCreate_v4(byref(ctx), ctypes.addressof(plain), 0, 0)
cost = used() - base
current = c_void_p()
lib.cuCtxGetCurrent(byref(current))
destroyed = lib.cuCtxDestroy_v2(ctx)
lib.cuCtxSetCurrent(primary)
print(json.dumps([bad_params, created, cost, current.value == ctx.value, destroyed,
                  used() - base]))
"""


def test_strict_ctx_create_v4(sim: Sim) -> None:
    """The CUDA 13 form (NVIDIA's cuda-bindings asks for it) makes a current context that
    costs memory; affinity parameters announced but missing are refused."""
    bad, created, used, current, destroyed, after = run_json(sim.base_env(), CTX_V4)
    assert bad == INVALID_VALUE
    assert (created, used, current, destroyed, after) == (SUCCESS, CTX, True, SUCCESS, 0)


GREEN = """
import ctypes, json
from ctypes import Structure, Union, byref, c_int, c_size_t, c_ubyte, c_uint, c_uint64, c_void_p
lib = ctypes.CDLL("libcuda.so.1")
class Sm(Structure):
    _fields_ = [("smCount", c_uint), ("minSmPartitionSize", c_uint),
                ("smCoscheduledAlignment", c_uint)]
class U(Union):
    _fields_ = [("sm", Sm), ("_oversize", c_ubyte * 48)]
class Res(Structure):
    _anonymous_ = ("u",)
    _fields_ = [("type", c_int), ("_pad", c_ubyte * 92), ("u", U)]
assert lib.cuInit(0) == 0
def used():
    f, t = c_size_t(), c_size_t()
    assert lib.cuMemGetInfo_v2(byref(f), byref(t)) == 0
    return t.value - f.value
res, desc, green, ctx = Res(), c_void_p(), c_void_p(), c_void_p()
out = {"res": lib.cuDeviceGetDevResource(0, byref(res), 1), "sms": res.sm.smCount}
out["desc"] = lib.cuDevResourceGenerateDesc(byref(desc), byref(res), 1)
out["no_stream_flag"] = lib.cuGreenCtxCreate(byref(green), desc, 0, 0)
out["create"] = lib.cuGreenCtxCreate(byref(green), desc, 0, 1)  # CU_GREEN_CTX_DEFAULT_STREAM
flags, active = c_uint(), c_int()
lib.cuDevicePrimaryCtxGetState(0, byref(flags), byref(active))
out["primary_active"] = active.value
out["from"] = lib.cuCtxFromGreenCtx(byref(ctx), green)
out["set"] = lib.cuCtxSetCurrent(ctx)
base = 0
f, t = c_size_t(), c_size_t()
lib.cuMemGetInfo_v2(byref(f), byref(t))
out["used_with_green"] = t.value - f.value
p = c_uint64()
out["alloc"] = lib.cuMemAlloc_v2(byref(p), c_size_t(256 << 20))
lib.cuMemGetInfo_v2(byref(f), byref(t))
out["used_alloc"] = t.value - f.value
lib.cuCtxSetCurrent(None)
out["destroy"] = lib.cuGreenCtxDestroy(green)
lib.cuDevicePrimaryCtxGetState(0, byref(flags), byref(active))
out["primary_after"] = active.value
prim = c_void_p()
lib.cuDevicePrimaryCtxRetain(byref(prim), 0)
lib.cuCtxSetCurrent(prim)
lib.cuMemGetInfo_v2(byref(f), byref(t))
out["used_after"] = t.value - f.value
print(json.dumps(out))
"""


def test_strict_green_contexts(sim: Sim) -> None:
    """CUDA 12.4 green contexts: CU_GREEN_CTX_DEFAULT_STREAM is required; creating one
    retains the device's primary context (which costs a context's memory) and costs its own
    (green_context_memory), destroying it releases both and frees what was allocated in it."""
    out = run_json(sim.base_env(), GREEN)
    assert (out["res"], out["sms"], out["desc"]) == (SUCCESS, 132, SUCCESS)
    assert out["no_stream_flag"] == INVALID_VALUE
    assert (out["create"], out["from"], out["set"], out["alloc"]) == (SUCCESS,) * 4
    assert out["primary_active"] == 1
    green = sim.config.gpus[0].green_context_memory
    assert green == GREEN_CONTEXT_MEMORY > 0
    assert out["used_with_green"] == CTX + green
    assert out["used_alloc"] == CTX + green + (256 << 20)
    assert (out["destroy"], out["primary_after"]) == (SUCCESS, 0)
    assert out["used_after"] == CTX  # the primary retained again; the green one's memory gone


ATTRS = """
import ctypes, json
from ctypes import byref, c_int
lib = ctypes.CDLL("libcuda.so.1")
assert lib.cuInit(0) == 0
def attr(a, dev):
    v = c_int(-1)
    return [lib.cuDeviceGetAttribute(byref(v), a, dev), v.value]
# MAX_THREADS_PER_MULTIPROCESSOR, MULTIPROCESSOR_COUNT, MAX_BLOCKS_PER_MULTIPROCESSOR
print(json.dumps({d: [attr(39, d), attr(16, d), attr(106, d)] for d in (0, 1)}))
"""


def test_strict_attributes_nvml_limiters_size_their_buckets_by(sim: Sim, short_tmp: Path) -> None:
    """HAMi-core sizes its token bucket by threads per SM x SMs: a driver model that says 0
    makes NVML-driven enforcement divide by zero."""
    two = make_sim(short_tmp, "attrs")
    out = run_json(two.base_env() | {"CUDA_VISIBLE_DEVICES": "0,1"}, ATTRS)
    assert out["0"] == [[SUCCESS, 2048], [SUCCESS, 132], [SUCCESS, 32]]  # H100
    assert out["1"] == [[SUCCESS, 1024], [SUCCESS, 40], [SUCCESS, 16]]  # T4 (sm_75)


EXPORT_TABLE = """
import ctypes, json
from ctypes import POINTER, byref, c_ubyte, c_void_p
lib = ctypes.CDLL("libcuda.so.1")
table = c_void_p(1)
uuid = (c_ubyte * 16)(*bytes.fromhex("6bd5fb6c5bf4e74a8987d93912fd9df9"))
print(json.dumps([lib.cuGetExportTable(byref(table), byref(uuid)), table.value]))
"""


def test_strict_export_tables_are_answered_not_found(sim: Sim) -> None:
    """NVIDIA's runtime asks for private tables by UUID; the simulator has none and says so
    (CUDA_ERROR_NOT_FOUND, a NULL table) instead of lacking the entry point."""
    assert run_json(sim.base_env(), EXPORT_TABLE) == [NOT_FOUND, None]


STATIC_PROGRAM = r"""
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
typedef int (*fn)();
static void *cuda, *nvml;
static fn f(void *h, const char *name) {
    fn p = (fn)dlsym(h, name);
    if (!p) { printf("missing %s\n", name); fflush(stdout); }
    return p;
}
int main(int argc, char **argv) {
    (void)argc;
    cuda = dlopen(argv[1], RTLD_NOW);
    nvml = dlopen(argv[2], RTLD_NOW);
    if (!cuda || !nvml) { printf("dlopen: %s\n", dlerror()); return 2; }
    int version = 0, r;
    void *ctx = 0, *mod = 0, *func = 0, *ev = 0, *getinfo = 0;
    uint64_t ptr = 0, ns = 2000000;
    size_t free_b = 0, total = 0;
    void *params[] = {&ns};
    r = f(cuda, "cuDriverGetVersion")(&version);
    printf("version %d %d\n", r, version);
    printf("init %d\n", f(cuda, "cuInit")(0));
    printf("retain %d\n", f(cuda, "cuDevicePrimaryCtxRetain")(&ctx, 0));
    printf("current %d\n", f(cuda, "cuCtxSetCurrent")(ctx));
    printf("alloc %d\n", f(cuda, "cuMemAlloc_v2")(&ptr, (size_t)1 << 30));
    printf("getproc %d\n", f(cuda, "cuGetProcAddress_v2")("cuMemGetInfo", &getinfo, 13000,
                                                          (uint64_t)0, (void *)0));
    r = ((fn)getinfo)(&free_b, &total);
    printf("meminfo %d %zu %zu\n", r, free_b, total);
    f(cuda, "cuModuleLoadData")(&mod, "qgpu-sim-module");
    f(cuda, "cuModuleGetFunction")(&func, mod, "qgpu_sim_busy");
    printf("launch %d\n", f(cuda, "cuLaunchKernel")(func, 1, 1, 1, 1, 1, 1, 0, (void *)0,
                                                   params, (void *)0));
    f(cuda, "cuEventCreate")(&ev, 0);
    f(cuda, "cuEventRecord")(ev, (void *)0);
    printf("sync %d\n", f(cuda, "cuEventSynchronize")(ev));
    printf("free %d\n", f(cuda, "cuMemFree_v2")(ptr));
    unsigned count = 0;
    printf("nvml %d\n", f(nvml, "nvmlInit_v2")());
    r = f(nvml, "nvmlDeviceGetCount_v2")(&count);
    printf("count %d %u\n", r, count);
    return 0;
}
"""


@pytest.fixture(scope="module")
def static_program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc:
        pytest.fail(
            "no C compiler (cc/gcc) on PATH: make install needs one to build the interposer"
        )
    d = tmp_path_factory.mktemp("static")
    (d / "prog.c").write_text(STATIC_PROGRAM)
    built = subprocess.run(
        [cc, "-static", "-O1", "-o", str(d / "prog"), str(d / "prog.c")],
        capture_output=True,
        text=True,
    )
    if built.returncode != 0:
        pytest.fail(
            f"cc -static failed (needs glibc's static libc, libc6-dev): {built.stderr[-300:]}"
        )
    return d / "prog"


def test_strict_a_statically_linked_program_can_load_the_driver(
    sim: Sim, static_program: Path
) -> None:
    """A static binary dlopens the simulated libcuda.so.1 and libnvidia-ml.so.1 and uses them
    (no thread-local storage model that only a dynamic program provides)."""
    lib = sim_library_dir()
    run = subprocess.run(
        [str(static_program), str(lib / "libcuda.so.1"), str(lib / "libnvidia-ml.so.1")],
        env=sim.base_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, (run.returncode, run.stdout, run.stderr)
    lines = dict(line.split(" ", 1) for line in run.stdout.splitlines())
    assert lines["version"] == "0 13000"
    for key in ("init", "retain", "current", "alloc", "getproc", "launch", "sync", "free", "nvml"):
        assert lines[key] == "0", (key, run.stdout)
    assert lines["meminfo"] == f"0 {80 * GIB - CTX - GIB} {80 * GIB}"
    assert lines["count"] == "0 5"


def test_strict_procaddr_table_is_what_the_toolkit_headers_say() -> None:
    """The committed (name, version, flags) -> symbol table is NVIDIA's statement in the
    installed toolkit's headers (where one is installed; the build never needs it)."""
    cuda = Path(os.environ.get("CUDA_HOME") or "/usr/local/cuda")
    if not (cuda / "include" / "cudaTypedefs.h").is_file():
        pytest.fail(
            f"no CUDA toolkit headers at {cuda} (set CUDA_HOME): the table is checked against them"
        )
    tool = Path(enforcement.native.__file__).parent / "tools" / "gen_procaddr.py"
    check = subprocess.run(
        [sys.executable, str(tool), "--cuda", str(cuda), "--check"], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stderr
