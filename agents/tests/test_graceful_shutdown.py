"""A Worker stopped with SIGTERM (RELIABILITY.md T22, graceful_shutdown), as a deploy stops it.

The Worker child claims nothing more and gives its running Steps the shutdown grace (5 s in test
Workers) to finish. A write that finishes in time is recorded `succeeded`, not `outcome_unknown`:
a deploy does not turn short tool calls into unknown outcomes. A write still running when the
grace ends is cancelled and recorded `outcome_unknown`; it never runs again. The Worker exits 0
either way, and a new Worker carries the turn on.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import cast

import pytest
from agents.tests.conftest import REPO_ROOT, WORKER_MODULE
from agents.tests.scripted_agent import INVOCATIONS, build_flow
from agents.tests.session_driver import first_turn_answer

from dex_agents import OUTCOME_UNKNOWN_TEXT, AgentSessionClient, AgentSessionFlow
from dex_agents.testing import AgentTestStack, FileGate, InvocationLog, executed_steps, wait_for_agent_snapshot

pytestmark = pytest.mark.slow


def _script(gate: str) -> str:
    return json.dumps({"steps": [
        {"tools": [{"id": "w", "name": "write_refund", "args": {"gate": gate}}]}, {"answer": "{results}"},
    ]})


async def _approved_write_at_its_gate(stack: AgentTestStack, sessions: AgentSessionClient, name: str) -> FileGate:
    await sessions.start_session(name, _script(name))
    await wait_for_agent_snapshot(
        sessions, name, lambda s: s if s.pending_interrupts else None, description=f"{name}'s approval")
    assert await sessions.resolve_interrupt(name, "w", approved=True)
    gate = FileGate(stack.state_dir, name)
    await gate.wait_until_reached()
    return gate


async def test_sigterm_lets_a_running_write_finish_or_records_it_unknown(tmp_path: Path) -> None:
    async with AgentTestStack(tmp_path, [build_flow(tmp_path)], WORKER_MODULE, worker_cwd=REPO_ROOT) as stack:
        sessions = stack.sessions(cast(AgentSessionFlow, stack.flows[0]))
        log = InvocationLog(tmp_path / INVOCATIONS)

        # Within the grace: the write finishes and commits; the Worker exits 0.
        worker = await stack.start_worker()
        gate = await _approved_write_at_its_gate(stack, sessions, "in-time")
        stopping = asyncio.create_task(worker.stop())
        await asyncio.sleep(0.5)  # the signal is in; the tool is still running
        assert worker.alive
        gate.release()
        assert await stopping == 0, worker.log_tail()
        await stack.start_worker()
        assert await first_turn_answer(sessions, "in-time") == "w=write_refund done"
        assert log.count("tool_start", flow_id="in-time") == 1 and log.count("tool_end", flow_id="in-time") == 1
        assert "CallSingleAttemptTool" in executed_steps(await stack.read_step_history("in-time"))

        # Past the grace: the write is cancelled, recorded outcome_unknown, never run again.
        worker = stack.workers[-1]
        gate = await _approved_write_at_its_gate(stack, sessions, "too-long")
        assert await worker.stop() == 0, worker.log_tail()
        gate.release()  # a rerun would now finish and log a second start and an end
        await stack.start_worker()
        assert await first_turn_answer(sessions, "too-long") == f"w={OUTCOME_UNKNOWN_TEXT}"
        assert log.count("tool_start", flow_id="too-long") == 1 and log.count("tool_end", flow_id="too-long") == 0
        steps = executed_steps(await stack.read_step_history("too-long"))
        assert "RecordToolOutcomeUnknown" in steps and "CallSingleAttemptTool" not in steps
