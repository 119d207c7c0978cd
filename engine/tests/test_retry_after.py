"""E4: a handler's error that asks for its retry no sooner than a delay (RetryAfterError, or any
exception with a `retry_after_seconds` attribute, such as a provider's rate limit with Retry-After).

The retry waits in the database like any retry's backoff (the worker is free meanwhile), for the
longer of the asked delay and the policy's interval, within the policy's total duration. Times
asserted are recorded ones (history, task rows, what handlers saw) and only as lower bounds or exact
arithmetic of recorded values.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

import pytest

from dex_engine import (
    Context,
    InvalidValueError,
    Registry,
    RetryAfterError,
    RetryPolicy,
    RpcContext,
    RPCResult,
    Step,
    StepDecision,
    StepOptions,
    rpc,
)
from dex_engine._limits import MAX_RETRY_AFTER_SECONDS
from dex_engine._records import AttemptProgress, ErrorInfo, RecoveryError
from dex_engine._retry import asked_delay

from .conftest import engine_for, wait_until
from .test_rules_e01_e08 import claim_one, dead_end, history, make_flow, task_row


class ProviderBusy(Exception):
    """A library's own error that carries the attribute (as LiteLLMModelClient sets it on a 429)."""

    def __init__(self, retry_after_seconds: object) -> None:
        super().__init__("the provider is busy")
        self.retry_after_seconds = retry_after_seconds


async def complete(ctx: Context, _: None) -> StepDecision:
    return StepDecision.graceful_complete()


@pytest.mark.parametrize("raised", ["RetryAfterError", "ProviderBusy"])
async def test_e4_a_retry_after_error_delays_the_retry_and_holds_no_worker(db_url: str, raised: str) -> None:
    """An attempt that raises RetryAfterError(1.0) (or an error of its own type with
    retry_after_seconds=1.0), under a policy whose interval is 50 ms, is tried again no sooner than
    1 s after its failure; the attempt-failed history names the asked delay, the error's own type is
    kept; and a worker with a single slot runs another flow's Step meanwhile.

    Catches: the asked delay ignored (the retry after 50 ms, as a provider's 429 with Retry-After
    failed a turn in 3 s), or honoured by sleeping inside the attempt (the slot held, the other
    flow's Step run only after it)."""
    starts: list[tuple[int, int]] = []

    async def work(ctx: Context, _: None) -> StepDecision:
        starts.append((ctx.attempt, int(time.time() * 1000)))
        if ctx.attempt == 1:
            raise RetryAfterError(1.0, "slow down") if raised == "RetryAfterError" else ProviderBusy(1.0)
        return StepDecision.graceful_complete()

    policy = RetryPolicy(max_attempts=3, initial_interval_seconds=0.05, total_duration_seconds=60)
    flows = [make_flow("Asks", [Step("Work", work, options=StepOptions(execute_retry=policy))], "Work"),
             make_flow("Other", [Step("Quick", complete)], "Quick")]
    async with engine_for(db_url, Registry(flows), worker=False) as eng:
        await eng.start_worker(max_concurrent_tasks=1)
        await eng.client.start_flow("Asks", "f")
        (failed,) = await wait_until("attempt 1 failed", lambda: history(eng, "f", "attempt_failed"))
        await eng.client.start_flow("Other", "g")
        assert (await eng.client.wait_for_flow("g", 10)).status == "completed"
        other_done = (await history(eng, "g", "execute_completed"))[0].at_ms
        assert (await eng.client.wait_for_flow("f", 10)).status == "completed"
    assert [a for a, _ in starts] == [1, 2]
    assert starts[1][1] >= failed.at_ms + 1000, "the retry started before the delay the error asked for"
    assert other_done < starts[1][1], "the other flow's Step waited for the slot the waiting retry held"
    assert failed.detail.startswith(f"execute: {raised}: ")
    assert "it asked for its retry no sooner than 1 s from now: the next attempt is due in 1 s" in failed.detail


