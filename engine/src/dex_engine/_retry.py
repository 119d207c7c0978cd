"""Retry policies and the pure decision of what follows a failed attempt."""

from __future__ import annotations

import math
from dataclasses import dataclass

import msgspec

from ._errors import FlowDefinitionError, shown
from ._limits import MAX_TIMER_SECONDS, MAX_WHOLE_NUMBER


class RetryPolicy(msgspec.Struct, frozen=True, omit_defaults=True):
    """How often a Step method is tried: `max_attempts` within `total_duration_seconds`.

    The wait before attempt n+1 is initial_interval * backoff_coefficient**(n-1), capped at
    max_interval. A retry that would start after total_duration (counted from the first attempt's
    start) is not made.
    """

    max_attempts: int = 3
    initial_interval_seconds: float = 1.0
    backoff_coefficient: float = 2.0
    max_interval_seconds: float = 60.0
    total_duration_seconds: float | None = None

    def __post_init__(self) -> None:
        problems = []
        attempts: object = self.max_attempts
        if isinstance(attempts, bool) or not isinstance(attempts, int) or not 1 <= attempts <= MAX_WHOLE_NUMBER:
            problems.append(f"max_attempts must be a whole number from 1 to {MAX_WHOLE_NUMBER}, "
                            f"got {shown(self.max_attempts, None)}")
        seconds = {
            "initial_interval_seconds": self.initial_interval_seconds,
            "backoff_coefficient": self.backoff_coefficient,
            "max_interval_seconds": self.max_interval_seconds,
            "total_duration_seconds": self.total_duration_seconds,
        }
        not_numbers = [
            f"{name} must be a number, got {shown(value, None)}" for name, value in seconds.items()
            if value is not None and (isinstance(value, bool) or not isinstance(value, int | float))
        ]
        if not_numbers:  # the range checks below would raise TypeError on them
            raise FlowDefinitionError("invalid retry policy: " + "; ".join(problems + not_numbers))
        if not (self.initial_interval_seconds >= 0 and _finite(self.initial_interval_seconds)):
            problems.append(
                "initial_interval_seconds must be a finite number >= 0, "
                f"got {shown(self.initial_interval_seconds, None)}")
        if not (self.backoff_coefficient >= 1 and _finite(self.backoff_coefficient)):
            problems.append(
                f"backoff_coefficient must be a finite number >= 1, got {shown(self.backoff_coefficient, None)}")
        if not (self.max_interval_seconds >= self.initial_interval_seconds):
            problems.append(
                f"max_interval_seconds ({shown(self.max_interval_seconds, None)}) must be >= "
                f"initial_interval_seconds ({shown(self.initial_interval_seconds, None)})"
            )
        elif not self.max_interval_seconds <= MAX_TIMER_SECONDS:
            problems.append(
                f"max_interval_seconds must be at most {MAX_TIMER_SECONDS} s, "
                f"got {shown(self.max_interval_seconds, None)}"
            )
        total = self.total_duration_seconds
        if total is not None and not (total > 0 and _finite(total)):
            problems.append(f"total_duration_seconds must be > 0 and finite (or None), got {shown(total, None)}")
        if problems:
            raise FlowDefinitionError("invalid retry policy: " + "; ".join(problems))

    def interval_after(self, attempt: int) -> float:
        """Seconds to wait after failed attempt `attempt` (1-based) before the next one."""
        try:
            raw = self.initial_interval_seconds * float(self.backoff_coefficient) ** (attempt - 1)
        except OverflowError:  # a long "retry forever" policy: the cap applies
            return float(self.max_interval_seconds)
        return min(raw, self.max_interval_seconds)


def _finite(value: float) -> bool:
    """Whether `value` is a finite float or an int a float can hold. The policy is stored with a
    scheduled Step as JSON and read back as floats: an int past a float's range (on which
    math.isfinite raises OverflowError) could not be read back."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


@dataclass(frozen=True)
class RetryDecision:
    retry: bool
    run_at_ms: int = 0


def decide_retry(
    policy: RetryPolicy, *, attempt: int, first_started_ms: int, now_ms: int, no_retry: bool
) -> RetryDecision:
    """Retry with backoff, or give up (the caller then takes the failure route)."""
    if no_retry or attempt >= policy.max_attempts:
        return RetryDecision(False)
    run_at = now_ms + int(policy.interval_after(attempt) * 1000)
    total = policy.total_duration_seconds
    if total is not None and run_at > first_started_ms + int(total * 1000):
        return RetryDecision(False)
    return RetryDecision(True, run_at)
