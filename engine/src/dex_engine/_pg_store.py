"""The PostgreSQL store: many worker processes on many hosts sharing one database.

Operations queue to a few lanes, each a thread with one pooled connection in pipeline mode (the
transitions are synchronous code). The first lane, whenever free, takes every queued operation (up
to MAX_BATCH_OPS) and runs them in one transaction, so they share one COMMIT and its WAL flush
(group commit); the others help only when it is stuck (_Dispatcher). The Execute commits of a batch
are one call of the server-side function dex_commit_execute (migrations 0002, 0003: about ten
statements per batch) instead of a few statements each; elsewhere statements whose replies nobody
reads travel with the next one that needs a reply. Writers to one flow serialize on its row (`FOR
UPDATE`); claims skip rows other transactions hold (`FOR UPDATE SKIP LOCKED`), so workers never
wait on each other's claims. Commits that make work ready send `NOTIFY dex_engine`, and commits
that cancel, fail or take away a running attempt `NOTIFY dex_engine_revoked`; every worker process
LISTENs on a dedicated connection, whose notifications wake the process's workers. A worker,
idle or running attempts, sleeps until a notification, a commit of its own process, its next due
time or its housekeeping, which bounds what a lost notification costs. Only while commits that may
claim are in flight does it poll every poll_seconds; such a quiet poll (nothing to claim or clean
up, no notification, and a full poll every FALLBACK_POLL_SECONDS) is one read-only statement. A
dropped connection is replaced and the operation retried; so are deadlocks and serialization
failures, which PostgreSQL resolves by aborting one side.

Failure isolation: an operation that raises rolls its batch back; the others commit without it and
it runs again alone. A batch waits at most BATCH_LOCK_TIMEOUT_MS for a row lock (two batches could
otherwise deadlock on each other's flows); then each of its operations runs alone, without a limit.

Durability: a SYNC Step commits with `synchronous_commit = on` (the server default); an ASYNC Step
with `synchronous_commit = off`, which survives a client crash but may lose the last commits if the
server crashes (its WAL buffers are lost) or its machine loses power. A transaction that hands
attempts to a worker (a claim) always commits synchronously: a claim lost in a server crash would
let a second worker be handed the same attempt under the same lease epoch. A batch commits
asynchronously only when every write in it may.

A connection that drops after COMMIT was sent leaves the outcome unknown. A writing transaction
reads its ID before COMMIT and sets its lane's commit mark (migration 0004) to the lane's next
sequence number. After such a drop the store waits until that ID is no longer in progress
(`pg_xact_status`), then reads the mark: there, the transaction committed and its results stand;
not there, the operations run again. The status alone cannot decide: a server crash that loses
the transaction also loses its ID, which the restarted server hands to a later transaction. It is
never re-applied blindly.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import msgspec

# Without the postgres extra these fail, and open_store names the extra to install.
import psycopg
import psycopg_pool
from psycopg import errors as pg_errors

from . import _gates
from . import _transitions as tx
from ._attribute_cache import AttributeCache, KnownRows
from ._codec import decode_json, encode_json
from ._errors import CommitOutcomeUnknownError, FlowNotActiveError, StaleAttemptError, StoreOpenError
from ._limits import POOLER_PROBE_ROUNDS
from ._migrate import apply_pending, recorded_version
from ._open import shown_error, shown_url
from ._options import LoadSpec, MethodOptions, StepDurability, TaskOptions
from ._records import DecisionRecord, Lease, MovementRecord, WriteSet
from ._store import CLOSED_STORE_ADVICE, FoldExecute, Store, commit_origin, now_ms, stop_retrying
from ._transitions import AppendRow, Db, HistoryRow, PollResult, Row, run_op

log = logging.getLogger("dex_engine.postgres")

R = TypeVar("R")

CHANNEL = "dex_engine"
# Commits that cancel, fail or take away a running attempt NOTIFY here, and the listener wakes the
# process's workers: a worker running attempts need not poll for their revocation.
REVOKED_CHANNEL = "dex_engine_revoked"
# Lanes (connections) per process. Each runs one transaction at a time, carrying every operation
# queued meanwhile, so a few keep a worker's commits, heartbeats and polls flowing.
DEFAULT_POOL_SIZE = 4
# Execute commits of a batch go to the server as one dex_commit_execute call (migrations 0002, 0003);
# False sends each through _transitions.commit_execute (about four statements each), e.g. to compare.
BATCH_EXECUTE_COMMITS = True
# The other lanes take queued operations only when the first has been busy this long with one batch.
OVERFLOW_AFTER_SECONDS = 0.1
# Most operations one transaction carries: bounds how long a batch holds its flows' row locks.
MAX_BATCH_OPS = 32
# How long a batch of several operations waits for a row lock before it runs them one by one.
BATCH_LOCK_TIMEOUT_MS = 100
# Reruns of one batch without an operation that raised, before the rest run one by one.
MAX_BATCH_ISOLATIONS = 3
# Tries of one operation on a dropped connection, deadlock or serialization failure.
MAX_OP_TRIES = 8
# OperationalErrors that are a statement's own failure, not a lost connection: a row past the
# index's size limit, too many arguments or columns. Every try would fail the same way, and the
# connection is fine, so the statement's op fails at once (SQLSTATE class 54).
_STATEMENT_LIMITS = (pg_errors.ProgramLimitExceeded,)
# SQLSTATEs of an OperationalError the server sends as it ends the session: administrator command,
# crash, start-up (with class 08, connection exceptions, and psycopg's own, which has none).
_SESSION_ENDED = ("57P01", "57P02", "57P03")
# Without a notification, report a change at least this often so claims fall back to polling.
FALLBACK_POLL_SECONDS = 1.0
# Migrations of concurrent processes serialize on this advisory lock.
MIGRATION_LOCK_KEY = 0x6465786D  # "dexm"
# A worker cut off from the server (network partition, dead host) notices in seconds, not after the
# kernel's TCP defaults (about 15 minutes for unacknowledged data, 2 hours for an idle connection);
# the dropped connection is replaced and the operation retried. Used unless the URL sets its own.
NETWORK_TIMEOUTS = {
    "connect_timeout": "10", "keepalives": "1", "keepalives_idle": "10", "keepalives_interval": "5",
    "keepalives_count": "3", "tcp_user_timeout": "30000",
}
# The open transaction of a client that was cut off keeps its row locks (its flows, its worker
# registration) until the server notices, stalling the workers that take over its Steps. So each
# session tells the server to end it when it sits idle in a transaction this long (the engine never
# does), and to apply the connection's keepalive and tcp_user_timeout on the server's side too: in
# the middle of a pipeline the idle timeout does not run, and only TCP can tell the client is gone.
IDLE_IN_TRANSACTION_TIMEOUT = "10s"
# psycopg_pool tries a failed connection again after 1 s, then 2, 4, 8 ... s: after an outage of a
# minute its next try may be a minute away (measured: an operation completed 55 s after the server
# was back). It gives a chain of tries up after this long instead, so that the next wait for a
# connection starts a fresh chain, whose first try is immediate.
POOL_RECONNECT_GIVE_UP_SECONDS = 5.0
# A lane waiting for a connection asks the pool again this often (so starting a fresh chain of
# tries once one was given up) ...
CONNECTION_ASK_SECONDS = 2.0
# ... for at most this long before the wait counts as one failed try of its operation (MAX_OP_TRIES).
CONNECTION_WAIT_SECONDS = 30.0
# Commit marks of lanes idle this long are deleted when a store opens: a mark is read only within
# seconds of its commit (_committed), and a lane that commits again writes its row anew.
COMMIT_MARK_RETENTION = "1 day"

_PLACEHOLDER = re.compile(r"\?")


def _with_network_timeouts(url: str) -> str:
    """`url` as a conninfo string, with NETWORK_TIMEOUTS for the parameters it does not set."""
    given = psycopg.conninfo.conninfo_to_dict(url)
    return psycopg.conninfo.make_conninfo(url, **{k: v for k, v in NETWORK_TIMEOUTS.items() if k not in given})


def _session_setup(conninfo: str) -> Callable[[psycopg.Connection[Any]], None]:
    """The pool's `configure`: the server-side settings of each new session (see above)."""
    params = psycopg.conninfo.conninfo_to_dict(conninfo)
    settings = {"idle_in_transaction_session_timeout": IDLE_IN_TRANSACTION_TIMEOUT}
    if params.get("keepalives") != "0":
        for name in ("keepalives_idle", "keepalives_interval", "keepalives_count"):
            if name in params:
                settings[f"tcp_{name}"] = str(params[name])
    if "tcp_user_timeout" in params:
        settings["tcp_user_timeout"] = str(params["tcp_user_timeout"])
    query = "SELECT " + ", ".join("set_config(%s, %s, false)" for _ in settings)
    args = [item for pair in settings.items() for item in pair]

    def configure(conn: psycopg.Connection[Any]) -> None:
        conn.execute(query, args)  # its connections (the pool's, the listener's) autocommit: left idle

    return configure


