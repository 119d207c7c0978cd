"""Tool sources: tools listed at run time (e.g. an MCP server's), and how their calls find them again."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

from .._policy import shown
from .._runner import AgentTurnContext, DeferredToolCall, DeferredToolExecution
from ._model import ModelToolCall, ModelToolDefinition

# Listing a source may not hold up a model call longer than this; a slow source offers no tools.
DEFAULT_TOOL_SOURCE_LISTING_TIMEOUT_SECONDS = 10.0

STEPWISE_TOOL_SOURCE_KEY = "stepwise_tool_source"


@runtime_checkable
class ToolSource(Protocol):
    """Tools listed at run time. `source_name` must be unique in an agent and stable across deploys.

    Optional, each reached with the call's own reference: `poll_tool_task` and `cancel_tool_task`
    (its calls may return ToolTaskStarted), `tool_call_step_options` (a call's tool Step timeout
    and retry), `declared_tool_names()` (checked when the agent is built) and `cached_tools()`.
    """

    source_name: str

    async def list_tools(self) -> Sequence[ModelToolDefinition]: ...

    def deferred_tool_call(
        self, call: ModelToolCall, listed_tool: ModelToolDefinition, turn: AgentTurnContext
    ) -> DeferredToolCall: ...

    async def execute_deferred_tool_call(self, call: DeferredToolExecution) -> Any: ...


def wrap_source_reference(source_name: str, reference: str | None) -> str:
    """The reference stored on the call's record: the source's name and the source's own reference."""
    return json.dumps({STEPWISE_TOOL_SOURCE_KEY: source_name, "reference": reference}, separators=(",", ":"))


def unwrap_source_reference(stored: str | None) -> tuple[str, str | None] | None:
    """(source name, the source's reference) of a stored reference, or None for a function tool's call."""
    if stored is None:
        return None
    try:
        value = json.loads(stored)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get(STEPWISE_TOOL_SOURCE_KEY), str):
        return None
    reference = value.get("reference")
    return value[STEPWISE_TOOL_SOURCE_KEY], reference if isinstance(reference, str) else None


class DeclaredNamesError(ValueError):
    """A source's declared_tool_names() returned no list of names (not a ValueError it raised itself)."""


def declared_names(source: ToolSource) -> list[object]:
    """Names a source always lists (optional `declared_tool_names()`), checked when the agent is built.
    Raises DeclaredNamesError, naming the source, for a result that is not a list of names: text would be
    taken as one name per character, and anything else fail with a bare TypeError."""
    method = getattr(source, "declared_tool_names", None)
    if not callable(method):
        return []
    names: object = method()
    if isinstance(names, str | bytes) or not isinstance(names, Iterable):
        raise DeclaredNamesError(f"declared_tool_names() of tool source {shown(source.source_name)} returned "
                                 f"{shown(names)}; return a list of tool names")
    return list(names)
