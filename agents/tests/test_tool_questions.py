"""Tool questions: a tool returns ToolInputRequested, AwaitQuestionAnswer raises `<id>-input-<n>`,
and after the answer the same tool Step type runs the call again with the answers.

Most tests run an in-process Worker on a SQLite file (agents/tests/builtin_agent.py InProcessEngine)
with `AskingRunner`, a hand-written runner: the function tools of builtin_loop cannot ask yet. The
last tests call AwaitQuestionAnswer's handlers directly on built contexts, to pin down the races a
live Worker cannot be made to hit on purpose.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import msgspec
import pytest
from agents.tests.built_context import runtime_of, step_context, tool_call
from agents.tests.builtin_agent import InProcessEngine

from dex_agents import (
    AGENT_TOOL_CALLS,
    AWAIT_QUESTION_ANSWER,
    CALL_SINGLE_ATTEMPT_TOOL,
    CALL_TOOL,
    INTERRUPT_RESOLUTIONS,
    PENDING_INTERRUPTS,
    TOOL_CALL_CANCELLATIONS,
    TOOL_CALL_NOT_RUN_ERROR_PREFIX,
    AgentEvent,
    AgentInterrupt,
    AgentInterruptResolution,
    AgentSessionClient,
    AgentSessionFlow,
    AgentSessionOptions,
    AgentSnapshot,
    AgentToolCall,
    AgentToolCallStatus,
    AgentTurnContext,
    AgentTurnOutcome,
    DeferredToolCall,
    DeferredToolExecution,
    DeferredToolOutcome,
    FrameworkMessage,
    InterruptKind,
    MessageRole,
    QuestionAnswer,
    ToolCallsRequested,
    ToolCallStepOptions,
    ToolEffect,
    ToolExecutionResult,
    ToolInputRequested,
    ToolPolicy,
    TurnCompleted,
)
from dex_agents._builtin_steps import BuiltInSteps, tool_question_id_in_use
from dex_agents._timefmt import format_time
from dex_agents.testing import executed_steps, to_step_history, wait_for_agent_snapshot
from dex_engine import MAX_VALUE_BYTES, Context, StepDecision, Timer, Wait
from dex_engine._records import ConsumedMessage, WaitOutcome

FLOW_TYPE = "ToolQuestions"

POLICIES = {
    "ask_read": ToolPolicy(ToolEffect.READ),
    "ask_idempotent": ToolPolicy(ToolEffect.IDEMPOTENT_WRITE),
    "ask_write": ToolPolicy(ToolEffect.NON_IDEMPOTENT_WRITE, requires_approval=False),
    "guarded": ToolPolicy(ToolEffect.READ, requires_approval=True),
}


@dataclass(frozen=True)
class ToolRun:
    """One execute_deferred_tool_call, as the tool saw it."""

    tool_call_id: str
    answers: tuple[QuestionAnswer, ...]
    continuation: str | None


class AskingRunner:
    """A scripted model, and tools whose arguments say what they ask.

    The user message is `{"rounds": [[{"id", "tool", "args"}, ...], ...]}`: each round is one model
    response's tool calls; after the last round the model answers with the calls' outcomes as JSON
    (`{id: {status, output, error, rejection_message}}`), read from the turn's records.

    Tool arguments: `ask` (questions, asked one per run until each has an answer), `choices`, `free`
    (allows_free_text), `request` (a raw ToolInputRequested to return), `question_size` (ask one
    question of that many characters), `crash_after` (raise a Step failure once that many answers
    are in). The output lists the answers the tool saw.
    """

    def __init__(self) -> None:
        self.runs: list[ToolRun] = []

    def build_user_message(self, text: str) -> FrameworkMessage:
        return FrameworkMessage(role=MessageRole.USER, framework_item=json.dumps({"user": text}), text=text)

    async def run_model_step(self, turn: AgentTurnContext) -> AgentTurnOutcome:
        script = next(m for m in turn.messages if m.turn_id == turn.turn_id and m.role is MessageRole.USER)
        rounds = json.loads(script.text or "{}")["rounds"]
        done = -1 if turn.framework_run_state is None else int(turn.framework_run_state)
        if done + 1 < len(rounds):
            calls = [
                DeferredToolCall(c["id"], c["tool"], json.dumps(c.get("args", {})), turn.resolve_tool_policy(c["tool"]))
                for c in rounds[done + 1]
            ]
            return ToolCallsRequested(framework_run_state=str(done + 1), tool_calls=calls)
        outcomes = {
            r.tool_call_id: {"status": r.status.value, "output": r.output, "error": r.error,
                             "rejection_message": r.rejection_message}
            for r in turn.tool_calls.values()
        }
        return TurnCompleted([FrameworkMessage(role=MessageRole.ASSISTANT, framework_item="{}",
                                               text=json.dumps(outcomes))])

    async def execute_deferred_tool_call(self, call: DeferredToolExecution) -> DeferredToolOutcome:
        record = call.tool_call
        args = json.loads(record.arguments)
        answers = tuple(call.input_answers)
        self.runs.append(ToolRun(record.tool_call_id, answers, record.input_continuation))
        if "crash_after" in args and len(answers) >= args["crash_after"]:
            raise RuntimeError("the tool crashed after the answer")
        if "request" in args and not answers:
            return ToolInputRequested(**args["request"])
        if "question_size" in args and not answers:
            return ToolInputRequested(question="Q" * args["question_size"])
        asks: list[str] = args.get("ask", [])
        if len(answers) < len(asks):
            return ToolInputRequested(
                question=asks[len(answers)], choices=args.get("choices", []), allows_free_text=args.get("free", True),
                continuation=f"cont-{len(answers) + 1}",
            )
        return ToolExecutionResult(json.dumps({
            "answers": [[a.interrupt_id, a.question, a.answer] for a in answers],
            "continuation": record.input_continuation,
        }))

    def runs_of(self, tool_call_id: str) -> list[ToolRun]:
        return [r for r in self.runs if r.tool_call_id == tool_call_id]


def _flow(interrupt_deadline: timedelta | None = None) -> tuple[AgentSessionFlow, AskingRunner]:
    runner = AskingRunner()
    options = AgentSessionOptions(tool_policies=POLICIES, interrupt_deadline=interrupt_deadline)
    return AgentSessionFlow(runner, FLOW_TYPE, options), runner


def _script(*rounds: list[dict[str, Any]]) -> str:
    return json.dumps({"rounds": list(rounds)})


def _call(call_id: str, tool: str, **args: Any) -> dict[str, Any]:
    return {"id": call_id, "tool": tool, "args": args}


async def _done(sessions: AgentSessionClient) -> tuple[dict[str, Any], AgentSnapshot]:
    """The outcomes the model saw at the end of the first turn, and the snapshot then."""
    snapshot: AgentSnapshot = await wait_for_agent_snapshot(
        sessions, "s", lambda s: s if s.state is not None and s.state.turn_count >= 1 else None,
        description="the turn to end")
    outcomes: dict[str, Any] = json.loads(snapshot.messages[-1].text or "")
    return outcomes, snapshot


async def _pending(sessions: AgentSessionClient, *interrupt_ids: str) -> list[AgentInterrupt]:
    """Wait until exactly these interrupts are pending, together."""
    want = set(interrupt_ids)
    found: list[AgentInterrupt] = await wait_for_agent_snapshot(
        sessions, "s", lambda s: s.pending_interrupts if {i.interrupt_id for i in s.pending_interrupts} == want
        else None, description=f"pending interrupts {sorted(want)}")
    return found


async def _record(sessions: AgentSessionClient, tool_call_id: str, status: AgentToolCallStatus) -> AgentToolCall:
    found: AgentToolCall = await wait_for_agent_snapshot(
        sessions, "s", lambda s: next((r for r in s.tool_calls if r.tool_call_id == tool_call_id
                                       and r.status is status), None),
        description=f"tool call {tool_call_id} {status.value}")
    return found


async def _steps(engine: InProcessEngine) -> list[str]:
    return executed_steps(to_step_history(await engine.client.get_flow_history("s")))


async def _events(sessions: AgentSessionClient, event_type: str) -> list[tuple[AgentEvent, dict[str, Any]]]:
    read = await sessions.read_agent_events("s")
    return [(e.value, json.loads(e.value.payload)) for e in read.events if e.value.type == event_type]


# In-process sessions ---------------------------------------------------------------------------


async def test_answered_tool_question_runs_the_tool_again(tmp_path: Path) -> None:
    """A tool asks; AwaitQuestionAnswer raises `c1-input-1` (the tool Step never writes
    PendingInterrupts); the answer runs CallTool again with input_answers and input_continuation."""
    flow, runner = _flow()
    engine = InProcessEngine(tmp_path, [flow])
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s", _script(
            [_call("c1", "ask_read", ask=["Colour?"], choices=["red", "blue"], free=False)]))
        [question] = await _pending(sessions, "c1-input-1")
        assert (question.kind, question.tool_call_id, question.tool_name) == (InterruptKind.QUESTION, "c1", "ask_read")
        assert (question.question, question.choices, question.allows_free_text) == ("Colour?", ["red", "blue"], False)
        assert question.deadline is None
        waiting = await _record(sessions, "c1", AgentToolCallStatus.AWAITING_ANSWER)
        assert (waiting.input_question, waiting.input_choices, waiting.input_allows_free_text) == (
            "Colour?", ["red", "blue"], False)
        assert (waiting.input_continuation, waiting.input_answers) == ("cont-1", [])
        assert not await sessions.answer_question("s", "c1", "blue")  # the call's own ID is not the question's
        assert not await sessions.answer_question("s", "c1-input-1", "green")  # not a choice
        assert await sessions.answer_question("s", "c1-input-1", "blue")
        outcomes, snapshot = await _done(sessions)
        assert outcomes["c1"]["status"] == "succeeded"
        assert json.loads(outcomes["c1"]["output"]) == {
            "answers": [["c1-input-1", "Colour?", "blue"]], "continuation": "cont-1"}
        assert snapshot.pending_interrupts == []
        assert runner.runs_of("c1") == [
            ToolRun("c1", (), None),
            ToolRun("c1", (QuestionAnswer("c1-input-1", "Colour?", "blue"),), "cont-1"),
        ]
        # AwaitQuestionAnswer runs twice: once to raise the question (then it waits again), once for the answer.
        assert await _steps(engine) == [
            "StartAgentSession", "RunModel", "CallTool", "AwaitQuestionAnswer", "AwaitQuestionAnswer", "CallTool",
            "ResumeTurn", "RunModel",
        ]
        [(raised_event, raised)] = await _events(sessions, "interrupt_raised")
        assert raised_event.step_execution_id.startswith(AWAIT_QUESTION_ANSWER)
        assert raised == {"interrupt_id": "c1-input-1", "tool_call_id": "c1", "tool_name": "ask_read",
                          "deadline": None, "kind": "question", "question": "Colour?", "choices": ["red", "blue"],
                          "allows_free_text": False}
        [(_, resolved)] = await _events(sessions, "interrupt_resolved")
        assert resolved == {"interrupt_id": "c1-input-1", "approved": True, "rejection_message": None,
                            "kind": "question", "answered": True, "cancellation_reason": None}
        assert len(await _events(sessions, "tool_call_started")) == 2


async def test_two_questions_in_a_row_get_input_1_and_input_2(tmp_path: Path) -> None:
    """The n-th question of a call is `<id>-input-<n>`; a late answer to the first one is refused."""
    flow, runner = _flow()
    engine = InProcessEngine(tmp_path, [flow])
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s", _script([_call("c1", "ask_write", ask=["First?", "Second?"])]))
        await _pending(sessions, "c1-input-1")
        assert await sessions.answer_question("s", "c1-input-1", "one")
        [second] = await _pending(sessions, "c1-input-2")
        assert second.question == "Second?"
        assert not await sessions.answer_question("s", "c1-input-1", "again")
        assert await sessions.answer_question("s", "c1-input-2", "two")
        outcomes, _ = await _done(sessions)
        assert json.loads(outcomes["c1"]["output"]) == {
            "answers": [["c1-input-1", "First?", "one"], ["c1-input-2", "Second?", "two"]], "continuation": "cont-2"}
        assert [(len(r.answers), r.continuation) for r in runner.runs_of("c1")] == [(0, None), (1, "cont-1"),
                                                                                    (2, "cont-2")]
        # A non_idempotent_write goes back to CallSingleAttemptTool after each answer.
        assert (await _steps(engine)).count("CallSingleAttemptTool") == 3


@pytest.mark.parametrize(("message", "expected"), [(None, "The user declined to answer."), ("no thanks", "no thanks")])
async def test_declined_tool_question_rejects_the_call(tmp_path: Path, message: str | None, expected: str) -> None:
    """resolve_interrupt(approved=False) declines: rejected with the message, and the tool never runs again."""
    flow, runner = _flow()
    engine = InProcessEngine(tmp_path, [flow])
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s", _script([_call("c1", "ask_write", ask=["Sure?"])]))
        await _pending(sessions, "c1-input-1")
        assert await sessions.resolve_interrupt("s", "c1-input-1", approved=False, rejection_message=message)
        outcomes, _ = await _done(sessions)
        assert (outcomes["c1"]["status"], outcomes["c1"]["rejection_message"]) == ("rejected", expected)
        assert len(runner.runs_of("c1")) == 1
        [(_, resolved)] = await _events(sessions, "interrupt_resolved")
        assert (resolved["interrupt_id"], resolved["approved"], resolved["answered"]) == ("c1-input-1", False, False)
        assert resolved["rejection_message"] == expected


async def test_tool_question_deadline_rejects_the_call(tmp_path: Path) -> None:
    """With interrupt_deadline, an unanswered tool question is rejected with `question deadline passed`."""
    flow, runner = _flow(interrupt_deadline=timedelta(seconds=1))
    engine = InProcessEngine(tmp_path, [flow])
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s", _script([_call("c1", "ask_read", ask=["Quick?"])]))
        outcomes, snapshot = await _done(sessions)
        assert (outcomes["c1"]["status"], outcomes["c1"]["rejection_message"]) == (
            "rejected", "question deadline passed")
        assert snapshot.pending_interrupts == []
        assert not await sessions.answer_question("s", "c1-input-1", "late")
        assert len(runner.runs_of("c1")) == 1
        [(_, raised)] = await _events(sessions, "interrupt_raised")
        assert raised["interrupt_id"] == "c1-input-1" and raised["deadline"] is not None
        [(_, resolved)] = await _events(sessions, "interrupt_resolved")
        assert (resolved["interrupt_id"], resolved["rejection_message"]) == ("c1-input-1", "question deadline passed")


async def test_parallel_tool_calls_ask_at_once(tmp_path: Path) -> None:
    """Two tool Steps of one response ask together: both questions are pending at once, none is lost."""
    flow, runner = _flow()
    engine = InProcessEngine(tmp_path, [flow])
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s", _script([
            _call("a", "ask_read", ask=["A?"]), _call("b", "ask_write", ask=["B?"]),
        ]))
        pending = await _pending(sessions, "a-input-1", "b-input-1")
        assert {(i.tool_call_id, i.question) for i in pending} == {("a", "A?"), ("b", "B?")}
        assert await sessions.answer_question("s", "b-input-1", "bee")
        assert await sessions.answer_question("s", "a-input-1", "ay")
        outcomes, _ = await _done(sessions)
        assert json.loads(outcomes["a"]["output"])["answers"] == [["a-input-1", "A?", "ay"]]
        assert json.loads(outcomes["b"]["output"])["answers"] == [["b-input-1", "B?", "bee"]]
        assert len(runner.runs) == 4
        assert sorted(await _steps(engine)) == sorted([
            "StartAgentSession", "RunModel", "CallTool", "CallSingleAttemptTool", *["AwaitQuestionAnswer"] * 4,
            "CallTool", "CallSingleAttemptTool", "ResumeTurn", "RunModel",
        ])


@pytest.mark.parametrize("case", ["pending_approval", "earlier_record"])
async def test_tool_question_id_used_by_another_call_fails_the_call(tmp_path: Path, case: str) -> None:
    """Call `y` asks while call `y-input-1` exists in the turn (its approval pending, or already
    final from an earlier response): `y` records failed with the seed's error, and nothing is raised."""
    flow, runner = _flow()
    engine = InProcessEngine(tmp_path, [flow])
    async with engine.running():
        sessions = engine.sessions()
        if case == "pending_approval":
            await sessions.start_session("s", _script([
                _call("y", "ask_read", ask=["Which?"]), _call("y-input-1", "guarded"),
            ]))
            failed = await _record(sessions, "y", AgentToolCallStatus.FAILED)
            assert failed.error == tool_question_id_in_use("y-input-1")
            [approval] = await _pending(sessions, "y-input-1")
            assert approval.kind is InterruptKind.TOOL_APPROVAL  # still the other call's approval
            assert await sessions.resolve_interrupt("s", "y-input-1", approved=True)
        else:
            await sessions.start_session("s", _script(
                [_call("y-input-1", "ask_read")], [_call("y", "ask_read", ask=["Which?"])]))
        outcomes, snapshot = await _done(sessions)
        assert outcomes["y"] == {
            "status": "failed", "output": None, "rejection_message": None,
            "error": "the tool's question cannot use interrupt ID y-input-1, which another tool call of this turn uses",
        }
        assert outcomes["y-input-1"]["status"] == "succeeded"
        assert snapshot.pending_interrupts == []
        assert len(runner.runs_of("y")) == 1
        assert [p["kind"] for _, p in await _events(sessions, "interrupt_raised")] == (
            ["tool_approval"] if case == "pending_approval" else [])


