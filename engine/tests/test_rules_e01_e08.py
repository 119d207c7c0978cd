"""Engine contract rules E1..E8 (ENGINE.md section 2), in-process, on real SQLite files.

Each test's docstring names its rule and the plausible bug it catches. Handlers run on the test's
event loop (the in-process worker of `engine_for`), so they report what they saw through plain lists
and asyncio events; durable effects are checked through the client, the store and the flow history.
Times asserted are the store's recorded times (history, task rows), and only as lower bounds or exact
arithmetic of recorded values, never as wall-clock upper bounds.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from dex_engine import (
    MAX_VALUE_BYTES,
    AsyncClient,
    AttemptProgress,
    Attribute,
    AttributeMap,
    Channel,
    ChannelMap,
    ChannelMessageNotFoundError,
    ChannelRef,
    Context,
    Flow,
    HistoryEntry,
    InvalidValueError,
    LoadOptions,
    Movement,
    NoRetryError,
    RecoveryError,
    Registry,
    RetryPolicy,
    RpcContext,
    RpcLockConflictError,
    RPCResult,
    StaleAttemptError,
    Step,
    StepDecision,
    StepNotWaitingError,
    StepOptions,
    Stream,
    Timer,
    Wait,
    open_store,
    rpc,
)
from dex_engine import _transitions as transitions
from dex_engine._records import DecisionRecord, ErrorInfo, Lease, WriteSet
from dex_engine._scheduling import movement_record

from .conftest import Engine, engine_for, wait_until

# Schema shared by every flow of this file ------------------------------------------------------

Count = Attribute("Count", int)
Note = Attribute("Note", str)
Big = Attribute("Big", str)
Inbox = Channel("Inbox", str)
ChA = Channel("ChA", str)
ChB = Channel("ChB", str)
Never = Channel("Never", str)  # nobody publishes here: a wait on it lasts until cancelled
Box = ChannelMap("Box", str)
Log = Stream("Log", str)
SCHEMA = [Count, Note, Big, Inbox, ChA, ChB, Never, Box, Log]

FAST_RETRY = RetryPolicy(max_attempts=3, initial_interval_seconds=0.05, backoff_coefficient=1.0,
                         max_interval_seconds=0.05)


def channel(label: str) -> ChannelRef[str]:
    """'Inbox', 'ChA', ... or 'Box[key]' to the channel instance."""
    if label.startswith("Box[") and label.endswith("]"):
        return Box[label[4:-1]]
    return {"Inbox": Inbox, "ChA": ChA, "ChB": ChB, "Never": Never}[label]


# RPCs every flow of this file has --------------------------------------------------------------


@rpc(request_type=list[str])
async def peek(ctx: RpcContext, labels: list[str]) -> dict[str, list[tuple[int, str]]]:
    """Pending (message ID, value) of the named channel instances, oldest first."""
    return {label: [(m.message_id, m.value) for m in ctx.pending(channel(label))] for label in labels}


@rpc()
async def incr(ctx: RpcContext, _: None) -> int:
    value = (ctx.get(Count) or 0) + 1
    ctx.set(Count, value)
    return value


@rpc(locks=[Count])
async def bump(ctx: RpcContext, _: None) -> None:
    """Locks Count; writes and publishes, so a wrongly accepted call would leave traces."""
    ctx.set(Count, 100)
    ctx.publish(Inbox, "bumped")


@rpc(locks=[Note])
async def touch_note(ctx: RpcContext, _: None) -> None:
    ctx.set(Note, "touched")


@rpc()
async def explode(ctx: RpcContext, _: None) -> None:
    ctx.set(Count, 99)
    ctx.set(Note, "exploded")
    ctx.publish(Inbox, "boom")
    ctx.append(Log, "boom")
    raise RuntimeError("explode after writing")


@rpc(request_type=list[str])
async def publish_many(ctx: RpcContext, values: list[str]) -> None:
    for value in values:
        ctx.publish(Inbox, value)


@rpc(request_type=int)
async def drop(ctx: RpcContext, message_id: int) -> None:
    ctx.delete_message(Inbox, message_id)


@rpc(request_type=list[int])
async def drop_all(ctx: RpcContext, message_ids: list[int]) -> None:
    """Writes, publishes, then deletes every given message: all of it or nothing commits."""
    ctx.set(Note, "dropped")
    ctx.publish(Inbox, "side effect")
    for mid in message_ids:
        ctx.delete_message(Inbox, mid)


COMMON_RPCS = [peek, incr, bump, touch_note, explode, publish_many, drop, drop_all]


def make_flow(flow_type: str, steps: Sequence[Step[Any]], start: str | None, rpcs: Sequence[Any] = ()) -> Flow:
    return Flow(flow_type, steps, start_step=start, schema=SCHEMA, rpcs=[*COMMON_RPCS, *rpcs])


# Steps used by several flows ---------------------------------------------------------------------


async def dead_end(ctx: Context, _: Any) -> StepDecision:
    return StepDecision.dead_end()


async def wait_never(ctx: Context, _: Any) -> Wait:
    return Wait.until(Never.for_one())


def idle_step() -> Step[Any]:
    """A Step that waits until it is cancelled; keeps its flow's Step shape visible."""
    return Step("Idle", dead_end, wait_for=wait_never)


def prime_step() -> Step[Any]:
    """Start Step: publishes input['publish'] ([label, value] pairs) then goes to input['next']."""

    async def execute(ctx: Context, inp: dict[str, Any]) -> StepDecision:
        for label, value in inp["publish"]:
            ctx.publish(channel(label), value)
        return StepDecision.go_to(inp["next"], inp.get("input"))

    return Step("Prime", execute, input_type=dict[str, Any])


def waiter_step(name: str, wait: Callable[[], Wait], seen: list[dict[str, Any]]) -> Step[Any]:
    """A Step waiting on `wait()`; its Execute records what the wait consumed, per condition."""

    async def wait_for(ctx: Context, _: Any) -> Wait:
        return wait()

    async def execute(ctx: Context, inp: Any) -> StepDecision:
        wr = ctx.wait_result
        assert wr is not None and wr.spec is not None
        seen.append({
            "flow_id": ctx.flow_id,
            "input": inp,
            "satisfied": wr.satisfied,
            "timer_fired": wr.timer_fired,
            "messages": [wr.messages_at(i) for i in range(len(wr.spec.conditions))],
            "by_channel": {label: wr.messages(channel(label)) for label in ("Inbox", "ChA", "ChB", "Box[a]")},
        })
        return StepDecision.dead_end()

    return Step(name, execute, wait_for=wait_for)


# Probes -------------------------------------------------------------------------------------------


async def history(eng: Engine, flow_id: str, event: str | None = None, seid: str | None = None) -> list[HistoryEntry]:
    return [
        h for h in await eng.client.get_flow_history(flow_id)
        if (event is None or h.event_type == event) and (seid is None or h.step_execution_id == seid)
    ]


async def step_state(eng: Engine, flow_id: str, seid: str) -> tuple[str, int] | None:
    """(state, attempt) of an active Step execution, or None when it is not active."""
    info = await eng.client.describe_flow(flow_id)
    for s in info.active_steps:
        if s.step_execution_id == seid:
            return s.state, s.attempt
    return None


async def wait_state(eng: Engine, flow_id: str, seid: str, state: str) -> None:
    async def probe() -> bool:
        found = await step_state(eng, flow_id, seid)
        return found is not None and found[0] == state

    await wait_until(f"{seid} of {flow_id} {state}", probe)


async def no_active_steps(eng: Engine, flow_id: str) -> None:
    async def probe() -> bool:
        return not (await eng.client.describe_flow(flow_id)).active_steps

    await wait_until(f"no active Steps in {flow_id}", probe)


def seen_probe(seen: Sequence[Any], n: int = 1) -> Callable[[], Awaitable[bool]]:
    """A wait_until probe: true once handlers have reported `n` times."""

    async def probe() -> bool:
        return len(seen) >= n

    return probe


async def pending(eng: Engine, flow_id: str, label: str) -> list[str]:
    out = await eng.client.rpc(flow_id, "peek", [label])
    return [value for _mid, value in out[label]]


async def stored_messages(eng: Engine, flow_id: str) -> list[tuple[str, str, bytes]]:
    """Every queued channel message of a flow, read from the table (works on closed flows too)."""
    rows = await eng.store.raw(lambda db: db.all(
        "SELECT channel, key, value FROM channel_messages WHERE flow_id = ? ORDER BY message_id", (flow_id,)))
    return [(str(r[0]), str(r[1]), bytes(r[2])) for r in rows]


async def stream_values(eng: Engine, flow_id: str) -> list[tuple[str, int, str]]:
    read = await eng.client.read_stream(flow_id, Log)
    return [(e.step_execution_id, e.attempt, e.value) for e in read.events]


# E1 Atomic commit -------------------------------------------------------------------------------


