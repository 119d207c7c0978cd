"""Function tools: schema derivation, argument checking and conversion, invocation, error wrapping.

No engine: `FunctionTool.invoke` is called directly with a hand-built `ToolCallContext`.
This file deliberately has no `from __future__ import annotations`: some tools are defined inside
tests, and their annotations must be real objects for `typing.get_type_hints` to resolve them.
"""

import asyncio
import contextvars
import dataclasses
import enum
import functools
import gc
import inspect
import json
import math
import re
import threading
from dataclasses import InitVar, dataclass, field
from typing import Annotated, Any, ClassVar, Literal, NotRequired, Optional, Required, TypedDict

import pytest
from agents.tests.function_tools_future import FutureChild, FutureFilters, FutureOptions, future_count
from hypothesis import given, settings
from hypothesis import strategies as st

from dex_agents import ToolEffect, ToolExecutionError, ToolOutcomeUnknownError, ToolPolicy
from dex_agents._constants import ARGUMENTS_TOO_DEEP, SHOWN_VALUE_CHARS
from dex_agents.builtin_loop import ModelToolDefinition
from dex_agents.builtin_loop._function_tools import FunctionTool, ToolCallContext, function_tool
from dex_engine import RetryAfterError

# --------------------------------------------------------------------------- fixtures and helpers


def make_context(effect: ToolEffect = ToolEffect.UNCLASSIFIED) -> ToolCallContext:
    return ToolCallContext(
        idempotency_key="flow-1/turn-1/call-1", attempt=1, flow_id="flow-1", turn_id="turn-1",
        tool_call_id="call-1", effect=effect,
    )


def run(tool: FunctionTool, arguments: str | dict[str, Any], effect: ToolEffect = ToolEffect.UNCLASSIFIED) -> str:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return asyncio.run(tool.invoke(text, make_context(effect)))


async def invoke(tool: FunctionTool, arguments: dict[str, Any], effect: ToolEffect = ToolEffect.UNCLASSIFIED) -> str:
    return await tool.invoke(json.dumps(arguments), make_context(effect))


def refusal(tool: FunctionTool, arguments: str | dict[str, Any], effect: ToolEffect = ToolEffect.UNCLASSIFIED) -> str:
    """The message of the ToolExecutionError the call raises (the test fails if it returns)."""
    with pytest.raises(ToolExecutionError) as caught:
        run(tool, arguments, effect)
    return caught.value.message


def capturing_tool(annotation: Any, *, default: Any = inspect.Parameter.empty) -> tuple[FunctionTool, list[Any]]:
    """A one-parameter tool `probe(value: <annotation>)` that records what it received."""
    received: list[Any] = []

    def probe(value: Any) -> str:
        received.append(value)
        return "ok"

    probe.__annotations__ = {"value": annotation}
    if default is not inspect.Parameter.empty:
        probe.__defaults__ = (default,)
    return function_tool(probe), received


def property_schema(tool: FunctionTool) -> Any:
    schema = tool.parameters_schema
    assert schema["type"] == "object"
    assert schema["additionalProperties"] is False
    return schema["properties"]["value"]


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"


class Priority(enum.IntEnum):
    LOW = 1
    HIGH = 2


class Mixed(enum.Enum):
    NAMED = "named"
    NUMBERED = 7


@dataclass
class Address:
    street: str
    city: Annotated[str, "The city name"]
    zip_code: int | None = None
    tags: list[str] = field(default_factory=list)
    normalized: bool = field(default=False, init=False)


@dataclass
class Customer:
    name: str
    address: Address


@dataclass
class Positive:
    amount: int

    def __post_init__(self) -> None:
        if self.amount <= 0:
            raise ValueError("amount must be positive")


class Filters(TypedDict):
    status: Literal["open", "closed"]
    owner: NotRequired[str]


class Paging(TypedDict, total=False):
    page: int
    size: int


@dataclass
class Node:
    label: str
    children: list["Node"]


ADDRESS_SCHEMA = {
    "type": "object",
    "properties": {
        "street": {"type": "string"},
        "city": {"type": "string", "description": "The city name"},
        "zip_code": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["street", "city"],
    "additionalProperties": False,
}


# --------------------------------------------------------------------------- schema and conversion per type


@pytest.mark.parametrize(
    ("annotation", "schema", "argument", "expected"),
    [
        (str, {"type": "string"}, "héllo", "héllo"),
        (int, {"type": "integer"}, 42, 42),
        (float, {"type": "number"}, 2.5, 2.5),
        (bool, {"type": "boolean"}, True, True),
        (None, {"type": "null"}, None, None),
        (list[int], {"type": "array", "items": {"type": "integer"}}, [1, 2], [1, 2]),
        (list, {"type": "array"}, [1, "a", None, {"k": [True]}], [1, "a", None, {"k": [True]}]),
        (dict[str, float], {"type": "object", "additionalProperties": {"type": "number"}}, {"a": 1.5}, {"a": 1.5}),
        (dict, {"type": "object"}, {"any": ["json", 1]}, {"any": ["json", 1]}),
        (Literal["fast", "slow"], {"type": "string", "enum": ["fast", "slow"]}, "slow", "slow"),
        (Literal[1, "one", True, None], {"enum": [1, "one", True, None]}, True, True),
        (Color, {"type": "string", "enum": ["red", "green"]}, "green", Color.GREEN),
        (Priority, {"type": "integer", "enum": [1, 2]}, 2, Priority.HIGH),
        (Mixed, {"enum": ["named", 7]}, 7, Mixed.NUMBERED),
        (int | str, {"anyOf": [{"type": "integer"}, {"type": "string"}]}, "x", "x"),
        (Optional[int], {"anyOf": [{"type": "integer"}, {"type": "null"}]}, None, None),  # noqa: UP045 - typing.Optional is what the test is about
        (int | None, {"anyOf": [{"type": "integer"}, {"type": "null"}]}, 5, 5),
        (Annotated[str, "The order ID"], {"type": "string", "description": "The order ID"}, "o-1", "o-1"),
        (
            Annotated[int | None, "A count", "a second string is ignored", object()],
            {"anyOf": [{"type": "integer"}, {"type": "null"}], "description": "A count"},
            3,
            3,
        ),
        (Annotated[int, object()], {"type": "integer"}, 3, 3),
        (list[Annotated[str, "a tag"]], {"type": "array", "items": {"type": "string", "description": "a tag"}}, ["t"],
         ["t"]),
    ],
)
def test_each_supported_type_has_its_schema_and_arrives_converted(
    annotation: Any, schema: dict[str, Any], argument: Any, expected: Any
) -> None:
    """The derived property schema is exact, and a valid argument arrives with the declared Python type."""
    tool, received = capturing_tool(annotation)
    assert property_schema(tool) == schema
    assert tool.parameters_schema["required"] == ["value"]
    assert run(tool, {"value": argument}) == "ok"
    assert received == [expected]
    assert type(received[0]) is type(expected)


def test_dataclass_parameter_has_nested_object_schema_and_arrives_as_instance() -> None:
    """Dataclasses nest as closed object schemas (init=False fields left out) and arrive built."""
    tool, received = capturing_tool(Customer)
    assert property_schema(tool) == {
        "type": "object",
        "properties": {"name": {"type": "string"}, "address": ADDRESS_SCHEMA},
        "required": ["name", "address"],
        "additionalProperties": False,
    }
    run(tool, {"value": {"name": "Ann", "address": {"street": "Main 1", "city": "Oslo", "zip_code": 150}}})
    assert received == [Customer("Ann", Address("Main 1", "Oslo", 150, []))]
    assert type(received[0].address) is Address


def test_typed_dict_parameter_has_object_schema_and_arrives_as_dict() -> None:
    """TypedDict keys are required unless NotRequired or total=False; the value arrives as a plain dict."""
    tool, received = capturing_tool(Filters)
    assert property_schema(tool) == {
        "type": "object",
        "properties": {"status": {"type": "string", "enum": ["open", "closed"]}, "owner": {"type": "string"}},
        "required": ["status"],
        "additionalProperties": False,
    }
    run(tool, {"value": {"status": "open"}})
    assert received == [{"status": "open"}]

    paging, paging_received = capturing_tool(Paging)
    assert property_schema(paging)["required"] == []
    run(paging, {"value": {"size": 10}})
    assert paging_received == [{"size": 10}]



def test_typed_dict_qualifiers_decide_required_keys_under_postponed_annotations() -> None:
    """Catches required-ness taken from `__required_keys__` alone: with `from __future__ import annotations`
    Python 3.11 records a NotRequired key as required and a Required key of a total=False class as optional."""
    filters, filters_received = capturing_tool(FutureFilters)
    assert property_schema(filters)["required"] == ["name"]
    run(filters, {"value": {"name": "x"}})
    assert filters_received == [{"name": "x"}]

    options, options_received = capturing_tool(FutureOptions)
    assert property_schema(options)["required"] == ["mode"]
    assert refusal(options, {"value": {"size": 1}}) == (
        "invalid arguments for probe: parameter 'value': missing required field 'mode'")
    assert options_received == []


def test_typed_dict_keys_inherited_across_totality_keep_their_own_required_ness() -> None:
    """Catches one totality applied to every key: a base with total=False and a total subclass, each with
    qualified and unqualified keys, all declared under `from __future__ import annotations`."""
    tool, received = capturing_tool(FutureChild)
    schema = property_schema(tool)
    assert schema["required"] == ["base_required", "child_required"]
    assert schema["properties"]["described"] == {"type": "integer", "description": "how many"}
    run(tool, {"value": {"base_required": "a", "child_required": 1}})
    assert received == [{"base_required": "a", "child_required": 1}]


class QualifiedInsideAnnotated(TypedDict):
    name: str
    limit: Annotated[NotRequired[int], "how many"]
    owner: NotRequired[Annotated[str, "who"]]


class RequiredInsideAnnotated(TypedDict, total=False):
    mode: Annotated[Required[str], "how"]
    size: Annotated[int, "how big"]


def test_typed_dict_qualifier_inside_annotated_is_unwrapped_and_keeps_the_description() -> None:
    """Catches a qualifier stripped only at the top: `Annotated[NotRequired[int], "..."]` (valid per PEP 655)
    was refused as "NotRequired[int] is not a supported argument type"."""
    tool, received = capturing_tool(QualifiedInsideAnnotated)
    assert property_schema(tool) == {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "limit": {"type": "integer", "description": "how many"},
            "owner": {"type": "string", "description": "who"},
        },
        "required": ["name"],
        "additionalProperties": False,
    }
    run(tool, {"value": {"name": "x", "limit": 2}})
    assert received == [{"name": "x", "limit": 2}]

    partial, _ = capturing_tool(RequiredInsideAnnotated)
    assert property_schema(partial)["required"] == ["mode"]
    assert property_schema(partial)["properties"]["mode"] == {"type": "string", "description": "how"}


