"""ask_user and durable_wait: routed by the session, answered through RPCs, timed by durable Timers."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from agents.tests.built_context import runtime_of, step_context, tool_call
from agents.tests.builtin_agent import InProcessEngine, lookup_order, scripted_flow

from dex_agents import (
    ARGUMENTS_NOT_TEXT,
    AWAIT_TIMER,
    TOOL_CALL_CANCELLATIONS,
    AgentEventType,
    AgentSessionClient,
    AgentSnapshot,
    AgentToolCallStatus,
    BuiltInTool,
    InterruptKind,
    MessageRole,
)
from dex_agents._builtin_steps import BuiltInSteps
from dex_agents._builtin_tools import (
    BUILT_IN_TOOL_DEFINITIONS,
    BuiltInArgumentsError,
    answered_output,
    parse_ask_user,
    parse_durable_wait,
    waited_output,
)
from dex_agents._constants import SHOWN_VALUE_CHARS
from dex_agents._timefmt import format_time
from dex_agents.builtin_loop import (
    AgentDefinition,
    ModelRequest,
    ScriptedModelClient,
    ScriptedModelReply,
    ScriptedToolCall,
)
from dex_agents.testing import executed_steps, to_step_history, wait_for_agent_snapshot, wait_until
from dex_engine import Timer, Wait
from dex_engine._records import WaitOutcome

BOTH = frozenset({BuiltInTool.ASK_USER, BuiltInTool.DURABLE_WAIT})


def calls_then_echo(name: str, arguments: dict[str, Any] | str) -> Callable[[ModelRequest], ScriptedModelReply]:
    """A model that calls one tool, then answers with the tool's output."""

    def respond(request: ModelRequest) -> ScriptedModelReply:
        results = ScriptedModelClient.tool_results(request)
        if results:
            return ScriptedModelReply(text=results[0].output)
        return ScriptedModelReply(tool_calls=[ScriptedToolCall(name, arguments)])

    return respond


async def _done(sessions: AgentSessionClient, sid: str = "s", turns: int = 1) -> AgentSnapshot:
    snapshot: AgentSnapshot = await wait_for_agent_snapshot(
        sessions, sid, lambda s: s if s.state is not None and s.state.turn_count >= turns else None,
        description="the turn to end")
    return snapshot


async def _question(sessions: AgentSessionClient, sid: str = "s") -> Any:
    return await wait_for_agent_snapshot(
        sessions, sid, lambda s: next((i for i in s.pending_interrupts if i.kind is InterruptKind.QUESTION), None),
        description="a pending question")


async def test_ask_user_answer_is_the_tool_result(tmp_path: Path) -> None:
    """RunModel -> AwaitQuestionAnswer -> ResumeTurn -> RunModel; refused answers change nothing."""
    flow, model = scripted_flow(calls_then_echo("ask_user", {"question": "Colour?", "choices": ["red", "blue"],
                                                             "allows_free_text": False}), built_in_tools=BOTH)
    engine = InProcessEngine(tmp_path, [flow])
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s", "ask me")
        question = await _question(sessions)
        assert (question.question, question.choices, question.allows_free_text) == ("Colour?", ["red", "blue"], False)
        assert {t.name for t in model.requests[0].tools} >= {"ask_user", "durable_wait"}
        assert not await sessions.answer_question("s", question.interrupt_id, "green")  # not a choice
        assert not await sessions.answer_question("s", question.interrupt_id, "   ")  # blank
        assert not await sessions.answer_question("s", "nope", "red")  # unknown
        assert not await sessions.resolve_interrupt("s", question.interrupt_id, approved=True)  # questions are answered
        assert await sessions.answer_question("s", question.interrupt_id, "blue")
        assert not await sessions.answer_question("s", question.interrupt_id, "red")  # a second answer
        done = await _done(sessions)
        assert json.loads(done.messages[-1].text or "") == {"status": "answered", "answer": "blue"}
        steps = executed_steps(to_step_history(await engine.client.get_flow_history("s")))
        assert steps == ["StartAgentSession", "RunModel", "AwaitQuestionAnswer", "ResumeTurn", "RunModel"]
        events = [e.value.type for e in (await sessions.read_agent_events("s")).events]
        assert AgentEventType.INTERRUPT_RAISED in events and AgentEventType.INTERRUPT_RESOLVED in events


@pytest.mark.parametrize(("message", "expected"), [(None, "The user declined to answer."), ("not now", "not now")])
async def test_declined_question_is_rejected(tmp_path: Path, message: str | None, expected: str) -> None:
    """resolve_interrupt(approved=False) declines a question; the model sees the decline text."""
    flow, _ = scripted_flow(calls_then_echo("ask_user", {"question": "Name?"}), built_in_tools=BOTH)
    engine = InProcessEngine(tmp_path, [flow])
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s", "ask")
        question = await _question(sessions)
        assert await sessions.resolve_interrupt("s", question.interrupt_id, approved=False, rejection_message=message)
        done = await _done(sessions)
        assert done.messages[-1].text == expected


