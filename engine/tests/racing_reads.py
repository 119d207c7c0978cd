"""Another writer's commit landing inside one read's transaction, between its statements: how the
read-consistency tests show that a read sees its flow as of one moment on both backends."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

import dex_engine._transitions as transitions


class CommitsAfterStatement:
    """A Db for one read that runs `commit` (another writer's) once its `n`-th statement returned."""

    def __init__(self, db: Any, n: int, commit: Callable[[], object]) -> None:
        self._db, self._n, self._commit, self._statements = db, n, commit, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._db, name)

    def one(self, sql: str, params: Any = ()) -> Any:
        return self._then(self._db.one(sql, params))

    def all(self, sql: str, params: Any = ()) -> Any:
        return self._then(self._db.all(sql, params))

    def _then(self, result: Any) -> Any:
        self._statements += 1
        if self._statements == self._n:
            self._commit()
        return result


def commit_during_first_read(
    monkeypatch: pytest.MonkeyPatch, transition: str, after: int, commit: Callable[[], object],
) -> list[object]:
    """Make the next run of `transitions.<transition>` run `commit` once its `after`-th statement
    returned, or right after it when it took fewer; later runs are left alone. The list returned
    gets what `commit` returned once it ran."""
    real = getattr(transitions, transition)
    committed: list[object] = []

    def run_commit() -> None:
        committed.append(commit())

    def racing(db: Any, *args: Any) -> Any:
        if committed:
            return real(db, *args)
        result = real(CommitsAfterStatement(db, after, run_commit), *args)
        if not committed:  # the read took fewer statements: the commit lands after it
            run_commit()
        return result

    monkeypatch.setattr(transitions, transition, racing)
    return committed
