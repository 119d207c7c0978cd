"""What keeps a Step cheap, and that each shortcut keeps the rules it skips work for.

- A WaitFor the worker can evaluate before the commit that starts its Step (it takes no locks and
  loads only what that commit's Execute loaded) has its wait registered in that commit: no commit
  of its own. It falls back to a normal attempt when the rows changed meanwhile (E15), when it needs
  an attempt (execution ID, heartbeat), and a wait satisfied at once is claimed by the same commit.
- On SQLite a method's snapshot (E15) stays the live rows until a write would change one it loaded;
  that write copies them first, so retries still see the first attempt's state.
- A heartbeat takes the events written just before it along (one transaction), in order (E11).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import dex_engine._transitions as transitions
from dex_engine import (
    AsyncClient,
    AsyncWorker,
    Attribute,
    AttributeMap,
    AttributeRef,
    Channel,
    Context,
    Flow,
    FlowConfig,
    LoadOptions,
    LoadSpec,
    Registry,
    RetryPolicy,
    RpcContext,
    Step,
    StepDecision,
    StepOptions,
    Store,
    Stream,
    Wait,
    WorkerOptions,
    open_store,
    rpc,
)
from dex_engine._decision import Movement
from dex_engine._records import StartRequest

from .conftest import Engine, engine_for, history_fallbacks, history_has, statements_during, wait_until

QUICK = RetryPolicy(max_attempts=3, initial_interval_seconds=0.05, max_interval_seconds=0.05)
A = Attribute("A", int)
B = Attribute("B", int)
M = AttributeMap("M", int)
C = Channel("C", int)
Events = Stream("Events", str)


@dataclass
class Probe:
    wait_calls: list[Any] = field(default_factory=list)
    executed: list[Any] = field(default_factory=list)
    reached: asyncio.Event = field(default_factory=asyncio.Event)
    proceed: asyncio.Event = field(default_factory=asyncio.Event)
    attempts: list[tuple[int, int | None]] = field(default_factory=list)
    origins: list[Any] = field(default_factory=list)  # commit origins the Execute ran with


def count_wait_commits(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Step execution IDs of the WaitFor commits made through commit_wait_for (a commit of their own)."""
    seen: list[str] = []
    original = transitions.commit_wait_for

    def spying(db: transitions.Db, lease: Any, *rest: Any) -> None:
        seen.append(lease.step_execution_id)
        original(db, lease, *rest)

    monkeypatch.setattr(transitions, "commit_wait_for", spying)
    return seen


async def waiter_execute(probe: Probe, ctx: Context, _: None) -> StepDecision:
    assert ctx.wait_result is not None
    probe.executed.append((ctx.step_execution_id, ctx.wait_result.skipped, ctx.wait_result.messages(C)))
    return StepDecision.dead_end()


def fold_flow(probe: Probe) -> Flow:
    """Start sets A=5 and moves to Plain (loads nothing), Reads (loads A) and Named (uses its ID)."""

    async def start(ctx: Context, _: None) -> StepDecision:
        ctx.set(A, 5)
        return StepDecision.go_to_many(Movement("Plain", None), Movement("Reads", None), Movement("Named", None))

    async def plain_wait(ctx: Context, _: None) -> Wait:
        probe.wait_calls.append(("Plain", None))
        return Wait.until(C.for_one())

    async def reads_wait(ctx: Context, _: None) -> Wait:
        probe.wait_calls.append(("Reads", ctx.get(A)))
        return Wait.skip_immediately() if ctx.get(A) == 5 else Wait.until(C.for_one())

    async def named_wait(ctx: Context, _: None) -> Wait:
        probe.wait_calls.append(("Named", ctx.step_execution_id))
        return Wait.skip_immediately()

    async def execute(ctx: Context, _: None) -> StepDecision:
        return await waiter_execute(probe, ctx, None)

    return Flow("Fold", [
        Step("Start", start, input_type=type(None), options=StepOptions(load=LoadOptions.only(A))),
        Step("Plain", execute, input_type=type(None), wait_for=plain_wait,
             options=StepOptions(wait_for_load=LoadOptions.none())),
        Step("Reads", execute, input_type=type(None), wait_for=reads_wait,
             options=StepOptions(wait_for_load=LoadOptions.only(A))),
        Step("Named", execute, input_type=type(None), wait_for=named_wait,
             options=StepOptions(wait_for_load=LoadOptions.none())),
    ], start_step="Start", schema=[A, C])


