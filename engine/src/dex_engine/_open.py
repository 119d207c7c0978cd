"""Opening a store from a URL."""

from __future__ import annotations

from ._store import Store


def open_store(url: str) -> Store:
    """Open the database at `url`: `sqlite:///path/to/file.db` (optionally `?synchronous=NORMAL`)
    or `postgresql://user@host:port/dbname` (needs the `postgres` extra)."""
    if url.startswith("sqlite:"):
        from ._sqlite_store import SqliteStore

        return SqliteStore(url)
    if url.startswith(("postgresql://", "postgres://")):
        from ._pg_store import PostgresStore

        return PostgresStore(url)
    raise ValueError(
        f"unsupported database URL {url!r}; use sqlite:///path/to/file.db or postgresql://user@host:port/dbname"
    )
