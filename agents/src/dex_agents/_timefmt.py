"""Wire times: UTC RFC 3339 with milliseconds and Z; readers also accept the +00:00 form."""

from __future__ import annotations

import functools
import time
from datetime import UTC, datetime


def format_time(moment: datetime) -> str:
    """`2026-11-01T12:00:00.123Z` for an aware datetime (converted to UTC)."""
    if moment.tzinfo is None:
        raise ValueError(f"wire times must be timezone-aware, got naive {moment!r}")
    # isoformat writes "+00:00" for UTC: six characters that become "Z".
    return moment.astimezone(UTC).isoformat(timespec="milliseconds")[:-6] + "Z"


def utc_now_text() -> str:
    """format_time(datetime.now(UTC)): the same clock, read as nanoseconds (see posix_ns_text)."""
    return posix_ns_text(time.time_ns())


def posix_ns_text(ns: int) -> str:
    """format_time of the instant `ns` nanoseconds after the POSIX epoch, milliseconds cut as datetime
    cuts them. Every stored message takes a time: the text up to the second is made once a second,
    which costs a fraction of a datetime's isoformat."""
    seconds, millis = divmod(ns // 1_000_000, 1000)
    return f"{_second_text(seconds)}.{millis:03d}Z"


@functools.lru_cache(maxsize=1)
def _second_text(seconds: int) -> str:
    return format_time(datetime.fromtimestamp(seconds, UTC))[:-5]


def parse_time(text: str) -> datetime:
    """Read a wire time: the Z form and the +00:00 offset form (written by older cores)."""
    value = text[:-1] + "+00:00" if text.endswith(("Z", "z")) else text
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(f"not an RFC 3339 time: {text!r}") from None
    if moment.tzinfo is None:
        raise ValueError(f"RFC 3339 time {text!r} has no offset; wire times are UTC")
    return moment.astimezone(UTC)
