"""Writers of one SQLite file take turns through an exclusive flock on a file beside it.

SQLite's busy handler retries a held write lock by sleeping (1, 2, 5, 10 ... ms between tries),
so a process waiting behind another's back-to-back group commits loses milliseconds per try and a
second worker process adds nothing. A process blocked on flock is woken by the kernel when the
lock is released. SQLite's own lock still guards the data: a writer that does not take this turn
(the sqlite3 shell, a migration at start-up) is only slower to get in, never unsafe.
"""

from __future__ import annotations

import logging
import os
from types import TracebackType

from ._limits import SQLITE_WRITER_TURN_SUFFIX

try:
    import fcntl
except ImportError:  # Windows: no flock; writers queue through SQLite's busy handler alone
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger("dex_engine")


class WriterTurns:
    """The turn lock of one SQLite file; used from the store's one thread.

    The lock file is opened on first use, so a forked child opens its own instead of sharing its
    parent's open file (flock locks belong to the open file, so parent and child would not
    exclude each other). When it cannot be opened, writers go on without it, with one warning.
    """

    def __init__(self, database_path: str) -> None:
        self.path = database_path + SQLITE_WRITER_TURN_SUFFIX
        self._fd: int | None = None
        self._usable = fcntl is not None

    def __enter__(self) -> WriterTurns:
        fd = self._open()
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)  # blocks with the GIL released
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _open(self) -> int | None:
        if self._fd is None and self._usable:
            try:
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError as exc:
                self._usable = False
                log.warning("cannot open %s (%s): writers of this SQLite file queue through SQLite's "
                            "busy handler alone, which is slower with several worker processes", self.path, exc)
        return self._fd

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
