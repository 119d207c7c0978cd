"""Message storage (seed 002 "Message storage"): the window, immutable chunks, AgentMessageIndex.

The pure layout (`_message_store.plan_append` and its readers) is checked with Hypothesis against a
reference model (the plain list of every appended message) over random appends, sizes and limits.
Real sessions on the in-process engine, with a 4-message window and 2-message chunks, check that
the RPCs, the model input and the stored index agree with what was said.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import msgspec
import pytest
from agents.tests.built_context import running_turn, runtime_of, step_context
from agents.tests.builtin_agent import InProcessEngine, lookup_order
from agents.tests.session_driver import all_agent_events
from engine.tests.conftest import pg_database, pg_databases  # noqa: F401 - the fixtures the PostgreSQL tests use
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dex_agents import (
    AGENT_MESSAGE_CHUNKS,
    AGENT_MESSAGE_INDEX,
    AGENT_MESSAGES,
    MESSAGE_ROLLOVER_MAX_BYTES_PER_COMMIT,
    MESSAGE_ROLLOVER_MAX_CHUNKS_PER_COMMIT,
    TURN_REPLY_SEQUENCE,
    TURN_SESSION_SETTINGS,
    AgentMessage,
    AgentMessageChunk,
    AgentMessageChunkRange,
    AgentMessageIndex,
    AgentSessionClient,
    AgentSessionFlow,
    AgentSessionOptions,
    AgentSnapshot,
    FrameworkMessage,
    MessageRole,
    RunModelLimit,
    TurnReplySequence,
    TurnSessionSettings,
)
from dex_agents._message_store import (
    CHUNK_ENVELOPE_BYTES,
    ChunkReader,
    MessageLayoutLimits,
    MessageStoreCorruptError,
    MessageWrites,
    all_messages,
    chunk_bytes,
    chunk_holding,
    chunk_messages,
    chunks_of_newest,
    is_oversized,
    iter_newest_first,
    message_bytes,
    newest_messages,
    plan_append,
    reply_start_by_scan,
)
from dex_agents._persistence import AGENT_STATE, message_sequence_key
from dex_agents._rpcs import page_of_messages
from dex_agents._runtime import ValueTooLarge, every_chunk_reader
from dex_agents._timefmt import utc_now_text
from dex_agents._turn_logic import to_agent_message
from dex_agents._wire import AgentState
from dex_agents.builtin_loop import (
    AgentDefinition,
    BuiltinLoopAgentRunner,
    ModelRequest,
    ScriptedModelClient,
    ScriptedModelReply,
    ScriptedToolCall,
    builtin_agent_session_options,
)
from dex_agents.builtin_loop._items import input_item
from dex_agents.testing import wait_for_agent_snapshot
from dex_engine import MAX_VALUE_BYTES, Context, LoadSpec, NotLoadedError
from dex_engine import _transitions as transitions
from dex_engine._codec import encode_value
from dex_engine._records import WriteSet

# The pure layout ------------------------------------------------------------------------------------


def message(sequence: int, text_length: int, turn_id: str = "turn-1", role: MessageRole = MessageRole.ASSISTANT,
            ) -> AgentMessage:
    return AgentMessage(
        sequence=sequence, turn_id=turn_id, role=role, text="x" * text_length, tool_call_id=None, tool_name=None,
        tool_arguments=None, tool_output=None, framework_item="{}", created_at="2025-01-01T00:00:00Z",
    )


@dataclass
class ModelStore:
    """The stored instances of one session, as a Step's writes leave them, and every appended message."""

    window: dict[int, AgentMessage] = field(default_factory=dict)
    chunks: dict[int, AgentMessageChunk] = field(default_factory=dict)
    index: AgentMessageIndex | None = None
    appended: list[AgentMessage] = field(default_factory=list)
    checked: set[int] = field(default_factory=set)  # chunks already checked (they never change)

    @property
    def next_sequence(self) -> int:
        return len(self.appended) + 1

    def read_chunk(self, chunk_range: AgentMessageChunkRange) -> AgentMessageChunk | None:
        return self.chunks.get(chunk_range.first_sequence)

    def append(self, sizes: Sequence[int], limits: MessageLayoutLimits) -> MessageWrites:
        """Plan the append of messages of these text sizes, check the writes are legal, apply them."""
        new = [message(self.next_sequence + i, size) for i, size in enumerate(sizes)]
        writes = plan_append(sorted(self.window.values(), key=lambda m: m.sequence), self.index, new, limits)
        for chunk in writes.chunk_sets:
            first = chunk.messages[0].sequence
            # Chunks are immutable: no write ever targets an existing chunk.
            assert first not in self.chunks, f"chunk {first} rewritten"
            self.chunks[first] = chunk
        for written in writes.window_sets:
            assert written.sequence not in self.window, f"window message {written.sequence} rewritten"
            self.window[written.sequence] = written
        for sequence in writes.window_deletes:
            assert sequence in self.window, f"deleting {sequence}, which is not in the window"
            del self.window[sequence]
        if writes.index is not None:
            self.index = writes.index
        self.appended.extend(new)
        return writes


def moved_chunks(writes: MessageWrites, limits: MessageLayoutLimits, new: Sequence[AgentMessage]
                 ) -> list[AgentMessageChunk]:
    """The chunks rollover wrote (every written chunk except the new oversized messages' own)."""
    oversized = {m.sequence for m in new if is_oversized(message_bytes(m), limits)}
    return [c for c in writes.chunk_sets if not (len(c.messages) == 1 and c.messages[0].sequence in oversized)]


def encoded_chunk_bytes(chunk: AgentMessageChunk) -> int:
    return len(msgspec.json.encode(chunk))


def check_layout(store: ModelStore, limits: MessageLayoutLimits) -> None:
    """Every appended message is readable exactly once, where the index says; chunks hold their ranges."""
    window = [store.window[s] for s in sorted(store.window)]  # as window_messages lists them
    assert newest_messages(store.index, window, store.read_chunk) == store.appended
    assert all_messages(store.index, window, store.read_chunk) == store.appended
    index = store.index or AgentMessageIndex(chunks=[], first_sequence=1, window_first_sequence=1)
    assert index.first_sequence == 1  # no retention: nothing is ever deleted
    ranges = index.chunks
    assert [r.first_sequence for r in ranges] == sorted(store.chunks)
    for before, after in itertools.pairwise(ranges):
        assert before.last_sequence < after.first_sequence
    for chunk_range in ranges:
        chunk = store.chunks[chunk_range.first_sequence]
        held = [m.sequence for m in chunk.messages]
        assert held == list(range(chunk_range.first_sequence, chunk_range.last_sequence + 1))
        if chunk_range.first_sequence in store.checked:
            continue
        store.checked.add(chunk_range.first_sequence)
        sizes = [message_bytes(m) for m in chunk.messages]
        assert encoded_chunk_bytes(chunk) == chunk_bytes(sizes)
        if len(held) > 1:
            assert len(held) <= limits.chunk_size
            assert chunk_bytes(sizes) <= limits.chunk_max_bytes
    # Archived chunks cover 1 .. window_first_sequence - 1 with consecutive ranges; after that, only
    # single oversized messages sit among the window's sequences.
    archived = [r for r in ranges if r.last_sequence < index.window_first_sequence]
    expected_first = 1
    for chunk_range in archived:
        assert chunk_range.first_sequence == expected_first
        expected_first = chunk_range.last_sequence + 1
    if index.window_first_sequence > 1:
        assert expected_first == index.window_first_sequence
    for chunk_range in ranges[len(archived):]:
        assert chunk_range.first_sequence == chunk_range.last_sequence >= index.window_first_sequence
        assert is_oversized(message_bytes(store.chunks[chunk_range.first_sequence].messages[0]), limits)
    # Every sequence is in exactly one place.
    for stored in store.appended:
        holder = chunk_holding(store.index, stored.sequence)
        if holder is not None:
            assert stored.sequence not in store.window
            assert stored in store.chunks[holder.first_sequence].messages
        else:
            assert stored.sequence >= index.window_first_sequence
            assert store.window[stored.sequence] == stored
    assert len(store.window) + sum(len(c.messages) for c in store.chunks.values()) == len(store.appended)


limits_strategy = st.builds(
    MessageLayoutLimits,
    window_size=st.integers(1, 6),
    chunk_size=st.integers(1, 4),
    # A bare message encodes to about 170 bytes: some limits make every message oversized.
    chunk_max_bytes=st.integers(150, 1500),
    max_chunks_per_commit=st.integers(1, 4),
    max_bytes_per_commit=st.integers(150, 3000),
)
commits_strategy = st.lists(st.lists(st.integers(0, 700), max_size=6), max_size=20)


