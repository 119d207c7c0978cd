"""Message storage layout (seed 002 "Message storage"): pure decisions, no engine calls.

The conversation is a window of AgentMessages instances (one per message) plus immutable
AgentMessageChunks instances listed in AgentMessageIndex. `plan_append` decides what a Step that
stores messages writes and deletes; the readers (`iter_newest_first`, `newest_messages`,
`all_messages`) say where a sequence is stored. _runtime.py and _rpcs.py apply them to a Context or
RpcContext.

Retention (deleting the oldest summarized chunks after compaction) is planned in _compaction.py
(`plan_retention`); without compaction no chunk is ever deleted and AgentMessageIndex.first_sequence
stays 1.
"""

from __future__ import annotations

import bisect
import heapq
import operator
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import msgspec

from dex_engine import MAX_VALUE_BYTES

from ._constants import MESSAGE_ROLLOVER_MAX_BYTES_PER_COMMIT, MESSAGE_ROLLOVER_MAX_CHUNKS_PER_COMMIT
from ._wire import AgentMessage, AgentMessageChunk, AgentMessageChunkRange, AgentMessageIndex, MessageRole

# len(b'{"messages":[]}'): the encoded AgentMessageChunk around its messages.
CHUNK_ENVELOPE_BYTES = len(msgspec.json.encode(AgentMessageChunk(messages=())))

_encoder = msgspec.json.Encoder()
# A key function in C: every append sorts the whole window by it.
_sequence_of = operator.attrgetter("sequence")


class MessageStoreCorruptError(RuntimeError):
    """The stored layout contradicts AgentMessageIndex (a listed chunk is missing or holds other sequences)."""


@dataclass(frozen=True)
class MessageLayoutLimits:
    """The sizes the layout obeys: AgentSessionOptions' three message options and the per-commit caps."""

    window_size: int
    chunk_size: int
    chunk_max_bytes: int
    max_chunks_per_commit: int = MESSAGE_ROLLOVER_MAX_CHUNKS_PER_COMMIT
    max_bytes_per_commit: int = MESSAGE_ROLLOVER_MAX_BYTES_PER_COMMIT


def message_bytes(message: AgentMessage) -> int:
    """The UTF-8 length of the message's JSON, as the engine encodes it (inside a chunk or alone)."""
    return len(_encoder.encode(message))


def chunk_bytes(message_sizes: Sequence[int]) -> int:
    """Encoded size of a chunk of messages of these sizes: the envelope, each message, a comma between."""
    return CHUNK_ENVELOPE_BYTES + sum(message_sizes) + max(0, len(message_sizes) - 1)


def is_oversized(size: int, limits: MessageLayoutLimits) -> bool:
    """A message whose single-message chunk exceeds chunk_max_bytes skips the window."""
    return CHUNK_ENVELOPE_BYTES + size > limits.chunk_max_bytes  # chunk_bytes([size]), asked of every message


def empty_index() -> AgentMessageIndex:
    """What a session without AgentMessageIndex means: every message in AgentMessages from sequence 1."""
    return AgentMessageIndex(chunks=[], first_sequence=1, window_first_sequence=1)


@dataclass(frozen=True)
class MessageWrites:
    """What one Step writes: new window instances, window deletes, new chunks, and the index (None: unchanged)."""

    window_sets: tuple[AgentMessage, ...] = ()
    window_deletes: tuple[int, ...] = ()
    chunk_sets: tuple[AgentMessageChunk, ...] = ()  # each keyed by its first message's sequence
    index: AgentMessageIndex | None = None


