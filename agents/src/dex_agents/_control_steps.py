"""Steering and turn cancellation (seed 002, "Steering and cancellation rules").

Two flags decide every boundary, from committed state only. A turn is cancelled while
TurnCancellationRequest names it, and steered while steered messages wait for ApplyTurnControl
(SteeredMessageCount above AppliedSteeredMessageCount: a Step sees a Channel only by waiting on it,
see _persistence.py). A turn that is both ends as cancelled.

The module has three parts: the pure rules (the flags, the one predicate that says which waiting
calls steering and cancel_turn may abandon, and the records, notes and RPC checks they imply); the
helpers the other Step modules call at their boundaries; and the Steps ApplyTurnControl and
FinishTurnCancellation, with the RPCs steer_user_message, delete_queued_message and cancel_turn.

It imports none of the other Step modules at import time, because they import it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

import msgspec

from dex_engine import (
    Context,
    LoadOptions,
    Movement,
    Rpc,
    RpcContext,
    RPCResult,
    StepDecision,
    Timer,
    Wait,
    WaitResult,
    rpc,
)

from ._compaction_steps import go_to_apply_turn_control
from ._constants import (
    AWAIT_QUESTION_ANSWER,
    AWAIT_TIMER,
    AWAIT_TOOL_APPROVAL,
    AWAIT_USER_MESSAGE,
    CALL_TOOL,
    CANCEL_TOOL_TASK,
    CANCELLED_WHILE_WAITING_TO_RETRY,
    COMPACT_CONTEXT,
    FINISH_TURN_CANCELLATION,
    MAX,
    POLL_TOOL_TASK,
    RECORD_TURN_FAILURE,
    RUN_MODEL,
    STEERED_REJECTION_MESSAGE,
    STEERED_WHILE_WAITING_TO_RETRY,
    TURN_CANCELLED_REJECTION_MESSAGE,
)
from ._events import AgentEventType
from ._persistence import (
    AGENT_STATE,
    AGENT_TOOL_CALLS,
    APPLIED_STEERED_MESSAGE_COUNT,
    INTERRUPT_RESOLUTIONS,
    PENDING_INTERRUPTS,
    QUEUED_USER_MESSAGES,
    STEERED_MESSAGE_COUNT,
    STEERED_USER_MESSAGES,
    TOOL_CALL_CANCELLATIONS,
    TURN_CANCELLATION_REQUEST,
    TURN_CONTROL_REQUESTS,
)
from ._policy import CANCELLED_NOTE_HEADER, STEERED_NOTE_HEADER, build_tool_call_note
from ._runner import AgentTurnContext, FrameworkMessage
from ._runtime import (
    INTERRUPT_STEP_LOAD_EXTRA,
    SessionRuntime,
    pending_interrupts,
    tool_call_load,
)
from ._timefmt import utc_now_text
from ._turn_logic import ended_turn, finished, without_question
from ._wire import (
    AgentInterrupt,
    AgentState,
    AgentStatus,
    AgentToolCall,
    AgentToolCallStatus,
    AgentUserMessage,
    CancellationReason,
    CancelTurnRequest,
    DeleteQueuedMessageRequest,
    SteerUserMessageRequest,
    ToolCallCancellation,
    TurnCancellationRequest,
    TurnControlKind,
    TurnControlRequest,
)

if TYPE_CHECKING:
    from ._turn_steps import TurnSteps

log = logging.getLogger("dex_agents.session")

# The Step types cancel_turn cancels (seed 002, RPCs), in the seed's order. Only those registered in
# the Flow are named: the engine refuses to cancel a Step type it does not know.
CANCEL_TURN_CANCELING_STEPS = (
    RUN_MODEL, COMPACT_CONTEXT, RECORD_TURN_FAILURE, AWAIT_TOOL_APPROVAL, AWAIT_QUESTION_ANSWER, AWAIT_TIMER,
    POLL_TOOL_TASK,
)


# Pure rules -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TurnControl:
    """The two flags of one turn, and how many steered messages wait to start the next turn."""

    steered: bool = False
    cancelled: bool = False
    steered_message_count: int = 0

    @property
    def reason(self) -> CancellationReason | None:
        """Why the turn ends early, None while it runs on; a turn both steered and cancelled is cancelled."""
        if self.cancelled:
            return CancellationReason.TURN_CANCELLED
        if self.steered:
            return CancellationReason.STEERED
        return None


NOT_CONTROLLED = TurnControl()

# What wakes AwaitUserMessage and ResumeTurn for steering and cancel_turn: every control request queued.
# Conditions are immutable values, so every wait shares one.
TURN_CONTROL_WAKE = TURN_CONTROL_REQUESTS.for_range(1, MAX)


def turn_control_of(
    turn_id: str | None,
    *,
    state: AgentState | None,
    cancellation: TurnCancellationRequest | None,
    steered_count: int,
    applied_count: int,
) -> TurnControl:
    """The flags of `turn_id`, which count only while it is the active turn (turn IDs never repeat)."""
    if turn_id is None or state is None or state.active_turn_id != turn_id:
        return NOT_CONTROLLED
    waiting = max(0, steered_count - applied_count)
    cancelled = cancellation is not None and cancellation.turn_id == turn_id
    if not waiting and not cancelled:
        return NOT_CONTROLLED  # what nearly every boundary sees: the shared value, not a new one
    return TurnControl(steered=waiting > 0, cancelled=cancelled, steered_message_count=waiting)


_ABANDONABLE_STATUSES = frozenset({
    AgentToolCallStatus.AWAITING_APPROVAL,
    AgentToolCallStatus.AWAITING_ANSWER,
    AgentToolCallStatus.WAITING_FOR_TIMER,
})


def is_abandonable(record: AgentToolCall) -> bool:
    """The one predicate: a waiting call that has taken no effect, so steering may abandon it.

    An approval, a question no started task asked, or a durable wait. A record with task_id belongs
    to remote work that started and is left to finish; an approved call belongs to its tool Step,
    which checks the flags itself before the tool starts.
    """
    return record.task_id is None and record.status in _ABANDONABLE_STATUSES


def cancellation_rejection_message(reason: CancellationReason) -> str:
    """The structured rejection_message the model sees for a call abandoned before it started."""
    if reason is CancellationReason.TURN_CANCELLED:
        return TURN_CANCELLED_REJECTION_MESSAGE
    return STEERED_REJECTION_MESSAGE


def cancelled_record(record: AgentToolCall, reason: CancellationReason) -> AgentToolCall:
    """The call abandoned before it started: rejected with cancellation_reason, no pending question."""
    unasked = msgspec.structs.replace(without_question(record), cancellation_reason=reason)
    return finished(unasked, AgentToolCallStatus.REJECTED, rejection_message=cancellation_rejection_message(reason))


def controlled_turn_note(
    records: Iterable[AgentToolCall], reason: CancellationReason, *, field_chars: int | None = None
) -> str | None:
    """The steered or cancelled note (the turn-failure note's lines and footer); None without final
    records; `field_chars` as in build_tool_call_note."""
    header = CANCELLED_NOTE_HEADER if reason is CancellationReason.TURN_CANCELLED else STEERED_NOTE_HEADER
    return build_tool_call_note(header, records, field_chars=field_chars)


def owned_interrupt(pending: Iterable[AgentInterrupt], tool_call_id: str) -> AgentInterrupt | None:
    """The pending interrupt a call raised (its approval or its question), if any."""
    return next((i for i in pending if i.tool_call_id == tool_call_id), None)


def steer_abandonments(
    records: Iterable[AgentToolCall], pending: Sequence[AgentInterrupt]
) -> tuple[list[AgentInterrupt], list[str]]:
    """What ResumeTurn does on a steer: the interrupts it removes, and the calls it wakes.

    Each abandonable call with a pending interrupt loses it and is woken; every durable wait is
    woken. A call whose interrupt is gone already has an answer that committed first, and a
    question not raised yet is cancelled by AwaitQuestionAnswer when it would raise it.
    """
    removed: list[AgentInterrupt] = []
    woken: list[str] = []
    for record in sorted(records, key=lambda r: r.deferral_order):
        if not is_abandonable(record):
            continue
        if record.status is AgentToolCallStatus.WAITING_FOR_TIMER:
            woken.append(record.tool_call_id)
            continue
        interrupt = owned_interrupt(pending, record.tool_call_id)
        if interrupt is not None:
            removed.append(interrupt)
            woken.append(record.tool_call_id)
    return removed, woken


class CancellationAction(StrEnum):
    """What FinishTurnCancellation does with one record of the cancelled turn."""

    NONE = "none"  # final, approved (its tool Step decides), or a task CancelToolTask owns already
    RECORD_CANCELLED = "record_cancelled"  # rejected with turn_cancelled; its interrupt is removed
    CANCEL_TASK = "cancel_task"  # a started task: CancelToolTask(id)
    BACK_TO_WAIT = "back_to_wait"  # its interrupt is gone: the waiting Step takes the answer, or abandons


def cancellation_action(record: AgentToolCall, pending: Iterable[AgentInterrupt]) -> CancellationAction:
    """FinishTurnCancellation's decision for one record, from committed state."""
    status = record.status
    if status.is_final or status is AgentToolCallStatus.APPROVED:
        return CancellationAction.NONE
    if status is AgentToolCallStatus.WAITING_FOR_TASK:
        if record.cancellation_reason is CancellationReason.TURN_CANCELLED:
            return CancellationAction.NONE
        return CancellationAction.CANCEL_TASK
    if status is AgentToolCallStatus.WAITING_FOR_TIMER:
        return CancellationAction.RECORD_CANCELLED
    # awaiting_approval or awaiting_answer: cancel_turn cancelled the Step that waited for it.
    if owned_interrupt(pending, record.tool_call_id) is None:
        # An answer committed first (or a tool's question was never raised): the waiting Step
        # takes that answer if there is one, else records the call cancelled itself.
        return CancellationAction.BACK_TO_WAIT
    return CancellationAction.CANCEL_TASK if record.task_id is not None else CancellationAction.RECORD_CANCELLED


def abandoned_task_record(record: AgentToolCall) -> AgentToolCall:
    """A started task cancel_turn abandons: it keeps waiting_for_task, marked for CancelToolTask."""
    return msgspec.structs.replace(
        without_question(record), status=AgentToolCallStatus.WAITING_FOR_TASK,
        cancellation_reason=CancellationReason.TURN_CANCELLED,
    )


def steer_request_ok(request: SteerUserMessageRequest) -> bool:
    """Exactly one of message_id and text, and text that is not blank."""
    if (request.message_id is None) == (request.text is None):
        return False
    return request.text is None or bool(request.text.strip())


# Digits of the longest engine message ID: a 64-bit signed integer (9,223,372,036,854,775,807). A
# longer one names no message, and past 4,300 digits Python's int() refuses to convert it at all.
MAX_CHANNEL_MESSAGE_ID_DIGITS = 19


def channel_message_id(text: str) -> int | None:
    """A PendingUserMessage.message_id as the engine's message ID, None when it cannot be one. Only
    the form the snapshot shows: "01" names no pending message, and must not act on message 1."""
    if len(text) > MAX_CHANNEL_MESSAGE_ID_DIGITS or not text.isdigit() or not text.isascii():
        return None
    number = int(text)
    return number if str(number) == text else None


# Helpers the Step modules call at their boundaries ------------------------------------------------


def read_turn_control(ctx: Context, turn_id: str | None) -> TurnControl:
    """The flags of `turn_id` from this method's snapshot (AgentState, TurnCancellationRequest and the
    two steered counts must be loaded: tool_call_load and the turn loads include them)."""
    return turn_control_of(
        turn_id, state=ctx.get(AGENT_STATE), cancellation=ctx.get(TURN_CANCELLATION_REQUEST),
        steered_count=ctx.get(STEERED_MESSAGE_COUNT) or 0, applied_count=ctx.get(APPLIED_STEERED_MESSAGE_COUNT) or 0,
    )


def emit_interrupt_cancelled(
    rt: SessionRuntime, ctx: Context, interrupt: AgentInterrupt, turn_id: str, reason: CancellationReason
) -> None:
    """interrupt_resolved for an interrupt that steering or cancel_turn removed."""
    rt.emit(ctx, AgentEventType.INTERRUPT_RESOLVED, turn_id, {
        "interrupt_id": interrupt.interrupt_id, "approved": False,
        "rejection_message": cancellation_rejection_message(reason), "kind": interrupt.kind.value,
        "answered": False, "cancellation_reason": reason.value,
    })


def abandon_call(
    rt: SessionRuntime, ctx: Context, record: AgentToolCall, reason: CancellationReason, *, interrupts: bool
) -> StepDecision:
    """Record a call that had not started cancelled, publish its result, and end the branch.

    With `interrupts` (the Step holds the PendingInterrupts lock), its interrupt is removed first
    when it is still pending, with its interrupt_resolved.
    """
    if interrupts:
        pending = pending_interrupts(ctx)
        interrupt = owned_interrupt(pending, record.tool_call_id)
        if interrupt is not None:
            ctx.set(PENDING_INTERRUPTS, [i for i in pending if i is not interrupt])
            emit_interrupt_cancelled(rt, ctx, interrupt, record.turn_id, reason)
    rt.store_cancelled_record(ctx, cancelled_record(record, reason))
    return StepDecision.dead_end()


def reject_before_start(rt: SessionRuntime, ctx: Context, record: AgentToolCall) -> StepDecision | None:
    """The tool Steps' check before tool_call_started: in a steered or cancelled turn the call is
    recorded cancelled and its result published, and the tool never runs. None: run it."""
    reason = read_turn_control(ctx, record.turn_id).reason
    if reason is None:
        return None
    return abandon_call(rt, ctx, record, reason, interrupts=False)


def answer_first_wait(tool_call_id: str, interrupt_id: str) -> Wait:
    """The wait of an approval or question whose interrupt is gone in a steered or cancelled turn.

    Never blocks: it takes an answer that committed first, if one is queued, and any stale wake. A
    Step reads a Channel only by waiting on it, so this is how it tells "answered first" (apply the
    answer) from "steering or cancel_turn removed the interrupt" (record the call cancelled).
    """
    return Wait.all_of(Timer.by_duration(0), INTERRUPT_RESOLUTIONS[interrupt_id].at_most(1),
                       TOOL_CALL_CANCELLATIONS[tool_call_id].at_most(MAX))


def is_answer_first_wait(wait: WaitResult) -> bool:
    """Whether Execute follows an answer-first wait (the only all_of wait of these Steps, with the
    tool question's raise wait, which has the same meaning: no answer is queued)."""
    return wait.spec is not None and wait.spec.mode == "all"


def woken_waiting_call(
    rt: SessionRuntime, ctx: Context, record: AgentToolCall, *, answer_first: bool
) -> StepDecision | None:
    """An approval or question woken by ToolCallCancellations, or back from an answer-first wait
    that found no answer (the Step holds PendingInterrupts). None: wait again.

    ToolCallCancellations only wakes; the flags decide. A wake in a turn neither steered nor
    cancelled (left from an earlier turn whose call reused the ID) changes nothing, and a started
    task's question is never abandoned here. A woken call whose interrupt is gone may have an answer
    that committed first: it waits again, and the answer-first wait takes that answer.
    """
    reason = read_turn_control(ctx, record.turn_id).reason
    if reason is None or record.task_id is not None:
        return None
    if not answer_first and owned_interrupt(pending_interrupts(ctx), record.tool_call_id) is None:
        return None
    return abandon_call(rt, ctx, record, reason, interrupts=True)


def end_controlled_turn(
    rt: SessionRuntime,
    ctx: Context,
    state: AgentState,
    turn_id: str,
    reason: CancellationReason,
    *,
    steered_message_count: int,
    unfinished: list[FrameworkMessage] | None,
) -> AgentState:
    """End a steered or cancelled turn in this commit, every record final.

    Stores the runner's unfinished-turn messages, else (none from the runner, or too large to store)
    the steered or cancelled note when the turn has records (append_turn_ending); deletes the
    records and run state; counts the turn, clears it and last_turn_error; writes turn_steered or
    turn_cancelled.
    """
    records = rt.turn_records(ctx, turn_id)

    def note_text(field_chars: int | None) -> str | None:
        return controlled_turn_note(records.values(), reason, field_chars=field_chars)

    what = "cancelled turn" if reason is CancellationReason.TURN_CANCELLED else "steered turn"
    # The runner's messages when it gives them, else the note; the note also when they do not fit:
    # a write that ran must be told to the next turn's model one way or the other.
    state = rt.append_turn_ending(ctx, state, turn_id, unfinished or [], note_text, what,
                                  note_instead=unfinished is not None)
    count = rt.reply_count(ctx, state, turn_id)
    rt.clear_turn(ctx, turn_id)
    if pending_interrupts(ctx):
        ctx.set(PENDING_INTERRUPTS, [])  # every record is final: nothing of the turn may stay answerable
    state = ended_turn(state, error=None)
    ctx.set(AGENT_STATE, state)
    if reason is CancellationReason.TURN_CANCELLED:
        rt.emit(ctx, AgentEventType.TURN_CANCELLED, turn_id, {"message_count": count})
    else:
        rt.emit(ctx, AgentEventType.TURN_STEERED, turn_id, {
            "steered_message_count": steered_message_count, "message_count": count,
        })
    return state


def end_turn_before_model_call(
    rt: SessionRuntime, ctx: Context, state: AgentState, turn_id: str, control: TurnControl, turn: AgentTurnContext
) -> StepDecision:
    """RunModel in a steered or cancelled turn: end the turn here, as ApplyTurnControl would, with no
    model call, and move to ApplyTurnControl, which starts the steered turn. `turn`'s event writer is
    closed (there is no model call to stream)."""
    reason = control.reason
    assert reason is not None
    end_controlled_turn(rt, ctx, state, turn_id, reason, steered_message_count=control.steered_message_count,
                        unfinished=rt.unfinished_turn_messages(turn))
    return go_to_apply_turn_control(ctx, rt.options)


def wake_abandoned_calls(rt: SessionRuntime, ctx: Context, turn_id: str) -> None:
    """ResumeTurn's control wake in a steered turn that is not cancelled (holds PendingInterrupts):
    remove the interrupts of the abandonable calls and wake their Steps and every durable wait."""
    pending = pending_interrupts(ctx)
    removed, woken = steer_abandonments(rt.turn_records(ctx, turn_id).values(), pending)
    if removed:
        ctx.set(PENDING_INTERRUPTS, [i for i in pending if all(i is not r for r in removed)])
        for interrupt in removed:
            emit_interrupt_cancelled(rt, ctx, interrupt, turn_id, CancellationReason.STEERED)
    for tool_call_id in woken:
        ctx.publish(TOOL_CALL_CANCELLATIONS[tool_call_id], ToolCallCancellation(CancellationReason.STEERED))


# The Steps ----------------------------------------------------------------------------------------


class ControlSteps:
    """ApplyTurnControl (no input) and FinishTurnCancellation (the cancelled turn's ID)."""

    def __init__(self, runtime: SessionRuntime, turn: TurnSteps) -> None:
        self.rt = runtime
        self.turn = turn  # starts the steered turn exactly as a queued message starts one

    # ApplyTurnControl --------------------------------------------------------------------------

    async def apply_turn_control_wait(self, ctx: Context, _: None) -> Wait:
        # Both never block: every steered message and stale wake is taken at once. This Step is
        # the only consumer of SteeredUserMessages.
        return Wait.all_of(STEERED_USER_MESSAGES.at_most(MAX), TURN_CONTROL_REQUESTS.at_most(MAX))

    async def apply_turn_control(self, ctx: Context, _: None) -> StepDecision:
        rt = self.rt
        state = ctx.get(AGENT_STATE)
        if state is None:
            raise RuntimeError("ApplyTurnControl ran before StartAgentSession stored AgentState")
        assert ctx.wait_result is not None
        steered = ctx.wait_result.messages(STEERED_USER_MESSAGES)
        if steered:
            applied = ctx.get(APPLIED_STEERED_MESSAGE_COUNT) or 0
            ctx.set(APPLIED_STEERED_MESSAGE_COUNT, applied + len(steered))
        turn_id = state.active_turn_id
        if turn_id is not None:
            records = rt.turn_records(ctx, turn_id)
            waiting = sorted(r.tool_call_id for r in records.values() if not r.status.is_final)
            if waiting:
                # Every path here comes from a turn whose records are final (ResumeTurn, or a model
                # phase); ending the turn now would lose these calls' results.
                raise RuntimeError(f"ApplyTurnControl found turn {turn_id} with unfinished tool calls {waiting}")
            control = read_turn_control(ctx, turn_id)
            reason = CancellationReason.TURN_CANCELLED if control.cancelled else CancellationReason.STEERED
            turn = self.turn.turn_context(ctx, state, turn_id, live=False)
            state = end_controlled_turn(rt, ctx, state, turn_id, reason, steered_message_count=len(steered),
                                        unfinished=rt.unfinished_turn_messages(turn))
        messages = [m for m in steered if m.text.strip()]
        if not messages:
            return StepDecision.go_to(AWAIT_USER_MESSAGE)
        return self.turn.begin_turn(ctx, state, messages, self.turn.turn_mode(ctx, messages))

    # FinishTurnCancellation --------------------------------------------------------------------

    async def finish_turn_cancellation(self, ctx: Context, turn_id: str) -> StepDecision:
        rt = self.rt
        state = ctx.get(AGENT_STATE)
        cancellation = ctx.get(TURN_CANCELLATION_REQUEST)
        if state is None or state.active_turn_id != turn_id or cancellation is None or cancellation.turn_id != turn_id:
            return StepDecision.dead_end()  # the turn ended first, or this is not its cancellation
        if state.status is not AgentStatus.RUNNING_TOOLS:
            # cancel_turn cancelled the model call, the compaction or the failure route: end the turn.
            return go_to_apply_turn_control(ctx, rt.options)
        # ResumeTurn still waits for the results: this Step owns every call whose waiting Step
        # cancel_turn cancelled, and never ends the turn itself.
        pending = pending_interrupts(ctx)
        kept = list(pending)
        movements: list[Movement] = []
        reason = CancellationReason.TURN_CANCELLED
        for record in sorted(rt.turn_records(ctx, turn_id).values(), key=lambda r: r.deferral_order):
            action = cancellation_action(record, pending)
            if action is CancellationAction.NONE:
                continue
            if action is CancellationAction.BACK_TO_WAIT:
                movements.append(_back_to_wait(record))
                continue
            interrupt = owned_interrupt(kept, record.tool_call_id)
            if interrupt is not None:
                kept.remove(interrupt)
                emit_interrupt_cancelled(rt, ctx, interrupt, turn_id, reason)
            if action is CancellationAction.CANCEL_TASK:
                rt.store_cancelled_record(ctx, abandoned_task_record(record))
                movements.append(Movement(CANCEL_TOOL_TASK, record.tool_call_id, tool_call_load(record.tool_call_id)))
            else:
                rt.store_cancelled_record(ctx, cancelled_record(record, reason))
        if len(kept) != len(pending):
            ctx.set(PENDING_INTERRUPTS, kept)
        return StepDecision.go_to_many(*movements) if movements else StepDecision.dead_end()


def _back_to_wait(record: AgentToolCall) -> Movement:
    """The movement back to a call's waiting Step, which takes an answer that committed first."""
    if record.status is AgentToolCallStatus.AWAITING_APPROVAL:
        return Movement(AWAIT_TOOL_APPROVAL, record.tool_call_id,
                        tool_call_load(record.tool_call_id, *INTERRUPT_STEP_LOAD_EXTRA))
    from ._builtin_steps import question_step_load

    return Movement(AWAIT_QUESTION_ANSWER, record.tool_call_id, question_step_load(record))


def requeue_taken_resolutions(ctx: RpcContext, turn_id: str) -> None:
    """Queue again the answers and approvals of the turn that a waiting Step's satisfied wait took
    but whose Execute has not committed. cancel_turn cancels that Step, and what its wait took goes
    with it (E9), so an answer that committed first would be lost; queued again, the waiting Step
    FinishTurnCancellation sends the call back to applies it (seed 002, FinishTurnCancellation)."""
    from ._builtin_steps import question_interrupt_id

    for record in SessionRuntime.turn_records(ctx, turn_id).values():
        if record.status is AgentToolCallStatus.AWAITING_APPROVAL:
            channel = INTERRUPT_RESOLUTIONS[record.tool_call_id]
        elif record.status is AgentToolCallStatus.AWAITING_ANSWER:
            channel = INTERRUPT_RESOLUTIONS[question_interrupt_id(record)]
        else:
            continue
        for taken in ctx.in_flight(channel):
            ctx.publish(channel, taken.value)


# The RPCs -------------------------------------------------------------------------------------------


def turn_control_rpcs() -> list[Rpc]:
    """steer_user_message, delete_queued_message and cancel_turn."""

    @rpc("steer_user_message", request_type=SteerUserMessageRequest,
         load=LoadOptions.only(AGENT_STATE, STEERED_MESSAGE_COUNT))
    async def steer_user_message(ctx: RpcContext, request: SteerUserMessageRequest) -> bool | RPCResult[bool]:
        # Locks nothing: a steer never waits for a Step. Reads the queued messages to move one.
        if not steer_request_ok(request):
            return False
        queued = None
        if request.message_id is not None:
            wanted = channel_message_id(request.message_id)
            queued = next((m for m in ctx.pending(QUEUED_USER_MESSAGES) if m.message_id == wanted), None)
            if queued is None:
                return False
        state = ctx.get(AGENT_STATE)
        if state is None or state.active_turn_id is None:
            # Nothing to steer: text is queued like send_user_message and starts the next turn at
            # once; a queued message stays queued.
            if request.text is not None:
                ctx.publish(QUEUED_USER_MESSAGES, AgentUserMessage(request.text))
            return True
        if not state.accepts_turn_control:
            return False  # a turn an earlier Worker started may hold waits a steer never wakes
        if queued is not None:
            # The queued message moves as it is (plan_mode kept). If the session consumes it before
            # this commit, nothing commits: the engine reruns the RPC, which then returns False (or
            # fails with ChannelMessageNotFoundError, as Dex does).
            ctx.delete_message(QUEUED_USER_MESSAGES, queued.message_id)
            message: AgentUserMessage = queued.value
        else:
            assert request.text is not None
            message = AgentUserMessage(request.text)
        ctx.publish(STEERED_USER_MESSAGES, message)
        ctx.set(STEERED_MESSAGE_COUNT, (ctx.get(STEERED_MESSAGE_COUNT) or 0) + 1)
        ctx.publish(TURN_CONTROL_REQUESTS, TurnControlRequest(TurnControlKind.STEER))
        # A CallTool waiting for a retry is not running: it ends now, as cancel_turn ends it, so the
        # steered turn does not wait for the retry (an hour, for a rate limit) nor run the tool again;
        # a running one that then fails ends the same way.
        return RPCResult(True, ending_retry_waits=(CALL_TOOL,), ending_reason=STEERED_WHILE_WAITING_TO_RETRY)

    @rpc("delete_queued_message", request_type=DeleteQueuedMessageRequest, load=LoadOptions.none())
    async def delete_queued_message(ctx: RpcContext, request: DeleteQueuedMessageRequest) -> bool:
        wanted = channel_message_id(request.message_id)
        if not any(m.message_id == wanted for m in ctx.pending(QUEUED_USER_MESSAGES)):
            return False
        assert wanted is not None
        ctx.delete_message(QUEUED_USER_MESSAGES, wanted)
        return True

    @rpc("cancel_turn", request_type=CancelTurnRequest | None, locks=[TURN_CANCELLATION_REQUEST, PENDING_INTERRUPTS],
         load=LoadOptions.only(AGENT_STATE, TURN_CANCELLATION_REQUEST, AGENT_TOOL_CALLS))
    async def cancel_turn(ctx: RpcContext, request: CancelTurnRequest | None) -> bool | RPCResult[bool]:
        # Only short Steps hold these locks, so this never waits for a model call; a conflict fails
        # at once and AgentSessionClient.cancel_turn retries it.
        state = ctx.get(AGENT_STATE)
        turn_id = None if state is None else state.active_turn_id
        wanted = None if request is None else request.turn_id
        if state is None or turn_id is None or (wanted is not None and wanted != turn_id):
            return False
        if not state.accepts_turn_control:
            return False
        existing = ctx.get(TURN_CANCELLATION_REQUEST)
        if existing is not None and existing.turn_id == turn_id:
            return True  # already cancelled: nothing changes
        ctx.set(TURN_CANCELLATION_REQUEST, TurnCancellationRequest(turn_id=turn_id, requested_at=utc_now_text()))
        requeue_taken_resolutions(ctx, turn_id)
        canceling = tuple(s for s in CANCEL_TURN_CANCELING_STEPS if s in ctx.flow.steps)
        # A CallTool waiting for a retry (a rate limit's can be an hour) is not running: its call
        # ends now by its effect through RecordToolFailure, and the tool is not called again. A
        # running one keeps the seed's rule and runs to the end, but if it fails it ends the same
        # way instead of retrying (the engine keeps the ending for it).
        return RPCResult(True, next_steps=(Movement(FINISH_TURN_CANCELLATION, turn_id),), canceling_steps=canceling,
                         ending_retry_waits=(CALL_TOOL,), ending_reason=CANCELLED_WHILE_WAITING_TO_RETRY)

    return [steer_user_message, delete_queued_message, cancel_turn]
