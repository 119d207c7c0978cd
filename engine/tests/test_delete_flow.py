"""Deleting closed flows (AsyncClient.delete_flow, E12) and retention (WorkerOptions.closed_flow_retention_seconds).

Each test runs real flows on both backends and looks at every table that has a flow_id column (from
the database's own catalogue, so a table added later is checked too): a deleted flow leaves no row.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest

import dex_engine._transitions as transitions
from dex_engine import (
    Attribute,
    AttributeMap,
    Channel,
    Client,
    Context,
    Flow,
    FlowNotFoundError,
    FlowStillRunningError,
    Registry,
    Step,
    StepDecision,
    Stream,
    Wait,
    WorkerOptions,
)
from dex_engine._gates import INSIDE_DELETE
from dex_engine._limits import MAX_RETENTION_SECONDS
from dex_engine._store import Store, now_ms

from .conftest import Engine, engine_for, wait_until

Note = Attribute("Note", str)
Tags = AttributeMap("Tags", str)
Inbox = Channel("Inbox", str)
Aside = Channel("Aside", str)  # never waited for: its messages stay queued until the flow is deleted
Log = Stream("Log", str)


async def fill(ctx: Context, text: str) -> StepDecision:
    ctx.set(Note, text)
    ctx.set(Tags["a"], text)
    ctx.write_event(Log, f"filled {text}")
    return StepDecision.go_to("Listen", None)


async def listen_wait(ctx: Context, _: None) -> Wait:
    return Wait.until(Inbox.for_one())


async def listen(ctx: Context, _: None) -> StepDecision:
    assert ctx.wait_result is not None
    (msg,) = ctx.wait_result.messages(Inbox)
    ctx.write_event(Log, f"got {msg}")
    if msg == "fail":
        return StepDecision.force_fail("asked to fail")
    return StepDecision.force_complete(msg)


KEEPER = Flow(
    "Keeper",
    [Step("Fill", fill, input_type=str), Step("Listen", listen, wait_for=listen_wait, input_type=type(None))],
    start_step="Fill",
    schema=[Note, Tags, Inbox, Aside, Log],
)
REGISTRY = Registry([KEEPER])


async def flow_tables(store: Store) -> list[str]:
    """Every table (and view) of the database with a flow_id column."""
    if store.url.startswith("sqlite"):
        sql = ("SELECT DISTINCT m.name FROM sqlite_master m, pragma_table_info(m.name) p "
               "WHERE p.name = 'flow_id' AND m.type IN ('table', 'view') ORDER BY m.name")
    else:
        sql = ("SELECT DISTINCT table_name FROM information_schema.columns "
               "WHERE column_name = 'flow_id' AND table_schema = current_schema() ORDER BY table_name")
    return [str(r[0]) for r in await store.raw(lambda db: db.all(sql))]


async def rows_of(store: Store, flow_id: str) -> dict[str, int]:
    """Rows of `flow_id` in each table that has a flow_id column."""
    counts = {}
    for table in await flow_tables(store):
        row = await store.raw(lambda db, t=table: db.one(f"SELECT COUNT(*) FROM {t} WHERE flow_id = ?", (flow_id,)))
        counts[table] = int(row[0])
    return counts


async def listening(eng: Engine, flow_id: str) -> None:
    async def probe() -> bool:
        info = await eng.client.describe_flow(flow_id)
        return any(s.step_type == "Listen" and s.state == "waiting" for s in info.active_steps)

    await wait_until(f"{flow_id} listening", probe)


async def closed_flow(eng: Engine, flow_id: str, status: str) -> None:
    """A flow of each kind of row (attribute, map instance, queued message, stream events, history)
    closed with `status`."""
    await eng.client.start_flow("Keeper", flow_id, "hello")
    await listening(eng, flow_id)
    await eng.client.publish(flow_id, Aside, "left queued")
    if status == "stopped":
        await eng.client.stop_flow(flow_id, "done with it")
    else:
        await eng.client.publish(flow_id, Inbox, "fail" if status == "failed" else "bye")
    assert (await eng.client.wait_for_flow(flow_id, 10)).status == status


async def assert_unknown(eng: Engine, flow_id: str) -> None:
    """The flow ID reads as unknown to every read of the client."""
    assert not await eng.client.exists(flow_id)
    for read in (eng.client.describe_flow(flow_id), eng.client.get_attribute(flow_id, Note),
                 eng.client.get_attribute_map(flow_id, Tags), eng.client.read_stream(flow_id, Log),
                 eng.client.get_flow_history(flow_id)):
        with pytest.raises(FlowNotFoundError, match=repr(flow_id)):
            await read
    for query in ('FlowType = "Keeper"', 'FlowStatus = "completed"', 'FlowStatus = "failed"',
                  'FlowStatus = "stopped"'):
        assert flow_id not in await eng.client.search_flows(query)
    assert flow_id not in [info.flow_id for info in await eng.store.list_flows()]


@pytest.mark.parametrize("status", ["completed", "failed", "stopped"])
async def test_delete_flow_removes_a_closed_flow_and_every_row_of_it(db_url: str, status: str) -> None:
    """E12: a closed flow of each status is deleted whole, in every table; another flow is untouched."""
    async with engine_for(db_url, REGISTRY) as eng:
        await closed_flow(eng, "gone", status)
        await closed_flow(eng, "kept", status)
        before = await rows_of(eng.store, "gone")
        kept = await rows_of(eng.store, "kept")
        # Every kind of row was there to delete (SQLite keeps history in batches, PostgreSQL per event).
        history = "history" if "history_batches" not in before else "history_batches"
        for table in ("flows", "attributes", "channel_messages", "stream_events", history):
            assert before[table] > 0, (table, before)

        assert await eng.client.delete_flow("gone") is True

        assert await rows_of(eng.store, "gone") == dict.fromkeys(before, 0)
        await assert_unknown(eng, "gone")
        assert await rows_of(eng.store, "kept") == kept
        assert await eng.client.get_attribute("kept", Note) == "hello"
        assert (await eng.client.read_stream("kept", Log)).events[0].value == "filled hello"
        assert await eng.client.delete_flow("gone") is False  # deleted already: unknown


async def test_delete_flow_refuses_a_running_flow_and_leaves_it_whole(db_url: str) -> None:
    """A running flow is not deleted: the error names it and says to stop it first; it runs on."""
    async with engine_for(db_url, REGISTRY) as eng:
        await eng.client.start_flow("Keeper", "busy", "hello")
        await listening(eng, "busy")
        before = await rows_of(eng.store, "busy")
        with pytest.raises(FlowStillRunningError) as caught:
            await eng.client.delete_flow("busy")
        assert str(caught.value) == (
            "flow 'busy' is still running; stop it first (stop_flow), then delete it (nothing was deleted)")
        assert await rows_of(eng.store, "busy") == before
        await eng.client.publish("busy", Inbox, "bye")
        info = await eng.client.wait_for_flow("busy", 10)
        assert (info.status, await eng.client.flow_output("busy")) == ("completed", "bye")


async def test_delete_flow_of_an_unknown_flow_returns_false(db_url: str) -> None:
    async with engine_for(db_url, REGISTRY, worker=False) as eng:
        assert await eng.client.delete_flow("never-started") is False
        assert await eng.client.delete_flow("bad\nid") is False  # no flow has such an ID


async def test_a_deleted_flow_id_starts_again_as_a_new_flow(db_url: str) -> None:
    """After delete_flow, start_flow takes the ID again: a new flow, with nothing of the old one."""
    async with engine_for(db_url, REGISTRY) as eng:
        await closed_flow(eng, "again", "completed")
        assert await eng.client.delete_flow("again")
        await eng.client.start_flow("Keeper", "again", "second life")
        await listening(eng, "again")
        assert await eng.client.get_attribute("again", Note) == "second life"
        events = (await eng.client.read_stream("again", Log)).events
        assert [(e.sequence, e.value) for e in events] == [(1, "filled second life")]
        history = await eng.client.get_flow_history("again")
        assert [h.event_type for h in history][:2] == ["step_scheduled", "execute_completed"], history
        assert not any(h.event_type == "flow_closed" for h in history)
        # Its queue starts empty: the old flow's queued message is gone.
        rows = await eng.store.raw(lambda db: db.all("SELECT channel FROM channel_messages WHERE flow_id = ?",
                                                     ("again",)))
        assert rows == []
        await eng.client.publish("again", Inbox, "fail")
        assert (await eng.client.wait_for_flow("again", 10)).status == "failed"


def test_blocking_client_delete_flow(db_url: str) -> None:
    async def prepare() -> None:
        async with engine_for(db_url, REGISTRY) as eng:
            await closed_flow(eng, "sync", "stopped")

    asyncio.run(prepare())
    with Client(REGISTRY, db_url) as client:
        assert client.delete_flow("sync") is True
        assert client.delete_flow("sync") is False
        with pytest.raises(FlowNotFoundError):
            client.describe_flow("sync")


_DELETE_CHILD = textwrap.dedent("""
    import asyncio, sys
    from dex_engine import open_store

    async def main() -> None:
        store = open_store(sys.argv[1])
        await store.delete_flow(sys.argv[2])
        print("deleted")  # not reached: the gate kills the process inside the transaction

    asyncio.run(main())
