"""The SQLite deployment of docs/deployment.md: one file shared by several client processes (web
server processes, each with its own AsyncClient) and two Worker processes.

Four client processes (storm_client.py) call every session RPC on 30 sessions at once: messages
that start echo turns and turns with a read and an approved write, approvals and rejections of the
writes they find with search_flows, cancels, steers, snapshots and message pages. Meanwhile the
test SIGKILLs a random client process mid-call and the killable Worker at random instants (a seeded
schedule, printed on failure), each replaced at once. Then every session must settle, and:

- no call failed with anything but the documented RpcLockConflictError of a lock held too long
  (E7), never SQLite's `database is locked`;
- each acknowledged message is stored exactly once, a client's sends in its send order, and a
  message whose call a kill cut short at most once;
- a write ran at most once, never after a rejection, never without an approval call; a write in a
  turn that ended with its answer ran once exactly when recorded `succeeded`;
- the file passes `PRAGMA integrity_check`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest
from agents.tests.conftest import REPO_ROOT, WORKER_MODULE
from agents.tests.scripted_agent import INVOCATIONS, build_flow
from agents.tests.standby_workers import SharedStack
from agents.tests.storm_client import APPROVAL_SEARCH, CALLS, STOP_FILE

from dex_agents import AgentMessage, AgentSessionClient, MessageRole
from dex_agents.testing import ENV_DATABASE_URL, ENV_STATE_DIR, AgentTestStack, InvocationLog, wait_until

pytestmark = pytest.mark.slow

SEED = 20261206
SESSIONS = 30
CLIENTS = 4
STORM_SECONDS = 14.0
CLIENT_KILLS = 3
WORKER_KILLS = 3
SETTLE_SECONDS = 120.0
# The only error a call may end with: a lock a Step held longer than the client's retry (E7).
ALLOWED_ERRORS = ("dex_engine._errors.RpcLockConflictError",)
CLIENT_MODULE = "agents.tests.storm_client"
CRASH_AT = "DEX_ENGINE_CRASH_AT"
INSIDE_COMMIT = "store.inside_commit"
CRASH_AT_COMMIT = 150


class ClientProcess:
    def __init__(self, number: int, seed: int, session_ids: list[str], stack: AgentTestStack) -> None:
        self.number = number
        env = {**os.environ, ENV_DATABASE_URL: stack.database_url, ENV_STATE_DIR: str(stack.state_dir),
               "PYTHONUNBUFFERED": "1"}
        self.log_path = stack.state_dir / f"client-{number}.log"
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", CLIENT_MODULE, str(number), str(seed), *session_ids], cwd=REPO_ROOT,
                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


def _calling(state_dir: Path) -> set[int]:
    """The clients that have started a call."""
    return {e["client"] for e in InvocationLog(state_dir / CALLS).entries("start")}


async def _kill_mid_call(client: ClientProcess, state_dir: Path) -> None:
    """SIGKILL `client` inside a call: frozen (SIGSTOP) at a moment its last record is a call's
    start, else let go and frozen again a moment later."""

    def inside_a_call() -> bool:
        os.killpg(client.process.pid, signal.SIGSTOP)
        mine = [e for e in InvocationLog(state_dir / CALLS).entries() if e["client"] == client.number]
        if mine and mine[-1]["kind"] == "start":
            return True
        os.killpg(client.process.pid, signal.SIGCONT)
        return False

    await wait_until(f"client {client.number} to be inside a call", inside_a_call, timeout=30, interval=0.003)
    client.kill()


def _calls(state_dir: Path) -> tuple[dict[tuple[int, int], dict[str, Any]], dict[tuple[int, int], dict[str, Any]]]:
    log = InvocationLog(state_dir / CALLS)
    starts = {(e["client"], e["call"]): e for e in log.entries("start")}
    ends = {(e["client"], e["call"]): e for e in log.entries("end")}
    return starts, ends


async def _all_messages(sessions: AgentSessionClient, session_id: str) -> list[AgentMessage]:
    pages: list[list[AgentMessage]] = []
    before: int | None = None
    while True:
        page = await sessions.list_agent_messages(session_id, before_sequence=before, limit=200)
        pages.append(page.messages)
        if page.next_before_sequence is None:
            break
        before = page.next_before_sequence
    return [m for page in reversed(pages) for m in page]


async def _settle(sessions: AgentSessionClient, session_ids: list[str], log: InvocationLog) -> None:
    """Approve whatever still waits (the clients are gone), until every session is idle."""

    async def idle() -> bool:
        for session_id in await sessions.client.search_flows(APPROVAL_SEARCH):
            for interrupt in (await sessions.get_agent_snapshot(session_id)).pending_interrupts:
                entry = {"client": -1, "call": len(log.entries()), "op": "resolve", "session": session_id,
                         "interrupt": interrupt.interrupt_id, "tool_call": interrupt.tool_call_id, "approved": True}
                log.record("start", **entry)
                log.record("end", **entry, result=await sessions.resolve_interrupt(
                    session_id, interrupt.interrupt_id, approved=True))
        for session_id in session_ids:
            snapshot = await sessions.get_agent_snapshot(session_id)
            state = snapshot.state
            if state is None or state.active_turn_id is not None or snapshot.queued_messages:
                return False
        return True

    await wait_until("every session to answer every message and end its turn", idle, timeout=SETTLE_SECONDS,
                     interval=0.2)


def _tag(message: AgentMessage) -> str | None:
    text = message.text or ""
    try:
        value = json.loads(text)
    except ValueError:
        return text if text.startswith("c") and "-" in text else None
    return value.get("tag") if isinstance(value, dict) else None


async def test_client_processes_and_workers_share_one_file_through_kills(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    session_ids = [f"storm-{n}" for n in range(SESSIONS)]
    # Every random choice drawn up front: the seed alone fixes the schedule.
    events = sorted([(round(rng.uniform(1.0, STORM_SECONDS - 1.0), 3), "client") for _ in range(CLIENT_KILLS)]
                    + [(round(rng.uniform(1.0, STORM_SECONDS - 1.0), 3), "worker") for _ in range(WORKER_KILLS)])
    victims = [rng.random() for _ in events]
    context = f"seed {SEED}, kills at {events}"
    flow = build_flow(tmp_path)
    clients: list[ClientProcess] = []
    # The killable Workers also kill themselves inside a commit transaction (SQLite's write lock
    # and the flock held), at their CRASH_AT_COMMIT-th crossing.
    crash_env = {CRASH_AT: f"{INSIDE_COMMIT}:{CRASH_AT_COMMIT}"}
    async with AgentTestStack(tmp_path, [flow], WORKER_MODULE, worker_cwd=REPO_ROOT, worker_env=crash_env) as stack:
        try:
            sessions = stack.sessions(flow)
            for session_id in session_ids:
                await sessions.start_session(session_id)
            shared = SharedStack(stack, standbys=2)
            await stack.start_worker({CRASH_AT: ""})  # never killed
            await shared.worker()
            clients = [ClientProcess(n, SEED + n, session_ids, stack) for n in range(CLIENTS)]
            live = list(clients)
            await wait_until("every client process to make its first call",
                             lambda: {c.number for c in live} <= _calling(stack.state_dir), timeout=90)
            self_kills = 0
            killed: set[int] = set()  # the Workers this test killed, not themselves

            async def replace_dead_workers() -> None:
                nonlocal self_kills
                while True:
                    if shared.current is not None and not shared.current.alive:
                        self_kills += shared.current.pid not in killed
                        await shared.start_new_worker()
                    await asyncio.sleep(0.05)

            replacing = asyncio.create_task(replace_dead_workers())
            loop = asyncio.get_running_loop()
            began = loop.time()
            for (at, kind), victim in zip(events, victims, strict=True):
                await asyncio.sleep(max(0.0, began + at - loop.time()))
                if kind == "client":
                    dead = live.pop(int(victim * len(live)))
                    await _kill_mid_call(dead, stack.state_dir)
                    replacement = ClientProcess(len(clients), SEED + len(clients), session_ids, stack)
                    clients.append(replacement)
                    live.append(replacement)
                elif shared.current is not None and shared.current.alive:
                    killed.add(shared.current.pid)
                    shared.current.kill()
            await asyncio.sleep(max(0.0, began + STORM_SECONDS - loop.time()))
            replacing.cancel()
            (stack.state_dir / STOP_FILE).write_text("stop")
            await wait_until("the client processes to stop", lambda: all(c.process.poll() is not None for c in live),
                             timeout=60)
            for client in live:
                assert client.process.returncode == 0, (context, client.log_path.read_text()[-3000:])
            await _settle(sessions, session_ids, InvocationLog(stack.state_dir / CALLS))
            transcripts = {s: await _all_messages(sessions, s) for s in session_ids}
            assert await stack.client.search_flows(APPROVAL_SEARCH) == [], (context, "found waiting once all settled")
        finally:
            for client in clients:
                client.kill()
    context += f", {self_kills} Worker(s) killed inside a commit"

    starts, ends = _calls(tmp_path)
    errors = [e for e in ends.values() if "error" in e]
    assert not [e for e in errors if not e["error"].startswith(ALLOWED_ERRORS)], (context, errors)
    unknown = {k for k in starts if k not in ends}
    assert len(unknown) >= CLIENT_KILLS and self_kills, (context, "the kills cut no call or commit short", unknown)
    sends = [starts[k] for k in sorted(starts) if starts[k]["op"] in ("send", "tools", "steer")]
    acked = {e["tag"] for e in sends if ends.get((e["client"], e["call"]), {}).get("result") is True}
    maybe = {e["tag"] for e in sends if (e["client"], e["call"]) in unknown}
    assert len(acked) > 100, (context, "too few messages to test anything", len(acked))

    stored: dict[str, list[str]] = {}
    for session_id, messages in transcripts.items():
        tags = [t for m in messages if m.role is MessageRole.USER and (t := _tag(m)) is not None]
        stored[session_id] = tags
        doubled = [t for t, n in Counter(tags).items() if n > 1]
        assert not doubled, (context, session_id, "stored twice", doubled)
        assert set(tags) <= acked | maybe, (context, session_id, "stored but never acknowledged",
                                            set(tags) - acked - maybe)
        per_client: dict[str, list[int]] = defaultdict(list)
        for tag in tags:
            client, _, number = tag.partition("-")
            if number.startswith("m"):  # a steer goes ahead of queued messages; sends keep their order
                per_client[client].append(int(number[1:]))
        for client, numbers in per_client.items():
            assert numbers == sorted(numbers), (context, session_id, client, "sends out of order", numbers)
    for e in sends:
        if e["tag"] in acked:
            assert e["tag"] in stored[e["session"]], (context, "acknowledged but not stored", e)

    # Writes: the InvocationLog of the tools themselves.
    tool_log = InvocationLog(tmp_path / INVOCATIONS)
    write_starts = Counter((e["flow_id"], e["tool_call_id"]) for e in tool_log.entries("tool_start")
                           if e["tool_call_id"].startswith("w-"))
    write_ends = Counter((e["flow_id"], e["tool_call_id"]) for e in tool_log.entries("tool_end")
                         if e["tool_call_id"].startswith("w-"))
    assert not [k for k, n in write_starts.items() if n > 1], (context, "a write ran twice", write_starts)
    resolves = [(starts[k], ends.get(k)) for k in starts if starts[k]["op"] == "resolve"]
    rejected = {(s["session"], s["tool_call"]) for s, e in resolves if not s["approved"] and e and e.get("result")}
    approved_calls = {(s["session"], s["tool_call"]) for s, e in resolves
                      if s["approved"] and (e is None or e.get("result") is True)}
    assert not rejected & set(write_starts), (context, "a rejected write ran", rejected & set(write_starts))
    assert set(write_starts) <= approved_calls, (context, "a write ran unapproved", set(write_starts) - approved_calls)
    checked = 0
    for session_id, messages in transcripts.items():
        for message in messages:
            if message.role is not MessageRole.ASSISTANT or not (message.text or "").startswith("{"):
                continue
            for call_id, record in json.loads(message.text or "{}").items():
                if not call_id.startswith("w-"):
                    continue
                key = (session_id, call_id)
                ran = (write_starts[key], write_ends[key])
                checked += 1
                if record["status"] == "succeeded":
                    assert ran == (1, 1), (context, key, record, ran)
                elif record["status"] in ("rejected", "failed"):
                    assert ran[0] == 0, (context, key, record, ran)
    assert checked, (context, "no turn with a write ended with its answer")

    with contextlib.closing(sqlite3.connect(tmp_path / "dex.db")) as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
