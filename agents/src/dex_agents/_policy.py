"""Tool policies and the texts the model sees for tool call outcomes (pure functions)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ._constants import DEFAULT_REJECTION_MESSAGE, SHOWN_VALUE_CHARS
from ._wire import AgentToolCall, AgentToolCallStatus, ToolEffect

# Effects whose calls may run again: CallTool retries them; the others run at most once.
REPEATABLE_EFFECTS = frozenset({ToolEffect.READ, ToolEffect.IDEMPOTENT_WRITE})

OUTCOME_UNKNOWN_TEXT = (
    "The tool call's outcome is unknown: it stopped without returning a result, so it may or may not "
    "have taken effect. It will not be retried automatically."
)

TURN_FAILURE_NOTE_HEADER = "[Dex] The previous turn failed after these tool calls ran:"
STEERED_NOTE_HEADER = "[Dex] The user steered the conversation after these tool calls ran:"
CANCELLED_NOTE_HEADER = "[Dex] The user stopped the previous turn after these tool calls ran:"
TOOL_CALL_NOTE_FOOTER = "Do not repeat these tool calls unless the user asks again."


@dataclass(frozen=True)
class ToolPolicy:
    """Per-tool override: its effect and, when set, whether it needs approval."""

    effect: ToolEffect
    requires_approval: bool | None = None

    def __post_init__(self) -> None:
        problem = tool_effect_problem(self.effect, "ToolPolicy.effect") or requires_approval_problem(
            self.requires_approval, "ToolPolicy.requires_approval")
        if problem is not None:
            raise TypeError(problem)


def tool_effect_problem(effect: object, field_name: str) -> str | None:
    """What is wrong with a tool effect, or None. Shared by every place a user writes one
    (ToolPolicy, function_tool, default_tool_effect), so each names its own field."""
    if not isinstance(effect, ToolEffect):
        return f"{field_name} must be a ToolEffect, such as ToolEffect.READ, got {shown(effect, None)}"
    return None


def count_problem(label: str, value: object) -> str | None:
    """What keeps `value` from being a count of at least one (a bool is not one), or None; shared by
    every such field, each naming its own `label`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return f"{label} must be a whole number >= 1, got {shown(value, None)}"
    return None


def requires_approval_problem(value: object, field_name: str) -> str | None:
    """What is wrong with a `requires_approval`, or None (shared as tool_effect_problem is)."""
    if value is not None and not isinstance(value, bool):
        return f"{field_name} must be a bool or None (None: the effect decides), got {shown(value, None)}"
    return None


def is_approval_required(policy: ToolPolicy) -> bool:
    """The policy's explicit choice, else the effect's default: writes that may not repeat need approval."""
    if policy.requires_approval is not None:
        return policy.requires_approval
    return policy.effect not in REPEATABLE_EFFECTS


# How cautiously a call of each effect runs: a read is repeated and fails, an idempotent write is
# repeated and ends outcome_unknown, the others run once. A call recorded under a lower rank than its
# tool has now would run with fewer safeguards than the tool asks for.
_EFFECT_CAUTION = {
    ToolEffect.READ: 0, ToolEffect.IDEMPOTENT_WRITE: 1,
    ToolEffect.NON_IDEMPOTENT_WRITE: 2, ToolEffect.UNCLASSIFIED: 2,
}


def _described(effect: ToolEffect, approval: bool) -> str:
    return f"{effect.value} {'needing approval' if approval else 'with no approval'}"


def policy_text(policy: ToolPolicy) -> str:
    """A policy as a person reads it: its effect and whether a call of it waits for approval."""
    return _described(policy.effect, is_approval_required(policy))


def stricter_policy_problem(record: AgentToolCall, current: ToolPolicy) -> str | None:
    """Why `current`, the policy the tool has now, is stricter than the one `record` was made under
    (a deploy changed the tool while the call waited or was retried), or None. The record chose the
    call's approval and its tool Step, so running it as recorded could skip an approval the tool now
    needs, or run a write that may not repeat in a Step that repeats it."""
    approval = is_approval_required(current)
    needs_approval = approval and not record.requires_approval
    if not needs_approval and _EFFECT_CAUTION[current.effect] <= _EFFECT_CAUTION[record.effect]:
        return None
    return (f"tool {record.tool_name} changed after the model called it: the call was recorded as "
            f"{_described(record.effect, record.requires_approval)}, and this Worker's agent defines it as "
            f"{_described(current.effect, approval)}; call it again to run it under the new definition")


