"""cancel_turn: the RPC, FinishTurnCancellation, the cancelled flag at every boundary, and the turn's end
through ApplyTurnControl (seed 002 "Steering and cancellation rules", the RPC table and the Steps
FinishTurnCancellation and ApplyTurnControl; seed 003 "Steering and turn cancellation").

The integration tests drive the scripted runner in one Worker child shared by the module, each
with its own session, and hold a model call, a tool or a task poll at a FileGate while they cancel.
The Step handlers and the RPC are also called on built contexts for the boundaries a live Worker
cannot be made to hit on purpose (a tool Step that starts after cancel_turn committed, a question
not raised yet), and the pure decision of FinishTurnCancellation is tested as a function.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import pytest
import pytest_asyncio
from agents.tests.built_context import filling, runtime_of, step_context, tool_call
from agents.tests.conftest import REPO_ROOT, WORKER_MODULE
from agents.tests.scripted_agent import ENV_BUILT_IN_TOOLS, build_flow, item
from agents.tests.session_driver import Session

from dex_agents import (
    AGENT_STATE,
    AGENT_TOOL_CALLS,
    APPLY_TURN_CONTROL,
    AWAIT_QUESTION_ANSWER,
    AWAIT_TIMER,
    AWAIT_TOOL_APPROVAL,
    CALL_SINGLE_ATTEMPT_TOOL,
    CALL_TOOL,
    CANCEL_TOOL_TASK,
    FINISH_TURN_CANCELLATION,
    INTERRUPT_RESOLUTIONS,
    PENDING_INTERRUPTS,
    POLL_TOOL_TASK,
    RESUME_TURN,
    STEERED_REJECTION_MESSAGE,
    TOOL_CALL_CANCELLATIONS,
    TOOL_CALL_RESULTS,
    TOOL_TASK_CANCELLED_ERROR,
    TURN_CANCELLATION_REQUEST,
    TURN_CANCELLED_REJECTION_MESSAGE,
    AgentEvent,
    AgentInterrupt,
    AgentInterruptResolution,
    AgentSessionFlow,
    AgentSnapshot,
    AgentState,
    AgentStatus,
    AgentToolCall,
    AgentToolCallStatus,
    BuiltInTool,
    CancellationReason,
    CancelTurnRequest,
    InterruptKind,
    MessageRole,
    QuestionAnswer,
    ToolEffect,
    TurnCancellationRequest,
    TurnControlKind,
    TurnControlRequest,
)
from dex_agents._builtin_steps import BuiltInSteps
from dex_agents._constants import CUT_NOTE_FIELD_CHARS
from dex_agents._control_steps import (
    CANCEL_TURN_CANCELING_STEPS,
    TURN_CONTROL_WAKE,
    CancellationAction,
    ControlSteps,
    abandoned_task_record,
    cancellation_action,
    cancelled_record,
)
from dex_agents._policy import CANCELLED_NOTE_HEADER, TOOL_CALL_NOTE_FOOTER, cut_text
from dex_agents._task_steps import TaskSteps, answered_task_record, cancelled_task_record
from dex_agents._timefmt import parse_time, utc_now_text
from dex_agents._tool_steps import ToolSteps
from dex_agents._turn_steps import TurnSteps
from dex_agents.testing import (
    AgentTestStack,
)
from dex_engine import MAX_VALUE_BYTES, Context, LoadOptions, RpcContext, RPCResult, Timer, Wait
from dex_engine._records import ConsumedMessage, WaitOutcome

BUILT_INS = frozenset({BuiltInTool.ASK_USER, BuiltInTool.DURABLE_WAIT})
RACE_ROUNDS = 20
RACE_MAX_ROUNDS = 40

# The integration tests share the module's event loop with the shared stack's Client.
shared_loop = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[AgentTestStack]:
    """The scripted Flow with ask_user and durable_wait, and one Worker child for the whole module."""
    tmp = tmp_path_factory.mktemp("cancel")
    flow = build_flow(tmp, built_in_tools=BUILT_INS)
    env = {ENV_BUILT_IN_TOOLS: ",".join(sorted(BUILT_INS))}
    async with AgentTestStack(tmp, [flow], WORKER_MODULE, worker_cwd=REPO_ROOT, worker_env=env) as s:
        await s.start_worker()
        yield s


@pytest.fixture
def session(request: pytest.FixtureRequest, stack: AgentTestStack) -> Session:
    return Session(stack, request.node.name.replace("[", "-").replace("]", ""))


def script(*steps: dict[str, Any]) -> str:
    return json.dumps({"steps": list(steps)})


def records_by_id(snapshot: AgentSnapshot) -> dict[str, AgentToolCall]:
    return {r.tool_call_id: r for r in snapshot.tool_calls}


def note_of(snapshot: AgentSnapshot, turn_id: str) -> str | None:
    users = [m for m in snapshot.messages if m.turn_id == turn_id and m.role is MessageRole.USER]
    return users[1].text if len(users) > 1 else None


# The pure decision of FinishTurnCancellation ----------------------------------------------------


def _interrupt(interrupt_id: str, tool_call_id: str = "c1", kind: InterruptKind = InterruptKind.QUESTION,
               ) -> AgentInterrupt:
    return AgentInterrupt(interrupt_id=interrupt_id, kind=kind, tool_call_id=tool_call_id, tool_name="t",
                          arguments="{}", created_at="2026-01-01T00:00:00.000Z", deadline=None, question="Q?")


A = CancellationAction
S = AgentToolCallStatus


@pytest.mark.parametrize(("status", "fields", "pending", "action"), [
    (S.SUCCEEDED, {}, [], A.NONE), (S.REJECTED, {}, [], A.NONE), (S.FAILED, {}, [], A.NONE),
    (S.OUTCOME_UNKNOWN, {"task_id": "t"}, [], A.NONE),
    (S.APPROVED, {}, [], A.NONE),  # its tool Step checks the flag itself, or runs to the end
    (S.WAITING_FOR_TIMER, {}, [], A.RECORD_CANCELLED),
    (S.AWAITING_APPROVAL, {}, ["c1"], A.RECORD_CANCELLED),
    (S.AWAITING_APPROVAL, {}, [], A.BACK_TO_WAIT),  # resolve_interrupt committed first
    (S.AWAITING_ANSWER, {}, ["c1"], A.RECORD_CANCELLED),  # ask_user
    (S.AWAITING_ANSWER, {"input_question": "Q?"}, ["c1-input-1"], A.RECORD_CANCELLED),
    (S.AWAITING_ANSWER, {"input_question": "Q?"}, [], A.BACK_TO_WAIT),  # answered, or not raised yet
    (S.AWAITING_ANSWER, {"input_question": "Q?", "task_id": "t"}, ["c1-input-1"], A.CANCEL_TASK),
    (S.AWAITING_ANSWER, {"input_question": "Q?", "task_id": "t"}, [], A.BACK_TO_WAIT),
    (S.WAITING_FOR_TASK, {"task_id": "t"}, [], A.CANCEL_TASK),
    (S.WAITING_FOR_TASK, {"task_id": "t", "cancellation_reason": CancellationReason.TURN_CANCELLED}, [], A.NONE),
])
def test_finish_turn_cancellation_decides_each_record_from_committed_state(
    status: AgentToolCallStatus, fields: dict[str, Any], pending: list[str], action: CancellationAction,
) -> None:
    """A wait whose interrupt is still pending (or a durable wait) is recorded cancelled; one whose
    answer committed first goes back to its waiting Step; a started task goes to CancelToolTask once;
    final and approved records belong to someone else."""
    interrupts = [_interrupt(i) for i in pending] + [_interrupt("c2", "c2")]
    assert cancellation_action(tool_call(status, **fields), interrupts) is action


def test_a_cancelled_record_is_rejected_with_its_reason_and_the_structured_message() -> None:
    record = tool_call(S.AWAITING_ANSWER, input_question="Q?", input_choices=["a"], input_allows_free_text=False)
    cancelled = cancelled_record(record, CancellationReason.TURN_CANCELLED)
    assert (cancelled.status, cancelled.cancellation_reason, cancelled.rejection_message) == (
        S.REJECTED, CancellationReason.TURN_CANCELLED, TURN_CANCELLED_REJECTION_MESSAGE)
    assert (cancelled.input_question, cancelled.input_choices, cancelled.input_allows_free_text) == (None, [], True)
    steered = cancelled_record(tool_call(S.AWAITING_APPROVAL), CancellationReason.STEERED)
    assert (steered.cancellation_reason, steered.rejection_message) == (
        CancellationReason.STEERED, STEERED_REJECTION_MESSAGE)


@pytest.mark.parametrize("leave_the_question", [
    lambda r: cancelled_record(r, CancellationReason.STEERED),
    abandoned_task_record,
    lambda r: answered_task_record(r, QuestionAnswer("c1-input-2", "Go?", "yes")),
    cancelled_task_record,
], ids=["cancelled", "abandoned_task", "answered_task", "cancelled_task"])
def test_a_record_leaving_its_question_drops_all_of_it_and_keeps_the_answers(
    leave_the_question: Callable[[AgentToolCall], AgentToolCall],
) -> None:
    """Each way a call stops waiting for its answer shows no question any more, in every field the
    snapshot carries (a stale allows_free_text=false would tell a UI the call still limits the
    answer to its choices), and keeps the continuation and the answers given before."""
    earlier = QuestionAnswer("c1-input-1", "Sure?", "no")
    asking = tool_call(S.AWAITING_ANSWER, task_id="job-1", input_question="Go?", input_choices=["yes", "no"],
                       input_allows_free_text=False, input_continuation="k1", input_answers=[earlier])
    left = leave_the_question(asking)
    assert (left.input_question, left.input_choices, left.input_allows_free_text) == (None, [], True)
    assert (left.input_continuation, left.input_answers[0]) == ("k1", earlier)


# cancel_turn through a live Worker --------------------------------------------------------------


@shared_loop
async def test_cancel_during_a_model_call_cancels_it_and_drops_its_result(session: Session) -> None:
    """cancel_turn cancels the running RunModel (step_cancelled, never committed); FinishTurnCancellation
    finds the model phase and moves to ApplyTurnControl, which ends the turn with turn_cancelled and
    no note (no tool ran) and starts nothing. The model call's answer never appears."""
    await session.start(script({"gate": session.gate_name("model"), "heartbeat": True, "answer": "too late"}))
    await session.gate("model").wait_until_reached()
    assert not await session.cancel("turn-2")  # another turn's ID
    assert await session.cancel("turn-1")
    done = await session.turns_ended(1)
    assert [m.role for m in done.messages] == [MessageRole.USER]
    assert done.state is not None and done.state.status is AgentStatus.WAITING_FOR_USER_MESSAGE
    assert (done.state.last_turn_error, done.state.accepts_turn_control) == (None, False)
    [(event, cancelled)] = await session.events("turn_cancelled")
    assert event.turn_id == "turn-1" and cancelled == {"message_count": 0}
    assert await session.events("turn_completed") == []
    assert await session.steps() == ["StartAgentSession", "FinishTurnCancellation", "ApplyTurnControl"]
    assert await session.cancelled_steps() == ["RunModel"]
    assert not await session.cancel()  # no turn is active any more
    session.gate("model").release()  # the cancelled coroutine is gone: releasing changes nothing
    assert await session.sessions.send_user_message(session.id, "again")
    after = await session.turns_ended(2)
    assert [m.text for m in after.messages[1:]] == ["again", "echo: again"]
    assert session.count("model", turn_id="turn-1") == 1


