"""KubeRay: a worker pod's qgpu slice becomes its Ray node's resources.

In Kubernetes each Ray worker pod holds ONE slice (its ``<prefix>/qgpu-core`` and
``<prefix>/qgpu-memory`` limits). Ray then only needs to know how much of it the node has:
`ray_resources_from_pod` turns the limits into ``{"qgpu-core": 30, "qgpu-memory": 8}``,
`ray_start_params` into KubeRay's ``rayStartParams`` (``resources`` in KubeRay's documented
form ``'"{\\"qgpu-core\\": 30}"'``: JSON wrapped in quotes, inner quotes escaped, which the
operator passes to ``ray start --resources`` through a shell and the Ray autoscaler reads
by dropping the outer quotes and the backslashes; and ``num-gpus: "0"`` for a share so Ray
never rewrites the slice's ``CUDA_VISIBLE_DEVICES``), and `patch_ray_cluster` does it for
every group of a RayCluster manifest. KubeRay 1.5 added a typed ``resources`` map to head
and worker group specs; `crd_has_group_resources` tells from the installed CRD whether it
is there, and ``patch_ray_cluster(..., typed_resources=True)`` then writes the map
(quantity strings) instead of ``rayStartParams.resources``. Actors then ask for
``resources={"qgpu-core": 10, "qgpu-memory": 2}`` and share the pod's slice; the
interposer caps the pod as a whole.
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


def crd_has_group_resources(crd: Mapping[str, Any]) -> bool:
    """Does this RayCluster CRD (``kubectl get crd rayclusters.ray.io -o yaml``) have the
    typed ``resources`` map on head and worker group specs (KubeRay >= 1.5)?"""
    for version in (crd.get("spec") or {}).get("versions") or []:
        if version.get("name") != "v1":
            continue
        schema = (version.get("schema") or {}).get("openAPIV3Schema") or {}
        spec = ((schema.get("properties") or {}).get("spec") or {}).get("properties") or {}
        head = (spec.get("headGroupSpec") or {}).get("properties") or {}
        worker = ((spec.get("workerGroupSpecs") or {}).get("items") or {}).get("properties") or {}
        return "resources" in head and "resources" in worker
    return False


def _typed(group: dict[str, Any], names: Names | None) -> None:
    """Move the group's qgpu resources from rayStartParams into the typed map."""
    resources = ray_resources_from_pod(group.get("template") or {}, names)
    if not resources:
        return
    typed = dict(group.get("resources") or {})
    typed.update({k: str(v) for k, v in resources.items()})
    group["resources"] = typed
    group.get("rayStartParams", {}).pop("resources", None)


def patch_ray_cluster(
    cluster: Mapping[str, Any], names: Names | None = None, *, typed_resources: bool = False
) -> dict[str, Any]:
    """A copy of a RayCluster with every group's Ray resources set from its qgpu limits:
    in ``rayStartParams`` (any KubeRay), or with `typed_resources` in the group's typed
    ``resources`` map (KubeRay >= 1.5; ``num-gpus`` stays in rayStartParams)."""
    out = copy.deepcopy(dict(cluster))
    spec = out.get("spec") or {}
    groups = []
    if spec.get("headGroupSpec"):
        groups.append(spec["headGroupSpec"])
    groups += spec.get("workerGroupSpecs") or []
    for group in groups:
        template = group.get("template") or {}
        group["rayStartParams"] = ray_start_params(template, names, group.get("rayStartParams"))
        if typed_resources:
            _typed(group, names)
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
    """``python -m k8s_bridge.kuberay raycluster.yaml [--prefix P] [--crd CRD.yaml]``:
    print it patched (with ``--crd``, the typed resources map where that CRD has it)."""
    args = list(sys.argv[1:] if argv is None else argv)
    options: dict[str, str] = {}
    for flag in ("--prefix", "--crd"):
        if flag in args:
            i = args.index(flag)
            if i + 1 >= len(args):
                print(f"error: {flag} needs a value", file=sys.stderr)
                return 2
            options[flag] = args[i + 1]
            del args[i : i + 2]
    if len(args) != 1:
        print(
            "usage: python -m k8s_bridge.kuberay RAYCLUSTER.yaml [--prefix P] [--crd CRD.yaml]",
            file=sys.stderr,
        )
        return 2
    with open(args[0]) as f:
        cluster = yaml.safe_load(f)
    typed = False
    if "--crd" in options:
        with open(options["--crd"]) as f:
            typed = crd_has_group_resources(yaml.safe_load(f) or {})
    prefix = options.get("--prefix")
    try:
        patched = patch_ray_cluster(
            cluster, Names(prefix) if prefix else None, typed_resources=typed
        )
    except RuleViolation as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    yaml.safe_dump(patched, sys.stdout, sort_keys=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
