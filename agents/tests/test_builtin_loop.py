"""The built-in loop end to end: tools, stored items, limits, continuation, settings, sources, kills."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import sys
import threading
import time
import types
from collections.abc import Sequence
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from agents.tests.builtin_agent import (
    FAST_WORKER,
    InProcessEngine,
    gated_flow,
    lookup_order,
    refund_order,
    scripted_flow,
    tool_then_answer,
)
from agents.tests.compaction_agent import FILLER
from agents.tests.conftest import REPO_ROOT
from engine.tests.conftest import db_url, pg_database, pg_databases  # noqa: F401 - the fixtures used here

from dex_agents import (
    MISSING_TOOL_TASK_POLLER,
    OUTCOME_UNKNOWN_TEXT,
    TOOL_NAME_MISSING,
    AgentEvent,
    AgentSessionClient,
    AgentSessionFlow,
    AgentSnapshot,
    AgentTurnContext,
    BuiltInTool,
    CompactionPolicy,
    DeferredToolCall,
    DeferredToolExecution,
    MessageRole,
    RunModelLimit,
    ToolCallStepOptions,
    ToolEffect,
    ToolExecutionError,
    ToolExecutionResult,
    ToolInputRequested,
    ToolPolicy,
    ToolTaskCancellation,
    ToolTaskPoll,
    ToolTaskPollOutcome,
    ToolTaskStarted,
)
from dex_agents.builtin_loop import (
    CONTEXT_SUMMARY_INSTRUCTIONS,
    MAX_CONSECUTIVE_TURN_CONTINUATIONS,
    TURN_CONTINUATION_LIMIT_ERROR,
    AgentDefinition,
    BuiltinLoopAgentRunner,
    ContinueTurn,
    InstructionContext,
    ModelOutputItem,
    ModelOutputWriter,
    ModelRequest,
    ModelToolCall,
    ModelToolDefinition,
    OutputItemKind,
    ScriptedModelClient,
    ScriptedModelReply,
    ScriptedToolCall,
    ToolCallContext,
    ToolChoice,
    ToolResultInput,
    TurnContinuationContext,
    UserTextInput,
    builtin_agent_session_flow,
    builtin_agent_session_options,
    function_tool,
    model_call_limit_result,
)
from dex_agents.builtin_loop._loop_runner import listed_tool_problem, unknown_tool_error
from dex_agents.builtin_loop._scripted import DEFAULT_SUMMARY_QUOTE_CHARS
from dex_agents.testing import (
    AgentTestStack,
    FileGate,
    InvocationLog,
    executed_steps,
    to_step_history,
    wait_for_agent_snapshot,
)
from dex_engine import AsyncWorker, InvalidIdError, Registry, WorkerOptions

# Tool calls of the turn compacted as it runs (test_a_turn_compacted_as_it_runs_keeps_unique_call_ids...).
CALLS = 12


async def _turns_done(sessions: AgentSessionClient, sid: str, count: int) -> AgentSnapshot:
    snapshot: AgentSnapshot = await wait_for_agent_snapshot(
        sessions, sid, lambda s: s if s.state is not None and s.state.turn_count >= count else None,
        description=f"{count} turn(s) of {sid} to end",
    )
    return snapshot


async def _one_turn(tmp_path: Path, definition: AgentDefinition, text: str) -> AgentSnapshot:
    """The snapshot after the first turn of a session of `definition`'s agent, started with `text`."""
    engine = InProcessEngine(tmp_path, [builtin_agent_session_flow(definition)])
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s", text)
        return await _turns_done(sessions, "s", 1)


def test_the_testing_kit_exports_the_built_in_loops_scripted_model_client() -> None:
    """Seed 003: dex_agents.testing "exports the same class" as dex_agents.builtin_loop."""
    import dex_agents.testing

    assert dex_agents.testing.ScriptedModelClient is ScriptedModelClient
    assert "ScriptedModelClient" in dex_agents.testing.__all__


class _Deltas:
    """The live output a model client streams, as (kind, text) in order."""

    def __init__(self) -> None:
        self.written: list[tuple[str, str]] = []

    def write_text_delta(self, text: str) -> None:
        self.written.append(("text", text))

    def write_reasoning_delta(self, text: str) -> None:
        self.written.append(("reasoning", text))


async def test_the_scripted_client_streams_its_reply_and_derives_call_ids_from_the_whole_input() -> None:
    """A scripted reply streams its reasoning, then its text, and returns them before its tool calls.
    Calls without an ID get one derived from the whole request: one of their own each, the same for
    the same request (a RunModel that runs again), and new for a request that ends as an earlier one
    did (a later turn's same user text). Catches reasoning not streamed, calls of one reply sharing
    an ID, and IDs derived from the request's last item alone."""
    reply = ScriptedModelReply(text="ok", reasoning="think", tool_calls=[
        ScriptedToolCall("a"), ScriptedToolCall("b", {"x": 1}), ScriptedToolCall("c", "{}", tool_call_id="mine")])
    model = ScriptedModelClient(lambda request: reply)
    deltas = _Deltas()
    first = ModelRequest(None, (UserTextInput("again"),))
    response = await model.call_model(first, ModelOutputWriter(deltas))  # type: ignore[arg-type]
    assert deltas.written == [("reasoning", "think"), ("text", "ok")]
    assert [item.kind for item in response.output] == [
        OutputItemKind.REASONING, OutputItemKind.TEXT, *[OutputItemKind.TOOL_CALL] * 3]
    calls = [item.tool_call for item in response.output[2:]]
    assert [(c.tool_name, c.arguments) for c in calls if c is not None] == [("a", "{}"), ("b", '{"x": 1}'),
                                                                            ("c", "{}")]
    ids = [c.tool_call_id for c in calls if c is not None]
    assert len(set(ids)) == 3 and ids[2] == "mine"
    # Its usage is an estimate, as a provider's would be: one call, the request's tokens in, some out.
    usage = response.usage
    assert (usage.model_calls, usage.input_tokens) == (1, model.estimate_input_tokens(first))
    assert usage.output_tokens > 0
    again = await model.call_model(first, ModelOutputWriter(_Deltas()))  # type: ignore[arg-type]
    assert [item.tool_call.tool_call_id for item in again.output[2:] if item.tool_call is not None] == ids
    later = ModelRequest(None, (UserTextInput("earlier"), *response.output, UserTextInput("again")))
    other = await model.call_model(later, ModelOutputWriter(_Deltas()))  # type: ignore[arg-type]
    other_ids = [item.tool_call.tool_call_id for item in other.output[2:] if item.tool_call is not None]
    assert not set(other_ids[:2]) & set(ids[:2]), (other_ids, ids)


async def test_the_scripted_clients_derived_call_ids_do_not_repeat_across_requests() -> None:
    """Every request gets call IDs of its own: seed 003 wants them unique within a turn, whose model
    calls can be many, and the client derives them so that they do not repeat within a session.
    300 different requests, more than a short digest has values, derive 300 different first-call
    IDs. Catches: a derived ID cut to a few hex digits, which repeats an earlier request's ID."""
    model = ScriptedModelClient(lambda request: ScriptedModelReply(tool_calls=[ScriptedToolCall("a")]))
    ids = set()
    for n in range(300):
        response = await model.call_model(ModelRequest(None, (UserTextInput(f"question {n}"),)),
                                          ModelOutputWriter(_Deltas()))  # type: ignore[arg-type]
        [call] = [item.tool_call for item in response.output if item.tool_call is not None]
        ids.add(call.tool_call_id)
    assert len(ids) == 300


def test_the_scripted_clients_helpers_read_the_request_in_order() -> None:
    """tool_results: the results the request ends with, oldest first; default_summary: the number of
    items and the last user text that is not a [Dex] note, its first DEFAULT_SUMMARY_QUOTE_CHARS
    characters. max_recorded_requests=0 (a long session's) records none."""
    assert ScriptedModelClient(print, max_recorded_requests=0).requests.maxlen == 0
    request = ModelRequest(None, (
        UserTextInput("first"), ToolResultInput("c0", "t", "old"), UserTextInput("the last question"),
        UserTextInput("[Dex] a note"), ToolResultInput("c1", "t", "one"), ToolResultInput("c2", "t", "two"),
    ))
    assert [r.output for r in ScriptedModelClient.tool_results(request)] == ["one", "two"]
    assert ScriptedModelClient.default_summary(request) == (
        "Scripted summary of 6 input items. The last user message was: the last question")
    # A long message is quoted in part only: quoted whole, the summary would not shrink the context.
    long = ModelRequest(None, (UserTextInput("a" * DEFAULT_SUMMARY_QUOTE_CHARS + "b"),))
    assert ScriptedModelClient.default_summary(long) == (
        "Scripted summary of 1 input items. The last user message was: " + "a" * DEFAULT_SUMMARY_QUOTE_CHARS)


def test_a_scripted_client_refuses_more_recorded_requests_than_a_deque_can_hold() -> None:
    """Catches: max_recorded_requests past sys.maxsize (a deque's largest maxlen) failing with a bare
    OverflowError (Python int too large to convert to C ssize_t) naming neither the field nor the bound,
    and True taken as a maxlen of 1."""
    with pytest.raises(ValueError, match=re.escape(
            f"max_recorded_requests must be a whole number from 0 to {sys.maxsize}, got {sys.maxsize + 1}")):
        ScriptedModelClient(print, max_recorded_requests=sys.maxsize + 1)
    assert ScriptedModelClient(print, max_recorded_requests=sys.maxsize).requests.maxlen == sys.maxsize
    # Nor a bool, which a deque takes as a count: True kept one request.
    with pytest.raises(ValueError, match=re.escape("max_recorded_requests must be a whole number from 0 to ")):
        ScriptedModelClient(print, max_recorded_requests=True)


async def test_a_script_or_summarize_returning_the_wrong_type_is_named() -> None:
    """Catches: an AttributeError from deep in the client, naming neither the script nor what to return."""
    writer = ModelOutputWriter(_Deltas())  # type: ignore[arg-type]
    request = ModelRequest(None, (UserTextInput("hi"),))
    with pytest.raises(TypeError, match=re.escape("the script returned 'ok'; return a ScriptedModelReply")):
        await ScriptedModelClient(lambda r: "ok").call_model(request, writer)  # type: ignore[arg-type,return-value]
    summary = ModelRequest(CONTEXT_SUMMARY_INSTRUCTIONS, (UserTextInput("hi"),))
    with pytest.raises(TypeError, match=re.escape("summarize returned 5; return the summary text")):
        await ScriptedModelClient(print, summarize=lambda r: 5).call_model(summary, writer)  # type: ignore[arg-type,return-value]


