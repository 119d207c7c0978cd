"""ChunkMessagesMemo: a model call of a long session reuses the chunk messages its previous call
assembled only when it reads the very same chunk objects under the same ranges, and answers exactly
as chunk_messages does otherwise, errors included."""

from __future__ import annotations

import msgspec
import pytest

from dex_agents import _chunk_memo
from dex_agents._chunk_memo import ChunkMessagesMemo
from dex_agents._message_store import ChunkReader, MessageStoreCorruptError, chunk_messages, message_chars
from dex_agents._wire import AgentMessage, AgentMessageChunk, AgentMessageChunkRange, MessageRole


def message(sequence: int) -> AgentMessage:
    return AgentMessage(
        sequence=sequence, turn_id="t", role=MessageRole.USER, text=f"m{sequence}", tool_call_id=None,
        tool_name=None, tool_arguments=None, tool_output=None, framework_item="{}",
        created_at="2026-12-02T00:00:00.000Z",
    )


def chunk(first: int, last: int) -> AgentMessageChunk:
    return AgentMessageChunk(tuple(message(s) for s in range(first, last + 1)))


RANGES = [AgentMessageChunkRange(1, 3), AgentMessageChunkRange(4, 5)]


class Stored:
    """Chunks by first sequence, as the engine hands them out (the same object on every read)."""

    def __init__(self, *chunks: AgentMessageChunk) -> None:
        self.chunks = {c.messages[0].sequence: c for c in chunks}
        self.reads: list[int] = []

    def read(self, r: AgentMessageChunkRange) -> AgentMessageChunk | None:
        self.reads.append(r.first_sequence)
        return self.chunks.get(r.first_sequence)


