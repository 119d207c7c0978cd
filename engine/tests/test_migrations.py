"""Numbered migrations and the schema version, on each backend."""

from __future__ import annotations

import asyncio
import contextlib
import re
import secrets
import sqlite3
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from psycopg import sql as pg_sql

from dex_engine import Context, Flow, FlowConfig, Step, StepDecision, StoreOpenError, open_store
from dex_engine import _transitions as transitions
from dex_engine._codec import encode_json
from dex_engine._decision import Movement
from dex_engine._migrate import migration_files, statements
from dex_engine._open import shown_url
from dex_engine._records import StartRequest
from dex_engine._scheduling import movement_record

from .conftest import PgDatabases, pg_database_url
from .schema_states import pg_tables


def _version(db: object) -> int:
    row = db.one("SELECT value FROM meta WHERE key = 'schema_version'")  # type: ignore[attr-defined]
    return int(row[0])


async def test_opening_applies_every_migration_once_and_keeps_data(db_url: str) -> None:
    """A new database gets the latest schema version; reopening applies nothing again, keeps the
    data and the stream token secret; stores opened concurrently agree on one schema."""
    backend = "postgres" if db_url.startswith("postgres") else "sqlite"
    latest = migration_files(backend)[-1][0]
    first = open_store(db_url)
    try:
        assert await first.raw(_version) == latest
        await first.start_flow(StartRequest("kept", "T", b"null", FlowConfig(), None))
        secret = await first.stream_secret()
    finally:
        await first.close()
    stores = await asyncio.gather(*(asyncio.to_thread(open_store, db_url) for _ in range(3)))
    try:
        for store in stores:
            assert await store.raw(_version) == latest
            assert await store.stream_secret() == secret
            assert (await store.describe_flow("kept")).status == "running"
    finally:
        for store in stores:
            await store.close()


async def test_a_current_database_without_a_stream_token_secret_gets_one_when_opened(db_url: str) -> None:
    """A database at the latest schema whose stream token secret row is gone (a hand-edited meta
    table, a restore of the tables alone): opening it creates a new secret, so stream resume tokens
    work. Catches: a file at the latest schema taken as up to date, its first stream call failing
    with an assertion about an unmigrated database."""
    first = open_store(db_url)
    try:
        await first.raw(lambda db: db.run("DELETE FROM meta WHERE key = 'stream_token_secret'"), write=True)
    finally:
        await first.close()
    again = open_store(db_url)
    try:
        assert len(await again.stream_secret()) == 32
    finally:
        await again.close()


async def test_stores_opened_at_once_on_a_new_database_migrate_it_once(db_url: str) -> None:
    """Several processes starting at once on an empty database (a deploy of many workers) each
    open a store: one applies the migrations, the others wait for it and find the schema done, and
    all share one stream token secret. Catches migrations that race (tables created twice)."""
    backend = "postgres" if db_url.startswith("postgres") else "sqlite"
    latest = migration_files(backend)[-1][0]
    stores = await asyncio.gather(*(asyncio.to_thread(open_store, db_url) for _ in range(4)))
    try:
        assert [await store.raw(_version) for store in stores] == [latest] * 4
        assert len({await store.stream_secret() for store in stores}) == 1
    finally:
        for store in stores:
            await store.close()


async def test_a_database_a_newer_engine_migrated_is_refused_unchanged(db_url: str) -> None:
    """Opening a database whose schema version is past this engine's migrations fails with an error
    that names the database, both versions and what to do, and leaves the database as it was. Catches: an older
    engine reading rows in a newer form (task options by reference) as if it knew them."""
    backend = "postgres" if db_url.startswith("postgres") else "sqlite"
    latest = migration_files(backend)[-1][0]
    store = open_store(db_url)
    try:
        await store.raw(lambda db: db.run("UPDATE meta SET value = ? WHERE key = 'schema_version'",
                                          (str(latest + 1),)), write=True)
    finally:
        await store.close()
    newer = rf"schema is version {latest + 1}, newer than the {latest} .*upgrade"
    with pytest.raises(StoreOpenError, match=newer) as refused:
        open_store(db_url)
    # Named, as every other refusal to open names its database; a PostgreSQL URL without its password.
    named = db_url.removeprefix("sqlite:///") if backend == "sqlite" else shown_url(db_url)
    assert str(refused.value).startswith(f"{named!r}: "), refused.value
    # Read with a connection of its own: the version is still the newer one, nothing was migrated.
    if backend == "sqlite":
        conn = sqlite3.connect(db_url.removeprefix("sqlite:///"))
        try:
            assert conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone() == (str(latest + 1),)
        finally:
            conn.close()
    else:
        with psycopg.connect(db_url) as conn:
            row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
            assert row == (str(latest + 1),)


