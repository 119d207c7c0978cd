"""Compaction and retention (seed 002 "Steps" RunModel and CompactContext, "Rules", "Message storage";
seed 003 "Compaction", "Message storage and retention", "Testing an adapter").

The pure helpers are checked exhaustively, mostly with Hypothesis against plain reference models.
Sessions run the built-in loop with a scripted model on the in-process engine; the Worker-kill test
runs agents/tests/compaction_agent.py as the Worker child. Step shapes come
from the engine's history, the loaded chunks from the running task's stored options.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import msgspec
import pytest
from agents.tests.built_context import running_turn, runtime_of, step_context
from agents.tests.builtin_agent import InProcessEngine
from agents.tests.compaction_agent import answer, compaction_flow, kill_test_flow, say
from agents.tests.conftest import REPO_ROOT
from agents.tests.session_driver import all_agent_events
from engine.tests.conftest import db_url, pg_database, pg_databases  # noqa: F401 - the fixtures used here
from engine.tests.odd_values import UNSHOWABLE_SHOWN, Unshowable
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dex_agents import (
    AGENT_MESSAGE_CHUNKS,
    AGENT_MESSAGE_INDEX,
    AGENT_MESSAGES,
    AGENT_STATE,
    CONTEXT_SUMMARY,
    CONTEXT_SUMMARY_INSTRUCTIONS,
    CONTEXT_SUMMARY_NOTE_HEADER,
    CONTEXT_SUMMARY_TRANSCRIPT_HEADER,
    OUTCOME_UNKNOWN_TEXT,
    AgentEventWriter,
    AgentMessage,
    AgentMessageChunk,
    AgentMessageChunkRange,
    AgentMessageIndex,
    AgentSessionClient,
    AgentSessionFlow,
    AgentSessionOptions,
    AgentSnapshot,
    AgentState,
    AgentStatus,
    AgentTurnContext,
    AgentTurnOutcome,
    AgentUsage,
    CompactContextInput,
    CompactionPolicy,
    ContextCompactionRunner,
    ContextSummary,
    ContextSummaryRequest,
    ContextSummaryResult,
    FrameworkMessage,
    MessageRole,
    ModelCallMetadata,
    RunModelLimit,
    ToolEffect,
    TurnCompleted,
    build_context_summary_omission_note,
    build_context_summary_prompt,
    estimate_stored_input_tokens,
    estimate_text_tokens,
    select_turn_boundary_cutoff,
)
from dex_agents._compaction import (
    RetentionPlan,
    choose_cutoff,
    chunks_between,
    context_summary_note,
    messages_between,
    plan_retention,
)
from dex_agents._compaction_steps import BlankContextSummaryError, CompactionSteps, model_view
from dex_agents._constants import COMPACT_CONTEXT, CONTEXT_SUMMARY_REQUEST_TEXT, RUN_MODEL
from dex_agents._message_store import MessageLayoutLimits, plan_append
from dex_agents._persistence import message_sequence_key
from dex_agents.builtin_loop import (
    AgentDefinition,
    BuiltinLoopAgentRunner,
    ModelOutputItem,
    ModelOutputWriter,
    ModelRequest,
    ModelResponse,
    ModelToolCall,
    ModelToolDefinition,
    OutputItemKind,
    ScriptedModelClient,
    ScriptedModelReply,
    ToolResultInput,
    UserTextInput,
    builtin_agent_session_options,
)
from dex_agents.builtin_loop._compaction import response_cuts, summary_request
from dex_agents.builtin_loop._items import input_item
from dex_agents.testing import (
    AgentTestStack,
    ContextWindowSessionScenario,
    FileGate,
    InvocationLog,
    StepHistoryEntry,
    executed_steps,
    to_step_history,
    wait_for_agent_snapshot,
)
from dex_engine import MAX_VALUE_BYTES, Context, Flow
from dex_engine._context import HeartbeatFn
from dex_engine._transitions import stored_options_json

# Messages and conversations --------------------------------------------------------------------------


def message(sequence: int, role: MessageRole = MessageRole.USER, *, turn: int = 1, text: str | None = "hi",
            call: str | None = None, item: str | None = None) -> AgentMessage:
    return AgentMessage(
        sequence=sequence, turn_id=f"turn-{turn}", role=role, text=text, tool_call_id=call,
        tool_name=None if call is None else "lookup_order", tool_arguments="{}" if role is MessageRole.ASSISTANT
        and call is not None else None, tool_output="out" if role is MessageRole.TOOL else None,
        framework_item=item if item is not None else json.dumps({"role": role.value, "text": text}),
        created_at="2026-01-01T00:00:00.000Z",
    )


def summary_of(last: int, generation: int = 1, text: str = "earlier") -> ContextSummary:
    return ContextSummary(generation=generation, first_sequence=1, last_sequence=last, text=text,
                          created_at="2026-01-01T00:00:00.000Z")


def closed_writer() -> AgentEventWriter:
    writer = AgentEventWriter(lambda event: None, "turn-1", "", 1)
    writer.close()
    return writer


async def no_heartbeat() -> None:
    return None


def turn_context(messages: Sequence[AgentMessage], *, turn_id: str = "turn-9", run_state: str | None = None,
                 summary: ContextSummary | None = None) -> AgentTurnContext:
    return AgentTurnContext(
        flow_id="s", turn_id=turn_id, attempt=1, messages=list(messages), framework_run_state=run_state,
        tool_calls={}, events=closed_writer(), heartbeat=no_heartbeat, tool_policies={},
        default_tool_effect=ToolEffect.UNCLASSIFIED, context_summary=summary,
    )


@st.composite
def conversations(draw: st.DrawFn, max_turns: int = 6) -> list[AgentMessage]:
    """Turns of a built-in loop conversation: a user message, then responses of text and tool calls,
    each call's result after its response (the last response of the last turn may still wait)."""
    out: list[AgentMessage] = []
    turns = draw(st.integers(1, max_turns))
    for turn in range(1, turns + 1):
        out.append(message(len(out) + 1, MessageRole.USER, turn=turn, text=f"q{turn}"))
        for response in range(draw(st.integers(1, 3))):
            calls = [f"c{turn}-{response}-{i}" for i in range(draw(st.integers(0, 3)))]
            if draw(st.booleans()):
                out.append(message(len(out) + 1, MessageRole.ASSISTANT, turn=turn, text=None))  # reasoning
            out.append(message(len(out) + 1, MessageRole.ASSISTANT, turn=turn, text="a"))
            for call in calls:
                out.append(message(len(out) + 1, MessageRole.ASSISTANT, turn=turn, text=None, call=call))
            last_open = turn == turns and draw(st.booleans())
            if calls and not last_open:
                for call in draw(st.permutations(calls)):
                    out.append(message(len(out) + 1, MessageRole.TOOL, turn=turn, text=None, call=call))
            if not calls or last_open:
                break
    return out


# CompactionPolicy and the options ---------------------------------------------------------------------


def test_policy_defaults_and_thresholds() -> None:
    """Defaults are the seed's (trigger 0.85, keep 0.3, nothing reserved); the trigger counts the
    reserved tokens on top of the runner's estimate."""
    policy = CompactionPolicy(context_window_tokens=1000)
    assert (policy.trigger_ratio, policy.retained_ratio, policy.reserved_input_tokens) == (0.85, 0.3, 0)
    assert (policy.trigger_tokens, policy.retained_token_budget) == (850, 300)
    assert not policy.should_compact(849) and policy.should_compact(850)
    # A fractional product rounds up: the trigger is reached, never undercut.
    uneven = CompactionPolicy(context_window_tokens=1001)
    assert uneven.trigger_tokens == 851  # 850.85
    assert not uneven.should_compact(850) and uneven.should_compact(851)
    reserved = CompactionPolicy(context_window_tokens=1000, reserved_input_tokens=100)
    assert not reserved.should_compact(749) and reserved.should_compact(750)
    assert AgentSessionOptions().compaction is None
    assert AgentSessionOptions().retained_message_limit == 1000
    AgentSessionOptions(compaction=policy, retained_message_limit=None)
    AgentSessionOptions(retained_message_limit=0)
    # Every bound the seed states is inclusive where it says so: a 1-token window, trigger_ratio 1
    # (compact only at the full window) and retained_ratio 0 (summarize everything) are valid.
    edge = CompactionPolicy(context_window_tokens=1, trigger_ratio=1, retained_ratio=0)
    assert (edge.trigger_tokens, edge.retained_token_budget) == (1, 0)


@pytest.mark.parametrize(("fields", "problem"), [
    ({"context_window_tokens": 0}, "context_window_tokens must be a whole number from 1 to"),
    ({"context_window_tokens": True}, "context_window_tokens must be a whole number from 1 to"),
    ({"context_window_tokens": 10.0}, "context_window_tokens must be a whole number from 1 to"),
    # Catches: a window past a float's range taken, then trigger_tokens raising OverflowError in
    # every RunModel of every session, in a Worker, instead of here.
    ({"context_window_tokens": 10**400}, "context_window_tokens must be a whole number from 1 to"),
    ({"context_window_tokens": 2**63}, f"context_window_tokens must be a whole number from 1 to {2**63 - 1}, got"),
    ({"context_window_tokens": 10, "trigger_ratio": 0}, "trigger_ratio must be a number above 0 and at most 1"),
    ({"context_window_tokens": 10, "trigger_ratio": 1.5}, "trigger_ratio must be a number above 0 and at most 1"),
    ({"context_window_tokens": 10, "trigger_ratio": float("nan")}, "trigger_ratio must be a number"),
    # A bool is not a ratio, though True == 1; a string is refused with the same ValueError, not a TypeError.
    ({"context_window_tokens": 10, "trigger_ratio": True}, "trigger_ratio must be a number above 0 and at most 1"),
    ({"context_window_tokens": 10, "trigger_ratio": "0.85"}, "trigger_ratio must be a number above 0 and at most 1"),
    ({"context_window_tokens": 10, "retained_ratio": -0.1}, "retained_ratio must be a number from 0 to below 1"),
    # 1 is out of range on its own, not merely not below the default trigger_ratio.
    ({"context_window_tokens": 10, "retained_ratio": 1.0},
     "retained_ratio must be a number from 0 to below 1, got 1.0"),
    ({"context_window_tokens": 10, "retained_ratio": "0.3"}, "retained_ratio must be a number from 0 to below 1"),
    # A whole number past a float's range: math.isfinite raised OverflowError on it.
    ({"context_window_tokens": 10, "trigger_ratio": 10**400}, "trigger_ratio must be a number above 0 and at most 1"),
    ({"context_window_tokens": 10, "trigger_ratio": 0.5, "retained_ratio": 0.5}, "must be below trigger_ratio"),
    ({"context_window_tokens": 10, "reserved_input_tokens": -1}, "reserved_input_tokens must be a whole number"),
    ({"context_window_tokens": 10, "reserved_input_tokens": True}, "reserved_input_tokens must be a whole number"),
    ({"context_window_tokens": 10, "reserved_input_tokens": 1.5}, "reserved_input_tokens must be a whole number"),
    # Catches: reserved tokens that, with what compaction keeps, reach the trigger again at once, so
    # the session summarized nearly every turn (one larger than the whole window was taken too).
    ({"context_window_tokens": 1000, "reserved_input_tokens": 550},
     "reserved_input_tokens (550) and the retained budget (300 tokens, retained_ratio 0.3 of 1000) reach the "
     "trigger (850 tokens) together"),
    ({"context_window_tokens": 450, "reserved_input_tokens": 10_000}, "reserved_input_tokens (10000) and the"),
])
def test_policy_refuses_bad_values(fields: dict[str, Any], problem: str) -> None:
    """Each bad value is a ValueError naming the field."""
    with pytest.raises(ValueError, match="invalid CompactionPolicy") as info:
        CompactionPolicy(**fields)
    assert problem in str(info.value)


def test_reserved_tokens_just_below_the_trigger_are_taken() -> None:
    assert CompactionPolicy(context_window_tokens=1000, reserved_input_tokens=549).reserved_input_tokens == 549


@pytest.mark.parametrize("setting", ["max_output_tokens", "max_completion_tokens", "max_tokens"])
def test_an_agent_whose_summary_output_fills_the_window_is_refused(setting: str) -> None:
    """Catches: every summary request over the window by its reserved output alone, so each left out
    the whole conversation it was to summarize, without an error."""
    model = ScriptedModelClient(lambda r: ScriptedModelReply(text="x"))
    with pytest.raises(ValueError, match=r"max output tokens \(450\) leave no room in the compaction window "
                                         r"\(450 tokens\)"):
        AgentDefinition(name="a", instructions="", model=model, model_settings={setting: 450},
                        compaction=CompactionPolicy(context_window_tokens=450))
    AgentDefinition(name="a", instructions="", model=model, model_settings={setting: 449},
                    compaction=CompactionPolicy(context_window_tokens=450))


def test_an_empty_range_lists_no_chunk_to_load() -> None:
    """chunks_between with through <= after lists nothing, even a chunk that straddles `after`:
    a movement that summarizes no message loads no chunk."""
    index = AgentMessageIndex(chunks=[AgentMessageChunkRange(4, 6)], first_sequence=1, window_first_sequence=7)
    assert chunks_between(index, after=5, through=6) == [AgentMessageChunkRange(4, 6)]
    assert chunks_between(index, after=5, through=5) == []
    assert chunks_between(index, after=5, through=4) == []


def test_transcript_lines_exact_texts() -> None:
    """The summary prompt's transcript lines, pinned as text: the prompt tests build their expected
    prompt with transcript_line itself, so its wording had no test of its own."""
    from dex_agents._compaction import transcript_line

    def msg(role: MessageRole, text: str | None, call_id: str | None = None, name: str | None = None,
            arguments: str | None = None, output: str | None = None) -> AgentMessage:
        return msgspec.structs.replace(message(1, role, text=text, call=call_id, item="{}"), tool_name=name,
                                       tool_arguments=arguments, tool_output=output)

    assert transcript_line(msg(MessageRole.USER, "hi")) == "user: hi"
    assert transcript_line(msg(MessageRole.USER, None)) == "user: {}"
    assert transcript_line(msg(MessageRole.ASSISTANT, None, "c1", "lookup", '{"id":1}')) == (
        'assistant called lookup (c1) with {"id":1}')
    assert transcript_line(msg(MessageRole.ASSISTANT, None, "c1")) == "assistant called a tool (c1) with {}"
    assert transcript_line(msg(MessageRole.ASSISTANT, "ok", "c1", "lookup")) == "assistant: ok"
    # An assistant message with neither text nor a call (a reasoning item) shows its stored item.
    assert transcript_line(msg(MessageRole.ASSISTANT, None)) == "assistant: {}"
    assert transcript_line(msg(MessageRole.TOOL, None, "c1", "lookup", output="found")) == (
        "tool result of lookup (c1): found")
    assert transcript_line(msg(MessageRole.TOOL, None)) == "tool result of a tool (): {}"


