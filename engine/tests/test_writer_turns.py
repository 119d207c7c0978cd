"""Writers of one SQLite file take turns through an flock on `<file>-dexlock` (_writer_turns).

A real second process holds the turn; /proc/locks shows when the store's thread is blocked on it.
"""

from __future__ import annotations

import asyncio
import fcntl
import functools
import logging
import os
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dex_engine import FlowConfig, _sqlite_store, open_store
from dex_engine import _transitions as tx
from dex_engine._records import StartRequest
from dex_engine._writer_turns import WriterTurns

from .conftest import wait_until

pytestmark = pytest.mark.skipif(not Path("/proc/locks").exists(), reason="needs Linux's /proc/locks")

_HOLDER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def holder_of(tmp_path: Path) -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        with proc:  # closes its pipes too
            proc.kill()


def hold_turn(lock: Path, started: list[subprocess.Popen[str]]) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(lock)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    started.append(proc)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def blocked_on(lock: Path) -> bool:
    """Whether this process waits for an flock on `lock` (a '->' line in /proc/locks)."""
    inode = os.stat(lock).st_ino
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if "->" in fields and "FLOCK" in fields and str(os.getpid()) in fields and any(
                f.endswith(f":{inode}") for f in fields):
            return True
    return False


def write_marker(flow_id: str) -> Callable[[tx.Db], None]:
    def op(db: tx.Db) -> None:
        db.run("INSERT INTO attributes (flow_id, name, key, value) VALUES (?, 'A', '', x'31')", (flow_id,))
    return op


async def test_a_write_waits_for_the_turn_another_process_holds_and_a_read_does_not(
        tmp_path: Path, holder_of: list[subprocess.Popen[str]]) -> None:
    db = tmp_path / "t.db"
    store = open_store(f"sqlite:///{db}")
    try:
        await store.start_flow(StartRequest("f", "T", b"null", FlowConfig(), None))
        lock = Path(f"{db}-dexlock")
        assert await asyncio.to_thread(lock.exists), "a write did not create the turn's lock file"
        holder = hold_turn(lock, holder_of)

        # A read needs no turn (bounded: a read that waited for the turn would wait for ever).
        assert (await asyncio.wait_for(store.read_attribute("f", "A", ""), 30)) is None

        write = asyncio.ensure_future(store.raw(write_marker("f"), write=True))

        async def waiting() -> bool:
            return blocked_on(lock)

        await wait_until("the store's thread waits for the turn", waiting)
        assert not write.done()
        assert holder.stdin is not None
        holder.stdin.close()  # the holder exits, and the kernel releases its turn
        await write
        assert (await store.read_attribute("f", "A", "")) == b"1"
    finally:
        for proc in holder_of:
            proc.kill()  # before closing: a store thread blocked on the turn would never stop
        await store.close()


