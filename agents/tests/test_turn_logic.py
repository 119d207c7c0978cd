"""The pure turn decisions (_turn_logic.py) and policies (_policy.py), checked against seeds 002 and 003.

No engine here: each rule is a function of its inputs, so the tests enumerate the inputs.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dex_agents._constants import (
    ARGUMENTS_NOT_OBJECT,
    AWAIT_TOOL_APPROVAL,
    CALL_SINGLE_ATTEMPT_TOOL,
    CALL_TOOL,
    CUT_NOTE_FIELD_CHARS,
    MAX_REJECTION_MESSAGE_CHARS,
    MAX_USAGE_COUNT,
    NEW_MESSAGES_WITHOUT_BUILDER,
    TOOL_CALL_NOT_RUN_ERROR_PREFIX,
    TOOL_NAME_MISSING,
)
from dex_agents._events import AgentEventWriter
from dex_agents._policy import (
    CANCELLED_NOTE_HEADER,
    OUTCOME_UNKNOWN_TEXT,
    STEERED_NOTE_HEADER,
    ToolPolicy,
    build_tool_call_note,
    build_turn_failure_note,
    describe_tool_call_outcome,
    error_message,
    is_approval_required,
    resolve_tool_policy,
)
from dex_agents._runner import (
    AgentTurnContext,
    DeferredToolCall,
    FrameworkMessage,
    ToolExecutionError,
    ToolOutcomeUnknownError,
    polls_tool_tasks,
)
from dex_agents._turn_logic import (
    MAX_TOOL_CALL_ID_LENGTH,
    TurnContractError,
    arguments_error,
    check_framework_messages,
    deadline_timer_seconds,
    ended_turn,
    ending_tries,
    finished,
    initial_state,
    next_turn_id,
    not_run_error,
    plan_tool_calls,
    recovered_status,
    smaller_records,
    started_turn,
    storable_outcome,
    storable_rejection_message,
    text_problem,
    to_agent_message,
    tool_step_for,
    turn_id_for,
    usage_problem,
    without_interrupt,
)
from dex_agents._wire import (
    AgentInterrupt,
    AgentMessage,
    AgentStatus,
    AgentToolCall,
    AgentToolCallStatus,
    AgentUsage,
    InteractionMode,
    InterruptKind,
    MessageRole,
    QuestionAnswer,
    ToolEffect,
)
from dex_engine import MAX_TIMER_SECONDS

NOW = datetime(2026, 11, 1, 12, 0, 0, 123000, tzinfo=UTC)
TURN = "turn-3"
TRACE = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
FINAL = [s for s in AgentToolCallStatus if s.is_final]
NON_FINAL = [s for s in AgentToolCallStatus if not s.is_final]


def call(
    tool_call_id: str = "c1",
    tool_name: str = "read_orders",
    arguments: Any = "{}",
    effect: ToolEffect = ToolEffect.READ,
    requires_approval: bool | None = None,
    reference: str | None = None,
) -> DeferredToolCall:
    return DeferredToolCall(tool_call_id, tool_name, arguments, ToolPolicy(effect, requires_approval), reference)


def record(
    tool_call_id: str = "c1",
    *,
    turn_id: str = TURN,
    tool_name: str = "read_orders",
    arguments: str = "{}",
    effect: ToolEffect = ToolEffect.READ,
    status: AgentToolCallStatus = AgentToolCallStatus.APPROVED,
    output: str | None = None,
    error: str | None = None,
    rejection_message: str | None = None,
    deferral_order: int = 0,
    input_answers: list[QuestionAnswer] | None = None,
) -> AgentToolCall:
    return AgentToolCall(
        tool_call_id=tool_call_id, turn_id=turn_id, tool_name=tool_name, arguments=arguments, effect=effect,
        requires_approval=False, status=status, output=output, error=error, rejection_message=rejection_message,
        deferral_order=deferral_order, tool_source_reference=None, trace_context=None,
        input_answers=input_answers or [],
    )


def plan(
    calls: Any,
    existing: dict[str, AgentToolCall] | None = None,
    deadline: timedelta | None = None,
) -> Any:
    return plan_tool_calls(
        calls, turn_id=TURN, existing=existing or {}, now=NOW, interrupt_deadline=deadline, trace_context=TRACE,
    )


# plan_tool_calls: Steps and approval ----------------------------------------------------------

# Seed 003 "Effects and policies": the Step of each effect, and its default approval.
EFFECT_TABLE = {
    ToolEffect.READ: (CALL_TOOL, False),
    ToolEffect.IDEMPOTENT_WRITE: (CALL_TOOL, False),
    ToolEffect.NON_IDEMPOTENT_WRITE: (CALL_SINGLE_ATTEMPT_TOOL, True),
    ToolEffect.UNCLASSIFIED: (CALL_SINGLE_ATTEMPT_TOOL, True),
}


@pytest.mark.parametrize("effect", list(ToolEffect))
@pytest.mark.parametrize("requires_approval", [None, True, False])
def test_plan_routes_each_effect_and_approval(effect: ToolEffect, requires_approval: bool | None) -> None:
    """Approval goes to AwaitToolApproval with an interrupt; else READ/IDEMPOTENT_WRITE -> CallTool, others single."""
    step, default_approval = EFFECT_TABLE[effect]
    approval = default_approval if requires_approval is None else requires_approval
    result = plan([call("c1", "tool", '{"a":1}', effect, requires_approval, reference="src/ref")])
    (planned,) = result.calls
    assert planned.next_step == (AWAIT_TOOL_APPROVAL if approval else step)
    assert planned.record == AgentToolCall(
        tool_call_id="c1", turn_id=TURN, tool_name="tool", arguments='{"a":1}', effect=effect,
        requires_approval=approval,
        status=AgentToolCallStatus.AWAITING_APPROVAL if approval else AgentToolCallStatus.APPROVED,
        output=None, error=None, rejection_message=None, deferral_order=0, tool_source_reference="src/ref",
        trace_context=TRACE,
    )
    if approval:
        assert result.interrupts == (AgentInterrupt(
            interrupt_id="c1", kind=InterruptKind.TOOL_APPROVAL, tool_call_id="c1", tool_name="tool",
            arguments='{"a":1}', created_at="2026-11-01T12:00:00.123Z", deadline=None,
        ),)
    else:
        assert result.interrupts == ()


def test_approval_interrupt_carries_created_at_and_deadline() -> None:
    """The interrupt's created_at is now and its deadline now + interrupt_deadline, both wire times."""
    result = plan([call("w1", "refund", "{}", ToolEffect.UNCLASSIFIED)], deadline=timedelta(minutes=5, seconds=1))
    (interrupt,) = result.interrupts
    assert interrupt.created_at == "2026-11-01T12:00:00.123Z"
    assert interrupt.deadline == "2026-11-01T12:05:01.123Z"
    assert (interrupt.question, interrupt.choices, interrupt.allows_free_text) == (None, [], True)


