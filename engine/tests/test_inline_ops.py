"""SqliteStore runs an operation on its caller's event loop when that loop and the store's thread
are both idle (one Step after another), and hands it to the thread otherwise. These tests pin when
it may, and that it never waits on the loop: not for SQLite's lock, not for another process's
write turn, and never ahead of an operation queued before it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import fcntl
import gc
import os
import signal
import socket
import sqlite3
import threading
import time
import weakref
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from dex_engine import _transitions as tx
from dex_engine._limits import INLINE_YIELDS, SQLITE_WRITER_TURN_SUFFIX
from dex_engine._sqlite_store import SqliteStore, _Op, parse_sqlite_url

from .conftest import wait_until

# How long the test holds a lock before letting the queued write through.
HOLD_SECONDS = 0.5


@pytest.fixture
async def store(tmp_path: Path) -> Any:
    s = SqliteStore(f"sqlite:///{tmp_path / 'inline.db'}")
    await s.raw(lambda db: db.run("CREATE TABLE marks (mark TEXT)"), write=True)
    yield s
    await s.close()


def mark(text: str, ran: list[tuple[str, int]]) -> Any:
    """An operation that records where it ran and inserts one row."""
    def op(db: tx.Db) -> int:
        ran.append((text, threading.get_ident()))
        db.run("INSERT INTO marks (mark) VALUES (?)", (text,))
        return threading.get_ident()
    return op


def taken_by_thread(store: SqliteStore) -> Callable[[], Awaitable[bool]]:
    """A probe: the store's thread has taken the one queued operation but not yet run it."""

    async def taken() -> bool:
        return store._outstanding == 1 and store._queue.empty()

    return taken


async def marks(store: SqliteStore) -> list[str]:
    rows = await store.raw(lambda db: db.all("SELECT mark FROM marks ORDER BY rowid"))
    return [r[0] for r in rows]


async def test_an_idle_loop_runs_the_operation_itself_and_a_busy_one_hands_it_off(store: SqliteStore) -> None:
    ran: list[tuple[str, int]] = []
    here = threading.get_ident()
    assert await store.raw(mark("idle", ran), write=True) == here
    assert await store.raw(lambda db: threading.get_ident()) == here  # reads too
    loop = asyncio.get_running_loop()
    # A callback that schedules another, so the loop is still busy after the rounds an operation
    # lets it have (INLINE_YIELDS).
    keep_busy = INLINE_YIELDS + 2

    def busy() -> None:
        nonlocal keep_busy
        keep_busy -= 1
        if keep_busy:
            loop.call_soon(busy)

    loop.call_soon(busy)
    assert await store.raw(mark("busy", ran), write=True) != here
    assert await marks(store) == ["idle", "busy"]


async def test_operations_back_to_back_on_an_idle_loop_still_let_its_timers_fire(store: SqliteStore) -> None:
    """A caller that runs operations one after another (a client paging through a long transcript)
    finds its loop idle before each, since its timers are not yet in the ready queue: run inline
    every time, its task never suspended, and no timer fired until it stopped (a sleep, a
    wait_for timeout, an in-process Worker's lease renewal). A due timer now sends the operation to
    the store's thread, so the caller waits and the loop runs the timer."""
    loop = asyncio.get_running_loop()
    fired: list[float] = []
    started = loop.time()
    loop.call_later(0.01, lambda: fired.append(loop.time()))
    while loop.time() - started < 0.5:
        await store.raw(lambda db: db.one("SELECT count(*) FROM marks"))
    assert fired, "a timer due after 10 ms did not fire while operations ran back to back for 0.5 s"
    assert fired[0] - started < 0.2, f"the timer due after 10 ms fired after {fired[0] - started:.3f} s"


