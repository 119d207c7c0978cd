"""Function tools: plain sync or async Python functions offered to the model as tools.

`@function_tool` derives a tool's name, description and JSON Schema from the function, and
`FunctionTool.invoke` decodes, checks and converts the model's argument text before calling it.

Decisions this module makes (seed 003, "Built-in agent loop"):

- The description defaults to the function's docstring cleaned with `inspect.cleandoc`; a function
  without one gets an empty description (providers accept it, and the name often says enough).
- Supported annotations: `str`, `int`, `float`, `bool`, `None`, `list` / `list[T]`, `dict` /
  `dict[str, T]`, `Literal[...]` of str/int/bool/None values, `Enum` subclasses with str or int
  values (offered by value), unions including `Optional` (`anyOf`), dataclasses and `TypedDict`
  (nested object schemas with `additionalProperties: false`; a dataclass's `InitVar` fields are
  members, since `__init__` takes them), and `Annotated[T, "description"]` (the first string extra
  becomes `description`; other extras are ignored). Anything else (no annotation, `Any`, `tuple`,
  `set`, arbitrary classes, recursive types, `*args`, `**kwargs`, positional-only parameters)
  raises `TypeError` when the tool is defined. Only parameter hints are resolved: the return
  annotation may name a type imported only under `TYPE_CHECKING`.
- A `TypedDict` key's `Required[...]` / `NotRequired[...]` is read from its resolved hint, also inside
  `Annotated` (either order); only a key without one takes `__required_keys__`, which misreads the
  qualifiers of postponed (`from __future__ import annotations`) hints.
- A `functools.partial` is a tool of the function it wraps (name, docstring, hints); the parameters
  it binds are not offered to the model.
- Checking mirrors the JSON Schema offered: `bool` is never an `int` or a `float`; an `int` is a
  fine `float` (converted); an integral float such as `3.0` is a fine `int` (JSON Schema's
  `integer` accepts it), for an integer `Literal` or `Enum` value too; non-finite numbers are
  refused. Unknown names are violations at every level.
- `null` for a member that has a default (a parameter with a default, a dataclass field with a
  default, a `TypedDict` key that is not required) whose type does not admit `None` means the
  member is absent, as for built-in tools: providers in strict-schema mode send it.
- An explicit `parameters_schema` replaces the derived schema in the definition only; arguments are
  still checked and converted against the function's type hints, which stay the contract.
- A result that cannot be encoded as JSON is an error of the call and follows the effect rule.
- `ToolOutcomeUnknownError` raised by the function passes through for every effect: the tool itself
  says a write may have happened.
- An exception with a `retry_after_seconds` attribute (`dex_engine.RetryAfterError`, a rate-limited
  API client's error) passes through for every effect instead of becoming `ToolExecutionError`: it
  asks for a retry after that delay, which CallTool's retry policy makes (docs/deviations.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import copy
import dataclasses
import enum
import functools
import inspect
import json
import math
import threading
import types
import typing
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, overload

import msgspec

from .._constants import ARGUMENTS_TOO_DEEP, SHOWN_VALUE_CHARS
from .._events import AgentEventWriter
from .._policy import ToolPolicy, raised_text, requires_approval_problem, shown, tool_effect_problem
from .._runner import ToolExecutionError, ToolInputRequested, ToolOutcomeUnknownError, ToolTaskStarted
from .._wire import QuestionAnswer, ToolEffect
from ._model import PROVIDER_TOOL_NAME_RULE, ModelToolDefinition, is_provider_tool_name

__all__ = ["FunctionTool", "ToolCallContext", "function_tool"]

# Effects whose calls may run again: an error there is shown to the model instead of failing the Step.
_MODEL_VISIBLE_ERROR_EFFECTS = frozenset({ToolEffect.READ, ToolEffect.IDEMPOTENT_WRITE})


@dataclass(frozen=True)
class ToolCallContext:
    """What a function tool learns about its call; a parameter typed `ToolCallContext` receives it."""

    idempotency_key: str
    attempt: int
    flow_id: str
    turn_id: str
    tool_call_id: str
    events: AgentEventWriter | None = None
    heartbeat: Callable[[], Awaitable[None]] | None = None
    input_answers: Sequence[QuestionAnswer] = ()
    # What the function returned in ToolInputRequested.continuation when it asked its last question.
    input_continuation: str | None = None
    # The call's effect after the tool policies (it chose the tool Step); decides error wrapping.
    effect: ToolEffect = ToolEffect.UNCLASSIFIED
    heartbeat_checkpoint: str | None = None
    save_heartbeat_checkpoint: Callable[[str], Awaitable[None]] | None = None


# --------------------------------------------------------------------------- argument shapes


class _ArgumentError(Exception):
    """A schema violation at `path` (a parameter name, maybe with a nested suffix)."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _show(value: object) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    if len(text) > SHOWN_VALUE_CHARS:
        text = text[: SHOWN_VALUE_CHARS - 3] + "..."
    return text


