"""Validation of AgentSessionOptions, RunModelLimit and ToolPolicy, and AgentSessionFlow's runner check.

A bad option is caught when the Flow is built, with a message that names the field and the value, so
an operator sees the mistake at Worker start rather than in a failed session.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal

import pytest
from engine.tests.odd_values import NO_REPR_VALUES, assert_refused_naming

from dex_agents import (
    AgentSessionFlow,
    AgentSessionOptions,
    AgentTurnContext,
    AgentTurnOutcome,
    BuiltInTool,
    CompactionPolicy,
    DeferredToolExecution,
    FrameworkMessage,
    MessageRole,
    RunModelLimit,
    ToolEffect,
    ToolExecutionResult,
    ToolPolicy,
    TurnCompleted,
)
from dex_agents._constants import (
    DEFAULT_AGENT_EVENTS_CAPACITY_BYTES,
    MAX_AGENT_EVENTS_CAPACITY_BYTES,
    MAX_RETRY_ATTEMPTS,
)
from dex_agents.builtin_loop import (
    AgentDefinition,
    FunctionTool,
    ScriptedModelClient,
    ScriptedModelReply,
    function_tool,
)
from dex_engine import MAX_TIMER_SECONDS

# Values typed Any on purpose: the point is what a caller without a type checker can pass.
BAD_DURATIONS: list[Any] = [timedelta(0), timedelta(seconds=-1), 30, 30.0, "30s", None]


# ToolPolicy ---------------------------------------------------------------------------------


def test_tool_policy_accepts_every_effect_and_approval() -> None:
    """Each effect with None, True or False builds; None is the default."""
    for effect in ToolEffect:
        assert ToolPolicy(effect).requires_approval is None
        assert ToolPolicy(effect, True).requires_approval is True
        assert ToolPolicy(effect, False).requires_approval is False


@pytest.mark.parametrize("effect", ["read", None, 1, "READ"])
def test_tool_policy_refuses_a_non_effect(effect: Any) -> None:
    """The effect must be a ToolEffect member; the TypeError names the field and the value."""
    with pytest.raises(TypeError, match=r"ToolPolicy\.effect") as info:
        ToolPolicy(effect)
    assert repr(effect) in str(info.value)


@pytest.mark.parametrize("requires_approval", [1, 0, "yes", "false"])
def test_tool_policy_refuses_a_non_bool_approval(requires_approval: Any) -> None:
    """requires_approval is a bool or None; truthy stand-ins are refused, naming the value."""
    with pytest.raises(TypeError, match=r"ToolPolicy\.requires_approval") as info:
        ToolPolicy(ToolEffect.READ, requires_approval)
    assert repr(requires_approval) in str(info.value)


# RunModelLimit ------------------------------------------------------------------------------


def test_run_model_limit_defaults_are_the_seed_options() -> None:
    """RunModel: method timeout 15 min, 3 attempts within 30 min (seed 002 Step table)."""
    limit = RunModelLimit()
    assert (limit.timeout, limit.max_attempts, limit.retry_budget) == (
        timedelta(minutes=15), 3, timedelta(minutes=30))
    RunModelLimit(timeout=timedelta(microseconds=1), max_attempts=1, retry_budget=timedelta(seconds=1))


@pytest.mark.parametrize("field", ["timeout", "retry_budget"])
@pytest.mark.parametrize("value", BAD_DURATIONS)
def test_run_model_limit_refuses_bad_durations(field: str, value: Any) -> None:
    """timeout and retry_budget must be positive timedeltas; the error names the field and the value."""
    with pytest.raises(ValueError, match=f"{field} must be a positive timedelta") as info:
        RunModelLimit(**{field: value})
    assert repr(value) in str(info.value)


@pytest.mark.parametrize("value", [0, -1, True, False, 2.0, "3", None, 2**64])
def test_run_model_limit_refuses_bad_attempts(value: Any) -> None:
    """max_attempts is a whole number from 1 to the engine's bound; bools, floats, text and a count
    too large to store are refused, naming the value."""
    with pytest.raises(ValueError, match="max_attempts must be a whole number from 1 to 9223372036854775807") as info:
        RunModelLimit(max_attempts=value)
    assert repr(value) in str(info.value)


def test_a_run_model_timeout_past_the_engines_longest_is_refused() -> None:
    """Catches: a timeout of more than a year accepted here, then refused by the engine as the
    session Flow was built, naming execute_timeout_seconds rather than RunModelLimit.timeout."""
    with pytest.raises(ValueError, match=r"^invalid RunModelLimit: timeout must be a positive timedelta of at most "
                                         r"366 days \(the engine's longest method timeout\), got "):
        RunModelLimit(timeout=timedelta(days=367))
    assert RunModelLimit(timeout=timedelta(days=366)).timeout == timedelta(days=366)


def test_run_model_limit_reports_every_problem() -> None:
    """All bad fields are reported in one error, so one fix round is enough."""
    with pytest.raises(ValueError, match="invalid RunModelLimit") as info:
        RunModelLimit(timeout=timedelta(0), max_attempts=0, retry_budget=-5)  # type: ignore[arg-type]
    text = str(info.value)
    assert "timeout" in text and "max_attempts" in text and "retry_budget" in text and "-5" in text


# AgentSessionOptions ------------------------------------------------------------------------


def test_session_options_defaults() -> None:
    """Defaults: no policies, unclassified default effect, 10 MiB of events, no approval deadline,
    durable waits of up to 365 days."""
    options = AgentSessionOptions()
    assert dict(options.tool_policies) == {}
    assert options.default_tool_effect is ToolEffect.UNCLASSIFIED
    assert options.agent_events_capacity_bytes == DEFAULT_AGENT_EVENTS_CAPACITY_BYTES == 10 * 1024 * 1024
    assert options.interrupt_deadline is None
    assert options.run_model_limit == RunModelLimit()
    assert options.max_durable_wait == timedelta(days=365)  # seed 003 "Built-in tools"


def test_session_options_freeze_tool_policies() -> None:
    """The options keep a read-only copy: changing the caller's dict later changes nothing."""
    policies = {"refund": ToolPolicy(ToolEffect.NON_IDEMPOTENT_WRITE)}
    options = AgentSessionOptions(tool_policies=policies)
    policies["lookup"] = ToolPolicy(ToolEffect.READ)
    assert list(options.tool_policies) == ["refund"]
    with pytest.raises(TypeError):
        options.tool_policies["x"] = ToolPolicy(ToolEffect.READ)  # type: ignore[index]


