"""Plans and plan mode (seed 002 "Rules", "RPCs", "Events"; seed 003 "Plans and plan mode").

Pure rules first (write_todos arguments, the status decision, build_plan_note, the turn-mode
decision, execute_plan's acceptance), then whole sessions of the built-in loop on a real SQLite
engine with an in-process Worker that tests stop and start, so an approval can be left pending.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections.abc import AsyncIterator, Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
import pytest
from agents.tests.built_context import interrupt, runtime_of, step_context
from agents.tests.builtin_agent import FAST_WORKER, lookup_order, refund_order
from agents.tests.scripted_agent import ScriptedRunner

from dex_agents import (
    AGENT_PLAN,
    AGENT_STATE,
    ARGUMENTS_NOT_TEXT,
    AWAIT_USER_MESSAGE,
    BUILT_IN_TOOL_DEFINITIONS,
    PENDING_PLAN_EXECUTION,
    PLANNING_TURN_REJECTION_MESSAGE,
    WRITE_TODOS_CALLED_MORE_THAN_ONCE,
    AgentEvent,
    AgentPlan,
    AgentPlanTask,
    AgentSessionClient,
    AgentSessionFlow,
    AgentSessionOptions,
    AgentSnapshot,
    AgentState,
    AgentStatus,
    AgentToolCallStatus,
    AgentUserMessage,
    BuiltInTool,
    DeferredToolCall,
    ExecutePlanRequest,
    InteractionMode,
    PlanExecutionRequest,
    PlanModeRunner,
    PlanStatus,
    PlanTaskStatus,
    ToolEffect,
    ToolPolicy,
    build_plan_note,
    turn_interaction_mode,
)
from dex_agents._builtin_tools import BuiltInArgumentsError
from dex_agents._plans import (
    approved_plan,
    approved_plan_message,
    execute_plan_accepted,
    parse_write_todos,
    plan_size_error,
    plan_status_after_write,
    written_plan,
)
from dex_agents._turn_logic import plan_tool_calls
from dex_agents._turn_steps import TurnSteps
from dex_agents.builtin_loop import (
    AgentDefinition,
    ModelRequest,
    ModelToolDefinition,
    ScriptedModelClient,
    ScriptedModelReply,
    ScriptedToolCall,
    ToolChoice,
    ToolResultInput,
    UserTextInput,
    builtin_agent_session_flow,
    builtin_agent_session_options,
    function_tool,
)
from dex_agents.demo import demo_reply
from dex_agents.demo._chat import plan_lines, wants_plan_mode
from dex_agents.testing import executed_steps, to_step_history, wait_for_agent_snapshot, wait_until
from dex_engine import (
    MAX_VALUE_BYTES,
    AsyncClient,
    AsyncWorker,
    LoadOptions,
    Registry,
    RpcContext,
    RpcLockConflictError,
    WorkerOptions,
)
from dex_engine._codec import encode_value
from dex_engine._records import ConsumedMessage, WaitOutcome

NOW = datetime(2026, 11, 1, 12, 0, 0, 123000, tzinfo=UTC)
PLANNING_LINE = (
    "This turn only plans: write or revise the plan with write_todos, and do not do or claim any of its tasks. "
    "The user reviews the plan before it runs."
)


# What a plan mode Flow needs: the option and the write_todos built-in that drafts its plans.
PLAN_MODE_OPTIONS = AgentSessionOptions(plan_mode_enabled=True, built_in_tools=frozenset({BuiltInTool.WRITE_TODOS}))


def task(content: str, status: PlanTaskStatus = PlanTaskStatus.PENDING) -> AgentPlanTask:
    return AgentPlanTask(content=content, status=status)


def plan_of(revision: int, status: PlanStatus, *tasks: AgentPlanTask) -> AgentPlan:
    return AgentPlan(revision=revision, status=status, tasks=list(tasks), updated_at="2026-11-01T12:00:00.000Z")


def todos(*pairs: tuple[str, str]) -> str:
    return json.dumps({"todos": [{"content": c, "status": s} for c, s in pairs]})


# write_todos arguments --------------------------------------------------------------------------


def test_write_todos_arguments_parse_to_tasks_in_order() -> None:
    """Valid arguments give the tasks as written, in order; an empty list is allowed (it clears)."""
    tasks = parse_write_todos(todos(("look up", "completed"), ("refund", "in_progress"), ("tell", "pending")))
    assert tasks == (task("look up", PlanTaskStatus.COMPLETED), task("refund", PlanTaskStatus.IN_PROGRESS),
                     task("tell"))
    assert parse_write_todos('{"todos": []}') == ()


@pytest.mark.parametrize(("arguments", "error"), [
    ("not json", "arguments must be a JSON object"),
    ('{"todos": [{"content": "a", "status": NaN}]}', "arguments must be a JSON object"),
    ("[]", "arguments must be a JSON object"),
    ('{"zeta": 1, "alpha": 2, "todos": []}', "invalid todos: unknown argument 'alpha'"),
    ("{}", "invalid todos: todos is required: a list of tasks, each {content, status}"),
    ('{"todos": null}', "invalid todos: todos is required: a list of tasks, each {content, status}"),
    ('{"todos": "a; b"}', "invalid todos: todos must be a list of tasks, got str"),
    ('{"todos": ["a"]}', "invalid todos: todos[0] must be an object with content and status"),
    ('{"todos": [{"content": "a", "status": "pending", "priority": 1}]}',
     "invalid todos: todos[0] has unknown field 'priority'"),
    # Seed 002: the first unknown name is the lowest by code point, not the first written.
    ('{"todos": [{"priority": 1, "content": "a", "status": "pending", "color": 2}]}',
     "invalid todos: todos[0] has unknown field 'color'"),
    ('{"todos": [{"content": "a", "status": "pending"}, {"content": "  ", "status": "pending"}]}',
     "invalid todos: todos[1].content must be non-empty text"),
    ('{"todos": [{"content": 3, "status": "pending"}]}', "invalid todos: todos[0].content must be non-empty text"),
    ('{"todos": [{"status": "pending"}]}', "invalid todos: todos[0].content must be non-empty text"),
    ('{"todos": [{"content": "a", "status": "done"}]}',
     "invalid todos: todos[0].status must be one of pending, in_progress, completed, got 'done'"),
    ('{"todos": [{"content": "a"}]}',
     "invalid todos: todos[0].status must be one of pending, in_progress, completed, got None"),
    # A status that is no string, not even a hashable value, fails as any other bad status.
    ('{"todos": [{"content": "a", "status": ["pending"]}]}',
     "invalid todos: todos[0].status must be one of pending, in_progress, completed, got ['pending']"),
    ('{"todos": [{"content": "a", "status": {"pending": 1}}]}',
     "invalid todos: todos[0].status must be one of pending, in_progress, completed, got {'pending': 1}"),
    # Strict JSON, whose escape decodes to half a UTF-16 pair: no stored plan could hold it.
    (r'{"todos": [{"content": "a\ud800b", "status": "pending"}]}', ARGUMENTS_NOT_TEXT),
    # Values the model wrote are shown cut, so the error stays small whatever the model sent.
    ('{"todos": [{"content": "a", "status": "' + "x" * 100_000 + '"}]}',
     "invalid todos: todos[0].status must be one of pending, in_progress, completed, got '" + "x" * 59),
    ('{"todos": [{"content": "a", "status": "pending", "' + "f" * 100_000 + '": 1}]}',
     "invalid todos: todos[0] has unknown field '" + "f" * 59),
])
def test_invalid_write_todos_arguments_fail_with_the_model_visible_reason(arguments: str, error: str) -> None:
    """Not strict JSON fails as `arguments must be a JSON object`; anything else `invalid todos: <reason>`."""
    with pytest.raises(BuiltInArgumentsError) as raised:
        parse_write_todos(arguments)
    assert str(raised.value) == error


def test_write_todos_definition_is_offered_with_the_other_built_ins() -> None:
    """BuiltInTool.WRITE_TODOS has a definition whose schema requires todos of {content, status}."""
    definition = BUILT_IN_TOOL_DEFINITIONS[BuiltInTool.WRITE_TODOS]
    assert definition.name == "write_todos" == BuiltInTool.WRITE_TODOS.value
    items = definition.parameters_schema["properties"]["todos"]["items"]
    assert items["required"] == ["content", "status"]
    assert items["properties"]["status"]["enum"] == ["pending", "in_progress", "completed"]


# The plan a write writes ------------------------------------------------------------------------

STATUS_LISTS = [list(combo) for n in range(4) for combo in itertools.product(PlanTaskStatus, repeat=n)]


@pytest.mark.parametrize("mode", list(InteractionMode))
def test_status_decision_for_every_task_list_up_to_three(mode: InteractionMode) -> None:
    """No tasks is cleared, a planning turn drafts, all completed is completed, otherwise active."""
    for statuses in STATUS_LISTS:
        tasks = [task(f"t{i}", s) for i, s in enumerate(statuses)]
        status = plan_status_after_write(tasks, mode)
        if not tasks:
            assert status is PlanStatus.CLEARED, statuses
        elif mode is InteractionMode.PLANNING:
            assert status is PlanStatus.DRAFT, statuses  # even when every task is completed
        elif set(statuses) == {PlanTaskStatus.COMPLETED}:
            assert status is PlanStatus.COMPLETED, statuses
        else:
            assert status is PlanStatus.ACTIVE, statuses


def test_written_plan_is_revision_plus_one_with_the_whole_task_list() -> None:
    """The first write is revision 1; each later write replaces the plan with revision + 1."""
    first = written_plan(None, [task("a")], InteractionMode.PLANNING, NOW)
    assert first == AgentPlan(revision=1, status=PlanStatus.DRAFT, tasks=[task("a")],
                              updated_at="2026-11-01T12:00:00.123Z")
    second = written_plan(plan_of(7, PlanStatus.ACTIVE, task("a"), task("b")), [task("b")],
                          InteractionMode.EXECUTING, NOW)
    assert (second.revision, second.status, second.tasks) == (8, PlanStatus.ACTIVE, [task("b")])
    cleared = written_plan(second, [], InteractionMode.CHAT, NOW)
    assert (cleared.revision, cleared.status, cleared.tasks) == (9, PlanStatus.CLEARED, [])


# build_plan_note --------------------------------------------------------------------------------

DRAFT = plan_of(3, PlanStatus.DRAFT, task("look up the order"), task("refund it", PlanTaskStatus.IN_PROGRESS))


@pytest.mark.parametrize(("plan", "mode", "note"), [
    (None, InteractionMode.PLANNING, f"[Dex] There is no plan yet.\n{PLANNING_LINE}"),
    (plan_of(4, PlanStatus.CLEARED), InteractionMode.PLANNING, f"[Dex] There is no plan yet.\n{PLANNING_LINE}"),
    (None, InteractionMode.CHAT, None),
    (None, InteractionMode.EXECUTING, None),
    (plan_of(4, PlanStatus.CLEARED), InteractionMode.CHAT, None),
    (plan_of(4, PlanStatus.CLEARED), InteractionMode.EXECUTING, None),
    (DRAFT, InteractionMode.PLANNING,
     "[Dex] The current plan, revision 3, is draft:\n- [pending] look up the order\n- [in_progress] refund it\n"
     + PLANNING_LINE),
    (DRAFT, InteractionMode.CHAT,
     "[Dex] The current plan, revision 3, is draft:\n- [pending] look up the order\n- [in_progress] refund it"),
    (plan_of(5, PlanStatus.ACTIVE, task("a", PlanTaskStatus.COMPLETED), task("b")), InteractionMode.EXECUTING,
     "[Dex] The current plan, revision 5, is active:\n- [completed] a\n- [pending] b"),
    (plan_of(6, PlanStatus.COMPLETED, task("a", PlanTaskStatus.COMPLETED)), InteractionMode.CHAT,
     "[Dex] The current plan, revision 6, is completed:\n- [completed] a"),
    (plan_of(6, PlanStatus.COMPLETED, task("a", PlanTaskStatus.COMPLETED)), InteractionMode.PLANNING,
     f"[Dex] The current plan, revision 6, is completed:\n- [completed] a\n{PLANNING_LINE}"),
])
def test_build_plan_note_exact_texts(plan: AgentPlan | None, mode: InteractionMode, note: str | None) -> None:
    """The seed's note: header and task lines, the planning line only in a planning turn, no plan yet."""
    assert build_plan_note(plan, mode) == note


