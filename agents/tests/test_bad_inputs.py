"""Bad inputs to a session (issue 4): each gets the seed's result and leaves the session usable.

Every case ends the same way: a normal turn ("hello" -> "echo: hello") completes on the same
session, and the messages stored before the bad input are unchanged. Most tests run the Worker in
this process (an AsyncWorker on the SQLite file in tmp_path), which keeps the file fast and lets a
test stop the Worker to hold the session still; test_bad_inputs_with_a_real_worker_child runs the
scripted cases against a Worker child process, as deployments do.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import msgspec
import pytest
from agents.tests.built_context import filling, interrupt, running_turn, runtime_of, step_context, tool_call
from agents.tests.scripted_agent import CALL_USAGE, FLOW_TYPE, INVOCATIONS, ScriptedRunner, build_flow, item
from engine.tests.conftest import db_url, pg_database, pg_databases  # noqa: F401 - the fixtures used here

from dex_agents import (
    AGENT_MESSAGES,
    AGENT_STATE,
    AGENT_TOOL_CALLS,
    AGENT_USAGE,
    ARGUMENTS_NOT_OBJECT,
    AWAIT_QUESTION_ANSWER,
    AWAIT_TOOL_APPROVAL,
    FRAMEWORK_RUN_STATE,
    INTERRUPT_RESOLUTIONS,
    INVALID_START_SESSION_SETTINGS_REASON,
    MAX_SESSION_SETTINGS_BYTES,
    MAX_SESSION_SETTINGS_NESTING,
    NEW_MESSAGES_WITHOUT_BUILDER,
    OUTCOME_UNKNOWN_TEXT,
    PENDING_INTERRUPTS,
    QUEUED_USER_MESSAGES,
    SESSION_SETTINGS,
    SESSION_SETTINGS_SIZE_TOLERANCE_BYTES,
    TOOL_CALL_CANCELLATIONS,
    ActiveStepSearchMode,
    AgentEvent,
    AgentInterrupt,
    AgentInterruptResolution,
    AgentMessage,
    AgentSessionClient,
    AgentSessionFlow,
    AgentSessionOptions,
    AgentSessionStartInput,
    AgentSnapshot,
    AgentState,
    AgentStatus,
    AgentToolCallStatus,
    AgentTurnContext,
    AgentTurnOutcome,
    AgentUsage,
    AgentUserMessage,
    AnswerQuestionRequest,
    BuiltInTool,
    CancelTurnRequest,
    DeferredToolCall,
    DeferredToolExecution,
    DeleteQueuedMessageRequest,
    ExecutePlanRequest,
    FrameworkMessage,
    InterruptKind,
    ListAgentMessagesRequest,
    MessageRole,
    ResolveInterruptRequest,
    SteerUserMessageRequest,
    ToolCallsRequested,
    ToolEffect,
    ToolExecutionResult,
    ToolInputRequested,
    ToolPolicy,
    TurnCompleted,
    TurnContinued,
    TurnSessionSettings,
    UpdateSessionSettingsRequest,
    _builtin_steps,
    _tool_steps,
    message_sequence_key,
)
from dex_agents._constants import (
    ARGUMENTS_TOO_DEEP,
    CUT_NOTE_FIELD_CHARS,
    MAX_REJECTION_MESSAGE_CHARS,
    MAX_STORED_TOOL_ERROR_CHARS,
    REJECTION_MESSAGE_NOT_STORED,
    TIGHTER_NOTE_FIELD_CHARS,
)
from dex_agents._policy import CANCELLED_NOTE_HEADER, TURN_FAILURE_NOTE_HEADER
from dex_agents._runtime import ValueTooLarge, with_unrecorded_usage
from dex_agents._session_settings import session_settings_error, session_settings_size, validate_session_settings
from dex_agents._timefmt import format_time
from dex_agents._tool_steps import ToolSteps
from dex_agents._turn_logic import storable_rejection_message
from dex_agents._turn_steps import TurnSteps
from dex_agents.testing import (
    EXECUTE_COMPLETED_EVENT,
    AgentTestStack,
    InvocationLog,
    executed_steps,
    wait_for_agent_snapshot,
    wait_until,
)
from dex_engine import (
    MAX_ERROR_TEXT_CHARS,
    MAX_TIMER_SECONDS,
    MAX_VALUE_BYTES,
    AsyncClient,
    AsyncWorker,
    AttemptProgress,
    Flow,
    FlowNotActiveError,
    FlowNotFoundError,
    FlowStillRunningError,
    InvalidValueError,
    LoadOptions,
    NoRetryError,
    RecoveryError,
    Registry,
    RpcContext,
    Timer,
    ValueTooLargeError,
    Wait,
    WorkerOptions,
    open_store,
)
from dex_engine._records import ConsumedMessage, WaitOutcome

MISBEHAVE = "misbehave"  # the user text a misbehaving runner answers with its bad outcome
HELLO = "hello"

# Tables that hold a flow's state; a refused call must leave every row as it was.
FLOW_TABLES = ("flows", "tasks", "locks", "attributes", "channel_messages", "stream_events", "history")


# An engine in this process ------------------------------------------------------------------------


@dataclass
class InProcess:
    """A private engine (a SQLite file in tmp_path) whose Worker runs in this process.

    Client and Worker share one Store, so the Worker hears the Client's commits at once.
    """

    flow: AgentSessionFlow
    client: AsyncClient
    log: InvocationLog
    options: WorkerOptions
    worker: AsyncWorker | None = None

    @property
    def sessions(self) -> AgentSessionClient:
        return AgentSessionClient(self.client, self.flow)

    async def start_worker(self) -> None:
        self.worker = AsyncWorker(Registry([self.flow]), self.options, store=self.client.store)
        await self.worker.__aenter__()

    async def stop_worker(self) -> None:
        if self.worker is not None:
            await self.worker.stop()
            self.worker = None


@asynccontextmanager
async def in_process(
    tmp_path: Path, flow: AgentSessionFlow, *, worker: bool = True, database_url: str | None = None
) -> AsyncIterator[InProcess]:
    """The engine on `database_url`, by default a SQLite file in tmp_path."""
    url = database_url or f"sqlite:///{tmp_path / 'dex.db'}"
    options = WorkerOptions(database_url=url, lease_ttl_seconds=2.0, lease_renew_seconds=0.4,
                            housekeeping_seconds=0.1, poll_seconds=0.01, shutdown_grace_seconds=5.0)
    store = open_store(url)
    engine = InProcess(flow, AsyncClient(Registry([flow]), store=store), InvocationLog(tmp_path / INVOCATIONS),
                       options)
    try:
        if worker:
            await engine.start_worker()
        yield engine
    finally:
        await engine.stop_worker()
        await store.close()


async def table_rows(client: AsyncClient) -> dict[str, list[str]]:
    """Every row of the flow-state tables; compare two reads to prove nothing committed."""

    def read(db: Any) -> dict[str, list[str]]:
        return {name: sorted(repr(row) for row in db.all(f'SELECT * FROM "{name}"')) for name in FLOW_TABLES}

    rows: dict[str, list[str]] = await client.store.raw(read)
    return rows


# Runners ------------------------------------------------------------------------------------------


def current_user_text(turn: AgentTurnContext) -> str:
    user = next(m for m in reversed(turn.messages) if m.role is MessageRole.USER and m.turn_id == turn.turn_id)
    return user.text or ""


class MisbehavingRunner(ScriptedRunner):
    """The scripted runner, except that the user text "misbehave <case>" gets `bad_outcomes[case]()`."""

    def __init__(self, state_dir: Path, bad_outcomes: dict[str, Callable[[], object]]) -> None:
        super().__init__(state_dir)
        self.bad_outcomes = bad_outcomes

    async def run_model_step(self, turn: AgentTurnContext) -> AgentTurnOutcome:
        prefix, _, case = current_user_text(turn).partition(" ")
        if prefix != MISBEHAVE:
            return await super().run_model_step(turn)
        assert self.log is not None
        self.log.record("model", flow_id=turn.flow_id, turn_id=turn.turn_id, attempt=turn.attempt, step=0, seen=[])
        outcome: Any = self.bad_outcomes[case]()
        return outcome  # deliberately not an AgentTurnOutcome in most cases

    def build_user_message(self, text: str) -> FrameworkMessage:
        if text == USER_MESSAGE_AS_ASSISTANT:
            return item(MessageRole.ASSISTANT, text=text)
        if text == USER_MESSAGE_THAT_RAISES:
            raise ValueError("cannot build")
        if text == USER_MESSAGE_AS_TEXT:
            built: Any = text  # the message's text, not a FrameworkMessage
            return built
        if text == USER_MESSAGE_WITH_DICT_ITEM:
            return FrameworkMessage(MessageRole.USER, {"content": text}, text=text)  # type: ignore[arg-type]
        return super().build_user_message(text)


# The user texts MisbehavingRunner.build_user_message turns into an assistant message, or raises on.
USER_MESSAGE_AS_ASSISTANT = "build me as an assistant message"
USER_MESSAGE_THAT_RAISES = "build me and raise"
# ... or returns as the text itself, or with a framework_item that is a dict, not JSON text.
USER_MESSAGE_AS_TEXT = "build me as plain text"
USER_MESSAGE_WITH_DICT_ITEM = "build me with a dict item"


MANY_ANSWERS = 250


class ManyMessagesRunner(ScriptedRunner):
    """Answers "many" with MANY_ANSWERS assistant messages in one TurnCompleted."""

    async def run_model_step(self, turn: AgentTurnContext) -> AgentTurnOutcome:
        if current_user_text(turn) != "many":
            return await super().run_model_step(turn)
        return TurnCompleted([item(MessageRole.ASSISTANT, text=f"m{n}") for n in range(1, MANY_ANSWERS + 1)])


class WrongToolResultRunner(ScriptedRunner):
    """Tools named bad_* return plain text instead of a ToolExecutionResult."""

    async def execute_deferred_tool_call(self, call: DeferredToolExecution) -> ToolExecutionResult:
        record = call.tool_call
        if not record.tool_name.startswith("bad_"):
            return await super().execute_deferred_tool_call(call)
        self.log_tool_start(call)
        result: Any = "plain text"
        return result


def unapproved_write_flow(tmp_path: Path, tool_name: str) -> AgentSessionFlow:
    """The scripted flow, where `tool_name` is a non-idempotent write that runs without approval."""
    return build_flow(tmp_path, tool_policies={
        tool_name: ToolPolicy(ToolEffect.NON_IDEMPOTENT_WRITE, requires_approval=False)})


def flow_with(runner: ScriptedRunner, **options: Any) -> AgentSessionFlow:
    return AgentSessionFlow(runner, FLOW_TYPE, AgentSessionOptions(**options))


# Session helpers ----------------------------------------------------------------------------------


async def turn_ended(sessions: AgentSessionClient, session_id: str, turn_count: int) -> AgentSnapshot:
    """Wait until `turn_count` turns ended; return that snapshot."""
    return await wait_for_agent_snapshot(
        sessions, session_id, lambda s: s if s.state is not None and s.state.turn_count >= turn_count else None,
        description=f"turn {turn_count} to end")


async def run_turn(sessions: AgentSessionClient, session_id: str, text: str) -> AgentSnapshot:
    """Send `text` while the session waits, and wait until that turn ended."""
    before = await sessions.get_agent_snapshot(session_id)
    assert before.state is not None and before.state.active_turn_id is None
    assert await sessions.send_user_message(session_id, text)
    return await turn_ended(sessions, session_id, before.state.turn_count + 1)


async def all_messages(sessions: AgentSessionClient, session_id: str) -> list[AgentMessage]:
    """Every stored message, oldest first, paging back with next_before_sequence."""
    messages: list[AgentMessage] = []
    cursor: int | None = None
    while True:
        page = await sessions.list_agent_messages(session_id, before_sequence=cursor, limit=200)
        messages[:0] = page.messages
        if page.next_before_sequence is None:
            return messages
        cursor = page.next_before_sequence


async def started_session(sessions: AgentSessionClient, session_id: str) -> list[AgentMessage]:
    """A session that completed one normal turn; returns its stored messages."""
    await sessions.start_session(session_id, "first")
    snapshot = await turn_ended(sessions, session_id, 1)
    assert snapshot.state is not None and snapshot.state.last_turn_error is None
    messages = await all_messages(sessions, session_id)
    assert [m.text for m in messages] == ["first", "echo: first"]
    return messages


async def assert_usable(sessions: AgentSessionClient, session_id: str, before: Sequence[AgentMessage]) -> None:
    """A normal turn completes after the bad input, and the messages stored before it are unchanged."""
    snapshot = await run_turn(sessions, session_id, HELLO)
    state = snapshot.state
    assert state is not None
    assert state.status is AgentStatus.WAITING_FOR_USER_MESSAGE
    assert state.last_turn_error is None  # a completed turn clears the failure
    assert snapshot.pending_interrupts == [] and snapshot.tool_calls == []
    messages = await all_messages(sessions, session_id)
    assert messages[:len(before)] == list(before)
    assert [m.sequence for m in messages] == list(range(1, len(messages) + 1))
    assert [(m.role, m.text, m.turn_id) for m in messages[-2:]] == [
        (MessageRole.USER, HELLO, f"turn-{state.turn_count}"),
        (MessageRole.ASSISTANT, f"echo: {HELLO}", f"turn-{state.turn_count}"),
    ]


async def steps_run(client: AsyncClient, session_id: str) -> list[str]:
    """Step types whose Execute committed, in commit order (the session's Step shape)."""
    history = await client.get_flow_history(session_id)
    return [e.step_type for e in history if e.event_type == EXECUTE_COMPLETED_EVENT and e.step_type]


async def turn_events(sessions: AgentSessionClient, session_id: str, turn_id: str) -> list[tuple[str, Any]]:
    """The turn's AgentEvents as (type, payload) pairs, oldest first."""
    read = await sessions.read_agent_events(session_id)
    return [(e.value.type, json.loads(e.value.payload)) for e in read.events if e.value.turn_id == turn_id]


async def assert_turn_failed(sessions: AgentSessionClient, session_id: str, turn_id: str, error: str) -> None:
    """The turn wrote turn_failed with `error`, and no turn_completed."""
    events = await turn_events(sessions, session_id, turn_id)
    types = [t for t, _ in events]
    assert types[0] == "turn_started"
    assert "turn_completed" not in types
    assert [p for t, p in events if t == "turn_failed"] == [{"error": error}]


async def failed_turn(sessions: AgentSessionClient, session_id: str, text: str) -> tuple[str, str]:
    """Run a turn that must fail; return its ID and last_turn_error, after checking how it ended."""
    snapshot = await run_turn(sessions, session_id, text)
    state = snapshot.state
    assert state is not None and state.status is AgentStatus.WAITING_FOR_USER_MESSAGE
    assert state.last_turn_error is not None, f"turn {text[:60]!r} did not fail"
    assert snapshot.tool_calls == [] and snapshot.pending_interrupts == []  # the turn is cleared
    turn_id = f"turn-{state.turn_count}"
    await assert_turn_failed(sessions, session_id, turn_id, state.last_turn_error)
    return turn_id, state.last_turn_error


def script(*steps: dict[str, Any]) -> str:
    return json.dumps({"steps": list(steps)})


async def tool_records(sessions: AgentSessionClient, session_id: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
    """Run a turn that asks for `calls` and then answers; the final records by call ID (status,
    output, error, ...) as the answer showed them, after checking that the turn completed."""
    snapshot = await run_turn(sessions, session_id, script({"tools": calls}, {"answer": "{records}"}))
    assert snapshot.state is not None and snapshot.state.last_turn_error is None
    records: dict[str, Any] = json.loads(snapshot.messages[-1].text or "")
    return records


# Blank messages -----------------------------------------------------------------------------------


async def test_blank_messages_and_plan_mode_start_no_turn(tmp_path: Path) -> None:
    """send_user_message is False for blank text and for plan_mode (queuing nothing); a blank
    initial_message starts no turn; a blank message published around the RPC is dropped."""
    async with in_process(tmp_path, build_flow(tmp_path), worker=False) as engine:
        sessions = engine.sessions
        await sessions.start_session("s", "  \n\t ")
        # No Worker yet: whatever these RPCs commit would still be queued.
        rows = await table_rows(engine.client)
        assert await sessions.send_user_message("s", "") is False
        assert await sessions.send_user_message("s", " \n\t ") is False
        assert await sessions.send_user_message("s", "a plan please", plan_mode=True) is False
        assert await table_rows(engine.client) == rows
        assert (await sessions.get_agent_snapshot("s")).queued_message_count == 0

        await engine.start_worker()
        snapshot = await wait_for_agent_snapshot(
            sessions, "s", lambda s: s if s.state is not None else None, description="StartAgentSession")
        assert snapshot.state is not None
        assert snapshot.state.turn_count == 0 and snapshot.state.active_turn_id is None
        assert snapshot.state.status is AgentStatus.WAITING_FOR_USER_MESSAGE
        assert snapshot.messages == []

        # A client that skips the RPC's check: AwaitUserMessage drops the blank message.
        await engine.client.publish("s", QUEUED_USER_MESSAGES, AgentUserMessage("   "))
        await wait_until("AwaitUserMessage to consume the blank message",
                         lambda: _awaited_one_message(engine.client, "s"))
        snapshot = await sessions.get_agent_snapshot("s")
        assert snapshot.state is not None and snapshot.state.turn_count == 0 and snapshot.messages == []
        assert engine.log.count("model") == 0
        await assert_usable(sessions, "s", [])
        assert engine.log.count("model") == 1
        assert await steps_run(engine.client, "s") == [
            "StartAgentSession", "AwaitUserMessage", "AwaitUserMessage", "RunModel",
        ]


async def _awaited_one_message(client: AsyncClient, session_id: str) -> bool:
    return (await steps_run(client, session_id)).count("AwaitUserMessage") == 1


# Tool call IDs ------------------------------------------------------------------------------------


BAD_TOOL_CALL_IDS: list[tuple[str, list[dict[str, Any]], object, str, int]] = [
    # (case, the turn's tool responses, the bad ID, why it is bad, model calls of the turn)
    ("empty", [{"tools": [{"id": "", "name": "read_x"}]}], "", "is empty", 1),
    ("not text", [{"tools": [{"id": 7, "name": "read_x"}]}], 7, "(int) is not text; pass it as a str", 1),
    ("slash", [{"tools": [{"id": "a/b", "name": "read_x"}]}], "a/b", "contains '/'", 1),
    ("repeat in one response", [{"tools": [{"id": "c1", "name": "read_x"}, {"id": "c1", "name": "read_y"}]}],
     "c1", "repeats within this turn", 1),
    ("repeat in a later response", [{"tools": [{"id": "c1", "name": "read_x"}]},
                                    {"tools": [{"id": "c1", "name": "read_y"}]}],
     # The usual cause, a provider numbering each response's calls afresh, named with its fix.
     "c1", "repeats within this turn: an earlier model call of the turn used it; IDs must be unique per turn, so "
           "make IDs a provider numbers per response (call_0, call_1, ...) unique, e.g. by prefixing "
           "len(turn.tool_calls)", 2),
]


async def test_bad_tool_call_id_fails_the_turn(tmp_path: Path) -> None:
    """A response with an empty, '/'-containing or repeated tool call ID fails the turn in RunModel's
    commit (no retry, no RecordTurnFailure): last_turn_error names the ID, turn_failed is written, no
    call of that response runs, and a repeat after a call that ran leaves the turn-failure note. The
    same ID in a later turn runs normally."""
    async with in_process(tmp_path, build_flow(tmp_path)) as engine:
        sessions = engine.sessions
        before = await started_session(sessions, "s")
        model_calls_total = 1
        for case, steps, bad_id, reason, model_calls in BAD_TOOL_CALL_IDS:
            text = script(*steps, {"answer": "never"})
            turn_id, error = await failed_turn(sessions, "s", text)
            assert f"tool call ID {bad_id!r}" in error and reason in error, case
            assert engine.log.count("model", turn_id=turn_id) == model_calls, case
            ran = [e["tool_name"] for e in engine.log.entries("tool_start", turn_id=turn_id)]
            assert ran == (["read_x"] if model_calls == 2 else []), case
            expected = [text]
            if model_calls == 2:  # read_x ran before the bad response: the note keeps it from repeating
                expected.append("[Dex] The previous turn failed after these tool calls ran:\n"
                                "- read_x {} -> succeeded: read_x done\n"
                                "Do not repeat these tool calls unless the user asks again.")
            assert [m.text for m in (await all_messages(sessions, "s"))[len(before):]] == expected, case
            await assert_usable(sessions, "s", before)
            model_calls_total += model_calls + 1
            before = await all_messages(sessions, "s")
        # IDs are unique per turn only: c1, which ran in an earlier turn, runs again in a new one.
        snapshot = await run_turn(sessions, "s", script({"tools": [{"id": "c1", "name": "read_x"}]},
                                                        {"answer": "got {results}"}))
        assert snapshot.state is not None and snapshot.state.last_turn_error is None
        assert snapshot.messages[-1].text == "got c1=read_x done"
        assert engine.log.count("tool_start", turn_id=f"turn-{snapshot.state.turn_count}", tool_call_id="c1") == 1
        shape = await steps_run(engine.client, "s")
        assert "RecordTurnFailure" not in shape
        assert shape.count("RunModel") == model_calls_total + 2


# Arguments that are not a JSON object -------------------------------------------------------------


async def test_arguments_that_are_not_a_json_object_fail_only_that_call(tmp_path: Path) -> None:
    """Each call whose arguments are not strict JSON object text is recorded failed with "arguments
    must be a JSON object" in RunModel's commit, runs no Step and asks no approval (even a write);
    the model sees "The tool call failed: arguments must be a JSON object" and the turn completes."""
    bad = {"list": "[1, 2]", "text": '"text"', "null": "null", "not-json": "{oops", "nan": '{"x": NaN}'}
    calls = [{"id": f"b-{name}", "name": "read_x", "args_text": text} for name, text in bad.items()]
    calls += [{"id": "w-bad", "name": "write_x", "args_text": "[]"}, {"id": "ok", "name": "read_ok", "args": {}}]
    async with in_process(tmp_path, build_flow(tmp_path)) as engine:
        sessions = engine.sessions
        before = await started_session(sessions, "s")
        snapshot = await run_turn(sessions, "s", script({"tools": calls}, {"answer": "got {results}"}))
        assert snapshot.state is not None and snapshot.state.last_turn_error is None
        failed = f"The tool call failed: {ARGUMENTS_NOT_OBJECT}"
        results = [f"b-{name}={failed}" for name in bad] + [f"w-bad={failed}", "ok=read_ok done"]
        assert snapshot.messages[-1].text == "got " + "; ".join(results)
        assert [e["tool_call_id"] for e in engine.log.entries("tool_start")] == ["ok"]
        events = await turn_events(sessions, "s", "turn-2")
        assert not [t for t, _ in events if t == "interrupt_raised"]
        finished = {p["tool_call_id"]: p["status"] for t, p in events if t == "tool_call_finished"}
        assert finished == {**{f"b-{name}": "failed" for name in bad}, "w-bad": "failed", "ok": "succeeded"}
        assert [t for t, _ in events][-1] == "turn_completed"
        assert (await steps_run(engine.client, "s"))[3:] == [
            "RunModel", "CallTool", "ResumeTurn", "RunModel",
        ]
        await assert_usable(sessions, "s", before)


async def test_arguments_nested_too_deeply_fail_only_that_call(tmp_path: Path) -> None:
    """Arguments nested deeper than the JSON decoder can go (a model's output need not be sane) fail
    only that call, at once, with a clear error: no approval, no Step, one model call. Catches: the
    decoder's RecursionError raised in RunModel, which failed the model call, paid for it again on
    each of its three attempts, and failed the turn."""
    depth = 50_000
    deep = '{"a": ' + "[" * depth + "]" * depth + "}"
    calls = [{"id": "d-read", "name": "read_x", "args_text": deep},
             {"id": "d-write", "name": "write_x", "args_text": deep}, {"id": "ok", "name": "read_ok", "args": {}}]
    async with in_process(tmp_path, build_flow(tmp_path)) as engine:
        sessions = engine.sessions
        before = await started_session(sessions, "s")
        records = await tool_records(sessions, "s", calls)
        assert {k: (v["status"], v["error"]) for k, v in records.items()} == {
            "d-read": ("failed", ARGUMENTS_TOO_DEEP), "d-write": ("failed", ARGUMENTS_TOO_DEEP),
            "ok": ("succeeded", None)}
        assert [e["tool_call_id"] for e in engine.log.entries("tool_start")] == ["ok"]
        assert [e["attempt"] for e in engine.log.entries("model", turn_id="turn-2")] == [1, 1]
        await assert_usable(sessions, "s", before)


async def test_arguments_with_a_lone_surrogate_fail_only_that_call(tmp_path: Path) -> None:
    """Arguments text holding a lone surrogate (JSON cannot carry it) fail only that call, at once:
    recorded failed (with the arguments escaped, so the record can be stored: test_turn_logic.py),
    no approval, no Step."""
    bad_text = '{"q": "\ud800"}'
    calls = [{"id": "b-read", "name": "read_x", "args_text": bad_text},
             {"id": "b-write", "name": "write_x", "args_text": bad_text}, {"id": "ok", "name": "read_ok", "args": {}}]
    async with in_process(tmp_path, build_flow(tmp_path)) as engine:
        sessions = engine.sessions
        before = await started_session(sessions, "s")
        records = await tool_records(sessions, "s", calls)
        error = "arguments are not valid UTF-8 text: '\\ud800' at position 7 is a lone surrogate"
        assert {k: (v["status"], v["error"]) for k, v in records.items()} == {
            "b-read": ("failed", error), "b-write": ("failed", error), "ok": ("succeeded", None)}
        assert [e["tool_call_id"] for e in engine.log.entries("tool_start")] == ["ok"]
        await assert_usable(sessions, "s", before)


# resolve_interrupt --------------------------------------------------------------------------------


async def test_resolve_interrupt_unknown_or_already_resolved_is_false(tmp_path: Path) -> None:
    """resolve_interrupt is False for an unknown ID, a call that raised no interrupt, and an interrupt
    already resolved (either way); the one approval runs the write once."""
    async with in_process(tmp_path, build_flow(tmp_path)) as engine:
        sessions = engine.sessions
        before = await started_session(sessions, "s")
        assert await sessions.send_user_message("s", script(
            {"tools": [{"id": "r1", "name": "read_x"}, {"id": "w1", "name": "write_x"}]}, {"answer": "{results}"}))
        await wait_for_agent_snapshot(sessions, "s", lambda s: s.pending_interrupts, description="the approval")
        assert await sessions.resolve_interrupt("s", "nope", approved=True) is False
        assert await sessions.resolve_interrupt("s", "r1", approved=True) is False
        assert await sessions.resolve_interrupt("s", "w1", approved=True) is True
        assert await sessions.resolve_interrupt("s", "w1", approved=True) is False
        assert await sessions.resolve_interrupt("s", "w1", approved=False, rejection_message="no") is False
        snapshot = await turn_ended(sessions, "s", 2)
        assert snapshot.messages[-1].text == "r1=read_x done; w1=write_x done"
        assert engine.log.count("tool_start", tool_call_id="w1") == 1
        assert await sessions.resolve_interrupt("s", "w1", approved=False) is False  # its turn ended
        await assert_usable(sessions, "s", before)


@pytest.mark.parametrize("approved", [True, False])
async def test_resolve_interrupt_publishes_a_rejection_message_only_with_a_rejection(approved: bool) -> None:
    """What resolve_interrupt queues for AwaitToolApproval: the decision, and the rejection message
    only when it rejects (seed 002 "RPCs": "dropping rejection_message on approval")."""
    flow = build_flow(None)
    loaded = {("PendingInterrupts", ""): msgspec.json.encode([interrupt("w1")])}
    ctx = RpcContext(flow, "s", loaded, LoadOptions.all(), {}, "resolve_interrupt")
    request = ResolveInterruptRequest("w1", approved=approved, rejection_message="too risky")
    assert await flow.rpc("resolve_interrupt").handler(ctx, request) is True
    channel = INTERRUPT_RESOLUTIONS["w1"]
    assert [(name, key, msgspec.json.decode(data, type=AgentInterruptResolution))
            for name, key, data in ctx.writes.publishes] == [
        (channel.name, channel.key, AgentInterruptResolution(
            approved=approved, rejection_message=None if approved else "too risky")),
    ]
    assert ctx.get(PENDING_INTERRUPTS) == []


@pytest.mark.parametrize("name", ["resolve_interrupt", "answer_question"])
@pytest.mark.parametrize(("before_deadline", "accepted"), [(timedelta(milliseconds=1), True), (timedelta(0), False)])
async def test_an_interrupt_is_past_its_deadline_from_the_deadline_itself(
    monkeypatch: pytest.MonkeyPatch, name: str, before_deadline: timedelta, accepted: bool,
) -> None:
    """Both RPCs accept an interrupt until its deadline and refuse it (False, nothing written) at the
    deadline itself: the approval Steps record "deadline passed" once now >= deadline, so an answer
    committed at that instant would race their record."""
    deadline = datetime(2026, 1, 1, 0, 5, tzinfo=UTC)
    monkeypatch.setattr("dex_agents._rpcs.now_utc", lambda: deadline - before_deadline)
    flow = build_flow(None)
    kind = InterruptKind.QUESTION if name == "answer_question" else InterruptKind.TOOL_APPROVAL
    waiting = interrupt("i1", kind=kind, deadline=format_time(deadline))
    ctx = RpcContext(flow, "s", {("PendingInterrupts", ""): msgspec.json.encode([waiting])}, LoadOptions.all(),
                     {}, name)
    request = AnswerQuestionRequest("i1", "Ada") if name == "answer_question" else ResolveInterruptRequest("i1", False)
    assert await flow.rpc(name).handler(ctx, request) is accepted
    assert ctx.get(PENDING_INTERRUPTS) == ([] if accepted else [waiting])
    assert len(ctx.writes.publishes) == (1 if accepted else 0)


async def pending_past_its_deadline(engine: InProcess, waiting: AgentInterrupt) -> dict[str, list[str]]:
    """Stop the Worker and wait until session "s"'s only interrupt is past its deadline: without a
    Worker its deadline Timer cannot fire, so it stays pending. Returns the flow's rows then."""
    await engine.stop_worker()
    assert waiting.deadline is not None
    deadline = datetime.fromisoformat(waiting.deadline)
    await wait_until(f"{waiting.interrupt_id}'s deadline to pass", lambda: datetime.now(UTC) > deadline, timeout=10)
    assert (await engine.sessions.get_agent_snapshot("s")).pending_interrupts == [waiting]
    return await table_rows(engine.client)


async def test_resolve_interrupt_past_its_deadline_is_false(tmp_path: Path) -> None:
    """Past its deadline, a still-pending interrupt cannot be resolved (False, nothing committed);
    AwaitToolApproval then records it rejected with "approval deadline passed" and the write never runs."""
    flow = build_flow(tmp_path, interrupt_deadline=timedelta(seconds=3))
    async with in_process(tmp_path, flow) as engine:
        sessions = engine.sessions
        before = await started_session(sessions, "s")
        assert await sessions.send_user_message("s", script({"tools": [{"id": "w1", "name": "write_x"}]},
                                                            {"answer": "{results}"}))
        interrupt = await wait_for_agent_snapshot(
            sessions, "s", lambda s: next(iter(s.pending_interrupts), None), description="the approval")
        rows = await pending_past_its_deadline(engine, interrupt)
        assert await sessions.resolve_interrupt("s", "w1", approved=True) is False
        assert await table_rows(engine.client) == rows

        await engine.start_worker()
        snapshot = await turn_ended(sessions, "s", 2)
        assert snapshot.messages[-1].text == "w1=approval deadline passed"
        assert engine.log.count("tool_start") == 0
        resolved = [p for t, p in await turn_events(sessions, "s", "turn-2") if t == "interrupt_resolved"]
        assert [(p["approved"], p["rejection_message"]) for p in resolved] == [(False, "approval deadline passed")]
        await assert_usable(sessions, "s", before)


async def test_answer_question_blank_or_past_its_deadline_is_false(tmp_path: Path) -> None:
    """answer_question on a free-text question is False for a blank answer, and for any answer once
    the still-pending question is past its deadline (seed 002 "RPCs"); neither commits anything.
    AwaitQuestionAnswer then rejects it with "question deadline passed"."""
    flow = build_flow(tmp_path, interrupt_deadline=timedelta(seconds=3),
                      built_in_tools=frozenset({BuiltInTool.ASK_USER}))
    async with in_process(tmp_path, flow) as engine:
        sessions = engine.sessions
        before = await started_session(sessions, "s")
        assert await sessions.send_user_message("s", script(
            {"tools": [{"id": "q1", "name": "ask_user", "args": {"question": "Name?"}}]}, {"answer": "{results}"}))
        question = await wait_for_agent_snapshot(
            sessions, "s", lambda s: next(iter(s.pending_interrupts), None), description="the question")
        assert question.allows_free_text
        rows = await table_rows(engine.client)
        for blank in ("", "   ", "\n\t"):
            assert await sessions.answer_question("s", "q1", blank) is False
        assert await table_rows(engine.client) == rows
        rows = await pending_past_its_deadline(engine, question)
        assert await sessions.answer_question("s", "q1", "Ada") is False
        assert await table_rows(engine.client) == rows

        await engine.start_worker()
        snapshot = await turn_ended(sessions, "s", 2)
        assert snapshot.messages[-1].text == "q1=question deadline passed"
        await assert_usable(sessions, "s", before)


async def test_the_longest_deadline_read_by_a_worker_whose_clock_is_behind_still_waits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """interrupt_deadline may be the engine's longest Timer (366 days). The Worker that waits on an
    approval or a question may read the time an hour behind the one that wrote the deadline (another
    host, or NTP stepping the clock back): the deadline is then further away than any Timer can be.
    The waits register at once anyway, at the longest Timer, and the answers apply; before, each
    WaitFor was refused on every retry and the session failed."""
    behind = timedelta(hours=1)
    for module in (_tool_steps, _builtin_steps):
        monkeypatch.setattr(module, "now_utc", lambda: datetime.now(UTC) - behind)
    flow = build_flow(tmp_path, interrupt_deadline=timedelta(seconds=MAX_TIMER_SECONDS),
                      built_in_tools=frozenset({BuiltInTool.ASK_USER}))
    async with in_process(tmp_path, flow) as engine:
        sessions = engine.sessions
        before = await started_session(sessions, "s")
        assert await sessions.send_user_message("s", script({"tools": [
            {"id": "w1", "name": "write_x"}, {"id": "q1", "name": "ask_user", "args": {"question": "Name?"}},
        ]}, {"answer": "{results}"}))
        await wait_for_agent_snapshot(sessions, "s", lambda s: len(s.pending_interrupts) == 2 or None,
                                      description="the approval and the question")

        async def both_waiting() -> bool:
            info = await engine.client.describe_flow("s")
            waiting = {a.step_type for a in info.active_steps if a.state == "waiting" and a.timer_due_at_ms}
            return waiting == {AWAIT_TOOL_APPROVAL, AWAIT_QUESTION_ANSWER}

        await wait_until("both waits registered with their Timers", both_waiting)
        assert await sessions.resolve_interrupt("s", "w1", approved=True)
        assert await sessions.answer_question("s", "q1", "Ada")
        snapshot = await turn_ended(sessions, "s", 2)
        assert snapshot.messages[-1].text == 'w1=write_x done; q1={"status":"answered","answer":"Ada"}'
        history = await engine.client.get_flow_history("s")
        assert [e for e in history if e.event_type == "attempt_failed"] == []
        await assert_usable(sessions, "s", before)


@pytest.mark.parametrize("over_limit", [-4096, 4096], ids=["near-the-value-limit", "over-the-value-limit"])
async def test_a_rejection_message_too_large_to_store_is_cut_and_the_session_goes_on(
    tmp_path: Path, over_limit: int
) -> None:
    """A rejection message near the engine's value limit would not fit in the call's record: every
    AwaitToolApproval attempt would fail, and the session with it. It is cut, with a note, and the
    write is rejected as asked; nothing runs. One over the limit is cut by the client before it is
    sent, or the request itself would be too large (the resolve refused, the rejection lost)."""
    async with in_process(tmp_path, build_flow(tmp_path)) as engine:
        sessions = engine.sessions
        before = await started_session(sessions, "s")
        assert await sessions.send_user_message("s", script({"tools": [{"id": "w1", "name": "write_x"}]},
                                                            {"answer": "{results}"}))
        await wait_for_agent_snapshot(sessions, "s", lambda s: s.pending_interrupts, description="the approval")
        reason = "no, " * ((MAX_VALUE_BYTES + over_limit) // 4)
        assert await sessions.resolve_interrupt("s", "w1", approved=False, rejection_message=reason) is True
        snapshot = await turn_ended(sessions, "s", 2)
        kept = MAX_REJECTION_MESSAGE_CHARS
        assert snapshot.messages[-1].text == f"w1={reason[:kept]} [Dex: cut from {len(reason)} characters]"
        assert snapshot.state is not None and snapshot.state.last_turn_error is None
        assert engine.log.count("tool_start") == 0
        resolved = [p for t, p in await turn_events(sessions, "s", "turn-2") if t == "interrupt_resolved"]
        assert [len(p["rejection_message"]) for p in resolved] == [len(snapshot.messages[-1].text) - 3]
        await assert_usable(sessions, "s", before)


async def test_a_rejection_that_does_not_fit_beside_the_calls_arguments_keeps_a_short_note() -> None:
    """A call whose arguments nearly fill the value limit has no room for even a cut rejection
    message: AwaitToolApproval records it rejected with REJECTION_MESSAGE_NOT_STORED instead of
    failing on every retry. (A live session cannot get such arguments past its own message store,
    which keeps each message's text and framework item; so the Step runs on a built context.)"""
    flow = build_flow(None)
    record = tool_call(AgentToolCallStatus.AWAITING_APPROVAL, tool_call_id="w1", tool_name="write_x",
                       effect=ToolEffect.NON_IDEMPOTENT_WRITE, requires_approval=True,
                       arguments=json.dumps({"padding": "x" * (MAX_VALUE_BYTES - 12_000)}))
    reason = "no, " * (MAX_REJECTION_MESSAGE_CHARS // 4)
    resolutions = INTERRUPT_RESOLUTIONS["w1"]
    resolution = AgentInterruptResolution(approved=False, rejection_message=reason)
    taken = ConsumedMessage(1, msgspec.Raw(msgspec.json.encode(resolution)))
    outcome = WaitOutcome(satisfied=(0,), consumed=((taken,),))
    ctx = step_context(flow, AWAIT_TOOL_APPROVAL, {("AgentToolCalls", "w1"): record},
                       (Wait.any_of(resolutions.for_one()), outcome))
    tools = ToolSteps(runtime_of(flow))
    await tools.await_tool_approval(ctx, "w1")
    stored = ctx.get(AGENT_TOOL_CALLS["w1"])
    assert stored is not None and stored.status is AgentToolCallStatus.REJECTED
    assert stored.rejection_message == REJECTION_MESSAGE_NOT_STORED
    assert stored.arguments == record.arguments


@pytest.mark.parametrize("pending", ["taken by resolve_interrupt", "not due yet"])
async def test_a_deadline_timer_that_finds_no_due_interrupt_waits_again(pending: str) -> None:
    """AwaitToolApproval woken by its deadline Timer rejects the call only when the interrupt is
    still pending and due. When resolve_interrupt took it just as the Timer fired (its resolution
    not consumed by this wait), or the Timer fired before the deadline (clock skew), the Step waits
    again, changing nothing, so the next wait applies the answer (seed 003 "Design decisions")."""
    flow = build_flow(None)
    record = tool_call(AgentToolCallStatus.AWAITING_APPROVAL, tool_call_id="w1", tool_name="write_x",
                       effect=ToolEffect.NON_IDEMPOTENT_WRITE, requires_approval=True)
    created = datetime.now(UTC)
    deadline = created + (timedelta(hours=1) if pending == "not due yet" else -timedelta(seconds=1))
    pending_interrupt = interrupt("w1", created_at=format_time(created), deadline=format_time(deadline))
    interrupts = [pending_interrupt] if pending == "not due yet" else []
    wait = Wait.any_of(TOOL_CALL_CANCELLATIONS["w1"].for_one(), INTERRUPT_RESOLUTIONS["w1"].for_one(),
                       Timer.by_duration(1))
    fired = WaitOutcome(satisfied=(2,), consumed=((), (), ()), fired_timers=(2,))
    ctx = step_context(flow, AWAIT_TOOL_APPROVAL, {("AgentToolCalls", "w1"): record,
                                                   ("PendingInterrupts", ""): interrupts}, (wait, fired))
    tools = ToolSteps(runtime_of(flow))
    decision = await tools.await_tool_approval(ctx, "w1")
    assert [(m.step_type, m.input) for m in decision.movements] == [(AWAIT_TOOL_APPROVAL, "w1")]
    assert ctx.writes.attributes == {} and ctx.writes.appends == []


@pytest.mark.parametrize(("before_deadline", "due"), [(timedelta(milliseconds=1), False), (timedelta(0), True)])
async def test_an_approval_deadline_timer_rejects_the_call_from_the_deadline_itself(
    monkeypatch: pytest.MonkeyPatch, before_deadline: timedelta, due: bool,
) -> None:
    """AwaitToolApproval woken by its deadline Timer records "approval deadline passed", removes the
    interrupt and writes its interrupt_resolved once now >= deadline, the instant from which
    resolve_interrupt refuses the interrupt; 1 ms before, it waits again."""
    deadline = datetime(2026, 1, 1, 0, 5, tzinfo=UTC)
    monkeypatch.setattr("dex_agents._tool_steps.now_utc", lambda: deadline - before_deadline)
    flow = build_flow(None)
    record = tool_call(AgentToolCallStatus.AWAITING_APPROVAL, tool_call_id="w1", tool_name="write_x",
                       effect=ToolEffect.NON_IDEMPOTENT_WRITE, requires_approval=True)
    pending_interrupt = interrupt("w1", deadline=format_time(deadline))
    wait = Wait.any_of(TOOL_CALL_CANCELLATIONS["w1"].for_one(), INTERRUPT_RESOLUTIONS["w1"].for_one(),
                       Timer.by_duration(1))
    fired = WaitOutcome(satisfied=(2,), consumed=((), (), ()), fired_timers=(2,))
    ctx = step_context(flow, AWAIT_TOOL_APPROVAL, {("AgentToolCalls", "w1"): record,
                                                   ("PendingInterrupts", ""): [pending_interrupt]}, (wait, fired))
    decision = await ToolSteps(runtime_of(flow)).await_tool_approval(ctx, "w1")
    stored = ctx.get(AGENT_TOOL_CALLS["w1"])
    assert stored is not None
    events = [msgspec.json.decode(data, type=AgentEvent) for _, _, data in ctx.writes.appends]
    resolved = [json.loads(e.payload) for e in events if e.type == "interrupt_resolved"]
    if due:
        assert decision.kind == "dead_end"
        assert (stored.status, stored.rejection_message) == (AgentToolCallStatus.REJECTED, "approval deadline passed")
        assert ctx.get(PENDING_INTERRUPTS) == []
        assert resolved == [{
            "interrupt_id": "w1", "approved": False, "rejection_message": "approval deadline passed",
            "kind": "tool_approval", "answered": False, "cancellation_reason": None}]
    else:
        assert [(m.step_type, m.input) for m in decision.movements] == [(AWAIT_TOOL_APPROVAL, "w1")]
        assert stored == record and ctx.writes.empty()


# Runner failures ----------------------------------------------------------------------------------


async def test_runner_that_raises_on_every_attempt_fails_the_turn(tmp_path: Path) -> None:
    """run_model_step raising on all three attempts -> RecordTurnFailure: last_turn_error carries the
    exception text and turn_failed is written."""
    async with in_process(tmp_path, build_flow(tmp_path)) as engine:
        sessions = engine.sessions
        before = await started_session(sessions, "s")
        text = script({"raise": "the provider is down"})
        turn_id, error = await failed_turn(sessions, "s", text)
        assert "the provider is down" in error
        assert sorted(e["attempt"] for e in engine.log.entries("model", turn_id=turn_id)) == [1, 2, 3]
        # A failed RunModel commits no Execute; its failure route does.
        assert await steps_run(engine.client, "s") == [
            "StartAgentSession", "RunModel", "AwaitUserMessage", "RecordTurnFailure",
        ]
        assert [m.text for m in await all_messages(sessions, "s")][len(before):] == [text]
        await assert_usable(sessions, "s", before)


async def test_errors_of_megabytes_fail_the_turn_and_the_call_with_them_cut(tmp_path: Path) -> None:
    """A runner, or a read tool, that raises with a text of megabytes (a whole response body) on
    every attempt: the call records failed and the turn fails, each with the error's first
    MAX_ERROR_TEXT_CHARS characters, and the session goes on. Catches: the error handed to the
    failure route whole, where RecordTurnFailure (last_turn_error) and RecordToolFailure (the
    call's error) could never store it and retried without end, the session stuck in its turn."""
    size = 3 * MAX_VALUE_BYTES
    async with in_process(tmp_path, build_flow(tmp_path)) as engine:
        sessions = engine.sessions
        before = await started_session(sessions, "s")
        (record,) = (await tool_records(sessions, "s", [
            {"id": "c1", "name": "read_x", "args": {"crash_bytes": size}}])).values()
        assert (record["status"], record["error"]) == ("failed", "c" * MAX_ERROR_TEXT_CHARS)
        _, error = await failed_turn(sessions, "s", script({"raise_bytes": size}))
        assert error == "r" * MAX_ERROR_TEXT_CHARS
        await assert_usable(sessions, "s", before)


class _DeltaRunner(ScriptedRunner):
    """The scripted runner, except that it first writes DELTAS[user text] as text_delta events."""

    DELTAS: dict[str, str] = {"odd delta": "half \ud83d of an emoji", "big delta": "d" * (MAX_VALUE_BYTES + 1)}

    async def run_model_step(self, turn: AgentTurnContext) -> AgentTurnOutcome:
        delta = self.DELTAS.get(current_user_text(turn))
        if delta is not None:
            turn.events.write_text_delta(delta)
            turn.events.write_text_delta("after it")
        return await super().run_model_step(turn)


async def test_a_live_event_that_cannot_be_stored_as_written_does_not_fail_the_model_call(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """Live events are best effort. A text_delta with a lone surrogate (a model's stream that split a
    UTF-16 pair across two deltas) is stored with it as its JSON escape, so that reading it gives the
    text back exactly; one over the value limit is dropped with a warning. Either way the model call
    ran once and its turn completed. Catches: the write raising into the runner, which failed the
    model call, paid for it again on each of its three attempts, and failed the turn."""
    async with in_process(tmp_path, flow_with(_DeltaRunner(tmp_path))) as engine:
        sessions = engine.sessions
        before = await started_session(sessions, "s")
        # The scripted model call writes its own delta, "step 0", after these.
        for text, stored in (("odd delta", ["half \ud83d of an emoji", "after it", "step 0"]),
                             ("big delta", ["after it", "step 0"])):
            snapshot = await run_turn(sessions, "s", text)
            assert snapshot.state is not None and snapshot.state.last_turn_error is None
            turn_id = f"turn-{snapshot.state.turn_count}"
            assert [p["text"] for t, p in await turn_events(sessions, "s", turn_id) if t == "text_delta"] == stored
            assert engine.log.count("model", turn_id=turn_id) == 1
        (dropped,) = [r.getMessage() for r in caplog.records if "dropped a text_delta event" in r.getMessage()]
        assert re.fullmatch(
            r"flow s: dropped a text_delta event of RunModel-3 attempt 1: value for 'AgentEvents' is \d+ bytes "
            rf"encoded, over MAX_VALUE_BYTES \({MAX_VALUE_BYTES}\); store it in pieces or outside the flow",
            dropped), dropped
        await assert_usable(sessions, "s", before)


class _UnwritableEventsRunner(ScriptedRunner):
    """The scripted runner, except that it first writes events no JSON can hold, then a text_delta."""

    async def run_model_step(self, turn: AgentTurnContext) -> AgentTurnOutcome:
        if current_user_text(turn) == "odd events":
            turn.events.write_event("myadapter.metric", {"latency_ms": float("nan")})
            turn.events.write_event("myadapter.tags", {"tags": {"a", "b"}})
            turn.events.write_event("", {})
            turn.events.write_text_delta("after them")
        return await super().run_model_step(turn)


async def test_a_live_event_that_is_not_json_is_dropped_with_a_warning_naming_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """A payload with NaN or a set, or a blank event type: each dropped with a warning that names
    the event and the problem, the model call run once. Catches: the write raising into the
    runner, failing the model call (paid again on each of three attempts) and then the turn with
    "Out of range float values are not JSON compliant", which names no event."""
    async with in_process(tmp_path, flow_with(_UnwritableEventsRunner(tmp_path))) as engine:
        sessions = engine.sessions
        before = await started_session(sessions, "s")
        snapshot = await run_turn(sessions, "s", "odd events")
        assert snapshot.state is not None and snapshot.state.last_turn_error is None
        turn_id = f"turn-{snapshot.state.turn_count}"
        events = await turn_events(sessions, "s", turn_id)
        assert [p["text"] for t, p in events if t == "text_delta"] == ["after them", "step 0"]
        assert not [t for t, _ in events if t.startswith("myadapter.")]
        assert engine.log.count("model", turn_id=turn_id) == 1
        dropped = [r.getMessage() for r in caplog.records if r.getMessage().startswith("flow s: dropped a")]
        expected = [  # the json module's own words; Python 3.13 adds the value (": nan")
            r"flow s: dropped a 'myadapter\.metric' event of RunModel-2 attempt 1: it cannot be written as JSON: "
            r"Out of range float values are not JSON compliant(: nan)?",
            r"flow s: dropped a 'myadapter\.tags' event of RunModel-2 attempt 1: it cannot be written as JSON: "
            r"Object of type set is not JSON serializable",
            r"flow s: dropped a '' event of RunModel-2 attempt 1: it cannot be written as JSON: "
            r"an event type must be a non-empty string, got ''",
        ]
        assert len(dropped) == len(expected), dropped
        for message, pattern in zip(dropped, expected, strict=True):
            assert re.fullmatch(pattern, message), message
        await assert_usable(sessions, "s", before)


class _BigQuestionRunner(ScriptedRunner):
    """The scripted runner, except that read_x first asks a question that fits its record and
    PendingInterrupts, but whose interrupt_raised payload, JSON escaped again inside the event,
    does not fit one stored value."""

    QUESTION = '"' * (MAX_VALUE_BYTES // 3)

    async def execute_deferred_tool_call(self, call: DeferredToolExecution) -> Any:
        if not call.input_answers:
            return ToolInputRequested(question=self.QUESTION, allows_free_text=True)
        return await super().execute_deferred_tool_call(call)


async def test_a_question_whose_event_is_too_large_is_still_asked_and_answered(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """The interrupt_raised event is dropped with a warning (streams are best effort; readers have
    the snapshot); the question is pending, and its answer reaches the tool. Catches: the event's
    append failing AwaitQuestionAnswer on each of its attempts, leaving the call awaiting an
    answer that no one could give, with no pending interrupt."""
    async with in_process(tmp_path, flow_with(_BigQuestionRunner(tmp_path))) as engine:
        sessions = engine.sessions
        before = await started_session(sessions, "s")
        assert await sessions.send_user_message("s", script({"tools": [{"id": "r1", "name": "read_x"}]},
                                                            {"answer": "{results}"}))
        question = await wait_for_agent_snapshot(
            sessions, "s", lambda s: next(iter(s.pending_interrupts), None), description="the question")
        assert question.question == _BigQuestionRunner.QUESTION
        assert await sessions.answer_question("s", question.interrupt_id, "yes")
        snapshot = await turn_ended(sessions, "s", 2)
        assert snapshot.state is not None and snapshot.state.last_turn_error is None
        assert [t for t, _ in await turn_events(sessions, "s", "turn-2") if t.startswith("interrupt_")] == [
            "interrupt_resolved"]
        assert any(r.getMessage().startswith("flow s: dropped a interrupt_raised event of ") for r in caplog.records)
        history = await engine.client.get_flow_history("s")
        assert [h.step_type for h in history if h.event_type == "attempt_failed"] == []
        await assert_usable(sessions, "s", before)


class _FailingAfterAReadRunner:
    """One read call, whose output is `output`, then a model call that fails for good; the turn's
    unfinished-turn message is an assistant message of `size` characters."""

    def __init__(self, size: int, output: str = "found") -> None:
        self.size = size
        self.output = output

    def build_user_message(self, text: str) -> FrameworkMessage:
        return item(MessageRole.USER, text=text)

    async def run_model_step(self, turn: AgentTurnContext) -> AgentTurnOutcome:
        if turn.framework_run_state is None:
            return ToolCallsRequested("asked", [_read_call()], AgentUsage())
        raise NoRetryError("the model broke for good")

    async def execute_deferred_tool_call(self, execution: DeferredToolExecution) -> ToolExecutionResult:
        return ToolExecutionResult(self.output)

    def build_unfinished_turn_messages(self, turn: AgentTurnContext) -> list[FrameworkMessage]:
        return [item(MessageRole.ASSISTANT, text="x" * self.size)]


@pytest.mark.parametrize("fits", [True, False])
async def test_a_failed_turn_keeps_its_note_when_the_unfinished_messages_are_too_large(
    tmp_path: Path, fits: bool
) -> None:
    """RecordTurnFailure stores the runner's unfinished-turn messages, then the turn-failure note
    (seed 002). Unfinished messages over the value limit are left out, and the note is still stored:
    it is what keeps the next turn's model from repeating the calls that ran."""
    size = 10 if fits else MAX_VALUE_BYTES + 1
    async with in_process(tmp_path, AgentSessionFlow(_FailingAfterAReadRunner(size), FLOW_TYPE)) as engine:
        sessions = engine.sessions
        await sessions.start_session("s", HELLO)
        snapshot = await turn_ended(sessions, "s", 1)
        assert snapshot.state is not None and snapshot.state.last_turn_error is not None
        assert "the model broke for good" in snapshot.state.last_turn_error
        stored = await all_messages(sessions, "s")
        roles = [m.role for m in stored]
        assert roles == [MessageRole.USER, *([MessageRole.ASSISTANT] if fits else []), MessageRole.USER]
        note = stored[-1].text or ""
        assert note.startswith("[Dex] The previous turn failed after these tool calls ran:")
        assert "read_x {} -> succeeded: found" in note
        # The second RunModel failed without a retry: it commits no Execute; its failure route does.
        assert await steps_run(engine.client, "s") == [
            "StartAgentSession", "RunModel", "CallTool", "ResumeTurn", "RecordTurnFailure",
        ]


class _NoNoteRunner:
    """A runner whose build_user_message breaks the contract for Dex's notes only; no model call here."""

    def build_user_message(self, text: str) -> FrameworkMessage:
        if text.startswith("[Dex]"):
            raise ValueError("no notes here")
        return item(MessageRole.USER, text=text)

    async def run_model_step(self, turn: AgentTurnContext) -> AgentTurnOutcome:
        raise AssertionError("no model call")

    async def execute_deferred_tool_call(self, execution: DeferredToolExecution) -> ToolExecutionResult:
        raise AssertionError("no tool runs")


def test_a_runner_that_cannot_build_the_note_ends_the_failed_turn_without_it(caplog: pytest.LogCaptureFixture) -> None:
    """A runner defect never blocks the failure route: the unfinished message is stored, the note
    left out with a warning naming the turn (the only warning: the message fit at the first try),
    and the turn fails as it would with the note, its interrupts emptied."""
    flow = AgentSessionFlow(_NoNoteRunner(), "NoNote")
    ctx = step_context(flow, "RecordTurnFailure", {
        ("AgentToolCalls", "c1"): tool_call(AgentToolCallStatus.SUCCEEDED, output="ran"),
        ("PendingInterrupts", ""): [interrupt("c2")],
    })
    with caplog.at_level(logging.WARNING, logger="dex_agents.session"):
        unfinished = [item(MessageRole.ASSISTANT, text="partial")]
        runtime_of(flow).fail_turn(ctx, running_turn(), "turn-1", "boom", unfinished=unfinished)
    state = ctx.get(AGENT_STATE)
    assert state is not None
    assert (state.active_turn_id, state.last_turn_error, state.next_message_sequence) == (None, "boom", 3)
    stored = ctx.get(AGENT_MESSAGES[message_sequence_key(2)])
    assert stored is not None and (stored.role, stored.text) == (MessageRole.ASSISTANT, "partial")
    assert ctx.get(AGENT_TOOL_CALLS["c1"]) is None
    assert ctx.get(PENDING_INTERRUPTS) == []
    assert [r.getMessage() for r in caplog.records] == ["flow s turn turn-1: could not build the failed turn's note"]


def test_a_failed_turn_whose_unfinished_message_is_too_large_stores_none_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """No tool call ran, so no note; the one unfinished message is over the value limit: nothing is
    stored, the turn still fails, and the warning says it stores none of its messages."""
    flow = AgentSessionFlow(_NoNoteRunner(), "NoNote")
    ctx = step_context(flow, "RecordTurnFailure", {})
    huge = [item(MessageRole.ASSISTANT, text="x" * MAX_VALUE_BYTES)]
    with caplog.at_level(logging.WARNING, logger="dex_agents.session"):
        runtime_of(flow).fail_turn(ctx, running_turn(), "turn-1", "boom", unfinished=huge)
    state = ctx.get(AGENT_STATE)
    assert state is not None and (state.last_turn_error, state.next_message_sequence) == ("boom", 2)
    assert ctx.get(AGENT_MESSAGES[message_sequence_key(2)]) is None
    [warning] = [r.getMessage() for r in caplog.records]
    assert warning.startswith("flow s: message 2 (assistant) of turn turn-1 is too large to store: ")
    assert warning.endswith("; the failed turn stores 0 of its messages instead: none")


async def test_a_failed_turn_whose_note_is_too_large_stores_it_cut(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A read's output that fits its record (700,000 characters) makes a note over the value limit
    (its text is in the message twice, as text and in the framework item). The note is stored with
    each call's result cut to CUT_NOTE_FIELD_CHARS, beside the unfinished message, so the next
    turn's model still learns which calls ran."""
    output = "f" * 700_000
    async with in_process(tmp_path, AgentSessionFlow(_FailingAfterAReadRunner(10, output), FLOW_TYPE)) as engine:
        sessions = engine.sessions
        with caplog.at_level(logging.WARNING, logger="dex_agents.session"):
            await sessions.start_session("s", HELLO)
            await turn_ended(sessions, "s", 1)
        # The warning names the first refusal (the note after the unfinished message, sequence 3).
        [warning] = [r.getMessage() for r in caplog.records if "stores" in r.getMessage()]
        assert warning.startswith("flow s: message 3 (user) of turn turn-1 is too large to store: ")
        assert warning.endswith("; the failed turn stores 2 of its messages instead: assistant, user")
        stored = await all_messages(sessions, "s")
        assert [(m.role, m.text) for m in stored] == [
            (MessageRole.USER, HELLO), (MessageRole.ASSISTANT, "x" * 10), (MessageRole.USER, "\n".join([
                "[Dex] The previous turn failed after these tool calls ran:",
                f"- read_x {{}} -> succeeded: {output[:CUT_NOTE_FIELD_CHARS]} "
                f"[Dex: cut from {len(output)} characters]",
                "Do not repeat these tool calls unless the user asks again.",
            ])),
        ]


class _NotingRunner(_NoNoteRunner):
    """A runner that builds every user message, Dex's notes included, as plain user text."""

    def build_user_message(self, text: str) -> FrameworkMessage:
        return item(MessageRole.USER, text=text)


def test_a_failed_turn_whose_cut_note_is_still_too_large_stores_it_cut_further() -> None:
    """500 calls whose arguments and outputs are 3,000 characters each: the note cut to
    CUT_NOTE_FIELD_CHARS a field is still over the value limit, so it is stored cut to the first of
    TIGHTER_NOTE_FIELD_CHARS. Catches: the note left out, so that the next turn's model, told
    nothing, could repeat the writes that ran."""
    calls = 500
    arguments, output = "a" * 3000, "o" * 3000
    flow = AgentSessionFlow(_NotingRunner(), "Noting")
    ctx = step_context(flow, "RecordTurnFailure", {
        ("AgentToolCalls", f"c{n}"): tool_call(AgentToolCallStatus.SUCCEEDED, tool_call_id=f"c{n}", arguments=arguments,
                                               output=output, deferral_order=n)
        for n in range(calls)
    })
    assert calls * 2 * (CUT_NOTE_FIELD_CHARS + 30) > MAX_VALUE_BYTES  # the first cut cannot fit
    runtime_of(flow).fail_turn(ctx, running_turn(), "turn-1", "boom")
    stored = ctx.get(AGENT_MESSAGES[message_sequence_key(2)])
    chars = TIGHTER_NOTE_FIELD_CHARS[0]
    line = (f"- t {arguments[:chars]} [Dex: cut from 3000 characters] -> succeeded: "
            f"{output[:chars]} [Dex: cut from 3000 characters]")
    assert stored is not None and stored.text == "\n".join([
        "[Dex] The previous turn failed after these tool calls ran:", *[line] * calls,
        "Do not repeat these tool calls unless the user asks again.",
    ])
    state = ctx.get(AGENT_STATE)
    assert state is not None and (state.last_turn_error, state.next_message_sequence) == ("boom", 3)


def _read_call(call_id: str = "c1") -> DeferredToolCall:
    return DeferredToolCall(call_id, "read_x", "{}", ToolPolicy(ToolEffect.READ))


_PARTIAL = item(MessageRole.ASSISTANT, text="partial")
_USAGE = AgentUsage(model_calls=1, input_tokens=7, output_tokens=3)
_OUTCOME_KINDS = "return TurnCompleted, ToolCallsRequested or TurnContinued"

CONTRACT_BREACHES: list[tuple[str, Callable[[], object], str]] = [
    # (case, what run_model_step returns, last_turn_error)
    ("a-dict", lambda: {"answer": "hi"}, f"run_model_step returned a dict; {_OUTCOME_KINDS}"),
    ("none", lambda: None, f"run_model_step returned a NoneType; {_OUTCOME_KINDS}"),
    ("no-tool-calls", lambda: ToolCallsRequested("state", [], _USAGE),
     "ToolCallsRequested.tool_calls must be a non-empty sequence of DeferredToolCall"),
    ("empty-run-state", lambda: ToolCallsRequested("", [_read_call()], _USAGE),
     "ToolCallsRequested.framework_run_state must be non-empty text that continues the turn"),
    ("continued-empty-run-state", lambda: TurnContinued("", [], _USAGE),
     "TurnContinued.framework_run_state must be non-empty text that continues the turn"),
    ("run-state-not-text", lambda: ToolCallsRequested({"step": 1}, [_read_call()], _USAGE),  # type: ignore[arg-type]
     "ToolCallsRequested.framework_run_state must be non-empty text that continues the turn"),
    ("new-messages-without-builder",
     lambda: ToolCallsRequested("state", [_read_call()], _USAGE, new_messages=[_PARTIAL]),
     NEW_MESSAGES_WITHOUT_BUILDER),
    ("continued-without-builder", lambda: TurnContinued("state", [_PARTIAL], _USAGE), NEW_MESSAGES_WITHOUT_BUILDER),
    ("bad-role", lambda: TurnCompleted([_PARTIAL, FrameworkMessage("system", "{}", text="x")], _USAGE),  # type: ignore[arg-type]
     "TurnCompleted.new_messages[1] has role 'system'; use MessageRole.USER, ASSISTANT or TOOL"),
    ("not-a-framework-message", lambda: TurnCompleted([{"role": "assistant", "text": "x"}], _USAGE),  # type: ignore[list-item]
     "TurnCompleted.new_messages[0] is a dict, not a FrameworkMessage"),
    ("framework-item-not-text",
     lambda: TurnCompleted([FrameworkMessage(MessageRole.ASSISTANT, {"text": "x"})], _USAGE),  # type: ignore[arg-type]
     "TurnCompleted.new_messages[0].framework_item is a dict, not JSON text (str)"),
    ("messages-a-str", lambda: TurnCompleted("echo", _USAGE),  # type: ignore[arg-type]
     "TurnCompleted.new_messages must be a sequence of FrameworkMessage, got str"),
    ("usage-not-agent-usage", lambda: TurnCompleted([_PARTIAL], usage={"model_calls": 1}),  # type: ignore[arg-type]
     "usage must be an AgentUsage, got dict"),
    # A provider's missing count passed on as None, a float, or a negative count: the session's
    # totals could not add them (the model call ran three times and its answer was lost).
    ("usage-count-none", lambda: TurnCompleted([_PARTIAL], AgentUsage(1, cached_input_tokens=None)),  # type: ignore[arg-type]
     "usage cached_input_tokens must be a whole number from 0 to 9223372036854775807, got None"),
    ("usage-count-float", lambda: TurnCompleted([_PARTIAL], AgentUsage(1, input_tokens=12.5)),  # type: ignore[arg-type]
     "usage input_tokens must be a whole number from 0 to 9223372036854775807, got 12.5"),
    ("usage-count-negative", lambda: TurnCompleted([_PARTIAL], AgentUsage(1, output_tokens=-3)),
     "usage output_tokens must be a whole number from 0 to 9223372036854775807, got -3"),
    ("usage-count-bool", lambda: TurnCompleted([_PARTIAL], AgentUsage(True)),
     "usage model_calls must be a whole number from 0 to 9223372036854775807, got True"),
    # Catches: a count too large to store (over 4,300 digits) failing the commit three times.
    ("usage-count-huge", lambda: TurnCompleted([_PARTIAL], AgentUsage(1, input_tokens=10**5000)),
     "usage input_tokens must be a whole number from 0 to 9223372036854775807, got (a int whose repr could not "
     "be made: ValueError)"),
    # Catches: TypeError (unhashable) from the role check, which failed the commit three times.
    ("role-unhashable",
     lambda: TurnCompleted([FrameworkMessage(["assistant"], "{}")], _USAGE),  # type: ignore[arg-type]
     "TurnCompleted.new_messages[0] has role ['assistant']; use MessageRole.USER, ASSISTANT or TOOL"),
    ("policy-not-tool-policy",
     lambda: ToolCallsRequested("state", [DeferredToolCall("c1", "read_x", "{}", "read")], _USAGE),  # type: ignore[arg-type]
     "tool call 'c1' has policy 'read'; use turn.resolve_tool_policy(name)"),
    ("call-not-deferred-tool-call",
     lambda: ToolCallsRequested("state", [("c1", "read_x", "{}")], _USAGE),  # type: ignore[list-item]
     "tool_calls[0] is a tuple, not a DeferredToolCall"),
    # Text UTF-8 cannot hold (a lone surrogate, which a JSON "\ud800" escape decodes to) cannot be stored.
    ("answer-lone-surrogate", lambda: TurnCompleted([item(MessageRole.ASSISTANT, text="bad \ud800 answer")], _USAGE),
     "TurnCompleted.new_messages[0].text is not valid UTF-8 text: '\\ud800' at position 4 is a lone surrogate"),
    ("tool-output-lone-surrogate",
     lambda: TurnCompleted([_PARTIAL, item(MessageRole.TOOL, tool_call_id="c1", output="x\udfff")], _USAGE),
     "TurnCompleted.new_messages[1].tool_output is not valid UTF-8 text: '\\udfff' at position 1 is a lone surrogate"),
    ("tool-name-lone-surrogate",
     lambda: ToolCallsRequested("state", [DeferredToolCall("c1", "read_\ud800", "{}", ToolPolicy(ToolEffect.READ))],
                                _USAGE),
     "tool call 'c1' has a tool name that is not valid UTF-8 text: '\\ud800' at position 5 is a lone surrogate"),
    ("tool-call-id-lone-surrogate",
     lambda: ToolCallsRequested("state", [_read_call("c\ud800")], _USAGE),
     "tool call ID 'c\\ud800' is not valid UTF-8 text: '\\ud800' at position 1 is a lone surrogate"),
    ("turn-error-lone-surrogate", lambda: TurnCompleted([_PARTIAL], _USAGE, turn_error="bad \ud800"),
     "TurnCompleted.turn_error is not valid UTF-8 text: '\\ud800' at position 4 is a lone surrogate"),
    ("run-state-lone-surrogate", lambda: ToolCallsRequested("s\ud800", [_read_call()], _USAGE),
     "ToolCallsRequested.framework_run_state is not valid UTF-8 text: '\\ud800' at position 1 is a lone surrogate"),
    ("continued-run-state-lone-surrogate", lambda: TurnContinued("s\udfff", [], _USAGE),
     "TurnContinued.framework_run_state is not valid UTF-8 text: '\\udfff' at position 1 is a lone surrogate"),
    ("text-not-text", lambda: TurnCompleted([FrameworkMessage(MessageRole.ASSISTANT, "{}", text=42)], _USAGE),  # type: ignore[arg-type]
     "TurnCompleted.new_messages[0].text must be text (str) or None, not int"),
    ("tool-output-not-text",
     lambda: TurnCompleted([FrameworkMessage(MessageRole.TOOL, "{}", tool_call_id="c1", tool_output=b"x")], _USAGE),  # type: ignore[arg-type]
     "TurnCompleted.new_messages[0].tool_output must be text (str) or None, not bytes"),
]
# Cases whose outcome carries no AgentUsage to record; every other one records _USAGE before failing.
NO_USAGE_RECORDED = {"a-dict", "none", "usage-not-agent-usage", "usage-count-none", "usage-count-float",
                     "usage-count-negative", "usage-count-bool", "usage-count-huge"}


async def test_a_turn_error_after_a_tool_call_stores_the_runners_transcript_and_no_note(tmp_path: Path) -> None:
    """TurnCompleted with turn_error (seed 002, RunModel): the turn's new_messages are stored, it
    fails with that text, turn_failed is written, its records are cleared, with no retry. The
    turn-failure note is RecordTurnFailure's (matrix item 8): new_messages already carry the tool
    results, and the note would repeat them."""
    async with in_process(tmp_path, build_flow(tmp_path)) as engine:
        sessions = engine.sessions
        before = await started_session(sessions, "s")
        text = script({"tools": [{"id": "c1", "name": "read_x"}]}, {"turn_error": "limit hit"})
        turn_id, error = await failed_turn(sessions, "s", text)
        assert error == "limit hit"
        assert engine.log.count("model", turn_id=turn_id) == 2  # no retry of the failing call
        stored = (await all_messages(sessions, "s"))[len(before):]
        assert [(m.role, m.tool_call_id) for m in stored] == [
            (MessageRole.USER, None), (MessageRole.ASSISTANT, None), (MessageRole.TOOL, "c1"),
        ]
        assert not any((m.text or "").startswith("[Dex]") for m in stored)
        assert await steps_run(engine.client, "s") == [
            "StartAgentSession", "RunModel", "AwaitUserMessage", "RunModel", "CallTool", "ResumeTurn", "RunModel",
        ]
        await assert_usable(sessions, "s", await all_messages(sessions, "s"))


class _EndsWithTurnError:
    """A runner whose model call ends the turn with `turn_error`, whatever it is."""

    def __init__(self, turn_error: object) -> None:
        self.turn_error = turn_error

    def build_user_message(self, text: str) -> FrameworkMessage:
        return item(MessageRole.USER, text=text)

    async def run_model_step(self, turn: AgentTurnContext) -> AgentTurnOutcome:
        return TurnCompleted([_PARTIAL], _USAGE, turn_error=self.turn_error)  # type: ignore[arg-type]

    async def execute_deferred_tool_call(self, execution: DeferredToolExecution) -> ToolExecutionResult:
        raise AssertionError("no tool runs")


async def test_a_turn_error_that_is_not_a_str_is_recorded_as_its_text() -> None:
    """TurnCompleted.turn_error given as an object, such as the exception the runner caught, fails
    the turn in RunModel's commit with its text as last_turn_error and in turn_failed, as a str does:
    the contract check reads text, so the object never fails the attempt itself (and so no retry)."""
    flow = AgentSessionFlow(_EndsWithTurnError(RuntimeError("the quota is used up")), "TurnError")
    running = running_turn()
    ctx = step_context(flow, "RunModel", {("AgentState", ""): running})
    decision = await TurnSteps(runtime_of(flow)).run_model(ctx, None)
    assert [m.step_type for m in decision.movements] == ["AwaitUserMessage"]
    state = ctx.get(AGENT_STATE)
    assert state is not None and (state.active_turn_id, state.last_turn_error) == (None, "the quota is used up")
    events = [msgspec.json.decode(data) for _, _, data in ctx.writes.appends]
    assert [(e["type"], json.loads(e["payload"])) for e in events][-1] == (
        "turn_failed", {"error": "the quota is used up"})


class _SeesSettings(_EndsWithTurnError):
    """Keeps the session settings each model call is given."""

    def __init__(self) -> None:
        super().__init__(None)
        self.seen: list[dict[str, Any]] = []

    async def run_model_step(self, turn: AgentTurnContext) -> AgentTurnOutcome:
        self.seen.append(turn.session_settings)
        return await super().run_model_step(turn)


@pytest.mark.parametrize(("copied_for", "expected"), [("turn-1", {"model": "a"}), ("turn-0", {})])
async def test_a_model_call_gets_the_settings_its_turn_started_with_not_a_later_update(
    copied_for: str, expected: dict[str, Any]
) -> None:
    """update_session_settings during a turn applies from the next turn (seed 002): the turn's model
    calls get TurnSessionSettings, the copy its start took, not the newer SessionSettings; a copy
    tagged with another turn reads as {}."""
    runner = _SeesSettings()
    flow = AgentSessionFlow(runner, "Settings")
    ctx = step_context(flow, "RunModel", {
        ("AgentState", ""): running_turn(), ("SessionSettings", ""): {"model": "b"},
        ("TurnSessionSettings", ""): TurnSessionSettings(turn_id=copied_for, session_settings={"model": "a"}),
    })
    await TurnSteps(runtime_of(flow)).run_model(ctx, None)
    assert runner.seen == [expected]


class _BreachingAfterAReadRunner(_FailingAfterAReadRunner):
    """After its read call, a model call whose outcome breaks the contract (a dict)."""

    async def run_model_step(self, turn: AgentTurnContext) -> AgentTurnOutcome:
        return {"answer": "hi"}  # type: ignore[return-value]


async def test_a_contract_breach_after_a_call_stores_the_unfinished_messages_then_the_note() -> None:
    """A contract breach that ends the turn in RunModel's commit ends it as RecordTurnFailure would:
    the runner's unfinished-turn messages (the transcript of the call that ran), then the note.
    Catches: the breach storing the note alone, so the runner's own record of the turn is lost."""
    flow = AgentSessionFlow(_BreachingAfterAReadRunner(7), "Breach")
    ctx = step_context(flow, "RunModel", {
        ("AgentState", ""): running_turn(), ("FrameworkRunState", ""): "asked",
        ("AgentToolCalls", "c1"): tool_call(AgentToolCallStatus.SUCCEEDED, tool_name="read_x", output="found"),
    })
    decision = await TurnSteps(runtime_of(flow)).run_model(ctx, None)
    assert [m.step_type for m in decision.movements] == ["AwaitUserMessage"]
    state = ctx.get(AGENT_STATE)
    assert state is not None and (state.active_turn_id, state.next_message_sequence) == (None, 4)
    assert state.last_turn_error == f"run_model_step returned a dict; {_OUTCOME_KINDS}"
    unfinished, note = (ctx.get(AGENT_MESSAGES[message_sequence_key(sequence)]) for sequence in (2, 3))
    assert unfinished is not None and (unfinished.role, unfinished.text) == (MessageRole.ASSISTANT, "x" * 7)
    assert note is not None and note.role is MessageRole.USER and note.text is not None
    assert note.text.startswith(TURN_FAILURE_NOTE_HEADER) and "read_x {} -> succeeded: found" in note.text


async def test_runner_contract_breach_fails_the_turn_without_retry(tmp_path: Path) -> None:
    """A run_model_step outcome that breaks the runner contract fails the turn in RunModel's commit:
    exactly one model call, last_turn_error says what is wrong, turn_failed, the call's usage is
    recorded, nothing else of the outcome is stored, no tool runs, no RecordTurnFailure."""
    runner = MisbehavingRunner(tmp_path, {case: bad for case, bad, _ in CONTRACT_BREACHES})
    async with in_process(tmp_path, flow_with(runner)) as engine:
        sessions = engine.sessions
        before = await started_session(sessions, "s")
        for case, _, expected_error in CONTRACT_BREACHES:
            text = f"{MISBEHAVE} {case}"
            turn_id, error = await failed_turn(sessions, "s", text)
            assert error == expected_error, case
            assert engine.log.count("model", turn_id=turn_id) == 1, case
            assert [m.text for m in (await all_messages(sessions, "s"))[len(before):]] == [text], case
            recorded = [p["recorded"] for t, p in await turn_events(sessions, "s", turn_id) if t == "usage_recorded"]
            assert recorded == ([] if case in NO_USAGE_RECORDED else [msgspec.to_builtins(_USAGE)]), case
            await assert_usable(sessions, "s", before)
            before = await all_messages(sessions, "s")
        assert engine.log.count("tool_start") == 0
        assert await steps_run(engine.client, "s") == [
            "StartAgentSession", "RunModel", *["AwaitUserMessage", "RunModel"] * 2 * len(CONTRACT_BREACHES),
        ]


@pytest.mark.parametrize(("text", "expected_error"), [
    (USER_MESSAGE_AS_ASSISTANT, "build_user_message returned role 'assistant'; it must be 'user'"),
    (USER_MESSAGE_THAT_RAISES, "build_user_message raised ValueError: cannot build"),
    # One message, named without an index: "build_user_message(...)[0] is a str" read as a list.
    (USER_MESSAGE_AS_TEXT, "build_user_message(...) is a str, not a FrameworkMessage"),
    (USER_MESSAGE_WITH_DICT_ITEM, "build_user_message(...).framework_item is a dict, not JSON text (str)"),
])
async def test_a_user_message_the_runner_cannot_build_fails_the_turn(
    tmp_path: Path, text: str, expected_error: str
) -> None:
    """build_user_message returning a non-user message, or raising, fails the new turn in
    AwaitUserMessage's commit: no model call, nothing stored, turn_failed."""
    async with in_process(tmp_path, flow_with(MisbehavingRunner(tmp_path, {}))) as engine:
        sessions = engine.sessions
        before = await started_session(sessions, "s")
        turn_id, error = await failed_turn(sessions, "s", text)
        assert error == expected_error
        assert engine.log.count("model", turn_id=turn_id) == 0
        assert await all_messages(sessions, "s") == before
        await assert_usable(sessions, "s", before)


# Values over the engine's limit -------------------------------------------------------------------


async def assert_usage_recorded_once(sessions: AgentSessionClient, session_id: str, turn_id: str) -> None:
    """The turn's model call, whose outcome was too large to store, is counted once: one
    usage_recorded of _USAGE (the failure route's), before turn_failed, and the session's total
    the first turn's call (the scripted runner's CALL_USAGE) plus it."""
    events = [(t, p) for t, p in await turn_events(sessions, session_id, turn_id)
              if t in ("usage_recorded", "turn_failed")]
    total = CALL_USAGE.plus(_USAGE)
    assert [(t, p.get("recorded"), p.get("session")) for t, p in events] == [
        ("usage_recorded", msgspec.to_builtins(_USAGE), msgspec.to_builtins(total)), ("turn_failed", None, None)]
    assert (await sessions.get_agent_snapshot(session_id)).usage == total


async def test_model_answer_over_the_value_limit_fails_the_turn(
    tmp_path: Path, db_url: str  # noqa: F811 - the fixture
) -> None:
    """An answer larger than MAX_VALUE_BYTES fails the turn once (no retry): RecordTurnFailure sets a
    last_turn_error saying which message is too large to store, and nothing of the answer is stored;
    the call's usage, dropped with RunModel's commit, is recorded by RecordTurnFailure. Catches: a
    model call the user paid for missing from AgentUsage."""
    runner = MisbehavingRunner(tmp_path, {
        "big": lambda: TurnCompleted([item(MessageRole.ASSISTANT, text="x" * MAX_VALUE_BYTES)], _USAGE),
    })
    async with in_process(tmp_path, flow_with(runner), database_url=db_url) as engine:
        sessions = engine.sessions
        before = await started_session(sessions, "s")
        text = f"{MISBEHAVE} big"
        turn_id, error = await failed_turn(sessions, "s", text)
        assert error.startswith("message 4 (assistant) of turn turn-2 is too large to store: ")
        assert f"over MAX_VALUE_BYTES ({MAX_VALUE_BYTES})" in error
        assert engine.log.count("model", turn_id=turn_id) == 1
        await assert_usage_recorded_once(sessions, "s", turn_id)
        # A failed RunModel commits no Execute; its failure route does.
        assert await steps_run(engine.client, "s") == [
            "StartAgentSession", "RunModel", "AwaitUserMessage", "RecordTurnFailure",
        ]
        assert [m.text for m in await all_messages(sessions, "s")] == ["first", "echo: first", text]
        await assert_usable(sessions, "s", before)


async def test_a_tool_call_whose_record_is_over_the_value_limit_fails_the_turn_once(
    tmp_path: Path, db_url: str  # noqa: F811 - the fixture
) -> None:
    """A call whose arguments alone nearly fill one stored value (from a runner that stores no
    message of them), so its record does not fit: the turn fails at once naming the call, the
    model called once and no tool run, the session going on though the tool's name holds "run state
    of" (what ends a session for an oversized run state). Catches: RunModel's commit failing on each
    of its three attempts, calling the model again each time, and then an engine error naming no
    call; the failure taken for the run state's; the call's usage missing from AgentUsage."""
    arguments = json.dumps({"pad": "x" * (MAX_VALUE_BYTES - 100)})
    huge = DeferredToolCall("c1", "save run state of job", arguments, ToolPolicy(ToolEffect.READ))
    runner = MisbehavingRunner(tmp_path, {"huge-call": lambda: ToolCallsRequested("asked", [huge], _USAGE)})
    async with in_process(tmp_path, flow_with(runner), database_url=db_url) as engine:
        sessions = engine.sessions
        before = await started_session(sessions, "s")
        turn_id, error = await failed_turn(sessions, "s", f"{MISBEHAVE} huge-call")
        assert error.startswith(f"tool call 'c1' (save run state of job) of turn {turn_id} is too large to store: "
                                "value for "
                                "'AgentToolCalls[c1]' is "), error
        assert engine.log.count("model", turn_id=turn_id) == 1
        assert engine.log.count("tool_start") == 0
        await assert_usage_recorded_once(sessions, "s", turn_id)
        await assert_usable(sessions, "s", before)


def _approval_filling_its_record(tool_call_id: str, turn_id: str, slack: int) -> DeferredToolCall:
    """A write needing approval whose record, as RunModel stores it, is `slack` bytes under the
    value limit: its arguments fill the rest."""
    policy = ToolPolicy(ToolEffect.NON_IDEMPOTENT_WRITE, requires_approval=True)
    record = filling(tool_call(AgentToolCallStatus.AWAITING_APPROVAL, tool_call_id=tool_call_id, turn_id=turn_id,
                               tool_name="write_x", effect=policy.effect, requires_approval=True), slack)
    return DeferredToolCall(tool_call_id, "write_x", record.arguments, policy)


async def test_cancel_turn_ends_a_turn_whose_waiting_call_nearly_fills_the_value_limit(
    tmp_path: Path, db_url: str  # noqa: F811 - the fixture
) -> None:
    """A write awaiting approval whose record is 20 bytes under the value limit (arguments from a
    runner that stores no message of them): cancel_turn marks it rejected with the cancellation's
    message and reason, ~60 bytes more. Its arguments are cut instead, and the turn ends cancelled,
    the note naming the call. Catches: FinishTurnCancellation failing on every retry, the cancel
    never finishing and the session stuck in running_tools."""
    runner = MisbehavingRunner(tmp_path, {"filling-approval": lambda: ToolCallsRequested(
        "asked", [_approval_filling_its_record("w1", "turn-2", 20)], AgentUsage())})
    async with in_process(tmp_path, flow_with(runner), database_url=db_url) as engine:
        sessions = engine.sessions
        before = await started_session(sessions, "s")
        assert await sessions.send_user_message("s", f"{MISBEHAVE} filling-approval")
        await wait_for_agent_snapshot(sessions, "s", lambda s: s.pending_interrupts, description="the approval")
        assert await sessions.cancel_turn("s") is True
        snapshot = await turn_ended(sessions, "s", 2)
        assert snapshot.state is not None and snapshot.state.last_turn_error is None
        assert snapshot.pending_interrupts == [] and snapshot.tool_calls == []
        note = snapshot.messages[-1].text or ""
        assert note.startswith(CANCELLED_NOTE_HEADER), note[:200]
        assert re.search(r'- write_x \{"pad":"x+ \[Dex: cut from \d+ characters\] -> rejected: ', note), note[:300]
        assert engine.log.count("tool_start") == 0
        await assert_usable(sessions, "s", before)


class _OversizedRunStateRunner:
    """A read call with a run state that fits, then one whose run state is over the value limit.
    Each response stores an assistant message, and the runner builds unfinished-turn messages, so a
    failure route that stored anything of the turn would show it."""

    def __init__(self) -> None:
        self.model_calls = 0

    def build_user_message(self, text: str) -> FrameworkMessage:
        return item(MessageRole.USER, text=text)

    async def run_model_step(self, turn: AgentTurnContext) -> AgentTurnOutcome:
        self.model_calls += 1
        if turn.framework_run_state is None:
            return ToolCallsRequested("fits", [_read_call("c1")], AgentUsage(),
                                      new_messages=[item(MessageRole.ASSISTANT, text="asked c1")])
        return ToolCallsRequested("x" * MAX_VALUE_BYTES, [_read_call("c2")], _USAGE,
                                  new_messages=[item(MessageRole.ASSISTANT, text="asked c2")])

    async def execute_deferred_tool_call(self, execution: DeferredToolExecution) -> ToolExecutionResult:
        return ToolExecutionResult("found")

    def build_unfinished_turn_messages(self, turn: AgentTurnContext) -> list[FrameworkMessage]:
        return [item(MessageRole.TOOL, tool_call_id="c2", output="never run")]


async def test_a_run_state_too_large_to_store_ends_the_session(
    tmp_path: Path, db_url: str  # noqa: F811 - the fixture
) -> None:
    """Seed 002, RecordTurnFailure (the rule under RecordToolFailure): a RunModel whose run state is
    over the value limit fails once (no retry), and its failure route ends the session instead of the
    turn, since every later turn would meet the same limit. Status failed, last_turn_error the
    detail, the turn, FrameworkRunState and PendingInterrupts cleared, the turn's records kept (but
    not in the snapshot, which lists the active turn's only), turn_failed written, the Flow
    force-failed with the detail, and no turn message stored: no unfinished-turn messages, no note.
    The failed call's usage, dropped with RunModel's commit, is recorded as the session ends."""
    runner = _OversizedRunStateRunner()
    async with in_process(tmp_path, AgentSessionFlow(runner, FLOW_TYPE), database_url=db_url) as engine:
        sessions, client = engine.sessions, engine.client
        await sessions.start_session("s", HELLO)
        info = await client.wait_for_flow("s", 30)
        assert info.status == "failed"
        error = info.error
        assert error is not None
        assert error.startswith("the framework run state of turn turn-1 is too large to store: ")
        assert runner.model_calls == 2

        snapshot = await sessions.get_agent_snapshot("s")
        state = snapshot.state
        assert state is not None
        assert (state.status, state.last_turn_error, state.active_turn_id, state.turn_count) == (
            AgentStatus.FAILED, error, None, 1)
        assert snapshot.pending_interrupts == [] and snapshot.tool_calls == []
        assert await client.get_attribute("s", FRAMEWORK_RUN_STATE) is None
        assert await client.get_attribute("s", PENDING_INTERRUPTS) == []
        kept = await client.get_attribute_map("s", AGENT_TOOL_CALLS)
        assert {k: (r.turn_id, r.status) for k, r in kept.items()} == {
            "c1": ("turn-1", AgentToolCallStatus.SUCCEEDED)}

        stored = await all_messages(sessions, "s")
        assert [(m.role, m.text) for m in stored] == [(MessageRole.USER, HELLO), (MessageRole.ASSISTANT, "asked c1")]
        await assert_turn_failed(sessions, "s", "turn-1", error)
        recorded = [p["recorded"] for t, p in await turn_events(sessions, "s", "turn-1") if t == "usage_recorded"]
        assert recorded == [msgspec.to_builtins(AgentUsage()), msgspec.to_builtins(_USAGE)]
        assert snapshot.usage == _USAGE
        # The second RunModel failed without a retry: it commits no Execute; its failure route does.
        assert await steps_run(client, "s") == [
            "StartAgentSession", "RunModel", "CallTool", "ResumeTurn", "RecordTurnFailure",
        ]


async def test_a_run_state_failure_leaves_nothing_of_the_session_answerable() -> None:
    """RecordTurnFailure ending the session for a run state too large to store clears PendingInterrupts
    whatever it holds (a live session reaches it with none left): a failed session can take no answer."""
    flow = AgentSessionFlow(ScriptedRunner(), "Fails")
    detail = "the framework run state of turn turn-1 is too large to store: over the limit"
    recovery = RecoveryError(step_type="RunModel", step_execution_id="RunModel-1", method="execute", attempts=1,
                             attempt_progress=AttemptProgress.NOT_COMPLETED, error_type="ValueTooLarge", detail=detail)
    ctx = step_context(flow, "RecordTurnFailure", {
        ("AgentState", ""): running_turn(), ("PendingInterrupts", ""): [interrupt("c1")],
        ("FrameworkRunState", ""): "run state",
    }, recovery_error=recovery)
    decision = await TurnSteps(runtime_of(flow)).record_turn_failure(ctx, None)
    assert (decision.kind, decision.reason) == ("force_fail", detail)
    assert (ctx.get(PENDING_INTERRUPTS), ctx.get(FRAMEWORK_RUN_STATE)) == ([], None)
    state = ctx.get(AGENT_STATE)
    assert state is not None and (state.status, state.active_turn_id, state.last_turn_error) == (
        AgentStatus.FAILED, None, detail)


@pytest.mark.parametrize(("error_type", "detail", "expected"), [
    ("RuntimeError", "the provider is down", "the provider is down"),
    ("RuntimeError", "", "RuntimeError"),  # an exception without text: last_turn_error names its type
    # Only a ValueTooLarge about the run state ends the session; other errors end the turn.
    ("RuntimeError", "the framework run state of turn turn-1 is bad", "the framework run state of turn turn-1 is bad"),
    ("ValueTooLarge", "message 3 (assistant) of turn turn-1 is too large to store",
     "message 3 (assistant) of turn turn-1 is too large to store"),
    # A call's record too large to store, whose tool name the model chose: the turn ends, not the session.
    ("ToolCallTooLarge", "tool call 'c1' (save run state of the job) of turn turn-1 is too large to store",
     "tool call 'c1' (save run state of the job) of turn turn-1 is too large to store"),
])
async def test_record_turn_failure_ends_the_turn_with_the_recovery_detail_or_its_type(
    error_type: str, detail: str, expected: str,
) -> None:
    """RecordTurnFailure records last_turn_error from the recovery error: its detail, or its type when
    the detail is empty (an exception raised without text), and writes turn_failed with it; the
    session goes on to AwaitUserMessage unless the error is a ValueTooLarge about the run state."""
    flow = AgentSessionFlow(ScriptedRunner(), "Fails")
    running = running_turn()
    recovery = RecoveryError(step_type="RunModel", step_execution_id="RunModel-1", method="execute", attempts=3,
                             attempt_progress=AttemptProgress.NOT_COMPLETED, error_type=error_type, detail=detail)
    ctx = step_context(flow, "RecordTurnFailure", {("AgentState", ""): running}, recovery_error=recovery)
    decision = await TurnSteps(runtime_of(flow)).record_turn_failure(ctx, None)
    assert [m.step_type for m in decision.movements] == ["AwaitUserMessage"]
    state = ctx.get(AGENT_STATE)
    assert state is not None
    assert (state.status, state.active_turn_id, state.last_turn_error) == (
        AgentStatus.WAITING_FOR_USER_MESSAGE, None, expected)
    events = [msgspec.json.decode(data) for _, _, data in ctx.writes.appends]
    assert [(e["type"], json.loads(e["payload"])) for e in events] == [("turn_failed", {"error": expected})]


_TOO_LARGE = "message 3 (assistant) of turn turn-1 is too large to store"


@pytest.mark.parametrize(("error_type", "usage", "counted"), [
    ("ValueTooLarge", _USAGE, True),
    ("ToolCallTooLarge", _USAGE, True),
    # Any other failure's detail is a runner's text, whatever it starts with.
    ("RuntimeError", _USAGE, False),
    # A usage that cannot be added to the totals is left in the detail, not recorded.
    ("ValueTooLarge", AgentUsage(model_calls=-1), False),
])
async def test_record_turn_failure_records_the_usage_a_too_large_outcome_carries(
    error_type: str, usage: AgentUsage, counted: bool,
) -> None:
    """RunModel's size failure carries the model call's usage, which its failed commit dropped, at
    the head of its detail: RecordTurnFailure records it, before turn_failed, and keeps it out of
    last_turn_error."""
    flow = AgentSessionFlow(ScriptedRunner(), "Fails")
    detail = str(with_unrecorded_usage(ValueTooLarge(_TOO_LARGE), usage))
    recovery = RecoveryError(step_type="RunModel", step_execution_id="RunModel-1", method="execute", attempts=1,
                             attempt_progress=AttemptProgress.NOT_COMPLETED, error_type=error_type, detail=detail)
    ctx = step_context(flow, "RecordTurnFailure", {("AgentState", ""): running_turn()}, recovery_error=recovery)
    await TurnSteps(runtime_of(flow)).record_turn_failure(ctx, None)
    expected = _TOO_LARGE if counted else detail
    state = ctx.get(AGENT_STATE)
    assert state is not None and state.last_turn_error == expected
    events = [msgspec.json.decode(data) for _, _, data in ctx.writes.appends]
    assert [e["type"] for e in events] == [*(["usage_recorded"] if counted else []), "turn_failed"]
    assert ctx.get(AGENT_USAGE) == (usage if counted else None)


def _text_filling(limit: int, wrap: Callable[[str], object]) -> str:
    """The longest text whose wrapped value encodes to at most `limit` bytes (exactly `limit`)."""
    text = "x" * (limit - len(msgspec.json.encode(wrap(""))))
    assert len(msgspec.json.encode(wrap(text))) == limit
    return text


async def test_user_message_under_the_rpc_limit_but_too_large_to_store(tmp_path: Path) -> None:
    """A user message one byte over the limit is refused by the RPC (nothing queued); one that fits
    the RPC but not an AgentMessage starts a turn that fails at once, with no model call."""
    async with in_process(tmp_path, build_flow(tmp_path)) as engine:
        sessions = engine.sessions
        before = await started_session(sessions, "s")
        text = _text_filling(MAX_VALUE_BYTES, AgentUserMessage)
        await engine.stop_worker()  # nothing else writes while the refused call runs
        rows = await table_rows(engine.client)
        with pytest.raises(ValueTooLargeError, match="request of RPC send_user_message"):
            await sessions.send_user_message("s", text + "x")
        assert await table_rows(engine.client) == rows
        await engine.start_worker()

        turn_id, error = await failed_turn(sessions, "s", text)
        assert error.startswith("message 3 (user) of turn turn-2 is too large to store: ")
        assert f"over MAX_VALUE_BYTES ({MAX_VALUE_BYTES})" in error
        assert engine.log.count("model", turn_id=turn_id) == 0
        assert await all_messages(sessions, "s") == before
        await assert_usable(sessions, "s", before)


async def test_initial_message_too_large(tmp_path: Path) -> None:
    """An initial_message over the input limit starts nothing; one that fits the input but not an
    AgentMessage fails turn 1 in StartAgentSession, and the session goes on."""
    async with in_process(tmp_path, build_flow(tmp_path)) as engine:
        sessions = engine.sessions
        text = _text_filling(MAX_VALUE_BYTES, lambda t: AgentSessionStartInput(initial_message=t))
        with pytest.raises(ValueTooLargeError):
            await sessions.start_session("too-large", text + "x")
        assert not await engine.client.exists("too-large")

        await sessions.start_session("s", text)
        snapshot = await turn_ended(sessions, "s", 1)
        assert snapshot.state is not None
        error = snapshot.state.last_turn_error
        assert error is not None and error.startswith("message 1 (user) of turn turn-1 is too large to store: ")
        await assert_turn_failed(sessions, "s", "turn-1", error)
        assert engine.log.count("model") == 0
        await assert_usable(sessions, "s", [])


# Tools that misbehave -----------------------------------------------------------------------------


async def test_tool_returning_a_non_tool_execution_result(tmp_path: Path) -> None:
    """A tool Step whose tool returns something other than ToolExecutionResult fails its attempts:
    the read retries (3 attempts) and records failed through RecordToolFailure, the write runs once
    and records outcome_unknown; the model sees both and the turn completes."""
    runner = WrongToolResultRunner(tmp_path)
    flow = flow_with(runner, tool_policies={"bad_write": ToolPolicy(ToolEffect.NON_IDEMPOTENT_WRITE,
                                                                    requires_approval=False),
                                            "bad_read": ToolPolicy(ToolEffect.READ)})
    async with in_process(tmp_path, flow) as engine:
        sessions = engine.sessions
        before = await started_session(sessions, "s")
        snapshot = await run_turn(sessions, "s", script(
            {"tools": [{"id": "r", "name": "bad_read"}, {"id": "w", "name": "bad_write"}]}, {"answer": "{results}"}))
        assert snapshot.state is not None and snapshot.state.last_turn_error is None
        answer = snapshot.messages[-1].text
        assert answer is not None
        assert answer == (
            "r=The tool call failed: execute_deferred_tool_call returned 'plain text'; return "
            f"ToolExecutionResult(output: str) or raise ToolExecutionError; w={OUTCOME_UNKNOWN_TEXT}"
        )
        assert sorted(e["attempt"] for e in engine.log.entries("tool_start", tool_call_id="r")) == [1, 2, 3]
        assert [e["attempt"] for e in engine.log.entries("tool_start", tool_call_id="w")] == [1]
        steps = await steps_run(engine.client, "s")
        assert {"RecordToolFailure", "RecordToolOutcomeUnknown"} <= set(steps)
        await assert_usable(sessions, "s", before)


async def test_tool_output_over_the_value_limit(tmp_path: Path) -> None:
    """A tool output too large to store: a read records failed with a clear error (safe to call
    again); a write that ran records succeeded with a note; each tool ran once."""
    flow = unapproved_write_flow(tmp_path, "write_big")
    big = {"output_bytes": MAX_VALUE_BYTES}
    async with in_process(tmp_path, flow) as engine:
        sessions = engine.sessions
        before = await started_session(sessions, "s")
        snapshot = await run_turn(sessions, "s", script({"tools": [
            {"id": "r", "name": "read_big", "args": big}, {"id": "i", "name": "idem_big", "args": big},
            {"id": "w", "name": "write_big", "args": big},
        ]}, {"answer": "{results}"}))
        assert snapshot.state is not None and snapshot.state.last_turn_error is None
        answer = snapshot.messages[-1].text
        assert answer is not None
        # The record holds the output plus its other fields, so its size is the output's and a bit more.
        note = (rf"the tool's output is \d+ bytes, over the session's value limit of {MAX_VALUE_BYTES}; "
                "it was not stored")
        succeeded = rf"\[Dex\] The tool call succeeded, but {note}\."
        assert re.fullmatch(rf"r=The tool call failed: {note}; i={succeeded}; w={succeeded}", answer), answer
        for call_id in ("r", "i", "w"):
            assert engine.log.count("tool_start", tool_call_id=call_id) == 1
            assert engine.log.count("tool_end", tool_call_id=call_id) == 1
        await assert_usable(sessions, "s", before)


async def test_tool_error_over_the_value_limit_keeps_the_calls_status(tmp_path: Path) -> None:
    """A tool error (ToolExecutionError, ToolOutcomeUnknownError) whose text is too large to store
    keeps the call's status, failed or outcome_unknown, with the text cut to
    MAX_STORED_TOOL_ERROR_CHARS and a note of its length; each tool ran once. Catches: such an
    error taken for a too-large output, where a write the tool said failed, or whose outcome it did
    not know, was recorded as succeeded, and the model told so."""
    flow = unapproved_write_flow(tmp_path, "write_big")
    size = MAX_VALUE_BYTES + 1
    async with in_process(tmp_path, flow) as engine:
        sessions = engine.sessions
        before = await started_session(sessions, "s")
        records = await tool_records(sessions, "s", [
            {"id": "rf", "name": "read_big", "args": {"fail_bytes": size}},
            {"id": "ru", "name": "read_big", "args": {"unknown_bytes": size}},
            {"id": "wf", "name": "write_big", "args": {"fail_bytes": size}},
            {"id": "wu", "name": "write_big", "args": {"unknown_bytes": size}},
        ])
        cut = f" [Dex: cut from {size} characters]"
        failed, unknown = "f" * MAX_STORED_TOOL_ERROR_CHARS + cut, "u" * MAX_STORED_TOOL_ERROR_CHARS + cut
        assert {k: (v["status"], v["output"], v["error"]) for k, v in records.items()} == {
            "rf": ("failed", None, failed), "ru": ("outcome_unknown", None, unknown),
            "wf": ("failed", None, failed), "wu": ("outcome_unknown", None, unknown),
        }
        for call_id in records:
            assert engine.log.count("tool_start", tool_call_id=call_id) == 1
        await assert_usable(sessions, "s", before)


async def test_tool_output_or_error_with_a_lone_surrogate_is_stored_escaped(tmp_path: Path) -> None:
    """A tool's output or error text holding a lone surrogate (UTF-8 cannot hold it) is stored with
    the surrogate escaped: the write that ran stays succeeded (not outcome_unknown), nothing runs
    twice, and the model sees the text with the escape."""
    flow = unapproved_write_flow(tmp_path, "write_odd")
    odd = "half \ud83d of an emoji"
    async with in_process(tmp_path, flow) as engine:
        sessions = engine.sessions
        before = await started_session(sessions, "s")
        records = await tool_records(sessions, "s", [
            {"id": "r", "name": "read_odd", "args": {"output": odd}},
            {"id": "w", "name": "write_odd", "args": {"output": odd}},
            {"id": "f", "name": "read_fails", "args": {"fail": odd}},
        ])
        escaped = "half \\ud83d of an emoji"
        assert {k: (v["status"], v["output"], v["error"]) for k, v in records.items()} == {
            "r": ("succeeded", escaped, None), "w": ("succeeded", escaped, None), "f": ("failed", None, escaped)}
        for call_id in ("r", "w", "f"):
            assert engine.log.count("tool_start", tool_call_id=call_id) == 1
        await assert_usable(sessions, "s", before)


# Session settings ---------------------------------------------------------------------------------


def _settings_of_size(size: int) -> dict[str, str]:
    settings = {"k": "x" * (size - len('{"k":""}'))}
    assert len(json.dumps(settings, separators=(",", ":")).encode()) == size
    return settings


def test_settings_size_is_the_compact_json_of_every_key() -> None:
    """The size check measures compact JSON with "," and ":" (seed 002 "Session settings"), for settings
    of several keys too: the cases below use one key, which no item separator enters."""
    settings = {"model": "m", "tools": ["a", "b"], "n": 1}
    assert session_settings_size(settings) == len('{"model":"m","tools":["a","b"],"n":1}')


def _settings_holding_themselves() -> dict[str, Any]:
    """Settings with an array that holds the settings again: a cycle, which JSON cannot write."""
    settings: dict[str, Any] = {"model": "m"}
    settings["fallbacks"] = [{"model": "n"}, settings]
    return settings


CIRCULAR_SETTINGS_PROBLEM = (
    "session_settings contain themselves (an object or array that holds itself), which JSON cannot write")


@pytest.mark.timeout(10)
def test_settings_that_hold_themselves_are_refused_at_once() -> None:
    """A dict or list that holds itself is refused with ValueError naming the problem, by the Client's
    check and the session's. Catches: the nesting walk following the cycle for ever, so that
    start_session and update_session_settings hung, growing memory, instead of raising. The same
    object under two keys is no cycle, and is accepted."""
    loop: list[Any] = ["a"]
    loop.append({"k": loop})
    for settings in (_settings_holding_themselves(), {"x": loop}):
        with pytest.raises(ValueError) as caught:
            validate_session_settings(settings)
        assert str(caught.value) == CIRCULAR_SETTINGS_PROBLEM
        assert session_settings_error(settings) == CIRCULAR_SETTINGS_PROBLEM
    shared = {"model": "m", "tools": ["a"]}
    validate_session_settings({"main": shared, "fallbacks": [shared, shared]})



def test_settings_checks_at_their_edges() -> None:
    """The settings checks' edges, each measured as seed 002 "Session settings" says (compact JSON
    text in UTF-8, objects and arrays nested at most MAX_SESSION_SETTINGS_NESTING deep):
    - non-ASCII text counts its UTF-8 bytes, so settings of exactly the limit in it are accepted
      (catches: the size taken of \\u escapes, 6 bytes a character);
    - settings exactly MAX_SESSION_SETTINGS_NESTING deep are accepted (catches: `>=`);
    - the depth is the deepest branch's, whichever is walked last (catches: the last one's);
    - a tuple, written by JSON as an array, counts as one (catches: tuples not walked);
    - a key that is not text is shown cut (catches: a huge key in the error)."""
    accented = {"k": "é" * ((MAX_SESSION_SETTINGS_BYTES - len('{"k":""}')) // 2)}
    assert session_settings_size(accented) == MAX_SESSION_SETTINGS_BYTES
    validate_session_settings(accented)
    deepest_allowed = functools.reduce(lambda inner, _: {"k": inner}, range(MAX_SESSION_SETTINGS_NESTING - 1), {})
    validate_session_settings(deepest_allowed)
    too_deep = f"over the limit of {MAX_SESSION_SETTINGS_NESTING}"
    for settings, depth in (
        ({"shallow": [], "deep": deepest_allowed}, MAX_SESSION_SETTINGS_NESTING + 1),
        ({"k": functools.reduce(lambda inner, _: (inner,), range(MAX_SESSION_SETTINGS_NESTING), ())},
         MAX_SESSION_SETTINGS_NESTING + 2),
    ):
        assert session_settings_error(settings) == (
            f"session_settings nest objects and arrays {depth} levels deep, {too_deep}")
    assert session_settings_error({10**100: 1}) == (
        "session_settings keys must be text, got the int key " + "1" + "0" * 59)


def test_a_rejection_message_of_exactly_the_limit_is_kept_whole() -> None:
    """MAX_REJECTION_MESSAGE_CHARS is the longest message kept as given; one more character is cut."""
    exact = "n" * MAX_REJECTION_MESSAGE_CHARS
    assert storable_rejection_message(exact) == exact
    longer = exact + "n"
    assert storable_rejection_message(longer) == (
        f"{exact} [Dex: cut from {MAX_REJECTION_MESSAGE_CHARS + 1} characters]")


INVALID_SETTINGS: list[tuple[str, object, str]] = [
    # (case, session_settings, the start of the ValueError's message)
    ("a-list", [1, 2], "session_settings must be a JSON object, got list"),
    ("a-str", "model=x", "session_settings must be a JSON object, got str"),
    ("nan", {"k": math.nan}, "session_settings are not JSON: "),
    ("not-serializable", {"k": object()}, "session_settings are not JSON: "),
    ("nested-too-deeply", functools.reduce(lambda inner, _: {"k": inner}, range(100_000), {}),
     f"session_settings nest objects and arrays 100001 levels deep, over the limit of {MAX_SESSION_SETTINGS_NESTING}"),
    # Deeper than the engine stores (MAX_VALUE_NESTING, less the start input around them), though
    # JSON writes it: refused here, by name, not as the engine's 'flow input'.
    ("nested-past-the-engine", functools.reduce(lambda inner, _: {"k": inner}, range(MAX_SESSION_SETTINGS_NESTING), {}),
     f"session_settings nest objects and arrays {MAX_SESSION_SETTINGS_NESTING + 1} levels deep, over the limit of "
     f"{MAX_SESSION_SETTINGS_NESTING}"),
    # Catches: json.dumps writing a None, True or 1 key as text, so the size checked was not what the
    # engine stores (it refused None and True keys by its own, unnamed error; {1: .., "1": ..} lost one).
    ("none-key", {"a": {None: 1}}, "session_settings keys must be text, got the NoneType key None"),
    ("bool-key", {True: 1}, "session_settings keys must be text, got the bool key True"),
    ("int-key", {1: "a", "1": "b"}, "session_settings keys must be text, got the int key 1"),
    ("circular", _settings_holding_themselves(), CIRCULAR_SETTINGS_PROBLEM),
    ("too-large", _settings_of_size(MAX_SESSION_SETTINGS_BYTES + 1),
     f"session_settings are {MAX_SESSION_SETTINGS_BYTES + 1} bytes of compact JSON, over the limit of "
     f"{MAX_SESSION_SETTINGS_BYTES}"),
]


async def test_start_session_and_update_refuse_invalid_settings(tmp_path: Path) -> None:
    """start_session raises ValueError naming the problem before anything is stored; the same ID then
    starts with valid settings (the limit itself is accepted). update_session_settings refuses the same
    settings the same way, before sending, and the stored settings stay."""
    async with in_process(tmp_path, build_flow(tmp_path), worker=False) as engine:
        sessions = engine.sessions
        rows = await table_rows(engine.client)
        for case, settings, problem in INVALID_SETTINGS:
            with pytest.raises(ValueError, match="^" + re.escape(problem)) as caught:
                await sessions.start_session("s", "first", session_settings=settings)  # type: ignore[arg-type]
            assert type(caught.value) is ValueError, case
        assert await table_rows(engine.client) == rows
        assert not await engine.client.exists("s")

        valid = _settings_of_size(MAX_SESSION_SETTINGS_BYTES)
        await engine.start_worker()
        await sessions.start_session("s", "first", session_settings=valid)
        snapshot = await turn_ended(sessions, "s", 1)
        assert snapshot.session_settings == valid
        for _case, settings, problem in INVALID_SETTINGS:
            with pytest.raises(ValueError, match="^" + re.escape(problem)):
                await sessions.update_session_settings("s", settings)  # type: ignore[arg-type]
        assert (await sessions.get_agent_snapshot("s")).session_settings == valid
        await assert_usable(sessions, "s", await all_messages(sessions, "s"))


async def test_session_client_refuses_a_wrong_flow_message_or_search_mode(tmp_path: Path) -> None:
    """AgentSessionClient refuses what is not an AgentSessionFlow, start_session an initial message that
    is not text and a search mode that is not an ActiveStepSearchMode, each with an error naming the
    value, before anything is stored; the same ID then starts."""
    flow = build_flow(tmp_path)
    async with in_process(tmp_path, flow, worker=False) as engine:
        with pytest.raises(TypeError) as caught:
            AgentSessionClient(engine.client, Flow("NotAnAgent", []))  # type: ignore[arg-type]
        assert str(caught.value) == "flow must be an AgentSessionFlow, got Flow"
        sessions = engine.sessions
        rows = await table_rows(engine.client)
        with pytest.raises(TypeError) as caught:
            await sessions.start_session("s", 42)  # type: ignore[arg-type]
        assert str(caught.value) == "initial_message must be a str or None, got int: 42"
        with pytest.raises(ValueError) as caught_mode:
            await sessions.start_session("s", "first", active_step_search_mode="enabled")  # type: ignore[arg-type]
        assert str(caught_mode.value) == "active_step_search_mode must be an ActiveStepSearchMode, got 'enabled'"
        assert await table_rows(engine.client) == rows
        assert not await engine.client.exists("s")
        await sessions.start_session("s", "first", active_step_search_mode=ActiveStepSearchMode.DISABLED)
        assert await engine.client.exists("s")


async def test_session_client_calls_refuse_text_that_is_not_a_str(tmp_path: Path) -> None:
    """Each AgentSessionClient call refuses a text argument that is not a str with TypeError naming
    the argument and the value, before anything is sent; a message sent as bytes is not stored.
    Catches: bytes taken as their base64 text by the engine's JSON (b"hi" stored as the message
    "aGk=", and answered), and other values refused only by the RPC's type check, with its text."""
    async with in_process(tmp_path, build_flow(tmp_path)) as engine:
        sessions = engine.sessions
        before = await started_session(sessions, "s")
        rows = await table_rows(engine.client)
        calls: list[tuple[str, Callable[[], Awaitable[object]]]] = [
            ("text must be a str, got bytes: b'hi'", lambda: sessions.send_user_message("s", b"hi")),  # type: ignore[arg-type]
            ("text must be a str, got NoneType: None", lambda: sessions.send_user_message("s", None)),  # type: ignore[arg-type]
            ("text must be a str or None, got bytes: b'hi'", lambda: sessions.steer_user_message("s", text=b"hi")),  # type: ignore[arg-type]
            ("message_id must be a str or None, got int: 7",
             lambda: sessions.steer_user_message("s", message_id=7)),  # type: ignore[arg-type]
            ("interrupt_id must be a str, got NoneType: None",
             lambda: sessions.resolve_interrupt("s", None, approved=True)),  # type: ignore[arg-type]
            ("rejection_message must be a str or None, got bytes: b'no'",
             lambda: sessions.resolve_interrupt("s", "i", approved=False, rejection_message=b"no")),  # type: ignore[arg-type]
            ("interrupt_id must be a str, got int: 1", lambda: sessions.answer_question("s", 1, "a")),  # type: ignore[arg-type]
            ("answer must be a str, got bytes: b'a'", lambda: sessions.answer_question("s", "i", b"a")),  # type: ignore[arg-type]
            ("message_id must be a str, got bytes: b'm'", lambda: sessions.delete_queued_message("s", b"m")),  # type: ignore[arg-type]
            ("turn_id must be a str or None, got int: 2", lambda: sessions.cancel_turn("s", 2)),  # type: ignore[arg-type]
        ]
        for message, call in calls:
            with pytest.raises(TypeError) as caught:
                await call()
            assert str(caught.value) == message
        assert await table_rows(engine.client) == rows
        await assert_usable(sessions, "s", before)


async def test_start_flow_with_invalid_settings_force_fails_the_session(tmp_path: Path) -> None:
    """A start input sent with AsyncClient.start_flow, past the client's check: settings over the
    session's limit force-fail the flow with the seed's reason and store nothing; settings within the
    tolerance are accepted; settings that are not an object, and an initial message that is not
    text, are refused by the input type."""
    async with in_process(tmp_path, build_flow(tmp_path)) as engine:
        client, flow_type = engine.client, engine.flow.flow_type
        session_limit = MAX_SESSION_SETTINGS_BYTES + SESSION_SETTINGS_SIZE_TOLERANCE_BYTES
        await client.start_flow(flow_type, "too-large", AgentSessionStartInput(
            initial_message="first", session_settings=_settings_of_size(session_limit + 1)))
        info = await client.wait_for_flow("too-large", 30)
        assert info.status == "failed"
        assert info.error == (f"{INVALID_START_SESSION_SETTINGS_REASON}: session_settings are {session_limit + 1} "
                              f"bytes of compact JSON, over the limit of {session_limit}")
        assert await client.get_attribute("too-large", AGENT_STATE) is None
        assert engine.log.count("model") == 0

        with pytest.raises(InvalidValueError, match="session_settings"):
            await client.start_flow(flow_type, "a-list", AgentSessionStartInput(session_settings=[1]))  # type: ignore[arg-type]
        assert not await client.exists("a-list")
        with pytest.raises(InvalidValueError, match=r"\$\.initial_message"):
            await client.start_flow(flow_type, "a-number", AgentSessionStartInput(initial_message=5))  # type: ignore[arg-type]
        assert not await client.exists("a-number")

        tolerated = _settings_of_size(session_limit)
        await client.start_flow(flow_type, "s", AgentSessionStartInput(initial_message="first",
                                                                        session_settings=tolerated))
        snapshot = await turn_ended(engine.sessions, "s", 1)
        assert snapshot.session_settings == tolerated
        await assert_usable(engine.sessions, "s", await all_messages(engine.sessions, "s"))


async def test_empty_settings_at_start_store_none(tmp_path: Path) -> None:
    """session_settings {} means none (seed 002 AgentSessionStartInput): StartAgentSession stores no
    SessionSettings, so the snapshot shows None, as for a session started without settings."""
    async with in_process(tmp_path, build_flow(tmp_path)) as engine:
        await engine.sessions.start_session("client", "first", session_settings={})
        await engine.client.start_flow(engine.flow.flow_type, "direct",
                                       AgentSessionStartInput(initial_message="first", session_settings={}))
        for session_id in ("client", "direct"):
            snapshot = await turn_ended(engine.sessions, session_id, 1)
            assert snapshot.session_settings is None, session_id
            assert await engine.client.get_attribute(session_id, SESSION_SETTINGS) is None, session_id


async def test_start_flow_without_an_input_starts_an_idle_session(tmp_path: Path) -> None:
    """StartAgentSession takes a null input (AsyncClient.start_flow without one) as an empty
    AgentSessionStartInput: the session waits for a user message with no turn, no settings and no
    message, having stored a zero AgentUsage and an empty PendingInterrupts, and the first message
    sent then runs a turn."""
    async with in_process(tmp_path, build_flow(tmp_path)) as engine:
        await engine.client.start_flow(engine.flow.flow_type, "bare")
        idle = await wait_for_agent_snapshot(
            engine.sessions, "bare",
            lambda s: s if s.state is not None and s.state.status is AgentStatus.WAITING_FOR_USER_MESSAGE else None,
            description="the session to wait for a user message")
        assert idle.state is not None
        assert (idle.state.turn_count, idle.state.active_turn_id, idle.state.next_message_sequence) == (0, None, 1)
        assert idle.session_settings is None
        assert await all_messages(engine.sessions, "bare") == []
        assert await engine.client.get_attribute("bare", AGENT_USAGE) == AgentUsage()
        assert await engine.client.get_attribute("bare", PENDING_INTERRUPTS) == []
        await assert_usable(engine.sessions, "bare", [])


# RPCs ---------------------------------------------------------------------------------------------


_WAITING = AgentState(status=AgentStatus.WAITING_FOR_USER_MESSAGE, turn_count=1, active_turn_id=None,
                      next_message_sequence=3, last_turn_error=None)
_CHOICE = interrupt("q1", kind=InterruptKind.QUESTION, choices=["yes", "no"], allows_free_text=False)
REFUSED_RPCS: list[tuple[str, dict[tuple[str, str], Any], object]] = [
    ("send_user_message", {}, AgentUserMessage(" \n\t ")),
    ("send_user_message", {}, AgentUserMessage("a plan please", plan_mode=True)),
    ("resolve_interrupt", {("PendingInterrupts", ""): [interrupt("w1")]}, ResolveInterruptRequest("nope", True)),
    ("resolve_interrupt", {("PendingInterrupts", ""): [_CHOICE]}, ResolveInterruptRequest("q1", True)),
    ("answer_question", {("PendingInterrupts", ""): [_CHOICE]}, AnswerQuestionRequest("nope", "yes")),
    ("answer_question", {("PendingInterrupts", ""): [interrupt("w1")]}, AnswerQuestionRequest("w1", "yes")),
    ("answer_question", {("PendingInterrupts", ""): [_CHOICE]}, AnswerQuestionRequest("q1", "  ")),
    ("answer_question", {("PendingInterrupts", ""): [_CHOICE]}, AnswerQuestionRequest("q1", "maybe")),
    # A choice with spaces around it is not one of the choices (the answer is queued as given).
    ("answer_question", {("PendingInterrupts", ""): [_CHOICE]}, AnswerQuestionRequest("q1", " yes")),
    ("update_session_settings", {}, UpdateSessionSettingsRequest({"model": "m"})),
    ("update_session_settings", {("AgentState", ""): _WAITING}, UpdateSessionSettingsRequest(None)),
    ("update_session_settings", {("AgentState", ""): _WAITING}, UpdateSessionSettingsRequest(
        _settings_of_size(MAX_SESSION_SETTINGS_BYTES + SESSION_SETTINGS_SIZE_TOLERANCE_BYTES + 1))),
    ("execute_plan", {("AgentState", ""): _WAITING}, ExecutePlanRequest(1)),
]


@pytest.mark.parametrize(("name", "values", "request_value"), REFUSED_RPCS)
async def test_a_refused_rpc_returns_false_on_the_wire_and_writes_nothing(
    name: str, values: dict[tuple[str, str], Any], request_value: object,
) -> None:
    """Each refusal in seed 002 "RPCs" returns the bool False itself, the RPC's declared result type
    (AgentSessionClient's bool() would hide a None, a client on the wire would not), and writes nothing."""
    flow = build_flow(None)
    loaded = {key: msgspec.json.encode(value) for key, value in values.items()}
    ctx = RpcContext(flow, "s", loaded, LoadOptions.all(), {}, name)
    assert await flow.rpc(name).handler(ctx, request_value) is False
    assert ctx.writes.empty()


async def test_resolve_interrupt_cuts_a_long_rejection_message_sent_past_the_client() -> None:
    """A rejection message over MAX_REJECTION_MESSAGE_CHARS sent to the resolve_interrupt RPC itself (by
    a client on the wire, past AgentSessionClient's own cut) is queued cut, with the note saying so:
    AwaitToolApproval stores and emits the message as the RPC queued it. Catches: the RPC queuing it
    whole, so the record and rejection event held all of it."""
    flow = build_flow(None)
    loaded = {("PendingInterrupts", ""): msgspec.json.encode([interrupt("w1")])}
    ctx = RpcContext(flow, "s", loaded, LoadOptions.all(), {}, "resolve_interrupt")
    longer = "n" * (MAX_REJECTION_MESSAGE_CHARS + 1)
    assert await flow.rpc("resolve_interrupt").handler(ctx, ResolveInterruptRequest("w1", False, longer)) is True
    [(_, _, data)] = ctx.writes.publishes
    assert msgspec.json.decode(data, type=AgentInterruptResolution).rejection_message == (
        f"{longer[:-1]} [Dex: cut from {MAX_REJECTION_MESSAGE_CHARS + 1} characters]")


async def test_answer_question_queues_the_answer_exactly_as_given() -> None:
    """answer_question queues AgentInterruptResolution(approved=True, answer) with the answer as the
    user gave it, its spaces and line breaks kept (seed 002 "RPCs"); only the blank check strips it.
    Catches: the answer queued stripped."""
    flow = build_flow(None)
    question = interrupt("q1", kind=InterruptKind.QUESTION)
    ctx = RpcContext(flow, "s", {("PendingInterrupts", ""): msgspec.json.encode([question])}, LoadOptions.all(), {},
                     "answer_question")
    answer = "  the second one,\nnot the first \n"
    assert await flow.rpc("answer_question").handler(ctx, AnswerQuestionRequest("q1", answer)) is True
    channel = INTERRUPT_RESOLUTIONS["q1"]
    assert [(name, key, msgspec.json.decode(data, type=AgentInterruptResolution))
            for name, key, data in ctx.writes.publishes] == [
        (channel.name, channel.key, AgentInterruptResolution(approved=True, rejection_message=None, answer=answer)),
    ]
    assert ctx.get(PENDING_INTERRUPTS) == []


async def test_the_snapshot_lists_only_the_active_turns_tool_calls() -> None:
    """get_agent_snapshot's tool_calls are the active turn's records (seed 002 "RPCs"), not records an
    earlier turn left stored (a turn that a run state too large to store ended keeps its records).
    Catches: every stored record listed."""
    flow = build_flow(None)
    loaded = {
        ("AgentState", ""): msgspec.json.encode(running_turn(active_turn_id="turn-2")),
        ("AgentToolCalls", "c1"): msgspec.json.encode(tool_call(AgentToolCallStatus.SUCCEEDED, output="old")),
        ("AgentToolCalls", "c2"): msgspec.json.encode(
            tool_call(AgentToolCallStatus.APPROVED, tool_call_id="c2", turn_id="turn-2")),
    }
    ctx = RpcContext(flow, "s", loaded, LoadOptions.all(), {}, "get_agent_snapshot")
    snapshot = await flow.rpc("get_agent_snapshot").handler(ctx, None)
    assert [(r.tool_call_id, r.turn_id) for r in snapshot.tool_calls] == [("c2", "turn-2")]


async def test_update_session_settings_on_the_wire_takes_settings_within_the_tolerance() -> None:
    """The update_session_settings RPC accepts settings up to MAX_SESSION_SETTINGS_BYTES plus
    SESSION_SETTINGS_SIZE_TOLERANCE_BYTES (seed 002 "RPCs"), as StartAgentSession does: a Client on
    another core may measure some values larger than Python does. Catches: the RPC checking the
    Client's limit, refusing what that Client checked and sent."""
    flow = build_flow(None)
    settings = _settings_of_size(MAX_SESSION_SETTINGS_BYTES + SESSION_SETTINGS_SIZE_TOLERANCE_BYTES)
    ctx = RpcContext(flow, "s", {("AgentState", ""): msgspec.json.encode(_WAITING)}, LoadOptions.all(), {},
                     "update_session_settings")
    assert await flow.rpc("update_session_settings").handler(ctx, UpdateSessionSettingsRequest(settings)) is True
    assert ctx.get(SESSION_SETTINGS) == settings


async def test_rpc_request_of_the_wrong_type_commits_nothing(tmp_path: Path) -> None:
    """A request that is not of the RPC's request type raises InvalidValueError naming the RPC and
    the field, and commits nothing; the interrupt it aimed at is still pending and resolvable."""
    async with in_process(tmp_path, build_flow(tmp_path)) as engine:
        sessions = engine.sessions
        before = await started_session(sessions, "s")
        assert await sessions.send_user_message("s", script({"tools": [{"id": "w1", "name": "write_x"}]},
                                                            {"answer": "{results}"}))
        interrupt = await wait_for_agent_snapshot(
            sessions, "s", lambda s: next(iter(s.pending_interrupts), None), description="the approval")
        await engine.stop_worker()  # nothing else writes while the refused calls run
        rows = await table_rows(engine.client)
        wrong: list[tuple[str, object, str]] = [
            ("resolve_interrupt", ResolveInterruptRequest("w1", "yes"), "$.approved"),  # type: ignore[arg-type]
            ("resolve_interrupt", "w1", "ResolveInterruptRequest"),
            ("send_user_message", AgentUserMessage(5), "$.text"),  # type: ignore[arg-type]
            ("send_user_message", AgentUserMessage("hi", plan_mode="no"), "$.plan_mode"),  # type: ignore[arg-type]
            ("list_agent_messages", ListAgentMessagesRequest(limit="5"), "$.limit"),  # type: ignore[arg-type]
            # Each field of every other request, of a kind its handler never reads: refused by its
            # type, not answered False (or failing in the handler) as if it were a refusal.
            ("list_agent_messages", ListAgentMessagesRequest(before_sequence="5"), "$.before_sequence"),  # type: ignore[arg-type]
            ("resolve_interrupt", ResolveInterruptRequest("w1", False, 5), "$.rejection_message"),  # type: ignore[arg-type]
            ("answer_question", AnswerQuestionRequest("w1", 5), "$.answer"),  # type: ignore[arg-type]
            ("answer_question", AnswerQuestionRequest(5, "yes"), "$.interrupt_id"),  # type: ignore[arg-type]
            ("execute_plan", ExecutePlanRequest("1"), "$.revision"),  # type: ignore[arg-type]
            ("steer_user_message", SteerUserMessageRequest(text=5), "$.text"),  # type: ignore[arg-type]
            ("steer_user_message", SteerUserMessageRequest(message_id=5), "$.message_id"),  # type: ignore[arg-type]
            ("delete_queued_message", DeleteQueuedMessageRequest(5), "$.message_id"),  # type: ignore[arg-type]
            ("cancel_turn", CancelTurnRequest(5), "$.turn_id"),  # type: ignore[arg-type]
        ]
        for name, request, where in wrong:
            with pytest.raises(InvalidValueError) as caught:
                await engine.client.rpc("s", name, request)
            assert f"request of RPC {name}" in str(caught.value) and where in str(caught.value)
        # The client refuses them itself, naming its parameter.
        with pytest.raises(TypeError, match=r"^approved must be a bool \(True or False\), got str: 'yes'$"):
            await sessions.resolve_interrupt("s", "w1", approved="yes")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"^plan_mode must be a bool \(True or False\), got int: 1$"):
            await sessions.send_user_message("s", "hi", plan_mode=1)  # type: ignore[arg-type]
        assert await table_rows(engine.client) == rows
        assert (await sessions.get_agent_snapshot("s")).pending_interrupts == [interrupt]

        await engine.start_worker()
        assert await sessions.resolve_interrupt("s", "w1", approved=True) is True
        snapshot = await turn_ended(sessions, "s", 2)
        assert snapshot.messages[-1].text == "w1=write_x done"
        await assert_usable(sessions, "s", before)


async def test_rpc_request_as_a_dict_is_refused_or_decoded(tmp_path: Path) -> None:
    """A dict shaped like the request type is either refused with InvalidValueError or handled as
    the request it encodes; the handler never sees the dict."""
    async with in_process(tmp_path, build_flow(tmp_path), worker=False) as engine:
        await engine.sessions.start_session("s")
        try:
            queued = await engine.client.rpc("s", "send_user_message", {"text": HELLO, "plan_mode": False})
        except InvalidValueError:
            return
        assert queued is True
        assert (await engine.sessions.get_agent_snapshot("s")).queued_message_count == 1


async def test_list_agent_messages_clamps_limit_and_before_sequence(tmp_path: Path) -> None:
    """list_agent_messages clamps the limit to 1..200 and treats before_sequence past the end as
    "after the newest"; paging with next_before_sequence reaches the oldest message."""
    async with in_process(tmp_path, flow_with(ManyMessagesRunner(tmp_path))) as engine:
        sessions = engine.sessions
        await sessions.start_session("s", "many")
        await turn_ended(sessions, "s", 1)
        total = MANY_ANSWERS + 1  # the user message, then the answers

        for limit in (0, -5):
            page = await sessions.list_agent_messages("s", limit=limit)
            assert [m.sequence for m in page.messages] == [total]
            assert page.next_before_sequence == total
        page = await sessions.list_agent_messages("s", limit=10_000)
        assert [m.sequence for m in page.messages] == list(range(total - 199, total + 1))
        assert page.next_before_sequence == total - 199 and page.deleted_before_sequence is None
        assert len((await sessions.get_agent_snapshot("s")).messages) == 200

        for before_sequence in (total + 1, 10_000):
            page = await sessions.list_agent_messages("s", before_sequence=before_sequence, limit=3)
            assert [m.sequence for m in page.messages] == [total - 2, total - 1, total]
        page = await sessions.list_agent_messages("s", before_sequence=1)
        assert page.messages == [] and page.next_before_sequence is None
        # The limit defaults to 50 (seed 002 "RPCs"): for a request without one, and for the client's
        # call without one, which sends its own default.
        default = await engine.client.rpc("s", "list_agent_messages", None)
        assert [m.sequence for m in default.messages] == list(range(total - 49, total + 1))
        assert await sessions.list_agent_messages("s") == default

        messages = await all_messages(sessions, "s")  # pages back with next_before_sequence
        assert [m.sequence for m in messages] == list(range(1, total + 1))
        await assert_usable(sessions, "s", messages)


async def test_calls_on_an_unknown_session_raise_flow_not_found(tmp_path: Path) -> None:
    """Every session call on an ID that was never started raises FlowNotFoundError and creates nothing."""
    async with in_process(tmp_path, build_flow(tmp_path), worker=False) as engine:
        sessions = engine.sessions
        calls = [
            sessions.get_agent_snapshot("missing"),
            sessions.list_agent_messages("missing"),
            sessions.send_user_message("missing", HELLO),
            sessions.resolve_interrupt("missing", "w1", approved=True),
            sessions.read_agent_events("missing"),
        ]
        for call in calls:
            with pytest.raises(FlowNotFoundError, match="'missing'"):
                await call
        assert not await engine.client.exists("missing")


async def test_a_stopped_session_deleted_through_the_engine_reads_as_unknown(
    tmp_path: Path, db_url: str  # noqa: F811 - the fixture
) -> None:
    """Seed 000: a stopped session stays readable for the retention period; once the engine deletes
    it (delete_flow, as retention does), every session call raises FlowNotFoundError naming it, as
    for an ID never started, also through a client that had read the session before. A running
    session is not deleted, and the ID starts a new session afterwards."""
    async with in_process(tmp_path, build_flow(tmp_path), database_url=db_url) as engine:
        sessions = engine.sessions
        await sessions.start_session("s", "first")
        await turn_ended(sessions, "s", 1)
        other = AgentSessionClient(AsyncClient(Registry([engine.flow]), store=engine.client.store), engine.flow)
        assert (await other.get_agent_snapshot("s")).messages  # it knows the session now
        with pytest.raises(FlowStillRunningError, match="'s' is still running; stop it first"):
            await engine.client.delete_flow("s")
        await engine.client.stop_flow("s", "closed by the test")
        assert (await sessions.get_agent_snapshot("s")).messages  # stopped: still readable

        assert await engine.client.delete_flow("s") is True

        for client in (sessions, other):
            for call in (client.get_agent_snapshot("s"), client.list_agent_messages("s"),
                         client.read_agent_events("s"), client.send_user_message("s", HELLO)):
                with pytest.raises(FlowNotFoundError, match="'s'"):
                    await call
        assert await engine.client.delete_flow("s") is False

        await sessions.start_session("s", "second")
        again = await turn_ended(sessions, "s", 1)
        assert "first" not in repr(again.messages) and "second" in repr(again.messages)


async def test_a_closed_session_still_serves_its_snapshot_and_messages_and_refuses_changes(tmp_path: Path) -> None:
    """Seed 003: get_agent_snapshot "Serves retained closed sessions", and list_agent_messages reads
    them too: a session stopped while an approval waits, and one force-failed at its start, still
    read as they were left. A change (a message, a resolution) raises FlowNotActiveError naming the
    session and its status, and changes nothing."""
    async with in_process(tmp_path, build_flow(tmp_path)) as engine:
        sessions = engine.sessions
        await sessions.start_session("s", "first")
        await turn_ended(sessions, "s", 1)
        assert await sessions.send_user_message("s", script({"tools": [{"id": "w1", "name": "write_x"}]},
                                                            {"answer": "{results}"}))
        waiting = await wait_for_agent_snapshot(sessions, "s", lambda snap: snap if snap.pending_interrupts else None,
                                                description="the write's approval")
        await engine.client.stop_flow("s", "closed by the test")
        assert (await engine.client.describe_flow("s")).status == "stopped"

        closed = await sessions.get_agent_snapshot("s")
        assert closed == waiting
        page = await sessions.list_agent_messages("s")
        assert page.messages == closed.messages and page.next_before_sequence is None
        with pytest.raises(FlowNotActiveError, match="'s' is stopped"):
            await sessions.send_user_message("s", HELLO)
        with pytest.raises(FlowNotActiveError, match="'s' is stopped"):
            await sessions.resolve_interrupt("s", closed.pending_interrupts[0].interrupt_id, approved=True)
        assert await sessions.get_agent_snapshot("s") == closed

        session_limit = MAX_SESSION_SETTINGS_BYTES + SESSION_SETTINGS_SIZE_TOLERANCE_BYTES
        await engine.client.start_flow(engine.flow.flow_type, "failed", AgentSessionStartInput(
            initial_message="first", session_settings=_settings_of_size(session_limit + 1)))
        assert (await engine.client.wait_for_flow("failed", 30)).status == "failed"
        empty = await sessions.get_agent_snapshot("failed")
        assert empty.state is None and empty.messages == [] and empty.pending_interrupts == []
        assert empty.usage == AgentUsage() and empty.tool_calls == [] and empty.queued_message_count == 0
        assert (await sessions.list_agent_messages("failed")).messages == []


# The same against a Worker child ------------------------------------------------------------------


async def test_bad_inputs_with_a_real_worker_child(stack: AgentTestStack) -> None:
    """Against a Worker child process: blank text is refused, a bad tool call ID fails its turn,
    non-object arguments fail only their call, and the session answers "hello" afterwards."""
    sessions = stack.sessions(stack.flows[0])  # type: ignore[arg-type]
    await stack.start_worker()
    before = await started_session(sessions, "s")
    assert await sessions.send_user_message("s", "   ") is False

    snapshot = await run_turn(sessions, "s", script({"tools": [{"id": "a/b", "name": "read_x"}]}))
    assert snapshot.state is not None and snapshot.state.last_turn_error is not None
    assert "tool call ID 'a/b' contains '/'" in snapshot.state.last_turn_error

    snapshot = await run_turn(sessions, "s", script({"tools": [{"id": "c1", "name": "read_x", "args_text": "[]"}]},
                                                    {"answer": "{results}"}))
    assert snapshot.state is not None and snapshot.state.last_turn_error is None
    assert snapshot.messages[-1].text == f"c1=The tool call failed: {ARGUMENTS_NOT_OBJECT}"
    log = InvocationLog(stack.state_dir / INVOCATIONS)
    assert log.count("tool_start") == 0
    assert executed_steps(await stack.read_step_history("s")).count("RunModel") == 4
    await assert_usable(sessions, "s", before)


# An answer that commits just before cancel_turn ----------------------------------------------------


@pytest.mark.parametrize("kind", ["answer", "approval"])
async def test_an_answer_committed_just_before_cancel_turn_is_applied_not_lost(tmp_path: Path, kind: str) -> None:
    """Seed 002, FinishTurnCancellation: a record whose answer committed first goes back to its
    waiting Step, which applies the answer. The answer's commit hands it to the waiting Step's wait;
    cancel_turn then cancels that Step before its Execute ran, which drops what its wait took (E9),
    so cancel_turn queues it again for the Step the call is sent back to."""
    flow = build_flow(tmp_path, built_in_tools=frozenset({BuiltInTool.ASK_USER}))
    async with in_process(tmp_path, flow) as engine:
        sessions = engine.sessions
        await started_session(sessions, "s")
        call = ({"id": "q", "name": "ask_user", "args": {"question": "color?"}} if kind == "answer"
                else {"id": "q", "name": "write_x"})
        assert await sessions.send_user_message("s", script({"tools": [call]}, {"answer": "{results}"}))
        await wait_for_agent_snapshot(sessions, "s", lambda s: s.pending_interrupts, description="the interrupt")
        await asyncio.sleep(0.3)  # the waiting Step's wait is registered
        await engine.stop_worker()  # so that nothing runs between the two commits
        if kind == "answer":
            assert await sessions.answer_question("s", "q", "blue") is True
        else:
            assert await sessions.resolve_interrupt("s", "q", approved=False, rejection_message="not now") is True
        assert await sessions.cancel_turn("s") is True
        await engine.start_worker()
        await turn_ended(sessions, "s", 2)
        events = await turn_events(sessions, "s", "turn-2")
        resolved = [p for t, p in events if t == "interrupt_resolved"]
        assert [(p["interrupt_id"], p["approved"]) for p in resolved] == [("q", kind == "answer")]
        finished = [p["status"] for t, p in events if t == "tool_call_finished"]
        assert finished == (["succeeded"] if kind == "answer" else ["rejected"])
        assert engine.log.count("tool_start") == 0


async def test_a_steered_turn_whose_runner_messages_do_not_fit_stores_the_steered_note(tmp_path: Path) -> None:
    """A write ran, then the turn was steered; the runner's unfinished-turn messages are over the
    value limit. The steered note stands in for them (seed 002: ApplyTurnControl stores a note when
    the runner stores no messages). Catches: neither stored, the next turn's model never told that
    the write ran."""
    from agents.tests.scripted_agent import IncrementalScriptedRunner

    from dex_agents import RunModelLimit, ToolPolicy
    from dex_agents._policy import STEERED_NOTE_HEADER
    from dex_agents.testing import FileGate

    class HugeUnfinished(IncrementalScriptedRunner):
        def build_unfinished_turn_messages(self, turn: AgentTurnContext) -> list[FrameworkMessage]:
            return [item(MessageRole.TOOL, tool_call_id="c1", tool_name="write_x", output="y" * (MAX_VALUE_BYTES + 10))]

    flow = AgentSessionFlow(HugeUnfinished(tmp_path), FLOW_TYPE, AgentSessionOptions(
        tool_policies={"write_x": ToolPolicy(ToolEffect.NON_IDEMPOTENT_WRITE, requires_approval=False)},
        run_model_limit=RunModelLimit(max_attempts=1)))
    script = {"steps": [{"tools": [{"id": "c1", "name": "write_x", "args": {"gate": "g", "output": "paid"}}]},
                        {"answer": "done"}]}
    async with in_process(tmp_path, flow) as engine:
        sessions = engine.sessions
        await sessions.start_session("s", json.dumps(script))
        gate = FileGate(tmp_path, "g")
        await gate.wait_until_reached()
        assert await sessions.steer_user_message("s", text="hello")
        gate.release()
        await turn_ended(sessions, "s", 2)
        texts = [m.text or "" for m in await all_messages(sessions, "s")]
    (note,) = [t for t in texts if t.startswith(STEERED_NOTE_HEADER)]
    assert "write_x" in note and "succeeded: paid" in note


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no text")


async def test_a_turn_error_whose_text_cannot_be_made_fails_the_turn_once(tmp_path: Path) -> None:
    """Catches: str() of the runner's turn_error raising in RunModel's commit, which repeated the
    paid model call three times."""
    runner = MisbehavingRunner(tmp_path, {"odd": lambda: TurnCompleted([_PARTIAL], _USAGE, turn_error=_Unprintable())})
    async with in_process(tmp_path, flow_with(runner)) as engine:
        sessions = engine.sessions
        before = await started_session(sessions, "s")
        turn_id, error = await failed_turn(sessions, "s", f"{MISBEHAVE} odd")
        assert error == "(a _Unprintable whose text could not be made: RuntimeError)"
        assert engine.log.count("model", turn_id=turn_id) == 1
        await assert_usable(sessions, "s", await all_messages(sessions, "s"))
        assert before
