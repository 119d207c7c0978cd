"""Task options stored once per distinct value (SQLite, schema 6), and found again from a task row.

A task row's `options` column holds either the options' JSON (PostgreSQL, and SQLite rows written
before schema 6) or `#<digest>`: the key of the options' row in `task_options`, a digest of that
JSON. A digest names one value for good, so any process may keep what it decoded from one.

A store inserts (or confirms) the row in the transaction that first writes a task naming it, and
remembers it once that transaction committed; for TASK_OPTIONS_REFRESH_MS it then names the row
without writing it again. Housekeeping deletes a row only when it is unused (unconfirmed) for
TASK_OPTIONS_KEEP_MS and no task names it, so a row a store may name unconfirmed is never gone.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Sequence
from typing import Any, Protocol

from ._limits import (
    ROWS_PER_STATEMENT,
    TASK_OPTIONS_COLLECT_MS,
    TASK_OPTIONS_CONFIRMED_ENTRIES,
    TASK_OPTIONS_KEEP_MS,
    TASK_OPTIONS_REFRESH_MS,
)

REF_PREFIX = b"#"  # JSON options begin with '{': a reference cannot be mistaken for them

# Digests of the options JSON this process saw last, by that JSON: a Step type's options are
# encoded alike for every task, and hashing them is most of a reference's cost.
_digests: dict[bytes, bytes] = {}
_DIGESTS_MAX = 4096


class _Statements(Protocol):
    def all(self, sql: str, params: Sequence[Any] = ()) -> list[Any]: ...
    def run(self, sql: str, params: Sequence[Any] = ()) -> int: ...


def digest_of(options_json: bytes) -> bytes:
    """The row key of these options: 128 bits of BLAKE2b, in URL-safe base64 (22 bytes)."""
    known = _digests.get(options_json)
    if known is None:
        raw = hashlib.blake2b(options_json, digest_size=16).digest()
        known = base64.urlsafe_b64encode(raw).rstrip(b"=")
        if len(_digests) >= _DIGESTS_MAX:
            _digests.clear()
        _digests[options_json] = known
    return known


def is_reference(stored: bytes) -> bool:
    return stored[:1] == REF_PREFIX


def options_json(db: _Statements, reference: bytes) -> bytes:
    """The options a reference names, read from its row; a missing row is a damaged database."""
    rows = db.all("SELECT options FROM task_options WHERE digest = ?", (reference[len(REF_PREFIX):],))
    if not rows:
        raise RuntimeError(
            f"task options {reference.decode(errors='replace')!r} have no row in task_options: the database "
            "was changed outside dex_engine; restore it from a backup"
        )
    return bytes(rows[0][0])


class SharedOptions:
    """One store connection's task_options rows known to exist: confirmed by a committed transaction
    (`confirmed`, by digest, when), or by the open one (`pending`, kept only if it commits)."""

    def __init__(self) -> None:
        self.confirmed: dict[bytes, int] = {}
        self.pending: dict[bytes, int] = {}
        self._collect_after = 0

    def reference(self, db: _Statements, data: bytes, now: int) -> bytes:
        """What a task row stores for the options whose JSON is `data`; writes (or confirms) their
        row when this connection has not confirmed it within TASK_OPTIONS_REFRESH_MS."""
        digest = digest_of(data)
        at = self.confirmed.get(digest)
        if at is None or not 0 <= now - at < TASK_OPTIONS_REFRESH_MS:
            at = self.pending.get(digest)
            if at is None or not 0 <= now - at < TASK_OPTIONS_REFRESH_MS:
                db.run("INSERT INTO task_options (digest, options, used_at) VALUES (?, ?, ?) "
                       "ON CONFLICT (digest) DO UPDATE SET used_at = excluded.used_at", (digest, data, now))
                self.pending[digest] = now
        return REF_PREFIX + digest

    def committed(self) -> None:
        """The open transaction committed: what it confirmed is known from now on."""
        if self.pending:
            if len(self.confirmed) + len(self.pending) > TASK_OPTIONS_CONFIRMED_ENTRIES:
                self.confirmed.clear()  # a miss costs one upsert: start over rather than track use
            self.confirmed.update(self.pending)
            self.pending.clear()

    def rolled_back(self) -> None:
        """The open transaction, or a savepoint in it, rolled back: its confirmations may be undone."""
        self.pending.clear()

    def collect(self, db: _Statements, now: int) -> None:
        """Delete rows unused for TASK_OPTIONS_KEEP_MS that no task names (at most once per
        TASK_OPTIONS_COLLECT_MS per store); rows still named count as used now."""
        if now < self._collect_after:
            return
        self._collect_after = now + TASK_OPTIONS_COLLECT_MS
        stale = [bytes(r[0]) for r in db.all("SELECT digest FROM task_options WHERE used_at < ?",
                                             (now - TASK_OPTIONS_KEEP_MS,))]
        if not stale:
            return
        named = {bytes(r[0])[len(REF_PREFIX):] for r in db.all(
            "SELECT DISTINCT options FROM tasks WHERE substr(options, 1, 1) = ?", (REF_PREFIX,))}
        gone = [d for d in stale if d not in named]
        kept = [d for d in stale if d in named]
        for rows, sql in ((gone, "DELETE FROM task_options WHERE digest IN ({})"),
                          (kept, "UPDATE task_options SET used_at = ? WHERE digest IN ({})")):
            for i in range(0, len(rows), ROWS_PER_STATEMENT):
                part = rows[i:i + ROWS_PER_STATEMENT]
                params: list[Any] = [] if rows is gone else [now]
                db.run(sql.format(", ".join("?" * len(part))), [*params, *part])
