"""Tool tasks: a tool returns ToolTaskStarted, PollToolTask polls it on a Timer, a task's questions go
through AwaitQuestionAnswer and back to the task, and CancelToolTask abandons a task cancel_turn stopped.

The sessions run the scripted runner (agents/tests/scripted_agent.py: `{"task": ...}` tool arguments
and a poll script), most on an in-process Worker (InProcessEngine), and the question, kill and
running-poll cancellation tests on real Worker processes. Pure rules are tested exhaustively, and
the Steps' handlers on built contexts where a live Worker cannot be made to hit a case on purpose.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import msgspec
import pytest
import pytest_asyncio
from agents.tests.built_context import runtime_of, step_context, tool_call
from agents.tests.builtin_agent import InProcessEngine
from agents.tests.conftest import REPO_ROOT, WORKER_MODULE
from agents.tests.scripted_agent import ENV_START_GATE, FLOW_TYPE, INVOCATIONS, ScriptedRunner, build_flow
from engine.tests.odd_values import UNSHOWABLE_SHOWN, Unshowable
from hypothesis import given
from hypothesis import strategies as st

from dex_agents import (
    AGENT_TOOL_CALLS,
    AWAIT_QUESTION_ANSWER,
    CANCEL_TOOL_TASK,
    MISSING_TOOL_TASK_POLLER,
    POLL_TOOL_TASK,
    RECORD_TOOL_FAILURE,
    RECORD_TOOL_OUTCOME_UNKNOWN,
    TOOL_TASK_CANCELLED_ERROR,
    AgentEvent,
    AgentSessionClient,
    AgentSessionFlow,
    AgentSessionOptions,
    AgentSnapshot,
    AgentState,
    AgentStatus,
    AgentToolCall,
    AgentToolCallStatus,
    AgentTurnContext,
    AgentTurnOutcome,
    CancellationReason,
    DeferredToolExecution,
    FrameworkMessage,
    QuestionAnswer,
    QuestionResolution,
    ToolEffect,
    ToolExecutionError,
    ToolExecutionResult,
    ToolInputRequested,
    ToolPolicy,
    ToolTaskCancellation,
    ToolTaskPending,
    ToolTaskPoll,
    ToolTaskPollOutcome,
    ToolTaskStarted,
    TurnCancellationRequest,
)
from dex_agents._builtin_steps import tool_question_id_in_use
from dex_agents._constants import FINISH_TURN_CANCELLATION
from dex_agents._task_steps import (
    TaskSteps,
    answered_task_record,
    cancelled_task_record,
    invalid_pending_error,
    invalid_task_error,
    pending_task_record,
    poll_failure_route,
    poll_tool_task_options,
    question_failure_status,
    resolve_task_question,
    started_task_record,
    status_by_effect,
    task_poll_interval_seconds,
    tool_task_pending_problem,
    tool_task_started_problem,
    turn_cancelled,
)
from dex_agents._tool_steps import ToolSteps, invalid_question_error
from dex_agents.demo import build_demo_flow
from dex_agents.testing import (
    ENV_DATABASE_URL,
    ENV_PARENT_PID,
    ENV_STATE_DIR,
    AgentTestStack,
    FileGate,
    InvocationLog,
    WorkerProcess,
    executed_steps,
    to_step_history,
    wait_for_agent_snapshot,
    wait_until,
)
from dex_engine import MAX_VALUE_BYTES, AttemptProgress, Context, RecoveryError, Timer, Wait
from dex_engine._context import HeartbeatFn

DAY = 86_400
# Tools by name prefix (scripted_agent.POLICIES); write_now is a single-attempt write with no approval.
NO_APPROVAL_WRITE = {"write_now": ToolPolicy(ToolEffect.NON_IDEMPOTENT_WRITE, requires_approval=False)}


# Pure rules -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "seconds"), [
    (0, 1), (0.0, 1), (-0.0, 1), (5e-324, 1), (0.001, 1), (0.999, 1), (1, 1), (1.0, 1), (1.0000001, 2),
    (1.5, 2), (2, 2), (59.01, 60), (-1, 1), (-2.5, 1), (-10**30, 1), (DAY - 1, DAY - 1), (DAY - 0.5, DAY),
    (DAY, DAY), (float(DAY), DAY), (DAY + 1e-6, DAY), (DAY + 1, DAY), (10**30, DAY), (10**400, DAY),
    (math.inf, DAY), (-math.inf, 1), (1e308, DAY),
])
def test_poll_interval_is_rounded_up_to_whole_seconds_from_1_to_a_day(value: float, seconds: int) -> None:
    """Dex Timers take whole seconds: an interval is rounded up, then clamped to 1 s .. 1 day."""
    result = task_poll_interval_seconds(value)
    assert result == seconds and type(result) is int


@pytest.mark.parametrize("value", [math.nan, -math.nan, True, False, "5", "1.5", None, [1], {"s": 1}, b"1"])
def test_poll_interval_that_is_not_a_number_is_refused(value: object) -> None:
    """NaN, booleans and non-numbers have no interval (the call is then recorded by effect)."""
    assert task_poll_interval_seconds(value) is None


@given(st.one_of(st.floats(allow_nan=False), st.integers()))
def test_poll_interval_property(value: float) -> None:
    """For every number: an int in 1..86400, never shorter than asked unless clamped to a day,
    and less than a second longer than asked unless clamped up to 1."""
    result = task_poll_interval_seconds(value)
    assert isinstance(result, int) and 1 <= result <= DAY
    if value <= DAY:
        assert result >= value
    if 1 <= value <= DAY:
        assert result - value < 1


@pytest.mark.parametrize(("task_id", "interval", "problem"), [
    ("job-1", 5, None),
    ("j", 0.2, None),
    ("", 5, "task_id must be non-empty text"),
    ("   ", 5, "task_id must be non-empty text"),
    (None, 5, "task_id must be non-empty text"),
    (7, 5, "task_id must be non-empty text"),
    ("job-1", "soon", "poll_interval_seconds must be a number, got 'soon'"),
    ("job-1", math.nan, "poll_interval_seconds must be a number, got nan"),
    ("job-1", None, "poll_interval_seconds must be a number, got None"),
    ("job-1", True, "poll_interval_seconds must be a number, got True"),
    # Named as shown() names values: a repr that raises failed the Step with its own error.
    ("job-1", Unshowable(), f"poll_interval_seconds must be a number, got {UNSHOWABLE_SHOWN}"),
    ("", "soon", "task_id must be non-empty text"),  # the ID is checked first
    ("job-\ud800", 5, "task_id is not valid UTF-8 text: '\\ud800' at position 4 is a lone surrogate"),
])
def test_tool_task_started_problems(task_id: Any, interval: Any, problem: str | None) -> None:
    """A ToolTaskStarted the session cannot poll: a blank or non-text task_id, or an interval that is
    not a number."""
    assert tool_task_started_problem(ToolTaskStarted(task_id=task_id, poll_interval_seconds=interval)) == problem


@pytest.mark.parametrize(("interval", "continuation", "problem"), [
    (3, None, None), (0.5, "k", None),
    ("later", None, "poll_interval_seconds must be a number, got 'later'"),
    (Unshowable(), None, f"poll_interval_seconds must be a number, got {UNSHOWABLE_SHOWN}"),
    (3, 5, "continuation must be text or None"),
    (3, "k\udc00", "continuation is not valid UTF-8 text: '\\udc00' at position 1 is a lone surrogate"),
])
def test_tool_task_pending_problems(interval: Any, continuation: Any, problem: str | None) -> None:
    assert tool_task_pending_problem(ToolTaskPending(poll_interval_seconds=interval, continuation=continuation)) == (
        problem)


def _record(effect: ToolEffect = ToolEffect.READ, **fields: Any) -> AgentToolCall:
    fields = {"status": AgentToolCallStatus.APPROVED, "tool_name": "read_report", "effect": effect, **fields}
    return tool_call(fields.pop("status"), **fields)


@pytest.mark.parametrize(("effect", "status", "route"), [
    (ToolEffect.READ, AgentToolCallStatus.FAILED, RECORD_TOOL_FAILURE),
    (ToolEffect.IDEMPOTENT_WRITE, AgentToolCallStatus.OUTCOME_UNKNOWN, RECORD_TOOL_FAILURE),
    (ToolEffect.NON_IDEMPOTENT_WRITE, AgentToolCallStatus.OUTCOME_UNKNOWN, RECORD_TOOL_OUTCOME_UNKNOWN),
    (ToolEffect.UNCLASSIFIED, AgentToolCallStatus.OUTCOME_UNKNOWN, RECORD_TOOL_OUTCOME_UNKNOWN),
])
def test_by_effect_rules(effect: ToolEffect, status: AgentToolCallStatus, route: str) -> None:
    """A started task that ends without a result: failed for a read, outcome_unknown otherwise; the
    poll's failure route is the one of the Step that started it; a question that cannot be asked
    fails a call with no task, and is recorded by effect for a task."""
    assert status_by_effect(_record(effect)) is status
    assert poll_failure_route(effect) == route
    assert question_failure_status(_record(effect)) is AgentToolCallStatus.FAILED
    assert question_failure_status(_record(effect, task_id="t")) is status
    options = poll_tool_task_options(_record(effect, task_id="t"))
    assert options.failure_route == route
    assert options.load is not None and ("AgentToolCalls", "c1") in options.load.instances
    assert {"AgentState", "TurnCancellationRequest"} <= set(options.load.names)


def _state(active: str | None) -> AgentState:
    return AgentState(status=AgentStatus.RUNNING_TOOLS, turn_count=0, active_turn_id=active, next_message_sequence=2,
                      last_turn_error=None)


@pytest.mark.parametrize(("active", "requested", "cancelled"), [
    ("turn-1", "turn-1", True), ("turn-1", None, False), ("turn-1", "turn-0", False), (None, "turn-1", False),
    ("turn-2", "turn-1", False), ("turn-2", "turn-2", False),
])
def test_turn_cancelled(active: str | None, requested: str | None, cancelled: bool) -> None:
    """A turn is cancelled while TurnCancellationRequest names it and it is the active turn."""
    request = None if requested is None else TurnCancellationRequest(turn_id=requested, requested_at="x")
    assert turn_cancelled(_state(active), request, "turn-1") is cancelled
    assert turn_cancelled(None, request, "turn-1") is False


def test_task_records() -> None:
    """Started: waiting_for_task with task_id and the rounded interval, continuation cleared. Pending:
    the next interval, and the continuation stored or cleared. Answered: the resolution appended,
    task_answer_pending set, the question cleared, its continuation kept. Cancelled: outcome_unknown
    with the fixed error and cancellation_reason, task_id kept."""
    approved = _record(input_continuation="from an earlier question")
    started = started_task_record(approved, ToolTaskStarted("job-1", 2.2))
    assert (started.status, started.task_id, started.task_poll_interval_seconds, started.input_continuation) == (
        AgentToolCallStatus.WAITING_FOR_TASK, "job-1", 3, None)
    kept = pending_task_record(started, ToolTaskPending(0.1, continuation="k1"))
    assert (kept.task_poll_interval_seconds, kept.input_continuation) == (1, "k1")
    assert pending_task_record(kept, ToolTaskPending(90000)).input_continuation is None
    asking = msgspec.structs.replace(kept, status=AgentToolCallStatus.AWAITING_ANSWER, input_question="Go?",
                                     input_choices=["yes", "no"], input_allows_free_text=False)
    answer = QuestionAnswer("c1-input-1", "Go?", "yes")
    answered = answered_task_record(asking, answer)
    assert (answered.status, answered.input_answers, answered.task_answer_pending) == (
        AgentToolCallStatus.WAITING_FOR_TASK, [answer], True)
    assert (answered.input_question, answered.input_choices, answered.input_continuation) == (None, [], "k1")
    cancelled = cancelled_task_record(answered)
    assert (cancelled.status, cancelled.error, cancelled.cancellation_reason, cancelled.task_id) == (
        AgentToolCallStatus.OUTCOME_UNKNOWN, TOOL_TASK_CANCELLED_ERROR, CancellationReason.TURN_CANCELLED, "job-1")
    assert TOOL_TASK_CANCELLED_ERROR == (
        "the turn was cancelled while the tool's task was running; the task may have taken effect")


# Handlers on built contexts ----------------------------------------------------------------------


class TaskRunner:
    """A runner whose polls and cancellations are recorded; a poll returns `next_poll`."""

    def __init__(self, *, canceller: bool = True, poller: bool = True) -> None:
        self.polls: list[ToolTaskPoll] = []
        self.cancellations: list[ToolTaskCancellation] = []
        self.next_poll: ToolTaskPollOutcome = ToolTaskPending(5)
        if not canceller:
            self.cancel_tool_task = None  # type: ignore[assignment]
        if not poller:
            self.poll_tool_task = None  # type: ignore[assignment]

    def build_user_message(self, text: str) -> FrameworkMessage:
        raise AssertionError("not used")

    async def run_model_step(self, turn: AgentTurnContext) -> AgentTurnOutcome:
        raise AssertionError("not used")

    async def execute_deferred_tool_call(self, call: DeferredToolExecution) -> ToolTaskStarted:
        raise AssertionError("not used")

    async def poll_tool_task(self, poll: ToolTaskPoll) -> ToolTaskPollOutcome:
        self.polls.append(poll)
        return self.next_poll

    async def cancel_tool_task(self, cancellation: ToolTaskCancellation) -> None:
        self.cancellations.append(cancellation)


def _context(
    flow: AgentSessionFlow,
    step_type: str,
    record: AgentToolCall,
    *,
    cancelled: bool = False,
    method: str = "execute",
    recovery: RecoveryError | None = None,
    heartbeat: HeartbeatFn | None = None,
) -> Context:
    values: dict[tuple[str, str], Any] = {
        ("AgentToolCalls", record.tool_call_id): record, ("AgentState", ""): _state(record.turn_id),
    }
    if cancelled:
        values[("TurnCancellationRequest", "")] = TurnCancellationRequest(
            turn_id=record.turn_id, requested_at="2026-01-01T00:00:00.000Z")
    return step_context(flow, step_type, values, method=method, recovery_error=recovery, heartbeat=heartbeat)


def _task_steps(runner: TaskRunner) -> tuple[AgentSessionFlow, TaskSteps, ToolSteps]:
    flow = AgentSessionFlow(runner, "Tasks", AgentSessionOptions())
    runtime = runtime_of(flow)
    tools = ToolSteps(runtime)
    return flow, TaskSteps(runtime, tools), tools


def _waiting(**fields: Any) -> AgentToolCall:
    waiting = {"status": AgentToolCallStatus.WAITING_FOR_TASK, "task_id": "job-1", "task_poll_interval_seconds": 7}
    return _record(**{**waiting, **fields})


async def test_poll_wait_is_the_interval_or_a_zero_timer() -> None:
    """The Timer of task_poll_interval_seconds; a zero Timer while an answer waits for the task or
    the turn is cancelled; nothing to wait for once the record is no longer waiting for its task."""
    flow, steps, _ = _task_steps(TaskRunner())
    wait = steps.poll_tool_task_wait
    assert await wait(_context(flow, POLL_TOOL_TASK, _waiting(), method="wait_for"), "c1") == Wait.until(
        Timer.by_duration(7))
    assert await wait(_context(flow, POLL_TOOL_TASK, _waiting(task_answer_pending=True), method="wait_for"),
                      "c1") == Wait.until(Timer.by_duration(0))
    assert await wait(_context(flow, POLL_TOOL_TASK, _waiting(), cancelled=True, method="wait_for"), "c1") == (
        Wait.until(Timer.by_duration(0)))
    done = _waiting(status=AgentToolCallStatus.SUCCEEDED)
    assert await wait(_context(flow, POLL_TOOL_TASK, done, method="wait_for"), "c1") == Wait.skip_immediately()
    # A record with no interval waits the minimum, never a Timer of no duration (a poll loop).
    unset = _waiting(task_poll_interval_seconds=None)
    assert await wait(_context(flow, POLL_TOOL_TASK, unset, method="wait_for"), "c1") == Wait.until(
        Timer.by_duration(1))


async def test_poll_hands_over_the_pending_answer_once_and_stores_the_next_interval() -> None:
    """With task_answer_pending the poll gets the last answer as pending_answer and the question's
    continuation; its commit clears task_answer_pending, stores the rounded interval and the new
    continuation, and moves to PollToolTask with the failure route by effect."""
    runner = TaskRunner()
    runner.next_poll = ToolTaskPending(2.5, continuation="next")
    flow, steps, _ = _task_steps(runner)
    first = QuestionAnswer("c1-input-1", "A?", "a")
    second = QuestionAnswer("c1-input-2", "B?", "no", QuestionResolution.DECLINED)
    record = _waiting(effect=ToolEffect.NON_IDEMPOTENT_WRITE, input_answers=[first, second], task_answer_pending=True,
                      input_continuation="q2")
    ctx = _context(flow, POLL_TOOL_TASK, record)
    decision = await steps.poll_tool_task(ctx, "c1")
    [poll] = runner.polls
    assert (poll.pending_answer, list(poll.input_answers), poll.tool_call.input_continuation) == (
        second, [first, second], "q2")
    assert (poll.idempotency_key, poll.flow_id, poll.attempt) == ("s/turn-1/c1", "s", 1)
    stored = ctx.get(AGENT_TOOL_CALLS["c1"])
    assert stored is not None
    assert (stored.status, stored.task_answer_pending) == (AgentToolCallStatus.WAITING_FOR_TASK, False)
    assert (stored.task_poll_interval_seconds, stored.input_continuation) == (3, "next")
    [movement] = decision.movements
    assert (movement.step_type, movement.input) == (POLL_TOOL_TASK, "c1")
    assert movement.options is not None and movement.options.failure_route == RECORD_TOOL_OUTCOME_UNKNOWN
    # Without task_answer_pending, the same answers are not handed over again.
    runner.polls.clear()
    await steps.poll_tool_task(_context(flow, POLL_TOOL_TASK, stored), "c1")
    assert runner.polls[0].pending_answer is None


async def test_poll_in_a_cancelled_turn_moves_to_finish_turn_cancellation_without_polling() -> None:
    """A PollToolTask that starts after cancel_turn committed never polls: FinishTurnCancellation(turn)."""
    runner = TaskRunner()
    flow, steps, _ = _task_steps(runner)
    ctx = _context(flow, POLL_TOOL_TASK, _waiting(task_answer_pending=True), cancelled=True)
    decision = await steps.poll_tool_task(ctx, "c1")
    assert [(m.step_type, m.input) for m in decision.movements] == [(FINISH_TURN_CANCELLATION, "turn-1")]
    assert runner.polls == []
    assert ctx.writes.attributes == {} and ctx.writes.publishes == []
    # A task CancelToolTask owns (cancellation_reason set) is never polled either.
    abandoned = _waiting(cancellation_reason=CancellationReason.TURN_CANCELLED)
    assert (await steps.poll_tool_task(_context(flow, POLL_TOOL_TASK, abandoned), "c1")).kind == "dead_end"
    assert runner.polls == []


async def test_task_steps_whose_record_is_gone_or_final_neither_poll_nor_cancel() -> None:
    """A PollToolTask or CancelToolTask whose record was deleted (the turn failed while it was
    scheduled) ends without calling the runner or writing, the poll skipping its wait; and a poll
    whose call became final first ends the same way: one result per call, no poll after it."""
    runner = TaskRunner()
    flow, steps, _ = _task_steps(runner)
    no_record = {("AgentState", ""): _state("turn-1")}
    assert await steps.poll_tool_task_wait(step_context(flow, POLL_TOOL_TASK, no_record, method="wait_for"), "c1") == (
        Wait.skip_immediately())
    gone = step_context(flow, POLL_TOOL_TASK, no_record)
    assert (await steps.poll_tool_task(gone, "c1")).kind == "dead_end"
    assert gone.writes.empty()
    done = _context(flow, POLL_TOOL_TASK, _waiting(status=AgentToolCallStatus.SUCCEEDED, output="ok"))
    assert (await steps.poll_tool_task(done, "c1")).kind == "dead_end"
    assert done.writes.empty()
    assert runner.polls == []
    gone = step_context(flow, CANCEL_TOOL_TASK, no_record)
    assert (await steps.cancel_tool_task(gone, "c1")).kind == "dead_end"
    assert gone.writes.empty() and runner.cancellations == []


@pytest.mark.parametrize(("effect", "status"), [
    (ToolEffect.READ, AgentToolCallStatus.FAILED), (ToolEffect.IDEMPOTENT_WRITE, AgentToolCallStatus.OUTCOME_UNKNOWN),
])
async def test_poll_on_a_runner_that_lost_its_poller_records_the_call_by_effect(
    effect: ToolEffect, status: AgentToolCallStatus
) -> None:
    """A task polled on a Worker whose runner has no poll_tool_task (it had one when the task started):
    the call is recorded by effect with MISSING_TOOL_TASK_POLLER, as a start on such a runner is,
    instead of failing the Step on the missing method; the answer is no longer pending."""
    flow, steps, _ = _task_steps(TaskRunner(poller=False))
    ctx = _context(flow, POLL_TOOL_TASK, _waiting(effect=effect, task_answer_pending=True,
                                                  input_answers=[QuestionAnswer("c1-input-1", "A?", "a")]))
    assert (await steps.poll_tool_task(ctx, "c1")).kind == "dead_end"
    stored = ctx.get(AGENT_TOOL_CALLS["c1"])
    assert stored is not None
    assert (stored.status, stored.error, stored.task_id, stored.task_answer_pending) == (
        status, MISSING_TOOL_TASK_POLLER, "job-1", False)
    assert [p[0] for p in ctx.writes.publishes] == ["ToolCallResults"]


@pytest.mark.parametrize("outcome", [None, "done", ToolExecutionResult(5)],  # type: ignore[arg-type]
                         ids=["none", "text", "number-output"])
async def test_poll_outcome_that_is_not_a_text_result_fails_the_step_and_records_nothing(outcome: Any) -> None:
    """poll_tool_task must return ToolExecutionResult(output: str), ToolTaskPending or
    ToolInputRequested: anything else, or a result whose output is not text, is a runner contract
    breach that fails the Step (its retries, then the failure route), never a succeeded record."""
    runner = TaskRunner()
    runner.next_poll = outcome
    flow, steps, _ = _task_steps(runner)
    ctx = _context(flow, POLL_TOOL_TASK, _waiting())
    with pytest.raises(TypeError, match=rf"^poll_tool_task returned {re.escape(repr(outcome))}; return "
                       r"ToolExecutionResult\(output: str\), ToolTaskPending or ToolInputRequested, or raise "
                       r"ToolExecutionError$"):
        await steps.poll_tool_task(ctx, "c1")
    assert ctx.writes.empty()


class HeartbeatingTaskRunner(TaskRunner):
    """A poll and a cancellation that each heartbeat twice themselves, as long ones do."""

    async def poll_tool_task(self, poll: ToolTaskPoll) -> ToolTaskPollOutcome:
        await poll.heartbeat()
        await poll.heartbeat()
        return await super().poll_tool_task(poll)

    async def cancel_tool_task(self, cancellation: ToolTaskCancellation) -> None:
        await cancellation.heartbeat()
        await cancellation.heartbeat()
        await super().cancel_tool_task(cancellation)


async def test_the_runners_heartbeats_in_a_poll_or_a_cancellation_heartbeat_the_attempt() -> None:
    """ToolTaskPoll.heartbeat and ToolTaskCancellation.heartbeat are the attempt's own heartbeat: one
    per call the runner makes, after PollToolTask's durable one before the poll (the background ones
    are 20 s away)."""
    heartbeats: list[str | None] = []

    async def heartbeat(checkpoint: str | None) -> None:
        heartbeats.append(checkpoint)

    runner = HeartbeatingTaskRunner()
    flow, steps, _ = _task_steps(runner)
    await steps.poll_tool_task(_context(flow, POLL_TOOL_TASK, _waiting(), heartbeat=heartbeat), "c1")
    assert len(runner.polls) == 1 and heartbeats == [None, None, None]
    heartbeats.clear()
    abandoned = _waiting(cancellation_reason=CancellationReason.TURN_CANCELLED)
    await steps.cancel_tool_task(_context(flow, CANCEL_TOOL_TASK, abandoned, heartbeat=heartbeat), "c1")
    assert len(runner.cancellations) == 1 and heartbeats == [None, None]


class FailingTaskRunner(TaskRunner):
    """A runner whose poll raises ToolExecutionError, after recording it."""

    async def poll_tool_task(self, poll: ToolTaskPoll) -> ToolTaskPollOutcome:
        self.polls.append(poll)
        raise ToolExecutionError("the task failed")


@pytest.mark.parametrize("outcome", [
    ToolTaskPending(5), ToolInputRequested(question="Which region?", continuation="p1"),
    ToolExecutionResult("done"), "raises",
], ids=["pending", "question", "result", "raises"])
async def test_a_polls_event_writer_is_closed_when_the_poll_returns(outcome: ToolTaskPollOutcome | str) -> None:
    """Whatever the poll returns or raises, its ToolTaskPoll.events is closed by the time
    PollToolTask decides, so a runner's later writes through it are dropped (seed 003: "writes
    after the call returns are dropped"). Catches a poll whose writer is left open."""
    runner = FailingTaskRunner() if outcome == "raises" else TaskRunner()
    if not isinstance(outcome, str):
        runner.next_poll = outcome
    flow, steps, _ = _task_steps(runner)
    await steps.poll_tool_task(_context(flow, POLL_TOOL_TASK, _waiting()), "c1")
    [poll] = runner.polls
    assert poll.events.closed


