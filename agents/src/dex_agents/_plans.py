"""Plans and plan mode: the pure rules (seed 002 "Rules", seed 003 "Plans and plan mode").

Nothing here touches the engine: the write_todos argument check, the plan a successful call writes
(revision + 1 and its status), what the model sees, the plan note, the turn-mode decision every turn
start applies, and execute_plan's acceptance rule. The Steps and RPCs that apply them are in
_plan_rpcs.py and the shared Step modules.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import msgspec

from dex_engine import MAX_VALUE_BYTES

from ._builtin_tools import BuiltInArgumentsError, BuiltInTool, decode_arguments_object
from ._constants import PLANNING_TURN_REJECTION_MESSAGE, SHOWN_VALUE_CHARS, WRITE_TODOS_CALLED_MORE_THAN_ONCE
from ._timefmt import format_time
from ._wire import (
    AgentPlan,
    AgentPlanTask,
    AgentState,
    AgentStatus,
    AgentToolCall,
    AgentToolCallStatus,
    AgentUserMessage,
    InteractionMode,
    PlanStatus,
    PlanTaskStatus,
)

WRITE_TODOS = BuiltInTool.WRITE_TODOS.value

# Plans execute_plan may approve: a draft, or an active plan the user wants run again.
EXECUTABLE_PLAN_STATUSES = frozenset({PlanStatus.DRAFT, PlanStatus.ACTIVE})

PLAN_NOTE_PLANNING_LINE = (
    "This turn only plans: write or revise the plan with write_todos, and do not do or claim any of its tasks. "
    "The user reviews the plan before it runs."
)
PLAN_NOTE_NO_PLAN = "[Dex] There is no plan yet."

_TASK_STATUS_VALUES = frozenset(s.value for s in PlanTaskStatus)
_TASK_STATUSES = ", ".join(s.value for s in PlanTaskStatus)
_TASK_FIELDS = ("content", "status")


def _invalid(reason: str) -> BuiltInArgumentsError:
    return BuiltInArgumentsError(f"invalid todos: {reason}")


def parse_write_todos(arguments: str) -> tuple[AgentPlanTask, ...]:
    """The tasks of a write_todos call, or BuiltInArgumentsError with the text the model sees.

    Text that is not a strict JSON object (NaN included) fails as `arguments must be a JSON
    object`; every other problem as `invalid todos: <reason>`. The first unknown name is the
    lowest by code point, as for the other built-ins.
    """

    value = decode_arguments_object(arguments)
    unknown = sorted(set(value) - {"todos"})
    if unknown:
        raise _invalid(f"unknown argument {unknown[0]!r:.{SHOWN_VALUE_CHARS}}")
    todos = value.get("todos")
    if todos is None:
        raise _invalid("todos is required: a list of tasks, each {content, status}")
    if not isinstance(todos, list):
        raise _invalid(f"todos must be a list of tasks, got {type(todos).__name__}")
    tasks: list[AgentPlanTask] = []
    for index, task in enumerate(todos):
        where = f"todos[{index}]"
        if not isinstance(task, dict):
            raise _invalid(f"{where} must be an object with content and status")
        extra = sorted(set(task) - set(_TASK_FIELDS))
        if extra:
            raise _invalid(f"{where} has unknown field {extra[0]!r:.{SHOWN_VALUE_CHARS}}")
        content = task.get("content")
        if not isinstance(content, str) or not content.strip():
            raise _invalid(f"{where}.content must be non-empty text")
        status = task.get("status")
        if not isinstance(status, str) or status not in _TASK_STATUS_VALUES:
            raise _invalid(f"{where}.status must be one of {_TASK_STATUSES}, got {status!r:.{SHOWN_VALUE_CHARS}}")
        tasks.append(AgentPlanTask(content=content, status=PlanTaskStatus(status)))
    return tuple(tasks)


def plan_status_after_write(tasks: Iterable[AgentPlanTask], mode: InteractionMode) -> PlanStatus:
    """The status write_todos gives the plan, rules in the seed's order.

    No tasks is cleared, a planning turn writes a draft, every task completed is completed, and
    otherwise the plan is active.
    """
    listed = list(tasks)
    if not listed:
        return PlanStatus.CLEARED
    if mode is InteractionMode.PLANNING:
        return PlanStatus.DRAFT
    if all(t.status is PlanTaskStatus.COMPLETED for t in listed):
        return PlanStatus.COMPLETED
    return PlanStatus.ACTIVE


def written_plan(
    current: AgentPlan | None, tasks: Iterable[AgentPlanTask], mode: InteractionMode, now: datetime
) -> AgentPlan:
    """The plan a successful write_todos stores: the whole task list, revision + 1."""
    listed = list(tasks)
    revision = 1 if current is None else current.revision + 1
    return AgentPlan(revision=revision, status=plan_status_after_write(listed, mode), tasks=listed,
                     updated_at=format_time(now))


def write_todos_output(plan: AgentPlan) -> str:
    """What the model sees for a write_todos call that succeeded."""
    if plan.status is PlanStatus.CLEARED:
        value: dict[str, Any] = {"status": "cleared", "revision": plan.revision}
    else:
        value = {"status": "updated", "revision": plan.revision, "task_count": len(plan.tasks)}
    return json.dumps(value, separators=(",", ":"))


def plan_updated_payload(plan: AgentPlan) -> dict[str, Any]:
    """The plan_updated event payload."""
    return {"revision": plan.revision, "status": plan.status.value, "task_count": len(plan.tasks)}


def plan_execution_started_payload(revision: int) -> dict[str, Any]:
    """The plan_execution_started event payload."""
    return {"revision": revision}


def approved_plan_message(revision: int) -> str:
    """The user message of the executing turn an approval starts (stored through build_user_message)."""
    return (f"[Dex] The user approved plan revision {revision}. "
            "Execute it and keep the task statuses current with write_todos.")


def build_plan_note(plan: AgentPlan | None, interaction_mode: InteractionMode) -> str | None:
    """The user text that shows the model the plan, before the turn's messages; None for no note.

    A planning turn always gets a note, ending with the line that says it only plans; a missing or
    cleared plan shows as `[Dex] There is no plan yet.` there and as nothing in other turns.
    """
    planning = InteractionMode(interaction_mode) is InteractionMode.PLANNING
    lines: list[str] = []
    if plan is None or plan.status is PlanStatus.CLEARED or not plan.tasks:
        if not planning:
            return None
        lines.append(PLAN_NOTE_NO_PLAN)
    else:
        lines.append(f"[Dex] The current plan, revision {plan.revision}, is {plan.status.value}:")
        lines.extend(f"- [{task.status.value}] {task.content}" for task in plan.tasks)
    if planning:
        lines.append(PLAN_NOTE_PLANNING_LINE)
    return "\n".join(lines)


def turn_interaction_mode(
    plan_mode_enabled: bool, messages: Iterable[AgentUserMessage], plan: AgentPlan | None
) -> InteractionMode:
    """The mode of a turn that user messages start (queued, steered or initial); one rule for all.

    Planning when plan mode is enabled and a message has plan_mode or a draft plan exists, else
    chat. Only an approved plan execution starts an executing turn.
    """
    if not plan_mode_enabled:
        return InteractionMode.CHAT
    if plan is not None and plan.status is PlanStatus.DRAFT:
        return InteractionMode.PLANNING
    if any(m.plan_mode for m in messages):
        return InteractionMode.PLANNING
    return InteractionMode.CHAT


def is_executable(plan: AgentPlan | None) -> bool:
    return plan is not None and plan.status in EXECUTABLE_PLAN_STATUSES


def valid_revision(revision: object) -> bool:
    return isinstance(revision, int) and not isinstance(revision, bool) and revision >= 1


def execute_plan_accepted(
    revision: object,
    *,
    state: AgentState | None,
    plan: AgentPlan | None,
    pending_execution_revision: int | None,
    queued_message_count: int,
    steered_message_count: int,
    pending_interrupt_count: int,
) -> bool:
    """Whether execute_plan accepts an approval of `revision` (seed 002 "RPCs").

    Only while the session waits for a user message, the plan has this revision and is draft or
    active, no approval of it is pending, and nothing is queued, steered or waiting for a person.
    """
    if not valid_revision(revision):
        return False
    if state is None or state.active_turn_id is not None or state.status is not AgentStatus.WAITING_FOR_USER_MESSAGE:
        return False
    if plan is None or plan.revision != revision or not is_executable(plan):
        return False
    if pending_execution_revision == revision:
        return False
    return queued_message_count == 0 and steered_message_count == 0 and pending_interrupt_count == 0


def approved_plan(plan: AgentPlan | None, revision: int, now: datetime) -> tuple[AgentPlan, bool] | None:
    """The plan an approval of `revision` executes, and whether the approval changed it (draft -> active).

    None when the approval is stale: the plan no longer has that revision or is no longer draft or
    active, so AwaitUserMessage waits again.
    """
    if plan is None or plan.revision != revision or not is_executable(plan):
        return None
    if plan.status is PlanStatus.ACTIVE:
        return plan, False
    return msgspec.structs.replace(plan, status=PlanStatus.ACTIVE, updated_at=format_time(now)), True


@dataclass(frozen=True)
class WriteTodosOutcome:
    """A write_todos call settled in RunModel's commit: its final record, and the plan it wrote (if any)."""

    record: AgentToolCall
    plan: AgentPlan | None