class _Shape:
    """One supported annotation: its JSON Schema and its checked conversion from decoded JSON."""

    # JSON types (as _json_type names them) a value may have for this shape to consider it.
    json_types: frozenset[str] = frozenset()
    accepts_none = False

    def schema(self) -> dict[str, Any]:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    def convert(self, value: object, path: str) -> object:
        raise NotImplementedError

    def mismatch(self, value: object, path: str) -> _ArgumentError:
        return _ArgumentError(path, f"expected {self.describe()}, got {_json_type(value)}")


class _String(_Shape):
    json_types = frozenset({"string"})

    def schema(self) -> dict[str, Any]:
        return {"type": "string"}

    def describe(self) -> str:
        return "string"

    def convert(self, value: object, path: str) -> object:
        if isinstance(value, str):
            return value
        raise self.mismatch(value, path)


class _Integer(_Shape):
    json_types = frozenset({"integer", "number"})

    def schema(self) -> dict[str, Any]:
        return {"type": "integer"}

    def describe(self) -> str:
        return "integer"

    def convert(self, value: object, path: str) -> object:
        if isinstance(value, bool):
            raise self.mismatch(value, path)
        if isinstance(value, int):
            return value
        # JSON Schema's "integer" is any number with a zero fractional part, 3.0 included.
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise self.mismatch(value, path)


class _Number(_Shape):
    json_types = frozenset({"integer", "number"})

    def schema(self) -> dict[str, Any]:
        return {"type": "number"}

    def describe(self) -> str:
        return "number"

    def convert(self, value: object, path: str) -> object:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.mismatch(value, path)
        try:
            number = float(value)
        except OverflowError:
            raise _ArgumentError(path, "number out of range") from None
        if not math.isfinite(number):
            raise _ArgumentError(path, "number out of range")
        return number


class _Boolean(_Shape):
    json_types = frozenset({"boolean"})

    def schema(self) -> dict[str, Any]:
        return {"type": "boolean"}

    def describe(self) -> str:
        return "boolean"

    def convert(self, value: object, path: str) -> object:
        if isinstance(value, bool):
            return value
        raise self.mismatch(value, path)


class _Null(_Shape):
    json_types = frozenset({"null"})
    accepts_none = True

    def schema(self) -> dict[str, Any]:
        return {"type": "null"}

    def describe(self) -> str:
        return "null"

    def convert(self, value: object, path: str) -> object:
        if value is None:
            return None
        raise self.mismatch(value, path)


class _Array(_Shape):
    json_types = frozenset({"array"})

    def __init__(self, items: _Shape | None) -> None:
        self.items = items

    def schema(self) -> dict[str, Any]:
        if self.items is None:
            return {"type": "array"}
        return {"type": "array", "items": self.items.schema()}

    def describe(self) -> str:
        return "array"

    def convert(self, value: object, path: str) -> object:
        if not isinstance(value, list):
            raise self.mismatch(value, path)
        if self.items is None:
            return value
        items = self.items
        return [items.convert(item, f"{path}[{index}]") for index, item in enumerate(value)]


class _Map(_Shape):
    json_types = frozenset({"object"})

    def __init__(self, values: _Shape | None) -> None:
        self.values = values

    def schema(self) -> dict[str, Any]:
        if self.values is None:
            return {"type": "object"}
        return {"type": "object", "additionalProperties": self.values.schema()}

    def describe(self) -> str:
        return "object"

    def convert(self, value: object, path: str) -> object:
        if not isinstance(value, dict):
            raise self.mismatch(value, path)
        if self.values is None:
            return value
        values = self.values
        return {
            key: values.convert(item, f"{path}[{json.dumps(key, ensure_ascii=False)}]") for key, item in value.items()
        }


