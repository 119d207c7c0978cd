"""Built-in loop behaviour that a hand-made mutation sweep of the loop runner, its stored items and
function tools found untested: each test names the mutant it kills."""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import re
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from pathlib import Path
from typing import Any

import pytest
from agents.tests.builtin_agent import InProcessEngine, lookup_order, scripted_flow, tool_then_answer

from dex_agents import (
    OUTCOME_UNKNOWN_TEXT,
    AgentEventWriter,
    AgentMessage,
    AgentSessionClient,
    AgentSessionFlow,
    AgentSnapshot,
    AgentTurnContext,
    AgentUsage,
    BuiltInTool,
    MessageRole,
    ModelCallMetadata,
    RunModelLimit,
    ToolEffect,
    ToolPolicy,
)
from dex_agents._constants import MAX_CONSECUTIVE_TURN_CONTINUATIONS
from dex_agents._turn_logic import MAX_TOOL_CALL_ID_LENGTH
from dex_agents.builtin_loop import (
    AgentDefinition,
    BuiltinLoopAgentRunner,
    ContinueTurn,
    InstructionContext,
    ModelInputItem,
    ModelOutputItem,
    ModelOutputWriter,
    ModelRequest,
    ModelResponse,
    ModelToolCall,
    ModelToolDefinition,
    OutputItemKind,
    ScriptedModelClient,
    ScriptedModelReply,
    ScriptedToolCall,
    ToolResultInput,
    TurnContinuationContext,
    UserTextInput,
    _items,
    _loop_runner,
    builtin_agent_session_flow,
    builtin_agent_session_options,
)
from dex_agents.builtin_loop._model import content_filter_finish_reason, token_limit_finish_reason, unique_call_id
from dex_agents.builtin_loop._tool_sources import unwrap_source_reference, wrap_source_reference
from dex_agents.testing import wait_for_agent_snapshot


async def _turns_done(sessions: AgentSessionClient, sid: str, count: int) -> AgentSnapshot:
    snapshot: AgentSnapshot = await wait_for_agent_snapshot(
        sessions, sid, lambda s: s if s.state is not None and s.state.turn_count >= count else None,
        description=f"{count} turn(s) of {sid} to end",
    )
    return snapshot


def _call_item(call_id: str, name: str, arguments: str) -> ModelOutputItem:
    return ModelOutputItem("scripted", OutputItemKind.TOOL_CALL, json.dumps({"type": "tool_call", "id": call_id}),
                           tool_call=ModelToolCall(call_id, name, arguments))


async def test_only_the_calls_the_token_limit_cut_are_told_so(tmp_path: Path) -> None:
    """In a response cut at its token limit, the result of a whole call that failed for its own reason
    (an unknown tool) is that failure alone; only the call whose arguments were cut is told to retry
    with shorter arguments. Catches (mutant R04, every call of a cut response taken as cut): the model
    told its whole call was cut, so it shortened arguments that were never the problem."""
    requests: list[ModelRequest] = []

    class CutReplies:
        def estimate_input_tokens(self, request: ModelRequest) -> int:
            return 1

        async def call_model(self, request: ModelRequest, output: ModelOutputWriter) -> ModelResponse:
            requests.append(request)
            if ScriptedModelClient.tool_results(request):
                text = ModelOutputItem("scripted", OutputItemKind.TEXT, json.dumps({"type": "text"}), "Done.")
                return ModelResponse((text,), AgentUsage(model_calls=1))
            calls = (_call_item("call-whole", "no_such_tool", "{}"), _call_item("call-cut", "lookup_order", '{"ord'))
            return ModelResponse(calls, AgentUsage(model_calls=1), ModelCallMetadata(finish_reasons=("length",)))

    agent = AgentDefinition(name="cut", model=CutReplies(), instructions="", tools=[lookup_order])
    engine = InProcessEngine(tmp_path, [builtin_agent_session_flow(agent, "CutAgent")])
    async with engine.running():
        await engine.sessions().start_session("s", "look it up")
        await _turns_done(engine.sessions(), "s", 1)
    results = {r.tool_call_id: r.output for r in ScriptedModelClient.tool_results(requests[-1])}
    assert "token limit" not in results["call-whole"] and "unknown tool no_such_tool" in results["call-whole"]
    assert "your output was cut at its token limit" in results["call-cut"]


async def test_a_tool_call_between_continuations_starts_their_count_again(tmp_path: Path) -> None:
    """The continuation limit counts continuations in a row without a tool call (docs/agents.md): a
    turn continued more times than the limit, with a tool call after each continuation, ends well.
    Catches (mutant R08, the count kept across tool calls): such a turn failed with "continued more
    than 8 times in a row without a tool call", though each continuation led to one."""
    continuations = MAX_CONSECUTIVE_TURN_CONTINUATIONS + 2

    def respond(request: ModelRequest) -> ScriptedModelReply:
        if isinstance(request.input[-1], ToolResultInput):
            return ScriptedModelReply(text="answer")
        return ScriptedModelReply(tool_calls=[ScriptedToolCall("lookup_order", {"order_id": "A-1"})])

    answers: list[int] = []

    def decide(context: TurnContinuationContext) -> ContinueTurn | str:
        if context.tool_results:
            return "default"
        answers.append(1)
        return ContinueTurn("Keep going.") if len(answers) <= continuations else "default"

    flow, _ = scripted_flow(respond, decide_turn_continuation=decide)
    engine = InProcessEngine(tmp_path, [flow])
    async with engine.running():
        await engine.sessions().start_session("s", "start")
        done = await _turns_done(engine.sessions(), "s", 1)
    assert done.state is not None and done.state.last_turn_error is None
    assert len(answers) == continuations + 1


