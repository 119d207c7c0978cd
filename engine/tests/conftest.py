"""Shared fixtures: a private database file per test, an in-process worker with short timings."""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import secrets
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest

from dex_engine import AsyncClient, AsyncWorker, Registry, Store, WorkerOptions, open_store

# Test timings: leases expire in 1 s, housekeeping runs about every 0.1 s.
FAST = WorkerOptions(
    database_url="unused",
    lease_ttl_seconds=1.0,
    lease_renew_seconds=0.25,
    housekeeping_seconds=0.1,
    poll_seconds=0.01,
    shutdown_grace_seconds=1.0,
)


def backend_urls(tmp_path: Path) -> list[str]:
    return [f"sqlite:///{tmp_path / 'engine.db'}"]


# Why the postgres param of `db_url` skips when no server is configured; the terminal summary counts
# skips with this reason and warns, so a run that never touched PostgreSQL cannot pass unnoticed.
NO_PG_REASON = "TEST_PG_DSN is not set: PostgreSQL backend not tested"
SQLITE_ONLY_REASON = "SQLite-specific"


def pg_database_url(dsn: str, dbname: str) -> str:
    """`dsn` (a postgresql:// URL) naming database `dbname` instead of its own."""
    parts = urlsplit(dsn)
    if parts.scheme not in ("postgresql", "postgres"):
        raise ValueError(f"TEST_PG_DSN must be a postgresql:// URL, not {dsn!r}")
    return urlunsplit(parts._replace(path=f"/{dbname}"))


# Schemas every database has; anything else in a given-back database was made by a test.
_SYSTEM_SCHEMAS = "('pg_catalog', 'information_schema', 'pg_toast')"
_EMPTY_DATABASE_PROBES = [
    f"SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
    f" WHERE n.nspname NOT IN {_SYSTEM_SCHEMAS} AND n.nspname NOT LIKE 'pg\\_%'",
    f"SELECT count(*) FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace"
    f" WHERE n.nspname NOT IN {_SYSTEM_SCHEMAS} AND n.nspname NOT LIKE 'pg\\_%'",
    f"SELECT count(*) FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace"
    f" WHERE n.nspname NOT IN {_SYSTEM_SCHEMAS} AND n.nspname NOT LIKE 'pg\\_%'",
    "SELECT count(*) FROM pg_extension WHERE extname <> 'plpgsql'",
    "SELECT count(*) FROM pg_largeobject_metadata",
    "SELECT count(*) FROM pg_namespace WHERE nspname NOT IN "
    + _SYSTEM_SCHEMAS
    + " AND nspname NOT LIKE 'pg\\_%' AND nspname <> 'public'",
]
_RESET_DATABASE = f"""
DO $$
DECLARE s text;
BEGIN
    FOR s IN SELECT nspname FROM pg_namespace
             WHERE nspname NOT IN {_SYSTEM_SCHEMAS} AND nspname NOT LIKE 'pg\\_%'
    LOOP
        EXECUTE format('DROP SCHEMA %I CASCADE', s);
    END LOOP;
END $$;
CREATE SCHEMA public AUTHORIZATION pg_database_owner;
GRANT USAGE ON SCHEMA public TO PUBLIC;
SELECT lo_unlink(oid) FROM pg_largeobject_metadata;
"""


