"""AgentSessionClient retries RpcLockConflictError (seed 003's RPC table) for resolve_interrupt,
answer_question and cancel_turn: a conflict that clears is retried until the call commits, and one
that persists raises once RPC_LOCK_CONFLICT_RETRY has passed.

The locks these RPCs take are held only while a short Step's Execute runs, too briefly for a test
to call an RPC inside it. So each test writes the row the engine writes when it hands that Step its
Execute (a `locks` row naming the waiting Step's task) into the real SQLite file, and the engine's own
lock check raises the conflict; deleting the row is that Step's commit releasing the lock. The
Worker runs in this process, on the same Store.
"""

from __future__ import annotations

import asyncio
import json
import types
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from agents.tests.scripted_agent import INVOCATIONS, build_flow
from engine.tests.conftest import db_url, pg_database, pg_databases  # noqa: F401 - the fixtures used here

import dex_agents._client as client_module
import dex_agents._rpcs as rpcs_module
from dex_agents import PENDING_INTERRUPTS, AgentSessionClient, AgentSessionFlow, AgentSnapshot, BuiltInTool
from dex_agents._client import lock_retry_interval, refused_check_due
from dex_agents._constants import (
    RPC_LOCK_CONFLICT_FIRST_RETRY_INTERVAL,
    RPC_LOCK_CONFLICT_LONGEST_RETRY_INTERVAL,
    RPC_LOCK_CONFLICT_REFUSED_CHECK_AFTER,
    RPC_LOCK_CONFLICT_RETRY,
)
from dex_agents.testing import InvocationLog, wait_for_agent_snapshot
from dex_engine import (
    AsyncClient,
    AsyncWorker,
    DexError,
    Registry,
    RpcLockConflictError,
    Store,
    WorkerOptions,
    open_store,
)

SESSION = "s"


@dataclass(frozen=True)
class HeldLock:
    """A `locks` row, as the engine writes it for a Step whose Execute is running."""

    store: Store
    flow_id: str
    lock: str
    task_id: int
    step_execution_id: str

    async def release(self) -> None:
        def delete(db: Any) -> None:
            db.run("DELETE FROM locks WHERE flow_id = ? AND lock_name = ? AND task_id = ?",
                   (self.flow_id, self.lock, self.task_id))

        await self.store.raw(delete, write=True)


async def hold_lock(store: Store, flow_id: str, lock: str, step_type: str) -> HeldLock:
    """Take `lock` of the flow for its one waiting `step_type` Step, as its Execute's claim would."""

    def insert(db: Any) -> tuple[int, str]:
        rows = db.all("SELECT task_id, step_execution_id FROM tasks WHERE flow_id = ? AND step_type = ?",
                      (flow_id, step_type))
        assert len(rows) == 1, f"expected one {step_type} task, found {rows!r}"
        task_id, step_execution_id = int(rows[0][0]), str(rows[0][1])
        db.run("INSERT INTO locks (flow_id, lock_name, task_id) VALUES (?, ?, ?)", (flow_id, lock, task_id))
        return task_id, step_execution_id

    task_id, step_execution_id = await store.raw(insert, write=True)
    return HeldLock(store, flow_id, lock, task_id, step_execution_id)


class CountingClient(AsyncClient):
    """The engine's AsyncClient, counting the RPCs it sends; after `release_after` lock conflicts it
    releases `held`, as the Step holding the lock would by committing."""

    def __init__(self, registry: Registry, store: Store) -> None:
        super().__init__(registry, store=store)
        self.sent: list[str] = []
        self.conflicts = 0
        self.held: HeldLock | None = None
        self.release_after: int | None = None

    async def rpc(self, flow_id: str, name: str, request: Any = None) -> Any:
        self.sent.append(name)
        try:
            return await super().rpc(flow_id, name, request)
        except RpcLockConflictError:
            self.conflicts += 1
            if self.held is not None and self.conflicts == self.release_after:
                await self.held.release()
                self.held = None
            raise


@dataclass
class Engine:
    flow: AgentSessionFlow
    client: CountingClient
    log: InvocationLog

    @property
    def sessions(self) -> AgentSessionClient:
        return AgentSessionClient(self.client, self.flow)


