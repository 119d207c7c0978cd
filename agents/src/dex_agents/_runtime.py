"""What every session Step shares: the runner, options, events, message storage and turn endings."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import inspect
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, cast

import msgspec

from dex_engine import (
    MAX_VALUE_BYTES,
    ChannelRef,
    Context,
    LoadOptions,
    LoadSpec,
    Movement,
    MovementOptions,
    NoRetryError,
    NotLoadedError,
    RpcContext,
    Stream,
    ValueTooLargeError,
)

from ._chunk_memo import ChunkMessagesMemo
from ._compaction import is_compaction_runner, plan_retention
from ._constants import (
    CUT_NOTE_FIELD_CHARS,
    MAX_STORED_TOOL_ERROR_CHARS,
    MAX_STORED_TURN_ERROR_CHARS,
    REJECTION_MESSAGE_NOT_STORED,
    TIGHTER_NOTE_FIELD_CHARS,
    TOOL_HEARTBEAT_INTERVAL,
)
from ._events import AgentEventType, AgentEventWriter, make_event
from ._message_store import (
    MessageLayoutLimits,
    all_messages,
    chunk_bytes,
    iter_newest_first,
    message_bytes,
    plan_append,
    reply_start_by_scan,
)
from ._options import AgentSessionOptions
from ._persistence import (
    AGENT_MESSAGE_CHUNKS,
    AGENT_MESSAGE_INDEX,
    AGENT_MESSAGES,
    AGENT_PLAN,
    AGENT_STATE,
    AGENT_TOOL_CALLS,
    AGENT_TRACE_CONTEXT,
    AGENT_USAGE,
    APPLIED_STEERED_MESSAGE_COUNT,
    CONTEXT_SUMMARY,
    FRAMEWORK_RUN_STATE,
    PENDING_INTERRUPTS,
    SESSION_SETTINGS,
    STEERED_MESSAGE_COUNT,
    TOOL_CALL_RESULTS,
    TURN_CANCELLATION_REQUEST,
    TURN_REPLY_SEQUENCE,
    TURN_SESSION_SETTINGS,
    message_sequence_key,
)
from ._policy import build_turn_failure_note, cut_text, raised_text
from ._runner import AgentFrameworkRunner, AgentTurnContext, FrameworkMessage, UnfinishedTurnMessageBuilder
from ._timefmt import utc_now_text
from ._turn_logic import (
    TurnContractError,
    check_framework_messages,
    deferred_call_of,
    ended_turn,
    ending_tries,
    finished,
    not_run_error,
    smaller_records,
    storable_outcome,
    to_agent_message,
    tool_step_for,
    tool_step_overrides,
    usage_problem,
)
from ._wire import (
    AgentEvent,
    AgentInterrupt,
    AgentMessage,
    AgentMessageChunk,
    AgentMessageChunkRange,
    AgentMessageIndex,
    AgentState,
    AgentToolCall,
    AgentToolCallStatus,
    AgentUsage,
    AgentUserMessage,
    JsonObject,
    MessageRole,
    PendingUserMessage,
    ToolCallCompleted,
    TurnReplySequence,
)

log = logging.getLogger("dex_agents.session")

# What a turn-level Step that stores messages reads: the session's state with the whole message
# window (AgentMessages) and AgentMessageIndex, but no AgentMessageChunks. Enough for StartAgentSession
# and AwaitUserMessage, which store messages (and roll the window over) but never read old ones.
WINDOW_LOAD: LoadSpec = LoadOptions.only(
    AGENT_STATE, AGENT_MESSAGES, AGENT_MESSAGE_INDEX, TURN_REPLY_SEQUENCE, FRAMEWORK_RUN_STATE, AGENT_TOOL_CALLS,
    PENDING_INTERRUPTS, AGENT_USAGE, SESSION_SETTINGS, TURN_SESSION_SETTINGS, CONTEXT_SUMMARY, AGENT_PLAN,
    TURN_CANCELLATION_REQUEST, AGENT_TRACE_CONTEXT, STEERED_MESSAGE_COUNT, APPLIED_STEERED_MESSAGE_COUNT,
)
# WINDOW_LOAD plus every AgentMessageChunks instance: RunModel and RecordTurnFailure give the runner
# the whole conversation. Without compaction the model input is every message, so these Steps load
# every chunk (seed 003 "Message storage and retention"); the whole map, not instances listed per
# movement, because every movement into RunModel would list all of them anyway, and ResumeTurn and
# the failure route could not list them (they do not load AgentMessageIndex).
TURN_LOAD: LoadSpec = LoadOptions.only(
    AGENT_STATE, AGENT_MESSAGES, AGENT_MESSAGE_CHUNKS, AGENT_MESSAGE_INDEX, TURN_REPLY_SEQUENCE,
    FRAMEWORK_RUN_STATE, AGENT_TOOL_CALLS, PENDING_INTERRUPTS, AGENT_USAGE, SESSION_SETTINGS,
    TURN_SESSION_SETTINGS, CONTEXT_SUMMARY, AGENT_PLAN, TURN_CANCELLATION_REQUEST, AGENT_TRACE_CONTEXT,
    STEERED_MESSAGE_COUNT, APPLIED_STEERED_MESSAGE_COUNT,
)


class ValueTooLarge(NoRetryError):
    """A value the Step must store is over the engine's value limit; retrying cannot help."""


