"""Every bad input gets its named error, a message naming the offending value, and no state change.

Client-side misuse is checked against a dump of every table before and after (via store.raw), with
no worker running so nothing else writes. Misuse inside a Step handler must fail that attempt, name
the error and the offending name in history, and commit none of the attempt's writes (E1, E14).
Definition errors (Flow, Step options, RetryPolicy, WorkerOptions, Wait) are raised at construction.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import math
import re
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgspec
import pytest

from dex_engine import (
    MAX_TIMER_SECONDS,
    MAX_VALUE_BYTES,
    MAX_VALUE_NESTING,
    AsyncClient,
    AsyncWorker,
    Attribute,
    AttributeMap,
    Channel,
    ChannelCondition,
    ChannelMap,
    Client,
    Context,
    Flow,
    FlowAlreadyStartedError,
    FlowConfig,
    FlowDefinitionError,
    FlowNotActiveError,
    FlowNotFoundError,
    InvalidIdError,
    InvalidResumeTokenError,
    InvalidValueError,
    InvalidWaitError,
    MovementOptions,
    Registry,
    RetryPolicy,
    RpcContext,
    RpcNotFoundError,
    RPCResult,
    SearchQueryError,
    StaleAttemptError,
    Step,
    StepDecision,
    StepDurability,
    StepNotWaitingError,
    StepOptions,
    Store,
    Stream,
    Timer,
    TimerCondition,
    UndeclaredNameError,
    UnknownFlowTypeError,
    ValueTooLargeError,
    Wait,
    WorkerOptions,
    _codec,
    open_store,
    rpc,
)
from dex_engine._codec import encode_value, may_nest_deeply, nesting_depth
from dex_engine._limits import (
    MAX_ERROR_TEXT_CHARS,
    MAX_OPTION_SECONDS,
    MAX_READ_LIMIT,
    MAX_RETENTION_SECONDS,
    MAX_STREAM_WAIT_SECONDS,
    MAX_WHOLE_NUMBER,
)
from dex_engine._retry import decide_retry

from .conftest import Engine, engine_for, wait_until

# The flow under test ---------------------------------------------------------------------------

Note = Attribute("Note", str)
Count = Attribute("Count", int)
Tags = AttributeMap("Tags", str)
Inbox = Channel("Inbox", int)
Boxes = ChannelMap("Boxes", str)
Events = Stream("Events", str)
Other = Stream("Other", str)

# Declared by no flow, or declared with another shape (a map where the flow has a plain value).
Stray = Attribute("Stray", int)
StrayChannel = Channel("StrayChannel", int)
NoteAsMap = AttributeMap("Note", str)
InboxAsMap = ChannelMap("Inbox", int)

HUGE = "x" * MAX_VALUE_BYTES  # encodes to MAX_VALUE_BYTES + 2 bytes (the JSON quotes)
ONCE = RetryPolicy(max_attempts=1)  # the first failure is final, so the flow fails at once
# Characters a database cannot store in text: PostgreSQL's text cannot hold NUL, and a lone
# surrogate has no UTF-8 encoding on either backend.
UNSTORABLE = {"nul": "\x00", "surrogate": "\ud800"}


KEPT_CONTEXTS: list[Context] = []  # contexts "keep_context" handed on past its return


def misuse(ctx: Context | RpcContext, what: str) -> None:
    """Each bad call a handler can make; a valid write first, which must not be committed."""
    ctx.set(Count, 41)
    if what == "undeclared_set":
        ctx.set(Stray, 1)
    elif what == "undeclared_publish":
        ctx.publish(StrayChannel, 1)
    elif what == "too_large":
        ctx.set(Note, HUGE)
    elif what == "wrong_type":
        ctx.set(Count, "three")  # type: ignore[arg-type]
    elif what == "set_by_name":
        ctx.set("Note", "x")  # type: ignore[arg-type]
    elif what == "get_whole_map":
        ctx.get(Tags)  # type: ignore[arg-type]
    elif what == "items_of_attribute":
        ctx.items(Note)  # type: ignore[arg-type]
    elif what == "publish_whole_map":
        ctx.publish(Boxes, "x")  # type: ignore[arg-type]
    else:
        raise AssertionError(f"unknown misuse {what!r}")


async def start(ctx: Context, what: str) -> StepDecision:
    if what == "ok":
        return StepDecision.graceful_complete("done")
    if what == "listen":
        return StepDecision.go_to("Listen", None)
    if what == "miswrapped":
        return StepDecision.go_to("Miswrapped", None)
    if what == "bad_wait":
        return StepDecision.go_to("BadWait", None)
    if what in ("stray_wait", "map_wait"):
        return StepDecision.go_to("StrayWait", what)
    if what == "undeclared_messages":
        return StepDecision.go_to("ReadStray", None)
    if what == "keep_context":  # a background task holding the context past the handler's return
        KEPT_CONTEXTS.append(ctx)
        return StepDecision.go_to("Listen", None)
    if what.startswith("checkpoint_bytes:"):  # a checkpoint of that many bytes in UTF-8 (é is two)
        size = int(what.partition(":")[2])
        await ctx.heartbeat("é" + "c" * (size - 2))
        return StepDecision.graceful_complete(len(ctx.checkpoint or ""))
    if what == "int_checkpoint":
        await ctx.heartbeat(5)  # type: ignore[arg-type]
    if what == "long_error":
        raise RuntimeError("e" * (2 * MAX_ERROR_TEXT_CHARS))
    if what == "long_reason":
        return StepDecision.force_fail("r" * (2 * MAX_ERROR_TEXT_CHARS))
    if what == "long_routed":
        return StepDecision.go_to("Routed", "long")
    if what == "bare_error":
        raise TimeoutError  # as a handler's own asyncio.wait_for raises it: no message
    kind, _, use = what.partition(":")
    if kind in UNSTORABLE:  # "<kind>:<use>", the character being UNSTORABLE[kind]
        bad = UNSTORABLE[kind]
        if use == "error":
            raise RuntimeError(f"bad{bad}value")
        if use == "reason":
            return StepDecision.force_fail(f"reason{bad}here")
        if use == "checkpoint":
            await ctx.heartbeat(f"a{bad}b")
        if use in ("retried", "routed"):
            return StepDecision.go_to(use.capitalize(), kind)
    if what == "textless_error":
        raise TextlessError("its __str__ raises")
    if what == "nul_value":
        ctx.set(Note, "a\x00b")
        return StepDecision.graceful_complete("c\x00d")
    if what == "undeclared_cancel":
        ctx.set(Count, 41)
        return StepDecision.graceful_complete("done").with_canceling_steps("Nowhere")
    misuse(ctx, what)
    return StepDecision.graceful_complete("misuse was not refused")


class TextlessError(Exception):
    """An exception whose text cannot be made: its __str__ (and so its repr's use of it) raises."""

    def __str__(self) -> str:
        raise ValueError("no text")

    def __repr__(self) -> str:
        raise ValueError("no repr")


def _takes_no_input(fn: Callable[[Context], Awaitable[StepDecision]]) -> Callable[..., Any]:
    """A decorator whose wrapper claims `fn`'s signature (functools.wraps) but takes only ctx: it
    passes the Flow's definition check, and calling it with (ctx, input) raises TypeError."""

    @functools.wraps(fn)
    async def wrapper(ctx: Context) -> StepDecision:
        return await fn(ctx)

    return wrapper


@_takes_no_input
async def miswrapped(ctx: Context, _: None = None) -> StepDecision:
    return StepDecision.graceful_complete(None)


async def fails_once(ctx: Context, kind: str) -> StepDecision:
    if ctx.attempt == 1:
        raise RuntimeError(f"bad{UNSTORABLE[kind]}value")
    return StepDecision.graceful_complete("retried")


async def fails(ctx: Context, kind: str) -> StepDecision:
    if kind == "long":
        raise RuntimeError("e" * (2 * MAX_ERROR_TEXT_CHARS))
    raise RuntimeError(f"bad{UNSTORABLE[kind]}value")


async def recovered(ctx: Context, _: str) -> StepDecision:
    assert ctx.recovery_error is not None
    return StepDecision.graceful_complete(ctx.recovery_error.detail)


async def listen_wait(ctx: Context, _: None) -> Wait:
    return Wait.until(Inbox.for_one())


async def bad_wait(ctx: Context, _: None) -> Wait:
    ctx.set(Count, 41)
    return Wait.until(Inbox.for_range(2, 1))  # raises InvalidWaitError


async def stray_wait(ctx: Context, what: str) -> Wait:
    """A wait nothing could satisfy: a channel the flow lacks, or an instance of a plain channel.
    The first writes nothing, so the worker also evaluates it before the commit that starts it."""
    if what == "stray_wait":
        return Wait.until(StrayChannel.for_one())
    ctx.set(Count, 41)
    return Wait.until(InboxAsMap["k"].for_one())


async def read_stray(ctx: Context, _: None) -> StepDecision:
    ctx.set(Count, 41)
    ctx.wait_result.messages(StrayChannel)
    return StepDecision.graceful_complete("messages of a stray channel were not refused")


async def at_once(ctx: Context, _: None) -> Wait:
    return Wait.until(Timer.by_duration(0))


async def done(ctx: Context, _: None) -> StepDecision:
    return StepDecision.graceful_complete(None)


@rpc(request_type=str)
async def note(ctx: RpcContext, text: str) -> None:
    ctx.set(Note, text)


@rpc(request_type=str)
async def append(ctx: RpcContext, event: str) -> None:
    ctx.append(Events, event)
    ctx.append(Other, event)


@rpc(name="misuse", request_type=str)
async def misuse_rpc(ctx: RpcContext, what: str) -> None:
    misuse(ctx, what)


@rpc(request_type=str)
async def stray_result(ctx: RpcContext, what: str) -> RPCResult[None]:
    """An RPCResult naming a Step type the flow lacks; a valid write first, which must not be committed."""
    ctx.set(Count, 41)
    if what == "cancel":
        return RPCResult(None, canceling_steps=("NoSuchStep",))
    return RPCResult(None, ending_retry_waits=("NoSuchStep",))


KEPT_RPC_CONTEXTS: list[RpcContext] = []  # contexts keep_rpc_context handed on past its return


@rpc(name="keep_rpc_context")
async def keep_rpc_context(ctx: RpcContext, _: None) -> None:
    KEPT_RPC_CONTEXTS.append(ctx)
    ctx.set(Note, "kept")


@rpc(request_type=int)
async def takes_int(ctx: RpcContext, n: int) -> int:
    ctx.set(Count, n)
    return n


FLOW = Flow(
    "Bad",
    [
        Step("Start", start, input_type=str, options=StepOptions(execute_retry=ONCE)),
        Step("Listen", done, wait_for=listen_wait, input_type=type(None)),
        Step("Retried", fails_once, input_type=str,
             options=StepOptions(execute_retry=RetryPolicy(max_attempts=2, initial_interval_seconds=0.01))),
        Step("Routed", fails, input_type=str, options=StepOptions(execute_retry=ONCE, failure_route="Recovered")),
        Step("Recovered", recovered, input_type=str),
        Step("Miswrapped", miswrapped, input_type=type(None), options=StepOptions(execute_retry=ONCE)),
        Step("BadWait", done, wait_for=bad_wait, input_type=type(None), options=StepOptions(wait_for_retry=ONCE)),
        Step("StrayWait", done, wait_for=stray_wait, input_type=str, options=StepOptions(wait_for_retry=ONCE)),
        Step("ReadStray", read_stray, wait_for=at_once, input_type=type(None), options=StepOptions(execute_retry=ONCE)),
    ],
    start_step="Start",
    schema=[Note, Count, Tags, Inbox, Boxes, Events, Other],
    rpcs=[note, append, misuse_rpc, takes_int, keep_rpc_context, stray_result],
)
OTHER_FLOW = Flow("OtherType", [Step("Start", start, input_type=str)], start_step="Start")
REGISTRY = Registry([FLOW, OTHER_FLOW])


# Helpers ---------------------------------------------------------------------------------------

Dump = dict[str, list[str]]


# Every table of the engine's schema; PostgreSQL also keeps the Step counters and stream positions
# in tables of their own (SQLite keeps them in the flow row).
TABLES = ("meta", "flows", "tasks", "locks", "attributes", "channel_messages", "stream_events", "history",
          "workers")
POSTGRES_TABLES = ("step_counters", "streams")


async def dump(store: Store) -> Dump:
    """Every row of every table, as sorted reprs (history has no rowid to order by)."""

    def read(db: Any) -> Dump:
        names = TABLES + (POSTGRES_TABLES if getattr(db, "dialect", None) == "postgres" else ())
        return {name: sorted(repr(row) for row in db.all(f'SELECT * FROM "{name}"')) for name in names}

    result: Dump = await store.raw(read)
    return result


@asynccontextmanager
async def unchanged(store: Store) -> AsyncIterator[None]:
    """Assert the block leaves every table exactly as it found it."""
    before = await dump(store)
    yield
    after = await dump(store)
    changed = [t for t in before if before[t] != after.get(t)] + [t for t in after if t not in before]
    assert not changed, f"tables changed by a refused input: {changed}"


async def refused(
    store: Store, call: Callable[[], Awaitable[Any]], error: type[BaseException], *names: str
) -> BaseException:
    """`call` raises exactly `error` (not a subclass of it), naming each of `names`, changing nothing."""
    async with unchanged(store):
        with pytest.raises(error) as caught:
            await call()
    assert type(caught.value) is error, f"expected {error.__name__}, got {type(caught.value).__name__}"
    message = str(caught.value)
    for name in names:
        assert name in message, f"{error.__name__} message {message!r} does not name {name!r}"
    return caught.value


@asynccontextmanager
async def idle_engine(db_url: str) -> AsyncIterator[Engine]:
    """A store and client with no worker, so only the calls under test write; flow 'f' is running."""
    async with engine_for(db_url, REGISTRY, worker=False) as eng:
        await eng.client.start_flow("Bad", "f", "listen")
        await eng.client.rpc("f", "note", "kept")
        await eng.client.rpc("f", "append", "e1")
        yield eng


# Undeclared names ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("case", "name"),
    [
        ("client.publish", "'StrayChannel'"),
        ("client.publish map instance of plain channel", "'Inbox[k]'"),
        ("client.get_attribute", "'Stray'"),
        ("client.get_attribute map instance of plain attribute", "'Note[k]'"),
        ("client.read_stream", "'Nope'"),
        ("rpc ctx.set", "'Stray'"),
        ("rpc ctx.publish", "'StrayChannel'"),
        ("rpc cancels", "'NoSuchStep'"),
        ("rpc ends retry waits", "'NoSuchStep'"),
    ],
)
async def test_undeclared_name_from_client_or_rpc(db_url: str, case: str, name: str) -> None:
    """Naming an attribute, channel, stream or (in an RPCResult) Step type the flow does not declare
    raises UndeclaredNameError naming it; an RPC that does so commits none of its other writes."""
    async with idle_engine(db_url) as eng:
        c = eng.client
        calls: dict[str, Callable[[], Awaitable[Any]]] = {
            "client.publish": lambda: c.publish("f", StrayChannel, 1),
            "client.publish map instance of plain channel": lambda: c.publish("f", InboxAsMap["k"], 1),
            "client.get_attribute": lambda: c.get_attribute("f", Stray),
            "client.get_attribute map instance of plain attribute": lambda: c.get_attribute("f", NoteAsMap["k"]),
            "client.read_stream": lambda: c.read_stream("f", "Nope"),
            "rpc ctx.set": lambda: c.rpc("f", "misuse", "undeclared_set"),
            "rpc ctx.publish": lambda: c.rpc("f", "misuse", "undeclared_publish"),
            "rpc cancels": lambda: c.rpc("f", "stray_result", "cancel"),
            "rpc ends retry waits": lambda: c.rpc("f", "stray_result", "end"),
        }
        await refused(eng.store, calls[case], UndeclaredNameError, name, "'Bad'")


