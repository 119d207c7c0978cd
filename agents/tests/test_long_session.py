"""Long sessions with compaction and retention keep Flow state bounded (seed 003 "Message storage and
retention" and "Testing an adapter": the 800-turn guard, and the 2,000-turn session behind the storage
numbers, which runs only with DEX_AGENTS_LONG_TESTS=1, as .ci/run sets it).

The session runs the built-in loop with a trivial scripted model on an in-process Worker, with a
1,000-token context window and retained_message_limit=100. The stored bytes are the sum of the
session's Attribute and AttributeMap instance values in the engine's SQLite file; the test prints
them at checkpoints and asserts boundedness structurally (no timing is asserted): the bytes at the end
stay within a constant factor of the bytes at an early checkpoint, the stored message count stays
under the retention bound, and the index lists exactly the stored chunks. It also prints the median
per-turn latency of early and late turns, which should stay flat because RunModel loads only the
messages after the summary.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

from dex_agents import (
    AGENT_MESSAGE_CHUNKS,
    AGENT_MESSAGE_INDEX,
    AGENT_MESSAGES,
    AGENT_STATE,
    CONTEXT_SUMMARY,
    QUEUED_USER_MESSAGES,
    AgentSessionClient,
    AgentSessionFlow,
    AgentUserMessage,
    CompactionPolicy,
)
from dex_agents._persistence import message_sequence_key
from dex_agents.builtin_loop import (
    AgentDefinition,
    BuiltinLoopAgentRunner,
    ModelRequest,
    ScriptedModelClient,
    ScriptedModelReply,
    builtin_agent_session_options,
)
from dex_agents.testing import wait_until
from dex_engine import AsyncClient, AsyncWorker, Registry, WorkerOptions

LONG_TESTS_ENV = "DEX_AGENTS_LONG_TESTS"
CONTEXT_WINDOW_TOKENS = 1_000
RETAINED_MESSAGE_LIMIT = 100
# A smaller window and chunks than the defaults (64, 32): each Step that stores messages loads the
# whole window, so this keeps the 800 turns fast; retention then deletes in smaller steps.
MESSAGE_WINDOW_SIZE = 16
MESSAGE_CHUNK_SIZE = 8
# Messages the client keeps queued ahead of the session, so the Worker never waits for the client.
PIPELINE_DEPTH = 2
# Stored bytes may grow after an early checkpoint only while the window, the chunks and the summary
# fill up to their steady size; a session that keeps every message grows with the turn count.
BOUNDED_GROWTH_FACTOR = 1.5


@dataclass
class LongSession:
    """A built-in loop session on its own engine file, and when each turn's model call ran."""

    flow: AgentSessionFlow
    client: AsyncClient
    worker: AsyncWorker
    url: str
    turn_started: dict[int, float] = field(default_factory=dict)

    @property
    def sessions(self) -> AgentSessionClient:
        return AgentSessionClient(self.client, self.flow)


def turn_number(request: ModelRequest) -> int:
    return int(ScriptedModelClient.user_texts(request)[-1].split()[1])


@contextlib.asynccontextmanager
async def long_session(tmp_path: Path) -> AsyncIterator[LongSession]:
    """The 800-turn session's engine: an in-process Worker on a SQLite file. synchronous=NORMAL skips the
    fsync of each commit, which on a shared CI disk costs more than the whole Step; it changes what a
    power loss may lose, not what is stored."""
    started: dict[int, float] = {}

    def respond(request: ModelRequest) -> ScriptedModelReply:
        started.setdefault(turn_number(request), time.monotonic())
        return ScriptedModelReply(text=f"ok, noted turn {turn_number(request)}")

    model = ScriptedModelClient(respond, max_recorded_requests=0)
    definition = AgentDefinition(name="long-session", model=model, instructions="You are a long-running test agent.",
                                 compaction=CompactionPolicy(context_window_tokens=CONTEXT_WINDOW_TOKENS))
    options = replace(builtin_agent_session_options(definition), retained_message_limit=RETAINED_MESSAGE_LIMIT,
                      message_window_size=MESSAGE_WINDOW_SIZE, message_chunk_size=MESSAGE_CHUNK_SIZE)
    flow = AgentSessionFlow(BuiltinLoopAgentRunner(definition), "LongSessionAgent", options)
    url = f"sqlite:///{tmp_path / 'long-session.db'}?synchronous=NORMAL"
    registry = Registry([flow])
    client = AsyncClient(registry, url)
    worker = AsyncWorker(registry, WorkerOptions(database_url=url, poll_seconds=0.01, housekeeping_seconds=0.05))
    task = asyncio.create_task(worker.run())
    try:
        yield LongSession(flow, client, worker, url, started)
    finally:
        await worker.stop()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await client.close()


@dataclass(frozen=True)
class StoredState:
    turn: int
    stored_bytes: int  # every Attribute and AttributeMap instance value of the session
    attribute_count: int
    message_count: int
    chunk_count: int
    first_sequence: int
    summary_generation: int