@pytest.mark.parametrize(("effect", "status"), [
    (ToolEffect.READ, AgentToolCallStatus.FAILED),
    (ToolEffect.NON_IDEMPOTENT_WRITE, AgentToolCallStatus.OUTCOME_UNKNOWN),
])
async def test_pending_the_session_cannot_store_records_the_call_by_effect(
    effect: ToolEffect, status: AgentToolCallStatus
) -> None:
    """A ToolTaskPending whose interval is not a number, or whose continuation makes the record too
    large to store, leaves the task running with nothing to poll it with: the call is recorded by
    effect with the error that says which, and the Step ends."""
    runner = TaskRunner()
    flow, steps, _ = _task_steps(runner)
    prefix = "poll_tool_task returned an invalid ToolTaskPending: "
    cases = [
        (ToolTaskPending("later"), re.escape(f"{prefix}poll_interval_seconds must be a number, got 'later'")),
        (ToolTaskPending(5, continuation="k" * MAX_VALUE_BYTES), re.escape(f"{prefix}the continuation makes the call ")
         + rf"\d+ bytes, over the session's value limit of {MAX_VALUE_BYTES}"),
    ]
    for pending, error in cases:
        runner.next_poll = pending
        ctx = _context(flow, POLL_TOOL_TASK, _waiting(effect=effect))
        assert (await steps.poll_tool_task(ctx, "c1")).kind == "dead_end"
        stored = ctx.get(AGENT_TOOL_CALLS["c1"])
        assert stored is not None and stored.status is status
        assert re.fullmatch(error, stored.error or ""), stored.error
        assert (stored.task_id, stored.input_continuation) == ("job-1", None)


