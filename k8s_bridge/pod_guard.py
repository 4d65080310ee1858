"""What a qgpu pod may not set, because it would override the enforcement the device plugin
injects into its containers.

kubelet hands the container runtime the device plugin's Allocate answer first (devices,
mounts, env) and the container's own env and volume mounts after it
(`GenerateRunContainerOptions` in kubernetes/kubernetes pkg/kubelet/kubelet_pods.go);
containerd sorts all the mounts by path depth with a stable sort (`WithMounts`,
`orderedMounts`) and runc mounts them in that order, so a pod's own mount at the same
path as one of the plugin's is mounted on top of it and wins; of two env entries with
one name, readers that build a map (Go, NVIDIA's container toolkit, Python's
``os.environ``) take the later one, the pod's. A pod that asks for a slice and also
mounts an empty file at ``/etc/ld.so.preload`` (a ConfigMap key is enough) would run
with no interposer; its own root-owned ``limits.conf`` at the trusted path would give it
any cap; ``NVIDIA_VISIBLE_DEVICES=all`` would make the toolkit give it every GPU of the
node. Pod Security's baseline and restricted levels allow all of these.

`pod_violations()` lists every such setting of a pod, each as a `RuleViolation` naming
the field, the value and the rule; the webhook denies the pod with the first, and the
device plugin refuses the container at Allocate (the webhook can be bypassed). The rules:

- a share container (qgpu-core below 100, which gets the interposer) mounts nothing at a
  file the plugin mounts or at or under a directory it mounts, nor under the node's qgpu
  state directory;
- no container of the pod sets the slice's env (``CUDA_VISIBLE_DEVICES``,
  ``NVIDIA_VISIBLE_DEVICES``, ``QGPU_*``), asks the toolkit for driver capabilities whose
  libraries allocate device memory without libcuda (``graphics``, ``display``, ``all``),
  or takes env from a ConfigMap or Secret (``envFrom``) with a prefix that could make one
  of those names (none at all, included): the keys are not in the pod, so admission
  cannot tell;
- no container is privileged or adds ``SYS_ADMIN`` (or ``ALL``): either can unmount or
  replace the plugin's mounts and reach every GPU of the node;
- the pod does not share the host's pid namespace (``hostPID``: every tenant's pid to
  name) and mounts no ``hostPath`` that contains or lies in the qgpu state directory,
  ``/dev`` or NVIDIA's default MPS pipe directory (``/tmp/nvidia-mps``).

What this cannot see: a symbolic link in the container's image, which makes a mount at an
innocent path land on an injected one (runc resolves mount targets inside the root
file system). Against that, and every other way around the interposer, the node agent's
watchdog is the backstop (docs/kubernetes.md, trust model).
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable, Iterator
from pathlib import PurePosixPath
from typing import Any

from enforcement.sim import MPS_PIPE_DIRECTORY
from k8s_bridge.container_paths import (
    DRIVER_CAPABILITIES_ENV,
    INJECTED_DIRS,
    INJECTED_FILES,
    PURPOSE,
    SLICE_ENV_NAMES,
    SLICE_ENV_PREFIX,
    UNSEEN_CAPABILITIES,
)
from k8s_bridge.resources import ContainerModel, Names, PodModel, pod_slice_requests
from qgpu.errors import RuleViolation
from qgpu.model import WHOLE_GPU_CORE

DEFAULT_NODE_STATE_DIR = PurePosixPath("/var/lib/qgpu")  # the chart's manager.stateDir
HOST_DEVICES = PurePosixPath("/dev")
# NVIDIA's default MPS pipe directory: a pod that reaches the node's MPS control daemon runs
# its work inside an MPS server process, where the watchdog cannot tell whose it is
HOST_MPS_PIPES = PurePosixPath(str(MPS_PIPE_DIRECTORY))
MOUNT_CAPABILITIES = ("SYS_ADMIN", "CAP_SYS_ADMIN", "ALL")


def clean(path: str) -> PurePosixPath:
    """A container or host path as the runtime compares them (Go's filepath.Clean)."""
    cleaned = posixpath.normpath("/" + path.lstrip("/")) if path.startswith("/") else path
    return PurePosixPath(cleaned)


def _within(path: PurePosixPath, root: PurePosixPath) -> bool:
    return path == root or root in path.parents


def reserved_env(name: str) -> bool:
    """Whether `name` is one the slice's environment (or the toolkit's device choice) uses."""
    return name in SLICE_ENV_NAMES or name.startswith(SLICE_ENV_PREFIX)


def _prefix_can_make_reserved(prefix: str) -> bool:
    names = (*SLICE_ENV_NAMES, DRIVER_CAPABILITIES_ENV)
    return (
        any(n.startswith(prefix) for n in names)
        or prefix.startswith(SLICE_ENV_PREFIX)
        or SLICE_ENV_PREFIX.startswith(prefix)
    )


def _mount_violations(
    c: ContainerModel, where: str, state_dir: PurePosixPath | None
) -> Iterator[RuleViolation]:
    dirs = [*INJECTED_DIRS, *([state_dir] if state_dir else [])]
    for j, mount in enumerate(c.volume_mounts or []):
        raw = mount.get("mountPath") if isinstance(mount, dict) else None
        if not isinstance(raw, str):
            continue
        path = clean(raw)
        field = f"{where}.volumeMounts[{j}].mountPath"
        if path in INJECTED_FILES:
            yield RuleViolation(
                field,
                raw,
                f"a qgpu share container may not mount anything at {path}, where the device "
                f"plugin mounts {PURPOSE[path]}: the pod's own mount would replace it",
            )
            continue
        for root in dirs:
            if _within(path, root):
                what = PURPOSE.get(root, "the node's qgpu state")
                yield RuleViolation(
                    field,
                    raw,
                    f"a qgpu share container may not mount anything at or under {root}, "
                    f"where the device plugin mounts {what}: the pod's own mount would "
                    "replace it",
                )
                break


def _env_violations(c: ContainerModel, where: str) -> Iterator[RuleViolation]:
    for j, entry in enumerate(c.env or []):
        name = entry.get("name") if isinstance(entry, dict) else None
        if not isinstance(name, str):
            continue
        field = f"{where}.env[{j}].name"
        if reserved_env(name):
            yield RuleViolation(
                field,
                name,
                f"the slice's environment ({', '.join(SLICE_ENV_NAMES)}, "
                f"{SLICE_ENV_PREFIX}*) is set by the device plugin; a pod's own value would "
                "override it (the GPU it sees, the interposer's contract)",
            )
        elif name == DRIVER_CAPABILITIES_ENV:
            value = entry.get("value")
            caps = {p.strip().lower() for p in value.split(",")} if isinstance(value, str) else None
            if caps is None or caps & set(UNSEEN_CAPABILITIES):
                yield RuleViolation(
                    f"{where}.env[{j}]",
                    value if isinstance(value, str) else "valueFrom",
                    f"{DRIVER_CAPABILITIES_ENV} of a qgpu pod must be a literal list without "
                    f"{', '.join(UNSEEN_CAPABILITIES)}: Vulkan, OpenGL and EGL allocate device "
                    "memory without libcuda, where no interposer sees it",
                )
    for j, source in enumerate(c.env_from or []):
        prefix = source.get("prefix") if isinstance(source, dict) else None
        prefix = prefix if isinstance(prefix, str) else ""
        if _prefix_can_make_reserved(prefix):
            yield RuleViolation(
                f"{where}.envFrom[{j}].prefix",
                prefix or None,
                "envFrom in a qgpu pod needs a prefix that cannot make the slice's environment "
                f"({', '.join(SLICE_ENV_NAMES)}, {SLICE_ENV_PREFIX}*, "
                f"{DRIVER_CAPABILITIES_ENV}): the ConfigMap's or Secret's keys are not in the "
                "pod, so admission cannot check them (e.g. prefix: APP_, or list them in env)",
            )


def _privilege_violations(c: ContainerModel, where: str) -> Iterator[RuleViolation]:
    sc = c.security_context or {}
    if sc.get("privileged") is True:
        yield RuleViolation(
            f"{where}.securityContext.privileged",
            True,
            "a qgpu pod's containers may not be privileged: a privileged container sees "
            "every GPU of the node and can unmount what enforces its slice",
        )
    caps = sc.get("capabilities")
    added = caps.get("add") if isinstance(caps, dict) else None
    for k, cap in enumerate(added if isinstance(added, list) else []):
        if isinstance(cap, str) and cap.upper() in MOUNT_CAPABILITIES:
            yield RuleViolation(
                f"{where}.securityContext.capabilities.add[{k}]",
                cap,
                "a qgpu pod's containers may not add SYS_ADMIN (or ALL): it lets them unmount "
                "or replace what the device plugin mounts",
            )


def _volume_violations(
    pod: PodModel, state_dir: PurePosixPath | None
) -> Iterator[RuleViolation]:
    guarded = [HOST_DEVICES, HOST_MPS_PIPES, *([state_dir] if state_dir else [])]
    for j, volume in enumerate(pod.spec.volumes or []):
        host = volume.get("hostPath") if isinstance(volume, dict) else None
        raw = host.get("path") if isinstance(host, dict) else None
        if not isinstance(raw, str) or not raw.startswith("/"):
            continue
        path = clean(raw)
        for root in guarded:
            if _within(path, root) or _within(root, path):
                yield RuleViolation(
                    f"spec.volumes[{j}].hostPath.path",
                    raw,
                    f"a qgpu pod may not mount a host path that contains or lies in {root} "
                    "(the node's GPUs, its MPS daemon's pipes and every slice's enforcement "
                    "state)",
                )
                break


def _containers(pod: PodModel) -> Iterable[tuple[ContainerModel, str]]:
    for i, c in enumerate(pod.spec.containers):
        yield c, f"spec.containers[{i}]"
    for i, c in enumerate(pod.spec.init_containers or []):
        yield c, f"spec.initContainers[{i}]"


def pod_violations(
    names: Names, pod: PodModel, state_dir: PurePosixPath | None = DEFAULT_NODE_STATE_DIR
) -> list[RuleViolation]:
    """Every setting of `pod` that would override its slices' enforcement; [] for a pod that
    asks for no qgpu resources. Raises RuleViolation on an invalid qgpu request."""
    requests = pod_slice_requests(names, pod)
    if not requests:
        return []
    shares = {r.container for r in requests if r.request.core < WHOLE_GPU_CORE}
    found: list[RuleViolation] = []
    for c, where in _containers(pod):
        if c.name in shares and where.startswith("spec.containers"):
            found += _mount_violations(c, where, state_dir)
        found += _env_violations(c, where)
        found += _privilege_violations(c, where)
    if pod.spec.host_pid:
        found.append(
            RuleViolation(
                "spec.hostPID",
                True,
                "a qgpu pod may not share the host's pid namespace: every other tenant's "
                "processes would be its to name",
            )
        )
    found += _volume_violations(pod, state_dir)
    return found


def check_pod(
    names: Names, pod: PodModel, state_dir: PurePosixPath | None = DEFAULT_NODE_STATE_DIR
) -> None:
    """Raise the first of `pod_violations`, if any."""
    found = pod_violations(names, pod, state_dir)
    if found:
        raise found[0]


def as_state_dir(value: Any) -> PurePosixPath | None:
    """A node state directory from configuration (None or empty: none to guard)."""
    return clean(str(value)) if value else None