@shared_loop
async def test_cancel_records_every_cancelled_wait_and_lets_a_started_tool_finish(session: Session) -> None:
    """While a read tool runs (held at a gate), cancel_turn cancels the approval, ask_user, tool
    question and durable wait Steps, and FinishTurnCancellation records each call rejected with
    cancellation_reason turn_cancelled, removing their interrupts (interrupt_resolved with
    cancellation_reason). A second cancel returns True and changes nothing; a steer in the
    cancelled turn is kept for the next turn. The started tool finishes, then ApplyTurnControl ends
    the turn as cancelled (not steered) with the cancelled note, and the steer starts turn-2."""
    calls = [
        {"id": "c1", "name": "read_slow", "args": {"gate": session.gate_name("c1")}},
        {"id": "c2", "name": "write_refund", "args": {}},
        {"id": "c3", "name": "ask_user", "args": {"question": "Which order?"}},
        {"id": "c4", "name": "durable_wait", "args": {"duration_seconds": 3600, "reason": "cool down"}},
        {"id": "c5", "name": "read_lookup", "args": {"ask": "Which account?"}},
    ]
    await session.start(script({"tools": calls}, {"answer": "unreachable"}))
    await session.gate("c1").wait_until_reached()
    await session.interrupts("c2", "c3", "c5-input-1")
    assert await session.cancel()
    first = await session.stack.client.get_attribute(session.id, TURN_CANCELLATION_REQUEST)
    assert first is not None and first.turn_id == "turn-1"

    def recorded(s: AgentSnapshot) -> AgentSnapshot | None:
        records = records_by_id(s)
        final = all(records[i].status is AgentToolCallStatus.REJECTED for i in ("c2", "c3", "c4", "c5"))
        return s if final and not s.pending_interrupts else None

    snapshot = await session.wait_for(recorded, "FinishTurnCancellation to record the waits")
    records = records_by_id(snapshot)
    for call_id in ("c2", "c3", "c4", "c5"):
        assert (records[call_id].cancellation_reason, records[call_id].rejection_message) == (
            CancellationReason.TURN_CANCELLED, TURN_CANCELLED_REJECTION_MESSAGE)
    assert records["c1"].status is AgentToolCallStatus.APPROVED
    assert await session.cancel() and await session.cancel("turn-1")  # already cancelled: True, no change
    assert await session.stack.client.get_attribute(session.id, TURN_CANCELLATION_REQUEST) == first
    assert not await session.sessions.resolve_interrupt(session.id, "c2", approved=True)
    assert await session.sessions.steer_user_message(session.id, text="after the cancel")
    resolved = {p["interrupt_id"]: p for _, p in await session.events("interrupt_resolved")}
    assert set(resolved) == {"c2", "c3", "c5-input-1"}
    assert {(p["cancellation_reason"], p["rejection_message"], p["approved"], p["answered"])
            for p in resolved.values()} == {("turn_cancelled", TURN_CANCELLED_REJECTION_MESSAGE, False, False)}
    session.gate("c1").release()
    done = await session.turns_ended(2)
    note = note_of(done, "turn-1")
    assert note is not None
    lines = note.splitlines()
    assert lines[0] == CANCELLED_NOTE_HEADER and lines[-1] == TOOL_CALL_NOTE_FOOTER
    assert lines[1].endswith("-> succeeded: read_slow done")
    assert sum(line.endswith(f"-> rejected: {TURN_CANCELLED_REJECTION_MESSAGE}") for line in lines) == 4
    [(event, cancelled)] = await session.events("turn_cancelled")
    assert event.turn_id == "turn-1" and cancelled == {"message_count": 1}
    assert await session.events("turn_steered") == []  # both flags: the turn ends as cancelled
    assert [m.text for m in done.messages if m.turn_id == "turn-2"] == ["after the cancel", "echo: after the cancel"]
    steps = await session.steps()
    assert steps.count("FinishTurnCancellation") == 1 and steps.count("ApplyTurnControl") == 1
    assert steps[-2:] == ["ApplyTurnControl", "RunModel"]
    assert "AwaitTimer" not in steps and "CallSingleAttemptTool" not in steps
    assert sorted(await session.cancelled_steps()) == sorted(
        ["AwaitToolApproval", "AwaitQuestionAnswer", "AwaitQuestionAnswer", "AwaitTimer"])
    assert session.count("tool_start", tool_call_id="c2") == 0 and session.count("tool_start", tool_call_id="c1") == 1


