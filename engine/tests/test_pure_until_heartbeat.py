"""Step.pure_until_heartbeat: a handler runs inside the commit that makes its Step ready, up to its
first heartbeat, which that commit records; it goes on from there once the commit is durable.

The flows here are Arm -> Tool. Tool writes an event, heartbeats with a checkpoint (on SQLite,
inside Arm's commit when it folds), writes another event and heartbeats again (a usual heartbeat),
fails its first attempt, and completes in its second. Whether Tool's first part ran inside Arm's
commit or not, the flow must end exactly as with a usual attempt: same history, same events under
the same attempts, and attempt 2 reads the checkpoint attempt 1 saved with its first heartbeat.
Crashes are in test_crash.py (a kill inside the combined commit; a kill after it).
"""

from __future__ import annotations

import asyncio
import threading
from contextvars import ContextVar
from typing import Any

import pytest

from dex_engine import (
    Attribute,
    Context,
    Flow,
    FlowDefinitionError,
    Registry,
    RetryPolicy,
    Step,
    StepDecision,
    StepDurability,
    StepOptions,
    Stream,
)
from dex_engine import _transitions as tx
from dex_engine._context import NotFoldable
from dex_engine._parked import FoldFunctions, Resumed

from .conftest import Engine, stop_while_a_claim_lands, wait_until
from .test_pure_execute import TRIES, called_from, finished, quiet_engine, shape

Log = Stream("Log", str)
Note = Attribute("Note", str)
QUICK_RETRY = RetryPolicy(max_attempts=2, initial_interval_seconds=0.01, max_interval_seconds=0.01)
EVENTS = [("started#1", "Tool-1", 1), ("after#1", "Tool-1", 1),
          ("started#2", "Tool-1", 2), ("after#2", "Tool-1", 2), ("done", "Tool-1", 2)]

# Folding is opportunistic: Tool is stepped inside Arm's commit only when that commit runs on the
# event loop, which needs the loop idle then. So Arm waits a moment before it commits, and the tests
# let each flow run alone for a while (`settled`) before they read it.
ARM_PAUSE = 0.02
SETTLE_SECONDS = 0.2
STREAMED_EVENTS = 20

Call = tuple[str, str, bool]  # (where in the handler, task it ran in, inside fold_execute)
WHERE: ContextVar[str] = ContextVar("WHERE")
# How long a commit's hand-off of a started attempt stays in flight after stop() (drain test).
HANDOFF_LAG = 0.2


def task_name() -> str:
    task = asyncio.current_task()
    return "" if task is None else task.get_name()


async def tool(ctx: Context, calls: list[Call]) -> StepDecision:
    """Tool's Execute: the part before its first heartbeat only reads and writes events."""
    seen_checkpoint = ctx.checkpoint
    calls.append(("pre", task_name(), called_from("fold_execute")))
    ctx.write_event(Log, f"started#{ctx.attempt}")
    try:
        await ctx.heartbeat(f"cp#{ctx.attempt}")
    except GeneratorExit:
        calls.append(("closed", task_name(), False))
        raise
    calls.append(("after", task_name(), called_from("fold_execute")))
    ctx.write_event(Log, f"after#{ctx.attempt}")
    await ctx.heartbeat()
    if ctx.attempt == 1:
        raise RuntimeError("attempt 1 fails after its heartbeats")
    ctx.set(Note, f"attempt 2 saw {seen_checkpoint}")
    ctx.append(Log, "done")
    return StepDecision.graceful_complete(seen_checkpoint)


def park_flow(flow_type: str, calls: list[Call], *, parks: bool = True) -> Flow:
    async def arm(ctx: Context, _: None) -> StepDecision:
        await asyncio.sleep(ARM_PAUSE)
        return StepDecision.go_to("Tool")

    async def run_tool(ctx: Context, _: None) -> StepDecision:
        return await tool(ctx, calls)

    return Flow(flow_type, [
        Step("Arm", arm),
        Step("Tool", run_tool, pure_until_heartbeat=parks, options=StepOptions(execute_retry=QUICK_RETRY)),
    ], start_step="Arm", schema=[Note, Log])


async def settled(eng: Any, flow_id: str) -> Any:
    """The completed flow's output, read once it has had the loop to itself for a while."""
    await asyncio.sleep(SETTLE_SECONDS)
    return await finished(eng, flow_id)


async def events(eng: Any, flow_id: str) -> list[tuple[str, str, int]]:
    page = await eng.client.read_stream(flow_id, Log)
    return [(e.value, e.step_execution_id, e.attempt) for e in page.events]


