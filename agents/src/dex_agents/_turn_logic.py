"""Pure decisions of a turn: validating runner output, planning tool calls, recording outcomes.

Nothing here touches the engine: state goes in, records and decisions come out, so every rule
can be tested exhaustively without a database.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

import msgspec

from dex_engine import RetryPolicy

from ._builtin_tools import BuiltInArgumentsError, BuiltInTool, parse_ask_user, parse_durable_wait
from ._constants import (
    ARGUMENTS_NOT_OBJECT,
    ARGUMENTS_TOO_DEEP,
    AWAIT_QUESTION_ANSWER,
    AWAIT_TIMER,
    AWAIT_TOOL_APPROVAL,
    CALL_SINGLE_ATTEMPT_TOOL,
    CALL_TOOL,
    CUT_NOTE_FIELD_CHARS,
    DEFAULT_MAX_DURABLE_WAIT,
    MAX_REJECTION_MESSAGE_CHARS,
    MAX_STORED_TOOL_ERROR_CHARS,
    MAX_USAGE_COUNT,
    SHOWN_VALUE_CHARS,
    TOOL_CALL_NOT_RUN_ERROR_PREFIX,
    TOOL_NAME_MISSING,
)
from ._options import LONGEST_TIMER
from ._plans import WRITE_TODOS, count_write_todos_calls, rejected_in_planning_turn, settle_write_todos
from ._policy import REPEATABLE_EFFECTS, ToolPolicy, cut_text, is_approval_required, is_cut_text, shown
from ._runner import DeferredToolCall, FrameworkMessage, ToolCallStepOptions
from ._timefmt import format_time
from ._wire import (
    AgentInterrupt,
    AgentMessage,
    AgentPlan,
    AgentState,
    AgentStatus,
    AgentToolCall,
    AgentToolCallStatus,
    AgentUsage,
    InteractionMode,
    InterruptKind,
    MessageRole,
    ToolEffect,
)

# Longest tool call ID: it becomes part of map keys and the idempotency key.
MAX_TOOL_CALL_ID_LENGTH = 255


class TurnContractError(Exception):
    """A runner's output breaks the contract in a way a retry cannot fix: the turn fails now."""


def turn_id_for(turn_number: int) -> str:
    return f"turn-{turn_number}"


def next_turn_id(state: AgentState) -> str:
    """Turn IDs never repeat: turn_count counts every ended turn."""
    return turn_id_for(state.turn_count + 1)


def initial_state() -> AgentState:
    return AgentState(
        status=AgentStatus.WAITING_FOR_USER_MESSAGE, turn_count=0, active_turn_id=None,
        next_message_sequence=1, last_turn_error=None,
    )


def started_turn(state: AgentState, turn_id: str, mode: InteractionMode) -> AgentState:
    """The state of a started turn: this Worker can steer and cancel it (accepts_turn_control)."""
    return msgspec.structs.replace(
        state, status=AgentStatus.RUNNING_MODEL, active_turn_id=turn_id, interaction_mode=mode,
        accepts_turn_control=True,
    )


def ended_turn(state: AgentState, *, error: str | None) -> AgentState:
    """The state after a turn ends: counted, cleared; a failure's error, or cleared on success."""
    return msgspec.structs.replace(
        state, status=AgentStatus.WAITING_FOR_USER_MESSAGE, turn_count=state.turn_count + 1,
        active_turn_id=None, last_turn_error=error, accepts_turn_control=False,
    )


_ROLES = frozenset(r.value for r in MessageRole)


def usage_problem(usage: object) -> str | None:
    """Why `usage` cannot be added to the session's totals, or None: it must be an AgentUsage whose
    counts are whole numbers of at least 0 (a provider's missing count passed on as None is not)."""
    if not isinstance(usage, AgentUsage):
        return f"must be an AgentUsage, got {type(usage).__name__}"
    for name in AgentUsage.__struct_fields__:
        value = getattr(usage, name)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_USAGE_COUNT:
            return f"{name} must be a whole number from 0 to {MAX_USAGE_COUNT}, got {shown(value)}"
    return None


