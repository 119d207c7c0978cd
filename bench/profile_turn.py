"""Profile one agent turn in-process: CPU per turn, store operations, commits and fsyncs per turn.

Runs agent_turn.py's dex turn (scripted runner, the built-in loop with --builtin, or with
--engine-shape the turn's Steps on the bare engine, no agent layer) on one SQLite file, N turns one
after another (or spread over --sessions sessions at once), after warm-up turns, and prints what a
turn costs in the quantities that stay stable on a loaded machine:

- CPU ms per turn: the whole process, the event loop thread (its user and system time) and the
  SQLite thread separately;
- store operations per turn, by kind, and how many ran on the event loop (SqliteStore._inline)
  rather than through a hand-off to the SQLite thread;
- data-changing commits and fsyncs per turn, and SQLite batches (transactions) per turn;
- with --profile, a cProfile of the event loop thread (and with --profile-db, of the SQLite
  thread), sorted by --sort (tottime or cumulative), top --top rows;
- with --replay, the turns' own SQL statements, recorded with their parameters and run again on a
  copy of the database taken before the turns, on one thread with no engine or agent code around
  them: what the turn's SQLite work costs by itself (the part of a turn no Python change removes);
- three floors measured in the same run, after the turns: a bare fsynced commit, the same commit
  also rewriting a row of as many pages as one of a turn's commits writes, and a hand-off
  from the event loop to a thread and back (how the store reaches its SQLite thread), each in
  wall and CPU time; with the commits counted, what a sequential turn's hand-offs and fsynced
  commits cost at those floors.

Run: uv run python bench/profile_turn.py [--turns N] [--sessions N] [--builtin] [--profile]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import cProfile
import io
import os
import pstats
import queue
import resource
import sqlite3
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent_turn import (
    TURNS_PER_SEQUENTIAL_SESSION,
    CommitCounter,
    DexTurn,
    TurnWatcher,
    bind_turn,
    builtin_loop_flow,
    engine_shape_flow,
    scripted_runner_flow,
    sequential_plan,
    session_plan,
)
from dex_engine import AsyncWorker, WorkerOptions
from dex_engine._sqlite_store import SqliteStore
from dex_engine._transitions import Db
from engine_steps import (
    Recorded,
    RecordingConnection,
    Rows,
    WalWarmth,
    commit_split,
    floor,
    replay,
    reused_wal,
    snapshot,
)


def wal_size(wal: Path) -> int:
    """Bytes in the WAL file (0 when there is none); a quick stat between measured turns."""
    try:
        return os.stat(wal).st_size
    except FileNotFoundError:
        return 0


def page_size(db: Path) -> int:
    """The database file's page size (a WAL frame holds one page)."""
    conn = sqlite3.connect(db)
    try:
        return int(conn.execute("PRAGMA page_size").fetchone()[0])
    finally:
        conn.close()


def wal_pages_by_btree(db: Path, start: int, end: int) -> collections.Counter[str]:
    """The pages of the WAL frames between byte offsets `start` and `end`, by the b-tree (table or
    index) that holds each page now (dbstat); pages no b-tree holds count as "(free or overflow)"."""
    size = page_size(db)
    conn = sqlite3.connect(db)
    try:
        owner = {int(pageno): str(name) for name, pageno in conn.execute("SELECT name, pageno FROM dbstat")}
    finally:
        conn.close()
    counts: collections.Counter[str] = collections.Counter()
    with open(f"{db}-wal", "rb") as wal:
        offset = max(start, 32)  # the WAL header
        wal.seek(offset)
        while offset + 24 + size <= end:
            header = wal.read(24)
            counts[owner.get(int.from_bytes(header[:4], "big"), "(free or overflow)")] += 1
            wal.seek(size, os.SEEK_CUR)
            offset += 24 + size
    return counts


def thread_cpu_ns(native_id: int | None) -> int:
    """On-CPU nanoseconds of one thread of this process (Linux schedstat)."""
    if native_id is None:
        return 0
    try:
        with open(f"/proc/self/task/{native_id}/schedstat") as f:
            return int(f.read().split()[0])
    except OSError:
        return 0


