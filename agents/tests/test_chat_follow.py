"""How `dex-agents chat` follows turns, in process: a real engine file and Worker, the chat's
terminal a pipe the test types into, so each test sets up exactly the order of events it needs."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from rich.console import Console

from dex_agents import AgentSessionClient, AgentSnapshot
from dex_agents.demo._agent import build_demo_flow
from dex_agents.demo._chat import Chat
from dex_agents.demo._lines import TerminalLines
from dex_engine import AsyncClient, AsyncWorker, Registry, StreamRead, WorkerOptions

SESSION = "chat"
WAIT_SECONDS = 60.0
REFUND = '/tool refund_order {"order_id": "A-1001", "amount_cents": 500}'


@dataclass
class Terminal:
    """A chat's screen and keyboard: what it printed, and a pipe to type lines into."""

    chat: Chat
    screen: io.StringIO
    keyboard: int

    def type(self, *lines: str) -> None:
        os.write(self.keyboard, "".join(f"{line}\n" for line in lines).encode())

    def shown(self) -> str:
        return self.screen.getvalue()


@dataclass
class Setup:
    sessions: AgentSessionClient
    worker: AsyncWorker | None
    worker_task: asyncio.Task[None] | None
    registry: Registry
    url: str

    def start_worker(self) -> None:
        self.worker = AsyncWorker(self.registry, WorkerOptions(database_url=self.url))
        self.worker_task = asyncio.create_task(self.worker.run())

    async def stop_worker(self) -> None:
        assert self.worker is not None and self.worker_task is not None
        await self.worker.stop()
        with contextlib.suppress(asyncio.CancelledError):
            await self.worker_task
        self.worker = self.worker_task = None

    def terminal(self) -> Terminal:
        screen = io.StringIO()
        reading, writing = os.pipe()
        lines = TerminalLines(reading, "utf-8")
        console = Console(file=screen, width=200, highlight=False, color_system=None)
        return Terminal(Chat(console, self.sessions, SESSION, lines), screen, writing)


@pytest.fixture
async def setup(tmp_path: Path) -> AsyncIterator[Setup]:
    url = f"sqlite:///{tmp_path / 'agents.db'}"
    flow = build_demo_flow(tmp_path / "ledger.jsonl")
    registry = Registry([flow])
    client = AsyncClient(registry, url)
    result = Setup(AgentSessionClient(client, flow), None, None, registry, url)
    result.start_worker()
    try:
        yield result
    finally:
        if result.worker is not None:
            await result.stop_worker()
        await client.close()


async def _until(condition: Callable[[], Awaitable[bool]], what: str) -> None:
    deadline = asyncio.get_running_loop().time() + WAIT_SECONDS
    while not await condition():
        if asyncio.get_running_loop().time() > deadline:
            pytest.fail(f"no {what} within {WAIT_SECONDS} s")
        await asyncio.sleep(0.02)


async def test_a_cancelled_turn_with_a_steer_goes_on_to_show_the_steered_turn(setup: Setup) -> None:
    """A turn both steered and cancelled ends as cancelled, and the steered message starts the next
    turn at once (seed 002). Catches: the chat stopping at turn_cancelled, so the steered turn's
    reply was never shown and the next line typed was sent as a new message behind it."""
    terminal = setup.terminal()
    await terminal.chat.open()
    sessions = setup.sessions
    await sessions.send_user_message(SESSION, REFUND)

    async def waiting_for_approval() -> bool:
        return bool((await sessions.get_agent_snapshot(SESSION)).pending_interrupts)

    await _until(waiting_for_approval, "approval pending for the refund")
    snapshot = await sessions.get_agent_snapshot(SESSION)
    turn_id = snapshot.state.active_turn_id if snapshot.state else None
    assert turn_id is not None
    # The chat has shown the turn up to its approval; then, with no Worker to apply them in
    # between, the turn is steered and cancelled.
    terminal.chat.token = (await sessions.read_agent_events(SESSION, limit=1_000_000)).resume_token
    await setup.stop_worker()
    assert await sessions.steer_user_message(SESSION, text="/echo never mind")
    assert await sessions.cancel_turn(SESSION, turn_id)
    setup.start_worker()

    async with asyncio.timeout(WAIT_SECONDS):
        await terminal.chat.follow_turn(turn_id)
    shown = terminal.shown()
    assert "turn cancelled" in shown
    assert "agent> never mind" in shown, shown
    after = await sessions.get_agent_snapshot(SESSION)
    assert after.state is not None and after.state.active_turn_id is None