@pytest.mark.parametrize("ref", [None, "Note", 7, b"Events", ["Note"]], ids=["none", "name", "int", "bytes", "list"])
@pytest.mark.parametrize("method", ["publish", "get_attribute", "get_attribute_map", "read_stream"])
async def test_client_calls_refuse_a_schema_ref_of_another_type(db_url: str, method: str, ref: Any) -> None:
    """publish, get_attribute, get_attribute_map and read_stream given something other than the
    Channel, Attribute, AttributeMap or Stream (None, the attribute's name as text) raise
    InvalidValueError naming the argument, its type and what to pass, changing nothing; read_stream
    still takes a stream's name. Catches: AttributeError ('NoneType' object has no attribute
    'name') or TypeError ('str' indices) from deep in the lookup, naming neither."""
    if method == "read_stream" and isinstance(ref, str):
        ref = 7  # a name is a stream read_stream accepts
    async with idle_engine(db_url) as eng:
        c = eng.client
        calls: dict[str, tuple[Callable[[], Awaitable[Any]], str]] = {
            "publish": (lambda: c.publish("f", ref, 1), "channel must be of type ChannelRef"),
            "get_attribute": (lambda: c.get_attribute("f", ref), "ref must be of type AttributeRef"),
            "get_attribute_map": (lambda: c.get_attribute_map("f", ref), "amap must be of type AttributeMap"),
            "read_stream": (lambda: c.read_stream("f", ref), "stream must be of type Stream"),
        }
        call, named = calls[method]
        await refused(eng.store, call, InvalidValueError, named, f"got {type(ref).__name__}: {ref!r}",
                      "the Flow declares")
        assert await c.get_attribute("f", Note) == "kept"
        assert [e.value for e in (await c.read_stream("f", "Events")).events] == ["e1"]


@pytest.mark.parametrize(
    ("what", "method", "error", "name"),
    [
        ("undeclared_set", "execute", UndeclaredNameError, "'Stray'"),
        ("undeclared_publish", "execute", UndeclaredNameError, "'StrayChannel'"),
        ("undeclared_cancel", "execute", UndeclaredNameError, "'Nowhere'"),
        ("too_large", "execute", ValueTooLargeError, "'Note'"),
        ("wrong_type", "execute", InvalidValueError, "'Count'"),
        ("bad_wait", "wait_for", InvalidWaitError, "'Inbox'"),
        # Catches: the wait stored, and the flow waiting for ever on a channel no one can publish to.
        ("stray_wait", "wait_for", UndeclaredNameError, "'StrayChannel'"),
        ("map_wait", "wait_for", UndeclaredNameError, "'Inbox[k]'"),
        # Catches: [] for messages of a channel the flow lacks (a typo reads as "nothing came").
        ("undeclared_messages", "execute", UndeclaredNameError, "'StrayChannel'"),
        # Catches: "'str' object has no attribute 'name'", "'AttributeMap' object has no attribute
        # 'key'", "attribute 'Note[?]' is not declared" (Note is) and "argument of type 'int' is not
        # iterable": bare errors naming neither the argument nor the fix.
        ("set_by_name", "execute", InvalidValueError, "an Attribute or an AttributeMap[key] the flow declares, got "
         "str: 'Note'"),
        ("get_whole_map", "execute", InvalidValueError, "attribute map 'Tags' given whole where one attribute is "
         "read or written; give one instance of it, Tags[key]"),
        ("items_of_attribute", "execute", InvalidValueError, "attribute 'Note' is a plain Attribute, not an "
         "AttributeMap; read it with get"),
        ("publish_whole_map", "execute", InvalidValueError, "channel map 'Boxes' given whole where one channel is "
         "meant; give one instance of it, Boxes[key]"),
        ("int_checkpoint", "execute", InvalidValueError, "a heartbeat checkpoint must be a str or None, got int: 5"),
    ],
)
async def test_misuse_in_a_step_handler_fails_the_attempt_and_history_names_it(
    db_url: str, what: str, method: str, error: type[Exception], name: str
) -> None:
    """A handler's bad call fails its attempt (E1: none of its writes commit); history's
    attempt_failed entry and the flow's error name the error type and the offending name; the
    worker keeps running other flows (E14)."""
    async with engine_for(db_url, REGISTRY) as eng:
        c = eng.client
        await c.start_flow("Bad", "f", what)
        info = await c.wait_for_flow("f", 10)
        assert info.status == "failed"
        assert info.error is not None and error.__name__ in info.error and name in info.error
        failed = [h for h in await c.get_flow_history("f") if h.event_type == "attempt_failed"]
        assert len(failed) == 1, failed
        assert failed[0].detail.startswith(f"{method}: {error.__name__}: "), failed[0].detail
        assert name in failed[0].detail
        assert await c.get_attribute("f", Count) is None, "a failed attempt's write was committed"

        await c.start_flow("Bad", "after", "ok")
        assert (await c.wait_for_flow("after", 10)).status == "completed"


async def test_a_long_error_is_kept_cut_to_the_error_text_limit(db_url: str) -> None:
    """A handler's error text, a force_fail reason and a stop reason longer than MAX_ERROR_TEXT_CHARS
    are kept to their first that many characters: in history, in the flow's error, and in the error
    a failure route is handed. Catches: an error kept whole (a handler raising a whole response
    body), which grew the rows by megabytes and made the failure route's own writes, which often
    keep the error, too large to commit."""
    limit = MAX_ERROR_TEXT_CHARS
    async with engine_for(db_url, REGISTRY) as eng:
        c = eng.client
        await c.start_flow("Bad", "f", "long_error")
        info = await c.wait_for_flow("f", 10)
        assert info.status == "failed"
        failed = [h for h in await c.get_flow_history("f") if h.event_type == "attempt_failed"]
        assert len(failed) == 1, failed
        assert failed[0].detail == ("execute: RuntimeError: " + "e" * (2 * limit))[:limit]
        assert info.error == ("Step Start-1 failed after 1 attempt(s): RuntimeError: " + "e" * (2 * limit))[:limit]

        await c.start_flow("Bad", "routed", "long_routed")
        assert (await c.wait_for_flow("routed", 10)).status == "completed"
        assert await c.flow_output("routed") == "e" * limit

        await c.start_flow("Bad", "reason", "long_reason")
        assert (await c.wait_for_flow("reason", 10)).error == "r" * limit
        await c.start_flow("Bad", "stop", "listen")
        await c.stop_flow("stop", "s" * (2 * limit))
        assert (await c.describe_flow("stop")).error == "s" * limit


async def test_an_error_whose_text_cannot_be_made_fails_the_attempt(db_url: str) -> None:
    """A handler raising an exception whose __str__ and __repr__ raise fails its attempt, named by
    its type. Catches: the failure's text made without a guard, which raised in the worker, so the
    attempt was handed back and run again without end, the flow running forever."""
    async with engine_for(db_url, REGISTRY) as eng:
        c = eng.client
        await c.start_flow("Bad", "f", "textless_error")
        info = await c.wait_for_flow("f", 10)
        assert (info.status, info.error) == (
            "failed", "Step Start-1 failed after 1 attempt(s): TextlessError: (its text could not be made: ValueError)")


async def test_a_handler_that_cannot_be_called_with_its_input_fails_the_attempt(db_url: str) -> None:
    """A handler that raises when called with (ctx, input), before it runs (here a decorator's
    wrapper that takes only ctx, which the definition check cannot see through functools.wraps),
    fails its attempt with WorkerInvocationError naming the TypeError. Catches: only the engine's
    own errors caught at the call, any other raised in the worker and the attempt handed back and
    run again without end."""
    async with engine_for(db_url, REGISTRY) as eng:
        c = eng.client
        await c.start_flow("Bad", "f", "miswrapped")
        info = await c.wait_for_flow("f", 10)
        assert info.status == "failed" and info.error is not None
        assert info.error.startswith("Step Miswrapped-1 failed after 1 attempt(s): WorkerInvocationError: TypeError: ")
        assert "positional argument" in info.error


async def test_an_error_without_a_message_is_named_by_its_repr(db_url: str) -> None:
    """An exception raised with no message (a handler's own asyncio.wait_for timing out) still
    says what it was in history and in the flow's error, rather than leaving the detail empty."""
    async with engine_for(db_url, REGISTRY) as eng:
        c = eng.client
        await c.start_flow("Bad", "f", "bare_error")
        info = await c.wait_for_flow("f", 10)
        assert info.status == "failed" and info.error is not None and "TimeoutError()" in info.error, info
        failed = [h for h in await c.get_flow_history("f") if h.event_type == "attempt_failed"]
        assert [h.detail for h in failed] == ["execute: TimeoutError: TimeoutError()"]