FLOOR_SAMPLES = 1000  # per floor: about a second at this machine's speeds, enough for a stable median
# WAL pages of the heavy floor's commit: about what one of a turn's commits writes (--wal-frames: 14.9).
HEAVY_FLOOR_PAGES = 15

# cProfile's clock: this thread's CPU time, so waits (fsync, the GIL, idle loops) do not count.
_CLOCK: list[Callable[[], float]] = [time.thread_time]


def _profiler() -> cProfile.Profile:
    return cProfile.Profile(_CLOCK[0])


class _TimedConnection(RecordingConnection):
    """A sqlite3 connection whose execute() adds its thread CPU time to the store's per-SQL totals,
    and records the statements for --replay, while the store is profiling."""

    def __init__(self, conn: Any, store: ProfilingStore) -> None:
        super().__init__(conn, store.recorded if store.recorded is not None else [])
        self._store = store

    def execute(self, sql: str, params: Any = ()) -> Rows:
        t = time.thread_time()
        self.recording = self._store.profiling and self._store.recorded is not None
        rows = super().execute(sql, params)
        if self._store.profiling and self._store.sql_times is not None:
            entry = self._store.sql_times.setdefault(" ".join(sql.split())[:110], [0.0, 0])
            entry[0] += time.thread_time() - t
            entry[1] += 1
        return rows


class ProfilingStore(SqliteStore):
    """The engine's SQLite store, counting operations, batches and commits; optionally profiled."""

    def __init__(self, url: str, counter: CommitCounter | None, profile_db: bool, sql: bool = False,
                 no_checkpoints: bool = False, record: bool = False) -> None:
        self.no_checkpoints = no_checkpoints
        self.counter = counter
        self.ops: collections.Counter[str] = collections.Counter()
        self.batches = 0
        self.inlined = 0  # operations run on the event loop rather than handed to the SQLite thread
        self.profiler: cProfile.Profile | None = _profiler() if profile_db else None
        self.profiling = False
        self.native_id: int | None = None
        # CPU seconds and count per SQL statement text, while profiling (with --sql).
        self.sql_times: dict[str, list[float]] | None = {} if sql else None
        # Statements and parameters of the store's connection, in order, while profiling (--replay).
        self.recorded: list[Recorded] | None = [] if record else None
        super().__init__(url)

    def _connect(self) -> Any:
        self.native_id = threading.get_native_id()
        conn = super()._connect()
        if self.no_checkpoints:
            conn.execute("PRAGMA wal_autocheckpoint = 0")  # the WAL only grows: its size counts frames
        if self.counter is not None:
            self.counter.attach(conn)
        timed = self.sql_times is not None or self.recorded is not None
        return _TimedConnection(conn, self) if timed else conn

    def _execute(self, conn: Any, db: Any, batch: list[Any], level: str) -> Any:
        self.batches += 1
        # Only on the store's thread: an operation run inline is in the event loop's profile.
        if self.profiler is not None and self.profiling and threading.get_native_id() == self.native_id:
            self.profiler.enable()
            try:
                return super()._execute(conn, db, batch, level)
            finally:
                self.profiler.disable()
        return super()._execute(conn, db, batch, level)

    def _inline(self, op: Any, loop: asyncio.AbstractEventLoop) -> bool:
        ran = super()._inline(op, loop)
        self.inlined += ran
        return ran

    async def _run(self, fn: Callable[[Db], Any], *, write: bool, durable: bool | None = None) -> Any:
        name = getattr(fn, "__qualname__", repr(fn)).replace(".<locals>", "").replace(".<lambda>", "")
        parts = name.split(".")
        # Store methods that build a nested `op` are named after the method.
        self.ops[parts[-2] if parts[-1] == "op" and len(parts) > 1 else parts[-1]] += 1
        return await super()._run(fn, write=write, durable=durable)