@pytest.mark.parametrize(("make", "expected"), [
    (lambda: ScriptedModelReply(tool_calls=[{"name": "lookup"}]),  # type: ignore[list-item]
     "ScriptedModelReply.tool_calls[0] must be a ScriptedToolCall, got {'name': 'lookup'}; write "
     "ScriptedToolCall(name, arguments)"),
    (lambda: ScriptedModelReply(tool_calls=ScriptedToolCall("lookup")),  # type: ignore[arg-type]
     "ScriptedModelReply.tool_calls must be a list of ScriptedToolCall (one call as [call]), got "
     "ScriptedToolCall(name='lookup'"),
    (lambda: ScriptedModelReply(tool_calls="lookup"),  # type: ignore[arg-type]
     "ScriptedModelReply.tool_calls must be a list of ScriptedToolCall (one call as [call]), got 'lookup'"),
    (lambda: ScriptedModelReply(text=5),  # type: ignore[arg-type]
     "ScriptedModelReply.text must be a str or None, got 5"),
    (lambda: ScriptedModelReply(reasoning=["a"]),  # type: ignore[arg-type]
     "ScriptedModelReply.reasoning must be a str or None, got ['a']"),
    (lambda: ScriptedToolCall(None),  # type: ignore[arg-type]
     "ScriptedToolCall.name must be the tool's name as a str, got None"),
    (lambda: ScriptedToolCall("lookup", {"at": object}),
     "ScriptedToolCall.arguments of 'lookup' must be JSON-serializable: Object of type type is not JSON "
     "serializable; pass JSON values"),
    (lambda: ScriptedToolCall("lookup", ["A-1"]),  # type: ignore[arg-type]
     "ScriptedToolCall.arguments of 'lookup' must be a dict or its JSON text as a str, got ['A-1']"),
    (lambda: ScriptedToolCall("lookup", tool_call_id=7),  # type: ignore[arg-type]
     "ScriptedToolCall.tool_call_id of 'lookup' must be a str or None (derived), got 7"),
])
def test_a_scripted_reply_of_the_wrong_shape_is_refused_where_it_is_written(
    make: Any, expected: str
) -> None:
    """Catches: a reply checked only inside the model call, where a dict for a call failed RunModel
    three times with "'dict' object has no attribute 'arguments'", and text=5 went out as is."""
    with pytest.raises(TypeError, match=re.escape(expected)):
        make()


def test_a_scripted_reply_keeps_its_calls_as_written() -> None:
    """Catches: a reply holding the script's list, which the script may go on changing."""
    calls = [ScriptedToolCall("lookup", '{"id": "A-1"}', "call_1")]
    reply = ScriptedModelReply(tool_calls=calls)
    calls.clear()
    assert reply.tool_calls == (ScriptedToolCall("lookup", '{"id": "A-1"}', "call_1"),)


async def test_function_tool_turn_stores_items_as_they_appear(tmp_path: Path) -> None:
    """A write waits for approval with its call already stored; the answer sees the tool's result."""
    flow, model = scripted_flow(tool_then_answer)
    engine = InProcessEngine(tmp_path, [flow])
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s", '/tool refund_order {"order_id": "A-1", "amount_cents": 250}')
        waiting = await wait_for_agent_snapshot(
            sessions, "s", lambda s: s if s.pending_interrupts else None, description="the approval")
        # Stored incrementally: the user message, the model's text, and its tool call, before the tool runs.
        assert [m.role for m in waiting.messages] == [MessageRole.USER, MessageRole.ASSISTANT, MessageRole.ASSISTANT]
        assert waiting.messages[2].tool_name == "refund_order"
        assert await sessions.resolve_interrupt("s", waiting.pending_interrupts[0].interrupt_id, approved=True)
        done = await _turns_done(sessions, "s", 1)
        assert done.messages[-1].text == "results: refund_order=refunded 250 on A-1"
        assert done.messages[-2].role is MessageRole.TOOL
        assert done.state is not None and done.state.last_turn_error is None
        steps = executed_steps(to_step_history(await engine.client.get_flow_history("s")))
        assert steps == ["StartAgentSession", "RunModel", "AwaitToolApproval", "CallSingleAttemptTool",
                         "ResumeTurn", "RunModel"]
        # The second request replays the stored call followed by its result.
        last = model.requests[-1].input
        assert isinstance(last[-1], ToolResultInput) and last[-1].output == "refunded 250 on A-1"
        assert isinstance(last[-2], ModelOutputItem) and last[-2].tool_call is not None


async def test_schema_violation_and_unknown_tool_reach_the_model(tmp_path: Path) -> None:
    """Bad arguments, an unknown name and no name become tool failures the model sees; none asks for
    approval, and the response's other calls run. Catches: a nameless call failing the whole turn."""

    def respond(request: ModelRequest) -> ScriptedModelReply:
        results = ScriptedModelClient.tool_results(request)
        if results:
            return ScriptedModelReply(text=" | ".join(r.output for r in results))
        return ScriptedModelReply(tool_calls=[
            ScriptedToolCall("lookup_order", {"order_id": 7}),
            ScriptedToolCall("no_such_tool", {}),
            ScriptedToolCall("", {}),
        ])

    flow, _ = scripted_flow(respond)
    engine = InProcessEngine(tmp_path, [flow])
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s", "go")
        done = await _turns_done(sessions, "s", 1)
        answer = done.messages[-1].text or ""
        assert "The tool call failed: invalid arguments for lookup_order" in answer
        assert "The tool call failed: unknown tool no_such_tool" in answer
        assert f"The tool call failed: {TOOL_NAME_MISSING}" in answer
        assert done.state is not None and done.state.last_turn_error is None
        assert done.pending_interrupts == []


async def test_model_call_limit_offers_no_tools_and_ends_the_turn(tmp_path: Path) -> None:
    """After max_model_calls_per_turn calls, the next call offers no tools; a call anyway is not run."""

    def always_tools(request: ModelRequest) -> ScriptedModelReply:
        return ScriptedModelReply(tool_calls=[ScriptedToolCall("lookup_order", {"order_id": "A"})])

    flow, model = scripted_flow(always_tools, max_model_calls_per_turn=2)
    engine = InProcessEngine(tmp_path, [flow])
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s", "loop forever")
        done = await _turns_done(sessions, "s", 1)
        assert len(model.requests) == 3
        assert model.requests[0].tools and model.requests[1].tools
        assert model.requests[2].tools == () and model.requests[2].tool_choice is ToolChoice.NONE
        assert done.messages[-1].role is MessageRole.TOOL
        assert done.messages[-1].tool_output == model_call_limit_result(2)
        assert done.state is not None and done.state.last_turn_error is None


async def test_instructions_function_and_resolve_model_follow_turn_settings(tmp_path: Path) -> None:
    """Settings reach instructions and resolve_model; an update applies from the next turn only."""
    seen: list[tuple[str, str]] = []

    def named(name: str) -> ScriptedModelClient:
        return ScriptedModelClient(lambda request: ScriptedModelReply(text=f"{name}: {request.instructions}"))

    models = {"small": named("small"), "large": named("large")}

    def instructions(context: InstructionContext) -> str:
        seen.append((context.turn_id, str(context.session_settings.get("model"))))
        return f"model={context.session_settings.get('model')}"

    agent = AgentDefinition(
        name="settings-agent", instructions=instructions, model=models["small"],
        resolve_model=lambda settings: models.get(str(settings.get("model")), models["small"]),
    )
    flow = builtin_agent_session_flow(agent, "SettingsAgent")
    engine = InProcessEngine(tmp_path, [flow])
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s", "hi", session_settings={"model": "large"})
        first = await _turns_done(sessions, "s", 1)
        assert first.messages[-1].text == "large: model=large"
        assert await sessions.update_session_settings("s", {"model": "small"})
        assert await sessions.send_user_message("s", "again")
        second = await _turns_done(sessions, "s", 2)
        assert second.messages[-1].text == "small: model=small"
        assert second.session_settings == {"model": "small"}
        assert await sessions.update_session_settings("s", {})
        assert (await sessions.get_agent_snapshot("s")).session_settings is None
    assert seen == [("turn-1", "large"), ("turn-2", "small")]


async def test_continuation_after_an_answer_and_its_limit(tmp_path: Path) -> None:
    """ContinueTurn stores the answer and the message in the same turn; past 8 in a row the turn fails."""
    calls: list[int] = []

    def respond(request: ModelRequest) -> ScriptedModelReply:
        calls.append(len(request.input))
        return ScriptedModelReply(text=f"answer {len(calls)}")

    def decide(context: TurnContinuationContext) -> ContinueTurn | str:
        answer = "".join(item.text or "" for item in context.model_output)
        return "default" if answer == "answer 2" else ContinueTurn("Keep going.")

    flow, _ = scripted_flow(respond, decide_turn_continuation=decide)
    engine = InProcessEngine(tmp_path, [flow])
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s", "start")
        done = await _turns_done(sessions, "s", 1)
        texts = [(m.role.value, m.text, m.turn_id) for m in done.messages]
        assert texts == [("user", "start", "turn-1"), ("assistant", "answer 1", "turn-1"),
                         ("user", "Keep going.", "turn-1"), ("assistant", "answer 2", "turn-1")]
        assert done.usage.model_calls == 2

    flow2, _ = scripted_flow(lambda r: ScriptedModelReply(text="never done"),
                             decide_turn_continuation=lambda c: ContinueTurn("more"), flow_type="Forever")
    (tmp_path / "second").mkdir()
    engine2 = InProcessEngine(tmp_path / "second", [flow2])
    async with engine2.running():
        sessions = engine2.sessions()
        await sessions.start_session("s", "start")
        failed = await _turns_done(sessions, "s", 1)
        assert failed.state is not None and failed.state.last_turn_error == TURN_CONTINUATION_LIMIT_ERROR
        assert MAX_CONSECUTIVE_TURN_CONTINUATIONS == 8
        assert failed.usage.model_calls == 9  # the first answer plus 8 continuations
        assert failed.messages[-1].text == "never done"


@pytest.mark.parametrize("fault", ["returns None", "raises"])
async def test_a_continuation_hook_failing_after_an_answer_fails_the_turn_without_paying_again(
    tmp_path: Path, fault: str
) -> None:
    """A hook that forgets to return in one branch (None), or raises, after the model answered: the
    turn fails at once naming the hook's problem, the paid answer is stored, and the session goes
    on. Catches: the error failing the RunModel attempt, so the same answer was paid for on each
    of its three attempts and then lost with the turn."""

    def decide(context: TurnContinuationContext) -> Any:
        if context.tool_results:
            return "end"
        if fault == "raises":
            raise KeyError("verdict")
        return None

    flow, model = scripted_flow(lambda r: ScriptedModelReply(text="the answer"), decide_turn_continuation=decide)
    engine = InProcessEngine(tmp_path, [flow])
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s", "start")
        done = await _turns_done(sessions, "s", 1)
        assert await sessions.send_user_message("s", "again")
        again = await _turns_done(sessions, "s", 2)
    assert len(model.requests) == 2  # one per turn
    error = {"returns None": "decide_turn_continuation returned None; return 'end', 'default' or ContinueTurn",
             "raises": "decide_turn_continuation raised KeyError: 'verdict'"}[fault]
    assert done.state is not None and done.state.last_turn_error == error
    assert [(m.role, m.text) for m in done.messages] == [(MessageRole.USER, "start"),
                                                         (MessageRole.ASSISTANT, "the answer")]
    assert again.messages[-1].text == "the answer"


