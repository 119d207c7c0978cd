"""AgentDefinition: an agent in Dex terms (instructions, model, tools), and the hooks it takes."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from types import MappingProxyType
from typing import Any, Literal, TypeGuard

from .._builtin_tools import BuiltInTool
from .._compaction import CompactionPolicy
from .._constants import DEFAULT_AGENT_EVENTS_CAPACITY_BYTES, DEFAULT_MAX_DURABLE_WAIT, RUN_MODEL_TIMEOUT
from .._options import (
    AgentSessionOptions,
    events_capacity_problem,
    interrupt_deadline_problem,
    max_durable_wait_problem,
    tool_policy_entry_problems,
)
from .._policy import ToolPolicy, count_problem, policy_text, resolve_tool_policy, shown, tool_effect_problem
from .._wire import InteractionMode, JsonObject, ToolEffect
from ._compaction import max_output_tokens
from ._function_tools import FunctionTool
from ._model import ModelClient, ModelOutputItem, ToolResultInput
from ._tool_sources import (
    DEFAULT_TOOL_SOURCE_LISTING_TIMEOUT_SECONDS,
    DeclaredNamesError,
    ToolSource,
    declared_names,
)

# After this many model calls in one turn, the next call offers no tools and the turn ends.
DEFAULT_MAX_MODEL_CALLS_PER_TURN = 100


@dataclass(frozen=True)
class InstructionContext:
    """What an instructions function sees, evaluated in every RunModel."""

    flow_id: str
    turn_id: str
    session_settings: JsonObject
    interaction_mode: InteractionMode


@dataclass(frozen=True)
class ContinueTurn:
    """Continue the turn: `message` is stored as user text and the model is called again."""

    message: str


TurnContinuation = Literal["end", "default"] | ContinueTurn


@dataclass(frozen=True)
class TurnContinuationContext:
    """One loop iteration: a model call's output and the results of the tools it called (if any)."""

    flow_id: str
    turn_id: str
    session_settings: JsonObject
    model_output: Sequence[ModelOutputItem]
    tool_results: Sequence[ToolResultInput]


Instructions = str | Callable[[InstructionContext], str | Awaitable[str]]
DecideTurnContinuation = Callable[[TurnContinuationContext], TurnContinuation | Awaitable[TurnContinuation]]
ResolveModel = Callable[[JsonObject], ModelClient]
PlanningToolChoice = Literal["auto", "required"]


