"""`dex-agents chat`: a terminal chat with the demo agent on the embedded engine.

The Worker runs in this process; the session lives in a SQLite file (./.dex by default), so after
Ctrl-C or a crash the same command resumes the same session, pending approvals included.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

from rich.console import Console

from dex_engine import AsyncClient, AsyncWorker, Registry, WorkerOptions

from .._client import AgentSessionClient
from .._wire import AgentInterrupt, AgentSnapshot, InterruptKind
from ._agent import build_demo_flow
from ._model import HELP_TEXT

# The chat's Worker lives in this process; a short lease lets a restarted chat take over the
# Steps a killed one was running within seconds instead of the production default of 30 s.
CHAT_LEASE_TTL_SECONDS = 5.0
# Messages of an existing session shown when the chat resumes it.
RESUME_MESSAGES_SHOWN = 10
# How long one read of the AgentEvents Stream waits for new events.
EVENT_WAIT_SECONDS = 1.0
TURN_END_EVENTS = frozenset({"turn_completed", "turn_failed", "turn_steered", "turn_cancelled"})


async def _ask(prompt: str) -> str | None:
    """One line from the terminal, or None at end of input (Ctrl-D or a closed pipe)."""
    try:
        return await asyncio.to_thread(input, prompt)
    except EOFError:
        return None


class Chat:
    def __init__(self, console: Console, sessions: AgentSessionClient, session_id: str) -> None:
        self.console = console
        self.sessions = sessions
        self.session_id = session_id
        self.token: str | None = None

    async def open(self) -> None:
        """Start the session, or resume it: show its latest messages and answer what waits."""
        if not await self.sessions.client.exists(self.session_id):
            await self.sessions.start_session(self.session_id)
            self.console.print(f"[dim]new session {self.session_id!r}; type /help for the demo model's commands, "
                               "Ctrl-D to leave[/dim]")
            return
        snapshot = await self.sessions.get_agent_snapshot(self.session_id)
        self.console.print(f"[dim]resuming session {self.session_id!r}[/dim]")
        for message in snapshot.messages[-RESUME_MESSAGES_SHOWN:]:
            if message.text:
                self.console.print(f"[bold]{message.role.value}>[/bold] {message.text}")
        self.token = (await self.sessions.read_agent_events(self.session_id, limit=1_000_000)).resume_token
        if _turn_running(snapshot):
            self.console.print("[dim]a turn is still running; following it[/dim]")
            await self._answer_pending(snapshot.pending_interrupts)
            await self.follow_turn()

    async def run(self) -> None:
        await self.open()
        while True:
            text = await _ask("you> ")
            if text is None:
                return
            text = text.strip()
            if not text:
                continue
            if text in ("/quit", "/exit"):
                return
            if text == "/help":
                self.console.print(HELP_TEXT)
            if self.token is None:
                self.token = (await self.sessions.read_agent_events(self.session_id, limit=1_000_000)).resume_token
            await self.sessions.send_user_message(self.session_id, text)
            await self.follow_turn()

    async def follow_turn(self) -> None:
        """Print the turn's live events until it ends, asking for approvals inline."""
        while True:
            read = await self.sessions.read_agent_events(self.session_id, self.token, wait_seconds=EVENT_WAIT_SECONDS)
            self.token = read.resume_token
            for event in read.events:
                kind, payload = event.value.type, json.loads(event.value.payload)
                if kind == "text_delta":
                    self.console.print(f"[green]agent>[/green] {payload['text']}")
                elif kind == "tool_call_started":
                    self.console.print(f"[dim]  running {payload['tool_name']}...[/dim]")
                elif kind == "tool_call_finished":
                    self.console.print(f"[dim]  {payload['tool_name']}: {payload['status']}[/dim]")
                elif kind == "interrupt_raised":
                    snapshot = await self.sessions.get_agent_snapshot(self.session_id)
                    await self._answer_pending(snapshot.pending_interrupts)
                elif kind == "timer_started":
                    self.console.print(f"[dim]  waiting until {payload['wait_until']} ({payload['reason']}); "
                                       "the Timer is durable: Ctrl-C and come back later[/dim]")
                elif kind == "turn_failed":
                    self.console.print(f"[red]the turn failed: {payload['error']}[/red]")
                if kind in TURN_END_EVENTS:
                    return

    async def _answer_pending(self, interrupts: list[AgentInterrupt]) -> None:
        for interrupt in interrupts:
            if interrupt.kind is InterruptKind.QUESTION:
                await self._answer_question(interrupt)
                continue
            answer = await _ask(f"approve {interrupt.tool_name} {interrupt.arguments}? [y/n] ")
            if answer is None:
                raise EOFError
            approved = answer.strip().lower() in ("y", "yes")
            done = await self.sessions.resolve_interrupt(self.session_id, interrupt.interrupt_id, approved)
            if not done:
                self.console.print("[dim]  that approval is no longer pending[/dim]")


    async def _answer_question(self, interrupt: AgentInterrupt) -> None:
        choices = f" [{' / '.join(interrupt.choices)}]" if interrupt.choices else ""
        answer = await _ask(f"{interrupt.question}{choices} (empty line declines) ")
        if answer is None:
            raise EOFError
        if not answer.strip():
            await self.sessions.resolve_interrupt(self.session_id, interrupt.interrupt_id, approved=False)
            return
        if not await self.sessions.answer_question(self.session_id, interrupt.interrupt_id, answer.strip()):
            self.console.print("[dim]  that answer was not taken (not a choice, or no longer pending)[/dim]")
            if _still_pending_choice(interrupt, answer):
                await self._answer_question(interrupt)


def _still_pending_choice(interrupt: AgentInterrupt, answer: str) -> bool:
    """Ask again only for an answer outside the choices; anything else is gone for good."""
    return bool(interrupt.choices) and not interrupt.allows_free_text and answer.strip() not in interrupt.choices


def _turn_running(snapshot: AgentSnapshot) -> bool:
    return snapshot.state is not None and snapshot.state.active_turn_id is not None


async def run_chat(console: Console, data_dir: Path, session_id: str) -> int:
    """Chat until end of input; `data_dir` must exist."""
    url = f"sqlite:///{data_dir / 'agents.db'}"
    flow = build_demo_flow(data_dir / "demo-ledger.jsonl")
    registry = Registry([flow])
    client = AsyncClient(registry, url)
    worker = AsyncWorker(registry, WorkerOptions(
        database_url=url, lease_ttl_seconds=CHAT_LEASE_TTL_SECONDS, lease_renew_seconds=CHAT_LEASE_TTL_SECONDS / 5,
    ))
    worker_task = asyncio.create_task(worker.run())
    try:
        await Chat(console, AgentSessionClient(client, flow), session_id).run()
    except EOFError:
        pass
    finally:
        await worker.stop()
        with contextlib.suppress(asyncio.CancelledError):
            await worker_task
        await client.close()
        console.print(f"[dim]session {session_id!r} is saved in {data_dir}; run the same command to resume it[/dim]")
    return 0
