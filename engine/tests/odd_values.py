"""Values whose repr cannot be made, for the tests that check an error about a caller's or a runner's
value is still the one raised (both packages build such errors with shown())."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest


class Unshowable:
    """A value whose repr and str raise (an ORM row detached from its session, say)."""

    def __repr__(self) -> str:
        raise RuntimeError("no repr")

    def __str__(self) -> str:
        raise RuntimeError("no str")


# What an error shows in place of an Unshowable's repr.
UNSHOWABLE_SHOWN = "(a Unshowable whose repr could not be made: RuntimeError)"

# An int of over 4,300 digits, whose repr Python refuses to make (ValueError), and an Unshowable:
# parametrize a test's `bad` with these.
NO_REPR_VALUES = [pytest.param(10**5000, id="int-of-5000-digits"), pytest.param(Unshowable(), id="repr-raises")]


def assert_refused_naming(build: Callable[[Any], object], bad: Any, error: type[Exception], text: str) -> str:
    """`build(bad)` raises exactly `error`, whose text holds `text` (the field it names): not Python's
    ValueError or the value's own error, raised while that error's text was built. Returns the text."""
    with pytest.raises(Exception) as caught:
        build(bad)
    assert type(caught.value) is error, (type(caught.value), caught.value)
    message = str(caught.value)
    assert text in message, message
    return message
