"""Steps of the wall clock, told from drift by comparing it with the monotonic clock."""

from __future__ import annotations

import time
from collections.abc import Callable


class WallClockSteps:
    """How far the wall clock (which leases, deadlines and timers use) moved against the monotonic
    clock since the last look: a step (NTP setting the time, a virtual machine resumed), not the
    time that passed. A paused process sees no step: both clocks run on while it is stopped."""

    def __init__(self, wall: Callable[[], float] | None = None, monotonic: Callable[[], float] | None = None) -> None:
        self._wall = wall or _wall_now
        self._monotonic = monotonic or _monotonic_now
        self._last = (self._wall(), self._monotonic())

    def step(self) -> float:
        """Seconds the wall clock stepped (forward > 0, back < 0) since the last call or creation."""
        wall, monotonic = self._wall(), self._monotonic()
        last_wall, last_monotonic = self._last
        self._last = (wall, monotonic)
        return (wall - last_wall) - (monotonic - last_monotonic)


# Looked up at each call, as now_ms does: a test that moves time.time moves this clock too.
def _wall_now() -> float:
    return time.time()


def _monotonic_now() -> float:
    return time.monotonic()