def test_mixed_response_keeps_model_order() -> None:
    """Each call gets its own Step and deferral_order in model order; only approval calls raise interrupts."""
    result = plan([
        call("r", "read_orders", "{}", ToolEffect.READ),
        call("w", "refund", "{}", ToolEffect.NON_IDEMPOTENT_WRITE),
        call("i", "tag", "{}", ToolEffect.IDEMPOTENT_WRITE),
        call("u", "mystery", "{}", ToolEffect.UNCLASSIFIED, requires_approval=False),
    ])
    assert [(p.record.tool_call_id, p.record.deferral_order, p.next_step) for p in result.calls] == [
        ("r", 0, CALL_TOOL), ("w", 1, AWAIT_TOOL_APPROVAL), ("i", 2, CALL_TOOL), ("u", 3, CALL_SINGLE_ATTEMPT_TOOL),
    ]
    assert [i.interrupt_id for i in result.interrupts] == ["w"]


# plan_tool_calls: IDs ------------------------------------------------------------------------


@pytest.mark.parametrize("bad_id", ["", "a/b", "/", "turn/3", None, 7])
def test_bad_tool_call_id_fails_the_turn(bad_id: Any) -> None:
    """IDs must be non-empty text without '/': a bad one is a TurnContractError naming it."""
    with pytest.raises(TurnContractError) as info:
        plan([call("ok"), call(bad_id)])
    assert repr(bad_id) in str(info.value)


def test_id_repeated_within_the_response_fails_the_turn() -> None:
    """Two calls of one response with the same ID: TurnContractError naming the ID."""
    with pytest.raises(TurnContractError, match=r"'c1' repeats"):
        plan([call("c1"), call("c2"), call("c1")])


def test_id_repeating_an_existing_record_of_the_turn_fails_the_turn() -> None:
    """An ID used by an earlier model call of the same turn is a repeat too."""
    with pytest.raises(TurnContractError, match=r"'c1' repeats"):
        plan([call("c9"), call("c1")], existing={"c1": record("c1")})


def test_ids_may_repeat_across_turns() -> None:
    """A record of another turn with the same ID is no conflict, and does not count toward deferral_order."""
    result = plan([call("c1")], existing={"c1": record("c1", turn_id="turn-2")})
    assert [(p.record.tool_call_id, p.record.deferral_order) for p in result.calls] == [("c1", 0)]


def test_deferral_order_continues_across_model_calls_of_a_turn() -> None:
    """The second model call's calls follow the first's in deferral_order."""
    existing = {
        "a": record("a", deferral_order=0, status=AgentToolCallStatus.SUCCEEDED),
        "b": record("b", deferral_order=1, status=AgentToolCallStatus.FAILED),
        "x": record("x", turn_id="turn-2", deferral_order=0),
    }
    result = plan([call("c"), call("d")], existing=existing)
    assert [(p.record.tool_call_id, p.record.deferral_order) for p in result.calls] == [("c", 2), ("d", 3)]


def test_id_length_and_control_characters_are_checked() -> None:
    """IDs become map and idempotency keys: longer than the limit, or with control characters, fail the turn."""
    plan([call("x" * MAX_TOOL_CALL_ID_LENGTH)])
    with pytest.raises(TurnContractError, match=str(MAX_TOOL_CALL_ID_LENGTH + 1)):
        plan([call("x" * (MAX_TOOL_CALL_ID_LENGTH + 1))])
    with pytest.raises(TurnContractError, match="control characters"):
        plan([call("a\nb")])


def test_the_tool_call_id_limit_is_the_engines_id_length() -> None:
    """A tool call ID becomes part of engine keys, which are at most 255 characters: 255 passes and 256
    fails the turn here. The test above reads MAX_TOOL_CALL_ID_LENGTH, so only this pins its value."""
    plan([call("x" * 255)])
    with pytest.raises(TurnContractError, match=r"is 256 characters, over 255$"):
        plan([call("x" * 256)])


# Hypothesis: any list of IDs from a small alphabet (so repeats are common), against existing records.
ids = st.text(alphabet="abc", min_size=1, max_size=2)


@settings(max_examples=60, deadline=None)
@given(
    new_ids=st.lists(ids, min_size=1, max_size=8),
    same_turn=st.lists(ids, max_size=4, unique=True),
    other_turn=st.lists(ids, max_size=4, unique=True),
)
def test_ids_unique_per_turn_and_deferral_order_property(
    new_ids: list[str], same_turn: list[str], other_turn: list[str]
) -> None:
    """Planning succeeds iff no ID repeats within the turn; then deferral_order counts on from the turn's records."""
    existing = {i: record(i, turn_id="turn-2") for i in other_turn}
    # Same-turn records win over other-turn ones under the same key, as the map holds one record per ID.
    existing.update({i: record(i, deferral_order=n) for n, i in enumerate(same_turn)})
    seen = set(same_turn)
    first_repeat = None
    for i in new_ids:
        if i in seen:
            first_repeat = i
            break
        seen.add(i)
    if first_repeat is not None:
        with pytest.raises(TurnContractError, match=f"'{first_repeat}' repeats"):
            plan([call(i) for i in new_ids], existing=existing)
        return
    result = plan([call(i) for i in new_ids], existing=existing)
    assert [p.record.tool_call_id for p in result.calls] == new_ids
    assert [p.record.deferral_order for p in result.calls] == list(range(len(same_turn), len(same_turn) + len(new_ids)))


# plan_tool_calls: arguments ------------------------------------------------------------------


@pytest.mark.parametrize("arguments", [
    "[1]", "nan", "NaN", '{"a": NaN}', '{"a": Infinity}', '{"a": -Infinity}', "not json", "", "null", "1", '"{}"',
    '{"a": 1} trailing', "{'a': 1}", "{",
])
@pytest.mark.parametrize("effect", [ToolEffect.READ, ToolEffect.UNCLASSIFIED])
def test_arguments_not_a_strict_json_object_fail_only_that_call(arguments: str, effect: ToolEffect) -> None:
    """The call is recorded failed with the seed text, runs no Step and raises no interrupt; others proceed."""
    result = plan([call("bad", "tool", arguments, effect), call("good", "tool", "{}", ToolEffect.READ)])
    bad, good = result.calls
    assert bad.next_step is None
    assert bad.record.status is AgentToolCallStatus.FAILED
    assert bad.record.error == ARGUMENTS_NOT_OBJECT == "arguments must be a JSON object"
    assert bad.record.arguments == arguments
    assert describe_tool_call_outcome(bad.record) == "The tool call failed: arguments must be a JSON object"
    assert result.interrupts == ()
    assert (good.next_step, good.record.status, good.record.deferral_order) == (
        CALL_TOOL, AgentToolCallStatus.APPROVED, 1)


