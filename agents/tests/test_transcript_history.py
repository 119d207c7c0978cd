"""Acknowledged messages are never lost, duplicated or reordered across Worker kills (RELIABILITY.md
T17, committed_messages_readable: a Jepsen-lite history check on agent sessions).

Four clients, each with its own engine client, send messages to six sessions and read snapshots
of random sessions, while the Worker child is SIGKILLed at random instants (a seeded schedule,
printed on failure) and replaced by standbys. The history of every call is recorded with a
logical clock, then checked:

- every send is acknowledged, and each acknowledged message is stored exactly once, in the order
  its client sent it, and answered by its turn;
- read-your-writes: a snapshot that starts after a send was acknowledged shows the message,
  queued or stored;
- monotonic transcripts: a snapshot's stored messages are a prefix of those of every snapshot of
  the same session that starts after it ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from agents.tests.conftest import REPO_ROOT, WORKER_MODULE
from agents.tests.scripted_agent import build_flow
from agents.tests.standby_workers import SharedStack
from engine.tests.conftest import db_url, pg_database, pg_databases  # noqa: F401 - the fixtures used here

from dex_agents import AgentSessionClient, AgentSessionFlow, AgentSnapshot, MessageRole
from dex_agents.testing import AgentTestStack, wait_for_agent_snapshot
from dex_engine import AsyncClient, Registry

pytestmark = pytest.mark.slow

SEED = 20261130
SESSIONS = 6
CLIENTS = 4
SENDS_PER_CLIENT = 12
KILLS = 3
KILL_AFTER_SECONDS = (0.4, 1.2)  # between a Worker's registration and its kill
PAUSE_SECONDS = (0.0, 0.06)  # a client's pause between calls
SETTLE_SECONDS = 120.0

Stored = tuple[tuple[int, str, str], ...]  # (sequence, role, text) of every stored message


@dataclass(frozen=True)
class Ack:
    client: int
    session_id: str
    text: str
    ok: bool
    end: int  # the clock when send_user_message returned


@dataclass(frozen=True)
class Read:
    client: int
    session_id: str
    start: int
    end: int
    stored: Stored
    queued: tuple[str, ...]


class History:
    """Every call's outcome, on a logical clock that ticks at each call's start and end."""

    def __init__(self) -> None:
        self.clock = 0
        self.acks: list[Ack] = []
        self.reads: list[Read] = []

    def tick(self) -> int:
        self.clock += 1
        return self.clock


def _stored(snapshot: AgentSnapshot) -> Stored:
    return tuple((m.sequence, m.role.value, m.text or "") for m in snapshot.messages)


async def _client_calls(
    number: int, sessions: AgentSessionClient, session_ids: list[str], plan: list[tuple[str, str, float]],
    history: History,
) -> None:
    """Send each planned message, reading a random session's snapshot after each send."""
    for index, (target, read_target, pause) in enumerate(plan):
        text = f"c{number}-m{index}"
        ok = await sessions.send_user_message(target, text)
        history.acks.append(Ack(number, target, text, ok, history.tick()))
        start = history.tick()
        snapshot = await sessions.get_agent_snapshot(read_target)
        history.reads.append(Read(number, read_target, start, history.tick(), _stored(snapshot),
                                  tuple(p.message.text for p in snapshot.queued_messages)))
        await asyncio.sleep(pause)


@contextlib.asynccontextmanager
async def _extra_clients(flow: AgentSessionFlow, url: str, count: int) -> AsyncIterator[list[AgentSessionClient]]:
    clients = [AsyncClient(Registry([flow]), url) for _ in range(count)]
    try:
        yield [AgentSessionClient(client, flow) for client in clients]
    finally:
        for client in clients:
            await client.close()


async def test_acknowledged_messages_survive_kills_in_order_and_reads_are_monotonic(
    tmp_path: Path, db_url: str,  # noqa: F811
) -> None:
    rng = random.Random(SEED)
    session_ids = [f"history-{n}" for n in range(SESSIONS)]
    plans = [[(rng.choice(session_ids), rng.choice(session_ids), round(rng.uniform(*PAUSE_SECONDS), 3))
              for _ in range(SENDS_PER_CLIENT)] for _ in range(CLIENTS)]
    kill_gaps = [round(rng.uniform(*KILL_AFTER_SECONDS), 3) for _ in range(KILLS)]
    context = f"seed {SEED}, kills {kill_gaps} s after each Worker began"
    flow = build_flow(tmp_path)
    history = History()
    async with AgentTestStack(tmp_path, [flow], WORKER_MODULE, worker_cwd=REPO_ROOT, database_url=db_url) as stack, \
            _extra_clients(flow, stack.database_url, CLIENTS - 1) as others:
        shared = SharedStack(stack, standbys=2)
        clients = [stack.sessions(flow), *others]
        worker = await shared.worker()
        for session_id in session_ids:
            await clients[0].start_session(session_id)
        calls = [asyncio.create_task(_client_calls(n, clients[n], session_ids, plans[n], history))
                 for n in range(CLIENTS)]
        for gap in kill_gaps:
            await asyncio.sleep(gap)
            worker.kill()
            worker = await shared.start_new_worker()
        await asyncio.wait_for(asyncio.gather(*calls), SETTLE_SECONDS)

        finals: dict[str, AgentSnapshot] = {}
        for session_id in session_ids:
            expected = sum(1 for a in history.acks if a.session_id == session_id)

            def settled(s: AgentSnapshot, expected: int = expected) -> AgentSnapshot | None:
                users = [m for m in s.messages if m.role is MessageRole.USER]
                idle = s.state is not None and s.state.active_turn_id is None and not s.queued_messages
                return s if idle and len(users) >= expected else None

            finals[session_id] = await wait_for_agent_snapshot(
                clients[0], session_id, settled, description=f"{session_id} to answer every message",
                timeout=SETTLE_SECONDS)

    assert all(a.ok for a in history.acks), (context, [a for a in history.acks if not a.ok])
    for session_id, final in finals.items():
        assert final.state is not None and final.state.last_turn_error is None, (context, final.state)
        users = [m.text for m in final.messages if m.role is MessageRole.USER]
        acked = [a.text for a in history.acks if a.session_id == session_id]
        assert sorted(users) == sorted(acked), (context, session_id, users, acked)  # each once: none lost or doubled
        for client in range(CLIENTS):
            mine = [t for t in users if t.startswith(f"c{client}-")]
            assert mine == [a.text for a in history.acks if a.session_id == session_id and a.client == client], (
                context, session_id, "a client's messages out of its send order", users)
        answers = [m.text for m in final.messages if m.role is MessageRole.ASSISTANT]
        assert answers and all(a is not None and a.startswith("echo: c") for a in answers), (context, answers)
        assert answers[-1] == f"echo: {users[-1]}", (context, session_id, final.messages[-2:])

    for read in history.reads:
        shown = {text for _, role, text in read.stored if role == MessageRole.USER.value} | set(read.queued)
        missing = [a.text for a in history.acks
                   if a.session_id == read.session_id and a.end < read.start and a.text not in shown]
        assert not missing, (context, "acknowledged but not in a later read", read, missing)
    for earlier in history.reads:
        for later in history.reads:
            if later.session_id == earlier.session_id and earlier.end < later.start:
                assert later.stored[:len(earlier.stored)] == earlier.stored, (
                    context, "a later read lost or changed stored messages", earlier, later)