def resolve_tool_policy(
    tool_name: str,
    tool_policies: Mapping[str, ToolPolicy],
    default_tool_effect: ToolEffect,
    framework_effect: ToolEffect | None = None,
) -> ToolPolicy:
    """Explicit policy, else the framework's metadata, else the session's default effect."""
    explicit = tool_policies.get(tool_name)
    if explicit is not None:
        return explicit
    return ToolPolicy(framework_effect if framework_effect is not None else default_tool_effect)


def describe_tool_call_outcome(record: AgentToolCall) -> str:
    """The model-visible result of a final record (seed 002, "Model-visible results")."""
    status = record.status
    if status is AgentToolCallStatus.SUCCEEDED:
        return record.output or ""
    if status is AgentToolCallStatus.FAILED:
        return f"The tool call failed: {record.error or ''}"
    if status is AgentToolCallStatus.REJECTED:
        return record.rejection_message or DEFAULT_REJECTION_MESSAGE
    if status is AgentToolCallStatus.OUTCOME_UNKNOWN:
        return OUTCOME_UNKNOWN_TEXT
    raise ValueError(
        f"tool call {record.tool_call_id!r} is {status.value}, not final; "
        "only final records have a model-visible result"
    )


def build_tool_call_note(
    header: str, records: Iterable[AgentToolCall], *, field_chars: int | None = None
) -> str | None:
    """A note listing final records in deferral_order, or None when there are none; with
    `field_chars`, each call's arguments and result cut to that many characters."""
    final = sorted((r for r in records if r.status.is_final), key=lambda r: r.deferral_order)
    if not final:
        return None
    lines = [header]
    lines.extend(
        f"- {r.tool_name} {cut_text(r.arguments, field_chars)} -> {r.status.value}: "
        f"{cut_text(describe_tool_call_outcome(r), field_chars)}"
        for r in final
    )
    lines.append(TOOL_CALL_NOTE_FOOTER)
    return "\n".join(lines)


def cut_text(text: str, chars: int | None) -> str:
    """`text`, or its first `chars` characters and a note of its full length; None: no cut."""
    if chars is None or len(text) <= chars:
        return text
    return f"{text[:chars]} [Dex: cut from {len(text)} characters]"


# The note cut_text appends; a length of at most 19 digits, so int() never meets a huge one.
_CUT_NOTE = re.compile(r" \[Dex: cut from ([1-9][0-9]{0,18}) characters\]")


def is_cut_text(text: str, chars: int) -> bool:
    """Whether `text` is what cut_text(original, chars) made of an original longer than `chars`."""
    note = _CUT_NOTE.fullmatch(text, chars)
    return note is not None and int(note.group(1)) > chars


def text_of(value: object) -> str:
    """`value` as text, for an error a session stores: str() of what is not text. Never raises: a
    runner's odd value (an exception given as a message, a __str__ that raises) must not stop a call
    or a turn from being recorded, which would run it again."""
    if isinstance(value, str):
        return value
    try:
        return str(value)
    except Exception as exc:
        return f"(a {type(value).__name__} whose text could not be made: {type(exc).__name__})"


def shown(value: object, chars: int | None = SHOWN_VALUE_CHARS) -> str:
    """repr(value), at most `chars` characters (None: all), for an error that names a runner's value. Never
    raises: a repr that raises must not stop the call or turn from being recorded."""
    try:
        text = repr(value)
    except Exception as exc:
        return f"(a {type(value).__name__} whose repr could not be made: {type(exc).__name__})"
    return text if chars is None else text[:chars]


def error_message(exc: BaseException) -> str:
    """The message of a ToolExecutionError or ToolOutcomeUnknownError as text. Never raises: a
    subclass that skipped super().__init__ has no `message`, and its own text stands in."""
    message = getattr(exc, "message", None)
    return text_of(exc if message is None else message)


def raised_text(exc: BaseException) -> str:
    """What `exc` was, as "<type>: <text>"; never raises (text_of)."""
    return f"{type(exc).__name__}: {text_of(exc)}"


def build_turn_failure_note(records: Iterable[AgentToolCall], *, field_chars: int | None = None) -> str | None:
    """The turn-failure note for a failed turn's final records, or None when no tool call ran;
    `field_chars` as in build_tool_call_note."""
    return build_tool_call_note(TURN_FAILURE_NOTE_HEADER, records, field_chars=field_chars)
