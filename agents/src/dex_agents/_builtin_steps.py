"""Steps of the built-in tools: AwaitQuestionAnswer (ask_user) and AwaitTimer (durable_wait)."""

from __future__ import annotations

import json

from dex_engine import ChannelCondition, Context, StepDecision, Timer, TimerCondition, Wait

from ._builtin_tools import answered_output, waited_output
from ._constants import AWAIT_QUESTION_ANSWER, DEFAULT_DECLINE_MESSAGE, QUESTION_DEADLINE_PASSED
from ._events import AgentEventType
from ._persistence import AGENT_TOOL_CALLS, INTERRUPT_RESOLUTIONS, PENDING_INTERRUPTS
from ._runtime import INTERRUPT_STEP_LOAD_EXTRA, SessionRuntime, now_utc, pending_interrupts, tool_call_load
from ._timefmt import parse_time
from ._turn_logic import deadline_timer_seconds, finished, without_interrupt
from ._wire import AgentInterrupt, AgentToolCall, AgentToolCallStatus


class BuiltInSteps:
    """Handlers whose input is the tool call ID, like the tool Steps."""

    def __init__(self, runtime: SessionRuntime) -> None:
        self.rt = runtime

    # AwaitQuestionAnswer -------------------------------------------------------------------------

    async def await_question_answer_wait(self, ctx: Context, tool_call_id: str) -> Wait:
        record = ctx.get(AGENT_TOOL_CALLS[tool_call_id])
        if record is None or record.status is not AgentToolCallStatus.AWAITING_ANSWER:
            return Wait.skip_immediately()
        conditions: list[ChannelCondition | TimerCondition] = [INTERRUPT_RESOLUTIONS[tool_call_id].for_one()]
        interrupt = _pending(ctx, tool_call_id)
        if interrupt is not None and interrupt.deadline is not None:
            conditions.append(Timer.by_duration(deadline_timer_seconds(parse_time(interrupt.deadline), now_utc())))
        return Wait.any_of(*conditions)

    async def await_question_answer(self, ctx: Context, tool_call_id: str) -> StepDecision:
        rt = self.rt
        record = ctx.get(AGENT_TOOL_CALLS[tool_call_id])
        if record is None or record.status is not AgentToolCallStatus.AWAITING_ANSWER:
            return StepDecision.dead_end()
        assert ctx.wait_result is not None
        resolutions = ctx.wait_result.messages(INTERRUPT_RESOLUTIONS[tool_call_id])
        if resolutions:
            resolution = resolutions[0]
            if resolution.approved and resolution.answer is not None:
                self._resolved(ctx, record, approved=True, rejection_message=None, answered=True)
                rt.finish_record(ctx, finished(record, AgentToolCallStatus.SUCCEEDED,
                                               output=answered_output(resolution.answer)))
            else:
                message = resolution.rejection_message or DEFAULT_DECLINE_MESSAGE
                self._resolved(ctx, record, approved=False, rejection_message=message, answered=False)
                rt.finish_record(ctx, finished(record, AgentToolCallStatus.REJECTED, rejection_message=message))
            return StepDecision.dead_end()
        if ctx.wait_result.timer_fired:
            kept, interrupt = without_interrupt(pending_interrupts(ctx), tool_call_id)
            if interrupt is not None and interrupt.deadline is not None and now_utc() >= parse_time(
                interrupt.deadline
            ):
                ctx.set(PENDING_INTERRUPTS, kept)
                self._resolved(ctx, record, approved=False, rejection_message=QUESTION_DEADLINE_PASSED,
                               answered=False)
                rt.finish_record(ctx, finished(record, AgentToolCallStatus.REJECTED,
                                               rejection_message=QUESTION_DEADLINE_PASSED))
                return StepDecision.dead_end()
        # An early Timer, or one that fired after answer_question took the interrupt: wait again.
        return StepDecision.go_to(
            AWAIT_QUESTION_ANSWER, tool_call_id, tool_call_load(tool_call_id, *INTERRUPT_STEP_LOAD_EXTRA)
        )

    def _resolved(
        self, ctx: Context, record: AgentToolCall, *, approved: bool, rejection_message: str | None, answered: bool
    ) -> None:
        self.rt.emit(ctx, AgentEventType.INTERRUPT_RESOLVED, record.turn_id, {
            "interrupt_id": record.tool_call_id, "approved": approved, "rejection_message": rejection_message,
            "kind": "question", "answered": answered, "cancellation_reason": None,
        })

    # AwaitTimer --------------------------------------------------------------------------------

    async def await_timer_wait(self, ctx: Context, tool_call_id: str) -> Wait:
        record = ctx.get(AGENT_TOOL_CALLS[tool_call_id])
        if record is None or record.status is not AgentToolCallStatus.WAITING_FOR_TIMER or record.wait_until is None:
            return Wait.skip_immediately()
        return Wait.until(Timer.by_duration(deadline_timer_seconds(parse_time(record.wait_until), now_utc())))

    async def await_timer(self, ctx: Context, tool_call_id: str) -> StepDecision:
        record = ctx.get(AGENT_TOOL_CALLS[tool_call_id])
        if record is None or record.status is not AgentToolCallStatus.WAITING_FOR_TIMER:
            return StepDecision.dead_end()
        # The Timer is the authority: a skipped Timer (SkipTimer) completes the wait early.
        arguments = json.loads(record.arguments)
        output = waited_output(int(arguments["duration_seconds"]), str(arguments["reason"]))
        self.rt.finish_record(ctx, finished(record, AgentToolCallStatus.SUCCEEDED, output=output))
        return StepDecision.dead_end()


def _pending(ctx: Context, interrupt_id: str) -> AgentInterrupt | None:
    return next((i for i in pending_interrupts(ctx) if i.interrupt_id == interrupt_id), None)

