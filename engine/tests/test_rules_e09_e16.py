"""Rules E9..E16 of ENGINE.md, each test against the in-process engine on a real SQLite file.

Every test names its rule and the breakage it catches. Handlers that must stay busy block on an
asyncio.Event the test controls; nothing sleeps to wait for the engine (wait_until polls with a deadline).
"""

from __future__ import annotations

import asyncio
import base64
import json
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import pytest

import dex_engine._transitions as transitions
from dex_engine import (
    MAX_VALUE_BYTES,
    Attribute,
    AttributeMap,
    AttributeRef,
    Channel,
    Client,
    Context,
    Flow,
    FlowConfig,
    FlowNotActiveError,
    InvalidResumeTokenError,
    InvalidValueError,
    LoadOptions,
    Movement,
    MovementOptions,
    NotLoadedError,
    Registry,
    RetryPolicy,
    RpcContext,
    RPCResult,
    SearchQueryError,
    Step,
    StepDecision,
    StepDurability,
    StepOptions,
    Stream,
    Timer,
    ValueTooLargeError,
    Wait,
    open_store,
    rpc,
)
from dex_engine._records import EventPage, StoredEvent
from dex_engine._tokens import TokenPosition, check_not_rewound, event_digest

from .conftest import Engine, engine_for, wait_until
from .racing_reads import commit_during_first_read

# A retry soon after a failure, so retried tests stay fast; ONCE: the first failure is final.
QUICK = RetryPolicy(max_attempts=3, initial_interval_seconds=0.05, max_interval_seconds=0.05)
ONCE = RetryPolicy(max_attempts=1)


# Helpers ---------------------------------------------------------------------------------------


async def states(eng: Engine, flow_id: str) -> dict[str, str]:
    """Active Step executions of a flow: step_execution_id -> ready/running/waiting."""
    info = await eng.client.describe_flow(flow_id)
    return {s.step_execution_id: s.state for s in info.active_steps}


async def settle(eng: Engine, flow_id: str, expected: dict[str, str]) -> None:
    """Wait until the flow's active Steps are exactly `expected`."""
    last: dict[str, str] = {}

    async def probe() -> bool:
        nonlocal last
        last = await states(eng, flow_id)
        return last == expected

    try:
        await wait_until(f"{flow_id} active Steps {expected}", probe)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last active Steps {last}") from None


async def events(eng: Engine, flow_id: str) -> list[tuple[str, str, int]]:
    """History as (event_type, step_execution_id, attempt)."""
    return [(h.event_type, h.step_execution_id, h.attempt) for h in await eng.client.get_flow_history(flow_id)]


async def has_event(eng: Engine, flow_id: str, event_type: str, seid: str) -> bool:
    return any(e == event_type and s == seid for e, s, _ in await events(eng, flow_id))


def is_set(ev: asyncio.Event) -> Callable[[], Awaitable[bool]]:
    async def probe() -> bool:
        return ev.is_set()

    return probe


def non_empty(items: list[Any]) -> Callable[[], Awaitable[bool]]:
    async def probe() -> bool:
        return bool(items)

    return probe


async def stored_options(eng: Engine, flow_id: str) -> dict[str, dict[str, Any]]:
    """The resolved options each scheduled task of a flow was stored with."""
    rows = await eng.store.raw(
        lambda db: db.all("SELECT step_execution_id, options FROM tasks WHERE flow_id = ?", (flow_id,))
    )
    texts = await eng.store.raw(lambda db: [transitions.stored_options_json(db, bytes(opts)) for _seid, opts in rows])
    return {str(seid): json.loads(text) for (seid, _opts), text in zip(rows, texts, strict=True)}


async def never() -> None:
    """Block until cancelled."""
    await asyncio.Event().wait()


@rpc(request_type=str)
async def begin(ctx: RpcContext, step_type: str) -> RPCResult[None]:
    """Start a Step (input None) on a flow without a start Step."""
    return RPCResult(None, next_steps=(Movement(step_type, None),))


# E9 Cancellation ---------------------------------------------------------------------------------

Lock = Attribute("Lock", int)
Written = AttributeMap("Written", str)
Go = Channel("Go", str)
Fire = Channel("Fire", str)


@dataclass
class CancelProbe:
    slow_started: asyncio.Event = field(default_factory=asyncio.Event)
    cancelled: list[str] = field(default_factory=list)  # handlers that saw CancelledError
    ran: list[str] = field(default_factory=list)  # executions that must never run


def cancel_flow(probe: CancelProbe) -> Flow:
    async def start(ctx: Context, _: None) -> StepDecision:
        return StepDecision.go_to_many(("Slow", "old"), ("Waiter", None), ("Queued", None), ("Trigger", None))

    async def slow(ctx: Context, tag: str) -> StepDecision:
        ctx.set(Written[tag], tag)
        if tag == "old":
            probe.slow_started.set()
            try:
                await never()
            except asyncio.CancelledError:
                probe.cancelled.append(ctx.step_execution_id)
                # Misbehave on purpose: swallow the cancellation and return a result with a write and
                # a movement. The engine must discard both (E9 via E2).
                ctx.set(Written["zombie"], "zombie")
                return StepDecision.go_to("Recover", None)
        return StepDecision.dead_end()

    async def waiter_wait(ctx: Context, _: None) -> Wait:
        return Wait.until(Go.for_one())

    async def must_not_run(ctx: Context, _: Any) -> StepDecision:
        probe.ran.append(ctx.step_execution_id)
        return StepDecision.dead_end()

    async def trigger_wait(ctx: Context, _: None) -> Wait:
        return Wait.until(Fire.for_one())

    async def trigger(ctx: Context, _: None) -> StepDecision:
        # Cancels Slow and starts a new Slow in the same decision: the new one must survive.
        return StepDecision.go_to("Slow", "new").with_canceling_steps("Slow", "Waiter", "Queued")

    @rpc()
    async def cancel_all(ctx: RpcContext, _: None) -> RPCResult[str]:
        return RPCResult("ok", next_steps=(Movement("Slow", "new"),), canceling_steps=("Slow", "Waiter", "Queued"))

    # Slow and Queued share a lock: while Slow runs, Queued is a queued (ready) movement no worker can claim.
    # Both route failures to Recover with a single attempt, so a cancellation treated as a failure shows.
    guarded = StepOptions(execute_locks=(Lock,), execute_retry=ONCE, failure_route="Recover")
    return Flow(
        "Cancel",
        [
            Step("Start", start, input_type=type(None)),
            Step("Slow", slow, input_type=str, options=guarded),
            Step("Waiter", must_not_run, wait_for=waiter_wait, input_type=type(None),
                 options=StepOptions(failure_route="Recover", execute_retry=ONCE, wait_for_retry=ONCE)),
            Step("Queued", must_not_run, input_type=type(None), options=guarded),
            Step("Trigger", trigger, wait_for=trigger_wait, input_type=type(None)),
            Step("Recover", must_not_run),
        ],
        start_step="Start",
        schema=[Lock, Written, Go, Fire],
        rpcs=[cancel_all],
    )


@pytest.mark.parametrize("source", ["decision", "rpc"])
async def test_e9_cancel_step_types(db_url: str, source: str) -> None:
    """E9: canceling Step types from a decision or an RPC removes the waiting execution, cancels the
    running attempt promptly (its handler sees CancelledError) and discards its writes and decision,
    drops the queued movement, leaves the Step the same decision/RPC starts alone, and runs no
    failure route. Catches: cancellations that skip a state (waiting/running/ready), a handler left
    running, a zombie result committed, cancellation applied after the new movements, or a
    cancellation treated as a failure."""
    probe = CancelProbe()
    async with engine_for(db_url, Registry([cancel_flow(probe)])) as eng:
        await eng.client.start_flow("Cancel", "c1")
        await settle(eng, "c1", {"Slow-1": "running", "Waiter-1": "waiting", "Queued-1": "ready",
                                 "Trigger-1": "waiting"})
        await wait_until("Slow-1 handler blocked", is_set(probe.slow_started))

        if source == "decision":
            await eng.client.publish("c1", Fire, "go")
        else:
            assert await eng.client.rpc("c1", "cancel_all") == "ok"

        await wait_until("Slow-1 handler cancelled", non_empty(probe.cancelled))
        await wait_until("Slow-2 completed", lambda: has_event(eng, "c1", "execute_completed", "Slow-2"))

        assert probe.cancelled == ["Slow-1"]
        assert probe.ran == [], "a cancelled Step, a dropped movement or a failure route ran"
        assert await eng.client.get_attribute_map("c1", Written) == {"new": "new"}
        assert await states(eng, "c1") == ({} if source == "decision" else {"Trigger-1": "waiting"})
        history = await events(eng, "c1")
        cancelled = {s for e, s, _ in history if e == "step_cancelled"}
        assert cancelled == {"Slow-1", "Waiter-1", "Queued-1"}
        assert not [h for h in history if h[1].startswith("Recover")], "a cancelled Step took its failure route"
        assert not [h for h in history if h[0] in ("attempt_failed", "step_failed")]
        assert (await eng.client.describe_flow("c1")).status == "running"