async def test_the_continuation_hook_after_tool_results_gets_the_last_response_only(tmp_path: Path) -> None:
    """After tool results, decide_turn_continuation's model_output is the response that made the
    calls, not earlier answers of the session. Catches (mutant R21, every stored output item taken):
    the hook saw the previous turn's answer as this response's, and decided on it."""
    seen: list[list[str | None]] = []

    def decide(context: TurnContinuationContext) -> str:
        if context.tool_results:
            seen.append([item.text if item.tool_call is None else item.tool_call.tool_name
                         for item in context.model_output])
        return "default"

    flow, _ = scripted_flow(tool_then_answer, decide_turn_continuation=decide)
    engine = InProcessEngine(tmp_path, [flow])
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s", "hi")
        await _turns_done(sessions, "s", 1)
        assert await sessions.send_user_message("s", '/tool lookup_order {"order_id": "A-1"}')
        await _turns_done(sessions, "s", 2)
    assert seen == [["calling", "lookup_order"]]


async def test_a_continuation_with_a_blank_message_fails_the_turn_naming_it(tmp_path: Path) -> None:
    """ContinueTurn whose message is only whitespace fails the turn with its answer stored, as a
    hook's other bad return does. Catches (mutant R22, only "" refused): a blank user message stored
    and sent to the model, which some providers refuse, every continuation paid for."""
    flow, model = scripted_flow(tool_then_answer, decide_turn_continuation=lambda c: ContinueTurn(" \n"))
    engine = InProcessEngine(tmp_path, [flow])
    async with engine.running():
        await engine.sessions().start_session("s", "hi")
        done = await _turns_done(engine.sessions(), "s", 1)
    assert done.state is not None
    assert done.state.last_turn_error == "decide_turn_continuation returned ContinueTurn with a blank message"
    assert len(model.requests) == 1 and done.messages[-1].text == "echo: hi"


class _Listing:
    """A tool source that lists `tools` and declares no names, so only its listing shows a collision."""

    def __init__(self, name: str, tools: Sequence[str]) -> None:
        self.source_name = name
        self.tools = tools

    async def list_tools(self) -> Sequence[ModelToolDefinition]:
        return [ModelToolDefinition(t, "", {"type": "object", "properties": {}}) for t in self.tools]

    def deferred_tool_call(self, call: object, listed_tool: object, turn: object) -> None:
        raise AssertionError("never called: the model call fails first")

    async def execute_deferred_tool_call(self, call: object) -> None:
        raise AssertionError("never called")


@pytest.mark.parametrize(("listings", "built_ins", "error"), [
    ([["a", "a"]], frozenset(), "tool source 's0' lists a tool named a more than once"),
    ([["a"], ["a"]], frozenset(), "two tool sources list a tool named a"),
    ([["ask_user"]], frozenset({BuiltInTool.ASK_USER}), "tool ask_user uses the name of an enabled built-in tool"),
])
async def test_a_listing_colliding_with_a_tool_fails_the_model_call_naming_the_collision(
    tmp_path: Path, listings: list[list[str]], built_ins: frozenset[BuiltInTool], error: str
) -> None:
    """A source that lists a name twice, two sources listing one name, or a listed name of an enabled
    built-in tool fail RunModel before any model request, each with its own error. Catches (mutants
    R23, the first two messages swapped, and R24, the built-in check dropped): a wrong source named,
    or a built-in tool offered twice, which the provider refuses."""
    model = ScriptedModelClient(tool_then_answer)
    agent = AgentDefinition(name="lister", instructions="", model=model, built_in_tools=built_ins,
                            tool_sources=[_Listing(f"s{i}", listed) for i, listed in enumerate(listings)])
    options = dataclasses.replace(builtin_agent_session_options(agent), run_model_limit=RunModelLimit(max_attempts=1))
    engine = InProcessEngine(tmp_path, [AgentSessionFlow(BuiltinLoopAgentRunner(agent), "Lister", options)])
    async with engine.running():
        await engine.sessions().start_session("s", "hi")
        done = await _turns_done(engine.sessions(), "s", 1)
    assert done.state is not None and done.state.last_turn_error == error
    assert not model.requests