def test_a_chunk_fills_to_exactly_its_byte_limit_and_not_one_byte_more() -> None:
    """Seed 002 "Rollover": a chunk is the 15-byte envelope, each message, and a comma between; it
    closes before a message would take it past message_chunk_max_bytes. Three messages that fill a
    chunk exactly roll over together; one byte less of room splits them. A message whose own chunk
    is exactly the limit is not oversized; one byte more is."""
    sizes = [message_bytes(message(n, 100)) for n in (1, 2, 3)]
    exact = CHUNK_ENVELOPE_BYTES + sum(sizes) + 2  # two commas
    assert encoded_chunk_bytes(AgentMessageChunk(messages=tuple(message(n, 100) for n in (1, 2, 3)))) == exact
    for room, expected in ((exact, [[1, 2, 3]]), (exact - 1, [[1, 2]])):
        limits = MessageLayoutLimits(window_size=1, chunk_size=10, chunk_max_bytes=room)
        window = [message(n, 100) for n in (1, 2, 3)]
        writes = plan_append(window, None, [message(4, 100)], limits)
        assert [[m.sequence for m in c.messages] for c in writes.chunk_sets][:1] == expected, room
        assert all(encoded_chunk_bytes(c) <= room for c in writes.chunk_sets)
    single = CHUNK_ENVELOPE_BYTES + sizes[0]
    assert not is_oversized(sizes[0], MessageLayoutLimits(window_size=1, chunk_size=1, chunk_max_bytes=single))
    assert is_oversized(sizes[0], MessageLayoutLimits(window_size=1, chunk_size=1, chunk_max_bytes=single - 1))


def test_a_commit_moves_exactly_its_byte_cap_and_not_one_byte_more() -> None:
    """Seed 002 "Rollover": one commit moves at most MESSAGE_ROLLOVER_MAX_BYTES_PER_COMMIT bytes of
    chunks. Two one-message chunks that fill the cap exactly move together; one byte less of cap
    moves only the first, and the window stays above its size until a later commit. A cap smaller
    than the first chunk still moves that chunk: every commit over the window's size makes progress."""
    window = [message(n, 100) for n in (1, 2, 3, 4)]
    exact = 2 * chunk_bytes([message_bytes(window[0])])
    for cap, expected in ((exact, [[1], [2]]), (exact - 1, [[1]]), (1, [[1]])):
        limits = MessageLayoutLimits(window_size=1, chunk_size=1, chunk_max_bytes=1024 * 1024,
                                     max_bytes_per_commit=cap)
        writes = plan_append(window, None, [message(5, 100)], limits)
        assert [[m.sequence for m in c.messages] for c in writes.chunk_sets] == expected, cap
        assert list(writes.window_deletes) == [s for chunk in expected for s in chunk]


def test_rollover_caps_are_the_seeds() -> None:
    """Seed 002 "Message storage": one commit moves at most 4 chunks and 8 MiB (public names)."""
    assert (MESSAGE_ROLLOVER_MAX_CHUNKS_PER_COMMIT, MESSAGE_ROLLOVER_MAX_BYTES_PER_COMMIT) == (4, 8 * 1024 * 1024)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(limits=limits_strategy, legacy=st.lists(st.integers(0, 700), max_size=30), commits=commits_strategy)
def test_layout_matches_the_reference_model(
    limits: MessageLayoutLimits, legacy: list[int], commits: list[list[int]]
) -> None:
    """Any sequence of appends, starting from a 0.1.0 session (every message in AgentMessages, no index):
    every message stays readable exactly once and in order, chunks are never rewritten and hold exactly
    their consecutive ranges within chunk_size and chunk_max_bytes, new oversized messages go straight into
    their own chunk, one commit moves at most the per-commit chunks and bytes (unless the first chunk alone
    is larger), and the window is within its size unless a per-commit cap stopped the rollover."""
    store = ModelStore()
    for size in legacy:  # 0.1.0: every message in AgentMessages, no AgentMessageIndex
        stored = message(store.next_sequence, size)
        store.window[stored.sequence] = stored
        store.appended.append(stored)
    check_layout(store, limits)
    for sizes in commits:
        before_index = store.index
        first = store.next_sequence
        writes = store.append(sizes, limits)
        new = store.appended[first - 1:]
        if not sizes:
            assert writes == MessageWrites()  # an append with no messages writes nothing
            continue
        # AgentMessageIndex is written exactly when a chunk is written.
        assert (writes.index is not None) == bool(writes.chunk_sets)
        if writes.index is None:
            assert store.index == before_index
        for added in new:
            if is_oversized(message_bytes(added), limits):
                assert AgentMessageChunk((added,)) in writes.chunk_sets
                assert added not in writes.window_sets
        moved = moved_chunks(writes, limits, new)
        moved_bytes = [encoded_chunk_bytes(c) for c in moved]
        assert len(moved) <= limits.max_chunks_per_commit
        if len(moved) > 1:
            assert sum(moved_bytes) <= limits.max_bytes_per_commit
        check_layout(store, limits)
        if len(store.window) > limits.window_size:
            # Only a per-commit cap leaves the window over its size, and never with nothing moved.
            assert moved
            biggest = max([limits.chunk_max_bytes] + [chunk_bytes([message_bytes(m)]) for m in store.window.values()])
            assert len(moved) == limits.max_chunks_per_commit or sum(moved_bytes) + biggest > (
                limits.max_bytes_per_commit
            )


@settings(max_examples=60, deadline=None)
@given(window_size=st.integers(1, 10), chunk_size=st.integers(1, 5), legacy=st.integers(0, 120))
def test_an_old_window_drains_a_few_chunks_a_commit(window_size: int, chunk_size: int, legacy: int) -> None:
    """A 0.1.0 session's large window leaves over several commits of one message each, at most
    MESSAGE_ROLLOVER_MAX_CHUNKS_PER_COMMIT chunks a commit, shrinking each time until within its size."""
    limits = MessageLayoutLimits(window_size=window_size, chunk_size=chunk_size, chunk_max_bytes=1024 * 1024)
    store = ModelStore()
    for _ in range(legacy):
        stored = message(store.next_sequence, 10)
        store.window[stored.sequence] = stored
        store.appended.append(stored)
    commits = 0
    while True:
        before = len(store.window)
        writes = store.append([10], limits)
        commits += 1
        check_layout(store, limits)
        assert len(writes.chunk_sets) <= MESSAGE_ROLLOVER_MAX_CHUNKS_PER_COMMIT
        if len(store.window) <= window_size:
            break
        assert len(writes.chunk_sets) == MESSAGE_ROLLOVER_MAX_CHUNKS_PER_COMMIT
        assert len(store.window) < before + 1
        assert commits <= legacy
    # Once drained, the window stays within its size.
    for _ in range(3 * chunk_size):
        store.append([10], limits)
        assert len(store.window) <= window_size


def test_rollover_moves_whole_chunks_of_the_oldest_messages() -> None:
    """Window 4, chunks of 2: the fifth message moves 1-2 into chunk 1 and the window starts at 3."""
    limits = MessageLayoutLimits(window_size=4, chunk_size=2, chunk_max_bytes=1024 * 1024)
    store = ModelStore()
    for _ in range(4):
        writes = store.append([5], limits)  # within the window: one blind write each, not "nothing"
        assert writes == MessageWrites(window_sets=(store.appended[-1],))
    writes = store.append([5], limits)
    assert writes.window_sets == (store.appended[4],)
    assert writes.window_deletes == (1, 2)
    assert writes.chunk_sets == (AgentMessageChunk(tuple(store.appended[:2])),)
    assert writes.index == AgentMessageIndex(chunks=[AgentMessageChunkRange(1, 2)], first_sequence=1,
                                             window_first_sequence=3)
    assert sorted(store.window) == [3, 4, 5]


def test_rollover_steps_over_an_oversized_message() -> None:
    """An oversized message goes straight into its own chunk among the window's sequences; rollover
    later closes the chunk before it and steps over it."""
    limits = MessageLayoutLimits(window_size=2, chunk_size=3, chunk_max_bytes=600)
    store = ModelStore()
    store.append([5], limits)
    writes = store.append([1000], limits)  # sequence 2: oversized
    assert writes.window_sets == () and writes.chunk_sets == (AgentMessageChunk((store.appended[1],)),)
    assert writes.index == AgentMessageIndex(chunks=[AgentMessageChunkRange(2, 2)], first_sequence=1,
                                             window_first_sequence=1)
    store.append([5, 5], limits)  # 3, 4: the window holds 1, 3, 4
    assert store.index is not None
    # Chunk 1 closed at the gap; the window starts after the oversized message.
    assert store.index.chunks == [AgentMessageChunkRange(1, 1), AgentMessageChunkRange(2, 2)]
    assert store.index.window_first_sequence == 3
    check_layout(store, limits)