async def test_resolved_task_question_waits_for_the_next_poll_with_the_question_asked() -> None:
    """AwaitQuestionAnswer's resolution of a started task's question: the QuestionAnswer keeps the
    question the task asked (the task reads it back in input_answers), and the call waits for its
    next poll, on the failure route of its effect. A resolution too large to store records the call
    by effect with the sizes instead: the task may run."""
    flow, steps, _ = _task_steps(TaskRunner())
    asking = _waiting(effect=ToolEffect.IDEMPOTENT_WRITE, status=AgentToolCallStatus.AWAITING_ANSWER,
                      input_question="Format?", input_choices=["pdf", "csv"], input_continuation="p1")
    ctx = _context(flow, AWAIT_QUESTION_ANSWER, asking)
    decision = resolve_task_question(steps.rt, ctx, asking, "c1-input-1", QuestionResolution.ANSWERED, "csv")
    stored = ctx.get(AGENT_TOOL_CALLS["c1"])
    assert stored is not None
    assert stored.input_answers == [QuestionAnswer("c1-input-1", "Format?", "csv", QuestionResolution.ANSWERED)]
    assert (stored.status, stored.task_answer_pending, stored.input_question, stored.input_continuation) == (
        AgentToolCallStatus.WAITING_FOR_TASK, True, None, "p1")
    [movement] = decision.movements
    assert (movement.step_type, movement.input) == (POLL_TOOL_TASK, "c1")
    assert movement.options is not None and movement.options.failure_route == RECORD_TOOL_FAILURE

    ctx = _context(flow, AWAIT_QUESTION_ANSWER, asking)
    decision = resolve_task_question(steps.rt, ctx, asking, "c1-input-1", QuestionResolution.ANSWERED,
                                     "x" * MAX_VALUE_BYTES)
    assert decision.kind == "dead_end"
    stored = ctx.get(AGENT_TOOL_CALLS["c1"])
    assert stored is not None
    assert (stored.status, stored.input_question, stored.input_answers) == (
        AgentToolCallStatus.OUTCOME_UNKNOWN, None, [])
    assert re.fullmatch(rf"the resolution of the task question makes the call \d+ bytes, over the session's value "
                        rf"limit of {MAX_VALUE_BYTES}; it was not stored", stored.error or ""), stored.error
    assert [p[0] for p in ctx.writes.publishes] == ["ToolCallResults"]


