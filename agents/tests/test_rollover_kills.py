"""Message rollover, compaction and retention with two Worker processes, a SIGKILL inside the Steps
that roll the window over (RunModel's model call, whose commit stores and rolls over) and compact
(CompactContext's summary call, whose commit deletes summarized chunks), while user messages keep
arriving and a reader pages through the transcript; on a private SQLite file and on a PostgreSQL
database (TEST_PG_DSN). test_compaction.py kills CompactContext on SQLite with one Worker.

The agent (agents/tests/rollover_agent.py) rolls its window over on nearly every commit that stores
messages, compacts and deletes summarized chunks. Every snapshot and page read meanwhile must be a
consistent whole; afterwards paging back from the newest message ends exactly at the first kept one,
in order, each sequence once, the snapshot is its newest part, the index names exactly the stored
chunks, every user message is stored once in the order sent (retention deleting a prefix), and only
the killed model call ran twice.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from agents.tests.compaction_agent import say
from agents.tests.conftest import REPO_ROOT
from agents.tests.rollover_agent import rollover_flow
from engine.tests.conftest import pg_database, pg_databases  # noqa: F401 - the fixtures these tests use

from dex_agents import (
    AGENT_MESSAGE_CHUNKS,
    AGENT_MESSAGE_INDEX,
    AgentMessage,
    AgentSessionClient,
    AgentSessionFlow,
    AgentSnapshot,
    AgentStatus,
    MessageRole,
)
from dex_agents._persistence import message_sequence_key
from dex_agents.testing import AgentTestStack, FileGate, InvocationLog, WorkerProcess, wait_for_agent_snapshot

pytestmark = pytest.mark.slow

WORKER = "agents.tests.rollover_agent"


@pytest.fixture(params=["sqlite", "postgres"])
async def stack(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[AgentTestStack]:
    url = request.getfixturevalue("pg_database") if request.param == "postgres" else None
    async with AgentTestStack(tmp_path, [rollover_flow(tmp_path)], WORKER, worker_cwd=REPO_ROOT,
                              database_url=url) as stack:
        yield stack


def _consecutive(sequences: list[int]) -> bool:
    return sequences == list(range(sequences[0], sequences[0] + len(sequences))) if sequences else True


async def _transcript(sessions: AgentSessionClient, sid: str, limit: int) -> tuple[list[AgentMessage], int | None]:
    """Every stored message, paging back from the newest; and the pages' deleted_before_sequence."""
    pages: list[list[AgentMessage]] = []
    cursor: int | None = None
    deleted: set[int | None] = set()
    while True:
        page = await sessions.list_agent_messages(sid, before_sequence=cursor, limit=limit)
        deleted.add(page.deleted_before_sequence)
        assert len(page.messages) <= limit
        pages.append(page.messages)
        if page.next_before_sequence is None:
            break
        assert page.next_before_sequence == page.messages[0].sequence
        cursor = page.next_before_sequence
    assert len(deleted) == 1, deleted
    return [m for page in reversed(pages) for m in page], deleted.pop()


async def _read_until_cancelled(sessions: AgentSessionClient, sid: str, problems: list[str]) -> None:
    """Snapshots and pages read back to back while Steps roll over and compact: each a whole."""
    while True:
        snapshot = await sessions.get_agent_snapshot(sid)
        sequences = [m.sequence for m in snapshot.messages]
        if snapshot.state is not None and sequences and (
                not _consecutive(sequences) or sequences[-1] != snapshot.state.next_message_sequence - 1):
            problems.append(f"snapshot {sequences}, next {snapshot.state.next_message_sequence}")
        cursor: int | None = None
        while True:
            page = await sessions.list_agent_messages(sid, before_sequence=cursor, limit=3)
            sequences = [m.sequence for m in page.messages]
            if not _consecutive(sequences) or (cursor is not None and sequences and sequences[-1] != cursor - 1):
                problems.append(f"page before {cursor}: {sequences}")
            if page.next_before_sequence is None:
                break
            cursor = page.next_before_sequence


