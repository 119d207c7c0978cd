"""The session's RPCs: each runs in one transaction, serialized with the session's Steps."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import msgspec

from dex_engine import LoadOptions, Rpc, RpcContext, rpc

from ._constants import LIST_MESSAGES_DEFAULT_LIMIT, LIST_MESSAGES_MAX_LIMIT, SNAPSHOT_MESSAGE_LIMIT
from ._message_store import ChunkReader, chunks_of_newest, newest_messages
from ._persistence import (
    AGENT_MESSAGE_CHUNKS,
    AGENT_MESSAGE_INDEX,
    AGENT_MESSAGES,
    AGENT_PLAN,
    AGENT_STATE,
    AGENT_TOOL_CALLS,
    AGENT_USAGE,
    CONTEXT_SUMMARY,
    INTERRUPT_RESOLUTIONS,
    PENDING_INTERRUPTS,
    QUEUED_USER_MESSAGES,
    SESSION_SETTINGS,
    STEERED_USER_MESSAGES,
    message_sequence_key,
)
from ._runtime import chunk_reader, now_utc, pending_interrupts, waiting_user_messages, window_messages
from ._session_settings import session_settings_error
from ._timefmt import parse_time
from ._turn_logic import storable_rejection_message, without_interrupt
from ._wire import (
    AgentInterrupt,
    AgentInterruptResolution,
    AgentMessage,
    AgentMessageIndex,
    AgentMessagesPage,
    AgentSnapshot,
    AgentUsage,
    AgentUserMessage,
    AnswerQuestionRequest,
    InterruptKind,
    ListAgentMessagesRequest,
    ResolveInterruptRequest,
    UpdateSessionSettingsRequest,
)


class SessionSettingsUpdate(msgspec.Struct, frozen=True):
    """UpdateSessionSettingsRequest as the update_session_settings RPC decodes it: the same JSON, with
    settings of any JSON type. Seed 002's RPC table answers settings that are not a JSON object with
    False, as it does null and oversized ones; declared as JsonObject, the request's decoding refused
    them with InvalidValueError before the RPC could say so."""

    session_settings: Any = None


def page_limit(limit: int) -> int:
    """list_agent_messages' limit, clamped to 1..LIST_MESSAGES_MAX_LIMIT."""
    return max(1, min(LIST_MESSAGES_MAX_LIMIT, limit))


async def load_page_chunks(
    ctx: RpcContext, index: AgentMessageIndex | None, window: list[AgentMessage], before_sequence: int | None,
    limit: int,
) -> None:
    """Load the chunks that the newest `limit` messages before `before_sequence` are in, and no
    others: loading AgentMessageChunks whole read every chunk of the session, so a page cost more
    the longer the session ran (seed 002 lists the whole map; docs/deviations.md)."""
    wanted = chunks_of_newest(index, window, before=before_sequence, limit=limit)
    if wanted:
        await ctx.load(*(AGENT_MESSAGE_CHUNKS[message_sequence_key(r.first_sequence)] for r in wanted))


def page_of_messages(
    index: AgentMessageIndex | None,
    window: list[AgentMessage],
    read_chunk: ChunkReader,
    before_sequence: int | None,
    limit: int,
) -> AgentMessagesPage:
    """One page, oldest first, ending before `before_sequence` (after the newest when None), across
    chunks and window; it reads only the chunks the page touches."""
    limit = page_limit(limit)
    first_stored = 1 if index is None else index.first_sequence
    page = newest_messages(index, window, read_chunk, before=before_sequence, limit=limit)
    at_oldest = not page or page[0].sequence <= first_stored
    return AgentMessagesPage(
        messages=page,
        next_before_sequence=None if at_oldest else page[0].sequence,
        deleted_before_sequence=first_stored if first_stored > 1 else None,
    )


def _past_deadline(interrupt: AgentInterrupt, now: datetime) -> bool:
    # Its Step records the deadline; an answer now would race it.
    return interrupt.deadline is not None and now >= parse_time(interrupt.deadline)


def resolve_refused(interrupt: AgentInterrupt | None, approved: bool, now: datetime) -> bool:
    """Whether resolve_interrupt returns False for `interrupt` (None: not pending) at `now`, changing
    nothing. The RPC and AgentSessionClient's lock-free check both ask this, so they judge alike."""
    if interrupt is None or _past_deadline(interrupt, now):
        return True
    # Questions are answered with answer_question; resolve_interrupt only declines.
    return interrupt.kind is InterruptKind.QUESTION and approved


def answer_refused(interrupt: AgentInterrupt | None, answer: str, now: datetime) -> bool:
    """Whether answer_question returns False for `interrupt` (None: not pending) and `answer` at
    `now`, changing nothing: not a question, past its deadline, a blank answer, or one not among its
    choices while it allows no free text. The RPC and AgentSessionClient's lock-free check both ask
    this, so they judge alike."""
    if interrupt is None or interrupt.kind is not InterruptKind.QUESTION or _past_deadline(interrupt, now):
        return True
    if not answer.strip():
        return True
    return not interrupt.allows_free_text and answer not in interrupt.choices


