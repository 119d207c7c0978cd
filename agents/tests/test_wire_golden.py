"""Golden tests of the wire JSON: every value type of seed 002 "Persistence schema", event payloads, times, keys.

The expected JSON strings are written by hand from the seed text, not produced by the code under test:
field names, field order, defaults and enum values (plain strings) are contracts every core shares.
"""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, timezone
from enum import IntEnum, StrEnum
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dex_agents import _events, _wire
from dex_agents._events import AgentEventType, AgentEventWriter, make_event, payload_text
from dex_agents._persistence import message_sequence_key, plan_execution_key
from dex_agents._timefmt import format_time, parse_time, posix_ns_text, utc_now_text
from dex_agents._wire import (
    AgentEvent,
    AgentInterrupt,
    AgentInterruptResolution,
    AgentMessage,
    AgentMessageChunk,
    AgentMessageChunkRange,
    AgentMessageIndex,
    AgentMessagesPage,
    AgentPlan,
    AgentPlanTask,
    AgentSessionStartInput,
    AgentSnapshot,
    AgentState,
    AgentStatus,
    AgentToolCall,
    AgentToolCallStatus,
    AgentUsage,
    AgentUserMessage,
    AnswerQuestionRequest,
    CancellationReason,
    CancelTurnRequest,
    CompactContextInput,
    ContextSummary,
    DeleteQueuedMessageRequest,
    ExecutePlanRequest,
    InteractionMode,
    InterruptKind,
    ListAgentMessagesRequest,
    MessageRole,
    PendingUserMessage,
    PlanExecutionRequest,
    PlanStatus,
    PlanTaskStatus,
    QuestionAnswer,
    QuestionResolution,
    ResolveInterruptRequest,
    SteerUserMessageRequest,
    ToolCallCancellation,
    ToolCallCompleted,
    ToolEffect,
    TurnCancellationRequest,
    TurnControlKind,
    TurnControlRequest,
    TurnReplySequence,
    TurnSessionSettings,
    UpdateSessionSettingsRequest,
)

T0 = "2026-11-01T12:00:00.123Z"
T1 = "2026-11-01T12:05:00.123Z"
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
SETTINGS = {"model": "m1", "temperature": 0.5, "tags": ["a", "b"], "nested": {"k": None, "on": True}}
SETTINGS_JSON = r'{"model":"m1","temperature":0.5,"tags":["a","b"],"nested":{"k":null,"on":true}}'

# Building blocks reused inside larger values; each is itself a literal from the seed's field list.
MESSAGE = AgentMessage(
    sequence=5, turn_id="turn-3", role=MessageRole.TOOL, text="shown", tool_call_id="c1", tool_name="read_orders",
    tool_arguments='{"id":1}', tool_output="3 orders", framework_item='{"kind":"tool"}', created_at=T0,
)
MESSAGE_JSON = (
    r'{"sequence":5,"turn_id":"turn-3","role":"tool","text":"shown","tool_call_id":"c1","tool_name":"read_orders",'
    r'"tool_arguments":"{\"id\":1}","tool_output":"3 orders","framework_item":"{\"kind\":\"tool\"}",'
    r'"created_at":"2026-11-01T12:00:00.123Z"}'
)
STATE = AgentState(
    status=AgentStatus.RUNNING_TOOLS, turn_count=2, active_turn_id="turn-3", next_message_sequence=7,
    last_turn_error="boom", interaction_mode=InteractionMode.PLANNING, accepts_turn_control=True,
)
STATE_JSON = (
    r'{"status":"running_tools","turn_count":2,"active_turn_id":"turn-3","next_message_sequence":7,'
    r'"last_turn_error":"boom","interaction_mode":"planning","accepts_turn_control":true}'
)
ANSWER = QuestionAnswer(
    interrupt_id="c1-input-1", question="Which?", answer="a", resolution=QuestionResolution.DEADLINE_PASSED
)
ANSWER_JSON = r'{"interrupt_id":"c1-input-1","question":"Which?","answer":"a","resolution":"deadline_passed"}'
TOOL_CALL = AgentToolCall(
    tool_call_id="c1", turn_id="turn-3", tool_name="refund", arguments='{"order":7}',
    effect=ToolEffect.NON_IDEMPOTENT_WRITE, requires_approval=True, status=AgentToolCallStatus.WAITING_FOR_TASK,
    output="out", error="err", rejection_message="no", deferral_order=2, tool_source_reference="billing/refund",
    trace_context=TRACEPARENT, wait_until=T1, input_continuation="cont-1", input_answers=[ANSWER],
    input_question="Sure?", input_choices=["yes", "no"], input_allows_free_text=False,
    cancellation_reason=CancellationReason.TURN_CANCELLED, task_id="task-9", task_poll_interval_seconds=30,
    task_answer_pending=True,
)
TOOL_CALL_JSON = (
    r'{"tool_call_id":"c1","turn_id":"turn-3","tool_name":"refund","arguments":"{\"order\":7}",'
    r'"effect":"non_idempotent_write","requires_approval":true,"status":"waiting_for_task","output":"out",'
    r'"error":"err","rejection_message":"no","deferral_order":2,"tool_source_reference":"billing/refund",'
    r'"trace_context":"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",'
    r'"wait_until":"2026-11-01T12:05:00.123Z","input_continuation":"cont-1","input_answers":[' + ANSWER_JSON + r'],'
    r'"input_question":"Sure?","input_choices":["yes","no"],"input_allows_free_text":false,'
    r'"cancellation_reason":"turn_cancelled","task_id":"task-9","task_poll_interval_seconds":30,'
    r'"task_answer_pending":true}'
)
INTERRUPT = AgentInterrupt(
    interrupt_id="c1-input-1", kind=InterruptKind.QUESTION, tool_call_id="c1", tool_name="refund",
    arguments='{"order":7}', created_at=T0, deadline=T1, question="Sure?", choices=["yes", "no"],
    allows_free_text=False,
)
INTERRUPT_JSON = (
    r'{"interrupt_id":"c1-input-1","kind":"question","tool_call_id":"c1","tool_name":"refund",'
    r'"arguments":"{\"order\":7}","created_at":"2026-11-01T12:00:00.123Z","deadline":"2026-11-01T12:05:00.123Z",'
    r'"question":"Sure?","choices":["yes","no"],"allows_free_text":false}'
)
USAGE = AgentUsage(model_calls=1, input_tokens=2, output_tokens=3, cached_input_tokens=4, reasoning_tokens=5)
USAGE_JSON = r'{"model_calls":1,"input_tokens":2,"output_tokens":3,"cached_input_tokens":4,"reasoning_tokens":5}'
USER_MESSAGE = AgentUserMessage(text="hello", plan_mode=True)
USER_MESSAGE_JSON = r'{"text":"hello","plan_mode":true}'
PENDING = PendingUserMessage(message_id="42", message=USER_MESSAGE)
PENDING_JSON = r'{"message_id":"42","message":' + USER_MESSAGE_JSON + "}"
PLAN = AgentPlan(
    revision=2, status=PlanStatus.ACTIVE,
    tasks=[AgentPlanTask("write tests", PlanTaskStatus.IN_PROGRESS), AgentPlanTask("ship", PlanTaskStatus.PENDING)],
    updated_at=T0,
)
PLAN_JSON = (
    r'{"revision":2,"status":"active","tasks":[{"content":"write tests","status":"in_progress"},'
    r'{"content":"ship","status":"pending"}],"updated_at":"2026-11-01T12:00:00.123Z"}'
)
SUMMARY = ContextSummary(generation=1, first_sequence=1, last_sequence=40, text="summary", created_at=T0)
SUMMARY_JSON = (
    r'{"generation":1,"first_sequence":1,"last_sequence":40,"text":"summary",'
    r'"created_at":"2026-11-01T12:00:00.123Z"}'
)
CHUNK_RANGE = AgentMessageChunkRange(first_sequence=1, last_sequence=32)
CHUNK_RANGE_JSON = r'{"first_sequence":1,"last_sequence":32}'


