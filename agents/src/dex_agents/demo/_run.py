"""`dex-agents demo`: one command that shows what durability means for an agent session.

It starts a session whose first message asks for a refund (a write that needs approval), kills the
Worker process while the session waits for the person, starts a new Worker, approves, and prints the
turn's timeline (AgentEvents) and Step history. The refund runs exactly once.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from dex_engine import AsyncClient, Registry

from .._client import AgentSessionClient
from .._session_flow import AgentSessionFlow
from ..testing import (
    ENV_PARENT_PID,
    StepHistoryEntry,
    executed_steps,
    to_step_history,
    wait_for_agent_snapshot,
    wait_until,
)
from ._agent import ENV_LEDGER, build_demo_flow, read_ledger

DEMO_SESSION_ID = "demo-session"
REFUND_MESSAGE = '/tool refund_order {"order_id": "A-1001", "amount_cents": 1500}'
# The whole demo normally takes a few seconds; this bounds a broken machine.
DEMO_TIMEOUT_SECONDS = 90.0


def data_dir_problem(directory: Path) -> str | None:
    """Why the demo cannot run in `directory`, or None. It starts from nothing and never deletes
    what it did not write, so the directory must be new or empty."""
    if not directory.exists():
        return None
    if not directory.is_dir():
        return f"{str(directory)!r} is not a directory"
    held = sorted(entry.name for entry in directory.iterdir())
    if held:
        shown = ", ".join(held[:5]) + (f" and {len(held) - 5} more" if len(held) > 5 else "")
        return (f"{str(directory)!r} is not empty (it holds {shown}); the demo starts from nothing and deletes "
                "nothing it did not write: name a new or empty directory")
    return None


class DemoError(Exception):
    """The demo cannot go on (its Worker exited as it started); the message says why."""


class _Worker:
    """The demo's Worker, a child process in its own process group; it kills itself if the demo
    process dies without stopping it (SIGKILL, say)."""

    def __init__(self, database_url: str, ledger: Path, log_path: Path) -> None:
        env = dict(os.environ, **{ENV_LEDGER: str(ledger), "PYTHONUNBUFFERED": "1", ENV_PARENT_PID: str(os.getpid())})
        self.log_path = log_path
        with log_path.open("ab") as log:
            # -P: the working directory is not searched first, so a `dex_agents` of the user's own
            # there (a project's folder) is not imported in place of this one.
            self.process = subprocess.Popen(
                [sys.executable, "-P", "-m", "dex_agents.demo.worker", database_url], env=env,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )

    def kill(self) -> None:
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


async def _registered(client: AsyncClient, worker: _Worker) -> None:
    async def seen() -> bool:
        if worker.process.poll() is not None:
            # Its log is read now: a temporary directory goes with the demo.
            lines = worker.log_path.read_text(errors="replace").strip().splitlines()
            raise DemoError(f"the demo Worker exited with code {worker.process.returncode} as it started; the last "
                            f"line of its log {str(worker.log_path)!r}: {lines[-1] if lines else '(empty)'}")
        return any(row[2] == worker.process.pid for row in await client.store.list_workers())

    await wait_until("the demo Worker to start", seen)


async def run_demo(console: Console, data_dir: Path | None = None) -> int:
    """Run the demo in `data_dir` (a fresh temporary directory by default, else one data_dir_problem
    accepts: the command checks it, naming its option); returns an exit code."""
    own_dir = data_dir is None
    directory = Path(tempfile.mkdtemp(prefix="dex-agents-demo-")) if data_dir is None else data_dir
    directory.mkdir(parents=True, exist_ok=True)
    database = directory / "demo.db"
    ledger = directory / "ledger.jsonl"
    url = f"sqlite:///{database}"
    flow = build_demo_flow(ledger)
    client = AsyncClient(Registry([flow]), url)
    workers: list[_Worker] = []
    try:
        async with asyncio.timeout(DEMO_TIMEOUT_SECONDS):
            return await _story(console, client, flow, url, ledger, directory, workers)
    finally:
        for worker in workers:
            worker.stop()
        await client.close()
        if own_dir:
            shutil.rmtree(directory, ignore_errors=True)


async def _story(
    console: Console, client: AsyncClient, flow: AgentSessionFlow, url: str, ledger: Path, directory: Path,
    workers: list[_Worker],
) -> int:
    sessions = AgentSessionClient(client, flow)
    started = time.monotonic()

    def say(text: str) -> None:
        console.print(f"[dim]{time.monotonic() - started:5.1f}s[/dim]  {text}")

    console.rule("[bold]dex-agents demo: a durable agent session")
    say(f"engine: embedded SQLite at {directory / 'demo.db'}")
    workers.append(_Worker(url, ledger, directory / "worker-1.log"))
    await _registered(client, workers[0])
    say(f"Worker 1 started (pid {workers[0].process.pid})")
    await sessions.start_session(DEMO_SESSION_ID, REFUND_MESSAGE)
    say(f"session {DEMO_SESSION_ID!r} started with the user message: [cyan]{REFUND_MESSAGE}[/cyan]")
    interrupt = await wait_for_agent_snapshot(
        sessions, DEMO_SESSION_ID, lambda s: next(iter(s.pending_interrupts), None),
        description="the refund's approval",
    )
    say(f"the model asked for [bold]{interrupt.tool_name}[/bold] {interrupt.arguments}: a non-idempotent write,"
        " so the session waits in AwaitToolApproval")
    waiting = await client.search_flows('ActiveStepTypes = "AwaitToolApproval"')
    say(f"search_flows('ActiveStepTypes = \"AwaitToolApproval\"') finds {waiting}")
    workers[0].kill()
    say("[red]Worker 1 killed with SIGKILL[/red] while the session waits (no Worker holds the wait)")
    workers.append(_Worker(url, ledger, directory / "worker-2.log"))
    await _registered(client, workers[1])
    say(f"Worker 2 started (pid {workers[1].process.pid})")
    approved = await sessions.resolve_interrupt(DEMO_SESSION_ID, interrupt.interrupt_id, approved=True)
    say(f"a person approves the refund: resolve_interrupt -> {approved}")
    again = await sessions.resolve_interrupt(DEMO_SESSION_ID, interrupt.interrupt_id, approved=True)
    say(f"approving twice is refused: resolve_interrupt -> {again}")
    snapshot = await wait_for_agent_snapshot(
        sessions, DEMO_SESSION_ID, lambda s: s if s.state is not None and s.state.turn_count >= 1 else None,
        description="the turn to complete",
    )
    answer = snapshot.messages[-1].text if snapshot.messages else None
    say(f"the turn completed; the agent answered: [green]{answer}[/green]")
    refunds = read_ledger(ledger)
    say(f"refunds in the payment ledger: [bold]{len(refunds)}[/bold] (idempotency key "
        f"{refunds[0]['idempotency_key'] if refunds else '-'})")
    await _print_timeline(console, sessions)
    history = to_step_history(await client.get_flow_history(DEMO_SESSION_ID))
    _print_history(console, history)
    console.print(f"Step shape: {' -> '.join(executed_steps(history))}")
    ok = len(refunds) == 1 and snapshot.state is not None and snapshot.state.last_turn_error is None
    console.rule("[green]the write ran exactly once across a Worker kill[/green]" if ok else "[red]unexpected result")
    return 0 if ok else 1


async def _print_timeline(console: Console, sessions: AgentSessionClient) -> None:
    events = (await sessions.read_agent_events(DEMO_SESSION_ID)).events
    table = Table(title="Turn timeline (AgentEvents)", show_lines=False)
    for column in ("#", "event", "Step execution", "try", "what"):
        table.add_column(column)
    for event in events:
        value = event.value
        table.add_row(str(event.sequence), value.type, value.step_execution_id, str(value.attempt),
                      _summary(value.type, json.loads(value.payload)))
    console.print(table)


def _summary(event_type: str, payload: dict[str, Any]) -> str:
    """One short line per event for the demo's table (the full payload is in the Stream)."""
    if event_type == "turn_started":
        return f"user message {payload['sequence']}"
    if event_type in ("text_delta", "reasoning_delta"):
        return str(payload["text"])
    if event_type == "usage_recorded":
        return f"model calls so far: {payload['session']['model_calls']}"
    if event_type == "tool_call_deferred":
        approval = ", needs approval" if payload["requires_approval"] else ""
        return f"{payload['tool_name']} ({payload['effect']}{approval})"
    if event_type == "interrupt_raised":
        return f"waiting for a person to approve {payload['tool_name']}"
    if event_type == "interrupt_resolved":
        return "approved" if payload["approved"] else f"rejected: {payload['rejection_message']}"
    if event_type in ("tool_call_started", "tool_call_finished"):
        status = payload.get("status")
        return f"{payload['tool_name']}{': ' + status if status else ''}"
    if event_type == "turn_completed":
        return f"{payload['message_count']} messages stored"
    return json.dumps(payload)[:60]


def _print_history(console: Console, history: list[StepHistoryEntry]) -> None:
    table = Table(title="Step history (the engine's record)")
    for column in ("event", "Step", "Step execution", "attempt"):
        table.add_column(column)
    for entry in history:
        table.add_row(entry.event_type, entry.step_type, entry.step_execution_id, str(entry.final_attempt))
    console.print(table)
