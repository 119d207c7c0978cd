"""dex_agents.builtin_loop: agents defined in Dex terms, with no framework.

Each RunModel makes exactly one model call through a ModelClient, and every tool call is its own Step.
"""

from .._compaction import build_context_summary_omission_note, estimate_text_tokens
from .._constants import CONTEXT_SUMMARY_INSTRUCTIONS, CONTEXT_SUMMARY_NOTE_HEADER, MAX_CONSECUTIVE_TURN_CONTINUATIONS
from ._definition import (
    DEFAULT_MAX_MODEL_CALLS_PER_TURN,
    AgentDefinition,
    ContinueTurn,
    InstructionContext,
    TurnContinuation,
    TurnContinuationContext,
)
from ._flow import builtin_agent_session_flow, builtin_agent_session_options, stepwise_agent_session_flow
from ._function_tools import FunctionTool, ToolCallContext, function_tool
from ._loop_runner import TURN_CONTINUATION_LIMIT_ERROR, BuiltinLoopAgentRunner, model_call_limit_result
from ._model import (
    ModelClient,
    ModelInputItem,
    ModelOutputItem,
    ModelOutputWriter,
    ModelRequest,
    ModelResponse,
    ModelToolCall,
    ModelToolDefinition,
    OutputItemKind,
    ToolChoice,
    ToolResultInput,
    UserTextInput,
    estimate_request_tokens,
)
from ._scripted import ScriptedModelClient, ScriptedModelReply, ScriptedToolCall
from ._tool_sources import DEFAULT_TOOL_SOURCE_LISTING_TIMEOUT_SECONDS, ToolSource, wrap_source_reference

__all__ = [
    "CONTEXT_SUMMARY_INSTRUCTIONS",
    "CONTEXT_SUMMARY_NOTE_HEADER",
    "DEFAULT_MAX_MODEL_CALLS_PER_TURN",
    "DEFAULT_TOOL_SOURCE_LISTING_TIMEOUT_SECONDS",
    "MAX_CONSECUTIVE_TURN_CONTINUATIONS",
    "TURN_CONTINUATION_LIMIT_ERROR",
    "AgentDefinition",
    "BuiltinLoopAgentRunner",
    "ContinueTurn",
    "FunctionTool",
    "InstructionContext",
    "ModelClient",
    "ModelInputItem",
    "ModelOutputItem",
    "ModelOutputWriter",
    "ModelRequest",
    "ModelResponse",
    "ModelToolCall",
    "ModelToolDefinition",
    "OutputItemKind",
    "ScriptedModelClient",
    "ScriptedModelReply",
    "ScriptedToolCall",
    "ToolCallContext",
    "ToolChoice",
    "ToolResultInput",
    "ToolSource",
    "TurnContinuation",
    "TurnContinuationContext",
    "UserTextInput",
    "build_context_summary_omission_note",
    "builtin_agent_session_flow",
    "builtin_agent_session_options",
    "estimate_request_tokens",
    "estimate_text_tokens",
    "function_tool",
    "model_call_limit_result",
    "stepwise_agent_session_flow",
    "wrap_source_reference",
]
