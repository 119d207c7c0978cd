"""Wait conditions as authored in WaitFor, and their stored form."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import msgspec

from ._errors import InvalidWaitError
from ._limits import MAX_TIMER_SECONDS

# Stored form ------------------------------------------------------------------------------


class ConditionSpec(msgspec.Struct, frozen=True, omit_defaults=True):
    """One condition as stored: a channel instance with bounds, or a timer."""

    kind: Literal["channel", "timer"]
    channel: str = ""
    key: str = ""
    at_least: int = 0
    at_most: int | None = None  # None: take everything queued
    seconds: int = 0


class WaitSpec(msgspec.Struct, frozen=True, omit_defaults=True):
    mode: Literal["any", "all", "skip"]
    conditions: tuple[ConditionSpec, ...] = ()


# Authored form ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ChannelCondition:
    """Satisfied when `at_least` messages are queued on one channel instance; takes up to `at_most`."""

    channel: str
    key: str
    at_least: int
    at_most: int | None

    def __post_init__(self) -> None:
        # Checked here, not only in the channel helpers, because ChannelCondition is exported: one
        # made directly with a fraction or a bool failed the WaitFor's commit on every retry, and
        # at_most=0 or at_most < at_least held the Step for ever.
        channel, key = self.channel, self.key
        if not isinstance(key, str):
            raise InvalidWaitError(f"the key of channel {channel!r} must be text, got {key!r}")
        for label, n, optional in (("at_least", self.at_least, False), ("at_most", self.at_most, True)):
            if not (n is None and optional) and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
                raise InvalidWaitError(f"{label} must be a whole number >= 0, got {n!r} for channel {channel!r}")
        if self.at_most is not None and self.at_most < self.at_least:
            raise InvalidWaitError(
                f"at_most ({self.at_most}) < at_least ({self.at_least}) on channel {channel!r}; "
                "it could never be satisfied"
            )
        if self.at_most == 0:
            raise InvalidWaitError(f"at_most must be >= 1 on channel {channel!r}; a condition that takes nothing")

    def spec(self) -> ConditionSpec:
        return ConditionSpec(
            kind="channel", channel=self.channel, key=self.key,
            at_least=self.at_least, at_most=self.at_most,
        )


@dataclass(frozen=True)
class TimerCondition:
    """Fires `seconds` whole seconds after the wait is registered (0 fires at once)."""

    seconds: int

    def __post_init__(self) -> None:
        # Made directly rather than by Timer.by_duration, a value the store cannot hold (a fraction,
        # a bool, NaN, past the limit) failed the WaitFor's commit on every retry, and the flow,
        # with an error that did not name it.
        seconds: object = self.seconds
        if isinstance(seconds, bool) or not isinstance(seconds, int) or not 0 <= seconds <= MAX_TIMER_SECONDS:
            raise InvalidWaitError(
                f"TimerCondition takes whole seconds from 0 to {MAX_TIMER_SECONDS}, got {seconds!r}; "
                "make timers with Timer.by_duration(seconds), which rounds a fraction up"
            )

    def spec(self) -> ConditionSpec:
        return ConditionSpec(kind="timer", seconds=self.seconds)


Condition = ChannelCondition | TimerCondition


class Timer:
    """Durable timer conditions."""

    @staticmethod
    def by_duration(seconds: float) -> TimerCondition:
        """A timer of whole seconds; fractions round up, 0 fires at once, negatives are refused."""
        # math.isnan only on a float: it cannot convert an int past a float's range (OverflowError).
        if isinstance(seconds, bool) or not isinstance(seconds, int | float) or (
            isinstance(seconds, float) and math.isnan(seconds)
        ):
            raise InvalidWaitError(f"timer duration must be a number of seconds, got {seconds!r}")
        if seconds < 0:
            raise InvalidWaitError(f"timer duration is negative ({seconds!r} s); use 0 to fire at once")
        if seconds > MAX_TIMER_SECONDS:  # infinity included
            raise InvalidWaitError(f"timer duration {seconds!r} s is beyond the limit of {MAX_TIMER_SECONDS} s")
        return TimerCondition(math.ceil(seconds))


@dataclass(frozen=True)
class Wait:
    """What a WaitFor returns: the conditions Execute waits for."""

    mode: Literal["any", "all", "skip"]
    conditions: tuple[Condition, ...]

    @staticmethod
    def until(condition: Condition) -> Wait:
        return Wait("any", (_check(condition),))

    @staticmethod
    def any_of(*conditions: Condition) -> Wait:
        if not conditions:
            raise InvalidWaitError("Wait.any_of needs at least one condition; use Wait.skip_immediately()")
        return Wait("any", tuple(_check(c) for c in conditions))

    @staticmethod
    def all_of(*conditions: Condition) -> Wait:
        if not conditions:
            raise InvalidWaitError("Wait.all_of needs at least one condition; use Wait.skip_immediately()")
        return Wait("all", tuple(_check(c) for c in conditions))

    @staticmethod
    def skip_immediately() -> Wait:
        return Wait("skip", ())

    def spec(self) -> WaitSpec:
        return WaitSpec(mode=self.mode, conditions=tuple(c.spec() for c in self.conditions))


def _check(condition: object) -> Condition:
    if not isinstance(condition, ChannelCondition | TimerCondition):
        raise InvalidWaitError(
            f"{condition!r} is not a wait condition; use a channel's for_one()/for_n()/... or Timer.by_duration()"
        )
    return condition
