"""AgentSessionOptions: per-Flow-type settings of the session, checked when the Flow is built."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from types import MappingProxyType

from dex_engine import MAX_TIMER_SECONDS, MAX_VALUE_BYTES

from ._builtin_tools import BuiltInTool
from ._compaction import CompactionPolicy
from ._constants import (
    DEFAULT_AGENT_EVENTS_CAPACITY_BYTES,
    DEFAULT_MAX_DURABLE_WAIT,
    DEFAULT_MESSAGE_CHUNK_MAX_BYTES,
    DEFAULT_MESSAGE_CHUNK_SIZE,
    DEFAULT_MESSAGE_WINDOW_SIZE,
    DEFAULT_RETAINED_MESSAGE_LIMIT,
    MAX_AGENT_EVENTS_CAPACITY_BYTES,
    MAX_MESSAGE_CHUNK_MAX_BYTES,
    MAX_RETRY_ATTEMPTS,
    RUN_MODEL_MAX_ATTEMPTS,
    RUN_MODEL_RETRY_BUDGET,
    RUN_MODEL_TIMEOUT,
)
from ._policy import ToolPolicy, count_problem, shown, tool_effect_problem
from ._wire import ToolEffect

# A rollover chunk is one engine value: a cap above MAX_VALUE_BYTES would make a later rollover fail.
MESSAGE_CHUNK_MAX_BYTES_LIMIT = min(MAX_MESSAGE_CHUNK_MAX_BYTES, MAX_VALUE_BYTES)
# An approval deadline or a durable wait becomes one engine Timer, which can be at most this long;
# a model call's or a tool call's timeout an engine method timeout, bounded the same.
LONGEST_TIMER = timedelta(seconds=MAX_TIMER_SECONDS)


def interrupt_deadline_problem(deadline: object) -> str | None:
    """What is wrong with an `interrupt_deadline`, or None. AgentDefinition checks its own with this
    too, so a bad one is refused where it was written, not later as an AgentSessionOptions field."""
    if deadline is not None and (not isinstance(deadline, timedelta) or deadline <= timedelta(0)):
        return f"interrupt_deadline must be a positive timedelta or None, got {shown(deadline, None)}"
    if isinstance(deadline, timedelta) and deadline > LONGEST_TIMER:
        return (f"interrupt_deadline must be at most {LONGEST_TIMER.days} days (the engine's longest "
                f"timer), got {shown(deadline, None)}")
    return None


def max_durable_wait_problem(wait: object) -> str | None:
    """What is wrong with a `max_durable_wait`, or None (AgentDefinition checks its own with this too)."""
    if not isinstance(wait, timedelta) or not timedelta(seconds=1) <= wait <= LONGEST_TIMER:
        return (f"max_durable_wait must be a timedelta from 1 second to {LONGEST_TIMER.days} days "
                f"(the engine's longest timer), got {shown(wait, None)}")
    return None


def tool_policy_entry_problems(policies: Mapping[object, object]) -> list[str]:
    """What is wrong with the entries of a `tool_policies` mapping (AgentDefinition checks its own
    with this too, so a bad one is refused where it was written)."""
    problems: list[str] = []
    for name, policy in policies.items():
        if not isinstance(name, str) or not name:
            problems.append(f"tool_policies key {shown(name, None)} is not a tool name")
        if not isinstance(policy, ToolPolicy):
            problems.append(f"tool_policies[{shown(name, None)}] is {shown(policy, None)}, not a ToolPolicy; "
                            "give a ToolPolicy, such as ToolPolicy(ToolEffect.READ)")
    return problems


def events_capacity_problem(capacity: object, field_name: str = "agent_events_capacity_bytes") -> str | None:
    """What is wrong with an AgentEvents Stream capacity, or None. AgentDefinition checks its
    `event_stream_capacity_bytes` with this too, naming its own field."""
    if isinstance(capacity, bool) or not isinstance(capacity, int) or not (
        1 <= capacity <= MAX_AGENT_EVENTS_CAPACITY_BYTES
    ):
        return (f"{field_name} must be a whole number of bytes from 1 to {MAX_AGENT_EVENTS_CAPACITY_BYTES}, "
                f"got {shown(capacity, None)}")
    return None


@dataclass(frozen=True)
class RunModelLimit:
    """RunModel's method timeout, attempts, and the time budget of its retries."""

    timeout: timedelta = RUN_MODEL_TIMEOUT
    max_attempts: int = RUN_MODEL_MAX_ATTEMPTS
    retry_budget: timedelta = RUN_MODEL_RETRY_BUDGET

    def __post_init__(self) -> None:
        problems = []
        timeout: object = self.timeout
        budget: object = self.retry_budget
        if not isinstance(timeout, timedelta) or not timedelta(0) < timeout <= LONGEST_TIMER:
            problems.append(f"timeout must be a positive timedelta of at most {LONGEST_TIMER.days} days (the "
                            f"engine's longest method timeout), got {shown(self.timeout, None)}")
        attempts: object = self.max_attempts
        # Bounded as the engine's RetryPolicy bounds it, which RunModel's is built into.
        if isinstance(attempts, bool) or not isinstance(attempts, int) or not 1 <= attempts <= MAX_RETRY_ATTEMPTS:
            problems.append(f"max_attempts must be a whole number from 1 to {MAX_RETRY_ATTEMPTS}, "
                            f"got {shown(self.max_attempts, None)}")
        if not isinstance(budget, timedelta) or budget <= timedelta(0):
            problems.append(f"retry_budget must be a positive timedelta, got {shown(self.retry_budget, None)}")
        if problems:
            raise ValueError("invalid RunModelLimit: " + "; ".join(problems))