async def test_end_after_tools_completes_with_the_tool_result(tmp_path: Path) -> None:
    """'end' after tool calls completes the turn without another model call; the last message is the result."""

    def respond(request: ModelRequest) -> ScriptedModelReply:
        return ScriptedModelReply(tool_calls=[ScriptedToolCall("lookup_order", {"order_id": "A-9"})])

    def decide(context: TurnContinuationContext) -> str:
        return "end" if context.tool_results else "default"

    flow, model = scripted_flow(respond, decide_turn_continuation=decide)
    engine = InProcessEngine(tmp_path, [flow])
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s", "look it up")
        done = await _turns_done(sessions, "s", 1)
        assert len(model.requests) == 1
        assert done.usage.model_calls == 1
        assert done.messages[-1].role is MessageRole.TOOL
        assert json.loads(done.messages[-1].tool_output or "{}") == {"order_id": "A-9", "status": "shipped"}


class _Source:
    """A tool source listing one tool; records the references its calls come back with."""

    def __init__(self, name: str, tools: Sequence[str], *, fail: bool = False, delay: float = 0.0) -> None:
        self.source_name = name
        self.tools = tools
        self.fail = fail
        self.delay = delay
        self.executed: list[str | None] = []

    async def list_tools(self) -> Sequence[ModelToolDefinition]:
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.fail:
            raise ConnectionError("server down")
        return [ModelToolDefinition(t, f"{t} from {self.source_name}", {"type": "object", "properties": {}})
                for t in self.tools]

    def deferred_tool_call(self, call: ModelToolCall, listed_tool: ModelToolDefinition,
                           turn: AgentTurnContext) -> DeferredToolCall:
        return DeferredToolCall(call.tool_call_id, call.tool_name, call.arguments, ToolPolicy(ToolEffect.READ),
                                tool_source_reference=f"ref:{listed_tool.name}")

    async def execute_deferred_tool_call(self, call: DeferredToolExecution) -> ToolExecutionResult:
        self.executed.append(call.tool_call.tool_source_reference)
        return ToolExecutionResult(f"{self.source_name} ran {call.tool_call.tool_name}")


def _call_first_offered(request: ModelRequest) -> ScriptedModelReply:
    results = ScriptedModelClient.tool_results(request)
    if results:
        return ScriptedModelReply(text=results[0].output)
    names = [t.name for t in request.tools]
    return ScriptedModelReply(text=",".join(names), tool_calls=[ScriptedToolCall("remote_search", {})]
                              if "remote_search" in names else ())


async def _first_turn(tmp_path: Path, sources: list[Any], text: str, **definition: Any,
                      ) -> tuple[AgentSnapshot, ScriptedModelClient]:
    """The first turn of a scripted agent on `sources` that calls remote_search when listed."""
    flow, model = scripted_flow(_call_first_offered, tool_sources=sources, **definition)
    engine = InProcessEngine(tmp_path, [flow])
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s", text)
        return await _turns_done(sessions, "s", 1), model


async def test_tool_source_call_reaches_its_source_with_its_own_reference(tmp_path: Path) -> None:
    """Source tools are offered after function tools; the tool Step finds the source by its stored name."""
    source = _Source("search", ["remote_search"])
    down = _Source("down", ["never"], fail=True)
    done, model = await _first_turn(tmp_path, [down, source], "search")
    assert done.messages[-1].text == "search ran remote_search"
    assert [t.name for t in model.requests[0].tools] == ["lookup_order", "refund_order", "remote_search"]
    assert source.executed == ["ref:remote_search"]


async def test_tool_source_name_collision_fails_the_model_call(tmp_path: Path) -> None:
    """A listed name that repeats a function tool fails RunModel before any model request."""
    source = _Source("dupe", ["lookup_order"])
    done, model = await _first_turn(tmp_path, [source], "hi")
    assert done.state is not None
    assert done.state.last_turn_error == "tool lookup_order of a tool source uses the name of a function tool"
    assert len(model.requests) == 0


async def test_slow_tool_source_offers_nothing_in_that_call(tmp_path: Path) -> None:
    """A listing slower than tool_source_listing_timeout leaves its tools out; the turn goes on."""
    slow = _Source("slow", ["remote_search"], delay=5.0)
    done, _ = await _first_turn(tmp_path, [slow], "hi", tool_source_listing_timeout=timedelta(milliseconds=50))
    assert done.messages[-1].text == "lookup_order,refund_order"


def test_a_run_model_timeout_no_longer_than_the_listing_timeout_is_refused() -> None:
    """Options whose RunModel timeout (5 s) is not longer than the agent's listing timeout (10 s, the
    default) are refused when the Flow is built, naming both; without tool sources nothing is listed,
    and they are taken. Catches: they were taken, and a source that did not answer failed each turn
    with "the attempt passed its deadline" where it was to offer no tools (agents.md "Tool sources")."""
    model = ScriptedModelClient(lambda r: ScriptedModelReply(text="x"))
    short = RunModelLimit(timeout=timedelta(seconds=5))
    with_source = AgentDefinition(name="lister", instructions="", model=model, tool_sources=[_Source("s", ["t"])])
    options = replace(builtin_agent_session_options(with_source), run_model_limit=short)
    with pytest.raises(ValueError) as refused:
        AgentSessionFlow(BuiltinLoopAgentRunner(with_source), "Lister", options)
    assert str(refused.value) == (
        "AgentSessionOptions that do not fit AgentDefinition 'lister': the AgentDefinition's "
        "tool_source_listing_timeout (0:00:10) is not shorter than the options' run_model_limit.timeout (0:00:05), "
        "which the listing shares: a tool source that does not answer would fail the turn instead of offering no "
        "tools; lower tool_source_listing_timeout, or raise RunModelLimit.timeout")
    shorter = replace(with_source, tool_source_listing_timeout=timedelta(seconds=4))
    AgentSessionFlow(BuiltinLoopAgentRunner(shorter), "Lister", options)
    without = AgentDefinition(name="plain", instructions="", model=model)
    AgentSessionFlow(BuiltinLoopAgentRunner(without), "Plain",
                     replace(builtin_agent_session_options(without), run_model_limit=short))


def test_options_whose_compaction_window_the_models_output_fills_are_refused() -> None:
    """A compaction policy set in the options (replace(builtin_agent_session_options(...), ...)), whose
    window the model's max_output_tokens fills, is refused when the Flow is built, as the same policy
    in the AgentDefinition is. Catches: it was taken, and every summary call left out the whole
    conversation it was to summarize."""
    model = ScriptedModelClient(lambda r: ScriptedModelReply(text="x"))
    definition = AgentDefinition(name="summarizer", instructions="", model=model,
                                 model_settings={"max_output_tokens": 4096})
    options = replace(builtin_agent_session_options(definition),
                      compaction=CompactionPolicy(context_window_tokens=4000))
    with pytest.raises(ValueError) as refused:
        AgentSessionFlow(BuiltinLoopAgentRunner(definition), "Summarizer", options)
    assert str(refused.value) == (
        "AgentSessionOptions that do not fit AgentDefinition 'summarizer': the options' compaction: "
        "model_settings' max output tokens (4096) leave no room in the compaction window (4000 tokens) for the "
        "summary call's input; lower it, or raise context_window_tokens")
    roomy = replace(options, compaction=CompactionPolicy(context_window_tokens=40_000))
    AgentSessionFlow(BuiltinLoopAgentRunner(definition), "Summarizer", roomy)


def test_options_enabling_a_built_in_tool_a_function_tool_is_named_after_are_refused() -> None:
    """Options (replace(builtin_agent_session_options(...), ...)) enabling ask_user for an agent with
    a function tool of that name are refused when the Flow is built, as the definition refuses it.
    Catches: they were taken, and every turn failed ("tool ask_user uses the name of an enabled
    built-in tool")."""

    @function_tool(effect=ToolEffect.READ)
    def ask_user(question: str) -> str:
        """Ask the user."""
        return question

    model = ScriptedModelClient(lambda r: ScriptedModelReply(text="x"))
    definition = AgentDefinition(name="asker", instructions="", model=model, tools=[ask_user])
    options = replace(builtin_agent_session_options(definition), built_in_tools=frozenset({BuiltInTool.ASK_USER}))
    with pytest.raises(ValueError) as refused:
        AgentSessionFlow(BuiltinLoopAgentRunner(definition), "Asker", options)
    assert str(refused.value) == (
        "AgentSessionOptions that do not fit AgentDefinition 'asker': the options' built_in_tools: tool ask_user "
        "uses the name of an enabled built-in tool; rename the tool, or leave that built-in tool out")
    others = replace(options, built_in_tools=frozenset({BuiltInTool.DURABLE_WAIT}))
    AgentSessionFlow(BuiltinLoopAgentRunner(definition), "Asker", others)


def test_agent_definition_refuses_bad_tools() -> None:
    """Duplicate function tools, duplicate source names and a bad limit are refused when built."""
    model = ScriptedModelClient(lambda r: ScriptedModelReply(text="x"))

    with pytest.raises(ValueError, match="two function tools are named 'lookup_order'"):
        AgentDefinition(name="a", instructions="", model=model, tools=[lookup_order, lookup_order])
    with pytest.raises(ValueError, match="two tool sources are named 'x'"):
        AgentDefinition(name="a", instructions="", model=model, tool_sources=[_Source("x", []), _Source("x", [])])
    with pytest.raises(ValueError, match="max_model_calls_per_turn must be a whole number >= 1, got 0"):
        AgentDefinition(name="a", instructions="", model=model, max_model_calls_per_turn=0)
    with pytest.raises(ValueError, match="model must be a ModelClient"):
        AgentDefinition(name="a", instructions="", model="gpt")  # type: ignore[arg-type]


