"""Property-based fuzzing of the public API's inputs, with a real engine (a Worker in this process).

The rule under test: every bad input gets a clear error that names the problem, and leaves stored
state intact. Each property draws odd values (wrong types, None, bools, huge and negative ints,
NaN and the infinities, blank, control and NUL characters, lone surrogates, very long text, bytes,
dicts with non-text keys, recursive containers, objects whose repr raises) for one parameter of one
call, and checks that the call either succeeds or raises one of our own errors: a DexError, or a
ValueError or TypeError raised by our own checks. Never an internal one (AttributeError, KeyError,
IndexError, UnicodeEncodeError, OverflowError, RecursionError, a database driver's error), and a
refused call changes no stored row. Runner outcomes with one odd field must fail the turn with a
last_turn_error, or complete it, and the session must then run a normal turn.

The client calls run on both backends (PostgreSQL refuses NUL in text where SQLite stores it); the
runner outcomes on SQLite, as the session code between runner and store is the same on both.
Hypothesis runs derandomized (the same examples each run) and with few examples: the engine is
real, so each example costs a commit or a turn. One engine serves every example of a test.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import traceback
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import msgspec
from agents.tests.scripted_agent import CALL_USAGE, ScriptedRunner, build_flow, item
from agents.tests.test_bad_inputs import (
    InProcess,
    all_messages,
    assert_usable,
    current_user_text,
    flow_with,
    in_process,
    started_session,
    table_rows,
)
from engine.tests.conftest import db_url, pg_database, pg_databases  # noqa: F401 - the fixtures used here
from engine.tests.odd_values import Unshowable
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dex_agents import (
    AgentSessionClient,
    AgentSnapshot,
    AgentToolCallStatus,
    AgentTurnContext,
    AgentTurnOutcome,
    AgentUsage,
    DeferredToolCall,
    DeferredToolExecution,
    FrameworkMessage,
    InterruptKind,
    MessageRole,
    ToolCallsRequested,
    ToolEffect,
    ToolExecutionError,
    ToolExecutionResult,
    ToolInputRequested,
    ToolOutcomeUnknownError,
    ToolPolicy,
    ToolTaskPoll,
    ToolTaskPollOutcome,
    ToolTaskStarted,
    TurnCompleted,
    TurnContinued,
)
from dex_engine import MAX_VALUE_BYTES, DexError

# DEX_FUZZ_EXAMPLES=500 (and DEX_FUZZ_RANDOM=1 for new examples each run) searches further.
EXAMPLES = int(os.environ.get("DEX_FUZZ_EXAMPLES", "40"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=os.environ.get("DEX_FUZZ_RANDOM") != "1",
                database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# A refused client call costs a few reads: five times as many examples as a turn.
CLIENT_FUZZ = settings(FUZZ, max_examples=EXAMPLES * 5)
SESSION = "s"
# Where our own checks live: a ValueError or TypeError raised from anywhere else is internal.
OWN_CODE = ("/dex_engine/", "/dex_agents/")


def _recursive_dict() -> dict[str, Any]:
    value: dict[str, Any] = {}
    value["self"] = value
    return value


def _recursive_list() -> list[Any]:
    value: list[Any] = []
    value.append(value)
    return value


ODD_TEXT = st.sampled_from([
    "", " ", "\t\n ", "\x00", "a\x00b", "\ud800", "x\udfff", "\x1b[31m", "\u2028", "\ufeff", "é", "{}", "null",
    "x" * 1_100_000,  # over MAX_VALUE_BYTES once encoded
])
ODD: st.SearchStrategy[Any] = st.one_of(
    st.none(), st.booleans(), st.integers(),
    st.sampled_from([2**63, -(2**63) - 1, 2**64, 10**400, 10**5000]),
    st.floats(), st.sampled_from([math.nan, math.inf, -math.inf]),
    st.text(st.characters(codec=None, exclude_categories=()), max_size=8), ODD_TEXT,
    st.binary(max_size=4), st.lists(st.integers(), max_size=2),
    st.dictionaries(st.integers(), st.text(max_size=2), max_size=2),
    st.builds(object), st.builds(Unshowable), st.builds(_recursive_dict), st.builds(_recursive_list),
    st.sampled_from(list(MessageRole)),
)


def is_clear(exc: BaseException) -> bool:
    """A DexError, or a ValueError or TypeError a `raise` of our own code raised: not one Python
    raised inside our code ('NoneType' object is not subscriptable), nor a subclass a library or
    Python raises (UnicodeEncodeError, msgspec's ValidationError)."""
    if isinstance(exc, DexError):
        return True
    if type(exc) not in (ValueError, TypeError):
        return False
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return False
    last = frames[-1]
    return any(part in last.filename for part in OWN_CODE) and (last.line or "").lstrip().startswith("raise")


def described(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc))


