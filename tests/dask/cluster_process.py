"""A process that holds a SliceCluster until it is killed (for the SIGKILL tests), or with
``exit`` returns without closing it (the interpreter's exit hook must release the slices).

    python tests/dask/cluster_process.py AGENT_SOCKET|sim ROOT [exit]

Prints one JSON line: slice ids, worker process pids and (own agent) the agent's pid.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    from distributed import Client

    from qgpu_dask import SliceCluster

    target, root = sys.argv[1], sys.argv[2]
    where = {"sim": "1xH100-80GB"} if target == "sim" else {"agent_socket": target}
    slices = [{"core": 30, "memory": 8}, {"core": 20, "memory": 4}]
    cluster = SliceCluster(slices, root=root, **where)
    with Client(cluster) as client:
        pids = sorted(client.run(os.getpid).values())
    report = {
        "slices": sorted(r.slice_id for r in cluster.slices.values()),
        "worker_pids": pids,
        "agent_pid": cluster.agent.process.pid if cluster.agent is not None else None,
    }
    print(json.dumps(report), flush=True)
    if sys.argv[3:] == ["exit"]:
        return
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main()