@pytest.mark.parametrize(("kwargs", "field", "shown"), [
    ({"tool_policies": [("refund", ToolPolicy(ToolEffect.READ))]}, "tool_policies must map tool names", "list"),
    ({"tool_policies": None}, "tool_policies must map tool names", "NoneType"),
    ({"tool_policies": {"": ToolPolicy(ToolEffect.READ)}}, "tool_policies key", "''"),
    ({"tool_policies": {3: ToolPolicy(ToolEffect.READ)}}, "tool_policies key", "3"),
    ({"tool_policies": {"refund": "read"}}, "tool_policies['refund']", "'read'"),
    ({"tool_policies": {"refund": ToolEffect.READ}}, "tool_policies['refund']", repr(ToolEffect.READ)),
    ({"default_tool_effect": "read"}, "default_tool_effect must be a ToolEffect", "'read'"),
    ({"default_tool_effect": None}, "default_tool_effect must be a ToolEffect", "None"),
    ({"agent_events_capacity_bytes": 0}, "agent_events_capacity_bytes must be a whole number", "0"),
    ({"agent_events_capacity_bytes": -1}, "agent_events_capacity_bytes must be a whole number", "-1"),
    ({"agent_events_capacity_bytes": True}, "agent_events_capacity_bytes must be a whole number", "True"),
    ({"agent_events_capacity_bytes": 1.5}, "agent_events_capacity_bytes must be a whole number", "1.5"),
    ({"agent_events_capacity_bytes": "1MiB"}, "agent_events_capacity_bytes must be a whole number", "'1MiB'"),
    # Past the engine Stream's 64-bit capacity: the Stream refused it later, naming neither option.
    ({"agent_events_capacity_bytes": 2**63}, "agent_events_capacity_bytes must be a whole number", str(2**63)),
    ({"interrupt_deadline": timedelta(0)}, "interrupt_deadline must be a positive timedelta", "timedelta(0)"),
    ({"interrupt_deadline": timedelta(seconds=-1)}, "interrupt_deadline must be a positive timedelta",
     repr(timedelta(seconds=-1))),
    ({"interrupt_deadline": 300}, "interrupt_deadline must be a positive timedelta", "300"),
    # Each becomes one engine Timer, which can wait at most MAX_TIMER_SECONDS (366 days).
    ({"interrupt_deadline": timedelta(days=367)}, "interrupt_deadline must be at most 366 days",
     repr(timedelta(days=367))),
    ({"max_durable_wait": timedelta(days=400)}, "max_durable_wait must be a timedelta from 1 second to 366 days",
     repr(timedelta(days=400))),
    ({"max_durable_wait": timedelta(milliseconds=999)}, "max_durable_wait must be a timedelta from 1 second",
     repr(timedelta(milliseconds=999))),
    ({"max_durable_wait": 3600}, "max_durable_wait must be a timedelta from 1 second", "3600"),
    ({"run_model_limit": None}, "run_model_limit must be a RunModelLimit", "None"),
    ({"run_model_limit": {"max_attempts": 3}}, "run_model_limit must be a RunModelLimit", "{'max_attempts': 3}"),
])
def test_session_options_refuse_bad_values(kwargs: dict[str, Any], field: str, shown: str) -> None:
    """Each bad value is a ValueError naming the field and showing the offending value."""
    with pytest.raises(ValueError, match="invalid AgentSessionOptions") as info:
        AgentSessionOptions(**kwargs)
    assert field in str(info.value)
    assert shown in str(info.value)