async def test_a_second_chat_on_the_session_shows_its_own_reply(setup: Setup) -> None:
    """Two chats on one session: the second's message gets its own reply, not the reply to the
    first chat's earlier message. Catches: the second chat reading on from where it opened, showing
    the other chat's turn as its answer and its own a message late."""
    first, second = setup.terminal(), setup.terminal()
    await first.chat.open()
    running = asyncio.create_task(second.chat.run())

    async def opened() -> bool:
        return second.chat.token is not None

    await _until(opened, "second chat opened")

    await setup.sessions.send_user_message(SESSION, "/echo for the first chat")
    async with asyncio.timeout(WAIT_SECONDS):
        await first.chat.follow_turn()
    second.type("/echo for the second chat")

    async def answered() -> bool:
        return "agent> for the second chat" in second.shown()

    await _until(answered, "reply shown in the second chat")
    second.type("/quit")
    async with asyncio.timeout(WAIT_SECONDS):
        await running
    assert "for the first chat" not in second.shown(), second.shown()
    messages = (await setup.sessions.get_agent_snapshot(SESSION)).messages
    assert [m.text for m in messages if m.text][-1] == "for the second chat"


async def _turn_on_a_durable_wait(sessions: AgentSessionClient) -> None:
    """Start the session with a turn that waits on a 600 s durable_wait Timer ("coffee")."""
    await sessions.start_session(SESSION)
    await sessions.send_user_message(SESSION, "/wait 600 coffee")

    async def waiting() -> bool:
        calls = (await sessions.get_agent_snapshot(SESSION)).tool_calls
        return any(c.status.value == "waiting_for_timer" for c in calls)

    await _until(waiting, "durable wait of the turn")


async def test_a_resumed_chat_sees_the_end_of_a_turn_that_ends_as_it_opens(setup: Setup) -> None:
    """The turn a resumed chat finds running ends right after the chat read the snapshot. Catches:
    the chat taking the events' end after the snapshot, so it skipped that turn's end and followed
    a turn that had already ended, waiting for ever."""
    sessions = setup.sessions
    await _turn_on_a_durable_wait(sessions)

    class EndingAfterTheSnapshot(AgentSessionClient):
        """The first snapshot is read while the turn runs; the turn is cancelled and has ended
        before the chat gets it."""

        ended = False

        async def get_agent_snapshot(self, session_id: str) -> AgentSnapshot:
            snapshot = await super().get_agent_snapshot(session_id)
            if not self.ended:
                self.ended = True
                assert snapshot.state is not None and snapshot.state.active_turn_id is not None
                assert await sessions.cancel_turn(SESSION, snapshot.state.active_turn_id)

                async def idle() -> bool:
                    state = (await sessions.get_agent_snapshot(SESSION)).state
                    return state is not None and state.active_turn_id is None

                await _until(idle, "cancelled turn to end")
            return snapshot

    terminal = setup.terminal()
    terminal.chat.sessions = EndingAfterTheSnapshot(sessions.client, sessions.flow)
    async with asyncio.timeout(WAIT_SECONDS):
        await terminal.chat.open()
    assert "turn cancelled" in terminal.shown()


