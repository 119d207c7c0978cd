"""Tool tasks: a tool that started remote work returns ToolTaskStarted, and the session polls it.

The tool Step (CallTool or CallSingleAttemptTool) records the call `waiting_for_task` and ends in
PollToolTask, which waits on a Timer and calls the runner's poll_tool_task once per execution.
No Step holds a connection while the work runs, and a crash repeats only the one poll. A task's
question goes through AwaitQuestionAnswer and comes back here as `pending_answer`. CancelToolTask
abandons a task that cancel_turn stopped.

A record with task_id belongs to remote work that started: nothing but the task's own outcome, or
the call's failure route by effect, makes it final, and it is never recorded `rejected`.

This module imports neither _tool_steps nor _builtin_steps at import time (both import it).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, cast

import msgspec

from dex_engine import Context, LoadOptions, LoadSpec, MovementOptions, StepDecision, Timer, ValueTooLargeError, Wait

from ._constants import (
    FINISH_TURN_CANCELLATION,
    MAX_TOOL_TASK_POLL_INTERVAL_SECONDS,
    MIN_TOOL_TASK_POLL_INTERVAL_SECONDS,
    MISSING_TOOL_TASK_POLLER,
    POLL_TOOL_TASK,
    RECORD_TOOL_FAILURE,
    RECORD_TOOL_OUTCOME_UNKNOWN,
    TOOL_TASK_CANCELLED_ERROR,
)
from ._events import AgentEventType
from ._persistence import AGENT_STATE, AGENT_TOOL_CALLS, TURN_CANCELLATION_REQUEST
from ._policy import REPEATABLE_EFFECTS, error_message, shown
from ._runner import (
    ToolExecutionError,
    ToolExecutionResult,
    ToolInputRequested,
    ToolOutcomeUnknownError,
    ToolTaskCancellation,
    ToolTaskPending,
    ToolTaskPoll,
    ToolTaskPoller,
    ToolTaskStarted,
    polls_tool_tasks,
)
from ._runtime import SessionRuntime, background_heartbeats, resolved, tool_call_load
from ._turn_logic import finished, text_problem, without_question
from ._wire import (
    AgentState,
    AgentToolCall,
    AgentToolCallStatus,
    CancellationReason,
    QuestionAnswer,
    QuestionResolution,
    ToolEffect,
    TurnCancellationRequest,
)

if TYPE_CHECKING:
    from ._tool_steps import ToolSteps

# What PollToolTask reads when a movement names nothing narrower: every record, to find its own,
# and the two flags that say whether cancel_turn stopped the turn.
POLL_TOOL_TASK_STEP_LOAD: LoadSpec = LoadOptions.only(AGENT_TOOL_CALLS, AGENT_STATE, TURN_CANCELLATION_REQUEST)


# Pure rules -------------------------------------------------------------------------------------


def task_poll_interval_seconds(value: object) -> int | None:
    """A poll interval as the session stores it: rounded up to whole seconds (Dex Timers take whole
    seconds) and clamped to 1 second .. 1 day; None when `value` is not a number (bool and NaN included).

    Infinity clamps like any other number out of range.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, float) and math.isinf(value):
        seconds = MAX_TOOL_TASK_POLL_INTERVAL_SECONDS if value > 0 else MIN_TOOL_TASK_POLL_INTERVAL_SECONDS
    else:
        seconds = math.ceil(value)  # an int stays itself, however large
    return min(MAX_TOOL_TASK_POLL_INTERVAL_SECONDS, max(MIN_TOOL_TASK_POLL_INTERVAL_SECONDS, seconds))


def tool_task_started_problem(started: ToolTaskStarted) -> str | None:
    """None for a task the session can poll; else what is wrong with the ToolTaskStarted."""
    task_id: object = started.task_id
    if not isinstance(task_id, str) or not task_id.strip():
        return "task_id must be non-empty text"
    problem = text_problem(task_id)
    if problem is not None:
        return f"task_id is {problem}"
    if task_poll_interval_seconds(started.poll_interval_seconds) is None:
        return f"poll_interval_seconds must be a number, got {shown(started.poll_interval_seconds)}"
    return None


def invalid_task_error(problem: str) -> str:
    return f"the tool started a task with an invalid ToolTaskStarted: {problem}"


