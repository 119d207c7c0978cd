"""Benchmark: thousands of idle agent sessions (waiting for a message or an approval) and one Worker.

Prints figures, checks no thresholds. On one database (a new SQLite file, or a PostgreSQL database
named by --pg-dsn, created and dropped here) it:

1. starts --sessions sessions with AgentSessionClient.start_session, --batch at once (gather);
   --approvals of them start with a message whose turn asks for the approval of one write;
2. starts one Worker child process (default WorkerOptions but the lease, --lease seconds) and
   times its registration and how long until every session waits (the first Steps of all);
3. reads its RSS, then its CPU use over --idle seconds of idleness;
4. sends a message to --probes random waiting sessions, one at a time, and times each answer;
5. times search_flows('ActiveStepTypes = "AwaitToolApproval"');
6. holds --midturn sessions inside their model call (a FileGate), SIGKILLs the Worker, releases the
   gates, starts a new Worker and times until all their turns ended;
7. with --timers N: N more sessions whose approval deadline (--deadline seconds) falls while the
   Worker is stopped; times, from a new Worker's start, the answer to a message sent then and
   until every deadline fired and its turn ended.

The sessions run the tests' scripted runner (agents/tests/scripted_agent.py): no model is called.

Run: uv run --frozen python bench/idle_sessions.py [--sessions 10000] [--pg-dsn DSN] [--timers 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlparse, urlunparse

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from agents.tests.scripted_agent import ENV_DEADLINE_SECONDS, build_flow  # noqa: E402

from dex_agents import AgentSessionClient, AgentSnapshot  # noqa: E402
from dex_agents.testing import ENV_DATABASE_URL, ENV_STATE_DIR, FileGate, wait_until  # noqa: E402
from dex_engine import AsyncClient, AsyncWorker, Registry, WorkerOptions  # noqa: E402

APPROVAL_SCRIPT = json.dumps({"steps": [
    {"tools": [{"id": "w", "name": "write_refund", "args": {"amount": 5}}]}, {"answer": "{results}"},
]})
ENV_LEASE = "IDLE_BENCH_LEASE_SECONDS"


def worker_main() -> None:
    url = os.environ[ENV_DATABASE_URL]
    lease = float(os.environ[ENV_LEASE])
    options = WorkerOptions(database_url=url, lease_ttl_seconds=lease, lease_renew_seconds=lease / 3)
    worker = AsyncWorker(Registry([build_flow()]), options)

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, lambda: asyncio.ensure_future(worker.stop()))
        await worker.run()

    asyncio.run(serve())


def spawn_worker(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen([sys.executable, __file__, "--worker"], env=env, stdout=out,
                                stderr=subprocess.STDOUT, cwd=REPO_ROOT)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Bench:
    def __init__(self, url: str, state: Path, lease: float, deadline: float | None) -> None:
        self.url, self.state, self.lease, self.deadline = url, state, lease, deadline
        if deadline is not None:
            os.environ[ENV_DEADLINE_SECONDS] = str(deadline)
        os.environ[ENV_STATE_DIR] = str(state)
        self.flow = build_flow(state)
        self.client = AsyncClient(Registry([self.flow]), url)
        self.sessions = AgentSessionClient(self.client, self.flow)
        self.worker: subprocess.Popen[bytes] | None = None

    async def start_worker(self) -> tuple[float, int]:
        env = dict(os.environ, **{ENV_DATABASE_URL: self.url, ENV_STATE_DIR: str(self.state),
                                  ENV_LEASE: str(self.lease), "PYTHONUNBUFFERED": "1"})
        started = time.perf_counter()
        self.worker = spawn_worker(env, self.state / f"worker-{time.time_ns()}.log")
        while not any(row[2] == self.worker.pid for row in await self.client.store.list_workers()):
            if self.worker.poll() is not None:
                raise SystemExit(f"worker exited: {self.worker.returncode}")
            await asyncio.sleep(0.02)
        return time.perf_counter() - started, self.worker.pid

    async def create(self, ids: list[str], batch: int, message: str | None) -> float:
        started = time.perf_counter()
        for i in range(0, len(ids), batch):
            await asyncio.gather(*(self.sessions.start_session(s, message) for s in ids[i:i + batch]))
        return time.perf_counter() - started

    async def count(self, step: str) -> int:
        return len(await self.client.search_flows(f'ActiveStepTypes = "{step}"', limit=100_000))

    async def wait_count(self, step: str, n: int, timeout: float = 1800) -> float:
        started = time.perf_counter()
        while await self.count(step) < n:
            if time.perf_counter() - started > timeout:
                raise SystemExit(f"timed out waiting for {n} sessions in {step}")
            await asyncio.sleep(0.25)
        return time.perf_counter() - started

    async def answered(self, session_id: str, turns: int) -> AgentSnapshot:
        while True:
            snap = await self.sessions.get_agent_snapshot(session_id)
            if snap.state is not None and snap.state.turn_count >= turns and snap.state.active_turn_id is None:
                return snap
            await asyncio.sleep(0.005)


def line(name: str, value: str) -> None:
    print(f"{name:<58} {value}", flush=True)


async def run(args: argparse.Namespace, url: str, state: Path) -> None:
    bench = Bench(url, state, args.lease, args.deadline if args.timers else None)
    n, approvals = args.sessions, args.approvals
    plain = [f"idle-{i}" for i in range(n - approvals)]
    asking = [f"approve-{i}" for i in range(approvals)]
    seconds = await bench.create(plain, args.batch, None)
    line(f"create {len(plain)} sessions, batches of {args.batch}", f"{seconds:.1f} s ({len(plain) / seconds:.0f}/s)")
    seconds = await bench.create(asking, args.batch, APPROVAL_SCRIPT)
    line(f"create {len(asking)} sessions asking for approval", f"{seconds:.1f} s")
    registered, pid = await bench.start_worker()
    line("worker start-up (spawn to registered)", f"{registered:.2f} s, RSS {rss_mb(pid):.0f} MB")
    seconds = await bench.wait_count("AwaitUserMessage", len(plain))
    seconds += await bench.wait_count("AwaitToolApproval", len(asking))
    line(f"until all {n} sessions wait", f"{seconds + registered:.1f} s from spawn, RSS {rss_mb(pid):.0f} MB")
    await asyncio.sleep(2)
    before, t0 = cpu_seconds(pid), time.perf_counter()
    await asyncio.sleep(args.idle)
    cpu = cpu_seconds(pid) - before
    line(f"worker idle CPU over {args.idle:.0f} s", f"{100 * cpu / (time.perf_counter() - t0):.2f}% of a core, "
         f"RSS {rss_mb(pid):.0f} MB")
    latencies = []
    for session_id in random.sample(plain, args.probes):
        t = time.perf_counter()
        await bench.sessions.send_user_message(session_id, "hello")
        await bench.answered(session_id, 1)
        latencies.append(time.perf_counter() - t)
    latencies.sort()
    line(f"message to a random session answered ({args.probes} probes)",
         f"median {1000 * latencies[len(latencies) // 2]:.0f} ms, max {1000 * latencies[-1]:.0f} ms")
    times = []
    for _ in range(5):
        t = time.perf_counter()
        found = await bench.client.search_flows('ActiveStepTypes = "AwaitToolApproval"')
        times.append(time.perf_counter() - t)
    line(f"search_flows AwaitToolApproval ({len(found)} found)", f"best {1000 * min(times):.1f} ms of 5")
    await midturn(bench, args, plain, pid)
    if args.timers:
        await timers(bench, args, plain)
    if bench.worker is not None:
        bench.worker.kill()
        bench.worker.wait()
    await bench.client.close()


async def midturn(bench: Bench, args: argparse.Namespace, plain: list[str], pid: int) -> None:
    chosen = random.sample(plain[args.probes:], args.midturn)
    gates = [FileGate(bench.state, f"gate-{i}") for i in range(len(chosen))]
    for i, session_id in enumerate(chosen):
        script = json.dumps({"steps": [{"answer": "done", "gate": f"gate-{i}"}]})
        await bench.sessions.send_user_message(session_id, script)
    for gate in gates:
        await wait_until(f"{gate.name} reached", lambda gate=gate: gate.reached, timeout=600)
    assert bench.worker is not None
    os.kill(pid, signal.SIGKILL)
    bench.worker.wait()
    for gate in gates:
        gate.release()
    t = time.perf_counter()
    registered, pid = await bench.start_worker()
    snaps = await asyncio.gather(*(bench.answered(s, 1) for s in chosen))
    line(f"{args.midturn} sessions mid-turn after SIGKILL: all ended (lease {args.lease:.0f} s)",
         f"{time.perf_counter() - t:.1f} s after restart (registered in {registered:.2f} s), "
         f"{sum(1 for s in snaps if s.messages[-1].text == 'done')} answered")


async def timers(bench: Bench, args: argparse.Namespace, plain: list[str]) -> None:
    """--timers sessions wait for an approval whose deadline falls while no Worker runs, so the next
    Worker's first housekeeping fires them all at once; a message is sent as it starts."""
    ids = [f"timer-{i}" for i in range(args.timers)]
    t = time.perf_counter()
    await bench.create(ids, args.batch, APPROVAL_SCRIPT)
    await bench.wait_count("AwaitToolApproval", args.approvals + args.timers)
    waited = time.perf_counter() - t
    line(f"{args.timers} more sessions waiting for approval (deadline {args.deadline:.0f} s)", f"in {waited:.1f} s")
    assert bench.worker is not None
    bench.worker.send_signal(signal.SIGTERM)
    await asyncio.to_thread(bench.worker.wait)
    await asyncio.sleep(max(0.0, t + args.deadline + waited + 1 - time.perf_counter()))
    probe = random.choice(plain[args.probes + args.midturn:])
    started = time.perf_counter()
    await bench.start_worker()
    await bench.sessions.send_user_message(probe, "hello")
    await bench.answered(probe, 1)
    line("message sent as a Worker starts with them all due", f"answered in {time.perf_counter() - started:.1f} s")

    async def fired() -> bool:
        return await bench.count("AwaitToolApproval") <= args.approvals

    await wait_until("every deadline to fire", fired, timeout=1800, interval=0.25)
    line(f"all {args.timers} deadlines fired and their turns ended",
         f"{time.perf_counter() - started:.1f} s after it started")


