"""Benchmark: cost of a dex_engine Step against the raw SQLite commit floor, measured in one run.

Prints, for the chosen synchronous mode (FULL by default):
- the floor: one small `BEGIN IMMEDIATE; INSERT; COMMIT` on a dedicated thread, into a WAL it
  reuses (see floor()), and the same commit into a growing WAL (median, p95);
- chains of no-op Steps at concurrency 1, 16 and 64 (per-Step latency median and p95, Steps/s);
- a fan-out of 8 parallel Steps joined by one channel wait;
- each latency as a ratio to the floor.

Run: uv run python bench/engine_steps.py [--sync FULL|NORMAL] [--chain-steps N]
     uv run python bench/engine_steps.py --backend postgres --pg-dsn postgresql://... [--workers 1,2,4]

With --backend postgres the floor is one small INSERT committed on one connection, and the chains
run at concurrency 1, 16 and 64 (--concurrency) on 1, 2 and 4 worker processes (--workers), each its
own AsyncWorker and store; per-Step latencies come from marks the worker processes write at exit.
With DEX_BENCH_PROFILE=<path> set, each worker process writes a cProfile of its event loop thread
(thread CPU time) to <path>.<pid>. DEX_BENCH_MAX_BATCH=<n> caps the operations per PostgreSQL
transaction (MAX_BATCH_OPS, default 32), DEX_BENCH_LANES=<n> sets the connections per process: with
one process and a cap of 8, a Step's CPU on both sides rises to what four processes cost (their
batches hold about 9 commits), which shows the cost is per transaction, not per process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
from dex_engine._sqlite_store import parse_sqlite_url

NOOP = StepOptions(load=LoadOptions.none())
marks: dict[str, list[float]] = defaultdict(list)

# Warm-up goes on while a phase's WAL file still grows (WalWarmth), up to this many rounds: a WAL of
# SQLite's default 1,000 pages before a checkpoint takes an agent turn of dex about 17.
WARMUP_MAX = 200
WARMUP_CHAIN_STEPS = 50  # Steps of one warm-up chain: a few WAL pages each


class WalWarmth:
    """Whether a database file's WAL still grows. A commit that grows the WAL costs about twice one
    that reuses it (floor()), and the floor is measured into a reused WAL, so a phase warms up until
    a round leaves the WAL's size as it was: it has been checkpointed and started over, and from then
    on only a commit that crosses the checkpoint threshold further than any before grows it (by less
    than that commit's pages)."""

    def __init__(self, db: Path | None) -> None:
        self.wal = None if db is None else Path(f"{db}-wal")
        self.size = self._size()

    @classmethod
    def of(cls, url: str) -> WalWarmth:
        """For a database URL: a SQLite file's WAL; none for PostgreSQL."""
        return cls(Path(parse_sqlite_url(url).path) if url.startswith("sqlite:") else None)

    def _size(self) -> int | None:
        if self.wal is None:
            return None
        try:
            return self.wal.stat().st_size
        except FileNotFoundError:
            return None  # not in WAL mode (a rollback journal): nothing to warm

    def grew(self) -> bool:
        """Whether the WAL grew since the last look."""
        size = self._size()
        grew = size is not None and size != self.size
        self.size = size
        return grew

    def rounds(self, least: int) -> Iterator[int]:
        """Warm-up round numbers: `least` of them, then more while the last one grew the WAL, up to
        WARMUP_MAX in all."""
        done = 0
        while (self.grew() and done < WARMUP_MAX) or done < least:  # grew() first: every round is looked at
            yield done
            done += 1


async def chain_step(ctx: Context, remaining: int) -> StepDecision:
    marks[ctx.flow_id].append(time.perf_counter())
    if remaining <= 1:
        return StepDecision.graceful_complete()
    return StepDecision.go_to("Chain", remaining - 1)


Done: Channel[int] = Channel("Done", int)


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


def floor(
    path: str, sync: str, n: int, growing: list[float] | None = None, cpu: list[float] | None = None,
    rewrite_pages: int = 0,
) -> list[float]:
    """Latency of a bare small commit on one dedicated thread, as the engine's store does it, into a
    WAL the commits reuse.

    A commit that appends to a growing WAL file costs this machine about twice one that overwrites
    frames a checkpoint has copied back (0.21-0.26 ms against 0.11-0.15 ms): the file's new size has
    to reach the disk too. A database that runs for a while reuses its WAL, and so do the systems
    measured against this floor after their first few hundred commits, so the timed commits run after
    `n` untimed ones and a checkpoint. Their latencies go to `growing` when given, and the timed
    commits' thread CPU seconds to `cpu`. With `rewrite_pages`, each commit also rewrites a row that
    fills about that many pages, in place: as many more WAL pages, written by one statement.
    """
    out: list[float] = []
    # Two contents, alternated: each rewrite changes every page of the row.
    big = [bytes([b]) * max(0, rewrite_pages - 1) * 4096 for b in b"ab"]

    def commits(conn: sqlite3.Connection, into: list[float]) -> None:
        for i in range(n):
            t = time.perf_counter()
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("INSERT INTO floor (v) VALUES (?)", (b"x" * 100,))
            if rewrite_pages:
                conn.execute("UPDATE floor SET v = ? WHERE id = 1", (big[i % 2],))
            conn.execute("COMMIT")
            into.append(time.perf_counter() - t)

    def run() -> None:
        conn = sqlite3.connect(path, isolation_level=None)
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute(f"PRAGMA synchronous = {sync}")
        conn.execute("CREATE TABLE IF NOT EXISTS floor (id INTEGER PRIMARY KEY, v BLOB)")
        commits(conn, [] if growing is None else growing)
        # With every frame copied back and no reader, the next commit starts the WAL over.
        conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
        cpu0 = time.thread_time()
        commits(conn, out)
        if cpu is not None:
            cpu.append(time.thread_time() - cpu0)
        conn.close()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return out


def snapshot(path: Path, copy: Path) -> int:
    """Copy the database as committed now into a new WAL-mode file, and return how many frames the
    original's WAL file holds (0 without one): replay() grows the copy's WAL that far, so that its
    commits reuse it as the original's did. The online backup copies page for page, so every row of
    the copy sits on the page it sat on."""
    src, dst = sqlite3.connect(path), sqlite3.connect(copy)
    try:
        src.backup(dst)
        dst.execute("PRAGMA journal_mode = WAL")
        page_size = int(src.execute("PRAGMA page_size").fetchone()[0])
    finally:
        src.close()
        dst.close()
    try:
        wal_bytes = Path(f"{path}-wal").stat().st_size
    except FileNotFoundError:
        return 0
    return max(0, wal_bytes - WAL_HEADER_BYTES) // (WAL_FRAME_HEADER_BYTES + page_size)


# SQLite's WAL file layout (https://www.sqlite.org/fileformat.html#the_write_ahead_log).
WAL_HEADER_BYTES = 32
WAL_FRAME_HEADER_BYTES = 24


def warm_wal(conn: sqlite3.Connection, wal: Path, frames: int) -> None:
    """Grow the WAL of `conn`'s database to at least `frames` frames and checkpoint it, so that the
    next commits write over frames the file already has instead of growing it (see floor()), with
    every row as it was: each commit rewrites page 1 only, setting user_version to its own value.
    Without fsyncs and autocheckpoints meanwhile; the connection's settings are put back after."""
    mode = conn.execute("PRAGMA journal_mode").fetchone()[0]
    if str(mode).lower() != "wal":
        raise ValueError(f"warm_wal needs a database in WAL mode; {wal.name[:-4]} is in journal mode {mode!r}")
    sync = conn.execute("PRAGMA synchronous").fetchone()[0]
    limit = conn.execute("PRAGMA wal_autocheckpoint").fetchone()[0]
    version = int(conn.execute("PRAGMA user_version").fetchone()[0])
    conn.execute("PRAGMA synchronous = OFF")
    conn.execute("PRAGMA wal_autocheckpoint = 0")
    try:
        page = int(conn.execute("PRAGMA page_size").fetchone()[0])
        want = WAL_HEADER_BYTES + frames * (WAL_FRAME_HEADER_BYTES + page)
        for _ in range(frames):  # each commit appends at least one frame
            if wal.exists() and wal.stat().st_size >= want:
                break
            conn.execute(f"PRAGMA user_version = {version}")
        conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
    finally:
        conn.execute(f"PRAGMA wal_autocheckpoint = {int(limit)}")
        conn.execute(f"PRAGMA synchronous = {int(sync)}")


# A recorded statement: its text, its parameters, and what it did (rowcount, hash of the rows returned).
Recorded = tuple[str, tuple[Any, ...], tuple[int, int]]


class Rows:
    """A statement's rows, read to the end, with the cursor's rowcount and lastrowid."""

    def __init__(self, rows: list[Any], rowcount: int, lastrowid: int | None) -> None:
        self.rows = rows
        self.rowcount = rowcount
        self.lastrowid = lastrowid

    def fetchone(self) -> Any:
        return self.rows[0] if self.rows else None

    def fetchall(self) -> list[Any]:
        return self.rows


class RecordingConnection:
    """A sqlite3 connection, and the one cursor the engine's store runs everything on, whose
    statements go to `recorded` (for replay) while `recording` is set."""

    def __init__(self, conn: sqlite3.Connection, recorded: list[Recorded]) -> None:
        self._conn = conn
        self.recorded = recorded
        self.recording = False

    def execute(self, sql: str, params: Any = ()) -> Rows:
        cursor = self._conn.execute(sql, params)
        rows = Rows(cursor.fetchall(), cursor.rowcount, cursor.lastrowid)
        if self.recording:
            self.recorded.append((sql, tuple(params), (rows.rowcount, hash(tuple(rows.rows)))))
        return rows

    def cursor(self) -> RecordingConnection:
        return self

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


class ReplayDiverged(AssertionError):
    """A replayed statement did not do what it did when recorded: the copy was not the state it met."""


@dataclass(frozen=True)
class Replayed:
    """What replay() measured: the median wall seconds of one turn's statements over the turns that
    reused the copy's WAL (`timed` of `turns`; all of them when none did), and the mean thread CPU
    seconds a turn. `commit_median` is the median, over the same turns, of the seconds a turn spent
    in the COMMITs of transactions that changed rows (`commits` of them a turn, on average): what
    the turn's durable commits cost, apart from its other statements."""

    median: float
    cpu: float
    timed: int
    turns: int
    commit_median: float
    commits: float


def commit_split(median: float, commit_median: float, commits: float, floor: float) -> str:
    """How a replayed turn's median splits between its data-changing COMMITs and its other
    statements, as the reports print it (seconds in, `floor` the bare commit's)."""
    each = commit_median / commits if commits else 0.0
    return (f"its {commits:.1f} data-changing COMMITs take {commit_median * 1e3:.2f} ms of it ({each * 1e3:.3f} ms"
            f" each, {each / floor:.2f}x the floor's commit) and its other statements"
            f" {(median - commit_median) * 1e3:.2f} ms ({(median - commit_median) / floor:.1f} floors)")


def reused_wal(timed: int, turns: int) -> str:
    """Which replayed turns a Replayed median is over, as the reports print it."""
    if timed == 0:
        return f"over all {turns} turns, every one of which grew the copy's WAL (about twice a commit's cost)"
    return f"over the {timed} of {turns} turns that reused the copy's WAL"


_BEGIN, _COMMIT = "begin", "commit"  # replay()'s marks of the statements that open and end a transaction


def replay(copy: Path, recorded: list[Recorded], turn_ends: list[int], wal_frames: int = 0) -> Replayed:
    """Run recorded statements again on `copy`, a snapshot taken just before them, by one connection
    on a dedicated thread as the engine's store runs them. `turn_ends[i]` is how many statements had
    been recorded when turn i ended.

    Each statement meets the state it met the first time, so it does the same work and writes the
    same pages; one whose rowcount or rows differ raises ReplayDiverged. The copy's WAL is first
    grown to `wal_frames` frames (what snapshot() returned: the original's) and checkpointed
    (warm_wal). A turn that still grew it (about twice the cost of one that reuses it, see floor())
    is left out of the median, as the timed turns and the floor reuse theirs."""
    latencies: list[tuple[float, bool]] = []
    commit_seconds: list[float] = []  # a turn's data-changing COMMITs, turn by turn
    commit_counts: list[int] = []
    cpu: list[float] = []
    failed: list[BaseException] = []

    def run() -> None:
        conn = sqlite3.connect(copy, isolation_level=None, check_same_thread=False)
        try:
            if wal_frames:
                warm_wal(conn, Path(f"{copy}-wal"), wal_frames)
            wal = WalWarmth(copy)
            cursor = conn.cursor()
            # Which statements begin and commit a transaction, known before the clock starts.
            kinds = [_COMMIT if sql.startswith("COMMIT") else _BEGIN if sql.startswith("BEGIN") else None
                     for sql, _, _ in recorded]
            start = 0
            cpu0 = time.thread_time()
            changes = conn.total_changes  # at the last BEGIN: a COMMIT after more wrote rows
            for end in turn_ends:
                t = time.perf_counter()
                in_commits, commits = 0.0, 0
                for i in range(start, end):
                    sql, params, (rowcount, rows) = recorded[i]
                    kind = kinds[i]
                    if kind is _COMMIT and conn.total_changes != changes:
                        c = time.perf_counter()
                        cursor.execute(sql, params)
                        in_commits += time.perf_counter() - c
                        commits += 1
                    else:
                        if kind is _BEGIN:
                            changes = conn.total_changes
                        cursor.execute(sql, params)
                    got = hash(tuple(cursor.fetchall()))
                    if cursor.rowcount != rowcount or got != rows:
                        raise ReplayDiverged(
                            f"statement {i} ({sql[:60]!r}) gave rowcount {cursor.rowcount} and rows hashing to "
                            f"{got} on replay, {rowcount} and {rows} when recorded: the copy is not the state it "
                            "ran on"
                        )
                latencies.append((time.perf_counter() - t, wal.grew()))
                commit_seconds.append(in_commits)
                commit_counts.append(commits)
                start = end
            cpu.append((time.thread_time() - cpu0) / max(1, len(turn_ends)))
        except BaseException as exc:
            failed.append(exc)
        finally:
            conn.close()

    thread = threading.Thread(target=run, name="replay")
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    reused = [i for i, (_, grew) in enumerate(latencies) if not grew]
    timed = reused or range(len(latencies))
    return Replayed(
        median=statistics.median(latencies[i][0] for i in timed), cpu=cpu[0], timed=len(reused),
        turns=len(latencies), commit_median=statistics.median(commit_seconds[i] for i in timed),
        commits=sum(commit_counts) / max(1, len(commit_counts)),
    )


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
        for n in WalWarmth.of(url).rounds(1):
            await client.start_flow("BenchChain", f"warmup-{n}", WARMUP_CHAIN_STEPS)
            await client.wait_for_flow(f"warmup-{n}", 600)
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
        for n in WalWarmth.of(url).rounds(1):
            await client.start_flow("BenchFan", f"warmup-{n}", None)
            await client.wait_for_flow(f"warmup-{n}", 600)
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


def drop_pg_database(dsn: str, name: str) -> None:
    import psycopg
    from psycopg import sql

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


# Statement and round-trip counters of a benchmark worker process (see `_count_statements`).
counts: dict[str, int] = defaultdict(int)


def _count_statements() -> None:
    """Count, in this process, the statements psycopg sends (by first word), the round trips it
    waits for (a pipeline sync, or a fetch that must wait for a reply) and, from the COMMITs, the
    transactions. Stable under machine load, unlike times."""
    import psycopg
    from psycopg import _pipeline_base

    execute = psycopg.Cursor.execute

    def counted_execute(self: psycopg.Cursor[object], query: object, *args: object, **kwargs: object) -> object:
        word = str(query).lstrip().split(None, 1)[0].upper() if str(query).strip() else ""
        counts["statements"] += 1
        if word in ("BEGIN", "COMMIT"):
            counts[word.lower()] += 1
        return execute(self, query, *args, **kwargs)  # type: ignore[call-overload]

    sync = psycopg.Pipeline.sync

    def counted_sync(self: psycopg.Pipeline) -> None:
        counts["round_trips"] += 1
        sync(self)

    fetch_gen = _pipeline_base.BasePipeline._fetch_gen

    def counted_fetch_gen(self: _pipeline_base.BasePipeline, *, flush: bool) -> object:
        if flush and self.result_queue:
            counts["round_trips"] += 1
        return fetch_gen(self, flush=flush)

    psycopg.Cursor.execute = counted_execute  # type: ignore[assignment,method-assign]
    psycopg.Pipeline.sync = counted_sync  # type: ignore[method-assign]
    _pipeline_base.BasePipeline._fetch_gen = counted_fetch_gen  # type: ignore[assignment,method-assign]


def worker_process_main(url: str, capacity: int = 64, marks_path: str = "") -> None:
    """A benchmark worker process: serves BenchChain until SIGTERM, then writes its Step marks.

    On SIGUSR1 it writes a snapshot of its CPU time and statement counters to `<marks>.snap`,
    so the driver can count only the measured interval."""
    _count_statements()
    if os.environ.get("DEX_BENCH_LANES"):
        from dex_engine import _pg_store

        _pg_store.DEFAULT_POOL_SIZE = int(os.environ["DEX_BENCH_LANES"])
    if os.environ.get("DEX_BENCH_MAX_BATCH"):
        from dex_engine import _pg_store

        _pg_store.MAX_BATCH_OPS = int(os.environ["DEX_BENCH_MAX_BATCH"])
    if os.environ.get("DEX_BENCH_GENERIC_COMMITS"):
        from dex_engine import _pg_store

        _pg_store.BATCH_EXECUTE_COMMITS = False  # each commit through _transitions, as before migration 0002

    if os.environ.get("DEX_BENCH_EACH_COMMITS"):
        from dex_engine import _pg_store

        # A batch through the per-operation function (migration 0002's), as before migration 0003.
        _pg_store._COMMIT_EXECUTE = _pg_store._COMMIT_EXECUTE.replace("dex_commit_execute(", "dex_commit_execute_each(")

    def snapshot() -> None:
        Path(marks_path + ".tmp").write_text(json.dumps({"cpu": time.process_time(), **counts}))
        os.replace(marks_path + ".tmp", marks_path + ".snap")

    async def run() -> None:
        worker = AsyncWorker(Registry([CHAIN]), WorkerOptions(database_url=url, max_concurrent_tasks=capacity))
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        if marks_path:
            loop.add_signal_handler(signal.SIGUSR1, snapshot)
        async with worker:
            await stop.wait()

    if os.environ.get("DEX_BENCH_PROFILE"):
        import cProfile

        profiler = cProfile.Profile(time.thread_time)  # this thread's CPU; the store's lanes are not in it
        profiler.runcall(asyncio.run, run())
        profiler.dump_stats(f"{os.environ['DEX_BENCH_PROFILE']}.{os.getpid()}")
    else:
        asyncio.run(run())
    if marks_path:
        # perf_counter is CLOCK_MONOTONIC on Linux: one clock for every process of the machine.
        Path(marks_path).write_text(json.dumps(marks))


def _with_app_name(url: str, name: str) -> str:
    return f"{url}{'&' if '?' in url else '?'}application_name={name}"


def backend_cpu(url: str, app_name: str) -> float:
    """CPU seconds (user + system) used so far by the server backends serving `app_name` in the
    database of `url`, from /proc (the server runs on this machine)."""
    import psycopg

    tick = os.sysconf("SC_CLK_TCK")
    with psycopg.connect(url, autocommit=True) as conn:
        pids = [int(r[0]) for r in conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND application_name = %s",
            (app_name,),
        )]
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


