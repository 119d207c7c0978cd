"""Approvals and questions driven through real sessions: a Worker child (dex_agents.testing) on a
private SQLite file and on a PostgreSQL database (TEST_PG_DSN), the scripted runner at the model edge.
"""

from __future__ import annotations

from pathlib import Path
from typing import cast

from agents.tests.conftest import REPO_ROOT, WORKER_MODULE
from agents.tests.scripted_agent import INVOCATIONS, build_flow
from agents.tests.session_driver import all_agent_events, first_turn_ended, script
from engine.tests.conftest import db_url, pg_database, pg_databases  # noqa: F401 - the fixtures used here

from dex_agents import AgentSessionFlow, AgentSnapshot
from dex_agents._constants import MAX_REJECTION_MESSAGE_CHARS
from dex_agents.testing import AgentTestStack, InvocationLog, wait_for_agent_snapshot
from dex_engine import MAX_VALUE_BYTES


def _stack(tmp_path: Path, db_url: str) -> AgentTestStack:  # noqa: F811
    return AgentTestStack(tmp_path, [build_flow(tmp_path)], WORKER_MODULE, worker_cwd=REPO_ROOT, database_url=db_url)


def _pending(count: int) -> object:
    def probe(s: AgentSnapshot) -> AgentSnapshot | None:
        return s if len(s.pending_interrupts) == count else None

    return probe


async def test_a_rejection_message_over_the_value_limit_is_cut_and_rejects_the_write(
    tmp_path: Path, db_url: str  # noqa: F811
) -> None:
    """A rejection message longer than the engine's value limit is kept cut, as one over
    MAX_REJECTION_MESSAGE_CHARS is: the write is rejected with it and never runs. Catches:
    resolve_interrupt raising ValueTooLargeError for its own request ("store it in pieces or outside
    the flow"), so the rejection never reached the session and the approval stayed pending."""
    async with _stack(tmp_path, db_url) as stack:
        sessions = stack.sessions(cast(AgentSessionFlow, stack.flows[0]))
        await stack.start_worker()
        await sessions.start_session("s", script({"tools": [{"id": "w1", "name": "write_a"}]},
                                                 {"answer": "{results}"}))
        await wait_for_agent_snapshot(sessions, "s", _pending(1), description="the approval")
        reason = "no" * MAX_VALUE_BYTES
        assert await sessions.resolve_interrupt("s", "w1", approved=False, rejection_message=reason) is True
        kept = f"{reason[:MAX_REJECTION_MESSAGE_CHARS]} [Dex: cut from {len(reason)} characters]"
        snapshot = await first_turn_ended(sessions, "s")
        assert snapshot.messages[-1].text == f"w1={kept}"
        assert InvocationLog(tmp_path / INVOCATIONS).count("tool_start", flow_id="s") == 0
        resolved = [e.value.payload for e in await all_agent_events(sessions, "s")
                    if e.value.type == "interrupt_resolved"]
        assert len(resolved) == 1 and f'"rejection_message":"{kept}"' in resolved[0]
