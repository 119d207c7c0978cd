"""The SQLite store's file and thread: what opening a URL creates, and what closing the store ends."""

from __future__ import annotations

import asyncio
import re
import sqlite3
import threading
from pathlib import Path

import pytest

from dex_engine import FlowConfig, StoreOpenError, open_store
from dex_engine._records import StartRequest
from dex_engine._sqlite_store import SqliteStore
from dex_engine._transitions import Db


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


async def test_close_ends_the_stores_thread_before_it_returns(tmp_path: Path) -> None:
    """Once close() returns the connection's thread has ended, so a caller may delete or copy the
    file at once."""
    path = tmp_path / "engine.db"
    store = open_store(f"sqlite:///{path}")
    name = f"dex-sqlite:{path}"
    assert name in {t.name for t in threading.enumerate()}
    await store.close()
    assert name not in {t.name for t in threading.enumerate() if t.is_alive()}


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