@pytest.mark.parametrize("name", ["", "  "])
@pytest.mark.parametrize("effect", [ToolEffect.READ, ToolEffect.UNCLASSIFIED])
def test_a_blank_tool_name_fails_only_that_call(name: str, effect: ToolEffect) -> None:
    """A model's call naming no tool is recorded failed, without approval or a Step, for the model
    to see; the response's other calls proceed (it failed the whole turn before)."""
    bad, good = plan([call("bad", name, "{}", effect), call("good", "tool", "{}", ToolEffect.READ)]).calls
    assert (bad.next_step, bad.record.status, bad.record.error) == (
        None, AgentToolCallStatus.FAILED, TOOL_NAME_MISSING)
    assert describe_tool_call_outcome(bad.record) == "The tool call failed: the tool call names no tool"
    assert (good.next_step, good.record.status) == (CALL_TOOL, AgentToolCallStatus.APPROVED)


def test_non_text_arguments_fail_the_call() -> None:
    """Arguments that are not text at all fail the call; the record keeps their repr as text."""
    (planned,) = plan([call("c1", arguments={"a": 1})]).calls
    assert planned.record.status is AgentToolCallStatus.FAILED
    assert planned.record.error == ARGUMENTS_NOT_OBJECT
    assert planned.record.arguments == "{'a': 1}"


@pytest.mark.parametrize("arguments", ["{}", ' {"a": 1} ', '{"a":[1,2.5,null],"b":{"c":"\\u00e9"}}', '{"a":1e400}'])
def test_json_object_arguments_are_accepted(arguments: str) -> None:
    """Object text, whitespace and nesting included, passes unchanged."""
    assert arguments_error(arguments) is None
    (planned,) = plan([call("c1", arguments=arguments)]).calls
    assert planned.record.arguments == arguments and planned.next_step == CALL_TOOL


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3),
    max_leaves=10,
)


@settings(max_examples=60, deadline=None)
@given(value=json_values)
def test_arguments_error_accepts_exactly_json_objects(value: Any) -> None:
    """Any strict JSON text is accepted iff it is an object."""
    expected = None if isinstance(value, dict) else ARGUMENTS_NOT_OBJECT
    assert arguments_error(json.dumps(value)) == expected


# plan_tool_calls: other contract errors --------------------------------------------------------


@pytest.mark.parametrize("tool_calls", [[], (), "c1", b"c1", None, {"c1": 1}])
def test_no_tool_calls_fails_the_turn(tool_calls: Any) -> None:
    """ToolCallsRequested needs a non-empty sequence of calls."""
    with pytest.raises(TurnContractError, match="non-empty sequence"):
        plan(tool_calls)


def test_malformed_calls_fail_the_turn() -> None:
    """A non-DeferredToolCall, a tool name that is not text, a bad policy or a source reference that
    is not text, or not storable text, fail the turn."""
    with pytest.raises(TurnContractError, match=r"tool_calls\[1\] is a dict"):
        plan([call("a"), {"tool_call_id": "b"}])
    for no_name in (None, 5, b"t"):
        with pytest.raises(TurnContractError, match=f"'c1' has tool_name {no_name!r}; it must be text"):
            plan([call("c1", tool_name=no_name)])
    bad_policy: Any = "read"
    with pytest.raises(TurnContractError, match="'c1' has policy 'read'"):
        plan([DeferredToolCall("c1", "t", "{}", bad_policy)])
    for bad_reference in (5, "src/\ud800"):  # not text; text that cannot be stored
        with pytest.raises(TurnContractError, match="'c1' has a tool_source_reference that is not UTF-8 text"):
            plan([DeferredToolCall("c1", "t", "{}", ToolPolicy(ToolEffect.READ), bad_reference)])


# recovered_status: exhaustive against the seed's failure-route rows --------------------------

# RecordToolFailure (the route of CallTool and of PollToolTask for repeatable effects): failed for a read,
# outcome_unknown for a write, which may have taken effect.
RECORD_TOOL_FAILURE_STATUS = {
    ToolEffect.READ: AgentToolCallStatus.FAILED,
    ToolEffect.IDEMPOTENT_WRITE: AgentToolCallStatus.OUTCOME_UNKNOWN,
    ToolEffect.NON_IDEMPOTENT_WRITE: AgentToolCallStatus.OUTCOME_UNKNOWN,
    ToolEffect.UNCLASSIFIED: AgentToolCallStatus.OUTCOME_UNKNOWN,
}
# RecordToolOutcomeUnknown (CallSingleAttemptTool's route, and CancelToolTask's for any effect): outcome_unknown.
RECORD_TOOL_OUTCOME_UNKNOWN_STATUS = dict.fromkeys(ToolEffect, AgentToolCallStatus.OUTCOME_UNKNOWN)
ANSWERS = [QuestionAnswer(interrupt_id="c1-input-1", question="Q?", answer="A")]


def expected_recovery(
    progress: str, status: AgentToolCallStatus, answered: bool, effect: ToolEffect, single_attempt: bool
) -> tuple[AgentToolCallStatus, bool]:
    # Known limits: NOT_STARTED on a record still approved with no input_answers never ran -> failed, not run.
    if progress == "NOT_STARTED" and status is AgentToolCallStatus.APPROVED and not answered:
        return AgentToolCallStatus.FAILED, True
    # NOT_COMPLETED, UNSPECIFIED, a started task, an asked question: the status of the call's effect.
    table = RECORD_TOOL_OUTCOME_UNKNOWN_STATUS if single_attempt else RECORD_TOOL_FAILURE_STATUS
    return table[effect], False


def test_recovered_status_table() -> None:
    """Every attempt_progress x record status x input_answers x effect x route gives the seed's status."""
    mismatches = []
    cases = itertools.product(
        ["NOT_STARTED", "NOT_COMPLETED", "UNSPECIFIED"], list(AgentToolCallStatus), [False, True], list(ToolEffect),
        [False, True],
    )
    count = 0
    for progress, status, answered, effect, single_attempt in cases:
        count += 1
        rec = record(effect=effect, status=status, input_answers=ANSWERS if answered else None)
        got = recovered_status(rec, attempt_progress=progress, single_attempt=single_attempt)
        want = expected_recovery(progress, status, answered, effect, single_attempt)
        if got != want:
            mismatches.append((progress, status.value, answered, effect.value, single_attempt, got, want))
    assert count == 3 * 9 * 2 * 4 * 2
    assert mismatches == []


