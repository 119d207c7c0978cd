"""Compaction in the session Flow: RunModel's decision, the CompactContext Step, and the load options of
every movement into RunModel (seed 002 "Steps" and "Rules"; seed 003 "Compaction").

RunModel asks the runner for its input estimate before the model call; at the policy's trigger it asks
for a cutoff, and a cutoff past the current summary moves to CompactContext with no model call.
CompactContext makes one summary call and, in one commit, writes ContextSummary, records the usage,
applies retention and moves back to RunModel. With a compaction policy, each movement into RunModel
loads only the AgentMessageChunks instances after the summary, and CompactContext only those it
summarizes; both load the whole AgentMessages window.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from dex_engine import (
    Context,
    LoadSpec,
    MovementOptions,
    NoRetryError,
    NotLoadedError,
    StepDecision,
    ValueTooLargeError,
)

from ._compaction import (
    COMPACTION_RUNNER_METHODS,
    CompactionPolicy,
    ContextSummaryRequest,
    ContextSummaryResult,
    chunks_between,
    messages_between,
    summarized_through,
)
from ._constants import APPLY_TURN_CONTROL, AWAIT_USER_MESSAGE, COMPACT_CONTEXT, RUN_MODEL, RUN_MODEL_HEARTBEAT_INTERVAL
from ._events import AgentEventType
from ._options import AgentSessionOptions
from ._persistence import (
    AGENT_MESSAGE_CHUNKS,
    AGENT_MESSAGE_INDEX,
    AGENT_STATE,
    CONTEXT_SUMMARY,
    message_sequence_key,
)
from ._policy import shown
from ._runner import AgentTurnContext
from ._runtime import (
    TURN_LOAD,
    SessionRuntime,
    ValueTooLarge,
    background_heartbeats,
    chunk_reader,
    resolved,
    window_messages,
    with_unrecorded_usage,
)
from ._timefmt import utc_now_text
from ._turn_logic import TurnContractError, storable_text, usage_problem
from ._wire import (
    AgentMessage,
    AgentMessageChunkRange,
    AgentState,
    AgentStatus,
    CompactContextInput,
    ContextSummary,
)

log = logging.getLogger("dex_agents.session")


class CompactionContractError(NoRetryError):
    """The runner broke the compaction contract; a retry cannot fix it, so the turn fails."""


class BlankContextSummaryError(RuntimeError):
    """summarize_context returned a blank summary: the attempt fails and is retried."""


def check_compaction_runner(runner: object, policy: CompactionPolicy | None) -> None:
    """AgentSessionFlow refuses a compaction policy for a runner without ContextCompactionRunner."""
    if policy is None:
        return
    missing = [name for name in COMPACTION_RUNNER_METHODS if not callable(getattr(runner, name, None))]
    if missing:
        raise TypeError(
            f"AgentSessionOptions.compaction needs a ContextCompactionRunner, but {type(runner).__name__} "
            f"lacks {', '.join(missing)}"
        )


# Load options ------------------------------------------------------------------------------------------

# What a Step that moves into RunModel must load to list the chunks after the summary.
RUN_MODEL_MOVEMENT_LOAD_EXTRA = (AGENT_MESSAGE_INDEX, CONTEXT_SUMMARY)



def _load_with_chunks(ranges: list[AgentMessageChunkRange]) -> LoadSpec:
    """RunModel's load (TURN_LOAD) with only the listed AgentMessageChunks instances instead of all."""
    names = tuple(name for name in TURN_LOAD.names if name != AGENT_MESSAGE_CHUNKS.name)
    chunks = tuple((AGENT_MESSAGE_CHUNKS.name, message_sequence_key(r.first_sequence)) for r in ranges)
    return LoadSpec("only", names, TURN_LOAD.instances + chunks)


def turn_load_options(ctx: Context, options: AgentSessionOptions) -> MovementOptions | None:
    """Load options of a movement into RunModel (or ApplyTurnControl): with compaction, the whole
    window and only the chunks after the summary, as this commit leaves them. None: the Step's own
    load (every chunk), as without compaction, or when the moving Step did not load the index."""
    if options.compaction is None:
        return None
    try:
        index = ctx.get(AGENT_MESSAGE_INDEX)
        summary = ctx.get(CONTEXT_SUMMARY)
    except NotLoadedError:
        return None
    return MovementOptions(load=_load_with_chunks(chunks_between(index, after=summarized_through(summary))))


