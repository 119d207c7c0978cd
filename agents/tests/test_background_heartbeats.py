"""background_heartbeats: RunModel and the tool Steps stay alive through long calls (seed 002:
"a background heartbeat every 20 s"), and no heartbeat outlives the call it covered."""

from __future__ import annotations

import asyncio
import contextvars
import logging
from typing import Any, cast

import pytest

from dex_agents._runtime import background_heartbeats
from dex_engine import Context

INTERVAL = 0.02

caller = contextvars.ContextVar("caller", default="none")


class FakeContext:
    """The part of a Step's Context that background_heartbeats uses, recording each heartbeat."""

    flow_id = "session-1"
    step_execution_id = "RunModel-1"

    def __init__(self, *, fail_first: int = 0, beat_seconds: float = 0.0) -> None:
        self.beats: list[str] = []  # the caller context variable each heartbeat saw
        self.fail_first = fail_first
        self.beat_seconds = beat_seconds
        self.in_flight = 0
        self.started = asyncio.Event()

    async def heartbeat(self) -> None:
        self.in_flight += 1
        self.started.set()
        try:
            if self.beat_seconds:
                await asyncio.sleep(self.beat_seconds)
            self.beats.append(caller.get())
            if len(self.beats) <= self.fail_first:
                raise RuntimeError("store unavailable")
        finally:
            self.in_flight -= 1


def as_context(fake: FakeContext) -> Context:
    return cast(Context, fake)


async def test_a_body_shorter_than_the_interval_makes_no_heartbeat() -> None:
    fake = FakeContext()
    async with background_heartbeats(as_context(fake), INTERVAL):
        await asyncio.sleep(0)
    await asyncio.sleep(INTERVAL * 3)
    assert fake.beats == []


async def test_a_long_body_heartbeats_every_interval_and_none_after_it_ends() -> None:
    fake = FakeContext()
    caller.set("run-model")
    async with background_heartbeats(as_context(fake), INTERVAL):
        await asyncio.sleep(INTERVAL * 8)
    seen = len(fake.beats)
    assert seen >= 3
    assert set(fake.beats) == {"run-model"}  # heartbeats run in the handler's context
    await asyncio.sleep(INTERVAL * 4)
    assert len(fake.beats) == seen


async def test_a_failed_heartbeat_does_not_stop_the_next_ones() -> None:
    fake = FakeContext(fail_first=2)
    async with background_heartbeats(as_context(fake), INTERVAL):
        await asyncio.sleep(INTERVAL * 10)
    assert len(fake.beats) >= 4


async def test_a_failed_heartbeat_is_logged_at_debug_with_its_step_and_error(caplog: pytest.LogCaptureFixture) -> None:
    """Debug, not a warning: the worker revokes a lost attempt itself, and a transient store error
    is retried at the next interval; the record still names the Step and carries the error."""
    fake = FakeContext(fail_first=1)
    caplog.set_level(logging.DEBUG, logger="dex_agents")
    async with background_heartbeats(as_context(fake), INTERVAL):
        while len(fake.beats) < 2:
            await fake.started.wait()
            fake.started.clear()
    failures = [r for r in caplog.records if "background heartbeat failed" in r.getMessage()]
    assert [(r.levelno, r.getMessage()) for r in failures] == [
        (logging.DEBUG, "flow session-1 RunModel-1: background heartbeat failed")
    ]
    assert failures[0].exc_info is not None
    assert isinstance(failures[0].exc_info[1], RuntimeError)


async def test_a_heartbeat_in_flight_at_exit_is_cancelled_and_awaited() -> None:
    fake = FakeContext(beat_seconds=INTERVAL * 10)
    async with background_heartbeats(as_context(fake), INTERVAL):
        await fake.started.wait()
    assert fake.in_flight == 0  # cancelled before the body's exit returned
    assert fake.beats == []


async def test_a_body_that_raises_ends_the_heartbeats_and_raises() -> None:
    fake = FakeContext()

    async def failing() -> Any:
        async with background_heartbeats(as_context(fake), INTERVAL):
            await asyncio.sleep(INTERVAL * 3)
            raise ValueError("model call failed")

    with pytest.raises(ValueError, match="model call failed"):
        await failing()
    seen = len(fake.beats)
    await asyncio.sleep(INTERVAL * 4)
    assert len(fake.beats) == seen
