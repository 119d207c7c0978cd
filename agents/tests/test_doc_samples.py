"""Samples the docs and seeds show, run as written (or as close as this engine allows).

Seed 004's session Flow (the built-in loop's guide) is built with the names it uses; seed 003's
"Testing an adapter" test runs in a package of its own, with its Worker child.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
from agents.tests.builtin_agent import InProcessEngine

from dex_agents import AgentSessionFlow, BuiltInTool, CompactionPolicy
from dex_agents.builtin_loop import (
    AgentDefinition,
    ModelRequest,
    ScriptedModelClient,
    ScriptedModelReply,
    builtin_agent_session_flow,
    stepwise_agent_session_flow,
)
from dex_agents.testing import EXECUTE_COMPLETED_EVENT, AgentTestStack, wait_for_agent_snapshot
from dex_engine import FlowNotActiveOrNotFoundError


def _reply(request: ModelRequest) -> ScriptedModelReply:
    return ScriptedModelReply(text=f"Demo reply: {ScriptedModelClient.user_texts(request)[-1]}")


def build_ai_agent_session_flow(
    models: Sequence[str], system_prompt: str, context_window_tokens: int
) -> AgentSessionFlow:
    """Seed 004's build_ai_agent_session_flow, without the MCP and Slack tool sources (not built here)."""
    clients = {model: ScriptedModelClient(_reply) for model in models}
    definition = AgentDefinition(
        name="ai-agent",
        instructions=system_prompt,
        model=clients[models[0]],
        resolve_model=lambda settings: clients.get(str(settings.get("model")), clients[models[0]]),
        tool_sources=[],
        built_in_tools=frozenset(BuiltInTool),
        plan_mode_enabled=True,
        compaction=CompactionPolicy(context_window_tokens=context_window_tokens),
    )
    return stepwise_agent_session_flow(definition, flow_type="AIAgentSession")


async def test_seed_004_builds_its_session_flow_with_the_names_it_uses(tmp_path: Path) -> None:
    """Seed 004 builds its agent with stepwise_agent_session_flow, seed 003 with
    builtin_agent_session_flow: one function under both names. Catches: the seed's name did not exist,
    so its example failed to import; and its /events route catches FlowNotActiveOrNotFoundError."""
    assert stepwise_agent_session_flow is builtin_agent_session_flow
    flow = build_ai_agent_session_flow(["demo/dex", "demo/dex-mini"], "You help.", 128_000)
    engine = InProcessEngine(tmp_path, [flow])
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("ai-agent-1", "hello", session_settings={"model": "demo/dex-mini"})
        snapshot = await wait_for_agent_snapshot(
            sessions, "ai-agent-1", lambda s: s if len(s.messages) == 2 else None, description="the reply")
        assert snapshot.messages[-1].text == "Demo reply: hello"
        with pytest.raises(FlowNotActiveOrNotFoundError):
            await sessions.get_agent_snapshot("ai-agent-missing")
        await engine.client.stop_flow("ai-agent-1")
        with pytest.raises(FlowNotActiveOrNotFoundError):
            await sessions.send_user_message("ai-agent-1", "are you there?")


# Seed 003 "Testing an adapter": its two files and its test, as an adapter package would have them.

MY_AGENT = '''
from dex_agents import ToolEffect
from dex_agents.builtin_loop import (
    AgentDefinition, ModelRequest, ScriptedModelClient, ScriptedModelReply, ScriptedToolCall,
    builtin_agent_session_flow, function_tool,
)


@function_tool(effect=ToolEffect.NON_IDEMPOTENT_WRITE)
def refund_order(order_id: str) -> str:
    """Refund an order."""
    return f"refunded order {order_id}"


def _respond(request: ModelRequest) -> ScriptedModelReply:
    if ScriptedModelClient.tool_results(request):
        return ScriptedModelReply(text="done")
    return ScriptedModelReply(tool_calls=[ScriptedToolCall("refund_order", {"order_id": "7"})])


def build_flow():
    agent = AgentDefinition(name="my-agent", instructions="Refund what is asked.",
                            model=ScriptedModelClient(_respond), tools=[refund_order])
    return builtin_agent_session_flow(agent, "MyAgentSession")
'''

MY_WORKER = '''
# tests/my_worker.py: the Worker child.
from dex_agents.testing import run_agent_worker
from tests.my_agent import build_flow

if __name__ == "__main__":
    run_agent_worker([build_flow()])
'''


async def test_seed_003_testing_an_adapter_sample_runs_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seed 003's "Testing an adapter" test, as written, in a package of its own (tests/my_agent.py,
    tests/my_worker.py): the kit's names and arguments an adapter's own tests call (AgentTestStack's
    positional module name, worker_cwd and worker_env, start_worker, kill, sessions,
    wait_for_agent_snapshot's description, read_step_history, EXECUTE_COMPLETED_EVENT). The seed's
    test ends at reading the history; here the turn then ends with the write run once, after the kill.
    Catches: a renamed or reordered argument or name of the kit, which every adapter's tests would hit."""
    package_dir = tmp_path / "package"
    (package_dir / "tests").mkdir(parents=True)
    (package_dir / "tests" / "my_agent.py").write_text(MY_AGENT)
    (package_dir / "tests" / "my_worker.py").write_text(MY_WORKER)
    monkeypatch.syspath_prepend(str(package_dir))
    for name in [m for m in sys.modules if m == "tests" or m.startswith("tests.")]:
        monkeypatch.delitem(sys.modules, name)
    from tests.my_agent import build_flow  # type: ignore[import-not-found]  # written above

    PACKAGE_DIR = package_dir  # the seed's name for it

    # The seed's test body, as written.
    flow = build_flow()
    async with AgentTestStack(tmp_path, [flow], "tests.my_worker",
                              worker_cwd=PACKAGE_DIR,
                              worker_env={"MY_STATE_DIR": str(tmp_path)}) as stack:
        sessions = stack.sessions(flow)
        worker = await stack.start_worker()
        await sessions.start_session("session-1", "refund order 7")
        interrupt = await wait_for_agent_snapshot(
            sessions, "session-1",
            lambda snapshot: next(iter(snapshot.pending_interrupts), None),
            description="a pending approval")
        worker.kill()                    # SIGKILL while the session waits
        await stack.start_worker()       # replacement Worker
        assert await sessions.resolve_interrupt(
            "session-1", interrupt.interrupt_id, approved=True)
        history = await stack.read_step_history("session-1")
        executed = [entry.step_type for entry in history
                    if entry.event_type == EXECUTE_COMPLETED_EVENT]

        # What the seed's test leads up to: the approved write runs once and the turn ends.
        assert executed[:2] == ["StartAgentSession", "RunModel"]
        snapshot = await wait_for_agent_snapshot(
            sessions, "session-1",
            lambda s: s if s.state is not None and s.state.turn_count == 1 and s.state.active_turn_id is None
            else None,
            description="the turn's end")
        assert snapshot.messages[-1].text == "done"
        history = await stack.read_step_history("session-1")
        executed = [entry.step_type for entry in history if entry.event_type == EXECUTE_COMPLETED_EVENT]
        assert executed == ["StartAgentSession", "RunModel", "AwaitToolApproval", "CallSingleAttemptTool",
                            "ResumeTurn", "RunModel"]
        tool_messages = [m.tool_output for m in snapshot.messages if m.tool_call_id is not None and m.tool_output]
        assert tool_messages == ["refunded order 7"]
