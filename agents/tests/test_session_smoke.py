"""The shortest path through a session: a read tool, an approved write, and the Step shape."""

from __future__ import annotations

import json

from agents.tests.scripted_agent import FLOW_TYPE

from dex_agents import ActiveStepSearchMode, AgentStatus
from dex_agents.testing import AgentTestStack, executed_steps, wait_for_agent_snapshot


async def test_turn_with_read_and_approved_write(stack: AgentTestStack) -> None:
    """RunModel -> CallTool + AwaitToolApproval -> CallSingleAttemptTool -> ResumeTurn -> RunModel."""
    flow = stack.flows[0]
    sessions = stack.sessions(flow)  # type: ignore[arg-type]
    await stack.start_worker()
    script = {"steps": [
        {"tools": [{"id": "c1", "name": "read_orders", "args": {}}, {"id": "c2", "name": "write_refund", "args": {}}]},
        {"answer": "done {results}"},
    ]}
    await sessions.start_session("s1", json.dumps(script))
    interrupt = await wait_for_agent_snapshot(
        sessions, "s1", lambda s: next(iter(s.pending_interrupts), None), description="the approval")
    assert interrupt.interrupt_id == "c2"
    assert await sessions.resolve_interrupt("s1", "c2", approved=True)
    snapshot = await wait_for_agent_snapshot(
        sessions, "s1", lambda s: s if s.state and s.state.turn_count == 1 else None, description="turn end")
    assert snapshot.state is not None and snapshot.state.status is AgentStatus.WAITING_FOR_USER_MESSAGE
    assert snapshot.messages[-1].text == "done c1=read_orders done; c2=write_refund done"
    steps = executed_steps(await stack.read_step_history("s1"))
    assert steps[:2] == ["StartAgentSession", "RunModel"]
    assert sorted(steps[2:5]) == ["AwaitToolApproval", "CallSingleAttemptTool", "CallTool"]
    assert steps[5:] == ["ResumeTurn", "RunModel"]
    assert snapshot.tool_calls == []  # records are deleted at turn end; the answer carries their results
    assert flow.flow_type == FLOW_TYPE


async def test_sessions_waiting_for_a_person_are_found_by_the_step_they_wait_in(stack: AgentTestStack) -> None:
    """Seed 003, "Finding sessions that need a person": start_session makes a session searchable by
    its active Steps, so search_flows('ActiveStepTypes = "AwaitToolApproval"', 50) finds it while its
    approval waits, and not once it has moved on; a session started with search disabled is never
    found."""
    flow = stack.flows[0]
    sessions = stack.sessions(flow)  # type: ignore[arg-type]
    client = sessions.client
    await stack.start_worker()
    script = json.dumps({"steps": [{"tools": [{"id": "w1", "name": "write_refund", "args": {}}]}, {"answer": "ok"}]})
    await sessions.start_session("found", script)
    await sessions.start_session("hidden", script, active_step_search_mode=ActiveStepSearchMode.DISABLED)
    for session_id in ("found", "hidden"):
        await wait_for_agent_snapshot(sessions, session_id, lambda s: next(iter(s.pending_interrupts), None),
                                      description=f"{session_id}'s approval")
    assert await client.search_flows('ActiveStepTypes = "AwaitToolApproval"', 50) == ["found"]
    assert await client.search_flows(f'ActiveStepTypes = "AwaitToolApproval" AND FlowType = "{FLOW_TYPE}"') == [
        "found"
    ]
    for session_id in ("found", "hidden"):
        assert await sessions.resolve_interrupt(session_id, "w1", approved=True)
        await wait_for_agent_snapshot(sessions, session_id,
                                      lambda s: s if s.state and s.state.turn_count == 1 else None,
                                      description=f"{session_id}'s turn end")
    assert await client.search_flows('ActiveStepTypes = "AwaitToolApproval"', 50) == []
    assert await client.search_flows('ActiveStepTypes = "AwaitUserMessage"', 50) == ["found"]