@shared_loop
async def test_cancel_abandons_started_tool_tasks_through_cancel_tool_task(session: Session) -> None:
    """A waiting_for_task call and a task's pending question: cancel_turn cancels PollToolTask and
    AwaitQuestionAnswer, FinishTurnCancellation keeps both waiting_for_task with cancellation_reason
    turn_cancelled (the question's interrupt removed) and moves each to CancelToolTask, which asks
    the runner to cancel the task and records outcome_unknown: the task may have run."""
    calls = [
        {"id": "c1", "name": "read_task", "args": {"task": {"polls": [{"pending": 3600}]}}},
        {"id": "c2", "name": "read_quiz", "args": {"task": {"polls": [{"ask": "Colour?"}, {"result": "x"}]}}},
    ]
    await session.start(script({"tools": calls}, {"answer": "unreachable"}))
    await session.interrupts("c2-input-1")
    await session.wait_for(lambda s: session.count("poll", tool_call_id="c1") >= 1 or None, "c1's first poll")
    assert await session.cancel()
    done = await session.turns_ended(1)
    assert session.count("task_cancel", tool_call_id="c1") == 1 and session.count("task_cancel", tool_call_id="c2") == 1
    note = note_of(done, "turn-1")
    assert note is not None and note.splitlines()[0] == CANCELLED_NOTE_HEADER
    assert sum("-> outcome_unknown:" in line for line in note.splitlines()) == 2
    finished = {p["tool_call_id"]: p["status"] for _, p in await session.events("tool_call_finished")}
    assert finished == {"c1": "outcome_unknown", "c2": "outcome_unknown"}
    [(_, resolved)] = await session.events("interrupt_resolved")
    assert (resolved["interrupt_id"], resolved["cancellation_reason"]) == ("c2-input-1", "turn_cancelled")
    steps = await session.steps()
    assert steps.count(FINISH_TURN_CANCELLATION) == 1 and steps.count(CANCEL_TOOL_TASK) == 2
    assert steps[-1] == APPLY_TURN_CONTROL
    assert POLL_TOOL_TASK in await session.cancelled_steps()
    assert TOOL_TASK_CANCELLED_ERROR  # the recorded error (its text belongs to the tool tasks feature)