def test_policy_names_every_bad_value_in_one_error() -> None:
    """All problems are reported at once, in field order, joined by '; ', so one fix does not reveal the next."""
    with pytest.raises(ValueError) as info:
        CompactionPolicy(context_window_tokens=0, reserved_input_tokens=-1)
    assert str(info.value) == (
        "invalid CompactionPolicy: context_window_tokens must be a whole number from 1 to "
        f"{2**63 - 1}, got 0; "
        "reserved_input_tokens must be a whole number >= 0, got -1"
    )
    # A bad trigger_ratio is its own problem: retained_ratio is not also reported as not below it.
    with pytest.raises(ValueError) as info:
        CompactionPolicy(context_window_tokens=10, trigger_ratio=0)
    assert str(info.value) == "invalid CompactionPolicy: trigger_ratio must be a number above 0 and at most 1, got 0"


@pytest.mark.parametrize(("fields", "problem"), [
    ({"compaction": 1000}, "compaction must be a CompactionPolicy or None"),
    ({"retained_message_limit": -1}, "retained_message_limit must be a whole number >= 0 or None"),
    ({"retained_message_limit": True}, "retained_message_limit must be a whole number >= 0 or None"),
    ({"retained_message_limit": 1.0}, "retained_message_limit must be a whole number >= 0 or None"),
])
def test_session_options_refuse_bad_compaction_values(fields: dict[str, Any], problem: str) -> None:
    with pytest.raises(ValueError, match="invalid AgentSessionOptions") as info:
        AgentSessionOptions(**fields)
    assert problem in str(info.value)


class PlainRunner:
    """A runner with only the three base methods: no ContextCompactionRunner."""

    def __init__(self, inner: BuiltinLoopAgentRunner) -> None:
        self.inner = inner

    def build_user_message(self, text: str) -> Any:
        return self.inner.build_user_message(text)

    async def run_model_step(self, turn: AgentTurnContext) -> Any:
        return await self.inner.run_model_step(turn)

    async def execute_deferred_tool_call(self, call: Any) -> Any:
        return await self.inner.execute_deferred_tool_call(call)


def test_flow_refuses_a_policy_for_a_runner_without_compaction() -> None:
    """AgentSessionFlow raises TypeError naming the missing methods; the built-in loop implements them,
    and AgentDefinition.compaction sets the option."""
    definition = AgentDefinition(name="a", instructions="x", model=ScriptedModelClient(lambda r: ScriptedModelReply()),
                                 compaction=CompactionPolicy(context_window_tokens=500))
    runner = BuiltinLoopAgentRunner(definition)
    assert isinstance(runner, ContextCompactionRunner)
    options = builtin_agent_session_options(definition)
    assert options.compaction == CompactionPolicy(context_window_tokens=500)
    AgentSessionFlow(runner, "Compacting", options)
    with pytest.raises(TypeError, match="needs a ContextCompactionRunner") as info:
        AgentSessionFlow(PlainRunner(runner), "Plain", options)
    assert "estimate_input_tokens, select_compaction_cutoff, summarize_context" in str(info.value)
    AgentSessionFlow(PlainRunner(runner), "PlainWithout", replace(options, compaction=None))
    with pytest.raises(ValueError, match="compaction must be a CompactionPolicy"):
        AgentDefinition(name="a", instructions="x", model=definition.model, compaction=500)  # type: ignore[arg-type]


def test_compact_context_has_run_models_options() -> None:
    """CompactContext: RunModel's input type, timeouts, retries, failure route and SYNC durability."""
    flow, _ = compaction_flow("OptionsAgent", answer, window=500)
    run_model, compact = flow.step(RUN_MODEL), flow.step(COMPACT_CONTEXT)
    for name in ("failure_route", "execute_timeout_seconds", "heartbeat_timeout_seconds", "execute_retry",
                 "durability", "load"):
        assert getattr(compact.options, name) == getattr(run_model.options, name), name
    assert compact.options.failure_route == "RecordTurnFailure"
    assert compact.input_type == run_model.input_type


# Token estimates and texts ----------------------------------------------------------------------------