def test_recovered_status_named_cases() -> None:
    """The seed's own examples, spelled out: a task or an asked question already ran the tool."""
    single_write = record(effect=ToolEffect.NON_IDEMPOTENT_WRITE)
    assert recovered_status(single_write, attempt_progress="NOT_STARTED", single_attempt=True) == (
        AgentToolCallStatus.FAILED, True)
    assert recovered_status(single_write, attempt_progress="NOT_COMPLETED", single_attempt=True) == (
        AgentToolCallStatus.OUTCOME_UNKNOWN, False)
    polling_read = record(effect=ToolEffect.READ, status=AgentToolCallStatus.WAITING_FOR_TASK)
    assert recovered_status(polling_read, attempt_progress="NOT_STARTED", single_attempt=False) == (
        AgentToolCallStatus.FAILED, False)
    polling_write = record(effect=ToolEffect.IDEMPOTENT_WRITE, status=AgentToolCallStatus.WAITING_FOR_TASK)
    assert recovered_status(polling_write, attempt_progress="NOT_STARTED", single_attempt=False) == (
        AgentToolCallStatus.OUTCOME_UNKNOWN, False)
    answered_write = record(effect=ToolEffect.UNCLASSIFIED, input_answers=ANSWERS)
    assert recovered_status(answered_write, attempt_progress="NOT_STARTED", single_attempt=True) == (
        AgentToolCallStatus.OUTCOME_UNKNOWN, False)


def test_not_run_error_uses_the_seed_prefix() -> None:
    """The never-ran error is TOOL_CALL_NOT_RUN_ERROR_PREFIX, ': ', then the recovery detail."""
    assert TOOL_CALL_NOT_RUN_ERROR_PREFIX == "the tool did not run, so it is safe to call again"
    assert not_run_error("no Worker took it") == (
        "the tool did not run, so it is safe to call again: no Worker took it")


# deadline_timer_seconds ---------------------------------------------------------------------


@pytest.mark.parametrize(("delta", "seconds"), [
    (timedelta(seconds=5), 5), (timedelta(seconds=5, microseconds=1), 6), (timedelta(microseconds=1), 1),
    (timedelta(milliseconds=999), 1), (timedelta(0), 0), (timedelta(microseconds=-1), 0), (timedelta(seconds=-90), 0),
    (timedelta(days=1, milliseconds=500), 86_401), (timedelta(seconds=MAX_TIMER_SECONDS), MAX_TIMER_SECONDS),
    # Past the longest Timer only when read with a clock behind the writer's: that Timer fires early.
    (timedelta(days=400), MAX_TIMER_SECONDS),
])
def test_deadline_timer_seconds(delta: timedelta, seconds: int) -> None:
    """Whole seconds until the deadline, rounded up so the Timer never fires early; 0 once past."""
    assert deadline_timer_seconds(NOW + delta, NOW) == seconds


@settings(max_examples=100, deadline=None)
@given(micros=st.integers(min_value=-(10**12), max_value=10**12))
def test_deadline_timer_seconds_is_the_ceiling(micros: int) -> None:
    """For any gap, the Timer is the smallest whole second count that is not before the deadline."""
    gap = timedelta(microseconds=micros)
    result = deadline_timer_seconds(NOW + gap, NOW)
    if gap <= timedelta(0):
        assert result == 0
    else:
        assert timedelta(seconds=result) >= gap > timedelta(seconds=result - 1)


# without_interrupt ------------------------------------------------------------------------------


def _interrupt(interrupt_id: str) -> AgentInterrupt:
    return AgentInterrupt(interrupt_id=interrupt_id, kind=InterruptKind.TOOL_APPROVAL, tool_call_id=interrupt_id,
                          tool_name="t", arguments="{}", created_at="2026-11-01T12:00:00.123Z", deadline=None)


def test_without_interrupt_removes_the_first_match_and_keeps_order() -> None:
    """The named interrupt is removed and returned; the rest keep their order; the input is untouched."""
    pending = [_interrupt("a"), _interrupt("b"), _interrupt("c"), _interrupt("b")]
    kept, removed = without_interrupt(pending, "b")
    assert removed == _interrupt("b")
    assert [i.interrupt_id for i in kept] == ["a", "c", "b"]
    assert len(pending) == 4


def test_without_interrupt_reports_a_missing_interrupt() -> None:
    """An interrupt that is not pending comes back as None, with every interrupt kept."""
    kept, removed = without_interrupt(iter([_interrupt("a")]), "z")
    assert removed is None and [i.interrupt_id for i in kept] == ["a"]
    assert without_interrupt([], "a") == ([], None)


# check_framework_messages -------------------------------------------------------------------


def test_check_framework_messages_accepts_messages() -> None:
    """A list or tuple of FrameworkMessage with MessageRole roles and text items comes back as a list."""
    items = (FrameworkMessage(MessageRole.USER, "{}", text="hi"), FrameworkMessage(MessageRole.TOOL, '{"x":1}'))
    assert check_framework_messages(items, "new_messages") == list(items)
    assert check_framework_messages([], "new_messages") == []


@pytest.mark.parametrize(("items", "message"), [
    ("text", "new_messages must be a sequence of FrameworkMessage, got str"),
    (b"x", "got bytes"),
    (None, "got NoneType"),
    ({"role": "user"}, "got dict"),
    ([FrameworkMessage(MessageRole.USER, "{}"), "hi"], r"new_messages\[1\] is a str, not a FrameworkMessage"),
    ([FrameworkMessage("system", "{}")], r"new_messages\[0\] has role 'system'"),  # type: ignore[arg-type]
    ([FrameworkMessage(MessageRole.ASSISTANT, {"x": 1})],  # type: ignore[arg-type]
     r"new_messages\[0\]\.framework_item is a dict, not JSON text"),
])
def test_check_framework_messages_names_the_bad_item(items: Any, message: str) -> None:
    """Anything else is a TurnContractError naming the source and the first bad item."""
    with pytest.raises(TurnContractError, match=message):
        check_framework_messages(items, "new_messages")


