"""Client edges an audit found: search queries whose names hold AND, unknown statuses, and many
concurrent RPCs on one flow from one client."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from typing import Any

import pytest

from dex_engine import (
    AsyncClient,
    Attribute,
    AttributeMap,
    Channel,
    Context,
    Flow,
    FlowNotActiveError,
    FlowNotActiveOrNotFoundError,
    FlowNotFoundError,
    InvalidValueError,
    LoadOptions,
    Registry,
    RpcContentionError,
    RpcContext,
    RpcLockConflictError,
    SearchQueryError,
    Step,
    StepDecision,
    Wait,
    rpc,
)
from dex_engine import _client as client_module
from dex_engine._limits import MAX_RPC_TRIES

from .conftest import engine_for, wait_until

Inbox = Channel("Inbox", int)


async def wait_for_inbox(ctx: Context, _input: Any) -> Wait:
    return Wait.until(Inbox.for_one())


async def complete(ctx: Context, _input: Any) -> StepDecision:
    return StepDecision.graceful_complete(None)


async def to_review(ctx: Context, _input: Any) -> StepDecision:
    return StepDecision.go_to("Review-AND-Approve", None)


# Flow and Step types are IDs, and an ID may hold "AND" (any letters and punctuation but '/').
REVIEW = Flow(
    "Plan-AND-Do",
    [Step("Start", to_review), Step("Review-AND-Approve", complete, wait_for=wait_for_inbox)],
    start_step="Start",
    schema=[Inbox],
)
SEARCH_REGISTRY = Registry([REVIEW])


async def test_search_finds_names_that_hold_and(db_url: str) -> None:
    """A quoted Flow or Step type holding AND is one value. Catches: the query split on every AND
    before its terms were read, so `ActiveStepTypes = "Review-AND-Approve"` raised SearchQueryError
    (cannot parse 'ActiveStepTypes = "Review-') and such a Step could never be searched."""
    async with engine_for(db_url, SEARCH_REGISTRY) as eng:
        c = eng.client
        await c.start_flow("Plan-AND-Do", "p")
        found = await wait_until("the review Step waiting",
                                 lambda: c.search_flows('ActiveStepTypes = "Review-AND-Approve"'))
        assert found == ["p"]
        both = 'FlowType = "Plan-AND-Do" AND ActiveStepTypes = "Review-AND-Approve" AND FlowStatus = "running"'
        assert await c.search_flows(both) == ["p"]
        assert await c.search_flows('FlowType="Plan-AND-Do"AND FlowStatus="running"') == ["p"]
        for glued in ('FlowType = "Plan-AND-Do" ANDFlowStatus = "running"',
                      'FlowType = "Plan-AND-Do" FlowStatus = "running"'):
            with pytest.raises(SearchQueryError, match="cannot parse"):
                await c.search_flows(glued)


@pytest.mark.parametrize("status", ["Completed", "done", "", "running "])
async def test_search_for_an_unknown_status_is_refused(db_url: str, status: str) -> None:
    """A FlowStatus that is none of running, completed, failed, stopped raises SearchQueryError
    naming it and listing those four. Catches: `FlowStatus = "Completed"` (or "done", or "")
    silently matching nothing, so a typo read as "no such flows"."""
    async with engine_for(db_url, SEARCH_REGISTRY, worker=False) as eng:
        await eng.client.start_flow("Plan-AND-Do", "p")
        with pytest.raises(SearchQueryError) as caught:
            await eng.client.search_flows(f'FlowType = "Plan-AND-Do" AND FlowStatus = "{status}"')
        message = str(caught.value)
        assert f"FlowStatus {status!r}" in message
        assert '"running", "completed", "failed", "stopped"' in message
        assert await eng.client.search_flows('FlowStatus = "running"') == ["p"]


# Concurrent RPCs on one flow -------------------------------------------------------------------

Count = Attribute("Count", int)
Notes = AttributeMap("Notes", int)


@rpc()
async def increment(ctx: RpcContext, _request: Any) -> int:
    await asyncio.sleep(0)  # an await, as any real handler has, lets the other calls read the same version
    count = (ctx.get(Count) or 0) + 1
    ctx.set(Count, count)
    return count


note_runs: list[int] = []


@rpc(request_type=int, load=LoadOptions.none())
async def note(ctx: RpcContext, request: int) -> None:
    note_runs.append(request)
    ctx.set(Notes[str(request)], request)  # loads nothing: commits with no snapshot read before


runs: list[int] = []
overtaker: list[AsyncClient] = []  # the client that writes to the flow during each run


@rpc()
async def always_overtaken(ctx: RpcContext, _request: Any) -> None:
    """Each run publishes before it commits: another write to the flow, so its snapshot is stale."""
    runs.append(1)
    await overtaker[0].publish("c", Inbox, len(runs))
    ctx.set(Count, -1)


nested: list[AsyncClient] = []  # the client whose RPC calls another on the same flow
outer_runs: list[int] = []
outer_events: dict[str, asyncio.Event] = {}  # "read" and "overtaken", made in each test's event loop


@rpc()
async def peek(ctx: RpcContext, _request: Any) -> int:
    return ctx.get(Count) or 0


@rpc()
async def outer(ctx: RpcContext, _request: Any) -> int:
    """Reuses `peek` on its own flow; its first run is overtaken, so it runs again in the flow's turn."""
    outer_runs.append(1)
    seen: int = await nested[0].rpc(ctx.flow_id, "peek")
    if len(outer_runs) == 1:
        outer_events["read"].set()
        await outer_events["overtaken"].wait()
    ctx.set(Count, seen + 100)
    return seen