@pytest.mark.sqlite_only
async def test_a_wait_known_before_the_commit_is_registered_in_it(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Plain (loads nothing) and Reads (loads A, which Start loaded and set to 5) get their waits in
    Start's commit: their WaitFors run once, before it, and never commit on their own; Reads sees the
    A Start wrote. Named reads its execution ID, which only a real attempt has: it runs as usual,
    after the commit, as Named-1 attempt 1. History still shows each wait registered at attempt 1.
    Catches: WaitFors committed separately again, the early WaitFor seeing the state before the
    writes of the commit that starts it, a WaitFor given an execution ID it does not have."""
    probe = Probe()
    wait_commits = count_wait_commits(monkeypatch)
    async with engine_for(db_url, Registry([fold_flow(probe)])) as eng:
        await eng.client.start_flow("Fold", "f1")
        await wait_until("Reads and Named executed", lambda: _count(probe.executed, 2))
        await eng.client.publish("f1", C, 7)
        await wait_until("Plain executed", lambda: _count(probe.executed, 3))
        # The handler ran; its commit may still be on its way.
        history = await wait_until("the three Executes committed", lambda: _committed(eng, "f1", 3))
    assert sorted(probe.wait_calls, key=str) == [("Named", "Named-1"), ("Plain", None), ("Reads", 5)]
    assert sorted(probe.executed) == [("Named-1", True, []), ("Plain-1", False, [7]), ("Reads-1", True, [])]
    assert wait_commits == ["Named-1"]
    for seid in ("Plain-1", "Reads-1", "Named-1"):
        events = [(h.event_type, h.attempt) for h in history if h.step_execution_id == seid]
        assert events[:2] == [("step_scheduled", 0), ("wait_registered", 1)], events
        assert events[-1] == ("execute_completed", 1), events


async def _count(items: list[Any], n: int) -> bool:
    return len(items) >= n


async def _committed(eng: Engine, flow_id: str, executes: int) -> Any:
    """The flow's history once it shows `executes` Executes of waiting Steps committed, else None."""
    history = await eng.client.get_flow_history(flow_id)
    done = [h for h in history if h.event_type == "execute_completed" and not h.step_execution_id.startswith("Start")]
    return history if len(done) >= executes else None


def changed_flow(probe: Probe) -> Flow:
    """Decide loads A, holds until an RPC changed A, writes nothing and moves to Next, whose WaitFor
    skips only when A is 2."""

    async def start(ctx: Context, _: None) -> StepDecision:
        ctx.set(A, 1)
        return StepDecision.go_to("Decide", None)

    async def decide(ctx: Context, _: None) -> StepDecision:
        probe.reached.set()
        await probe.proceed.wait()
        return StepDecision.go_to("Next", None)

    async def next_wait(ctx: Context, _: None) -> Wait:
        probe.wait_calls.append(ctx.get(A))
        return Wait.skip_immediately() if ctx.get(A) == 2 else Wait.until(C.for_one())

    async def execute(ctx: Context, _: None) -> StepDecision:
        return await waiter_execute(probe, ctx, None)

    @rpc(request_type=int)
    async def set_a(ctx: RpcContext, value: int) -> None:
        ctx.set(A, value)

    only_a = LoadOptions.only(A)
    return Flow("Changed", [
        Step("Start", start, input_type=type(None)),
        Step("Decide", decide, input_type=type(None), options=StepOptions(load=only_a)),
        Step("Next", execute, input_type=type(None), wait_for=next_wait, options=StepOptions(wait_for_load=only_a)),
    ], start_step="Start", schema=[A, C], rpcs=[set_a])


@pytest.mark.sqlite_only
async def test_an_early_wait_on_rows_that_changed_runs_again_after_the_commit(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decide loaded A=1; an RPC set A=2 before Decide committed. Next's WaitFor, evaluated early on
    A=1, would wait on the channel; the commit sees A is 2 now, drops the early wait, and the WaitFor
    runs as usual on A=2 and skips. Catches: an early wait registered on a state that is not the one
    its Step starts from (E15: the WaitFor's snapshot is the state after the commit)."""
    probe = Probe()
    wait_commits = count_wait_commits(monkeypatch)
    async with engine_for(db_url, Registry([changed_flow(probe)])) as eng:
        await eng.client.start_flow("Changed", "f1")
        await wait_until("Decide loaded A", lambda: _is_set(probe.reached))
        await eng.client.rpc("f1", "set_a", 2)
        probe.proceed.set()
        await wait_until("Next executed", lambda: _count(probe.executed, 1))
    assert probe.wait_calls == [1, 2]
    assert probe.executed == [("Next-1", True, [])]
    assert wait_commits == ["Next-1"]


async def _is_set(event: asyncio.Event) -> bool:
    return event.is_set()


@pytest.mark.sqlite_only
async def test_an_early_wait_for_that_swallows_what_it_cannot_do_early_runs_as_usual(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Logged's WaitFor writes an event and reads its execution ID, each inside a catch-all that
    swallows the refusal an early run gets. Its result would look fine, but the event was never
    written and the ID never seen: it runs again as usual after Start's commit, which writes the
    event once and sees the ID. Catches: an early run trusted because it returned a Wait."""
    probe = Probe()
    wait_commits = count_wait_commits(monkeypatch)

    async def start(ctx: Context, _: None) -> StepDecision:
        return StepDecision.go_to("Logged", None)

    async def logged_wait(ctx: Context, _: None) -> Wait:
        seen = "unknown"
        try:
            ctx.write_event(Events, "waiting")
            seen = ctx.step_execution_id
        except BaseException:  # a catch-all, as some handlers have
            pass
        probe.wait_calls.append(seen)
        return Wait.skip_immediately()

    async def execute(ctx: Context, _: None) -> StepDecision:
        return await waiter_execute(probe, ctx, None)

    flow = Flow("Logged", [
        Step("Start", start, input_type=type(None)),
        Step("Logged", execute, input_type=type(None), wait_for=logged_wait,
             options=StepOptions(wait_for_load=LoadOptions.none())),
    ], start_step="Start", schema=[Events, C])
    async with engine_for(db_url, Registry([flow])) as eng:
        await eng.client.start_flow("Logged", "f1")
        await wait_until("Logged executed", lambda: _count(probe.executed, 1))
        page = await eng.client.read_stream("f1", Events)
    assert [(e.value, e.step_execution_id) for e in page.events] == [("waiting", "Logged-1")]
    assert probe.wait_calls == ["unknown", "Logged-1"]
    assert wait_commits == ["Logged-1"]


def loaded_flow(probe: Probe) -> Flow:
    """Init sets A=3, M["k"]=2 and B=1, then moves to Start (loads all) and Narrow (loads only A).
    Start sets M["j"]=4 and moves to ByAll, ByName, ByInstance and Locking (its WaitFor locks A);
    Narrow moves to Wider (its WaitFor loads B). Each WaitFor skips when it sees the values Init
    and Start set, and otherwise waits on C, which nothing publishes."""
    expected: dict[str, tuple[tuple[AttributeRef[int], ...], tuple[int, ...]]] = {
        "ByAll": ((A, M["j"]), (3, 4)), "ByName": ((A,), (3,)), "ByInstance": ((M["k"], M["j"]), (2, 4)),
        "Locking": ((A,), (3,)), "Wider": ((B,), (1,)),
    }

    async def init(ctx: Context, _: None) -> StepDecision:
        ctx.set(A, 3)
        ctx.set(M["k"], 2)
        ctx.set(B, 1)
        return StepDecision.go_to_many(Movement("Start", None), Movement("Narrow", None))

    async def start(ctx: Context, _: None) -> StepDecision:
        ctx.set(M["j"], 4)
        return StepDecision.go_to_many(*(Movement(name, None) for name in ("ByAll", "ByName", "ByInstance", "Locking")))

    async def narrow(ctx: Context, _: None) -> StepDecision:
        return StepDecision.go_to("Wider", None)

    async def wait(ctx: Context, _: None) -> Wait:
        refs, values = expected[ctx.step_type]
        seen = tuple(ctx.get(ref) for ref in refs)
        probe.wait_calls.append((ctx.step_type, seen))
        return Wait.skip_immediately() if seen == values else Wait.until(C.for_one())

    async def execute(ctx: Context, _: None) -> StepDecision:
        return await waiter_execute(probe, ctx, None)

    def waiting(name: str, load: LoadSpec, locks: tuple[AttributeRef[int], ...] = ()) -> Step[None]:
        return Step(name, execute, input_type=type(None), wait_for=wait,
                    options=StepOptions(wait_for_load=load, wait_for_locks=locks))

    return Flow("Loaded", [
        Step("Init", init, input_type=type(None)),
        Step("Start", start, input_type=type(None), options=StepOptions(load=LoadOptions.all())),
        Step("Narrow", narrow, input_type=type(None), options=StepOptions(load=LoadOptions.only(A))),
        waiting("ByAll", LoadOptions.all()),
        waiting("ByName", LoadOptions.only(A)),
        waiting("ByInstance", LoadOptions.only(M["k"], M["j"])),
        waiting("Locking", LoadOptions.only(A), locks=(A,)),
        waiting("Wider", LoadOptions.only(B)),
    ], start_step="Init", schema=[A, B, M, C])


@pytest.mark.sqlite_only
async def test_an_early_wait_for_sees_what_the_execute_loaded_and_only_that(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The WaitFors of ByAll, ByName and ByInstance run early, in Start's commit, on what Start
    loaded (every attribute) with what it wrote applied: each sees the values Init and Start set,
    whether it loads everything, an attribute by name or map instances. Locking's WaitFor takes a
    lock, which only a usual attempt does; Wider's loads B, which Narrow did not load: both run as
    usual, after the commit, and see the same values. Catches: an early WaitFor that misses what
    the Execute loaded or wrote, or runs early without its lock or without what it loads."""
    probe = Probe()
    wait_commits = count_wait_commits(monkeypatch)
    async with engine_for(db_url, Registry([loaded_flow(probe)])) as eng:
        await eng.client.start_flow("Loaded", "f1")
        await wait_until("the five waiting Steps executed", lambda: _count(probe.executed, 5))
    assert sorted(probe.wait_calls) == [
        ("ByAll", (3, 4)), ("ByInstance", (2, 4)), ("ByName", (3,)), ("Locking", (3,)), ("Wider", (1,)),
    ]
    names = ("ByAll", "ByInstance", "ByName", "Locking", "Wider")
    assert sorted(probe.executed) == [(f"{name}-1", True, []) for name in names]
    assert sorted(wait_commits) == ["Locking-1", "Wider-1"]


@pytest.mark.sqlite_only
async def test_an_execute_commits_before_the_next_steps_wait_for_that_awaits_anything(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Slow's WaitFor qualifies to run early (no locks, loads nothing) but awaits an event. Start's
    result must not wait for it: until Start commits, a crash repeats Start (a model or tool call).
    The early run stops at the first await and the WaitFor runs as usual after the commit, once
    more from the top. Catches: an early WaitFor awaited, holding the commit for as long as it takes
    (with no wait_for timeout, forever)."""
    proceed = asyncio.Event()
    wait_calls: list[str] = []
    wait_commits = count_wait_commits(monkeypatch)

    async def start(ctx: Context, _: None) -> StepDecision:
        return StepDecision.go_to("Slow", None)

    async def slow_wait(ctx: Context, _: None) -> Wait:
        wait_calls.append(ctx.method)
        await proceed.wait()
        return Wait.skip_immediately()

    async def slow(ctx: Context, _: None) -> StepDecision:
        return StepDecision.graceful_complete("done")

    flow = Flow("SlowWait", [
        Step("Start", start, input_type=type(None)),
        Step("Slow", slow, input_type=type(None), wait_for=slow_wait,
             options=StepOptions(wait_for_load=LoadOptions.none())),
    ], start_step="Start")
    async with engine_for(db_url, Registry([flow])) as eng:
        await eng.client.start_flow("SlowWait", "f1")

        async def start_committed() -> bool:
            history = await eng.client.get_flow_history("f1")
            return any(h.event_type == "execute_completed" and h.step_execution_id == "Start-1" for h in history)

        try:
            await wait_until("Start's commit", start_committed)
            await wait_until("the WaitFor's usual attempt", lambda: _count(wait_calls, 2))
        finally:
            proceed.set()  # else a commit held by the WaitFor would hold the worker's stop too
        assert (await eng.client.wait_for_flow("f1", 10)).status == "completed"
    assert wait_calls == ["wait_for", "wait_for"]
    assert wait_commits == ["Slow-1"]


def ready_flow(probe: Probe) -> Flow:
    """Start publishes on C and moves to Waiter (waits on C, loads nothing) and Other (no WaitFor)."""

    async def start(ctx: Context, _: None) -> StepDecision:
        ctx.publish(C, 3)
        return StepDecision.go_to_many(Movement("Waiter", None), Movement("Other", None))

    async def waiter_wait(ctx: Context, _: None) -> Wait:
        return Wait.until(C.for_one())

    async def waiter(ctx: Context, _: None) -> StepDecision:
        probe.reached.set()
        return await waiter_execute(probe, ctx, None)

    async def other(ctx: Context, _: None) -> StepDecision:
        # Holds until Waiter ran, so that Other's own commit cannot be what claims Waiter.
        await asyncio.wait_for(probe.reached.wait(), 10)
        probe.executed.append(("Other", ctx.step_execution_id))
        return StepDecision.dead_end()

    return Flow("Ready", [
        Step("Start", start, input_type=type(None)),
        Step("Waiter", waiter, input_type=type(None), wait_for=waiter_wait,
             options=StepOptions(wait_for_load=LoadOptions.none())),
        Step("Other", other, input_type=type(None)),
    ], start_step="Start", schema=[C])


@pytest.mark.sqlite_only
async def test_a_wait_satisfied_in_the_commit_that_registers_it_is_claimed_by_that_commit(db_url: str) -> None:
    """Start's commit hands Other to its worker and registers Waiter's wait, which the message Start
    published satisfies at once: the same commit claims Waiter too. The worker polls only every 30 s
    here (no lease falls due either) and Other holds until Waiter ran, so Waiter runs only if that
    commit claimed it. Catches: ready work left for a later poll."""
    probe = Probe()
    async with engine_for(db_url, Registry([ready_flow(probe)]), worker=False) as eng:
        # Nothing else makes this worker poll or claim for 30 s: no due lease, housekeeping or poll.
        await eng.start_worker(poll_seconds=30.0, housekeeping_seconds=30.0, lease_ttl_seconds=90.0,
                               lease_renew_seconds=30.0)
        await eng.client.start_flow("Ready", "f1")
        await wait_until("both Steps executed", lambda: _count(probe.executed, 2))
    assert sorted(probe.executed, key=str) == [("Other", "Other-1"), ("Waiter-1", False, [3])]


def snapshot_flow(probe: Probe) -> Flow:
    """Start sets A=1, B=1 and moves to Decide (loads only A; its first attempt holds, then fails)
    and Writer (sets B, then A, each in its own Step) - writes by other Steps, not RPCs."""

    async def start(ctx: Context, _: None) -> StepDecision:
        ctx.set(A, 1)
        ctx.set(B, 1)
        return StepDecision.go_to("Decide", None)

    async def decide(ctx: Context, _: None) -> StepDecision:
        probe.attempts.append((ctx.attempt, ctx.get(A)))
        if ctx.attempt == 1:
            probe.reached.set()
            await probe.proceed.wait()
            raise RuntimeError("fails after its decision was taken")
        return StepDecision.graceful_complete(ctx.get(A))

    async def write(ctx: Context, name: str) -> StepDecision:
        ctx.set(A if name == "A" else B, 2)
        return StepDecision.dead_end()

    @rpc(request_type=str)
    async def start_writer(ctx: RpcContext, name: str) -> Any:
        from dex_engine import RPCResult

        return RPCResult(None, next_steps=[Movement("Writer", name)])

    return Flow("Snapshots", [
        Step("Start", start, input_type=type(None)),
        Step("Decide", decide, input_type=type(None),
             options=StepOptions(load=LoadOptions.only(A), execute_retry=QUICK)),
        Step("Writer", write, input_type=str, options=StepOptions(load=LoadOptions.none())),
    ], start_step="Start", schema=[A, B], rpcs=[start_writer])


async def decide_snapshot(eng: Any) -> bytes | None:
    rows = await eng.store.raw(lambda db: db.all(
        "SELECT snapshot FROM tasks WHERE flow_id = 'f1' AND step_type = 'Decide'"))
    assert len(rows) == 1
    return None if rows[0][0] is None else bytes(rows[0][0])


@pytest.mark.sqlite_only
async def test_a_snapshot_is_copied_only_when_a_write_would_change_it(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decide (loads only A) runs with its snapshot left as the live rows; a Step writing B, which
    Decide did not load, leaves it so; a Step writing A copies A=1 into it first. Decide's retry
    then sees A=1, the state its first attempt loaded, though A is 2 (E15). Start's writes, with no
    other method on the live rows, look for no snapshot to preserve (the lease check told). Catches:
    snapshots written eagerly on every claim, or not at all before another Step's write, and the
    snapshot look-up back in every commit that writes."""
    preserving: list[int | None] = []
    original = transitions._preserve_snapshots

    def spying(db: transitions.Db, flow_id: str, written: Any, own_task: int | None) -> None:
        preserving.append(own_task)
        original(db, flow_id, written, own_task)

    monkeypatch.setattr(transitions, "_preserve_snapshots", spying)
    probe = Probe()
    async with engine_for(db_url, Registry([snapshot_flow(probe)])) as eng:
        await eng.client.start_flow("Snapshots", "f1")
        await wait_until("Decide attempt 1 loaded A", lambda: _is_set(probe.reached))
        assert await decide_snapshot(eng) == transitions.LIVE_SNAPSHOT
        await eng.client.rpc("f1", "start_writer", "B")
        await wait_until("B written", lambda: _equals(eng.client.get_attribute("f1", B), 2))
        assert await decide_snapshot(eng) == transitions.LIVE_SNAPSHOT
        await eng.client.rpc("f1", "start_writer", "A")
        await wait_until("A written", lambda: _equals(eng.client.get_attribute("f1", A), 2))
        copied = await decide_snapshot(eng)
        assert copied is not None and copied != transitions.LIVE_SNAPSHOT
        probe.proceed.set()
        assert (await eng.client.wait_for_flow("f1", 10)).status == "completed"
        assert probe.attempts == [(1, 1), (2, 1)]
        assert await eng.client.flow_output("f1") == 1
    assert len(preserving) == 2  # the two Writers' commits, while Decide had the live rows


async def _equals(value: Any, expected: Any) -> bool:
    return bool(await value == expected)


def events_flow(probe: Probe) -> Flow:
    async def step(ctx: Context, _: None) -> StepDecision:
        ctx.write_event(Events, "before heartbeat")
        await ctx.heartbeat()
        ctx.write_event(Events, "after heartbeat")
        return StepDecision.graceful_complete()

    return Flow("Events", [Step("Only", step, input_type=type(None), options=StepOptions(load=LoadOptions.none()))],
                start_step="Only", schema=[Events])


async def test_events_written_before_a_heartbeat_go_out_with_it_in_order(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The event written just before a heartbeat is appended by the heartbeat's own transaction (no
    separate best-effort append for it), before the later event, both tagged with the attempt
    (E11). Catches: events lost, reordered, or each costing a transaction of its own."""
    from dex_engine import Store

    appends: list[int] = []
    original = Store.append_best_effort

    async def counting(self: Store, lease: Any, stream: str, capacity: int, values: Any) -> None:
        appends.append(len(values))
        await original(self, lease, stream, capacity, values)

    monkeypatch.setattr(Store, "append_best_effort", counting)
    async with engine_for(db_url, Registry([events_flow(Probe())])) as eng:
        await eng.client.start_flow("Events", "f1")
        assert (await eng.client.wait_for_flow("f1", 10)).status == "completed"
        read = await eng.client.read_stream("f1", Events)
    assert [(e.value, e.step_execution_id, e.attempt) for e in read.events] == [
        ("before heartbeat", "Only-1", 1), ("after heartbeat", "Only-1", 1),
    ]
    assert appends == [1]


async def test_an_event_written_while_a_heartbeat_carries_earlier_ones_follows_them(db_url: str) -> None:
    """A handler writes event 1 and heartbeats; while the heartbeat (carrying event 1) runs, another
    of its tasks writes event 2. Catches: event 2's flush overtaking the heartbeat on SQLite (an
    operation that yields to the loop can be overtaken), so readers saw 2 before 1 (E11)."""

    async def step(ctx: Context, _: None) -> StepDecision:
        async def second() -> None:
            ctx.write_event(Events, "2")

        later = asyncio.ensure_future(second())
        ctx.write_event(Events, "1")
        await ctx.heartbeat()
        await later
        return StepDecision.graceful_complete()

    flow = Flow("Ordered", [Step("Only", step, input_type=type(None))], start_step="Only", schema=[Events])
    registry = Registry([flow])
    # A worker with a store of its own, as in a Worker process: its operations then yield to the loop.
    async with AsyncClient(registry, db_url) as client, AsyncWorker(registry, WorkerOptions(database_url=db_url)):
        await client.start_flow("Ordered", "f1")
        assert (await client.wait_for_flow("f1", 10)).status == "completed"
        read = await client.read_stream("f1", Events)
    assert [(e.sequence, e.value) for e in read.events] == [(1, "1"), (2, "2")]


@pytest.mark.sqlite_only
async def test_a_heartbeat_after_an_event_runs_on_the_idle_loop_not_the_store_thread(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tool Step writes tool_call_started and heartbeats at once. The event's flush, scheduled on
    the loop, finds the event gone with the heartbeat and starts nothing, and an event written on
    the loop's own thread wakes no self-pipe: the loop is idle again, and the heartbeat's fsynced
    commit runs on it instead of paying a hand-off to the store's thread. Catches a flush task
    started for nothing, or a thread-safe wake-up from the loop's own thread, either of which keeps
    the loop busy (in the bench, a hand-off cost about 0.5 ms of CPU)."""
    import threading

    here = threading.get_ident()
    heartbeat_threads: list[int] = []
    real_heartbeat = transitions.heartbeat

    def recording(*args: Any, **kwargs: Any) -> Any:
        heartbeat_threads.append(threading.get_ident())
        return real_heartbeat(*args, **kwargs)

    monkeypatch.setattr(transitions, "heartbeat", recording)
    done = asyncio.Event()

    async def step(ctx: Context, _: None) -> StepDecision:
        ctx.write_event(Events, "tool_call_started")
        await ctx.heartbeat()
        done.set()
        return StepDecision.graceful_complete()

    flow = Flow("Events", [Step("Only", step, input_type=type(None), options=StepOptions(load=LoadOptions.none()))],
                start_step="Only", schema=[Events])
    flows = 20
    async with engine_for(db_url, Registry([flow])) as eng:
        for i in range(flows):
            done.clear()
            await eng.client.start_flow("Events", f"f{i}")
            async with asyncio.timeout(10):  # not wait_for, whose task would keep the loop busy
                await done.wait()  # and no client operation meanwhile
            assert (await eng.client.wait_for_flow(f"f{i}", 10)).status == "completed"
    assert len(heartbeat_threads) == flows
    # On a loaded machine the store's thread is often still busy (a poll, a renewal), and then the
    # heartbeat is rightly handed off; either regression above hands off every one of them.
    assert heartbeat_threads.count(here) >= 1, f"every heartbeat ran on the store's thread: {heartbeat_threads}"


def blind_flow(probe: Probe) -> Flow:
    """RPCs: `post` publishes from its request alone; `echo` reads the pending messages first."""

    async def waiter_wait(ctx: Context, _: None) -> Wait:
        return Wait.until(C.for_n(2))

    async def waiter(ctx: Context, _: None) -> StepDecision:
        from dex_engine._store import commit_origin

        probe.origins.append(commit_origin.get())
        return await waiter_execute(probe, ctx, None)

    @rpc(request_type=int, load=LoadOptions.none())
    async def post(ctx: RpcContext, value: int) -> bool:
        probe.wait_calls.append(("post", value))
        ctx.publish(C, value)
        return True

    @rpc(request_type=int, load=LoadOptions.none())
    async def echo(ctx: RpcContext, value: int) -> list[int]:
        queued = [m.value for m in ctx.pending(C)]
        probe.wait_calls.append(("echo", queued))
        ctx.publish(C, value)
        return queued

    return Flow("Blind", [
        Step("Waiter", waiter, input_type=type(None), wait_for=waiter_wait,
             options=StepOptions(wait_for_load=LoadOptions.none())),
    ], start_step="Waiter", schema=[C], rpcs=[post, echo])


async def blind_flow_with_one_post(eng: Engine) -> Callable[[str], Awaitable[bool]]:
    """Start Blind flow f1, wait until Waiter's wait is registered, post 1; returns a history check."""
    await eng.client.start_flow("Blind", "f1")

    async def has(event_type: str) -> bool:
        return any(h.event_type == event_type for h in await eng.client.get_flow_history("f1"))

    await wait_until("Waiter's wait registered", lambda: has("wait_registered"))
    assert await eng.client.rpc("f1", "post", 1) is True
    return has


async def test_an_rpc_that_reads_nothing_commits_without_a_snapshot(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`post` loads nothing and reads no pending message: its publish commits with no snapshot read
    before it (E8 holds: it read nothing that could change), its handler runs once. `echo` reads the
    pending messages: it takes the snapshot path and sees the message `post` queued. On a stopped
    flow `post` still fails with FlowNotActiveError and commits nothing. Catches: blind commits of
    handlers that read state, an RPC on a closed flow that commits, a read per RPC that needs none."""
    from dex_engine import FlowNotActiveError, Store

    reads: list[str] = []
    original = Store.rpc_read

    async def counting(self: Store, flow_id: str, *rest: Any) -> Any:
        reads.append(flow_id)
        return await original(self, flow_id, *rest)

    monkeypatch.setattr(Store, "rpc_read", counting)
    probe = Probe()
    async with engine_for(db_url, Registry([blind_flow(probe)])) as eng:
        await eng.client.start_flow("Blind", "f1")
        assert await eng.client.rpc("f1", "post", 1) is True
        assert (reads, probe.wait_calls) == ([], [("post", 1)])
        assert await eng.client.rpc("f1", "echo", 2) == [1]
        # (more than one read when a Step of the flow committed meanwhile: the RPC ran again, E8)
        assert reads and set(reads) == {"f1"} and probe.wait_calls[-1] == ("echo", [1])
        await wait_until("Waiter executed", lambda: _count(probe.executed, 1))
        assert probe.executed == [("Waiter-1", False, [1, 2])]
        await eng.client.stop_flow("f1", "done")
        with pytest.raises(FlowNotActiveError):
            await eng.client.rpc("f1", "post", 3)
        history = await eng.client.get_flow_history("f1")
    assert not [h for h in history if h.event_type == "wait_registered" and h.step_execution_id != "Waiter-1"]


@pytest.mark.sqlite_only
async def test_steps_a_client_commit_makes_ready_are_claimed_in_that_commit(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker shares the client's store and event loop: the RPC whose publish satisfies Waiter's
    wait claims Waiter's Execute for that worker in its own transaction, so no poll claims anything
    from the RPCs to Waiter's commit; and the attempt runs with the worker's commit origin, not the
    client's (its commits do not wake the worker into a poll). Catches: the notify -> poll -> claim
    round trip back, attempts claimed for the worker running in the client's context."""
    from dex_engine import Store

    claimed_by_polls: list[tuple[str, str]] = []
    original = Store.poll

    async def recording(self: Store, *args: Any, **kwargs: Any) -> Any:
        changed, result = await original(self, *args, **kwargs)
        claimed_by_polls.extend((lease.step_execution_id, lease.method) for lease in result.leases)
        return changed, result

    monkeypatch.setattr(Store, "poll", recording)
    probe = Probe()
    async with engine_for(db_url, Registry([blind_flow(probe)])) as eng:
        has = await blind_flow_with_one_post(eng)
        assert await eng.client.rpc("f1", "post", 2) is True
        await wait_until("Waiter executed", lambda: _count(probe.executed, 1))
        await wait_until("Waiter's commit", lambda: has("execute_completed"))
        assert eng.worker is not None
        assert probe.origins == [eng.worker._notify]
    assert probe.executed == [("Waiter-1", False, [1, 2])]
    # (Waiter's WaitFor may be claimed by a poll: the worker may not be running yet at start_flow.)
    assert ("Waiter-1", "execute") not in claimed_by_polls


def completing_flow() -> Flow:
    """Start moves to Waiter and Other (both wait on C) and Finish, which completes gracefully;
    `cancel` cancels a Step type, `note` sets A (a write that adds no history event)."""

    async def start(ctx: Context, _: None) -> StepDecision:
        return StepDecision.go_to_many(Movement("Waiter", None), Movement("Other", None), Movement("Finish", None))

    async def finish(ctx: Context, _: None) -> StepDecision:
        return StepDecision.graceful_complete("done")

    async def waiter_wait(ctx: Context, _: None) -> Wait:
        return Wait.until(C.for_one())

    async def waiter(ctx: Context, _: None) -> StepDecision:
        return StepDecision.dead_end()

    @rpc(request_type=str, load=LoadOptions.none())
    async def cancel(ctx: RpcContext, step_type: str) -> Any:
        from dex_engine import RPCResult

        return RPCResult(None, canceling_steps=[step_type])

    @rpc(request_type=int, load=LoadOptions.none())
    async def note(ctx: RpcContext, value: int) -> None:
        ctx.set(A, value)

    return Flow("Completing", [
        Step("Start", start, input_type=type(None)),
        Step("Finish", finish, input_type=type(None)),
        Step("Waiter", waiter, input_type=type(None), wait_for=waiter_wait),
        Step("Other", waiter, input_type=type(None), wait_for=waiter_wait),
    ], start_step="Start", schema=[A, C], rpcs=[cancel, note])


async def test_an_rpc_bumps_the_version_once_and_completes_a_flow_only_by_cancelling(db_url: str) -> None:
    """An RPC whose commit writes no history event (`note` sets A) still moves the flow's version
    (E8: other RPCs' snapshots must see the change); one that does (`cancel` Other: step_cancelled)
    moves it once, by that alone. The RPC that cancels the last Step of a gracefully completing flow
    closes it (E12). Catches: the version bump dropped with the completion check, or made twice."""
    async with engine_for(db_url, Registry([completing_flow()])) as eng:
        await eng.client.start_flow("Completing", "f1")

        async def settled() -> bool:
            info = await eng.client.describe_flow("f1")
            return sorted((s.step_type, s.state) for s in info.active_steps) == [
                ("Other", "waiting"), ("Waiter", "waiting")]

        await wait_until("Waiter and Other waiting, Finish done", settled)

        async def version() -> int:
            row = await eng.store.raw(lambda db: db.one("SELECT version FROM flows WHERE flow_id = 'f1'"))
            return int(row[0])

        before = await version()
        await eng.client.rpc("f1", "note", 7)
        assert await version() == before + 1
        await eng.client.rpc("f1", "cancel", "Other")
        assert await version() == before + 2
        assert (await eng.client.describe_flow("f1")).status == "running"
        await eng.client.rpc("f1", "cancel", "Waiter")
        info = await eng.client.wait_for_flow("f1", 10)
    assert info.status == "completed"


@pytest.mark.sqlite_only
async def test_steps_a_cancelled_client_commit_claimed_still_run(db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The RPC whose publish satisfies Waiter's wait is cancelled while its commit waits behind
    another transaction: the commit happens anyway and claims Waiter's Execute for the worker, which
    must run it though the caller never saw the reply. Lost-claim recovery is off here (bound of
    11 days), so nothing else could start it. Catches: a hand-off whose leases are only delivered
    to the caller (the Step then sat claimed and idle until lost-claim recovery, 10 s or more)."""
    import threading

    from dex_engine import _worker
    from dex_engine._sqlite_store import SqliteStore

    monkeypatch.setattr(_worker, "LOST_CLAIM_MS", 10**9)
    queued_writes: list[bool] = []
    real_run = SqliteStore._run

    async def recording_run(self: SqliteStore, fn: Any, *, write: bool, durable: bool | None = None) -> Any:
        if write:
            queued_writes.append(True)
        return await real_run(self, fn, write=write, durable=durable)

    probe = Probe()
    async with engine_for(db_url, Registry([blind_flow(probe)])) as eng:
        has = await blind_flow_with_one_post(eng)
        entered, release = threading.Event(), threading.Event()

        def block(_: object) -> None:
            entered.set()
            release.wait(30)

        blocker = asyncio.create_task(asyncio.to_thread(eng.store.run_sync, block, write=False))
        await asyncio.to_thread(entered.wait, 30)  # the store's thread is in the blocker
        monkeypatch.setattr(SqliteStore, "_run", recording_run)
        post = asyncio.create_task(eng.client.rpc("f1", "post", 2))
        # Its commit is queued behind the blocker (waiting for it, not for a sleep, on a slow machine).
        await wait_until("the RPC's commit queued", lambda: _count(queued_writes, 1))
        post.cancel()
        with pytest.raises(asyncio.CancelledError):
            await post
        release.set()
        await blocker
        await wait_until("Waiter executed", lambda: _count(probe.executed, 1))
        await wait_until("Waiter's commit", lambda: has("execute_completed"))
    assert probe.executed == [("Waiter-1", False, [1, 2])]


def holding_flow(probe: Probe) -> Flow:
    """Hold's Execute blocks until cancelled (recorded in probe.executed)."""

    async def hold(ctx: Context, _: None) -> StepDecision:
        probe.reached.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            probe.executed.append(ctx.step_execution_id)
            raise
        return StepDecision.graceful_complete()  # not reached

    return Flow("Holding", [Step("Hold", hold, input_type=type(None))], start_step="Hold")


@pytest.mark.sqlite_only
async def test_a_sqlite_worker_sleeps_idle_or_running_and_every_commit_wakes_it(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SQLite worker does not poll, with nothing running or with an attempt running (a model call
    can run for minutes, and a poll every poll_seconds cost 8% of a core on this project's VM): the
    store's thread watches data_version and wakes it when another connection commits, and this
    process's commits wake it through the commit listeners. Housekeeping, the only timeout left, is
    a minute away here, yet another connection's start is claimed and its stop cancels the running
    attempt at once, and so does a stop by this process's client of an attempt its commit handed to
    the sleeping worker. Catches a worker that polls while idle or running, a watcher that misses a
    commit, and a revocation left to housekeeping."""
    from dex_engine import AsyncClient, open_store
    from dex_engine._sqlite_store import SqliteStore

    queued: list[bool] = []
    polls: list[bool] = []
    real_run, real_poll = SqliteStore._run, SqliteStore.poll

    async def counting_run(self: SqliteStore, fn: Any, *, write: bool, durable: bool | None = None) -> Any:
        queued.append(write)
        return await real_run(self, fn, write=write, durable=durable)

    async def counting_poll(self: SqliteStore, *args: Any, **kwargs: Any) -> Any:
        polls.append(kwargs["must_claim"])
        return await real_poll(self, *args, **kwargs)

    async def quiet_for_half_a_second(what: str) -> None:
        await asyncio.sleep(0.2)
        queued.clear()
        polls.clear()
        await asyncio.sleep(0.5)  # 50 poll intervals
        assert len(polls) <= 1, f"a worker {what} polled {len(polls)} times in 0.5 s"
        assert len(queued) <= 1, f"{len(queued)} operations reached the store's thread {what}: {queued}"

    monkeypatch.setattr(SqliteStore, "_run", counting_run)
    monkeypatch.setattr(SqliteStore, "poll", counting_poll)
    probe = Probe()
    registry = Registry([holding_flow(probe)])
    async with engine_for(db_url, registry) as eng:
        assert eng.worker is not None
        await eng.worker.stop()  # restart with housekeeping and lease renewal rare: nothing else runs
        await eng.start_worker(housekeeping_seconds=60.0, lease_ttl_seconds=60.0, lease_renew_seconds=30.0,
                               poll_seconds=0.01)
        await quiet_for_half_a_second("with nothing running")

        other = open_store(db_url)  # a second connection: what another process does
        try:
            await AsyncClient(registry, store=other).start_flow("Holding", "q1")
            await asyncio.wait_for(probe.reached.wait(), 5.0)
            await quiet_for_half_a_second("running an attempt another connection started")
            await AsyncClient(registry, store=other).stop_flow("q1", "from another connection")
            await wait_until("Hold-1 cancelled", lambda: _count(probe.executed, 1), timeout=5.0)
            assert probe.executed == ["Hold-1"]
        finally:
            await other.close()

        # A flow started by this process's client is handed to the sleeping worker in the client's
        # commit: no poll claims it, and the client's stop must still reach the running attempt.
        probe.reached.clear()
        await eng.client.start_flow("Holding", "q2")
        await asyncio.wait_for(probe.reached.wait(), 5.0)
        await quiet_for_half_a_second("running an attempt handed to it")
        await eng.client.stop_flow("q2", "from this process")
        await wait_until("Hold-1 of q2 cancelled", lambda: _count(probe.executed, 2), timeout=5.0)


CHAIN_LINKS = 20


@pytest.mark.sqlite_only
async def test_a_chain_of_steps_each_claimed_by_the_commit_before_it_makes_the_worker_poll_no_more(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each Step's commit claims the next Step for its worker, so the slot it frees is already taken:
    the worker is not woken to poll for work after each commit. Catches a poll after every Step (a
    transaction each), which the chain would not notice otherwise."""
    from dex_engine._sqlite_store import SqliteStore

    polls: list[bool] = []
    real_poll = SqliteStore.poll

    async def counting_poll(self: SqliteStore, *args: Any, **kwargs: Any) -> Any:
        polls.append(kwargs["must_claim"])
        return await real_poll(self, *args, **kwargs)

    async def link(ctx: Context, left: int) -> StepDecision:
        return StepDecision.graceful_complete() if left == 0 else StepDecision.go_to("Link", left - 1)

    chain = Flow("Chain", [Step("Link", link, input_type=int)], start_step="Link")
    async with engine_for(db_url, Registry([chain]), worker=False) as eng:
        # Nothing else makes this worker poll for a minute: no housekeeping, renewal or poll timer.
        await eng.start_worker(poll_seconds=60.0, housekeeping_seconds=60.0, lease_ttl_seconds=120.0,
                               lease_renew_seconds=60.0)
        await asyncio.sleep(0.1)  # the worker's first poll and housekeeping are behind it
        monkeypatch.setattr(SqliteStore, "poll", counting_poll)
        await eng.client.start_flow("Chain", "c1", CHAIN_LINKS)
        assert (await eng.client.wait_for_flow("c1", 10)).status == "completed"
    assert len(polls) <= 1, f"the worker polled {len(polls)} times over a chain of {CHAIN_LINKS + 1} Steps"


@pytest.mark.sqlite_only
async def test_quiet_sqlite_polls_keep_their_answer_off_the_store_thread(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A quiet poll (a worker with a claim in flight polls every poll_seconds) reads data_version on
    the caller's thread: while no connection commits, its answer is the last one and nothing reaches
    the store's thread (a trip there costs more CPU than the statements). Another connection's stop
    ends the kept answer, and the next poll shows the attempt revoked. Catches quiet polls that
    queue a transaction each, and a kept answer that outlives another connection's commit."""
    from dex_engine import AsyncClient, open_store
    from dex_engine._sqlite_store import SqliteStore

    queued: list[bool] = []
    real_run = SqliteStore._run

    async def counting_run(self: SqliteStore, fn: Any, *, write: bool, durable: bool | None = None) -> Any:
        queued.append(write)
        return await real_run(self, fn, write=write, durable=durable)

    probe = Probe()
    registry = Registry([holding_flow(probe)])
    async with engine_for(db_url, registry, worker=False) as eng:
        # Housekeeping and lease renewal rare: no commit of the worker's ends a kept answer.
        worker = await eng.start_worker(housekeeping_seconds=60.0, lease_ttl_seconds=60.0,
                                        lease_renew_seconds=30.0)
        await eng.client.start_flow("Holding", "q1")
        await asyncio.wait_for(probe.reached.wait(), 5.0)
        running = list(worker._running)
        assert len(running) == 1
        monkeypatch.setattr(SqliteStore, "_run", counting_run)

        async def quiet_poll() -> Any:
            _changed, result = await eng.store.poll("quiet-poller", ["Holding"], 0, running, must_claim=False,
                                                    housekeep=False)
            return result

        first = await quiet_poll()
        assert first.epochs.keys() == set(running)
        queued.clear()
        for _ in range(20):
            assert await quiet_poll() is first, "a quiet poll did not keep its answer"
        assert queued == [], f"quiet polls with nothing committed reached the store's thread: {queued}"
        other = open_store(db_url)
        try:
            await AsyncClient(registry, store=other).stop_flow("q1", "from another connection")
        finally:
            await other.close()
        after = await quiet_poll()
        assert after is not first and after.epochs == {}, f"the kept answer outlived a stop: {after}"


@pytest.mark.sqlite_only
async def test_a_kept_quiet_answer_is_dropped_by_a_commit_of_this_process_too(db_url: str) -> None:
    """The data_version a quiet poll compares is read on a connection of its own, so a commit by the
    store's own writer (this process: a worker's commit that cancels a sibling attempt, a renewal)
    invalidates a kept answer as another process's would. Catches reading it on the writer's
    connection, where the writer's own commits never change it."""
    from dex_engine import open_store
    from dex_engine._sqlite_store import SqliteStore
    from dex_engine._transitions import PollResult

    store = open_store(db_url)
    assert isinstance(store, SqliteStore)
    try:
        asked = (("T",), (1, 2))
        version, kept = store._quiet.answer("w1", asked)
        assert version is not None and kept is None
        result = PollResult([], {1: 1, 2: 1}, None, None)
        store._quiet.keep("w1", version, asked, result)
        assert store._quiet.answer("w1", asked) == (version, result)
        assert store._quiet.answer("w1", (("T",), (1,)))[1] is None, "an answer for other running attempts"
        assert store._quiet.answer("w2", asked)[1] is None, "another worker's answer"
        await store.register_worker("w9", "host", 1, 60_000)  # a commit on the store's own connection
        assert store._quiet.answer("w1", asked)[1] is None, "a kept answer survived this process's commit"
    finally:
        await store.close()


@pytest.mark.sqlite_only
async def test_a_worker_leaving_a_shared_store_leaves_no_quiet_answer(db_url: str) -> None:
    """Catches: a store shared by workers (`store=`) kept each worker's last quiet-poll answer until
    it closed, one per worker ID it ever served, so a process that starts and stops workers on one
    store grew without bound."""
    from dex_engine._sqlite_store import SqliteStore

    store = open_store(db_url)
    assert isinstance(store, SqliteStore)
    try:
        for n in range(3):
            worker_id = f"w{n}"
            await store.register_worker(worker_id, "host", 1, 60_000)
            await store.poll(worker_id, ["T"], 0, [], must_claim=False, housekeep=False)
            assert worker_id in store._quiet._answers, "the quiet poll kept no answer: nothing to check"
            await store.unregister_worker(worker_id)
            assert store._quiet._answers == {}, f"after {worker_id} left: {list(store._quiet._answers)}"
    finally:
        await store.close()


def view_flow(probe: Probe) -> Flow:
    """Start sets A=1, B=1; Decide (loads A and B) holds until released, deletes B and moves to Next,
    which is handed to the same worker and records what it loads (A and B)."""

    async def start(ctx: Context, _: None) -> StepDecision:
        ctx.set(A, 1)
        ctx.set(B, 1)
        return StepDecision.go_to("Decide", None)

    async def decide(ctx: Context, _: None) -> StepDecision:
        probe.reached.set()
        await probe.proceed.wait()
        ctx.delete(B)
        return StepDecision.go_to("Next", None)

    async def next_step(ctx: Context, _: None) -> StepDecision:
        probe.executed.append((ctx.get(A), ctx.get(B)))
        return StepDecision.graceful_complete()

    @rpc(request_type=int)
    async def set_a(ctx: RpcContext, value: int) -> None:
        ctx.set(A, value)

    both = LoadOptions.only(A, B)
    return Flow("View", [
        Step("Start", start, input_type=type(None)),
        Step("Decide", decide, input_type=type(None), options=StepOptions(load=both)),
        Step("Next", next_step, input_type=type(None), options=StepOptions(load=both)),
    ], start_step="Start", schema=[A, B], rpcs=[set_a])


@pytest.mark.parametrize("rpc_writes", [False, True], ids=["rows-unchanged", "rpc-changed-A"])
async def test_a_step_handed_on_loads_the_rows_the_commit_leaves(db_url: str, rpc_writes: bool) -> None:
    """Next, handed to the worker by Decide's commit, loads the rows as that commit leaves them:
    Decide's own writes applied (B deleted), and when an RPC changed A while Decide ran, A as the
    RPC left it, not Decide's snapshot of it (E15: a method's snapshot is the state when it is
    claimed). Catches rows known without reading (the store's cache, _attribute_cache) used after
    they went stale, or a commit's own writes (a delete) not applied to them."""
    probe = Probe()
    async with engine_for(db_url, Registry([view_flow(probe)])) as eng:
        await eng.client.start_flow("View", "f1")
        await wait_until("Decide loaded A and B", lambda: _is_set(probe.reached))
        if rpc_writes:
            await eng.client.rpc("f1", "set_a", 7)
        probe.proceed.set()
        assert (await eng.client.wait_for_flow("f1", 10)).status == "completed"
    assert probe.executed == [(7 if rpc_writes else 1, None)]


@pytest.mark.sqlite_only
async def test_a_folded_execute_leaves_its_lock_to_the_step_its_claim_held_back(db_url: str) -> None:
    """One client commit makes First and Second ready; both are pure and lock the same attribute.
    Its claim takes First and holds Second back for that lock; First, folded into the commit, never
    writes its lock, yet the same commit must then claim Second (a worker that polls every 30 s
    would otherwise leave it waiting). Both run, one after the other, never together. Catches a
    folded claim that kept others from a lock without letting them have it after."""
    ran: list[tuple[str, str]] = []
    Second = Channel("Second", str)

    async def arm(ctx: Context, _: None) -> StepDecision:
        return StepDecision.go_to_many(Movement("First", None), Movement("Second", None))

    def waiting_on(channel: Channel[str]) -> Callable[[Context, None], Awaitable[Wait]]:
        async def wait(ctx: Context, _: None) -> Wait:
            return Wait.until(channel.for_one())
        return wait

    def locked(name: str) -> Callable[[Context, None], Awaitable[StepDecision]]:
        async def execute(ctx: Context, _: None) -> StepDecision:
            task = asyncio.current_task()
            ran.append((name, "" if task is None else task.get_name()))
            ctx.set(A, (ctx.get(A) or 0) + 1)
            # A Step handed on: a commit that hands its worker Steps claims nothing more unless told to.
            return StepDecision.go_to("Then", None)
        return execute

    async def then(ctx: Context, _: None) -> StepDecision:
        return StepDecision.dead_end()

    @rpc(request_type=str)
    async def post_both(ctx: RpcContext, text: str) -> None:
        ctx.publish(C, 1)
        ctx.publish(Second, text)

    lock = StepOptions(load=LoadOptions.only(A), execute_locks=(A,))
    flow = Flow("Locked", [
        Step("Arm", arm, input_type=type(None)),
        Step("First", locked("First"), input_type=type(None), wait_for=waiting_on_int(C), pure_execute=True,
             options=lock),
        Step("Second", locked("Second"), input_type=type(None), wait_for=waiting_on(Second), pure_execute=True,
             options=lock),
        Step("Then", then, input_type=type(None), options=StepOptions(load=LoadOptions.none())),
    ], start_step="Arm", schema=[A, C, Second], rpcs=[post_both])
    async with engine_for(db_url, Registry([flow]), worker=False) as eng:
        await eng.start_worker(poll_seconds=30.0, housekeeping_seconds=30.0, lease_ttl_seconds=90.0,
                               lease_renew_seconds=30.0)
        together = 0
        for i in range(10):
            flow_id = f"f{i}"
            await eng.client.start_flow("Locked", flow_id)
            await wait_until("both waiting", lambda fid=flow_id: _both_waiting(eng, fid))
            ran.clear()
            await eng.client.rpc(flow_id, "post_both", "go")
            await wait_until("both ran", lambda: _count(ran, 2))
            assert await eng.client.get_attribute(flow_id, A) == 2
            tasks = {task for _name, task in ran}
            together += len(tasks) == 1 and not tasks & {"First-1", "Second-1"}
        assert together, "Second never ran in the commit that folded First"


def waiting_on_int(channel: Channel[int]) -> Callable[[Context, None], Awaitable[Wait]]:
    async def wait(ctx: Context, _: None) -> Wait:
        return Wait.until(channel.for_one())
    return wait


async def _both_waiting(eng: Engine, flow_id: str) -> bool:
    info = await eng.client.describe_flow(flow_id)
    return sorted(s.state for s in info.active_steps) == ["waiting", "waiting"]


FLOW_ROW = "SELECT history_seq, version FROM flows WHERE flow_id = 'f'"


async def start_bare_flow(store: Store) -> tuple[int, int]:
    """Start flow 'f', with no Step, and return its row's (history_seq, version)."""
    await store.start_flow(StartRequest("f", "T", b"null", FlowConfig(), None))
    row: tuple[int, int] = await store.raw(lambda db: db.one(FLOW_ROW))
    return row


async def test_history_follows_the_flow_row_whoever_moved_it_within_the_operation(tmp_path: Path) -> None:
    """SQLite writes an operation's history against the sequence and version it read with the flow
    row, without reading them back; its update checks both. A change the operation did not follow
    (here a raw update, as any path that moves them without telling Db.flow_rows) makes that update
    miss, and the write falls back to reading them back: history stays gapless and the version right.
    Catches: an unchecked update (events written over the wrong sequences, a version the attribute
    cache would trust wrongly), and a fallback that never runs."""
    store = open_store(f"sqlite:///{tmp_path / 'seq.db'}")
    try:
        seq0, version0 = await start_bare_flow(store)

        def followed(db: Any) -> None:
            transitions.require_running(db, "f")
            transitions._history(db, "f", "S", "S-1", "note", 1, 0, "followed")

        def moved_behind_its_back(db: Any) -> None:
            transitions.require_running(db, "f")
            # Moved by different amounts, so that no mix-up of sequence and version can come out right.
            db.run("UPDATE flows SET history_seq = history_seq + 2, version = version + 9 WHERE flow_id = 'f'")
            transitions._history(db, "f", "S", "S-1", "note", 1, 0, "after a move")

        await store.raw(followed, write=True)
        assert await store.raw(lambda db: db.one(FLOW_ROW)) == (seq0 + 1, version0 + 1)
        await store.raw(moved_behind_its_back, write=True)
        assert await store.raw(lambda db: db.one(FLOW_ROW)) == (seq0 + 4, version0 + 11)
        history = await store.raw(lambda db: db.all(
            "SELECT seq, detail FROM history WHERE flow_id = 'f' AND event_type = 'note' ORDER BY seq"))
        assert history == [(seq0 + 1, "followed"), (seq0 + 4, "after a move")]
        # Reading the newest N walks batches back by their sequence ranges: a range written wrong
        # would end the walk early.
        every = await store.history("f", 1000)
        assert await store.history("f", len(every)) == every
        assert [h.detail for h in await store.history("f", 2)] == ["followed", "after a move"]
    finally:
        await store.close()


@pytest.mark.parametrize("reader", ["require_running", "existing_flow_type"])
async def test_history_after_a_followed_row_read_and_bump_takes_the_one_checked_update(
    tmp_path: Path, reader: str
) -> None:
    """An operation that read the flow row (require_running or existing_flow_type) and then bumped its
    version writes its history with the checked update alone: the read and the bump keep Db.flow_rows
    exact, so nothing is numbered again (no batch deleted) or read back (no RETURNING update).
    Catches: a read that does not note the row, a bump that leaves its noted version (or sequence)
    wrong; each still writes the right history, through the fallback, at two or three more statements."""
    store = open_store(f"sqlite:///{tmp_path / 'fast.db'}")
    try:
        seq0, version0 = await start_bare_flow(store)

        def read_bump_note(db: Any) -> None:
            getattr(transitions, reader)(db, "f")
            transitions.bump(db, "f")
            transitions._history(db, "f", "S", "S-1", "note", 1, 0, "after a bump")

        statements = await statements_during(store, lambda: store.raw(read_bump_note, write=True))
        assert history_fallbacks(statements) == [], statements
        assert await store.raw(lambda db: db.one(FLOW_ROW)) == (seq0 + 1, version0 + 2)
        history = await store.raw(lambda db: db.all(
            "SELECT seq, detail FROM history WHERE flow_id = 'f' AND event_type = 'note'"))
        assert history == [(seq0 + 1, "after a bump")]
    finally:
        await store.close()


@pytest.mark.parametrize("per_commit", [1, 5, 12])
async def test_sqlite_trims_history_to_exactly_the_newest_events_inside_a_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, per_commit: int
) -> None:
    """SQLite keeps a commit's history events in one batch (schema 7), and a trim that falls inside
    a batch cuts it: exactly the commits whose events cross a multiple of HISTORY_CHAIN_TRIM_EVERY
    trim, each to exactly the newest MAX_HISTORY_EVENTS_PER_FLOW events, gapless, as PostgreSQL's
    trim of rows does. Checked after every commit against that rule, with commits of one event (each
    crossing falls on a commit's edge), of five and of exactly the trim period.
    Catches: a trim by whole batches only (older events of the cut batch kept), one that cuts the
    wrong end of it, or one a commit early or late."""
    # 21 events kept, trims every 12.
    monkeypatch.setattr(transitions, "MAX_HISTORY_EVENTS_PER_FLOW", 21)
    monkeypatch.setattr(transitions, "HISTORY_CHAIN_TRIM_EVERY", 12)
    store = open_store(f"sqlite:///{tmp_path / 'trim.db'}")
    all_seqs = "SELECT seq FROM history WHERE flow_id = 'f' ORDER BY seq"
    try:
        await store.start_flow(StartRequest("f", "T", b"null", FlowConfig(), None))
        base = (await store.raw(lambda db: db.one("SELECT history_seq FROM flows WHERE flow_id = 'f'")))[0]
        oldest = min([base + 1, *(r[0] for r in await store.raw(lambda db: db.all(all_seqs)))])
        written = base
        trims = 0

        def commit(db: Any) -> None:
            nonlocal written
            transitions.require_running(db, "f")
            for _ in range(per_commit):
                written += 1
                transitions._history(db, "f", "S", f"S-{written}", "note", 1, written, str(written))

        while trims < 3:
            first = written + 1
            await store.raw(commit, write=True)
            if written // 12 != (first - 1) // 12:
                oldest = max(oldest, written - 20)
                trims += written - base > 21
            seqs = [r[0] for r in await store.raw(lambda db: db.all(all_seqs))]
            assert seqs == list(range(oldest, written + 1)), (first, written)
        history = await store.history("f", 100)
    finally:
        await store.close()
    assert [h.detail for h in history] == [str(n) for n in range(written - 20, written + 1)]


async def test_a_full_stream_is_trimmed_by_one_read_and_one_delete(tmp_path: Path) -> None:
    """A commit that trims a full stream (E11) finds its cut with one read and deletes the events
    before it with one range delete however many go, not a read and a delete per event, which a
    long session at its stream's capacity would pay on every commit. Catches: trimming one event
    per statement pair."""
    store = open_store(f"sqlite:///{tmp_path / 'stream.db'}")
    events = [("S-1", 1, b'"' + b"x" * 8 + b'"')] * 200  # 10 bytes each
    try:
        await store.start_flow(StartRequest("f", "T", b"null", FlowConfig(), None))

        def append(db: Any, rows: list[tuple[str, int, bytes]]) -> None:
            transitions.require_running(db, "f")
            transitions.append_events(db, "f", "Out", 2000, rows)

        await store.raw(lambda db: append(db, events), write=True)  # at capacity: nothing trimmed
        statements = await statements_during(
            store, lambda: store.raw(lambda db: append(db, [("S-2", 1, b'"' + b"y" * 998 + b'"')]), write=True))
        kept = await store.raw(lambda db: db.one(
            "SELECT MIN(seq), COUNT(*), SUM(LENGTH(value)) FROM stream_events WHERE flow_id = 'f'"))
    finally:
        await store.close()
    assert tuple(kept) == (101, 101, 2000)  # 100 old events made room for the 1,000-byte one
    on_events = [s.split()[0].upper() for s in statements if "stream_events" in s]
    assert on_events == ["INSERT", "SELECT", "DELETE"], statements


# Messages a wait of the same commit takes are never written (SQLite) ------------------------------


def relay_flow(probe: Probe) -> Flow:
    """First and Second each wait for one message on C and record what they got, with its ID; the
    RPC `post` publishes one."""

    async def one(ctx: Context, _: None) -> Wait:
        return Wait.until(C.for_one())

    async def first(ctx: Context, _: None) -> StepDecision:
        assert ctx.wait_result is not None
        probe.executed.append((ctx.step_execution_id, ctx.wait_result.messages(C), ctx.wait_result.message_ids(0)))
        return StepDecision.go_to("Second", None)

    async def second(ctx: Context, _: None) -> StepDecision:
        assert ctx.wait_result is not None
        probe.executed.append((ctx.step_execution_id, ctx.wait_result.messages(C), ctx.wait_result.message_ids(0)))
        return StepDecision.dead_end()

    @rpc(request_type=int)
    async def post(ctx: RpcContext, value: int) -> None:
        ctx.publish(C, value)

    return Flow("Relay", [
        Step("First", first, wait_for=one, input_type=type(None)),
        Step("Second", second, wait_for=one, input_type=type(None)),
    ], start_step="First", schema=[C], rpcs=[post])


@pytest.mark.sqlite_only
async def test_a_message_a_wait_of_the_same_commit_takes_is_never_written(db_url: str) -> None:
    """An RPC publishes to a channel a registered wait is waiting on: the wait takes the message in
    that commit, which writes no channel_messages row for it, and the message still gets an ID from
    the channel_messages sequence, after the message stored before it, so no later message can
    reuse it. Catches: a message lost because it was never written, an ID out of publish order or
    taken again."""
    probe = Probe()
    async with engine_for(db_url, Registry([relay_flow(probe)])) as eng:
        await eng.client.start_flow("Relay", "r1")
        await eng.client.publish("r1", C, 1)  # the client's publish stores it, then First takes it
        await wait_until("First ran", lambda: _count(probe.executed, 1))
        await wait_until("Second waits", lambda: history_has(eng, "r1", "wait_registered", "Second-1"))
        statements = await statements_during(eng.store, lambda: eng.client.rpc("r1", "post", 2))
        await wait_until("Second ran", lambda: _count(probe.executed, 2))
        sequence = await eng.store.raw(lambda db: db.one(
            "SELECT seq FROM sqlite_sequence WHERE name = 'channel_messages'"))
    (_first, first_values, [first_id]), (_second, second_values, [second_id]) = probe.executed
    assert (first_values, second_values) == ([1], [2])
    assert first_id < second_id == sequence[0]
    written = [s for s in statements if s.lstrip().upper().startswith(("INSERT", "DELETE"))]
    assert not [s for s in written if "channel_messages" in s], written


@pytest.mark.sqlite_only
async def test_the_first_message_of_a_new_database_taken_unwritten_uses_up_its_id(db_url: str) -> None:
    """On a new database the channel_messages sequence has no row yet; the first message ever
    published is taken by a wait of its own commit and never written. Its ID must still be used up,
    so the next message (taken the same way) gets another. Catches: the sequence's first row not
    written with that ID, so that every such message is message 1."""
    probe = Probe()
    async with engine_for(db_url, Registry([relay_flow(probe)])) as eng:
        await eng.client.start_flow("Relay", "r1")
        for value, seid in ((1, "First-1"), (2, "Second-1")):
            await wait_until(f"{seid} waits", lambda seid=seid: history_has(eng, "r1", "wait_registered", seid))
            await eng.client.rpc("r1", "post", value)
            await wait_until(f"{seid} ran", lambda value=value: _count(probe.executed, value))
        stored = await eng.store.raw(lambda db: db.one("SELECT COUNT(*) FROM channel_messages"))
    assert [(values, ids) for _seid, values, ids in probe.executed] == [([1], [1]), ([2], [2])]
    assert stored == (0,)


@pytest.mark.sqlite_only
async def test_a_rolled_back_fold_gives_back_the_messages_its_waits_took(tmp_path: Path) -> None:
    """A folded Execute's savepoint that rolls back also undoes what its waits did to this
    operation's unwritten messages: a message it took is unwritten again, without the ID whose
    sequence the rollback undid, and the operation writes it at its end. Catches: a message lost
    with the rolled-back fold, or written with an ID the sequence gives out again."""
    store = open_store(f"sqlite:///{tmp_path / 'fold.db'}")
    try:
        def op(db: transitions.Db) -> tuple[list[int | None], list[int | None]]:
            unstored: list[transitions.UnstoredMessage] = db.unstored  # type: ignore[attr-defined]
            db.run("INSERT INTO flows (flow_id, flow_type, status, input, config, version, created_at) "
                   "VALUES ('f', 'T', 'running', x'6e756c6c', x'7b7d', 1, 0)")
            unstored.append(transitions.UnstoredMessage("f", "C", "", b"1", 0))

            def fold() -> None:
                transitions._number_unstored(db, unstored)
                taken.append(unstored[0].message_id)
                unstored.clear()
                raise RuntimeError("the fold fails after its wait took the message")

            taken: list[int | None] = []
            assert not transitions._in_savepoint(db, fold)
            return taken, [m.message_id for m in unstored]

        taken, after = await store.raw(op, write=True)
        rows = await store.raw(lambda db: db.all("SELECT message_id, value FROM channel_messages"))
    finally:
        await store.close()
    assert taken == [1] and after == [None]
    assert [(int(r[0]), bytes(r[1])) for r in rows] == [(1, b"1")]