@pytest.mark.parametrize("field", ["text", "tool_call_id", "tool_name", "tool_arguments", "tool_output"])
def test_check_framework_messages_checks_each_text_field_after_unset_ones(field: str) -> None:
    """Every optional text field is checked, whichever of the others are unset (None): the last one
    set, after several unset, is as likely to hold a value that cannot be stored as the first."""
    bad = FrameworkMessage(MessageRole.TOOL, "{}", **{field: "x\ud800"})  # type: ignore[arg-type]
    with pytest.raises(TurnContractError, match=rf"new_messages\[0\]\.{field} is not valid UTF-8 text"):
        check_framework_messages([bad], "new_messages")
    wrong_type = FrameworkMessage(MessageRole.TOOL, "{}", **{field: 7})  # type: ignore[arg-type]
    with pytest.raises(TurnContractError, match=rf"new_messages\[0\]\.{field} must be text \(str\) or None, not int"):
        check_framework_messages([wrong_type], "new_messages")


# Turn state and records ---------------------------------------------------------------------


def test_turn_ids_and_state_transitions() -> None:
    """Turn IDs are turn-<n> from turn_count; a session starts at sequence 1; an ended turn is counted and cleared."""
    state = initial_state()
    assert (state.status, state.turn_count, state.active_turn_id, state.next_message_sequence,
            state.last_turn_error) == (AgentStatus.WAITING_FOR_USER_MESSAGE, 0, None, 1, None)
    assert turn_id_for(4) == "turn-4" and next_turn_id(state) == "turn-1"
    running = started_turn(state, "turn-1", InteractionMode.PLANNING)
    assert (running.status, running.active_turn_id, running.interaction_mode) == (
        AgentStatus.RUNNING_MODEL, "turn-1", InteractionMode.PLANNING)
    failed = ended_turn(msgspec.structs.replace(running, accepts_turn_control=True), error="boom")
    assert (failed.status, failed.turn_count, failed.active_turn_id, failed.last_turn_error,
            failed.accepts_turn_control) == (AgentStatus.WAITING_FOR_USER_MESSAGE, 1, None, "boom", False)
    assert failed.interaction_mode is InteractionMode.PLANNING  # "of the active or last turn"
    assert next_turn_id(failed) == "turn-2"
    assert ended_turn(failed, error=None).last_turn_error is None  # a completed turn clears the error


def test_to_agent_message_copies_the_projection() -> None:
    """A FrameworkMessage becomes an AgentMessage with its sequence, turn and time, every field copied."""
    item = FrameworkMessage(MessageRole.TOOL, '{"k":1}', text="t", tool_call_id="c1", tool_name="n",
                            tool_arguments="{}", tool_output="o")
    assert to_agent_message(item, 7, TURN, "2026-11-01T12:00:00.123Z") == AgentMessage(
        sequence=7, turn_id=TURN, role=MessageRole.TOOL, text="t", tool_call_id="c1", tool_name="n",
        tool_arguments="{}", tool_output="o", framework_item='{"k":1}', created_at="2026-11-01T12:00:00.123Z")


@pytest.mark.parametrize("status", FINAL)
def test_finished_sets_the_final_fields(status: AgentToolCallStatus) -> None:
    """finished() sets status, output, error and rejection_message and keeps everything else."""
    base = record("c1", status=AgentToolCallStatus.APPROVED, deferral_order=3, output="stale")
    done = finished(base, status, error="e", rejection_message="r")
    assert done == msgspec.structs.replace(base, status=status, output=None, error="e", rejection_message="r")


@pytest.mark.parametrize("status", NON_FINAL)
def test_finished_refuses_non_final_statuses(status: AgentToolCallStatus) -> None:
    """A non-final status cannot finish a record."""
    with pytest.raises(ValueError, match=f"{status.value} is not a final status"):
        finished(record(), status)


# _policy.py ----------------------------------------------------------------------------------


@pytest.mark.parametrize("effect", list(ToolEffect))
def test_effect_table_default_approval_and_step(effect: ToolEffect) -> None:
    """Seed 003 "Effects and policies": default approval and Step per effect; an explicit choice wins."""
    step, default_approval = EFFECT_TABLE[effect]
    assert tool_step_for(effect) == step
    assert is_approval_required(ToolPolicy(effect)) is default_approval
    assert is_approval_required(ToolPolicy(effect, requires_approval=True)) is True
    assert is_approval_required(ToolPolicy(effect, requires_approval=False)) is False


def test_resolve_tool_policy_precedence() -> None:
    """An explicit ToolPolicy wins over framework metadata, which wins over the session's default effect."""
    explicit = ToolPolicy(ToolEffect.NON_IDEMPOTENT_WRITE, requires_approval=False)
    policies = {"refund": explicit}
    assert resolve_tool_policy("refund", policies, ToolEffect.UNCLASSIFIED, ToolEffect.READ) is explicit
    assert resolve_tool_policy("lookup", policies, ToolEffect.UNCLASSIFIED, ToolEffect.READ) == ToolPolicy(
        ToolEffect.READ, None)
    assert resolve_tool_policy("lookup", policies, ToolEffect.IDEMPOTENT_WRITE) == ToolPolicy(
        ToolEffect.IDEMPOTENT_WRITE, None)
    assert resolve_tool_policy("lookup", {}, ToolEffect.UNCLASSIFIED, None) == ToolPolicy(ToolEffect.UNCLASSIFIED)


def test_new_messages_without_a_builder_text_is_the_seed_text() -> None:
    """RunModel's last_turn_error for new_messages without build_unfinished_turn_messages, from seed 002."""
    assert NEW_MESSAGES_WITHOUT_BUILDER == (
        "a runner that sets ToolCallsRequested.new_messages must implement build_unfinished_turn_messages"
    )


async def _no_heartbeat() -> None:
    return None


@pytest.mark.parametrize("run_state", [None, "{}"])
def test_a_turn_context_is_resuming_with_run_state_and_names_missing_records(run_state: str | None) -> None:
    """AgentTurnContext.is_resuming: the turn has framework_run_state (seed 003); recorded_tool_call
    returns a record, or raises KeyError naming the turn, the ID and the recorded IDs."""
    stored = record("c1", status=AgentToolCallStatus.SUCCEEDED)
    writer = AgentEventWriter(lambda _event: None, "turn-1", "RunModel-1", 1)
    turn = AgentTurnContext(
        flow_id="s", turn_id="turn-1", attempt=1, messages=[], framework_run_state=run_state,
        tool_calls={"c1": stored}, events=writer, heartbeat=_no_heartbeat, tool_policies={},
        default_tool_effect=ToolEffect.UNCLASSIFIED,
    )
    assert turn.is_resuming is (run_state is not None)
    assert turn.recorded_tool_call("c1") is stored
    with pytest.raises(KeyError, match=r"turn 'turn-1' has no tool call record 'c9'; recorded: \['c1'\]"):
        turn.recorded_tool_call("c9")