class ConflictingQualifiers(TypedDict):
    limit: Annotated[Required[NotRequired[int]], "how many"]


def test_typed_dict_key_both_required_and_not_required_is_refused() -> None:
    """A key cannot be both; the error names the field rather than picking one qualifier silently."""
    with pytest.raises(TypeError, match=r"field 'limit' of ConflictingQualifiers: .* both Required and NotRequired"):
        capturing_tool(ConflictingQualifiers)

def test_int_argument_for_float_parameter_arrives_as_float() -> None:
    """An integer is a valid JSON Schema number; the function gets a float, not an int."""
    tool, received = capturing_tool(float)
    run(tool, {"value": 3})
    assert received == [3.0]
    assert type(received[0]) is float


def test_integral_float_for_int_parameter_arrives_as_int() -> None:
    """JSON Schema's integer accepts 3.0; the function gets the int 3."""
    tool, received = capturing_tool(int)
    run(tool, '{"value": 3.0}')
    assert received == [3]
    assert type(received[0]) is int


@pytest.mark.parametrize(
    ("annotation", "expected"), [(Literal[1, 2], 2), (Priority, Priority.HIGH), (Literal[1, 2] | str, 2)]
)
def test_integral_float_for_integer_choice_arrives_as_the_choice(annotation: Any, expected: Any) -> None:
    """An integer Literal or Enum is offered as an integer enum, which 2.0 satisfies as it does `int`."""
    tool, received = capturing_tool(annotation)
    run(tool, '{"value": 2.0}')
    assert received == [expected]
    assert type(received[0]) is type(expected)


@pytest.mark.parametrize(("argument", "shown"), [("2.5", "2.5"), ("true", "true"), ("3.0", "3.0")])
def test_integer_choice_still_refuses_fractions_booleans_and_other_values(argument: str, shown: str) -> None:
    tool, received = capturing_tool(Literal[1, 2])
    assert refusal(tool, f'{{"value": {argument}}}') == (
        f"invalid arguments for probe: parameter 'value': expected one of 1, 2, got {shown}")
    assert received == []


def test_initvar_field_of_a_dataclass_is_offered_and_passed_to_init() -> None:
    """An InitVar is an `__init__` argument, so it is a member; a ClassVar is not."""

    @dataclass
    class Money:
        cents: int
        currency: InitVar[str]
        rounded: InitVar[bool] = False
        places: ClassVar[int] = 2

        def __post_init__(self, currency: str, rounded: bool) -> None:
            self.code = currency.upper()
            self.was_rounded = rounded

    tool, received = capturing_tool(Money)
    assert property_schema(tool) == {
        "type": "object",
        "properties": {"cents": {"type": "integer"}, "currency": {"type": "string"}, "rounded": {"type": "boolean"}},
        "required": ["cents", "currency"],
        "additionalProperties": False,
    }
    run(tool, {"value": {"cents": 5, "currency": "eur"}})
    run(tool, {"value": {"cents": 7, "currency": "usd", "rounded": True}})
    assert [(m.cents, m.code, m.was_rounded) for m in received] == [(5, "EUR", False), (7, "USD", True)]
    with pytest.raises(ToolExecutionError, match="parameter 'value': missing required field 'currency'"):
        run(tool, {"value": {"cents": 5}})


def test_union_tries_alternatives_in_declaration_order() -> None:
    """`int | float` keeps 3 an int and 3.5 a float; a union of objects picks the one that fits."""
    tool, received = capturing_tool(int | float)
    run(tool, {"value": 3})
    run(tool, {"value": 3.5})
    assert [(v, type(v)) for v in received] == [(3, int), (3.5, float)]

    objects, objects_received = capturing_tool(Positive | Address)
    run(objects, {"value": {"street": "s", "city": "c"}})
    assert objects_received == [Address("s", "c")]


def test_full_tool_schema_lists_parameters_in_order_with_required_ones() -> None:
    """The arguments object: properties in signature order, required only for parameters without defaults."""

    @function_tool(effect=ToolEffect.READ)
    async def search(
        query: Annotated[str, "Words to look for"], limit: int = 10, filters: Filters | None = None
    ) -> list[str]:
        """Search tickets.

        Returns matching ticket IDs.
        """
        return []

    assert search.definition() == ModelToolDefinition(
        name="search",
        description="Search tickets.\n\nReturns matching ticket IDs.",
        parameters_schema={
            "type": "object",
            "properties": {
                "query": {"type": "string", "description": "Words to look for"},
                "limit": {"type": "integer"},
                "filters": {"anyOf": [property_schema(capturing_tool(Filters)[0]), {"type": "null"}]},
            },
            "required": ["query"],
            "additionalProperties": False,
        },
    )


def test_tool_without_parameters_has_empty_closed_object_schema() -> None:
    """A parameterless tool offers an empty object with required [] and accepts `{}`."""

    @function_tool
    def ping() -> str:
        return "pong"

    assert ping.parameters_schema == {"type": "object", "properties": {}, "required": [], "additionalProperties": False}
    assert run(ping, "{}") == "pong"


def test_defaults_apply_when_absent_and_null_means_absent_for_non_nullable_optional() -> None:
    """A missing optional argument takes the default; `null` for one whose type has no None does too."""
    received: list[tuple[int, int | None]] = []

    @function_tool
    def page(size: int = 20, cursor: int | None = 5) -> str:
        received.append((size, cursor))
        return "ok"

    run(page, {})
    run(page, {"size": None})
    run(page, {"cursor": None})  # the type admits None, so null is a real value
    assert received == [(20, 5), (20, 5), (20, None)]


