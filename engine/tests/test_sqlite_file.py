"""The SQLite store's file and thread: what opening a URL creates, and what closing the store ends."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from dex_engine import (
    AsyncWorker,
    Context,
    DatabaseFileReplacedError,
    Flow,
    FlowConfig,
    Registry,
    Step,
    StepDecision,
    StoreOpenError,
    WorkerOptions,
    open_store,
)
from dex_engine._records import StartRequest
from dex_engine._sqlite_store import SqliteStore, parse_sqlite_url
from dex_engine._transitions import Db

from .conftest import close_twice, wait_until


async def test_opening_a_url_in_missing_directories_creates_them_and_a_wal_file(tmp_path: Path) -> None:
    """A first deployment names a path under directories nobody made yet: they are created, and the
    file is in WAL mode with the engine's schema, ready for a flow."""
    path = tmp_path / "not" / "yet" / "there" / "engine.db"
    store = open_store(f"sqlite:///{path}")
    try:
        await store.start_flow(StartRequest("f1", "T", b"null", FlowConfig(), None))
        assert (await store.describe_flow("f1")).status == "running"
    finally:
        await store.close()
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


async def test_stores_opening_a_new_file_at_once_all_open_it(tmp_path: Path) -> None:
    """A deploy starts many workers at once on a file nobody created yet: every one opens it, in
    WAL mode. Rounds of six at once: a store losing the race to convert the file gets SQLITE_BUSY
    at once from SQLite (its busy handler not called), in about one round in sixty. Catches a store
    that gives up on that instead of trying the switch again."""
    for round_ in range(ROUNDS_OF_OPENERS):
        path = tmp_path / f"engine{round_}.db"
        results = await asyncio.gather(
            *(asyncio.to_thread(open_store, f"sqlite:///{path}") for _ in range(OPENERS_AT_ONCE)),
            return_exceptions=True,
        )
        for store in results:
            if not isinstance(store, BaseException):
                await store.close()
        assert not [r for r in results if isinstance(r, BaseException)], f"round {round_}: {results}"
        with contextlib.closing(sqlite3.connect(path)) as conn:
            assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


ROUNDS_OF_OPENERS = 25
OPENERS_AT_ONCE = 6


def busy_wal_switches(monkeypatch: pytest.MonkeyPatch, fails: int, code: int = sqlite3.SQLITE_BUSY) -> list[str]:
    """Make the next `fails` WAL switches of the stores' connections fail as a losing racer's does
    (OperationalError with `code`, at once); returns the list each try is noted in."""
    tries: list[str] = []
    left = [fails]

    class RacedConnection(sqlite3.Connection):
        def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
            if sql.startswith("PRAGMA journal_mode"):
                tries.append(sql)
                if left[0] > 0:
                    left[0] -= 1
                    exc = sqlite3.OperationalError("database is locked")
                    exc.sqlite_errorcode = code
                    raise exc
            return super().execute(sql, *args)

    real = sqlite3.connect
    monkeypatch.setattr(sqlite3, "connect", lambda *a, **k: real(*a, factory=RacedConnection, **k))
    return tries