async def test_e1_failed_attempts_contribute_nothing(db_url: str) -> None:
    """E1: a WaitFor and an Execute that write, delete, publish and append and then raise leave none of it.

    Catches: writes applied as the handler makes them (not buffered to the commit), a failed attempt's
    buffer committed with the failure record, or a retry reusing the failed attempt's write buffer.
    The second attempts write on purpose, proving the probes see what does commit.
    """

    async def seed(ctx: Context, _: None) -> StepDecision:
        ctx.set(Note, "seed")
        return StepDecision.go_to("Work")

    async def work_wait(ctx: Context, _: None) -> Wait:
        if ctx.attempt == 1:
            ctx.set(Count, 7)
            ctx.publish(Inbox, "wait-1")
            ctx.append(Log, "wait-1")
            raise RuntimeError("wait_for fails after writing")
        return Wait.skip_immediately()

    async def work(ctx: Context, _: None) -> StepDecision:
        if ctx.attempt == 1:
            ctx.set(Count, 1)
            ctx.delete(Note)
            ctx.publish(Inbox, "exec-1")
            ctx.append(Log, "exec-1")
            raise RuntimeError("execute fails after writing")
        ctx.set(Big, "exec-2")
        ctx.publish(Inbox, "exec-2")
        ctx.append(Log, "exec-2")
        return StepDecision.dead_end()

    opts = StepOptions(execute_retry=FAST_RETRY, wait_for_retry=FAST_RETRY)
    flow = make_flow("E1Fail", [Step("Seed", seed), Step("Work", work, wait_for=work_wait, options=opts)], "Seed")
    async with engine_for(db_url, Registry([flow])) as eng:
        await eng.client.start_flow("E1Fail", "f")
        await wait_until("Work-1 completed", lambda: history(eng, "f", "execute_completed", "Work-1"))
        failures = await history(eng, "f", "attempt_failed", "Work-1")
        assert [h.detail.split(":")[0] for h in failures] == ["wait_for", "execute"]
        assert await eng.client.get_attribute("f", Count) is None
        assert await eng.client.get_attribute("f", Note) == "seed", "a failed attempt's delete was committed"
        assert await eng.client.get_attribute("f", Big) == "exec-2"
        assert await pending(eng, "f", "Inbox") == ["exec-2"]
        assert await stream_values(eng, "f") == [("Work-1", 2, "exec-2")]
        assert (await eng.client.describe_flow("f")).status == "running"


async def test_e1_execute_writes_and_movement_commit_together(db_url: str) -> None:
    """E1: a successful Execute's writes, publish, append and movement are visible together.

    The next Step is claimed in the same transaction as the commit (the worker's commit-and-claim), so
    its snapshot must already hold the writes. Catches: movements committed before the writes (the next
    Step would load the old state) or publishes committed after the movement (its wait would miss them).
    """
    seen: list[Any] = []

    async def first(ctx: Context, _: None) -> StepDecision:
        ctx.set(Count, 41)
        ctx.set(Note, "from First")
        ctx.publish(Inbox, "hello")
        ctx.append(Log, "first")
        return StepDecision.go_to("Second")

    async def second(ctx: Context, _: None) -> StepDecision:
        seen.append(("second", ctx.get(Count), ctx.get(Note)))
        return StepDecision.go_to("Third")

    third_seen: list[dict[str, Any]] = []
    flow = make_flow("E1Ok", [
        Step("First", first), Step("Second", second),
        waiter_step("Third", lambda: Wait.until(Inbox.for_one()), third_seen),
    ], "First")
    async with engine_for(db_url, Registry([flow])) as eng:
        await eng.client.start_flow("E1Ok", "f")
        await wait_until("Third executed", seen_probe(third_seen))
        assert seen == [("second", 41, "from First")]
        assert third_seen[0]["messages"] == [["hello"]]
        assert await stream_values(eng, "f") == [("First-1", 1, "first")]
        assert len(await history(eng, "f", "execute_completed", "First-1")) == 1


async def test_e1_failure_late_in_execute_commit_rolls_back_its_writes(tmp_path: Path) -> None:
    """E1: when scheduling an Execute's movement fails inside the commit, its writes roll back too.

    A SQLite trigger makes inserting the 'Doomed' Step's task row abort, i.e. the commit fails after
    the attribute writes, publish and append were applied. Catches: writes and movements committed in
    separate transactions (the writes would survive) or a partial commit being acknowledged.
    """
    url = f"sqlite:///{tmp_path / 'e1-trigger.db'}"

    async def first(ctx: Context, _: None) -> StepDecision:
        ctx.set(Count, 5)
        ctx.publish(Inbox, "lost")
        ctx.append(Log, "lost")
        return StepDecision.go_to("Doomed")

    flow = make_flow("E1Late", [
        Step("First", first, options=StepOptions(execute_retry=RetryPolicy(max_attempts=1))),
        Step("Doomed", dead_end),
    ], "First")
    async with engine_for(url, Registry([flow]), worker=False) as eng:
        await eng.store.raw(lambda db: db.run(
            "CREATE TRIGGER doom BEFORE INSERT ON tasks WHEN NEW.step_type = 'Doomed' "
            "BEGIN SELECT RAISE(ABORT, 'injected failure inside the commit'); END"), write=True)
        await eng.client.start_flow("E1Late", "f")
        await eng.start_worker()
        info = await eng.client.wait_for_flow("f", 10)
        assert info.status == "failed"
        assert info.error is not None and "injected failure" in info.error
        assert await eng.client.get_attribute("f", Count) is None
        assert await stored_messages(eng, "f") == []
        assert await stream_values(eng, "f") == []
        assert await history(eng, "f", "execute_completed") == []
        counters = await eng.store.raw(lambda db: transitions.step_counters(db, "f"))
        assert counters == {"First": 1}, "the Doomed Step's ID was allocated by a rolled-back commit"


async def test_e1_rpc_that_raises_commits_nothing_and_flow_keeps_running(db_url: str) -> None:
    """E1/E8: an RPC handler that writes, publishes, appends and then raises commits none of it.

    The flow has a Step waiting on Inbox, so a leaked publish would be consumed and visible. Catches:
    RPC writes applied before the handler returns, an RPC error failing the flow, or the waiting Step
    being disturbed by a rolled-back publish.
    """
    seen: list[dict[str, Any]] = []
    flow = make_flow("E1Rpc", [waiter_step("Listen", lambda: Wait.until(Inbox.for_one()), seen)], "Listen")
    async with engine_for(db_url, Registry([flow])) as eng:
        await eng.client.start_flow("E1Rpc", "f")
        await wait_state(eng, "f", "Listen-1", "waiting")
        with pytest.raises(RuntimeError, match="explode after writing"):
            await eng.client.rpc("f", "explode")
        assert await eng.client.get_attribute("f", Count) is None
        assert await eng.client.get_attribute("f", Note) is None
        assert await stream_values(eng, "f") == []
        assert await step_state(eng, "f", "Listen-1") == ("waiting", 1)
        assert (await eng.client.describe_flow("f")).status == "running"
        # The flow keeps working: RPCs commit, and the waiting Step gets the next real message.
        assert await eng.client.rpc("f", "incr") == 1
        await eng.client.publish("f", Inbox, "real")
        await wait_until("Listen executed", seen_probe(seen))
        assert seen[0]["messages"] == [["real"]]


async def test_e1_value_too_large_leaves_the_execute_other_writes_unstored(db_url: str) -> None:
    """E1/E14: a ValueTooLargeError in one write of an Execute leaves its other writes unstored.

    Catches: writes flushed one by one as they are set (the small ones before the oversized one would
    survive), or the oversized write being dropped silently while the rest commits.
    """

    async def work(ctx: Context, _: None) -> StepDecision:
        ctx.set(Note, "small")
        ctx.publish(Inbox, "small")
        ctx.append(Log, "small")
        ctx.set(Big, "x" * (MAX_VALUE_BYTES + 1))
        return StepDecision.dead_end()

    flow = make_flow("E1Big", [Step("Work", work, options=StepOptions(execute_retry=RetryPolicy(max_attempts=1)))],
                     "Work")
    async with engine_for(db_url, Registry([flow])) as eng:
        await eng.client.start_flow("E1Big", "f")
        info = await eng.client.wait_for_flow("f", 10)
        assert info.status == "failed"
        assert info.error is not None and "ValueTooLargeError" in info.error and "'Big'" in info.error
        assert await eng.client.get_attribute("f", Note) is None
        assert await eng.client.get_attribute("f", Big) is None
        assert await stored_messages(eng, "f") == []
        assert await stream_values(eng, "f") == []


# E2 Fencing -------------------------------------------------------------------------------------


# The flow rows hold the Step counters and stream positions on SQLite; PostgreSQL keeps them in
# tables of their own.
TABLES = ("flows", "tasks", "attributes", "channel_messages", "stream_events", "history", "locks")
POSTGRES_TABLES = ("step_counters", "streams")


