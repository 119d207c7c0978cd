"""A tool call whose tool raises an error asking for its retry no sooner than a delay
(`retry_after_seconds`, dex_engine's RetryAfterError protocol), as a rate-limited API's client does.

- CallTool (read, idempotent_write) retries it after that delay, waiting in the database, so a
  one-slot Worker runs other sessions meanwhile: for a function tool of the built-in loop too,
  whose errors otherwise become ToolExecutionError (seed 003) and end the call at once;
- a delay past the tool Step's retry budget ends the call at once, by its effect, naming the delay;
- CallSingleAttemptTool (one attempt) runs the tool once whatever it asks.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from agents.tests.builtin_agent import InProcessEngine, scripted_flow, tool_then_answer
from agents.tests.scripted_agent import ScriptedRunner
from agents.tests.session_driver import script, turns_ended
from engine.tests.conftest import db_url, pg_database, pg_databases, wait_until  # noqa: F401 - the fixtures used here

from dex_agents import (
    AgentSessionClient,
    AgentSessionFlow,
    AgentSessionOptions,
    AgentSnapshot,
    AgentToolCallStatus,
    DeferredToolCall,
    DeferredToolExecution,
    ToolCallStepOptions,
    ToolEffect,
    ToolExecutionResult,
    ToolInputRequested,
    ToolTaskStarted,
)
from dex_agents.builtin_loop import ToolCallContext, function_tool
from dex_engine import HistoryEntry, RetryAfterError, RetryPolicy, StreamEvent


class RateLimited(Exception):
    """A library's rate-limit error: its own type, with the delay the API asked for."""

    def __init__(self, delay_seconds: float) -> None:
        super().__init__(f"429 Too Many Requests, retry after {delay_seconds:g} s")
        self.retry_after_seconds = delay_seconds


def history_of(history: list[HistoryEntry], step_type: str, event_type: str) -> list[HistoryEntry]:
    return [h for h in history if h.step_type == step_type and h.event_type == event_type]


def ended_by_the_control(control: str, status: AgentToolCallStatus, events: list[StreamEvent],
                         history: list[HistoryEntry], done: AgentSnapshot) -> str:
    """Check that the turn's one call ended, recorded `status`, as one whose retry `control`
    (cancel_turn or steer) ended, and that the session went on to the next turn; the reason given."""
    finished = [json.loads(e.value.payload) for e in events if e.value.type == "tool_call_finished"]
    assert [f["status"] for f in finished] == [status.value], finished
    why = "the user cancelled the turn" if control == "cancel_turn" else "the user steered the turn with a new message"
    (ended,) = history_of(history, "CallTool", "step_failed")
    assert f"cancelled while waiting to retry: {why}" in ended.detail, ended
    assert "429 Too Many Requests, retry after 3600 s" in ended.detail, ended
    ending = "turn_cancelled" if control == "cancel_turn" else "turn_steered"
    assert [e.value.type for e in events if e.value.type in ("turn_cancelled", "turn_steered", "turn_completed")] == [
        ending, "turn_completed"]
    assert done.messages[-1].text == "after the control"
    return why


@pytest.mark.parametrize(("effect", "error"), [
    (ToolEffect.READ, "library"), (ToolEffect.IDEMPOTENT_WRITE, "library"), (ToolEffect.READ, "RetryAfterError"),
])
async def test_a_function_tool_asking_retry_after_is_retried_after_it_in_the_engine(
    tmp_path: Path, db_url: str, effect: ToolEffect, error: str  # noqa: F811
) -> None:
    """A function tool (read or idempotent_write) raising an error with retry_after_seconds=2 on its
    first attempt, then answering: the call succeeds on CallTool's second attempt, which starts no
    sooner than 2 s after the engine recorded the first one's failure; on a Worker with one slot,
    another session's whole turn runs meanwhile. Catches: the error turned into ToolExecutionError,
    so the call failed at once with the rate limit shown to the model and no retry."""
    calls: list[tuple[int, float]] = []  # (attempt, wall-clock ms) of each run of the tool

    @function_tool(effect=effect, name="fetch_quote")
    async def fetch_quote(symbol: str, context: ToolCallContext) -> str:
        calls.append((context.attempt, time.time() * 1000))
        if context.attempt == 1:
            raise RateLimited(2) if error == "library" else RetryAfterError(2, "quota API: retry in 2 s")
        return f"{symbol}=42"

    flow, _ = scripted_flow(tool_then_answer, tools=[fetch_quote])
    engine = InProcessEngine(tmp_path, [flow], db_url, max_concurrent_tasks=1)
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("a", '/tool fetch_quote {"symbol": "DEX"}')

        async def a_failed() -> list[HistoryEntry]:
            failed = history_of(await engine.client.get_flow_history("a"), "CallTool", "attempt_failed")
            state = (await sessions.get_agent_snapshot("a")).state
            if not failed and state is not None and state.turn_count == 1 and state.active_turn_id is None:
                raise AssertionError(f"the turn ended with no retry of the call: {calls}")
            return failed

        (failed,) = await wait_until("CallTool of a failed once", a_failed)
        await sessions.start_session("b", "hello from b")
        await turns_ended(sessions, "b", 1)
        b_done = history_of(await engine.client.get_flow_history("b"), "RunModel", "execute_completed")
        done = await turns_ended(sessions, "a", 1)
        a_history = await engine.client.get_flow_history("a")
    assert done.messages[-1].text == "results: fetch_quote=DEX=42"
    assert [attempt for attempt, _ in calls] == [1, 2]
    assert calls[1][1] >= failed.at_ms + 2000, "the retry came before the delay the tool's error asked for"
    assert b_done[0].at_ms < calls[1][1], "the other session's turn waited for the slot the waiting retry held"
    assert "no sooner than 2 s from now" in failed.detail
    assert [h.attempt for h in history_of(a_history, "CallTool", "execute_completed")] == [2]