def test_chunk_size_is_the_encoded_json() -> None:
    """The size rule is the engine's JSON: 15 bytes of envelope, each message, a comma between."""
    assert CHUNK_ENVELOPE_BYTES == len(b'{"messages":[]}') == 15
    messages = [message(1, 3), message(2, 300), message(3, 0)]
    encoded = msgspec.json.encode(AgentMessageChunk(tuple(messages)))
    assert chunk_bytes([message_bytes(m) for m in messages]) == len(encoded)


def test_an_append_must_come_after_every_stored_message() -> None:
    """plan_append refuses a message at or before the newest stored one (in the window or in a chunk
    only) and a batch whose sequences do not increase: a Step never overwrites or reorders messages."""
    limits = MessageLayoutLimits(window_size=4, chunk_size=2, chunk_max_bytes=1_000_000)
    window = [message(1, 1), message(2, 1)]
    with pytest.raises(ValueError, match=r"^message 2 is not after the newest stored message 2$"):
        plan_append(window, None, [message(2, 1)], limits)
    with pytest.raises(ValueError, match=r"^message 4 is not after the newest stored message 4$"):
        plan_append(window, None, [message(3, 1), message(4, 1), message(4, 1)], limits)
    # Messages 3..5 are only in chunks (oversized ones): still stored, so 5 is not new.
    chunks = [AgentMessageChunkRange(3, 3), AgentMessageChunkRange(4, 5)]
    index = AgentMessageIndex(chunks=chunks, first_sequence=1, window_first_sequence=1)
    with pytest.raises(ValueError, match=r"^message 5 is not after the newest stored message 5$"):
        plan_append(window, index, [message(5, 1)], limits)
    assert plan_append(window, index, [message(6, 1)], limits).window_sets == (message(6, 1),)
    assert chunk_bytes([]) == CHUNK_ENVELOPE_BYTES  # an empty chunk is the envelope alone


def test_a_reader_checks_each_chunk_holds_its_range() -> None:
    """A chunk that is missing or holds other sequences than its index range is an error, not a guess."""
    index = AgentMessageIndex(chunks=[AgentMessageChunkRange(1, 2)], first_sequence=1, window_first_sequence=3)
    window = [message(3, 1)]
    with pytest.raises(MessageStoreCorruptError, match="missing"):
        newest_messages(index, window, lambda r: None)
    with pytest.raises(MessageStoreCorruptError, match=r"holds 1\.\.1 \(1 messages\).*lists 1\.\.2"):
        newest_messages(index, window, lambda r: AgentMessageChunk((message(1, 1),)))
    # The listed number of messages, but other sequences: still not the chunk the index lists.
    with pytest.raises(MessageStoreCorruptError, match=r"holds 2\.\.3 \(2 messages\).*lists 1\.\.2"):
        newest_messages(index, window, lambda r: AgentMessageChunk((message(2, 1), message(3, 1))))
    with pytest.raises(MessageStoreCorruptError, match=r"holds no messages, but AgentMessageIndex lists 1\.\.2"):
        newest_messages(index, window, lambda r: AgentMessageChunk(()))
    # Only the chunks a page reaches are read; an empty page reads nothing.
    assert newest_messages(index, window, lambda r: None, limit=1) == window
    assert newest_messages(index, window, lambda r: None, limit=0) == []


def test_reads_ignore_window_instances_outside_the_window() -> None:
    """A sequence in a chunk range is in that chunk; any other from window_first_sequence on is in
    AgentMessages; an instance before window_first_sequence is not read."""
    chunk = AgentMessageChunk((message(2, 1), message(3, 1)))
    index = AgentMessageIndex(chunks=[AgentMessageChunkRange(2, 3)], first_sequence=2, window_first_sequence=4)
    stale = [message(1, 9), message(3, 9), message(4, 1), message(5, 1)]
    read = newest_messages(index, stale, lambda r: chunk)
    assert [(m.sequence, m.text) for m in read] == [(2, "x"), (3, "x"), (4, "x"), (5, "x")]
    assert [m.sequence for m in newest_messages(index, stale, lambda r: chunk, before=4, limit=1)] == [3]
    # An oversized message's chunk (4) sits among the window's sequences: a window instance of 4 is not read.
    index = AgentMessageIndex(chunks=[AgentMessageChunkRange(1, 2), AgentMessageChunkRange(4, 4)], first_sequence=1,
                              window_first_sequence=3)
    chunks = {1: AgentMessageChunk((message(1, 1), message(2, 1))), 4: AgentMessageChunk((message(4, 1),))}
    stale = [message(3, 1), message(4, 9), message(5, 1)]
    for read_all in (newest_messages, all_messages):
        read = read_all(index, stale, lambda r: chunks[r.first_sequence])
        assert [(m.sequence, m.text) for m in read] == [(1, "x"), (2, "x"), (3, "x"), (4, "x"), (5, "x")]



def test_reads_of_an_index_listing_its_chunks_out_of_order_come_out_in_sequence_order() -> None:
    """Steps list AgentMessageIndex's chunks in order, but a reader does not rely on it: an index
    listing them out of order reads as the same index in order, for every page. Catches: the lazy
    merge (which assumes chunks in order) taken for any index."""
    chunks = {1: AgentMessageChunk(tuple(message(s, 1) for s in (1, 2, 3))),
              4: AgentMessageChunk((message(4, 1), message(5, 1)))}
    in_order = [AgentMessageChunkRange(1, 3), AgentMessageChunkRange(4, 5)]
    window = [message(6, 1), message(7, 1)]
    for ranges in (in_order, in_order[::-1]):
        index = AgentMessageIndex(chunks=ranges, first_sequence=1, window_first_sequence=6)
        pages = [newest_messages(index, window, lambda r: chunks[r.first_sequence], before=before, limit=limit)
                 for before, limit in ((None, None), (None, 3), (6, 4), (4, 5))]
        assert [[m.sequence for m in page] for page in pages] == [
            [1, 2, 3, 4, 5, 6, 7], [5, 6, 7], [2, 3, 4, 5], [1, 2, 3]], ranges


def test_a_page_past_deleted_messages_names_the_first_stored_one() -> None:
    """list_agent_messages' page: deleted_before_sequence is AgentMessageIndex.first_sequence once it is
    past 1, already at 2 (only message 1 deleted), and the page starting there is the last; without
    an index the oldest stored message is 1, so a page starting at 2 is not the last."""
    index = AgentMessageIndex(chunks=[], first_sequence=2, window_first_sequence=2)
    window = [message(2, 1), message(3, 1)]
    pages = [page_of_messages(index, window, lambda r: None, None, limit) for limit in (1, 200)]
    pages += [page_of_messages(None, [message(1, 1), message(2, 1)], lambda r: None, None, limit) for limit in (1, 200)]
    assert [([m.sequence for m in p.messages], p.next_before_sequence, p.deleted_before_sequence) for p in pages] == [
        ([3], 3, 2), ([2, 3], None, 2), ([2], 2, None), ([1, 2], None, None)]


def test_a_turn_without_its_reply_sequence_counts_back_to_its_last_user_message() -> None:
    """Seed 002 "Counts": for a turn another Worker started, the replies are the newest messages of
    the turn after its last user message, scanned back from the newest message across the window and
    chunks; a turn with no stored messages after another turn's has no replies."""
    user, assistant, tool = MessageRole.USER, MessageRole.ASSISTANT, MessageRole.TOOL
    shapes = [("turn-1", user), ("turn-1", assistant), ("turn-2", user), ("turn-2", user),
              ("turn-2", assistant), ("turn-2", tool), ("turn-2", assistant)]
    stored = [message(n, 1, turn_id=turn_id, role=role) for n, (turn_id, role) in enumerate(shapes, start=1)]
    chunk = AgentMessageChunk(tuple(stored[:4]))  # the last user message is in a chunk
    index = AgentMessageIndex(chunks=[AgentMessageChunkRange(1, 4)], first_sequence=1, window_first_sequence=5)
    for turn_id, start in (("turn-2", 5), ("turn-3", 8)):
        newest_first = iter_newest_first(index, stored[4:], lambda r: chunk)
        assert reply_start_by_scan(newest_first, turn_id, 8) == start, turn_id