def test_outcome_unknown_text_is_the_seed_text() -> None:
    """The outcome_unknown text, copied from seed 002 "Model-visible results"."""
    assert OUTCOME_UNKNOWN_TEXT == (
        "The tool call's outcome is unknown: it stopped without returning a result, so it may or may not have "
        "taken effect. It will not be retried automatically."
    )


CANCELLED_BY_USER = '{"status":"cancelled","reason":"turn_cancelled_by_user"}'


@pytest.mark.parametrize(("rec", "text"), [
    (record(status=AgentToolCallStatus.SUCCEEDED, output='{"orders":3}'), '{"orders":3}'),
    (record(status=AgentToolCallStatus.SUCCEEDED, output=""), ""),
    (record(status=AgentToolCallStatus.SUCCEEDED), ""),
    (record(status=AgentToolCallStatus.FAILED), "The tool call failed: "),
    (record(status=AgentToolCallStatus.FAILED, error="db down"), "The tool call failed: db down"),
    (record(status=AgentToolCallStatus.REJECTED, rejection_message="not today"), "not today"),
    (record(status=AgentToolCallStatus.REJECTED), "The user rejected this tool call."),
    (record(status=AgentToolCallStatus.REJECTED, rejection_message=CANCELLED_BY_USER), CANCELLED_BY_USER),
    (record(status=AgentToolCallStatus.OUTCOME_UNKNOWN, error="worker died"),
     "The tool call's outcome is unknown: it stopped without returning a result, so it may or may not have taken "
     "effect. It will not be retried automatically."),
])
def test_describe_tool_call_outcome(rec: AgentToolCall, text: str) -> None:
    """Each final status's model-visible result is the seed's exact text."""
    assert describe_tool_call_outcome(rec) == text


@pytest.mark.parametrize("status", NON_FINAL)
def test_describe_refuses_non_final_records(status: AgentToolCallStatus) -> None:
    """Only final records have a model-visible result; the error names the call and its status."""
    with pytest.raises(ValueError, match=f"'c7' is {status.value}, not final"):
        describe_tool_call_outcome(record("c7", status=status))


NOTE_RECORDS = [
    record("w", tool_name="refund", arguments='{"order":7}', effect=ToolEffect.UNCLASSIFIED,
           status=AgentToolCallStatus.OUTCOME_UNKNOWN, deferral_order=2),
    record("p", tool_name="tag", status=AgentToolCallStatus.AWAITING_APPROVAL, deferral_order=1),
    record("r", tool_name="read_orders", arguments='{"id":1}', status=AgentToolCallStatus.SUCCEEDED,
           output="3 orders", deferral_order=0),
    record("x", tool_name="delete", status=AgentToolCallStatus.REJECTED, deferral_order=4),
    record("f", tool_name="lookup", status=AgentToolCallStatus.FAILED, error="timeout", deferral_order=3),
    record("t", tool_name="poll", status=AgentToolCallStatus.WAITING_FOR_TASK, deferral_order=5),
]
EXPECTED_NOTE = (
    "[Dex] The previous turn failed after these tool calls ran:\n"
    '- read_orders {"id":1} -> succeeded: 3 orders\n'
    '- refund {"order":7} -> outcome_unknown: The tool call\'s outcome is unknown: it stopped without returning a '
    "result, so it may or may not have taken effect. It will not be retried automatically.\n"
    "- lookup {} -> failed: The tool call failed: timeout\n"
    "- delete {} -> rejected: The user rejected this tool call.\n"
    "Do not repeat these tool calls unless the user asks again."
)


def test_turn_failure_note_exact_format() -> None:
    """One line per final record in deferral_order, between the seed's header and footer; non-final ones left out."""
    assert build_turn_failure_note(NOTE_RECORDS) == EXPECTED_NOTE


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(min_value=0, max_value=10**6))
def test_turn_failure_note_ignores_input_order(seed: int) -> None:
    """The note depends on deferral_order only, never on the order the records come in (map order)."""
    shuffled = list(NOTE_RECORDS)
    random.Random(seed).shuffle(shuffled)
    assert build_turn_failure_note(iter(shuffled)) == EXPECTED_NOTE


def test_turn_failure_note_is_none_without_final_records() -> None:
    """No final record means no tool call ran to an end: no note."""
    assert build_turn_failure_note([]) is None
    assert build_turn_failure_note([r for r in NOTE_RECORDS if not r.status.is_final]) is None


@pytest.mark.parametrize(("header", "first_line"), [
    (STEERED_NOTE_HEADER, "[Dex] The user steered the conversation after these tool calls ran:"),
    (CANCELLED_NOTE_HEADER, "[Dex] The user stopped the previous turn after these tool calls ran:"),
])
def test_steered_and_cancelled_notes_start_with_the_seed_lines(header: str, first_line: str) -> None:
    """Seed 002 gives the exact first lines of the steered and cancelled notes the model reads, in the
    turn-failure note's format. The steering and cancellation tests compare with the constants, so only
    this pins the texts."""
    failed_header = "[Dex] The previous turn failed after these tool calls ran:"
    assert build_tool_call_note(header, NOTE_RECORDS) == EXPECTED_NOTE.replace(failed_header, first_line)


def test_a_cut_note_keeps_each_field_up_to_its_limit_and_says_how_much_more_there_was() -> None:
    """field_chars cuts the arguments and the model-visible result of every line, each on its own;
    a field of exactly field_chars characters is kept whole. Header, statuses and footer stay."""
    record = NOTE_RECORDS[0]
    long_call = msgspec.structs.replace(record, arguments='{"q":"' + "a" * 20 + '"}', output="b" * 9,
                                        status=AgentToolCallStatus.SUCCEEDED, deferral_order=0)
    exact = msgspec.structs.replace(long_call, tool_call_id="other", arguments="{}", output="c" * 8, deferral_order=1)
    note = build_tool_call_note(STEERED_NOTE_HEADER, [exact, long_call], field_chars=8)
    assert note == "\n".join([
        STEERED_NOTE_HEADER,
        f"- {record.tool_name} {{\"q\":\"aa [Dex: cut from 28 characters] -> succeeded: "
        "bbbbbbbb [Dex: cut from 9 characters]",
        f"- {record.tool_name} {{}} -> succeeded: cccccccc",
        "Do not repeat these tool calls unless the user asks again.",
    ])
    assert build_tool_call_note(STEERED_NOTE_HEADER, [exact, long_call], field_chars=None) == \
        build_tool_call_note(STEERED_NOTE_HEADER, [exact, long_call])


