"""Steps of questions and the built-in tools: AwaitQuestionAnswer (ask_user and tool questions) and
AwaitTimer (durable_wait).

AwaitQuestionAnswer waits for two kinds of question. An ask_user call's question was raised by
RunModel under the call's own ID. A tool's question (ToolInputRequested) is stored on the call's
record by its tool Step, and this Step raises it as `<tool_call_id>-input-<n>` under the
PendingInterrupts lock, so parallel tool Steps never write PendingInterrupts and cannot lose an update.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from dex_engine import (
    ChannelCondition,
    Context,
    MovementOptions,
    StepDecision,
    Timer,
    TimerCondition,
    ValueTooLargeError,
    Wait,
    WaitResult,
)

from ._builtin_tools import answered_output, waited_output
from ._constants import (
    AWAIT_QUESTION_ANSWER,
    AWAIT_TIMER,
    DEFAULT_DECLINE_MESSAGE,
    FINISH_TURN_CANCELLATION,
    QUESTION_DEADLINE_PASSED,
)
from ._control_steps import abandon_call, answer_first_wait, read_turn_control, woken_waiting_call
from ._events import AgentEventType
from ._persistence import AGENT_TOOL_CALLS, INTERRUPT_RESOLUTIONS, PENDING_INTERRUPTS, TOOL_CALL_CANCELLATIONS
from ._runtime import INTERRUPT_STEP_LOAD_EXTRA, SessionRuntime, now_utc, pending_interrupts, tool_call_load
from ._task_steps import question_failure_status, resolve_task_question
from ._timefmt import format_time, parse_time
from ._turn_logic import deadline_timer_seconds, finished, without_interrupt, without_question
from ._wire import (
    AgentInterrupt,
    AgentInterruptResolution,
    AgentToolCall,
    AgentToolCallStatus,
    InterruptKind,
    QuestionAnswer,
    QuestionResolution,
)


def tool_question_id_in_use(interrupt_id: str) -> str:
    """The error of a tool question whose interrupt ID another call of the turn already uses (seed 002)."""
    return f"the tool's question cannot use interrupt ID {interrupt_id}, which another tool call of this turn uses"


def question_interrupt_id(record: AgentToolCall) -> str:
    """An ask_user question uses the call's ID; a tool's n-th question `<tool_call_id>-input-<n>`."""
    if record.input_question is None:
        return record.tool_call_id
    return f"{record.tool_call_id}-input-{len(record.input_answers) + 1}"


def question_step_load(record: AgentToolCall) -> MovementOptions:
    """What AwaitQuestionAnswer reads: the call's record and PendingInterrupts, and for a tool's
    question also the record a call with the question's ID would have (the collision rule).

    Every movement to AwaitQuestionAnswer for a tool question must use it.
    """
    extra: tuple[Any, ...] = INTERRUPT_STEP_LOAD_EXTRA
    if record.input_question is not None:
        extra = (*extra, AGENT_TOOL_CALLS[question_interrupt_id(record)])
    return tool_call_load(record.tool_call_id, *extra)


def _is_raise_wait(wait: WaitResult) -> bool:
    # Only the WaitFor of a tool question that was neither pending nor answered waits with all_of.
    return wait.spec is not None and wait.spec.mode == "all"


class BuiltInSteps:
    """Handlers whose input is the tool call ID, like the tool Steps."""

    def __init__(self, runtime: SessionRuntime) -> None:
        self.rt = runtime

    # AwaitQuestionAnswer -------------------------------------------------------------------------

    async def await_question_answer_wait(self, ctx: Context, tool_call_id: str) -> Wait:
        record = ctx.get(AGENT_TOOL_CALLS[tool_call_id])
        if record is None or record.status is not AgentToolCallStatus.AWAITING_ANSWER:
            return Wait.skip_immediately()
        interrupt_id = question_interrupt_id(record)
        resolutions = INTERRUPT_RESOLUTIONS[interrupt_id]
        interrupt = _pending(ctx, interrupt_id)
        if record.input_question is not None and (interrupt is None or interrupt.tool_call_id != tool_call_id):
            # A tool's question that is not pending: not raised yet, or raised and already resolved.
            # The zero Timer wakes Execute at once to raise it; at_most(1) never blocks and takes a
            # resolution that is already queued. all_of, because in any_of a fired Timer wins and
            # consumes nothing, and a Step cannot read a Channel without waiting on it.
            return Wait.all_of(Timer.by_duration(0), resolutions.at_most(1))
        if interrupt is None and read_turn_control(ctx, record.turn_id).reason is not None:
            return answer_first_wait(tool_call_id, interrupt_id)  # steered or cancelled: an answer first wins
        conditions: list[ChannelCondition | TimerCondition] = [
            TOOL_CALL_CANCELLATIONS[tool_call_id].for_one(), resolutions.for_one(),
        ]
        if interrupt is not None and interrupt.deadline is not None:
            conditions.append(Timer.by_duration(deadline_timer_seconds(parse_time(interrupt.deadline), now_utc())))
        return Wait.any_of(*conditions)

    async def await_question_answer(self, ctx: Context, tool_call_id: str) -> StepDecision:
        rt = self.rt
        record = ctx.get(AGENT_TOOL_CALLS[tool_call_id])
        if record is None or record.status is not AgentToolCallStatus.AWAITING_ANSWER:
            return StepDecision.dead_end()
        assert ctx.wait_result is not None
        interrupt_id = question_interrupt_id(record)
        resolutions = ctx.wait_result.messages(INTERRUPT_RESOLUTIONS[interrupt_id])
        if resolutions:
            return self._apply_resolution(ctx, record, interrupt_id, resolutions[0])
        raise_wait = _is_raise_wait(ctx.wait_result)
        if raise_wait or ctx.wait_result.messages(TOOL_CALL_CANCELLATIONS[tool_call_id]):
            # No answer is queued (raise wait), or steering or cancel_turn woke the wait: the flags
            # decide (_control_steps.py). A steered or cancelled turn asks nothing new.
            if raise_wait and record.task_id is not None and read_turn_control(ctx, record.turn_id).cancelled:
                # cancel_turn abandons the started task instead: FinishTurnCancellation hands it to
                # CancelToolTask. The record leaves awaiting_answer, so it is not sent back here.
                ctx.set(AGENT_TOOL_CALLS[tool_call_id], msgspec.structs.replace(
                    without_question(record), status=AgentToolCallStatus.WAITING_FOR_TASK))
                return StepDecision.go_to(FINISH_TURN_CANCELLATION, record.turn_id)
            abandoned = woken_waiting_call(rt, ctx, record, answer_first=raise_wait)
            if abandoned is not None:
                return abandoned
        pending = pending_interrupts(ctx)
        kept, interrupt = without_interrupt(pending, interrupt_id)
        if record.input_question is not None and raise_wait:
            # The WaitFor found the question neither pending nor answered, and only this Step raises
            # it, so it was never raised. (A Timer of the other wait fires when the question was
            # pending: one that races answer_question must wait again, never raise it twice.)
            return self._raise_tool_question(ctx, record, interrupt_id, pending, interrupt)
        if ctx.wait_result.timer_fired and interrupt is not None and interrupt.tool_call_id == tool_call_id and (
            interrupt.deadline is not None and now_utc() >= parse_time(interrupt.deadline)
        ):
            ctx.set(PENDING_INTERRUPTS, kept)
            self._resolved(ctx, record, interrupt_id, approved=False, rejection_message=QUESTION_DEADLINE_PASSED,
                           answered=False)
            if record.task_id is not None:  # a started task's question never ends the call: the task decides
                return resolve_task_question(rt, ctx, record, interrupt_id, QuestionResolution.DEADLINE_PASSED,
                                             QUESTION_DEADLINE_PASSED)
            rt.finish_record(ctx, finished(without_question(record), AgentToolCallStatus.REJECTED,
                                           rejection_message=QUESTION_DEADLINE_PASSED))
            return StepDecision.dead_end()
        # An early Timer, or one that fired after answer_question took the interrupt: wait again.
        return StepDecision.go_to(AWAIT_QUESTION_ANSWER, tool_call_id, question_step_load(record))

    def _apply_resolution(
        self, ctx: Context, record: AgentToolCall, interrupt_id: str, resolution: AgentInterruptResolution
    ) -> StepDecision:
        rt = self.rt
        question = record.input_question
        if not (resolution.approved and resolution.answer is not None):
            message = resolution.rejection_message or DEFAULT_DECLINE_MESSAGE
            self._resolved(ctx, record, interrupt_id, approved=False, rejection_message=message, answered=False)
            if record.task_id is not None:  # the task gets the decline through PollToolTask
                return resolve_task_question(rt, ctx, record, interrupt_id, QuestionResolution.DECLINED, message)
            rt.finish_rejected(ctx, without_question(record), message)
            return StepDecision.dead_end()
        self._resolved(ctx, record, interrupt_id, approved=True, rejection_message=None, answered=True)
        if record.task_id is not None:
            return resolve_task_question(rt, ctx, record, interrupt_id, QuestionResolution.ANSWERED, resolution.answer)
        try:
            if question is None:  # ask_user: the answer is the call's result
                rt.finish_record(ctx, finished(record, AgentToolCallStatus.SUCCEEDED,
                                               output=answered_output(resolution.answer)))
                return StepDecision.dead_end()
            # A tool's question: the tool Step runs the call again with the answers so far.
            answer = QuestionAnswer(interrupt_id=interrupt_id, question=question, answer=resolution.answer)
            approved = msgspec.structs.replace(
                without_question(record), status=AgentToolCallStatus.APPROVED,
                input_answers=[*record.input_answers, answer],
            )
            moved = rt.tool_step_movement(ctx.flow_id, approved)
            if isinstance(moved, AgentToolCall):
                rt.finish_record(ctx, moved)
                return StepDecision.dead_end()
            ctx.set(AGENT_TOOL_CALLS[record.tool_call_id], approved)
        except ValueTooLargeError as exc:
            # An answer too large to store would fail this Step on every retry, and with it the
            # session: the call fails instead (a tool that asks has taken no effect).
            rt.finish_record(ctx, finished(without_question(record), AgentToolCallStatus.FAILED, error=(
                f"the user's answer makes the call {exc.size} bytes, over the session's value limit of "
                f"{exc.limit}; it was not stored"
            )))
            return StepDecision.dead_end()
        return StepDecision.go_to_many(moved)

    def _raise_tool_question(
        self,
        ctx: Context,
        record: AgentToolCall,
        interrupt_id: str,
        pending: list[AgentInterrupt],
        interrupt: AgentInterrupt | None,
    ) -> StepDecision:
        """Raise a tool's question under the PendingInterrupts lock, unless another call uses its ID."""
        rt = self.rt
        other = ctx.get(AGENT_TOOL_CALLS[interrupt_id])
        taken = (interrupt is not None and interrupt.tool_call_id != record.tool_call_id) or (
            other is not None and other.turn_id == record.turn_id
        )
        if taken:
            rt.finish_record(ctx, finished(without_question(record), question_failure_status(record),
                                           error=tool_question_id_in_use(interrupt_id)))
            return StepDecision.dead_end()
        if interrupt is None:
            now = now_utc()
            limit = rt.options.interrupt_deadline
            raised = AgentInterrupt(
                interrupt_id=interrupt_id, kind=InterruptKind.QUESTION, tool_call_id=record.tool_call_id,
                tool_name=record.tool_name, arguments=record.arguments, created_at=format_time(now),
                deadline=None if limit is None else format_time(now + limit), question=record.input_question,
                choices=list(record.input_choices), allows_free_text=record.input_allows_free_text,
            )
            try:
                ctx.set(PENDING_INTERRUPTS, [*pending, raised])
            except ValueTooLargeError as exc:
                rt.finish_record(ctx, finished(without_question(record), question_failure_status(record), error=(
                    f"the tool's question does not fit with the turn's other pending interrupts ({exc.size} bytes, "
                    f"over the session's value limit of {exc.limit})"
                )))
                return StepDecision.dead_end()
            rt.emit(ctx, AgentEventType.INTERRUPT_RAISED, record.turn_id, {
                "interrupt_id": raised.interrupt_id, "tool_call_id": raised.tool_call_id,
                "tool_name": raised.tool_name, "deadline": raised.deadline, "kind": raised.kind.value,
                "question": raised.question, "choices": list(raised.choices),
                "allows_free_text": raised.allows_free_text,
            })
        return StepDecision.go_to(AWAIT_QUESTION_ANSWER, record.tool_call_id, question_step_load(record))

    def _resolved(
        self,
        ctx: Context,
        record: AgentToolCall,
        interrupt_id: str,
        *,
        approved: bool,
        rejection_message: str | None,
        answered: bool,
    ) -> None:
        self.rt.emit(ctx, AgentEventType.INTERRUPT_RESOLVED, record.turn_id, {
            "interrupt_id": interrupt_id, "approved": approved, "rejection_message": rejection_message,
            "kind": "question", "answered": answered, "cancellation_reason": None,
        })

    # AwaitTimer --------------------------------------------------------------------------------

    async def await_timer_wait(self, ctx: Context, tool_call_id: str) -> Wait:
        record = ctx.get(AGENT_TOOL_CALLS[tool_call_id])
        if record is None or record.status is not AgentToolCallStatus.WAITING_FOR_TIMER or record.wait_until is None:
            return Wait.skip_immediately()
        # Timers win over Channels: a wait that ends as a steer arrives completes normally.
        return Wait.any_of(Timer.by_duration(deadline_timer_seconds(parse_time(record.wait_until), now_utc())),
                           TOOL_CALL_CANCELLATIONS[tool_call_id].for_one())

    async def await_timer(self, ctx: Context, tool_call_id: str) -> StepDecision:
        record = ctx.get(AGENT_TOOL_CALLS[tool_call_id])
        if record is None or record.status is not AgentToolCallStatus.WAITING_FOR_TIMER:
            return StepDecision.dead_end()
        assert ctx.wait_result is not None
        if not ctx.wait_result.timer_fired:
            # Woken by ToolCallCancellations: the flags decide, and a stale wake waits again.
            reason = read_turn_control(ctx, record.turn_id).reason
            if reason is None:
                return StepDecision.go_to(AWAIT_TIMER, tool_call_id, tool_call_load(tool_call_id))
            return abandon_call(self.rt, ctx, record, reason, interrupts=False)
        # The Timer is the authority: a skipped Timer (SkipTimer) completes the wait early.
        arguments = json.loads(record.arguments)
        output = waited_output(int(arguments["duration_seconds"]), str(arguments["reason"]))
        self.rt.finish_record(ctx, finished(record, AgentToolCallStatus.SUCCEEDED, output=output))
        return StepDecision.dead_end()


def _pending(ctx: Context, interrupt_id: str) -> AgentInterrupt | None:
    return next((i for i in pending_interrupts(ctx) if i.interrupt_id == interrupt_id), None)