async def test_a_single_attempt_function_tool_asking_retry_after_runs_once(
    tmp_path: Path, db_url: str  # noqa: F811
) -> None:
    """A non_idempotent_write function tool raising an error with retry_after_seconds: its one
    attempt is all (CallSingleAttemptTool): the call records outcome_unknown with no retry, and the tool
    ran once."""
    calls: list[int] = []

    @function_tool(effect=ToolEffect.NON_IDEMPOTENT_WRITE, name="send_payment")
    async def send_payment(amount_cents: int, context: ToolCallContext) -> str:
        calls.append(context.attempt)
        raise RateLimited(2)

    flow, _ = scripted_flow(tool_then_answer, tools=[send_payment])
    engine = InProcessEngine(tmp_path, [flow], db_url)
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("a", '/tool send_payment {"amount_cents": 5}')
        await wait_until("the approval interrupt", lambda: _pending(sessions, "a"))
        (interrupt,) = (await sessions.get_agent_snapshot("a")).pending_interrupts
        await sessions.resolve_interrupt("a", interrupt.interrupt_id, approved=True)
        await turns_ended(sessions, "a", 1)
        events = (await sessions.read_agent_events("a", limit=1000)).events
    finished = [json.loads(e.value.payload)["status"] for e in events if e.value.type == "tool_call_finished"]
    assert finished == [AgentToolCallStatus.OUTCOME_UNKNOWN.value]
    assert calls == [1]


async def _pending(sessions: AgentSessionClient, session_id: str) -> bool:
    return bool((await sessions.get_agent_snapshot(session_id)).pending_interrupts)


class BudgetRunner(ScriptedRunner):
    """The scripted runner, whose tool calls with args `{"delay": seconds}` raise RateLimited(seconds)
    on their first attempt (then answer), under a tool Step retry policy of 3 attempts within 60 s
    (ToolCallStepOptions), as an operation's manifest may set."""

    def __init__(self) -> None:
        super().__init__(None)
        self.attempts: list[int] = []

    def tool_call_step_options(self, call: DeferredToolCall) -> ToolCallStepOptions | None:
        return ToolCallStepOptions(retry=RetryPolicy(max_attempts=3, total_duration_seconds=60))

    async def execute_deferred_tool_call(
        self, call: DeferredToolExecution
    ) -> ToolExecutionResult | ToolInputRequested | ToolTaskStarted:
        args = json.loads(call.tool_call.arguments)
        if "delay" not in args:
            return await super().execute_deferred_tool_call(call)
        self.attempts.append(call.attempt)
        if call.attempt == 1:
            raise RateLimited(args["delay"])
        return ToolExecutionResult("fetched")