@dataclass(frozen=True)
class AgentSessionOptions:
    """Options of one agent Flow type.

    `tool_policies` override per tool name; `default_tool_effect` applies to tools with no policy
    and no framework metadata. `interrupt_deadline` bounds how long an approval or a question waits.
    """

    tool_policies: Mapping[str, ToolPolicy] = field(default_factory=dict)
    default_tool_effect: ToolEffect = ToolEffect.UNCLASSIFIED
    agent_events_capacity_bytes: int = DEFAULT_AGENT_EVENTS_CAPACITY_BYTES
    interrupt_deadline: timedelta | None = None
    run_model_limit: RunModelLimit = field(default_factory=RunModelLimit)
    built_in_tools: frozenset[BuiltInTool] = frozenset()
    max_durable_wait: timedelta = DEFAULT_MAX_DURABLE_WAIT
    # Plan mode (seed 003 "Plans and plan mode"): needs BuiltInTool.WRITE_TODOS and a PlanModeRunner,
    # which the Flow constructor checks.
    plan_mode_enabled: bool = False
    # Message storage (seed 002 "Message storage"): the window of AgentMessages instances, and the
    # immutable AgentMessageChunks its oldest messages move into.
    message_window_size: int = DEFAULT_MESSAGE_WINDOW_SIZE
    message_chunk_size: int = DEFAULT_MESSAGE_CHUNK_SIZE
    message_chunk_max_bytes: int = DEFAULT_MESSAGE_CHUNK_MAX_BYTES
    # Compaction and retention (seed 003 "Compaction", "Message storage and retention"): needs a
    # ContextCompactionRunner, which the Flow constructor checks. Retention applies only with
    # compaction; None keeps every message.
    compaction: CompactionPolicy | None = None
    retained_message_limit: int | None = DEFAULT_RETAINED_MESSAGE_LIMIT

    def __post_init__(self) -> None:
        problems = []
        policies: object = self.tool_policies
        limit: object = self.run_model_limit
        if not isinstance(policies, Mapping):
            problems.append(f"tool_policies must map tool names to ToolPolicy, got {type(self.tool_policies).__name__}")
        else:
            problems.extend(tool_policy_entry_problems(policies))
            object.__setattr__(self, "tool_policies", MappingProxyType(dict(policies)))
        problems.extend(problem for problem in (
            tool_effect_problem(self.default_tool_effect, "default_tool_effect"),
            events_capacity_problem(self.agent_events_capacity_bytes),
            interrupt_deadline_problem(self.interrupt_deadline)) if problem is not None)
        tools: object = self.built_in_tools
        if not isinstance(tools, frozenset | set) or not all(isinstance(t, BuiltInTool) for t in tools):
            problems.append(f"built_in_tools must be a frozenset of BuiltInTool, got {shown(tools, None)}")
        else:
            object.__setattr__(self, "built_in_tools", frozenset(tools))
        wait_problem = max_durable_wait_problem(self.max_durable_wait)
        if wait_problem is not None:
            problems.append(wait_problem)
        plan_mode: object = self.plan_mode_enabled
        if not isinstance(plan_mode, bool):
            problems.append(f"plan_mode_enabled must be True or False, got {shown(plan_mode, None)}")
        problems.extend(problem for name in ("message_window_size", "message_chunk_size")
                        if (problem := count_problem(name, getattr(self, name))) is not None)
        chunk_bytes: object = self.message_chunk_max_bytes
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or not (
            1 <= chunk_bytes <= MESSAGE_CHUNK_MAX_BYTES_LIMIT
        ):
            problems.append(
                f"message_chunk_max_bytes must be a whole number from 1 to {MESSAGE_CHUNK_MAX_BYTES_LIMIT} "
                f"(at most 8 MiB, and a chunk must fit the engine's MAX_VALUE_BYTES), got {shown(chunk_bytes, None)}"
            )
        compaction: object = self.compaction
        if compaction is not None and not isinstance(compaction, CompactionPolicy):
            problems.append(f"compaction must be a CompactionPolicy or None, got {shown(compaction, None)}")
        retained: object = self.retained_message_limit
        if retained is not None and (isinstance(retained, bool) or not isinstance(retained, int) or retained < 0):
            problems.append(f"retained_message_limit must be a whole number >= 0 or None, got {shown(retained, None)}")
        if not isinstance(limit, RunModelLimit):
            problems.append(f"run_model_limit must be a RunModelLimit, got {shown(self.run_model_limit, None)}")
        if problems:
            raise ValueError("invalid AgentSessionOptions: " + "; ".join(problems))