INVALID_QUESTION = "the tool asked for input with an invalid ToolInputRequested: "


@pytest.mark.parametrize(("call_fields", "error"), [
    *(({"request": fields}, re.escape(INVALID_QUESTION + problem)) for fields, problem in [
        ({"question": "  "}, "question must be non-empty text"),
        ({"question": 5}, "question must be non-empty text"),
        ({"question": "Pick", "choices": "ab"}, "choices must be a sequence of texts"),
        ({"question": "Pick", "choices": 3}, "choices must be a sequence of texts"),
        ({"question": "Pick", "choices": {"a": 1}}, "choices must be a sequence of texts"),
        ({"question": "Pick", "choices": ["a", 1]}, "choices must be non-empty texts"),
        ({"question": "Pick", "choices": ["a"], "allows_free_text": "yes"}, "allows_free_text must be true or false"),
        ({"question": "Pick", "continuation": 5}, "continuation must be text or None"),
        ({"question": "Pick", "choices": ["a", "a"]}, "choices repeat"),
        ({"question": "Pick", "choices": ["a", " "]}, "choices must be non-empty texts"),
        ({"question": "Pick", "allows_free_text": False}, "a question without choices must allow free text"),
        ({"question": "Pick \ud800"}, "question is not valid UTF-8 text: '\\ud800' at position 5 is a lone surrogate"),
        ({"question": "Pick", "choices": ["a", "b\udfff"]},
         "a choice is not valid UTF-8 text: '\\udfff' at position 1 is a lone surrogate"),
        ({"question": "Pick", "continuation": "\ud800"},
         "continuation is not valid UTF-8 text: '\\ud800' at position 0 is a lone surrogate"),
    ]),
    ({"question_size": MAX_VALUE_BYTES}, re.escape(INVALID_QUESTION) + r"the question makes the call \d+ bytes, over "
     rf"the session's value limit of {MAX_VALUE_BYTES}"),
])
async def test_invalid_tool_question_fails_the_call(tmp_path: Path, call_fields: dict[str, Any], error: str) -> None:
    """A question the session cannot ask, or one that makes the call's record larger than the session's
    value limit, records failed with the problem (not outcome_unknown, even for a write: a tool that
    asks has taken no effect), and no Step waits for it."""
    flow, runner = _flow()
    engine = InProcessEngine(tmp_path, [flow])
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s", _script([_call("c1", "ask_write", **call_fields)]))
        outcomes, snapshot = await _done(sessions)
        assert outcomes["c1"]["status"] == "failed"
        assert re.fullmatch(error, outcomes["c1"]["error"]), outcomes["c1"]["error"]
        assert snapshot.pending_interrupts == []
        assert len(runner.runs_of("c1")) == 1
        assert await _steps(engine) == [
            "StartAgentSession", "RunModel", "CallSingleAttemptTool", "ResumeTurn", "RunModel"]