""")


async def test_a_kill_inside_delete_flow_leaves_the_flow_whole(db_url: str, tmp_path: Any) -> None:
    """A process killed inside delete_flow's transaction, every row deleted but not committed,
    leaves the flow whole and readable; deleting it again then works."""
    async with engine_for(db_url, REGISTRY) as eng:
        await closed_flow(eng, "whole", "completed")
        before = await rows_of(eng.store, "whole")
        gate_log = tmp_path / "gates.log"
        env = {**os.environ, "DEX_ENGINE_CRASH_AT": f"{INSIDE_DELETE}:1", "DEX_ENGINE_GATE_LOG": str(gate_log)}
        child = await asyncio.to_thread(subprocess.run, [sys.executable, "-c", _DELETE_CHILD, db_url, "whole"],
                                        env=env, capture_output=True, text=True, timeout=60)
        assert child.returncode == -9, (child.returncode, child.stdout, child.stderr)
        assert gate_log.read_text().split()[1:] == [INSIDE_DELETE]
        assert await rows_of(eng.store, "whole") == before
        assert await eng.client.get_attribute("whole", Note) == "hello"
        assert (await eng.client.describe_flow("whole")).status == "completed"
        assert await eng.client.delete_flow("whole")
        assert await rows_of(eng.store, "whole") == dict.fromkeys(before, 0)


# Retention ---------------------------------------------------------------------------------------

DAY_MS = 24 * 3600 * 1000


async def close_days_ago(store: Store, flow_id: str, days: float) -> None:
    when = now_ms() - int(days * DAY_MS)
    await store.raw(lambda db: db.run("UPDATE flows SET closed_at = ? WHERE flow_id = ?", (when, flow_id)), write=True)


async def test_retention_deletes_only_flows_closed_longer_ago(db_url: str) -> None:
    """A worker with closed_flow_retention_seconds deletes the flows closed longer ago than that, and
    only those: not one closed more recently, nor a running one (however old)."""
    async with engine_for(db_url, REGISTRY) as eng:
        for flow_id, status in [("old-done", "completed"), ("old-failed", "failed"), ("old-stopped", "stopped"),
                                ("recent", "completed")]:
            await closed_flow(eng, flow_id, status)
        for flow_id in ("old-done", "old-failed", "old-stopped"):
            await close_days_ago(eng.store, flow_id, 31)
        await close_days_ago(eng.store, "recent", 29)
        await eng.client.start_flow("Keeper", "running", "hello")
        await listening(eng, "running")
        await eng.store.raw(lambda db: db.run("UPDATE flows SET created_at = ? WHERE flow_id = 'running'",
                                              (now_ms() - 400 * DAY_MS,)), write=True)
        assert eng.worker is not None
        await eng.worker.stop()
        await eng.start_worker(closed_flow_retention_seconds=30 * 24 * 3600)

        async def deleted() -> bool:
            return not any([await eng.client.exists(f) for f in ("old-done", "old-failed", "old-stopped")])

        await wait_until("the flows closed 31 days ago deleted", deleted)
        for flow_id in ("old-done", "old-failed", "old-stopped"):
            assert set((await rows_of(eng.store, flow_id)).values()) == {0}
        assert (await eng.client.describe_flow("recent")).status == "completed"
        assert await eng.client.get_attribute("recent", Note) == "hello"
        await eng.client.publish("running", Inbox, "bye")
        assert (await eng.client.wait_for_flow("running", 10)).status == "completed"


async def test_retention_deletes_a_bounded_number_per_pass_oldest_first(
    db_url: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One housekeeping pass deletes at most CLOSED_FLOWS_DELETED_PER_HOUSEKEEPING flows, the
    longest closed first, and says whether more are due: not when it deleted exactly the last ones."""
    monkeypatch.setattr(transitions, "CLOSED_FLOWS_DELETED_PER_HOUSEKEEPING", 2)
    async with engine_for(db_url, REGISTRY) as eng:
        for n in range(7):
            await closed_flow(eng, f"f{n}", "completed")
            await close_days_ago(eng.store, f"f{n}", 10 - n if n < 5 else 1)  # f0 closed longest ago; f5, f6 recently
        assert eng.worker is not None
        await eng.worker.stop()
        eng.worker = None
        retention_ms = 5 * DAY_MS

        async def one_pass() -> tuple[int, bool, list[str]]:
            report = await eng.store.raw(lambda db: transitions.housekeeping(db, now_ms(), retention_ms=retention_ms),
                                         write=True)
            left = [f"f{n}" for n in range(7) if await eng.client.exists(f"f{n}")]
            return report.flows_deleted, report.flows_left, left

        assert await one_pass() == (2, True, ["f2", "f3", "f4", "f5", "f6"])
        assert await one_pass() == (2, True, ["f4", "f5", "f6"])
        assert await one_pass() == (1, False, ["f5", "f6"])
        assert await one_pass() == (0, False, ["f5", "f6"])
        # Exactly as many due as a pass deletes: none left after it.
        for n in (5, 6):
            await close_days_ago(eng.store, f"f{n}", 10)
        assert await one_pass() == (2, False, [])