# The turn-mode decision -------------------------------------------------------------------------

PLANS: list[AgentPlan | None] = [None, *(plan_of(1, s, task("a")) for s in PlanStatus)]
MESSAGE_SETS = [[], [False], [True], [False, True], [False, False]]


def test_turn_mode_decision_is_exhaustive() -> None:
    """Planning iff plan mode is on and (a message has plan_mode or a draft exists); never executing."""
    for enabled, plan, flags in itertools.product([False, True], PLANS, MESSAGE_SETS):
        messages = [AgentUserMessage(f"m{i}", plan_mode=f) for i, f in enumerate(flags)]
        mode = turn_interaction_mode(enabled, messages, plan)
        draft = plan is not None and plan.status is PlanStatus.DRAFT
        expected = InteractionMode.PLANNING if enabled and (any(flags) or draft) else InteractionMode.CHAT
        assert mode is expected, (enabled, plan, flags)


# execute_plan's acceptance and the approval -----------------------------------------------------

WAITING = AgentState(status=AgentStatus.WAITING_FOR_USER_MESSAGE, turn_count=1, active_turn_id=None,
                     next_message_sequence=5, last_turn_error=None, interaction_mode=InteractionMode.PLANNING)
ACCEPTED: dict[str, Any] = {
    "state": WAITING, "plan": plan_of(2, PlanStatus.DRAFT, task("a")), "pending_execution_revision": None,
    "queued_message_count": 0, "steered_message_count": 0, "pending_interrupt_count": 0,
}


@pytest.mark.parametrize(("revision", "change", "expected"), [
    (2, {}, True),  # the baseline
    (1, {}, False),  # a stale revision
    (3, {}, False),  # a revision not written yet
    (0, {}, False),
    (True, {}, False),  # a bool is not a revision
    # True == 1 and 2.0 == 2 in Python: only valid_revision refuses them for a plan of that revision.
    (True, {"plan": plan_of(1, PlanStatus.DRAFT, task("a"))}, False),
    (2.0, {}, False),
    (2, {"state": None}, False),  # StartAgentSession has not committed
    (2, {"state": AgentState(status=AgentStatus.RUNNING_MODEL, turn_count=1, active_turn_id="turn-2",
                             next_message_sequence=5, last_turn_error=None)}, False),
    (2, {"state": AgentState(status=AgentStatus.FAILED, turn_count=1, active_turn_id=None,
                             next_message_sequence=5, last_turn_error="x")}, False),
    (2, {"plan": None}, False),
    (2, {"plan": plan_of(2, PlanStatus.COMPLETED, task("a", PlanTaskStatus.COMPLETED))}, False),
    (2, {"plan": plan_of(2, PlanStatus.CLEARED)}, False),
    (2, {"plan": plan_of(2, PlanStatus.ACTIVE, task("a"))}, True),  # an active plan may run again
    (2, {"pending_execution_revision": 2}, False),  # an approval of it is pending
    (2, {"pending_execution_revision": 1}, True),  # an unconsumed approval of an older revision does not block
    (2, {"queued_message_count": 1}, False),
    (2, {"steered_message_count": 1}, False),
    (2, {"pending_interrupt_count": 1}, False),
])
def test_execute_plan_acceptance(revision: object, change: dict[str, Any], expected: bool) -> None:
    """True only while waiting, for the current draft or active revision, nothing pending or queued."""
    assert execute_plan_accepted(revision, **{**ACCEPTED, **change}) is expected


