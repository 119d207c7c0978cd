"""One test's session on a stack shared by a test module (test_steering.py, test_cancellation.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, cast

from agents.tests.scripted_agent import INVOCATIONS

from dex_agents import AgentEvent, AgentSessionClient, AgentSessionFlow, AgentSnapshot
from dex_agents.testing import (
    AgentTestStack,
    FileGate,
    InvocationLog,
    StepHistoryEntry,
    executed_steps,
    wait_for_agent_snapshot,
)
from dex_agents.testing._waiting import DEFAULT_WAIT_SECONDS
from dex_engine import StreamEvent


class Session:
    """One test's session on a shared stack; its ID prefixes its FileGates."""

    def __init__(self, stack: AgentTestStack, session_id: str) -> None:
        self.stack = stack
        self.id = session_id
        self.sessions = stack.sessions(cast(AgentSessionFlow, stack.flows[0]))
        self.log = InvocationLog(stack.state_dir / INVOCATIONS)

    def gate_name(self, name: str) -> str:
        return f"{self.id}.{name}"

    def gate(self, name: str) -> FileGate:
        return FileGate(self.stack.state_dir, self.gate_name(name))

    async def start(self, text: str | None) -> None:
        await self.sessions.start_session(self.id, text)

    async def cancel(self, turn_id: str | None = None) -> bool:
        return await self.sessions.cancel_turn(self.id, turn_id)

    async def snapshot(self) -> AgentSnapshot:
        return await self.sessions.get_agent_snapshot(self.id)

    async def wait_for(self, probe: Callable[[AgentSnapshot], Any], description: str) -> Any:
        return await wait_for_agent_snapshot(self.sessions, self.id, probe, description=description)

    async def turns_ended(self, count: int) -> AgentSnapshot:
        return await turns_ended(self.sessions, self.id, count)

    async def interrupts(self, *interrupt_ids: str) -> AgentSnapshot:
        def probe(s: AgentSnapshot) -> AgentSnapshot | None:
            return s if {i.interrupt_id for i in s.pending_interrupts} >= set(interrupt_ids) else None

        found: AgentSnapshot = await self.wait_for(probe, f"interrupts {interrupt_ids}")
        return found

    async def events(self, event_type: str | None = None) -> list[tuple[AgentEvent, dict[str, Any]]]:
        """The session's events, of `event_type` only when given, with their decoded payloads."""
        read = await self.sessions.read_agent_events(self.id)
        values = [cast(AgentEvent, e.value) for e in read.events]
        return [(v, json.loads(v.payload)) for v in values if event_type is None or v.type == event_type]

    async def history(self) -> list[StepHistoryEntry]:
        return await self.stack.read_step_history(self.id)

    async def steps(self) -> list[str]:
        return executed_steps(await self.history())

    async def cancelled_steps(self) -> list[str]:
        return [e.step_type for e in await self.history() if e.event_type == "step_cancelled"]

    def count(self, kind: str, **match: Any) -> int:
        return self.log.count(kind, flow_id=self.id, **match)

    def tool_starts(self, tool_call_id: str | None = None) -> int:
        return self.count("tool_start", **({} if tool_call_id is None else {"tool_call_id": tool_call_id}))


async def all_agent_events(sessions: AgentSessionClient, session_id: str) -> list[StreamEvent]:
    """Every event of the session's AgentEvents, oldest first, read page by page (none trimmed)."""
    events: list[StreamEvent] = []
    token: str | None = None
    while True:
        read = await sessions.read_agent_events(session_id, token)
        assert not read.trimmed
        if not read.events:
            return events
        events.extend(read.events)
        token = read.resume_token


def script(*steps: dict[str, Any]) -> str:
    """A ScriptedRunner script: the user message that plays `steps`, one per model call."""
    return json.dumps({"steps": list(steps)})


async def turns_ended(
    sessions: AgentSessionClient, session_id: str, count: int, *, timeout: float = DEFAULT_WAIT_SECONDS,
) -> AgentSnapshot:
    """The session's snapshot once `count` turns have ended and no turn is active."""

    def probe(s: AgentSnapshot) -> AgentSnapshot | None:
        ended = s.state is not None and s.state.turn_count == count and s.state.active_turn_id is None
        return s if ended else None

    snapshot: AgentSnapshot = await wait_for_agent_snapshot(
        sessions, session_id, probe, description=f"{count} turn(s) of {session_id} to end", timeout=timeout)
    return snapshot


async def first_turn_ended(
    sessions: AgentSessionClient, session_id: str, *, timeout: float = DEFAULT_WAIT_SECONDS,
) -> AgentSnapshot:
    """The session's snapshot once its first turn has ended and no turn is active."""
    return await turns_ended(sessions, session_id, 1, timeout=timeout)


async def first_turn_answer(sessions: AgentSessionClient, session_id: str) -> str:
    """The text of the session's last message once its first turn has ended."""
    return (await first_turn_ended(sessions, session_id)).messages[-1].text or ""
