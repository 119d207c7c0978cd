"""AgentSessionClient refuses what it cannot send, before anything is stored, on both backends.

Each case was once accepted and broke later: a step durability stored in a FlowConfig no reader
could decode (the session never ran), a session ID that is not a str failing deep in the engine,
the blocking engine Client whose calls commit and then fail (a retry sends twice), and a message ID
too long for int() raising instead of being "not queued".
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import math
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from agents.tests.scripted_agent import build_flow
from engine.tests.conftest import db_url, pg_database, pg_databases  # noqa: F401 - the fixtures used here
from engine.tests.odd_values import NO_REPR_VALUES

from dex_agents import AgentSessionClient, AgentSnapshot, UpdateSessionSettingsRequest
from dex_agents.testing import wait_for_agent_snapshot
from dex_engine import (
    AsyncClient,
    AsyncWorker,
    Client,
    FlowConfig,
    InvalidIdError,
    InvalidResumeTokenError,
    InvalidValueError,
    Registry,
    RpcNotFoundError,
    SearchQueryError,
    StepDurability,
    UnknownFlowTypeError,
    WorkerOptions,
    open_store,
)


@asynccontextmanager
async def sessions_on(tmp_path: Path, url: str, *, worker: bool = False) -> AsyncIterator[AgentSessionClient]:
    """The scripted agent's sessions on `url`; with `worker`, a Worker in this process runs them."""
    flow = build_flow(tmp_path)
    store = open_store(url)
    running: AsyncWorker | None = None
    try:
        if worker:
            running = AsyncWorker(Registry([flow]), WorkerOptions(database_url=url, poll_seconds=0.01), store=store)
            await running.__aenter__()
        yield AgentSessionClient(AsyncClient(Registry([flow]), store=store), flow)
    finally:
        if running is not None:
            await running.stop()
        await store.close()


def _turn_ended(snapshot: AgentSnapshot) -> bool:
    state = snapshot.state
    return state is not None and state.turn_count >= 1 and state.active_turn_id is None


@pytest.mark.parametrize("durability", ["async", "bogus", None, 1])
async def test_start_session_refuses_a_step_durability_that_is_not_one(
    tmp_path: Path, db_url: str, durability: Any  # noqa: F811
) -> None:
    """start_session refuses a step_durability other than StepDurability.SYNC or ASYNC with
    ValueError naming it, and starts nothing; the same ID then starts. Catches: the value stored in
    the session's FlowConfig, which no reader could decode: the session's Worker failed to claim
    StartAgentSession for ever and its messages were queued, never answered."""
    async with sessions_on(tmp_path, db_url) as sessions:
        with pytest.raises(ValueError) as caught:
            await sessions.start_session("s", "hi", step_durability=durability)
        assert str(caught.value) == (
            f"step_durability must be StepDurability.SYNC or StepDurability.ASYNC, got {durability!r}")
        assert not await sessions.client.exists("s")
        await sessions.start_session("s", "hi")
        assert (await sessions.client.describe_flow("s")).config == FlowConfig()


async def test_a_step_durability_given_as_its_text_runs_the_session(tmp_path: Path, db_url: str) -> None:  # noqa: F811
    """"ASYNC", the text of StepDurability.ASYNC, worked before step_durability was checked: it still
    starts a session whose config holds the member, and whose first turn runs."""
    async with sessions_on(tmp_path, db_url, worker=True) as sessions:
        await sessions.start_session("s", "hi", step_durability="ASYNC")  # type: ignore[arg-type]
        config = (await sessions.client.describe_flow("s")).config
        assert config.default_step_durability is StepDurability.ASYNC
        await wait_for_agent_snapshot(sessions, "s", _turn_ended, description="the first turn ended")


@pytest.mark.parametrize("bad", [42, None, b"s"], ids=["int", "none", "bytes"])
async def test_session_calls_refuse_a_session_id_that_is_not_a_str(
    tmp_path: Path, db_url: str, bad: Any  # noqa: F811
) -> None:
    """Every session call on an ID that is not a str (an int from a database row, None, bytes) raises
    the InvalidIdError start_session gives it, naming its type and value. Catches: AttributeError
    ('int' object has no attribute 'isprintable') from inside the engine for all but start_session."""
    message = f"flow ID must be a string, got {type(bad).__name__}: {bad!r}"
    async with sessions_on(tmp_path, db_url) as sessions:
        calls: dict[str, Callable[[], Awaitable[object]]] = {
            "start_session": lambda: sessions.start_session(bad, "hi"),
            "send_user_message": lambda: sessions.send_user_message(bad, "hi"),
            "get_agent_snapshot": lambda: sessions.get_agent_snapshot(bad),
            "list_agent_messages": lambda: sessions.list_agent_messages(bad),
            "resolve_interrupt": lambda: sessions.resolve_interrupt(bad, "c1", True),
            "delete_queued_message": lambda: sessions.delete_queued_message(bad, "1"),
            "cancel_turn": lambda: sessions.cancel_turn(bad),
            "read_agent_events": lambda: sessions.read_agent_events(bad),
        }
        for name, call in calls.items():
            with pytest.raises(InvalidIdError) as caught:
                await call()
            assert str(caught.value) == message, name