def test_null_for_dataclass_field_with_default_means_absent() -> None:
    """The null-means-absent rule applies to nested members with defaults too."""

    @dataclass
    class Limits:
        size: int = 7

    tool, received = capturing_tool(Limits)
    run(tool, {"value": {"size": None}})
    assert received == [Limits(7)]


@given(text=st.text(), number=st.integers(min_value=-(2**70), max_value=2**70))
@settings(max_examples=50, deadline=None)
def test_any_string_and_integer_round_trips_exactly(text: str, number: int) -> None:
    """Whatever JSON string or integer the model sends reaches the function unchanged."""
    received: list[tuple[str, int]] = []

    @function_tool
    def echo(text: str, number: int) -> str:
        received.append((text, number))
        return text

    assert run(echo, {"text": text, "number": number}) == text
    assert received == [(text, number)]


# --------------------------------------------------------------------------- schema violations


BASE = {"order_id": "o", "amount": 1}


@pytest.mark.parametrize(
    ("arguments", "reason"),
    [
        ({"order_id": 5, "amount": 1}, "parameter 'order_id': expected string, got integer"),
        ({"amount": 1}, "missing required parameter 'order_id'"),
        ({**BASE, "note": "x"}, "unknown parameter 'note'"),
        ({**BASE, "b": 1, "a": 2}, "unknown parameters 'b', 'a'"),
        ({"order_id": "o", "amount": True}, "parameter 'amount': expected integer, got boolean"),
        ({"order_id": "o", "amount": 1.5}, "parameter 'amount': expected integer, got number"),
        ({**BASE, "ratio": False}, "parameter 'ratio': expected number, got boolean"),
        ({**BASE, "ratio": 10**400}, "parameter 'ratio': number out of range"),
        ({**BASE, "color": "blue"}, 'parameter \'color\': expected one of "red", "green", got "blue"'),
        ({**BASE, "color": ["red"]}, 'parameter \'color\': expected one of "red", "green", got ["red"]'),
        ({**BASE, "mode": 1}, 'parameter \'mode\': expected one of "a", true, got 1'),
        ({**BASE, "ids": [1, "2"]}, "parameter 'ids[1]': expected integer, got string"),
        ({**BASE, "weights": {"a b": "x"}}, 'parameter \'weights["a b"]\': expected number, got string'),
        ({**BASE, "either": [1]}, "parameter 'either': expected integer or string, got array"),
        ({**BASE, "address": {"street": "s"}}, "parameter 'address': missing required field 'city'"),
        ({**BASE, "address": {"street": "s", "city": "c", "zip": 1}}, "parameter 'address': unknown field 'zip'"),
        ({**BASE, "address": {"street": "s", "city": 1}}, "parameter 'address.city': expected string, got integer"),
        ({**BASE, "address": "Main 1"}, "parameter 'address': expected object (Address) or null, got string"),
        ({**BASE, "positive": {"amount": 0}}, "parameter 'positive': ValueError: amount must be positive"),
        ({**BASE, "filters": {"status": "pending"}},
         'parameter \'filters.status\': expected one of "open", "closed", got "pending"'),
    ],
)
def test_schema_violations_are_model_visible_errors_naming_the_parameter(
    arguments: dict[str, Any], reason: str
) -> None:
    """Each violation raises ToolExecutionError with the exact reason, and the function never runs."""
    calls: list[object] = []

    @function_tool(effect=ToolEffect.NON_IDEMPOTENT_WRITE)
    def refund(
        order_id: str,
        amount: int,
        ratio: float = 1.0,
        color: Color = Color.RED,
        mode: Literal["a", True] = "a",
        ids: list[int] | None = None,
        weights: dict[str, float] | None = None,
        either: int | str = 0,
        address: Address | None = None,
        positive: Positive | None = None,
        filters: Filters | None = None,
    ) -> str:
        calls.append(order_id)
        return "refunded"

    assert refusal(refund, arguments) == f"invalid arguments for refund: {reason}"
    assert calls == []


@pytest.mark.parametrize("number", ["1e999", "-1e999"])
def test_a_number_past_the_float_range_is_refused_and_never_run(number: str) -> None:
    """A JSON number that is finite as text but overflows a float (1e999 decodes to inf) is refused
    as out of range, like 10**400. Catches (mutant F02 of the loop sweep, the finiteness check dropped):
    the tool ran with ratio=inf."""
    calls: list[float] = []

    @function_tool(effect=ToolEffect.READ)
    def scale(ratio: float) -> str:
        calls.append(ratio)
        return "scaled"

    assert refusal(scale, f'{{"ratio": {number}}}') == (
        "invalid arguments for scale: parameter 'ratio': number out of range")
    assert calls == []


@pytest.mark.parametrize("text", ["not json", "", "{", "{'a': 1}", "NaN", '{"a": Infinity}', "{} {}"])
def test_text_that_is_not_json_is_refused(text: str) -> None:
    """Invalid JSON (non-standard constants included) gives the contract's exact error."""
    tool, received = capturing_tool(int, default=0)
    assert refusal(tool, text) == "invalid arguments for probe: arguments are not valid JSON"
    assert received == []


@pytest.mark.parametrize("text", ["[]", "[{}]", "1", '"{}"', "null", "true"])
def test_json_that_is_not_an_object_is_refused(text: str) -> None:
    """Arguments must be a JSON object."""
    tool, received = capturing_tool(int, default=0)
    assert refusal(tool, text) == "invalid arguments for probe: arguments must be a JSON object"
    assert received == []


# Far above any recursion limit (Python's or 3.12+'s C one): json.loads and json.dumps overflow on it
# whatever the depth of the stack they run on.
OVERFLOWING_DEPTH = 100_000


@pytest.mark.parametrize("effect", [ToolEffect.NON_IDEMPOTENT_WRITE, ToolEffect.READ])
def test_arguments_nested_too_deeply_to_decode_are_refused_and_never_run(effect: ToolEffect) -> None:
    """Catches RecursionError from json.loads escaping invoke: the session recorded a write that never ran
    as outcome_unknown and retried a read, failing it with the raw "maximum recursion depth" text."""
    text = '{"value": ' + "[" * OVERFLOWING_DEPTH + "]" * OVERFLOWING_DEPTH + "}"
    with pytest.raises(RecursionError):
        json.loads(text)  # the premise: the decode itself overflows
    tool, received = capturing_tool(list)
    assert refusal(tool, text, effect) == f"invalid arguments for probe: {ARGUMENTS_TOO_DEEP}"
    assert received == []


def test_arguments_nested_too_deeply_to_check_are_refused_and_never_run() -> None:
    """Catches RecursionError escaping the check: a deep value the schema refuses is shown in the error, and
    showing it overflows. prepare_arguments hands it over, so no decode overflows first."""
    deep: list[Any] = []
    for _ in range(OVERFLOWING_DEPTH):
        deep = [deep]
    with pytest.raises(RecursionError):
        json.dumps(deep)  # the premise: showing the value overflows
    received: list[str] = []

    @function_tool(effect=ToolEffect.NON_IDEMPOTENT_WRITE, prepare_arguments=lambda _: {"mode": deep})
    def pick(mode: Literal["fast", "slow"]) -> str:
        received.append(mode)
        return "picked"

    assert refusal(pick, {"mode": "fast"}, ToolEffect.NON_IDEMPOTENT_WRITE) == (
        f"invalid arguments for pick: {ARGUMENTS_TOO_DEEP}")
    assert received == []


# --------------------------------------------------------------------------- prepare_arguments


def upgrade_old_shape(arguments: dict[str, Any]) -> dict[str, Any]:
    """Version 1 of the tool took {"id": ..., "cents": "<digits>"}."""
    if "id" in arguments:
        return {"order_id": arguments["id"], "amount_cents": int(arguments["cents"])}
    return arguments


def test_prepare_arguments_converts_an_old_argument_shape_before_the_check() -> None:
    """Old and new shapes both reach the function in the new shape; the schema describes the new one."""
    received: list[tuple[str, int]] = []

    @function_tool(prepare_arguments=upgrade_old_shape)
    def refund(order_id: str, amount_cents: int) -> str:
        received.append((order_id, amount_cents))
        return "ok"

    assert set(refund.parameters_schema["properties"]) == {"order_id", "amount_cents"}
    run(refund, {"id": "o-1", "cents": "250"})
    run(refund, {"order_id": "o-2", "amount_cents": 99})
    assert received == [("o-1", 250), ("o-2", 99)]