@settings(max_examples=500, deadline=None)
@given(
    window=st.lists(st.integers(1, 12), max_size=8),
    ranges=st.lists(st.tuples(st.integers(1, 12), st.integers(0, 3)), max_size=4),
    window_first=st.integers(1, 12),
    before=st.none() | st.integers(-1, 16),
    limit=st.integers(1, 6),
)
def test_a_page_loads_exactly_the_chunks_it_reads(
    window: list[int], ranges: list[tuple[int, int]], window_first: int, before: int | None, limit: int,
) -> None:
    """chunks_of_newest, what get_agent_snapshot and list_agent_messages load, lists exactly the
    chunks newest_messages then reads for that page, for any layout of whole chunks: unsorted or
    overlapping ranges, window instances inside chunks or before them. One more would be a read the
    page does not need; one fewer, a chunk the RPC had not loaded (NotLoadedError)."""
    index = AgentMessageIndex(chunks=[AgentMessageChunkRange(first, first + length) for first, length in ranges],
                              first_sequence=1, window_first_sequence=window_first)
    stored = [message(sequence, 1) for sequence in window]
    read: list[AgentMessageChunkRange] = []

    def read_chunk(chunk_range: AgentMessageChunkRange) -> AgentMessageChunk:
        read.append(chunk_range)
        return AgentMessageChunk(tuple(message(s, 0) for s in range(chunk_range.first_sequence,
                                                                     chunk_range.last_sequence + 1)))

    newest_messages(index, stored, read_chunk, before=before, limit=limit)
    assert chunks_of_newest(index, stored, before=before, limit=limit) == read


def test_a_page_before_a_chunks_first_sequence_neither_loads_nor_reads_that_chunk() -> None:
    """A chunk that starts at `before` holds nothing the page wants: chunks_of_newest does not list it
    and newest_messages does not read it. Catches: the chunks taken through the first one starting at
    `before` (bisect_right), an extra chunk every such page loads and reads, which
    test_a_page_loads_exactly_the_chunks_it_reads misses, as listing and reading agree on it."""
    index = AgentMessageIndex(chunks=[AgentMessageChunkRange(1, 3), AgentMessageChunkRange(4, 5)], first_sequence=1,
                              window_first_sequence=6)
    chunks = {1: AgentMessageChunk(tuple(message(s, 1) for s in (1, 2, 3))),
              4: AgentMessageChunk((message(4, 1), message(5, 1)))}
    window = [message(6, 1)]
    read: list[int] = []

    def read_chunk(chunk_range: AgentMessageChunkRange) -> AgentMessageChunk:
        read.append(chunk_range.first_sequence)
        return chunks[chunk_range.first_sequence]

    assert [m.sequence for m in newest_messages(index, window, read_chunk, before=4, limit=2)] == [2, 3]
    assert read == [1]
    assert chunks_of_newest(index, window, before=4, limit=2) == [AgentMessageChunkRange(1, 3)]


@settings(max_examples=500, deadline=None)
@given(
    window=st.lists(st.integers(1, 12), max_size=8),
    ranges=st.lists(st.tuples(st.integers(1, 12), st.integers(-1, 3)), max_size=3),  # -1: a range backwards
    window_first=st.integers(1, 12),
    corrupt=st.sets(st.integers(0, 2), max_size=2),
    shape=st.sampled_from(["any", "run", "tidy"]),
)
def test_reading_every_message_matches_newest_messages(
    window: list[int], ranges: list[tuple[int, int]], window_first: int, corrupt: set[int], shape: str
) -> None:
    """all_messages (which skips sorting when the window follows every chunk in order) returns, or
    raises, exactly what newest_messages does, for any layout: unsorted or repeated window sequences,
    overlapping or unsorted chunk ranges, window instances inside chunks, missing or wrong chunks.
    A "run" window holds consecutive sequences; a "tidy" layout (consecutive chunks from 1, then the
    window) is the one Steps leave, and the only one read through `read_chunks` (the memo) in one
    call, with no sort."""
    if shape == "tidy":
        lengths = [max(0, length) for _, length in ranges]
        ends = list(itertools.accumulate(1 + length for length in lengths))
        ranges = [(end - length, length) for end, length in zip(ends, lengths, strict=True)]
        window_first = (ends[-1] if ends else 0) + 1
        window = list(range(window_first, window_first + len(window)))
    elif shape == "run" and window:
        window = list(range(window[0], window[0] + len(window)))
    chunk_ranges = [AgentMessageChunkRange(first, first + length) for first, length in ranges]
    index = AgentMessageIndex(chunks=chunk_ranges, first_sequence=1, window_first_sequence=window_first)
    stored = [message(sequence, i) for i, sequence in enumerate(window)]  # text length tells repeats apart
    bad = {ranges[i][0] for i in corrupt if i < len(ranges)}  # these chunks are missing or hold too little

    def read_chunk(chunk_range: AgentMessageChunkRange) -> AgentMessageChunk | None:
        first = chunk_range.first_sequence
        if first in bad:
            return None if first % 2 else AgentMessageChunk((message(first, 0),) * 5)
        return AgentMessageChunk(tuple(message(s, 0) for s in range(first, chunk_range.last_sequence + 1)))

    read_in_one_call: list[int] = []

    def read_chunks(chunks: Sequence[AgentMessageChunkRange], read: ChunkReader) -> list[AgentMessage]:
        read_in_one_call.append(len(chunks))
        return chunk_messages(chunks, read)

    for layout in (index, None):
        try:
            expected: list[AgentMessage] | str = newest_messages(layout, stored, read_chunk)
        except MessageStoreCorruptError as exc:
            expected = str(exc)
        read_in_one_call.clear()
        try:
            got: list[AgentMessage] | str = all_messages(layout, stored, read_chunk, read_chunks)
        except MessageStoreCorruptError as exc:
            got = str(exc)
        assert got == expected
        if shape == "tidy":
            assert read_in_one_call == [len(layout.chunks) if layout is not None else 0]


# Options ------------------------------------------------------------------------------------------------


def test_message_options_defaults() -> None:
    """Defaults are the seed's: a window of 64, chunks of 32 messages and 1 MiB."""
    options = AgentSessionOptions()
    assert (options.message_window_size, options.message_chunk_size, options.message_chunk_max_bytes) == (
        64, 32, 1024 * 1024)
    AgentSessionOptions(message_window_size=1, message_chunk_size=1, message_chunk_max_bytes=1)


@pytest.mark.parametrize(("name", "value"), [
    ("message_window_size", 0), ("message_window_size", -1), ("message_window_size", True),
    ("message_window_size", 2.0), ("message_window_size", "64"), ("message_window_size", None),
    ("message_chunk_size", 0), ("message_chunk_size", False), ("message_chunk_size", 1.5),
    ("message_chunk_max_bytes", 0), ("message_chunk_max_bytes", True), ("message_chunk_max_bytes", "1MiB"),
    ("message_chunk_max_bytes", 8 * 1024 * 1024 + 1),
    # A chunk is one engine value: a cap over MAX_VALUE_BYTES would make a later rollover fail.
    ("message_chunk_max_bytes", MAX_VALUE_BYTES + 1),
])
def test_message_options_refuse_bad_values(name: str, value: Any) -> None:
    """Each bad value is a ValueError naming the field and showing the value."""
    with pytest.raises(ValueError, match="invalid AgentSessionOptions") as info:
        AgentSessionOptions(**{name: value})
    assert f"{name} must be a whole number" in str(info.value)
    assert repr(value) in str(info.value)


# Real sessions ----------------------------------------------------------------------------------------

LOOKUPS_PER_TURN = 1


def three_lookups(request: ModelRequest) -> ScriptedModelReply:
    """Each turn: reasoning, text and three lookups; then, after the results, reasoning and an answer."""
    text = ScriptedModelClient.user_texts(request)[-1]
    if text.startswith("/fail") and ScriptedModelClient.tool_results(request):
        raise RuntimeError("the model is down")
    if ScriptedModelClient.tool_results(request):
        return ScriptedModelReply(reasoning="got them", text=f"answer to {text}")
    if text.startswith("/echo"):
        return ScriptedModelReply(text=f"echo: {text}")
    calls = [ScriptedToolCall("lookup_order", {"order_id": f"{text}-{i}"}) for i in range(LOOKUPS_PER_TURN)]
    return ScriptedModelReply(reasoning="thinking", text="looking up", tool_calls=calls)


def storage_flow(flow_type: str, **options: Any) -> tuple[AgentSessionFlow, ScriptedModelClient]:
    model = ScriptedModelClient(three_lookups)
    definition = AgentDefinition(name="storage-agent", model=model, instructions="Test agent.", tools=[lookup_order])
    session_options = replace(builtin_agent_session_options(definition), **options)
    return AgentSessionFlow(BuiltinLoopAgentRunner(definition), flow_type, session_options), model


async def turn_done(sessions: AgentSessionClient, sid: str, count: int) -> AgentSnapshot:
    snapshot: AgentSnapshot = await wait_for_agent_snapshot(
        sessions, sid, lambda s: s if s.state is not None and s.state.turn_count >= count else None,
        description=f"turn {count} of {sid} to end",
    )
    return snapshot