async def test_a_continuation_after_tool_results_reaches_the_next_model_call(tmp_path: Path) -> None:
    """ContinueTurn returned after a response's tool results stores its message after the results,
    and the next model call gets it. Catches (mutant R37, the message dropped there): the hook's
    instruction never reached the model, which answered as if it had said nothing."""
    def decide(context: TurnContinuationContext) -> ContinueTurn | str:
        return ContinueTurn("Also check B-2.") if context.tool_results else "default"

    flow, model = scripted_flow(tool_then_answer, decide_turn_continuation=decide)
    engine = InProcessEngine(tmp_path, [flow])
    async with engine.running():
        await engine.sessions().start_session("s", '/tool lookup_order {"order_id": "A-1"}')
        done = await _turns_done(engine.sessions(), "s", 1)
    assert [type(item).__name__ for item in model.requests[1].input[-2:]] == ["ToolResultInput", "UserTextInput"]
    assert ScriptedModelClient.user_texts(model.requests[1])[-1] == "Also check B-2."
    assert [m.text for m in done.messages if m.role is MessageRole.USER][-1] == "Also check B-2."


async def test_resolve_model_returning_no_model_client_fails_the_turn_naming_what_it_returned(
    tmp_path: Path,
) -> None:
    """A resolve_model that returns something without call_model fails the turn with the type it
    returned. Catches (mutant R38, the check dropped): "'str' object has no attribute 'call_model'"."""
    agent = AgentDefinition(name="resolver", instructions="", model=ScriptedModelClient(tool_then_answer),
                            resolve_model=lambda settings: "openai/gpt-5")  # type: ignore[arg-type, return-value]
    options = dataclasses.replace(builtin_agent_session_options(agent), run_model_limit=RunModelLimit(max_attempts=1))
    engine = InProcessEngine(tmp_path, [AgentSessionFlow(BuiltinLoopAgentRunner(agent), "Resolver", options)])
    async with engine.running():
        await engine.sessions().start_session("s", "hi")
        done = await _turns_done(engine.sessions(), "s", 1)
    assert done.state is not None and done.state.last_turn_error is not None
    assert "resolve_model returned str, not a ModelClient" in done.state.last_turn_error


async def test_stored_reasoning_keeps_its_text_for_the_next_model_call(tmp_path: Path) -> None:
    """A reasoning item is stored with its text (the message has no text field for it), a call with
    its arguments, and the next model call of the turn gets them back. Catches (mutants I01 and I03
    of the loop sweep, the text not stored or not read): a model client that replays reasoning as
    text, and the continuation hook, got None."""
    def respond(request: ModelRequest) -> ScriptedModelReply:
        if ScriptedModelClient.tool_results(request):
            return ScriptedModelReply(text="done")
        return ScriptedModelReply(reasoning="Check A-1 first.",
                                  tool_calls=[ScriptedToolCall("lookup_order", {"order_id": "A-1"})])

    flow, model = scripted_flow(respond)
    engine = InProcessEngine(tmp_path, [flow])
    async with engine.running():
        await engine.sessions().start_session("s", "where is A-1?")
        done = await _turns_done(engine.sessions(), "s", 1)
    reasoning = [item for item in model.requests[1].input
                 if isinstance(item, ModelOutputItem) and item.kind is OutputItemKind.REASONING]
    assert [item.text for item in reasoning] == ["Check A-1 first."]
    # Nor is it the assistant message's text, which users read as the answer (mutant I02).
    assert "Check A-1 first." not in [m.text for m in done.messages]
    # The call's arguments are stored on its message and replayed (mutant I11: stored as None).
    assert [m.tool_arguments for m in done.messages if m.role is MessageRole.ASSISTANT and m.tool_call_id] == \
        ['{"order_id": "A-1"}']
    assert [item.tool_call.arguments for item in model.requests[1].input
            if isinstance(item, ModelOutputItem) and item.tool_call] == ['{"order_id": "A-1"}']


def test_messages_of_dex_agents_0_1_and_of_other_runners_parse_as_their_items(monkeypatch: pytest.MonkeyPatch) -> None:
    """A session stored by dex-agents 0.1 (texts, outputs and arguments in the framework item, not the
    message) and messages another runner stored (no item of this loop) read back as the items they
    stand for. Catches (mutants I04, I05, I08, I09, I10, I12 of the loop sweep): a 0.1 session's
    user texts, tool outputs and call arguments replayed empty after an upgrade, or another
    runner's texts lost or replayed as reasoning, which other providers drop."""
    monkeypatch.setattr(_items, "_parsed", _items._ParsedItems(100, 1_000_000))

    def message(role: MessageRole, item: dict[str, object] | None, text: str | None = None,
                call: tuple[str, str] | None = None, output: str | None = None) -> AgentMessage:
        framework_item = json.dumps(item) if item is not None else "not this loop's item"
        return AgentMessage(1, "t1", role, text, call and call[0], call and call[1], None, output, framework_item,
                            "2026-01-01T00:00:00.000Z")

    old_call = {"type": "model_output", "api": "a", "kind": "tool_call", "item": "{}",
                "tool_call": {"tool_call_id": "c1", "tool_name": "t", "arguments": '{"x":1}'}}
    assert _items.input_item(message(MessageRole.USER, {"type": "user_text", "text": "hi"})) == UserTextInput("hi")
    assert _items.input_item(message(MessageRole.TOOL, {"type": "tool_result", "tool_call_id": "c1",
                                                        "tool_name": "t", "output": "ok"})) == \
        ToolResultInput("c1", "t", "ok")
    parsed = _items.input_item(message(MessageRole.ASSISTANT, old_call))
    assert isinstance(parsed, ModelOutputItem) and parsed.tool_call == ModelToolCall("c1", "t", '{"x":1}')

    assert _items.input_item(message(MessageRole.USER, None, text="other")) == UserTextInput("other")
    assert _items.input_item(message(MessageRole.TOOL, None, call=("c2", "u"), output="done")) == \
        ToolResultInput("c2", "u", "done")
    answer = _items.input_item(message(MessageRole.ASSISTANT, None, text="hello"))
    assert isinstance(answer, ModelOutputItem)
    assert (answer.kind, answer.text) == (OutputItemKind.TEXT, "hello")


