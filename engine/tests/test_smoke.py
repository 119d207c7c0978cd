from __future__ import annotations

import _thread
import asyncio
import contextlib
import gc
import inspect
import itertools
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any
from unittest import mock

import pytest

from dex_engine import (
    AsyncClient,
    AsyncWorker,
    Attribute,
    AttributeMap,
    Channel,
    Client,
    Context,
    Flow,
    FlowConfig,
    Registry,
    RpcContext,
    Step,
    StepDecision,
    Store,
    Stream,
    Timer,
    Wait,
    WorkerOptions,
    open_store,
    rpc,
)
from dex_engine import _worker as worker_module
from dex_engine._open import shown_url
from dex_engine._pg_store import NETWORK_TIMEOUTS, PostgresStore
from dex_engine._sqlite_store import SqliteStore

from .conftest import engine_for, wait_until

Count = Attribute("Count", int)
Inbox = Channel("Inbox", str)


async def count(ctx: Context, n: int) -> StepDecision:
    ctx.set(Count, (ctx.get(Count) or 0) + 1)
    if n <= 1:
        return StepDecision.go_to("Listen", None)
    return StepDecision.go_to("Count", n - 1)


async def listen_wait(ctx: Context, _: None) -> Wait:
    return Wait.until(Inbox.for_one())


async def listen(ctx: Context, _: None) -> StepDecision:
    assert ctx.wait_result is not None
    (msg,) = ctx.wait_result.messages(Inbox)
    return StepDecision.graceful_complete({"count": ctx.get(Count), "msg": msg})


@rpc(request_type=str)
async def say(ctx: RpcContext, text: str) -> int:
    ctx.publish(Inbox, text)
    return ctx.get(Count) or 0


FLOW = Flow(
    "Smoke",
    [Step("Count", count, input_type=int), Step("Listen", listen, wait_for=listen_wait, input_type=type(None))],
    start_step="Count",
    schema=[Count, Inbox],
    rpcs=[say],
)


Log = Stream("Log", str)


async def ticker_start(ctx: Context, _: None) -> StepDecision:
    ctx.write_event(Log, "started")
    return StepDecision.go_to("Sleep", None)


async def ticker_sleep_wait(ctx: Context, _: None) -> Wait:
    return Wait.until(Timer.by_duration(3600))  # fires only when skipped


async def ticker_sleep(ctx: Context, _: None) -> StepDecision:
    assert ctx.wait_result is not None and ctx.wait_result.timer_fired
    ctx.write_event(Log, "woke")
    return StepDecision.graceful_complete(None)


TICKER = Flow(
    "Ticker",
    [Step("Start", ticker_start, input_type=type(None)),
     Step("Sleep", ticker_sleep, wait_for=ticker_sleep_wait, input_type=type(None))],
    start_step="Start",
    schema=[Log],
)


async def test_chain_wait_and_rpc(db_url: str) -> None:
    async with engine_for(db_url, Registry([FLOW])) as eng:
        await eng.client.start_flow("Smoke", "f1", 5)
        from .conftest import wait_until

        async def listening() -> bool:
            info = await eng.client.describe_flow("f1")
            return any(s.step_type == "Listen" and s.state == "waiting" for s in info.active_steps)

        await wait_until("Listen waiting", listening)
        assert await eng.client.rpc("f1", "say", "hello") == 5
        info = await eng.client.wait_for_flow("f1", 10)
        assert info.status == "completed"
        assert await eng.client.flow_output("f1") == {"count": 5, "msg": "hello"}


async def test_a_call_on_a_closed_async_client_says_to_open_the_database_again(db_url: str) -> None:
    """A web handler that closes a shared AsyncClient and calls it later gets an error saying what
    closed the store and what to do, not only that a store is closed."""
    async with engine_for(db_url, Registry([FLOW])):
        client = AsyncClient(Registry([FLOW]), db_url)
        await client.close()
        with pytest.raises(RuntimeError) as caught:
            await client.describe_flow("f1")
        assert str(caught.value) == (
            f"store {shown_url(db_url)!r} is closed; the AsyncClient, AsyncWorker or open_store() call that opened"
            " it has closed it; open the database again (a new AsyncClient or AsyncWorker)"
        )


async def test_the_blocking_client_drives_a_flow(db_url: str) -> None:
    """Client, the blocking twin of AsyncClient, from a plain thread: start a flow, find it waiting,
    read its state, call an RPC, publish, read history, stop another flow, and close its loop thread."""
    def until_listening(client: Client, flow_id: str) -> None:
        deadline = time.monotonic() + 10
        while not any(s.step_type == "Listen" and s.state == "waiting"
                      for s in client.describe_flow(flow_id).active_steps):
            assert time.monotonic() < deadline, f"{flow_id} never waited in Listen"
            time.sleep(0.01)

    def drive() -> None:
        with Client(Registry([FLOW]), db_url) as client:
            client.start_flow("Smoke", "b1", 3)
            until_listening(client, "b1")
            assert client.search_flows('ActiveStepTypes = "Listen"') == ["b1"]
            assert client.get_attribute("b1", Count) == 3
            assert client.rpc("b1", "say", "by rpc") == 3
            assert client.wait_for_flow("b1", 10).status == "completed"
            assert "execute_completed" in {e.event_type for e in client.get_flow_history("b1")}

            client.start_flow("Smoke", "b2", 1)
            until_listening(client, "b2")
            client.publish("b2", Inbox, "published")
            assert client.wait_for_flow("b2", 10).status == "completed"

            client.start_flow("Smoke", "b3", 1)
            until_listening(client, "b3")
            client.stop_flow("b3", "not needed")
            stopped = client.wait_for_flow("b3", 10)
            assert (stopped.status, stopped.error) == ("stopped", "not needed")
        # Closing joins its event-loop thread and closes the store it opened.
        assert "dex-client" not in {t.name for t in threading.enumerate()}
        with pytest.raises(RuntimeError, match="is closed"):
            asyncio.run(client._async.store.describe_flow("b1"))

    async with engine_for(db_url, Registry([FLOW])) as eng:
        await asyncio.to_thread(drive)
        assert await eng.client.flow_output("b2") == {"count": 1, "msg": "published"}


Tags = AttributeMap("Tags", str)


async def tag_and_end(ctx: Context, tags: list[str]) -> StepDecision:
    for tag in tags:
        ctx.set(Tags[tag], tag.upper())
    return StepDecision.graceful_complete(len(tags))


TAGGER = Flow("Tagger", [Step("Tag", tag_and_end, input_type=list[str])], start_step="Tag", schema=[Tags])


def test_the_blocking_client_has_every_call_of_the_async_client() -> None:
    """Client is documented as AsyncClient's blocking twin. Catches: a call added to AsyncClient only
    (get_attribute_map, update_flow_config, flow_output and exists were missing)."""
    def calls(cls: type) -> set[str]:
        return {name for name, member in vars(cls).items() if not name.startswith("_") and callable(member)}

    assert calls(AsyncClient) - calls(Client) == set()


async def test_the_blocking_client_reads_a_map_and_the_output_and_updates_the_config(db_url: str) -> None:
    """Client.get_attribute_map, flow_output, exists and update_flow_config give what AsyncClient's give."""
    def drive() -> None:
        with Client(Registry([TAGGER, FLOW]), db_url) as client:
            assert client.exists("t1") is False
            client.start_flow("Tagger", "t1", ["b", "a"])
            assert client.wait_for_flow("t1", 10).status == "completed"
            assert client.exists("t1") is True
            assert client.flow_output("t1") == 2
            assert client.get_attribute_map("t1", Tags) == {"a": "A", "b": "B"}
            client.start_flow("Smoke", "s1", 1)  # waits in Listen: still running
            client.update_flow_config("s1", FlowConfig(active_step_search=False))
            assert client.describe_flow("s1").config == FlowConfig(active_step_search=False)

    async with engine_for(db_url, Registry([TAGGER, FLOW])):
        await asyncio.to_thread(drive)


