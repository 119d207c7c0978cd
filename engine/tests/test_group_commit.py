"""Group commit of the SQLite store: operations queued together share one transaction, and one
that fails rolls back alone (E1 for each operation of a batch). The last test does the same for
PostgreSQL's lanes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dex_engine import Context, Flow, FlowConfig, Movement, Step, StepDecision, open_store
from dex_engine import _transitions as tx
from dex_engine._options import LoadOptions
from dex_engine._records import StartRequest, WriteSet
from dex_engine._scheduling import movement_record

from .conftest import history_fallbacks, run_as_one_batch, statements_during


async def test_a_failing_operation_in_a_batch_rolls_back_alone(tmp_path: Path) -> None:
    """Ops queued behind a slow one run as one batch; the failing one leaves no attribute and no
    history, the others commit. Breaks if a batch commits a failed op's writes, or fails them all."""
    store = open_store(f"sqlite:///{tmp_path / 'g.db'}")
    batches: list[int] = []
    original = store._run_batch  # type: ignore[attr-defined]

    def counting(conn, db, batch, level):  # type: ignore[no-untyped-def]
        batches.append(len(batch))
        return original(conn, db, batch, level)

    store._run_batch = counting  # type: ignore[attr-defined]
    try:
        for fid in ("a", "b", "c"):
            await store.start_flow(StartRequest(fid, "T", b"null", FlowConfig(), None))

        def write(flow_id: str) -> Callable[[tx.Db], None]:
            def op(db: tx.Db) -> None:
                db.run("INSERT INTO attributes (flow_id, name, key, value) VALUES (?, 'A', '', x'31')", (flow_id,))
                tx._history(db, flow_id, "S", "S-1", "marker", 1, 0, "")
            return op

        def failing(db: tx.Db) -> None:
            write("b")(db)
            raise RuntimeError("op b fails after writing")

        results = await run_as_one_batch(store, [write("a"), failing, write("c")])
        assert results[0] is None and results[2] is None
        assert isinstance(results[1], RuntimeError)
        assert 3 in batches, f"the three ops did not share a batch: {batches}"
        for fid, present in (("a", True), ("b", False), ("c", True)):
            assert (await store.read_attribute(fid, "A", "")) == (b"1" if present else None)
            events = [h.event_type for h in await store.history(fid)]
            assert ("marker" in events) is present, (fid, events)
    finally:
        await store.close()


async def test_batch_history_rows_get_consecutive_sequences(tmp_path: Path) -> None:
    """Several history events of one operation are written in order with consecutive sequences,
    and the flow's version moves so RPC validation sees the change; a read of fewer of the newest
    events than the batch holds gets exactly those."""
    store = open_store(f"sqlite:///{tmp_path / 'h.db'}")
    try:
        await store.start_flow(StartRequest("f", "T", b"null", FlowConfig(), None))
        version_before = await store.raw(lambda db: db.one("SELECT version FROM flows WHERE flow_id = 'f'"))

        def three(db: tx.Db) -> None:
            for i in range(3):
                tx._history(db, "f", "S", f"S-{i}", f"e{i}", i, 0, "")

        await store.raw(three, write=True)
        seqs = await store.raw(
            lambda db: db.all("SELECT seq, event_type FROM history WHERE flow_id = 'f' ORDER BY seq"))
        assert [e for _, e in seqs] == ["e0", "e1", "e2"]
        assert [s for s, _ in seqs] == [1, 2, 3]
        # The newest two of them: part of the one batch they share.
        assert [h.event_type for h in await store.history("f", 2)] == ["e1", "e2"]
        version_after = await store.raw(lambda db: db.one("SELECT version FROM flows WHERE flow_id = 'f'"))
        assert version_after[0] > version_before[0]
    finally:
        await store.close()


async def _dead_end(ctx: Context, _: Any) -> StepDecision:
    return StepDecision.dead_end()


STEPPED = Flow("T", [Step("S", _dead_end)], start_step="S")