async def run_turn(sessions: AgentSessionClient, sid: str, number: int, text: str) -> AgentSnapshot:
    assert await sessions.send_user_message(sid, text)
    return await turn_done(sessions, sid, number)


async def all_pages(sessions: AgentSessionClient, sid: str, limit: int) -> list[AgentMessage]:
    """Every stored message, paging back from the newest with next_before_sequence."""
    pages: list[list[AgentMessage]] = []
    cursor: int | None = None
    while True:
        page = await sessions.list_agent_messages(sid, before_sequence=cursor, limit=limit)
        assert page.deleted_before_sequence is None  # nothing is ever deleted without compaction
        assert page.messages and len(page.messages) <= limit
        pages.append(page.messages)
        if page.next_before_sequence is None:
            break
        assert page.next_before_sequence == page.messages[0].sequence
        cursor = page.next_before_sequence
    return [m for page in reversed(pages) for m in page]


@dataclass
class StoredLayout:
    index: AgentMessageIndex | None
    window: dict[str, AgentMessage]
    chunks: dict[str, AgentMessageChunk]


async def stored_layout(engine: InProcessEngine, sid: str) -> StoredLayout:
    return StoredLayout(
        index=await engine.client.get_attribute(sid, AGENT_MESSAGE_INDEX),
        window=await engine.client.get_attribute_map(sid, AGENT_MESSAGES),
        chunks=await engine.client.get_attribute_map(sid, AGENT_MESSAGE_CHUNKS),
    )


def check_stored_layout(layout: StoredLayout, total: int, window_size: int) -> None:
    """The index lists exactly the stored chunks, each holds exactly its range, archived ranges are
    consecutive from 1, the window holds the rest and no more than its size, all sequences 1..total."""
    index = layout.index
    assert index is not None
    assert index.first_sequence == 1
    assert sorted(layout.chunks) == [message_sequence_key(r.first_sequence) for r in index.chunks]
    located: list[int] = []
    for chunk_range in index.chunks:
        held = [m.sequence for m in layout.chunks[message_sequence_key(chunk_range.first_sequence)].messages]
        assert held == list(range(chunk_range.first_sequence, chunk_range.last_sequence + 1))
        located.extend(held)
    archived = [r for r in index.chunks if r.last_sequence < index.window_first_sequence]
    assert [r.first_sequence for r in archived] == [1] + [r.last_sequence + 1 for r in archived[:-1]]
    assert archived[-1].last_sequence == index.window_first_sequence - 1
    assert all(int(key) >= index.window_first_sequence for key in layout.window)
    assert len(layout.window) <= window_size
    located.extend(int(key) for key in layout.window)
    assert sorted(located) == list(range(1, total + 1))


async def test_thirty_turns_over_a_small_window(tmp_path: Path) -> None:
    """Window 4, chunks of 2, 30 turns of 11 messages: the snapshot holds the newest 200 in order,
    list_agent_messages pages back to sequence 1 exactly, the last model call saw every message in
    order, AgentMessageIndex lists exactly the chunks, each holding its range, chunks written earlier
    never change, and turn_completed counts each turn's replies from TurnReplySequence."""
    flow, model = storage_flow("StorageAgent", message_window_size=4, message_chunk_size=2)
    engine = InProcessEngine(tmp_path, [flow])
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s")
        earlier: dict[str, AgentMessageChunk] = {}
        for number in range(1, 31):
            await run_turn(sessions, "s", number, f"turn {number}")
            if number == 15:
                earlier = (await stored_layout(engine, "s")).chunks
        snapshot = await sessions.get_agent_snapshot("s")
        assert snapshot.state is not None and snapshot.state.last_turn_error is None
        per_turn = 1 + 2 + 2 * LOOKUPS_PER_TURN + 2  # user; reasoning, text, calls; results, reasoning, answer
        total = 30 * per_turn
        assert snapshot.state.next_message_sequence == total + 1

        assert [m.sequence for m in snapshot.messages] == list(range(total - 199, total + 1))
        everything = await all_pages(sessions, "s", limit=37)
        assert [m.sequence for m in everything] == list(range(1, total + 1))
        assert snapshot.messages == everything[-200:]
        assert [m.text for m in everything if m.role is MessageRole.USER] == [f"turn {n}" for n in range(1, 31)]
        assert everything == await all_pages(sessions, "s", limit=200)

        # The last model call (after turn 30's lookups) saw every message stored before its answer.
        last = model.requests[-1]
        assert list(last.input) == [input_item(m) for m in everything[:-2]]

        layout = await stored_layout(engine, "s")
        check_stored_layout(layout, total, window_size=4)
        assert all(len(c.messages) == 2 for c in layout.chunks.values())
        assert earlier and all(layout.chunks[key] == chunk for key, chunk in earlier.items())

        reply = await engine.client.get_attribute("s", TURN_REPLY_SEQUENCE)
        assert reply is not None and (reply.turn_id, reply.sequence) == ("turn-30", total - per_turn + 2)
        completed = [json.loads(e.value.payload) for e in await all_agent_events(sessions, "s")
                     if e.value.type == "turn_completed"]
        assert [c["message_count"] for c in completed] == [per_turn - 1] * 30


async def test_paging_back_to_back_lets_the_loop_run_its_timers(tmp_path: Path) -> None:
    """A client that pages through a transcript again and again (a UI exporting it, a sync job) on
    the loop of an in-process Worker: on SQLite each read ran on that loop while it looked idle, so
    the pager never suspended and no timer fired until it stopped: not the Worker's lease renewal,
    not a sleep, not the wait_for timeout meant to bound the paging itself."""
    flow, _ = storage_flow("PagedAgent", message_window_size=4, message_chunk_size=2)
    engine = InProcessEngine(tmp_path, [flow])
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s")
        for number in range(1, 4):
            await run_turn(sessions, "s", number, f"turn {number}")
        loop = asyncio.get_running_loop()
        paging_seconds = 3.0

        async def page_for_a_while() -> int:
            started, walks = loop.time(), 0
            while loop.time() - started < paging_seconds:
                await all_pages(sessions, "s", limit=5)
                walks += 1
            return walks

        started = loop.time()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(page_for_a_while(), timeout=0.2)
        assert loop.time() - started < 1.0, f"wait_for(timeout=0.2) ended after {loop.time() - started:.2f} s"


async def test_oversized_messages_sit_in_their_own_chunks(tmp_path: Path) -> None:
    """With message_chunk_max_bytes 2 KB, a 3 KB user message and its 3 KB echo skip the window: the Step
    that stores each writes it straight into its own chunk; later rollover steps over them, and every
    read (snapshot, pages, the model input) still has every message in order."""
    flow, model = storage_flow("OversizedAgent", message_window_size=4, message_chunk_size=2,
                               message_chunk_max_bytes=2048)
    engine = InProcessEngine(tmp_path, [flow])
    big = "/echo " + "y" * 3000
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s")
        await run_turn(sessions, "s", 1, "/echo one")
        await run_turn(sessions, "s", 2, big)
        layout = await stored_layout(engine, "s")
        # Sequences 3 (the user's) and 4 (the echo) never entered the window.
        assert layout.index == AgentMessageIndex(
            chunks=[AgentMessageChunkRange(3, 3), AgentMessageChunkRange(4, 4)], first_sequence=1,
            window_first_sequence=1)
        assert sorted(layout.window) == [message_sequence_key(1), message_sequence_key(2)]
        assert [m.text for m in layout.chunks[message_sequence_key(3)].messages] == [big]
        assert [m.text for m in layout.chunks[message_sequence_key(4)].messages] == [f"echo: {big}"]

        for number in range(3, 9):
            await run_turn(sessions, "s", number, f"/echo {number}")
        total = 16
        layout = await stored_layout(engine, "s")
        check_stored_layout(layout, total, window_size=4)
        assert layout.index is not None
        assert layout.index.window_first_sequence > 4  # rollover went past the oversized chunks
        for key, chunk in layout.chunks.items():
            size = encoded_chunk_bytes(chunk)
            assert size <= 2048 or (len(chunk.messages) == 1 and key in (message_sequence_key(3),
                                                                         message_sequence_key(4)))
        everything = await all_pages(sessions, "s", limit=3)
        assert [m.sequence for m in everything] == list(range(1, total + 1))
        assert everything[2].text == big
        snapshot = await sessions.get_agent_snapshot("s")
        assert snapshot.messages == everything
        assert list(model.requests[-1].input) == [input_item(m) for m in everything[:-1]]


