"""JSON encoding of declared values with msgspec: strict types, size limit."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import msgspec
import msgspec.inspect as mi

from ._errors import InvalidValueError, ValueTooLargeError
from ._limits import DECODED_VALUE_CACHE_ENTRIES, MAX_VALUE_BYTES

T = TypeVar("T")

_encoder = msgspec.json.Encoder()
_decoders: dict[Any, msgspec.json.Decoder[Any]] = {}


def _decoder(tp: Any) -> msgspec.json.Decoder[Any]:
    dec = _decoders.get(tp)
    if dec is None:
        dec = msgspec.json.Decoder(tp, strict=True)
        _decoders[tp] = dec
    return dec


def encode_value(name: str, tp: Any, value: Any, *, limit: int = MAX_VALUE_BYTES) -> bytes:
    """Encode `value` as JSON, checking it is a `tp` and at most `limit` bytes."""
    try:
        data = _encoder.encode(value)
    except (TypeError, msgspec.EncodeError) as exc:
        raise InvalidValueError(
            f"value for {name!r} cannot be encoded as JSON ({type(value).__name__}): {exc}"
        ) from None
    if len(data) > limit:
        raise ValueTooLargeError(name, len(data), limit)
    if tp is not Any and not _is_checked_instance(tp, value):
        # Round-trip through the declared type: catches a dict where a dataclass is declared,
        # a str where an int is declared, and nested mismatches. An immutable value decoded here
        # is kept (_decoded): the next Step that loads these bytes gets it without decoding.
        key = (tp, data) if _deeply_immutable(tp) else None
        if key is None or key not in _decoded:
            try:
                decoded = _decoder(tp).decode(data)
            except msgspec.ValidationError as exc:
                raise InvalidValueError(
                    f"value for {name!r} is not a {_type_name(tp)}: {exc}"
                ) from None
            if key is not None:
                _remember(key, decoded)
    return data


def _is_checked_instance(tp: Any, value: Any) -> bool:
    """`value` is exactly a `tp` and so needs no round-trip. Not so for Structs and dataclasses:
    their constructors check no field types (a Struct with a str in a bool field builds)."""
    return (
        isinstance(tp, type) and type(value) is tp
        and not issubclass(tp, msgspec.Struct) and not dataclasses.is_dataclass(tp)
    )


def decode_value(name: str, tp: Any, data: bytes | str) -> Any:
    immutable = _immutable_types.get(tp)
    if immutable is None:
        immutable = _deeply_immutable(tp)
    key = (tp, data) if immutable and type(data) is bytes else None
    if key is not None:
        hit = _decoded.get(key)
        if hit is not None:
            return hit
    try:
        value = _decoder(tp).decode(data)
    except msgspec.ValidationError as exc:
        raise InvalidValueError(f"stored value for {name!r} is not a {_type_name(tp)}: {exc}") from None
    if key is not None:
        _remember(key, value)
    return value


def _remember(key: tuple[Any, bytes | str], value: Any) -> None:
    if len(_decoded) >= DECODED_VALUE_CACHE_ENTRIES:
        del _decoded[next(iter(_decoded))]  # the oldest entry
    _decoded[key] = value


# Decoded values by (type, stored bytes), for types whose values nothing can change (frozen Structs
# of immutable fields): a value is a function of its bytes, so every reader of the same bytes (the
# next Step reading the same messages, another flow) can share one decoded object.
_decoded: dict[tuple[Any, bytes | str], Any] = {}
_immutable_types: dict[Any, bool] = {}

_IMMUTABLE_SCALARS = (
    mi.NoneType, mi.BoolType, mi.IntType, mi.FloatType, mi.StrType, mi.BytesType, mi.DateTimeType,
    mi.DateType, mi.TimeType, mi.TimeDeltaType, mi.UUIDType, mi.DecimalType, mi.EnumType, mi.LiteralType,
)


def _deeply_immutable(tp: Any) -> bool:
    """Whether decoded values of `tp` are frozen Structs whose every field is immutable all the way down."""
    known = _immutable_types.get(tp)
    if known is None:
        try:
            info = mi.type_info(tp)
            known = isinstance(info, mi.StructType) and _immutable_info(info, set())
        except Exception:  # a type msgspec cannot describe is simply not cached
            known = False
        _immutable_types[tp] = known
    return known


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