class ToolCallTooLarge(ValueTooLarge):
    """A tool call's record is over the value limit. Its own type, not ValueTooLarge: the seed has
    RecordTurnFailure end the session for a ValueTooLarge whose detail contains "run state of",
    and this detail names a tool the model chose."""


# A model call whose outcome (an answer, a run state, a call's record, a summary) is too large to
# store fails its Step's commit, and the usage recorded in it, the call paid for, with it. The
# failure route, RecordTurnFailure, records it: the failure's detail, all the engine hands it, leads
# with the usage. A prefix, because the engine keeps a detail's first MAX_ERROR_TEXT_CHARS and the
# rest is text a runner chose (a tool's name), which can neither push it out nor stand for it.
_UNRECORDED_USAGE = "[usage of the model call, recorded by the failure route: "
_UNRECORDED_USAGE_END = "] "


def with_unrecorded_usage(exc: ValueTooLarge, usage: AgentUsage) -> ValueTooLarge:
    """`exc` again, of its type (the failure route's rule reads it), its detail led by `usage`."""
    return type(exc)(f"{_UNRECORDED_USAGE}{msgspec.json.encode(usage).decode()}{_UNRECORDED_USAGE_END}{exc}")


def unrecorded_usage(error_type: str, detail: str) -> tuple[AgentUsage | None, str]:
    """The usage with_unrecorded_usage put in a failure's detail, and the detail without it; (None,
    `detail`) for any other failure. Only a too-large error carries it: the detail of any other is a
    runner's text."""
    if error_type not in (ValueTooLarge.__name__, ToolCallTooLarge.__name__) or not detail.startswith(
            _UNRECORDED_USAGE):
        return None, detail
    encoded, found, rest = detail[len(_UNRECORDED_USAGE):].partition(_UNRECORDED_USAGE_END)
    if not found:
        return None, detail
    try:
        usage = msgspec.json.decode(encoded, type=AgentUsage)
    except msgspec.DecodeError:  # ValidationError included
        return None, detail
    return (None, detail) if usage_problem(usage) is not None else (usage, rest)


# Steps that wait on an interrupt (approval, question) also read the pending interrupts (deadlines).
INTERRUPT_STEP_LOAD_EXTRA = (PENDING_INTERRUPTS,)


def pending_interrupts(ctx: Context | RpcContext) -> list[AgentInterrupt]:
    stored = ctx.get(PENDING_INTERRUPTS)
    return [] if stored is None else list(stored)


def waiting_user_messages(ctx: RpcContext, channel: ChannelRef[AgentUserMessage]) -> list[PendingUserMessage]:
    """The user messages of a channel that no turn has taken yet, oldest first: those a satisfied
    AwaitUserMessage (or ApplyTurnControl) wait took but whose Execute has not committed, which no
    RPC can delete any more, then those still queued."""
    return [PendingUserMessage(str(m.message_id), m.value)
            for m in (*ctx.in_flight(channel), *ctx.pending(channel))]


def session_settings(ctx: Context | RpcContext) -> JsonObject:
    stored = ctx.get(SESSION_SETTINGS)
    return {} if stored is None else dict(stored)


def now_utc() -> datetime:
    return datetime.now(UTC)