async def test_operations_back_to_back_on_an_idle_loop_still_let_it_answer_a_socket(store: SqliteStore) -> None:
    """A caller running operations one after another (paging through a long transcript, polling a
    snapshot) with no timer scheduled: its loop has nothing ready before each, so each ran inline,
    the caller never suspended, and the loop never polled its sockets. A server on that loop (an
    HTTP handler, another client's connection) got no byte until the caller stopped. A socket with
    something to read now sends the operation to the store's thread, so the loop serves it."""
    here = threading.get_ident()
    answered = asyncio.Event()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readline()
        answered.set()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    read = lambda db: (db.one("SELECT count(*) FROM marks"), threading.get_ident())[1]  # noqa: E731
    try:
        # Run inline before the client writes: the loop is otherwise idle.
        assert await store.raw(read) == here
        # A blocking client on this thread: the kernel completes its connect and takes its line
        # without the loop, which must then poll the listening socket and the connection.
        with socket.create_connection(("127.0.0.1", port)) as client:
            client.sendall(b"hello\n")
            sent = time.monotonic()
            while not answered.is_set() and time.monotonic() - sent < 3:
                await store.raw(read)
            waited = time.monotonic() - sent
    finally:
        server.close()
        await server.wait_closed()
    assert answered.is_set(), "the server never read a line sent while operations ran back to back for 3 s"
    assert waited < 0.5, f"the server read a line {waited:.3f} s after it was sent"


async def test_operations_back_to_back_on_an_idle_loop_still_let_it_handle_a_signal(store: SqliteStore) -> None:
    """asyncio hands a signal to its loop through a socket the loop watches (the CLI Worker's
    SIGTERM handler is one): operations run back to back inline kept it from the handler, and the
    process from stopping, until they stopped."""
    loop = asyncio.get_running_loop()
    handled = asyncio.Event()
    loop.add_signal_handler(signal.SIGUSR1, handled.set)
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        sent = time.monotonic()
        while not handled.is_set() and time.monotonic() - sent < 3:
            await store.raw(lambda db: db.one("SELECT count(*) FROM marks"))
        waited = time.monotonic() - sent
    finally:
        loop.remove_signal_handler(signal.SIGUSR1)
    assert handled.is_set(), "a signal sent while operations ran back to back for 3 s was never handled"
    assert waited < 0.5, f"the signal was handled {waited:.3f} s after it was sent"


async def test_two_operations_ready_at_once_on_an_idle_loop_both_run_inline(store: SqliteStore) -> None:
    """Two tasks start an operation in the same round of an otherwise idle loop (an attempt's
    commit and a reader woken by the commit before it): each finds the other's wake-up ready. Each
    lets the loop run, and the one that runs again first goes ahead on the loop; neither waits for
    the other until both hand off. Catches two such operations each deferring to the other until
    both went to the store's thread (an Execute's commit there folds nothing)."""
    here = threading.get_ident()
    ran: list[tuple[str, int]] = []
    threads = await asyncio.gather(store.raw(mark("first", ran), write=True),
                                   store.raw(mark("second", ran), write=True))
    assert threads == [here, here]
    assert sorted(await marks(store)) == ["first", "second"]


async def test_callbacks_ready_before_an_operation_run_first_and_then_it_runs_inline(store: SqliteStore) -> None:
    """What is ready (often the caller's own continuation) gets one round of the loop; an
    operation that then finds the loop idle runs on it instead of paying a hand-off."""
    ran: list[tuple[str, int]] = []
    order: list[str] = []
    asyncio.get_running_loop().call_soon(order.append, "ready callback")
    assert await store.raw(mark("after", ran), write=True) == threading.get_ident()
    order.append("operation")
    assert order == ["ready callback", "operation"]
    assert await marks(store) == ["after"]


async def test_with_the_thread_busy_an_operation_joins_its_queue_without_waiting_for_the_loop(
    store: SqliteStore,
) -> None:
    """The store's thread has work (so nothing could run inline): a new operation is queued at once
    to share the thread's next group commit, before the loop's ready callbacks run."""
    conn_lock: threading.Lock = store._conn_lock  # type: ignore[attr-defined]
    ran: list[tuple[str, int]] = []
    queued_when_callback_ran: list[int] = []
    conn_lock.acquire()
    try:
        first = asyncio.ensure_future(asyncio.to_thread(store.run_sync, mark("first", ran), write=True))

        await wait_until("the store's thread to take first", taken_by_thread(store))
        second = asyncio.ensure_future(store.raw(mark("second", ran), write=True))
        asyncio.get_running_loop().call_soon(lambda: queued_when_callback_ran.append(store._outstanding))
        await asyncio.sleep(0)  # `second` starts (the callback is ready by then), then the callback runs
        await asyncio.sleep(0)
    finally:
        conn_lock.release()
    await first
    await second
    assert queued_when_callback_ran == [2], "the operation waited for the loop instead of joining the queue"
    assert [text for text, _ in ran] == ["first", "second"]


