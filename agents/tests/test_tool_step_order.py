"""What a tool Step does before, during and instead of its tool (seed 002 "Rules" and the Step
table), on a built context that records heartbeats and best-effort events in order:

- CallTool and CallSingleAttemptTool write tool_call_started, then make a heartbeat durable, and
  only then run the tool, which heartbeats in the background every TOOL_HEARTBEAT_INTERVAL while
  it runs and not after;
- the tool's own heartbeat and save_heartbeat_checkpoint reach the attempt's heartbeat, and a
  checkpoint that is not text raises TypeError in the tool instead of being saved;
- a tool Step whose record is already final or gone ends without running, publishing or writing
  anything, and so does a failure route Step (RecordToolFailure, RecordToolOutcomeUnknown) whose
  record is final or gone; a tool Step for a call that is not approved raises without running it,
  and one whose tool returns an output that is not text raises without recording it;
- ResumeTurn in a session with no active turn ends without writing anything, and one whose turn
  still has an unfinished call waits again for the unfinished count.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import msgspec
import pytest
from agents.tests.built_context import interrupt, runtime_of, step_context, tool_call
from agents.tests.scripted_agent import ScriptedRunner
from engine.tests.odd_values import UNSHOWABLE_SHOWN, Unshowable

from dex_agents import (
    AGENT_STATE,
    AGENT_TOOL_CALLS,
    CALL_SINGLE_ATTEMPT_TOOL,
    CALL_TOOL,
    RECORD_TOOL_FAILURE,
    RECORD_TOOL_OUTCOME_UNKNOWN,
    RESUME_TURN,
    RUN_MODEL,
    TOOL_CALL_RESULTS,
    AgentSessionFlow,
    AgentSessionOptions,
    AgentState,
    AgentStatus,
    AgentToolCallStatus,
    DeferredToolExecution,
    ToolEffect,
    ToolExecutionResult,
    ToolInputRequested,
    ToolTaskStarted,
    TurnCancellationRequest,
    TurnControlKind,
    TurnControlRequest,
)
from dex_agents import _tool_steps as tool_steps_module
from dex_agents._constants import TOOL_HEARTBEAT_INTERVAL
from dex_agents._control_steps import TURN_CONTROL_WAKE
from dex_agents._runtime import background_heartbeats
from dex_agents._tool_steps import ToolSteps
from dex_engine import AttemptProgress, Context, RecoveryError, StepDecision, Wait
from dex_engine._records import ConsumedMessage, WaitOutcome

# The background heartbeat interval the tests run the tool Step with, and how long their tool runs:
# several intervals, so a Step without background heartbeats shows.
SHORT_INTERVAL = 0.02
TOOL_SECONDS = SHORT_INTERVAL * 8

ToolHandler = Callable[[Context, str], Awaitable[StepDecision]]


class LoggingRunner(ScriptedRunner):
    """A tool that logs its start and end around a sleep of TOOL_SECONDS."""

    def __init__(self, log: list[str]) -> None:
        super().__init__()
        self.order = log

    async def execute_deferred_tool_call(
        self, call: DeferredToolExecution
    ) -> ToolExecutionResult | ToolInputRequested | ToolTaskStarted:
        self.order.append("tool start")
        await asyncio.sleep(TOOL_SECONDS)
        self.order.append("tool end")
        return ToolExecutionResult("ok")


def recording_context(flow: AgentSessionFlow, step_type: str, status: AgentToolCallStatus,
                      log: list[str]) -> Context:
    record = tool_call(status, effect=ToolEffect.NON_IDEMPOTENT_WRITE if step_type == CALL_SINGLE_ATTEMPT_TOOL
                       else ToolEffect.READ)

    async def heartbeat(checkpoint: str | None) -> None:
        log.append("heartbeat")

    def write_event(_stream: str, data: bytes) -> None:
        log.append(f"event {json.loads(data)['type']}")

    return step_context(flow, step_type, {("AgentToolCalls", "c1"): record},
                        heartbeat=heartbeat, write_event=write_event)


def tool_step(log: list[str], step_type: str) -> tuple[AgentSessionFlow, ToolHandler]:
    """A Flow whose runner's tool logs to `log`, and the handler of its `step_type`."""
    flow = AgentSessionFlow(LoggingRunner(log), "ToolOrder", AgentSessionOptions())
    steps = ToolSteps(runtime_of(flow))
    return flow, steps.call_tool if step_type == CALL_TOOL else steps.call_single_attempt_tool