def test_approval_activates_a_draft_keeps_an_active_plan_and_refuses_a_stale_one() -> None:
    """A draft becomes active (changed), an active plan runs as is, anything else is stale (None)."""
    activated = approved_plan(DRAFT, 3, NOW)
    assert activated is not None
    plan, changed = activated
    assert changed and plan.status is PlanStatus.ACTIVE and plan.revision == 3 and plan.tasks == DRAFT.tasks
    assert plan.updated_at == "2026-11-01T12:00:00.123Z"  # the approval changed the plan: now
    active = plan_of(3, PlanStatus.ACTIVE, task("a"))
    assert approved_plan(active, 3, NOW) == (active, False)
    assert approved_plan(DRAFT, 2, NOW) is None
    assert approved_plan(None, 1, NOW) is None
    for status in (PlanStatus.COMPLETED, PlanStatus.CLEARED):
        assert approved_plan(plan_of(3, status), 3, NOW) is None
    assert approved_plan_message(3) == (
        "[Dex] The user approved plan revision 3. Execute it and keep the task statuses current with write_todos."
    )


# RunModel's recording of one response (pure) ----------------------------------------------------

READ = ToolPolicy(ToolEffect.READ, requires_approval=False)
WRITE = ToolPolicy(ToolEffect.NON_IDEMPOTENT_WRITE)
ENABLED = frozenset(t.value for t in BuiltInTool)


def plan_calls(calls: Sequence[DeferredToolCall], mode: InteractionMode, current: AgentPlan | None = None,
               built_ins: frozenset[str] = ENABLED) -> Any:
    return plan_tool_calls(list(calls), turn_id="turn-1", existing={}, now=NOW, interrupt_deadline=None,
                           trace_context=None, built_in_tools=built_ins, interaction_mode=mode,
                           current_plan=current)


def test_planning_turn_rejects_every_call_but_write_todos() -> None:
    """In a planning turn a tool, ask_user and durable_wait are rejected with the exact text, never run."""
    result = plan_calls([
        DeferredToolCall("c1", "refund", "{}", WRITE),
        DeferredToolCall("c2", "ask_user", '{"question": "q"}', READ),
        DeferredToolCall("c3", "durable_wait", "not json", READ),
        DeferredToolCall("c4", "write_todos", todos(("a", "pending")), READ),
    ], InteractionMode.PLANNING, DRAFT)
    statuses = [(c.record.status, c.record.rejection_message, c.next_step) for c in result.calls]
    rejected = (AgentToolCallStatus.REJECTED, PLANNING_TURN_REJECTION_MESSAGE, None)
    assert statuses[:3] == [rejected, rejected, rejected]
    assert PLANNING_TURN_REJECTION_MESSAGE == "The tool call was not run: a planning turn can only call write_todos."
    assert result.interrupts == ()
    write = result.calls[3]
    assert (write.record.status, write.next_step) == (AgentToolCallStatus.SUCCEEDED, None)
    assert write.record.output == '{"status":"updated","revision":4,"task_count":1}'
    assert result.plan == AgentPlan(revision=4, status=PlanStatus.DRAFT, tasks=[task("a")],
                                    updated_at="2026-11-01T12:00:00.123Z")


def test_planning_turn_rejects_a_tool_of_the_runner_named_write_todos() -> None:
    """With the built-in write_todos not enabled, a runner's own tool of that name is a tool like
    any other: a planning turn rejects it, and no plan is written."""
    result = plan_calls([DeferredToolCall("c1", "write_todos", todos(("a", "pending")), WRITE)],
                        InteractionMode.PLANNING, DRAFT, built_ins=frozenset())
    (call,) = result.calls
    assert (call.record.status, call.record.rejection_message, call.next_step) == (
        AgentToolCallStatus.REJECTED, PLANNING_TURN_REJECTION_MESSAGE, None)
    assert result.plan is None


def test_write_todos_twice_in_one_response_fails_both_and_keeps_the_plan() -> None:
    """Each call fails with the more-than-once text, even a valid one; no plan is written."""
    result = plan_calls([
        DeferredToolCall("c1", "write_todos", todos(("a", "pending")), READ),
        DeferredToolCall("c2", "lookup", "{}", READ),
        DeferredToolCall("c3", "write_todos", "{bad", READ),
    ], InteractionMode.CHAT, DRAFT)
    first, _, third = result.calls
    for planned in (first, third):
        assert planned.record.status is AgentToolCallStatus.FAILED
        assert planned.record.error == WRITE_TODOS_CALLED_MORE_THAN_ONCE
        assert planned.next_step is None
    assert WRITE_TODOS_CALLED_MORE_THAN_ONCE == "write_todos was called more than once in one response"
    assert result.calls[1].next_step == "CallTool"
    assert result.plan is None


def test_write_todos_outputs_and_statuses_in_chat_turns() -> None:
    """A chat write is active or completed, [] clears; the model sees updated or cleared JSON."""
    active = plan_calls([DeferredToolCall("c", "write_todos", todos(("a", "completed"), ("b", "pending")), READ)],
                        InteractionMode.CHAT)
    assert active.plan is not None and (active.plan.revision, active.plan.status) == (1, PlanStatus.ACTIVE)
    assert active.calls[0].record.output == '{"status":"updated","revision":1,"task_count":2}'
    assert (active.calls[0].record.effect, active.calls[0].record.requires_approval) == (ToolEffect.READ, False)
    done = plan_calls([DeferredToolCall("c", "write_todos", todos(("a", "completed")), READ)],
                      InteractionMode.EXECUTING, active.plan)
    assert done.plan is not None and (done.plan.revision, done.plan.status) == (2, PlanStatus.COMPLETED)
    cleared = plan_calls([DeferredToolCall("c", "write_todos", '{"todos": []}', READ)], InteractionMode.CHAT,
                         done.plan)
    assert cleared.plan is not None and cleared.plan.status is PlanStatus.CLEARED
    assert cleared.calls[0].record.output == '{"status":"cleared","revision":3}'
    invalid = plan_calls([DeferredToolCall("c", "write_todos", '{"todos": [1]}', READ)], InteractionMode.CHAT,
                         done.plan)
    assert invalid.plan is None
    assert invalid.calls[0].record.status is AgentToolCallStatus.FAILED
    assert invalid.calls[0].record.error == "invalid todos: todos[0] must be an object with content and status"


def test_write_todos_is_an_ordinary_tool_name_when_not_enabled() -> None:
    """Without the built-in, write_todos goes to a tool Step like any tool (twice is fine)."""
    result = plan_calls([DeferredToolCall("c1", "write_todos", "{}", READ),
                         DeferredToolCall("c2", "write_todos", "{}", READ)], InteractionMode.CHAT,
                        built_ins=frozenset({"ask_user"}))
    assert [c.next_step for c in result.calls] == ["CallTool", "CallTool"]
    assert result.plan is None


def test_an_oversized_plan_fails_the_call_instead_of_the_commit() -> None:
    """A plan larger than one engine value fails the call with invalid todos, before any write."""
    huge = todos(*((("x" * 1000) + str(i), "pending") for i in range(1100)))
    result = plan_calls([DeferredToolCall("c", "write_todos", huge, READ)], InteractionMode.CHAT)
    assert result.plan is None
    error = result.calls[0].record.error or ""
    assert error.startswith("invalid todos: the plan is ") and "over the limit of 1048576 bytes" in error


def test_a_plan_of_exactly_one_engine_value_is_stored() -> None:
    """The limit is inclusive, as the engine's: a plan of exactly MAX_VALUE_BYTES stores, one byte more fails.

    A stricter check would fail a write_todos call whose plan the engine would have stored.
    """
    base = plan_of(1, PlanStatus.ACTIVE, task(""))
    content = "x" * (MAX_VALUE_BYTES - len(msgspec.json.encode(base)))
    exact = plan_of(1, PlanStatus.ACTIVE, task(content))
    assert len(msgspec.json.encode(exact)) == MAX_VALUE_BYTES
    assert plan_size_error(exact) is None
    encode_value("AgentPlan", AgentPlan, exact)  # the engine stores it
    over = plan_of(1, PlanStatus.ACTIVE, task(content + "x"))
    assert plan_size_error(over) == (
        f"the plan is {MAX_VALUE_BYTES + 1} bytes as JSON, over the limit of {MAX_VALUE_BYTES} bytes"
    )


# Plan mode needs write_todos and a PlanModeRunner -----------------------------------------------