class _Estimating(ScriptedModelClient):
    """A scripted model that records the requests its estimate_input_tokens is given."""

    def __init__(self) -> None:
        super().__init__(lambda request: ScriptedModelReply(text="ok"))
        self.estimated: list[ModelRequest] = []

    def estimate_input_tokens(self, request: ModelRequest) -> int:
        self.estimated.append(request)
        return 1


class _Cached(_Listing):
    """A source whose cached_tools() answers without I/O once it has listed."""

    def __init__(self, name: str, tools: Sequence[str]) -> None:
        super().__init__(name, tools)
        self.listed = False

    async def list_tools(self) -> Sequence[ModelToolDefinition]:
        self.listed = True
        return await super().list_tools()

    def cached_tools(self) -> Sequence[ModelToolDefinition] | None:
        return [ModelToolDefinition(f"cached_{t}", "", {"type": "object", "properties": {}}) for t in self.tools]


def _bare_turn() -> AgentTurnContext:
    async def no_heartbeat() -> None:
        return None

    return AgentTurnContext(
        flow_id="s", turn_id="turn-1", attempt=1, messages=[], framework_run_state=None, tool_calls={},
        events=AgentEventWriter(lambda event: None, "turn-1", "RunModel-1", 1), heartbeat=no_heartbeat,
        tool_policies={}, default_tool_effect=ToolEffect.UNCLASSIFIED,
    )


async def test_the_compaction_estimate_counts_async_instructions_and_source_tools() -> None:
    """estimate_input_tokens (synchronous, for compaction decisions) counts what the next model call
    sends: an async instructions function's last text, and each tool source's cached_tools() or else
    its last listing. Catches: the instructions left out (None) or counted as their coroutine's repr,
    and a source's tools left out, so compaction came too late for a long prompt or many MCP tools."""
    calls: list[str] = []
    made: list[Coroutine[Any, Any, str]] = []

    async def text(context: InstructionContext) -> str:
        calls.append(context.turn_id)
        return f"Be brief ({len(calls)})."

    def instructions(context: InstructionContext) -> Awaitable[str]:
        made.append(text(context))
        return made[-1]

    model = _Estimating()
    agent = AgentDefinition(name="estimated", instructions=instructions, model=model,
                            tool_sources=[_Listing("listed", ["remote_search"]), _Cached("cached", ["fetch"])])
    runner = BuiltinLoopAgentRunner(agent)
    turn = _bare_turn()
    runner.estimate_input_tokens(turn)
    # Before any model call: no text yet, and only what a source tells without listing.
    assert model.estimated[-1].instructions is None
    assert [t.name for t in model.estimated[-1].tools] == ["cached_fetch"]
    await runner.run_model_step(turn)
    assert [t.name for t in model.requests[-1].tools] == ["remote_search", "fetch"]
    runner.estimate_input_tokens(turn)
    estimated = model.estimated[-1]
    assert estimated.instructions == "Be brief (1)."  # the text of the function's last awaited call
    assert calls == ["turn-1"]  # the estimate's own calls of it never ran
    # and were closed, not left to warn "coroutine ... was never awaited" when collected
    assert [inspect.getcoroutinestate(c) for c in made] == [inspect.CORO_CLOSED] * 3
    assert [t.name for t in estimated.tools] == ["remote_search", "cached_fetch"]


class _Declaring(_Listing):
    """A source that declares the names it lists, so AgentDefinition checks them when it is built."""

    def declared_tool_names(self) -> Iterable[str]:
        return list(self.tools)


class _DeclaringOnce(_Listing):
    """Declares its names as a generator, which can be read only once."""

    def declared_tool_names(self) -> Iterable[str]:
        return (name for name in self.tools)


