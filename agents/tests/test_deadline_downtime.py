"""Approval and question deadlines that pass while no Worker runs (seed 002 AwaitToolApproval and
AwaitQuestionAnswer; docs/deviations.md "Interrupt deadlines use the Worker clock").

Sessions wait for an approval, an ask_user answer and a tool's question, each with a deadline. The
Worker is SIGKILLed and the deadlines pass with no Worker running. Then, before a Worker is back,
resolve_interrupt and answer_question return False by the caller's clock and change nothing; the
next Worker records each deadline exactly once, with the seed's texts, and the turns go on.
"""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, cast

import pytest
from agents.tests.conftest import REPO_ROOT, WORKER_MODULE
from agents.tests.scripted_agent import ENV_BUILT_IN_TOOLS, ENV_DEADLINE_SECONDS, INVOCATIONS, build_flow
from agents.tests.session_driver import all_agent_events, first_turn_ended, script
from engine.tests.conftest import db_url, pg_database, pg_databases  # noqa: F401 - the fixtures used here

from dex_agents import AgentSessionClient, AgentSessionFlow, BuiltInTool
from dex_agents.testing import AgentTestStack, InvocationLog, wait_until

pytestmark = pytest.mark.slow

# Long enough that every session raises its interrupt before it passes on a loaded machine; a
# session whose deadline passes before the kill is checked the same way, so the test does not
# depend on it.
DEADLINE_SECONDS = 3
SESSIONS_PER_KIND = 4
# kind: (interrupt ID, script, the final answer once the deadline is recorded)
KINDS: dict[str, tuple[str, str, str]] = {
    "approval": ("w", script({"tools": [{"id": "w", "name": "write_refund", "args": {"amount": 5}}]},
                             {"answer": "{results}"}), "w=approval deadline passed"),
    "ask_user": ("q", script({"tools": [{"id": "q", "name": "ask_user", "args": {"question": "ok?"}}]},
                             {"answer": "{results}"}), "q=question deadline passed"),
    "tool_question": ("t-input-1", script({"tools": [{"id": "t", "name": "read_x", "args": {"ask": "which?"}}]},
                                          {"answer": "{results}"}), "t=question deadline passed"),
}


def _deadline(payload: dict[str, Any]) -> datetime:
    return datetime.fromisoformat(str(payload["deadline"]).replace("Z", "+00:00"))


async def _events(sessions: AgentSessionClient, session_id: str, event_type: str) -> list[dict[str, Any]]:
    return [json.loads(e.value.payload) for e in await all_agent_events(sessions, session_id)
            if e.value.type == event_type]


async def test_deadlines_that_pass_while_no_worker_runs_are_recorded_once_by_the_next_worker(
    tmp_path: Path, db_url: str,  # noqa: F811
) -> None:
    env = {ENV_DEADLINE_SECONDS: str(DEADLINE_SECONDS), ENV_BUILT_IN_TOOLS: BuiltInTool.ASK_USER.value}
    flow = build_flow(tmp_path, interrupt_deadline=timedelta(seconds=DEADLINE_SECONDS),
                      built_in_tools=frozenset({BuiltInTool.ASK_USER}))
    url = None if db_url.startswith("sqlite") else db_url
    async with AgentTestStack(tmp_path, [flow], WORKER_MODULE, worker_cwd=REPO_ROOT, worker_env=env,
                              database_url=url) as stack:
        sessions = AgentSessionClient(stack.client, cast(AgentSessionFlow, stack.flows[0]))
        kinds = {f"{kind}-{n}": kind for kind in KINDS for n in range(SESSIONS_PER_KIND)}
        worker = await stack.start_worker()
        await asyncio.gather(*(sessions.start_session(s, KINDS[kind][1]) for s, kind in kinds.items()))

        async def raised() -> dict[str, datetime] | None:
            found = {s: await _events(sessions, s, "interrupt_raised") for s in kinds}
            return {s: _deadline(e[0]) for s, e in found.items()} if all(found.values()) else None

        deadlines: dict[str, datetime] = await wait_until("every session to raise its interrupt", raised)
        worker.kill()
        last = max(deadlines.values())
        await wait_until("every deadline to pass", lambda: datetime.now(UTC) >= last)

        # (a) No Worker runs: the caller's clock says the deadline passed, so nothing is taken.
        for session_id, kind in kinds.items():
            interrupt_id = KINDS[kind][0]
            if kind == "approval":
                assert await sessions.resolve_interrupt(session_id, interrupt_id, approved=True) is False
            else:
                assert await sessions.answer_question(session_id, interrupt_id, "yes") is False
            assert await sessions.resolve_interrupt(session_id, interrupt_id, approved=False) is False

        # (b) The next Worker records each deadline once, and the turn goes on to its answer.
        await stack.start_worker()
        for session_id, kind in kinds.items():
            interrupt_id, _, answer = KINDS[kind]
            ended = await first_turn_ended(sessions, session_id)
            assert ended.messages[-1].text == answer, (session_id, ended.messages[-1].text)
            assert not ended.pending_interrupts, session_id
            resolved = await _events(sessions, session_id, "interrupt_resolved")
            assert resolved == [{
                "interrupt_id": interrupt_id, "approved": False, "rejection_message": answer.split("=", 1)[1],
                "kind": "tool_approval" if kind == "approval" else "question", "answered": False,
                "cancellation_reason": None,
            }], (session_id, resolved)
            finished = await _events(sessions, session_id, "tool_call_finished")
            assert [f["status"] for f in finished] == ["rejected"], (session_id, finished)
    # The write never ran; the asking tool ran once, to ask, and never again with an answer.
    log = InvocationLog(tmp_path / INVOCATIONS)
    assert log.count("tool_start", tool_call_id="w") == 0
    assert log.count("tool_start", tool_call_id="t") == SESSIONS_PER_KIND
