"""PostgreSQL's batched Execute commit (dex_commit_execute) against the reference, _transitions.

Each scenario runs twice on one database: once through `Store.commit_execute` (the generic
transitions) on flows of type G, once through `PostgresStore.commit_execute` (one
dex_commit_execute call per batch, then the stream events of the commits it accepted) on flows
of type F. Both must leave the same rows (tasks, history, flows, counters,
attributes, locks, streams and their events, queued channel messages; IDs and clock times
normalized) and hand out the same attempts, so any departure of the batched path from the Python
transitions fails here.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import pytest

from dex_engine import Channel, FlowConfig, LoadOptions, StepDurability, StepOptions, Store, Wait, open_store
from dex_engine import _pg_store as pg
from dex_engine import _transitions as tx
from dex_engine._errors import FlowNotActiveError, StaleAttemptError
from dex_engine._limits import HISTORY_TRIM_CHECK_EVERY, MAX_HISTORY_EVENTS_PER_FLOW
from dex_engine._options import LoadSpec, TaskOptions, resolve_task_options
from dex_engine._records import DecisionRecord, Lease, MovementRecord, StartRequest, WriteSet
from dex_engine._store import now_ms

Commit = Callable[[Lease, WriteSet, DecisionRecord, "tuple[str, list[str], int] | None"], Awaitable[list[Lease]]]


def _options(**kwargs: Any) -> TaskOptions:
    return resolve_task_options(StepOptions(**kwargs), False, None)


NOOP = _options(load=LoadOptions.none())
LOAD_ALL = _options()
LOAD_ONLY = msgspec.structs.replace(
    LOAD_ALL, execute=msgspec.structs.replace(
        LOAD_ALL.execute, load=LoadSpec("only", names=("x", "gone"), instances=(("m", "k1"), ("m", "absent")))),
)
LOCKED = msgspec.structs.replace(NOOP, execute=msgspec.structs.replace(NOOP.execute, locks=("L",)))
TIMED = _options(load=LoadOptions.none(), execute_timeout_seconds=30, heartbeat_timeout_seconds=5)
# A heartbeat timeout longer than its method timeout: the first heartbeat deadline is the method's.
TIMED_SHORT = _options(load=LoadOptions.none(), execute_timeout_seconds=5, heartbeat_timeout_seconds=30)
PINNED_SYNC = _options(load=LoadOptions.none(), durability=StepDurability.SYNC)
WAITING = resolve_task_options(StepOptions(load=LoadOptions.none()), True, None)  # a WaitFor, then an Execute
INBOX: Channel[str] = Channel("Inbox", str)


def _go(*moves: tuple[str, TaskOptions]) -> DecisionRecord:
    return DecisionRecord("movements", tuple(MovementRecord(step, b'"in"', opts) for step, opts in moves))


DEAD_END = DecisionRecord("dead_end")


class Run:
    """One scenario's run on flows of one type, committing through one path."""

    def __init__(self, store: Store, flow_type: str, commit: Commit) -> None:
        self.store, self.flow_type, self.commit = store, flow_type, commit
        self.outcomes: list[object] = []

    def fid(self, name: str) -> str:
        return f"{self.flow_type}-{name}"

    async def start(self, name: str, options: TaskOptions = NOOP, config: FlowConfig | None = None) -> None:
        start = MovementRecord("A", b"0", options)
        request = StartRequest(self.fid(name), self.flow_type, b"null", config or FlowConfig(), start)
        await self.store.start_flow(request)

    async def claim(self, capacity: int = 1) -> list[Lease]:
        return await self.store.claim("w", [self.flow_type], capacity)

    async def run(self, lease: Lease, decision: DecisionRecord, writes: WriteSet | None = None,
                  capacity: int | None = 1) -> list[Lease]:
        claim = None if capacity is None else ("w", [self.flow_type], capacity)
        try:
            leases = await self.commit(lease, writes or WriteSet(), decision, claim)
        except (StaleAttemptError, FlowNotActiveError) as exc:
            self.outcomes.append(type(exc).__name__)
            return []
        self.outcomes.append([_lease_shape(x) for x in leases])
        return leases


def _lease_shape(lease: Lease) -> tuple[Any, ...]:
    return (lease.step_type, lease.step_execution_id, lease.method, lease.attempt, lease.lease_epoch, lease.input,
            lease.options, lease.load, sorted(lease.attributes.items()), lease.durable)


