"""ToolCallStepOptionsProvider (seed 003, "The runner contract"): a runner gives a call's tool Step
its own timeout and, for CallTool, retry policy; a provider that fails fails only that call.

In-process sessions on a SQLite file, with AskingRunner's scripted model (test_tool_questions.py)
and tools that sleep past a timeout or crash, so the Step history and the runs show which options
each tool Step got.
"""

from __future__ import annotations

import asyncio
import json
import logging
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from agents.tests.builtin_agent import InProcessEngine
from agents.tests.test_tool_questions import AskingRunner, ToolRun, _call, _done, _pending, _script

from dex_agents import (
    TOOL_CALL_NOT_RUN_ERROR_PREFIX,
    AgentSessionClient,
    AgentSessionFlow,
    AgentSessionOptions,
    AgentStatus,
    DeferredToolCall,
    DeferredToolExecution,
    DeferredToolOutcome,
    ToolCallStepOptions,
    ToolCallStepOptionsProvider,
    ToolEffect,
    ToolPolicy,
)
from dex_agents._constants import MAX_STORED_TOOL_ERROR_CHARS
from dex_agents._options import LONGEST_TIMER
from dex_agents._policy import cut_text
from dex_agents.testing import executed_steps, to_step_history
from dex_engine import RetryPolicy

FLOW_TYPE = "ToolStepOptions"
QUICK_TWO = RetryPolicy(max_attempts=2, initial_interval_seconds=0.01, max_interval_seconds=0.01)
SHORT = timedelta(milliseconds=500)

POLICIES = {
    "read": ToolPolicy(ToolEffect.READ),
    "read_default": ToolPolicy(ToolEffect.READ),
    "write": ToolPolicy(ToolEffect.NON_IDEMPOTENT_WRITE, requires_approval=False),
    "guarded": ToolPolicy(ToolEffect.READ, requires_approval=True),
    "ask": ToolPolicy(ToolEffect.READ),
    "ok": ToolPolicy(ToolEffect.READ),
    "bad_raise": ToolPolicy(ToolEffect.READ),
    "bad_type": ToolPolicy(ToolEffect.READ),
    "bad_timeout": ToolPolicy(ToolEffect.READ),
    "bad_retry": ToolPolicy(ToolEffect.READ),
    "guarded_raise": ToolPolicy(ToolEffect.IDEMPOTENT_WRITE, requires_approval=True),
    "odd_huge": ToolPolicy(ToolEffect.READ),
    "odd_badstr": ToolPolicy(ToolEffect.READ),
    "guarded_huge": ToolPolicy(ToolEffect.READ, requires_approval=True),
    "guarded_badstr": ToolPolicy(ToolEffect.READ, requires_approval=True),
}
# The text of the exception tool_call_step_options raises for a tool named *_huge: over the engine's
# value limit, so the call's record cannot hold it whole.
HUGE_TEXT_CHARS = 2 * 1024 * 1024


class _TextlessError(Exception):
    """An exception whose text cannot be made."""

    def __str__(self) -> str:
        raise ValueError("no text")

# What tool_call_step_options returns, by tool name (a name not listed gets None).
CHOSEN: dict[str, Any] = {
    "read": ToolCallStepOptions(timeout=SHORT, retry=QUICK_TWO),
    "write": ToolCallStepOptions(timeout=SHORT, retry=RetryPolicy(max_attempts=5)),
    "guarded": ToolCallStepOptions(timeout=SHORT, retry=RetryPolicy(max_attempts=1)),
    "ask": ToolCallStepOptions(timeout=SHORT, retry=RetryPolicy(max_attempts=1)),
    "ok": ToolCallStepOptions(),
    "bad_type": "30 seconds",
    "bad_timeout": ToolCallStepOptions(timeout=timedelta(0)),
    "bad_retry": ToolCallStepOptions(retry=3),  # type: ignore[arg-type]
}