def test_migration_files_are_numbered_from_one_without_gaps() -> None:
    """Each backend's migrations are 0001, 0002, ... and every file holds statements."""
    for backend in ("sqlite", "postgres"):
        files = migration_files(backend)
        assert [n for n, _ in files] == list(range(1, len(files) + 1)), backend
        assert all(statements(sql) for _, sql in files), backend


def test_statements_ignore_comments() -> None:
    assert statements("-- a; comment\nCREATE TABLE a (x INT); -- trailing; note\n\n") == ["CREATE TABLE a (x INT)"]


def _sqlite_at_version(path: Path, version: int) -> sqlite3.Connection:
    """A new SQLite database as schema `version` left it (migrations 1 to `version`), open."""
    conn = sqlite3.connect(path, isolation_level=None)
    for number, sql in migration_files("sqlite"):
        if number > version:
            break
        for statement in statements(sql):
            conn.execute(statement)
    conn.execute("INSERT INTO meta (key, value) VALUES ('schema_version', ?)", (str(version),))
    return conn


def test_sqlite_tables_rebuilt_by_migrations_keep_their_rows(tmp_path: Path) -> None:
    """Migrations 0003-0005 (SQLite) on a database made by schema version 2: each flow's Step
    counters move into its row, and the next Step of a type gets the next number, not 1 again
    (types without one start at 1); attributes, whose table 0004 rebuilds, keep every row; stream
    positions move into the flow row, and the next event follows the last one. Catches: counters
    or positions lost by a move (execution IDs or event sequences reused), rows lost by a rebuild,
    or an old table left behind."""
    path = tmp_path / "v2.db"
    conn = _sqlite_at_version(path, 2)
    conn.execute("INSERT INTO flows (flow_id, flow_type, status, input, config, version, created_at) "
                 "VALUES ('old', 'T', 'running', x'6e756c6c', ?, 1, 0)", (encode_json(FlowConfig()),))
    conn.executemany("INSERT INTO step_counters (flow_id, step_type, n) VALUES ('old', ?, ?)",
                     [("Work", 3), ("Wait", 1)])
    conn.executemany("INSERT INTO attributes (flow_id, name, key, value) VALUES ('old', ?, ?, ?)",
                     [("Note", "", b'"kept"'), ("Notes", "a", b'"one"'), ("Notes", "b", b'"two"')])
    conn.execute("INSERT INTO streams (flow_id, stream, next_seq, first_seq, total_bytes) "
                 "VALUES ('old', 'Log', 3, 1, 10)")
    conn.executemany("INSERT INTO stream_events (flow_id, stream, seq, step_execution_id, attempt, value) "
                     "VALUES ('old', 'Log', ?, 'Work-3', 1, ?)", [(1, b'"first"'), (2, b'"second"')])
    conn.close()

    async def check() -> None:
        flow = Flow("T", [Step("Work", _noop, input_type=type(None)), Step("Other", _noop, input_type=type(None))],
                    start_step="Work")
        store = open_store(f"sqlite:///{path}")
        try:
            assert await store.raw(_version) == migration_files("sqlite")[-1][0]
            assert await store.raw(lambda db: transitions.step_counters(db, "old")) == {"Work": 3, "Wait": 1}
            for step_type in ("Work", "Other"):
                record = movement_record(flow, Movement(step_type, None))
                await store.raw(lambda db, r=record: transitions.create_task(db, "old", "T", r, 0), write=True)
            ids = await store.raw(lambda db: db.all("SELECT step_execution_id FROM tasks ORDER BY task_id"))
            assert [r[0] for r in ids] == ["Work-4", "Other-1"]
            assert await store.read_all_attributes("old") == {
                ("Note", ""): b'"kept"', ("Notes", "a"): b'"one"', ("Notes", "b"): b'"two"'}
            assert await store.stream_names("old") == ["Log"]
            await store.raw(lambda db: transitions.append_writes(db, "old", [("Log", 1000, b'"third"')],
                                                                 "Work-4", 1), write=True)
            page = await store.read_events("old", "Log", 0, 10)
            assert [(e.sequence, e.value) for e in page.events] == [
                (1, b'"first"'), (2, b'"second"'), (3, b'"third"')]
            tables = await store.raw(lambda db: db.all(
                "SELECT name FROM sqlite_master WHERE name IN ('step_counters', 'streams', 'attributes_by_key')"))
            assert tables == []
        finally:
            await store.close()

    asyncio.run(check())