def plan_append(
    window: Sequence[AgentMessage],
    index: AgentMessageIndex | None,
    new: Sequence[AgentMessage],
    limits: MessageLayoutLimits,
    *,
    sizes: Mapping[int, int] | None = None,
) -> MessageWrites:
    """The writes of a Step that stores `new` after the stored messages.

    `window` is every AgentMessages instance (the whole window, sequence order), `index` the stored
    AgentMessageIndex or None, `sizes` optional known message_bytes by sequence. An oversized message
    goes straight into its own chunk; then, when the window holds more than window_size messages, the
    oldest move into chunks (rollover). An append with no messages writes nothing.
    """
    if not new:
        return MessageWrites()
    known = dict(sizes or {})

    def size_of(message: AgentMessage) -> int:
        size = known.get(message.sequence)
        if size is None:
            size = known[message.sequence] = message_bytes(message)
        return size

    stored = sorted(window, key=_sequence_of)
    current = index or empty_index()
    newest = max(stored[-1].sequence if stored else 0, max((r.last_sequence for r in current.chunks), default=0))
    for message in new:
        if message.sequence <= newest:
            raise ValueError(f"message {message.sequence} is not after the newest stored message {newest}")
        newest = message.sequence

    chunks = list(current.chunks)
    written: list[AgentMessageChunk] = []
    placed: list[AgentMessage] = []
    for message in new:
        if is_oversized(size_of(message), limits):
            written.append(AgentMessageChunk(messages=(message,)))
            chunks.append(AgentMessageChunkRange(message.sequence, message.sequence))
        else:
            placed.append(message)

    if len(stored) + len(placed) <= limits.window_size and not written:
        return MessageWrites(window_sets=tuple(placed))  # most appends: within the window, no chunk
    moved = _rollover(stored + placed, limits, size_of)
    if (moved or written) and not _index_fits(current, chunks, moved):
        # AgentMessageIndex is one engine value, one range per chunk: with no room left for a range,
        # a chunk written now would fail this commit, its retries, and every later one that stores a
        # message, so the session could never run a turn again. What finds no room stays in the
        # window instead (readers take a message from there when no chunk holds it), which then
        # grows past window_size; retention's deletes make room again.
        if not _index_fits(current, chunks, []):
            moved = []  # a full index (every append once it is): no rollover chunk fits
        while moved and not _index_fits(current, chunks, moved):
            moved.pop()
        while written and not _index_fits(current, chunks, moved):
            kept = written.pop().messages[0]
            chunks.pop()
            in_window = {m.sequence for m in placed} | {kept.sequence}
            placed = [m for m in new if m.sequence in in_window]
    written.extend(moved)
    moved_sequences = {m.sequence for c in moved for m in c.messages}
    # Only a rollover deletes window instances: most appends need no set of the stored sequences.
    old_sequences = set(map(_sequence_of, stored)) if moved_sequences else set()
    new_index = _planned_index(current, chunks, moved) if written else None
    return MessageWrites(
        window_sets=tuple(m for m in placed if m.sequence not in moved_sequences),
        window_deletes=tuple(s for s in sorted(moved_sequences) if s in old_sequences),
        chunk_sets=tuple(written),
        index=new_index,
    )


# An upper bound of one AgentMessageChunkRange's JSON in the index, and a comma: two sequences of at
# most 12 digits (message_sequence_key's limit).
_RANGE_BYTES_BOUND = len(b'{"first_sequence":,"last_sequence":},') + 2 * 12


def _planned_index(
    current: AgentMessageIndex, chunks: Sequence[AgentMessageChunkRange], moved: Sequence[AgentMessageChunk],
) -> AgentMessageIndex:
    """The index after an append: `chunks` (the stored ones and new oversized messages' own) and
    the `moved` rollover chunks, in order, and the window after the last moved one."""
    ranges = sorted([*chunks, *(AgentMessageChunkRange(c.messages[0].sequence, c.messages[-1].sequence)
                                for c in moved)], key=lambda r: r.first_sequence)
    window_first = current.window_first_sequence
    if moved:
        window_first = _step_over_chunks(moved[-1].messages[-1].sequence + 1, ranges)
    return AgentMessageIndex(chunks=ranges, first_sequence=current.first_sequence, window_first_sequence=window_first)


