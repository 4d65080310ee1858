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
import ssl
import threading
import time
from pathlib import Path
from typing import Any

from qgpu.cli_common import DEFAULT_PLACEMENT_HELP, add_placement_options, choice
from qgpu.errors import QgpuError, RuleViolation
from qgpu.mix_prior import add_prior_option, use_prior
from qgpu.model import (
    DEFAULT_MAX_SLICES_PER_GPU,
    DEFAULT_PLACEMENT,
    PlacementPolicy,
    SlicesPerGpu,
)

EXIT_OK = 0
EXIT_FAILURE = 1


LOG_LEVELS = ["debug", "info", "warning", "error"]


def _prefix(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--prefix",
        default=os.environ.get("QGPU_RESOURCE_PREFIX", "tke.cloud.tencent.com"),
        help="resource name prefix: <prefix>/qgpu-core, <prefix>/qgpu-memory "
        "($QGPU_RESOURCE_PREFIX)",
    )


def _log_level(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--log-level",
        type=choice(LOG_LEVELS, "--log-level"),
        default="info",
        metavar="|".join(LOG_LEVELS),
        help="log level (stderr)",
    )


def _common(p: argparse.ArgumentParser) -> None:
    _prefix(p)
    p.add_argument(
        "--kubeconfig",
        help="kubeconfig file (default: the in-cluster service account, else "
        "$KUBECONFIG or ~/.kube/config)",
    )
    p.add_argument("--apiserver", help="apiserver URL (overrides kubeconfig; for proxies/tests)")
    _log_level(p)


def _assignment_key_flags(p: argparse.ArgumentParser, role: str) -> None:
    p.add_argument(
        "--assignment-key-file",
        metavar="FILE",
        help=f"the key (at least 32 bytes) the extender signs assignments with and the "
        f"device plugin checks them with (HMAC-SHA256; the chart's Secret): this {role}; "
        "without it assignments are neither signed nor checked",
    )
    p.add_argument(
        "--assignment-previous-key-file",
        metavar="FILE",
        help="during a key rotation: the previous key, still accepted when checking (a "
        "file that does not exist means no rotation)",
    )


def _assignment_keys(args: argparse.Namespace) -> Any:
    """The AssignmentKeys of the key flags, or None without --assignment-key-file; a bad
    key file is a RuleViolation naming the flag and the path."""
    from k8s_bridge.assignment_mac import AssignmentKeys

    if args.assignment_key_file is None:
        if args.assignment_previous_key_file is not None:
            raise RuleViolation(
                "--assignment-previous-key-file",
                args.assignment_previous_key_file,
                "needs --assignment-key-file (the current key)",
            )
        return None
    return AssignmentKeys.from_files(args.assignment_key_file, args.assignment_previous_key_file)


def _logging(args: argparse.Namespace) -> None:
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def _kube(args: argparse.Namespace) -> Any:
    """The apiserver client; no usable configuration is one line naming the way to give one."""
    from kubernetes.config import ConfigException

    from k8s_bridge.kube import Kube, make_api_client
    from k8s_bridge.resources import Names

    try:
        api = make_api_client(args.apiserver, args.kubeconfig)
    except (ConfigException, OSError) as exc:
        where = (
            f"--kubeconfig {args.kubeconfig}"
            if args.kubeconfig
            else "no in-cluster service account and no usable $KUBECONFIG or ~/.kube/config"
        )
        reason = " ".join(str(exc).split())
        raise QgpuError(
            f"cannot reach Kubernetes: {where} ({reason}); pass --kubeconfig FILE or "
            "--apiserver URL, or run inside a pod"
        ) from exc
    return Kube(api, Names(args.prefix))