def test_prepare_arguments_output_is_still_checked_against_the_schema() -> None:
    """What prepare_arguments returns goes through the same check as the model's arguments."""

    @function_tool(prepare_arguments=lambda arguments: {**arguments, "extra": 1})
    def tool(order_id: str) -> str:
        return order_id

    assert refusal(tool, {"order_id": "o"}) == "invalid arguments for tool: unknown parameter 'extra'"


def test_prepare_arguments_exception_fails_like_a_schema_violation() -> None:
    """An exception from prepare_arguments becomes `invalid arguments for <tool>: ...`; the tool never runs."""
    calls: list[str] = []

    @function_tool(effect=ToolEffect.NON_IDEMPOTENT_WRITE, prepare_arguments=upgrade_old_shape)
    def refund(order_id: str, amount_cents: int) -> str:
        calls.append(order_id)
        return "ok"

    assert refusal(refund, {"id": "o-1", "cents": "lots"}) == (
        "invalid arguments for refund: prepare_arguments failed: "
        "ValueError: invalid literal for int() with base 10: 'lots'"
    )
    with pytest.raises(ToolExecutionError) as missing:
        run(refund, {"id": "o-1"})
    assert missing.value.message == "invalid arguments for refund: prepare_arguments failed: KeyError: 'cents'"
    assert calls == []


def test_prepare_arguments_returning_a_coroutine_is_refused() -> None:
    """An awaitable result is refused, never awaited, and closed (no 'never awaited' warning)."""
    started: list[str] = []
    coroutines: list[Any] = []

    async def later(arguments: dict[str, Any]) -> dict[str, Any]:
        started.append("ran")
        return arguments

    def sneaky(arguments: dict[str, Any]) -> dict[str, Any]:
        coroutine = later(arguments)
        coroutines.append(coroutine)
        return coroutine  # type: ignore[return-value]

    @function_tool(prepare_arguments=sneaky)
    def tool(order_id: str) -> str:
        return order_id

    assert refusal(tool, {"order_id": "o"}) == (
        "invalid arguments for tool: prepare_arguments returned an awaitable; it must be synchronous"
    )
    assert started == []
    assert inspect.getcoroutinestate(coroutines[0]) == inspect.CORO_CLOSED


def test_async_prepare_arguments_is_refused_at_definition() -> None:
    """An async prepare_arguments can never be right, so defining the tool fails."""

    async def prepare(arguments: dict[str, Any]) -> dict[str, Any]:
        return arguments

    with pytest.raises(TypeError, match="prepare_arguments of tool 'tool' must be synchronous"):

        @function_tool(prepare_arguments=prepare)  # type: ignore[arg-type]
        def tool(order_id: str) -> str:
            return order_id


def test_prepare_arguments_returning_a_non_object_is_refused() -> None:
    """prepare_arguments must hand back a mapping of arguments."""

    @function_tool(prepare_arguments=lambda arguments: [arguments])  # type: ignore[arg-type,return-value]
    def tool(order_id: str) -> str:
        return order_id

    assert refusal(tool, {"order_id": "o"}) == (
        "invalid arguments for tool: prepare_arguments returned list, not a JSON object")


async def test_cancelled_error_from_prepare_arguments_passes_through() -> None:
    """CancelledError is not turned into an arguments error."""

    def cancel(arguments: dict[str, Any]) -> dict[str, Any]:
        raise asyncio.CancelledError

    @function_tool(effect=ToolEffect.READ, prepare_arguments=cancel)
    def tool(order_id: str) -> str:
        return order_id

    with pytest.raises(asyncio.CancelledError):
        await invoke(tool, {"order_id": "o"}, ToolEffect.READ)


# --------------------------------------------------------------------------- running the function


async def test_sync_function_runs_in_a_worker_thread_and_async_in_the_loop() -> None:
    """A sync tool runs off the event loop's thread; an async one runs on it."""
    loop_thread = threading.get_ident()
    threads: dict[str, int] = {}

    @function_tool
    def blocking() -> str:
        threads["sync"] = threading.get_ident()
        return "sync"

    @function_tool
    async def non_blocking() -> str:
        threads["async"] = threading.get_ident()
        return "async"

    assert await invoke(blocking, {}) == "sync"
    assert await invoke(non_blocking, {}) == "async"
    assert threads["sync"] != loop_thread
    assert threads["async"] == loop_thread


async def test_async_callable_object_is_awaited() -> None:
    """An object whose __call__ is async counts as an async tool."""

    class Lookup:
        async def __call__(self, order_id: str) -> str:
            return f"order {order_id}"

    tool = FunctionTool(Lookup(), name="lookup", effect=ToolEffect.READ)
    assert tool.parameters_schema["properties"] == {"order_id": {"type": "string"}}
    assert await invoke(tool, {"order_id": "7"}) == "order 7"


@pytest.mark.parametrize(
    ("result", "output"),
    [
        ("plain text, not JSON", "plain text, not JSON"),
        ("", ""),
        ({"status": "ok", "count": 2}, '{"status":"ok","count":2}'),
        ([1, 2.5, None, True], "[1,2.5,null,true]"),
        (None, "null"),
        (7, "7"),
        ({"name": "Ünïcode"}, '{"name":"Ünïcode"}'),
        # msgspec encodes the instance's attributes; an init=False field's class-level default is none.
        (Address("Main 1", "Oslo"), '{"street":"Main 1","city":"Oslo","zip_code":null,"tags":[]}'),
        (Color.GREEN, '"green"'),
        ({"priority": Priority.HIGH}, '{"priority":2}'),
    ],
)
async def test_result_is_the_string_or_its_json(result: object, output: str) -> None:
    """A str is the output as is; anything else is compact JSON (dataclasses and Enums included)."""

    @function_tool
    async def produce() -> Any:
        return result

    assert await invoke(produce, {}) == output


async def test_unencodable_result_follows_the_effect_rule() -> None:
    """A result JSON cannot hold fails like any other error of the call: shown for reads, raised for writes."""

    @function_tool
    async def produce() -> object:
        return object()

    with pytest.raises(ToolExecutionError, match=r"^TypeError: "):
        await invoke(produce, {}, ToolEffect.READ)
    with pytest.raises(TypeError):
        await invoke(produce, {}, ToolEffect.NON_IDEMPOTENT_WRITE)


@dataclass
class Reading:
    value: float


@pytest.mark.parametrize("result", [
    {"ratio": math.nan}, [1.0, math.inf], {"deep": [{"limit": -math.inf}]}, math.nan,
    Reading(math.nan), {"readings": [Reading(math.inf)]},  # msgspec encodes dataclasses too
])
async def test_a_result_holding_nan_or_infinity_follows_the_effect_rule(result: object) -> None:
    """NaN and infinities, which JSON cannot hold, fail the call like any unencodable result.
    Catches: msgspec writing them as null, the model shown a wrong value as the call's success."""

    @function_tool
    async def produce() -> object:
        return result

    with pytest.raises(ToolExecutionError, match=r"^ValueError: the result holds the number -?(nan|inf), "
                                                  "which JSON cannot hold$"):
        await invoke(produce, {}, ToolEffect.READ)
    with pytest.raises(ValueError, match="which JSON cannot hold"):
        await invoke(produce, {}, ToolEffect.NON_IDEMPOTENT_WRITE)

    @function_tool
    async def with_null() -> object:
        return {"value": None, "count": 1.5}

    assert await invoke(with_null, {}) == '{"value":null,"count":1.5}'  # a real null is kept


@pytest.mark.parametrize("effect", [ToolEffect.READ, ToolEffect.IDEMPOTENT_WRITE])
@pytest.mark.parametrize("sync", [True, False])
async def test_errors_of_repeatable_calls_become_model_visible(effect: ToolEffect, sync: bool) -> None:
    """For read and idempotent_write calls, any exception becomes ToolExecutionError('<Type>: <message>')."""
    tool = failing_tool(sync, ValueError("order o-1 not found"))
    with pytest.raises(ToolExecutionError) as caught:
        await invoke(tool, {}, effect)
    assert caught.value.message == "ValueError: order o-1 not found"
    assert isinstance(caught.value.__cause__, ValueError)


