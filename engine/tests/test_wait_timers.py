"""Timer bookkeeping of waits: the timer index follows the next pending timer (E5, E6)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from dex_engine import (
    Channel,
    Context,
    Flow,
    Movement,
    RetryPolicy,
    Step,
    StepDecision,
    StepOptions,
    Timer,
    Wait,
    open_store,
)
from dex_engine import _transitions as tx
from dex_engine._options import FlowConfig
from dex_engine._records import DecisionRecord, StartRequest, WriteSet
from dex_engine._scheduling import movement_record, start_record

from .conftest import statements_during

Inbox = Channel("Inbox", str)


async def _both_timers(ctx: Context, _: Any) -> Wait:
    return Wait.all_of(Timer.by_duration(1), Timer.by_duration(3))


async def _done(ctx: Context, _: Any) -> StepDecision:
    return StepDecision.graceful_complete()


FLOW = Flow("Timers", [Step("Both", _done, wait_for=_both_timers)], start_step="Both")


async def test_all_of_two_timers_moves_the_due_time_to_the_second(tmp_path: Path) -> None:
    """After the 1 s timer of all_of(1 s, 3 s) fires, the wait's due time becomes the 3 s timer's,
    it is not satisfied before that, and it is satisfied at it. Breaks if the due time stays on the
    fired timer (housekeeping then re-evaluates the wait forever) or if all_of fires on one timer."""
    store = open_store(f"sqlite:///{tmp_path / 't.db'}")
    try:
        await store.register_worker("w", "h", 1, 3_600_000)
        await store.start_flow(StartRequest("t1", "Timers", b"null", FlowConfig(), start_record(FLOW, None)))
        (lease,) = await store.claim("w", ["Timers"], 1)
        spec = Wait.all_of(Timer.by_duration(1), Timer.by_duration(3)).spec()
        await store.commit_wait_for(lease, WriteSet(), spec)

        def registered(db: tx.Db) -> tuple[int, int]:
            row = db.one("SELECT wait_registered_at, timer_due_at FROM tasks WHERE flow_id = 't1'")
            assert row is not None
            return int(row[0]), int(row[1])

        base, due = await store.raw(registered)
        assert due == base + 1000
        report = await store.raw(lambda db: tx.housekeeping(db, base + 1500), write=True)
        assert report.timers_fired == 0
        _, due = await store.raw(registered)
        assert due == base + 3000
        report = await store.raw(lambda db: tx.housekeeping(db, base + 2999), write=True)
        assert report.timers_fired == 0
        report = await store.raw(lambda db: tx.housekeeping(db, base + 3000), write=True)
        assert report.timers_fired == 1
        (lease,) = await store.raw(lambda db: tx.claim(db, "w", ["Timers"], 1, base + 3000), write=True)
        assert lease.method == "execute"
        assert lease.wait_outcome is not None and lease.wait_outcome.fired_timers == (0, 1)
    finally:
        await store.close()


async def _first(ctx: Context, _: Any) -> StepDecision:
    return StepDecision.go_to("Both")


AHEAD = Flow("Ahead", [Step("First", _first), Step("Both", _done, wait_for=_both_timers)], start_step="First")


@pytest.mark.parametrize(("wait", "due_after_ms"), [
    (Wait.any_of(Timer.by_duration(3), Timer.by_duration(1)), 1000),
    (Wait.all_of(Timer.by_duration(2)), 2000),
    (Wait.until(Inbox.for_one()), None),
])
async def test_a_wait_registered_with_the_commit_that_moves_to_it_is_due_at_its_first_timer(
    tmp_path: Path, wait: Wait, due_after_ms: int | None
) -> None:
    """A movement whose WaitFor already ran (MovementRecord.wait) is registered by the commit that
    makes it, as its own commit would register it: waiting at attempt 1, due at its earliest timer
    (in whole milliseconds), or with no due time when it has none, written once with its row.
    Catches: the due time of such a wait taken from the wrong timer, scaled wrongly, or left out
    (the flow's wait evaluation would put it right, at one more statement a commit)."""
    store = open_store(f"sqlite:///{tmp_path / 'ahead.db'}")
    try:
        await store.register_worker("w", "h", 1, 3_600_000)
        await store.start_flow(StartRequest("a", "Ahead", b"null", FlowConfig(), start_record(AHEAD, None)))
        (lease,) = await store.claim("w", ["Ahead"], 1)
        moved = msgspec.structs.replace(movement_record(AHEAD, Movement("Both")), wait=wait.spec())
        statements = await statements_during(store, lambda: store.commit_execute(
            lease, WriteSet(), DecisionRecord(kind="movements", movements=(moved,))))
        # Its due time is written with the row: evaluating the flow's waits after finds it right.
        assert not [s for s in statements if "SET timer_due_at" in s], statements
        row = await store.raw(lambda db: db.one(
            "SELECT state, attempt, wait_registered_at, timer_due_at FROM tasks WHERE flow_id = 'a'"))
        assert row is not None
        state, attempt, registered_at, due = row
        assert (state, attempt) == ("waiting", 1)
        assert due == (None if due_after_ms is None else registered_at + due_after_ms)
        events = [(h.step_execution_id, h.event_type, h.attempt) for h in await store.history("a")]
        assert events[-2:] == [("Both-1", "step_scheduled", 0), ("Both-1", "wait_registered", 1)]
    finally:
        await store.close()


@pytest.mark.parametrize("beat", [False, True], ids=["claimed", "heartbeat"])
@pytest.mark.parametrize(("execute_timeout", "heartbeat_timeout", "kind"), [
    (60, 1, "HeartbeatTimeout"),
    (1, 60, "MethodTimeout"),
])
async def test_an_attempt_is_timed_out_at_the_earlier_of_its_deadlines(
    tmp_path: Path, execute_timeout: int, heartbeat_timeout: int, kind: str, beat: bool
) -> None:
    """An attempt with both a method timeout and a heartbeat timeout is failed at whichever comes
    first, named for it; not a millisecond before; also after a heartbeat (half a second in), which
    moves the heartbeat deadline but never past the method's. Catches: a deadline taken from the
    later of the two (a silent handler would then run on until its method timeout), at the claim or
    at a heartbeat."""
    options = StepOptions(execute_timeout_seconds=execute_timeout, heartbeat_timeout_seconds=heartbeat_timeout,
                          execute_retry=RetryPolicy(max_attempts=1))
    flow = Flow("Slow", [Step("Work", _done, options=options)], start_step="Work")
    store = open_store(f"sqlite:///{tmp_path / 'slow.db'}")
    try:
        await store.register_worker("w", "h", 1, 3_600_000)
        await store.start_flow(StartRequest("s", "Slow", b"null", FlowConfig(), start_record(flow, None)))
        (lease,) = await store.claim("w", ["Slow"], 1)
        row = await store.raw(lambda db: db.one("SELECT claimed_at FROM tasks WHERE flow_id = 's'"))
        assert row is not None
        first = int(row[0]) + 1000
        if beat:
            beat_at = int(row[0]) + 500
            await store.raw(lambda db: tx.heartbeat(db, lease, None, beat_at), write=True)
            first = beat_at + 1000 if kind == "HeartbeatTimeout" else first
        report = await store.raw(lambda db: tx.housekeeping(db, first - 1), write=True)
        assert report.timeouts == 0
        report = await store.raw(lambda db: tx.housekeeping(db, first + 1), write=True)
        assert report.timeouts == 1
        failed = [h.detail for h in await store.history("s") if h.event_type in ("attempt_failed", "step_failed")]
        assert failed and all(kind in detail for detail in failed), failed
    finally:
        await store.close()
