"""Numbered migration files and applying the pending ones; shared by the SQLite and PostgreSQL stores."""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Sequence
from importlib import resources
from typing import Any

from ._errors import StoreOpenError

Execute = Callable[[str, Sequence[Any]], Any]


def statements(sql: str) -> list[str]:
    """Split a migration file into statements; `--` comments end at the line's end, and a
    `$$`-quoted body (a PostgreSQL function's) keeps its own semicolons."""
    lines = [line.split("--", 1)[0] for line in sql.splitlines()]
    out = [""]
    for n, part in enumerate(re.split(r"(\$\$.*?\$\$)", "\n".join(lines), flags=re.DOTALL)):
        pieces = [part] if n % 2 else part.split(";")
        out[-1] += pieces[0]
        out += pieces[1:]
    return [part.strip() for part in out if part.strip()]


def migration_files(backend: str) -> list[tuple[int, str]]:
    """(number, SQL) of `_migrations/<backend>/NNNN_*.sql`, in order."""
    folder = resources.files("dex_engine") / "_migrations" / backend
    return sorted((int(e.name.split("_", 1)[0]), e.read_text()) for e in folder.iterdir() if e.name.endswith(".sql"))


def recorded_version(stored: object) -> int | None:
    """The schema version a `meta` row's value records, or None when it is not one dex_engine wrote:
    apply_pending writes str(number) of a migration, numbered from 1. Another application's `meta`
    table (a common name) holds anything else."""
    if isinstance(stored, str) and stored.isascii() and stored.isdigit() and int(stored) >= 1:
        return int(stored)
    return None


def apply_pending(execute: Execute, backend: str, version: int, placeholder: str, database: str) -> None:
    """Inside the caller's transaction: apply migrations after `version`, record the new version,
    and create the stream token secret once. A database a newer
    dex_engine migrated is refused, named by `database` (its path, or its URL without a password):
    its rows may be in forms this one misreads (schema 6 on SQLite stores task options by reference)."""
    files = migration_files(backend)
    if version > files[-1][0]:
        raise StoreOpenError(
            f"{database!r}: the database's schema is version {version}, newer than the {files[-1][0]} this "
            f"dex_engine knows ({backend}): a newer dex_engine wrote it; upgrade dex_engine to open it (nothing "
            "was changed)"
        )
    for number, sql in files:
        if number <= version:
            continue
        for statement in statements(sql):
            execute(statement, ())
        execute(
            f"INSERT INTO meta (key, value) VALUES ('schema_version', {placeholder}) "
            "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            (str(number),),
        )
    execute(
        f"INSERT INTO meta (key, value) VALUES ('stream_token_secret', {placeholder}) ON CONFLICT DO NOTHING",
        (secrets.token_hex(32),),
    )