@pytest.mark.parametrize(("kind", "escaped"), [("nul", "\\x00"), ("surrogate", "\\ud800")])
async def test_texts_with_an_unstorable_character_are_kept_with_it_escaped(
    db_url: str, kind: str, escaped: str,
) -> None:
    """An error message (final, retried or handed to a failure route), a force_fail reason and a stop reason with a NUL
    character (which PostgreSQL's text cannot hold) or a lone surrogate (which no backend can encode)
    are kept with it written as its escape, on both backends alike, and the worker goes on.
    Catches: the text sent to the database as is, where the failure could never be recorded and the
    worker handed the attempt back and ran it again without end."""
    bad = UNSTORABLE[kind]
    async with engine_for(db_url, REGISTRY) as eng:
        c = eng.client
        await c.start_flow("Bad", "error", f"{kind}:error")
        info = await c.wait_for_flow("error", 10)
        assert info.status == "failed" and info.error is not None and f"RuntimeError: bad{escaped}value" in info.error
        failed = [h.detail for h in await c.get_flow_history("error") if h.event_type == "attempt_failed"]
        assert failed == [f"execute: RuntimeError: bad{escaped}value"]

        await c.start_flow("Bad", "retried", f"{kind}:retried")
        assert (await c.wait_for_flow("retried", 10)).status == "completed"
        failed = [h.detail for h in await c.get_flow_history("retried") if h.event_type == "attempt_failed"]
        assert failed == [f"execute: RuntimeError: bad{escaped}value"]

        await c.start_flow("Bad", "routed", f"{kind}:routed")  # its failure route is handed the error
        assert (await c.wait_for_flow("routed", 10)).status == "completed"
        assert await c.flow_output("routed") == f"bad{escaped}value"

        await c.start_flow("Bad", "reason", f"{kind}:reason")
        info = await c.wait_for_flow("reason", 10)
        assert (info.status, info.error) == ("failed", f"reason{escaped}here")
        closed = [h.detail for h in await c.get_flow_history("reason") if h.event_type == "flow_closed"]
        assert closed == [f"failed: reason{escaped}here"]

        await c.start_flow("Bad", "stop", "listen")
        await c.stop_flow("stop", f"why{bad}not")
        info = await c.describe_flow("stop")
        assert (info.status, info.error) == ("stopped", f"why{escaped}not")

        await c.start_flow("Bad", "after", "ok")
        assert (await c.wait_for_flow("after", 10)).status == "completed"


async def test_values_keep_a_nul_character_as_it_is(db_url: str) -> None:
    """Values are JSON, which writes a NUL character as an escape of its own: it comes back unchanged."""
    async with engine_for(db_url, REGISTRY) as eng:
        c = eng.client
        await c.start_flow("Bad", "value", "nul_value")
        assert (await c.wait_for_flow("value", 10)).status == "completed"
        assert await c.get_attribute("value", Note) == "a\x00b"
        assert await c.flow_output("value") == "c\x00d"


UNICODE_NOTES = AttributeMap("UnicodeNotes", str)


async def _note_under_itself(ctx: Context, text: str) -> StepDecision:
    ctx.set(UNICODE_NOTES[text], text)
    return StepDecision.graceful_complete(text)


UNICODE_FLOW = Flow("Unicode", [Step("Note", _note_under_itself, input_type=str)], start_step="Note",
                    schema=[UNICODE_NOTES])


