"""Benchmark: cost of a dex_engine Step against the raw SQLite commit floor, measured in one run.

Prints, for the chosen synchronous mode (FULL by default):
- the floor: one small `BEGIN IMMEDIATE; INSERT; COMMIT` on a dedicated thread (median, p95);
- chains of no-op Steps at concurrency 1, 16 and 64 (per-Step latency median and p95, Steps/s);
- a fan-out of 8 parallel Steps joined by one channel wait;
- each latency as a ratio to the floor.

Run: uv run python bench/engine_steps.py [--sync FULL|NORMAL] [--chain-steps N]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sqlite3
import statistics
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sync", choices=["FULL", "NORMAL"], default="FULL")
    parser.add_argument("--chain-steps", type=int, default=0, help="Steps per chain (default: by concurrency)")
    parser.add_argument("--floor-commits", type=int, default=1000)
    args = parser.parse_args()
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