@shared_loop
async def test_approval_and_cancel_race_never_runs_a_cancelled_write_unless_it_started(session: Session) -> None:
    """resolve_interrupt(approve) and cancel_turn issued together, many rounds. cancel_turn always
    records the request and the turn ends cancelled. Either FinishTurnCancellation removes the
    interrupt first (the approval returns False; the write is rejected as cancelled and never runs),
    or the approval commits first (True): the tool Step then finds the flag and records the call
    cancelled before it starts, or, when it had started, the write runs to the end. Both orders
    happen, and no round runs a write after recording it cancelled."""
    rng = random.Random(20260502)

    async def one_round(n: int) -> tuple[bool, str]:
        run = Session(session.stack, f"{session.id}-{n}")
        # The model call after the tool waits at a gate no one releases, so the turn cannot complete
        # before cancel_turn commits: cancel_turn then cancels that model call.
        await run.start(script({"tools": [{"id": "w", "name": "write_refund", "args": {}}]},
                               {"gate": run.gate_name("model"), "answer": "never"}))
        await run.interrupts("w")
        cancel_first = rng.random() < 0.5
        delay = rng.choice([0.0, 0.01, 0.05, 0.2, 0.5])

        async def approve() -> bool:
            if cancel_first:
                await asyncio.sleep(delay)
            return await run.sessions.resolve_interrupt(run.id, "w", approved=True)

        async def cancel() -> bool:
            if not cancel_first:
                await asyncio.sleep(delay)
            return await run.cancel()

        approved, cancelled = await asyncio.gather(approve(), cancel())
        assert cancelled
        done = await run.turns_ended(1)
        [(_, finished)] = await run.events("tool_call_finished")
        ran = run.count("tool_start", tool_call_id="w")
        if finished["status"] == "rejected":
            assert ran == 0
            assert f"-> rejected: {TURN_CANCELLED_REJECTION_MESSAGE}" in (note_of(done, "turn-1") or "")
        else:
            assert (finished["status"], approved, ran) == ("succeeded", True, 1)
        if not approved:
            assert finished["status"] == "rejected"
        assert [e.turn_id for e, _ in await run.events("turn_cancelled")] == ["turn-1"]
        return approved, finished["status"]

    outcomes: list[tuple[bool, str]] = []
    rounds = 0
    while rounds < RACE_ROUNDS or (len({a for a, _ in outcomes}) < 2 and rounds < RACE_MAX_ROUNDS):
        batch = range(rounds, rounds + 10)
        outcomes.extend(await asyncio.gather(*(one_round(n) for n in batch)))
        rounds += len(batch)
    assert {approved for approved, _ in outcomes} == {True, False}, outcomes


# Step handlers and the RPC on built contexts ------------------------------------------------------


class _NoTools:
    """A runner whose tools and model must not run."""

    def build_user_message(self, text: str) -> Any:
        return item(MessageRole.USER, text=text)

    async def run_model_step(self, turn: Any) -> Any:
        raise AssertionError("the model was called in a cancelled turn")

    async def execute_deferred_tool_call(self, call: Any) -> Any:
        raise AssertionError("a tool ran in a cancelled turn")


def _flow() -> AgentSessionFlow:
    return AgentSessionFlow(_NoTools(), "NoTools")  # type: ignore[arg-type]


def _state(**fields: Any) -> AgentState:
    state = AgentState(status=AgentStatus.RUNNING_TOOLS, turn_count=0, active_turn_id="turn-1",
                       next_message_sequence=3, last_turn_error=None, accepts_turn_control=True)
    return msgspec.structs.replace(state, **fields)


CANCELLED = TurnCancellationRequest(turn_id="turn-1", requested_at="2026-01-01T00:00:00.000Z")


def _event_payloads(ctx: Context, event_type: str) -> list[dict[str, Any]]:
    events = [msgspec.json.decode(data, type=AgentEvent) for _, _, data in ctx.writes.appends]
    return [json.loads(e.payload) for e in events if e.type == event_type]


@pytest.mark.parametrize(("values", "reason"), [
    ({("TurnCancellationRequest", ""): CANCELLED}, CancellationReason.TURN_CANCELLED),
    ({("SteeredMessageCount", ""): 1}, CancellationReason.STEERED),
    ({("TurnCancellationRequest", ""): CANCELLED, ("SteeredMessageCount", ""): 1}, CancellationReason.TURN_CANCELLED),
])
@pytest.mark.parametrize("step_type", [CALL_TOOL, CALL_SINGLE_ATTEMPT_TOOL])
async def test_a_tool_step_in_a_cancelled_or_steered_turn_never_starts_its_tool(
    step_type: str, values: dict[tuple[str, str], Any], reason: CancellationReason,
) -> None:
    """Before tool_call_started: the approved call is recorded rejected with cancellation_reason and
    the structured message, its one result is published, and the tool never runs (no event either)."""
    flow = _flow()
    tools = ToolSteps(runtime_of(flow))
    approved = tool_call(S.APPROVED, effect=ToolEffect.NON_IDEMPOTENT_WRITE)
    ctx = step_context(flow, step_type, {("AgentState", ""): _state(), ("AgentToolCalls", "c1"): approved, **values})
    handler = tools.call_tool if step_type == CALL_TOOL else tools.call_single_attempt_tool
    decision = await handler(ctx, "c1")
    assert decision.kind == "dead_end"
    record = ctx.get(AGENT_TOOL_CALLS["c1"])
    assert record is not None and (record.status, record.cancellation_reason) == (S.REJECTED, reason)
    assert [name for name, _, _ in ctx.writes.publishes] == ["ToolCallResults"]
    assert _event_payloads(ctx, "tool_call_started") == []
    assert _event_payloads(ctx, "tool_call_finished") == [
        {"tool_call_id": "c1", "tool_name": "t", "status": "rejected"}]


