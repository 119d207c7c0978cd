"""Long-polling stream readers share one watcher per client and event loop: idle readers cost one
store operation a tick between them, not one read each (see _client._StreamWatch)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest

from dex_engine import AsyncClient, Registry, StreamRead
from dex_engine._limits import STREAM_WATCH_SECONDS

from .conftest import Engine, engine_for, wait_until
from .test_rules_e09_e16 import STREAMS_FLOW, Events, Other


def watchers() -> list[asyncio.Task[Any]]:
    """The stream watcher tasks of this event loop."""
    return [t for t in asyncio.all_tasks() if t.get_name() == "dex-stream-watch" and not t.done()]


def count_calls(monkeypatch: pytest.MonkeyPatch, target: object, name: str) -> list[int]:
    """Counts the calls of `target.name` from now on, in a one-item list."""
    calls = [0]
    real: Callable[..., Any] = getattr(target, name)

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(target, name, counting)
    return calls


async def started(eng: Engine, *flow_ids: str) -> None:
    for flow_id in flow_ids:
        await eng.client.start_flow("Streams", flow_id)


async def idle(reads: list[int], readers: list[asyncio.Task[StreamRead]]) -> None:
    """Until each reader made its first read and waits."""
    async def all_waiting() -> bool:
        return reads[0] >= len(readers) and not any(r.done() for r in readers)

    await wait_until("every reader waiting", all_waiting)


async def test_idle_readers_cost_one_operation_a_tick(db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """50 long-polling readers of 50 idle flows: the store runs about one operation a tick, not
    one per reader per tick (which took ~150 statements a second per reader and slowed every write).
    Catches: each waiting reader polling read_events by itself."""
    async with engine_for(db_url, Registry([STREAMS_FLOW]), worker=False) as eng:
        flow_ids = [f"idle-{i}" for i in range(50)]
        await started(eng, *flow_ids)
        reads = count_calls(monkeypatch, eng.store, "read_events")
        readers = [asyncio.create_task(eng.client.read_stream(f, Events, wait_seconds=30)) for f in flow_ids]
        await idle(reads, readers)
        operations = count_calls(monkeypatch, eng.store, "_run")
        window = 0.5
        await asyncio.sleep(window)
        ticks = window / STREAM_WATCH_SECONDS
        assert 1 <= operations[0] <= ticks + 5, operations  # one per reader per tick would be 1250
        assert reads[0] == len(readers)
        assert not any(r.done() for r in readers)
        for reader in readers:
            reader.cancel()
        await asyncio.gather(*readers, return_exceptions=True)


async def test_a_reader_wakes_for_its_own_stream_only(db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An event wakes the reader of its flow and stream, within a tick or so, and no other: not the
    reader of another stream of that flow, nor of that stream of another flow (each would read
    again). Catches: a watcher that keys readers by flow alone, or wakes all of them."""
    async with engine_for(db_url, Registry([STREAMS_FLOW]), worker=False) as eng:
        c = eng.client
        await started(eng, "s1", "s2")
        await c.rpc("s1", "append", ["a"])
        token = (await c.read_stream("s1", Events)).resume_token
        reads = count_calls(monkeypatch, eng.store, "read_events")
        mine = asyncio.create_task(c.read_stream("s1", Events, token, wait_seconds=30))
        other_stream = asyncio.create_task(c.read_stream("s1", Other, wait_seconds=30))
        other_flow = asyncio.create_task(c.read_stream("s2", Events, wait_seconds=30))
        await idle(reads, [mine, other_stream, other_flow])
        await asyncio.sleep(5 * STREAM_WATCH_SECONDS)  # a few ticks of the watcher, seeing nothing new
        assert reads[0] == 3

        appended = time.monotonic()
        await c.rpc("s1", "append", ["b"])
        result = await asyncio.wait_for(mine, 10)
        assert time.monotonic() - appended < 2, "the reader did not return as soon as its event existed"
        assert [(e.sequence, e.value) for e in result.events] == [(2, "b")]
        assert not result.trimmed
        await asyncio.sleep(5 * STREAM_WATCH_SECONDS)
        assert reads[0] == 4, "only the woken reader read again"
        assert not other_stream.done() and not other_flow.done()

        # Its token resumes after the event it returned.
        await c.rpc("s1", "append", ["c"])
        after = await c.read_stream("s1", Events, result.resume_token, wait_seconds=30)
        assert [e.value for e in after.events] == ["c"]
        for reader in (other_stream, other_flow):
            reader.cancel()
        await asyncio.gather(other_stream, other_flow, return_exceptions=True)
        await wait_until("the watcher ending once no one waits", lambda: asyncio.sleep(0, not watchers()))