def tool_task_pending_problem(pending: ToolTaskPending) -> str | None:
    """None for a ToolTaskPending the session can store; else what is wrong with it."""
    if task_poll_interval_seconds(pending.poll_interval_seconds) is None:
        return f"poll_interval_seconds must be a number, got {shown(pending.poll_interval_seconds)}"
    continuation: object = pending.continuation
    if continuation is not None and not isinstance(continuation, str):
        return "continuation must be text or None"
    problem = None if continuation is None else text_problem(continuation)
    if problem is not None:
        return f"continuation is {problem}"
    return None


def invalid_pending_error(problem: str) -> str:
    return f"poll_tool_task returned an invalid ToolTaskPending: {problem}"


def status_by_effect(record: AgentToolCall) -> AgentToolCallStatus:
    """The status of a call that may have taken effect and has no result: a read failed (asking
    again is safe); any write's outcome is unknown."""
    return AgentToolCallStatus.FAILED if record.effect is ToolEffect.READ else AgentToolCallStatus.OUTCOME_UNKNOWN


def question_failure_status(record: AgentToolCall) -> AgentToolCallStatus:
    """A tool question that cannot be asked: `failed` for a tool that asked before it took any
    effect; by effect for a started task's question, because the task may run."""
    return AgentToolCallStatus.FAILED if record.task_id is None else status_by_effect(record)


def started_task_record(record: AgentToolCall, started: ToolTaskStarted) -> AgentToolCall:
    """The call waiting for its new task (a valid ToolTaskStarted): no continuation yet."""
    return msgspec.structs.replace(
        record, status=AgentToolCallStatus.WAITING_FOR_TASK, task_id=started.task_id,
        task_poll_interval_seconds=task_poll_interval_seconds(started.poll_interval_seconds),
        input_continuation=None, task_answer_pending=False,
    )


def pending_task_record(record: AgentToolCall, pending: ToolTaskPending) -> AgentToolCall:
    """The call after a poll that found the task running (a valid ToolTaskPending)."""
    return msgspec.structs.replace(
        record, status=AgentToolCallStatus.WAITING_FOR_TASK,
        task_poll_interval_seconds=task_poll_interval_seconds(pending.poll_interval_seconds),
        input_continuation=pending.continuation, task_answer_pending=False,
    )


def answered_task_record(record: AgentToolCall, answer: QuestionAnswer) -> AgentToolCall:
    """A task's question resolved: the resolution waits in input_answers for the next poll, which
    reads the question's continuation (kept) and hands the task `answer` as pending_answer."""
    return msgspec.structs.replace(
        without_question(record), status=AgentToolCallStatus.WAITING_FOR_TASK,
        input_answers=[*record.input_answers, answer], task_answer_pending=True,
    )


def cancelled_task_record(record: AgentToolCall) -> AgentToolCall:
    """A task that cancel_turn abandoned: outcome_unknown, because the task may have run."""
    abandoned = msgspec.structs.replace(
        without_question(record), cancellation_reason=CancellationReason.TURN_CANCELLED, task_answer_pending=False,
    )
    return finished(abandoned, AgentToolCallStatus.OUTCOME_UNKNOWN, error=TOOL_TASK_CANCELLED_ERROR)


def is_abandoned_task(record: AgentToolCall) -> bool:
    """A started task that cancel_turn handed to CancelToolTask (FinishTurnCancellation marks it)."""
    return record.task_id is not None and record.cancellation_reason is CancellationReason.TURN_CANCELLED


def turn_cancelled(state: AgentState | None, request: TurnCancellationRequest | None, turn_id: str) -> bool:
    """cancel_turn committed for this turn while it is the active one (turn IDs never repeat)."""
    return state is not None and request is not None and state.active_turn_id == turn_id == request.turn_id


def poll_failure_route(effect: ToolEffect) -> str:
    """PollToolTask's failure route by the call's effect, as for the tool Step that started the task."""
    return RECORD_TOOL_FAILURE if effect in REPEATABLE_EFFECTS else RECORD_TOOL_OUTCOME_UNKNOWN


def poll_tool_task_options(record: AgentToolCall) -> MovementOptions:
    """Every movement into PollToolTask: its own record and the turn-control flags (tool_call_load),
    and the failure route by effect."""
    load = tool_call_load(record.tool_call_id).load
    return MovementOptions(load=load, failure_route=poll_failure_route(record.effect))