def _user(text: str) -> FrameworkMessage:
    return FrameworkMessage(MessageRole.USER, "{}", text=text)


@pytest.mark.parametrize(("unfinished", "note", "cut", "expected"), [
    # The note comes first, whole, then cut; the unfinished messages alone only when no note fits.
    (["u1", "u2"], "note", "cut", [["u1", "u2", "note"], ["note"], ["u1", "u2", "cut"], ["cut"], ["u1", "u2"], []]),
    ([], "note", "cut", [["note"], ["cut"], []]),
    # A note that needs no cut, or a runner that cannot build the cut one: no try repeats.
    (["u1"], "note", "note", [["u1", "note"], ["note"], ["u1"], []]),
    (["u1"], "note", None, [["u1", "note"], ["note"], ["u1"], []]),
    (["u1"], None, None, [["u1"], []]),
    ([], None, None, [[]]),
])
def test_a_turns_ending_tries_the_note_before_the_unfinished_messages(
    unfinished: list[str], note: str | None, cut: str | None, expected: list[list[str]]
) -> None:
    tries = ending_tries([_user(t) for t in unfinished], None if note is None else _user(note),
                         [None if cut is None else _user(cut)])
    assert [[m.text for m in tried] for tried in tries] == expected


@pytest.mark.parametrize(("unfinished", "expected"), [
    # A steered or cancelled turn: the runner's messages, else its note, never both.
    (["u1", "u2"], [["u1", "u2"], ["note"], ["cut"], []]),
    ([], [[]]),
])
def test_a_controlled_turns_ending_tries_the_note_only_instead_of_the_runners_messages(
    unfinished: list[str], expected: list[list[str]]
) -> None:
    tries = ending_tries([_user(t) for t in unfinished], _user("note"), [_user("cut")], note_instead=True)
    assert [[m.text for m in tried] for tried in tries] == expected


def test_a_turns_ending_builds_each_cut_note_only_when_the_one_before_does_not_fit() -> None:
    asked: list[str] = []

    def cuts() -> Iterator[FrameworkMessage]:
        for name in ("cut", "tighter"):
            asked.append(name)
            yield _user(name)

    tries = ending_tries([_user("u")], _user("note"), cuts())
    assert [m.text for m in next(tries)] == ["u", "note"] and [m.text for m in next(tries)] == ["note"]
    assert asked == []
    assert [m.text for m in next(tries)] == ["u", "cut"] and asked == ["cut"]
    assert [m.text for m in next(tries)] == ["cut"] and asked == ["cut"]
    assert [m.text for m in next(tries)] == ["u", "tighter"] and asked == ["cut", "tighter"]


@pytest.mark.parametrize(("cuts", "expected"), [
    # Each tighter cut is tried, with and then without the unfinished messages, before giving up the note.
    (["cut", "tighter"], [["u", "note"], ["note"], ["u", "cut"], ["cut"], ["u", "tighter"], ["tighter"], ["u"], []]),
    # A cut that changes nothing (fields already short) is not tried twice.
    (["cut", "cut", None], [["u", "note"], ["note"], ["u", "cut"], ["cut"], ["u"], []]),
])
def test_a_turns_ending_tries_every_tighter_cut_of_the_note(cuts: list[str | None], expected: list[list[str]]) -> None:
    tries = ending_tries([_user("u")], _user("note"), [None if c is None else _user(c) for c in cuts])
    assert [[m.text for m in tried] for tried in tries] == expected
    controlled = ending_tries([_user("u")], _user("note"), [None if c is None else _user(c) for c in cuts],
                              note_instead=True)
    assert [[m.text for m in tried] for tried in controlled] == [
        ["u"], ["note"], *([c] for c in dict.fromkeys(c for c in cuts if c is not None)), []]


def test_check_framework_messages_accepts_a_plain_role_string() -> None:
    """A role given as the plain text "assistant" is read as MessageRole.ASSISTANT."""
    (item,) = check_framework_messages([FrameworkMessage("assistant", "{}")], "new_messages")  # type: ignore[arg-type]
    assert item.role is MessageRole.ASSISTANT


# Text that JSON (UTF-8) cannot hold -------------------------------------------------------------


@pytest.mark.parametrize("effect", [ToolEffect.READ, ToolEffect.NON_IDEMPOTENT_WRITE])
def test_arguments_with_a_lone_surrogate_fail_the_call_and_are_stored_escaped(effect: ToolEffect) -> None:
    """The call is final (failed, no Step, no approval), and its record holds the arguments with the
    surrogate escaped: storing them as given would fail RunModel's commit on every retry."""
    (planned,) = plan([call("c1", "tool", '{"q": "\ud800"}', effect)]).calls
    assert planned.next_step is None
    assert planned.record.status is AgentToolCallStatus.FAILED
    assert planned.record.error == "arguments are not valid UTF-8 text: '\\ud800' at position 7 is a lone surrogate"
    assert planned.record.arguments == '{"q": "\\ud800"}'
    planned.record.arguments.encode("utf-8")


def test_a_built_in_tool_with_a_lone_surrogate_fails_like_any_call() -> None:
    """ask_user arguments with a lone surrogate never reach the question parser or an interrupt."""
    result = plan_tool_calls(
        [call("c1", "ask_user", '{"question": "\udfff?"}', ToolEffect.READ)], turn_id=TURN, existing={}, now=NOW,
        interrupt_deadline=None, trace_context=TRACE, built_in_tools=frozenset({"ask_user"}),
    )
    (planned,) = result.calls
    assert (planned.next_step, planned.record.status, result.interrupts) == (None, AgentToolCallStatus.FAILED, ())
    assert "lone surrogate" in (planned.record.error or "")


@pytest.mark.parametrize("text, expected", [
    ("plain", None), ("emoji \U0001f600", None), ("", None),
    ("a\ud800", "not valid UTF-8 text: '\\ud800' at position 1 is a lone surrogate"),
])
def test_text_problem(text: str, expected: str | None) -> None:
    assert text_problem(text) == expected


def test_storable_outcome_escapes_only_what_cannot_be_stored() -> None:
    """A final record's output, error and rejection message come from the tool or the user; a lone
    surrogate in them is escaped, and a record without one is returned as it is."""
    fine = record("c1", status=AgentToolCallStatus.SUCCEEDED, output="ok \U0001f600")
    assert storable_outcome(fine) is fine
    odd = record("c1", status=AgentToolCallStatus.REJECTED, output="a\ud800", error="b\udfff",
                 rejection_message="c\ud83d")
    stored = storable_outcome(odd)
    assert (stored.output, stored.error, stored.rejection_message) == ("a\\ud800", "b\\udfff", "c\\ud83d")
    assert msgspec.json.encode(stored)


