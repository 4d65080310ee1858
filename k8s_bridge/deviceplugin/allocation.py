"""What a container receives from Allocate: env, mounts and devices for the interposer.

`container_response()` is the ONE mapping from a container's assignment to kubelet's
`ContainerAllocateResponse`. The limits themselves come from `enforcement.limits` (the
interposer's contract: ``QGPU_SLICE_ID``, ``QGPU_DEVICE_UUID``, ``QGPU_MEMORY_LIMIT`` in
bytes, ``QGPU_CORE_LIMIT``, ``QGPU_ISOLATION``, ``QGPU_STATE_DIR``, ``QGPU_LIMITS_FILE``,
and in simulation ``QGPU_REAL_LIBCUDA`` / ``QGPU_SIM_CONFIG``), the slice's files from
`enforcement.state_tree` (one directory per slice); this module adds what only a container
needs:

- the slice's limits file (root-owned, mode 0440), bind-mounted read-only at
  ``/etc/qgpu/limits.conf``, where the interposer trusts it whatever the environment says;
- ``/etc/ld.so.preload`` bind-mounted read-only from a host file naming the interposer, and
  the interposer itself mounted read-only at ``/usr/local/qgpu/lib/libqgpu_hook.so``, so
  ``env -u LD_PRELOAD`` cannot escape the caps;
- of the state tree only the container's own slice's ``ledger/`` directory (read-write,
  owned by the container's user: ``runAsUser``/``runAsGroup`` of the container, else of the
  pod, else root), its GPU's directory ``.gpu-<uuid>/`` read-only (the roster: every
  slice's policy and share; the other slices' activity files; with an agent, its busy list
  of the slices its watchdog saw run) and, inside it, its own activity file read-write
  (mounted after the directory): it can say what it does itself, nothing about another
  slice;
- device selection: ``CUDA_VISIBLE_DEVICES`` / ``NVIDIA_VISIBLE_DEVICES`` = GPU UUID(s) and
  the ``/dev/nvidia*`` device nodes that exist on the host.

Whole GPUs get the device(s) and the slice id only: nothing to cap.

With a node agent (``qgpu device-plugin --agent-socket``), the slice is recorded with the
agent instead (`enforcement.agent` ``POST /v1/slices/record``, owner = the pod, uid/gid =
the container's): the agent checks it against everything else on the node (Ray, Dask,
other pods), makes the slice's files in its own state tree, and its reconcile and watchdog
cover the pod. The same pieces of that tree are then mounted at their host paths (so
the paths inside the limits file hold in the container too), and the limits file at
``/etc/qgpu/limits.conf`` as well.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from enforcement.agent.client import AgentClient, AgentError, AgentUnavailable
from enforcement.gpu_roster import WRITER_PLUGIN, RosterFull
from enforcement.limits import allocation_env, limits_for_allocation
from enforcement.state_tree import Identity, StateTree, activity_file, gpu_dir
from k8s_bridge import container_paths
from k8s_bridge.deviceplugin.v1beta1 import api_pb2 as pb
from k8s_bridge.protocol import ContainerAssignment, Kind
from k8s_bridge.resources import PodModel
from qgpu.errors import RuleViolation
from qgpu.model import (
    WHOLE_GPU_CORE,
    Allocation,
    GpuDevice,
    IsolationPolicy,
    Owner,
    OwnerKind,
    SliceRequest,
)

CONTAINER_LIMITS_FILE = Path(container_paths.CONTAINER_LIMITS_FILE)
CONTAINER_PRELOAD = Path(container_paths.CONTAINER_PRELOAD)
CONTAINER_HOOK = Path(container_paths.CONTAINER_HOOK)
CONTAINER_STATE_DIR = Path(container_paths.CONTAINER_STATE_DIR)
CONTROL_DEVICES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")


@dataclass(frozen=True)
class AllocationPaths:
    """Host-side paths the plugin writes and mounts (under one state directory)."""

    state_dir: Path
    hook_library: Path | None
    dev_dir: Path = Path("/dev")
    workload_env: dict[str, str] = field(default_factory=dict)
    agent: AgentClient | None = None
    workload_gid: int = 0  # group of the GPUs' shared state (.gpu-<uuid>/)

    @property
    def slices_dir(self) -> Path:
        """The plugin's own slice directories (when no agent records the slices)."""
        return self.state_dir / "k8s" / "slices"

    @property
    def gpus_dir(self) -> Path:
        """The GPUs' shared state (.gpu-<uuid>/), shared with the node agent's workloads."""
        return self.state_dir / "slices"

    @property
    def preload_file(self) -> Path:
        return self.state_dir / "k8s" / "ld.so.preload"

    def tree(self) -> StateTree:
        return StateTree(self.slices_dir, privileged=os.geteuid() == 0)

    def gpu_state(self) -> StateTree:
        return StateTree(
            self.gpus_dir, privileged=os.geteuid() == 0, workload_gid=self.workload_gid
        )


