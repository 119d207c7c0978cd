"""Task options stored once per distinct value (SQLite, schema 6; _task_options).

A task row names its options' row in task_options. These tests check what that must never cost:
a task whose options cannot be read. The row is written in the transaction of the first task that
names it, so a rollback (of a transaction, or of a folded Execute's savepoint) must leave the store
writing it again; housekeeping deletes only rows unused for a day that no task names; rows written
before schema 6 still hold their JSON and still run.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest

from dex_engine import (
    AsyncClient,
    AsyncWorker,
    AttributeMap,
    Context,
    Flow,
    FlowConfig,
    LoadOptions,
    MovementOptions,
    Registry,
    RetryPolicy,
    Step,
    StepDecision,
    StepOptions,
    Store,
    _task_options,
    open_store,
)
from dex_engine import _transitions as tx
from dex_engine._codec import encode_json
from dex_engine._decision import Movement
from dex_engine._limits import TASK_OPTIONS_COLLECT_MS, TASK_OPTIONS_KEEP_MS, TASK_OPTIONS_REFRESH_MS
from dex_engine._options import TaskOptions
from dex_engine._records import StartRequest
from dex_engine._scheduling import movement_record
from dex_engine._task_options import SharedOptions, digest_of

from .conftest import FAST, run_as_one_batch, statements_during, wait_until

T0 = 1_900_000_000_000  # a fixed clock, far from the real one, for the rows these tests write


async def _done(ctx: Context, _: None) -> StepDecision:
    return StepDecision.dead_end()


Records = AttributeMap("Records", str)

FLOW = Flow("Opts", [
    Step("Plain", _done, input_type=type(None)),
    Step("Patient", _done, input_type=type(None),
         options=StepOptions(execute_retry=RetryPolicy(max_attempts=7))),
], start_step=None, schema=[Records])


def _record(step_type: str) -> Any:
    return movement_record(FLOW, Movement(step_type, None))


def _stored(step_type: str) -> TaskOptions:
    """The options a task of `step_type` is stored with: its Step's, with the flow's durability."""
    return msgspec.structs.replace(_record(step_type).options, durability=FlowConfig().default_step_durability)


async def _store_with_flow(tmp_path: Path) -> Store:
    store = open_store(f"sqlite:///{tmp_path / 'opts.db'}")
    await store.start_flow(StartRequest("f", "Opts", b"null", FlowConfig(), None))
    return store


async def _task_options_rows(store: Store) -> dict[bytes, int]:
    rows = await store.raw(lambda db: db.all("SELECT digest, used_at FROM task_options"))
    return {bytes(d): int(at) for d, at in rows}


async def _create(store: Store, step_type: str, now: int) -> int:
    return int(await store.raw(lambda db: tx.create_task(db, "f", "Opts", _record(step_type), now), write=True))


async def _options_of(store: Store, task_id: int) -> TaskOptions:
    return await store.raw(lambda db: tx.stored_task_options(
        db, bytes(db.one("SELECT options FROM tasks WHERE task_id = ?", (task_id,))[0])))


async def test_tasks_name_one_row_per_distinct_options(tmp_path: Path) -> None:
    """Tasks of one Step type share a row; another type's options get their own; each task reads
    back exactly the options it was created with. Catches: options inlined again (no saving), one
    row per task, a reference that names the wrong row."""
    store = await _store_with_flow(tmp_path)
    try:
        ids = [await _create(store, "Plain", T0), await _create(store, "Plain", T0 + 1),
               await _create(store, "Patient", T0 + 2)]
        stored = await store.raw(lambda db: [bytes(r[0]) for r in db.all(
            "SELECT options FROM tasks ORDER BY task_id")])
        assert all(s.startswith(b"#") and len(s) == 23 for s in stored), stored
        assert stored[0] == stored[1] != stored[2]
        assert set(await _task_options_rows(store)) == {stored[0][1:], stored[2][1:]}
        for task_id, step_type in zip(ids, ["Plain", "Plain", "Patient"], strict=True):
            assert await _options_of(store, task_id) == _stored(step_type)
        # The row holds the options' JSON itself: what a reader of another process decodes.
        json_rows = await store.raw(lambda db: [bytes(r[0]) for r in db.all("SELECT options FROM task_options")])
        assert sorted(json_rows) == sorted(encode_json(_stored(s)) for s in ("Plain", "Patient"))
    finally:
        await store.close()


def _created_then_failed(db: Any) -> None:
    tx.create_task(db, "f", "Opts", _record("Patient"), T0)
    raise RuntimeError("rolled back on purpose")


async def _transaction_rolled_back(store: Store) -> None:
    with pytest.raises(RuntimeError, match="on purpose"):
        await store.raw(_created_then_failed, write=True)


async def _savepoint_rolled_back(store: Store) -> None:
    """A folded Execute's savepoint rolls back while its transaction commits."""
    assert await store.raw(lambda db: tx._in_savepoint(db, lambda: _created_then_failed(db)), write=True) is False


