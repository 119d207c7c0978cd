"""Waiting with deadlines instead of sleeping."""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from .._client import AgentSessionClient
    from .._wire import AgentSnapshot

T = TypeVar("T")

# Long enough for a Worker restart plus a lease takeover on a loaded CI machine.
DEFAULT_WAIT_SECONDS = 30.0
POLL_SECONDS = 0.02
# How long an awaited probe started at the deadline may still run: a snapshot read takes well under it.
PROBE_GRACE_SECONDS = 1.0


async def wait_until(
    description: str,
    probe: Callable[[], Any],
    *,
    timeout: float = DEFAULT_WAIT_SECONDS,
    interval: float = POLL_SECONDS,
) -> Any:
    """Poll `probe` (sync or async) until it returns a truthy value, and return it.

    Raises AssertionError naming `description` and the last value when `timeout` seconds pass,
    cancelling an awaited probe call still running then (one started at the deadline gets
    PROBE_GRACE_SECONDS). A sync probe runs on the event loop and
    cannot be interrupted: one that blocks holds the wait up until it returns.
    """
    _check_seconds("timeout", timeout, "a number of seconds (math.inf waits for ever)")
    _check_seconds("interval", interval, "a finite number of seconds above 0")
    if not 0 < interval < math.inf:  # 0 or less: a busy loop; math.inf: asleep past the deadline
        raise ValueError(f"interval must be a finite number of seconds above 0, got {interval!r}")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    # asyncio.timeout_at takes None for "never" (FileGate waits for ever).
    cutoff = deadline if math.isfinite(deadline) else None
    value: Any = None
    while True:
        returned = probe()
        if inspect.isawaitable(returned):
            # A probe started at (or just before) the deadline still gets PROBE_GRACE_SECONDS to
            # answer: cut off at once, the last probe never counted, nor the only one of timeout=0.
            bound = asyncio.timeout_at(None if cutoff is None else max(cutoff, loop.time() + PROBE_GRACE_SECONDS))
            try:
                async with bound:
                    returned = await returned
            except TimeoutError:
                if not bound.expired():
                    raise  # the probe's own TimeoutError, not the deadline
                break
        value = returned
        if value:
            return value
        left = deadline - loop.time()
        if left <= 0:
            break
        await asyncio.sleep(min(interval, left))  # so that the last probe runs at the deadline, not after it
    raise AssertionError(f"timed out after {timeout} s waiting for {description}; last value: {value!r}")


def _check_seconds(name: str, value: object, allowed: str) -> None:
    """ValueError unless `value` is a number of seconds, not a bool and not NaN: a NaN deadline is
    never reached (every comparison with it is false), so the wait went on for ever, and a NaN
    interval slept for ever."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or (isinstance(value, float) and math.isnan(value)):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


async def wait_for_agent_snapshot(
    sessions: AgentSessionClient,
    session_id: str,
    probe: Callable[[AgentSnapshot], T | None],
    *,
    description: str,
    timeout: float = DEFAULT_WAIT_SECONDS,
) -> T:
    """Poll get_agent_snapshot until `probe(snapshot)` is truthy; return what it returned.

    Raises AssertionError at once when the session's Flow has closed (failed, stopped) without the
    probe passing: a closed session never changes again, so waiting out `timeout` would only hide
    why (a failed session's error is in the message).
    """
    last: list[AgentSnapshot] = []

    async def check() -> T | None:
        snapshot = await sessions.get_agent_snapshot(session_id)
        last[:] = [snapshot]
        found = probe(snapshot)
        if found:
            return found
        info = await sessions.client.describe_flow(session_id)
        if info.status == "running":
            return found
        # The snapshot may predate the close: probe the session as it ended once more.
        snapshot = await sessions.get_agent_snapshot(session_id)
        last[:] = [snapshot]
        found = probe(snapshot)
        if found:
            return found
        error = f" with error {info.error!r}" if info.error else ""
        raise AssertionError(f"session {session_id!r} is {info.status}{error}, so it will never show {description}")

    try:
        found: T = await wait_until(description, check, timeout=timeout)
        return found
    except AssertionError as exc:
        stuck = await _active_steps(sessions, session_id) if last else ""
        raise AssertionError(f"{exc}{stuck}; last snapshot of {session_id!r}: {last[0] if last else None!r}") from None


async def _active_steps(sessions: AgentSessionClient, session_id: str) -> str:
    """Where a running session is when a wait for it times out: its active Steps, and for one that
    stays ready the usual cause, a test whose Worker child serves other flow types (or none)."""
    info = await sessions.client.describe_flow(session_id)
    if info.status != "running":
        return ""
    steps = ", ".join(f"{s.step_execution_id} {s.state}" for s in info.active_steps) or "none"
    shown = f"; its active Steps: {steps}"
    if any(s.state == "ready" for s in info.active_steps):
        shown += (f" (a Step that stays ready has no Worker to run it: does the Worker child's Registry serve "
                  f"flow type {info.flow_type!r}, and is it running on this database?)")
    return shown