@contextmanager
def engine_loop(tmp_path: Path, flow: Any, url: str | None = None) -> Iterator[tuple[asyncio.Runner, InProcess]]:
    """An engine on `url` (a SQLite file in tmp_path by default) with a Worker in this process,
    driven by one event loop the examples share."""
    with asyncio.Runner() as loop:
        context = in_process(tmp_path, flow, database_url=url)
        engine = loop.run(context.__aenter__())
        try:
            yield loop, engine
        finally:
            loop.run(context.__aexit__(None, None, None))


async def refused_or_served(engine: InProcess, call: Callable[[], Awaitable[object]]) -> BaseException | None:
    """Run `call`; None when it returned. When it raised, the error must be a clear one and no stored
    row may have changed (no Worker runs, so only the call could write)."""
    before = await table_rows(engine.client)
    try:
        await asyncio.wait_for(call(), 30)
    except TimeoutError:
        raise
    except Exception as exc:
        assert is_clear(exc), f"internal error for a bad input:\n{described(exc)}"
        assert await table_rows(engine.client) == before, f"a refused call changed stored rows: {exc!r}"
        return exc
    return None


# AgentSessionClient ------------------------------------------------------------------------------

def _session_calls(sessions: AgentSessionClient, value: Any) -> dict[str, Callable[[], Awaitable[object]]]:
    """Each parameter of each session call, given `value` (the others valid)."""
    return {
        "start_session.session_id": lambda: sessions.start_session(value, "hi"),
        "start_session.initial_message": lambda: sessions.start_session("new", value),
        "start_session.session_settings": lambda: sessions.start_session("new", "hi", session_settings=value),
        "start_session.active_step_search_mode": lambda: sessions.start_session("new", active_step_search_mode=value),
        "start_session.step_durability": lambda: sessions.start_session("new", step_durability=value),
        "send_user_message.session_id": lambda: sessions.send_user_message(value, "hi"),
        "send_user_message.text": lambda: sessions.send_user_message(SESSION, value),
        "send_user_message.plan_mode": lambda: sessions.send_user_message(SESSION, "hi", plan_mode=value),
        "resolve_interrupt.interrupt_id": lambda: sessions.resolve_interrupt(SESSION, value, True),
        "resolve_interrupt.approved": lambda: sessions.resolve_interrupt(SESSION, "c1", value),
        "resolve_interrupt.rejection_message": lambda: sessions.resolve_interrupt(SESSION, "c1", False, value),
        "answer_question.interrupt_id": lambda: sessions.answer_question(SESSION, value, "yes"),
        "answer_question.answer": lambda: sessions.answer_question(SESSION, "c1-input-1", value),
        "steer_user_message.text": lambda: sessions.steer_user_message(SESSION, text=value),
        "steer_user_message.message_id": lambda: sessions.steer_user_message(SESSION, message_id=value),
        "delete_queued_message.message_id": lambda: sessions.delete_queued_message(SESSION, value),
        "cancel_turn.turn_id": lambda: sessions.cancel_turn(SESSION, value),
        "execute_plan.revision": lambda: sessions.execute_plan(SESSION, value),
        "update_session_settings.session_settings": lambda: sessions.update_session_settings(SESSION, value),
        "get_agent_snapshot.session_id": lambda: sessions.get_agent_snapshot(value),
        "list_agent_messages.before_sequence": lambda: sessions.list_agent_messages(SESSION, value),
        "list_agent_messages.limit": lambda: sessions.list_agent_messages(SESSION, None, value),
        "read_agent_events.resume_token": lambda: sessions.read_agent_events(SESSION, value),
        "read_agent_events.wait_seconds": lambda: sessions.read_agent_events(SESSION, wait_seconds=value),
        "read_agent_events.limit": lambda: sessions.read_agent_events(SESSION, limit=value),
    }


