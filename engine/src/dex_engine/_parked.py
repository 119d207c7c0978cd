"""A handler stepped inside the commit that claimed its attempt (Step.pure_execute and
Step.pure_until_heartbeat), and, when it stopped at its first heartbeat, resumed after that commit."""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Coroutine, Generator
from typing import Any

from ._context import Context, EventFn, HeartbeatFn, NotFoldable
from ._flow import Flow


class FoldFunctions:
    """The heartbeat and event functions of a handler stepped inside a commit.

    Until `go_live`, a heartbeat (when `parks`) records its checkpoint and parks the handler on
    `parked`, and the events written before it are kept in `events` for that commit; anything else
    raises NotFoldable, so the handler runs as a usual attempt instead. After `go_live`, both go to
    the attempt's own functions.
    """

    def __init__(self, flow: Flow, *, parks: bool) -> None:
        self._flow = flow
        self._parks = parks
        self.events: list[tuple[str, int, bytes]] = []  # (stream, capacity, value)
        self.checkpoint: str | None = None
        self.parked: asyncio.Future[None] | None = None
        self._live: tuple[HeartbeatFn, EventFn] | None = None
        self._late: list[tuple[str, bytes]] = []  # written by another thread while parked
        self._lock = threading.Lock()

    async def heartbeat(self, checkpoint: str | None) -> None:
        live = self._live
        if live is not None:
            await live[0](checkpoint)
            return
        if not self._parks or self.parked is not None:
            raise NotFoldable("heartbeat")
        self.checkpoint = checkpoint
        self.parked = asyncio.get_running_loop().create_future()
        await self.parked

    def write_event(self, stream: str, data: bytes) -> None:
        with self._lock:
            live = self._live
            if live is None:
                if not self._parks:
                    raise NotFoldable("write_event")
                if self.parked is None:
                    self.events.append((stream, self._flow.streams[stream].capacity_bytes, data))
                else:
                    self._late.append((stream, data))  # after the events the commit records
                return
        live[1](stream, data)

    def go_live(self, heartbeat: HeartbeatFn, write_event: EventFn) -> None:
        """The commit recorded the heartbeat: from now on the attempt's own functions serve, and
        the parked heartbeat returns."""
        with self._lock:
            self._live = (heartbeat, write_event)
            late, self._late = self._late, []
        for stream, data in late:
            write_event(stream, data)
        assert self.parked is not None
        self.parked.set_result(None)


class ParkedHandler:
    """A handler parked at its first heartbeat, which the commit that claimed it recorded.

    `variables` are the context variables it ran in until then; its attempt's task runs in them
    too, so what it set before the heartbeat it still sees after, and the committing task never does.
    """

    def __init__(
        self, context: Context, coroutine: Coroutine[Any, Any, Any], functions: FoldFunctions,
        variables: contextvars.Context,
    ) -> None:
        self.context = context
        self.coroutine = coroutine
        self.functions = functions
        self.variables = variables

    def resume(self, heartbeat: HeartbeatFn, write_event: EventFn) -> Resumed:
        """What to await for the handler's result, serving it with the attempt's own functions."""
        self.functions.go_live(heartbeat, write_event)
        return Resumed(self.coroutine)


class Resumed:
    """Awaits a coroutine that was stepped elsewhere and left suspended.

    `await coroutine` refuses one that is suspended in an await of its own; this drives it as a
    Task would, passing on what it yields and what is sent or thrown into it (cancellation).
    """

    def __init__(self, coroutine: Coroutine[Any, Any, Any]) -> None:
        self._coroutine = coroutine

    def __await__(self) -> Generator[Any, Any, Any]:
        coroutine = self._coroutine
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                yielded = coroutine.send(value) if error is None else coroutine.throw(error)
            except StopIteration as done:
                return done.value
            try:
                value, error = (yield yielded), None
            except GeneratorExit:
                coroutine.close()
                raise
            except BaseException as exc:  # cancellation and the like go on to the handler
                value, error = None, exc