@pytest.mark.parametrize("effect", [ToolEffect.NON_IDEMPOTENT_WRITE, ToolEffect.UNCLASSIFIED])
@pytest.mark.parametrize("sync", [True, False])
async def test_errors_of_writes_that_may_not_repeat_propagate(effect: ToolEffect, sync: bool) -> None:
    """For non_idempotent_write and unclassified calls the exception propagates unchanged (outcome unknown)."""
    error = ConnectionError("payment gateway closed the connection")
    tool = failing_tool(sync, error)
    with pytest.raises(ConnectionError) as caught:
        await invoke(tool, {}, effect)
    assert caught.value is error


async def test_wrapping_follows_the_context_effect_not_the_declared_one() -> None:
    """The call's effect after the policies decides; a hand-built context defaults to unclassified."""
    tool = failing_tool(False, ValueError("boom"), effect=ToolEffect.READ)
    with pytest.raises(ValueError, match="boom"):
        await tool.invoke("{}", ToolCallContext("k", 1, "f", "t", "c"))
    write = failing_tool(False, ValueError("boom"), effect=ToolEffect.NON_IDEMPOTENT_WRITE)
    with pytest.raises(ToolExecutionError, match=r"^ValueError: boom$"):
        await invoke(write, {}, ToolEffect.READ)


@pytest.mark.parametrize("effect", list(ToolEffect))
async def test_tool_execution_error_passes_through_for_every_effect(effect: ToolEffect) -> None:
    """The tool's own model-visible error is not re-wrapped."""
    error = ToolExecutionError("no such order")
    with pytest.raises(ToolExecutionError) as caught:
        await invoke(failing_tool(False, error), {}, effect)
    assert caught.value is error


@pytest.mark.parametrize("effect", list(ToolEffect))
async def test_outcome_unknown_error_passes_through_for_every_effect(effect: ToolEffect) -> None:
    """A tool that says its write may have happened is never shown as a plain failure."""
    error = ToolOutcomeUnknownError("sent, no reply")
    with pytest.raises(ToolOutcomeUnknownError) as caught:
        await invoke(failing_tool(True, error), {}, effect)
    assert caught.value is error


class _RateLimited(Exception):
    def __init__(self, retry_after_seconds: object) -> None:
        super().__init__("429 Too Many Requests")
        self.retry_after_seconds = retry_after_seconds


@pytest.mark.parametrize("effect", list(ToolEffect))
@pytest.mark.parametrize("sync", [True, False])
async def test_an_error_asking_retry_after_propagates_for_every_effect(effect: ToolEffect, sync: bool) -> None:
    """An error with retry_after_seconds (a library's, or dex_engine.RetryAfterError) propagates
    unchanged, so CallTool's retry honours the delay; one whose retry_after_seconds is None asks
    nothing and is wrapped as any error is. Catches: a rate-limited read turned into
    ToolExecutionError, failing the call at once with no retry."""
    for error in (_RateLimited(2.5), RetryAfterError(2, "quota: retry in 2 s")):
        with pytest.raises(type(error)) as caught:
            await invoke(failing_tool(sync, error), {}, effect)
        assert caught.value is error
    if effect in (ToolEffect.READ, ToolEffect.IDEMPOTENT_WRITE):
        with pytest.raises(ToolExecutionError, match=r"^_RateLimited: 429 Too Many Requests$"):
            await invoke(failing_tool(sync, _RateLimited(None)), {}, effect)


class _UnreadableDelay(Exception):
    """A rate limit error whose retry_after_seconds property raises (a library's bad header parse)."""

    @property
    def retry_after_seconds(self) -> float:
        raise ValueError("Retry-After: soon")


async def test_an_error_whose_retry_after_cannot_be_read_still_propagates_from_a_read() -> None:
    """An error whose retry_after_seconds raises when read propagates unchanged, as one with a delay
    does: the engine reads it, notes the problem in the attempt's history and retries at the
    policy's interval. Catches (mutant F14 of the loop sweep, taken as asking nothing): a read's
    rate limit shown to the model as a failed call, with no retry."""
    error = _UnreadableDelay("429 Too Many Requests")
    with pytest.raises(_UnreadableDelay) as caught:
        await invoke(failing_tool(False, error), {}, ToolEffect.READ)
    assert caught.value is error


@pytest.mark.timeout(30)  # the mutant below hangs the call for good
async def test_a_sync_tool_raising_stop_iteration_fails_the_call() -> None:
    """A sync tool that raises StopIteration (next() on an empty iterator) fails its call naming it.
    Catches (mutant F22 of the loop sweep, StopIteration passed on as it is): asyncio refuses it as
    a future's exception, so the call never ended and its Step hung until its timeout."""
    def first_match() -> str:
        return next(iter([]))

    with pytest.raises(ToolExecutionError, match=r"^RuntimeError: tool first_match raised StopIteration$"):
        await FunctionTool(first_match, effect=ToolEffect.READ).invoke("{}", make_context(ToolEffect.READ))


async def test_a_sync_function_returning_a_coroutine_has_it_awaited() -> None:
    """A plain def that hands back a coroutine (a wrapper around an async client call) has it
    awaited and its result returned. Catches (mutant F25 of the loop sweep, the awaitable taken as
    the result): "the result ... is not JSON", and a "never awaited" warning."""
    async def fetch(order_id: str) -> str:
        return f"order {order_id}"

    def lookup(order_id: str) -> Any:
        return fetch(order_id)

    assert await invoke(FunctionTool(lookup, effect=ToolEffect.READ), {"order_id": "A-1"}) == "order A-1"


@pytest.mark.parametrize("sync", [True, False])
async def test_cancelled_error_always_propagates(sync: bool) -> None:
    """CancelledError is never turned into a model-visible error, even for reads."""
    with pytest.raises(asyncio.CancelledError):
        await invoke(failing_tool(sync, asyncio.CancelledError()), {}, ToolEffect.READ)


@pytest.mark.parametrize("error", [KeyboardInterrupt(), SystemExit(3)], ids=["KeyboardInterrupt", "SystemExit"])
async def test_a_sync_tool_raising_keyboard_interrupt_or_system_exit_fails_the_call(error: BaseException) -> None:
    """Raised in the tool's thread, it is no signal to the process: the call fails (a read's error is
    model-visible). Catches: the exception carried out of the tool Step, ending the Worker."""
    with pytest.raises(ToolExecutionError, match=f"tool fail raised {type(error).__name__}"):
        await invoke(failing_tool(True, error), {}, ToolEffect.READ)


async def test_a_sync_tool_runs_on_a_daemon_thread_with_the_callers_context() -> None:
    """Catches: the default executor's thread, which the event loop and the interpreter join at
    their end, so a hung sync tool held a stopped Worker's process up past its shutdown grace."""
    seen: list[tuple[bool, str]] = []
    marker: contextvars.ContextVar[str] = contextvars.ContextVar("marker")

    def where() -> str:
        seen.append((threading.current_thread().daemon, marker.get("unset")))
        return "ok"

    marker.set("caller's")
    assert await invoke(FunctionTool(where, name="where", effect=ToolEffect.READ), {}) == "ok"
    assert seen == [(True, "caller's")]


class LateTool:
    """A sync tool that blocks in its thread until released, then returns or raises `outcome`."""

    def __init__(self, outcome: object) -> None:
        self.started, self.release = threading.Event(), threading.Event()
        self.outcome = outcome
        self.tool = FunctionTool(self._late, name="late", effect=ToolEffect.NON_IDEMPOTENT_WRITE)

    def _late(self) -> object:
        self.started.set()
        assert self.release.wait(30), "the test never released the tool"
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome

    def finish(self) -> None:
        """Release the tool and wait for its thread to end (it delivers its outcome, or drops it)."""
        self.release.set()
        for thread in threading.enumerate():
            if thread.name == "dex-tool:late":
                thread.join(10)
                assert not thread.is_alive()