def test_session_client_calls_refuse_odd_values_clearly(tmp_path: Path, db_url: str) -> None:  # noqa: F811
    """Every AgentSessionClient parameter, given an odd value, is served or refused with a clear
    error that changes nothing; the session then still runs a normal turn, with the messages it
    stored before unchanged (accepted messages queue while no Worker runs, and run after)."""
    with engine_loop(tmp_path, build_flow(tmp_path), db_url) as (loop, engine):
        sessions = engine.sessions
        before = loop.run(started_session(sessions, SESSION))
        loop.run(engine.stop_worker())  # still: only the call under test writes

        @CLIENT_FUZZ
        @given(call=st.sampled_from(sorted(_session_calls(sessions, None))), value=ODD)
        def one(call: str, value: Any) -> None:
            loop.run(refused_or_served(engine, _session_calls(sessions, value)[call]))

        one()
        loop.run(engine.start_worker())
        loop.run(_settled(sessions))
        loop.run(assert_usable(sessions, SESSION, before))


async def _settled(sessions: AgentSessionClient) -> AgentSnapshot:
    """Wait until the session runs no turn and has no message queued (accepted ones ran)."""
    for _ in range(600):
        snapshot = await sessions.get_agent_snapshot(SESSION)
        state = snapshot.state
        if state is not None and state.active_turn_id is None and not snapshot.queued_messages:
            return snapshot
        await asyncio.sleep(0.05)
    raise AssertionError(f"session never settled: {snapshot!r}")


# The engine's AsyncClient ------------------------------------------------------------------------

SEARCH_WORDS = ["FlowType", "FlowStatus", "ActiveStepTypes", "=", '"', "AND", "and", " ", "running", "completed",
                "ScriptedAgent", "AwaitUserMessage", "\x00", "\ud800", "'", "\\", "\n", "AND\"", "==", "%", "_"]
SEARCH_QUERIES = st.one_of(st.lists(st.sampled_from(SEARCH_WORDS), max_size=12).map("".join),
                           st.text(st.characters(codec=None, exclude_categories=()), max_size=12))