async def test_a_parked_heartbeat_leaves_what_a_usual_attempt_leaves(db_url: str) -> None:
    parked: list[Call] = []
    usual_calls: list[Call] = []
    registry = Registry([park_flow("Parked", parked), park_flow("Usual", usual_calls, parks=False)])
    async with quiet_engine(db_url, registry) as eng:
        await eng.client.start_flow("Usual", "u")
        assert await finished(eng, "u") == "cp#1"
        usual = shape(await eng.client.get_flow_history("u"))
        assert await events(eng, "u") == EVENTS
        for i in range(TRIES):
            await eng.client.start_flow("Parked", f"p{i}")
            assert await settled(eng, f"p{i}") == "cp#1"  # attempt 2 read the checkpoint of the first heartbeat
            assert shape(await eng.client.get_flow_history(f"p{i}")) == usual
            assert await events(eng, f"p{i}") == EVENTS
            assert await eng.client.get_attribute(f"p{i}", Note) == "attempt 2 saw cp#1"
        assert not [c for c in usual_calls if c[2]], usual_calls
        # After the heartbeat, the handler always runs in its attempt's own task, after the commit.
        assert {c for c in parked if c[0] == "after"} == {("after", "Tool-1", False)}, parked
        assert not [c for c in parked if c[0] == "closed"], parked
        folded = [c for c in parked if c == ("pre", "Arm-1", True)]
        if db_url.startswith("sqlite"):
            assert folded, parked
            # Each folded attempt 1 ran its first part once, inside Arm's commit, and went on from there.
            assert len([c for c in parked if c[0] == "pre"]) == 2 * TRIES, parked
        else:
            assert not folded, parked


@pytest.mark.sqlite_only
async def test_a_parked_handler_goes_on_in_a_worker_with_no_slot_free(db_url: str) -> None:
    """With max_concurrent_tasks=1, Arm holds the worker's one slot while it commits; its commit
    counts that slot as free (Arm ends with it), claims Tool, runs Tool up to its heartbeat inside
    the commit, and Tool goes on from there in the slot Arm left. Catches a commit that claims for
    no more than the slots free besides its own (no fold at all with one slot)."""
    parked: list[Call] = []
    registry = Registry([park_flow("Parked", parked)])
    async with quiet_engine(db_url, registry, max_concurrent_tasks=1) as eng:
        for i in range(TRIES):
            await eng.client.start_flow("Parked", f"p{i}")
            assert await settled(eng, f"p{i}") == "cp#1"
            assert await events(eng, f"p{i}") == EVENTS
    assert [c for c in parked if c == ("pre", "Arm-1", True)], parked
    assert {c for c in parked if c[0] == "after"} == {("after", "Tool-1", False)}, parked
    assert not [c for c in parked if c[0] == "closed"], parked