async def _noop(ctx: Context, _: None) -> StepDecision:
    return StepDecision.dead_end()


def test_sqlite_history_moves_into_chained_batches_and_reads_as_before(tmp_path: Path) -> None:
    """Migration 0007 (SQLite) on a database made by schema version 6: every flow's history events
    become batches chained from its row, read back in order; the next events continue the numbering
    in a batch of their own; a read with a limit returns the newest events; the `history` view shows
    the rows as schema 6 stored them. A chain that leads into another flow's batch stops there.
    Catches: events lost or reordered by the move, a chain in the wrong order (a limit returning the
    oldest events), a head left unset (new events unreachable), a walk that crosses into another flow."""
    path = tmp_path / "v6.db"
    conn = _sqlite_at_version(path, 6)
    for flow_id, events in (("a", 3), ("b", 2)):
        conn.execute("INSERT INTO flows (flow_id, flow_type, status, input, config, version, created_at, history_seq) "
                     "VALUES (?, 'T', 'running', x'6e756c6c', ?, 1, 0, ?)",
                     (flow_id, encode_json(FlowConfig()), events))
        conn.executemany(
            "INSERT INTO history (flow_id, seq, step_type, step_execution_id, event_type, attempt, at, detail) "
            "VALUES (?, ?, 'Work', ?, 'execute_completed', 1, ?, ?)",
            [(flow_id, seq, f"Work-{seq}", 1000 + seq, f"{flow_id}{seq}") for seq in range(events, 0, -1)])
    conn.close()

    async def check() -> None:
        store = open_store(f"sqlite:///{path}")
        try:
            assert await store.raw(_version) == migration_files("sqlite")[-1][0]
            old = await store.history("a", 100)
            assert [(h.step_execution_id, h.at_ms, h.detail, h.event_type) for h in old] == [
                (f"Work-{seq}", 1000 + seq, f"a{seq}", "execute_completed") for seq in (1, 2, 3)]
            assert [h.detail for h in await store.history("b", 100)] == ["b1", "b2"]

            def two_more(db: transitions.Db) -> None:
                transitions.require_running(db, "a")
                transitions._history(db, "a", "Work", "Work-4", "step_scheduled", 0, 2000, "a4")
                transitions._history(db, "a", "Work", "Work-4", "execute_completed", 1, 2001, "a5")

            await store.raw(two_more, write=True)
            assert [h.detail for h in await store.history("a", 100)] == ["a1", "a2", "a3", "a4", "a5"]
            assert [h.detail for h in await store.history("a", 3)] == ["a3", "a4", "a5"]
            rows = await store.raw(lambda db: db.all(
                "SELECT seq, step_execution_id, event_type, attempt, at, detail FROM history "
                "WHERE flow_id = 'a' ORDER BY seq"))
            assert rows[-2:] == [(4, "Work-4", "step_scheduled", 0, 2000, "a4"),
                                 (5, "Work-4", "execute_completed", 1, 2001, "a5")]
            assert [r[0] for r in rows] == [1, 2, 3, 4, 5]
            kinds = await store.raw(lambda db: db.all("SELECT type FROM sqlite_master WHERE name = 'history'"))
            assert kinds == [("view",)]

            def cross(db: transitions.Db) -> None:  # a's oldest batch now claims b's newest before it
                b_head = db.one("SELECT history_head FROM flows WHERE flow_id = 'b'")
                db.run("UPDATE history_batches SET prev = ? WHERE flow_id = 'a' AND first_seq = 1", (b_head[0],))

            await store.raw(cross, write=True)
            assert [h.detail for h in await store.history("a", 100)] == ["a1", "a2", "a3", "a4", "a5"]
        finally:
            await store.close()

    asyncio.run(check())