def test_tool_steps_heartbeat_in_the_background_every_20_seconds() -> None:
    # Seed 002: "a background heartbeat every 20 s"; background_heartbeats' default is what the tool
    # Steps use.
    assert timedelta(seconds=20) == TOOL_HEARTBEAT_INTERVAL
    default = inspect.signature(background_heartbeats).parameters["interval_seconds"].default
    assert default == TOOL_HEARTBEAT_INTERVAL.total_seconds()


@pytest.mark.parametrize("step_type", [CALL_TOOL, CALL_SINGLE_ATTEMPT_TOOL])
async def test_started_then_a_durable_heartbeat_then_the_tool_with_background_heartbeats(
    step_type: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    log: list[str] = []
    flow, handler = tool_step(log, step_type)
    intervals: list[Any] = []

    def short_heartbeats(ctx: Context, *interval: float) -> Any:
        intervals.append(interval)
        return background_heartbeats(ctx, SHORT_INTERVAL)

    monkeypatch.setattr(tool_steps_module, "background_heartbeats", short_heartbeats)
    ctx = recording_context(flow, step_type, AgentToolCallStatus.APPROVED, log)
    await handler(ctx, "c1")

    assert intervals == [()]  # the default interval (pinned above)
    assert log[:3] == ["event tool_call_started", "heartbeat", "tool start"]
    assert log[-1] == "tool end"
    background = log[3:-1]
    assert background and set(background) == {"heartbeat"}
    await asyncio.sleep(SHORT_INTERVAL * 4)
    assert log[-1] == "tool end"  # no heartbeat outlives the tool
    record = ctx.get(AGENT_TOOL_CALLS["c1"])
    assert record is not None and (record.status, record.output) == (AgentToolCallStatus.SUCCEEDED, "ok")


@pytest.mark.parametrize("status", [s for s in AgentToolCallStatus if s.is_final])
@pytest.mark.parametrize("step_type", [CALL_TOOL, CALL_SINGLE_ATTEMPT_TOOL])
async def test_a_final_record_is_never_run_again(step_type: str, status: AgentToolCallStatus) -> None:
    """Seed 002 "Rules": a tool Step whose record is already final ends without running or
    publishing (a retried Step after its tool's result committed, say): a write never runs twice."""
    log: list[str] = []
    flow, handler = tool_step(log, step_type)
    ctx = recording_context(flow, step_type, status, log)
    decision = await handler(ctx, "c1")
    assert decision.kind == "dead_end"
    assert log == []
    assert ctx.writes.attributes == {} and ctx.writes.appends == [] and ctx.writes.publishes == []



@pytest.mark.parametrize("step_type", [CALL_TOOL, CALL_SINGLE_ATTEMPT_TOOL])
async def test_a_tool_step_whose_record_is_gone_ends_without_running(step_type: str) -> None:
    """A tool Step whose record was deleted (the turn failed while it was scheduled) ends without
    running the tool or writing anything."""
    log: list[str] = []
    flow, handler = tool_step(log, step_type)
    ctx = step_context(flow, step_type, {})
    decision = await handler(ctx, "c1")
    assert decision.kind == "dead_end"
    assert log == []
    assert ctx.writes.empty()


@pytest.mark.parametrize("status", [s for s in AgentToolCallStatus
                                    if not s.is_final and s is not AgentToolCallStatus.APPROVED])
@pytest.mark.parametrize("step_type", [CALL_TOOL, CALL_SINGLE_ATTEMPT_TOOL])
async def test_a_call_that_is_not_approved_fails_the_step_and_never_runs(
    step_type: str, status: AgentToolCallStatus
) -> None:
    """A tool Step runs only an approved call: for a call still waiting (approval, answer, task or
    timer) it raises, so the Step fails, and neither runs the tool nor writes anything."""
    log: list[str] = []
    flow, handler = tool_step(log, step_type)
    ctx = recording_context(flow, step_type, status, log)
    with pytest.raises(RuntimeError, match=f"^tool call 'c1' is {status.value}; a tool Step runs only approved calls$"):
        await handler(ctx, "c1")
    assert log == []
    assert ctx.writes.empty()


@pytest.mark.parametrize("status", [None, *(s for s in AgentToolCallStatus if s.is_final)])
@pytest.mark.parametrize("step_type", [RECORD_TOOL_FAILURE, RECORD_TOOL_OUTCOME_UNKNOWN])
async def test_a_failure_route_for_a_final_or_missing_record_writes_nothing(
    step_type: str, status: AgentToolCallStatus | None
) -> None:
    """A failure route Step whose call already has its result (or whose record is gone) ends
    without recording or publishing a second result, which ResumeTurn would count."""
    flow = AgentSessionFlow(ScriptedRunner(), "ToolOrder", AgentSessionOptions())
    steps = ToolSteps(runtime_of(flow))
    handler = steps.record_tool_failure if step_type == RECORD_TOOL_FAILURE else steps.record_tool_outcome_unknown
    values: dict[tuple[str, str], Any] = {} if status is None else {("AgentToolCalls", "c1"): tool_call(status)}
    recovery = RecoveryError(step_type=CALL_TOOL, step_execution_id="CallTool-1", method="execute", attempts=3,
                             attempt_progress=AttemptProgress.NOT_COMPLETED, error_type="RuntimeError", detail="boom")
    ctx = step_context(flow, step_type, values, recovery_error=recovery)
    decision = await handler(ctx, "c1")
    assert decision.kind == "dead_end"
    assert ctx.writes.empty()


@pytest.mark.parametrize(("detail", "error"), [("boom", "boom"), ("", "TimeoutError")])
@pytest.mark.parametrize(("step_type", "effect", "status"), [
    (RECORD_TOOL_FAILURE, ToolEffect.READ, AgentToolCallStatus.FAILED),
    (RECORD_TOOL_OUTCOME_UNKNOWN, ToolEffect.NON_IDEMPOTENT_WRITE, AgentToolCallStatus.OUTCOME_UNKNOWN),
])
async def test_a_failure_route_records_the_recovery_detail_or_else_the_error_type(
    step_type: str, effect: ToolEffect, status: AgentToolCallStatus, detail: str, error: str
) -> None:
    """The failed call's error is the recovery error's detail; a failure without one (a bare
    TimeoutError, say) records its error type, so the model never sees an empty error."""
    flow = AgentSessionFlow(ScriptedRunner(), "ToolOrder", AgentSessionOptions())
    steps = ToolSteps(runtime_of(flow))
    handler = steps.record_tool_failure if step_type == RECORD_TOOL_FAILURE else steps.record_tool_outcome_unknown
    recovery = RecoveryError(step_type=CALL_TOOL, step_execution_id="CallTool-1", method="execute", attempts=3,
                             attempt_progress=AttemptProgress.NOT_COMPLETED, error_type="TimeoutError", detail=detail)
    record = tool_call(AgentToolCallStatus.APPROVED, effect=effect)
    ctx = step_context(flow, step_type, {("AgentToolCalls", "c1"): record}, recovery_error=recovery)
    decision = await handler(ctx, "c1")
    assert decision.kind == "dead_end"
    final = ctx.get(AGENT_TOOL_CALLS["c1"])
    assert final is not None and (final.status, final.error) == (status, error)


def turn_2_running_tools() -> dict[tuple[str, str], Any]:
    """The loaded values of a session in turn-2 running tools: c1 succeeded, c2 approved and not run."""
    return {
        ("AgentState", ""): AgentState(status=AgentStatus.RUNNING_TOOLS, turn_count=1, active_turn_id="turn-2",
                                       next_message_sequence=5, last_turn_error=None, accepts_turn_control=True),
        ("AgentToolCalls", "c1"): tool_call(AgentToolCallStatus.SUCCEEDED, turn_id="turn-2", output="ok"),
        ("AgentToolCalls", "c2"): tool_call(AgentToolCallStatus.APPROVED, tool_call_id="c2", turn_id="turn-2"),
    }


@pytest.mark.parametrize(("steered", "cancelled"), [(False, False), (True, True)])
async def test_resume_turn_woken_by_turn_control_waits_again_for_the_same_count(steered: bool, cancelled: bool) -> None:
    """Seed 002 ResumeTurn: on a control wake with nothing for it to apply (a stale wake, or a turn
    both steered and cancelled, which FinishTurnCancellation owns) it abandons no waiting call and
    waits again for the same count, even when a call whose result is still queued is already final."""
    flow = AgentSessionFlow(ScriptedRunner(), "ToolOrder", AgentSessionOptions())
    values = turn_2_running_tools()
    values[("AgentToolCalls", "c3")] = tool_call(AgentToolCallStatus.AWAITING_APPROVAL, tool_call_id="c3",
                                                 turn_id="turn-2", requires_approval=True)
    values[("PendingInterrupts", "")] = [interrupt("c3")]
    if steered:
        values[("SteeredMessageCount", "")] = 1
    if cancelled:
        values[("TurnCancellationRequest", "")] = TurnCancellationRequest(
            turn_id="turn-2", requested_at="2026-01-01T00:00:00.000Z")
    wait = Wait.any_of(TOOL_CALL_RESULTS.for_n(3), TURN_CONTROL_WAKE)
    wake = ConsumedMessage(1, msgspec.Raw(msgspec.json.encode(TurnControlRequest(TurnControlKind.STEER))))
    ctx = step_context(flow, RESUME_TURN, values, (wait, WaitOutcome(satisfied=(1,), consumed=((), (wake,)))))
    decision = await ToolSteps(runtime_of(flow)).resume_turn(ctx, 3)
    assert [(m.step_type, m.input) for m in decision.movements] == [(RESUME_TURN, 3)]
    assert ctx.writes.empty()


@pytest.mark.parametrize("state", [None, "no active turn"])
async def test_resume_turn_without_an_active_turn_ends_writing_nothing(state: str | None) -> None:
    """A ResumeTurn woken after its session's turn ended (or before any state) neither starts a model
    call nor writes AgentState."""
    flow = AgentSessionFlow(ScriptedRunner(), "ToolOrder", AgentSessionOptions())
    values: dict[tuple[str, str], Any] = {}
    if state is not None:
        values[("AgentState", "")] = AgentState(
            status=AgentStatus.WAITING_FOR_USER_MESSAGE, turn_count=1, active_turn_id=None, next_message_sequence=3,
            last_turn_error=None, accepts_turn_control=False)
    wait = Wait.any_of(TOOL_CALL_RESULTS.for_n(1), TURN_CONTROL_WAKE)
    result = ConsumedMessage(1, msgspec.Raw(b'"c1"'))
    ctx = step_context(flow, RESUME_TURN, values, (wait, WaitOutcome(satisfied=(0,), consumed=((result,), ()))))
    decision = await ToolSteps(runtime_of(flow)).resume_turn(ctx, 1)
    assert decision.kind == "dead_end" and not decision.movements
    assert ctx.writes.empty()


async def test_resume_turn_with_a_call_of_its_turn_unfinished_waits_again_for_the_unfinished_count() -> None:
    """Seed 002 ResumeTurn: if a consumed result belonged to an earlier turn, it waits again for the
    unfinished count, writing nothing and starting no model call."""
    flow = AgentSessionFlow(ScriptedRunner(), "ToolOrder", AgentSessionOptions())
    values = turn_2_running_tools()
    wait = Wait.any_of(TOOL_CALL_RESULTS.for_n(2), TURN_CONTROL_WAKE)
    results = (ConsumedMessage(1, msgspec.Raw(b'"c0"')), ConsumedMessage(2, msgspec.Raw(b'"c1"')))
    ctx = step_context(flow, RESUME_TURN, values, (wait, WaitOutcome(satisfied=(0,), consumed=(results, ()))))
    decision = await ToolSteps(runtime_of(flow)).resume_turn(ctx, 2)
    assert [(m.step_type, m.input) for m in decision.movements] == [(RESUME_TURN, 1)]
    assert ctx.writes.empty()


async def test_resume_turn_with_every_call_final_goes_to_run_model_with_status_running_model() -> None:
    """Seed 002 ResumeTurn: once every call of the turn is final it sets the status back to
    running_model in its own commit (a snapshot during the next model call says so) and goes to RunModel."""
    flow = AgentSessionFlow(ScriptedRunner(), "ToolOrder", AgentSessionOptions())
    values = turn_2_running_tools()
    values[("AgentToolCalls", "c2")] = tool_call(AgentToolCallStatus.FAILED, tool_call_id="c2", turn_id="turn-2",
                                                 error="db down")
    wait = Wait.any_of(TOOL_CALL_RESULTS.for_n(1), TURN_CONTROL_WAKE)
    result = ConsumedMessage(1, msgspec.Raw(b'"c2"'))
    ctx = step_context(flow, RESUME_TURN, values, (wait, WaitOutcome(satisfied=(0,), consumed=((result,), ()))))
    decision = await ToolSteps(runtime_of(flow)).resume_turn(ctx, 1)
    assert [m.step_type for m in decision.movements] == [RUN_MODEL]
    running = values[("AgentState", "")]
    assert ctx.get(AGENT_STATE) == msgspec.structs.replace(running, status=AgentStatus.RUNNING_MODEL)


class NumberOutputRunner(ScriptedRunner):
    """A tool that returns a ToolExecutionResult whose output is a number, not text."""

    async def execute_deferred_tool_call(
        self, call: DeferredToolExecution
    ) -> ToolExecutionResult | ToolInputRequested | ToolTaskStarted:
        output: Any = 5
        return ToolExecutionResult(output)


@pytest.mark.parametrize("step_type", [CALL_TOOL, CALL_SINGLE_ATTEMPT_TOOL])
async def test_a_tool_result_whose_output_is_not_text_fails_the_step_and_records_nothing(step_type: str) -> None:
    """ToolExecutionResult.output must be text: a tool that returns another output fails its Step
    (a runner contract breach, like returning something else), so nothing is recorded succeeded."""
    flow = AgentSessionFlow(NumberOutputRunner(), "ToolOrder", AgentSessionOptions())
    steps = ToolSteps(runtime_of(flow))
    handler = steps.call_tool if step_type == CALL_TOOL else steps.call_single_attempt_tool
    ctx = step_context(flow, step_type, {("AgentToolCalls", "c1"): tool_call(AgentToolCallStatus.APPROVED)})
    with pytest.raises(TypeError, match=r"^execute_deferred_tool_call returned ToolExecutionResult\(.*\); return "
                       r"ToolExecutionResult\(output: str\) or raise ToolExecutionError$"):
        await handler(ctx, "c1")
    assert ctx.writes.empty()


class UnshowableResultRunner(ScriptedRunner):
    """A tool that returns a value whose repr raises."""

    async def execute_deferred_tool_call(
        self, call: DeferredToolExecution
    ) -> ToolExecutionResult | ToolInputRequested | ToolTaskStarted:
        return Unshowable()  # type: ignore[return-value]


async def test_a_tool_result_whose_repr_raises_fails_the_step_naming_what_it_is() -> None:
    """The contract error about a tool's result names it as `shown` does. Catches: the result's own
    repr raising inside the error's message, so the Step failed (and was logged) with the
    result's RuntimeError, which named no contract."""
    flow = AgentSessionFlow(UnshowableResultRunner(), "ToolOrder", AgentSessionOptions())
    ctx = step_context(flow, CALL_TOOL, {("AgentToolCalls", "c1"): tool_call(AgentToolCallStatus.APPROVED)})
    with pytest.raises(TypeError, match=re.escape(f"execute_deferred_tool_call returned {UNSHOWABLE_SHOWN}; ")):
        await ToolSteps(runtime_of(flow)).call_tool(ctx, "c1")


class HeartbeatingRunner(ScriptedRunner):
    """A tool that heartbeats, saves a checkpoint, then tries to save one that is not text."""

    def __init__(self) -> None:
        super().__init__()
        self.errors: list[str] = []

    async def execute_deferred_tool_call(
        self, call: DeferredToolExecution
    ) -> ToolExecutionResult | ToolInputRequested | ToolTaskStarted:
        await call.heartbeat()
        await call.save_heartbeat_checkpoint("cp-1")
        bad: Any = 5
        try:
            await call.save_heartbeat_checkpoint(bad)
        except TypeError as exc:
            self.errors.append(str(exc))
        return ToolExecutionResult("ok")


@pytest.mark.parametrize("step_type", [CALL_TOOL, CALL_SINGLE_ATTEMPT_TOOL])
async def test_the_tools_heartbeat_and_checkpoint_reach_the_attempt_and_a_checkpoint_must_be_text(
    step_type: str
) -> None:
    runner = HeartbeatingRunner()
    flow = AgentSessionFlow(runner, "ToolOrder", AgentSessionOptions())
    steps = ToolSteps(runtime_of(flow))
    handler = steps.call_tool if step_type == CALL_TOOL else steps.call_single_attempt_tool
    heartbeats: list[str | None] = []

    async def heartbeat(checkpoint: str | None) -> None:
        heartbeats.append(checkpoint)

    ctx = step_context(flow, step_type, {("AgentToolCalls", "c1"): tool_call(AgentToolCallStatus.APPROVED)},
                       heartbeat=heartbeat)
    await handler(ctx, "c1")

    # The Step's own durable heartbeat, then the tool's heartbeat, then its checkpoint; never the 5.
    assert heartbeats == [None, None, "cp-1"]
    assert runner.errors == ["a heartbeat checkpoint must be text, got int"]
    record = ctx.get(AGENT_TOOL_CALLS["c1"])
    assert record is not None and (record.status, record.output) == (AgentToolCallStatus.SUCCEEDED, "ok")