async def test_a_cancelled_reader_leaves_the_others_waiting(db_url: str) -> None:
    """Cancelling one long-polling reader does not disturb the others: they still return on their
    events, or empty at their deadline; and the watcher task ends once no reader waits.
    Catches: a cancellation that ends the shared watcher, or leaves it running for ever."""
    async with engine_for(db_url, Registry([STREAMS_FLOW]), worker=False) as eng:
        c = eng.client
        await started(eng, "c1", "c2", "c3")
        cancelled = asyncio.create_task(c.read_stream("c1", Events, wait_seconds=30))
        woken = asyncio.create_task(c.read_stream("c2", Events, wait_seconds=30))
        begun = time.monotonic()
        timed_out = asyncio.create_task(c.read_stream("c3", Events, wait_seconds=1.0))
        await asyncio.sleep(5 * STREAM_WATCH_SECONDS)
        assert len(watchers()) == 1, "one watcher for all readers of this client and loop"
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled

        await c.rpc("c2", "append", ["x"])
        assert [e.value for e in (await asyncio.wait_for(woken, 10)).events] == ["x"]
        empty = await asyncio.wait_for(timed_out, 10)
        assert empty.events == [] and not empty.trimmed
        assert time.monotonic() - begun >= 1.0 * 0.9, "returned empty before its deadline"
        # Its token still resumes from the start: the stream had no event.
        await c.rpc("c3", "append", ["y"])
        assert [e.value for e in (await c.read_stream("c3", Events, empty.resume_token)).events] == ["y"]

        await wait_until("the watcher ending once no one waits", lambda: asyncio.sleep(0, not watchers()))
        # A later reader starts a new one.
        again = asyncio.create_task(c.read_stream("c1", Events, wait_seconds=30))
        await wait_until("a new watcher", lambda: asyncio.sleep(0, bool(watchers())))
        await c.rpc("c1", "append", ["z"])
        assert [e.value for e in (await asyncio.wait_for(again, 10)).events] == ["z"]


async def test_a_failing_watch_reaches_each_reader_as_its_own_reads_error(db_url: str) -> None:
    """When the watcher's read fails (here: the store was closed under the readers), every waiting
    reader reads again itself and raises that read's error, at once rather than at its deadline.
    Catches: readers left waiting on a watcher that cannot see, or one error given to all."""
    async with engine_for(db_url, Registry([STREAMS_FLOW]), worker=False) as eng:
        c = eng.client
        await started(eng, "e1", "e2", "e3")
        readers = [asyncio.create_task(c.read_stream(f, Events, wait_seconds=30)) for f in ("e1", "e2", "e3")]
        await asyncio.sleep(5 * STREAM_WATCH_SECONDS)
        assert not any(r.done() for r in readers)
        await eng.store.close()
        outcomes = await asyncio.wait_for(asyncio.gather(*readers, return_exceptions=True), 10)
        assert all(isinstance(o, RuntimeError) and "is closed" in str(o) for o in outcomes), outcomes
        assert len({id(o) for o in outcomes}) == 3, "each reader raised its own read's error"
        await wait_until("the watcher ending once no one waits", lambda: asyncio.sleep(0, not watchers()))


async def test_closing_a_client_ends_its_watcher_and_its_readers(db_url: str) -> None:
    """AsyncClient.close() while a reader long-polls: the reader raises the closed store's error
    at once, and no watcher task is left on the loop. Catches: a watcher outliving its client."""
    async with engine_for(db_url, Registry([STREAMS_FLOW]), worker=False) as eng:
        await started(eng, "k1")
    client = AsyncClient(Registry([STREAMS_FLOW]), db_url)
    reader = asyncio.create_task(client.read_stream("k1", Events, wait_seconds=30))
    await wait_until("a watcher", lambda: asyncio.sleep(0, bool(watchers())))
    await client.close()
    assert not watchers()
    with pytest.raises(RuntimeError, match="is closed"):
        await asyncio.wait_for(reader, 5)


# A bound on a read that must return at once, or within a tick or two: only a broken reader reaches it.
PROMPT_BOUND_SECONDS = 20.0


async def test_a_long_poll_of_a_closed_flow_returns_at_once_saying_so(db_url: str) -> None:
    """A closed flow's stream takes no more events, so a long poll of it with nothing left to read
    returns at once, empty, with flow_closed; a read that still has its events returns them with it.
    A running flow's reads say flow_closed is False. Catches: a UI following an ended session that
    waits out every poll and never learns the session ended."""
    async with engine_for(db_url, Registry([STREAMS_FLOW]), worker=False) as eng:
        c = eng.client
        await started(eng, "ended")
        await c.rpc("ended", "append", ["a", "b"])
        running = await c.read_stream("ended", Events)
        assert ([e.value for e in running.events], running.flow_closed) == (["a", "b"], False)
        await c.stop_flow("ended", "done")

        rest = await asyncio.wait_for(c.read_stream("ended", Events, wait_seconds=60), PROMPT_BOUND_SECONDS)
        assert ([e.value for e in rest.events], rest.flow_closed) == (["a", "b"], True)
        for token in (running.resume_token, rest.resume_token, None):
            stream = Other if token is None else Events  # Other never had an event
            nothing = await asyncio.wait_for(c.read_stream("ended", stream, token, wait_seconds=60),
                                             PROMPT_BOUND_SECONDS)
            assert (nothing.events, nothing.flow_closed) == ([], True)


async def test_a_long_poll_ends_when_its_flow_closes_meanwhile(db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader long-polling a flow that is stopped while it waits returns within a tick or two,
    empty, with flow_closed, not after its whole wait. Catches: a watcher that wakes a reader only
    when its stream grows, which a stopped flow's never does."""
    async with engine_for(db_url, Registry([STREAMS_FLOW]), worker=False) as eng:
        c = eng.client
        await started(eng, "closing")
        reads = count_calls(monkeypatch, eng.store, "read_events")
        waiting = asyncio.create_task(c.read_stream("closing", Events, wait_seconds=60))
        await idle(reads, [waiting])
        await c.stop_flow("closing", "done")
        result = await asyncio.wait_for(waiting, PROMPT_BOUND_SECONDS)
        assert (result.events, result.flow_closed) == ([], True)