@dataclass(frozen=True)
class Golden:
    """One value and the exact JSON the seed gives for it."""

    name: str
    value: msgspec.Struct
    json_text: str


GOLDEN = [
    Golden("AgentSessionStartInput", AgentSessionStartInput(initial_message="hi", session_settings=SETTINGS),
           r'{"initial_message":"hi","session_settings":' + SETTINGS_JSON + "}"),
    Golden("AgentSessionStartInput/none", AgentSessionStartInput(initial_message=None),
           r'{"initial_message":null,"session_settings":null}'),
    Golden("UpdateSessionSettingsRequest", UpdateSessionSettingsRequest(session_settings={"model": "m2"}),
           r'{"session_settings":{"model":"m2"}}'),
    Golden("UpdateSessionSettingsRequest/clear", UpdateSessionSettingsRequest(session_settings={}),
           r'{"session_settings":{}}'),
    Golden("TurnSessionSettings", TurnSessionSettings(turn_id="turn-3", session_settings={"model": "m2"}),
           r'{"turn_id":"turn-3","session_settings":{"model":"m2"}}'),
    Golden("AgentState", STATE, STATE_JSON),
    Golden("AgentState/defaults",
           AgentState(status=AgentStatus.WAITING_FOR_USER_MESSAGE, turn_count=0, active_turn_id=None,
                      next_message_sequence=1, last_turn_error=None),
           r'{"status":"waiting_for_user_message","turn_count":0,"active_turn_id":null,"next_message_sequence":1,'
           r'"last_turn_error":null,"interaction_mode":"chat","accepts_turn_control":false}'),
    Golden("AgentMessage", MESSAGE, MESSAGE_JSON),
    Golden("AgentMessage/user",
           AgentMessage(sequence=1, turn_id="turn-1", role=MessageRole.USER, text="hi", tool_call_id=None,
                        tool_name=None, tool_arguments=None, tool_output=None, framework_item="{}", created_at=T0),
           r'{"sequence":1,"turn_id":"turn-1","role":"user","text":"hi","tool_call_id":null,"tool_name":null,'
           r'"tool_arguments":null,"tool_output":null,"framework_item":"{}","created_at":"2026-11-01T12:00:00.123Z"}'),
    Golden("QuestionAnswer", ANSWER, ANSWER_JSON),
    Golden("QuestionAnswer/defaults", QuestionAnswer(interrupt_id="q", question="Q?", answer="A"),
           r'{"interrupt_id":"q","question":"Q?","answer":"A","resolution":"answered"}'),
    Golden("AgentToolCall", TOOL_CALL, TOOL_CALL_JSON),
    Golden("AgentToolCall/defaults",
           AgentToolCall(tool_call_id="c2", turn_id="turn-3", tool_name="read_orders", arguments="{}",
                         effect=ToolEffect.READ, requires_approval=False, status=AgentToolCallStatus.APPROVED,
                         output=None, error=None, rejection_message=None, deferral_order=0,
                         tool_source_reference=None, trace_context=None),
           r'{"tool_call_id":"c2","turn_id":"turn-3","tool_name":"read_orders","arguments":"{}","effect":"read",'
           r'"requires_approval":false,"status":"approved","output":null,"error":null,"rejection_message":null,'
           r'"deferral_order":0,"tool_source_reference":null,"trace_context":null,"wait_until":null,'
           r'"input_continuation":null,"input_answers":[],"input_question":null,"input_choices":[],'
           r'"input_allows_free_text":true,"cancellation_reason":null,"task_id":null,'
           r'"task_poll_interval_seconds":null,"task_answer_pending":false}'),
    Golden("AgentInterrupt", INTERRUPT, INTERRUPT_JSON),
    Golden("AgentInterrupt/defaults",
           AgentInterrupt(interrupt_id="c1", kind=InterruptKind.TOOL_APPROVAL, tool_call_id="c1", tool_name="refund",
                          arguments="{}", created_at=T0, deadline=None),
           r'{"interrupt_id":"c1","kind":"tool_approval","tool_call_id":"c1","tool_name":"refund","arguments":"{}",'
           r'"created_at":"2026-11-01T12:00:00.123Z","deadline":null,"question":null,"choices":[],'
           r'"allows_free_text":true}'),
    Golden("AgentInterruptResolution",
           AgentInterruptResolution(approved=False, rejection_message="not now", answer="b"),
           r'{"approved":false,"rejection_message":"not now","answer":"b"}'),
    Golden("AgentInterruptResolution/defaults", AgentInterruptResolution(approved=True, rejection_message=None),
           r'{"approved":true,"rejection_message":null,"answer":null}'),
    Golden("AnswerQuestionRequest", AnswerQuestionRequest(interrupt_id="c1-input-1", answer="yes"),
           r'{"interrupt_id":"c1-input-1","answer":"yes"}'),
    Golden("ToolCallCompleted", ToolCallCompleted(tool_call_id="c1"), r'{"tool_call_id":"c1"}'),
    Golden("AgentUserMessage", USER_MESSAGE, USER_MESSAGE_JSON),
    Golden("AgentUserMessage/defaults", AgentUserMessage(text="hi"), r'{"text":"hi","plan_mode":false}'),
    Golden("PendingUserMessage", PENDING, PENDING_JSON),
    Golden("SteerUserMessageRequest", SteerUserMessageRequest(message_id="42", text="go"),
           r'{"message_id":"42","text":"go"}'),
    Golden("DeleteQueuedMessageRequest", DeleteQueuedMessageRequest(message_id="42"), r'{"message_id":"42"}'),
    Golden("CancelTurnRequest", CancelTurnRequest(turn_id="turn-3"), r'{"turn_id":"turn-3"}'),
    Golden("CancelTurnRequest/active", CancelTurnRequest(turn_id=None), r'{"turn_id":null}'),
    Golden("TurnControlRequest", TurnControlRequest(kind=TurnControlKind.CANCEL_TURN), r'{"kind":"cancel_turn"}'),
    Golden("TurnCancellationRequest", TurnCancellationRequest(turn_id="turn-3", requested_at=T0),
           r'{"turn_id":"turn-3","requested_at":"2026-11-01T12:00:00.123Z"}'),
    Golden("ToolCallCancellation", ToolCallCancellation(reason=CancellationReason.STEERED), r'{"reason":"steered"}'),
    Golden("AgentUsage", USAGE, USAGE_JSON),
    Golden("AgentPlanTask", AgentPlanTask(content="ship", status=PlanTaskStatus.COMPLETED),
           r'{"content":"ship","status":"completed"}'),
    Golden("AgentPlan", PLAN, PLAN_JSON),
    Golden("ExecutePlanRequest", ExecutePlanRequest(revision=2), r'{"revision":2}'),
    Golden("PlanExecutionRequest", PlanExecutionRequest(revision=3), r'{"revision":3}'),
    Golden("AgentEvent",
           AgentEvent(type="tool_call_finished", turn_id="turn-3", attempt=2, payload='{"tool_call_id":"c1"}',
                      step_execution_id="CallTool-4"),
           r'{"type":"tool_call_finished","turn_id":"turn-3","attempt":2,"payload":"{\"tool_call_id\":\"c1\"}",'
           r'"step_execution_id":"CallTool-4"}'),
    Golden("AgentEvent/defaults", AgentEvent(type="turn_failed", turn_id=None, attempt=1, payload="{}"),
           r'{"type":"turn_failed","turn_id":null,"attempt":1,"payload":"{}","step_execution_id":""}'),
    Golden("ResolveInterruptRequest",
           ResolveInterruptRequest(interrupt_id="c1", approved=False, rejection_message="no"),
           r'{"interrupt_id":"c1","approved":false,"rejection_message":"no"}'),
    Golden("ContextSummary", SUMMARY, SUMMARY_JSON),
    Golden("CompactContextInput", CompactContextInput(through_sequence=40), r'{"through_sequence":40}'),
    Golden("AgentMessageChunk", AgentMessageChunk(messages=(MESSAGE,)), r'{"messages":[' + MESSAGE_JSON + "]}"),
    Golden("AgentMessageChunkRange", CHUNK_RANGE, CHUNK_RANGE_JSON),
    Golden("AgentMessageIndex",
           AgentMessageIndex(chunks=[CHUNK_RANGE], first_sequence=1, window_first_sequence=33),
           r'{"chunks":[' + CHUNK_RANGE_JSON + r'],"first_sequence":1,"window_first_sequence":33}'),
    Golden("TurnReplySequence", TurnReplySequence(turn_id="turn-3", sequence=6), r'{"turn_id":"turn-3","sequence":6}'),
    Golden("ListAgentMessagesRequest", ListAgentMessagesRequest(before_sequence=40, limit=10),
           r'{"before_sequence":40,"limit":10}'),
    Golden("ListAgentMessagesRequest/defaults", ListAgentMessagesRequest(before_sequence=None),
           r'{"before_sequence":null,"limit":50}'),
    Golden("AgentMessagesPage",
           AgentMessagesPage(messages=[MESSAGE], next_before_sequence=5, deleted_before_sequence=3),
           r'{"messages":[' + MESSAGE_JSON + r'],"next_before_sequence":5,"deleted_before_sequence":3}'),
    Golden("AgentSnapshot",
           AgentSnapshot(
               state=STATE, messages=[MESSAGE], pending_interrupts=[INTERRUPT], tool_calls=[TOOL_CALL], usage=USAGE,
               queued_message_count=1, plan=PLAN, queued_messages=[PENDING],
               steered_messages=[PendingUserMessage("43", AgentUserMessage("steer"))], context_summary=SUMMARY,
               session_settings=SETTINGS,
           ),
           r'{"state":' + STATE_JSON + r',"messages":[' + MESSAGE_JSON + r'],"pending_interrupts":[' + INTERRUPT_JSON
           + r'],"tool_calls":[' + TOOL_CALL_JSON + r'],"usage":' + USAGE_JSON + r',"queued_message_count":1,'
           r'"plan":' + PLAN_JSON + r',"queued_messages":[' + PENDING_JSON + r'],'
           r'"steered_messages":[{"message_id":"43","message":{"text":"steer","plan_mode":false}}],'
           r'"context_summary":' + SUMMARY_JSON + r',"session_settings":' + SETTINGS_JSON + "}"),
    Golden("AgentSnapshot/defaults",
           AgentSnapshot(state=None, messages=[], pending_interrupts=[], tool_calls=[], usage=AgentUsage(),
                         queued_message_count=0),
           r'{"state":null,"messages":[],"pending_interrupts":[],"tool_calls":[],"usage":{"model_calls":0,'
           r'"input_tokens":0,"output_tokens":0,"cached_input_tokens":0,"reasoning_tokens":0},'
           r'"queued_message_count":0,"plan":null,"queued_messages":[],"steered_messages":[],"context_summary":null,'
           r'"session_settings":null}'),
]


