"""``qgpu run``: run a command inside a slice of one GPU on this node.

    qgpu run --core 30 --memory 4 [--isolation fs] [--device UUID] [--sim SPEC] -- CMD...

The request is validated by ``qgpu.model.SliceRequest``; the command gets
``CUDA_VISIBLE_DEVICES=<uuid>``, ``LD_PRELOAD=libqgpu_hook.so`` and the slice's limits
(``enforcement.limits``). GPUs are the real ones (NVML) or simulated ones (``--sim``,
``QGPU_BACKEND=sim``, or no NVIDIA driver on the node), in which case the command also gets
the simulated driver on ``LD_LIBRARY_PATH``. The exit code is the command's.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from enforcement.limits import DEFAULT_STATE_DIR, limits_for_request, new_slice_id
from qgpu.cli_common import (
    ISOLATION_HELP,
    REQUEST_FLAGS,
    add_isolation_option,
    describe,
    flag_violation,
)
from qgpu.errors import RuleViolation, first_violation
from qgpu.model import GpuDevice, SliceRequest

EXIT_INVALID = 2
EXIT_FAILURE = 1
DEFAULT_SIM_SPEC = "H100-80GB"


@dataclass(frozen=True)
class Backend:
    """Where the GPUs come from and what a command needs to reach them."""

    kind: str  # "nvidia" or "sim"
    gpus: tuple[GpuDevice, ...]
    env: dict[str, str]


DESCRIPTION = """\
Run a command inside a slice of one GPU on this node:

    qgpu run --core 30 --memory 4 --isolation fs -- python train.py