@pytest.mark.parametrize("stored", ["2024.1", "", "0", "-1", "٣", None])
def test_sqlite_meta_without_a_dex_engine_schema_version_is_refused_unchanged(
    tmp_path: Path, stored: str | None,
) -> None:
    """A file with meta and flows tables whose schema_version is not one dex_engine writes (another
    application's meta table, a hand-edited one) or is missing: StoreOpenError naming the file and
    the value, saying it is not a dex_engine database; the file keeps its bytes. Catches: a bare
    ValueError from int() that names neither, and migrations applied from a version read wrongly."""
    path = tmp_path / "app.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
    if stored is not None:
        conn.execute("INSERT INTO meta VALUES ('schema_version', ?)", (stored,))
    conn.execute("CREATE TABLE flows (x)")
    conn.commit()
    conn.close()
    before = path.read_bytes()
    refusal = f"'{path}' is not a dex_engine database: its meta table's schema_version is {stored!r}, not a dex_engine"
    with pytest.raises(StoreOpenError, match=re.escape(refusal)):
        open_store(f"sqlite:///{path}")
    assert path.read_bytes() == before


@pytest.mark.parametrize(("stored", "with_flows", "why"), [
    ("2024.1", True, "its meta table's schema_version is '2024.1', not a dex_engine schema version"),
    ("17", False, "it has a meta table but no dex_engine flows table"),
    ("3", False, "it has a meta table but no dex_engine flows table"),
    (None, True, "its meta table's schema_version is None, not a dex_engine schema version"),
])
def test_postgres_meta_of_another_application_is_refused_unchanged(
    pg_database: str, stored: str | None, with_flows: bool, why: str,
) -> None:
    """A database holding another application's key/value `meta` table (a common name): StoreOpenError
    saying it is not a dex_engine database, and how to give dex_engine its own schema; nothing is
    created. Catches: int()'s bare ValueError for '2024.1', 'a newer dex_engine wrote it' for '17',
    and 'relation tasks does not exist' for '3'."""
    with psycopg.connect(pg_database, autocommit=True) as conn:
        conn.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        if stored is not None:
            conn.execute("INSERT INTO meta VALUES ('schema_version', %s)", (stored,))
        if with_flows:
            conn.execute("CREATE TABLE flows (x int)")
    before = pg_tables(pg_database)
    with pytest.raises(StoreOpenError, match=re.escape(f"is not a dex_engine database: {why}; use a database")):
        open_store(pg_database)
    assert pg_tables(pg_database) == before