@pytest.mark.parametrize("canceller", [True, False])
async def test_cancel_tool_task_records_outcome_unknown(canceller: bool) -> None:
    """CancelToolTask calls cancel_tool_task when the runner has it, then records outcome_unknown with
    the fixed error and cancellation_reason turn_cancelled, and publishes the call's one result."""
    runner = TaskRunner(canceller=canceller)
    flow, steps, _ = _task_steps(runner)
    record = _waiting(effect=ToolEffect.IDEMPOTENT_WRITE, cancellation_reason=CancellationReason.TURN_CANCELLED)
    ctx = _context(flow, CANCEL_TOOL_TASK, record)
    assert (await steps.cancel_tool_task(ctx, "c1")).kind == "dead_end"
    if canceller:
        [cancellation] = runner.cancellations
        assert (cancellation.tool_call, cancellation.idempotency_key, cancellation.attempt) == (
            record, "s/turn-1/c1", 1)
    stored = ctx.get(AGENT_TOOL_CALLS["c1"])
    assert stored is not None
    assert (stored.status, stored.error, stored.cancellation_reason, stored.task_id) == (
        AgentToolCallStatus.OUTCOME_UNKNOWN, TOOL_TASK_CANCELLED_ERROR, CancellationReason.TURN_CANCELLED, "job-1")
    assert [p[0] for p in ctx.writes.publishes] == ["ToolCallResults"]
    # A record that became final first is left alone: one result per call.
    again = _context(flow, CANCEL_TOOL_TASK, stored)
    await steps.cancel_tool_task(again, "c1")
    assert again.writes.publishes == [] and len(runner.cancellations) == int(canceller)


@pytest.mark.parametrize("progress", [AttemptProgress.NOT_STARTED, AttemptProgress.NOT_COMPLETED])
async def test_failure_routes_of_task_steps(progress: AttemptProgress) -> None:
    """RecordToolOutcomeUnknown after CancelToolTask kept failing records the same result as
    CancelToolTask; after a poll failed, a waiting_for_task call keeps its effect's status with the
    recovery detail, never `the tool did not run`, because the task started."""
    flow, _, tools = _task_steps(TaskRunner())
    recovery = RecoveryError(step_type=CANCEL_TOOL_TASK, step_execution_id="CancelToolTask-1", method="execute",
                             attempts=3, attempt_progress=progress, error_type="RuntimeError", detail="boom")
    abandoned = _waiting(cancellation_reason=CancellationReason.TURN_CANCELLED)
    ctx = _context(flow, RECORD_TOOL_OUTCOME_UNKNOWN, abandoned, recovery=recovery)
    await tools.record_tool_outcome_unknown(ctx, "c1")
    stored = ctx.get(AGENT_TOOL_CALLS["c1"])
    assert stored is not None
    assert (stored.status, stored.error, stored.cancellation_reason) == (
        AgentToolCallStatus.OUTCOME_UNKNOWN, TOOL_TASK_CANCELLED_ERROR, CancellationReason.TURN_CANCELLED)
    for effect, route, status in [
        (ToolEffect.READ, tools.record_tool_failure, AgentToolCallStatus.FAILED),
        (ToolEffect.IDEMPOTENT_WRITE, tools.record_tool_failure, AgentToolCallStatus.OUTCOME_UNKNOWN),
        (ToolEffect.NON_IDEMPOTENT_WRITE, tools.record_tool_outcome_unknown, AgentToolCallStatus.OUTCOME_UNKNOWN),
    ]:
        ctx = _context(flow, POLL_TOOL_TASK, _waiting(effect=effect), recovery=recovery)
        await route(ctx, "c1")
        stored = ctx.get(AGENT_TOOL_CALLS["c1"])
        assert stored is not None and (stored.status, stored.error) == (status, "boom")


# Sessions -------------------------------------------------------------------------------------


def _task(call_id: str, tool: str, polls: Sequence[dict[str, Any]], **task: Any) -> dict[str, Any]:
    return {"id": call_id, "name": tool, "args": {"task": {"polls": list(polls), **task}}}


def _script(*calls: dict[str, Any]) -> str:
    """One model response with `calls`, then an answer that lists every record's outcome as JSON."""
    return json.dumps({"steps": [{"tools": list(calls)}, {"answer": "{records}"}]})


async def _ended(sessions: AgentSessionClient, sid: str = "s", turns: int = 1) -> AgentSnapshot:
    snapshot: AgentSnapshot = await wait_for_agent_snapshot(
        sessions, sid, lambda s: s if s.state is not None and s.state.turn_count >= turns else None,
        description=f"turn {turns} of {sid} to end")
    return snapshot


