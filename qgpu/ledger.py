"""The allocation ledger: slices in a SQLite file (WAL), safe across threads and processes.

Every reservation runs in one ``BEGIN IMMEDIATE`` transaction: load the inventory and the
live slices, decide with the placement engine (or take a decision made elsewhere), insert,
then re-check the totals of the touched GPUs *inside the same transaction* and roll back if
anything would be over-committed. SQLite's write lock serialises writers across threads
and processes; WAL keeps readers unblocked; a committed slice survives ``kill -9``.

Release is idempotent. Each slice records its owner (pid, Ray actor, pod uid, ...) so the
node agent's reconcile can release slices whose owner is gone (`adopt` records a restarted
process of the same owner), and optionally `SliceAttrs`
(written in the same transaction): a lease (``expires_at``, the slice returns by itself
unless renewed) and the uid/gid its processes run as.

A ledger whose process is its file's only writer (the node agent) passes
``cache_state=True``: the placement state (`ClusterState`) is then built once and updated
with every committed change, and the engine that decides over it is kept with it (its
policies update what they derived from the state, frag's mix of the live slices included),
so a reservation costs the same with 10 or 1,000 live slices.
All writes then go through one connection, whose ``PRAGMA data_version`` reveals a commit
by any other connection or process: the cache is rebuilt before the next decision, and the
capacity check inside each transaction never trusts the cache anyway.

Rows are read back leniently: a stored value that today's rules refuse (a slice id or an
owner field written by an older version) is read as it is, with lone surrogates replaced,
so listing and releasing never fail on old data.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from qgpu.errors import NoFit, QgpuError, RuleViolation
from qgpu.model import (
    Allocation,
    GpuDevice,
    IsolationPolicy,
    NodeInventory,
    Owner,
    OwnerKind,
    PlacementPolicy,
    SliceRequest,
    new_slice_id,
)
from qgpu.placement import ClusterState, Decision, Engine

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS nodes (
    name TEXT PRIMARY KEY,
    inventory TEXT NOT NULL,
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS slices (
    slice_id TEXT PRIMARY KEY,
    node TEXT NOT NULL,
    core INTEGER NOT NULL,
    memory_gib INTEGER NOT NULL,
    isolation TEXT NOT NULL,
    owner_kind TEXT NOT NULL,
    owner_id TEXT NOT NULL,
    owner_meta TEXT NOT NULL,
    request TEXT NOT NULL,
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS slice_gpus (
    slice_id TEXT NOT NULL REFERENCES slices(slice_id) ON DELETE CASCADE,
    gpu_uuid TEXT NOT NULL,
    core INTEGER NOT NULL,
    memory_gib INTEGER NOT NULL,
    PRIMARY KEY (slice_id, gpu_uuid)
);
CREATE INDEX IF NOT EXISTS slice_gpus_by_gpu ON slice_gpus(gpu_uuid);
CREATE INDEX IF NOT EXISTS slices_by_owner ON slices(owner_kind, owner_id);
CREATE INDEX IF NOT EXISTS slices_by_node ON slices(node);
CREATE TABLE IF NOT EXISTS slice_attrs (
    slice_id TEXT PRIMARY KEY REFERENCES slices(slice_id) ON DELETE CASCADE,
    expires_at REAL,
    uid INTEGER,
    gid INTEGER
);
CREATE INDEX IF NOT EXISTS slice_attrs_by_expiry ON slice_attrs(expires_at)
    WHERE expires_at IS NOT NULL;
"""


Prepare = Callable[[Allocation], None]
"""Work that must be done before a new slice is committed (the node agent makes the
slice's files): called inside the write transaction after the checked insert; raising
rolls the transaction back, so the slice is recorded only when its `Prepare` succeeded. A
rollback writes nothing to the database file, so it works on a disk that turned
read-only."""


class OverCommit(QgpuError):
    """A reservation would have over-committed a GPU; the transaction was rolled back."""


class UnknownNode(QgpuError):
    pass


