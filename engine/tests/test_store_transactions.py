"""What kind of transaction each Store operation runs as, on SQLite (docs/engine.md "Durability modes").

A write must take the write lock up front and be fsynced before it is acknowledged, even right
after a commit that skipped the fsync; only the writes documented as best effort (lease renewals,
best-effort stream events, a worker's poll) skip it. A read must never wait for another
connection's write lock: WAL readers do not block on the writer.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from dex_engine import FlowConfig, Store, open_store
from dex_engine import _sqlite_store as sqlite_store
from dex_engine._options import LoadSpec
from dex_engine._records import ErrorInfo, Lease, RpcOutcome, WriteSet
from dex_engine._sqlite_store import SqliteStore
from dex_engine._transitions import Db
from dex_engine._wait import ConditionSpec, WaitSpec

from .conftest import wait_until
from .test_durability import record_operation_levels, sync_level
from .test_store_contract import DEAD_END, HOUR_MS, TYPES, W, claim_one, enc, start


@pytest.fixture
async def store(tmp_path: Any) -> AsyncIterator[Store]:
    s = open_store(f"sqlite:///{tmp_path / 'tx.db'}")
    try:
        await s.register_worker(W, "tx-host", 1, HOUR_MS)
        yield s
    finally:
        await s.close()


async def test_each_write_is_fsynced_unless_documented_best_effort(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each operation runs after a lease renewal (a commit without fsync, which leaves the
    connection at NORMAL): the durable ones must switch back to FULL before they commit."""
    ran = record_operation_levels(monkeypatch)
    seen: dict[str, str] = {}

    async def level(name: str, call: Callable[[], Awaitable[Any]]) -> Any:
        await store.renew_worker(W, HOUR_MS)
        assert ran[-1][1] == "NORMAL"
        ran.clear()
        result = await call()
        assert len(ran) == 1, f"{name} ran {len(ran)} transactions: {ran}"
        seen[name] = ran[0][1]
        return result

    await level("start_flow", lambda: start(store, "f1"))
    await level("update_flow_config", lambda: store.update_flow_config("f1", FlowConfig()))
    lease: Lease = await level("claim", lambda: claim_one(store))
    await level("heartbeat", lambda: store.heartbeat(lease, "half way"))
    await level("append_best_effort", lambda: store.append_best_effort(lease, "Out", 1000, [enc("e")]))
    await level("fail_attempt", lambda: store.fail_attempt(lease, ErrorInfo("ValueError", "retry")))
    retry = await claim_one(store)
    await level("release_unstarted", lambda: store.release_unstarted(retry))
    again = await claim_one(store)
    await store.heartbeat(again, None)
    await level("abandon", lambda: store.abandon(again))
    await level("housekeeping", store.housekeeping)
    started = await claim_one(store)
    await level("commit_execute", lambda: store.commit_execute(started, WriteSet(), DEAD_END))
    await start(store, "f4", "Listen")
    sleeping = await claim_one(store)
    await store.commit_wait_for(sleeping, WriteSet(), WaitSpec("any", (ConditionSpec("timer", seconds=3600),)))
    await level("skip_timer", lambda: store.skip_timer("f4", sleeping.step_execution_id))
    await claim_one(store)  # the Execute skip_timer readied
    await start(store, "f2", "Listen")
    listening = await claim_one(store)
    await level("commit_wait_for", lambda: store.commit_wait_for(listening, WriteSet(), WaitSpec("skip")))
    await start(store, "f3")
    running = (await store.describe_flow("f3")).active_steps[0].step_execution_id
    await level("rpc_commit (cancelling)", lambda: store.rpc_commit("f3", None, [], WriteSet(), [], [running]))
    locked = RpcOutcome(None, WriteSet(attributes={("Count", ""): enc(1)}), [], (), None)
    await level("rpc_locked", lambda: store.rpc_locked("f3", LoadSpec(), [], lambda snap, load: locked))
    await level("poll", lambda: store.poll(W, TYPES, 1, [], must_claim=True, housekeep=False))
    await level("register_worker", lambda: store.register_worker("w2", "tx-host", 2, HOUR_MS))
    await level("unregister_worker", lambda: store.unregister_worker("w2"))
    await level("renew_worker", lambda: store.renew_worker(W, HOUR_MS))

    best_effort = {"append_best_effort", "poll", "renew_worker"}
    assert seen == {name: "NORMAL" if name in best_effort else "FULL" for name in seen}