async def test_a_wal_switch_refused_as_busy_is_tried_again_until_it_takes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store whose switch to WAL mode meets SQLITE_BUSY tries again, and opens once it takes."""
    tries = busy_wal_switches(monkeypatch, fails=3)
    store = open_store(f"sqlite:///{tmp_path / 'engine.db'}")
    try:
        await store.start_flow(StartRequest("f1", "T", b"null", FlowConfig(), None))
    finally:
        await store.close()
    assert len(tries) == 4
    monkeypatch.undo()
    with contextlib.closing(sqlite3.connect(tmp_path / "engine.db")) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


@pytest.mark.parametrize("code", [sqlite3.SQLITE_BUSY, sqlite3.SQLITE_IOERR])
def test_a_wal_switch_that_keeps_failing_is_refused_naming_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    """SQLITE_BUSY past the busy timeout (a tenth of a second here), or any other error at once:
    StoreOpenError naming the file and SQLite's reason. Catches a store that waits forever on a
    file another process keeps locked, or that tries again on errors waiting cannot cure."""
    monkeypatch.setattr("dex_engine._sqlite_store.SQLITE_BUSY_TIMEOUT_MS", 100)
    tries = busy_wal_switches(monkeypatch, fails=10**9, code=code)
    path = tmp_path / "engine.db"
    with pytest.raises(StoreOpenError, match=rf"cannot open '{re.escape(str(path))}' .*database is locked"):
        open_store(f"sqlite:///{path}")
    assert len(tries) > 1 if code == sqlite3.SQLITE_BUSY else len(tries) == 1


async def test_close_ends_the_stores_thread_before_it_returns(tmp_path: Path) -> None:
    """Once close() returns the connection's thread has ended, so a caller may delete or copy the
    file at once."""
    path = tmp_path / "engine.db"
    store = open_store(f"sqlite:///{path}")
    name = f"dex-sqlite:{path}"
    assert name in {t.name for t in threading.enumerate()}
    await store.close()
    assert name not in {t.name for t in threading.enumerate() if t.is_alive()}


async def test_a_second_close_at_once_returns_only_once_the_first_has_ended_the_thread(tmp_path: Path) -> None:
    """Two tasks close one store at once (a client's shutdown and its owner's) while its thread is
    still busy: the second close returns only once the thread has ended too, since its caller may
    then delete the file. Catches: a second close that returns at once."""
    store = SqliteStore(f"sqlite:///{tmp_path / 'engine.db'}")
    conn_lock: threading.Lock = store._conn_lock
    conn_lock.acquire()
    try:
        busy = asyncio.ensure_future(asyncio.to_thread(store.run_sync, lambda db: None, write=True))

        async def taken() -> bool:  # the thread took it, and waits for the connection
            return store._outstanding == 1 and store._queue.empty()

        await wait_until("the store's thread to take the operation", taken)
        first, second = await close_twice(store, "the store's thread was still running")
    finally:
        conn_lock.release()
    await asyncio.gather(busy, first, second)
    assert not store._thread.is_alive()


@pytest.mark.parametrize("make", ["garbage", "directory", "under_a_file"])
def test_a_path_that_cannot_be_an_engine_database_is_refused_naming_it(tmp_path: Path, make: str) -> None:
    """A file that is not a database, a directory, or a path under a file: StoreOpenError naming the
    path and SQLite's or the system's reason, and a file that was there is left as it was."""
    garbage = tmp_path / "notes.txt"
    garbage.write_bytes(b"not a database, only text " * 8)
    path = {"garbage": garbage, "directory": tmp_path, "under_a_file": garbage / "engine.db"}[make]
    reason = {"garbage": "file is not a database", "directory": "unable to open database file",
              "under_a_file": "Not a directory|File exists"}[make]
    with pytest.raises(StoreOpenError, match=rf"cannot open '{re.escape(str(path))}' .*({reason})"):
        open_store(f"sqlite:///{path}")
    assert garbage.read_bytes() == b"not a database, only text " * 8
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


async def test_run_sync_runs_on_the_stores_thread_durably_and_raises_what_its_operation_raised(
    tmp_path: Path,
) -> None:
    """The tests' blocking hook: its operation runs on the store's thread, a write commits fsynced
    (synchronous FULL, 2), and an operation's exception reaches the caller instead of hanging it."""
    path = tmp_path / "engine.db"
    store = SqliteStore(f"sqlite:///{path}")
    try:
        def fails(db: Db) -> None:
            raise LookupError("the operation failed")

        with pytest.raises(LookupError, match="the operation failed"):
            await asyncio.wait_for(asyncio.to_thread(store.run_sync, fails, write=True), 10)

        def where(db: Db) -> tuple[str, int]:
            row = db.one("PRAGMA synchronous")
            assert row is not None
            return threading.current_thread().name, row[0]

        assert await asyncio.to_thread(store.run_sync, where, write=True) == (f"dex-sqlite:{path}", 2)
    finally:
        await store.close()