def plan_size_error(plan: AgentPlan) -> str | None:
    """Why the plan cannot be stored (one engine value), or None."""
    size = len(msgspec.json.encode(plan))
    if size > MAX_VALUE_BYTES:
        return f"the plan is {size} bytes as JSON, over the limit of {MAX_VALUE_BYTES} bytes"
    return None


def settle_write_todos(
    record: AgentToolCall,
    *,
    current_plan: AgentPlan | None,
    mode: InteractionMode,
    now: datetime,
    called_more_than_once: bool,
) -> WriteTodosOutcome:
    """Settle one write_todos call: succeeded with the new plan, or failed with the plan unchanged.

    `record` is the call's approved record (read effect, no approval); `current_plan` the plan the
    call replaces, which for a second successful call in one response would be the first's (but a
    response with more than one call fails each of them).
    """
    def failed(error: str) -> WriteTodosOutcome:
        return WriteTodosOutcome(msgspec.structs.replace(
            record, status=AgentToolCallStatus.FAILED, output=None, error=error, rejection_message=None,
        ), None)

    if called_more_than_once:
        return failed(WRITE_TODOS_CALLED_MORE_THAN_ONCE)
    try:
        tasks = parse_write_todos(record.arguments)
    except BuiltInArgumentsError as exc:
        return failed(str(exc))
    plan = written_plan(current_plan, tasks, mode, now)
    too_large = plan_size_error(plan)
    if too_large is not None:
        return failed(f"invalid todos: {too_large}")
    succeeded = msgspec.structs.replace(
        record, status=AgentToolCallStatus.SUCCEEDED, output=write_todos_output(plan), error=None,
        rejection_message=None,
    )
    return WriteTodosOutcome(succeeded, plan)