def go_to_run_model(ctx: Context, options: AgentSessionOptions) -> StepDecision:
    """Move to RunModel, loading only the chunks it reads."""
    return StepDecision.go_to(RUN_MODEL, None, turn_load_options(ctx, options))


def go_to_apply_turn_control(ctx: Context, options: AgentSessionOptions) -> StepDecision:
    """Move to ApplyTurnControl, which reads the turn as RunModel does: only the chunks after the summary."""
    return StepDecision.go_to(APPLY_TURN_CONTROL, None, turn_load_options(ctx, options))


def compact_context_load(ctx: Context, after: int, through: int) -> MovementOptions:
    """CompactContext loads the window and only the chunks it summarizes."""
    ranges = chunks_between(ctx.get(AGENT_MESSAGE_INDEX), after=after, through=through)
    return MovementOptions(load=_load_with_chunks(ranges))


# What the runner sees ------------------------------------------------------------------------------------


def model_view(ctx: Context, rt: SessionRuntime, *, warn: bool) -> tuple[list[AgentMessage], ContextSummary | None]:
    """The messages and summary a runner gets (seed 002 "Rules"): a runner with the compaction
    capability gets only the messages after ContextSummary.last_sequence, plus the summary.

    A runner without it on a session whose retention deleted messages gets what is left, with no
    summary, and `warn` logs that on each model call.
    """
    index = ctx.get(AGENT_MESSAGE_INDEX)
    if rt.compacts:
        summary = ctx.get(CONTEXT_SUMMARY)
        if summary is not None:
            after = summary.last_sequence
            return messages_between(index, window_messages(ctx), chunk_reader(ctx), after=after), summary
    elif warn and index is not None and index.first_sequence > 1:
        log.warning(
            "flow %s: %s does not implement ContextCompactionRunner, but retention deleted the messages "
            "before sequence %d; the model input starts after them, with no summary",
            ctx.flow_id, type(rt.runner).__name__, index.first_sequence,
        )
    return rt.stored_messages(ctx), None


# RunModel's decision -------------------------------------------------------------------------------------