async def _outcomes(sessions: AgentSessionClient, sid: str = "s") -> tuple[dict[str, Any], AgentSnapshot]:
    """Each record's outcome as the model's final answer listed it (scripted `{records}`)."""
    snapshot = await _ended(sessions, sid)
    return json.loads(snapshot.messages[-1].text or ""), snapshot


async def _record_of(
    sessions: AgentSessionClient, call_id: str, status: AgentToolCallStatus, sid: str = "s"
) -> AgentToolCall:
    found: AgentToolCall = await wait_for_agent_snapshot(
        sessions, sid, lambda s: next((r for r in s.tool_calls if r.tool_call_id == call_id and r.status is status),
                                      None), description=f"{call_id} {status.value}")
    return found


async def _events(
    sessions: AgentSessionClient, event_type: str, sid: str = "s"
) -> list[tuple[AgentEvent, dict[str, Any]]]:
    read = await sessions.read_agent_events(sid, limit=10_000)
    return [(e.value, json.loads(e.value.payload)) for e in read.events if e.value.type == event_type]


def _polls(log: InvocationLog, call_id: str = "c1", sid: str = "s") -> list[tuple[int, int]]:
    """(position, attempt) of every poll of a call, in order."""
    return [(e["position"], e["attempt"]) for e in log.entries("poll", tool_call_id=call_id, flow_id=sid)]


@contextlib.asynccontextmanager
async def _in_process(tmp_path: Path, flow: AgentSessionFlow | None = None,
                      **options: Any) -> AsyncIterator[tuple[InProcessEngine, AgentSessionClient, InvocationLog]]:
    engine = InProcessEngine(tmp_path, [flow or build_flow(tmp_path, **options)])
    async with engine.running():
        yield engine, engine.sessions(), InvocationLog(tmp_path / INVOCATIONS)


async def _steps(engine: InProcessEngine | AgentTestStack, sid: str = "s") -> list[str]:
    return executed_steps(to_step_history(await engine.client.get_flow_history(sid)))