async def test_text_beyond_latin1_is_kept_whatever_pgclientencoding_says(
    db_url: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A flow ID, map key and value beyond Latin-1 (a combining accent, an emoji) are kept as on
    SQLite when the environment sets PGCLIENTENCODING=LATIN1 (as some hosts do): the store speaks
    UTF-8 to PostgreSQL whatever libpq's defaults say. Catches: start_flow raising a bare
    UnicodeEncodeError, and a Step writing such a value failing after its retries, on PostgreSQL
    only."""
    monkeypatch.setenv("PGCLIENTENCODING", "LATIN1")
    text = "e\u0301\U0001F600"
    async with engine_for(db_url, Registry([UNICODE_FLOW])) as eng:
        c = eng.client
        await c.start_flow("Unicode", text, text)
        assert (await c.wait_for_flow(text, 10)).status == "completed"
        assert await c.flow_output(text) == text
        assert await c.get_attribute_map(text, UNICODE_NOTES) == {text: text}
        assert await c.search_flows('FlowType = "Unicode"') == [text]


@pytest.mark.parametrize(("kind", "named"), [("nul", "a NUL character"), ("surrogate", "a lone surrogate")])
async def test_a_heartbeat_checkpoint_with_an_unstorable_character_is_refused(
    db_url: str, kind: str, named: str,
) -> None:
    """A heartbeat checkpoint with a NUL character or a lone surrogate (stored as text, which cannot
    hold either, and not escaped, since it must come back exactly) is refused on both backends with
    InvalidValueError naming the character and its place: the attempt fails with that error."""
    async with engine_for(db_url, REGISTRY) as eng:
        c = eng.client
        await c.start_flow("Bad", "f", f"{kind}:checkpoint")
        info = await c.wait_for_flow("f", 10)
        assert info.status == "failed" and info.error is not None
        shown = repr(f"a{UNSTORABLE[kind]}b")
        assert f"InvalidValueError: heartbeat checkpoint {shown} contains {named} at index 1" in info.error


async def test_a_heartbeat_checkpoint_over_the_value_limit_is_refused(db_url: str) -> None:
    """A heartbeat checkpoint over MAX_VALUE_BYTES in UTF-8 (every later claim of the method loads
    it) is refused with ValueTooLargeError naming its size, as a value is; one of exactly that size
    is kept. Catches: a checkpoint of any size stored (PostgreSQL refuses a field over 1 GB), or
    its size counted in characters rather than bytes."""
    async with engine_for(db_url, REGISTRY) as eng:
        c = eng.client
        await c.start_flow("Bad", "fits", f"checkpoint_bytes:{MAX_VALUE_BYTES}")
        assert (await c.wait_for_flow("fits", 10)).status == "completed"
        assert await c.flow_output("fits") == MAX_VALUE_BYTES - 1
        await c.start_flow("Bad", "over", f"checkpoint_bytes:{MAX_VALUE_BYTES + 1}")
        info = await c.wait_for_flow("over", 10)
        assert info.status == "failed" and info.error is not None
        assert (f"ValueTooLargeError: value for 'heartbeat checkpoint' is {MAX_VALUE_BYTES + 1} bytes encoded, "
                f"over MAX_VALUE_BYTES ({MAX_VALUE_BYTES})") in info.error


# IDs and keys ----------------------------------------------------------------------------------

BAD_IDS = [
    pytest.param("a/b", "'a/b'", id="slash"),
    pytest.param("a b", "'a b'", id="space"),
    pytest.param("tab\there", "'tab\\there'", id="tab"),
    pytest.param("new\nline", "'new\\nline'", id="newline"),
    pytest.param("bell\x07", "'bell\\x07'", id="control"),
    pytest.param("nbsp\u00a0x", "nbsp", id="unicode-space"),
    pytest.param("", "empty", id="empty"),
    pytest.param("x" * 256, "256 characters", id="too-long"),
]


@pytest.mark.parametrize(("flow_id", "named"), BAD_IDS)
async def test_bad_flow_id_is_refused(db_url: str, flow_id: str, named: str) -> None:
    """start_flow refuses an ID with '/', whitespace or control characters, an empty one, and one
    over 255 characters, with InvalidIdError naming it; no flow is created."""
    async with engine_for(db_url, REGISTRY, worker=False) as eng:
        await refused(eng.store, lambda: eng.client.start_flow("Bad", flow_id, "ok"), InvalidIdError,
                      "flow ID", named)


def _lookups(c: AsyncClient, bad: Any) -> dict[str, Callable[[], Awaitable[object]]]:
    """Every client call that names a flow, on flow ID `bad`."""
    return {
        "describe_flow": lambda: c.describe_flow(bad),
        "get_flow_history": lambda: c.get_flow_history(bad),
        "wait_for_flow": lambda: c.wait_for_flow(bad, 1),
        "flow_output": lambda: c.flow_output(bad),
        "stop_flow": lambda: c.stop_flow(bad, "why"),
        "skip_timer": lambda: c.skip_timer(bad, "Listen-1"),
        "update_flow_config": lambda: c.update_flow_config(bad, FlowConfig()),
        "rpc": lambda: c.rpc(bad, "note", "x"),
        "publish": lambda: c.publish(bad, Inbox, 1),
        "get_attribute": lambda: c.get_attribute(bad, Note),
        "get_attribute_map": lambda: c.get_attribute_map(bad, Tags),
        "read_stream": lambda: c.read_stream(bad, Events),
    }


@pytest.mark.parametrize("kind", UNSTORABLE)
async def test_lookups_of_an_id_with_an_unstorable_character_find_no_flow(db_url: str, kind: str) -> None:
    """No flow has an ID with a NUL character or a lone surrogate (start_flow refuses both), so
    every client call on one raises FlowNotFoundError naming it, on both backends alike, a Step
    execution ID with one is not waiting, and a search for a name with one finds nothing (for a
    status with one: SearchQueryError, as for any unknown status).
    Catches: the text sent to the database, where PostgreSQL's text cannot hold NUL (a DataError)
    and neither backend can encode a lone surrogate (a UnicodeEncodeError)."""
    bad = f"a{UNSTORABLE[kind]}b"
    async with engine_for(db_url, REGISTRY, worker=False) as eng:
        c = eng.client
        await c.start_flow("Bad", "f", "listen")
        for name, call in _lookups(c, bad).items():
            with pytest.raises(FlowNotFoundError, match=re.escape(repr(bad))):
                await call()
            assert (await c.describe_flow("f")).status == "running", name
        assert await c.exists(bad) is False
        with pytest.raises(StepNotWaitingError, match=re.escape(repr(bad))):
            await c.skip_timer("f", bad)
        for term in ("FlowType", "ActiveStepTypes"):
            assert await c.search_flows(f'{term} = "{bad}"') == []
        with pytest.raises(SearchQueryError, match="is not a flow status"):  # no status has one
            await c.search_flows(f'FlowStatus = "{bad}"')


@pytest.mark.parametrize("bad", [42, None, b"f", ["f"]], ids=["int", "none", "bytes", "list"])
async def test_lookups_of_an_id_that_is_not_a_str_are_refused_as_start_flow_refuses_it(db_url: str, bad: Any) -> None:
    """A flow ID that is not a str (an int read from a row, a None, bytes) gets from every client call
    the InvalidIdError start_flow gives it, naming its type and value, and changes nothing.
    Catches: AttributeError ('int' object has no attribute 'isprintable') from inside the client, and
    TypeError (unhashable type) from its cache of flow types for a list."""
    message = f"flow ID must be a string, got {type(bad).__name__}: {bad!r}"
    async with idle_engine(db_url) as eng:
        c = eng.client
        calls = {"start_flow": lambda: c.start_flow("Bad", bad, "ok"), "exists": lambda: c.exists(bad),
                 **_lookups(c, bad)}
        for name, call in calls.items():
            error = await refused(eng.store, call, InvalidIdError)
            assert str(error) == message, name


async def test_a_step_execution_id_or_query_that_is_not_a_str_is_refused(db_url: str) -> None:
    """skip_timer's Step execution ID and search_flows's query must be text: InvalidIdError and
    SearchQueryError name the value. Catches: AttributeError from inside the client."""
    async with idle_engine(db_url) as eng:
        c = eng.client
        error = await refused(eng.store, lambda: c.skip_timer("f", 7), InvalidIdError)  # type: ignore[arg-type]
        assert str(error) == "step execution ID must be a string, got int: 7"
        error = await refused(eng.store, lambda: c.search_flows(7), SearchQueryError)  # type: ignore[arg-type]
        assert str(error) == "search query must be text, got int: 7"


async def test_longest_and_punctuated_flow_ids_are_accepted(db_url: str) -> None:
    """The boundary: 255 characters and punctuation other than '/' are valid flow IDs."""
    async with engine_for(db_url, REGISTRY, worker=False) as eng:
        for flow_id in ("x" * 255, "user:42|session.7-b_c@host#1", "ünïcødé"):
            await eng.client.start_flow("Bad", flow_id, "ok")
            assert (await eng.client.describe_flow(flow_id)).flow_id == flow_id


@pytest.mark.parametrize(
    ("make", "named"),
    [
        pytest.param(lambda: Tags[""], "empty", id="attribute-map-empty"),
        pytest.param(lambda: Tags["a\x00b"], "'a\\x00b'", id="attribute-map-nul"),
        pytest.param(lambda: Boxes[""], "empty", id="channel-map-empty"),
        pytest.param(lambda: Boxes["\x1b[31m"], "'\\x1b[31m'", id="channel-map-escape"),
        pytest.param(lambda: Boxes["k" * 256], "256 characters", id="channel-map-too-long"),
        pytest.param(lambda: Tags[7], "7", id="not-a-string"),
    ],
)
def test_bad_map_key_is_refused(make: Callable[[], object], named: str) -> None:
    """A map key that is empty, has control characters, is too long or is not text raises
    InvalidIdError naming the map and the key, before anything is stored."""
    with pytest.raises(InvalidIdError) as caught:
        make()
    assert named in str(caught.value)
    assert "Tags" in str(caught.value) or "Boxes" in str(caught.value)


@pytest.mark.parametrize(
    ("make", "named"),
    [
        pytest.param(lambda: Attribute("bad name", int), "'bad name'", id="attribute"),
        pytest.param(lambda: Channel("a/b", int), "'a/b'", id="channel"),
        pytest.param(lambda: Stream("", str), "stream name is empty", id="stream"),
        pytest.param(lambda: Step("tab\t", done), "'tab\\t'", id="step-type"),
        pytest.param(lambda: Flow("x" * 300, []), "300 characters", id="flow-type"),
        pytest.param(lambda: rpc("no/slash")(note.handler), "'no/slash'", id="rpc-name"),
    ],
)
def test_bad_names_in_definitions_are_refused(make: Callable[[], object], named: str) -> None:
    """Names of attributes, channels, streams, Steps, flow types and RPCs follow the ID rules."""
    with pytest.raises(InvalidIdError) as caught:
        make()
    assert named in str(caught.value)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        pytest.param(lambda: Stream("s", str, capacity_bytes=0), "stream 's' capacity must be a positive whole "
                     "number of bytes, at most 9223372036854775807, got 0", id="stream-capacity-zero"),
        pytest.param(lambda: Stream("s", str, capacity_bytes="1MB"), "got '1MB'", id="stream-capacity-text"),
        pytest.param(lambda: Stream("s", str, capacity_bytes=1.5), "got 1.5", id="stream-capacity-float"),
        pytest.param(lambda: Stream("s", str, capacity_bytes=True), "got True", id="stream-capacity-bool"),
        pytest.param(lambda: open_store(5), "database URL must be a str, got int: 5", id="store-url-not-text"),
    ],
)
def test_bad_values_in_definitions_are_refused_by_name(make: Callable[[], object], message: str) -> None:
    """Catches: a capacity given as text failing with a bare TypeError of a comparison, and a URL
    that is not text with an AttributeError from inside the engine."""
    with pytest.raises(ValueError) as caught:
        make()
    assert message in str(caught.value)


def test_a_stream_capacity_of_exactly_the_largest_whole_number_is_taken() -> None:
    """"at most MAX_WHOLE_NUMBER", as the refusal says. Catches: `<` for `<=`."""
    assert Stream("s", str, capacity_bytes=MAX_WHOLE_NUMBER).capacity_bytes == MAX_WHOLE_NUMBER


def _postgres_dsn(url: str) -> object:
    """`url` as a pydantic settings class holds it (PostgresDsn), whose repr shows the password."""
    pydantic = pytest.importorskip("pydantic")
    return pydantic.TypeAdapter(pydantic.PostgresDsn).validate_python(url)


class TextlessUrl:
    """A URL object whose str() raises and whose repr shows its password: no text to hide it in."""

    def __init__(self, url: str) -> None:
        self.url = url

    def __str__(self) -> str:
        raise RuntimeError("no text")

    def __repr__(self) -> str:
        return f"TextlessUrl({self.url!r})"


@pytest.mark.parametrize("kind", ["bytes", "PostgresDsn", "TextlessUrl"])
@pytest.mark.parametrize("where", ["open_store", "WorkerOptions"])
def test_a_database_url_that_is_not_a_str_is_refused_without_its_password(kind: str, where: str) -> None:
    """A URL given as bytes or a pydantic PostgresDsn (a settings field passed as is) is refused
    naming it with *** for its password; one whose text cannot be made, by its type alone. Catches:
    the refusal quoted its repr, password and all, into the traceback a service logs as it fails to start."""
    url = "postgresql://app:Hunter2-pw@db.example:5432/app"
    given = url.encode() if kind == "bytes" else _postgres_dsn(url) if kind == "PostgresDsn" else TextlessUrl(url)
    with pytest.raises(ValueError) as caught:
        if where == "open_store":
            open_store(given)  # type: ignore[arg-type]
        else:
            WorkerOptions(database_url=given)  # type: ignore[arg-type]
    assert "Hunter2-pw" not in str(caught.value)
    assert f"must be a str, got {kind}: " in str(caught.value)
    if kind == "TextlessUrl":
        assert "got TextlessUrl: (a TextlessUrl whose text could not be made)" in str(caught.value)
    else:
        assert "postgresql://app:***@db.example:5432/app" in str(caught.value)


# Values ----------------------------------------------------------------------------------------


def _nested(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("where", ["client.publish", "rpc ctx.set", "start_flow input"])
async def test_value_over_max_value_bytes_is_refused(db_url: str, where: str) -> None:
    """A value over MAX_VALUE_BYTES raises ValueTooLargeError naming the value's place and size,
    and nothing is stored (the Step case is in the handler test above)."""
    async with idle_engine(db_url) as eng:
        c = eng.client
        calls: dict[str, tuple[Callable[[], Awaitable[Any]], str]] = {
            "client.publish": (lambda: c.publish("f", Boxes["k"], HUGE), "'Boxes[k]'"),
            "rpc ctx.set": (lambda: c.rpc("f", "misuse", "too_large"), "'Note'"),
            "start_flow input": (lambda: c.start_flow("Bad", "g", HUGE), "input"),
        }
        call, name = calls[where]
        exc = await refused(eng.store, call, ValueTooLargeError, name, str(MAX_VALUE_BYTES + 2))
        assert isinstance(exc, ValueTooLargeError)
        assert (exc.size, exc.limit) == (MAX_VALUE_BYTES + 2, MAX_VALUE_BYTES)


@pytest.mark.parametrize(
    "where",
    [
        "start_flow input of the start Step",
        "start_flow input that is not JSON",
        "publish str to int channel",
        "publish bool to int channel",
        "publish float to int channel",
        "rpc request",
        "rpc request with a lone surrogate",
        "start_flow input with a lone surrogate",
        "start_flow input nested too deeply",
        "rpc ctx.set",
    ],
)
async def test_value_of_wrong_type_is_refused(db_url: str, where: str) -> None:
    """A value that is not of its declared type (or not JSON) raises InvalidValueError naming where
    it was going; nothing is stored and an RPC's handler does not run."""
    async with idle_engine(db_url) as eng:
        c = eng.client
        calls: dict[str, tuple[Callable[[], Awaitable[Any]], str]] = {
            "start_flow input of the start Step": (lambda: c.start_flow("Bad", "g", 42), "input of Step Start"),
            "start_flow input that is not JSON": (lambda: c.start_flow("Bad", "g", object()), "flow input"),
            "publish str to int channel": (lambda: c.publish("f", Inbox, "seven"), "'Inbox'"),  # type: ignore[arg-type]
            "publish bool to int channel": (lambda: c.publish("f", Inbox, True), "'Inbox'"),
            "publish float to int channel": (lambda: c.publish("f", Inbox, 1.5), "'Inbox'"),  # type: ignore[arg-type]
            "rpc request": (lambda: c.rpc("f", "takes_int", "seven"), "request of RPC takes_int"),
            # Text UTF-8 cannot hold: the same error as any value JSON cannot hold, naming where it went.
            "rpc request with a lone surrogate": (lambda: c.rpc("f", "note", "bad \ud800"), "request of RPC note"),
            "start_flow input with a lone surrogate": (lambda: c.start_flow("Bad", "g", "bad \ud800"), "flow input"),
            # Deeper than Python's recursion limit lets the encoder go: not a RecursionError.
            "start_flow input nested too deeply": (lambda: c.start_flow("Bad", "g", _nested(100_000)), "flow input"),
            "rpc ctx.set": (lambda: c.rpc("f", "misuse", "wrong_type"), "'Count'"),
        }
        call, name = calls[where]
        await refused(eng.store, call, InvalidValueError, name)


# Flows, RPCs, streams --------------------------------------------------------------------------


@pytest.mark.parametrize("flow_type", ["NoSuchFlow", ["Bad"], {"type": "Bad"}], ids=["text", "list", "dict"])
async def test_unknown_flow_type_is_refused(db_url: str, flow_type: Any) -> None:
    """start_flow with a type the Registry lacks raises UnknownFlowTypeError naming it and the
    known types. Catches: a type that cannot be a dict key (a list or dict from a request body)
    raised a bare TypeError ("unhashable type") naming neither."""
    async with engine_for(db_url, REGISTRY, worker=False) as eng:
        await refused(eng.store, lambda: eng.client.start_flow(flow_type, "f", "ok"), UnknownFlowTypeError,
                      repr(flow_type), "'Bad'", "'OtherType'")


@pytest.mark.parametrize("second_type", ["Bad", "OtherType"])
async def test_duplicate_flow_id_leaves_the_first_flow_intact(db_url: str, second_type: str) -> None:
    """Starting a flow ID that exists (of any type) raises FlowAlreadyStartedError naming the ID; the
    first flow's input, attributes, messages, events and Steps are untouched."""
    async with idle_engine(db_url) as eng:
        await eng.client.publish("f", Inbox, 5)
        await refused(eng.store, lambda: eng.client.start_flow(second_type, "f", "ok"), FlowAlreadyStartedError,
                      "'f'")
        assert await eng.client.get_attribute("f", Note) == "kept"
        assert (await eng.client.describe_flow("f")).flow_type == "Bad"


@pytest.mark.parametrize("operation", ["rpc", "publish", "skip_timer", "stop_flow"])
async def test_operations_on_a_closed_flow_are_refused(db_url: str, operation: str) -> None:
    """An RPC, publish, skip_timer or stop on a stopped flow raises FlowNotActiveError naming the flow
    and its status, and changes nothing."""
    async with idle_engine(db_url) as eng:
        c = eng.client
        await c.stop_flow("f", "test")
        calls: dict[str, Callable[[], Awaitable[Any]]] = {
            "rpc": lambda: c.rpc("f", "note", "late"),
            "publish": lambda: c.publish("f", Inbox, 1),
            "skip_timer": lambda: c.skip_timer("f", "Start-1"),
            "stop_flow": lambda: c.stop_flow("f", "again"),
        }
        await refused(eng.store, calls[operation], FlowNotActiveError, "'f'", "stopped")
        assert await c.get_attribute("f", Note) == "kept", "a closed flow's attributes stay readable"


@pytest.mark.parametrize("config", ["bogus", {"active_step_search": False}], ids=["text", "dict"])
async def test_a_config_that_is_not_a_flow_config_is_refused(db_url: str, config: Any) -> None:
    """start_flow's config_override and update_flow_config take only a FlowConfig: anything else
    raises InvalidValueError naming the argument and the value, and nothing is stored. Catches: the
    value stored as its JSON, after which no reader could decode the flow's config (the flow ran no
    other Step, describe_flow raised msgspec's ValidationError), or one that could by chance."""
    async with idle_engine(db_url) as eng:
        c = eng.client
        shown = f"got {type(config).__name__}: {config!r}"
        await refused(eng.store, lambda: c.start_flow("Bad", "g", "ok", config_override=config), InvalidValueError,
                      "config_override must be a FlowConfig", shown)
        await refused(eng.store, lambda: c.update_flow_config("f", config), InvalidValueError,
                      "config must be a FlowConfig", shown)
        assert not await c.exists("g")
        assert (await c.describe_flow("f")).config == FlowConfig()


@pytest.mark.parametrize("name", ["nope", ["note"], {"name": "note"}], ids=["text", "list", "dict"])
async def test_unknown_rpc_is_refused(db_url: str, name: Any) -> None:
    """An RPC name the flow lacks raises RpcNotFoundError naming it and listing the flow's RPCs.
    Catches: a name that cannot be a dict key (a list or dict from a request body) raised a bare
    TypeError ("unhashable type") naming neither."""
    async with idle_engine(db_url) as eng:
        await refused(eng.store, lambda: eng.client.rpc("f", name, None), RpcNotFoundError,
                      repr(name), "'Bad'", "'note'", "'takes_int'")


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


@pytest.mark.parametrize(
    ("wait_seconds", "limit", "named"),
    [
        (-0.5, 10, f"wait_seconds must be between 0 and {MAX_STREAM_WAIT_SECONDS}, got -0.5"),
        (MAX_STREAM_WAIT_SECONDS + 0.5, 10, f"got {MAX_STREAM_WAIT_SECONDS + 0.5}"),
        (math.nan, 10, "got nan"),
        (0.0, 0, f"limit must be a whole number from 1 to {MAX_READ_LIMIT}, got 0"),
        (0.0, -3, "got -3"),
        # Once: an OverflowError from the database driver, a TypeError of a comparison, a 1.
        (0.0, 10**30, f"got {10**30}"),
        (0.0, "10", "got '10'"),
        (0.0, True, "got True"),
        ("1", 10, "wait_seconds must be between 0 and 60.0, got '1'"),
    ],
)
async def test_read_stream_wait_or_limit_out_of_range(db_url: str, wait_seconds: float, limit: int, named: str) -> None:
    """A stream read with a long-poll outside 0..MAX_STREAM_WAIT_SECONDS or a limit below 1 raises
    ValueError naming the value, reading nothing; both bounds themselves are accepted."""
    async with idle_engine(db_url) as eng:
        c = eng.client
        await refused(eng.store, lambda: c.read_stream("f", Events, wait_seconds=wait_seconds, limit=limit),
                      ValueError, named)
        # Events are there, so even the longest poll returns at once.
        read = await c.read_stream("f", Events, wait_seconds=MAX_STREAM_WAIT_SECONDS, limit=1)
        assert [e.value for e in read.events] == ["e1"]


async def test_forged_and_foreign_resume_tokens_are_refused(db_url: str, tmp_path: Path) -> None:
    """E11: a token that was tampered with, belongs to another flow, stream or database, or is
    malformed raises InvalidResumeTokenError before any event is returned; a good token still works."""
    async with idle_engine(db_url) as eng:
        c = eng.client
        await c.start_flow("Bad", "g", "listen")
        await c.rpc("g", "append", "g1")
        own = (await c.read_stream("f", Events)).resume_token
        other_flow = (await c.read_stream("g", Events)).resume_token
        other_stream = (await c.read_stream("f", Other)).resume_token
        body, _, mac = own.partition(".")
        flipped_mac = body + "." + ("A" if mac[0] != "A" else "B") + mac[1:]
        # A body claiming an earlier position (sequence 0) under the real signature.
        rewound = _b64(b'["f","Events",0]') + "." + mac
        # Another database issues tokens with its own secret, even for the same flow and stream.
        async with engine_for(f"sqlite:///{tmp_path / 'other.db'}", REGISTRY, worker=False) as other:
            await other.client.start_flow("Bad", "f", "listen")
            await other.client.rpc("f", "append", "x")
            foreign_db = (await other.client.read_stream("f", Events)).resume_token

        cases: list[tuple[Any, str]] = [
            (flipped_mac, "signature"),
            (own[:-3], "cut, altered, or issued by another database"),  # copied short from a log line
            (12345, "12345"),  # not text at all
            (rewound, "signature"),
            (foreign_db, "signature"),
            (other_flow, "'g'"),
            (other_stream, "'Other'"),
            ("garbage", "'garbage'"),
            ("", "''"),
            ("a.b.c", "'a.b.c'"),
            ("a\ud800.b", "'a\\ud800.b'"),  # text that has no UTF-8 (what JSON's "\ud800" decodes to)
        ]
        for token, named in cases:
            await refused(eng.store, lambda t=token: c.read_stream("f", Events, t), InvalidResumeTokenError,
                          "resume token", named)
        await c.rpc("f", "append", "e2")
        good = await c.read_stream("f", Events, own)
        assert [e.value for e in good.events] == ["e2"]


async def test_a_huge_resume_token_is_refused_with_a_short_message(db_url: str) -> None:
    """A megabyte of text passed as a resume token (a client's Last-Event-ID, say) is refused naming
    its start, not echoed whole into the error, which a server logs and may send back."""
    async with idle_engine(db_url) as eng:
        for huge in ("x" * 1_000_000, "é" * 1_000_000, "a." + "b" * 1_000_000 + ".c"):
            error = await refused(eng.store, lambda t=huge: eng.client.read_stream("f", Events, t),
                                  InvalidResumeTokenError, "resume token", repr(huge)[:50])
            assert len(str(error)) < 500, len(str(error))


# Waits and timers ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "named"),
    [
        pytest.param(lambda: Inbox.for_range(3, 1), "at_most (1) < at_least (3) on channel 'Inbox'", id="range"),
        pytest.param(lambda: Boxes["k"].at_most(0), "'Boxes'", id="at-most-zero"),
        pytest.param(lambda: Inbox.for_n(-1), "-1", id="negative-count"),
        pytest.param(lambda: Inbox.at_least(1.5), "1.5", id="fractional-count"),
        pytest.param(lambda: Inbox.for_n(True), "at_least must be a whole number >= 0, got True", id="bool-count"),
        pytest.param(lambda: Inbox.for_range(0, True), "at_most must be a whole number >= 0, got True",
                     id="bool-at-most"),
        # Made directly, past the channel helpers: a fraction failed the WaitFor's commit on every
        # retry, and a condition no message count can meet held the Step for ever.
        pytest.param(lambda: ChannelCondition("Inbox", "", 1.5, None), "at_least must be a whole number >= 0, got 1.5",
                     id="fraction-channel-condition"),
        pytest.param(lambda: ChannelCondition("Inbox", "", None, 1), "at_least must be a whole number >= 0, got None",
                     id="no-at-least-channel-condition"),
        pytest.param(lambda: ChannelCondition("Inbox", "", 0, 0), "at_most must be >= 1 on channel 'Inbox'",
                     id="take-nothing-channel-condition"),
        pytest.param(lambda: ChannelCondition("Inbox", "", 3, 1), "at_most (1) < at_least (3)",
                     id="unsatisfiable-channel-condition"),
        pytest.param(lambda: ChannelCondition("Boxes", 7, 1, 1), "the key of channel 'Boxes' must be text, got 7",
                     id="key-not-text-channel-condition"),
        pytest.param(lambda: Timer.by_duration(-1), "-1", id="negative-timer"),
        pytest.param(lambda: Timer.by_duration(math.nan), "nan", id="nan-timer"),
        pytest.param(lambda: Timer.by_duration(math.inf), "inf", id="infinite-timer"),
        pytest.param(lambda: Timer.by_duration(MAX_TIMER_SECONDS + 0.5),
                     f"timer duration {MAX_TIMER_SECONDS + 0.5!r} s is beyond the limit of {MAX_TIMER_SECONDS} s",
                     id="timer-past-the-limit"),
        pytest.param(lambda: Timer.by_duration(10**400), f"timer duration {10**400!r} s is beyond the limit",
                     id="timer-past-a-float"),
        pytest.param(lambda: Timer.by_duration("5"), "'5'", id="string-timer"),
        pytest.param(lambda: Timer.by_duration(True), "True", id="bool-timer"),
        # Made directly, past Timer.by_duration's checks: each failed the WaitFor's commit instead.
        pytest.param(lambda: TimerCondition(1.5), "got 1.5; make timers with Timer.by_duration",
                     id="fraction-condition"),
        pytest.param(lambda: TimerCondition(-5), "got -5", id="negative-condition"),
        pytest.param(lambda: TimerCondition(MAX_TIMER_SECONDS + 1), f"got {MAX_TIMER_SECONDS + 1}",
                     id="condition-past-the-limit"),
        pytest.param(lambda: TimerCondition(True), "got True", id="bool-condition"),
        pytest.param(lambda: TimerCondition(math.nan), "got nan", id="nan-condition"),
        pytest.param(Wait.any_of, "any_of", id="empty-any-of"),
        pytest.param(Wait.all_of, "all_of", id="empty-all-of"),
        pytest.param(lambda: Wait.until("soon"), "'soon'", id="not-a-condition"),
        pytest.param(lambda: Wait.any_of(Inbox.for_one(), 3), "3", id="not-a-condition-in-any-of"),
        pytest.param(lambda: Wait.all_of(Timer.by_duration(1), ("Inbox", 2)), "('Inbox', 2) is not a wait condition",
                     id="not-a-condition-in-all-of"),
    ],
)
def test_invalid_wait_is_refused(make: Callable[[], object], named: str) -> None:
    """Waits that could never be valid raise InvalidWaitError naming the bad value."""
    with pytest.raises(InvalidWaitError) as caught:
        make()
    assert named in str(caught.value)