class AllocationError(Exception):
    """The container cannot be given its slice (reported to kubelet as a gRPC error)."""


def k8s_slice_id(pod_uid: str, container: str) -> str:
    """A slice id (``[A-Za-z0-9][A-Za-z0-9._-]{0,63}``) unique per pod container."""
    sid = f"{pod_uid}.{container}"
    if len(sid) <= 64:
        return sid
    return f"{pod_uid}.{hashlib.sha256(container.encode()).hexdigest()[:16]}"


def limits_file_for(paths: AllocationPaths, slice_id: str) -> Path:
    return paths.tree().files(slice_id).limits_file


def container_identity(pod: PodModel, container: str) -> Identity:
    """The user a container runs as, as far as the pod says: ``runAsUser``/``runAsGroup``
    of the container's securityContext, else of the pod's, else root (uid 0, gid 0)."""
    pod_ctx = pod.spec.security_context or {}
    own: dict[str, Any] = next(
        (c.security_context or {} for c in pod.spec.containers if c.name == container), {}
    )

    def pick(key: str) -> int:
        value = own.get(key, pod_ctx.get(key))
        return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0

    return Identity(pick("runAsUser"), pick("runAsGroup"))


def _device_specs(paths: AllocationPaths, gpus: list[GpuDevice]) -> list[pb.DeviceSpec]:
    specs = []
    wanted = [str(paths.dev_dir / f"nvidia{g.index}") for g in gpus]
    wanted += [str(paths.dev_dir / Path(p).name) for p in CONTROL_DEVICES]
    for host in wanted:
        if Path(host).exists():
            container = "/dev/" + Path(host).name
            specs.append(pb.DeviceSpec(container_path=container, host_path=host, permissions="rw"))
    return specs


