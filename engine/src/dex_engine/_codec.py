"""JSON encoding of declared values with msgspec: strict types, size limit."""

from __future__ import annotations

import dataclasses
import itertools
import math
import threading
from array import array
from collections.abc import Callable
from typing import Any, TypeVar, cast

import msgspec
import msgspec.inspect as mi

from ._errors import InvalidValueError, ValueTooLargeError, shown
from ._limits import DECODED_VALUE_CACHE_BYTES, DECODED_VALUE_CACHE_ENTRIES, MAX_VALUE_BYTES, MAX_VALUE_NESTING

T = TypeVar("T")

_encoder = msgspec.json.Encoder()
_decoders: dict[Any, msgspec.json.Decoder[Any]] = {}


def _decoder(tp: Any) -> msgspec.json.Decoder[Any]:
    dec = _decoders.get(tp)
    if dec is None:
        dec = msgspec.json.Decoder(tp, strict=True)
        _decoders[tp] = dec
    return dec


def type_problem(label: str, tp: Any) -> str | None:
    """Why values of `tp` cannot be stored as JSON (`label` names where it was declared), or None."""
    try:
        _decoder(tp)
    except TypeError as exc:  # not a type msgspec knows (a value, an unsupported class), or unhashable
        return f"{label} is {shown(tp, None)}, not a type whose values can be stored as JSON ({exc})"
    except Exception:  # msgspec names a value it cannot take by its repr, and that repr raised
        return f"{label} is {shown(tp, None)}, not a type whose values can be stored as JSON"
    return None


# Opening brackets as 1, closing ones as -1 (255, read as a signed byte); every other byte dropped.
_BRACKET_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def nesting_depth(data: bytes) -> int:
    """How deeply the JSON `data` nests arrays and objects (0 for a scalar)."""
    # Brackets inside strings do not count. With escaped backslashes, then escaped quotes, taken
    # out, every other piece between quotes is outside a string (bytes operations, no Python loop).
    unescaped = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    outside = b"".join(unescaped.split(b'"')[::2])
    steps = outside.translate(_BRACKET_STEPS, _NOT_BRACKETS)
    return max(itertools.accumulate(array("b", steps)), default=0)


def _per_type(cache: dict[Any, bool], tp: Any, judge: Callable[[mi.Type], bool]) -> bool:
    """`judge` of `tp`'s msgspec description, kept per type in `cache`; True for an unhashable type
    or one msgspec cannot describe (its values are then looked at, which is always safe)."""
    try:
        known = cache.get(tp)
    except TypeError:
        return True
    if known is None:
        try:
            known = judge(mi.type_info(tp))
        except Exception:
            known = True
        cache[tp] = known
    return known


def _inner_types(info: mi.Type) -> tuple[list[mi.Type], int] | None:
    """The types directly inside `info`, and 1 when it is an array or object itself (0 for a union);
    None for one with nothing inside (a scalar, Any, a custom type)."""
    if isinstance(info, mi.UnionType):
        return list(info.types), 0
    if isinstance(info, mi.ListType | mi.SetType | mi.FrozenSetType | mi.VarTupleType):
        return [info.item_type], 1
    if isinstance(info, mi.TupleType):
        return list(info.item_types), 1
    if isinstance(info, mi.DictType):
        return [info.value_type], 1  # keys are written as text
    if isinstance(info, mi.StructType | mi.DataclassType | mi.TypedDictType | mi.NamedTupleType):
        return [field.type for field in info.fields], 1
    return None


# Whether values of a declared type may nest past MAX_VALUE_NESTING (Any, a recursive type), by type.
_may_nest_deeply: dict[Any, bool] = {}


def may_nest_deeply(tp: Any) -> bool:
    """Whether values of `tp` can nest arrays and objects past MAX_VALUE_NESTING: most declared
    types (an agent's message chunk, a struct of text) bound their depth, and their values need
    no count. An unhashable or unknown type is counted."""

    def deep(info: mi.Type) -> bool:
        depth = _type_depth(info, set())
        return depth is None or depth > MAX_VALUE_NESTING

    return _per_type(_may_nest_deeply, tp, deep)


