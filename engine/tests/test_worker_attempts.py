"""A worker's hold on the attempts it runs: nothing it does on its own side may let a started
attempt run twice, nor end one the engine did not take away.

- a stopping worker keeps its lease through the drain (a lapsed lease lets another worker fail the
  draining attempt as lost and run it again, while it still runs);
- a poll reply that comes back late revokes only the attempt it watched, never the task's next one;
- a handler's own CancelledError, inside a fold or in a usual attempt, is a failure of that
  attempt, not a cancellation of the commit or the attempt;
- every attempt starts in the worker's context variables, never in the committing handler's;
- an attempt revoked before its task first ran still frees its slot.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import Any

import pytest

from dex_engine import (
    AsyncWorker,
    Attribute,
    Channel,
    Context,
    Flow,
    Registry,
    RetryPolicy,
    Step,
    StepDecision,
    StepOptions,
    Store,
    Stream,
    Timer,
    Wait,
    WorkerOptions,
    _gates,
    open_store,
)
from dex_engine._limits import MAX_WORKER_ERRORS_PER_ATTEMPT, RENEW_RETRY_SECONDS
from dex_engine._records import HousekeepingReport
from dex_engine._store import LOST_CLAIM_MS

from .conftest import FAST, Engine, assert_paced, engine_for, history_has, wait_until
from .odd_values import UNSHOWABLE_SHOWN, Unshowable
from .test_pure_execute import TRIES, called_from, quiet_engine

QUICK_RETRY = StepOptions(execute_retry=RetryPolicy(max_attempts=4, initial_interval_seconds=0.01,
                                                    max_interval_seconds=0.01))
TOOL_SECONDS = 2.0  # longer than the stopping worker's lease, shorter than its grace
Inbox = Channel("Inbox", str)


def failures(history: list[Any]) -> list[tuple[str, int, str]]:
    return [(h.step_execution_id, h.attempt, h.detail) for h in history if h.event_type == "attempt_failed"]


async def test_a_stopping_worker_keeps_its_lease_while_started_attempts_finish(db_url: str) -> None:
    runs: list[tuple[int, str]] = []

    async def tool(ctx: Context, _: None) -> StepDecision:
        await ctx.heartbeat("started")  # from here on a retry would run the tool again
        runs.append((ctx.attempt, "start"))
        await asyncio.sleep(TOOL_SECONDS)
        runs.append((ctx.attempt, "end"))
        return StepDecision.graceful_complete(f"attempt {ctx.attempt}")

    registry = Registry([Flow("Drain", [Step("Tool", tool, options=QUICK_RETRY)], start_step="Tool")])
    async with engine_for(db_url, registry, worker=False) as eng:
        # A lease of 1 s, renewed every 0.25 s; stop() lets started attempts run for up to 5 s.
        stopping = await eng.start_worker(worker_id="stopping", shutdown_grace_seconds=5.0)
        await eng.client.start_flow("Drain", "d")
        await wait_until("the tool to start", lambda: asyncio.sleep(0, runs))
        other = await eng.start_worker(worker_id="other")  # housekeeps every 0.1 s
        try:
            await stopping.stop()
            info = await eng.client.wait_for_flow("d", 10)
        finally:
            await other.stop()
        assert info.status == "completed"
        assert await eng.client.flow_output("d") == "attempt 1"
        assert runs == [(1, "start"), (1, "end")]
        assert failures(await eng.client.get_flow_history("d")) == []


async def test_cancelling_a_workers_run_task_stops_it_as_stop_does(db_url: str) -> None:
    """A worker whose run() task is cancelled (a supervisor's task group, a Ctrl-C in an app that
    runs it as a task) stops as stop() does: the started attempt finishes within the grace and
    commits, the worker leaves no row behind, and run() ends cancelled. Catches: the attempt
    cancelled with the loop and failed as a lost one after the lease ran out, then run again."""
    runs: list[str] = []

    async def tool(ctx: Context, _: None) -> StepDecision:
        await ctx.heartbeat("started")
        runs.append("start")
        await asyncio.sleep(0.5)
        runs.append("end")
        return StepDecision.graceful_complete("done")

    registry = Registry([Flow("CancelledRun", [Step("Tool", tool, options=QUICK_RETRY)], start_step="Tool")])
    async with engine_for(db_url, registry, worker=False) as eng:
        worker = AsyncWorker(registry, WorkerOptions(database_url=db_url, shutdown_grace_seconds=10.0), store=eng.store)
        run = asyncio.create_task(worker.run())
        await eng.client.start_flow("CancelledRun", "c")
        await wait_until("the attempt to start", lambda: asyncio.sleep(0, runs))
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
        assert runs == ["start", "end"]
        assert await eng.store.raw(lambda db: db.all("SELECT worker_id FROM workers")) == []
        assert (await eng.client.describe_flow("c")).status == "completed"
        assert failures(await eng.client.get_flow_history("c")) == []

@pytest.mark.parametrize("handler", ["stops", "returns anyway"])
async def test_a_stopping_worker_cancels_what_outlasts_its_grace_and_the_attempt_runs_again(
    db_url: str, handler: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """stop() waits shutdown_grace_seconds for started attempts, then cancels their handlers and
    returns: a handler that never ends must not keep the worker from stopping. Its attempt, started,
    fails as this worker's lost attempt (E3) and runs again on the next worker. The history says the
    worker stopped past its grace, not that it died, and the worker warns naming the attempt and
    the setting to change: an operator's SIGTERM must not read as a crash. A handler that catches
    the cancellation and returns a result anyway (a broad `except BaseException`) gets nothing in:
    its attempt was revoked, though it still owns its task in the database. Catches a revoke that
    cancels the handler but does not mark the attempt revoked, so the worker commits what it returns."""
    log: list[str] = []

    async def tool(ctx: Context, _: None) -> StepDecision:
        await ctx.heartbeat("started")
        log.append(f"attempt {ctx.attempt} runs")
        if ctx.attempt == 1:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                log.append("attempt 1 cancelled")
                if handler == "stops":
                    raise
        return StepDecision.graceful_complete(f"attempt {ctx.attempt}")

    registry = Registry([Flow("Outlast", [Step("Tool", tool, options=QUICK_RETRY)], start_step="Tool")])
    async with engine_for(db_url, registry, worker=False) as eng:
        stopping = await eng.start_worker(shutdown_grace_seconds=0.3)
        await eng.client.start_flow("Outlast", "o")
        await wait_until("attempt 1 to run", lambda: asyncio.sleep(0, log))
        await asyncio.wait_for(stopping.stop(), 10)
        assert log == ["attempt 1 runs", "attempt 1 cancelled"], log
        assert (await eng.client.describe_flow("o")).status == "running"
        await eng.start_worker()
        info = await eng.client.wait_for_flow("o", 10)
        assert info.status == "completed", info
        assert await eng.client.flow_output("o") == "attempt 2"
        assert failures(await eng.client.get_flow_history("o")) == [
            ("Tool-1", 1, "execute: WorkerLost: the worker running the attempt stopped before the attempt ended "
                          "(its shutdown_grace_seconds ran out)")]
    warnings = [r.getMessage() for r in caplog.records if r.name == "dex_engine.worker" and r.levelname == "WARNING"]
    assert any("shutdown_grace_seconds (0.3 s) with 1 attempts still running" in w and "o/Tool-1 attempt 1" in w
               for w in warnings), warnings


@pytest.mark.sqlite_only  # the retry must reach the worker through a client's commit while the poll is out
async def test_a_late_poll_reply_does_not_revoke_the_next_attempt_of_the_task(db_url: str) -> None:
    log: list[str] = []

    async def tool(ctx: Context, _: None) -> StepDecision:
        await ctx.heartbeat()
        if ctx.attempt == 1:
            await asyncio.sleep(0.3)
            raise RuntimeError("attempt 1 fails")
        log.append(f"attempt {ctx.attempt} starts the tool")
        try:
            await asyncio.sleep(1.0)
        except asyncio.CancelledError:
            log.append(f"attempt {ctx.attempt} cancelled")
            raise
        return StepDecision.graceful_complete(f"attempt {ctx.attempt}")

    async def noop(ctx: Context, _: None) -> StepDecision:
        return StepDecision.graceful_complete()

    registry = Registry([Flow("Retry", [Step("Tool", tool, options=QUICK_RETRY)], start_step="Tool"),
                         Flow("Other", [Step("Noop", noop)], start_step="Noop")])
    async with engine_for(db_url, registry, worker=False) as eng:
        worker = await eng.start_worker(housekeeping_seconds=0.1, poll_seconds=0.05)
        real_poll = eng.store.poll
        delayed: list[float] = []

        async def slow_poll(worker_id: str, flow_types: Any, capacity: int, running: Any, **kw: Any) -> Any:
            result = await real_poll(worker_id, flow_types, capacity, running, **kw)
            watching_first = [t for t in running if (r := worker._running.get(t)) is not None
                              and r.lease.step_type == "Tool" and r.lease.attempt == 1]
            if watching_first and not delayed:
                delayed.append(time.monotonic())
                await asyncio.sleep(1.0)  # a poll queued behind other writes: its reply is old news
            return result

        eng.store.poll = slow_poll  # type: ignore[method-assign]
        await eng.client.start_flow("Retry", "r")
        await wait_until("the poll to watch attempt 1", lambda: asyncio.sleep(0, delayed))
        await asyncio.sleep(0.5)  # attempt 1 has failed and its retry is due
        await eng.client.start_flow("Other", "o")  # its commit hands this worker the ready retry
        info = await eng.client.wait_for_flow("r", 20)
        assert info.status == "completed"
        assert await eng.client.flow_output("r") == "attempt 2"
        assert log == ["attempt 2 starts the tool"]
        history = await eng.client.get_flow_history("r")
        assert failures(history) == [("Tool-1", 1, "execute: RuntimeError: attempt 1 fails")]


async def _cancelled_future() -> None:
    future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    future.cancel()
    await future  # raises CancelledError into the handler, which nothing cancelled


@pytest.mark.sqlite_only  # folds
async def test_a_handler_that_raises_cancelled_error_inside_a_fold_leaves_the_commit_whole(db_url: str) -> None:
    calls: list[bool] = []

    async def tool(ctx: Context, _: None) -> StepDecision:
        folded = called_from("fold_execute")
        calls.append(folded)
        if folded:
            await _cancelled_future()
        await ctx.heartbeat()
        return StepDecision.graceful_complete("done")

    async def arm(ctx: Context, _: None) -> StepDecision:
        await asyncio.sleep(0.02)  # the loop is idle when it commits, so Tool folds into that commit
        return StepDecision.go_to("Tool")

    arms: list[str] = []

    async def counted_arm(ctx: Context, _: None) -> StepDecision:
        arms.append(ctx.flow_id)
        return await arm(ctx, None)

    registry = Registry([
        Flow("Direct", [Step("Tool", tool, pure_until_heartbeat=True)], start_step="Tool"),
        Flow("Armed", [Step("Arm", counted_arm), Step("Tool", tool, pure_until_heartbeat=True)], start_step="Arm"),
    ])
    async with quiet_engine(db_url, registry) as eng:
        for i in range(TRIES):
            await eng.client.start_flow("Direct", f"d{i}")  # the client's commit claims and folds Tool
            await eng.client.start_flow("Armed", f"a{i}")  # Arm's commit does
            for flow_id in (f"d{i}", f"a{i}"):
                info = await eng.client.wait_for_flow(flow_id, 10)
                assert info.status == "completed", info
                assert failures(await eng.client.get_flow_history(flow_id)) == []
        assert True in calls, calls  # some folded, and each of those ran again as a usual attempt
        assert sorted(arms) == sorted(f"a{i}" for i in range(TRIES))  # Arm committed once each


async def test_a_cancelled_error_the_handler_raises_itself_fails_the_attempt(db_url: str) -> None:
    async def flaky(ctx: Context, _: None) -> StepDecision:
        if ctx.attempt == 1:
            await _cancelled_future()
        return StepDecision.graceful_complete(f"attempt {ctx.attempt}")

    registry = Registry([Flow("Flaky", [Step("Call", flaky, options=QUICK_RETRY)], start_step="Call")])
    async with engine_for(db_url, registry) as eng:
        await eng.client.start_flow("Flaky", "f")
        info = await eng.client.wait_for_flow("f", 10)  # not handed back as a lost claim, again and again
        assert info.status == "completed"
        assert await eng.client.flow_output("f") == "attempt 2"
        (failed,) = failures(await eng.client.get_flow_history("f"))
        assert failed[:2] == ("Call-1", 1) and failed[2] == "execute: CancelledError: CancelledError()", failed


CALLER: ContextVar[str] = ContextVar("CALLER", default="unset")


async def test_an_attempt_never_sees_the_context_variables_of_the_handler_whose_commit_started_it(
    db_url: str,
) -> None:
    seen: list[str] = []

    async def first(ctx: Context, _: None) -> StepDecision:
        CALLER.set(f"set by {ctx.step_execution_id}")  # a tracing span, say
        await asyncio.sleep(0.01)
        return StepDecision.go_to("Second")

    async def second(ctx: Context, _: None) -> StepDecision:
        seen.append(CALLER.get())
        await asyncio.sleep(0)
        return StepDecision.graceful_complete()

    registry = Registry([Flow("Vars", [Step("First", first), Step("Second", second)], start_step="First")])
    async with engine_for(db_url, registry) as eng:
        for i in range(3):
            await eng.client.start_flow("Vars", f"v{i}")
            assert (await eng.client.wait_for_flow(f"v{i}", 10)).status == "completed"
    assert seen == ["unset"] * 3


async def test_an_attempt_revoked_before_its_task_ran_frees_its_slot(db_url: str) -> None:
    async def quick(ctx: Context, _: None) -> StepDecision:
        return StepDecision.graceful_complete()

    registry = Registry([Flow("Quick", [Step("Run", quick)], start_step="Run")])
    async with engine_for(db_url, registry, worker=False) as eng:
        worker = await eng.start_worker()
        spawn = worker._spawn

        def spawn_then_revoke(lease: Any, context: Any = None) -> None:
            spawn(lease, context)
            running = worker._running.get(lease.task_id)
            if running is not None and lease.attempt == 1:
                worker._revoke(running)  # before the task's first step, as a declared-dead worker does

        worker._spawn = spawn_then_revoke  # type: ignore[method-assign]
        await eng.client.start_flow("Quick", "q")
        # The revoked attempt ends without running; the slot must be free again, not held for ever.
        # Sooner than LOST_CLAIM_MS, after which a poll's housekeeping would hand the claim back.
        await wait_until("the revoked attempt to free its slot", lambda: asyncio.sleep(0, not worker._running),
                         timeout=LOST_CLAIM_MS / 1000 / 4)


async def _tool_heartbeating(ctx: Context, beats: int) -> StepDecision:
    for _ in range(beats):
        await ctx.heartbeat()
        await asyncio.sleep(0.1)
    return StepDecision.graceful_complete(f"attempt {ctx.attempt}")


def heartbeating_flow(flow_type: str, beats: int) -> Flow:
    async def tool(ctx: Context, _: None) -> StepDecision:
        return await _tool_heartbeating(ctx, beats)

    return Flow(flow_type, [Step("Tool", tool, options=QUICK_RETRY)], start_step="Tool")


async def test_a_wall_clock_step_forward_does_not_make_a_worker_fail_its_own_attempts(
    db_url: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    registry = Registry([heartbeating_flow("Clock", beats=10)])
    async with engine_for(db_url, registry, worker=False) as eng:
        # Production-like leases, so no renewal comes to the rescue within the test; housekeeping often.
        await eng.start_worker(lease_ttl_seconds=30.0, lease_renew_seconds=10.0)
        await eng.client.start_flow("Clock", "c")
        await asyncio.sleep(0.3)
        real_time = time.time
        monkeypatch.setattr(time, "time", lambda: real_time() + 60.0)  # an NTP step, a resumed VM
        info = await eng.client.wait_for_flow("c", 10)
        assert info.status == "completed", info
        assert await eng.client.flow_output("c") == "attempt 1"
        assert failures(await eng.client.get_flow_history("c")) == []


async def test_a_worker_declared_dead_claims_nothing_until_it_registers_again(db_url: str) -> None:
    registry = Registry([heartbeating_flow("Dead", beats=5)])
    async with engine_for(db_url, registry, worker=False) as eng:
        worker = await eng.start_worker(lease_ttl_seconds=30.0, lease_renew_seconds=10.0)
        await eng.client.start_flow("Dead", "d")
        await asyncio.sleep(0.2)
        # What another worker's housekeeping does to a worker that was paused longer than its lease.
        await eng.store.raw(lambda db: db.run("DELETE FROM workers"), write=True)
        info = await eng.client.wait_for_flow("d", 10)
        assert info.status == "completed", info
        # Attempt 1 was lost with the worker; its retry ran once the worker had registered again,
        # rather than being claimed by a worker without a row and failed as lost too.
        assert await eng.client.flow_output("d") == "attempt 2"
        assert [f[:2] for f in failures(await eng.client.get_flow_history("d"))] == [("Tool-1", 1)]
        assert [w[0] for w in await eng.store.list_workers()] == [worker.worker_id]


async def test_a_worker_declared_dead_takes_no_step_its_processs_clients_ready_until_it_registers_again(
    db_url: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A client sharing the worker's store hands that worker the Steps its commits ready, in the
    same transaction. A worker declared dead has no row until it registers again, and housekeeping
    takes a running attempt without one for lost (the worker's own housekeeping too). So until its
    registration lands (held here) it must take nothing: the Step waits, then runs once. Catches a
    hand-off to a worker that does not know it is dead."""
    ran: list[int] = []

    async def work(ctx: Context, _: None) -> StepDecision:
        ran.append(ctx.attempt)
        return StepDecision.graceful_complete()

    registry = Registry([Flow("Handed", [Step("Work", work)], start_step="Work")])
    async with engine_for(db_url, registry, worker=False) as eng:
        await eng.start_worker(lease_ttl_seconds=30.0, lease_renew_seconds=10.0)
        registering: list[str] = []
        registered = asyncio.Event()
        real_register = eng.store.register_worker

        async def held_register(*args: Any, **kwargs: Any) -> Any:
            registering.append("again")
            await registered.wait()
            return await real_register(*args, **kwargs)

        monkeypatch.setattr(eng.store, "register_worker", held_register)
        # What another worker's housekeeping does to a worker that was paused longer than its lease.
        await eng.store.raw(lambda db: db.run("DELETE FROM workers"), write=True)
        await wait_until("the worker to register again", lambda: asyncio.sleep(0, registering))
        await eng.client.start_flow("Handed", "h")
        await asyncio.sleep(0.3)  # polls every 0.01 s and housekeeping every 0.1 s meanwhile
        assert ran == []
        registered.set()
        assert (await eng.client.wait_for_flow("h", 10)).status == "completed"
        assert ran == [1]
        assert failures(await eng.client.get_flow_history("h")) == []


async def test_a_worker_declared_dead_stops_the_handlers_of_the_attempts_it_lost(db_url: str) -> None:
    """A worker that learns it was declared dead (paused past its lease) cancels the handlers of
    the attempts it held: those attempts were failed as lost and will run again, so a handler left
    running (a tool call that does not heartbeat) would do its work a second time alongside the
    retry, with nothing to fence it until its commit. The retry waits a minute here, so that it is
    not its claim that stops the handler. Catches a worker that registers again and leaves them
    running."""
    log: list[str] = []

    async def tool(ctx: Context, _: None) -> StepDecision:
        await ctx.heartbeat("started")
        log.append(f"attempt {ctx.attempt} runs")
        try:
            await asyncio.sleep(30)  # a long call that does not heartbeat
        except asyncio.CancelledError:
            log.append(f"attempt {ctx.attempt} cancelled")
            raise
        log.append(f"attempt {ctx.attempt} ran to its end")
        return StepDecision.graceful_complete(f"attempt {ctx.attempt}")

    slow_retry = StepOptions(execute_retry=RetryPolicy(max_attempts=2, initial_interval_seconds=60.0))
    registry = Registry([Flow("Lost", [Step("Tool", tool, options=slow_retry)], start_step="Tool")])
    async with engine_for(db_url, registry, worker=False) as eng:
        await eng.start_worker(lease_ttl_seconds=30.0, lease_renew_seconds=10.0)
        await eng.client.start_flow("Lost", "l")
        await wait_until("attempt 1 to run", lambda: asyncio.sleep(0, log))
        # What another worker's housekeeping does to a worker that was paused longer than its lease.
        await eng.store.raw(lambda db: db.run("DELETE FROM workers"), write=True)
        await wait_until("attempt 1's handler to be cancelled", lambda: asyncio.sleep(0, "attempt 1 cancelled" in log))
        assert log == ["attempt 1 runs", "attempt 1 cancelled"], log
        assert [f[:2] for f in failures(await eng.client.get_flow_history("l"))] == [("Tool-1", 1)]


Owner: Attribute[str] = Attribute("Owner", str)
Progress: Stream[str] = Stream("Progress", str)


@pytest.mark.parametrize("learns_from", ["renew_worker", "poll", "refused event"])
async def test_a_worker_cut_off_past_its_lease_gets_no_late_commit_in_and_stops_what_still_runs_once_it_learns(
    db_url: str, learns_from: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """Worker A runs two started attempts ("late", "stuck") when its link to the database goes
    down (its polls and renewals fail; its commits are left working, as for one that comes back
    just as its handler returns). Its lease runs out, worker B declares it dead, fails both
    attempts as WorkerLost and runs them again. A's "late" handler then returns while B's attempt
    2 still runs: A sends its commit, which the store refuses (E2), so the task, its attribute and
    its history hold B's attempt only (the task row is the one A claimed, running again under B's
    lease epoch: only the epoch tells the two apart). Then A learns that the "stuck" attempt is
    gone, whose retry B has run meanwhile, in one of three ways: its renewal works again before its
    poll (refused: its row is gone), or its poll before its renewal (its row gone, the attempt's
    task taken over), or, with both still down, the handler writes a stream event, which the store
    refuses. Each alone must cancel the handler rather than let it run on, do its work a second
    time and commit. Catches the revoke dropped from any of the three."""
    log: list[str] = []
    release_late, finish_retry, write_now, never = asyncio.Event(), asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def tool(ctx: Context, _: None) -> StepDecision:
        await ctx.heartbeat("started")  # from here on a retry runs the tool again
        log.append(f"{ctx.flow_id} attempt {ctx.attempt} runs")
        try:
            if ctx.attempt == 1 and ctx.flow_id == "late":
                await release_late.wait()
            elif ctx.attempt == 1:
                await write_now.wait()
                ctx.write_event(Progress, "still working")
                await never.wait()
            elif ctx.flow_id == "late":
                await finish_retry.wait()
        except asyncio.CancelledError:
            log.append(f"{ctx.flow_id} attempt {ctx.attempt} cancelled")
            raise
        ctx.set(Owner, f"attempt {ctx.attempt}")
        log.append(f"{ctx.flow_id} attempt {ctx.attempt} returns")
        return StepDecision.graceful_complete(f"attempt {ctx.attempt}")

    registry = Registry([Flow("CutOff", [Step("Tool", tool, options=QUICK_RETRY)], start_step="Tool",
                              schema=[Owner, Progress])])
    async with engine_for(db_url, registry, worker=False) as eng:
        a_store = open_store(db_url)  # A's own connections, which the cut takes down
        down = {"poll", "renew_worker"}
        cut = False

        def through_the_link(name: str) -> None:
            real = getattr(a_store, name)

            async def call(*args: Any, **kwargs: Any) -> Any:
                if cut and name in down:
                    raise OSError("connection timed out")
                return await real(*args, **kwargs)

            monkeypatch.setattr(a_store, name, call)

        through_the_link("poll")
        through_the_link("renew_worker")

        def flow_log(flow_id: str) -> list[str]:
            return [entry for entry in log if entry.startswith(f"{flow_id} ")]

        a_options = WorkerOptions(**{**FAST.__dict__, "database_url": db_url, "worker_id": "a",
                                     "lease_ttl_seconds": 0.5, "lease_renew_seconds": 0.1})
        try:
            async with AsyncWorker(registry, a_options, store=a_store):
                await eng.client.start_flow("CutOff", "late")
                await eng.client.start_flow("CutOff", "stuck")
                await wait_until("A to run both attempts", lambda: asyncio.sleep(0, len(log) == 2))
                cut = True
                await eng.start_worker(worker_id="b")  # housekeeps every 0.1 s
                assert (await eng.client.wait_for_flow("stuck", 10)).status == "completed"
                await wait_until("B to run late's attempt 2",
                                 lambda: asyncio.sleep(0, "late attempt 2 runs" in log))

                with caplog.at_level(logging.INFO, logger="dex_engine.worker"):
                    release_late.set()
                    await wait_until("A's late commit to be refused", lambda: asyncio.sleep(0, any(
                        r.getMessage() == "flow late: Tool-1 attempt 1 lost its task (taken over, or the flow "
                        "ended); result discarded" for r in caplog.records)))
                info = await eng.client.describe_flow("late")
                assert [(s.step_execution_id, s.state, s.attempt) for s in info.active_steps] == [
                    ("Tool-1", "running", 2)], info
                assert await eng.client.get_attribute("late", Owner) is None
                finish_retry.set()
                assert (await eng.client.wait_for_flow("late", 10)).status == "completed"

                if learns_from == "refused event":
                    write_now.set()
                else:
                    down.discard(learns_from)  # the other way to the database stays down
                await wait_until("A to cancel stuck's attempt 1",
                                 lambda: asyncio.sleep(0, "stuck attempt 1 cancelled" in log))
                cut = False

                async def a_registered() -> bool:
                    return "a" in [w[0] for w in await eng.store.list_workers()]

                await wait_until("A to register again", a_registered)
        finally:
            await a_store.close()
        for flow_id in ("late", "stuck"):
            assert await eng.client.flow_output(flow_id) == "attempt 2"
            assert await eng.client.get_attribute(flow_id, Owner) == "attempt 2"
            history = await eng.client.get_flow_history(flow_id)
            assert [h.attempt for h in history if h.event_type == "execute_completed"] == [2], history
            assert [(f[:2], "WorkerLost" in f[2]) for f in failures(history)] == [(("Tool-1", 1), True)], history
        assert flow_log("late") == ["late attempt 1 runs", "late attempt 2 runs", "late attempt 1 returns",
                                    "late attempt 2 returns"]
        assert flow_log("stuck") == ["stuck attempt 1 runs", "stuck attempt 2 runs", "stuck attempt 2 returns",
                                     "stuck attempt 1 cancelled"]
        assert (await eng.client.read_stream("stuck", Progress)).events == []


async def test_a_failed_registration_after_being_declared_dead_is_tried_again(db_url: str) -> None:
    """A worker declared dead registers again at once (its polls, every 0.01 s here, ask for it,
    long before its next renewal is due), and while the database refuses, tries every
    RENEW_RETRY_SECONDS: not in a tight loop driven by those polls. Then it runs work again."""
    registry = Registry([heartbeating_flow("Flaky", beats=2)])
    refusals = 2
    async with engine_for(db_url, registry, worker=False) as eng:
        worker = await eng.start_worker(lease_renew_seconds=30.0, lease_ttl_seconds=60.0)
        real_register = eng.store.register_worker
        calls: list[float] = []

        async def flaky_register(*args: Any, **kwargs: Any) -> None:
            calls.append(time.monotonic())
            if len(calls) <= refusals:
                raise OSError("connection reset")  # the outage that got it declared dead goes on
            await real_register(*args, **kwargs)

        eng.store.register_worker = flaky_register  # type: ignore[method-assign]
        await eng.store.raw(lambda db: db.run("DELETE FROM workers"), write=True)
        await wait_until("the worker to register again", eng.store.list_workers)
        assert len(calls) == refusals + 1
        assert_paced(calls, RENEW_RETRY_SECONDS, most=10)
        await eng.client.start_flow("Flaky", "f")
        info = await eng.client.wait_for_flow("f", 10)
        assert info.status == "completed", info
        assert failures(await eng.client.get_flow_history("f")) == []
        await worker.stop()  # unregisters cleanly
        assert await eng.store.list_workers() == []


async def test_a_late_claim_reply_never_displaces_the_newer_attempt_of_its_task(db_url: str) -> None:
    log: list[str] = []

    async def tool(ctx: Context, _: None) -> StepDecision:
        log.append(f"attempt {ctx.attempt} runs")
        await ctx.heartbeat()
        await asyncio.sleep(0.3)
        return StepDecision.graceful_complete(f"attempt {ctx.attempt}")

    registry = Registry([Flow("Late", [Step("Tool", tool, options=QUICK_RETRY)], start_step="Tool")])
    async with engine_for(db_url, registry, worker=False) as eng:
        worker = await eng.start_worker()
        spawn = worker._spawn
        first: list[Any] = []

        def spawn_keeping_the_first(lease: Any, context: Any = None) -> None:
            if not first:
                first.append(lease)  # its reply "arrives" only after the task was handed out again
                return
            spawn(lease, context)
            if lease.task_id == first[0].task_id:
                spawn(first[0], context)  # the late reply of the first claim

        worker._spawn = spawn_keeping_the_first  # type: ignore[method-assign]
        await eng.client.start_flow("Late", "l")
        info = await eng.client.wait_for_flow("l", 20)  # attempt 1 is handed back as a lost claim first
        assert info.status == "completed", info
        assert await eng.client.flow_output("l") == "attempt 1"  # the unstarted attempt, handed out again
        assert log == ["attempt 1 runs"]


@pytest.mark.parametrize("method_timeout", [None, 60.0])
async def test_a_timeout_error_the_handler_lets_out_is_not_the_method_timeout(
    db_url: str, method_timeout: float | None,
) -> None:
    """A TimeoutError of the handler's own is recorded as such, whether or not the method has a
    timeout of its own (one far off here): only the method's timeout is MethodTimeout."""
    async def waits(ctx: Context, _: None) -> StepDecision:
        if ctx.attempt == 1:
            await asyncio.wait_for(asyncio.Event().wait(), 0.01)  # its own deadline, on its own call
        return StepDecision.graceful_complete()

    options = dataclasses.replace(QUICK_RETRY, execute_timeout_seconds=method_timeout)
    registry = Registry([Flow("Own", [Step("Call", waits, options=options)], start_step="Call")])
    async with engine_for(db_url, registry) as eng:
        await eng.client.start_flow("Own", "o")
        assert (await eng.client.wait_for_flow("o", 10)).status == "completed"
        (failed,) = failures(await eng.client.get_flow_history("o"))
        assert failed[2] == "execute: TimeoutError: TimeoutError()", failed


@pytest.mark.parametrize(("result", "shown"), [
    ("not a decision", "'not a decision'"),
    (Unshowable(), f"{UNSHOWABLE_SHOWN}, not a StepDecision"),
], ids=["text", "no-repr"])
async def test_a_result_that_cannot_be_committed_fails_the_attempt_and_is_retried(
    db_url: str, result: object, shown: str
) -> None:
    """A handler's result refused as its attempt commits (here not a StepDecision) fails that
    attempt with the error named, and the Step's retry policy applies as to any other failure.
    Catches a result with no repr failing with the repr's error instead of InvalidValueError."""
    async def returns(ctx: Context, _: None) -> StepDecision:
        if ctx.attempt == 1:
            return result  # type: ignore[return-value]
        return StepDecision.graceful_complete(f"attempt {ctx.attempt}")

    registry = Registry([Flow("Refused", [Step("Call", returns, options=QUICK_RETRY)], start_step="Call")])
    async with engine_for(db_url, registry) as eng:
        await eng.client.start_flow("Refused", "r")
        assert (await eng.client.wait_for_flow("r", 10)).status == "completed"
        assert await eng.client.flow_output("r") == "attempt 2"
        (failed,) = failures(await eng.client.get_flow_history("r"))
        assert failed[:2] == ("Call-1", 1) and failed[2].startswith("execute: InvalidValueError: "), failed
        assert shown in failed[2]


async def test_an_attempt_the_worker_itself_cannot_finish_is_handed_back_and_retried(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker, not the handler, fails: here the attempt's commit raises an unexpected error (a
    database fault, a bug), and so does recording that failure. The worker hands the attempt back,
    and the next housekeeping treats it as a dead worker's: its retry runs and the flow completes.
    Catches an attempt left running under a worker that stays alive, renewing its lease, so that
    nothing ever runs it again."""
    calls: list[int] = []

    async def call(ctx: Context, _: None) -> StepDecision:
        calls.append(ctx.attempt)
        await ctx.heartbeat()  # started: handed back, it is failed as lost and retried
        return StepDecision.graceful_complete(f"attempt {ctx.attempt}")

    registry = Registry([Flow("Faulty", [Step("Call", call, options=QUICK_RETRY)], start_step="Call")])
    async with engine_for(db_url, registry) as eng:
        faults: list[str] = []

        def faulty(name: str) -> Callable[..., Awaitable[Any]]:
            real = getattr(eng.store, name)

            async def once(lease: Any, *args: Any, **kwargs: Any) -> Any:
                if lease.attempt == 1:
                    faults.append(name)
                    raise RuntimeError("the database went away")
                return await real(lease, *args, **kwargs)

            return once

        for name in ("commit_execute", "fail_attempt"):
            monkeypatch.setattr(eng.store, name, faulty(name))
        await eng.client.start_flow("Faulty", "f")
        assert (await eng.client.wait_for_flow("f", 10)).status == "completed"
        assert faults == ["commit_execute", "fail_attempt"]
        assert calls == [1, 2]
        assert eng.worker is not None and eng.worker._worker_errors == {}  # the attempt that ended forgot it
        assert await eng.client.flow_output("f") == "attempt 2"
        (failed,) = failures(await eng.client.get_flow_history("f"))
        assert failed[:2] == ("Call-1", 1), failed


def _unendable_attempts(eng: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every first attempt's commit, and the recording of its failure, raise in the worker."""
    commit_execute, fail_attempt = eng.store.commit_execute, eng.store.fail_attempt

    async def unrecordable_commit(lease: Any, *args: Any, **kwargs: Any) -> Any:
        if lease.attempt == 1:
            raise RuntimeError("a bug in the commit")
        return await commit_execute(lease, *args, **kwargs)

    async def unrecordable_failure(lease: Any, error: Any, **kwargs: Any) -> Any:
        if error.error_type != "WorkerError":  # the worker's own last resort is recorded
            raise LookupError("a bug in recording the failure")
        return await fail_attempt(lease, error, **kwargs)

    monkeypatch.setattr(eng.store, "commit_execute", unrecordable_commit)
    monkeypatch.setattr(eng.store, "fail_attempt", unrecordable_failure)


async def test_an_unstarted_attempt_the_worker_cannot_end_again_and_again_is_failed(
    db_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """An attempt that never started (no heartbeat) is handed back under the same number after a
    worker-side error (E3: no retry used). When ending it fails every time (an error of the
    worker's that recurs on each run: a bug in recording the failure), the worker fails it with
    WorkerError after MAX_WORKER_ERRORS_PER_ATTEMPT runs, and the retry policy applies. Catches:
    the attempt handed back and run again without end, its flow running forever (as a NUL in an
    error's text once did on PostgreSQL)."""
    calls: list[int] = []

    async def call(ctx: Context, _: None) -> StepDecision:
        calls.append(ctx.attempt)
        return StepDecision.graceful_complete(f"attempt {ctx.attempt}")

    registry = Registry([Flow("Unending", [Step("Call", call, options=QUICK_RETRY)], start_step="Call")])
    async with engine_for(db_url, registry) as eng:
        _unendable_attempts(eng, monkeypatch)
        await eng.client.start_flow("Unending", "u")
        assert (await eng.client.wait_for_flow("u", 20)).status == "completed"
        assert calls == [1] * MAX_WORKER_ERRORS_PER_ATTEMPT + [2]
        assert await eng.client.flow_output("u") == "attempt 2"
        (failed,) = failures(await eng.client.get_flow_history("u"))
        assert failed == ("Call-1", 1, "execute: WorkerError: the worker could not end the attempt "
                          f"{MAX_WORKER_ERRORS_PER_ATTEMPT} times; the last time: LookupError")
        assert eng.worker is not None and eng.worker._worker_errors == {}
    # Each names the flow and attempt: Step execution IDs (Call-1) repeat in every flow.
    errors = [r.getMessage() for r in caplog.records if r.name == "dex_engine.worker" and r.levelno >= logging.ERROR]
    assert errors == (["flow u: worker error while running Call-1 attempt 1; handing the attempt back"]
                      * (MAX_WORKER_ERRORS_PER_ATTEMPT - 1)
                      + [f"flow u: worker error while running Call-1 attempt 1, {MAX_WORKER_ERRORS_PER_ATTEMPT} "
                         "times in a row; failing the attempt"]), errors


async def test_attempts_beyond_the_workers_error_count_bound_still_end_failed(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With its count of worker-side errors full (MAX_WORKER_ERROR_ENTRIES, 1 here), a worker
    leaves a fresh entry alone and counts the new attempt once the counted one ended; it drops an
    entry left stale (an attempt that went to another worker) for it. Every attempt that cannot
    be ended is failed with WorkerError in the end, and the count stays within its bound. Catches:
    entries of attempts handed to other workers filling the count for good, after which an error
    that recurs ran its attempt again without end."""
    from dex_engine import _worker

    monkeypatch.setattr(_worker, "MAX_WORKER_ERROR_ENTRIES", 1)
    calls: list[tuple[str, int]] = []

    async def call(ctx: Context, _: None) -> StepDecision:
        calls.append((ctx.flow_id, ctx.attempt))
        return StepDecision.graceful_complete(f"attempt {ctx.attempt}")

    registry = Registry([Flow("Bounded", [Step("Call", call, options=QUICK_RETRY)], start_step="Call")])
    async with engine_for(db_url, registry) as eng:
        assert eng.worker is not None
        _unendable_attempts(eng, monkeypatch)
        stale = time.monotonic() - _worker.WORKER_ERROR_STALE_SECONDS - 1
        eng.worker._worker_errors[10**9] = (1, 1, stale)  # an attempt handed back and run elsewhere
        sizes: list[int] = []
        count = eng.worker._count_worker_error

        def counting(lease: Any, errors: int) -> None:
            count(lease, errors)
            sizes.append(len(eng.worker._worker_errors))  # type: ignore[union-attr]

        monkeypatch.setattr(eng.worker, "_count_worker_error", counting)
        await asyncio.gather(*(eng.client.start_flow("Bounded", f"b{i}") for i in range(3)))
        for i in range(3):
            assert (await eng.client.wait_for_flow(f"b{i}", 30)).status == "completed"
            assert await eng.client.flow_output(f"b{i}") == "attempt 2"
            (failed,) = failures(await eng.client.get_flow_history(f"b{i}"))
            assert failed[2].startswith("execute: WorkerError: the worker could not end the attempt "
                                        f"{MAX_WORKER_ERRORS_PER_ATTEMPT} times"), failed
            assert calls.count((f"b{i}", 1)) >= MAX_WORKER_ERRORS_PER_ATTEMPT
        assert sizes and max(sizes) == 1
        assert eng.worker._worker_errors == {}

@pytest.mark.sqlite_only  # on PostgreSQL the lock is released without a round trip; a poll claims the Step
async def test_a_step_waiting_for_a_method_lock_runs_once_the_holder_commits(db_url: str) -> None:
    """The holder's commit frees the lock and hands its worker the Step it starts; the ready Step
    that waited for the lock is claimed in that commit too, not at the next housekeeping."""
    marks: dict[str, float] = {}
    count = Attribute("Count", int)

    async def start(ctx: Context, _: None) -> StepDecision:
        return StepDecision.go_to_many(("Holder", None), ("Other", None))

    async def holder(ctx: Context, _: None) -> StepDecision:
        await asyncio.sleep(0.2)
        marks["holder returned"] = time.monotonic()
        return StepDecision.go_to("Next")

    async def other(ctx: Context, _: None) -> StepDecision:
        marks.setdefault("other started", time.monotonic())
        return StepDecision.dead_end()

    async def next_step(ctx: Context, _: None) -> StepDecision:
        await asyncio.sleep(2.0)  # its commit would claim Other too: only after this
        return StepDecision.dead_end()

    locked = StepOptions(execute_locks=(count,))
    registry = Registry([Flow("Locks", [
        Step("Start", start), Step("Holder", holder, options=locked), Step("Other", other, options=locked),
        Step("Next", next_step),
    ], start_step="Start", schema=[count])])
    async with quiet_engine(db_url, registry) as eng:  # polls every second, housekeeps every 5 s
        for i in range(3):
            marks.clear()
            await eng.client.start_flow("Locks", f"l{i}")
            await wait_until("Other to start", lambda: asyncio.sleep(0, "other started" in marks))
            if marks["other started"] > marks.get("holder returned", 0.0):  # it may have taken the lock first
                assert marks["other started"] - marks["holder returned"] < 0.3, marks


def without_own_housekeeping(eng: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker eng starts next never housekeeps: only the test's other store does."""
    real_poll = eng.store.poll

    async def poll_without_housekeeping(*args: Any, **kwargs: Any) -> Any:
        return await real_poll(*args, **{**kwargs, "housekeep": False})

    monkeypatch.setattr(eng.store, "poll", poll_without_housekeeping)


async def housekeeping_during_the_held_commit(
    db_url: str, monkeypatch: pytest.MonkeyPatch, before: Callable[[Store], Awaitable[Any]] | None = None,
) -> HousekeepingReport:
    """The next commit of a Step method stops inside its transaction, holding its locks; meanwhile
    `before` and then the housekeeping of another store (another process's) run, and the commit
    goes on once housekeeping had time to read what the commit changes. Returns its report."""
    other = open_store(db_url)
    inside, go = threading.Event(), threading.Event()

    def held_inside_commit(name: str) -> None:
        if name == _gates.INSIDE_COMMIT and not inside.is_set():
            inside.set()
            go.wait(30)

    monkeypatch.setattr(_gates, "ACTIVE", True)
    monkeypatch.setattr(_gates, "gate", held_inside_commit)
    try:
        assert await asyncio.to_thread(inside.wait, 10), "the commit never started"
        if before is not None:
            await before(other)
        housekeeping = asyncio.create_task(other.housekeeping())
        await asyncio.sleep(0.5)  # it reads what the commit changes, and waits if it must
        go.set()
        return await asyncio.wait_for(housekeeping, 30)
    finally:
        go.set()
        await other.close()


async def test_housekeeping_waits_for_the_commit_of_an_attempt_it_would_time_out(
    pg_database: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On PostgreSQL, an attempt past its heartbeat deadline is committing its result when another
    process's housekeeping finds it overdue. Housekeeping waits for that commit, sees the Step
    completed and leaves it alone. Catches: an overdue attempt re-checked without the flow's row
    lock, which records a HeartbeatTimeout for an attempt that completed and may run it again.
    (On SQLite the writers take turns with the whole file; a commit held there may hold the loop.)"""
    started = asyncio.Event()

    async def late(ctx: Context, _: None) -> StepDecision:
        started.set()
        await asyncio.sleep(0.6)  # no heartbeat: past its deadline when it returns
        return StepDecision.force_complete("done")

    options = StepOptions(heartbeat_timeout_seconds=0.2, execute_retry=QUICK_RETRY.execute_retry)
    registry = Registry([Flow("Late", [Step("Call", late, options=options)], start_step="Call")])
    async with engine_for(pg_database, registry, worker=False) as eng:
        without_own_housekeeping(eng, monkeypatch)
        await eng.start_worker()
        await eng.client.start_flow("Late", "l")
        await asyncio.wait_for(started.wait(), 10)
        report = await housekeeping_during_the_held_commit(pg_database, monkeypatch)
        assert (await eng.client.wait_for_flow("l", 10)).status == "completed"
        assert failures(await eng.client.get_flow_history("l")) == []
        assert report.timeouts == 0, report


async def test_housekeeping_waits_for_the_commit_of_an_attempt_whose_worker_it_finds_gone(
    pg_database: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On PostgreSQL, a worker's registration is gone (another process declared it dead) while its
    attempt's commit is open. Housekeeping finds the attempt orphaned, waits for that commit, sees
    the Step completed and leaves it alone. Catches: an orphan re-checked without the flow's row
    lock, which records WorkerLost for an attempt that completed."""
    started = asyncio.Event()

    async def call(ctx: Context, _: None) -> StepDecision:
        started.set()
        await asyncio.sleep(0.3)
        return StepDecision.force_complete("done")

    registry = Registry([Flow("Orphan", [Step("Call", call, options=QUICK_RETRY)], start_step="Call")])
    async with engine_for(pg_database, registry, worker=False) as eng:
        without_own_housekeeping(eng, monkeypatch)
        worker = await eng.start_worker(lease_ttl_seconds=60.0, lease_renew_seconds=30.0)  # no renewal meanwhile
        await eng.client.start_flow("Orphan", "o")
        await asyncio.wait_for(started.wait(), 10)

        async def declared_dead(other: Store) -> None:
            await other.raw(lambda db: db.run("DELETE FROM workers WHERE worker_id = ?", (worker.worker_id,)),
                            write=True)

        report = await housekeeping_during_the_held_commit(pg_database, monkeypatch, declared_dead)
        assert (await eng.client.wait_for_flow("o", 10)).status == "completed"
        assert failures(await eng.client.get_flow_history("o")) == []
        assert report.leases_expired == 0, report


async def test_housekeeping_waits_for_a_commit_that_satisfies_the_wait_whose_timer_it_fires(
    pg_database: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On PostgreSQL, Waiter waits for a message or a 1 s timer. Sender publishes the message after
    the timer is due, and while Sender's commit (which completes Waiter's wait) is open, another
    process's housekeeping finds the timer due. It waits for that commit and fires nothing: Waiter's
    wait completes once and its Execute runs once. Catches: a due timer fired without the flow's
    row lock, over the wait the commit had just completed (Waiter made ready again)."""
    sender_started = asyncio.Event()
    got: list[list[str]] = []

    async def arm(ctx: Context, _: None) -> StepDecision:
        return StepDecision.go_to_many(("Waiter", None), ("Sender", None))

    async def waiter_wait(ctx: Context, _: None) -> Wait:
        return Wait.any_of(Inbox.for_one(), Timer.by_duration(1))

    async def waiter(ctx: Context, _: None) -> StepDecision:
        assert ctx.wait_result is not None
        got.append(ctx.wait_result.messages(Inbox))
        return StepDecision.graceful_complete()

    async def sender(ctx: Context, _: None) -> StepDecision:
        sender_started.set()
        await asyncio.sleep(1.5)  # Waiter's timer is due
        ctx.publish(Inbox, "go")
        return StepDecision.dead_end()

    registry = Registry([Flow("Race", [
        Step("Arm", arm), Step("Waiter", waiter, wait_for=waiter_wait), Step("Sender", sender),
    ], start_step="Arm", schema=[Inbox])])
    async with engine_for(pg_database, registry, worker=False) as eng:
        without_own_housekeeping(eng, monkeypatch)
        await eng.start_worker()
        await eng.client.start_flow("Race", "r")
        await asyncio.wait_for(sender_started.wait(), 10)
        await wait_until("Waiter waits", lambda: history_has(eng, "r", "wait_registered", "Waiter-1"))
        report = await housekeeping_during_the_held_commit(pg_database, monkeypatch)
        assert (await eng.client.wait_for_flow("r", 10)).status == "completed"
        history = await eng.client.get_flow_history("r")
    completed = [h.detail for h in history if h.event_type == "wait_completed" and h.step_execution_id == "Waiter-1"]
    assert len(completed) == 1, completed
    assert len(got) == 1, got
    assert report.timers_fired == 0, report


async def test_a_failed_attempt_is_logged_naming_its_flow_and_the_last_with_its_traceback(
    db_url: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """Each failed attempt of a Step is logged once on dex_engine.worker naming its flow, Step
    execution and attempt: at INFO while its retry policy may run it again, at WARNING with the
    handler's traceback once it is the last, saying what follows (the failure route, or the flow
    fails); a NoRetryError is the last at once. Catches: a Step's bug failing a flow with no log
    line at all, and its traceback nowhere (the database keeps only its type and text)."""

    async def broken(ctx: Context, _: None) -> StepDecision:
        raise KeyError("missing-" + "x" * 10_000)

    async def refused(ctx: Context, _: None) -> StepDecision:
        from dex_engine import NoRetryError
        raise NoRetryError("bad input")

    async def route(ctx: Context, _: None) -> StepDecision:
        return StepDecision.graceful_complete("routed")

    three = StepOptions(execute_retry=RetryPolicy(max_attempts=3, initial_interval_seconds=0.01,
                                                  max_interval_seconds=0.01))
    registry = Registry([
        Flow("Broken", [Step("Work", broken, options=three)], start_step="Work"),
        Flow("Refused", [Step("Work", refused, options=dataclasses.replace(three, failure_route="Route")),
                         Step("Route", route)], start_step="Work"),
    ])
    async with engine_for(db_url, registry) as eng:
        with caplog.at_level(logging.INFO, logger="dex_engine.worker"):
            await eng.client.start_flow("Broken", "b")
            await eng.client.start_flow("Refused", "r")
            assert (await eng.client.wait_for_flow("b", 10)).status == "failed"
            assert (await eng.client.wait_for_flow("r", 10)).status == "completed"
    said = [r for r in caplog.records if r.name == "dex_engine.worker" and "of Step" in r.getMessage()]
    lines = sorted((r.levelname, r.getMessage()[:120], r.exc_info is not None) for r in said)
    cut = "KeyError: 'missing-" + "x" * 100
    assert lines == [
        ("INFO", f"flow b: execute of Step Work-1 attempt 1 failed, retried as its retry policy allows: {cut}"[:120],
         False),
        ("INFO", f"flow b: execute of Step Work-1 attempt 2 failed, retried as its retry policy allows: {cut}"[:120],
         False),
        ("WARNING", f"flow b: execute of Step Work-1 failed on attempt 3, its last: {cut}"[:120], False),
        ("WARNING", "flow r: execute of Step Work-1 failed on attempt 1, its last: NoRetryError: bad input; its "
                    "failure route Route runs", True),
    ]
    last = next(r for r in said if r.getMessage().startswith("flow b: execute of Step Work-1 failed on attempt 3"))
    # Its text is cut as the database keeps it, and so is the traceback, which shows the frames only:
    # with exc_info, logging would print the 10,000 characters whole.
    text, _, frames = last.getMessage().partition("; the flow fails\nTraceback (most recent call last):\n")
    assert len(text) < 4200 and 'in broken\n    raise KeyError("missing-" + "x" * 10_000)' in frames, frames


async def test_a_dead_workers_attempts_taken_back_are_logged_naming_their_flows(
    db_url: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """The worker whose housekeeping takes back a dead worker's attempts warns once, naming each
    attempt's flow, Step execution and attempt. Catches: a worker killed mid-attempt, its session
    failed as WorkerLost or run again, with no line in any surviving worker's log."""

    async def work(ctx: Context, _: None) -> StepDecision:
        return StepDecision.graceful_complete(f"attempt {ctx.attempt}")

    registry = Registry([Flow("Orphaned", [Step("Work", work, options=QUICK_RETRY)], start_step="Work")])
    async with engine_for(db_url, registry, worker=False) as eng:
        await eng.client.start_flow("Orphaned", "o")
        await eng.store.register_worker("killed", "gone-host", 1, 1)  # its lease runs out at once
        [lease] = await eng.store.claim("killed", ["Orphaned"], 1)
        await eng.store.heartbeat(lease, "started")  # started: it fails as WorkerLost, then is retried
        with caplog.at_level(logging.WARNING, logger="dex_engine.worker"):
            await eng.start_worker()
            assert (await eng.client.wait_for_flow("o", 10)).status == "completed"
    said = [r.getMessage() for r in caplog.records if "housekeeping took back" in r.getMessage()]
    assert len(said) == 1, said
    assert said[0].endswith("housekeeping took back 1 attempts of workers that died or lost their lease (1 declared "
                            "dead now; a started attempt fails as WorkerLost through its retry policy, others run "
                            "again) and failed 0 attempts past their deadline (HeartbeatTimeout, MethodTimeout): "
                            "o/Work-1 attempt 1"), said


async def test_a_worker_declared_dead_names_the_attempts_it_abandons(
    db_url: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """A worker that finds itself declared dead (paused or cut off past its lease) names the flow,
    Step execution and attempt of each attempt it abandons: its renewal warns, or its poll, finding
    the attempt's lease gone first, says so. Catches: "abandoning 1 attempts", with nothing to find
    the sessions by, or an attempt revoked with no line at all."""
    started: list[int] = []

    async def work(ctx: Context, _: None) -> StepDecision:
        await ctx.heartbeat("started")
        started.append(ctx.attempt)
        await asyncio.sleep(3600 if ctx.attempt == 1 else 0)
        return StepDecision.graceful_complete(f"attempt {ctx.attempt}")

    registry = Registry([Flow("Abandoned", [Step("Work", work, options=QUICK_RETRY)], start_step="Work")])
    async with engine_for(db_url, registry, worker=False) as eng:
        await eng.start_worker(worker_id="paused", lease_renew_seconds=0.05)
        await eng.client.start_flow("Abandoned", "a")
        await wait_until("attempt 1 to start", lambda: asyncio.sleep(0, started))
        with caplog.at_level(logging.INFO, logger="dex_engine.worker"):
            await eng.store.unregister_worker("paused")  # as another worker's housekeeping declares it dead
            assert (await eng.client.wait_for_flow("a", 10)).status == "completed"
    # Its renewal or its poll finds it first: either line names the attempt.
    said = [m for m in (r.getMessage() for r in caplog.records) if "declared dead" in m or "taken over" in m]
    assert said and said[0] in (
        "worker paused was declared dead; abandoning 1 attempts: a/Work-1 attempt 1",
        "flow a: Work-1 attempt 1 was cancelled, timed out or taken over; its handler is cancelled"), said


async def test_an_attempt_whose_own_commit_ended_its_task_is_not_said_to_be_taken_over(
    db_url: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """A poll reply that no longer finds the task of an attempt that began committing meanwhile (its
    own commit ended the task) logs nothing; one that finds a running attempt's task gone says so.
    Catches: an INFO line claiming "cancelled, timed out or taken over" for hundreds of attempts
    of a busy PostgreSQL worker that were not."""
    started: list[int] = []

    async def work(ctx: Context, _: None) -> StepDecision:
        started.append(ctx.attempt)
        await asyncio.sleep(3600)
        return StepDecision.graceful_complete()

    registry = Registry([Flow("Committing", [Step("Work", work, options=QUICK_RETRY)], start_step="Work")])
    async with engine_for(db_url, registry) as eng:
        await eng.client.start_flow("Committing", "c")
        await wait_until("the attempt to start", lambda: asyncio.sleep(0, started))
        assert eng.worker is not None
        [(task_id, running)] = list(eng.worker._running.items())
        with caplog.at_level(logging.INFO, logger="dex_engine.worker"):
            running.committing = True  # as when its commit began after the poll was sent
            eng.worker._revoke_changed({task_id: running}, {})
            while_committing = [r.getMessage() for r in caplog.records if "taken over" in r.getMessage()]
            running.committing = False
            eng.worker._revoke_changed({task_id: running}, {})  # cancels the handler: the worker can stop
        said = [r.getMessage() for r in caplog.records if "taken over" in r.getMessage()]
        assert while_committing == [], while_committing
        assert said == ["flow c: Work-1 attempt 1 was cancelled, timed out or taken over; its handler is cancelled"]
        await eng.client.stop_flow("c", "done")


async def test_a_claim_handed_to_the_worker_twice_runs_its_attempt_once(db_url: str) -> None:
    """The same claim reaches the worker a second time while its attempt runs (a reply that came
    again: a poll's and a commit's naming one attempt). The repeat, at the same lease epoch, is
    dropped: the handler runs once and is not cancelled. Catches a repeat taken for a newer attempt
    of the task, which revoked the running handler and ran the attempt again."""
    runs: list[int] = []
    repeats: list[Any] = []
    cancelled: list[int] = []

    async def tool(ctx: Context, _: None) -> StepDecision:
        runs.append(ctx.attempt)
        if repeats:
            repeats.pop()()  # the claim's reply arrives again, while this attempt runs
        try:
            await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            cancelled.append(ctx.attempt)
            raise
        return StepDecision.graceful_complete(f"attempt {ctx.attempt}")

    registry = Registry([Flow("Twice", [Step("Tool", tool, options=QUICK_RETRY)], start_step="Tool")])
    async with engine_for(db_url, registry, worker=False) as eng:
        worker = await eng.start_worker()
        spawn = worker._spawn

        def spawn_and_repeat(lease: Any, context: Any = None) -> None:
            if not runs and not repeats:
                repeats.append(lambda: spawn(lease))
            spawn(lease, context)

        worker._spawn = spawn_and_repeat  # type: ignore[method-assign]
        await eng.client.start_flow("Twice", "t")
        assert (await eng.client.wait_for_flow("t", 10)).status == "completed"
        assert not repeats, "the claim was never repeated"
        assert (runs, cancelled) == ([1], [])
        assert await eng.client.flow_output("t") == "attempt 1"