@pytest.mark.parametrize(("field", "value", "message"), [
    ("interrupt_deadline", timedelta(0), "interrupt_deadline must be a positive timedelta or None, got "),
    ("interrupt_deadline", 300, "interrupt_deadline must be a positive timedelta or None, got 300"),
    ("interrupt_deadline", True, "interrupt_deadline must be a positive timedelta or None, got True"),
    ("interrupt_deadline", timedelta(days=367), "interrupt_deadline must be at most 366 days"),
    ("max_durable_wait", timedelta(0), "max_durable_wait must be a timedelta from 1 second to 366 days"),
    ("max_durable_wait", float("nan"), "max_durable_wait must be a timedelta from 1 second to 366 days"),
    ("default_tool_effect", "read", "default_tool_effect must be a ToolEffect, such as ToolEffect.READ, got 'read'"),
    ("default_tool_effect", None, "default_tool_effect must be a ToolEffect, such as ToolEffect.READ, got None"),
    ("tool_policies", {"lookup_order": "read"},
     "tool_policies['lookup_order'] is 'read', not a ToolPolicy; give a ToolPolicy"),
    ("tool_policies", {"lookup_order": ToolEffect.READ}, "tool_policies['lookup_order'] is <ToolEffect.READ: 'read'>"),
    ("tool_policies", {"": ToolPolicy(ToolEffect.READ)}, "tool_policies key '' is not a tool name"),
    ("tool_policies", {3: ToolPolicy(ToolEffect.READ)}, "tool_policies key 3 is not a tool name"),
    # Catches: a setting name that is not text taken, then failing every model call of LiteLLM
    # (keyword arguments) with a bare TypeError, in a Worker.
    ("model_settings", {1: 2}, "model_settings key 1 is not a setting name; use its name as text"),
    ("model_settings", {"": 2}, "model_settings key '' is not a setting name"),
    ("tool_source_listing_timeout", timedelta(0),
     "tool_source_listing_timeout must be a positive timedelta shorter than RunModel's timeout (0:15:00), got "),
    ("tool_source_listing_timeout", 10, "tool_source_listing_timeout must be a positive timedelta"),
    # Catches: a listing that may outlast RunModel's timeout taken, then a hung source failing every
    # turn ("execute passed its timeout") where it was to offer no tools (agents.md "Tool sources").
    ("tool_source_listing_timeout", timedelta(minutes=15),
     "tool_source_listing_timeout must be a positive timedelta shorter than RunModel's timeout (0:15:00), got "
     "datetime.timedelta(seconds=900)"),
    ("event_stream_capacity_bytes", 0, "event_stream_capacity_bytes must be a whole number of bytes from 1 to "),
    ("event_stream_capacity_bytes", -1, "event_stream_capacity_bytes must be a whole number of bytes from 1 to "),
    ("event_stream_capacity_bytes", True, "event_stream_capacity_bytes must be a whole number of bytes from 1 to "),
    ("event_stream_capacity_bytes", 1.5, "event_stream_capacity_bytes must be a whole number of bytes from 1 to "),
    ("event_stream_capacity_bytes", None, "event_stream_capacity_bytes must be a whole number of bytes from 1 to "),
    ("event_stream_capacity_bytes", "1MiB", "event_stream_capacity_bytes must be a whole number of bytes from 1 to "),
    # Past the engine Stream's 64-bit capacity: refused by the Stream, naming neither field.
    ("event_stream_capacity_bytes", 2**63,
     f"event_stream_capacity_bytes must be a whole number of bytes from 1 to {2**63 - 1}, got {2**63}"),
])
def test_agent_definition_refuses_a_bad_value_where_it_is_written(
    field: str, value: object, message: str
) -> None:
    """AgentDefinition refuses each field its derived AgentSessionOptions would refuse, naming its own
    field and the value. Catches: any value taken by AgentDefinition, then refused by
    builtin_agent_session_flow as "invalid AgentSessionOptions" (or by the engine's Stream), objects
    the caller never wrote (and never, when the definition only backs a runner)."""
    model = ScriptedModelClient(lambda r: ScriptedModelReply(text="x"))
    with pytest.raises(ValueError, match=re.escape("invalid AgentDefinition: " + message)) as refused:
        AgentDefinition(name="a", instructions="", model=model, **{field: value})
    assert "AgentSessionOptions" not in str(refused.value)


def test_a_name_that_cannot_be_a_flow_type_is_named_as_the_agent_s_name() -> None:
    """Without flow_type the flow type is the definition's name. Catches: AgentDefinition(name=
    "Support Agent") refused by builtin_agent_session_flow as a "flow type", which the caller
    never wrote, with no word that it is the name or that flow_type= would do."""
    model = ScriptedModelClient(lambda r: ScriptedModelReply(text="x"))
    agent = AgentDefinition(name="Support Agent", instructions="", model=model)
    with pytest.raises(InvalidIdError, match=re.escape(
        "the AgentDefinition's name 'Support Agent' is the flow type when flow_type is not given, and flow type "
        "'Support Agent' contains whitespace")) as refused:
        builtin_agent_session_flow(agent)
    assert "pass flow_type= (such as 'SupportAgent') or rename the agent" in str(refused.value)
    assert builtin_agent_session_flow(agent, flow_type="SupportAgent").flow_type == "SupportAgent"


async def test_failed_turn_pairs_every_stored_call_with_a_result(tmp_path: Path) -> None:
    """RecordTurnFailure stores the loop's results for the stored calls, then the note; the next request is paired."""
    failing = {"on": True}

    def respond(request: ModelRequest) -> ScriptedModelReply:
        text = ScriptedModelClient.user_texts(request)[-1]
        if ScriptedModelClient.tool_results(request) and failing["on"]:
            raise RuntimeError("provider down")
        if text == "use the tool":
            return ScriptedModelReply(tool_calls=[ScriptedToolCall("lookup_order", {"order_id": "B-2"})])
        return ScriptedModelReply(text=f"echo: {text}")

    flow, model = scripted_flow(respond)
    engine = InProcessEngine(tmp_path, [flow])
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s", "use the tool")
        failed = await _turns_done(sessions, "s", 1)
        assert failed.state is not None and failed.state.last_turn_error == "provider down"
        roles = [m.role for m in failed.messages]
        assert roles == [MessageRole.USER, MessageRole.ASSISTANT, MessageRole.TOOL, MessageRole.USER]
        assert (failed.messages[-1].text or "").startswith("[Dex] The previous turn failed after these tool calls ran:")
        failing["on"] = False
        await sessions.send_user_message("s", "next")
        await _turns_done(sessions, "s", 2)
        request = model.requests[-1].input
        calls = [i for i in request if isinstance(i, ModelOutputItem) and i.tool_call is not None]
        results = [i for i in request if isinstance(i, ToolResultInput)]
        assert [c.tool_call.tool_call_id for c in calls if c.tool_call] == [r.tool_call_id for r in results]
        assert isinstance(request[-1], UserTextInput) and request[-1].text == "next"


def test_orphaned_call_gets_the_outcome_unknown_text() -> None:
    """A stored call without a stored result reaches the model paired with the outcome-unknown text."""
    from dex_agents.builtin_loop._loop_runner import _paired

    call = ModelOutputItem("scripted", OutputItemKind.TOOL_CALL, "{}", None, ModelToolCall("c1", "t", "{}"))
    items = _paired([UserTextInput("hi"), call, UserTextInput("later")])
    assert items[2] == ToolResultInput("c1", "t", OUTCOME_UNKNOWN_TEXT)
    assert items[3] == UserTextInput("later")


@pytest.mark.slow
async def test_worker_killed_during_run_model_reruns_only_that_model_call(tmp_path: Path) -> None:
    """SIGKILL during the second turn's model call: that call runs twice, every other call once."""
    flow = gated_flow(tmp_path)
    async with AgentTestStack(tmp_path, [flow], "agents.tests.builtin_worker", worker_cwd=REPO_ROOT) as stack:
        sessions = stack.sessions(flow)
        worker = await stack.start_worker()
        await sessions.start_session("s", "/tool")
        await _turns_done(sessions, "s", 1)
        await sessions.send_user_message("s", "/gate model")
        gate = FileGate(tmp_path, "model")
        await gate.wait_until_reached()
        worker.kill()
        gate.release()
        await stack.start_worker()
        done = await _turns_done(sessions, "s", 2)
        assert done.messages[-1].text == "released"
        log = InvocationLog(tmp_path / "invocations.log")
        counts = {text: log.count("model_call", text=text) for text in ("/tool", "/gate model")}
        assert counts == {"/tool": 2, "/gate model": 2}  # /tool: two model calls of turn 1, once each
        assert [e["inputs"] for e in log.entries("model_call", text="/tool")] == [1, 3]
        history = await stack.read_step_history("s")
        assert executed_steps(history).count("RunModel") == 3
        # The killed model call had written nothing durable: the same attempt is handed out again.
        killed = [e for e in history if e.step_execution_id == "RunModel-3" and e.event_type == "execute_completed"]
        assert len(killed) == 1


@pytest.mark.slow
async def test_worker_stopped_while_a_sync_tool_hangs_exits_and_records_the_write_unknown(tmp_path: Path) -> None:
    """SIGTERM while a sync write blocks its thread for good: the Worker exits 0 within the shutdown
    grace (the tool's daemon thread holds no process up), the write is recorded outcome_unknown by
    the next Worker and never runs again, and the turn goes on. Catches: a thread that the event
    loop or the interpreter joins at its end, holding a deploy's restart up for ever."""
    flow = gated_flow(tmp_path)
    async with AgentTestStack(tmp_path, [flow], "agents.tests.builtin_worker", worker_cwd=REPO_ROOT) as stack:
        sessions = stack.sessions(flow)
        worker = await stack.start_worker()
        await sessions.start_session("s", "/hang")
        await FileGate(tmp_path, "hang").wait_until_reached()
        started = time.monotonic()
        assert await worker.stop(timeout=30) == 0, worker.log_tail()
        assert time.monotonic() - started < 15  # the 5 s grace, then the exit
        await stack.start_worker()
        done = await _turns_done(sessions, "s", 1)
        assert done.messages[-1].text == "after the tool"
        events = (await sessions.read_agent_events("s", limit=1000)).events
        finished = [json.loads(e.value.payload) for e in events if e.value.type == "tool_call_finished"]
        assert [(f["tool_name"], f["status"]) for f in finished] == [("hang_write", "outcome_unknown")]
        assert InvocationLog(tmp_path / "invocations.log").count("hang_write") == 1
        steps = executed_steps(await stack.read_step_history("s"))
        assert "RecordToolOutcomeUnknown" in steps and "CallSingleAttemptTool" not in steps


async def test_a_sync_tools_result_after_its_worker_stopped_is_never_recorded(tmp_path: Path) -> None:
    """A sync read still blocked in its thread when its Worker stops: the stop ends at the grace,
    not when the tool returns; the next Worker (same process, same event loop) runs the call again
    and records that run's result. The first thread's later result reaches nothing: it is neither
    recorded nor reported as an error of the loop."""
    first_started, release_first = threading.Event(), threading.Event()
    runs: list[int] = []

    @function_tool(effect=ToolEffect.READ)
    def slow_read() -> str:
        """A read whose first run blocks until released."""
        runs.append(len(runs) + 1)
        if len(runs) == 1:
            first_started.set()
            release_first.wait(30)
            return "stale"
        return "fresh"

    reported: list[dict[str, Any]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _loop, context: reported.append(context))
    flow, _ = scripted_flow(tool_then_answer, tools=[slow_read])
    engine = InProcessEngine(tmp_path, [flow])
    registry = Registry([flow])
    options = WorkerOptions(database_url=engine.url, shutdown_grace_seconds=0.5, **FAST_WORKER)
    sessions = engine.sessions()
    try:
        first = AsyncWorker(registry, options)
        running = asyncio.create_task(first.run())
        await sessions.start_session("s", "/tool slow_read {}")
        await asyncio.to_thread(first_started.wait, 30)
        async with asyncio.timeout(10):  # the grace, then the running attempt is revoked
            await first.stop()
            await running
        release_first.set()  # the first run returns "stale" now, to nobody
        second = AsyncWorker(registry, options)
        running = asyncio.create_task(second.run())
        done = await _turns_done(sessions, "s", 1)
        await second.stop()
        await running
    finally:
        release_first.set()
        await engine.client.close()
    assert done.messages[-1].text == "results: slow_read=fresh"
    assert runs == [1, 2]
    assert reported == []