def test_the_blocking_engine_client_is_refused(tmp_path: Path, db_url: str) -> None:  # noqa: F811
    """AgentSessionClient refuses dex_engine.Client, whose calls cannot be awaited, with TypeError
    saying to pass an AsyncClient. Catches: send_user_message storing the message, then raising
    TypeError, so a caller's retry queued it twice."""
    flow = build_flow(tmp_path)
    with Client(Registry([flow]), db_url) as blocking, pytest.raises(TypeError) as caught:
        AgentSessionClient(blocking, flow)  # type: ignore[arg-type]
    assert str(caught.value) == ("client must be a dex_engine.AsyncClient, got Client, whose rpc cannot be awaited; "
                                 "pass a dex_engine.AsyncClient")


async def test_sync_code_shares_one_session_client_through_asyncio_run_in_many_threads(
    tmp_path: Path, db_url: str  # noqa: F811
) -> None:
    """docs/agents.md's way for sync code (a threaded WSGI app): one AgentSessionClient over one
    AsyncClient, each call run by asyncio.run in its own thread, 16 threads at once, each long-polling
    its session's events while the others start theirs; every session's first turn answers."""
    async with sessions_on(tmp_path, db_url, worker=True) as sessions:

        def request(n: int) -> bool:
            session_id = f"s{n}"
            asyncio.run(sessions.start_session(session_id, "hi"))
            token = None
            deadline = time.monotonic() + 60  # a hang guard
            while not _turn_ended(asyncio.run(sessions.get_agent_snapshot(session_id))):
                assert time.monotonic() < deadline, f"{session_id}'s first turn never ended"
                token = asyncio.run(sessions.read_agent_events(session_id, token, wait_seconds=1)).resume_token
            return True

        loop = asyncio.get_running_loop()
        with concurrent.futures.ThreadPoolExecutor(16) as threads:  # asyncio.to_thread's has 6 on 2 cores
            answered = await asyncio.gather(*(loop.run_in_executor(threads, request, n) for n in range(16)))
        assert answered == [True] * 16


async def test_a_message_id_too_long_to_be_one_is_not_queued(tmp_path: Path, db_url: str) -> None:  # noqa: F811
    """delete_queued_message and steer_user_message return False for a message ID of any length that
    names no queued message, and the queued message stays. Catches: an ID of over 4,300 digits
    raising Python's ValueError from int() instead."""
    async with sessions_on(tmp_path, db_url) as sessions:  # no Worker: the message stays queued
        await sessions.start_session("s")
        await sessions.send_user_message("s", "queued")
        queued_id = (await sessions.get_agent_snapshot("s")).queued_messages[0].message_id
        for message_id in ("9" * 20, "9" * 5000, "0" + queued_id):  # "01" is not message 1
            assert await sessions.delete_queued_message("s", message_id) is False
            assert await sessions.steer_user_message("s", message_id=message_id) is False
        queued = (await sessions.get_agent_snapshot("s")).queued_messages
        assert [m.message.text for m in queued] == ["queued"]
        assert await sessions.delete_queued_message("s", queued[0].message_id) is True


