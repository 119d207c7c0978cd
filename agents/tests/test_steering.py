"""Steering: steer_user_message, delete_queued_message, ApplyTurnControl, and the steered flag at every
boundary (seed 002 "Steering and cancellation rules"; seed 003 "Steering and turn cancellation").

Most tests drive the scripted runner (agents/tests/scripted_agent.py) in one Worker child shared by
the module, each test with its own session; FileGates hold a model call or a tool while the test
steers, and the Step shape comes from the Flow's history. A few tests call a Step or RPC handler on
a built context, to pin down a boundary a live Worker cannot be made to hit on purpose (RunModel
finding its turn steered before the call, a Worker without steering). The pure rules are tested
as functions.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import types
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import msgspec
import pytest
import pytest_asyncio
from agents.tests.built_context import running_turn, runtime_of, step_context, tool_call
from agents.tests.conftest import REPO_ROOT, WORKER_MODULE
from agents.tests.scripted_agent import ENV_BUILT_IN_TOOLS, ENV_INCREMENTAL, build_flow
from agents.tests.session_driver import Session
from engine.tests.conftest import db_url, pg_database, pg_databases  # noqa: F401 - the fixtures used here

from dex_agents import (
    AGENT_MESSAGES,
    AGENT_STATE,
    AGENT_TOOL_CALLS,
    APPLIED_STEERED_MESSAGE_COUNT,
    APPLY_TURN_CONTROL,
    AWAIT_QUESTION_ANSWER,
    AWAIT_USER_MESSAGE,
    INTERRUPT_RESOLUTIONS,
    PENDING_INTERRUPTS,
    RECORD_TURN_FAILURE,
    RUN_MODEL,
    STEERED_REJECTION_MESSAGE,
    STEERED_USER_MESSAGES,
    TOOL_CALL_CANCELLATIONS,
    TURN_CANCELLED_REJECTION_MESSAGE,
    TURN_CONTROL_REQUESTS,
    AgentEvent,
    AgentInterrupt,
    AgentSessionFlow,
    AgentSessionOptions,
    AgentSnapshot,
    AgentState,
    AgentStatus,
    AgentToolCall,
    AgentToolCallStatus,
    AgentUserMessage,
    BuiltInTool,
    CancellationReason,
    DeleteQueuedMessageRequest,
    InteractionMode,
    InterruptKind,
    MessageRole,
    PendingUserMessage,
    SteerUserMessageRequest,
    ToolCallCancellation,
    ToolEffect,
    TurnCancellationRequest,
    message_sequence_key,
)
from dex_agents._builtin_steps import BuiltInSteps
from dex_agents._constants import CUT_NOTE_FIELD_CHARS, MAX
from dex_agents._control_steps import (
    ControlSteps,
    TurnControl,
    answer_first_wait,
    channel_message_id,
    controlled_turn_note,
    is_abandonable,
    is_answer_first_wait,
    steer_abandonments,
    steer_request_ok,
    turn_control_of,
)
from dex_agents._policy import STEERED_NOTE_HEADER, TOOL_CALL_NOTE_FOOTER
from dex_agents._timefmt import format_time
from dex_agents._tool_steps import ToolSteps
from dex_agents._turn_steps import TurnSteps
from dex_agents.testing import (
    AgentTestStack,
    wait_until,
)
from dex_engine import MAX_VALUE_BYTES, Context, LoadOptions, RpcContext, RPCResult, Timer, Wait, WaitResult
from dex_engine._records import ConsumedMessage, WaitOutcome

# The integration tests share the module's event loop with the shared stacks' Clients.
shared_loop = pytest.mark.asyncio(loop_scope="module")

BUILT_INS = frozenset({BuiltInTool.ASK_USER, BuiltInTool.DURABLE_WAIT})
BUILT_IN_ENV = ",".join(sorted(BUILT_INS))
RACE_ROUNDS = 20
RACE_MAX_ROUNDS = 40


# Shared stacks: one Worker child per runner kind, started when the module starts ----------------


def _stack(tmp: Any, *, incremental: bool) -> AgentTestStack:
    env = {ENV_BUILT_IN_TOOLS: BUILT_IN_ENV}
    if incremental:
        env[ENV_INCREMENTAL] = "1"
    flow = build_flow(tmp, incremental=incremental, built_in_tools=BUILT_INS)
    return AgentTestStack(tmp, [flow], WORKER_MODULE, worker_cwd=REPO_ROOT, worker_env=env)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stacks(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[dict[str, AgentTestStack]]:
    """The plain runner (stores a turn's items at its end) and the incremental one, each with a Worker."""
    async with _stack(tmp_path_factory.mktemp("plain"), incremental=False) as plain, \
            _stack(tmp_path_factory.mktemp("incremental"), incremental=True) as incremental:
        await asyncio.gather(plain.start_worker(), incremental.start_worker())
        yield {"plain": plain, "incremental": incremental}


def session_of(request: pytest.FixtureRequest, stack: AgentTestStack) -> Session:
    name = request.node.name.replace("[", "-").replace("]", "")
    return Session(stack, name)


@pytest.fixture
def plain(request: pytest.FixtureRequest, stacks: dict[str, AgentTestStack]) -> Session:
    return session_of(request, stacks["plain"])


@pytest.fixture
def incremental(request: pytest.FixtureRequest, stacks: dict[str, AgentTestStack]) -> Session:
    return session_of(request, stacks["incremental"])


def script(*steps: dict[str, Any]) -> str:
    return json.dumps({"steps": list(steps)})


def records_by_id(snapshot: AgentSnapshot) -> dict[str, AgentToolCall]:
    return {r.tool_call_id: r for r in snapshot.tool_calls}


def note_of(snapshot: AgentSnapshot, turn_id: str) -> str | None:
    """The note a steered or cancelled turn stored: its user message after the first."""
    users = [m for m in snapshot.messages if m.turn_id == turn_id and m.role is MessageRole.USER]
    return users[1].text if len(users) > 1 else None


def user_texts(snapshot: AgentSnapshot, turn_id: str) -> list[str | None]:
    return [m.text for m in snapshot.messages if m.turn_id == turn_id and m.role is MessageRole.USER]


# The pure rules ----------------------------------------------------------------------------------


def _interrupt(
    interrupt_id: str, tool_call_id: str, kind: InterruptKind = InterruptKind.TOOL_APPROVAL
) -> AgentInterrupt:
    return AgentInterrupt(interrupt_id=interrupt_id, kind=kind, tool_call_id=tool_call_id, tool_name="t",
                          arguments="{}", created_at="2026-01-01T00:00:00.000Z", deadline=None)


@pytest.mark.parametrize("status", list(AgentToolCallStatus))
@pytest.mark.parametrize("task_id", [None, "task-1"])
def test_one_predicate_decides_what_steering_may_abandon(status: AgentToolCallStatus, task_id: str | None) -> None:
    """Only a wait that took no effect: awaiting_approval, awaiting_answer or waiting_for_timer with no
    task_id. Never a started task (its question included), an approved call, or a final record."""
    expected = task_id is None and status in {
        AgentToolCallStatus.AWAITING_APPROVAL, AgentToolCallStatus.AWAITING_ANSWER,
        AgentToolCallStatus.WAITING_FOR_TIMER,
    }
    assert is_abandonable(tool_call(status, task_id=task_id)) is expected


def test_the_two_flags_come_from_committed_state_of_the_active_turn() -> None:
    """Steered while more steered messages were published than applied; cancelled while
    TurnCancellationRequest names the turn; both only for the active turn; cancelled wins."""
    state = AgentState(status=AgentStatus.RUNNING_TOOLS, turn_count=0, active_turn_id="turn-1",
                       next_message_sequence=2, last_turn_error=None, accepts_turn_control=True)
    cancel = TurnCancellationRequest(turn_id="turn-1", requested_at="2026-01-01T00:00:00.000Z")
    other = TurnCancellationRequest(turn_id="turn-0", requested_at="2026-01-01T00:00:00.000Z")

    def of(turn_id: str | None = "turn-1", **kw: Any) -> Any:
        args: dict[str, Any] = {"state": state, "cancellation": None, "steered_count": 0, "applied_count": 0, **kw}
        return turn_control_of(turn_id, **args)

    assert of().reason is None
    steered = of(steered_count=3, applied_count=1)
    assert (steered.steered, steered.cancelled, steered.steered_message_count) == (True, False, 2)
    assert steered.reason is CancellationReason.STEERED
    assert of(steered_count=2, applied_count=2).reason is None  # every steered message applied
    cancelled = of(cancellation=cancel)
    # Only cancelled: ResumeTurn abandons waits only for a steer (steered and not cancelled).
    assert (cancelled.steered, cancelled.cancelled, cancelled.steered_message_count) == (False, True, 0)
    assert cancelled.reason is CancellationReason.TURN_CANCELLED
    # More applied than published (never committed so, but a count is never negative): not steered.
    assert of(steered_count=1, applied_count=2) == TurnControl()
    assert of(cancellation=other).reason is None  # an earlier turn's cancellation
    both = of(cancellation=cancel, steered_count=1)
    assert (both.steered, both.cancelled, both.reason) == (True, True, CancellationReason.TURN_CANCELLED)
    assert of("turn-2", cancellation=cancel, steered_count=1).reason is None  # not the active turn
    assert of(None, steered_count=1).reason is None
    # No turn is active when none is named either: a waiting steer starts the next turn, it steers none.
    idle = msgspec.structs.replace(state, active_turn_id=None, status=AgentStatus.WAITING_FOR_USER_MESSAGE)
    assert of(None, state=idle, steered_count=1).reason is None
    assert turn_control_of("turn-1", state=None, cancellation=cancel, steered_count=1, applied_count=0).reason is None


def test_a_steer_removes_pending_interrupts_and_wakes_only_abandonable_calls() -> None:
    """ResumeTurn on a steer: an approval and a question with a pending interrupt lose it and are
    woken; every durable wait is woken; an answered approval (interrupt gone), a started task's
    question, an approved call and a final record are left alone."""
    records = [
        tool_call(AgentToolCallStatus.AWAITING_APPROVAL, tool_call_id="a", deferral_order=0),
        tool_call(AgentToolCallStatus.AWAITING_ANSWER, tool_call_id="q", deferral_order=1, input_question="Q?"),
        tool_call(AgentToolCallStatus.WAITING_FOR_TIMER, tool_call_id="w", deferral_order=2),
        tool_call(AgentToolCallStatus.AWAITING_APPROVAL, tool_call_id="answered", deferral_order=3),
        tool_call(AgentToolCallStatus.AWAITING_ANSWER, tool_call_id="task", deferral_order=4, task_id="t1"),
        tool_call(AgentToolCallStatus.APPROVED, tool_call_id="run", deferral_order=5),
        tool_call(AgentToolCallStatus.SUCCEEDED, tool_call_id="done", deferral_order=6),
    ]
    pending = [_interrupt("a", "a"), _interrupt("q-input-1", "q", InterruptKind.QUESTION),
               _interrupt("task-input-1", "task", InterruptKind.QUESTION)]
    removed, woken = steer_abandonments(reversed(records), pending)
    assert [i.interrupt_id for i in removed] == ["a", "q-input-1"]
    assert woken == ["a", "q", "w"]


@pytest.mark.parametrize(("request_fields", "ok"), [
    ({"text": "go"}, True), ({"message_id": "7"}, True), ({}, False), ({"text": "go", "message_id": "7"}, False),
    ({"text": "  \n"}, False), ({"text": ""}, False),
])
def test_steer_request_needs_exactly_one_of_text_and_message_id(request_fields: dict[str, Any], ok: bool) -> None:
    """Both or neither field, or blank text, is refused before anything is read."""
    assert steer_request_ok(SteerUserMessageRequest(**request_fields)) is ok


def test_channel_message_ids_are_decimal_text() -> None:
    assert channel_message_id("42") == 42
    assert [channel_message_id(t) for t in ("", "-1", "4.2", "x", "١٢")] == [None] * 5
    # Catches: "01" acting on queued message 1, which the snapshot shows as "1".
    assert [channel_message_id(t) for t in ("01", "0000000000000000002", "00")] == [None] * 3
    assert channel_message_id("0") == 0


def test_steered_note_lists_final_calls_in_deferral_order() -> None:
    """The note has the turn-failure note's lines and footer under the steered header; None without records."""
    records = [
        tool_call(AgentToolCallStatus.REJECTED, tool_call_id="b", deferral_order=1, tool_name="write",
                rejection_message=STEERED_REJECTION_MESSAGE),
        tool_call(AgentToolCallStatus.SUCCEEDED, tool_call_id="a", deferral_order=0, tool_name="read", output="ok"),
    ]
    assert controlled_turn_note(records, CancellationReason.STEERED) == "\n".join([
        STEERED_NOTE_HEADER, "- read {} -> succeeded: ok", f"- write {{}} -> rejected: {STEERED_REJECTION_MESSAGE}",
        TOOL_CALL_NOTE_FOOTER,
    ])
    assert controlled_turn_note([], CancellationReason.STEERED) is None
    assert STEERED_REJECTION_MESSAGE == '{"status":"cancelled","reason":"superseded_by_steered_user_message"}'
    assert TURN_CANCELLED_REJECTION_MESSAGE == '{"status":"cancelled","reason":"turn_cancelled_by_user"}'


# Steering through a live Worker --------------------------------------------------------------------


@shared_loop
async def test_steer_during_a_model_call_that_answers_completes_the_turn_then_starts_the_steered_one(
    plain: Session,
) -> None:
    """A running model call is never cancelled: its final answer completes the turn (turn_completed,
    no turn_steered), and the steer starts the next turn through AwaitUserMessage's control wake:
    StartAgentSession, RunModel, AwaitUserMessage, ApplyTurnControl, RunModel."""
    await plain.start(script({"gate": plain.gate_name("model"), "answer": "first answer"}))
    await plain.gate("model").wait_until_reached()
    assert await plain.sessions.steer_user_message(plain.id, text="and then this")
    snapshot = await plain.snapshot()
    assert [m.message for m in snapshot.steered_messages] == [AgentUserMessage("and then this")]
    assert snapshot.steered_messages[0].message_id.isdigit() and snapshot.queued_messages == []
    assert snapshot.state is not None and snapshot.state.accepts_turn_control  # set when the turn began
    plain.gate("model").release()
    done = await plain.turns_ended(2)
    assert [(m.role, m.text) for m in done.messages[1:]] == [
        (MessageRole.ASSISTANT, "first answer"), (MessageRole.USER, "and then this"),
        (MessageRole.ASSISTANT, "echo: and then this"),
    ]
    assert done.steered_messages == []
    assert plain.log.count("model", flow_id=plain.id, turn_id="turn-1") == 1
    assert [e.turn_id for e, _ in await plain.events("turn_completed")] == ["turn-1", "turn-2"]
    assert await plain.events("turn_steered") == []
    assert await plain.steps() == ["StartAgentSession", "RunModel", "AwaitUserMessage", "ApplyTurnControl", "RunModel"]


@shared_loop
async def test_a_steer_beats_a_message_queued_before_it_when_the_turn_completes(plain: Session) -> None:
    """Seed 002, AwaitUserMessage: Channel conditions are selected in argument order, so a steer beats
    a queued message. Both sent during a model call that answers: the steer starts turn 2 (through
    ApplyTurnControl), the queued message turn 3, though it was sent first."""
    await plain.start(script({"gate": plain.gate_name("model"), "answer": "first answer"}))
    await plain.gate("model").wait_until_reached()
    assert await plain.sessions.send_user_message(plain.id, "queued A")
    assert await plain.sessions.steer_user_message(plain.id, text="steer B")
    plain.gate("model").release()
    done = await plain.turns_ended(3)
    assert user_texts(done, "turn-2") == ["steer B"]
    assert user_texts(done, "turn-3") == ["queued A"]
    assert await plain.events("turn_steered") == []  # turn 1 completed with its answer


@shared_loop
@pytest.mark.parametrize("control", ["steer", "cancel"])
async def test_a_steered_or_cancelled_turn_clears_the_last_turns_error(plain: Session, control: str) -> None:
    """Seed 002, ApplyTurnControl: it counts the turn and clears last_turn_error. A turn that failed,
    then one that is steered or cancelled: the error is gone once the controlled turn ended."""
    await plain.start(script({"turn_error": "the first turn failed"}))
    failed = await plain.turns_ended(1)
    assert failed.state is not None and failed.state.last_turn_error == "the first turn failed"
    calls = [{"id": "c1", "name": "read_orders", "args": {}}]
    assert await plain.sessions.send_user_message(
        plain.id, script({"gate": plain.gate_name("model"), "tools": calls}, {"answer": "unreachable"}))
    await plain.gate("model").wait_until_reached()
    if control == "steer":
        # The steered turn's model call waits at a gate of its own, so the state ApplyTurnControl
        # left is what the snapshot shows (no later commit has cleared the error for it).
        steered = script({"gate": plain.gate_name("steered"), "answer": "steered answer"})
        assert await plain.sessions.steer_user_message(plain.id, text=steered)
    else:
        assert await plain.sessions.cancel_turn(plain.id)
    plain.gate("model").release()
    if control == "steer":
        await plain.gate("steered").wait_until_reached()
        ended = await plain.snapshot()
        assert ended.state is not None and (ended.state.turn_count, ended.state.active_turn_id) == (2, "turn-3")
        plain.gate("steered").release()
    else:
        ended = await plain.turns_ended(2)
    assert ended.state is not None and ended.state.last_turn_error is None
    event = "turn_steered" if control == "steer" else "turn_cancelled"
    assert [e.turn_id for e, _ in await plain.events(event)] == ["turn-2"]


@shared_loop
async def test_tools_requested_by_a_model_call_that_was_steered_never_start(plain: Session) -> None:
    """A steer during the model call applies at the tool Steps it requested: CallTool records the
    read cancelled before tool_call_started, the approval is abandoned, and ApplyTurnControl ends
    the turn with the steered note, writes turn_steered, and starts the steered turn."""
    calls = [{"id": "c1", "name": "read_orders", "args": {}}, {"id": "c2", "name": "write_refund", "args": {}}]
    await plain.start(script({"gate": plain.gate_name("model"), "tools": calls}, {"answer": "unreachable"}))
    await plain.gate("model").wait_until_reached()
    assert await plain.sessions.steer_user_message(plain.id, text="never mind")
    plain.gate("model").release()
    done = await plain.turns_ended(2)
    assert plain.tool_starts() == 0  # neither tool ran
    note = note_of(done, "turn-1")
    assert note == "\n".join([
        STEERED_NOTE_HEADER, f"- read_orders {{}} -> rejected: {STEERED_REJECTION_MESSAGE}",
        f"- write_refund {{}} -> rejected: {STEERED_REJECTION_MESSAGE}", TOOL_CALL_NOTE_FOOTER,
    ])
    assert user_texts(done, "turn-2") == ["never mind"] and done.messages[-1].text == "echo: never mind"
    [(_, steered)] = await plain.events("turn_steered")
    assert steered == {"steered_message_count": 1, "message_count": 1}
    resolved = [p for _, p in await plain.events("interrupt_resolved")]
    assert resolved == [{"interrupt_id": "c2", "approved": False, "rejection_message": STEERED_REJECTION_MESSAGE,
                         "kind": "tool_approval", "answered": False, "cancellation_reason": "steered"}]
    finished = {p["tool_call_id"]: p["status"] for _, p in await plain.events("tool_call_finished")}
    assert finished == {"c1": "rejected", "c2": "rejected"}
    steps = await plain.steps()
    assert steps[:2] == ["StartAgentSession", "RunModel"] and steps[-2:] == ["ApplyTurnControl", "RunModel"]
    middle = steps[2:-2]
    assert middle.count("CallTool") == 1 and "AwaitToolApproval" in middle and "ResumeTurn" in middle
    assert "CallSingleAttemptTool" not in middle and middle[-1] == "ResumeTurn"


@shared_loop
async def test_steer_abandons_every_wait_that_took_no_effect_and_a_started_tool_runs_to_the_end(
    plain: Session,
) -> None:
    """While a read tool runs (held at a gate), a steer makes ResumeTurn remove the pending approval,
    ask_user and tool-question interrupts (interrupt_resolved with cancellation_reason steered) and
    wake the durable wait; each call records rejected with cancellation_reason steered and the
    structured message. The started tool finishes, and only then does the turn end steered."""
    calls = [
        {"id": "c1", "name": "read_slow", "args": {"gate": plain.gate_name("c1")}},
        {"id": "c2", "name": "write_refund", "args": {}},
        {"id": "c3", "name": "ask_user", "args": {"question": "Which order?"}},
        {"id": "c4", "name": "durable_wait", "args": {"duration_seconds": 3600, "reason": "cool down"}},
        {"id": "c5", "name": "read_lookup", "args": {"ask": "Which account?"}},
    ]
    await plain.start(script({"tools": calls}, {"answer": "unreachable"}))
    await plain.gate("c1").wait_until_reached()
    await plain.interrupts("c2", "c3", "c5-input-1")
    assert await plain.sessions.steer_user_message(plain.id, text="stop waiting")

    def abandoned(s: AgentSnapshot) -> AgentSnapshot | None:
        records = records_by_id(s)
        done = all(records[i].status is AgentToolCallStatus.REJECTED for i in ("c2", "c3", "c4", "c5"))
        return s if done and not s.pending_interrupts else None

    snapshot = await plain.wait_for(abandoned, "the waits to be abandoned")
    records = records_by_id(snapshot)
    for call_id in ("c2", "c3", "c4", "c5"):
        record = records[call_id]
        assert (record.cancellation_reason, record.rejection_message) == (
            CancellationReason.STEERED, STEERED_REJECTION_MESSAGE), record
        assert record.input_question is None
    assert records["c1"].status is AgentToolCallStatus.APPROVED  # started: steering leaves it running
    assert snapshot.state is not None and snapshot.state.active_turn_id == "turn-1"
    # Answering after the steer took the interrupts returns False and changes nothing.
    assert not await plain.sessions.answer_question(plain.id, "c3", "order 7")
    assert not await plain.sessions.resolve_interrupt(plain.id, "c2", approved=True)
    resolved = {p["interrupt_id"]: p for _, p in await plain.events("interrupt_resolved")}
    assert set(resolved) == {"c2", "c3", "c5-input-1"}
    assert {(p["kind"], p["cancellation_reason"], p["rejection_message"], p["approved"])
            for p in resolved.values()} == {
        ("tool_approval", "steered", STEERED_REJECTION_MESSAGE, False),
        ("question", "steered", STEERED_REJECTION_MESSAGE, False),
    }
    plain.gate("c1").release()
    done = await plain.turns_ended(2)
    note = note_of(done, "turn-1")
    assert note is not None and note.splitlines()[0] == STEERED_NOTE_HEADER
    assert note.splitlines()[1] == "- read_slow " + json.dumps({"gate": plain.gate_name("c1")}) + \
        " -> succeeded: read_slow done"
    assert sum(STEERED_REJECTION_MESSAGE in line for line in note.splitlines()) == 4
    assert user_texts(done, "turn-2") == ["stop waiting"]
    assert plain.tool_starts("c1") == 1 and plain.tool_starts("c2") == 0
    assert plain.tool_starts("c5") == 1  # asked its question, then never ran again
    steps = await plain.steps()
    assert steps.count("AwaitTimer") == 1 and steps.count("ApplyTurnControl") == 1
    assert steps[-2:] == ["ApplyTurnControl", "RunModel"] and "CallSingleAttemptTool" not in steps


@shared_loop
async def test_a_steered_queued_message_moves_in_order_and_a_steer_beats_a_queued_message(plain: Session) -> None:
    """steer_user_message with a queued message's ID deletes it from the queue and steers with it;
    steered messages start the next turn together, in order (turn_steered counts both), before the
    message still queued, which starts the turn after. delete_queued_message removes one."""
    calls = [{"id": "c1", "name": "read_orders", "args": {}}]
    await plain.start(script({"gate": plain.gate_name("model"), "tools": calls}, {"answer": "unreachable"}))
    await plain.gate("model").wait_until_reached()
    for text in ("queued A", "queued B", "queued C"):
        assert await plain.sessions.send_user_message(plain.id, text)
    queued = (await plain.snapshot()).queued_messages
    assert [q.message.text for q in queued] == ["queued A", "queued B", "queued C"]
    assert await plain.sessions.steer_user_message(plain.id, message_id=queued[1].message_id)
    assert await plain.sessions.delete_queued_message(plain.id, queued[2].message_id)
    assert await plain.sessions.steer_user_message(plain.id, text="steer C")
    snapshot = await plain.snapshot()
    assert snapshot.queued_messages == [queued[0]] and snapshot.queued_message_count == 1
    assert [m.message.text for m in snapshot.steered_messages] == ["queued B", "steer C"]
    # Neither a consumed (steered or deleted) message nor an unknown ID can be moved or deleted again.
    for message_id in (queued[1].message_id, queued[2].message_id, "999999", "not-an-id"):
        assert not await plain.sessions.steer_user_message(plain.id, message_id=message_id)
        assert not await plain.sessions.delete_queued_message(plain.id, message_id)
    plain.gate("model").release()
    done = await plain.turns_ended(3)
    assert user_texts(done, "turn-2") == ["queued B", "steer C"]
    assert user_texts(done, "turn-3") == ["queued A"]
    assert done.messages[-1].text == "echo: queued A"
    [(event, steered)] = await plain.events("turn_steered")
    assert event.turn_id == "turn-1" and steered == {"steered_message_count": 2, "message_count": 1}
    assert plain.tool_starts() == 0


@shared_loop
async def test_steer_while_no_turn_is_active_queues_the_text(plain: Session) -> None:
    """With no active turn there is nothing to steer: the text is queued like send_user_message and
    starts the next turn at once, through AwaitUserMessage's queued-message wake."""
    await plain.start(None)
    await plain.wait_for(lambda s: s.state is not None, "the session to start")
    assert await plain.sessions.steer_user_message(plain.id, text="hello")
    done = await plain.turns_ended(1)
    assert [m.text for m in done.messages] == ["hello", "echo: hello"]
    assert await plain.events("turn_steered") == []
    assert await plain.steps() == ["StartAgentSession", "AwaitUserMessage", "RunModel"]


@shared_loop
async def test_bad_steer_and_delete_requests_change_nothing(plain: Session) -> None:
    """Both or neither field, blank text, and unknown or malformed message IDs return False and
    leave the queues and the running turn alone."""
    await plain.start(script({"gate": plain.gate_name("model"), "answer": "done"}))
    await plain.gate("model").wait_until_reached()
    assert await plain.sessions.send_user_message(plain.id, "queued")
    queued = (await plain.snapshot()).queued_messages
    bad = [
        {}, {"text": "x", "message_id": queued[0].message_id}, {"text": ""}, {"text": " \t\n"},
        {"message_id": "123456789"}, {"message_id": ""}, {"message_id": "abc"},
    ]
    for fields in bad:
        assert not await plain.sessions.steer_user_message(plain.id, **fields), fields
    assert not await plain.sessions.delete_queued_message(plain.id, "123456789")
    snapshot = await plain.snapshot()
    assert snapshot.queued_messages == queued and snapshot.steered_messages == []
    plain.gate("model").release()
    done = await plain.turns_ended(2)
    assert [m.text for m in done.messages[1:]] == ["done", "queued", "echo: queued"]
    assert await plain.events("turn_steered") == []


@shared_loop
async def test_a_runner_with_unfinished_turn_messages_keeps_the_steered_turn_transcript(incremental: Session) -> None:
    """ApplyTurnControl stores the runner's unfinished-turn messages instead of the note: the stored
    tool call request plus the tool result of each final record; message_count counts them."""
    calls = [{"id": "c1", "name": "write_refund", "args": {}}]
    await incremental.start(script({"tools": calls}, {"answer": "unreachable"}))
    await incremental.interrupts("c1")
    assert await incremental.sessions.steer_user_message(incremental.id, text="change of plan")
    done = await incremental.turns_ended(2)
    turn_1 = [m for m in done.messages if m.turn_id == "turn-1"]
    assert [m.role for m in turn_1] == [MessageRole.USER, MessageRole.ASSISTANT, MessageRole.TOOL]
    assert turn_1[2].tool_output == STEERED_REJECTION_MESSAGE
    assert not any(STEERED_NOTE_HEADER in (m.text or "") for m in done.messages)
    [(_, steered)] = await incremental.events("turn_steered")
    assert steered == {"steered_message_count": 1, "message_count": 2}
    assert user_texts(done, "turn-2") == ["change of plan"]


@shared_loop
async def test_a_stale_cancellation_wake_changes_nothing_in_a_turn_that_is_not_steered(plain: Session) -> None:
    """ToolCallCancellations only wakes: a wake left for a reused call ID in a turn that is neither
    steered nor cancelled makes AwaitToolApproval and AwaitTimer wait again; the approval then
    runs its tool and the wait completes as usual."""
    calls = [{"id": "c1", "name": "write_refund", "args": {}},
             {"id": "c2", "name": "durable_wait", "args": {"duration_seconds": 1, "reason": "r"}}]
    await plain.start(script({"tools": calls}, {"answer": "{results}"}))
    await plain.interrupts("c1")
    for call_id in ("c1", "c2"):
        await plain.stack.client.publish(plain.id, TOOL_CALL_CANCELLATIONS[call_id],
                                         ToolCallCancellation(CancellationReason.STEERED))

    async def woken() -> bool:
        return (await plain.steps()).count("AwaitToolApproval") >= 1

    await wait_until("the stale wake to be consumed", woken)
    snapshot = await plain.interrupts("c1")  # still pending: nothing was abandoned
    assert records_by_id(snapshot)["c1"].status is AgentToolCallStatus.AWAITING_APPROVAL
    assert await plain.sessions.resolve_interrupt(plain.id, "c1", approved=True)
    done = await plain.turns_ended(1)
    assert done.messages[-1].text == "c1=write_refund done; " + "c2=" + json.dumps(
        {"status": "completed", "waited_seconds": 1, "reason": "r"}, separators=(",", ":"))
    assert plain.tool_starts("c1") == 1
    steps = await plain.steps()
    assert steps.count("AwaitToolApproval") == 2  # the stale wake, then the approval
    assert "ApplyTurnControl" not in steps


@shared_loop
async def test_answer_and_steer_race_either_answers_or_abandons_the_question(plain: Session) -> None:
    """answer_question and steer_user_message issued together, many rounds: either the answer commits
    first (True, and ask_user records it as its result) or ResumeTurn removes the interrupt first
    (False, and the call is rejected as steered). Both orders happen; every round is one or the other."""
    rng = random.Random(20260501)

    async def one_round(n: int) -> tuple[bool, str]:
        session = Session(plain.stack, f"{plain.id}-{n}")
        calls = [{"id": "q", "name": "ask_user", "args": {"question": "Which?"}}]
        await session.start(script({"tools": calls}, {"answer": "unreachable"}))
        await session.interrupts("q")
        steer_first = rng.random() < 0.5
        delay = rng.choice([0.0, 0.01, 0.05, 0.2, 0.5])

        async def answer() -> bool:
            if steer_first:
                await asyncio.sleep(delay)
            return await session.sessions.answer_question(session.id, "q", "the red one")

        async def steer() -> bool:
            if not steer_first:
                await asyncio.sleep(delay)
            return await session.sessions.steer_user_message(session.id, text="forget it")

        answered, steered = await asyncio.gather(answer(), steer())
        assert steered
        done = await session.turns_ended(2)
        [(_, finished)] = await session.events("tool_call_finished")
        # What the next model input carries for the call: the steered note, or (when the answer's
        # result reached ResumeTurn before the steer) the tool result of a turn that completed.
        seen = " ".join(f"{m.text} {m.tool_output}" for m in done.messages if m.turn_id == "turn-1")
        if answered:
            assert finished["status"] == "succeeded"
            assert '{"status":"answered","answer":"the red one"}' in seen
        else:
            assert finished["status"] == "rejected"
            assert f"-> rejected: {STEERED_REJECTION_MESSAGE}" in (note_of(done, "turn-1") or "")
        assert user_texts(done, "turn-2") == ["forget it"]
        return answered, finished["status"]

    outcomes: list[tuple[bool, str]] = []
    rounds = 0
    while rounds < RACE_ROUNDS or (len({a for a, _ in outcomes}) < 2 and rounds < RACE_MAX_ROUNDS):
        batch = list(range(rounds, rounds + 10))
        outcomes.extend(await asyncio.gather(*(one_round(n) for n in batch)))
        rounds += len(batch)
    assert {answered for answered, _ in outcomes} == {True, False}, outcomes


@shared_loop
async def test_a_model_call_retry_reuses_the_first_attempts_state_and_ignores_a_later_steer(plain: Session) -> None:
    """RunModel decides only before its model call: a steer that commits during attempt 1, which then
    fails, does not stop attempt 2 (it sees attempt 1's snapshot); its answer completes the turn,
    and the steer starts the next one."""
    await plain.start(script({"gate": plain.gate_name("model"), "raise": "flaky provider", "attempts": 1,
                              "answer": "second try"}))
    await plain.gate("model").wait_until_reached()
    assert await plain.sessions.steer_user_message(plain.id, text="steer during attempt 1")
    plain.gate("model").release()
    done = await plain.turns_ended(2)
    assert [e["attempt"] for e in plain.log.entries("model", flow_id=plain.id, turn_id="turn-1")] == [1, 2]
    assert [m.text for m in done.messages][1:] == [
        "second try", "steer during attempt 1", "echo: steer during attempt 1"]
    assert [e.turn_id for e, _ in await plain.events("turn_completed")] == ["turn-1", "turn-2"]
    assert await plain.events("turn_steered") == []


@shared_loop
async def test_steering_never_abandons_a_started_task_or_its_question(plain: Session) -> None:
    """A running task poll and a task's pending question are left alone by a steer: ResumeTurn takes
    the control wake and waits again, the question stays answerable, and the turn ends steered only
    once both tasks returned their results."""
    calls = [
        {"id": "c1", "name": "read_task", "args": {"task": {"polls": [{"gate": plain.gate_name("poll"),
                                                                        "result": "task done"}]}}},
        {"id": "c2", "name": "read_quiz", "args": {"task": {"polls": [{"ask": "Colour?"},
                                                                       {"result": "got {answers}"}]}}},
    ]
    await plain.start(script({"tools": calls}, {"answer": "unreachable"}))
    await plain.gate("poll").wait_until_reached()
    await plain.interrupts("c2-input-1")
    assert await plain.sessions.steer_user_message(plain.id, text="hurry up")

    async def wake_taken() -> bool:
        return "ResumeTurn" in await plain.steps()

    await wait_until("ResumeTurn to take the control wake", wake_taken)
    snapshot = await plain.interrupts("c2-input-1")  # still pending
    records = records_by_id(snapshot)
    assert (records["c1"].status, records["c2"].status) == (
        AgentToolCallStatus.WAITING_FOR_TASK, AgentToolCallStatus.AWAITING_ANSWER)
    assert await plain.events("interrupt_resolved") == []
    assert await plain.sessions.answer_question(plain.id, "c2-input-1", "red")
    plain.gate("poll").release()
    done = await plain.turns_ended(2)
    note = note_of(done, "turn-1") or ""
    assert "-> succeeded: task done" in note and '-> succeeded: got [["answered", "red"]]' in note
    finished = {p["tool_call_id"]: p["status"] for _, p in await plain.events("tool_call_finished")}
    assert finished == {"c1": "succeeded", "c2": "succeeded"}
    [(_, steered)] = await plain.events("turn_steered")
    assert steered == {"steered_message_count": 1, "message_count": 1}
    assert user_texts(done, "turn-2") == ["hurry up"]


# Step handlers on built contexts -----------------------------------------------------------------


def _events_written(ctx: Context) -> list[AgentEvent]:
    return [msgspec.json.decode(data, type=AgentEvent) for _, _, data in ctx.writes.appends]


class _NoModel:
    """A runner whose model call must not happen (it supports plan mode, so a Flow may enable it)."""

    supports_plan_mode = True

    def build_user_message(self, text: str) -> Any:
        from agents.tests.scripted_agent import item

        return item(MessageRole.USER, text=text)

    async def run_model_step(self, turn: Any) -> Any:
        raise AssertionError("the model was called in a steered turn")

    async def execute_deferred_tool_call(self, call: Any) -> Any:
        raise AssertionError("a tool ran")


class _Builds(_NoModel):
    """A runner whose unfinished-turn builder returns `built`, or raises when it is an exception."""

    def __init__(self, built: Any) -> None:
        self.built = built

    def build_unfinished_turn_messages(self, turn: Any) -> Any:
        if isinstance(self.built, Exception):
            raise self.built
        return self.built


def test_unfinished_turn_messages_are_none_without_a_builder_or_when_it_fails(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The steered, cancelled and failed turn ends store the note instead of the runner's items when
    it has none to give: no builder, a builder that raises, or one that breaks the item contract
    (each logged); a working builder's items come back checked. Catches a runner defect that blocks
    the end of a turn, or an empty list taken for "no builder"."""
    from agents.tests.scripted_agent import item

    turn: Any = types.SimpleNamespace(flow_id="f", turn_id="turn-1")  # the builders do not read it; the log does
    answer = item(MessageRole.ASSISTANT, text="half an answer")

    def built(runner: Any) -> Any:
        flow = AgentSessionFlow(runner, "Builds")
        return runtime_of(flow).unfinished_turn_messages(turn)

    with caplog.at_level(logging.WARNING, logger="dex_agents.session"):
        assert built(_NoModel()) is None
        assert caplog.records == []  # no builder is no defect: nothing to log
        assert built(_Builds(RuntimeError("builder bug"))) is None
        assert built(_Builds(["not a framework message"])) is None
    assert [r.getMessage() for r in caplog.records] == [
        "flow f turn turn-1: build_unfinished_turn_messages failed; the turn ends without its items"] * 2
    assert built(_Builds([])) == []
    assert built(_Builds([answer])) == [answer]


async def test_run_model_in_a_steered_turn_ends_it_without_a_model_call() -> None:
    """RunModel's only decision before the call: with more steered messages than applied it stores
    the steered note, deletes the records, counts and clears the turn (accepts_turn_control cleared),
    writes turn_steered, and moves to ApplyTurnControl; the model is never called."""
    flow = AgentSessionFlow(_NoModel(), "NoModel")  # type: ignore[arg-type]
    steps = TurnSteps(runtime_of(flow))
    record = tool_call(AgentToolCallStatus.SUCCEEDED, output="ok", tool_name="read")
    ctx = step_context(flow, RUN_MODEL, {
        ("AgentState", ""): running_turn(), ("AgentToolCalls", "c1"): record,
        ("SteeredMessageCount", ""): 2, ("AppliedSteeredMessageCount", ""): 1,
    })
    decision = await steps.run_model(ctx, None)
    assert [m.step_type for m in decision.movements] == [APPLY_TURN_CONTROL]
    state = ctx.get(AGENT_STATE)
    assert state is not None
    assert (state.active_turn_id, state.turn_count, state.accepts_turn_control) == (None, 1, False)
    assert state.status is AgentStatus.WAITING_FOR_USER_MESSAGE and state.next_message_sequence == 3
    assert ctx.get(AGENT_TOOL_CALLS["c1"]) is None
    events = _events_written(ctx)
    assert [(e.type, json.loads(e.payload)) for e in events] == [
        ("turn_steered", {"steered_message_count": 1, "message_count": 1})]
    # No steered messages waiting: the flags are clear and the model would be called.
    clear = step_context(flow, RUN_MODEL, {("AgentState", ""): running_turn(), ("SteeredMessageCount", ""): 1,
                                       ("AppliedSteeredMessageCount", ""): 1})
    with pytest.raises(AssertionError, match="the model was called"):
        await steps.run_model(clear, None)


@pytest.mark.parametrize("step_type", [RUN_MODEL, RECORD_TURN_FAILURE])
@pytest.mark.parametrize("state", [None, running_turn(
    status=AgentStatus.WAITING_FOR_USER_MESSAGE, active_turn_id=None, turn_count=1, accepts_turn_control=False)])
async def test_run_model_and_record_turn_failure_after_the_turn_ended_are_dead_ends(
    step_type: str, state: AgentState | None,
) -> None:
    """RunModel or RecordTurnFailure that runs when no turn is active (one ended it first, e.g.
    cancelled, or no AgentState) ends there: a dead end that calls neither the model nor the
    unfinished-turn builder and writes nothing."""
    flow = AgentSessionFlow(_Builds(AssertionError("the builder was called")), "NoTurn")
    steps = TurnSteps(runtime_of(flow))
    ctx = step_context(flow, step_type, {} if state is None else {("AgentState", ""): state})
    handler = steps.run_model if step_type == RUN_MODEL else steps.record_turn_failure
    decision = await handler(ctx, None)
    assert (decision.kind, decision.movements) == ("dead_end", ())
    assert ctx.writes.empty()


class _WritesWhileBuilding(_NoModel):
    """A builder that keeps the turn it was given and writes a text delta with its event writer."""

    def __init__(self) -> None:
        self.turns: list[Any] = []

    def build_unfinished_turn_messages(self, turn: Any) -> Any:
        self.turns.append(turn)
        turn.events.write_text_delta("from the builder")
        return []


@pytest.mark.parametrize("step_type", [RUN_MODEL, RECORD_TURN_FAILURE, APPLY_TURN_CONTROL])
async def test_a_turn_that_ends_without_a_model_call_gives_the_builder_a_closed_event_writer(step_type: str) -> None:
    """A turn that ends outside a model call (RunModel in a steered turn, RecordTurnFailure,
    ApplyTurnControl) hands build_unfinished_turn_messages a turn whose event writer is already
    closed: what it writes is dropped, never shown live as the attempt's output, and a later write
    cannot be either."""
    runner = _WritesWhileBuilding()
    flow = AgentSessionFlow(runner, "Closed")
    live: list[str] = []
    values: dict[tuple[str, str], Any] = {("AgentState", ""): running_turn()}
    wait = None
    if step_type == RUN_MODEL:
        values.update({("SteeredMessageCount", ""): 2, ("AppliedSteeredMessageCount", ""): 1})
    if step_type == APPLY_TURN_CONTROL:
        wait = (Wait.all_of(STEERED_USER_MESSAGES.at_most(10), TURN_CONTROL_REQUESTS.at_most(10)),
                WaitOutcome(satisfied=(0, 1), consumed=((), ())))
    ctx = step_context(flow, step_type, values, wait, write_event=lambda name, _data: live.append(name))
    steps = TurnSteps(runtime_of(flow))
    handler = {RUN_MODEL: steps.run_model, RECORD_TURN_FAILURE: steps.record_turn_failure,
               APPLY_TURN_CONTROL: ControlSteps(steps.rt, steps).apply_turn_control}[step_type]
    decision = await handler(ctx, None)
    assert [m.step_type for m in decision.movements] == [APPLY_TURN_CONTROL if step_type == RUN_MODEL
                                                         else AWAIT_USER_MESSAGE]
    assert len(runner.turns) == 1 and runner.turns[0].events.closed
    assert live == []
    state = ctx.get(AGENT_STATE)
    assert state is not None and state.active_turn_id is None  # the turn ended in this commit


@pytest.mark.parametrize(("plan_mode_enabled", "flags", "mode"), [
    (True, (True, False), InteractionMode.PLANNING),  # any steered message with plan_mode
    (True, (False, False), InteractionMode.CHAT),
    (False, (True, True), InteractionMode.CHAT),  # plan mode off: always chat
])
async def test_apply_turn_control_starts_the_steered_turn_in_the_mode_of_its_messages(
    plan_mode_enabled: bool, flags: tuple[bool, bool], mode: InteractionMode,
) -> None:
    """ApplyTurnControl counts what it consumed as applied and starts the steered turn with every
    steered message, in order, in the mode the one turn-start rule gives those messages; with no
    steered message it goes back to AwaitUserMessage and writes nothing."""
    options = AgentSessionOptions(built_in_tools=frozenset({BuiltInTool.WRITE_TODOS}),
                                  plan_mode_enabled=plan_mode_enabled)
    flow = AgentSessionFlow(_NoModel(), "NoModel", options)  # type: ignore[arg-type]
    runtime = runtime_of(flow)
    control = ControlSteps(runtime, TurnSteps(runtime))
    idle = running_turn(status=AgentStatus.WAITING_FOR_USER_MESSAGE, active_turn_id=None, turn_count=1,
                          accepts_turn_control=False)
    wait = Wait.all_of(STEERED_USER_MESSAGES.at_most(10), TURN_CONTROL_REQUESTS.at_most(10))
    messages = [AgentUserMessage("one", plan_mode=flags[0]), AgentUserMessage("two", plan_mode=flags[1])]
    consumed = tuple(ConsumedMessage(i + 1, msgspec.Raw(msgspec.json.encode(m))) for i, m in enumerate(messages))
    ctx = step_context(flow, APPLY_TURN_CONTROL, {("AgentState", ""): idle, ("AppliedSteeredMessageCount", ""): 3},
                   (wait, WaitOutcome(satisfied=(0, 1), consumed=(consumed, ()))))
    decision = await control.apply_turn_control(ctx, None)
    assert [m.step_type for m in decision.movements] == [RUN_MODEL]
    state = ctx.get(AGENT_STATE)
    assert state is not None and (state.active_turn_id, state.accepts_turn_control) == ("turn-2", True)
    assert state.interaction_mode is mode and state.next_message_sequence == 4
    assert ctx.get(APPLIED_STEERED_MESSAGE_COUNT) == 5
    stored = [msgspec.json.decode(v) for (name, _), v in ctx.writes.attributes.items() if name == "AgentMessages"]
    assert [m["text"] for m in stored] == ["one", "two"]
    empty = step_context(flow, APPLY_TURN_CONTROL, {("AgentState", ""): idle},
                     (wait, WaitOutcome(satisfied=(0, 1), consumed=((), ()))))
    decision = await control.apply_turn_control(empty, None)
    assert [m.step_type for m in decision.movements] == [AWAIT_USER_MESSAGE]
    assert empty.writes.attributes == {}


def _applying(flow: AgentSessionFlow, values: dict[tuple[str, str], Any], *steered: AgentUserMessage) -> Context:
    """ApplyTurnControl's Execute after its wait took `steered` (and no stale wake)."""
    wait = Wait.all_of(STEERED_USER_MESSAGES.at_most(10), TURN_CONTROL_REQUESTS.at_most(10))
    consumed = tuple(ConsumedMessage(i + 1, msgspec.Raw(msgspec.json.encode(m))) for i, m in enumerate(steered))
    outcome = WaitOutcome(satisfied=(0, 1), consumed=(consumed, ()))
    return step_context(flow, APPLY_TURN_CONTROL, values, (wait, outcome))


async def test_apply_turn_control_ends_the_steered_turn_and_counts_the_first_steer_from_zero() -> None:
    """The session's first steer: AppliedSteeredMessageCount is unset, so it becomes the one message
    taken; counted one too high, a later steer would leave as many published as applied and the
    flags would never see it. The active turn ends steered before the steered turn starts."""
    flow = AgentSessionFlow(_NoModel(), "NoModel")  # type: ignore[arg-type]
    runtime = runtime_of(flow)
    control = ControlSteps(runtime, TurnSteps(runtime))
    record = tool_call(AgentToolCallStatus.REJECTED, rejection_message=STEERED_REJECTION_MESSAGE,
                       cancellation_reason=CancellationReason.STEERED)
    ctx = _applying(flow, {("AgentState", ""): running_turn(status=AgentStatus.RUNNING_TOOLS),
                           ("AgentToolCalls", "c1"): record, ("SteeredMessageCount", ""): 1},
                    AgentUserMessage("change of plan"))
    decision = await control.apply_turn_control(ctx, None)
    assert [m.step_type for m in decision.movements] == [RUN_MODEL]
    assert ctx.get(APPLIED_STEERED_MESSAGE_COUNT) == 1
    state = ctx.get(AGENT_STATE)
    assert state is not None and (state.active_turn_id, state.turn_count) == ("turn-2", 1)
    assert ctx.get(AGENT_TOOL_CALLS["c1"]) is None
    assert [(e.type, e.turn_id) for e in _events_written(ctx)][:1] == [("turn_steered", "turn-1")]


async def test_a_blank_steered_message_is_applied_but_starts_no_turn() -> None:
    """A blank message published to QueuedUserMessages around send_user_message can be moved by a
    steer with its message_id. ApplyTurnControl counts it applied but, as AwaitUserMessage does with
    a blank queued message, never stores it as a user message: alone it starts no turn; with others
    the turn starts with those. Catches: ApplyTurnControl starting the turn with every steered
    message (survived the _control_steps mutation sweep)."""
    flow = AgentSessionFlow(_NoModel(), "NoModel")  # type: ignore[arg-type]
    runtime = runtime_of(flow)
    control = ControlSteps(runtime, TurnSteps(runtime))
    idle = running_turn(status=AgentStatus.WAITING_FOR_USER_MESSAGE, active_turn_id=None, turn_count=1,
                        accepts_turn_control=False)
    alone = _applying(flow, {("AgentState", ""): idle}, AgentUserMessage(" \n"))
    decision = await control.apply_turn_control(alone, None)
    assert [m.step_type for m in decision.movements] == [AWAIT_USER_MESSAGE]
    assert alone.get(APPLIED_STEERED_MESSAGE_COUNT) == 1
    assert alone.get(AGENT_STATE) == idle
    mixed = _applying(flow, {("AgentState", ""): idle}, AgentUserMessage(" "), AgentUserMessage("real"))
    decision = await control.apply_turn_control(mixed, None)
    assert [m.step_type for m in decision.movements] == [RUN_MODEL]
    stored = [msgspec.json.decode(v) for (name, _), v in mixed.writes.attributes.items() if name == "AgentMessages"]
    assert [m["text"] for m in stored] == ["real"]


async def test_a_steered_turns_note_too_large_to_store_is_stored_cut(caplog: pytest.LogCaptureFixture) -> None:
    """A read whose output fits its record (700,000 characters) makes a steered note over the value
    limit; the note is stored with the result cut to CUT_NOTE_FIELD_CHARS, so the model still learns
    the call ran, and the steered message follows it."""
    flow = AgentSessionFlow(_NoModel(), "NoModel")  # type: ignore[arg-type]
    runtime = runtime_of(flow)
    output = "o" * 700_000
    ctx = _applying(flow, {("AgentState", ""): running_turn(status=AgentStatus.RUNNING_TOOLS),
                           ("AgentToolCalls", "c1"): tool_call(AgentToolCallStatus.SUCCEEDED, output=output),
                           ("SteeredMessageCount", ""): 1},
                    AgentUserMessage("change of plan"))
    with caplog.at_level(logging.WARNING, logger="dex_agents.session"):
        await ControlSteps(runtime, TurnSteps(runtime)).apply_turn_control(ctx, None)
    [warning] = [r.getMessage() for r in caplog.records]
    assert warning.startswith("flow s: message 2 (user) of turn turn-1 is too large to store: ")
    assert warning.endswith("; the steered turn stores 1 of its messages instead: user")
    stored = [ctx.get(AGENT_MESSAGES[message_sequence_key(n)]) for n in (2, 3)]
    assert [(m.turn_id, m.text) for m in stored if m is not None] == [
        ("turn-1", "\n".join([
            STEERED_NOTE_HEADER,
            f"- t {{}} -> succeeded: {output[:CUT_NOTE_FIELD_CHARS]} [Dex: cut from {len(output)} characters]",
            TOOL_CALL_NOTE_FOOTER,
        ])),
        ("turn-2", "change of plan"),
    ]


async def test_a_controlled_turn_that_ends_leaves_no_interrupt_answerable() -> None:
    """Every record is final when a steered or cancelled turn ends, so an interrupt still listed (one
    whose call was settled without removing it) must not outlive the turn and stay answerable. With
    none listed, PendingInterrupts (which cancel_turn locks) is not written at all."""
    flow = AgentSessionFlow(_NoModel(), "NoModel")  # type: ignore[arg-type]
    runtime = runtime_of(flow)
    record = tool_call(AgentToolCallStatus.REJECTED, rejection_message=STEERED_REJECTION_MESSAGE,
                       cancellation_reason=CancellationReason.STEERED)
    values: dict[tuple[str, str], Any] = {
        ("AgentState", ""): running_turn(status=AgentStatus.RUNNING_TOOLS), ("AgentToolCalls", "c1"): record,
        ("SteeredMessageCount", ""): 1, ("PendingInterrupts", ""): [_interrupt("c1", "c1")],
    }
    ctx = _applying(flow, values, AgentUserMessage("change of plan"))
    control = ControlSteps(runtime, TurnSteps(runtime))
    await control.apply_turn_control(ctx, None)
    assert ctx.get(PENDING_INTERRUPTS) == []
    values[("PendingInterrupts", "")] = []
    ctx = _applying(flow, values, AgentUserMessage("change of plan"))
    await control.apply_turn_control(ctx, None)
    assert ("PendingInterrupts", "") not in ctx.writes.attributes


async def test_apply_turn_control_fails_rather_than_end_a_turn_with_an_unfinished_call() -> None:
    """Every path to ApplyTurnControl comes from a turn whose records are final; ending one that
    still has a waiting call would drop that call's result, so the Step fails instead."""
    flow = AgentSessionFlow(_NoModel(), "NoModel")  # type: ignore[arg-type]
    runtime = runtime_of(flow)
    control = ControlSteps(runtime, TurnSteps(runtime))
    values: dict[tuple[str, str], Any] = {
        ("AgentState", ""): running_turn(status=AgentStatus.RUNNING_TOOLS), ("SteeredMessageCount", ""): 1,
        ("AgentToolCalls", "c1"): tool_call(AgentToolCallStatus.SUCCEEDED, output="ok"),
        ("AgentToolCalls", "c2"): tool_call(AgentToolCallStatus.AWAITING_APPROVAL, tool_call_id="c2"),
    }
    ctx = _applying(flow, values, AgentUserMessage("change of plan"))
    with pytest.raises(RuntimeError, match=r"turn turn-1 with unfinished tool calls \['c2'\]"):
        await control.apply_turn_control(ctx, None)


async def test_apply_turn_control_before_the_session_started_fails_naming_the_missing_state() -> None:
    flow = AgentSessionFlow(_NoModel(), "NoModel")  # type: ignore[arg-type]
    runtime = runtime_of(flow)
    ctx = _applying(flow, {}, AgentUserMessage("early"))
    with pytest.raises(RuntimeError, match="ApplyTurnControl ran before StartAgentSession stored AgentState"):
        await ControlSteps(runtime, TurnSteps(runtime)).apply_turn_control(ctx, None)


# RPC handlers on built contexts ------------------------------------------------------------------


def _rpc_context(flow: AgentSessionFlow, name: str, values: dict[tuple[str, str], Any],
                 queued: tuple[tuple[int, AgentUserMessage], ...] = ()) -> RpcContext:
    loaded = {key: msgspec.json.encode(value) for key, value in values.items()}
    pending = {("QueuedUserMessages", ""): [(mid, msgspec.json.encode(m)) for mid, m in queued]}
    return RpcContext(flow, "s", loaded, LoadOptions.all(), pending, name)


async def test_steer_and_cancel_are_refused_for_a_turn_without_accepts_turn_control() -> None:
    """A turn an earlier Worker started (accepts_turn_control false) is neither steered nor cancelled:
    both RPCs return False and write nothing; delete_queued_message still works."""
    flow = build_flow(None)
    legacy = running_turn(accepts_turn_control=False)
    values = {("AgentState", ""): legacy}
    for name, request in (("steer_user_message", SteerUserMessageRequest(text="x")),
                          ("steer_user_message", SteerUserMessageRequest(message_id="5")),
                          ("cancel_turn", None)):
        ctx = _rpc_context(flow, name, values, ((5, AgentUserMessage("q")),))
        assert await flow.rpc(name).handler(ctx, request) is False
        assert ctx.writes.empty()
    ctx = _rpc_context(flow, "delete_queued_message", values, ((5, AgentUserMessage("q")),))
    assert await flow.rpc("delete_queued_message").handler(ctx, DeleteQueuedMessageRequest("5")) is True
    assert ctx.writes.deleted_messages == [("QueuedUserMessages", "", 5)]


async def test_refused_steer_and_delete_requests_return_false_and_write_nothing() -> None:
    """The RPCs are declared to return bool, so a refusal is false on the wire, never null (the
    client's bool() would hide the difference from Python callers only)."""
    flow = build_flow(None)
    values = {("AgentState", ""): running_turn()}
    for name, request in (("steer_user_message", SteerUserMessageRequest()),
                          ("steer_user_message", SteerUserMessageRequest(text=" ")),
                          ("steer_user_message", SteerUserMessageRequest(message_id="6")),
                          ("delete_queued_message", DeleteQueuedMessageRequest("6")),
                          ("delete_queued_message", DeleteQueuedMessageRequest("x"))):
        ctx = _rpc_context(flow, name, values, ((5, AgentUserMessage("q")),))
        assert await flow.rpc(name).handler(ctx, request) is False, request
        assert ctx.writes.empty()


async def test_steer_rpc_writes_the_message_the_count_and_one_wake_in_one_commit() -> None:
    """A steer of a running turn publishes the message to SteeredUserMessages (a queued one moved as it
    is, plan_mode kept), adds one to SteeredMessageCount, publishes TurnControlRequest(steer) and ends
    the CallTool Steps waiting for a retry;
    with no active turn a queued message ID stays queued (True, nothing written)."""
    flow = build_flow(None)
    values = {("AgentState", ""): running_turn(), ("SteeredMessageCount", ""): 4}
    moved = AgentUserMessage("plan this", plan_mode=True)
    ctx = _rpc_context(flow, "steer_user_message", values, ((5, moved),))
    steered = await flow.rpc("steer_user_message").handler(ctx, SteerUserMessageRequest(message_id="5"))
    assert isinstance(steered, RPCResult) and steered.output is True
    assert steered.ending_retry_waits == ("CallTool",)  # a tool call waiting for a retry ends now
    assert ctx.writes.deleted_messages == [("QueuedUserMessages", "", 5)]
    assert [(n, msgspec.json.decode(v)) for n, _, v in ctx.writes.publishes] == [
        ("SteeredUserMessages", {"text": "plan this", "plan_mode": True}),
        ("TurnControlRequests", {"kind": "steer"}),
    ]
    assert ctx.writes.attributes == {("SteeredMessageCount", ""): b"5"}
    idle = {("AgentState", ""): running_turn(active_turn_id=None, status=AgentStatus.WAITING_FOR_USER_MESSAGE)}
    ctx = _rpc_context(flow, "steer_user_message", idle, ((5, moved),))
    assert await flow.rpc("steer_user_message").handler(ctx, SteerUserMessageRequest(message_id="5")) is True
    assert ctx.writes.empty()
    ctx = _rpc_context(flow, "steer_user_message", idle, ((5, moved),))
    assert await flow.rpc("steer_user_message").handler(ctx, SteerUserMessageRequest(message_id="6")) is False
    ctx = _rpc_context(flow, "steer_user_message", {})
    assert await flow.rpc("steer_user_message").handler(ctx, SteerUserMessageRequest(text="early")) is True
    assert [n for n, _, _ in ctx.writes.publishes] == ["QueuedUserMessages"]  # before StartAgentSession


def test_pending_user_message_ids_are_text() -> None:
    """AgentSnapshot lists queued and steered messages with their Channel message IDs as text."""
    assert msgspec.json.encode(PendingUserMessage("12", AgentUserMessage("x"))) == (
        b'{"message_id":"12","message":{"text":"x","plan_mode":false}}')


# The woken waiting Steps on built contexts -------------------------------------------------------


def _approval_steps(flow: AgentSessionFlow) -> ToolSteps:
    return ToolSteps(runtime_of(flow))


def _waiting_values(steered: bool, pending: bool, record: AgentToolCall) -> dict[tuple[str, str], Any]:
    values: dict[tuple[str, str], Any] = {
        ("AgentState", ""): running_turn(status=AgentStatus.RUNNING_TOOLS),
        ("AgentToolCalls", record.tool_call_id): record,
        ("PendingInterrupts", ""): [_interrupt("c1", "c1")] if pending else [],
    }
    if steered:
        values[("SteeredMessageCount", "")] = 1
    return values


async def test_approval_wait_takes_an_answer_first_once_its_interrupt_is_gone_in_a_steered_turn() -> None:
    """AwaitToolApproval waits on ToolCallCancellations first, then InterruptResolutions; once the
    interrupt is gone in a steered turn it waits without blocking, taking an answer that committed
    first and any stale wake."""
    flow = build_flow(None)
    steps = _approval_steps(flow)
    approval = tool_call(AgentToolCallStatus.AWAITING_APPROVAL, effect=ToolEffect.NON_IDEMPOTENT_WRITE)
    waiting = await steps.await_tool_approval_wait(
        step_context(flow, "AwaitToolApproval", _waiting_values(True, True, approval)), "c1")
    assert waiting == Wait.any_of(TOOL_CALL_CANCELLATIONS["c1"].for_one(), INTERRUPT_RESOLUTIONS["c1"].for_one())
    gone = await steps.await_tool_approval_wait(
        step_context(flow, "AwaitToolApproval", _waiting_values(True, False, approval)), "c1")
    assert gone == answer_first_wait("c1", "c1") and gone.mode == "all"
    quiet = await steps.await_tool_approval_wait(
        step_context(flow, "AwaitToolApproval", _waiting_values(False, False, approval)), "c1")
    assert quiet.mode == "any"  # not steered: an answer is queued, and for_one takes it


async def test_an_approval_wait_reads_only_its_own_interrupt() -> None:
    """Another call's pending interrupt (with a deadline) is not this call's: in a steered turn this
    call's interrupt is gone, so it takes an answer first; in a quiet turn it sets no deadline Timer."""
    flow = build_flow(None)
    steps = _approval_steps(flow)
    approval = tool_call(AgentToolCallStatus.AWAITING_APPROVAL, effect=ToolEffect.NON_IDEMPOTENT_WRITE)
    other = msgspec.structs.replace(_interrupt("c2", "c2"), deadline="2026-01-01T01:00:00.000Z")
    for steered, expected in [
        (True, answer_first_wait("c1", "c1")),
        (False, Wait.any_of(TOOL_CALL_CANCELLATIONS["c1"].for_one(), INTERRUPT_RESOLUTIONS["c1"].for_one())),
    ]:
        values = _waiting_values(steered, False, approval)
        values[("PendingInterrupts", "")] = [other]
        waiting = await steps.await_tool_approval_wait(step_context(flow, "AwaitToolApproval", values), "c1")
        assert waiting == expected


@pytest.mark.parametrize(("left_ms", "timer_seconds"), [(1_200, 2), (1_000, 1), (300, 1), (59_001, 60)])
async def test_an_approval_waits_on_a_deadline_timer_rounded_up_to_whole_seconds(
    monkeypatch: pytest.MonkeyPatch, left_ms: int, timer_seconds: int,
) -> None:
    """The Timer the approval's wait registers is the time to its deadline rounded up (seed 002:
    "rounded up to whole seconds because Dex Timers take whole seconds"). Catches: rounding to the
    nearest second, a Timer that fires before the deadline and then spins on zero-second Timers."""
    flow = build_flow(None)
    steps = _approval_steps(flow)
    now = datetime(2026, 1, 1, 1, 0, tzinfo=UTC)
    monkeypatch.setattr("dex_agents._tool_steps.now_utc", lambda: now)
    deadline = format_time(now + timedelta(milliseconds=left_ms))
    values = _waiting_values(False, True, tool_call(AgentToolCallStatus.AWAITING_APPROVAL))
    values[("PendingInterrupts", "")] = [msgspec.structs.replace(_interrupt("c1", "c1"), deadline=deadline)]
    waiting = await steps.await_tool_approval_wait(step_context(flow, "AwaitToolApproval", values), "c1")
    assert waiting == Wait.any_of(TOOL_CALL_CANCELLATIONS["c1"].for_one(), INTERRUPT_RESOLUTIONS["c1"].for_one(),
                                  Timer.by_duration(timer_seconds))


@pytest.mark.parametrize("status", [None, AgentToolCallStatus.APPROVED, AgentToolCallStatus.REJECTED])
async def test_an_approval_wait_of_a_call_no_longer_awaiting_approval_skips_and_its_execute_ends(
    status: AgentToolCallStatus | None,
) -> None:
    """An AwaitToolApproval whose record is gone or no longer awaiting_approval (an approval or a
    FinishTurnCancellation committed first) waits for nothing, and its execute ends writing nothing."""
    flow = build_flow(None)
    steps = _approval_steps(flow)
    values = _waiting_values(True, True, tool_call(AgentToolCallStatus.AWAITING_APPROVAL))
    if status is None:
        del values[("AgentToolCalls", "c1")]
    else:
        values[("AgentToolCalls", "c1")] = tool_call(status)
    waiting = await steps.await_tool_approval_wait(step_context(flow, "AwaitToolApproval", values), "c1")
    assert waiting == Wait.skip_immediately()
    ctx = step_context(flow, "AwaitToolApproval", values, (waiting, WaitOutcome(satisfied=(), consumed=())))
    decision = await steps.await_tool_approval(ctx, "c1")
    assert decision.kind == "dead_end" and not decision.movements
    assert ctx.writes.empty()


@pytest.mark.parametrize(("steered", "pending", "outcome"), [
    (True, True, "abandoned"),  # the Step removes its interrupt and records the call cancelled
    (True, False, "waits"),  # the interrupt is gone: an answer may have committed first
    (False, True, "waits"),  # a stale wake in a turn that is not steered
])
async def test_a_woken_approval_abandons_only_in_a_steered_turn_with_its_interrupt_pending(
    steered: bool, pending: bool, outcome: str,
) -> None:
    flow = build_flow(None)
    steps = _approval_steps(flow)
    approval = tool_call(AgentToolCallStatus.AWAITING_APPROVAL, effect=ToolEffect.NON_IDEMPOTENT_WRITE)
    wait = Wait.any_of(TOOL_CALL_CANCELLATIONS["c1"].for_one(), INTERRUPT_RESOLUTIONS["c1"].for_one())
    wake = msgspec.Raw(b'{"reason":"steered"}')
    values = _waiting_values(steered, pending, approval)
    other = _interrupt("c2", "c2")  # another call's, which abandoning c1 must leave pending
    values[("PendingInterrupts", "")] = [*values[("PendingInterrupts", "")], other]
    ctx = step_context(flow, "AwaitToolApproval", values,
                   (wait, WaitOutcome(satisfied=(0,), consumed=((ConsumedMessage(1, wake),), ()))))
    decision = await steps.await_tool_approval(ctx, "c1")
    if outcome == "waits":
        assert [(m.step_type, m.input) for m in decision.movements] == [("AwaitToolApproval", "c1")]
        assert ctx.writes.empty()
        return
    assert decision.kind == "dead_end"
    record = ctx.get(AGENT_TOOL_CALLS["c1"])
    assert record is not None and (record.status, record.cancellation_reason, record.rejection_message) == (
        AgentToolCallStatus.REJECTED, CancellationReason.STEERED, STEERED_REJECTION_MESSAGE)
    events = [(e.type, json.loads(e.payload)) for e in _events_written(ctx)]
    assert events[0] == ("interrupt_resolved", {
        "interrupt_id": "c1", "approved": False, "rejection_message": STEERED_REJECTION_MESSAGE,
        "kind": "tool_approval", "answered": False, "cancellation_reason": "steered"})
    assert [n for n, _, _ in ctx.writes.publishes] == ["ToolCallResults"]
    assert ctx.get(PENDING_INTERRUPTS) == [other]


def test_the_answer_first_wait_never_blocks_and_takes_at_most_one_answer() -> None:
    """A zero Timer, so Execute runs at once instead of blocking; the one resolution the Step applies,
    if one committed first; every stale wake. Only an all_of wait (this one, or the tool question's
    raise wait) counts as answer-first, and a wait result with no spec never does."""
    flow = build_flow(None)
    wait = answer_first_wait("c1", "c1-input-1")
    assert wait == Wait.all_of(Timer.by_duration(0), INTERRUPT_RESOLUTIONS["c1-input-1"].at_most(1),
                               TOOL_CALL_CANCELLATIONS["c1"].at_most(MAX))
    assert is_answer_first_wait(WaitResult(wait.spec(), None, flow))
    woken = Wait.any_of(TOOL_CALL_CANCELLATIONS["c1"].for_one(), INTERRUPT_RESOLUTIONS["c1"].for_one())
    assert not is_answer_first_wait(WaitResult(woken.spec(), None, flow))
    assert not is_answer_first_wait(WaitResult(None, None, flow))


async def test_a_started_tasks_question_woken_in_a_steered_turn_waits_again() -> None:
    """Steering never abandons a started task's question, even with its interrupt still pending when
    a ToolCallCancellations wake arrives: the task owns the call, so the Step waits again and writes
    nothing."""
    flow = build_flow(None)
    question = tool_call(AgentToolCallStatus.AWAITING_ANSWER, task_id="task-1", input_question="Which?")
    pending = _interrupt("c1-input-1", "c1", InterruptKind.QUESTION)
    values: dict[tuple[str, str], Any] = {
        ("AgentState", ""): running_turn(status=AgentStatus.RUNNING_TOOLS), ("AgentToolCalls", "c1"): question,
        ("PendingInterrupts", ""): [pending], ("SteeredMessageCount", ""): 1,
    }
    built_ins = BuiltInSteps(runtime_of(flow))
    waiting = await built_ins.await_question_answer_wait(step_context(flow, AWAIT_QUESTION_ANSWER, values), "c1")
    assert waiting == Wait.any_of(TOOL_CALL_CANCELLATIONS["c1"].for_one(),
                                  INTERRUPT_RESOLUTIONS["c1-input-1"].for_one())
    wake = ConsumedMessage(1, msgspec.Raw(b'{"reason":"steered"}'))
    outcome = WaitOutcome(satisfied=(0,), consumed=((wake,), ()))
    ctx = step_context(flow, AWAIT_QUESTION_ANSWER, values, (waiting, outcome))
    decision = await built_ins.await_question_answer(ctx, "c1")
    assert [(m.step_type, m.input) for m in decision.movements] == [(AWAIT_QUESTION_ANSWER, "c1")]
    assert ctx.writes.empty()


@pytest.mark.parametrize("answered", [True, False])
async def test_the_answer_first_wait_applies_an_approval_that_won_or_abandons_the_call(answered: bool) -> None:
    """After the non-blocking wait: an approval that committed first moves the call to its tool Step
    (which then records it cancelled before the tool starts); no answer means steering removed the
    interrupt, so the call is recorded cancelled, with no second interrupt_resolved."""
    flow = build_flow(None)
    steps = _approval_steps(flow)
    approval = tool_call(AgentToolCallStatus.AWAITING_APPROVAL, effect=ToolEffect.NON_IDEMPOTENT_WRITE)
    approve = msgspec.Raw(b'{"approved":true,"rejection_message":null,"answer":null}')
    consumed = ((), (ConsumedMessage(3, approve),) if answered else (), ())
    outcome = WaitOutcome(satisfied=(0, 1, 2), consumed=consumed, fired_timers=(0,))
    ctx = step_context(flow, "AwaitToolApproval", _waiting_values(True, False, approval),
                   (answer_first_wait("c1", "c1"), outcome))
    decision = await steps.await_tool_approval(ctx, "c1")
    record = ctx.get(AGENT_TOOL_CALLS["c1"])
    assert record is not None
    if answered:
        assert [(m.step_type, m.input) for m in decision.movements] == [("CallSingleAttemptTool", "c1")]
        assert record.status is AgentToolCallStatus.APPROVED
        return
    assert decision.kind == "dead_end"
    assert (record.status, record.cancellation_reason) == (AgentToolCallStatus.REJECTED, CancellationReason.STEERED)
    assert [e.type for e in _events_written(ctx)] == ["tool_call_finished"]


@pytest.mark.parametrize(("steered", "timer_fired", "status"), [
    (True, False, AgentToolCallStatus.REJECTED),  # woken by ToolCallCancellations in a steered turn
    (True, True, AgentToolCallStatus.SUCCEEDED),  # the Timer won: the wait completes normally
    (False, False, AgentToolCallStatus.WAITING_FOR_TIMER),  # a stale wake: waits again
])
async def test_a_durable_wait_woken_by_a_steer_is_cancelled_unless_its_timer_fired(
    steered: bool, timer_fired: bool, status: AgentToolCallStatus,
) -> None:
    """AwaitTimer waits on its Timer and ToolCallCancellations; Timers win, so a wait that ends as a
    steer arrives records succeeded; a wake in a steered turn records rejected (steered); a stale
    wake in a turn that is not steered waits again."""
    flow = build_flow(None, built_in_tools=BUILT_INS)
    built_ins = BuiltInSteps(runtime_of(flow))
    timer = tool_call(AgentToolCallStatus.WAITING_FOR_TIMER, tool_name="durable_wait",
                    arguments='{"duration_seconds": 60, "reason": "r"}',
                    wait_until=format_time(datetime.now(UTC) + timedelta(seconds=60)))
    values = _waiting_values(steered, False, timer)
    waiting = await built_ins.await_timer_wait(step_context(flow, "AwaitTimer", values), "c1")
    assert waiting.mode == "any" and waiting.conditions[1] == TOOL_CALL_CANCELLATIONS["c1"].for_one()
    wake = msgspec.Raw(b'{"reason":"steered"}')
    outcome = (WaitOutcome(satisfied=(0,), consumed=((), ()), fired_timers=(0,)) if timer_fired
               else WaitOutcome(satisfied=(1,), consumed=((), (ConsumedMessage(1, wake),))))
    ctx = step_context(flow, "AwaitTimer", values, (waiting, outcome))
    decision = await built_ins.await_timer(ctx, "c1")
    record = ctx.get(AGENT_TOOL_CALLS["c1"])
    assert record is not None and record.status is status
    if status is AgentToolCallStatus.WAITING_FOR_TIMER:
        assert [(m.step_type, m.input) for m in decision.movements] == [("AwaitTimer", "c1")]
        assert ctx.writes.empty()
    elif status is AgentToolCallStatus.REJECTED:
        assert (record.cancellation_reason, record.rejection_message) == (
            CancellationReason.STEERED, STEERED_REJECTION_MESSAGE)


async def test_a_steered_message_the_turn_control_step_took_stays_in_the_snapshot(tmp_path: Any) -> None:
    """ApplyTurnControl's wait takes every steered message when the Step is scheduled; the message
    is stored only when its Execute commits. The Worker is killed inside that Execute (in the
    runner's build_unfinished_turn_messages): with no Worker, the snapshot must still list the
    message as steered, and a message ID taken this way can no longer be deleted. The next Worker
    starts the steered turn with it. Breaks if the snapshot reads only the channel's pending messages."""
    async with _stack(tmp_path, incremental=True) as stack:
        session = Session(stack, "s")
        worker = await stack.start_worker()
        turn_1 = json.dumps({"steps": [{"tools": [{"id": "c1", "name": "write_refund", "args": {}}]},
                                       {"answer": "unreachable"}],
                             "unfinished_gate": session.gate_name("apply")})
        await session.start(turn_1)
        await session.interrupts("c1")
        assert await session.sessions.steer_user_message(session.id, text="change of plan")
        assert await session.gate("apply").wait_until_reached() == worker.pid
        worker.kill()

        snapshot = await session.snapshot()
        assert [p.message.text for p in snapshot.steered_messages] == ["change of plan"]
        assert snapshot.queued_messages == [] and "change of plan" not in [m.text for m in snapshot.messages]
        [taken] = snapshot.steered_messages
        assert await session.sessions.delete_queued_message(session.id, taken.message_id) is False
        assert await session.sessions.steer_user_message(session.id, message_id=taken.message_id) is False

        session.gate("apply").release()
        await stack.start_worker()
        done = await session.turns_ended(2)
        assert user_texts(done, "turn-2") == ["change of plan"]
        assert done.steered_messages == [] and done.queued_messages == []


@pytest.mark.parametrize("paste_first", [False, True])
async def test_a_steered_message_too_large_to_store_loses_none_of_the_others(
    tmp_path: Any, db_url: str, paste_first: bool  # noqa: F811 - the fixture
) -> None:
    """Two steers reach one ApplyTurnControl (sent while no Worker runs): a short instruction, and a
    paste that fits the RPC but not an AgentMessage. The steered turn fails for the paste, with no
    model call, its error naming it after the stored messages; the instruction is stored as the
    turn's user message, in either order, and the session goes on. Breaks if the whole steered batch
    is dropped with the one message that does not fit: the instruction was then neither stored,
    queued nor steered."""
    flow = build_flow(tmp_path)
    async with AgentTestStack(tmp_path, [flow], WORKER_MODULE, worker_cwd=REPO_ROOT, database_url=db_url) as stack:
        session = Session(stack, "s")
        worker = await stack.start_worker()
        await session.start(script({"tools": [{"id": "w", "name": "write_refund", "args": {}}]}, {"answer": "never"}))
        await session.interrupts("w")
        worker.kill()
        paste = "x" * (MAX_VALUE_BYTES - 100)  # the request fits; the stored message holds it twice
        for text in ([paste, "use staging"] if paste_first else ["use staging", paste]):
            assert await session.sessions.steer_user_message(session.id, text=text)
        await stack.start_worker()

        done = await session.turns_ended(2)
        assert done.state is not None and done.steered_messages == []
        error = done.state.last_turn_error
        assert error is not None and error.startswith("message 4 (user) of turn turn-2 is too large to store: ")
        assert [(e.type, p) for e, p in await session.events() if e.turn_id == "turn-2"] == [
            ("turn_started", {"sequence": 3}), ("turn_failed", {"error": error})]
        assert [(m.sequence, m.role, m.text) for m in done.messages if m.turn_id == "turn-2"] == [
            (3, MessageRole.USER, "use staging")]
        assert session.count("model", turn_id="turn-2") == 0
        assert await session.sessions.send_user_message(session.id, "hello")
        done = await session.turns_ended(3)
        assert [m.text for m in done.messages[-2:]] == ["hello", "echo: hello"]


async def test_a_question_whose_deadline_timer_fired_in_a_steered_turn_is_rejected_for_its_deadline() -> None:
    """Timers win over the steer's wake, as for AwaitTimer: a pending question whose deadline Timer
    fired is rejected with `question deadline passed`, though the turn is steered; only a wake by
    ToolCallCancellations lets the steering flags decide."""
    flow = build_flow(None, built_in_tools=BUILT_INS)
    built_ins = BuiltInSteps(runtime_of(flow))
    ask = tool_call(AgentToolCallStatus.AWAITING_ANSWER, tool_name="ask_user")
    question = msgspec.structs.replace(_interrupt("c1", "c1", InterruptKind.QUESTION),
                                       deadline=format_time(datetime.now(UTC) - timedelta(seconds=1)))
    values = {**_waiting_values(True, False, ask), ("PendingInterrupts", ""): [question]}
    waiting = await built_ins.await_question_answer_wait(step_context(flow, AWAIT_QUESTION_ANSWER, values), "c1")
    fired = WaitOutcome(satisfied=(2,), consumed=((), (), ()), fired_timers=(2,))
    ctx = step_context(flow, AWAIT_QUESTION_ANSWER, values, (waiting, fired))
    decision = await built_ins.await_question_answer(ctx, "c1")
    assert decision.kind == "dead_end"
    record = ctx.get(AGENT_TOOL_CALLS["c1"])
    assert record is not None
    assert (record.status, record.rejection_message, record.cancellation_reason) == (
        AgentToolCallStatus.REJECTED, "question deadline passed", None)
    assert ctx.get(PENDING_INTERRUPTS) == []


async def test_a_pending_question_woken_by_a_steer_is_cancelled_with_its_interrupt() -> None:
    """The steer's wake on ToolCallCancellations reaches a question still pending in a steered turn:
    the call records rejected (steered) at once, its interrupt is removed with interrupt_resolved,
    and the branch ends, rather than waiting for ResumeTurn to take the interrupt."""
    flow = build_flow(None, built_in_tools=BUILT_INS)
    built_ins = BuiltInSteps(runtime_of(flow))
    ask = tool_call(AgentToolCallStatus.AWAITING_ANSWER, tool_name="ask_user")
    values = {**_waiting_values(True, False, ask),
              ("PendingInterrupts", ""): [_interrupt("c1", "c1", InterruptKind.QUESTION)]}
    waiting = await built_ins.await_question_answer_wait(step_context(flow, AWAIT_QUESTION_ANSWER, values), "c1")
    wake = WaitOutcome(satisfied=(0,), consumed=((ConsumedMessage(1, msgspec.Raw(b'{"reason":"steered"}')),), ()))
    ctx = step_context(flow, AWAIT_QUESTION_ANSWER, values, (waiting, wake))
    decision = await built_ins.await_question_answer(ctx, "c1")
    assert decision.kind == "dead_end"
    record = ctx.get(AGENT_TOOL_CALLS["c1"])
    assert record is not None
    assert (record.status, record.cancellation_reason) == (AgentToolCallStatus.REJECTED, CancellationReason.STEERED)
    assert ctx.get(PENDING_INTERRUPTS) == []
    resolved = [json.loads(e.payload) for e in _events_written(ctx) if e.type == "interrupt_resolved"]
    assert [(p["interrupt_id"], p["cancellation_reason"]) for p in resolved] == [("c1", "steered")]


async def test_a_pending_task_question_in_a_steered_turn_keeps_waiting_for_its_answer() -> None:
    """Steering never abandons a started task's question: while its interrupt is pending in a steered
    turn, the WaitFor blocks on the wake and the resolution as usual. The answer-first wait would
    find no answer, and Execute, which keeps a task's question, would loop on zero Timers."""
    flow = build_flow(None, built_in_tools=BUILT_INS)
    built_ins = BuiltInSteps(runtime_of(flow))
    question = tool_call(AgentToolCallStatus.AWAITING_ANSWER, task_id="task-1", input_question="Which?")
    values = {**_waiting_values(True, False, question),
              ("PendingInterrupts", ""): [_interrupt("c1-input-1", "c1", InterruptKind.QUESTION)]}
    waiting = await built_ins.await_question_answer_wait(step_context(flow, AWAIT_QUESTION_ANSWER, values), "c1")
    assert waiting == Wait.any_of(
        TOOL_CALL_CANCELLATIONS["c1"].for_one(), INTERRUPT_RESOLUTIONS["c1-input-1"].for_one())