def container_response(
    paths: AllocationPaths,
    pod_uid: str,
    container: str,
    ca: ContainerAssignment,
    gpus: list[GpuDevice],
    kind: Kind,
    identity: Identity | None = None,
) -> pb.ContainerAllocateResponse:
    """Env, mounts and devices of one container's slice (makes its files)."""
    who = identity or Identity(0, 0)
    sid = k8s_slice_id(pod_uid, container)
    alloc = Allocation(
        slice_id=sid,
        node="",
        gpu_uuids=ca.gpus,
        core=ca.core,
        memory_gib=ca.memory_gib[0],
        isolation=ca.isolation,
        owner=Owner(kind=OwnerKind.POD, id=pod_uid, meta={"container": container}),
    )
    if paths.agent is not None:
        return _recorded_by_agent(paths, paths.agent, alloc, ca, gpus, kind, who)
    env = dict(paths.workload_env)
    env["NVIDIA_VISIBLE_DEVICES"] = ",".join(ca.gpus)
    if ca.core >= 100:
        env.update(allocation_env(alloc))  # the device(s) and the slice id: nothing to cap
        if kind != "core":
            return pb.ContainerAllocateResponse(envs=env)
        return pb.ContainerAllocateResponse(envs=env, devices=_device_specs(paths, gpus))
    if paths.hook_library is None or not paths.hook_library.is_file():
        raise AllocationError(
            f"the interposer library is not available on this node ({paths.hook_library}); "
            "a share slice cannot be enforced without it"
        )
    try:
        limits = replace(
            limits_for_allocation(alloc, state_dir=str(CONTAINER_STATE_DIR)),
            real_libcuda=paths.workload_env.get("QGPU_REAL_LIBCUDA"),
            sim_config=paths.workload_env.get("QGPU_SIM_CONFIG"),
        )
    except RuleViolation as exc:
        raise AllocationError(f"the slice's limits are invalid: {exc}") from exc
    values = limits.to_env()
    values["QGPU_LIMITS_FILE"] = str(CONTAINER_LIMITS_FILE)
    env.update(values)
    env["CUDA_VISIBLE_DEVICES"] = ca.gpus[0]
    if kind != "core":
        # Mounts and devices come once per container, with the core resource (kubelet
        # merges the two plugins' answers; a mount given twice would clash).
        return pb.ContainerAllocateResponse(envs=env)
    tree = paths.tree()
    try:
        tree.prepare()
        files = tree.create(sid, who)
        tree.write_limits(sid, values, who)
        shared = paths.gpu_state()
        shared.prepare()
        _join_gpu(shared, ca.gpus[0], sid, who, ca.isolation, ca.core)
        preload = _preload_file(paths)
    except RosterFull as exc:
        raise AllocationError(f"cannot list the slice on its GPU: {exc}") from exc
    except OSError as exc:
        raise AllocationError(f"cannot write the slice's files on the host: {exc}") from exc
    mounts = [
        pb.Mount(
            container_path=str(CONTAINER_LIMITS_FILE),
            host_path=str(files.limits_file),
            read_only=True,
        ),
        *_preload_mounts(paths, preload),
        *_state_mounts(
            CONTAINER_STATE_DIR / sid / files.ledger_dir.name,
            files.ledger_dir,
            (CONTAINER_STATE_DIR, shared.root),
            ca.gpus[0],
            sid,
        ),
    ]
    return pb.ContainerAllocateResponse(envs=env, mounts=mounts, devices=_device_specs(paths, gpus))


def _state_mounts(
    ledger_in: Path, ledger_host: Path, roots: tuple[Path, Path], uuid: str, slice_id: str
) -> list[pb.Mount]:
    """Of the node's state tree: the container's own slice ledger directory (read-write),
    its GPU's directory read-only (the roster, the other slices' activity, the agent's busy
    list) and its own activity file in it read-write, listed after the directory it lies in
    (runtimes mount in order). `roots`: the slices root inside the container and on the
    host."""
    inside, host = roots
    return [
        pb.Mount(container_path=str(ledger_in), host_path=str(ledger_host), read_only=False),
        pb.Mount(
            container_path=str(gpu_dir(inside, uuid)),
            host_path=str(gpu_dir(host, uuid)),
            read_only=True,
        ),
        pb.Mount(
            container_path=str(activity_file(inside, uuid, slice_id)),
            host_path=str(activity_file(host, uuid, slice_id)),
            read_only=False,
        ),
    ]


IDLE_EVICTION_S = 600.0  # a full roster gives up plugin entries idle for this long


def _join_gpu(
    shared: StateTree,
    uuid: str,
    slice_id: str,
    who: Identity,
    isolation: IsolationPolicy,
    core: int,
) -> Path:
    """List the slice on its GPU. Without an agent nobody tells the plugin that a pod is
    gone, so when the GPU's roster is full the plugin's entries idle for IDLE_EVICTION_S
    (long-gone pods, in practice: a GPU holds at most 16 live slices) make room."""
    try:
        return shared.join_gpu(uuid, slice_id, who, isolation, core, WRITER_PLUGIN)
    except RosterFull:
        shared.evict_idle(uuid, WRITER_PLUGIN, IDLE_EVICTION_S)
        return shared.join_gpu(uuid, slice_id, who, isolation, core, WRITER_PLUGIN)