async def test_question_id_over_the_key_limit_fails_the_call(tmp_path: Path) -> None:
    """A 250-character call ID leaves no room for `-input-1` within the engine's 255-character keys:
    the call, a write, records failed at once instead of failing its Step into outcome_unknown."""
    flow, runner = _flow()
    call_id = "x" * 250
    engine = InProcessEngine(tmp_path, [flow])
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s", _script([_call(call_id, "ask_write", ask=["Sure?"])]))
        outcomes, snapshot = await _done(sessions)
        assert outcomes[call_id]["status"] == "failed"
        assert outcomes[call_id]["error"].startswith(f"the tool's question cannot use interrupt ID {call_id}-input-1: ")
        assert snapshot.pending_interrupts == []
        assert len(runner.runs) == 1


def _fail_before_the_tool_starts(flow: AgentSessionFlow, step_type: str) -> None:
    """Make the Step's attempts fail before the tool Step starts (no heartbeat: NOT_STARTED) for a
    record with input_answers, or for a call whose tool asks nothing."""
    step = flow.steps[step_type]
    original: Callable[[Context, str], Awaitable[StepDecision]] = step.execute

    async def failing(ctx: Context, tool_call_id: str) -> StepDecision:
        record = ctx.get(AGENT_TOOL_CALLS[tool_call_id])
        if record is not None and (record.input_answers or "ask" not in json.loads(record.arguments)):
            raise RuntimeError("injected: the attempt failed before the tool started")
        return await original(ctx, tool_call_id)

    step.execute = failing