@dataclass(frozen=True)
class AgentDefinition:
    """An agent for the built-in loop. Checked when built: names, limits and tool name collisions."""

    name: str
    instructions: Instructions
    model: ModelClient
    model_settings: Mapping[str, Any] = field(default_factory=dict)
    tools: Sequence[FunctionTool] = ()
    tool_sources: Sequence[ToolSource] = ()
    tool_policies: Mapping[str, ToolPolicy] = field(default_factory=dict)
    default_tool_effect: ToolEffect = ToolEffect.UNCLASSIFIED
    max_model_calls_per_turn: int = DEFAULT_MAX_MODEL_CALLS_PER_TURN
    interrupt_deadline: timedelta | None = None
    event_stream_capacity_bytes: int = DEFAULT_AGENT_EVENTS_CAPACITY_BYTES
    built_in_tools: frozenset[BuiltInTool] = frozenset()
    max_durable_wait: timedelta = DEFAULT_MAX_DURABLE_WAIT
    decide_turn_continuation: DecideTurnContinuation | None = None
    resolve_model: ResolveModel | None = None
    tool_source_listing_timeout: timedelta = timedelta(seconds=DEFAULT_TOOL_SOURCE_LISTING_TIMEOUT_SECONDS)
    # Plans and plan mode (seed 003): plan_mode_enabled sets AgentSessionOptions.plan_mode_enabled and
    # enables write_todos; "required" forces write_todos on a planning turn's first call with no draft.
    plan_mode_enabled: bool = False
    planning_tool_choice: PlanningToolChoice = "auto"
    # Compaction (seed 003 "Compaction"): sets AgentSessionOptions.compaction; the runner implements it.
    compaction: CompactionPolicy | None = None

    def __post_init__(self) -> None:
        problems: list[str] = []
        name: object = self.name
        if not isinstance(name, str) or not name.strip():
            problems.append(f"name must be non-empty text, got {shown(name, None)}")
        instructions: object = self.instructions
        if not isinstance(instructions, str) and not callable(instructions):
            problems.append(
                f"instructions must be text or a function of InstructionContext, got {shown(instructions, None)}")
        model: object = self.model
        if not callable(getattr(model, "call_model", None)):
            problems.append(f"model must be a ModelClient (with call_model), got {type(model).__name__}")
        limit_problem = count_problem("max_model_calls_per_turn", self.max_model_calls_per_turn)
        if limit_problem is not None:
            problems.append(limit_problem)
        # The session options builtin_agent_session_flow derives would refuse these too, but as
        # "invalid AgentSessionOptions", which the caller never wrote.
        for problem in (interrupt_deadline_problem(self.interrupt_deadline),
                        max_durable_wait_problem(self.max_durable_wait),
                        tool_effect_problem(self.default_tool_effect, "default_tool_effect"),
                        events_capacity_problem(self.event_stream_capacity_bytes, "event_stream_capacity_bytes")):
            if problem is not None:
                problems.append(problem)
        timeout: object = self.tool_source_listing_timeout
        # Listings run inside RunModel: one that may outlast its timeout would fail the turn when a
        # source hangs, where a listing timeout is to leave that source's tools out and go on.
        if not isinstance(timeout, timedelta) or not timedelta(0) < timeout < RUN_MODEL_TIMEOUT:
            problems.append(f"tool_source_listing_timeout must be a positive timedelta shorter than RunModel's "
                            f"timeout ({RUN_MODEL_TIMEOUT}), got {shown(timeout, None)}")
        problems.extend(_shape_problems(self))
        problems.extend(_tool_problems(self.tools, self.tool_sources))
        compaction: object = self.compaction
        if compaction is not None and not isinstance(compaction, CompactionPolicy):
            problems.append(f"compaction must be a CompactionPolicy or None, got {shown(compaction, None)}")
        elif compaction is not None and isinstance(self.model_settings, Mapping):
            window_problem = compaction_window_problem(self.model_settings, compaction)
            if window_problem is not None:
                problems.append(window_problem)
        problems.extend(_plan_mode_problems(self.plan_mode_enabled, self.planning_tool_choice, model,
                                            self.model_settings))
        settings_problem = getattr(model, "model_settings_problem", None)
        settings = self.model_settings
        if callable(settings_problem) and isinstance(settings, Mapping) and all(isinstance(k, str) for k in settings):
            # A client's own refusal of its settings (LiteLLM's of a setting it sets itself): here,
            # not in call_model, which would fail every turn of every session after it started.
            problem = settings_problem(dict(settings))
            if problem is not None:
                problems.append(problem)
        built_ins: object = self.enabled_built_in_tools
        if not isinstance(built_ins, frozenset | set) or not all(isinstance(t, BuiltInTool) for t in built_ins):
            problems.append(f"built_in_tools must be a frozenset of BuiltInTool, got {shown(built_ins, None)}")
        else:
            problems.extend(_built_in_clashes(self.tools, self.tool_sources, {b.value for b in built_ins}))
        if problems:
            raise ValueError("invalid AgentDefinition: " + "; ".join(problems))
        # Copies, read-only: a caller's list or dict changed after the checks above would change the
        # agent unchecked (a tool policy dropped, and its approval with it).
        object.__setattr__(self, "tools", tuple(self.tools))
        object.__setattr__(self, "tool_sources", tuple(self.tool_sources))
        object.__setattr__(self, "model_settings", MappingProxyType(dict(self.model_settings)))
        object.__setattr__(self, "tool_policies", MappingProxyType(dict(self.tool_policies)))

    @property
    def enabled_built_in_tools(self) -> frozenset[BuiltInTool]:
        """built_in_tools, plus write_todos when plan mode is enabled (plan mode needs it)."""
        tools: object = self.built_in_tools
        if not isinstance(tools, frozenset | set):
            return self.built_in_tools  # refused in __post_init__
        plan: frozenset[BuiltInTool] = frozenset({BuiltInTool.WRITE_TODOS}) if self.plan_mode_enabled else frozenset()
        return frozenset(tools) | plan

    def function_tool(self, name: str) -> FunctionTool | None:
        return next((t for t in self.tools if t.name == name), None)

    def tool_source(self, source_name: str) -> ToolSource:
        for source in self.tool_sources:
            if source.source_name == source_name:
                return source
        raise LookupError(
            f"this Worker's agent {self.name!r} has no tool source named {source_name!r}; "
            f"it has {[s.source_name for s in self.tool_sources]}"
        )

    def merged_tool_policies(self) -> dict[str, ToolPolicy]:
        """Each function tool's own policy, overridden by the definition's tool_policies."""
        merged = {t.name: t.policy for t in self.tools}
        merged.update(self.tool_policies)
        return merged

    def function_tool_policy(self, name: str) -> ToolPolicy:
        """The policy a call of function tool `name` gets, as the session options this definition
        implies resolve it (builtin_agent_session_options)."""
        return resolve_tool_policy(name, self.merged_tool_policies(), self.default_tool_effect)


