"""Compaction and retention (seed 002 "Rules", "Message storage"; seed 003 "Compaction"): pure logic.

`CompactionPolicy` says when RunModel compacts; `ContextCompactionRunner` is the runner capability it
needs. The rest decides without an engine: which messages a compacted model input holds, which chunks
a movement loads, which chunks retention deletes, and the shared cutoff and prompt helpers that
framework adapters use (`estimate_stored_input_tokens`, `select_turn_boundary_cutoff`,
`build_context_summary_prompt`). The Steps that apply them are in _compaction_steps.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeGuard, runtime_checkable

from ._constants import (
    CONTEXT_SUMMARY_INSTRUCTIONS,
    CONTEXT_SUMMARY_NOTE_HEADER,
    CONTEXT_SUMMARY_TRANSCRIPT_HEADER,
    DEFAULT_COMPACTION_RETAINED_RATIO,
    DEFAULT_COMPACTION_TRIGGER_RATIO,
    MAX_CONTEXT_WINDOW_TOKENS,
)
from ._message_store import ChunkReader, checked_chunk, chunk_holding, empty_index
from ._policy import shown
from ._wire import (
    AgentMessage,
    AgentMessageChunkRange,
    AgentMessageIndex,
    AgentUsage,
    ContextSummary,
    JsonObject,
    MessageRole,
)

if TYPE_CHECKING:
    from ._events import AgentEventWriter
    from ._runner import AgentTurnContext, HeartbeatFn, ModelCallMetadata

# Three UTF-8 bytes per token errs high for English text: a safe-side estimate needs no tokenizer.
BYTES_PER_TOKEN = 3


def estimate_text_tokens(text: str) -> int:
    """Tokens of `text` at three UTF-8 bytes per token, rounded up."""
    try:
        size = len(text.encode())
    except AttributeError:  # caught, not checked first: it runs for every message of every model call
        # A runner's estimate given a message's text unchecked (None for a tool call) failed RunModel
        # with "'NoneType' object has no attribute 'encode'".
        raise TypeError(f"estimate_text_tokens takes a str, got {type(text).__name__}: {shown(text)}; for a "
                        "message whose text may be None, pass message.text or ''") from None
    return (size + BYTES_PER_TOKEN - 1) // BYTES_PER_TOKEN


# The policy -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CompactionPolicy:
    """When RunModel compacts: at `trigger_ratio` of `context_window_tokens`, keeping `retained_ratio`.

    `reserved_input_tokens` is added to the runner's estimate for input it cannot see, such as a
    framework's own system prompt.
    """

    context_window_tokens: int
    trigger_ratio: float = DEFAULT_COMPACTION_TRIGGER_RATIO
    retained_ratio: float = DEFAULT_COMPACTION_RETAINED_RATIO
    reserved_input_tokens: int = 0

    def __post_init__(self) -> None:
        problems: list[str] = []
        window: object = self.context_window_tokens
        if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= MAX_CONTEXT_WINDOW_TOKENS:
            problems.append(f"context_window_tokens must be a whole number from 1 to {MAX_CONTEXT_WINDOW_TOKENS}, "
                            f"got {shown(window, None)}")
        trigger: object = self.trigger_ratio
        trigger_ok = _is_ratio(trigger) and 0 < trigger <= 1
        if not trigger_ok:
            problems.append(f"trigger_ratio must be a number above 0 and at most 1, got {shown(trigger, None)}")
        retained: object = self.retained_ratio
        if not (_is_ratio(retained) and 0 <= retained < 1):
            problems.append(f"retained_ratio must be a number from 0 to below 1, got {shown(retained, None)}")
        elif _is_ratio(trigger) and trigger_ok and retained >= trigger:
            # Keeping as much as triggers compaction would compact again at once.
            problems.append(f"retained_ratio ({retained!r}) must be below trigger_ratio ({trigger!r})")
        reserved: object = self.reserved_input_tokens
        if isinstance(reserved, bool) or not isinstance(reserved, int) or reserved < 0:
            problems.append(f"reserved_input_tokens must be a whole number >= 0, got {shown(reserved, None)}")
        elif not problems and reserved and self.retained_token_budget + reserved >= self.trigger_tokens:
            # The reserved tokens count in every estimate: with what compaction keeps, they would
            # reach the trigger again at once, and the session would summarize nearly every turn.
            problems.append(
                f"reserved_input_tokens ({reserved}) and the retained budget ({self.retained_token_budget} tokens, "
                f"retained_ratio {self.retained_ratio!r} of {self.context_window_tokens}) reach the trigger "
                f"({self.trigger_tokens} tokens) together; lower reserved_input_tokens or retained_ratio")
        if problems:
            raise ValueError("invalid CompactionPolicy: " + "; ".join(problems))

    @property
    def trigger_tokens(self) -> int:
        """The input size, reserved tokens included, at which RunModel compacts."""
        return max(1, math.ceil(self.context_window_tokens * self.trigger_ratio))

    @property
    def retained_token_budget(self) -> int:
        """What select_compaction_cutoff may keep unsummarized."""
        return math.floor(self.context_window_tokens * self.retained_ratio)

    def should_compact(self, estimated_input_tokens: int) -> bool:
        return estimated_input_tokens + self.reserved_input_tokens >= self.trigger_tokens


def _is_ratio(value: object) -> TypeGuard[float]:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int past a float's range
        return False


# The runner capability ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ContextSummaryRequest:
    """One CompactContext attempt's summary call: fold `messages` into `previous_summary`.

    `messages` are the stored messages after the previous summary through `through_sequence`;
    `input_token_budget` is the policy's context_window_tokens.
    """

    flow_id: str
    turn_id: str
    attempt: int
    previous_summary: ContextSummary | None
    messages: Sequence[AgentMessage]
    through_sequence: int
    events: AgentEventWriter
    heartbeat: HeartbeatFn
    input_token_budget: int
    session_settings: JsonObject = field(default_factory=dict)


@dataclass(frozen=True)
class ContextSummaryResult:
    """The summary text (never blank), the call's usage, and optional span metadata."""

    text: str
    usage: AgentUsage = field(default_factory=AgentUsage)
    model_call_metadata: ModelCallMetadata | None = None