def go_to_poll(record: AgentToolCall) -> StepDecision:
    return StepDecision.go_to(POLL_TOOL_TASK, record.tool_call_id, poll_tool_task_options(record))


def _too_large(what: str, exc: ValueTooLargeError) -> str:
    return f"{what} makes the call {exc.size} bytes, over the session's value limit of {exc.limit}"


# Transitions the tool Steps and AwaitQuestionAnswer share ----------------------------------------


def start_tool_task(rt: SessionRuntime, ctx: Context, record: AgentToolCall, started: ToolTaskStarted) -> StepDecision:
    """A tool Step's ToolTaskStarted: record waiting_for_task, write tool_task_started, poll.

    A task nobody can poll, or a ToolTaskStarted the session cannot store, records the call by
    effect (failed for a read, outcome_unknown otherwise): the task may run.
    """
    error: str | None = None
    if not polls_tool_tasks(rt.runner, record):
        error = MISSING_TOOL_TASK_POLLER
    else:
        problem = tool_task_started_problem(started)
        if problem is not None:
            error = invalid_task_error(problem)
    if error is None:
        waiting = started_task_record(record, started)
        try:
            ctx.set(AGENT_TOOL_CALLS[record.tool_call_id], waiting)
        except ValueTooLargeError as exc:
            error = invalid_task_error(_too_large("task_id", exc))
        else:
            rt.emit(ctx, AgentEventType.TOOL_TASK_STARTED, record.turn_id, {
                "tool_call_id": record.tool_call_id, "tool_name": record.tool_name, "task_id": started.task_id,
            })
            return go_to_poll(waiting)
    rt.finish_record(ctx, finished(record, status_by_effect(record), error=error))
    return StepDecision.dead_end()


def resolve_task_question(
    rt: SessionRuntime,
    ctx: Context,
    record: AgentToolCall,
    interrupt_id: str,
    resolution: QuestionResolution,
    answer: str,
) -> StepDecision:
    """A started task's question was answered, declined, or passed its deadline: the call waits for
    its task again, and PollToolTask hands the task the resolution at once."""
    entry = QuestionAnswer(interrupt_id=interrupt_id, question=record.input_question or "", answer=answer,
                           resolution=resolution)
    waiting = answered_task_record(record, entry)
    try:
        ctx.set(AGENT_TOOL_CALLS[record.tool_call_id], waiting)
    except ValueTooLargeError as exc:
        rt.finish_record(ctx, finished(without_question(record), status_by_effect(record), error=(
            f"{_too_large('the resolution of the task question', exc)}; it was not stored"
        )))
        return StepDecision.dead_end()
    return go_to_poll(waiting)


# The Steps ------------------------------------------------------------------------------------