LATE_OUTCOMES = [
    pytest.param("late result", id="returns"),
    pytest.param(ValueError("late failure"), id="raises"),
    pytest.param(SystemExit(3), id="raises-SystemExit"),
]


@pytest.fixture
def escaped(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """What escaped a tool's thread unhandled: a thread's exception, or an unraisable one."""
    seen: list[object] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: seen.append(args.exc_value))
    monkeypatch.setattr("sys.unraisablehook", lambda unraisable: seen.append(unraisable.exc_value))
    return seen


@pytest.mark.parametrize("outcome", LATE_OUTCOMES)
def test_a_sync_tool_that_ends_after_its_event_loop_closed_is_dropped_quietly(
    outcome: object, escaped: list[object]
) -> None:
    """The loop ended (a Worker's asyncio.run returned, cancelling the call) while the tool ran: the
    thread's later outcome has no loop to go to and is dropped, with nothing raised in the thread."""
    late = LateTool(outcome)
    ended: list[str] = []
    reported: list[object] = []

    async def leave_the_call_running() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _loop, context: reported.append(context))
        call = asyncio.create_task(late.tool.invoke("{}", make_context(ToolEffect.NON_IDEMPOTENT_WRITE)))
        await asyncio.to_thread(late.started.wait, 10)
        call.add_done_callback(lambda task: ended.append("cancelled" if task.cancelled() else repr(task.result())))

    asyncio.run(leave_the_call_running())  # cancels the call, then closes the loop
    late.finish()
    assert (ended, reported, escaped) == (["cancelled"], [], [])


@pytest.mark.parametrize("outcome", LATE_OUTCOMES)
async def test_a_sync_tool_whose_call_was_cancelled_has_its_later_outcome_dropped(
    outcome: object, escaped: list[object]
) -> None:
    """The call is cancelled (Step revoked, timed out, Worker stopping) while the tool's thread runs:
    CancelledError at once, never a result or an error of the call, and what the thread returns or
    raises later reaches nobody: no "exception was never retrieved", nothing raised in the thread."""
    late = LateTool(outcome)
    reported: list[object] = []
    asyncio.get_running_loop().set_exception_handler(lambda _loop, context: reported.append(context))
    call = asyncio.create_task(late.tool.invoke("{}", make_context(ToolEffect.NON_IDEMPOTENT_WRITE)))
    await asyncio.to_thread(late.started.wait, 10)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    await asyncio.to_thread(late.finish)
    for _ in range(3):  # the thread's callback, had it been scheduled, runs in one of these rounds
        await asyncio.sleep(0)
    gc.collect()  # a future holding a never-retrieved exception would report it when collected
    assert (reported, escaped) == ([], [])


async def test_a_sync_tool_that_times_out_frees_the_call_and_its_late_result_is_dropped(escaped: list[object]) -> None:
    """A tool Step's method timeout cancels the wait on the thread: the call ends at the timeout,
    and the result the thread returns afterwards is dropped."""
    late = LateTool("late result")
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.2):
            await late.tool.invoke("{}", make_context(ToolEffect.NON_IDEMPOTENT_WRITE))
    await asyncio.to_thread(late.finish)
    await asyncio.sleep(0)
    assert escaped == []


def failing_tool(sync: bool, error: BaseException, effect: ToolEffect = ToolEffect.READ) -> FunctionTool:
    if sync:

        def fail_sync() -> str:
            raise error

        return FunctionTool(fail_sync, name="fail", effect=effect)

    async def fail_async() -> str:
        raise error

    return FunctionTool(fail_async, name="fail", effect=effect)


# --------------------------------------------------------------------------- ToolCallContext


async def test_context_parameter_is_injected_and_not_in_the_schema() -> None:
    """A parameter typed ToolCallContext gets the call's context and is invisible to the model."""
    seen: list[ToolCallContext] = []

    @function_tool(effect=ToolEffect.NON_IDEMPOTENT_WRITE)
    async def refund_order(order_id: str, call: ToolCallContext, amount_cents: int) -> str:
        seen.append(call)
        return f"{order_id}:{amount_cents}:{call.idempotency_key}"

    assert refund_order.parameters_schema == {
        "type": "object",
        "properties": {"order_id": {"type": "string"}, "amount_cents": {"type": "integer"}},
        "required": ["order_id", "amount_cents"],
        "additionalProperties": False,
    }
    context = make_context(ToolEffect.NON_IDEMPOTENT_WRITE)
    output = await refund_order.invoke('{"order_id": "o-1", "amount_cents": 5}', context)
    assert output == "o-1:5:flow-1/turn-1/call-1"
    assert seen == [context]
    assert seen[0] is context

    # The model cannot supply it: the name is not a parameter it knows.
    with pytest.raises(ToolExecutionError, match="unknown parameter 'call'"):
        await invoke(refund_order, {"order_id": "o", "amount_cents": 1, "call": {}})


def test_sync_tool_receives_context_in_its_thread() -> None:
    """Injection works for sync tools too."""

    @function_tool
    def whoami(context: ToolCallContext) -> str:
        return context.tool_call_id

    assert run(whoami, {}) == "call-1"


def test_two_context_parameters_are_refused() -> None:
    with pytest.raises(TypeError, match="only one parameter may be typed ToolCallContext"):

        @function_tool
        def tool(a: ToolCallContext, b: ToolCallContext) -> str:
            return ""


def test_context_defaults() -> None:
    """A hand-built context is unclassified, with no writer, heartbeat, answers or checkpoint."""
    context = ToolCallContext("k", 2, "f", "t", "c")
    assert context.effect is ToolEffect.UNCLASSIFIED
    assert (context.events, context.heartbeat, context.heartbeat_checkpoint, context.save_heartbeat_checkpoint) == (
        None, None, None, None)
    assert context.input_answers == ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        context.attempt = 3  # type: ignore[misc]


# --------------------------------------------------------------------------- definition-time checks


class Opaque:
    pass


@pytest.mark.parametrize(
    ("annotation", "type_text"),
    [
        (set[int], "set[int]"),
        (tuple[int, int], "tuple[int, int]"),
        (Opaque, "Opaque"),
        (Any, "Any"),
        (bytes, "bytes"),
        (dict[int, str], "dict[int, str]"),
        (list[set[str]], "list[set[str]]"),
        (int | Opaque, "Opaque"),
        (Literal[1.5], "Literal[1.5]"),
        (Node, "Node"),
    ],
)
def test_unsupported_annotations_are_refused_at_definition(annotation: Any, type_text: str) -> None:
    """TypeError names the parameter and the type, before any model sees the tool."""
    with pytest.raises(TypeError) as caught:
        capturing_tool(annotation)
    message = str(caught.value)
    assert "parameter 'value' of tool 'probe'" in message
    assert type_text in message


def test_unsupported_field_of_a_dataclass_names_the_field() -> None:
    @dataclass
    class Shipment:
        items: frozenset[str]

    with pytest.raises(TypeError, match=r"parameter 'value' of tool 'probe'.*field 'items' of .*Shipment"):
        capturing_tool(Shipment)


def test_recursive_dataclass_is_refused() -> None:
    with pytest.raises(TypeError, match="recursive"):
        capturing_tool(Node)


def test_enum_with_unsupported_values_is_refused() -> None:
    class Ratio(enum.Enum):
        HALF = 0.5

    with pytest.raises(TypeError, match=r"Ratio.HALF has value 0.5; Enum values must be str or int"):
        capturing_tool(Ratio)


def test_missing_annotation_is_refused() -> None:
    """The error says what to write: a newcomer's `context` parameter is not found by its name."""
    with pytest.raises(TypeError) as caught:

        @function_tool
        def lookup(order_id) -> str:  # type: ignore[no-untyped-def]
            return str(order_id)

    assert str(caught.value) == (
        "parameter 'order_id' of tool 'lookup' has no type annotation; annotate it with its type (str, int,"
        " float, bool, None, list[...], dict[str, ...], Literal[...], a union, an Enum, a dataclass or a"
        " TypedDict), or with ToolCallContext for the call's context"
    )