def text_problem(value: str) -> str | None:
    """Why text cannot be stored (stored values are JSON, which is UTF-8), or None when it can."""
    if value.isascii():  # O(1) in CPython (a flag of the string): most text takes no encoding here
        return None
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"not valid UTF-8 text: {value[exc.start]!r} at position {exc.start} is a lone surrogate"
    return None


_MESSAGE_TEXT_FIELDS = ("framework_item", "text", "tool_call_id", "tool_name", "tool_arguments", "tool_output")


def check_framework_messages(items: object, source: str, *, single: bool = False) -> list[FrameworkMessage]:
    """The runner's messages, or TurnContractError naming the first bad one. `single`: `items` holds
    the one message `source` returned, named without an index (there is no list to index)."""
    if isinstance(items, str | bytes) or not isinstance(items, Sequence):
        raise TurnContractError(f"{source} must be a sequence of FrameworkMessage, got {type(items).__name__}")
    out: list[FrameworkMessage] = []
    for index, given in enumerate(items):
        where = source if single else f"{source}[{index}]"
        if not isinstance(given, FrameworkMessage):
            raise TurnContractError(f"{where} is a {type(given).__name__}, not a FrameworkMessage")
        role: object = given.role
        item = given
        if type(role) is not MessageRole and isinstance(role, str) and role in _ROLES:
            # A plain "assistant" is as good as the enum member (which needs no copy).
            item = dataclasses.replace(given, role=MessageRole(role))
        if not isinstance(item.role, MessageRole):
            raise TurnContractError(
                f"{where} has role {shown(item.role)}; use MessageRole.USER, ASSISTANT or TOOL"
            )
        if not isinstance(item.framework_item, str):
            raise TurnContractError(
                f"{where}.framework_item is a {type(item.framework_item).__name__}, not JSON text (str)"
            )
        for name in _MESSAGE_TEXT_FIELDS:
            value = getattr(item, name)
            if value is None:
                continue
            if not isinstance(value, str):
                raise TurnContractError(
                    f"{where}.{name} must be text (str) or None, not {type(value).__name__}"
                )
            problem = text_problem(value)
            if problem is not None:
                raise TurnContractError(f"{where}.{name} is {problem}")
        out.append(item)
    return out


def to_agent_message(item: FrameworkMessage, sequence: int, turn_id: str, created_at: str) -> AgentMessage:
    return AgentMessage(
        sequence=sequence, turn_id=turn_id, role=item.role, text=item.text, tool_call_id=item.tool_call_id,
        tool_name=item.tool_name, tool_arguments=item.tool_arguments, tool_output=item.tool_output,
        framework_item=item.framework_item, created_at=created_at,
    )


def check_tool_call_id(tool_call_id: object, seen: set[str], earlier: Collection[str] = ()) -> str:
    """A tool call ID the session can key by, or TurnContractError saying why not. `earlier`: the
    IDs of the turn's earlier model calls, among `seen`."""
    if not isinstance(tool_call_id, str):
        # A provider's numeric ID passed on as it came: "is empty" would send the author looking
        # for a missing value.
        raise TurnContractError(
            f"tool call ID {shown(tool_call_id)} ({type(tool_call_id).__name__}) is not text; pass it as a str"
        )
    if not tool_call_id:
        raise TurnContractError(f"tool call ID {tool_call_id!r} is empty; every tool call needs a non-empty ID")
    problem = text_problem(tool_call_id)
    if problem is not None:
        raise TurnContractError(f"tool call ID {tool_call_id!r} is {problem}")
    if "/" in tool_call_id:
        raise TurnContractError(
            f"tool call ID {tool_call_id!r} contains '/'; IDs join the idempotency key <flow>/<turn>/<id>"
        )
    if len(tool_call_id) > MAX_TOOL_CALL_ID_LENGTH:
        raise TurnContractError(
            f"tool call ID {tool_call_id[:40]!r}... is {len(tool_call_id)} characters, over {MAX_TOOL_CALL_ID_LENGTH}"
        )
    if not tool_call_id.isprintable():
        raise TurnContractError(f"tool call ID {tool_call_id!r} contains control characters")
    if tool_call_id in earlier:
        # Most often a provider that numbers each response's calls afresh (call_0, call_1, ...):
        # every adapter of one meets this at the turn's second response with tools, so say how to fix it.
        raise TurnContractError(
            f"tool call ID {tool_call_id!r} repeats within this turn: an earlier model call of the turn used it; "
            "IDs must be unique per turn, so make IDs a provider numbers per response (call_0, call_1, ...) "
            "unique, e.g. by prefixing len(turn.tool_calls)"
        )
    if tool_call_id in seen:
        raise TurnContractError(f"tool call ID {tool_call_id!r} repeats within this turn; IDs must be unique per turn")
    seen.add(tool_call_id)
    return tool_call_id