async def test_writes_go_on_without_turns_when_the_lock_file_cannot_be_opened(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    db = tmp_path / "t.db"
    await asyncio.to_thread(Path(f"{db}-dexlock").mkdir)  # a directory where the lock file would go
    store = open_store(f"sqlite:///{db}")
    try:
        with caplog.at_level(logging.WARNING, logger="dex_engine"):
            for fid in ("a", "b"):
                await store.start_flow(StartRequest(fid, "T", b"null", FlowConfig(), None))
                await store.raw(write_marker(fid), write=True)
        for fid in ("a", "b"):
            assert (await store.read_attribute(fid, "A", "")) == b"1"
        warnings = [r.getMessage() for r in caplog.records if "-dexlock" in r.getMessage()]
        assert len(warnings) == 1, warnings
        assert "busy handler alone" in warnings[0]
    finally:
        await store.close()


def turn_is_free(lock: Path) -> bool:
    """Whether another open of the lock file can take the turn now (released by the others)."""
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def gave_up_waiting(
        tmp_path: Path, started: list[subprocess.Popen[str]]) -> tuple[WriterTurns, Path, subprocess.Popen[str]]:
    """A writer (waiting 0.2 s at most) that gave up waiting for the turn another process holds: its
    request stays with its helper thread, still blocked in flock."""
    turns = WriterTurns(str(tmp_path / "t.db"), wait_seconds=0.2)
    lock = Path(turns.path)
    with turns:
        pass  # creates the lock file
    holder = hold_turn(lock, started)
    with turns:
        assert not turns._held
    return turns, lock, holder


async def test_a_writer_waits_for_a_frozen_holder_only_so_long_and_releases_a_late_turn(
        tmp_path: Path, holder_of: list[subprocess.Popen[str]], caplog: pytest.LogCaptureFixture) -> None:
    """The holder never lets go within the wait: the writer goes on without the turn, and says so.
    When the holder exits, the turn granted late is not kept, or no other process could take it."""
    turns = WriterTurns(str(tmp_path / "t.db"), wait_seconds=0.2)
    lock = Path(turns.path)
    with turns:
        pass  # creates the lock file
    holder = hold_turn(lock, holder_of)
    with caplog.at_level(logging.WARNING, logger="dex_engine"), turns:
        assert not turns._held
    assert any("writing without it" in r.getMessage() for r in caplog.records)
    assert holder.stdin is not None
    holder.stdin.close()
    holder.wait()

    async def free() -> bool:
        return turn_is_free(lock)

    await wait_until("the late turn released", free)
    turns.close()


async def test_a_late_turn_goes_to_the_next_waiting_write(
        tmp_path: Path, holder_of: list[subprocess.Popen[str]]) -> None:
    turns, lock, holder = gave_up_waiting(tmp_path, holder_of)
    turns.wait_seconds = 60
    waiter = turns._waiter
    entered, leave = threading.Event(), threading.Event()

    def write() -> None:
        with turns:
            assert turns._held
            entered.set()
            leave.wait(60)

    writer = threading.Thread(target=write)
    writer.start()
    assert holder.stdin is not None
    holder.stdin.close()  # the turn frees; the newer request gets it
    assert await asyncio.to_thread(entered.wait, 60)
    assert not turn_is_free(lock), "the writer holds the turn, yet another open could take it"
    # The one waiting thread took the newer request too: a thread per blocked write would be a leak.
    assert turns._waiter is waiter and waiter is not None
    leave.set()
    await asyncio.to_thread(writer.join, 60)
    assert turn_is_free(lock)
    turns.close()


def test_a_turn_freed_while_the_waiter_still_takes_it_for_a_writer_that_gave_up_is_not_shared(
        tmp_path: Path, holder_of: list[subprocess.Popen[str]]) -> None:
    """The holder lets go while the waiting thread still blocks in flock for a request its caller gave
    up on: a try_enter then waits for the thread to settle, and takes the turn after. Catches: the
    try_enter succeeding on the same open file as the thread's flock, and the thread then releasing
    the turn (its caller gone) under the writer that believed it held it."""
    turns, lock, holder = gave_up_waiting(tmp_path, holder_of)
    waiter = turns._waiter
    assert waiter is not None
    with waiter._cv:  # the thread cannot settle its flock's result meanwhile
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(60)
        assert not turns.try_enter()
    assert wait_for_thread(lambda: not waiter.busy())
    assert turns.try_enter()
    assert turns._held and not turn_is_free(lock)
    turns.leave()
    assert turn_is_free(lock)
    turns.close()


def wait_for_thread(done: Callable[[], bool]) -> bool:
    """Whether `done` came true within 60 s (a hang guard), polled every millisecond."""
    for _ in range(60_000):
        if done():
            return True
        time.sleep(0.001)
    return False


async def test_a_store_write_goes_on_when_the_turn_never_comes(
        tmp_path: Path, holder_of: list[subprocess.Popen[str]], monkeypatch: pytest.MonkeyPatch) -> None:
    db = tmp_path / "t.db"
    monkeypatch.setattr(_sqlite_store, "WriterTurns", functools.partial(WriterTurns, wait_seconds=0.2))
    store = open_store(f"sqlite:///{db}")
    try:
        await store.start_flow(StartRequest("f", "T", b"null", FlowConfig(), None))
        hold_turn(Path(f"{db}-dexlock"), holder_of)
        await asyncio.wait_for(store.raw(write_marker("f"), write=True), 30)
        assert (await store.read_attribute("f", "A", "")) == b"1"
    finally:
        for proc in holder_of:
            proc.kill()
        await store.close()


def test_a_turn_taken_at_once_is_the_with_blocks_own_and_released_after_it(tmp_path: Path) -> None:
    """`with WriterTurns(path) as turns` hands back the turns object; the flock is held inside the
    block (another open file of the lock cannot take it) and released on the way out."""
    turns = WriterTurns(str(tmp_path / "w.db"))
    lock = Path(turns.path)
    with turns as entered:
        assert entered is turns
        assert not turn_is_free(lock)
    assert turn_is_free(lock)


def test_the_lock_file_is_made_readable_by_all_and_closing_closes_it(tmp_path: Path) -> None:
    """The lock file is created rw-r--r-- less the umask, as SQLite creates the database file beside
    it; close() closes the descriptor it opened."""
    turns = WriterTurns(str(tmp_path / "w.db"))
    assert turns.try_enter()
    turns.leave()
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(os.stat(turns.path).st_mode) == 0o644 & ~umask
    fd = turns._fd
    assert fd is not None
    turns.close()
    with pytest.raises(OSError):
        os.fstat(fd)
    # A second close() closes nothing: the descriptor's number may already name another file.
    other = os.open(tmp_path / "other", os.O_RDWR | os.O_CREAT)
    try:
        turns.close()
        os.fstat(other)
    finally:
        os.close(other)


def _closed(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return True
    return False


async def test_a_turn_waited_for_is_held_once_granted_and_close_ends_the_waiter(
        tmp_path: Path, holder_of: list[subprocess.Popen[str]]) -> None:
    """A writer that waited for the holder gets the turn when the holder exits, and holds it through
    its block: no other process can take it meanwhile. close() then stops the idle waiting thread,
    which closes the lock file."""
    turns = WriterTurns(str(tmp_path / "t.db"), wait_seconds=30)
    lock = Path(turns.path)
    with turns:
        pass  # creates the lock file
    holder = hold_turn(lock, holder_of)
    assert holder.stdin is not None
    threading.Timer(0.2, holder.stdin.close).start()  # the holder exits a moment after we start waiting
    with turns:
        assert turns._held and turns._waiter is not None
        assert not turn_is_free(lock)
    assert turn_is_free(lock)
    fd = turns._fd
    assert fd is not None
    turns.close()

    async def fd_closed() -> bool:
        return _closed(fd)

    await wait_until("the waiting thread closed the lock file", fd_closed)


async def test_closing_while_a_flock_is_still_blocked_closes_the_file_once_it_returns(
        tmp_path: Path, holder_of: list[subprocess.Popen[str]]) -> None:
    """A writer gave up waiting, and is closed while its waiting thread is still blocked in flock:
    the file stays open until the flock returns (closing it under a blocked flock is undefined), then
    the turn is released and the file closed."""
    turns, lock, holder = gave_up_waiting(tmp_path, holder_of)
    fd = turns._fd
    assert fd is not None
    turns.close()
    assert not _closed(fd)  # still blocked in flock on it
    assert holder.stdin is not None
    holder.stdin.close()
    holder.wait()

    async def released_and_closed() -> bool:
        return _closed(fd) and turn_is_free(lock)

    await wait_until("the late turn released and the file closed", released_and_closed)
