"""Tool call Steps: AwaitToolApproval, CallTool, CallSingleAttemptTool, their failure routes, ResumeTurn.

A tool that returns ToolInputRequested has its question stored on its record here; AwaitQuestionAnswer
(_builtin_steps.py) raises it, and after the answer the same tool Step type runs the call again.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from dex_engine import (
    ChannelCondition,
    Context,
    InvalidIdError,
    StepDecision,
    Timer,
    TimerCondition,
    ValueTooLargeError,
    Wait,
)

from ._builtin_steps import question_interrupt_id, question_step_load
from ._compaction_steps import go_to_apply_turn_control, go_to_run_model
from ._constants import (
    APPROVAL_DEADLINE_PASSED,
    AWAIT_QUESTION_ANSWER,
    AWAIT_TOOL_APPROVAL,
    MAX_STORED_TOOL_ERROR_CHARS,
    RESUME_TURN,
)
from ._control_steps import (
    TURN_CONTROL_WAKE,
    answer_first_wait,
    is_answer_first_wait,
    read_turn_control,
    reject_before_start,
    wake_abandoned_calls,
    woken_waiting_call,
)
from ._events import AgentEventType
from ._persistence import (
    AGENT_STATE,
    AGENT_TOOL_CALLS,
    INTERRUPT_RESOLUTIONS,
    PENDING_INTERRUPTS,
    TOOL_CALL_CANCELLATIONS,
    TOOL_CALL_RESULTS,
    TURN_CONTROL_REQUESTS,
)
from ._policy import cut_text, error_message, shown
from ._runner import (
    DeferredToolExecution,
    ToolExecutionError,
    ToolExecutionResult,
    ToolInputRequested,
    ToolOutcomeUnknownError,
    ToolTaskStarted,
    polls_tool_tasks,
)
from ._runtime import (
    INTERRUPT_STEP_LOAD_EXTRA,
    SessionRuntime,
    background_heartbeats,
    now_utc,
    pending_interrupts,
    resolved,
    tool_call_load,
)
from ._task_steps import cancelled_task_record, is_abandoned_task, question_failure_status, start_tool_task
from ._timefmt import parse_time
from ._turn_logic import (
    deadline_timer_seconds,
    finished,
    not_run_error,
    recovered_status,
    text_problem,
    without_interrupt,
)
from ._wire import AgentInterrupt, AgentStatus, AgentToolCall, AgentToolCallStatus, ToolEffect


def idempotency_key(flow_id: str, turn_id: str, tool_call_id: str) -> str:
    """The same on every attempt of a call; tool call IDs may repeat across turns, so the turn is in it."""
    return f"{flow_id}/{turn_id}/{tool_call_id}"


def oversized_output(record: AgentToolCall, final: AgentToolCall, error: ValueTooLargeError) -> AgentToolCall:
    """`final`, the outcome of `record`, when it is too large to store. A success's output is not
    stored: a read fails (safe to ask again), a write that ran keeps succeeded. Any other outcome
    keeps its status (a write whose outcome is unknown must go on saying so) with its error cut."""
    if final.status is not AgentToolCallStatus.SUCCEEDED:
        return finished(record, final.status, error=cut_text(final.error or "", MAX_STORED_TOOL_ERROR_CHARS))
    note = (f"the tool's output is {error.size} bytes, over the session's value limit of {error.limit}; "
            "it was not stored")
    if record.effect is ToolEffect.READ:
        return finished(record, AgentToolCallStatus.FAILED, error=note)
    return finished(record, AgentToolCallStatus.SUCCEEDED, output=f"[Dex] The tool call succeeded, but {note}.")


def finish_tool_call(rt: SessionRuntime, ctx: Context, record: AgentToolCall, final: AgentToolCall) -> StepDecision:
    """End a tool Step with `final`, the outcome of `record`; when it is too large to store, with
    oversized_output's outcome instead."""
    try:
        rt.finish_record(ctx, final)
    except ValueTooLargeError as exc:
        rt.finish_record(ctx, oversized_output(record, final, exc))
    return StepDecision.dead_end()