async def test_failed_turn_reads_and_stores_across_chunks(tmp_path: Path) -> None:
    """RecordTurnFailure gives the runner the whole conversation (chunks included) and stores the
    failed turn's unfinished messages; the next turn's model input has every message in order."""
    flow, model = storage_flow("FailingAgent", message_window_size=4, message_chunk_size=2,
                               run_model_limit=RunModelLimit(max_attempts=1))
    engine = InProcessEngine(tmp_path, [flow])
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s")
        for number in range(1, 4):
            await run_turn(sessions, "s", number, f"turn {number}")
        failed = await run_turn(sessions, "s", 4, "/fail now")
        assert failed.state is not None and failed.state.last_turn_error is not None
        stored = await all_pages(sessions, "s", limit=50)
        turn_four = [m for m in stored if m.turn_id == "turn-4"]
        # The user message, reasoning, text and calls, then the unfinished results the failure stored.
        assert [m.role for m in turn_four].count(MessageRole.TOOL) == LOOKUPS_PER_TURN
        assert [m.sequence for m in stored] == list(range(1, len(stored) + 1))
        await run_turn(sessions, "s", 5, "/echo after")
        everything = await all_pages(sessions, "s", limit=50)
        assert list(model.requests[-1].input) == [input_item(m) for m in everything[:-1]]
        check_stored_layout(await stored_layout(engine, "s"), len(everything), window_size=4)


async def test_a_turn_cancelled_during_its_model_call_reads_across_chunks(tmp_path: Path) -> None:
    """cancel_turn during a model call, in a session whose older messages are in chunks: ApplyTurnControl
    ends the turn with the runner's view of the whole conversation, chunks included, and the next
    turn's model input has every message in order. Catches: ApplyTurnControl loading the window
    alone, whose read of a chunk failed every attempt, so the cancelled turn never ended."""
    running = asyncio.Event()

    async def respond(request: ModelRequest) -> ScriptedModelReply:
        text = ScriptedModelClient.user_texts(request)[-1]
        if text == "/hang":
            running.set()
            await asyncio.Event().wait()  # until cancel_turn cancels the call
        return ScriptedModelReply(text=f"echo: {text}")

    model = ScriptedModelClient(respond)
    definition = AgentDefinition(name="storage-agent", model=model, instructions="Test agent.")
    options = replace(builtin_agent_session_options(definition), message_window_size=4, message_chunk_size=2)
    engine = InProcessEngine(tmp_path, [AgentSessionFlow(BuiltinLoopAgentRunner(definition), "Cancelled", options)])
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s")
        for number in range(1, 4):
            await run_turn(sessions, "s", number, f"/echo {number}")
        assert (await stored_layout(engine, "s")).chunks  # the older messages are in chunks now
        assert await sessions.send_user_message("s", "/hang")
        await asyncio.wait_for(running.wait(), 30)
        assert await sessions.cancel_turn("s") is True
        cancelled = await turn_done(sessions, "s", 4)
        assert cancelled.state is not None and cancelled.state.last_turn_error is None
        await run_turn(sessions, "s", 5, "/echo after")
        everything = await all_pages(sessions, "s", limit=50)
        assert list(model.requests[-1].input) == [input_item(m) for m in everything[:-1]]


def test_store_limits_follow_the_options() -> None:
    """The runtime's layout limits are the session options' message fields and the seed's per-commit caps."""
    flow, _ = storage_flow("LimitsAgent", message_window_size=5, message_chunk_size=3, message_chunk_max_bytes=4096)
    runtime = runtime_of(flow)
    assert dataclasses.asdict(runtime.layout_limits) == {
        "window_size": 5, "chunk_size": 3, "chunk_max_bytes": 4096,
        "max_chunks_per_commit": MESSAGE_ROLLOVER_MAX_CHUNKS_PER_COMMIT,
        "max_bytes_per_commit": MESSAGE_ROLLOVER_MAX_BYTES_PER_COMMIT,
    }


@pytest.mark.parametrize("starts_turn", [True, False])
async def test_appending_no_messages_writes_only_a_starting_turns_reply_sequence(starts_turn: bool) -> None:
    """No items: a turn that starts here still records where its replies start (the next sequence), and
    otherwise nothing is written, not even the reply sequence a scan back would find."""
    flow, _ = storage_flow("EmptyAppendAgent")
    state = running_turn(active_turn_id="turn-2", next_message_sequence=3)
    ctx = step_context(flow, "RunModel", {})
    assert runtime_of(flow).append_messages(ctx, state, "turn-2", [], starts_turn=starts_turn) == state
    if starts_turn:
        assert ctx.get(TURN_REPLY_SEQUENCE) == TurnReplySequence(turn_id="turn-2", sequence=3)
    else:
        assert ctx.writes.empty()


def _framework(role: MessageRole, text: str) -> FrameworkMessage:
    return FrameworkMessage(role=role, framework_item="{}", text=text)


def _with_turn_1_marker(flow: AgentSessionFlow, window: list[AgentMessage]) -> Context:
    """A RunModel context with `window` as the window and TurnReplySequence left by turn-1 (at 2)."""
    values: dict[tuple[str, str], Any] = {(AGENT_MESSAGES.name, message_sequence_key(m.sequence)): m for m in window}
    values[(TURN_REPLY_SEQUENCE.name, "")] = TurnReplySequence(turn_id="turn-1", sequence=2)
    return step_context(flow, "RunModel", values)


def test_a_starting_turn_records_where_its_replies_start_after_its_user_messages() -> None:
    """The turn's user messages take sequences 3 and 4: its replies start at 5, recorded now, not
    found later by a scan back."""
    flow, _ = storage_flow("StartingAppendAgent")
    state = running_turn(active_turn_id="turn-2", next_message_sequence=3)
    ctx = step_context(flow, "AwaitUserMessage", {})
    users = [_framework(MessageRole.USER, t) for t in ("a", "b")]
    after = runtime_of(flow).append_messages(ctx, state, "turn-2", users, starts_turn=True)
    assert after.next_message_sequence == 5
    assert ctx.get(TURN_REPLY_SEQUENCE) == TurnReplySequence(turn_id="turn-2", sequence=5)


@pytest.mark.parametrize("over", [0, 1])
def test_a_message_is_refused_one_byte_past_the_value_limit_in_its_own_chunk(over: int) -> None:
    """A message whose own chunk is exactly MAX_VALUE_BYTES (the default message_chunk_max_bytes) is
    stored, in the window; one byte more names the message, its role, its turn, the chunk it would
    need and its size, and writes nothing."""
    flow, _ = storage_flow("LimitAgent")
    state = running_turn(active_turn_id="turn-2", next_message_sequence=3)

    def answer(text: str) -> FrameworkMessage:
        return _framework(MessageRole.ASSISTANT, text)

    def stored_size(text: str) -> int:
        return chunk_bytes([message_bytes(to_agent_message(answer(text), 3, "turn-2", utc_now_text()))])

    text = "x" * (MAX_VALUE_BYTES - stored_size("") + over)
    assert stored_size(text) == MAX_VALUE_BYTES + over
    ctx = step_context(flow, "RunModel", {})
    runtime = runtime_of(flow)
    if not over:
        assert runtime.append_messages(ctx, state, "turn-2", [answer(text)]).next_message_sequence == 4
        stored = ctx.get(AGENT_MESSAGES[message_sequence_key(3)])
        assert stored is not None and stored.text == text
        return
    with pytest.raises(ValueTooLarge) as raised:
        runtime.append_messages(ctx, state, "turn-2", [answer(text)])
    assert str(raised.value) == (
        "message 3 (assistant) of turn turn-2 is too large to store: value for "
        f"'AgentMessageChunks[000000000003]' is {MAX_VALUE_BYTES + 1} bytes encoded, over MAX_VALUE_BYTES "
        f"({MAX_VALUE_BYTES}); store it in pieces or outside the flow"
    )
    assert ctx.writes.empty()