@pytest.mark.parametrize(("fields", "error"), [
    ({"name": "  "}, "name must be non-empty text, got '  '"),  # mutant D01: blank name taken
    ({"max_model_calls_per_turn": True}, "max_model_calls_per_turn must be a whole number >= 1, got True"),  # D05
    ({"tools": "lookup_order"}, "tools must be a list of FunctionTool, got 'lookup_order'"),  # D19: one per letter
    ({"tool_sources": [_Declaring(" ", [])]}, "has source_name ' '; give it a unique, non-empty text name"),  # D24
    ({"tools": [lookup_order], "tool_sources": [_Declaring("s", ["lookup_order"])]},
     "tool lookup_order of a tool source uses the name of a function tool"),  # D27
    ({"tool_sources": [_Declaring("s1", ["search"]), _Declaring("s2", ["search"])]},
     "two tool sources list a tool named search"),  # D29
    ({"tools": [lookup_order], "tool_sources": [_DeclaringOnce("s", ["lookup_order"])]},
     "tool lookup_order of a tool source uses the name of a function tool"),  # T10: a generator read twice
    ({"built_in_tools": frozenset({"ask_user"})},
     "built_in_tools must be a frozenset of BuiltInTool, got frozenset({'ask_user'})"),  # D11: AttributeError
])
def test_agent_definition_refuses_what_its_sweep_found_unchecked(fields: dict[str, Any], error: str) -> None:
    """AgentDefinition refuses, when built, a blank name or source name, True as a call limit, text as
    the tool list, and declared source tool names colliding with a function tool or another source.
    Catches (mutants D01, D05, D11, D19, D24, D27, D29 of the _definition sweep, and T10 of the
    _tool_sources sweep, a declared_tool_names() generator not read into a list): each taken, then failing
    later: a collision in every model call of every turn, text as one bad tool per letter."""
    agent: dict[str, Any] = {"name": "a", "instructions": "", "model": ScriptedModelClient(tool_then_answer)}
    with pytest.raises(ValueError, match=re.escape("invalid AgentDefinition: ") + ".*" + re.escape(error)):
        AgentDefinition(**{**agent, **fields})


def test_a_definitions_tool_policy_overrides_its_function_tools_own() -> None:
    """AgentDefinition.tool_policies override a function tool's own policy, in the options the
    definition implies and for its calls. Catches (mutant D13 of the _definition sweep, the override
    dropped): lookup_order, declared a read, ran without the approval the definition asked for."""
    asked = ToolPolicy(ToolEffect.NON_IDEMPOTENT_WRITE, requires_approval=True)
    agent = AgentDefinition(name="a", instructions="", model=ScriptedModelClient(tool_then_answer),
                            tools=[lookup_order], tool_policies={"lookup_order": asked})
    assert builtin_agent_session_options(agent).tool_policies["lookup_order"] == asked
    assert agent.function_tool_policy("lookup_order") == asked


def test_an_agent_definition_keeps_copies_of_the_lists_and_dicts_it_was_given() -> None:
    """AgentDefinition copies its tools, tool sources, model settings and tool policies, read-only.
    Catches: the caller's dict kept, so that dropping a tool policy from it after the definition was
    built (and checked) let the tool run without the approval the definition asked for."""
    asked = ToolPolicy(ToolEffect.NON_IDEMPOTENT_WRITE, requires_approval=True)
    policies = {"lookup_order": asked}
    settings: dict[str, Any] = {"temperature": 0.5}
    tools = [lookup_order]
    sources: list[Any] = [_Declaring("s", ["search"])]
    agent = AgentDefinition(name="a", instructions="", model=ScriptedModelClient(tool_then_answer), tools=tools,
                            tool_sources=sources, model_settings=settings, tool_policies=policies)
    policies.clear()
    settings["temperature"] = 2
    tools.clear()
    sources.clear()
    assert agent.function_tool_policy("lookup_order") == asked
    assert builtin_agent_session_options(agent).tool_policies["lookup_order"] == asked
    assert dict(agent.model_settings) == {"temperature": 0.5}
    assert [t.name for t in agent.tools] == ["lookup_order"]
    assert len(agent.tool_sources) == 1
    with pytest.raises(TypeError):
        agent.tool_policies["lookup_order"] = ToolPolicy(ToolEffect.READ)  # type: ignore[index]
    with pytest.raises(TypeError):
        agent.model_settings["temperature"] = 2  # type: ignore[index]


@pytest.mark.parametrize(("stored", "found"), [
    (None, None),
    ("call-ref-7", None),  # another runner's reference, not JSON (mutant T02: raised)
    ('["s", "r"]', None),  # JSON, not an object (T03: AttributeError)
    ('{"reference": "r"}', None),  # no source name (T04: taken as a source call)
    ('{"stepwise_tool_source": "s", "reference": 7}', ("s", None)),  # T05: 7 handed on as the reference
    (wrap_source_reference("s", "r"), ("s", "r")),
])
def test_a_stored_reference_names_a_source_only_when_it_was_wrapped(
    stored: str | None, found: tuple[str, str | None] | None
) -> None:
    """A stored call's reference is taken as a tool source's only when wrap_source_reference made it;
    any other is a function tool's (or another runner's) call. Catches (mutants T02-T05 of the
    _tool_sources sweep): such a call failing its tool Step with a bare ValueError or AttributeError."""
    assert unwrap_source_reference(stored) == found