class PlanRunner(ScriptedRunner):
    supports_plan_mode = True


def test_flow_constructor_refuses_plan_mode_without_write_todos_or_a_plan_mode_runner() -> None:
    """Either missing raises ValueError; both missing, one ValueError names both; both present builds
    the Flow."""
    with pytest.raises(ValueError, match=r"needs BuiltInTool\.WRITE_TODOS in built_in_tools"):
        AgentSessionFlow(PlanRunner(), "P", AgentSessionOptions(plan_mode_enabled=True))
    with pytest.raises(ValueError, match=r"needs a runner that supports plan mode .*; ScriptedRunner does not$"):
        AgentSessionFlow(ScriptedRunner(), "P", PLAN_MODE_OPTIONS)
    with pytest.raises(ValueError) as caught:
        AgentSessionFlow(ScriptedRunner(), "P", AgentSessionOptions(plan_mode_enabled=True))
    assert str(caught.value) == (
        "cannot enable plan mode: plan_mode_enabled needs BuiltInTool.WRITE_TODOS in built_in_tools; "
        "plan_mode_enabled needs a runner that supports plan mode (PlanModeRunner, supports_plan_mode = True); "
        "ScriptedRunner does not")
    for not_true in (False, 1, "yes"):  # seed 003: supports_plan_mode is True, not merely truthy
        off = PlanRunner()
        off.supports_plan_mode = not_true  # type: ignore[assignment]
        with pytest.raises(ValueError, match="needs a runner that supports plan mode"):
            AgentSessionFlow(off, "P", PLAN_MODE_OPTIONS)
    assert isinstance(PlanRunner(), PlanModeRunner)
    assert AgentSessionFlow(PlanRunner(), "P", PLAN_MODE_OPTIONS).options.plan_mode_enabled
    with pytest.raises(ValueError, match="plan_mode_enabled must be True or False"):
        AgentSessionOptions(plan_mode_enabled="yes")  # type: ignore[arg-type]


class RefusingClient(ScriptedModelClient):
    """A client that cannot force a tool call (as LiteLLM's for Claude Opus 5.5)."""

    def supports_forced_tool_choice(self, settings: object) -> bool:
        return False


def test_agent_definition_plan_mode_options() -> None:
    """plan_mode_enabled sets the option and write_todos; required needs a forced-choice client."""
    model = ScriptedModelClient(lambda r: ScriptedModelReply(text="ok"))
    agent = AgentDefinition(name="a", instructions="i", model=model, plan_mode_enabled=True)
    options = builtin_agent_session_options(agent)
    assert options.plan_mode_enabled and BuiltInTool.WRITE_TODOS in options.built_in_tools
    assert builtin_agent_session_flow(agent).options.plan_mode_enabled
    assert agent.planning_tool_choice == "auto"
    AgentDefinition(name="a", instructions="i", model=model, planning_tool_choice="required")
    refusing = RefusingClient(lambda r: ScriptedModelReply(text="ok"))
    AgentDefinition(name="a", instructions="i", model=refusing, plan_mode_enabled=True)  # auto is fine
    with pytest.raises(ValueError, match="planning_tool_choice 'required' needs a model client that can force"):
        AgentDefinition(name="a", instructions="i", model=refusing, plan_mode_enabled=True,
                        planning_tool_choice="required")
    with pytest.raises(ValueError, match="planning_tool_choice must be 'auto' or 'required'"):
        AgentDefinition(name="a", instructions="i", model=model, planning_tool_choice="always")  # type: ignore[arg-type]

    @function_tool(effect=ToolEffect.READ)
    def write_todos(items: str) -> str:
        """A clash with the built-in plan mode enables."""
        return items

    AgentDefinition(name="a", instructions="i", model=model, tools=[write_todos])  # an ordinary name without it
    with pytest.raises(ValueError, match="tool write_todos uses the name of an enabled built-in tool"):
        AgentDefinition(name="a", instructions="i", model=model, tools=[write_todos], plan_mode_enabled=True)


# Sessions on a real engine ----------------------------------------------------------------------

NOTE_PREFIXES = ("[Dex] The current plan, revision", "[Dex] There is no plan yet.")
Script = dict[str, list[ScriptedModelReply]]


def turn_message(request: ModelRequest) -> tuple[str, int]:
    """The turn's user message (the last user text that is not the plan note), and the model calls
    the turn made before this one (model output groups after that message)."""
    index = max(i for i, e in enumerate(request.input)
                if isinstance(e, UserTextInput) and not e.text.startswith(NOTE_PREFIXES))
    entry = request.input[index]
    assert isinstance(entry, UserTextInput)
    calls = 0
    previous_was_output = False
    for item in request.input[index + 1:]:
        is_output = not isinstance(item, UserTextInput | ToolResultInput)
        calls += is_output and not previous_was_output
        previous_was_output = is_output
    return entry.text, calls


def replying(script: Script) -> Callable[[ModelRequest], ScriptedModelReply]:
    """Replies by the turn's user message and the model call's position in the turn."""

    def respond(request: ModelRequest) -> ScriptedModelReply:
        text, calls = turn_message(request)
        replies = script.get(text, [ScriptedModelReply(text=f"echo: {text}")])
        return replies[min(calls, len(replies) - 1)]

    return respond


def write(*pairs: tuple[str, str], call_id: str | None = None) -> ScriptedToolCall:
    return ScriptedToolCall("write_todos", todos(*pairs), tool_call_id=call_id)


class PlanEngine:
    """A SQLite engine file, a Client, and an in-process Worker the test stops and starts."""

    def __init__(self, tmp_path: Path, flow: AgentSessionFlow, model: ScriptedModelClient | None = None) -> None:
        self.url = f"sqlite:///{tmp_path / 'plans.db'}"
        self.registry = Registry([flow])
        self.client = AsyncClient(self.registry, self.url)
        self.sessions = AgentSessionClient(self.client, flow)
        self.model = model or ScriptedModelClient(lambda r: ScriptedModelReply(text="unused"))
        self._worker: AsyncWorker | None = None
        self._task: asyncio.Task[None] | None = None

    async def start_worker(self) -> None:
        self._worker = AsyncWorker(self.registry, WorkerOptions(database_url=self.url, **FAST_WORKER))
        self._task = asyncio.create_task(self._worker.run())

    async def stop_worker(self) -> None:
        if self._worker is not None and self._task is not None:
            await self._worker.stop()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._worker = self._task = None

    async def events(self, sid: str) -> list[AgentEvent]:
        read = await self.sessions.read_agent_events(sid, limit=100_000)
        return [e.value for e in read.events]

    async def steps(self, sid: str) -> list[str]:
        return executed_steps(to_step_history(await self.client.get_flow_history(sid)))

    async def turns_done(self, sid: str, count: int) -> AgentSnapshot:
        return await wait_for_agent_snapshot(
            self.sessions, sid,
            lambda s: s if s.state and s.state.turn_count >= count and s.state.active_turn_id is None else None,
            description=f"{count} turns to end")


@contextlib.asynccontextmanager
async def plan_engine(tmp_path: Path, script: Script, **definition: Any) -> AsyncIterator[PlanEngine]:
    model = ScriptedModelClient(replying(script))
    fields: dict[str, Any] = {"instructions": "You are a test agent.", "tools": [lookup_order, refund_order],
                              "plan_mode_enabled": True}
    fields.update(definition)
    agent = AgentDefinition(name="plan-agent", model=model, **fields)
    engine = PlanEngine(tmp_path, builtin_agent_session_flow(agent, "PlanAgent"), model)
    await engine.start_worker()
    try:
        yield engine
    finally:
        await engine.stop_worker()
        await engine.client.close()


def turn_events(events: list[AgentEvent], turn_id: str) -> list[tuple[str, str]]:
    """The turn's committed events but usage and live text, as (type, payload text)."""
    return [(e.type, e.payload) for e in events
            if e.turn_id == turn_id and e.type not in ("usage_recorded", "text_delta", "reasoning_delta")]


def offered(request: ModelRequest) -> list[str]:
    return [t.name for t in request.tools]


APPROVED_1 = approved_plan_message(1)