async def run(args: argparse.Namespace, path: Path) -> None:
    url = f"sqlite:///{path}"
    counter = None if args.no_count else CommitCounter()
    store = ProfilingStore(url, counter, args.profile_db, args.sql, args.wal_frames, record=args.replay)
    wal = Path(f"{path}-wal")
    make: Callable[[TurnWatcher], DexTurn] = (builtin_loop_flow if args.builtin else
                                              engine_shape_flow if args.engine_shape else scripted_runner_flow)
    bound = bind_turn(store, make)
    watcher, registry, client, calls = bound.watcher, bound.registry, bound.client, bound.calls
    plan = (sequential_plan(args.turns, args.session_turns) if args.sessions == 1
            else session_plan(args.turns, args.sessions))
    options = WorkerOptions(database_url=url, max_concurrent_tasks=max(64, 4 * len(plan)), poll_seconds=args.poll)

    async def start(session_id: str) -> None:
        await calls.start(session_id)
        await watcher.wait_started(session_id)

    turn_ends: list[int] = []  # with --replay: how many statements were recorded when each turn ended

    async def turns(session_id: str, count: int, first: int = 0) -> None:
        for done in range(first, first + count):
            await calls.send(session_id)
            await watcher.wait_turn(session_id, done + 1)
            if store.profiling and store.recorded is not None:
                turn_ends.append(len(store.recorded))

    ids = [f"s-{i}" for i in range(len(plan))]
    profiler = _profiler() if args.profile else None
    main_id = threading.get_native_id()
    async with AsyncWorker(registry, options, store=store):
        await start("warmup")
        # As agent_turn's phases: on until the WAL stops growing, unless checkpoints are off (--wal-frames).
        for n in WalWarmth(None if args.wal_frames else path).rounds(args.warmup):
            await turns("warmup", 1, first=n)
        await asyncio.gather(*(start(s) for s in ids))
        replay_wal = snapshot(path, path.with_name("replay.db")) if args.replay else 0
        commits0, ops0, batches0 = _totals(counter), collections.Counter(store.ops), store.batches
        inlined0 = store.inlined
        wal0 = wal_size(wal)
        cpu0, main0, db0 = time.process_time(), thread_cpu_ns(main_id), thread_cpu_ns(store.native_id)
        usage0 = resource.getrusage(resource.RUSAGE_THREAD)  # this is the event loop thread
        t0 = time.perf_counter()
        store.profiling = True
        if profiler is not None:
            profiler.enable()
        if args.sessions == 1:
            for sid, count in zip(ids, plan, strict=True):
                await turns(sid, count)
        else:
            await asyncio.gather(*(turns(sid, count) for sid, count in zip(ids, plan, strict=True)))
        if profiler is not None:
            profiler.disable()
        store.profiling = False
        wall = time.perf_counter() - t0
        cpu, main_cpu = time.process_time() - cpu0, thread_cpu_ns(main_id) - main0
        usage1 = resource.getrusage(resource.RUSAGE_THREAD)
        user, system = usage1.ru_utime - usage0.ru_utime, usage1.ru_stime - usage0.ru_stime
        db_cpu = thread_cpu_ns(store.native_id) - db0
        commits1, batches = _totals(counter), store.batches - batches0
        wal1 = wal_size(wal)
        pages = wal_pages_by_btree(path, wal0, wal1) if args.wal_frames else collections.Counter()
        ops = store.ops - ops0
        inlined = store.inlined - inlined0
        if args.history:
            history = await client.get_flow_history(ids[-1])
    bound.unbind()
    await store.close()
    commit_wall, commit_cpu = commit_floor(path.with_name("floor.db"), FLOOR_SAMPLES)
    # As many WAL pages as one of a turn's commits writes, most of them pages that exist (as a turn's
    # are), rewritten by one statement: what the volume alone costs.
    heavy_pages = HEAVY_FLOOR_PAGES
    heavy_wall, heavy_cpu = commit_floor(path.with_name("floor-heavy.db"), FLOOR_SAMPLES, heavy_pages)
    handoff_wall, handoff_cpu = await handoff_floor(FLOOR_SAMPLES)
    replayed = None
    if store.recorded is not None:
        replayed = replay(path.with_name("replay.db"), store.recorded, turn_ends, replay_wal)
    if args.history:
        print(f"history of {ids[-1]}, last {args.history} events:")
        for h in history[-args.history:]:
            print(f"  {h.at_ms % 100000:>6} {h.event_type:<18} {h.step_execution_id:<28} #{h.attempt} {h.detail[:50]}")

    n = args.turns
    kind = "built-in loop" if args.builtin else "the turn's Steps on the bare engine" if args.engine_shape else (
        "scripted runner")
    print(f"{n} turns, {args.sessions} session(s) at once, {kind}, "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"wall {wall / n * 1e3:.2f} ms/turn ({n / wall:.1f} turns/s)")
    print(f"CPU  {cpu / n * 1e3:.2f} ms/turn (event loop thread {main_cpu / n / 1e6:.2f}: user {user / n * 1e3:.2f}, "
          f"system {system / n * 1e3:.2f}; SQLite thread {db_cpu / n / 1e6:.2f})")
    counted = ("commits not counted (--no-count), " if counter is None else
               f"commits {(commits1[0] - commits0[0]) / n:.2f}/turn, fsyncs {(commits1[1] - commits0[1]) / n:.2f}/turn"
               " (the counter's trace callback adds SQLite thread CPU; --no-count leaves it out), ")
    print(f"{counted}SQLite transactions {batches / n:.2f}/turn, store operations {sum(ops.values()) / n:.2f}/turn, "
          f"{inlined / n:.2f} of them run on the event loop, the others handed to the SQLite thread:")
    for name, count in ops.most_common():
        print(f"  {name:<24} {count / n:6.2f}")
    if args.wal_frames:
        frames = (wal1 - wal0) / (page_size(path) + 24)  # a WAL frame: a 24-byte header and a page
        per_commit = ("" if counter is None else
                      f", {frames / max(1, commits1[0] - commits0[0]):.1f} per data-changing commit")
        print(f"WAL frames (pages written) {frames / n:.1f}/turn{per_commit} (autocheckpoint off)")
        for name, count in pages.most_common():
            print(f"  {name:<28} {count / n:6.2f} pages/turn")
    if store.sql_times is not None:
        total = sum(times for _spent, times in store.sql_times.values())
        print(f"\nSQL statements: {total / n:.1f}/turn; by thread CPU (ms per turn, count per turn):")
        for sql, (spent, times) in sorted(store.sql_times.items(), key=lambda kv: -kv[1][0])[:args.top]:
            print(f"  {spent / n * 1e3:7.3f} {times / n:6.2f}  {sql}")
    print(f"floors: bare fsynced commit {commit_wall * 1e3:.3f} ms ({commit_cpu * 1e3:.3f} ms CPU), "
          f"event loop -> thread -> event loop {handoff_wall * 1e3:.3f} ms ({handoff_cpu * 1e3:.3f} ms CPU); "
          f"the bare commit also rewriting a row of about {heavy_pages} pages {heavy_wall * 1e3:.3f} ms "
          f"({heavy_cpu * 1e3:.3f} ms CPU)")
    if replayed is not None:
        print(f"the turns' {len(store.recorded or ()) / n:.1f} statements a turn, replayed alone on a copy of the "
              f"database: median {replayed.median * 1e3:.3f} ms a turn ({replayed.median / commit_wall:.1f}x the bare "
              f"commit; {reused_wal(replayed.timed, replayed.turns)}), "
              f"{replayed.cpu * 1e3:.3f} ms CPU; of the turn's {wall / n * 1e3:.2f} ms wall and "
              f"{cpu / n * 1e3:.2f} ms CPU; "
              + commit_split(replayed.median, replayed.commit_median, replayed.commits, commit_wall))
    if counter is not None and args.sessions == 1:
        handoffs, fsyncs = (sum(ops.values()) - inlined) / n, (commits1[1] - commits0[1]) / n
        least = handoffs * handoff_wall + fsyncs * commit_wall
        print(f"a sequential turn's {handoffs:.2f} hand-offs and {fsyncs:.2f} fsynced commits at these floors: "
              f"{least * 1e3:.2f} ms of its {wall / n * 1e3:.2f} ms "
              f"({(handoffs * handoff_cpu + fsyncs * commit_cpu) * 1e3:.2f} ms of its {cpu / n * 1e3:.2f} ms CPU)")
    for label, prof in (("event loop thread", profiler), ("SQLite thread", store.profiler)):
        if prof is None:
            continue
        out = io.StringIO()
        stats = pstats.Stats(prof, stream=out)
        stats.sort_stats(args.sort).print_stats(args.top)
        if args.callers:
            stats.print_callers(args.callers)
        print(f"\n--- cProfile, {label}, sorted by {args.sort} ---")
        print(out.getvalue())


