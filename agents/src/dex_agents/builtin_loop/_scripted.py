"""ScriptedModelClient: answers each model call from a function of the request, with no model key."""

from __future__ import annotations

import hashlib
import inspect
import json
import sys
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from .._compaction import estimate_text_tokens
from .._constants import CONTEXT_SUMMARY_INSTRUCTIONS
from .._policy import shown
from .._wire import AgentUsage
from ._model import (
    ModelOutputItem,
    ModelOutputWriter,
    ModelRequest,
    ModelResponse,
    ModelToolCall,
    OutputItemKind,
    ToolResultInput,
    UserTextInput,
    estimate_request_tokens,
)

SCRIPTED_API = "scripted"

# Hex digits of the request digest in a derived tool call ID: 48 bits, no repeat within a session.
SCRIPTED_CALL_ID_DIGEST_CHARS = 12
# Requests a ScriptedModelClient keeps for inspection by default.
DEFAULT_MAX_RECORDED_REQUESTS = 100


@dataclass(frozen=True)
class ScriptedToolCall:
    """A tool call of a scripted reply; without an ID, a deterministic one is derived from the request."""

    name: str
    arguments: str | dict[str, object] = field(default_factory=dict)
    tool_call_id: str | None = None

    def __post_init__(self) -> None:
        # Checked when written: inside a model call, a wrong field would fail RunModel three times
        # with an AttributeError from deep inside the client.
        if not isinstance(self.name, str):
            raise TypeError(f"ScriptedToolCall.name must be the tool's name as a str, got {shown(self.name)}")
        if isinstance(self.arguments, dict):
            try:
                json.dumps(self.arguments)
            except (TypeError, ValueError) as exc:
                raise TypeError(f"ScriptedToolCall.arguments of {self.name!r} must be JSON-serializable: {exc}; "
                                "pass JSON values, or the arguments' JSON text as a str") from None
        elif not isinstance(self.arguments, str):
            raise TypeError(f"ScriptedToolCall.arguments of {self.name!r} must be a dict or its JSON text as a "
                            f"str, got {shown(self.arguments)}")
        if self.tool_call_id is not None and not isinstance(self.tool_call_id, str):
            raise TypeError(f"ScriptedToolCall.tool_call_id of {self.name!r} must be a str or None (derived), "
                            f"got {shown(self.tool_call_id)}")


