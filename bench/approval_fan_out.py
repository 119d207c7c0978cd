"""Benchmark: approving a wide fan-out, one approval after another.

One model response asks for N tool calls that each need approval; once all N are pending, a client
approves them one after another (`AgentSessionClient.resolve_interrupt`, each awaited) and the turn
ends. Each approval wakes that call's AwaitToolApproval Step, which holds PendingInterrupts while it
runs, so the next approval usually meets it (RpcLockConflictError) and the client tries again: what
an approval costs here is mostly how soon that retry comes, and how much of PendingInterrupts (all
N pending interrupts) each Step and RPC reads.

For each N (--sizes) and backend (SQLite, and PostgreSQL with --pg-dsn or $TEST_PG_DSN), on a new
database, it prints the time from the first approval to the turn's end, per approval, the median
and p95 of one resolve_interrupt call, and the bare commit floor measured in the same run. The
Worker runs in this process on the client's Store (as an app that runs both would), or with
--worker-process in a child process, as a deployment with separate Worker processes does.

Prints figures, checks no thresholds; it does check that every approval was taken and that the turn
ended with its answer.

Run: uv run --frozen python bench/approval_fan_out.py [--sizes 10,100,300] [--worker-process]
     [--pg-dsn DSN] [--no-sqlite]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from dex_agents import (
    AgentSessionClient,
    AgentSessionFlow,
    AgentTurnContext,
    AgentTurnOutcome,
    DeferredToolCall,
    DeferredToolExecution,
    FrameworkMessage,
    MessageRole,
    ToolCallsRequested,
    ToolEffect,
    ToolExecutionResult,
    ToolPolicy,
    TurnCompleted,
)
from dex_agents.testing import run_agent_worker
from dex_engine import AsyncClient, AsyncWorker, Registry, WorkerOptions, open_store
from engine_steps import drop_pg_database, floor, fresh_pg_database, pct, pg_floor

SESSION = "fan-out"
FLOW_TYPE = "FanOutBench"
FLOOR_COMMITS = 500
# How long to wait for the N calls to be pending, and for the turn to end once all are approved.
SETTLE_SECONDS = 600.0


class FanOutRunner:
    """The turn: one response asking for `size` approval-requiring writes, then a final answer."""

    def __init__(self, size: int) -> None:
        self.size = size

    def build_user_message(self, text: str) -> FrameworkMessage:
        return FrameworkMessage(MessageRole.USER, json.dumps({"role": "user", "text": text}), text=text)

    async def run_model_step(self, turn: AgentTurnContext) -> AgentTurnOutcome:
        if turn.framework_run_state is None:
            policy = ToolPolicy(ToolEffect.IDEMPOTENT_WRITE, requires_approval=True)
            calls = [DeferredToolCall(f"c{i}", "write", "{}", policy) for i in range(self.size)]
            return ToolCallsRequested(json.dumps({"asked": self.size}), calls)
        answer = f"{self.size} writes done"
        return TurnCompleted([FrameworkMessage(MessageRole.ASSISTANT, json.dumps({"text": answer}), text=answer)])

    async def execute_deferred_tool_call(self, call: DeferredToolExecution) -> ToolExecutionResult:
        return ToolExecutionResult("written")


def fan_out_flow(size: int) -> AgentSessionFlow:
    return AgentSessionFlow(FanOutRunner(size), flow_type=FLOW_TYPE)


async def wait_for(sessions: AgentSessionClient, size: int, done: str) -> None:
    """Poll the snapshot until `done` ("pending": all `size` calls wait for approval; "ended": turn 1
    ended with the runner's answer)."""
    deadline = time.monotonic() + SETTLE_SECONDS
    while time.monotonic() < deadline:
        snapshot = await sessions.get_agent_snapshot(SESSION)
        if done == "pending" and len(snapshot.pending_interrupts) == size:
            return
        if done == "ended" and snapshot.state is not None and snapshot.state.turn_count == 1:
            last = snapshot.messages[-1].text if snapshot.messages else None
            if last != f"{size} writes done":
                raise AssertionError(f"turn 1 ended with {last!r}, not the answer: {snapshot.state!r}")
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"session not {done} after {SETTLE_SECONDS} s")