class _Choice(_Shape):
    """A `Literal` or an `Enum`: one of fixed JSON values, matched by JSON type and value."""

    def __init__(self, options: Sequence[tuple[object, object]]) -> None:
        # (JSON value, Python value) pairs, in declaration order.
        self.options = tuple(options)
        self._lookup = {(_json_type(raw), raw): result for raw, result in self.options}
        kinds = frozenset(_json_type(raw) for raw, _ in self.options)
        # An integral float such as 2.0 may be an integer option, as it is a fine `int` (see convert).
        self.json_types = kinds | {"number"} if "integer" in kinds else kinds
        self.accepts_none = "null" in self.json_types

    def schema(self) -> dict[str, Any]:
        values = [raw for raw, _ in self.options]
        kinds = {_json_type(raw) for raw in values}
        if len(kinds) == 1:
            return {"type": kinds.pop(), "enum": values}
        return {"enum": values}

    def describe(self) -> str:
        return "one of " + ", ".join(_show(raw) for raw, _ in self.options)

    def convert(self, value: object, path: str) -> object:
        # JSON Schema's enum compares numbers by value, so 2.0 is the integer option 2 (as for `int`).
        if isinstance(value, float) and value.is_integer() and ("integer", int(value)) in self._lookup:
            return self._lookup[("integer", int(value))]
        try:
            key = (_json_type(value), value)
            if key in self._lookup:
                return self._lookup[key]
        except TypeError:  # unhashable (array or object): never a choice
            pass
        raise _ArgumentError(path, f"expected {self.describe()}, got {_show(value)}")


class _Union(_Shape):
    def __init__(self, options: Sequence[_Shape]) -> None:
        self.options = tuple(options)
        self.json_types = frozenset().union(*(option.json_types for option in self.options))
        self.accepts_none = any(option.accepts_none for option in self.options)

    def schema(self) -> dict[str, Any]:
        return {"anyOf": [option.schema() for option in self.options]}

    def describe(self) -> str:
        return " or ".join(option.describe() for option in self.options)

    def convert(self, value: object, path: str) -> object:
        kind = _json_type(value)
        candidates = [option for option in self.options if kind in option.json_types]
        if not candidates:
            raise self.mismatch(value, path)
        if len(candidates) == 1:
            # The only alternative of this JSON type: its own error names the exact problem.
            return candidates[0].convert(value, path)
        errors: list[_ArgumentError] = []
        for option in candidates:  # declaration order decides, e.g. `int | float` keeps 3 an int
            try:
                return option.convert(value, path)
            except _ArgumentError as exc:
                errors.append(exc)
        reasons = "; ".join(f"{error.path}: {error.problem}" for error in errors)
        raise _ArgumentError(path, f"matches none of {self.describe()} ({reasons})")


class _Described(_Shape):
    """`Annotated[T, "description"]`: T's schema with a description."""

    def __init__(self, inner: _Shape, description: str) -> None:
        self.inner = inner
        self.description = description
        self.json_types = inner.json_types
        self.accepts_none = inner.accepts_none

    def schema(self) -> dict[str, Any]:
        return {**self.inner.schema(), "description": self.description}

    def describe(self) -> str:
        return self.inner.describe()

    def convert(self, value: object, path: str) -> object:
        return self.inner.convert(value, path)


@dataclass(frozen=True)
class _Member:
    """A parameter, dataclass field or TypedDict key."""

    name: str
    shape: _Shape
    required: bool


def _members_schema(members: Sequence[_Member]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {member.name: member.shape.schema() for member in members},
        "required": [member.name for member in members if member.required],
        "additionalProperties": False,
    }


def _convert_members(
    members: Sequence[_Member], value: Mapping[str, object], path: str | None, noun: str
) -> dict[str, object]:
    """Checks an object against its members; `path` None means the top level (the parameters)."""

    def where(name: str) -> str:
        return name if path is None else f"{path}.{name}"

    known = {member.name: member for member in members}
    unknown = [key for key in value if key not in known]
    if unknown:
        names = ", ".join(repr(key) for key in unknown)
        problem = f"unknown {noun}{'s' if len(unknown) > 1 else ''} {names}"
        if path is None:
            raise _ArgumentError("", problem)
        raise _ArgumentError(path, problem)
    converted: dict[str, object] = {}
    for member in members:
        if member.name not in value:
            if member.required:
                problem = f"missing required {noun} {member.name!r}"
                if path is None:
                    raise _ArgumentError("", problem)
                raise _ArgumentError(path, problem)
            continue
        item = value[member.name]
        if item is None and not member.required and not member.shape.accepts_none:
            continue  # null for an optional member means absent (strict-schema providers send it)
        converted[member.name] = member.shape.convert(item, where(member.name))
    return converted