async def test_the_blocking_client_reads_a_stream_and_skips_a_timer(db_url: str) -> None:
    """Client.read_stream long-polls and resumes from its token; Client.skip_timer fires a waiting
    Step's hour-long timer now."""
    def drive() -> None:
        with Client(Registry([TICKER]), db_url) as client:
            client.start_flow("Ticker", "t1")
            first = client.read_stream("t1", Log, wait_seconds=10)
            assert [e.value for e in first.events] == ["started"]
            deadline = time.monotonic() + 10
            while not (waiting := [s for s in client.describe_flow("t1").active_steps if s.state == "waiting"]):
                assert time.monotonic() < deadline, "Sleep never waited"
                time.sleep(0.01)
            client.skip_timer("t1", waiting[0].step_execution_id)
            assert client.wait_for_flow("t1", 10).status == "completed"
            rest = client.read_stream("t1", "Log", first.resume_token, limit=5)
            assert [e.value for e in rest.events] == ["woke"]
            assert rest.events[0].sequence > first.events[0].sequence

    async with engine_for(db_url, Registry([TICKER])):
        await asyncio.to_thread(drive)


async def test_closing_the_blocking_client_ends_calls_other_threads_wait_in(db_url: str) -> None:
    """close() while other threads wait in wait_for_flow or a long-polling read_stream: each gets a
    RuntimeError saying the client closed, at once. A second close does nothing; a call after close
    is refused. Catches: close() stopping the client's loop under the waiting calls, which then
    waited for ever, and a second close raising 'Event loop is closed'."""

    def drive() -> None:
        client = Client(Registry([TICKER]), db_url)
        client.start_flow("Ticker", "never")  # no worker: it never completes, nor writes an event
        outcomes: list[str] = []

        def wait(call: Callable[[], object]) -> threading.Thread:
            def run() -> None:
                try:
                    call()
                    outcomes.append("returned")
                except RuntimeError as exc:
                    outcomes.append(str(exc))
            thread = threading.Thread(target=run, daemon=True)
            thread.start()
            return thread

        threads = [wait(lambda: client.wait_for_flow("never", 60)),
                   wait(lambda: client.read_stream("never", Log, wait_seconds=60))]
        time.sleep(0.3)  # both are waiting on the client's loop
        client.close()
        for thread in threads:
            thread.join(10)
            assert not thread.is_alive(), "a call still waits after close()"
        assert outcomes == [f"client of {shown_url(db_url)!r} was closed while the call waited"] * 2
        client.close()
        with pytest.raises(RuntimeError, match="is closed") as refused:
            client.describe_flow("never")
        assert "open the database again with a new Client" in str(refused.value)  # says what to do

    await asyncio.to_thread(drive)


async def test_a_blocking_client_dropped_unclosed_closes_its_store_and_ends_its_thread(db_url: str) -> None:
    """A web handler that makes a Client per request and never closes it: once the client is
    collected its store closes and its loop thread ends, with a ResourceWarning saying to close it.
    Catches: each dropped client kept its loop thread, the store's threads and (PostgreSQL) its
    connections until the process exited (40 such requests held 400 threads and 118 connections)."""

    def drive() -> None:
        client = Client(Registry([FLOW]), db_url)
        client.start_flow("Smoke", "dropped", 1)
        thread, store = client._thread, client._async.store
        with pytest.warns(ResourceWarning, match="was never closed; call its close"):
            del client
            gc.collect()
        thread.join(30)  # a hang guard
        assert not thread.is_alive(), "the dropped client's loop thread still runs"
        with pytest.raises(RuntimeError, match="is closed"):
            asyncio.run(store.describe_flow("dropped"))

    await asyncio.to_thread(drive)


def _db_sessions(db_url: str) -> int | None:
    """Sessions on `db_url`'s PostgreSQL database other than this query's own; None on SQLite."""
    if not db_url.startswith("postgresql"):
        return None
    import psycopg

    with psycopg.connect(db_url, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                           " AND pid <> pg_backend_pid()").fetchone()
    assert row is not None
    return int(row[0])


def _threads_end(before: set[threading.Thread]) -> list[str]:
    """The names of the store threads (dex-sqlite, dex-pg-*, the pool's dex-engine-*) started since
    `before` that are still running after a hang guard: not asyncio.to_thread's, which stay."""
    started = {thread for thread in set(threading.enumerate()) - before if thread.name.startswith("dex-")}
    guard = time.monotonic() + 30  # a hang guard
    for thread in started:
        while True:
            try:
                thread.join(max(0.0, guard - time.monotonic()))
                break
            except RuntimeError:
                # Listed while its start() was still under way (threading.enumerate() includes
                # such threads), it cannot be joined until it runs, a moment later.
                if time.monotonic() > guard:
                    break
                time.sleep(0.001)
    return [thread.name for thread in started if thread.is_alive() or thread.ident is None]


def test_threads_end_waits_for_a_thread_still_starting() -> None:
    """threading.enumerate() lists a thread whose start() is under way, which join() refuses until it
    runs: _threads_end waits for it (CI once failed the Ctrl-C test below in that moment)."""
    before = set(threading.enumerate())
    done = threading.Event()
    late = threading.Thread(target=done.wait, name="dex-late", daemon=True)

    def start_late() -> None:
        late.start()
        done.set()

    starter = threading.Timer(0.05, start_late)
    with mock.patch.object(threading, "enumerate", lambda: [*before, late]):
        starter.start()
        assert _threads_end(before) == []
    starter.join()


async def _sessions_back_to(db_url: str, baseline: int | None) -> None:
    # A backend leaves pg_stat_activity a moment after its client closed the connection.
    await wait_until("the dropped clients' sessions to end",
                     lambda: asyncio.to_thread(lambda: _db_sessions(db_url) == baseline))


def _thread_path(db_url: str) -> str:
    # On SQLite every operation goes to the store's thread, where the last one used to be kept.
    return db_url + "?inline=off" if db_url.startswith("sqlite") else db_url


async def test_async_clients_dropped_unclosed_close_their_stores(db_url: str) -> None:
    """A web handler that makes an AsyncClient per request and never closes it: once each client is
    collected its store's threads end and (PostgreSQL) its connections close, with a ResourceWarning
    naming the URL. The last call of each failed (FlowNotFoundError). Catches: 10 such requests held
    90 threads on PostgreSQL until the process exited, and a store's thread kept its last operation,
    whose error's traceback kept the client itself from being collected."""
    url = _thread_path(db_url)
    baseline = await asyncio.to_thread(_db_sessions, db_url)
    before = set(threading.enumerate())

    async def request() -> None:
        client = AsyncClient(Registry([FLOW]), url)
        assert not await client.exists("no-such-flow")

    def serve() -> None:
        for _ in range(3):
            asyncio.run(request())  # each request's loop ends: the drop happens where no loop runs

    expected = (f"an AsyncClient of {shown_url(url)!r} was never closed; await its close(), or use it in an "
                "async with block")
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always", ResourceWarning)
        await asyncio.to_thread(serve)

        async def all_collected() -> bool:
            # A store thread may hold the last client's operation for a moment after its caller had
            # the result; and clients other tests dropped may be collected now too (not counted).
            gc.collect()
            return sum(str(w.message) == expected for w in warned) >= 3

        await wait_until("the three dropped clients collected", all_collected)
    assert [str(w.message) for w in warned if url in str(w.message)] == [expected] * 3
    assert await asyncio.to_thread(_threads_end, before) == []
    await _sessions_back_to(db_url, baseline)