def _engine_calls(engine: InProcess, value: Any) -> dict[str, Callable[[], Awaitable[object]]]:
    client = engine.client
    events = engine.flow.agent_events
    return {
        "start_flow.flow_type": lambda: client.start_flow(value, "new"),
        "start_flow.flow_id": lambda: client.start_flow("ScriptedAgent", value),
        "start_flow.input": lambda: client.start_flow("ScriptedAgent", "new", value),
        "start_flow.config_override": lambda: client.start_flow("ScriptedAgent", "new", config_override=value),
        "rpc.flow_id": lambda: client.rpc(value, "get_agent_snapshot"),
        "rpc.name": lambda: client.rpc(SESSION, value),
        "rpc.request": lambda: client.rpc(SESSION, "list_agent_messages", value),
        "rpc.send_request": lambda: client.rpc(SESSION, "send_user_message", value),
        "search_flows.query": lambda: client.search_flows(value),
        "search_flows.limit": lambda: client.search_flows("", value),
        "get_flow_history.flow_id": lambda: client.get_flow_history(value),
        "read_stream.stream": lambda: client.read_stream(SESSION, value),
        "read_stream.resume_token": lambda: client.read_stream(SESSION, events, value),
        "read_stream.wait_seconds": lambda: client.read_stream(SESSION, events, wait_seconds=value),
        "read_stream.limit": lambda: client.read_stream(SESSION, events, limit=value),
        "get_attribute.ref": lambda: client.get_attribute(SESSION, value),
        "publish.channel": lambda: client.publish(SESSION, value, "hi"),
        "delete_flow.flow_id": lambda: client.delete_flow(value),
        "skip_timer.flow_id": lambda: client.skip_timer(value, "AwaitUserMessage-1"),
        "skip_timer.step_execution_id": lambda: client.skip_timer(SESSION, value),
        "stop_flow.reason": lambda: client.stop_flow("no-such-flow", value),
        "describe_flow.flow_id": lambda: client.describe_flow(value),
        "exists.flow_id": lambda: client.exists(value),
        "flow_output.flow_id": lambda: client.flow_output(value),
        "update_flow_config.config": lambda: client.update_flow_config(SESSION, value),
    }


def _field_names(request_type: Any) -> list[str]:
    """The JSON names of a request struct's fields; [] for a request that is not a struct."""
    if not (isinstance(request_type, type) and issubclass(request_type, msgspec.Struct)):
        return []
    return [field.encode_name for field in msgspec.structs.fields(request_type)]


def test_engine_client_calls_refuse_odd_values_clearly(tmp_path: Path, db_url: str) -> None:  # noqa: F811
    """Every AsyncClient parameter, given an odd value, search_flows given grammar-like text, and
    each session RPC given a dict of its request's fields with odd values, is served or refused with
    a clear error that changes nothing; the session then still runs."""
    with engine_loop(tmp_path, build_flow(tmp_path), db_url) as (loop, engine):
        sessions = engine.sessions
        before = loop.run(started_session(sessions, SESSION))
        loop.run(engine.stop_worker())

        @CLIENT_FUZZ
        @given(call=st.sampled_from(sorted(_engine_calls(engine, None))), value=ODD)
        def one(call: str, value: Any) -> None:
            loop.run(refused_or_served(engine, _engine_calls(engine, value)[call]))

        @CLIENT_FUZZ
        @given(query=SEARCH_QUERIES)
        def search(query: str) -> None:
            loop.run(refused_or_served(engine, lambda: engine.client.search_flows(query)))

        rpcs = engine.client.registry.flow(engine.flow.flow_type).rpcs

        @CLIENT_FUZZ
        @given(name=st.sampled_from(sorted(rpcs)), data=st.data())
        def request(name: str, data: st.DataObject) -> None:
            # A request as a web route forwards a browser's body: a dict of the request's fields, each
            # valid or odd (a number too large for a 64-bit column, NaN where an int goes...).
            fields = _field_names(rpcs[name].request_type)
            given = data.draw(st.lists(st.sampled_from(fields), unique=True)) if fields else []
            body = {field: data.draw(ODD, label=field) for field in given} if fields else data.draw(ODD)
            loop.run(refused_or_served(engine, lambda: engine.client.rpc(SESSION, name, body)))

        one()
        search()
        request()
        loop.run(engine.start_worker())
        loop.run(_settled(sessions))
        loop.run(assert_usable(sessions, SESSION, before))


# Runner outcomes ---------------------------------------------------------------------------------

GOOD_MESSAGE = FrameworkMessage(MessageRole.ASSISTANT, '{"role": "assistant"}', text="hi")
GOOD_CALL = DeferredToolCall("c1", "read_x", "{}", ToolPolicy(ToolEffect.READ))
MESSAGE_FIELDS = ["role", "framework_item", "text", "tool_call_id", "tool_name", "tool_arguments", "tool_output"]
CALL_FIELDS = ["tool_call_id", "tool_name", "arguments", "policy", "tool_source_reference"]
USAGE_FIELDS = ["model_calls", "input_tokens", "output_tokens", "cached_input_tokens", "reasoning_tokens"]