@dataclass(frozen=True)
class GpuUsage:
    """Committed use of one GPU according to the ledger."""

    node: str
    uuid: str
    core_used: int
    memory_used_gib: int
    slices: int
    core_capacity: int
    memory_capacity_gib: int
    max_slices: int


@dataclass(frozen=True)
class SliceAttrs:
    """What the ledger keeps of a slice besides its placement (all optional)."""

    expires_at: float | None = None  # lease: released by the agent after this wall time
    uid: int | None = None  # the user its processes run as (owner of its files)
    gid: int | None = None


class Ledger:
    """SQLite-backed record of nodes and slices. One instance may be shared by threads."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        synchronous: str = "FULL",
        *,
        cache_state: bool = False,
    ) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if synchronous.upper() not in {"FULL", "NORMAL", "EXTRA"}:
            raise RuleViolation("synchronous", synchronous, "must be FULL, NORMAL or EXTRA")
        self._synchronous = synchronous.upper()
        self._local = threading.local()
        self._cache_state = cache_state
        self._wlock = threading.RLock()
        self._wconn: sqlite3.Connection | None = None
        self._seen_version: int | None = None
        # node filter -> (inventories, state with every committed slice applied)
        self._cache: dict[str | None, tuple[list[NodeInventory], ClusterState]] = {}
        # (node filter, policies) -> the engine deciding over that cached state: its
        # policies keep what they derived from the state (frag's mix of the live slices,
        # usable copies per GPU, gap prices) and update it with each change
        self._engines: dict[tuple[str | None, str, str], Engine] = {}
        # model names asked for -> (the inventory list it was found in, the biggest card)
        self._biggest: dict[tuple[str, ...], tuple[list[NodeInventory], GpuDevice | None]] = {}
        # executescript() commits on its own, so the schema gets its own script transaction
        self._conn().executescript(
            "BEGIN IMMEDIATE;"
            + _SCHEMA
            + "INSERT OR IGNORE INTO meta(key, value) VALUES "
            + f"('schema_version', '{SCHEMA_VERSION}');"
            + "COMMIT;"
        )

    # -- connections -------------------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(
            self.path, timeout=60.0, isolation_level=None, check_same_thread=False
        )
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(f"PRAGMA synchronous={self._synchronous}")
        conn.execute("PRAGMA foreign_keys=ON")
        conn.execute("PRAGMA busy_timeout=60000")
        return conn

    def _conn(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        pid = getattr(self._local, "pid", None)
        if conn is None or pid != os.getpid():
            conn = self._connect()
            self._local.conn = conn
            self._local.pid = os.getpid()
        return conn

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One write transaction holding SQLite's write lock from the start (with
        `cache_state`, on the one writer connection, after checking nobody else wrote)."""
        if not self._cache_state:
            db = self._conn()
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
            except BaseException:
                _rollback(db)
                raise
            else:
                db.execute("COMMIT")
            return
        with self._wlock:
            if self._wconn is None:
                self._wconn = self._connect()
            db = self._wconn
            db.execute("BEGIN IMMEDIATE")
            try:
                version = db.execute("PRAGMA data_version").fetchone()[0]
                if version != self._seen_version:
                    self._cache.clear()  # another connection or process committed
                    self._seen_version = version
                yield db
            except BaseException:
                _rollback(db)
                raise
            try:
                db.execute("COMMIT")
            except BaseException:
                self._cache.clear()  # the transaction's fate is unknown: rebuild
                _rollback(db)
                raise

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None
        with self._wlock:
            if self._wconn is not None:
                self._wconn.close()
                self._wconn = None
            self._cache.clear()
            self._engines.clear()

    # -- nodes -------------------------------------------------------------------------

    def put_node(self, inventory: NodeInventory) -> None:
        """Insert or replace a node's inventory (slices on it are kept)."""
        with self._tx() as db:
            db.execute(
                "INSERT INTO nodes(name, inventory, updated_at) VALUES (?, ?, ?) "
                "ON CONFLICT(name) DO UPDATE SET inventory=excluded.inventory, "
                "updated_at=excluded.updated_at",
                (inventory.name, inventory.model_dump_json(), time.time()),
            )
            self._cache.clear()

    def nodes(self) -> list[NodeInventory]:
        rows = self._conn().execute("SELECT inventory FROM nodes ORDER BY name").fetchall()
        return [NodeInventory.model_validate_json(r[0]) for r in rows]

    def node(self, name: str) -> NodeInventory:
        row = self._conn().execute("SELECT inventory FROM nodes WHERE name=?", (name,)).fetchone()
        if row is None:
            raise UnknownNode(f"node {name!r} is not in the ledger")
        return NodeInventory.model_validate_json(row[0])

    def remove_node(self, name: str) -> list[str]:
        """Forget a node (it died or left); its slices are released. Returns their ids."""
        with self._tx() as db:
            ids = [r[0] for r in db.execute("SELECT slice_id FROM slices WHERE node=?", (name,))]
            db.execute("DELETE FROM slices WHERE node=?", (name,))
            db.execute("DELETE FROM nodes WHERE name=?", (name,))
            self._cache.clear()
        return ids

    # -- reservations ------------------------------------------------------------------

    def reserve(
        self,
        request: SliceRequest,
        owner: Owner | None = None,
        *,
        slice_id: str | None = None,
        node: str | None = None,
        policy: PlacementPolicy | str | None = None,
        gpu_policy: PlacementPolicy | str | None = None,
        attrs: SliceAttrs | None = None,
        prepare: Prepare | None = None,
    ) -> Allocation:
        """Place and record a slice atomically. Raises NoFit, RuleViolation or OverCommit.

        With a `slice_id` that already exists for the same owner, returns the existing
        allocation (a retried reservation is not placed twice). `prepare` (see `Prepare`)
        runs for a new slice inside the transaction, before the commit.
        """
        owner = owner or Owner()
        slice_id = slice_id or new_slice_id()
        request.require_single_gpu_share("a reservation (its env names one GPU)")
        with self._wlock:  # the commit and the cached state's update, together
            with self._tx() as db:
                existing = self._get(db, slice_id)
                if existing is not None:
                    return _same_owner_or_raise(existing, owner)
                inventories, state = self._placement_state(db, node)
                self._reject_never_fits(request, inventories)
                engine = self._engine(state, node, policy, gpu_policy)
                decision = engine.decide(request)
                inv = next(n for n in inventories if n.name == decision.node)
                alloc = _allocation(slice_id, decision, request, inv, owner)
                mems = decision.memory_gib_per_gpu
                self._insert_checked(db, alloc, mems, request, inv, attrs)
                if prepare is not None:
                    prepare(alloc)
            self._cached_apply(alloc, mems, request)
        return alloc

    def record(
        self,
        alloc: Allocation,
        request: SliceRequest | None = None,
        attrs: SliceAttrs | None = None,
        prepare: Prepare | None = None,
    ) -> Allocation:
        """Record a placement decided elsewhere (Ray SDK, scheduler extender), checked;
        `prepare` as for `reserve`."""
        with self._wlock:
            return self._record(alloc, request, attrs, prepare)

    def _record(
        self,
        alloc: Allocation,
        request: SliceRequest | None,
        attrs: SliceAttrs | None,
        prepare: Prepare | None = None,
    ) -> Allocation:
        with self._tx() as db:
            existing = self._get(db, alloc.slice_id)
            if existing is not None:
                return _same_owner_or_raise(existing, alloc.owner)
            inv = self._inventories(db, alloc.node)[0]
            by_uuid = {g.uuid: g for g in inv.gpus}
            missing = [u for u in alloc.gpu_uuids if u not in by_uuid]
            if missing:
                raise RuleViolation("gpu_uuids", missing[0], f"is not a GPU of node {inv.name}")
            mems = tuple(
                by_uuid[u].memory_gib if alloc.is_whole_gpu else alloc.memory_gib
                for u in alloc.gpu_uuids
            )
            req = request or SliceRequest(
                core=alloc.core * len(alloc.gpu_uuids) if alloc.is_whole_gpu else alloc.core,
                memory_gib=None if alloc.is_whole_gpu else alloc.memory_gib,
                isolation=alloc.isolation,
            )
            self._insert_checked(db, alloc, mems, req, inv, attrs)
            if prepare is not None:
                prepare(alloc)
        self._cached_apply(alloc, mems, req)
        return alloc

    def release(self, slice_id: str) -> bool:
        """Release a slice. True if it was held; False if it was already gone (idempotent)."""
        return self.take(slice_id) is not None

    def take(self, slice_id: str) -> Allocation | None:
        """Release a slice and return what it was (read in the same transaction that
        deletes it); None if it was already gone."""
        with self._wlock:
            with self._tx() as db:
                gpus = [
                    r[0]
                    for r in db.execute(
                        "SELECT gpu_uuid FROM slice_gpus WHERE slice_id=? ORDER BY rowid",
                        (slice_id,),
                    )
                ]
                rows = db.execute(
                    "DELETE FROM slices WHERE slice_id=? RETURNING *", (slice_id,)
                ).fetchall()  # stepped to its end: nothing left running at the commit
            if not rows:
                return None
            self._cached_release(slice_id)
        return _row_to_allocation(rows[0], gpus)

    def adopt(self, slice_id: str, owner: Owner) -> Allocation | None:
        """Record `owner` (the same kind and id, other ``meta``: a restarted process of the
        same holder) as the holder of an existing slice; None when the slice is gone.
        Which holder may adopt is the caller's rule (the node agent: when the previous
        process is gone)."""
        with self._wlock, self._tx() as db:
            existing = self._get(db, slice_id)
            if existing is None:
                return None
            _same_owner_or_raise(existing, owner)
            db.execute(
                "UPDATE slices SET owner_meta=? WHERE slice_id=?",
                (json.dumps(owner.meta, sort_keys=True), slice_id),
            )
            return existing.model_copy(update={"owner": owner})

    # -- slice attributes (leases, identity) -------------------------------------------

    def attrs(self, slice_id: str) -> SliceAttrs:
        row = (
            self._conn()
            .execute("SELECT expires_at, uid, gid FROM slice_attrs WHERE slice_id=?", (slice_id,))
            .fetchone()
        )
        return SliceAttrs(*row) if row else SliceAttrs()

    def all_attrs(self) -> dict[str, SliceAttrs]:
        rows = self._conn().execute("SELECT slice_id, expires_at, uid, gid FROM slice_attrs")
        return {r[0]: SliceAttrs(*r[1:]) for r in rows}

    def set_expiry(self, slice_id: str, expires_at: float | None) -> bool:
        """Renew (a new time) or end (None) a slice's lease; False if the slice is gone."""
        with self._tx() as db:
            if db.execute("SELECT 1 FROM slices WHERE slice_id=?", (slice_id,)).fetchone() is None:
                return False
            db.execute(
                "INSERT INTO slice_attrs(slice_id, expires_at) VALUES (?, ?) "
                "ON CONFLICT(slice_id) DO UPDATE SET expires_at=excluded.expires_at",
                (slice_id, expires_at),
            )
        return True

    def expired(self, now: float | None = None) -> list[str]:
        """Slices whose lease ended before `now`."""
        now = time.time() if now is None else now
        rows = self._conn().execute(
            "SELECT slice_id FROM slice_attrs WHERE expires_at IS NOT NULL AND expires_at <= ? "
            "ORDER BY expires_at",
            (now,),
        )
        return [r[0] for r in rows]

    def release_owner(self, kind: OwnerKind | str, owner_id: str) -> list[str]:
        """Release every slice of one owner; returns the released ids."""
        kind = OwnerKind(kind)
        with self._tx() as db:
            ids = [
                r[0]
                for r in db.execute(
                    "SELECT slice_id FROM slices WHERE owner_kind=? AND owner_id=?",
                    (kind.value, owner_id),
                )
            ]
            db.execute(
                "DELETE FROM slices WHERE owner_kind=? AND owner_id=?", (kind.value, owner_id)
            )
            self._cache.clear()
        return ids

    # -- queries -----------------------------------------------------------------------

    def get(self, slice_id: str) -> Allocation | None:
        return self._get(self._conn(), slice_id)

    def allocations(self, node: str | None = None) -> list[Allocation]:
        db = self._conn()
        where, args = ("WHERE node=?", (node,)) if node else ("", ())
        rows = db.execute(f"SELECT * FROM slices {where} ORDER BY created_at, slice_id", args)
        rows = rows.fetchall()
        gpus = _gpus_by_slice(db)
        return [_row_to_allocation(r, gpus.get(r[0], [])) for r in rows]

    def usage(self, node: str | None = None) -> list[GpuUsage]:
        """Per-GPU committed core, memory and slice count against capacity."""
        db = self._conn()
        inventories = self._inventories(db, node) if node else self.nodes()
        used = {
            r[0]: (r[1], r[2], r[3])
            for r in db.execute(
                "SELECT gpu_uuid, SUM(core), SUM(memory_gib), COUNT(*) "
                "FROM slice_gpus GROUP BY gpu_uuid"
            )
        }
        out = []
        for inv in inventories:
            for gpu in inv.gpus:
                core, mem, count = used.get(gpu.uuid, (0, 0, 0))
                out.append(
                    GpuUsage(
                        node=inv.name,
                        uuid=gpu.uuid,
                        core_used=core,
                        memory_used_gib=mem,
                        slices=count,
                        core_capacity=100,
                        memory_capacity_gib=gpu.memory_gib,
                        max_slices=gpu.max_slices(inv.max_slices_per_gpu, inv.fixed_slices),
                    )
                )
        return out

    def state(self, node: str | None = None) -> ClusterState:
        """A ClusterState with every live slice applied (for planning and tests)."""
        db = self._conn()
        return self._state(db, self._inventories(db, node))

    # -- the cached placement state (cache_state=True) ---------------------------------

    def _placement_state(
        self, db: sqlite3.Connection, node: str | None
    ) -> tuple[list[NodeInventory], ClusterState]:
        """Inventories and state for a decision: cached (kept up to date by every commit of
        this ledger) or read from the database."""
        if not self._cache_state:
            inventories = self._inventories(db, node)
            return inventories, self._state(db, inventories)
        cached = self._cache.get(node)
        if cached is None:
            inventories = self._inventories(db, node)
            cached = (inventories, self._state(db, inventories))
            self._cache[node] = cached
        return cached

    def _reject_never_fits(self, request: SliceRequest, inventories: list[NodeInventory]) -> None:
        """A request bigger than every card is a rule violation, not a 'try later'. The
        biggest matching card is remembered per inventory list (the cached one is kept until
        an inventory changes), so the check does not walk every GPU per reservation."""
        if request.memory_gib is None:
            return
        key = request.model_names
        known = self._biggest.get(key)
        if known is None or known[0] is not inventories:
            known = (inventories, _biggest_card(request, inventories))
            if self._cache_state:
                self._biggest[key] = known
        biggest = known[1]
        if biggest is not None and request.memory_gib > biggest.memory_gib:
            request.check_against(biggest)

    def _engine(
        self,
        state: ClusterState,
        node: str | None,
        policy: PlacementPolicy | str | None,
        gpu_policy: PlacementPolicy | str | None,
    ) -> Engine:
        """An engine over `state`: made once per cached state (kept while the state is),
        else for this decision only."""
        if not self._cache_state:
            return Engine(state, policy, gpu_policy)
        key = (node, str(policy), str(gpu_policy))
        engine = self._engines.get(key)
        if engine is None or engine.state is not state:
            engine = self._engines[key] = Engine(state, policy, gpu_policy)
        return engine

    def _cached_apply(
        self, alloc: Allocation, memory_per_gpu: tuple[int, ...] | list[int], req: SliceRequest
    ) -> None:
        if not self._cache_state:
            return
        with self._wlock:
            for key, (_invs, state) in list(self._cache.items()):
                if alloc.node not in state.node_index:
                    continue
                try:
                    state.apply(
                        alloc.slice_id,
                        [state.uuid_index[u] for u in alloc.gpu_uuids],
                        alloc.core,
                        list(memory_per_gpu),
                        req.cpu_milli,
                        req.host_memory_mib,
                    )
                except (KeyError, ValueError):
                    self._cache.pop(key, None)  # out of step with the database: rebuild

    def _cached_release(self, slice_id: str) -> None:
        if not self._cache_state:
            return
        with self._wlock:
            for _invs, state in self._cache.values():
                state.release(slice_id)

    # -- internals ---------------------------------------------------------------------

    def _inventories(self, db: sqlite3.Connection, node: str | None) -> list[NodeInventory]:
        if node is None:
            rows = db.execute("SELECT inventory FROM nodes ORDER BY name").fetchall()
        else:
            rows = db.execute("SELECT inventory FROM nodes WHERE name=?", (node,)).fetchall()
            if not rows:
                raise UnknownNode(f"node {node!r} is not in the ledger")
        return [NodeInventory.model_validate_json(r[0]) for r in rows]

    def _state(self, db: sqlite3.Connection, inventories: list[NodeInventory]) -> ClusterState:
        state = ClusterState(inventories)
        names = {n.name for n in inventories}
        rows = db.execute(
            "SELECT s.slice_id, s.node, s.request, g.gpu_uuid, g.core, g.memory_gib "
            "FROM slices s JOIN slice_gpus g USING (slice_id) ORDER BY s.slice_id"
        ).fetchall()
        grouped: dict[str, list[tuple]] = {}
        for row in rows:
            if row[1] in names:
                grouped.setdefault(row[0], []).append(row)
        for sid, parts in grouped.items():
            req = json.loads(parts[0][2])
            state.apply(
                sid,
                [state.uuid_index[p[3]] for p in parts],
                parts[0][4],
                [p[5] for p in parts],
                int(req.get("cpu_milli", 0)),
                int(req.get("host_memory_mib", 0)),
            )
        return state

    def _get(self, db: sqlite3.Connection, slice_id: str) -> Allocation | None:
        row = db.execute("SELECT * FROM slices WHERE slice_id=?", (slice_id,)).fetchone()
        if row is None:
            return None
        gpus = [
            r[0]
            for r in db.execute(
                "SELECT gpu_uuid FROM slice_gpus WHERE slice_id=? ORDER BY rowid", (slice_id,)
            )
        ]
        return _row_to_allocation(row, gpus)

    def _insert_checked(
        self,
        db: sqlite3.Connection,
        alloc: Allocation,
        memory_per_gpu: tuple[int, ...],
        request: SliceRequest,
        inv: NodeInventory,
        attrs: SliceAttrs | None = None,
    ) -> None:
        db.execute(
            "INSERT INTO slices(slice_id, node, core, memory_gib, isolation, owner_kind, "
            "owner_id, owner_meta, request, created_at) VALUES (?,?,?,?,?,?,?,?,?,?)",
            (
                alloc.slice_id,
                alloc.node,
                alloc.core,
                alloc.memory_gib,
                alloc.isolation.value,
                alloc.owner.kind.value,
                alloc.owner.id,
                json.dumps(alloc.owner.meta, sort_keys=True),
                request.model_dump_json(),
                alloc.created_at,
            ),
        )
        db.executemany(
            "INSERT INTO slice_gpus(slice_id, gpu_uuid, core, memory_gib) VALUES (?,?,?,?)",
            [
                (alloc.slice_id, u, alloc.core, m)
                for u, m in zip(alloc.gpu_uuids, memory_per_gpu, strict=True)
            ],
        )
        if attrs is not None and attrs != SliceAttrs():
            db.execute(
                "INSERT INTO slice_attrs(slice_id, expires_at, uid, gid) VALUES (?,?,?,?)",
                (alloc.slice_id, attrs.expires_at, attrs.uid, attrs.gid),
            )
        self._check_capacity(db, inv, alloc.gpu_uuids)

    def _check_capacity(self, db: sqlite3.Connection, inv: NodeInventory, uuids: list[str]) -> None:
        by_uuid = {g.uuid: g for g in inv.gpus}
        marks = ",".join("?" * len(uuids))
        rows = db.execute(
            f"SELECT gpu_uuid, SUM(core), SUM(memory_gib), COUNT(*) FROM slice_gpus "
            f"WHERE gpu_uuid IN ({marks}) GROUP BY gpu_uuid",
            uuids,
        ).fetchall()
        for uuid_, core, mem, count in rows:
            gpu = by_uuid[uuid_]
            limit = gpu.max_slices(inv.max_slices_per_gpu, inv.fixed_slices)
            if core > 100 or mem > gpu.memory_gib or count > limit:
                raise OverCommit(
                    f"GPU {uuid_} would hold core {core}/100, memory {mem}/{gpu.memory_gib} GiB, "
                    f"{count}/{limit} slices"
                )


