"""A framework adapter written from docs/agents.md alone (agents/tests/journey_agent.py), tested as
"Testing an adapter" says: AgentTestStack, Worker children killed at FileGates, InvocationLog counts,
Step history, and ContextWindowSessionScenario, with only public names of dex_agents."""

from __future__ import annotations

from pathlib import Path

import pytest
from agents.tests.journey_agent import (
    AWAITED_ESTIMATE_FLOW_TYPE,
    COMPACTING_FLOW_TYPE,
    FLOW_TYPE,
    LOOKUP_GATE,
    REFUND_GATE,
    build_flows,
)

from dex_agents import (
    AWAIT_TOOL_APPROVAL,
    CALL_SINGLE_ATTEMPT_TOOL,
    CALL_TOOL,
    OUTCOME_UNKNOWN_TEXT,
    POLL_TOOL_TASK,
    AgentSessionFlow,
    AgentSnapshot,
    AgentStatus,
    AgentToolCallStatus,
    MessageRole,
)
from dex_agents.testing import (
    AgentTestStack,
    ContextWindowSessionScenario,
    FileGate,
    InvocationLog,
    executed_steps,
    wait_for_agent_snapshot,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
WORKER_MODULE = "agents.tests.journey_worker"


def stack_of(tmp_path: Path) -> tuple[AgentTestStack, dict[str, AgentSessionFlow]]:
    flows = build_flows()
    return AgentTestStack(tmp_path, flows, WORKER_MODULE, worker_cwd=REPO_ROOT), {f.flow_type: f for f in flows}


def turn_ended(count: int):  # type: ignore[no-untyped-def]
    def probe(snapshot: AgentSnapshot) -> AgentSnapshot | None:
        state = snapshot.state
        ended = state is not None and state.turn_count >= count and state.status is AgentStatus.WAITING_FOR_USER_MESSAGE
        return snapshot if ended else None
    return probe


def arm(stack: AgentTestStack, gate: str) -> FileGate:
    (stack.state_dir / f"{gate}.armed").touch()
    return FileGate(stack.state_dir, gate)


async def test_a_write_killed_mid_call_is_outcome_unknown_and_never_repeated(tmp_path: Path) -> None:
    """The seed's example: kill while the session waits for approval, approve on a new Worker, kill
    again inside the write; the write ran once, the model sees outcome_unknown, and the results the
    runner built from the records are stored with the answer."""
    stack, flows = stack_of(tmp_path)
    async with stack:
        sessions = stack.sessions(flows[FLOW_TYPE])
        worker = await stack.start_worker()
        gate = arm(stack, REFUND_GATE)
        await sessions.start_session("s1", "refund 7")
        interrupt = await wait_for_agent_snapshot(
            sessions, "s1", lambda s: next(iter(s.pending_interrupts), None), description="an approval")
        worker.kill()
        worker = await stack.start_worker()
        assert await sessions.resolve_interrupt("s1", interrupt.interrupt_id, approved=True)
        await gate.wait_until_reached()
        worker.kill()
        await stack.start_worker()
        snapshot = await wait_for_agent_snapshot(sessions, "s1", turn_ended(1), description="turn 1")
        log = InvocationLog(stack.state_dir / "invocations.jsonl")
        assert log.count("tool", tool_call_id="r1") == 1
        assert [(m.role, m.text or m.tool_output) for m in snapshot.messages] == [
            (MessageRole.USER, "refund 7"),
            (MessageRole.ASSISTANT, None),
            (MessageRole.TOOL, OUTCOME_UNKNOWN_TEXT),
            (MessageRole.ASSISTANT, f"refund: {OUTCOME_UNKNOWN_TEXT}"),
        ]
        steps = executed_steps(await stack.read_step_history("s1"))
        assert AWAIT_TOOL_APPROVAL in steps and CALL_SINGLE_ATTEMPT_TOOL not in steps  # it never completed
        assert "RecordToolOutcomeUnknown" in steps


async def test_a_read_killed_mid_call_runs_again_and_a_task_is_polled(tmp_path: Path) -> None:
    """Two parallel reads, one killed at its gate: only it runs again on the next Worker. Then a
    report tool that starts a task is polled to its result, and TurnContinued makes a second model
    call in one turn."""
    stack, flows = stack_of(tmp_path)
    async with stack:
        sessions = stack.sessions(flows[FLOW_TYPE])
        worker = await stack.start_worker()
        gate = arm(stack, LOOKUP_GATE)
        await sessions.start_session("s2", "lookup")
        killed = await gate.wait_until_reached()
        # The other read finished first (on a loaded machine it may still be running at the gate,
        # and then it rightly runs again too): only the gated one is cut off by the kill.
        await wait_for_agent_snapshot(sessions, "s2", lambda s: any(
            c.tool_call_id == "b" and c.status is AgentToolCallStatus.SUCCEEDED for c in s.tool_calls),
            description="read b's result")
        worker.kill()
        await stack.start_worker()
        await gate.wait_until_reached(other_than=killed)
        gate.release()
        snapshot = await wait_for_agent_snapshot(sessions, "s2", turn_ended(1), description="turn 1")
        assert snapshot.messages[-1].text == "order=order 7 shipped customer=customer c9 is gold"
        log = InvocationLog(stack.state_dir / "invocations.jsonl")
        assert log.count("tool", tool_call_id="a") == 2 and log.count("tool", tool_call_id="b") == 1
        assert log.count("model", turn_id="turn-1") == 2

        assert await sessions.send_user_message("s2", "report")
        snapshot = await wait_for_agent_snapshot(sessions, "s2", turn_ended(2), description="turn 2")
        assert (snapshot.messages[-1].text or "").startswith("report: job-")
        assert snapshot.messages[-1].text.endswith(" done")  # type: ignore[union-attr]
        steps = executed_steps(await stack.read_step_history("s2"))
        assert CALL_TOOL in steps and POLL_TOOL_TASK in steps

        assert await sessions.send_user_message("s2", "think")
        snapshot = await wait_for_agent_snapshot(sessions, "s2", turn_ended(3), description="turn 3")
        assert [m.text for m in snapshot.messages[-3:]] == ["think", "let me think", "thought it through"]


async def test_cancel_turn_stores_the_runners_unfinished_messages(tmp_path: Path) -> None:
    """cancel_turn while a read runs: the started read finishes, the other waits for nothing, and the
    turn ends with build_unfinished_turn_messages' tool results (not the session's note)."""
    stack, flows = stack_of(tmp_path)
    async with stack:
        sessions = stack.sessions(flows[FLOW_TYPE])
        await stack.start_worker()
        gate = arm(stack, LOOKUP_GATE)
        await sessions.start_session("s3", "lookup")
        await gate.wait_until_reached()
        assert await sessions.cancel_turn("s3")
        gate.release()
        snapshot = await wait_for_agent_snapshot(sessions, "s3", turn_ended(1), description="turn 1")
        assert all(c.status is not AgentToolCallStatus.PENDING for c in snapshot.tool_calls)
        tool_messages = {m.tool_call_id: m.tool_output for m in snapshot.messages if m.role is MessageRole.TOOL}
        assert tool_messages == {"a": "order 7 shipped", "b": "customer c9 is gold"}
        assert not any((m.text or "").startswith("[Dex]") for m in snapshot.messages)


@pytest.mark.parametrize("flow_type", [COMPACTING_FLOW_TYPE, AWAITED_ESTIMATE_FLOW_TYPE])
async def test_the_context_window_scenario_passes_for_the_adapter_on_a_worker_child(
    tmp_path: Path, flow_type: str
) -> None:
    """The scenario on a Worker child, also for an adapter whose estimate_input_tokens and
    select_compaction_cutoff are async (RunModel awaits them). Catches: the scenario called the
    estimate without awaiting it and failed with "estimate_input_tokens returned <coroutine ...>"
    for an adapter the session runs fine."""
    stack, flows = stack_of(tmp_path)
    async with stack:
        await stack.start_worker()
        report = await ContextWindowSessionScenario(stack.sessions(flows[flow_type]), turns=30).run()
    assert report.summary.generation >= 2 and report.deleted_before_sequence is not None
    assert "ORCHID-0001" in report.summary.text
