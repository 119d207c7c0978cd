"""The runner contract: what a framework adapter implements and what the session hands it."""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from dex_engine import RetryPolicy

if sys.version_info >= (3, 13):
    from typing import TypeVar
else:  # TypeVar defaults (PEP 696) arrive in 3.13
    from typing_extensions import TypeVar

from ._policy import text_of
from ._wire import (
    AgentMessage,
    AgentToolCall,
    AgentUsage,
    ContextSummary,
    InteractionMode,
    JsonObject,
    MessageRole,
    QuestionAnswer,
    ToolEffect,
)

if TYPE_CHECKING:
    from dex_engine import Context

    from ._events import AgentEventWriter
    from ._policy import ToolPolicy
    from ._wire import AgentPlan


@dataclass(frozen=True)
class FrameworkMessage:
    """A message as a runner produces it: the AgentMessage projection plus the framework's own item.

    `framework_item` is framework-native JSON text, replayed to the framework unchanged.
    """

    role: MessageRole
    framework_item: str
    text: str | None = None
    tool_call_id: str | None = None
    tool_name: str | None = None
    tool_arguments: str | None = None
    tool_output: str | None = None


@dataclass(frozen=True)
class ModelCallMetadata:
    """Names and annotates the model call's span; the session never stores it."""

    request_model: str | None = None
    response_model: str | None = None
    provider_name: str | None = None
    response_id: str | None = None
    finish_reasons: tuple[str, ...] | None = None


@dataclass(frozen=True)
class DeferredToolCall:
    """One tool call a model response asked for; the session runs it in its own Step."""

    tool_call_id: str
    tool_name: str
    arguments: str  # JSON object text
    policy: ToolPolicy
    tool_source_reference: str | None = None


@dataclass(frozen=True)
class TurnCompleted:
    """The final answer: `new_messages` are the turn's items the session has not stored yet.

    With `turn_error`, the turn ends as failed without a retry, after storing `new_messages`.
    """

    new_messages: Sequence[FrameworkMessage]
    usage: AgentUsage = field(default_factory=AgentUsage)
    model_call_metadata: ModelCallMetadata | None = None
    turn_error: str | None = None


@dataclass(frozen=True)
class ToolCallsRequested:
    """The model asked for tools: run each call in its own Step, then resume from the run state."""

    framework_run_state: str
    tool_calls: Sequence[DeferredToolCall]
    usage: AgentUsage = field(default_factory=AgentUsage)
    new_messages: Sequence[FrameworkMessage] = ()
    model_call_metadata: ModelCallMetadata | None = None


@dataclass(frozen=True)
class TurnContinued:
    """Make another model call in the same turn, after storing `new_messages`."""

    framework_run_state: str
    new_messages: Sequence[FrameworkMessage]
    usage: AgentUsage = field(default_factory=AgentUsage)
    model_call_metadata: ModelCallMetadata | None = None


AgentTurnOutcome = TurnCompleted | ToolCallsRequested | TurnContinued


@dataclass(frozen=True)
class ToolExecutionResult:
    """A tool call's output, as the model sees it."""

    output: str


@dataclass(frozen=True)
class ToolInputRequested:
    """The tool needs the user's answer before it takes any effect, so it asks instead of running.

    The session records the question on the call, raises the question interrupt
    `<tool_call_id>-input-<n>` in AwaitQuestionAnswer, and after an answer runs the same tool Step
    type again with DeferredToolExecution.input_answers and tool_call.input_continuation set to
    `continuation`. A decline or a passed deadline rejects the call. Return it only while the call
    has taken no effect: a call that asked is never reported as not run.
    """

    question: str
    choices: Sequence[str] = ()
    allows_free_text: bool = True
    continuation: str | None = None


@dataclass(frozen=True)
class ToolTaskStarted:
    """The tool started remote work that the session polls (PollToolTask) instead of holding a Step.

    The session records the call `waiting_for_task` with `task_id` and polls it with the runner's
    ToolTaskPoller.poll_tool_task after `poll_interval_seconds`, rounded up to whole seconds from 1
    to a day. Save the handle with save_heartbeat_checkpoint before returning it, and return the
    saved one when DeferredToolExecution.heartbeat_checkpoint holds it, so a retried attempt does
    not start the work again.
    """

    task_id: str
    poll_interval_seconds: float


