"""Retry policies and the pure decision of what follows a failed attempt."""

from __future__ import annotations

import math
from dataclasses import dataclass

import msgspec

from ._errors import FlowDefinitionError, shown
from ._limits import MAX_RETRY_AFTER_SECONDS, MAX_TIMER_SECONDS, MAX_WHOLE_NUMBER


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
class AskedDelay:
    """What a failed attempt's error asked of its retry (its `retry_after_seconds`)."""

    delay_ms: int | None  # the wait to honour; None when the value asked cannot be one
    note: str  # what was asked, and what became of it, for the attempt's history


def asked_delay(error: BaseException) -> AskedDelay | None:
    """The retry delay `error` asks for through a `retry_after_seconds` attribute (RetryAfterError's,
    or one a library's error carries), or None when it asks none. An unusable value (not a number,
    negative, NaN) is a note and no delay: the attempt's own failure is what is recorded, and the
    retry policy's interval applies; one over MAX_RETRY_AFTER_SECONDS is capped there."""
    try:
        value: object = getattr(error, "retry_after_seconds", None)
    except Exception as failed:  # a property that raises: as unusable as a value that is no number
        return AskedDelay(None, f"its retry_after_seconds could not be read ({type(failed).__name__}), so "
                                "the retry policy's interval applies")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        return AskedDelay(None, f"its retry_after_seconds, {shown(value)}, is not a number of seconds >= 0, so "
                                "the retry policy's interval applies")
    if value > MAX_RETRY_AFTER_SECONDS:  # an infinity too; an int too large for a float compares as well
        return AskedDelay(MAX_RETRY_AFTER_SECONDS * 1000,
                          f"it asked for its retry no sooner than {_seconds(value)} s from now, capped at "
                          f"MAX_RETRY_AFTER_SECONDS ({MAX_RETRY_AFTER_SECONDS} s)")
    return AskedDelay(math.ceil(value * 1000), f"it asked for its retry no sooner than {_seconds(value)} s from now")


def _seconds(value: float) -> str:
    """Seconds as a history note shows them: 3, 2.5, 1e+12, inf."""
    try:
        return f"{float(value):g}"
    except OverflowError:  # an int past a float's range
        return shown(value)


@dataclass(frozen=True)
class RetryDecision:
    retry: bool
    run_at_ms: int = 0
    # No retry although attempts remained, only because of the delay the error asked for: it would
    # start after the policy's total duration, where the policy's own interval would not.
    asked_past_budget: bool = False


def decide_retry(
    policy: RetryPolicy, *, attempt: int, first_started_ms: int, now_ms: int, no_retry: bool,
    asked_delay_ms: int | None = None,
) -> RetryDecision:
    """Retry with backoff, or give up (the caller then takes the failure route). A delay the error
    asked for (`asked_delay_ms`) makes the retry wait at least that long, as any retry, in the
    database: the worker is free meanwhile."""
    if no_retry or attempt >= policy.max_attempts:
        return RetryDecision(False)
    backoff_at = now_ms + int(policy.interval_after(attempt) * 1000)
    run_at = backoff_at if asked_delay_ms is None else max(backoff_at, now_ms + asked_delay_ms)
    total = policy.total_duration_seconds
    if total is not None:
        budget_end = first_started_ms + int(total * 1000)
        if run_at > budget_end:
            return RetryDecision(False, asked_past_budget=backoff_at <= budget_end)
    return RetryDecision(True, run_at)
