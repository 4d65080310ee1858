"""``qgpu device-plugin``, ``qgpu extender`` and ``qgpu webhook`` (entry points of `qgpu.cli`).

Each ``register_*(subparsers)`` adds one subcommand whose handler returns an exit code.
The device plugin discovers its GPUs through `enforcement.discovery` (NVML, or the
simulated backend with ``--sim 2xH100-80GB``), publishes them on its Node, serves kubelet
and re-discovers every ``--health-interval`` seconds to report health changes; with
``--agent-socket`` it records each slice with the node agent.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from qgpu.mix_prior import add_prior_option, use_prior
from qgpu.model import DEFAULT_MAX_SLICES_PER_GPU, PlacementPolicy, SlicesPerGpu

EXIT_OK = 0
EXIT_FAILURE = 1


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--prefix",
        default=os.environ.get("QGPU_RESOURCE_PREFIX", "tke.cloud.tencent.com"),
        help="resource name prefix: <prefix>/qgpu-core, <prefix>/qgpu-memory",
    )
    p.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster, then ~/.kube)")
    p.add_argument("--apiserver", help="apiserver URL (overrides kubeconfig; for proxies/tests)")
    p.add_argument("--log-level", default="INFO")


def _logging(args: argparse.Namespace) -> None:
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def _kube(args: argparse.Namespace) -> Any:
    from k8s_bridge.kube import Kube, make_api_client
    from k8s_bridge.resources import Names

    return Kube(make_api_client(args.apiserver, args.kubeconfig), Names(args.prefix))


def _serving_flags(p: argparse.ArgumentParser, client_help: str) -> None:
    """Request limits and TLS of an HTTP server (`k8s_bridge.http_serving`, `peer_auth`)."""
    p.add_argument("--tls-cert", help="server certificate (PEM); plain HTTP without it")
    p.add_argument("--tls-key", help="server key (PEM)")
    p.add_argument(
        "--client-ca",
        help=f"require a client certificate signed by this CA (PEM) on every request but "
        f"/healthz: 401 without one, 403 for a name not in --client-name ({client_help})",
    )
    p.add_argument(
        "--client-name",
        action="append",
        default=[],
        help="a client certificate common name to accept (repeatable; default: any the CA signed)",
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        help="seconds a request's head may take to arrive (408 and close after)",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        help="seconds more its body may take (408 and close after)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=8 * 1024 * 1024,
        help="largest request body (413 above it)",
    )


def _serving(args: argparse.Namespace) -> tuple[Any, Any]:
    """(ServerLimits, ServerTLS or None) from `_serving_flags`; SystemExit(2) on bad flags."""
    from pydantic import ValidationError

    from k8s_bridge.http_serving import ServerLimits
    from k8s_bridge.peer_auth import ServerTLS

    for flag in ("header_timeout", "body_timeout", "max_body_bytes"):
        if getattr(args, flag) <= 0:
            raise SystemExit(f"--{flag.replace('_', '-')} must be positive")
    limits = ServerLimits(
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
        max_body_bytes=args.max_body_bytes,
    )
    if not args.tls_cert:
        if args.client_ca or args.tls_key:
            raise SystemExit("--client-ca and --tls-key need --tls-cert")
        return limits, None
    try:
        tls = ServerTLS(
            cert=args.tls_cert,
            key=args.tls_key or args.tls_cert,
            client_ca=args.client_ca,
            client_names=frozenset(args.client_name),
        )
    except ValidationError as exc:
        raise SystemExit(f"TLS settings: {exc.errors()[0]['msg']}") from None
    return limits, tls


def _wait_for_signal() -> None:
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    done.wait()


# --- device plugin -------------------------------------------------------------------------


def run_device_plugin(args: argparse.Namespace) -> int:
    from enforcement.discovery import discover, node_slice_policy, open_backend
    from k8s_bridge.deviceplugin.allocation import AllocationPaths
    from k8s_bridge.deviceplugin.server import PluginConfig, QgpuDevicePlugin

    _logging(args)
    node = args.node_name or os.environ.get("NODE_NAME")
    if not node:
        logging.error("--node-name (or NODE_NAME from the downward API) is required")
        return EXIT_FAILURE
    state_dir = Path(args.state_dir)
    backend = open_backend(args.backend, sim_spec=args.sim, state_dir=state_dir, node_name=node)
    if args.slices_per_gpu is None and args.slices_per_gpu_file is None:
        slices = SlicesPerGpu(limit=args.max_slices)  # floor-gib, capped at --max-slices
    else:
        slices = node_slice_policy(args.slices_per_gpu, args.slices_per_gpu_file, args.max_slices)

    def discovered() -> Any:
        return discover(
            backend, node, max_slices_per_gpu=slices.limit, fixed_slices=slices.fixed
        )

    inventory = discovered()
    paths = AllocationPaths(
        state_dir=state_dir,
        hook_library=_hook_library(args.hook_library),
        workload_env=dict(backend.workload_env),
        agent=_agent(args.agent_socket),
        workload_gid=args.workload_gid,
    )
    cfg = PluginConfig(node_name=node, prefix=args.prefix, plugin_dir=Path(args.plugin_dir))
    plugin = QgpuDevicePlugin(cfg, _kube(args), inventory, paths)
    plugin.start()
    stop = threading.Event()

    def refresh() -> None:
        while not stop.wait(args.health_interval):
            try:
                now = discovered()
            except Exception as exc:  # keep serving the last inventory; say why
                logging.warning("GPU re-discovery failed: %s", exc)
                continue
            if now.gpus != plugin.inventory.gpus:
                plugin.set_inventory(now)

    threading.Thread(target=refresh, daemon=True).start()
    try:
        _wait_for_signal()
    finally:
        stop.set()
        plugin.stop()
        backend.close()
    return EXIT_OK


def _agent(socket_path: str | None) -> Any:
    """A client of the node agent (waits up to a minute for it to come up), or None."""
    if not socket_path:
        return None
    from enforcement.agent.client import AgentClient, AgentUnavailable

    client = AgentClient(socket_path)
    deadline = time.monotonic() + 60
    while True:
        try:
            client.node()
            return client
        except AgentUnavailable as exc:
            if time.monotonic() > deadline:
                logging.warning("%s; Allocate fails until the agent answers", exc)
                return client
            time.sleep(1.0)


def _hook_library(explicit: str | None) -> Path | None:
    if explicit:
        return Path(explicit)
    try:
        from enforcement.native import NativeLibraryMissing, hook_library_path
    except ImportError:
        return None
    try:
        return hook_library_path()
    except NativeLibraryMissing as exc:
        logging.warning("%s; share slices will be refused at Allocate", exc)
        return None


def register_device_plugin(sub: Any) -> None:
    p = sub.add_parser("device-plugin", help="run the Kubernetes device plugin on this node")
    _common(p)
    p.add_argument("--node-name", help="this node's name (default: $NODE_NAME)")
    p.add_argument("--plugin-dir", default="/var/lib/kubelet/device-plugins")
    p.add_argument("--state-dir", default="/var/lib/qgpu", help="limits files and ledgers")
    p.add_argument("--backend", default=None, help="nvml, sim or auto (default: auto)")
    p.add_argument("--sim", help="simulated GPUs, e.g. 2xH100-80GB")
    p.add_argument("--hook-library", help="interposer path (default: the built one)")
    p.add_argument(
        "--max-slices",
        type=int,
        default=DEFAULT_MAX_SLICES_PER_GPU,
        help="cap of the floor-gib rule (see --slices-per-gpu)",
    )
    p.add_argument(
        "--slices-per-gpu",
        help="slices one GPU may hold: floor-gib (floor(GiB/4), at most 16) or a fixed "
        "count 1..16; published in the node's inventory",
    )
    p.add_argument(
        "--slices-per-gpu-file",
        help="a file whose text, when the file exists, overrides --slices-per-gpu (the chart "
        "writes the node label's value there)",
    )
    p.add_argument("--health-interval", type=float, default=10.0)
    p.add_argument(
        "--agent-socket",
        help="record every slice with the node agent on this socket (it writes the limits "
        "files and watches the pods' processes); default: the plugin writes them itself",
    )
    p.add_argument(
        "--workload-gid",
        type=int,
        default=0,
        help="group that may use the GPUs' region files (default 0: containers in group 0)",
    )
    p.set_defaults(func=run_device_plugin)


# --- extender ------------------------------------------------------------------------------


def run_extender(args: argparse.Namespace) -> int:
    from k8s_bridge.extender.app import create_app
    from k8s_bridge.extender.service import Extender, ExtenderConfig
    from k8s_bridge.http_serving import serve

    _logging(args)
    use_prior(args.mix_prior)
    limits, tls = _serving(args)
    if tls is None or tls.client_ca is None:
        logging.warning(
            "the extender authenticates no caller (no --tls-cert/--client-ca): anyone who "
            "can reach port %d can ask it to bind pods of %s",
            args.port,
            args.scheduler_name,
        )
    holder = args.holder_id or _default_holder()
    cfg = ExtenderConfig(
        prefix=args.prefix,
        scheduler_name=args.scheduler_name,
        **({"holder": holder} if holder else {}),
        holder_pod=_holder_pod(),
        node_policy=PlacementPolicy.parse(args.node_policy, "--node-policy"),
        gpu_policy=PlacementPolicy.parse(args.gpu_policy, "--gpu-policy")
        if args.gpu_policy
        else None,
        lock_ttl_s=args.lock_ttl,
        lock_linger_s=args.lock_linger,
        assume_ttl_s=args.assume_ttl,
        compat=args.compat,
    )
    ext = Extender(_kube(args), cfg)
    ext.start()
    try:
        serve(create_app(ext), host=args.host, port=args.port, limits=limits, tls=tls)
    finally:
        ext.stop()
    return EXIT_OK


def _holder_pod() -> Any:
    """The pod this extender runs in, from the downward API (POD_NAMESPACE, POD_NAME,
    POD_UID), or None outside a pod."""
    from k8s_bridge.kube import HolderPod

    ns, name, uid = (os.environ.get(k) for k in ("POD_NAMESPACE", "POD_NAME", "POD_UID"))
    return HolderPod(ns, name, uid) if ns and name and uid else None


def _default_holder() -> str | None:
    """The pod's namespace/name (stable across restarts of its containers), else None (a
    random name per process)."""
    pod = _holder_pod()
    return f"qgpu-extender/{pod.ref}" if pod else None


def register_extender(sub: Any) -> None:
    names = [p.value for p in PlacementPolicy]
    p = sub.add_parser("extender", help="run the kube-scheduler extender (HTTP or HTTPS)")
    _common(p)
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8888)
    p.add_argument(
        "--scheduler-name",
        default="qgpu-scheduler",
        help="bind only pods with this spec.schedulerName (the profile that calls us)",
    )
    p.add_argument(
        "--holder-id",
        help="this replica's name in node locks (default: qgpu-extender/$POD_NAMESPACE/"
        "$POD_NAME from the downward API, else random per process); must differ between "
        "replicas and stay the same across restarts of one",
    )
    _serving_flags(p, "kube-scheduler's extender tlsConfig certificate")
    p.add_argument("--node-policy", default="binpack", choices=names)
    p.add_argument("--gpu-policy", choices=names, help="default: same as --node-policy")
    add_prior_option(p)
    p.add_argument("--lock-ttl", type=float, default=30.0, help="node lock expiry, seconds")
    p.add_argument(
        "--lock-linger",
        type=float,
        default=0.2,
        help="keep a node's lock this long after a bind for the next bind there, seconds "
        "(0: release after every bind)",
    )
    p.add_argument(
        "--assume-ttl",
        type=float,
        default=10.0,
        help="hold prioritize's best node until bind for this long, seconds (0: off)",
    )
    _compat_flag(p)
    p.set_defaults(func=run_extender)


def _compat_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--compat",
        action="store_true",
        help="compat mode: the webhook translates HAMi and Koordinator resource names and "
        "annotations into qgpu slices (see docs/install.md 'Migrating')",
    )


# --- webhook -------------------------------------------------------------------------------


def run_webhook(args: argparse.Namespace) -> int:
    from k8s_bridge.http_serving import serve
    from k8s_bridge.resources import Names
    from k8s_bridge.webhook import create_app

    _logging(args)
    limits, tls = _serving(args)
    app = create_app(Names(args.prefix), args.scheduler_name, compat_mode=args.compat)
    serve(app, host=args.host, port=args.port, limits=limits, tls=tls)
    return EXIT_OK


def register_webhook(sub: Any) -> None:
    p = sub.add_parser("webhook", help="run the mutating admission webhook (HTTPS)")
    p.add_argument(
        "--prefix", default=os.environ.get("QGPU_RESOURCE_PREFIX", "tke.cloud.tencent.com")
    )
    p.add_argument("--scheduler-name", default="qgpu-scheduler")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8443)
    p.add_argument("--log-level", default="INFO")
    _serving_flags(p, "for an apiserver configured with webhook client credentials")
    _compat_flag(p)
    p.set_defaults(func=run_webhook)