async def test_a_durable_write_sharing_a_group_commit_with_a_best_effort_one_is_fsynced(store: Store) -> None:
    """A durable write and one that may skip the fsync (a lease renewal) queued together commit in
    one batch: that commit must be fsynced (FULL), or the durable write is acknowledged without it.
    Catches: the level chosen from any non-durable write of the batch instead of all of them."""
    assert isinstance(store, SqliteStore)
    conn_lock: threading.Lock = store._conn_lock
    seen: dict[str, str] = {}

    def level(name: str) -> Callable[[Db], None]:
        def op(db: Db) -> None:
            seen[name] = sync_level(db)
        return op

    conn_lock.acquire()
    try:
        # The thread takes this one and waits for the connection; the two behind it queue up.
        first = asyncio.ensure_future(asyncio.to_thread(store.run_sync, level("first"), write=True))

        async def taken() -> bool:
            return store._outstanding == 1 and store._queue.empty()

        await wait_until("the store's thread to take the first write", taken)
        durable = asyncio.ensure_future(store._run(level("durable"), write=True))
        best_effort = asyncio.ensure_future(store._run(level("best effort"), write=True, durable=False))

        async def queued() -> bool:
            return store._outstanding == 3

        await wait_until("both writes to queue behind it", queued)
    finally:
        conn_lock.release()
    await asyncio.gather(first, durable, best_effort)
    assert seen == {"first": "FULL", "durable": "FULL", "best effort": "FULL"}


async def test_reads_do_not_wait_for_another_connections_write_lock(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another connection (another process, the sqlite3 shell) holds the write lock while each
    read runs. A read run as a write would wait for the lock and, with the busy timeout cut
    short here, fail with "database is locked"."""
    await start(store, "f1")
    await store.heartbeat(await claim_one(store), None)
    monkeypatch.setattr(sqlite_store, "SQLITE_BUSY_TIMEOUT_MS", 50)
    reads: dict[str, Callable[[], Awaitable[Any]]] = {
        "flow_config": lambda: store.flow_config("f1"),
        "describe_flow": lambda: store.describe_flow("f1"),
        "search_flows": lambda: store.search_flows(flow_type="Contract"),
        "list_flows": store.list_flows,
        "history": lambda: store.history("f1"),
        "next_due": lambda: store.next_due(TYPES),
        "list_workers": store.list_workers,
        "rpc_read": lambda: store.rpc_read("f1", LoadSpec(), []),
        "read_attribute": lambda: store.read_attribute("f1", "Count", ""),
        "read_attribute_map": lambda: store.read_attribute_map("f1", "Count"),
        "read_all_attributes": lambda: store.read_all_attributes("f1"),
        "read_events": lambda: store.read_events("f1", "Out", 0, 10),
        "stream_names": lambda: store.stream_names("f1"),
        "newest_sequences": lambda: store.newest_sequences([("f1", "Out")]),
        "stream_secret": store.stream_secret,
        "poll (nothing to claim)": lambda: store.poll(W, TYPES, 1, [], must_claim=False, housekeep=False),
    }
    path = store.settings.path  # type: ignore[attr-defined]
    await reads["poll (nothing to claim)"]()  # takes note of the file's data version
    other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        for name, read in reads.items():
            other.execute("BEGIN IMMEDIATE")
            try:
                await read()
            except sqlite3.OperationalError as exc:
                pytest.fail(f"{name} waited for the write lock: {exc}")
            finally:
                other.execute("ROLLBACK")
    finally:
        other.close()
