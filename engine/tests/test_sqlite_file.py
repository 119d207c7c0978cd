"""The SQLite store's file and thread: what opening a URL creates, and what closing the store ends."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

from dex_engine import FlowConfig, open_store
from dex_engine._records import StartRequest


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