def compaction_window_problem(model_settings: Mapping[str, Any], compaction: CompactionPolicy) -> str | None:
    """What is wrong with `compaction` for a model called with `model_settings`, or None."""
    reserve = max_output_tokens(model_settings)
    if reserve < compaction.context_window_tokens:
        return None
    # The summary call reserves its output in the window: no summary request could fit, and each
    # would leave out the whole conversation it was to summarize.
    return (f"model_settings' max output tokens ({reserve}) leave no room in the compaction window "
            f"({compaction.context_window_tokens} tokens) for the summary call's input; lower it, or "
            "raise context_window_tokens")


def session_options_problems(definition: AgentDefinition, options: AgentSessionOptions) -> list[str]:
    """What AgentDefinition checks against RunModel's defaults, checked against `options`, which a
    caller may have changed (replace(builtin_agent_session_options(definition), ...))."""
    problems: list[str] = []
    listing, timeout = definition.tool_source_listing_timeout, options.run_model_limit.timeout
    # Listings run inside RunModel: one that may outlast its timeout fails every turn when a source
    # hangs ("the attempt passed its deadline"), where it was to offer no tools. Without tool
    # sources nothing is listed, and a short RunModel timeout is no mistake.
    if definition.tool_sources and listing >= timeout:
        problems.append(
            f"the AgentDefinition's tool_source_listing_timeout ({listing}) is not shorter than the options' "
            f"run_model_limit.timeout ({timeout}), which the listing shares: a tool source that does not answer "
            "would fail the turn instead of offering no tools; lower tool_source_listing_timeout, or raise "
            "RunModelLimit.timeout")
    # Only the options enable a built-in tool (the definition's own are refused when it is built): a
    # clash made every model call of every turn fail.
    built_ins = {tool.value for tool in options.built_in_tools}
    problems.extend(f"the options' built_in_tools: {clash}; rename the tool, or leave that built-in tool out"
                    for clash in _built_in_clashes(definition.tools, definition.tool_sources, built_ins))
    if options.compaction is not None:
        window_problem = compaction_window_problem(definition.model_settings, options.compaction)
        if window_problem is not None:
            problems.append(f"the options' compaction: {window_problem}")
    # A tool Step refuses a call whose tool the definition makes stricter than its record (a deploy
    # changed it), so options looser than the definition would record, then refuse, every call of it.
    differing = []
    for tool in definition.tools:
        given = policy_text(resolve_tool_policy(tool.name, options.tool_policies, options.default_tool_effect))
        defined = policy_text(definition.function_tool_policy(tool.name))
        if given != defined:
            differing.append(f"{tool.name} ({given} in the options, {defined} in the definition)")
    if differing:
        problems.append(f"function tool policies differ from the definition's: {'; '.join(differing)}; build "
                        "the options with builtin_agent_session_options(definition) and set tool policies on the "
                        "definition")
    return problems


def _plan_mode_problems(
    plan_mode_enabled: object, choice: object, model: object, settings: Mapping[str, Any]
) -> list[str]:
    """plan_mode_enabled and planning_tool_choice; "required" needs a client that can force a tool call."""
    problems: list[str] = []
    if not isinstance(plan_mode_enabled, bool):
        problems.append(f"plan_mode_enabled must be True or False, got {shown(plan_mode_enabled, None)}")
    if choice not in ("auto", "required"):
        problems.append(f"planning_tool_choice must be 'auto' or 'required', got {shown(choice, None)}")
    elif choice == "required":
        supports = getattr(model, "supports_forced_tool_choice", None)
        if callable(supports) and supports(dict(settings) if isinstance(settings, Mapping) else {}) is False:
            problems.append(
                "planning_tool_choice 'required' needs a model client that can force a tool call, but "
                f"{type(model).__name__}.supports_forced_tool_choice(model_settings) is False (Claude Opus 5.5, "
                "Claude Sonnet 5.5 and Anthropic extended thinking refuse a forced tool choice); use 'auto'"
            )
    return problems


