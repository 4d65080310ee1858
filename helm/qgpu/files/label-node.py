"""label-node (init container of qgpu-manager): give this node the chart's default isolation
policy as its <prefix>/qgpu-schedule-policy label, unless the node already has one (a label
set by hand wins). The scheduler extender reads the label as the node's default isolation.

It also hands the node label <prefix>/qgpu-slices-per-gpu (floor-gib or 1..16), when set, to
the agent and the device plugin: its value is written to QGPU_SLICES_FILE, which overrides
the chart's manager.slicesPerGpu there; without the label the file is removed. A bad value
stops the pod with the rule (the extender's filter names the same label).
"""

import os
import sys
from pathlib import Path

from k8s_bridge.kube import Kube, make_api_client
from k8s_bridge.resources import Names
from qgpu.errors import RuleViolation
from qgpu.model import IsolationPolicy, SlicesPerGpu

node = os.environ["NODE_NAME"]
names = Names(os.environ["QGPU_RESOURCE_PREFIX"])
default = IsolationPolicy.parse(os.environ["QGPU_DEFAULT_ISOLATION"], "policies.isolation")
kube = Kube(make_api_client(os.environ.get("QGPU_APISERVER") or None), names)
labels = kube.get_node(node).get("metadata", {}).get("labels") or {}
label = names.policy_label
if label in labels:
    print(f"node {node} keeps {label}={labels[label]}")
else:
    kube.patch_node(node, {"metadata": {"labels": {label: default.value}}})
    print(f"node {node}: {label}={default.value}")

slices_file = os.environ.get("QGPU_SLICES_FILE")
if slices_file:
    path = Path(slices_file)
    value = labels.get(names.slices_label)
    if value is None:
        path.unlink(missing_ok=True)
        print(f"node {node}: no {names.slices_label} label, slices per GPU from the chart")
    else:
        try:
            SlicesPerGpu.parse(value, f"node label {names.slices_label}")
        except RuleViolation as exc:
            sys.exit(f"node {node}: {exc}")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(value.strip() + "\n")
        print(f"node {node}: {names.slices_label}={value} (slices per GPU)")