@asynccontextmanager
async def in_process(
    tmp_path: Path, database_url: str | None = None, interrupt_deadline: timedelta | None = None,
    built_in_tools: frozenset[BuiltInTool] | None = None,
) -> AsyncIterator[Engine]:
    """The scripted Flow on `database_url` (None: a SQLite file in tmp_path); the Worker shares the
    client's Store, so it hears each commit at once."""
    flow = build_flow(tmp_path, interrupt_deadline=interrupt_deadline, built_in_tools=built_in_tools)
    url = database_url or f"sqlite:///{tmp_path / 'dex.db'}"
    store = open_store(url)
    options = WorkerOptions(database_url=url, lease_ttl_seconds=2.0, lease_renew_seconds=0.4,
                            housekeeping_seconds=0.1, poll_seconds=0.01, shutdown_grace_seconds=5.0)
    worker = AsyncWorker(Registry([flow]), options, store=store)
    await worker.__aenter__()
    try:
        yield Engine(flow, CountingClient(Registry([flow]), store), InvocationLog(tmp_path / INVOCATIONS))
    finally:
        await worker.stop()
        await store.close()


@dataclass(frozen=True)
class LockingRpc:
    """One RPC that takes PendingInterrupts, called while the turn waits for a person."""

    name: str
    tools: list[dict[str, Any]]  # the turn's one tool call, which makes it wait
    interrupt_id: str
    holder: str  # the Step type whose Execute takes PendingInterrupts next
    call: Callable[[AgentSessionClient], Awaitable[bool]]
    ending_event: str
    answer: str | None  # the turn's final answer, when it completes
    tool_runs: int  # completed runs of the tool


LOCKING_RPCS = [
    LockingRpc("resolve_interrupt", [{"id": "w1", "name": "write_x"}], "w1", "AwaitToolApproval",
               lambda sessions: sessions.resolve_interrupt(SESSION, "w1", approved=True),
               "turn_completed", "w1=write_x done", 1),
    LockingRpc("answer_question", [{"id": "c1", "name": "read_x", "args": {"ask": "Which order?"}}], "c1-input-1",
               "AwaitQuestionAnswer", lambda sessions: sessions.answer_question(SESSION, "c1-input-1", "A-1"),
               "turn_completed", "c1=read_x done", 1),
    # cancel_turn locks TurnCancellationRequest too; PendingInterrupts alone is enough to conflict.
    LockingRpc("cancel_turn", [{"id": "w1", "name": "write_x"}], "w1", "AwaitToolApproval",
               lambda sessions: sessions.cancel_turn(SESSION),
               "turn_cancelled", None, 0),
]
IDS = [rpc.name for rpc in LOCKING_RPCS]


async def waiting_turn(engine: Engine, rpc: LockingRpc) -> AgentSnapshot:
    """Start a session whose first turn waits on `rpc.interrupt_id`; return that snapshot."""
    script = json.dumps({"steps": [{"tools": rpc.tools}, {"answer": "{results}"}]})
    await engine.sessions.start_session(SESSION, script)
    snapshot: AgentSnapshot = await wait_for_agent_snapshot(
        engine.sessions, SESSION,
        lambda s: s if [i.interrupt_id for i in s.pending_interrupts] == [rpc.interrupt_id] else None,
        description=f"interrupt {rpc.interrupt_id}")
    return snapshot


async def assert_turn_ended(engine: Engine, rpc: LockingRpc) -> None:
    """The call took effect: the turn ended as the RPC makes it end."""
    snapshot = await wait_for_agent_snapshot(
        engine.sessions, SESSION, lambda s: s if s.state is not None and s.state.turn_count == 1 else None,
        description="turn-1 to end")
    read = await engine.sessions.read_agent_events(SESSION)
    endings = [e.value.type for e in read.events if e.value.type in ("turn_completed", "turn_cancelled", "turn_failed")]
    assert endings == [rpc.ending_event]
    if rpc.answer is not None:
        assert snapshot.messages[-1].text == rpc.answer
    assert engine.log.count("tool_end") == rpc.tool_runs


def sent_locking(client: CountingClient) -> list[str]:
    """The RPCs sent but the lock-free snapshot resolve_interrupt and answer_question read once their
    conflicts have lasted RPC_LOCK_CONFLICT_REFUSED_CHECK_AFTER."""
    return [name for name in client.sent if name != "get_agent_snapshot"]


