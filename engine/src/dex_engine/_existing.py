"""Checks of a database before a store opens it as one the workers already use.

Opening a store creates and migrates the database, so a reader of the workers' database (the
`dex-engine` command, `open_store(url, existing=True)`) refuses, before opening, a database that is
not there, holds no dex_engine tables, or has an older schema than this dex_engine's.
"""

from __future__ import annotations

import os
import sqlite3
from dataclasses import dataclass

from ._errors import StoreOpenError
from ._limits import SQLITE_WRITER_TURN_SUFFIX
from ._migrate import migration_files
from ._open import POSTGRES_SCHEMES, postgres_store_module, shown_url
from ._sqlite_store import parse_sqlite_url, schema_version


@dataclass(frozen=True)
class Wording:
    """What the refusals of one reader (the CLI names its options) say of it and of what to do instead."""

    # The one whose schema version an older database's is compared with: "this dex_engine".
    reader: str
    # What to pass instead of a database without dex_engine tables, or of a SQLite file that is not there.
    pass_instead: str
    # Besides upgrading the workers, what to read a database of an older schema with.
    older_instead: str
    # What the refusal of a SQLite file without dex_engine tables adds, after naming it ("" for nothing).
    foreign_file_advice: str


OPEN_EXISTING = Wording(
    reader="this dex_engine",
    pass_instead="pass the URL of the engine database the workers use",
    older_instead="read it with the dex_engine of their version",
    foreign_file_advice="; nothing was created in it: pass the URL of the engine database the workers use",
)


def check_existing(url: str, wording: Wording, *, must_exist: bool) -> None:
    """Refuse the database at `url` when opening a store on it would harm it: a SQLite file that is
    not an engine database or that this process may not write, and, when `must_exist` (the workers'
    database, to read or operate), a SQLite file that is not there (FileNotFoundError), a PostgreSQL
    database without dex_engine tables, or either with an older schema. StoreOpenError, or ValueError
    for a malformed URL; nothing is created or changed."""
    if url.startswith(POSTGRES_SCHEMES):
        if must_exist:
            _check_postgres(url, wording)
        return
    if not url.startswith("sqlite:"):
        return  # open_store judges other URLs
    path = parse_sqlite_url(url).path
    if not os.path.exists(path):
        if must_exist:
            raise FileNotFoundError(f"no database file {os.path.abspath(path)!r} (from {url!r}); "
                                    f"{wording.pass_instead}")
        return
    try:
        conn = sqlite3.connect(path)
        try:
            row = conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'flows'").fetchone()
            version = None if row is None else schema_version(conn, path)  # StoreOpenError: a flows table, not ours
        finally:
            conn.close()
    except sqlite3.Error as exc:
        # Reading a WAL file creates its -shm file: in a directory this process may not write, even
        # an engine database cannot be read, and SQLite's "unable to open database file" misleads.
        _refuse_unwritable(path)
        raise StoreOpenError(f"{path!r} is not a readable SQLite database ({exc})") from None
    if version is None:
        raise StoreOpenError(f"{path!r} is not a dex-engine database (it has no flows table)"
                             f"{wording.foreign_file_advice}")
    _refuse_unwritable(path)  # opening the store writes (migrations, WAL)
    if must_exist:
        _refuse_older_schema(path, version, "sqlite", wording)


def _check_postgres(url: str, wording: Wording) -> None:
    """Refuse a PostgreSQL database without dex_engine's tables (opening it would create them, in
    whatever database the URL names) or with an older schema."""
    version: int = postgres_store_module(url).stored_schema_version(url)
    if version == 0:
        raise StoreOpenError(f"{shown_url(url)!r} holds no dex_engine tables, so no flows (nothing was created "
                             f"there); {wording.pass_instead}")
    _refuse_older_schema(shown_url(url), version, "postgres", wording)


def _refuse_older_schema(database: str, version: int, backend: str, wording: Wording) -> None:
    """Refuse a database whose schema is older than this engine's: opening it would migrate it, and
    workers of the older dex_engine still using it would then misread it."""
    latest = migration_files(backend)[-1][0]
    if version < latest:
        raise StoreOpenError(
            f"{database!r} has dex_engine schema version {version}, older than the {latest} {wording.reader} "
            "uses; it was not opened, since opening would migrate it under the older dex_engine's workers "
            "(nothing was changed): upgrade the workers, which migrate it as they start, or "
            f"{wording.older_instead}"
        )


def _refuse_unwritable(path: str) -> None:
    """Refuse the database file `path` when this process may not write it or its directory."""
    directory = os.path.dirname(os.path.abspath(path))
    if not os.access(directory, os.W_OK):
        what = f"its directory {directory!r}"
    elif not os.access(path, os.W_OK):
        what = "the file"
    else:
        return
    name = os.path.basename(path)
    raise StoreOpenError(
        f"cannot use {path!r}: this process may not write {what}; the engine needs write access to the "
        f"database file and its directory (it creates {name}-wal, {name}-shm and "
        f"{name}{SQLITE_WRITER_TURN_SUFFIX} beside the file): run as a user who may write there, or copy "
        "the file into a writable directory"
    )