def pg_database(dsn: str) -> tuple[str, Any]:
    import psycopg

    name = f"dex_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    parts = urlparse(dsn)

    def drop() -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")

    return urlunparse(parts._replace(path=f"/{name}")), drop


def main() -> None:
    if "--worker" in sys.argv:
        worker_main()
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=10_000, help="sessions in all (default 10,000)")
    parser.add_argument("--approvals", type=int, default=100,
                        help="of them, sessions left waiting for an approval (default 100)")
    parser.add_argument("--batch", type=int, default=200, help="sessions started at once (default 200)")
    parser.add_argument("--idle", type=float, default=30.0, help="seconds the Worker's idle CPU is measured over")
    parser.add_argument("--probes", type=int, default=20, help="messages sent to random idle sessions, one at a time")
    parser.add_argument("--midturn", type=int, default=50, help="sessions mid-turn when the Worker is killed")
    parser.add_argument("--lease", type=float, default=5.0, help="the Worker's lease, seconds (default 5)")
    parser.add_argument("--timers", type=int, default=0,
                        help="more sessions waiting for an approval whose --deadline falls due at about one time")
    parser.add_argument("--deadline", type=float, default=60.0, help="those approvals' deadline, seconds (default 60)")
    parser.add_argument("--pg-dsn",
                        help="run on this PostgreSQL server (creates and drops a database) instead of SQLite")
    args = parser.parse_args()
    idle_sessions = args.sessions - args.approvals
    if min(args.approvals, args.probes, args.midturn, args.timers) < 0 or args.batch < 1:
        parser.error("--approvals, --probes, --midturn and --timers must be at least 0, and --batch at least 1")
    if idle_sessions < args.probes + args.midturn + 1:
        parser.error(f"--sessions ({args.sessions}) must leave, beside --approvals ({args.approvals}), at least "
                     f"--probes + --midturn + 1 ({args.probes + args.midturn + 1}) idle sessions to send messages to")
    if not (args.idle >= 0 and args.lease > 0 and args.deadline > 0):
        parser.error(f"--idle must be at least 0 and --lease and --deadline above 0, got {args.idle}, {args.lease}, "
                     f"{args.deadline}")
    with tempfile.TemporaryDirectory(prefix="dex-idle-") as tmp:
        state = Path(tmp)
        if args.pg_dsn:
            url, drop = pg_database(args.pg_dsn)
            try:
                asyncio.run(run(args, url, state))
            finally:
                drop()
        else:
            asyncio.run(run(args, f"sqlite:///{state / 'dex.db'}", state))


if __name__ == "__main__":
    main()