def input_request_problem(request: ToolInputRequested) -> str | None:
    """None for a question the session can ask; else what is wrong with it."""
    question: object = request.question
    choices: object = request.choices
    free_text: object = request.allows_free_text
    continuation: object = request.continuation
    if not isinstance(question, str) or not question.strip():
        return "question must be non-empty text"
    if isinstance(choices, str | bytes) or not isinstance(choices, Sequence):
        return "choices must be a sequence of texts"
    if not all(isinstance(c, str) and c.strip() for c in choices):
        return "choices must be non-empty texts"
    if len(set(choices)) != len(choices):
        return "choices repeat"
    if not isinstance(free_text, bool):
        return "allows_free_text must be true or false"
    if not choices and not free_text:
        return "a question without choices must allow free text"
    if continuation is not None and not isinstance(continuation, str):
        return "continuation must be text or None"
    for name, text in (("question", question), *(("a choice", c) for c in choices), ("continuation", continuation)):
        problem = text_problem(text) if isinstance(text, str) else None
        if problem is not None:
            return f"{name} is {problem}"
    return None


def invalid_question_error(problem: str) -> str:
    return f"the tool asked for input with an invalid ToolInputRequested: {problem}"


class ToolSteps:
    """The Step handlers of one tool call each (their input is the tool call ID), and ResumeTurn."""

    def __init__(self, runtime: SessionRuntime) -> None:
        self.rt = runtime

    @staticmethod
    def _record(ctx: Context, tool_call_id: str) -> AgentToolCall | None:
        return ctx.get(AGENT_TOOL_CALLS[tool_call_id])

    # AwaitToolApproval -------------------------------------------------------------------------

    async def await_tool_approval_wait(self, ctx: Context, tool_call_id: str) -> Wait:
        record = self._record(ctx, tool_call_id)
        if record is None or record.status is not AgentToolCallStatus.AWAITING_APPROVAL:
            return Wait.skip_immediately()
        interrupt = _pending(ctx, tool_call_id)
        if interrupt is None and read_turn_control(ctx, record.turn_id).reason is not None:
            return answer_first_wait(tool_call_id, tool_call_id)  # steered or cancelled: an answer first wins
        conditions: list[ChannelCondition | TimerCondition] = [
            TOOL_CALL_CANCELLATIONS[tool_call_id].for_one(), INTERRUPT_RESOLUTIONS[tool_call_id].for_one(),
        ]
        if interrupt is not None and interrupt.deadline is not None:
            seconds = deadline_timer_seconds(parse_time(interrupt.deadline), now_utc())
            conditions.append(Timer.by_duration(seconds))
        return Wait.any_of(*conditions)

    async def await_tool_approval(self, ctx: Context, tool_call_id: str) -> StepDecision:
        rt = self.rt
        record = self._record(ctx, tool_call_id)
        if record is None or record.status is not AgentToolCallStatus.AWAITING_APPROVAL:
            return StepDecision.dead_end()
        assert ctx.wait_result is not None
        resolutions = ctx.wait_result.messages(INTERRUPT_RESOLUTIONS[tool_call_id])
        if resolutions:
            resolution = resolutions[0]
            rejection = None if resolution.approved else resolution.rejection_message
            self._resolved_event(ctx, record, approved=resolution.approved, rejection_message=rejection)
            if resolution.approved:
                approved = msgspec.structs.replace(record, status=AgentToolCallStatus.APPROVED)
                moved = rt.tool_step_movement(ctx.flow_id, approved)
                if isinstance(moved, AgentToolCall):
                    rt.finish_record(ctx, moved)
                    return StepDecision.dead_end()
                ctx.set(AGENT_TOOL_CALLS[tool_call_id], approved)
                return StepDecision.go_to_many(moved)
            rt.finish_rejected(ctx, record, rejection)
            return StepDecision.dead_end()
        answer_first = is_answer_first_wait(ctx.wait_result)
        if answer_first or ctx.wait_result.messages(TOOL_CALL_CANCELLATIONS[tool_call_id]):
            # Steering or cancel_turn woke the wait: the flags decide (_control_steps.py).
            abandoned = woken_waiting_call(rt, ctx, record, answer_first=answer_first)
            if abandoned is not None:
                return abandoned
        elif ctx.wait_result.timer_fired:
            pending = pending_interrupts(ctx)
            kept, interrupt = without_interrupt(pending, tool_call_id)
            due = interrupt is not None and interrupt.deadline is not None and now_utc() >= parse_time(
                interrupt.deadline
            )
            if due:
                ctx.set(PENDING_INTERRUPTS, kept)
                self._resolved_event(ctx, record, approved=False, rejection_message=APPROVAL_DEADLINE_PASSED)
                rt.finish_record(ctx, finished(
                    record, AgentToolCallStatus.REJECTED, rejection_message=APPROVAL_DEADLINE_PASSED
                ))
                return StepDecision.dead_end()
        # The Timer fired early (clock skew) or after resolve_interrupt took the interrupt: wait again.
        return StepDecision.go_to(
            AWAIT_TOOL_APPROVAL, tool_call_id, tool_call_load(tool_call_id, *INTERRUPT_STEP_LOAD_EXTRA)
        )

    def _resolved_event(
        self, ctx: Context, record: AgentToolCall, *, approved: bool, rejection_message: str | None
    ) -> None:
        self.rt.emit(ctx, AgentEventType.INTERRUPT_RESOLVED, record.turn_id, {
            "interrupt_id": record.tool_call_id, "approved": approved, "rejection_message": rejection_message,
            "kind": "tool_approval", "answered": False, "cancellation_reason": None,
        })

    # CallTool and CallSingleAttemptTool ---------------------------------------------------------

    async def call_tool(self, ctx: Context, tool_call_id: str) -> StepDecision:
        return await self._run_tool(ctx, tool_call_id)

    async def call_single_attempt_tool(self, ctx: Context, tool_call_id: str) -> StepDecision:
        return await self._run_tool(ctx, tool_call_id)

    async def _run_tool(self, ctx: Context, tool_call_id: str) -> StepDecision:
        rt = self.rt
        record = self._record(ctx, tool_call_id)
        if record is None or record.status.is_final:
            return StepDecision.dead_end()  # already recorded: never run or publish twice
        if record.status is not AgentToolCallStatus.APPROVED:
            raise RuntimeError(
                f"tool call {tool_call_id!r} is {record.status.value}; a tool Step runs only approved calls"
            )
        # Before tool_call_started only: in a steered or cancelled turn the call never starts. Every
        # attempt sees the first attempt's snapshot, so a tool that started runs to the end.
        rejected = reject_before_start(rt, ctx, record)
        if rejected is not None:
            return rejected
        writer = rt.live_writer(ctx, record.turn_id)
        writer.write_tool_call_started(record.tool_call_id, record.tool_name)
        # Durable before the tool runs: from here a lost Worker fails the attempt instead of handing
        # the same attempt to another Worker, so a started tool is never reported as not run.
        await ctx.heartbeat()

        async def heartbeat() -> None:
            await ctx.heartbeat()

        async def save_checkpoint(text: str) -> None:
            if not isinstance(text, str):
                raise TypeError(f"a heartbeat checkpoint must be text, got {type(text).__name__}")
            await ctx.heartbeat(text)

        call = DeferredToolExecution(
            flow_id=ctx.flow_id, tool_call=record,
            idempotency_key=idempotency_key(ctx.flow_id, record.turn_id, record.tool_call_id),
            attempt=ctx.attempt, events=writer, heartbeat=heartbeat, save_heartbeat_checkpoint=save_checkpoint,
            heartbeat_checkpoint=ctx.checkpoint, context=ctx, input_answers=tuple(record.input_answers),
            supports_tool_tasks=polls_tool_tasks(rt.runner, record),
        )
        result: object = None
        try:
            async with background_heartbeats(ctx):
                result = await resolved(rt.runner.execute_deferred_tool_call(call))
        except ToolExecutionError as exc:
            final = finished(record, AgentToolCallStatus.FAILED, error=error_message(exc))
        except ToolOutcomeUnknownError as exc:
            final = finished(record, AgentToolCallStatus.OUTCOME_UNKNOWN, error=error_message(exc))
        else:
            if isinstance(result, ToolInputRequested):
                return self._ask(ctx, record, result)
            if isinstance(result, ToolTaskStarted):
                return start_tool_task(rt, ctx, record, result)
            if not isinstance(result, ToolExecutionResult) or not isinstance(result.output, str):
                raise TypeError(
                    # shown: a repr that raises, or of megabytes, must not replace or swell this error.
                    f"execute_deferred_tool_call returned {shown(result)}; return ToolExecutionResult(output: str) "
                    "or raise ToolExecutionError"
                )
            final = finished(record, AgentToolCallStatus.SUCCEEDED, output=result.output)
        finally:
            writer.close()
        return finish_tool_call(rt, ctx, record, final)

    def _ask(self, ctx: Context, record: AgentToolCall, request: ToolInputRequested) -> StepDecision:
        """Store the tool's question on its record and move to AwaitQuestionAnswer, which raises it.

        The tool Step never writes PendingInterrupts: parallel tool Steps take no lock, so only
        AwaitQuestionAnswer, under the PendingInterrupts lock, adds the question to it.
        """
        problem = input_request_problem(request)
        if problem is not None:
            # A tool that asks has taken no effect (the runner contract), so the call failed, for
            # writes too: the model sees why and may call the tool again. A started task's question
            # is recorded by effect instead (question_failure_status): the task may run.
            self.rt.finish_record(ctx, finished(record, question_failure_status(record),
                                                error=invalid_question_error(problem)))
            return StepDecision.dead_end()
        waiting = msgspec.structs.replace(
            record, status=AgentToolCallStatus.AWAITING_ANSWER, input_continuation=request.continuation,
            input_question=request.question, input_choices=list(request.choices),
            input_allows_free_text=request.allows_free_text,
        )
        try:
            load = question_step_load(waiting)
        except InvalidIdError as exc:
            # A tool call ID near the key length limit leaves no room for "-input-<n>".
            self.rt.finish_record(ctx, finished(record, question_failure_status(record), error=(
                f"the tool's question cannot use interrupt ID {question_interrupt_id(waiting)}: {exc}"
            )))
            return StepDecision.dead_end()
        try:
            ctx.set(AGENT_TOOL_CALLS[record.tool_call_id], waiting)
        except ValueTooLargeError as exc:
            self.rt.finish_record(ctx, finished(record, question_failure_status(record), error=invalid_question_error(
                f"the question makes the call {exc.size} bytes, over the session's value limit of {exc.limit}"
            )))
            return StepDecision.dead_end()
        return StepDecision.go_to(AWAIT_QUESTION_ANSWER, record.tool_call_id, load)

    # Failure routes ----------------------------------------------------------------------------

    async def record_tool_failure(self, ctx: Context, tool_call_id: str) -> StepDecision:
        return self._record_failure(ctx, tool_call_id, single_attempt=False)

    async def record_tool_outcome_unknown(self, ctx: Context, tool_call_id: str) -> StepDecision:
        return self._record_failure(ctx, tool_call_id, single_attempt=True)

    def _record_failure(self, ctx: Context, tool_call_id: str, *, single_attempt: bool) -> StepDecision:
        record = self._record(ctx, tool_call_id)
        if record is None or record.status.is_final:
            return StepDecision.dead_end()
        if is_abandoned_task(record):
            # CancelToolTask kept failing: the abandoned task still ends the turn, with the same result.
            self.rt.store_cancelled_record(ctx, cancelled_task_record(record))
            return StepDecision.dead_end()
        recovery = ctx.recovery_error
        detail = "the tool Step failed" if recovery is None else recovery.detail or recovery.error_type
        progress = "NOT_COMPLETED" if recovery is None else recovery.attempt_progress.value
        status, never_ran = recovered_status(record, attempt_progress=progress, single_attempt=single_attempt)
        self.rt.finish_record(ctx, finished(record, status, error=not_run_error(detail) if never_ran else detail))
        return StepDecision.dead_end()

    # ResumeTurn --------------------------------------------------------------------------------

    async def resume_turn_wait(self, ctx: Context, expected: int) -> Wait:
        return Wait.any_of(TOOL_CALL_RESULTS.for_n(expected), TURN_CONTROL_WAKE)

    async def resume_turn(self, ctx: Context, expected: int) -> StepDecision:
        state = ctx.get(AGENT_STATE)
        if state is None or state.active_turn_id is None:
            return StepDecision.dead_end()
        turn_id = state.active_turn_id
        assert ctx.wait_result is not None
        if ctx.wait_result.messages(TURN_CONTROL_REQUESTS):
            control = read_turn_control(ctx, turn_id)
            if control.steered and not control.cancelled:
                # A steer: abandon the waits that took no effect; FinishTurnCancellation owns a cancel.
                wake_abandoned_calls(self.rt, ctx, turn_id)
            return StepDecision.go_to(RESUME_TURN, expected)
        records = self.rt.turn_records(ctx, turn_id)
        unfinished = [r for r in records.values() if not r.status.is_final]
        if unfinished:
            # A consumed result belonged to an earlier turn: wait for the ones still missing.
            return StepDecision.go_to(RESUME_TURN, len(unfinished))
        if read_turn_control(ctx, turn_id).reason is not None:
            # Steered or cancelled: ApplyTurnControl ends the turn (the status stays running_tools,
            # so a FinishTurnCancellation that comes later leaves the ending to it).
            return go_to_apply_turn_control(ctx, self.rt.options)
        ctx.set(AGENT_STATE, msgspec.structs.replace(state, status=AgentStatus.RUNNING_MODEL))
        return go_to_run_model(ctx, self.rt.options)  # with compaction, only the chunks after the summary


def _pending(ctx: Context, interrupt_id: str) -> AgentInterrupt | None:
    for interrupt in pending_interrupts(ctx):
        if interrupt.interrupt_id == interrupt_id:
            return interrupt
    return None