def tls_pair(args: argparse.Namespace, insecure_flag: str = "--insecure-http") -> tuple[str, str]:
    """``--tls-cert`` and ``--tls-key``: both or neither, and loadable as PEM; neither is
    allowed only with `insecure_flag` (then ("", "") is returned: plain HTTP)."""
    cert, key = args.tls_cert, args.tls_key
    insecure = getattr(args, insecure_flag.lstrip("-").replace("-", "_"), False)
    if bool(cert) != bool(key):
        given, missing = ("--tls-cert", "--tls-key") if cert else ("--tls-key", "--tls-cert")
        raise RuleViolation(
            missing, None, f"is required with {given}: TLS needs both --tls-cert and --tls-key"
        )
    if not cert:
        if not insecure:
            raise RuleViolation(
                "--tls-cert/--tls-key",
                None,
                "are required: the API server calls webhooks over HTTPS only "
                f"({insecure_flag} serves plain HTTP, for tests or a TLS proxy in front)",
            )
        return "", ""
    if insecure:
        raise RuleViolation(insecure_flag, None, "cannot be combined with --tls-cert/--tls-key")
    for flag, path in (("--tls-cert", cert), ("--tls-key", key)):
        try:
            Path(path).read_bytes()
        except OSError as exc:
            raise RuleViolation(flag, path, f"cannot be read: {exc.strerror}") from exc
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
    except ssl.SSLError as exc:
        raise RuleViolation(
            "--tls-cert", cert, f"and --tls-key {key} are not a PEM certificate and its private key"
        ) from exc
    return cert, key


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
        raise RuleViolation(
            "--node-name", None, "is required (or NODE_NAME from the downward API)"
        )
    keys = _assignment_keys(args)
    if keys is None:
        logging.warning(
            "no --assignment-key-file: assignments are taken without checking who wrote "
            "them (a tenant who can patch its pods can name another GPU)"
        )
    pod_resources = _pod_resources_socket(args)
    kube = _kube(args)  # no cluster configuration fails here, before the GPUs are opened
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
    cfg = PluginConfig(
        node_name=node,
        prefix=args.prefix,
        plugin_dir=Path(args.plugin_dir),
        scheduler_name=args.scheduler_name,
        pod_resources_socket=pod_resources,
    )
    plugin = QgpuDevicePlugin(cfg, kube, inventory, paths, keys)
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


