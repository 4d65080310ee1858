"""label-node (init container of qgpu-manager): give this node the chart's default isolation
policy as its <prefix>/qgpu-schedule-policy label, unless the node already has one (a label
set by hand wins). The scheduler extender reads the label as the node's default isolation.
"""

import os

from k8s_bridge.kube import Kube, make_api_client
from k8s_bridge.resources import Names
from qgpu.model import IsolationPolicy

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
