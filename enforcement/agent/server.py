"""Serving the agent: the unix socket (mode 0600), optional loopback TCP, background upkeep.

The unix socket is created under a 0177 umask, so it is 0600 from the moment it exists
(uvicorn's own ``uds=`` path would chmod it 0666); only its owner (root in production) can
connect. TCP is opt-in, loopback only (the config refuses any other address) and every
request on it needs the bearer token (`enforcement.agent.app.TokenGuard`).

Both listeners run uvicorn's httptools protocol with deadlines (`enforcement.agent.http_guard`):
a request head must arrive within ``head_timeout_s``, its body within ``body_timeout_s``;
bodies are limited to ``max_body_bytes``.

A maintenance thread reconciles owners every ``reconcile_interval_s``, releases slices
whose lease ran out (every second), runs the watchdog every ``watchdog_interval_s`` and
re-reads the GPUs' health every 30 s.

A state directory the agent cannot use (read-only, full, not a directory) stops it at
start-up with one line naming it and exit code 2 (`check_state_dir`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sqlite3
import stat
import threading
import time
from pathlib import Path

import uvicorn

from enforcement.agent.app import TokenGuard, create_app
from enforcement.agent.config import AgentConfig
from enforcement.agent.http_guard import guarded_httptools
from enforcement.agent.metrics_http import MetricsListener
from enforcement.agent.mps import MpsManager
from enforcement.agent.service import Agent, check_state_dir, storage_reason
from enforcement.agent.watchdog import Watchdog
from enforcement.discovery import GpuBackend, open_backend
from qgpu.errors import RuleViolation

log = logging.getLogger("qgpu.agent.server")

INVENTORY_REFRESH_S = 30.0
LEASE_CHECK_S = 1.0
BACKLOG = 4096


def bind_unix(path: Path) -> socket.socket:
    """A listening unix socket at `path`, mode 0600 from creation."""
    try:
        return _bind_unix(path)
    except OSError as exc:
        raise RuleViolation("socket", str(path), f"cannot listen there ({exc.strerror})") from None


def _bind_unix(path: Path) -> socket.socket:
    if not path.parent.exists():
        path.parent.mkdir(parents=True, mode=0o755)
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise RuleViolation(
                "socket", str(path), "exists and is not a socket; refusing to remove it"
            )
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()  # a stale socket of a dead agent
        else:
            raise RuleViolation("socket", str(path), "another agent is already listening there")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    sock.listen(BACKLOG)
    sock.set_inheritable(True)
    return sock


def bind_tcp(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(BACKLOG)
    sock.set_inheritable(True)
    return sock


class Maintenance(threading.Thread):
    """Periodic reconcile, watchdog scan and inventory refresh."""

    def __init__(self, agent: Agent, watchdog: Watchdog) -> None:
        super().__init__(name="qgpu-maintenance", daemon=True)
        self.agent = agent
        self.watchdog = watchdog
        self.stop_event = threading.Event()

    def run(self) -> None:
        cfg = self.agent.config
        now = time.monotonic()
        due = {
            "reconcile": now + cfg.reconcile_interval_s,
            "leases": now + LEASE_CHECK_S,
            "watchdog": now,
            "inventory": now,
        }
        every = {
            "reconcile": cfg.reconcile_interval_s,
            "leases": LEASE_CHECK_S,
            "watchdog": cfg.watchdog_interval_s,
            "inventory": INVENTORY_REFRESH_S,
        }
        jobs = {
            "reconcile": self.agent.reconcile,
            "leases": self.agent.expire_leases,
            "watchdog": self.watchdog.scan,
            "inventory": self.agent.refresh_inventory,
        }
        while not self.stop_event.is_set():
            now = time.monotonic()
            for name, at in due.items():
                if now >= at:
                    try:
                        jobs[name]()
                    except Exception as exc:
                        self.agent.counters.add("errors", f"{name}:{type(exc).__name__}")
                        log.exception("%s failed: %s", name, exc)
                    due[name] = time.monotonic() + every[name]
            self.stop_event.wait(max(0.05, min(due.values()) - time.monotonic()))

    def stop(self) -> None:
        self.stop_event.set()
        self.join(timeout=10)


def build_agent(config: AgentConfig, backend: GpuBackend | None = None) -> Agent:
    """Open the GPU backend (and MPS when configured) and start the agent's state.

    A state directory that cannot be written is a `RuleViolation` naming it."""
    check_state_dir(config.state_dir)
    if backend is None:
        backend = open_backend(
            config.backend,
            sim_spec=config.sim_spec,
            state_dir=config.state_dir,
            node_name=config.node_name,
        )
    mps = MpsManager(config.mps_control, config.mps_dir) if config.enforcement == "mps" else None
    try:
        agent = Agent(config, backend, mps=mps)
    except (sqlite3.Error, OSError) as exc:
        if isinstance(exc, OSError) and exc.errno is None:
            raise
        rule = f"must be a writable directory with free space: {storage_reason(exc)}"
        raise RuleViolation("state_dir", str(config.state_dir), rule) from None
    agent.watchdog = Watchdog(
        agent,
        kill=config.watchdog_kill,
        grace_s=config.watchdog_grace_s,
        core_margin=config.watchdog_core_margin,
        interval_s=config.watchdog_interval_s,
        unowned=config.watchdog_unowned,
    )
    return agent


def serve(config: AgentConfig, backend: GpuBackend | None = None) -> int:
    """Run the agent until SIGINT/SIGTERM. Returns the exit code."""
    if config.tcp_port is not None and not config.token:
        raise RuleViolation("token_file", None, "is required with --tcp-port")
    check_state_dir(config.state_dir)
    # Bind first: a second agent on the same socket stops here, before touching the state.
    sockets = [bind_unix(config.socket)]
    try:
        if config.tcp_port is not None:
            sockets.append(bind_tcp(config.tcp_host, config.tcp_port))
        agent = build_agent(config, backend)
    except BaseException:
        for sock in sockets:
            sock.close()
        config.socket.unlink(missing_ok=True)
        raise
    assert agent.watchdog is not None
    app = create_app(agent, max_body_bytes=config.max_body_bytes)
    asgi = TokenGuard(app, config.token) if config.token else app
    metrics: MetricsListener | None = None
    if config.metrics_port is not None:
        registry = app.state.metrics_registry
        metrics = MetricsListener(config.metrics_host, config.metrics_port, registry)
    maintenance = Maintenance(agent, agent.watchdog)
    server = uvicorn.Server(
        uvicorn.Config(
            asgi,
            http=guarded_httptools(config.head_timeout_s, config.body_timeout_s),
            loop="uvloop",
            proxy_headers=False,  # no proxy in front of a unix socket or loopback port
            lifespan="off",
            access_log=False,
            log_level=logging.getLevelName(logging.getLogger().level).lower(),
            timeout_graceful_shutdown=5,
            backlog=BACKLOG,
        )
    )
    tcp = (
        f" and {sockets[1].getsockname()[0]}:{sockets[1].getsockname()[1]}"
        if len(sockets) > 1
        else ""
    )
    if metrics is not None:
        tcp += f"; metrics (read-only) on {metrics.address[0]}:{metrics.address[1]}"
    log.info(
        "qgpu agent on node %s (%s backend, %d GPUs, %d slices) listening on %s%s",
        agent.node,
        agent.backend.kind,
        len(agent.inventory.gpus),
        len(agent.ledger.allocations(agent.node)),
        config.socket,
        tcp,
    )
    maintenance.start()

    # uvicorn re-raises the signal that stopped it once it has shut down; SIGTERM is the
    # normal way to stop the agent, so let that land here (or, arriving before uvicorn
    # listens for it, stop uvicorn right after start-up) and finish with exit code 0.
    def stop(_sig: int, _frame: object) -> None:
        server.should_exit = True

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        server.run(sockets=sockets)
    finally:
        signal.signal(signal.SIGTERM, previous)
        app.state.writer.close()
        maintenance.stop()
        if metrics is not None:
            metrics.close()
        for sock in sockets:
            sock.close()
        with contextlib.suppress(FileNotFoundError):
            config.socket.unlink()
        agent.close()
        agent.backend.close()
    return 0


__all__ = ["Maintenance", "bind_tcp", "bind_unix", "build_agent", "serve"]