def _refuse_constant(constant: str) -> float:
    raise ValueError(constant)


# NaN and Infinity are not JSON. One decoder for every call: json.loads with an option builds one each time.
_STRICT_JSON = json.JSONDecoder(parse_constant=_refuse_constant)


def arguments_error(arguments: object) -> str | None:
    """None when `arguments` is strict JSON object text; else why not (NaN and Infinity are not JSON)."""
    if not isinstance(arguments, str):
        return ARGUMENTS_NOT_OBJECT
    problem = text_problem(arguments)
    if problem is not None:
        return f"arguments are {problem}"
    try:
        # A leading byte order mark, which json.loads refuses by name, fails here too (ValueError).
        value = _STRICT_JSON.decode(arguments)
    except ValueError:
        return ARGUMENTS_NOT_OBJECT
    except RecursionError:
        return ARGUMENTS_TOO_DEEP
    if not isinstance(value, dict):
        return ARGUMENTS_NOT_OBJECT
    return None


def ending_tries(
    unfinished: Sequence[FrameworkMessage],
    note: FrameworkMessage | None,
    cut_notes: Iterable[FrameworkMessage | None],
    *,
    note_instead: bool = False,
) -> Iterator[list[FrameworkMessage]]:
    """What a turn's end tries to store, best first, until one fits the value limit: the unfinished
    messages and the note, the note alone, both again with each cut of the note in turn (`cut_notes`,
    each cut more than the last, built only when reached; None or a repeat is skipped), the
    unfinished messages alone, nothing. The note comes before the unfinished messages: it is what
    keeps the next turn from repeating a write.

    With `note_instead` (a steered or cancelled turn, whose note stands in for the runner's
    messages, never beside them): the unfinished messages, else the note, else each cut note, else
    nothing."""
    if note_instead:
        yield [*unfinished]
        if note is not None and unfinished:
            yield [note]
            for cut in _new_cuts(note, cut_notes):
                yield [cut]
        if unfinished:
            yield []
        return
    yield [*unfinished, *([note] if note is not None else [])]
    if note is not None:
        if unfinished:
            yield [note]
        for cut in _new_cuts(note, cut_notes):
            yield [*unfinished, cut]
            if unfinished:
                yield [cut]
        if unfinished:
            yield [*unfinished]
    if unfinished or note is not None:
        yield []


def _new_cuts(note: FrameworkMessage, cut_notes: Iterable[FrameworkMessage | None]) -> Iterator[FrameworkMessage]:
    """The cuts of `note` that differ from it and from the cut before (a note too short to cut)."""
    last = note
    for cut in cut_notes:
        if cut is not None and cut != last:
            yield cut
            last = cut


def storable_text(text: str) -> str:
    """`text` with any lone surrogate escaped (as `\\ud800`), so that it can be stored."""
    return text if text_problem(text) is None else _escaped(text)


