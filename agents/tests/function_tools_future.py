"""TypedDicts declared under `from __future__ import annotations`, for agents/tests/test_function_tools.py.

A module of their own because that test module must not postpone annotations (see its docstring), while
these must: with string annotations Python 3.11 and 3.13 cannot see `Required[...]` / `NotRequired[...]`
when building `__required_keys__`, and take every key's required-ness from the class's totality.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, NotRequired, Required, TypedDict


class FutureFilters(TypedDict):
    name: str
    limit: NotRequired[int]


class FutureOptions(TypedDict, total=False):
    mode: Required[str]
    size: int


class FutureBase(TypedDict, total=False):
    base_required: Required[str]
    base_optional: int


class FutureChild(FutureBase):
    """Total, over a base that is not: each key's required-ness comes from the class that declares it."""

    child_required: int
    child_optional: NotRequired[str]
    described: Annotated[NotRequired[int], "how many"]


@dataclass
class FutureRange:
    """Named in no other module: only this module's namespace resolves the hint `FutureRange`."""

    start: int
    end: int


def future_count(window: FutureRange) -> str:
    """Count the orders in a window."""
    return str(window.end - window.start)