async def test_e4_a_retry_after_past_the_total_duration_fails_at_once_naming_it(db_url: str) -> None:
    """An attempt asking for 60 s under a policy of 3 attempts within 5 s fails the Step at once,
    the flow's error and the failure route's recovery error naming the asked delay and the total
    duration, the error's own type and text kept. Catches: a retry scheduled past the policy's
    budget (waiting a minute for a retry the policy does not allow), or a failure that says only
    the provider's error, where the policy would have allowed a retry after its own interval."""

    async def work(ctx: Context, _: None) -> StepDecision:
        raise RetryAfterError(60, "rate limited for a minute")

    policy = RetryPolicy(max_attempts=3, initial_interval_seconds=0.05, total_duration_seconds=5)
    flow = make_flow("Budget", [Step("Work", work, options=StepOptions(execute_retry=policy))], "Work")
    async with engine_for(db_url, Registry([flow])) as eng:
        await eng.client.start_flow("Budget", "f")
        info = await eng.client.wait_for_flow("f", 10)
        failed = await history(eng, "f", "attempt_failed")
    assert info.status == "failed" and info.error is not None
    assert [h.attempt for h in failed] == [1]
    assert "after 1 attempt(s): RetryAfterError: rate limited for a minute" in info.error
    assert ("it asked for its retry no sooner than 60 s from now, past the end of the retry policy's total "
            "duration of 5 s from the first attempt's start, so no retry was made") in info.error


