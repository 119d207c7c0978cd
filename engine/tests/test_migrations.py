"""Numbered migrations and the schema version, on each backend."""

from __future__ import annotations

import asyncio

from dex_engine import FlowConfig, open_store
from dex_engine._migrate import migration_files, statements
from dex_engine._records import StartRequest


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


def test_migration_files_are_numbered_from_one_without_gaps() -> None:
    """Each backend's migrations are 0001, 0002, ... and every file holds statements."""
    for backend in ("sqlite", "postgres"):
        files = migration_files(backend)
        assert [n for n, _ in files] == list(range(1, len(files) + 1)), backend
        assert all(statements(sql) for _, sql in files), backend


def test_statements_ignore_comments() -> None:
    assert statements("-- a; comment\nCREATE TABLE a (x INT); -- trailing; note\n\n") == ["CREATE TABLE a (x INT)"]
