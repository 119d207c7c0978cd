"""ContextWindowSessionScenario: one session past a small context window, for any adapter (seed 003
"Compaction" and "Testing an adapter").

The adapter's test builds its Flow with a small `CompactionPolicy` (and usually a small
`retained_message_limit`), starts a Worker, and runs the scenario with its scripted model. The
scenario sends turn after turn and then checks what every adapter must show: the session compacted
more than once without a failed turn; each compaction is RunModel -> CompactContext -> RunModel in
the Step history, with matching compaction_started and compaction_finished events and a
ContextSummary of the last one; the runner's next model input fits the window; paging ends at the
oldest stored message with deleted_before_sequence; and retention keeps the stored messages bounded
while every message after the summary stays.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .._client import AgentSessionClient
from .._compaction import CompactionPolicy
from .._constants import COMPACT_CONTEXT, RUN_MODEL
from .._events import AgentEventType, AgentEventWriter
from .._policy import count_problem, shown
from .._runner import AgentTurnContext
from .._runtime import resolved
from .._wire import AgentMessage, AgentSnapshot, AgentStatus, ContextSummary
from ._history import executed_steps, to_step_history
from ._waiting import DEFAULT_WAIT_SECONDS, wait_for_agent_snapshot

# The default message of turn n: about 300 bytes, and the number it carries stays in each summary.
SCENARIO_FILLER = "Please keep this in mind for later. " * 8


def default_scenario_message(turn: int) -> str:
    return f"Turn {turn}: remember the code word ORCHID-{turn:04d}. {SCENARIO_FILLER}"


def _ended(turn_count: int) -> Callable[[AgentSnapshot], AgentSnapshot | None]:
    return lambda snapshot: snapshot if snapshot.state is not None and snapshot.state.turn_count >= turn_count else None


@dataclass(frozen=True)
class ContextWindowSessionReport:
    """What the scenario saw, for a test to print or check further."""

    turns: int
    summary: ContextSummary
    compactions: list[dict[str, Any]]  # compaction_finished payloads, oldest first
    stored_messages: list[AgentMessage]  # every stored message, oldest first
    deleted_before_sequence: int | None
    next_input_tokens: int  # the runner's estimate of the next model input


@dataclass
class ContextWindowSessionScenario:
    """Run `turns` turns of one session and check compaction and retention (see the module docstring).

    `sessions` is the adapter's AgentSessionClient, whose Flow has AgentSessionOptions.compaction;
    a Worker for it must be running. Keep each turn well under (1 - trigger_ratio) of the window, so
    the input after a compaction fits it. Raises AssertionError naming what broke.
    """

    sessions: AgentSessionClient
    session_id: str = "context-window-session"
    turns: int = 24
    message: Callable[[int], str] = default_scenario_message
    min_compactions: int = 2
    turn_timeout: float = DEFAULT_WAIT_SECONDS
    snapshots: list[AgentSnapshot] = field(default_factory=list)

    def __post_init__(self) -> None:
        """Refuse what run() cannot use, before it starts a session: turns=0 started one and then
        failed with a bare IndexError, a message that is not a function with a TypeError mid-run."""
        problems = []
        given: object = self.sessions  # typed; checked for callers that pass anything
        if not isinstance(given, AgentSessionClient):
            problems.append(f"sessions must be the adapter's AgentSessionClient, got {shown(given)}")
        problems.extend(problem for name in ("turns", "min_compactions")
                        if (problem := count_problem(name, getattr(self, name))) is not None)
        message: object = self.message
        if not callable(message):
            problems.append(f"message must be a function of the turn number returning its text, got "
                            f"{shown(message)}")
        timeout: object = self.turn_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
            problems.append(f"turn_timeout must be a number of seconds above 0 (math.inf waits for ever), "
                            f"got {shown(timeout)}")
        if problems:
            raise ValueError("invalid ContextWindowSessionScenario: " + "; ".join(problems))

    async def run(self) -> ContextWindowSessionReport:
        flow = self.sessions.flow
        policy = flow.options.compaction
        if policy is None:
            raise ValueError(f"flow {flow.flow_type} has no AgentSessionOptions.compaction; the scenario needs one")
        sid = self.session_id
        await self.sessions.start_session(sid)
        for number in range(1, self.turns + 1):
            assert await self.sessions.send_user_message(sid, self.message(number)), f"turn {number} was refused"
            snapshot: AgentSnapshot = await wait_for_agent_snapshot(
                self.sessions, sid, _ended(number), description=f"turn {number} of {sid} to end",
                timeout=self.turn_timeout,
            )
            assert snapshot.state is not None
            assert snapshot.state.last_turn_error is None, f"turn {number} failed: {snapshot.state.last_turn_error}"
            self.snapshots.append(snapshot)
        final = self.snapshots[-1]
        assert final.state is not None and final.state.status is AgentStatus.WAITING_FOR_USER_MESSAGE
        summary = final.context_summary
        if summary is None:
            await self._no_compaction(policy, final)
        assert summary is not None
        newest = final.state.next_message_sequence - 1
        assert summary.first_sequence == 1 and 1 <= summary.last_sequence < newest, summary
        assert summary.text.strip(), "the summary is blank"
        assert summary.generation >= self.min_compactions, (
            f"{summary.generation} compactions in {self.turns} turns; expected at least {self.min_compactions}"
        )
        compactions = await self._check_events(summary)
        await self._check_history(summary.generation)
        stored, deleted_before = await self._stored_messages(newest)
        self._check_retention(stored, summary, newest)
        next_input = await self._next_input_tokens(stored, summary, final)
        assert next_input < policy.context_window_tokens, (
            f"the next model input is {next_input} tokens, over the {policy.context_window_tokens}-token window"
        )
        return ContextWindowSessionReport(self.turns, summary, compactions, stored, deleted_before, next_input)

    async def _no_compaction(self, policy: CompactionPolicy, final: AgentSnapshot) -> None:
        """Raise AssertionError saying why no turn compacted: the runner's estimate stayed under the
        trigger, or it passed the trigger and select_compaction_cutoff named nothing to summarize."""
        assert final.state is not None
        stored, _ = await self._stored_messages(final.state.next_message_sequence - 1)
        estimate = await self._next_input_tokens(stored, None, final)
        with_reserved = estimate + policy.reserved_input_tokens
        if policy.should_compact(estimate):
            raise AssertionError(
                f"no compaction in {self.turns} turns, though the next model input is {with_reserved} tokens "
                f"(estimate_input_tokens plus reserved_input_tokens), over the trigger of {policy.trigger_tokens}: "
                "select_compaction_cutoff named no message to summarize (None, or one at or before the summary)"
            )
        raise AssertionError(
            f"no compaction in {self.turns} turns: the window was never reached (the next model input is "
            f"{with_reserved} tokens, under the trigger of {policy.trigger_tokens}); send longer messages or more "
            "turns, or give the Flow a smaller context_window_tokens"
        )

    async def _check_events(self, summary: ContextSummary) -> list[dict[str, Any]]:
        started: list[int] = []
        finished: list[dict[str, Any]] = []
        token: str | None = None
        while True:
            read = await self.sessions.read_agent_events(self.session_id, token)
            # Events older than the Stream's capacity are gone: the checks below would then fail
            # with a misleading count of compactions.
            assert not read.trimmed, (
                f"the AgentEvents Stream of {self.session_id!r} dropped its oldest events (over its capacity, "
                f"{self.sessions.flow.options.agent_events_capacity_bytes} bytes); the scenario checks every "
                "compaction event: give the Flow a larger agent_events_capacity_bytes, or run fewer turns"
            )
            if not read.events:
                break
            for event in read.events:
                value = event.value
                if value.type == AgentEventType.COMPACTION_STARTED:
                    started.append(json.loads(value.payload)["through_sequence"])
                elif value.type == AgentEventType.COMPACTION_FINISHED:
                    finished.append(json.loads(value.payload))
            token = read.resume_token
        assert [f["generation"] for f in finished] == list(range(1, summary.generation + 1)), finished
        throughs = [f["through_sequence"] for f in finished]
        assert throughs == sorted(set(throughs)), f"summaries must advance: {throughs}"
        assert throughs[-1] == summary.last_sequence, (throughs, summary)
        assert set(throughs) <= set(started), f"compaction_finished without compaction_started: {throughs} {started}"
        return finished

    async def _check_history(self, generation: int) -> None:
        history = to_step_history(await self.sessions.client.get_flow_history(self.session_id))
        steps = executed_steps(history)
        positions = [i for i, step in enumerate(steps) if step == COMPACT_CONTEXT]
        assert len(positions) == generation, f"{len(positions)} CompactContext Steps for {generation} summaries"
        for at in positions:
            assert steps[at - 1] == RUN_MODEL and steps[at + 1] == RUN_MODEL, (
                f"CompactContext must sit between two RunModel Steps: {steps[max(0, at - 3):at + 4]}"
            )

    async def _stored_messages(self, newest: int) -> tuple[list[AgentMessage], int | None]:
        """Every stored message, paging back from the newest; paging ends at the oldest stored one."""
        pages: list[list[AgentMessage]] = []
        deleted: set[int | None] = set()
        cursor: int | None = None
        while True:
            page = await self.sessions.list_agent_messages(self.session_id, before_sequence=cursor, limit=200)
            deleted.add(page.deleted_before_sequence)
            pages.append(page.messages)
            if page.next_before_sequence is None:
                break
            cursor = page.next_before_sequence
        stored = [m for page in reversed(pages) for m in page]
        assert stored, "no stored messages"
        first = stored[0].sequence
        assert [m.sequence for m in stored] == list(range(first, newest + 1)), "stored messages are not contiguous"
        assert deleted == {first if first > 1 else None}, f"deleted_before_sequence {deleted}, oldest stored {first}"
        return stored, first if first > 1 else None

    def _check_retention(self, stored: list[AgentMessage], summary: ContextSummary, newest: int) -> None:
        options = self.sessions.flow.options
        limit = options.retained_message_limit
        first = stored[0].sequence
        assert first <= summary.last_sequence + 1, "a message after the summary was deleted"
        if limit is None:
            assert first == 1, "retained_message_limit=None must keep every message"
            return
        assert newest - first + 1 >= min(limit, newest), "fewer than retained_message_limit messages stay"
        after_summary = newest - summary.last_sequence
        bound = max(limit, options.message_window_size, after_summary) + options.message_chunk_size
        assert len(stored) <= bound, f"{len(stored)} stored messages, over the retention bound {bound}"

    async def _next_input_tokens(
        self, stored: list[AgentMessage], summary: ContextSummary | None, final: AgentSnapshot
    ) -> int:
        options = self.sessions.flow.options
        runner: Any = self.sessions.flow.runner
        assert final.state is not None
        turn_id = f"turn-{final.state.turn_count + 1}"
        events = AgentEventWriter(lambda event: None, turn_id, "", 1)
        events.close()

        async def heartbeat() -> None:
            return None

        turn = AgentTurnContext(
            flow_id=self.session_id, turn_id=turn_id, attempt=1,
            messages=[m for m in stored if summary is None or m.sequence > summary.last_sequence],
            framework_run_state=None,
            tool_calls={}, events=events, heartbeat=heartbeat, tool_policies=options.tool_policies,
            default_tool_effect=options.default_tool_effect,
            enabled_built_in_tools=frozenset(t.value for t in options.built_in_tools), context_summary=summary,
        )
        # Awaited when awaitable, as RunModel awaits it: an adapter's async estimate is a working one.
        value = await resolved(runner.estimate_input_tokens(turn))
        assert isinstance(value, int), f"estimate_input_tokens returned {value!r}"
        return value