def commit_floor(path: Path, n: int, rewrite_pages: int = 0) -> tuple[float, float]:
    """Median wall and mean CPU seconds of a bare fsynced commit into a reused WAL (engine_steps.floor),
    also rewriting a row of about `rewrite_pages` pages."""
    cpu: list[float] = []
    latencies = floor(str(path), "FULL", n, cpu=cpu, rewrite_pages=rewrite_pages)
    return statistics.median(latencies), cpu[0] / n


async def handoff_floor(n: int) -> tuple[float, float]:
    """Median wall and mean CPU seconds of one event loop -> thread -> event loop round trip.

    The same mechanism as the store's: a SimpleQueue to the thread, call_soon_threadsafe back.
    """
    inbox: queue.SimpleQueue[asyncio.Future[None] | None] = queue.SimpleQueue()
    loop = asyncio.get_running_loop()

    def serve() -> None:
        while (future := inbox.get()) is not None:
            loop.call_soon_threadsafe(future.set_result, None)

    thread = threading.Thread(target=serve, name="handoff-floor")
    thread.start()
    latencies: list[float] = []
    cpu0 = time.process_time()
    try:
        for _ in range(n):
            t = time.perf_counter()
            future: asyncio.Future[None] = loop.create_future()
            inbox.put(future)
            await future
            latencies.append(time.perf_counter() - t)
    finally:
        inbox.put(None)
        thread.join()
    return statistics.median(latencies), (time.process_time() - cpu0) / n