# What every tool call Step also reads: the two flags of steering and cancel_turn (_control_steps.py).
TURN_CONTROL_LOAD_EXTRA = (AGENT_STATE, TURN_CANCELLATION_REQUEST, STEERED_MESSAGE_COUNT, APPLIED_STEERED_MESSAGE_COUNT)


def tool_call_load(tool_call_id: str, *extra: Any) -> MovementOptions:
    """Tool Steps load only their own AgentToolCalls instance, the turn-control flags, and `extra`."""
    return MovementOptions(load=LoadOptions.only(AGENT_TOOL_CALLS[tool_call_id], *TURN_CONTROL_LOAD_EXTRA, *extra))


@dataclass(frozen=True)
class SessionRuntime:
    """The runner and options of one agent Flow type, and the helpers its Steps share."""

    runner: AgentFrameworkRunner[Any]
    options: AgentSessionOptions
    events: Stream[AgentEvent]

    @functools.cached_property
    def builds_unfinished_messages(self) -> bool:
        """Whether the runner is an UnfinishedTurnMessageBuilder; asked once (a Protocol isinstance is slow)."""
        return isinstance(self.runner, UnfinishedTurnMessageBuilder)

    @functools.cached_property
    def compacts(self) -> bool:
        """Whether the runner is a ContextCompactionRunner; asked once, not on every model call."""
        return is_compaction_runner(self.runner)

    @functools.cached_property
    def built_in_tool_names(self) -> frozenset[str]:
        """The enabled built-in tools by name, from the options a Flow keeps for its lifetime."""
        return frozenset(t.value for t in self.options.built_in_tools)

    # Events ----------------------------------------------------------------------------------

    def emit(self, ctx: Context, event_type: AgentEventType, turn_id: str | None, payload: Mapping[str, Any]) -> None:
        """Append an event at this Step's commit (it appears only if the Step commits). One too
        large to store (an interrupt_raised of a question near the value limit, whose payload is
        JSON inside JSON) is dropped with a warning: streams are best effort, and the Step would
        fail alike on every retry. Readers have the snapshot."""
        event = make_event(event_type, turn_id, ctx.step_execution_id, ctx.attempt, payload)
        try:
            ctx.append(self.events, event)
        except ValueTooLargeError as exc:
            log.warning("flow %s: dropped a %s event of %s: %s", ctx.flow_id, event_type, ctx.step_execution_id, exc)

    def live_writer(self, ctx: Context, turn_id: str | None) -> AgentEventWriter:
        """A best-effort writer for the runner: events appear at once, before the attempt commits."""

        def write(event: AgentEvent) -> None:
            ctx.write_event(self.events, event)

        return AgentEventWriter(write, turn_id, ctx.step_execution_id, ctx.attempt, flow_id=ctx.flow_id)

    # Messages ----------------------------------------------------------------------------------

    @functools.cached_property
    def layout_limits(self) -> MessageLayoutLimits:
        """From the options, which a Flow keeps for its lifetime; built once."""
        options = self.options
        return MessageLayoutLimits(
            window_size=options.message_window_size, chunk_size=options.message_chunk_size,
            chunk_max_bytes=options.message_chunk_max_bytes,
        )

    @functools.cached_property
    def chunk_memo(self) -> ChunkMessagesMemo:
        """The chunks' messages each session's last model call assembled (one memo per Flow type)."""
        return ChunkMessagesMemo()

    def stored_messages(self, ctx: Context) -> list[AgentMessage]:
        """Every stored message, window and chunks, in sequence order, for a model call (needs
        AgentMessageChunks loaded)."""
        return all_messages(ctx.get(AGENT_MESSAGE_INDEX), window_messages(ctx), every_chunk_reader(ctx),
                            self.chunk_memo.reader(ctx.flow_id))

    def append_messages(
        self,
        ctx: Context,
        state: AgentState,
        turn_id: str,
        items: Sequence[FrameworkMessage],
        *,
        starts_turn: bool = False,
    ) -> AgentState:
        """Store messages under the next sequences, rolling the window over (seed 002 "Message storage").

        With `starts_turn`, the items are the turn's user messages and TurnReplySequence is set to the
        sequence after them; otherwise a turn without its own TurnReplySequence gets one, from a scan
        back, before any rollover. Raises ValueTooLarge naming the message before anything is written,
        so a caller that catches it commits none of these messages. No items and no turn start:
        nothing is written.
        """
        if not items:
            if starts_turn:
                ctx.set(TURN_REPLY_SEQUENCE, TurnReplySequence(turn_id=turn_id, sequence=state.next_message_sequence))
            return state
        first = state.next_message_sequence
        created_at = utc_now_text()
        messages = [to_agent_message(item, first + i, turn_id, created_at) for i, item in enumerate(items)]
        limits = self.layout_limits
        sizes: dict[int, int] = {}
        for message in messages:
            size = sizes[message.sequence] = message_bytes(message)
            # Only a message stored alone in a chunk can be over the limit: a window message's own chunk
            # fits message_chunk_max_bytes, which the options keep within MAX_VALUE_BYTES.
            stored_size = chunk_bytes([size])
            if stored_size > MAX_VALUE_BYTES:
                exc = ValueTooLargeError(AGENT_MESSAGE_CHUNKS[message_sequence_key(message.sequence)].label,
                                         stored_size, MAX_VALUE_BYTES)
                raise ValueTooLarge(
                    f"message {message.sequence} ({message.role.value}) of turn {turn_id} is too large to store: "
                    f"{exc}"
                )
        window = window_messages(ctx)
        index = ctx.get(AGENT_MESSAGE_INDEX)
        after = first + len(messages)
        marker = ctx.get(TURN_REPLY_SEQUENCE)
        if starts_turn:
            ctx.set(TURN_REPLY_SEQUENCE, TurnReplySequence(turn_id=turn_id, sequence=after))
        elif marker is None or marker.turn_id != turn_id:
            # A turn another Worker started: record where its replies start while they are readable.
            start = reply_start_by_scan(iter_newest_first(index, window, chunk_reader(ctx)), turn_id, first)
            ctx.set(TURN_REPLY_SEQUENCE, TurnReplySequence(turn_id=turn_id, sequence=start))
        writes = plan_append(window, index, messages, limits, sizes=sizes)
        try:
            for message in writes.window_sets:
                ctx.set(AGENT_MESSAGES[message_sequence_key(message.sequence)], message)
            for chunk in writes.chunk_sets:
                ctx.set(AGENT_MESSAGE_CHUNKS[message_sequence_key(chunk.messages[0].sequence)], chunk)
        except ValueTooLargeError as exc:
            # Not reached: every size was checked above and rollover chunks fit message_chunk_max_bytes.
            raise ValueTooLarge(f"messages of turn {turn_id} are too large to store: {exc}") from None
        for sequence in writes.window_deletes:
            ctx.delete(AGENT_MESSAGES[message_sequence_key(sequence)])
        new_index = self.retain(ctx, writes.index or index, after - 1) or writes.index
        if new_index is not None:
            ctx.set(AGENT_MESSAGE_INDEX, new_index)
        return msgspec.structs.replace(state, next_message_sequence=after)

    def retain(self, ctx: Context, index: AgentMessageIndex | None, newest: int) -> AgentMessageIndex | None:
        """Retention (seed 002 "Message storage"): with compaction, delete the oldest summarized chunks
        that have retained_message_limit messages after them. Returns the new index, None: no change."""
        if self.options.compaction is None:
            return None
        plan = plan_retention(index, ctx.get(CONTEXT_SUMMARY), self.options.retained_message_limit, newest)
        for chunk in plan.deleted:
            ctx.delete(AGENT_MESSAGE_CHUNKS[message_sequence_key(chunk.first_sequence)])
        return plan.index

    def user_message(self, text: str) -> FrameworkMessage:
        """The runner's user message for `text`; a runner that raises or returns another role breaks the contract."""
        try:
            built = self.runner.build_user_message(text)
        except Exception as exc:
            raise TurnContractError(f"build_user_message raised {raised_text(exc)}") from exc
        checked = check_framework_messages([built], "build_user_message(...)", single=True)[0]
        if checked.role is not MessageRole.USER:
            raise TurnContractError(f"build_user_message returned role {checked.role.value!r}; it must be 'user'")
        return checked

    # Turns -------------------------------------------------------------------------------------

    @staticmethod
    def turn_records(ctx: Context | RpcContext, turn_id: str) -> dict[str, AgentToolCall]:
        return {k: r for k, r in ctx.items(AGENT_TOOL_CALLS).items() if r.turn_id == turn_id}

    @staticmethod
    def reply_count(ctx: Context, state: AgentState, turn_id: str) -> int:
        """Messages the turn appended after its user messages: next_message_sequence - TurnReplySequence.

        Only a turn whose TurnReplySequence names another turn is scanned back from the newest message.
        """
        reply = ctx.get(TURN_REPLY_SEQUENCE)
        if reply is not None and reply.turn_id == turn_id:
            return state.next_message_sequence - reply.sequence
        newest_first = iter_newest_first(ctx.get(AGENT_MESSAGE_INDEX), window_messages(ctx), chunk_reader(ctx))
        return state.next_message_sequence - reply_start_by_scan(newest_first, turn_id, state.next_message_sequence)

    @staticmethod
    def turn_settings(ctx: Context, turn_id: str) -> JsonObject:
        """The settings the turn started with; a copy tagged with another turn reads as {}."""
        stored = ctx.get(TURN_SESSION_SETTINGS)
        return dict(stored.session_settings) if stored is not None and stored.turn_id == turn_id else {}

    def record_usage(self, ctx: Context, turn_id: str, usage: AgentUsage) -> None:
        problem = usage_problem(usage)
        if problem is not None:
            raise TurnContractError(f"usage {problem}")
        total = (ctx.get(AGENT_USAGE) or AgentUsage()).plus(usage)
        ctx.set(AGENT_USAGE, total)
        self.emit(ctx, AgentEventType.USAGE_RECORDED, turn_id, {
            "recorded": msgspec.to_builtins(usage), "session": msgspec.to_builtins(total),
        })

    def clear_turn(self, ctx: Context, turn_id: str) -> None:
        """Delete the turn's tool call records and run state."""
        for key in self.turn_records(ctx, turn_id):
            ctx.delete(AGENT_TOOL_CALLS[key])
        ctx.delete(FRAMEWORK_RUN_STATE)

    def unfinished_turn_messages(self, turn: AgentTurnContext) -> list[FrameworkMessage] | None:
        """The runner's unstored items of an unfinished turn, or None when it has none to give (no
        builder, or the builder failed, which is logged: a runner defect never blocks a turn's end)."""
        if not self.builds_unfinished_messages:
            return None
        try:
            built = cast(UnfinishedTurnMessageBuilder, self.runner).build_unfinished_turn_messages(turn)
            return check_framework_messages(built, "build_unfinished_turn_messages(...)")
        except Exception:
            log.warning("flow %s turn %s: build_unfinished_turn_messages failed; the turn ends without its items",
                        turn.flow_id, turn.turn_id, exc_info=True)
            return None

    def fail_turn(
        self,
        ctx: Context,
        state: AgentState,
        turn_id: str,
        error: str,
        *,
        unfinished: Sequence[FrameworkMessage] = (),
        note: bool = True,
    ) -> None:
        """End the turn as failed in this commit: unfinished items, the note (with `note` and final
        records), cleared records. What does not fit the value limit is left out (append_turn_ending);
        nothing here blocks the failure: an error over MAX_STORED_TURN_ERROR_CHARS is cut."""
        error = cut_text(error, MAX_STORED_TURN_ERROR_CHARS)
        records = self.turn_records(ctx, turn_id)

        def note_text(field_chars: int | None) -> str | None:
            return build_turn_failure_note(records.values(), field_chars=field_chars)

        state = self.append_turn_ending(ctx, state, turn_id, unfinished, note_text if note else None, "failed turn")
        self.clear_turn(ctx, turn_id)
        ctx.set(PENDING_INTERRUPTS, [])
        state = ended_turn(state, error=error)
        ctx.set(AGENT_STATE, state)
        self.emit(ctx, AgentEventType.TURN_FAILED, turn_id, {"error": error})

    def append_turn_ending(
        self,
        ctx: Context,
        state: AgentState,
        turn_id: str,
        unfinished: Sequence[FrameworkMessage],
        note_text: Callable[[int | None], str | None] | None,
        what: str,
        *,
        note_instead: bool = False,
    ) -> AgentState:
        """Store an ending turn's last messages: `unfinished`, then the note `note_text(None)` gives,
        if any. When they do not fit the value limit, the first of ending_tries that fits (the note
        whole, then cut to CUT_NOTE_FIELD_CHARS a field, then to each TIGHTER_NOTE_FIELD_CHARS, before
        the unfinished messages); a runner that cannot build the note leaves it out. With
        `note_instead`, the note is stored only when the unfinished messages do not fit
        (ending_tries). `what` names the turn in warnings."""

        def note_message(field_chars: int | None) -> FrameworkMessage | None:
            text = note_text(field_chars) if note_text is not None else None
            if text is None:
                return None
            try:
                return self.user_message(text)
            except TurnContractError:
                # A runner defect never blocks a turn's end: the turn ends without its note.
                log.warning("flow %s turn %s: could not build the %s's note", ctx.flow_id, turn_id, what,
                            exc_info=True)
                return None

        note = note_message(None)
        first: ValueTooLarge | None = None
        cuts = (note_message(chars) for chars in (CUT_NOTE_FIELD_CHARS, *TIGHTER_NOTE_FIELD_CHARS))
        tries = ending_tries(unfinished, note, cuts, note_instead=note_instead)
        for items in tries:
            # append_messages checks every size before it writes anything, so a refused try leaves nothing.
            try:
                state = self.append_messages(ctx, state, turn_id, items)
            except ValueTooLarge as exc:
                first = first or exc
                continue
            if first is not None:
                log.warning("flow %s: %s; the %s stores %d of its messages instead: %s", ctx.flow_id, first, what,
                            len(items), ", ".join(m.role.value for m in items) or "none")
            break
        return state

    def tool_step_movement(self, flow_id: str, record: AgentToolCall) -> Movement | AgentToolCall:
        """The movement into an approved call's tool Step, with the runner's own options for the call
        (ToolCallStepOptionsProvider); or, when those cannot be had, the call's record made final
        `failed` without running, for the caller to finish; a warning names `flow_id`, the session."""
        step = tool_step_for(record.effect)
        moved = tool_call_load(record.tool_call_id)
        provide = getattr(self.runner, "tool_call_step_options", None)
        if not callable(provide):
            return Movement(step, record.tool_call_id, moved)
        # A runner bug fails only this call, before it runs; the turn and the session go on.
        try:
            chosen = provide(deferred_call_of(record))
        except Exception as exc:
            log.warning("flow %s turn %s: tool_call_step_options raised for tool call %r", flow_id, record.turn_id,
                        record.tool_call_id, exc_info=True)
            detail = cut_text(f"the runner's tool_call_step_options raised {raised_text(exc)}",
                              MAX_STORED_TOOL_ERROR_CHARS)
            return finished(record, AgentToolCallStatus.FAILED, error=not_run_error(detail))
        try:
            retry, timeout = tool_step_overrides(step, chosen)
        except ValueError as exc:
            detail = cut_text(str(exc), MAX_STORED_TOOL_ERROR_CHARS)  # it may quote a huge value
            return finished(record, AgentToolCallStatus.FAILED, error=not_run_error(detail))
        return Movement(step, record.tool_call_id, dataclasses.replace(
            moved, execute_retry=retry, execute_timeout_seconds=timeout))

    def finish_rejected(self, ctx: Context, record: AgentToolCall, message: str | None) -> None:
        """Finish `record` rejected with `message`; with a short note instead when the two together
        are too large to store (arguments near the value limit), so the Step cannot fail for it."""
        try:
            self.finish_record(ctx, finished(record, AgentToolCallStatus.REJECTED, rejection_message=message))
        except ValueTooLargeError:
            self.finish_record(ctx, finished(record, AgentToolCallStatus.REJECTED,
                                             rejection_message=REJECTION_MESSAGE_NOT_STORED))

    def store_cancelled_record(self, ctx: Context, record: AgentToolCall) -> None:
        """Store a record that steering or cancel_turn changed: finish_record for a final one, else
        set it (a started task handed to CancelToolTask). When the change makes it too large to
        store, the first of smaller_records that fits: a Step that failed for it would fail on every
        retry, and the cancelled turn would never end."""
        def store(stored: AgentToolCall) -> None:
            if stored.status.is_final:
                self.finish_record(ctx, stored)
            else:
                ctx.set(AGENT_TOOL_CALLS[stored.tool_call_id], stored)

        try:
            store(record)
            return
        except ValueTooLargeError as exc:
            first = exc
        for smaller in smaller_records(record):
            try:
                store(smaller)  # a set that fails writes nothing
            except ValueTooLargeError:
                continue
            log.warning("flow %s: %s; tool call %r is stored with its arguments cut instead", ctx.flow_id, first,
                        record.tool_call_id)
            return
        raise first

    def finish_record(self, ctx: Context, record: AgentToolCall) -> None:
        """Store a final record, publish its one ToolCallCompleted, and write tool_call_finished."""
        record = storable_outcome(record)
        ctx.set(AGENT_TOOL_CALLS[record.tool_call_id], record)
        ctx.publish(TOOL_CALL_RESULTS, ToolCallCompleted(record.tool_call_id))
        self.emit(ctx, AgentEventType.TOOL_CALL_FINISHED, record.turn_id, {
            "tool_call_id": record.tool_call_id, "tool_name": record.tool_name, "status": record.status.value,
        })