async def test_finish_turn_cancellation_records_hands_over_and_sends_back_in_one_commit() -> None:
    """Running tools: each call whose wait cancel_turn cancelled is settled from committed state in
    one commit under the PendingInterrupts lock, and FinishTurnCancellation never ends the turn."""
    flow = _flow()
    control = ControlSteps(runtime_of(flow), TurnSteps(runtime_of(flow)))
    records = [
        tool_call(S.AWAITING_APPROVAL, tool_call_id="a", deferral_order=0),
        tool_call(S.AWAITING_APPROVAL, tool_call_id="answered", deferral_order=1),
        tool_call(S.WAITING_FOR_TIMER, tool_call_id="w", deferral_order=2),
        tool_call(S.WAITING_FOR_TASK, tool_call_id="t", deferral_order=3, task_id="task-1"),
        tool_call(S.AWAITING_ANSWER, tool_call_id="q", deferral_order=4, task_id="task-2", input_question="Q?"),
        tool_call(S.APPROVED, tool_call_id="run", deferral_order=5),
    ]
    pending = [_interrupt("a", "a", InterruptKind.TOOL_APPROVAL), _interrupt("q-input-1", "q"),
               _interrupt("other", "elsewhere")]
    values: dict[tuple[str, str], Any] = {("AgentToolCalls", r.tool_call_id): r for r in records}
    values |= {("AgentState", ""): _state(), ("TurnCancellationRequest", ""): CANCELLED,
               ("PendingInterrupts", ""): pending}
    ctx = step_context(flow, FINISH_TURN_CANCELLATION, values)
    decision = await control.finish_turn_cancellation(ctx, "turn-1")
    assert [(m.step_type, m.input) for m in decision.movements] == [
        (AWAIT_TOOL_APPROVAL, "answered"), (CANCEL_TOOL_TASK, "t"), (CANCEL_TOOL_TASK, "q")]
    after = {r.tool_call_id: r for r in ctx.items(AGENT_TOOL_CALLS).values()}
    assert (after["a"].status, after["a"].cancellation_reason) == (S.REJECTED, CancellationReason.TURN_CANCELLED)
    assert (after["w"].status, after["w"].rejection_message) == (S.REJECTED, TURN_CANCELLED_REJECTION_MESSAGE)
    for task in ("t", "q"):
        assert (after[task].status, after[task].cancellation_reason) == (
            S.WAITING_FOR_TASK, CancellationReason.TURN_CANCELLED)
    assert after["q"].input_question is None
    assert after["answered"].status is S.AWAITING_APPROVAL and after["run"].status is S.APPROVED
    assert [i.interrupt_id for i in ctx.get(PENDING_INTERRUPTS) or []] == ["other"]
    assert [p["interrupt_id"] for p in _event_payloads(ctx, "interrupt_resolved")] == ["a", "q-input-1"]
    assert [v for n, _, v in ctx.writes.publishes if n == "ToolCallResults"] == [b'{"tool_call_id":"a"}',
                                                                                 b'{"tool_call_id":"w"}']
    state = ctx.get(AGENT_STATE)
    assert state is not None and state.active_turn_id == "turn-1"  # ResumeTurn ends the turn, not this Step
    # Run again on the committed result (e.g. PollToolTask moved here after the cancel): nothing twice.
    again = step_context(flow, FINISH_TURN_CANCELLATION, {
        **{("AgentToolCalls", k): r for k, r in after.items()}, ("AgentState", ""): _state(),
        ("TurnCancellationRequest", ""): CANCELLED, ("PendingInterrupts", ""): ctx.get(PENDING_INTERRUPTS),
    })
    decision = await control.finish_turn_cancellation(again, "turn-1")
    assert [(m.step_type, m.input) for m in decision.movements] == [(AWAIT_TOOL_APPROVAL, "answered")]
    assert again.writes.publishes == [] and again.writes.appends == []


def _answers_filling(slack: int) -> AgentToolCall:
    """A tool's second question, pending, on a call whose first answer nearly fills the value limit."""
    asked = tool_call(S.AWAITING_ANSWER, input_question="Q?", input_answers=[
        QuestionAnswer(interrupt_id="c1-input-1", question="Q?", answer="")])
    answer = "a" * (MAX_VALUE_BYTES - slack - len(msgspec.json.encode(asked)))
    return msgspec.structs.replace(asked, input_answers=[
        QuestionAnswer(interrupt_id="c1-input-1", question="Q?", answer=answer)])


@pytest.mark.parametrize(("record", "pending", "after", "answers"), [
    (filling(tool_call(S.AWAITING_APPROVAL, requires_approval=True), 20), "c1", S.REJECTED, 0),
    (filling(tool_call(S.WAITING_FOR_TIMER), 20), None, S.REJECTED, 0),
    (filling(tool_call(S.WAITING_FOR_TASK, task_id="task-1"), 10), None, S.WAITING_FOR_TASK, 0),  # marked: +15 bytes
    (_answers_filling(20), "c1-input-2", S.REJECTED, 1),  # its arguments are short: the answers go
])
async def test_finish_turn_cancellation_ends_a_call_whose_record_nearly_fills_the_value_limit(
    record: AgentToolCall, pending: str | None, after: AgentToolCallStatus, answers: int,
) -> None:
    """A call whose arguments (or answers) leave under ~100 bytes of the value limit: the rejection
    message and reason cancel_turn adds would not fit. Its arguments are cut (CUT_NOTE_FIELD_CHARS),
    then its answers dropped, and the call is settled as usual. Catches: the Step failing on every
    retry, so the cancel never finishes and ResumeTurn waits for ever."""
    flow = _flow()
    control = ControlSteps(runtime_of(flow), TurnSteps(runtime_of(flow)))
    interrupts = [] if pending is None else [_interrupt(pending)]
    ctx = step_context(flow, FINISH_TURN_CANCELLATION, {
        ("AgentToolCalls", "c1"): record, ("AgentState", ""): _state(), ("TurnCancellationRequest", ""): CANCELLED,
        ("PendingInterrupts", ""): interrupts})
    decision = await control.finish_turn_cancellation(ctx, "turn-1")
    stored = ctx.get(AGENT_TOOL_CALLS["c1"])
    assert stored is not None
    assert (stored.status, stored.cancellation_reason) == (after, CancellationReason.TURN_CANCELLED)
    assert stored.arguments == cut_text(record.arguments, CUT_NOTE_FIELD_CHARS)
    assert len(stored.input_answers) == (len(record.input_answers) if answers == 0 else 0)
    if after is S.REJECTED:
        assert stored.rejection_message == TURN_CANCELLED_REJECTION_MESSAGE
        assert [v for n, _, v in ctx.writes.publishes] == [b'{"tool_call_id":"c1"}']
        assert decision.kind == "dead_end" and ctx.get(PENDING_INTERRUPTS) == []
    else:
        assert [(m.step_type, m.input) for m in decision.movements] == [(CANCEL_TOOL_TASK, "c1")]