def rejected_in_planning_turn(record: AgentToolCall) -> AgentToolCall:
    """A call other than write_todos in a planning turn: rejected in RunModel's commit, never run."""
    return msgspec.structs.replace(
        record, status=AgentToolCallStatus.REJECTED, output=None, error=None,
        rejection_message=PLANNING_TURN_REJECTION_MESSAGE,
    )


def count_write_todos_calls(tool_calls: Iterable[object], enabled: bool) -> int:
    """How many calls of one response name write_todos, when it is enabled (else it is an ordinary name)."""
    if not enabled:
        return 0
    return sum(1 for call in tool_calls if getattr(call, "tool_name", None) == WRITE_TODOS)


def plan_mode_problems(plan_mode_enabled: bool, built_in_tools: Iterable[object], runner: object) -> list[str]:
    """Why a Flow cannot enable plan mode with these options and this runner (empty when it can)."""
    if not plan_mode_enabled:
        return []
    problems: list[str] = []
    if BuiltInTool.WRITE_TODOS not in set(built_in_tools):
        problems.append("plan_mode_enabled needs BuiltInTool.WRITE_TODOS in built_in_tools")
    if getattr(runner, "supports_plan_mode", False) is not True:
        problems.append(
            f"plan_mode_enabled needs a runner that supports plan mode (PlanModeRunner, supports_plan_mode = True); "
            f"{type(runner).__name__} does not"
        )
    return problems

