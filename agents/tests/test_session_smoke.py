"""The shortest path through a session: a read tool, an approved write, and the Step shape."""

from __future__ import annotations

import json
import re
from pathlib import Path

from agents.tests.builtin_agent import InProcessEngine
from agents.tests.scripted_agent import FLOW_TYPE, build_flow

from dex_agents import ActiveStepSearchMode, AgentSnapshot, AgentStatus, MessageRole
from dex_agents.testing import AgentTestStack, executed_steps, read_step_history, wait_for_agent_snapshot

# Seed 002: writers emit times in UTC with milliseconds and Z.
WIRE_TIME = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{3}Z$")


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


def first_turn_ended(snapshot: AgentSnapshot) -> AgentSnapshot | None:
    return snapshot if snapshot.state is not None and snapshot.state.turn_count == 1 else None


async def test_stored_messages_carry_utc_millisecond_z_times(stack: AgentTestStack) -> None:
    """Every message a real turn stores (the user's, the assistant's and the tool's) has created_at
    in the seed's wire form, e.g. 2026-11-01T12:00:00.123Z: no offset, no microseconds."""
    sessions = stack.sessions(stack.flows[0])  # type: ignore[arg-type]
    await stack.start_worker()
    script = {"steps": [{"tools": [{"id": "c1", "name": "read_orders", "args": {}}]}, {"answer": "done"}]}
    await sessions.start_session("s1", json.dumps(script))
    snapshot = await wait_for_agent_snapshot(sessions, "s1", first_turn_ended, description="turn end")
    assert [m.role for m in snapshot.messages] == [
        MessageRole.USER, MessageRole.ASSISTANT, MessageRole.TOOL, MessageRole.ASSISTANT]
    assert [m.created_at for m in snapshot.messages if not WIRE_TIME.fullmatch(m.created_at)] == []


async def test_module_read_step_history_reads_what_the_stack_reads(stack: AgentTestStack) -> None:
    """dex_agents.testing.read_step_history(database_url, flow_id), which opens its own Store, returns
    the same entries as AgentTestStack.read_step_history for a session that ran a turn."""
    sessions = stack.sessions(stack.flows[0])  # type: ignore[arg-type]
    worker = await stack.start_worker()
    await sessions.start_session("s1", "hello")
    await wait_for_agent_snapshot(sessions, "s1", first_turn_ended, description="turn end")
    await worker.stop()  # AwaitUserMessage's wait may still be registering: nothing writes between the reads
    history = await read_step_history(stack.database_url, "s1")
    assert executed_steps(history) == ["StartAgentSession", "RunModel"]
    assert history == await stack.read_step_history("s1")


async def test_snapshot_lists_the_active_turns_records_in_deferral_order(tmp_path: Path) -> None:
    """get_agent_snapshot's tool_calls are the active turn's records in deferral_order (seed 002
    "RPCs"), not in the order of their IDs: real models' IDs (toolu_...) do not sort as they were asked."""
    engine = InProcessEngine(tmp_path, [build_flow(tmp_path)])
    asked = [("zeta", "read_orders"), ("alpha", "write_refund"), ("mid", "write_email")]
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s1", json.dumps({"steps": [
            {"tools": [{"id": i, "name": name, "args": {}} for i, name in asked]}, {"answer": "{results}"},
        ]}))
        waiting = await wait_for_agent_snapshot(
            sessions, "s1", lambda s: s if len(s.pending_interrupts) == 2 else None, description="the approvals")
        assert [(r.tool_call_id, r.deferral_order) for r in waiting.tool_calls] == [
            ("zeta", 0), ("alpha", 1), ("mid", 2)]
        assert [i.interrupt_id for i in waiting.pending_interrupts] == ["alpha", "mid"]
        for interrupt_id in ("alpha", "mid"):
            assert await sessions.resolve_interrupt("s1", interrupt_id, approved=True)
        done = await wait_for_agent_snapshot(sessions, "s1", first_turn_ended, description="turn end")
    assert done.messages[-1].text == "zeta=read_orders done; alpha=write_refund done; mid=write_email done"
