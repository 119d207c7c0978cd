"""`dex-agents chat`: a terminal chat with the demo agent on the embedded engine.

The Worker runs in this process; the session lives in a SQLite file (./.dex by default), so after
Ctrl-C or a crash the same command resumes the same session, pending approvals included.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from dex_engine import (
    AsyncClient,
    AsyncWorker,
    DexError,
    FlowNotActiveError,
    FlowNotFoundError,
    InvalidResumeTokenError,
    InvalidValueError,
    Registry,
    WorkerOptions,
)

from .._client import AgentSessionClient
from .._wire import AgentInterrupt, AgentPlan, AgentSnapshot, AgentToolCallStatus, InterruptKind, PlanStatus
from ._agent import build_demo_flow
from ._full_disk import FullDiskWatch, until_disk_full
from ._lines import CANCEL_COMMAND, STEER_COMMAND, TerminalLines, UndecodableLineError, is_control
from ._model import HELP_TEXT

# The chat's Worker lives in this process; a short lease lets a restarted chat take over the
# Steps a killed one was running within seconds instead of the production default of 30 s.
CHAT_LEASE_TTL_SECONDS = 5.0
# Messages of an existing session shown when the chat resumes it.
RESUME_MESSAGES_SHOWN = 10
# How long one read of the AgentEvents Stream waits for new events.
EVENT_WAIT_SECONDS = 1.0
TURN_END_EVENTS = frozenset({"turn_completed", "turn_failed", "turn_steered", "turn_cancelled"})
# What an approval prompt takes; anything else asks again.
APPROVAL_ANSWERS = {"y": True, "yes": True, "n": False, "no": False}


CHAT_HELP_TEXT = (
    "While a turn runs:\n"
    "  /steer TEXT                steer the running turn with TEXT (it ends at its next safe point)\n"
    "  /cancel                    stop the running turn\n"
    "  anything else              is sent when the turn has ended\n"
    "/quit or Ctrl-D leaves; the session is saved."
)


class Chat:
    def __init__(self, console: Console, sessions: AgentSessionClient, session_id: str,
                 lines: TerminalLines) -> None:
        self.console = console
        self.sessions = sessions
        self.session_id = session_id
        self.lines = lines
        self.token: str | None = None

    async def _ask(self, prompt: str) -> str | None:
        """One line from the terminal after `prompt`, or None at end of input; a line that is not
        text is refused, and `prompt` asked again."""
        while True:
            self.console.print(prompt, end="", markup=False, highlight=False)
            try:
                return await self.lines.next()
            except UndecodableLineError as error:
                self.console.print(f"  {error}", style="red", markup=False, highlight=False)

    async def open(self) -> None:
        """Start the session, or resume it: show its latest messages and answer what waits."""
        if not await self.sessions.client.exists(self.session_id):
            await self.sessions.start_session(self.session_id)
            self.console.print(f"[dim]new session {escape(repr(self.session_id))}; type /help for the demo model's "
                               "commands, Ctrl-D to leave[/dim]")
            return
        await self._resume(f"resuming session {self.session_id!r}")

    async def _resume(self, header: str) -> None:
        """Show the session as stored after `header` (its latest messages, what waits) and follow a
        turn that runs; the chat reads its events on from their end."""
        await self._require_open()
        # The events' end first, then the snapshot: a turn that ends between the two is seen ending.
        await self._skip_to_end()
        snapshot = await self.sessions.get_agent_snapshot(self.session_id)
        self.console.print(f"[dim]{escape(header)}[/dim]")
        for message in snapshot.messages[-RESUME_MESSAGES_SHOWN:]:
            if message.text:
                self.console.print(f"[bold]{message.role.value}>[/bold] {escape(message.text)}")
        if _busy(snapshot):
            self.console.print("[dim]a turn is still running; following it[/dim]")
            # Its timer_started event is behind the events' end: say what the turn waits for, or
            # the chat shows nothing until the Timer fires (up to max_durable_wait later).
            for call in snapshot.tool_calls:
                if call.status is AgentToolCallStatus.WAITING_FOR_TIMER and call.wait_until is not None:
                    self._show_wait(call.wait_until, _wait_reason(call.arguments))
            await self._answer_pending(snapshot.pending_interrupts)
            await self.follow_turn(snapshot.state.active_turn_id if snapshot.state else None)
        await self.offer_plan()  # a draft left from the last run still waits for its review

    async def run(self) -> None:
        await self._in_sync(self.open())
        while True:
            text = await self._ask("you> ")
            if text is None:
                return
            text = text.strip()
            if not text:
                continue
            if text in ("/quit", "/exit"):
                return
            if text == "/help":  # answered here, not sent: a turn would print the model's commands again
                self.console.print(HELP_TEXT)
                self.console.print(CHAT_HELP_TEXT)
                continue
            if is_control(text):
                self.console.print("[dim]  no turn is running; /steer and /cancel apply to a running turn[/dim]")
                continue
            try:
                await self._skip_to_end()  # what happened while this chat waited for a line is not its reply
            except InvalidResumeTokenError:
                # The line was written for the conversation shown, which is not the one stored now.
                await self._resync()
                self.console.print("  that message was not sent; type it again to send it to the session shown "
                                   "above", style="red", markup=False)
                continue
            try:
                await self.sessions.send_user_message(self.session_id, text, plan_mode=wants_plan_mode(text))
            except InvalidValueError as error:  # too large to send, say: that line only, the chat goes on
                self.console.print(f"  that message was not sent: {error}", style="red", markup=False)
                continue
            await self._in_sync(self._reply())

    async def _reply(self) -> None:
        await self.follow_turn()
        await self.offer_plan()

    async def _in_sync(self, work: Coroutine[Any, Any, None]) -> None:
        """Run `work`; when the session's events refuse the chat's resume token, show the session
        again from its snapshot instead (seed 003: a UI whose token is refused loads the snapshot)."""
        try:
            await work
        except InvalidResumeTokenError:
            await self._resync()

    async def _resync(self) -> None:
        """The events this chat read on from are not the session's any more: it was deleted and
        started again under its ID (another chat, `dex-engine delete`), or a database crash lost
        events the chat showed. Say so and show the session as stored, reading its events from the
        start (the token the engine refused means nothing now)."""
        while True:
            self.token = None
            try:
                await self._resume(f"session {self.session_id!r} is not as this chat showed it (it was deleted and "
                                   "started again, or a database crash lost events); showing it as stored")
                return
            except InvalidResumeTokenError:
                continue  # replaced again while it was read: read the newest one from the start

    async def offer_plan(self) -> None:
        """Show a draft plan and ask whether to execute it; yes runs it as an executing turn."""
        plan = (await self.sessions.get_agent_snapshot(self.session_id)).plan
        if plan is None or plan.status is not PlanStatus.DRAFT:
            return
        for line in plan_lines(plan):
            self.console.print(line, markup=False)
        answer = await self._ask(f"execute plan revision {plan.revision}? [y/n] ")
        if answer is None:
            raise EOFError
        if answer.strip().lower() not in ("y", "yes"):
            self.console.print("[dim]  not executed: send feedback to revise the plan[/dim]")
            return
        if not await self.sessions.execute_plan(self.session_id, plan.revision):
            self.console.print("[dim]  that plan can no longer be executed (it changed, or a message is waiting)[/dim]")
            return
        await self.follow_turn()

    async def follow_turn(self, turn_id: str | None = None) -> None:
        """Print the session's live events until no turn runs or waits to start, asking for
        approvals inline and applying /steer and /cancel lines typed meanwhile (to `turn_id`, or
        the turn that starts)."""
        while True:
            if turn_id is not None:
                await self._apply_control(turn_id)
            read = await self.sessions.read_agent_events(self.session_id, self.token, wait_seconds=EVENT_WAIT_SECONDS)
            self.token = read.resume_token
            if read.flow_closed and not read.events:
                await self._require_open()  # stopped meanwhile (dex-engine stop): no event will come
            ended = False
            for event in read.events:  # the whole batch: its token is taken, so what is left is lost
                kind, payload = event.value.type, json.loads(event.value.payload)
                if kind == "turn_started":
                    turn_id = event.value.turn_id
                elif kind in TURN_END_EVENTS:
                    ended, turn_id = True, None
                await self._show(kind, payload)
            if ended:
                # A turn that ends can start the next at once (its steered messages, even when it
                # was cancelled), or leave a message queued behind it (another chat's, or a steer
                # queued as it ended): follow on until the session is idle.
                snapshot = await self.sessions.get_agent_snapshot(self.session_id)
                if not _busy(snapshot):
                    return
                turn_id = snapshot.state.active_turn_id if snapshot.state else None

    async def _show(self, kind: str, payload: dict[str, Any]) -> None:
        """One live event as the chat shows it; an interrupt is asked for at once."""
        if kind == "text_delta":
            self.console.print(f"[green]agent>[/green] {escape(payload['text'])}")
        elif kind == "tool_call_started":
            self.console.print(f"[dim]  running {escape(payload['tool_name'])}...[/dim]")
        elif kind == "tool_call_finished":
            self.console.print(f"[dim]  {escape(payload['tool_name'])}: {payload['status']}[/dim]")
        elif kind == "interrupt_raised":
            snapshot = await self.sessions.get_agent_snapshot(self.session_id)
            await self._answer_pending(snapshot.pending_interrupts)
        elif kind == "timer_started":
            self._show_wait(payload["wait_until"], payload["reason"])
        elif kind == "plan_updated":
            self.console.print(f"[dim]  plan revision {payload['revision']} is {payload['status']} "
                               f"({payload['task_count']} tasks)[/dim]")
        elif kind == "turn_failed":
            self.console.print(f"[red]the turn failed: {escape(payload['error'])}[/red]")
        elif kind == "turn_steered":
            self.console.print("[dim]  turn steered; the steered message starts the next turn[/dim]")
        elif kind == "turn_cancelled":
            self.console.print("[dim]  turn cancelled[/dim]")

    def _show_wait(self, wait_until: str, reason: str) -> None:
        self.console.print(f"[dim]  waiting until {escape(wait_until)} ({escape(reason)}); "
                           "the Timer is durable: Ctrl-C and come back later[/dim]")

    async def _skip_to_end(self) -> None:
        """Move past every event written so far (another chat's turns, say), page by page."""
        while True:
            read = await self.sessions.read_agent_events(self.session_id, self.token)
            self.token = read.resume_token
            if not read.events:
                return

    async def _require_open(self) -> None:
        """FlowNotActiveError when the session's Flow has ended (stopped, failed): it takes nothing more."""
        info = await self.sessions.client.describe_flow(self.session_id)
        if info.status != "running":
            raise FlowNotActiveError(self.session_id, info.status)

    async def _apply_control(self, turn_id: str) -> None:
        """Steer or cancel the running turn with a /steer or /cancel line typed meanwhile."""
        line = self.lines.take_control()
        if line is not None:
            await self._control(line.strip(), turn_id)

    async def _control_at_prompt(self, answer: str) -> bool:
        """Apply a /steer or /cancel typed at an approval or question prompt, as /help says they act
        while a turn runs (not taken for the answer); whether it was one."""
        if not is_control(answer.strip()):
            return False
        snapshot = await self.sessions.get_agent_snapshot(self.session_id)
        turn_id = snapshot.state.active_turn_id if snapshot.state else None
        if turn_id is None:
            self.console.print("[dim]  no turn is running; /steer and /cancel apply to a running turn[/dim]")
        else:
            await self._control(answer.strip(), turn_id)
        return True

    async def _control(self, text: str, turn_id: str) -> None:
        if text == CANCEL_COMMAND:
            done = await self.sessions.cancel_turn(self.session_id, turn_id)
        else:
            done = await self.sessions.steer_user_message(
                self.session_id, text=text.removeprefix(STEER_COMMAND).strip())
        if not done:
            self.console.print("[dim]  the turn could not be steered or cancelled (it may have ended)[/dim]")

    async def _answer_pending(self, interrupts: list[AgentInterrupt]) -> None:
        for interrupt in interrupts:
            if interrupt.kind is InterruptKind.QUESTION:
                await self._answer_question(interrupt)
                continue
            while True:  # anything but yes or no asks again: an empty line or a typo must not reject
                answer = await self._ask(f"approve {interrupt.tool_name} {interrupt.arguments}? [y/n] ")
                if answer is None:
                    raise EOFError
                if await self._control_at_prompt(answer):
                    return  # cancelled or steered: the turn's pending interrupts are settled for it
                choice = answer.strip().lower()
                if choice in APPROVAL_ANSWERS:
                    break
                self.console.print("  answer y or n", markup=False)
            approved = APPROVAL_ANSWERS[choice]
            done = await self.sessions.resolve_interrupt(self.session_id, interrupt.interrupt_id, approved)
            if not done:
                self.console.print("[dim]  that approval is no longer pending[/dim]")


    async def _answer_question(self, interrupt: AgentInterrupt) -> None:
        choices = f" [{' / '.join(interrupt.choices)}]" if interrupt.choices else ""
        answer = await self._ask(f"{interrupt.question}{choices} (empty line declines) ")
        if answer is None:
            raise EOFError
        if await self._control_at_prompt(answer):
            return
        if not answer.strip():
            await self.sessions.resolve_interrupt(self.session_id, interrupt.interrupt_id, approved=False)
            return
        if not await self.sessions.answer_question(self.session_id, interrupt.interrupt_id, answer.strip()):
            self.console.print("[dim]  that answer was not taken (not a choice, or no longer pending)[/dim]")
            if _still_pending_choice(interrupt, answer):
                await self._answer_question(interrupt)


def _wait_reason(arguments: str) -> str:
    """The reason of a durable_wait call from its arguments, which the session checked (a JSON
    object with a text reason) before it recorded the call waiting_for_timer."""
    with contextlib.suppress(ValueError):
        decoded = json.loads(arguments)
        if isinstance(decoded, dict) and isinstance(decoded.get("reason"), str):
            return str(decoded["reason"])
    return "a durable wait"


def _still_pending_choice(interrupt: AgentInterrupt, answer: str) -> bool:
    """Ask again only for an answer outside the choices; anything else is gone for good."""
    return bool(interrupt.choices) and not interrupt.allows_free_text and answer.strip() not in interrupt.choices


def wants_plan_mode(text: str) -> bool:
    """A /plan message asks for a planning turn (the demo agent has plan mode on)."""
    return text == "/plan" or text.startswith("/plan ")


def plan_lines(plan: AgentPlan) -> list[str]:
    """A plan as the chat shows it: a header, then one line per task with its status."""
    return [f"plan revision {plan.revision} ({plan.status.value}):",
            *(f"  [{task.status.value}] {task.content}" for task in plan.tasks)]


def _turn_running(snapshot: AgentSnapshot) -> bool:
    return snapshot.state is not None and snapshot.state.active_turn_id is not None


def _busy(snapshot: AgentSnapshot) -> bool:
    """A turn runs, or a message waits to start one."""
    return _turn_running(snapshot) or bool(snapshot.queued_messages or snapshot.steered_messages)


async def run_chat(console: Console, data_dir: Path, session_id: str) -> int:
    """Chat until end of input; `data_dir` must exist. Ends with OSError (ENOSPC) when the disk
    under the database fills, since no turn could end."""
    database = data_dir / "agents.db"
    url = f"sqlite:///{database}"
    flow = build_demo_flow(data_dir / "demo-ledger.jsonl")
    registry = Registry([flow])
    client = AsyncClient(registry, url)
    worker = AsyncWorker(registry, WorkerOptions(
        database_url=url, lease_ttl_seconds=CHAT_LEASE_TTL_SECONDS, lease_renew_seconds=CHAT_LEASE_TTL_SECONDS / 5,
    ))
    status: str | None = None
    ended: FlowNotActiveError | None = None
    deleted = False
    with FullDiskWatch() as full_disk:
        worker_task = asyncio.create_task(worker.run())
        try:
            chat = Chat(console, AgentSessionClient(client, flow), session_id, TerminalLines())
            await until_disk_full(chat.run(), full_disk, str(database))
        except EOFError:
            pass
        except FlowNotActiveError as closed:  # stopped (dex-engine stop) or failed: it cannot go on
            ended = closed
        except FlowNotFoundError:  # stopped and deleted (dex-engine delete) while the chat ran
            deleted = True
        finally:
            await worker.stop()
            with contextlib.suppress(asyncio.CancelledError):
                await worker_task
            status = await _session_status(client, session_id, flow.flow_type)
            await client.close()
            if status == "running":
                console.print(f"[dim]session {escape(repr(session_id))} is saved in {escape(str(data_dir))}; "
                              "run the same command to resume it[/dim]")
    if deleted:
        console.print(f"session {session_id!r} was deleted while this chat ran; run the same command to start a "
                      "new one", style="red", markup=False)
        return 1
    if ended is None and status is not None and status != "running":  # stopped while the chat waited for a line
        ended = FlowNotActiveError(session_id, status)
    if ended is not None:
        console.print(f"session {session_id!r} has ended ({ended}); start another with --session NAME",
                      style="red", markup=False)
        return 1
    return 0


async def _session_status(client: AsyncClient, session_id: str, flow_type: str) -> str | None:
    """The status of the chat's session: None when `session_id` holds no session of `flow_type` (none
    was started, another kind of Flow has the ID) or it cannot be read."""
    try:
        info = await client.describe_flow(session_id)
    except (DexError, OSError, sqlite3.Error):
        return None
    return info.status if info.flow_type == flow_type else None