async def test_a_worker_drains_a_retention_backlog_without_waiting_a_housekeeping_interval_a_pass(
    db_url: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A backlog larger than one pass (retention turned on for an old database) is deleted in passes
    a fraction of a second apart. Catches a worker that waited its whole housekeeping interval (a
    minute here) between passes, so that a backlog of millions took weeks."""
    monkeypatch.setattr(transitions, "CLOSED_FLOWS_DELETED_PER_HOUSEKEEPING", 2)
    async with engine_for(db_url, REGISTRY) as eng:
        for n in range(7):
            await closed_flow(eng, f"f{n}", "completed")
            await close_days_ago(eng.store, f"f{n}", 10)
        assert eng.worker is not None
        await eng.worker.stop()
        await eng.start_worker(closed_flow_retention_seconds=5 * 24 * 3600, housekeeping_seconds=60.0)

        async def all_deleted() -> bool:
            return not any([await eng.client.exists(f"f{n}") for n in range(7)])

        # Four passes: the first at the worker's start, the others only if it does not wait a minute.
        await wait_until("the backlog of 7 closed flows deleted 2 a pass", all_deleted, timeout=20)


async def test_retention_finds_due_flows_through_an_index(db_url: str) -> None:
    """The pass's search for due flows reads the closed-flows index, not every flow."""
    async with engine_for(db_url, REGISTRY, worker=False) as eng:
        sql = ("SELECT flow_id FROM flows WHERE closed_at IS NOT NULL AND closed_at < ? ORDER BY closed_at "
               "LIMIT ?")

        def plan(db: Any) -> str:
            if eng.store.url.startswith("sqlite"):
                return " ".join(str(r[-1]) for r in db.all("EXPLAIN QUERY PLAN " + sql, (1, 2)))
            db.run("SET LOCAL enable_seqscan = off")  # a tiny table is scanned anyway otherwise
            return " ".join(str(r[0]) for r in db.all("EXPLAIN " + sql, (1, 2)))

        shown = await eng.store.raw(plan, write=True)
        assert "flows_closed" in shown, shown
        assert "SCAN flows" not in shown and "Seq Scan" not in shown and "TEMP B-TREE" not in shown, shown


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), MAX_RETENTION_SECONDS + 1, "30", True])
def test_retention_option_is_validated(bad: object) -> None:
    with pytest.raises(ValueError, match=r"closed_flow_retention_seconds must be None \(keep closed flows for "
                                         r"ever\) or a number of seconds > 0") as caught:
        WorkerOptions(closed_flow_retention_seconds=bad)  # type: ignore[arg-type]
    assert repr(bad) in str(caught.value)


def test_retention_is_off_by_default() -> None:
    assert WorkerOptions().closed_flow_retention_seconds is None
    assert WorkerOptions(closed_flow_retention_seconds=30 * 24 * 3600.0).closed_flow_retention_seconds == 2592000.0