class _Object(_Shape):
    """A dataclass (built from its converted fields) or a TypedDict (a plain dict)."""

    json_types = frozenset({"object"})

    def __init__(self, cls: type, members: Sequence[_Member], is_dataclass: bool) -> None:
        self.cls = cls
        self.members = tuple(members)
        self.is_dataclass = is_dataclass

    def schema(self) -> dict[str, Any]:
        return _members_schema(self.members)

    def describe(self) -> str:
        return f"object ({self.cls.__name__})"

    def convert(self, value: object, path: str) -> object:
        if not isinstance(value, dict):
            raise self.mismatch(value, path)
        converted = _convert_members(self.members, value, path, "field")
        if not self.is_dataclass:
            return converted
        try:
            return self.cls(**converted)
        except Exception as exc:  # __post_init__ validation rejects the value like a schema would
            raise _ArgumentError(path, raised_text(exc)) from None


class _UnsupportedType(TypeError):
    pass


# Named in the errors for a parameter without a usable type, so the author knows what to write instead.
_SUPPORTED_ARGUMENT_TYPES = (
    "str, int, float, bool, None, list[...], dict[str, ...], Literal[...], a union, an Enum,"
    " a dataclass or a TypedDict"
)


def _type_name(annotation: object) -> str:
    if isinstance(annotation, type) and not typing.get_args(annotation):
        return annotation.__qualname__
    return shown(annotation, None).replace("typing.", "")  # an annotation may hold a value with no repr


def _resolved_hints(owner: object, label: str, module_namespace: dict[str, Any] | None = None) -> dict[str, Any]:
    try:
        return typing.get_type_hints(owner, globalns=module_namespace, include_extras=True)
    except Exception as exc:  # NameError for an unresolvable forward reference, among others
        advice = "; an argument type must be importable at run time, not only under TYPE_CHECKING"
        raise TypeError(
            f"cannot resolve the type hints of {label}: {exc}{advice if isinstance(exc, NameError) else ''}"
        ) from exc


def _parameter_hints(owner: Callable[..., Any], label: str) -> dict[str, Any]:
    """The resolved hints of `owner`'s parameters. Its return annotation stays unresolved: the schema
    never uses it, and a return type imported only under TYPE_CHECKING must not block the tool."""
    annotations: dict[str, Any] = getattr(owner, "__annotations__", None) or {}
    parameters_only = types.SimpleNamespace(
        __annotations__={name: hint for name, hint in annotations.items() if name != "return"}
    )
    # The namespace get_type_hints(owner) would use: the module of the function behind any decorators.
    module_namespace: dict[str, Any] = getattr(inspect.unwrap(owner), "__globals__", {})
    return _resolved_hints(parameters_only, label, module_namespace)


# Typed Any: rebuilding Annotated from a runtime tuple of arguments is no type expression for mypy.
_ANNOTATED: Any = typing.Annotated


def _split_qualifier(hint: object) -> tuple[object, object | None]:
    """A TypedDict key's resolved hint without its Required[...] / NotRequired[...], wherever it sits among
    Annotated layers (PEP 655 allows either order), and that qualifier, or None when there is none."""
    origin = typing.get_origin(hint)
    if origin is typing.Required or origin is typing.NotRequired:
        inner, nested = _split_qualifier(typing.get_args(hint)[0])
        if nested is not None and nested is not origin:
            raise _UnsupportedType(f"{_type_name(hint)} is both Required and NotRequired")
        return inner, origin
    if origin is typing.Annotated:
        inner, qualifier = _split_qualifier(typing.get_args(hint)[0])
        if qualifier is None:
            return hint, None
        # Rebuilt with every extra, so the description is kept as for any Annotated type.
        return _ANNOTATED[(inner, *hint.__metadata__)], qualifier  # type: ignore[attr-defined]
    return hint, None


