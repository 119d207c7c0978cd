"""How the built-in loop stores items: provider-neutral user text and tool results, provider-exact output."""

from __future__ import annotations

import json
import threading
from typing import Any

from .._constants import INPUT_ITEM_CACHE_CHARS, INPUT_ITEM_CACHE_ENTRIES
from .._message_store import message_chars
from .._runner import FrameworkMessage
from .._wire import AgentMessage, MessageRole
from ._model import ModelInputItem, ModelOutputItem, ModelToolCall, OutputItemKind, ToolResultInput, UserTextInput

USER_TEXT = "user_text"
MODEL_OUTPUT = "model_output"
TOOL_RESULT = "tool_result"


def _dump(value: dict[str, Any]) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


# A user text and a tool's output are stored once, in the message's `text` and `tool_output`, not
# again in its framework item: stored twice, one of half the value limit failed the turn's commit.
# Likewise a model's answer text and a tool call's arguments, which the message holds in `text` and
# `tool_arguments`: the framework item keeps only the provider's own item, where they appear again.


def user_message(text: str) -> FrameworkMessage:
    return FrameworkMessage(MessageRole.USER, _dump({"type": USER_TEXT}), text=text)


def output_message(item: ModelOutputItem) -> FrameworkMessage:
    call = item.tool_call
    shown = item.kind is OutputItemKind.TEXT
    raw: dict[str, Any] = {"type": MODEL_OUTPUT, "api": item.api, "kind": item.kind.value, "item": item.item}
    if not shown:
        raw["text"] = item.text  # a reasoning text has no message field of its own
    raw["tool_call"] = None if call is None else {"tool_call_id": call.tool_call_id, "tool_name": call.tool_name}
    return FrameworkMessage(
        MessageRole.ASSISTANT, _dump(raw), text=item.text if shown else None,
        tool_call_id=None if call is None else call.tool_call_id, tool_name=None if call is None else call.tool_name,
        tool_arguments=None if call is None else call.arguments,
    )


def stored_output_item(raw: dict[str, Any], text: str | None, tool_arguments: str | None) -> ModelOutputItem:
    """The output item of a MODEL_OUTPUT framework item, with the message's `text` and
    `tool_arguments`, which the framework item holds itself only in messages of dex-agents 0.1."""
    held = raw.get("text")
    call = raw.get("tool_call")
    arguments = call.get("arguments") if isinstance(call, dict) else None
    return ModelOutputItem(
        api=str(raw["api"]), kind=OutputItemKind(raw["kind"]), item=str(raw["item"]),
        text=held if "text" in raw else text,
        tool_call=None if not isinstance(call, dict) else ModelToolCall(
            str(call["tool_call_id"]), str(call["tool_name"]),
            arguments if isinstance(arguments, str) else tool_arguments or "",
        ),
    )


def tool_result_message(result: ToolResultInput) -> FrameworkMessage:
    raw = {"type": TOOL_RESULT, "tool_call_id": result.tool_call_id, "tool_name": result.tool_name}
    return FrameworkMessage(MessageRole.TOOL, _dump(raw), tool_call_id=result.tool_call_id,
                            tool_name=result.tool_name, tool_output=result.output)


def stored_text(raw: dict[str, Any], field: str, stored: str | None) -> str:
    """A user text or tool output: from the message (`stored`), or from the framework item of a
    message written before they were stored once (sessions of dex-agents 0.1)."""
    held = raw.get(field)
    return held if isinstance(held, str) else stored or ""


# Items are frozen and a function of the (frozen) message alone, so every model call of every
# session in this process can share them.
class _ParsedItems:
    """Input items by stored message; the oldest entries go first past `max_entries` entries or
    `max_chars` characters of their messages' texts (message_chars). Bounded by entries alone,
    messages with large tool outputs kept gigabytes alive that the engine's byte-bounded caches
    had let go."""

    def __init__(self, max_entries: int, max_chars: int) -> None:
        self.items: dict[AgentMessage, tuple[ModelInputItem, int]] = {}
        self.chars = 0  # the message_chars of the messages in `items`
        self._max_entries = max_entries
        self._max_chars = max_chars
        self._lock = threading.Lock()  # model calls of one flow type may run on several threads

    def keep(self, message: AgentMessage, item: ModelInputItem) -> None:
        size = message_chars(message)
        with self._lock:
            if message in self.items:  # another thread parsed it meanwhile
                return
            self.items[message] = (item, size)
            self.chars += size
            while len(self.items) > self._max_entries or self.chars > self._max_chars:
                self.chars -= self.items.pop(next(iter(self.items)))[1]


_parsed = _ParsedItems(INPUT_ITEM_CACHE_ENTRIES, INPUT_ITEM_CACHE_CHARS)


def input_item(message: AgentMessage) -> ModelInputItem:
    """The model input item of a stored message; items another runner stored fall back to their text."""
    hit = _parsed.items.get(message)  # unlocked: a dict lookup is atomic, and this is every message of every call
    if hit is not None:
        return hit[0]
    item = _parse(message)
    _parsed.keep(message, item)
    return item


def _parse(message: AgentMessage) -> ModelInputItem:
    try:
        raw = json.loads(message.framework_item)
    except ValueError:
        raw = None
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind == MODEL_OUTPUT and isinstance(raw, dict):
        return stored_output_item(raw, message.text, message.tool_arguments)
    if kind == TOOL_RESULT and isinstance(raw, dict):
        return ToolResultInput(str(raw["tool_call_id"]), str(raw["tool_name"]),
                               stored_text(raw, "output", message.tool_output))
    if kind == USER_TEXT and isinstance(raw, dict):
        return UserTextInput(stored_text(raw, "text", message.text))
    if message.role is MessageRole.TOOL:
        return ToolResultInput(message.tool_call_id or "", message.tool_name or "", message.tool_output or "")
    if message.role is MessageRole.ASSISTANT:
        text = message.text or ""
        return ModelOutputItem("foreign", OutputItemKind.TEXT, _dump({"type": "text", "text": text}), text)
    return UserTextInput(message.text or "")