@pytest.mark.parametrize(("ddl", "taken"), [
    ("CREATE TABLE tasks (id SERIAL PRIMARY KEY, title TEXT); INSERT INTO tasks (title) VALUES ('buy milk')",
     'relation "tasks"'),
    ("CREATE TABLE flows (id INT)", 'relation "flows"'),
    ("CREATE TABLE orders (id INT); CREATE INDEX tasks_ready ON orders (id)", 'relation "tasks_ready"'),
    ("CREATE FUNCTION dex_load_snapshot(p_flow TEXT, p_spec JSONB) RETURNS BYTEA LANGUAGE sql AS 'SELECT NULL::bytea'",
     'function "dex_load_snapshot"'),
])
async def test_postgres_tables_of_another_application_are_refused_unchanged(
    pg_database: str, ddl: str, taken: str,
) -> None:
    """A database without dex_engine's meta table but with another application's table, index or
    function of a name the migrations create (`tasks`, `flows`, ...): StoreOpenError naming the URL
    and the object, saying it is not a dex_engine database and how to give dex_engine its own
    schema; the database is left as it was. Catches: the server's bare 'relation "tasks" already
    exists' with advice to check the server and the user's rights, neither of which is the problem."""
    with psycopg.connect(pg_database, autocommit=True) as conn:
        conn.execute(ddl)
    before = pg_tables(pg_database)
    with pytest.raises(StoreOpenError) as refused:
        open_store(pg_database)
    assert str(refused.value).startswith(f"{shown_url(pg_database)!r} is not a dex_engine database: it already "
                                         f'holds {taken}, of another application; '), refused.value
    advice = "use a database of dex_engine's own, or a schema of its own (?options=-csearch_path%3D<schema> in the URL)"
    assert advice in str(refused.value)
    assert pg_tables(pg_database) == before
    # The advice as written works: the URL libpq refused with '=' unencoded in the value
    # ('extra key/value separator') opens the engine in a schema of its own beside the other tables.
    with psycopg.connect(pg_database, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA dex")
    await _opens(pg_database + "?options=-csearch_path%3Ddex")
    assert pg_tables(pg_database) == before


@pytest.mark.parametrize("encoding", ["LATIN1", "SQL_ASCII"])
def test_a_postgres_database_not_in_utf8_is_refused_unchanged(pg_databases: PgDatabases, encoding: str) -> None:
    """A database created with another encoding than UTF8 (an old cluster's LATIN1 default, or
    SQL_ASCII): StoreOpenError naming the encoding and how to create a UTF8 database; nothing is
    created. Catches: the store opened, and a flow ID, map key or value with a character the
    encoding lacks (on SQLite every one is kept) failing later with a bare UnicodeEncodeError, and on
    SQL_ASCII every text read back as bytes."""
    name = f"dex_t_{secrets.token_hex(6)}"
    with psycopg.connect(pg_databases.dsn, autocommit=True) as admin:
        admin.execute(pg_sql.SQL("CREATE DATABASE {} ENCODING {} TEMPLATE template0 LC_COLLATE 'C' LC_CTYPE 'C'")
                      .format(pg_sql.Identifier(name), pg_sql.Literal(encoding)))
    url = pg_database_url(pg_databases.dsn, name)
    try:
        with pytest.raises(StoreOpenError) as refused:
            open_store(url)
        assert str(refused.value) == (
            f"cannot open {shown_url(url)!r} as a dex_engine database: its encoding is {encoding}, which cannot hold "
            "every character of the flow IDs, names and errors dex_engine stores; use a database created with "
            "ENCODING 'UTF8' (CREATE DATABASE <name> ENCODING 'UTF8' TEMPLATE template0)")
        assert pg_tables(url) == []
    finally:
        with psycopg.connect(pg_databases.dsn, autocommit=True) as admin:
            admin.execute(pg_sql.SQL("DROP DATABASE {} WITH (FORCE)").format(pg_sql.Identifier(name)))


def test_a_store_opened_while_another_migrates_a_large_file_waits_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Processes starting together on a database an older dex_engine made: one migrates it, and a
    migration of a large file (schema 7 rewrote every history row: about a minute for 9 million)
    holds the write lock longer than SQLite's busy timeout. The others wait for it and open the
    migrated file. Catches: every process but the migrating one refused with 'database is locked'
    and advice about the URL and the directory. Here the busy timeout is cut to 0.2 s and a
    connection of the test plays the migrating process, holding the lock for 1 s."""
    monkeypatch.setattr("dex_engine._sqlite_store.SQLITE_BUSY_TIMEOUT_MS", 200)
    latest = migration_files("sqlite")[-1][0]
    path = tmp_path / "old.db"
    migrating = _sqlite_at_version(path, latest - 1)
    migrating.execute("PRAGMA journal_mode = WAL")
    migrating.execute("BEGIN IMMEDIATE")
    with ThreadPoolExecutor(1) as pool:
        opening = pool.submit(open_store, f"sqlite:///{path}")
        time.sleep(1.0)
        assert not opening.done(), opening.exception()
        number, sql = migration_files("sqlite")[-1]
        for statement in statements(sql):
            migrating.execute(statement)
        migrating.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(number),))
        migrating.execute("COMMIT")
        store = opening.result(timeout=30)
    migrating.close()
    try:
        assert asyncio.run(store.raw(_version)) == latest
    finally:
        asyncio.run(store.close())


@contextlib.contextmanager
def _pg_role(database_url: str) -> Iterator[str]:
    """A login role of its own for one test (roles are the server's, not the database's), dropped after."""
    role = f"dex_role_{secrets.token_hex(4)}"
    with psycopg.connect(database_url, autocommit=True) as admin:
        admin.execute(pg_sql.SQL("CREATE ROLE {} LOGIN").format(pg_sql.Identifier(role)))
    try:
        yield role
    finally:
        with psycopg.connect(database_url, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (role,))
            admin.execute(pg_sql.SQL("DROP OWNED BY {}").format(pg_sql.Identifier(role)))
            admin.execute(pg_sql.SQL("DROP ROLE {}").format(pg_sql.Identifier(role)))


def _as_role(database_url: str, role: str) -> str:
    parts = urlsplit(database_url)
    return urlunsplit(parts._replace(netloc=f"{role}@{parts.hostname}:{parts.port}"))


async def _opens(url: str) -> None:
    store = open_store(url)
    try:
        await store.start_flow(StartRequest("f", "T", b"null", FlowConfig(), None))
    finally:
        await store.close()


async def test_postgres_user_who_may_not_create_tables_is_told_what_to_grant(pg_database: str) -> None:
    """A role without CREATE on the schema: StoreOpenError naming the GRANT that lets it create the
    engine's tables, which, run, does. Catches the old advice for every failure ('the server must
    be running, and the URL's user able to create tables') that named no statement."""
    with _pg_role(pg_database) as role:
        url = _as_role(pg_database, role)
        with psycopg.connect(pg_database, autocommit=True) as admin:
            admin.execute(pg_sql.SQL("GRANT USAGE ON SCHEMA public TO {}").format(pg_sql.Identifier(role)))
        grant = f"GRANT CREATE ON SCHEMA public TO {role}"
        with pytest.raises(StoreOpenError, match=re.escape(f"{role} may not create tables there: as the schema's "
                                                           f"owner run {grant},")):
            open_store(url)
        assert pg_tables(pg_database) == []
        with psycopg.connect(pg_database, autocommit=True) as admin:
            admin.execute(grant)
        await _opens(url)


async def test_postgres_user_of_tables_another_role_created_is_told_what_to_grant(pg_database: str) -> None:
    """The engine's tables made by another role (a deploy user) and a worker's role without rights
    on them: StoreOpenError saying so, naming the GRANTs, which, run, let it work."""
    store = open_store(pg_database)
    await store.close()
    with _pg_role(pg_database) as role:
        url = _as_role(pg_database, role)
        with psycopg.connect(pg_database, autocommit=True) as admin:
            admin.execute(pg_sql.SQL("GRANT USAGE ON SCHEMA public TO {}").format(pg_sql.Identifier(role)))
        with pytest.raises(StoreOpenError, match=re.escape("its dex_engine tables belong to another role: connect as "
                                                           "that role, or as it run GRANT SELECT")) as refused:
            open_store(url)
        # Run as written: the advice names the schema, not a placeholder to fill in.
        grants = re.findall(r"GRANT [A-Z, ]+ ON ALL [A-Z]+ IN SCHEMA public TO [^ ]+? ", str(refused.value))
        assert len(grants) == 2, refused.value
        for grant in grants:
            with psycopg.connect(pg_database, autocommit=True) as admin:
                admin.execute(grant)
        await _opens(url)


def test_postgres_database_that_does_not_exist_is_named_with_how_to_create_it(pg_database: str) -> None:
    """A URL naming a database the server does not have (a typo, a database not created yet):
    StoreOpenError naming it and the CREATE DATABASE to run, not advice about creating tables."""
    parts = urlsplit(pg_database)
    missing = f"dex_missing_{secrets.token_hex(4)}"
    url = urlunsplit(parts._replace(path=f"/{missing}"))
    with pytest.raises(StoreOpenError, match=re.escape(f"the server has no database '{missing}': create it "
                                                       f"(CREATE DATABASE {missing}) or correct the URL")):
        open_store(url)
