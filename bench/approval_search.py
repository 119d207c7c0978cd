"""Benchmark: the first page of search_flows('ActiveStepTypes = "AwaitToolApproval"') among many idle sessions.

Prints figures, checks no thresholds (but does check each answer against the flows it built). For
each mix of --idle sessions waiting in AwaitUserMessage and W (--waiting, a list) waiting in
AwaitToolApproval, and each placement of the W in the order search_flows lists flows (created_at,
then flow ID): `spread` (evenly among the idle ones), `start` (all older) and `end` (all younger),
it builds a database and times the first page (--limit) of the search, best and median of --repeat.

Building is quick: two sessions are run for real by an in-process Worker until one waits in each
Step; then SQL statements run through the store's own transaction copy their flow and task rows
(the fast path the engine's tests use, e.g. test_worker_behaviour's clone()), each copy with its
own flow ID and created_at. On PostgreSQL the database is ANALYZEd, as autovacuum would.

--base SRC times the same databases with another checkout's engine too (its engine/src), in a
child process per database like the engine under test, and prints both side by side: e.g.
`--base /work/main/engine/src` compares this branch against main.

Run: uv run --frozen python bench/approval_search.py [--idle 100000] [--waiting 10,2001,20000,50000]
     [--placements spread,start,end] [--pg-dsn DSN (default $TEST_PG_DSN)] [--base SRC] [--no-sqlite]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlparse, urlunparse

QUERY = 'ActiveStepTypes = "AwaitToolApproval"'
BASE_MS = 1_700_000_000_000
_TASK_COLUMNS = (
    "flow_id, flow_type, step_type, step_execution_id, input, options, method, state, attempt, attempt_started, "
    "any_started, method_first_at, run_at, lease_owner, lease_epoch, claimed_at, deadline_at, method_deadline_at, "
    "checkpoint, snapshot, locks_held, wait_spec, wait_registered_at, timer_due_at, timers_skipped, wait_outcome, "
    "last_error, recovery_error, created_at"
)
_FLOW_COLUMNS = ("flow_type, status, input, output, error, config, version, completing, completion_output, "
                 "history_seq, closed_at")


def session_flow() -> Any:
    """An agent session's shape: it waits for a user message, then for the approval of a tool call."""
    from dex_engine import Channel, Context, Flow, Step, StepDecision, Wait

    inbox = Channel("Inbox", str)
    approvals = Channel("Approvals", str)

    async def await_message(ctx: Context, _: Any) -> Wait:
        return Wait.until(inbox.for_one())

    async def await_approval(ctx: Context, _: Any) -> Wait:
        return Wait.until(approvals.for_one())

    async def to_approval(ctx: Context, _: Any) -> StepDecision:
        return StepDecision.go_to("AwaitToolApproval")

    async def done(ctx: Context, _: Any) -> StepDecision:
        return StepDecision.graceful_complete()

    return Flow("Session", [Step("AwaitUserMessage", to_approval, wait_for=await_message),
                            Step("AwaitToolApproval", done, wait_for=await_approval)],
                start_step="AwaitUserMessage", schema=[inbox, approvals])


def created_at(kind: str, placement: str, idle: int, waiting: int) -> str:
    """SQL giving the created_at of the n.i-th (from 0) flow of `kind` in the order `placement`."""
    if placement == "start":
        return f"{BASE_MS} + n.i" if kind == "wait" else f"{BASE_MS} + {waiting} + n.i"
    if placement == "end":
        return f"{BASE_MS} + n.i" if kind == "idle" else f"{BASE_MS} + {idle} + n.i"
    # spread: idle flows at even offsets, each waiting one just after the idle one it follows
    if kind == "idle":
        return f"{BASE_MS} + 2 * n.i"
    return f"{BASE_MS} + 2 * ((CAST(n.i AS BIGINT) * {idle}) / {waiting}) + 1"


async def build(url: str, idle: int, waiting: int, placement: str) -> list[str]:
    """Fill the empty database at `url`; returns the flow IDs the search should find, in order."""
    from dex_agents.testing import wait_until
    from dex_engine import AsyncClient, AsyncWorker, Registry, WorkerOptions, open_store

    flow = session_flow()
    registry = Registry([flow])
    store = open_store(url)
    try:
        client = AsyncClient(registry, store=store)
        await client.start_flow("Session", "idle-0")
        await client.start_flow("Session", "wait-0")
        await client.publish("wait-0", flow.channels["Inbox"], "hello")
        options = WorkerOptions(database_url=url, poll_seconds=0.05)
        async with AsyncWorker(registry, options, store=store):
            async def both_waiting() -> bool:
                steps = [(s.step_type, s.state) for flow_id in ("idle-0", "wait-0")
                         for s in (await client.describe_flow(flow_id)).active_steps]
                return steps == [("AwaitUserMessage", "waiting"), ("AwaitToolApproval", "waiting")]

            await wait_until("both sessions waiting", both_waiting, timeout=60)

        def clone(db: Any) -> None:
            numbers = "WITH RECURSIVE n (i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?) "
            task_columns = _TASK_COLUMNS.replace("flow_id, ", "", 1)
            for kind, count in (("idle", idle), ("wait", waiting)):
                at = created_at(kind, placement, idle, waiting)
                if count > 1:
                    db.run(f"{numbers}INSERT INTO flows (flow_id, created_at, {_FLOW_COLUMNS}) "
                           f"SELECT '{kind}-' || n.i, {at}, {_FLOW_COLUMNS} FROM flows, n WHERE flow_id = '{kind}-0'",
                           (count - 1,))
                    db.run(f"{numbers}INSERT INTO tasks ({_TASK_COLUMNS}) SELECT '{kind}-' || n.i, {task_columns} "
                           f"FROM tasks, n WHERE flow_id = '{kind}-0'", (count - 1,))
                db.run(f"UPDATE flows SET created_at = (SELECT {at} FROM (SELECT 0 AS i) n) WHERE flow_id = '{kind}-0'")

        await store._run(clone, write=True)
        if url.startswith("postgresql"):
            await store._run(lambda db: db.run("ANALYZE"), write=True)
        found = await store._run(lambda db: db.all(
            "SELECT flow_id, created_at FROM flows WHERE flow_id LIKE 'wait-%'"), write=False)
        return [flow_id for _, flow_id in sorted((int(at), str(flow_id)) for flow_id, at in found)]
    finally:
        await store.close()