def _journal_mode_and_tables(path: Path) -> tuple[str, list[str]]:
    with contextlib.closing(sqlite3.connect(path)) as conn:
        mode = conn.execute("PRAGMA journal_mode").fetchone()[0]
        return mode, [r[0] for r in conn.execute("SELECT name FROM sqlite_master ORDER BY name")]


@pytest.mark.parametrize(("ddl", "why"), [
    (["CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT)", "INSERT INTO customers VALUES (1, 'alice')"],
     "its tables do not include dex_engine's meta and flows"),
    (["CREATE TABLE flows (x)"], "its tables do not include dex_engine's meta and flows"),
    # Another application's key-value meta table alone, without the engine's flows table.
    (["CREATE TABLE meta (key TEXT, value TEXT)"], "its tables do not include dex_engine's meta and flows"),
    (["CREATE TABLE meta (name TEXT)", "CREATE TABLE flows (x)"], "its meta table has no key and value columns"),
    (["CREATE VIEW v AS SELECT 1"], "its tables do not include"),
    # No tables yet, but marked by an application that set up the file and creates its tables later.
    (["PRAGMA user_version = 3"], "it has no tables, but its user_version is 3, set by another application"),
    (["PRAGMA application_id = 1296125511"],
     "it has no tables, but its application_id is 1296125511, set by another application"),
])
def test_another_applications_database_is_refused_as_it_was(tmp_path: Path, ddl: list[str], why: str) -> None:
    """A URL naming another application's SQLite database: StoreOpenError naming the file, saying it
    is not a dex_engine database and what to name instead; the file keeps its bytes and its journal
    mode, and nothing is created beside it. Catches: the engine's tables migrated into that
    application's database, or a refused file left switched to WAL."""
    path = tmp_path / "app.db"
    with contextlib.closing(sqlite3.connect(path)) as conn:
        for statement in ddl:
            conn.execute(statement)
        conn.commit()
    before = path.read_bytes()
    with pytest.raises(StoreOpenError, match=rf"'{re.escape(str(path))}' is not a dex_engine database: "
                                             rf"{re.escape(why)}.*name a new file, or one dex_engine created"):
        open_store(f"sqlite:///{path}")
    assert path.read_bytes() == before
    assert _journal_mode_and_tables(path)[0] == "delete"
    assert [p.name for p in tmp_path.iterdir()] == ["app.db"]


@pytest.mark.parametrize("content", [b"x", b"\n"], ids=["one-byte", "echo"])
def test_a_one_byte_file_is_refused_as_it_was(tmp_path: Path, content: bytes) -> None:
    """SQLite reads a one-byte file (what `echo > engine.db` leaves) as an empty database; longer
    ones it refuses itself. Such a file is not ours to write over, and is refused as it was.
    Catches: the engine's tables written over it."""
    path = tmp_path / "notes.db"
    path.write_bytes(content)
    with pytest.raises(StoreOpenError, match=rf"'{re.escape(str(path))}' is not a dex_engine database: "
                                             "it holds bytes that are not a SQLite database's"):
        open_store(f"sqlite:///{path}")
    assert path.read_bytes() == content
    assert [p.name for p in tmp_path.iterdir()] == ["notes.db"]


async def test_a_zero_byte_file_is_opened_as_a_new_database(tmp_path: Path) -> None:
    """A file that exists but holds nothing (touched by a deploy script, or left by a first open that
    created it and was killed) is a new database, not another application's: it is migrated."""
    path = tmp_path / "engine.db"
    path.touch()
    store = open_store(f"sqlite:///{path}")
    try:
        await store.start_flow(StartRequest("f1", "T", b"null", FlowConfig(), None))
    finally:
        await store.close()
    mode, tables = _journal_mode_and_tables(path)
    assert mode == "wal" and {"meta", "flows"} <= set(tables)