def _to_pg(sql: str, cache: dict[str, str] = {}) -> str:  # noqa: B006 - a deliberate per-process cache
    converted = cache.get(sql)
    if converted is None:
        converted = cache[sql] = _PLACEHOLDER.sub("%s", sql.replace("%", "%%"))
    return converted


def _writes(sql: str, cache: dict[str, bool] = {}) -> bool:  # noqa: B006 - a deliberate per-process cache
    """Whether a statement may write (or lock rows): anything but a plain SELECT."""
    writes = cache.get(sql)
    if writes is None:
        upper = sql.lstrip().upper()
        writes = cache[sql] = not upper.startswith("SELECT") or " FOR UPDATE" in upper or " FOR SHARE" in upper
    return writes


def _hands_out_leases(result: object) -> bool:
    """Whether an operation's result hands attempts to a worker (a claim, or a commit that claimed)."""
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], PollResult):
        return bool(result[1].leases)
    return isinstance(result, list) and bool(result) and isinstance(result[0], Lease)


class _PgDb:
    """One transaction on a connection in pipeline mode: statements whose results nobody reads
    (`send`) travel with the next statement that needs its reply."""

    __slots__ = (
        "appends", "cache", "cache_writes", "conn", "counted", "counters", "flow_rows", "history", "known",
        "notified", "pipeline", "reader", "revoked_sent", "sender", "streamed", "streams", "undo", "version_after",
        "wrote",
    )

    dialect = "postgres"
    for_update = " FOR UPDATE"
    skip_locked = " FOR UPDATE SKIP LOCKED"

    def __init__(self, conn: psycopg.Connection[Any], pipeline: psycopg.Pipeline) -> None:
        self.conn = conn
        self.pipeline = pipeline
        # Two cursors reused for every statement (a new cursor per statement costs more than the
        # statement's own client-side work): one whose results nobody reads, one that is read at
        # once. Kept apart so that a late reply to a sent statement never lands on the read one.
        self.reader: psycopg.Cursor[Any] = conn.cursor()
        self.sender: psycopg.Cursor[Any] = conn.cursor()
        self.history: list[HistoryRow] = []
        self.appends: list[AppendRow] = []
        self.counters: dict[str, dict[str, int]] = {}
        self.counted: set[str] = set()
        self.streams: dict[str, dict[str, list[int]]] = {}
        self.streamed: set[str] = set()
        self.cache: AttributeCache | None = None  # see Db.known: SQLite only
        self.known: dict[str, KnownRows | None] = {}
        self.version_after: dict[str, int] = {}
        self.flow_rows: dict[str, tuple[int, int]] = {}  # see Db.flow_rows: SQLite only
        self.cache_writes: list[tuple[str, KnownRows]] = []
        self.notified = False
        self.revoked_sent = False
        # In-memory changes made by operations of this transaction, undone if it rolls back.
        self.undo: list[Callable[[], None]] = []
        self.wrote = False  # a statement may have written: the commit's outcome matters

    def _execute(self, cursor: psycopg.Cursor[Any], sql: str, params: Sequence[Any]) -> psycopg.Cursor[Any]:
        if not self.wrote and _writes(sql):
            self.wrote = True
        return cursor.execute(_to_pg(sql), params, prepare=True)

    def one(self, sql: str, params: Sequence[Any] = ()) -> Row | None:
        row: Row | None = self._execute(self.reader, sql, params).fetchone()
        return row

    def all(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        return self._execute(self.reader, sql, params).fetchall()

    def run(self, sql: str, params: Sequence[Any] = ()) -> int:
        cursor = self._execute(self.reader, sql, params)
        self.pipeline.sync()  # the row count comes with the reply
        return cursor.rowcount

    def send(self, sql: str, params: Sequence[Any] = ()) -> None:
        """Queue a statement whose result nobody reads; its errors surface at the next reply."""
        self._execute(self.sender, sql, params)

    def notify(self) -> None:
        if not self.notified:  # one per transaction; PostgreSQL folds duplicates anyway
            self.sender.execute(f"NOTIFY {CHANNEL}")
            self.notified = self.wrote = True

    def revoked(self) -> None:
        if not self.revoked_sent:
            self.sender.execute(f"NOTIFY {REVOKED_CHANNEL}")
            self.revoked_sent = self.wrote = True


# Batched Execute commits ---------------------------------------------------------------------

_SnapshotRows = list[tuple[str, str, msgspec.Raw]]

# Set a lane's commit mark (migration 0004) and return the transaction's ID, for the lost-COMMIT
# check: in a transaction known to write, at its start; else at its end, only if it wrote.
_MARK_UPSERT = (
    " ON CONFLICT (lane) DO UPDATE SET seq = EXCLUDED.seq, updated_at = EXCLUDED.updated_at"
    " RETURNING pg_current_xact_id()::text"
)
_MARK = "INSERT INTO commit_marks (lane, seq, updated_at) VALUES (%s, %s, now())" + _MARK_UPSERT
_MARK_IF_WRITTEN = (
    "INSERT INTO commit_marks (lane, seq, updated_at) SELECT %s, %s, now()"
    " WHERE pg_current_xact_id_if_assigned() IS NOT NULL" + _MARK_UPSERT
)

# One call of the migration's dex_commit_execute commits every Execute of a batch.
_COMMIT_EXECUTE = (
    "SELECT r_idx, r_kind, r_task, r_seid, r_async, r_snapshot "
    "FROM dex_commit_execute(%s::jsonb, %s::jsonb, %s::jsonb, %s::bigint, %s::int, %s::int)"
)
_json = msgspec.json.Encoder()


@dataclass(frozen=True)
class _Target:
    """What a commit needs to know about one TaskOptions it schedules (cached per object)."""

    options: TaskOptions
    method: str
    mopts: MethodOptions
    sync: tuple[TaskOptions, str]  # the stored options (JSON); SYNC when the flow config decides
    asynchronous: tuple[TaskOptions, str] | None  # the ASYNC variant when the flow config decides
    load: msgspec.Raw | None  # the LoadSpec as JSON when the method loads attributes


_targets: dict[int, _Target] = {}
_TARGETS_MAX = 4096


def _target(options: TaskOptions) -> _Target:
    hit = _targets.get(id(options))
    if hit is not None and hit.options is options:
        return hit
    method = "wait_for" if options.has_wait_for else "execute"
    mopts = options.wait_for if method == "wait_for" and options.wait_for is not None else options.execute
    variants: tuple[tuple[TaskOptions, bytes], tuple[TaskOptions, bytes] | None]
    if options.durability is None:
        sync = msgspec.structs.replace(options, durability=StepDurability.SYNC)
        asynchronous = msgspec.structs.replace(options, durability=StepDurability.ASYNC)
        variants = (sync, encode_json(sync)), (asynchronous, encode_json(asynchronous))
    else:
        variants = (options, encode_json(options)), None
    load = None if mopts.load == LoadSpec("none") else msgspec.Raw(encode_json(mopts.load))
    target = _Target(options, method, mopts, (variants[0][0], variants[0][1].decode()),
                     None if variants[1] is None else (variants[1][0], variants[1][1].decode()), load)
    if len(_targets) >= _TARGETS_MAX:
        _targets.clear()
    _targets[id(options)] = target  # keeps `options` alive, so its id is not reused meanwhile
    return target


def batchable(writes: WriteSet, decision: DecisionRecord) -> bool:
    """Whether dex_commit_execute can commit this Execute: no channel writes, no cancellations, no
    forced close, no movement with a WaitFor already evaluated (MovementRecord.wait). Stream appends
    are batchable: _commit_executes writes them after the call, for the commits it accepted. (A
    publish, which wakes waits, saves no round trip there: the waits' reads cost what the generic
    path's do.) Anything else takes _transitions.commit_execute."""
    return (
        not writes.publishes and not writes.deleted_messages
        and not decision.canceling_steps and decision.kind in ("movements", "dead_end", "graceful_complete")
        and all(m.wait is None for m in decision.movements)
    )


@dataclass(eq=False)
class _ExecuteCommit:
    """One Execute's commit, sent with the other Executes of its batch in one dex_commit_execute call."""

    lease: Lease
    writes: WriteSet
    decision: DecisionRecord
    claim: tuple[str, Sequence[str], int] | None
    declined: tx.Declined = ()  # Steps no claim for the claim's worker takes (Store.set_declined)

    def generic(self, db: Db) -> list[Lease]:
        """The same commit through _transitions (Store.commit_execute's operation), used when a
        batch failed in the database and its operations run again one by one."""
        now = now_ms()
        claim = self.claim
        handoff = None if claim is None else tx.Handoff(claim[0], claim[2], [])
        tx.commit_execute(db, self.lease, self.writes, self.decision, now, handoff)
        if _gates.ACTIVE:  # the transaction is open: a crash here must roll it all back
            _gates.gate(_gates.INSIDE_COMMIT)
        if claim is None or handoff is None:
            return []
        return handoff.leases or tx.claim(db, claim[0], claim[1], claim[2], now, self.declined)


class _Unbatchable(Exception):
    """A batch's Execute commits cannot go to dex_commit_execute; they run through _transitions."""


class _Rejected:
    """The result of an operation that changed nothing and raises `error`; its batch still commits."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


def _stale(lease: Lease) -> StaleAttemptError:
    return StaleAttemptError(
        f"attempt {lease.attempt} of {lease.step_execution_id} in flow {lease.flow_id!r} "
        "no longer owns its task (cancelled, timed out, lease lost or superseded); its write was rejected"
    )


def _commit_executes(db: _PgDb, commits: list[_ExecuteCommit]) -> list[Any]:
    """Commit `commits` with one dex_commit_execute call; each one's result (its Leases) or _Rejected."""
    now = now_ms()
    # Flows are locked in one order (their IDs) by every batch, so two lanes' batches never deadlock.
    order = sorted(range(len(commits)), key=lambda n: commits[n].lease.flow_id)
    ops: list[tuple[Any, ...]] = []
    attrs: list[tuple[str, str, str | None]] = []
    moves: list[tuple[Any, ...]] = []
    planned: list[tuple[int, MovementRecord, _Target, bool]] = []  # per movement: commit, movement, handoff
    try:
        for n in order:
            c = commits[n]
            lease, decision, claim = c.lease, c.decision, c.claim
            attrs += [(name, key, None if value is None else value.decode())
                      for (name, key), value in c.writes.attributes.items()]
            capacity = 0 if claim is None else claim[2]
            for movement in decision.movements:
                target = _target(movement.options)
                handoff = capacity > 0 and not target.mopts.locks
                capacity -= handoff
                planned.append((n, movement, target, handoff))
                if handoff:
                    hb_ms = target.options.heartbeat_timeout_ms
                    method_deadline = None if target.mopts.timeout_ms is None else now + target.mopts.timeout_ms
                    deadline = method_deadline if hb_ms is None else min(now + hb_ms, method_deadline or now + hb_ms)
                    moves.append((movement.step_type, movement.input.decode(), target.sync[1],
                                  None if target.asynchronous is None else target.asynchronous[1], target.method,
                                  True, deadline, method_deadline, target.load))
                else:
                    moves.append((movement.step_type, movement.input.decode(), target.sync[1],
                                  None if target.asynchronous is None else target.asynchronous[1], target.method,
                                  False, None, None, None))
            locks = (lease.options.wait_for if lease.method == "wait_for" and lease.options.wait_for is not None
                     else lease.options.execute).locks
            ops.append((lease.flow_id, lease.task_id, lease.lease_epoch, None if claim is None else claim[0],
                        lease.step_type, lease.step_execution_id, lease.attempt, decision.kind, bool(locks),
                        decision.kind == "graceful_complete",
                        None if decision.output is None else decision.output.decode(), len(attrs), len(moves)))
        # The history bounds as _transitions reads them (tests lower them there).
        bounds = vars(tx)
        params = (_json.encode(ops).decode(), _json.encode(attrs).decode(), _json.encode(moves).decode(), now,
                  bounds["HISTORY_TRIM_CHECK_EVERY"], bounds["MAX_HISTORY_EVENTS_PER_FLOW"])
    except Exception as exc:  # e.g. a value that is not UTF-8: these commits take _transitions
        raise _Unbatchable() from exc
    db.wrote = True
    rows = db.reader.execute(_COMMIT_EXECUTE, params, prepare=True).fetchall()
    results: list[Any] = [[] for _ in commits]
    for idx, kind, task_id, seid, is_async, snapshot in rows:
        if kind == "task":
            n, movement, target, handoff = planned[idx - 1]
            if not handoff:
                continue
            options = target.sync[0] if not is_async or target.asynchronous is None else target.asynchronous[0]
            lease = commits[n].lease
            attributes = ({} if snapshot is None else
                          {(a, k): bytes(v) for a, k, v in decode_json(bytes(snapshot), _SnapshotRows)})
            results[n].append(Lease(
                task_id=int(task_id), lease_epoch=1, flow_id=lease.flow_id, flow_type=lease.flow_type,
                step_type=movement.step_type, step_execution_id=str(seid),
                method="wait_for" if target.method == "wait_for" else "execute", attempt=1,
                input=movement.input, options=options, load=target.mopts.load, attributes=attributes,
                checkpoint=None, wait_spec=None, wait_outcome=None, recovery_error=None,
            ))
        else:
            n = order[idx - 1]
            lease = commits[n].lease
            results[n] = _Rejected(_stale(lease) if kind == "stale" else FlowNotActiveError(lease.flow_id, seid))
    # Events of the accepted commits, in flow order under the flow locks the call took (E2: a
    # rejected attempt appends nothing); the function knows no streams (E11 trimming included).
    try:
        for n in order:
            c = commits[n]
            if c.writes.appends and not isinstance(results[n], _Rejected):
                lease = c.lease
                tx.append_writes(db, lease.flow_id, c.writes.appends, lease.step_execution_id, lease.attempt)
        tx.flush_appends(db)
    except psycopg.Error:
        raise
    except Exception as exc:  # the generic path runs the commits again, each failing on its own
        raise _Unbatchable() from exc
    return results


@dataclass(eq=False)
class _Op:
    """One queued operation and where its result goes."""

    fn: Callable[[Db], Any]
    write: bool
    durable: bool
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]
    origin: Callable[[], None] | None
    commit: _ExecuteCommit | None = None  # an Execute's commit that dex_commit_execute can batch
    gives_up: Callable[[], bool] | None = None  # see PostgresStore._gives_up