def test_a_run_model_timeout_equal_to_the_listing_timeout_is_refused() -> None:
    """A RunModel timeout equal to the listing timeout leaves the model call no time after a listing
    that times out, so it is refused like a shorter one. Catches (mutant D15 of the _definition
    sweep, > for >=): taken, and a source that did not answer failed the turn at its deadline."""
    agent = AgentDefinition(name="lister", instructions="", model=ScriptedModelClient(tool_then_answer),
                            tool_sources=[_Listing("s", ["t"])])
    equal = RunModelLimit(timeout=agent.tool_source_listing_timeout)
    options = dataclasses.replace(builtin_agent_session_options(agent), run_model_limit=equal)
    with pytest.raises(ValueError, match=r"tool_source_listing_timeout \(0:00:10\) is not shorter than"):
        AgentSessionFlow(BuiltinLoopAgentRunner(agent), "Lister", options)


def test_a_repeated_call_id_of_the_longest_length_is_made_unique_within_it() -> None:
    """A server that repeats a call ID of the longest length a session takes gets `_<n>` in place of
    the ID's tail, never past that length. Catches the suffix appended to the whole ID, an ID the
    session refuses, which failed the turn."""
    longest = "c" * MAX_TOOL_CALL_ID_LENGTH
    taken: set[str] = set()
    made = [unique_call_id(longest, taken) for _ in range(11)]
    assert made[:3] == [longest, longest[:-2] + "_1", longest[:-2] + "_2"]
    assert made[10] == longest[:-3] + "_10"
    assert len(set(made)) == 11 and taken == set(made)
    assert max(len(i) for i in made) == MAX_TOOL_CALL_ID_LENGTH


def test_finish_reasons_are_recognized_in_any_case() -> None:
    """A client may pass a provider's finish reason as the provider writes it (Gemini's MAX_TOKENS,
    an upper-case CONTENT_FILTER): it is recognized, and returned as given for the message that
    names it. Catches only the lower-case spelling recognized, so such a cut answer passed as whole."""
    assert token_limit_finish_reason(ModelCallMetadata(finish_reasons=("STOP", "MAX_TOKENS"))) == "MAX_TOKENS"
    assert content_filter_finish_reason(ModelCallMetadata(finish_reasons=("Content_Filter",))) == "Content_Filter"
    assert token_limit_finish_reason(ModelCallMetadata(finish_reasons=("stop",))) is None
    assert content_filter_finish_reason(ModelCallMetadata(finish_reasons=None)) is None


_TEXT = ModelOutputItem("scripted", OutputItemKind.TEXT, json.dumps({"type": "text"}), "hi")


@pytest.mark.parametrize(
    ("build", "message"),
    [
        pytest.param(lambda: ModelToolCall("c1", "lookup_order", {"order_id": "A-1"}),
                     "ModelToolCall.arguments must be a str, got {'order_id': 'A-1'}; give the arguments' JSON text",
                     id="arguments-dict"),
        pytest.param(lambda: ModelToolCall(None, "lookup_order", "{}"), "ModelToolCall.tool_call_id must be a str, "
                     "got None", id="no-call-id"),
        pytest.param(lambda: ModelOutputItem("scripted", OutputItemKind.TOOL_CALL, "{}",
                                             tool_call={"tool_call_id": "c1"}),
                     "ModelOutputItem.tool_call must be a ModelToolCall or None, got {'tool_call_id': 'c1'}",
                     id="tool-call-dict"),
        pytest.param(lambda: ModelOutputItem("scripted", OutputItemKind.TEXT, "{}", "hi",
                                             ModelToolCall("c1", "lookup_order", "{}")),
                     "ModelOutputItem.tool_call is for OutputItemKind.TOOL_CALL items, got one on a 'text' item; "
                     "give the call an item of its own", id="call-on-text"),
        pytest.param(lambda: ModelOutputItem("scripted", "tool_call", "{}"), "ModelOutputItem.kind must be an "
                     "OutputItemKind, such as OutputItemKind.TEXT, got 'tool_call'", id="kind-text"),
        pytest.param(lambda: ModelOutputItem("scripted", OutputItemKind.TEXT, {"type": "text"}),
                     "ModelOutputItem.item must be a str, got {'type': 'text'}", id="item-dict"),
        pytest.param(lambda: ModelOutputItem("scripted", OutputItemKind.TEXT, "{}", 5),
                     "ModelOutputItem.text must be a str or None, got 5", id="text-int"),
        pytest.param(lambda: ModelResponse(_TEXT), "ModelResponse.output must be a tuple of ModelOutputItem (one "
                     "item as (item,)), got ModelOutputItem(", id="one-item"),
        pytest.param(lambda: ModelResponse(({"kind": "text"},)), "ModelResponse.output[0] must be a "
                     "ModelOutputItem, got {'kind': 'text'}", id="item-as-dict"),
        pytest.param(lambda: ModelResponse((_TEXT,), {"model_calls": 1}), "ModelResponse.usage must be an "
                     "AgentUsage, got {'model_calls': 1}", id="usage-dict"),
        pytest.param(lambda: ModelResponse((_TEXT,), AgentUsage(), {"response_id": "r"}), "ModelResponse.metadata "
                     "must be a ModelCallMetadata or None, got {'response_id': 'r'}", id="metadata-dict"),
    ],
)
def test_a_model_response_of_the_wrong_shape_is_refused_where_it_is_built(
    build: Callable[[], object], message: str
) -> None:
    """Catches: a model client's ModelOutputItem holding a dict for its tool call (or a kind given as
    text, one item given alone as output) accepted, and failing later deep inside the loop with
    "'dict' object has no attribute 'tool_call_id'" (a kind as text: its tool call silently dropped)."""
    with pytest.raises(TypeError) as caught:
        build()
    assert str(caught.value).startswith(message), caught.value