The command gets CUDA_VISIBLE_DEVICES=<the GPU's UUID>, the interposer libqgpu_hook.so in
LD_PRELOAD and the slice's limits (QGPU_* variables), so every CUDA process it starts is
held to the slice's memory cap and compute share. GPUs are this node's (NVML), or
simulated ones with --sim, QGPU_BACKEND=sim, or when no NVIDIA driver is installed. Whole
GPUs (--core 100, 200, ...) get their devices and no caps. The exit code is the command's
(128+N when it died of signal N); 2 when the request breaks a rule.
"""


def register_run(subparsers: Any) -> None:
    """Entry point of group ``qgpu.commands``: adds ``qgpu run``."""
    p = subparsers.add_parser(
        "run", help="run a command inside a GPU slice on this node", description=DESCRIPTION
    )
    p.add_argument(
        "--core",
        required=True,
        help="qgpu-core: 1..99 = percent of the GPU, 100, 200, ... = whole GPUs",
    )
    p.add_argument(
        "--memory", help="qgpu-memory: whole GiB of the GPU (8, 8Gi, 8192Mi); required for a share"
    )
    add_isolation_option(p, old=["--policy"], help=ISOLATION_HELP + " (default: best-effort)")
    p.add_argument("--device", help="GPU UUID (default: the first GPU of the node)")
    p.add_argument("--sim", metavar="SPEC", help="simulated GPUs, e.g. 2xH100-80GB")
    p.add_argument(
        "--slice-id",
        help="slice id (default: a new one); processes started with the same id share its caps",
    )
    p.add_argument(
        "--state-dir",
        default=os.environ.get("QGPU_STATE_DIR", DEFAULT_STATE_DIR),
        help="directory of the shared slice ledgers ($QGPU_STATE_DIR)",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")
    p.set_defaults(func=run_handler)


def validate_request(core: str, memory: str | None, isolation: str | None) -> SliceRequest:
    """The slice rules live in qgpu.model: this is the only validation done here; a broken
    rule names the flag (``--core``, ``--memory``, ``--isolation``)."""
    raw: dict[str, object] = {"core": core, "memory": memory}
    if isolation is not None:
        raw["isolation"] = isolation
    try:
        return SliceRequest.parse(raw, "qgpu run")
    except RuleViolation as exc:
        raise flag_violation(exc, REQUEST_FLAGS) from exc


def _nvidia_driver_present() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def sim_backend(spec: str | None, state_dir: str) -> Backend:
    from enforcement.discovery import SIM_SPEC_ENV
    from enforcement.sim import load_sim_config, sim_environment, write_sim_config

    existing = os.environ.get("QGPU_SIM_CONFIG")
    if spec is None and existing and Path(existing).is_file():
        cfg = load_sim_config(existing)
    else:
        spec = spec or os.environ.get(SIM_SPEC_ENV) or DEFAULT_SIM_SPEC
        node = socket.gethostname()
        digest = hashlib.sha256(f"{node}/{spec}".encode()).hexdigest()[:12]
        cfg = write_sim_config(Path(state_dir) / "sim" / f"{digest}.conf", spec, node=node)
    gpus = tuple(
        GpuDevice(
            uuid=g.uuid,
            index=g.index,
            model=g.model,
            memory_mib=g.memory_bytes >> 20,
            sm_count=g.sms,
        )
        for g in cfg.gpus
    )
    return Backend("sim", gpus, sim_environment(cfg.path))


def nvidia_backend() -> Backend:
    import pynvml

    pynvml.nvmlInit()
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            gpus.append(
                GpuDevice(
                    uuid=str(pynvml.nvmlDeviceGetUUID(h)),
                    index=i,
                    model=str(pynvml.nvmlDeviceGetName(h)),
                    memory_mib=int(mem.total) >> 20,
                )
            )
    finally:
        pynvml.nvmlShutdown()
    return Backend("nvidia", tuple(gpus), {})


def choose_backend(args: argparse.Namespace) -> Backend:
    if args.sim or os.environ.get("QGPU_BACKEND") == "sim" or not _nvidia_driver_present():
        return sim_backend(args.sim, args.state_dir)
    return nvidia_backend()


def slice_environment(
    args: argparse.Namespace, request: SliceRequest, backend: Backend, base: dict[str, str]
) -> dict[str, str]:
    """The command's environment: the device, the interposer and the slice's limits."""
    if not backend.gpus:
        raise RuleViolation("--device", None, "this node has no GPU")
    if args.device:
        gpu = next((g for g in backend.gpus if g.uuid == args.device), None)
        if gpu is None:
            known = ", ".join(g.uuid for g in backend.gpus)
            raise RuleViolation("--device", args.device, f"must be a GPU of this node ({known})")
    else:
        gpu = backend.gpus[0]
    try:
        request.check_against(gpu)
    except RuleViolation as exc:
        raise flag_violation(exc, REQUEST_FLAGS) from exc
    env = dict(base)
    env.update(backend.env)
    if request.is_whole_gpu:
        count = request.gpu_count
        if count > len(backend.gpus):
            raise RuleViolation(
                "--core", request.core, f"needs {count} GPUs, this node has {len(backend.gpus)}"
            )
        start = backend.gpus.index(gpu)
        chosen = (backend.gpus[start:] + backend.gpus[:start])[:count]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(g.uuid for g in chosen)
        return env
    from enforcement.native import hook_library_path

    limits = limits_for_request(
        request,
        slice_id=args.slice_id or new_slice_id(),
        device_uuid=gpu.uuid,
        state_dir=args.state_dir,
    )
    env.update(limits.to_env())
    env["CUDA_VISIBLE_DEVICES"] = gpu.uuid
    hook = str(hook_library_path())
    preload = [p for p in base.get("LD_PRELOAD", "").split() if p and p != hook]
    env["LD_PRELOAD"] = " ".join([hook, *preload])
    return env


def run_handler(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        print(
            "qgpu run: no command given (usage: qgpu run --core N --memory GiB -- CMD...)",
            file=sys.stderr,
        )
        return EXIT_INVALID
    try:
        request = validate_request(args.core, args.memory, args.isolation)
        backend = choose_backend(args)
        env = slice_environment(args, request, backend, dict(os.environ))
    except RuleViolation as exc:
        print(f"qgpu run: {describe(exc)}", file=sys.stderr)
        return EXIT_INVALID
    except ValidationError as exc:
        print(f"qgpu run: {describe(first_violation(exc))}", file=sys.stderr)
        return EXIT_INVALID
    except ValueError as exc:  # e.g. a bad --sim spec
        print(f"qgpu run: {exc}", file=sys.stderr)
        return EXIT_INVALID
    try:
        proc = subprocess.Popen(command, env=env)
    except OSError as exc:
        print(f"qgpu run: cannot start {command[0]!r}: {exc.strerror}", file=sys.stderr)
        return 127 if isinstance(exc, FileNotFoundError) else 126
    try:
        code = proc.wait()
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGINT)
        code = proc.wait()
    return 128 - code if code < 0 else code