# Whether a declared type has a float position (a field, an item, a value), by type.
_may_hold_float: dict[Any, bool] = {}


def may_hold_float(tp: Any) -> bool:
    """Whether `tp` declares a float anywhere inside it (Any does not: there a NaN is written as null,
    as docs/engine.md says). An unhashable or unknown type is treated as one that may."""
    return _per_type(_may_hold_float, tp, lambda info: _has_float(info, set()))


def _has_float(info: mi.Type, path: set[int]) -> bool:
    if isinstance(info, mi.FloatType):
        return True
    found = _inner_types(info)
    if found is None or id(info) in path:
        return False  # recursive: what it holds is looked at where it was entered
    path.add(id(info))
    held = any(_has_float(item, path) for item in found[0])
    path.discard(id(info))
    return held


def non_finite_float(value: Any) -> float | None:
    """The first NaN or infinity inside `value` (its fields, items and values), or None."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, float):
            if not math.isfinite(item):
                return item
        elif isinstance(item, dict):
            pending.extend(item.values())
        elif isinstance(item, list | tuple | set | frozenset):
            pending.extend(item)
        elif isinstance(item, msgspec.Struct):
            pending.extend(getattr(item, field) for field in item.__struct_fields__)
        elif dataclasses.is_dataclass(item) and not isinstance(item, type):
            pending.extend(getattr(item, field.name) for field in dataclasses.fields(item))
    return None


def _type_depth(info: mi.Type, path: set[int]) -> int | None:
    """The deepest nesting of arrays and objects a value of `info` can have; None when unbounded."""
    if id(info) in path:
        return None  # recursive
    if isinstance(info, mi.AnyType | mi.RawType | mi.CustomType | mi.ExtType):
        return None
    found = _inner_types(info)
    if found is None:
        return 0  # a scalar: text, a number, a literal, an enum, a time
    inner, own = found
    path.add(id(info))
    depths = [_type_depth(item, path) for item in inner]
    path.discard(id(info))
    if any(depth is None for depth in depths):
        return None
    return own + max((depth for depth in depths if depth is not None), default=0)


def nesting_problem(name: str, data: bytes) -> str | None:
    """Why the JSON `data` of `name` nests too deeply to store (MAX_VALUE_NESTING), or None."""
    # Only a value with that many brackets can nest that deeply: most are counted no further.
    if len(data) <= 2 * MAX_VALUE_NESTING or data.count(b"[") + data.count(b"{") <= MAX_VALUE_NESTING:
        return None
    depth = nesting_depth(data)
    if depth <= MAX_VALUE_NESTING:
        return None
    return (f"value for {name!r} nests arrays and objects {depth} levels deep, over the limit of "
            f"{MAX_VALUE_NESTING} (MAX_VALUE_NESTING); store it flatter, or as text")


def encode_value(name: str, tp: Any, value: Any, *, limit: int = MAX_VALUE_BYTES) -> bytes:
    """Encode `value` as JSON, checking it is a `tp` and at most `limit` bytes."""
    try:
        data = _encoder.encode(value)
    except (TypeError, ValueError, msgspec.EncodeError, RecursionError) as exc:
        # UnicodeEncodeError (a ValueError): text with a lone surrogate, which UTF-8 (and so JSON)
        # cannot hold. ValueError: an int of more digits than Python converts to text (4,300).
        # RecursionError: nested deeper than Python's recursion limit lets the encoder go.
        raise InvalidValueError(
            f"value for {name!r} cannot be encoded as JSON ({type(value).__name__}): {exc}"
        ) from None
    if len(data) > limit:
        raise ValueTooLargeError(name, len(data), limit)
    if type(value) is float and not math.isfinite(value):
        # msgspec writes it as null, which no float declaration reads back: every later load of
        # the value would fail. (Inside an Any or dict value the null is read back as None.)
        raise InvalidValueError(f"value for {name!r} is {value!r}, which JSON cannot hold; store it as text or None")
    if b"null" in data and may_hold_float(tp):
        # One inside the value is written as null too: a field declared `float | None` read it back
        # as None, so the NaN was stored as "no value" without a word. Looked for only when a null
        # was written where the declared type has a float: most values are never walked.
        found = non_finite_float(value)
        if found is not None:
            raise InvalidValueError(
                f"value for {name!r} holds the float {found!r}, which JSON cannot hold (it would be "
                "written as null); store it as text or None")
    nesting = nesting_problem(name, data) if may_nest_deeply(tp) else None
    if nesting is not None:
        raise InvalidValueError(nesting)
    if tp is not Any and not _is_checked_instance(tp, value):
        # Round-trip through the declared type: catches a dict where a dataclass is declared,
        # a str where an int is declared, and nested mismatches. A shareable value decoded here
        # is kept (_decoded): the next Step that loads these bytes gets it without decoding.
        handout = _handouts.get(tp, _UNKNOWN)
        if handout is _UNKNOWN:
            handout = _handout(tp)
        key = (tp, data) if handout is not None else None
        if key is None or key not in _decoded.values:
            try:
                decoded = _decoder(tp).decode(data)
            except msgspec.ValidationError as exc:
                raise InvalidValueError(
                    f"value for {name!r} is not a {_type_name(tp)}: {exc}"
                ) from None
            if key is not None:
                _decoded.remember(key, decoded)
    return data


def _is_checked_instance(tp: Any, value: Any) -> bool:
    """`value` is exactly a `tp` and so needs no round-trip. Not so for Structs and dataclasses:
    their constructors check no field types (a Struct with a str in a bool field builds)."""
    if type(value) is not tp:
        return False
    known = _plain_types.get(tp)
    if known is None:
        known = _plain_types[tp] = (
            isinstance(tp, type) and not issubclass(tp, msgspec.Struct) and not dataclasses.is_dataclass(tp)
        )
    return known


# Whether a type's instances are checked by being one (see _is_checked_instance), by type.
_plain_types: dict[Any, bool] = {}


def decode_value(name: str, tp: Any, data: bytes | str | msgspec.Raw, key: str | None = None) -> Any:
    """Decode a stored `tp`; `name` (with `key`, a map instance's) labels the value in errors."""
    handout = _handouts.get(tp, _UNKNOWN)
    if handout is _UNKNOWN:
        handout = _handout(tp)
    cache_key = (tp, data) if handout is not None and type(data) is bytes else None
    if cache_key is not None:
        hit = _decoded.values.get(cache_key)
        if hit is not None:
            return handout(hit)
    try:
        value = _decoder(tp).decode(data)
    except msgspec.ValidationError as exc:
        # The label only when it is needed: a map's instances are decoded by the dozen per Step.
        label = name if key is None else f"{name}[{key}]"
        raise InvalidValueError(f"stored value for {label!r} is not a {_type_name(tp)}: {exc}") from None
    if cache_key is not None and handout is not None:
        _decoded.remember(cache_key, value)
        return handout(value)
    return value


def decoded_cache(tp: Any) -> tuple[dict[tuple[Any, bytes | str], Any], Handout | None] | None:
    """For a caller that decodes many `tp` values in one loop (a map read whole: the message
    window): the decoded values by (tp, stored bytes), and how a hit is handed out (None: as is);
    None when `tp` is not cached. A miss goes through decode_value."""
    handout = _handout(tp)
    if handout is None:
        return None
    return _decoded.values, (None if handout is _shared else handout)


class _DecodedCache:
    """Decoded values by (type, stored bytes), for types whose values can be shared (see _handout).

    A value is a function of its bytes, so every reader of the same bytes (the next Step reading the
    same messages, another flow) gets it without decoding. Bounded by entries and by stored bytes;
    the oldest entries go first. Safe across threads (RPC clients decode on their own).
    """

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.values: dict[tuple[Any, bytes | str], Any] = {}
        self.stored_bytes = 0  # the stored bytes of the keys in `values`
        self._max_entries = max_entries
        self._max_bytes = max_bytes
        self._lock = threading.Lock()

    def remember(self, key: tuple[Any, bytes | str], value: Any) -> None:
        with self._lock:
            if key in self.values:
                return
            self.values[key] = value
            self.stored_bytes += len(key[1])
            while len(self.values) > self._max_entries or self.stored_bytes > self._max_bytes:
                oldest = next(iter(self.values))
                del self.values[oldest]
                self.stored_bytes -= len(oldest[1])


_decoded = _DecodedCache(DECODED_VALUE_CACHE_ENTRIES, DECODED_VALUE_CACHE_BYTES)

Handout = Callable[[Any], Any]
_UNKNOWN: Any = object()
_handouts: dict[Any, Handout | None] = {}

_IMMUTABLE_SCALARS = (
    mi.NoneType, mi.BoolType, mi.IntType, mi.FloatType, mi.StrType, mi.BytesType, mi.DateTimeType,
    mi.DateType, mi.TimeType, mi.TimeDeltaType, mi.UUIDType, mi.DecimalType, mi.EnumType, mi.LiteralType,
)


def _handout(tp: Any) -> Handout | None:
    """How a cached decoded `tp` is given to a reader, or None when `tp` is not cached.

    A frozen Struct immutable all the way down is shared as is. A list of such values, or a frozen
    Struct whose only mutable fields are such lists (a message chunk, a tool call record), is
    shared with fresh copies of those lists: copying a list is far cheaper than decoding its items,
    and no reader can change what another reads.
    """
    known = _handouts.get(tp, _UNKNOWN)
    if known is not _UNKNOWN:
        return cast("Handout | None", known)
    try:
        info = mi.type_info(tp)
    except Exception:  # a type msgspec cannot describe is simply not cached
        info = None
    rule: Handout | None = None
    if isinstance(info, mi.ListType) and _immutable_info(info.item_type, set()):
        rule = list
    elif isinstance(info, mi.StructType) and info.cls.__struct_config__.frozen:
        lists: list[str] = []
        shareable = True
        for f in info.fields:
            if _holds_immutable_list(f.type):
                lists.append(f.name)
            elif not _immutable_info(f.type, {info.cls}):
                shareable = False
                break
        if shareable:
            rule = _copying_lists(tuple(lists)) if lists else _shared
    _handouts[tp] = rule
    return rule


def _shared(value: Any) -> Any:
    return value


def _copying_lists(names: tuple[str, ...]) -> Handout:
    def handout(value: Any) -> Any:
        copies = {}
        for name in names:
            items = getattr(value, name)
            if items is not None:
                copies[name] = list(items)
        return msgspec.structs.replace(value, **copies)

    return handout


def _holds_immutable_list(info: mi.Type) -> bool:
    """A list of immutable items, or such a list or None."""
    if isinstance(info, mi.ListType):
        return _immutable_info(info.item_type, set())
    if isinstance(info, mi.UnionType):
        others = [t for t in info.types if not isinstance(t, mi.NoneType)]
        return len(others) == 1 and len(info.types) == 2 and _holds_immutable_list(others[0])
    return False


def _immutable_info(info: mi.Type, seen: set[type]) -> bool:
    if isinstance(info, _IMMUTABLE_SCALARS):
        return True
    if isinstance(info, mi.StructType):
        if info.cls in seen:
            return True  # a recursive reference: decided by the outer check
        if not info.cls.__struct_config__.frozen:
            return False
        seen.add(info.cls)
        return all(_immutable_info(f.type, seen) for f in info.fields)
    if isinstance(info, mi.UnionType):
        return all(_immutable_info(t, seen) for t in info.types)
    if isinstance(info, mi.TupleType):
        return all(_immutable_info(t, seen) for t in info.item_types)
    if isinstance(info, mi.VarTupleType | mi.FrozenSetType):
        return _immutable_info(info.item_type, seen)
    return False


def encode_json(value: Any) -> bytes:
    """Encode engine-internal records (options, wait specs) without a size check."""
    return _encoder.encode(value)


def decode_json(data: bytes | str, tp: type[T]) -> T:
    result: T = _decoder(tp).decode(data)
    return result


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or repr(tp)