@pytest.mark.parametrize(("effect", "result"), [
    (ToolEffect.READ, "The tool call failed: RuntimeError: tool find_order raised StopIteration"),
    (ToolEffect.NON_IDEMPOTENT_WRITE, OUTCOME_UNKNOWN_TEXT),
])
async def test_a_sync_tool_raising_stop_iteration_fails_its_call_by_effect(
    tmp_path: Path, db_url: str, effect: ToolEffect, result: str  # noqa: F811 - the fixture
) -> None:
    """A sync tool whose `next()` finds nothing lets StopIteration out of its thread. The call fails
    by its effect, once, and the turn goes on. Catches: StopIteration cannot be set on an asyncio
    Future, so the call's result was lost in the event loop and the tool Step, heartbeating, waited
    for it for ever: the session stuck in its turn."""
    runs: list[str] = []

    @function_tool(effect=effect, requires_approval=False)
    def find_order(order_id: str) -> str:
        """Find an order by ID."""
        runs.append(order_id)
        return next(order for order in ("A-1", "A-2") if order == order_id)

    flow, _ = scripted_flow(tool_then_answer, tools=[find_order])
    engine = InProcessEngine(tmp_path, [flow], url=db_url)
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s", '/tool find_order {"order_id": "B-9"}')
        done = await wait_for_agent_snapshot(
            sessions, "s", lambda s: s if s.state is not None and s.state.turn_count >= 1 else None,
            description="the turn to end", timeout=20)
    assert done.messages[-1].text == f"results: find_order={result}"
    assert done.state is not None and done.state.last_turn_error is None
    assert runs == ["B-9"]


async def test_function_tool_asks_a_question_and_runs_again_with_the_answer(tmp_path: Path) -> None:
    """A function tool that returns ToolInputRequested asks the user; the answer and its continuation
    reach the second call through ToolCallContext, and the model sees the second call's output."""
    calls: list[tuple[tuple[str, ...], str | None]] = []

    @function_tool(effect=ToolEffect.NON_IDEMPOTENT_WRITE, requires_approval=False)
    async def ship_order(order_id: str, context: ToolCallContext) -> str | ToolInputRequested:
        """Ship an order with the carrier the user picks."""
        calls.append((tuple(a.answer for a in context.input_answers), context.input_continuation))
        if not context.input_answers:
            return ToolInputRequested(question=f"Which carrier for {order_id}?", choices=("ups", "dhl"),
                                      allows_free_text=False, continuation="step-1")
        return f"shipped {order_id} with {context.input_answers[-1].answer}"

    flow, _ = scripted_flow(tool_then_answer, tools=[ship_order])
    engine = InProcessEngine(tmp_path, [flow])
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s", '/tool ship_order {"order_id": "A-7"}')
        asking = await wait_for_agent_snapshot(
            sessions, "s", lambda s: s if s.pending_interrupts else None, description="the tool's question")
        question = asking.pending_interrupts[0]
        assert question.interrupt_id.endswith("-input-1")
        assert question.question == "Which carrier for A-7?" and list(question.choices) == ["ups", "dhl"]
        assert not await sessions.answer_question("s", question.interrupt_id, "fedex")  # not a choice
        assert await sessions.answer_question("s", question.interrupt_id, "dhl")
        done = await _turns_done(sessions, "s", 1)
        assert done.messages[-1].text == "results: ship_order=shipped A-7 with dhl"
        assert calls == [((), None), (("dhl",), "step-1")]
        steps = executed_steps(to_step_history(await engine.client.get_flow_history("s")))
        # AwaitQuestionAnswer runs twice: it raises the question, then applies the answer.
        assert steps == ["StartAgentSession", "RunModel", "CallSingleAttemptTool", "AwaitQuestionAnswer",
                         "AwaitQuestionAnswer", "CallSingleAttemptTool", "ResumeTurn", "RunModel"]


def test_stored_items_are_parsed_once_per_process_and_the_cache_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each model call reads the whole conversation: a stored message's input item is parsed once
    and shared (items are frozen), equal messages share it, and the cache drops its oldest entry at
    its bound. Catches an unbounded cache, or one that hands a message another message's item."""
    from dex_agents import AgentMessage
    from dex_agents._constants import INPUT_ITEM_CACHE_CHARS
    from dex_agents.builtin_loop import _items

    def stored(sequence: int, text: str) -> AgentMessage:
        built = _items.user_message(text)
        return AgentMessage(sequence, "t1", MessageRole.USER, text, None, None, None, None, built.framework_item,
                            "2026-01-01T00:00:00.000Z")

    monkeypatch.setattr(_items, "_parsed", _items._ParsedItems(3, INPUT_ITEM_CACHE_CHARS))
    first = _items.input_item(stored(1, "one"))
    assert first == _items.UserTextInput("one")
    assert _items.input_item(stored(1, "one")) is first, "an equal stored message was parsed again"
    assert _items.input_item(stored(2, "two")) == _items.UserTextInput("two")
    for n in range(3, 6):
        _items.input_item(stored(n, f"m{n}"))
    assert len(_items._parsed.items) == 3
    assert [m.sequence for m in _items._parsed.items] == [3, 4, 5]
    assert _items.input_item(stored(1, "one")) == first


def test_agent_definition_refuses_fields_of_the_wrong_kind_and_names_it_cannot_use() -> None:
    """Each refused when the agent is built, naming the field. Catches: bare TypeErrors (None for
    tools, model_settings); a hook given as text failing every turn after paid model calls; a
    source without a text name whose calls could never find it again; a declared name that an
    enabled built-in tool shadows failing every turn instead of the definition."""
    model = ScriptedModelClient(lambda r: ScriptedModelReply(text="x"))

    def refused(match: str, **fields: Any) -> None:
        with pytest.raises(ValueError, match=match):
            AgentDefinition(**{"name": "a", "instructions": "", "model": model, **fields})

    refused(r"tools must be a list of FunctionTool, got None", tools=None)
    refused(r"tools must be a list of FunctionTool, got FunctionTool", tools=lookup_order)
    refused(r"tool_sources must be a list of ToolSource objects, got None", tool_sources=None)
    refused(r"model_settings must be a dict of the model client's settings, got 'fast'", model_settings="fast")
    refused(r"tool_policies must be a dict of tool name to ToolPolicy, got None", tool_policies=None)
    refused(r"decide_turn_continuation must be a function of TurnContinuationContext or None, got 'end'",
            decide_turn_continuation="end")
    refused(r"resolve_model must be a function of the session settings or None, got 'gpt-5'", resolve_model="gpt-5")
    nameless = _Source("x", [])
    nameless.source_name = None  # type: ignore[assignment]
    refused(r"has source_name None; give it a unique, non-empty text name", tool_sources=[nameless])
    refused(r"tool ask_user uses the name of an enabled built-in tool",
            tool_sources=[_Declaring("s", ["ask_user"])], built_in_tools=frozenset({BuiltInTool.ASK_USER}))
    refused(r"tool write_todos uses the name of an enabled built-in tool",
            tool_sources=[_Declaring("s", ["write_todos"])], plan_mode_enabled=True)
    refused(r"tool source 's' lists a tool named a more than once", tool_sources=[_Declaring("s", ["a", "a"])])
    refused(r"tool source 's' declares a tool name '', not non-empty text", tool_sources=[_Declaring("s", [""])])
    refused(r"tool source 's' declares a tool name \['a'\], not non-empty text",
            tool_sources=[_Declaring("s", [["a"]])])  # type: ignore[list-item]
    # Catches: text taken as one declared name per character, anything else not a list failing with a
    # bare TypeError that named no source.
    refused(r"declared_tool_names\(\) of tool source 's' returned 'abc'; return a list of tool names",
            tool_sources=[_Declaring("s", "abc")])
    refused(r"declared_tool_names\(\) of tool source 's' returned 3; return a list of tool names",
            tool_sources=[_Declaring("s", 3)], built_in_tools=frozenset({BuiltInTool.ASK_USER}))  # type: ignore[arg-type]


class _Declaring(_Source):
    def __init__(self, name: str, declared: Sequence[str]) -> None:
        super().__init__(name, declared)

    def declared_tool_names(self) -> Sequence[str]:
        return self.tools


class _OddListing(_Source):
    """Lists one good tool after definitions a model cannot be offered (an MCP tool without a
    description, say), or raises CancelledError as a client library whose server died can."""

    def __init__(self, *, cancelled: bool = False) -> None:
        super().__init__("odd", ["remote_search"])
        self.cancelled = cancelled

    async def list_tools(self) -> Sequence[ModelToolDefinition]:
        if self.cancelled:
            raise asyncio.CancelledError
        good = await super().list_tools()
        return [ModelToolDefinition("nodesc", None, {}), ModelToolDefinition("noschema", "d", None),  # type: ignore[arg-type]
                {"name": "plain"}, ModelToolDefinition("", "d", {}),  # type: ignore[list-item]
                ModelToolDefinition("files.read", "d", {}), ModelToolDefinition("3d_render", "d", {}), *good]


@pytest.mark.parametrize("cancelled", [False, True])
async def test_a_malformed_listing_leaves_out_what_cannot_be_offered(tmp_path: Path, cancelled: bool) -> None:
    """Bad definitions are left out and the rest offered; a listing cancelled by the source's own
    library offers nothing. Catches: each failing every turn with errors like `'NoneType' object is
    not iterable` or `CancelledError()`, where the seed says a down server never fails a turn."""
    done, model = await _first_turn(tmp_path, [_OddListing(cancelled=cancelled)], "search")
    assert done.state is not None and done.state.last_turn_error is None
    offered = [t.name for t in model.requests[0].tools]
    if cancelled:
        assert offered == ["lookup_order", "refund_order"]
    else:
        assert offered == ["lookup_order", "refund_order", "remote_search"]
        assert done.messages[-1].text == "odd ran remote_search"


class _BadCallSource(_Source):
    """A source whose deferred_tool_call raises, returns no DeferredToolCall, a reference that is not
    text, or a call under an ID of its own."""

    def __init__(self, fault: str) -> None:
        super().__init__("odd", ["remote_search"])
        self.fault = fault

    def deferred_tool_call(self, call: ModelToolCall, listed_tool: ModelToolDefinition,
                           turn: AgentTurnContext) -> DeferredToolCall:
        if self.fault == "raises":
            raise RuntimeError("the source could not build the call")
        if self.fault == "returns None":
            return None  # type: ignore[return-value]
        if self.fault == "another call ID":
            return DeferredToolCall(f"odd-{call.tool_call_id}", call.tool_name, call.arguments,
                                    ToolPolicy(ToolEffect.READ), tool_source_reference="search")
        return DeferredToolCall(call.tool_call_id, call.tool_name, call.arguments, ToolPolicy(ToolEffect.READ),
                                tool_source_reference={"operation": "search"})  # type: ignore[arg-type]