async def test_a_store_closed_while_an_operation_lets_the_loop_run_refuses_it(tmp_path: Path) -> None:
    """Closing while the operation yields to ready callbacks: a clear error, not an operation queued
    behind the thread's stop that nobody would ever run."""
    s = SqliteStore(f"sqlite:///{tmp_path / 'closing.db'}")
    await s.raw(lambda db: db.run("CREATE TABLE marks (mark TEXT)"), write=True)
    late = asyncio.ensure_future(s.raw(mark("late", []), write=True))
    closing = asyncio.ensure_future(s.close())  # ready when `late` starts: it runs while `late` yields
    with pytest.raises(RuntimeError, match="is closed"):
        await asyncio.wait_for(late, 10)
    await closing


async def test_inline_off_in_the_url_keeps_every_operation_on_the_thread(tmp_path: Path) -> None:
    s = SqliteStore(f"sqlite:///{tmp_path / 'off.db'}?inline=off&synchronous=FULL")
    try:
        assert s.settings.inline is False
        assert await s.raw(lambda db: threading.get_ident()) != threading.get_ident()
        assert await s.raw(lambda db: threading.get_ident(), write=True) != threading.get_ident()
    finally:
        await s.close()
    assert parse_sqlite_url("sqlite:///x.db").inline and parse_sqlite_url("sqlite:///x.db?inline=ON").inline


async def test_an_operation_never_overtakes_one_queued_before_it(store: SqliteStore) -> None:
    """The thread has taken `first` from its queue but not yet the connection: `second`, asked for
    on an idle loop with the connection free, must still run after it."""
    ran: list[tuple[str, int]] = []
    conn_lock: threading.Lock = store._conn_lock  # type: ignore[attr-defined]

    conn_lock.acquire()
    try:
        first = asyncio.ensure_future(asyncio.to_thread(store.run_sync, mark("first", ran), write=True))
        await wait_until("the store's thread to take first", taken_by_thread(store))
    finally:
        conn_lock.release()
    # No await between the release and this call: the store's thread cannot have run `first` yet.
    second = await store.raw(mark("second", ran), write=True)
    await first
    assert [text for text, _ in ran] == ["first", "second"]
    assert await marks(store) == ["first", "second"]
    assert second != threading.get_ident()


async def test_a_write_waits_for_sqlite_lock_on_the_thread_not_on_the_loop(store: SqliteStore) -> None:
    """Another connection (the sqlite3 shell, say) holds the write lock: the write must neither fail
    nor block the loop, and lands once when the lock is free."""
    other = sqlite3.connect(store.settings.path, isolation_level=None, check_same_thread=False)
    other.execute("BEGIN IMMEDIATE")
    ran: list[tuple[str, int]] = []
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    ticking = asyncio.create_task(ticker())
    try:
        threading.Timer(HOLD_SECONDS, lambda: other.execute("COMMIT")).start()
        await asyncio.sleep(0)  # the ticker's first step: then the loop is idle for the write
        await store.raw(mark("blocked", ran), write=True)
    finally:
        ticking.cancel()
        other.close()
    assert ticks >= HOLD_SECONDS / 0.01 / 4, f"the loop stalled while the write waited: {ticks} ticks"
    assert await marks(store) == ["blocked"]
    assert all(thread != threading.get_ident() for _, thread in ran)