@pytest.mark.parametrize("undo", [_transaction_rolled_back, _savepoint_rolled_back])
async def test_a_rollback_leaves_the_store_writing_the_row_again(
    tmp_path: Path, undo: Callable[[Store], Awaitable[None]],
) -> None:
    """The first task naming the options is undone with its row, by a transaction's rollback or a
    savepoint's; the next one must write the row again, not name a row that is not there. Catches:
    confirmations kept from an undone transaction or savepoint (a task whose options no reader finds)."""
    store = await _store_with_flow(tmp_path)
    try:
        await undo(store)
        assert await _task_options_rows(store) == {}
        task_id = await _create(store, "Patient", T0 + 1)
        assert len(await _task_options_rows(store)) == 1
        assert await _options_of(store, task_id) == _stored("Patient")
    finally:
        await store.close()


async def test_a_batch_run_again_op_by_op_writes_the_row_again(tmp_path: Path) -> None:
    """A group commit whose batch fails runs again op by op, each in a savepoint: the first run's
    confirmations went with its rollback, so an op that names the options in the second run writes
    their row again. Catches: confirmations carried from a batch's failed run into its rerun (a
    committed task naming a row that was rolled back)."""
    store = await _store_with_flow(tmp_path)
    try:
        def failing(_db: Any) -> None:
            raise RuntimeError("fails the batch")

        results = await run_as_one_batch(store, [
            lambda db: tx.create_task(db, "f", "Opts", _record("Patient"), T0), failing])
        assert isinstance(results[1], RuntimeError)
        task_id = results[0]
        assert isinstance(task_id, int)
        assert len(await _task_options_rows(store)) == 1
        tx._decode_options._by_blob.clear()  # read as another process would, from the row
        assert await _options_of(store, task_id) == _stored("Patient")
    finally:
        await store.close()


async def test_an_op_rolled_back_alone_in_a_batch_leaves_its_row_to_be_written_again(tmp_path: Path) -> None:
    """In a batch run again op by op, an op that names the options and then fails is rolled back to
    its savepoint with their row; the next task naming them must write the row again. Catches: a
    failed op's confirmations kept past its savepoint's rollback (a task naming a row never stored)."""
    store = await _store_with_flow(tmp_path)
    try:
        def names_then_fails(db: Any) -> None:
            tx.create_task(db, "f", "Opts", _record("Patient"), T0)
            raise RuntimeError("fails after naming the options")

        results = await run_as_one_batch(store, [names_then_fails, lambda _db: None])
        assert isinstance(results[0], RuntimeError) and results[1] is None
        assert await _task_options_rows(store) == {}
        task_id = await _create(store, "Patient", T0 + 1)
        assert len(await _task_options_rows(store)) == 1
        tx._decode_options._by_blob.clear()  # read as another process would, from the row
        assert await _options_of(store, task_id) == _stored("Patient")
    finally:
        await store.close()


async def test_options_naming_map_instances_stay_in_the_task_row(tmp_path: Path) -> None:
    """Options that load map instances by key are one entity's (an agent tool Step loads its own
    call's record): shared, they would leave a row per entity behind. Catches: such options shared."""
    store = await _store_with_flow(tmp_path)
    try:
        own = MovementOptions(load=LoadOptions.only(Records["call-1"]))
        record = movement_record(FLOW, Movement("Plain", None, own))
        task_id = await store.raw(lambda db: tx.create_task(db, "f", "Opts", record, T0), write=True)
        stored = await store.raw(lambda db: bytes(db.one("SELECT options FROM tasks")[0]))
        assert json.loads(stored)["execute"]["load"]["instances"] == [["Records", "call-1"]]
        assert await _task_options_rows(store) == {}
        assert (await _options_of(store, task_id)).execute.load.instances == (("Records", "call-1"),)
    finally:
        await store.close()