def test_session_options_report_every_problem() -> None:
    """Several bad fields are reported together."""
    with pytest.raises(ValueError) as info:
        AgentSessionOptions(default_tool_effect="x", agent_events_capacity_bytes=0)  # type: ignore[arg-type]
    assert "default_tool_effect" in str(info.value) and "agent_events_capacity_bytes" in str(info.value)


def test_session_options_accept_good_values() -> None:
    """A fully set, valid options object builds and keeps its values."""
    limit = RunModelLimit(timeout=timedelta(minutes=1), max_attempts=5, retry_budget=timedelta(hours=1))
    options = AgentSessionOptions(
        tool_policies={"refund": ToolPolicy(ToolEffect.NON_IDEMPOTENT_WRITE, False)},
        default_tool_effect=ToolEffect.READ, agent_events_capacity_bytes=1, interrupt_deadline=timedelta(seconds=1),
        run_model_limit=limit,
    )
    assert options.run_model_limit is limit and options.interrupt_deadline == timedelta(seconds=1)


# AgentSessionFlow's runner check ------------------------------------------------------------


class _BuildOnly:
    def build_user_message(self, text: str) -> FrameworkMessage:
        return FrameworkMessage(MessageRole.USER, "{}", text=text)


class _NoTools(_BuildOnly):
    async def run_model_step(self, turn: AgentTurnContext) -> AgentTurnOutcome:
        return TurnCompleted(new_messages=[])


class _Complete(_NoTools):
    async def execute_deferred_tool_call(self, call: DeferredToolExecution) -> ToolExecutionResult:
        return ToolExecutionResult("ok")


class _NotCallable(_NoTools):
    execute_deferred_tool_call = "not a method"