class PgDatabases:
    """Empty databases on one PostgreSQL server, one per test, each under a name no test used before.

    CREATE DATABASE copies template1 with fsync on: 1 to 3 s on the CI machine, longer than most
    tests. So a test's database is, after it, disconnected (every session terminated), renamed to a
    new random name (a pool a test left open can no longer reach it: reconnecting by the old name
    fails, as it would after a DROP), emptied (every schema dropped, `public` recreated, database
    settings reset), checked empty, and handed to the next test. One that cannot be emptied is
    dropped. With DEX_PG_FRESH_DB=1 every test gets a database made by CREATE DATABASE instead,
    dropped after it. All of them are dropped (WITH (FORCE)) at the end of the session.
    """

    def __init__(self, dsn: str) -> None:
        pg_database_url(dsn, "check")  # reject a DSN that is not a URL before any test runs
        self.dsn = dsn
        self.fresh = os.environ.get("DEX_PG_FRESH_DB", "") not in ("", "0")
        self.free: list[str] = []  # emptied, renamed, unused since
        self.owned: set[str] = set()  # every database of ours that exists

    def _admin(self) -> Any:
        import psycopg

        # CREATE/DROP/ALTER DATABASE cannot run in a transaction block: autocommit.
        return psycopg.connect(self.dsn, autocommit=True)

    def take(self) -> str:
        """The name of an empty database no test has seen."""
        if self.free:
            return self.free.pop()
        from psycopg import sql

        name = f"dex_t_{secrets.token_hex(6)}"
        with self._admin() as admin:
            admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        self.owned.add(name)
        return name

    def give_back(self, name: str) -> None:
        """End everything a test left on `name`; keep the database for another test, or drop it."""
        if self.fresh:
            self._drop(name)
            return
        import psycopg
        from psycopg import errors, sql

        new_name = f"dex_t_{secrets.token_hex(6)}"
        with self._admin() as admin:
            for _ in range(10):
                # Wait (up to 5 s each) for each session to end: a pool reconnects, so loop until
                # the rename finds no session left.
                admin.execute(
                    "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity"
                    " WHERE datname = %s AND pid <> pg_backend_pid()",
                    (name,),
                )
                try:
                    admin.execute(
                        sql.SQL("ALTER DATABASE {} RENAME TO {}").format(sql.Identifier(name), sql.Identifier(new_name))
                    )
                    break
                except errors.ObjectInUse:
                    continue
            else:
                self._drop(name)
                return
        self.owned.discard(name)
        self.owned.add(new_name)
        with psycopg.connect(pg_database_url(self.dsn, new_name), autocommit=True) as conn:
            conn.execute(_RESET_DATABASE)
            conn.execute(sql.SQL("ALTER DATABASE {} RESET ALL").format(sql.Identifier(new_name)))
            leftovers = [probe for probe in _EMPTY_DATABASE_PROBES if conn.execute(probe).fetchone() != (0,)]
        if leftovers:
            self._drop(new_name)
            return
        self.free.append(new_name)

    def _drop(self, name: str) -> None:
        from psycopg import sql

        with self._admin() as admin:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
        self.owned.discard(name)

    def close(self) -> None:
        for name in sorted(self.owned):
            self._drop(name)


@pytest.fixture(scope="session")
def pg_databases() -> Iterator[PgDatabases]:
    dsn = os.environ.get("TEST_PG_DSN")
    if not dsn:
        pytest.skip(NO_PG_REASON)
    databases = PgDatabases(dsn)
    try:
        yield databases
    finally:
        databases.close()