def _preload_file(paths: AllocationPaths) -> Path:
    """The host file bind-mounted as the container's /etc/ld.so.preload."""
    preload = paths.preload_file
    preload.parent.mkdir(parents=True, exist_ok=True)
    text = f"{CONTAINER_HOOK}\n"
    if not preload.exists() or preload.read_text() != text:
        tmp = preload.with_name(f".{preload.name}.{os.getpid()}")
        tmp.write_text(text)
        os.chmod(tmp, 0o444)
        os.replace(tmp, preload)
    return preload


def _preload_mounts(paths: AllocationPaths, preload: Path) -> list[pb.Mount]:
    return [
        pb.Mount(container_path=str(CONTAINER_PRELOAD), host_path=str(preload), read_only=True),
        pb.Mount(
            container_path=str(CONTAINER_HOOK), host_path=str(paths.hook_library), read_only=True
        ),
    ]


def _recorded_by_agent(
    paths: AllocationPaths,
    agent: AgentClient,
    alloc: Allocation,
    ca: ContainerAssignment,
    gpus: list[GpuDevice],
    kind: Kind,
    who: Identity,
) -> pb.ContainerAllocateResponse:
    """The slice as the node agent records and enforces it (a repeat is a no-op there)."""
    whole = ca.core >= WHOLE_GPU_CORE
    request = SliceRequest(
        core=WHOLE_GPU_CORE * len(ca.gpus) if whole else ca.core,
        memory_gib=None if whole else ca.memory_gib[0],
        isolation=ca.isolation,
    )
    try:
        res = agent.record(
            alloc.slice_id, request, list(ca.gpus), alloc.owner, uid=who.uid, gid=who.gid
        )
    except AgentUnavailable as exc:
        raise AllocationError(str(exc)) from exc
    except AgentError as exc:
        raise AllocationError(f"the node agent refused the slice: {exc}") from exc
    env = {k: v for k, v in res.env.items() if k != "LD_PRELOAD"}  # /etc/ld.so.preload does
    env["NVIDIA_VISIBLE_DEVICES"] = ",".join(ca.gpus)
    if kind != "core":
        return pb.ContainerAllocateResponse(envs=env)
    devices = _device_specs(paths, gpus)
    if res.enforcement == "none":
        return pb.ContainerAllocateResponse(envs=env, devices=devices)
    if res.enforcement != "interposer" or not res.limits_file or "QGPU_STATE_DIR" not in env:
        raise AllocationError(
            f"the node agent enforces this slice with {res.enforcement}, which the device "
            "plugin cannot hand to a container; run the agent with --enforcement interposer"
        )
    if paths.hook_library is None or not paths.hook_library.is_file():
        raise AllocationError(
            f"the interposer library is not available on this node ({paths.hook_library})"
        )
    try:
        preload = _preload_file(paths)
    except OSError as exc:
        raise AllocationError(f"cannot write {paths.preload_file}: {exc}") from exc
    state = StateTree(Path(env["QGPU_STATE_DIR"]), privileged=False)
    files = state.files(alloc.slice_id)
    limits = res.limits_file
    mounts = [
        pb.Mount(container_path=str(CONTAINER_LIMITS_FILE), host_path=limits, read_only=True),
        pb.Mount(container_path=limits, host_path=limits, read_only=True),
        *_preload_mounts(paths, preload),
        *_state_mounts(
            files.ledger_dir, files.ledger_dir, (state.root, state.root), ca.gpus[0], alloc.slice_id
        ),
    ]
    return pb.ContainerAllocateResponse(envs=env, mounts=mounts, devices=devices)
