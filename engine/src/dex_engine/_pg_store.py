"""The PostgreSQL store: many worker processes on many hosts sharing one database.

Operations queue to a few lanes, each a thread with one pooled connection in pipeline mode (the
transitions are synchronous code). A free lane takes every queued operation (up to MAX_BATCH_OPS)
and runs them in one transaction, so they share one COMMIT and its WAL flush (group commit), and
statements whose replies nobody reads travel with the next one that needs a reply. Writers to one
flow serialize on its row (`FOR UPDATE`); claims skip rows other transactions hold (`FOR UPDATE
SKIP LOCKED`), so workers never wait on each other's claims. Commits that make work ready send
`NOTIFY dex_engine`; every worker process LISTENs on a dedicated connection and also polls, so a
missed notification costs one poll interval. A dropped connection is replaced and the operation
retried; so are deadlocks and serialization failures, which PostgreSQL resolves by aborting one side.

Failure isolation: an operation that raises rolls its batch back; the others commit without it and
it runs again alone. A batch waits at most BATCH_LOCK_TIMEOUT_MS for a row lock (two batches could
otherwise deadlock on each other's flows); then each of its operations runs alone, without a limit.

Durability: a SYNC Step commits with `synchronous_commit = on` (the server default); an ASYNC Step
with `synchronous_commit = off`, which survives a client crash but may lose the last commits if the
server crashes (its WAL buffers are lost) or its machine loses power. A transaction that hands
attempts to a worker (a claim) always commits synchronously: a claim lost in a server crash would
let a second worker be handed the same attempt under the same lease epoch. A batch commits
asynchronously only when every write in it may.

A connection that drops after COMMIT was sent leaves the outcome unknown. The transaction's ID is
read before COMMIT; after such a drop its status (`pg_xact_status`) decides: committed, the result
stands; aborted, the operation runs again. It is never re-applied blindly.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from ._migrate import apply_pending
from ._records import Lease
from ._store import Store, commit_origin
from ._transitions import Db, HistoryRow, PollResult, Row, run_op

try:
    import psycopg
    import psycopg_pool
    from psycopg import errors as pg_errors
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "PostgreSQL support needs the 'postgres' extra: pip install 'dex-engine[postgres]'"
    ) from exc

log = logging.getLogger("dex_engine.postgres")

R = TypeVar("R")

CHANNEL = "dex_engine"
# Lanes (connections) per process. Each runs one transaction at a time, carrying every operation
# queued meanwhile, so a few keep a worker's commits, heartbeats and polls flowing.
DEFAULT_POOL_SIZE = 4
# Most operations one transaction carries: bounds how long a batch holds its flows' row locks.
MAX_BATCH_OPS = 32
# How long a batch of several operations waits for a row lock before it runs them one by one.
BATCH_LOCK_TIMEOUT_MS = 100
# Reruns of one batch without an operation that raised, before the rest run one by one.
MAX_BATCH_ISOLATIONS = 3
# Tries of one operation on a dropped connection, deadlock or serialization failure.
MAX_OP_TRIES = 8
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
        conn.execute(query, args)
        if not conn.autocommit:
            conn.commit()  # the pool wants its new connections idle

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

    __slots__ = ("conn", "history", "notified", "pipeline", "reader", "sender", "undo", "wrote")

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
        self.notified = False
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


@dataclass(eq=False)
class _Op:
    """One queued operation and where its result goes."""

    fn: Callable[[Db], Any]
    write: bool
    durable: bool
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]
    origin: Callable[[], None] | None


class _OpFailed(Exception):
    """Operation `index` of a transaction raised `error` itself (not a database error)."""

    def __init__(self, index: int, error: Exception) -> None:
        super().__init__(index, error)
        self.index = index
        self.error = error


class _OutcomeUnknown(Exception):
    """The connection dropped during COMMIT and the server could not say whether it committed."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(error)
        self.error = error