async def test_one_transaction_writes_a_row_once_for_all_its_tasks(tmp_path: Path) -> None:
    """A transaction that creates several tasks with the same options (a turn's tool calls) writes
    their row once, in the same millisecond or not; the row it has written is pending until it commits."""
    store = await _store_with_flow(tmp_path)

    def three_tasks(db: Any) -> None:
        for now in (T0, T0, T0 + 1):
            tx.create_task(db, "f", "Opts", _record("Plain"), now)

    try:
        statements = await statements_during(store, lambda: store.raw(three_tasks, write=True))
        assert len([s for s in statements if "INSERT INTO task_options" in s]) == 1, statements
    finally:
        await store.close()


async def test_a_store_confirms_a_row_again_after_the_refresh_time(tmp_path: Path) -> None:
    """Within TASK_OPTIONS_REFRESH_MS a store names a row it confirmed without writing it; after
    that it confirms it again (used_at moves), so housekeeping never takes it for unused. Catches: a
    row confirmed once and then named for good, which a long-lived store could see collected."""
    store = await _store_with_flow(tmp_path)
    try:
        await _create(store, "Plain", T0)
        digest = digest_of(encode_json(_stored("Plain")))
        # The same millisecond: confirmed, not written again.
        statements = await statements_during(store, lambda: _create(store, "Plain", T0))
        assert not [s for s in statements if "task_options" in s], statements
        await _create(store, "Plain", T0 + TASK_OPTIONS_REFRESH_MS - 1)
        assert await _task_options_rows(store) == {digest: T0}
        await _create(store, "Plain", T0 + TASK_OPTIONS_REFRESH_MS)
        assert await _task_options_rows(store) == {digest: T0 + TASK_OPTIONS_REFRESH_MS}
    finally:
        await store.close()


async def test_housekeeping_deletes_only_unused_rows_no_task_names(tmp_path: Path) -> None:
    """A row unused for TASK_OPTIONS_KEEP_MS goes once no task names it; one a task still names
    stays, counted as used now; a row another store confirmed within the refresh time stays even
    with no task naming it. After its row went, a new task writes it again. Catches: a collector
    that deletes named rows (tasks whose options are gone) or rows another store may still name
    unconfirmed."""
    store = await _store_with_flow(tmp_path)
    other = open_store(f"sqlite:///{tmp_path / 'opts.db'}")
    try:
        named_task = await _create(store, "Patient", T0)
        plain_task = await _create(store, "Plain", T0)
        await store.raw(lambda db: db.run("DELETE FROM tasks WHERE task_id = ?", (plain_task,)), write=True)
        patient, plain = (digest_of(encode_json(_stored(s))) for s in ("Patient", "Plain"))

        # Another store confirms Plain's row late enough that it may still name it unconfirmed.
        late = T0 + TASK_OPTIONS_KEEP_MS + 1
        await other.raw(lambda db: tx._stored_options(db, _stored("Plain"), late), write=True)
        at = late + TASK_OPTIONS_REFRESH_MS - 1
        await store.raw(lambda db: tx.housekeeping(db, at), write=True)
        assert await _task_options_rows(store) == {patient: at, plain: late}

        # A day after every use: the unnamed row goes, the named one stays.
        collect_at = at + TASK_OPTIONS_COLLECT_MS + TASK_OPTIONS_KEEP_MS
        await store.raw(lambda db: tx.housekeeping(db, collect_at), write=True)
        assert await _task_options_rows(store) == {patient: collect_at}
        assert await _options_of(store, named_task) == _stored("Patient")

        # The store that confirmed Plain long ago writes its row again for a new task.
        again = await _create(other, "Plain", collect_at + 1)
        assert await _options_of(store, again) == _stored("Plain")
    finally:
        await other.close()
        await store.close()