def _given_up(ops: list[_Op]) -> bool:
    """Whether every operation of a batch gives up trying (PostgresStore._gives_up)."""
    return all(op.gives_up is not None and op.gives_up() for op in ops)


# A worker's poll when it has nothing to claim or clean up: the lease epochs of its running
# attempts (a changed or missing one revokes the attempt) and when something next falls due, as
# _transitions.task_epochs and next_due compute them, in one statement. `declined`: the ready
# tasks it counts leave out the Steps the worker declined (three arrays: flow type, Step type,
# method; see Store.set_declined).
def _light_poll_sql(declined: bool) -> str:
    skip = (" AND (flow_type, step_type, method) NOT IN "
            "(SELECT * FROM unnest(%s::text[], %s::text[], %s::text[]))") if declined else ""
    return (
        "SELECT r.ids, r.epochs, "
        f"(SELECT MIN(run_at) FROM tasks WHERE state = 'ready' AND flow_type = ANY(%s::text[]){skip}), "
        "(SELECT MIN(timer_due_at) FROM tasks WHERE state = 'waiting'), "
        "(SELECT MIN(deadline_at) FROM tasks WHERE state = 'running'), (SELECT MIN(expires_at) FROM workers) "
        "FROM (SELECT array_agg(task_id) AS ids, array_agg(lease_epoch) AS epochs FROM tasks "
        "WHERE state = 'running' AND task_id = ANY(%s::bigint[])) r"
    )


_LIGHT_POLL = _light_poll_sql(declined=False)
_LIGHT_POLL_DECLINING = _light_poll_sql(declined=True)


def _text_array(values: Sequence[str]) -> str:
    """A PostgreSQL array literal (binding a Python list costs psycopg far more)."""
    quoted = ('"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"' for v in values)
    return "{" + ",".join(quoted) + "}"


def _light_poll(db: Db, flow_types: str, running: Sequence[int], declined: tx.Declined) -> PollResult:
    assert isinstance(db, _PgDb)
    ids = "{" + ",".join(map(str, running)) + "}"
    if declined:
        columns = [_text_array([step[i] for step in declined]) for i in range(3)]
        row = db.reader.execute(_LIGHT_POLL_DECLINING, (flow_types, *columns, ids), prepare=True).fetchone()
    else:
        row = db.reader.execute(_LIGHT_POLL, (flow_types, ids), prepare=True).fetchone()
    assert row is not None
    epochs = {} if row[0] is None else {int(t): int(e) for t, e in zip(row[0], row[1], strict=True)}
    due = [int(v) for v in row[2:] if v is not None]
    return PollResult([], epochs, min(due) if due else None, None)