def test_a_timer_of_exactly_the_limit_is_accepted() -> None:
    """The limit is the longest timer accepted, a fraction below it rounding up to it."""
    assert Timer.by_duration(MAX_TIMER_SECONDS).seconds == MAX_TIMER_SECONDS
    assert Timer.by_duration(MAX_TIMER_SECONDS - 0.5).seconds == MAX_TIMER_SECONDS


async def test_skip_timer_on_a_step_that_is_not_waiting(db_url: str) -> None:
    """skip_timer on a ready Step, an unknown Step execution, or a Step waiting on no timer raises
    StepNotWaitingError naming the Step execution, and changes nothing."""
    async with engine_for(db_url, REGISTRY, worker=False) as eng:
        c = eng.client
        await c.start_flow("Bad", "f", "listen")  # Start-1 is ready: no worker runs it yet
        await refused(eng.store, lambda: c.skip_timer("f", "Start-1"), StepNotWaitingError, "'Start-1'", "'f'")
        await refused(eng.store, lambda: c.skip_timer("f", "Nope-9"), StepNotWaitingError, "'Nope-9'")

        await eng.start_worker()

        async def listening() -> bool:
            info = await c.describe_flow("f")
            return [(s.step_execution_id, s.state) for s in info.active_steps] == [("Listen-1", "waiting")]

        await wait_until("Listen-1 waiting", listening)
        assert eng.worker is not None
        await eng.worker.stop()  # nothing else writes while the tables are compared
        eng.worker = None
        await refused(eng.store, lambda: c.skip_timer("f", "Listen-1"), StepNotWaitingError, "'Listen-1'")


# Definitions and options -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"max_attempts": 0}, "max_attempts"),
        ({"max_attempts": -3}, "-3"),
        ({"max_attempts": 2.5}, "2.5"),
        ({"max_attempts": True}, "True"),
        ({"max_attempts": "3"}, "'3'"),
        ({"initial_interval_seconds": -1.0}, "-1.0"),
        ({"initial_interval_seconds": math.nan}, "nan"),
        ({"initial_interval_seconds": "1"}, "'1'"),
        ({"backoff_coefficient": 0.5}, "0.5"),
        ({"backoff_coefficient": math.inf}, "inf"),
        ({"initial_interval_seconds": 10.0, "max_interval_seconds": 5.0}, "5.0"),
        ({"max_interval_seconds": math.inf}, "inf"),
        ({"max_interval_seconds": MAX_TIMER_SECONDS + 1},
         f"max_interval_seconds must be at most {MAX_TIMER_SECONDS} s"),
        ({"initial_interval_seconds": math.inf, "max_interval_seconds": math.inf},
         "initial_interval_seconds must be a finite number >= 0, got inf"),
        ({"backoff_coefficient": True}, "backoff_coefficient must be a number, got True"),
        ({"total_duration_seconds": 0}, "total_duration_seconds"),
        ({"total_duration_seconds": -5.0}, "-5.0"),
        ({"total_duration_seconds": math.inf}, "inf"),
        # Whole numbers past a float's range: the stored policy, read back as floats, could not be
        # decoded (and math.isfinite raised OverflowError on them, not FlowDefinitionError).
        ({"total_duration_seconds": 10**400}, "total_duration_seconds must be > 0 and finite"),
        ({"backoff_coefficient": 10**400}, "backoff_coefficient must be a finite number >= 1"),
        ({"initial_interval_seconds": 10**400, "max_interval_seconds": 10**401},
         "initial_interval_seconds must be a finite number >= 0"),
    ],
)
def test_invalid_retry_policy(kwargs: dict[str, Any], named: str) -> None:
    """RetryPolicy refuses values it could not honour with FlowDefinitionError naming them."""
    with pytest.raises(FlowDefinitionError) as caught:
        RetryPolicy(**kwargs)
    assert named in str(caught.value)
    for field_name in kwargs:
        assert field_name in str(caught.value)


def test_retry_policy_lists_every_problem_at_once() -> None:
    with pytest.raises(FlowDefinitionError) as caught:
        RetryPolicy(max_attempts=0, backoff_coefficient=0.5, total_duration_seconds=-1)
    for part in ("max_attempts", "backoff_coefficient", "total_duration_seconds"):
        assert part in str(caught.value)


def test_a_retry_policy_at_its_limits_is_accepted() -> None:
    """The longest retry interval accepted is the timer limit itself."""
    assert RetryPolicy(max_interval_seconds=MAX_TIMER_SECONDS).max_interval_seconds == MAX_TIMER_SECONDS
    # "from 1 to MAX_WHOLE_NUMBER" and ">= 0", as the refusals say: both ends are taken.
    edges = RetryPolicy(max_attempts=MAX_WHOLE_NUMBER, initial_interval_seconds=0)
    assert (edges.max_attempts, edges.interval_after(1)) == (MAX_WHOLE_NUMBER, 0)


@pytest.mark.parametrize(("now_ms", "retry"), [(9_000, True), (9_001, False)])
def test_a_retry_due_exactly_at_the_total_duration_is_made(now_ms: int, retry: bool) -> None:
    """E4 refuses a retry that would start after total_duration from the first attempt's start: one
    that starts exactly then is made, one a millisecond later is not."""
    policy = RetryPolicy(max_attempts=5, initial_interval_seconds=1.0, total_duration_seconds=10.0)
    decision = decide_retry(policy, attempt=1, first_started_ms=0, now_ms=now_ms, no_retry=False)
    assert (decision.retry, decision.run_at_ms) == ((True, 10_000) if retry else (False, 0))


def test_retry_forever_policy_keeps_a_finite_interval() -> None:
    """A valid 'retry for a long time' policy (many attempts, capped interval) computes a finite
    retry time at any attempt number; an overflow here would leave a failing Step stuck running."""
    for policy in (
        RetryPolicy(max_attempts=10**9, initial_interval_seconds=1.0, backoff_coefficient=2.0, max_interval_seconds=60),
        RetryPolicy(max_attempts=10**9, initial_interval_seconds=1, backoff_coefficient=2, max_interval_seconds=60),
    ):
        for attempt in (10, 1_025, 1_100, 10**8):
            decision = decide_retry(policy, attempt=attempt, first_started_ms=0, now_ms=1_000, no_retry=False)
            assert decision.retry
            assert decision.run_at_ms == 1_000 + 60_000