async def test_cancel_tool_task_ends_an_abandoned_task_whose_record_nearly_fills_the_value_limit() -> None:
    """CancelToolTask's outcome_unknown adds its ~90-character error: a record 50 bytes under the
    limit is stored with its arguments cut, and the call's one result published."""
    flow = _flow()
    runtime = runtime_of(flow)
    abandoned = filling(tool_call(S.WAITING_FOR_TASK, task_id="task-1",
                                  cancellation_reason=CancellationReason.TURN_CANCELLED), 50)
    ctx = step_context(flow, CANCEL_TOOL_TASK, {("AgentToolCalls", "c1"): abandoned, ("AgentState", ""): _state(),
                                                ("TurnCancellationRequest", ""): CANCELLED})
    assert (await TaskSteps(runtime, ToolSteps(runtime)).cancel_tool_task(ctx, "c1")).kind == "dead_end"
    stored = ctx.get(AGENT_TOOL_CALLS["c1"])
    assert stored is not None
    assert (stored.status, stored.error) == (S.OUTCOME_UNKNOWN, TOOL_TASK_CANCELLED_ERROR)
    assert stored.arguments == cut_text(abandoned.arguments, CUT_NOTE_FIELD_CHARS)
    assert [n for n, _, _ in ctx.writes.publishes] == ["ToolCallResults"]


async def test_a_steered_durable_wait_whose_record_nearly_fills_the_value_limit_ends() -> None:
    """A steer abandons a durable wait the same way: AwaitTimer, woken in a steered turn, stores the
    rejected record with its arguments cut rather than failing on every retry."""
    flow = build_flow(None, built_in_tools=BUILT_INS)
    timer = filling(tool_call(S.WAITING_FOR_TIMER, tool_name="durable_wait", wait_until="2026-01-01T00:01:00.000Z"),
                    20)
    wake = ConsumedMessage(1, msgspec.Raw(b'{"reason":"steered"}'))
    waited = (Wait.any_of(Timer.by_duration(60), TOOL_CALL_CANCELLATIONS["c1"].for_one()),
              WaitOutcome(satisfied=(1,), consumed=((), (wake,))))
    ctx = step_context(flow, AWAIT_TIMER, {("AgentToolCalls", "c1"): timer, ("AgentState", ""): _state(),
                                           ("SteeredMessageCount", ""): 1}, waited)
    assert (await BuiltInSteps(runtime_of(flow)).await_timer(ctx, "c1")).kind == "dead_end"
    stored = ctx.get(AGENT_TOOL_CALLS["c1"])
    assert stored is not None
    assert (stored.status, stored.cancellation_reason) == (S.REJECTED, CancellationReason.STEERED)
    assert stored.arguments == cut_text(timer.arguments, CUT_NOTE_FIELD_CHARS)


@pytest.mark.parametrize(("state", "cancellation", "expected"), [
    (_state(status=AgentStatus.RUNNING_MODEL), CANCELLED, [APPLY_TURN_CONTROL]),  # the model call was cancelled
    (_state(status=AgentStatus.COMPACTING_CONTEXT), CANCELLED, [APPLY_TURN_CONTROL]),
    (_state(active_turn_id=None, status=AgentStatus.WAITING_FOR_USER_MESSAGE), CANCELLED, []),  # ended first
    (_state(active_turn_id="turn-2"), CANCELLED, []),
    (_state(), TurnCancellationRequest(turn_id="turn-0", requested_at="x"), []),  # not this turn's request
])
async def test_finish_turn_cancellation_ends_only_a_cancelled_model_phase(
    state: AgentState, cancellation: TurnCancellationRequest, expected: list[str],
) -> None:
    """Outside running_tools the cancelled Step was the model call, the compaction or the failure
    route: ApplyTurnControl ends the turn. A turn that already ended, or is not cancelled: it ends."""
    flow = _flow()
    control = ControlSteps(runtime_of(flow), TurnSteps(runtime_of(flow)))
    ctx = step_context(flow, FINISH_TURN_CANCELLATION, {("AgentState", ""): state,
                                                   ("TurnCancellationRequest", ""): cancellation})
    decision = await control.finish_turn_cancellation(ctx, "turn-1")
    assert [m.step_type for m in decision.movements] == expected
    assert ctx.writes.empty()


WAITING_TIMER = tool_call(S.WAITING_FOR_TIMER, tool_call_id="w")
DONE = tool_call(S.SUCCEEDED, tool_call_id="done", output="ok")


@pytest.mark.parametrize(("state", "cancellation", "record"), [
    (None, CANCELLED, WAITING_TIMER),  # before StartAgentSession
    (_state(), None, WAITING_TIMER),  # no cancel_turn
    (_state(), TurnCancellationRequest(turn_id="turn-0", requested_at="x"), WAITING_TIMER),  # another turn's
    (_state(), CANCELLED, DONE),  # running tools with nothing left to settle
])
async def test_finish_turn_cancellation_with_nothing_to_settle_ends_its_branch_writing_nothing(
    state: AgentState | None, cancellation: TurnCancellationRequest | None, record: AgentToolCall,
) -> None:
    """A waiting call is settled only for the active turn that TurnCancellationRequest names; with no
    state, no request or another turn's request, the Step touches no call. When every call of the
    cancelled turn is already final, it ends its branch and leaves PendingInterrupts (another turn's
    interrupt) unwritten."""
    flow = _flow()
    control = ControlSteps(runtime_of(flow), TurnSteps(runtime_of(flow)))
    values: dict[tuple[str, str], Any] = {("AgentToolCalls", record.tool_call_id): record,
                                          ("PendingInterrupts", ""): [_interrupt("other", "elsewhere")]}
    if state is not None:
        values[("AgentState", "")] = state
    if cancellation is not None:
        values[("TurnCancellationRequest", "")] = cancellation
    ctx = step_context(flow, FINISH_TURN_CANCELLATION, values)
    decision = await control.finish_turn_cancellation(ctx, "turn-1")
    assert (decision.kind, decision.movements) == ("dead_end", ())
    assert ctx.writes.empty()


