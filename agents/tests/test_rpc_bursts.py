"""Bursts of session RPCs from several client processes at once, on one session, on SQLite and on
PostgreSQL (TEST_PG_DSN): three processes of two AsyncClients each (burst_client.py) resolve the
approvals of a wide fan-out, some of them twice from two processes, while they also queue messages,
read snapshots, and steer or cancel the turn. The engine's RPCs race each other and the Worker's
Steps there (an RPC that lost two races runs under the flow's write lock); the session must apply
each approval once, run each approved tool once, lose no message, and take the next turn.

Ground truth: the burst log of every RPC's result, the scripted runner's InvocationLog of tool runs,
and the session's AgentEvents.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from agents.tests.burst_client import BURST_LOG, ready_path
from agents.tests.conftest import REPO_ROOT, WORKER_MODULE
from agents.tests.scripted_agent import INVOCATIONS, build_flow
from engine.tests.conftest import db_url, pg_database, pg_databases  # noqa: F401 - the fixtures used here

from dex_agents import AgentSessionClient, AgentSnapshot
from dex_agents.testing import (
    ENV_DATABASE_URL,
    ENV_STATE_DIR,
    AgentTestStack,
    InvocationLog,
    wait_for_agent_snapshot,
    wait_until,
)

pytestmark = pytest.mark.slow

SESSION = "s"
PROCESSES = 3
CLIENTS_PER_PROCESS = 2
CALLS = 40
MESSAGES = 12
IDS = [f"w{n:03d}" for n in range(CALLS)]


def _fan_out_script() -> str:
    """One model call asking for CALLS approval-requiring writes; then an answer listing each result."""
    calls = [{"id": call_id, "name": "write_item", "args": {}} for call_id in IDS]
    return json.dumps({"steps": [{"tools": calls}, {"answer": "{results}"}]})


def _plan(extra: list[list[Any]]) -> list[list[list[Any]]]:
    """Each client's ops: every interrupt resolved by one client, every third one also by a client of
    another process with the opposite decision; MESSAGES messages; a snapshot each; `extra` spread."""
    slots = PROCESSES * CLIENTS_PER_PROCESS
    plan: list[list[list[Any]]] = [[] for _ in range(slots)]
    for n, call_id in enumerate(IDS):
        approved = n % 4 != 0
        plan[n % slots].append(["resolve", call_id, approved])
        if n % 3 == 0:  # the same interrupt from another process: exactly one of the two may win
            plan[(n + CLIENTS_PER_PROCESS) % slots].append(["resolve", call_id, not approved])
    for m in range(MESSAGES):
        plan[m % slots].append(["send", f"m{m}"])
    for n, op in enumerate(extra):
        plan[(n * 5 + 1) % slots].append(op)
    for ops in plan:
        ops.append(["snapshot"])
    return plan


async def _burst(stack: AgentTestStack, plan: list[list[list[Any]]]) -> list[dict[str, Any]]:
    """Run `plan` from PROCESSES client processes, all started before the burst begins."""
    start = stack.state_dir / "burst.start"
    env = dict(os.environ, **{ENV_DATABASE_URL: stack.database_url, ENV_STATE_DIR: str(stack.state_dir)})
    children = []
    paths = [stack.state_dir / f"burst-{p}.json" for p in range(PROCESSES)]
    for p, path in enumerate(paths):
        path.write_text(json.dumps({"session": SESSION, "start": str(start),
                                    "clients": plan[p * CLIENTS_PER_PROCESS:(p + 1) * CLIENTS_PER_PROCESS]}))
        children.append(await asyncio.create_subprocess_exec(
            sys.executable, "-m", "agents.tests.burst_client", str(path), cwd=REPO_ROOT, env=env))
    try:
        await wait_until("the burst's client processes to be ready", lambda: all(
            ready_path(path).exists() or child.returncode is not None
            for path, child in zip(paths, children, strict=True)))
        start.touch()
        for child in children:
            await child.wait()
    finally:
        for child in children:
            if child.returncode is None:
                child.kill()
                await child.wait()
    assert [c.returncode for c in children] == [0] * PROCESSES
    ops = InvocationLog(stack.state_dir / BURST_LOG).entries("op")
    assert len(ops) == sum(len(client_ops) for client_ops in plan)
    assert [e for e in ops if "error" in e] == []  # no RpcLockConflictError, RpcContentionError, or other
    return ops


def _winners(ops: list[dict[str, Any]]) -> dict[str, bool]:
    """Each interrupt's one winning resolve_interrupt's decision; at most one per interrupt returned True."""
    wins = Counter(e["op"][1] for e in ops if e["op"][0] == "resolve" and e["result"] is True)
    assert [i for i, n in wins.items() if n > 1] == []
    assert {e["result"] for e in ops if e["op"][0] == "resolve"} <= {True, False}
    return {e["op"][1]: e["op"][2] for e in ops if e["op"][0] == "resolve" and e["result"] is True}


async def _events(sessions: AgentSessionClient) -> list[tuple[str, str | None, dict[str, Any]]]:
    """The session's AgentEvents: (type, turn_id, payload)."""
    events: list[tuple[str, str | None, dict[str, Any]]] = []
    token = None
    while True:
        read = await sessions.read_agent_events(SESSION, token, limit=1000)
        if not read.events:
            return events
        events += [(e.value.type, e.value.turn_id, json.loads(e.value.payload)) for e in read.events]
        token = read.resume_token


def _idle(s: AgentSnapshot) -> AgentSnapshot | None:
    return s if s.state is not None and s.state.active_turn_id is None and s.queued_message_count == 0 else None


