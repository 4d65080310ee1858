"""Own-ledger tampering (issue 17): the slice ledger is a shared file every process of the
slice maps; a workload can zero what it says the slice holds (mem_used at offset 24 and
every slot's bytes) and allocate again. One process (argv[1] == "one") takes 3 GiB, zeroes
the ledger and asks for 3 GiB again; with "many", each of the slice's processes takes
3 GiB after zeroing the ledger (the test starts several)."""

from __future__ import annotations

import mmap
import os
import struct
import sys
from pathlib import Path

from hostile_cb import GIB, alloc, hold, say, setup


def zero_ledger() -> None:
    sid = os.environ["QGPU_SLICE_ID"]
    path = Path(os.environ["QGPU_STATE_DIR"]) / sid / "ledger" / f"slice-{sid}.ledger"
    with path.open("r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        m[24:32] = struct.pack("<Q", 0)
        for slot in range(64):
            base = 512 + slot * 64
            m[base + 16 : base + 24] = struct.pack("<Q", 0)
    say("zeroed", 1)


def main() -> None:
    setup()
    if sys.argv[1] == "one":
        alloc(3 * GIB)
        zero_ledger()
        alloc(3 * GIB)
    else:
        zero_ledger()
        alloc(3 * GIB)
    hold()


main()