class _ShapeBuilder:
    def __init__(self) -> None:
        self._building: list[type] = []  # classes being built, to refuse recursive types

    def build(self, annotation: object) -> _Shape:
        origin = typing.get_origin(annotation)
        args = typing.get_args(annotation)
        if annotation is str:
            return _String()
        if annotation is bool:
            return _Boolean()
        if annotation is int:
            return _Integer()
        if annotation is float:
            return _Number()
        if annotation is None or annotation is types.NoneType:
            return _Null()
        if origin is typing.Annotated:
            inner = self.build(args[0])
            description = next((extra for extra in annotation.__metadata__ if isinstance(extra, str)), None)  # type: ignore[attr-defined]
            return inner if description is None else _Described(inner, description)
        if annotation is list or origin is list:
            return _Array(self.build(args[0]) if args else None)
        if annotation is dict or origin is dict:
            if not args:
                return _Map(None)
            if args[0] is not str:
                raise _UnsupportedType(f"dict keys must be str, not {_type_name(args[0])}")
            return _Map(self.build(args[1]))
        if origin is typing.Literal:
            return self._literal(args)
        if origin is typing.Union or origin is types.UnionType:
            return _Union([self.build(arg) for arg in args])
        if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
            return self._enum(annotation)
        if isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
            return self._guarded(annotation, self._dataclass)
        if typing.is_typeddict(annotation):
            assert isinstance(annotation, type)
            return self._guarded(annotation, self._typed_dict)
        raise _UnsupportedType(
            f"{_type_name(annotation)} is not a supported argument type; use {_SUPPORTED_ARGUMENT_TYPES}"
        )

    def _literal(self, values: tuple[object, ...]) -> _Shape:
        for value in values:
            if value is not None and not isinstance(value, str | int | bool):
                raise _UnsupportedType(f"Literal value {shown(value, None)} is not a str, int, bool or None")
            if isinstance(value, enum.Enum):
                raise _UnsupportedType(f"Literal value {shown(value, None)} is an Enum member; use the Enum type")
        return _Choice([(value, value) for value in values])

    def _enum(self, cls: type[enum.Enum]) -> _Shape:
        options: list[tuple[object, object]] = []
        for member in cls:
            value = member.value
            if isinstance(value, bool) or not isinstance(value, str | int):
                raise _UnsupportedType(
                    f"{cls.__qualname__}.{member.name} has value {shown(value, None)}; Enum values must be str or int"
                )
            # The JSON value is the plain str/int, not the member (a StrEnum member is also a str).
            options.append((str(value) if isinstance(value, str) else int(value), member))
        if not options:
            raise _UnsupportedType(f"{cls.__qualname__} has no members")
        return _Choice(options)

    def _guarded(self, cls: type, build: Callable[[type], _Shape]) -> _Shape:
        if cls in self._building:
            raise _UnsupportedType(f"{cls.__qualname__} is recursive; recursive types are not supported")
        self._building.append(cls)
        try:
            return build(cls)
        finally:
            self._building.pop()

    def _dataclass(self, cls: type) -> _Shape:
        assert dataclasses.is_dataclass(cls), f"build() routes only dataclasses here, got {cls!r}"
        hints = _resolved_hints(cls, cls.__qualname__)
        regular = {field.name for field in dataclasses.fields(cls)}
        members = []
        # __dataclass_fields__ also holds the pseudo-fields dataclasses.fields() leaves out, in
        # declaration order: an InitVar is an argument of __init__, so the caller must be able to pass it.
        for field in cls.__dataclass_fields__.values():
            hint = hints[field.name]
            if field.name in regular:
                if not field.init:
                    continue  # set by the class itself, never by the caller
            elif hint is typing.ClassVar or typing.get_origin(hint) is typing.ClassVar:
                continue  # belongs to the class, never an argument
            elif isinstance(hint, dataclasses.InitVar):
                hint = hint.type
            required = field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
            members.append(_Member(field.name, self._member(cls, field.name, hint), required))
        return _Object(cls, members, is_dataclass=True)

    def _typed_dict(self, cls: type) -> _Shape:
        hints = _resolved_hints(cls, cls.__qualname__)
        # Right only for keys without a qualifier: under `from __future__ import annotations` the class
        # sees Required[...] / NotRequired[...] as strings and applies the declaring class's totality.
        required_keys: frozenset[str] = getattr(cls, "__required_keys__", frozenset())
        members = []
        for key, declared in hints.items():
            try:
                hint, qualifier = _split_qualifier(declared)
            except _UnsupportedType as exc:
                raise _UnsupportedType(f"field {key!r} of {cls.__qualname__}: {exc}") from None
            required = key in required_keys if qualifier is None else qualifier is typing.Required
            members.append(_Member(key, self._member(cls, key, hint), required))
        return _Object(cls, members, is_dataclass=False)

    def _member(self, owner: type, name: str, hint: object) -> _Shape:
        try:
            return self.build(hint)
        except _UnsupportedType as exc:
            raise _UnsupportedType(f"field {name!r} of {owner.__qualname__}: {exc}") from None


# --------------------------------------------------------------------------- the tool


def _decode_arguments(tool_name: str, arguments: str) -> dict[str, Any]:
    def refuse_constant(constant: str) -> object:
        raise ValueError(f"{constant} is not JSON")

    try:
        decoded = json.loads(arguments, parse_constant=refuse_constant)
    except (ValueError, TypeError):
        raise ToolExecutionError(f"invalid arguments for {tool_name}: arguments are not valid JSON") from None
    except RecursionError:
        # RunModel's own check decodes on a shallower stack, so text it accepted may still overflow here.
        raise ToolExecutionError(f"invalid arguments for {tool_name}: {ARGUMENTS_TOO_DEEP}") from None
    if not isinstance(decoded, dict):
        raise ToolExecutionError(f"invalid arguments for {tool_name}: arguments must be a JSON object")
    return decoded