async def approve_all(url: str, size: int, worker_process: bool) -> tuple[float, list[float]]:
    """Seconds from the first approval to the turn's end, and each resolve_interrupt call's seconds."""
    flow = fan_out_flow(size)
    registry = Registry([flow])
    store = open_store(url)
    sessions = AgentSessionClient(AsyncClient(registry, store=store), flow)
    child: asyncio.subprocess.Process | None = None
    worker: AsyncWorker | None = None
    try:
        if worker_process:
            child = await asyncio.create_subprocess_exec(sys.executable, __file__, "--serve", url, "--size", str(size))
        else:
            worker = AsyncWorker(registry, WorkerOptions(database_url=url, max_concurrent_tasks=64), store=store)
            await worker.__aenter__()
        await sessions.start_session(SESSION, "write them all")
        await wait_for(sessions, size, "pending")
        calls: list[float] = []
        t0 = time.perf_counter()
        for i in range(size):
            t = time.perf_counter()
            if not await sessions.resolve_interrupt(SESSION, f"c{i}", approved=True):
                raise AssertionError(f"approval of c{i} refused")
            calls.append(time.perf_counter() - t)
        await wait_for(sessions, size, "ended")
        return time.perf_counter() - t0, calls
    finally:
        if worker is not None:
            await worker.stop()
        if child is not None:
            child.terminate()
            await asyncio.wait_for(child.wait(), 30)
        await store.close()


def sqlite_floor_ms() -> float:
    with tempfile.TemporaryDirectory() as d:
        return statistics.median(floor(str(Path(d) / "floor.db"), "FULL", FLOOR_COMMITS)) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="10,100,300", help="comma-separated fan-out widths")
    parser.add_argument("--worker-process", action="store_true", help="run the Worker in a child process")
    parser.add_argument("--pg-dsn", default=os.environ.get("TEST_PG_DSN"), help="also on PostgreSQL")
    parser.add_argument("--no-sqlite", action="store_true")
    parser.add_argument("--serve", metavar="URL", help=argparse.SUPPRESS)  # the --worker-process child
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        run_agent_worker([fan_out_flow(args.size)], database_url=args.serve)
        return
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        parser.error(f"--sizes must be comma-separated whole numbers, got {args.sizes!r}")
    if not sizes or min(sizes) < 1:
        parser.error(f"--sizes must each be at least 1, got {args.sizes!r}")
    backends: list[str] = ([] if args.no_sqlite else ["sqlite"]) + (["postgresql"] if args.pg_dsn else [])
    if not backends:
        parser.error("--no-sqlite needs --pg-dsn (or $TEST_PG_DSN)")
    placement = "a child process" if args.worker_process else "this process"
    print(f"approving a fan-out of N calls one after another; Worker in {placement}")
    print(f"{'backend':<11}{'N':>6}{'total s':>10}{'ms/approval':>13}{'call median ms':>16}{'call p95 ms':>13}"
          f"{'floor ms':>10}")
    for backend in backends:
        for size in sizes:
            if backend == "sqlite":
                with tempfile.TemporaryDirectory() as d:
                    total, calls = asyncio.run(approve_all(f"sqlite:///{d}/fan.db", size, args.worker_process))
                floor_ms = sqlite_floor_ms()
            else:
                name = f"bench_fan_out_{size}"
                try:
                    url = fresh_pg_database(args.pg_dsn, name)
                    total, calls = asyncio.run(approve_all(url, size, args.worker_process))
                    floor_ms = statistics.median(pg_floor(url, FLOOR_COMMITS)) * 1e3
                finally:
                    drop_pg_database(args.pg_dsn, name)
            print(f"{backend:<11}{size:>6}{total:>10.2f}{total / size * 1e3:>13.2f}"
                  f"{statistics.median(calls) * 1e3:>16.2f}{pct(calls, 0.95) * 1e3:>13.2f}{floor_ms:>10.3f}",
                  flush=True)


if __name__ == "__main__":
    main()