def _index_fits(
    current: AgentMessageIndex, chunks: Sequence[AgentMessageChunkRange], moved: Sequence[AgentMessageChunk],
) -> bool:
    """Whether _planned_index fits the engine's value limit: encoded only when the bound says it may
    not, so an ordinary session's rollover never encodes it."""
    # 200: room for the rest of the index, {"chunks":[],"first_sequence":..,"window_first_sequence":..}.
    if (len(chunks) + len(moved)) * _RANGE_BYTES_BOUND + 200 <= MAX_VALUE_BYTES:
        return True
    return len(_encoder.encode(_planned_index(current, chunks, moved))) <= MAX_VALUE_BYTES


def _rollover(
    window: list[AgentMessage], limits: MessageLayoutLimits, size_of: Callable[[AgentMessage], int]
) -> list[AgentMessageChunk]:
    """The oldest window messages moved into chunks this commit, oldest chunk first.

    A chunk closes at chunk_size messages, before a message that would take it past chunk_max_bytes,
    and at a gap in the sequences (an oversized message's chunk sits there: rollover steps over it).
    One commit moves at most max_chunks_per_commit chunks and max_bytes_per_commit bytes, unless the
    first chunk alone is larger. Rollover stops at a message no chunk can hold (see below): it and
    every later message stay in the window.
    """
    moved: list[AgentMessageChunk] = []
    moved_bytes = 0
    position = 0
    while len(window) - position > limits.window_size and len(moved) < limits.max_chunks_per_commit:
        end = position + 1
        size = chunk_bytes([size_of(window[position])])
        if size > MAX_VALUE_BYTES:
            # Only a 0.1.0 window message can be here: stored alone it fit the engine's value limit,
            # but its chunk is CHUNK_ENVELOPE_BYTES larger. Moving it would fail every commit that
            # stores a message, so no turn of the session could run again; left in the window (as
            # 0.1.0 kept it), the session goes on, only its window is no longer bounded.
            break
        while end < len(window) and end - position < limits.chunk_size:
            following = window[end]
            if following.sequence != window[end - 1].sequence + 1:
                break
            grown = size + 1 + size_of(following)
            if grown > limits.chunk_max_bytes:
                break
            size = grown
            end += 1
        if moved and moved_bytes + size > limits.max_bytes_per_commit:
            break
        moved.append(AgentMessageChunk(messages=tuple(window[position:end])))
        moved_bytes += size
        position = end
    return moved


def _step_over_chunks(sequence: int, chunks: Sequence[AgentMessageChunkRange]) -> int:
    """The first sequence from `sequence` on that no chunk holds (chunks sorted by first sequence)."""
    for chunk in chunks:
        if chunk.first_sequence == sequence:
            sequence = chunk.last_sequence + 1
    return sequence


# Reads ---------------------------------------------------------------------------------------------


def chunk_holding(index: AgentMessageIndex | None, sequence: int) -> AgentMessageChunkRange | None:
    """The chunk range that holds `sequence`, or None when the sequence is not in a chunk."""
    if index is None or not index.chunks:
        return None
    return _holding(index.chunks, [r.first_sequence for r in index.chunks], sequence)


def _holding(
    chunks: Sequence[AgentMessageChunkRange], firsts: Sequence[int], sequence: int
) -> AgentMessageChunkRange | None:
    at = bisect.bisect_right(firsts, sequence) - 1
    if at >= 0 and chunks[at].first_sequence <= sequence <= chunks[at].last_sequence:
        return chunks[at]
    return None