async def test_a_model_client_building_a_bad_item_fails_the_turn_after_one_call(tmp_path: Path) -> None:
    """The refusal inside call_model fails the turn with its text, at once: the client's code is wrong,
    so no retry pays for the same call twice more. Catches: three model calls, then the turn failed
    with "'dict' object has no attribute 'tool_call_id'"."""
    calls: list[ModelRequest] = []

    class DictCalls:
        def estimate_input_tokens(self, request: ModelRequest) -> int:
            return 1

        async def call_model(self, request: ModelRequest, output: ModelOutputWriter) -> ModelResponse:
            calls.append(request)
            call: Any = {"tool_call_id": "c1", "tool_name": "lookup_order", "arguments": "{}"}
            return ModelResponse((ModelOutputItem("scripted", OutputItemKind.TOOL_CALL, "{}", tool_call=call),))

    agent = AgentDefinition(name="dict-calls", model=DictCalls(), instructions="", tools=[lookup_order])
    engine = InProcessEngine(tmp_path, [builtin_agent_session_flow(agent, "DictCallsAgent")])
    async with engine.running():
        await engine.sessions().start_session("s", "look it up")
        done = await _turns_done(engine.sessions(), "s", 1)
    assert done.state is not None and done.state.last_turn_error is not None
    assert "ModelOutputItem.tool_call must be a ModelToolCall or None" in done.state.last_turn_error
    assert len(calls) == 1


async def test_a_failed_turn_stores_its_calls_result_though_an_earlier_turn_used_its_id(tmp_path: Path) -> None:
    """Providers number each response's calls from call_0, so a call of turn 2 may have the ID of an
    answered call of turn 1. When turn 2 fails after its call ran, its result is stored as the call's
    own outcome. Catches (mutant: build_unfinished_turn_messages counting results of every turn as
    answered): no result stored for turn 2's call, and the next model call saw "outcome unknown" for a
    lookup that succeeded."""

    def respond(request: ModelRequest) -> ScriptedModelReply:
        texts = ScriptedModelClient.user_texts(request)
        if texts[-1] == "third":
            return ScriptedModelReply(text="ok")
        results = ScriptedModelClient.tool_results(request)  # those after the last user text
        if texts[-1] == "first" and results:
            return ScriptedModelReply(text="A-1 shipped")
        if texts[-1] == "second" and results:  # '/' in the ID fails the turn in RunModel's commit
            return ScriptedModelReply(tool_calls=[ScriptedToolCall("lookup_order", {"order_id": "B-2"},
                                                                   tool_call_id="call/1")])
        order = "A-1" if texts[-1] == "first" else "B-2"
        return ScriptedModelReply(tool_calls=[ScriptedToolCall("lookup_order", {"order_id": order},
                                                               tool_call_id="call_0")])

    flow, model = scripted_flow(respond)
    engine = InProcessEngine(tmp_path, [flow])
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s", "first")
        await _turns_done(sessions, "s", 1)
        await sessions.send_user_message("s", "second")
        failed = await _turns_done(sessions, "s", 2)
        assert failed.state is not None and "'call/1' contains '/'" in (failed.state.last_turn_error or "")
        await sessions.send_user_message("s", "third")
        await _turns_done(sessions, "s", 3)
    results = [(r.tool_call_id, r.output) for r in model.requests[-1].input if isinstance(r, ToolResultInput)]
    assert [(i, json.loads(o)["order_id"]) for i, o in results] == [("call_0", "A-1"), ("call_0", "B-2")]


async def test_results_reach_the_model_in_the_order_of_its_calls(tmp_path: Path) -> None:
    """The results of one response's calls follow them in the order the model made the calls, not
    in the order of their IDs. Catches (mutant: pending results sorted by tool call ID instead of
    deferral order): the model got "zz-first"'s result after "aa-second"'s."""

    def respond(request: ModelRequest) -> ScriptedModelReply:
        if ScriptedModelClient.tool_results(request):
            return ScriptedModelReply(text="done")
        return ScriptedModelReply(tool_calls=[
            ScriptedToolCall("lookup_order", {"order_id": "A-1"}, tool_call_id="zz-first"),
            ScriptedToolCall("lookup_order", {"order_id": "B-2"}, tool_call_id="aa-second"),
        ])

    flow, model = scripted_flow(respond)
    engine = InProcessEngine(tmp_path, [flow])
    async with engine.running():
        await engine.sessions().start_session("s", "look both up")
        done = await _turns_done(engine.sessions(), "s", 1)
    results = [r.tool_call_id for r in model.requests[-1].input if isinstance(r, ToolResultInput)]
    assert results == ["zz-first", "aa-second"]
    assert [m.tool_call_id for m in done.messages if m.role is MessageRole.TOOL] == ["zz-first", "aa-second"]


