"""Step contexts and records built by hand, for calling a Step's handler directly on chosen state:
the cases a live Worker cannot be made to hit on purpose (steering, cancellation, tool tasks and
tool questions)."""

from __future__ import annotations

import json
from typing import Any

import msgspec

from dex_agents import (
    AgentInterrupt,
    AgentSessionFlow,
    AgentState,
    AgentStatus,
    AgentToolCall,
    AgentToolCallStatus,
    InterruptKind,
    ToolEffect,
)
from dex_agents._runtime import SessionRuntime
from dex_engine import MAX_VALUE_BYTES, Context, LoadOptions, LoadSpec, RecoveryError, Wait, WaitResult
from dex_engine._context import EventFn, HeartbeatFn
from dex_engine._records import WaitOutcome


def tool_call(status: AgentToolCallStatus, **fields: Any) -> AgentToolCall:
    """Call c1 of turn-1, tool "t", a read without approval, in `status`; `fields` override."""
    record = AgentToolCall(
        tool_call_id="c1", turn_id="turn-1", tool_name="t", arguments="{}", effect=ToolEffect.READ,
        requires_approval=False, status=status, output=None, error=None, rejection_message=None,
        deferral_order=0, tool_source_reference=None, trace_context=None,
    )
    return msgspec.structs.replace(record, **fields)


def filling(record: AgentToolCall, slack: int, field: str = "arguments") -> AgentToolCall:
    """`record` with its text `field` (arguments by default) padded to a JSON object of "x"s so
    that the record is `slack` bytes under MAX_VALUE_BYTES: a call that steering or cancel_turn
    must still be able to end."""
    def padded(chars: int) -> AgentToolCall:
        return msgspec.structs.replace(record, **{field: json.dumps({"pad": "x" * chars}, separators=(",", ":"))})

    short = len(msgspec.json.encode(padded(0)))  # each "x" is one byte more
    filled = padded(MAX_VALUE_BYTES - slack - short)
    assert len(msgspec.json.encode(filled)) == MAX_VALUE_BYTES - slack
    return filled


def running_turn(**fields: Any) -> AgentState:
    """A session in its first turn, turn-1, running its model call after the user message (sequence 1),
    with steering and cancel_turn accepted; `fields` override."""
    state = AgentState(status=AgentStatus.RUNNING_MODEL, turn_count=0, active_turn_id="turn-1",
                       next_message_sequence=2, last_turn_error=None, accepts_turn_control=True)
    return msgspec.structs.replace(state, **fields)


def interrupt(interrupt_id: str, *, kind: InterruptKind = InterruptKind.TOOL_APPROVAL, **fields: Any) -> AgentInterrupt:
    """The pending interrupt `interrupt_id` of the tool call with the same ID (tool "t"), created
    2026-01-01 with no deadline; `fields` override."""
    made = AgentInterrupt(interrupt_id=interrupt_id, kind=kind, tool_call_id=interrupt_id, tool_name="t",
                          arguments="{}", created_at="2026-01-01T00:00:00.000Z", deadline=None)
    return msgspec.structs.replace(made, **fields)


def runtime_of(flow: AgentSessionFlow) -> SessionRuntime:
    """The SessionRuntime the Flow's Step handlers share, for calling a handler directly."""
    return SessionRuntime(flow.runner, flow.options, flow.agent_events)


def step_context(
    flow: AgentSessionFlow,
    step_type: str,
    values: dict[tuple[str, str], Any],
    wait: tuple[Wait, WaitOutcome] | None = None,
    *,
    method: str = "execute",
    step_execution_id: str | None = None,
    recovery_error: RecoveryError | None = None,
    heartbeat: HeartbeatFn | None = None,
    write_event: EventFn | None = None,
    load: LoadSpec | None = None,
) -> Context:
    """Attempt 1 of a method of flow "s" that loaded `values` ((name, key) -> value), with the wait
    result `wait` if given; its heartbeats and best-effort events go to `heartbeat` and
    `write_event`, or nowhere. `load`: what the method declares it loads (reading anything else raises
    NotLoadedError, as in a Worker); every value by default."""
    loaded = {key: msgspec.json.encode(value) for key, value in values.items()}

    async def no_heartbeat(_: str | None) -> None:
        return None

    return Context(
        flow=flow, flow_id="s", step_type=step_type, step_execution_id=step_execution_id or f"{step_type}-1",
        method=method, attempt=1, loaded=loaded, load=load or LoadOptions.all(), checkpoint=None,
        recovery_error=recovery_error,
        wait_result=None if wait is None else WaitResult(wait[0].spec(), wait[1], flow),
        heartbeat=heartbeat or no_heartbeat, write_event=write_event or (lambda _name, _data: None),
    )