@pytest.fixture
def assembled(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many times the memo assembled messages itself (a miss)."""
    calls: list[int] = []

    def counting(ranges: list[AgentMessageChunkRange], read_chunk: ChunkReader) -> list[AgentMessage]:
        calls.append(len(ranges))
        return chunk_messages(ranges, read_chunk)

    monkeypatch.setattr(_chunk_memo, "chunk_messages", counting)
    return calls


def test_the_same_chunk_objects_are_assembled_once(assembled: list[int]) -> None:
    stored = Stored(chunk(1, 3), chunk(4, 5))
    read = ChunkMessagesMemo().reader("s1")
    first = read(RANGES, stored.read)
    assert [m.sequence for m in first] == [1, 2, 3, 4, 5]
    first.append(message(6))  # all_messages extends what it gets: that must not reach the memo
    again = read(RANGES, stored.read)
    assert again == chunk_messages(RANGES, stored.read) and [m.sequence for m in again] == [1, 2, 3, 4, 5]
    assert assembled == [2]
    # Every chunk is still read (newest first) on a hit: the identities are what is compared.
    assert stored.reads[:4] == [4, 1, 4, 1]


def test_an_equal_but_new_chunk_object_or_other_ranges_assemble_again(assembled: list[int]) -> None:
    stored = Stored(chunk(1, 3), chunk(4, 5))
    read = ChunkMessagesMemo().reader("s1")
    read(RANGES, stored.read)
    stored.chunks[4] = chunk(4, 5)  # the decoded cache let the old one go: an equal, new object
    assert [m.sequence for m in read(RANGES, stored.read)] == [1, 2, 3, 4, 5]
    stored.chunks[6] = chunk(6, 7)  # a rollover wrote a chunk
    grown = [*RANGES, AgentMessageChunkRange(6, 7)]
    assert [m.sequence for m in read(grown, stored.read)] == [1, 2, 3, 4, 5, 6, 7]
    assert assembled == [2, 2, 3]


def test_the_kept_chunk_objects_under_other_ranges_fail_as_chunk_messages_fails(assembled: list[int]) -> None:
    """The very chunk objects a session's last call read, now listed under other ranges (an index that
    contradicts its chunks), are checked again: the memo fails as chunk_messages does instead of
    answering the kept messages. Catches: a hit decided by the chunk identities alone."""
    stored = Stored(chunk(1, 3), chunk(4, 5))
    read = ChunkMessagesMemo().reader("s1")
    read(RANGES, stored.read)
    other = [AgentMessageChunkRange(1, 3), AgentMessageChunkRange(4, 6)]
    with pytest.raises(MessageStoreCorruptError, match=r"holds 4\.\.5 \(2 messages\), but .* lists 4\.\.6"):
        read(other, stored.read)
    assert assembled == [2, 2]


def test_a_sessions_new_messages_replace_its_old_ones_in_the_bound(assembled: list[int]) -> None:
    """A session's new entry replaces its old one in the message count: a session whose chunks grow
    within the bound stays kept. Catches: the replaced entry's messages still counted, so a long
    session pushed itself out after a few rollovers and every model call assembled its chunks again."""
    memo = ChunkMessagesMemo(sessions=10, messages=8)
    stored = Stored(chunk(1, 3), chunk(4, 5), chunk(6, 7))
    read = memo.reader("s1")
    read(RANGES, stored.read)  # 5 messages
    grown = [*RANGES, AgentMessageChunkRange(6, 7)]
    read(grown, stored.read)  # 7 messages instead of the 5: within 8
    assert len(memo) == 1
    read(grown, stored.read)  # a hit
    assert assembled == [2, 3]


def test_sessions_are_kept_apart(assembled: list[int]) -> None:
    memo = ChunkMessagesMemo()
    mine, other = Stored(chunk(1, 3), chunk(4, 5)), Stored(chunk(1, 3), chunk(4, 5))
    memo.reader("s1")(RANGES, mine.read)
    assert memo.reader("s2")(RANGES, other.read) == chunk_messages(RANGES, other.read)
    memo.reader("s1")(RANGES, mine.read)
    assert assembled == [2, 2]


def test_a_bad_chunk_fails_as_chunk_messages_fails_and_is_not_kept(assembled: list[int]) -> None:
    read = ChunkMessagesMemo().reader("s1")
    missing = Stored(chunk(1, 3))
    with pytest.raises(MessageStoreCorruptError, match=r"AgentMessageChunks\[000000000004\] is missing"):
        read(RANGES, missing.read)
    wrong = Stored(chunk(1, 3), chunk(4, 6))
    with pytest.raises(MessageStoreCorruptError, match=r"holds 4\.\.6 \(3 messages\), but .* lists 4\.\.5"):
        read(RANGES, wrong.read)
    with pytest.raises(MessageStoreCorruptError):
        read(RANGES, wrong.read)  # checked again, not answered from a kept result
    assert assembled == [2, 2, 2]


def test_the_oldest_sessions_go_past_either_bound(assembled: list[int]) -> None:
    by_sessions = ChunkMessagesMemo(sessions=2, messages=1000)
    stores = {s: Stored(chunk(1, 3), chunk(4, 5)) for s in ("a", "b", "c")}
    for s in ("a", "b", "a", "c"):  # "b" is the least recently used when "c" comes
        by_sessions.reader(s)(RANGES, stores[s].read)
    assert len(by_sessions) == 2
    by_sessions.reader("a")(RANGES, stores["a"].read)
    by_sessions.reader("b")(RANGES, stores["b"].read)
    assert assembled == [2, 2, 2, 2]  # a, b, c, then b again; a was kept

    by_messages = ChunkMessagesMemo(sessions=10, messages=8)  # room for one session of 5 messages
    by_messages.reader("a")(RANGES, stores["a"].read)
    by_messages.reader("b")(RANGES, stores["b"].read)
    assert len(by_messages) == 1


def big_chunk(first: int, last: int, output_chars: int) -> AgentMessageChunk:
    return AgentMessageChunk(tuple(msgspec.structs.replace(message(s), tool_output="x" * output_chars)
                                   for s in range(first, last + 1)))


def test_the_oldest_sessions_go_past_the_character_bound(assembled: list[int]) -> None:
    """Bounded by sessions and messages alone, the memo kept 65,536 messages however large: with
    tool outputs of 100 kB, gigabytes the engine's byte-bounded caches had let go. Here room for two
    sessions of 5 messages of 10,000 characters each, not three."""
    memo = ChunkMessagesMemo(sessions=10, messages=1000, chars=120_000)
    stores = {s: Stored(big_chunk(1, 3, 10_000), big_chunk(4, 5, 10_000)) for s in ("a", "b", "c")}
    for s in ("a", "b", "c"):
        assert len(memo.reader(s)(RANGES, stores[s].read)) == 5
    kept = [m for k in memo._kept.values() for m in k.messages]
    assert len(memo) == 2 and sum(map(message_chars, kept)) <= 120_000
    memo.reader("a")(RANGES, stores["a"].read)  # the oldest went: assembled again
    memo.reader("c")(RANGES, stores["c"].read)  # the newest stayed: a hit
    assert assembled == [2, 2, 2, 2]


def test_a_sessions_new_messages_replace_its_old_ones_in_the_character_bound(assembled: list[int]) -> None:
    """As with the message count, a session's new entry replaces its old one's characters: a session
    growing within the character bound stays kept. Catches: the replaced entry's characters still
    counted, so a session with large tool outputs pushed itself out and assembled every call again."""
    memo = ChunkMessagesMemo(sessions=10, messages=1000, chars=80_000)
    stored = Stored(big_chunk(1, 3, 10_000), big_chunk(4, 5, 10_000), big_chunk(6, 7, 10_000))
    read = memo.reader("s1")
    read(RANGES, stored.read)  # 5 messages of over 10,000 characters each
    grown = [*RANGES, AgentMessageChunkRange(6, 7)]
    read(grown, stored.read)  # 7 of them instead of the 5: within 80,000
    assert len(memo) == 1
    read(grown, stored.read)  # a hit
    assert assembled == [2, 3]