async def stored_state(session: LongSession, sid: str, turn: int) -> StoredState:
    """What the session stores, read straight from the engine's SQLite file."""
    client = session.client
    values = await client.store.read_all_attributes(sid)
    index = await client.get_attribute(sid, AGENT_MESSAGE_INDEX)
    window = await client.get_attribute_map(sid, AGENT_MESSAGES)
    chunks = await client.get_attribute_map(sid, AGENT_MESSAGE_CHUNKS)
    summary = await client.get_attribute(sid, CONTEXT_SUMMARY)
    assert index is not None and summary is not None
    # The index lists exactly the stored chunks: retention deleted whole chunks and nothing else.
    assert sorted(chunks) == [message_sequence_key(r.first_sequence) for r in index.chunks]
    return StoredState(
        turn=turn, stored_bytes=sum(len(value) for value in values.values()), attribute_count=len(values),
        message_count=len(window) + sum(len(c.messages) for c in chunks.values()), chunk_count=len(chunks),
        first_sequence=index.first_sequence, summary_generation=summary.generation,
    )


async def run_long_session(tmp_path: Path, turns: int, checkpoints: tuple[int, ...]) -> list[StoredState]:
    """Run `turns` one-line turns; return the stored state at each checkpoint (printed as it goes)."""
    sid = "long-session"
    states: list[StoredState] = []
    async with long_session(tmp_path) as session:
        await session.sessions.start_session(sid)
        sent = 0
        done = 0
        began = time.monotonic()
        for checkpoint in checkpoints:
            while done < checkpoint:
                while sent < checkpoint and sent - done < PIPELINE_DEPTH:
                    sent += 1
                    await session.client.publish(sid, QUEUED_USER_MESSAGES, AgentUserMessage(f"turn {sent} hello"))

                async def advanced(seen: int = done) -> int:
                    state = await session.client.get_attribute(sid, AGENT_STATE)
                    assert state is None or state.last_turn_error is None, state
                    count = 0 if state is None else state.turn_count
                    return count if count > seen else 0

                done = await wait_until(f"turn {done + 1} of {sid} to end", advanced, interval=0.01)
            # Nothing more is queued: the session waits after exactly `checkpoint` turns.
            state = await stored_state(session, sid, checkpoint)
            states.append(state)
            print(f"turn {checkpoint}: {state.stored_bytes} stored bytes in {state.attribute_count} values; "
                  f"{state.message_count} messages in {state.chunk_count} chunks and the window, oldest "
                  f"{state.first_sequence}; summary generation {state.summary_generation}; "
                  f"{time.monotonic() - began:.1f} s")
        print_latency(session.turn_started, turns)
    return states


def print_latency(started: dict[int, float], turns: int) -> None:
    """Median time between consecutive turns' model calls, early against late (printed, never asserted)."""
    gaps = {n: started[n] - started[n - 1] for n in range(2, turns + 1) if n in started and n - 1 in started}
    span = min(100, turns // 4)
    early = [gaps[n] for n in range(2, span + 2) if n in gaps]
    late = [gaps[n] for n in range(turns - span + 1, turns + 1) if n in gaps]
    print(f"per-turn latency: turns 2-{span + 1} median {statistics.median(early) * 1000:.1f} ms, "
          f"turns {turns - span + 1}-{turns} median {statistics.median(late) * 1000:.1f} ms")


def check_bounded(states: list[StoredState], early: int, late: int) -> None:
    by_turn = {s.turn: s for s in states}
    # Compaction ran all along, and retention deleted summarized chunks.
    assert by_turn[late].summary_generation > by_turn[early].summary_generation >= 1
    assert by_turn[late].first_sequence > by_turn[early].first_sequence > 1
    for state in states:
        # Retained: at most the limit plus a window and a chunk; never anything like 2 messages a turn.
        assert state.message_count <= RETAINED_MESSAGE_LIMIT + MESSAGE_WINDOW_SIZE + MESSAGE_CHUNK_SIZE, state
    assert by_turn[late].stored_bytes <= BOUNDED_GROWTH_FACTOR * by_turn[early].stored_bytes, (
        by_turn[early], by_turn[late])
    assert by_turn[late].attribute_count <= by_turn[early].attribute_count + 8, (by_turn[early], by_turn[late])


async def test_800_turn_session_stays_bounded(tmp_path: Path) -> None:
    """The CI guard: 800 turns with compaction and retained_message_limit=100. The stored bytes at turn
    800 stay within 1.5x of those at turn 400 (a session that kept its messages would double), the
    stored messages stay under the retention bound, compaction and retention ran throughout, and the
    index lists exactly the stored chunks."""
    states = await run_long_session(tmp_path, 800, (100, 400, 800))
    check_bounded(states, early=400, late=800)


@pytest.mark.skipif(os.environ.get(LONG_TESTS_ENV) != "1",
                    reason=f"the 2,000-turn session takes about 15 s more; set {LONG_TESTS_ENV}=1 to run it")
async def test_2000_turn_session_stays_bounded(tmp_path: Path) -> None:
    """The long version: 2,000 turns; the stored bytes at turn 2,000 stay within 1.5x of turn 500's."""
    states = await run_long_session(tmp_path, 2000, (100, 500, 1000, 2000))
    check_bounded(states, early=500, late=2000)
