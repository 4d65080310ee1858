"""The agent's state and operations: reserve, release, list, health — over the core ledger.

State lives in two places, both under the state directory and both rebuilt from the
ledger on start: the core SQLite ledger (``ledger.sqlite``, WAL, synchronous=FULL: a
reservation is acknowledged only after it is committed) and one directory per slice
(``slices/<slice>/``: its limits file and the interposer's ledger, owned by the slice's
user, see `enforcement.state_tree`) with its entry in its GPU's roster and its activity
file (``slices/.gpu-<uuid>/``), made inside the transaction that records a new slice,
before its commit (`Ledger.reserve(prepare=...)`): a slice whose files cannot be made is
never recorded, even when the disk turned read-only and nothing can be undone. A
restart — even after ``kill -9`` — re-reads the ledger, rewrites any missing limits file,
deletes the directories of slices that are gone, makes each GPU's roster list exactly its
slices, and reconciles owners. Running processes
keep their caps: the interposer read its limits at ``cuInit`` and shares per-slice state
through its ledger, which the agent never rewrites.

Placement is the core engine's (`Ledger.reserve`, with the placement state kept in memory:
the agent is its ledger's only writer); validation is the core model's. Leases
(``expires_s``) are kept in the ledger with the slice and released by `expire_leases`.
A write that fails because the state directory is full or read-only is answered 503 (see
`enforcement.agent.app`) and makes the health check fail until a write works again.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import pwd
import shutil
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING

from enforcement.agent import slice_env
from enforcement.agent.attribution import (
    Attributor,
    SliceCgroups,
    environ_slice_id,
    is_mps_server,
    owner_anchor,
)
from enforcement.agent.config import AgentConfig
from enforcement.agent.models import (
    MAX_LEASE_S,
    DeviceInfo,
    DeviceList,
    Health,
    NodeInfo,
    RecordRequest,
    ReleaseResult,
    Reservation,
    ReserveRequest,
    SliceInfo,
    SliceList,
    SliceUsage,
)
from enforcement.agent.mps import MpsManager
from enforcement.agent.reconcile import (
    Liveness,
    OwnerRegistry,
    default_registry,
    pid_namespace,
    proc_start_time,
)
from enforcement.agent.slice_stats import BusyRate, read_ledger_file, read_slice_ledger
from enforcement.discovery import (
    DeviceTelemetry,
    GpuBackend,
    GpuProcess,
    UtilSample,
    discover,
)
from enforcement.gpu_roster import WRITER_AGENT, RosterEntry
from enforcement.native import HOOK_LIBRARY
from enforcement.state_tree import Identity, StateTree, process_identity
from qgpu.errors import QgpuError, RuleViolation
from qgpu.ledger import Ledger, OverCommit, Prepare, SliceAttrs
from qgpu.model import Allocation, NodeInventory, Owner, OwnerKind, is_slice_id
from qgpu.units import BYTES_PER_GIB

if TYPE_CHECKING:
    from enforcement.agent.watchdog import Watchdog

log = logging.getLogger("qgpu.agent")

# NVIDIA MPS takes a client's thread percentage and pinned memory limit from the client's
# own environment, and lets that environment only lower the daemon's (NVIDIA's MPS docs,
# CUDA_MPS_ACTIVE_THREAD_PERCENTAGE): the interposer sets them from the slice's limits, so
# only a process around it keeps the daemon's defaults.
MPS_CAPS_ADVISORY = (
    "--enforcement mps: a slice's MPS caps (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, "
    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT) are its processes' environment, which the interposer "
    "sets from the slice's limits at cuInit; a process that goes around the interposer sets "
    "its own (MPS lets it rise to the daemon's defaults: all threads, no memory limit); the "
    "watchdog kills memory over a cap but does not judge compute under MPS. Use "
    "--enforcement interposer (the default) for tenants that must not get out"
)

try:
    VERSION = version("qgpu")
except PackageNotFoundError:  # running from a source tree
    VERSION = "0+unknown"


MIN_FREE_BYTES = 128 * 1024  # below this the state directory counts as full


class NotFound(QgpuError):
    def __init__(self, field: str, value: object, rule: str) -> None:
        self.violation = RuleViolation(field, value, rule)
        super().__init__(str(self.violation))


def check_state_dir(path: Path) -> None:
    """Refuse (RuleViolation, exit 2 at start-up) a state directory the agent cannot use."""
    rule = "must be a writable directory with free space"
    try:
        path.mkdir(parents=True, exist_ok=True)
        _probe_write(path)
    except OSError as exc:
        raise RuleViolation("state_dir", str(path), f"{rule} ({exc.strerror or exc})") from None


def _probe_write(path: Path) -> None:
    """Write, sync and delete a small file in `path` (OSError when it cannot)."""
    fd, name = tempfile.mkstemp(prefix=".probe-", dir=path)
    try:
        os.write(fd, b"\0" * 8192)
        os.fsync(fd)
    finally:
        os.close(fd)
        os.unlink(name)


def storage_reason(exc: BaseException) -> str:
    """A sentence for a failed write of the state directory."""
    text = str(exc)
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return f"the state directory is full ({exc.strerror})"
    if isinstance(exc, OSError) and exc.errno == errno.EROFS:
        return "the state directory is on a read-only file system"
    if "full" in text:
        return f"the state directory is full ({text})"
    if "readonly" in text or "read-only" in text:
        return f"the state directory is read-only ({text})"
    return f"the state directory cannot be written ({text})"


@dataclass
class Counters:
    """Event counters exported by the metrics module (thread-safe)."""

    reservations: Counter[str] = field(default_factory=Counter)
    releases: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    reconcile_released: int = 0
    watchdog_over_cap: Counter[tuple[str, str]] = field(default_factory=Counter)
    watchdog_kills: Counter[tuple[str, str]] = field(default_factory=Counter)
    watchdog_over_core: Counter[tuple[str, str]] = field(default_factory=Counter)
    watchdog_unowned_kills: Counter[str] = field(default_factory=Counter)
    watchdog_settings_restored: Counter[tuple[str, str]] = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, name: str, key: object, n: int = 1) -> None:
        with self._lock:
            getattr(self, name)[key] += n


def default_hook_path() -> Path:
    """Where `pip install` builds the interposer (it may be missing: health says so)."""
    return HOOK_LIBRARY


class Agent:
    """One node's slices. Thread-safe: FastAPI runs handlers on a thread pool."""

    def __init__(
        self,
        config: AgentConfig,
        backend: GpuBackend,
        *,
        registry: OwnerRegistry | None = None,
        mps: MpsManager | None = None,
    ) -> None:
        self.config = config
        self.backend = backend
        self.registry = registry or default_registry(config.kubelet_pods_dir)
        self.mps = mps
        self.counters = Counters()
        self.started_at = time.time()
        self.last_reconcile_at: float | None = None
        self.watchdog: Watchdog | None = None
        self.hook_path = config.hook_path or default_hook_path()
        self._stripes = [threading.Lock() for _ in range(64)]
        # The agent is its ledger's only writer: serialising writes here is cheaper than
        # letting threads meet SQLite's busy handler (which sleeps up to 100 ms per retry).
        self._write_lock = threading.Lock()
        self._inventory_lock = threading.Lock()
        self._environ_cache: dict[tuple[int, int], str | None] = {}
        self._busy = BusyRate()
        self._storage_error: str | None = None
        self._last_limits: tuple[Allocation, dict[str, str]] | None = None
        self._gpu_index: tuple[NodeInventory | None, dict[str, int]] = (None, {})
        self.privileged = not config.test_mode and os.geteuid() == 0
        self.cgroups = SliceCgroups(
            config.state_dir / "cgroups", config.slice_cgroups, privileged=self.privileged
        )
        log.info("per-slice cgroups: %s", "on, " + self.cgroups.reason if self.cgroups.enabled
                 else "not made (" + self.cgroups.reason + "): slices owned by a process are "
                 "attributed by descent from it")  # fmt: skip
        config.state_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(config.state_dir, 0o755)
        self.tree = StateTree(
            config.slices_dir,
            privileged=self.privileged,
            workload_gid=config.workload_gid,
            keep_rosters=True,
        )
        self.tree.prepare()
        self.ledger = Ledger(config.ledger_path, cache_state=True)
        for suffix in ("", "-wal", "-shm"):  # owners and slices are the agent's business
            path = config.ledger_path.with_name(config.ledger_path.name + suffix)
            if path.exists():
                os.chmod(path, 0o600)
        self.inventory = self._discover()
        self.ledger.put_node(self.inventory)
        for gpu in self.inventory.gpus:
            self.tree.ensure_gpu(gpu.uuid)
            self.tree.ensure_busy(gpu.uuid)
        if self.mps is not None:
            self.mps.start(g.uuid for g in self.inventory.gpus)
            log.warning(MPS_CAPS_ADVISORY)
        self.restore()
        self.reconcile()
        self.expire_leases()

    # -- inventory ---------------------------------------------------------------------

    @property
    def node(self) -> str:
        return self.config.node_name

    def _discover(self) -> NodeInventory:
        return discover(
            self.backend,
            self.node,
            max_slices_per_gpu=self.config.slice_policy.limit,
            fixed_slices=self.config.slice_policy.fixed,
            default_isolation=self.config.default_isolation,
        )

    def refresh_inventory(self) -> bool:
        """Re-read the GPUs (health changes); returns True when the inventory changed."""
        with self._inventory_lock:
            fresh = self._discover()
            if fresh == self.inventory:
                return False
            self.ledger.put_node(fresh)
            known = {g.uuid for g in self.inventory.gpus}
            for gpu in fresh.gpus:
                self.tree.ensure_gpu(gpu.uuid)
                if gpu.uuid not in known:  # a known GPU's list is the watchdog's to renew
                    self.tree.ensure_busy(gpu.uuid)
            self.inventory = fresh
            log.info("inventory of %s changed: %s", self.node, fresh.model_dump_json())
            return True

    # -- restart recovery ---------------------------------------------------------------

    def restore(self) -> None:
        """Make the slice directories match the ledger exactly (after any restart or crash).

        A slice whose id breaks today's rule (``.``, ``..``, ``.x``, stored by an older
        version) cannot have a directory and its client cannot name it: it is released.
        """
        held = {a.slice_id: a for a in self.ledger.allocations(self.node)}
        for sid in [s for s in held if not is_slice_id(s)]:
            with self._write_lock:
                self.ledger.release(sid)
            del held[sid]
            self.counters.add("releases", "owner-gone")
            log.warning("released slice %r: its id breaks the slice id rule", sid)
        attrs = self.ledger.all_attrs()
        for alloc in held.values():
            self._prepare_slice(alloc, self._stored_identity(alloc, attrs.get(alloc.slice_id)))
        for sid in self.tree.slice_ids():
            if sid not in held:
                self._drop_slice_dir(sid)
        self._sync_gpus(held.values())
        self._drop_legacy()
        self.cgroups.sweep(held)
        for alloc in held.values():
            if self.cgroups.path_of(alloc.slice_id) is None:  # made before slice cgroups
                self._enroll(alloc)

    def _sync_gpus(self, held: Iterable[Allocation]) -> None:
        """Each GPU's roster lists exactly the agent's interposer slices on it (entries of
        the device plugin, or of hooks, are theirs to keep)."""
        listed: dict[str, dict[str, RosterEntry]] = {g.uuid: {} for g in self.inventory.gpus}
        for alloc in held:
            if self.enforcement_of(alloc) == "interposer":
                entry = RosterEntry.of(alloc.slice_id, alloc.isolation, alloc.core, WRITER_AGENT)
                listed.setdefault(alloc.gpu_uuids[0], {})[alloc.slice_id] = entry
        for uuid, entries in listed.items():
            self.tree.sync_gpu(uuid, WRITER_AGENT, entries)

    def _drop_legacy(self) -> None:
        """Files of the flat layout of older versions: limits/<id>.limits (their slices now
        have limits.conf in their own directory), slices/gpu-<uuid>.region (every tenant of
        a GPU could write it) and slices/gpu-<uuid>.busy (both now in .gpu-<uuid>/), and
        slices/slice-<id>.ledger once no process maps it."""
        shutil.rmtree(self.config.legacy_limits_dir, ignore_errors=True)
        for path in self.tree.legacy_gpu_files():  # running processes keep their mapping
            path.unlink(missing_ok=True)
        for path in self.tree.legacy_files():
            led = read_ledger_file(path)
            if led is None or not led.pids:
                path.unlink(missing_ok=True)

    def _drop_slice_dir(self, slice_id: str) -> None:
        """Delete a released slice's directory once no live process uses its ledger."""
        led = read_ledger_file(self.tree.files(slice_id).ledger_s)
        if led is None or not led.pids:
            self.tree.remove(slice_id)

    # -- reservations --------------------------------------------------------------------

    def _stripe(self, slice_id: str) -> threading.Lock:
        return self._stripes[hash(slice_id) % len(self._stripes)]

    def _identity(self, owner: Owner, uid: int | None, gid: int | None) -> Identity:
        """Who the slice's processes run as: as asked, else the owner's process, else us."""
        pid = owner.id if owner.kind is OwnerKind.PID else owner.meta.get("pid")
        of_pid = process_identity(int(pid)) if pid and pid.isdigit() else None
        base = of_pid or Identity.current()
        if uid is None:
            return Identity(base.uid, base.gid if gid is None else gid)
        if gid is None:
            try:
                gid = pwd.getpwuid(uid).pw_gid
            except KeyError:
                gid = uid  # a uid without a passwd entry (containers): its own group id
        return Identity(uid, gid)

    def _stored_identity(self, alloc: Allocation, attrs: SliceAttrs | None) -> Identity:
        if attrs is not None and attrs.uid is not None and attrs.gid is not None:
            return Identity(attrs.uid, attrs.gid)
        return self.tree.identity_of(alloc.slice_id) or Identity.current()

    @staticmethod
    def _expiry(expires_s: float | None) -> float | None:
        return None if expires_s is None else time.time() + min(expires_s, MAX_LEASE_S)

    def reserve(self, body: ReserveRequest) -> Reservation:
        owner = self._checked_owner(body.owner)
        slice_id = body.slice_id or _new_id()
        who = self._identity(owner, body.uid, body.gid)
        attrs = SliceAttrs(expires_at=self._expiry(body.expires_s), uid=who.uid, gid=who.gid)
        with self._stripe(slice_id):
            with self._write_lock:
                alloc, created = self._commit_with_files(
                    lambda prepare: self.ledger.reserve(
                        body.request,
                        owner,
                        slice_id=slice_id,
                        node=self.node,
                        policy=self.config.placement,
                        gpu_policy=self.config.gpu_placement,
                        attrs=attrs,
                        prepare=prepare,
                    ),
                    who,
                )
                self._storage_error = None
            if not created:
                alloc = self._adopted(alloc, owner)
                self._recheck_files(alloc)
            self._enroll(alloc)
        self.counters.add("reservations", "ok")
        log.info(
            "reserved %s on %s core=%d memory=%dGiB owner=%s:%s",
            alloc.slice_id,
            ",".join(alloc.gpu_uuids),
            alloc.core,
            alloc.memory_gib,
            alloc.owner.kind.value,
            alloc.owner.id,
        )
        return self.reservation(alloc, attrs if created else None)

    def _commit_with_files(
        self, commit: Callable[[Prepare], Allocation], who: Identity
    ) -> tuple[Allocation, bool]:
        """Run a ledger commit whose new slice gets its files inside the transaction
        (`qgpu.ledger.Prepare`): a slice whose files cannot be made is never recorded (the
        rollback needs no disk write, so a disk that turned read-only leaves no orphan row),
        and files whose commit then failed are removed (or, on a read-only disk, dropped by
        `restore` at the next start). Returns the allocation and whether it is new."""
        made: list[Allocation] = []

        def prepare(alloc: Allocation) -> None:
            made.append(alloc)
            self._prepare_slice(alloc, who)

        try:
            alloc = commit(prepare)
        except BaseException:
            for new in made:
                with contextlib.suppress(OSError):
                    self.tree.remove(new.slice_id)
                with contextlib.suppress(OSError):
                    self.tree.leave_gpu(new.gpu_uuids[0], new.slice_id)
            raise
        return alloc, bool(made)

    def _adopted(self, alloc: Allocation, owner: Owner) -> Allocation:
        """A repeated reservation by a restarted process of the slice's owner (same kind
        and id, another ``meta.pid``: a Dask worker restarted under its name) takes the slice
        over, so that reconcile follows the new process; while the previous process still
        runs, the slice stays its own (stripe lock held)."""
        before = _owner_process(alloc.owner)
        if before == _owner_process(owner):
            return alloc
        if self.registry.check(alloc.owner) is Liveness.ALIVE:
            raise RuleViolation(
                "slice_id",
                alloc.slice_id,
                f"is held by {alloc.owner.kind.value} {alloc.owner.id!r} in process "
                f"{before[0]}, which is still running; stop it or choose another slice id",
            )
        with self._write_lock:
            adopted = self.ledger.adopt(alloc.slice_id, owner)
        if adopted is None:
            raise NotFound("slice_id", alloc.slice_id, "was released meanwhile; reserve again")
        log.info("%s taken over by %s:%s", alloc.slice_id, owner.kind.value, owner.id)
        return adopted

    def _enroll(self, alloc: Allocation) -> None:
        """Put a slice's owner process (and its descendants) into the slice's cgroup, where
        the node allows one (see `enforcement.agent.attribution`)."""
        anchor = owner_anchor(alloc)
        if anchor is None or not is_slice_id(alloc.slice_id):
            return
        path = self.cgroups.enroll(alloc.slice_id, *anchor)
        if path is not None:
            log.info("slice %s: owner %d in cgroup %s", alloc.slice_id, anchor[0], path)

    def _recheck_files(self, alloc: Allocation) -> None:
        """A repeated reservation re-checks its older slice's files (never undoes it)."""
        stored = self.ledger.attrs(alloc.slice_id)
        self._prepare_slice(alloc, self._stored_identity(alloc, stored))

    def record(self, body: RecordRequest) -> Reservation:
        """Account for and enforce a placement decided elsewhere (checked by the ledger)."""
        req = body.request
        if len(body.device_uuids) != req.gpu_count:
            raise RuleViolation(
                "device_uuids",
                len(body.device_uuids),
                f"must name exactly {req.gpu_count} GPU(s) for qgpu-core={req.core}",
            )
        if len(set(body.device_uuids)) != len(body.device_uuids):
            raise RuleViolation("device_uuids", body.device_uuids[0], "must not repeat a GPU")
        cards = {g.uuid: g for g in self.inventory.gpus}
        for uuid in body.device_uuids:
            gpu = cards.get(uuid)
            if gpu is None:
                raise RuleViolation("device_uuids", uuid, f"is not a GPU of node {self.node}")
            req.check_against(gpu)
        memory = (
            min(cards[u].memory_gib for u in body.device_uuids)
            if req.is_whole_gpu
            else req.memory_gib
        )
        owner = self._checked_owner(body.owner)
        alloc = Allocation(
            slice_id=body.slice_id,
            node=self.node,
            gpu_uuids=list(body.device_uuids),
            core=req.core_per_gpu,
            memory_gib=memory or 1,
            isolation=req.effective_isolation(self.inventory.default_isolation),
            owner=owner,
        )
        who = self._identity(owner, body.uid, body.gid)
        attrs = SliceAttrs(expires_at=self._expiry(body.expires_s), uid=who.uid, gid=who.gid)
        placed = alloc

        def commit() -> tuple[Allocation, bool]:
            with self._stripe(placed.slice_id), self._write_lock:
                return self._commit_with_files(
                    lambda prepare: self.ledger.record(placed, req, attrs, prepare), who
                )

        try:
            alloc, created = commit()
        except OverCommit:
            # The placer (Ray, the extender) freed and re-used the GPU before this agent's
            # periodic reconcile saw the old owner die: reconcile now, then check again.
            if not self.reconcile():
                raise
            alloc, created = commit()
        self._storage_error = None
        with self._stripe(alloc.slice_id):
            if not created:
                self._recheck_files(alloc)
            self._enroll(alloc)
        self.counters.add("reservations", "ok")
        log.info("recorded %s on %s (placed elsewhere)", alloc.slice_id, ",".join(alloc.gpu_uuids))
        return self.reservation(alloc)

    def _checked_owner(self, owner: Owner) -> Owner:
        """A pid owner must be a running process; its start time pins its identity.

        A Dask worker that names its process (``meta.pid``) gets the same treatment.
        """
        if owner.kind is OwnerKind.DASK_WORKER and "pid" in owner.meta:
            try:
                pid_owner = self._checked_owner(Owner(kind=OwnerKind.PID, id=owner.meta["pid"]))
            except RuleViolation as exc:
                raise RuleViolation("owner.meta.pid", owner.meta["pid"], exc.rule) from None
            meta = {**owner.meta, **pid_owner.meta, "pid": pid_owner.id}
            return Owner(kind=owner.kind, id=owner.id, meta=meta)
        if owner.kind is not OwnerKind.PID:
            return owner
        try:
            pid = int(owner.id)
        except ValueError:
            raise RuleViolation("owner.id", owner.id, "a pid owner's id must be a pid") from None
        started = proc_start_time(pid) if 0 < pid < 2**22 else None
        if started is None:
            raise RuleViolation("owner.id", owner.id, "must be the pid of a running process")
        given = owner.meta.get("start_time")
        if given is not None and given != str(started):
            raise RuleViolation(
                "owner.meta.start_time", given, f"does not match process {pid} (started {started})"
            )
        meta = dict(owner.meta)
        meta["start_time"] = str(started)
        ns = pid_namespace()
        if ns is not None:
            meta["pidns"] = ns
        return Owner(kind=owner.kind, id=str(pid), meta=meta)

    def release(self, slice_id: str, reason: str = "request") -> ReleaseResult:
        with self._stripe(slice_id):
            released = self._release_locked(slice_id, reason)
        return ReleaseResult(slice_id=slice_id, released=released)

    def _release_locked(self, slice_id: str, reason: str) -> bool:
        """Release with the slice's stripe lock held. The limits file is moved aside first:
        where the slice files cannot be written (a read-only disk) the release is refused
        with nothing changed, and where the commit fails (a full disk) it is put back."""
        retired = is_slice_id(slice_id) and self.tree.retire_limits(slice_id)
        try:
            with self._write_lock:
                held = self.ledger.take(slice_id)  # what it was, read as it is deleted
                self._storage_error = None
        except BaseException:
            if retired:
                self.tree.unretire_limits(slice_id)
            raise
        released = held is not None
        if is_slice_id(slice_id):
            self.tree.remove_limits(slice_id, retired=retired)
            self._drop_slice_dir(slice_id)
            self.cgroups.release(slice_id)  # a busy one is removed by a later reconcile
            if held is not None and self.enforcement_of(held) == "interposer":
                # a roster that cannot be written now is put right by the next start
                with contextlib.suppress(OSError):
                    self.tree.leave_gpu(held.gpu_uuids[0], slice_id)
        self.counters.add("releases", reason if released else "already-gone")
        if released:
            log.info("released %s (%s)", slice_id, reason)
        return released

    def renew(self, slice_id: str, expires_s: float | None) -> Reservation:
        """Renew a slice's lease for `expires_s` from now, or end it (None: kept)."""
        with self._stripe(slice_id):
            with self._write_lock:
                found = self.ledger.set_expiry(slice_id, self._expiry(expires_s))
            if not found:
                raise NotFound("slice_id", slice_id, "no such slice on this node (released?)")
            return self.get(slice_id)

    def expire_leases(self) -> list[str]:
        """Release every slice whose lease ran out (its holder did not renew it)."""
        released = []
        now = time.time()
        for sid in self.ledger.expired(now):
            with self._stripe(sid):
                expires_at = self.ledger.attrs(sid).expires_at
                if expires_at is None or expires_at > now:
                    continue  # renewed meanwhile
                if self._release_locked(sid, reason="lease-expired"):
                    released.append(sid)
                    log.info("lease of %s ran out: released", sid)
        return released

    def get(self, slice_id: str) -> Reservation:
        alloc = self.ledger.get(slice_id)
        if alloc is None or alloc.node != self.node:
            raise NotFound("slice_id", slice_id, "no such slice on this node")
        return self.reservation(alloc)

    # -- environment and limits files ----------------------------------------------------

    def _limits_path(self, slice_id: str) -> Path:
        return self.tree.files(slice_id).limits_file

    def enforcement_of(self, alloc: Allocation) -> str:
        """How a slice is capped on this node: none (whole GPUs), mps or interposer."""
        if alloc.is_whole_gpu:
            return "none"
        return "mps" if self.mps is not None else "interposer"

    def _limits(self, alloc: Allocation) -> dict[str, str]:
        """The slice's limits (not to be changed by the caller). The last ones computed are
        kept with their allocation: a new slice's answer needs what its files got."""
        last = self._last_limits
        if last is not None and last[0] is alloc:
            return last[1]
        values = slice_env.limits_values(
            alloc,
            state_dir=self.config.slices_dir,
            limits_file=self._limits_path(alloc.slice_id),
            real_libcuda=self.config.real_libcuda,
            extra=self.backend.workload_env,
            mps_pipe_directory=(
                self.mps.dirs(alloc.gpu_uuids[0])[0] if self.mps is not None else None
            ),
        )
        self._last_limits = (alloc, values)
        return values

    def _prepare_slice(self, alloc: Allocation, who: Identity) -> None:
        """A share slice's directory, ledger and limits file, and (interposer slices) its
        entry and activity file on its GPU (idempotent). MPS slices run the interposer too,
        which sets their MPS caps from the limits; they are not on the GPU's roster, which
        is for the interposer's compute gate (MPS partitions the GPU instead)."""
        enforcement = self.enforcement_of(alloc)
        if enforcement == "none":
            return
        self.tree.create(alloc.slice_id, who)
        # no fsync: the ledger (fsynced at commit) is the source of truth, and the agent
        # rewrites every limits file from it when it starts
        self.tree.write_limits(alloc.slice_id, self._limits(alloc), who)
        if enforcement != "interposer":
            return
        self.tree.join_gpu(
            alloc.gpu_uuids[0], alloc.slice_id, who, alloc.isolation, alloc.core, WRITER_AGENT
        )

    def reservation(self, alloc: Allocation, attrs: SliceAttrs | None = None) -> Reservation:
        attrs = self.ledger.attrs(alloc.slice_id) if attrs is None else attrs
        enforcement = self.enforcement_of(alloc)
        limits_file: str | None = None
        slice_dir: str | None = None
        if enforcement == "none":
            env = slice_env.whole_gpu_env(alloc, self.backend.workload_env)
        elif enforcement == "mps":
            assert self.mps is not None
            hook = self.hook_path if self.hook_path.exists() else None
            env = slice_env.interposer_env(
                alloc, self._limits(alloc), hook_path=hook, workload_env=self.backend.workload_env
            )
            env.update(self.mps.slice_env(alloc))
            limits_file = str(self._limits_path(alloc.slice_id))
            slice_dir = str(self.tree.files(alloc.slice_id).dir)
        else:
            hook = self.hook_path if self.hook_path.exists() else None
            env = slice_env.interposer_env(
                alloc, self._limits(alloc), hook_path=hook, workload_env=self.backend.workload_env
            )
            limits_file = str(self._limits_path(alloc.slice_id))
            slice_dir = str(self.tree.files(alloc.slice_id).dir)
        inventory, index = self._gpu_index
        if inventory is not self.inventory:
            inventory = self.inventory
            index = {g.uuid: g.index for g in inventory.gpus}
            self._gpu_index = (inventory, index)
        return Reservation(
            slice_id=alloc.slice_id,
            node=alloc.node,
            device_uuid=alloc.gpu_uuids[0],
            device_uuids=list(alloc.gpu_uuids),
            device_indexes=[index.get(u, -1) for u in alloc.gpu_uuids],
            core=alloc.core,
            memory_gib=alloc.memory_gib,
            memory_limit_bytes=alloc.memory_gib * BYTES_PER_GIB,
            isolation=alloc.isolation,
            enforcement=enforcement,  # type: ignore[arg-type]
            owner=alloc.owner,
            created_at=alloc.created_at,
            expires_at=attrs.expires_at,
            uid=attrs.uid,
            gid=attrs.gid,
            slice_dir=slice_dir,
            limits_file=limits_file,
            env=env,
        )

    # -- live usage ----------------------------------------------------------------------

    def _claim(self, pid: int) -> str | None:
        """The slice id a process's environment names (it cannot change for a process: the
        environment is read once per pid and start time)."""
        started = proc_start_time(pid)
        if started is None:
            return None
        key = (pid, started)
        if key not in self._environ_cache:
            if len(self._environ_cache) > 4096:
                self._environ_cache.clear()
            self._environ_cache[key] = environ_slice_id(pid)
        return self._environ_cache[key]

    def attribute(
        self, allocs: list[Allocation], procs: list[GpuProcess]
    ) -> tuple[dict[str, list[GpuProcess]], list[GpuProcess]]:
        """GPU processes per slice, and the processes that belong to no slice (NVIDIA's
        MPS server is neither). The rules: `enforcement.agent.attribution`."""
        rule = Attributor(allocs, self.cgroups.paths(), self.cgroups.v2, self._claim)
        by_slice: dict[str, list[GpuProcess]] = {}
        unowned = []
        for proc in procs:
            found = rule.of(proc)
            if found.slice_id is not None:
                by_slice.setdefault(found.slice_id, []).append(proc)
            elif not is_mps_server(proc.pid):
                unowned.append(proc)
        return by_slice, unowned

    def _usage_source(self) -> str:
        return "sim" if self.backend.kind == "sim" else "nvml"

    def slices(self) -> SliceList:
        allocs = self.ledger.allocations(self.node)
        attrs = self.ledger.all_attrs()
        procs = _safe(self.backend.processes, [])
        utils = _safe(self.backend.process_utilization, {})
        by_slice, _unowned = self.attribute(allocs, procs)
        out = []
        self._busy.forget({a.slice_id for a in allocs})
        for alloc in allocs:
            mine = [p for p in by_slice.get(alloc.slice_id, []) if p.device_uuid in alloc.gpu_uuids]
            out.append(
                SliceInfo(
                    **self.reservation(alloc, attrs.get(alloc.slice_id, SliceAttrs())).model_dump(),
                    usage=self._usage(alloc, mine, utils),
                )
            )
        return SliceList(node=self.node, slices=out)

    def _usage(
        self,
        alloc: Allocation,
        mine: list[GpuProcess],
        utils: dict[tuple[str, int], UtilSample],
    ) -> SliceUsage:
        """The interposer's shared ledger when the slice has one, with NVML per process."""
        pids = {p.pid for p in mine}
        mem = [p.used_memory_bytes for p in mine if p.used_memory_bytes is not None]
        if self.enforcement_of(alloc) != "none" and is_slice_id(alloc.slice_id):
            led = read_slice_ledger(self.config.slices_dir, alloc.slice_id)
            if led is not None:
                # NVML's per-process numbers also see memory that bypassed the interposer.
                return SliceUsage(
                    memory_used_bytes=max(led.mem_used, sum(mem)),
                    core_used_percent=self._busy.update(alloc.slice_id, led.busy_ns),
                    throttled_seconds=(
                        led.throttled_ns / 1e9 if led.throttled_ns is not None else None
                    ),
                    oom_refusals=led.oom_refusals,
                    pids=sorted(pids | set(led.pids)),
                    source="interposer",
                )
        core = [
            utils[(p.device_uuid, p.pid)].sm_util for p in mine if (p.device_uuid, p.pid) in utils
        ]
        return SliceUsage(
            memory_used_bytes=sum(mem) if mine else 0,
            core_used_percent=float(sum(core)) if core or not mine else None,
            pids=sorted(pids),
            source=self._usage_source(),  # type: ignore[arg-type]
        )

    def devices(self) -> DeviceList:
        usage = {u.uuid: u for u in self.ledger.usage(self.node)}
        tele: dict[str, DeviceTelemetry] = {t.uuid: t for t in _safe(self.backend.telemetry, [])}
        out = []
        for gpu in self.inventory.gpus:
            u = usage.get(gpu.uuid)
            t = tele.get(gpu.uuid)
            out.append(
                DeviceInfo(
                    **gpu.model_dump(),
                    memory_total_bytes=t.memory_total_bytes if t else None,
                    memory_used_bytes=t.memory_used_bytes if t else None,
                    utilization_percent=t.utilization_percent if t else None,
                    slices=u.slices if u else 0,
                    max_slices=gpu.max_slices(
                        self.inventory.max_slices_per_gpu, self.inventory.fixed_slices
                    ),
                    core_committed=u.core_used if u else 0,
                    memory_committed_gib=u.memory_used_gib if u else 0,
                )
            )
        return DeviceList(node=self.node, backend=self.backend.kind, devices=out)

    def node_info(self) -> NodeInfo:
        env = dict(self.backend.workload_env)
        env["QGPU_STATE_DIR"] = str(self.config.slices_dir)
        return NodeInfo(
            node=self.node,
            backend=self.backend.kind,
            enforcement="mps" if self.mps is not None else "interposer",
            inventory=self.inventory,
            workload_env=env,
            hook_path=str(self.hook_path) if self.hook_path.exists() else None,
        )

    # -- storage -------------------------------------------------------------------------

    def storage_failed(self, exc: BaseException) -> str:
        """Remember that a write of the state directory failed; the reason, as a sentence."""
        reason = storage_reason(exc)
        if self._storage_error != reason:
            log.error("state directory %s: %s", self.config.state_dir, reason)
        self._storage_error = reason
        return reason

    def storage_problem(self) -> str | None:
        """Why the state directory cannot take a reservation now, or None."""
        path = self.config.state_dir
        try:
            st = os.statvfs(path)
        except OSError as exc:
            return f"the state directory {path} cannot be read ({exc.strerror})"
        if st.f_flag & os.ST_RDONLY:
            return f"the state directory {path} is on a read-only file system"
        free = (st.f_bfree if os.geteuid() == 0 else st.f_bavail) * st.f_frsize
        if free < MIN_FREE_BYTES:
            return f"the state directory {path} is full ({free} bytes free)"
        if self._storage_error is not None:
            try:
                _probe_write(path)
            except OSError:
                return self._storage_error
            self._storage_error = None  # writes work again
        return None

    def health(self) -> Health:
        problems = []
        storage = self.storage_problem()
        if storage is not None:
            problems.append(f"{storage}: no slice can be reserved or released")
        unhealthy = [g.uuid for g in self.inventory.gpus if not g.healthy]
        for gpu in self.inventory.gpus:
            if not gpu.healthy:
                problems.append(f"GPU {gpu.uuid} is unhealthy: {gpu.health_reason}")
        if self.mps is None and not self.hook_path.exists():
            problems.append(
                f"the interposer {self.hook_path} is not built: memory and compute caps are "
                "not enforced (reinstall qgpu to build it)"
            )
        uuids = {g.uuid for g in self.inventory.gpus}
        allocs = self.ledger.allocations(self.node)
        for alloc in allocs:
            gone = [u for u in alloc.gpu_uuids if u not in uuids]
            if gone:
                problems.append(f"slice {alloc.slice_id} is on a GPU no longer present: {gone[0]}")
        return Health(
            status="failing" if storage else "degraded" if problems else "ok",
            node=self.node,
            backend=self.backend.kind,
            enforcement="mps" if self.mps is not None else "interposer",
            devices=len(self.inventory.gpus),
            unhealthy_devices=unhealthy,
            slices=len(allocs),
            uptime_s=round(time.time() - self.started_at, 3),
            last_reconcile_at=self.last_reconcile_at,
            problems=problems,
            version=VERSION,
        )

    # -- reconcile -----------------------------------------------------------------------

    def reconcile(self) -> list[str]:
        """Release the slices whose owner is dead; alive and unknown owners keep theirs."""
        released = []
        for alloc in self.ledger.allocations(self.node):
            if not is_slice_id(alloc.slice_id):
                continue
            if self.registry.check(alloc.owner) is not Liveness.DEAD:
                continue
            # Re-check under the slice's lock: it may have been released and re-reserved.
            with self._stripe(alloc.slice_id):
                current = self.ledger.get(alloc.slice_id)
                if current is None or current.owner != alloc.owner:
                    continue
                if not self._release_locked(alloc.slice_id, reason="owner-gone"):
                    continue
            released.append(alloc.slice_id)
            log.info(
                "reconcile: released %s, owner %s:%s is gone",
                alloc.slice_id,
                alloc.owner.kind.value,
                alloc.owner.id,
            )
        self.cgroups.sweep(a.slice_id for a in self.ledger.allocations(self.node))
        with self.counters._lock:
            self.counters.reconcile_released += len(released)
        self.last_reconcile_at = time.time()
        return released

    def close(self) -> None:
        self.ledger.close()
        self.tree.close()


def _new_id() -> str:
    from qgpu.ledger import new_slice_id

    return new_slice_id()


def _owner_process(owner: Owner) -> tuple[str | None, str | None]:
    """The process an owner names (pid and start time), if any."""
    pid = owner.id if owner.kind is OwnerKind.PID else owner.meta.get("pid")
    return pid, owner.meta.get("start_time")


def _safe(call, default):
    """Telemetry must never break the API: a failing NVML query reads as 'not reported'."""
    try:
        return call()
    except Exception as exc:
        log.warning("GPU telemetry query %s failed: %s", getattr(call, "__name__", call), exc)
        return default


__all__ = [
    "Agent",
    "Counters",
    "NotFound",
    "check_state_dir",
    "default_hook_path",
    "storage_reason",
]