async def _rows(store: Store, flow_type: str) -> dict[str, Any]:
    """Every row of `flow_type`'s flows, with IDs and clock times made comparable."""
    def read(db: Any) -> dict[str, Any]:
        prefix = f"{flow_type}-"
        tasks = db.all(
            "SELECT t.task_id, t.flow_id, t.step_type, t.step_execution_id, t.input, t.options, t.method, t.state, "
            "t.attempt, t.attempt_started, t.any_started, t.lease_owner, t.lease_epoch, t.claimed_at IS NULL, "
            "t.method_first_at - t.claimed_at, t.deadline_at - t.claimed_at, t.method_deadline_at - t.claimed_at, "
            "t.snapshot, "
            "t.locks_held, t.recovery_error, t.created_at - t.run_at FROM tasks t WHERE t.flow_type = ? "
            "ORDER BY t.flow_id, t.task_id", (flow_type,))
        ids = {int(r[0]): n for n, r in enumerate(tasks)}
        snap = msgspec.json.Decoder(list[tuple[str, str, msgspec.Raw]])
        def of_type(table: str, columns: str, order: str) -> list[tuple[Any, ...]]:
            """`columns` (the flow ID first, unprefixed) of `table`'s rows for flows of this type."""
            rows = db.all(f"SELECT x.flow_id, {columns} FROM {table} x JOIN flows f ON f.flow_id = x.flow_id "
                          f"WHERE f.flow_type = ? ORDER BY x.flow_id, {order}", (flow_type,))
            return [(r[0].removeprefix(prefix), *r[1:]) for r in rows]

        return {
            "tasks": [(r[1].removeprefix(prefix), *r[2:17],
                       None if r[17] is None else sorted((n, k, bytes(v)) for n, k, v in snap.decode(bytes(r[17]))),
                       *r[18:]) for r in tasks],
            "history": of_type("history", "x.seq, x.step_type, x.step_execution_id, x.event_type, x.attempt, x.detail",
                               "x.seq"),
            "flows": [(r[0].removeprefix(prefix), *r[1:]) for r in db.all(
                "SELECT flow_id, status, version, completing, completion_output, history_seq, output, error, "
                "closed_at IS NULL FROM flows WHERE flow_type = ? ORDER BY flow_id", (flow_type,))],
            "counters": of_type("step_counters", "x.step_type, x.n", "x.step_type"),
            "attributes": of_type("attributes", "x.name, x.key, x.value", "x.name, x.key"),
            "locks": [(flow, name, ids.get(int(task))) for flow, name, task in
                      of_type("locks", "x.lock_name, x.task_id", "x.lock_name")],
            "streams": of_type("streams", "x.stream, x.next_seq, x.first_seq, x.total_bytes", "x.stream"),
            "messages": of_type("channel_messages", "x.channel, x.key, x.value", "x.message_id"),
            "stream_events": of_type("stream_events", "x.stream, x.seq, x.step_execution_id, x.attempt, x.value",
                                     "x.stream, x.seq"),
        }

    result: dict[str, Any] = await store.raw(read)
    return result


# Scenarios: each drives one Run through setup, commits and claims.

async def chain_handoff(r: Run) -> None:
    """go_to with a free slot: the next Step goes to the committing worker, already claimed."""
    await r.start("c")
    [lease] = await r.claim()
    [nxt] = await r.run(lease, _go(("B", NOOP)))
    [nxt] = await r.run(nxt, _go(("B", TIMED)))
    [nxt] = await r.run(nxt, _go(("A", PINNED_SYNC)))
    # Left running, so that their deadlines (from their timeouts) are compared.
    await r.run(nxt, _go(("B", TIMED), ("B", TIMED_SHORT)), capacity=2)


async def writes_and_loads(r: Run) -> None:
    """Attribute writes and deletes land before the next Step's snapshot is taken (all, only)."""
    await r.start("w")
    [lease] = await r.claim()
    seed = WriteSet(attributes={("x", ""): b"1", ("y", ""): b'"gone"', ("m", "k1"): b'{"b":1,"a":2}',
                                ("m", "k2"): b"[1]", ("quote\"d", "k\\ey"): b'"\\u00e9"'})
    [nxt] = await r.run(lease, _go(("B", LOAD_ALL)), seed)
    change = WriteSet(attributes={("x", ""): b"2", ("y", ""): None, ("absent", ""): None})
    [nxt] = await r.run(nxt, _go(("C", LOAD_ONLY)), change)
    await r.run(nxt, _go(("D", LOAD_ALL)), WriteSet(attributes={("x", ""): b"3"}), capacity=None)