def _biggest_card(request: SliceRequest, inventories: list[NodeInventory]) -> GpuDevice | None:
    """The card with the most memory among those `request` may use (None: no such card)."""
    cards = [g for n in inventories for g in n.gpus if g.matches_model(request.model_names)]
    return max(cards, key=lambda g: g.memory_gib) if cards else None


def _allocation(
    slice_id: str, d: Decision, req: SliceRequest, inv: NodeInventory, owner: Owner
) -> Allocation:
    return Allocation(
        slice_id=slice_id,
        node=d.node,
        gpu_uuids=list(d.gpu_uuids),
        core=d.core_per_gpu,
        memory_gib=min(d.memory_gib_per_gpu),
        isolation=req.effective_isolation(inv.default_isolation),
        owner=owner,
    )


def _same_owner_or_raise(existing: Allocation, owner: Owner) -> Allocation:
    if existing.owner.kind == owner.kind and existing.owner.id == owner.id:
        return existing
    raise RuleViolation(
        "slice_id", existing.slice_id, "is already held by another owner; choose a new id"
    )


def _gpus_by_slice(db: sqlite3.Connection) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for sid, gpu in db.execute("SELECT slice_id, gpu_uuid FROM slice_gpus ORDER BY rowid"):
        out.setdefault(sid, []).append(gpu)
    return out


