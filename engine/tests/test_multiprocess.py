"""Two worker processes on one database: no lost and no repeated commit, and a sound database.

On SQLite the processes share one file; on PostgreSQL each has its own connection pool and LISTEN
connection, and claims race on `FOR UPDATE SKIP LOCKED`.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path

import pytest

from .conftest import engine_for
from .proc_harness import ProcSet, database_check, eventually, is_sqlite
from .worker_child import COUNTER_STEPS, REGISTRY, Count

pytestmark = pytest.mark.slow

# Flows per backend. A PostgreSQL Step costs several times a SQLite one on this machine (each commit
# waits for the server's WAL flush, and commits that NOTIFY take turns): 200 flows, 2,000 Steps,
# keep it within the time budget and still keep both processes claiming side by side throughout.
FLOWS = {"sqlite": 1000, "postgres": 200}


async def test_two_worker_processes_complete_every_flow_exactly_once(db_url: str, tmp_path: Path) -> None:
    """Counter flows of 10 Steps each (1,000 on SQLite, 200 on PostgreSQL), run by two worker processes at once.

    Every flow completes with Count 10; history shows each Step execution Inc-1..Inc-10 committed
    exactly once (no lost, no repeated commit); the invocation log shows each handler ran once and
    that both processes did work. Once the workers have stopped the database is sound: SQLite's
    `PRAGMA integrity_check`; on PostgreSQL amcheck on every index, and no task, lease, lock or
    worker registration left over, every history a gapless sequence (`pg_integrity_check`).
    """
    flows = FLOWS["sqlite" if is_sqlite(db_url) else "postgres"]
    async with engine_for(db_url, REGISTRY, worker=False) as eng:
        with ProcSet(db_url, tmp_path / "state") as procs:
            # No crash here: long leases so that a slow moment on a busy machine is not taken for a
            # dead worker (which would legitimately re-run a Step), no gate log, no fsync of the log.
            workers = [
                procs.start(f"w{i}", lease_ttl=30.0, lease_renew=1.0, housekeeping=1.0, gate_log=False,
                            log_fsync=False)
                for i in (1, 2)
            ]

            async def both_registered() -> bool:
                pids = {row[2] for row in await eng.store.list_workers()}
                return {w.pid for w in workers} <= pids

            await eventually("both workers to register", both_registered, 60.0)
            started = time.monotonic()
            flow_ids = [f"c{i:04d}" for i in range(flows)]
            await asyncio.gather(*(eng.client.start_flow("Counter", fid, 1) for fid in flow_ids))

            async def all_closed() -> bool:
                return not await eng.store.search_flows(flow_type="Counter", status="running", limit=1)

            await eventually("every flow to close", all_closed, 240.0, 0.1)
            elapsed = time.monotonic() - started
            for w in workers:
                await w.stop()
            print(f"\n{flows} flows x {COUNTER_STEPS} Steps on 2 worker processes: {elapsed:.1f} s")

            infos = await asyncio.gather(*(eng.client.describe_flow(fid) for fid in flow_ids))
            assert Counter(i.status for i in infos) == {"completed": flows}

            async def count_of(flow_id: str) -> int | None:
                value: int | None = await eng.client.get_attribute(flow_id, Count)
                return value

            counts = await asyncio.gather(*(count_of(fid) for fid in flow_ids))
            assert Counter(counts) == {COUNTER_STEPS: flows}, "every Step's increment committed exactly once"

            expected = {f"Inc-{n}" for n in range(1, COUNTER_STEPS + 1)}
            histories = await asyncio.gather(*(eng.client.get_flow_history(fid) for fid in flow_ids))
            for fid, history in zip(flow_ids, histories, strict=True):
                commits = Counter(h.step_execution_id for h in history if h.event_type == "execute_completed")
                assert commits == dict.fromkeys(expected, 1), f"flow {fid}: commits per Step execution {commits}"
                assert not [h for h in history if h.event_type in ("attempt_failed", "step_failed")], history

            entries = procs.invocations.read()
            runs = Counter((e.flow_id, e.step_execution_id) for e in entries)
            twice = [k for k, n in runs.items() if n != 1]
            detail = [(e.flow_id, e.step_execution_id, e.attempt, e.pid) for e in entries
                      if (e.flow_id, e.step_execution_id) in set(twice[:3])]
            assert len(runs) == flows * COUNTER_STEPS and not twice, (
                f"handlers that ran other than once: {[(k, runs[k]) for k in twice][:10]}; runs: {detail}"
            )
            per_pid = Counter(e.pid for e in entries)
            assert set(per_pid) == {w.pid for w in workers}, per_pid
            print(f"Steps run per worker process: {dict(per_pid)}")

    assert database_check(db_url) == "ok"
