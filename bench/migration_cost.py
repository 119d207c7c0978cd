"""Benchmark: what upgrading a large deployment costs, the newest migration of each backend.

Prints figures, checks no thresholds. For each backend it builds a database at the schema before
the newest (SQLite 7, PostgreSQL 6) holding --flows flows, most closed (completed) and --running of
them waiting for a message, each with the tasks, history and other rows the engine stored for it.
Then it opens a store of this checkout's engine on it (the migration, in a child process, as a
worker's start would), while a writer of the older version's kind (a connection of its own, not the
engine) inserts a flows row and updates another, one transaction after another. Printed: how long
the open took, how many of the writer's transactions finished meanwhile, and the longest one: how
long the migration held the writer off (a write takes about a millisecond on its own).

Building is quick: two flows are run for real by an in-process Worker, one to its end and one until
it waits; then SQL statements copy every row the engine stored for each (each copy with its own
flow ID, and closed or created a millisecond after the one before). The newest migration only adds
an index, so the database is then put back to the schema before it by dropping that index and
recording the older version. On PostgreSQL it is VACUUM ANALYZEd, as autovacuum would. Each
--src engine (e.g. `--src /work/main/engine/src` for main's, before a change) migrates a copy of
the one built database (a file copy; CREATE DATABASE ... TEMPLATE on PostgreSQL).

Run: uv run --frozen python bench/migration_cost.py [--flows 1000000] [--running 100000]
     [--pg-dsn DSN (default $TEST_PG_DSN)] [--no-sqlite] [--src SRC ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlparse, urlunparse

BASE_MS = 1_700_000_000_000
HERE = Path(__file__).resolve().parents[1] / "engine" / "src"
# The newest migration of each backend, which this measures: (number, the index it creates).
NEWEST = {"sqlite": (8, "flows_closed"), "postgres": (7, "flows_closed")}


def job_flow() -> Any:
    """A flow of three Steps: two that run at once, then one that waits for a message and ends it."""
    from dex_engine import Channel, Context, Flow, Step, StepDecision, Wait

    inbox = Channel("Inbox", str)

    async def begin(ctx: Context, _: Any) -> StepDecision:
        return StepDecision.go_to("Work")

    async def work(ctx: Context, _: Any) -> StepDecision:
        return StepDecision.go_to("AwaitMessage")

    async def await_message(ctx: Context, _: Any) -> Wait:
        return Wait.until(inbox.for_one())

    async def done(ctx: Context, _: Any) -> StepDecision:
        return StepDecision.graceful_complete()

    return Flow("Job", [Step("Begin", begin), Step("Work", work),
                        Step("AwaitMessage", done, wait_for=await_message)],
                start_step="Begin", schema=[inbox])


async def build(url: str, flows: int, running: int) -> None:
    """Fill the empty database at `url` (this checkout's engine) and put it back to the schema before the newest."""
    from dex_agents.testing import wait_until
    from dex_engine import AsyncClient, AsyncWorker, Registry, WorkerOptions, open_store

    backend = "postgres" if url.startswith("postgres") else "sqlite"
    flow = job_flow()
    registry = Registry([flow])
    store = open_store(url)
    try:
        client = AsyncClient(registry, store=store)
        await client.start_flow("Job", "closed-0")
        await client.start_flow("Job", "running-0")
        await client.publish("closed-0", flow.channels["Inbox"], "hello")
        async with AsyncWorker(registry, WorkerOptions(database_url=url, poll_seconds=0.05), store=store):
            async def settled() -> bool:
                closed = await client.describe_flow("closed-0")
                steps = [(s.step_type, s.state) for s in (await client.describe_flow("running-0")).active_steps]
                return closed.status == "completed" and steps == [("AwaitMessage", "waiting")]

            await wait_until("one flow closed, one waiting", settled, timeout=60)

        def clone(db: Any) -> None:
            tables = _flow_tables(db, backend)
            numbers = ("WITH RECURSIVE n (i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?) " if backend ==
                       "sqlite" else "WITH n (i) AS (SELECT generate_series(1, CAST(? AS INTEGER))) ")
            for kind, count in (("closed", flows - running), ("running", running)):
                if count <= 1:
                    continue
                heads = _clone_history_batches(db, kind, count, numbers) if backend == "sqlite" else {}
                for table, columns in tables.items():
                    others = [c for c in columns if c != "flow_id"]
                    shifted = [f"{c} + n.i" if c in ("created_at", "closed_at") else heads.get(c, c) for c in others]
                    db.run(f"{numbers}INSERT INTO {table} (flow_id, {', '.join(others)}) "
                           f"SELECT '{kind}-' || n.i, {', '.join(shifted)} FROM {table}, n "
                           f"WHERE flow_id = '{kind}-0'", (count - 1,))
            number, index = NEWEST[backend]
            db.run(f"DROP INDEX {index}")
            db.run("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(number - 1),))

        await store._run(clone, write=True)
    finally:
        await store.close()
    if backend == "postgres":
        import psycopg

        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("VACUUM ANALYZE")
            conn.execute("CHECKPOINT")


def _clone_history_batches(db: Any, kind: str, count: int, numbers: str) -> dict[str, str]:
    """SQLite: copy the history batches of flow `<kind>-0` to flows `<kind>-1` onwards, each copy
    chained as the original (batch IDs in a block per original batch); returns the SQL giving a
    copy's flows.history_head."""
    moved: dict[int, int] = {}  # an original batch ID: the batch ID of its copies before the first
    for batch_id, prev in db.all(f"SELECT batch_id, prev FROM history_batches WHERE flow_id = '{kind}-0' "
                                 "ORDER BY batch_id"):
        base = db.one("SELECT MAX(batch_id) FROM history_batches")[0]
        moved[batch_id] = base
        chained = "NULL" if prev is None else f"{moved[prev]} + n.i"
        db.run(f"{numbers}INSERT INTO history_batches (batch_id, flow_id, first_seq, last_seq, prev, events) "
               f"SELECT {base} + n.i, '{kind}-' || n.i, first_seq, last_seq, {chained}, events "
               f"FROM history_batches, n WHERE batch_id = {batch_id}", (count - 1,))
    head = db.one(f"SELECT history_head FROM flows WHERE flow_id = '{kind}-0'")[0]
    return {} if head is None else {"history_head": f"{moved[head]} + n.i"}


def _flow_tables(db: Any, backend: str) -> dict[str, list[str]]:
    """Each table holding a flow's rows (a flow_id column) and its columns to copy: not its own
    generated key (task_id, message_id, batch_id), which the copy is given anew."""
    if backend == "sqlite":
        names = [r[0] for r in db.all("SELECT name FROM sqlite_master WHERE type = 'table' "
                                      "AND name NOT LIKE 'sqlite%'")]
        out = {}
        for name in names:
            columns = db.all(f"SELECT name, pk, type FROM pragma_table_info('{name}')")
            keys = [c for c in columns if c[1]]
            generated = {c[0] for c in keys if len(keys) == 1 and str(c[2]).upper() == "INTEGER"}
            cols = [str(c[0]) for c in columns if c[0] not in generated]
            if "flow_id" in cols and name != "history_batches":  # _clone_history_batches
                out[name] = cols
        return out
    out = {}
    for table, column, identity in db.all(
            "SELECT table_name, column_name, is_identity FROM information_schema.columns "
            "WHERE table_schema = current_schema() ORDER BY table_name, ordinal_position"):
        if identity != "YES":
            out.setdefault(str(table), []).append(str(column))
    return {table: cols for table, cols in out.items() if "flow_id" in cols}


class Writer:
    """An older version's worker writing to flows: a row inserted and one updated per transaction,
    one after another, each transaction's start and end recorded."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.spans: list[tuple[float, float]] = []
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, daemon=True)

    def _main(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # reported by the caller
            self.error = exc

    def _loop(self) -> None:
        columns = ("flow_type, status, input, output, error, config, version, completing, completion_output, "
                   "history_seq, created_at, closed_at")
        n = 0
        if self.url.startswith("postgres"):
            import psycopg

            with psycopg.connect(self.url, autocommit=True) as conn:
                while not self.stop.is_set():
                    n += 1
                    t = time.perf_counter()
                    with conn.transaction():
                        conn.execute(f"INSERT INTO flows (flow_id, {columns}) SELECT %s, {columns} FROM flows "
                                     "WHERE flow_id = 'running-0'", (f"writer-{n}",))
                        conn.execute("UPDATE flows SET version = version + 1 WHERE flow_id = 'running-0'")
                    self.spans.append((t, time.perf_counter()))
                    time.sleep(0.002)
            return
        conn = sqlite3.connect(self.url.removeprefix("sqlite:///"), isolation_level=None, timeout=600)
        try:
            while not self.stop.is_set():
                n += 1
                t = time.perf_counter()
                conn.execute("BEGIN IMMEDIATE")
                conn.execute(f"INSERT INTO flows (flow_id, {columns}) SELECT ?, {columns} FROM flows "
                             "WHERE flow_id = 'running-0'", (f"writer-{n}",))
                conn.execute("UPDATE flows SET version = version + 1 WHERE flow_id = 'running-0'")
                conn.execute("COMMIT")
                self.spans.append((t, time.perf_counter()))
                time.sleep(0.002)
        finally:
            conn.close()


def migrate_in_child(src: str, url: str) -> float:
    """Seconds to open a store of the engine at `src` on `url` (its migration), in a process of its own."""
    env = dict(os.environ, PYTHONPATH=src)
    out = subprocess.run([sys.executable, __file__, "--open", url, src], env=env, check=True,
                         capture_output=True, text=True).stdout
    return float(json.loads(out.splitlines()[-1])["seconds"])


def measure(src: str, url: str) -> dict[str, float]:
    writer = Writer(url)
    writer.thread.start()
    time.sleep(1.0)  # the writer's connection open and its statements warm
    start = time.perf_counter()
    seconds = migrate_in_child(src, url)
    end = time.perf_counter()
    time.sleep(0.5)
    writer.stop.set()
    writer.thread.join()
    if writer.error is not None:
        raise writer.error
    during = [(a, b) for a, b in writer.spans if b > start and a < end]
    before = [b - a for a, b in writer.spans if b <= start]
    return {"open_s": seconds, "writes": len(during),
            "longest_write_s": max((b - a for a, b in during), default=end - start),
            "usual_write_ms": 1000 * sorted(before)[len(before) // 2] if before else 0.0}


def open_and_report(url: str, src: str) -> None:
    import dex_engine
    from dex_engine import open_store

    assert str(Path(dex_engine.__file__).resolve()).startswith(str(Path(src).resolve())), dex_engine.__file__
    t = time.perf_counter()
    store = open_store(url)
    seconds = time.perf_counter() - t
    asyncio.run(store.close())
    print(json.dumps({"seconds": seconds}))


def pg_url(dsn: str, name: str) -> str:
    return urlunparse(urlparse(dsn)._replace(path=f"/{name}"))


def pg_admin(dsn: str, sql: str) -> None:
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql)


def sizes(url: str) -> str:
    if url.startswith("postgres"):
        import psycopg

        with psycopg.connect(url) as conn:
            row = conn.execute("SELECT pg_size_pretty(pg_total_relation_size('flows')), "
                               "pg_size_pretty(pg_database_size(current_database()))").fetchone()
        assert row is not None
        return f"flows {row[0]}, database {row[1]}"
    return f"file {os.path.getsize(url.removeprefix('sqlite:///')) / 2**20:.0f} MiB"


def run_backend(args: argparse.Namespace, backend: str, tmp: Path) -> None:
    copies: list[Callable[[], None]] = []
    if backend == "postgres":
        built_name = f"dex_bench_{uuid.uuid4().hex[:8]}"
        pg_admin(args.pg_dsn, f"CREATE DATABASE {built_name}")
        copies.append(lambda: pg_admin(args.pg_dsn, f"DROP DATABASE IF EXISTS {built_name} WITH (FORCE)"))
        built = pg_url(args.pg_dsn, built_name)
    else:
        built = f"sqlite:///{tmp / 'built.db'}"
    try:
        t = time.perf_counter()
        asyncio.run(build(built, args.flows, args.running))
        print(f"{backend}: built {args.flows} flows ({args.running} running) at schema {NEWEST[backend][0] - 1} "
              f"in {time.perf_counter() - t:.0f} s; {sizes(built)}", flush=True)
        for src in args.src or [str(HERE)]:
            if backend == "postgres":
                name = f"dex_bench_{uuid.uuid4().hex[:8]}"
                pg_admin(args.pg_dsn, f"CREATE DATABASE {name} TEMPLATE {built_name}")
                copies.append(lambda name=name: pg_admin(args.pg_dsn, f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                url = pg_url(args.pg_dsn, name)
            else:
                path = tmp / f"copy-{uuid.uuid4().hex[:8]}.db"
                shutil.copyfile(built.removeprefix("sqlite:///"), path)
                url = f"sqlite:///{path}"
            r = measure(src, url)
            print(f"  {src}: open (migration) {r['open_s']:.2f} s; writer: {r['writes']} transactions during it, "
                  f"longest {r['longest_write_s']:.3f} s (usual {r['usual_write_ms']:.1f} ms)", flush=True)
    finally:
        for drop in reversed(copies):
            drop()


def main() -> None:
    if sys.argv[1:2] == ["--open"]:
        open_and_report(sys.argv[2], sys.argv[3])
        return
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--flows", type=int, default=1_000_000, help="flows in the database (default 1,000,000)")
    parser.add_argument("--running", type=int, default=100_000, help="of them still running (default 100,000)")
    parser.add_argument("--pg-dsn", default=os.environ.get("TEST_PG_DSN"),
                        help="also on this PostgreSQL server (databases created and dropped)")
    parser.add_argument("--no-sqlite", action="store_true", help="PostgreSQL only")
    parser.add_argument("--src", action="append", help="an engine/src to migrate with (repeatable; default this one)")
    args = parser.parse_args()
    if not 1 <= args.running <= args.flows - 1:
        parser.error("--running must be at least 1 and leave at least 1 closed flow")
    backends = ([] if args.no_sqlite else ["sqlite"]) + (["postgres"] if args.pg_dsn else [])
    with tempfile.TemporaryDirectory(prefix="dex-migration-") as tmp:
        for backend in backends:
            run_backend(args, backend, Path(tmp))


if __name__ == "__main__":
    main()
