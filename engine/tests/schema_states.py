"""Databases in the states an engine must not open blindly, and what they hold: another
application's (no dex_engine tables), or one an older dex_engine left (an older schema version)."""

from __future__ import annotations

import sqlite3

import psycopg

from dex_engine._migrate import migration_files, statements


def pg_tables(url: str) -> list[str]:
    """The tables of the schema the PostgreSQL `url` uses first, by name."""
    with psycopg.connect(url) as pg:
        return [name for (name,) in pg.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = current_schema() ORDER BY tablename")]


def stored_version(url: str) -> str:
    """The schema_version the engine database at `url` records, read without the engine."""
    query = "SELECT value FROM meta WHERE key = 'schema_version'"
    if url.startswith("sqlite:"):
        conn = sqlite3.connect(url.removeprefix("sqlite:///"))
        try:
            return str(conn.execute(query).fetchone()[0])
        finally:
            conn.close()
    with psycopg.connect(url) as pg:
        row = pg.execute(query).fetchone()
        assert row is not None
        return str(row[0])


def latest_version(url: str) -> int:
    """The schema version this dex_engine migrates the database at `url` to."""
    return migration_files(_backend(url))[-1][0]


def migrate_to(url: str, version: int) -> None:
    """Give the empty database at `url` the schema `version` (migrations 1 to `version`), as an
    older dex_engine left it."""
    backend = _backend(url)
    sql = [statement for number, text in migration_files(backend) if number <= version
           for statement in statements(text)]
    sql.append(f"INSERT INTO meta (key, value) VALUES ('schema_version', '{version}')")
    if backend == "sqlite":
        conn = sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None)
        try:
            for statement in sql:
                conn.execute(statement)
        finally:
            conn.close()
        return
    with psycopg.connect(url, autocommit=True) as pg:
        for statement in sql:
            pg.execute(statement)


def _backend(url: str) -> str:
    return "postgres" if url.startswith("postgres") else "sqlite"
