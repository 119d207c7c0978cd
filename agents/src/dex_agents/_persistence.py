"""The session's persistence schema, shared by every agent Flow type (seed 002, "Persistence schema")."""

from __future__ import annotations

from typing import Any

from dex_engine import Attribute, AttributeMap, Channel, ChannelMap, Stream

from ._constants import DEFAULT_AGENT_EVENTS_CAPACITY_BYTES
from ._policy import count_problem, shown
from ._wire import (
    AgentEvent,
    AgentInterrupt,
    AgentInterruptResolution,
    AgentMessage,
    AgentMessageChunk,
    AgentMessageIndex,
    AgentPlan,
    AgentState,
    AgentToolCall,
    AgentUsage,
    AgentUserMessage,
    ContextSummary,
    JsonObject,
    PlanExecutionRequest,
    ToolCallCancellation,
    ToolCallCompleted,
    TurnCancellationRequest,
    TurnControlRequest,
    TurnReplySequence,
    TurnSessionSettings,
)

AGENT_STATE: Attribute[AgentState] = Attribute("AgentState", AgentState)
AGENT_MESSAGES: AttributeMap[AgentMessage] = AttributeMap("AgentMessages", AgentMessage)
AGENT_MESSAGE_CHUNKS: AttributeMap[AgentMessageChunk] = AttributeMap("AgentMessageChunks", AgentMessageChunk)
AGENT_MESSAGE_INDEX: Attribute[AgentMessageIndex] = Attribute("AgentMessageIndex", AgentMessageIndex)
TURN_REPLY_SEQUENCE: Attribute[TurnReplySequence] = Attribute("TurnReplySequence", TurnReplySequence)
FRAMEWORK_RUN_STATE: Attribute[str] = Attribute("FrameworkRunState", str)
AGENT_TOOL_CALLS: AttributeMap[AgentToolCall] = AttributeMap("AgentToolCalls", AgentToolCall)
PENDING_INTERRUPTS: Attribute[list[AgentInterrupt]] = Attribute("PendingInterrupts", list[AgentInterrupt])
AGENT_USAGE: Attribute[AgentUsage] = Attribute("AgentUsage", AgentUsage)
QUEUED_USER_MESSAGES: Channel[AgentUserMessage] = Channel("QueuedUserMessages", AgentUserMessage)
INTERRUPT_RESOLUTIONS: ChannelMap[AgentInterruptResolution] = ChannelMap(
    "InterruptResolutions", AgentInterruptResolution
)
TOOL_CALL_RESULTS: Channel[ToolCallCompleted] = Channel("ToolCallResults", ToolCallCompleted)
STEERED_USER_MESSAGES: Channel[AgentUserMessage] = Channel("SteeredUserMessages", AgentUserMessage)
TURN_CONTROL_REQUESTS: Channel[TurnControlRequest] = Channel("TurnControlRequests", TurnControlRequest)
TURN_CANCELLATION_REQUEST: Attribute[TurnCancellationRequest] = Attribute(
    "TurnCancellationRequest", TurnCancellationRequest
)
TOOL_CALL_CANCELLATIONS: ChannelMap[ToolCallCancellation] = ChannelMap("ToolCallCancellations", ToolCallCancellation)
# Whether a turn is steered ("SteeredUserMessages is not empty") as committed state a Step can read:
# a Step sees a Channel only by waiting on it, which would consume it. steer_user_message adds one
# to SteeredMessageCount per message it publishes to SteeredUserMessages, and ApplyTurnControl, the
# only consumer, adds what it consumed to AppliedSteeredMessageCount. Each has one writer, so no
# commit loses another's update; the turn is steered while the first is larger (docs/agents.md,
# "Steering and cancellation").
STEERED_MESSAGE_COUNT: Attribute[int] = Attribute("SteeredMessageCount", int)
APPLIED_STEERED_MESSAGE_COUNT: Attribute[int] = Attribute("AppliedSteeredMessageCount", int)
AGENT_TRACE_CONTEXT: Attribute[str] = Attribute("AgentTraceContext", str)
AGENT_PLAN: Attribute[AgentPlan] = Attribute("AgentPlan", AgentPlan)
PLAN_EXECUTIONS: ChannelMap[PlanExecutionRequest] = ChannelMap("PlanExecutions", PlanExecutionRequest)
PENDING_PLAN_EXECUTION: Attribute[PlanExecutionRequest] = Attribute("PendingPlanExecution", PlanExecutionRequest)
CONTEXT_SUMMARY: Attribute[ContextSummary] = Attribute("ContextSummary", ContextSummary)
SESSION_SETTINGS: Attribute[JsonObject] = Attribute("SessionSettings", dict[str, Any])
TURN_SESSION_SETTINGS: Attribute[TurnSessionSettings] = Attribute("TurnSessionSettings", TurnSessionSettings)

AGENT_EVENTS_STREAM_NAME = "AgentEvents"


def agent_events_stream(capacity_bytes: int = DEFAULT_AGENT_EVENTS_CAPACITY_BYTES) -> Stream[AgentEvent]:
    """The AgentEvents Stream of one agent Flow type; its capacity is set per Flow type."""
    return Stream(AGENT_EVENTS_STREAM_NAME, AgentEvent, capacity_bytes)


def message_sequence_key(sequence: int) -> str:
    """AgentMessages / AgentMessageChunks key: the sequence as 12-digit zero-padded decimal."""
    if isinstance(sequence, bool) or not isinstance(sequence, int) or not 0 < sequence < 10**12:
        raise ValueError(f"message sequence must be a whole number from 1 to 10**12 - 1, got {shown(sequence)}")
    return f"{sequence:012d}"


def plan_execution_key(revision: int) -> str:
    """PlanExecutions key: the plan revision as decimal."""
    problem = count_problem("plan revision", revision)
    if problem is not None:
        raise ValueError(problem)
    return str(revision)


def session_schema(events: Stream[AgentEvent]) -> list[Any]:
    """Every schema item of an agent session Flow, in the seed's order."""
    return [
        AGENT_STATE, AGENT_MESSAGES, AGENT_MESSAGE_CHUNKS, AGENT_MESSAGE_INDEX, TURN_REPLY_SEQUENCE,
        FRAMEWORK_RUN_STATE, AGENT_TOOL_CALLS, PENDING_INTERRUPTS, AGENT_USAGE, QUEUED_USER_MESSAGES,
        INTERRUPT_RESOLUTIONS, TOOL_CALL_RESULTS, STEERED_USER_MESSAGES, TURN_CONTROL_REQUESTS,
        TURN_CANCELLATION_REQUEST, TOOL_CALL_CANCELLATIONS, STEERED_MESSAGE_COUNT, APPLIED_STEERED_MESSAGE_COUNT,
        AGENT_TRACE_CONTEXT, AGENT_PLAN, PLAN_EXECUTIONS,
        PENDING_PLAN_EXECUTION, CONTEXT_SUMMARY, SESSION_SETTINGS, TURN_SESSION_SETTINGS, events,
    ]