async def test_a_write_waits_for_another_process_turn_on_the_thread(store: SqliteStore) -> None:
    """Another process holds the file's write turn (its flock): the loop hands the write to the
    store's thread, which waits for the turn, instead of blocking on it."""
    fd = os.open(store.settings.path + SQLITE_WRITER_TURN_SUFFIX, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    ran: list[tuple[str, int]] = []
    started = asyncio.get_running_loop().time()
    try:
        threading.Timer(HOLD_SECONDS, lambda: fcntl.flock(fd, fcntl.LOCK_UN)).start()
        write = asyncio.ensure_future(store.raw(mark("turn", ran), write=True))
        await asyncio.sleep(HOLD_SECONDS / 5)
        assert not write.done(), "the write went ahead while another process held the turn"
        assert asyncio.get_running_loop().time() - started < HOLD_SECONDS, "the loop waited for the turn"
        await write
    finally:
        os.close(fd)
    assert [text for text, _ in ran] == ["turn"] and ran[0][1] != threading.get_ident()
    assert await marks(store) == ["turn"]


async def test_a_read_runs_on_the_loop_while_another_connection_writes(store: SqliteStore) -> None:
    """WAL readers never wait for the writer: a read keeps the fast path."""
    other = sqlite3.connect(store.settings.path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    try:
        other.execute("INSERT INTO marks (mark) VALUES ('uncommitted')")
        assert await marks(store) == []
        assert await store.raw(lambda db: threading.get_ident()) == threading.get_ident()
    finally:
        other.execute("ROLLBACK")
        other.close()


def test_two_event_loops_sharing_the_store_each_keep_their_order(tmp_path: Path) -> None:
    """Two threads, each with its own idle event loop, write through one store at once: some writes
    run on a loop, some on the store's thread. Every write lands once, each loop's in its order."""
    store = SqliteStore(f"sqlite:///{tmp_path / 'two.db'}")
    per_loop = 200
    where: dict[str, set[int]] = {"a": set(), "b": set()}

    async def writer(name: str) -> None:
        for i in range(per_loop):
            ran: list[tuple[str, int]] = []
            if i % 4 == 0:
                # A loop with other work ready hands its write to the store's thread: without this,
                # an idle loop's write (done without yielding) seldom meets the other's.
                keep_busy(asyncio.get_running_loop(), INLINE_YIELDS + 2)
            await store.raw(mark(f"{name}{i:04d}", ran), write=True)
            where[name].add(ran[0][1])

    async def setup() -> None:
        await store.raw(lambda db: db.run("CREATE TABLE marks (mark TEXT)"), write=True)

    asyncio.run(setup())
    threads = [threading.Thread(target=asyncio.run, args=(writer(name),)) for name in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)

    async def check() -> None:
        stored = await marks(store)
        for name in ("a", "b"):
            mine = [m for m in stored if m.startswith(name)]
            assert mine == [f"{name}{i:04d}" for i in range(per_loop)], f"loop {name}'s writes out of order or lost"
        await store.close()

    asyncio.run(check())
    loop_threads = {t.ident for t in threads}
    assert (where["a"] | where["b"]) - loop_threads, "no write went to the store's thread"
    assert (where["a"] | where["b"]) & loop_threads, "no write ran on its own loop"


def test_a_store_keeps_no_event_loop_it_served_after_that_loop_ends(tmp_path: Path) -> None:
    """One store serving a fresh loop per call (asyncio.run per request in a threaded web app, a
    test framework's loop per test): each loop is freed once it ends, also one whose operation was
    cancelled while it let the loop run first. Catches: the store counted the operations letting
    each loop run in a dict keyed by loop and never removed the key, keeping every loop (some KB
    each) for the life of the store."""
    store = SqliteStore(f"sqlite:///{tmp_path / 'loops.db'}")
    served: list[weakref.ref[asyncio.AbstractEventLoop]] = []

    async def request(cancel: bool) -> None:
        loop = asyncio.get_running_loop()
        served.append(weakref.ref(loop))
        keep_busy(loop, INLINE_YIELDS + 2)  # so the operation lets the loop run before its own
        op = asyncio.ensure_future(store.raw(lambda db: db.one("SELECT 1")))
        if cancel:
            await asyncio.sleep(0)
            op.cancel()
        await asyncio.gather(op, return_exceptions=True)

    async def readying_request() -> None:
        # An operation run inline, on an idle loop, that leaves a callback ready as it ends (another
        # thread's call_soon_threadsafe can, too): it overtook no operation letting the loop run.
        loop = asyncio.get_running_loop()
        served.append(weakref.ref(loop))
        await store.raw(lambda db: (loop.call_soon(lambda: None), db.one("SELECT 1"))[1])

    for i in range(20):
        asyncio.run(request(cancel=i % 2 == 1))
        asyncio.run(readying_request())
    store.run_sync(lambda db: None, write=False)  # the store's thread lets go of the last batch it ran
    gc.collect()
    assert [ref for ref in served if ref() is not None] == []
    asyncio.run(store.close())


def commit_from_another_process(store: SqliteStore) -> None:
    """Commit a mark through a connection of the store's file that is not the store's."""
    other = sqlite3.connect(store.settings.path, isolation_level=None)
    try:
        other.execute("INSERT INTO marks (mark) VALUES ('from another process')")
    finally:
        other.close()


async def test_a_watch_set_while_every_operation_ran_inline_still_sees_another_connections_commit(
    store: SqliteStore,
) -> None:
    """The store's thread reads data_version only while it waits with an interval. Set after the
    thread went to sleep without one, and with every operation of this process run inline (so none
    wakes the thread), the interval must still take effect: another process's commit wakes the
    listeners. Catches a thread that picks up a new interval only when some operation reaches it."""
    assert await store.raw(lambda db: threading.get_ident()) == threading.get_ident()
    woken = asyncio.Event()
    store.add_commit_listener(woken.set)
    assert store.watch_foreign_commits(0.01)
    commit_from_another_process(store)
    async with asyncio.timeout(5):
        await woken.wait()
    assert await marks(store) == ["from another process"]


async def test_workers_sharing_a_store_watch_at_the_shortest_of_their_intervals(store: SqliteStore) -> None:
    """Two workers share the store, one polling hourly and one every 10 ms: another process's
    commit wakes the listeners within the shorter interval, whichever worker asked last. Catches
    the longest interval kept, the busy worker then hearing of commits only at its housekeeping."""
    woken = asyncio.Event()
    store.add_commit_listener(woken.set)
    assert store.watch_foreign_commits(0.01)
    assert store.watch_foreign_commits(3600)
    commit_from_another_process(store)
    async with asyncio.timeout(5):
        await woken.wait()


def keep_busy(loop: asyncio.AbstractEventLoop, times: int) -> None:
    """Keep `loop` from going idle for `times` rounds of callbacks."""
    left = [times]

    def busy() -> None:
        left[0] -= 1
        if left[0]:
            loop.call_soon(busy)

    loop.call_soon(busy)


@pytest.mark.parametrize("traffic", ["reads", "own appends"])
@pytest.mark.parametrize("inline", ["on", "off"])
async def test_steady_traffic_that_wakes_nobody_does_not_hide_another_process_commit(
    tmp_path: Path, traffic: str, inline: str,
) -> None:
    """The store's thread reads data_version on a deadline, not only after an idle interval: reads
    or a worker's own event appends arriving more often than the interval must not keep another
    process's commit (a cancel, new work) from waking the worker until its housekeeping."""
    from dex_engine._store import commit_origin

    s = SqliteStore(f"sqlite:///{tmp_path / 'watch.db'}?inline={inline}")
    await s.raw(lambda db: db.run("CREATE TABLE marks (mark TEXT)"), write=True)
    woken = asyncio.Event()
    s.add_commit_listener(woken.set)
    s.watch_foreign_commits(0.02)
    commit_origin.set(woken.set)  # as in a worker's attempt: its own commits do not wake it
    stop = False

    async def steady() -> None:
        while not stop:
            keep_busy(asyncio.get_running_loop(), INLINE_YIELDS + 2)  # other attempts: it goes to the thread
            if traffic == "reads":
                await s.raw(lambda db: db.one("SELECT count(*) FROM marks"))
            else:
                await s.raw(lambda db: db.run("INSERT INTO marks VALUES ('event')"), write=True)
            await asyncio.sleep(0.005)

    running = asyncio.create_task(steady())
    try:
        await asyncio.sleep(0.2)
        woken.clear()
        other = sqlite3.connect(s.settings.path, isolation_level=None)
        other.execute("INSERT INTO marks VALUES ('another process')")
        other.close()
        async with asyncio.timeout(1.0):  # housekeeping would come after seconds, not this
            await woken.wait()
    finally:
        stop = True
        await running
        await s.close()


async def test_a_failing_read_in_a_batch_of_reads_takes_no_write_lock(tmp_path: Path) -> None:
    """A batch runs again operation by operation after one fails; a batch of reads does so without
    the write lock, so its good reads do not wait for another connection's write."""
    s = SqliteStore(f"sqlite:///{tmp_path / 'reads.db'}?inline=off")
    await s.raw(lambda db: db.run("CREATE TABLE marks (mark TEXT)"), write=True)
    other = sqlite3.connect(s.settings.path, isolation_level=None, check_same_thread=False)
    other.execute("BEGIN IMMEDIATE")  # another process writing for a while
    other.execute("INSERT INTO marks VALUES ('x')")
    try:
        slow = asyncio.ensure_future(s.raw(lambda db: threading.Event().wait(0.05)))  # the next two share a batch
        await asyncio.sleep(0.01)

        def fails(db: tx.Db) -> None:
            raise LookupError("no such flow")

        good = asyncio.ensure_future(s.raw(lambda db: db.one("SELECT count(*) FROM marks")))
        bad = asyncio.ensure_future(s.raw(fails))
        async with asyncio.timeout(HOLD_SECONDS):  # the writer holds its lock far longer
            results = await asyncio.gather(good, bad, return_exceptions=True)
        await slow
        assert results[0] == (0,)
        assert isinstance(results[1], LookupError)
    finally:
        other.execute("ROLLBACK")
        other.close()
        await s.close()


async def test_an_operation_after_close_is_refused_not_left_waiting(tmp_path: Path) -> None:
    """One queued after close() (from code without a loop, or a loop that passed the closed check
    just before) would sit behind the thread's stop for ever; it is refused instead."""
    s = SqliteStore(f"sqlite:///{tmp_path / 'closed.db'}")
    await s.close()
    outcome: list[str] = []

    def call() -> None:
        try:
            s.run_sync(lambda db: db.one("SELECT 1"), write=False)
            outcome.append("ran")
        except RuntimeError as exc:
            outcome.append(str(exc))

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    caller.join(2.0)
    assert len(outcome) == 1 and "is closed" in outcome[0], outcome


async def test_an_operation_queued_behind_close_nowaits_stop_is_refused_not_left_waiting(tmp_path: Path) -> None:
    """close_nowait takes no lock (a finalizer may run it inside _enqueue), so an operation that
    passed the closed check just before it is queued behind the thread's stop: the thread refuses
    it as it ends. Catches: that caller waiting for ever."""
    s = SqliteStore(f"sqlite:///{tmp_path / 'nowait.db'}")
    conn_lock: threading.Lock = s._conn_lock
    conn_lock.acquire()
    try:
        first = asyncio.ensure_future(asyncio.to_thread(s.run_sync, lambda db: None, write=True))
        await wait_until("the store's thread to take first", taken_by_thread(s))
        s.close_nowait()
        late: concurrent.futures.Future[None] = concurrent.futures.Future()
        s._queue.put(_Op(lambda db: None, True, True, None, late))  # as _enqueue did, having checked before
    finally:
        conn_lock.release()
    await first
    with pytest.raises(RuntimeError, match="is closed"):
        await asyncio.wait_for(asyncio.wrap_future(late), 10)
    await s.close()


async def test_operations_back_to_back_do_not_keep_an_operation_letting_the_loop_run_waiting(
    store: SqliteStore,
) -> None:
    """An operation that finds callbacks ready lets the loop run them first (INLINE_YIELDS rounds),
    and another task's operations do not count its wake-up as work for the loop. A task running
    operations back to back (a client exporting transcripts, a UI polling a snapshot) then ran each
    one inline and never suspended, so the waiting operation's task never ran again: a write on the
    same loop hung until the reader stopped (here, until wait_for's timer came due). It now runs
    ahead of a waiting operation once, then lets it have its round."""
    stop = False
    reads = 0

    async def reader() -> None:
        nonlocal reads
        while not stop:
            await store.raw(lambda db: db.one("SELECT count(*) FROM marks"))
            reads += 1

    task = asyncio.create_task(reader())
    ran: list[tuple[str, int]] = []
    try:
        for number in range(20):
            # Woken by a timer, the writer works a little: meanwhile the reader's operation, handed
            # off for the due timer, completes, so the write finds the reader's wake-up ready.
            await asyncio.sleep(0.01)
            time.sleep(0.01)  # noqa: ASYNC251 - blocking on purpose, as handler work would
            started = time.monotonic()
            await asyncio.wait_for(store.raw(mark(f"w{number}", ran), write=True), 3)
            waited = time.monotonic() - started
            assert waited < 0.5, f"write {number} waited {waited:.3f} s while another task read back to back"
    finally:
        stop = True
        await task
    assert reads > 0
    assert len(await marks(store)) == 20