@pytest.mark.parametrize(("tool", "status"), [
    ("read_quota", AgentToolCallStatus.FAILED), ("idem_quota", AgentToolCallStatus.OUTCOME_UNKNOWN),
])
async def test_a_retry_after_past_the_tool_steps_budget_ends_the_call_at_once_by_its_effect(
    tmp_path: Path, db_url: str, tool: str, status: AgentToolCallStatus  # noqa: F811
) -> None:
    """A framework runner's tool (read_: read, idem_: idempotent_write) raising an error asking
    3600 s under a CallTool policy of 3 attempts within 60 s: no retry is made, and the call ends at
    once as its effect says (read: failed; idempotent_write: outcome_unknown, the tool having
    started), its error keeping the tool's and naming the asked delay and the budget. Catches: a
    retry an hour later (the turn stuck), or retries after the policy's 1 s and 2 s, which the API
    would refuse again."""
    runner = BudgetRunner()
    flow = AgentSessionFlow(runner, "BudgetAgent", AgentSessionOptions())
    engine = InProcessEngine(tmp_path, [flow], db_url)
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("a", script(
            {"tools": [{"id": "c1", "name": tool, "args": {"delay": 3600}}]}, {"answer": "{records}"}))
        done = await turns_ended(sessions, "a", 1)
    record = json.loads(done.messages[-1].text or "")["c1"]
    assert record["status"] == status.value, record
    assert "429 Too Many Requests, retry after 3600 s" in record["error"]
    assert ("it asked for its retry no sooner than 3600 s from now, past the end of the retry policy's total "
            "duration of 60 s from the first attempt's start, so no retry was made") in record["error"]
    assert runner.attempts == [1]


class HourRunner(BudgetRunner):
    """BudgetRunner under CallTool's default retry policy (no total duration): a tool asking 3600 s
    waits an hour in the database for its second attempt."""

    def tool_call_step_options(self, call: DeferredToolCall) -> ToolCallStepOptions | None:
        return None


@pytest.mark.parametrize("control", ["cancel_turn", "steer"])
@pytest.mark.parametrize(("tool", "status"), [
    ("read_quota", AgentToolCallStatus.FAILED), ("idem_quota", AgentToolCallStatus.OUTCOME_UNKNOWN),
])
async def test_cancel_or_steer_ends_a_tool_call_waiting_to_retry_at_once_without_calling_it_again(
    tmp_path: Path, db_url: str, tool: str, status: AgentToolCallStatus, control: str  # noqa: F811
) -> None:
    """A tool (read_: read, idem_: idempotent_write) whose first attempt asked for its retry in 3600 s,
    on a one-slot Worker: cancel_turn (or a steer) while CallTool waits for that retry ends the turn at
    once, the call recorded by its effect (read: failed; idempotent_write: outcome_unknown, the first
    attempt having started) saying it was cancelled while waiting to retry, the tool never called
    again, and the session takes the next message (the steered one). Catches: the turn ending only
    after the hour, with a second call of the tool after the user cancelled or steered."""
    runner = HourRunner()
    flow = AgentSessionFlow(runner, "HourAgent", AgentSessionOptions())
    engine = InProcessEngine(tmp_path, [flow], db_url, max_concurrent_tasks=1)
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("a", script(
            {"tools": [{"id": "c1", "name": tool, "args": {"delay": 3600}}]}, {"answer": "{records}"}))

        async def waiting_to_retry() -> list[HistoryEntry]:
            return history_of(await engine.client.get_flow_history("a"), "CallTool", "attempt_failed")

        await wait_until("CallTool of a failed once", waiting_to_retry)
        if control == "cancel_turn":
            assert await sessions.cancel_turn("a") is True
            await turns_ended(sessions, "a", 1)
            await sessions.send_user_message("a", script({"answer": "after the control"}))
        else:
            assert await sessions.steer_user_message("a", text=script({"answer": "after the control"})) is True
        done = await turns_ended(sessions, "a", 2)
        events = (await sessions.read_agent_events("a", limit=1000)).events
        history = await engine.client.get_flow_history("a")
    why = ended_by_the_control(control, status, events, history, done)
    assert runner.attempts == [1]
    if status is AgentToolCallStatus.FAILED:  # the model is told why in the ended turn's note
        note = next(m.text or "" for m in done.messages if "after these tool calls ran" in (m.text or ""))
        assert f"cancelled while waiting to retry: {why}" in note, note


class HeldHourRunner(HourRunner):
    """HourRunner whose tool's first attempt is held until the test releases it, then asks 3600 s."""

    def __init__(self) -> None:
        super().__init__()
        self.running = asyncio.Event()
        self.release = asyncio.Event()

    async def execute_deferred_tool_call(
        self, call: DeferredToolExecution
    ) -> ToolExecutionResult | ToolInputRequested | ToolTaskStarted:
        if call.attempt == 1 and "delay" in json.loads(call.tool_call.arguments):
            self.running.set()
            await self.release.wait()
        return await super().execute_deferred_tool_call(call)