async def test_e9_a_decision_of_the_same_worker_cancels_its_running_attempt_at_once(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """E9 "promptly" when the cancelling commit is the worker's own: Trigger's decision cancels
    Slow-1, which the same worker runs. A worker is not woken by its own commits (they hand it what
    they claim), and it no longer polls while attempts run, so that commit must wake it itself;
    housekeeping (and PostgreSQL's fallback poll) are a minute away here. Catches a revocation by
    the worker's own commit that waits for housekeeping."""
    if db_url.startswith("postgresql"):
        from dex_engine import _pg_store

        monkeypatch.setattr(_pg_store, "FALLBACK_POLL_SECONDS", 60.0)
    probe = CancelProbe()
    async with engine_for(db_url, Registry([cancel_flow(probe)]), worker=False) as eng:
        await eng.start_worker(housekeeping_seconds=60.0, lease_ttl_seconds=120.0, lease_renew_seconds=50.0)
        await eng.client.start_flow("Cancel", "c1")
        await settle(eng, "c1", {"Slow-1": "running", "Waiter-1": "waiting", "Queued-1": "ready",
                                 "Trigger-1": "waiting"})
        await wait_until("Slow-1 handler blocked", is_set(probe.slow_started))
        await eng.client.publish("c1", Fire, "go")
        await wait_until("Slow-1 handler cancelled", non_empty(probe.cancelled), timeout=10.0)
        await wait_until("Slow-2 completed", lambda: has_event(eng, "c1", "execute_completed", "Slow-2"))
        assert probe.cancelled == ["Slow-1"]

# E10 Heartbeats and checkpoints ------------------------------------------------------------------


@dataclass
class BeatProbe:
    db_url: str = ""
    rows: list[tuple[str | None, int]] = field(default_factory=list)  # (checkpoint, attempt_started)
    seen: list[tuple[int, str | None]] = field(default_factory=list)  # (attempt, ctx.checkpoint)
    beats: int = 0
    cancelled: list[int] = field(default_factory=list)


def beat_flow(probe: BeatProbe, stall_retry_interval: float = 0.05) -> Flow:
    async def task_row(ctx: Context) -> tuple[str | None, int]:
        # A second store (its own connection) sees only what is committed, so a heartbeat that
        # returned before its commit would show here.
        other = open_store(probe.db_url)
        try:
            row = await other.raw(lambda db: db.one(
                "SELECT checkpoint, attempt_started FROM tasks WHERE flow_id = ? AND step_execution_id = ?",
                (ctx.flow_id, ctx.step_execution_id),
            ))
        finally:
            await other.close()
        return (row[0], int(row[1]))

    async def save(ctx: Context, _: None) -> StepDecision:
        probe.seen.append((ctx.attempt, ctx.checkpoint))
        if ctx.attempt == 1:
            probe.rows.append(await task_row(ctx))
            await ctx.heartbeat("cp1")
            probe.rows.append(await task_row(ctx))
            await ctx.heartbeat()
            probe.rows.append(await task_row(ctx))
            await ctx.heartbeat("cp2")
            await ctx.heartbeat()
            probe.rows.append(await task_row(ctx))
            raise RuntimeError("fails after checkpointing")
        return StepDecision.graceful_complete(ctx.checkpoint)

    async def stall(ctx: Context, _: None) -> StepDecision:
        if ctx.attempt == 1:
            # Heartbeat for longer than the heartbeat timeout (each beat extends the deadline), then stop.
            for i in range(8):
                await ctx.heartbeat(f"beat{i}")
                probe.beats += 1
                await asyncio.sleep(0.1)  # simulated work between heartbeats
            try:
                await never()
            except asyncio.CancelledError:
                probe.cancelled.append(ctx.attempt)
                raise
        return StepDecision.graceful_complete(ctx.checkpoint)

    async def slow(ctx: Context, _: None) -> StepDecision:
        if ctx.attempt == 1:
            try:
                await never()
            except asyncio.CancelledError:
                probe.cancelled.append(ctx.attempt)
                raise
        return StepDecision.graceful_complete("second attempt")

    retry2 = RetryPolicy(max_attempts=2, initial_interval_seconds=0.05, max_interval_seconds=0.05)
    stall_retry = RetryPolicy(max_attempts=2, initial_interval_seconds=stall_retry_interval,
                              max_interval_seconds=max(stall_retry_interval, 0.05))
    return Flow(
        "Beat",
        [
            Step("Save", save, input_type=type(None), options=StepOptions(execute_retry=retry2)),
            Step("Stall", stall, input_type=type(None),
                 options=StepOptions(execute_retry=stall_retry, heartbeat_timeout_seconds=0.5)),
            Step("Slow", slow, input_type=type(None),
                 options=StepOptions(execute_retry=retry2, execute_timeout_seconds=0.3)),
        ],
        start_step=None,
        rpcs=[begin],
    )


async def test_e10_heartbeat_checkpoints_durable_and_carried_to_next_attempt(db_url: str) -> None:
    """E10: heartbeat("cp1") returns only once the checkpoint is committed (a second connection sees
    it, and the attempt is marked started); a heartbeat without a checkpoint keeps the last one; the
    next attempt of the method reads the last checkpoint. Catches: fire-and-forget heartbeats, a bare
    heartbeat clearing the checkpoint, checkpoints lost between attempts."""
    probe = BeatProbe(db_url=db_url)
    async with engine_for(db_url, Registry([beat_flow(probe)])) as eng:
        await eng.client.start_flow("Beat", "b1")
        await eng.client.rpc("b1", "begin", "Save")
        info = await eng.client.wait_for_flow("b1", 10)
        assert info.status == "completed"
        assert probe.rows == [(None, 0), ("cp1", 1), ("cp1", 1), ("cp2", 1)]
        assert probe.seen == [(1, None), (2, "cp2")]
        assert await eng.client.flow_output("b1") == "cp2"


@pytest.mark.parametrize("retry_interval", [0.05, 0.0])
async def test_e10_heartbeat_timeout_fails_the_attempt_and_retries(db_url: str, retry_interval: float) -> None:
    """E10: an attempt heartbeating for longer than heartbeat_timeout_seconds survives (each beat
    extends the deadline); once it stops, the attempt fails with HeartbeatTimeout, its handler is
    cancelled (E2/E9), and the retry runs with the last checkpoint, also when the retry is due at once.
    Catches: a timeout that is never enforced, heartbeats that do not extend the deadline, a timed-out
    handler left running."""
    probe = BeatProbe()
    async with engine_for(db_url, Registry([beat_flow(probe, retry_interval)])) as eng:
        await eng.client.start_flow("Beat", "b2")
        await eng.client.rpc("b2", "begin", "Stall")
        info = await eng.client.wait_for_flow("b2", 15)
        assert info.status == "completed"
        assert probe.beats == 8, "the attempt was failed while it was still heartbeating"
        assert await eng.client.flow_output("b2") == "beat7"
        history = await eng.client.get_flow_history("b2")
        failed = [h for h in history if h.event_type == "attempt_failed"]
        assert [(h.step_execution_id, h.attempt) for h in failed] == [("Stall-1", 1)]
        assert "HeartbeatTimeout" in failed[0].detail
        assert [(h.step_execution_id, h.attempt) for h in history if h.event_type == "execute_completed"] == [
            ("Stall-1", 2)
        ]
        await wait_until("timed-out handler cancelled", non_empty(probe.cancelled), timeout=5)
        assert probe.cancelled == [1]


async def test_e10_execute_timeout_fails_a_slow_attempt(db_url: str) -> None:
    """E10/E4: execute_timeout_seconds fails an attempt that runs too long with MethodTimeout, cancels
    its handler, and the retry runs. Catches: method timeouts never enforced or reported as another
    error."""
    probe = BeatProbe()
    async with engine_for(db_url, Registry([beat_flow(probe)])) as eng:
        await eng.client.start_flow("Beat", "b3")
        await eng.client.rpc("b3", "begin", "Slow")
        info = await eng.client.wait_for_flow("b3", 10)
        assert info.status == "completed"
        assert await eng.client.flow_output("b3") == "second attempt"
        history = await eng.client.get_flow_history("b3")
        failed = [h for h in history if h.event_type == "attempt_failed"]
        assert [(h.step_execution_id, h.attempt) for h in failed] == [("Slow-1", 1)]
        assert "MethodTimeout" in failed[0].detail
        assert probe.cancelled == [1]


async def test_e10_wait_for_timeout_times_the_wait_for_alone(db_url: str) -> None:
    """E10/E4: wait_for_timeout_seconds fails a WaitFor that runs too long with MethodTimeout,
    cancels it, and its retry runs; the Step's Execute keeps its own execute_timeout_seconds and may
    run longer than the WaitFor's. Catches: WaitFor timeouts never enforced, or either method timed
    by the other's timeout."""
    cancelled: list[int] = []

    async def slow_wait(ctx: Context, _: None) -> Wait:
        if ctx.attempt == 1:
            try:
                await never()
            except asyncio.CancelledError:
                cancelled.append(ctx.attempt)
                raise
        return Wait.skip_immediately()

    async def longer_than_the_wait_for_timeout(ctx: Context, _: None) -> StepDecision:
        await asyncio.sleep(0.8)
        return StepDecision.graceful_complete("executed")

    once = RetryPolicy(max_attempts=1)
    flow = Flow("WaitTimed", [
        Step("Slow", longer_than_the_wait_for_timeout, wait_for=slow_wait, input_type=type(None),
             options=StepOptions(
                 wait_for_timeout_seconds=0.3, execute_timeout_seconds=30, execute_retry=once,
                 wait_for_retry=RetryPolicy(max_attempts=2, initial_interval_seconds=0.05,
                                            max_interval_seconds=0.05))),
    ], start_step="Slow")
    async with engine_for(db_url, Registry([flow])) as eng:
        await eng.client.start_flow("WaitTimed", "wt")
        info = await eng.client.wait_for_flow("wt", 10)
        assert info.status == "completed", info
        assert await eng.client.flow_output("wt") == "executed"
        history = await eng.client.get_flow_history("wt")
        failed = [h for h in history if h.event_type == "attempt_failed"]
        assert len(failed) == 1 and "MethodTimeout" in failed[0].detail, failed
        assert "wait_for" in failed[0].detail, failed[0].detail
        assert cancelled == [1]


# E11 Streams -------------------------------------------------------------------------------------

Events = Stream("Events", str)
Other = Stream("Other", str)
Small = Stream("Small", str, capacity_bytes=50)


@rpc(request_type=list[str])
async def append(ctx: RpcContext, values: list[str]) -> int:
    for v in values:
        ctx.append(Events, v)
    return len(values)


@rpc(request_type=list[str])
async def append_other(ctx: RpcContext, values: list[str]) -> int:
    for v in values:
        ctx.append(Other, v)
    return len(values)


@rpc(request_type=list[str])
async def append_small(ctx: RpcContext, values: list[str]) -> int:
    for v in values:
        ctx.append(Small, v)
    return len(values)


async def _noop(ctx: Context, _: Any) -> StepDecision:
    return StepDecision.dead_end()


STREAMS_FLOW = Flow(
    "Streams", [Step("Noop", _noop)], schema=[Events, Other, Small], rpcs=[append, append_other, append_small]
)


@dataclass
class LiveProbe:
    holding: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)