@pytest.mark.parametrize("field_name", ["execute_timeout_seconds", "wait_for_timeout_seconds",
                                        "heartbeat_timeout_seconds"])
@pytest.mark.parametrize("value", [0, -1.0, math.nan, math.inf, "10", True, MAX_TIMER_SECONDS + 0.001])
def test_invalid_step_option_timeouts(field_name: str, value: Any) -> None:
    """Step timeouts must be positive finite seconds; FlowDefinitionError names the option and value."""
    with pytest.raises(FlowDefinitionError) as caught:
        StepOptions(**{field_name: value})
    assert field_name in str(caught.value)
    assert repr(value) in str(caught.value)
    assert f"at most {MAX_TIMER_SECONDS}" in str(caught.value)


@pytest.mark.parametrize("make", [StepOptions, MovementOptions])
def test_a_step_option_timeout_of_exactly_the_cap_is_taken(make: Callable[..., object]) -> None:
    """MAX_TIMER_SECONDS itself is "at most" the cap, as the refusal says. Catches: `<` for `<=`."""
    make(execute_timeout_seconds=MAX_TIMER_SECONDS, wait_for_timeout_seconds=MAX_TIMER_SECONDS,
         heartbeat_timeout_seconds=float(MAX_TIMER_SECONDS))


DURABILITY_CHOICES = "StepDurability.SYNC or StepDurability.ASYNC"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param({"default_step_durability": "async"},
                     f"FlowConfig default_step_durability must be {DURABILITY_CHOICES}, got 'async'", id="text"),
        pytest.param({"default_step_durability": None},
                     f"FlowConfig default_step_durability must be {DURABILITY_CHOICES}, got None", id="none"),
        pytest.param({"default_step_durability": 1},
                     f"FlowConfig default_step_durability must be {DURABILITY_CHOICES}, got 1", id="int"),
        pytest.param({"active_step_search": 1}, "FlowConfig active_step_search must be a bool, got 1", id="search-int"),
        pytest.param({"active_step_search": "false"}, "FlowConfig active_step_search must be a bool, got 'false'",
                     id="search-text"),
        # Catches: Python's ValueError (an int of over 4,300 digits has no repr) instead of this error.
        pytest.param({"active_step_search": 10**5000}, "FlowConfig active_step_search must be a bool, got (a int "
                     "whose repr could not be made: ValueError)", id="search-int-without-repr"),
        pytest.param({"default_step_durability": 10**5000}, f"FlowConfig default_step_durability must be "
                     f"{DURABILITY_CHOICES}, got (a int whose repr could not be made: ValueError)",
                     id="durability-int-without-repr"),
    ],
)
def test_a_flow_config_with_a_bad_field_is_refused_when_built(kwargs: dict[str, Any], message: str) -> None:
    """A FlowConfig refuses a field of the wrong kind with InvalidValueError naming it and the value.
    Catches: the config stored as given, after which no reader could decode it: the flow (an agent
    session started with step_durability="async") never ran another Step."""
    with pytest.raises(InvalidValueError) as caught:
        FlowConfig(**kwargs)
    assert str(caught.value) == message


@pytest.mark.parametrize("make", [StepOptions, MovementOptions])
@pytest.mark.parametrize("value", ["async", 1, True])
def test_invalid_step_durability(make: Callable[..., object], value: Any) -> None:
    """Step and movement options refuse a durability that is not a StepDurability with
    FlowDefinitionError naming it. Catches: the options stored with each task they resolve to, where
    the next process to read the task (a restarted worker) could not decode it and the flow stalled."""
    with pytest.raises(FlowDefinitionError) as caught:
        make(durability=value)
    assert str(caught.value) == (f"durability must be StepDurability.SYNC, StepDurability.ASYNC or None (the flow "
                                 f"config's default), got {value!r}")


@pytest.mark.parametrize("member", list(StepDurability))
def test_a_durability_given_as_its_text_is_taken_as_the_member(member: StepDurability) -> None:
    """"SYNC" and "ASYNC" named their durability before it was checked, so they still do: each
    option holds the member itself, as a decoded one would."""
    assert FlowConfig(default_step_durability=member.value).default_step_durability is member  # type: ignore[arg-type]
    assert StepOptions(durability=member.value).durability is member  # type: ignore[arg-type]
    assert MovementOptions(durability=member.value).durability is member  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"lease_ttl_seconds": 10.0, "lease_renew_seconds": 10.0}, "lease_renew_seconds (10.0)"),
        ({"lease_ttl_seconds": 5.0, "lease_renew_seconds": 8.0}, "lease_ttl_seconds (5.0)"),
        ({"lease_renew_seconds": 0.0}, "lease_renew_seconds must be a number of seconds > 0 and at most 86400, "
                                       "got 0.0"),
        ({"lease_ttl_seconds": math.nan}, "nan"),
        # Accepted once, each of these failed only as a worker started (an int too large for the
        # database, an infinity in a lease expiry) or never housekept at all (timers never fired).
        ({"lease_ttl_seconds": math.inf}, "lease_ttl_seconds must be a number of seconds > 0 and at most 86400, "
                                          "got inf"),
        ({"lease_ttl_seconds": 1e300, "lease_renew_seconds": 1e299}, "got 1e+300; lease_renew_seconds must"),
        ({"housekeeping_seconds": math.inf}, "housekeeping_seconds must be a number of seconds > 0"),
        ({"poll_seconds": "1"}, "poll_seconds must be a number of seconds > 0 and at most 86400, got '1'"),
        ({"lease_ttl_seconds": True, "lease_renew_seconds": 0.5}, "lease_ttl_seconds must be a number of seconds > 0 "
                                                                 "and at most 86400, got True"),
        ({"database_url": 5}, "database_url must be a str, got int: 5"),
        ({"max_concurrent_tasks": 0}, "max_concurrent_tasks"),
        ({"max_concurrent_tasks": 1.5}, "1.5"),
        ({"max_concurrent_tasks": True}, "True"),
        ({"poll_seconds": 0}, "poll_seconds"),
        ({"housekeeping_seconds": -1}, "housekeeping_seconds"),
        ({"shutdown_grace_seconds": 0}, "shutdown_grace_seconds"),
    ],
)
def test_invalid_worker_options(kwargs: dict[str, Any], named: str) -> None:
    """WorkerOptions whose timings or capacity cannot work raise ValueError naming the values."""
    with pytest.raises(ValueError, match="invalid WorkerOptions") as caught:
        WorkerOptions(**kwargs)
    assert named in str(caught.value)


def test_a_worker_refuses_what_is_not_a_registry_or_worker_options() -> None:
    """Catches: AttributeError from deep inside the worker ('list' object has no attribute 'flows')
    for a list of Flows, and options given as a dict accepted until first read."""
    not_a_registry = r"AsyncWorker takes a Registry of Flows, got list: .*Registry\(\[flow, \.\.\.\]\)"
    with pytest.raises(TypeError, match=not_a_registry):
        AsyncWorker([FLOW], WorkerOptions())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"options must be WorkerOptions, got dict: \{'poll_seconds': 1\}"):
        AsyncWorker(REGISTRY, {"poll_seconds": 1})  # type: ignore[arg-type]


@pytest.mark.parametrize("make", [AsyncClient, Client], ids=["AsyncClient", "Client"])
@pytest.mark.parametrize("registry", [None, [FLOW]], ids=["none", "list-of-flows"])
def test_a_client_refuses_what_is_not_a_registry(make: Any, registry: Any, tmp_path: Path) -> None:
    """Catches: a client made with None or a list of Flows for its Registry accepted, every call
    then failing with an AttributeError ('NoneType' object has no attribute 'flow')."""
    owner = make.__name__
    with pytest.raises(TypeError, match=rf"^{owner} takes a Registry of Flows, got {type(registry).__name__}: "
                       r".*; wrap the Flows: Registry\(\[flow, \.\.\.\]\)$"):
        make(registry, f"sqlite:///{tmp_path / 'dex.db'}")


async def test_an_async_client_takes_a_database_url_or_a_store_not_both(tmp_path: Path) -> None:
    """Catches: a client given both accepted, which then used the store and silently ignored the URL,
    maybe of another database."""
    url = f"sqlite:///{tmp_path / 'dex.db'}"
    store = open_store(url)
    try:
        with pytest.raises(ValueError, match=r"^AsyncClient takes exactly one of database_url and store, got both; "):
            AsyncClient(REGISTRY, f"sqlite:///{tmp_path / 'other.db'}", store=store)
        with pytest.raises(ValueError, match="got neither"):
            AsyncClient(REGISTRY)
        async with AsyncClient(REGISTRY, store=store) as client:
            await client.start_flow("Bad", "f", "listen")
        assert (await store.describe_flow("f")).status == "running"  # the client left the caller's store open
    finally:
        await store.close()
    assert not (tmp_path / "other.db").exists()


def test_the_blocking_client_hands_each_argument_on_to_its_check(tmp_path: Path) -> None:
    """The blocking Client's config_override, limits, wait_seconds and stop reason reach the
    AsyncClient's checks, which refuse them naming the value and change nothing. Catches: the
    Client dropping one on the way (its default then used instead, silently)."""
    with Client(REGISTRY, f"sqlite:///{tmp_path / 'dex.db'}") as client:
        client.start_flow("Bad", "f", "listen")
        with pytest.raises(InvalidValueError, match="config_override must be a FlowConfig, got str: 'fast'"):
            client.start_flow("Bad", "g", "listen", config_override="fast")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=f"limit must be a whole number from 1 to {MAX_READ_LIMIT}, got 0"):
            client.search_flows('FlowType = "Bad"', limit=0)
        with pytest.raises(ValueError, match=f"limit must be a whole number from 1 to {MAX_READ_LIMIT}, got 0"):
            client.read_stream("f", Events, limit=0)
        with pytest.raises(ValueError, match=f"wait_seconds must be between 0 and {MAX_STREAM_WAIT_SECONDS}, got -1"):
            client.read_stream("f", Events, wait_seconds=-1)
        with pytest.raises(InvalidValueError, match="stop_flow's reason must be a str, got NoneType"):
            client.stop_flow("f", None)  # type: ignore[arg-type]
        assert client.search_flows('FlowType = "Bad"') == ["f"]  # no "g"
        assert client.describe_flow("f").status == "running"


def test_worker_options_at_their_limits_are_accepted() -> None:
    """The smallest capacity and the tightest renewal that can work are valid, not rejected."""
    options = WorkerOptions(max_concurrent_tasks=1, lease_ttl_seconds=1.0, lease_renew_seconds=0.999,
                            poll_seconds=0.001, housekeeping_seconds=0.001, shutdown_grace_seconds=0.001)
    assert (options.max_concurrent_tasks, options.lease_renew_seconds) == (1, 0.999)
    longest = WorkerOptions(lease_ttl_seconds=MAX_OPTION_SECONDS, lease_renew_seconds=MAX_OPTION_SECONDS - 1,
                            poll_seconds=MAX_OPTION_SECONDS, housekeeping_seconds=MAX_OPTION_SECONDS,
                            shutdown_grace_seconds=MAX_OPTION_SECONDS)
    assert longest.lease_ttl_seconds == MAX_OPTION_SECONDS
    kept = WorkerOptions(closed_flow_retention_seconds=MAX_RETENTION_SECONDS)  # "at most" the cap, as refusals say
    assert kept.closed_flow_retention_seconds == MAX_RETENTION_SECONDS


def test_worker_options_repr_hides_the_database_password() -> None:
    """WorkerOptions printed or logged (a service logs its settings at start) show its URL's
    password as ***, and every other field as the dataclass would. Catches: the password in logs."""
    options = WorkerOptions(database_url="postgresql://app:hunter2@db/app", worker_id="w-1")
    for text in (repr(options), str(options), f"{options}"):
        assert "hunter2" not in text
        assert text.startswith("WorkerOptions(database_url='postgresql://app:***@db/app', max_concurrent_tasks=")
        assert "worker_id='w-1'" in text

def _sync_execute(ctx: Context, _: None) -> StepDecision:
    return StepDecision.dead_end()


def _sync_wait(ctx: Context, _: None) -> Wait:
    return Wait.skip_immediately()


async def _one_argument(ctx: Context) -> StepDecision:
    return StepDecision.dead_end()


async def _three_arguments(ctx: Context, _: None, extra: int) -> Wait:
    return Wait.skip_immediately()