async def test_plan_mode_draft_then_approval_runs_an_executing_turn(tmp_path: Path) -> None:
    """The whole path: a plan_mode message drafts revision 1 in a planning turn (only write_todos
    offered, the note before the message), execute_plan marks it active and runs an executing turn
    with every tool, whose write_todos completes it; events, payloads and Step shape as specified."""
    script: Script = {
        "Plan the refund": [
            ScriptedModelReply(tool_calls=[write(("look up A-1", "pending"), ("refund A-1", "pending"))]),
            ScriptedModelReply(text="Here is the plan."),
        ],
        APPROVED_1: [
            ScriptedModelReply(tool_calls=[write(("look up A-1", "completed"), ("refund A-1", "completed"))]),
            ScriptedModelReply(text="All done."),
        ],
    }
    async with plan_engine(tmp_path, script) as engine:
        sessions = engine.sessions
        await sessions.start_session("s")
        assert await sessions.send_user_message("s", "Plan the refund", plan_mode=True)
        snapshot = await engine.turns_done("s", 1)
        assert snapshot.state is not None and snapshot.state.interaction_mode is InteractionMode.PLANNING
        assert snapshot.plan is not None
        assert (snapshot.plan.revision, snapshot.plan.status) == (1, PlanStatus.DRAFT)
        assert snapshot.plan.tasks == [task("look up A-1"), task("refund A-1")]
        first, second = list(engine.model.requests)
        assert offered(first) == offered(second) == ["write_todos"]
        assert first.tool_choice is ToolChoice.AUTO  # planning_tool_choice defaults to auto
        assert first.input[-2:] == (UserTextInput(f"[Dex] There is no plan yet.\n{PLANNING_LINE}"),
                                    UserTextInput("Plan the refund"))
        # The second call of the turn sees the draft its first call wrote, still before the turn's items.
        assert second.input[0] == UserTextInput(
            f"[Dex] The current plan, revision 1, is draft:\n- [pending] look up A-1\n- [pending] refund A-1\n"
            f"{PLANNING_LINE}")
        assert ScriptedModelClient.tool_results(second)[0].output == '{"status":"updated","revision":1,"task_count":2}'
        assert await sessions.execute_plan("s", 2) is False  # not written yet

        assert await sessions.execute_plan("s", 1)
        snapshot = await engine.turns_done("s", 2)
        assert snapshot.state is not None and snapshot.state.interaction_mode is InteractionMode.EXECUTING
        assert snapshot.plan is not None
        assert (snapshot.plan.revision, snapshot.plan.status) == (2, PlanStatus.COMPLETED)
        user_texts = [m.text for m in snapshot.messages if m.role.value == "user"]
        assert user_texts == ["Plan the refund", APPROVED_1]
        third, fourth = list(engine.model.requests)[2:]
        assert offered(third) == ["lookup_order", "refund_order", "write_todos"]  # every tool
        assert third.input[-2:] == (UserTextInput(
            "[Dex] The current plan, revision 1, is active:\n- [pending] look up A-1\n- [pending] refund A-1"),
            UserTextInput(APPROVED_1))
        assert any(isinstance(e, UserTextInput) and e.text.startswith(
            "[Dex] The current plan, revision 2, is completed:") for e in fourth.input)
        assert await sessions.execute_plan("s", 2) is False  # completed plans do not run

        events = await engine.events("s")
        # Golden payloads; write_todos settles in RunModel's commit, before the next model call.
        call_id = json.loads(turn_events(events, "turn-1")[1][1])["tool_call_id"]
        assert turn_events(events, "turn-1") == [
            ("turn_started", '{"sequence":1}'),
            ("tool_call_deferred", f'{{"tool_call_id":"{call_id}","tool_name":"write_todos","effect":"read",'
                                   '"requires_approval":false}'),
            ("tool_call_finished", f'{{"tool_call_id":"{call_id}","tool_name":"write_todos","status":"succeeded"}}'),
            ("plan_updated", '{"revision":1,"status":"draft","task_count":2}'),
            ("turn_completed", '{"message_count":3}'),
        ]
        executing = turn_events(events, "turn-2")
        assert executing[:3] == [
            ("plan_updated", '{"revision":1,"status":"active","task_count":2}'),
            ("turn_started", '{"sequence":5}'),
            ("plan_execution_started", '{"revision":1}'),
        ]
        assert ("plan_updated", '{"revision":2,"status":"completed","task_count":2}') in executing
        # write_todos runs in RunModel's commit: no tool Step, ResumeTurn still counts it.
        assert await engine.steps("s") == [
            "StartAgentSession", "AwaitUserMessage", "RunModel", "ResumeTurn", "RunModel",
            "AwaitUserMessage", "RunModel", "ResumeTurn", "RunModel",
        ]


async def test_planning_turn_rejects_other_calls_and_feedback_revises_the_draft(tmp_path: Path) -> None:
    """A planning turn's tool and ask_user calls are rejected with the exact text and never run; a
    plain message while a draft exists plans again (revision 2, still a draft)."""
    script: Script = {
        "Plan it": [ScriptedModelReply(tool_calls=[
            ScriptedToolCall("refund_order", '{"order_id": "A-1", "amount_cents": 5}'),
            ScriptedToolCall("ask_user", '{"question": "Which order?"}'),
            write(("refund A-1", "pending")),
        ]), ScriptedModelReply(text="Drafted.")],
        "Also tell the customer": [ScriptedModelReply(tool_calls=[
            write(("refund A-1", "pending"), ("tell the customer", "pending"))]), ScriptedModelReply(text="Revised.")],
    }
    async with plan_engine(tmp_path, script) as engine:
        sessions = engine.sessions
        await sessions.start_session("s")
        assert await sessions.send_user_message("s", "Plan it", plan_mode=True)
        snapshot = await engine.turns_done("s", 1)
        results = ScriptedModelClient.tool_results(engine.model.requests[-1])
        assert [(r.tool_name, r.output) for r in results] == [
            ("refund_order", PLANNING_TURN_REJECTION_MESSAGE), ("ask_user", PLANNING_TURN_REJECTION_MESSAGE),
            ("write_todos", '{"status":"updated","revision":1,"task_count":1}'),
        ]
        assert snapshot.pending_interrupts == []
        assert "CallSingleAttemptTool" not in await engine.steps("s")
        assert "AwaitQuestionAnswer" not in await engine.steps("s")

        assert await sessions.send_user_message("s", "Also tell the customer")  # no plan_mode: the draft plans
        snapshot = await engine.turns_done("s", 2)
        assert snapshot.state is not None and snapshot.state.interaction_mode is InteractionMode.PLANNING
        assert snapshot.plan is not None and (snapshot.plan.revision, snapshot.plan.status) == (2, PlanStatus.DRAFT)
        assert offered(engine.model.requests[-1]) == ["write_todos"]
        events = await engine.events("s")
        finished = [json.loads(e.payload) for e in events if e.type == "tool_call_finished"]
        assert [f["status"] for f in finished[:3]] == ["rejected", "rejected", "succeeded"]


async def test_write_todos_twice_and_invalid_in_a_session(tmp_path: Path) -> None:
    """Two write_todos in one response both fail and leave no plan; invalid arguments fail with
    invalid todos: the model sees each as The tool call failed: <error>. Plan mode stays off here."""
    script: Script = {
        "twice": [ScriptedModelReply(tool_calls=[write(("a", "pending")), write(("b", "pending"))]),
                  ScriptedModelReply(text="ok")],
        "invalid": [ScriptedModelReply(tool_calls=[ScriptedToolCall("write_todos", '{"todos": [{"content": "a"}]}')]),
                    ScriptedModelReply(text="ok")],
    }
    async with plan_engine(tmp_path, script, plan_mode_enabled=False,
                           built_in_tools=frozenset({BuiltInTool.WRITE_TODOS})) as engine:
        sessions = engine.sessions
        await sessions.start_session("s", "twice")
        snapshot = await engine.turns_done("s", 1)
        assert snapshot.plan is None
        assert snapshot.state is not None and snapshot.state.interaction_mode is InteractionMode.CHAT
        results = ScriptedModelClient.tool_results(engine.model.requests[-1])
        assert [r.output for r in results] == [f"The tool call failed: {WRITE_TODOS_CALLED_MORE_THAN_ONCE}"] * 2
        assert await sessions.send_user_message("s", "a plan please", plan_mode=True) is False  # plan mode off
        assert await sessions.send_user_message("s", "invalid")
        await engine.turns_done("s", 2)
        results = ScriptedModelClient.tool_results(engine.model.requests[-1])
        assert [r.output for r in results] == [
            "The tool call failed: invalid todos: todos[0].status must be one of pending, in_progress, completed, "
            "got None"]
        assert not [e for e in await engine.events("s") if e.type == "plan_updated"]


