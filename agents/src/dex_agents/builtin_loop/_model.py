"""The model-client contract of the built-in loop: requests, provider-exact output items, clients."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol, runtime_checkable

from dex_engine import NoRetryError

from .._compaction import estimate_text_tokens
from .._constants import CONTENT_FILTER_FINISH_REASONS, TOKEN_LIMIT_FINISH_REASONS
from .._events import AgentEventWriter
from .._policy import shown
from .._runner import ModelCallMetadata
from .._turn_logic import MAX_TOOL_CALL_ID_LENGTH
from .._wire import AgentUsage


class ModelOutputError(NoRetryError, TypeError):
    """A model client built a ModelResponse (or an item of one) with a field of the wrong type. A
    TypeError, and a NoRetryError: the client's code is wrong, so RunModel fails now instead of paying
    for the same call twice more."""


class OutputItemKind(StrEnum):
    TEXT = "text"
    REASONING = "reasoning"
    TOOL_CALL = "tool_call"


class ToolChoice(StrEnum):
    AUTO = "auto"
    REQUIRED = "required"
    NONE = "none"


@dataclass(frozen=True)
class ModelToolCall:
    """A tool call in a model's output: the provider's call ID, tool name and JSON argument text."""

    tool_call_id: str
    tool_name: str
    arguments: str

    def __post_init__(self) -> None:
        # Checked when written: a model client's wrong field failed RunModel three times (three paid
        # calls) with an AttributeError or a check from deep inside the loop.
        for name in ("tool_call_id", "tool_name", "arguments"):
            value: object = getattr(self, name)
            if not isinstance(value, str):
                hint = "; give the arguments' JSON text, json.dumps(arguments)" if name == "arguments" else ""
                raise ModelOutputError(f"ModelToolCall.{name} must be a str, got {shown(value)}{hint}")


@dataclass(frozen=True)
class ModelOutputItem:
    """One output item, provider-exact.

    `item` is the provider's own JSON text for the item, replayed byte for byte to the same `api`
    (encrypted reasoning and thinking signatures included). Another provider or API sees only
    `text` and `tool_call`; reasoning is dropped there.
    """

    api: str
    kind: OutputItemKind
    item: str
    text: str | None = None
    tool_call: ModelToolCall | None = None

    def __post_init__(self) -> None:
        # Checked when written, as ModelToolCall is: a kind given as text was taken for no tool call.
        for name in ("api", "item"):
            value: object = getattr(self, name)
            if not isinstance(value, str):
                hint = "; give the provider's item as JSON text" if name == "item" else ""
                raise ModelOutputError(f"ModelOutputItem.{name} must be a str, got {shown(value)}{hint}")
        kind: object = self.kind
        if not isinstance(kind, OutputItemKind):
            raise ModelOutputError(f"ModelOutputItem.kind must be an OutputItemKind, such as OutputItemKind.TEXT, "
                                   f"got {shown(kind)}")
        text: object = self.text
        if text is not None and not isinstance(text, str):
            raise ModelOutputError(f"ModelOutputItem.text must be a str or None, got {shown(text)}")
        call: object = self.tool_call
        if call is not None and not isinstance(call, ModelToolCall):
            raise ModelOutputError(f"ModelOutputItem.tool_call must be a ModelToolCall or None, got {shown(call)}; "
                                   "write ModelToolCall(tool_call_id, tool_name, arguments)")
        if call is not None and kind is not OutputItemKind.TOOL_CALL:
            # The loop runs only a TOOL_CALL item's call, but stored the call's ID with a text or
            # reasoning item all the same: the turn answered, and its next request held a call that
            # never ran, given an "outcome unknown" result.
            raise ModelOutputError(f"ModelOutputItem.tool_call is for OutputItemKind.TOOL_CALL items, got one on a "
                                   f"{kind.value!r} item; give the call an item of its own")


@dataclass(frozen=True)
class UserTextInput:
    """User text in provider-neutral form (a user message, a note, a continuation message)."""

    text: str


@dataclass(frozen=True)
class ToolResultInput:
    """A tool call's model-visible result in provider-neutral form."""

    tool_call_id: str
    tool_name: str
    output: str


ModelInputItem = UserTextInput | ToolResultInput | ModelOutputItem


# What providers accept as a function name: OpenAI and Anthropic take 1 to 64 of [A-Za-z0-9_-], and
# Gemini's FunctionDeclaration.name also must start with a letter or '_' (at most 64 characters).
_PROVIDER_TOOL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,63}")
PROVIDER_TOOL_NAME_RULE = (
    "a tool name is 1 to 64 characters of letters, digits, '_' and '-', starting with a letter or '_'"
)


def is_provider_tool_name(name: object) -> bool:
    """Whether every supported provider takes `name` as a function name (PROVIDER_TOOL_NAME_RULE)."""
    return isinstance(name, str) and _PROVIDER_TOOL_NAME.fullmatch(name) is not None


@dataclass(frozen=True)
class ModelToolDefinition:
    """A tool as offered to the model: name, description, JSON Schema of its arguments object."""

    name: str
    description: str
    parameters_schema: Mapping[str, Any]