def test_flow_definition_lists_every_problem_at_once() -> None:
    """A Flow with several mistakes raises one FlowDefinitionError that lists each of them."""

    @rpc(locks=[Stray])
    async def locked(ctx: RpcContext, _: None) -> None:
        return None

    @rpc()
    def sync_rpc(ctx: RpcContext, _: None) -> None:
        return None

    @rpc()
    async def no_request(ctx: RpcContext) -> None:
        return None

    @rpc(request_type=[str])  # a value where a type belongs
    async def listed(ctx: RpcContext, _: Any) -> None:
        return None

    with pytest.raises(FlowDefinitionError) as caught:
        Flow(
            "Broken",
            [
                Step("A", done),
                Step("A", done),
                Step("Sync", _sync_execute, wait_for=_sync_wait),  # type: ignore[arg-type]
                Step("Arity", _one_argument, wait_for=_three_arguments),  # type: ignore[arg-type]
                Step("Routed", done, options=StepOptions(failure_route="Nowhere", execute_locks=(Stray,),
                                                          wait_for_locks=(Tags["k"],))),
                Step("Pure", done, pure_execute="yes"),  # type: ignore[arg-type]
                Step("Typed", done, input_type=3),
            ],
            start_step="Missing",
            # What follows an item that is not of its kind is still checked.
            schema=[Note, "Colour", Attribute("Note", int), Inbox, Channel("Odd", 5)],
            rpcs=[_sync_wait, locked, locked, sync_rpc, no_request, listed],  # type: ignore[list-item]
        )
    message = str(caught.value)
    expected = [
        "Step type 'A' is declared twice",
        "start Step 'Missing' is not one of the flow's Steps",
        "schema name 'Note' is declared twice",
        "RPC 'locked' locks 'Stray', which is not a declared attribute",
        "Step 'Sync' execute must be an async function",
        "Step 'Sync' wait_for must be an async function",
        "Step 'Arity' execute _one_argument(ctx: 'Context') -> 'StepDecision' cannot be called with (ctx, input)",
        "Step 'Arity' wait_for _three_arguments(ctx: 'Context', _: 'None', extra: 'int') -> 'Wait' cannot be "
        "called with (ctx, input): missing a required argument: 'extra'",
        "RPC 'sync_rpc' must be an async function",
        "RPC 'no_request' test_flow_definition_lists_every_problem_at_once.<locals>.no_request(ctx: 'RpcContext') "
        "-> 'None' cannot be called with (ctx, input): too many positional arguments",
        "failure route 'Nowhere' is not one of the flow's Steps",
        "Step 'Routed' locks 'Stray'",
        "Step 'Routed' locks 'Tags[k]'",
        "Step 'Pure' pure_execute must be True or False, got 'yes'",
        "schema item 'Colour' is not an Attribute, AttributeMap, Channel, ChannelMap, Stream",
        "RPC 'locked' is declared twice",
        "is not decorated with @rpc",
        # Accepted once: the first value written or read raised msgspec's TypeError in a handler.
        "Channel 'Odd' value type is 5, not a type whose values can be stored as JSON (Type '5' is not supported)",
        "RPC 'listed' request type is [<class 'str'>], not a type whose values can be stored as JSON (unhashable "
        "type: 'list')",
        "Step 'Typed' input type is 3, not a type whose values can be stored as JSON (Type '3' is not supported)",
    ]
    missing = [e for e in expected if e not in message]
    assert not missing, f"{message!r} lacks {missing}"
    assert message.count("RPC 'locked' locks 'Stray'") == 1  # not again for its second declaration
    assert f"has {len(expected)} problem(s)" in message


@pytest.mark.parametrize(
    ("flows", "named"),
    [
        pytest.param([], "at least one Flow", id="empty"),
        pytest.param([FLOW, FLOW], "'Bad' is registered twice", id="duplicate"),
        pytest.param([FLOW, "Bad"], "'Bad' is not a Flow", id="not-a-flow"),
    ],
)
def test_invalid_registry(flows: list[Any], named: str) -> None:
    with pytest.raises(FlowDefinitionError) as caught:
        Registry(flows)
    assert named in str(caught.value)


def test_a_registry_lists_every_problem_and_only_those() -> None:
    """Items after one that is not a Flow are still checked; a Registry with no Flow but other
    problems does not also say it needs one."""
    with pytest.raises(FlowDefinitionError) as caught:
        Registry(["Bad", FLOW, FLOW])  # type: ignore[list-item]
    assert str(caught.value) == "invalid Registry: 'Bad' is not a Flow; flow type 'Bad' is registered twice"
    with pytest.raises(FlowDefinitionError) as caught:
        Registry([3])  # type: ignore[list-item]
    assert str(caught.value) == "invalid Registry: 3 is not a Flow"


def test_locks_on_declared_attributes_and_map_instances_are_accepted() -> None:
    @rpc(locks=[Tags["k"], Note])
    async def locked(ctx: RpcContext, _: None) -> None:
        return None

    flow = Flow("Locks", [Step("S", done, options=StepOptions(execute_locks=(Tags["k"], Note)))],
                start_step="S", schema=[Note, Tags], rpcs=[locked])
    assert flow.attribute_type("Tags") is Tags.value_type
    with pytest.raises(UndeclaredNameError, match="Nowhere"):
        flow.attribute_type("Nowhere")


# Search queries and database URLs ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("query", "named"),
    [
        ('FlowType = Bad', "'FlowType = Bad'"),
        ('Colour = "red"', "'Colour = \"red\"'"),
        ('FlowType = "Bad" OR FlowStatus = "running"', "OR"),
        ('FlowType = "Bad" AND', "''"),
        ('FlowType = "Bad" AND FlowType = "OtherType"', "FlowType appears twice"),
        ('ActiveStepTypes == "Listen"', "'ActiveStepTypes == \"Listen\"'"),
    ],
)
async def test_malformed_search_query(db_url: str, query: str, named: str) -> None:
    """E13: a query that does not parse raises SearchQueryError naming the bad part."""
    async with idle_engine(db_url) as eng:
        await refused(eng.store, lambda: eng.client.search_flows(query), SearchQueryError, named)
        assert await eng.client.search_flows('FlowType = "Bad"') == ["f"]


@pytest.mark.parametrize("limit", [0, -5, 10**30, 2.5, "3"])
async def test_search_limit_out_of_range(db_url: str, limit: Any) -> None:
    """E13: a search limit below 1, above MAX_READ_LIMIT or not a whole number raises ValueError
    naming it (before: 0 found nothing, a negative one meant no limit on SQLite and an error from
    PostgreSQL, 10**30 an OverflowError from the driver)."""
    async with idle_engine(db_url) as eng:
        for query in ('FlowType = "Bad"', 'ActiveStepTypes = "Listen"'):
            await refused(eng.store, lambda q=query: eng.client.search_flows(q, limit=limit), ValueError,
                          f"limit must be a whole number from 1 to {MAX_READ_LIMIT}, got {limit!r}")
        assert await eng.client.search_flows('FlowType = "Bad"', limit=1) == ["f"]
        assert await eng.client.search_flows('FlowType = "Bad"', limit=MAX_READ_LIMIT) == ["f"]


@pytest.mark.parametrize("timeout", [math.nan, -1, "5"])
async def test_wait_for_flow_refuses_a_timeout_that_is_not_a_number_of_seconds(db_url: str, timeout: Any) -> None:
    """Catches: a NaN timeout that never ran out (the wait went on for ever), a negative one that
    timed out at once as if the flow were stuck, and text failing with a TypeError of an addition."""
    async with idle_engine(db_url) as eng:
        with pytest.raises(ValueError, match=re.escape(f"timeout_seconds must be a number of seconds >= 0, got "
                                                       f"{timeout!r}")):
            await eng.client.wait_for_flow("f", timeout)
        with pytest.raises(TimeoutError, match="still running after 0 s"):
            await eng.client.wait_for_flow("f", 0)


async def test_wait_for_flow_names_the_active_steps_and_takes_a_timeout_too_large_for_a_float(db_url: str) -> None:
    """A wait that runs out names the flow and its active Steps; 10**400 s waits as math.inf does;
    a flow with no output has flow_output None. Catches: the TimeoutError naming no Step, 10**400
    added to the clock as it is, raising OverflowError ('int too large to convert to float'), and
    a missing output decoded as if it were JSON."""
    async with idle_engine(db_url) as eng:
        with pytest.raises(TimeoutError, match=re.escape("flow 'f' still running after 0 s; active Steps ['Start-1']")):
            await eng.client.wait_for_flow("f", 0)
        assert await eng.client.flow_output("f") is None  # none yet
        await eng.client.stop_flow("f", "done waiting")
        assert (await eng.client.wait_for_flow("f", 10**400)).status == "stopped"
        assert await eng.client.flow_output("f") is None  # a stopped flow has none


