"""cancel_turn while RunModel's attempt runs and its model call ignores the cancellation (its answer
or its error arrives after the RPC committed): seed 002's RunModel row, "cancel_turn cancels a
running RunModel ... and the model call's result is dropped", and the RPC row, "a model call that
committed its final answer before the RPC completes the turn" (only then).

The model sits at the provider edge of the built-in loop (ScriptedModelClient), on an in-process
Worker, against a real SQLite file and PostgreSQL.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from agents.tests.builtin_agent import InProcessEngine, scripted_flow
from agents.tests.session_driver import turns_ended
from engine.tests.conftest import db_url, pg_database, pg_databases  # noqa: F401 - the fixtures used here

from dex_agents import MessageRole
from dex_agents.builtin_loop import ModelRequest, ScriptedModelClient, ScriptedModelReply


class RateLimited(Exception):
    """A provider's 429 asking for the next call in 600 s (within RunModel's 30 min budget)."""

    def __init__(self) -> None:
        super().__init__("429 Too Many Requests, retry after 600 s")
        self.retry_after_seconds = 600.0


class DeafModel:
    """The first call of the first turn waits for `release` through any cancellation (a provider
    client that finishes its request whatever happens), then answers or fails as `outcome` says;
    every other call echoes the last user text."""

    def __init__(self, outcome: str) -> None:
        self.outcome = outcome
        self.calls: list[str] = []
        self.running = asyncio.Event()
        self.release = asyncio.Event()
        self.cancelled = False

    async def __call__(self, request: ModelRequest) -> ScriptedModelReply:
        text = ScriptedModelClient.user_texts(request)[-1]
        self.calls.append(text)
        if len(self.calls) > 1:
            return ScriptedModelReply(text=f"echo: {text}")
        self.running.set()
        while not self.release.is_set():
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                self.cancelled = True  # deaf to it: the answer (or the error) still comes
        if self.outcome == "answer":
            return ScriptedModelReply(text="the answer nobody waits for")
        raise RateLimited


@pytest.mark.parametrize("released", ["at_once", "after_the_turn_ended"])
@pytest.mark.parametrize("outcome", ["answer", "rate_limited"])
async def test_cancel_during_a_model_call_that_then_answers_or_fails_ends_the_turn_cancelled(
    tmp_path: Path, db_url: str, outcome: str, released: str  # noqa: F811
) -> None:
    """cancel_turn commits while the turn's first model call runs; the call then returns its answer
    (or fails with a 429 asking 600 s), as soon as the RPC returned or after the cancelled turn
    ended. The turn ends cancelled at once, with no turn_completed, the
    answer not stored, no second model call, and the session takes the next message. Catches: the
    late answer completing the cancelled turn (or stored in it), or its retry ten minutes on."""
    model = DeafModel(outcome)
    flow, _ = scripted_flow(model)
    engine = InProcessEngine(tmp_path, [flow], db_url)
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("a", "first")
        await asyncio.wait_for(model.running.wait(), 30)
        assert await sessions.cancel_turn("a") is True
        if released == "at_once":
            model.release.set()
        done = await turns_ended(sessions, "a", 1)
        model.release.set()
        assert await sessions.send_user_message("a", "second")
        after = await turns_ended(sessions, "a", 2)
        events = (await sessions.read_agent_events("a", limit=1000)).events
    assert [m.role for m in done.messages] == [MessageRole.USER]
    assert [m.text for m in after.messages] == ["first", "second", "echo: second"]
    assert [e.value.type for e in events if e.value.type in ("turn_cancelled", "turn_completed", "turn_failed")] == [
        "turn_cancelled", "turn_completed"]
    assert after.state is not None and after.state.last_turn_error is None
    assert model.calls == ["first", "second"]