@pytest.mark.parametrize("rpc", LOCKING_RPCS, ids=IDS)
async def test_a_lock_conflict_that_clears_is_retried_and_the_call_commits(tmp_path: Path, rpc: LockingRpc) -> None:
    """Two conflicts, then the lock is released: the third try commits, the call returns True, and
    the turn goes on as that RPC makes it."""
    async with in_process(tmp_path) as engine:
        await waiting_turn(engine, rpc)
        held = await hold_lock(engine.client.store, SESSION, PENDING_INTERRUPTS.label, rpc.holder)
        engine.client.held, engine.client.release_after = held, 2
        engine.client.sent.clear()
        assert await rpc.call(engine.sessions) is True
        assert sent_locking(engine.client) == [rpc.name] * 3
        assert engine.client.conflicts == 2
        await assert_turn_ended(engine, rpc)


class SteppedClock:
    """The clock and sleep of _retry_lock_conflicts, moved only by its sleeps, in whole milliseconds:
    the retry window is then counted in sleeps, whatever the speed of this machine."""

    def __init__(self) -> None:
        self.now_ms = 0

    # Far from zero, as a real monotonic clock is: a time left at 0 rather than read shows.
    START_MS = 7_000_000

    def monotonic(self) -> float:
        return (self.START_MS + self.now_ms) / 1000

    async def sleep(self, seconds: float) -> None:
        self.now_ms += round(seconds * 1000)
        await asyncio.sleep(0)  # still yield, as the real sleep does