async def test_a_dropped_async_client_closes_its_store_under_w_error(
        db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With -W error the ResourceWarning is raised in the finalizer (and reported as unraisable):
    the store is closed all the same. Catches: a warning issued before the close skipped it."""
    unraisable: list[BaseException | None] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda hook: unraisable.append(hook.exc_value))
    before = set(threading.enumerate())
    client = AsyncClient(Registry([FLOW]), db_url)
    await client.start_flow("Smoke", "f", 1)
    store = client.store
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        del client
        gc.collect()
    # Only this client's: clients other tests dropped may be collected here too.
    assert [type(exc) for exc in unraisable if db_url in str(exc)] == [ResourceWarning]
    assert await asyncio.to_thread(_threads_end, before) == []
    with pytest.raises(RuntimeError, match="is closed"):
        await store.describe_flow("f")


async def test_a_closed_or_store_sharing_async_client_is_left_alone_when_dropped(db_url: str) -> None:
    """An AsyncClient closed explicitly gives no warning when collected, and one given a store (the
    caller's, shared with a worker, say) never closes it. Catches: a finalizer closing the store
    under a worker that shares it."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        async with AsyncClient(Registry([FLOW]), db_url) as closed:
            await closed.start_flow("Smoke", "a", 1)
        del closed
        async with engine_for(db_url, Registry([FLOW]), worker=False) as eng:
            sharing = AsyncClient(Registry([FLOW]), store=eng.store)
            await sharing.start_flow("Smoke", "b", 1)
            del sharing
            gc.collect()
            assert (await eng.store.describe_flow("b")).status == "running"  # the store is still open


def test_an_async_client_kept_until_exit_runs_nothing_at_exit(tmp_path: Path) -> None:
    """A client kept for the process's whole life is no mistake: at exit nothing warns or closes.
    Catches: a finalizer run at interpreter exit, when the store's threads may already be gone."""
    url = f"sqlite:///{tmp_path / 'kept.db'}"
    script = (
        "import asyncio, sys\n"
        "sys.path.insert(0, '.')\n"
        "from dex_engine import AsyncClient, Registry\n"
        "from engine.tests.test_smoke import FLOW\n"
        f"CLIENT = AsyncClient(Registry([FLOW]), {url!r})\n"
        "asyncio.run(CLIENT.start_flow('Smoke', 'kept', 1))\n"
    )
    done = subprocess.run([sys.executable, "-W", "error::ResourceWarning", "-c", script],
                          capture_output=True, text=True, timeout=60, check=False)
    assert (done.returncode, done.stderr) == (0, "")


@pytest.mark.parametrize("where", ["thread", "lock"])
async def test_close_nowait_on_the_stores_own_thread_or_holding_its_lock(db_url: str, where: str) -> None:
    """The collector may run a dropped client's finalizer on one of its store's own threads, or on
    a thread inside the store's lock: close_nowait must wait for neither. Catches: a close that
    joined its own thread, or took a lock its caller held (hangs)."""
    before = set(threading.enumerate())
    store = open_store(db_url)
    if where == "thread" and isinstance(store, SqliteStore):
        await asyncio.to_thread(store.run_sync, lambda _db: store.close_nowait(), write=False)
    elif where == "thread":
        await store.raw(lambda _db: store.close_nowait())  # on one of its lanes
    else:
        lock = store._dispatcher.lock if isinstance(store, PostgresStore) else store._count_lock

        def close_holding_the_lock() -> None:
            with lock:
                store.close_nowait()

        closer = threading.Thread(target=close_holding_the_lock, daemon=True)
        closer.start()
        closer.join(30)  # a hang guard
        assert not closer.is_alive(), "close_nowait waited for a lock its own thread held"
    assert await asyncio.to_thread(_threads_end, before) == []
    with pytest.raises(RuntimeError, match="is closed"):
        await store.describe_flow("x")


def test_ctrl_c_in_a_blocking_wait_ends_the_call_on_the_clients_loop(db_url: str) -> None:
    """Ctrl-C (KeyboardInterrupt) while the main thread waits in wait_for_flow(id, math.inf) for a
    flow no worker runs: the interrupt reaches the caller, and the call's task on the client's loop
    ends too. Catches: the abandoned call polled the database until close(), which then destroyed
    it with "Task was destroyed but it is pending!"."""
    assert threading.current_thread() is threading.main_thread()  # where SIGINT's KeyboardInterrupt lands
    with Client(Registry([FLOW]), db_url) as client:
        client.start_flow("Smoke", "interrupted", 1)

        def interrupt_once_waiting() -> None:
            deadline = time.monotonic() + 30  # a hang guard
            while not client._in_flight and time.monotonic() < deadline:
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGINT)

        threading.Thread(target=interrupt_once_waiting, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            client.wait_for_flow("interrupted", math.inf)

        async def others() -> set[asyncio.Task[Any]]:
            return asyncio.all_tasks() - {asyncio.current_task()}  # type: ignore[operator]

        deadline = time.monotonic() + 30  # a hang guard: the cancelled task ends within a loop turn or two
        while tasks := asyncio.run_coroutine_threadsafe(others(), client._loop).result():
            assert time.monotonic() < deadline, f"the interrupted call still runs: {tasks}"
            time.sleep(0.01)
        assert client.describe_flow("interrupted").status == "running"  # the client still serves


def _loop_tasks(client: Client) -> set[asyncio.Task[Any]]:
    """The tasks on `client`'s loop but the asking one's."""

    async def others() -> set[asyncio.Task[Any]]:
        return asyncio.all_tasks() - {asyncio.current_task()}  # type: ignore[operator]

    return asyncio.run_coroutine_threadsafe(others(), client._loop).result()


def test_a_ctrl_c_that_no_lock_wait_woke_still_reaches_a_blocking_call(db_url: str) -> None:
    """A KeyboardInterrupt pending while the main thread already waits for a call (wait_for_flow(id,
    math.inf)) that never ends: it reaches the caller, the call ends on the loop, and the client
    still serves. _thread.interrupt_main() sets Python's flag without waking the wait, as a SIGINT
    that lands just before the wait blocks does. Catches: the caller waited in one lock wait, which
    only the call's end ended: the interrupt waited for ever (here, for the guard's close())."""
    assert threading.current_thread() is threading.main_thread()
    with Client(Registry([FLOW]), db_url) as client:
        client.start_flow("Smoke", "interrupted", 1)
        guard_closed: list[bool] = []

        def interrupt_once_waiting() -> None:
            deadline = time.monotonic() + 30  # a hang guard
            while not client._in_flight and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.2)  # well into the wait
            _thread.interrupt_main()
            time.sleep(30)  # a hang guard: let the caller go, saying it had to
            if client._in_flight:
                guard_closed.append(True)
                client.close()

        threading.Thread(target=interrupt_once_waiting, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            client.wait_for_flow("interrupted", math.inf)
        assert guard_closed == [], "the interrupt reached the caller only once the guard closed the client"
        deadline = time.monotonic() + 30  # a hang guard: the cancelled task ends within a loop turn or two
        while tasks := _loop_tasks(client):
            assert time.monotonic() < deadline, f"the interrupted call still runs: {tasks}"
            time.sleep(0.01)
        assert client.describe_flow("interrupted").status == "running"


class _InterruptOnAdd(set[Any]):
    """A blocking Client's set of waiting calls that raises KeyboardInterrupt (Ctrl-C) as the client
    adds a call to it: just after the call was handed to the loop, before the caller waits."""

    def add(self, call: Any) -> None:
        raise KeyboardInterrupt


def test_ctrl_c_just_after_a_call_was_handed_to_the_loop_ends_it(db_url: str) -> None:
    """Ctrl-C in the main thread just after a call (wait_for_flow(id, math.inf)) was handed to the
    client's loop, before its wait began: the interrupt reaches the caller, the call's task ends too,
    and the client still serves. Catches: the call was abandoned only when interrupted in its wait,
    so this one polled the database until close(), which then cancelled it."""
    with Client(Registry([FLOW]), db_url) as client:
        client.start_flow("Smoke", "interrupted", 1)
        client._in_flight = _InterruptOnAdd()
        with pytest.raises(KeyboardInterrupt):
            client.wait_for_flow("interrupted", math.inf)
        client._in_flight = set()
        deadline = time.monotonic() + 30  # a hang guard: the cancelled task ends within a loop turn or two
        while tasks := _loop_tasks(client):
            assert time.monotonic() < deadline, f"the interrupted call still runs: {tasks}"
            time.sleep(0.01)
        assert client.describe_flow("interrupted").status == "running"


def test_ctrl_c_as_a_call_is_handed_to_the_loop_leaves_no_unawaited_coroutine(db_url: str) -> None:
    """Ctrl-C in the main thread while a call is being handed to the client's loop, before it was:
    the interrupt reaches the caller, the call never runs, and its coroutine is closed, so no
    "coroutine ... was never awaited" warning comes when it is collected; the client still serves.
    Catches: the coroutine was closed only when the hand-over raised RuntimeError."""
    with Client(Registry([FLOW]), db_url) as client:
        client.start_flow("Smoke", "interrupted", 1)
        loop: Any = client._loop
        check_closed = loop._check_closed
        armed = [True]

        def interrupt_once_in_the_main_thread() -> None:
            # The hand-over's first step; Ctrl-C's KeyboardInterrupt raised there, before it queued the call.
            if armed and threading.current_thread() is threading.main_thread():
                armed.clear()
                raise KeyboardInterrupt
            check_closed()

        loop._check_closed = interrupt_once_in_the_main_thread

        def interrupted() -> bool:
            # Caught here, not by pytest.raises, whose record of the traceback keeps the coroutine alive.
            try:
                client.wait_for_flow("interrupted", math.inf)
            except KeyboardInterrupt:
                return True
            return False

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert interrupted()
            assert client.describe_flow("interrupted").status == "running"  # after the loop ran the abandon
            gc.collect()
        assert [str(warning.message) for warning in caught] == []
        del loop._check_closed


# The product fault holds the interrupt back until the open gives up, at the connect timeout: an
# open that ended sooner, with the interrupt not yet caught, ended for a cause outside the test
# (seen once in CI, never reproduced), and the scenario runs again.
_OPEN_GIVES_UP_SECONDS = float(NETWORK_TIMEOUTS["connect_timeout"])
_SILENT_SERVER_TRIES = 3


def _interrupt_an_open(before: set[threading.Thread]) -> tuple[bool | None, str]:
    """Ctrl-C once Client(...) connected to a server that never answers, then the server hangs up on
    it and on every connection after (libpq tries again without SSL). Whether the client's thread,
    alive when KeyboardInterrupt was caught, ended once the open failed (None: none was alive), and
    what happened."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        url = f"postgresql://dex@127.0.0.1:{server.getsockname()[1]}/silent"
        accepted: list[socket.socket] = []
        sent_at: list[float] = []

        def interrupt_once_connected() -> None:
            server.settimeout(30)  # a hang guard
            accepted.append(server.accept()[0])
            sent_at.append(time.monotonic())
            os.kill(os.getpid(), signal.SIGINT)

        interrupter = threading.Thread(target=interrupt_once_connected, daemon=True)
        interrupter.start()
        with pytest.raises(KeyboardInterrupt):
            Client(Registry([FLOW]), url)
        caught_at = time.monotonic()
        opening = [thread for thread in set(threading.enumerate()) - before if thread.name == "dex-client"]
        if not sent_at:
            return None, "a stray interrupt came before the client connected"
        accepted[0].setblocking(False)
        try:
            connection = "hung up" if accepted[0].recv(1 << 16) == b"" else "still open"
        except BlockingIOError:
            connection = "still open"
        except OSError as exc:
            connection = f"failed: {exc!r}"
        outcome = f"the interrupt was caught {caught_at - sent_at[0]:.3f} s after the signal; the client's " \
                  f"connection: {connection}"
        if not opening:
            accepted[0].close()
            return None, outcome
        done = threading.Event()

        def hang_up_on_each() -> None:
            server.settimeout(0.05)
            while not done.is_set():
                with contextlib.suppress(TimeoutError):
                    server.accept()[0].close()

        hanging_up = threading.Thread(target=hang_up_on_each, daemon=True)
        hanging_up.start()
        accepted[0].close()  # the server hangs up: the open fails
        opening[0].join(30)  # a hang guard
        done.set()
        hanging_up.join(30)  # a hang guard
    return not opening[0].is_alive(), outcome


def test_ctrl_c_while_a_blocking_client_opens_a_silent_server_raises_at_once() -> None:
    """Ctrl-C while Client(...) waits for a PostgreSQL server that accepted the connection but does not
    answer: KeyboardInterrupt reaches the caller while the open still waits on the client's thread,
    and once the open fails (the server hangs up) that thread ends. Catches: the interrupt was held
    back until the connect timeout (10 s) ran out."""
    assert threading.current_thread() is threading.main_thread()  # where SIGINT's KeyboardInterrupt lands
    outcomes: list[str] = []
    for _ in range(_SILENT_SERVER_TRIES):
        before = set(threading.enumerate())
        started = time.monotonic()
        ended, outcome = _interrupt_an_open(before)
        if ended is not None:
            assert ended, f"the interrupted open's thread still runs: {outcome}"
            return
        outcomes.append(outcome)
        assert time.monotonic() - started < _OPEN_GIVES_UP_SECONDS, (
            f"the interrupt waited for the open to give up: {outcome}")
    raise AssertionError(f"each open ended before its interrupt reached the caller: {outcomes}")


def test_ctrl_c_as_a_blocking_client_hands_its_open_to_its_loop_leaves_no_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C in the moment Client(...) hands the open to its loop thread (the open scheduled, the
    KeyboardInterrupt raised before the hand-off returned; here raised by the hand-off itself): the
    interrupt reaches the caller, and the loop thread, with whatever store it opened, ends. Catches:
    the hand-off ran before the code that stops the loop of an abandoned open, so the loop thread
    (and a store it opened) ran until the process exited, as CI saw under load."""
    real = asyncio.BaseEventLoop.call_soon_threadsafe
    handed: list[bool] = []

    def interrupted_hand_off(loop: asyncio.BaseEventLoop, *args: Any, **kwargs: Any) -> Any:
        handle = real(loop, *args, **kwargs)
        if threading.current_thread() is threading.main_thread() and not handed:
            handed.append(True)
            raise KeyboardInterrupt
        return handle

    monkeypatch.setattr(asyncio.BaseEventLoop, "call_soon_threadsafe", interrupted_hand_off)
    before = set(threading.enumerate())
    with pytest.raises(KeyboardInterrupt):
        Client(Registry([FLOW]), f"sqlite:///{tmp_path / 'handed.db'}")
    assert handed
    monkeypatch.undo()
    assert _threads_end(before) == []


async def test_a_worker_stopped_while_it_opens_a_silent_server_stops_at_once() -> None:
    """stop() (a SIGTERM handler's) while AsyncWorker.run() opens a PostgreSQL server that accepted
    the connection but does not answer: run() returns, not having started, while the open still
    waits, and the open's thread ends once the open fails. Catches: the open ran on the event loop,
    so nothing else ran on it (the SIGTERM handler among them) until the connect timeout (10 s) ran
    out, and run() then raised StoreOpenError."""
    before = set(threading.enumerate())
    with socket.create_server(("127.0.0.1", 0)) as server:
        url = f"postgresql://dex@127.0.0.1:{server.getsockname()[1]}/silent"
        worker = AsyncWorker(Registry([FLOW]), WorkerOptions(database_url=url))
        running = asyncio.create_task(worker.run())
        server.settimeout(30)  # a hang guard
        accepted, _ = await asyncio.to_thread(server.accept)
        with accepted:
            await asyncio.wait_for(worker.stop(), 30)  # a hang guard
            assert await running is None
            assert not _hung_up(accepted), "the worker's stop waited until the open gave up"
    opening = [thread for thread in set(threading.enumerate()) - before if thread.name == "dex-worker-open"]
    for thread in opening:
        thread.join(30)  # a hang guard: the open fails once the server hung up
        assert not thread.is_alive(), "the stopped worker's open still runs"


async def test_a_worker_stopped_while_its_open_runs_closes_the_store_the_open_then_makes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """stop() while AsyncWorker.run() opens its store, the open then succeeding (a slow PostgreSQL
    connect that gets through; here a SQLite open held back): run() returns at the stop, and the
    store the open makes afterwards is closed, its threads ended. Catches: nobody closed it, so its
    threads (on PostgreSQL, its connections) lived until the process exited."""
    release = threading.Event()
    opening = threading.Event()
    opened: list[Store] = []
    real_open = worker_module.open_store

    def held_open(url: str) -> Store:
        opening.set()
        release.wait(30)  # a hang guard
        opened.append(real_open(url))
        return opened[-1]

    monkeypatch.setattr(worker_module, "open_store", held_open)
    before = set(threading.enumerate())
    worker = AsyncWorker(Registry([FLOW]), WorkerOptions(database_url=f"sqlite:///{tmp_path / 'held.db'}"))
    running = asyncio.create_task(worker.run())
    assert await asyncio.to_thread(opening.wait, 30)  # a hang guard
    await asyncio.wait_for(worker.stop(), 30)  # a hang guard
    assert await running is None
    assert not opened, "run() waited for the open"
    release.set()
    # Made, its thread started: _threads_end cannot join a thread still starting.
    await wait_until("the held open to make its store", lambda: asyncio.sleep(0, bool(opened)))
    assert await asyncio.to_thread(_threads_end, before) == []
    assert len(opened) == 1


def _hung_up(conn: socket.socket) -> bool:
    """Whether the peer of `conn` closed it (read past what it sent)."""
    conn.setblocking(False)
    try:
        while conn.recv(1 << 16):
            pass
    except BlockingIOError:
        return False  # open, and nothing more to read
    return True


# A handler that holds its client's loop until the test lets it go: a blocking call in an RPC handler.
_handler_entered = threading.Event()
_handler_released = threading.Event()


@rpc(request_type=type(None))
async def hold_the_loop(ctx: RpcContext, _: None) -> None:
    _handler_entered.set()
    _handler_released.wait(30)  # a hang guard


HOLDER = Flow("Holder", [Step("Start", ticker_sleep, wait_for=ticker_sleep_wait, input_type=type(None))],
              start_step="Start", schema=[Log], rpcs=[hold_the_loop])


def test_ctrl_c_in_close_still_closes_the_store_and_a_second_close_waits_for_it(db_url: str) -> None:
    """Ctrl-C while close() waits, its loop busy (an RPC handler of another thread's call blocks it):
    the interrupt reaches the caller, the close goes on, and a second close() returns once it is done,
    with the store's threads (and on PostgreSQL its connections) ended. Catches: the interrupted close
    stopped the loop before the store's close ran, so the store stayed open until the process exited,
    "Task was destroyed but it is pending!" was logged, and the second close returned at once."""
    assert threading.current_thread() is threading.main_thread()  # where SIGINT's KeyboardInterrupt lands
    before = set(threading.enumerate())
    client = Client(Registry([HOLDER]), db_url)
    client.start_flow("Holder", "held")
    _handler_entered.clear()
    _handler_released.clear()
    outcomes: list[str] = []

    def call_the_handler() -> None:
        try:
            client.rpc("held", "hold_the_loop")
            outcomes.append("returned")
        except RuntimeError as exc:
            outcomes.append(str(exc))

    caller = threading.Thread(target=call_the_handler, daemon=True)
    caller.start()
    assert _handler_entered.wait(30)  # a hang guard
    interrupted = threading.Event()

    def on_sigint(signum: int, frame: object) -> None:
        interrupted.set()  # then as Python's own handler does
        raise KeyboardInterrupt

    def interrupt_once_closing() -> None:
        deadline = time.monotonic() + 30  # a hang guard
        while not client._closed and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGINT)
        interrupted.wait(30)  # a hang guard
        _handler_released.set()

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        threading.Thread(target=interrupt_once_closing, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            client.close()
    finally:
        signal.signal(signal.SIGINT, previous)
        _handler_released.set()
    client.close()
    assert not client._thread.is_alive(), "the second close returned before the first one's close ended"
    assert _threads_end(before) == []
    with pytest.raises(RuntimeError, match="is closed"):
        asyncio.run(client._async.store.describe_flow("held"))
    caller.join(30)  # a hang guard
    assert outcomes == [f"client of {shown_url(db_url)!r} was closed while the call waited"]


class _FailedError(Exception):
    pass


@rpc(request_type=type(None))
async def hold_the_loop_then_fail(ctx: RpcContext, _: None) -> None:
    _handler_entered.set()
    _handler_released.wait(30)  # a hang guard
    raise _FailedError("the handler failed")


FAILER = Flow("Failer", [Step("Start", ticker_sleep, wait_for=ticker_sleep_wait, input_type=type(None))],
              start_step="Start", schema=[Log], rpcs=[hold_the_loop_then_fail])


def test_a_call_that_fails_after_close_let_its_caller_go_reports_no_unretrieved_error(db_url: str) -> None:
    """close() on one thread lets another thread's call go (it raises saying the client was closed
    while it waited), and the call then fails on the loop (its RPC handler raises): nobody reads that
    error, and asyncio does not report it when the call's task is collected. Catches: "Task exception
    was never retrieved" logged with the handler's traceback after close(), since the call's task was
    no longer chained to a future that read its outcome."""
    client = Client(Registry([FAILER]), db_url)
    client.start_flow("Failer", "failing")
    reported: list[str] = []
    client._loop.set_exception_handler(lambda _loop, context: reported.append(context["message"]))
    _handler_entered.clear()
    _handler_released.clear()
    outcomes: list[str] = []

    def call_the_handler() -> None:
        try:
            client.rpc("failing", "hold_the_loop_then_fail")
            outcomes.append("returned")
        except (RuntimeError, _FailedError) as exc:
            outcomes.append(str(exc))

    caller = threading.Thread(target=call_the_handler, daemon=True)
    try:
        caller.start()
        assert _handler_entered.wait(30)  # a hang guard
        closer = threading.Thread(target=client.close, daemon=True)
        closer.start()
        caller.join(30)  # a hang guard: close() lets the caller go at once, the loop still busy
        _handler_released.set()
        closer.join(30)  # a hang guard
    finally:
        _handler_released.set()
    assert outcomes == [f"client of {shown_url(db_url)!r} was closed while the call waited"]
    gc.collect()  # the call's task, whose collection reported its error
    assert reported == []


class _SigtermAt(set[Any]):
    """A blocking Client's set of waiting calls that raises SIGTERM once in the calling thread (whose
    handler runs at once, in it) when the client adds a call to it (before or after adding it), or
    when close() lists it: each a moment the client holds its lock."""

    def __init__(self, when: str) -> None:
        super().__init__()
        self.when = when

    def _sigterm(self, when: str) -> None:
        if self.when == when:
            self.when = "done"  # once: the handler's own close() comes here too
            signal.raise_signal(signal.SIGTERM)

    def add(self, future: Any) -> None:
        self._sigterm("before_in_flight")
        super().add(future)
        self._sigterm("after_in_flight")

    def __iter__(self) -> Iterator[Any]:
        self._sigterm("in_close")
        return super().__iter__()


@pytest.mark.parametrize("when", ["submitting", "queued", "before_in_flight", "after_in_flight", "in_close"])
def test_close_in_a_signal_handler_returns_wherever_it_interrupts_the_client(db_url: str, when: str) -> None:
    """A script's SIGTERM handler calls close() of the Client its main thread is using, and the signal
    comes while that thread holds the client's lock: as a call is handed to the loop (before or after
    the loop checks it is open), just before or after the call is counted as waiting, or in the
    script's own close(). The handler's close returns; the interrupted call raises saying the client
    is closed; the loop thread ends and the store is closed. Catches: the handler's close() waited
    for ever for the lock the thread it interrupted held; with a reentrant lock, the interrupted call
    waited for ever on the loop the close had stopped (or met "Event loop is closed", or the closed
    store), and a close in close() waited for ever for the loop thread the interrupted close had yet
    to end."""
    assert threading.current_thread() is threading.main_thread()  # where the handler runs, in the fork too

    def drive() -> str:
        client = Client(Registry([FLOW]), db_url)
        client.start_flow("Smoke", "waited", 1)  # no worker: it runs until the test ends
        said: list[str] = []

        def on_sigterm(signum: int, frame: object) -> None:
            client.close()
            said.append("handler closed")

        signal.signal(signal.SIGTERM, on_sigterm)
        if when in ("submitting", "queued"):
            loop: Any = client._loop
            check_closed = loop._check_closed
            armed = [True]

            def sigterm_around_the_check() -> None:
                # Once, in the main thread: there only the call's hand-over and the close check it.
                if not (armed and threading.current_thread() is threading.main_thread()):
                    check_closed()
                    return
                armed.clear()
                if when == "submitting":
                    signal.raise_signal(signal.SIGTERM)
                check_closed()
                if when == "queued":
                    signal.raise_signal(signal.SIGTERM)

            loop._check_closed = sigterm_around_the_check  # in the fork only
        client._in_flight = _SigtermAt(when)
        try:
            if when == "in_close":
                client.close()
                said.append("closed")
            else:
                client.wait_for_flow("waited", math.inf)
                said.append("returned")
        except RuntimeError as exc:
            said.append(str(exc))
        said.append(f"loop thread ended: {not client._thread.is_alive()}")
        said.append(f"store closed: {_store_closed(client._async.store)}")
        return "; ".join(said)

    url = shown_url(db_url)
    ended = {
        "submitting": f"client of {url!r} is closed; its close() was called (by this or another thread): open the "
                      "database again with a new Client",
        "in_close": "closed",
    }.get(when, f"client of {url!r} was closed while the call waited")
    assert _in_a_fork(drive) == f"handler closed; {ended}; loop thread ended: True; store closed: True"


def test_a_second_sigterm_while_the_handlers_close_waits_for_the_loop_thread_returns(db_url: str) -> None:
    """A script's SIGTERM handler calls close(), and a second SIGTERM comes while that close waits for
    the client's loop thread to end, delivered to another thread (the kernel picks any that does not
    block it): the main thread runs the handler again once its wait returns. Both closes return.
    Catches: the wait was Thread.join(), which the second handler's close ran in again after the
    first had taken the ended thread's lock, and waited for ever for it."""
    assert threading.current_thread() is threading.main_thread()  # where the handler runs, in the fork too

    def drive() -> str:
        client = Client(Registry([FLOW]), db_url)
        client.start_flow("Smoke", "waited", 1)
        said: list[str] = []

        def on_sigterm(signum: int, frame: object) -> None:
            client.close()
            said.append("handler closed")

        signal.signal(signal.SIGTERM, on_sigterm)
        close = client._async.close
        main = threading.main_thread()

        async def second_sigterm_then_close() -> None:
            async def waiting() -> bool:
                return _waiting_in_close(main)

            await wait_until("the main thread to wait in close()", waiting, timeout=30)
            signal.raise_signal(signal.SIGTERM)  # here, on the loop thread: the main thread's wait goes on
            await close()

        client._async.close = second_sigterm_then_close  # type: ignore[method-assign]  # in the fork only
        signal.raise_signal(signal.SIGTERM)
        said.append(f"loop thread ended: {not client._thread.is_alive()}")
        said.append(f"store closed: {_store_closed(client._async.store)}")
        return "; ".join(said)

    assert _in_a_fork(drive) == "handler closed; handler closed; loop thread ended: True; store closed: True"


_LOCKS = (type(threading.Lock()), type(threading.RLock()))


class _SigtermAtPoint:
    """A profile function (sys.setprofile) that raises SIGTERM, whose handler runs at once in the
    same thread, at the `point`th (from 0) point of that thread where a signal's handler may run: a
    Python function's start, a C function's return, or a lock's acquire (a thread blocked in it runs
    the handler there). Once, and only while `armed`."""

    def __init__(self, point: int) -> None:
        self.point = point
        self.seen = 0
        self.armed = True
        self.fired_at = ""

    def __call__(self, frame: FrameType, event: str, arg: object) -> None:
        if not self.armed:
            return
        if event == "c_call":
            if getattr(arg, "__name__", None) not in ("acquire", "__enter__") or \
                    not isinstance(getattr(arg, "__self__", None), _LOCKS):
                return
        elif event not in ("call", "c_return"):
            return
        if self.seen == self.point:
            self.armed = False
            what = getattr(arg, "__qualname__", "") if event != "call" else ""
            self.fired_at = f"{event} {what} in {frame.f_code.co_name} " \
                            f"({Path(frame.f_code.co_filename).name}:{frame.f_lineno})"
            signal.raise_signal(signal.SIGTERM)  # its handler runs before this returns
        self.seen += 1


def _sigterm_at_every_point(db_url: str, act: Callable[[Client], object]) -> str:
    """The outcomes (sorted, one a line, each with the first point that had it) of `act` on a new
    Client, with a SIGTERM whose handler calls the client's close() coming at each point of it in
    turn (see _SigtermAtPoint), until `act` ends with the signal not sent. In a fork, in its main
    thread, where handlers run; "hung" if any hangs (its stderr names the point)."""
    assert threading.current_thread() is threading.main_thread()

    def drive() -> str:
        outcomes: dict[str, str] = {}
        for point in itertools.count():
            client = Client(Registry([FLOW]), db_url)
            if point == 0:
                client.start_flow("Smoke", "waited", 1)  # no worker: it runs until the test ends
            said: list[str] = []

            def on_sigterm(signum: int, frame: object, client: Client = client, said: list[str] = said) -> None:
                client.close()
                said.append("handler closed")

            signal.signal(signal.SIGTERM, on_sigterm)
            hook = _SigtermAtPoint(point)
            sys.setprofile(hook)
            try:
                try:
                    act(client)
                finally:
                    hook.armed = False
                    sys.setprofile(None)
                said.append("returned")
            except TimeoutError:
                said.append("timed out")
            except RuntimeError as exc:
                said.append(str(exc))
            if not hook.fired_at:
                client.close()
                return "\n".join(sorted(f"{outcome} (first at {at})" for outcome, at in outcomes.items()))
            said.append(f"loop thread ended: {not client._thread.is_alive()}")
            said.append(f"store closed: {_store_closed(client._async.store)}")
            outcomes.setdefault("; ".join(said), f"point {point}: {hook.fired_at}")
            # Named on stderr first: a hang loses the outcomes
            os.write(2, f"point {point}: {hook.fired_at}: {'; '.join(said)}\n".encode())
        raise AssertionError("unreachable")

    return _in_a_fork(drive)


def _outcomes_only(report: str) -> set[str]:
    return {line.split(" (first at ")[0] for line in report.splitlines()}


def test_a_sigterm_closing_the_client_anywhere_in_a_blocking_call_ends_both(db_url: str) -> None:
    """A script's SIGTERM handler calls close() of the Client its main thread is calling, the signal
    coming at each point of the call in turn: the handler's close returns, the call returns or raises
    saying the client is closed, the loop thread ends and the store is closed. Catches: the call
    waited in concurrent.futures.Future.result(), which holds the future's lock but in its inner
    wait: a handler run while it held it waited for the loop thread to end, which waited for that
    lock to hand the call over, for ever (seen about once in 100 SIGTERMs to such a script)."""
    url = shown_url(db_url)
    tail = "loop thread ended: True; store closed: True"
    # A call that takes a while (polls the running flow), so that its caller waits for it at each
    # point of its wait: on the loop's own time, the result may come first.
    report = _sigterm_at_every_point(db_url, lambda client: client.wait_for_flow("waited", 0.1))
    assert report != "hung"
    assert _outcomes_only(report) <= {
        f"handler closed; timed out; {tail}",
        f"handler closed; client of {url!r} was closed while the call waited; {tail}",
        f"handler closed; client of {url!r} is closed; its close() was called (by this or another thread): open "
        f"the database again with a new Client; {tail}",
    }, report


def test_a_sigterm_closing_the_client_anywhere_in_its_close_returns_both(db_url: str) -> None:
    """A script's SIGTERM handler calls close() of its Client, and the signal comes at each point of
    the script's own close() in turn, or of a first handler's (two SIGTERMs): both closes return, the
    loop thread ends and the store is closed. Catches: the outer close waited for the loop thread in
    a concurrent future's result(), and a handler run between its test of the future's state and its
    wait took the wake-up (its own wait returned), so the outer one waited for ever; a handler run in
    Thread.join() holding the ended thread's lock joined it again, waiting for that lock for ever."""
    report = _sigterm_at_every_point(db_url, lambda client: client.close())
    assert report != "hung"
    assert _outcomes_only(report) == {"handler closed; returned; loop thread ended: True; store closed: True"}, report


def _waiting_in_close(thread: threading.Thread) -> bool:
    """Whether `thread` waits in a blocking Client's close() now: for the lock its loop thread holds,
    or in threading's code (the join)."""
    frame = sys._current_frames().get(thread.ident or -1)
    if frame is not None and frame.f_code is Client.close.__code__:
        lines, first = inspect.getsourcelines(Client.close)
        return "self._served.acquire()" in lines[frame.f_lineno - first]
    if frame is None or frame.f_code.co_filename != threading.__file__:
        return False
    while frame is not None:
        if frame.f_code.co_name == "close" and frame.f_code.co_filename == inspect.getfile(Client):
            return True
        frame = frame.f_back
    return False


async def test_a_close_racing_another_returns_only_once_the_store_is_closed(db_url: str) -> None:
    """Two threads close one Client at once, its loop busy (an RPC handler blocks it): the one that
    comes second returns only once the store is closed, as the first does. Catches: it returned at
    once, the store still open, so code after it (dropping the database, deleting the file) raced the
    close."""

    def drive() -> None:
        client = Client(Registry([HOLDER]), db_url)
        client.start_flow("Holder", "held")
        _handler_entered.clear()
        _handler_released.clear()

        def call_the_handler() -> None:
            with contextlib.suppress(RuntimeError):  # closed while the call waited
                client.rpc("held", "hold_the_loop")

        caller = threading.Thread(target=call_the_handler, daemon=True)
        caller.start()
        assert _handler_entered.wait(30)  # a hang guard
        first = threading.Thread(target=client.close, daemon=True)
        first.start()
        deadline = time.monotonic() + 30  # a hang guard
        while not client._closed and time.monotonic() < deadline:
            time.sleep(0.01)
        store_closed_when_returned: list[bool] = []

        def close_again() -> None:
            client.close()
            store_closed_when_returned.append(_store_closed(client._async.store))

        second = threading.Thread(target=close_again, daemon=True)
        second.start()
        # Let the handler go once the second close returned, or waits for the loop thread to end.
        while second.is_alive() and not _waiting_in_close(second) and time.monotonic() < deadline:
            time.sleep(0.01)
        _handler_released.set()
        for thread in (second, first, caller):
            thread.join(30)  # a hang guard
        assert store_closed_when_returned == [True]

    try:
        await asyncio.to_thread(drive)
    finally:
        _handler_released.set()


async def test_an_async_close_racing_another_returns_only_once_the_store_is_closed(db_url: str) -> None:
    """Two tasks close one AsyncClient at once while its store's thread waits for a lock another
    connection holds (a write queued before the close): the second returns only once the store's
    threads ended, as the first does. Catches: it returned at once, its connections still open, so
    code after it (dropping the database, deleting the file) raced the close."""
    url = _thread_path(db_url)
    before = set(threading.enumerate())
    client = AsyncClient(Registry([FLOW]), url)
    await client.start_flow("Smoke", "first", 1)
    with _holding_the_flows_table(db_url):
        writing = asyncio.create_task(client.start_flow("Smoke", "blocked", 1))
        if db_url.startswith("postgresql"):
            await wait_until("the write to wait for the lock", lambda: asyncio.to_thread(_waiting_for_a_lock, db_url))
        else:
            await asyncio.sleep(0)  # the write is queued on the store's thread, which waits for the lock
        first = asyncio.create_task(client.close())
        threads_left_when_returned: list[list[str]] = []

        async def close_again() -> None:
            await client.close()
            threads_left_when_returned.append(
                [thread.name for thread in set(threading.enumerate()) - before
                 if thread.name.startswith("dex-") and thread.is_alive()])

        second = asyncio.create_task(close_again())
        for _ in range(3):
            await asyncio.sleep(0)  # both closes run until they wait
    await asyncio.gather(first, second)
    with contextlib.suppress(Exception):  # committed before the close, or refused by it
        await writing
    assert threads_left_when_returned == [[]]


@contextlib.contextmanager
def _holding_the_flows_table(db_url: str) -> Iterator[None]:
    """Another connection holds a lock that every write of `db_url`'s engine waits for."""
    if db_url.startswith("postgresql"):
        import psycopg

        with psycopg.connect(db_url) as conn:
            conn.execute("LOCK TABLE flows IN ACCESS EXCLUSIVE MODE")
            yield
            conn.rollback()
        return
    import sqlite3

    conn = sqlite3.connect(db_url.removeprefix("sqlite:///"), isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        yield
        conn.execute("ROLLBACK")
    finally:
        conn.close()


def _waiting_for_a_lock(db_url: str) -> bool:
    import psycopg

    with psycopg.connect(db_url, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                           " AND wait_event_type = 'Lock'").fetchone()
    return row is not None and row[0] > 0


def _store_closed(store: Store) -> bool:
    try:
        asyncio.run(store.describe_flow("held"))
    except RuntimeError as exc:
        return "is closed" in str(exc)
    return False


def _in_a_fork(action: Callable[[], str]) -> str:
    """What `action` returns (or the error it raises, as "ExcType: text") in a forked child, which
    is killed if it has not ended in 30 s (a hang guard)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, and leave without running the parent's cleanup
        try:
            try:
                outcome = action()
            except BaseException as exc:
                outcome = f"{type(exc).__name__}: {exc}"
            os.write(write_end, outcome.encode())
        finally:
            os._exit(0)
    os.close(write_end)
    deadline = time.monotonic() + 30
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(read_end)
            return "hung"
        time.sleep(0.01)
    with os.fdopen(read_end, "rb") as child_said:
        return child_said.read().decode()


async def test_a_forked_child_is_told_to_make_its_own_blocking_client(db_url: str) -> None:
    """gunicorn --preload: a Client made before the fork, used in the child. A call there raises a
    RuntimeError saying to make a Client after the fork; close() there returns, and leaves the
    parent's client working. Catches: the child's call and close() queued work for the parent's
    loop thread, which did not pass to the child, and waited for ever."""

    def drive() -> None:
        with Client(Registry([FLOW]), db_url) as client:
            client.start_flow("Smoke", "forked", 1)
            outcome = _in_a_fork(lambda: str(client.describe_flow("forked").status))
            assert outcome.startswith(f"RuntimeError: the blocking Client of {shown_url(db_url)!r} was made in "
                                      f"process {os.getpid()}, and this process ("), outcome
            assert "make Clients only after the fork, in each process" in outcome

            def close_then_call() -> str:
                client.close()
                try:
                    client.describe_flow("forked")
                except RuntimeError as exc:
                    return f"closed; then {exc}"
                return "closed; then the call returned"

            outcome = _in_a_fork(close_then_call)
            assert outcome.startswith("closed; then the blocking Client of"), outcome
            assert client.describe_flow("forked").status == "running"  # the parent's client still serves

    await asyncio.to_thread(drive)


async def test_a_forked_child_is_told_to_open_the_database_again_for_an_async_client(db_url: str) -> None:
    """gunicorn --preload with one AsyncClient, each request run by asyncio.run: in the child a
    call raises a RuntimeError saying to open the database after the fork; close() there returns,
    and leaves the parent's client working. Catches: on PostgreSQL the call waited for ever for the
    parent's connection threads; on SQLite it used the parent's connection, which SQLite forbids
    in a fork (it can corrupt the file), or waited for ever for its thread when the connection was
    busy."""
    client = AsyncClient(Registry([FLOW]), db_url)
    try:
        await client.start_flow("Smoke", "forked", 1)

        def call() -> str:
            return str(asyncio.run(client.describe_flow("forked")).status)

        def close_then_call() -> str:
            asyncio.run(client.close())
            return call()

        for action in (call, close_then_call):  # the call after close() raises: the fork is said first
            outcome = await asyncio.to_thread(_in_a_fork, action)
            opened_here = f"RuntimeError: store {shown_url(db_url)!r} was opened in process {os.getpid()}, "
            assert outcome.startswith(opened_here + "and this process ("), outcome
            assert "open the database only after the fork" in outcome, outcome
        assert (await client.describe_flow("forked")).status == "running"  # the parent's client still serves
    finally:
        await client.close()


async def test_a_fork_cannot_open_a_sqlite_file_its_parent_had_open_as_it_forked(tmp_path: Path) -> None:
    """A process forked while its parent had the SQLite file open (gunicorn --preload, then a Client
    made in the worker) is refused at once with StoreOpenError saying why and what to do; one forked
    after the parent closed its store opens the file and writes. Catches: SQLite's per-process lock
    state copied into the fork: a fork made while the parent wrote waited 30 s for a write lock
    nobody held on each write, then failed with 'database is locked', and SQLite warns that such a
    fork can corrupt the file."""
    db_url = f"sqlite:///{tmp_path / 'engine.db'}"

    def open_and_write() -> str:
        with Client(Registry([FLOW]), db_url) as mine:
            mine.start_flow("Smoke", f"child-{os.getpid()}", 1)
            return "wrote"

    def drive() -> None:
        client = Client(Registry([FLOW]), db_url)
        stop = threading.Event()

        def write() -> None:  # the parent writes as it forks
            n = 0
            while not stop.is_set():
                n += 1
                client.start_flow("Smoke", f"parent-{n}", 1)

        writer = threading.Thread(target=write, daemon=True)
        writer.start()
        try:
            outcome = _in_a_fork(open_and_write)
        finally:
            stop.set()
            writer.join(30)
        assert outcome.startswith(f"StoreOpenError: cannot open {db_url!r} in process "), outcome
        assert "a fork of a process that had this SQLite file open as it forked" in outcome, outcome
        assert "open the database only after the fork, in each process" in outcome, outcome
        client.close()
        assert _in_a_fork(open_and_write) == "wrote"  # the parent closed it before this fork
        with Client(Registry([FLOW]), db_url) as after:
            assert [f for f in after.search_flows("", 1000) if f.startswith("child-")] != []

    await asyncio.to_thread(drive)


# The blocking Client whose RPC calls it again (an application's one shared client, used by its own handler).
SHARED_BLOCKING: list[Client] = []


@rpc()
async def status_by_blocking_client(ctx: RpcContext, _: None) -> str:
    try:
        return SHARED_BLOCKING[0].describe_flow(ctx.flow_id).status
    except RuntimeError as exc:
        return str(exc)


@rpc()
async def close_blocking_client(ctx: RpcContext, _: None) -> str:
    try:
        SHARED_BLOCKING[0].close()
    except RuntimeError as exc:
        return str(exc)
    return "closed"


REENTERED = Flow("Reentered", [Step("Listen", listen, wait_for=listen_wait, input_type=type(None))],
                 start_step="Listen", schema=[Count, Inbox], rpcs=[status_by_blocking_client, close_blocking_client])


@pytest.mark.parametrize(("rpc_name", "refusal"), [
    ("status_by_blocking_client", "from code its own event loop runs (an RPC handler it called) would wait "
                                  "for ever; in an RPC handler, await an AsyncClient's calls instead"),
    ("close_blocking_client", "would wait for ever; close it from another thread"),
])
async def test_the_blocking_client_used_from_its_own_rpc_handler_refuses_at_once(
    db_url: str, rpc_name: str, refusal: str
) -> None:
    """An RPC handler that calls, or closes, the blocking Client that runs it (a threaded app's one
    shared client) gets a RuntimeError saying what to do, and the client serves other threads and
    closes after. Catches: the call or close blocked the client's own loop waiting for a result only
    that loop could make: the caller, every other thread's call and close() waited for ever (a close
    first cancelled the caller's call, which then failed, and hung the loop)."""

    def drive() -> None:
        client = Client(Registry([REENTERED]), db_url)
        SHARED_BLOCKING[:] = [client]
        client.start_flow("Reentered", "r")
        outcome: list[str] = []

        def call() -> None:
            try:
                outcome.append(client.rpc("r", rpc_name))
            except RuntimeError as exc:
                outcome.append(f"the call failed: {exc}")

        caller = threading.Thread(target=call, daemon=True)
        caller.start()
        caller.join(10)
        assert not caller.is_alive(), f"{rpc_name}: the handler's use of its own client still waits"
        assert len(outcome) == 1 and refusal in outcome[0], outcome
        assert client.describe_flow("r").status == "running"
        closer = threading.Thread(target=client.close, daemon=True)
        closer.start()
        closer.join(10)
        assert not closer.is_alive(), "close() still waits"

    await asyncio.to_thread(drive)


def test_the_blocking_client_takes_each_methods_arguments_as_the_async_client_does() -> None:
    """Catches: a method of Client whose parameters differ from AsyncClient's (seed 003 calls
    `search_flows(query, 50)`, which the blocking client refused with a TypeError while its limit
    was keyword-only)."""
    shared = [name for name, member in vars(Client).items()
              if callable(member) and not name.startswith("_") and hasattr(AsyncClient, name)]
    assert "search_flows" in shared and "read_stream" in shared
    for name in shared:
        blocking = inspect.signature(getattr(Client, name))
        awaited = inspect.signature(getattr(AsyncClient, name))
        assert [(p.name, p.kind, p.default) for p in blocking.parameters.values()] == [
            (p.name, p.kind, p.default) for p in awaited.parameters.values()], name