async def test_question_deadline_rejects_and_refuses_late_answers(tmp_path: Path) -> None:
    """Past interrupt_deadline the question is rejected with `question deadline passed`."""
    flow, _ = scripted_flow(calls_then_echo("ask_user", {"question": "Quick?"}), built_in_tools=BOTH,
                            interrupt_deadline=timedelta(seconds=1))
    engine = InProcessEngine(tmp_path, [flow])
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s", "ask")
        done = await _done(sessions)
        assert done.messages[-1].text == "question deadline passed"
        assert done.pending_interrupts == []


async def test_durable_wait_completes_on_its_timer(tmp_path: Path) -> None:
    """durable_wait records waiting_for_timer, writes timer_started, and completes in AwaitTimer."""
    flow, _ = scripted_flow(calls_then_echo("durable_wait", {"duration_seconds": 1, "reason": "cool down"}),
                            built_in_tools=BOTH)
    engine = InProcessEngine(tmp_path, [flow])
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s", "wait")
        done = await _done(sessions)
        assert json.loads(done.messages[-1].text or "") == {"status": "completed", "waited_seconds": 1,
                                                            "reason": "cool down"}
        steps = executed_steps(to_step_history(await engine.client.get_flow_history("s")))
        assert steps == ["StartAgentSession", "RunModel", "AwaitTimer", "ResumeTurn", "RunModel"]
        timer = [json.loads(e.value.payload) for e in (await sessions.read_agent_events("s")).events
                 if e.value.type == "timer_started"]
        assert len(timer) == 1 and timer[0]["reason"] == "cool down" and timer[0]["wait_until"].endswith("Z")


async def test_skip_timer_ends_a_long_wait(tmp_path: Path) -> None:
    """The Timer is the authority: skipping it completes an hour-long wait now."""
    flow, _ = scripted_flow(calls_then_echo("durable_wait", {"duration_seconds": 3600, "reason": "later"}),
                            built_in_tools=BOTH)
    engine = InProcessEngine(tmp_path, [flow])
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s", "wait")
        waiting = await wait_for_agent_snapshot(
            sessions, "s", lambda s: s.tool_calls[0] if s.tool_calls and s.tool_calls[0].wait_until else None,
            description="the wait")
        assert waiting.status.value == "waiting_for_timer"

        async def registered_timer() -> Any:
            info = await engine.client.describe_flow("s")
            return next((a for a in info.active_steps if a.step_type == "AwaitTimer" and a.timer_due_at_ms), None)

        timer_step = await wait_until("the wait's Timer", registered_timer)
        await engine.client.skip_timer("s", timer_step.step_execution_id)
        done = await _done(sessions)
        assert json.loads(done.messages[-1].text or "")["status"] == "completed"


@pytest.mark.parametrize(("name", "arguments", "error"), [
    ("ask_user", {"question": ""}, "invalid ask_user arguments: question must be non-empty text"),
    ("ask_user", {"question": "Q", "zeta": 1, "alpha": 2}, "invalid ask_user arguments: unknown argument 'alpha'"),
    ("ask_user", {"question": "Q", "choices": [], "allows_free_text": False},
     "invalid ask_user arguments: a question without choices must allow free text"),
    ("ask_user", {"question": "Q", "choices": ["a", "a"]}, "invalid ask_user arguments: choices repeat"),
    ("durable_wait", {"duration_seconds": 0, "reason": "r"},
     "invalid durable_wait arguments: duration_seconds must be a whole number from 1 to 31622400, got 0"),
    ("durable_wait", {"duration_seconds": 2.5, "reason": "r"},
     "invalid durable_wait arguments: duration_seconds must be a whole number from 1 to 31622400, got 2.5"),
    ("durable_wait", {"duration_seconds": 5}, "invalid durable_wait arguments: reason must be text"),
    ("durable_wait", "[1]", "arguments must be a JSON object"),
    # Strict JSON whose escape decodes to half a UTF-16 pair: no stored question or reason holds it.
    ("ask_user", r'{"question": "a\ud800b"}', ARGUMENTS_NOT_TEXT),
    ("durable_wait", r'{"duration_seconds": 5, "reason": "\uDC00"}', ARGUMENTS_NOT_TEXT),
])
async def test_invalid_built_in_arguments_fail_at_once(
    tmp_path: Path, name: str, arguments: dict[str, Any] | str, error: str
) -> None:
    """Invalid built-in arguments record failed in RunModel's commit; the model sees the reason."""
    flow, _ = scripted_flow(calls_then_echo(name, arguments), built_in_tools=BOTH,
                            max_durable_wait=timedelta(days=366))
    engine = InProcessEngine(tmp_path, [flow])
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s", "go")
        done = await _done(sessions)
        assert done.messages[-1].role is MessageRole.ASSISTANT
        assert done.messages[-1].text == f"The tool call failed: {error}"
        steps = executed_steps(to_step_history(await engine.client.get_flow_history("s")))
        assert steps == ["StartAgentSession", "RunModel", "ResumeTurn", "RunModel"]