@pytest.mark.sqlite_only
async def test_a_parked_heartbeat_whose_savepoint_fails_runs_the_handler_again_as_usual(
    db_url: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The folded heartbeat's savepoint rolls back alone: Arm's commit stands, the parked handler is
    closed (it never goes on), and Tool runs from the start as a usual attempt 1."""
    calls: list[Call] = []
    real = tx.heartbeat
    failed: list[str] = []

    def failing_when_folded(db: tx.Db, lease: Any, *args: Any, **kwargs: Any) -> None:
        real(db, lease, *args, **kwargs)
        if called_from("heartbeat_folded"):
            failed.append(lease.step_execution_id)
            raise RuntimeError("the folded heartbeat fails after its statements ran")

    monkeypatch.setattr(tx, "heartbeat", failing_when_folded)
    async with quiet_engine(db_url, Registry([park_flow("Parked", calls)])) as eng:
        for i in range(TRIES):
            await eng.client.start_flow("Parked", f"p{i}")
            assert await settled(eng, f"p{i}") == "cp#1"
            assert await events(eng, f"p{i}") == EVENTS
            history = [(h.event_type, h.step_execution_id, h.attempt)
                       for h in await eng.client.get_flow_history(f"p{i}")]
            assert history.count(("execute_completed", "Arm-1", 1)) == 1, history
    assert failed, "no folded heartbeat was tried"
    assert calls.count(("closed", "Arm-1", False)) == len(failed), calls  # closed inside Arm's commit
    assert {c for c in calls if c[0] == "after"} == {("after", "Tool-1", False)}, calls
    assert len([c for c in calls if c[0] == "after"]) == 2 * TRIES, calls


async def _suspends(ctx: Context) -> None:
    await asyncio.sleep(0)


@pytest.mark.sqlite_only
async def test_a_handler_that_suspends_before_its_heartbeat_runs_as_a_usual_attempt(db_url: str) -> None:
    calls: list[Call] = []

    async def arm(ctx: Context, _: None) -> StepDecision:
        await asyncio.sleep(ARM_PAUSE)
        return StepDecision.go_to("Tool")

    async def run_tool(ctx: Context, _: None) -> StepDecision:
        await _suspends(ctx)  # awaits the loop: only a usual attempt can
        return await tool(ctx, calls)

    flow = Flow("Suspends", [
        Step("Arm", arm),
        Step("Tool", run_tool, pure_until_heartbeat=True, options=StepOptions(execute_retry=QUICK_RETRY)),
    ], start_step="Arm", schema=[Note, Log])
    async with quiet_engine(db_url, Registry([flow])) as eng:
        for i in range(TRIES):
            await eng.client.start_flow("Suspends", f"s{i}")
            assert await settled(eng, f"s{i}") == "cp#1"
            assert await events(eng, f"s{i}") == EVENTS
    assert {c[1] for c in calls} == {"Tool-1"}, calls


@pytest.mark.sqlite_only
async def test_events_without_a_heartbeat_run_as_a_usual_attempt_and_are_written_once(db_url: str) -> None:
    """A handler that writes a best-effort event and finishes without a heartbeat is not committed
    inside the claiming commit (that commit records events only with a heartbeat): it runs again as
    a usual attempt, and its event is written once, by that attempt."""
    ran_in: list[tuple[str, bool]] = []

    async def arm(ctx: Context, _: None) -> StepDecision:
        await asyncio.sleep(ARM_PAUSE)
        return StepDecision.go_to("Tool")

    async def run_tool(ctx: Context, _: None) -> StepDecision:
        ran_in.append((task_name(), called_from("fold_execute")))
        ctx.write_event(Log, "only")
        return StepDecision.graceful_complete("ok")

    flow = Flow("EventOnly", [Step("Arm", arm), Step("Tool", run_tool, pure_until_heartbeat=True)],
                start_step="Arm", schema=[Log])
    async with quiet_engine(db_url, Registry([flow])) as eng:
        for i in range(TRIES):
            await eng.client.start_flow("EventOnly", f"e{i}")
            assert await settled(eng, f"e{i}") == "ok"
            assert await events(eng, f"e{i}") == [("only", "Tool-1", 1)]
    assert ran_in.count(("Tool-1", False)) == TRIES, ran_in
    assert ("Arm-1", True) in ran_in, ran_in


def test_pure_until_heartbeat_must_be_a_bool() -> None:
    async def execute(ctx: Context, _: None) -> StepDecision:
        return StepDecision.dead_end()

    with pytest.raises(FlowDefinitionError, match="Step 'S' pure_until_heartbeat must be True or False, got 'yes'"):
        Flow("Bad", [Step("S", execute, pure_until_heartbeat="yes")], start_step="S")  # type: ignore[arg-type]


@pytest.mark.sqlite_only
async def test_a_step_that_streams_events_still_readies_a_tool_inside_its_commit(db_url: str) -> None:
    """Arm streams best-effort events while it runs (a model call's deltas), so one of their flushes
    may still be on the store's thread when Arm returns. Arm's commit must still run on the loop and
    step Tool inside it (the built-in loop's first model call, then its tool); queued behind the
    flush on the thread, it could not. Three things make it so, and this catches each one missing
    (at most 4 of 10 folded then): the worker lets that flush finish before the commit; the store's
    thread counts a batch done before it hands out its results; and an operation on the loop waits
    a moment for the connection that thread is about to let go of (INLINE_LOCK_WAIT_SECONDS)."""
    calls: list[Call] = []

    async def arm(ctx: Context, _: None) -> StepDecision:
        for i in range(STREAMED_EVENTS):
            ctx.write_event(Log, f"delta {i}")
            await asyncio.sleep(0)  # the loop runs the flush meanwhile: its op goes to the thread
        return StepDecision.go_to("Tool")

    async def run_tool(ctx: Context, _: None) -> StepDecision:
        return await tool(ctx, calls)

    flow = Flow("Streams", [
        Step("Arm", arm),
        Step("Tool", run_tool, pure_until_heartbeat=True, options=StepOptions(execute_retry=QUICK_RETRY)),
    ], start_step="Arm", schema=[Note, Log])
    async with quiet_engine(db_url, Registry([flow])) as eng:
        for i in range(TRIES):
            await eng.client.start_flow("Streams", f"s{i}")
            assert await settled(eng, f"s{i}") == "cp#1"
            streamed = [(f"delta {n}", "Arm-1", 1) for n in range(STREAMED_EVENTS)]
            assert await events(eng, f"s{i}") == streamed + EVENTS
    folded = [c for c in calls if c == ("pre", "Arm-1", True)]
    assert len(folded) >= TRIES - 2, (len(folded), calls)  # 10 of 10 on an idle machine


@pytest.mark.sqlite_only
async def test_a_parked_handler_keeps_its_context_variables_and_leaks_none(db_url: str) -> None:
    """A ContextVar the handler sets before its first heartbeat it still sees after it (and can reset
    there, which only works in the same Context); the task whose commit ran that first part (here
    the test's own, through start_flow) never sees it."""
    seen: list[tuple[str, str | None, bool]] = []

    async def run_tool(ctx: Context, _: None) -> StepDecision:
        folded = called_from("fold_execute")
        token = WHERE.set(f"set before the heartbeat of {ctx.step_execution_id}")
        await ctx.heartbeat("cp")
        seen.append((task_name(), WHERE.get(None), folded))
        WHERE.reset(token)
        return StepDecision.graceful_complete("ok")

    flow = Flow("Direct", [Step("Tool", run_tool, pure_until_heartbeat=True)], start_step="Tool")
    async with quiet_engine(db_url, Registry([flow])) as eng:
        for i in range(TRIES):
            await eng.client.start_flow("Direct", f"d{i}")
            assert WHERE.get(None) is None, seen
            assert await settled(eng, f"d{i}") == "ok"
    assert {(task, value) for task, value, _ in seen} == {("Tool-1", "set before the heartbeat of Tool-1")}, seen
    assert len(seen) == TRIES, seen
    assert any(folded for *_, folded in seen), seen  # start_flow's commit ran Tool up to its heartbeat


@pytest.mark.sqlite_only
async def test_a_commit_that_skips_its_fsync_runs_no_handler_up_to_its_heartbeat(db_url: str) -> None:
    """A heartbeat is durable once recorded (E10). An ASYNC Step's commit skips the fsync, so it may
    not record Tool's first heartbeat: Tool runs as a usual attempt, and is not even stepped inside it."""
    calls: list[Call] = []

    async def arm(ctx: Context, _: None) -> StepDecision:
        await asyncio.sleep(ARM_PAUSE)
        return StepDecision.go_to("Tool")

    async def run_tool(ctx: Context, _: None) -> StepDecision:
        return await tool(ctx, calls)

    lazy = StepOptions(durability=StepDurability.ASYNC)
    flow = Flow("Lazy", [
        Step("Arm", arm, options=lazy),
        Step("Tool", run_tool, pure_until_heartbeat=True,
             options=StepOptions(durability=StepDurability.ASYNC, execute_retry=QUICK_RETRY)),
    ], start_step="Arm", schema=[Note, Log])
    async with quiet_engine(db_url, Registry([flow])) as eng:
        for i in range(TRIES):
            await eng.client.start_flow("Lazy", f"l{i}")
            assert await settled(eng, f"l{i}") == "cp#1"
            assert await events(eng, f"l{i}") == EVENTS
    assert {c[1:] for c in calls} == {("Tool-1", False)}, calls


async def stopped_at_a_started_handoff(
    eng: Engine, monkeypatch: pytest.MonkeyPatch, flow_type: str, prefix: str,
) -> str:
    """Start `flow_type` flows (IDs `prefix`0, 1, ...) until the worker is stopped while a commit
    hands it a Tool that already started (ran up to its first heartbeat); once the stop returned,
    that flow's ID. Each flow before it must finish with "done"."""
    worker = eng.worker
    assert worker is not None
    stopped = stop_while_a_claim_lands(
        worker, monkeypatch, HANDOFF_LAG, lambda leases: any(lease.started is not None for lease in leases))
    for i in range(TRIES):
        await eng.client.start_flow(flow_type, f"{prefix}{i}")
        if stopped:
            break
        assert await finished(eng, f"{prefix}{i}") == "done"
    assert stopped, "no start_flow ran Tool up to its heartbeat"
    leases, stopping = stopped[0]
    flow_id: str = next(lease.flow_id for lease in leases if lease.started is not None)
    await stopping
    return flow_id


@pytest.mark.sqlite_only
async def test_a_stopping_worker_runs_a_started_attempt_a_commit_in_flight_hands_it(
    db_url: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """stop() may come while a commit that recorded Tool's first heartbeat is still handing Tool to
    the worker. Tool has started then, so the draining worker must run it to the end before it
    unregisters, which would otherwise fail it as lost while its handler went on."""
    ran: list[str] = []

    async def run_tool(ctx: Context, _: None) -> StepDecision:
        await ctx.heartbeat("cp")
        ran.append(ctx.step_execution_id)
        return StepDecision.graceful_complete("done")

    flow = Flow("Direct", [Step("Tool", run_tool, pure_until_heartbeat=True)], start_step="Tool")
    async with quiet_engine(db_url, Registry([flow])) as eng:
        flow_id = await stopped_at_a_started_handoff(eng, monkeypatch, "Direct", "d")
        history = [(h.event_type, h.step_execution_id, h.attempt)
                   for h in await eng.client.get_flow_history(flow_id)]
        assert history == [
            ("step_scheduled", "Tool-1", 0), ("execute_completed", "Tool-1", 1), ("flow_closed", "", 0),
        ], history
        assert await finished(eng, flow_id) == "done"
    assert len(ran) == int(flow_id[1:]) + 1, ran  # each Tool ran once past its heartbeat


@pytest.mark.sqlite_only
async def test_a_resumed_handlers_later_heartbeats_are_its_attempts_own(db_url: str) -> None:
    """Once the commit recorded the first heartbeat, the handler's next ones go to its attempt: the
    checkpoint its second heartbeat saves is the one attempt 2 starts from."""
    folded: list[bool] = []

    async def run_tool(ctx: Context, _: None) -> StepDecision:
        if ctx.attempt == 1:
            folded.append(called_from("fold_execute"))
            await ctx.heartbeat("first")
            await ctx.heartbeat("second")
            raise RuntimeError("attempt 1 fails after its heartbeats")
        return StepDecision.graceful_complete(ctx.checkpoint)

    flow = Flow("Late", [Step("Tool", run_tool, pure_until_heartbeat=True,
                              options=StepOptions(execute_retry=QUICK_RETRY))], start_step="Tool")
    async with quiet_engine(db_url, Registry([flow])) as eng:
        for i in range(TRIES):
            await eng.client.start_flow("Late", f"l{i}")
            assert await settled(eng, f"l{i}") == "second"
    assert any(folded), folded  # start_flow's commit ran attempt 1 up to its first heartbeat


async def test_fold_functions_park_one_heartbeat_and_pass_late_events_on_once_live() -> None:
    """Until the commit hands the handler its attempt's functions, one heartbeat parks it and a second
    (a concurrent task of the handler's) cannot fold; an event another thread writes while it is
    parked is passed on, in order, once the attempt's functions serve, after the events the commit kept."""
    flow = park_flow("Unit", [])
    functions = FoldFunctions(flow, parks=True)
    functions.write_event(Log.name, b'"before"')
    parked = asyncio.ensure_future(functions.heartbeat("cp"))
    await asyncio.sleep(0)
    assert functions.checkpoint == "cp" and not parked.done()
    with pytest.raises(NotFoldable):
        await asyncio.wait_for(functions.heartbeat("again"), 5)  # parked for good, were it let through
    for data in (b'"late 1"', b'"late 2"'):
        writer = threading.Thread(target=functions.write_event, args=(Log.name, data))
        writer.start()
        writer.join()
    beats: list[str | None] = []
    written: list[tuple[str, bytes]] = []

    async def live_heartbeat(checkpoint: str | None) -> None:
        beats.append(checkpoint)

    functions.go_live(live_heartbeat, lambda stream, data: written.append((stream, data)))
    await asyncio.wait_for(parked, 5)  # go_live let the parked heartbeat return
    assert functions.events == [(Log.name, flow.streams[Log.name].capacity_bytes, b'"before"')]
    assert written == [(Log.name, b'"late 1"'), (Log.name, b'"late 2"')]
    functions.write_event(Log.name, b'"after"')
    await functions.heartbeat("later")
    assert written[2:] == [(Log.name, b'"after"')]
    assert beats == ["later"]
    assert functions.checkpoint == "cp"  # what the commit recorded stays as it was


async def test_fold_functions_that_do_not_park_refuse_heartbeats_and_events() -> None:
    """A pure_execute handler (no parking) that heartbeats or writes an event cannot run inside a
    commit: both raise NotFoldable, and nothing is kept for the commit."""
    functions = FoldFunctions(park_flow("Unit", []), parks=False)
    with pytest.raises(NotFoldable):
        await functions.heartbeat(None)
    with pytest.raises(NotFoldable):
        functions.write_event(Log.name, b'"x"')
    assert functions.events == [] and functions.parked is None


async def _parked_then_resumed(handler: Any) -> tuple[Resumed, Any]:
    """`handler(functions)` stepped up to its first heartbeat, as a claiming commit steps it, then
    resumed with its attempt's functions: the Resumed its attempt's task awaits, and the coroutine."""
    functions = FoldFunctions(park_flow("Unit", []), parks=True)
    coroutine = handler(functions)
    coroutine.send(None)  # runs up to the heartbeat, which parks it
    assert functions.checkpoint == "cp"

    async def live_heartbeat(checkpoint: str | None) -> None:
        pass

    functions.go_live(live_heartbeat, lambda stream, data: None)
    return Resumed(coroutine), coroutine


async def test_a_resumed_handler_gets_the_cancellation_of_its_attempts_task_and_may_go_on() -> None:
    """What is thrown into the attempt's task (a cancellation: its lease lost, the worker stopping)
    goes on to the resumed handler, as it would to one run as a usual attempt: its `except
    CancelledError` runs, and one that handles it goes on and returns. Catches the cancellation
    raised past the handler, left suspended, and the cancellation thrown into it again at its next await."""
    seen: list[str] = []

    async def handler(functions: FoldFunctions) -> str:
        await functions.heartbeat("cp")
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            seen.append("cancelled")
        await asyncio.sleep(0)
        return "went on"

    resumed, _ = await _parked_then_resumed(handler)

    async def attempt() -> str:
        result: str = await resumed
        return result

    task = asyncio.create_task(attempt())
    await asyncio.sleep(0)
    task.cancel()
    assert await asyncio.wait_for(task, 5) == "went on"
    assert seen == ["cancelled"]


async def test_a_resumed_handler_closes_with_its_awaiter() -> None:
    """A resumed handler whose attempt's coroutine is closed (never finished) is closed with it, at
    once: its finally blocks run then, not whenever the garbage collector finds it."""
    seen: list[str] = []

    async def handler(functions: FoldFunctions) -> None:
        await functions.heartbeat("cp")
        try:
            await asyncio.Event().wait()
        finally:
            seen.append("closed")

    resumed, coroutine = await _parked_then_resumed(handler)
    awaiting = resumed.__await__()
    awaiting.send(None)  # the handler is suspended in its own await
    awaiting.close()
    assert seen == ["closed"]
    assert coroutine.cr_frame is None  # finished: nothing left to close later


@pytest.mark.sqlite_only
async def test_a_started_attempt_handed_to_a_worker_after_its_grace_does_not_run_there(
    db_url: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As above, but the commit's hand-off lands only after the stopping worker's grace ran out
    (its drain is over): the worker has stopped running anything, so it drops the parked handler
    instead of resuming it. Catches a handler resumed in a worker that has stopped, its attempt
    already failed as lost when the worker unregistered."""
    ran: list[str] = []
    grace = HANDOFF_LAG / 4

    async def run_tool(ctx: Context, _: None) -> StepDecision:
        await ctx.heartbeat("cp")
        ran.append(ctx.flow_id)
        return StepDecision.graceful_complete("done")

    flow = Flow("Late", [Step("Tool", run_tool, pure_until_heartbeat=True)], start_step="Tool")
    async with quiet_engine(db_url, Registry([flow]), shutdown_grace_seconds=grace) as eng:
        worker = eng.worker
        assert worker is not None
        land = worker.local_claim_done
        running_after_landing: dict[str, int] = {}  # flow ID -> attempts the worker runs once its Tool landed

        def landing(token: int, leases: list[Any] | None, capacity: int) -> None:
            land(token, leases, capacity)
            for lease in leases or ():
                running_after_landing[lease.flow_id] = len(worker._running)

        monkeypatch.setattr(worker, "local_claim_done", landing)
        flow_id = await stopped_at_a_started_handoff(eng, monkeypatch, "Late", "l")
        await wait_until("the hand-off to land", lambda: asyncio.sleep(0, flow_id in running_after_landing))
        assert running_after_landing[flow_id] == 0, "the stopped worker took the handed-off attempt to run"
    assert flow_id not in ran, ran
