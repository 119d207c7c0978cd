"""Built-in tools the session routes itself: ask_user, durable_wait (a Timer) and write_todos (the plan).

Their definitions are offered by runners like any tool; their calls never reach a runner's
execute_deferred_tool_call. Argument checks are pure: text in, parsed arguments or an error out.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from datetime import timedelta
from enum import StrEnum
from typing import Any

from ._constants import ARGUMENTS_NOT_OBJECT, ARGUMENTS_NOT_TEXT, ARGUMENTS_TOO_DEEP, SHOWN_VALUE_CHARS


class BuiltInTool(StrEnum):
    ASK_USER = "ask_user"
    DURABLE_WAIT = "durable_wait"
    WRITE_TODOS = "write_todos"


@dataclass(frozen=True)
class BuiltInToolDefinition:
    name: str
    description: str
    parameters_schema: dict[str, Any]


BUILT_IN_TOOL_DEFINITIONS: dict[BuiltInTool, BuiltInToolDefinition] = {
    BuiltInTool.ASK_USER: BuiltInToolDefinition(
        "ask_user",
        "Ask the user a question and wait for the answer; offer choices when the answer is one of a few.",
        {
            "type": "object",
            "properties": {
                "question": {"type": "string", "description": "The question, as the user should read it."},
                "choices": {"type": ["array", "null"], "items": {"type": "string"},
                            "description": "Answers to offer; omit for a free-text question."},
                "allows_free_text": {"type": ["boolean", "null"],
                                     "description": "Whether an answer outside the choices is allowed (default true)."},
            },
            "required": ["question"],
            "additionalProperties": False,
        },
    ),
    BuiltInTool.DURABLE_WAIT: BuiltInToolDefinition(
        "durable_wait",
        "Wait a number of whole seconds without holding anything, e.g. before checking again; the session sleeps.",
        {
            "type": "object",
            "properties": {
                "duration_seconds": {"type": "integer", "minimum": 1, "description": "Whole seconds to wait."},
                "reason": {"type": "string", "description": "Why the wait is needed, shown to the user."},
            },
            "required": ["duration_seconds", "reason"],
            "additionalProperties": False,
        },
    ),
    # Arguments are checked by dex_agents._plans.parse_write_todos; RunModel records the call itself.
    BuiltInTool.WRITE_TODOS: BuiltInToolDefinition(
        "write_todos",
        "Write the plan as a list of tasks, replacing the whole previous plan. Keep each task's status current "
        "(pending, in_progress, completed) as you work; an empty list clears the plan.",
        {
            "type": "object",
            "properties": {
                "todos": {
                    "type": "array",
                    "description": "Every task of the plan, in order.",
                    "items": {
                        "type": "object",
                        "properties": {
                            "content": {"type": "string", "description": "What the task does."},
                            "status": {"type": "string", "enum": ["pending", "in_progress", "completed"]},
                        },
                        "required": ["content", "status"],
                        "additionalProperties": False,
                    },
                },
            },
            "required": ["todos"],
            "additionalProperties": False,
        },
    ),
}


class BuiltInArgumentsError(ValueError):
    """Arguments a built-in tool refuses; the text is what the model sees after `The tool call failed: `."""


@dataclass(frozen=True)
class AskUserArguments:
    question: str
    choices: tuple[str, ...]
    allows_free_text: bool


@dataclass(frozen=True)
class DurableWaitArguments:
    duration_seconds: int
    reason: str


def decode_arguments_object(arguments: str) -> dict[str, Any]:
    """A built-in's argument text as a JSON object; anything else (NaN included) is ARGUMENTS_NOT_OBJECT."""

    def refuse(constant: str) -> float:
        raise ValueError(constant)

    try:
        value = json.loads(arguments, parse_constant=refuse)
    except (TypeError, ValueError):
        raise BuiltInArgumentsError(ARGUMENTS_NOT_OBJECT) from None
    except RecursionError:
        raise BuiltInArgumentsError(ARGUMENTS_TOO_DEEP) from None
    if not isinstance(value, dict):
        raise BuiltInArgumentsError(ARGUMENTS_NOT_OBJECT)
    # Strict JSON may escape half of a UTF-16 pair ("\ud800"), which decodes to text no stored
    # value can hold: the plan, question or reason would fail the Step's commit on every retry.
    if "\\u" in arguments:
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise BuiltInArgumentsError(ARGUMENTS_NOT_TEXT) from None
        except RecursionError:
            raise BuiltInArgumentsError(ARGUMENTS_TOO_DEEP) from None
    return value


def _object(tool: str, arguments: str, allowed: tuple[str, ...]) -> dict[str, Any]:
    value = decode_arguments_object(arguments)
    unknown = sorted(set(value) - set(allowed))  # the first unknown name is the lowest by code point
    if unknown:
        raise BuiltInArgumentsError(f"invalid {tool} arguments: unknown argument {unknown[0]!r:.{SHOWN_VALUE_CHARS}}")
    return {k: v for k, v in value.items() if v is not None}  # null for an optional argument means absent


def parse_ask_user(arguments: str) -> AskUserArguments:
    tool = BuiltInTool.ASK_USER.value
    value = _object(tool, arguments, ("question", "choices", "allows_free_text"))
    question = value.get("question")
    if not isinstance(question, str) or not question.strip():
        raise BuiltInArgumentsError(f"invalid {tool} arguments: question must be non-empty text")
    choices = value.get("choices", [])
    if not isinstance(choices, list) or not all(isinstance(c, str) and c.strip() for c in choices):
        raise BuiltInArgumentsError(f"invalid {tool} arguments: choices must be a list of non-empty texts")
    if len(set(choices)) != len(choices):
        raise BuiltInArgumentsError(f"invalid {tool} arguments: choices repeat")
    free_text = value.get("allows_free_text", True)
    if not isinstance(free_text, bool):
        raise BuiltInArgumentsError(f"invalid {tool} arguments: allows_free_text must be true or false")
    if not choices and not free_text:
        raise BuiltInArgumentsError(f"invalid {tool} arguments: a question without choices must allow free text")
    return AskUserArguments(question, tuple(choices), free_text)


def parse_durable_wait(arguments: str, max_wait: timedelta) -> DurableWaitArguments:
    tool = BuiltInTool.DURABLE_WAIT.value
    value = _object(tool, arguments, ("duration_seconds", "reason"))
    seconds = value.get("duration_seconds")
    if isinstance(seconds, float) and math.isfinite(seconds) and seconds.is_integer():
        seconds = int(seconds)
    limit = int(max_wait.total_seconds())
    if isinstance(seconds, bool) or not isinstance(seconds, int) or not 1 <= seconds <= limit:
        raise BuiltInArgumentsError(
            f"invalid {tool} arguments: duration_seconds must be a whole number from 1 to {limit}, "
            f"got {seconds!r:.{SHOWN_VALUE_CHARS}}"
        )
    reason = value.get("reason")
    if not isinstance(reason, str):
        raise BuiltInArgumentsError(f"invalid {tool} arguments: reason must be text")
    return DurableWaitArguments(seconds, reason)


def answered_output(answer: str) -> str:
    return json.dumps({"status": "answered", "answer": answer}, separators=(",", ":"), ensure_ascii=False)


def waited_output(seconds: int, reason: str) -> str:
    return json.dumps({"status": "completed", "waited_seconds": seconds, "reason": reason},
                      separators=(",", ":"), ensure_ascii=False)