@dataclass(frozen=True)
class ModelRequest:
    """One model call's whole input; clients keep no provider-side conversation state."""

    instructions: str | None
    input: tuple[ModelInputItem, ...]
    tools: tuple[ModelToolDefinition, ...] = ()
    tool_choice: ToolChoice = ToolChoice.AUTO
    model_settings: Mapping[str, Any] = field(default_factory=dict)
    session_settings: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelResponse:
    output: tuple[ModelOutputItem, ...]
    usage: AgentUsage = field(default_factory=AgentUsage)
    metadata: ModelCallMetadata | None = None

    def __post_init__(self) -> None:
        # Checked when written: one item given alone, or a dict for an item, failed RunModel three
        # times (three paid calls) with a bare TypeError or AttributeError from inside the loop.
        output: object = self.output
        if not isinstance(output, tuple | list):
            raise ModelOutputError(f"ModelResponse.output must be a tuple of ModelOutputItem (one item as (item,)), "
                                   f"got {shown(output)}")
        for index, item in enumerate(output):
            if not isinstance(item, ModelOutputItem):
                raise ModelOutputError(f"ModelResponse.output[{index}] must be a ModelOutputItem, got {shown(item)}")
        usage: object = self.usage
        if not isinstance(usage, AgentUsage):
            raise ModelOutputError(f"ModelResponse.usage must be an AgentUsage, got {shown(usage)}")
        metadata: object = self.metadata
        if metadata is not None and not isinstance(metadata, ModelCallMetadata):
            raise ModelOutputError(f"ModelResponse.metadata must be a ModelCallMetadata or None, got {shown(metadata)}")
        # Frozen like the response's other fields: a list the client keeps changing would change it.
        object.__setattr__(self, "output", tuple(output))


def returned_response(response: object) -> ModelResponse:
    """`response`, which a client's call_model returned, as a ModelResponse; anything else raises
    ModelOutputError, so the turn fails after this call rather than paying for two more alike."""
    if not isinstance(response, ModelResponse):
        raise ModelOutputError(f"call_model returned {type(response).__name__}; return a ModelResponse")
    return response


def token_limit_finish_reason(metadata: ModelCallMetadata | None) -> str | None:
    """The finish reason, as the client reported it, saying the response was cut at the output token
    limit (TOKEN_LIMIT_FINISH_REASONS), or None: a client that reports no finish reasons is never cut."""
    return _finish_reason_in(metadata, TOKEN_LIMIT_FINISH_REASONS)


def content_filter_finish_reason(metadata: ModelCallMetadata | None) -> str | None:
    """The finish reason saying the provider's content filter stopped the response
    (CONTENT_FILTER_FINISH_REASONS), or None."""
    return _finish_reason_in(metadata, CONTENT_FILTER_FINISH_REASONS)


def _finish_reason_in(metadata: ModelCallMetadata | None, names: frozenset[str]) -> str | None:
    reasons = metadata.finish_reasons if isinstance(metadata, ModelCallMetadata) else None
    for reason in reasons or ():
        if isinstance(reason, str) and reason.lower() in names:
            return reason
    return None


class ModelOutputWriter:
    """Where a client streams live output; writes go to the turn's AgentEvents (best effort)."""

    def __init__(self, events: AgentEventWriter) -> None:
        self._events = events

    def write_text_delta(self, text: str) -> None:
        if text:
            self._events.write_text_delta(text)

    def write_reasoning_delta(self, text: str) -> None:
        if text:
            self._events.write_reasoning_delta(text)


@runtime_checkable
class ModelClient(Protocol):
    """One request per call, no retries of its own (RunModel retries), the whole input every time."""

    async def call_model(self, request: ModelRequest, output: ModelOutputWriter) -> ModelResponse: ...

    def estimate_input_tokens(self, request: ModelRequest) -> int: ...


def estimate_request_tokens(request: ModelRequest) -> int:
    """A provider-independent estimate of a request's input size in tokens."""
    total = estimate_text_tokens(request.instructions or "")
    for entry in request.input:
        if isinstance(entry, UserTextInput):
            total += estimate_text_tokens(entry.text)
        elif isinstance(entry, ToolResultInput):
            total += estimate_text_tokens(entry.output) + estimate_text_tokens(entry.tool_name)
        else:
            total += estimate_text_tokens(entry.item)
    for tool in request.tools:
        total += estimate_text_tokens(tool.name + tool.description + json.dumps(dict(tool.parameters_schema)))
    return total


def unique_call_id(call_id: str, taken: set[str]) -> str:
    """`call_id`, or `<call_id>_<n>` with the least n from 1 that `taken` does not hold when it does;
    added to `taken`. Servers such as vLLM, llama.cpp and Ollama (with some chat templates) and some
    LiteLLM adapters number each response's calls afresh (call_0, call_1, ...) or give every call one
    ID: the session refuses an ID that repeats within a turn (seed 003), so such a server failed each
    turn at its second response with tools, or at once for two calls with one ID; and an ID repeated
    in a later turn made a late resolve_interrupt of an earlier call approve the later call. Made
    only of what the model call saw and returned, the new ID is the same on each RunModel attempt."""
    fresh, number = call_id, 0
    while fresh in taken:
        number += 1
        suffix = f"_{number}"
        fresh = call_id[:MAX_TOOL_CALL_ID_LENGTH - len(suffix)] + suffix  # room for the suffix in a long ID
    taken.add(fresh)
    return fresh