def _encode_result(result: object) -> str:
    if isinstance(result, str):
        return result
    # msgspec encodes dataclasses, Enums (by value), TypedDicts, datetimes and UUIDs as well.
    data = msgspec.json.encode(result)
    if b"null" in data:  # msgspec writes NaN and infinities as null: the model would see a wrong value
        bad = _non_finite(msgspec.to_builtins(result))
        if bad is not None:
            raise ValueError(f"the result holds the number {bad!r}, which JSON cannot hold")
    return data.decode()


def _non_finite(value: object) -> float | None:
    """The first NaN or infinity in `value` (builtins: dicts, lists, scalars), or None."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, float) and not math.isfinite(item):
            return item
        if isinstance(item, dict):
            pending.extend(item.values())
        elif isinstance(item, list | tuple):
            pending.extend(item)
    return None


class FunctionTool:
    """A function offered to the model: its definition, policy and checked invocation."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        effect: ToolEffect = ToolEffect.UNCLASSIFIED,
        requires_approval: bool | None = None,
        name: str | None = None,
        description: str | None = None,
        parameters_schema: Mapping[str, Any] | None = None,
        prepare_arguments: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    ) -> None:
        if not callable(fn):
            raise TypeError(f"a function tool needs a callable, got {shown(fn, None)}")
        self.fn = fn
        self.name = _tool_name(fn, name)
        # Checked here, not by ToolPolicy, so that the error names this tool and the option written.
        problems = [p for p in (tool_effect_problem(effect, "effect"),
                                requires_approval_problem(requires_approval, "requires_approval")) if p is not None]
        if problems:
            raise TypeError(f"function tool {self.name!r}: " + "; ".join(problems))
        self.policy = ToolPolicy(effect, requires_approval)
        self.description = _tool_description(fn, self.name, description)
        if prepare_arguments is not None:
            if not callable(prepare_arguments):
                raise TypeError(f"prepare_arguments of tool {self.name!r} must be a function of the decoded "
                                f"arguments or None, got {shown(prepare_arguments, None)}")
            if inspect.iscoroutinefunction(prepare_arguments):
                raise TypeError(f"prepare_arguments of tool {self.name!r} must be synchronous, not async")
        self._prepare_arguments = prepare_arguments
        self._members, self._context_parameter = _parameters(fn, self.name)
        self._schema = _members_schema(self._members)
        if parameters_schema is not None:
            self._schema = _explicit_schema(self.name, parameters_schema)
        self._is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
            getattr(fn, "__call__", None)  # noqa: B004 - an object whose __call__ is async
        )

    @property
    def parameters_schema(self) -> dict[str, Any]:
        """The JSON Schema of the arguments object (a copy)."""
        return copy.deepcopy(self._schema)

    def definition(self) -> ModelToolDefinition:
        return ModelToolDefinition(self.name, self.description, copy.deepcopy(self._schema))

    def __repr__(self) -> str:
        return f"FunctionTool(name={self.name!r}, effect={self.policy.effect.value!r})"

    async def invoke(self, arguments: str, context: ToolCallContext) -> str | ToolInputRequested | ToolTaskStarted:
        """Checks the argument text, calls the function once and returns its model-visible output,
        the question it asks the user (the session asks, then calls it again with the answer), or
        the task it started (the runner's poll_tool_task polls it)."""
        kwargs = self._convert_arguments(_decode_arguments(self.name, arguments))
        if self._context_parameter is not None:
            kwargs[self._context_parameter] = context
        try:
            if self._is_async:
                result = await self.fn(**kwargs)
            else:
                result = await _in_daemon_thread(self.name, functools.partial(self.fn, **kwargs))
                if inspect.isawaitable(result):  # a sync callable that hands back an awaitable
                    result = await result
            # Not outputs: as JSON the model would read a started task's handle as the result, a
            # write that started would be recorded succeeded, and nothing would poll the task.
            if isinstance(result, ToolInputRequested | ToolTaskStarted):
                return result
            return _encode_result(result)
        except (ToolExecutionError, ToolOutcomeUnknownError):
            raise
        except Exception as exc:
            # A repeatable call's error is shown to the model; a write that may not repeat might
            # have taken effect, so its error propagates and the session records outcome_unknown.
            # An error that asks for its retry after a delay (a rate limit's Retry-After) propagates
            # too, so CallTool's retry policy retries it after that delay (dex_engine.RetryAfterError).
            if context.effect in _MODEL_VISIBLE_ERROR_EFFECTS and not _asks_retry_after(exc):
                raise ToolExecutionError(raised_text(exc)) from exc
            raise

    def _convert_arguments(self, decoded: dict[str, Any]) -> dict[str, Any]:
        prefix = f"invalid arguments for {self.name}"
        if self._prepare_arguments is not None:
            decoded = self._prepare(decoded)
        try:
            return dict(_convert_members(self._members, decoded, None, "parameter"))
        except _ArgumentError as exc:
            if not exc.path:
                raise ToolExecutionError(f"{prefix}: {exc.problem}") from None
            raise ToolExecutionError(f"{prefix}: parameter {exc.path!r}: {exc.problem}") from None
        except RecursionError:
            # Showing a refused value (json.dumps) walks all of it: a deep one overflows before the error.
            raise ToolExecutionError(f"{prefix}: {ARGUMENTS_TOO_DEEP}") from None

    def _prepare(self, decoded: dict[str, Any]) -> dict[str, Any]:
        prefix = f"invalid arguments for {self.name}"
        assert self._prepare_arguments is not None
        try:
            prepared: object = self._prepare_arguments(decoded)
        except ToolExecutionError as exc:
            raise ToolExecutionError(f"{prefix}: {exc.message}") from exc
        except Exception as exc:  # CancelledError is a BaseException and passes through
            raise ToolExecutionError(f"{prefix}: prepare_arguments failed: {raised_text(exc)}") from exc
        if inspect.isawaitable(prepared):
            if inspect.iscoroutine(prepared):
                prepared.close()  # never awaited on purpose; closing avoids a "never awaited" warning
            raise ToolExecutionError(
                f"{prefix}: prepare_arguments returned an awaitable; it must be synchronous"
            )
        if not isinstance(prepared, Mapping):
            raise ToolExecutionError(
                f"{prefix}: prepare_arguments returned {type(prepared).__name__}, not a JSON object"
            )
        return dict(prepared)