def _what_failed(exc: psycopg.OperationalError) -> str:
    """What a retried OperationalError was, for its warning: a lost connection, or a statement the
    server cut short or refused on a connection that is fine (a statement_timeout, a cancel, a full
    disk), which a reader of the log must not go looking for in the network."""
    state = exc.sqlstate
    if state is None or state.startswith("08") or state in _SESSION_ENDED:
        return "database connection lost"
    return "database statement failed"


def _error_line(exc: BaseException) -> str:
    """`exc` as its type and the first line of its text (the server's message, not its detail)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


class _OpFailed(Exception):
    """Operation `index` of a transaction raised `error` itself (not a database error)."""

    def __init__(self, index: int, error: Exception) -> None:
        super().__init__(index, error)
        self.index = index
        self.error = error


# This host's clock as clock_skew_ms reads it (a test moves it; the engine's own times use now_ms).
_local_clock_ms = now_ms


class _OutcomeUnknown(Exception):
    """The connection dropped during COMMIT and the server could not say whether it committed;
    `error`, what the operations raise, says so."""

    def __init__(self, url: str, cause: BaseException) -> None:
        self.error = CommitOutcomeUnknownError(
            f"the connection to {shown_url(url)} was lost during COMMIT ({type(cause).__name__}: "
            f"{' '.join(str(cause).split())}) and the server could not say whether the transaction committed: it may "
            "have; read its effect before doing it again")
        self.error.__cause__ = cause
        super().__init__(self.error)


def _never() -> bool:
    return False


def _getconn(pool: psycopg_pool.ConnectionPool[Any], gives_up: Callable[[], bool] = _never) -> psycopg.Connection[Any]:
    """A connection from `pool`, asking again every CONNECTION_ASK_SECONDS (see there); raises
    psycopg_pool.PoolTimeout after CONNECTION_WAIT_SECONDS, or once `gives_up()` after an ask."""
    deadline = time.monotonic() + CONNECTION_WAIT_SECONDS
    while True:
        try:
            conn: psycopg.Connection[Any] = pool.getconn(
                timeout=min(CONNECTION_ASK_SECONDS, max(0.01, deadline - time.monotonic())))
            return conn
        except psycopg_pool.PoolTimeout:
            if time.monotonic() >= deadline or gives_up():
                raise


class _Lane:
    """A pooled connection kept in pipeline mode, used by one lane thread only."""

    def __init__(self, pool: psycopg_pool.ConnectionPool[Any]) -> None:
        self._pool = pool
        self.mark_id = uuid.uuid4().hex  # its row in commit_marks
        self.mark_seq = 0  # the mark its last writing transaction set
        self._conn: psycopg.Connection[Any] | None = None
        self._pipeline: psycopg.Pipeline | None = None
        self._stack = contextlib.ExitStack()

    def open(self, gives_up: Callable[[], bool] = _never) -> tuple[psycopg.Connection[Any], psycopg.Pipeline]:
        if self._conn is None or self._pipeline is None:
            conn = _getconn(self._pool, gives_up)
            try:
                self._pipeline = self._stack.enter_context(conn.pipeline())
            except BaseException:
                self._pool.putconn(conn)
                raise
            self._conn = conn
        return self._conn, self._pipeline

    def rollback(self) -> None:
        """End a failed transaction; a connection that cannot is closed and given back to the pool,
        which replaces it: its session state (prepared statements above all) is unknown."""
        assert self._conn is not None and self._pipeline is not None
        try:
            with contextlib.suppress(psycopg.Error):
                self._pipeline.sync()  # collects the error and ends the aborted pipeline segment
            # psycopg's cache of prepared statements must be emptied with the server's. Its own
            # rollback() always empties it (and deallocates what it knew of); a ROLLBACK or
            # DEALLOCATE ALL run as a query is seen only while psycopg does not yet count it among
            # its queries, so from a connection's second rollback in a row on, the server lost every
            # statement psycopg still took for prepared: each later use failed for good
            # (InvalidSqlStatementName). A read-only batch has no transaction for rollback() to end:
            # it gets an empty one.
            if self._conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE:
                self._conn.execute("BEGIN", prepare=False)
            self._conn.rollback()
            # Statements psycopg forgot when their pipeline segment failed may still be on the
            # server: drop them too (psycopg's cache is empty now, so it has nothing to forget).
            self._conn.execute("DEALLOCATE ALL", prepare=False)
            self._pipeline.sync()
        except psycopg.Error:
            self.release(discard=True)

    def release(self, *, discard: bool = False) -> None:
        """Give the connection back (the pool replaces a broken one); with `discard`, closed first."""
        conn, self._conn, self._pipeline = self._conn, None, None
        if conn is None:
            return
        with contextlib.suppress(psycopg.Error):
            self._stack.close()  # leaves pipeline mode
        self._stack = contextlib.ExitStack()
        if discard or (not conn.broken and conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE):
            conn.close()  # in an unknown state: the pool discards closed connections
        self._pool.putconn(conn)


class _Dispatcher:
    """Queued operations and the lanes that take them. The first lane takes everything queued
    whenever it is free, so operations gather into large batches (one transaction and, for Execute
    commits, one statement each); the other lanes take work only when it has been busy with one
    batch for OVERFLOW_AFTER_SECONDS (a lock wait, a slow disk, a lost connection), so one stuck
    transaction does not hold up the process's commits, heartbeats and polls."""

    def __init__(self) -> None:
        # Reentrant: close() may come from a finalizer the collector runs on a thread that holds it
        # (a lane in take(), a caller in put()), and a plain lock would wait there for ever.
        self.lock = threading.RLock()
        self.first = threading.Condition(self.lock)
        self.others = threading.Condition(self.lock)
        self.queue: collections.deque[_Op] = collections.deque()
        self.busy_since: float | None = None  # when the first lane took its batch; None while it waits
        self.first_waiting = False
        self.watching = False  # another lane waits out the first one's current batch
        self.closed = False

    def put(self, op: _Op) -> bool:
        """Queue `op`; False once the store closed, as no lane may be left to run it."""
        with self.lock:
            if self.closed:
                return False
            self.queue.append(op)
            # Wake a lane only when one must act: each wake-up is a thread switch.
            if self.busy_since is None:
                if self.first_waiting:
                    self.first.notify()
            elif not self.watching:
                self.others.notify()  # it waits out the first lane's grace period, then takes over
            return True

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self.first.notify_all()
            self.others.notify_all()

    def take(self, first: bool) -> list[_Op] | None:
        """A lane's next batch (up to MAX_BATCH_OPS); None once the store closed and nothing is queued."""
        with self.lock:
            if first:
                self.busy_since = None
                while not self.queue and not self.closed:
                    self.first_waiting = True
                    self.first.wait()
                    self.first_waiting = False
                if self.queue:
                    self.busy_since = time.monotonic()
            else:
                while not self.closed:
                    if self.queue and self.busy_since is not None:
                        waited = time.monotonic() - self.busy_since
                        if waited >= OVERFLOW_AFTER_SECONDS:
                            break
                        self.watching = True
                        self.others.wait(OVERFLOW_AFTER_SECONDS - waited)
                        self.watching = False
                    else:
                        self.others.wait()
            if not self.queue:
                return None
            return [self.queue.popleft() for _ in range(min(len(self.queue), MAX_BATCH_OPS))]

    def drain(self) -> list[_Op]:
        with self.lock:
            ops = list(self.queue)
            self.queue.clear()
            return ops


def _result(value: Any) -> tuple[bool, Any]:
    """An operation's (ok, value) from what its transaction returned: a stale commit's error."""
    return (False, value.error) if isinstance(value, _Rejected) else (True, value)


# The result of an operation already handed to its caller (_each_alone_past_locks): _complete skips it.
_DELIVERED: Any = object()


def _deliver(items: list[tuple[asyncio.Future[Any], bool, Any]], listeners: list[Callable[[], None]]) -> None:
    """Runs on the caller's event loop: one wake-up resolves every result of a batch."""
    for future, ok, value in items:
        if future.cancelled():
            continue
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)
    for listener in listeners:
        listener()