@pytest.mark.parametrize("case", GOLDEN, ids=[g.name for g in GOLDEN])
def test_encodes_to_the_seed_json(case: Golden) -> None:
    """Encoding writes exactly the seed's fields, in the seed's order, defaults included, enums as strings."""
    assert msgspec.json.encode(case.value).decode() == case.json_text


@pytest.mark.parametrize("case", GOLDEN, ids=[g.name for g in GOLDEN])
def test_decodes_the_seed_json(case: Golden) -> None:
    """The literal decodes back to an equal value, so the round trip loses nothing."""
    assert msgspec.json.decode(case.json_text, type=type(case.value)) == case.value


@pytest.mark.parametrize("case", GOLDEN, ids=[g.name for g in GOLDEN])
def test_wire_values_are_immutable(case: Golden) -> None:
    """A wire value cannot be changed in place: a stored chunk is shared by every reader of it rather
    than copied for each, so a change by one reader would show in every other's."""
    field = msgspec.structs.fields(case.value)[0].name
    with pytest.raises(AttributeError):
        setattr(case.value, field, getattr(case.value, field))


def test_every_wire_struct_has_a_golden_case() -> None:
    """A wire type added to _wire.py without a golden case fails here, and __all__ exports every one."""
    structs = {
        name for name, obj in vars(_wire).items()
        if isinstance(obj, type) and issubclass(obj, msgspec.Struct) and obj.__module__ == _wire.__name__
    }
    assert structs == {g.name.split("/")[0] for g in GOLDEN}
    assert structs <= set(_wire.__all__)
    assert len(structs) == 35  # the seed's value types