@pytest.mark.parametrize("settings", [[1, 2], "model-a", 5, True], ids=["array", "text", "number", "bool"])
async def test_update_session_settings_that_are_not_an_object_return_false(
    tmp_path: Path, db_url: str, settings: Any  # noqa: F811
) -> None:
    """The update_session_settings RPC returns False for settings that are not a JSON object, as seed
    002's RPC table says (with null, missing and oversized settings), and the stored settings stay.
    Catches: the request's decoding refusing them with InvalidValueError, so a caller on the wire (a
    web route forwarding a browser's body) got an exception where the contract promises False."""
    async with sessions_on(tmp_path, db_url, worker=True) as sessions:
        await sessions.start_session("s", "hi", session_settings={"model": "m"})
        await wait_for_agent_snapshot(sessions, "s", _turn_ended, description="the first turn ended")
        request = UpdateSessionSettingsRequest(settings)
        assert await sessions.client.rpc("s", "update_session_settings", request) is False
        assert await sessions.client.rpc("s", "update_session_settings", {"session_settings": settings}) is False
        assert (await sessions.get_agent_snapshot("s")).session_settings == {"model": "m"}
        assert await sessions.client.rpc("s", "update_session_settings", UpdateSessionSettingsRequest({})) is True
        assert (await sessions.get_agent_snapshot("s")).session_settings is None


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, True, 2.0, "3"],
                         ids=["nan", "inf", "-inf", "bool", "float", "text"])
async def test_message_pages_and_plan_revisions_refuse_a_number_that_is_not_a_whole_one(
    tmp_path: Path, db_url: str, bad: Any  # noqa: F811
) -> None:
    """list_agent_messages' before_sequence and limit and execute_plan's revision take an int: anything
    else raises TypeError naming the parameter and the value, and sends nothing. Catches: the engine's
    JSON writing NaN and the infinities as null, so before_sequence=nan was read as "no
    before_sequence" and answered with the newest page, as if it were a real cursor."""
    async with sessions_on(tmp_path, db_url, worker=True) as sessions:
        await sessions.start_session("s", "hi")
        await wait_for_agent_snapshot(sessions, "s", _turn_ended, description="the first turn ended")
        calls: dict[str, Callable[[], Awaitable[object]]] = {
            "before_sequence": lambda: sessions.list_agent_messages("s", before_sequence=bad),
            "limit": lambda: sessions.list_agent_messages("s", limit=bad),
            "revision": lambda: sessions.execute_plan("s", bad),
        }
        for name, call in calls.items():
            with pytest.raises(TypeError) as caught:
                await call()
            assert str(caught.value).startswith(f"{name} must be a whole number (int)"), caught.value
            assert f"got {type(bad).__name__}: {bad!r}" in str(caught.value)
        page = await sessions.list_agent_messages("s", before_sequence=None, limit=1)
        assert len(page.messages) == 1 and page.next_before_sequence == page.messages[0].sequence


@pytest.mark.parametrize("bad", NO_REPR_VALUES)
async def test_a_value_with_no_repr_gets_the_error_about_it(tmp_path: Path, db_url: str, bad: Any) -> None:  # noqa: F811
    """A value whose repr cannot be made (an int of over 4,300 digits, an object whose __repr__
    raises) given to a session or engine call gets the error that call gives any value of its
    type, naming the parameter, and stores nothing; the session then works. Catches: the error's
    own text raising Python's ValueError ("Exceeds the limit (4300 digits) for integer string
    conversion") or the object's error instead, and wait_for_flow raising OverflowError."""
    async with sessions_on(tmp_path, db_url, worker=True) as sessions:
        await sessions.start_session("s", "hi")
        await wait_for_agent_snapshot(sessions, "s", _turn_ended, description="the first turn ended")
        client = sessions.client
        kind = type(bad).__name__
        calls: dict[str, tuple[Callable[[], Awaitable[object]], type[Exception], str]] = {
            "session ID": (lambda: sessions.send_user_message(bad, "hi"), InvalidIdError,
                           f"flow ID must be a string, got {kind}: (a {kind} whose repr could not be made"),
            "text": (lambda: sessions.send_user_message("s", bad), TypeError, f"text must be a str, got {kind}: (a"),
            "interrupt_id": (lambda: sessions.resolve_interrupt("s", bad, True), TypeError,
                             f"interrupt_id must be a str, got {kind}"),
            "search mode": (lambda: sessions.start_session("t", active_step_search_mode=bad), ValueError,
                            "active_step_search_mode must be an ActiveStepSearchMode, got (a"),
            "resume token": (lambda: sessions.read_agent_events("s", bad), InvalidResumeTokenError,
                             "resume token (a"),
            "wait_seconds": (lambda: sessions.read_agent_events("s", wait_seconds=bad), ValueError,
                             "wait_seconds must be between 0 and"),
            "limit": (lambda: client.search_flows("", bad), ValueError, "limit must be a whole number"),
            "query": (lambda: client.search_flows(bad), SearchQueryError, f"search query must be text, got {kind}"),
            "rpc name": (lambda: client.rpc("s", bad), RpcNotFoundError, "has no RPC (a"),
            "flow type": (lambda: client.start_flow(bad, "t"), UnknownFlowTypeError, "unknown flow type (a"),
            "reason": (lambda: client.stop_flow("s", bad), InvalidValueError, "stop_flow's reason must be a str"),
            "config": (lambda: client.start_flow("ScriptedAgent", "t", config_override=bad), InvalidValueError,
                       "config_override must be a FlowConfig"),
        }
        if isinstance(bad, int):
            calls["timeout"] = (lambda: client.wait_for_flow("s", bad), TimeoutError, "")
        for name, (call, error, text) in calls.items():
            try:
                await asyncio.wait_for(call(), 0.5 if name == "timeout" else 30)
            except Exception as exc:
                if name == "timeout":  # waits for ever, as math.inf does: cut short here
                    assert isinstance(exc, TimeoutError), (name, exc)
                    continue
                assert type(exc) is error, (name, type(exc), exc)
                assert str(exc).startswith(text) or text in str(exc), (name, str(exc))
            else:
                raise AssertionError(f"{name}: {bad!r:.0} accepted")
        assert not await client.exists("t")
        assert await sessions.send_user_message("s", "again")
        await wait_for_agent_snapshot(sessions, "s", lambda s: s.state is not None and s.state.turn_count >= 2
                                      and s.state.active_turn_id is None, description="the second turn ended")