async def test_a_reference_without_its_row_is_a_clear_error(tmp_path: Path) -> None:
    """A database changed outside the engine (the row deleted by hand): the error names the options
    reference and what to do, instead of a decode error."""
    store = await _store_with_flow(tmp_path)
    try:
        task_id = await _create(store, "Patient", T0)
        await store.raw(lambda db: db.run("DELETE FROM task_options"), write=True)
        reference = await store.raw(lambda db: bytes(db.one("SELECT options FROM tasks")[0]))
        # Another process, which never decoded these options, reads the task.
        tx._decode_options._by_blob.pop(reference, None)
        with pytest.raises(RuntimeError, match=f"task options '{reference.decode()}' have no row.*backup"):
            await _options_of(store, task_id)
    finally:
        await store.close()


async def test_a_task_written_before_schema_6_still_runs(tmp_path: Path) -> None:
    """A task row holding its options' JSON (as every row did before schema 6, and as PostgreSQL's
    do) is claimed, retried and completed as before. Catches: readers that only follow references."""
    attempts: list[int] = []

    async def flaky(ctx: Context, _: None) -> StepDecision:
        attempts.append(ctx.attempt)
        if ctx.attempt == 1:
            raise RuntimeError("first attempt fails")
        return StepDecision.force_complete()

    retry = RetryPolicy(max_attempts=3, initial_interval_seconds=0.01)
    flow = Flow("Old", [Step("Flaky", flaky, input_type=type(None), options=StepOptions(execute_retry=retry))],
                start_step="Flaky")
    url = f"sqlite:///{tmp_path / 'old.db'}"
    store = open_store(url)
    try:
        await store.start_flow(StartRequest("old", "Old", b"null", FlowConfig(), movement_record(
            flow, Movement("Flaky", None))))
        options = movement_record(flow, Movement("Flaky", None)).options
        await store.raw(lambda db: db.run("UPDATE tasks SET options = ? WHERE flow_id = 'old'",
                                          (encode_json(options),)), write=True)
        stored = await store.raw(lambda db: bytes(db.one("SELECT options FROM tasks")[0]))
        assert json.loads(stored) == msgspec.to_builtins(options)
        registry = Registry([flow])
        client = AsyncClient(registry, store=store)
        async with AsyncWorker(registry, dataclasses.replace(FAST, database_url=url), store=store):
            async def closed() -> bool:
                return (await client.describe_flow("old")).status != "running"
            await wait_until("the old task completed", closed)
        assert attempts == [1, 2]
        assert (await client.describe_flow("old")).status == "completed"
    finally:
        await store.close()


def test_the_digest_memo_keeps_what_it_saw_up_to_its_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """digest_of remembers the digests of the options it saw (a Step type's options repeat on every
    task), up to _DIGESTS_MAX of them, then starts over; a remembered digest is the one computed."""
    memo: dict[bytes, bytes] = {}
    monkeypatch.setattr(_task_options, "_digests", memo)
    bound = _task_options._DIGESTS_MAX
    first = [digest_of(b'{"n": %d}' % i) for i in range(bound)]
    assert len(memo) == bound  # every one kept, none dropped before the bound
    assert digest_of(b'{"n": 0}') == first[0] and len(memo) == bound  # a hit changes nothing
    assert digest_of(b'{"n": %d}' % bound) not in first
    assert list(memo) == [b'{"n": %d}' % bound]  # one past the bound: started over with it


class _Upserts:
    """The statements SharedOptions.reference runs, recording which digests it wrote."""

    def __init__(self) -> None:
        self.written: list[bytes] = []

    def all(self, sql: str, params: Sequence[Any] = ()) -> list[Any]:
        raise AssertionError(f"reference() reads nothing, got {sql!r}")

    def run(self, sql: str, params: Sequence[Any] = ()) -> int:
        assert sql.startswith("INSERT INTO task_options"), sql
        self.written.append(params[0])
        return 1