@pytest.mark.parametrize(("tool", "fault", "status", "route"), [
    ("ask_write", "tool_raises", "outcome_unknown", "RecordToolOutcomeUnknown"),
    ("ask_write", "not_started", "outcome_unknown", "RecordToolOutcomeUnknown"),
    ("ask_idempotent", "not_started", "outcome_unknown", "RecordToolFailure"),
    # Control: the same NOT_STARTED failure of a call that never asked is safe to call again.
    ("ask_write", "not_started_unasked", "failed", "RecordToolOutcomeUnknown"),
])
async def test_a_call_that_asked_keeps_its_effect_after_a_step_failure(
    tmp_path: Path, tool: str, fault: str, status: str, route: str
) -> None:
    """A write whose tool asked, then failed after the answer, records outcome_unknown by effect,
    even when the failed attempts never started (NOT_STARTED): its tool already ran once."""
    flow, runner = _flow()
    step_type = CALL_SINGLE_ATTEMPT_TOOL if tool == "ask_write" else CALL_TOOL
    args: dict[str, Any] = {"ask": ["Amount?"]}
    if fault == "tool_raises":
        args["crash_after"] = 1
    elif fault == "not_started_unasked":
        args = {}
    if fault.startswith("not_started"):
        _fail_before_the_tool_starts(flow, step_type)
    engine = InProcessEngine(tmp_path, [flow])
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s", _script([_call("c1", tool, **args)]))
        if fault != "not_started_unasked":
            await _pending(sessions, "c1-input-1")
            assert await sessions.answer_question("s", "c1-input-1", "42")
        outcomes, _ = await _done(sessions)
        assert outcomes["c1"]["status"] == status
        never_ran = outcomes["c1"]["error"].startswith(TOOL_CALL_NOT_RUN_ERROR_PREFIX)
        assert never_ran is (fault == "not_started_unasked")
        steps = await _steps(engine)
        assert steps[-3:] == [route, "ResumeTurn", "RunModel"]
        history = await engine.client.get_flow_history("s")
        [failure] = [e for e in history if e.event_type == "step_failed"]
        assert failure.detail.startswith("NOT_COMPLETED" if fault == "tool_raises" else "NOT_STARTED")
        if never_ran:  # seed 002: the prefix, then ": " and the recovery detail (the attempt's error)
            assert outcomes["c1"]["error"] == (
                f"{TOOL_CALL_NOT_RUN_ERROR_PREFIX}: injected: the attempt failed before the tool started")
        expected_runs = {"tool_raises": 2, "not_started": 1, "not_started_unasked": 0}[fault]
        assert len(runner.runs_of("c1")) == expected_runs