def _whole_number(value: object, source: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TurnContractError(f"{source} returned {shown(value)}; return a whole number")
    return value


async def compaction_before_model_call(
    ctx: Context, rt: SessionRuntime, state: AgentState, turn: AgentTurnContext
) -> StepDecision | None:
    """RunModel's compaction decision, before its model call; None: make the model call.

    Estimate; at the trigger, ask for a cutoff; a cutoff past the current summary sets status
    compacting_context and moves to CompactContext. A runner that breaks the contract (a
    non-integer answer, a cutoff after the newest message) fails the turn in this commit.
    """
    policy = rt.options.compaction
    runner: Any = rt.runner
    if policy is None or not rt.compacts:
        return None
    try:
        estimate = _whole_number(await resolved(runner.estimate_input_tokens(turn)), "estimate_input_tokens")
        if not policy.should_compact(estimate):
            return None
        chosen = await resolved(runner.select_compaction_cutoff(turn, policy.retained_token_budget))
        if chosen is None:
            return None
        cutoff = _whole_number(chosen, "select_compaction_cutoff")
        newest = state.next_message_sequence - 1
        if cutoff > newest:
            raise TurnContractError(
                f"select_compaction_cutoff returned {cutoff}, after the newest stored message {newest}"
            )
    except TurnContractError as exc:
        # As RecordTurnFailure ends a turn: the runner's results of its stored calls, then the note.
        rt.fail_turn(ctx, state, turn.turn_id, str(exc), unfinished=rt.unfinished_turn_messages(turn) or [])
        return StepDecision.go_to(AWAIT_USER_MESSAGE)
    after = summarized_through(turn.context_summary)
    if cutoff <= after:
        return None  # nothing new to summarize: the pair RunModel -> CompactContext cannot loop
    ctx.set(AGENT_STATE, msgspec.structs.replace(state, status=AgentStatus.COMPACTING_CONTEXT))
    return StepDecision.go_to(COMPACT_CONTEXT, CompactContextInput(cutoff), compact_context_load(ctx, after, cutoff))


# CompactContext --------------------------------------------------------------------------------------------


class CompactionSteps:
    """The CompactContext Step handler."""

    def __init__(self, runtime: SessionRuntime) -> None:
        self.rt = runtime

    async def compact_context(self, ctx: Context, request: CompactContextInput | None) -> StepDecision:
        rt = self.rt
        state = ctx.get(AGENT_STATE)
        if state is None or state.active_turn_id is None:
            return StepDecision.dead_end()  # the turn already ended (cancelled, say)
        turn_id = state.active_turn_id
        policy = rt.options.compaction
        runner: Any = rt.runner
        previous = ctx.get(CONTEXT_SUMMARY)
        after = summarized_through(previous)
        through = after if request is None else request.through_sequence
        if policy is None or not rt.compacts or through <= after:
            # A Worker without compaction, or a summary that already covers the range: nothing to do.
            ctx.set(AGENT_STATE, msgspec.structs.replace(state, status=AgentStatus.RUNNING_MODEL))
            return go_to_run_model(ctx, rt.options)
        messages = messages_between(ctx.get(AGENT_MESSAGE_INDEX), window_messages(ctx), chunk_reader(ctx),
                                    after=after, through=through)
        writer = rt.live_writer(ctx, turn_id)
        # Live, at the attempt's start: a retried attempt writes it again.
        writer.write_event(AgentEventType.COMPACTION_STARTED, {"through_sequence": through})

        async def heartbeat() -> None:
            await ctx.heartbeat()

        summary_request = ContextSummaryRequest(
            flow_id=ctx.flow_id, turn_id=turn_id, attempt=ctx.attempt, previous_summary=previous, messages=messages,
            through_sequence=through, events=writer, heartbeat=heartbeat,
            input_token_budget=policy.context_window_tokens, session_settings=rt.turn_settings(ctx, turn_id),
        )
        try:
            async with background_heartbeats(ctx, RUN_MODEL_HEARTBEAT_INTERVAL.total_seconds()):
                result = await resolved(runner.summarize_context(summary_request))
        finally:
            writer.close()
        if not isinstance(result, ContextSummaryResult):
            raise CompactionContractError(
                f"summarize_context returned a {type(result).__name__}; return a ContextSummaryResult"
            )
        problem = usage_problem(result.usage)
        if problem is not None:
            raise CompactionContractError(f"ContextSummaryResult.usage {problem}")
        if result.text is not None and not isinstance(result.text, str):
            # Such as a provider's list of content blocks: not blank (None, no text, is), and every retry
            # would pay for a summary call that comes back the same way.
            raise CompactionContractError(
                f"ContextSummaryResult.text must be a str, got {type(result.text).__name__}; return the summary's text"
            )
        if result.text is None or not result.text.strip():
            raise BlankContextSummaryError(f"summarize_context returned a blank summary through {through}")
        summary = ContextSummary(
            generation=1 if previous is None else previous.generation + 1, first_sequence=1,
            # A lone surrogate (a stream that split a UTF-16 pair) is kept as its escape: the commit
            # would fail on every retry, paying for the summary each time, and every later turn alike.
            last_sequence=through, text=storable_text(result.text), created_at=utc_now_text(),
        )
        try:
            ctx.set(CONTEXT_SUMMARY, summary)
        except ValueTooLargeError as exc:
            too_large = ValueTooLarge(f"the context summary through {through} is too large to store: {exc}")
            raise with_unrecorded_usage(too_large, result.usage) from None  # RecordTurnFailure records it
        rt.record_usage(ctx, turn_id, result.usage)
        index = rt.retain(ctx, ctx.get(AGENT_MESSAGE_INDEX), state.next_message_sequence - 1)
        if index is not None:
            ctx.set(AGENT_MESSAGE_INDEX, index)
        ctx.set(AGENT_STATE, msgspec.structs.replace(state, status=AgentStatus.RUNNING_MODEL))
        rt.emit(ctx, AgentEventType.COMPACTION_FINISHED, turn_id,
                {"generation": summary.generation, "through_sequence": through})
        return go_to_run_model(ctx, rt.options)