@pytest.fixture
def pg_database(pg_databases: PgDatabases) -> Iterator[str]:
    """The URL of an empty PostgreSQL database on TEST_PG_DSN's server, for this test alone."""
    name = pg_databases.take()
    try:
        yield pg_database_url(pg_databases.dsn, name)
    finally:
        pg_databases.give_back(name)


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The URL of an empty database of each backend: a private SQLite file, or a fresh PostgreSQL
    database (TEST_PG_DSN's server). Tests marked `sqlite_only` skip the postgres param."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'engine.db'}"
    if request.node.get_closest_marker("sqlite_only") is not None:
        pytest.skip(SQLITE_ONLY_REASON)
    url: str = request.getfixturevalue("pg_database")
    return url


@pytest.hookimpl(tryfirst=True)  # before `-k` deselects: it matches the marker's name
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark `postgres` every test that takes a PostgreSQL database, so `-k postgres` selects all of
    them and `-k "not postgres"` leaves them out, as docs/testing.md says; `db_url`'s postgres
    param has it in its ID already. A module that needs a server of its own marks itself."""
    for item in items:
        if "pg_databases" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.postgres)


def pytest_report_header(config: pytest.Config) -> str:
    dsn = os.environ.get("TEST_PG_DSN")
    if not dsn:
        return f"PostgreSQL backend: NOT TESTED ({NO_PG_REASON}; start one with .ci/pg-start)"
    parts = urlsplit(dsn)
    return f"PostgreSQL backend: {parts.hostname}:{parts.port or 5432} (TEST_PG_DSN), a fresh database per test"


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """Warn loudly at the end of the run when PostgreSQL tests were skipped because TEST_PG_DSN is unset."""
    skipped = [
        report
        for report in terminalreporter.stats.get("skipped", [])
        if isinstance(report.longrepr, tuple) and NO_PG_REASON in str(report.longrepr[2])
    ]
    if not skipped:
        return
    terminalreporter.write_sep(
        "!", f"WARNING: {len(skipped)} PostgreSQL test(s) skipped: {NO_PG_REASON}", yellow=True, bold=True
    )
    terminalreporter.write_line(
        'Only SQLite was tested. To test PostgreSQL too: export TEST_PG_DSN="$(.ci/pg-start | tail -n 1)"',
        yellow=True,
        bold=True,
    )


class Engine:
    """A store, a client and (optionally) an in-process worker on one database."""

    def __init__(self, store: Store, registry: Registry) -> None:
        self.store = store
        self.registry = registry
        self.client = AsyncClient(registry, store=store)
        self.worker: AsyncWorker | None = None

    async def start_worker(self, **overrides: Any) -> AsyncWorker:
        opts = WorkerOptions(**{**FAST.__dict__, "database_url": self.store.url, **overrides})
        worker = AsyncWorker(self.registry, opts, store=self.store)
        await worker.__aenter__()
        self.worker = worker
        return worker


@asynccontextmanager
async def engine_for(db_url: str, registry: Registry, *, worker: bool = True) -> AsyncIterator[Engine]:
    store = open_store(db_url)
    eng = Engine(store, registry)
    try:
        if worker:
            await eng.start_worker()
        yield eng
    finally:
        if eng.worker is not None:
            await eng.worker.stop()
        await store.close()


def stop_while_a_claim_lands(
    worker: AsyncWorker, monkeypatch: pytest.MonkeyPatch, lag: float, wanted: Callable[[list[Any]], bool],
) -> list[tuple[list[Any], asyncio.Task[None]]]:
    """From now on, the first claim a client's commit makes for `worker` whose leases are `wanted`
    starts `worker.stop()` and lands (local_claim_done) only `lag` seconds later: a stop that comes
    while the claim is in flight. Returns [(those leases, the stop's task)] once it happened."""
    real = worker.local_claim_done
    stopped: list[tuple[list[Any], asyncio.Task[None]]] = []

    def in_flight_at_stop(token: int, leases: list[Any] | None, capacity: int) -> None:
        if stopped or not leases or not wanted(leases):
            real(token, leases, capacity)
            return
        stopped.append((leases, asyncio.create_task(worker.stop())))
        asyncio.get_running_loop().call_later(lag, real, token, leases, capacity)

    monkeypatch.setattr(worker, "local_claim_done", in_flight_at_stop)
    return stopped


def assert_paced(times: Sequence[float], pause: float, most: float = math.inf) -> None:
    """Consecutive `times` (time.monotonic()) lie at least `pause` apart, and less than `most`.
    asyncio may wake a timer up to its clock's resolution early: a tenth of the pause is ample."""
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert all(pause * 0.9 <= gap < most for gap in gaps), gaps


async def close_twice(store: Store, still: str) -> tuple[asyncio.Future[None], asyncio.Future[None]]:
    """Start two closes of `store` at once and check the second has not returned while the first
    is held (`still` says what holds it); the two futures, for the caller to await once released."""
    first = asyncio.ensure_future(store.close())
    await asyncio.sleep(0)
    second = asyncio.ensure_future(store.close())
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert not second.done(), f"a second close returned while {still}"
    return first, second


async def wait_until(description: str, probe: Callable[[], Awaitable[Any]], timeout: float = 10.0) -> Any:
    """Poll `probe` until it returns a truthy value; fail naming `description` after `timeout`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = await probe()
        if value:
            return value
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {description}; last value {value!r}")
        await asyncio.sleep(0.01)


async def statements_during(store: Store, action: Callable[[], Awaitable[object]]) -> list[str]:
    """The SQL an SQLite store's connection ran while `action` ran (its trace callback, removed after)."""
    statements: list[str] = []
    await store.raw(lambda db: db.conn.set_trace_callback(statements.append))
    try:
        await action()
    finally:
        await store.raw(lambda db: db.conn.set_trace_callback(None))
    return statements


def history_fallbacks(statements: list[str]) -> list[str]:
    """Those of an SQLite operation's statements that number its history again or read the flow
    row back (flush_history's fallback): none when the operation followed its flow row exactly."""
    return [s for s in statements
            if (s.startswith("DELETE") and "last_insert_rowid()" in s) or "RETURNING history_seq" in s]


async def run_as_one_batch(store: Store, ops: Sequence[Callable[[Any], object]]) -> list[object]:
    """Run write operations on an SQLite store's thread as one batch (one group commit): a slow
    operation holds the thread until all of `ops` are queued behind it. Each op's result, or the
    exception it raised."""
    entered, release = threading.Event(), threading.Event()

    def slow(_db: object) -> None:
        entered.set()
        release.wait(30)

    # From another thread, so it queues to the store's thread (run on this idle loop, it would
    # block the loop instead).
    slow_task = asyncio.ensure_future(asyncio.to_thread(store.run_sync, slow, write=True))  # type: ignore[attr-defined]
    await asyncio.to_thread(entered.wait, 30)
    queued_ops = asyncio.gather(*(store.raw(op, write=True) for op in ops), return_exceptions=True)

    async def queued() -> bool:
        return int(store._queue.qsize()) >= len(ops)  # type: ignore[attr-defined]

    await wait_until(f"the {len(ops)} ops queued behind a slow one", queued)  # whatever the machine's speed
    release.set()
    results = list(await queued_ops)
    await slow_task
    return results


async def history_has(eng: Engine, flow_id: str, event: str, step_execution_id: str) -> bool:
    """Whether the flow's history has `event` for that Step execution (a wait_until probe)."""
    return any(h.event_type == event and h.step_execution_id == step_execution_id
               for h in await eng.client.get_flow_history(flow_id))