class TaskSteps:
    """PollToolTask and CancelToolTask; their input is the tool call ID."""

    def __init__(self, runtime: SessionRuntime, tools: ToolSteps) -> None:
        self.rt = runtime
        self.tools = tools  # asks a task's question exactly as CallTool does

    @staticmethod
    def _cancelled(ctx: Context, record: AgentToolCall) -> bool:
        return turn_cancelled(ctx.get(AGENT_STATE), ctx.get(TURN_CANCELLATION_REQUEST), record.turn_id)

    # PollToolTask ------------------------------------------------------------------------------

    async def poll_tool_task_wait(self, ctx: Context, tool_call_id: str) -> Wait:
        record = ctx.get(AGENT_TOOL_CALLS[tool_call_id])
        if record is None or record.status is not AgentToolCallStatus.WAITING_FOR_TASK:
            return Wait.skip_immediately()
        if record.task_answer_pending or self._cancelled(ctx, record):
            # A resolved question reaches the task at once; a cancelled turn moves on without a poll.
            return Wait.until(Timer.by_duration(0))
        interval = record.task_poll_interval_seconds or MIN_TOOL_TASK_POLL_INTERVAL_SECONDS
        return Wait.until(Timer.by_duration(interval))

    async def poll_tool_task(self, ctx: Context, tool_call_id: str) -> StepDecision:
        rt = self.rt
        record = ctx.get(AGENT_TOOL_CALLS[tool_call_id])
        if record is None or record.status is not AgentToolCallStatus.WAITING_FOR_TASK or is_abandoned_task(record):
            return StepDecision.dead_end()  # final already, or CancelToolTask owns it
        if self._cancelled(ctx, record):
            # cancel_turn committed before this Step started (it cancels a waiting or running one).
            return StepDecision.go_to(FINISH_TURN_CANCELLATION, record.turn_id)
        # The poll's commit clears task_answer_pending, whatever the poll returns.
        polled = msgspec.structs.replace(record, task_answer_pending=False)
        if not polls_tool_tasks(rt.runner, record):
            # A Worker whose runner (or the call's tool source) lost poll_tool_task since the task started.
            rt.finish_record(ctx, finished(polled, status_by_effect(record), error=MISSING_TOOL_TASK_POLLER))
            return StepDecision.dead_end()
        from ._tool_steps import finish_tool_call, idempotency_key

        pending_answer = record.input_answers[-1] if record.task_answer_pending and record.input_answers else None
        writer = rt.live_writer(ctx, record.turn_id)

        async def heartbeat() -> None:
            await ctx.heartbeat()

        poll = ToolTaskPoll(
            flow_id=ctx.flow_id, tool_call=record,
            idempotency_key=idempotency_key(ctx.flow_id, record.turn_id, record.tool_call_id),
            attempt=ctx.attempt, input_answers=tuple(record.input_answers), events=writer, heartbeat=heartbeat,
            pending_answer=pending_answer,
        )
        result: object = None
        try:
            # Durable before the poll: a Worker lost from here fails the attempt, so a poll that
            # keeps killing its Worker runs out of attempts instead of being handed out forever.
            await ctx.heartbeat()
            async with background_heartbeats(ctx):
                result = await resolved(cast(ToolTaskPoller, rt.runner).poll_tool_task(poll))
        except ToolExecutionError as exc:
            final = finished(polled, AgentToolCallStatus.FAILED, error=error_message(exc))
        except ToolOutcomeUnknownError as exc:
            final = finished(polled, AgentToolCallStatus.OUTCOME_UNKNOWN, error=error_message(exc))
        else:
            if isinstance(result, ToolTaskPending):
                return self._pending(ctx, polled, result)
            if isinstance(result, ToolInputRequested):
                return self.tools._ask(ctx, polled, result)
            if not isinstance(result, ToolExecutionResult) or not isinstance(result.output, str):
                raise TypeError(
                    f"poll_tool_task returned {shown(result)}; return ToolExecutionResult(output: str), "
                    "ToolTaskPending or ToolInputRequested, or raise ToolExecutionError"
                )
            final = finished(polled, AgentToolCallStatus.SUCCEEDED, output=result.output)
        finally:
            writer.close()
        return finish_tool_call(rt, ctx, polled, final)

    def _pending(self, ctx: Context, record: AgentToolCall, pending: ToolTaskPending) -> StepDecision:
        problem = tool_task_pending_problem(pending)
        if problem is None:
            waiting = pending_task_record(record, pending)
            try:
                ctx.set(AGENT_TOOL_CALLS[record.tool_call_id], waiting)
            except ValueTooLargeError as exc:
                problem = _too_large("the continuation", exc)
            else:
                return go_to_poll(waiting)
        # The task runs on and nothing can poll it with what the runner returned.
        self.rt.finish_record(ctx, finished(record, status_by_effect(record), error=invalid_pending_error(problem)))
        return StepDecision.dead_end()

    # CancelToolTask ----------------------------------------------------------------------------

    async def cancel_tool_task(self, ctx: Context, tool_call_id: str) -> StepDecision:
        rt = self.rt
        record = ctx.get(AGENT_TOOL_CALLS[tool_call_id])
        if record is None or record.status.is_final:
            return StepDecision.dead_end()  # recorded already: never publish twice
        cancel = getattr(rt.runner, "cancel_tool_task", None)
        if record.task_id is not None and callable(cancel):
            from ._tool_steps import idempotency_key

            async def heartbeat() -> None:
                await ctx.heartbeat()

            cancellation = ToolTaskCancellation(
                flow_id=ctx.flow_id, tool_call=record,
                idempotency_key=idempotency_key(ctx.flow_id, record.turn_id, record.tool_call_id),
                attempt=ctx.attempt, heartbeat=heartbeat,
            )
            async with background_heartbeats(ctx):
                await resolved(cancel(cancellation))
        rt.store_cancelled_record(ctx, cancelled_task_record(record))
        return StepDecision.dead_end()