def test_argument_parsers() -> None:
    """null means absent for optional arguments; whole-number floats are whole seconds; the limit is inclusive."""
    assert parse_ask_user('{"question": "Q", "choices": null, "allows_free_text": null}').allows_free_text
    assert parse_durable_wait('{"duration_seconds": 60.0, "reason": ""}', timedelta(minutes=1)).duration_seconds == 60
    with pytest.raises(BuiltInArgumentsError, match="from 1 to 60, got 61"):
        parse_durable_wait('{"duration_seconds": 61, "reason": ""}', timedelta(minutes=1))
    with pytest.raises(BuiltInArgumentsError, match="arguments must be a JSON object"):
        parse_ask_user('{"question": NaN}')
    deep = '{"question": ' + "[" * 100_000 + "]" * 100_000 + "}"  # past the JSON decoder's recursion
    with pytest.raises(BuiltInArgumentsError, match=r"^arguments are nested too deeply to read as JSON$"):
        parse_ask_user(deep)



@pytest.mark.parametrize(("arguments", "error"), [
    ('{"question": "  "}', "question must be non-empty text"),
    ('{"question": "Q", "choices": "yes"}', "choices must be a list of non-empty texts"),
    ('{"question": "Q", "choices": {"yes": 1}}', "choices must be a list of non-empty texts"),
    ('{"question": "Q", "choices": ["yes", " "]}', "choices must be a list of non-empty texts"),
    ('{"question": "Q", "allows_free_text": "yes"}', "allows_free_text must be true or false"),
])
def test_ask_user_refuses_blank_texts_and_choices_that_are_not_a_list(arguments: str, error: str) -> None:
    """A blank question or choice would show the user nothing to answer, and choices given as text or
    an object would be offered one character or key each: each is refused for the model to fix."""
    with pytest.raises(BuiltInArgumentsError, match=f"^invalid ask_user arguments: {error}$"):
        parse_ask_user(arguments)


def test_durable_wait_refuses_true_and_a_wait_past_a_fractional_limit() -> None:
    """JSON true is no number of seconds, though Python counts it as the int 1; a max_durable_wait
    of 60.7 seconds takes whole waits up to 60, never 61 (which would wait past the limit)."""
    with pytest.raises(BuiltInArgumentsError, match=r"from 1 to 60, got True$"):
        parse_durable_wait('{"duration_seconds": true, "reason": ""}', timedelta(minutes=1))
    fractional = timedelta(seconds=60.7)
    assert parse_durable_wait('{"duration_seconds": 60, "reason": ""}', fractional).duration_seconds == 60
    with pytest.raises(BuiltInArgumentsError, match=r"from 1 to 60, got 61$"):
        parse_durable_wait('{"duration_seconds": 61, "reason": ""}', fractional)


def test_an_unknown_argument_is_named_cut_to_a_short_text() -> None:
    """A model may invent a huge argument name: the error names it cut, not the whole name."""
    with pytest.raises(BuiltInArgumentsError) as raised:
        parse_ask_user(json.dumps({"question": "Q", "x" * 100_000: 1}))
    shown = repr("x" * 100_000)[:SHOWN_VALUE_CHARS]
    assert str(raised.value) == f"invalid ask_user arguments: unknown argument {shown}"


def test_built_in_results_are_the_seeds_compact_json_with_text_as_written() -> None:
    """Seed 003: the model sees {"status":"answered","answer":"<text>"} and
    {"status":"completed","waited_seconds":<n>,"reason":"<reason>"}: compact, text not escaped."""
    assert answered_output("Zoë 🙂") == '{"status":"answered","answer":"Zoë 🙂"}'
    assert waited_output(5, "Köln") == '{"status":"completed","waited_seconds":5,"reason":"Köln"}'