async def test_bad_arguments_in_a_whole_response_are_not_blamed_on_the_token_limit(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A call whose arguments are not a JSON object in a response the token limit did not cut fails for
    its arguments alone: no warning tells the operator to raise max_output_tokens. Catches (mutant: the
    calls with bad arguments taken as cut whatever the finish reason): a warning "cut at its token limit
    (finish_reason None)" sent the operator after a limit that was never reached."""

    class BadArguments:
        def estimate_input_tokens(self, request: ModelRequest) -> int:
            return 1

        async def call_model(self, request: ModelRequest, output: ModelOutputWriter) -> ModelResponse:
            if ScriptedModelClient.tool_results(request):
                text = ModelOutputItem("scripted", OutputItemKind.TEXT, json.dumps({"type": "text"}), "Done.")
                return ModelResponse((text,), AgentUsage(model_calls=1))
            calls = (_call_item("call-bad", "lookup_order", '["A-1"]'),)
            return ModelResponse(calls, AgentUsage(model_calls=1), ModelCallMetadata(finish_reasons=("tool_calls",)))

    caplog.set_level(logging.WARNING, logger="dex_agents.builtin_loop")
    agent = AgentDefinition(name="bad", model=BadArguments(), instructions="", tools=[lookup_order])
    engine = InProcessEngine(tmp_path, [builtin_agent_session_flow(agent, "BadArgumentsAgent")])
    async with engine.running():
        await engine.sessions().start_session("s", "look it up")
        done = await _turns_done(engine.sessions(), "s", 1)
    (result,) = [m.tool_output for m in done.messages if m.role is MessageRole.TOOL]
    assert result is not None and "JSON object" in result and "token limit" not in result, result
    assert [r.getMessage() for r in caplog.records if "token limit" in r.getMessage()] == []


def test_the_model_input_drops_a_result_whose_call_it_lacks() -> None:
    """A tool result whose call is not in the input before it (a foreign runner's message, or history
    cut between a call and its result) is left out: providers refuse a request holding one. Catches
    (mutant: such a result kept): every model call of the session was refused by the provider."""
    call = _call_item("call-1", "lookup_order", "{}")
    items: list[ModelInputItem] = [
        ToolResultInput("call-gone", "lookup_order", "orphan"), UserTextInput("hi"), call,
        ToolResultInput("call-1", "lookup_order", "ok"), ToolResultInput("call-1", "lookup_order", "again"),
    ]
    assert _loop_runner._paired(items) == [UserTextInput("hi"), call, ToolResultInput("call-1", "lookup_order", "ok")]


def test_the_model_input_ends_each_call_left_without_a_result_with_outcome_unknown() -> None:
    """A call last in the input with no result (a turn whose results were never stored) gets the
    outcome-unknown result, as one in the middle does: providers refuse a call without a result.
    Catches (mutant: the calls still open at the end of the input left open)."""
    first, last = _call_item("call-1", "lookup_order", "{}"), _call_item("call-2", "lookup_order", "{}")
    assert _loop_runner._paired([first, UserTextInput("hi"), last]) == [
        first, ToolResultInput("call-1", "lookup_order", OUTCOME_UNKNOWN_TEXT), UserTextInput("hi"),
        last, ToolResultInput("call-2", "lookup_order", OUTCOME_UNKNOWN_TEXT),
    ]


async def test_a_model_client_returning_no_model_response_fails_the_turn_naming_it(tmp_path: Path) -> None:
    """call_model returning something other than a ModelResponse fails the turn after that one call,
    saying what it returned and what to return: the client's code is wrong, and a retry would pay for
    the same call again. Catches (mutant: the check dropped): the turn failed with "'dict' object has
    no attribute 'output'", naming neither the client nor the fix; and a retried TypeError."""
    calls: list[str] = []

    class ReturnsDict:
        def estimate_input_tokens(self, request: ModelRequest) -> int:
            return 1

        async def call_model(self, request: ModelRequest, output: ModelOutputWriter) -> ModelResponse:
            calls.append("call_model")
            returned: Any = {"output": []}
            return returned  # type: ignore[no-any-return]

    agent = AgentDefinition(name="returns-dict", model=ReturnsDict(), instructions="")
    engine = InProcessEngine(tmp_path, [builtin_agent_session_flow(agent, "ReturnsDictAgent")])
    async with engine.running():
        await engine.sessions().start_session("s", "hi")
        done = await _turns_done(engine.sessions(), "s", 1)
    assert done.state is not None
    assert "call_model returned dict; return a ModelResponse" in (done.state.last_turn_error or ""), done.state
    assert len(calls) == 1, calls