async def fan_out(r: Run) -> None:
    """More movements than free slots, and one with a lock: the rest are inserted ready."""
    await r.start("f")
    [lease] = await r.claim()
    leases = await r.run(lease, _go(("B", NOOP), ("B", NOOP), ("C", LOCKED), ("B", NOOP)), capacity=2)
    for held in leases:
        await r.run(held, DEAD_END)  # each claims one of the ready Steps into its freed slot
    for held in await r.claim(10):
        await r.run(held, DEAD_END, capacity=None)


async def method_locks(r: Run) -> None:
    """A Step holding a method lock releases it with its commit."""
    await r.start("l", LOCKED)
    [lease] = await r.claim()
    await r.run(lease, _go(("B", NOOP)))


async def graceful(r: Run) -> None:
    """graceful_complete closes the flow once no Step is left, with its output."""
    await r.start("g")
    [lease] = await r.claim()
    await r.run(lease, DecisionRecord("graceful_complete", output=b'"done"'))
    await r.start("h")
    [lease] = await r.claim()
    [a, b] = await r.run(lease, _go(("B", NOOP), ("C", NOOP)), capacity=2)
    await r.run(a, DecisionRecord("graceful_complete", output=b'"later"'), capacity=None)  # C is still running
    await r.run(b, DEAD_END, capacity=None)  # the last Step leaves: the flow closes


async def async_default(r: Run) -> None:
    """A movement without durability takes the flow config's default at this moment (E16)."""
    await r.start("a", config=FlowConfig(default_step_durability=StepDurability.ASYNC))
    [lease] = await r.claim()
    await r.run(lease, _go(("B", NOOP), ("C", PINNED_SYNC), ("D", NOOP)), capacity=2)


def _appends(*values: str, stream: str = "events", capacity: int = 1 << 20) -> list[tuple[str, int, bytes]]:
    return [(stream, capacity, f'"{v}"'.encode()) for v in values]


async def stream_appends(r: Run) -> None:
    """Events appended by Executes: a new stream, two streams in one commit, a stream whose
    capacity trims the oldest events (E11), and an append with nothing else to write."""
    await r.start("e")
    [lease] = await r.claim()
    [nxt] = await r.run(lease, _go(("B", NOOP)), WriteSet(appends=_appends("one", "two")))
    both = [*_appends("three"), *_appends("x", "y", stream="other"), *_appends("four")]
    [nxt] = await r.run(nxt, _go(("B", NOOP)), WriteSet(attributes={("x", ""): b"1"}, appends=both))
    small = 12  # bytes: a few short events at most, so each append trims the oldest
    [nxt] = await r.run(nxt, _go(("B", NOOP)), WriteSet(appends=_appends("aaaa", "bbbb", stream="small",
                                                                          capacity=small)))
    [nxt] = await r.run(nxt, _go(("B", NOOP)), WriteSet(appends=_appends("cc", "dddddddddddddd", stream="small",
                                                                          capacity=small)))
    await r.run(nxt, DEAD_END, WriteSet(appends=_appends("last")))


async def appends_without_a_claim(r: Run) -> None:
    """An Execute appending events whose commit claims nothing (its worker is stopping), then one
    that claims."""
    await r.start("e")
    [lease] = await r.claim()
    await r.run(lease, _go(("B", NOOP)), WriteSet(appends=_appends("one")), capacity=None)
    [nxt] = await r.claim()
    await r.run(nxt, DEAD_END, WriteSet(appends=_appends("two")))


def _publishes(*values: str, channel: str = "Inbox", key: str = "") -> list[tuple[str, str, bytes]]:
    return [(channel, key, f'"{v}"'.encode()) for v in values]