def _is_list(value: object) -> TypeGuard[Sequence[object]]:
    """A list or tuple of things; not text (a sequence of characters), not one thing alone."""
    return isinstance(value, Sequence) and not isinstance(value, str | bytes)


def _shape_problems(definition: AgentDefinition) -> list[str]:
    """Fields whose wrong kind would otherwise fail later with a bare TypeError, or in every turn."""
    problems: list[str] = []
    for field_name, what in (("tools", "FunctionTool"), ("tool_sources", "ToolSource objects")):
        value: object = getattr(definition, field_name)
        if not _is_list(value):
            problems.append(f"{field_name} must be a list of {what}, got {shown(value, None)}")
    settings: object = definition.model_settings
    if not isinstance(settings, Mapping):
        problems.append(f"model_settings must be a dict of the model client's settings, got {shown(settings, None)}")
    else:
        # Settings are named: a client passes them on as keyword arguments (LiteLLM's), which fail
        # every model call of every turn with a bare TypeError on a name that is not text.
        problems.extend(f"model_settings key {shown(key, None)} is not a setting name; use its name as text"
                        for key in settings if not isinstance(key, str) or not key)
    policies: object = definition.tool_policies
    if not isinstance(policies, Mapping):
        problems.append(f"tool_policies must be a dict of tool name to ToolPolicy, got {shown(policies, None)}")
    else:  # as the derived AgentSessionOptions would, but naming this definition
        problems.extend(tool_policy_entry_problems(policies))
    for hook_name, takes in (("decide_turn_continuation", "TurnContinuationContext"),
                             ("resolve_model", "the session settings")):
        hook: object = getattr(definition, hook_name)
        if hook is not None and not callable(hook):
            problems.append(f"{hook_name} must be a function of {takes} or None, got {shown(hook, None)}")
    return problems


def _built_in_clashes(tools: object, sources: object, built_ins: set[str]) -> list[str]:
    """Function tools, and names tool sources declare, that an enabled built-in tool would shadow."""
    names = [t.name for t in tools if isinstance(t, FunctionTool)] if _is_list(tools) else []
    if _is_list(sources):
        for source in sources:
            if isinstance(source, ToolSource):
                with contextlib.suppress(DeclaredNamesError):  # reported by _tool_problems
                    names.extend(n for n in declared_names(source) if isinstance(n, str))
    return [f"tool {name} uses the name of an enabled built-in tool" for name in dict.fromkeys(names)
            if name in built_ins]


def _tool_problems(tools: object, sources: object) -> list[str]:
    problems: list[str] = []
    seen: set[str] = set()
    if not _is_list(tools) or not _is_list(sources):
        return problems  # refused by _shape_problems
    for tool in tools:
        if not isinstance(tool, FunctionTool):
            problems.append(f"tools must be FunctionTool (use @function_tool), got {shown(tool, None)}")
            continue
        if tool.name in seen:
            problems.append(f"two function tools are named {tool.name!r}")
        seen.add(tool.name)
    source_names: set[str] = set()
    listed: set[str] = set()
    for source in sources:
        if not isinstance(source, ToolSource):
            problems.append(f"tool_sources must be ToolSource objects, got {shown(source, None)}")
            continue
        source_name: object = source.source_name
        if not isinstance(source_name, str) or not source_name.strip():
            # Its calls store the name to find the source again: one that is not text never could.
            problems.append(f"tool source {shown(source, None)} has source_name {shown(source_name, None)}; "
                            "give it a unique, non-empty text name")
            continue
        if source.source_name in source_names:
            problems.append(f"two tool sources are named {source.source_name!r}; give each a unique source_name")
        source_names.add(source.source_name)
        try:
            given = declared_names(source)
        except DeclaredNamesError as exc:
            problems.append(str(exc))
            continue
        problems.extend(f"tool source {source.source_name!r} declares a tool name {shown(name, None)}, "
                        "not non-empty text"
                        for name in given if not isinstance(name, str) or not name.strip())
        declared = [name for name in given if isinstance(name, str) and name.strip()]
        for name in dict.fromkeys(declared):
            if name in seen:
                problems.append(f"tool {name} of a tool source uses the name of a function tool")
            if declared.count(name) > 1:
                problems.append(f"tool source {source.source_name!r} lists a tool named {name} more than once")
            elif name in listed:
                problems.append(f"two tool sources list a tool named {name}")
            listed.add(name)
    return problems
