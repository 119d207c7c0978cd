"""The attribute rows a store keeps between transactions (_attribute_cache): never served stale.

A store reads a flow's attributes from its cache only while the flow's version is the one the rows
were read or written at. These tests change rows behind a store's back in each way the version
guards against: another connection's commit, a commit that failed, and a folded Execute whose
writes were rolled back within its commit; then read through the store that had them cached.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from dex_engine import (
    AsyncClient,
    Attribute,
    Channel,
    Context,
    Flow,
    LoadOptions,
    Registry,
    RpcContext,
    Step,
    StepDecision,
    StepOptions,
    Wait,
    open_store,
    rpc,
)
from dex_engine import _transitions as tx
from dex_engine._attribute_cache import AttributeCache, Ident, KnownRows
from dex_engine._options import LoadSpec

from .conftest import engine_for, wait_until

A = Attribute("A", int)
B = Attribute("B", str)
Poison = Attribute("Poison", int)
Inbox = Channel("Inbox", str)


@rpc(request_type=int)
async def set_a(ctx: RpcContext, value: int) -> None:
    ctx.set(A, value)


@rpc(request_type=int)
async def set_poison(ctx: RpcContext, value: int) -> None:
    ctx.set(Poison, value)


@rpc(request_type=str)
async def post(ctx: RpcContext, text: str) -> None:
    ctx.publish(Inbox, text)


async def _start(ctx: Context, _: None) -> StepDecision:
    ctx.set(A, 1)
    return StepDecision.go_to("Idle")


async def _idle_wait(ctx: Context, _: None) -> Wait:
    return Wait.until(Inbox.for_one())


async def _idle(ctx: Context, _: None) -> StepDecision:
    return StepDecision.go_to("Idle")


FLOW = Flow("Cached", [
    Step("Start", _start, options=StepOptions(load=LoadOptions.only(A))),
    Step("Idle", _idle, wait_for=_idle_wait, options=StepOptions(load=LoadOptions.none())),
], start_step="Start", schema=[A, B, Poison, Inbox], rpcs=[set_a, set_poison, post])


async def _started(client: AsyncClient, flow_id: str) -> Any:
    await client.start_flow("Cached", flow_id)
    await wait_until("Start committed", lambda: client.get_attribute(flow_id, A))


async def test_rows_another_connection_changed_are_read_again(db_url: str) -> None:
    """A store that read A=1 (and so keeps it) reads A again after another connection's RPC set
    it to 2. Catches rows served without checking the flow's version."""
    async with engine_for(db_url, Registry([FLOW])) as eng:
        await _started(eng.client, "f")
        assert await eng.client.get_attribute("f", A) == 1
        other = open_store(db_url)
        try:
            await AsyncClient(Registry([FLOW]), store=other).rpc("f", "set_a", 2)
        finally:
            await other.close()
        assert await eng.client.get_attribute("f", A) == 2


@pytest.mark.sqlite_only
async def test_a_commit_that_fails_leaves_no_rows_behind(db_url: str) -> None:
    """An RPC sets Poison; its transaction runs to the end but its COMMIT fails (a deferred foreign
    key this test adds), so nothing of it stays. Another connection then moves the flow to the
    version that commit would have left; the store that ran it must still read Poison as unset.
    Catches the rows of a transaction kept although it rolled back."""
    async with engine_for(db_url, Registry([FLOW])) as eng:
        await _started(eng.client, "f")
        await eng.store.raw(lambda db: db.run(
            "CREATE TABLE doomed (flow_id TEXT REFERENCES flows (flow_id) DEFERRABLE INITIALLY DEFERRED)"),
            write=True)
        await eng.store.raw(lambda db: db.run(
            "CREATE TRIGGER poison AFTER INSERT ON attributes WHEN NEW.name = 'Poison' "
            "BEGIN INSERT INTO doomed VALUES ('no such flow'); END"), write=True)
        assert await eng.client.get_attribute("f", Poison) is None
        with pytest.raises(Exception, match="FOREIGN KEY"):
            await eng.client.rpc("f", "set_poison", 1)
        other = open_store(db_url)
        try:
            await AsyncClient(Registry([FLOW]), store=other).rpc("f", "set_a", 3)
        finally:
            await other.close()
        assert await eng.client.get_attribute("f", A) == 3
        assert await eng.client.get_attribute("f", Poison) is None


