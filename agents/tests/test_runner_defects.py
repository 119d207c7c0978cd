"""A runner's odd values and defects (issue 4, bad inputs): what a runner or tool hands the session,
short of a plain exception, is recorded once, as the contract says, and the session goes on.

Each case used to repeat work the contract says runs once (a tool's write, a model call) or to stop
the session for good: an exception given as a tool error's message, error texts of megabytes, an
exception whose text cannot be made, and runner methods written as plain `def`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from agents.tests.scripted_agent import FLOW_TYPE, ScriptedRunner, item
from agents.tests.test_bad_inputs import (
    MISBEHAVE,
    MisbehavingRunner,
    all_messages,
    assert_usable,
    failed_turn,
    flow_with,
    in_process,
    started_session,
    tool_records,
    turn_ended,
)

from dex_agents import (
    AgentSessionFlow,
    AgentTurnContext,
    AgentTurnOutcome,
    AgentUsage,
    DeferredToolCall,
    DeferredToolExecution,
    DeferredToolOutcome,
    FrameworkMessage,
    MessageRole,
    ToolCallsRequested,
    ToolEffect,
    ToolExecutionError,
    ToolExecutionResult,
    ToolOutcomeUnknownError,
    ToolPolicy,
    TurnCompleted,
    describe_tool_call_outcome,
)
from dex_agents._constants import MAX_STORED_TURN_ERROR_CHARS
from dex_agents._policy import cut_text
from dex_engine import MAX_VALUE_BYTES, NoRetryError

HUGE = 2 * MAX_VALUE_BYTES  # characters: no stored value can hold a text this long


class TextlessError(Exception):
    """An exception whose text cannot be made: str() raises."""

    def __str__(self) -> str:
        raise ValueError("no text")


TEXTLESS = "(a TextlessError whose text could not be made: ValueError)"


class OddToolErrorRunner(ScriptedRunner):
    """The scripted runner, whose tools named *_odd raise ToolExecutionError or
    ToolOutcomeUnknownError (args {"unknown": true}) with the message args["message"] names: an
    exception object or one whose text cannot be made, not text."""

    MESSAGES: dict[str, Any] = {"exception": ValueError("order 7 not found"), "textless": TextlessError()}

    async def execute_deferred_tool_call(self, call: DeferredToolExecution) -> DeferredToolOutcome:
        record = call.tool_call
        if not record.tool_name.endswith("_odd"):
            return await super().execute_deferred_tool_call(call)
        self.log_tool_start(call)
        args = json.loads(record.arguments)
        message = self.MESSAGES[args["message"]]
        if args.get("unknown"):
            raise ToolOutcomeUnknownError(message)
        raise ToolExecutionError(message)


async def test_a_tool_error_whose_message_is_not_text_is_recorded_once_as_its_text(tmp_path: Path) -> None:
    """ToolExecutionError(exc) and ToolOutcomeUnknownError(exc), the caught exception given as the
    message, record failed or outcome_unknown with its text, and the tool ran once. Catches: the
    record that could not be stored, the Step retried, a read run three times and an idempotent
    write whose outcome was unknown sent three times."""
    async with in_process(tmp_path, flow_with(OddToolErrorRunner(tmp_path))) as engine:
        sessions = engine.sessions
        before = await started_session(sessions, "s")
        records = await tool_records(sessions, "s", [
            {"id": "rf", "name": "read_odd", "args": {"message": "exception"}},
            {"id": "ru", "name": "idem_odd", "args": {"message": "exception", "unknown": True}},
            {"id": "rt", "name": "read_odd", "args": {"message": "textless"}},
            {"id": "wt", "name": "idem_odd", "args": {"message": "textless", "unknown": True}},
        ])
        assert {k: (v["status"], v["error"]) for k, v in records.items()} == {
            "rf": ("failed", "order 7 not found"), "ru": ("outcome_unknown", "order 7 not found"),
            "rt": ("failed", TEXTLESS), "wt": ("outcome_unknown", TEXTLESS),
        }
        for call_id in records:
            assert engine.log.count("tool_start", tool_call_id=call_id) == 1, call_id
        await assert_usable(sessions, "s", before)


async def test_a_turn_error_of_megabytes_fails_the_turn_once_with_it_cut(tmp_path: Path) -> None:
    """TurnCompleted(turn_error=<megabytes>) fails the turn in RunModel's commit: one model call,
    the runner's new_messages stored, last_turn_error and turn_failed holding the error's first
    MAX_STORED_TURN_ERROR_CHARS characters. Catches: an error too large to store, where the model
    call ran three times and the runner's messages were lost."""
    error = "e" * HUGE
    runner = MisbehavingRunner(tmp_path, {"huge": lambda: TurnCompleted(
        [item(MessageRole.ASSISTANT, text="partial")], AgentUsage(1), turn_error=error)})
    async with in_process(tmp_path, flow_with(runner)) as engine:
        sessions = engine.sessions
        before = await started_session(sessions, "s")
        text = f"{MISBEHAVE} huge"
        turn_id, stored_error = await failed_turn(sessions, "s", text)
        assert stored_error == cut_text(error, MAX_STORED_TURN_ERROR_CHARS)
        assert stored_error.endswith(f" [Dex: cut from {HUGE} characters]")
        assert engine.log.count("model", turn_id=turn_id) == 1
        assert [m.text for m in (await all_messages(sessions, "s"))[len(before):]] == [text, "partial"]
        await assert_usable(sessions, "s", before)