class _Lane:
    """A pooled connection kept in pipeline mode, used by one lane thread only."""

    def __init__(self, pool: psycopg_pool.ConnectionPool[Any]) -> None:
        self._pool = pool
        self._conn: psycopg.Connection[Any] | None = None
        self._pipeline: psycopg.Pipeline | None = None
        self._stack = contextlib.ExitStack()

    def open(self) -> tuple[psycopg.Connection[Any], psycopg.Pipeline]:
        if self._conn is None or self._pipeline is None:
            conn = self._pool.getconn()
            try:
                self._pipeline = self._stack.enter_context(conn.pipeline())
            except BaseException:
                self._pool.putconn(conn)
                raise
            self._conn = conn
        return self._conn, self._pipeline

    def rollback(self) -> None:
        """End a failed transaction; a connection that cannot is given back to the pool."""
        assert self._conn is not None and self._pipeline is not None
        try:
            with contextlib.suppress(psycopg.Error):
                self._pipeline.sync()  # collects the error and ends the aborted pipeline segment
            self._conn.execute("ROLLBACK")
            self._pipeline.sync()
        except psycopg.Error:
            self.release()

    def release(self) -> None:
        """Give the connection back (the pool replaces a broken one)."""
        conn, self._conn, self._pipeline = self._conn, None, None
        if conn is None:
            return
        with contextlib.suppress(psycopg.Error):
            self._stack.close()  # leaves pipeline mode
        self._stack = contextlib.ExitStack()
        if not conn.broken and conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            conn.close()  # in an unknown state: the pool discards closed connections
        self._pool.putconn(conn)


_STOP = object()


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


def migrate(conn: psycopg.Connection[Any]) -> int:
    """Apply numbered migrations not yet applied; return the schema version."""
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK_KEY,))
        has_meta = conn.execute("SELECT to_regclass('meta')").fetchone()
        version = 0
        if has_meta and has_meta[0] is not None:
            row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
            version = int(row[0]) if row else 0
        return apply_pending(conn.execute, "postgres", version, "%s")  # committed as the block exits