class SharedWorkers:
    """One engine for the Worker-process tests, with its live Worker child, and a standby child that
    imports ahead of time and registers only when released, so a kill test need not wait for imports.

    Worker children import for seconds of wall time on a loaded machine; each test uses its own
    session ID, which also prefixes its FileGates, and the InvocationLog is filtered by session.
    """

    def __init__(self, stack: AgentTestStack) -> None:
        self.stack = stack
        self.sessions = stack.sessions(stack.flows[0])  # type: ignore[arg-type]
        self.log = InvocationLog(stack.state_dir / INVOCATIONS)
        self.live: WorkerProcess | None = None
        self.standby: tuple[WorkerProcess, FileGate] | None = None
        self._spawn_standby()

    def _spawn_standby(self) -> None:
        stack = self.stack
        gate = FileGate(stack.state_dir, "standby")
        env = {**os.environ, ENV_DATABASE_URL: stack.database_url, ENV_STATE_DIR: str(stack.state_dir),
               ENV_PARENT_PID: str(os.getpid()), "PYTHONUNBUFFERED": "1", ENV_START_GATE: gate.name}
        log_path = stack.state_dir / "standby.log"
        with log_path.open("wb") as out:
            process = subprocess.Popen([sys.executable, "-m", WORKER_MODULE], cwd=REPO_ROOT, env=env, stdout=out,
                                       stderr=subprocess.STDOUT, start_new_session=True)
        worker = WorkerProcess(process, log_path)
        stack.workers.append(worker)  # SIGKILLed with the stack, released or not
        self.standby = (worker, gate)

    async def worker(self) -> WorkerProcess:
        """The live Worker: the standby's turn after a kill, else a new child."""
        if self.live is not None and self.live.alive:
            return self.live
        if self.live is None or self.standby is None:
            self.live = await self.stack.start_worker()
            return self.live
        worker, gate = self.standby
        self.standby = None
        gate.release()

        async def registered() -> bool:
            if not worker.alive:
                raise AssertionError(f"standby worker {worker.pid} exited:\n{worker.log_tail()}")
            return any(row[2] == worker.pid for row in await self.stack.client.store.list_workers())

        await wait_until(f"standby worker {worker.pid} to register", registered, timeout=90.0)
        self.live = worker
        return worker


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def workers(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[SharedWorkers]:
    state_dir = tmp_path_factory.mktemp("workers")
    async with AgentTestStack(state_dir, [build_flow(state_dir)], WORKER_MODULE, worker_cwd=REPO_ROOT) as stack:
        yield SharedWorkers(stack)


async def test_task_is_polled_until_it_returns_a_result(tmp_path: Path) -> None:
    """CallTool records waiting_for_task (task_id, the interval rounded up, no continuation) and
    writes tool_task_started; each PollToolTask polls once and stores the next interval and
    continuation; the result records succeeded. The tool ran once and knew the runner polls tasks."""
    async with _in_process(tmp_path) as (engine, sessions, log):
        first, second = FileGate(tmp_path, "first"), FileGate(tmp_path, "second")
        await sessions.start_session("s", _script(_task("c1", "read_report", interval=1.5, polls=[
            {"gate": "first", "pending": 0.4}, {"gate": "second", "result": "report ready"}])))
        await first.wait_until_reached()
        waiting = await _record_of(sessions, "c1", AgentToolCallStatus.WAITING_FOR_TASK)
        assert (waiting.task_id, waiting.task_poll_interval_seconds, waiting.input_continuation) == ("task-c1", 2, None)
        first.release()
        await second.wait_until_reached()
        waiting = await _record_of(sessions, "c1", AgentToolCallStatus.WAITING_FOR_TASK)
        assert (waiting.task_poll_interval_seconds, waiting.input_continuation, waiting.task_answer_pending) == (
            1, "p1", False)
        second.release()
        outcomes, _ = await _outcomes(sessions)
        assert outcomes["c1"]["status"] == "succeeded" and outcomes["c1"]["output"] == "report ready"
        assert outcomes["c1"]["task_id"] == "task-c1"  # kept after the task ends
        assert await _steps(engine) == [
            "StartAgentSession", "RunModel", "CallTool", "PollToolTask", "PollToolTask", "ResumeTurn", "RunModel"]
        [(event, started)] = await _events(sessions, "tool_task_started")
        assert started == {"tool_call_id": "c1", "tool_name": "read_report", "task_id": "task-c1"}
        assert event.step_execution_id == "CallTool-1"
        [start] = log.entries("task_start")
        assert start["supports_tool_tasks"] is True
        assert _polls(log) == [(0, 1), (1, 1)]
        assert {e["idempotency_key"] for e in log.entries("poll")} == {"s/turn-1/c1"}
        assert [p["status"] for _, p in await _events(sessions, "tool_call_finished")] == ["succeeded"]


@pytest.mark.asyncio(loop_scope="module")
async def test_task_question_answer_reaches_the_task_on_the_next_poll(workers: SharedWorkers) -> None:
    """Worker process: a poll's ToolInputRequested records awaiting_answer with task_id, and
    AwaitQuestionAnswer raises `c1-input-1`; the answer appends a QuestionAnswer (answered), records
    waiting_for_task with task_answer_pending, and the next poll gets it as pending_answer, with the
    question's continuation; the poll after that does not."""
    sessions, log, sid = workers.sessions, workers.log, "question"
    await workers.worker()
    await sessions.start_session(sid, _script(_task("c1", "idem_export", polls=[
        {"ask": "Format?", "choices": ["pdf", "csv"]}, {"pending": 0.2}, {"result": "exported {answers}"}])))
    asking = await _record_of(sessions, "c1", AgentToolCallStatus.AWAITING_ANSWER, sid)
    assert (asking.task_id, asking.input_question, asking.input_continuation) == ("task-c1", "Format?", "p1")
    question = await wait_for_agent_snapshot(
        sessions, sid, lambda s: next(iter(s.pending_interrupts), None), description="the task's question")
    assert (question.interrupt_id, question.tool_call_id, question.choices) == ("c1-input-1", "c1", ["pdf", "csv"])
    assert await sessions.answer_question(sid, "c1-input-1", "csv")
    outcomes, snapshot = await _outcomes(sessions, sid)
    assert outcomes["c1"]["status"] == "succeeded"
    assert outcomes["c1"]["output"] == 'exported [["answered", "csv"]]'
    assert snapshot.pending_interrupts == []
    assert [(e["position"], e["pending_answer"]) for e in log.entries("poll", flow_id=sid)] == [
        (0, None), (1, ["answered", "csv", "c1-input-1"]), (2, None)]
    assert log.count("task_start", flow_id=sid) == 1 and log.count("tool_start", flow_id=sid) == 1
    assert await _steps(workers.stack, sid) == [
        "StartAgentSession", "RunModel", "CallTool", "PollToolTask", "AwaitQuestionAnswer", "AwaitQuestionAnswer",
        "PollToolTask", "PollToolTask", "ResumeTurn", "RunModel"]
    [(_, resolved)] = await _events(sessions, "interrupt_resolved", sid)
    assert (resolved["interrupt_id"], resolved["approved"], resolved["answered"]) == ("c1-input-1", True, True)


async def test_task_question_decline_goes_to_the_task(tmp_path: Path) -> None:
    """A started task's question never ends the call: a decline goes to the task as a QuestionAnswer
    with resolution declined and the decline text (or the default), and the task decides (here: it
    finishes). Both calls succeed; neither is rejected."""
    async with _in_process(tmp_path) as (engine, sessions, log):
        await sessions.start_session("s", _script(*(_task(c, "read_report", polls=[
            {"ask": "Include refunds?"}, {"result": "{answers}"}]) for c in ("c1", "c2"))))
        await wait_for_agent_snapshot(sessions, "s", lambda s: len(s.pending_interrupts) == 2,
                                      description="both questions")
        assert await sessions.resolve_interrupt("s", "c1-input-1", approved=False)
        assert await sessions.resolve_interrupt("s", "c2-input-1", approved=False, rejection_message="not now")
        outcomes, snapshot = await _outcomes(sessions)
        expected = {"c1": "The user declined to answer.", "c2": "not now"}
        for call_id, text in expected.items():
            assert outcomes[call_id]["status"] == "succeeded"
            assert json.loads(outcomes[call_id]["output"]) == [["declined", text]]
            assert [e["pending_answer"] for e in log.entries("poll", tool_call_id=call_id)] == [
                None, ["declined", text, f"{call_id}-input-1"]]
        assert snapshot.pending_interrupts == []
        resolved = {p["interrupt_id"]: (p["approved"], p["rejection_message"])
                    for _, p in await _events(sessions, "interrupt_resolved")}
        assert resolved == {"c1-input-1": (False, expected["c1"]), "c2-input-1": (False, expected["c2"])}
        assert (await _steps(engine))[-3:] == ["PollToolTask", "ResumeTurn", "RunModel"]


async def test_task_question_deadline_goes_to_the_task(tmp_path: Path) -> None:
    """A passed question deadline goes to the task as deadline_passed with `question deadline
    passed`; a late answer is refused, and the task finishes."""
    async with _in_process(tmp_path, interrupt_deadline=timedelta(seconds=1)) as (_, sessions, log):
        await sessions.start_session("s", _script(_task("c1", "read_report", polls=[
            {"ask": "Include refunds?"}, {"result": "{answers}"}])))
        outcomes, snapshot = await _outcomes(sessions)
        assert outcomes["c1"]["status"] == "succeeded"
        assert json.loads(outcomes["c1"]["output"]) == [["deadline_passed", "question deadline passed"]]
        assert snapshot.pending_interrupts == []
        assert not await sessions.answer_question("s", "c1-input-1", "late")
        assert [e["pending_answer"] for e in log.entries("poll")] == [
            None, ["deadline_passed", "question deadline passed", "c1-input-1"]]
        [(_, resolved)] = await _events(sessions, "interrupt_resolved")
        assert (resolved["approved"], resolved["rejection_message"]) == (False, "question deadline passed")


async def test_task_question_that_cannot_be_asked_is_recorded_by_effect(tmp_path: Path) -> None:
    """A task's question whose interrupt ID another call of the turn uses, or that is invalid, or
    whose ID is over the key limit (a 250-character call ID), or that makes the record too large, is
    recorded by effect (an idempotent write: outcome_unknown), not failed: the task started."""
    long_id = "x" * 250
    async with _in_process(tmp_path) as (_, sessions, _log):
        await sessions.start_session("s", _script(
            _task("y", "idem_sync", polls=[{"ask": "Which?"}]),
            {"id": "y-input-1", "name": "write_refund", "args": {}},  # its approval is pending as y-input-1
            _task("z", "idem_other", polls=[{"ask": "Pick", "choices": ["a", "a"]}]),
            _task(long_id, "idem_long", polls=[{"ask": "Which?"}], id="task-long"),
            _task("big", "idem_big", polls=[{"ask_bytes": MAX_VALUE_BYTES}]),
        ))
        await _record_of(sessions, "y", AgentToolCallStatus.OUTCOME_UNKNOWN)
        assert await sessions.resolve_interrupt("s", "y-input-1", approved=False)
        outcomes, snapshot = await _outcomes(sessions)
        assert (outcomes["y"]["status"], outcomes["y"]["error"]) == (
            "outcome_unknown", tool_question_id_in_use("y-input-1"))
        assert (outcomes["z"]["status"], outcomes["z"]["error"]) == (
            "outcome_unknown", invalid_question_error("choices repeat"))
        assert outcomes[long_id]["status"] == "outcome_unknown"
        assert outcomes[long_id]["error"].startswith(f"the tool's question cannot use interrupt ID {long_id}-input-1: ")
        assert outcomes["big"]["status"] == "outcome_unknown"
        assert re.fullmatch(re.escape(invalid_question_error("the question makes the call ")) + r"\d+ bytes, over "
                            rf"the session's value limit of {MAX_VALUE_BYTES}", outcomes["big"]["error"])
        assert snapshot.pending_interrupts == []


@pytest.mark.asyncio(loop_scope="module")
async def test_kill_during_a_poll_reruns_only_that_poll(workers: SharedWorkers) -> None:
    """A Worker killed (SIGKILL) while a poll waits at a FileGate: the next Worker runs that poll
    again (attempt 2, same position), and no other poll, tool call or model call runs twice."""
    sessions, log, sid = workers.sessions, workers.log, "kill"
    worker = await workers.worker()
    await sessions.start_session(sid, _script(_task("c1", "read_report", polls=[
        {"pending": 0.1}, {"gate": f"{sid}.poll", "pending": 0.1}, {"result": "report ready"}])))
    gate = FileGate(workers.stack.state_dir, f"{sid}.poll")
    assert await gate.wait_until_reached() == worker.pid
    worker.kill()
    second = await workers.worker()
    gate.release()
    outcomes, _ = await _outcomes(sessions, sid)
    assert (outcomes["c1"]["status"], outcomes["c1"]["output"]) == ("succeeded", "report ready")
    assert _polls(log, sid=sid) == [(0, 1), (1, 1), (1, 2), (2, 1)]
    [killed, rerun] = [e["pid"] for e in log.entries("poll", flow_id=sid, position=1)]
    assert (killed, rerun) == (worker.pid, second.pid)
    counts = [log.count(kind, flow_id=sid) for kind in ("tool_start", "task_start", "model")]
    assert counts == [1, 1, 2]
    history = to_step_history(await workers.stack.client.get_flow_history(sid))
    assert executed_steps(history) == [
        "StartAgentSession", "RunModel", "CallTool", "PollToolTask", "PollToolTask", "PollToolTask", "ResumeTurn",
        "RunModel"]
    finals = [e.final_attempt for e in history if e.event_type == "execute_completed" and e.step_type == POLL_TOOL_TASK]
    assert finals == [1, 2, 1]


@pytest.mark.asyncio(loop_scope="module")
async def test_kill_after_the_task_started_and_before_its_first_poll(workers: SharedWorkers) -> None:
    """A Worker killed (SIGKILL) in CallTool after the tool started its task and saved its handle,
    before the Step's commit: the next Worker runs CallTool again (attempt 2), which gets the saved
    handle and starts nothing; one tool_task_started; then a Worker killed while PollToolTask waits
    on its Timer: the next one polls. The task started once and each poll ran once."""
    sessions, log, sid = workers.sessions, workers.log, "kill-start"
    worker = await workers.worker()
    gate = FileGate(workers.stack.state_dir, f"{sid}.start")
    await sessions.start_session(sid, _script(_task("c1", "read_report", interval=3, start_gate=gate.name, polls=[
        {"pending": 0.1}, {"result": "report ready"}])))
    assert await gate.wait_until_reached() == worker.pid
    worker.kill()
    gate.release()
    second = await workers.worker()
    waiting = await _record_of(sessions, "c1", AgentToolCallStatus.WAITING_FOR_TASK, sid)
    assert (waiting.task_id, waiting.task_poll_interval_seconds) == ("task-c1", 3)
    second.kill()  # its PollToolTask waits on the Timer
    await workers.worker()
    outcomes, _ = await _outcomes(sessions, sid)
    assert (outcomes["c1"]["status"], outcomes["c1"]["output"]) == ("succeeded", "report ready")
    assert [(e["attempt"], e["task_id"]) for e in log.entries("task_start", flow_id=sid)] == [(1, "task-c1")]
    assert [e["attempt"] for e in log.entries("tool_start", flow_id=sid)] == [1, 2]
    assert _polls(log, sid=sid) == [(0, 1), (1, 1)]
    assert [p["task_id"] for _, p in await _events(sessions, "tool_task_started", sid)] == ["task-c1"]
    history = to_step_history(await workers.stack.client.get_flow_history(sid))
    assert executed_steps(history) == [
        "StartAgentSession", "RunModel", "CallTool", "PollToolTask", "PollToolTask", "ResumeTurn", "RunModel"]


async def test_task_result_over_the_value_limit(tmp_path: Path) -> None:
    """A task's result too large to store ends its call as CallTool's would: a read fails with the
    size note (safe to ask again), a write the task ran succeeds with the note as its output; each
    final poll ran once."""
    big = [{"result_bytes": MAX_VALUE_BYTES}]
    async with _in_process(tmp_path, tool_policies=NO_APPROVAL_WRITE) as (_engine, sessions, log):
        await sessions.start_session("s", _script(_task("r", "read_report", big), _task("w", "write_now", big)))
        outcomes, _ = await _outcomes(sessions)
        note = (rf"the tool's output is \d+ bytes, over the session's value limit of {MAX_VALUE_BYTES}; "
                "it was not stored")
        assert outcomes["r"]["status"] == "failed", outcomes["r"]
        assert re.fullmatch(note, outcomes["r"]["error"]), outcomes["r"]["error"]
        assert outcomes["w"]["status"] == "succeeded", outcomes["w"]
        assert re.fullmatch(rf"\[Dex\] The tool call succeeded, but {note}\.", outcomes["w"]["output"])
        assert _polls(log, "r") == [(0, 1)] and _polls(log, "w") == [(0, 1)]


async def test_poll_failures_follow_the_calls_effect(tmp_path: Path) -> None:
    """A poll that keeps failing gets three attempts, then the failure route of the Step that started
    the task: RecordToolFailure for read (failed) and idempotent_write (outcome_unknown), and
    RecordToolOutcomeUnknown for a single-attempt write (outcome_unknown), with the recovery detail."""
    crash = [{"crash": "the task service is down"}]
    async with _in_process(tmp_path, tool_policies=NO_APPROVAL_WRITE) as (engine, sessions, log):
        await sessions.start_session("s", _script(
            _task("r", "read_report", crash), _task("i", "idem_export", crash), _task("w", "write_now", crash)))
        outcomes, _ = await _outcomes(sessions)
        assert {k: v["status"] for k, v in outcomes.items()} == {
            "r": "failed", "i": "outcome_unknown", "w": "outcome_unknown"}
        assert all("the task service is down" in v["error"] for v in outcomes.values())
        for call_id in "riw":
            assert _polls(log, call_id) == [(0, 1), (0, 2), (0, 3)]
        steps = await _steps(engine)
        assert sorted(steps[2:8]) == sorted([
            "CallTool", "CallTool", "CallSingleAttemptTool", RECORD_TOOL_FAILURE, RECORD_TOOL_FAILURE,
            RECORD_TOOL_OUTCOME_UNKNOWN])
        assert POLL_TOOL_TASK not in steps  # no poll ever completed
        assert steps[-2:] == ["ResumeTurn", "RunModel"]


async def test_poll_errors_and_a_retried_poll(tmp_path: Path) -> None:
    """ToolExecutionError from a poll records failed and ToolOutcomeUnknownError outcome_unknown,
    without a retry; a poll that failed once is retried and its result recorded."""
    async with _in_process(tmp_path) as (_, sessions, log):
        await sessions.start_session("s", _script(
            _task("f", "read_report", [{"fail": "no such report"}]),
            _task("u", "idem_export", [{"unknown": "the export may have run"}]),
            _task("c", "read_other", [{"crash": "blip", "attempts": 1, "result": "ok"}]),
        ))
        outcomes, _ = await _outcomes(sessions)
        assert (outcomes["f"]["status"], outcomes["f"]["error"]) == ("failed", "no such report")
        assert (outcomes["u"]["status"], outcomes["u"]["error"]) == ("outcome_unknown", "the export may have run")
        assert (outcomes["c"]["status"], outcomes["c"]["output"]) == ("succeeded", "ok")
        assert (_polls(log, "f"), _polls(log, "u"), _polls(log, "c")) == ([(0, 1)], [(0, 1)], [(0, 1), (0, 2)])


async def test_invalid_task_start_or_pending_is_recorded_by_effect(tmp_path: Path) -> None:
    """A blank or non-text task_id, an interval that is not a number, and a ToolTaskPending whose
    interval is not a number record failed for a read and outcome_unknown otherwise, with the error;
    an invalid start writes no tool_task_started and runs no poll."""
    async with _in_process(tmp_path, tool_policies=NO_APPROVAL_WRITE) as (engine, sessions, log):
        await sessions.start_session("s", _script(
            _task("a", "read_report", [], id="  "),
            _task("b", "idem_export", [], interval="soon"),
            _task("c", "write_now", [], id=5),
            _task("d", "read_other", [{"pending": "later"}]),
        ))
        outcomes, _ = await _outcomes(sessions)
        assert {k: (v["status"], v["error"]) for k, v in outcomes.items()} == {
            "a": ("failed", invalid_task_error("task_id must be non-empty text")),
            "b": ("outcome_unknown", invalid_task_error("poll_interval_seconds must be a number, got 'soon'")),
            "c": ("outcome_unknown", invalid_task_error("task_id must be non-empty text")),
            "d": ("failed", invalid_pending_error("poll_interval_seconds must be a number, got 'later'")),
        }
        assert [p["tool_call_id"] for _, p in await _events(sessions, "tool_task_started")] == ["d"]
        assert _polls(log, "d") == [(0, 1)] and len(log.entries("poll")) == 1
        assert (await _steps(engine)).count(POLL_TOOL_TASK) == 1


class NoPollerRunner:
    """The scripted runner without poll_tool_task: its tools still start tasks."""

    def __init__(self, inner: ScriptedRunner) -> None:
        self.inner = inner

    def build_user_message(self, text: str) -> FrameworkMessage:
        return self.inner.build_user_message(text)

    async def run_model_step(self, turn: AgentTurnContext) -> AgentTurnOutcome:
        return await self.inner.run_model_step(turn)

    async def execute_deferred_tool_call(self, call: DeferredToolExecution) -> Any:
        return await self.inner.execute_deferred_tool_call(call)


async def test_task_from_a_runner_without_a_poller(tmp_path: Path) -> None:
    """The tool learns supports_tool_tasks is false; a task it starts anyway records
    MISSING_TOOL_TASK_POLLER, failed for a read and outcome_unknown otherwise, and nothing polls."""
    flow = AgentSessionFlow(NoPollerRunner(ScriptedRunner(tmp_path)), FLOW_TYPE, AgentSessionOptions())
    async with _in_process(tmp_path, flow) as (engine, sessions, log):
        await sessions.start_session("s", _script(_task("r", "read_report", []), _task("i", "idem_export", [])))
        outcomes, _ = await _outcomes(sessions)
        assert {k: (v["status"], v["error"]) for k, v in outcomes.items()} == {
            "r": ("failed", MISSING_TOOL_TASK_POLLER), "i": ("outcome_unknown", MISSING_TOOL_TASK_POLLER)}
        assert [e["supports_tool_tasks"] for e in log.entries("task_start")] == [False, False]
        assert POLL_TOOL_TASK not in await _steps(engine)
        assert await _events(sessions, "tool_task_started") == []


async def test_steering_waits_for_a_started_task(tmp_path: Path) -> None:
    """A steer while a task runs abandons nothing: the task polls on to its result, and only then
    does the steered turn start."""
    async with _in_process(tmp_path) as (engine, sessions, log):
        gate = FileGate(tmp_path, "poll")
        await sessions.start_session("s", _script(_task("c1", "read_report", polls=[
            {"gate": "poll", "pending": 0.1}, {"result": "report ready"}])))
        await gate.wait_until_reached()
        assert await sessions.steer_user_message("s", text="now something else")
        gate.release()
        snapshot = await wait_for_agent_snapshot(
            sessions, "s", lambda s: s if s.state is not None and s.state.turn_count >= 2 else None,
            description="the steered turn to end")
        assert snapshot.messages[-1].text == "echo: now something else"
        assert [p["status"] for _, p in await _events(sessions, "tool_call_finished")] == ["succeeded"]
        assert _polls(log) == [(0, 1), (1, 1)]
        steps = await _steps(engine)
        assert CANCEL_TOOL_TASK not in steps
        assert steps.index("ApplyTurnControl") > max(i for i, s in enumerate(steps) if s == POLL_TOOL_TASK)


# cancel_turn and CancelToolTask ------------------------------------------------------------------


@pytest.mark.asyncio(loop_scope="module")
async def test_cancel_turn_abandons_a_running_poll(workers: SharedWorkers) -> None:
    """Worker process: cancel_turn cancels a running poll (its result is dropped), and CancelToolTask
    calls cancel_tool_task and records outcome_unknown with cancellation_reason turn_cancelled and
    the fixed error, while another call's started tool runs to its end; then the turn is cancelled."""
    sessions, log, sid = workers.sessions, workers.log, "cancel"
    await workers.worker()
    poll, slow = (FileGate(workers.stack.state_dir, f"{sid}.{name}") for name in ("poll", "slow"))
    await sessions.start_session(sid, _script(
        _task("c1", "read_report", polls=[{"gate": poll.name, "result": "too late"}]),
        {"id": "c2", "name": "read_slow", "args": {"gate": slow.name}},
    ))
    await poll.wait_until_reached()
    await slow.wait_until_reached()
    assert await sessions.cancel_turn(sid)
    abandoned = await _record_of(sessions, "c1", AgentToolCallStatus.OUTCOME_UNKNOWN, sid)
    assert (abandoned.error, abandoned.cancellation_reason, abandoned.task_id) == (
        TOOL_TASK_CANCELLED_ERROR, CancellationReason.TURN_CANCELLED, "task-c1")
    assert [(e["task_id"], e["attempt"]) for e in log.entries("task_cancel", flow_id=sid)] == [("task-c1", 1)]
    poll.release()  # the cancelled poll never returns its result
    slow.release()
    snapshot = await _ended(sessions, sid)
    assert snapshot.state is not None and snapshot.state.status is AgentStatus.WAITING_FOR_USER_MESSAGE
    finished = {p["tool_call_id"]: p["status"] for _, p in await _events(sessions, "tool_call_finished", sid)}
    assert finished == {"c1": "outcome_unknown", "c2": "succeeded"}
    assert len(await _events(sessions, "turn_cancelled", sid)) == 1
    steps = await _steps(workers.stack, sid)
    assert POLL_TOOL_TASK not in steps  # the only poll was cancelled
    assert steps.count(CANCEL_TOOL_TASK) == 1
    assert steps.index(FINISH_TURN_CANCELLATION) < steps.index(CANCEL_TOOL_TASK)
    assert steps[-2:] == ["ResumeTurn", "ApplyTurnControl"]
    assert _polls(log, sid=sid) == [(0, 1)]


async def test_cancel_tool_task_that_keeps_failing_still_ends_the_turn(tmp_path: Path) -> None:
    """cancel_tool_task raises on every attempt: three attempts, then RecordToolOutcomeUnknown records
    the same outcome_unknown result with cancellation_reason turn_cancelled, and the turn ends."""
    async with _in_process(tmp_path) as (engine, sessions, log):
        slow = FileGate(tmp_path, "slow")
        await sessions.start_session("s", _script(
            _task("c1", "read_report", interval=600, polls=[{"result": "never polled"}], cancel_crash="refused"),
            {"id": "c2", "name": "read_slow", "args": {"gate": "slow"}},
        ))
        await _record_of(sessions, "c1", AgentToolCallStatus.WAITING_FOR_TASK)
        await slow.wait_until_reached()
        assert await sessions.cancel_turn("s")
        abandoned = await _record_of(sessions, "c1", AgentToolCallStatus.OUTCOME_UNKNOWN)
        assert (abandoned.error, abandoned.cancellation_reason) == (
            TOOL_TASK_CANCELLED_ERROR, CancellationReason.TURN_CANCELLED)
        assert [e["attempt"] for e in log.entries("task_cancel")] == [1, 2, 3]
        slow.release()
        await wait_for_agent_snapshot(sessions, "s", lambda s: s.state is not None and s.state.turn_count >= 1,
                                      description="the cancelled turn to end")
        steps = await _steps(engine)
        assert CANCEL_TOOL_TASK not in steps and RECORD_TOOL_OUTCOME_UNKNOWN in steps
        assert log.entries("poll") == []  # the poll waited on its Timer and was cancelled
        assert steps[-2:] == ["ResumeTurn", "ApplyTurnControl"]


async def test_cancel_turn_abandons_a_task_whose_question_waits(tmp_path: Path) -> None:
    """cancel_turn while a task's question is pending: the question is removed (interrupt_resolved
    with cancellation_reason turn_cancelled) and the task goes to CancelToolTask, not rejected."""
    async with _in_process(tmp_path) as (engine, sessions, log):
        await sessions.start_session("s", _script(_task("c1", "idem_export", polls=[{"ask": "Proceed?"}])))
        await wait_for_agent_snapshot(sessions, "s", lambda s: s.pending_interrupts, description="the question")
        assert await sessions.cancel_turn("s")
        snapshot = await wait_for_agent_snapshot(
            sessions, "s", lambda s: s if s.state is not None and s.state.turn_count >= 1 else None,
            description="the cancelled turn to end")
        assert snapshot.pending_interrupts == []
        assert not await sessions.answer_question("s", "c1-input-1", "yes")
        [(_, resolved)] = await _events(sessions, "interrupt_resolved")
        assert (resolved["interrupt_id"], resolved["cancellation_reason"]) == ("c1-input-1", "turn_cancelled")
        assert [p["status"] for _, p in await _events(sessions, "tool_call_finished")] == ["outcome_unknown"]
        assert [e["task_id"] for e in log.entries("task_cancel")] == ["task-c1"]
        assert CANCEL_TOOL_TASK in await _steps(engine)


async def test_poll_that_starts_after_cancel_turn_does_not_poll(tmp_path: Path) -> None:
    """cancel_turn commits while CallTool runs (it runs to its end), and its FinishTurnCancellation
    ends meanwhile, finding no call to take; the task CallTool then starts goes to a PollToolTask
    that moves to FinishTurnCancellation without polling, then CancelToolTask. (Had cancel_turn's
    FinishTurnCancellation run only after CallTool's commit, it would take the task itself, and the
    PollToolTask would end without a move: so the tool waits until it has ended.)"""
    async with _in_process(tmp_path) as (engine, sessions, log):
        tool = FileGate(tmp_path, "tool")
        await sessions.start_session("s", _script(
            {"id": "c1", "name": "read_report", "args": {"gate": "tool", "task": {"polls": [{"result": "x"}]}}}))
        await tool.wait_until_reached()
        assert await sessions.cancel_turn("s")

        async def cancellation_ended() -> bool:
            return FINISH_TURN_CANCELLATION in await _steps(engine)

        await wait_until("cancel_turn's FinishTurnCancellation to end", cancellation_ended)
        tool.release()
        await wait_for_agent_snapshot(sessions, "s", lambda s: s.state is not None and s.state.turn_count >= 1,
                                      description="the cancelled turn to end")
        assert log.entries("poll") == []
        assert [e["task_id"] for e in log.entries("task_cancel")] == ["task-c1"]
        steps = await _steps(engine)
        shape = [s for s in steps if s in (POLL_TOOL_TASK, FINISH_TURN_CANCELLATION, CANCEL_TOOL_TASK)]
        assert shape == [FINISH_TURN_CANCELLATION, POLL_TOOL_TASK, FINISH_TURN_CANCELLATION, CANCEL_TOOL_TASK], steps
        assert [p["status"] for _, p in await _events(sessions, "tool_call_finished")] == ["outcome_unknown"]


# The demo -------------------------------------------------------------------------------------------


async def test_demo_task_command_builds_a_report_as_a_task(tmp_path: Path) -> None:
    """`/task refunds` in the demo: build_report starts a task that is ready on the second poll."""
    async with _in_process(tmp_path, build_demo_flow(tmp_path / "ledger.jsonl")) as (engine, sessions, _):
        await sessions.start_session("s", "/task refunds")
        snapshot = await wait_for_agent_snapshot(
            sessions, "s", lambda s: s if s.state is not None and s.state.turn_count >= 1 else None,
            description="the demo turn to end")
        assert snapshot.messages[-1].text == (
            "build_report returned: report on refunds: 2 orders, 9250 cents (ready after 2 polls)")
        steps = await _steps(engine)
        assert steps[2:5] == ["CallTool", POLL_TOOL_TASK, POLL_TOOL_TASK]
        [(_, started)] = await _events(sessions, "tool_task_started")
        assert started["tool_name"] == "build_report" and started["task_id"].startswith("report:s/turn-1/")