@pytest.mark.parametrize(("url", "part"), [
    ("sqlite:///{d}/runs#3.db", "has a '#'"),
    ("sqlite:///{d}/runs.db#", "has a '#'"),
    ("sqlite:///{d}/runs.db?synchronous=NORMAL#x", "has a '#'"),
    ("sqlite://data/engine.db", "has a host part ('data')"),
    ("sqlite://localhost/{d}/engine.db", "has a host part ('localhost')"),
    # urlparse drops these wherever they are: "a\tb/engine.db" opened ab/engine.db.
    ("sqlite:///{d}/a\tb/engine.db", "has '\\t'"),
    ("sqlite:///{d}/a\nb\r.db", "has '\\n' and '\\r'"),
])
def test_a_url_with_parts_a_url_parser_would_drop_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, url: str, part: str,
) -> None:
    """A '#' (the rest would be taken as a fragment) or a host part (one slash short of a path):
    ValueError naming the URL and the part, and no file is created. Catches: another file opened,
    and created, with no error (runs#3.db opening runs; sqlite://data/engine.db opening engine.db)."""
    monkeypatch.chdir(tmp_path)
    url = url.format(d=tmp_path)
    with pytest.raises(ValueError, match=re.escape(f"sqlite URL {url!r} {part}")) as refused:
        open_store(url)
    if "host" in part:
        assert "sqlite:///relative/path.db" in str(refused.value)
        assert "sqlite:////absolute/path.db" in str(refused.value)
    assert list(tmp_path.iterdir()) == []


async def test_a_relative_path_stays_where_it_was_opened_after_a_chdir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A store opened on a relative path in one directory, after the process changed directory (a
    daemonizing library, the application's own chdir): its quiet polls and its writes (with their
    write turn) still use the file it opened. Catches: the path resolved again on first use, which
    created a stray database and -dexlock file in the new directory."""
    opened, moved = tmp_path / "opened", tmp_path / "moved"
    opened.mkdir()
    moved.mkdir()
    monkeypatch.chdir(opened)
    store = open_store("sqlite:///engine.db")
    try:
        monkeypatch.chdir(moved)
        await store.poll("w1", ["T"], 1, [], must_claim=False, housekeep=False)
        await store.start_flow(StartRequest("f1", "T", b"null", FlowConfig(), None))
        assert (await store.describe_flow("f1")).status == "running"
    finally:
        await store.close()
    assert list(moved.iterdir()) == []
    assert {"engine.db", "engine.db-dexlock"} <= {p.name for p in opened.iterdir()}


def _remove_database_files(path: Path) -> None:
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)


def _rename(source: Path, target: Path) -> None:
    source.rename(target)


def _unlink(path: str) -> None:
    os.unlink(path)


def _exists(path: Path) -> bool:
    return path.exists()


@pytest.mark.parametrize("how", ["deleted", "replaced"])
async def test_a_file_deleted_or_replaced_under_an_open_store_refuses_writes(tmp_path: Path, how: str) -> None:
    """The database file is deleted (with its -wal and -shm), or another file renamed over it, while
    a store has it open: a write raises StoreOpenError naming the file and saying to restart, and
    writes nothing. Catches: SQLite writing on to the unlinked file, every acknowledged write lost
    at the next open while other processes used a new file at that path."""
    path = tmp_path / "e.db"
    store = open_store(f"sqlite:///{path}")
    try:
        await store.start_flow(StartRequest("before", "T", b"null", FlowConfig(), None))
        _remove_database_files(path)
        if how == "replaced":
            other = open_store(f"sqlite:///{tmp_path / 'other.db'}")
            await other.close()
            _rename(tmp_path / "other.db", path)
        with pytest.raises(StoreOpenError, match=re.escape(f"database file '{path}' was deleted or replaced")):
            await store.start_flow(StartRequest("after", "T", b"null", FlowConfig(), None))
    finally:
        await store.close()
    if how == "replaced":
        reopened = open_store(f"sqlite:///{path}")
        try:
            assert await reopened.list_flows() == []  # the file renamed there, untouched
        finally:
            await reopened.close()


async def test_a_current_file_opens_and_reads_while_another_process_holds_its_write_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client process (a web server starting, `dex-engine describe`) opens the file while another
    writer holds SQLite's write lock longer than the busy timeout (a long transaction, the sqlite3
    shell): opening a file already at this engine's schema writes nothing, so it opens and reads at
    once (WAL lets a reader in), instead of waiting out the busy timeout and being refused with
    `database is locked` and the advice to name a new file."""
    path = tmp_path / "engine.db"
    store = open_store(f"sqlite:///{path}")
    await store.start_flow(StartRequest("f1", "T", b"null", FlowConfig(), None))
    await store.close()
    monkeypatch.setattr("dex_engine._sqlite_store.SQLITE_BUSY_TIMEOUT_MS", 200)  # the refusal, quickly
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as writer:
        writer.execute("BEGIN IMMEDIATE")
        writer.execute("INSERT INTO meta (key, value) VALUES ('held', 'by another process')")
        store = open_store(f"sqlite:///{path}")
        try:
            assert (await store.describe_flow("f1")).status == "running"
        finally:
            await store.close()