class Snapshots:
    """CPU and statement counters of the worker processes and of their server backends."""

    def __init__(self, url: str, paths: list[Path], children: list[subprocess.Popen[bytes]]) -> None:
        self.url, self.paths, self.children = url, paths, children

    def take(self) -> dict[str, float]:
        for path in self.paths:
            Path(f"{path}.snap").unlink(missing_ok=True)
        for child in self.children:
            child.send_signal(signal.SIGUSR1)
        server = backend_cpu(self.url, WORKER_APP)
        total: dict[str, float] = defaultdict(float)
        for path in self.paths:
            snap = Path(f"{path}.snap")
            while not snap.exists():
                time.sleep(0.005)
            for key, value in json.loads(snap.read_text()).items():
                total[key] += value
        total["server_cpu"] = server
        return total


WORKER_APP = "dex_bench_worker"
# Flow IDs of the warm-up chains, whose Step marks the latencies leave out.
WARMUP_PREFIX = "warmup-"
# Steps of each warm-up chain by default. A new server session compiles the commit functions and
# plans their statements on first use (pg_stat_statements with track_planning: about 30 ms of
# planning per session), and the pools open their connections as load grows: costs that
# long-running workers pay once, not per Step.
DEFAULT_WARMUP_STEPS = 20


async def drive_chains(
    url: str, concurrency: int, steps: int, processes: int = 1, snapshots: Snapshots | None = None,
    warmup_steps: int = 0,
) -> tuple[float, int, dict[str, float]]:
    """Start `concurrency` chains and wait for them; `processes` worker processes do the work.
    With `warmup_steps`, as many unmeasured chains of that length run first. Returns the wall
    time, the Steps run and, with `snapshots`, what the measured interval cost."""
    store = open_store(_with_app_name(url, "dex_bench_driver"))
    client = AsyncClient(Registry([CHAIN]), store=store)
    try:
        while True:  # the clock starts once every worker process is up
            if len(await store.list_workers()) >= processes:
                break
            await asyncio.sleep(0.05)

        async def chains(prefix: str, length: int) -> None:
            await asyncio.gather(*(client.start_flow("BenchChain", f"{prefix}{i}", length)
                                   for i in range(concurrency)))
            # One cheap query per poll, so the driver adds little load to the server it measures.
            while True:
                if not await store.search_flows(flow_type="BenchChain", status="running", limit=1):
                    return
                await asyncio.sleep(0.01)

        if warmup_steps:
            await chains(WARMUP_PREFIX, warmup_steps)
        before = await asyncio.to_thread(snapshots.take) if snapshots else {}
        t0 = time.perf_counter()
        await chains("chain-", steps)
        wall = time.perf_counter() - t0
        after = await asyncio.to_thread(snapshots.take) if snapshots else {}
        return wall, concurrency * steps, {k: after[k] - before.get(k, 0) for k in after}
    finally:
        await store.close()


