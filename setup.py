"""Build of the native parts of qgpu: the CUDA driver interposer ``libqgpu_hook.so`` and the
simulated driver (``libcuda.so.1``, ``libnvidia-ml.so.1``).

Everything else lives in pyproject.toml. The C code needs no CUDA SDK (it declares the
driver ABI itself); it is compiled with the system C compiler (``$CC`` or ``cc``) during
``pip install .`` and ``pip install -e .``. Outputs keep their real library names and
SONAMEs, not Python extension-module names.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
NATIVE = Path("enforcement") / "native"
COMMON = [
    str(NATIVE / "common" / n) for n in ("clock.c", "proc.c", "shm.c", "table.c", "procaddr.c")
]
SIM_CORE = [str(NATIVE / "sim" / n) for n in ("config.c", "state.c", "shared.c", "acct.c")]

# (extension name, output file relative to the package root, soname, sources, extra links,
#  extra compiler flags)
LIBRARIES = {
    "enforcement.native.libqgpu_hook": (
        NATIVE / "libqgpu_hook.so",
        "libqgpu_hook.so",
        [
            str(NATIVE / "hook" / n)
            for n in (
                "libc_sym.c",
                "real.c",
                "dlsym.c",
                "config.c",
                "ledger.c",
                "roster.c",
                "region.c",
                "busy.c",
                "init.c",
                "mem.c",
                "vmm.c",
                "ipc.c",
                "managed.c",
                "pool.c",
                "graph.c",
                "graph_work.c",
                "lmem.c",
                "ctx.c",
                "module.c",
                "launch.c",
                "nvml.c",
                "nvml_activity.c",
                "nvml_settings.c",
                "checkpoint.c",
            )
        ]
        + COMMON,
        (),
        # pin libc symbol versions so the interposer loads on glibc 2.17+ (glibc_compat.h)
        ("-include", str(ROOT / NATIVE / "hook" / "glibc_compat.h")),
    ),
    "enforcement.native.sim.libcuda": (
        NATIVE / "sim" / "libcuda.so.1",
        "libcuda.so.1",
        [
            str(NATIVE / "sim" / n)
            for n in (
                "driver.c",
                "ctx.c",
                "mem.c",
                "pool.c",
                "managed.c",
                "ipc.c",
                "exec.c",
                "graph.c",
                "module.c",
                "image.c",
                "graphmem.c",
                "procaddr.c",
                "checkpoint.c",
                "video.c",
            )
        ]
        + SIM_CORE
        + COMMON,
        ("libcuda.so",),
        (),
    ),
    "enforcement.native.sim.libnvidia-ml": (
        NATIVE / "sim" / "libnvidia-ml.so.1",
        "libnvidia-ml.so.1",
        [str(NATIVE / "sim" / "nvml.c"), *SIM_CORE, *COMMON],
        ("libnvidia-ml.so",),
        (),
    ),
}

CFLAGS = ["-std=gnu11", "-O2", "-g", "-fPIC", "-fvisibility=hidden", "-Wall", "-Wextra"]
# libdl, libpthread and librt are NEEDED explicitly: on glibc < 2.34 dlsym and friends live
# there (the interposer finds libc's dlsym in libc.so or libdl.so, hook/libc_sym.c)
LDFLAGS = [
    "-shared",
    "-Wl,-Bsymbolic",
    "-Wl,-z,now",
    "-Wl,--no-as-needed",
    "-l:libdl.so.2",
    "-l:libpthread.so.0",
    "-l:librt.so.1",
]


class BuildNative(build_ext):
    """Compile each library with one compiler call and name it as the loader expects."""

    def get_ext_filename(self, fullname: str) -> str:
        return str(LIBRARIES[fullname][0])

    def get_ext_fullpath(self, ext_name: str) -> str:
        base = ROOT if self.inplace else Path(self.build_lib)
        return str(base / LIBRARIES[ext_name][0])

    def build_extension(self, ext: Extension) -> None:
        _, soname, sources, aliases, extra = LIBRARIES[ext.name]
        out = Path(self.get_ext_fullpath(ext.name))
        out.parent.mkdir(parents=True, exist_ok=True)
        cc = shlex.split(os.environ.get("CC") or "cc")
        cmd = [
            *cc,
            *CFLAGS,
            *extra,
            "-o",
            str(out),
            *[str(ROOT / s) for s in sources],
            f"-Wl,-soname,{soname}",
            *LDFLAGS,
        ]
        self.announce(" ".join(cmd), level=2)
        subprocess.run(cmd, check=True)
        _make_aliases(out, aliases)

    def copy_extensions_to_source(self) -> None:
        """Editable installs build in a temporary dir and copy the outputs back."""
        super().copy_extensions_to_source()
        for rel, _, _, aliases, _ in LIBRARIES.values():
            _make_aliases(ROOT / rel, aliases)


def _make_aliases(lib: Path, aliases: tuple[str, ...]) -> None:
    """Development names (libcuda.so for ``-lcuda``): a symlink, or a copy where links fail."""
    for alias in aliases:
        target = lib.parent / alias
        if target.is_symlink() or target.exists():
            target.unlink()
        try:
            target.symlink_to(lib.name)
        except OSError:
            shutil.copy2(lib, target)


setup(
    ext_modules=[Extension(name, sources=list(spec[2])) for name, spec in LIBRARIES.items()],
    cmdclass={"build_ext": BuildNative},
)