def test_flow_accepts_a_complete_runner() -> None:
    """A runner with the three contract methods builds a Flow with the given type and options."""
    options = AgentSessionOptions(agent_events_capacity_bytes=4096)
    flow = AgentSessionFlow(_Complete(), flow_type="TriageAgent", options=options)
    assert flow.flow_type == "TriageAgent"
    assert flow.options is options


def test_the_flow_runs_its_pure_steps_inside_the_commits_that_ready_them() -> None:
    """What keeps a tool turn at four commits (docs/agents.md, "What a turn costs"): AwaitUserMessage
    and ResumeTurn are pure Executes, and the tool Steps are pure up to the heartbeat before the
    tool; no other Step is either (the engine tests in test_pure_execute.py and
    test_pure_until_heartbeat.py show what the flags do)."""
    flow = AgentSessionFlow(_Complete())
    pure = {name for name, step in flow.steps.items() if step.pure_execute}
    until_heartbeat = {name for name, step in flow.steps.items() if step.pure_until_heartbeat}
    assert pure == {"AwaitUserMessage", "ResumeTurn"}
    assert until_heartbeat == {"CallTool", "CallSingleAttemptTool"}


@pytest.mark.parametrize(("runner", "missing", "present"), [
    (object(), ["build_user_message", "run_model_step", "execute_deferred_tool_call"], []),
    (_BuildOnly(), ["run_model_step", "execute_deferred_tool_call"], ["build_user_message"]),
    (_NoTools(), ["execute_deferred_tool_call"], ["build_user_message", "run_model_step"]),
    (_NotCallable(), ["execute_deferred_tool_call"], ["build_user_message", "run_model_step"]),
])
def test_flow_refuses_a_runner_missing_methods(runner: Any, missing: list[str], present: list[str]) -> None:
    """A runner without a contract method is a TypeError naming the runner's type and each missing method only."""
    with pytest.raises(TypeError, match="is not an AgentFrameworkRunner") as info:
        AgentSessionFlow(runner)
    text = str(info.value)
    assert text.startswith(type(runner).__name__)
    assert text.endswith("lacks " + ", ".join(missing))
    for name in present:
        assert name not in text


def test_flow_refuses_a_runner_class_instead_of_an_instance() -> None:
    """AgentSessionFlow(MyRunner) instead of AgentSessionFlow(MyRunner()): the class has every
    contract method, so it was accepted, and every turn failed with build_user_message raised
    TypeError: missing 1 required positional argument."""
    with pytest.raises(TypeError) as info:
        AgentSessionFlow(_Complete)  # type: ignore[arg-type]
    assert str(info.value) == "the class _Complete is not an AgentFrameworkRunner: pass an instance, _Complete(...)"


class _AsyncUserMessage(_Complete):
    async def build_user_message(self, text: str) -> FrameworkMessage:  # type: ignore[override]
        return FrameworkMessage(MessageRole.USER, "{}", text=text)


class _AsyncUnfinished(_Complete):
    async def build_unfinished_turn_messages(self, turn: AgentTurnContext) -> list[FrameworkMessage]:
        return []


@pytest.mark.parametrize(("runner", "method"), [
    (_AsyncUserMessage(), "build_user_message"),
    (_AsyncUnfinished(), "build_unfinished_turn_messages"),
])
def test_flow_refuses_an_async_method_the_session_cannot_await(runner: Any, method: str) -> None:
    """build_user_message and build_unfinished_turn_messages run inside a commit, which cannot await:
    `async def` is refused when the Flow is built, naming the method and what to write. Catches:
    an async build_user_message failed every turn with "build_user_message(...)[0] is a coroutine,
    not a FrameworkMessage", and an async builder silently lost the runner's items of every
    cancelled, steered or failed turn (a warning, the session's note instead)."""
    with pytest.raises(TypeError) as info:
        AgentSessionFlow(runner)
    assert str(info.value) == (
        f"{type(runner).__name__}.{method} is async def, but the session calls it inside a commit, which "
        "cannot await it; make it a plain def (run_model_step, execute_deferred_tool_call and the "
        "tool task and compaction methods may be async)"
    )


