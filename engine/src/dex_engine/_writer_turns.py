"""Writers of one SQLite file take turns through an exclusive flock on a file beside it.

SQLite's busy handler retries a held write lock by sleeping (1, 2, 5, 10 ... ms between tries),
so a process waiting behind another's back-to-back group commits loses milliseconds per try and a
second worker process adds nothing. A process blocked on flock is woken by the kernel when the
lock is released. SQLite's own lock still guards the data: a writer that does not take this turn
(the sqlite3 shell, a migration at start-up) is only slower to get in, never unsafe. So the turn
is only a queue, and a writer that waits too long for it goes on without it.
"""

from __future__ import annotations

import logging
import os
import threading
from types import TracebackType

from ._limits import SQLITE_BUSY_TIMEOUT_MS, SQLITE_WRITER_TURN_SUFFIX

try:
    import fcntl
except ImportError:  # Windows: no flock; writers queue through SQLite's busy handler alone
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger("dex_engine")


class WriterTurns:
    """The turn lock of one SQLite file; entered and left by the holder of the store's connection.

    The lock file is opened on first use, so a forked child opens its own instead of sharing its
    parent's open file (flock locks belong to the open file, so parent and child would not
    exclude each other). When it cannot be opened, writers go on without it, with one warning.
    A turn held by another process is waited for on a helper thread, for at most `wait_seconds`
    (SQLite's busy timeout): flock has no timeout, and a holder that is frozen (SIGSTOP, a
    debugger) between its commit and its release must not stop this process's writes for ever.
    """

    def __init__(self, database_path: str, wait_seconds: float = SQLITE_BUSY_TIMEOUT_MS / 1000) -> None:
        self.path = database_path + SQLITE_WRITER_TURN_SUFFIX
        self.wait_seconds = wait_seconds
        self._fd: int | None = None
        self._usable = fcntl is not None
        self._held = False
        self._waiter: _TurnWaiter | None = None

    def __enter__(self) -> WriterTurns:
        if self.try_enter():
            return self
        if self._waiter is None:
            assert self._fd is not None  # try_enter opened it, or it would have said yes
            self._waiter = _TurnWaiter(self._fd)
        self._held = self._waiter.wait(self.wait_seconds)
        if not self._held:
            log.warning("waited %.0f s for the write turn of %s; writing without it (another process "
                        "holds it: frozen, or stopped in a debugger?)", self.wait_seconds, self.path)
        return self

    def try_enter(self) -> bool:
        """Take the turn unless another process holds it (True: taken, or no lock file to take)."""
        fd = self._open()
        if fd is None:
            return True
        if self._waiter is not None and self._waiter.busy():
            # Its thread still blocks in (or just returned from) flock on the same open file, for a
            # request its caller gave up on: flock counts a lock taken here as that file's too, so the
            # thread would take it as its own and release it under this writer.
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        self._held = True
        return True

    def leave(self) -> None:
        if self._held and self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._held = False

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.leave()

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
        if self._waiter is not None:
            self._waiter.stop()  # a wait in progress keeps the file open until its flock returns
        elif self._fd is not None:
            os.close(self._fd)
        self._fd = None


class _TurnWaiter:
    """Takes the turn with a blocking flock on a daemon thread, for a caller that waits with a timeout.

    A grant that comes after its caller gave up goes to the caller's newer request, if it has one
    waiting, and is otherwise released at once.
    """

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._cv = threading.Condition()
        self._asked = 0  # the newest request
        self._granted = 0  # the newest request the flock was taken for
        self._abandoned = 0  # the newest request its caller stopped waiting for
        self._stopping = False
        threading.Thread(target=self._run, name="dex-sqlite-turn", daemon=True).start()

    def wait(self, timeout: float) -> bool:
        """Whether the turn was taken within `timeout` seconds."""
        with self._cv:
            self._asked += 1
            request = self._asked
            self._cv.notify_all()
            if self._cv.wait_for(lambda: self._granted >= request, timeout):
                return True
            self._abandoned = request
            return False

    def busy(self) -> bool:
        """Whether the thread is taking the turn for a request it has not yet settled."""
        with self._cv:
            return self._asked > self._granted

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._stopping or self._asked > self._granted)
                if self._stopping:
                    break
            fcntl.flock(self._fd, fcntl.LOCK_EX)  # blocks with the GIL released
            with self._cv:
                # The newest request gets the turn (one caller asks at a time); when its caller
                # has given up too, nobody waits for the turn and it is released at once.
                if self._stopping or self._abandoned >= self._asked:
                    fcntl.flock(self._fd, fcntl.LOCK_UN)
                self._granted = self._asked
                self._cv.notify_all()
        os.close(self._fd)
