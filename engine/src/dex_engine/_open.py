"""Opening a store from a URL."""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

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
        f"unsupported database URL {shown_url(url)!r}; use sqlite:///path/to/file.db or postgresql://user@host:port/dbname"
    )


def shown_url(url: str) -> str:
    """`url` fit for a message or a log: a password in it, as user:password@ or a password=
    parameter, is written as ***."""
    try:
        parts = urlsplit(url)
    except ValueError:  # malformed (an unclosed IPv6 bracket): hide what would be userinfo's password
        return re.sub(r"password=[^&]*", "password=***", re.sub(r"^([^:/]*://[^:@/]*):[^@]*@", r"\1:***@", url))
    if parts.password is None and "password=" not in parts.query:
        return url  # unchanged, not rebuilt: urlunsplit would drop the empty host of sqlite:////path
    netloc = parts.netloc
    if parts.password is not None:
        userinfo, _, hosts = netloc.rpartition("@")
        netloc = f"{userinfo.partition(':')[0]}:***@{hosts}"
    query = re.sub(r"(^|&)password=[^&]*", r"\1password=***", parts.query)
    return urlunsplit(parts._replace(netloc=netloc, query=query))