# What execute_deferred_tool_call returns for a runner whose tools ask the user or start tasks.
DeferredToolOutcome = ToolExecutionResult | ToolInputRequested | ToolTaskStarted


class ToolExecutionError(Exception):
    """A tool failure the model should see: recorded `failed` with this message, never retried.
    A message that is not text (the caught exception itself) is kept as its text (text_of)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = text_of(message)


class ToolOutcomeUnknownError(Exception):
    """The tool sent a write and cannot tell whether it took effect: recorded `outcome_unknown`.
    A message that is not text is kept as its text, as ToolExecutionError's."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = text_of(message)


HeartbeatFn = Callable[[], Awaitable[None]]
CheckpointFn = Callable[[str], Awaitable[None]]


@dataclass(frozen=True)
class AgentTurnContext:
    """Committed state a RunModel attempt hands the runner."""

    flow_id: str
    turn_id: str
    attempt: int
    messages: Sequence[AgentMessage]
    framework_run_state: str | None
    tool_calls: Mapping[str, AgentToolCall]
    events: AgentEventWriter
    heartbeat: HeartbeatFn
    tool_policies: Mapping[str, ToolPolicy]
    default_tool_effect: ToolEffect
    enabled_built_in_tools: frozenset[str] = frozenset()
    session_settings: JsonObject = field(default_factory=dict)
    interaction_mode: InteractionMode = InteractionMode.CHAT
    plan: AgentPlan | None = None
    context_summary: ContextSummary | None = None

    @property
    def is_resuming(self) -> bool:
        return self.framework_run_state is not None

    def recorded_tool_call(self, tool_call_id: str) -> AgentToolCall:
        try:
            return self.tool_calls[tool_call_id]
        except KeyError:
            raise KeyError(
                f"turn {self.turn_id!r} has no tool call record {tool_call_id!r}; "
                f"recorded: {sorted(self.tool_calls)}"
            ) from None

    def resolve_tool_policy(self, name: str, framework_effect: ToolEffect | None = None) -> ToolPolicy:
        from ._policy import resolve_tool_policy

        return resolve_tool_policy(name, self.tool_policies, self.default_tool_effect, framework_effect)


@dataclass(frozen=True)
class DeferredToolExecution:
    """One approved tool call, as a tool Step attempt hands it to the runner."""

    flow_id: str
    tool_call: AgentToolCall
    idempotency_key: str  # <flow_id>/<turn_id>/<tool_call_id>, the same on every attempt
    attempt: int
    events: AgentEventWriter
    heartbeat: HeartbeatFn
    save_heartbeat_checkpoint: CheckpointFn
    heartbeat_checkpoint: str | None
    context: Context
    input_answers: Sequence[QuestionAnswer] = ()
    supports_tool_tasks: bool = False


# A bare AgentFrameworkRunner returns ToolExecutionResult; a runner whose tools ask the user or start
# tasks is an AgentFrameworkRunner[DeferredToolOutcome].
ToolOutcomeT_co = TypeVar("ToolOutcomeT_co", covariant=True, default=ToolExecutionResult)


@runtime_checkable
class AgentFrameworkRunner(Protocol[ToolOutcomeT_co]):
    """What a framework adapter implements. Every method may run again after a crash or retry."""

    def build_user_message(self, text: str) -> FrameworkMessage: ...

    async def run_model_step(self, turn: AgentTurnContext) -> AgentTurnOutcome: ...

    async def execute_deferred_tool_call(self, call: DeferredToolExecution) -> ToolOutcomeT_co: ...


@dataclass(frozen=True)
class ToolCallStepOptions:
    """One call's own tool Step options; a field left None keeps the Step's.

    `timeout` bounds each attempt of the call's tool Step (CallTool or CallSingleAttemptTool).
    `retry` replaces CallTool's three attempts; CallSingleAttemptTool always makes one attempt, so
    there it is ignored.
    """

    timeout: timedelta | None = None
    retry: RetryPolicy | None = None