async def test_a_write_refused_past_the_busy_timeout_names_the_file_and_that_nothing_was_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another writer holds SQLite's write lock past the busy timeout: the write fails with
    OperationalError (SQLITE_BUSY, as before) whose text names the file and says nothing was
    written, so the caller knows it may call again; SQLite's own `database is locked` says neither.
    Called again once the lock is free, it is stored once."""
    path = tmp_path / "engine.db"
    store = open_store(f"sqlite:///{path}")
    try:
        monkeypatch.setattr("dex_engine._sqlite_store.SQLITE_BUSY_TIMEOUT_MS", 200)  # the refusal, quickly
        with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as writer:
            writer.execute("BEGIN IMMEDIATE")
            with pytest.raises(sqlite3.OperationalError) as refused:
                await store.start_flow(StartRequest("f1", "T", b"null", FlowConfig(), None))
            writer.execute("ROLLBACK")
        assert refused.value.sqlite_errorcode == sqlite3.SQLITE_BUSY
        assert str(path) in str(refused.value) and "nothing was written" in str(refused.value), refused.value
        await store.start_flow(StartRequest("f1", "T", b"null", FlowConfig(), None))
        assert (await store.describe_flow("f1")).status == "running"
    finally:
        await store.close()


async def _noop_step(ctx: Context, _: Any) -> StepDecision:
    return StepDecision.complete(None)


NOOP = Flow("Noop", [Step("S", _noop_step)], start_step="S")


@pytest.mark.parametrize("how", ["rm", "mv", "rm -wal", "rm -shm"])
async def test_a_worker_whose_database_file_is_deleted_or_moved_stops_with_an_error_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str,
) -> None:
    """An operator deletes or moves the database file (or deletes its -wal or -shm) under a running
    worker: the worker stops, its run() raising DatabaseFileReplacedError naming the file, so its
    supervisor restarts it on the file now at that path. Catches: a worker that went on running
    with its writes refused and its errors only logged, while the flows clients started in the new
    file at that path waited for ever."""
    monkeypatch.setattr("dex_engine._sqlite_store.SQLITE_FILE_CHECK_SECONDS", 0.0)
    path = tmp_path / "e.db"
    options = WorkerOptions(database_url=f"sqlite:///{path}", worker_id="w1", poll_seconds=0.05,
                            lease_ttl_seconds=1.0, lease_renew_seconds=0.1, housekeeping_seconds=0.1)
    worker = AsyncWorker(Registry([NOOP]), options)
    running = asyncio.create_task(worker.run())
    try:
        await worker._registered.wait()
        named = f"{path}{how.removeprefix('rm ')}" if how.startswith("rm -") else str(path)  # the file gone
        if how == "mv":
            _rename(path, tmp_path / "moved.db")
        else:
            _unlink(named)
        with pytest.raises(DatabaseFileReplacedError, match=re.escape(repr(named))):
            await asyncio.wait_for(running, WORKER_GIVES_UP_WITHIN_SECONDS)
    finally:
        running.cancel()
        with contextlib.suppress(BaseException):
            await running


WORKER_GIVES_UP_WITHIN_SECONDS = 30.0  # a guard against a hang only: it stops at its next renewal


@pytest.mark.parametrize("suffix", ["", "-wal", "-shm"])
async def test_a_read_of_a_database_whose_files_were_deleted_fails_instead_of_showing_a_stale_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, suffix: str,
) -> None:
    """After the database file, its -wal or its -shm is deleted under an open store, its reads raise
    DatabaseFileReplacedError (checked every SQLITE_FILE_CHECK_SECONDS, here each read). Catches: a
    client's wait_for_flow reading the unlinked file's unchanging state until its timeout (for ever
    with math.inf), while the flow it waits for runs, or not, in the new file at that path."""
    monkeypatch.setattr("dex_engine._sqlite_store.SQLITE_FILE_CHECK_SECONDS", 0.0)
    path = tmp_path / "e.db"
    store = open_store(f"sqlite:///{path}")
    try:
        await store.start_flow(StartRequest("f1", "T", b"null", FlowConfig(), None))
        _unlink(f"{path}{suffix}")
        with pytest.raises(DatabaseFileReplacedError, match=re.escape(repr(f"{path}{suffix}"))):
            await store.describe_flow("f1")
    finally:
        await store.close()


async def test_other_processes_opening_and_closing_the_file_leave_an_open_store_working(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another process opens the file, writes and closes it (the last connection but this one's): the
    -wal and -shm stay, so this store's checks of them (every operation here) find nothing wrong."""
    monkeypatch.setattr("dex_engine._sqlite_store.SQLITE_FILE_CHECK_SECONDS", 0.0)
    path = tmp_path / "e.db"
    store = open_store(f"sqlite:///{path}")
    try:
        await store.start_flow(StartRequest("f1", "T", b"null", FlowConfig(), None))
        script = ("import asyncio, sys\n"
                  "from dex_engine import FlowConfig, open_store\n"
                  "from dex_engine._records import StartRequest\n"
                  "async def main():\n"
                  "    store = open_store(sys.argv[1])\n"
                  "    await store.start_flow(StartRequest('f2', 'T', b'null', FlowConfig(), None))\n"
                  "    await store.close()\n"
                  "asyncio.run(main())\n")
        await asyncio.to_thread(subprocess.run, [sys.executable, "-c", script, f"sqlite:///{path}"], check=True,
                                timeout=60)
        assert (await store.describe_flow("f2")).status == "running"
        await store.start_flow(StartRequest("f3", "T", b"null", FlowConfig(), None))
    finally:
        await store.close()