def test_a_store_remembers_committed_rows_up_to_its_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a committed transaction confirmed is named without a write until the confirmed rows would
    pass TASK_OPTIONS_CONFIRMED_ENTRIES; then the store starts over with those of the new commit."""
    monkeypatch.setattr(_task_options, "TASK_OPTIONS_CONFIRMED_ENTRIES", 3)
    options = [b'{"n": %d}' % n for n in range(4)]
    digests = [digest_of(o) for o in options]
    db, shared = _Upserts(), SharedOptions()
    for data in options[:2]:
        assert shared.reference(db, data, T0) == b"#" + digest_of(data)
    shared.committed()
    shared.reference(db, options[2], T0 + 1)
    shared.committed()  # three rows: at the bound, none forgotten
    assert shared.confirmed == {digests[0]: T0, digests[1]: T0, digests[2]: T0 + 1}
    for data in options[:3]:
        shared.reference(db, data, T0 + 2)
    assert db.written == digests[:3]  # named, not written again
    shared.reference(db, options[3], T0 + 2)
    shared.committed()  # a fourth would pass the bound: only the new commit's row is kept
    assert shared.confirmed == {digests[3]: T0 + 2} and shared.pending == {}


def test_a_rolled_back_transaction_confirms_nothing() -> None:
    db, shared = _Upserts(), SharedOptions()
    shared.reference(db, b'{"n": 0}', T0)
    shared.rolled_back()
    shared.committed()
    assert shared.confirmed == {}
    shared.reference(db, b'{"n": 0}', T0)
    assert db.written == [digest_of(b'{"n": 0}')] * 2  # written again: the first write was undone


class _OptionRows:
    """task_options rows (digest -> used_at) and the digests tasks name, behind the statements
    SharedOptions.collect runs."""

    def __init__(self, used_at: dict[bytes, int], named: set[bytes]) -> None:
        self.used_at = used_at
        self.named = named

    def all(self, sql: str, params: Sequence[Any] = ()) -> list[Any]:
        if sql.startswith("SELECT digest FROM task_options WHERE used_at < ?"):
            return [(d,) for d, at in self.used_at.items() if at < params[0]]
        assert sql.startswith("SELECT DISTINCT options FROM tasks"), sql
        return [(b"#" + d,) for d in self.named]

    def run(self, sql: str, params: Sequence[Any] = ()) -> int:
        if sql.startswith("DELETE FROM task_options WHERE digest IN"):
            for digest in params:
                del self.used_at[digest]
        else:
            assert sql.startswith("UPDATE task_options SET used_at = ? WHERE digest IN"), sql
            for digest in params[1:]:
                self.used_at[digest] = params[0]
        return len(params)


def test_a_store_collects_at_most_once_per_collect_interval() -> None:
    """Housekeeping runs often; the rows' scan runs once per TASK_OPTIONS_COLLECT_MS per store."""
    stale_at = T0 + TASK_OPTIONS_KEEP_MS + 1  # T0's rows are stale from here
    rows, shared = _OptionRows({b"a": T0}, set()), SharedOptions()
    shared.collect(rows, stale_at)
    assert rows.used_at == {}
    rows.used_at[b"b"] = T0
    shared.collect(rows, stale_at + TASK_OPTIONS_COLLECT_MS - 1)
    assert rows.used_at == {b"b": T0}  # not yet: the last scan was too recent
    shared.collect(rows, stale_at + TASK_OPTIONS_COLLECT_MS)
    assert rows.used_at == {}


def test_collect_deletes_and_keeps_every_row_past_one_statements_worth(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stale rows are deleted (unnamed) or stamped used (named) ROWS_PER_STATEMENT at a time, with
    none lost at a part's edge (here 2 a statement, for 5 and 3 rows)."""
    monkeypatch.setattr(_task_options, "ROWS_PER_STATEMENT", 2)
    named = {b"n%d" % i for i in range(3)}
    rows = _OptionRows({**{b"u%d" % i: T0 for i in range(5)}, **dict.fromkeys(named, T0)}, named)
    now = T0 + TASK_OPTIONS_KEEP_MS + 1
    SharedOptions().collect(rows, now)
    assert rows.used_at == dict.fromkeys(named, now)


def test_a_confirmation_stamped_later_than_now_is_not_taken_as_recent() -> None:
    """A row confirmed at a time past `now` (the clock was set back since) is written again: that
    stamp tells nothing of how recently the row was confirmed."""
    db, shared = _Upserts(), SharedOptions()
    shared.reference(db, b'{"n": 0}', T0)
    shared.committed()
    shared.reference(db, b'{"n": 0}', T0 - 1)
    assert db.written == [digest_of(b'{"n": 0}')] * 2