def session_rpcs(*, plan_mode_enabled: bool) -> list[Rpc]:
    """The RPCs of every agent session Flow (`plan_mode_enabled` from its AgentSessionOptions)."""

    @rpc("send_user_message", request_type=AgentUserMessage, load=LoadOptions.none())
    async def send_user_message(ctx: RpcContext, message: AgentUserMessage) -> bool:
        # Queued, not applied: the session consumes it when the running turn (if any) ends.
        if not message.text.strip() or (message.plan_mode and not plan_mode_enabled):
            return False  # blank, or a plan_mode message while plan mode is off on this Flow type
        ctx.publish(QUEUED_USER_MESSAGES, message)
        return True

    @rpc("resolve_interrupt", request_type=ResolveInterruptRequest, locks=[PENDING_INTERRUPTS],
         load=LoadOptions.only(PENDING_INTERRUPTS))
    async def resolve_interrupt(ctx: RpcContext, request: ResolveInterruptRequest) -> bool:
        pending = pending_interrupts(ctx)
        kept, interrupt = without_interrupt(pending, request.interrupt_id)
        if interrupt is None or resolve_refused(interrupt, request.approved, now_utc()):
            return False
        ctx.set(PENDING_INTERRUPTS, kept)
        ctx.publish(INTERRUPT_RESOLUTIONS[interrupt.interrupt_id], AgentInterruptResolution(
            approved=request.approved,
            rejection_message=None if request.approved else storable_rejection_message(request.rejection_message),
        ))
        return True

    @rpc("answer_question", request_type=AnswerQuestionRequest, locks=[PENDING_INTERRUPTS],
         load=LoadOptions.only(PENDING_INTERRUPTS))
    async def answer_question(ctx: RpcContext, request: AnswerQuestionRequest) -> bool:
        kept, interrupt = without_interrupt(pending_interrupts(ctx), request.interrupt_id)
        if interrupt is None or answer_refused(interrupt, request.answer, now_utc()):
            return False
        ctx.set(PENDING_INTERRUPTS, kept)
        ctx.publish(INTERRUPT_RESOLUTIONS[interrupt.interrupt_id], AgentInterruptResolution(
            approved=True, rejection_message=None, answer=request.answer,
        ))
        return True

    @rpc("get_agent_snapshot", load=LoadOptions.only(
        AGENT_STATE, AGENT_MESSAGES, AGENT_MESSAGE_INDEX, AGENT_TOOL_CALLS,
        PENDING_INTERRUPTS, AGENT_USAGE, AGENT_PLAN, CONTEXT_SUMMARY, SESSION_SETTINGS,
    ))
    async def get_agent_snapshot(ctx: RpcContext, _: None = None) -> AgentSnapshot:
        state = ctx.get(AGENT_STATE)
        # The newest messages, from the window and as many chunks as they reach back into.
        index = ctx.get(AGENT_MESSAGE_INDEX)
        window = window_messages(ctx)
        await load_page_chunks(ctx, index, window, None, SNAPSHOT_MESSAGE_LIMIT)
        messages = newest_messages(index, window, chunk_reader(ctx), limit=SNAPSHOT_MESSAGE_LIMIT)
        # The active turn's records only: a session a too-large run state ended keeps its last
        # turn's records stored, but that turn is over.
        active_turn_id = None if state is None else state.active_turn_id
        records = [] if active_turn_id is None else [
            r for r in ctx.items(AGENT_TOOL_CALLS).values() if r.turn_id == active_turn_id]
        records.sort(key=lambda r: r.deferral_order)
        queued = waiting_user_messages(ctx, QUEUED_USER_MESSAGES)
        steered = waiting_user_messages(ctx, STEERED_USER_MESSAGES)
        return AgentSnapshot(
            state=state, messages=messages,
            pending_interrupts=pending_interrupts(ctx), tool_calls=records,
            usage=ctx.get(AGENT_USAGE) or AgentUsage(), queued_message_count=len(queued), plan=ctx.get(AGENT_PLAN),
            queued_messages=queued, steered_messages=steered, context_summary=ctx.get(CONTEXT_SUMMARY),
            session_settings=ctx.get(SESSION_SETTINGS),
        )

    @rpc("list_agent_messages", request_type=ListAgentMessagesRequest | None,
         load=LoadOptions.only(AGENT_MESSAGES, AGENT_MESSAGE_INDEX))
    async def list_agent_messages(ctx: RpcContext, request: ListAgentMessagesRequest | None) -> AgentMessagesPage:
        request = request or ListAgentMessagesRequest(limit=LIST_MESSAGES_DEFAULT_LIMIT)
        index = ctx.get(AGENT_MESSAGE_INDEX)
        window = window_messages(ctx)
        await load_page_chunks(ctx, index, window, request.before_sequence, page_limit(request.limit))
        return page_of_messages(index, window, chunk_reader(ctx), request.before_sequence, request.limit)

    @rpc("update_session_settings", request_type=SessionSettingsUpdate, load=LoadOptions.only(AGENT_STATE))
    async def update_session_settings(
        ctx: RpcContext, request: SessionSettingsUpdate | UpdateSessionSettingsRequest
    ) -> bool:
        # Replaces, never merges; {} clears. The next turn copies it; the running turn keeps its copy.
        if ctx.get(AGENT_STATE) is None:
            return False  # StartAgentSession has not committed
        settings = request.session_settings
        if settings is None or session_settings_error(settings) is not None:
            return False
        if settings:
            ctx.set(SESSION_SETTINGS, settings)
        else:
            ctx.delete(SESSION_SETTINGS)
        return True

    return [send_user_message, resolve_interrupt, answer_question, get_agent_snapshot, list_agent_messages,
            update_session_settings]