async def test_stores_naming_one_file_through_a_symlink_take_turns_on_one_lock_file(tmp_path: Path) -> None:
    """Two deployments name one database by different paths, one through a symlink to the file: both
    take their write turns on the flock of `<real file>-dexlock`, beside SQLite's -wal and -shm, so
    they still queue for each other. Catches: the lock file named after the path as given
    (`link.db-dexlock`), a second lock the other deployment never took."""
    real, link = tmp_path / "real.db", tmp_path / "link.db"
    direct = open_store(f"sqlite:///{real}")
    _symlink(real, link)
    through_link = open_store(f"sqlite:///{link}")
    try:
        assert isinstance(through_link, SqliteStore)
        await through_link.start_flow(StartRequest("f1", "T", b"null", FlowConfig(), None))
        with open(f"{real}-dexlock", "a") as held:  # noqa: ASYNC230
            fcntl.flock(held, fcntl.LOCK_EX)
            assert not through_link._turns.try_enter()  # it queues behind the holder of the real file's
        assert not Path(f"{link}-dexlock").exists()  # noqa: ASYNC240
    finally:
        await through_link.close()
        await direct.close()


def _symlink(target: Path, link: Path) -> None:
    link.symlink_to(target)


_WRITE_ONCE = """
import asyncio, sys
from dex_engine import FlowConfig, open_store
from dex_engine._records import StartRequest
async def main() -> None:
    store = open_store(sys.argv[1])
    try:
        print((await store.describe_flow("f1")).status)
        await store.start_flow(StartRequest("f2", "T", b"null", FlowConfig(), None))
    except Exception as exc:
        print(type(exc).__name__, exc.sqlite_errorcode & 0xFF, exc)
    finally:
        await store.close()
asyncio.run(main())
"""