def test_unsupported_annotation_names_the_types_to_use() -> None:
    with pytest.raises(TypeError) as caught:
        capturing_tool(set[int])

    assert str(caught.value) == (
        "parameter 'value' of tool 'probe' has unsupported type set[int]: set[int] is not a supported argument"
        " type; use str, int, float, bool, None, list[...], dict[str, ...], Literal[...], a union, an Enum, a"
        " dataclass or a TypedDict"
    )


def test_variadic_parameters_are_refused() -> None:
    def many(*args: int) -> str:
        return ""

    def named(**kwargs: int) -> str:
        return ""

    for fn in (many, named):
        with pytest.raises(TypeError, match=r"\*args and \*\*kwargs are not supported"):
            function_tool(fn)


def test_positional_only_parameters_are_refused() -> None:
    with pytest.raises(TypeError, match="positional-only"):

        @function_tool
        def tool(a: int, /) -> str:
            return ""


def test_unresolvable_forward_reference_is_refused() -> None:
    with pytest.raises(TypeError) as caught:

        @function_tool
        def tool(a: "Missing") -> str:  # type: ignore[name-defined] # noqa: F821
            return ""

    assert str(caught.value) == (
        "cannot resolve the type hints of tool 'tool': name 'Missing' is not defined; an argument type must be"
        " importable at run time, not only under TYPE_CHECKING"
    )


def test_string_annotations_resolve_from_the_function_module() -> None:
    """Postponed annotations (as with `from __future__ import annotations`) are resolved."""

    @function_tool
    def tool(a: "Address", b: "int") -> str:
        return ""

    assert tool.parameters_schema["properties"] == {"a": ADDRESS_SCHEMA, "b": {"type": "integer"}}


def test_return_annotation_is_never_resolved() -> None:
    """Only parameter hints matter: a return type imported only under TYPE_CHECKING does not block the tool."""

    @function_tool
    def total(order_id: str) -> "Decimal":  # type: ignore[name-defined] # noqa: F821
        return order_id

    assert total.parameters_schema["properties"] == {"order_id": {"type": "string"}}
    assert run(total, {"order_id": "o-1"}) == "o-1"


def search_catalogue(catalogue: Opaque, query: str, limit: int = 10, exact: bool = False) -> str:
    """Search the catalogue."""
    return f"{type(catalogue).__name__} {query} {limit} {exact}"


def test_partial_is_a_tool_of_the_wrapped_function_without_its_bound_parameters() -> None:
    """Name, docstring and hints come from the wrapped function; what the partial binds is not offered."""
    tool = function_tool(functools.partial(search_catalogue, Opaque(), exact=True))
    assert (tool.name, tool.description) == ("search_catalogue", "Search the catalogue.")
    assert tool.parameters_schema == {
        "type": "object",
        "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
        "required": ["query"],
        "additionalProperties": False,
    }
    assert run(tool, {"query": "lamps"}) == "Opaque lamps 10 True"
    with pytest.raises(ToolExecutionError, match="unknown parameter 'exact'"):
        run(tool, {"query": "lamps", "exact": False})


@pytest.mark.parametrize(
    "name", ["", "has space", "x" * 65, "naïve", "dot.ted", "trailing\n", "<lambda>", "2fa_check", "-lookup"]
)
def test_bad_names_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match="invalid tool name"):
        function_tool(name=name)(lambda: "")


def test_name_must_start_with_a_letter_or_underscore() -> None:
    """Gemini refuses a function name that starts with a digit or '-'; the error says what is allowed."""
    with pytest.raises(ValueError) as caught:
        function_tool(name="3d-render")(lambda: "")
    assert str(caught.value) == (
        "invalid tool name '3d-render': a tool name is 1 to 64 characters of letters, digits, '_' and '-',"
        " starting with a letter or '_'"
    )


def test_lambda_without_explicit_name_is_refused() -> None:
    """`<lambda>` is no provider-valid name."""
    with pytest.raises(ValueError, match="invalid tool name '<lambda>'"):
        function_tool(lambda: "")


@pytest.mark.parametrize("name", ["a", "A-b_9", "x" * 64, "_private", "_9-"])
def test_good_names_are_kept(name: str) -> None:
    assert function_tool(name=name)(lambda: "").name == name


# --------------------------------------------------------------------------- decorator forms and metadata


def test_bare_decorator_defaults() -> None:
    """Bare `@function_tool`: function name, cleaned docstring, unclassified effect, approval by effect."""

    @function_tool
    def lookup_order(order_id: str) -> str:
        """
            Look up an order.

            Indented details stay relative.
        """
        return order_id

    assert isinstance(lookup_order, FunctionTool)
    assert lookup_order.name == "lookup_order"
    assert lookup_order.description == "Look up an order.\n\nIndented details stay relative."
    assert lookup_order.policy == ToolPolicy(ToolEffect.UNCLASSIFIED, None)


def test_function_without_docstring_gets_empty_description() -> None:
    """Our choice: no docstring is allowed and gives an empty description."""

    @function_tool(effect=ToolEffect.READ)
    def lookup(order_id: str) -> str:
        return order_id

    assert lookup.description == ""
    assert lookup.definition().description == ""


def test_options_override_name_description_and_policy() -> None:
    @function_tool(effect=ToolEffect.IDEMPOTENT_WRITE, requires_approval=True, name="set-status",
                   description="Set the status.")
    def set_status(status: Literal["open", "closed"]) -> str:
        """Ignored docstring."""
        return status

    definition = set_status.definition()
    assert (definition.name, definition.description) == ("set-status", "Set the status.")
    assert set_status.policy == ToolPolicy(ToolEffect.IDEMPOTENT_WRITE, True)
    assert run(set_status, {"status": "open"}) == "open"


@pytest.mark.parametrize(("options", "error", "message"), [
    ({"effect": "read"}, TypeError,
     "function tool 'tool': effect must be a ToolEffect, such as ToolEffect.READ, got 'read'"),
    ({"effect": None}, TypeError,
     "function tool 'tool': effect must be a ToolEffect, such as ToolEffect.READ, got None"),
    ({"requires_approval": 1}, TypeError,
     "function tool 'tool': requires_approval must be a bool or None (None: the effect decides), got 1"),
    ({"requires_approval": "no"}, TypeError, "function tool 'tool': requires_approval must be a bool or None"),
    ({"effect": "read", "requires_approval": "no"}, TypeError,
     "effect must be a ToolEffect, such as ToolEffect.READ, got 'read'; requires_approval must be a bool or None"),
    ({"name": ""}, ValueError, "invalid tool name '': a tool name is 1 to 64 characters"),
    ({"name": 3}, ValueError, "invalid tool name 3: a tool name is 1 to 64 characters"),
    ({"description": 3}, TypeError, "description of tool 'tool' must be text or None (None: the docstring), got 3"),
    ({"parameters_schema": {"type": "string"}}, ValueError,
     "parameters_schema of tool 'tool' must be a JSON object schema (type: object)"),
    ({"parameters_schema": {"type": "object", "minimum": float("nan")}}, ValueError,
     "parameters_schema of tool 'tool' is not JSON"),
    ({"prepare_arguments": "strip"}, TypeError,
     "prepare_arguments of tool 'tool' must be a function of the decoded arguments or None, got 'strip'"),
])
def test_function_tool_refuses_a_bad_option_naming_the_tool_and_the_option(
    options: dict[str, Any], error: type[Exception], message: str
) -> None:
    """Each bad option is refused where the tool is defined, naming the tool, the option and its
    value. Catches: a bad effect or requires_approval reported as "ToolPolicy.effect", an object
    the caller never wrote, with no word of which tool; a description or prepare_arguments error
    not naming the tool or the value."""
    def tool() -> str:
        return ""

    with pytest.raises(error, match=re.escape(message)) as refused:
        function_tool(**options)(tool)
    assert "ToolPolicy" not in str(refused.value)