def test_flow_refuses_options_of_the_wrong_type() -> None:
    """Options must be AgentSessionOptions; a dict is a TypeError naming what it got."""
    bad: Any = {"default_tool_effect": ToolEffect.READ}
    with pytest.raises(TypeError, match="options must be AgentSessionOptions, got dict"):
        AgentSessionFlow(_Complete(), options=bad)


def test_the_longest_timer_is_accepted_for_deadlines_and_durable_waits() -> None:
    """366 days, the engine's MAX_TIMER_SECONDS, is the bound itself: allowed for both."""
    options = AgentSessionOptions(interrupt_deadline=timedelta(days=366), max_durable_wait=timedelta(days=366))
    assert options.interrupt_deadline == options.max_durable_wait == timedelta(seconds=MAX_TIMER_SECONDS)


def test_the_largest_events_capacity_and_run_model_attempts_are_accepted() -> None:
    """The bounds themselves, the engine's largest Stream capacity and RetryPolicy attempts, are
    allowed; one more is refused."""
    options = AgentSessionOptions(agent_events_capacity_bytes=MAX_AGENT_EVENTS_CAPACITY_BYTES,
                                  run_model_limit=RunModelLimit(max_attempts=MAX_RETRY_ATTEMPTS))
    assert options.agent_events_capacity_bytes == MAX_AGENT_EVENTS_CAPACITY_BYTES
    assert options.run_model_limit.max_attempts == MAX_RETRY_ATTEMPTS
    with pytest.raises(ValueError, match="agent_events_capacity_bytes must be a whole number"):
        AgentSessionOptions(agent_events_capacity_bytes=MAX_AGENT_EVENTS_CAPACITY_BYTES + 1)
    with pytest.raises(ValueError, match="max_attempts must be a whole number"):
        RunModelLimit(max_attempts=MAX_RETRY_ATTEMPTS + 1)


def test_built_in_tools_take_a_set_of_built_in_tools_and_keep_a_frozenset() -> None:
    """A set of BuiltInTool is kept as a frozenset (read-only and hashable, like the default); a list,
    or names given as plain strings, is refused with the field and the value, not taken as they are."""
    options = AgentSessionOptions(built_in_tools={BuiltInTool.ASK_USER})  # type: ignore[arg-type]
    assert type(options.built_in_tools) is frozenset
    assert options.built_in_tools == frozenset({BuiltInTool.ASK_USER})
    bad_values: list[Any] = [[BuiltInTool.ASK_USER], frozenset({"ask_user"}), None]
    for bad in bad_values:
        with pytest.raises(ValueError, match="invalid AgentSessionOptions") as info:
            AgentSessionOptions(built_in_tools=bad)
        assert f"built_in_tools must be a frozenset of BuiltInTool, got {bad!r}" in str(info.value)


def test_max_durable_wait_is_at_least_one_second() -> None:
    """durable_wait takes whole seconds from 1 (seed 003 "Built-in tools"): a bound of one second is
    accepted, and a shorter one, under which no wait could be allowed, is refused."""
    assert AgentSessionOptions(max_durable_wait=timedelta(seconds=1)).max_durable_wait == timedelta(seconds=1)
    for bad in (timedelta(milliseconds=999), timedelta(0)):
        with pytest.raises(ValueError, match="max_durable_wait must be a timedelta from 1 second") as info:
            AgentSessionOptions(max_durable_wait=bad)
        assert repr(bad) in str(info.value)


# A value with no repr -------------------------------------------------------------------------


def _negative(bad: Any) -> Any:
    """`bad` refused where any whole number >= 0 is taken: an int of over 4,300 digits made negative."""
    return -abs(bad) if isinstance(bad, int) else bad


