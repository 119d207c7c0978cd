"""Benchmark: cost of a dex_engine Step against the raw SQLite commit floor, measured in one run.

Prints, for the chosen synchronous mode (FULL by default):
- the floor: one small `BEGIN IMMEDIATE; INSERT; COMMIT` on a dedicated thread (median, p95);
- chains of no-op Steps at concurrency 1, 16 and 64 (per-Step latency median and p95, Steps/s);
- a fan-out of 8 parallel Steps joined by one channel wait;
- each latency as a ratio to the floor.

Run: uv run python bench/engine_steps.py [--sync FULL|NORMAL] [--chain-steps N]
     uv run python bench/engine_steps.py --backend postgres --pg-dsn postgresql://... [--workers 1,2,4]

With --backend postgres the floor is one small INSERT committed on one connection, and the chains
run at concurrency 1, 16 and 64 (--concurrency) on 1, 2 and 4 worker processes (--workers), each its
own AsyncWorker and store; per-Step latencies come from marks the worker processes write at exit.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

from dex_engine import (
    AsyncClient,
    AsyncWorker,
    Channel,
    Context,
    Flow,
    LoadOptions,
    Registry,
    Step,
    StepDecision,
    StepOptions,
    Wait,
    WorkerOptions,
    open_store,
)

NOOP = StepOptions(load=LoadOptions.none())
marks: dict[str, list[float]] = defaultdict(list)


async def chain_step(ctx: Context, remaining: int) -> StepDecision:
    marks[ctx.flow_id].append(time.perf_counter())
    if remaining <= 1:
        return StepDecision.graceful_complete()
    return StepDecision.go_to("Chain", remaining - 1)


Done = Channel("Done", int)


async def fan_start(ctx: Context, _: None) -> StepDecision:
    marks[ctx.flow_id].append(time.perf_counter())
    return StepDecision.go_to_many(*[("Work", i) for i in range(8)], ("Join", None))


async def fan_work(ctx: Context, i: int) -> StepDecision:
    ctx.publish(Done, i)
    return StepDecision.dead_end()


async def join_wait(ctx: Context, _: None) -> Wait:
    return Wait.until(Done.for_n(8))


async def join(ctx: Context, _: None) -> StepDecision:
    marks[ctx.flow_id].append(time.perf_counter())
    return StepDecision.graceful_complete()


CHAIN = Flow("BenchChain", [Step("Chain", chain_step, input_type=int, options=NOOP)], start_step="Chain")
FAN = Flow(
    "BenchFan",
    [
        Step("Start", fan_start, input_type=type(None), options=NOOP),
        Step("Work", fan_work, input_type=int, options=NOOP),
        Step("Join", join, wait_for=join_wait, input_type=type(None), options=NOOP),
    ],
    start_step="Start",
    schema=[Done],
)


def floor(path: str, sync: str, n: int) -> list[float]:
    """Latency of a bare small commit on one dedicated thread, as the engine's store does it."""
    out: list[float] = []

    def run() -> None:
        conn = sqlite3.connect(path, isolation_level=None)
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute(f"PRAGMA synchronous = {sync}")
        conn.execute("CREATE TABLE IF NOT EXISTS floor (id INTEGER PRIMARY KEY, v BLOB)")
        for _ in range(n):
            t = time.perf_counter()
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("INSERT INTO floor (v) VALUES (?)", (b"x" * 100,))
            conn.execute("COMMIT")
            out.append(time.perf_counter() - t)
        conn.close()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return out


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


async def run_chain(url: str, concurrency: int, steps: int) -> tuple[list[float], float, int]:
    marks.clear()
    store = open_store(url)
    registry = Registry([CHAIN])
    client = AsyncClient(registry, store=store)
    opts = WorkerOptions(database_url=url, max_concurrent_tasks=max(64, concurrency))
    async with AsyncWorker(registry, opts, store=store):
        ids = [f"chain-{concurrency}-{i}" for i in range(concurrency)]
        t0 = time.perf_counter()
        await asyncio.gather(*(client.start_flow("BenchChain", fid, steps) for fid in ids))
        for fid in ids:
            await client.wait_for_flow(fid, 600)
        wall = time.perf_counter() - t0
    await store.close()
    gaps = [b - a for fid in ids for a, b in zip(marks[fid], marks[fid][1:], strict=False)]
    return gaps, wall, concurrency * steps