def window_messages(ctx: Context | RpcContext) -> list[AgentMessage]:
    """Every AgentMessages instance (the window), in sequence order."""
    return list(ctx.items(AGENT_MESSAGES).values())


def chunk_reader(ctx: Context | RpcContext) -> Callable[[AgentMessageChunkRange], AgentMessageChunk | None]:
    """Reads the AgentMessageChunks instance of a range AgentMessageIndex lists."""

    def read(chunk_range: AgentMessageChunkRange) -> AgentMessageChunk | None:
        return ctx.get(AGENT_MESSAGE_CHUNKS[message_sequence_key(chunk_range.first_sequence)])

    return read


def every_chunk_reader(ctx: Context | RpcContext) -> Callable[[AgentMessageChunkRange], AgentMessageChunk | None]:
    """chunk_reader for a caller that reads every loaded chunk (a model call's view): they are read
    in one call up front, each then looked up; a chunk not among them is read as chunk_reader reads it."""
    try:
        loaded = ctx.items(AGENT_MESSAGE_CHUNKS)
    except NotLoadedError:
        loaded = {}
    one = chunk_reader(ctx)

    def read(chunk_range: AgentMessageChunkRange) -> AgentMessageChunk | None:
        chunk = loaded.get(message_sequence_key(chunk_range.first_sequence))
        return chunk if chunk is not None else one(chunk_range)

    return read