@runtime_checkable
class ContextCompactionRunner(Protocol):
    """The capability AgentSessionOptions.compaction needs. Every method may run again after a crash."""

    def estimate_input_tokens(self, turn: AgentTurnContext) -> int:
        """The next model input's size in tokens, as run_model_step would build it."""
        ...

    def select_compaction_cutoff(self, turn: AgentTurnContext, retained_token_budget: int) -> int | None:
        """The last sequence to summarize (never separating a tool call from its result), or None."""
        ...

    async def summarize_context(self, request: ContextSummaryRequest) -> ContextSummaryResult:
        """One model call that writes the summary."""
        ...


COMPACTION_RUNNER_METHODS = ("estimate_input_tokens", "select_compaction_cutoff", "summarize_context")


def is_compaction_runner(runner: object) -> bool:
    return all(callable(getattr(runner, name, None)) for name in COMPACTION_RUNNER_METHODS)


# Reading a compacted conversation -------------------------------------------------------------------


def summarized_through(summary: ContextSummary | None) -> int:
    """The last summarized sequence, 0 without a summary."""
    return 0 if summary is None else summary.last_sequence


def messages_between(
    index: AgentMessageIndex | None,
    window: Sequence[AgentMessage],
    read_chunk: ChunkReader,
    *,
    after: int,
    through: int | None = None,
) -> list[AgentMessage]:
    """Stored messages with after < sequence <= through (through None: to the newest), oldest first.

    Reads only the chunks `chunks_between` lists, so a Step that loads just those can call it.
    """
    current = index or empty_index()

    def wanted(sequence: int) -> bool:
        return sequence > after and (through is None or sequence <= through)

    picked: list[AgentMessage] = []
    for chunk_range in chunks_between(current, after=after, through=through):
        picked.extend(m for m in checked_chunk(chunk_range, read_chunk(chunk_range)) if wanted(m.sequence))
    picked.extend(
        m for m in window
        if m.sequence >= current.window_first_sequence and wanted(m.sequence)
        and chunk_holding(current, m.sequence) is None
    )
    picked.sort(key=lambda m: m.sequence)
    return picked


def chunks_between(index: AgentMessageIndex | None, *, after: int, through: int | None = None,
                   ) -> list[AgentMessageChunkRange]:
    """The chunk ranges holding any sequence in (after, through]: what a movement lists to load."""
    if index is None or (through is not None and through <= after):
        return []
    return [r for r in index.chunks if r.last_sequence > after and (through is None or r.first_sequence <= through)]


# Retention --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RetentionPlan:
    """The chunks retention deletes in one commit, and the index after (None: nothing to delete)."""

    deleted: tuple[AgentMessageChunkRange, ...] = ()
    index: AgentMessageIndex | None = None


def plan_retention(
    index: AgentMessageIndex | None, summary: ContextSummary | None, retained_message_limit: int | None,
    newest_sequence: int,
) -> RetentionPlan:
    """Delete the oldest chunk while its last sequence is at or before the summary's and at least
    `retained_message_limit` messages are stored after it; then first_sequence is the next one.

    Only a chunk that starts at first_sequence is the oldest stored message's: retention never
    leaves a gap, and never deletes a window message (those move into chunks first).
    """
    if index is None or summary is None or retained_message_limit is None:
        return RetentionPlan()
    chunks = list(index.chunks)
    first = index.first_sequence
    deleted: list[AgentMessageChunkRange] = []
    while chunks:
        oldest = chunks[0]
        if oldest.first_sequence != first or oldest.last_sequence > summary.last_sequence:
            break
        if newest_sequence - oldest.last_sequence < retained_message_limit:
            break
        deleted.append(chunks.pop(0))
        first = oldest.last_sequence + 1
    if not deleted:
        return RetentionPlan()
    return RetentionPlan(tuple(deleted), AgentMessageIndex(
        chunks=chunks, first_sequence=first, window_first_sequence=max(index.window_first_sequence, first),
    ))