async def test_active_plan_executes_without_plan_updated_and_every_write_is_noted(tmp_path: Path) -> None:
    """With write_todos only, a chat write is active; execute_plan runs it as is (no plan_updated from
    the approval), and [] clears it, after which execute_plan is refused."""
    approved_1 = approved_plan_message(1)
    script: Script = {
        "track it": [ScriptedModelReply(tool_calls=[write(("a", "completed"), ("b", "pending"))]),
                     ScriptedModelReply(text="tracked")],
        approved_1: [ScriptedModelReply(tool_calls=[ScriptedToolCall("write_todos", '{"todos": []}')]),
                     ScriptedModelReply(text="cleared")],
    }
    async with plan_engine(tmp_path, script, plan_mode_enabled=False,
                           built_in_tools=frozenset({BuiltInTool.WRITE_TODOS})) as engine:
        sessions = engine.sessions
        await sessions.start_session("s", "track it")
        snapshot = await engine.turns_done("s", 1)
        assert snapshot.plan is not None and (snapshot.plan.revision, snapshot.plan.status) == (1, PlanStatus.ACTIVE)
        assert await sessions.execute_plan("s", 1)
        snapshot = await engine.turns_done("s", 2)
        assert snapshot.plan is not None and (snapshot.plan.revision, snapshot.plan.status) == (2, PlanStatus.CLEARED)
        assert ScriptedModelClient.tool_results(engine.model.requests[-1])[0].output == (
            '{"status":"cleared","revision":2}')
        # The executing turn's first call saw the active plan; the next call sees no note at all.
        assert engine.model.requests[2].input[-2] == UserTextInput(
            "[Dex] The current plan, revision 1, is active:\n- [completed] a\n- [pending] b")
        assert not any(isinstance(e, UserTextInput) and e.text.startswith(NOTE_PREFIXES)
                       for e in engine.model.requests[3].input)
        events = await engine.events("s")
        assert [(e.type, e.payload) for e in events if e.type.startswith("plan_")] == [
            ("plan_updated", '{"revision":1,"status":"active","task_count":2}'),
            ("plan_execution_started", '{"revision":1}'),
            ("plan_updated", '{"revision":2,"status":"cleared","task_count":0}'),
        ]
        assert await sessions.execute_plan("s", 2) is False


async def test_execute_plan_refusals_while_an_approval_is_pending(tmp_path: Path) -> None:
    """With AwaitUserMessage waiting and no Worker: of two concurrent execute_plan calls exactly one is
    True, a repeat is False while PendingPlanExecution holds it, and so is a call while a message is
    queued. The approval satisfied the wait in its own commit, so when the Worker returns the executing
    turn runs first, then the queued message's turn (which rewrites the plan as revision 2); then
    revision 1 is stale and revision 2 can run. AwaitUserMessage consumed PendingPlanExecution."""
    approved_1, approved_2 = approved_plan_message(1), approved_plan_message(2)
    script: Script = {
        "Plan it": [ScriptedModelReply(tool_calls=[write(("a", "pending"))]), ScriptedModelReply(text="drafted")],
        approved_1: [ScriptedModelReply(text="executing 1")],
        "Change it": [ScriptedModelReply(tool_calls=[write(("a", "completed"), ("b", "pending"))]),
                      ScriptedModelReply(text="changed")],
        approved_2: [ScriptedModelReply(text="executing 2")],
    }
    async with plan_engine(tmp_path, script) as engine:
        sessions = engine.sessions
        await drafted_then_idle_without_a_worker(engine)

        results = await asyncio.gather(sessions.execute_plan("s", 1), sessions.execute_plan("s", 1))
        assert sorted(results) == [False, True]
        assert await sessions.execute_plan("s", 1) is False  # PendingPlanExecution holds it
        pending = await engine.client.get_attribute("s", PENDING_PLAN_EXECUTION)
        assert pending is not None and pending.revision == 1
        assert await sessions.send_user_message("s", "Change it")
        assert (await sessions.get_agent_snapshot("s")).queued_message_count == 1
        assert await sessions.execute_plan("s", 1) is False

        await engine.start_worker()
        snapshot = await engine.turns_done("s", 3)
        assert [m.text for m in snapshot.messages if m.role.value == "user"] == ["Plan it", approved_1, "Change it"]
        assert await engine.client.get_attribute("s", PENDING_PLAN_EXECUTION) is None
        assert snapshot.state is not None and snapshot.state.interaction_mode is InteractionMode.CHAT
        assert snapshot.plan is not None and (snapshot.plan.revision, snapshot.plan.status) == (2, PlanStatus.ACTIVE)
        assert await sessions.execute_plan("s", 1) is False  # a stale revision
        assert await sessions.execute_plan("s", 2)  # an active plan may run
        snapshot = await engine.turns_done("s", 4)
        assert snapshot.messages[-1].text == "executing 2"
        started = [e.payload for e in await engine.events("s") if e.type == "plan_execution_started"]
        assert started == ['{"revision":1}', '{"revision":2}']


def test_await_user_message_waits_on_the_current_revision_last() -> None:
    """The wait's conditions in argument order: steers, then queued messages, then the approval of
    the current revision, only while the plan is draft or active (so a queued message beats it)."""
    flow = AgentSessionFlow(PlanRunner(), "P", PLAN_MODE_OPTIONS)
    wait_for = flow.step("AwaitUserMessage").wait_for
    assert wait_for is not None

    class PlanOnly:
        def __init__(self, plan: AgentPlan | None) -> None:
            self.plan = plan

        def get(self, ref: Any, default: Any = None) -> Any:
            assert ref.name == "AgentPlan"  # the only thing the WaitFor reads
            return self.plan

    def channels(plan: AgentPlan | None) -> list[tuple[Any, Any]]:
        assert wait_for is not None
        wait = asyncio.run(wait_for(PlanOnly(plan), None))  # type: ignore[arg-type]
        return [(c.channel, c.key) for c in wait.spec().conditions]

    queued = ("QueuedUserMessages", "")
    for plan in (DRAFT, plan_of(3, PlanStatus.ACTIVE, task("a"))):
        conditions = channels(plan)
        assert conditions[-2:] == [queued, ("PlanExecutions", "3")]
        assert conditions[:-2] in ([], [("TurnControlRequests", "")])  # steering's condition comes first
    for plan in (None, plan_of(3, PlanStatus.COMPLETED), plan_of(3, PlanStatus.CLEARED)):
        assert channels(plan)[-1] == queued


class _CannotBuildUserMessages(PlanRunner):
    """A plan mode runner whose build_user_message raises, for the approval message too."""

    def build_user_message(self, text: str) -> Any:
        raise ValueError("cannot build")