async def resolved(value: Any) -> Any:
    """A runner method's result, awaited when it is awaitable. The contract's methods are async, but
    a plain def has already done its work when it returns (a model call, a write that may not run
    twice): its result is used rather than the Step failing after it and running it again."""
    return await value if inspect.isawaitable(value) else value


def background_heartbeats(
    ctx: Context, interval_seconds: float = TOOL_HEARTBEAT_INTERVAL.total_seconds()
) -> contextlib.AbstractAsyncContextManager[None]:
    """Heartbeat every `interval_seconds` while the body runs (each repeats the saved checkpoint)."""
    return _Heartbeats(ctx, interval_seconds)


class _Heartbeats:
    """A timer while the body runs, and a task only for a heartbeat that is due.

    Most model calls and tools end long before the first heartbeat, so entering and leaving costs a
    timer, not a task that starts, sleeps and is cancelled. A heartbeat runs in the handler's context
    (the timer's callback copies it), the next timer starts when it ends, and one in flight when the
    body ends is cancelled and awaited.
    """

    def __init__(self, ctx: Context, interval_seconds: float) -> None:
        self._ctx = ctx
        self._interval = interval_seconds
        self._loop = asyncio.get_running_loop()
        self._timer: asyncio.TimerHandle | None = None
        self._beat: asyncio.Task[None] | None = None

    async def __aenter__(self) -> None:
        self._timer = self._loop.call_later(self._interval, self._due)

    async def __aexit__(self, *_: object) -> None:
        if self._timer is not None:
            self._timer.cancel()
        beat = self._beat
        if beat is not None and not beat.done():
            beat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beat

    def _due(self) -> None:
        self._beat = self._loop.create_task(self._heartbeat())

    async def _heartbeat(self) -> None:
        ctx = self._ctx
        try:
            await ctx.heartbeat()
        except Exception:
            # A lost task is revoked by the worker; a transient error is retried next interval.
            log.debug("flow %s %s: background heartbeat failed", ctx.flow_id, ctx.step_execution_id, exc_info=True)
        self._timer = self._loop.call_later(self._interval, self._due)