class _Source:
    """A ToolSource (it lists nothing) with the given source_name and declared tool names."""

    def __init__(self, source_name: Any, declared: tuple[Any, ...] = ()) -> None:
        self.source_name = source_name
        self._declared = declared

    def declared_tool_names(self) -> list[Any]:
        return list(self._declared)

    async def list_tools(self) -> list[Any]:
        return []

    # Declared for AgentDefinition's check of a source; the tests only declare it, no turn calls these.
    def deferred_tool_call(self, call: Any, listed_tool: Any, turn: Any) -> Any:
        raise AssertionError("_Source only stands in a declaration; no turn calls it")

    async def execute_deferred_tool_call(self, call: Any) -> Any:
        raise AssertionError("_Source only stands in a declaration; no turn calls it")


def _showing(bad: Any) -> Any:
    """A callable with no __name__ whose repr is `bad`'s (which cannot be made)."""

    class Showing:
        def __call__(self) -> None:
            return None

        def __repr__(self) -> str:
            return repr(bad)

    return Showing()


def _tool_taking(annotation: Any) -> FunctionTool:
    def tool(x: Any) -> str:
        return "ok"

    tool.__annotations__ = {"x": annotation, "return": str}
    return FunctionTool(tool)


def _agent(**kwargs: Any) -> AgentDefinition:
    fields: dict[str, Any] = {"name": "a", "instructions": "be brief",
                              "model": ScriptedModelClient(lambda request: ScriptedModelReply(text="ok"))}
    return AgentDefinition(**{**fields, **kwargs})