def _escaped(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode()


def storable_arguments(arguments: object) -> str:
    """What a record stores as a call's arguments: the text, escaped by storable_text (the call
    then fails on arguments_error), or the repr of arguments that are not text."""
    return storable_text(arguments) if isinstance(arguments, str) else shown(arguments, MAX_STORED_TOOL_ERROR_CHARS)


def storable_outcome(record: AgentToolCall) -> AgentToolCall:
    """A final record whose texts from the tool (output, error, rejection message) can be stored: a
    lone surrogate in them is escaped rather than failing the commit on every retry (and a write
    that ran must not become outcome_unknown for it)."""
    texts = {name: getattr(record, name) for name in ("output", "error", "rejection_message")}
    escaped = {name: _escaped(t) for name, t in texts.items() if isinstance(t, str) and text_problem(t)}
    return msgspec.structs.replace(record, **escaped) if escaped else record


def tool_step_for(effect: ToolEffect) -> str:
    """CallTool for calls that may run again, CallSingleAttemptTool for every other write."""
    return CALL_TOOL if effect in REPEATABLE_EFFECTS else CALL_SINGLE_ATTEMPT_TOOL


def deferred_call_of(record: AgentToolCall) -> DeferredToolCall:
    """The DeferredToolCall a stored record stands for (its policy as resolved when it was planned)."""
    return DeferredToolCall(
        tool_call_id=record.tool_call_id, tool_name=record.tool_name, arguments=record.arguments,
        policy=ToolPolicy(record.effect, record.requires_approval),
        tool_source_reference=record.tool_source_reference,
    )


def tool_step_overrides(step: str, chosen: object) -> tuple[RetryPolicy | None, float | None]:
    """The retry policy and the timeout in seconds that `chosen` (what a runner's
    tool_call_step_options returned) gives a call's tool `step`: (None, None) keeps the Step's own.

    Raises ValueError naming a value that is not usable. A retry policy applies to CallTool only.
    """
    if chosen is None:
        return None, None
    if inspect.isawaitable(chosen):
        if inspect.iscoroutine(chosen):
            chosen.close()  # never awaited: closed so Python does not warn about it
        raise ValueError(
            "tool_call_step_options returned an awaitable; it must be a plain method (not async def) "
            "that returns ToolCallStepOptions or None"
        )
    if not isinstance(chosen, ToolCallStepOptions):
        raise ValueError(
            f"tool_call_step_options returned {shown(chosen)}, which is not a ToolCallStepOptions or None"
        )
    timeout, retry = chosen.timeout, chosen.retry
    if timeout is not None and not (isinstance(timeout, timedelta) and timedelta(0) < timeout <= LONGEST_TIMER):
        raise ValueError(f"ToolCallStepOptions.timeout must be a positive timedelta of at most {LONGEST_TIMER.days} "
                         f"days (the engine's longest method timeout) or None, got {shown(timeout)}")
    if retry is not None and not isinstance(retry, RetryPolicy):
        raise ValueError(f"ToolCallStepOptions.retry must be a dex_engine.RetryPolicy or None, got {shown(retry)}")
    return (retry if step == CALL_TOOL else None), (None if timeout is None else timeout.total_seconds())


@dataclass(frozen=True)
class PlannedCall:
    record: AgentToolCall
    next_step: str | None  # None: final in RunModel's commit, no Step runs it
    timer_reason: str | None = None  # durable_wait: the reason its timer_started event shows
    plan: AgentPlan | None = None  # write_todos that succeeded: the plan it writes


@dataclass(frozen=True)
class ToolCallPlan:
    calls: tuple[PlannedCall, ...]
    interrupts: tuple[AgentInterrupt, ...]

    @property
    def plan(self) -> AgentPlan | None:
        """The plan a write_todos call of this response writes (at most one call can succeed)."""
        return next((c.plan for c in self.calls if c.plan is not None), None)


def plan_tool_calls(
    tool_calls: object,
    *,
    turn_id: str,
    existing: Mapping[str, AgentToolCall],
    now: datetime,
    interrupt_deadline: timedelta | None,
    trace_context: str | None,
    built_in_tools: frozenset[str] = frozenset(),
    max_durable_wait: timedelta = DEFAULT_MAX_DURABLE_WAIT,
    interaction_mode: InteractionMode = InteractionMode.CHAT,
    current_plan: AgentPlan | None = None,
) -> ToolCallPlan:
    """Records, interrupts and next Steps for one response's tool calls (in model order).

    Raises TurnContractError for what fails the turn: no calls, a bad ID, a call that is not a
    DeferredToolCall. Arguments that are not a JSON object, or a blank tool name, fail only that
    call, at once. A planning
    turn rejects every call but write_todos; write_todos settles here against `current_plan`.
    """
    if isinstance(tool_calls, str | bytes) or not isinstance(tool_calls, Sequence) or not tool_calls:
        raise TurnContractError("ToolCallsRequested.tool_calls must be a non-empty sequence of DeferredToolCall")
    seen = {r.tool_call_id for r in existing.values() if r.turn_id == turn_id}
    earlier = frozenset(seen)
    first_order = len(seen)
    deadline = None if interrupt_deadline is None else format_time(now + interrupt_deadline)
    calls: list[PlannedCall] = []
    interrupts: list[AgentInterrupt] = []
    write_todos_calls = count_write_todos_calls(tool_calls, WRITE_TODOS in built_in_tools)
    for index, call in enumerate(tool_calls):
        if not isinstance(call, DeferredToolCall):
            raise TurnContractError(f"tool_calls[{index}] is a {type(call).__name__}, not a DeferredToolCall")
        call_id = check_tool_call_id(call.tool_call_id, seen, earlier)
        if not isinstance(call.tool_name, str):
            raise TurnContractError(
                f"tool call {call_id!r} has tool_name {call.tool_name!r:.{SHOWN_VALUE_CHARS}}; it must be text")
        name_problem = text_problem(call.tool_name)
        if name_problem is not None:
            raise TurnContractError(f"tool call {call_id!r} has a tool name that is {name_problem}")
        if not isinstance(call.policy, ToolPolicy):
            raise TurnContractError(
                f"tool call {call_id!r} has policy {call.policy!r}; use turn.resolve_tool_policy(name)"
            )
        reference = call.tool_source_reference
        if reference is not None and (not isinstance(reference, str) or text_problem(reference) is not None):
            raise TurnContractError(f"tool call {call_id!r} has a tool_source_reference that is not UTF-8 text")
        if interaction_mode is InteractionMode.PLANNING and not (
            call.tool_name == WRITE_TODOS and WRITE_TODOS in built_in_tools
        ):
            calls.append(PlannedCall(rejected_in_planning_turn(AgentToolCall(
                tool_call_id=call_id, turn_id=turn_id, tool_name=call.tool_name,
                arguments=storable_arguments(call.arguments),
                effect=call.policy.effect, requires_approval=is_approval_required(call.policy),
                status=AgentToolCallStatus.APPROVED, output=None, error=None, rejection_message=None,
                deferral_order=first_order + index, tool_source_reference=reference, trace_context=trace_context,
            )), None))
            continue
        usable_text = isinstance(call.arguments, str) and text_problem(call.arguments) is None
        if call.tool_name in built_in_tools and usable_text:
            planned, interrupt = _built_in_call(
                call, call_id, turn_id, first_order + index, trace_context, now, deadline, max_durable_wait,
                plan_context=(current_plan, interaction_mode, write_todos_calls > 1),
            )
            calls.append(planned)
            if interrupt is not None:
                interrupts.append(interrupt)
            continue
        # A model's call with a blank name fails alone, as bad arguments do: its other calls still run.
        bad_arguments = TOOL_NAME_MISSING if not call.tool_name.strip() else arguments_error(call.arguments)
        arguments = storable_arguments(call.arguments)
        approval = is_approval_required(call.policy)
        if bad_arguments is not None:
            status = AgentToolCallStatus.FAILED
        elif approval:
            status = AgentToolCallStatus.AWAITING_APPROVAL
        else:
            status = AgentToolCallStatus.APPROVED
        record = AgentToolCall(
            tool_call_id=call_id, turn_id=turn_id, tool_name=call.tool_name, arguments=arguments,
            effect=call.policy.effect, requires_approval=is_approval_required(call.policy), status=status,
            output=None, error=bad_arguments, rejection_message=None, deferral_order=first_order + index,
            tool_source_reference=reference, trace_context=trace_context,
        )
        if bad_arguments is not None:
            calls.append(PlannedCall(record, None))
            continue
        if approval:
            interrupts.append(AgentInterrupt(
                interrupt_id=call_id, kind=InterruptKind.TOOL_APPROVAL, tool_call_id=call_id,
                tool_name=call.tool_name, arguments=arguments, created_at=format_time(now), deadline=deadline,
            ))
            calls.append(PlannedCall(record, AWAIT_TOOL_APPROVAL))
        else:
            calls.append(PlannedCall(record, tool_step_for(call.policy.effect)))
    return ToolCallPlan(tuple(calls), tuple(interrupts))


def _built_in_call(
    call: DeferredToolCall,
    call_id: str,
    turn_id: str,
    order: int,
    trace_context: str | None,
    now: datetime,
    deadline: str | None,
    max_durable_wait: timedelta,
    *,
    plan_context: tuple[AgentPlan | None, InteractionMode, bool],
) -> tuple[PlannedCall, AgentInterrupt | None]:
    """A built-in call: routed to its own Step with no approval and the read effect, or failed now."""
    record = AgentToolCall(
        tool_call_id=call_id, turn_id=turn_id, tool_name=call.tool_name, arguments=call.arguments,
        effect=ToolEffect.READ, requires_approval=False, status=AgentToolCallStatus.APPROVED, output=None,
        error=None, rejection_message=None, deferral_order=order, tool_source_reference=None,
        trace_context=trace_context,
    )
    if call.tool_name == BuiltInTool.WRITE_TODOS:
        # Settled in RunModel's own commit: no Step runs it (plan_context: current plan, mode, repeated).
        current_plan, mode, repeated = plan_context
        outcome = settle_write_todos(record, current_plan=current_plan, mode=mode, now=now,
                                     called_more_than_once=repeated)
        return PlannedCall(outcome.record, None, plan=outcome.plan), None
    try:
        if call.tool_name == BuiltInTool.ASK_USER:
            asked = parse_ask_user(call.arguments)
            interrupt = AgentInterrupt(
                interrupt_id=call_id, kind=InterruptKind.QUESTION, tool_call_id=call_id, tool_name=call.tool_name,
                arguments=call.arguments, created_at=format_time(now), deadline=deadline, question=asked.question,
                choices=list(asked.choices), allows_free_text=asked.allows_free_text,
            )
            waiting = msgspec.structs.replace(record, status=AgentToolCallStatus.AWAITING_ANSWER)
            return PlannedCall(waiting, AWAIT_QUESTION_ANSWER), interrupt
        wait = parse_durable_wait(call.arguments, max_durable_wait)
        waiting = msgspec.structs.replace(
            record, status=AgentToolCallStatus.WAITING_FOR_TIMER,
            wait_until=format_time(now + timedelta(seconds=wait.duration_seconds)),
        )
        return PlannedCall(waiting, AWAIT_TIMER, timer_reason=wait.reason), None
    except BuiltInArgumentsError as exc:
        return PlannedCall(finished(record, AgentToolCallStatus.FAILED, error=str(exc)), None), None


def storable_rejection_message(message: str | None) -> str | None:
    """`message`, cut to MAX_REJECTION_MESSAGE_CHARS with a note saying so when longer. A message
    that already is such a cut stays as it is: AgentSessionClient cuts before sending, so that a
    reason over the engine's value limit still fits in its request, and the RPC cuts again."""
    if message is None or is_cut_text(message, MAX_REJECTION_MESSAGE_CHARS):
        return message
    return cut_text(message, MAX_REJECTION_MESSAGE_CHARS)


def finished(
    record: AgentToolCall,
    status: AgentToolCallStatus,
    *,
    output: str | None = None,
    error: str | None = None,
    rejection_message: str | None = None,
) -> AgentToolCall:
    """The record made final with `status`."""
    if not status.is_final:
        raise ValueError(f"{status.value} is not a final status")
    return msgspec.structs.replace(
        record, status=status, output=output, error=error, rejection_message=rejection_message,
    )


def without_question(record: AgentToolCall) -> AgentToolCall:
    """The record with no pending tool question (its answers and continuation stay)."""
    return msgspec.structs.replace(record, input_question=None, input_choices=[], input_allows_free_text=True)


def smaller_records(record: AgentToolCall) -> Iterator[AgentToolCall]:
    """What a call's record tries to store instead when steering or cancel_turn grew it past the
    value limit, each smaller than the last: its arguments cut to CUT_NOTE_FIELD_CHARS, then also
    without its answers and, once final (never polled again), its continuation. They mark a call
    that takes no further effect (a rejection message, a reason, an error of ~100 bytes), and a
    call whose arguments or answers nearly fill the limit must still end, or the cancel never would."""
    cut = msgspec.structs.replace(record, arguments=cut_text(record.arguments, CUT_NOTE_FIELD_CHARS))
    yield cut
    continuation = None if record.status.is_final else record.input_continuation
    yield msgspec.structs.replace(cut, input_answers=[], input_continuation=continuation)


def recovered_status(
    record: AgentToolCall, *, attempt_progress: str, single_attempt: bool
) -> tuple[AgentToolCallStatus, bool]:
    """The status a failure route records, and whether the tool certainly never ran.

    NOT_STARTED on a record that is still approved, with no answers, means no attempt reached a
    Worker: `failed`, safe to call again. Otherwise reads fail and writes become outcome_unknown.
    """
    never_ran = (
        attempt_progress == "NOT_STARTED"
        and record.status is AgentToolCallStatus.APPROVED
        and not record.input_answers
    )
    if never_ran:
        return AgentToolCallStatus.FAILED, True
    if not single_attempt and record.effect is ToolEffect.READ:
        return AgentToolCallStatus.FAILED, False
    return AgentToolCallStatus.OUTCOME_UNKNOWN, False


def not_run_error(detail: str) -> str:
    return f"{TOOL_CALL_NOT_RUN_ERROR_PREFIX}: {detail}"


def deadline_timer_seconds(deadline: datetime, now: datetime) -> int:
    """Whole seconds until `deadline`, rounded up (engine Timers take whole seconds); 0 when past;
    at most the engine's longest Timer.

    A deadline or wait_until of up to LONGEST_TIMER was written with the clock of the Worker that
    ran RunModel (or raised the question). Read by a Worker whose clock is behind (another host, or
    NTP stepping the clock back), it is further away than that: the Timer would be refused, and the
    WaitFor with it on every retry until the Step, and the session, failed. The longest Timer fires
    at most that skew early, and the approval and question Steps then wait again.
    """
    remaining = (deadline - now).total_seconds()
    return min(int(LONGEST_TIMER.total_seconds()), max(0, math.ceil(remaining)))


def without_interrupt(
    interrupts: Iterable[AgentInterrupt], interrupt_id: str
) -> tuple[list[AgentInterrupt], AgentInterrupt | None]:
    """The interrupts without `interrupt_id`, and the removed one (None when it was not pending)."""
    kept: list[AgentInterrupt] = []
    removed: AgentInterrupt | None = None
    for interrupt in interrupts:
        if removed is None and interrupt.interrupt_id == interrupt_id:
            removed = interrupt
        else:
            kept.append(interrupt)
    return kept, removed