async def test_an_approval_whose_message_cannot_be_built_writes_no_plan_execution_started() -> None:
    """AwaitUserMessage taking an approval of a draft marks it active (plan_updated) and starts the
    executing turn, which fails in the same commit when the runner cannot build the approval message:
    turn_started then turn_failed, and no plan_execution_started, which only a turn that runs writes.
    The failed turn is the last turn, so AgentState keeps its executing mode (seed 002)."""
    flow = AgentSessionFlow(_CannotBuildUserMessages(), "P", PLAN_MODE_OPTIONS)
    steps = TurnSteps(runtime_of(flow))
    idle = AgentState(status=AgentStatus.WAITING_FOR_USER_MESSAGE, turn_count=1, active_turn_id=None,
                      next_message_sequence=4, last_turn_error=None)
    values: dict[tuple[str, str], Any] = {("AgentState", ""): idle, ("AgentPlan", ""): DRAFT}
    wait = await steps.await_user_message_wait(step_context(flow, AWAIT_USER_MESSAGE, values), None)
    conditions = len(wait.spec().conditions)
    approval = ConsumedMessage(1, msgspec.Raw(msgspec.json.encode(PlanExecutionRequest(DRAFT.revision))))
    outcome = WaitOutcome(satisfied=(conditions - 1,), consumed=(*[()] * (conditions - 1), (approval,)))
    ctx = step_context(flow, AWAIT_USER_MESSAGE, values, (wait, outcome))
    decision = await steps.await_user_message(ctx, None)
    assert [m.step_type for m in decision.movements] == [AWAIT_USER_MESSAGE]
    state = ctx.get(AGENT_STATE)
    assert state is not None
    assert (state.active_turn_id, state.turn_count, state.last_turn_error, state.interaction_mode) == (
        None, 2, "build_user_message raised ValueError: cannot build", InteractionMode.EXECUTING)
    plan = ctx.get(AGENT_PLAN)
    assert plan is not None and (plan.revision, plan.status) == (DRAFT.revision, PlanStatus.ACTIVE)
    events = [msgspec.json.decode(data, type=AgentEvent) for _, _, data in ctx.writes.appends]
    assert [(e.type, e.turn_id) for e in events] == [
        ("plan_updated", "turn-2"), ("turn_started", "turn-2"), ("turn_failed", "turn-2")]


async def test_a_stale_approval_only_consumes_its_pending_execution_and_waits_again() -> None:
    """An approval AwaitUserMessage took for a revision the plan no longer has (or a plan no longer
    draft or active) runs nothing: PendingPlanExecution is deleted, so execute_plan can be asked
    again, and the Step waits for the next message with no plan, state or event written."""
    flow = AgentSessionFlow(PlanRunner(), "P", PLAN_MODE_OPTIONS)
    steps = TurnSteps(runtime_of(flow))
    idle = AgentState(status=AgentStatus.WAITING_FOR_USER_MESSAGE, turn_count=1, active_turn_id=None,
                      next_message_sequence=4, last_turn_error=None)
    # The wait registered for the approved revision; the Execute reads a plan a later commit wrote.
    for plan, revision in ((DRAFT, 2), (plan_of(3, PlanStatus.COMPLETED, task("a")), 3)):
        when_waiting = {("AgentState", ""): idle, ("AgentPlan", ""): plan_of(revision, PlanStatus.DRAFT, task("a"))}
        wait = await steps.await_user_message_wait(step_context(flow, AWAIT_USER_MESSAGE, when_waiting), None)
        values: dict[tuple[str, str], Any] = {
            ("AgentState", ""): idle, ("AgentPlan", ""): plan,
            ("PendingPlanExecution", ""): PlanExecutionRequest(revision),
        }
        conditions = len(wait.spec().conditions)
        approval = ConsumedMessage(1, msgspec.Raw(msgspec.json.encode(PlanExecutionRequest(revision))))
        outcome = WaitOutcome(satisfied=(conditions - 1,), consumed=(*[()] * (conditions - 1), (approval,)))
        ctx = step_context(flow, AWAIT_USER_MESSAGE, values, (wait, outcome))
        decision = await steps.await_user_message(ctx, None)
        assert [m.step_type for m in decision.movements] == [AWAIT_USER_MESSAGE], plan
        assert ctx.writes.attributes == {("PendingPlanExecution", ""): None}, plan
        assert (ctx.writes.appends, ctx.writes.publishes) == ([], []), plan


@pytest.mark.parametrize("waiting", ["steered message", "interrupt"])
async def test_execute_plan_refuses_while_a_steered_message_or_an_interrupt_is_pending(waiting: str) -> None:
    """Seed 002 "RPCs": execute_plan returns False, writing nothing, while a steered message or an
    interrupt is pending, though the session waits for a user message with its draft (a turn whose
    model call answered as the user steered it ends with the steered message still to be applied).
    The same call with neither pending is accepted. Catches: the RPC passing execute_plan_accepted 0
    for either count, whose pure tests pass either way."""
    flow = AgentSessionFlow(PlanRunner(), "P", PLAN_MODE_OPTIONS)
    idle = AgentState(status=AgentStatus.WAITING_FOR_USER_MESSAGE, turn_count=1, active_turn_id=None,
                      next_message_sequence=4, last_turn_error=None)
    loaded = {("AgentState", ""): msgspec.json.encode(idle), ("AgentPlan", ""): msgspec.json.encode(DRAFT)}
    pending: dict[tuple[str, str], list[tuple[int, bytes]]] = {}
    if waiting == "steered message":
        pending[("SteeredUserMessages", "")] = [(1, msgspec.json.encode(AgentUserMessage("do it differently")))]
    else:
        loaded[("PendingInterrupts", "")] = msgspec.json.encode([interrupt("w1")])
    execute_plan = flow.rpc("execute_plan").handler
    refused = RpcContext(flow, "s", loaded, LoadOptions.all(), pending, "execute_plan")
    assert await execute_plan(refused, ExecutePlanRequest(DRAFT.revision)) is False
    assert refused.writes.empty()
    clear = {key: value for key, value in loaded.items() if key[0] != "PendingInterrupts"}
    accepted = RpcContext(flow, "s", clear, LoadOptions.all(), {}, "execute_plan")
    assert await execute_plan(accepted, ExecutePlanRequest(DRAFT.revision)) is True
    assert accepted.get(PENDING_PLAN_EXECUTION) == PlanExecutionRequest(DRAFT.revision)


@pytest.mark.parametrize("enabled", [False, True])
async def test_a_draft_left_from_when_plan_mode_was_on_starts_a_chat_turn_once_it_is_off(enabled: bool) -> None:
    """A session that drafted a plan, now run by a Worker whose options turn plan mode off (a new
    deployment): the next message starts a chat turn, as seed 002 gives a planning turn only while
    plan mode is enabled; with it still on, the draft makes the turn a planning one."""
    options = PLAN_MODE_OPTIONS if enabled else AgentSessionOptions()
    flow = AgentSessionFlow(PlanRunner(), "P", options)
    steps = TurnSteps(runtime_of(flow))
    idle = AgentState(status=AgentStatus.WAITING_FOR_USER_MESSAGE, turn_count=1, active_turn_id=None,
                      next_message_sequence=4, last_turn_error=None, interaction_mode=InteractionMode.PLANNING)
    values: dict[tuple[str, str], Any] = {("AgentState", ""): idle, ("AgentPlan", ""): DRAFT}
    wait = await steps.await_user_message_wait(step_context(flow, AWAIT_USER_MESSAGE, values), None)
    conditions = len(wait.spec().conditions)
    queued = ConsumedMessage(1, msgspec.Raw(msgspec.json.encode(AgentUserMessage("go on"))))
    # The queued message is the second condition, after the turn control wake.
    outcome = WaitOutcome(satisfied=(1,), consumed=((), (queued,), *[()] * (conditions - 2)))
    ctx = step_context(flow, AWAIT_USER_MESSAGE, values, (wait, outcome))
    await steps.await_user_message(ctx, None)
    state = ctx.get(AGENT_STATE)
    assert state is not None and state.active_turn_id == "turn-2"
    assert state.interaction_mode is (InteractionMode.PLANNING if enabled else InteractionMode.CHAT)


