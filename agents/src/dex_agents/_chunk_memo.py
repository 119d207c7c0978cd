"""The messages of each session's chunks as its last model call assembled them, kept per process."""

from __future__ import annotations

import operator
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from ._constants import CHUNK_MEMO_CHARS, CHUNK_MEMO_MESSAGES, CHUNK_MEMO_SESSIONS
from ._message_store import ChunkMessages, ChunkReader, chunk_messages, message_chars
from ._wire import AgentMessage, AgentMessageChunk, AgentMessageChunkRange


@dataclass(frozen=True)
class _Kept:
    ranges: tuple[AgentMessageChunkRange, ...]
    chunks: tuple[AgentMessageChunk | None, ...]  # held, so that no other object can take their identities
    messages: tuple[AgentMessage, ...]
    chars: int  # the messages' message_chars


class ChunkMessagesMemo:
    """chunk_messages for model calls, remembered per session.

    A chunk never changes once written, and the engine hands every reader of a stored chunk the same
    decoded object while its decoded cache holds it. So when the chunks a model call reads are, one
    for one and under the same ranges, the objects the session's previous call read, their messages
    are the ones assembled then; otherwise they are assembled, and checked, again. A long session's
    model call would otherwise check and copy every chunk of it, every time.
    """

    def __init__(self, sessions: int = CHUNK_MEMO_SESSIONS, messages: int = CHUNK_MEMO_MESSAGES,
                 chars: int = CHUNK_MEMO_CHARS) -> None:
        self._sessions = sessions
        self._messages = messages
        self._chars = chars
        self._held = 0  # messages kept, over all sessions
        # Their characters: bounded by messages alone, sessions with large tool outputs kept
        # gigabytes alive that the engine's byte-bounded caches had let go.
        self._held_chars = 0
        self._kept: OrderedDict[str, _Kept] = OrderedDict()
        self._lock = threading.Lock()  # model calls of one flow type may run on several threads

    def reader(self, flow_id: str) -> ChunkMessages:
        """all_messages' `read_chunks` for one session."""

        def read_chunks(ranges: Sequence[AgentMessageChunkRange], read_chunk: ChunkReader) -> list[AgentMessage]:
            # Read newest first, as chunk_messages reads them: the same first failure, if any.
            chunks = tuple(reversed([read_chunk(r) for r in reversed(ranges)]))
            with self._lock:
                kept = self._kept.get(flow_id)
                if kept is not None:
                    self._kept.move_to_end(flow_id)
            if (
                kept is not None and len(kept.chunks) == len(chunks) and all(map(operator.is_, kept.chunks, chunks))
                and kept.ranges == tuple(ranges)
            ):
                return list(kept.messages)
            by_range = dict(zip(ranges, chunks, strict=True))
            messages = chunk_messages(ranges, by_range.__getitem__)
            self._keep(flow_id, _Kept(tuple(ranges), chunks, tuple(messages), sum(map(message_chars, messages))))
            return messages

        return read_chunks

    def _keep(self, flow_id: str, kept: _Kept) -> None:
        with self._lock:
            old = self._kept.pop(flow_id, None)
            if old is not None:
                self._held -= len(old.messages)
                self._held_chars -= old.chars
            self._kept[flow_id] = kept
            self._held += len(kept.messages)
            self._held_chars += kept.chars
            while self._kept and (len(self._kept) > self._sessions or self._held > self._messages
                                  or self._held_chars > self._chars):
                _, gone = self._kept.popitem(last=False)
                self._held -= len(gone.messages)
                self._held_chars -= gone.chars

    def __len__(self) -> int:
        return len(self._kept)
