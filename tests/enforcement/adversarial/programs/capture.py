"""cuMemAllocAsync under stream capture (issue 17): while a stream is captured an
allocation is a node of the graph being built; it takes memory when the graph is uploaded
or launched. The tenant first takes 3 GiB with cuMemAlloc, then captures a 3 GiB
stream-ordered allocation (never freed in the graph) and launches (argv[1] == "launch") or
uploads ("upload") the instantiated graph: that must be refused."""

from __future__ import annotations

import sys

from cuda.bindings import driver as cuda
from hostile_cb import GIB, alloc, code, hold, say, setup


def main() -> None:
    setup()
    alloc(3 * GIB)
    _, stream = cuda.cuStreamCreate(0)
    mode = cuda.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL
    assert code(cuda.cuStreamBeginCapture(stream, mode)) == 0
    err, _ptr = cuda.cuMemAllocAsync(3 * GIB, stream)
    say("captured", int(err))
    err, graph = cuda.cuStreamEndCapture(stream)
    assert int(err) == 0, err
    err, exe = cuda.cuGraphInstantiate(graph, 0)
    assert int(err) == 0, err
    if sys.argv[1] == "upload":
        say("run", code(cuda.cuGraphUpload(exe, stream)))
    else:
        say("run", code(cuda.cuGraphLaunch(exe, stream)))
    say("sync", code(cuda.cuStreamSynchronize(stream)))
    hold()


main()