def _asks_retry_after(exc: BaseException) -> bool:
    """Whether `exc` asks for its retry after a delay: it has a `retry_after_seconds` other than None,
    as dex_engine reads it (an unusable value is the engine's to report, in the attempt's history)."""
    try:
        return getattr(exc, "retry_after_seconds", None) is not None
    except Exception:  # a property that raises: the engine notes it, and the policy's interval applies
        return True


def _partial_target(fn: Callable[..., Any]) -> tuple[Callable[..., Any], frozenset[str]]:
    """The callable behind a `functools.partial` (else `fn`), and the parameters it binds by keyword."""
    target = fn
    bound: set[str] = set()
    while isinstance(target, functools.partial):  # a partial subclass does not flatten nested partials
        bound.update(target.keywords)
        target = target.func
    return target, frozenset(bound)


def _tool_name(fn: Callable[..., Any], name: str | None) -> str:
    if name is None:
        name = getattr(_partial_target(fn)[0], "__name__", None)
        if not isinstance(name, str):
            raise ValueError(f"{shown(fn, None)} has no __name__; pass name= to function_tool")
    if not is_provider_tool_name(name):
        raise ValueError(f"invalid tool name {shown(name, None)}: {PROVIDER_TOOL_NAME_RULE}")
    return name


def _tool_description(fn: Callable[..., Any], tool_name: str, description: str | None) -> str:
    if description is not None:
        if not isinstance(description, str):
            raise TypeError(f"description of tool {tool_name!r} must be text or None (None: the docstring), "
                            f"got {shown(description, None)}")
        return description
    # Only a function's own docstring (behind a functools.partial, whose own describes partial
    # itself): a callable object's would describe its class.
    target = _partial_target(fn)[0]
    if inspect.isfunction(target) or inspect.ismethod(target) or inspect.isbuiltin(target):
        return inspect.cleandoc(target.__doc__) if target.__doc__ else ""
    return ""