async def test_a_task_question_not_raised_in_a_cancelled_turn_goes_to_finish_turn_cancellation() -> None:
    """AwaitQuestionAnswer about to raise a started task's question in a cancelled turn asks nothing:
    the call waits for its task again and FinishTurnCancellation hands it to CancelToolTask. A
    question of a call without a task is recorded cancelled instead."""
    flow = _flow()
    built_ins = BuiltInSteps(runtime_of(flow))
    # The raise wait found no answer queued (the tool question was never raised).
    wait = Wait.all_of(Timer.by_duration(0), INTERRUPT_RESOLUTIONS["c1-input-1"].at_most(1))
    nothing = WaitOutcome(satisfied=(0, 1), consumed=((), ()), fired_timers=(0,))
    task_question = tool_call(S.AWAITING_ANSWER, task_id="task-1", input_question="Q?")
    values = {("AgentState", ""): _state(), ("TurnCancellationRequest", ""): CANCELLED,
              ("AgentToolCalls", "c1"): task_question, ("PendingInterrupts", ""): []}
    ctx = step_context(flow, AWAIT_QUESTION_ANSWER, values, (wait, nothing))
    decision = await built_ins.await_question_answer(ctx, "c1")
    assert [(m.step_type, m.input) for m in decision.movements] == [(FINISH_TURN_CANCELLATION, "turn-1")]
    record = ctx.get(AGENT_TOOL_CALLS["c1"])
    assert record is not None and (record.status, record.input_question) == (S.WAITING_FOR_TASK, None)
    assert ctx.get(PENDING_INTERRUPTS) == [] and _event_payloads(ctx, "interrupt_raised") == []
    plain = {**values, ("AgentToolCalls", "c1"): tool_call(S.AWAITING_ANSWER, input_question="Q?")}
    ctx = step_context(flow, AWAIT_QUESTION_ANSWER, plain, (wait, nothing))
    decision = await built_ins.await_question_answer(ctx, "c1")
    assert decision.kind == "dead_end"
    record = ctx.get(AGENT_TOOL_CALLS["c1"])
    assert record is not None and (record.status, record.cancellation_reason) == (
        S.REJECTED, CancellationReason.TURN_CANCELLED)


def _rpc(
    flow: AgentSessionFlow, values: dict[tuple[str, str], Any],
    in_flight: dict[tuple[str, str], list[tuple[int, bytes]]] | None = None,
) -> RpcContext:
    loaded = {key: msgspec.json.encode(value) for key, value in values.items()}
    return RpcContext(flow, "s", loaded, LoadOptions.all(), {}, "cancel_turn", in_flight)


async def test_cancel_turn_rpc_cancels_the_registered_steps_and_starts_finish_turn_cancellation() -> None:
    """cancel_turn writes TurnCancellationRequest(turn_id, requested_at) and returns True with canceling
    Steps RunModel, RecordTurnFailure, AwaitToolApproval, AwaitQuestionAnswer, AwaitTimer and the
    other seed Step types only where the Flow registers them, and next Step FinishTurnCancellation.
    requested_at is the time of the call (catches: a fixed time written)."""
    flow = build_flow(None)
    handler = flow.rpc("cancel_turn")
    assert set(handler.locks) == {"TurnCancellationRequest", "PendingInterrupts"}
    ctx = _rpc(flow, {("AgentState", ""): _state()})
    before = parse_time(utc_now_text())
    result = await handler.handler(ctx, CancelTurnRequest())
    after = parse_time(utc_now_text())
    assert isinstance(result, RPCResult) and result.output is True
    assert CANCEL_TURN_CANCELING_STEPS == ("RunModel", "CompactContext", "RecordTurnFailure", "AwaitToolApproval",
                                           "AwaitQuestionAnswer", "AwaitTimer", "PollToolTask")
    assert result.canceling_steps == tuple(s for s in CANCEL_TURN_CANCELING_STEPS if s in flow.steps)
    assert {"RunModel", "RecordTurnFailure", "AwaitToolApproval", "AwaitQuestionAnswer", "AwaitTimer"} <= set(
        result.canceling_steps)
    assert [(m.step_type, m.input) for m in result.next_steps] == [(FINISH_TURN_CANCELLATION, "turn-1")]
    written = ctx.get(TURN_CANCELLATION_REQUEST)
    assert written is not None and written.turn_id == "turn-1" and written.requested_at.endswith("Z")
    assert before <= parse_time(written.requested_at) <= after


async def test_cancel_turn_after_an_earlier_turn_was_cancelled_writes_its_own_request() -> None:
    """TurnCancellationRequest still names the earlier turn it cancelled: only a request for this turn
    means "already cancelled", so cancel_turn writes a new one and starts FinishTurnCancellation."""
    flow = build_flow(None)
    earlier = TurnCancellationRequest(turn_id="turn-0", requested_at="2026-01-01T00:00:00.000Z")
    ctx = _rpc(flow, {("AgentState", ""): _state(), ("TurnCancellationRequest", ""): earlier})
    result = await flow.rpc("cancel_turn").handler(ctx, CancelTurnRequest())
    assert isinstance(result, RPCResult) and result.output is True
    assert [(m.step_type, m.input) for m in result.next_steps] == [(FINISH_TURN_CANCELLATION, "turn-1")]
    written = ctx.get(TURN_CANCELLATION_REQUEST)
    assert written is not None and written.turn_id == "turn-1"