@dataclass(frozen=True)
class ScriptedModelReply:
    text: str | None = None
    tool_calls: Sequence[ScriptedToolCall] = ()
    reasoning: str | None = None

    def __post_init__(self) -> None:
        for name in ("text", "reasoning"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise TypeError(f"ScriptedModelReply.{name} must be a str or None, got {shown(value)}")
        calls = self.tool_calls
        if isinstance(calls, (str, bytes, ScriptedToolCall)) or not isinstance(calls, Sequence):
            raise TypeError(f"ScriptedModelReply.tool_calls must be a list of ScriptedToolCall (one call as "
                            f"[call]), got {shown(calls)}")
        for index, call in enumerate(calls):
            if not isinstance(call, ScriptedToolCall):
                raise TypeError(f"ScriptedModelReply.tool_calls[{index}] must be a ScriptedToolCall, got "
                                f"{shown(call)}; write ScriptedToolCall(name, arguments)")
        # Frozen like the reply's other fields: a list the script keeps changing would change the reply.
        object.__setattr__(self, "tool_calls", tuple(calls))


Respond = Callable[[ModelRequest], ScriptedModelReply | Awaitable[ScriptedModelReply]]
# Answers a context summary request (see ScriptedModelClient.is_summary_request) with the summary text.
Summarize = Callable[[ModelRequest], str | Awaitable[str]]
# How much of the last user text the default summary quotes.
DEFAULT_SUMMARY_QUOTE_CHARS = 200


class ScriptedModelClient:
    """A ModelClient whose replies come from `respond(request)`, sync or async.

    Keep `respond` deterministic: a crashed RunModel calls it again with the same request. A context
    summary request (compaction) goes to `summarize` instead, or gets `default_summary`.
    """

    def __init__(self, respond: Respond, *, summarize: Summarize | None = None,
                 max_recorded_requests: int = DEFAULT_MAX_RECORDED_REQUESTS) -> None:
        if not callable(respond):
            raise TypeError(f"respond must be a function of the ModelRequest, got {shown(respond, None)}")
        if summarize is not None and not callable(summarize):
            raise TypeError(f"summarize must be a function of the ModelRequest, got {shown(summarize, None)}")
        self._summarize = summarize
        # At most sys.maxsize: a deque's maxlen, past which it raised a bare OverflowError.
        if isinstance(max_recorded_requests, bool) or not isinstance(max_recorded_requests, int) or not (
            0 <= max_recorded_requests <= sys.maxsize
        ):
            raise ValueError(f"max_recorded_requests must be a whole number from 0 to {sys.maxsize}, got "
                             f"{shown(max_recorded_requests, None)}")
        self._respond = respond
        self.requests: deque[ModelRequest] = deque(maxlen=max_recorded_requests)

    @staticmethod
    def user_texts(request: ModelRequest) -> list[str]:
        """Every user text of the request, oldest first."""
        return [entry.text for entry in request.input if isinstance(entry, UserTextInput)]

    @staticmethod
    def is_summary_request(request: ModelRequest) -> bool:
        """A built-in loop context summary request: CONTEXT_SUMMARY_INSTRUCTIONS and no tools."""
        return request.instructions == CONTEXT_SUMMARY_INSTRUCTIONS and not request.tools

    @staticmethod
    def default_summary(request: ModelRequest) -> str:
        """A short deterministic summary: how many items it folds in and the last user text (not a note)."""
        texts = [t for t in ScriptedModelClient.user_texts(request) if not t.startswith("[Dex]")]
        last = texts[-1][:DEFAULT_SUMMARY_QUOTE_CHARS] if texts else ""
        return f"Scripted summary of {len(request.input)} input items. The last user message was: {last}"

    @staticmethod
    def tool_results(request: ModelRequest) -> list[ToolResultInput]:
        """The tool results the request ends with: those of the previous model response."""
        trailing: list[ToolResultInput] = []
        for entry in reversed(request.input):
            if not isinstance(entry, ToolResultInput):
                break
            trailing.append(entry)
        return trailing[::-1]

    def estimate_input_tokens(self, request: ModelRequest) -> int:
        return estimate_request_tokens(request)

    def supports_forced_tool_choice(self, settings: object) -> bool:
        return True

    async def call_model(self, request: ModelRequest, output: ModelOutputWriter) -> ModelResponse:
        self.requests.append(request)
        if self.is_summary_request(request):
            return await self._summary(request)
        reply = self._respond(request)
        if inspect.isawaitable(reply):
            reply = await reply
        if not isinstance(reply, ScriptedModelReply):
            raise TypeError(f"the script returned {shown(reply)}; return a ScriptedModelReply")
        items: list[ModelOutputItem] = []
        # Derived from the whole input: the same for a RunModel that runs again, and new for every
        # later request of the turn, even after compaction has made its input shorter.
        request_digest = _digest(request.input) if reply.tool_calls else ""
        if reply.reasoning:
            output.write_reasoning_delta(reply.reasoning)
            items.append(_item(OutputItemKind.REASONING, {"type": "reasoning", "text": reply.reasoning},
                               text=reply.reasoning))
        if reply.text:
            output.write_text_delta(reply.text)
            items.append(_item(OutputItemKind.TEXT, {"type": "text", "text": reply.text}, text=reply.text))
        for index, call in enumerate(reply.tool_calls):
            arguments = call.arguments if isinstance(call.arguments, str) else json.dumps(call.arguments)
            call_id = call.tool_call_id or f"call_{request_digest}_{index}"
            items.append(_item(
                OutputItemKind.TOOL_CALL,
                {"type": "tool_call", "id": call_id, "name": call.name, "arguments": arguments},
                tool_call=ModelToolCall(call_id, call.name, arguments),
            ))
        produced = sum(estimate_text_tokens(i.item) for i in items)
        usage = AgentUsage(model_calls=1, input_tokens=estimate_request_tokens(request), output_tokens=produced)
        return ModelResponse(tuple(items), usage)

    async def _summary(self, request: ModelRequest) -> ModelResponse:
        text = self.default_summary(request) if self._summarize is None else self._summarize(request)
        if inspect.isawaitable(text):
            text = await text
        if not isinstance(text, str):
            raise TypeError(f"summarize returned {shown(text)}; return the summary text")
        item = _item(OutputItemKind.TEXT, {"type": "text", "text": text}, text=text)
        usage = AgentUsage(model_calls=1, input_tokens=estimate_request_tokens(request),
                           output_tokens=estimate_text_tokens(item.item))
        return ModelResponse((item,), usage)


def _digest(items: tuple[object, ...]) -> str:
    return hashlib.sha256(repr(items).encode("utf-8", "surrogatepass")).hexdigest()[:SCRIPTED_CALL_ID_DIGEST_CHARS]


def _item(kind: OutputItemKind, raw: dict[str, object], *, text: str | None = None,
          tool_call: ModelToolCall | None = None) -> ModelOutputItem:
    return ModelOutputItem(SCRIPTED_API, kind, json.dumps(raw, separators=(",", ":")), text, tool_call)