def measure(url: str, limit: int, repeat: int) -> dict[str, Any]:
    """Times the search on a client of its own (in the child process --base and the engine use)."""
    from dex_engine import AsyncClient, Registry

    async def go() -> dict[str, Any]:
        client = AsyncClient(Registry([session_flow()]), url)
        try:
            await client.search_flows(QUERY, limit=limit)  # connection opened, statements prepared
            times, found = [], []
            for _ in range(repeat):
                t = time.perf_counter()
                found = await client.search_flows(QUERY, limit=limit)
                times.append(time.perf_counter() - t)
            return {"best_ms": 1000 * min(times), "median_ms": 1000 * statistics.median(times), "found": found}
        finally:
            await client.close()

    return asyncio.run(go())


def measure_in_child(src: str, url: str, limit: int, repeat: int) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=src)
    out = subprocess.run([sys.executable, __file__, "--measure", url, str(limit), str(repeat), src],
                         env=env, check=True, capture_output=True, text=True).stdout
    result: dict[str, Any] = json.loads(out.splitlines()[-1])
    return result


def pg_database(dsn: str) -> tuple[str, Any]:
    import psycopg

    name = f"dex_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")

    def drop() -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")

    return urlunparse(urlparse(dsn)._replace(path=f"/{name}")), drop


def run_mix(args: argparse.Namespace, backend: str, waiting: int, placement: str, tmp: Path) -> None:
    drop = None
    if backend == "postgres":
        url, drop = pg_database(args.pg_dsn)
    else:
        url = f"sqlite:///{tmp / f'approvals-{waiting}-{placement}.db'}"
    try:
        t = time.perf_counter()
        expected = asyncio.run(build(url, args.idle, waiting, placement))[:args.limit]
        built = time.perf_counter() - t
        cells = []
        engines = ([("base", args.base)] if args.base else []) + [("new", str(Path(__file__).resolve().parents[1]
                                                                                 / "engine" / "src"))]
        for name, src in engines:
            result = measure_in_child(src, url, args.limit, args.repeat)
            if result["found"] != expected:
                raise SystemExit(f"{name} engine on {backend}, {waiting} {placement}: found {result['found'][:5]}... "
                                 f"({len(result['found'])}), expected {expected[:5]}... ({len(expected)})")
            cells.append(f"{name} {result['best_ms']:8.1f} / {result['median_ms']:8.1f}")
        print(f"{backend:<9}{args.idle:>8} {waiting:>7}  {placement:<7} " + "   ".join(cells)
              + f"   (built in {built:.0f} s)", flush=True)
    finally:
        if drop is not None:
            drop()
        elif url.startswith("sqlite:///"):
            for suffix in ("", "-wal", "-shm"):
                Path(url.removeprefix("sqlite:///") + suffix).unlink(missing_ok=True)


def main() -> None:
    if sys.argv[1:2] == ["--measure"]:
        url, limit, repeat, src = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
        import dex_engine

        assert str(Path(dex_engine.__file__).resolve()).startswith(str(Path(src).resolve())), dex_engine.__file__
        print(json.dumps(measure(url, limit, repeat)))
        return
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--idle", type=int, default=100_000, help="sessions waiting in AwaitUserMessage")
    parser.add_argument("--waiting", default="10,2001,20000,50000",
                        help="comma-separated counts of sessions waiting in AwaitToolApproval, one mix each")
    parser.add_argument("--placements", default="spread,start,end", help="of spread, start, end")
    parser.add_argument("--limit", type=int, default=100, help="the search's limit (default 100)")
    parser.add_argument("--repeat", type=int, default=7, help="searches timed per engine and mix")
    parser.add_argument("--pg-dsn", default=os.environ.get("TEST_PG_DSN"),
                        help="also on this PostgreSQL server (a database created and dropped per mix)")
    parser.add_argument("--no-sqlite", action="store_true", help="PostgreSQL only")
    parser.add_argument("--base", help="another checkout's engine/src to time beside this one")
    args = parser.parse_args()
    counts = [int(w) for w in args.waiting.split(",")]
    placements = args.placements.split(",")
    if args.idle < 1 or min(counts) < 1 or args.limit < 1 or args.repeat < 1:
        parser.error("--idle, --waiting, --limit and --repeat must be at least 1")
    if not set(placements) <= {"spread", "start", "end"}:
        parser.error(f"--placements must be of spread, start, end, got {args.placements!r}")
    backends = ([] if args.no_sqlite else ["sqlite"]) + (["postgres"] if args.pg_dsn else [])
    print(f"first page (limit {args.limit}) of search_flows({QUERY}): best / median of {args.repeat}, ms")
    print(f"{'backend':<9}{'idle':>8} {'waiting':>7}  {'order':<7} " + ("base best / median    " if args.base else "")
          + "new best / median")
    with tempfile.TemporaryDirectory(prefix="dex-approvals-") as tmp:
        for backend in backends:
            for waiting in counts:
                for placement in placements:
                    run_mix(args, backend, waiting, placement, Path(tmp))


if __name__ == "__main__":
    main()