# Cutoffs -----------------------------------------------------------------------------------------------


def choose_cutoff(
    messages: Sequence[AgentMessage], tokens: Sequence[int], valid: Sequence[bool], retained_token_budget: int,
) -> int | None:
    """The last sequence to summarize, given each message's tokens and whether a cut after it is valid.

    Keeps as much as fits the budget: the earliest valid cut whose remaining messages fit it. When no
    valid cut leaves few enough, the latest valid cut, so the input still shrinks as far as it can.
    None when everything fits already or no cut is valid, so a compacted input never compacts again.
    """
    if sum(tokens) <= retained_token_budget:
        return None
    kept = 0
    fits_from = len(messages)  # smallest k with sum(tokens[k:]) <= budget
    for position in range(len(messages) - 1, -1, -1):
        kept += tokens[position]
        if kept > retained_token_budget:
            break
        fits_from = position
    cuts = [i for i in range(len(messages) - 1) if valid[i]]
    if not cuts:
        return None
    fitting = [i for i in cuts if i + 1 >= fits_from]
    chosen = fitting[0] if fitting else cuts[-1]
    return messages[chosen].sequence


def context_summary_note(summary: ContextSummary) -> str:
    """The user text a compacted model input starts with."""
    return f"{CONTEXT_SUMMARY_NOTE_HEADER}\n{summary.text}"


def build_context_summary_omission_note(omitted_count: int) -> str:
    """Says how many of the oldest messages a summary request left out to fit its budget."""
    if omitted_count == 1:
        return "[Dex] 1 earlier message did not fit in this request and is left out."
    return f"[Dex] {omitted_count} earlier messages did not fit in this request and are left out."


# Helpers for framework adapters ----------------------------------------------------------------------


def estimate_stored_input_tokens(turn: AgentTurnContext, fixed_input_tokens: int = 0) -> int:
    """The shared estimate: each stored framework_item and the summary note, plus `fixed_input_tokens`
    (instructions, tool definitions) the adapter adds itself."""
    total = fixed_input_tokens
    if turn.context_summary is not None:
        total += estimate_text_tokens(context_summary_note(turn.context_summary))
    return total + sum(estimate_text_tokens(m.framework_item) for m in turn.messages)


def select_turn_boundary_cutoff(turn: AgentTurnContext, retained_token_budget: int) -> int | None:
    """Cut only between turns, never inside the running turn; None while a turn resumes from run state.

    A framework keeps its own state of a resumed call, so only whole earlier turns can be summarized.
    """
    if turn.framework_run_state is not None:
        return None
    messages = list(turn.messages)
    valid = [
        messages[i].turn_id != turn.turn_id and messages[i + 1].turn_id != messages[i].turn_id
        for i in range(len(messages) - 1)
    ]
    tokens = [estimate_text_tokens(m.framework_item) for m in messages]
    return choose_cutoff(messages, tokens, valid, retained_token_budget)


def transcript_line(message: AgentMessage) -> str:
    """One message of a plain-text summary transcript."""
    if message.role is MessageRole.TOOL:
        output = message.tool_output if message.tool_output is not None else message.framework_item
        return f"tool result of {message.tool_name or 'a tool'} ({message.tool_call_id or ''}): {output}"
    if message.role is MessageRole.ASSISTANT and message.tool_call_id is not None and message.text is None:
        return (f"assistant called {message.tool_name or 'a tool'} ({message.tool_call_id}) "
                f"with {message.tool_arguments or '{}'}")
    text = message.text if message.text is not None else message.framework_item
    return f"{message.role.value}: {text}"


def build_context_summary_prompt(request: ContextSummaryRequest) -> str:
    """The range as one plain-text prompt starting with CONTEXT_SUMMARY_TRANSCRIPT_HEADER that fits
    `input_token_budget`: the fewest oldest messages are left out, with the omission note, when it would
    not. Sizes add up exactly: the estimate is the UTF-8 length, so no prompt is built twice."""
    head = [CONTEXT_SUMMARY_TRANSCRIPT_HEADER, CONTEXT_SUMMARY_INSTRUCTIONS, ""]
    if request.previous_summary is not None:
        head += [context_summary_note(request.previous_summary), ""]
    lines = [transcript_line(m) for m in request.messages]
    line_bytes = [len(line.encode()) + 1 for line in lines]  # each line and the newline before it
    budget_bytes = request.input_token_budget * BYTES_PER_TOKEN
    total = len("\n".join(head).encode()) + sum(line_bytes)

    def note_bytes(omitted: int) -> int:
        return len(build_context_summary_omission_note(omitted).encode()) + 2 if omitted else 0  # + blank line

    omitted = 0
    while omitted < len(lines) and total + note_bytes(omitted) > budget_bytes:
        total -= line_bytes[omitted]
        omitted += 1
    body = lines[omitted:]
    if omitted:
        body = [build_context_summary_omission_note(omitted), "", *body]
    return "\n".join(head + body)