# AwaitQuestionAnswer's handlers on built contexts ------------------------------------------------


def _asking_record(**fields: Any) -> AgentToolCall:
    fields = {"status": AgentToolCallStatus.AWAITING_ANSWER, "tool_name": "ask_read", "input_continuation": "cont-1",
              "input_question": "Colour?", "input_choices": ["red", "blue"], **fields}
    return tool_call(fields.pop("status"), **fields)


def _interrupt(interrupt_id: str, tool_call_id: str, deadline: datetime | None = None) -> AgentInterrupt:
    return AgentInterrupt(
        interrupt_id=interrupt_id, kind=InterruptKind.QUESTION, tool_call_id=tool_call_id, tool_name="ask_read",
        arguments="{}", created_at=format_time(datetime.now(UTC)),
        deadline=None if deadline is None else format_time(deadline), question="Colour?", choices=["red", "blue"],
    )


def _context(
    flow: AgentSessionFlow,
    records: list[AgentToolCall],
    pending: list[AgentInterrupt],
    wait: tuple[Wait, WaitOutcome] | None = None,
) -> Context:
    values: dict[tuple[str, str], Any] = {("AgentToolCalls", r.tool_call_id): r for r in records}
    values[("PendingInterrupts", "")] = pending
    return step_context(flow, AWAIT_QUESTION_ANSWER, values, wait=wait,
                        method="wait_for" if wait is None else "execute", step_execution_id="AwaitQuestionAnswer-9")


def _steps_of(flow: AgentSessionFlow) -> BuiltInSteps:
    return BuiltInSteps(runtime_of(flow))


async def test_wait_of_a_tool_question_uses_its_own_interrupt_id() -> None:
    """Not pending yet: a zero Timer with a non-blocking take of InterruptResolutions[c1-input-1]
    (so an answer that committed before this WaitFor is consumed, never asked again). Pending:
    the resolution of `c1-input-1`, not of the tool call ID, and the deadline Timer."""
    flow, _ = _flow()
    steps = _steps_of(flow)
    fresh = await steps.await_question_answer_wait(_context(flow, [_asking_record()], []), "c1")
    resolutions = INTERRUPT_RESOLUTIONS["c1-input-1"]
    assert fresh == Wait.all_of(Timer.by_duration(0), resolutions.at_most(1))
    other = await steps.await_question_answer_wait(
        _context(flow, [_asking_record()], [_interrupt("c1-input-1", "other")]), "c1")
    assert other == fresh  # another call's interrupt: Execute applies the collision rule
    deadline = datetime.now(UTC) + timedelta(seconds=30)
    waiting = await steps.await_question_answer_wait(
        _context(flow, [_asking_record()], [_interrupt("c1-input-1", "c1", deadline)]), "c1")
    # Pending: ToolCallCancellations[c1] first (a steer's wake, seed 002), then the question's resolution.
    assert waiting.mode == "any" and waiting.conditions[:2] == (
        TOOL_CALL_CANCELLATIONS["c1"].for_one(), resolutions.for_one())
    assert len(waiting.conditions) == 3 and waiting.conditions[2].seconds >= 29  # type: ignore[union-attr]