@pytest.mark.parametrize("fault", ["raises", "returns None", "reference not text", "another call ID"])
async def test_a_source_that_cannot_build_its_call_fails_that_call_and_pays_one_model_call(
    tmp_path: Path, fault: str
) -> None:
    """The model call that asked for the tool is made once: the call fails as unknown without
    reaching the source, and the turn goes on. Catches: the error (or a dict reference, which the
    source got back as None) failing the RunModel attempt, so the paid model call ran three times
    and the turn failed; a call under another ID than the model's running, its result stored apart
    from the model's call, which the model was told had an unknown outcome."""
    source = _BadCallSource(fault)
    done, model = await _first_turn(tmp_path, [source], "search")
    assert len(model.requests) == 2  # the call, then the answer after its result
    assert done.state is not None and done.state.last_turn_error is None
    assert done.messages[-1].text == f"The tool call failed: {unknown_tool_error('remote_search')}"
    assert source.executed == []


def test_listed_tool_problems_name_what_is_wrong() -> None:
    assert listed_tool_problem(ModelToolDefinition("t", "d", {"type": "object"})) is None
    assert listed_tool_problem({"name": "t"}) == "{'name': 't'} is not a ModelToolDefinition"
    assert listed_tool_problem(ModelToolDefinition(" ", "d", {})) == (
        "tool name ' ' is not one providers accept: a tool name is 1 to 64 characters of letters, digits, "
        "'_' and '-', starting with a letter or '_'")
    assert listed_tool_problem(ModelToolDefinition("files.read", "d", {})) == (
        "tool name 'files.read' is not one providers accept: a tool name is 1 to 64 characters of letters, digits, "
        "'_' and '-', starting with a letter or '_'")
    assert listed_tool_problem(ModelToolDefinition("t" * 65, "d", {})) is not None
    assert listed_tool_problem(ModelToolDefinition("t", None, {})) == "tool t's description is None, not text"  # type: ignore[arg-type]
    assert listed_tool_problem(ModelToolDefinition("t", "d", [])) == (  # type: ignore[arg-type]
        "tool t's parameters_schema is [], not a JSON Schema object")


class _TaskSource(_Source):
    """A source whose calls start tasks it polls and cancels itself, and that gives its calls a
    tool Step timeout; `hang` makes a call hang instead, as a server that stops answering."""

    def __init__(self, *, hang: bool = False, poll_interval: int = 1) -> None:
        super().__init__("tasks", ["remote_search"])
        self.hang = hang
        self.poll_interval = poll_interval
        self.polled: list[str | None] = []
        self.cancelled: list[str | None] = []
        self.options_for: list[str | None] = []
        self.supports_tool_tasks: list[bool] = []

    async def execute_deferred_tool_call(self, call: DeferredToolExecution) -> Any:
        self.supports_tool_tasks.append(call.supports_tool_tasks)
        if self.hang:
            await asyncio.sleep(3600)
        return ToolTaskStarted(task_id="task-1", poll_interval_seconds=self.poll_interval)

    async def poll_tool_task(self, poll: ToolTaskPoll) -> ToolTaskPollOutcome:
        self.polled.append(poll.tool_call.tool_source_reference)
        return ToolExecutionResult(f"task {poll.tool_call.task_id} done")

    async def cancel_tool_task(self, cancellation: ToolTaskCancellation) -> None:
        self.cancelled.append(cancellation.tool_call.tool_source_reference)

    def tool_call_step_options(self, call: DeferredToolCall) -> ToolCallStepOptions:
        self.options_for.append(call.tool_source_reference)
        return ToolCallStepOptions(timeout=timedelta(seconds=1))


async def test_a_sources_task_is_polled_by_that_source(tmp_path: Path) -> None:
    """A listed tool's task goes to its source's poll_tool_task, with the source's own reference.
    Catches: the runner lacking poll_tool_task, so the call failed with MISSING_TOOL_TASK_POLLER
    (seed 003: "tool tasks work as for any tool")."""
    source = _TaskSource()
    done, _ = await _first_turn(tmp_path, [source], "search")
    assert done.messages[-1].text == "task task-1 done"
    assert source.supports_tool_tasks == [True]
    assert source.polled == ["ref:remote_search"]
    assert source.options_for == ["ref:remote_search"]


async def test_a_cancelled_turn_cancels_the_sources_task(tmp_path: Path) -> None:
    """cancel_turn abandons a source's task; the source's cancel_tool_task is asked to stop it."""
    source = _TaskSource(poll_interval=600)
    flow, _ = scripted_flow(_call_first_offered, tool_sources=[source])
    engine = InProcessEngine(tmp_path, [flow])
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s", "search")
        waiting = await wait_for_agent_snapshot(
            sessions, "s", lambda s: s if any(c.task_id for c in s.tool_calls) else None,
            description="the source's task to start")
        assert waiting.state is not None and waiting.state.active_turn_id is not None
        assert await sessions.cancel_turn("s", waiting.state.active_turn_id)
        await _turns_done(sessions, "s", 1)
        await wait_for_agent_snapshot(sessions, "s", lambda s: s if source.cancelled else None,
                                      description="the source's cancel_tool_task")
        assert source.cancelled == ["ref:remote_search"]
        assert source.polled == []


async def test_a_sources_tool_step_options_bound_its_call(tmp_path: Path) -> None:
    """A source's tool_call_step_options timeout ends a call whose server stops answering. Catches:
    the options never asked for, so the turn hung on a tool Step with no deadline."""
    source = _TaskSource(hang=True)
    done, _ = await _first_turn(tmp_path, [source], "search")
    assert source.options_for == ["ref:remote_search"]
    answer = done.messages[-1].text or ""  # the model's answer quotes the call's result
    assert answer.startswith("The tool call failed:") and "passed its" in answer, answer  # timeout or deadline


class _PlainDefSource:
    """A source written with plain `def` methods (a sync HTTP client, say): the ToolSource protocol's
    `async def` returning Any accepts them for mypy, and isinstance only checks the names."""

    source_name = "plain"

    def __init__(self, effect: ToolEffect, *, task: bool = False) -> None:
        self.effect = effect
        self.task = task
        self.executed: list[str] = []
        self.polled: list[str] = []

    def list_tools(self) -> Sequence[ModelToolDefinition]:
        return [ModelToolDefinition("remote_search", "Search remotely.", {"type": "object", "properties": {}})]

    def deferred_tool_call(self, call: ModelToolCall, listed_tool: ModelToolDefinition,
                           turn: AgentTurnContext) -> DeferredToolCall:
        return DeferredToolCall(call.tool_call_id, call.tool_name, call.arguments,
                                ToolPolicy(self.effect, requires_approval=False), tool_source_reference="op")

    def execute_deferred_tool_call(self, call: DeferredToolExecution) -> Any:
        self.executed.append(call.tool_call.tool_call_id)
        if self.task:
            return ToolTaskStarted(task_id="task-1", poll_interval_seconds=1)
        return ToolExecutionResult(f"ran {call.tool_call.tool_name}")

    def poll_tool_task(self, poll: ToolTaskPoll) -> ToolTaskPollOutcome:
        self.polled.append(poll.tool_call.tool_call_id)
        return ToolExecutionResult(f"task {poll.tool_call.task_id} done")


@pytest.mark.parametrize(("effect", "task"), [
    (ToolEffect.READ, False), (ToolEffect.NON_IDEMPOTENT_WRITE, False), (ToolEffect.READ, True),
])
async def test_a_source_with_plain_def_methods_is_listed_and_its_call_runs_once(
    tmp_path: Path, effect: ToolEffect, task: bool
) -> None:
    """Its listing offers its tool, and a call's result (or its task's) is the call's result, after
    one run. Catches: the runner awaiting what the plain def returned, after the work was done: the
    listing offered nothing in every model call; a write that succeeded was recorded outcome_unknown,
    and a read ran three times and was recorded failed (as the session already avoids for a
    runner's own plain def methods)."""
    source = _PlainDefSource(effect, task=task)
    done, model = await _first_turn(tmp_path, [source], "search")
    assert "remote_search" in [t.name for t in model.requests[0].tools]
    assert done.messages[-1].text == ("task task-1 done" if task else "ran remote_search")
    assert len(source.executed) == 1
    assert len(source.polled) == (1 if task else 0)


async def _own_tool_turn(tmp_path: Path, runner: type[BuiltinLoopAgentRunner]) -> tuple[str | None, list[str]]:
    """One turn calling lookup_order on a `runner` subclass: the call's result, and the event types."""
    definition = AgentDefinition(name="a", instructions="", model=ScriptedModelClient(tool_then_answer),
                                 tools=[lookup_order])
    flow = AgentSessionFlow(runner(definition), "OwnTasks", builtin_agent_session_options(definition))
    engine = InProcessEngine(tmp_path, [flow])
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s", '/tool lookup_order {"order_id": "A-1"}')
        done = await _turns_done(sessions, "s", 1)
        (result,) = [m for m in done.messages if m.role is MessageRole.TOOL]
        return result.tool_output, [e.value.type for e in (await sessions.read_agent_events("s")).events]


async def test_a_task_no_source_started_fails_at_once_with_missing_poller(tmp_path: Path) -> None:
    """A subclass whose own tool starts a task but that does not override poll_tool_task is told
    supports_tool_tasks=False, and a task it starts anyway is recorded by its effect with
    MISSING_TOOL_TASK_POLLER when it starts, as on a runner with no poll_tool_task. Catches: the
    base runner's source-only poll_tool_task counting as a poller, so the call was told tasks were
    supported and its poll failed three times with LookupError."""
    told: list[bool] = []

    class OwnTasks(BuiltinLoopAgentRunner):
        async def execute_deferred_tool_call(self, call: DeferredToolExecution) -> Any:
            told.append(call.supports_tool_tasks)
            return ToolTaskStarted(task_id="own", poll_interval_seconds=1)

    result, events = await _own_tool_turn(tmp_path, OwnTasks)
    assert result == f"The tool call failed: {MISSING_TOOL_TASK_POLLER}"
    assert told == [False]
    assert "tool_task_started" not in events and "tool_call_finished" in events


async def test_a_subclass_that_polls_its_own_tasks_is_told_they_are_supported(tmp_path: Path) -> None:
    """A subclass that overrides poll_tool_task polls its own tools' tasks. Catches: the per-call
    check asking only the tool sources, so such a subclass was refused its own tasks."""
    told: list[bool] = []

    class OwnTasks(BuiltinLoopAgentRunner):
        async def execute_deferred_tool_call(self, call: DeferredToolExecution) -> Any:
            told.append(call.supports_tool_tasks)
            return ToolTaskStarted(task_id="own", poll_interval_seconds=1)

        async def poll_tool_task(self, poll: ToolTaskPoll) -> ToolTaskPollOutcome:
            return ToolExecutionResult(f"polled {poll.tool_call.task_id}")

    result, _ = await _own_tool_turn(tmp_path, OwnTasks)
    assert result == "polled own"
    assert told == [True]


