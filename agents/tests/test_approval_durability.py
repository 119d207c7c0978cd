"""Approvals outlive everything but the database file (RELIABILITY.md T14, approval_durability).

Ten sessions each wait for the approval of one write. Then the whole stack goes away: the Worker
child is SIGKILLed and the client closed, so no process holds the database open. A new stack on the
same file (a fresh client, no cache of the old one) grants or denies, in the variants T14 names, and
only then starts a Worker:

- approved: the write runs exactly once; a second approval returns False and changes nothing;
- denied, then approved: the approval returns False, the write never runs, the model sees the denial;
- two approvals at once: exactly one returns True, and the write runs once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
from pathlib import Path
from typing import cast

import pytest
from agents.tests.conftest import REPO_ROOT, WORKER_MODULE
from agents.tests.scripted_agent import INVOCATIONS, build_flow
from agents.tests.session_driver import first_turn_answer

from dex_agents import AgentSessionClient, AgentSessionFlow
from dex_agents.testing import AgentTestStack, InvocationLog, wait_for_agent_snapshot

pytestmark = pytest.mark.slow

APPROVE = [f"approve-{n}" for n in range(4)]
DENY_THEN_APPROVE = [f"deny-{n}" for n in range(3)]
RACE = [f"race-{n}" for n in range(3)]
SCRIPT = json.dumps({"steps": [
    {"tools": [{"id": "w", "name": "write_refund", "args": {"amount": 5}}]}, {"answer": "{results}"},
]})


def _stack(tmp_path: Path) -> AgentTestStack:
    return AgentTestStack(tmp_path, [build_flow(tmp_path)], WORKER_MODULE, worker_cwd=REPO_ROOT)


def _sessions(stack: AgentTestStack) -> AgentSessionClient:
    return stack.sessions(cast(AgentSessionFlow, stack.flows[0]))


async def test_approvals_survive_a_whole_stack_restart_and_resolve_once(tmp_path: Path) -> None:
    everyone = APPROVE + DENY_THEN_APPROVE + RACE
    async with _stack(tmp_path) as first:
        sessions = _sessions(first)
        await first.start_worker()
        for session_id in everyone:
            await sessions.start_session(session_id, SCRIPT)
        for session_id in everyone:
            await wait_for_agent_snapshot(
                sessions, session_id, lambda s: s if any(i.interrupt_id == "w" for i in s.pending_interrupts)
                else None, description=f"{session_id}'s approval")
    # The first stack's exit SIGKILLed its Worker and closed its client: nothing holds the file open.
    database = tmp_path / "dex.db"
    with contextlib.closing(sqlite3.connect(database)) as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)

    async with _stack(tmp_path) as second:
        sessions = _sessions(second)
        for session_id in APPROVE:
            assert await sessions.resolve_interrupt(session_id, "w", approved=True)
            assert await sessions.resolve_interrupt(session_id, "w", approved=True) is False
        for session_id in DENY_THEN_APPROVE:
            assert await sessions.resolve_interrupt(session_id, "w", approved=False, rejection_message="not now")
            assert await sessions.resolve_interrupt(session_id, "w", approved=True) is False
        for session_id in RACE:
            results = await asyncio.gather(*(sessions.resolve_interrupt(session_id, "w", approved=True)
                                             for _ in range(2)))
            assert sorted(results) == [False, True], (session_id, results)
        await second.start_worker()
        answers = {session_id: await first_turn_answer(sessions, session_id) for session_id in everyone}

    log = InvocationLog(tmp_path / INVOCATIONS)
    for session_id in APPROVE + RACE:
        assert answers[session_id] == "w=write_refund done", (session_id, answers[session_id])
        assert log.count("tool_start", flow_id=session_id, tool_call_id="w") == 1, session_id
    for session_id in DENY_THEN_APPROVE:
        assert answers[session_id] == "w=not now", (session_id, answers[session_id])
        assert log.count("tool_start", flow_id=session_id, tool_call_id="w") == 0, session_id