async def test_answer_taken_by_the_zero_timer_wait_is_applied() -> None:
    """An answer consumed by the not-pending wait appends a QuestionAnswer, clears the question,
    records approved, and goes back to the call's tool Step; PendingInterrupts is not touched."""
    flow, _ = _flow()
    wait = Wait.all_of(Timer.by_duration(0), INTERRUPT_RESOLUTIONS["c1-input-1"].at_most(1))
    answer = msgspec.json.encode(AgentInterruptResolution(approved=True, rejection_message=None, answer="red"))
    outcome = WaitOutcome(satisfied=(0, 1), consumed=((), (ConsumedMessage(7, msgspec.Raw(answer)),)),
                          fired_timers=(0,))
    ctx = _context(flow, [_asking_record()], [], (wait, outcome))
    decision = await _steps_of(flow).await_question_answer(ctx, "c1")
    assert [m.step_type for m in decision.movements] == [CALL_TOOL]
    record = ctx.get(AGENT_TOOL_CALLS["c1"])
    assert record is not None and record.status is AgentToolCallStatus.APPROVED
    assert record.input_answers == [QuestionAnswer("c1-input-1", "Colour?", "red")]
    assert (record.input_question, record.input_choices, record.input_continuation) == (None, [], "cont-1")
    assert ("PendingInterrupts", "") not in ctx.writes.attributes


async def test_timer_that_races_an_answer_never_raises_the_question_twice() -> None:
    """The deadline Timer of a pending question fires, but answer_question already took the
    interrupt (its answer still queued): Execute waits again instead of raising `c1-input-1` anew."""
    flow, _ = _flow()
    wait = Wait.any_of(INTERRUPT_RESOLUTIONS["c1-input-1"].for_one(), Timer.by_duration(1))
    outcome = WaitOutcome(satisfied=(1,), consumed=((), ()), fired_timers=(1,))
    ctx = _context(flow, [_asking_record()], [], (wait, outcome))
    decision = await _steps_of(flow).await_question_answer(ctx, "c1")
    assert [(m.step_type, m.input) for m in decision.movements] == [(AWAIT_QUESTION_ANSWER, "c1")]
    assert ctx.writes.attributes == {}
    assert ctx.writes.appends == []  # no interrupt_raised


async def test_not_pending_question_is_raised_under_the_lock() -> None:
    """After the zero-Timer wait with no answer, Execute adds `c1-input-1` to PendingInterrupts
    (next to other calls' interrupts) and waits again, loading the colliding record's key."""
    flow, _ = _flow(interrupt_deadline=timedelta(minutes=5))
    wait = Wait.all_of(Timer.by_duration(0), INTERRUPT_RESOLUTIONS["c1-input-1"].at_most(1))
    outcome = WaitOutcome(satisfied=(0, 1), consumed=((), ()), fired_timers=(0,))
    others = [_interrupt("c2", "c2")]
    ctx = _context(flow, [_asking_record()], others, (wait, outcome))
    decision = await _steps_of(flow).await_question_answer(ctx, "c1")
    [movement] = decision.movements
    assert (movement.step_type, movement.input) == (AWAIT_QUESTION_ANSWER, "c1")
    assert movement.options is not None
    assert ("AgentToolCalls", "c1-input-1") in movement.options.load.instances  # type: ignore[union-attr]
    pending = ctx.get(PENDING_INTERRUPTS)
    assert pending is not None and [i.interrupt_id for i in pending] == ["c2", "c1-input-1"]
    raised = pending[1]
    assert (raised.tool_call_id, raised.question, raised.choices, raised.deadline is not None) == (
        "c1", "Colour?", ["red", "blue"], True)
    assert ctx.get(AGENT_TOOL_CALLS["c1"]) == _asking_record()  # the record is not rewritten


async def test_a_question_already_pending_for_its_call_is_not_raised_again() -> None:
    """Execute after the zero-Timer wait finds `c1-input-1` already pending for c1 itself (raised
    since its WaitFor read PendingInterrupts): it waits for the answer again, with no second
    interrupt in PendingInterrupts and no second interrupt_raised event."""
    flow, _ = _flow(interrupt_deadline=timedelta(minutes=5))
    wait = Wait.all_of(Timer.by_duration(0), INTERRUPT_RESOLUTIONS["c1-input-1"].at_most(1))
    outcome = WaitOutcome(satisfied=(0, 1), consumed=((), ()), fired_timers=(0,))
    ctx = _context(flow, [_asking_record()], [_interrupt("c1-input-1", "c1")], (wait, outcome))
    decision = await _steps_of(flow).await_question_answer(ctx, "c1")
    assert [(m.step_type, m.input) for m in decision.movements] == [(AWAIT_QUESTION_ANSWER, "c1")]
    assert ctx.writes.attributes == {}
    assert ctx.writes.appends == []  # no interrupt_raised