def _totals(counter: CommitCounter | None) -> tuple[int, int]:
    return (0, 0) if counter is None else counter.totals()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--turns", type=int, default=100)
    parser.add_argument("--sessions", type=int, default=1, help="1: sequential turns; more: sessions at once")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--session-turns", type=int, default=TURNS_PER_SEQUENTIAL_SESSION,
                        help="sequential turns per session before a fresh one (a long session's turns cost more)")
    parser.add_argument("--poll", type=float, default=0.02, help="WorkerOptions.poll_seconds")
    turn = parser.add_mutually_exclusive_group()
    turn.add_argument("--builtin", action="store_true", help="the built-in loop instead of the scripted runner")
    turn.add_argument("--engine-shape", action="store_true",
                      help="the turn's Steps, waits and commits on the bare engine, with no agent layer")
    parser.add_argument("--profile", action="store_true", help="cProfile the event loop thread")
    parser.add_argument("--profile-db", action="store_true", help="cProfile the SQLite thread's batches")
    parser.add_argument("--sort", default="tottime", choices=["tottime", "cumulative", "ncalls"])
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--callers", default="", help="also print the callers of functions matching this regex")
    parser.add_argument("--history", type=int, default=0, help="print the last N history events of a session")
    parser.add_argument("--wal-frames", action="store_true", help="turn WAL checkpoints off and count pages written")
    parser.add_argument("--sql", action="store_true", help="CPU time per SQL statement text")
    parser.add_argument("--replay", action="store_true",
                        help="run the turns' SQL statements again on a copy of the database, alone (--sessions 1)")
    parser.add_argument("--no-count", action="store_true",
                        help="leave the commit counter (an SQLite trace callback, which costs CPU) off")
    parser.add_argument("--wall", action="store_true", help="profile wall time instead of thread CPU time")
    args = parser.parse_args()
    if args.session_turns < 1:
        parser.error(f"--session-turns must be at least 1 (turns per session), got {args.session_turns}")
    if args.replay and args.sessions != 1:
        parser.error(f"--replay replays sequential turns: it needs --sessions 1, got --sessions {args.sessions}")
    if args.wall:
        _CLOCK[0] = time.perf_counter
    with tempfile.TemporaryDirectory(prefix="dex-profile-turn-") as tmp:
        asyncio.run(run(args, Path(tmp) / "turn.db"))


if __name__ == "__main__":
    main()