class OptionsRunner(AskingRunner):
    """AskingRunner whose tools also sleep (`sleep`: seconds, after any answers) or crash (`crash`),
    and which gives tool Step options from CHOSEN, logging every call it was asked about."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[DeferredToolCall] = []

    def tool_call_step_options(self, call: DeferredToolCall) -> ToolCallStepOptions | None:
        self.asked.append(call)
        if call.tool_name.endswith("_raise"):
            raise RuntimeError("no manifest for this tool")
        if call.tool_name.endswith("_huge"):
            raise RuntimeError("m" * HUGE_TEXT_CHARS)
        if call.tool_name.endswith("_badstr"):
            raise _TextlessError()
        chosen: ToolCallStepOptions | None = CHOSEN.get(call.tool_name)
        return chosen

    async def execute_deferred_tool_call(self, call: DeferredToolExecution) -> DeferredToolOutcome:
        args = json.loads(call.tool_call.arguments)
        if len(call.input_answers) >= len(args.get("ask", [])):
            if "crash" in args:
                self.runs.append(ToolRun(call.tool_call.tool_call_id, tuple(call.input_answers), None))
                raise RuntimeError(args["crash"])
            if "sleep" in args:
                self.runs.append(ToolRun(call.tool_call.tool_call_id, tuple(call.input_answers), None))
                await asyncio.sleep(args["sleep"])
        return await super().execute_deferred_tool_call(call)


def _engine(tmp_path: Path) -> tuple[InProcessEngine, OptionsRunner]:
    runner = OptionsRunner()
    flow = AgentSessionFlow(runner, FLOW_TYPE, AgentSessionOptions(tool_policies=POLICIES))
    return InProcessEngine(tmp_path, [flow]), runner


async def _steps(engine: InProcessEngine) -> list[str]:
    return executed_steps(to_step_history(await engine.client.get_flow_history("s")))


async def _history_of(engine: InProcessEngine, step_type: str) -> list[tuple[str, int]]:
    """(event type, attempt) of every history event of `step_type`, in order."""
    history = to_step_history(await engine.client.get_flow_history("s"))
    return [(e.event_type, e.final_attempt) for e in history if e.step_type == step_type]


def _timed_out(error: str) -> bool:
    """The worker running the attempt ends it at its timeout, or housekeeping at its deadline."""
    return "passed its timeout" in error or "passed its deadline" in error


def test_the_scripted_runner_is_a_provider() -> None:
    assert isinstance(OptionsRunner(), ToolCallStepOptionsProvider)
    assert not isinstance(AskingRunner(), ToolCallStepOptionsProvider)


async def test_call_tool_takes_the_calls_timeout_and_retry_policy(tmp_path: Path) -> None:
    """A read that would sleep for 30 s ends at the call's 0.5 s timeout, twice (its own two
    attempts, not CallTool's three), then RecordToolFailure records it failed. A call the provider
    gives nothing keeps CallTool's three attempts. The provider sees the call as the model asked."""
    engine, runner = _engine(tmp_path)
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s", _script([
            _call("c1", "read", sleep=30), _call("c2", "read_default", crash="boom"),
        ]))
        outcomes, _ = await _done(sessions)
        assert outcomes["c1"]["status"] == "failed"
        assert _timed_out(outcomes["c1"]["error"])
        assert outcomes["c2"]["status"] == "failed"
        assert "boom" in outcomes["c2"]["error"]
        assert len(runner.runs_of("c1")) == 2
        assert len(runner.runs_of("c2")) == 3
        assert [(c.tool_call_id, c.tool_name, json.loads(c.arguments), c.policy) for c in runner.asked] == [
            ("c1", "read", {"sleep": 30}, ToolPolicy(ToolEffect.READ, requires_approval=False)),
            ("c2", "read_default", {"crash": "boom"}, ToolPolicy(ToolEffect.READ, requires_approval=False)),
        ]
        steps = await _steps(engine)
        assert steps.count("RecordToolFailure") == 2
        assert steps[:2] == ["StartAgentSession", "RunModel"] and steps[-2:] == ["ResumeTurn", "RunModel"]


async def test_a_single_attempt_call_takes_the_timeout_but_never_a_retry(tmp_path: Path) -> None:
    """CallSingleAttemptTool gets the call's timeout; the provider's five attempts are ignored, so
    the write that timed out runs once and is recorded outcome_unknown."""
    engine, runner = _engine(tmp_path)
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s", _script([_call("c1", "write", sleep=30)]))
        outcomes, _ = await _done(sessions)
        assert outcomes["c1"]["status"] == "outcome_unknown"
        assert len(runner.runs_of("c1")) == 1
        assert await _history_of(engine, "CallSingleAttemptTool") == [
            ("step_scheduled", 0), ("attempt_failed", 1), ("step_failed", 1)]
        assert await _steps(engine) == [
            "StartAgentSession", "RunModel", "RecordToolOutcomeUnknown", "ResumeTurn", "RunModel"]