def migrate(conn: psycopg.Connection[Any], url: str) -> None:
    """Apply numbered migrations not yet applied to the database of `url`."""
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK_KEY,))
        version = _schema_version(conn, url)
        try:
            # Committed as the block exits.
            apply_pending(conn.execute, "postgres", version, "%s", shown_url(url))
        except (psycopg.errors.DuplicateTable, psycopg.errors.DuplicateFunction, psycopg.errors.DuplicateObject) as exc:
            if version:
                raise
            # No meta table, yet a name the first migration creates is taken: DDL is transactional
            # (a migration killed midway left nothing), so another application's table, index or
            # function holds it. Rolled back as the block exits.
            raise StoreOpenError(
                f"{shown_url(url)!r} is not a dex_engine database: it already holds "
                f"{(exc.diag.message_primary or str(exc)).split(' already exists')[0]}, of another application; "
                "use a database of dex_engine's own, or a schema of its own (?options=-csearch_path%3D<schema> in "
                "the URL)") from None


def _conninfo(url: str) -> str:
    """`url` as the conninfo the store connects with (_with_network_timeouts), its text UTF-8 whatever the
    URL or PGCLIENTENCODING say (see _check_encoding); ValueError when malformed."""
    try:
        return psycopg.conninfo.make_conninfo(_with_network_timeouts(url), client_encoding="UTF8")
    except psycopg.ProgrammingError as exc:  # libpq's text may quote the URL or its password
        raise ValueError(f"malformed PostgreSQL URL {shown_url(url)!r}: {shown_error(str(exc), url).strip()}") from None


def _engine_schema(url: str) -> str | None:
    """The schema (quoted as SQL needs) whose `meta` table the URL's search_path finds, else the
    first schema of that path: the one a GRANT must name, so the advice gives a statement to run
    as written. None when it cannot be read (the advice then shows a placeholder)."""
    conninfo = _conninfo(url)
    app_name = psycopg.conninfo.conninfo_to_dict(conninfo).get("application_name") or "dex_engine"
    try:
        with psycopg.connect(conninfo, autocommit=True, application_name=app_name) as conn:
            row = conn.execute("SELECT COALESCE((SELECT relnamespace::regnamespace::text FROM pg_class "
                               "WHERE oid = to_regclass('meta')), quote_ident(current_schema()))").fetchone()
    except psycopg.Error:
        return None
    return str(row[0]) if row is not None and row[0] is not None else None


def _check_encoding(conn: psycopg.Connection[Any], url: str) -> None:
    """Refuse, before anything is created, a database whose encoding is not UTF8. The engine's text
    (flow IDs, names, map keys, errors) is any Unicode but NUL, as SQLite keeps it; a LATIN1 or
    SQL_ASCII database cannot hold most of it (a flow ID "e\u0301" or a Step's value with an emoji
    failed with a UnicodeEncodeError, after its retries), so a program that ran on SQLite would fail
    there only with some inputs."""
    row = conn.execute("SELECT pg_encoding_to_char(encoding) FROM pg_database WHERE datname = current_database()"
                       ).fetchone()
    encoding = str(row[0]) if row is not None else "UTF8"
    if encoding != "UTF8":
        raise StoreOpenError(
            f"cannot open {shown_url(url)!r} as a dex_engine database: its encoding is {encoding}, which cannot hold "
            "every character of the flow IDs, names and errors dex_engine stores; use a database created with "
            "ENCODING 'UTF8' (CREATE DATABASE <name> ENCODING 'UTF8' TEMPLATE template0)")


# What to do about a pooler that does not give the store's connections a server session each.
_POOLER_ADVICE = ("connect to PostgreSQL directly, or through PgBouncer with pool_mode = session for this database "
                  "(pool_mode=session on its line in [databases])")


def _server_session(conn: psycopg.Connection[Any]) -> tuple[int, str]:
    """The server session `conn`'s next statement runs in: its backend pid and the server's start
    time, so that two servers behind one address (whose pids may coincide) are told apart."""
    row = conn.execute("SELECT pg_backend_pid(), pg_postmaster_start_time()::text", prepare=False).fetchone()
    assert row is not None
    return int(row[0]), str(row[1])


def _refuse_transaction_pooling(conn: psycopg.Connection[Any], conninfo: str, app_name: str, url: str) -> None:
    """Refuse a pooler that hands a client connection's transactions to different server sessions
    (PgBouncer's pool_mode = transaction, the default of many managed offerings). The store keeps
    session state on its connections: the listener's LISTEN (through such a pooler it hears nothing,
    so cross-process wake-ups are lost), and the lanes' prepared statements (psycopg prepares a
    statement run 5 times; the next transaction, on another server session, failed with "prepared
    statement "_pg3_0" does not exist" or "already exists", over and over). A second connection holds
    a transaction open while `conn` runs a statement: through such a pooler the second takes the
    server session `conn` just gave back (PgBouncer hands out the last one given back), or `conn`
    moves to another; directly or through a session pooler neither can happen, so there are no false
    alarms. Other clients' transactions ending at the wrong moment can hide the pooler from a round,
    hence POOLER_PROBE_ROUNDS of them. One extra connection and a few short statements per open."""
    mine = _server_session(conn)
    with psycopg.connect(conninfo, autocommit=True, application_name=app_name) as other:
        for _ in range(POOLER_PROBE_ROUNDS):
            before = _server_session(conn)  # gives its server session back just before `other` asks for one
            with other.transaction():
                theirs = _server_session(other)  # holds its server session until the transaction ends
                after = _server_session(conn)
            if theirs == mine:
                seen = f"two connections ran in one server session, backend pid {mine[0]}"
                break
            if before != mine or after != mine:
                moved = before if before != mine else after
                seen = f"one connection ran in different server sessions, backend pids {mine[0]} and {moved[0]}"
                break
        else:
            return
    raise StoreOpenError(
        f"cannot open {shown_url(url)!r} as a dex_engine database: a connection pooler between the store and "
        f"PostgreSQL (PgBouncer with pool_mode = transaction or statement?) hands each transaction whichever "
        f"server session is free ({seen}); that breaks the LISTEN that wakes workers and the prepared statements "
        f"the store keeps on its connections; {_POOLER_ADVICE}")


def _open_error(url: str, exc: psycopg.Error) -> StoreOpenError:
    return StoreOpenError(
        f"cannot open {shown_url(url)!r} as a dex_engine database: {type(exc).__name__}: "
        f"{' '.join(shown_error(str(exc), url).split())}; {_open_advice(url, exc)}"
    )


def _open_advice(url: str, exc: psycopg.Error) -> str:
    """What to do about `exc`, raised connecting to `url` or creating its schema: the one thing to
    change, with the statement to run where there is one, rather than a list of every cause."""
    try:
        params = psycopg.conninfo.conninfo_to_dict(_conninfo(url))
    except ValueError:
        params = {}
    user = str(params.get("user") or "the URL's user")
    dbname = str(params.get("dbname") or "")
    text = str(exc)
    if isinstance(exc, pg_errors.InsufficientPrivilege):
        schema = re.search(r"permission denied for schema (\S+)", text)
        if schema:
            return (f"{user} may not create tables there: as the schema's owner run GRANT CREATE ON SCHEMA "
                    f"{schema.group(1)} TO {user}, or name a database or schema {user} owns")
        if re.search(r"permission denied for (table|sequence|function)", text):
            home = _engine_schema(url) or "<schema>"
            return (f"its dex_engine tables belong to another role: connect as that role, or as it run GRANT "
                    f"SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {home} TO {user} and GRANT USAGE, "
                    f"SELECT, UPDATE ON ALL SEQUENCES IN SCHEMA {home} TO {user} (migrations still need the owner)")
        return f"{user} lacks a privilege the engine needs there; connect as the role that owns its database"
    if isinstance(exc, pg_errors.InvalidSchemaName):
        return ("the schema the URL's search_path names first does not exist: create it (CREATE SCHEMA ...) or "
                "correct ?options=-csearch_path%3D<schema> in the URL")
    # PgBouncer's own refusal, such as "transaction blocks not allowed in statement pooling mode".
    if "pooling mode" in text:
        return f"a connection pooler (PgBouncer) refused what the store needs: {_POOLER_ADVICE}"
    if dbname and f'database "{dbname}" does not exist' in text:
        return f"the server has no database {dbname!r}: create it (CREATE DATABASE {dbname}) or correct the URL"
    return "the server must be running and reachable at the URL's host and port, and accept its user"


