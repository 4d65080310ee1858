"""A GPU workload for the agent tests: allocate GiB through the (simulated) driver, then wait.

Run as ``python -m tests.agent.workload GIB [GIB ...]``: each amount is one allocation
attempt; prints ``ok`` or ``oom`` per attempt, then ``ready`` and sleeps until killed.
"""

from __future__ import annotations

import sys
import time

from enforcement.simcuda import Driver

GIB = 1 << 30


def main(argv: list[str]) -> int:
    driver = Driver()
    driver.init()
    driver.context(0)
    held = []
    for amount in argv:
        code, alloc = driver.try_mem_alloc(int(float(amount) * GIB))
        print("ok" if alloc is not None else f"oom {code}", flush=True)
        if alloc is not None:
            held.append(alloc)
    print("ready", flush=True)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