def test_explicit_schema_is_offered_but_arguments_still_follow_the_type_hints() -> None:
    """parameters_schema replaces the definition's schema only; conversion stays with the hints."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1}}, "required": ["n"]}

    @function_tool(parameters_schema=schema)
    def count(n: int) -> str:
        return str(n * 2)

    assert count.definition().parameters_schema == schema
    assert run(count, {"n": 4}) == "8"
    with pytest.raises(ToolExecutionError, match="parameter 'n': expected integer, got string"):
        run(count, {"n": "4"})


@pytest.mark.parametrize("schema", [{"type": "array"}, {"properties": {}}, {"type": "object", "x": object()}])
def test_explicit_schema_must_be_a_json_object_schema(schema: dict[str, Any]) -> None:
    def count(n: int) -> str:
        return str(n)

    with pytest.raises(ValueError, match="parameters_schema of tool 'count'"):
        function_tool(parameters_schema=schema)(count)


def test_definition_schema_is_a_copy() -> None:
    """Mutating a handed-out schema cannot change what later model calls are offered."""

    @function_tool
    def tool(a: int) -> str:
        return ""

    tool.definition().parameters_schema["properties"]["a"]["type"] = "string"  # type: ignore[index]
    tool.parameters_schema["required"].append("b")
    assert tool.parameters_schema == {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False,
    }


def test_null_for_a_required_parameter_is_a_schema_violation_even_for_a_write() -> None:
    """`null` means absent only for a member with a default: for a required one it is a wrong value, refused
    before the call, so a write that may not repeat never runs and fails as bad arguments, not outcome_unknown."""
    calls: list[int] = []

    @function_tool(effect=ToolEffect.NON_IDEMPOTENT_WRITE)
    def refund(amount_cents: int) -> str:
        calls.append(amount_cents)
        return "ok"

    assert refusal(refund, {"amount_cents": None}, ToolEffect.NON_IDEMPOTENT_WRITE) == (
        "invalid arguments for refund: parameter 'amount_cents': expected integer, got null")
    assert calls == []


def test_null_for_a_described_optional_parameter_is_a_real_none() -> None:
    """`Annotated[int | None, "..."]` admits None like `int | None`: null is a value, not absence."""
    received: list[int | None] = []

    @function_tool
    def page(cursor: Annotated[int | None, "Where to start; null for the first page."] = 5) -> str:
        received.append(cursor)
        return "ok"

    run(page, {"cursor": None})
    run(page, {})
    assert received == [None, 5]


def test_null_for_a_literal_parameter_admitting_none_is_a_real_none() -> None:
    """A `Literal[..., None]` admits None: null is that value, not absence, even with another default."""
    received: list[str | None] = []

    @function_tool
    def sort(order: Literal["asc", "desc", None] = "asc") -> str:
        received.append(order)
        return "ok"

    run(sort, {"order": None})
    run(sort, {})
    assert received == [None, "asc"]


def test_enum_with_a_boolean_value_is_refused() -> None:
    """JSON Schema's booleans are no integers, so an Enum valued True is not offered as 1."""

    class Switch(enum.Enum):
        ON = True

    with pytest.raises(TypeError, match=r"Switch.ON has value True; Enum values must be str or int"):
        capturing_tool(Switch)


def test_prepare_arguments_tool_execution_error_keeps_its_own_message() -> None:
    """A ToolExecutionError from prepare_arguments is already written for the model: its message follows
    the prefix as it is, not wrapped as a failure of prepare_arguments."""

    def refuse(arguments: dict[str, Any]) -> dict[str, Any]:
        raise ToolExecutionError("cents must be digits; send amount_cents instead")

    @function_tool(prepare_arguments=refuse)
    def refund(amount_cents: int) -> str:
        return "ok"

    assert refusal(refund, {"cents": "lots"}) == (
        "invalid arguments for refund: cents must be digits; send amount_cents instead")


def test_callable_object_gets_no_description_from_its_class_docstring() -> None:
    """A callable object's docstring describes its class, not the tool: the description is empty."""

    class Lookup:
        """Holds a database connection."""

        def __call__(self, order_id: str) -> str:
            return order_id

    assert FunctionTool(Lookup(), name="lookup").description == ""


def test_a_long_refused_value_is_shortened_in_the_error() -> None:
    """The error quotes a refused value only in part, so a huge argument does not flood the model's context."""

    @function_tool
    def paint(color: Literal["red", "green"]) -> str:
        return color

    with pytest.raises(ToolExecutionError) as caught:
        run(paint, {"color": "x" * 10_000})
    shown = json.dumps("x" * 10_000)[: SHOWN_VALUE_CHARS - 3] + "..."
    assert caught.value.message == (
        f"invalid arguments for paint: parameter 'color': expected one of \"red\", \"green\", got {shown}"
    )


def test_a_non_object_for_a_dataclass_parameter_is_a_schema_violation() -> None:
    """A dataclass parameter given a scalar fails as bad arguments naming the class, never as a crash."""
    tool, received = capturing_tool(Address)
    for value, kind in ((7, "integer"), ("Main 1", "string"), ([], "array")):
        assert refusal(tool, {"value": value}, ToolEffect.NON_IDEMPOTENT_WRITE) == (
            f"invalid arguments for probe: parameter 'value': expected object (Address), got {kind}"
        )
    assert received == []


def test_literal_of_an_int_enum_member_is_refused() -> None:
    """An IntEnum member is an int, yet the Enum type is the way to offer it: the error says so."""
    with pytest.raises(TypeError, match=r"is an Enum member; use the Enum type"):
        capturing_tool(Literal[Priority.HIGH])


def test_enum_without_members_is_refused() -> None:
    """An empty Enum would offer `enum: []`, which no argument can satisfy: the tool is refused at definition."""

    class Nothing(enum.Enum):
        pass

    with pytest.raises(TypeError, match=r"Nothing has no members"):
        capturing_tool(Nothing)


def test_a_decorated_function_resolves_its_hints_in_the_module_that_defined_it() -> None:
    """A decorator's wrapper carries the function's postponed hints, but its globals are the decorator's module:
    the hints resolve where the function was written, so a type imported only there still works."""

    def logged(fn: Any) -> Any:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return fn(*args, **kwargs)

        return wrapper

    tool = FunctionTool(logged(future_count), effect=ToolEffect.READ)
    assert tool.parameters_schema["properties"]["window"]["required"] == ["start", "end"]
    assert run(tool, {"window": {"start": 2, "end": 7}}, ToolEffect.READ) == "5"


def test_a_partial_over_a_partial_it_cannot_flatten_is_a_tool_of_the_innermost_function() -> None:
    """A partial with attributes of its own is kept whole by the partial around it: every layer's
    keywords stay unoffered, and name, docstring and hints come from the innermost function."""
    inner = functools.partial(search_catalogue, Opaque(), exact=True)
    inner.source = "catalogue v2"  # type: ignore[attr-defined]  # a __dict__ stops partial() flattening it
    outer = functools.partial(inner, limit=3)
    assert outer.func is inner
    tool = function_tool(outer)
    assert (tool.name, tool.description) == ("search_catalogue", "Search the catalogue.")
    assert set(tool.parameters_schema["properties"]) == {"query"}
    assert run(tool, {"query": "lamps"}) == "Opaque lamps 3 True"


def test_a_value_no_alternative_of_its_json_type_accepts_names_each_reason() -> None:
    """When several alternatives of a union take the value's JSON type and all refuse it, the error gives
    each one's reason, so the model sees what every alternative expected."""
    tool, received = capturing_tool(Priority | Literal[10])
    assert refusal(tool, {"value": 7}) == (
        "invalid arguments for probe: parameter 'value': matches none of one of 1, 2 or one of 10"
        " (value: expected one of 1, 2, got 7; value: expected one of 10, got 7)"
    )
    assert received == []


def test_an_empty_description_is_kept_over_the_docstring() -> None:
    """`description=""` is a choice (the docstring is for developers), not a request for the default."""

    @function_tool(description="")
    def lookup(order_id: str) -> str:
        """Internal: hits the replica, see RUNBOOK.md."""
        return order_id

    assert lookup.description == ""


def test_an_explicit_parameters_schema_is_copied_at_definition() -> None:
    """Changing the caller's schema afterwards, nested parts included, leaves the tool's definition as defined."""
    schema: dict[str, Any] = {"type": "object", "properties": {"order_id": {"type": "string"}}}

    @function_tool(parameters_schema=schema)
    def lookup(order_id: str) -> str:
        return order_id

    schema["properties"]["order_id"]["type"] = "integer"
    schema["properties"]["extra"] = {"type": "string"}
    assert lookup.definition().parameters_schema == {"type": "object", "properties": {"order_id": {"type": "string"}}}