async def test_a_message_the_waiting_session_took_still_counts_as_queued(tmp_path: Path) -> None:
    """With AwaitUserMessage waiting and no Worker, a sent message satisfies the wait in its own
    commit: it leaves the queue before any turn stores it. Until the turn starts the snapshot still
    lists it as queued (so a UI rebuilt from the snapshot does not lose it), delete_queued_message
    can no longer remove it, and execute_plan refuses, as for any queued message."""
    script: Script = {
        "Plan it": [ScriptedModelReply(tool_calls=[write(("a", "pending"))]), ScriptedModelReply(text="drafted")],
        "Change it": [ScriptedModelReply(text="noted")],
    }
    async with plan_engine(tmp_path, script) as engine:
        sessions = engine.sessions
        await drafted_then_idle_without_a_worker(engine)

        assert await sessions.send_user_message("s", "Change it")
        snapshot = await sessions.get_agent_snapshot("s")
        assert snapshot.queued_message_count == 1
        [taken] = snapshot.queued_messages
        assert taken.message.text == "Change it"
        assert "Change it" not in [m.text for m in snapshot.messages]
        assert await sessions.delete_queued_message("s", taken.message_id) is False
        assert await sessions.execute_plan("s", 1) is False
        assert await sessions.send_user_message("s", "And this")
        later = await sessions.get_agent_snapshot("s")
        assert [p.message.text for p in later.queued_messages] == ["Change it", "And this"]

        await engine.start_worker()
        snapshot = await engine.turns_done("s", 3)
        assert [m.text for m in snapshot.messages if m.role.value == "user"] == ["Plan it", "Change it", "And this"]
        assert snapshot.queued_messages == [] and snapshot.queued_message_count == 0


async def drafted_then_idle_without_a_worker(engine: PlanEngine) -> None:
    """Session "s" drafts a plan ("Plan it"), waits for the next message, and then no Worker runs."""
    await engine.sessions.start_session("s")
    assert await engine.sessions.send_user_message("s", "Plan it", plan_mode=True)
    await engine.turns_done("s", 1)
    await wait_until_waiting(engine, "s")
    await engine.stop_worker()


async def wait_until_waiting(engine: PlanEngine, sid: str) -> None:
    """Until AwaitUserMessage's WaitFor has registered its wait (not merely been scheduled)."""

    async def waiting() -> bool:
        history = to_step_history(await engine.client.get_flow_history(sid))
        mine = [e.event_type for e in history if e.step_type == "AwaitUserMessage"]
        return mine.count("wait_registered") > mine.count("execute_completed")

    await wait_until("AwaitUserMessage to wait", waiting)


async def test_required_tool_choice_forces_write_todos_only_on_the_first_call_without_a_draft(
    tmp_path: Path,
) -> None:
    """planning_tool_choice required: the first model call of a planning turn is forced while no
    draft exists; later calls, even after a write_todos that failed and left no draft, and a planning
    turn on an existing draft, are auto. A chat turn is auto. (The failed call kills mutant R16 of the
    loop sweep, later calls forced too: a model whose write_todos kept failing could never answer.)"""
    script: Script = {
        "Plan": [ScriptedModelReply(tool_calls=[ScriptedToolCall("write_todos", {})]),
                 ScriptedModelReply(tool_calls=[write(("a", "pending"))]), ScriptedModelReply(text="drafted")],
        "More": [ScriptedModelReply(text="Which part?")],
        "hello": [ScriptedModelReply(text="hi")],
    }
    async with plan_engine(tmp_path, script, planning_tool_choice="required") as engine:
        sessions = engine.sessions
        await sessions.start_session("s", "hello")
        await engine.turns_done("s", 1)
        assert await sessions.send_user_message("s", "Plan", plan_mode=True)
        await engine.turns_done("s", 2)
        assert await sessions.send_user_message("s", "More")
        snapshot = await engine.turns_done("s", 3)
        choices = [(offered(r), r.tool_choice) for r in engine.model.requests]
        assert choices == [
            (["lookup_order", "refund_order", "write_todos"], ToolChoice.AUTO),  # initial message: a chat turn
            (["write_todos"], ToolChoice.REQUIRED),
            (["write_todos"], ToolChoice.AUTO),  # no draft: the first write_todos failed
            (["write_todos"], ToolChoice.AUTO),
            (["write_todos"], ToolChoice.AUTO),  # a draft exists
        ]
        assert snapshot.plan is not None and snapshot.plan.status is PlanStatus.DRAFT  # a text answer keeps it


class RecordingPlanRunner(PlanRunner):
    """A scripted (non built-in) PlanModeRunner that records what each RunModel hands it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[InteractionMode, AgentPlan | None]] = []

    async def run_model_step(self, turn: Any) -> Any:
        self.seen.append((turn.interaction_mode, turn.plan))
        return await super().run_model_step(turn)


async def test_any_plan_mode_runner_gets_the_mode_and_the_committed_plan(tmp_path: Path) -> None:
    """AgentTurnContext.interaction_mode and .plan reach any PlanModeRunner: the planning turn's first
    call sees no plan, its second the draft its write_todos committed; the initial message is chat."""
    runner = RecordingPlanRunner()
    flow = AgentSessionFlow(runner, "RecordingPlan", PLAN_MODE_OPTIONS)
    engine = PlanEngine(tmp_path, flow)
    await engine.start_worker()
    try:
        await engine.sessions.start_session("s", "hello")
        await engine.turns_done("s", 1)
        script = {"steps": [{"tools": [{"id": "w1", "name": "write_todos",
                                        "args": {"todos": [{"content": "a", "status": "pending"}]}}]},
                            {"answer": "drafted {results}"}]}
        assert await engine.sessions.send_user_message("s", json.dumps(script), plan_mode=True)
        snapshot = await engine.turns_done("s", 2)
    finally:
        await engine.stop_worker()
        await engine.client.close()
    assert snapshot.messages[-1].text == 'drafted w1={"status":"updated","revision":1,"task_count":1}'
    draft = snapshot.plan
    assert draft is not None and draft.status is PlanStatus.DRAFT
    assert runner.seen == [(InteractionMode.CHAT, None), (InteractionMode.PLANNING, None),
                           (InteractionMode.PLANNING, draft)]


async def test_execute_plan_client_retries_a_lock_conflict() -> None:
    """AgentSessionClient.execute_plan retries RpcLockConflictError like the other locking methods."""

    class Flaky:
        def __init__(self) -> None:
            self.calls: list[tuple[str, Any]] = []

        async def rpc(self, flow_id: str, name: str, request: Any = None) -> Any:
            self.calls.append((name, request))
            if len(self.calls) == 1:
                raise RpcLockConflictError(flow_id, "PendingPlanExecution", "RPC execute_plan")
            return True

    flaky = Flaky()
    flow = builtin_agent_session_flow(AgentDefinition(
        name="a", instructions="i", model=ScriptedModelClient(lambda r: ScriptedModelReply(text="x"))))
    client = AgentSessionClient(flaky, flow)  # type: ignore[arg-type]
    assert await client.execute_plan("s", 3) is True
    assert [name for name, _ in flaky.calls] == ["execute_plan", "execute_plan"]
    assert flaky.calls[0][1].revision == 3


# The demo model's /plan and the chat ----------------------------------------------------------


def test_chat_plan_helpers() -> None:
    """Only /plan messages ask for plan mode; a plan shows as a header and one line per task."""
    assert wants_plan_mode("/plan a; b") and wants_plan_mode("/plan")
    assert not wants_plan_mode("/planets") and not wants_plan_mode("plan it")
    assert plan_lines(DRAFT) == ["plan revision 3 (draft):", "  [pending] look up the order",
                                 "  [in_progress] refund it"]


def test_demo_model_plans_and_executes() -> None:
    """/plan writes a pending plan with write_todos; the approval marks every task in the note completed."""
    reply = demo_reply(ModelRequest(None, (UserTextInput("/plan look up A-1001; refund it"),),
                                    tools=(ModelToolDefinition("write_todos", "", {}),)))
    assert [c.name for c in reply.tool_calls] == ["write_todos"]
    assert json.loads(str(reply.tool_calls[0].arguments)) == {"todos": [
        {"content": "look up A-1001", "status": "pending"}, {"content": "refund it", "status": "pending"}]}
    assert demo_reply(ModelRequest(None, (UserTextInput("/plan"),))).text == "Usage: /plan TASK; TASK; ..."
    note = "[Dex] The current plan, revision 1, is active:\n- [pending] look up A-1001\n- [pending] refund it"
    reply = demo_reply(ModelRequest(None, (UserTextInput(note), UserTextInput(approved_plan_message(1)))))
    assert json.loads(str(reply.tool_calls[0].arguments)) == {"todos": [
        {"content": "look up A-1001", "status": "completed"}, {"content": "refund it", "status": "completed"}]}