async def publishes(r: Run) -> None:
    """Messages published by Executes (which the store commits through the transitions, between
    batched commits): one satisfies a waiting Step of the flow (the message is consumed, the Step
    made ready), the second stays queued, a later one finds nothing waiting; a publish to a flow
    with no waiting Step."""
    await r.start("p")
    [lease] = await r.claim()
    movers = {x.step_type: x for x in await r.run(lease, _go(("W", WAITING), ("P", NOOP)), capacity=2)}
    await r.store.commit_wait_for(movers["W"], WriteSet(), Wait.until(INBOX.for_one()).spec())
    [nxt] = await r.run(movers["P"], _go(("B", NOOP)),
                        WriteSet(publishes=_publishes("one", "two"), appends=_appends("sent")))
    [woken] = await r.claim()  # W, made ready by the first message
    await r.run(woken, DEAD_END, capacity=None)
    await r.run(nxt, DEAD_END, WriteSet(publishes=_publishes("three")), capacity=None)
    await r.start("q")
    [lease] = await r.claim()
    await r.run(lease, _go(("B", NOOP)), WriteSet(publishes=_publishes("x", channel="Other", key="k")))


async def rejected(r: Run) -> None:
    """A stale attempt and one of a closed flow change nothing, append no event, and raise."""
    await r.start("s")
    [lease] = await r.claim()
    await r.run(_with_epoch(lease, lease.lease_epoch + 1), _go(("B", NOOP)),
                WriteSet(attributes={("x", ""): b"1"}, appends=_appends("stale")))
    await r.store.raw(lambda db: db.run("UPDATE flows SET status = 'failed' WHERE flow_id = ?", (r.fid("s"),)),
                      write=True)
    await r.run(lease, _go(("B", NOOP)), WriteSet(attributes={("x", ""): b"1"}, appends=_appends("closed")))