async def test_pending_interrupt_of_another_call_with_the_question_id_fails_the_call() -> None:
    """The collision rule also reads PendingInterrupts: another call's interrupt `c1-input-1`
    makes c1 record failed, publish its result, and leave that interrupt alone."""
    flow, _ = _flow()
    wait = Wait.all_of(Timer.by_duration(0), INTERRUPT_RESOLUTIONS["c1-input-1"].at_most(1))
    outcome = WaitOutcome(satisfied=(0, 1), consumed=((), ()), fired_timers=(0,))
    others = [_interrupt("c1-input-1", "somebody")]
    ctx = _context(flow, [_asking_record()], others, (wait, outcome))
    decision = await _steps_of(flow).await_question_answer(ctx, "c1")
    assert decision.kind == "dead_end"
    record = ctx.get(AGENT_TOOL_CALLS["c1"])
    assert record is not None and record.status is AgentToolCallStatus.FAILED
    assert record.error == tool_question_id_in_use("c1-input-1")
    assert ctx.get(PENDING_INTERRUPTS) == others
    assert [p[0] for p in ctx.writes.publishes] == ["ToolCallResults"]


@pytest.mark.parametrize("final", [False, True], ids=["record_gone", "record_final"])
async def test_question_step_of_a_call_no_longer_awaiting_an_answer_skips_and_writes_nothing(final: bool) -> None:
    """A call already recorded final (or whose record is gone) when its AwaitQuestionAnswer runs: the
    WaitFor skips rather than wait for an answer nobody can give, and Execute ends without applying
    an answer it took, so a final call is never recorded twice."""
    flow, _ = _flow()
    steps = _steps_of(flow)
    records = [_asking_record(status=AgentToolCallStatus.REJECTED)] if final else []
    assert await steps.await_question_answer_wait(_context(flow, records, []), "c1") == Wait.skip_immediately()
    wait = Wait.any_of(TOOL_CALL_CANCELLATIONS["c1"].for_one(), INTERRUPT_RESOLUTIONS["c1-input-1"].for_one())
    answer = msgspec.json.encode(AgentInterruptResolution(approved=True, rejection_message=None, answer="red"))
    outcome = WaitOutcome(satisfied=(1,), consumed=((), (ConsumedMessage(7, msgspec.Raw(answer)),)))
    ctx = _context(flow, records, [], (wait, outcome))
    decision = await steps.await_question_answer(ctx, "c1")
    assert decision.kind == "dead_end"
    assert ctx.writes.empty()


async def test_wait_of_an_ask_user_question_whose_interrupt_an_answer_took() -> None:
    """answer_question took an ask_user question's interrupt before the WaitFor ran (the turn neither
    steered nor cancelled): it waits for that answer and a wake as while pending. Only a tool's
    question is raised by this Step, so no zero Timer, and with the interrupt gone no deadline Timer."""
    flow, _ = _flow()
    ask = tool_call(AgentToolCallStatus.AWAITING_ANSWER, tool_name="ask_user")
    wait = await _steps_of(flow).await_question_answer_wait(_context(flow, [ask], []), "c1")
    assert wait == Wait.any_of(TOOL_CALL_CANCELLATIONS["c1"].for_one(), INTERRUPT_RESOLUTIONS["c1"].for_one())


@pytest.mark.parametrize("deadline_passed", [True, False])
async def test_deadline_timer_rejects_a_pending_question_only_once_its_deadline_passed(deadline_passed: bool) -> None:
    """The deadline Timer of a pending question fires. Past the deadline, Execute removes the
    interrupt (other calls' stay), rejects the call with `question deadline passed` and ends. A Timer
    that fired early (SkipTimer) changes nothing and waits again (seed 002: "or itself after an early
    Timer")."""
    flow, _ = _flow()
    deadline = datetime.now(UTC) + (timedelta(seconds=-1) if deadline_passed else timedelta(minutes=5))
    pending = [_interrupt("c2", "c2"), _interrupt("c1-input-1", "c1", deadline)]
    wait = Wait.any_of(TOOL_CALL_CANCELLATIONS["c1"].for_one(), INTERRUPT_RESOLUTIONS["c1-input-1"].for_one(),
                       Timer.by_duration(1))
    outcome = WaitOutcome(satisfied=(2,), consumed=((), (), ()), fired_timers=(2,))
    ctx = _context(flow, [_asking_record()], pending, (wait, outcome))
    decision = await _steps_of(flow).await_question_answer(ctx, "c1")
    if not deadline_passed:
        assert [(m.step_type, m.input) for m in decision.movements] == [(AWAIT_QUESTION_ANSWER, "c1")]
        assert ctx.writes.empty()
        return
    assert decision.kind == "dead_end"
    assert ctx.get(PENDING_INTERRUPTS) == pending[:1]
    record = ctx.get(AGENT_TOOL_CALLS["c1"])
    assert record is not None
    assert (record.status, record.rejection_message, record.input_question) == (
        AgentToolCallStatus.REJECTED, "question deadline passed", None)


class _NoOptionsRunner(AskingRunner):
    """AskingRunner whose tool_call_step_options always raises."""

    def tool_call_step_options(self, call: DeferredToolCall) -> ToolCallStepOptions | None:
        raise RuntimeError("no manifest for this tool")


def _answered(answer: str) -> tuple[Wait, WaitOutcome]:
    """The not-pending wait of `c1-input-1`, having taken an answer that committed first."""
    wait = Wait.all_of(Timer.by_duration(0), INTERRUPT_RESOLUTIONS["c1-input-1"].at_most(1))
    resolution = msgspec.json.encode(AgentInterruptResolution(approved=True, rejection_message=None, answer=answer))
    return wait, WaitOutcome(satisfied=(0, 1), consumed=((), (ConsumedMessage(7, msgspec.Raw(resolution)),)),
                             fired_timers=(0,))


