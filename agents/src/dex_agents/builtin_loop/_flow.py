"""builtin_agent_session_flow (also stepwise_agent_session_flow): an AgentDefinition as a session Flow."""

from __future__ import annotations

from dex_engine import InvalidIdError

from .._options import AgentSessionOptions
from .._policy import shown
from .._session_flow import AgentSessionFlow
from ._definition import AgentDefinition
from ._loop_runner import BuiltinLoopAgentRunner


def builtin_agent_session_options(definition: AgentDefinition) -> AgentSessionOptions:
    """The session options an AgentDefinition implies: its tools' policies, effects, deadlines, capacity."""
    return AgentSessionOptions(
        tool_policies=definition.merged_tool_policies(),
        default_tool_effect=definition.default_tool_effect,
        agent_events_capacity_bytes=definition.event_stream_capacity_bytes,
        interrupt_deadline=definition.interrupt_deadline,
        built_in_tools=definition.enabled_built_in_tools,
        max_durable_wait=definition.max_durable_wait,
        plan_mode_enabled=definition.plan_mode_enabled,
        compaction=definition.compaction,
    )


def builtin_agent_session_flow(definition: AgentDefinition, flow_type: str | None = None) -> AgentSessionFlow:
    """The session Flow of a built-in loop agent; `flow_type` defaults to the definition's name."""
    runner, options = BuiltinLoopAgentRunner(definition), builtin_agent_session_options(definition)
    if flow_type is not None:
        return AgentSessionFlow(runner, flow_type, options)
    try:
        return AgentSessionFlow(runner, definition.name, options)
    except InvalidIdError as exc:
        # The flow type is the only ID the caller gives here; without flow_type it is the agent's
        # name, which the caller wrote as a name ("Support Agent"), never as a flow type.
        raise InvalidIdError(f"the AgentDefinition's name {shown(definition.name)} is the flow type when "
                             f"flow_type is not given, and {exc}; pass flow_type= (such as 'SupportAgent') "
                             "or rename the agent") from exc


# Seed 004, the built-in loop's guide, builds its agent with this name, and seed 003 with the one above;
# both seeds are contracts, so code written from either runs.
stepwise_agent_session_flow = builtin_agent_session_flow
