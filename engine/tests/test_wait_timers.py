"""Timer bookkeeping of waits: the timer index follows the next pending timer (E5, E6)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dex_engine import Context, Flow, Step, StepDecision, Timer, Wait, open_store
from dex_engine import _transitions as tx
from dex_engine._options import FlowConfig
from dex_engine._records import StartRequest, WriteSet
from dex_engine._scheduling import start_record


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