@pytest.mark.parametrize("control", ["cancel_turn", "steer"])
@pytest.mark.parametrize(("tool", "status"), [
    ("read_quota", AgentToolCallStatus.FAILED), ("idem_quota", AgentToolCallStatus.OUTCOME_UNKNOWN),
])
async def test_cancel_or_steer_during_a_tool_attempt_that_then_asks_retry_after_ends_the_call_without_the_retry(
    tmp_path: Path, db_url: str, tool: str, status: AgentToolCallStatus, control: str  # noqa: F811
) -> None:
    """cancel_turn (or a steer) commits while CallTool's first attempt is running; the attempt then
    fails asking for its retry in 3600 s. The call ends at that failure as if it had been waiting to
    retry when the control came (read: failed; idempotent_write: outcome_unknown), the turn ends
    cancelled (steered) at once, and the tool is not called again. Catches: the retry scheduled an
    hour out, the cancelled turn active until then and the tool called again after the user
    cancelled, because the control ended only retries already waiting at its commit."""
    runner = HeldHourRunner()
    flow = AgentSessionFlow(runner, "HeldHourAgent", AgentSessionOptions())
    engine = InProcessEngine(tmp_path, [flow], db_url)
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("a", script(
            {"tools": [{"id": "c1", "name": tool, "args": {"delay": 3600}}]}, {"answer": "{records}"}))
        await asyncio.wait_for(runner.running.wait(), 30)
        if control == "cancel_turn":
            assert await sessions.cancel_turn("a") is True
        else:
            assert await sessions.steer_user_message("a", text=script({"answer": "after the control"})) is True
        runner.release.set()

        async def turn_ended() -> bool:
            history = await engine.client.get_flow_history("a")
            retry = [h for h in history_of(history, "CallTool", "attempt_failed") if "next attempt is due" in h.detail]
            state = (await sessions.get_agent_snapshot("a")).state
            ended = state is not None and state.turn_count >= 1 and (
                (control == "cancel_turn" and state.active_turn_id is None) or state.turn_count == 2)
            if retry and not ended:
                raise AssertionError(f"the {control} turn waits for a retry: {retry[0].detail}")
            return ended

        await wait_until(f"the {control} turn to end", turn_ended)
        if control == "cancel_turn":
            await sessions.send_user_message("a", script({"answer": "after the control"}))
        done = await turns_ended(sessions, "a", 2)
        events = (await sessions.read_agent_events("a", limit=1000)).events
        history = await engine.client.get_flow_history("a")
    ended_by_the_control(control, status, events, history, done)
    assert runner.attempts == [1]


async def test_cancel_during_a_function_tool_that_then_asks_retry_after_ends_the_turn_without_the_retry(
    tmp_path: Path, db_url: str  # noqa: F811
) -> None:
    """The built-in loop's read function tool, running when cancel_turn commits, then raising
    RetryAfterError(3600): the turn ends cancelled at once, the call failed saying it was cancelled
    while waiting to retry, and the tool ran once. Catches: the cancelled turn held an hour for the
    retry, which called the tool again."""
    calls: list[int] = []
    running, release = asyncio.Event(), asyncio.Event()

    @function_tool(effect=ToolEffect.READ, name="fetch_quote")
    async def fetch_quote(symbol: str, context: ToolCallContext) -> str:
        calls.append(context.attempt)
        running.set()
        await release.wait()
        raise RetryAfterError(3600, "quota API: retry in an hour")

    flow, _ = scripted_flow(tool_then_answer, tools=[fetch_quote])
    engine = InProcessEngine(tmp_path, [flow], db_url)
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("a", '/tool fetch_quote {"symbol": "DEX"}')
        await asyncio.wait_for(running.wait(), 30)
        assert await sessions.cancel_turn("a") is True
        release.set()

        async def cancelled() -> bool:
            retry = [h for h in history_of(await engine.client.get_flow_history("a"), "CallTool", "attempt_failed")
                     if "next attempt is due" in h.detail]
            state = (await sessions.get_agent_snapshot("a")).state
            ended = state is not None and state.turn_count == 1 and state.active_turn_id is None
            if retry and not ended:
                raise AssertionError(f"the cancelled turn waits for a retry: {retry[0].detail}")
            return ended

        await wait_until("the cancelled turn to end", cancelled)
        events = (await sessions.read_agent_events("a", limit=1000)).events
        history = await engine.client.get_flow_history("a")
    finished = [json.loads(e.value.payload) for e in events if e.value.type == "tool_call_finished"]
    assert [f["status"] for f in finished] == [AgentToolCallStatus.FAILED.value], finished
    (ended,) = history_of(history, "CallTool", "step_failed")
    assert "cancelled while waiting to retry: the user cancelled the turn" in ended.detail, ended
    assert [e.value.type for e in events if e.value.type in ("turn_cancelled", "turn_completed")] == ["turn_cancelled"]
    assert calls == [1]