def _pod_resources_socket(args: argparse.Namespace) -> Path | None:
    """kubelet's pod-resources socket, after one List answered on it; None with
    --no-pod-resources-check (logged). Fails closed: no socket, or one that does not answer
    within --pod-resources-wait seconds, is a RuleViolation naming the flag and the path."""
    from k8s_bridge.deviceplugin.pod_resources import (
        DEFAULT_POD_RESOURCES_SOCKET,
        PodResourcesClient,
        PodResourcesUnavailable,
    )

    if args.no_pod_resources_check:
        logging.warning(
            "--no-pod-resources-check: PreStartContainer does not ask kubelet which container "
            "got the device IDs (a pod that bypasses the extender can take the slice of a "
            "bound, not yet admitted pod of the same layout)"
        )
        return None
    path = Path(args.pod_resources_socket or DEFAULT_POD_RESOURCES_SOCKET)
    fix = (
        "mount kubelet's pod-resources directory into the plugin, or pass "
        "--no-pod-resources-check to run without this check"
    )
    if not path.is_socket():
        raise RuleViolation(
            "--pod-resources-socket",
            str(path),
            f"is not a socket (kubelet's pod-resources API): {fix}",
        )
    client = PodResourcesClient(path, timeout_s=2.0)
    deadline = time.monotonic() + args.pod_resources_wait
    try:
        while True:
            try:
                client.devices()
                return path
            except PodResourcesUnavailable as exc:
                if time.monotonic() > deadline:
                    raise RuleViolation(
                        "--pod-resources-socket", str(path), f"{exc}: {fix}"
                    ) from None
                time.sleep(0.5)
    finally:
        client.close()


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
    p = sub.add_parser(
        "device-plugin",
        help="run the Kubernetes device plugin on this node",
        description="Run the Kubernetes device plugin (gRPC v1beta1) of this node: it "
        "advertises <prefix>/qgpu-core and <prefix>/qgpu-memory to kubelet, publishes the "
        "node's GPUs on its Node, and hands each container its GPU and its caps.",
    )
    _common(p)
    p.add_argument("--node-name", help="this node's name (default: $NODE_NAME)")
    p.add_argument(
        "--scheduler-name",
        default="qgpu-scheduler",
        help="honour assignments only on pods with this spec.schedulerName (the extender's)",
    )
    p.add_argument(
        "--plugin-dir",
        default="/var/lib/kubelet/device-plugins",
        help="kubelet's device-plugin directory (kubelet.sock)",
    )
    p.add_argument("--state-dir", default="/var/lib/qgpu", help="limits files and ledgers")
    p.add_argument(
        "--backend",
        type=choice(["auto", "nvml", "sim"], "--backend"),
        default=None,
        metavar="auto|nvml|sim",
        help="where GPUs come from (default: auto: NVML if it loads, else --sim)",
    )
    p.add_argument("--sim", metavar="SPEC", help="simulated GPUs, e.g. 2xH100-80GB")
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
    p.add_argument(
        "--health-interval",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="how often the GPUs are discovered again and their health reported",
    )
    p.add_argument(
        "--agent-socket",
        help="record every slice with the node agent on this socket (it writes the limits "
        "files and watches the pods' processes); default: the plugin writes them itself",
    )
    p.add_argument(
        "--workload-gid",
        type=int,
        default=0,
        help="group that may read the GPUs' shared state, slices/.gpu-<uuid>/ (default 0: "
        "containers in group 0)",
    )
    _assignment_key_flags(p, "device plugin ignores assignments whose MAC is missing or wrong")
    p.add_argument(
        "--pod-resources-socket",
        help="kubelet's pod-resources API: at PreStartContainer the plugin asks it which "
        "container got the device IDs and refuses a container that would start with another "
        "pod's slice; the plugin does not start without it (default: "
        "/var/lib/kubelet/pod-resources/kubelet.sock)",
    )
    p.add_argument(
        "--pod-resources-wait",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="how long to wait at start-up for the pod-resources socket to answer",
    )
    p.add_argument(
        "--no-pod-resources-check",
        action="store_true",
        help="run without kubelet's pod-resources API (the check above is off: only for "
        "clusters where no pod can reach kubelet past the qgpu extender)",
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
    keys = _assignment_keys(args)
    if keys is None:
        logging.warning(
            "no --assignment-key-file: assignments are bound unsigned (a device plugin "
            "with a key refuses them)"
        )
    holder = args.holder_id or _default_holder()
    kube = _kube(args)
    cfg = ExtenderConfig(
        prefix=args.prefix,
        scheduler_name=args.scheduler_name,
        **({"holder": holder} if holder else {}),
        holder_pod=_holder_pod(),
        node_policy=PlacementPolicy.parse(args.placement, "--placement"),
        gpu_policy=PlacementPolicy.parse(args.gpu_placement, "--gpu-placement")
        if args.gpu_placement
        else None,
        lock_ttl_s=args.lock_ttl,
        lock_linger_s=args.lock_linger,
        assume_ttl_s=args.assume_ttl,
        compat=args.compat,
    )
    ext = Extender(kube, cfg, keys)
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
    p = sub.add_parser(
        "extender",
        help="run the kube-scheduler extender (HTTP or HTTPS)",
        description="Run the kube-scheduler extender: filter, prioritize and bind pods that "
        "ask for qgpu resources, choosing the node and the GPU with the core placement engine.",
    )
    _common(p)
    p.add_argument("--host", default="0.0.0.0", help="address to listen on")
    p.add_argument("--port", type=int, default=8888, help="port to listen on")
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
    add_placement_options(
        p,
        default=DEFAULT_PLACEMENT.value,
        help="node-level placement: binpack, spread or frag (pod annotations override) "
        + DEFAULT_PLACEMENT_HELP,
        old=["--node-policy"],
        old_gpu=["--gpu-policy"],
    )
    add_prior_option(p)
    p.add_argument(
        "--lock-ttl", type=float, default=30.0, metavar="SECONDS", help="node lock expiry"
    )
    p.add_argument(
        "--lock-linger",
        type=float,
        default=0.2,
        metavar="SECONDS",
        help="keep a node's lock this long after a bind for the next bind there "
        "(0: release after every bind)",
    )
    p.add_argument(
        "--assume-ttl",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="hold prioritize's best node until bind for this long (0: off)",
    )
    _compat_flag(p)
    _assignment_key_flags(p, "extender signs every assignment it binds")
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
    from k8s_bridge.pod_guard import as_state_dir
    from k8s_bridge.resources import Names
    from k8s_bridge.webhook import create_app

    tls_pair(args)  # a certificate, or --insecure-http said out loud
    _logging(args)
    limits, tls = _serving(args)
    app = create_app(
        Names(args.prefix),
        args.scheduler_name,
        compat_mode=args.compat,
        state_dir=as_state_dir(args.node_state_dir),
    )
    serve(app, host=args.host, port=args.port, limits=limits, tls=tls)
    return EXIT_OK


def register_webhook(sub: Any) -> None:
    p = sub.add_parser(
        "webhook",
        help="run the mutating admission webhook (HTTPS)",
        description="Run the mutating admission webhook: pods that ask for qgpu resources get "
        "the qgpu scheduler's name, invalid requests are refused with the rule. The API "
        "server calls webhooks over HTTPS only, so --tls-cert and --tls-key are required "
        "(--insecure-http serves plain HTTP, for tests or behind a TLS proxy).",
    )
    _prefix(p)
    p.add_argument(
        "--scheduler-name",
        default="qgpu-scheduler",
        help="schedulerName given to pods that ask for qgpu resources",
    )
    p.add_argument(
        "--node-state-dir",
        default="/var/lib/qgpu",
        metavar="DIR",
        help="the qgpu state directory of the nodes (the chart's manager.stateDir): qgpu pods "
        "may not mount it or anything in it from the host, nor share containers anything "
        "under it ('' : no such rule)",
    )
    p.add_argument("--host", default="0.0.0.0", help="address to listen on")
    p.add_argument("--port", type=int, default=8443, help="port to listen on")
    p.add_argument(
        "--insecure-http",
        action="store_true",
        help="serve plain HTTP without a certificate (tests; a TLS proxy in front)",
    )
    _serving_flags(p, "for an apiserver configured with webhook client credentials")
    _compat_flag(p)
    _log_level(p)
    p.set_defaults(func=run_webhook)