def _check_transcript(snapshot: AgentSnapshot, ops: list[dict[str, Any]], cancelled: frozenset[int] = frozenset()
                      ) -> None:
    """Every message is stored once, in sequence order, and each queued one answered by its own turn,
    unless that turn was cancelled (`cancelled`: the sequences of those turns' user messages)."""
    sequences = [m.sequence for m in snapshot.messages]
    assert sequences == list(range(sequences[0], sequences[0] + len(sequences)))
    for e in ops:
        if e["op"][0] == "snapshot":  # snapshots read mid-burst are in order too
            assert e["result"] == sorted(set(e["result"]))
    texts = [m.text for m in snapshot.messages]
    sent = [t for t in texts if t is not None and t.startswith("m") and t[1:].isdigit()]
    assert sorted(sent) == sorted(f"m{m}" for m in range(MESSAGES))
    for text in sent:
        at = texts.index(text)
        if snapshot.messages[at].sequence in cancelled:  # its turn was cancelled before the model answered
            assert texts[at + 1:at + 2] != [f"echo: {text}"]
        else:
            assert texts[at + 1:at + 2] == [f"echo: {text}"]


async def _started(sessions: AgentSessionClient) -> None:
    await sessions.start_session(SESSION, _fan_out_script())
    await wait_for_agent_snapshot(sessions, SESSION, lambda s: s if len(s.pending_interrupts) == CALLS else None,
                                  description=f"the {CALLS} approvals")


async def test_approvals_from_three_processes_apply_once_and_queued_messages_are_all_answered(
    tmp_path: Path, db_url: str  # noqa: F811
) -> None:
    """Every interrupt resolved once (an overlapping second resolve returns False), the winner's
    decision is what the model sees, each approved write runs exactly once and no rejected one runs,
    every message sent in the burst is answered by its own turn, and the session takes a next turn."""
    flow = build_flow(tmp_path)
    async with AgentTestStack(tmp_path, [flow], WORKER_MODULE, worker_cwd=REPO_ROOT, database_url=db_url) as stack:
        sessions = stack.sessions(flow)
        await stack.start_worker()
        await _started(sessions)
        ops = await _burst(stack, _plan([]))
        winners = _winners(ops)
        assert sorted(winners) == IDS
        assert all(e["result"] is True for e in ops if e["op"][0] == "send")
        idle = await wait_for_agent_snapshot(sessions, SESSION, _idle, description="every queued message answered")
        answer = next(m.text for m in idle.messages if m.text is not None and m.text.startswith("w000="))
        assert answer == "; ".join(f"{i}={'write_item done' if winners[i] else f'no from {i}'}" for i in IDS)
        runs = Counter(e["tool_call_id"] for e in InvocationLog(tmp_path / INVOCATIONS).entries("tool_start"))
        assert runs == Counter({i: 1 for i in IDS if winners[i]})
        _check_transcript(idle, ops)
        assert idle.state is not None and idle.state.turn_count == 1 + MESSAGES
        await sessions.send_user_message(SESSION, "after")
        await wait_for_agent_snapshot(sessions, SESSION, lambda s: s if s.messages[-1].text == "echo: after" else None,
                                      description="the next turn")


async def test_cancel_and_steer_racing_approvals_from_three_processes_leave_one_outcome_per_call(
    tmp_path: Path, db_url: str  # noqa: F811
) -> None:
    """cancel_turn and steer_user_message from several processes in the same burst as the approvals:
    no RPC fails; each interrupt is resolved once, by its winning RPC's decision or by the steer or
    cancellation; each call finishes once, and ran (once) only when its approval won; no queued
    message is lost; the session takes a next turn."""
    flow = build_flow(tmp_path)
    async with AgentTestStack(tmp_path, [flow], WORKER_MODULE, worker_cwd=REPO_ROOT, database_url=db_url) as stack:
        sessions = stack.sessions(flow)
        await stack.start_worker()
        await _started(sessions)
        ops = await _burst(stack, _plan([["cancel"], ["steer", "steered 1"], ["cancel"], ["steer", "steered 2"]]))
        winners = _winners(ops)
        idle = await wait_for_agent_snapshot(sessions, SESSION, _idle, description="every queued message answered")
        runs = Counter(e["tool_call_id"] for e in InvocationLog(tmp_path / INVOCATIONS).entries("tool_start"))
        assert all(n == 1 and winners.get(i) is True for i, n in runs.items())
        events = await _events(sessions)
        resolved = [p for t, _, p in events if t == "interrupt_resolved"]
        assert sorted(p["interrupt_id"] for p in resolved) == IDS
        for p in resolved:
            if p["interrupt_id"] in winners:
                assert (p["approved"], p["cancellation_reason"]) == (winners[p["interrupt_id"]], None)
            else:
                assert p["cancellation_reason"] in ("steered", "turn_cancelled")
        finished = {p["tool_call_id"]: p["status"] for t, _, p in events if t == "tool_call_finished"}
        assert len([t for t, _, _ in events if t == "tool_call_finished"]) == CALLS
        assert {i for i, status in finished.items() if status == "succeeded"} == set(runs)
        _check_transcript(idle, ops, _cancelled_turns(events))
        await sessions.send_user_message(SESSION, "after")
        await wait_for_agent_snapshot(sessions, SESSION, lambda s: s if s.messages[-1].text == "echo: after" else None,
                                      description="the next turn")


def _cancelled_turns(events: list[tuple[str, str | None, dict[str, Any]]]) -> frozenset[int]:
    """The user message sequences of the turns that ended cancelled."""
    started = {turn_id: p["sequence"] for t, turn_id, p in events if t == "turn_started"}
    return frozenset(started[turn_id] for t, turn_id, _ in events if t == "turn_cancelled" and turn_id is not None)