class UnbuildableMessageRunner(ScriptedRunner):
    """The scripted runner, whose build_user_message raises for the texts in RAISES."""

    RAISES: dict[str, BaseException] = {
        "huge-raise": ValueError("b" * HUGE), "textless-raise": TextlessError(),
    }

    def build_user_message(self, text: str) -> FrameworkMessage:
        if text in self.RAISES:
            raise self.RAISES[text]
        return super().build_user_message(text)


async def test_a_user_message_whose_build_raises_oddly_fails_only_the_turn(tmp_path: Path) -> None:
    """build_user_message raising with a text of megabytes, or an exception whose text cannot be
    made, fails the new turn with that said (cut to MAX_STORED_TURN_ERROR_CHARS); the session goes
    on. Catches: an error that could not be made or stored, where AwaitUserMessage failed on each of
    its 20 attempts and then the whole session failed."""
    async with in_process(tmp_path, flow_with(UnbuildableMessageRunner(tmp_path))) as engine:
        sessions = engine.sessions
        before = await started_session(sessions, "s")
        _, error = await failed_turn(sessions, "s", "huge-raise")
        assert error == cut_text(f"build_user_message raised ValueError: {'b' * HUGE}", MAX_STORED_TURN_ERROR_CHARS)
        _, error = await failed_turn(sessions, "s", "textless-raise")
        assert error == f"build_user_message raised TextlessError: {TEXTLESS}"
        assert await all_messages(sessions, "s") == before
        await assert_usable(sessions, "s", before)


class _TextlessNoteRunner:
    """One read call, then a model call that fails for good; build_user_message raises an exception
    whose text cannot be made for the turn-failure note."""

    def build_user_message(self, text: str) -> FrameworkMessage:
        if text.startswith("[Dex]"):
            raise TextlessError()
        return item(MessageRole.USER, text=text)

    async def run_model_step(self, turn: AgentTurnContext) -> AgentTurnOutcome:
        if turn.framework_run_state is None:
            return ToolCallsRequested("asked", [DeferredToolCall("c1", "read_x", "{}", ToolPolicy(ToolEffect.READ))],
                                      AgentUsage())
        raise NoRetryError("the model broke for good")

    async def execute_deferred_tool_call(self, execution: DeferredToolExecution) -> ToolExecutionResult:
        return ToolExecutionResult("found")


async def test_a_note_whose_build_raises_a_textless_exception_is_left_out(tmp_path: Path) -> None:
    """RecordTurnFailure ends the turn without its note when build_user_message raises an
    exception whose text cannot be made. Catches: that exception escaping the failure route, which
    failed on each of its 20 attempts and then failed the session."""
    async with in_process(tmp_path, AgentSessionFlow(_TextlessNoteRunner(), FLOW_TYPE)) as engine:
        sessions = engine.sessions
        await sessions.start_session("s", "hello")
        snapshot = await turn_ended(sessions, "s", 1)
        assert snapshot.state is not None and "the model broke for good" in (snapshot.state.last_turn_error or "")
        assert [m.text for m in await all_messages(sessions, "s")] == ["hello"]
        assert await sessions.send_user_message("s", "again")  # the session still takes messages


class PlainDefRunner:
    """The contract's async methods written as plain def: one write call without approval, then an
    answer that shows its result. Counts model calls and tool runs."""

    def __init__(self) -> None:
        self.model_calls = 0
        self.tool_runs = 0

    def build_user_message(self, text: str) -> FrameworkMessage:
        return item(MessageRole.USER, text=text)

    def run_model_step(self, turn: AgentTurnContext) -> AgentTurnOutcome:
        self.model_calls += 1
        if turn.framework_run_state is None:
            policy = ToolPolicy(ToolEffect.NON_IDEMPOTENT_WRITE, requires_approval=False)
            return ToolCallsRequested("asked", [DeferredToolCall("w1", "refund", "{}", policy)], AgentUsage(1))
        record = turn.recorded_tool_call("w1")
        return TurnCompleted([item(MessageRole.ASSISTANT, text=describe_tool_call_outcome(record))], AgentUsage(1))

    def execute_deferred_tool_call(self, execution: DeferredToolExecution) -> ToolExecutionResult:
        self.tool_runs += 1
        return ToolExecutionResult("refunded")


async def test_plain_def_runner_methods_are_used_not_repeated(tmp_path: Path) -> None:
    """run_model_step and execute_deferred_tool_call written as plain def: their results are used,
    each model call made once, and a write that may not repeat runs once and succeeds. Catches:
    awaiting a result that is not awaitable, which failed the Step after the work was done: the
    model called three times and the turn failed, the write recorded outcome_unknown."""
    runner = PlainDefRunner()
    async with in_process(tmp_path, AgentSessionFlow(runner, FLOW_TYPE)) as engine:  # type: ignore[arg-type]
        sessions = engine.sessions
        await sessions.start_session("s", "refund order 7")
        snapshot = await turn_ended(sessions, "s", 1)
        assert snapshot.state is not None and snapshot.state.last_turn_error is None
        assert [m.text for m in await all_messages(sessions, "s")] == ["refund order 7", "refunded"]
        assert (runner.model_calls, runner.tool_runs) == (2, 1)