# (label, build with the bad value, the error raised, text the message holds). Where any whole
# number >= 0 is taken (a capacity, a count), the int of 5,000 digits is made negative to be refused.
_NO_REPR_DECLARATIONS: list[tuple[str, Callable[[Any], object], type[Exception], str]] = [
    ("RunModelLimit.timeout", lambda bad: RunModelLimit(timeout=bad), ValueError, "timeout must be"),
    ("RunModelLimit.max_attempts", lambda bad: RunModelLimit(max_attempts=_negative(bad)), ValueError,
     "max_attempts must be"),
    ("RunModelLimit.retry_budget", lambda bad: RunModelLimit(retry_budget=bad), ValueError, "retry_budget must be"),
    ("ToolPolicy.effect", ToolPolicy, TypeError, "ToolPolicy.effect"),
    ("ToolPolicy.requires_approval", lambda bad: ToolPolicy(ToolEffect.READ, bad), TypeError,
     "ToolPolicy.requires_approval"),
    ("AgentSessionOptions.tool_policies key",
     lambda bad: AgentSessionOptions(tool_policies={bad: ToolPolicy(ToolEffect.READ)}), ValueError,
     "tool_policies key"),
    ("AgentSessionOptions.tool_policies value", lambda bad: AgentSessionOptions(tool_policies={"t": bad}),
     ValueError, "tool_policies['t']"),
    *((f"AgentSessionOptions.{name}", lambda bad, name=name: AgentSessionOptions(**{name: bad}), ValueError, name)
      for name in ("default_tool_effect", "interrupt_deadline", "built_in_tools", "max_durable_wait",
                   "plan_mode_enabled", "message_chunk_max_bytes", "compaction", "run_model_limit")),
    *((f"AgentSessionOptions.{name}", lambda bad, name=name: AgentSessionOptions(**{name: _negative(bad)}),
       ValueError, name)
      for name in ("agent_events_capacity_bytes", "message_window_size", "message_chunk_size",
                   "retained_message_limit")),
    *((f"CompactionPolicy.{name}", lambda bad, name=name: CompactionPolicy(**{"context_window_tokens": 1000,
                                                                          name: _negative(bad)}),
       ValueError, name)
      for name in ("context_window_tokens", "trigger_ratio", "retained_ratio", "reserved_input_tokens")),
    ("AgentSessionFlow runner", AgentSessionFlow, TypeError, "is not an AgentFrameworkRunner"),
    ("AgentSessionFlow options", lambda bad: AgentSessionFlow(_Complete(), options=bad), TypeError,
     "options must be AgentSessionOptions"),
    *((f"AgentDefinition.{name}", lambda bad, name=name: _agent(**{name: bad}), ValueError, name)
      for name in ("name", "instructions", "tool_source_listing_timeout", "compaction", "plan_mode_enabled",
                   "planning_tool_choice", "built_in_tools", "tools", "tool_sources", "model_settings",
                   "tool_policies", "decide_turn_continuation", "resolve_model", "default_tool_effect",
                   "event_stream_capacity_bytes")),
    ("AgentDefinition.max_model_calls_per_turn", lambda bad: _agent(max_model_calls_per_turn=_negative(bad)),
     ValueError, "max_model_calls_per_turn"),
    ("AgentDefinition.tools item", lambda bad: _agent(tools=[bad]), ValueError, "tools must be FunctionTool"),
    ("AgentDefinition.tool_sources item", lambda bad: _agent(tool_sources=[bad]), ValueError,
     "tool_sources must be ToolSource objects"),
    ("ToolSource.source_name", lambda bad: _agent(tool_sources=[_Source(bad)]), ValueError, "has source_name"),
    ("ToolSource declared name", lambda bad: _agent(tool_sources=[_Source("s", (bad,))]), ValueError,
     "tool source 's' declares a tool name"),
    ("ScriptedModelClient respond", ScriptedModelClient, TypeError, "respond must be"),
    ("ScriptedModelClient summarize", lambda bad: ScriptedModelClient(print, summarize=bad), TypeError,
     "summarize must be"),
    ("ScriptedModelClient max_recorded_requests",
     lambda bad: ScriptedModelClient(print, max_recorded_requests=_negative(bad)), ValueError,
     "max_recorded_requests must be"),
    ("FunctionTool fn", FunctionTool, TypeError, "a function tool needs a callable"),
    ("FunctionTool name", lambda bad: FunctionTool(print, name=bad), ValueError, "invalid tool name"),
    ("FunctionTool without __name__", lambda bad: FunctionTool(_showing(bad)), ValueError, "has no __name__"),
    ("function_tool effect", lambda bad: function_tool(effect=bad)(print), TypeError, "effect must be a ToolEffect"),
    ("function_tool requires_approval", lambda bad: function_tool(requires_approval=bad)(print), TypeError,
     "requires_approval must be"),
    ("function_tool description", lambda bad: function_tool(description=bad)(print), TypeError,
     "description of tool 'print' must be"),
    ("function_tool prepare_arguments", lambda bad: function_tool(prepare_arguments=bad)(print), TypeError,
     "prepare_arguments of tool 'print' must be"),
    ("FunctionTool Literal value", lambda bad: _tool_taking(Literal[frozenset({bad})]), TypeError,
     "Literal value"),
    ("FunctionTool Enum value", lambda bad: _tool_taking(enum.Enum("Odd", {"A": (bad,)})), TypeError,
     "Odd.A has value"),
]


@pytest.mark.parametrize("bad", NO_REPR_VALUES)
@pytest.mark.parametrize(("build", "error", "text"), [case[1:] for case in _NO_REPR_DECLARATIONS],
                         ids=[case[0] for case in _NO_REPR_DECLARATIONS])
def test_a_declaration_given_a_value_with_no_repr_raises_its_own_error(
    bad: Any, build: Callable[[Any], object], error: type[Exception], text: str
) -> None:
    """An option, agent, tool or model client given a value whose repr cannot be made (an int of over
    4,300 digits, an object whose __repr__ raises) in a checked field raises its own error naming the
    field. Catches: building that error's text raising Python's ValueError ("Exceeds the limit (4300
    digits) for integer string conversion") or the object's own error, at Worker start."""
    assert_refused_naming(build, bad, error, text)