class PostgresStore(Store):
    """A Store on one PostgreSQL database; safe for many processes on many hosts."""

    def __init__(self, url: str, *, pool_size: int = DEFAULT_POOL_SIZE) -> None:
        self.url = url
        self._conninfo = _with_network_timeouts(url)
        self._configure_session = _session_setup(self._conninfo)
        self._closed = False
        with psycopg.connect(self._conninfo, autocommit=True) as conn:
            migrate(conn)
        self._pool: psycopg_pool.ConnectionPool[Any] = psycopg_pool.ConnectionPool(
            self._conninfo, configure=self._configure_session,
            min_size=1, max_size=pool_size, open=True, name="dex-engine",
            kwargs={"application_name": "dex_engine", "autocommit": True},
            check=psycopg_pool.ConnectionPool.check_connection,
        )
        self._listeners: list[tuple[asyncio.AbstractEventLoop, Callable[[], None]]] = []
        self._notified = threading.Event()
        self._last_change_report = 0.0
        self._stop_listening = threading.Event()
        self._listener = threading.Thread(target=self._listen, name="dex-pg-listen", daemon=True)
        self._listener.start()
        self._queue: queue.SimpleQueue[_Op | object] = queue.SimpleQueue()
        self._lanes = [
            threading.Thread(target=self._lane_main, name=f"dex-pg-{i}", daemon=True) for i in range(pool_size)
        ]
        for lane in self._lanes:
            lane.start()

    # Operations ---------------------------------------------------------------------------

    async def _run(self, fn: Callable[[Db], R], *, write: bool, durable: bool | None = None) -> R:
        if self._closed:
            raise RuntimeError(f"store {self.url!r} is closed")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[R] = loop.create_future()
        self._queue.put(_Op(fn, write, durable is not False, loop, future, commit_origin.get()))
        return await future

    def _lane_main(self) -> None:
        """Take every queued operation (up to MAX_BATCH_OPS) and run them as one transaction."""
        lane = _Lane(self._pool)
        try:
            while True:
                first = self._queue.get()
                if first is _STOP:
                    return
                batch: list[_Op] = [first]  # type: ignore[list-item]
                stop = False
                while len(batch) < MAX_BATCH_OPS:
                    try:
                        nxt = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if nxt is _STOP:
                        stop = True
                        break
                    batch.append(nxt)  # type: ignore[arg-type]
                self._complete(batch, self._run_batch(lane, batch))
                if stop:
                    return
        finally:
            lane.release()

    def _run_batch(self, lane: _Lane, ops: list[_Op], isolated: int = 0) -> list[tuple[bool, Any]]:
        """Run `ops` in one transaction, retrying lost connections; isolate failing operations.

        A transition that raises rolls the transaction back; the others then commit without it
        and it runs again alone, after them. After MAX_BATCH_ISOLATIONS such reruns (each repeats
        the operations before the failing one), the rest run alone. A database error in a pipeline
        cannot be pinned on one operation, and a lock wait or deadlock between two batches is
        broken by the batch's lock timeout: then each operation runs alone.
        """
        delay = 0.01
        for attempt in range(1, MAX_OP_TRIES + 1):
            try:
                return [(True, value) for value in self._transact(lane, ops)]
            except _OpFailed as failed:
                if len(ops) == 1:
                    return [(False, failed.error)]
                i = failed.index
                others = ops[:i] + ops[i + 1:]
                if isolated >= MAX_BATCH_ISOLATIONS:
                    rest = self._each_alone(lane, others)
                else:
                    rest = self._run_batch(lane, others, isolated + 1)
                return [*rest[:i], *self._run_batch(lane, [ops[i]]), *rest[i:]]
            except _OutcomeUnknown as unknown:
                return [(False, unknown.error)] * len(ops)
            except (pg_errors.SerializationFailure, pg_errors.DeadlockDetected, pg_errors.LockNotAvailable) as exc:
                if len(ops) > 1:
                    return self._each_alone(lane, ops)
                if attempt == MAX_OP_TRIES:
                    return [(False, exc)]
            except psycopg.OperationalError as exc:
                # The connection dropped (server restart, pg_terminate_backend, network) before
                # COMMIT, or during it and the transaction did not commit: run it again.
                if attempt == MAX_OP_TRIES:
                    return [(False, exc)] * len(ops)
                log.warning("database connection lost (try %d of %d); retrying", attempt, MAX_OP_TRIES)
            except psycopg.Error as exc:
                if len(ops) > 1:
                    return self._each_alone(lane, ops)
                return [(False, exc)]
            except BaseException as exc:  # the lane must survive to serve the others
                return [(False, exc)] * len(ops)
            time.sleep(delay)
            delay = min(delay * 2, 1.0)
        raise AssertionError("unreachable")

    def _each_alone(self, lane: _Lane, ops: list[_Op]) -> list[tuple[bool, Any]]:
        return [result for op in ops for result in self._run_batch(lane, [op])]

    def _transact(self, lane: _Lane, ops: list[_Op]) -> list[Any]:
        """One transaction running `ops` in order; their results, once committed."""
        conn, pipeline = lane.open()
        db = _PgDb(conn, pipeline)
        results: list[Any] = []
        commit_sent = False
        xid: str | None = None
        try:
            db.sender.execute("BEGIN")
            early_xid = self._ask_xid_early(db, ops)
            if len(ops) > 1:
                db.sender.execute(f"SET LOCAL lock_timeout = {BATCH_LOCK_TIMEOUT_MS}")
            for index, op in enumerate(ops):
                try:
                    results.append(run_op(op.fn, db))
                except psycopg.Error:
                    raise
                except Exception as exc:
                    raise _OpFailed(index, exc) from exc
            # Operations marked as writes that wrote nothing (a poll without news) need neither.
            writes = [(op, result) for op, result in zip(ops, results, strict=True) if op.write] if db.wrote else []
            if writes and all(not op.durable and not _hands_out_leases(result) for op, result in writes):
                # Set at the end: the setting in force at COMMIT is the one that counts.
                db.sender.execute("SET LOCAL synchronous_commit = off")
            if early_xid is not None:
                row = early_xid.fetchone()  # its reply came with the first one a statement waited for
                xid = None if row is None else row[0]
            elif writes:
                # Also collects the replies (and errors) of statements still in the pipeline.
                row = db.reader.execute("SELECT pg_current_xact_id_if_assigned()::text", prepare=True).fetchone()
                xid = None if row is None else row[0]
            commit_sent = True
            db.sender.execute("COMMIT")
            pipeline.sync()
            return results
        except BaseException as exc:
            # The connection dropped during COMMIT: ask the server, never apply it twice. Not only
            # when psycopg already calls it broken: a FATAL (pg_terminate_backend) arrives before
            # the closed socket, and the backend may have committed before it ended.
            ambiguous = commit_sent and isinstance(exc, psycopg.OperationalError)
            if conn.broken or ambiguous:
                lane.release()  # also frees its pool slot for _committed's connection
            else:
                lane.rollback()
            if ambiguous:
                committed = True if xid is None else self._committed(xid)
                if committed:
                    return results
                if committed is None:
                    raise _OutcomeUnknown(exc) from exc
            for undo in reversed(db.undo):
                undo()
            raise

    @staticmethod
    def _ask_xid_early(db: _PgDb, ops: list[_Op]) -> psycopg.Cursor[Any] | None:
        """For a batch with a durable write (a Step's commit, a heartbeat, a client's change), which
        will write: take its transaction ID at once. The reply travels with the first one a
        statement waits for, instead of costing a round trip of its own before COMMIT."""
        if not any(op.write and op.durable for op in ops):
            return None
        db.wrote = True
        cursor = db.conn.cursor()
        cursor.execute("SELECT pg_current_xact_id()::text", prepare=True)
        return cursor

    def _complete(self, batch: list[_Op], results: list[tuple[bool, Any]]) -> None:
        # One wake-up per event loop per batch, with its commit listeners folded in: a worker is
        # woken by commits of other origins (its own already handed it what they claimed).
        per_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[Any], bool, Any]]] = {}
        for op, (ok, value) in zip(batch, results, strict=True):
            per_loop.setdefault(op.loop, []).append((op.future, ok, value))
        origins = {op.origin for op, (ok, _) in zip(batch, results, strict=True) if ok and op.write}
        listeners: dict[asyncio.AbstractEventLoop, list[Callable[[], None]]] = {}
        if origins:
            for loop, fn in list(self._listeners):
                if origins != {fn}:
                    listeners.setdefault(loop, []).append(fn)
        for loop in per_loop.keys() | listeners.keys():
            if not loop.is_closed():
                with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                    loop.call_soon_threadsafe(_deliver, per_loop.get(loop, []), listeners.get(loop, []))

    def _committed(self, xid: str) -> bool | None:
        """Did transaction `xid` commit? None when the server cannot be asked."""
        delay = 0.01
        for _ in range(MAX_OP_TRIES * 2):
            try:
                with self._pool.connection() as conn:
                    row = conn.execute("SELECT pg_xact_status(%s::xid8)", (xid,)).fetchone()
                status = None if row is None else row[0]
                if status in ("committed", "aborted"):
                    return str(status) == "committed"
                # "in progress": its backend has not yet noticed the lost connection.
            except pg_errors.InvalidParameterValue:
                return False  # "in the future": a server crash lost it before it reached the WAL
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

    async def changed(self) -> bool:
        return await self._run(self._changed_in, write=False)

    def _listen(self) -> None:
        """Set the notified flag on every NOTIFY; reconnect after errors."""
        while not self._stop_listening.is_set():
            try:
                with psycopg.connect(self._conninfo, autocommit=True, application_name="dex_engine_listen") as conn:
                    self._configure_session(conn)
                    conn.execute(f"LISTEN {CHANNEL}")
                    self._notified.set()  # anything may have happened while not listening
                    while not self._stop_listening.is_set():
                        for _ in conn.notifies(timeout=0.5, stop_after=1):
                            self._notified.set()
                            for loop, fn in list(self._listeners):
                                if not loop.is_closed():
                                    with contextlib.suppress(RuntimeError):
                                        loop.call_soon_threadsafe(fn)
            except psycopg.Error:
                if self._stop_listening.wait(0.5):
                    return

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop_listening.set()
        for _ in self._lanes:
            self._queue.put(_STOP)
        await asyncio.to_thread(self._join_threads)
        await asyncio.to_thread(self._pool.close)

    def _join_threads(self) -> None:
        self._listener.join()
        for lane in self._lanes:
            lane.join()
        # Operations queued as the store closed: nobody will run them.
        while True:
            try:
                op = self._queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(op, _Op) and not op.loop.is_closed():
                error = RuntimeError(f"store {self.url!r} is closed")
                with contextlib.suppress(RuntimeError):
                    op.loop.call_soon_threadsafe(_deliver, [(op.future, False, error)], [])