async def _task_tool_turn(
    tmp_path: Path, runner: type[BuiltinLoopAgentRunner], effect: ToolEffect
) -> tuple[AgentSnapshot, list[AgentEvent]]:
    """One turn calling start_report, a function tool that starts remote work and returns its
    ToolTaskStarted, on a `runner` subclass: the snapshot after it, and the event types."""

    @function_tool(effect=effect, requires_approval=False)
    async def start_report(context: ToolCallContext) -> ToolTaskStarted:
        """Start a report."""
        return ToolTaskStarted(task_id=f"report-{context.tool_call_id}", poll_interval_seconds=1)

    definition = AgentDefinition(name="a", instructions="", model=ScriptedModelClient(tool_then_answer),
                                 tools=[start_report])
    flow = AgentSessionFlow(runner(definition), "FunctionTasks", builtin_agent_session_options(definition))
    engine = InProcessEngine(tmp_path, [flow])
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s", "/tool start_report {}")
        done = await _turns_done(sessions, "s", 1)
        return done, [e.value for e in (await sessions.read_agent_events("s")).events]


@pytest.mark.parametrize(("effect", "status"), [
    (ToolEffect.READ, "failed"), (ToolEffect.NON_IDEMPOTENT_WRITE, "outcome_unknown"),
])
async def test_a_function_tools_task_without_a_poller_is_recorded_by_its_effect(
    tmp_path: Path, effect: ToolEffect, status: str
) -> None:
    """A function tool that returns ToolTaskStarted started remote work; nothing polls a function
    tool's task on the base runner, so the call is recorded by its effect with
    MISSING_TOOL_TASK_POLLER (seed 003 "Tool tasks"). Catches: the ToolTaskStarted serialized as
    JSON and recorded `succeeded`, so the model read the handle as the tool's result and a started
    write looked finished, and nothing ever polled the task."""
    done, events = await _task_tool_turn(tmp_path, BuiltinLoopAgentRunner, effect)
    (result,) = [m for m in done.messages if m.role is MessageRole.TOOL]
    assert result.tool_output == (f"The tool call failed: {MISSING_TOOL_TASK_POLLER}" if status == "failed"
                                  else OUTCOME_UNKNOWN_TEXT), result
    (finished,) = [json.loads(e.payload) for e in events if e.type == "tool_call_finished"]
    assert finished["status"] == status
    assert "tool_task_started" not in [e.type for e in events]


async def test_a_function_tools_task_is_polled_by_a_subclass_that_polls(tmp_path: Path) -> None:
    """A subclass that overrides poll_tool_task polls the tasks its function tools start, as it
    does its own tools' tasks. Catches: the ToolTaskStarted stored as the call's JSON output."""

    class PollsFunctionTasks(BuiltinLoopAgentRunner):
        async def poll_tool_task(self, poll: ToolTaskPoll) -> ToolTaskPollOutcome:
            return ToolExecutionResult(f"polled {poll.tool_call.task_id}")

    done, events = await _task_tool_turn(tmp_path, PollsFunctionTasks, ToolEffect.NON_IDEMPOTENT_WRITE)
    (result,) = [m for m in done.messages if m.role is MessageRole.TOOL]
    assert result.tool_output is not None and result.tool_output.startswith("polled report-"), result
    assert "tool_task_started" in [e.type for e in events]


async def test_a_turn_compacted_as_it_runs_keeps_unique_call_ids_and_stores_each_result_once(tmp_path: Path) -> None:
    """A turn of twelve tool calls compacted as it runs. Catches: ScriptedModelClient deriving IDs
    from the input's length, which comes round again once a summary shortens the input, failing
    the turn with "tool call ID ... repeats within this turn". Once a compaction takes calls out of
    the messages, their records are still the turn's, with no result in the messages: also catches
    (mutant: pending results not limited to calls still visible) each compaction storing the
    summarized calls' results again, so the transcript held a call's result twice or more."""

    @function_tool(effect=ToolEffect.READ, name="count")
    def count(step: int, pad: str = "") -> int:
        """Count one step."""
        return step

    def respond(request: ModelRequest) -> ScriptedModelReply:
        results = ScriptedModelClient.tool_results(request)
        step = int(results[-1].output) + 1 if results else 1
        if step > CALLS:
            return ScriptedModelReply(text=f"counted {CALLS}")
        return ScriptedModelReply(tool_calls=[ScriptedToolCall("count", {"step": step, "pad": FILLER})])

    definition = AgentDefinition(name="a", instructions="", model=ScriptedModelClient(respond), tools=[count],
                                 compaction=CompactionPolicy(context_window_tokens=500))
    engine = InProcessEngine(tmp_path, [builtin_agent_session_flow(definition)])
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s", "count")
        done = await _turns_done(sessions, "s", 1)
        page = await sessions.list_agent_messages("s", limit=200)
    assert done.state is not None and done.state.last_turn_error is None
    assert done.context_summary is not None  # compacted within the turn
    assert done.messages[-1].text == f"counted {CALLS}"
    results = [m.tool_call_id for m in page.messages if m.role is MessageRole.TOOL]
    assert len(results) == CALLS and len(set(results)) == CALLS, results


class _Rendezvous(_Source):
    """Lists only once every source of the agent is listing: listed one after another, none would."""

    def __init__(self, name: str, everyone: list[_Rendezvous], all_listing: asyncio.Event) -> None:
        super().__init__(name, [f"{name}_tool"])
        self.everyone = everyone
        self.all_listing = all_listing
        self.listing = False

    async def list_tools(self) -> Sequence[ModelToolDefinition]:
        self.listing = True
        if all(s.listing for s in self.everyone):
            self.all_listing.set()
        await self.all_listing.wait()
        return await super().list_tools()


async def test_tool_sources_are_listed_at_once(tmp_path: Path) -> None:
    """Every source's listing runs at the same time. Catches: one after another, where each down
    server added a whole listing timeout to the model call (ten servers, 100 s before any answer)."""
    everyone: list[_Rendezvous] = []
    all_listing = asyncio.Event()
    everyone.extend(_Rendezvous(f"s{i}", everyone, all_listing) for i in range(3))
    _, model = await _first_turn(tmp_path, list(everyone), "hi", tool_source_listing_timeout=timedelta(seconds=2))
    assert [t.name for t in model.requests[0].tools] == [
        "lookup_order", "refund_order", "s0_tool", "s1_tool", "s2_tool"]


class _Aborting(_Source):
    """A listing that raises past any Exception handler, as a client library's own BaseException."""

    async def list_tools(self) -> Sequence[ModelToolDefinition]:
        await asyncio.sleep(0)
        raise _Abort("the client gave up")


class _Abort(BaseException):
    pass


class _Hanging(_Source):
    def __init__(self) -> None:
        super().__init__("hanging", ["never"])
        self.cancelled = False

    async def list_tools(self) -> Sequence[ModelToolDefinition]:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        return []


async def test_a_listing_that_raises_past_the_runner_ends_the_other_listings() -> None:
    """The model call fails, and no other source's listing runs on after it. Catches: listings
    gathered without cancelling the rest, left running (holding connections) after the Step ended."""
    hanging = _Hanging()
    definition = AgentDefinition(name="a", instructions="", model=ScriptedModelClient(tool_then_answer),
                                 tool_sources=[hanging, _Aborting("abort", [])])
    with pytest.raises(BaseExceptionGroup) as raised:
        turn: Any = types.SimpleNamespace(flow_id="f", turn_id="turn-1", enabled_built_in_tools=frozenset())
        await BuiltinLoopAgentRunner(definition)._offered_tools(turn)
    assert [type(e) for e in raised.value.exceptions] == [_Abort]
    assert hanging.cancelled


class _NoTaskSource(_Source):
    """A source without poll_tool_task that notes what its calls are told about tool tasks."""

    def __init__(self) -> None:
        super().__init__("plain", ["remote_search"])
        self.supports_tool_tasks: list[bool] = []

    async def execute_deferred_tool_call(self, call: DeferredToolExecution) -> ToolExecutionResult:
        self.supports_tool_tasks.append(call.supports_tool_tasks)
        return await super().execute_deferred_tool_call(call)


async def test_a_source_that_cannot_poll_is_told_tool_tasks_are_not_supported(tmp_path: Path) -> None:
    """The runner polls tasks (for sources that can), but a source without poll_tool_task is told
    supports_tool_tasks=False, so it runs the call inside the Step. Catches: every source told
    True, starting a task nothing can poll."""
    source = _NoTaskSource()
    done, _ = await _first_turn(tmp_path, [source], "search")
    assert done.messages[-1].text == "plain ran remote_search"
    assert source.supports_tool_tasks == [False]


async def test_a_tool_output_over_half_the_value_limit_is_stored_once_and_the_turn_goes_on(tmp_path: Path) -> None:
    """A read tool returning 600 KB: its result message holds the output once, so it fits, and the
    model's next call sees it. Catches: the output stored in the message twice (tool_output and the
    framework item), which failed the next RunModel's commit after its paid model call."""
    big = "x" * 600_000

    @function_tool(effect=ToolEffect.READ, name="dump")
    def dump() -> str:
        """Return a big text."""
        return big

    def respond(request: ModelRequest) -> ScriptedModelReply:
        results = ScriptedModelClient.tool_results(request)
        if results:
            return ScriptedModelReply(text=f"got {len(results[0].output)} characters")
        return ScriptedModelReply(tool_calls=[ScriptedToolCall("dump", {})])

    definition = AgentDefinition(name="a", instructions="", model=ScriptedModelClient(respond), tools=[dump])
    done = await _one_turn(tmp_path, definition, "dump it")
    assert done.state is not None and done.state.last_turn_error is None
    assert done.messages[-1].text == "got 600000 characters"
    (result,) = [m for m in done.messages if m.role is MessageRole.TOOL]
    assert result.tool_output == big and big not in result.framework_item


def test_messages_stored_with_their_text_in_the_framework_item_still_read() -> None:
    """Sessions of dex-agents 0.1 stored a user text and a tool output inside the framework item too;
    their messages read as before."""
    from dex_agents import AgentMessage
    from dex_agents.builtin_loop import _items

    old_user = AgentMessage(1, "t1", MessageRole.USER, "hi", None, None, None, None,
                            '{"type":"user_text","text":"hi"}', "2026-01-01T00:00:00.000Z")
    old_tool = AgentMessage(3, "t1", MessageRole.TOOL, None, "c1", "dump", None, "out",
                            '{"type":"tool_result","tool_call_id":"c1","tool_name":"dump","output":"out"}',
                            "2026-01-01T00:00:00.000Z")
    assert _items.input_item(old_user) == UserTextInput("hi")
    assert _items.input_item(old_tool) == ToolResultInput("c1", "dump", "out")

    # An answer's text and a call's arguments were in the framework item too (beside the provider's item).
    answer_item = '{"role":"assistant","content":"ok"}'
    old_answer = AgentMessage(4, "t1", MessageRole.ASSISTANT, "ok", None, None, None, None, json.dumps(
        {"type": "model_output", "api": "x", "kind": "text", "item": answer_item, "text": "ok", "tool_call": None}),
        "2026-01-01T00:00:00.000Z")
    call_item = '{"role":"assistant","tool_calls":[]}'
    old_call = AgentMessage(2, "t1", MessageRole.ASSISTANT, None, "c1", "dump", "{}", None, json.dumps(
        {"type": "model_output", "api": "x", "kind": "tool_call", "item": call_item, "text": None,
         "tool_call": {"tool_call_id": "c1", "tool_name": "dump", "arguments": "{}"}}), "2026-01-01T00:00:00.000Z")
    assert _items.input_item(old_answer) == ModelOutputItem("x", OutputItemKind.TEXT, answer_item, "ok")
    assert _items.input_item(old_call) == ModelOutputItem("x", OutputItemKind.TOOL_CALL, call_item, None,
                                                          ModelToolCall("c1", "dump", "{}"))