@settings(max_examples=50, deadline=None)
@given(st.text(max_size=200))
def test_estimate_text_tokens_is_three_bytes_a_token_rounded_up(text: str) -> None:
    size = len(text.encode())
    assert estimate_text_tokens(text) == -(-size // 3)
    assert 3 * estimate_text_tokens(text) >= size > 3 * (estimate_text_tokens(text) - 1)


@pytest.mark.parametrize(("text", "shown"), [(None, "NoneType: None"), (b"abc", "bytes: b'abc'"), (5, "int: 5")])
def test_estimate_text_tokens_names_a_text_that_is_not_one(text: Any, shown: str) -> None:
    """Catches: a runner's estimate_input_tokens given a tool call message's text (None) failing
    RunModel with "'NoneType' object has no attribute 'encode'"."""
    with pytest.raises(TypeError) as caught:
        estimate_text_tokens(text)
    assert str(caught.value) == (f"estimate_text_tokens takes a str, got {shown}; for a message whose text may be "
                                 "None, pass message.text or ''")


def test_fixed_texts() -> None:
    """The model-visible texts are the seed's."""
    assert CONTEXT_SUMMARY_NOTE_HEADER == "[Dex] Summary of the earlier conversation:"
    assert context_summary_note(summary_of(5, text="S")) == "[Dex] Summary of the earlier conversation:\nS"
    assert build_context_summary_omission_note(1) == (
        "[Dex] 1 earlier message did not fit in this request and is left out.")
    assert build_context_summary_omission_note(7) == (
        "[Dex] 7 earlier messages did not fit in this request and are left out.")
    assert CONTEXT_SUMMARY_TRANSCRIPT_HEADER.startswith("[Dex] ")


def test_estimate_stored_input_tokens_counts_items_the_note_and_fixed_tokens() -> None:
    messages = [message(1, item="x" * 30), message(2, MessageRole.ASSISTANT, item="y" * 31)]
    assert estimate_stored_input_tokens(turn_context(messages)) == 10 + 11
    assert estimate_stored_input_tokens(turn_context(messages), fixed_input_tokens=100) == 121
    summary = summary_of(0, text="z" * 9)
    with_note = estimate_stored_input_tokens(turn_context(messages, summary=summary))
    assert with_note == 21 + estimate_text_tokens(context_summary_note(summary))


# Cutoffs ------------------------------------------------------------------------------------------------


@settings(max_examples=120, deadline=None)
@given(tokens=st.lists(st.integers(0, 50), max_size=12), data=st.data(), budget=st.integers(0, 200))
def test_choose_cutoff_keeps_as_much_as_fits(tokens: list[int], data: st.DataObject, budget: int) -> None:
    """None when everything fits or no cut is valid; else the earliest valid cut whose remainder fits,
    or, when none fits, the latest valid cut."""
    messages = [message(i + 1) for i in range(len(tokens))]
    valid = data.draw(st.lists(st.booleans(), min_size=max(0, len(tokens) - 1), max_size=max(0, len(tokens) - 1)))
    chosen = choose_cutoff(messages, tokens, valid, budget)
    cuts = [i for i, ok in enumerate(valid) if ok]
    if sum(tokens) <= budget or not cuts:
        assert chosen is None
        return
    assert chosen is not None
    position = chosen - 1
    assert position in cuts
    fitting = [i for i in cuts if sum(tokens[i + 1:]) <= budget]
    assert position == (fitting[0] if fitting else cuts[-1])


def test_choose_cutoff_keeps_nothing_over_the_budget() -> None:
    """A remainder exactly at the budget fits and one token over does not: the kept tokens are counted
    from zero, so a retained budget is never exceeded by one."""
    messages = [message(1), message(2), message(3)]
    assert choose_cutoff(messages, [5, 5, 5], [True, True], 10) == 1  # the last two stay: 10 tokens
    assert choose_cutoff(messages, [5, 5, 5], [True, True], 9) == 2  # 10 > 9: only the last stays


@settings(max_examples=150, deadline=None)
@given(conversation=conversations())
def test_response_cuts_never_split_a_response_or_a_call_from_its_result(conversation: list[AgentMessage]) -> None:
    """The built-in loop cuts only between model responses, never inside one, and never after a call
    of the running turn whose result is not stored before the cut; every other place is a valid cut
    (the rule is not stricter than it says). A valid cut never separates a call from its result."""
    valid = response_cuts(conversation)
    assert len(valid) == max(0, len(conversation) - 1)
    for position, ok in enumerate(valid):
        before, after = conversation[: position + 1], conversation[position + 1:]
        inside = before[-1].role is MessageRole.ASSISTANT and after[0].role is MessageRole.ASSISTANT
        turn = before[-1].turn_id
        calls = {m.tool_call_id for m in before if m.turn_id == turn and m.role is MessageRole.ASSISTANT
                 and m.tool_call_id}
        answered = {m.tool_call_id for m in before if m.turn_id == turn and m.role is MessageRole.TOOL}
        open_in_turn = bool(calls - answered) and after[0].turn_id == turn
        assert ok == (not inside and not open_in_turn), (position, conversation)
        if ok:
            called = {(m.turn_id, m.tool_call_id) for m in before if m.role is MessageRole.ASSISTANT and m.tool_call_id}
            results_after = {(m.turn_id, m.tool_call_id) for m in after if m.role is MessageRole.TOOL}
            assert not called & results_after


def test_response_cuts_pass_an_earlier_turns_call_that_never_got_a_result() -> None:
    """A call of an earlier turn with no stored result (the loop shows it as outcome unknown) blocks no
    cut: neither the one at its turn's end nor those inside later turns. The conversations above leave
    a call open only in the last turn. Catches: the open call kept past its turn, or blocking the cut
    at the turn's end, so a session compacted only at its turns' starts, or never."""
    conversation = [
        message(1, MessageRole.USER, turn=1), message(2, MessageRole.ASSISTANT, turn=1, text=None, call="c1"),
        message(3, MessageRole.USER, turn=2), message(4, MessageRole.ASSISTANT, turn=2, text=None, call="c2"),
        message(5, MessageRole.TOOL, turn=2, text=None, call="c2"), message(6, MessageRole.ASSISTANT, turn=2, text="a"),
        message(7, MessageRole.USER, turn=3),
    ]
    assert response_cuts(conversation) == [True, True, True, False, True, True]


def test_item_tokens_are_each_items_share_of_the_request_estimate() -> None:
    """select_response_cutoff weighs each message as estimate_request_tokens counts it: a tool result
    with its tool name. Catches: the name left out, so the kept messages outgrew the retained budget."""
    from dex_agents.builtin_loop._compaction import item_tokens
    from dex_agents.builtin_loop._model import estimate_request_tokens
    items = (UserTextInput("q" * 10), ToolResultInput("c1", "lookup_order", "r" * 20),
             ModelOutputItem("scripted", OutputItemKind.TEXT, json.dumps({"type": "text", "text": "a" * 30}), "a" * 30))
    request = ModelRequest(instructions=None, input=items)
    assert [item_tokens(i) for i in items] == [4, 7 + 4, 20]  # an output item counts its whole JSON
    assert sum(map(item_tokens, items)) == estimate_request_tokens(request)


@settings(max_examples=100, deadline=None)
@given(conversation=conversations(), budget=st.integers(0, 400), resuming=st.booleans())
def test_turn_boundary_cutoff_cuts_only_between_earlier_turns(
    conversation: list[AgentMessage], budget: int, resuming: bool
) -> None:
    """select_turn_boundary_cutoff: None while the turn resumes from run state; otherwise a cut only at
    the end of a turn before the running one (the last turn here)."""
    running = conversation[-1].turn_id
    turn = turn_context(conversation, turn_id=running, run_state="{}" if resuming else None)
    chosen = select_turn_boundary_cutoff(turn, budget)
    if resuming:
        assert chosen is None
        return
    if chosen is None:
        return
    cut = next(i for i, m in enumerate(conversation) if m.sequence == chosen)
    assert conversation[cut].turn_id != running
    assert conversation[cut + 1].turn_id != conversation[cut].turn_id


def test_turn_boundary_cutoff_keeps_what_fits() -> None:
    """Three earlier turns of 10 tokens a message and the running turn: the budget decides how many
    whole turns stay."""
    messages = []
    for turn in (1, 2, 3, 4):
        for role in (MessageRole.USER, MessageRole.ASSISTANT):
            messages.append(message(len(messages) + 1, role, turn=turn, item="x" * 30))
    turn = turn_context(messages, turn_id="turn-4")
    assert select_turn_boundary_cutoff(turn, 80) is None  # everything fits
    assert select_turn_boundary_cutoff(turn, 40) == 4  # turns 3 and 4 stay
    assert select_turn_boundary_cutoff(turn, 30) == 6  # only the running turn fits
    assert select_turn_boundary_cutoff(turn, 5) == 6  # nothing fits: the latest cut, never inside turn 4
    # A running turn with no stored message yet: the last stored message is an earlier turn's, and the
    # cuts between earlier turns still count (the cut after the newest message is never one).
    assert select_turn_boundary_cutoff(turn_context(messages[:6], turn_id="turn-4"), 5) == 4


def test_builtin_cutoff_compacts_mid_turn_between_complete_responses() -> None:
    """One long running turn of calls and results: the built-in loop cuts inside it, after a result,
    never after a call whose result is not stored, and returns None once what is left fits."""
    messages = [message(1, MessageRole.USER, item='{"type":"user_text","text":"' + "q" * 60 + '"}')]
    for k in range(1, 6):
        messages.append(message(len(messages) + 1, MessageRole.ASSISTANT, text=None, call=f"c{k}"))
        messages.append(message(len(messages) + 1, MessageRole.TOOL, text=None, call=f"c{k}"))
    messages.append(message(len(messages) + 1, MessageRole.ASSISTANT, text=None, call="c6"))  # result pending
    runner = BuiltinLoopAgentRunner(AgentDefinition(name="a", instructions="x",
                                                    model=ScriptedModelClient(lambda r: ScriptedModelReply())))
    turn = turn_context(messages, turn_id="turn-1")
    chosen = runner.select_compaction_cutoff(turn, 10)
    assert chosen == 11  # after c5's result; c6 has no stored result
    rest = [m for m in messages if m.sequence > chosen]
    assert runner.select_compaction_cutoff(turn_context(rest, turn_id="turn-1"), 10) is None


# Retention and reads --------------------------------------------------------------------------------------


@dataclass
class Layout:
    """A store built with plan_append, as a session's Steps would leave it."""

    limits: MessageLayoutLimits
    window: dict[int, AgentMessage] = field(default_factory=dict)
    chunks: dict[int, list[AgentMessage]] = field(default_factory=dict)
    index: AgentMessageIndex | None = None
    appended: list[AgentMessage] = field(default_factory=list)

    def append(self, sizes: Sequence[int]) -> None:
        new = [message(len(self.appended) + i + 1, text="x" * size) for i, size in enumerate(sizes)]
        writes = plan_append(sorted(self.window.values(), key=lambda m: m.sequence), self.index, new, self.limits)
        for chunk in writes.chunk_sets:
            self.chunks[chunk.messages[0].sequence] = list(chunk.messages)
        self.window.update({m.sequence: m for m in writes.window_sets})
        for sequence in writes.window_deletes:
            del self.window[sequence]
        if writes.index is not None:
            self.index = writes.index
        self.appended.extend(new)

    def read_chunk(self, chunk_range: AgentMessageChunkRange) -> Any:
        from dex_agents import AgentMessageChunk
        return AgentMessageChunk(tuple(self.chunks[chunk_range.first_sequence]))


layout_strategy = st.builds(
    lambda window, chunk, limit, commits: (MessageLayoutLimits(window, chunk, limit), commits),
    st.integers(1, 5), st.integers(1, 4), st.integers(150, 900),
    st.lists(st.lists(st.integers(0, 500), min_size=1, max_size=4), min_size=1, max_size=14),
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(built=layout_strategy, data=st.data())
def test_plan_retention_matches_the_rule(built: tuple[MessageLayoutLimits, list[list[int]]], data: st.DataObject,
                                         ) -> None:
    """Retention deletes the oldest chunk while it starts at the oldest stored message, its last
    sequence is at or before the summary's, and at least retained_message_limit messages are stored
    after it; first_sequence then follows the deleted chunks. Nothing happens without an index, a
    summary or a limit."""
    limits, commits = built
    layout = Layout(limits)
    for sizes in commits:
        layout.append(sizes)
    newest = len(layout.appended)
    summary = summary_of(data.draw(st.integers(0, newest)))
    limit = data.draw(st.integers(0, newest + 2))
    plan = plan_retention(layout.index, summary, limit, newest)
    assert plan_retention(layout.index, None, limit, newest) == RetentionPlan()
    assert plan_retention(layout.index, summary, None, newest) == RetentionPlan()
    assert plan_retention(None, summary, limit, newest) == RetentionPlan()
    if layout.index is None:
        assert plan == RetentionPlan()
        return
    # Reference: walk the chunks oldest first.
    expected: list[AgentMessageChunkRange] = []
    first = layout.index.first_sequence
    for chunk in layout.index.chunks:
        if chunk.first_sequence != first or chunk.last_sequence > summary.last_sequence:
            break
        if newest - chunk.last_sequence < limit:
            break
        expected.append(chunk)
        first = chunk.last_sequence + 1
    assert list(plan.deleted) == expected
    if not expected:
        assert plan.index is None
        return
    assert plan.index is not None
    assert plan.index.chunks == layout.index.chunks[len(expected):]
    assert plan.index.first_sequence == expected[-1].last_sequence + 1
    assert plan.index.window_first_sequence == max(layout.index.window_first_sequence, plan.index.first_sequence)
    # Every message after the summary and the newest `limit` stay; readers see exactly what is left.
    kept = {c.first_sequence for c in plan.index.chunks}
    remaining = [m for m in layout.appended if m.sequence >= plan.index.first_sequence]
    assert messages_between(plan.index, list(layout.window.values()),
                            lambda r: layout.read_chunk(r) if r.first_sequence in kept else None,
                            after=0) == remaining
    assert plan.index.first_sequence <= summary.last_sequence + 1
    assert newest - plan.index.first_sequence + 1 >= min(limit, newest)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(built=layout_strategy, data=st.data())
def test_messages_between_reads_only_the_chunks_it_lists(built: tuple[MessageLayoutLimits, list[list[int]]],
                                                         data: st.DataObject) -> None:
    """messages_between returns exactly the messages in (after, through], in order, and reads only the
    chunks chunks_between lists (what a movement loads): any other read fails."""
    limits, commits = built
    layout = Layout(limits)
    for sizes in commits:
        layout.append(sizes)
    newest = len(layout.appended)
    after = data.draw(st.integers(0, newest))
    through = data.draw(st.none() | st.integers(after, newest))
    listed = {r.first_sequence for r in chunks_between(layout.index, after=after, through=through)}
    read: list[int] = []

    def read_chunk(chunk_range: AgentMessageChunkRange) -> Any:
        assert chunk_range.first_sequence in listed, f"read unlisted chunk {chunk_range}"
        read.append(chunk_range.first_sequence)
        return layout.read_chunk(chunk_range)

    got = messages_between(layout.index, list(layout.window.values()), read_chunk, after=after, through=through)
    top = newest if through is None else through
    assert got == [m for m in layout.appended if after < m.sequence <= top]
    # Every listed chunk holds a wanted message.
    for first in listed:
        assert any(after < m.sequence <= top for m in layout.chunks[first])


def test_messages_between_ignores_window_instances_outside_the_window() -> None:
    """As every reader (test_reads_ignore_window_instances_outside_the_window): a sequence a chunk
    holds comes from that chunk, and an instance before window_first_sequence is not read, so the
    compacted model input and the summarized range hold each message once. Catches: messages_between
    taking every window instance after `after`."""
    chunk = AgentMessageChunk((message(2, text="chunk"), message(3, text="chunk")))
    index = AgentMessageIndex(chunks=[AgentMessageChunkRange(2, 3)], first_sequence=2, window_first_sequence=4)
    stale = [message(1, text="stale"), message(3, text="stale"), message(4), message(5)]
    got = messages_between(index, stale, lambda r: chunk, after=0)
    assert [(m.sequence, m.text) for m in got] == [(2, "chunk"), (3, "chunk"), (4, "hi"), (5, "hi")]
    # An oversized message's chunk (4) sits among the window's sequences: its window instance is not read.
    chunks = {1: AgentMessageChunk((message(1, text="chunk"), message(2, text="chunk"))),
              4: AgentMessageChunk((message(4, text="chunk"),))}
    index = AgentMessageIndex(chunks=[AgentMessageChunkRange(1, 2), AgentMessageChunkRange(4, 4)], first_sequence=1,
                              window_first_sequence=3)
    got = messages_between(index, [message(3), message(4, text="stale"), message(5)],
                           lambda r: chunks[r.first_sequence], after=1, through=4)
    assert [(m.sequence, m.text) for m in got] == [(2, "chunk"), (3, "hi"), (4, "chunk")]


# Summary prompts -----------------------------------------------------------------------------------------


def summary_request_of(messages: Sequence[AgentMessage], budget: int, previous: ContextSummary | None = None,
                       ) -> ContextSummaryRequest:
    return ContextSummaryRequest(
        flow_id="s", turn_id="turn-1", attempt=1, previous_summary=previous, messages=list(messages),
        through_sequence=messages[-1].sequence if messages else 0, events=closed_writer(), heartbeat=no_heartbeat,
        input_token_budget=budget,
    )


@settings(max_examples=100, deadline=None)
@given(sizes=st.lists(st.integers(0, 120), min_size=1, max_size=12), budget=st.integers(1, 800),
       previous=st.booleans())
def test_summary_prompt_fits_its_budget(sizes: list[int], budget: int, previous: bool) -> None:
    """build_context_summary_prompt starts with the transcript header and the instructions, carries
    the previous summary, and leaves out the fewest oldest messages (saying how many) that make it fit
    the budget; when even the header does not fit, every message is left out."""
    roles = [MessageRole.USER, MessageRole.ASSISTANT, MessageRole.TOOL]
    messages = [message(i + 1, roles[i % 3], text="w" * size, call="c" if i % 3 else None)
                for i, size in enumerate(sizes)]
    earlier = summary_of(0, text="the earlier summary") if previous else None
    prompt = build_context_summary_prompt(summary_request_of(messages, budget, earlier))
    assert prompt.startswith(CONTEXT_SUMMARY_TRANSCRIPT_HEADER + "\n" + CONTEXT_SUMMARY_INSTRUCTIONS)
    assert ("the earlier summary" in prompt) == previous
    omitted = 0
    for count in range(len(messages), 0, -1):
        if build_context_summary_omission_note(count) in prompt:
            omitted = count
            break
    kept = messages[omitted:]
    if kept:
        assert prompt.split("\n")[-len(kept):] == [transcript(m) for m in kept]
    if omitted == 0:
        assert "did not fit" not in prompt
    if omitted < len(messages):
        assert estimate_text_tokens(prompt) <= budget
    if omitted:
        # Leaving nothing out would not have fitted.
        whole = build_context_summary_prompt(summary_request_of(messages, 10**9, earlier))
        assert estimate_text_tokens(whole) > budget
    assert prompt == reference_summary_prompt(messages, earlier, budget)


def reference_summary_prompt(messages: list[AgentMessage], earlier: ContextSummary | None, budget: int) -> str:
    """The summary prompt built the slow way: each candidate leaving out the k oldest messages made
    whole and measured, the smallest k that fits taken (every message when none fits)."""
    head = [CONTEXT_SUMMARY_TRANSCRIPT_HEADER, CONTEXT_SUMMARY_INSTRUCTIONS, ""]
    if earlier is not None:
        head += [context_summary_note(earlier), ""]

    def leaving_out(k: int) -> str:
        note = [build_context_summary_omission_note(k), ""] if k else []
        return "\n".join(head + note + [transcript(m) for m in messages[k:]])

    fewest = next((k for k in range(len(messages) + 1) if estimate_text_tokens(leaving_out(k)) <= budget),
                  len(messages))
    return leaving_out(fewest)


@pytest.mark.parametrize("previous", [False, True])
def test_summary_prompt_trims_exactly_at_every_budget(previous: bool) -> None:
    """At every budget from one token to the whole prompt, for message sizes that put each candidate on
    each side of a token boundary, the prompt leaves out exactly the fewest oldest messages that make
    it fit: the byte arithmetic (a newline per line, the note and its blank line) is exact, with no
    slack either way."""
    earlier = summary_of(0, text="the earlier summary") if previous else None
    for pad in range(3):
        messages = [message(1, MessageRole.USER, text="w" * (10 + pad)),
                    message(2, MessageRole.ASSISTANT, text="é" * 7, call="c"),
                    message(3, MessageRole.TOOL, text="w" * (20 + pad), call="c"),
                    message(4, MessageRole.ASSISTANT, text="w" * (4 + pad))]
        whole = estimate_text_tokens(reference_summary_prompt(messages, earlier, 10**9))
        for budget in range(1, whole + 2):
            got = build_context_summary_prompt(summary_request_of(messages, budget, earlier))
            assert got == reference_summary_prompt(messages, earlier, budget), (pad, budget)


def transcript(m: AgentMessage) -> str:
    from dex_agents._compaction import transcript_line
    return transcript_line(m)


def builtin_messages(items: Sequence[Any], turn_ids: Sequence[int]) -> list[AgentMessage]:
    """Stored messages from built-in loop items (FrameworkMessage), one turn number each."""
    from dex_agents._turn_logic import to_agent_message
    return [to_agent_message(item, i + 1, f"turn-{turn}", "2026-01-01T00:00:00.000Z")
            for i, (item, turn) in enumerate(zip(items, turn_ids, strict=True))]


def test_builtin_summary_request_leaves_out_the_oldest_whole_responses() -> None:
    """With max_output_tokens set, a request over input_token_budget leaves out the oldest messages up
    to a valid cut (never a result without its call) and says so after the previous summary; it uses
    CONTEXT_SUMMARY_INSTRUCTIONS, no tools, and ends with the request text."""
    from dex_agents.builtin_loop._items import output_message, tool_result_message, user_message
    items: list[Any] = []
    turns: list[int] = []
    for turn in range(1, 5):
        call = ModelToolCall(f"c{turn}", "lookup_order", '{"order_id": "' + "o" * 60 + '"}')
        output = ModelOutputItem("scripted", OutputItemKind.TOOL_CALL, json.dumps({"id": call.tool_call_id}), None,
                                 call)
        items += [user_message("u" * 90), output_message(output),
                  tool_result_message(ToolResultInput(call.tool_call_id, "lookup_order", "r" * 60))]
        turns += [turn] * 3
    messages = builtin_messages(items, turns)
    model = ScriptedModelClient(lambda r: ScriptedModelReply())
    full, omitted = summary_request(summary_request_of(messages, 10_000), {}, model)
    assert omitted == 0 and full.instructions == CONTEXT_SUMMARY_INSTRUCTIONS and full.tools == ()
    assert ScriptedModelClient.is_summary_request(full)
    # A turn's request whose instructions happen to be the summary's still offers tools: not one.
    assert not ScriptedModelClient.is_summary_request(replace(full, tools=(ModelToolDefinition("t", "T", {}),)))
    assert full.input[-1] == UserTextInput(CONTEXT_SUMMARY_REQUEST_TEXT)
    assert list(full.input[:-1]) == [input_item(m) for m in messages]
    size = model.estimate_input_tokens(full)
    budget = size - 40
    request = summary_request_of(messages, budget, summary_of(0, text="before"))
    built, omitted = summary_request(request, {"max_output_tokens": 100}, model)
    cuts = [i + 1 for i, ok in enumerate(response_cuts(messages)) if ok]
    assert omitted in cuts and messages[omitted].role is not MessageRole.TOOL
    assert built.input[0] == UserTextInput(context_summary_note(summary_of(0, text="before")))
    assert built.input[1] == UserTextInput(build_context_summary_omission_note(omitted))
    assert list(built.input[2:-1]) == [input_item(m) for m in messages[omitted:]]
    # The fewest messages that fit: the previous cut would not have.
    assert model.estimate_input_tokens(built) + 100 <= budget or omitted == cuts[-1]
    smaller = [c for c in cuts if c < omitted]
    if smaller:
        shorter = summary_request_of(messages[smaller[-1]:], 10**9, summary_of(0, text="before"))
        assert model.estimate_input_tokens(summary_request(shorter, {}, model)[0]) + 100 > budget - 20


def test_builtin_summary_request_fits_its_budget_exactly() -> None:
    """input_token_budget is inclusive: a summary request whose estimate plus max_output_tokens is the
    budget exactly leaves nothing out; one token less leaves the oldest message out."""
    from dex_agents.builtin_loop._items import user_message
    messages = builtin_messages([user_message("u" * 90) for _ in range(3)], [1, 2, 3])
    model = ScriptedModelClient(lambda r: ScriptedModelReply())
    size = model.estimate_input_tokens(summary_request(summary_request_of(messages, 10**6), {}, model)[0])
    settings_ = {"max_output_tokens": 100}
    assert summary_request(summary_request_of(messages, size + 100), settings_, model)[1] == 0
    assert summary_request(summary_request_of(messages, size + 99), settings_, model)[1] == 1
    # A name set to 0 or None is unset: the next name's limit is the reserve. Catches: 0 taken as the
    # reserve, so a request that leaves no room for max_tokens' output is sent whole.
    for unset in (0, None):
        fallback = {"max_output_tokens": unset, "max_tokens": 100}
        assert summary_request(summary_request_of(messages, size + 99), fallback, model)[1] == 1


async def test_scripted_model_answers_summary_requests() -> None:
    """ScriptedModelClient answers a summary request with `summarize`, or a short default summary, never
    with the turn script; the summary text is what the runner returns."""
    def script(request: ModelRequest) -> ScriptedModelReply:
        raise AssertionError("the turn script must not see a summary request")

    messages = [message(1, item=json.dumps({"type": "user_text", "text": "remember 42"}))]
    request = summary_request_of(messages, 10_000)
    definition = AgentDefinition(name="a", instructions="x", model=ScriptedModelClient(script))
    result = await BuiltinLoopAgentRunner(definition).summarize_context(request)
    assert isinstance(result, ContextSummaryResult)
    assert result.text == "Scripted summary of 2 input items. The last user message was: remember 42"
    assert result.usage.model_calls == 1

    async def summarize(model_request: ModelRequest) -> str:
        assert ScriptedModelClient.is_summary_request(model_request)
        return "custom summary"

    custom = AgentDefinition(name="a", instructions="x", model=ScriptedModelClient(script, summarize=summarize))
    assert (await BuiltinLoopAgentRunner(custom).summarize_context(request)).text == "custom summary"


# Sessions -----------------------------------------------------------------------------------------------

async def run_turns(sessions: AgentSessionClient, sid: str, texts: Sequence[str], start: int = 0) -> AgentSnapshot:
    snapshot: AgentSnapshot | None = None
    for offset, text in enumerate(texts):
        assert await sessions.send_user_message(sid, text)
        count = start + offset + 1
        snapshot = await wait_for_agent_snapshot(
            sessions, sid, lambda s, c=count: s if s.state is not None and s.state.turn_count >= c else None,
            description=f"turn {count} to end")
    assert snapshot is not None
    return snapshot


async def run_one_session(
    tmp_path: Path, flow: Flow, texts: Sequence[str]
) -> tuple[AgentSnapshot, list[StepHistoryEntry]]:
    """Session "s" of `flow` on a fresh engine, run through `texts`: its last snapshot and its Step history."""
    engine = InProcessEngine(tmp_path, [flow])
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s")
        done = await run_turns(sessions, "s", texts)
        return done, to_step_history(await engine.client.get_flow_history("s"))


async def all_messages(sessions: AgentSessionClient, sid: str) -> list[AgentMessage]:
    pages: list[list[AgentMessage]] = []
    cursor: int | None = None
    while True:
        page = await sessions.list_agent_messages(sid, before_sequence=cursor, limit=200)
        pages.append(page.messages)
        if page.next_before_sequence is None:
            return [m for page_messages in reversed(pages) for m in page_messages]
        cursor = page.next_before_sequence


def model_calls(model: ScriptedModelClient) -> list[ModelRequest]:
    return [r for r in model.requests if not ScriptedModelClient.is_summary_request(r)]


def summary_calls(model: ScriptedModelClient) -> list[ModelRequest]:
    return [r for r in model.requests if ScriptedModelClient.is_summary_request(r)]


def check_inputs_after_summaries(model: ScriptedModelClient, stored: list[AgentMessage],
                                 throughs: list[int], texts: list[str]) -> int:
    """Each model call right after a summary sees the summary note and then exactly the stored messages
    after the cut, in order: nothing summarized, nothing orphaned, no outcome-unknown filler."""
    checked = 0
    requests = list(model.requests)
    generation = 0
    for position, request in enumerate(requests):
        if ScriptedModelClient.is_summary_request(request):
            generation += 1
            following = requests[position + 1]
            assert not ScriptedModelClient.is_summary_request(following)
            note = UserTextInput(context_summary_note(summary_of(throughs[generation - 1], text=texts[generation - 1])))
            assert following.input[0] == note
            after = [input_item(m) for m in stored if m.sequence > throughs[generation - 1]]
            assert list(following.input[1:]) == after[: len(following.input) - 1]
            assert all(not (isinstance(i, ToolResultInput) and i.output == OUTCOME_UNKNOWN_TEXT)
                       for i in following.input)
            checked += 1
    return checked


async def test_compaction_summarizes_before_the_model_call(tmp_path: Path) -> None:
    """Past the trigger, RunModel makes no model call and moves to CompactContext, which makes one
    summary call and moves back to RunModel: RunModel -> CompactContext -> RunModel in the history.
    ContextSummary counts generations from 1 with first_sequence 1 and last_sequence the cut; the summary
    calls' usage is recorded; compaction_started and compaction_finished carry the cut; the next model
    call sees the note and exactly the messages after the cut; the summary request folds in the
    previous summary and the messages after it through the cut."""
    texts: list[str] = []

    def summarize(request: ModelRequest) -> str:
        texts.append(f"summary {len(texts) + 1}: " + ScriptedModelClient.default_summary(request))
        return texts[-1]

    seen: list[tuple[list[int], ContextSummary | None]] = []

    class Recording(BuiltinLoopAgentRunner):
        async def run_model_step(self, turn: AgentTurnContext) -> Any:
            seen.append(([m.sequence for m in turn.messages], turn.context_summary))
            return await super().run_model_step(turn)

    flow, model = compaction_flow("CompactingAgent", answer, window=450, summarize=summarize,
                                  runner=Recording, retained_message_limit=None)
    engine = InProcessEngine(tmp_path, [flow])
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s")
        final = await run_turns(sessions, "s", [say(n) for n in range(1, 15)])
        assert final.state is not None and final.state.last_turn_error is None
        summary = final.context_summary
        assert summary is not None and summary.generation >= 2
        events = [e.value for e in await all_agent_events(sessions, "s")]
        started = [e for e in events if e.type == "compaction_started"]
        finished = [e for e in events if e.type == "compaction_finished"]
        throughs = [json.loads(e.payload)["through_sequence"] for e in finished]
        assert [json.loads(e.payload) for e in finished] == [
            {"generation": g, "through_sequence": t} for g, t in enumerate(throughs, 1)]
        assert [json.loads(e.payload) for e in started] == [{"through_sequence": t} for t in throughs]
        assert all(e.turn_id is not None and e.step_execution_id.startswith("CompactContext") for e in started)
        assert throughs == sorted(set(throughs))
        assert (summary.generation, summary.first_sequence, summary.last_sequence, summary.text) == (
            len(throughs), 1, throughs[-1], texts[-1])
        assert summary.created_at.endswith("Z")

        history = to_step_history(await engine.client.get_flow_history("s"))
        steps = executed_steps(history)
        at = [i for i, step in enumerate(steps) if step == COMPACT_CONTEXT]
        assert len(at) == summary.generation
        assert all(steps[i - 1] == RUN_MODEL and steps[i + 1] == RUN_MODEL for i in at)
        # The RunModel that moved to CompactContext made no model call.
        assert steps.count(RUN_MODEL) == 14 + summary.generation == len(model_calls(model)) + summary.generation
        assert len(summary_calls(model)) == summary.generation
        assert final.usage.model_calls == 14 + summary.generation

        stored = await all_messages(sessions, "s")
        assert [m.sequence for m in stored] == list(range(1, 29))  # retained_message_limit=None keeps all
        # The runner gets only the messages after the summary, and the summary.
        assert len(seen) == 14
        for sequences, seen_summary in seen:
            after = 0 if seen_summary is None else seen_summary.last_sequence
            assert sequences == list(range(after + 1, sequences[-1] + 1))
        assert seen[-1][1] == summary
        assert check_inputs_after_summaries(model, stored, throughs, texts) == summary.generation
        # The second summary request: the first summary's note, then the messages after it through the cut.
        second = summary_calls(model)[1]
        assert second.input[0] == UserTextInput(context_summary_note(summary_of(throughs[0], text=texts[0])))
        assert list(second.input[1:-1]) == [input_item(m) for m in stored if throughs[0] < m.sequence <= throughs[1]]
        assert second.input[-1] == UserTextInput(CONTEXT_SUMMARY_REQUEST_TEXT)


async def read_running_task(engine: InProcessEngine, sid: str, step_type: str) -> tuple[dict[str, Any], Any]:
    """The stored options and input of the flow's running task of `step_type`."""
    def read(db: Any) -> list[Any]:
        rows = db.all("SELECT options, input FROM tasks WHERE flow_id = ? AND step_type = ? "
                      "AND state = 'running'", (sid, step_type))
        return [(stored_options_json(db, bytes(options)), data) for options, data in rows]

    rows = await engine.client.store.raw(read)
    assert len(rows) == 1, rows
    return json.loads(rows[0][0]), json.loads(bytes(rows[0][1]))


def loaded_chunks(options: dict[str, Any]) -> tuple[list[str], set[str]]:
    load = options["execute"]["load"]
    keys = {key for name, key in load.get("instances", []) if name == AGENT_MESSAGE_CHUNKS.name}
    return list(load.get("names", [])), keys


async def test_each_step_loads_only_the_chunks_it_reads(tmp_path: Path) -> None:
    """With compaction, every movement into RunModel (a turn start, ResumeTurn after tool calls,
    CompactContext) lists only the AgentMessageChunks instances after the summary, and CompactContext
    only those it summarizes; both load the whole window. Read from the running task's stored options
    while the model and summary calls run; turns with tool calls compact mid-turn."""
    engine_box: list[InProcessEngine] = []
    checks: list[tuple[str, set[str], set[str], bool]] = []

    async def respond(request: ModelRequest) -> ScriptedModelReply:
        engine = engine_box[0]
        options, _ = await read_running_task(engine, "s", RUN_MODEL)
        names, keys = loaded_chunks(options)
        assert AGENT_MESSAGE_CHUNKS.name not in names and "AgentMessages" in names
        index = await engine.client.get_attribute("s", AGENT_MESSAGE_INDEX)
        summary = await engine.client.get_attribute("s", CONTEXT_SUMMARY)
        after = 0 if summary is None else summary.last_sequence
        expected = {message_sequence_key(r.first_sequence) for r in chunks_between(index, after=after)}
        skipped = index is not None and any(r.last_sequence <= after for r in index.chunks)
        checks.append((RUN_MODEL, keys, expected, skipped))
        return answer(request)

    async def summarize(request: ModelRequest) -> str:
        engine = engine_box[0]
        options, task_input = await read_running_task(engine, "s", COMPACT_CONTEXT)
        names, keys = loaded_chunks(options)
        assert AGENT_MESSAGE_CHUNKS.name not in names and "AgentMessages" in names
        index = await engine.client.get_attribute("s", AGENT_MESSAGE_INDEX)
        summary = await engine.client.get_attribute("s", CONTEXT_SUMMARY)
        after = 0 if summary is None else summary.last_sequence
        through = task_input["through_sequence"]
        expected = {message_sequence_key(r.first_sequence) for r in chunks_between(index, after=after,
                                                                                       through=through)}
        checks.append((COMPACT_CONTEXT, keys, expected, False))
        return ScriptedModelClient.default_summary(request)

    flow, model = compaction_flow("LoadingAgent", respond, window=700, summarize=summarize,
                                  message_window_size=4, message_chunk_size=2, retained_message_limit=None)
    engine = InProcessEngine(tmp_path, [flow])
    engine_box.append(engine)
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s")
        final = await run_turns(sessions, "s", [say(1), say(2), "/tools 14", say(3), say(4), "/tools 6"])
        assert final.state is not None and final.state.last_turn_error is None
        assert final.context_summary is not None and final.context_summary.generation >= 2
        for step_type, keys, expected, _ in checks:
            assert keys == expected, step_type
        assert any(skipped for *_, skipped in checks), "no RunModel left out a chunk before the summary"
        assert {step for step, *_ in checks} == {RUN_MODEL, COMPACT_CONTEXT}
        steps = executed_steps(to_step_history(await engine.client.get_flow_history("s")))
        # A compaction inside the /tools 14 turn: ResumeTurn -> RunModel -> CompactContext -> RunModel.
        assert any(steps[i - 2: i + 2] == ["ResumeTurn", RUN_MODEL, COMPACT_CONTEXT, RUN_MODEL]
                   for i in range(2, len(steps)) if steps[i] == COMPACT_CONTEXT)

        # No cut separated a call from its result, and the calls after each cut were answered in the
        # model input (the loop's pending results never repeat a summarized call's result).
        stored = await all_messages(sessions, "s")
        throughs = [json.loads(e.value.payload)["through_sequence"] for e in await all_agent_events(sessions, "s")
                    if e.value.type == "compaction_finished"]
        for through in throughs:
            calls = {(m.turn_id, m.tool_call_id) for m in stored
                     if m.sequence <= through and m.role is MessageRole.ASSISTANT and m.tool_call_id}
            results = {(m.turn_id, m.tool_call_id) for m in stored if m.role is MessageRole.TOOL}
            before = {(m.turn_id, m.tool_call_id) for m in stored if m.sequence <= through
                      and m.role is MessageRole.TOOL}
            assert calls & results == calls & before, f"cut {through} separates a call from its result"
        for request in model_calls(model):
            items = list(request.input)
            for position, item in enumerate(items):
                if isinstance(item, ModelOutputItem) and item.tool_call is not None:
                    result = items[position + 1]
                    assert isinstance(result, ToolResultInput)
                    assert result.tool_call_id == item.tool_call.tool_call_id
                    assert result.output != OUTCOME_UNKNOWN_TEXT
            results_seen = [i.tool_call_id for i in items if isinstance(i, ToolResultInput)]
            assert len(results_seen) == len(set(results_seen)), "a result repeated in the model input"


async def test_compacting_context_status_while_the_summary_call_runs(tmp_path: Path) -> None:
    """While CompactContext's summary call runs the status is compacting_context; it commits running_model
    and RunModel then answers the turn."""
    release = asyncio.Event()
    reached = asyncio.Event()

    async def summarize(request: ModelRequest) -> str:
        reached.set()
        await release.wait()
        return "held summary"

    flow, _ = compaction_flow("StatusAgent", answer, window=400, summarize=summarize)
    engine = InProcessEngine(tmp_path, [flow])
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s")
        number = 0
        while not reached.is_set():
            number += 1
            assert number < 20, "never compacted"
            assert await sessions.send_user_message("s", say(number))
            await wait_for_agent_snapshot(
                sessions, "s",
                lambda s, n=number: reached.is_set() or (s.state is not None and s.state.turn_count >= n),
                description=f"turn {number} or a compaction")
        snapshot = await sessions.get_agent_snapshot("s")
        assert snapshot.state is not None and snapshot.state.status is AgentStatus.COMPACTING_CONTEXT
        assert snapshot.context_summary is None
        release.set()
        done = await wait_for_agent_snapshot(
            sessions, "s", lambda s: s if s.state is not None and s.state.turn_count >= number else None,
            description="the compacted turn to end")
        assert done.state is not None and done.state.status is AgentStatus.WAITING_FOR_USER_MESSAGE
        assert done.context_summary is not None and done.context_summary.text == "held summary"


async def test_retention_deletes_summarized_chunks(tmp_path: Path) -> None:
    """With compaction and retained_message_limit=6 (window 4, chunks of 2): the oldest chunks go while
    they end at or before the summary and 6 messages stay after them; AgentMessageIndex.first_sequence
    follows, the index lists exactly the stored chunks, every message from first_sequence on is readable,
    paging ends there with deleted_before_sequence on every page, and the snapshot starts there too.
    retained_message_limit=None keeps everything."""
    flow, _ = compaction_flow("RetainingAgent", answer, window=500, message_window_size=4, message_chunk_size=2,
                              retained_message_limit=6)
    keeping, _ = compaction_flow("KeepingAgent", answer, window=500, message_window_size=4, message_chunk_size=2,
                                 retained_message_limit=None)
    engine = InProcessEngine(tmp_path, [flow, keeping])
    async with engine.running():
        sessions = engine.sessions(flow)
        await sessions.start_session("s")
        final = await run_turns(sessions, "s", [say(n) for n in range(1, 15)])
        assert final.state is not None
        newest = final.state.next_message_sequence - 1
        summary = final.context_summary
        assert summary is not None
        index = await engine.client.get_attribute("s", AGENT_MESSAGE_INDEX)
        chunks = await engine.client.get_attribute_map("s", AGENT_MESSAGE_CHUNKS)
        assert index is not None and index.first_sequence > 1
        assert sorted(chunks) == [message_sequence_key(r.first_sequence) for r in index.chunks]
        # Retention went as far as the rule allows: the oldest kept chunk may not go.
        oldest = index.chunks[0]
        assert oldest.last_sequence > summary.last_sequence or newest - oldest.last_sequence < 6
        assert index.first_sequence <= summary.last_sequence + 1 and newest - index.first_sequence + 1 >= 6
        first = index.first_sequence
        cursor: int | None = None
        pages: list[list[AgentMessage]] = []
        while True:
            page = await sessions.list_agent_messages("s", before_sequence=cursor, limit=3)
            assert page.deleted_before_sequence == first
            pages.append(page.messages)
            if page.next_before_sequence is None:
                break
            cursor = page.next_before_sequence
        stored = [m for p in reversed(pages) for m in p]
        assert [m.sequence for m in stored] == list(range(first, newest + 1))
        empty = await sessions.list_agent_messages("s", before_sequence=first, limit=10)
        assert (empty.messages, empty.next_before_sequence, empty.deleted_before_sequence) == ([], None, first)
        assert [m.sequence for m in final.messages] == list(range(first, newest + 1))

        kept = engine.sessions(keeping)
        await kept.start_session("k")
        done = await run_turns(kept, "k", [say(n) for n in range(1, 15)])
        assert done.context_summary is not None
        kept_index = await engine.client.get_attribute("k", AGENT_MESSAGE_INDEX)
        assert kept_index is not None and kept_index.first_sequence == 1
        page = await kept.list_agent_messages("k", before_sequence=None, limit=200)
        assert page.deleted_before_sequence is None and page.messages[0].sequence == 1


async def test_compact_context_applies_retention_in_its_own_commit(tmp_path: Path) -> None:
    """CompactContext deletes the chunks its new summary lets retention delete in the commit that
    stores the summary, not at the next Step that stores a message: during every model call
    (RunModel stores nothing before it), including each right after a compaction, retention has
    nothing left to delete. Turns with tool calls compact mid-turn, between two model calls."""
    engine_box: list[InProcessEngine] = []
    seen: list[tuple[int, int, list[AgentMessageChunkRange]]] = []  # (summary through, newest, deletable)

    async def respond(request: ModelRequest) -> ScriptedModelReply:
        client = engine_box[0].client
        index = await client.get_attribute("s", AGENT_MESSAGE_INDEX)
        summary = await client.get_attribute("s", CONTEXT_SUMMARY)
        state = await client.get_attribute("s", AGENT_STATE)
        assert state is not None
        newest = state.next_message_sequence - 1
        deletable = list(plan_retention(index, summary, 2, newest).deleted)
        seen.append((0 if summary is None else summary.last_sequence, newest, deletable))
        return answer(request)

    flow, _ = compaction_flow("RetainingAgent", respond, window=700, message_window_size=4, message_chunk_size=2,
                              retained_message_limit=2)
    engine = InProcessEngine(tmp_path, [flow])
    engine_box.append(engine)
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s")
        await run_turns(sessions, "s", [say(1), say(2), "/tools 14", say(3), say(4), "/tools 6"])
    assert all(deletable == [] for _, _, deletable in seen), seen
    # The model calls right after a compaction (RunModel stores its messages before it moves to
    # CompactContext, so only CompactContext's commit lies between): the summary moved.
    assert sum(1 for i in range(1, len(seen)) if seen[i][0] > seen[i - 1][0]) >= 2, seen


async def test_a_runner_without_compaction_warns_on_a_session_with_deleted_messages(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A session whose retention deleted messages, later run by a Worker whose runner has no compaction
    capability: each model call logs the warning, and the runner gets the stored messages from
    first_sequence on with no summary."""
    flow, _ = compaction_flow("UpgradedAgent", answer, window=500, message_window_size=4, message_chunk_size=2,
                              retained_message_limit=4)
    first_engine = InProcessEngine(tmp_path, [flow])
    async with first_engine.running():
        sessions = first_engine.sessions()
        await sessions.start_session("s")
        await run_turns(sessions, "s", [say(n) for n in range(1, 13)])
    index = None
    seen: list[AgentTurnContext] = []

    class Recording(PlainRunner):
        async def run_model_step(self, turn: AgentTurnContext) -> Any:
            seen.append(turn)
            return await super().run_model_step(turn)

    plain = AgentSessionFlow(Recording(flow.runner), "UpgradedAgent", replace(flow.options, compaction=None))
    second_engine = InProcessEngine(tmp_path, [plain])
    with caplog.at_level(logging.WARNING, logger="dex_agents.session"):
        async with second_engine.running():
            sessions = second_engine.sessions()
            index = await second_engine.client.get_attribute("s", AGENT_MESSAGE_INDEX)
            await run_turns(sessions, "s", [say(13)], start=12)
    assert index is not None and index.first_sequence > 1
    warnings = [r for r in caplog.records if "does not implement ContextCompactionRunner" in r.getMessage()]
    assert len(warnings) == 1 and f"before sequence {index.first_sequence}" in warnings[0].getMessage()
    assert len(seen) == 1 and seen[0].context_summary is None
    assert seen[0].messages[0].sequence == index.first_sequence


@pytest.mark.parametrize(("first_sequence", "warn", "warned"), [(2, True, True), (1, True, False), (2, False, False)])
def test_the_no_compaction_warning_needs_deleted_messages_and_a_model_call(
    caplog: pytest.LogCaptureFixture, first_sequence: int, warn: bool, warned: bool
) -> None:
    """The warning is for a model call (warn) whose input lacks deleted messages: from sequence 2 on, one
    message is gone; from 1 on, none is. The runner gets the stored messages either way."""
    flow, _ = compaction_flow("PlainAgent", answer, window=500)
    plain = AgentSessionFlow(PlainRunner(flow.runner), "PlainAgent", replace(flow.options, compaction=None))
    stored = [message(sequence) for sequence in (first_sequence, 3)]
    index = AgentMessageIndex(chunks=[], first_sequence=first_sequence, window_first_sequence=first_sequence)
    ctx = step_context(plain, RUN_MODEL, {
        (AGENT_MESSAGE_INDEX.name, ""): index,
        **{(AGENT_MESSAGES.name, message_sequence_key(m.sequence)): m for m in stored},
    })
    with caplog.at_level(logging.WARNING, logger="dex_agents.session"):
        assert model_view(ctx, runtime_of(plain), warn=warn) == (stored, None)
    warnings = [r.getMessage() for r in caplog.records if "ContextCompactionRunner" in r.getMessage()]
    assert warnings == ([f"flow s: PlainRunner does not implement ContextCompactionRunner, but retention deleted the "
                         f"messages before sequence {first_sequence}; the model input starts after them, with no "
                         f"summary"] if warned else [])


async def test_a_turn_failure_logs_no_warning_meant_for_a_model_call(caplog: pytest.LogCaptureFixture) -> None:
    """The warning that a runner without compaction gets no deleted messages is for a model call's
    input: RecordTurnFailure, which builds the turn's context only for the runner's unfinished-turn
    messages, logs none (as RunModel ending a turn before its call, which shares that path)."""
    from dex_agents._turn_steps import TurnSteps

    flow, _ = compaction_flow("PlainAgent", answer, window=500)
    plain = AgentSessionFlow(PlainRunner(flow.runner), "PlainAgent", replace(flow.options, compaction=None))
    index = AgentMessageIndex(chunks=[], first_sequence=2, window_first_sequence=2)
    ctx = step_context(plain, "RecordTurnFailure", {
        ("AgentState", ""): running_turn(next_message_sequence=4), (AGENT_MESSAGE_INDEX.name, ""): index,
        **{(AGENT_MESSAGES.name, message_sequence_key(sequence)): message(sequence) for sequence in (2, 3)},
    })
    with caplog.at_level(logging.WARNING, logger="dex_agents.session"):
        await TurnSteps(runtime_of(plain)).record_turn_failure(ctx, None)
    state = ctx.get(AGENT_STATE)
    assert state is not None and (state.active_turn_id, state.last_turn_error) == (None, "the model call failed")
    assert [r.getMessage() for r in caplog.records if "ContextCompactionRunner" in r.getMessage()] == []


class BrokenEstimate(BuiltinLoopAgentRunner):
    def estimate_input_tokens(self, turn: AgentTurnContext) -> int:
        return "a lot"  # type: ignore[return-value]


class NoReprEstimate(BuiltinLoopAgentRunner):
    def estimate_input_tokens(self, turn: AgentTurnContext) -> int:
        return Unshowable()  # type: ignore[return-value]


class TrueEstimate(BuiltinLoopAgentRunner):
    def estimate_input_tokens(self, turn: AgentTurnContext) -> int:
        return True  # a bool is an int to Python, but no token count


class CutoffPastTheEnd(BuiltinLoopAgentRunner):
    def estimate_input_tokens(self, turn: AgentTurnContext) -> int:
        return 10**6

    def select_compaction_cutoff(self, turn: AgentTurnContext, retained_token_budget: int) -> int | None:
        return turn.messages[-1].sequence + 1


class FractionalCutoff(CutoffPastTheEnd):
    def select_compaction_cutoff(self, turn: AgentTurnContext, retained_token_budget: int) -> int | None:
        return float(turn.messages[-1].sequence)  # type: ignore[return-value]


class CutoffAtTheSummary(BuiltinLoopAgentRunner):
    """Always over the trigger; asks to summarize through the newest message once, then only through
    what the summary already covers."""

    def estimate_input_tokens(self, turn: AgentTurnContext) -> int:
        return 10**6

    def select_compaction_cutoff(self, turn: AgentTurnContext, retained_token_budget: int) -> int | None:
        summary = turn.context_summary
        return turn.messages[-1].sequence if summary is None else summary.last_sequence


class AwaitedCompactionAnswers(PlainRunner):
    """The wrapped runner's compaction answers, from coroutines: RunModel awaits an awaitable answer,
    as the TypeScript core awaits a Promise, instead of failing the turn on it."""

    async def estimate_input_tokens(self, turn: AgentTurnContext) -> int:
        return self.inner.estimate_input_tokens(turn)

    async def select_compaction_cutoff(self, turn: AgentTurnContext, retained_token_budget: int) -> int | None:
        return self.inner.select_compaction_cutoff(turn, retained_token_budget)

    async def summarize_context(self, request: ContextSummaryRequest) -> ContextSummaryResult:
        return await self.inner.summarize_context(request)


@pytest.mark.parametrize("awaited", [False, True])
async def test_a_cutoff_the_summary_already_covers_calls_the_model(tmp_path: Path, awaited: bool) -> None:
    """Seed 002: only a cutoff after the current ContextSummary moves RunModel to CompactContext, so
    the pair cannot loop. A cutoff equal to the summary's last sequence makes the model call, though
    the estimate stays over the trigger: one summary a turn at most, here one in all. The same when
    estimate_input_tokens and select_compaction_cutoff answer with awaitables."""
    # The first model call sees only the summary (it covers the one message): any answer will do.
    flow, model = compaction_flow("SummaryCutoffAgent", lambda _request: ScriptedModelReply(text="ok"), window=500,
                                  runner=CutoffAtTheSummary)
    if awaited:
        flow = AgentSessionFlow(AwaitedCompactionAnswers(flow.runner), "SummaryCutoffAgent", flow.options)
    done, history = await run_one_session(tmp_path, flow, ["hello", "again"])
    assert done.state is not None and done.state.last_turn_error is None
    assert done.context_summary is not None and done.context_summary.last_sequence == 1
    assert (len(summary_calls(model)), len(model_calls(model))) == (1, 2)
    # With no message after the summary, the model input is the summary note alone, never empty.
    assert model_calls(model)[0].input == (UserTextInput(context_summary_note(done.context_summary)),)
    assert executed_steps(history) == ["StartAgentSession", "AwaitUserMessage", RUN_MODEL, COMPACT_CONTEXT,
                                       RUN_MODEL, "AwaitUserMessage", RUN_MODEL]


class CutoffZero(BuiltinLoopAgentRunner):
    """Always over the trigger, with nothing to summarize: the cutoff is 0."""

    def estimate_input_tokens(self, turn: AgentTurnContext) -> int:
        return 10**6

    def select_compaction_cutoff(self, turn: AgentTurnContext, retained_token_budget: int) -> int | None:
        return 0


class NoCutoff(CutoffZero):
    """Always over the trigger, and declines to choose a cutoff."""

    def select_compaction_cutoff(self, turn: AgentTurnContext, retained_token_budget: int) -> int | None:
        return None


@pytest.mark.parametrize("runner", [CutoffZero, NoCutoff])
async def test_a_cutoff_of_zero_or_none_without_a_summary_calls_the_model(
    tmp_path: Path, runner: type[BuiltinLoopAgentRunner]
) -> None:
    """Before any summary, nothing is summarized through sequence 0, and None declines to compact:
    either way RunModel makes the model call, with no CompactContext, no summary call and no error."""
    flow, model = compaction_flow("ZeroCutoffAgent", answer, window=500, runner=runner)
    done, history = await run_one_session(tmp_path, flow, ["hello"])
    assert done.state is not None and done.state.last_turn_error is None
    assert done.context_summary is None
    assert (len(summary_calls(model)), len(model_calls(model))) == (0, 1)
    assert executed_steps(history) == ["StartAgentSession", "AwaitUserMessage", RUN_MODEL]


@pytest.mark.parametrize(("runner", "error"), [
    (BrokenEstimate, "estimate_input_tokens returned 'a lot'; return a whole number"),
    (TrueEstimate, "estimate_input_tokens returned True; return a whole number"),
    (NoReprEstimate, f"estimate_input_tokens returned {UNSHOWABLE_SHOWN}; return a whole number"),
    (CutoffPastTheEnd, "select_compaction_cutoff returned 2, after the newest stored message 1"),
    (FractionalCutoff, "select_compaction_cutoff returned 1.0; return a whole number"),
])
async def test_a_compaction_contract_breach_fails_the_turn(
    tmp_path: Path, runner: type[BuiltinLoopAgentRunner], error: str
) -> None:
    """A runner that answers the compaction questions wrongly fails the turn in RunModel's commit, with
    no model call and no retry; the session goes on."""
    flow, model = compaction_flow("BrokenAgent", answer, window=500, runner=runner)
    done, history = await run_one_session(tmp_path, flow, ["hello"])
    assert done.state is not None and done.state.last_turn_error == error
    assert model_calls(model) == []
    assert executed_steps(history) == ["StartAgentSession", "AwaitUserMessage", RUN_MODEL]
    assert [e.final_attempt for e in history if e.step_type == RUN_MODEL and e.event_type == "execute_completed"
            ] == [1]


class CutoffPastTheEndWithAPartialAnswer(CutoffPastTheEnd):
    """CutoffPastTheEnd whose unfinished turn has an item the runner gives when the turn fails."""

    def build_unfinished_turn_messages(self, turn: AgentTurnContext) -> Sequence[FrameworkMessage]:
        from dex_agents.builtin_loop._items import output_message
        text = "partial answer"
        return [output_message(ModelOutputItem("scripted", OutputItemKind.TEXT, json.dumps({"text": text}), text))]


async def test_a_compaction_contract_breach_stores_the_runners_unfinished_items(tmp_path: Path) -> None:
    """The turn a compaction contract breach fails ends as RecordTurnFailure ends one: the runner's
    unfinished items are stored before the failure note. Catches: the breach failing the turn
    without them, so the next turn's model input lacked what the runner had to give."""
    flow, _model = compaction_flow("BrokenAgent", answer, window=500, runner=CutoffPastTheEndWithAPartialAnswer)
    engine = InProcessEngine(tmp_path, [flow])
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s")
        done = await run_turns(sessions, "s", ["hello"])
        stored = await all_messages(sessions, "s")
    assert done.state is not None and done.state.last_turn_error is not None
    assert [(m.role, m.text) for m in stored[:2]] == [(MessageRole.USER, "hello"),
                                                      (MessageRole.ASSISTANT, "partial answer")]


class KeepsItsTurn(CutoffAtTheSummary):
    """CutoffAtTheSummary that keeps each turn context its compaction questions were given."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.turns: list[AgentTurnContext] = []

    def estimate_input_tokens(self, turn: AgentTurnContext) -> int:
        self.turns.append(turn)
        return super().estimate_input_tokens(turn)


async def test_run_model_moving_to_compact_context_closes_the_writer_its_runner_was_given() -> None:
    """RunModel that moves to CompactContext closes the turn's event writer, as after a model call:
    a write through it once RunModel returned is dropped (seed 003: "writes after the call returns
    are dropped"), not appended to the AgentEvents of an attempt that made no model call."""
    from dex_agents._turn_steps import TurnSteps

    flow, _ = compaction_flow("KeepsItsTurnAgent", answer, window=500, runner=KeepsItsTurn)
    written: list[bytes] = []
    ctx = step_context(flow, RUN_MODEL, {
        ("AgentState", ""): running_turn(), (AGENT_MESSAGES.name, message_sequence_key(1)): message(1),
    }, write_event=lambda _name, data: written.append(data))
    decision = await TurnSteps(runtime_of(flow)).run_model(ctx, None)
    assert [m.step_type for m in decision.movements] == [COMPACT_CONTEXT]
    runner = flow.runner
    assert isinstance(runner, KeepsItsTurn)
    [turn] = runner.turns
    turn.events.write_text_delta("late")
    assert turn.events.closed and written == []


class SummaryOfText(CutoffAtTheSummary):
    async def summarize_context(self, request: ContextSummaryRequest) -> ContextSummaryResult:
        return "the summary"  # type: ignore[return-value]


class SummaryWithDictUsage(CutoffAtTheSummary):
    async def summarize_context(self, request: ContextSummaryRequest) -> ContextSummaryResult:
        return ContextSummaryResult("the summary", usage={"input_tokens": 1})  # type: ignore[arg-type]


class SummaryOfContentBlocks(CutoffAtTheSummary):
    """A provider's content blocks passed on as the text: it is not blank, so it was retried as blank
    summaries are, paying for every attempt's summary call, and the turn failed saying it was blank."""

    async def summarize_context(self, request: ContextSummaryRequest) -> ContextSummaryResult:
        return ContextSummaryResult([{"type": "text", "text": "the summary"}])  # type: ignore[arg-type]


@pytest.mark.parametrize(("runner", "error"), [
    (SummaryOfText, "summarize_context returned a str; return a ContextSummaryResult"),
    (SummaryWithDictUsage, "ContextSummaryResult.usage must be an AgentUsage, got dict"),
    (SummaryOfContentBlocks, "ContextSummaryResult.text must be a str, got list; return the summary's text"),
])
async def test_a_summary_result_that_breaks_the_contract_fails_the_turn_without_retry(
    tmp_path: Path, runner: type[BuiltinLoopAgentRunner], error: str
) -> None:
    """A retry would get the same wrong type: CompactContext's one attempt fails the turn with the error,
    and no summary is stored."""
    flow, model = compaction_flow("BadSummaryAgent", answer, window=500, runner=runner)
    done, history = await run_one_session(tmp_path, flow, ["hello"])
    assert done.state is not None and done.state.last_turn_error == error
    assert done.context_summary is None and model_calls(model) == []
    assert executed_steps(history) == ["StartAgentSession", "AwaitUserMessage", RUN_MODEL, "RecordTurnFailure"]
    assert [(e.event_type, e.final_attempt) for e in history if e.step_type == COMPACT_CONTEXT] == [
        ("step_scheduled", 0), ("attempt_failed", 1), ("step_failed", 1)]


SUMMARY_USAGE = AgentUsage(model_calls=1, input_tokens=900, output_tokens=300)


class SummaryTooLarge(CutoffAtTheSummary):
    async def summarize_context(self, request: ContextSummaryRequest) -> ContextSummaryResult:
        return ContextSummaryResult("x" * MAX_VALUE_BYTES, usage=SUMMARY_USAGE)


async def test_a_summary_too_large_to_store_fails_the_turn_and_counts_its_call(
    tmp_path: Path, db_url: str  # noqa: F811 - the fixture
) -> None:
    """A summary over the value limit fails CompactContext's one attempt, and its commit with the
    summary call's usage: RecordTurnFailure fails the turn and records that usage, once. Catches: a
    summary call the user paid for missing from AgentUsage."""
    flow, model = compaction_flow("HugeSummaryAgent", answer, window=500, runner=SummaryTooLarge)
    engine = InProcessEngine(tmp_path, [flow], db_url)
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s")
        done = await run_turns(sessions, "s", ["hello"])
        events = await all_agent_events(sessions, "s")
        history = to_step_history(await engine.client.get_flow_history("s"))
    error = done.state.last_turn_error if done.state is not None else None
    assert error is not None and error.startswith("the context summary through 1 is too large to store: "), error
    assert done.context_summary is None and model_calls(model) == []
    assert done.usage == SUMMARY_USAGE
    recorded = [json.loads(e.value.payload)["recorded"] for e in events if e.value.type == "usage_recorded"]
    assert recorded == [msgspec.to_builtins(SUMMARY_USAGE)]
    assert executed_steps(history) == ["StartAgentSession", "AwaitUserMessage", RUN_MODEL, "RecordTurnFailure"]


COMPACTING = running_turn(status=AgentStatus.COMPACTING_CONTEXT, next_message_sequence=4)


@pytest.mark.parametrize(("state", "through", "compaction", "moves_to"), [
    (None, 3, True, None),
    (running_turn(active_turn_id=None, next_message_sequence=4), 3, True, None),
    (COMPACTING, 2, True, RUN_MODEL),
    (COMPACTING, 3, False, RUN_MODEL),
])
async def test_compact_context_with_nothing_to_do_makes_no_summary_call(
    state: AgentState | None, through: int, compaction: bool, moves_to: str | None
) -> None:
    """A turn that already ended (cancelled, say) ends the branch; a summary that already covers the
    range, or a Worker whose options have no compaction (the Step was scheduled by one that had),
    goes back to RunModel with status running_model. None calls the model or writes a summary."""
    flow, model = compaction_flow("IdleCompactionAgent", answer, window=500)
    if not compaction:
        flow = AgentSessionFlow(flow.runner, "IdleCompactionAgent", replace(flow.options, compaction=None))
    values: dict[tuple[str, str], Any] = {
        (AGENT_MESSAGE_INDEX.name, ""): AgentMessageIndex(chunks=[], first_sequence=1, window_first_sequence=1),
        (CONTEXT_SUMMARY.name, ""): summary_of(2),
    }
    if state is not None:
        values[(AGENT_STATE.name, "")] = state
    ctx = step_context(flow, COMPACT_CONTEXT, values)
    decision = await CompactionSteps(runtime_of(flow)).compact_context(ctx, CompactContextInput(through))
    assert [m.step_type for m in decision.movements] == ([] if moves_to is None else [moves_to])
    assert list(model.requests) == [] and ctx.get(CONTEXT_SUMMARY) == summary_of(2)
    written = ctx.get(AGENT_STATE)
    assert written == (state if moves_to is None else msgspec.structs.replace(state, status=AgentStatus.RUNNING_MODEL))


class HeartbeatingSummary(BuiltinLoopAgentRunner):
    async def summarize_context(self, request: ContextSummaryRequest) -> ContextSummaryResult:
        await request.heartbeat()
        return await super().summarize_context(request)


def compacting_turn_2(flow: AgentSessionFlow, heartbeat: HeartbeatFn | None = None) -> Context:
    """CompactContext's context in turn 2, with messages 1-3 in the window and no summary yet."""
    stored = [message(1), message(2, MessageRole.ASSISTANT), message(3, turn=2)]
    state = running_turn(status=AgentStatus.COMPACTING_CONTEXT, active_turn_id="turn-2", next_message_sequence=4)
    return step_context(flow, COMPACT_CONTEXT, {
        (AGENT_STATE.name, ""): state,
        (AGENT_MESSAGE_INDEX.name, ""): AgentMessageIndex(chunks=[], first_sequence=1, window_first_sequence=1),
        **{(AGENT_MESSAGES.name, message_sequence_key(m.sequence)): m for m in stored},
    }, heartbeat=heartbeat)


async def test_compact_context_sets_status_running_model_in_the_summary_commit() -> None:
    """The commit that stores the summary also ends compacting_context: a snapshot taken before RunModel
    commits shows running_model, not a summary call still running. The request's heartbeat is the
    attempt's."""
    flow, model = compaction_flow("SummarizingAgent", answer, window=500, runner=HeartbeatingSummary)
    beats: list[str | None] = []

    async def heartbeat(checkpoint: str | None) -> None:
        beats.append(checkpoint)

    ctx = compacting_turn_2(flow, heartbeat)
    decision = await CompactionSteps(runtime_of(flow)).compact_context(ctx, CompactContextInput(2))
    assert [m.step_type for m in decision.movements] == [RUN_MODEL] and len(summary_calls(model)) == 1
    assert beats == [None]
    summary = ctx.get(CONTEXT_SUMMARY)
    assert summary is not None and (summary.generation, summary.last_sequence) == (1, 2)
    written = ctx.get(AGENT_STATE)
    assert written is not None and written.status is AgentStatus.RUNNING_MODEL


class KeptSummaryRequest(BuiltinLoopAgentRunner):
    """Keeps the summary request it is given, then answers (or raises, when `fails` is set)."""

    fails = False

    async def summarize_context(self, request: ContextSummaryRequest) -> ContextSummaryResult:
        self.kept = request
        if self.fails:
            raise RuntimeError("the summary call failed")
        return await super().summarize_context(request)


@pytest.mark.parametrize("fails", [False, True], ids=["answers", "raises"])
async def test_a_summary_calls_event_writer_is_closed_when_the_call_returns(fails: bool) -> None:
    """Whether summarize_context answers or raises, its request's writer is closed once the call is
    over, so the runner's later writes through it are dropped (seed 003: "writes after the call
    returns are dropped"). Catches a summary call whose writer is left open."""
    flow, _ = compaction_flow("KeptSummaryAgent", answer, window=500, runner=KeptSummaryRequest)
    runner = flow.runner
    assert isinstance(runner, KeptSummaryRequest)
    runner.fails = fails
    call = CompactionSteps(runtime_of(flow)).compact_context(compacting_turn_2(flow), CompactContextInput(2))
    if fails:
        with pytest.raises(RuntimeError, match="the summary call failed"):
            await call
    else:
        await call
    assert runner.kept.events.closed


class SummaryWithoutText(BuiltinLoopAgentRunner):
    async def summarize_context(self, request: ContextSummaryRequest) -> ContextSummaryResult:
        return ContextSummaryResult(None)  # type: ignore[arg-type]


async def test_a_summary_without_text_is_a_blank_summary() -> None:
    """A summary without text (None) fails the attempt as a blank one does (and is retried), with the
    blank-summary error rather than an AttributeError, and writes nothing. Any other text that is not a
    string fails the turn at once (test_a_summary_result_that_breaks_the_contract_fails_the_turn_without_retry)."""
    flow, _ = compaction_flow("TextlessSummaryAgent", answer, window=500, runner=SummaryWithoutText)
    ctx = compacting_turn_2(flow)
    with pytest.raises(BlankContextSummaryError) as info:
        await CompactionSteps(runtime_of(flow)).compact_context(ctx, CompactContextInput(2))
    assert str(info.value) == "summarize_context returned a blank summary through 2"
    assert ctx.get(CONTEXT_SUMMARY) is None


@pytest.mark.parametrize(("retained_message_limit", "first_kept"), [(4, 3), (5, 1)])
async def test_compact_context_retains_exactly_the_limit_after_the_newest_stored_message(
    retained_message_limit: int, first_kept: int
) -> None:
    """Six messages stored (chunks 1-2 and 3-4, the window 5-6), summarized through 4: chunk 1-2 has four
    messages after it, so it goes at a limit of 4 and stays at 5. The count runs to the newest stored
    message, next_message_sequence - 1."""
    flow, _ = compaction_flow("RetainingAgent", answer, window=500, message_window_size=4, message_chunk_size=2,
                              retained_message_limit=retained_message_limit)
    stored = [message(1), message(2, MessageRole.ASSISTANT), message(3, turn=2), message(4, MessageRole.ASSISTANT,
              turn=2), message(5, turn=3), message(6, MessageRole.ASSISTANT, turn=3)]
    index = AgentMessageIndex(chunks=[AgentMessageChunkRange(1, 2), AgentMessageChunkRange(3, 4)], first_sequence=1,
                              window_first_sequence=5)
    ctx = step_context(flow, COMPACT_CONTEXT, {
        (AGENT_STATE.name, ""): running_turn(status=AgentStatus.COMPACTING_CONTEXT, active_turn_id="turn-3",
                                             next_message_sequence=7),
        (AGENT_MESSAGE_INDEX.name, ""): index,
        (AGENT_MESSAGE_CHUNKS.name, message_sequence_key(1)): AgentMessageChunk(tuple(stored[:2])),
        (AGENT_MESSAGE_CHUNKS.name, message_sequence_key(3)): AgentMessageChunk(tuple(stored[2:4])),
        **{(AGENT_MESSAGES.name, message_sequence_key(m.sequence)): m for m in stored[4:]},
    })
    await CompactionSteps(runtime_of(flow)).compact_context(ctx, CompactContextInput(4))
    kept = ctx.get(AGENT_MESSAGE_INDEX)
    assert kept is not None and kept.first_sequence == first_kept
    assert (ctx.get(AGENT_MESSAGE_CHUNKS[message_sequence_key(1)]) is None) == (first_kept == 3)


@pytest.mark.parametrize(("window", "limit", "compacts", "kept"), [
    # Five messages stored (chunks 1-2 and 3-4, the window 5), summarized through 4; message 6 fits the
    # window, so the append leaves the index alone, but brings chunk 1-2 to four messages after it.
    (4, 4, True, [AgentMessageChunkRange(3, 4)]),  # at the limit: deleted now, not at a later rollover
    (4, 5, True, [AgentMessageChunkRange(1, 2), AgentMessageChunkRange(3, 4)]),  # one short: kept
    # A summary left by an earlier deployment with compaction: without it, every chunk is model input.
    (4, 4, False, [AgentMessageChunkRange(1, 2), AgentMessageChunkRange(3, 4)]),
    # Window 3: message 6 rolls 3-4 over into a chunk, then retention runs on that new index.
    (3, 4, True, [AgentMessageChunkRange(3, 4)]),
])
def test_an_append_deletes_the_summarized_chunks_it_brings_past_the_retained_limit(
    window: int, limit: int, compacts: bool, kept: list[AgentMessageChunkRange]
) -> None:
    """Retention runs at every append, on the index the append leaves, counting to the newest message."""
    options: dict[str, Any] = {} if compacts else {"compaction": None}
    flow, _ = compaction_flow("AppendRetainingAgent", answer, window=500, message_window_size=window,
                              message_chunk_size=2, retained_message_limit=limit, **options)
    stored = [message(1), message(2, MessageRole.ASSISTANT), message(3, turn=2),
              message(4, MessageRole.ASSISTANT, turn=2), message(5, turn=3)]
    window_first = 5 if window == 4 else 3
    index = AgentMessageIndex(chunks=[AgentMessageChunkRange(1, 2)] + (
        [AgentMessageChunkRange(3, 4)] if window == 4 else []), first_sequence=1, window_first_sequence=window_first)
    values: dict[tuple[str, str], Any] = {
        (AGENT_MESSAGE_INDEX.name, ""): index, (CONTEXT_SUMMARY.name, ""): summary_of(4),
        (AGENT_MESSAGE_CHUNKS.name, message_sequence_key(1)): AgentMessageChunk(tuple(stored[:2])),
    }
    if window == 4:
        values[(AGENT_MESSAGE_CHUNKS.name, message_sequence_key(3))] = AgentMessageChunk(tuple(stored[2:4]))
    for m in stored[window_first - 1:]:
        values[(AGENT_MESSAGES.name, message_sequence_key(m.sequence))] = m
    ctx = step_context(flow, "RunModel", values)
    state = running_turn(active_turn_id="turn-3", next_message_sequence=6)
    reply = FrameworkMessage(MessageRole.ASSISTANT, "{}", text="hello")
    assert runtime_of(flow).append_messages(ctx, state, "turn-3", [reply]).next_message_sequence == 7
    after = ctx.get(AGENT_MESSAGE_INDEX)
    assert after is not None and (after.chunks, after.first_sequence) == (kept, kept[0].first_sequence)
    assert after.window_first_sequence == 5
    assert (ctx.get(AGENT_MESSAGE_CHUNKS[message_sequence_key(1)]) is None) == (len(kept) == 1)
    assert ctx.get(AGENT_MESSAGE_CHUNKS[message_sequence_key(3)]) == AgentMessageChunk(tuple(stored[2:4]))


async def _turns_until_summarized(sessions: AgentSessionClient, calls: list[int]) -> int:
    """Turns of session "s", one at a time, until the summarize function was called; how many."""
    number = 0
    while not calls:
        number += 1
        assert number < 20, "never compacted"
        await run_turns(sessions, "s", [say(number)], start=number - 1)
    return number


async def test_the_summary_call_gets_the_turns_session_settings(tmp_path: Path) -> None:
    """ContextSummaryRequest.session_settings are the settings the turn started with, as its model calls
    get them, so the built-in loop's summary call goes to the model and account the session chose.
    Catches: the summary request built with no settings."""
    summarized: list[dict[str, Any]] = []

    def summarize(request: ModelRequest) -> str:
        summarized.append(dict(request.session_settings))
        return "the summary"

    flow, model = compaction_flow("SettingsAgent", answer, window=400, summarize=summarize)
    engine = InProcessEngine(tmp_path, [flow])
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s", session_settings={"model": "large"})
        await _turns_until_summarized(sessions, summarized)
    assert summarized[0] == {"model": "large"}
    assert all(dict(r.session_settings) == {"model": "large"} for r in model_calls(model))


class SummaryAttempts(BuiltinLoopAgentRunner):
    """Records each summary request's attempt."""

    attempts: list[int] = []

    async def summarize_context(self, request: ContextSummaryRequest) -> ContextSummaryResult:
        SummaryAttempts.attempts.append(request.attempt)
        return await super().summarize_context(request)


@pytest.mark.parametrize("blank_attempts", [1, 99])
async def test_a_blank_summary_fails_the_attempt(tmp_path: Path, blank_attempts: int) -> None:
    """A blank summary fails the CompactContext attempt: a retry that writes one carries on; blank on
    every attempt ends in RecordTurnFailure with the error, after RunModel's attempts, and no summary.
    Each ContextSummaryRequest carries its CompactContext attempt, as AgentTurnContext carries RunModel's,
    so an adapter can tell a retry (catches: always 1)."""
    calls: list[int] = []
    SummaryAttempts.attempts = []

    def summarize(request: ModelRequest) -> str:
        calls.append(1)
        return "  " if len(calls) <= blank_attempts else "the summary"

    flow, _ = compaction_flow("BlankAgent", answer, window=400, summarize=summarize, runner=SummaryAttempts,
                              run_model_limit=RunModelLimit(max_attempts=2))
    engine = InProcessEngine(tmp_path, [flow])
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s")
        await _turns_until_summarized(sessions, calls)
        snapshot = await sessions.get_agent_snapshot("s")
        history = to_step_history(await engine.client.get_flow_history("s"))
        compact = [e for e in history if e.step_type == COMPACT_CONTEXT]
        assert snapshot.state is not None
        if blank_attempts == 1:
            assert snapshot.state.last_turn_error is None
            assert snapshot.context_summary is not None and snapshot.context_summary.text == "the summary"
            assert [e.final_attempt for e in compact if e.event_type == "execute_completed"] == [2]
            assert SummaryAttempts.attempts == [1, 2]
        else:
            assert len(calls) == 2
            assert snapshot.state.last_turn_error is not None and "blank summary" in snapshot.state.last_turn_error
            assert snapshot.context_summary is None
            assert executed_steps(history)[-2:] == [RUN_MODEL, "RecordTurnFailure"]
            assert not any(e.event_type == "execute_completed" for e in compact)


async def test_context_window_scenario_on_the_builtin_loop(tmp_path: Path) -> None:
    """dex_agents.testing.ContextWindowSessionScenario passes for the built-in loop: several compactions,
    bounded retention, paging to the oldest stored message, and a next input under the window.
    Catches: the scenario stopping a turn short of `turns`."""
    flow, _ = compaction_flow("ScenarioAgent", answer, window=600, message_window_size=4, message_chunk_size=2,
                              retained_message_limit=8)
    engine = InProcessEngine(tmp_path, [flow])
    async with engine.running():
        scenario = ContextWindowSessionScenario(engine.sessions(), turns=18)
        report = await scenario.run()
    assert report.summary.generation >= 2 and report.deleted_before_sequence is not None
    assert report.next_input_tokens < 600
    # Every turn asked for ran, each seen ended.
    assert [s.state.turn_count if s.state else None for s in scenario.snapshots] == list(range(1, 19))


async def test_context_window_scenario_says_when_the_event_stream_dropped_events(tmp_path: Path) -> None:
    """A Flow whose AgentEvents Stream keeps too few bytes for the scenario's turns: the scenario
    names the capacity. Catches: the trimmed read taken as the whole stream, which failed with a
    misleading list of compaction generations."""
    flow, _ = compaction_flow("SmallEvents", answer, window=600, message_window_size=4, message_chunk_size=2,
                              retained_message_limit=8, agent_events_capacity_bytes=4000)
    engine = InProcessEngine(tmp_path, [flow])
    async with engine.running():
        with pytest.raises(AssertionError, match=r"dropped its oldest events \(over its capacity, 4000 bytes\)"):
            await ContextWindowSessionScenario(engine.sessions(), turns=18).run()


async def test_context_window_scenario_names_too_few_compactions(tmp_path: Path) -> None:
    """min_compactions more than the turns compacted: the scenario fails with both counts. Catches:
    a session that compacted fewer times than the test asked passing."""
    flow, _ = compaction_flow("FewAgent", answer, window=600, message_window_size=4, message_chunk_size=2,
                              retained_message_limit=8)
    engine = InProcessEngine(tmp_path, [flow])
    async with engine.running():
        with pytest.raises(AssertionError) as caught:
            await ContextWindowSessionScenario(engine.sessions(), turns=18, min_compactions=100).run()
    assert re.fullmatch(r"[1-9]\d* compactions in 18 turns; expected at least 100", str(caught.value)), caught.value


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        pytest.param({"turns": 0}, "turns must be a whole number >= 1, got 0", id="no-turns"),
        pytest.param({"turns": 2.5}, "turns must be a whole number >= 1, got 2.5", id="fractional-turns"),
        pytest.param({"min_compactions": 0}, "min_compactions must be a whole number >= 1, got 0",
                     id="no-compactions"),
        pytest.param({"message": "hello"}, "message must be a function of the turn number returning its text, "
                     "got 'hello'", id="message-text"),
        pytest.param({"turn_timeout": math.nan}, "turn_timeout must be a number of seconds above 0 (math.inf "
                     "waits for ever), got nan", id="nan-timeout"),
        pytest.param({"sessions": None}, "sessions must be the adapter's AgentSessionClient, got None",
                     id="no-sessions"),
    ],
)
async def test_context_window_scenario_refuses_what_it_cannot_run_before_starting_a_session(
    tmp_path: Path, kwargs: dict[str, Any], named: str
) -> None:
    """Catches: turns=0 starting the session and then failing with a bare IndexError (list index out
    of range), a message given as text failing with a TypeError after the session started."""
    flow, _ = compaction_flow("RefusedScenario", answer, window=600)
    engine = InProcessEngine(tmp_path, [flow])
    with pytest.raises(ValueError) as caught:
        ContextWindowSessionScenario(**{"sessions": engine.sessions(), **kwargs})
    assert str(caught.value) == f"invalid ContextWindowSessionScenario: {named}"
    assert not await engine.client.exists("context-window-session")
    await engine.client.close()


class FailsTurnTwo(BuiltinLoopAgentRunner):
    async def run_model_step(self, turn: AgentTurnContext) -> AgentTurnOutcome:
        if turn.turn_id == "turn-2":
            return TurnCompleted(new_messages=[], turn_error="the model refused")
        return await super().run_model_step(turn)


async def test_context_window_scenario_stops_at_a_failed_turn(tmp_path: Path) -> None:
    """A turn that failed ends the scenario there, naming the turn and its error. Catches: the
    scenario going on past it, to fail later on what the failed turn left out (no compaction)."""
    flow, _ = compaction_flow("FailingAgent", answer, window=600, runner=FailsTurnTwo)
    engine = InProcessEngine(tmp_path, [flow])
    async with engine.running():
        with pytest.raises(AssertionError, match=r"^turn 2 failed: .*the model refused"):
            await ContextWindowSessionScenario(engine.sessions(), turns=4).run()


class NeverCompacts(BuiltinLoopAgentRunner):
    def estimate_input_tokens(self, turn: AgentTurnContext) -> int:
        return 0


async def test_context_window_scenario_catches_a_runner_that_never_compacts(tmp_path: Path) -> None:
    """The scenario fails for a runner whose estimate never reaches the trigger, saying so with the
    numbers."""
    flow, _ = compaction_flow("NeverAgent", answer, window=600, runner=NeverCompacts)
    engine = InProcessEngine(tmp_path, [flow])
    async with engine.running():
        with pytest.raises(AssertionError) as caught:
            await ContextWindowSessionScenario(engine.sessions(), turns=6).run()
    assert str(caught.value) == (
        "no compaction in 6 turns: the window was never reached (the next model input is 0 tokens, under the "
        "trigger of 510); send longer messages or more turns, or give the Flow a smaller context_window_tokens")


class NeverCuts(BuiltinLoopAgentRunner):
    def select_compaction_cutoff(self, turn: AgentTurnContext, retained_token_budget: int) -> int | None:
        return None


async def test_context_window_scenario_names_a_cutoff_that_never_summarizes(tmp_path: Path) -> None:
    """A runner whose input passes the trigger but whose select_compaction_cutoff names nothing: the
    scenario says so. Catches: 'the window was never reached', which sent the adapter's author to
    the estimate and the window, both of which worked."""
    flow, _ = compaction_flow("NeverCutAgent", answer, window=600, runner=NeverCuts)
    engine = InProcessEngine(tmp_path, [flow])
    async with engine.running():
        with pytest.raises(AssertionError) as caught:
            await ContextWindowSessionScenario(engine.sessions(), turns=6).run()
    assert re.fullmatch(
        r"no compaction in 6 turns, though the next model input is \d+ tokens \(estimate_input_tokens plus "
        r"reserved_input_tokens\), over the trigger of 510: select_compaction_cutoff named no message to summarize "
        r"\(None, or one at or before the summary\)", str(caught.value)), caught.value


# A Worker killed during CompactContext ------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
async def test_worker_killed_during_compact_context_reruns_only_the_summary_call(
    tmp_path: Path, backend: str, request: pytest.FixtureRequest,
) -> None:
    """SIGKILL while CompactContext's summary call runs: a new Worker runs the summary call again, every
    model call ran once, the RunModel that chose to compact is not repeated, and the Step shape is the
    same as without the kill; on a SQLite file and on PostgreSQL (TEST_PG_DSN)."""
    flow = kill_test_flow(tmp_path)
    url = request.getfixturevalue("pg_database") if backend == "postgres" else None
    async with AgentTestStack(tmp_path, [flow], "agents.tests.compaction_agent", worker_cwd=REPO_ROOT,
                              database_url=url) as stack:
        sessions = stack.sessions(flow)
        worker = await stack.start_worker()
        await sessions.start_session("s")
        gate = FileGate(tmp_path, "summary")
        number = 0
        while not gate.reached:
            number += 1
            assert number < 20, "never compacted"
            assert await sessions.send_user_message("s", say(number))
            await wait_for_agent_snapshot(
                sessions, "s", lambda s, n=number: gate.reached or (s.state is not None and s.state.turn_count >= n),
                description=f"turn {number} or the summary gate")
        await gate.wait_until_reached()
        worker.kill()
        await stack.start_worker()
        done = await wait_for_agent_snapshot(
            sessions, "s", lambda s: s if s.state is not None and s.state.turn_count >= number else None,
            description="the compacted turn to end")
        assert done.state is not None and done.state.last_turn_error is None
        assert done.context_summary is not None and done.context_summary.generation == 1
        log = InvocationLog(tmp_path / "invocations.log")
        assert log.count("summary") == 2
        assert [e["text"] for e in log.entries("model")] == [say(n) for n in range(1, number + 1)]
        history = await stack.read_step_history("s")
        steps = executed_steps(history)
        assert steps.count(COMPACT_CONTEXT) == 1
        assert steps.count(RUN_MODEL) == number + 1
        at = steps.index(COMPACT_CONTEXT)
        assert steps[at - 1: at + 2] == [RUN_MODEL, COMPACT_CONTEXT, RUN_MODEL]
        # The killed summary call committed nothing: every model call and the summary call that
        # committed count once, and the session total is the sum of the usage_recorded events.
        recorded = [json.loads(e.value.payload) for e in (await sessions.read_agent_events("s")).events
                    if e.value.type == "usage_recorded"]
        assert done.usage.model_calls == number + 1 == sum(r["recorded"]["model_calls"] for r in recorded)
        assert recorded[-1]["session"] == msgspec.to_builtins(done.usage)
        for field in ("input_tokens", "output_tokens"):
            assert getattr(done.usage, field) == sum(r["recorded"][field] for r in recorded)


class _LoadedAttributes:
    """The two Attributes turn_load_options reads, as a Step's Context returns them."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.values = values

    def get(self, ref: Any) -> Any:
        return self.values[ref.name]


def test_apply_turn_control_movements_load_only_the_chunks_after_the_summary() -> None:
    """Seed 002: every movement into ApplyTurnControl, like RunModel, lists only the AgentMessageChunks
    instances after the summary; without compaction it keeps the Step's own load (every chunk)."""
    from dex_agents._compaction_steps import go_to_apply_turn_control
    from dex_agents._constants import APPLY_TURN_CONTROL
    from dex_agents._persistence import AGENT_MESSAGE_CHUNKS, AGENT_MESSAGE_INDEX, CONTEXT_SUMMARY
    from dex_agents._wire import AgentMessageChunkRange, AgentMessageIndex, ContextSummary

    index = AgentMessageIndex(chunks=[AgentMessageChunkRange(1, 4), AgentMessageChunkRange(5, 8),
                                      AgentMessageChunkRange(9, 12)], first_sequence=1, window_first_sequence=13)
    summary = ContextSummary(generation=1, first_sequence=1, last_sequence=8, text="s",
                             created_at="2026-11-29T00:00:00.000Z")
    ctx: Any = _LoadedAttributes({AGENT_MESSAGE_INDEX.name: index, CONTEXT_SUMMARY.name: summary})
    with_compaction = AgentSessionOptions(compaction=CompactionPolicy(context_window_tokens=1000))
    [movement] = go_to_apply_turn_control(ctx, with_compaction).movements
    assert movement.step_type == APPLY_TURN_CONTROL
    assert movement.options is not None and movement.options.load is not None
    chunks = {key for name, key in movement.options.load.instances if name == AGENT_MESSAGE_CHUNKS.name}
    assert chunks == {message_sequence_key(9)}
    assert AGENT_MESSAGE_CHUNKS.name not in movement.options.load.names
    [plain] = go_to_apply_turn_control(ctx, AgentSessionOptions()).movements
    assert plain.step_type == APPLY_TURN_CONTROL and plain.options is None


async def test_a_cancelled_model_call_moves_to_apply_turn_control_with_only_the_chunks_after_the_summary() -> None:
    """FinishTurnCancellation, after cancel_turn cancelled a model call, moves to ApplyTurnControl
    like RunModel does: with what FinishTurnCancellation itself loads, the movement lists only the
    AgentMessageChunks instances after the summary (seed 002's load rule), not every chunk."""
    from dex_agents import TurnCancellationRequest
    from dex_agents._constants import APPLY_TURN_CONTROL, FINISH_TURN_CANCELLATION
    from dex_agents._control_steps import ControlSteps
    from dex_agents._turn_steps import TurnSteps

    flow, _ = compaction_flow("CancelledAgent", answer, window=1000)
    runtime = runtime_of(flow)
    control = ControlSteps(runtime, TurnSteps(runtime))
    index = AgentMessageIndex(chunks=[AgentMessageChunkRange(1, 4), AgentMessageChunkRange(5, 8)],
                              first_sequence=1, window_first_sequence=9)
    summary = ContextSummary(generation=1, first_sequence=1, last_sequence=4, text="s",
                             created_at="2026-11-29T00:00:00.000Z")
    state = running_turn(next_message_sequence=11)
    ctx = step_context(flow, FINISH_TURN_CANCELLATION, {
        ("AgentState", ""): state, (AGENT_MESSAGE_INDEX.name, ""): index, (CONTEXT_SUMMARY.name, ""): summary,
        ("TurnCancellationRequest", ""): TurnCancellationRequest(turn_id="turn-1",
                                                                 requested_at="2026-11-29T00:00:00.000Z"),
    }, load=flow.steps[FINISH_TURN_CANCELLATION].options.load)
    [movement] = (await control.finish_turn_cancellation(ctx, "turn-1")).movements
    assert movement.step_type == APPLY_TURN_CONTROL
    assert movement.options is not None and movement.options.load is not None
    assert AGENT_MESSAGE_CHUNKS.name not in movement.options.load.names
    assert {key for name, key in movement.options.load.instances if name == AGENT_MESSAGE_CHUNKS.name} == {
        message_sequence_key(5)}


async def test_a_summary_with_a_lone_surrogate_is_stored_escaped(tmp_path: Path) -> None:
    """A summary text holding half a UTF-16 pair (a provider's stream that split one) is stored with
    it as its escape, made once. Catches: the commit failing on every attempt, paying for the
    summary three times, then failing that turn and, compacting first, every later one."""
    calls: list[int] = []

    def summarize(request: ModelRequest) -> str:
        calls.append(1)
        return "the summary \ud800"

    flow, _ = compaction_flow("SurrogateAgent", answer, window=400, summarize=summarize)
    engine = InProcessEngine(tmp_path, [flow])
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s")
        number = await _turns_until_summarized(sessions, calls)
        await run_turns(sessions, "s", [say(number + 1)], start=number)
        snapshot = await sessions.get_agent_snapshot("s")
        assert snapshot.state is not None and snapshot.state.last_turn_error is None
        assert snapshot.context_summary is not None and snapshot.context_summary.text == "the summary \\ud800"
        assert len(calls) == 1
        history = to_step_history(await engine.client.get_flow_history("s"))
        assert [e.final_attempt for e in history
                if e.step_type == COMPACT_CONTEXT and e.event_type == "execute_completed"] == [1]


async def test_a_builtin_summary_is_the_responses_text_items_and_streams_nothing() -> None:
    """The built-in loop's summary is the text of the response's text items (from the item's JSON when
    a client sets no text), never its reasoning; and the call's deltas reach no event: the summary is
    not the assistant's answer. Catches: reasoning in the summary, the JSON's text dropped (a blank
    summary), and the summary streamed as text_delta events into the turn's chat."""
    class Summaries:
        def estimate_input_tokens(self, request: ModelRequest) -> int:
            return 1

        async def call_model(self, request: ModelRequest, output: ModelOutputWriter) -> ModelResponse:
            output.write_reasoning_delta("thinking")
            output.write_text_delta("The user")
            return ModelResponse((
                ModelOutputItem("scripted", OutputItemKind.REASONING, json.dumps({"type": "reasoning"}), "thinking"),
                ModelOutputItem("scripted", OutputItemKind.TEXT, json.dumps({"type": "text", "text": "The user "}),
                                None),
                ModelOutputItem("scripted", OutputItemKind.TEXT, json.dumps({"type": "text"}), "asked for 42."),
            ), AgentUsage(model_calls=1))

    events: list[Any] = []
    messages = [message(1, item=json.dumps({"type": "user_text", "text": "remember 42"}))]
    request = replace(summary_request_of(messages, 10_000), events=AgentEventWriter(events.append, "turn-1", "", 1))
    definition = AgentDefinition(name="a", instructions="x", model=Summaries())
    result = await BuiltinLoopAgentRunner(definition).summarize_context(request)
    assert result.text == "The user asked for 42."
    assert events == []


@pytest.mark.parametrize(("estimate", "reply", "error"), [
    (True, None, r"estimate_input_tokens returned True, not a whole number"),
    (1, {"output": []}, r"call_model returned dict; return a ModelResponse"),
])
async def test_a_builtin_summary_calls_client_that_breaks_its_contract_is_named(
    estimate: Any, reply: Any, error: str
) -> None:
    """A model client's wrong answer in a summary call fails it naming the method and the value, not
    with an AttributeError from deep inside the loop (a bool is an int to Python, but no token count)."""
    class Broken:
        def estimate_input_tokens(self, request: ModelRequest) -> int:
            return estimate  # type: ignore[no-any-return]

        async def call_model(self, request: ModelRequest, output: ModelOutputWriter) -> ModelResponse:
            return reply  # type: ignore[no-any-return]

    # Two messages: the estimate is asked only when a cut could leave one out.
    messages = [message(s, item=json.dumps({"type": "user_text", "text": "remember 42"})) for s in (1, 2)]
    definition = AgentDefinition(name="a", instructions="x", model=Broken())
    with pytest.raises(TypeError, match=error):
        await BuiltinLoopAgentRunner(definition).summarize_context(summary_request_of(messages, 10_000))


async def test_a_summary_cut_at_the_token_limit_is_kept_saying_so(caplog: pytest.LogCaptureFixture) -> None:
    """A summary the model's output token limit cut is kept (a retry pays for the same cut), but it
    ends with a note saying so, and a warning is logged: retention may delete what it summarizes."""
    class CutSummaries:
        def estimate_input_tokens(self, request: ModelRequest) -> int:
            return 1

        async def call_model(self, request: ModelRequest, output: ModelOutputWriter) -> ModelResponse:
            text = ModelOutputItem("scripted", OutputItemKind.TEXT, json.dumps({"type": "text", "text": "The user"}),
                                   "The user")
            return ModelResponse((text,), AgentUsage(model_calls=1), ModelCallMetadata(finish_reasons=("length",)))

    messages = [message(1, item=json.dumps({"type": "user_text", "text": "remember 42"}))]
    definition = AgentDefinition(name="a", instructions="x", model=CutSummaries())
    with caplog.at_level(logging.WARNING):
        result = await BuiltinLoopAgentRunner(definition).summarize_context(summary_request_of(messages, 10_000))
    assert result.text == ("The user\n[Dex: this summary was cut at the model's output token limit "
                           "(finish_reason 'length'); what followed is missing from it]")
    assert "flow s turn turn-1: the context summary was cut at the model's output token limit (finish_reason " \
           "'length')" in caplog.text  # the session named: every session has a turn-1