def test_decoded_enums_are_the_str_enums() -> None:
    """Decoding gives the StrEnum members (not bare strings), and they compare equal to the wire strings."""
    state = msgspec.json.decode(STATE_JSON, type=AgentState)
    assert state.status is AgentStatus.RUNNING_TOOLS and state.status == "running_tools"
    assert state.interaction_mode is InteractionMode.PLANNING
    record = msgspec.json.decode(TOOL_CALL_JSON, type=AgentToolCall)
    assert record.effect is ToolEffect.NON_IDEMPOTENT_WRITE
    assert record.status is AgentToolCallStatus.WAITING_FOR_TASK
    assert record.cancellation_reason is CancellationReason.TURN_CANCELLED
    assert record.input_answers[0].resolution is QuestionResolution.DEADLINE_PASSED


# Each StrEnum's values, in the seed's order.
SEED_ENUMS: list[tuple[type[StrEnum], list[str]]] = [
    (AgentStatus, ["waiting_for_user_message", "running_model", "running_tools", "compacting_context", "failed"]),
    (InteractionMode, ["chat", "planning", "executing"]),
    (MessageRole, ["user", "assistant", "tool"]),
    (ToolEffect, ["read", "idempotent_write", "non_idempotent_write", "unclassified"]),
    (AgentToolCallStatus, ["awaiting_approval", "approved", "awaiting_answer", "waiting_for_timer", "waiting_for_task",
                           "rejected", "succeeded", "failed", "outcome_unknown"]),
    (InterruptKind, ["tool_approval", "question"]),
    (QuestionResolution, ["answered", "declined", "deadline_passed"]),
    (CancellationReason, ["steered", "turn_cancelled"]),
    (TurnControlKind, ["steer", "cancel_turn"]),
    (PlanStatus, ["draft", "active", "completed", "cleared"]),
    (PlanTaskStatus, ["pending", "in_progress", "completed"]),
]


@pytest.mark.parametrize(("enum", "values"), SEED_ENUMS, ids=[e.__name__ for e, _ in SEED_ENUMS])
def test_enum_values_match_the_seed(enum: type[StrEnum], values: list[str]) -> None:
    """Every enum has exactly the seed's values, and encodes each as the plain string."""
    assert [member.value for member in enum] == values
    for member in enum:
        assert msgspec.json.encode(member) == json.dumps(member.value).encode()


def test_final_statuses_are_the_seed_final_statuses() -> None:
    """rejected, succeeded, failed and outcome_unknown are final; the five waiting statuses are not."""
    final = {s.value for s in AgentToolCallStatus if s.is_final}
    assert final == {"rejected", "succeeded", "failed", "outcome_unknown"}


def test_usage_plus_adds_each_field_to_the_same_field() -> None:
    """AgentUsage.plus, which makes usage_recorded's session total, sums field by field: every field, cached
    input and reasoning tokens included, is its own sum."""
    other = AgentUsage(model_calls=10, input_tokens=20, output_tokens=30, cached_input_tokens=40, reasoning_tokens=50)
    assert USAGE.plus(other) == AgentUsage(
        model_calls=11, input_tokens=22, output_tokens=33, cached_input_tokens=44, reasoning_tokens=55
    )


def test_decoding_refuses_unknown_enum_values() -> None:
    """A status outside the seed's set is a validation error, not a silently accepted string."""
    bad = STATE_JSON.replace('"running_tools"', '"sleeping"')
    with pytest.raises(msgspec.ValidationError, match="status"):
        msgspec.json.decode(bad, type=AgentState)


