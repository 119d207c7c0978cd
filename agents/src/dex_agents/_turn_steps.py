"""Turn-level Steps: StartAgentSession, AwaitUserMessage, RunModel and RecordTurnFailure."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import msgspec

from dex_engine import MAX_VALUE_BYTES, Context, Movement, StepDecision, ValueTooLargeError, Wait

from ._compaction_steps import compaction_before_model_call, go_to_apply_turn_control, go_to_run_model, model_view
from ._constants import (
    AWAIT_QUESTION_ANSWER,
    AWAIT_TOOL_APPROVAL,
    AWAIT_USER_MESSAGE,
    INVALID_START_SESSION_SETTINGS_REASON,
    NEW_MESSAGES_WITHOUT_BUILDER,
    RESUME_TURN,
    RUN_MODEL_HEARTBEAT_INTERVAL,
    TOOL_STEPS,
)
from ._control_steps import TURN_CONTROL_WAKE, end_turn_before_model_call, read_turn_control
from ._events import AgentEventType
from ._persistence import (
    AGENT_PLAN,
    AGENT_STATE,
    AGENT_TOOL_CALLS,
    AGENT_TRACE_CONTEXT,
    AGENT_USAGE,
    FRAMEWORK_RUN_STATE,
    PENDING_INTERRUPTS,
    PENDING_PLAN_EXECUTION,
    QUEUED_USER_MESSAGES,
    SESSION_SETTINGS,
    TURN_CONTROL_REQUESTS,
    TURN_SESSION_SETTINGS,
)
from ._plan_rpcs import consumed_plan_executions, plan_execution_conditions
from ._plans import (
    approved_plan,
    approved_plan_message,
    plan_execution_started_payload,
    plan_updated_payload,
    turn_interaction_mode,
)
from ._policy import text_of
from ._runner import AgentTurnContext, ToolCallsRequested, TurnCompleted, TurnContinued
from ._runtime import (
    INTERRUPT_STEP_LOAD_EXTRA,
    SessionRuntime,
    ToolCallTooLarge,
    ValueTooLarge,
    background_heartbeats,
    now_utc,
    pending_interrupts,
    resolved,
    session_settings,
    tool_call_load,
    unrecorded_usage,
    with_unrecorded_usage,
)
from ._session_settings import session_settings_error
from ._turn_logic import (
    TurnContractError,
    check_framework_messages,
    ended_turn,
    finished,
    initial_state,
    next_turn_id,
    plan_tool_calls,
    started_turn,
    text_problem,
)
from ._wire import (
    AgentInterrupt,
    AgentSessionStartInput,
    AgentState,
    AgentStatus,
    AgentToolCall,
    AgentToolCallStatus,
    AgentUsage,
    AgentUserMessage,
    CompactContextInput,
    InteractionMode,
    InterruptKind,
    PlanExecutionRequest,
    TurnSessionSettings,
)

# AwaitUserMessage takes one queued message at a time (an immutable condition, built once).
_QUEUED_MESSAGE = QUEUED_USER_MESSAGES.for_one()


class TurnSteps:
    """The Step handlers that start, run and end turns."""

    def __init__(self, runtime: SessionRuntime) -> None:
        self.rt = runtime

    # Starting turns ----------------------------------------------------------------------------

    def begin_turn(
        self, ctx: Context, state: AgentState, messages: Sequence[AgentUserMessage], mode: InteractionMode
    ) -> StepDecision:
        """Store the turn's user messages, copy the settings, write turn_started, go to RunModel.

        A user message too large to store fails the new turn in this commit instead.
        """
        rt = self.rt
        turn_id = next_turn_id(state)
        first_sequence = state.next_message_sequence
        state, error = self._store_user_messages(ctx, state, turn_id, messages)
        if error is not None:
            state = started_turn(state, turn_id, mode)
            rt.emit(ctx, AgentEventType.TURN_STARTED, turn_id, {"sequence": first_sequence})
            rt.fail_turn(ctx, state, turn_id, error)
            return StepDecision.go_to(AWAIT_USER_MESSAGE)
        ctx.set(TURN_SESSION_SETTINGS, TurnSessionSettings(turn_id=turn_id, session_settings=session_settings(ctx)))
        ctx.set(AGENT_STATE, started_turn(state, turn_id, mode))
        rt.emit(ctx, AgentEventType.TURN_STARTED, turn_id, {"sequence": first_sequence})
        return go_to_run_model(ctx, rt.options)

    def _store_user_messages(
        self, ctx: Context, state: AgentState, turn_id: str, messages: Sequence[AgentUserMessage]
    ) -> tuple[AgentState, str | None]:
        """Store a turn's user messages; the error that fails the turn when one cannot be stored
        (too large, or the runner cannot build it), else None. Also writes TurnReplySequence: the
        turn's replies start after these messages.

        A steered turn starts with several messages. When one cannot be stored, the others are
        stored one by one, in order, so that the user's other messages are not lost with it, and the
        error names the first left out at the sequence after them, which no stored message has.
        """
        rt = self.rt
        try:
            items = [rt.user_message(m.text) for m in messages]
            return rt.append_messages(ctx, state, turn_id, items, starts_turn=True), None
        except (ValueTooLarge, TurnContractError) as exc:
            if len(messages) < 2:
                return state, str(exc)
        left_out: list[AgentUserMessage] = []
        for message in messages:
            try:
                state = rt.append_messages(ctx, state, turn_id, [rt.user_message(message.text)], starts_turn=True)
            except (ValueTooLarge, TurnContractError):
                left_out.append(message)
        for message in left_out:
            # Again, after the stored ones, for the error's sequence. A message only grows with its
            # sequence, so it fails again; one that a runner builds differently this time is kept.
            try:
                state = rt.append_messages(ctx, state, turn_id, [rt.user_message(message.text)], starts_turn=True)
            except (ValueTooLarge, TurnContractError) as exc:
                return state, str(exc)
        return state, None

    async def start_agent_session(self, ctx: Context, start: AgentSessionStartInput | None) -> StepDecision:
        start = start or AgentSessionStartInput()
        settings = start.session_settings
        if settings is not None and settings != {}:
            problem = session_settings_error(settings)
            if problem is not None:
                return StepDecision.force_fail(f"{INVALID_START_SESSION_SETTINGS_REASON}: {problem}")
            ctx.set(SESSION_SETTINGS, settings)
        state = initial_state()
        ctx.set(AGENT_STATE, state)
        ctx.set(AGENT_USAGE, AgentUsage())
        ctx.set(PENDING_INTERRUPTS, [])
        text = start.initial_message
        if text is not None and text.strip():
            first = [AgentUserMessage(text)]
            return self.begin_turn(ctx, state, first, self.turn_mode(ctx, first))
        return StepDecision.go_to(AWAIT_USER_MESSAGE)

    def turn_mode(self, ctx: Context, messages: Sequence[AgentUserMessage]) -> InteractionMode:
        """The mode of a turn these user messages start: the one rule every turn start applies."""
        return turn_interaction_mode(self.rt.options.plan_mode_enabled, messages, ctx.get(AGENT_PLAN))

    async def await_user_message_wait(self, ctx: Context, _: None) -> Wait:
        # In argument order: a steer beats a queued message; the plan execution condition comes
        # last, so a queued message beats an approval.
        return Wait.any_of(TURN_CONTROL_WAKE, _QUEUED_MESSAGE, *plan_execution_conditions(ctx.get(AGENT_PLAN)))

    async def await_user_message(self, ctx: Context, _: None) -> StepDecision:
        state = ctx.get(AGENT_STATE)
        if state is None:
            raise RuntimeError("AwaitUserMessage ran before StartAgentSession stored AgentState")
        assert ctx.wait_result is not None
        if ctx.wait_result.messages(TURN_CONTROL_REQUESTS):
            # A steer that outlived its turn starts the next one.
            return go_to_apply_turn_control(ctx, self.rt.options)
        approvals = consumed_plan_executions(ctx.wait_result)
        if approvals:
            return self.start_plan_execution(ctx, state, approvals[0])
        messages = [m for m in ctx.wait_result.messages(QUEUED_USER_MESSAGES) if m.text.strip()]
        if not messages:
            return StepDecision.go_to(AWAIT_USER_MESSAGE)  # a blank message published around the RPC
        return self.begin_turn(ctx, state, messages, self.turn_mode(ctx, messages))

    def start_plan_execution(self, ctx: Context, state: AgentState, approval: PlanExecutionRequest) -> StepDecision:
        """An approval execute_plan accepted: consume PendingPlanExecution, then run the plan.

        A stale approval (the plan no longer has that revision, or is not draft or active) waits
        again. Otherwise a draft becomes active (plan_updated), and an executing turn starts with
        the approval message: turn_started, then plan_execution_started.
        """
        rt = self.rt
        ctx.delete(PENDING_PLAN_EXECUTION)
        approved = approved_plan(ctx.get(AGENT_PLAN), approval.revision, now_utc())
        if approved is None:
            return StepDecision.go_to(AWAIT_USER_MESSAGE)
        plan, activated = approved
        turn_id = next_turn_id(state)
        if activated:
            ctx.set(AGENT_PLAN, plan)
            rt.emit(ctx, AgentEventType.PLAN_UPDATED, turn_id, plan_updated_payload(plan))
        message = AgentUserMessage(approved_plan_message(plan.revision))
        decision = self.begin_turn(ctx, state, [message], InteractionMode.EXECUTING)
        started = ctx.get(AGENT_STATE)
        if started is not None and started.active_turn_id == turn_id:
            rt.emit(ctx, AgentEventType.PLAN_EXECUTION_STARTED, turn_id, plan_execution_started_payload(plan.revision))
        return decision

    # RunModel ----------------------------------------------------------------------------------

    def turn_context(self, ctx: Context, state: AgentState, turn_id: str, *, live: bool) -> AgentTurnContext:
        rt = self.rt
        writer = rt.live_writer(ctx, turn_id)
        if not live:
            writer.close()

        async def heartbeat() -> None:
            await ctx.heartbeat()

        # With compaction, only the messages after the summary, and the summary (_compaction_steps.py).
        messages, summary = model_view(ctx, rt, warn=live)
        return AgentTurnContext(
            flow_id=ctx.flow_id, turn_id=turn_id, attempt=ctx.attempt, messages=messages, context_summary=summary,
            framework_run_state=ctx.get(FRAMEWORK_RUN_STATE), tool_calls=rt.turn_records(ctx, turn_id),
            events=writer, heartbeat=heartbeat, tool_policies=rt.options.tool_policies,
            default_tool_effect=rt.options.default_tool_effect, session_settings=rt.turn_settings(ctx, turn_id),
            enabled_built_in_tools=rt.built_in_tool_names,
            interaction_mode=state.interaction_mode, plan=ctx.get(AGENT_PLAN),
        )

    async def run_model(self, ctx: Context, _: CompactContextInput | None) -> StepDecision:
        rt = self.rt
        state = ctx.get(AGENT_STATE)
        if state is None or state.active_turn_id is None:
            return StepDecision.dead_end()  # the turn already ended; nothing to run
        turn_id = state.active_turn_id
        control = read_turn_control(ctx, turn_id)
        if control.reason is not None:
            # Steered or cancelled before the model call: no call; the turn ends in this commit.
            turn = self.turn_context(ctx, state, turn_id, live=False)
            return end_turn_before_model_call(rt, ctx, state, turn_id, control, turn)
        turn = self.turn_context(ctx, state, turn_id, live=True)
        compacting = await compaction_before_model_call(ctx, rt, state, turn)
        if compacting is not None:
            turn.events.close()
            return compacting  # CompactContext, with no model call (or a contract breach ended the turn)
        try:
            async with background_heartbeats(ctx, RUN_MODEL_HEARTBEAT_INTERVAL.total_seconds()):
                outcome = await resolved(rt.runner.run_model_step(turn))
        finally:
            turn.events.close()
        try:
            return self._apply_outcome(ctx, state, turn_id, outcome)
        except TurnContractError as exc:
            return self._fail_in_commit(ctx, state, turn_id, str(exc))
        except ValueTooLarge as exc:
            # Raised after _apply_outcome recorded the usage, which this failed commit drops with the
            # rest: RecordTurnFailure records it, once, in the commit that fails the turn.
            assert isinstance(outcome, TurnCompleted | ToolCallsRequested | TurnContinued)
            raise with_unrecorded_usage(exc, outcome.usage) from None

    def _fail_in_commit(self, ctx: Context, state: AgentState, turn_id: str, error: str) -> StepDecision:
        """A contract breach a retry cannot fix ends the turn in this commit; the session goes on.

        Every breach is found before the outcome stores anything, so `state` is still the stored one,
        and the runner's unfinished-turn messages (results of the turn's stored calls) go before the
        note, as in RecordTurnFailure."""
        turn = self.turn_context(ctx, state, turn_id, live=False)
        self.rt.fail_turn(ctx, state, turn_id, error, unfinished=self.rt.unfinished_turn_messages(turn) or [])
        return StepDecision.go_to(AWAIT_USER_MESSAGE)

    def _apply_outcome(self, ctx: Context, state: AgentState, turn_id: str, outcome: object) -> StepDecision:
        rt = self.rt
        if not isinstance(outcome, TurnCompleted | ToolCallsRequested | TurnContinued):
            raise TurnContractError(
                f"run_model_step returned a {type(outcome).__name__}; return TurnCompleted, ToolCallsRequested "
                "or TurnContinued"
            )
        rt.record_usage(ctx, turn_id, outcome.usage)
        has_builder = rt.builds_unfinished_messages
        if isinstance(outcome, TurnCompleted):
            items = check_framework_messages(outcome.new_messages, "TurnCompleted.new_messages")
            turn_error = outcome.turn_error
            if turn_error is not None:
                turn_error = text_of(turn_error)
                problem = text_problem(turn_error)
                if problem is not None:
                    raise TurnContractError(f"TurnCompleted.turn_error is {problem}")
            # Nothing from here on breaks the contract, so AgentState is set once, as the turn ends.
            state = rt.append_messages(ctx, state, turn_id, items)
            if turn_error is not None:
                # The runner ended the turn with its own transcript (new_messages): no turn-failure
                # note, which seed 002 gives RecordTurnFailure and this commit's contract breaches.
                rt.fail_turn(ctx, state, turn_id, turn_error, note=False)
                return StepDecision.go_to(AWAIT_USER_MESSAGE)
            count = rt.reply_count(ctx, state, turn_id)
            rt.clear_turn(ctx, turn_id)
            ctx.set(AGENT_STATE, ended_turn(state, error=None))
            rt.emit(ctx, AgentEventType.TURN_COMPLETED, turn_id, {"message_count": count})
            return StepDecision.go_to(AWAIT_USER_MESSAGE)
        items = check_framework_messages(outcome.new_messages, f"{type(outcome).__name__}.new_messages")
        if items and not has_builder:
            raise TurnContractError(NEW_MESSAGES_WITHOUT_BUILDER)
        run_state = outcome.framework_run_state
        if not isinstance(run_state, str) or not run_state:
            raise TurnContractError(
                f"{type(outcome).__name__}.framework_run_state must be non-empty text that continues the turn"
            )
        problem = text_problem(run_state)
        if problem is not None:
            raise TurnContractError(f"{type(outcome).__name__}.framework_run_state is {problem}")
        if isinstance(outcome, TurnContinued):
            stored = rt.append_messages(ctx, state, turn_id, items)
            self._store_run_state(ctx, turn_id, run_state)
            if stored is not state:
                ctx.set(AGENT_STATE, stored)  # new messages moved next_message_sequence on
            return go_to_run_model(ctx, rt.options)
        plan = plan_tool_calls(
            outcome.tool_calls, turn_id=turn_id, existing=rt.turn_records(ctx, turn_id), now=now_utc(),
            interrupt_deadline=rt.options.interrupt_deadline, trace_context=ctx.get(AGENT_TRACE_CONTEXT),
            built_in_tools=rt.built_in_tool_names,
            max_durable_wait=rt.options.max_durable_wait,
            interaction_mode=state.interaction_mode, current_plan=ctx.get(AGENT_PLAN),
        )
        state = rt.append_messages(ctx, state, turn_id, items)
        self._store_run_state(ctx, turn_id, run_state)
        raised, unfit = _store_interrupts(ctx, plan.interrupts)
        movements: list[Movement] = []
        for planned in plan.calls:
            record = planned.record
            rt.emit(ctx, AgentEventType.TOOL_CALL_DEFERRED, turn_id, {
                "tool_call_id": record.tool_call_id, "tool_name": record.tool_name,
                "effect": record.effect.value, "requires_approval": record.requires_approval,
            })
            with _record_fits(record):
                error = unfit.get(record.tool_call_id)
                if error is not None:
                    rt.finish_record(ctx, finished(record, AgentToolCallStatus.FAILED, error=error))
                    continue
                if planned.next_step is None:
                    rt.finish_record(ctx, record)
                    continue
                if planned.next_step in TOOL_STEPS:
                    moved = rt.tool_step_movement(ctx.flow_id, record)
                    if isinstance(moved, AgentToolCall):
                        rt.finish_record(ctx, moved)
                    else:
                        ctx.set(AGENT_TOOL_CALLS[record.tool_call_id], record)
                        movements.append(moved)
                    continue
                ctx.set(AGENT_TOOL_CALLS[record.tool_call_id], record)
            if planned.timer_reason is not None:
                rt.emit(ctx, AgentEventType.TIMER_STARTED, turn_id, {
                    "tool_call_id": record.tool_call_id, "wait_until": record.wait_until,
                    "reason": planned.timer_reason,
                })
            extra = (INTERRUPT_STEP_LOAD_EXTRA
                     if planned.next_step in (AWAIT_TOOL_APPROVAL, AWAIT_QUESTION_ANSWER) else ())
            movements.append(Movement(planned.next_step, record.tool_call_id,
                                      tool_call_load(record.tool_call_id, *extra)))
        if plan.plan is not None:
            # write_todos settled in this commit: the plan is replaced whatever else the turn does.
            ctx.set(AGENT_PLAN, plan.plan)
            rt.emit(ctx, AgentEventType.PLAN_UPDATED, turn_id, plan_updated_payload(plan.plan))
        if raised:
            for interrupt in raised:
                rt.emit(ctx, AgentEventType.INTERRUPT_RAISED, turn_id, {
                    "interrupt_id": interrupt.interrupt_id, "tool_call_id": interrupt.tool_call_id,
                    "tool_name": interrupt.tool_name, "deadline": interrupt.deadline, "kind": interrupt.kind.value,
                    "question": interrupt.question, "choices": list(interrupt.choices),
                    "allows_free_text": interrupt.allows_free_text,
                })
        ctx.set(AGENT_STATE, _with_status(state, AgentStatus.RUNNING_TOOLS))
        movements.append(Movement(RESUME_TURN, len(plan.calls)))
        return StepDecision.go_to_many(*movements)

    @staticmethod
    def _store_run_state(ctx: Context, turn_id: str, run_state: str) -> None:
        try:
            ctx.set(FRAMEWORK_RUN_STATE, run_state)
        except ValueTooLargeError as exc:
            raise ValueTooLarge(f"the framework run state of turn {turn_id} is too large to store: {exc}") from None

    # RecordTurnFailure -------------------------------------------------------------------------

    async def record_turn_failure(self, ctx: Context, _: CompactContextInput | None) -> StepDecision:
        rt = self.rt
        state = ctx.get(AGENT_STATE)
        if state is None or state.active_turn_id is None:
            return StepDecision.dead_end()  # the turn already ended (e.g. cancelled)
        turn_id = state.active_turn_id
        recovery = ctx.recovery_error
        usage, detail = (None, "") if recovery is None else unrecorded_usage(recovery.error_type, recovery.detail)
        error = "the model call failed" if recovery is None else detail or recovery.error_type
        if usage is not None:
            rt.record_usage(ctx, turn_id, usage)  # a call whose outcome was too large to store
        if recovery is not None and recovery.error_type == ValueTooLarge.__name__ and "run state of" in error:
            return self._end_session(ctx, state, turn_id, error)
        turn = self.turn_context(ctx, state, turn_id, live=False)
        rt.fail_turn(ctx, state, turn_id, error, unfinished=rt.unfinished_turn_messages(turn) or [])
        return StepDecision.go_to(AWAIT_USER_MESSAGE)

    def _end_session(self, ctx: Context, state: AgentState, turn_id: str, error: str) -> StepDecision:
        """A run state too large to store would fail every later turn too: the session ends failed."""
        ctx.delete(FRAMEWORK_RUN_STATE)
        ctx.set(PENDING_INTERRUPTS, [])
        ended = ended_turn(state, error=error)
        ctx.set(AGENT_STATE, _with_status(ended, AgentStatus.FAILED))
        self.rt.emit(ctx, AgentEventType.TURN_FAILED, turn_id, {"error": error})
        return StepDecision.force_fail(error)


def _store_interrupts(
    ctx: Context, interrupts: Sequence[AgentInterrupt]
) -> tuple[list[AgentInterrupt], dict[str, str]]:
    """Add the response's interrupts to PendingInterrupts, each that still fits in one value: those
    raised, and by tool call ID the error of each left out. A call whose approval request or question
    does not fit is failed, never run, and the rest of the turn goes on: failing RunModel's commit
    would call the model again for the same output (seed 002: a too-large value fails at once)."""
    if not interrupts:
        return [], {}
    pending = pending_interrupts(ctx)
    with contextlib.suppress(ValueTooLargeError):
        ctx.set(PENDING_INTERRUPTS, [*pending, *interrupts])  # most often all fit: one encoding
        return list(interrupts), {}
    # Each set encodes (and checks) the whole list: one set per interrupt took seconds for a few
    # thousand of one response, the Worker's event loop blocked. A JSON array is its items joined by
    # commas in brackets, so adding up each interrupt's size once picks the same ones.
    size = len(msgspec.json.encode(pending))
    count = len(pending)
    raised: list[AgentInterrupt] = []
    unfit: dict[str, str] = {}
    for interrupt in interrupts:
        grown = size + len(msgspec.json.encode(interrupt)) + (1 if count else 0)
        if grown > MAX_VALUE_BYTES:
            unfit[interrupt.tool_call_id] = _interrupt_unfit_error(interrupt, grown, MAX_VALUE_BYTES)
        else:
            raised.append(interrupt)
            size, count = grown, count + 1
    try:
        ctx.set(PENDING_INTERRUPTS, [*pending, *raised])
    except ValueTooLargeError:
        return _store_interrupts_one_by_one(ctx, pending, interrupts)  # the sum was wrong: no guess stored
    return raised, unfit


def _store_interrupts_one_by_one(
    ctx: Context, pending: Sequence[AgentInterrupt], interrupts: Sequence[AgentInterrupt]
) -> tuple[list[AgentInterrupt], dict[str, str]]:
    """_store_interrupts by the engine's own check of each list."""
    raised: list[AgentInterrupt] = []
    unfit: dict[str, str] = {}
    for interrupt in interrupts:
        try:
            ctx.set(PENDING_INTERRUPTS, [*pending, *raised, interrupt])
        except ValueTooLargeError as exc:
            unfit[interrupt.tool_call_id] = _interrupt_unfit_error(interrupt, exc.size, exc.limit)
        else:
            raised.append(interrupt)  # a set that fails writes nothing: the last that fit stands
    return raised, unfit


def _interrupt_unfit_error(interrupt: AgentInterrupt, size: int, limit: int) -> str:
    what = "question" if interrupt.kind is InterruptKind.QUESTION else "approval request"
    return (f"its {what} does not fit with the turn's other pending interrupts ({size} bytes, over the "
            f"session's value limit of {limit}); the call was not run")


def _with_status(state: AgentState, status: AgentStatus) -> AgentState:
    return msgspec.structs.replace(state, status=status)


@contextlib.contextmanager
def _record_fits(record: AgentToolCall) -> Iterator[None]:
    """A call's record over the value limit (arguments near it, from a runner that stores no
    message of them) fails the turn at once, naming the call: a retry would call the model again
    for the same output, and fail alike."""
    try:
        yield
    except ValueTooLargeError as exc:
        raise ToolCallTooLarge(f"tool call {record.tool_call_id!r} ({record.tool_name}) of turn {record.turn_id} is "
                               f"too large to store: {exc}") from None