def stored_schema_version(url: str) -> int:
    """The dex_engine schema version of the database at `url`, read without changing anything (as
    opening a store would: it creates and migrates the schema); 0 when it has none yet. ValueError
    for a malformed URL, StoreOpenError for a server that cannot be reached or another application's
    tables, as opening a store raises them."""
    conninfo = _conninfo(url)
    app_name = psycopg.conninfo.conninfo_to_dict(conninfo).get("application_name") or "dex_engine"
    try:
        with psycopg.connect(conninfo, autocommit=True, application_name=app_name) as conn:
            return _schema_version(conn, url)
    except psycopg.Error as exc:
        raise _open_error(url, exc) from None


def _schema_version(conn: psycopg.Connection[Any], url: str) -> int:
    """The dex_engine schema version of the database (the schema search_path names first); 0 when
    it has no `meta` table. Another application's `meta` (a common name) is refused, unchanged:
    its schema_version is not one dex_engine wrote, or dex_engine's flows table is not beside it."""
    row = conn.execute("SELECT to_regclass('meta') IS NOT NULL, to_regclass('flows') IS NOT NULL").fetchone()
    has_meta, has_flows = (bool(row[0]), bool(row[1])) if row else (False, False)
    if not has_meta:
        return 0
    columns = {name for (name,) in conn.execute(
        "SELECT attname FROM pg_attribute WHERE attrelid = 'meta'::regclass AND attnum > 0 AND NOT attisdropped")}
    stored: object = None
    if {"key", "value"} <= columns:
        found = conn.execute("SELECT value FROM meta WHERE key::text = 'schema_version'").fetchone()
        stored = found[0] if found else None
    version = recorded_version(stored)
    if version is None or not has_flows:
        why = (f"its meta table's schema_version is {stored!r}, not a dex_engine schema version"
               if version is None else "it has a meta table but no dex_engine flows table")
        raise StoreOpenError(
            f"{shown_url(url)!r} is not a dex_engine database: {why}; use a database of dex_engine's own, or a "
            "schema of its own (?options=-csearch_path%3D<schema> in the URL)")
    return version


