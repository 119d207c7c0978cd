"""AgentEvents: event types, payload encoding, and the writer a runner gets."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from enum import StrEnum
from typing import Any

import msgspec

from ._policy import shown
from ._wire import AgentEvent

log = logging.getLogger("dex_agents.session")


class AgentEventType(StrEnum):
    TURN_STARTED = "turn_started"
    TURN_COMPLETED = "turn_completed"
    TURN_FAILED = "turn_failed"
    TURN_STEERED = "turn_steered"
    TURN_CANCELLED = "turn_cancelled"
    TEXT_DELTA = "text_delta"
    REASONING_DELTA = "reasoning_delta"
    TOOL_CALL_STARTED = "tool_call_started"
    TOOL_CALL_FINISHED = "tool_call_finished"
    TOOL_CALL_DEFERRED = "tool_call_deferred"
    INTERRUPT_RAISED = "interrupt_raised"
    INTERRUPT_RESOLVED = "interrupt_resolved"
    TIMER_STARTED = "timer_started"
    PLAN_UPDATED = "plan_updated"
    PLAN_EXECUTION_STARTED = "plan_execution_started"
    TOOL_TASK_STARTED = "tool_task_started"
    USAGE_RECORDED = "usage_recorded"
    COMPACTION_STARTED = "compaction_started"
    COMPACTION_FINISHED = "compaction_finished"


# The payload text is JSONEncoder's with these options, byte for byte; json.dumps with them builds a
# new JSONEncoder per call.
_PAYLOAD_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)
# A payload with a lone surrogate (a model's stream that split a UTF-16 pair across two deltas), which
# UTF-8 and so the stored event cannot hold, is written with every non-ASCII character as its JSON
# escape: the same JSON value, the surrogate included, in text that can be stored.
_ASCII_PAYLOAD_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=True, allow_nan=False)
# msgspec writes the same text for the payloads the session itself writes, several times faster: for
# str keys and str, int, bool and None values (every string is escaped alike), in dicts and lists
# nested up to _PLAIN_DEPTH deep (deeper ones meet JSONEncoder's recursion limit, or not, as before).
# Floats are JSONEncoder's alone (their text, NaN), and so is every other type.
_PLAIN_ENCODER = msgspec.json.Encoder()
_PLAIN_SCALARS = frozenset({str, int, bool, type(None)})
_PLAIN_VALUES = _PLAIN_SCALARS | {dict, list}
_STR = frozenset({str})
_PLAIN_DEPTH = 2


def payload_text(payload: Mapping[str, Any]) -> str:
    """Compact JSON object text, as every core writes event payloads."""
    if type(payload) is not dict and not isinstance(payload, Mapping):
        raise TypeError(f"an event payload must be a JSON object (a mapping), got {type(payload).__name__}")
    plain = dict(payload)
    if _is_plain(plain, _PLAIN_DEPTH):
        try:
            return _PLAIN_ENCODER.encode(plain).decode()
        except UnicodeEncodeError:
            return _ASCII_PAYLOAD_ENCODER.encode(plain)
    text = _PAYLOAD_ENCODER.encode(plain)
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return _ASCII_PAYLOAD_ENCODER.encode(plain)
    return text


def _is_plain(value: dict[Any, Any] | list[Any], depth: int) -> bool:
    """Whether msgspec writes `value` as JSONEncoder does (exact types only: no subclass, no enum)."""
    if type(value) is dict:
        if not _STR.issuperset(map(type, value)):
            return False
        items: Iterable[Any] = value.values()
    else:
        items = value
    if _PLAIN_SCALARS.issuperset(map(type, items)):
        return True
    if depth == 0 or not _PLAIN_VALUES.issuperset(map(type, items)):
        return False
    for item in items:
        kind = type(item)
        if (kind is dict or kind is list) and not _is_plain(item, depth - 1):
            return False
    return True


def make_event(
    event_type: str, turn_id: str | None, step_execution_id: str, attempt: int, payload: Mapping[str, Any]
) -> AgentEvent:
    if not isinstance(event_type, str) or not event_type:
        raise ValueError(f"an event type must be a non-empty string, got {event_type!r}")
    return AgentEvent(
        type=str(event_type), turn_id=turn_id, attempt=attempt, payload=payload_text(payload),
        step_execution_id=step_execution_id,
    )


class AgentEventWriter:
    """Best-effort live events of one Step attempt, bound to its turn, Step execution and attempt.

    Safe to call from any thread. Once the call that received it returns, the writer is closed and
    later writes are dropped, so a stray thread cannot attribute output to a finished attempt.
    An event that cannot be stored is dropped with a warning naming it, and `flow_id` when given.
    """

    def __init__(
        self, emit: Callable[[AgentEvent], None], turn_id: str | None, step_execution_id: str, attempt: int,
        *, flow_id: str | None = None,
    ) -> None:
        self._emit = emit
        # Named in the warning of a dropped event: Step execution IDs (RunModel-2) repeat in every session.
        self._flow = "" if flow_id is None else f"flow {flow_id}: "
        self.turn_id = turn_id
        self.step_execution_id = step_execution_id
        self.attempt = attempt
        self._lock = threading.Lock()
        self._closed = False

    def write_event(self, event_type: str, payload: Mapping[str, Any]) -> None:
        """Write one live event; one that cannot be stored (no JSON object payload, a blank type,
        too large) is dropped with a warning naming it: live events are best effort, and failing
        the model call or tool that wrote it would pay for that call again on each retry, and fail alike."""
        if self.closed:
            return  # dropped unchecked: a stray late write must not raise in its thread either
        try:
            event = make_event(event_type, self.turn_id, self.step_execution_id, self.attempt, payload)
        except (TypeError, ValueError, RecursionError) as exc:
            log.warning("%sdropped a %r event of %s attempt %d: it cannot be written as JSON: %s",
                        self._flow, event_type, self.step_execution_id, self.attempt, exc)
            return
        with self._lock:
            if self._closed:
                return
            try:
                self._emit(event)
            except ValueError as exc:  # too large (ValueTooLargeError), or text no stored value holds
                log.warning("%sdropped a %s event of %s attempt %d: %s", self._flow, event.type,
                            self.step_execution_id, self.attempt, exc)

    def write_text_delta(self, text: str) -> None:
        given: object = text  # typed str; a client may pass anything. Checked first, as cheaply: one per delta
        if isinstance(given, str) or self._texts(AgentEventType.TEXT_DELTA, text=given):
            self.write_event(AgentEventType.TEXT_DELTA, {"text": text})

    def write_reasoning_delta(self, text: str) -> None:
        given: object = text
        if isinstance(given, str) or self._texts(AgentEventType.REASONING_DELTA, text=given):
            self.write_event(AgentEventType.REASONING_DELTA, {"text": text})

    def write_tool_call_started(self, tool_call_id: str, tool_name: str) -> None:
        if self._texts(AgentEventType.TOOL_CALL_STARTED, tool_call_id=tool_call_id, tool_name=tool_name):
            self.write_event(AgentEventType.TOOL_CALL_STARTED, {"tool_call_id": tool_call_id, "tool_name": tool_name})

    def write_tool_call_finished(self, tool_call_id: str, tool_name: str, status: str) -> None:
        if self._texts(AgentEventType.TOOL_CALL_FINISHED, tool_call_id=tool_call_id, tool_name=tool_name):
            self.write_event(
                AgentEventType.TOOL_CALL_FINISHED,
                {"tool_call_id": tool_call_id, "tool_name": tool_name, "status": str(status)},
            )

    def _texts(self, event_type: AgentEventType, **fields: object) -> bool:
        """Whether each field of a typed event is text, as its payload's contract has it; else the
        event is dropped with a warning naming the field, as write_event drops what it cannot store.
        Written as given, {"text": 5} or {"text": null} reached clients that join the deltas' texts."""
        for name, value in fields.items():
            if not isinstance(value, str):
                if not self.closed:
                    log.warning("%sdropped a %s event of %s attempt %d: %s must be a str, got %s: %s",
                                self._flow, event_type, self.step_execution_id, self.attempt, name,
                                type(value).__name__, shown(value))
                return False
        return True

    def close(self) -> None:
        with self._lock:
            self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed
