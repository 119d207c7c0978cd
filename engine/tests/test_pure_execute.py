"""Step.pure_execute: a pure Execute runs inside the commit that makes its Step ready.

The flows here are Arm -> (Waiter, Sender): Waiter waits for a message on Inbox, Sender publishes
it. When Waiter's Execute is pure, the worker runs it inside Sender's commit (same transaction),
on SQLite; everywhere else, and whenever it cannot (it suspends, raises, heartbeats, or its commit
fails), it runs as a usual attempt after that commit. Either way the flow's history and state must
be what a usual attempt leaves: same events, attempt 1, nothing counted as a failure.

Where the Execute ran is told by the asyncio task that ran it: a usual attempt runs in a task named
after its own execution ID ("Waiter-1"); a folded one inside the committing task (Sender's, or the
client's commit).
"""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from dex_engine import (
    Attribute,
    Channel,
    Context,
    Flow,
    HistoryEntry,
    Movement,
    Registry,
    RetryPolicy,
    RpcContext,
    RPCResult,
    Step,
    StepDecision,
    StepDurability,
    StepOptions,
    Stream,
    Wait,
    rpc,
)
from dex_engine import _transitions as tx
from dex_engine._limits import MAX_FOLDED_EXECUTES_PER_COMMIT
from dex_engine._records import Lease

from .conftest import Engine, engine_for, history_has, wait_until

Inbox = Channel("Inbox", str)
Note = Attribute("Note", str)
Log = Stream("Log", str)

Handler = Callable[[Context, None], Awaitable[StepDecision]]


@rpc(request_type=str)
async def post(ctx: RpcContext, text: str) -> None:
    ctx.publish(Inbox, text)


def fold_flow(flow_type: str, waiter: Handler, *, pure: bool = True, sender_publishes: bool = True) -> Flow:
    """Arm -> (Waiter, Sender); Waiter waits for Inbox, then goes to Done, which completes the flow."""

    async def arm(ctx: Context, _: None) -> StepDecision:
        return StepDecision.go_to_many(("Waiter", None), ("Sender", None))

    async def sender(ctx: Context, _: None) -> StepDecision:
        if sender_publishes:
            ctx.publish(Inbox, "go")
        return StepDecision.dead_end()

    async def waiter_wait(ctx: Context, _: None) -> Wait:
        return Wait.until(Inbox.for_one())

    async def done(ctx: Context, _: None) -> StepDecision:
        return StepDecision.graceful_complete(ctx.get(Note))

    return Flow(flow_type, [
        Step("Arm", arm), Step("Sender", sender),
        Step("Waiter", waiter, wait_for=waiter_wait, pure_execute=pure),
        Step("Done", done),
    ], start_step="Arm", schema=[Inbox, Note, Log], rpcs=[post])


def recording_waiter(calls: list[str], before: Callable[[Context], Awaitable[None]] | None = None) -> Handler:
    """A Waiter Execute that logs the task it runs in, then writes Note and Log and goes to Done."""

    async def waiter(ctx: Context, _: None) -> StepDecision:
        task = asyncio.current_task()
        calls.append("" if task is None else task.get_name())
        if before is not None:
            await before(ctx)
        assert ctx.wait_result is not None
        ctx.set(Note, f"got {ctx.wait_result.messages(Inbox)}")
        ctx.append(Log, "waiter")
        return StepDecision.go_to("Done")

    return waiter


def shape(history: list[HistoryEntry]) -> list[tuple[str, str, int, str]]:
    return [(h.event_type, h.step_execution_id, h.attempt, h.detail) for h in history]


async def finished(eng: Engine, flow_id: str) -> Any:
    info = await eng.client.wait_for_flow(flow_id, 10)
    assert info.status == "completed", info
    return await eng.client.flow_output(flow_id)


# Folding is opportunistic: a commit the store hands to its thread (while that thread is busy,
# e.g. with a worker's poll) runs no handler there. So these run a few flows and ask that at least
# one folded, and that every one of them ended as a usual attempt would have. Their worker polls
# and housekeeps only every 30 s, longer than any wait here: its own work seldom keeps the store's
# thread busy, and each attempt must be handed out by the commit that readies it (one a commit lost
# would wait for a poll, and the test time out).
TRIES = 10


@asynccontextmanager
async def quiet_engine(db_url: str, registry: Registry, **overrides: Any) -> AsyncIterator[Engine]:
    async with engine_for(db_url, registry, worker=False) as eng:
        await eng.start_worker(**{"poll_seconds": 30.0, "housekeeping_seconds": 30.0, "lease_renew_seconds": 5.0,
                                  "lease_ttl_seconds": 30.0, **overrides})
        yield eng


async def test_pure_execute_runs_in_the_commit_that_readies_it_and_leaves_the_same_history(db_url: str) -> None:
    folded_calls: list[str] = []
    usual_calls: list[str] = []
    registry = Registry([fold_flow("Folded", recording_waiter(folded_calls)),
                         fold_flow("Usual", recording_waiter(usual_calls), pure=False)])
    async with quiet_engine(db_url, registry) as eng:
        await eng.client.start_flow("Usual", "u")
        assert await finished(eng, "u") == "got ['go']"
        usual = shape(await eng.client.get_flow_history("u"))
        for i in range(TRIES):
            # The same flow without pure_execute never folds, however the commits fall.
            await eng.client.start_flow("Usual", f"u{i}")
            assert await finished(eng, f"u{i}") == "got ['go']"
            assert shape(await eng.client.get_flow_history(f"u{i}")) == usual
            await eng.client.start_flow("Folded", f"f{i}")
            assert await finished(eng, f"f{i}") == "got ['go']"
            assert shape(await eng.client.get_flow_history(f"f{i}")) == usual
            events = await eng.client.read_stream(f"f{i}", Log)
            assert [(e.value, e.step_execution_id, e.attempt) for e in events.events] == [("waiter", "Waiter-1", 1)]
        assert usual_calls == ["Waiter-1"] * (TRIES + 1)
        assert len(folded_calls) == TRIES
        assert set(folded_calls) <= {"Sender-1", "Waiter-1"}
        if db_url.startswith("sqlite"):
            assert "Sender-1" in folded_calls, folded_calls
        else:
            assert set(folded_calls) == {"Waiter-1"}


async def test_a_commit_that_claims_a_pure_steps_wait_for_runs_no_execute_in_it(db_url: str) -> None:
    """Arm's commit readies Waiter, whose WaitFor cannot run early (it reads its execution ID), and
    claims that WaitFor's attempt. Only an Execute folds into a commit: the WaitFor runs as usual
    and waits for Inbox, and the pure Execute runs only after a message came. Catches a claimed
    WaitFor folded as if it were the Step's Execute (run before its wait, with no wait result)."""
    executed: list[tuple[str, list[str] | None]] = []

    async def arm(ctx: Context, _: None) -> StepDecision:
        return StepDecision.go_to("Waiter")

    async def waiter_wait(ctx: Context, _: None) -> Wait:
        assert ctx.step_execution_id == "Waiter-1"
        return Wait.until(Inbox.for_one())

    async def waiter(ctx: Context, _: None) -> StepDecision:
        executed.append((ctx.step_execution_id, None if ctx.wait_result is None else ctx.wait_result.messages(Inbox)))
        return StepDecision.graceful_complete()

    flow = Flow("PureWaiter", [Step("Arm", arm), Step("Waiter", waiter, wait_for=waiter_wait, pure_execute=True)],
                start_step="Arm", schema=[Inbox], rpcs=[post])
    async with quiet_engine(db_url, Registry([flow])) as eng:
        for i in range(TRIES):
            await eng.client.start_flow("PureWaiter", f"w{i}")
            await wait_until("Waiter waiting", lambda: eng.client.search_flows('ActiveStepTypes = "Waiter"'))
            assert executed == [("Waiter-1", ["go"])] * i
            await eng.client.rpc(f"w{i}", "post", "go")
            assert (await eng.client.wait_for_flow(f"w{i}", 10)).status == "completed"
    assert executed == [("Waiter-1", ["go"])] * TRIES


@pytest.mark.sqlite_only
async def test_pure_execute_folds_into_a_client_commit_on_the_workers_loop(db_url: str) -> None:
    calls: list[str] = []
    registry = Registry([fold_flow("Folded", recording_waiter(calls), sender_publishes=False)])
    async with quiet_engine(db_url, registry) as eng:
        for i in range(TRIES):
            await eng.client.start_flow("Folded", f"f{i}")
            await wait_until("Waiter waiting", lambda: eng.client.search_flows('ActiveStepTypes = "Waiter"'))
            await eng.client.rpc(f"f{i}", "post", "hello")
            assert await finished(eng, f"f{i}") == "got ['hello']"
        assert len(calls) == TRIES
        assert [c for c in calls if c != "Waiter-1"], "no Waiter ran inside the client's commit"


async def _suspend(_ctx: Context) -> None:
    await asyncio.sleep(0)


async def _heartbeat(ctx: Context) -> None:
    await ctx.heartbeat()


def called_from(function_name: str) -> bool:
    """Whether a frame of `function_name` is on the stack: the worker's fold_execute when a handler
    runs inside a commit, _transitions.commit_folded when its commit does."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == function_name:
            return True
        frame = frame.f_back
    return False


async def run_tries(eng: Engine) -> None:
    """TRIES flows one after the other; each ends as if Waiter had run as a usual attempt 1."""
    for i in range(TRIES):
        await eng.client.start_flow("Folded", f"f{i}")
        assert await finished(eng, f"f{i}") == "got ['go']"
        history = await eng.client.get_flow_history(f"f{i}")
        waiter = [(h.event_type, h.attempt) for h in history if h.step_execution_id == "Waiter-1"]
        assert waiter == [("step_scheduled", 0), ("wait_registered", 1), ("wait_completed", 0),
                          ("execute_completed", 1)], history
        assert not [h for h in history if h.event_type == "attempt_failed"], history
        events = await eng.client.read_stream(f"f{i}", Log)
        assert [e.value for e in events.events] == ["waiter"]


@pytest.mark.sqlite_only
@pytest.mark.parametrize("before", [_suspend, _heartbeat], ids=["suspends", "heartbeats"])
async def test_pure_execute_that_suspends_or_heartbeats_runs_as_a_usual_attempt(
    db_url: str, before: Callable[[Context], Awaitable[None]],
) -> None:
    calls: list[str] = []
    async with quiet_engine(db_url, Registry([fold_flow("Folded", recording_waiter(calls, before))])) as eng:
        await run_tries(eng)
        # Each Waiter ran once as attempt 1; some were first stepped inside Sender's commit, up to
        # where they suspended, and dropped.
        assert calls.count("Waiter-1") == TRIES
        assert set(calls) == {"Sender-1", "Waiter-1"}, calls


@pytest.mark.sqlite_only
async def test_pure_execute_that_raises_in_the_fold_costs_no_attempt(db_url: str) -> None:
    calls: list[str] = []
    inner = recording_waiter(calls)

    async def raises_when_folded(ctx: Context, value: None) -> StepDecision:
        if called_from("fold_execute"):
            calls.append("raised")
            raise RuntimeError("fails inside the fold only")
        return await inner(ctx, value)

    async with quiet_engine(db_url, Registry([fold_flow("Folded", raises_when_folded)])) as eng:
        await run_tries(eng)
        assert calls.count("Waiter-1") == TRIES
        assert "raised" in calls, calls


@pytest.mark.sqlite_only
async def test_folded_commit_that_fails_rolls_back_alone(db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The savepoint: a folded Execute whose commit fails leaves Sender's commit whole and runs again."""
    calls: list[str] = []
    failed: list[str] = []
    real = tx.commit_execute

    def failing_when_folded(db: tx.Db, lease: Any, *args: Any, **kwargs: Any) -> None:
        real(db, lease, *args, **kwargs)
        if lease.step_type == "Waiter" and called_from("commit_folded"):
            failed.append(lease.step_execution_id)
            raise RuntimeError("the folded commit fails after its statements ran")

    monkeypatch.setattr(tx, "commit_execute", failing_when_folded)
    async with quiet_engine(db_url, Registry([fold_flow("Folded", recording_waiter(calls))])) as eng:
        await run_tries(eng)
        assert failed, "no folded commit was tried"
        assert calls.count("Waiter-1") == TRIES
        assert calls.count("Sender-1") == len(failed)
        for i in range(TRIES):
            counted = [(h.event_type, h.step_execution_id) for h in await eng.client.get_flow_history(f"f{i}")]
            for event in [("execute_completed", "Sender-1"), ("wait_completed", "Waiter-1"),
                          ("execute_completed", "Waiter-1"), ("step_scheduled", "Done-1")]:
                assert counted.count(event) == 1, (event, counted)


Inbox2 = Channel("Inbox2", str)


@rpc(request_type=str)
async def post_both(ctx: RpcContext, text: str) -> None:
    ctx.publish(Inbox, text)
    ctx.publish(Inbox2, text)


@pytest.mark.sqlite_only
@pytest.mark.parametrize("other_first", [False, True], ids=["Other claim pending", "Other claim handed out"])
async def test_a_folded_execute_that_cancels_a_step_claimed_in_the_same_commit_keeps_it_from_starting(
    db_url: str, other_first: bool
) -> None:
    """One client commit makes Waiter (pure) and Other ready, and claims both; Waiter, folded into
    that commit, cancels Other. Other's attempt must not be started: its task is gone, and the
    worker, woken before it learns of the attempt, would not revoke it until its next housekeeping.
    Other's claim comes after Waiter's (still pending when Waiter runs) or before it (already
    handed out, as Other is not pure). Catches the claimed attempts of a folded commit being handed
    out unfiltered, or filtered the wrong way round (E9)."""
    waiter_tasks: list[str] = []
    other_runs: list[str] = []

    async def arm(ctx: Context, _: None) -> StepDecision:
        movements = [("Waiter", None), ("Other", None)]
        return StepDecision.go_to_many(*(movements[::-1] if other_first else movements))

    async def wait_inbox(ctx: Context, _: None) -> Wait:
        return Wait.until(Inbox.for_one())

    async def wait_inbox2(ctx: Context, _: None) -> Wait:
        return Wait.until(Inbox2.for_one())

    async def waiter(ctx: Context, _: None) -> StepDecision:
        task = asyncio.current_task()
        waiter_tasks.append("" if task is None else task.get_name())
        return StepDecision.go_to("Done").with_canceling_steps("Other")

    async def other(ctx: Context, _: None) -> StepDecision:
        other_runs.append(ctx.flow_id)
        await asyncio.sleep(0.3)  # stands for a tool call: it must not have started at all
        return StepDecision.dead_end()

    async def done(ctx: Context, _: None) -> StepDecision:
        return StepDecision.graceful_complete("done")

    flow = Flow("Cancelling", [
        Step("Arm", arm), Step("Waiter", waiter, wait_for=wait_inbox, pure_execute=True),
        Step("Other", other, wait_for=wait_inbox2), Step("Done", done),
    ], start_step="Arm", schema=[Inbox, Inbox2], rpcs=[post_both])
    async with quiet_engine(db_url, Registry([flow])) as eng:
        folded: list[str] = []
        for i in range(TRIES):
            flow_id = f"c{i}"
            await eng.client.start_flow("Cancelling", flow_id)
            await wait_until("Other waiting", lambda: eng.client.search_flows('ActiveStepTypes = "Other"'))
            await eng.client.rpc(flow_id, "post_both", "go")
            assert await finished(eng, flow_id) == "done"
            await asyncio.sleep(0.05)  # an attempt handed out by mistake would have started by now
            if waiter_tasks[-1] != "Waiter-1":
                folded.append(flow_id)
                assert flow_id not in other_runs, f"Other ran in {flow_id} after the folded Waiter cancelled it"
            history = await eng.client.get_flow_history(flow_id)
            assert ("step_cancelled", "Other-1") in [(h.event_type, h.step_execution_id) for h in history]
        assert folded, "no Waiter ran inside the client's commit"


@pytest.mark.sqlite_only
async def test_one_commit_runs_at_most_max_folded_executes_pure_steps(db_url: str) -> None:
    """A chain of pure Steps, each started by the one before: a commit runs at most
    MAX_FOLDED_EXECUTES_PER_COMMIT of them while it holds the write lock, and the Step after those
    runs as a usual attempt of its own. Catches the bound not being applied (or applied per Step,
    not per commit)."""
    chain = MAX_FOLDED_EXECUTES_PER_COMMIT + 2
    ran_in: dict[str, list[str]] = {}

    def pure(n: int) -> Step[None]:
        async def execute(ctx: Context, _: None) -> StepDecision:
            task = asyncio.current_task()
            ran_in.setdefault(ctx.flow_id, []).append("" if task is None else task.get_name())
            if n == chain:
                return StepDecision.graceful_complete("end")
            return StepDecision.go_to(f"P{n + 1}")

        return Step(f"P{n}", execute, pure_execute=True)

    async def start(ctx: Context, _: None) -> StepDecision:
        return StepDecision.go_to("P1")

    flow = Flow("Chain", [Step("Start", start), *(pure(n) for n in range(1, chain + 1))], start_step="Start")
    async with quiet_engine(db_url, Registry([flow])) as eng:
        full_runs = 0
        for i in range(TRIES):
            await eng.client.start_flow("Chain", f"c{i}")
            assert await finished(eng, f"c{i}") == "end"
            tasks = ran_in[f"c{i}"]
            assert len(tasks) == chain
            # Runs of Steps folded into one commit: those that did not run in their own task.
            folded_runs = [0]
            for n, task in enumerate(tasks, start=1):
                if task == f"P{n}-1":
                    folded_runs.append(0)
                else:
                    folded_runs[-1] += 1
            assert max(folded_runs) <= MAX_FOLDED_EXECUTES_PER_COMMIT, tasks
            full_runs += folded_runs.count(MAX_FOLDED_EXECUTES_PER_COMMIT)
        assert full_runs, f"no commit reached the bound: {ran_in}"


@pytest.mark.sqlite_only
@pytest.mark.parametrize("pure_first", [True, False], ids=["Hold a pending", "Hold a handed out"])
async def test_steps_a_folded_execute_starts_fill_only_the_workers_free_slots(
    db_url: str, monkeypatch: pytest.MonkeyPatch, pure_first: bool
) -> None:
    """Start hands out Pure and Hold a in one commit; Pure, folded there while Hold a's claim is
    still pending in it or already handed out, starts Holds b, c and d. The worker runs three
    attempts at once, so the fold may claim only two of them for it: d stays ready until a slot is
    free. Catches a fold that counts either kind of claim as a free slot: the worker would get four
    and hand one back. SQLite only: PostgreSQL folds nothing, and there a worker's poll woken by
    the commit's NOTIFY may claim d at the same time, which the worker rightly hands back."""
    slots = 3
    entered: list[str] = []
    ran_in: list[str] = []
    release = asyncio.Event()

    async def start(ctx: Context, _: None) -> StepDecision:
        movements = [("Pure", None), ("Hold", "a")]
        return StepDecision.go_to_many(*(movements if pure_first else movements[::-1]))

    async def pure(ctx: Context, _: None) -> StepDecision:
        task = asyncio.current_task()
        ran_in.append("" if task is None else task.get_name())
        return StepDecision.go_to_many(("Hold", "b"), ("Hold", "c"), ("Hold", "d"))

    async def hold(ctx: Context, name: str) -> StepDecision:
        entered.append(f"{ctx.flow_id}/{name}")
        await release.wait()
        return StepDecision.graceful_complete()  # the last one closes the flow

    flow = Flow("Fan", [Step("Start", start), Step("Pure", pure, pure_execute=True),
                        Step("Hold", hold, input_type=str)], start_step="Start")
    async with engine_for(db_url, Registry([flow]), worker=False) as eng:
        await eng.start_worker(max_concurrent_tasks=slots, poll_seconds=30.0, housekeeping_seconds=30.0,
                               lease_renew_seconds=5.0, lease_ttl_seconds=30.0)
        handed_back: list[str] = []
        release_unstarted = eng.store.release_unstarted

        async def counting(lease: Lease) -> None:
            handed_back.append(f"{lease.flow_id}/{lease.step_execution_id}")
            await release_unstarted(lease)

        monkeypatch.setattr(eng.store, "release_unstarted", counting)
        for i in range(TRIES):
            release.clear()
            entered.clear()
            await eng.client.start_flow("Fan", f"f{i}")

            async def full() -> bool:
                return len(entered) >= slots

            await wait_until("the worker's slots to fill", full)
            info = await eng.client.describe_flow(f"f{i}")
            states = sorted(s.state for s in info.active_steps)
            assert states == ["ready", "running", "running", "running"], (states, entered)
            assert sorted(entered) == [f"f{i}/a", f"f{i}/b", f"f{i}/c"], "a claim the fold handed out was lost"
            release.set()
            assert (await eng.client.wait_for_flow(f"f{i}", 10)).status == "completed"
            assert len(entered) == 4
        assert handed_back == [], "claims beyond the worker's free slots were handed back"
    assert "Start-1" in ran_in, f"Pure never folded into Start's commit: {ran_in}"


def thread_recording_flow(flow_type: str, threads: list[int], sender_durability: StepDurability) -> Flow:
    """Arm -> (Waiter, Sender) as fold_flow, with Sender's durability set and a Waiter that records
    the thread it runs on before anything else (asyncio.current_task() needs the loop's thread)."""

    async def arm(ctx: Context, _: None) -> StepDecision:
        return StepDecision.go_to_many(("Waiter", None), ("Sender", None))

    async def sender(ctx: Context, _: None) -> StepDecision:
        ctx.publish(Inbox, "go")
        return StepDecision.dead_end()

    async def waiter_wait(ctx: Context, _: None) -> Wait:
        return Wait.until(Inbox.for_one())

    async def waiter(ctx: Context, _: None) -> StepDecision:
        threads.append(threading.get_ident())
        return StepDecision.graceful_complete(called_from("fold_execute"))

    return Flow(flow_type, [
        Step("Arm", arm), Step("Sender", sender, options=StepOptions(durability=sender_durability)),
        Step("Waiter", waiter, wait_for=waiter_wait, pure_execute=True,
             options=StepOptions(durability=StepDurability.SYNC)),
    ], start_step="Arm", schema=[Inbox])


@pytest.mark.sqlite_only
async def test_a_commit_on_the_store_thread_runs_no_handler(tmp_path: Path) -> None:
    """With every operation on the store's thread (?inline=off), no pure Execute is folded: its
    handler would run off its event loop. Catches the fold's thread check being dropped."""
    threads: list[int] = []
    url = f"sqlite:///{tmp_path / 'off.db'}?inline=off"
    async with quiet_engine(url, Registry([thread_recording_flow("Off", threads, StepDurability.SYNC)])) as eng:
        for i in range(TRIES):
            await eng.client.start_flow("Off", f"f{i}")
            assert await finished(eng, f"f{i}") is False  # Waiter ran as a usual attempt
    assert threads == [threading.get_ident()] * TRIES


@pytest.mark.sqlite_only
async def test_a_commit_that_skips_the_fsync_folds_no_durable_step(db_url: str) -> None:
    """An ASYNC Step's commit skips the fsync; a SYNC pure Step it readies must not commit inside it,
    or the SYNC result could be lost on power failure. The same flow with a SYNC Sender does fold,
    so the test can tell. Catches the durability check being dropped."""
    async_folds: list[bool] = []
    sync_folds: list[bool] = []
    threads: list[int] = []
    registry = Registry([thread_recording_flow("AsyncSender", threads, StepDurability.ASYNC),
                         thread_recording_flow("SyncSender", threads, StepDurability.SYNC)])
    async with quiet_engine(db_url, registry) as eng:
        for i in range(TRIES):
            for flow_type, folds in (("AsyncSender", async_folds), ("SyncSender", sync_folds)):
                await eng.client.start_flow(flow_type, f"{flow_type}-{i}")
                folds.append(await finished(eng, f"{flow_type}-{i}"))
    assert not any(async_folds), async_folds
    assert any(sync_folds), sync_folds


RETRY_SECONDS = 2.0  # Locked's retry is due this long after its failure: time to hand Hog the slot


def held_lock_flow(runs: list[tuple[int, str]], hog_release: asyncio.Event) -> Flow:
    """Arm -> (Locked, Hog). Locked (pure, taking the lock Note) fails its first attempt and goes
    to After (which takes Note too) on its retry; Hog waits for Inbox, then runs until released."""

    async def arm(ctx: Context, _: None) -> StepDecision:
        return StepDecision.go_to_many(("Locked", None), ("Hog", None))

    async def locked(ctx: Context, _: None) -> StepDecision:
        task = asyncio.current_task()
        runs.append((ctx.attempt, "" if task is None else task.get_name()))
        if ctx.attempt == 1:
            raise RuntimeError("first attempt fails")
        return StepDecision.go_to("After")

    async def hog_wait(ctx: Context, _: None) -> Wait:
        return Wait.until(Inbox.for_one())

    async def hog(ctx: Context, _: None) -> StepDecision:
        await hog_release.wait()
        return StepDecision.dead_end()

    async def after(ctx: Context, _: None) -> StepDecision:
        return StepDecision.graceful_complete("after")

    retry = RetryPolicy(max_attempts=2, initial_interval_seconds=RETRY_SECONDS, max_interval_seconds=RETRY_SECONDS)
    return Flow("HeldLock", [
        Step("Arm", arm),
        Step("Locked", locked, pure_execute=True, options=StepOptions(execute_locks=(Note,), execute_retry=retry)),
        Step("Hog", hog, wait_for=hog_wait),
        Step("After", after, options=StepOptions(execute_locks=(Note,))),
    ], start_step="Arm", schema=[Inbox, Note], rpcs=[post])


@pytest.mark.sqlite_only
async def test_a_retry_folded_into_another_steps_commit_releases_the_locks_it_held(db_url: str) -> None:
    """A pure Step's retry holds the locks its failed attempt took. With the worker's one slot busy
    (Hog) when the retry comes due, Hog's commit claims it and runs its Execute inside that commit;
    that commit must release those locks, or After, which takes the same lock, never runs. The
    agent session's pure Steps take locks (AwaitUserMessage, ResumeTurn). Catches: a folded retry's
    locks kept after its task is gone (seen only in a mutant)."""
    runs: list[tuple[int, str]] = []
    hog_release = asyncio.Event()
    retry_tasks: list[str] = []  # the task each flow's retry ran in: "Hog-1" when folded into Hog's commit
    async with quiet_engine(db_url, Registry([held_lock_flow(runs, hog_release)]), max_concurrent_tasks=1) as eng:
        for i in range(3):
            runs.clear()
            hog_release.clear()
            flow_id = f"h{i}"
            await eng.client.start_flow("HeldLock", flow_id)
            await wait_until("Locked's first attempt failed",
                             lambda f=flow_id: history_has(eng, f, "attempt_failed", "Locked-1"))
            await eng.client.rpc(flow_id, "post", "go")  # Hog takes the slot
            await asyncio.sleep(RETRY_SECONDS + 0.5)  # the retry is due, and waits for a slot
            hog_release.set()
            assert await finished(eng, flow_id) == "after"
            assert runs[-1][0] == 2, runs
            retry_tasks.append(runs[-1][1])
    assert "Hog-1" in retry_tasks, f"no retry was folded into Hog's commit: {retry_tasks}"


def cross_flow(got: list[tuple[str, list[str]]], relay_tasks: list[str], release: dict[str, asyncio.Event]) -> Flow:
    """A flow started with "hog" runs Hog, which waits for release[flow_id], publishes on its own
    Inbox and ends. One started with "pair" has Waiter wait for its Inbox; its RPC `kick` readies
    Relay (pure), which publishes on that Inbox."""

    async def start(ctx: Context, role: str) -> StepDecision:
        return StepDecision.go_to("Hog" if role == "hog" else "Waiter")

    async def hog(ctx: Context, _: None) -> StepDecision:
        await release[ctx.flow_id].wait()
        ctx.publish(Inbox, f"from {ctx.flow_id}")
        return StepDecision.dead_end()

    async def relay(ctx: Context, _: None) -> StepDecision:
        task = asyncio.current_task()
        relay_tasks.append("" if task is None else task.get_name())
        ctx.publish(Inbox, f"from {ctx.flow_id}")
        return StepDecision.dead_end()

    async def waiter_wait(ctx: Context, _: None) -> Wait:
        return Wait.until(Inbox.for_one())

    async def waiter(ctx: Context, _: None) -> StepDecision:
        assert ctx.wait_result is not None
        got.append((ctx.flow_id, ctx.wait_result.messages(Inbox)))
        return StepDecision.graceful_complete()

    @rpc(request_type=type(None))
    async def kick(ctx: RpcContext, _: None) -> RPCResult[None]:
        return RPCResult(None, next_steps=(Movement("Relay", None),))

    return Flow("Cross", [
        Step("Start", start, input_type=str), Step("Hog", hog), Step("Relay", relay, pure_execute=True),
        Step("Waiter", waiter, wait_for=waiter_wait),
    ], start_step="Start", schema=[Inbox], rpcs=[kick])


@pytest.mark.sqlite_only
async def test_a_fold_of_another_flows_execute_takes_only_that_flows_messages(db_url: str) -> None:
    """Hog of flow A publishes on A's Inbox, and its commit claims Relay of flow B (ready, while
    both worker slots were busy) and runs it inside: Relay publishes on B's Inbox, which B's Waiter
    waits for. Both messages are unwritten in that one commit, and B's Waiter must take B's.
    Catches: a wait taking an unwritten message of another flow with the same channel name (seen
    only in a mutant, which gave B's Waiter A's message)."""
    got: list[tuple[str, list[str]]] = []
    relay_tasks: list[str] = []
    release: dict[str, asyncio.Event] = {}
    async with quiet_engine(db_url, Registry([cross_flow(got, relay_tasks, release)]), max_concurrent_tasks=2) as eng:
        for i in range(3):
            a, b, other = f"a{i}", f"b{i}", f"x{i}"
            await eng.client.start_flow("Cross", b, "pair")
            await wait_until("B's Waiter waits", lambda b=b: history_has(eng, b, "wait_registered", "Waiter-1"))
            for hog_flow in (a, other):
                release[hog_flow] = asyncio.Event()
                await eng.client.start_flow("Cross", hog_flow, "hog")
                await wait_until(f"{hog_flow}'s Hog runs",
                                 lambda f=hog_flow: history_has(eng, f, "step_scheduled", "Hog-1"))
            await asyncio.sleep(0.2)  # both Hogs hold the worker's two slots
            await eng.client.rpc(b, "kick", None)  # Relay is ready, and no slot is free
            release[a].set()
            await asyncio.sleep(0.5)  # nothing else runs on the loop while Hog commits: it may fold
            assert await finished(eng, b) is None
            release[other].set()
    assert got == [(f"b{i}", [f"from b{i}"]) for i in range(3)], got
    assert "Hog-1" in relay_tasks, f"no Relay ran inside a Hog's commit: {relay_tasks}"
