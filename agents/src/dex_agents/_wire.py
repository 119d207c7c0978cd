"""The session's wire types: every value stored in Attributes, Channels and the AgentEvents Stream.

Field names, order and enum values are contracts shared with other cores (seed 002, "Persistence
schema"): JSON is snake_case, times are RFC 3339 text in UTC. Every Struct encodes every field,
defaults included, so a reader in any core sees the same shape.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

import msgspec


class AgentStatus(StrEnum):
    WAITING_FOR_USER_MESSAGE = "waiting_for_user_message"
    RUNNING_MODEL = "running_model"
    RUNNING_TOOLS = "running_tools"
    COMPACTING_CONTEXT = "compacting_context"
    FAILED = "failed"


class InteractionMode(StrEnum):
    CHAT = "chat"
    PLANNING = "planning"
    EXECUTING = "executing"


class MessageRole(StrEnum):
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"


class ToolEffect(StrEnum):
    """What running a tool call again would do; decides its Step, retries and default approval."""

    READ = "read"
    IDEMPOTENT_WRITE = "idempotent_write"
    NON_IDEMPOTENT_WRITE = "non_idempotent_write"
    UNCLASSIFIED = "unclassified"


class AgentToolCallStatus(StrEnum):
    AWAITING_APPROVAL = "awaiting_approval"
    APPROVED = "approved"
    AWAITING_ANSWER = "awaiting_answer"
    WAITING_FOR_TIMER = "waiting_for_timer"
    WAITING_FOR_TASK = "waiting_for_task"
    REJECTED = "rejected"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    OUTCOME_UNKNOWN = "outcome_unknown"

    @property
    def is_final(self) -> bool:
        return self in _FINAL_STATUSES


_FINAL_STATUSES = frozenset({
    AgentToolCallStatus.REJECTED,
    AgentToolCallStatus.SUCCEEDED,
    AgentToolCallStatus.FAILED,
    AgentToolCallStatus.OUTCOME_UNKNOWN,
})


class InterruptKind(StrEnum):
    TOOL_APPROVAL = "tool_approval"
    QUESTION = "question"


class QuestionResolution(StrEnum):
    ANSWERED = "answered"
    DECLINED = "declined"
    DEADLINE_PASSED = "deadline_passed"


class CancellationReason(StrEnum):
    STEERED = "steered"
    TURN_CANCELLED = "turn_cancelled"


class TurnControlKind(StrEnum):
    STEER = "steer"
    CANCEL_TURN = "cancel_turn"


class PlanStatus(StrEnum):
    DRAFT = "draft"
    ACTIVE = "active"
    COMPLETED = "completed"
    CLEARED = "cleared"


class PlanTaskStatus(StrEnum):
    PENDING = "pending"
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"


JsonObject = dict[str, Any]


class AgentSessionStartInput(msgspec.Struct, frozen=True):
    initial_message: str | None = None
    session_settings: JsonObject | None = None


class UpdateSessionSettingsRequest(msgspec.Struct, frozen=True):
    session_settings: JsonObject | None = None


class TurnSessionSettings(msgspec.Struct, frozen=True):
    turn_id: str
    session_settings: JsonObject


class AgentState(msgspec.Struct, frozen=True):
    status: AgentStatus
    turn_count: int
    active_turn_id: str | None
    next_message_sequence: int
    last_turn_error: str | None
    interaction_mode: InteractionMode = InteractionMode.CHAT
    accepts_turn_control: bool = False


class AgentMessage(msgspec.Struct, frozen=True):
    sequence: int
    turn_id: str
    role: MessageRole
    text: str | None
    tool_call_id: str | None
    tool_name: str | None
    tool_arguments: str | None
    tool_output: str | None
    framework_item: str
    created_at: str


class QuestionAnswer(msgspec.Struct, frozen=True):
    interrupt_id: str
    question: str
    answer: str
    resolution: QuestionResolution = QuestionResolution.ANSWERED


class AgentToolCall(msgspec.Struct, frozen=True):
    tool_call_id: str
    turn_id: str
    tool_name: str
    arguments: str
    effect: ToolEffect
    requires_approval: bool
    status: AgentToolCallStatus
    output: str | None
    error: str | None
    rejection_message: str | None
    deferral_order: int
    tool_source_reference: str | None
    trace_context: str | None
    wait_until: str | None = None
    input_continuation: str | None = None
    input_answers: list[QuestionAnswer] = msgspec.field(default_factory=list)
    input_question: str | None = None
    input_choices: list[str] = msgspec.field(default_factory=list)
    input_allows_free_text: bool = True
    cancellation_reason: CancellationReason | None = None
    task_id: str | None = None
    task_poll_interval_seconds: int | None = None
    task_answer_pending: bool = False


class AgentInterrupt(msgspec.Struct, frozen=True):
    interrupt_id: str
    kind: InterruptKind
    tool_call_id: str
    tool_name: str
    arguments: str
    created_at: str
    deadline: str | None
    question: str | None = None
    choices: list[str] = msgspec.field(default_factory=list)
    allows_free_text: bool = True


class AgentInterruptResolution(msgspec.Struct, frozen=True):
    approved: bool
    rejection_message: str | None
    answer: str | None = None


class AnswerQuestionRequest(msgspec.Struct, frozen=True):
    interrupt_id: str
    answer: str


class ToolCallCompleted(msgspec.Struct, frozen=True):
    tool_call_id: str


class AgentUserMessage(msgspec.Struct, frozen=True):
    text: str
    plan_mode: bool = False


class PendingUserMessage(msgspec.Struct, frozen=True):
    message_id: str
    message: AgentUserMessage


class SteerUserMessageRequest(msgspec.Struct, frozen=True):
    message_id: str | None = None
    text: str | None = None


class DeleteQueuedMessageRequest(msgspec.Struct, frozen=True):
    message_id: str


class CancelTurnRequest(msgspec.Struct, frozen=True):
    turn_id: str | None = None


class TurnControlRequest(msgspec.Struct, frozen=True):
    kind: TurnControlKind


class TurnCancellationRequest(msgspec.Struct, frozen=True):
    turn_id: str
    requested_at: str


class ToolCallCancellation(msgspec.Struct, frozen=True):
    reason: CancellationReason


class AgentUsage(msgspec.Struct, frozen=True):
    model_calls: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cached_input_tokens: int = 0
    reasoning_tokens: int = 0

    def plus(self, other: AgentUsage) -> AgentUsage:
        return AgentUsage(
            model_calls=self.model_calls + other.model_calls,
            input_tokens=self.input_tokens + other.input_tokens,
            output_tokens=self.output_tokens + other.output_tokens,
            cached_input_tokens=self.cached_input_tokens + other.cached_input_tokens,
            reasoning_tokens=self.reasoning_tokens + other.reasoning_tokens,
        )


class AgentPlanTask(msgspec.Struct, frozen=True):
    content: str
    status: PlanTaskStatus


class AgentPlan(msgspec.Struct, frozen=True):
    revision: int
    status: PlanStatus
    tasks: list[AgentPlanTask]
    updated_at: str


class ExecutePlanRequest(msgspec.Struct, frozen=True):
    revision: int


class PlanExecutionRequest(msgspec.Struct, frozen=True):
    revision: int


class AgentEvent(msgspec.Struct, frozen=True):
    type: str
    turn_id: str | None
    attempt: int
    payload: str
    step_execution_id: str = ""


class ResolveInterruptRequest(msgspec.Struct, frozen=True):
    interrupt_id: str
    approved: bool
    rejection_message: str | None = None


class ContextSummary(msgspec.Struct, frozen=True):
    generation: int
    first_sequence: int
    last_sequence: int
    text: str
    created_at: str


class CompactContextInput(msgspec.Struct, frozen=True):
    through_sequence: int


class AgentMessageChunk(msgspec.Struct, frozen=True):
    # A tuple (a JSON array on the wire, as seed 002's list): a chunk never changes once written, and
    # an immutable one is shared by every reader of the same stored chunk rather than copied for each.
    messages: tuple[AgentMessage, ...]


class AgentMessageChunkRange(msgspec.Struct, frozen=True):
    first_sequence: int
    last_sequence: int


class AgentMessageIndex(msgspec.Struct, frozen=True):
    chunks: list[AgentMessageChunkRange]
    first_sequence: int
    window_first_sequence: int


class TurnReplySequence(msgspec.Struct, frozen=True):
    turn_id: str
    sequence: int


class ListAgentMessagesRequest(msgspec.Struct, frozen=True):
    before_sequence: int | None = None
    limit: int = 50


class AgentMessagesPage(msgspec.Struct, frozen=True):
    messages: list[AgentMessage]
    next_before_sequence: int | None
    deleted_before_sequence: int | None


class AgentSnapshot(msgspec.Struct, frozen=True):
    state: AgentState | None
    messages: list[AgentMessage]
    pending_interrupts: list[AgentInterrupt]
    tool_calls: list[AgentToolCall]
    usage: AgentUsage
    queued_message_count: int
    plan: AgentPlan | None = None
    queued_messages: list[PendingUserMessage] = msgspec.field(default_factory=list)
    steered_messages: list[PendingUserMessage] = msgspec.field(default_factory=list)
    context_summary: ContextSummary | None = None
    session_settings: JsonObject | None = None


__all__ = [
    "AgentEvent",
    "AgentInterrupt",
    "AgentInterruptResolution",
    "AgentMessage",
    "AgentMessageChunk",
    "AgentMessageChunkRange",
    "AgentMessageIndex",
    "AgentMessagesPage",
    "AgentPlan",
    "AgentPlanTask",
    "AgentSessionStartInput",
    "AgentSnapshot",
    "AgentState",
    "AgentStatus",
    "AgentToolCall",
    "AgentToolCallStatus",
    "AgentUsage",
    "AgentUserMessage",
    "AnswerQuestionRequest",
    "CancelTurnRequest",
    "CancellationReason",
    "CompactContextInput",
    "ContextSummary",
    "DeleteQueuedMessageRequest",
    "ExecutePlanRequest",
    "InteractionMode",
    "InterruptKind",
    "JsonObject",
    "ListAgentMessagesRequest",
    "MessageRole",
    "PendingUserMessage",
    "PlanExecutionRequest",
    "PlanStatus",
    "PlanTaskStatus",
    "QuestionAnswer",
    "QuestionResolution",
    "ResolveInterruptRequest",
    "SteerUserMessageRequest",
    "ToolCallCancellation",
    "ToolCallCompleted",
    "ToolEffect",
    "TurnCancellationRequest",
    "TurnControlKind",
    "TurnControlRequest",
    "TurnReplySequence",
    "TurnSessionSettings",
    "UpdateSessionSettingsRequest",
]