def _without_root_powers() -> list[str]:
    """A command prefix under which this process's user cannot write a file of mode 444: root (the
    test containers) loses the capabilities that let it; skip where that cannot be done."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv: a file of mode 444 stays writable")
    caps = "-dac_override,-dac_read_search"
    return [setpriv, f"--bounding-set={caps}", f"--inh-caps={caps}"]


async def test_a_write_to_a_file_this_process_may_not_write_names_the_file_and_the_cause(tmp_path: Path) -> None:
    """An operator changed the file's mode (or a process of another user created it): SQLite opens it
    read-only without a word, reads work, and the first write fails with SQLITE_READONLY, whose text
    now names the file, its owner and mode, and what to do. Catches SQLite's bare `attempt to write a
    readonly database`, which says neither which file nor why."""
    path = tmp_path / "e.db"
    store = open_store(f"sqlite:///{path}")
    await store.start_flow(StartRequest("f1", "T", b"null", FlowConfig(), None))
    await store.close()
    os.chmod(path, 0o444)
    run = await asyncio.to_thread(
        subprocess.run, [*_without_root_powers(), sys.executable, "-c", _WRITE_ONCE, f"sqlite:///{path}"],
        capture_output=True, text=True, timeout=60, check=False)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == "running"  # read-only, reads still work
    assert lines[1].startswith(f"OperationalError {sqlite3.SQLITE_READONLY} attempt to write a readonly database")
    assert f"{str(path)!r} (owner uid {os.geteuid()}, mode 444) cannot be written by this process" in lines[1]


def _vacuum_into(path: Path, backup: Path) -> None:
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("VACUUM INTO ?", (str(backup),))


def _restore(backup: Path, path: Path) -> None:
    shutil.copyfile(backup, f"{path}.new")
    os.replace(f"{path}.new", path)


async def test_the_documented_backup_while_writing_and_restore_keep_every_flow_of_the_snapshot(tmp_path: Path) -> None:
    """deployment.md's backup: `VACUUM INTO` while a store writes flows one after another gives a file
    dex_engine opens, holding a prefix of those flows; restored as documented (every process stopped,
    the copy renamed over the file), the file opens with exactly those flows and takes writes."""
    path, backup = tmp_path / "dex.db", tmp_path / "backup.db"
    store = open_store(f"sqlite:///{path}")
    written = 0
    try:
        async def write(count: int) -> None:
            nonlocal written
            for _ in range(count):
                await store.start_flow(StartRequest(f"f{written}", "T", b"null", FlowConfig(), None))
                written += 1

        writing = asyncio.create_task(write(BACKUP_FLOWS))
        await asyncio.sleep(0)
        await asyncio.to_thread(_vacuum_into, path, backup)
        await writing
    finally:
        await store.close()
    assert not Path(f"{path}-wal").exists()  # noqa: ASYNC240  the last to close folded it in
    await asyncio.to_thread(_restore, backup, path)
    restored = open_store(f"sqlite:///{path}")
    try:
        ids = sorted(int(f.flow_id[1:]) for f in await restored.list_flows(limit=BACKUP_FLOWS))
        assert ids == list(range(len(ids)))  # a consistent snapshot: the flows started before it
        await restored.start_flow(StartRequest("after", "T", b"null", FlowConfig(), None))
    finally:
        await restored.close()
    with contextlib.closing(sqlite3.connect(path)) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


BACKUP_FLOWS = 300


@pytest.mark.parametrize("how", ["moved", "deleted"])
async def test_opening_a_path_whose_file_was_moved_or_deleted_from_under_its_wal_is_refused_clearly(
    tmp_path: Path, how: str,
) -> None:
    """A store has dex.db open with commits in its -wal; the operator moves the file away (mv leaves
    the -wal and -shm at the old names) or deletes it alone. Opening the path is refused with
    StoreOpenError naming the -wal and saying what happened and what to do, creating no file. Once
    the old store closed (folding its -wal into the moved file), nothing was lost. Catches: SQLite's
    `disk I/O error` (given with the advice to name a new file), or a new file with another file's
    -wal applied to it."""
    path = tmp_path / "dex.db"
    store = open_store(f"sqlite:///{path}")
    try:
        await store.start_flow(StartRequest("f1", "T", b"null", FlowConfig(), None))
        if how == "moved":
            _rename(path, tmp_path / "moved.db")
        else:
            _unlink(str(path))
        with pytest.raises(StoreOpenError, match=re.escape(f"{str(path) + '-wal'!r} beside it holds")):
            open_store(f"sqlite:///{path}")
        assert not _exists(path)
    finally:
        await store.close()
    # SQLite does not checkpoint a file that was moved on close: its last commits stay in the -wal,
    # which the error's advice moves along with it.
    with pytest.raises(StoreOpenError, match="beside it holds"):
        open_store(f"sqlite:///{path}")
    if how == "moved":
        _rename(Path(f"{path}-wal"), tmp_path / "moved.db-wal")
        _unlink(f"{path}-shm")
        moved = open_store(f"sqlite:///{tmp_path / 'moved.db'}")
        try:
            assert (await moved.describe_flow("f1")).status == "running"
        finally:
            await moved.close()


async def test_opening_an_empty_file_left_where_a_database_was_moved_from_its_wal_is_refused(
    tmp_path: Path,
) -> None:
    """As above, but a deploy script touched the path after the move (an empty file, not a missing
    one): still refused naming the -wal, and the empty file is left as it was. Catches: only a
    missing file checked, the -wal of the moved file then applied to the new, empty one."""
    path = tmp_path / "dex.db"
    store = open_store(f"sqlite:///{path}")
    try:
        await store.start_flow(StartRequest("f1", "T", b"null", FlowConfig(), None))
        _rename(path, tmp_path / "moved.db")
        path.touch()
        with pytest.raises(StoreOpenError, match=re.escape(
                f"cannot open {str(path)!r}: it is empty, but {str(path) + '-wal'!r} beside it holds")):
            open_store(f"sqlite:///{path}")
        assert path.stat().st_size == 0
    finally:
        await store.close()


async def test_opening_a_symlink_whose_target_was_moved_from_under_its_wal_is_refused(tmp_path: Path) -> None:
    """The URL names a symlink to the database file; the file is moved away from its -wal, which
    SQLite keeps beside the symlink's target. Opening the symlink again is refused naming that -wal.
    Catches: the -wal looked for beside the symlink, where there is none, and another file's pages
    applied to a new file at the target."""
    (tmp_path / "data").mkdir()
    target = tmp_path / "data" / "dex.db"
    link = tmp_path / "link.db"
    link.symlink_to(target)
    store = open_store(f"sqlite:///{link}")
    try:
        await store.start_flow(StartRequest("f1", "T", b"null", FlowConfig(), None))
        _rename(target, tmp_path / "data" / "moved.db")
        with pytest.raises(StoreOpenError, match=re.escape(f"{str(target) + '-wal'!r} beside it holds")):
            open_store(f"sqlite:///{link}")
        assert not _exists(target)
    finally:
        await store.close()


def test_url_parameters_ignore_case_and_the_last_of_a_repeated_one_wins() -> None:
    """`synchronous=normal` is NORMAL, `inline=OFF` off, and a parameter appended to a URL that
    already has it (a deployment overriding a default) takes effect. Catches: a lower-case level
    refused, or the first of a repeated parameter silently kept."""
    assert parse_sqlite_url("sqlite:///x.db?synchronous=normal").synchronous == "NORMAL"
    assert parse_sqlite_url("sqlite:///x.db?synchronous=FULL&synchronous=NORMAL").synchronous == "NORMAL"
    assert parse_sqlite_url("sqlite:///x.db?inline=on&inline=OFF").inline is False