async def test_e4_an_unusable_retry_after_falls_back_to_the_policy(
    db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """retry_after_seconds of -1, NaN, "soon" or True (not a number of seconds >= 0), or a property
    that raises, is said in the attempt's history and a warning, and the policy's 50 ms interval
    applies. Catches: a TypeError or ValueError that left the failure unrecorded (the attempt handed
    back and run again), a NaN or negative run time, or a bad value taken silently."""
    bad: list[object] = [-1, math.nan, "soon", True]

    class Unreadable(Exception):
        @property
        def retry_after_seconds(self) -> float:
            raise RuntimeError("no headers")

    async def work(ctx: Context, _: None) -> StepDecision:
        if ctx.attempt <= len(bad):
            raise ProviderBusy(bad[ctx.attempt - 1])
        if ctx.attempt == len(bad) + 1:
            raise Unreadable("busy")
        return StepDecision.graceful_complete()

    policy = RetryPolicy(max_attempts=len(bad) + 2, initial_interval_seconds=0.05, backoff_coefficient=1.0)
    flow = make_flow("Bad", [Step("Work", work, options=StepOptions(execute_retry=policy))], "Work")
    with caplog.at_level(logging.WARNING, logger="dex_engine.worker"):
        async with engine_for(db_url, Registry([flow])) as eng:
            await eng.client.start_flow("Bad", "f")
            assert (await eng.client.wait_for_flow("f", 10)).status == "completed"
            failed = await history(eng, "f", "attempt_failed")
    assert len(failed) == len(bad) + 1
    for entry, value in zip(failed, ["-1", "nan", "'soon'", "True"], strict=False):
        assert (f"its retry_after_seconds, {value}, is not a number of seconds >= 0, so the retry policy's "
                "interval applies") in entry.detail, entry.detail
    assert "its retry_after_seconds could not be read (RuntimeError)" in failed[-1].detail
    warned = [r.getMessage() for r in caplog.records if "retry_after_seconds" in r.getMessage()]
    assert len(warned) == len(bad) + 1 and "flow f: execute of Work-1 (attempt 1) raised ProviderBusy" in warned[0]


async def test_e4_the_retry_runs_at_the_longer_of_the_asked_delay_and_the_interval(db_url: str) -> None:
    """Driven by hand through the store, so scheduled times are exact: asked 2.5 s against a 1 s
    interval is due 2,500 ms after the failure; asked 0.2 s against a 2 s interval, 2,000 ms; asked
    an infinity or 10**30 s, MAX_RETRY_AFTER_SECONDS after it (capped, and said so). Catches: the
    interval added to the asked delay, a shorter ask cutting the policy's backoff, or an absurd ask
    overflowing the run time."""
    policy = RetryPolicy(max_attempts=5, initial_interval_seconds=1.0, backoff_coefficient=2.0,
                         max_interval_seconds=60.0)
    flow = make_flow("Exact", [Step("Work", dead_end, options=StepOptions(execute_retry=policy))], "Work")
    asks: list[tuple[Any, int]] = [(2.5, 2500), (0.2, 2000), (math.inf, MAX_RETRY_AFTER_SECONDS * 1000),
                                   (10**30, MAX_RETRY_AFTER_SECONDS * 1000)]
    async with engine_for(db_url, Registry([flow]), worker=False) as eng:
        await eng.client.start_flow("Exact", "f")
        await eng.store.register_worker("w", "test-host", 1, 600_000)
        for attempt, (value, gap) in enumerate(asks, start=1):
            lease = await wait_until(f"attempt {attempt} claimable", lambda: claim_one(eng, "w", "Exact"))
            assert lease.attempt == attempt
            await eng.store.fail_attempt(lease, ErrorInfo("Busy", "slow down"), asked=asked_delay(ProviderBusy(value)))
            failed = (await history(eng, "f", "attempt_failed"))[-1]
            row = await task_row(eng, lease.task_id)
            assert row is not None and row[:2] == ("ready", attempt + 1)
            assert int(row[2]) - failed.at_ms == gap
            if gap == MAX_RETRY_AFTER_SECONDS * 1000:
                assert f"capped at MAX_RETRY_AFTER_SECONDS ({MAX_RETRY_AFTER_SECONDS} s)" in failed.detail
            await eng.store.raw(lambda db: db.run("UPDATE tasks SET run_at = 0"), write=True)  # due now


async def test_an_rpc_ends_a_waiting_retry_through_its_failure_route_and_leaves_a_running_attempt(
    db_url: str,
) -> None:
    """RPCResult(ending_retry_waits=...): Work, whose first attempt asked for its retry in 3600 s, is
    ended at the RPC's commit, its failure route receiving the reason and its last error with the
    attempts made; Busy, of a type also named, is running then and is left to finish. Catches: the
    retry run after the ending (the handler called twice), the wait left an hour, or a running
    attempt cancelled or failed."""
    ran: list[tuple[str, int]] = []
    recovered: list[RecoveryError | None] = []
    release = asyncio.Event()

    async def start(ctx: Context, _: None) -> StepDecision:
        return StepDecision.go_to_many(("Work", None), ("Busy", None))

    async def work(ctx: Context, _: None) -> StepDecision:
        ran.append(("Work", ctx.attempt))
        await ctx.heartbeat()
        raise RetryAfterError(3600, "quota exhausted")

    async def busy(ctx: Context, _: None) -> StepDecision:
        ran.append(("Busy", ctx.attempt))
        await ctx.heartbeat()
        await release.wait()
        return StepDecision.dead_end()

    async def rescue(ctx: Context, _: None) -> StepDecision:
        recovered.append(ctx.recovery_error)
        return StepDecision.graceful_complete()

    @rpc()
    async def stop_waits(ctx: RpcContext, _: None) -> RPCResult[str]:
        return RPCResult("ok", ending_retry_waits=("Work", "Busy"), ending_reason="stopped by the user")

    routed = StepOptions(failure_route="Rescue")
    flow = make_flow("Ends", [Step("Start", start), Step("Work", work, options=routed),
                              Step("Busy", busy, options=routed), Step("Rescue", rescue)], "Start", [stop_waits])
    async with engine_for(db_url, Registry([flow]), worker=False) as eng:
        await eng.start_worker(max_concurrent_tasks=2)
        await eng.client.start_flow("Ends", "f")
        await wait_until("Work's attempt 1 failed", lambda: history(eng, "f", "attempt_failed"))
        await wait_until("Busy running", lambda: _sync(("Busy", 1) in ran))
        assert await eng.client.rpc("f", "stop_waits") == "ok"
        await wait_until("the failure route ran", lambda: _sync(recovered))
        release.set()
        assert (await eng.client.wait_for_flow("f", 10)).status == "completed"
        failed = await history(eng, "f", "step_failed")
    assert ran == [("Work", 1), ("Busy", 1)]
    (err,) = recovered
    assert err is not None
    assert (err.step_type, err.attempts, err.attempt_progress) == ("Work", 1, AttemptProgress.NOT_COMPLETED)
    assert err.error_type == "RetryAfterError"
    assert err.detail.startswith("stopped by the user; its last attempt failed: RetryAfterError: quota exhausted")
    assert [h.step_execution_id for h in failed] == ["Work-1"]


async def test_an_rpc_ending_retries_ends_an_attempt_running_at_its_commit_when_it_then_fails(
    db_url: str,
) -> None:
    """RPCResult(ending_retry_waits=...) while Work's first attempt runs; that attempt then raises
    RetryAfterError(3600): the execution ends at that failure through its failure route, with the
    reason and its error, instead of a retry an hour later; a Work execution started after the RPC
    retries as its policy says. Catches: the ending reaching only retries already waiting at the
    commit (the flow stuck an hour, the handler called again after it was ended), or sticking to
    later executions of the Step type."""
    ran: list[tuple[int, int]] = []  # (round, attempt)
    recovered: list[RecoveryError | None] = []
    release = asyncio.Event()

    async def start(ctx: Context, _: None) -> StepDecision:
        return StepDecision.go_to("Work", 1)

    async def work(ctx: Context, round_: int) -> StepDecision:
        ran.append((round_, ctx.attempt))
        await ctx.heartbeat()
        if round_ == 1:
            await release.wait()
            raise RetryAfterError(3600, "quota exhausted")
        if ctx.attempt == 1:
            raise RuntimeError("transient")
        return StepDecision.graceful_complete()

    async def rescue(ctx: Context, _: int) -> StepDecision:
        recovered.append(ctx.recovery_error)
        return StepDecision.go_to("Work", 2)

    @rpc()
    async def stop_waits(ctx: RpcContext, _: None) -> RPCResult[str]:
        return RPCResult("ok", ending_retry_waits=("Work",), ending_reason="stopped by the user")

    fast = RetryPolicy(max_attempts=3, initial_interval_seconds=0.01)
    flow = make_flow("EndsRunning", [
        Step("Start", start), Step("Work", work, options=StepOptions(failure_route="Rescue", execute_retry=fast)),
        Step("Rescue", rescue)], "Start", [stop_waits])
    async with engine_for(db_url, Registry([flow])) as eng:
        await eng.client.start_flow("EndsRunning", "f")
        await wait_until("Work running", lambda: _sync((1, 1) in ran))
        assert await eng.client.rpc("f", "stop_waits") == "ok"
        release.set()
        assert (await eng.client.wait_for_flow("f", 10)).status == "completed"
        attempts = await history(eng, "f", "attempt_failed")
    assert ran == [(1, 1), (2, 1), (2, 2)]
    (err,) = recovered
    assert err is not None
    assert (err.step_type, err.attempts, err.attempt_progress) == ("Work", 1, AttemptProgress.NOT_COMPLETED)
    assert err.error_type == "RetryAfterError"
    assert err.detail.startswith("stopped by the user; its last attempt failed: RetryAfterError: quota exhausted")
    assert "next attempt is due" not in attempts[0].detail, attempts[0]


def test_rpc_result_refuses_an_ending_reason_that_is_not_text() -> None:
    with pytest.raises(InvalidValueError, match="ending_reason must be a str, got int: 5"):
        RPCResult("out", ending_retry_waits=("Work",), ending_reason=5)  # type: ignore[arg-type]


async def _sync(value: object) -> object:
    return value