async def test_a_turn_failed_in_run_models_commit_stores_its_calls_results_before_the_note(tmp_path: Path) -> None:
    """A provider whose second response of the turn has a tool call ID with '/' breaks the contract,
    and RunModel's commit fails the turn. The first call's result is stored before the note, as in
    RecordTurnFailure (seed 002). Catches: no result stored, so the next turn's model saw the call
    that succeeded as "outcome unknown" beside a note saying it succeeded."""

    def respond(request: ModelRequest) -> ScriptedModelReply:
        if ScriptedModelClient.user_texts(request)[-1] == "next":
            return ScriptedModelReply(text="ok")
        again = bool(ScriptedModelClient.tool_results(request))
        return ScriptedModelReply(tool_calls=[ScriptedToolCall(
            "lookup_order", {"order_id": "A-2" if again else "A-1"}, tool_call_id="call/1" if again else "call_0")])

    flow, model = scripted_flow(respond)
    engine = InProcessEngine(tmp_path, [flow])
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s", "go")
        failed = await _turns_done(sessions, "s", 1)
        assert failed.state is not None and "'call/1' contains '/'" in (failed.state.last_turn_error or "")
        await sessions.send_user_message("s", "next")
        await _turns_done(sessions, "s", 2)
    results = [i for i in model.requests[-1].input if isinstance(i, ToolResultInput)]
    assert [(r.tool_call_id, json.loads(r.output)) for r in results] == [
        ("call_0", {"order_id": "A-1", "status": "shipped"})]


async def test_a_turn_failed_by_a_compaction_answer_stores_its_calls_results_before_the_note(tmp_path: Path) -> None:
    """The same for a breach in the compaction check before a model call (an estimate that is not a
    whole number, once a call of the turn has run)."""

    class BadEstimate(BuiltinLoopAgentRunner):
        def estimate_input_tokens(self, turn: AgentTurnContext) -> int:
            ran = any(m.role is MessageRole.ASSISTANT and m.tool_call_id for m in turn.messages
                      if m.turn_id == turn.turn_id)
            return "many" if ran and turn.turn_id == "turn-1" else 1  # type: ignore[return-value]

    model = ScriptedModelClient(tool_then_answer)
    definition = AgentDefinition(name="a", instructions="", model=model, tools=[lookup_order],
                                 compaction=CompactionPolicy(context_window_tokens=100_000))
    flow = AgentSessionFlow(BadEstimate(definition), "BadEstimate", builtin_agent_session_options(definition))
    engine = InProcessEngine(tmp_path, [flow])
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s", '/tool lookup_order {"order_id": "A-1"}')
        failed = await _turns_done(sessions, "s", 1)
        assert failed.state is not None and "estimate_input_tokens returned 'many'" in (
            failed.state.last_turn_error or "")
        await sessions.send_user_message("s", "next")
        await _turns_done(sessions, "s", 2)
    results = [i for i in model.requests[-1].input if isinstance(i, ToolResultInput)]
    assert [json.loads(r.output) for r in results] == [{"order_id": "A-1", "status": "shipped"}]


class _NotFound(ToolExecutionError):
    """A tool's own error type that sets its text without ToolExecutionError.__init__."""

    def __init__(self, order_id: str) -> None:
        Exception.__init__(self, f"no order {order_id}")


@pytest.mark.parametrize("effect", [ToolEffect.READ, ToolEffect.IDEMPOTENT_WRITE])
async def test_a_tool_error_subclass_without_its_message_fails_the_call_once(
    tmp_path: Path, effect: ToolEffect
) -> None:
    """Catches: AttributeError on exc.message in the tool Step, so the tool ran three times, and a
    write the tool said had failed was recorded outcome_unknown."""
    runs: list[str] = []

    @function_tool(effect=effect, name="find", requires_approval=False)
    def find(order_id: str) -> str:
        """Find an order."""
        runs.append(order_id)
        raise _NotFound(order_id)

    definition = AgentDefinition(name="a", instructions="", model=ScriptedModelClient(tool_then_answer), tools=[find])
    done = await _one_turn(tmp_path, definition, '/tool find {"order_id": "A-9"}')
    (result,) = [m for m in done.messages if m.role is MessageRole.TOOL]
    assert result.tool_output == "The tool call failed: no order A-9"
    assert runs == ["A-9"]


class _OddOptions(BuiltinLoopAgentRunner):
    """Gives refund_order's calls step options that are not ToolCallStepOptions: a huge text."""

    def tool_call_step_options(self, call: DeferredToolCall) -> Any:
        return "x" * 2_000_000 if call.tool_name == "refund_order" else None


async def test_step_options_that_are_not_options_fail_only_their_call_even_after_an_approval(tmp_path: Path) -> None:
    """A runner's tool_call_step_options returning a 2 MB text: that call fails, not run, with a cut
    error, after its approval too; the other call runs and the turn goes on. Catches: the error
    quoting the whole value, over the value limit, failing the turn (or AwaitToolApproval's Step
    again and again, the session stuck)."""
    refund = '{"order_id": "A-1", "amount_cents": 5}'

    def respond(request: ModelRequest) -> ScriptedModelReply:
        results = ScriptedModelClient.tool_results(request)
        if results:
            return ScriptedModelReply(text=" | ".join(f"{r.tool_name}: {r.output[:200]}" for r in results))
        return ScriptedModelReply(tool_calls=[ScriptedToolCall("refund_order", refund),
                                              ScriptedToolCall("lookup_order", {"order_id": "A-1"})])

    definition = AgentDefinition(name="a", instructions="", model=ScriptedModelClient(respond),
                                 tools=[lookup_order, refund_order])
    flow = AgentSessionFlow(_OddOptions(definition), "OddOptions", builtin_agent_session_options(definition))
    engine = InProcessEngine(tmp_path, [flow])
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s", "refund")
        interrupt = await wait_for_agent_snapshot(
            sessions, "s", lambda s: next(iter(s.pending_interrupts), None), description="the refund's approval")
        assert await sessions.resolve_interrupt("s", interrupt.interrupt_id, approved=True)
        done = await _turns_done(sessions, "s", 1)
    assert done.state is not None and done.state.last_turn_error is None
    answer = done.messages[-1].text or ""
    assert "refund_order: The tool call failed: the tool did not run" in answer and "which is not a Tool" in answer
    assert 'lookup_order: {"order_id":"A-1","status":"shipped"}' in answer


async def test_warnings_about_a_turn_name_its_session(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The built-in loop's warnings about a model call name the session's flow and the turn: a tool
    call's arguments cut at the token limit, then an answer cut there. Catches: "turn 'turn-1': ...",
    a turn ID every session has, with no way for an operator to find which session it was."""
    from dex_agents import AgentUsage, ModelCallMetadata
    from dex_agents.builtin_loop import ModelResponse

    class CutReplies:
        def estimate_input_tokens(self, request: ModelRequest) -> int:
            return 1

        async def call_model(self, request: ModelRequest, output: ModelOutputWriter) -> ModelResponse:
            cut = ModelCallMetadata(finish_reasons=("length",))
            if ScriptedModelClient.tool_results(request):
                text = ModelOutputItem("scripted", OutputItemKind.TEXT, json.dumps({"type": "text", "text": "Half"}),
                                       "Half")
                return ModelResponse((text,), AgentUsage(model_calls=1), cut)
            call = ModelToolCall("call-1", "lookup_order", '{"order_')
            item = ModelOutputItem("scripted", OutputItemKind.TOOL_CALL, json.dumps({"type": "tool_call"}),
                                   tool_call=call)
            return ModelResponse((item,), AgentUsage(model_calls=1), cut)

    agent = AgentDefinition(name="cut", model=CutReplies(), instructions="", tools=[lookup_order])
    engine = InProcessEngine(tmp_path, [builtin_agent_session_flow(agent, "CutAgent")])
    with caplog.at_level(logging.WARNING, logger="dex_agents.builtin_loop"):
        async with engine.running():
            await engine.sessions().start_session("support-42", "look it up")
            await _turns_done(engine.sessions(), "support-42", 1)
    said = [r.getMessage() for r in caplog.records if r.name == "dex_agents.builtin_loop"]
    assert [m[:60] for m in said] == ["flow support-42 turn turn-1: the model's output was cut at i"] * 2, said
    assert "in the arguments of tool call 'call-1'" in said[0]
    assert "so its answer is incomplete or missing" in said[1]


@function_tool(effect=ToolEffect.READ)
async def fetch_page(page: int) -> str:
    """Fetch a large page (PAGE_CHARS characters)."""
    return f"page {page}: " + "x" * PAGE_CHARS


PAGE_CHARS = 40_000


async def test_parsed_input_items_stay_within_their_character_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The model input items a worker keeps by stored message hold at most INPUT_ITEM_CACHE_CHARS of
    those messages' texts: bounded by entries alone (8192), sessions whose tools return large pages
    kept every page of the last 8192 messages alive, gigabytes past what the engine's caches keep.
    Here a bound of 3 pages, and 4 sessions of 2 turns each reading a page: the later turns' model
    calls read every earlier message again, and the cache holds at most the bound."""
    from dex_agents._constants import INPUT_ITEM_CACHE_ENTRIES
    from dex_agents.builtin_loop import _items

    bound = 3 * PAGE_CHARS
    cache = _items._ParsedItems(INPUT_ITEM_CACHE_ENTRIES, bound)
    monkeypatch.setattr(_items, "_parsed", cache)

    def held() -> int:
        return sum(map(_items.message_chars, cache.items))

    flow, model = scripted_flow(tool_then_answer, tools=[fetch_page])
    engine = InProcessEngine(tmp_path, [flow])
    async with engine.running():
        sessions = engine.sessions()
        for n in range(4):
            sid = f"s{n}"
            await sessions.start_session(sid, f'/tool fetch_page {{"page": {n}}}')
            await _turns_done(sessions, sid, 1)
            assert await sessions.send_user_message(sid, "again")
            done = await _turns_done(sessions, sid, 2)
            assert done.messages[-1].text == "echo: again"
            assert held() <= bound, f"{len(cache.items)} items hold {held()} characters, over {bound}"
            assert cache.chars == held()
    # The bound still lets the newest messages in, and the last call saw its page's result.
    assert cache.items
    result = model.requests[-1].input[-3]
    assert isinstance(result, ToolResultInput) and result.output.startswith("page 3: xxx")