# Wire forms older writers (0.1.0) and other cores send: fields the seed gives a default may be absent.
SEED_WIRE_FORMS: list[tuple[str, type[msgspec.Struct], str, msgspec.Struct]] = [
    ("AgentState/0.1.0", AgentState,
     r'{"status":"running_model","turn_count":1,"active_turn_id":"turn-2","next_message_sequence":3,'
     r'"last_turn_error":null}',
     AgentState(status=AgentStatus.RUNNING_MODEL, turn_count=1, active_turn_id="turn-2", next_message_sequence=3,
                last_turn_error=None, interaction_mode=InteractionMode.CHAT, accepts_turn_control=False)),
    ("AgentSessionStartInput/0.1.0", AgentSessionStartInput, r'{"initial_message":"hi"}',
     AgentSessionStartInput(initial_message="hi", session_settings=None)),
    ("AgentSessionStartInput/null", AgentSessionStartInput, r'{"initial_message":null}',
     AgentSessionStartInput(initial_message=None, session_settings=None)),
    ("UpdateSessionSettingsRequest/absent", UpdateSessionSettingsRequest, "{}",
     UpdateSessionSettingsRequest(session_settings=None)),
    ("AgentToolCall/0.1.0", AgentToolCall,
     r'{"tool_call_id":"c1","turn_id":"turn-1","tool_name":"refund","arguments":"{}","effect":"unclassified",'
     r'"requires_approval":true,"status":"succeeded","output":"ok","error":null,"rejection_message":null,'
     r'"deferral_order":0,"tool_source_reference":null,"trace_context":null}',
     AgentToolCall(tool_call_id="c1", turn_id="turn-1", tool_name="refund", arguments="{}",
                   effect=ToolEffect.UNCLASSIFIED, requires_approval=True, status=AgentToolCallStatus.SUCCEEDED,
                   output="ok", error=None, rejection_message=None, deferral_order=0, tool_source_reference=None,
                   trace_context=None, wait_until=None, input_continuation=None, input_answers=[],
                   input_question=None, input_choices=[], input_allows_free_text=True, cancellation_reason=None,
                   task_id=None, task_poll_interval_seconds=None, task_answer_pending=False)),
    ("QuestionAnswer/no-resolution", QuestionAnswer, r'{"interrupt_id":"q","question":"Q?","answer":"A"}',
     QuestionAnswer(interrupt_id="q", question="Q?", answer="A", resolution=QuestionResolution.ANSWERED)),
    ("AgentInterrupt/0.1.0", AgentInterrupt,
     r'{"interrupt_id":"c1","kind":"tool_approval","tool_call_id":"c1","tool_name":"refund","arguments":"{}",'
     r'"created_at":"2026-11-01T12:00:00.123+00:00","deadline":null}',
     AgentInterrupt(interrupt_id="c1", kind=InterruptKind.TOOL_APPROVAL, tool_call_id="c1", tool_name="refund",
                    arguments="{}", created_at="2026-11-01T12:00:00.123+00:00", deadline=None, question=None,
                    choices=[], allows_free_text=True)),
    ("AgentInterruptResolution/0.1.0", AgentInterruptResolution, r'{"approved":true,"rejection_message":null}',
     AgentInterruptResolution(approved=True, rejection_message=None, answer=None)),
    ("AgentUserMessage/0.1.0", AgentUserMessage, r'{"text":"hi"}', AgentUserMessage(text="hi", plan_mode=False)),
    ("AgentEvent/no-step-execution", AgentEvent, r'{"type":"text_delta","turn_id":"turn-1","attempt":1,"payload":"{}"}',
     AgentEvent(type="text_delta", turn_id="turn-1", attempt=1, payload="{}", step_execution_id="")),
    ("ListAgentMessagesRequest/no-limit", ListAgentMessagesRequest, r'{"before_sequence":null}',
     ListAgentMessagesRequest(before_sequence=None, limit=50)),
    ("AgentSnapshot/0.1.0", AgentSnapshot,
     r'{"state":null,"messages":[],"pending_interrupts":[],"tool_calls":[],"usage":' + USAGE_JSON
     + r',"queued_message_count":2}',
     AgentSnapshot(state=None, messages=[], pending_interrupts=[], tool_calls=[], usage=USAGE,
                   queued_message_count=2, plan=None, queued_messages=[], steered_messages=[],
                   context_summary=None, session_settings=None)),
]


@pytest.mark.parametrize(("name", "cls", "text", "expected"), SEED_WIRE_FORMS, ids=[f[0] for f in SEED_WIRE_FORMS])
def test_decodes_wire_forms_without_defaulted_fields(
    name: str, cls: type[msgspec.Struct], text: str, expected: msgspec.Struct
) -> None:
    """A value written without the fields the seed defaults decodes with the seed's defaults."""
    assert msgspec.json.decode(text, type=cls) == expected


# Per type, the fields the seed lists with no default (every other field has the seed's default).
SEED_REQUIRED: dict[type[msgspec.Struct], set[str]] = {
    AgentSessionStartInput: {"initial_message"},
    UpdateSessionSettingsRequest: set(),
    TurnSessionSettings: {"turn_id", "session_settings"},
    AgentState: {"status", "turn_count", "active_turn_id", "next_message_sequence", "last_turn_error"},
    AgentMessage: {"sequence", "turn_id", "role", "text", "tool_call_id", "tool_name", "tool_arguments",
                   "tool_output", "framework_item", "created_at"},
    AgentToolCall: {"tool_call_id", "turn_id", "tool_name", "arguments", "effect", "requires_approval", "status",
                    "output", "error", "rejection_message", "deferral_order", "tool_source_reference",
                    "trace_context"},
    QuestionAnswer: {"interrupt_id", "question", "answer"},
    AgentInterrupt: {"interrupt_id", "kind", "tool_call_id", "tool_name", "arguments", "created_at", "deadline"},
    AgentInterruptResolution: {"approved", "rejection_message"},
    AnswerQuestionRequest: {"interrupt_id", "answer"},
    ToolCallCompleted: {"tool_call_id"},
    PendingUserMessage: {"message_id", "message"},
    SteerUserMessageRequest: {"message_id", "text"},
    DeleteQueuedMessageRequest: {"message_id"},
    CancelTurnRequest: {"turn_id"},
    TurnControlRequest: {"kind"},
    TurnCancellationRequest: {"turn_id", "requested_at"},
    ToolCallCancellation: {"reason"},
    AgentUsage: {"model_calls", "input_tokens", "output_tokens", "cached_input_tokens", "reasoning_tokens"},
    AgentUserMessage: {"text"},
    AgentPlan: {"revision", "status", "tasks", "updated_at"},
    AgentPlanTask: {"content", "status"},
    ExecutePlanRequest: {"revision"},
    PlanExecutionRequest: {"revision"},
    AgentEvent: {"type", "turn_id", "attempt", "payload"},  # step_execution_id: "" when absent
    ResolveInterruptRequest: {"interrupt_id", "approved", "rejection_message"},
    AgentSnapshot: {"state", "messages", "pending_interrupts", "tool_calls", "usage", "queued_message_count"},
    ContextSummary: {"generation", "first_sequence", "last_sequence", "text", "created_at"},
    CompactContextInput: {"through_sequence"},
    AgentMessageChunk: {"messages"},
    AgentMessageChunkRange: {"first_sequence", "last_sequence"},
    AgentMessageIndex: {"chunks", "first_sequence", "window_first_sequence"},
    TurnReplySequence: {"turn_id", "sequence"},
    ListAgentMessagesRequest: {"before_sequence"},  # limit defaults to 50
    AgentMessagesPage: {"messages", "next_before_sequence", "deleted_before_sequence"},
}