def intervals_ms(count: int) -> list[int]:
    """The first `count` waits between tries at a lock one holder keeps: 1 ms, then each doubled, up
    to the longest."""
    out, interval = [], RPC_LOCK_CONFLICT_FIRST_RETRY_INTERVAL // timedelta(milliseconds=1)
    for _ in range(count):
        out.append(interval)
        interval = min(2 * interval, RPC_LOCK_CONFLICT_LONGEST_RETRY_INTERVAL // timedelta(milliseconds=1))
    return out


def retry_times_ms(until_ms: int) -> list[int]:
    """The SteppedClock times of the tries after a first conflict at 0 with one holder, up to the first
    at or past `until_ms`."""
    times = [0]
    for interval in intervals_ms(until_ms + 1):
        if times[-1] >= until_ms:
            break
        times.append(times[-1] + interval)
    return times


# Conflicts a call meets with one holder before it reads the lock-free snapshot (at the last of them),
# and the SteppedClock time then.
CHECK_AT_MS = retry_times_ms(RPC_LOCK_CONFLICT_REFUSED_CHECK_AFTER // timedelta(milliseconds=1))[-1]
CONFLICTS_TO_CHECK = len(retry_times_ms(CHECK_AT_MS))


def test_the_retry_interval_starts_at_1_ms_and_doubles_up_to_20_ms() -> None:
    """A short Step frees the lock within milliseconds: a first retry after 20 ms made each approval of
    a wide fan-out take 24 ms on SQLite (100 in 2.4 s, 0.4 s now). The refused check waits as long."""
    assert [round(lock_retry_interval(n) * 1000, 6) for n in range(8)] == [1, 2, 4, 8, 16, 20, 20, 20]
    assert lock_retry_interval(10_000) == 0.02  # no overflow however many tries
    assert retry_times_ms(40) == [0, 1, 3, 7, 15, 31, 51]
    assert intervals_ms(7) == [1, 2, 4, 8, 16, 20, 20]
    assert (CHECK_AT_MS, CONFLICTS_TO_CHECK) == (31, 6)
    assert not refused_check_due(0.0) and not refused_check_due(0.0199)
    assert refused_check_due(0.02) and refused_check_due(5.0)


@pytest.mark.parametrize("rpc", LOCKING_RPCS, ids=IDS)
async def test_a_lock_conflict_that_persists_raises_after_the_retry_window(
    tmp_path: Path, rpc: LockingRpc, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lock held for good: the client tries again after 1 ms, then twice as long each time up to
    20 ms, until RPC_LOCK_CONFLICT_RETRY has passed, then raises the engine's RpcLockConflictError, naming the
    lock and the Step holding it. Nothing changed (the snapshot is the one before the call), and the
    call succeeds once the lock is released."""
    clock = SteppedClock()
    # Only _client's names: the event loop, the Worker and the Store keep the real clock.
    monkeypatch.setattr(client_module, "time", types.SimpleNamespace(monotonic=clock.monotonic))
    monkeypatch.setattr(client_module, "asyncio", types.SimpleNamespace(sleep=clock.sleep))
    async with in_process(tmp_path) as engine:
        waiting = await waiting_turn(engine, rpc)
        held = await hold_lock(engine.client.store, SESSION, PENDING_INTERRUPTS.label, rpc.holder)
        engine.client.sent.clear()
        with pytest.raises(RpcLockConflictError) as conflict:
            await rpc.call(engine.sessions)
        assert (conflict.value.lock, conflict.value.holder) == (held.lock, f"Step {held.step_execution_id}")
        window_ms = RPC_LOCK_CONFLICT_RETRY // timedelta(milliseconds=1)
        assert window_ms == 5_000  # seed 003: the client "retries it for 5 seconds"
        tries = retry_times_ms(window_ms)
        assert clock.now_ms == tries[-1] >= window_ms > tries[-2]  # the last try was the first at the deadline
        assert sent_locking(engine.client) == [rpc.name] * len(tries)
        # resolve_interrupt and answer_question read the lock-free snapshot once, 20 ms in; cancel_turn never.
        assert engine.client.sent.count("get_agent_snapshot") == (rpc.name != "cancel_turn")

        assert await engine.sessions.get_agent_snapshot(SESSION) == waiting
        await held.release()
        assert await rpc.call(engine.sessions) is True
        await assert_turn_ended(engine, rpc)


async def hold_lock_of(store: Store, flow_id: str, lock: str, step_execution_id: str) -> HeldLock:
    """Take `lock` of the flow for the Step `step_execution_id`, as its Execute's claim would."""

    def insert(db: Any) -> int:
        rows = db.all("SELECT task_id FROM tasks WHERE flow_id = ? AND step_execution_id = ?",
                      (flow_id, step_execution_id))
        assert len(rows) == 1, f"expected one task of {step_execution_id}, found {rows!r}"
        db.run("INSERT INTO locks (flow_id, lock_name, task_id) VALUES (?, ?, ?)", (flow_id, lock, int(rows[0][0])))
        return int(rows[0][0])

    return HeldLock(store, flow_id, lock, await store.raw(insert, write=True), step_execution_id)


class TrainClient(CountingClient):
    """Hands the lock from Step to Step, as approvals of a wide fan-out wake one AwaitToolApproval
    after another: each of `train` holds it for `conflicts_each` conflicts, then commits (releases)."""

    def __init__(self, registry: Registry, store: Store) -> None:
        super().__init__(registry, store)
        self.train: list[str] = []
        self.conflicts_each = 0

    def start_train(self, first: HeldLock, rest: list[str], conflicts_each: int) -> None:
        self.held, self.train, self.conflicts_each = first, rest, conflicts_each

    async def rpc(self, flow_id: str, name: str, request: Any = None) -> Any:
        try:
            return await super().rpc(flow_id, name, request)
        except RpcLockConflictError:
            if self.conflicts_each and self.conflicts % self.conflicts_each == 0:
                assert self.held is not None
                await self.held.release()
                self.held = None
                if self.train:
                    self.held = await hold_lock_of(self.store, flow_id, PENDING_INTERRUPTS.label, self.train.pop(0))
            raise


async def test_a_lock_handed_from_step_to_step_for_longer_than_the_retry_window_is_retried_until_free(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Approving a wide fan-out wakes its AwaitToolApproval Steps one after another, each holding
    PendingInterrupts briefly, for longer in all than RPC_LOCK_CONFLICT_RETRY (a hundred approvals
    on PostgreSQL). Each new holder is progress: the client keeps retrying, and the approval commits
    once the train has passed. Catches: resolve_interrupt raising RpcLockConflictError ("held by Step
    AwaitToolApproval-...") 5 s after its first conflict, though no Step held the lock for long."""
    clock = SteppedClock()
    monkeypatch.setattr(client_module, "time", types.SimpleNamespace(monotonic=clock.monotonic))
    monkeypatch.setattr(client_module, "asyncio", types.SimpleNamespace(sleep=clock.sleep))
    async with in_process(tmp_path) as engine:
        engine.client = TrainClient(Registry([engine.flow]), engine.client.store)
        script = json.dumps({"steps": [{"tools": [{"id": f"w{i}", "name": "write_x"} for i in range(1, 5)]},
                                       {"answer": "{results}"}]})
        await engine.sessions.start_session(SESSION, script)
        await wait_for_agent_snapshot(engine.sessions, SESSION, lambda s: s if len(s.pending_interrupts) == 4 else None,
                                      description="four approvals")
        steps = await engine.client.store.raw(lambda db: [str(r[0]) for r in db.all(
            "SELECT step_execution_id FROM tasks WHERE flow_id = ? AND step_type = 'AwaitToolApproval'"
            " ORDER BY task_id", (SESSION,))])
        assert len(steps) == 4
        # The other three calls' Steps hold the lock in turn, each for 4 s of the client's clock.
        first = await hold_lock_of(engine.client.store, SESSION, PENDING_INTERRUPTS.label, steps[1])
        engine.client.start_train(first, steps[2:], 200)
        engine.client.sent.clear()
        assert await engine.sessions.resolve_interrupt(SESSION, "w1", approved=True) is True
        assert engine.client.conflicts == 600 and engine.client.held is None
        # Each new holder is tried again after 1 ms, as the first was, not at the interval reached.
        assert clock.now_ms == 3 * sum(intervals_ms(200))
        # The lock-free snapshot is read once, not again for each new holder: in a wide fan-out every
        # pending resolve would read a whole snapshot per Step of the train.
        assert engine.client.sent.count("get_agent_snapshot") == 1
        assert clock.now_ms > RPC_LOCK_CONFLICT_RETRY // timedelta(milliseconds=1)
        for call in ("w2", "w3", "w4"):
            assert await engine.sessions.resolve_interrupt(SESSION, call, approved=True) is True
        snapshot = await wait_for_agent_snapshot(
            engine.sessions, SESSION, lambda s: s if s.state is not None and s.state.turn_count == 1 else None,
            description="turn-1 to end")
        assert snapshot.messages[-1].text == "; ".join(f"w{i}=write_x done" for i in range(1, 5))
        assert engine.log.count("tool_end") == 4


async def test_a_resolve_that_can_only_return_false_answers_while_a_step_holds_the_lock(
    tmp_path: Path, db_url: str, monkeypatch: pytest.MonkeyPatch  # noqa: F811 - the fixture
) -> None:
    """A resolve of an interrupt already resolved, or of one never raised, returns False while a Step
    holds PendingInterrupts, without waiting for it: a lock-free snapshot read once the conflicts
    have lasted 20 ms shows nothing it could change. A pending interrupt still waits for the lock
    and commits.
    Catches: such a resolve waiting out a fan-out's whole train of lock holders (seconds), here one
    holder that never lets go (RpcLockConflictError after the retry window)."""
    clock = SteppedClock()  # without the check, the retry window passes in sleeps, not seconds
    monkeypatch.setattr(client_module, "time", types.SimpleNamespace(monotonic=clock.monotonic))
    monkeypatch.setattr(client_module, "asyncio", types.SimpleNamespace(sleep=clock.sleep))
    async with in_process(tmp_path, db_url) as engine:
        script = json.dumps({"steps": [{"tools": [{"id": "w1", "name": "write_x"}, {"id": "w2", "name": "write_x"}]},
                                       {"answer": "{results}"}]})
        await engine.sessions.start_session(SESSION, script)
        await wait_for_agent_snapshot(engine.sessions, SESSION, lambda s: s if len(s.pending_interrupts) == 2 else None,
                                      description="two approvals")
        assert await engine.sessions.resolve_interrupt(SESSION, "w1", approved=True) is True
        await wait_for_agent_snapshot(
            engine.sessions, SESSION,
            lambda s: s if [r.status for r in s.tool_calls if r.tool_call_id == "w1"] == ["succeeded"] else None,
            description="w1 to run")
        held = await hold_lock(engine.client.store, SESSION, PENDING_INTERRUPTS.label, "AwaitToolApproval")
        engine.client.sent.clear()
        for interrupt_id, approved in (("w1", True), ("w1", False), ("w9", True)):
            assert await engine.sessions.resolve_interrupt(SESSION, interrupt_id, approved) is False
        # Each answered 31 ms in, the lock still held: none waited for the holder.
        assert engine.client.sent == (["resolve_interrupt"] * CONFLICTS_TO_CHECK + ["get_agent_snapshot"]) * 3
        assert engine.client.conflicts == 3 * CONFLICTS_TO_CHECK and clock.now_ms == 3 * CHECK_AT_MS
        # w2 is pending: the snapshot proves nothing, so the call retries until the holder commits.
        engine.client.held, engine.client.release_after = held, engine.client.conflicts + 2
        assert await engine.sessions.resolve_interrupt(SESSION, "w2", approved=True) is True
        assert engine.client.held is None
        snapshot = await wait_for_agent_snapshot(
            engine.sessions, SESSION, lambda s: s if s.state is not None and s.state.turn_count == 1 else None,
            description="turn-1 to end")
        assert snapshot.messages[-1].text == "w1=write_x done; w2=write_x done"


@pytest.mark.parametrize("rpc", LOCKING_RPCS[:2], ids=IDS[:2])
async def test_a_resolve_past_the_deadline_answers_false_while_a_step_holds_the_lock(
    tmp_path: Path, db_url: str, rpc: LockingRpc, monkeypatch: pytest.MonkeyPatch  # noqa: F811 - the fixture
) -> None:
    """An interrupt still in PendingInterrupts but past its deadline (its Step has not recorded it
    yet) is judged by the lock-free check as the locked RPC (resolve_interrupt or answer_question)
    judges it: False once the conflicts have lasted 20 ms, and False from the RPC once the lock is free. The clock
    of both, not the Worker's, is moved past the deadline, so the Worker's Timer does not remove the
    interrupt first."""
    clock = SteppedClock()
    monkeypatch.setattr(client_module, "time", types.SimpleNamespace(monotonic=clock.monotonic))
    monkeypatch.setattr(client_module, "asyncio", types.SimpleNamespace(sleep=clock.sleep))
    async with in_process(tmp_path, db_url, interrupt_deadline=timedelta(hours=1)) as engine:
        await waiting_turn(engine, rpc)
        later = datetime.now(UTC) + timedelta(hours=2)
        monkeypatch.setattr(client_module, "now_utc", lambda: later)
        monkeypatch.setattr(rpcs_module, "now_utc", lambda: later)
        held = await hold_lock(engine.client.store, SESSION, PENDING_INTERRUPTS.label, rpc.holder)
        engine.client.sent.clear()
        assert await rpc.call(engine.sessions) is False
        assert engine.client.sent == [rpc.name] * CONFLICTS_TO_CHECK + ["get_agent_snapshot"]
        assert clock.now_ms == CHECK_AT_MS
        await held.release()
        assert await rpc.call(engine.sessions) is False
        snapshot = await engine.sessions.get_agent_snapshot(SESSION)
        assert [i.interrupt_id for i in snapshot.pending_interrupts] == [rpc.interrupt_id]  # nothing changed


async def test_an_answer_that_can_only_return_false_answers_while_a_step_holds_the_lock(
    tmp_path: Path, db_url: str, monkeypatch: pytest.MonkeyPatch  # noqa: F811 - the fixture
) -> None:
    """An answer_question that can only return False (the question already answered, or never
    raised, the interrupt an approval, the answer blank or not one of the question's choices)
    returns it while a Step holds PendingInterrupts, read from a lock-free snapshot once the
    conflicts have lasted 20 ms. An answer the question takes still waits for the lock, through a second holder
    without reading the snapshot again, and commits. Catches: such an answer waiting out a fan-out's
    whole train of lock holders, here one that never lets go (RpcLockConflictError after the retry
    window)."""
    clock = SteppedClock()  # without the check, the retry window passes in sleeps, not seconds
    monkeypatch.setattr(client_module, "time", types.SimpleNamespace(monotonic=clock.monotonic))
    monkeypatch.setattr(client_module, "asyncio", types.SimpleNamespace(sleep=clock.sleep))
    async with in_process(tmp_path, db_url, built_in_tools=frozenset({BuiltInTool.ASK_USER})) as engine:
        engine.client = TrainClient(Registry([engine.flow]), engine.client.store)
        pick = {"question": "Colour?", "choices": ["red", "blue"], "allows_free_text": False}
        script = json.dumps({"steps": [{"tools": [
            {"id": "w1", "name": "write_x"},
            {"id": "q1", "name": "ask_user", "args": pick},
            {"id": "q2", "name": "ask_user", "args": {"question": "Why?"}},
        ]}, {"answer": "{results}"}]})
        await engine.sessions.start_session(SESSION, script)
        await wait_for_agent_snapshot(engine.sessions, SESSION, lambda s: s if len(s.pending_interrupts) == 3 else None,
                                      description="an approval and two questions")
        assert await engine.sessions.answer_question(SESSION, "q2", "because") is True
        await wait_for_agent_snapshot(
            engine.sessions, SESSION,
            lambda s: s if [r.status for r in s.tool_calls if r.tool_call_id == "q2"] == ["succeeded"] else None,
            description="q2 to be answered")
        held = await hold_lock(engine.client.store, SESSION, PENDING_INTERRUPTS.label, "AwaitToolApproval")
        engine.client.sent.clear()
        refused = (("q2", "again"), ("q9", "red"), ("w1", "yes"), ("q1", "  "), ("q1", "green"))
        for interrupt_id, answer in refused:
            assert await engine.sessions.answer_question(SESSION, interrupt_id, answer) is False, interrupt_id
        # Each answered 31 ms in, the lock still held: none waited for the holder.
        assert engine.client.sent == (["answer_question"] * CONFLICTS_TO_CHECK + ["get_agent_snapshot"]) * len(refused)
        assert engine.client.conflicts == len(refused) * CONFLICTS_TO_CHECK
        assert clock.now_ms == len(refused) * CHECK_AT_MS
        # q1 takes "blue": the lock passes to another Step, then is free, and the call commits.
        waits = await engine.client.store.raw(lambda db: [str(r[0]) for r in db.all(
            "SELECT step_execution_id FROM tasks WHERE flow_id = ? AND step_type = 'AwaitQuestionAnswer'",
            (SESSION,))])
        assert len(waits) == 1, waits  # q1's; q2's Step has committed
        engine.client.sent.clear()
        engine.client.conflicts = 0
        # Each holder past the check: the snapshot read under the first, not again under the second.
        engine.client.start_train(held, waits, CONFLICTS_TO_CHECK + 1)
        assert await engine.sessions.answer_question(SESSION, "q1", "blue") is True
        assert engine.client.held is None and engine.client.conflicts == 2 * (CONFLICTS_TO_CHECK + 1)
        assert engine.client.sent.count("get_agent_snapshot") == 1
        assert await engine.sessions.resolve_interrupt(SESSION, "w1", approved=True) is True
        snapshot = await wait_for_agent_snapshot(
            engine.sessions, SESSION, lambda s: s if s.state is not None and s.state.turn_count == 1 else None,
            description="turn-1 to end")
        assert "blue" in (snapshot.messages[-1].text or "")


class SnapshotFailingClient(CountingClient):
    """Its get_agent_snapshot RPC fails, as a read the engine refuses would."""

    async def rpc(self, flow_id: str, name: str, request: Any = None) -> Any:
        if name == "get_agent_snapshot" and self.held is not None:
            self.sent.append(name)
            raise DexError("the snapshot cannot be read now")
        return await super().rpc(flow_id, name, request)


async def test_a_lock_free_check_that_cannot_read_the_snapshot_waits_for_the_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once its conflicts have lasted 20 ms resolve_interrupt reads a lock-free snapshot; when that read
    fails, nothing says the call is refused, so the call waits for the lock and commits. Catches: a
    failed read taken as "refused", the approval dropped with False."""
    clock = SteppedClock()
    monkeypatch.setattr(client_module, "time", types.SimpleNamespace(monotonic=clock.monotonic))
    monkeypatch.setattr(client_module, "asyncio", types.SimpleNamespace(sleep=clock.sleep))
    async with in_process(tmp_path) as engine:
        rpc = LOCKING_RPCS[0]
        await waiting_turn(engine, rpc)
        engine.client = SnapshotFailingClient(Registry([engine.flow]), engine.client.store)
        held = await hold_lock(engine.client.store, SESSION, PENDING_INTERRUPTS.label, rpc.holder)
        engine.client.held, engine.client.release_after = held, CONFLICTS_TO_CHECK + 1
        assert await rpc.call(engine.sessions) is True
        assert engine.client.sent == (["resolve_interrupt"] * CONFLICTS_TO_CHECK + ["get_agent_snapshot"]
                                      + ["resolve_interrupt"] * 2)
        await assert_turn_ended(engine, rpc)