def test_arguments_that_are_not_text_are_stored_as_a_repr_that_never_raises_and_is_cut() -> None:
    """Catches: a runner's arguments object whose repr raises failing RunModel's commit three
    times (three paid model calls), and a huge one stored whole."""
    from dex_agents._constants import MAX_STORED_TOOL_ERROR_CHARS
    from dex_agents._turn_logic import storable_arguments

    class NoRepr:
        def __repr__(self) -> str:
            raise RuntimeError("no repr")

    assert storable_arguments(NoRepr()) == "(a NoRepr whose repr could not be made: RuntimeError)"
    assert storable_arguments(["x" * 10_000]) == repr(["x" * 10_000])[:MAX_STORED_TOOL_ERROR_CHARS]
    assert storable_arguments('{"a": 1}') == '{"a": 1}'


@pytest.mark.parametrize("field", AgentUsage.__struct_fields__)
def test_a_usage_count_of_exactly_the_largest_is_added_and_one_more_is_refused(field: str) -> None:
    """MAX_USAGE_COUNT is the largest count usage_problem lets into the session's totals."""
    assert usage_problem(AgentUsage(**{field: MAX_USAGE_COUNT})) is None
    assert usage_problem(AgentUsage(**{field: MAX_USAGE_COUNT + 1})) == (
        f"{field} must be a whole number from 0 to {MAX_USAGE_COUNT}, got {MAX_USAGE_COUNT + 1}")


@pytest.mark.parametrize("status", list(AgentToolCallStatus))
def test_smaller_records_drop_the_continuation_of_a_final_call_only(status: AgentToolCallStatus) -> None:
    """Each smaller record cuts the arguments; the smallest also drops the answers and, once the
    call is final (never polled again), its continuation, which a call still waiting needs."""
    answer = QuestionAnswer(interrupt_id="q1", question="Which?", answer="A")
    big = msgspec.structs.replace(
        record(arguments="a" * (CUT_NOTE_FIELD_CHARS + 1), status=status, input_answers=[answer]),
        input_continuation="k" * 100,
    )
    cut, smallest = list(smaller_records(big))
    assert cut == msgspec.structs.replace(big, arguments=f"{'a' * CUT_NOTE_FIELD_CHARS} [Dex: cut from "
                                                         f"{CUT_NOTE_FIELD_CHARS + 1} characters]")
    assert smallest == msgspec.structs.replace(
        cut, input_answers=[], input_continuation=None if status.is_final else big.input_continuation)


_LIMIT = "r" * MAX_REJECTION_MESSAGE_CHARS


@pytest.mark.parametrize("message", [
    # Only what cut_text makes of a longer message passes as already cut; a user's text that merely
    # looks like one is cut as any other, so no stored message runs past the limit and its note.
    f"{_LIMIT} [Dex: cut from {MAX_REJECTION_MESSAGE_CHARS} characters]",  # no message of the limit is cut
    f"{_LIMIT} [Dex: cut from 0{MAX_REJECTION_MESSAGE_CHARS + 1} characters]",  # cut_text writes no leading 0
    f"{_LIMIT} [Dex: cut from {MAX_REJECTION_MESSAGE_CHARS + 1} characters] and more",  # the note must end it
    f"{_LIMIT}r [Dex: cut from {MAX_REJECTION_MESSAGE_CHARS + 2} characters]",  # the note must start at the limit
])
def test_a_rejection_message_that_only_looks_cut_is_cut(message: str) -> None:
    assert storable_rejection_message(message) == (
        f"{message[:MAX_REJECTION_MESSAGE_CHARS]} [Dex: cut from {len(message)} characters]")


def test_a_rejection_message_already_cut_is_kept_as_it_is() -> None:
    """The client cuts before sending and the RPC cuts again: the second cut changes nothing."""
    once = storable_rejection_message(_LIMIT + "rr")
    assert once == f"{_LIMIT} [Dex: cut from {MAX_REJECTION_MESSAGE_CHARS + 2} characters]"
    assert storable_rejection_message(once) == once


@pytest.mark.parametrize("error_type", [ToolExecutionError, ToolOutcomeUnknownError])
def test_a_tool_errors_recorded_text_is_its_message_not_its_str(
    error_type: type[ToolExecutionError] | type[ToolOutcomeUnknownError],
) -> None:
    """The record keeps the message the tool gave, even from a subclass whose __str__ says more; a
    subclass that skipped super().__init__ has no message, and its own text stands in."""

    class Detailed(error_type):  # type: ignore[valid-type,misc]
        def __str__(self) -> str:
            return f"E42: {self.message}"

    class Bare(error_type):  # type: ignore[valid-type,misc]
        def __init__(self) -> None:  # no super().__init__: no message
            pass

        def __str__(self) -> str:
            return "bare failure"

    assert error_message(Detailed("out of stock")) == "out of stock"
    assert error_message(Bare()) == "bare failure"


@pytest.mark.parametrize("error_type", [ToolExecutionError, ToolOutcomeUnknownError])
def test_a_tool_errors_message_attribute_is_text_even_when_given_an_exception(
    error_type: type[ToolExecutionError] | type[ToolOutcomeUnknownError],
) -> None:
    """`message` is public and documented as kept as text: a runner that re-raises or logs the
    error reads the text of the exception it wrapped, not the exception object."""
    wrapped = ValueError("order 7 not found")
    assert error_type(wrapped).message == "order 7 not found"  # type: ignore[arg-type]


class _NoPolling:
    poll_tool_task = None  # a subclass that turns its base's polling off


class _Polls:
    async def poll_tool_task(self, poll: object) -> None:
        return None


class _PollsSomeCalls(_Polls):
    def _polls_tool_task_of(self, record: AgentToolCall) -> bool:
        return record.tool_name == "polled"


def test_polls_tool_tasks_asks_the_runner_and_per_call_only_for_a_record() -> None:
    """A poll_tool_task that is not callable is no poller; a runner that polls some calls only
    polls tasks, and for a record answers through _polls_tool_task_of."""
    polled, other = record(tool_name="polled"), record(tool_name="other")
    assert not polls_tool_tasks(_NoPolling()) and not polls_tool_tasks(_NoPolling(), polled)
    assert polls_tool_tasks(_Polls()) and polls_tool_tasks(_Polls(), other)
    assert polls_tool_tasks(_PollsSomeCalls())
    assert polls_tool_tasks(_PollsSomeCalls(), polled) and not polls_tool_tasks(_PollsSomeCalls(), other)