# Seed fields without a default that the Python types still default, as Python constructor conveniences
# (AgentUsage() is the zero usage, the RPC requests' optional fields are None). The encoded JSON is unchanged
# (every field is always written); only decoding accepts these fields absent.
DECODE_LENIENT: dict[type[msgspec.Struct], set[str]] = {
    AgentSessionStartInput: {"initial_message"},
    SteerUserMessageRequest: {"message_id", "text"},
    CancelTurnRequest: {"turn_id"},
    AgentUsage: {"model_calls", "input_tokens", "output_tokens", "cached_input_tokens", "reasoning_tokens"},
    ResolveInterruptRequest: {"rejection_message"},
    ListAgentMessagesRequest: {"before_sequence"},
}


def test_required_fields_follow_the_seed() -> None:
    """No type requires a field the seed defaults (old wire forms must decode), and leniency is only where listed."""
    assert set(SEED_REQUIRED) == {type(g.value) for g in GOLDEN}
    for cls, seed_required in SEED_REQUIRED.items():
        required = {f.name for f in msgspec.structs.fields(cls) if f.required}
        assert required <= seed_required, cls.__name__
        assert seed_required - required == DECODE_LENIENT.get(cls, set()), cls.__name__


def test_missing_required_field_is_refused() -> None:
    """A value missing a field the seed requires fails to decode with an error naming the field."""
    with pytest.raises(msgspec.ValidationError, match="next_message_sequence"):
        msgspec.json.decode(r'{"status":"failed","turn_count":0,"active_turn_id":null,"last_turn_error":null}',
                            type=AgentState)
    with pytest.raises(msgspec.ValidationError, match="deferral_order"):
        msgspec.json.decode(TOOL_CALL_JSON.replace('"deferral_order":2,', ""), type=AgentToolCall)


@pytest.mark.parametrize(("cls", "json_text", "where"), [
    (AgentState, STATE_JSON.replace('"turn_count":2', '"turn_count":null'), "$.turn_count"),
    (AgentToolCall, TOOL_CALL_JSON.replace('"task_poll_interval_seconds":30', '"task_poll_interval_seconds":1.5'),
     "$.task_poll_interval_seconds"),
    (AgentInterrupt, INTERRUPT_JSON.replace('"choices":["yes","no"]', '"choices":["yes",2]'), "$.choices[1]"),
    (AgentUserMessage, USER_MESSAGE_JSON.replace('"text":"hello"', '"text":null'), "$.text"),
    (AnswerQuestionRequest, r'{"interrupt_id":"c1-input-1","answer":7}', "$.answer"),
], ids=["turn_count-null", "poll-interval-fraction", "choice-number", "text-null", "answer-number"])
def test_a_field_of_a_kind_the_seed_does_not_give_is_refused(
    cls: type[msgspec.Struct], json_text: str, where: str
) -> None:
    """Decoding checks each field's kind as the seed gives it, naming the field: null only where the
    seed writes "| null", whole seconds as an int, choices and text as strings."""
    with pytest.raises(msgspec.ValidationError, match=re.escape(where)):
        msgspec.json.decode(json_text, type=cls)


# Events ------------------------------------------------------------------------------------------


def test_event_types_match_the_seed() -> None:
    """AgentEventType holds exactly the seed's event types, in its table's order."""
    assert [t.value for t in AgentEventType] == [
        "turn_started", "turn_completed", "turn_failed", "turn_steered", "turn_cancelled", "text_delta",
        "reasoning_delta", "tool_call_started", "tool_call_finished", "tool_call_deferred", "interrupt_raised",
        "interrupt_resolved", "timer_started", "plan_updated", "plan_execution_started", "tool_task_started",
        "usage_recorded", "compaction_started", "compaction_finished",
    ]


def _writer() -> tuple[AgentEventWriter, list[AgentEvent]]:
    events: list[AgentEvent] = []
    return AgentEventWriter(events.append, "turn-3", "RunModel-2", 2), events


def test_writer_methods_write_the_seed_payloads() -> None:
    """Each writer method emits one AgentEvent whose whole JSON, payload text included, is the seed's."""
    writer, events = _writer()
    writer.write_text_delta('he said "hi"')
    writer.write_reasoning_delta("thinking…")
    writer.write_tool_call_started("c1", "read_orders")
    writer.write_tool_call_finished("c1", "read_orders", AgentToolCallStatus.SUCCEEDED)
    assert [msgspec.json.encode(e).decode() for e in events] == [
        r'{"type":"text_delta","turn_id":"turn-3","attempt":2,"payload":"{\"text\":\"he said \\\"hi\\\"\"}",'
        r'"step_execution_id":"RunModel-2"}',
        r'{"type":"reasoning_delta","turn_id":"turn-3","attempt":2,"payload":"{\"text\":\"thinking…\"}",'
        r'"step_execution_id":"RunModel-2"}',
        r'{"type":"tool_call_started","turn_id":"turn-3","attempt":2,'
        r'"payload":"{\"tool_call_id\":\"c1\",\"tool_name\":\"read_orders\"}","step_execution_id":"RunModel-2"}',
        r'{"type":"tool_call_finished","turn_id":"turn-3","attempt":2,'
        r'"payload":"{\"tool_call_id\":\"c1\",\"tool_name\":\"read_orders\",\"status\":\"succeeded\"}",'
        r'"step_execution_id":"RunModel-2"}',
    ]
    # The payloads themselves, as a reader parses them: JSON objects with the seed's keys in its order.
    assert [list(json.loads(e.payload)) for e in events] == [
        ["text"], ["text"], ["tool_call_id", "tool_name"], ["tool_call_id", "tool_name", "status"],
    ]


