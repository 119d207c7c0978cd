"""Group commit of the SQLite store: operations queued together share one transaction, and one
that fails rolls back alone (E1 for each operation of a batch)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from dex_engine import FlowConfig, open_store
from dex_engine import _transitions as tx
from dex_engine._records import StartRequest

from .conftest import run_as_one_batch


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
    and the flow's version moves so RPC validation sees the change."""
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
        version_after = await store.raw(lambda db: db.one("SELECT version FROM flows WHERE flow_id = 'f'"))
        assert version_after[0] > version_before[0]
    finally:
        await store.close()
