"""cuMemFreeAsync credited at call time (issue 17): a stream-ordered free takes effect when
the stream reaches it. With 2 s of work queued before the free, the memory is still in use
right after the call; a hook that gives the charge back at the call lets a cuMemAlloc of the
same size through at once (6 GiB held under 4 GiB)."""

from __future__ import annotations

from cuda.bindings import driver as cuda
from hostile_cb import GIB, alloc, busy_kernel, code, hold, launch_busy, say, setup


def main() -> None:
    setup()
    _, stream = cuda.cuStreamCreate(0)
    fn = busy_kernel()
    err, ptr = cuda.cuMemAllocAsync(3 * GIB, stream)
    say("pool", int(err))
    say("launch", launch_busy(fn, 2_000_000_000, stream))
    say("free", code(cuda.cuMemFreeAsync(ptr, stream)))
    alloc(3 * GIB)  # the stream has not reached the free yet
    hold()


main()