async def run_fan(url: str, concurrency: int, rounds: int) -> tuple[list[float], float, int]:
    marks.clear()
    store = open_store(url)
    registry = Registry([FAN])
    client = AsyncClient(registry, store=store)
    opts = WorkerOptions(database_url=url, max_concurrent_tasks=max(64, concurrency * 9))
    async with AsyncWorker(registry, opts, store=store):
        durations: list[float] = []
        t0 = time.perf_counter()
        for r in range(rounds):
            ids = [f"fan-{concurrency}-{r}-{i}" for i in range(concurrency)]
            await asyncio.gather(*(client.start_flow("BenchFan", fid, None) for fid in ids))
            for fid in ids:
                await client.wait_for_flow(fid, 600)
            durations += [marks[fid][1] - marks[fid][0] for fid in ids]
        wall = time.perf_counter() - t0
    await store.close()
    return durations, wall, rounds * concurrency * 10


def pg_floor(dsn: str, n: int) -> list[float]:
    """Latency of a bare small commit on one PostgreSQL connection."""
    import psycopg

    out: list[float] = []
    with psycopg.connect(dsn) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS bench_floor (id BIGSERIAL PRIMARY KEY, v BYTEA)")
        conn.commit()
        for _ in range(n):
            t = time.perf_counter()
            conn.execute("INSERT INTO bench_floor (v) VALUES (%s)", (b"x" * 100,))
            conn.commit()
            out.append(time.perf_counter() - t)
        conn.execute("DROP TABLE bench_floor")
        conn.commit()
    return out


def fresh_pg_database(dsn: str, name: str) -> str:
    import psycopg
    from psycopg import sql

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    base, _, _ = dsn.rpartition("/")
    return f"{base}/{name}"


def worker_process_main(url: str, capacity: int = 64, marks_path: str = "") -> None:
    """A benchmark worker process: serves BenchChain until SIGTERM, then writes its Step marks."""

    async def run() -> None:
        worker = AsyncWorker(Registry([CHAIN]), WorkerOptions(database_url=url, max_concurrent_tasks=capacity))
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        async with worker:
            await stop.wait()

    asyncio.run(run())
    if marks_path:
        # perf_counter is CLOCK_MONOTONIC on Linux: one clock for every process of the machine.
        Path(marks_path).write_text(json.dumps(marks))


async def drive_chains(url: str, concurrency: int, steps: int, processes: int = 1) -> tuple[float, int]:
    """Start `concurrency` chains and wait for them; `processes` worker processes do the work."""
    store = open_store(url)
    client = AsyncClient(Registry([CHAIN]), store=store)
    try:
        while True:  # the clock starts once every worker process is up
            if len(await store.list_workers()) >= processes:
                break
            await asyncio.sleep(0.05)
        ids = [f"chain-{i}" for i in range(concurrency)]
        t0 = time.perf_counter()
        await asyncio.gather(*(client.start_flow("BenchChain", fid, steps) for fid in ids))
        # One cheap query per poll, so the driver adds little load to the server it measures.
        while True:
            if not await store.search_flows(flow_type="BenchChain", status="running", limit=1):
                break
            await asyncio.sleep(0.01)
        return time.perf_counter() - t0, concurrency * steps
    finally:
        await store.close()