async def history_trim(r: Run) -> None:
    """Crossing a multiple of HISTORY_TRIM_CHECK_EVERY trims events beyond the flow's bound."""
    await r.start("t")
    before = HISTORY_TRIM_CHECK_EVERY * (MAX_HISTORY_EVENTS_PER_FLOW // HISTORY_TRIM_CHECK_EVERY + 2) - 1

    def seed(db: Any) -> None:
        db.run("UPDATE flows SET history_seq = ? WHERE flow_id = ?", (before, r.fid("t")))
        for seq in (3, before - MAX_HISTORY_EVENTS_PER_FLOW + 5):
            db.run("INSERT INTO history (flow_id, seq, step_type, step_execution_id, event_type, attempt, at, detail) "
                   "VALUES (?, ?, '', '', 'old', 0, 0, '')", (r.fid("t"), seq))

    await r.store.raw(seed, write=True)
    [lease] = await r.claim()
    await r.run(lease, _go(("B", NOOP)))


def _with_epoch(lease: Lease, epoch: int) -> Lease:
    return dataclasses.replace(lease, lease_epoch=epoch)


SCENARIOS = [chain_handoff, writes_and_loads, fan_out, method_locks, graceful, async_default, stream_appends,
             publishes, rejected, history_trim]


# dex_commit_execute sends a lone commit to dex_commit_execute_each; the scenarios, which commit
# one Execute per call, also run through dex_commit_execute_sets, which it uses for larger batches.
FUNCTIONS = ["dex_commit_execute_each", "dex_commit_execute_sets"]


@pytest.mark.parametrize("function", FUNCTIONS)
@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.__name__ for s in SCENARIOS])
async def test_batched_commit_leaves_what_the_transitions_leave(
    pg_database: str, scenario: Callable[[Run], Awaitable[None]], function: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Same rows and same handed-out attempts through either server function as through _transitions."""
    monkeypatch.setattr(pg, "_COMMIT_EXECUTE", pg._COMMIT_EXECUTE.replace("dex_commit_execute(", f"{function}("))
    store = open_store(pg_database)
    calls: list[int] = []
    real = pg._commit_executes

    def counted(db: Any, commits: list[Any]) -> list[Any]:
        calls.append(len(commits))
        return real(db, commits)

    monkeypatch.setattr(pg, "_commit_executes", counted)
    try:
        await _same_as_the_reference(store, scenario, lambda: not calls, lambda: bool(calls))
    finally:
        await store.close()


async def _same_as_the_reference(
    store: Store, scenario: Callable[[Run], Awaitable[None]],
    reference_ran: Callable[[], bool] = lambda: True, batched_ran: Callable[[], bool] = lambda: True,
) -> None:
    """Run `scenario` through _transitions (type G) and then through the store (type F); both must
    raise the same errors, hand out the same attempts and leave the same rows. `reference_ran` and
    `batched_ran` check, after each run, that it took the path it was meant to."""
    generic = Run(store, "G", lambda *a: Store.commit_execute(store, *a))
    await scenario(generic)
    assert reference_ran(), "the reference run must not take the batched path"
    batched = Run(store, "F", store.commit_execute)
    await scenario(batched)
    assert batched_ran(), "the batched run did not take the path it was meant to"
    assert batched.outcomes == generic.outcomes
    got, want = await _rows(store, "F"), await _rows(store, "G")
    for table in want:
        assert got[table] == want[table], table


async def test_one_call_commits_a_batch_and_rejects_only_the_stale_commit(pg_database: str) -> None:
    """Three Executes in one dex_commit_execute call: the stale one raises and writes nothing, the
    two others commit and hand over their next Steps, in one transaction."""
    store = open_store(pg_database)
    try:
        r = Run(store, "F", store.commit_execute)
        for name in ("a", "b", "c"):
            await r.start(name)
        leases = sorted(await r.claim(3), key=lambda x: x.flow_id)
        stale = _with_epoch(leases[1], leases[1].lease_epoch + 1)
        commits = [pg._ExecuteCommit(lease, WriteSet(attributes={("x", ""): b"1"}), _go(("B", NOOP)),
                                     ("w", ["F"], 1)) for lease in (leases[0], stale, leases[2])]
        results = await store.raw(lambda db: pg._commit_executes(db, commits), write=True)
        assert [len(x) for x in (results[0], results[2])] == [1, 1]
        assert isinstance(results[1], pg._Rejected) and isinstance(results[1].error, StaleAttemptError)
        for name, written in (("a", True), ("b", False), ("c", True)):
            assert (await store.read_attribute(r.fid(name), "x", "")) == (b"1" if written else None)
            events = [h.event_type for h in await store.history(r.fid(name))]
            assert ("execute_completed" in events) is written, (name, events)
    finally:
        await store.close()


async def _one_batch(r: Run) -> None:
    """Several Executes of several shapes, one per flow, committed together; then two Executes of
    one flow together (that batch takes dex_commit_execute_each: the second must not leak into the
    first's next-Step snapshot)."""
    await r.start("a")
    await r.start("b")
    await r.start("c")
    await r.start("d", config=FlowConfig(default_step_durability=StepDurability.ASYNC))
    await r.start("e")
    await r.start("f", LOCKED)
    await r.start("g")
    leases = {x.flow_id: x for x in await r.claim(10)}
    # g's Step leaves a second one running, so that its graceful completion does not close it yet.
    [g2] = await r.run(leases[r.fid("g")], _go(("B", NOOP)))
    batch = [
        (leases[r.fid("a")], _go(("B", LOAD_ALL)),
         WriteSet(attributes={("x", ""): b"1", ("m", "k"): b"[2]"}, appends=_appends("a1", "a2")), 1),
        (leases[r.fid("b")], _go(("B", NOOP), ("B", NOOP), ("C", LOCKED), ("B", NOOP)), WriteSet(), 2),
        (leases[r.fid("c")], DecisionRecord("graceful_complete", output=b'"out"'), WriteSet(), 1),
        (leases[r.fid("d")], _go(("B", NOOP), ("C", PINNED_SYNC)), WriteSet(), None),
        (_with_epoch(leases[r.fid("e")], 9), _go(("B", NOOP)),
         WriteSet(attributes={("x", ""): b"1"}, appends=_appends("stale")), 1),
        (leases[r.fid("f")], DEAD_END, WriteSet(attributes={("gone", ""): None}), 1),
        (g2, DecisionRecord("graceful_complete", output=b'"g"'), WriteSet(appends=_appends("g")), 1),
    ]
    await r.batch(batch)
    await r.start("p")
    [lease] = await r.claim()
    first, second = await r.run(lease, _go(("B", NOOP), ("C", NOOP)), capacity=2)
    await r.batch([(first, _go(("D", LOAD_ALL)), WriteSet(attributes={("x", ""): b"1"}, appends=_appends("p1")), 1),
                   (second, _go(("E", NOOP)), WriteSet(attributes={("y", ""): b"2"}, appends=_appends("p2")), 1)])


async def test_a_batch_of_many_shapes_leaves_what_one_commit_at_a_time_leaves(pg_database: str) -> None:
    """Executes of many shapes (writes and a loaded handoff, fan-out past the free slots with a
    locked Step, graceful completion that closes and one that does not, ASYNC by config, a stale
    attempt, a dead end releasing its lock) in one dex_commit_execute call leave the rows, and
    hand out the attempts, that committing them one at a time through _transitions does; so do
    two Executes of one flow in one call (which dex_commit_execute gives to dex_commit_execute_each).
    Catches set-based statements that mix up operations."""
    store = open_store(pg_database)
    try:
        async def one_at_a_time(r: Run, batch: list[Any]) -> None:
            for lease, decision, writes, capacity in sorted(batch, key=lambda b: b[0].flow_id):
                await r.run(lease, decision, writes, capacity)

        async def together(r: Run, batch: list[Any]) -> None:
            ordered = sorted(batch, key=lambda b: b[0].flow_id)
            commits = [pg._ExecuteCommit(lease, writes, decision, None if capacity is None else ("w", ["F"], capacity))
                       for lease, decision, writes, capacity in ordered]

            def commit(db: Any) -> list[Any]:
                results = pg._commit_executes(db, commits)
                # As the store's batch transaction does: a commit that handed nothing over claims ready work.
                return [tx.claim(db, "w", ["F"], c.claim[2], now_ms()) if c.claim and result == [] else result
                        for c, result in zip(commits, results, strict=True)]

            for result in await store.raw(commit, write=True):
                r.outcomes.append(type(result.error).__name__ if isinstance(result, pg._Rejected)
                                  else [_lease_shape(x) for x in result])

        generic = Run(store, "G", lambda *a: Store.commit_execute(store, *a))
        generic.batch = lambda batch: one_at_a_time(generic, batch)  # type: ignore[attr-defined]
        await _one_batch(generic)
        batched = Run(store, "F", store.commit_execute)
        batched.batch = lambda batch: together(batched, batch)  # type: ignore[attr-defined]
        await _one_batch(batched)
        assert batched.outcomes == generic.outcomes
        assert "StaleAttemptError" in batched.outcomes
        got, want = await _rows(store, "F"), await _rows(store, "G")
        for table in want:
            assert got[table] == want[table], table
    finally:
        await store.close()


@pytest.mark.parametrize("scenario", [stream_appends, appends_without_a_claim], ids=lambda s: s.__name__)
async def test_a_call_the_server_refuses_reruns_the_batch_through_the_transitions(
    pg_database: str, scenario: Callable[[Run], Awaitable[None]], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The server refusing the dex_commit_execute call itself (a DataError, as a fault in the
    function would raise) rolls its transaction back and runs the batch's commits again through
    _transitions, one by one: they commit once, leaving what the reference run leaves. Catches: a
    lane that lost the rerun's results (and so its thread, with every operation queued to it)."""
    import psycopg

    store = open_store(pg_database)
    real = pg._commit_executes
    refused: list[int] = []

    def refuses_once(db: Any, commits: list[Any]) -> list[Any]:
        if not refused:
            refused.append(len(commits))
            raise psycopg.errors.DataError("the server refused the batched call")
        return real(db, commits)

    monkeypatch.setattr(pg, "_commit_executes", refuses_once)
    try:
        # Bounded: with the lane's thread gone, its operations would wait for ever.
        await asyncio.wait_for(_same_as_the_reference(store, scenario, batched_ran=lambda: len(refused) == 1), 60)
    finally:
        await store.close()


@pytest.mark.parametrize("scenario", [stream_appends, appends_without_a_claim], ids=lambda s: s.__name__)
async def test_an_error_after_the_call_reruns_the_batch_through_the_transitions(
    pg_database: str, scenario: Callable[[Run], Awaitable[None]], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Python error while writing the accepted commits' messages and events (after the
    dex_commit_execute call, in its transaction) rolls the call back and runs the commits again
    through _transitions: they commit once, leaving what the reference run leaves, and a rerun
    commit that claims nothing returns no attempts (not None)."""
    store = open_store(pg_database)
    real = tx.append_writes
    failures: list[str] = []

    def fails_once(db: Any, flow_id: str, *args: Any) -> None:
        if flow_id.startswith("F-") and not failures:
            failures.append(flow_id)
            raise RuntimeError("an append that cannot be written in the batched path")
        real(db, flow_id, *args)

    monkeypatch.setattr(tx, "append_writes", fails_once)
    try:
        await _same_as_the_reference(store, scenario, batched_ran=lambda: failures == ["F-e"])
    finally:
        await store.close()