def live_flow(probe: LiveProbe) -> Flow:
    async def live(ctx: Context, mode: str) -> StepDecision:
        if mode == "thread":
            writer = threading.Thread(target=ctx.write_event, args=(Events, "from-thread"))
            writer.start()
            await asyncio.to_thread(writer.join)
        else:
            ctx.write_event(Events, "delta-1")
        probe.holding.set()
        await probe.release.wait()
        ctx.append(Events, "final")
        return StepDecision.graceful_complete()

    return Flow("Live", [Step("Live", live, input_type=str)], start_step="Live", schema=[Events])


async def test_e11_sequences_and_resume_tokens(db_url: str) -> None:
    """E11: appends get increasing sequence numbers per flow and stream, and a read with a resume
    token returns exactly the events after it (an empty read's token still resumes correctly); an
    RPC's events name no Step execution ("" and attempt 0). Catches: reused or per-flow-shared
    sequences, tokens that replay or skip events, RPC events passed off as a Step attempt's."""
    async with engine_for(db_url, Registry([STREAMS_FLOW])) as eng:
        c = eng.client
        await c.start_flow("Streams", "s1")
        await c.rpc("s1", "append", ["a", "b", "c"])
        await c.rpc("s1", "append_other", ["x"])
        first = await c.read_stream("s1", Events)
        assert [(e.sequence, e.value) for e in first.events] == [(1, "a"), (2, "b"), (3, "c")]
        assert {(e.step_execution_id, e.attempt) for e in first.events} == {("", 0)}
        assert not first.trimmed
        # Another stream of the same flow counts on its own.
        assert [e.sequence for e in (await c.read_stream("s1", Other)).events] == [1]

        await c.rpc("s1", "append", ["d", "e"])
        second = await c.read_stream("s1", Events, first.resume_token)
        assert [(e.sequence, e.value) for e in second.events] == [(4, "d"), (5, "e")]

        empty = await c.read_stream("s1", Events, second.resume_token)
        assert empty.events == []
        await c.rpc("s1", "append", ["f"])
        third = await c.read_stream("s1", Events, empty.resume_token)
        assert [(e.sequence, e.value) for e in third.events] == [(6, "f")]

        # Paging with `limit` resumes where the page ended.
        page = await c.read_stream("s1", Events, limit=2)
        rest = await c.read_stream("s1", Events, page.resume_token)
        assert [e.sequence for e in page.events] == [1, 2]
        assert [e.sequence for e in rest.events] == [3, 4, 5, 6]


async def test_e11_a_token_whose_event_a_crash_replaced_is_refused(db_url: str) -> None:
    """E11: a database crash can lose the last events a reader saw (best-effort ones are written
    without fsync) and give their sequences to later events. A token whose event is another one now
    (here the stored event is replaced by hand, as that crash leaves it) is refused with
    InvalidResumeTokenError, also by a long poll and through a token an empty read handed back;
    the events kept before it still resume. Catches: a reader that reads on after the token and
    silently skips the events that took the lost sequences."""
    async with engine_for(db_url, Registry([STREAMS_FLOW])) as eng:
        c = eng.client
        await c.start_flow("Streams", "s1")
        await c.rpc("s1", "append", ["a", "b", "c"])
        kept = await c.read_stream("s1", Events, limit=2)
        seen = await c.read_stream("s1", Events, kept.resume_token)
        same = await c.read_stream("s1", Events, seen.resume_token)
        assert [e.value for e in seen.events] == ["c"] and same.events == []

        def replace_third(db: Any) -> None:
            db.run("UPDATE stream_events SET value = ? WHERE flow_id = ? AND stream = ? AND seq = 3",
                   (json.dumps("after the crash").encode(), "s1", "Events"))

        await eng.store.raw(replace_third, write=True)
        for token in (seen.resume_token, same.resume_token):
            with pytest.raises(InvalidResumeTokenError, match=r"^resume token is past the events stream 'Events' of "
                               r"flow 's1' still has: its event 3 is gone or another event now, so a database "
                               r"crash lost events this reader saw"):
                await c.read_stream("s1", Events, token, wait_seconds=5)
        rest = await c.read_stream("s1", Events, kept.resume_token)
        assert [(e.sequence, e.value) for e in rest.events] == [(3, "after the crash")]


def test_e11_a_token_digest_tells_events_apart_by_all_they_hold() -> None:
    """E11: the digest a token keeps of its last event differs for events that differ only in their
    Step execution, their attempt, or in where one of those ends and the next begins, and a token
    whose event is the oldest one still stored is checked too. Catches: a retried attempt's event
    (same value, another attempt) taken for the one a reader saw before a crash, and the check
    skipped for the first stored sequence as if it were trimmed."""
    value = json.dumps("same").encode()
    events = [StoredEvent(3, "Run-1", 12, value), StoredEvent(3, "Run-11", 2, value),
              StoredEvent(3, "Run-1", 1, value), StoredEvent(3, "Other-1", 12, value)]
    assert len({event_digest(e) for e in events}) == len(events)

    seen, now = events[0], events[1]
    position = TokenPosition(3, 1, event_digest(seen))
    page = EventPage([], 4, 3, 1, False, at_after=now)
    with pytest.raises(InvalidResumeTokenError, match=r"its event 3 is gone or another event now"):
        check_not_rewound(position, "f", "Events", page)
    check_not_rewound(position, "f", "Events", replace(page, at_after=seen))  # still the one it saw
    check_not_rewound(position, "f", "Events", replace(page, first_sequence=4))  # trimmed: not compared

