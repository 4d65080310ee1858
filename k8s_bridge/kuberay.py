"""KubeRay: a worker pod's qgpu slice becomes its Ray node's resources.

In Kubernetes each Ray worker pod holds ONE slice (its ``<prefix>/qgpu-core`` and
``<prefix>/qgpu-memory`` limits). Ray then only needs to know how much of it the node has:
`ray_resources_from_pod` turns the limits into ``{"qgpu-core": 30, "qgpu-memory": 8}``,
`ray_start_params` into KubeRay's ``rayStartParams`` (``resources`` as the quoted JSON
KubeRay passes to ``ray start --resources``, and ``num-gpus: "0"`` for a share so Ray never
rewrites the slice's ``CUDA_VISIBLE_DEVICES``), and `patch_ray_cluster` does it for every
group of a RayCluster manifest. Actors then ask for ``resources={"qgpu-core": 10,
"qgpu-memory": 2}`` and share the pod's slice; the interposer caps the pod as a whole.
`ray_resources_from_env` reads the same figures inside the pod from the device plugin's
environment (``QGPU_CORE_LIMIT``, ``QGPU_MEMORY_LIMIT``, ``CUDA_VISIBLE_DEVICES``).

No Ray import: this module only writes manifests and reads the environment.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from collections.abc import Mapping
from typing import Any

import yaml

from k8s_bridge.resources import Names, parse_pod, pod_slice_requests
from qgpu.errors import RuleViolation
from qgpu.units import BYTES_PER_GIB, CORE_FIELD, MEMORY_FIELD


def ray_resources_from_pod(pod: Mapping[str, Any], names: Names | None = None) -> dict[str, int]:
    """Ray resources of a pod (or pod template): its containers' qgpu limits, summed."""
    names = names or Names()
    raw = dict(pod)
    raw.setdefault("metadata", {})
    reqs = pod_slice_requests(names, parse_pod(raw))
    if not reqs:
        return {}
    out = {CORE_FIELD: sum(r.request.core for r in reqs)}
    memory = [r.request.memory_gib for r in reqs if r.request.memory_gib is not None]
    if memory:
        out[MEMORY_FIELD] = sum(memory)
    return out


def ray_start_params(
    pod_template: Mapping[str, Any],
    names: Names | None = None,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """KubeRay ``rayStartParams`` for a group whose pods use this template."""
    params = dict(base or {})
    resources = ray_resources_from_pod(pod_template, names)
    if not resources:
        return params
    merged: dict[str, Any] = {}
    if "resources" in params:
        text = params["resources"].strip()
        if text.startswith('"') and text.endswith('"'):
            text = json.loads(text)
        merged = json.loads(text)
    merged.update(resources)
    params["resources"] = json.dumps(json.dumps(merged, sort_keys=True))
    if resources[CORE_FIELD] < 100:
        params["num-gpus"] = "0"
    return params


def patch_ray_cluster(cluster: Mapping[str, Any], names: Names | None = None) -> dict[str, Any]:
    """A copy of a RayCluster with every group's rayStartParams set from its qgpu limits."""
    out = copy.deepcopy(dict(cluster))
    spec = out.get("spec") or {}
    groups = []
    if spec.get("headGroupSpec"):
        groups.append(spec["headGroupSpec"])
    groups += spec.get("workerGroupSpecs") or []
    for group in groups:
        template = group.get("template") or {}
        group["rayStartParams"] = ray_start_params(template, names, group.get("rayStartParams"))
    return out


def ray_resources_from_env(env: Mapping[str, str] | None = None) -> dict[str, int]:
    """Inside a pod: the slice the device plugin gave it, as Ray resources."""
    env = os.environ if env is None else env
    devices = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
    core = env.get("QGPU_CORE_LIMIT")
    memory = env.get("QGPU_MEMORY_LIMIT")
    if core and memory:
        try:
            return {CORE_FIELD: int(core), MEMORY_FIELD: int(memory) // BYTES_PER_GIB}
        except ValueError as exc:
            raise RuleViolation("QGPU_CORE_LIMIT", core, "must be an integer") from exc
    if env.get("QGPU_SLICE_ID") and devices:
        return {CORE_FIELD: 100 * len(devices)}
    return {}


def main(argv: list[str] | None = None) -> int:
    """``python -m k8s_bridge.kuberay raycluster.yaml [--prefix P]``: print it patched."""
    args = list(sys.argv[1:] if argv is None else argv)
    prefix = None
    if "--prefix" in args:
        i = args.index("--prefix")
        prefix = args[i + 1]
        del args[i : i + 2]
    if len(args) != 1:
        print("usage: python -m k8s_bridge.kuberay RAYCLUSTER.yaml [--prefix P]", file=sys.stderr)
        return 2
    with open(args[0]) as f:
        cluster = yaml.safe_load(f)
    try:
        patched = patch_ray_cluster(cluster, Names(prefix) if prefix else None)
    except RuleViolation as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    yaml.safe_dump(patched, sys.stdout, sort_keys=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