@pytest.mark.sqlite_only
async def test_writes_of_a_folded_execute_rolled_back_are_not_kept(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Taker's Execute, folded into the commit of the RPC that readies it, writes B; its commit
    then fails within that transaction (its savepoint rolls back) and it runs again as a usual
    attempt, which writes nothing. B must read as unset. Catches the rolled-back write kept in the
    rows the committing operation leaves."""

    async def taker(ctx: Context, _: None) -> StepDecision:
        if tx_called_from("fold_execute"):
            ctx.set(B, "written by the rolled-back fold")
        return StepDecision.graceful_complete()

    async def taker_wait(ctx: Context, _: None) -> Wait:
        return Wait.until(Inbox.for_one())

    async def start(ctx: Context, _: None) -> StepDecision:
        return StepDecision.go_to("Taker")

    real = tx.commit_execute
    failed: list[str] = []

    def failing_when_folded(db: tx.Db, lease: Any, *args: Any, **kwargs: Any) -> None:
        real(db, lease, *args, **kwargs)
        if lease.step_type == "Taker" and tx_called_from("commit_folded"):
            failed.append(lease.step_execution_id)
            raise RuntimeError("the folded commit fails after its statements ran")

    monkeypatch.setattr(tx, "commit_execute", failing_when_folded)
    flow = Flow("Folding", [
        Step("Start", start),
        Step("Taker", taker, wait_for=taker_wait, pure_execute=True, options=StepOptions(load=LoadOptions.only(B))),
    ], start_step="Start", schema=[A, B, Poison, Inbox], rpcs=[post])
    async with engine_for(db_url, Registry([flow])) as eng:
        for i in range(10):
            flow_id = f"f{i}"
            await eng.client.start_flow("Folding", flow_id)
            await wait_until("Taker waiting", lambda fid=flow_id: _waiting(eng.client, fid))
            assert await eng.client.get_attribute(flow_id, B) is None  # the store now keeps B's rows
            await eng.client.rpc(flow_id, "post", "go")
            info = await eng.client.wait_for_flow(flow_id, 10)
            assert info.status == "completed", info
            assert await eng.client.get_attribute(flow_id, B) is None
        assert failed, "no Taker was folded into the RPC's commit"


def tx_called_from(function_name: str) -> bool:
    import sys

    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == function_name:
            return True
        frame = frame.f_back
    return False


async def _waiting(client: AsyncClient, flow_id: str) -> bool:
    info = await client.describe_flow(flow_id)
    return [s.state for s in info.active_steps] == ["waiting"]


def test_split_takes_exactly_the_rows_of_the_names_it_covers() -> None:
    """KnownRows.split against a plain filter of its rows, over random learns, writes and deletes:
    a load naming every name with rows takes them in one copy (the names with rows are tracked,
    never forgotten while a row is left). Catches: a write of a new name not tracked (its rows
    handed to a load that did not ask for them), a delete or a learn that drops a name still held."""
    names = ["A", "B", "C", "D"]
    rng = random.Random(7)
    for _trial in range(300):
        known = KnownRows(1, 1)
        for _step in range(rng.randint(1, 12)):
            action = rng.random()
            if action < 0.3:
                learned = tuple(rng.sample(names, rng.randint(1, len(names))))
                known.learn(LoadSpec("only", learned), {
                    (n, f"k{i}"): f"{n}{i}".encode() for n in names for i in range(rng.randint(0, 2))})
            elif action < 0.4:
                known.learn(LoadSpec("all"), {(n, ""): n.encode() for n in rng.sample(names, 2)})
            else:
                known.apply({(rng.choice(names), f"k{rng.randint(0, 2)}"): rng.choice([None, b"v", b"w"])
                             for _ in range(rng.randint(1, 4))})
            wanted = tuple(rng.sample(names, rng.randint(1, len(names))))
            instances = ((rng.choice(names), "k0"),)
            found, rest = known.split(LoadSpec("only", wanted, instances))
            covered = {n for n in wanted if known.covers(n)}
            expected = {ident: v for ident, v in known.rows.items()
                        if ident[0] in covered or (ident in instances and known.covers(ident[0]))}
            assert found == expected
            assert rest is None or set(rest.names) == set(wanted) - covered
            # The copy a Step is handed is its own: changing it leaves the known rows as they were.
            found[("Z", "")] = b"x"
            assert ("Z", "") not in known.rows


def _read(database: dict[Ident, bytes], spec: LoadSpec) -> dict[Ident, bytes]:
    """What a load of `spec` reads from a database holding `database` (as _read_attributes does)."""
    if spec.mode == "none":
        return {}
    if spec.mode == "all":
        return dict(database)
    return {ident: v for ident, v in database.items() if ident[0] in spec.names or ident in spec.instances}


def _random_spec(rng: random.Random, names: list[str]) -> LoadSpec:
    if rng.random() < 0.1:
        return LoadSpec(rng.choice(["all", "none"]))
    wanted = tuple(rng.sample(names, rng.randint(0, len(names))))
    instances = tuple({(rng.choice(names), f"k{rng.randint(0, 2)}") for _ in range(rng.randint(0, 2))})
    return LoadSpec("only", wanted, instances)


def test_known_rows_and_what_they_leave_to_read_are_exactly_the_database() -> None:
    """KnownRows against a model database, used as load_attributes uses it, over random loads, writes
    and deletes: for every load, the rows split hands over plus those read for what it leaves are
    exactly what the database holds for that load. The oracle is the database, not KnownRows' own
    state: a learn that keeps rows of the wrong names, or a split that leaves an instance unread,
    hands a Step missing or deleted rows."""
    names = ["A", "B", "C", "D"]
    rng = random.Random(11)
    for _trial in range(400):
        database = {(n, f"k{i}"): f"{n}{i}".encode() for n in names for i in range(rng.randint(0, 2))}
        known = KnownRows(1, 1)
        for _step in range(rng.randint(1, 14)):
            if rng.random() < 0.6:
                spec = _random_spec(rng, names)
                if spec.mode == "none":
                    continue  # load_attributes reads nothing for it, and asks KnownRows nothing
                rows, rest = known.split(spec)
                if rest is not None:
                    read = _read(database, rest)
                    known.learn(rest, read)
                    rows.update(read)
                assert rows == _read(database, spec), (spec, rest)
            else:
                writes: dict[Ident, bytes | None] = {
                    (rng.choice(names), f"k{rng.randint(0, 2)}"): rng.choice([None, b"v", b"w"])
                    for _ in range(rng.randint(1, 4))}
                for ident, value in writes.items():
                    if value is None:
                        database.pop(ident, None)
                    else:
                        database[ident] = value
                known.apply(writes)


def test_a_load_known_whole_reads_nothing_more() -> None:
    """Once a load of some names (or of everything) read them, the next load of them is served
    whole from KnownRows, and a later load of other names keeps them known."""
    known = KnownRows(1, 1)
    known.learn(LoadSpec("only", ("A",), (("B", "k"),)), {("A", "1"): b"a", ("B", "k"): b"b"})
    assert known.split(LoadSpec("only", ("A",))) == ({("A", "1"): b"a"}, None)
    known.learn(LoadSpec("only", ("C",)), {("C", "1"): b"c"})
    assert known.covers("A") and known.covers("C") and not known.covers("B")
    assert known.split(LoadSpec("only", ("A", "C"))) == ({("A", "1"): b"a", ("C", "1"): b"c"}, None)
    everything = KnownRows(1, 1)
    everything.learn(LoadSpec("all"), {("A", "1"): b"a"})
    assert everything.split(LoadSpec("all")) == ({("A", "1"): b"a"}, None)
    assert everything.split(LoadSpec("only", ("Z",))) == ({}, None)
    copied = known.copy()
    assert copied == known and copied is not known and copied.rows is not known.rows
    copied.apply({("A", "2"): b"x"})
    assert ("A", "2") not in known.rows


def test_a_copy_learns_apart_from_the_rows_it_was_copied_from() -> None:
    """An operation works on a copy of the cached rows; what it learns must not reach the cached
    entry, which stays in the cache when the operation rolls back. Catches a copy sharing the set
    of names known whole: the entry would then claim a name whose rows it never read, and a later
    load at that version would hand the Step that name as unset."""
    cached = KnownRows(1, 1)
    cached.learn(LoadSpec("only", ("A",)), {("A", "1"): b"a"})
    copied = cached.copy()
    copied.learn(LoadSpec("only", ("B",)), {("B", "1"): b"b"})
    assert not cached.covers("B")
    assert cached.split(LoadSpec("only", ("A", "B"))) == ({("A", "1"): b"a"}, LoadSpec("only", ("B",)))
    copied.learn(LoadSpec("all"), {("C", "1"): b"c"})
    assert not cached.covers("C") and cached.rows == {("A", "1"): b"a"}


def test_the_cache_keeps_flows_up_to_exactly_its_byte_bound() -> None:
    cache = AttributeCache(max_flows=10, max_bytes=4)
    full = KnownRows(1, 1, {("A", "1"): b"abcd"})
    cache.put("f", full)
    assert cache.get("f", 1, 1) is full  # exactly at the bound: kept
    cache.put("g", KnownRows(1, 1, {("A", "1"): b"e"}))
    assert len(cache) == 1 and cache.get("f", 1, 1) is None  # one byte over: the oldest went


def test_rows_put_again_or_dropped_give_their_bytes_back() -> None:
    """Every commit puts its flow's rows again, replacing the entry, and a deleted flow's entry is
    dropped: the bytes counted for the old entry must go with it. Catches a count that only grows:
    it soon evicts every flow that fits (here the only one), and the cache keeps nothing again."""
    cache = AttributeCache(max_flows=10, max_bytes=4)
    for value in (b"abcd", b"efgh", b"ijkl"):
        rows = KnownRows(1, 1, {("A", ""): value})
        cache.put("f", rows)
        assert cache.get("f", 1, 1) is rows
    cache.drop("f")
    other = KnownRows(1, 1, {("A", ""): b"mnop"})
    cache.put("g", other)
    assert cache.get("g", 1, 1) is other and len(cache) == 1


def test_the_cache_answers_only_for_the_same_version_and_incarnation_and_keeps_the_newest_used() -> None:
    """A flow's rows are those of its version and of this incarnation of the flow: one deleted and
    started again under the same ID can reach the same version number with other rows. A hit makes
    the flow the newest used, so the flows that go first are those unused longest."""
    cache = AttributeCache(max_flows=2, max_bytes=1_000)
    f = KnownRows(3, 100, {("A", ""): b"f"})
    cache.put("f", f)
    assert cache.get("f", 3, 100) is f
    assert cache.get("f", 4, 100) is None  # a later version
    assert cache.get("f", 3, 200) is None  # the same version of a new flow under the same ID
    cache.put("g", KnownRows(1, 1))
    assert cache.get("f", 3, 100) is f  # f is now the newest used
    cache.put("h", KnownRows(1, 1))  # one flow too many: g, unused longest, goes
    assert cache.get("g", 1, 1) is None
    assert cache.get("f", 3, 100) is f and cache.get("h", 1, 1) is not None
