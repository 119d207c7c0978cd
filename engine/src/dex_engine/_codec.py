"""JSON encoding of declared values with msgspec: strict types, size limit."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import msgspec

from ._errors import InvalidValueError, ValueTooLargeError
from ._limits import MAX_VALUE_BYTES

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
        # a str where an int is declared, and nested mismatches.
        try:
            _decoder(tp).decode(data)
        except msgspec.ValidationError as exc:
            raise InvalidValueError(
                f"value for {name!r} is not a {_type_name(tp)}: {exc}"
            ) from None
    return data


def _is_checked_instance(tp: Any, value: Any) -> bool:
    """`value` is exactly a `tp` and so needs no round-trip. Not so for Structs and dataclasses:
    their constructors check no field types (a Struct with a str in a bool field builds)."""
    return (
        isinstance(tp, type) and type(value) is tp
        and not issubclass(tp, msgspec.Struct) and not dataclasses.is_dataclass(tp)
    )


def decode_value(name: str, tp: Any, data: bytes | str) -> Any:
    try:
        return _decoder(tp).decode(data)
    except msgspec.ValidationError as exc:
        raise InvalidValueError(f"stored value for {name!r} is not a {_type_name(tp)}: {exc}") from None


def encode_json(value: Any) -> bytes:
    """Encode engine-internal records (options, wait specs) without a size check."""
    return _encoder.encode(value)


def decode_json(data: bytes | str, tp: type[T]) -> T:
    result: T = _decoder(tp).decode(data)
    return result


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or repr(tp)
