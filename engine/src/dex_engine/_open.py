"""Opening a store from a URL."""

from __future__ import annotations

from ._store import Store


def open_store(url: str) -> Store:
    """Open the database at `url`: `sqlite:///path/to/file.db` (optionally `?synchronous=NORMAL`)."""
    if url.startswith("sqlite:"):
        from ._sqlite_store import SqliteStore

        return SqliteStore(url)
    raise ValueError(f"unsupported database URL {url!r}; use sqlite:///path/to/file.db")
