"""Device plugin admission cost of the pod-resources check, side by side in one run.

Two nodes in one process, each with the fake kubelet (real gRPC: Registration, device
plugin calls, the pod-resources API on its own socket) and the real device plugin, the fake
apiserver over HTTP and the extender binding in-process: node ``on`` runs the plugin with
kubelet's pod-resources check (``--pod-resources-socket``), node ``off`` without it
(``--no-pod-resources-check``). Pods of one shape are bound to both and admitted in turn
(on, off, on, off, ...) by kubelet: GetPreferredAllocation, Allocate and PreStartContainer
for both resources. Prints, per tenth of the fill (the pods already running on the node,
which kubelet's List returns every time), the median and p99 admission time on each node,
their ratio, and the pod-resources List calls per pod. No assertions.

    .venv/bin/python bench/deviceplugin_admission.py [--gpus 8] [--gib 80] [--pods 120]
        [--core 5] [--memory 4]
"""

from __future__ import annotations

import argparse
import logging
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _p99(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(0.99 * (len(s) - 1)))]


def main() -> None:
    from k8s_bridge.deviceplugin.allocation import AllocationPaths
    from k8s_bridge.deviceplugin.server import PluginConfig, QgpuDevicePlugin
    from k8s_bridge.extender.models import ExtenderBindingArgs
    from k8s_bridge.extender.service import Extender, ExtenderConfig
    from k8s_bridge.kube import Kube
    from qgpu.model import NodeInventory
    from tests.fakes.apiserver import FakeApiserver, node_object
    from tests.fakes.kubelet import FakeKubelet
    from tests.k8s.helpers import NAMES, TEST_KEYS, gpu, pod_object

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--gib", type=int, default=80)
    ap.add_argument("--pods", type=int, default=120, help="pods per node")
    ap.add_argument("--core", type=int, default=5)
    ap.add_argument("--memory", type=int, default=4)
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)

    tmp = Path(tempfile.mkdtemp(dir="/tmp", prefix="qbda"))
    hook = tmp / "hook.so"
    hook.write_bytes(b"stand-in")
    srv = FakeApiserver().start()
    kubelets: dict[str, FakeKubelet] = {}
    plugins: dict[str, QgpuDevicePlugin] = {}
    lists: dict[str, int] = {"on": 0, "off": 0}
    try:
        for name in ("on", "off"):
            srv.store.create("nodes", node_object(name, {}))
            kl = FakeKubelet(tmp / f"dp-{name}").start()
            plugin = QgpuDevicePlugin(
                PluginConfig(
                    node_name=name,
                    plugin_dir=kl.dir,
                    pod_resources_socket=kl.pod_resources_socket if name == "on" else None,
                ),
                Kube(srv.client(), NAMES),
                NodeInventory(
                    name=name, gpus=[gpu(name, i, gib=args.gib) for i in range(args.gpus)]
                ),
                AllocationPaths(state_dir=tmp / f"state-{name}", hook_library=hook),
                TEST_KEYS,
            )
            plugin.start()
            kl.wait_ready([NAMES.core, NAMES.memory])
            if plugin.check is not None:
                client = plugin.check.client
                real = client.devices

                def counted(real: Any = real, name: str = name) -> Any:
                    lists[name] += 1
                    return real()

                client.devices = counted  # type: ignore[method-assign]
            kubelets[name], plugins[name] = kl, plugin
        ext = Extender(Kube(srv.client(), NAMES), ExtenderConfig(watch=False), TEST_KEYS)
        ext.start()
        times: dict[str, list[float]] = {"on": [], "off": []}
        for i in range(args.pods):
            for name in ("on", "off"):
                pod_name = f"{name}-{i}"
                pod = srv.store.create("pods", pod_object(pod_name, [(args.core, args.memory)]))
                bound = ext.bind(
                    ExtenderBindingArgs(
                        PodName=pod_name,
                        PodNamespace="default",
                        PodUID=pod["metadata"]["uid"],
                        Node=name,
                    )
                )
                if bound.error:
                    raise SystemExit(f"bind {pod_name}: {bound.error}")
                obj = srv.store.get("pods", "default", pod_name)
                t0 = time.perf_counter()
                kubelets[name].admit(obj)
                times[name].append((time.perf_counter() - t0) * 1000)
        ext.stop()
        print(
            f"{args.pods} pods of ({args.core}% core, {args.memory} GiB) per node, "
            f"{args.gpus} GPUs x {args.gib} GiB; admission = GetPreferredAllocation + "
            "Allocate + PreStartContainer, both resources"
        )
        print(f"{'pods running':>14} {'on p50 ms':>10} {'off p50 ms':>11} {'ratio':>6} "
              f"{'on p99 ms':>10} {'off p99 ms':>11}")
        step = max(1, args.pods // 10)
        for lo in range(0, args.pods, step):
            on, off = times["on"][lo : lo + step], times["off"][lo : lo + step]
            print(
                f"{f'{lo}-{lo + len(on) - 1}':>14} {statistics.median(on):10.2f} "
                f"{statistics.median(off):11.2f} "
                f"{statistics.median(on) / statistics.median(off):6.2f} "
                f"{_p99(on):10.2f} {_p99(off):11.2f}"
            )
        on, off = times["on"], times["off"]
        print(
            f"{'all':>14} {statistics.median(on):10.2f} {statistics.median(off):11.2f} "
            f"{statistics.median(on) / statistics.median(off):6.2f} "
            f"{_p99(on):10.2f} {_p99(off):11.2f}"
        )
        print(f"pod-resources List calls per pod (on): {lists['on'] / args.pods:.2f}")
    finally:
        for p in plugins.values():
            p.stop()
        for k in kubelets.values():
            k.stop()
        srv.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