def test_session_clients_dropped_unclosed_close_their_stores(tmp_path: Path, db_url: str) -> None:  # noqa: F811
    """A web handler that makes an AgentSessionClient over an AsyncClient of its own per request and
    never closes it: once collected, each one's store threads end, with a ResourceWarning saying to
    close it. Catches: each such request kept its store's threads (9 on PostgreSQL) and connections
    until the process exited."""
    flow = build_flow(tmp_path)
    before = set(threading.enumerate())

    async def request(n: int) -> None:
        sessions = AgentSessionClient(AsyncClient(Registry([flow]), db_url), flow)
        await sessions.start_session(f"s{n}", "hi")
        await sessions.get_agent_snapshot(f"s{n}")

    with pytest.warns(ResourceWarning, match="an AsyncClient of .* was never closed"):
        for n in range(3):
            asyncio.run(request(n))
        gc.collect()
    started = {thread for thread in set(threading.enumerate()) - before if thread.name.startswith("dex-")}
    for thread in started:
        thread.join(30)  # a hang guard
    assert [thread.name for thread in started if thread.is_alive()] == []


async def test_read_agent_events_returns_at_most_limit_events_and_resumes_after_them(
    tmp_path: Path, db_url: str  # noqa: F811
) -> None:
    """read_agent_events(limit=n) hands the engine's read its limit: n events, and a resume token
    from which the next read goes on with the events after them. Catches: the limit dropped, every
    read answered with up to DEFAULT_READ_LIMIT events."""
    async with sessions_on(tmp_path, db_url, worker=True) as sessions:
        await sessions.start_session("s", "hi")
        await wait_for_agent_snapshot(sessions, "s", _turn_ended, description="the first turn ended")
        every = (await sessions.read_agent_events("s")).events
        assert len(every) >= 3
        first = await sessions.read_agent_events("s", limit=1)
        assert first.events == every[:1]
        after = await sessions.read_agent_events("s", first.resume_token, limit=2)
        assert after.events == every[1:3]


async def test_read_agent_events_with_wait_seconds_waits_for_the_next_event(
    tmp_path: Path, db_url: str  # noqa: F811
) -> None:
    """read_agent_events(wait_seconds=) long-polls: a read after the last event waits, and returns
    with the next turn's events once a message starts one. Catches: wait_seconds not handed to the
    engine's read, which then answers at once with no events and a UI polling it spins."""
    async with sessions_on(tmp_path, db_url, worker=True) as sessions:
        await sessions.start_session("s", "hi")
        await wait_for_agent_snapshot(sessions, "s", _turn_ended, description="the first turn ended")
        token = (await sessions.read_agent_events("s", limit=1000)).resume_token
        reader = asyncio.create_task(sessions.read_agent_events("s", token, wait_seconds=60))
        await asyncio.sleep(0.2)
        assert not reader.done(), f"the read did not wait: {reader.result() if reader.done() else None}"
        await sessions.send_user_message("s", "again")
        read = await asyncio.wait_for(reader, 90)  # a hang guard
        assert read.events and read.events[0].value.type == "turn_started"