@pytest.mark.parametrize("small_before", [0, 2])
def test_rollover_leaves_a_legacy_message_no_chunk_can_hold_in_the_window(small_before: int) -> None:
    """A 0.1.0 session stored a message of MAX_VALUE_BYTES - 5 bytes in AgentMessages; its chunk
    would be 10 bytes over the value limit. Rollover moves the messages before it and stops there,
    so the next Step stores its message: before, every Step that stored one failed on that chunk
    ("messages of turn turn-2 are too large to store"), and no turn of the session could run again.
    Every message stays readable, in order, and pages back to sequence 1."""
    flow, _ = storage_flow("LegacyGiantAgent", message_window_size=1, message_chunk_size=1)
    giant_sequence = small_before + 1
    padded = message(giant_sequence, 0)
    giant = message(giant_sequence, MAX_VALUE_BYTES - 5 - message_bytes(padded))
    assert message_bytes(giant) == MAX_VALUE_BYTES - 5 and chunk_bytes([message_bytes(giant)]) > MAX_VALUE_BYTES
    legacy = [message(s, 1) for s in range(1, giant_sequence)] + [giant, message(giant_sequence + 1, 1)]
    ctx = step_context(flow, "RunModel", {
        (AGENT_MESSAGES.name, message_sequence_key(m.sequence)): m for m in legacy})  # no AgentMessageIndex
    state = running_turn(active_turn_id="turn-1", next_message_sequence=len(legacy) + 1)
    after = runtime_of(flow).append_messages(ctx, state, "turn-1", [_framework(MessageRole.ASSISTANT, "next")])
    assert after.next_message_sequence == len(legacy) + 2
    index = ctx.get(AGENT_MESSAGE_INDEX)
    if small_before:
        assert index == AgentMessageIndex(chunks=[AgentMessageChunkRange(1, 1), AgentMessageChunkRange(2, 2)],
                                          first_sequence=1, window_first_sequence=giant_sequence)
    else:
        assert index is None  # nothing moved: the index is written only with a chunk
    window = list(ctx.items(AGENT_MESSAGES).values())
    assert [m.sequence for m in window] == list(range(giant_sequence, len(legacy) + 2))
    read_chunk = every_chunk_reader(ctx)
    stored = newest_messages(index, window, read_chunk)
    assert stored[:-1] == legacy and stored[-1].text == "next"
    page = page_of_messages(index, window, read_chunk, giant_sequence + 1, 200)
    assert (page.messages, page.next_before_sequence) == (legacy[:giant_sequence], None)


def test_appending_to_a_turn_whose_reply_sequence_names_another_records_its_own_first() -> None:
    """TurnReplySequence still names turn-1 (a Worker that did not record one started turn-2): the
    first append of turn-2 records where its replies start, found by a scan back while the turn's
    messages are all readable, not left for a later count that rollover may have made unreadable."""
    flow, _ = storage_flow("ScanBackAgent")
    ctx = _with_turn_1_marker(flow, [message(1, 1), message(2, 1), message(3, 1, "turn-2", MessageRole.USER)])
    state = running_turn(active_turn_id="turn-2", next_message_sequence=4)
    runtime_of(flow).append_messages(ctx, state, "turn-2", [_framework(MessageRole.ASSISTANT, "a")])
    assert ctx.get(TURN_REPLY_SEQUENCE) == TurnReplySequence(turn_id="turn-2", sequence=4)


def test_a_turn_whose_reply_sequence_names_another_counts_its_replies_by_a_scan_back() -> None:
    """reply_count reads TurnReplySequence only when it names the turn; one left by turn-1 would count
    turn-1's answer and turn-2's user message as replies. The scan back finds turn-2's replies start
    after its last user message (sequence 4)."""
    flow, _ = storage_flow("CountingAgent")
    ctx = _with_turn_1_marker(flow, [
        message(1, 1, role=MessageRole.USER), message(2, 1), message(3, 1, "turn-2", MessageRole.USER),
        message(4, 1, "turn-2"), message(5, 1, "turn-2", MessageRole.TOOL),
    ])
    state = running_turn(active_turn_id="turn-2", next_message_sequence=6)
    assert runtime_of(flow).reply_count(ctx, state, "turn-2") == 2
    assert runtime_of(flow).reply_count(ctx, state, "turn-1") == 4  # its own marker: read, not scanned


def test_turn_settings_tagged_with_another_turn_read_as_empty() -> None:
    """TurnSessionSettings left by turn-1 are not turn-2's: they read as {}; turn-1 reads its own."""
    flow, _ = storage_flow("SettingsAgent")
    ctx = step_context(flow, "RunModel", {
        (TURN_SESSION_SETTINGS.name, ""): TurnSessionSettings(turn_id="turn-1", session_settings={"tone": "dry"}),
    })
    assert runtime_of(flow).turn_settings(ctx, "turn-2") == {}
    assert runtime_of(flow).turn_settings(ctx, "turn-1") == {"tone": "dry"}


def test_every_chunk_reader_reads_what_it_did_not_load_as_chunk_reader_does() -> None:
    """A model call's reader takes the chunks it loaded from one read up front; a chunk outside them
    is read through the context, so a Step that did not load it gets NotLoadedError naming the
    instance, not None (which a reader takes for a chunk that is gone)."""
    flow, _ = storage_flow("ChunkReaders")
    kept = AgentMessageChunk((message(1, 3), message(2, 3)))
    values: dict[tuple[str, str], Any] = {(AGENT_MESSAGE_CHUNKS.name, message_sequence_key(1)): kept}
    only_chunk_1 = LoadSpec("only", instances=((AGENT_MESSAGE_CHUNKS.name, message_sequence_key(1)),))
    for load in (only_chunk_1, LoadSpec("all")):
        read = every_chunk_reader(step_context(flow, "RunModel", values, load=load))
        assert read(AgentMessageChunkRange(1, 2)) == kept
    read = every_chunk_reader(step_context(flow, "RunModel", values, load=only_chunk_1))
    with pytest.raises(NotLoadedError, match=f"AgentMessageChunks\\[{message_sequence_key(3)}\\]"):
        read(AgentMessageChunkRange(3, 4))
    read = every_chunk_reader(step_context(flow, "RunModel", values, load=LoadSpec("none")))
    with pytest.raises(NotLoadedError, match=f"AgentMessageChunks\\[{message_sequence_key(1)}\\]"):
        read(AgentMessageChunkRange(1, 2))
    assert every_chunk_reader(step_context(flow, "RunModel", values))(AgentMessageChunkRange(3, 4)) is None


# Long sessions ---------------------------------------------------------------------------------------


async def fabricate(engine: InProcessEngine, sid: str, index: AgentMessageIndex,
                    chunks: dict[int, AgentMessageChunk]) -> int:
    """Store these chunks and index, as a long session's rollovers would have left them, and the
    session's next sequence after them, in one commit: thousands of turns in a moment. The session
    must be waiting for a message. Returns the number of messages."""
    writes = WriteSet()
    for first, chunk in chunks.items():
        key = message_sequence_key(first)
        writes.attributes[(AGENT_MESSAGE_CHUNKS.name, key)] = encode_value(key, AgentMessageChunk, chunk)
    writes.attributes[(AGENT_MESSAGE_INDEX.name, "")] = encode_value("index", AgentMessageIndex, index)
    state = await engine.client.get_attribute(sid, AGENT_STATE)
    assert state is not None and state.next_message_sequence == 1
    total = index.window_first_sequence - 1
    state = msgspec.structs.replace(state, next_message_sequence=total + 1)
    writes.attributes[(AGENT_STATE.name, "")] = encode_value("state", AgentState, state)
    await engine.client.store.rpc_commit(sid, None, [], writes, [], [])
    return total