@rpc(load=LoadOptions.only(Count))
async def tally(ctx: RpcContext, _request: Any) -> int:
    """Counts, and keeps each count's predecessor in Notes, loaded only when needed (as an agent
    session pages a long map): the run that cannot lose must load it in its own transaction."""
    await asyncio.sleep(0)
    count = (ctx.get(Count) or 0) + 1
    await ctx.load(Notes[str(count - 1)])
    assert (ctx.get(Notes[str(count - 1)]) is not None) == (count > 1)
    ctx.set(Count, count)
    ctx.set(Notes[str(count)], count)
    return count


fails_from_run: list[int] = []  # the run from which `fails_late` raises; its runs so far


@rpc()
async def fails_late(ctx: RpcContext, _request: Any) -> None:
    fails_from_run.append(1)
    if len(fails_from_run) > fails_from_run[0]:
        raise ValueError(f"run {len(fails_from_run) - 1} refuses")
    ctx.set(Count, -1)


@rpc(locks=[Count])
async def locked_set(ctx: RpcContext, _request: Any) -> None:
    ctx.set(Count, 7)


@dataclasses.dataclass(frozen=True)
class Move:
    by: int


@rpc(request_type=Move)
async def move(ctx: RpcContext, request: Move) -> str:
    ctx.set(Count, (ctx.get(Count) or 0) + request.by)
    return type(request).__name__


@rpc(load=LoadOptions.none())
async def count_queued(ctx: RpcContext, _request: Any) -> int:
    """Loads no attribute, but decides on the queued messages, which only a snapshot holds."""
    queued = len(ctx.pending(Inbox))
    ctx.set(Count, queued)
    return queued


COUNTER = Flow("Counter", [Step("Listen", complete, wait_for=wait_for_inbox)], start_step="Listen",
               schema=[Inbox, Count, Notes], rpcs=[increment, note, always_overtaken, peek, outer, tally, fails_late,
                                                      locked_set, move, count_queued])
COUNTER_REGISTRY = Registry([COUNTER])