def run_chain_processes(url: str, processes: int, concurrency: int, steps: int) -> tuple[list[float], float, int]:
    """Chains on `processes` worker processes, each with an equal share of the concurrency (so that
    the chains spread over them: a chain stays on the worker that first claimed it)."""
    capacity = -(-concurrency // processes)
    tmp = Path(tempfile.mkdtemp(prefix="dex-bench-marks-"))
    paths = [tmp / f"marks-{i}.json" for i in range(processes)]
    children = [subprocess.Popen([sys.executable, __file__, "--serve", url, str(capacity), str(path)])
                for path in paths]
    try:
        wall, total = asyncio.run(drive_chains(url, concurrency, steps, processes))
    finally:
        for child in children:
            child.send_signal(signal.SIGTERM)
        for child in children:
            child.wait(30)
    per_flow: dict[str, list[float]] = defaultdict(list)
    for path in paths:
        for flow_id, times in json.loads(path.read_text()).items():
            per_flow[flow_id] += times
    gaps = [b - a for times in per_flow.values() for a, b in itertools.pairwise(sorted(times))]
    return gaps, wall, total


def main_postgres(args: argparse.Namespace) -> None:
    if not args.pg_dsn:
        raise SystemExit("--backend postgres needs --pg-dsn postgresql://user@host:port/db (or TEST_PG_DSN)")
    print(f"dex_engine Step benchmark, PostgreSQL {args.pg_dsn}, {os.cpu_count()} cores")
    fl = pg_floor(args.pg_dsn, args.floor_commits)
    f_med = statistics.median(fl)
    print(f"\nfloor: bare commit on one connection: median {f_med * 1e3:.3f} ms  p95 {pct(fl, 0.95) * 1e3:.3f} ms")
    print(f"\n{'workload':<48}{'median ms':>10}{'p95 ms':>9}{'x floor':>9}{'Steps/s':>10}")
    for processes in args.workers:
        for concurrency in args.concurrency:
            steps = args.chain_steps or {1: 200, 16: 50}.get(concurrency, 30)
            url = fresh_pg_database(args.pg_dsn, f"dex_bench_{processes}_{concurrency}")
            gaps, wall, total = run_chain_processes(url, processes, concurrency, steps)
            med = statistics.median(gaps)
            label = f"chain of no-op Steps, c={concurrency}, {processes} process(es)"
            print(f"{label:<48}{med * 1e3:>10.3f}{pct(gaps, 0.95) * 1e3:>9.3f}{med / f_med:>9.1f}"
                  f"{total / wall:>10.0f}", flush=True)
    print("\nper-Step latency: time between consecutive Step starts in one flow. Each worker process runs"
          "\nat most c/processes Steps at once, so the chains spread over the processes.")


def main() -> None:
    if len(sys.argv) >= 3 and sys.argv[1] == "--serve":
        worker_process_main(sys.argv[2], *([int(sys.argv[3]), sys.argv[4]] if len(sys.argv) == 5 else []))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sync", choices=["FULL", "NORMAL"], default="FULL")
    parser.add_argument("--chain-steps", type=int, default=0, help="Steps per chain (default: by concurrency)")
    parser.add_argument("--floor-commits", type=int, default=1000)
    parser.add_argument("--backend", choices=["sqlite", "postgres"], default="sqlite")
    parser.add_argument("--pg-dsn", default=os.environ.get("TEST_PG_DSN", ""))
    parser.add_argument("--workers", default="1,2,4", type=lambda s: [int(x) for x in s.split(",")],
                        help="PostgreSQL: worker process counts (default 1,2,4)")
    parser.add_argument("--concurrency", default="1,16,64", type=lambda s: [int(x) for x in s.split(",")],
                        help="PostgreSQL: chains run at once (default 1,16,64)")
    args = parser.parse_args()
    if args.backend == "postgres":
        main_postgres(args)
        return
    tmp = Path(tempfile.mkdtemp(prefix="dex-bench-"))
    print(f"dex_engine Step benchmark, SQLite WAL synchronous={args.sync}, {os.cpu_count()} cores, files in {tmp}")
    fl = floor(str(tmp / "floor.db"), args.sync, args.floor_commits)
    f_med, f_p95 = statistics.median(fl), pct(fl, 0.95)
    print(f"\nfloor: bare commit on a dedicated thread: median {f_med * 1e3:.3f} ms  p95 {f_p95 * 1e3:.3f} ms")
    print(f"\n{'workload':<34}{'median ms':>10}{'p95 ms':>9}{'x floor':>9}{'Steps/s':>10}")
    for concurrency in (1, 16, 64):
        steps = args.chain_steps or {1: 400, 16: 100, 64: 50}[concurrency]
        url = f"sqlite:///{tmp / f'chain{concurrency}.db'}?synchronous={args.sync}"
        gaps, wall, total = asyncio.run(run_chain(url, concurrency, steps))
        med = statistics.median(gaps)
        print(f"{f'chain of no-op Steps, c={concurrency}':<34}{med * 1e3:>10.3f}{pct(gaps, 0.95) * 1e3:>9.3f}"
              f"{med / f_med:>9.1f}{total / wall:>10.0f}")
    for concurrency in (1, 16):
        url = f"sqlite:///{tmp / f'fan{concurrency}.db'}?synchronous={args.sync}"
        durs, wall, total = asyncio.run(run_fan(url, concurrency, rounds=max(4, 64 // concurrency)))
        med = statistics.median(durs)
        print(f"{f'fan-out 8 + join, c={concurrency} (round)':<34}{med * 1e3:>10.3f}{pct(durs, 0.95) * 1e3:>9.3f}"
              f"{med / f_med:>9.1f}{total / wall:>10.0f}")
    print("\nper-Step latency: time between consecutive Step starts in one flow; fan-out: start to join.")


if __name__ == "__main__":
    main()