async def test_options_apply_after_an_approval_and_after_a_question(tmp_path: Path) -> None:
    """The options are asked for when an approved call moves into its tool Step: after
    resolve_interrupt approves it, and again when the tool's question is answered."""
    engine, runner = _engine(tmp_path)
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s", _script([
            _call("c1", "guarded", sleep=30), _call("c2", "ask", ask=["Which?"], sleep=30),
        ]))
        await _pending(sessions, "c1", "c2-input-1")
        assert [c.tool_call_id for c in runner.asked] == ["c2"]  # c1 waits for its approval first
        assert await sessions.resolve_interrupt("s", "c1", approved=True)
        assert await sessions.answer_question("s", "c2-input-1", "this one")
        outcomes, _ = await _done(sessions)
        assert [c.tool_call_id for c in runner.asked] in (["c2", "c1", "c2"], ["c2", "c2", "c1"])
        for call_id in ("c1", "c2"):
            assert outcomes[call_id]["status"] == "failed"
            assert _timed_out(outcomes[call_id]["error"])
        # One attempt each after the approval or the answer: the calls' own retry policy.
        assert len(runner.runs_of("c1")) == 1
        assert [len(run.answers) for run in runner.runs_of("c2")] == [0, 1]  # it asked, then slept once


async def test_a_provider_that_fails_fails_only_that_call(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A provider that raises or returns something unusable records the call failed without
    running it, with an error that says so and names the problem; the other calls run, the turn
    ends, and the session takes the next message. A provider that raised is a runner bug: logged as
    a warning naming the call, with its traceback."""
    caplog.set_level(logging.WARNING, logger="dex_agents")
    engine, runner = _engine(tmp_path)
    async with engine.running():
        sessions: AgentSessionClient = engine.sessions()
        await sessions.start_session("s", _script([
            _call("c1", "bad_raise"), _call("c2", "bad_type"), _call("c3", "bad_timeout"),
            _call("c4", "bad_retry"), _call("c5", "ok"), _call("c6", "guarded_raise"),
        ]))
        [approval] = await _pending(sessions, "c6")
        assert await sessions.resolve_interrupt("s", approval.interrupt_id, approved=True)
        outcomes, _ = await _done(sessions)
        errors = {call_id: outcomes[call_id]["error"] for call_id in ("c1", "c2", "c3", "c4", "c6")}
        for call_id, error in errors.items():
            assert outcomes[call_id]["status"] == "failed", call_id
            assert error.startswith(TOOL_CALL_NOT_RUN_ERROR_PREFIX + ": "), error
        raised = "the runner's tool_call_step_options raised RuntimeError: no manifest for this tool"
        assert errors["c1"] == f"{TOOL_CALL_NOT_RUN_ERROR_PREFIX}: {raised}"
        assert "returned '30 seconds', which is not a ToolCallStepOptions or None" in errors["c2"]
        assert "ToolCallStepOptions.timeout must be a positive timedelta of at most 366 days (the engine's longest " \
               "method timeout) or None, got datetime.timedelta(0)" \
            in errors["c3"]
        assert "ToolCallStepOptions.retry must be a dex_engine.RetryPolicy or None, got 3" in errors["c4"]
        assert errors["c6"] == errors["c1"]
        assert outcomes["c5"]["status"] == "succeeded"
        assert [r.tool_call_id for r in runner.runs] == ["c5"]
        assert "CallTool" in await _steps(engine)
        raised_logs = [r for r in caplog.records if "tool_call_step_options raised" in r.getMessage()]
        assert sorted(r.getMessage() for r in raised_logs) == [
            "flow s turn turn-1: tool_call_step_options raised for tool call 'c1'",
            "flow s turn turn-1: tool_call_step_options raised for tool call 'c6'",
        ]
        assert all(r.levelno == logging.WARNING and r.exc_info and r.exc_info[0] is RuntimeError for r in raised_logs)
        await sessions.send_user_message("s", "and now?")
        snapshot = await sessions.get_agent_snapshot("s")
        assert snapshot.state is not None and snapshot.state.last_turn_error is None


async def test_a_provider_raising_a_huge_or_textless_exception_fails_only_that_call(tmp_path: Path) -> None:
    """The provider raising with a text of megabytes, or an exception whose __str__ raises, records
    the call failed without running it (the text cut, or named as unmakeable), whether the call ran
    at once or after an approval. Catches: the error made or stored whole, which failed
    AwaitToolApproval on each of its 20 attempts, and then the session, or RunModel with its model
    call three times."""
    engine, runner = _engine(tmp_path)
    async with engine.running():
        sessions: AgentSessionClient = engine.sessions()
        await sessions.start_session("s", _script([
            _call("c1", "odd_huge"), _call("c2", "odd_badstr"), _call("c3", "guarded_huge"),
            _call("c4", "guarded_badstr"), _call("c5", "ok"),
        ]))
        for approval in await _pending(sessions, "c3", "c4"):
            assert await sessions.resolve_interrupt("s", approval.interrupt_id, approved=True)
        outcomes, _ = await _done(sessions)
        raised = "the runner's tool_call_step_options raised"
        huge = cut_text(f"{raised} RuntimeError: {'m' * HUGE_TEXT_CHARS}", MAX_STORED_TOOL_ERROR_CHARS)
        textless = f"{raised} _TextlessError: (a _TextlessError whose text could not be made: ValueError)"
        assert {call_id: (o["status"], o["error"]) for call_id, o in outcomes.items()} == {
            "c1": ("failed", f"{TOOL_CALL_NOT_RUN_ERROR_PREFIX}: {huge}"),
            "c2": ("failed", f"{TOOL_CALL_NOT_RUN_ERROR_PREFIX}: {textless}"),
            "c3": ("failed", f"{TOOL_CALL_NOT_RUN_ERROR_PREFIX}: {huge}"),
            "c4": ("failed", f"{TOOL_CALL_NOT_RUN_ERROR_PREFIX}: {textless}"),
            "c5": ("succeeded", None),
        }
        assert [r.tool_call_id for r in runner.runs] == ["c5"]
        snapshot = await sessions.get_agent_snapshot("s")
        assert snapshot.state is not None and (snapshot.state.status, snapshot.state.last_turn_error) == (
            AgentStatus.WAITING_FOR_USER_MESSAGE, None)


@pytest.mark.parametrize("chosen, step, expected", [
    (None, "CallTool", (None, None)),
    (ToolCallStepOptions(), "CallTool", (None, None)),
    (ToolCallStepOptions(timeout=timedelta(seconds=90), retry=QUICK_TWO), "CallTool", (QUICK_TWO, 90.0)),
    (ToolCallStepOptions(timeout=timedelta(seconds=90), retry=QUICK_TWO), "CallSingleAttemptTool", (None, 90.0)),
    # The engine's longest method timeout itself is usable ("at most"), not refused as over it.
    (ToolCallStepOptions(timeout=LONGEST_TIMER), "CallTool", (None, LONGEST_TIMER.total_seconds())),
])
def test_overrides_by_step(chosen: ToolCallStepOptions | None, step: str, expected: tuple[Any, Any]) -> None:
    from dex_agents._turn_logic import tool_step_overrides

    assert tool_step_overrides(step, chosen) == expected


def test_an_async_provider_is_named_and_its_coroutine_closed() -> None:
    """An `async def tool_call_step_options` returns a coroutine: refused with the likely cause,
    and closed, so Python does not warn that it was never awaited."""
    from dex_agents._turn_logic import tool_step_overrides

    async def options() -> ToolCallStepOptions:
        return ToolCallStepOptions()

    pending = options()
    with pytest.raises(ValueError, match=r"returned an awaitable; it must be a plain method \(not async def\)"):
        tool_step_overrides("CallTool", pending)
    assert pending.cr_frame is None  # closed


@pytest.mark.parametrize("chosen, message", [
    ({"timeout": 30}, "returned {'timeout': 30}, which is not a ToolCallStepOptions or None"),
    (ToolCallStepOptions(timeout=timedelta(seconds=-1)), "timeout must be a positive timedelta"),
    (ToolCallStepOptions(timeout=30), "(the engine's longest method timeout) or None, got 30"),  # type: ignore[arg-type]
    # Past the engine's cap, the call's MovementOptions would refuse it in RunModel's commit: the
    # turn would fail, not the one call.
    (ToolCallStepOptions(timeout=timedelta(days=400)), "timeout must be a positive timedelta of at most 366 days"),
    (ToolCallStepOptions(retry={"max_attempts": 2}), "retry must be a dex_engine.RetryPolicy"),  # type: ignore[arg-type]
])
def test_unusable_options_are_named(chosen: object, message: str) -> None:
    from dex_agents._turn_logic import tool_step_overrides

    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("{", r"\{")):
        tool_step_overrides("CallTool", chosen)