def run_chain_processes(
    url: str, processes: int, concurrency: int, steps: int, commits: str = "batched", warmup_steps: int = 0,
) -> tuple[list[float], float, int, dict[str, float]]:
    """Chains on `processes` worker processes, each with an equal share of the concurrency (so that
    the chains spread over them: a chain stays on the worker that first claimed it). With
    `commits` 'generic', the workers commit each Execute through _transitions instead of dex_commit_execute;
    with 'each', through dex_commit_execute_each (one operation after the other, in the server)."""
    capacity = -(-concurrency // processes)
    tmp = Path(tempfile.mkdtemp(prefix="dex-bench-marks-"))
    paths = [tmp / f"marks-{i}.json" for i in range(processes)]
    worker_url = _with_app_name(url, WORKER_APP)
    switch = {"generic": "DEX_BENCH_GENERIC_COMMITS", "each": "DEX_BENCH_EACH_COMMITS"}.get(commits)
    env = {**os.environ, **({switch: "1"} if switch else {})}
    children = [subprocess.Popen([sys.executable, __file__, "--serve", worker_url, str(capacity), str(path)], env=env)
                for path in paths]
    try:
        wall, total, cost = asyncio.run(drive_chains(url, concurrency, steps, processes,
                                                     Snapshots(url, paths, children), warmup_steps))
    finally:
        for child in children:
            child.send_signal(signal.SIGTERM)
        for child in children:
            child.wait(30)
    per_flow: dict[str, list[float]] = defaultdict(list)
    for path in paths:
        for flow_id, times in json.loads(path.read_text()).items():
            if not flow_id.startswith(WARMUP_PREFIX):
                per_flow[flow_id] += times
    gaps = [b - a for times in per_flow.values() for a, b in itertools.pairwise(sorted(times))]
    return gaps, wall, total, cost


def main_postgres(args: argparse.Namespace) -> None:
    if not args.pg_dsn:
        raise SystemExit("--backend postgres needs --pg-dsn postgresql://user@host:port/db (or TEST_PG_DSN)")
    print(f"dex_engine Step benchmark, PostgreSQL {args.pg_dsn}, {os.cpu_count()} cores")
    fl = pg_floor(args.pg_dsn, args.floor_commits)
    f_med = statistics.median(fl)
    print(f"\nfloor: bare commit on one connection: median {f_med * 1e3:.3f} ms  p95 {pct(fl, 0.95) * 1e3:.3f} ms")
    print(f"\n{'workload':<46}{'median ms':>10}{'p95 ms':>8}{'x floor':>8}{'Steps/s':>8}"
          f"{'CPU ms/Step: worker':>21}{'server':>7}{'stmts':>7}{'trips':>7}{'txns':>6}")
    for processes, concurrency, path in itertools.product(args.workers, args.concurrency, args.commits):
        # Long enough that starting the chains (64 start_flow calls, their first claims by polls) and
        # the tail (the last chains finishing alone) are a small part of the measured interval.
        steps = args.chain_steps or {1: 200, 16: 100}.get(concurrency, 100)
        # Named per run, so that two runs at once do not drop each other's database.
        name = f"dex_bench_{os.getpid()}_{processes}_{concurrency}"
        url = fresh_pg_database(args.pg_dsn, name)
        try:
            gaps, wall, total, cost = run_chain_processes(url, processes, concurrency, steps, path,
                                                          args.warmup_steps)
        finally:
            drop_pg_database(args.pg_dsn, name)
        med = statistics.median(gaps)
        label = f"chain of no-op Steps, c={concurrency}, {processes} process(es)"
        if len(args.commits) > 1:
            label = f"c={concurrency}, {processes} proc, {path} commits"
        print(f"{label:<46}{med * 1e3:>10.3f}{pct(gaps, 0.95) * 1e3:>8.3f}{med / f_med:>8.1f}"
              f"{total / wall:>8.0f}{cost['cpu'] * 1e3 / total:>21.2f}{cost['server_cpu'] * 1e3 / total:>7.2f}"
              f"{cost['statements'] / total:>7.1f}{cost['round_trips'] / total:>7.2f}"
              f"{cost['commit'] / total:>6.2f}", flush=True)
    print(f"\nMeasured after {args.warmup_steps} unmeasured Steps per chain (--warmup-steps), which open the"
          "\nconnections and let each server session compile the commit functions."
          "\nper-Step latency: time between consecutive Step starts in one flow. Each worker process runs"
          "\nat most c/processes Steps at once, so the chains spread over the processes. Per Step, over the"
          "\nmeasured interval: CPU of the worker processes and of the server backends serving them (from"
          "\n/proc; the server's background writers are not counted), statements and round trips the"
          "\nworkers' psycopg sent and waited for, and transactions they committed (polls included).")


COMMIT_PATHS = ("batched", "each", "generic")


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, by name, the numbers no run can use: every median needs a sample (a chain of one Step has
    no gap between Step starts), and an unknown --commits would silently run as 'batched'."""
    if args.chain_steps != 0 and args.chain_steps < 2:
        parser.error(f"--chain-steps must be 0 (by concurrency) or at least 2, got {args.chain_steps}")
    if args.floor_commits < 1:
        parser.error(f"--floor-commits must be at least 1, got {args.floor_commits}")
    if args.warmup_steps < 0:
        parser.error(f"--warmup-steps must be 0 or more, got {args.warmup_steps}")
    for name, counts in (("--workers", args.workers), ("--concurrency", args.concurrency)):
        if not counts or min(counts) < 1:
            parser.error(f"{name} must be counts of at least 1, got {','.join(map(str, counts))}")
    unknown = [path for path in args.commits if path not in COMMIT_PATHS]
    if unknown:
        parser.error(f"--commits takes {', '.join(COMMIT_PATHS)}, got {','.join(unknown)}")


def main() -> None:
    if len(sys.argv) >= 3 and sys.argv[1] == "--serve":
        if len(sys.argv) == 5:
            worker_process_main(sys.argv[2], int(sys.argv[3]), sys.argv[4])
        else:
            worker_process_main(sys.argv[2])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sync", choices=["FULL", "NORMAL"], default="FULL")
    parser.add_argument("--chain-steps", type=int, default=0, help="Steps per chain (default: by concurrency)")
    parser.add_argument("--floor-commits", type=int, default=1000)
    parser.add_argument("--warmup-steps", type=int, default=DEFAULT_WARMUP_STEPS,
                        help="PostgreSQL: unmeasured Steps per chain run first (0: none)")
    parser.add_argument("--backend", choices=["sqlite", "postgres"], default="sqlite")
    parser.add_argument("--pg-dsn", default=os.environ.get("TEST_PG_DSN", ""))
    parser.add_argument("--workers", default="1,2,4", type=lambda s: [int(x) for x in s.split(",")],
                        help="PostgreSQL: worker process counts (default 1,2,4)")
    parser.add_argument("--concurrency", default="1,16,64", type=lambda s: [int(x) for x in s.split(",")],
                        help="PostgreSQL: chains run at once (default 1,16,64)")
    parser.add_argument("--commits", default="batched", type=lambda s: s.split(","),
                        help="PostgreSQL: 'batched' (dex_commit_execute), 'each' (dex_commit_execute_each, "
                             "one operation after the other), 'generic' (_transitions), or several, comma-"
                             "separated: each configuration runs with each, one after the other")
    args = parser.parse_args()
    check_args(parser, args)
    if args.backend == "postgres":
        main_postgres(args)
        return
    tmp = Path(tempfile.mkdtemp(prefix="dex-bench-"))
    print(f"dex_engine Step benchmark, SQLite WAL synchronous={args.sync}, {os.cpu_count()} cores, files in {tmp}")
    growing: list[float] = []
    fl = floor(str(tmp / "floor.db"), args.sync, args.floor_commits, growing)
    f_med, f_p95 = statistics.median(fl), pct(fl, 0.95)
    print(f"\nfloor: bare commit on a dedicated thread into a reused WAL: median {f_med * 1e3:.3f} ms  "
          f"p95 {f_p95 * 1e3:.3f} ms (into a growing WAL: median {statistics.median(growing) * 1e3:.3f} ms)")
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
