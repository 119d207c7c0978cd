"""Samples the docs and seeds show, run as written (or as close as this engine allows).

Seed 004's session Flow (the built-in loop's guide) is built with the names it uses.
"""

from __future__ import annotations

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
from dex_agents.testing import wait_for_agent_snapshot
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
