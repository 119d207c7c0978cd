"""Validation of IDs, names and keys."""

from __future__ import annotations

from ._errors import InvalidIdError, shown
from ._limits import MAX_ID_LENGTH, RESERVED_ID_CHARACTERS, RESERVED_NAME_CHARACTERS


def check_id(kind: str, value: object) -> str:
    """Return `value` if it is a usable ID, else raise InvalidIdError naming the problem."""
    if not isinstance(value, str):
        raise InvalidIdError(f"{kind} must be a string, got {type(value).__name__}: {shown(value, None)}")
    if not value:
        raise InvalidIdError(f"{kind} is empty; give a non-empty {kind}")
    if len(value) > MAX_ID_LENGTH:
        raise InvalidIdError(
            f"{kind} {value[:40]!r}... is {len(value)} characters, over {MAX_ID_LENGTH}"
        )
    for ch in value:
        if ch.isspace() or not ch.isprintable():
            raise InvalidIdError(
                f"{kind} {value!r} contains whitespace or a control character ({ch!r}); "
                "use letters, digits and punctuation"
            )
        if ch in RESERVED_ID_CHARACTERS:
            raise InvalidIdError(
                f"{kind} {value!r} contains reserved character {ch!r}; it joins IDs into keys"
            )
    return value


def check_name(kind: str, value: object) -> str:
    """check_id, for a schema name (attribute, channel, stream, or a map of them): also without '['
    or ']', which set a map instance's key apart in its label and lock ("Name[key]")."""
    name = check_id(kind, value)
    for ch in RESERVED_NAME_CHARACTERS:
        if ch in name:
            raise InvalidIdError(
                f"{kind} {name!r} contains reserved character {ch!r}; it marks a map instance's key, "
                f"as in 'Name[key]'")
    return name


def check_key(kind: str, value: object) -> str:
    """Map and channel keys: any non-empty printable text up to the ID length."""
    if not isinstance(value, str):
        raise InvalidIdError(f"{kind} must be a string, got {type(value).__name__}: {shown(value, None)}")
    if not value:
        raise InvalidIdError(f"{kind} is empty; give a non-empty key")
    if len(value) > MAX_ID_LENGTH:
        raise InvalidIdError(f"{kind} {value[:40]!r}... is {len(value)} characters, over {MAX_ID_LENGTH}")
    if not value.isprintable():  # one C call; keys are checked on every map access
        raise InvalidIdError(f"{kind} {value!r} contains a control character")
    return value