async def test_e11_long_poll_returns_when_an_event_is_appended(db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """E11: a read with wait_seconds and nothing new long-polls and returns the event as soon as it is
    appended, long before its wait ends. Catches: long-polls that return empty at once, or only at
    the end of wait_seconds."""
    async with engine_for(db_url, Registry([STREAMS_FLOW])) as eng:
        c = eng.client
        await c.start_flow("Streams", "s1")
        await c.rpc("s1", "append", ["a"])
        token = (await c.read_stream("s1", Events)).resume_token

        polls = 0
        real_read, real_watch = eng.store.read_events, eng.store.newest_sequences

        async def counting_read(*args: Any, **kwargs: Any) -> Any:
            nonlocal polls
            polls += 1
            return await real_read(*args, **kwargs)

        async def counting_watch(*args: Any, **kwargs: Any) -> Any:
            nonlocal polls
            polls += 1
            return await real_watch(*args, **kwargs)

        # Its own read, then the client's watcher looks for new events on its behalf.
        monkeypatch.setattr(eng.store, "read_events", counting_read)
        monkeypatch.setattr(eng.store, "newest_sequences", counting_watch)
        reader = asyncio.create_task(c.read_stream("s1", Events, token, wait_seconds=30))

        async def polled_twice() -> bool:
            return polls >= 2 and not reader.done()

        await wait_until("reader long-polling with no events", polled_twice)
        await c.rpc("s1", "append", ["late"])
        # Well under the reader's 30 s: it must return as soon as the event exists.
        result = await asyncio.wait_for(reader, 10)
        assert [(e.sequence, e.value) for e in result.events] == [(2, "late")]


@pytest.mark.parametrize("mode", ["loop", "thread"])
async def test_e11_best_effort_events_visible_before_commit(db_url: str, mode: str) -> None:
    """E11: ctx.write_event appends (from the event loop or from another thread) are readable while
    the attempt is still running, and carry the Step execution ID and attempt; the transactional
    append comes after them. Catches: best-effort events buffered until commit, events from threads
    lost, events without their writer's identity."""
    probe = LiveProbe()
    expected = "from-thread" if mode == "thread" else "delta-1"
    async with engine_for(db_url, Registry([live_flow(probe)])) as eng:
        c = eng.client
        await c.start_flow("Live", "l1", mode)
        await wait_until("Live handler holding", is_set(probe.holding))

        async def visible() -> list[Any]:
            return (await c.read_stream("l1", Events)).events

        seen = await wait_until("best-effort event visible before commit", visible)
        # The attempt has not committed: the handler is still held and the Step is running.
        assert not probe.release.is_set()
        assert await states(eng, "l1") == {"Live-1": "running"}
        assert not await has_event(eng, "l1", "execute_completed", "Live-1")
        assert [(e.sequence, e.value, e.step_execution_id, e.attempt) for e in seen] == [(1, expected, "Live-1", 1)]

        probe.release.set()
        assert (await c.wait_for_flow("l1", 10)).status == "completed"
        after = await c.read_stream("l1", Events)
        assert [(e.sequence, e.value, e.step_execution_id, e.attempt) for e in after.events] == [
            (1, expected, "Live-1", 1), (2, "final", "Live-1", 1)
        ]


def _forge(token: str, sequence: int) -> str:
    """Same signature, body rewritten to another position."""
    body, _, mac = token.partition(".")
    raw = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    raw[2] = sequence
    new_body = base64.urlsafe_b64encode(json.dumps(raw, separators=(",", ":")).encode()).rstrip(b"=").decode()
    assert new_body != body
    return f"{new_body}.{mac}"


async def test_e11_forged_and_foreign_tokens_are_refused(db_url: str) -> None:
    """E11: a forged token, a token of another flow and a token of another stream raise
    InvalidResumeTokenError instead of returning events. Catches: unsigned tokens, tokens not bound to
    their flow or stream (which would leak another flow's events)."""
    async with engine_for(db_url, Registry([STREAMS_FLOW])) as eng:
        c = eng.client
        for fid in ("s1", "s2"):
            await c.start_flow("Streams", fid)
            await c.rpc(fid, "append", ["a", "b", "c"])
            await c.rpc(fid, "append_other", ["x", "y"])
        token = (await c.read_stream("s1", Events, limit=1)).resume_token
        # The genuine token works.
        assert [e.value for e in (await c.read_stream("s1", Events, token)).events] == ["b", "c"]

        bad = {
            "forged position": ("s1", Events, _forge(token, 0)),
            "garbage": ("s1", Events, "not-a-token"),
            "wrong signature": ("s1", Events, token.partition(".")[0] + ".AAAAAAAAAAAAAAAAAAAAAA"),
            "another flow": ("s2", Events, token),
            "another stream": ("s1", Other, token),
        }
        for label, (fid, stream, tok) in bad.items():
            with pytest.raises(InvalidResumeTokenError):
                await c.read_stream(fid, stream, tok)
                pytest.fail(f"{label} token was accepted")


async def test_e11_capacity_trims_oldest_first(db_url: str) -> None:
    """E11: a stream's byte budget trims the oldest events first, readers from before the trim see
    StreamRead.trimmed, and readers after it do not. Catches: unbounded streams, trimming the newest
    events, silent gaps."""
    async with engine_for(db_url, Registry([STREAMS_FLOW])) as eng:
        c = eng.client
        await c.start_flow("Streams", "s1")
        values = [f"v{i:08d}" for i in range(1, 11)]  # each 11 bytes as JSON; budget 50 keeps 4
        await c.rpc("s1", "append_small", values[:2])
        early = await c.read_stream("s1", Small)
        assert [e.sequence for e in early.events] == [1, 2]
        for i in range(2, 10, 2):
            await c.rpc("s1", "append_small", values[i:i + 2])

        everything = await c.read_stream("s1", Small)
        assert [(e.sequence, e.value) for e in everything.events] == [(i, values[i - 1]) for i in (7, 8, 9, 10)]
        assert everything.trimmed
        resumed = await c.read_stream("s1", Small, early.resume_token)
        assert [e.sequence for e in resumed.events] == [7, 8, 9, 10]
        assert resumed.trimmed
        page = await c.read_stream("s1", Small, limit=2)
        tail = await c.read_stream("s1", Small, page.resume_token)
        assert [e.sequence for e in tail.events] == [9, 10]
        assert not tail.trimmed
        kept = await eng.store.raw(lambda db: db.one(
            "SELECT COUNT(*), SUM(LENGTH(value)) FROM stream_events WHERE flow_id = 's1' AND stream = 'Small'"))
        assert kept is not None
        assert (int(kept[0]), int(kept[1])) == (4, 44)


async def test_e11_a_stream_at_its_capacity_keeps_every_event_and_trims_no_more_than_the_excess(
    db_url: str,
) -> None:
    """E11: a stream holding exactly its capacity_bytes trims nothing, and an append past it trims
    the oldest events holding the excess, no more. Catches: trimming at (not past) the capacity,
    which found no cut for an excess of 0 and dropped every event but the newest; a cut that
    passes an event whose bytes reach the excess exactly; an event over the whole budget that left
    the older events in place."""
    async with engine_for(db_url, Registry([STREAMS_FLOW]), worker=False) as eng:
        c = eng.client
        await c.start_flow("Streams", "s1")
        values = [f"v{i:08d}" for i in range(1, 5)] + ["v005"]  # 4 x 11 + 6 bytes as JSON: 50, the budget
        await c.rpc("s1", "append_small", values)
        full = await c.read_stream("s1", Small)
        assert [e.sequence for e in full.events] == [1, 2, 3, 4, 5]
        assert not full.trimmed
        await c.rpc("s1", "append_small", ["v00000006"])  # 61 bytes: 11 over, exactly event 1's
        after = await c.read_stream("s1", Small)
        assert [e.sequence for e in after.events] == [2, 3, 4, 5, 6]
        assert after.trimmed
        await c.rpc("s1", "append_small", ["x" * 58])  # 60 bytes alone: all before it go, never it
        alone = await c.read_stream("s1", Small)
        assert [e.sequence for e in alone.events] == [7]


async def test_e11_a_reader_one_event_behind_the_oldest_kept_is_told_of_the_trim(db_url: str) -> None:
    """E11: a gap of a single trimmed event sets StreamRead.trimmed too. Catches: a gap noticed only
    when more than one event was trimmed, the reader missing one event unawares."""
    async with engine_for(db_url, Registry([STREAMS_FLOW]), worker=False) as eng:
        c = eng.client
        await c.start_flow("Streams", "s1")
        values = [f"v{i:08d}" for i in range(1, 7)]  # each 11 bytes as JSON; budget 50 keeps 4
        await c.rpc("s1", "append_small", values[:2])
        first = await c.read_stream("s1", Small, limit=1)
        await c.rpc("s1", "append_small", values[2:])  # 6 events: 3..6 kept, 2 trimmed
        read = await c.read_stream("s1", Small, first.resume_token)
        assert [e.sequence for e in read.events] == [3, 4, 5, 6]
        assert read.trimmed


@pytest.mark.parametrize("trim_after", [1, 2])
async def test_e11_a_read_racing_a_trim_sees_the_stream_before_or_after_it(
    db_url: str, monkeypatch: pytest.MonkeyPatch, trim_after: int,
) -> None:
    """E11: another writer's append that trims a reader's last event away while the reader's read
    runs (after its first or second statement) gives that reader the stream as it was before the
    append or as it is after it (the newer event, with `trimmed`), on both backends. Catches:
    PostgreSQL reading where the stream starts and its events in two statements, each seeing the
    latest commit: the trim fell between them, the reader's event looked lost though not trimmed,
    and the read raised InvalidResumeTokenError saying a database crash lost events (SQLite reads
    one snapshot)."""
    async with engine_for(db_url, Registry([STREAMS_FLOW]), worker=False) as eng:
        c = eng.client
        await c.start_flow("Streams", "s1")
        await c.rpc("s1", "append_small", ["v1", "v2", "v3"])
        first = await c.read_stream("s1", Small, limit=1)
        # Another process's writer: a blocking Client runs on a loop of its own, so the read may wait
        # for it wherever it runs (on this loop, inline on SQLite; on a connection's thread).
        other = await asyncio.to_thread(Client, Registry([STREAMS_FLOW]), db_url)
        # An event over the capacity leaves only itself.
        trims = commit_during_first_read(monkeypatch, "read_events", trim_after,
                                         lambda: other.rpc("s1", "append_small", ["x" * 60]))
        try:
            read = await c.read_stream("s1", Small, first.resume_token)
        finally:
            await asyncio.to_thread(other.close)
        assert trims == [1]
        before_trim = ([e.sequence for e in read.events], read.trimmed) == ([2, 3], False)
        assert before_trim or ([e.sequence for e in read.events], read.trimmed) == ([4], True), read
        after = await c.read_stream("s1", Small, read.resume_token)
        assert [e.sequence for e in after.events] == ([4] if before_trim else []) and not after.trimmed, after


# E12 Completion ----------------------------------------------------------------------------------

Note = Attribute("Note", str)
Release = Channel("Release", str)
Kill = Channel("Kill", str)


@dataclass
class CloseProbe:
    runner_started: asyncio.Event = field(default_factory=asyncio.Event)
    runner_release: asyncio.Event = field(default_factory=asyncio.Event)
    cancelled: list[str] = field(default_factory=list)
    holder_ran: list[str] = field(default_factory=list)


def close_flow(probe: CloseProbe) -> Flow:
    async def start(ctx: Context, mode: str) -> StepDecision:
        ctx.set(Note, "kept")
        first: tuple[Any, ...] = ("Finisher", None) if mode == "graceful" else ("Killer", mode)
        if mode == "stop":
            return StepDecision.go_to_many(("Holder", None), ("Runner", None))
        return StepDecision.go_to_many(first, ("Holder", None), ("Runner", None))

    async def finisher(ctx: Context, _: None) -> StepDecision:
        return StepDecision.graceful_complete("done")

    async def holder_wait(ctx: Context, _: None) -> Wait:
        return Wait.until(Release.for_one())

    async def holder(ctx: Context, _: None) -> StepDecision:
        probe.holder_ran.append(ctx.step_execution_id)
        return StepDecision.dead_end()

    async def runner(ctx: Context, _: None) -> StepDecision:
        probe.runner_started.set()
        try:
            await probe.runner_release.wait()
        except asyncio.CancelledError:
            probe.cancelled.append(ctx.step_execution_id)
            raise
        return StepDecision.dead_end()

    async def killer_wait(ctx: Context, _: str) -> Wait:
        return Wait.until(Kill.for_one())

    async def killer(ctx: Context, mode: str) -> StepDecision:
        return StepDecision.force_complete("forced") if mode == "force_complete" else StepDecision.force_fail("boom")

    @rpc(request_type=str)
    async def touch(ctx: RpcContext, text: str) -> str:
        ctx.set(Note, text)
        return "ok"

    @rpc(request_type=type(None))
    async def peek(ctx: RpcContext, _: None) -> str | None:
        return ctx.get(Note)

    @rpc(request_type=str, load=LoadOptions.none())
    async def echo(ctx: RpcContext, text: str) -> RPCResult[str]:
        # Loads and writes nothing (an RPCResult that starts, cancels and ends nothing): first run
        # with no snapshot (docs/engine.md).
        return RPCResult(text)

    return Flow(
        "Close",
        [
            Step("Start", start, input_type=str),
            Step("Finisher", finisher, input_type=type(None)),
            Step("Holder", holder, wait_for=holder_wait, input_type=type(None)),
            Step("Runner", runner, input_type=type(None)),
            Step("Killer", killer, wait_for=killer_wait, input_type=str),
        ],
        start_step="Start",
        schema=[Note, Release, Kill],
        rpcs=[touch, peek, echo],
    )


async def assert_closed_but_readable(eng: Engine, flow_id: str) -> None:
    """E12: attributes stay readable, also to an RPC that changes nothing (one that loads nothing
    too: its run with no snapshot must not commit); an RPC that would change them and publishes are
    refused with FlowNotActiveError."""
    assert await eng.client.get_attribute(flow_id, Note) == "kept"
    assert await eng.client.rpc(flow_id, "peek", None) == "kept"
    assert await eng.client.rpc(flow_id, "echo", "still here") == "still here"
    with pytest.raises(FlowNotActiveError):
        await eng.client.rpc(flow_id, "touch", "changed")
    with pytest.raises(FlowNotActiveError):
        await eng.client.publish(flow_id, Release, "late")
    assert await eng.client.get_attribute(flow_id, Note) == "kept"
    assert await states(eng, flow_id) == {}


async def test_e12_graceful_complete_waits_for_other_steps(db_url: str) -> None:
    """E12: graceful_complete leaves the flow running while another Step runs or waits, and closes it
    with its output once the last one ends; the closed flow's attributes stay readable and RPCs and
    publishes raise FlowNotActiveError. Catches: graceful completion that closes at once (cancelling
    work) or never closes."""
    probe = CloseProbe()
    async with engine_for(db_url, Registry([close_flow(probe)])) as eng:
        await eng.client.start_flow("Close", "g1", "graceful")
        await wait_until("Finisher completed", lambda: has_event(eng, "g1", "execute_completed", "Finisher-1"))
        await wait_until("Runner running", is_set(probe.runner_started))
        # Checked after Finisher's commit: a flow closed by it would be closed already.
        assert (await eng.client.describe_flow("g1")).status == "running"

        probe.runner_release.set()
        await wait_until("Runner completed", lambda: has_event(eng, "g1", "execute_completed", "Runner-1"))
        assert (await eng.client.describe_flow("g1")).status == "running", "closed while Holder still waits"

        await eng.client.publish("g1", Release, "go")
        info = await eng.client.wait_for_flow("g1", 10)
        assert info.status == "completed"
        assert await eng.client.flow_output("g1") == "done"
        assert probe.holder_ran == ["Holder-1"]
        assert probe.cancelled == []
        await assert_closed_but_readable(eng, "g1")


@pytest.mark.parametrize(("mode", "status"), [("force_complete", "completed"), ("force_fail", "failed")])
async def test_e12_force_complete_and_fail_close_now(db_url: str, mode: str, status: str) -> None:
    """E12: force_complete and force_fail close the flow at once and cancel every active Step (the
    running handler sees CancelledError, the waiting Step never runs). Catches: forced completion that
    waits like graceful_complete, or leaves Steps active or handlers running."""
    probe = CloseProbe()
    async with engine_for(db_url, Registry([close_flow(probe)])) as eng:
        await eng.client.start_flow("Close", "f1", mode)
        await settle(eng, "f1", {"Killer-1": "waiting", "Holder-1": "waiting", "Runner-1": "running"})
        await wait_until("Runner running", is_set(probe.runner_started))
        await eng.client.publish("f1", Kill, "now")
        info = await eng.client.wait_for_flow("f1", 10)
        assert info.status == status
        if mode == "force_complete":
            assert await eng.client.flow_output("f1") == "forced"
        else:
            assert info.error is not None
            assert "boom" in info.error
        await wait_until("Runner handler cancelled", non_empty(probe.cancelled))
        assert probe.cancelled == ["Runner-1"]
        assert probe.holder_ran == []
        cancelled = {s for e, s, _ in await events(eng, "f1") if e == "step_cancelled"}
        assert cancelled == {"Holder-1", "Runner-1"}
        await assert_closed_but_readable(eng, "f1")


async def test_e12_stop_flow_from_client(db_url: str) -> None:
    """E12: client.stop_flow closes a running flow as stopped at once and cancels its Steps; a second
    stop is refused. Catches: stop_flow that leaves Steps running or the flow open."""
    probe = CloseProbe()
    async with engine_for(db_url, Registry([close_flow(probe)])) as eng:
        await eng.client.start_flow("Close", "s1", "stop")
        await settle(eng, "s1", {"Holder-1": "waiting", "Runner-1": "running"})
        await wait_until("Runner running", is_set(probe.runner_started))
        await eng.client.stop_flow("s1", "operator stop")
        info = await eng.client.describe_flow("s1")
        assert info.status == "stopped"
        assert info.error == "operator stop"
        assert info.closed_at_ms is not None
        await wait_until("Runner handler cancelled", non_empty(probe.cancelled))
        assert probe.cancelled == ["Runner-1"]
        with pytest.raises(FlowNotActiveError):
            await eng.client.stop_flow("s1")
        await assert_closed_but_readable(eng, "s1")


async def test_e12_a_stop_without_a_reason_is_recorded_as_stopped(db_url: str) -> None:
    """E12: a flow stopped with no reason still says why it closed: its error and its flow_closed
    history entry read "stopped", never an empty text."""
    async with engine_for(db_url, Registry([close_flow(CloseProbe())])) as eng:
        await eng.client.start_flow("Close", "s2", "stop")
        await settle(eng, "s2", {"Holder-1": "waiting", "Runner-1": "running"})
        await eng.client.stop_flow("s2")
        info = await eng.client.describe_flow("s2")
        assert (info.status, info.error) == ("stopped", "stopped")
        closed = [h.detail for h in await eng.client.get_flow_history("s2") if h.event_type == "flow_closed"]
        assert closed == ["stopped: stopped"]


# E13 Search and history --------------------------------------------------------------------------


@dataclass
class SearchProbe:
    release: asyncio.Event = field(default_factory=asyncio.Event)


def search_flows(probe: SearchProbe) -> list[Flow]:
    async def start(ctx: Context, target: str) -> StepDecision:
        return StepDecision.go_to(target, None)

    async def park_wait(ctx: Context, _: None) -> Wait:
        return Wait.until(Go.for_one())

    async def done(ctx: Context, _: None) -> StepDecision:
        return StepDecision.graceful_complete()

    async def busy(ctx: Context, _: None) -> StepDecision:
        await probe.release.wait()
        return StepDecision.graceful_complete()

    flow_a = Flow(
        "SearchA",
        [
            Step("Start", start, input_type=str),
            Step("Park", done, wait_for=park_wait, input_type=type(None)),
            Step("Other", done, wait_for=park_wait, input_type=type(None)),
            Step("Busy", busy, input_type=type(None)),
        ],
        start_step="Start",
        schema=[Go],
    )
    flow_b = Flow("SearchB", [Step("Park", done, wait_for=park_wait, input_type=type(None))],
                  start_step="Park", schema=[Go])
    return [flow_a, flow_b]


async def test_e13_search_by_active_step_type(db_url: str) -> None:
    """E13: ActiveStepTypes = "X", alone or joined by AND with FlowType and FlowStatus, finds exactly
    the flows waiting in or running X right now; an empty query finds every flow. Catches: search that
    ignores a term, matches Steps a flow has left, matches closed flows, or misses running (not
    waiting) Steps."""
    probe = SearchProbe()
    async with engine_for(db_url, Registry(search_flows(probe))) as eng:
        c = eng.client
        await c.start_flow("SearchA", "a-park", "Park")
        await c.start_flow("SearchA", "a-busy", "Busy")
        await c.start_flow("SearchA", "a-other", "Other")
        await c.start_flow("SearchB", "b-park")
        await c.start_flow("SearchA", "a-done", "Park")
        for fid, expected in [("a-park", {"Park-1": "waiting"}), ("a-busy", {"Busy-1": "running"}),
                              ("a-other", {"Other-1": "waiting"}), ("b-park", {"Park-1": "waiting"}),
                              ("a-done", {"Park-1": "waiting"})]:
            await settle(eng, fid, expected)
        await c.publish("a-done", Go, "go")
        assert (await c.wait_for_flow("a-done", 10)).status == "completed"

        async def found(query: str) -> list[str]:
            return sorted(await c.search_flows(query))

        assert await found('ActiveStepTypes = "Park"') == ["a-park", "b-park"]
        assert await found('ActiveStepTypes = "Park" AND FlowType = "SearchA"') == ["a-park"]
        assert await found('FlowType = "SearchB" AND ActiveStepTypes = "Park" AND FlowStatus = "running"') == [
            "b-park"
        ]
        assert await found('ActiveStepTypes = "Busy"') == ["a-busy"]
        assert await found('ActiveStepTypes = "Start"') == []
        assert await found('ActiveStepTypes = "Busy" AND FlowType = "SearchB"') == []
        # Only running flows have active Steps: any other status beside ActiveStepTypes finds none.
        assert await found('ActiveStepTypes = "Park" AND FlowStatus = "completed"') == []
        assert await found('FlowStatus = "failed" AND ActiveStepTypes = "Busy"') == []
        assert await found('FlowType = "SearchA" AND FlowStatus = "completed"') == ["a-done"]
        assert await found('FlowStatus = "running"') == ["a-busy", "a-other", "a-park", "b-park"]
        # Every term is optional: no term at all finds every flow, closed ones too.
        for everything in ("", "  "):
            assert await found(everything) == ["a-busy", "a-done", "a-other", "a-park", "b-park"]

        # Leaving the Step removes the flow from that search.
        await c.publish("a-park", Go, "go")
        assert (await c.wait_for_flow("a-park", 10)).status == "completed"
        assert await found('ActiveStepTypes = "Park"') == ["b-park"]
        probe.release.set()


async def test_e13_malformed_search_raises(db_url: str) -> None:
    """E13: a query that does not parse raises SearchQueryError instead of matching everything or
    nothing. Catches: lenient parsing that silently drops a term."""
    probe = SearchProbe()
    async with engine_for(db_url, Registry(search_flows(probe)), worker=False) as eng:
        for query in ['ActiveStepTypes = Park', 'Color = "red"', 'FlowType = "A" OR FlowStatus = "running"',
                      'FlowType = "A" AND FlowType = "B"', 'FlowType = "A" AND', 'ActiveStepTypes "Park"']:
            with pytest.raises(SearchQueryError):
                await eng.client.search_flows(query)
                pytest.fail(f"query {query!r} was accepted")


def history_flow() -> Flow:
    async def start(ctx: Context, _: None) -> StepDecision:
        return StepDecision.go_to("Flaky", None)

    async def flaky_wait(ctx: Context, _: None) -> Wait:
        return Wait.until(Timer.by_duration(0))

    async def flaky(ctx: Context, _: None) -> StepDecision:
        if ctx.attempt == 1:
            raise RuntimeError("first try fails")
        return StepDecision.graceful_complete()

    return Flow(
        "Hist",
        [
            Step("Start", start, input_type=type(None)),
            Step("Flaky", flaky, wait_for=flaky_wait, input_type=type(None), options=StepOptions(execute_retry=QUICK)),
        ],
        start_step="Start",
    )


async def test_e13_history_records_step_events_in_order(db_url: str) -> None:
    """E13: history records each Step's scheduling, wait completion, failed attempts and execute
    completion, with attempt numbers and non-decreasing times, in order. Catches: missing events, wrong
    attempt numbers, events out of order."""
    async with engine_for(db_url, Registry([history_flow()])) as eng:
        await eng.client.start_flow("Hist", "h1")
        assert (await eng.client.wait_for_flow("h1", 10)).status == "completed"
        history = await eng.client.get_flow_history("h1")
        named = {"step_scheduled", "wait_completed", "attempt_failed", "execute_completed"}
        shape = [(h.event_type, h.step_execution_id, h.attempt) for h in history if h.event_type in named]
        assert shape == [
            ("step_scheduled", "Start-1", 0),
            ("execute_completed", "Start-1", 1),
            ("step_scheduled", "Flaky-1", 0),
            ("wait_completed", "Flaky-1", 0),
            ("attempt_failed", "Flaky-1", 1),
            ("execute_completed", "Flaky-1", 2),
        ]
        failed = next(h for h in history if h.event_type == "attempt_failed")
        assert "RuntimeError" in failed.detail
        assert "first try fails" in failed.detail
        assert all(h.step_type == h.step_execution_id.rsplit("-", 1)[0] for h in history if h.step_execution_id)
        times = [h.at_ms for h in history]
        assert times == sorted(times)
        assert history[-1].event_type == "flow_closed"


async def _count(ctx: Context, n: int) -> StepDecision:
    return StepDecision.graceful_complete() if n <= 1 else StepDecision.go_to("Count", n - 1)


CHAIN = Flow("Chain", [Step("Count", _count, input_type=int)], start_step="Count")


async def test_e13_history_is_bounded(db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """E13: a flow's history is trimmed to about MAX_HISTORY_EVENTS_PER_FLOW, dropping the oldest
    events and keeping the newest. Catches: unbounded history growth, trimming the newest events
    instead of the oldest."""
    limit, check_every = 20, 10
    monkeypatch.setattr(transitions, "MAX_HISTORY_EVENTS_PER_FLOW", limit)
    # Trimming may run in chunks (every HISTORY_TRIM_CHECK_EVERY events, on SQLite every
    # HISTORY_CHAIN_TRIM_EVERY): either way a flow never holds more than limit + check_every events.
    monkeypatch.setattr(transitions, "HISTORY_TRIM_CHECK_EVERY", check_every, raising=False)
    monkeypatch.setattr(transitions, "HISTORY_CHAIN_TRIM_EVERY", check_every, raising=False)
    async with engine_for(db_url, Registry([CHAIN])) as eng:
        await eng.client.start_flow("Chain", "h1", 60)  # 60 Steps: over 120 events untrimmed
        assert (await eng.client.wait_for_flow("h1", 20)).status == "completed"
        history = await eng.client.get_flow_history("h1")
        stored = await eng.store.raw(lambda db: db.one("SELECT COUNT(*) FROM history WHERE flow_id = 'h1'"))
        assert stored is not None
        assert limit <= len(history) == int(stored[0]) <= limit + check_every
        assert history[-1].event_type == "flow_closed"
        assert ("execute_completed", "Count-60") in [(h.event_type, h.step_execution_id) for h in history]
        assert not [h for h in history if h.step_execution_id in ("Count-1", "Count-2")], "oldest events kept"


async def test_e13_history_reads_the_newest_events_up_to_the_bound_on_either_backend(
    db_url: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """E13: each backend trims history in its own chunks (PostgreSQL every HISTORY_TRIM_CHECK_EVERY
    events, SQLite every HISTORY_CHAIN_TRIM_EVERY), so a flow may hold a few more events than
    MAX_HISTORY_EVENTS_PER_FLOW; get_flow_history returns exactly the newest that many on both.
    Catches: the same flow read back with up to 24,095 events on SQLite and 20,255 on PostgreSQL,
    past the documented 20,000."""
    limit = 20
    monkeypatch.setattr(transitions, "MAX_HISTORY_EVENTS_PER_FLOW", limit)
    monkeypatch.setattr(transitions, "HISTORY_TRIM_CHECK_EVERY", 8)
    monkeypatch.setattr(transitions, "HISTORY_CHAIN_TRIM_EVERY", 64)
    async with engine_for(db_url, Registry([CHAIN])) as eng:
        await eng.client.start_flow("Chain", "h1", 30)  # about 60 events: under 64, so SQLite has not trimmed
        assert (await eng.client.wait_for_flow("h1", 20)).status == "completed"
        history = await eng.client.get_flow_history("h1")
        assert len(history) == limit, [(h.event_type, h.step_execution_id) for h in history]
        assert history[-1].event_type == "flow_closed"
        assert ("execute_completed", "Count-30") in [(h.event_type, h.step_execution_id) for h in history]


# E14 Values --------------------------------------------------------------------------------------

Blob = Attribute("Blob", str)
Number = Attribute("Number", int)


async def _write(ctx: Context, mode: str) -> StepDecision:
    if mode == "big":
        ctx.set(Blob, "x" * MAX_VALUE_BYTES)  # JSON adds two quotes: just over the limit
    elif mode == "wrong":
        ctx.set(Number, "not a number")  # type: ignore[arg-type]
    else:
        ctx.set(Blob, "small")
        ctx.set(Number, 7)
        if mode == "park":
            return StepDecision.go_to("Park", None)
    return StepDecision.graceful_complete(mode)


async def _park_wait(ctx: Context, _: None) -> Wait:
    return Wait.until(Go.for_one())


@rpc(request_type=int)
async def set_blob(ctx: RpcContext, size: int) -> str:
    ctx.set(Blob, "y" * size)
    return "set"


VALUES = Flow(
    "Values",
    [
        Step("Write", _write, input_type=str, options=StepOptions(execute_retry=ONCE)),
        Step("Park", _noop, wait_for=_park_wait, input_type=type(None)),
    ],
    start_step="Write",
    schema=[Blob, Number, Go],
    rpcs=[set_blob, begin],
)


async def test_e14_value_too_large_fails_the_attempt_and_engine_stays_healthy(db_url: str) -> None:
    """E14: writing a value over MAX_VALUE_BYTES fails the writing attempt with ValueTooLargeError
    naming the attribute (in history), writes nothing, and the worker keeps running other flows; an
    RPC writing one raises it to the caller and commits nothing. Catches: oversize values stored,
    errors that do not name the attribute, a worker that dies on them."""
    async with engine_for(db_url, Registry([VALUES])) as eng:
        c = eng.client
        await c.start_flow("Values", "big", "big")
        info = await c.wait_for_flow("big", 10)
        assert info.status == "failed"
        failed = [h for h in await c.get_flow_history("big") if h.event_type == "attempt_failed"]
        assert len(failed) == 1
        assert "ValueTooLargeError" in failed[0].detail
        assert "'Blob'" in failed[0].detail
        assert await c.get_attribute("big", Blob) is None

        # The same worker still runs other flows.
        await c.start_flow("Values", "ok", "ok")
        assert (await c.wait_for_flow("ok", 10)).status == "completed"
        assert await c.get_attribute("ok", Blob) == "small"

        # RPC: the error reaches the caller, names the attribute, and nothing is committed.
        await c.start_flow("Values", "rpc", "park")
        await settle(eng, "rpc", {"Park-1": "waiting"})
        with pytest.raises(ValueTooLargeError) as caught:
            await c.rpc("rpc", "set_blob", MAX_VALUE_BYTES)
        assert caught.value.name == "Blob"
        assert await c.get_attribute("rpc", Blob) == "small"
        assert await c.rpc("rpc", "set_blob", 10) == "set"
        assert await c.get_attribute("rpc", Blob) == "y" * 10


async def test_e14_value_of_wrong_type_is_refused(db_url: str) -> None:
    """E14: a value that is not of the declared type fails the writing attempt with InvalidValueError
    naming the attribute; a client publish or flow input of the wrong type raises InvalidValueError
    and changes nothing. Catches: values stored without their declared type being checked."""
    async with engine_for(db_url, Registry([VALUES])) as eng:
        c = eng.client
        await c.start_flow("Values", "wrong", "wrong")
        assert (await c.wait_for_flow("wrong", 10)).status == "failed"
        failed = [h for h in await c.get_flow_history("wrong") if h.event_type == "attempt_failed"]
        assert len(failed) == 1
        assert "InvalidValueError" in failed[0].detail
        assert "'Number'" in failed[0].detail
        assert await c.get_attribute("wrong", Number) is None

        with pytest.raises(InvalidValueError):
            await c.start_flow("Values", "bad-input", 123)
        assert not await c.exists("bad-input")

        await c.start_flow("Values", "park", "park")
        await settle(eng, "park", {"Park-1": "waiting"})
        with pytest.raises(InvalidValueError):
            await c.publish("park", Go, 5)  # type: ignore[arg-type]
        pending = await eng.store.raw(lambda db: db.one("SELECT COUNT(*) FROM channel_messages"))
        assert pending is not None
        assert int(pending[0]) == 0


# E15 One snapshot per method ---------------------------------------------------------------------

A = Attribute("A", int)
B = Attribute("B", int)
M = AttributeMap("M", int)


@dataclass
class SnapProbe:
    first_loaded: asyncio.Event = field(default_factory=asyncio.Event)
    proceed: asyncio.Event = field(default_factory=asyncio.Event)
    seen: list[tuple[int, int | None]] = field(default_factory=list)
    reads: dict[str, dict[str, Any]] = field(default_factory=dict)


def snapshot_flow(probe: SnapProbe, decide_locks: tuple[Attribute[int], ...] = ()) -> Flow:
    async def start(ctx: Context, _: None) -> StepDecision:
        ctx.set(A, 1)
        return StepDecision.go_to("Decide", None)

    async def decide(ctx: Context, _: None) -> StepDecision:
        probe.seen.append((ctx.attempt, ctx.get(A)))
        if ctx.attempt == 1:
            probe.first_loaded.set()
            await probe.proceed.wait()
            raise RuntimeError("side effect failed after the decision")
        return StepDecision.graceful_complete(ctx.get(A))

    @rpc(request_type=int)
    async def set_a(ctx: RpcContext, value: int) -> None:
        ctx.set(A, value)

    return Flow(
        "Snap",
        [
            Step("Start", start, input_type=type(None)),
            Step("Decide", decide, input_type=type(None),
                 options=StepOptions(execute_retry=QUICK, execute_locks=decide_locks)),
        ],
        start_step="Start",
        schema=[A, B],
        rpcs=[set_a],
    )


@pytest.mark.parametrize("decide_locks", [(), (B,)], ids=["handed_over", "claimed_ready"])
async def test_e15_retry_sees_the_first_attempts_snapshot(
    db_url: str, decide_locks: tuple[Attribute[int], ...]
) -> None:
    """E15: a retry of a method sees the attributes its first attempt loaded (A=1), even though an RPC
    committed A=2 in between: whether the first attempt was handed to the worker by the commit that
    made it, or (a Step with locks) made ready and claimed. Catches: retries that reload state, so a
    decision taken before a side effect could be taken differently on the retry."""
    probe = SnapProbe()
    async with engine_for(db_url, Registry([snapshot_flow(probe, decide_locks)])) as eng:
        await eng.client.start_flow("Snap", "p1")
        await wait_until("Decide attempt 1 loaded A", is_set(probe.first_loaded))
        await eng.client.rpc("p1", "set_a", 2)
        assert await eng.client.get_attribute("p1", A) == 2
        probe.proceed.set()
        assert (await eng.client.wait_for_flow("p1", 10)).status == "completed"
        assert probe.seen == [(1, 1), (2, 1)]
        assert await eng.client.flow_output("p1") == 1
        assert await eng.client.get_attribute("p1", A) == 2


NOT_LOADED = "not loaded"


def load_flow(probe: SnapProbe) -> Flow:
    def read_all(ctx: Context) -> dict[str, Any]:
        out: dict[str, Any] = {}
        refs: list[AttributeRef[int]] = [A, B, M["k"], M["j"]]
        for ref in refs:
            try:
                out[ref.label] = ctx.get(ref)
            except NotLoadedError:
                out[ref.label] = NOT_LOADED
        try:
            out["items(M)"] = ctx.items(M)
        except NotLoadedError:
            out["items(M)"] = NOT_LOADED
        return out

    async def start(ctx: Context, _: None) -> StepDecision:
        ctx.set(A, 1)
        ctx.set(B, 2)
        ctx.set(M["k"], 3)
        ctx.set(M["j"], 4)
        return StepDecision.go_to_many(
            Movement("Blind", "blind"),
            Movement("Narrow", "narrow"),
            Movement("Narrow", "override-all", MovementOptions(load=LoadOptions.all())),
            Movement("Narrow", "override-b", MovementOptions(load=LoadOptions.only(B))),
        )

    async def record(ctx: Context, tag: str) -> StepDecision:
        probe.reads[tag] = read_all(ctx)
        return StepDecision.dead_end()

    return Flow(
        "Load",
        [
            Step("Start", start, input_type=type(None)),
            Step("Blind", record, input_type=str, options=StepOptions(load=LoadOptions.none())),
            Step("Narrow", record, input_type=str, options=StepOptions(load=LoadOptions.only(A, M["k"]))),
        ],
        start_step="Start",
        schema=[A, B, M],
    )


async def test_e15_load_options_and_movement_override(db_url: str) -> None:
    """E15: LoadOptions.none() loads nothing (ctx.get raises NotLoadedError), LoadOptions.only(A,
    M["k"]) loads exactly that attribute and map instance, and a movement's MovementOptions(load=...)
    replaces the Step's load options. Catches: load options ignored (everything loaded), reads of
    unloaded attributes returning None silently, per-movement overrides ignored or merged."""
    probe = SnapProbe()
    async with engine_for(db_url, Registry([load_flow(probe)])) as eng:
        await eng.client.start_flow("Load", "l1")

        async def all_recorded() -> bool:
            return len(probe.reads) == 4

        await wait_until("four Steps recorded their reads", all_recorded)
        nl = NOT_LOADED
        assert probe.reads == {
            "blind": {"A": nl, "B": nl, "M[k]": nl, "M[j]": nl, "items(M)": nl},
            "narrow": {"A": 1, "B": nl, "M[k]": 3, "M[j]": nl, "items(M)": {"k": 3}},
            "override-all": {"A": 1, "B": 2, "M[k]": 3, "M[j]": 4, "items(M)": {"j": 4, "k": 3}},
            "override-b": {"A": nl, "B": 2, "M[k]": nl, "M[j]": nl, "items(M)": nl},
        }


# E16 Flow config ---------------------------------------------------------------------------------

Hold = Channel("Hold", str)


def config_flow() -> Flow:
    async def park(ctx: Context, tag: str) -> StepDecision:
        if tag == "first":
            return StepDecision.go_to_many(("Park", "second"), ("Pinned", None))
        return StepDecision.dead_end()

    async def park_wait(ctx: Context, _: Any) -> Wait:
        return Wait.until(Go.for_one())

    async def hold_wait(ctx: Context, _: Any) -> Wait:
        return Wait.until(Hold.for_one())

    return Flow(
        "Cfg",
        [
            Step("Park", park, wait_for=park_wait, input_type=str),
            # An explicit durability is the Step's own choice; the flow default does not apply to it.
            Step("Pinned", _noop, wait_for=hold_wait, input_type=type(None),
                 options=StepOptions(durability=StepDurability.SYNC)),
        ],
        start_step="Park",
        schema=[Go, Hold],
    )


async def test_e16_active_step_search_off_hides_the_flow(db_url: str) -> None:
    """E16/E13: a flow started with config_override=FlowConfig(active_step_search=False) is not found
    by ActiveStepTypes search, while the same flow type with the default config is; other search terms
    still find it. Catches: config_override ignored at start_flow."""
    async with engine_for(db_url, Registry([config_flow()])) as eng:
        c = eng.client
        await c.start_flow("Cfg", "on", "first")
        await c.start_flow("Cfg", "off", "first", config_override=FlowConfig(active_step_search=False))
        await settle(eng, "on", {"Park-1": "waiting"})
        await settle(eng, "off", {"Park-1": "waiting"})
        assert (await c.describe_flow("off")).config.active_step_search is False
        assert await c.search_flows('ActiveStepTypes = "Park"') == ["on"]
        assert await c.search_flows('ActiveStepTypes = "Park" AND FlowType = "Cfg"') == ["on"]
        assert sorted(await c.search_flows('FlowType = "Cfg" AND FlowStatus = "running"')) == ["off", "on"]


@pytest.mark.parametrize("few", [True, False], ids=["few-flows-with-the-step", "many-flows-with-the-step"])
async def test_e16_flows_hidden_from_active_step_search_do_not_use_up_its_limit(
    db_url: str, few: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """E16/E13: a search with a limit returns that many matching flows even when older flows with
    the same active Step, hidden by their config, come first in its order; both when few flows
    have the Step (read through the index on waiting tasks) and when more than
    ACTIVE_STEP_SEARCH_CANDIDATES do (running flows read in order, page by page; the bound is
    lowered to 1 here). Catches: applying the limit before the config is checked (the search then
    returned nothing)."""
    if not few:
        monkeypatch.setattr(transitions, "ACTIVE_STEP_SEARCH_CANDIDATES", 1)
    async with engine_for(db_url, Registry([config_flow()])) as eng:
        c = eng.client
        hidden = FlowConfig(active_step_search=False)
        for flow_id in ("hidden-1", "hidden-2", "hidden-3"):
            await c.start_flow("Cfg", flow_id, "first", config_override=hidden)
        for flow_id in ("shown-1", "shown-2", "shown-3"):
            await c.start_flow("Cfg", flow_id, "first")
        for flow_id in ("hidden-1", "hidden-2", "hidden-3", "shown-1", "shown-2", "shown-3"):
            await settle(eng, flow_id, {"Park-1": "waiting"})
        assert await c.search_flows('ActiveStepTypes = "Park"', limit=2) == ["shown-1", "shown-2"]
        assert await c.search_flows('ActiveStepTypes = "Park"', limit=3) == ["shown-1", "shown-2", "shown-3"]
        assert await c.search_flows('ActiveStepTypes = "Park"', limit=10) == ["shown-1", "shown-2", "shown-3"]
        assert await c.search_flows('FlowType = "Cfg"', limit=2) == ["hidden-1", "hidden-2"]


async def test_e16_update_flow_config_applies_to_later_steps_only(db_url: str) -> None:
    """E16: update_flow_config changes default_step_durability for Steps scheduled after the change;
    the already scheduled Step keeps the durability it was stored with, and a Step with its own
    durability keeps it; config_override at start_flow sets it for the first Step. Catches: config
    changes rewriting scheduled Steps, or never reaching new ones."""
    async with engine_for(db_url, Registry([config_flow()])) as eng:
        c = eng.client
        await c.start_flow("Cfg", "d1", "first")
        await settle(eng, "d1", {"Park-1": "waiting"})
        assert (await stored_options(eng, "d1"))["Park-1"]["durability"] == "SYNC"

        await c.update_flow_config("d1", FlowConfig(default_step_durability=StepDurability.ASYNC))
        assert (await c.describe_flow("d1")).config.default_step_durability == StepDurability.ASYNC
        assert (await stored_options(eng, "d1"))["Park-1"]["durability"] == "SYNC"

        await c.publish("d1", Go, "go")
        await settle(eng, "d1", {"Park-2": "waiting", "Pinned-1": "waiting"})
        durability = {seid: opts["durability"] for seid, opts in (await stored_options(eng, "d1")).items()}
        assert durability == {"Park-2": "ASYNC", "Pinned-1": "SYNC"}

        await c.start_flow("Cfg", "d2", "first",
                           config_override=FlowConfig(default_step_durability=StepDurability.ASYNC))
        await settle(eng, "d2", {"Park-1": "waiting"})
        assert (await stored_options(eng, "d2"))["Park-1"]["durability"] == "ASYNC"