async def test_a_resumed_chat_says_what_durable_wait_its_turn_is_in(setup: Setup) -> None:
    """A chat opened while its turn waits on a durable_wait Timer shows the wait, as the chat that
    started it did ("waiting until ... (coffee)"), then follows the turn to its end (the Timer
    skipped, as `dex-engine skip-timer` does). Catches: the resumed chat printing only "a turn is
    still running; following it" and then nothing until the Timer fired, up to a year later, after
    the first chat said "Ctrl-C and come back later"."""
    sessions = setup.sessions
    await _turn_on_a_durable_wait(sessions)
    wait_until = next(c.wait_until for c in (await sessions.get_agent_snapshot(SESSION)).tool_calls)
    terminal = setup.terminal()
    opening = asyncio.create_task(terminal.chat.open())

    async def following() -> bool:
        return "following it" in terminal.shown()

    await _until(following, "resumed chat following the turn")
    await sessions.client.skip_timer(SESSION, "AwaitTimer-1")
    async with asyncio.timeout(WAIT_SECONDS):
        await opening
    shown = terminal.shown()
    assert f"waiting until {wait_until} (coffee)" in shown, shown
    assert shown.index("waiting until") < shown.index("durable_wait: succeeded"), shown


async def test_skipping_to_the_end_reads_every_page(setup: Setup) -> None:
    """Moving past what was written before (another chat's turns) reads page after page, up to the
    end. Catches: one read taken for the end, so a long session's older events (past one page)
    were shown as the reply to the next message."""
    sessions = setup.sessions
    first = setup.terminal()
    await first.chat.open()
    for text in ("/echo one", "/echo two"):
        await sessions.send_user_message(SESSION, text)
        async with asyncio.timeout(WAIT_SECONDS):
            await first.chat.follow_turn()

    class SmallPages(AgentSessionClient):
        async def read_agent_events(self, session_id: str, resume_token: str | None = None, *,
                                    wait_seconds: float = 0.0, limit: int = 3) -> StreamRead:
            return await super().read_agent_events(session_id, resume_token, wait_seconds=wait_seconds,
                                                   limit=min(limit, 3))

    total = len((await sessions.read_agent_events(SESSION, limit=1_000_000)).events)
    assert total > 3 * 2, total  # more than two pages
    terminal = setup.terminal()
    terminal.chat.sessions = SmallPages(sessions.client, sessions.flow)
    await terminal.chat._skip_to_end()
    rest = await sessions.read_agent_events(SESSION, terminal.chat.token)
    assert rest.events == []


async def test_a_chat_whose_session_was_deleted_and_started_again_shows_the_new_one(setup: Setup) -> None:
    """The session is stopped, deleted and started again under its ID (another chat's) while this
    chat waits for a line: the typed line is not sent, and the chat shows the session as stored and
    goes on with it, as seed 003 has a UI whose resume token is refused load the snapshot again.
    Catches: the chat ending on the engine's InvalidResumeTokenError, whose advice ("read from the
    start (resume_token=None)") a chat user cannot follow."""
    sessions = setup.sessions
    terminal = setup.terminal()
    running = asyncio.create_task(terminal.chat.run())
    terminal.type("/echo in the old session")

    async def waits_for_a_line() -> bool:  # the reply shown, the next prompt printed
        return terminal.shown().endswith("agent> in the old session\nyou> ")

    await _until(waits_for_a_line, "reply in the old session")
    await sessions.client.stop_flow(SESSION, "replaced")
    assert await sessions.client.delete_flow(SESSION)
    await sessions.start_session(SESSION)
    await sessions.send_user_message(SESSION, "/echo in the new session")

    async def answered() -> bool:
        messages = (await sessions.get_agent_snapshot(SESSION)).messages
        return [m.text for m in messages if m.text][-1:] == ["in the new session"]

    await _until(answered, "reply in the new session")
    terminal.type("/echo typed for the old session", "/echo typed again", "/quit")
    async with asyncio.timeout(WAIT_SECONDS):
        await running
    shown = terminal.shown()
    assert "session 'chat' is not as this chat showed it (it was deleted and started again" in shown, shown
    assert "that message was not sent; type it again" in shown, shown
    assert "agent> typed again" in shown, shown
    texts = [m.text for m in (await sessions.get_agent_snapshot(SESSION)).messages if m.text]
    assert "typed for the old session" not in texts and texts[-1] == "typed again", texts