async def test_an_rpc_handler_gets_its_request_in_the_declared_type_however_it_was_given(db_url: str) -> None:
    """A request given as the dict a JSON body decodes to reaches the handler as the declared
    dataclass, as it would after a hop through the store. Catches: the client handing the handler
    the caller's dict, so `request.by` raised AttributeError ('dict' object has no attribute 'by')."""
    async with engine_for(db_url, COUNTER_REGISTRY, worker=False) as eng:
        await eng.client.start_flow("Counter", "c")
        assert await eng.client.rpc("c", "move", {"by": 2}) == "Move"
        assert await eng.client.rpc("c", "move", Move(3)) == "Move"
        assert await eng.client.get_attribute("c", Count) == 5


async def test_an_rpc_that_loads_nothing_but_reads_queued_messages_sees_them(db_url: str) -> None:
    """A handler that loads no attribute but reads the queued messages runs on a snapshot that has
    them. Catches: its first run, given no snapshot (none needed for a handler that decides from its
    request alone), committed as if no message were queued: it returned and stored 0."""
    async with engine_for(db_url, COUNTER_REGISTRY, worker=False) as eng:
        await eng.client.start_flow("Counter", "c")
        for value in (1, 2):
            await eng.client.publish("c", Inbox, value)
        assert await eng.client.rpc("c", "count_queued") == 2
        assert await eng.client.get_attribute("c", Count) == 2


