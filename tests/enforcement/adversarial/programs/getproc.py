"""Pointer identity (issue 17): every runtime (PyTorch, CuPy, cuda-bindings) resolves the
driver through cuGetProcAddress, and a driver may hand out entry points that are not its
exported symbols (the simulator's are internal stubs). A hook that swaps only pointers
equal to what dlsym returned lets all of them run uncapped. Two 3 GiB cuMemAllocs."""

from __future__ import annotations

from cuda.bindings import driver as cuda
from hostile_cb import GIB, alloc, hold, say, setup


def main() -> None:
    setup()
    alloc(3 * GIB)
    alloc(3 * GIB)
    free, total = cuda.cuMemGetInfo()[1:]
    say("free", free)
    say("total", total)
    hold()


main()
