"""The PostgreSQL store: many worker processes on many hosts sharing one database.

Each operation runs as one transaction on a pooled connection, on a small thread pool (the
transitions are synchronous code). Writers to one flow serialize on its row (`FOR UPDATE`);
claims skip rows other transactions hold (`FOR UPDATE SKIP LOCKED`), so workers never wait on
each other's claims. Commits that make work ready send `NOTIFY dex_engine`; every worker process
LISTENs on a dedicated connection and also polls, so a missed notification costs one poll interval.
A dropped connection is replaced and the operation retried; so are deadlocks and serialization
failures, which PostgreSQL resolves by aborting one side.

Durability: a SYNC Step commits with `synchronous_commit = on` (the server default); an ASYNC Step
with `synchronous_commit = off`, which survives a client or server process crash but may lose the
last commits if the server's machine loses power.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from ._migrate import apply_pending
from ._store import Store, commit_origin
from ._transitions import Db, HistoryRow, Row, run_op

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
# Connections per process: enough for a worker's concurrent commits, heartbeats and polls.
DEFAULT_POOL_SIZE = 16
# Tries of one operation on a dropped connection, deadlock or serialization failure.
MAX_OP_TRIES = 8
# Without a notification, report a change at least this often so claims fall back to polling.
FALLBACK_POLL_SECONDS = 1.0
# Migrations of concurrent processes serialize on this advisory lock.
MIGRATION_LOCK_KEY = 0x6465786D  # "dexm"

_PLACEHOLDER = re.compile(r"\?")


def _to_pg(sql: str, cache: dict[str, str] = {}) -> str:  # noqa: B006 - a deliberate per-process cache
    converted = cache.get(sql)
    if converted is None:
        converted = cache[sql] = _PLACEHOLDER.sub("%s", sql.replace("%", "%%"))
    return converted


class _PgDb:
    __slots__ = ("conn", "history", "notified")

    for_update = " FOR UPDATE"
    skip_locked = " FOR UPDATE SKIP LOCKED"

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn
        self.history: list[HistoryRow] = []
        self.notified = False

    def one(self, sql: str, params: Sequence[Any] = ()) -> Row | None:
        row: Row | None = self.conn.execute(_to_pg(sql), params, prepare=True).fetchone()
        return row

    def all(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        return self.conn.execute(_to_pg(sql), params, prepare=True).fetchall()

    def run(self, sql: str, params: Sequence[Any] = ()) -> int:
        return self.conn.execute(_to_pg(sql), params, prepare=True).rowcount

    def notify(self) -> None:
        if not self.notified:  # one per transaction; PostgreSQL folds duplicates anyway
            self.conn.execute(f"NOTIFY {CHANNEL}")
            self.notified = True


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
        self._closed = False
        with psycopg.connect(url, autocommit=True) as conn:
            migrate(conn)
        self._pool: psycopg_pool.ConnectionPool[Any] = psycopg_pool.ConnectionPool(
            url, min_size=1, max_size=pool_size, open=True, name="dex-engine",
            kwargs={"application_name": "dex_engine"}, check=psycopg_pool.ConnectionPool.check_connection,
        )
        self._executor = ThreadPoolExecutor(max_workers=pool_size, thread_name_prefix="dex-pg")
        self._listeners: list[tuple[asyncio.AbstractEventLoop, Callable[[], None]]] = []
        self._notified = threading.Event()
        self._last_change_report = 0.0
        self._stop_listening = threading.Event()
        self._listener = threading.Thread(target=self._listen, name="dex-pg-listen", daemon=True)
        self._listener.start()

    # Operations ---------------------------------------------------------------------------

    async def _run(self, fn: Callable[[Db], R], *, write: bool, durable: bool | None = None) -> R:
        if self._closed:
            raise RuntimeError(f"store {self.url!r} is closed")
        loop = asyncio.get_running_loop()
        origin = commit_origin.get()
        result = await loop.run_in_executor(self._executor, self._run_sync, fn, durable is not False)
        if write:
            for listener_loop, fn_ in list(self._listeners):
                if fn_ is not origin and not listener_loop.is_closed():
                    listener_loop.call_soon_threadsafe(fn_)
        return result

    def _run_sync(self, fn: Callable[[Db], R], durable: bool) -> R:
        delay = 0.01
        for attempt in range(1, MAX_OP_TRIES + 1):
            try:
                with self._pool.connection() as conn, conn.transaction():
                    if not durable:
                        conn.execute("SET LOCAL synchronous_commit = off")
                    return run_op(fn, _PgDb(conn))
            except (pg_errors.SerializationFailure, pg_errors.DeadlockDetected):
                if attempt == MAX_OP_TRIES:
                    raise
            except psycopg.OperationalError:
                # The connection dropped (server restart, pg_terminate_backend, network). The pool
                # replaces it; the operation runs again. If it had committed, fencing makes the
                # repeat harmless (StaleAttemptError) or visible (FlowAlreadyStartedError).
                if attempt == MAX_OP_TRIES:
                    raise
                log.warning("database connection lost (try %d of %d); retrying", attempt, MAX_OP_TRIES)
            time.sleep(delay)
            delay = min(delay * 2, 1.0)
        raise AssertionError("unreachable")

    def _changed_in(self, db: Db) -> bool:
        # A notification arrived, or it is time for the fallback poll.
        now = time.monotonic()
        if self._notified.is_set() or now - self._last_change_report >= FALLBACK_POLL_SECONDS:
            self._notified.clear()
            self._last_change_report = now
            return True
        return False

    async def changed(self) -> bool:
        return await self._run(self._changed_in, write=False)

    def _listen(self) -> None:
        """Set the notified flag on every NOTIFY; reconnect after errors."""
        while not self._stop_listening.is_set():
            try:
                with psycopg.connect(self.url, autocommit=True, application_name="dex_engine_listen") as conn:
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
        await asyncio.to_thread(self._listener.join)
        self._executor.shutdown(wait=True)
        await asyncio.to_thread(self._pool.close)