async def test_a_client_remembers_a_bounded_number_of_flow_types(db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that starts flows for days keeps at most CLIENT_FLOW_TYPE_CACHE_ENTRIES flow types,
    and a flow it forgot is looked up again. Catches: the table never cleared, growing by one entry
    per flow for the client's whole life."""
    monkeypatch.setattr(client_module, "CLIENT_FLOW_TYPE_CACHE_ENTRIES", 2)
    async with engine_for(db_url, COUNTER_REGISTRY, worker=False) as eng:
        c = eng.client
        for i in range(5):
            await c.start_flow("Counter", f"c{i}")
            assert len(c._flow_types) <= 2
        assert [await c.rpc(f"c{i}", "increment") for i in range(5)] == [1] * 5
        assert len(c._flow_types) <= 2


async def test_many_concurrent_rpcs_of_one_client_on_one_flow_all_commit(db_url: str) -> None:
    """E8 serializes an RPC with every other change to its flow, so however many RPCs one client
    runs on one flow at once, each commits exactly once. Catches: optimistic retries in which each
    round committed one call and sent all the others round again, so with more than MAX_RPC_TRIES
    concurrent calls the rest failed with RpcContentionError ("saw the flow change on each of 64
    tries"). Calls that need no snapshot (`note`) run among them and must neither fail nor be lost,
    and each runs its handler once: one that finishes while another call holds the flow's turn waits
    for the turn and commits what it computed."""
    calls = 3 * MAX_RPC_TRIES
    note_runs.clear()
    async with engine_for(db_url, COUNTER_REGISTRY, worker=False) as eng:
        c = eng.client
        await c.start_flow("Counter", "c")
        results = await asyncio.gather(
            *(c.rpc("c", "increment") for _ in range(calls)),
            *(c.rpc("c", "note", i) for i in range(calls)),
        )
        assert sorted(results[:calls]) == list(range(1, calls + 1))  # each saw the one before it
        assert await c.get_attribute("c", Count) == calls
        assert await c.get_attribute_map("c", Notes) == {str(i): i for i in range(calls)}
        assert sorted(note_runs) == list(range(calls))
        assert not c._rpc_turns._turns  # a flow's turn is dropped when its last RPC leaves it


async def test_an_rpc_overtaken_on_every_try_runs_its_handler_max_tries_times(db_url: str) -> None:
    """When a writer outside the client changes the flow before each commit, the RPC gives up with
    RpcContentionError naming it, the flow and MAX_RPC_TRIES, having run its handler exactly that
    many times and committed nothing. Pins the bound on handler runs that taking turns must keep."""
    runs.clear()
    async with engine_for(db_url, COUNTER_REGISTRY, worker=False) as eng:
        overtaker[:] = [eng.client]
        await eng.client.start_flow("Counter", "c")
        with pytest.raises(RpcContentionError) as caught:
            await eng.client.rpc("c", "always_overtaken")
        assert len(runs) == MAX_RPC_TRIES
        message = str(caught.value)
        assert "'always_overtaken'" in message
        assert "'c'" in message
        assert f"each of {MAX_RPC_TRIES} tries" in message
        assert await eng.client.get_attribute("c", Count) is None
        assert not eng.client._rpc_turns._turns


def overtake_every_snapshot(monkeypatch: pytest.MonkeyPatch, client: AsyncClient, outsider: AsyncClient) -> list[int]:
    """From now on, right after each snapshot `client` reads for an RPC, `outsider` publishes to the
    flow: a writer outside the client (another process, a Step) that commits between every try's
    read and its commit, so that no try on a snapshot can commit. Returns the publishes so far."""
    real = client.store.rpc_read
    published: list[int] = []

    async def read_then_overtaken(flow_id: str, load: Any, locks: Any) -> Any:
        snapshot = await real(flow_id, load, locks)
        published.append(await outsider.publish(flow_id, Inbox, 0))
        return snapshot

    monkeypatch.setattr(client.store, "rpc_read", read_then_overtaken)
    return published


@pytest.mark.parametrize("name", ["increment", "tally"])
async def test_rpcs_of_several_clients_overtaken_before_every_commit_all_commit(
    db_url: str, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """E8 serializes an RPC with every change to its flow, so an RPC overtaken by other writers on
    every try still commits, once. Here a writer outside each client commits between each snapshot
    read and its commit, as other clients' and processes' bursts did at random (six clients sending
    600 RPCs to one flow made up to nine fail per run). Catches: every try of every RPC losing its
    race, so each failed with RpcContentionError after MAX_RPC_TRIES tries. `tally` loads more
    attributes during its run, which must read in the transaction that cannot lose."""
    clients, calls = 3, 4
    async with engine_for(db_url, COUNTER_REGISTRY, worker=False) as eng:
        await eng.client.start_flow("Counter", "c")
        others = [AsyncClient(COUNTER_REGISTRY, db_url) for _ in range(clients)]
        try:
            published = [overtake_every_snapshot(monkeypatch, other, eng.client) for other in others]
            results = await asyncio.gather(*(other.rpc("c", name) for other in others for _ in range(calls)))
        finally:
            for other in others:
                await other.close()
        assert sorted(results) == list(range(1, clients * calls + 1))  # each saw the one before it
        assert await eng.client.get_attribute("c", Count) == clients * calls
        assert all(published)  # each client's RPCs were overtaken


async def test_a_burst_of_rpcs_from_several_clients_on_one_flow_all_commit_once(db_url: str) -> None:
    """Several clients (several web server processes, say) each send many RPCs to one flow at once,
    with no hook: they race each other for real, and each commits exactly once. Catches (at random,
    the test above at once): an RPC losing every race to the other clients' bursts."""
    clients, calls = 4, 25
    async with engine_for(db_url, COUNTER_REGISTRY, worker=False) as eng:
        await eng.client.start_flow("Counter", "c")
        others = [AsyncClient(COUNTER_REGISTRY, db_url) for _ in range(clients)]
        try:
            results = await asyncio.gather(*(other.rpc("c", "tally") for _ in range(calls) for other in others))
        finally:
            for other in others:
                await other.close()
        assert sorted(results) == list(range(1, clients * calls + 1))
        assert await eng.client.get_attribute("c", Count) == clients * calls


async def test_an_rpc_whose_handler_raises_after_lost_races_raises_its_error(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A handler that raises in the try that cannot lose (its third) commits nothing and its error
    reaches the caller, as from any run (E8)."""
    async with engine_for(db_url, COUNTER_REGISTRY, worker=False) as eng:
        await eng.client.start_flow("Counter", "c")
        async with AsyncClient(COUNTER_REGISTRY, db_url) as other:
            overtake_every_snapshot(monkeypatch, other, eng.client)
            fails_from_run[:] = [2]  # runs 1 and 2 lose their races, run 3 raises
            with pytest.raises(ValueError, match="refuses"):
                await other.rpc("c", "fails_late")
        assert await eng.client.get_attribute("c", Count) is None


async def test_an_rpc_whose_lock_a_step_took_while_it_lost_races_fails_with_a_lock_conflict(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """E7 holds in the try that cannot lose: a Step that took the RPC's lock while the RPC lost its
    first two races makes that try fail at once with RpcLockConflictError naming the lock and the
    Step, committing nothing, as any try would."""
    async with engine_for(db_url, COUNTER_REGISTRY, worker=False) as eng:
        await eng.client.start_flow("Counter", "c")

        def step_takes_count(db: Any) -> None:  # as a claim of a Step locking Count does
            row = db.one("SELECT task_id FROM tasks WHERE flow_id = ?", ("c",))
            db.run("INSERT INTO locks (flow_id, lock_name, task_id) VALUES (?, ?, ?)", ("c", "Count", row[0]))

        async with AsyncClient(COUNTER_REGISTRY, db_url) as other:
            real = other.store.rpc_read
            reads: list[int] = []

            async def read_then_overtaken(flow_id: str, load: Any, locks: Any) -> Any:
                snapshot = await real(flow_id, load, locks)
                reads.append(await eng.client.publish(flow_id, Inbox, 0))
                if len(reads) == 2:
                    await eng.store.raw(step_takes_count, write=True)
                return snapshot

            monkeypatch.setattr(other.store, "rpc_read", read_then_overtaken)
            with pytest.raises(RpcLockConflictError) as conflict:
                await other.rpc("c", "locked_set")
        assert conflict.value.lock == "Count"
        assert "Listen-1" in str(conflict.value)
        assert len(reads) == 2  # the third try read in the transaction that holds the flow's lock
        assert await eng.client.get_attribute("c", Count) is None


async def test_rpcs_that_start_while_a_turn_is_taken_wait_for_it(db_url: str) -> None:
    """While an RPC of the client holds a flow's turn (here the test holds it), the client's other
    RPCs on that flow neither read a snapshot nor commit a blind run: they wait for the turn, then
    all commit, a blind handler having run once. Catches: RPCs racing the turn's holder, which could
    make it lose on every try; and a blind run that waited being run again."""
    note_runs.clear()
    async with engine_for(db_url, COUNTER_REGISTRY, worker=False) as eng:
        c = eng.client
        await c.start_flow("Counter", "c")
        turns = c._rpc_turns
        held, release = asyncio.Event(), asyncio.Event()

        async def hold() -> None:  # a task of its own: calls made where the turn is held would be its
            async with turns.turn("c"):
                held.set()
                await release.wait()

        holder = asyncio.ensure_future(hold())
        await held.wait()
        calls = [asyncio.ensure_future(c.rpc("c", "increment")) for _ in range(3)]
        calls += [asyncio.ensure_future(c.rpc("c", "note", i)) for i in range(3)]

        async def all_waiting() -> bool:
            return turns._turns[asyncio.get_running_loop(), "c"].users == 1 + len(calls)

        await wait_until("every call waiting for the turn", all_waiting)
        assert await c.get_attribute("c", Count) is None
        assert await c.get_attribute_map("c", Notes) == {}
        assert sorted(note_runs) == [0, 1, 2]
        release.set()
        await holder
        assert sorted(await asyncio.gather(*calls[:3])) == [1, 2, 3]
        await asyncio.gather(*calls[3:])
        assert await c.get_attribute_map("c", Notes) == {"0": 0, "1": 1, "2": 2}
        assert sorted(note_runs) == [0, 1, 2]
        assert not turns._turns


async def test_an_rpc_whose_handler_calls_an_rpc_on_its_flow_after_a_lost_race_returns(db_url: str) -> None:
    """The retry of a lost race holds the flow's turn; the RPC its handler makes on the same flow
    runs in that turn. Catches: the inner RPC waiting for the turn its own caller held, for ever."""
    nested.clear()
    outer_runs.clear()
    outer_events.update(read=asyncio.Event(), overtaken=asyncio.Event())
    async with engine_for(db_url, COUNTER_REGISTRY, worker=False) as eng:
        nested.append(eng.client)
        await eng.client.start_flow("Counter", "c")
        call = asyncio.ensure_future(eng.client.rpc("c", "outer"))
        await outer_events["read"].wait()
        assert await eng.client.rpc("c", "increment") == 1  # lands while the first run waits
        outer_events["overtaken"].set()
        assert await asyncio.wait_for(call, 30) == 1
        assert len(outer_runs) == 2
        assert await eng.client.get_attribute("c", Count) == 101


@pytest.mark.parametrize("reason", [None, 0, b"", 42])
async def test_stop_flow_refuses_a_reason_that_is_not_text_however_falsy(db_url: str, reason: Any) -> None:
    """Catches: None, 0 and b"" taken as no reason (stopping the flow), only 42 refused."""
    async with engine_for(db_url, COUNTER_REGISTRY, worker=False) as eng:
        await eng.client.start_flow("Counter", "c")
        with pytest.raises(InvalidValueError, match="stop_flow's reason must be a str"):
            await eng.client.stop_flow("c", reason)
        assert (await eng.client.describe_flow("c")).status == "running"



async def test_a_missing_or_ended_flow_is_caught_by_one_name(db_url: str) -> None:
    """Seed 004's example catches FlowNotActiveOrNotFoundError for a session that is gone, whether it
    never existed or has ended. Catches: no such name, so that code failed to import, and catching
    either error alone let the other through."""
    async with engine_for(db_url, SEARCH_REGISTRY) as eng:
        c = eng.client
        with pytest.raises(FlowNotActiveOrNotFoundError) as missing:
            await c.describe_flow("never-started")
        assert isinstance(missing.value, FlowNotFoundError)
        await c.start_flow("Plan-AND-Do", "ended")
        await c.stop_flow("ended")
        with pytest.raises(FlowNotActiveOrNotFoundError) as ended:
            await c.publish("ended", Inbox, 1)
        assert isinstance(ended.value, FlowNotActiveError)


async def test_an_rpc_cancelled_while_its_commit_waits_for_the_database_may_still_commit(db_url: str) -> None:
    """A call cancelled (asyncio.timeout, a web request whose client left) after it was sent still
    commits: its transaction runs on the store's thread or connection whatever became of its caller.
    docs/engine.md says so, and that a retry must check first (an RPC is not deduplicated)."""
    async with engine_for(db_url, COUNTER_REGISTRY, worker=False) as eng:
        await eng.client.start_flow("Counter", "c")
        holding, release = threading.Event(), threading.Event()

        def hold(db: Any) -> None:
            # Another transaction writing the flow's row: the RPC's commit waits for it.
            db.run("UPDATE flows SET flow_id = flow_id WHERE flow_id = ?", ("c",))
            holding.set()
            release.wait(10)

        holder = asyncio.ensure_future(asyncio.to_thread(asyncio.run, eng.store.raw(hold, write=True)))
        await asyncio.to_thread(holding.wait, 10)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                await eng.client.rpc("c", "note", 7)
        release.set()
        await holder

        async def committed() -> bool:
            return await eng.client.get_attribute_map("c", Notes) == {"7": 7}

        await wait_until("the cancelled RPC's commit", committed)
        assert await eng.client.rpc("c", "increment") == 1  # and the client serves the next call