async def test_answered_question_whose_tool_step_options_fail_records_the_call_failed_unrun() -> None:
    """The answer would send the call back to its tool Step, but the runner's tool_call_step_options
    raises: the call records failed as never run and publishes its result, and the branch ends
    there instead of moving to a tool Step."""
    flow = AgentSessionFlow(_NoOptionsRunner(), FLOW_TYPE, AgentSessionOptions(tool_policies=POLICIES))
    ctx = _context(flow, [_asking_record()], [], _answered("red"))
    decision = await _steps_of(flow).await_question_answer(ctx, "c1")
    assert decision.kind == "dead_end"
    record = ctx.get(AGENT_TOOL_CALLS["c1"])
    assert record is not None and record.status is AgentToolCallStatus.FAILED
    assert record.error == (
        f"{TOOL_CALL_NOT_RUN_ERROR_PREFIX}: the runner's tool_call_step_options raised RuntimeError: "
        "no manifest for this tool")
    assert [p[0] for p in ctx.writes.publishes] == ["ToolCallResults"]


async def test_an_answer_too_large_to_store_fails_the_call() -> None:
    """An answer that makes the call's record larger than the session's value limit would fail the
    Step on every retry: the call records failed with the sizes instead, and the branch ends."""
    flow, _ = _flow()
    ctx = _context(flow, [_asking_record()], [], _answered("a" * MAX_VALUE_BYTES))
    decision = await _steps_of(flow).await_question_answer(ctx, "c1")
    assert decision.kind == "dead_end"
    record = ctx.get(AGENT_TOOL_CALLS["c1"])
    assert record is not None and record.status is AgentToolCallStatus.FAILED
    assert (record.input_question, record.input_answers) == (None, [])
    assert re.fullmatch(rf"the user's answer makes the call \d+ bytes, over the session's value limit of "
                        rf"{MAX_VALUE_BYTES}; it was not stored", record.error or "")


async def test_a_resolution_without_an_answer_declines_the_question() -> None:
    """A resolution approved but with no answer (the shape of a tool approval, never of
    answer_question) taken by a question never answers it with nothing: the call is declined with
    the default message and the tool does not run again, its record left with no question pending."""
    flow, _ = _flow()
    wait = Wait.all_of(Timer.by_duration(0), INTERRUPT_RESOLUTIONS["c1-input-1"].at_most(1))
    resolution = msgspec.json.encode(AgentInterruptResolution(approved=True, rejection_message=None))
    outcome = WaitOutcome(satisfied=(0, 1), consumed=((), (ConsumedMessage(7, msgspec.Raw(resolution)),)),
                          fired_timers=(0,))
    ctx = _context(flow, [_asking_record()], [], (wait, outcome))
    decision = await _steps_of(flow).await_question_answer(ctx, "c1")
    assert decision.kind == "dead_end"
    record = ctx.get(AGENT_TOOL_CALLS["c1"])
    assert record is not None
    assert (record.status, record.rejection_message, record.input_answers) == (
        AgentToolCallStatus.REJECTED, "The user declined to answer.", [])
    assert (record.input_question, record.input_choices) == (None, [])


async def test_a_question_that_does_not_fit_next_to_the_pending_interrupts_fails_the_call() -> None:
    """Raising the question would make PendingInterrupts larger than the value limit: the call
    records failed with the sizes, nothing is raised, and the other interrupts stay as they were."""
    flow, _ = _flow()
    wait = Wait.all_of(Timer.by_duration(0), INTERRUPT_RESOLUTIONS["c1-input-1"].at_most(1))
    outcome = WaitOutcome(satisfied=(0, 1), consumed=((), ()), fired_timers=(0,))
    big = msgspec.structs.replace(_interrupt("c2", "c2"), question="Q" * (MAX_VALUE_BYTES - 1000))
    ctx = _context(flow, [_asking_record(input_question="Colour?" * 200)], [big], (wait, outcome))
    decision = await _steps_of(flow).await_question_answer(ctx, "c1")
    assert decision.kind == "dead_end"
    record = ctx.get(AGENT_TOOL_CALLS["c1"])
    assert record is not None and record.status is AgentToolCallStatus.FAILED
    assert re.fullmatch(r"the tool's question does not fit with the turn's other pending interrupts "
                        rf"\(\d+ bytes, over the session's value limit of {MAX_VALUE_BYTES}\)", record.error or "")
    assert ctx.get(PENDING_INTERRUPTS) == [big]
    assert ("PendingInterrupts", "") not in ctx.writes.attributes


async def test_a_record_with_the_question_id_from_an_earlier_turn_does_not_collide() -> None:
    """Tool call IDs may repeat across turns: a record `c1-input-1` of an earlier turn is not
    "another tool call of this turn" (seed 002), so the question is raised as usual."""
    flow, _ = _flow()
    wait = Wait.all_of(Timer.by_duration(0), INTERRUPT_RESOLUTIONS["c1-input-1"].at_most(1))
    outcome = WaitOutcome(satisfied=(0, 1), consumed=((), ()), fired_timers=(0,))
    earlier = tool_call(AgentToolCallStatus.SUCCEEDED, tool_call_id="c1-input-1", turn_id="turn-0")
    ctx = _context(flow, [_asking_record(), earlier], [], (wait, outcome))
    decision = await _steps_of(flow).await_question_answer(ctx, "c1")
    assert [(m.step_type, m.input) for m in decision.movements] == [(AWAIT_QUESTION_ANSWER, "c1")]
    pending = ctx.get(PENDING_INTERRUPTS)
    assert pending is not None and [(i.interrupt_id, i.tool_call_id) for i in pending] == [("c1-input-1", "c1")]
    assert ctx.get(AGENT_TOOL_CALLS["c1"]) == _asking_record()
