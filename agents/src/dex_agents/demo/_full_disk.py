"""The chat's watch for a full disk under its database.

The chat's Worker runs in the chat's process. When the disk fills, the Worker's commits fail and it
logs and retries, so a turn the chat follows never ends: the chat would wait for ever. The watch sees
the engine's log records, and the chat stops at the first one that reports a full disk.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import sqlite3
from collections.abc import Coroutine
from types import TracebackType
from typing import Any

ENGINE_LOGGER = "dex_engine"


def is_disk_full(error: BaseException) -> bool:
    """Whether `error`, or an error it was raised from, reports a full disk (SQLITE_FULL, ENOSPC)."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, sqlite3.Error) and getattr(current, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL:
            return True
        if isinstance(current, OSError) and current.errno == errno.ENOSPC:
            return True
        current = current.__cause__ or current.__context__
    return False


class FullDiskWatch(logging.Handler):
    """While entered, a handler on the engine's logger: `error` is the first logged error that
    reports a full disk, and `full` is set then. Other records are printed as they were before
    (logging's last resort, when nothing else is configured); records of a full disk are not: the
    chat reports it once, in a line of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.error: BaseException | None = None
        self.full = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._logger = logging.getLogger(ENGINE_LOGGER)

    def emit(self, record: logging.LogRecord) -> None:
        error = record.exc_info[1] if record.exc_info else None
        if error is not None and is_disk_full(error):
            if self.error is None:
                self.error = error
                self._loop.call_soon_threadsafe(self.full.set)
            return
        if logging.lastResort is not None and not logging.getLogger().handlers:
            logging.lastResort.handle(record)

    def __enter__(self) -> FullDiskWatch:
        self._logger.addHandler(self)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self._logger.removeHandler(self)


async def until_disk_full(work: Coroutine[Any, Any, None], watch: FullDiskWatch, database: str) -> None:
    """Run `work` until it ends, or until `watch` sees a full disk: then cancel it and raise OSError
    (ENOSPC) naming `database`."""
    task = asyncio.ensure_future(work)
    full = asyncio.ensure_future(watch.full.wait())
    try:
        await asyncio.wait({task, full}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        full.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if watch.error is None or (task.done() and not task.cancelled()):
        task.result()  # its result, or its error (CancelledError when it was cancelled)
        return
    raise OSError(errno.ENOSPC, f"the session's database {database!r} cannot be written ({watch.error}); "
                                "free some space, then run the same command to resume")