@pytest.mark.parametrize(
    ("url", "named"),
    [
        ("mysql://localhost/dex", "'mysql://localhost/dex'"),
        ("", "''"),
        ("sqlite://", "names no file"),
        # Not SQLite's private in-memory database: a file named ':memory:' in the working directory.
        ("sqlite:///:memory:", "names an in-memory database"),
        ("sqlite:///engine.db?synchronous=SOMETIMES", "'SOMETIMES'"),
        ("sqlite:///engine.db?synchronus=NORMAL", "'synchronus'"),  # a misspelt parameter is not ignored
        ("sqlite:///engine.db?inline=sometimes", "'sometimes'"),
        # A NUL: SQLite raised "embedded null byte" naming no URL, and libpq ends a parameter at it,
        # so the rest named another database.
        ("sqlite:///eng\x00ine.db", "'sqlite:///eng\\x00ine.db' has a NUL character"),
        ("postgresql://postgres@127.0.0.1:1/dex\x00_staging", "has a NUL character"),
    ],
)
async def test_bad_database_url(url: str, named: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """open_store, AsyncClient, AsyncWorker and Client refuse a URL they cannot open with ValueError
    naming it; the blocking Client leaves no thread behind."""
    monkeypatch.chdir(tmp_path)  # a relative sqlite path must not land in the repository
    with pytest.raises(ValueError) as caught:
        open_store(url)
    assert named in str(caught.value)
    with pytest.raises(ValueError, match=r"URL|synchronous|inline"):
        AsyncClient(REGISTRY, url)
    with pytest.raises(ValueError, match=r"URL|synchronous|inline"):
        await AsyncWorker(REGISTRY, WorkerOptions(database_url=url)).run()
    threads = threading.active_count()
    with pytest.raises(ValueError, match=r"URL|synchronous|inline"):
        Client(REGISTRY, url)
    assert threading.active_count() == threads, "Client left its event-loop thread running"
    assert not any(tmp_path.iterdir()), "a refused URL created files"  # noqa: ASYNC240


@pytest.mark.parametrize(("tp", "value"), [(int, "5"), (float, "1.5"), (bool, 1), (str, 5)])
def test_a_value_is_checked_strictly_against_its_declared_type(tp: type, value: object) -> None:
    """No lax conversions: a "5" for an int, a 1 for a bool are refused, naming the value's name and
    the declared type, not stored as what they could be converted to."""
    with pytest.raises(InvalidValueError, match=f"value for 'N' is not a {tp.__name__}"):
        encode_value("N", tp, value)


@pytest.mark.parametrize("value", [10**5000, {"limit": -(10**5000)}, [1, 10**4300]],
                         ids=["int", "in-an-object", "in-a-list"])
def test_an_int_too_long_to_write_as_text_is_refused_naming_the_value(value: object) -> None:
    """Python writes no int of over 4,300 digits as text. Catches: its ValueError escaping as is
    (from an RPC's request, say), naming neither the value nor the call."""
    with pytest.raises(InvalidValueError, match=r"^value for 'N' cannot be encoded as JSON \((int|dict|list)\): "
                       r"Exceeds the limit \(4300 digits\)"):
        encode_value("N", Any, value)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_float_json_cannot_hold_is_refused_where_float_is_declared(value: float) -> None:
    """NaN and the infinities. Catches: msgspec writing them as null, which the commit stored and
    no later load of a float could read, so every Step loading the value failed for good."""
    with pytest.raises(InvalidValueError, match=rf"^value for 'N' is {value!r}, which JSON cannot hold"):
        encode_value("N", float, value)
    assert encode_value("N", Any, {"n": value}) == b'{"n":null}'  # as docs/engine.md says


class _Reading(msgspec.Struct, frozen=True):
    celsius: float | None = None
    history: list[float] = []


async def _reads_celsius(ctx: Context, reading: _Reading) -> StepDecision:
    return StepDecision.graceful_complete(reading.celsius)


READINGS = Flow("Readings", [Step("Read", _reads_celsius, input_type=_Reading)], start_step="Read")


@pytest.mark.parametrize("reading", [_Reading(celsius=math.nan), _Reading(celsius=-math.inf),
                                     _Reading(history=[1.0, math.inf])], ids=["optional-nan", "optional-inf", "item"])
async def test_a_float_json_cannot_hold_inside_a_declared_value_is_refused(db_url: str, reading: _Reading) -> None:
    """NaN or an infinity in a float field of a declared value. Catches: msgspec writing it as
    null, which a `float | None` field read back as None, so the NaN was stored as "no reading"
    without a word (and one in a `float` field was refused as a puzzling "got null")."""
    async with engine_for(db_url, Registry([READINGS])) as eng:
        bad = next(v for v in (reading.celsius, *reading.history) if v is not None and not math.isfinite(v))
        await refused(eng.store, lambda: eng.client.start_flow("Readings", "r", reading),
                      InvalidValueError, "'input of Step Read'", f"holds the float {bad!r}, which JSON cannot hold")
        assert not await eng.client.exists("r")
        await eng.client.start_flow("Readings", "none", _Reading())  # None itself is a value it holds
        assert (await eng.client.wait_for_flow("none", 20)).status == "completed"
        assert await eng.client.flow_output("none") is None
    # Declared Any, it is written as null, as docs/engine.md says.
    assert encode_value("N", Any, _Reading(celsius=math.nan)) == b'{"celsius":null,"history":[]}'


@dataclasses.dataclass
class _Probe:
    reading: float | None


@pytest.mark.parametrize(("tp", "value"), [
    (dict[str, float | None], {"a": 1.0, "b": math.nan}),
    (_Probe, _Probe(reading=math.inf)),
    (tuple[int, float | None], (1, -math.inf)),
    (frozenset[float | None], frozenset([1.0, math.nan])),
    (list[tuple[float | None, ...]], [(1.0,), (2.0, math.nan)]),
], ids=["dict value", "dataclass field", "tuple item", "frozenset item", "tuple in list"])
def test_a_float_json_cannot_hold_is_found_in_every_kind_of_container(tp: Any, value: Any) -> None:
    """Where a float is declared, a NaN or infinity is refused wherever it sits: a dict's values, a
    dataclass's fields, a tuple's or set's items, not only a Struct's fields and a list's items.
    Catches: one of them not looked into, so the float was written as null and read back as None."""
    with pytest.raises(InvalidValueError, match=r"holds the float -?(nan|inf), which JSON cannot hold"):
        encode_value("N", tp, value)


def test_a_value_of_exactly_the_limit_is_accepted_and_one_byte_more_refused() -> None:
    assert encode_value("N", str, "x" * 8, limit=10) == b'"xxxxxxxx"'
    with pytest.raises(ValueTooLargeError) as caught:
        encode_value("N", str, "x" * 9, limit=10)
    assert "11" in str(caught.value) and "10" in str(caught.value)


class _Sized(msgspec.Struct, frozen=True):
    name: str
    size: int


@dataclasses.dataclass
class _SizedRecord:
    name: str
    size: int


@pytest.mark.parametrize("value", [_Sized(name="a", size="big"), _SizedRecord(name="a", size="big")],  # type: ignore[arg-type]
                         ids=["struct", "dataclass"])
def test_a_struct_or_dataclass_built_with_a_wrong_field_type_is_refused(value: object) -> None:
    """Their constructors check no field types, so being an instance of the declared class is not
    enough: the value is checked field by field."""
    with pytest.raises(InvalidValueError, match=f"value for 'N' is not a {type(value).__name__}"):
        encode_value("N", type(value), value)


def test_a_map_key_of_exactly_the_id_length_is_accepted() -> None:
    assert Tags["k" * 255].key == "k" * 255


# Values nested past MAX_VALUE_NESTING ------------------------------------------------------------


async def _depth_of(ctx: Context, value: Any) -> StepDecision:
    depth = 0
    while isinstance(value, list) and value:
        value, depth = value[0], depth + 1
    return StepDecision.graceful_complete(depth)


DEPTH = Flow("Depth", [Step("Measure", _depth_of, input_type=Any)], start_step="Measure")


async def test_a_value_nested_past_the_limit_is_refused_and_one_at_it_is_read_by_a_worker(db_url: str) -> None:
    """A value whose arrays nest MAX_VALUE_NESTING levels is stored and decoded by a worker; one
    level more is refused with InvalidValueError naming the value, its depth and the limit, and
    nothing is stored. Catches: on Python 3.12 and later, a value nested about 9,990 levels deep
    encoded by the client that no worker could decode: its Step failed every attempt."""
    async with engine_for(db_url, Registry([DEPTH])) as eng:
        at_limit = _nested(MAX_VALUE_NESTING - 1)  # [[...[]...]]: its innermost list is one more level
        await eng.client.start_flow("Depth", "ok", at_limit)
        assert (await eng.client.wait_for_flow("ok", 20)).status == "completed"
        assert await eng.client.flow_output("ok") == MAX_VALUE_NESTING - 1
        await refused(eng.store, lambda: eng.client.start_flow("Depth", "deep", _nested(MAX_VALUE_NESTING)),
                      InvalidValueError, "'flow input'", f"{MAX_VALUE_NESTING + 1} levels deep",
                      f"over the limit of {MAX_VALUE_NESTING}")
        assert not await eng.client.exists("deep")


def test_a_value_exactly_at_the_nesting_limit_is_accepted_whatever_else_it_holds() -> None:
    """A value MAX_VALUE_NESTING levels deep is stored even when it has more brackets than levels
    (so it is counted, not waved through by the quick length and bracket checks); one level more
    is refused naming its depth. Catches: the limit itself refused (`<` for `<=`)."""
    deepest = _nested(MAX_VALUE_NESTING - 2)  # MAX_VALUE_NESTING - 1 levels
    at_limit = [deepest, [], {"k": [1]}]
    assert nesting_depth(msgspec.json.encode(at_limit)) == MAX_VALUE_NESTING
    assert encode_value("N", Any, at_limit).count(b"[") > MAX_VALUE_NESTING
    with pytest.raises(InvalidValueError, match=f"nests arrays and objects {MAX_VALUE_NESTING + 1} levels deep"):
        encode_value("N", Any, [at_limit])


def test_a_declared_type_deeper_than_the_limit_has_its_values_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bounded type whose values can still nest past MAX_VALUE_NESTING (here with a limit of 3)
    has its values counted, and one of exactly the limit's depth is not. Catches: a type's own
    level left out of its depth (or a union's counted), or only Any and recursive types counted."""
    monkeypatch.setattr(_codec, "MAX_VALUE_NESTING", 3)
    monkeypatch.setattr(_codec, "_may_nest_deeply", {})
    assert not may_nest_deeply(list[dict[str, list[int]]]) and may_nest_deeply(list[list[list[list[int]]]])
    # A dict is a level (an object); a union is not (`int | None` is a scalar).
    assert may_nest_deeply(dict[str, dict[str, dict[str, dict[str, int]]]])
    assert not may_nest_deeply(list[list[list[int | None]]])
    with pytest.raises(InvalidValueError, match="4 levels deep, over the limit of 3"):
        encode_value("N", list[list[list[list[int]]]], [[[[1]]]])


@pytest.mark.parametrize(("value", "depth"), [
    (1, 0), ("x", 0), ([], 1), ({}, 1), ([[]], 2), ({"a": [1, {"b": "[[[[{{"}]}, 3),
    ("\"[\\\"[", 0), ({"k": "a\\\\"}, 1), ({"k\\\"[": ["\\", "\\\\\"", [["]"]]]}, 4),
])
def test_nesting_depth_counts_brackets_outside_strings(value: Any, depth: int) -> None:
    """Brackets inside strings, escaped quotes and backslashes included, are not nesting."""
    assert nesting_depth(msgspec.json.encode(value)) == depth


def test_only_types_that_can_nest_deeply_have_their_values_counted() -> None:
    """Values of a type whose depth is bounded (a struct of text, a list of dicts of ints) are never
    counted, so the check costs them nothing; Any, a recursive type and an unhashable one are."""

    class Tree(msgspec.Struct):
        children: list[Tree]

    class Record(msgspec.Struct):
        text: str
        rows: list[dict[str, int]]

    assert may_nest_deeply(Any) and may_nest_deeply(dict[str, Any]) and may_nest_deeply(Tree)
    assert may_nest_deeply(msgspec.Raw)  # JSON already encoded: any depth
    assert not may_nest_deeply(Record) and not may_nest_deeply(int) and not may_nest_deeply(list[str])


async def test_a_context_written_after_its_handler_returned_refuses_the_write(db_url: str) -> None:
    """A write through a context kept past its handler's return raises StaleAttemptError naming the
    call, the method and the Step execution, and nothing is stored. Catches: the write accepted
    and then lost without a word (its attempt had committed)."""
    KEPT_CONTEXTS.clear()
    async with engine_for(db_url, REGISTRY) as eng:
        c = eng.client
        await c.start_flow("Bad", "f", "keep_context")

        async def listening() -> bool:
            return [s.step_type for s in (await c.describe_flow("f")).active_steps] == ["Listen"]

        await wait_until("the flow to wait in Listen", listening)
        (kept,) = KEPT_CONTEXTS
        writes: dict[str, Callable[[], None]] = {
            "set": lambda: kept.set(Count, 1),
            "delete": lambda: kept.delete(Note),
            "publish": lambda: kept.publish(Inbox, 1),
            "append": lambda: kept.append(Events, "late"),
        }
        for call, write in writes.items():
            with pytest.raises(StaleAttemptError) as refused:
                write()
            assert str(refused.value).startswith(f"ctx.{call} after execute of Start-1 (attempt 1) returned: ")
        assert await c.get_attribute("f", Count) is None
        assert (await c.read_stream("f", Events)).events == []


async def test_an_rpc_context_written_after_its_handler_returned_refuses_the_write(db_url: str) -> None:
    """As for a Step's context: a write through an RPC's context kept past its return raises
    StaleAttemptError naming the RPC and the flow, and only what the handler wrote is stored.
    Catches: the late write accepted and lost."""
    KEPT_RPC_CONTEXTS.clear()
    async with engine_for(db_url, REGISTRY) as eng:
        c = eng.client
        await c.start_flow("Bad", "f", "listen")
        await c.rpc("f", "keep_rpc_context")
        kept = KEPT_RPC_CONTEXTS[-1]
        with pytest.raises(StaleAttemptError) as refused_write:
            kept.set(Note, "late")
        assert str(refused_write.value).startswith("ctx.set after RPC 'keep_rpc_context' on flow 'f' returned: ")
        with pytest.raises(StaleAttemptError):
            kept.publish(Inbox, 1)
        assert await c.get_attribute("f", Note) == "kept"



KEPT_FOLDED: list[Context] = []  # contexts of handlers the worker ran inside a commit


async def _to_kept(ctx: Context, _: None) -> StepDecision:
    return StepDecision.go_to("Keep", None)


async def _keep_and_listen(ctx: Context, _: None) -> StepDecision:
    KEPT_FOLDED.append(ctx)
    return StepDecision.go_to("Listen", None)


async def _kept_wait(ctx: Context, _: None) -> Wait:
    KEPT_FOLDED.append(ctx)
    return Wait.until(Inbox.for_one())


async def _to_listen(ctx: Context, _: None) -> StepDecision:
    return StepDecision.go_to("Listen", None)


FOLDED_FLOWS = [
    # Start's commit claims Keep and runs its pure Execute inside it.
    Flow("FoldedExecute", [
        Step("Start", _to_kept, input_type=type(None)),
        Step("Keep", _keep_and_listen, input_type=type(None), pure_execute=True),
        Step("Listen", done, input_type=type(None)),
    ], start_step="Start", schema=[Count, Inbox]),
    # Start's commit evaluates Listen's WaitFor before it commits.
    Flow("FoldedWait", [
        Step("Start", _to_listen, input_type=type(None)),
        Step("Listen", done, wait_for=_kept_wait, input_type=type(None)),
    ], start_step="Start", schema=[Count, Inbox]),
]


async def test_contexts_of_handlers_run_inside_a_commit_refuse_late_writes(db_url: str) -> None:
    """A pure Execute run inside the commit that claims it, and a WaitFor evaluated inside the commit
    that starts its Step (both on SQLite), refuse a write after they returned, as a usual attempt's
    context does. Catches: those contexts never closed, the write accepted and lost."""
    for flow in FOLDED_FLOWS:
        KEPT_FOLDED.clear()
        async with engine_for(db_url, Registry([flow])) as eng:
            c = eng.client
            await c.start_flow(flow.flow_type, flow.flow_type)

            async def settled(client: AsyncClient = c, flow_id: str = flow.flow_type) -> bool:
                steps = (await client.describe_flow(flow_id)).active_steps
                return bool(KEPT_FOLDED) and all(s.state == "waiting" for s in steps)

            await wait_until(f"{flow.flow_type}'s handler kept its context", settled)
            for context in KEPT_FOLDED:
                with pytest.raises(StaleAttemptError, match=r"^ctx\.set after "):
                    context.set(Count, 1)
            assert await c.get_attribute(flow.flow_type, Count) is None