@runtime_checkable
class ToolCallStepOptionsProvider(Protocol):
    """Optional: a call's own tool Step timeout and, for CallTool, retry policy (for example an
    operation's from a connector manifest). Called each time the session moves an approved call
    into its tool Step: in RunModel's commit, after an approval, after a tool's question is
    answered. It runs on the Worker's event loop inside that Step: keep it quick, with no I/O. Return
    the same options for the same call. A call whose options cannot be had (the method raises or
    returns something else) is recorded failed without running."""

    def tool_call_step_options(self, call: DeferredToolCall) -> ToolCallStepOptions | None: ...


@runtime_checkable
class UnfinishedTurnMessageBuilder(Protocol):
    """Optional: the unstored items of a turn that ends without a final answer."""

    def build_unfinished_turn_messages(self, turn: AgentTurnContext) -> Sequence[FrameworkMessage]: ...


@runtime_checkable
class PlanModeRunner(Protocol):
    """A runner that supports plan mode: in a planning turn it offers only write_todos, and it shows
    the model build_plan_note(turn.plan, turn.interaction_mode) before the turn's messages. Only
    such a runner (supports_plan_mode is True) can run a Flow with plan_mode_enabled."""

    supports_plan_mode: bool


@dataclass(frozen=True)
class ToolTaskPending:
    """The task is still running: poll again after `poll_interval_seconds`.

    `continuation` is stored as the call's input_continuation for the next poll to read; None
    clears it (drop an answered question's continuation once the task took the answer).
    """

    poll_interval_seconds: float
    continuation: str | None = None


# What poll_tool_task returns; ToolExecutionError (raised) records `failed`.
ToolTaskPollOutcome = ToolExecutionResult | ToolInputRequested | ToolTaskPending


@dataclass(frozen=True)
class ToolTaskPoll:
    """One poll of a started task, as a PollToolTask attempt hands it to the runner.

    `tool_call` is the `waiting_for_task` record (task_id, input_continuation). `pending_answer` is
    the resolution of the task's last question (the last of `input_answers`) on the first poll
    after it was answered, declined, or its deadline passed, and on that poll's retries; else None.
    """

    flow_id: str
    tool_call: AgentToolCall
    idempotency_key: str
    attempt: int
    input_answers: Sequence[QuestionAnswer]
    events: AgentEventWriter
    heartbeat: HeartbeatFn
    pending_answer: QuestionAnswer | None = None


@runtime_checkable
class ToolTaskPoller(Protocol):
    """Implemented by a runner whose tools return ToolTaskStarted. A poll only reads the task, or
    delivers pending_answer idempotently: a crashed poll runs again."""

    async def poll_tool_task(self, poll: ToolTaskPoll) -> ToolTaskPollOutcome: ...


@dataclass(frozen=True)
class ToolTaskCancellation:
    """A started task that cancel_turn abandoned, as a CancelToolTask attempt hands it to the runner."""

    flow_id: str
    tool_call: AgentToolCall
    idempotency_key: str
    attempt: int
    heartbeat: HeartbeatFn


@runtime_checkable
class ToolTaskCanceller(Protocol):
    """Optional: stop an abandoned task best-effort. Make it idempotent by task_id: a crash or a
    failed attempt calls it again."""

    async def cancel_tool_task(self, cancellation: ToolTaskCancellation) -> None: ...


def polls_tool_tasks(runner: object, record: AgentToolCall | None = None) -> bool:
    """Whether the runner polls tasks (implements ToolTaskPoller.poll_tool_task); given `record`,
    whether it polls that call's task. A runner that polls for some calls only (the built-in loop's,
    for its tool sources that poll) answers per call through `_polls_tool_task_of`."""
    if not callable(getattr(runner, "poll_tool_task", None)):
        return False
    per_call = getattr(runner, "_polls_tool_task_of", None)
    return record is None or not callable(per_call) or bool(per_call(record))