@pytest.mark.parametrize("second", ["after_a_rollback", "from_another_store"])
async def test_an_operations_notes_of_a_flow_row_end_with_it(tmp_path: Path, second: str) -> None:
    """What an SQLite operation noted from a flow row (Step counters, stream positions, sequence and
    version, known attribute rows) serves that operation only: the next one reads the row again, so
    neither a rolled-back operation's numbers nor a row another store (process) has moved since
    leak into it, and its history takes the one checked update, not the fallback; an operation on
    another flow is not handed the notes either. Catches: a note kept past its operation (a Step
    execution ID or stream sequence used twice or skipped, a stale attribute read, a flow written
    with counters it no longer holds), or an operation's rows never handed to the store's cache."""
    path = f"sqlite:///{tmp_path / 'notes.db'}"
    store, other = open_store(path), open_store(path)
    try:
        await store.start_flow(StartRequest("f", "T", b"null", FlowConfig(), None))

        def step_and_event(tag: str, fail: bool = False) -> Callable[[tx.Db], tuple[str, list[str]]]:
            def op(db: tx.Db) -> tuple[str, list[str]]:
                tx.require_running(db, "f")
                seen = sorted(key for _name, key in tx.load_attributes(db, "f", LoadOptions.all()))
                task_id = tx.create_task(db, "f", "T", movement_record(STEPPED, Movement("S")), 0)
                writes = WriteSet(attributes={("A", tag): b"1"}, appends=[("Out", 1 << 20, f'"{tag}"'.encode())])
                tx.apply_writes(db, "f", writes, tag, 1, 0)
                tx._history(db, "f", "S", tag, "marker", 1, 0, tag)
                if fail:
                    raise RuntimeError(f"{tag} fails after its writes")
                row = db.one("SELECT step_execution_id FROM tasks WHERE task_id = ?", (task_id,))
                assert row is not None
                return str(row[0]), seen

            return op

        assert await store.raw(step_and_event("one"), write=True) == ("S-1", [])
        if second == "after_a_rollback":
            with pytest.raises(RuntimeError):
                await store.raw(step_and_event("lost", fail=True), write=True)
            tags = ["one", "three"]
        else:
            assert await other.raw(step_and_event("two"), write=True) == ("S-2", ["one"])
            tags = ["one", "two", "three"]
        result: list[tuple[str, list[str]]] = []

        async def last() -> None:
            result.append(await store.raw(step_and_event("three"), write=True))

        statements = await statements_during(store, last)
        assert result == [(f"S-{len(tags)}", sorted(tags[:-1]))]
        assert history_fallbacks(statements) == [], statements
        # The Step counters and stream positions come with the flow row the operation read first.
        assert not [s for s in statements if s.startswith(("SELECT streams", "SELECT step_counters"))], statements
        # The attribute rows come from the store's cache, which the first operation filled, unless
        # another store has changed the flow since.
        reads = [s for s in statements if "FROM attributes" in s]
        assert bool(reads) is (second == "from_another_store"), statements
        await store.start_flow(StartRequest("g", "T", b"null", FlowConfig(), None))

        page = await store.read_events("f", "Out", 0, 10)
        assert [(e.sequence, e.value) for e in page.events] == [
            (n, f'"{tag}"'.encode()) for n, tag in enumerate(tags, start=1)]
        assert await store.read_attribute_map("f", "A") == dict.fromkeys(tags, b"1")
        markers = [h.detail for h in await store.history("f") if h.event_type == "marker"]
        assert markers == tags
    finally:
        await store.close()
        await other.close()


async def test_a_database_error_fails_only_its_operation_on_postgresql(pg_database: str) -> None:
    """On PostgreSQL, an operation the server refuses (here a statement naming no such column) raises
    the server's error, alone or queued with others: the others commit, and the lanes go on
    serving. Catches: an error pinned on the wrong operation, every operation of its batch failed
    with it, or one operation tried again without end (a RecursionError in its place)."""
    import psycopg

    store = open_store(pg_database)
    try:
        for fid in ("a", "c"):
            await store.start_flow(StartRequest(fid, "T", b"null", FlowConfig(), None))

        def write(flow_id: str) -> Callable[[tx.Db], None]:
            def op(db: tx.Db) -> None:
                db.run("INSERT INTO attributes (flow_id, name, key, value) VALUES (?, 'A', '', ?)", (flow_id, b"1"))
            return op

        def refused(db: tx.Db) -> None:
            db.run("UPDATE flows SET no_such_column = 1 WHERE flow_id = 'a'")

        with pytest.raises(psycopg.errors.UndefinedColumn):
            await store.raw(refused, write=True)
        results = await asyncio.gather(*(store.raw(op, write=True) for op in (write("a"), refused, write("c"))),
                                       return_exceptions=True)
        assert results[0] is None and results[2] is None, results
        assert isinstance(results[1], psycopg.errors.UndefinedColumn), results
        for fid in ("a", "c"):
            assert await store.read_attribute(fid, "A", "") == b"1"
    finally:
        await store.close()


async def test_rows_an_operation_left_in_a_batch_run_again_without_it_are_not_kept(tmp_path: Path) -> None:
    """A batch that fails runs again op by op, and an operation that went through in the first run
    may fail in the second (another process revoked its lease in between). The rows it left known in
    the rolled-back first run must not reach the store's cache: another process's commit brings the
    flow to the version they were kept at, and the store would read a value that never committed.
    Catches the first run's cache writes left for the second run's commit."""
    path = f"sqlite:///{tmp_path / 'rerun.db'}"
    store, other = open_store(path), open_store(path)
    try:
        await store.start_flow(StartRequest("f", "T", b"null", FlowConfig(), None))
        runs: list[int] = []

        def set_a(value: bytes) -> Callable[[tx.Db], None]:
            def op(db: tx.Db) -> None:
                tx.require_running(db, "f")
                tx.load_attributes(db, "f", LoadOptions.all())  # the operation now knows the flow's rows
                tx.apply_writes(db, "f", WriteSet(attributes={("A", ""): value}), "", 0, 0)
                tx.bump(db, "f")
            return op

        def first_run_only(db: tx.Db) -> None:
            runs.append(len(runs))
            if len(runs) > 1:
                raise RuntimeError("fails when its batch runs again")
            set_a(b"never committed")(db)

        def failing(_db: tx.Db) -> None:
            raise RuntimeError("fails the batch's first run")

        results = await run_as_one_batch(store, [first_run_only, failing])
        assert [type(r) for r in results] == [RuntimeError, RuntimeError] and len(runs) == 2, results
        await other.raw(set_a(b"committed"), write=True)
        assert await store.read_attribute("f", "A", "") == b"committed"
    finally:
        await store.close()
        await other.close()