def _handled(texts: list[str]) -> Callable[[AgentSnapshot], AgentSnapshot | None]:
    def probe(s: AgentSnapshot) -> AgentSnapshot | None:
        idle = (s.state is not None and s.state.status is AgentStatus.WAITING_FOR_USER_MESSAGE
                and s.queued_message_count == 0)
        users = [m.text for m in s.messages if m.role is MessageRole.USER]
        return s if idle and users and users[-1] == texts[-1] else None
    return probe


async def _kill_at(gate: FileGate, workers: list[WorkerProcess]) -> None:
    """SIGKILL the Worker waiting at `gate`, then open the gate for the retry in the other one."""
    held_by = await gate.wait_until_reached()
    killed = next(w for w in workers if w.pid == held_by)
    killed.kill()
    workers.remove(killed)
    gate.release()


async def test_rollover_and_compaction_survive_kills_with_two_workers(stack: AgentTestStack) -> None:
    flow = stack.flows[0]
    assert isinstance(flow, AgentSessionFlow)
    sessions = stack.sessions(flow)
    workers = [await stack.start_worker(), await stack.start_worker()]
    await sessions.start_session("s")
    problems: list[str] = []
    reader = asyncio.create_task(_read_until_cancelled(sessions, "s", problems))
    texts: list[str] = []

    async def send(text: str) -> None:
        texts.append(text)
        assert await sessions.send_user_message("s", text)

    summary_gate = FileGate(stack.state_dir, "summary")
    while not summary_gate.reached:  # messages arrive while turns run: some queue, some start turns
        assert len(texts) < 200, "never compacted"
        await send(say(len(texts) + 1))
        await asyncio.sleep(0.05)
    await summary_gate.wait_until_reached()
    for _ in range(3):  # queued while CompactContext's summary call runs
        await send(say(len(texts) + 1))
    await _kill_at(summary_gate, workers)
    workers.append(await stack.start_worker())

    await send("/gate one")
    for _ in range(3):
        await send(say(len(texts) + 1))
    await _kill_at(FileGate(stack.state_dir, "model"), workers)
    for _ in range(4):
        await send(say(len(texts) + 1))

    final = await wait_for_agent_snapshot(sessions, "s", _handled(texts), description="every message handled",
                                          timeout=120)
    reader.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await reader
    assert not problems, problems[:10]
    assert final.state is not None and final.state.last_turn_error is None, final.state
    assert final.context_summary is not None
    newest = final.state.next_message_sequence - 1

    for limit in (1, 3, 200):
        stored, deleted_before = await _transcript(sessions, "s", limit)
        first = stored[0].sequence
        assert deleted_before == first > 1  # retention deleted the summarized chunks before it
        assert [m.sequence for m in stored] == list(range(first, newest + 1)), limit
    assert final.messages == stored[-200:]
    users = [m.text for m in stored if m.role is MessageRole.USER]
    assert users == texts[len(texts) - len(users):], (users, texts)

    index = await stack.client.get_attribute("s", AGENT_MESSAGE_INDEX)
    chunks = await stack.client.get_attribute_map("s", AGENT_MESSAGE_CHUNKS)
    assert index is not None and index.first_sequence == stored[0].sequence
    assert sorted(chunks) == sorted(message_sequence_key(r.first_sequence) for r in index.chunks)
    for chunk_range in index.chunks:
        held = [m.sequence for m in chunks[message_sequence_key(chunk_range.first_sequence)].messages]
        assert held == list(range(chunk_range.first_sequence, chunk_range.last_sequence + 1))

    log = InvocationLog(stack.state_dir / "invocations.log")
    assert log.count("summary") >= 2  # the killed one and its retry, then later compactions
    # One model call a turn (a turn takes every message queued when it starts), each once but the
    # killed one, whose retry was the same call: the turn after the summary kill called it once.
    model_texts = [e["text"] for e in log.entries("model")]
    assert model_texts.count("/gate one") == 2
    assert len(set(model_texts)) == len(model_texts) - 1
    assert model_texts[-1] == texts[-1]