async def test_cancel_turn_queues_again_the_answers_a_cancelled_waiting_step_took() -> None:
    """An approval or answer that committed first, taken by a waiting Step's satisfied wait whose
    Execute has not committed, goes with that Step when cancel_turn cancels it (E9). cancel_turn
    publishes each such message again, as it was, on the call's channel (the question's interrupt ID
    for a tool question), so the Step FinishTurnCancellation sends the call back to applies it. Taken
    messages of calls that wait for nothing are left alone."""
    flow = build_flow(None)
    records = [
        tool_call(S.AWAITING_APPROVAL, tool_call_id="a"),
        tool_call(S.AWAITING_ANSWER, tool_call_id="ask", tool_name="ask_user"),
        tool_call(S.AWAITING_ANSWER, tool_call_id="q", input_question="Which?"),
        tool_call(S.APPROVED, tool_call_id="ran"),
        tool_call(S.AWAITING_APPROVAL, tool_call_id="other", turn_id="turn-0"),
    ]
    approval = msgspec.json.encode(AgentInterruptResolution(approved=True, rejection_message=None))
    answer = msgspec.json.encode(AgentInterruptResolution(approved=True, rejection_message=None, answer="blue"))
    taken = {
        (INTERRUPT_RESOLUTIONS.name, "a"): [(7, approval)],
        (INTERRUPT_RESOLUTIONS.name, "ask"): [(8, answer)],
        (INTERRUPT_RESOLUTIONS.name, "q-input-1"): [(9, answer)],
        (INTERRUPT_RESOLUTIONS.name, "q"): [(10, answer)],  # not the question's ID
        (INTERRUPT_RESOLUTIONS.name, "ran"): [(11, approval)],
        (INTERRUPT_RESOLUTIONS.name, "other"): [(12, approval)],
    }
    values: dict[tuple[str, str], Any] = {("AgentToolCalls", r.tool_call_id): r for r in records}
    ctx = _rpc(flow, values | {("AgentState", ""): _state()}, taken)
    result = await flow.rpc("cancel_turn").handler(ctx, CancelTurnRequest())
    assert isinstance(result, RPCResult) and result.output is True
    assert sorted(ctx.writes.publishes) == [
        (INTERRUPT_RESOLUTIONS.name, "a", approval),
        (INTERRUPT_RESOLUTIONS.name, "ask", answer),
        (INTERRUPT_RESOLUTIONS.name, "q-input-1", answer),
    ]


@pytest.mark.parametrize(("values", "request_turn", "expected"), [
    ({}, None, False),  # before StartAgentSession
    ({("AgentState", ""): _state(active_turn_id=None)}, None, False),  # no active turn
    ({("AgentState", ""): _state()}, "turn-2", False),  # another turn
    ({("AgentState", ""): _state(accepts_turn_control=False)}, None, False),  # an earlier Worker's turn
    ({("AgentState", ""): _state(), ("TurnCancellationRequest", ""): CANCELLED}, "turn-1", True),  # again
])
async def test_cancel_turn_rpc_refusals_and_a_repeat_write_nothing(
    values: dict[tuple[str, str], Any], request_turn: str | None, expected: bool,
) -> None:
    flow = build_flow(None)
    ctx = _rpc(flow, values)
    assert await flow.rpc("cancel_turn").handler(ctx, CancelTurnRequest(request_turn)) is expected
    assert ctx.writes.empty()


@pytest.mark.parametrize("cancelled", [False, True])
async def test_resume_turn_woken_in_a_turn_both_steered_and_cancelled_leaves_the_waits_to_the_cancel(
    cancelled: bool,
) -> None:
    """ResumeTurn woken by a turn control request abandons the waits that took no effect only in a
    steered turn that is not cancelled (seed 002: "a turn that is both ends as cancelled", and
    FinishTurnCancellation owns a cancel): with both, a pending approval keeps its interrupt and
    record and no interrupt_resolved is written, so it is later resolved as turn_cancelled, not
    steered. Either way ResumeTurn waits again."""
    flow = _flow()
    approval = tool_call(AgentToolCallStatus.AWAITING_APPROVAL, effect=ToolEffect.NON_IDEMPOTENT_WRITE,
                         requires_approval=True)
    interrupt = _interrupt("c1", kind=InterruptKind.TOOL_APPROVAL)
    values: dict[tuple[str, str], Any] = {
        ("AgentState", ""): _state(), ("AgentToolCalls", "c1"): approval, ("PendingInterrupts", ""): [interrupt],
        ("SteeredMessageCount", ""): 1,
    }
    if cancelled:
        values[("TurnCancellationRequest", "")] = CANCELLED
    wake = ConsumedMessage(1, msgspec.Raw(msgspec.json.encode(TurnControlRequest(TurnControlKind.STEER))))
    wait = Wait.any_of(TOOL_CALL_RESULTS.for_n(1), TURN_CONTROL_WAKE)
    ctx = step_context(flow, RESUME_TURN, values, (wait, WaitOutcome(satisfied=(1,), consumed=((), (wake,)))))
    decision = await ToolSteps(runtime_of(flow)).resume_turn(ctx, 1)
    assert [(m.step_type, m.input) for m in decision.movements] == [(RESUME_TURN, 1)]
    resolved = _event_payloads(ctx, "interrupt_resolved")
    if cancelled:
        assert ctx.get(PENDING_INTERRUPTS) == [interrupt] and resolved == []
        assert ctx.writes.publishes == []
    else:
        assert ctx.get(PENDING_INTERRUPTS) == []
        assert [p["cancellation_reason"] for p in resolved] == ["steered"]


async def test_resume_turn_woken_by_a_steer_wakes_a_durable_wait_and_leaves_other_interrupts_unwritten() -> None:
    """A steer that removes no interrupt (the only abandonable call is a durable wait; the pending
    question belongs to a started task) wakes the wait and leaves PendingInterrupts, which
    cancel_turn locks, unwritten."""
    flow = _flow()
    records = [tool_call(S.WAITING_FOR_TIMER, tool_call_id="w", deferral_order=0),
               tool_call(S.AWAITING_ANSWER, tool_call_id="q", deferral_order=1, task_id="task-1", input_question="Q?")]
    values: dict[tuple[str, str], Any] = {("AgentToolCalls", r.tool_call_id): r for r in records}
    values |= {("AgentState", ""): _state(), ("PendingInterrupts", ""): [_interrupt("q-input-1", "q")],
               ("SteeredMessageCount", ""): 1}
    wake = ConsumedMessage(1, msgspec.Raw(msgspec.json.encode(TurnControlRequest(TurnControlKind.STEER))))
    wait = Wait.any_of(TOOL_CALL_RESULTS.for_n(2), TURN_CONTROL_WAKE)
    ctx = step_context(flow, RESUME_TURN, values, (wait, WaitOutcome(satisfied=(1,), consumed=((), (wake,)))))
    decision = await ToolSteps(runtime_of(flow)).resume_turn(ctx, 2)
    assert [(m.step_type, m.input) for m in decision.movements] == [(RESUME_TURN, 2)]
    assert [(n, k, msgspec.json.decode(v)) for n, k, v in ctx.writes.publishes] == [
        ("ToolCallCancellations", "w", {"reason": "steered"})]
    assert ctx.writes.attributes == {} and _event_payloads(ctx, "interrupt_resolved") == []