async def dump(eng: Engine) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every flow-state table: 'changed nothing' means this is unchanged."""

    def read(db: Any) -> dict[str, list[tuple[Any, ...]]]:
        names = TABLES + (POSTGRES_TABLES if getattr(db, "dialect", None) == "postgres" else ())
        return {t: [tuple(r) for r in db.all(f"SELECT * FROM {t} ORDER BY 1, 2, 3")] for t in names}

    result: dict[str, list[tuple[Any, ...]]] = await eng.store.raw(read)
    return result


async def claim_one(eng: Engine, worker_id: str, flow_type: str) -> Lease | None:
    leases = await eng.store.claim(worker_id, [flow_type], 1)
    return leases[0] if leases else None


async def expire_ghost(eng: Engine) -> None:
    """Run housekeeping until a worker whose registration lapsed has lost its leases."""

    async def probe() -> int:
        return (await eng.store.housekeeping()).leases_expired

    await wait_until("housekeeping expired the ghost worker's lease", probe)


@rpc()
async def cancel_work(ctx: RpcContext, _: None) -> RPCResult[None]:
    return RPCResult(None, canceling_steps=("Work",))


FENCE = make_flow("Fence", [
    Step("Work", dead_end, options=StepOptions(execute_retry=FAST_RETRY)),
    Step("Next", dead_end),
], "Work", rpcs=[cancel_work])


def fence_writes(tag: str) -> tuple[WriteSet, DecisionRecord]:
    writes = WriteSet(
        attributes={("Count", ""): b"13", ("Note", ""): f'"{tag}"'.encode()},
        publishes=[("Inbox", "", f'"{tag}"'.encode())],
        appends=[("Log", Log.capacity_bytes, f'"{tag}"'.encode())],
    )
    decision = DecisionRecord(kind="movements", movements=(movement_record(FENCE, Movement("Next")),))
    return writes, decision


@pytest.mark.parametrize("how", ["lease_expired", "superseded", "cancelled", "worker_lost_after_start"])
async def test_e2_stale_lease_is_rejected_and_changes_nothing(db_url: str, how: str) -> None:
    """E2: commit_execute, commit_wait_for, heartbeat, append_best_effort and fail_attempt with a stale
    Lease raise StaleAttemptError and leave every table unchanged.

    Stale by: its worker's registration lapsing (housekeeping hands the attempt back), another claim
    superseding it, the Step being cancelled by an RPC, or its worker dying after it started. Catches:
    fencing by task ID only (no epoch/state check), a check done after some writes, a zombie's heartbeat
    resurrecting or re-arming the task, or best-effort events accepted from a dead attempt.
    """
    async with engine_for(db_url, Registry([FENCE]), worker=False) as eng:
        store = eng.store
        await eng.client.start_flow("Fence", "f")
        ttl_ms = 1 if how in ("lease_expired", "superseded") else 600_000
        await store.register_worker("ghost", "test-host", 1, ttl_ms)
        stale = await claim_one(eng, "ghost", "Fence")
        assert stale is not None and stale.attempt == 1
        current: Lease | None = None
        if how in ("lease_expired", "superseded"):
            await expire_ghost(eng)
            assert await step_state(eng, "f", "Work-1") == ("ready", 1)
            if how == "superseded":
                await store.register_worker("live", "test-host", 2, 600_000)
                current = await claim_one(eng, "live", "Fence")
                assert current is not None and current.lease_epoch > stale.lease_epoch
        elif how == "cancelled":
            await eng.client.rpc("f", "cancel_work")
            assert await step_state(eng, "f", "Work-1") is None
        else:
            await store.heartbeat(stale, "ghost checkpoint")
            await store.unregister_worker("ghost")
            assert await step_state(eng, "f", "Work-1") == ("ready", 2)

        before = await dump(eng)
        writes, decision = fence_writes("stale")
        with pytest.raises(StaleAttemptError):
            await store.commit_execute(stale, writes, decision)
        with pytest.raises(StaleAttemptError):
            await store.commit_wait_for(stale, writes, Wait.until(Inbox.for_one()).spec())
        with pytest.raises(StaleAttemptError):
            await store.heartbeat(stale, "zombie checkpoint")
        with pytest.raises(StaleAttemptError):
            await store.append_best_effort(stale, "Log", Log.capacity_bytes, [b'"zombie"'])
        with pytest.raises(StaleAttemptError):
            await store.fail_attempt(stale, ErrorInfo("Zombie", "late failure"))
        assert await dump(eng) == before

        if how == "cancelled":
            return
        # Positive control: the attempt that owns the task now can do all of it.
        if current is None:
            await store.register_worker("live", "test-host", 2, 600_000)
            current = await wait_until("Work-1 claimable again", lambda: claim_one(eng, "live", "Fence"))
        await store.heartbeat(current, "live checkpoint")
        await store.append_best_effort(current, "Log", Log.capacity_bytes, [b'"live event"'])
        writes, decision = fence_writes("live")
        await store.commit_execute(current, writes, decision)
        assert await eng.client.get_attribute("f", Note) == "live"
        assert await step_state(eng, "f", "Next-1") == ("ready", 1)
        assert [v for _s, _a, v in await stream_values(eng, "f")] == ["live event", "live"]


# E3 Attempts ------------------------------------------------------------------------------------


async def test_e3_attempt_numbers_start_at_one(db_url: str) -> None:
    """E3: ctx.attempt is 1, 2, 3 over a Step's retries and history records the same numbers.

    Catches: zero-based attempts, or attempt numbers not advancing on retry.
    """
    attempts: list[int] = []

    async def work(ctx: Context, _: None) -> StepDecision:
        attempts.append(ctx.attempt)
        if ctx.attempt < 3:
            raise RuntimeError(f"attempt {ctx.attempt} fails")
        return StepDecision.graceful_complete()

    flow = make_flow("E3Num", [Step("Work", work, options=StepOptions(execute_retry=FAST_RETRY))], "Work")
    async with engine_for(db_url, Registry([flow])) as eng:
        await eng.client.start_flow("E3Num", "f")
        assert (await eng.client.wait_for_flow("f", 10)).status == "completed"
        assert attempts == [1, 2, 3]
        assert [h.attempt for h in await history(eng, "f", "attempt_failed")] == [1, 2]
        assert [h.attempt for h in await history(eng, "f", "execute_completed")] == [3]


async def test_e3_unstarted_attempt_of_vanished_worker_keeps_its_number(db_url: str) -> None:
    """E3: an attempt claimed by a worker that vanished before the attempt started is handed out again
    with the same attempt number and consumes no retry (max_attempts=1 still completes).

    Covers both ways a worker vanishes: unregistering, and its registration expiring. Catches: treating
    every lost lease as a failed attempt (attempt 2, or the flow failing with max_attempts=1).
    """
    attempts: list[int] = []

    async def work(ctx: Context, _: None) -> StepDecision:
        attempts.append(ctx.attempt)
        return StepDecision.graceful_complete()

    flow = make_flow("E3Unstarted", [
        Step("Work", work, options=StepOptions(execute_retry=RetryPolicy(max_attempts=1))),
    ], "Work")
    async with engine_for(db_url, Registry([flow]), worker=False) as eng:
        await eng.client.start_flow("E3Unstarted", "f")
        await eng.store.register_worker("ghost-1", "test-host", 1, 600_000)
        lease = await claim_one(eng, "ghost-1", "E3Unstarted")
        assert lease is not None and lease.attempt == 1
        await eng.store.unregister_worker("ghost-1")
        assert await step_state(eng, "f", "Work-1") == ("ready", 1)

        await eng.store.register_worker("ghost-2", "test-host", 2, 1)
        lease = await claim_one(eng, "ghost-2", "E3Unstarted")
        assert lease is not None and lease.attempt == 1
        await expire_ghost(eng)
        assert await step_state(eng, "f", "Work-1") == ("ready", 1)

        await eng.start_worker()
        assert (await eng.client.wait_for_flow("f", 10)).status == "completed"
        assert attempts == [1]
        assert await history(eng, "f", "attempt_failed") == []


async def test_e3_started_attempt_of_vanished_worker_fails_and_next_attempt_is_plus_one(db_url: str) -> None:
    """E3/E10: once an attempt heartbeated, its worker's death fails it; the retry is attempt 2 and reads
    the dead attempt's checkpoint.

    Catches: started attempts handed out again under the same number (the 'started' mark ignored), or a
    worker-death failure that loses the checkpoint.
    """
    seen: list[tuple[int, str | None]] = []

    async def work(ctx: Context, _: None) -> StepDecision:
        seen.append((ctx.attempt, ctx.checkpoint))
        return StepDecision.graceful_complete()

    flow = make_flow("E3Started", [Step("Work", work, options=StepOptions(execute_retry=FAST_RETRY))], "Work")
    async with engine_for(db_url, Registry([flow]), worker=False) as eng:
        await eng.client.start_flow("E3Started", "f")
        await eng.store.register_worker("ghost", "test-host", 1, 600_000)
        lease = await claim_one(eng, "ghost", "E3Started")
        assert lease is not None
        await eng.store.heartbeat(lease, "ghost was here")
        await eng.store.unregister_worker("ghost")
        assert await step_state(eng, "f", "Work-1") == ("ready", 2)
        await eng.start_worker()
        assert (await eng.client.wait_for_flow("f", 10)).status == "completed"
        assert seen == [(2, "ghost was here")]
        (failed,) = await history(eng, "f", "attempt_failed")
        assert failed.attempt == 1 and "WorkerLost" in failed.detail


@pytest.mark.parametrize("heartbeat_first", [False, True])
async def test_e3_recovery_error_attempt_progress_and_last_error(db_url: str, heartbeat_first: bool) -> None:
    """E3/E4: the recovery error is NOT_STARTED when no attempt ever heartbeated, NOT_COMPLETED when any
    did (here only the first), and carries the last attempt's error type and detail.

    Catches: progress computed from the last attempt only, the first error reported instead of the last,
    or a wrong attempt count.
    """
    recovered: list[RecoveryError | None] = []

    async def work(ctx: Context, _: None) -> StepDecision:
        if ctx.attempt == 1:
            if heartbeat_first:
                await ctx.heartbeat("halfway")
            raise ValueError("first failure")
        raise KeyError("second failure")

    async def rescue(ctx: Context, _: None) -> StepDecision:
        recovered.append(ctx.recovery_error)
        return StepDecision.graceful_complete()

    opts = StepOptions(execute_retry=RetryPolicy(max_attempts=2, initial_interval_seconds=0.05),
                       failure_route="Rescue")
    flow = make_flow("E3Progress", [Step("Work", work, options=opts), Step("Rescue", rescue)], "Work")
    async with engine_for(db_url, Registry([flow])) as eng:
        await eng.client.start_flow("E3Progress", "f")
        assert (await eng.client.wait_for_flow("f", 10)).status == "completed"
        (err,) = recovered
        assert err is not None
        expected = AttemptProgress.NOT_COMPLETED if heartbeat_first else AttemptProgress.NOT_STARTED
        assert err.attempt_progress == expected
        assert (err.error_type, err.attempts, err.method) == ("KeyError", 2, "execute")
        assert "second failure" in err.detail
        assert (err.step_type, err.step_execution_id) == ("Work", "Work-1")


async def test_e3_worker_lost_after_start_reaches_route_as_not_completed(db_url: str) -> None:
    """E3: a started attempt whose worker dies, with no retries left, reaches the failure route as
    NOT_COMPLETED with the worker-loss error. Catches: a worker death that is not counted as a failed
    started attempt (the Step silently re-run, or reported NOT_STARTED).
    """
    recovered: list[RecoveryError | None] = []

    async def rescue(ctx: Context, _: None) -> StepDecision:
        recovered.append(ctx.recovery_error)
        return StepDecision.graceful_complete()

    opts = StepOptions(execute_retry=RetryPolicy(max_attempts=1), failure_route="Rescue")
    flow = make_flow("E3Lost", [Step("Work", dead_end, options=opts), Step("Rescue", rescue)], "Work")
    async with engine_for(db_url, Registry([flow]), worker=False) as eng:
        await eng.client.start_flow("E3Lost", "f")
        await eng.store.register_worker("ghost", "test-host", 1, 600_000)
        lease = await claim_one(eng, "ghost", "E3Lost")
        assert lease is not None
        await eng.store.heartbeat(lease, None)
        await eng.store.unregister_worker("ghost")
        await eng.start_worker()
        assert (await eng.client.wait_for_flow("f", 10)).status == "completed"
        (err,) = recovered
        assert err is not None
        assert (err.attempt_progress, err.error_type, err.attempts) == (AttemptProgress.NOT_COMPLETED, "WorkerLost", 1)


# E4 Retries and failure routes --------------------------------------------------------------------


async def test_e4_max_attempts_then_flow_fails_naming_the_step(db_url: str) -> None:
    """E4: max_attempts=3 means exactly three runs; with no failure route the flow fails with an error
    naming the Step and the last error; each retry starts no earlier than its interval after the failure.

    Catches: off-by-one retry counting, endless retries, a silent failure without the Step's name, or
    retries that ignore the interval.
    """
    starts: list[tuple[int, int]] = []

    async def work(ctx: Context, _: None) -> StepDecision:
        starts.append((ctx.attempt, int(time.time() * 1000)))
        raise ValueError(f"nope #{ctx.attempt}")

    policy = RetryPolicy(max_attempts=3, initial_interval_seconds=0.05, backoff_coefficient=2.0)
    flow = make_flow("E4Max", [Step("Work", work, options=StepOptions(execute_retry=policy))], "Work")
    async with engine_for(db_url, Registry([flow])) as eng:
        await eng.client.start_flow("E4Max", "f")
        info = await eng.client.wait_for_flow("f", 10)
        assert info.status == "failed"
        assert info.error is not None
        assert "Work-1" in info.error and "ValueError" in info.error and "nope #3" in info.error
        assert [a for a, _ in starts] == [1, 2, 3]
        failed = await history(eng, "f", "attempt_failed")
        assert [h.attempt for h in failed] == [1, 2, 3]
        for k, interval_ms in ((0, 50), (1, 100)):
            assert starts[k + 1][1] >= failed[k].at_ms + interval_ms


async def task_row(eng: Engine, task_id: int) -> tuple[Any, ...] | None:
    row: tuple[Any, ...] | None = await eng.store.raw(lambda db: db.one(
        "SELECT state, attempt, run_at, claimed_at, method_first_at FROM tasks WHERE task_id = ?", (task_id,)))
    return row


async def test_e4_backoff_intervals_in_the_store(db_url: str) -> None:
    """E4: the retry of failed attempt n is scheduled initial * backoff**(n-1) after the failure, capped at
    max_interval (50, 150, then 450 capped to 200 ms), and is not handed out before that.

    Driven by hand through the store so the scheduled times are exact. Catches: a constant interval, the
    coefficient applied one time too many, a missing cap, or claims that ignore run_at.
    """
    policy = RetryPolicy(max_attempts=4, initial_interval_seconds=0.05, backoff_coefficient=3.0,
                         max_interval_seconds=0.2)
    flow = make_flow("E4Backoff", [Step("Work", dead_end, options=StepOptions(execute_retry=policy))], "Work")
    async with engine_for(db_url, Registry([flow]), worker=False) as eng:
        await eng.client.start_flow("E4Backoff", "f")
        await eng.store.register_worker("w", "test-host", 1, 600_000)
        expected_gaps = [50, 150, 200]
        run_at = 0
        for attempt in range(1, 5):
            lease = await wait_until(f"attempt {attempt} claimable", lambda: claim_one(eng, "w", "E4Backoff"))
            assert lease.attempt == attempt
            row = await task_row(eng, lease.task_id)
            assert row is not None and row[3] >= run_at, "an attempt was handed out before its retry time"
            await eng.store.fail_attempt(lease, ErrorInfo("Boom", f"attempt {attempt}"))
            failed_at = (await history(eng, "f", "attempt_failed"))[-1].at_ms
            row = await task_row(eng, lease.task_id)
            if attempt == 4:
                assert row is None
                break
            assert row is not None and row[:2] == ("ready", attempt + 1)
            run_at = int(row[2])
            assert run_at - failed_at == expected_gaps[attempt - 1]
        info = await eng.client.describe_flow("f")
        assert info.status == "failed" and info.error is not None and "after 4 attempt(s)" in info.error


def test_e4_the_default_retry_policy() -> None:
    """A Step with no policy of its own gets three attempts, 1 s after the first failure and 2 s
    after the second (doubling, capped at 60 s), with no total duration: docs/engine.md states it."""
    policy = RetryPolicy()
    assert (policy.max_attempts, policy.total_duration_seconds) == (3, None)
    assert [policy.interval_after(n) for n in (1, 2, 3, 7, 8)] == [1.0, 2.0, 4.0, 60.0, 60.0]


async def test_e4_total_duration_budget_stops_retries(db_url: str) -> None:
    """E4: a retry that would start after total_duration_seconds from the first attempt's start is not
    made, although max_attempts would allow many more.

    Each failure is checked against the rule with the store's own times (first claim, failure time).
    Catches: the budget ignored (10 attempts), or counted from the wrong moment.
    """
    policy = RetryPolicy(max_attempts=10, initial_interval_seconds=0.2, backoff_coefficient=1.0,
                         max_interval_seconds=0.2, total_duration_seconds=0.5)
    flow = make_flow("E4Budget", [Step("Work", dead_end, options=StepOptions(execute_retry=policy))], "Work")
    async with engine_for(db_url, Registry([flow]), worker=False) as eng:
        await eng.client.start_flow("E4Budget", "f")
        await eng.store.register_worker("w", "test-host", 1, 600_000)
        first_start: int | None = None
        attempts = 0
        while True:
            lease = await wait_until("Work claimable", lambda: claim_one(eng, "w", "E4Budget"))
            attempts += 1
            row = await task_row(eng, lease.task_id)
            assert row is not None
            first_start = int(row[4]) if first_start is None else first_start
            assert int(row[4]) == first_start
            await eng.store.fail_attempt(lease, ErrorInfo("Boom", "fails"))
            failed_at = (await history(eng, "f", "attempt_failed"))[-1].at_ms
            retried = await step_state(eng, "f", "Work-1") is not None
            assert retried == (failed_at + 200 <= first_start + 500), (attempts, failed_at - first_start)
            if not retried:
                break
        # Every retry starts >= 200 ms after the previous one, so at most 3 fit in 500 ms.
        assert attempts <= 3
        assert (await eng.client.describe_flow("f")).status == "failed"


async def test_e4_failure_route_receives_failing_step_input_and_recovery_error(db_url: str) -> None:
    """E4: when retries are spent the failure route starts with the failing Step's own input (not the
    flow's input) and ctx.recovery_error; the flow does not fail.

    Catches: the route given the flow input or None, a missing recovery error, or the flow failing
    although a route exists.
    """
    got: list[tuple[Any, RecoveryError | None]] = []

    async def start(ctx: Context, _: int) -> StepDecision:
        return StepDecision.go_to("Work", {"job": 42})

    async def work(ctx: Context, inp: dict[str, int]) -> StepDecision:
        raise ValueError(f"cannot do job {inp['job']}")

    async def rescue(ctx: Context, inp: dict[str, int]) -> StepDecision:
        got.append((inp, ctx.recovery_error))
        return StepDecision.graceful_complete("rescued")

    opts = StepOptions(execute_retry=FAST_RETRY, failure_route="Rescue")
    flow = make_flow("E4Route", [
        Step("Start", start, input_type=int),
        Step("Work", work, input_type=dict[str, int], options=opts),
        Step("Rescue", rescue, input_type=dict[str, int]),
    ], "Start")
    async with engine_for(db_url, Registry([flow])) as eng:
        await eng.client.start_flow("E4Route", "f", 1)
        info = await eng.client.wait_for_flow("f", 10)
        assert info.status == "completed"
        assert await eng.client.flow_output("f") == "rescued"
        ((inp, err),) = got
        assert inp == {"job": 42}
        assert err is not None
        assert (err.step_execution_id, err.attempts, err.error_type) == ("Work-1", 3, "ValueError")
        assert "cannot do job 42" in err.detail


async def test_e4_no_retry_error_skips_remaining_retries(db_url: str) -> None:
    """E4: a handler raising NoRetryError goes straight to the failure route on its first attempt,
    although max_attempts=5. Catches: NoRetryError treated as an ordinary error (five attempts).
    """
    attempts: list[int] = []
    recovered: list[RecoveryError | None] = []

    async def work(ctx: Context, _: None) -> StepDecision:
        attempts.append(ctx.attempt)
        raise NoRetryError("permanent problem")

    async def rescue(ctx: Context, _: None) -> StepDecision:
        recovered.append(ctx.recovery_error)
        return StepDecision.graceful_complete()

    opts = StepOptions(execute_retry=RetryPolicy(max_attempts=5, initial_interval_seconds=0.05),
                       failure_route="Rescue")
    flow = make_flow("E4NoRetry", [Step("Work", work, options=opts), Step("Rescue", rescue)], "Work")
    async with engine_for(db_url, Registry([flow])) as eng:
        await eng.client.start_flow("E4NoRetry", "f")
        assert (await eng.client.wait_for_flow("f", 10)).status == "completed"
        assert attempts == [1]
        (err,) = recovered
        assert err is not None
        assert (err.attempts, err.error_type) == (1, "NoRetryError")
        assert "permanent problem" in err.detail


# E5 Durable waits -------------------------------------------------------------------------------


def wait_flow(flow_type: str, wait: Callable[[], Wait], seen: list[dict[str, Any]]) -> Flow:
    return make_flow(flow_type, [prime_step(), waiter_step("W", wait, seen)], "Prime")


def prime(publish: Sequence[tuple[str, str]], next_step: str = "W", inp: Any = None) -> dict[str, Any]:
    return {"publish": [list(p) for p in publish], "next": next_step, "input": inp}


async def test_e5_due_timer_wins_over_a_channel_and_only_the_winner_consumes(db_url: str) -> None:
    """E5: in any_of, a due timer wins even over a channel with a queued message listed first; the
    channel's message stays queued. Catches: channels checked before timers, or every satisfied
    condition consuming.
    """
    seen: list[dict[str, Any]] = []
    flow = wait_flow("E5Timer", lambda: Wait.any_of(Inbox.for_one(), Timer.by_duration(0)), seen)
    async with engine_for(db_url, Registry([flow])) as eng:
        await eng.client.start_flow("E5Timer", "f", prime([("Inbox", "queued")]))
        await wait_until("W executed", seen_probe(seen))
        assert seen[0]["satisfied"] == (1,)
        assert seen[0]["timer_fired"] is True
        assert seen[0]["messages"] == [[], []]
        assert await pending(eng, "f", "Inbox") == ["queued"]


async def test_e5_channels_tried_in_argument_order(db_url: str) -> None:
    """E5: with messages queued on two channels, any_of(ChB, ChA) takes ChB's although ChA's message is
    older; ChA's message stays queued. Catches: choosing by message age or channel name, or consuming
    from both channels.
    """
    seen: list[dict[str, Any]] = []
    flow = wait_flow("E5Order", lambda: Wait.any_of(ChB.for_one(), ChA.for_one()), seen)
    async with engine_for(db_url, Registry([flow])) as eng:
        await eng.client.start_flow("E5Order", "f", prime([("ChA", "a-older"), ("ChB", "b-newer")]))
        await wait_until("W executed", seen_probe(seen))
        assert seen[0]["satisfied"] == (0,)
        assert seen[0]["timer_fired"] is False
        assert seen[0]["messages"] == [["b-newer"], []]
        assert seen[0]["by_channel"]["ChB"] == ["b-newer"] and seen[0]["by_channel"]["ChA"] == []
        assert await pending(eng, "f", "ChA") == ["a-older"]
        assert await pending(eng, "f", "ChB") == []


async def test_e5_all_of_needs_every_condition_at_once_and_consumes_all(db_url: str) -> None:
    """E5: all_of(ChA, ChB) stays waiting with only ChA's message (which stays queued, untouched), then
    takes both at once. Catches: all_of behaving like any_of, or consuming ChA's message early.
    """
    seen: list[dict[str, Any]] = []
    flow = wait_flow("E5All", lambda: Wait.all_of(ChA.for_one(), ChB.for_one()), seen)
    async with engine_for(db_url, Registry([flow])) as eng:
        await eng.client.start_flow("E5All", "f", prime([]))
        await wait_state(eng, "f", "W-1", "waiting")
        await eng.client.publish("f", ChA, "a1")
        assert await step_state(eng, "f", "W-1") == ("waiting", 1)
        assert await pending(eng, "f", "ChA") == ["a1"]
        await eng.client.publish("f", ChB, "b1")
        await wait_until("W executed", seen_probe(seen))
        assert seen[0]["satisfied"] == (0, 1)
        assert seen[0]["messages"] == [["a1"], ["b1"]]
        assert await pending(eng, "f", "ChA") == [] and await pending(eng, "f", "ChB") == []


async def test_e5_at_most_never_blocks(db_url: str) -> None:
    """E5: at_most(2) is satisfied by an empty queue (taking nothing) and takes only the two oldest of
    three. Catches: at_most treated as at_least(1) (the empty flow would wait forever) or taking all.
    """
    seen: list[dict[str, Any]] = []
    flow = wait_flow("E5AtMost", lambda: Wait.until(Inbox.at_most(2)), seen)
    async with engine_for(db_url, Registry([flow])) as eng:
        await eng.client.start_flow("E5AtMost", "empty", prime([]))
        await eng.client.start_flow("E5AtMost", "three", prime([("Inbox", "m0"), ("Inbox", "m1"), ("Inbox", "m2")]))
        await wait_until("both W executed", seen_probe(seen, 2))
        by_flow = {s["flow_id"]: s["messages"] for s in seen}
        assert by_flow == {"empty": [[]], "three": [["m0", "m1"]]}
        assert await pending(eng, "three", "Inbox") == ["m2"]


async def test_e5_at_least_blocks_then_takes_everything_queued(db_url: str) -> None:
    """E5: at_least(2) waits with one message, then takes all four once three more arrive in one commit.
    Catches: at_least satisfied below n, or taking exactly n.
    """
    seen: list[dict[str, Any]] = []
    flow = wait_flow("E5AtLeast", lambda: Wait.until(Inbox.at_least(2)), seen)
    async with engine_for(db_url, Registry([flow])) as eng:
        await eng.client.start_flow("E5AtLeast", "f", prime([("Inbox", "m0")]))
        await wait_state(eng, "f", "W-1", "waiting")
        assert await pending(eng, "f", "Inbox") == ["m0"]
        await eng.client.rpc("f", "publish_many", ["m1", "m2", "m3"])
        await wait_until("W executed", seen_probe(seen))
        assert seen[0]["messages"] == [["m0", "m1", "m2", "m3"]]
        assert await pending(eng, "f", "Inbox") == []


async def test_e5_a_message_goes_to_exactly_one_of_two_waiting_steps(db_url: str) -> None:
    """E5: two Steps wait for one Inbox message each; one message satisfies exactly one of them, the
    second message the other. Catches: a message delivered to every matching wait.
    """
    seen: list[dict[str, Any]] = []

    async def fork(ctx: Context, _: None) -> StepDecision:
        return StepDecision.go_to_many(("W", "x"), ("W", "y"))

    flow = make_flow("E5One", [Step("Fork", fork), waiter_step("W", lambda: Wait.until(Inbox.for_one()), seen)],
                     "Fork")
    async with engine_for(db_url, Registry([flow])) as eng:
        await eng.client.start_flow("E5One", "f")
        await wait_state(eng, "f", "W-1", "waiting")
        await wait_state(eng, "f", "W-2", "waiting")
        await eng.client.publish("f", Inbox, "m1")
        await wait_until("one W executed", seen_probe(seen))

        async def one_active() -> bool:
            return len((await eng.client.describe_flow("f")).active_steps) == 1

        await wait_until("the first W finished", one_active)
        states = [s.state for s in (await eng.client.describe_flow("f")).active_steps]
        assert states == ["waiting"], "the other W must still be waiting"
        assert len(seen) == 1
        await eng.client.publish("f", Inbox, "m2")
        await wait_until("both W executed", seen_probe(seen, 2))
        assert sorted(s["input"] for s in seen) == ["x", "y"]
        assert sorted(m for s in seen for m in s["messages"][0]) == ["m1", "m2"]
        assert [s["messages"][0] for s in seen] == [["m1"], ["m2"]]


@rpc()
async def start_second_waiter(ctx: RpcContext, _: None) -> RPCResult[None]:
    return RPCResult(None, next_steps=[("W", "second")])


async def test_e5_the_wait_registered_first_takes_the_first_message(db_url: str) -> None:
    """E5: W "first" registers its wait, then W "second" (started by an RPC) registers one on the
    same channel; two messages published at once go one to each, the older message to the older
    wait (evaluate_waits takes waits oldest first). Catches waits taken newest first, which would let
    a Step that keeps waiting again take every message from one that waited before it."""
    seen: list[dict[str, Any]] = []
    flow = make_flow("E5Oldest", [waiter_step("W", lambda: Wait.until(Inbox.for_one()), seen)], "W",
                     rpcs=[start_second_waiter])
    async with engine_for(db_url, Registry([flow])) as eng:
        await eng.client.start_flow("E5Oldest", "f", "first")
        await wait_state(eng, "f", "W-1", "waiting")
        await eng.client.rpc("f", "start_second_waiter", None)
        await wait_state(eng, "f", "W-2", "waiting")
        await eng.client.rpc("f", "publish_many", ["m1", "m2"])
        await wait_until("both W executed", seen_probe(seen, 2))
        assert sorted((s["input"], s["messages"][0]) for s in seen) == [("first", ["m1"]), ("second", ["m2"])]


async def test_e5_channel_map_instances_are_independent(db_url: str) -> None:
    """E5: a wait on Box[a] ignores a message on Box[b], which stays queued on Box[b]. Catches: map
    instances sharing one queue (the wait would take Box[b]'s message).
    """
    seen: list[dict[str, Any]] = []
    flow = wait_flow("E5Map", lambda: Wait.until(Box["a"].for_one()), seen)
    async with engine_for(db_url, Registry([flow])) as eng:
        await eng.client.start_flow("E5Map", "f", prime([]))
        await wait_state(eng, "f", "W-1", "waiting")
        await eng.client.publish("f", Box["b"], "for-b")
        assert await step_state(eng, "f", "W-1") == ("waiting", 1)
        await eng.client.publish("f", Box["a"], "for-a")
        await wait_until("W executed", seen_probe(seen))
        assert seen[0]["messages"] == [["for-a"]]
        assert seen[0]["by_channel"]["Box[a]"] == ["for-a"]
        assert await pending(eng, "f", "Box[b]") == ["for-b"]
        assert await pending(eng, "f", "Box[a]") == []


async def test_e5_only_the_execute_after_a_wait_for_gets_a_wait_result(db_url: str) -> None:
    """E5: `ctx.wait_result` is what the WaitFor's wait consumed, handed to the Execute after it;
    the WaitFor itself and the Execute of a Step without a WaitFor see None. Catches: a wait result
    made up for methods that waited for nothing."""
    seen: list[tuple[str, str, bool | None]] = []

    def record(ctx: Context) -> None:
        # The execution ID keeps the WaitFor from running early, in Plain's commit, without an attempt.
        seen.append((ctx.step_execution_id, ctx.method, None if ctx.wait_result is None else ctx.wait_result.skipped))

    async def plain(ctx: Context, _: None) -> StepDecision:
        record(ctx)
        return StepDecision.go_to("Waiting", None)

    async def waiting_wait(ctx: Context, _: None) -> Wait:
        record(ctx)
        return Wait.skip_immediately()

    async def waiting(ctx: Context, _: None) -> StepDecision:
        record(ctx)
        return StepDecision.graceful_complete()

    flow = Flow("Results", [
        Step("Plain", plain, input_type=type(None)),
        Step("Waiting", waiting, input_type=type(None), wait_for=waiting_wait),
    ], start_step="Plain")
    async with engine_for(db_url, Registry([flow])) as eng:
        await eng.client.start_flow("Results", "f")
        assert (await eng.client.wait_for_flow("f", 10)).status == "completed"
    assert seen == [("Plain-1", "execute", None), ("Waiting-1", "wait_for", None), ("Waiting-1", "execute", True)]


async def test_e5_waiting_steps_hold_no_worker(db_url: str) -> None:
    """E5: with max_concurrent_tasks=1, three flows waiting on a channel do not stop another flow from
    running. Catches: a wait implemented as a handler (or slot) parked on the worker.
    """
    seen: list[dict[str, Any]] = []
    parked = make_flow("Parked", [waiter_step("Park", lambda: Wait.until(Inbox.for_one()), seen)], "Park")

    async def run(ctx: Context, _: None) -> StepDecision:
        return StepDecision.graceful_complete("done")

    quick = make_flow("Quick", [Step("Run", run)], "Run")
    async with engine_for(db_url, Registry([parked, quick]), worker=False) as eng:
        await eng.start_worker(max_concurrent_tasks=1)
        for i in range(3):
            await eng.client.start_flow("Parked", f"p{i}")
        for i in range(3):
            await wait_state(eng, f"p{i}", "Park-1", "waiting")
        await eng.client.start_flow("Quick", "q")
        assert (await eng.client.wait_for_flow("q", 10)).status == "completed"
        for i in range(3):
            await eng.client.publish(f"p{i}", Inbox, f"wake {i}")
        await wait_until("every parked Step executed", seen_probe(seen, 3))


# E6 Timers --------------------------------------------------------------------------------------


def nap_flow(fired: list[bool]) -> Flow:
    """Nap waits for a timer of input['seconds']; with input['fail_first'] its first WaitFor fails, so
    the wait registers about 0.5 s after the Step was scheduled."""

    async def wait_for(ctx: Context, inp: dict[str, Any]) -> Wait:
        if inp.get("fail_first") and ctx.attempt == 1:
            raise RuntimeError("first WaitFor attempt fails")
        return Wait.until(Timer.by_duration(inp["seconds"]))

    async def execute(ctx: Context, _: dict[str, Any]) -> StepDecision:
        assert ctx.wait_result is not None
        fired.append(ctx.wait_result.timer_fired)
        return StepDecision.graceful_complete()

    opts = StepOptions(wait_for_retry=RetryPolicy(max_attempts=2, initial_interval_seconds=0.5))
    return make_flow("Nap", [Step("Nap", execute, wait_for=wait_for, input_type=dict[str, Any], options=opts)], "Nap")


async def timer_span(eng: Engine, flow_id: str) -> tuple[int, int]:
    """(wait registered, wait completed) times of Nap-1 from the flow history."""
    (registered,) = await history(eng, flow_id, "wait_registered", "Nap-1")
    (completed,) = await history(eng, flow_id, "wait_completed", "Nap-1")
    return registered.at_ms, completed.at_ms


async def test_e6_zero_timer_fires_at_once(db_url: str) -> None:
    """E6: Timer.by_duration(0) fires at registration. Catches: a zero timer rounded up to a second,
    treated as 'no timer' (never fires) or refused.
    """
    fired: list[bool] = []
    async with engine_for(db_url, Registry([nap_flow(fired)])) as eng:
        await eng.client.start_flow("Nap", "f", {"seconds": 0})
        assert (await eng.client.wait_for_flow("f", 10)).status == "completed"
        assert fired == [True]
        registered, completed = await timer_span(eng, "f")
        assert completed - registered < 1000, "a zero timer waited a whole second"


async def test_e6_one_second_timer_counts_from_wait_registration(db_url: str) -> None:
    """E6: a 1 s timer fires no earlier than 1 s after its wait registered, even though the Step was
    scheduled about 0.5 s before that (its first WaitFor failed). Catches: seconds read as a smaller
    unit, fractional rounding down, or the timer counted from the Step's scheduling.
    """
    fired: list[bool] = []
    async with engine_for(db_url, Registry([nap_flow(fired)])) as eng:
        await eng.client.start_flow("Nap", "f", {"seconds": 1, "fail_first": True})
        assert (await eng.client.wait_for_flow("f", 15)).status == "completed"
        assert fired == [True]
        registered, completed = await timer_span(eng, "f")
        (scheduled,) = await history(eng, "f", "step_scheduled", "Nap-1")
        assert registered - scheduled.at_ms >= 500
        assert completed - registered >= 1000


async def test_e6_a_timer_the_worker_registers_fires_on_time_without_housekeeping(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """E6: a 1 s timer fires about 1 s after the worker registered it, with housekeeping (and
    PostgreSQL's fallback poll) a minute away. The registering commit is the worker's own, which
    does not wake it, and a worker no longer polls while an attempt runs, so its next due time must
    still come from that commit. Catches a worker that sleeps through its own timer until housekeeping.
    """
    if db_url.startswith("postgresql"):
        from dex_engine import _pg_store

        monkeypatch.setattr(_pg_store, "FALLBACK_POLL_SECONDS", 60.0)
    fired: list[bool] = []
    async with engine_for(db_url, Registry([nap_flow(fired)]), worker=False) as eng:
        await eng.start_worker(housekeeping_seconds=60.0, lease_ttl_seconds=120.0, lease_renew_seconds=50.0)
        for n in range(3):
            await eng.client.start_flow("Nap", f"f{n}", {"seconds": 1})
            assert (await eng.client.wait_for_flow(f"f{n}", 15)).status == "completed"
        assert fired == [True, True, True]


async def test_e6_skip_timer_fires_it_now(db_url: str) -> None:
    """E6: skip_timer fires an hour-long timer now; skip_timer on a Step execution that is not waiting
    raises StepNotWaitingError. Catches: skip_timer not re-evaluating the wait, or accepting any ID.
    """
    fired: list[bool] = []
    async with engine_for(db_url, Registry([nap_flow(fired)])) as eng:
        await eng.client.start_flow("Nap", "f", {"seconds": 3600})
        await wait_state(eng, "f", "Nap-1", "waiting")
        with pytest.raises(StepNotWaitingError):
            await eng.client.skip_timer("f", "Nap-2")
        await eng.client.skip_timer("f", "Nap-1")
        assert (await eng.client.wait_for_flow("f", 10)).status == "completed"
        assert fired == [True]


async def test_e6_timer_survives_worker_and_store_restart(db_url: str) -> None:
    """E6: a timer registered before the worker stops and the store closes fires after both reopen.
    With no worker running in between nothing can fire it early, so the reopened store still shows the
    Step waiting. Catches: timers held in worker memory (lost on restart) or not rescanned at startup.
    """
    fired: list[bool] = []
    registry = Registry([nap_flow(fired)])
    async with engine_for(db_url, registry) as eng:
        await eng.client.start_flow("Nap", "f", {"seconds": 2})
        await wait_state(eng, "f", "Nap-1", "waiting")
    async with engine_for(db_url, registry, worker=False) as eng:
        state = await step_state(eng, "f", "Nap-1")
        assert state == ("waiting", 1)
        await eng.start_worker()
        assert (await eng.client.wait_for_flow("f", 15)).status == "completed"
        assert fired == [True]
        registered, completed = await timer_span(eng, "f")
        assert completed - registered >= 2000


# E7 Locks ---------------------------------------------------------------------------------------


async def test_e7_step_lock_waits_for_holder_and_rpc_conflicts_at_once(db_url: str) -> None:
    """E7: while Holder holds Count, Other (locking Count and Note) is not started, a lock-free Step
    runs, an RPC locking Count fails at once with RpcLockConflictError and changes nothing, and an RPC
    locking only Note succeeds (Other takes its locks all at once, so it holds no Note while waiting).
    When Holder ends, its lock is released: Other runs and sees Holder's write (no lost update), and the
    RPC then succeeds. Catches: locks not enforced, RPCs that wait or half-commit on conflict, locks
    taken one by one, or locks not released at the method's end.
    """
    log: list[str] = []
    release = asyncio.Event()

    async def start(ctx: Context, _: None) -> StepDecision:
        return StepDecision.go_to_many(("Holder", None), ("Other", None), ("Free", None))

    async def holder(ctx: Context, _: None) -> StepDecision:
        log.append("holder-start")
        ctx.set(Count, (ctx.get(Count) or 0) + 1)
        await release.wait()
        log.append("holder-end")
        return StepDecision.dead_end()

    async def other(ctx: Context, _: None) -> StepDecision:
        log.append("other-start")
        ctx.set(Count, (ctx.get(Count) or 0) + 1)
        return StepDecision.dead_end()

    async def free(ctx: Context, _: None) -> StepDecision:
        log.append("free")
        return StepDecision.dead_end()

    flow = make_flow("E7Lock", [
        Step("Start", start),
        Step("Holder", holder, options=StepOptions(execute_locks=(Count,))),
        Step("Other", other, options=StepOptions(execute_locks=(Count, Note))),
        Step("Free", free),
    ], "Start")
    async with engine_for(db_url, Registry([flow])) as eng:
        await eng.client.start_flow("E7Lock", "f")

        async def holder_and_free_started() -> bool:
            return {"holder-start", "free"} <= set(log)

        await wait_until("Holder and Free started", holder_and_free_started)
        assert await step_state(eng, "f", "Other-1") == ("ready", 1)
        assert "other-start" not in log
        with pytest.raises(RpcLockConflictError) as conflict:
            await asyncio.wait_for(eng.client.rpc("f", "bump"), 10)
        assert conflict.value.lock == "Count"
        await eng.client.rpc("f", "touch_note")
        assert await eng.client.get_attribute("f", Note) == "touched"
        assert await eng.client.get_attribute("f", Count) is None
        assert await pending(eng, "f", "Inbox") == []

        release.set()
        await no_active_steps(eng, "f")
        assert log.index("holder-end") < log.index("other-start")
        assert await eng.client.get_attribute("f", Count) == 2
        await eng.client.rpc("f", "bump")
        assert await eng.client.get_attribute("f", Count) == 100
        assert await pending(eng, "f", "Inbox") == ["bumped"]


@rpc()
async def cancel_flaky(ctx: RpcContext, _: None) -> RPCResult[None]:
    return RPCResult(None, canceling_steps=("Flaky",))


@rpc(locks=[Count], load=LoadOptions.none())
async def bump_blind(ctx: RpcContext, _: None) -> None:
    """bump that loads nothing: its lock must still be checked, though it reads no snapshot."""
    ctx.set(Count, 100)
    ctx.publish(Inbox, "bumped")


Tags = AttributeMap("Tags", str)


@rpc(locks=[Tags["k"]])
async def write_tag_k(ctx: RpcContext, _: None) -> None:
    ctx.set(Tags["k"], "rpc")


@rpc(locks=[Tags["j"]])
async def write_tag_j(ctx: RpcContext, _: None) -> None:
    ctx.set(Tags["j"], "rpc")


@rpc(locks=[Tags])
async def write_tags(ctx: RpcContext, _: None) -> None:
    ctx.set(Tags["k"], "rpc whole")


async def test_e7_a_whole_maps_lock_and_its_instances_locks_exclude_each_other(db_url: str) -> None:
    """E7 for an AttributeMap: while a Step holds the whole map Tags, a Step locking Tags[k] is not
    started and an RPC locking Tags[k] fails; while a Step holds Tags[k], an RPC locking Tags fails,
    and one locking Tags[j] succeeds (instances are locked on their own). Catches: lock names
    compared as exact text, so a map's lock and its instances' locks never met."""
    log: list[str] = []
    released = {"all": asyncio.Event(), "k": asyncio.Event()}

    async def start(ctx: Context, _: None) -> StepDecision:
        return StepDecision.go_to_many(("HoldAll", "all"), ("HoldK", "k"))

    def started(name: str) -> Callable[[], Awaitable[bool]]:
        async def seen() -> bool:
            return f"{name}-start" in log
        return seen

    async def hold(ctx: Context, name: str) -> StepDecision:
        log.append(f"{name}-start")
        await released[name].wait()
        log.append(f"{name}-end")
        return StepDecision.dead_end()

    flow = Flow("E7Map", [
        Step("Start", start),
        Step("HoldAll", hold, input_type=str, options=StepOptions(execute_locks=(Tags,))),
        Step("HoldK", hold, input_type=str, options=StepOptions(execute_locks=(Tags["k"],))),
    ], start_step="Start", schema=[*SCHEMA, Tags], rpcs=[write_tag_k, write_tag_j, write_tags])
    async with engine_for(db_url, Registry([flow])) as eng:
        await eng.client.start_flow("E7Map", "f")
        await wait_until("HoldAll started", started("all"))
        with pytest.raises(RpcLockConflictError) as conflict:
            await eng.client.rpc("f", "write_tag_k")
        assert conflict.value.lock == "Tags"
        await asyncio.sleep(0.3)  # polls come and go: none may start HoldK
        assert "k-start" not in log and await step_state(eng, "f", "HoldK-1") == ("ready", 1)

        released["all"].set()
        await wait_until("HoldK started", started("k"))
        assert log.index("all-end") < log.index("k-start")
        with pytest.raises(RpcLockConflictError) as conflict:
            await eng.client.rpc("f", "write_tags")
        assert conflict.value.lock == "Tags[k]"
        await eng.client.rpc("f", "write_tag_j")
        released["k"].set()
        await no_active_steps(eng, "f")
        assert await eng.client.get_attribute("f", Tags["j"]) == "rpc"
        assert await eng.client.get_attribute("f", Tags["k"]) is None


async def test_e7_step_lock_is_held_between_retries(db_url: str) -> None:
    """E7: a Step whose first attempt failed keeps its lock while its retry is pending: an RPC locking the
    same attribute gets RpcLockConflictError between the attempts, also one that loads nothing;
    cancelling the Step releases it. Catches: locks released when an attempt fails (another writer
    could slip in between retries), and a locking RPC let through the no-read path.
    """

    async def flaky(ctx: Context, _: None) -> StepDecision:
        ctx.set(Count, 1)
        raise RuntimeError("first attempt fails")

    # A long retry interval keeps the Step deterministically between its attempts during the checks.
    opts = StepOptions(execute_locks=(Count,),
                       execute_retry=RetryPolicy(max_attempts=2, initial_interval_seconds=60.0))
    flow = make_flow("E7Retry", [Step("Flaky", flaky, options=opts)], "Flaky", rpcs=[cancel_flaky, bump_blind])
    async with engine_for(db_url, Registry([flow])) as eng:
        await eng.client.start_flow("E7Retry", "f")
        await wait_until("attempt 1 failed", lambda: history(eng, "f", "attempt_failed", "Flaky-1"))
        assert await step_state(eng, "f", "Flaky-1") == ("ready", 2)
        for locking in ("bump", "bump_blind"):
            with pytest.raises(RpcLockConflictError):
                await asyncio.wait_for(eng.client.rpc("f", locking), 10)
        assert await eng.client.get_attribute("f", Count) is None
        assert await pending(eng, "f", "Inbox") == []
        await eng.client.rpc("f", "cancel_flaky")
        assert await step_state(eng, "f", "Flaky-1") is None
        await eng.client.rpc("f", "bump")
        assert await eng.client.get_attribute("f", Count) == 100


# E8 RPCs ----------------------------------------------------------------------------------------


@rpc(request_type=int)
async def restart(ctx: RpcContext, n: int) -> RPCResult[str]:
    return RPCResult("restarted", next_steps=(Movement("Take", n),), canceling_steps=("Idle",))


def e8_flow(seen: list[dict[str, Any]]) -> Flow:
    async def take_wait(ctx: Context, n: int) -> Wait:
        return Wait.until(Inbox.for_n(n))

    async def take(ctx: Context, n: int) -> StepDecision:
        assert ctx.wait_result is not None
        seen.append({"messages": ctx.wait_result.messages(Inbox)})
        return StepDecision.dead_end()

    return make_flow("E8", [idle_step(), Step("Take", take, wait_for=take_wait, input_type=int)], "Idle",
                     rpcs=[restart])


async def test_e8_rpc_reads_pending_with_ids_deletes_by_id_starts_and_cancels_steps(db_url: str) -> None:
    """E8: an RPC sees pending messages with the IDs publish returned, deletes one by ID (the rest keep
    FIFO order), and its RPCResult starts a Step and cancels another Step type in one commit.
    Catches: wrong or reordered message IDs, delete_message removing the wrong message, next_steps or
    canceling_steps ignored.
    """
    seen: list[dict[str, Any]] = []
    async with engine_for(db_url, Registry([e8_flow(seen)])) as eng:
        await eng.client.start_flow("E8", "f")
        await wait_state(eng, "f", "Idle-1", "waiting")
        ids = [await eng.client.publish("f", Inbox, m) for m in ("m1", "m2", "m3")]
        assert (await eng.client.rpc("f", "peek", ["Inbox"]))["Inbox"] == list(zip(ids, ["m1", "m2", "m3"],
                                                                                      strict=True))
        await eng.client.rpc("f", "drop", ids[1])
        assert (await eng.client.rpc("f", "peek", ["Inbox"]))["Inbox"] == [(ids[0], "m1"), (ids[2], "m3")]
        assert await eng.client.rpc("f", "restart", 2) == "restarted"
        await wait_until("Take executed", seen_probe(seen))
        assert seen[0]["messages"] == ["m1", "m3"]
        assert await step_state(eng, "f", "Idle-1") is None
        assert [h.step_execution_id for h in await history(eng, "f", "step_cancelled")] == ["Idle-1"]
        assert await pending(eng, "f", "Inbox") == []


@rpc()
async def note_and_inbox(ctx: RpcContext, _: None) -> tuple[str | None, list[str]]:
    """Reads only: Note and the pending Inbox messages."""
    return ctx.get(Note), [m.value for m in ctx.pending(Inbox)]


@rpc()
async def take_into_note(ctx: RpcContext, _: None) -> None:
    """Takes the oldest Inbox message into Note, as a Step's wait and Execute would."""
    first = ctx.pending(Inbox)[0]
    ctx.delete_message(Inbox, first.message_id)
    ctx.set(Note, first.value)


async def test_e8_an_rpc_that_only_reads_sees_the_flow_before_or_after_a_commit_never_half(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """E8: an RPC runs in one transaction, so a commit that lands while it reads is seen whole or
    not at all. Here another process takes the pending message into Note after the RPC read the
    messages and before it read the attributes. Catches: on PostgreSQL each statement saw the
    commits made before it (READ COMMITTED), so an RPC that writes nothing (which no version check
    at commit guards) saw the message both pending and in Note: an agent session's snapshot listed
    steered messages still pending after the turn that stored them ended.
    """
    flow = make_flow("E8r", [idle_step()], "Idle", rpcs=[note_and_inbox, take_into_note])
    registry = Registry([flow])

    async def take() -> None:
        store = open_store(db_url)
        try:
            await AsyncClient(registry, store=store).rpc("f", "take_into_note")
        finally:
            await store.close()

    real_load = transitions.load_attributes
    landed: list[bool] = []

    def load_after_a_commit(db: Any, flow_id: str, spec: Any) -> Any:
        if not landed:  # the first read only; the other process's RPC reads through here too
            landed.append(True)
            other = threading.Thread(target=lambda: asyncio.run(take()))  # its own store and loop
            other.start()
            other.join()
        return real_load(db, flow_id, spec)

    async with engine_for(db_url, Registry([flow]), worker=False) as eng:
        await eng.client.start_flow("E8r", "f")
        await eng.client.publish("f", Inbox, "m1")
        monkeypatch.setattr(transitions, "load_attributes", load_after_a_commit)
        seen = await eng.client.rpc("f", "note_and_inbox")
        assert landed
        assert list(seen) in ([None, ["m1"]], ["m1", []])  # before the commit, or after it
        assert list(await eng.client.rpc("f", "note_and_inbox")) == ["m1", []]


Pages = AttributeMap("Pages", str)


@rpc(load=LoadOptions.none())
async def write_generation(ctx: RpcContext, generation: int) -> None:
    """Count names the generation; Pages["a"] and Pages["b"] hold it too."""
    ctx.set(Count, generation)
    ctx.set(Pages["a"], f"a{generation}")
    ctx.set(Pages["b"], f"b{generation}")


@rpc(load=LoadOptions.only(Count))
async def read_generation(ctx: RpcContext, _: None) -> list[Any]:
    """Reads Count from its snapshot, then loads the Pages instances it names (as a page of a long
    map would be read), once and again (the second loads nothing new)."""
    count = ctx.get(Count)
    await ctx.load(Pages["a"], Pages["b"])
    await ctx.load(Pages["a"])
    return [count, ctx.get(Pages["a"]), ctx.get(Pages["b"]), ctx.keys(Pages)]


async def test_e8_what_an_rpc_loads_later_is_of_the_state_its_snapshot_read(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """E8: RpcContext.load adds map instances to an RPC's snapshot of the same state. Here another
    process writes a new generation after the RPC read Count and before it loads Pages: the load
    finds the flow changed and the RPC runs again on a new snapshot, so it returns generation 2
    whole. Catches: a load that read the latest rows alone, which returned Count 1 with Pages of
    generation 2."""
    flow = Flow("E8load", [idle_step()], start_step="Idle", schema=[*SCHEMA, Pages],
                rpcs=[write_generation, read_generation])
    registry = Registry([flow])

    async def write_second() -> None:
        store = open_store(db_url)
        try:
            await AsyncClient(registry, store=store).rpc("f", "write_generation", 2)
        finally:
            await store.close()

    real_load = transitions.rpc_load
    loads: list[Any] = []

    def load_after_a_commit(db: Any, flow_id: str, version: int, spec: Any, started_ms: int | None) -> Any:
        if not loads:  # the first load only
            other = threading.Thread(target=lambda: asyncio.run(write_second()))  # its own store and loop
            other.start()
            other.join()
        loads.append(spec)
        return real_load(db, flow_id, version, spec, started_ms)

    async with engine_for(db_url, registry, worker=False) as eng:
        await eng.client.start_flow("E8load", "f")
        await eng.client.rpc("f", "write_generation", 1)
        assert await eng.client.rpc("f", "read_generation") == [1, "a1", "b1", ["a", "b"]]
        monkeypatch.setattr(transitions, "rpc_load", load_after_a_commit)
        assert await eng.client.rpc("f", "read_generation") == [2, "a2", "b2", ["a", "b"]]
        # One load per run (the second ctx.load found both loaded); the first run's found the change.
        assert [sorted(spec.instances) for spec in loads] == [[("Pages", "a"), ("Pages", "b")]] * 2


async def test_e8_deleting_a_message_that_is_gone_fails_the_whole_rpc(db_url: str) -> None:
    """E8: an RPC deleting a message someone else already removed (another RPC, or a Step's wait) fails
    with ChannelMessageNotFoundError and commits nothing: not its attribute write, its publish, nor its
    deletion of a message that was still there. Catches: deletes of missing messages ignored, or the
    RPC's other changes committed anyway.
    """
    seen: list[dict[str, Any]] = []
    async with engine_for(db_url, Registry([e8_flow(seen)])) as eng:
        await eng.client.start_flow("E8", "f")
        await wait_state(eng, "f", "Idle-1", "waiting")
        id1 = await eng.client.publish("f", Inbox, "m1")
        id2 = await eng.client.publish("f", Inbox, "m2")
        await eng.client.rpc("f", "drop", id2)  # someone else deletes m2
        with pytest.raises(ChannelMessageNotFoundError) as gone:
            await eng.client.rpc("f", "drop_all", [id1, id2])
        assert gone.value.message_id == id2
        assert await eng.client.get_attribute("f", Note) is None
        assert (await eng.client.rpc("f", "peek", ["Inbox"]))["Inbox"] == [(id1, "m1")]

        # A Step's wait consumes m1; deleting it afterwards fails the same way.
        await eng.client.rpc("f", "restart", 1)
        await wait_until("Take executed", seen_probe(seen))
        assert seen[0]["messages"] == ["m1"]
        with pytest.raises(ChannelMessageNotFoundError):
            await eng.client.rpc("f", "drop", id1)
        assert (await eng.client.describe_flow("f")).status == "running"


@rpc(request_type=Any)
async def drop_given(ctx: RpcContext, message_id: Any) -> None:
    """Deletes whatever ID the caller sent, as a handler that trusts its request would."""
    ctx.delete_message(Inbox, message_id)


async def test_e8_a_message_id_no_message_can_have_deletes_nothing_the_same_on_both_backends(db_url: str) -> None:
    """E8: delete_message with an ID outside 64 bits fails the RPC with ChannelMessageNotFoundError
    naming it, and one that is not a whole number with InvalidValueError naming it; the queued
    message stays. Catches: SQLite raising OverflowError for 2**63 where PostgreSQL finds nothing,
    True deleting message 1 on SQLite and "1" deleting it on PostgreSQL.
    """
    flow = make_flow("E8Ids", [idle_step()], "Idle", rpcs=[drop_given])
    async with engine_for(db_url, Registry([flow])) as eng:
        await eng.client.start_flow("E8Ids", "f")
        await wait_state(eng, "f", "Idle-1", "waiting")
        mid = await eng.client.publish("f", Inbox, "m1")
        assert mid == 1  # the IDs a bool or a numeric text would alias
        for too_large in (2**63, -(2**63) - 1, 10**30):
            with pytest.raises(ChannelMessageNotFoundError) as gone:
                await eng.client.rpc("f", "drop_given", too_large)
            assert str(too_large) in str(gone.value)
        for not_a_number in (True, "1", 1.0, [1], None):
            with pytest.raises(InvalidValueError, match="message_id must be a whole number") as bad:
                await eng.client.rpc("f", "drop_given", not_a_number)
            assert repr(not_a_number) in str(bad.value)
        assert (await eng.client.rpc("f", "peek", ["Inbox"]))["Inbox"] == [(mid, "m1")]


async def test_e8_concurrent_rpcs_on_one_flow_are_serialized(db_url: str) -> None:
    """E8: 20 concurrent read-increment-write RPCs on one flow leave Count at 20, each having seen a
    distinct value. Catches: RPCs committing on a stale read (lost updates).
    """
    async with engine_for(db_url, Registry([e8_flow([])])) as eng:
        await eng.client.start_flow("E8", "f")
        results = await asyncio.gather(*(eng.client.rpc("f", "incr") for _ in range(20)))
        assert sorted(results) == list(range(1, 21))
        assert await eng.client.get_attribute("f", Count) == 20