@pytest.mark.parametrize(("tool", "allowed", "required"), [
    (BuiltInTool.ASK_USER, {"question", "choices", "allows_free_text"}, ["question"]),
    (BuiltInTool.DURABLE_WAIT, {"duration_seconds", "reason"}, ["duration_seconds", "reason"]),
])
def test_built_in_schemas_offer_what_the_parsers_take(
    tool: BuiltInTool, allowed: set[str], required: list[str]
) -> None:
    """The schema the model is offered names the arguments the parser takes, requires the ones it
    refuses to miss, and for durable_wait starts at its 1 second: a model following the schema is
    never refused."""
    schema = BUILT_IN_TOOL_DEFINITIONS[tool].parameters_schema
    assert BUILT_IN_TOOL_DEFINITIONS[tool].name == tool.value
    assert set(schema["properties"]) == allowed
    assert schema["required"] == required
    assert schema["additionalProperties"] is False
    if tool is BuiltInTool.DURABLE_WAIT:
        assert schema["properties"]["duration_seconds"]["minimum"] == 1

def test_enabled_built_in_name_is_reserved() -> None:
    """A function tool may not use the name of an enabled built-in tool; a disabled one is ordinary."""
    from dex_agents.builtin_loop import function_tool

    @function_tool
    async def ask_user(question: str) -> str:
        """A tool that clashes with the built-in."""
        return question

    model = ScriptedModelClient(lambda r: ScriptedModelReply(text="x"))
    with pytest.raises(ValueError, match="tool ask_user uses the name of an enabled built-in tool"):
        AgentDefinition(name="a", instructions="", model=model, tools=[ask_user], built_in_tools=BOTH)
    AgentDefinition(name="a", instructions="", model=model, tools=[ask_user, lookup_order])


@pytest.mark.parametrize("case", ["record_gone", "record_final", "no_wait_until"])
async def test_await_timer_of_a_call_no_longer_waiting_skips_and_writes_nothing(case: str) -> None:
    """A durable_wait whose call is no longer waiting_for_timer (recorded final, e.g. cancelled, or
    its record gone), or has no wait_until to time: the WaitFor skips rather than start a Timer, and
    Execute of a call no longer waiting ends with nothing written, so it is never recorded twice."""
    flow, _ = scripted_flow(calls_then_echo("durable_wait", {"duration_seconds": 60, "reason": "r"}),
                            built_in_tools=BOTH)
    built_ins = BuiltInSteps(runtime_of(flow))
    wait_until = format_time(datetime.now(UTC) + timedelta(seconds=60))
    records = {
        "record_gone": None,
        "record_final": tool_call(AgentToolCallStatus.REJECTED, tool_name="durable_wait", wait_until=wait_until),
        "no_wait_until": tool_call(AgentToolCallStatus.WAITING_FOR_TIMER, tool_name="durable_wait"),
    }
    record = records[case]
    values = {} if record is None else {("AgentToolCalls", "c1"): record}
    waiting = await built_ins.await_timer_wait(step_context(flow, AWAIT_TIMER, values), "c1")
    assert waiting == Wait.skip_immediately()
    if case == "no_wait_until":
        return
    fired = Wait.any_of(Timer.by_duration(60), TOOL_CALL_CANCELLATIONS["c1"].for_one())
    ctx = step_context(flow, AWAIT_TIMER, values, (fired, WaitOutcome(satisfied=(0,), consumed=((), ()),
                                                                       fired_timers=(0,))))
    decision = await built_ins.await_timer(ctx, "c1")
    assert decision.kind == "dead_end"
    assert ctx.writes.empty()


async def test_questions_that_do_not_fit_in_pending_interrupts_fail_alone(tmp_path: Path) -> None:
    """One response asks four big questions; three fit in PendingInterrupts, the fourth is failed
    (never asked) with a note the model sees, and the turn goes on. Catches: RunModel's commit
    failing with ValueTooLargeError, so the model was called three times and the turn failed."""
    questions = [chr(ord("A") + n) * 150_000 for n in range(4)]

    def respond(request: ModelRequest) -> ScriptedModelReply:
        results = ScriptedModelClient.tool_results(request)
        if results:
            return ScriptedModelReply(text=" | ".join(r.output[:120] for r in results))
        return ScriptedModelReply(tool_calls=[ScriptedToolCall("ask_user", {"question": q}) for q in questions])

    flow, model = scripted_flow(respond, built_in_tools=BOTH)
    engine = InProcessEngine(tmp_path, [flow])
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s", "ask me four things")
        asked = await wait_for_agent_snapshot(
            sessions, "s", lambda s: s.pending_interrupts if len(s.pending_interrupts) == 3 else None,
            description="three questions pending")
        assert [i.question[:1] for i in asked if i.question] == ["A", "B", "C"]
        for interrupt in asked:
            assert await sessions.answer_question("s", interrupt.interrupt_id, "yes")
        done = await _done(sessions)
        assert done.state is not None and done.state.last_turn_error is None
        assert len(model.requests) == 2
        last = done.messages[-1].text or ""
        assert last.count('{"status":"answered","answer":"yes"}') == 3, last
        assert "The tool call failed: its question does not fit with the turn's other pending interrupts" in last