def checked_chunk(chunk_range: AgentMessageChunkRange, chunk: AgentMessageChunk | None) -> Sequence[AgentMessage]:
    """The chunk's messages (read only: not a copy), after checking it holds exactly the range
    AgentMessageIndex lists."""
    first, last = chunk_range.first_sequence, chunk_range.last_sequence
    if chunk is None:
        raise MessageStoreCorruptError(
            f"AgentMessageChunks[{first:012d}] is missing, but AgentMessageIndex lists {first}..{last}"
        )
    messages = chunk.messages
    # Every model call checks every chunk: the sequences are compared in C, not in a Python loop.
    if len(messages) != last - first + 1 or list(map(_sequence_of, messages)) != list(range(first, last + 1)):
        held = [m.sequence for m in messages]
        shown = f"{held[0]}..{held[-1]} ({len(held)} messages)" if held else "no messages"
        raise MessageStoreCorruptError(
            f"AgentMessageChunks[{first:012d}] holds {shown}, but AgentMessageIndex lists {first}..{last}"
        )
    return messages


ChunkReader = Callable[[AgentMessageChunkRange], AgentMessageChunk | None]


def iter_newest_first(
    index: AgentMessageIndex | None,
    window: Sequence[AgentMessage],
    read_chunk: ChunkReader,
    *,
    before: int | None = None,
) -> Iterator[AgentMessage]:
    """Every stored message before `before` (all when None), newest first; chunks are read only when reached.

    A sequence in a chunk range is in that chunk; any other from window_first_sequence on is in
    AgentMessages (window instances elsewhere are ignored).
    """
    for segment in _segments_newest_first(index, window, before):
        if isinstance(segment, AgentMessage):
            yield segment
            continue
        for message in reversed(checked_chunk(segment, read_chunk(segment))):
            if before is None or message.sequence < before:
                yield message


def _segments_newest_first(
    index: AgentMessageIndex | None, window: Sequence[AgentMessage], before: int | None,
) -> Iterator[AgentMessageChunkRange | AgentMessage]:
    """Where the stored messages before `before` are, newest first: chunk ranges and window messages
    (a chunk listed when its first sequence is before `before`).

    Chunks listed in order (as Steps write the index) are taken lazily from the newest before
    `before`, so a page touches the chunks it reaches rather than every range of a long session's
    index in Python; only the C-level passes below see them all.
    """
    current = index or empty_index()
    chunks = current.chunks
    firsts = list(map(_first_sequence_of, chunks))
    # Window messages are mostly newer than every chunk: only older ones need the chunk look-up.
    newest_in_chunks = max(map(_last_sequence_of, chunks), default=0)
    window_first = current.window_first_sequence
    in_window = [
        m for m in window
        if m.sequence >= window_first and (before is None or m.sequence < before)
        and (m.sequence > newest_in_chunks or _holding(chunks, firsts, m.sequence) is None)
    ]
    in_window.sort(key=_sequence_of, reverse=True)  # stable: repeated sequences keep the window's order
    if all(map(operator.lt, firsts, firsts[1:])):
        # No window message starts where a chunk does (the chunk holds that sequence), so merging
        # orders them as sorting every segment by its start would.
        end = len(chunks) if before is None else bisect.bisect_left(firsts, before)
        newer_chunks = (chunks[at] for at in range(end - 1, -1, -1))
        return heapq.merge(newer_chunks, in_window, key=_segment_start, reverse=True)
    segments: list[AgentMessageChunkRange | AgentMessage] = [
        r for r in chunks if before is None or r.first_sequence < before]
    segments.extend(in_window)
    segments.sort(key=_segment_start, reverse=True)  # stable: equal starts keep the index's order
    return iter(segments)


_first_sequence_of = operator.attrgetter("first_sequence")
_last_sequence_of = operator.attrgetter("last_sequence")


def _segment_start(segment: AgentMessageChunkRange | AgentMessage) -> int:
    return segment.first_sequence if isinstance(segment, AgentMessageChunkRange) else segment.sequence