class PostgresStore(Store):
    """A Store on one PostgreSQL database; safe for many processes on many hosts."""

    def __init__(self, url: str, *, pool_size: int | None = None) -> None:
        pool_size = pool_size or DEFAULT_POOL_SIZE
        self.url = url
        self._opened_pid = os.getpid()  # its threads and connections belong to this process alone
        self._conninfo = _conninfo(url)
        self._configure_session = _session_setup(self._conninfo)
        # Named in pg_stat_activity as the URL says, else as dex_engine.
        self._app_name = psycopg.conninfo.conninfo_to_dict(self._conninfo).get("application_name") or "dex_engine"
        self._closed = False
        # The close() that joins the threads and closes the pool (not close_nowait, which leaves it
        # to the last lane), and when it is done: a second close waits for it.
        self._finish_lock = threading.Lock()
        self._finish_started = False
        self._finished = threading.Event()
        try:
            with psycopg.connect(self._conninfo, autocommit=True, application_name=self._app_name) as conn:
                _check_encoding(conn, url)
                _refuse_transaction_pooling(conn, self._conninfo, str(self._app_name), url)
                migrate(conn, url)
                conn.execute("DELETE FROM commit_marks WHERE updated_at < now() - %s::interval",
                             (COMMIT_MARK_RETENTION,))
        except psycopg.Error as exc:
            raise _open_error(url, exc) from None
        self._pool: psycopg_pool.ConnectionPool[Any] = psycopg_pool.ConnectionPool(
            self._conninfo, configure=self._configure_session,
            min_size=1, max_size=pool_size, open=True, name="dex-engine",
            reconnect_timeout=POOL_RECONNECT_GIVE_UP_SECONDS,
            kwargs={"application_name": self._app_name, "autocommit": True},
            check=psycopg_pool.ConnectionPool.check_connection,
        )
        self._listeners: list[tuple[asyncio.AbstractEventLoop, Callable[[], None]]] = []
        self._flow_type_arrays: dict[tuple[str, ...], str] = {}
        self._notified = threading.Event()
        self._last_change_report = 0.0
        self._stop_listening = threading.Event()
        self._listener = threading.Thread(target=self._listen, name="dex-pg-listen", daemon=True)
        self._listener.start()
        self._dispatcher = _Dispatcher()
        self._lanes_running = pool_size  # under the dispatcher's lock: the last lane out closes the pool
        self._lanes = [
            threading.Thread(target=self._lane_main, args=(i == 0,), name=f"dex-pg-{i}", daemon=True)
            for i in range(pool_size)
        ]
        for lane in self._lanes:
            lane.start()

    # Operations ---------------------------------------------------------------------------

    async def _run(
        self, fn: Callable[[Db], R], *, write: bool, durable: bool | None = None,
        commit: _ExecuteCommit | None = None, inline: bool = True,
    ) -> R:  # `inline`: every operation runs on the store's threads
        self._refuse_in_fork()
        if self._closed:
            raise RuntimeError(f"store {shown_url(self.url)!r} is closed; {CLOSED_STORE_ADVICE}")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[R] = loop.create_future()
        op = _Op(fn, write, durable is not False, loop, future, commit_origin.get(), commit,
                 self._gives_up(future, stop_retrying.get()))
        if not self._dispatcher.put(op):  # closed from another thread since the check above
            raise RuntimeError(f"store {shown_url(self.url)!r} is closed; {CLOSED_STORE_ADVICE}")
        return await future

    def _gives_up(self, future: asyncio.Future[Any], stopping: Callable[[], bool] | None) -> Callable[[], bool]:
        """When an operation stops trying again after a lost connection (at its next ask for one at
        the latest), having committed nothing: once its caller no longer waits (cancelled, say by
        asyncio.timeout or a blocking Client's close: a cancelled call may or may not take effect),
        the store is closing, or its worker is stopping (stop_retrying). Else, during an outage, a
        close waited for every try of each operation in flight (minutes), and a service manager's
        stop timeout killed the process instead."""
        return lambda: future.cancelled() or self._closed or (stopping is not None and stopping())

    async def poll(
        self, worker_id: str, flow_types: Sequence[str], capacity: int, running: Sequence[int],
        *, must_claim: bool, housekeep: bool, known: Sequence[int] | None = None,
        claimed_before: int | None = None, holder: tuple[str, int] | None = None, declare_dead: bool = True,
        timer_floor: bool = True, retention_ms: int | None = None,
    ) -> tuple[bool, PollResult]:
        """Store.poll; but when it would neither claim nor clean up (no claim asked for, no
        notification, no fallback poll and no housekeeping due), one read-only statement outside a
        transaction: most polls of a busy worker, which polls while its claiming commits are in
        flight."""
        if (must_claim or housekeep or self._notified.is_set()
                or time.monotonic() - self._last_change_report >= FALLBACK_POLL_SECONDS):
            return await super().poll(worker_id, flow_types, capacity, running, must_claim=must_claim,
                                      housekeep=housekeep, known=known, claimed_before=claimed_before,
                                      holder=holder, declare_dead=declare_dead, timer_floor=timer_floor,
                                      retention_ms=retention_ms)
        types = self._flow_type_arrays.get(tuple(flow_types))
        if types is None:
            types = self._flow_type_arrays[tuple(flow_types)] = _text_array(flow_types)
        declined = self.declined(worker_id)
        return False, await self._run(lambda db: _light_poll(db, types, running, declined), write=False)

    async def commit_execute(
        self, lease: Lease, writes: WriteSet, decision: DecisionRecord,
        claim: tuple[str, Sequence[str], int] | None = None, fold: FoldExecute | None = None,
    ) -> list[Lease]:
        # `fold` is unused: folds_executes is False here (the batched commit has no savepoints).
        if not (BATCH_EXECUTE_COMMITS and batchable(writes, decision)):
            return await super().commit_execute(lease, writes, decision, claim)
        commit = _ExecuteCommit(lease, writes, decision, claim, () if claim is None else self.declined(claim[0]))
        return await self._run(commit.generic, write=True, durable=lease.durable, commit=commit)

    def _lane_main(self, first: bool) -> None:
        """Take the queued operations (up to MAX_BATCH_OPS) and run them as one transaction."""
        lane = _Lane(self._pool)
        try:
            while (batch := self._dispatcher.take(first)) is not None:
                self._complete(batch, self._run_batch(lane, batch))
                # Not kept while waiting for the next: a failed operation's error holds its caller's
                # frames, and with them kept the last client to use this lane from being collected.
                del batch
        finally:
            lane.release()
            with self._dispatcher.lock:
                self._lanes_running -= 1
                last = self._lanes_running == 0
            if last and self._closed:
                # After every lane gave its connection back. Here, not only in close(): close_nowait
                # has nobody to wait for the lanes, and may run on a thread of the pool's own, which
                # cannot close the pool (that joins its threads).
                self._pool.close()

    def _run_batch(
        self, lane: _Lane, ops: list[_Op], isolated: int = 0, batched: bool = True,
    ) -> list[tuple[bool, Any]]:
        """Run `ops` in one transaction, retrying lost connections; isolate failing operations.

        A transition that raises rolls the transaction back; the others then commit without it
        and it runs again alone, after them. After MAX_BATCH_ISOLATIONS such reruns (each repeats
        the operations before the failing one), the rest run alone. A database error in a pipeline
        cannot be pinned on one operation, and a lock wait or deadlock between two batches is
        broken by the batch's lock timeout: then each operation runs alone. Without `batched`,
        Execute commits take _transitions.commit_execute instead of dex_commit_execute: after a
        database error in a batch that holds any, so that one bad commit cannot fail the others.
        """
        delay = 0.01
        started = time.monotonic()
        for attempt in range(1, MAX_OP_TRIES + 1):
            try:
                return [_result(value) for value in self._transact(lane, ops, batched)]
            except _OpFailed as failed:
                if len(ops) == 1:
                    return [(False, failed.error)]
                i = failed.index
                others = ops[:i] + ops[i + 1:]
                if isolated >= MAX_BATCH_ISOLATIONS:
                    rest = self._each_alone(lane, others, batched)
                else:
                    rest = self._run_batch(lane, others, isolated + 1, batched)
                return [*rest[:i], *self._run_batch(lane, [ops[i]], 0, batched), *rest[i:]]
            except _OutcomeUnknown as unknown:
                return [(False, unknown.error)] * len(ops)
            except _Unbatchable:
                return self._run_batch(lane, ops, isolated, batched=False)
            except (pg_errors.SerializationFailure, pg_errors.DeadlockDetected, pg_errors.LockNotAvailable) as exc:
                if len(ops) > 1:
                    return self._each_alone_past_locks(lane, ops, batched)
                if attempt == MAX_OP_TRIES:
                    return [(False, exc)]
            except psycopg.OperationalError as exc:
                if isinstance(exc, _STATEMENT_LIMITS):
                    return self._statement_failed(lane, ops, isolated, batched, exc)
                # The connection dropped (server restart, pg_terminate_backend, network) before
                # COMMIT, or during it and the transaction did not commit, or the server cut a
                # statement short (a statement_timeout, a cancel, a full disk): run it again.
                if attempt == MAX_OP_TRIES:
                    return [(False, self._gave_up(exc, time.monotonic() - started))] * len(ops)
                if _given_up(ops):
                    return [(False, exc)] * len(ops)  # nothing committed: a stopping worker's poll, say
                log.warning("%s (try %d of %d): %s; retrying", _what_failed(exc), attempt, MAX_OP_TRIES,
                            _error_line(exc))
            except psycopg.Error as exc:
                return self._statement_failed(lane, ops, isolated, batched, exc)
            except BaseException as exc:  # the lane must survive to serve the others
                return [(False, exc)] * len(ops)
            time.sleep(delay)
            delay = min(delay * 2, 1.0)
        raise AssertionError("unreachable")

    def _statement_failed(
        self, lane: _Lane, ops: list[_Op], isolated: int, batched: bool, exc: psycopg.Error
    ) -> list[tuple[bool, Any]]:
        """A statement of the batch failed on the server: find the op it belongs to by running the
        ops again unbatched or one by one; a single op fails with it."""
        if batched and any(op.commit is not None for op in ops):
            return self._run_batch(lane, ops, isolated, batched=False)
        if len(ops) > 1:
            return self._each_alone(lane, ops, batched)
        return [(False, exc)]

    def _gave_up(self, exc: psycopg.OperationalError, waited: float) -> psycopg.OperationalError:
        """The error an operation fails with after its last try. The pool's own timeout names only
        its last short wait for a connection, not the minutes waited nor what to check."""
        if not isinstance(exc, psycopg_pool.PoolTimeout):
            return exc
        error = psycopg_pool.PoolTimeout(
            f"no connection to {shown_url(self.url)!r} in {waited:.0f} s ({MAX_OP_TRIES} tries): the server "
            "refused or did not answer, or every connection of the pool stayed busy; check that the server "
            "is running and reachable from this host")
        error.__cause__ = exc
        return error

    def _each_alone(self, lane: _Lane, ops: list[_Op], batched: bool = True) -> list[tuple[bool, Any]]:
        return [result for op in ops for result in self._run_batch(lane, [op], 0, batched)]

    def _each_alone_past_locks(self, lane: _Lane, ops: list[_Op], batched: bool) -> list[tuple[bool, Any]]:
        """Run `ops` of a batch whose lock wait timed out each alone: first each with the batch's lock
        timeout, then, after all the others, those whose lock is still held, waiting for it. Run
        alone in order without that first pass, an operation waiting for a flow that another
        session holds would hold up the rest of the batch, operations on other flows, as long."""
        waiting: list[_Op] = []
        for op in ops:
            try:
                value = self._transact(lane, [op], batched, lock_timeout=True)[0]
            except pg_errors.LockNotAvailable:
                waiting.append(op)  # still held: waited for below
                continue
            except _OutcomeUnknown as unknown:
                result = (False, unknown.error)  # it may have committed: never run again
            except Exception:  # anything else takes the usual path, with its retries (none committed)
                (result,) = self._run_batch(lane, [op], 0, batched)
            else:
                result = _result(value)
            self._complete([op], [result])  # now: not once the locked ones got their locks
        for op in waiting:
            self._complete([op], self._run_batch(lane, [op], 0, batched))
        return [(True, _DELIVERED)] * len(ops)

    def _transact(
        self, lane: _Lane, ops: list[_Op], batched: bool = True, *, lock_timeout: bool | None = None,
    ) -> list[Any]:
        """One transaction running `ops`, the batchable Execute commits first (one call), then the
        others in order; their results (a _Rejected for a commit whose lease was stale), once committed.
        Row lock waits are cut at BATCH_LOCK_TIMEOUT_MS with `lock_timeout`, by default for a batch."""
        conn, pipeline = lane.open(partial(_given_up, ops))
        db = _PgDb(conn, pipeline)
        results: list[Any] = []
        commit_sent = False
        xid: str | None = None
        # Reads only: no BEGIN and COMMIT (in a pipeline, the statements up to the sync run as one
        # implicit transaction, and these take no locks and write nothing).
        reads = not any(op.write for op in ops)
        try:
            # Transaction control never prepared (see _Lane.rollback): psycopg prepares a statement
            # run PREPARE_THRESHOLD times, and one prepared inside a failing pipeline segment is
            # known to psycopg but not to the server, which broke every later batch of the lane.
            if not reads:
                db.sender.execute("BEGIN", prepare=False)
            early_xid = self._mark_early(db, ops, lane)
            if (len(ops) > 1 if lock_timeout is None else lock_timeout) and not reads:
                db.sender.execute(f"SET LOCAL lock_timeout = {BATCH_LOCK_TIMEOUT_MS}", prepare=False)
            batch = [i for i, op in enumerate(ops) if op.commit is not None] if batched else []
            done: dict[int, Any] = {}
            if batch:
                commits = [ops[i].commit for i in batch]
                for i, result in zip(batch, _commit_executes(db, commits), strict=True):  # type: ignore[arg-type]
                    done[i] = result
                for i in batch:
                    commit = ops[i].commit
                    assert commit is not None
                    if isinstance(done[i], _Rejected):
                        continue
                    if _gates.ACTIVE:  # the transaction is open: a crash here must roll it all back
                        _gates.gate(_gates.INSIDE_COMMIT)
                    claim = commit.claim
                    if claim is not None and not done[i]:  # nothing handed over: claim ready work
                        try:
                            done[i] = tx.claim(db, claim[0], claim[1], claim[2], now_ms(), commit.declined)
                        except psycopg.Error:
                            raise
                        except Exception as exc:
                            raise _OpFailed(i, exc) from exc
            for index, op in enumerate(ops):
                if index in done:
                    results.append(done[index])
                    continue
                try:
                    results.append(run_op(op.fn, db))
                except psycopg.Error:
                    raise
                except Exception as exc:
                    raise _OpFailed(index, exc) from exc
            # Operations marked as writes that wrote nothing (a poll without news) need neither.
            writes = [(op, result) for op, result in zip(ops, results, strict=True)
                      if op.write and not isinstance(result, _Rejected)] if db.wrote else []
            if writes and all(not op.durable and not _hands_out_leases(result) for op, result in writes):
                # Set at the end: the setting in force at COMMIT is the one that counts.
                db.sender.execute("SET LOCAL synchronous_commit = off", prepare=False)
            if early_xid is not None:
                row = early_xid.fetchone()  # its reply came with the first one a statement waited for
                xid = None if row is None else row[0]
            elif writes:
                # Also collects the replies (and errors) of statements still in the pipeline.
                lane.mark_seq += 1
                row = db.reader.execute(_MARK_IF_WRITTEN, (lane.mark_id, lane.mark_seq), prepare=True).fetchone()
                xid = None if row is None else row[0]
            commit_sent = True
            if not reads:
                db.sender.execute("COMMIT", prepare=False)
            pipeline.sync()
            return results
        except BaseException as exc:
            # The connection dropped during COMMIT: ask the server, never apply it twice. Not only
            # when psycopg already calls it broken: a FATAL (pg_terminate_backend) arrives before
            # the closed socket, and the backend may have committed before it ended.
            ambiguous = (commit_sent and isinstance(exc, psycopg.OperationalError)
                         and not isinstance(exc, _STATEMENT_LIMITS))
            if conn.broken or ambiguous:
                lane.release()  # also frees its pool slot for _committed's connection
            else:
                lane.rollback()
            if ambiguous:
                committed = True if xid is None else self._committed(xid, lane.mark_id, lane.mark_seq)
                if committed:
                    return results
                if committed is None:
                    raise _OutcomeUnknown(self.url, exc) from exc
            for undo in reversed(db.undo):
                undo()
            raise

    @staticmethod
    def _mark_early(db: _PgDb, ops: list[_Op], lane: _Lane) -> psycopg.Cursor[Any] | None:
        """For a batch with a durable write (a Step's commit, a heartbeat, a client's change), which
        will write: set the lane's commit mark at once, returning the transaction's ID. The reply
        travels with the first one a statement waits for, instead of costing a round trip of its
        own before COMMIT."""
        if not any(op.write and op.durable for op in ops):
            return None
        db.wrote = True
        lane.mark_seq += 1
        cursor = db.conn.cursor()
        cursor.execute(_MARK, (lane.mark_id, lane.mark_seq), prepare=True)
        return cursor

    def _complete(self, batch: list[_Op], results: list[tuple[bool, Any]]) -> None:
        # One wake-up per event loop per batch, with its commit listeners folded in: a worker is
        # woken by commits of other origins (its own already handed it what they claimed).
        per_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[Any], bool, Any]]] = {}
        pending = [(op, (ok, value)) for op, (ok, value) in zip(batch, results, strict=True) if value is not _DELIVERED]
        for op, (ok, value) in pending:
            per_loop.setdefault(op.loop, []).append((op.future, ok, value))
        origins = {op.origin for op, (ok, _) in pending if ok and op.write}
        listeners: dict[asyncio.AbstractEventLoop, list[Callable[[], None]]] = {}
        if origins:
            for loop, fn in list(self._listeners):
                if origins != {fn}:
                    listeners.setdefault(loop, []).append(fn)
        for loop in per_loop.keys() | listeners.keys():
            if not loop.is_closed():
                with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                    loop.call_soon_threadsafe(_deliver, per_loop.get(loop, []), listeners.get(loop, []))

    def _committed(self, xid: str, lane: str, seq: int) -> bool | None:
        """Did the transaction `xid`, which set `lane`'s mark to `seq`, commit? None when the server
        cannot be asked, or the transaction is still in progress after every try."""
        delay = 0.01
        for _ in range(MAX_OP_TRIES * 2):
            try:
                conn = _getconn(self._pool)
                try:
                    try:
                        row = conn.execute("SELECT pg_xact_status(%s::xid8)", (xid,)).fetchone()
                        over = row is not None and row[0] in ("committed", "aborted")
                    except pg_errors.InvalidParameterValue:
                        over = True  # "in the future": a server crash lost it before it reached the WAL
                    if over:
                        # Read after the status, in a snapshot of its own: a transaction reported over
                        # has left the server's list of running ones, so this snapshot sees its writes.
                        mark = conn.execute("SELECT seq FROM commit_marks WHERE lane = %s", (lane,)).fetchone()
                        return mark is not None and int(mark[0]) == seq
                    # "in progress": its backend has not yet noticed the lost connection.
                finally:
                    self._pool.putconn(conn)
            except psycopg.OperationalError:
                pass
            time.sleep(delay)
            delay = min(delay * 2, 1.0)
        return None

    def _changed_in(self, db: Db) -> bool:
        # A notification arrived, or it is time for the fallback poll.
        now = time.monotonic()
        if self._notified.is_set() or now - self._last_change_report >= FALLBACK_POLL_SECONDS:
            self._notified.clear()
            self._last_change_report = now
            if isinstance(db, _PgDb):
                db.undo.append(self._notified.set)  # rolled back, the poll that saw it never happened
            return True
        return False

    async def clock_skew_ms(self) -> int | None:
        def op(db: Db) -> int:
            before = _local_clock_ms()
            row = db.one("SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint")
            after = _local_clock_ms()
            assert row is not None
            return int(row[0]) - (before + after) // 2

        return await self._run(op, write=False)

    async def changed(self) -> bool:
        return await self._run(self._changed_in, write=False)

    def watch_foreign_commits(self, interval_seconds: float) -> bool:
        """Commits that make work ready or revoke a running attempt NOTIFY, and the listener calls
        the commit listeners on each notification and after every (re)connection: a worker need not
        poll. Work that only comes due later (a timer another process registered) is seen when
        that process's worker stops (it NOTIFYs as it unregisters) or at the next housekeeping."""
        return True

    def _listen(self) -> None:
        """Set the notified flag and call the commit listeners on every NOTIFY; reconnect after errors."""
        # _closed too: close_nowait leaves _stop_listening alone (see there).
        while not (self._stop_listening.is_set() or self._closed):
            try:
                listen_name = f"{self._app_name}_listen"
                with psycopg.connect(self._conninfo, autocommit=True, application_name=listen_name) as conn:
                    self._configure_session(conn)
                    conn.execute(f"LISTEN {CHANNEL}")
                    conn.execute(f"LISTEN {REVOKED_CHANNEL}")
                    self._tell_listeners()  # anything may have happened while not listening
                    while not (self._stop_listening.is_set() or self._closed):
                        for _ in conn.notifies(timeout=0.5, stop_after=1):
                            # Work ready, or a running attempt revoked: a sleeping worker must look.
                            self._tell_listeners()
            except psycopg.Error:
                if self._stop_listening.wait(0.5) or self._closed:
                    return

    def _tell_listeners(self) -> None:
        """Work may be ready or an attempt revoked: set the notified flag (the next poll claims) and wake
        the workers."""
        self._notified.set()
        for loop, fn in list(self._listeners):
            if not loop.is_closed():
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(fn)

    async def close(self) -> None:
        if self._in_fork():
            self._closed = True
            return  # a fork's copy: its threads and connections are the parent's, which goes on using them
        with self._finish_lock:
            finisher = not self._finish_started
            self._finish_started = self._closed = True
        if not finisher:
            # A second close (another task's, at once) returns only once the first is done too: the
            # connections are closed when any close() returns, and the caller may drop the database.
            await asyncio.to_thread(self._finished.wait)
            return
        self._stop_listening.set()
        self._dispatcher.close()  # the lanes run what is queued, then stop
        # One thread does it all, which goes on when the caller is cancelled (asyncio.timeout around
        # close, a cancelled shutdown): a second close only waits for it, so nothing else would close
        # the pool, and its connections and threads would stay until the process exits.
        await asyncio.to_thread(self._finish_close)

    def close_nowait(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._in_fork():
            return  # a fork's copy, as in close()
        # Not _stop_listening.set(): an Event's lock may be held by the very thread this runs on. The
        # listener sees _closed within its 0.5 s wait for notifications, and its connection closes.
        self._dispatcher.close()  # the lanes run what is queued, then stop; the last closes the pool

    def _finish_close(self) -> None:
        try:
            self._join_threads()
            self._pool.close()
        finally:
            self._finished.set()

    def _join_threads(self) -> None:
        self._listener.join()
        for lane in self._lanes:
            lane.join()
        # Operations no lane took (every lane died of an unexpected error): nobody will run them.
        for op in self._dispatcher.drain():
            if not op.loop.is_closed():
                error = RuntimeError(f"store {shown_url(self.url)!r} is closed; {CLOSED_STORE_ADVICE}")
                with contextlib.suppress(RuntimeError):
                    op.loop.call_soon_threadsafe(_deliver, [(op.future, False, error)], [])