def _rollback(db: sqlite3.Connection) -> None:
    """Roll back if a transaction is open (a failed COMMIT may already have ended it)."""
    if db.in_transaction:
        with suppress(sqlite3.Error):
            db.execute("ROLLBACK")


def _clean(text: object) -> str:
    """A stored string as valid Unicode: lone surrogates (which no JSON encoder takes)
    become U+FFFD."""
    value = str(text)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return value.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
    return value


def _meta(text: str) -> dict[str, str]:
    try:
        raw = json.loads(text)
    except ValueError:
        return {}
    if not isinstance(raw, dict):
        return {}
    return {_clean(k): _clean(v) for k, v in raw.items()}


def _row_to_allocation(row: tuple, gpus: list[str]) -> Allocation:
    """A stored slice, built without re-validating: the row was checked when written, and
    an older version's rules (or data) must not make it unreadable."""
    (sid, node, core, mem, iso, okind, oid, ometa, _req, created) = row
    try:
        kind = OwnerKind(okind)
    except ValueError:
        kind = OwnerKind.MANUAL
    try:
        isolation = IsolationPolicy(iso)
    except ValueError:
        isolation = IsolationPolicy.BEST_EFFORT
    owner = Owner.model_construct(kind=kind, id=_clean(oid), meta=_meta(ometa))
    return Allocation.model_construct(
        slice_id=_clean(sid),
        node=_clean(node),
        gpu_uuids=[_clean(g) for g in gpus],
        core=core,
        memory_gib=mem,
        isolation=isolation,
        owner=owner,
        created_at=created,
    )


__all__ = [
    "GpuUsage",
    "Ledger",
    "NoFit",
    "OverCommit",
    "SliceAttrs",
    "UnknownNode",
    "new_slice_id",
]
