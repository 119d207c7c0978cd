"""Worker and store behaviour outside the numbered rules: failed attempts' events, skip_timer's target."""

from __future__ import annotations

from typing import Any

import pytest

from dex_engine import (
    Channel,
    Context,
    Flow,
    FlowConfig,
    Movement,
    Registry,
    RetryPolicy,
    Step,
    StepDecision,
    StepNotWaitingError,
    StepOptions,
    Stream,
    Wait,
)
from dex_engine._records import StartRequest
from dex_engine._scheduling import movement_record

from .conftest import engine_for, wait_until

Log = Stream("Log", str)
Inbox = Channel("Inbox", str)


async def _write_then_fail(ctx: Context, _: Any) -> StepDecision:
    ctx.write_event(Log, f"partial output of attempt {ctx.attempt}")
    if ctx.attempt == 1:
        raise RuntimeError("model call failed")
    return StepDecision.graceful_complete()


async def _wait_inbox(ctx: Context, _: Any) -> Wait:
    return Wait.until(Inbox.for_one())


async def _done(ctx: Context, _: Any) -> StepDecision:
    return StepDecision.graceful_complete()


FLOW = Flow(
    "Behaviour",
    [
        Step("Flaky", _write_then_fail,
             options=StepOptions(execute_retry=RetryPolicy(max_attempts=2, initial_interval_seconds=0.01))),
        Step("Listen", _done, wait_for=_wait_inbox),
    ],
    start_step="Flaky",
    schema=[Log, Inbox],
)


async def test_events_of_a_failed_attempt_are_kept(db_url: str) -> None:
    """Best-effort events written before a handler raised reach readers, tagged with their attempt
    (a UI shows a failed attempt's partial output, then replaces it by the next attempt's)."""
    async with engine_for(db_url, Registry([FLOW])) as eng:
        await eng.client.start_flow("Behaviour", "f1")
        assert (await eng.client.wait_for_flow("f1", 10)).status == "completed"
        read = await eng.client.read_stream("f1", Log)
        assert [(e.step_execution_id, e.attempt, e.value) for e in read.events] == [
            ("Flaky-1", 1, "partial output of attempt 1"),
            ("Flaky-1", 2, "partial output of attempt 2"),
        ]


async def test_skip_timer_refuses_a_wait_without_a_timer(db_url: str) -> None:
    """skip_timer on a Step waiting only on channels names the problem and changes nothing."""
    async with engine_for(db_url, Registry([FLOW])) as eng:
        # Start the flow directly in its Listen Step, which waits on a channel only.
        start = movement_record(FLOW, Movement("Listen", None))
        await eng.store.start_flow(StartRequest("f2", "Behaviour", b"null", FlowConfig(), start))

        async def waiting() -> bool:
            info = await eng.client.describe_flow("f2")
            return any(s.state == "waiting" for s in info.active_steps)

        await wait_until("Listen waiting", waiting)
        before = await eng.client.get_flow_history("f2")
        with pytest.raises(StepNotWaitingError, match="waiting on a timer 'Listen-1'"):
            await eng.client.skip_timer("f2", "Listen-1")
        assert await eng.client.get_flow_history("f2") == before
        with pytest.raises(StepNotWaitingError, match="'Nope-1'"):
            await eng.client.skip_timer("f2", "Nope-1")