def chunks_of_newest(
    index: AgentMessageIndex | None, window: Sequence[AgentMessage], *, before: int | None = None, limit: int,
) -> list[AgentMessageChunkRange]:
    """The chunk ranges `newest_messages(..., before=before, limit=limit)` reads: what an RPC that
    returns a page loads, rather than every chunk of the session. A range is counted at its length,
    which checked_chunk holds every chunk to."""
    wanted: list[AgentMessageChunkRange] = []
    count = 0
    for segment in _segments_newest_first(index, window, before):
        if count >= limit:
            break
        if isinstance(segment, AgentMessage):
            count += 1
            continue
        wanted.append(segment)
        last = segment.last_sequence if before is None else min(segment.last_sequence, before - 1)
        count += last - segment.first_sequence + 1
    return wanted


def newest_messages(
    index: AgentMessageIndex | None,
    window: Sequence[AgentMessage],
    read_chunk: ChunkReader,
    *,
    before: int | None = None,
    limit: int | None = None,
) -> list[AgentMessage]:
    """The newest `limit` stored messages before `before` (every one when limit is None), oldest first."""
    picked: list[AgentMessage] = []
    if limit is not None and limit <= 0:
        return picked
    for message in iter_newest_first(index, window, read_chunk, before=before):
        picked.append(message)
        if limit is not None and len(picked) >= limit:
            break
    picked.reverse()
    return picked


def message_chars(message: AgentMessage) -> int:
    """The characters of a message's texts: near enough what a cache that keeps it keeps alive."""
    return (len(message.framework_item) + len(message.text or "") + len(message.tool_output or "")
            + len(message.tool_arguments or ""))


def chunk_messages(chunks: Sequence[AgentMessageChunkRange], read_chunk: ChunkReader) -> list[AgentMessage]:
    """The messages of these chunks (in order, none overlapping), oldest first, in a new list. Chunks
    are read and checked newest first, so a bad chunk is reported as newest_messages reports it."""
    held = [checked_chunk(r, read_chunk(r)) for r in reversed(chunks)]
    picked: list[AgentMessage] = []
    for messages in reversed(held):
        picked.extend(messages)
    return picked


# What all_messages gets the chunks' messages from: chunk_messages, or a memo that answers as it does.
ChunkMessages = Callable[[Sequence[AgentMessageChunkRange], ChunkReader], list[AgentMessage]]


def all_messages(
    index: AgentMessageIndex | None, window: Sequence[AgentMessage], read_chunk: ChunkReader,
    read_chunks: ChunkMessages = chunk_messages,
) -> list[AgentMessage]:
    """Every stored message, oldest first: what newest_messages returns with no `before` and no `limit`.

    Each model call reads this. When the window holds consecutive sequences, in order, after every
    chunk (as Steps leave it, unless an oversized message's chunk sits among them), it is the chunks
    in order (`read_chunks`), then the window: no segments to sort. Chunks are read newest first
    either way, so a bad chunk is reported as newest_messages reports it.
    """
    current = index or empty_index()
    chunks = current.chunks
    firsts = [r.first_sequence for r in chunks]
    sequences = [m.sequence for m in window]
    if sequences:
        start = sequences[0]
        floor = max(current.window_first_sequence - 1, max((r.last_sequence for r in chunks), default=0))
        if start <= floor or sequences != list(range(start, start + len(sequences))):
            return newest_messages(index, window, read_chunk)
    if firsts != sorted(set(firsts)):
        return newest_messages(index, window, read_chunk)
    picked = read_chunks(chunks, read_chunk)
    picked.extend(window)
    return picked


def reply_start_by_scan(newest_first: Iterator[AgentMessage], turn_id: str, next_sequence: int) -> int:
    """The first sequence after the turn's user messages, scanning back from the newest message.

    For a turn without a TurnReplySequence of its own (one another Worker started): the replies are
    the newest messages of the turn up to its last user message.
    """
    count = 0
    for message in newest_first:
        if message.turn_id != turn_id or message.role is MessageRole.USER:
            break
        count += 1
    return next_sequence - count