def test_payload_text_is_compact_json_object_text() -> None:
    """Payloads are compact (no spaces), keep non-ASCII text as is, and keep the caller's key order."""
    assert payload_text({"b": 1, "a": [1, 2], "c": None, "d": "é"}) == '{"b":1,"a":[1,2],"c":null,"d":"é"}'
    assert payload_text({}) == "{}"


class _Colour(StrEnum):
    RED = "red"


class _Level(IntEnum):
    HIGH = 3


class _Text(str):
    __slots__ = ()


_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=-(2**70), max_value=2**70), st.floats(),
    st.text(),
    st.sampled_from([_Colour.RED, _Level.HIGH, _Text("t"), "\ud800", "a\x00\x1f\x7f\u2028\u2029é\U0001f600"]),
)
_keys = st.one_of(st.text(), st.integers(), st.sampled_from([True, None, 1.5, _Colour.RED, _Text("k"), "\udfff"]))
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.tuples(inner), st.dictionaries(_keys, inner, max_size=3)),
    max_leaves=10,
)


def _outcome(encode: Any) -> Any:
    try:
        return encode()
    except Exception as exc:  # the same refusal, as the same error
        return type(exc), str(exc)


@settings(max_examples=1000, deadline=None)
@given(payload=st.dictionaries(_keys, _values, max_size=4))
def test_payload_text_is_the_json_module_text(payload: dict[Any, Any]) -> None:
    """payload_text writes what json.dumps does with its options (compact, non-ASCII as is, no NaN),
    byte for byte, or refuses what it refuses with the same error, whichever encoder it uses inside:
    floats, enums, str subclasses, non-text keys, lone surrogates, big integers and deep nesting. Text
    that UTF-8 cannot hold (a lone surrogate) is written all in ASCII instead, as json.dumps does
    with ensure_ascii, so that the event can be stored: the same JSON value."""
    expected = _outcome(lambda: json.dumps(payload, separators=(",", ":"), ensure_ascii=False, allow_nan=False))
    if isinstance(expected, str) and _outcome(expected.encode) != expected.encode("utf-8", "surrogatepass"):
        expected = json.dumps(payload, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    assert _outcome(lambda: payload_text(payload)) == expected


def test_payload_text_writes_every_character_as_json_does() -> None:
    """Every code point but the surrogates, in a key and in a value: escaped (or not) alike."""
    text = "".join(chr(c) for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF)
    payload = {text: text, "list": [text]}
    assert payload_text(payload) == json.dumps(payload, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def test_payload_text_refuses_an_integer_too_long_to_write_as_json_does() -> None:
    payload = {"count": 10**5000}  # over Python's limit on int to text conversion
    expected = _outcome(lambda: json.dumps(payload, separators=(",", ":"), ensure_ascii=False, allow_nan=False))
    assert expected[0] is ValueError
    assert _outcome(lambda: payload_text(payload)) == expected


@pytest.mark.parametrize(("payload", "text"), [
    ({"text": 'he said "hi" é'}, r'{"text":"he said \"hi\" é"}'),
    ({"recorded": {"model_calls": 1}, "choices": ["a", "b"], "deadline": None, "allows_free_text": True},
     r'{"recorded":{"model_calls":1},"choices":["a","b"],"deadline":null,"allows_free_text":true}'),
    ({"a": {"b": [1, "x", None]}, "c": [[2], {"d": False}]}, r'{"a":{"b":[1,"x",null]},"c":[[2],{"d":false}]}'),
])
def test_plain_payloads_two_deep_are_written_by_msgspec(
    payload: dict[str, Any], text: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Payloads of exact str keys and str, int, bool or None values, in dicts and lists at most two deep
    (every payload the session writes), take msgspec's path, not JSONEncoder's slower one."""

    class _Refuse:
        def encode(self, value: Any) -> str:
            raise AssertionError(f"JSONEncoder wrote {value!r}")

    monkeypatch.setattr(_events, "_PAYLOAD_ENCODER", _Refuse())
    assert payload_text(payload) == text


def test_payload_text_refuses_nesting_past_the_recursion_limit_as_json_does() -> None:
    """A payload of plain lists nested past the recursion limit gets json.dumps's RecursionError, message and
    all: payload_text looks only _PLAIN_DEPTH deep before handing it to JSONEncoder, never to the bottom."""
    nested: Any = 1
    for _ in range(2 * sys.getrecursionlimit()):
        nested = [nested]
    payload = {"a": nested}
    expected = _outcome(lambda: json.dumps(payload, separators=(",", ":"), ensure_ascii=False, allow_nan=False))
    assert expected[0] is RecursionError
    assert _outcome(lambda: payload_text(payload)) == expected


@pytest.mark.parametrize("payload", [[1], "text", None, 3])
def test_payload_text_refuses_non_objects(payload: Any) -> None:
    """A payload must be a JSON object: anything else is a TypeError naming what it got."""
    with pytest.raises(TypeError, match=type(payload).__name__):
        payload_text(payload)


def test_payload_text_refuses_nan() -> None:
    """NaN is not JSON, so a payload carrying it is refused rather than written as bare NaN."""
    with pytest.raises(ValueError, match="JSON"):
        payload_text({"x": math.nan})


@pytest.mark.parametrize("event_type", ["", 7, b"text_delta"])
def test_make_event_refuses_an_empty_or_non_string_type(event_type: Any) -> None:
    """An event needs a non-empty type, and a string one: 7 or bytes are refused, not written as "7" or "b'...'"."""
    with pytest.raises(ValueError, match="event type"):
        make_event(event_type, "turn-1", "RunModel-1", 1, {})


def test_closed_writer_drops_events() -> None:
    """After close() a stray write is dropped, so a finished attempt gets no late output; a late write
    is dropped unchecked, so it cannot raise in a stray thread either (seed 003: "writes after the
    call returns are dropped")."""
    writer, events = _writer()
    writer.write_text_delta("a")
    writer.close()
    writer.write_text_delta("b")
    writer.write_event("", [1, 2])  # type: ignore[arg-type]  # refused while open; dropped once closed
    writer.write_event("custom", {"x": math.nan})
    assert writer.closed
    assert [json.loads(e.payload)["text"] for e in events] == ["a"]


# Times -----------------------------------------------------------------------------------------


def test_format_time_writes_utc_millis_and_z() -> None:
    """Writers emit UTC with milliseconds and Z; other offsets are converted, sub-milliseconds truncated."""
    assert format_time(datetime(2026, 11, 1, 12, 0, 0, 123000, tzinfo=UTC)) == "2026-11-01T12:00:00.123Z"
    assert format_time(datetime(2026, 11, 1, 12, 0, 0, tzinfo=UTC)) == "2026-11-01T12:00:00.000Z"
    assert format_time(datetime(2026, 11, 1, 12, 0, 0, 123999, tzinfo=UTC)) == "2026-11-01T12:00:00.123Z"
    plus_two = timezone(timedelta(hours=2))
    assert format_time(datetime(2026, 11, 1, 14, 0, 0, 5000, tzinfo=plus_two)) == "2026-11-01T12:00:00.005Z"
    assert format_time(datetime(999, 1, 2, 3, 4, 5, tzinfo=UTC)) == "0999-01-02T03:04:05.000Z"  # RFC 3339: 4 digits


@pytest.mark.parametrize("ns", [
    0, 999_999, 1_000_000, 1_999_999_999, 1_793_534_400_123_999_999, 1_793_534_400_000_000_000, -1, -1_000_001,
    -62_135_596_800_000_000_000, 253_402_300_799_999_999_999,
])
def test_the_time_of_now_is_format_time_of_the_same_instant(ns: int) -> None:
    """utc_now_text formats the clock's nanoseconds itself: as format_time would the datetime that
    datetime.now(UTC) makes of them (microseconds rounded down), in every year."""
    moment = datetime(1970, 1, 1, tzinfo=UTC) + timedelta(microseconds=ns // 1000)
    assert posix_ns_text(ns) == format_time(moment)
    assert posix_ns_text(ns) == format_time(moment)  # the second's text now comes from the cache


def test_utc_now_text_reads_the_clock_of_datetime_now() -> None:
    before = format_time(datetime.now(UTC))
    now = utc_now_text()
    assert before <= now <= format_time(datetime.now(UTC))
    assert parse_time(now).tzinfo is UTC


def test_format_time_refuses_naive_datetimes() -> None:
    """A naive datetime has no zone to convert from, so it is refused."""
    with pytest.raises(ValueError, match="timezone-aware"):
        format_time(datetime(2026, 11, 1, 12, 0, 0))


@pytest.mark.parametrize("text", [
    "2026-11-01T12:00:00.123Z", "2026-11-01T12:00:00.123z", "2026-11-01T12:00:00.123+00:00",
    "2026-11-01T12:00:00.123000+00:00", "2026-11-01T14:00:00.123+02:00",
])
def test_parse_time_accepts_z_and_offset_forms(text: str) -> None:
    """Readers accept the Z form and the +00:00 form Python 0.1.0 wrote, and return aware UTC."""
    moment = parse_time(text)
    assert moment == datetime(2026, 11, 1, 12, 0, 0, 123000, tzinfo=UTC)
    assert moment.utcoffset() == timedelta(0)
    assert format_time(moment) == "2026-11-01T12:00:00.123Z"


@pytest.mark.parametrize("text", ["2026-11-01T12:00:00.123", "2026-11-01", "2026-11-01 12:00:00"])
def test_parse_time_refuses_naive_text(text: str) -> None:
    """A time without an offset is refused with a ValueError that quotes it."""
    with pytest.raises(ValueError, match="has no offset") as info:
        parse_time(text)
    assert repr(text) in str(info.value)


@pytest.mark.parametrize("text", ["", "Z", "yesterday", "2026-13-01T12:00:00Z", "2026-11-01T12:00:00.123ZZ",
                                  "2026-11-01T25:00:00Z"])
def test_parse_time_refuses_garbage(text: str) -> None:
    """Text that is not an RFC 3339 time is a ValueError that quotes it."""
    with pytest.raises(ValueError, match="not an RFC 3339 time") as info:
        parse_time(text)
    assert repr(text) in str(info.value)


# Keys ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("sequence", "key"), [(1, "000000000001"), (42, "000000000042"),
                                               (10**12 - 1, "999999999999")])
def test_message_sequence_key_pads_to_12_digits(sequence: int, key: str) -> None:
    """AgentMessages keys are 12-digit zero-padded decimal, so key order is sequence order."""
    assert message_sequence_key(sequence) == key


def test_message_sequence_keys_sort_like_sequences() -> None:
    """String order of the keys matches numeric order, which the zero padding exists for."""
    sequences = [1, 9, 10, 99, 100, 12345, 10**11]
    assert sorted(message_sequence_key(s) for s in sequences) == [message_sequence_key(s) for s in sequences]


@pytest.mark.parametrize("sequence", [0, -1, 10**12, True, 1.0, "1", None])
def test_message_sequence_key_refuses_bad_sequences(sequence: Any) -> None:
    """Sequences start at 1 and must fit 12 digits; bools, floats and text are refused, naming the value."""
    with pytest.raises(ValueError, match="message sequence") as info:
        message_sequence_key(sequence)
    assert repr(sequence) in str(info.value)


def test_plan_execution_key_is_plain_decimal() -> None:
    """PlanExecutions keys are the revision as decimal, without padding."""
    assert plan_execution_key(1) == "1"
    assert plan_execution_key(12) == "12"


@pytest.mark.parametrize("revision", [0, -3, True, 2.0, "2", None])
def test_plan_execution_key_refuses_bad_revisions(revision: Any) -> None:
    """A plan revision is a whole number from 1; anything else is refused, naming the value."""
    with pytest.raises(ValueError, match="plan revision") as info:
        plan_execution_key(revision)
    assert repr(revision) in str(info.value)
