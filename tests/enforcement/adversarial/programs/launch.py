"""A process that exists before it knows what it will run: the shape of a Ray or Dask
worker, which reserves its slice (as the slice's pid owner) before it starts CUDA.

``launch.py exec`` waits for one JSON line ``{"argv": [...], "env": {...}}`` on stdin and
replaces itself with that program (same pid: the program is the owner). ``launch.py fork``
starts the program as its child instead and ends the way the child ended (a child killed by
SIGKILL makes it die of SIGKILL too), so that a test can wait on this process either way.
stdin is read one byte at a time so that nothing meant for the program is consumed here.
"""

from __future__ import annotations

import json
import os
import signal
import sys


def read_line() -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        byte = os.read(0, 1)
        if not byte:
            sys.exit("launch.py: stdin closed before the program was named")
        data += byte
    return data


def main() -> None:
    mode = sys.argv[1]
    spec = json.loads(read_line())
    argv, env = spec["argv"], spec["env"]
    if mode == "exec":
        os.execve(argv[0], argv, env)
    pid = os.fork()
    if pid == 0:
        os.execve(argv[0], argv, env)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig != signal.SIGKILL:  # SIGKILL cannot be caught: always the default action
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    sys.exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    main()