@st.composite
def model_outcomes(draw: st.DrawFn) -> object:
    """A run_model_step outcome, valid but for one odd field (or the outcome itself)."""
    kind = draw(st.sampled_from(["message", "call", "turn_error", "run_state", "continued", "usage", "outcome"]))
    value = draw(ODD)
    if kind == "message":
        return TurnCompleted([replace(GOOD_MESSAGE, **{draw(st.sampled_from(MESSAGE_FIELDS)): value})], CALL_USAGE)
    if kind == "call":
        return ToolCallsRequested("state", [replace(GOOD_CALL, **{draw(st.sampled_from(CALL_FIELDS)): value})],
                                  CALL_USAGE)
    if kind == "turn_error":
        return TurnCompleted([GOOD_MESSAGE], CALL_USAGE, turn_error=value)
    if kind in ("run_state", "continued"):
        # Not one over the value limit: that ends the session by design (seed 002, RecordTurnFailure),
        # as every later turn would meet it (test_a_run_state_too_large_to_store_ends_the_session).
        state = draw(ODD.filter(lambda v: not (isinstance(v, str) and len(v) > MAX_VALUE_BYTES // 2)))
        if kind == "run_state":
            return ToolCallsRequested(state, [GOOD_CALL], CALL_USAGE)
        return TurnContinued(state, [], CALL_USAGE)
    if kind == "usage":
        return TurnCompleted([GOOD_MESSAGE], AgentUsage(**{draw(st.sampled_from(USAGE_FIELDS)): value}))
    return value


@st.composite
def tool_outcomes(draw: st.DrawFn) -> object:
    """What execute_deferred_tool_call returns (or raises, when an exception), with one odd value."""
    kind = draw(st.sampled_from(["output", "task_id", "interval", "question", "choices", "free_text",
                                 "continuation", "failed", "unknown", "outcome"]))
    value = draw(ODD)
    made: dict[str, Callable[[], object]] = {
        "output": lambda: ToolExecutionResult(value),
        "task_id": lambda: ToolTaskStarted(value, 1),
        "interval": lambda: ToolTaskStarted("task-1", value),
        "question": lambda: ToolInputRequested(value),
        "choices": lambda: ToolInputRequested("which?", choices=value, allows_free_text=False),
        "free_text": lambda: ToolInputRequested("which?", allows_free_text=value),
        "continuation": lambda: ToolInputRequested("which?", continuation=value),
        "failed": lambda: ToolExecutionError(value),
        "unknown": lambda: ToolOutcomeUnknownError(value),
        "outcome": lambda: value,
    }
    return made[kind]()


class FuzzRunner(ScriptedRunner):
    """The scripted runner, except that the user text "fuzz <n>" gets `model[n]`, or a read tool call
    whose run returns (or raises) `tool[n]`; a continued turn then completes."""

    def __init__(self, state_dir: Path) -> None:
        super().__init__(state_dir)
        self.model: dict[str, object] = {}
        self.tool: dict[str, object] = {}

    async def run_model_step(self, turn: AgentTurnContext) -> AgentTurnOutcome:
        text = current_user_text(turn)
        if not text.startswith("fuzz "):
            return await super().run_model_step(turn)
        if turn.framework_run_state:  # after the tool call, or a TurnContinued
            return TurnCompleted([item(MessageRole.ASSISTANT, text="after")], CALL_USAGE)
        if text in self.tool:
            policy = turn.resolve_tool_policy("read_fuzz", ToolEffect.READ)
            call = DeferredToolCall("c1", "read_fuzz", json.dumps({"fuzz": text}), policy)
            return ToolCallsRequested("state", [call], CALL_USAGE)
        outcome: Any = self.model[text]
        return outcome  # deliberately not always an AgentTurnOutcome

    async def execute_deferred_tool_call(self, call: DeferredToolExecution) -> Any:
        key = json.loads(call.tool_call.arguments).get("fuzz")
        if key is None:
            return await super().execute_deferred_tool_call(call)
        if call.input_answers:  # asked, and answered: done
            return ToolExecutionResult("answered")
        outcome = self.tool[key]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    async def poll_tool_task(self, poll: ToolTaskPoll) -> ToolTaskPollOutcome:
        return ToolExecutionResult("task done")


async def _fuzzed_turn(sessions: AgentSessionClient, text: str) -> AgentSnapshot:
    """Send `text` and wait until its turn ended, answering any question, rejecting any approval it
    raises and cancelling a task polled later than in a second; the turn must end, and the session
    then runs a normal turn."""
    turns = (await sessions.get_agent_snapshot(SESSION)).state
    assert turns is not None
    assert await sessions.send_user_message(SESSION, text)
    for _ in range(600):
        snapshot = await sessions.get_agent_snapshot(SESSION)
        state = snapshot.state
        assert state is not None
        if any(c.status is AgentToolCallStatus.WAITING_FOR_TASK and (c.task_poll_interval_seconds or 0) > 1
               for c in snapshot.tool_calls):
            # A task polled after up to a day (an odd interval is clamped to 1 s .. a day): stop it.
            await sessions.cancel_turn(SESSION)
        for interrupt in snapshot.pending_interrupts:
            if interrupt.kind is InterruptKind.QUESTION:
                answer = interrupt.choices[0] if interrupt.choices else "yes"
                if not await sessions.answer_question(SESSION, interrupt.interrupt_id, answer):
                    raise AssertionError(f"question {interrupt!r} takes no answer, not even {answer!r}")
            else:
                await sessions.resolve_interrupt(SESSION, interrupt.interrupt_id, False, "no")
        if state.turn_count > turns.turn_count and state.active_turn_id is None:
            before = await all_messages(sessions, SESSION)
            await assert_usable(sessions, SESSION, before)
            return snapshot
        await asyncio.sleep(0.05)
    raise AssertionError(f"the turn of {text!r} never ended: {snapshot!r}")


def test_runner_outcomes_with_an_odd_field_fail_the_turn_clearly(tmp_path: Path) -> None:
    """A run_model_step outcome with one odd field completes the turn or fails it with a
    last_turn_error (never a stuck session), and the session then runs a normal turn."""
    runner = FuzzRunner(tmp_path)
    with engine_loop(tmp_path, flow_with(runner)) as (loop, engine):
        sessions = engine.sessions
        loop.run(started_session(sessions, SESSION))

        @FUZZ
        @given(outcome=model_outcomes())
        def one(outcome: object) -> None:
            text = f"fuzz {len(runner.model) + 1}"
            runner.model[text] = outcome
            snapshot = loop.run(_fuzzed_turn(sessions, text))
            assert snapshot.state is not None

        one()


def test_tool_outcomes_with_an_odd_value_end_the_call_clearly(tmp_path: Path) -> None:
    """A tool run that returns or raises something odd (an output that is not text, a task ID or
    interval of the wrong type, a question with odd choices) ends its call and the turn, and the
    session then runs a normal turn."""
    runner = FuzzRunner(tmp_path)
    with engine_loop(tmp_path, flow_with(runner)) as (loop, engine):
        sessions = engine.sessions
        loop.run(started_session(sessions, SESSION))

        @FUZZ
        @given(outcome=tool_outcomes())
        def one(outcome: object) -> None:
            text = f"fuzz {len(runner.tool) + 1}"
            runner.tool[text] = outcome
            loop.run(_fuzzed_turn(sessions, text))

        one()