def chunks_of(count: int, size: int) -> tuple[AgentMessageIndex, dict[int, AgentMessageChunk]]:
    """`count` chunks of `size` messages from sequence 1, and the index listing them."""
    firsts = range(1, count * size + 1, size)
    chunks = {f: AgentMessageChunk(messages=tuple(message(s, 20) for s in range(f, f + size))) for f in firsts}
    ranges = [AgentMessageChunkRange(f, f + size - 1) for f in firsts]
    return AgentMessageIndex(chunks=ranges, first_sequence=1, window_first_sequence=count * size + 1), chunks


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
async def test_a_page_reads_only_the_chunks_it_returns(
    tmp_path: Path, backend: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """list_agent_messages and get_agent_snapshot on a session of 3,000 chunks load the chunks their
    messages are in, and no others (counted as the engine hands the RPC its rows, from the database
    or SQLite's cache); the pages are the same as before. Catches: both loaded AgentMessageChunks
    whole, so every page of a UI read the session's every chunk, and cost more the longer the session
    ran. A limit out of 1..200 is clamped before the chunks are chosen (catches: the chunks chosen
    for the limit as sent)."""
    url = request.getfixturevalue("pg_database") if backend == "postgres" else None
    flow, _ = storage_flow("LongAgent", message_window_size=4, message_chunk_size=3)
    engine = InProcessEngine(tmp_path, [flow], url=url)
    chunk_rows: list[int] = []
    real_load = transitions.load_attributes

    def counting_load(db: Any, flow_id: str, spec: LoadSpec) -> dict[tuple[str, str], bytes]:
        rows = real_load(db, flow_id, spec)
        chunk_rows.append(sum(1 for name, _ in rows if name == AGENT_MESSAGE_CHUNKS.name))
        return rows

    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s")
        await turn_done(sessions, "s", 0)  # StartAgentSession committed: the session waits for a message
        total = await fabricate(engine, "s", *chunks_of(3000, 3))
        monkeypatch.setattr(transitions, "load_attributes", counting_load)

        page = await sessions.list_agent_messages("s", limit=1)
        assert [m.sequence for m in page.messages] == [total]
        assert page.next_before_sequence == total
        assert sum(chunk_rows) == 1
        chunk_rows.clear()
        page = await sessions.list_agent_messages("s", before_sequence=4500, limit=200)
        assert [m.sequence for m in page.messages] == list(range(4300, 4500))
        assert sum(chunk_rows) == 67  # 4300..4301 in the chunk from 4300, ..., 4498..4499 in the one from 4498
        chunk_rows.clear()
        # A limit out of 1..200 loads the chunks of the page the clamped limit returns: none for 0 was a
        # chunk read but not loaded (NotLoadedError), and 10,000 loaded all 1,500 before 4500.
        for limit, clamped, chunks in ((0, 1, 1), (10_000, 200, 67)):
            page = await sessions.list_agent_messages("s", before_sequence=4500, limit=limit)
            assert [m.sequence for m in page.messages] == list(range(4500 - clamped, 4500))
            assert sum(chunk_rows) == chunks
            chunk_rows.clear()
        page = await sessions.list_agent_messages("s", before_sequence=3, limit=200)
        assert [m.sequence for m in page.messages] == [1, 2] and page.next_before_sequence is None
        assert sum(chunk_rows) == 1
        chunk_rows.clear()
        snapshot = await sessions.get_agent_snapshot("s")
        assert [m.sequence for m in snapshot.messages] == list(range(total - 199, total + 1))
        assert sum(chunk_rows) == 67


def full_index(room: int) -> tuple[AgentMessageIndex, dict[int, AgentMessageChunk]]:
    """Single-message chunks from sequence 1, as many as leave the index no more than `room` and at
    least `room` - 100 bytes below the engine's value limit, and the chunks it lists."""
    ranges: list[AgentMessageChunkRange] = []
    size = len(msgspec.json.encode(AgentMessageIndex(chunks=[], first_sequence=1, window_first_sequence=1)))
    sequence = 1
    while True:
        entry = len(msgspec.json.encode(AgentMessageChunkRange(sequence, sequence))) + (1 if ranges else 0)
        if size + entry + 12 > MAX_VALUE_BYTES - room:  # 12: window_first_sequence's digits
            break
        ranges.append(AgentMessageChunkRange(sequence, sequence))
        size += entry
        sequence += 1
    index = AgentMessageIndex(chunks=ranges, first_sequence=1, window_first_sequence=sequence)
    assert MAX_VALUE_BYTES - room - 100 < len(msgspec.json.encode(index)) <= MAX_VALUE_BYTES - room
    return index, {r.first_sequence: AgentMessageChunk(messages=(message(r.first_sequence, 1),)) for r in ranges}


@pytest.mark.parametrize("room", [0, 120, 400])
def test_rollover_stops_where_the_index_would_pass_the_value_limit(room: int) -> None:
    """With AgentMessageIndex near the engine's value limit (about 22,000 chunks), appends move only
    the chunks whose ranges fit it, and keep the rest (an oversized message too) in the window, which
    grows past its size: every index written fits the limit, and every message reads back in order.
    Catches: rollover wrote an index over the limit, so every Step that stored a message failed on
    every attempt, and the session never ran a turn again."""
    index, chunks = full_index(room)
    limits = MessageLayoutLimits(window_size=2, chunk_size=2, chunk_max_bytes=2048)
    store = ModelStore(chunks=dict(chunks), index=index)
    store.appended = [m for c in chunks.values() for m in c.messages]
    for _ in range(6):
        store.append([10, 10, 3000, 10], limits)  # the 3 KB message is oversized: its own chunk if it fits
        assert store.index is not None
        assert len(msgspec.json.encode(store.index)) <= MAX_VALUE_BYTES
    assert store.index is not None
    added = len(store.index.chunks) - len(index.chunks)
    assert (added > 0) is (room >= 120)  # 120 bytes: room for a range or two, 0: none
    assert len(store.window) > limits.window_size
    expected = [m.sequence for m in store.appended]
    assert [m.sequence for m in newest_messages(store.index, list(store.window.values()), store.read_chunk)] == expected
    assert [m.sequence for m in all_messages(store.index, sorted(store.window.values(), key=lambda m: m.sequence),
                                             store.read_chunk)] == expected
    page = newest_messages(store.index, list(store.window.values()), store.read_chunk, limit=30)
    assert [m.sequence for m in page] == expected[-30:]


def test_a_rollover_after_retention_keeps_the_first_stored_sequence() -> None:
    """A rollover's new AgentMessageIndex keeps first_sequence, which retention advanced: the
    messages before it are deleted, and a page past them names it. Catches: the index rewritten with
    first_sequence 1, as if deleted messages were stored again."""
    index = AgentMessageIndex(chunks=[AgentMessageChunkRange(5, 6)], first_sequence=5, window_first_sequence=7)
    limits = MessageLayoutLimits(window_size=2, chunk_size=2, chunk_max_bytes=2048)
    writes = plan_append([message(7, 1), message(8, 1)], index, [message(9, 1)], limits)
    assert writes.index == AgentMessageIndex(
        chunks=[AgentMessageChunkRange(5, 6), AgentMessageChunkRange(7, 8)], first_sequence=5, window_first_sequence=9)


def test_of_two_oversized_messages_only_the_older_gets_the_last_room_in_the_index() -> None:
    """With room in AgentMessageIndex for one more range, an append of two oversized messages writes
    the older one's chunk and lists its range, and keeps the newer one in the window: the chunk
    written is the chunk listed. Catches: the older message kept in the window while its range stayed
    listed and the newer one's chunk was written (a read of the index finds the wrong chunk)."""
    index, _ = full_index(room=40)
    first = index.window_first_sequence
    limits = MessageLayoutLimits(window_size=2, chunk_size=2, chunk_max_bytes=2048)
    writes = plan_append([], index, [message(first, 3000), message(first + 1, 3000)], limits)
    assert writes.index is not None
    assert [c.messages[0].sequence for c in writes.chunk_sets] == [first]
    assert writes.index.chunks[len(index.chunks):] == [AgentMessageChunkRange(first, first)]
    assert [m.sequence for m in writes.window_sets] == [first + 1]


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
async def test_a_session_whose_index_is_full_goes_on(
    tmp_path: Path, backend: str, request: pytest.FixtureRequest,
) -> None:
    """A session of about 22,700 chunks, its AgentMessageIndex a range short of the engine's value
    limit, runs its turns: the first fills the index and keeps the rest of its messages in the
    window, as the second does; no turn fails, the model sees every message in order, and the pages read them all back.
    Catches: from the turn whose rollover passed the limit on, RunModel's commit failed on each
    attempt (the model called each time) with the engine's ValueTooLargeError for AgentMessageIndex,
    and every turn failed; when RecordTurnFailure's note rolled the window over too, that Step
    retried without end and the session hung in running_model."""
    url = request.getfixturevalue("pg_database") if backend == "postgres" else None
    flow, model = storage_flow("FullIndexAgent", message_window_size=4, message_chunk_size=2)
    engine = InProcessEngine(tmp_path, [flow], url=url)
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s")
        await turn_done(sessions, "s", 0)
        index, chunks = full_index(room=120)
        total = await fabricate(engine, "s", index, chunks)
        for number in range(1, 3):
            snapshot = await run_turn(sessions, "s", number, f"turn {number}")
            assert snapshot.state is not None and snapshot.state.last_turn_error is None
        per_turn = 1 + 2 + 2 * LOOKUPS_PER_TURN + 2
        assert snapshot.state.next_message_sequence == total + 2 * per_turn + 1
        layout = await stored_layout(engine, "s")
        assert layout.index is not None and len(layout.index.chunks) > len(index.chunks)
        assert len(msgspec.json.encode(layout.index)) <= MAX_VALUE_BYTES
        assert len(layout.window) > 4
        newest = await all_pages_from(sessions, "s", total - 10)
        assert [m.sequence for m in newest] == list(range(total - 9, total + 2 * per_turn + 1))
        assert list(model.requests[-1].input)[-(2 * per_turn - 2):] == [input_item(m) for m in newest[10:-2]]
        assert len(model.requests[-1].input) == total + 2 * per_turn - 2


async def all_pages_from(sessions: AgentSessionClient, sid: str, after: int) -> list[AgentMessage]:
    """The stored messages after sequence `after`, paging back from the newest 7 at a time."""
    pages: list[list[AgentMessage]] = []
    cursor: int | None = None
    while cursor is None or cursor > after + 1:
        page = await sessions.list_agent_messages(sid, before_sequence=cursor, limit=7)
        pages.append([m for m in page.messages if m.sequence > after])
        assert page.next_before_sequence is not None
        cursor = page.next_before_sequence
    return [m for page in reversed(pages) for m in page]
