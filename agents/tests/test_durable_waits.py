"""Timers, questions and approvals survive killing every Worker: nothing waits in a process."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from agents.tests.conftest import REPO_ROOT
from agents.tests.durable_agent import durable_flow

from dex_agents import AgentSessionClient, AgentSnapshot, InterruptKind
from dex_agents._timefmt import parse_time
from dex_agents.demo import read_ledger
from dex_agents.testing import AgentTestStack, executed_steps, wait_for_agent_snapshot, wait_until

pytestmark = pytest.mark.slow

REFUND = '/tool refund_order {"order_id": "A-1001", "amount_cents": 10}'


async def _turn_done(sessions: AgentSessionClient, sid: str) -> AgentSnapshot:
    snapshot: AgentSnapshot = await wait_for_agent_snapshot(
        sessions, sid, lambda s: s if s.state is not None and s.state.turn_count >= 1 else None,
        description=f"{sid}'s turn to end")
    return snapshot


async def test_timer_question_and_approval_survive_killing_every_worker(tmp_path: Path) -> None:
    """Kill the only Worker while a 2 s wait, a question and an approval are pending; a new Worker
    finishes all three, and the write runs once."""
    flow = durable_flow(tmp_path)
    async with AgentTestStack(tmp_path, [flow], "agents.tests.durable_worker", worker_cwd=REPO_ROOT) as stack:
        sessions = stack.sessions(flow)  # type: ignore[arg-type]
        worker = await stack.start_worker()
        await sessions.start_session("wait", "/wait 2 cool down")
        await sessions.start_session("ask", "/ask Which order?")
        await sessions.start_session("write", REFUND)

        async def all_waiting() -> bool:
            info = await stack.client.describe_flow("wait")
            timer = any(a.step_type == "AwaitTimer" and a.timer_due_at_ms for a in info.active_steps)
            asked = (await sessions.get_agent_snapshot("ask")).pending_interrupts
            approval = (await sessions.get_agent_snapshot("write")).pending_interrupts
            return timer and bool(asked) and bool(approval)

        await wait_until("the timer, the question and the approval to wait", all_waiting)
        worker.kill()
        restarted = await stack.start_worker()
        restarted_at = time.time()
        question = (await sessions.get_agent_snapshot("ask")).pending_interrupts[0]
        assert question.kind is InterruptKind.QUESTION
        assert await sessions.answer_question("ask", question.interrupt_id, "A-1001")
        approval = (await sessions.get_agent_snapshot("write")).pending_interrupts[0]
        assert await sessions.resolve_interrupt("write", approval.interrupt_id, approved=True)
        waited = await _turn_done(sessions, "wait")
        done_at = time.time()
        assert "durable_wait returned" in (waited.messages[-1].text or "")
        assert '"answer":"A-1001"' in ((await _turn_done(sessions, "ask")).messages[-1].text or "")
        assert "refunded 10 cents" in ((await _turn_done(sessions, "write")).messages[-1].text or "")
        assert len(read_ledger(tmp_path / "ledger.jsonl")) == 1
        assert "AwaitTimer" in executed_steps(await stack.read_step_history("wait"))
        events = (await sessions.read_agent_events("wait")).events
        (timer,) = [json.loads(e.value.payload) for e in events if e.value.type == "timer_started"]
        due = parse_time(timer["wait_until"]).timestamp()
        # Reported, not asserted: timing belongs to benchmarks, not to tests.
        print(f"durable_wait completed {done_at - max(due, restarted_at):.2f} s after it was due and a Worker ran"
              f" (pid {restarted.pid})")
