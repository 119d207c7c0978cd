"""Session settings checks: one JSON object of references, bounded in size."""

from __future__ import annotations

import json
from typing import Any

from ._constants import MAX_SESSION_SETTINGS_BYTES, MAX_SESSION_SETTINGS_NESTING, SESSION_SETTINGS_SIZE_TOLERANCE_BYTES


def settings_json_bytes(settings: Any) -> int:
    """Size of the settings' compact JSON text in UTF-8, as Clients measure it."""
    return len(json.dumps(settings, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode())


# The session's own checks accept the tolerance; Clients check MAX_SESSION_SETTINGS_BYTES itself.
SESSION_SIDE_SETTINGS_LIMIT = MAX_SESSION_SETTINGS_BYTES + SESSION_SETTINGS_SIZE_TOLERANCE_BYTES


def session_settings_size(settings: Any) -> int:
    """The compact JSON size Clients check against MAX_SESSION_SETTINGS_BYTES."""
    return settings_json_bytes(settings)


def validate_session_settings(settings: object) -> None:
    """Raise ValueError naming the problem when a Client must not send these settings."""
    problem = session_settings_error(settings, limit=MAX_SESSION_SETTINGS_BYTES)
    if problem is not None:
        raise ValueError(problem)


def session_settings_error(settings: object, *, limit: int = SESSION_SIDE_SETTINGS_LIMIT) -> str | None:
    """None for acceptable settings, else why not (the session's own check allows the tolerance)."""
    if not isinstance(settings, dict):
        return f"session_settings must be a JSON object, got {type(settings).__name__}"
    # First: how deep JSON's encoder goes before it gives up depends on the Python.
    depth, odd_keys, circular = _nesting(settings)
    if circular:
        # Before the depth: a value that holds itself is endlessly deep, and JSON cannot write it.
        return "session_settings contain themselves (an object or array that holds itself), which JSON cannot write"
    if depth > MAX_SESSION_SETTINGS_NESTING:
        return (f"session_settings nest objects and arrays {depth} levels deep, over the limit of "
                f"{MAX_SESSION_SETTINGS_NESTING}")
    if odd_keys:
        odd_key = odd_keys[0]
        # json.dumps would write None, True or 1 as a text key: the size checked here would not be
        # what is stored, and {1: "a", "1": "b"} would lose a key.
        return f"session_settings keys must be text, got the {type(odd_key).__name__} key {odd_key!r:.60}"
    try:
        size = settings_json_bytes(settings)
    except (TypeError, ValueError) as exc:
        return f"session_settings are not JSON: {exc}"
    if size > limit:
        return f"session_settings are {size} bytes of compact JSON, over the limit of {limit}"
    return None


def _nesting(value: object) -> tuple[int, list[object], bool]:
    """Levels of objects and arrays in JSON-shaped `value`, the keys of its objects that are not
    text, and whether an object or array holds itself (then the walk stops: it would never end).
    Settings are small: a walk is cheap."""
    deepest, pending = 0, [(value, 1)]
    odd_keys: list[object] = []
    # The objects and arrays being walked, from `value` down to the current one, by id: a child
    # among them is a cycle. The same child under two parents is no cycle, and JSON writes it twice.
    open_ids: set[object] = set()
    while pending:
        item, level = pending.pop()
        if level == _LEAVING:
            open_ids.discard(item)  # the id pushed when it was entered
            continue
        if isinstance(item, dict):
            odd_keys.extend(key for key in item if not isinstance(key, str))
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list | tuple) else None
        if children is not None:
            if id(item) in open_ids:
                return deepest, odd_keys, True
            open_ids.add(id(item))
            deepest = max(deepest, level)
            pending.append((id(item), _LEAVING))
            pending.extend((child, level + 1) for child in children)
    return deepest, odd_keys, False


# The level of the marker _nesting pushes under a container's children: popped, it leaves it.
_LEAVING = 0
