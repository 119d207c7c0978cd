"""Compaction in the built-in loop (seed 003 "Compaction"): BuiltinLoopAgentRunner's ContextCompactionRunner.

The compacted model input starts with CONTEXT_SUMMARY_NOTE_HEADER and the summary. A cut falls only
between model responses whose tool calls all have stored results, so a turn with many tool calls
compacts mid-turn without separating a call from its result. The summary is one model call with
CONTEXT_SUMMARY_INSTRUCTIONS and no tools; when the request plus max_output_tokens would exceed the
budget, the oldest messages are left out up to such a cut, with build_context_summary_omission_note.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from .._compaction import (
    ContextSummaryRequest,
    ContextSummaryResult,
    build_context_summary_omission_note,
    choose_cutoff,
    context_summary_note,
    estimate_text_tokens,
)
from .._constants import CONTEXT_SUMMARY_INSTRUCTIONS, CONTEXT_SUMMARY_REQUEST_TEXT
from .._events import AgentEventWriter
from .._policy import shown
from .._runner import AgentTurnContext
from .._wire import AgentMessage, MessageRole
from ._items import input_item
from ._model import (
    ModelClient,
    ModelInputItem,
    ModelOutputItem,
    ModelOutputWriter,
    ModelRequest,
    OutputItemKind,
    ToolChoice,
    ToolResultInput,
    UserTextInput,
    estimate_request_tokens,
    returned_response,
    token_limit_finish_reason,
)

log = logging.getLogger(__name__)


def with_summary_note(turn: AgentTurnContext, items: list[ModelInputItem]) -> list[ModelInputItem]:
    """A compacted input starts with the summary note as user text."""
    if turn.context_summary is None:
        return items
    return [UserTextInput(context_summary_note(turn.context_summary)), *items]


def item_tokens(item: ModelInputItem) -> int:
    """One input item's share of estimate_request_tokens."""
    if isinstance(item, UserTextInput):
        return estimate_text_tokens(item.text)
    if isinstance(item, ToolResultInput):
        return estimate_text_tokens(item.output) + estimate_text_tokens(item.tool_name)
    return estimate_text_tokens(item.item)


def response_cuts(messages: Sequence[AgentMessage]) -> list[bool]:
    """valid[i]: a cut after messages[i] falls between model responses, and every tool call before it
    has its stored result before it.

    A response is a run of assistant items, so no cut falls between two of them. A call of an earlier
    turn that never got a result (the loop shows it as outcome unknown) does not block later cuts.
    """
    valid: list[bool] = []
    open_calls: set[str] = set()
    for position, message in enumerate(messages[:-1]):
        following = messages[position + 1]
        if message.tool_call_id is not None:
            if message.role is MessageRole.ASSISTANT:
                open_calls.add(message.tool_call_id)
            elif message.role is MessageRole.TOOL:
                open_calls.discard(message.tool_call_id)
        inside_response = message.role is MessageRole.ASSISTANT and following.role is MessageRole.ASSISTANT
        turn_ends = following.turn_id != message.turn_id
        valid.append(not inside_response and (not open_calls or turn_ends))
        if turn_ends:
            open_calls.clear()
    return valid


def select_response_cutoff(turn: AgentTurnContext, retained_token_budget: int) -> int | None:
    """The built-in loop's cutoff: keep what fits the budget, cutting only between complete responses."""
    messages = list(turn.messages)
    tokens = [item_tokens(input_item(m)) for m in messages]
    return choose_cutoff(messages, tokens, response_cuts(messages), retained_token_budget)


def estimate_model_input(model: ModelClient, request: ModelRequest) -> int:
    """The client's own estimate when it has one, else the provider-independent one."""
    estimate = getattr(model, "estimate_input_tokens", None)
    value = estimate(request) if callable(estimate) else estimate_request_tokens(request)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{type(model).__name__}.estimate_input_tokens returned {shown(value)}, not a whole number")
    return value


def max_output_tokens(model_settings: Mapping[str, Any]) -> int:
    """The configured max_output_tokens (or max_completion_tokens, OpenAI's newer name, or max_tokens),
    0 when unset."""
    for name in ("max_output_tokens", "max_completion_tokens", "max_tokens"):
        value = model_settings.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0


def summary_request(
    request: ContextSummaryRequest, model_settings: Mapping[str, Any], model: ModelClient
) -> tuple[ModelRequest, int]:
    """The summary model request, and how many of the oldest messages it leaves out to fit the budget."""
    messages = list(request.messages)
    cuts = [i + 1 for i, ok in enumerate(response_cuts(messages)) if ok]  # messages left out at each cut
    reserve = max_output_tokens(model_settings)

    def build(omitted: int) -> ModelRequest:
        items: list[ModelInputItem] = []
        if request.previous_summary is not None:
            items.append(UserTextInput(context_summary_note(request.previous_summary)))
        if omitted:
            items.append(UserTextInput(build_context_summary_omission_note(omitted)))
        items.extend(input_item(m) for m in messages[omitted:])
        items.append(UserTextInput(CONTEXT_SUMMARY_REQUEST_TEXT))
        return ModelRequest(
            instructions=CONTEXT_SUMMARY_INSTRUCTIONS, input=tuple(items), tools=(), tool_choice=ToolChoice.NONE,
            model_settings=model_settings, session_settings=request.session_settings,
        )

    built = build(0)
    omitted = 0
    for cut in cuts:
        if estimate_model_input(model, built) + reserve <= request.input_token_budget:
            break
        omitted = cut
        built = build(omitted)
    return built, omitted


async def summarize_with_model(
    request: ContextSummaryRequest, model_settings: Mapping[str, Any], model: ModelClient
) -> ContextSummaryResult:
    """One model call with CONTEXT_SUMMARY_INSTRUCTIONS and no tools; its text is the summary."""
    built, _ = summary_request(request, model_settings, model)
    # The summary is not the assistant's answer: its deltas are not streamed as text_delta events.
    quiet = AgentEventWriter(lambda event: None, request.turn_id, "", request.attempt)
    response = returned_response(await model.call_model(built, ModelOutputWriter(quiet)))
    text = "".join(_text_of(item) for item in response.output)
    cut = token_limit_finish_reason(response.metadata)
    if cut is not None:
        # Kept (a retry would pay for the same cut, and failing would stop every later turn), but said:
        # retention may delete the messages it summarizes, and the model should know it lacks their end.
        log.warning("flow %s turn %s: the context summary was cut at the model's output token limit (finish_reason "
                    "%r); raise max_output_tokens or max_tokens in the agent's model_settings", request.flow_id,
                    request.turn_id, cut)
        text += summary_cut_note(cut)
    return ContextSummaryResult(text, response.usage, response.metadata)


def summary_cut_note(finish_reason: str) -> str:
    """What a summary cut at the model's token limit ends with, for the model and whoever reads it."""
    return (f"\n[Dex: this summary was cut at the model's output token limit (finish_reason {finish_reason!r}); "
            "what followed is missing from it]")


def _text_of(item: ModelOutputItem) -> str:
    if item.kind is not OutputItemKind.TEXT:
        return ""
    if item.text is not None:
        return item.text
    try:
        raw = json.loads(item.item)
    except ValueError:
        return ""
    return str(raw.get("text") or "") if isinstance(raw, dict) else ""