def _parameters(fn: Callable[..., Any], tool_name: str) -> tuple[list[_Member], str | None]:
    """The model-visible parameters, and the name of the one typed ToolCallContext, if any."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"cannot read the signature of tool {tool_name!r}: {exc}") from exc
    # A partial's signature already leaves out what it binds positionally; its own __call__ has no
    # hints, so they come from the function it wraps.
    target, bound_by_keyword = _partial_target(fn)
    is_function = inspect.isfunction(target) or inspect.ismethod(target)
    hint_owner = target if is_function else getattr(target, "__call__", target)  # noqa: B004
    hints = _parameter_hints(hint_owner, f"tool {tool_name!r}")
    members: list[_Member] = []
    context_parameter: str | None = None
    builder = _ShapeBuilder()
    for parameter in signature.parameters.values():
        if parameter.name in bound_by_keyword:
            continue  # the partial supplies it (a dependency, say), so the model neither sees nor sets it
        where = f"parameter {parameter.name!r} of tool {tool_name!r}"
        if parameter.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            raise TypeError(f"{where}: *args and **kwargs are not supported")
        if parameter.kind is inspect.Parameter.POSITIONAL_ONLY:
            raise TypeError(f"{where}: positional-only parameters are not supported")
        if parameter.name not in hints:
            raise TypeError(
                f"{where} has no type annotation; annotate it with its type ({_SUPPORTED_ARGUMENT_TYPES}),"
                " or with ToolCallContext for the call's context"
            )
        hint = hints[parameter.name]
        if hint is ToolCallContext:
            if context_parameter is not None:
                raise TypeError(f"{where}: only one parameter may be typed ToolCallContext")
            context_parameter = parameter.name
            continue
        try:
            shape = builder.build(hint)
        except _UnsupportedType as exc:
            raise TypeError(f"{where} has unsupported type {_type_name(hint)}: {exc}") from None
        members.append(_Member(parameter.name, shape, parameter.default is inspect.Parameter.empty))
    return members, context_parameter


def _explicit_schema(tool_name: str, schema: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(schema, Mapping) or schema.get("type") != "object":
        raise ValueError(f"parameters_schema of tool {tool_name!r} must be a JSON object schema (type: object)")
    try:
        # A round trip through JSON proves it is JSON and leaves no shared mutable state.
        copied: dict[str, Any] = json.loads(json.dumps(dict(schema), allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"parameters_schema of tool {tool_name!r} is not JSON: {exc}") from exc
    return copied


@overload
def function_tool(fn: Callable[..., Any], /) -> FunctionTool: ...


@overload
def function_tool(
    fn: None = None,
    *,
    effect: ToolEffect = ToolEffect.UNCLASSIFIED,
    requires_approval: bool | None = None,
    name: str | None = None,
    description: str | None = None,
    parameters_schema: Mapping[str, Any] | None = None,
    prepare_arguments: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> Callable[[Callable[..., Any]], FunctionTool]: ...


def function_tool(
    fn: Callable[..., Any] | None = None,
    *,
    effect: ToolEffect = ToolEffect.UNCLASSIFIED,
    requires_approval: bool | None = None,
    name: str | None = None,
    description: str | None = None,
    parameters_schema: Mapping[str, Any] | None = None,
    prepare_arguments: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> FunctionTool | Callable[[Callable[..., Any]], FunctionTool]:
    """Turns a sync or async function into a `FunctionTool`; use bare or with options."""

    def decorate(target: Callable[..., Any]) -> FunctionTool:
        return FunctionTool(
            target,
            effect=effect,
            requires_approval=requires_approval,
            name=name,
            description=description,
            parameters_schema=parameters_schema,
            prepare_arguments=prepare_arguments,
        )

    if fn is None:
        return decorate
    return decorate(fn)


async def _in_daemon_thread(tool: str, call: Callable[[], Any]) -> Any:
    """`call()` on a daemon thread of its own, with this task's context variables, awaited.

    Not asyncio.to_thread: the default executor's threads are joined as the event loop and the
    interpreter end, so a sync tool that hangs held a stopped Worker's process up until it returned,
    past the shutdown grace that bounds a restart. The call's thread is left to the process's end.
    A KeyboardInterrupt or SystemExit the tool raises fails the call (a RuntimeError naming it)
    rather than ending the Worker: it is no signal to the process.
    """
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Any] = loop.create_future()
    context = contextvars.copy_context()

    def settle(result: Any, error: BaseException | None) -> None:
        if done.cancelled():
            return  # the attempt ended (revoked, timed out) while the tool ran
        if error is None:
            done.set_result(result)
        else:
            done.set_exception(error)

    def run() -> None:
        error: BaseException | None = None
        result: Any = None
        try:
            result = context.run(call)
        except StopIteration as exc:
            # A Future refuses StopIteration (settle raised TypeError in the loop and the call waited
            # for ever); a coroutine's StopIteration becomes a RuntimeError too (PEP 479).
            error = RuntimeError(f"tool {tool} raised StopIteration")
            error.__cause__ = exc
        except (Exception, asyncio.CancelledError) as exc:  # a CancelledError stays one, as from any tool
            error = exc
        except BaseException as exc:  # see the docstring
            error = RuntimeError(f"tool {tool} raised {type(exc).__name__}: {exc}")
        with contextlib.suppress(RuntimeError):  # the event loop has closed: nobody waits any more
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name=f"dex-tool:{tool}", daemon=True).start()
    return await done
