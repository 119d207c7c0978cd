"""The options AgentSessionFlow registers for its Steps and puts on the movements into them (seed 002
"Step table" and "Rules"; seed 003 "Flow shape"): SYNC durability on every Step, RunModel's limits,
its background heartbeat interval, and the per-call Steps loading only their own AgentToolCalls record.

The Step definitions are read from built Flows, with and without the features that change what a
Step does (built-in tools, plan mode, compaction, tool tasks, per-call tool options). Movements are
read from the Step handlers, called on built contexts, and resolved by the engine's own scheduling
code into the options it stores with a scheduled Step.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from datetime import timedelta
from typing import Any

import msgspec
import pytest
from agents.tests.built_context import running_turn, runtime_of, step_context, tool_call

from dex_agents import (
    AGENT_TOOL_CALLS,
    INTERRUPT_RESOLUTIONS,
    AgentInterruptResolution,
    AgentSessionFlow,
    AgentSessionOptions,
    AgentStatus,
    AgentToolCall,
    AgentToolCallStatus,
    AgentTurnContext,
    AgentTurnOutcome,
    BuiltInTool,
    CompactionPolicy,
    ContextSummaryRequest,
    ContextSummaryResult,
    DeferredToolCall,
    DeferredToolExecution,
    FrameworkMessage,
    MessageRole,
    RunModelLimit,
    ToolCallsRequested,
    ToolCallStepOptions,
    ToolEffect,
    ToolExecutionResult,
    ToolPolicy,
    ToolTaskCancellation,
    ToolTaskPending,
    ToolTaskPoll,
    ToolTaskPollOutcome,
    TurnCancellationRequest,
    TurnCompleted,
    _turn_steps,
)
from dex_agents._builtin_steps import question_step_load
from dex_agents._constants import (
    APPLY_TURN_CONTROL,
    AWAIT_QUESTION_ANSWER,
    AWAIT_TIMER,
    AWAIT_TOOL_APPROVAL,
    AWAIT_USER_MESSAGE,
    CALL_SINGLE_ATTEMPT_TOOL,
    CALL_TOOL,
    CANCEL_TOOL_TASK,
    COMPACT_CONTEXT,
    FINISH_TURN_CANCELLATION,
    POLL_TOOL_TASK,
    RECORD_TOOL_FAILURE,
    RECORD_TOOL_OUTCOME_UNKNOWN,
    RECORD_TURN_FAILURE,
    RESUME_TURN,
    RUN_MODEL,
    RUN_MODEL_HEARTBEAT_INTERVAL,
    START_AGENT_SESSION,
)
from dex_agents._control_steps import ControlSteps, _back_to_wait
from dex_agents._runtime import background_heartbeats
from dex_agents._session_flow import RECOVERY_RETRY
from dex_agents._task_steps import go_to_poll
from dex_agents._tool_steps import ToolSteps
from dex_agents._turn_steps import TurnSteps
from dex_engine import Context, LoadOptions, LoadSpec, Movement, RetryPolicy, StepDurability, Timer, Wait, WaitResult
from dex_engine._options import TaskOptions
from dex_engine._records import ConsumedMessage, WaitOutcome
from dex_engine._scheduling import task_options

# Seed 002's Step table, which seed 003's "Flow shape" repeats: every Step the session Flow has.
SEED_STEP_TYPES = frozenset({
    START_AGENT_SESSION, AWAIT_USER_MESSAGE, RUN_MODEL, COMPACT_CONTEXT, AWAIT_TOOL_APPROVAL, AWAIT_QUESTION_ANSWER,
    AWAIT_TIMER, CALL_TOOL, CALL_SINGLE_ATTEMPT_TOOL, POLL_TOOL_TASK, RECORD_TOOL_FAILURE,
    RECORD_TOOL_OUTCOME_UNKNOWN, RESUME_TURN, APPLY_TURN_CONTROL, RECORD_TURN_FAILURE, FINISH_TURN_CANCELLATION,
    CANCEL_TOOL_TASK,
})
# The Steps of one tool call whose movements carry per-movement load options. The call's failure
# routes are reached by no movement, so they run with their registered options.
PER_CALL_STEPS = frozenset({
    AWAIT_TOOL_APPROVAL, AWAIT_QUESTION_ANSWER, AWAIT_TIMER, CALL_TOOL, CALL_SINGLE_ATTEMPT_TOOL, POLL_TOOL_TASK,
    CANCEL_TOOL_TASK,
})
TOOL_RECORDS = AGENT_TOOL_CALLS.name


def _message(role: MessageRole, text: str) -> FrameworkMessage:
    return FrameworkMessage(role=role, framework_item=json.dumps({"role": role.value, "text": text}), text=text)


class PlainRunner:
    """Only the three methods every runner has; `outcome` is what each model call returns."""

    def __init__(self, outcome: AgentTurnOutcome | None = None) -> None:
        self.outcome: AgentTurnOutcome = outcome or TurnCompleted([_message(MessageRole.ASSISTANT, "done")])
        # Awaited inside each model call before it returns: a test holds the call open with it.
        self.hold: Callable[[], Awaitable[None]] | None = None

    def build_user_message(self, text: str) -> FrameworkMessage:
        return _message(MessageRole.USER, text)

    async def run_model_step(self, turn: AgentTurnContext) -> AgentTurnOutcome:
        if self.hold is not None:
            await self.hold()
        return self.outcome

    async def execute_deferred_tool_call(self, call: DeferredToolExecution) -> ToolExecutionResult:
        raise AssertionError("no tool runs in these tests")


class FullRunner(PlainRunner):
    """Every optional capability: plan mode, compaction, tool tasks and per-call tool Step options."""

    supports_plan_mode = True

    def estimate_input_tokens(self, turn: AgentTurnContext) -> int:
        return 0

    def select_compaction_cutoff(self, turn: AgentTurnContext, retained_token_budget: int) -> int | None:
        return None

    async def summarize_context(self, request: ContextSummaryRequest) -> ContextSummaryResult:
        raise AssertionError("no compaction runs in these tests")

    async def poll_tool_task(self, poll: ToolTaskPoll) -> ToolTaskPollOutcome:
        return ToolTaskPending(5)

    async def cancel_tool_task(self, cancellation: ToolTaskCancellation) -> None:
        return None

    def tool_call_step_options(self, call: DeferredToolCall) -> ToolCallStepOptions:
        # A timeout no Step registers, so a test can tell the provider's options reached the movement.
        return ToolCallStepOptions(timeout=timedelta(seconds=7))


ALL_BUILT_INS = frozenset(BuiltInTool)


def _flows() -> dict[str, AgentSessionFlow]:
    """One Flow per feature set that changes the session's Steps' work, plus the bare one."""
    return {
        "plain": AgentSessionFlow(PlainRunner(), "Plain"),
        "full runner, default options": AgentSessionFlow(FullRunner(), "FullRunner"),
        "built-in tools": AgentSessionFlow(PlainRunner(), "BuiltIns",
                                           AgentSessionOptions(built_in_tools=ALL_BUILT_INS)),
        "every feature": AgentSessionFlow(FullRunner(), "Everything", AgentSessionOptions(
            built_in_tools=ALL_BUILT_INS, plan_mode_enabled=True,
            compaction=CompactionPolicy(context_window_tokens=1000), interrupt_deadline=timedelta(minutes=5),
        )),
    }


FLOWS = _flows()


# SYNC durability on every Step ------------------------------------------------------------------


@pytest.mark.parametrize("features", list(FLOWS))
def test_the_flow_registers_the_seed_steps_whatever_its_features(features: str) -> None:
    """The Step set the durability checks below walk is the seed's whole table, in every feature set."""
    assert set(FLOWS[features].steps) == SEED_STEP_TYPES


@pytest.mark.parametrize("features", list(FLOWS))
def test_every_step_sets_sync_durability_itself(features: str) -> None:
    """Every Step, with or without a WaitFor, sets SYNC itself (seed 002 "Rules"): the engine has one
    durability per Step, for its WaitFor and its Execute, and None there means the flow config's
    default, which a session started with an ASYNC default would then use. The resolved options the
    engine stores with a scheduled Step (and with its failure route) carry the same SYNC."""
    flow = FLOWS[features]
    not_sync = {name: step.options.durability for name, step in flow.steps.items()
                if step.options.durability is not StepDurability.SYNC}
    assert not_sync == {}
    for name, step in flow.steps.items():
        resolved = task_options(flow, name, None)
        assert resolved.has_wait_for is (step.wait_for is not None), name
        assert resolved.durability is StepDurability.SYNC, name
        if resolved.failure_route_options is not None:
            assert resolved.failure_route_options.durability is StepDurability.SYNC, name
    # Both kinds are walked: a Step with a WaitFor and one without.
    assert {step.wait_for is None for step in flow.steps.values()} == {True, False}


# RunModel's limits and failure route ---------------------------------------------------------


# A RunModelLimit other than the default: (minutes, attempts, budget minutes).
LIMITED = (40, 5, 120)
RUN_MODEL_FLOWS = {
    **{features: (flow, (15, 3, 30)) for features, flow in FLOWS.items()},
    "run_model_limit": (AgentSessionFlow(FullRunner(), "Limited", AgentSessionOptions(run_model_limit=RunModelLimit(
        timeout=timedelta(minutes=LIMITED[0]), max_attempts=LIMITED[1], retry_budget=timedelta(minutes=LIMITED[2]),
    ))), LIMITED),
}


@pytest.mark.parametrize("features", list(RUN_MODEL_FLOWS))
def test_run_model_options_are_the_seeds(features: str) -> None:
    """RunModel (seed 002 Step table): method timeout 15 min, heartbeat timeout 2 min, 3 attempts within
    30 min, failure route RecordTurnFailure; the same once resolved into a scheduled Step's options.
    run_model_limit changes the timeout, the attempts and the retry budget (seed 003, The runner
    contract); the heartbeat timeout and the failure route stay."""
    flow, (minutes, attempts, budget_minutes) = RUN_MODEL_FLOWS[features]
    options = flow.step(RUN_MODEL).options
    assert options.execute_timeout_seconds == minutes * 60
    assert options.heartbeat_timeout_seconds == 2 * 60
    assert (options.execute_retry.max_attempts, options.execute_retry.total_duration_seconds) == (
        attempts, budget_minutes * 60)
    assert options.failure_route == RECORD_TURN_FAILURE
    resolved = task_options(flow, RUN_MODEL, None)
    assert (resolved.execute.timeout_ms, resolved.heartbeat_timeout_ms) == (minutes * 60_000, 2 * 60_000)
    assert resolved.execute.retry == options.execute_retry
    assert resolved.failure_route == RECORD_TURN_FAILURE
    assert resolved.failure_route_options == task_options(flow, RECORD_TURN_FAILURE, None)


@pytest.mark.parametrize("features", list(RUN_MODEL_FLOWS))
def test_compact_context_has_run_models_options_and_failure_route(features: str) -> None:
    """CompactContext (seed 002 Step table): "with RunModel's options and failure route", a
    run_model_limit's included; a summary call is a model call."""
    flow, _ = RUN_MODEL_FLOWS[features]
    run_model, compact = flow.step(RUN_MODEL).options, flow.step(COMPACT_CONTEXT).options
    shown = [(o.execute_timeout_seconds, o.heartbeat_timeout_seconds, o.execute_retry, o.failure_route)
             for o in (run_model, compact)]
    assert shown[0] == shown[1]


# The seed's options of the tool Steps (seed 002 Step table): (failure route, attempts, retry budget in
# seconds, method timeout in seconds); None where the seed sets none.
SEED_TOOL_STEP_OPTIONS = {
    "CallTool": ("RecordToolFailure", 3, None, None),
    "CallSingleAttemptTool": ("RecordToolOutcomeUnknown", 1, None, None),
    # Its movements choose the failure route by effect; this is the fallback.
    "PollToolTask": ("RecordToolFailure", 3, None, None),
    "CancelToolTask": ("RecordToolOutcomeUnknown", 3, 120.0, 30.0),
}
# What each Step's Execute locks (seed 002 Step table); every other Step locks nothing.
SEED_STEP_LOCKS = {
    "AwaitUserMessage": ["TurnCancellationRequest"],
    "AwaitToolApproval": ["PendingInterrupts"],
    "AwaitQuestionAnswer": ["PendingInterrupts"],
    "ResumeTurn": ["PendingInterrupts"],
    "ApplyTurnControl": ["TurnCancellationRequest"],
    "FinishTurnCancellation": ["TurnCancellationRequest", "PendingInterrupts"],
}


@pytest.mark.parametrize("features", list(FLOWS))
def test_tool_steps_and_locks_are_the_seeds(features: str) -> None:
    """The tool Steps' attempts, failure routes and timeouts, and each Step's locks, as the seed's
    Step table gives them. A single-attempt call routed to RecordToolFailure (which may retry
    nothing but says the call failed, not that it may have run), a CancelToolTask without its 30 s
    timeout, or an approval Step that stopped locking PendingInterrupts (racing resolve_interrupt)
    each still ran every other test of the options."""
    flow = FLOWS[features]
    tool_steps = {}
    for name in SEED_TOOL_STEP_OPTIONS:
        options = flow.step(name).options
        tool_steps[name] = (options.failure_route, options.execute_retry.max_attempts,
                            options.execute_retry.total_duration_seconds, options.execute_timeout_seconds)
    assert tool_steps == SEED_TOOL_STEP_OPTIONS
    locks = {name: [lock.name for lock in step.options.execute_locks]
             for name, step in flow.steps.items() if step.options.execute_locks or step.options.wait_for_locks}
    assert locks == SEED_STEP_LOCKS
    assert all(not step.options.wait_for_locks for step in flow.steps.values())


@pytest.mark.parametrize("features", list(FLOWS))
def test_every_wait_for_retries_with_the_recovery_retry(features: str) -> None:
    """A WaitFor only decides whether its Step wakes: one failing on a passing database hiccup with
    the engine's default of 3 attempts would fail the whole session, so each retries as the
    bookkeeping Steps do."""
    flow = FLOWS[features]
    retries = {name: step.options.wait_for_retry for name, step in flow.steps.items() if step.wait_for is not None}
    assert retries == dict.fromkeys(retries, RECOVERY_RETRY)
    assert len(retries) == 7


# Steps whose Execute only decides or records (no model or tool call): each retries with the recovery
# retry. The others' attempts are the seed's, pinned above.
BOOKKEEPING_STEPS = SEED_STEP_TYPES - {
    RUN_MODEL, COMPACT_CONTEXT, CALL_TOOL, CALL_SINGLE_ATTEMPT_TOOL, POLL_TOOL_TASK, CANCEL_TOOL_TASK}


@pytest.mark.parametrize("features", list(FLOWS))
def test_every_bookkeeping_execute_retries_with_the_recovery_retry(features: str) -> None:
    """A Step that only records or decides (StartAgentSession, the Await Steps, ResumeTurn, the failure
    routes, turn control; seed 002 names "the recovery retry" for ApplyTurnControl and
    FinishTurnCancellation) retries its Execute with RECOVERY_RETRY, which outlasts a passing database
    hiccup: the engine's default of 3 attempts would fail a turn's failure route, or the session's
    start, on one. Catches: execute_retry dropped from any of them, or RECOVERY_RETRY cut to the default."""
    flow = FLOWS[features]
    retries = {name: flow.step(name).options.execute_retry for name in BOOKKEEPING_STEPS}
    assert retries == dict.fromkeys(BOOKKEEPING_STEPS, RECOVERY_RETRY)
    assert task_options(flow, RECORD_TURN_FAILURE, None).execute.retry == RECOVERY_RETRY
    default = RetryPolicy()
    assert RECOVERY_RETRY.max_attempts > default.max_attempts
    assert RECOVERY_RETRY.total_duration_seconds is None  # no budget that a long outage would use up


# RunModel's background heartbeat ----------------------------------------------------------------


def test_background_heartbeat_interval_is_20_seconds() -> None:
    """Seed 003 (AgentTurnContext.heartbeat): the session heartbeats every 20 seconds in the background,
    well inside RunModel's 2 min heartbeat timeout."""
    assert timedelta(seconds=20) == RUN_MODEL_HEARTBEAT_INTERVAL


def _counting_context(flow: AgentSessionFlow, beat: Callable[[], None]) -> Context:
    """RunModel attempt 1 of turn-1 on a built context whose every heartbeat calls `beat`."""

    async def heartbeat(_: str | None) -> None:
        beat()

    state = msgspec.json.encode(running_turn())
    return Context(
        flow=flow, flow_id="s", step_type=RUN_MODEL, step_execution_id="RunModel-1", method="execute", attempt=1,
        loaded={("AgentState", ""): state}, load=LoadOptions.all(), checkpoint=None, recovery_error=None,
        wait_result=None, heartbeat=heartbeat, write_event=lambda _name, _data: None,
    )


async def test_run_model_heartbeats_in_the_background_every_run_model_heartbeat_interval(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A model call that never heartbeats itself still heartbeats, every RUN_MODEL_HEARTBEAT_INTERVAL:
    with the constant made 5 ms, RunModel's background heartbeats start with that interval and three
    of them land while the call is held open. A RunModel that used another interval (a literal, the
    tool Steps' default) or none at all fails here; the 20 s value is pinned above."""
    interval = timedelta(milliseconds=5)
    monkeypatch.setattr(_turn_steps, "RUN_MODEL_HEARTBEAT_INTERVAL", interval)
    intervals: list[float | None] = []  # None: called without an interval, so with the tool Steps' default

    def recording(ctx: Context, interval_seconds: float | None = None) -> AbstractAsyncContextManager[None]:
        intervals.append(interval_seconds)
        return background_heartbeats(ctx) if interval_seconds is None else background_heartbeats(ctx, interval_seconds)

    monkeypatch.setattr(_turn_steps, "background_heartbeats", recording)
    beats = 0
    three = asyncio.Event()

    def beat() -> None:
        nonlocal beats
        beats += 1
        if beats == 3:
            three.set()

    async def until_three_heartbeats() -> None:
        # Only at the patched interval: at any other the first heartbeat could be 20 s away, so the
        # call returns at once and the assertions below fail instead.
        if intervals == [interval.total_seconds()]:
            await three.wait()

    runner = PlainRunner()
    runner.hold = until_three_heartbeats
    flow = AgentSessionFlow(runner, "Heartbeats")
    steps = TurnSteps(runtime_of(flow))
    ctx = _counting_context(flow, beat)
    decision = await steps.run_model(ctx, None)
    assert [m.step_type for m in decision.movements] == [AWAIT_USER_MESSAGE]  # the call completed the turn
    assert intervals == [interval.total_seconds()]
    assert beats >= 3


class _HeartbeatsTwice(PlainRunner):
    """A model call that heartbeats twice itself, as one that streams output does, then returns."""

    async def run_model_step(self, turn: AgentTurnContext) -> AgentTurnOutcome:
        await turn.heartbeat()
        await turn.heartbeat()
        return await super().run_model_step(turn)


async def test_the_runners_heartbeat_heartbeats_the_run_model_attempt() -> None:
    """AgentTurnContext.heartbeat is the RunModel attempt's own heartbeat: each call the runner makes
    is one heartbeat of the Step, at once (the background ones are RUN_MODEL_HEARTBEAT_INTERVAL away)."""
    beats = 0

    def beat() -> None:
        nonlocal beats
        beats += 1

    flow = AgentSessionFlow(_HeartbeatsTwice(), "OwnHeartbeats")
    decision = await TurnSteps(runtime_of(flow)).run_model(_counting_context(flow, beat), None)
    assert [m.step_type for m in decision.movements] == [AWAIT_USER_MESSAGE]
    assert beats == 2


class _CompactsAtOnce(FullRunner):
    """Over the trigger with any estimate, summarizing through sequence 1; keeps the turns it gets."""

    def __init__(self) -> None:
        super().__init__()
        self.turns: list[AgentTurnContext] = []

    def estimate_input_tokens(self, turn: AgentTurnContext) -> int:
        self.turns.append(turn)
        return 1_000_000

    def select_compaction_cutoff(self, turn: AgentTurnContext, retained_token_budget: int) -> int | None:
        return 1


async def test_run_model_that_moves_to_compact_context_closes_the_turns_event_writer() -> None:
    """RunModel that compacts instead of calling the model moves to CompactContext and closes the
    event writer it gave the runner's compaction calls, as after a model call: a write made later
    with it (a stray thread) is dropped, never shown as this attempt's output."""
    runner = _CompactsAtOnce()
    flow = AgentSessionFlow(runner, "Compacts", AgentSessionOptions(compaction=CompactionPolicy(500)))
    live: list[str] = []
    ctx = step_context(flow, RUN_MODEL, {("AgentState", ""): running_turn()},
                       write_event=lambda name, _data: live.append(name))
    decision = await TurnSteps(runtime_of(flow)).run_model(ctx, None)
    assert [m.step_type for m in decision.movements] == [COMPACT_CONTEXT]
    [turn] = runner.turns
    assert turn.events.closed
    turn.events.write_text_delta("late")
    assert live == []


# Per-call Steps load only their own AgentToolCalls record ---------------------------------------


def _assert_own_record_only(
    flow: AgentSessionFlow, movement: Movement, *, also: frozenset[tuple[str, str]] = frozenset(),
) -> TaskOptions:
    """The movement's Step, as the engine stores it, loads its call's AgentToolCalls instance and no
    other (but `also`), never the whole map, for WaitFor and Execute alike; and stays SYNC."""
    assert movement.step_type in PER_CALL_STEPS
    assert movement.options is not None, f"{movement.step_type} movement falls back to the Step's load"
    resolved = task_options(flow, movement.step_type, movement.options)
    specs: list[LoadSpec] = [resolved.execute.load]
    if resolved.wait_for is not None:
        specs.append(resolved.wait_for.load)
    own = (TOOL_RECORDS, movement.input)
    for spec in specs:
        assert spec.mode == "only", (movement.step_type, spec)
        assert TOOL_RECORDS not in spec.names, (movement.step_type, spec)
        assert {i for i in spec.instances if i[0] == TOOL_RECORDS} == {own, *also}, (movement.step_type, spec)
    assert resolved.durability is StepDurability.SYNC
    return resolved


def _call(
    tool_call_id: str, name: str, policy: ToolPolicy, arguments: dict[str, Any] | None = None,
) -> DeferredToolCall:
    return DeferredToolCall(tool_call_id, name, json.dumps(arguments or {}), policy)


# One call for each per-call Step RunModel moves to, and the Step it goes to.
REQUESTED_CALLS = [
    (_call("r1", "read_orders", ToolPolicy(ToolEffect.READ)), CALL_TOOL),
    (_call("w1", "send_mail", ToolPolicy(ToolEffect.NON_IDEMPOTENT_WRITE, requires_approval=False)),
     CALL_SINGLE_ATTEMPT_TOOL),
    (_call("a1", "refund", ToolPolicy(ToolEffect.IDEMPOTENT_WRITE, requires_approval=True)), AWAIT_TOOL_APPROVAL),
    (_call("q1", "ask_user", ToolPolicy(ToolEffect.READ), {"question": "Which one?"}), AWAIT_QUESTION_ANSWER),
    (_call("t1", "durable_wait", ToolPolicy(ToolEffect.READ), {"duration_seconds": 5, "reason": "later"}),
     AWAIT_TIMER),
]


@pytest.mark.parametrize("runner_type", [PlainRunner, FullRunner])
async def test_run_model_moves_each_call_to_a_step_that_loads_only_its_record(runner_type: type[PlainRunner]) -> None:
    """ToolCallsRequested: go_to_many with one per-call Step for each call plus ResumeTurn; each
    per-call movement loads that call's record only (seed 003 "Flow shape"), also when the runner
    gives a call its own tool Step options (FullRunner's 7 s timeout)."""
    outcome = ToolCallsRequested(framework_run_state="state-1", tool_calls=[call for call, _ in REQUESTED_CALLS])
    flow = AgentSessionFlow(runner_type(outcome), f"Calls{runner_type.__name__}",
                            AgentSessionOptions(built_in_tools=ALL_BUILT_INS))
    ctx = step_context(flow, RUN_MODEL, {("AgentState", ""): running_turn()})
    decision = await TurnSteps(runtime_of(flow)).run_model(ctx, None)
    moved = {m.input: m for m in decision.movements if m.step_type != RESUME_TURN}
    assert [(m.step_type, m.input) for m in decision.movements if m.step_type == RESUME_TURN] == [
        (RESUME_TURN, len(REQUESTED_CALLS))]
    assert {i: m.step_type for i, m in moved.items()} == {call.tool_call_id: step for call, step in REQUESTED_CALLS}
    for call, step in REQUESTED_CALLS:
        resolved = _assert_own_record_only(flow, moved[call.tool_call_id])
        if step in (CALL_TOOL, CALL_SINGLE_ATTEMPT_TOOL) and runner_type is FullRunner:
            assert resolved.execute.timeout_ms == 7_000


async def test_run_model_writes_timer_started_for_the_durable_wait_call_only() -> None:
    """Of the calls one response defers to a waiting Step, only the durable_wait call (AwaitTimer)
    writes timer_started, with its wait_until and reason; the approval and the question wait with
    no timer event."""
    outcome = ToolCallsRequested(framework_run_state="state-1", tool_calls=[call for call, _ in REQUESTED_CALLS])
    flow = AgentSessionFlow(PlainRunner(outcome), "Timers", AgentSessionOptions(built_in_tools=ALL_BUILT_INS))
    ctx = step_context(flow, RUN_MODEL, {("AgentState", ""): running_turn()})
    await TurnSteps(runtime_of(flow)).run_model(ctx, None)
    events = [msgspec.json.decode(data) for _, _, data in ctx.writes.appends]
    timers = [json.loads(e["payload"]) for e in events if e["type"] == "timer_started"]
    record = ctx.get(AGENT_TOOL_CALLS["t1"])
    assert record is not None and record.wait_until is not None
    assert timers == [{"tool_call_id": "t1", "wait_until": record.wait_until, "reason": "later"}]


def _approval_record(effect: ToolEffect) -> AgentToolCall:
    return tool_call(AgentToolCallStatus.AWAITING_APPROVAL, tool_call_id="a1", tool_name="refund", effect=effect,
                     requires_approval=True)


@pytest.mark.parametrize("runner_type", [PlainRunner, FullRunner])
@pytest.mark.parametrize(("effect", "tool_step"), [
    (ToolEffect.READ, CALL_TOOL), (ToolEffect.IDEMPOTENT_WRITE, CALL_TOOL),
    (ToolEffect.NON_IDEMPOTENT_WRITE, CALL_SINGLE_ATTEMPT_TOOL), (ToolEffect.UNCLASSIFIED, CALL_SINGLE_ATTEMPT_TOOL),
])
async def test_an_approval_moves_to_a_tool_step_that_loads_only_its_record(
    runner_type: type[PlainRunner], effect: ToolEffect, tool_step: str,
) -> None:
    """AwaitToolApproval, approved: the movement into the call's tool Step (by effect) loads that
    call's record only, with or without the runner's per-call options."""
    flow = AgentSessionFlow(runner_type(), f"Approve{runner_type.__name__}")
    resolutions = INTERRUPT_RESOLUTIONS["a1"]
    approval = AgentInterruptResolution(approved=True, rejection_message=None)
    taken = ConsumedMessage(1, msgspec.Raw(msgspec.json.encode(approval)))
    ctx = step_context(flow, AWAIT_TOOL_APPROVAL, {("AgentToolCalls", "a1"): _approval_record(effect)},
                       (Wait.any_of(resolutions.for_one()), WaitOutcome(satisfied=(0,), consumed=((taken,),))))
    decision = await ToolSteps(runtime_of(flow)).await_tool_approval(ctx, "a1")
    [movement] = decision.movements
    assert (movement.step_type, movement.input) == (tool_step, "a1")
    _assert_own_record_only(flow, movement)


async def test_an_approval_that_waits_again_loads_only_its_record() -> None:
    """AwaitToolApproval woken by a Timer before any deadline goes back to itself, still loading only
    its record (with PendingInterrupts, for the deadline)."""
    flow = AgentSessionFlow(PlainRunner(), "WaitAgain")
    wait = Wait.any_of(INTERRUPT_RESOLUTIONS["a1"].for_one(), Timer.by_duration(30))
    ctx = step_context(flow, AWAIT_TOOL_APPROVAL, {("AgentToolCalls", "a1"): _approval_record(ToolEffect.READ)},
                       (wait, WaitOutcome(satisfied=(1,), consumed=((), ()), fired_timers=(1,))))
    assert isinstance(ctx.wait_result, WaitResult) and ctx.wait_result.timer_fired
    decision = await ToolSteps(runtime_of(flow)).await_tool_approval(ctx, "a1")
    [movement] = decision.movements
    assert (movement.step_type, movement.input) == (AWAIT_TOOL_APPROVAL, "a1")
    _assert_own_record_only(flow, movement)


def test_the_other_movements_into_per_call_steps_load_only_their_record() -> None:
    """FinishTurnCancellation's move back to a waiting approval or question, a tool question's
    AwaitQuestionAnswer, and PollToolTask: each loads its call's record only. A question also loads
    the record key its interrupt ID would take, to see a collision (seed 002 AwaitQuestionAnswer)."""
    flow = FLOWS["every feature"]
    approval = _approval_record(ToolEffect.NON_IDEMPOTENT_WRITE)
    _assert_own_record_only(flow, _back_to_wait(approval))
    question = tool_call(AgentToolCallStatus.AWAITING_ANSWER, input_question="Colour?", input_allows_free_text=True)
    collision = frozenset({(TOOL_RECORDS, "c1-input-1")})
    _assert_own_record_only(flow, _back_to_wait(question), also=collision)
    _assert_own_record_only(flow, Movement(AWAIT_QUESTION_ANSWER, "c1", question_step_load(question)), also=collision)
    for effect in ToolEffect:
        task = tool_call(AgentToolCallStatus.WAITING_FOR_TASK, effect=effect, task_id="job-1",
                         task_poll_interval_seconds=5)
        [poll] = go_to_poll(task).movements
        assert poll.step_type == POLL_TOOL_TASK
        _assert_own_record_only(flow, poll)


async def test_a_cancelled_turn_moves_its_started_task_to_a_cancel_tool_task_that_loads_only_its_record() -> None:
    """FinishTurnCancellation abandons a call whose tool task runs: its CancelToolTask loads that
    call's record only, like every other Step of one call."""
    flow = FLOWS["every feature"]
    runtime = runtime_of(flow)
    state = msgspec.structs.replace(running_turn(), status=AgentStatus.RUNNING_TOOLS)
    task = tool_call(AgentToolCallStatus.WAITING_FOR_TASK, task_id="job-1", task_poll_interval_seconds=5)
    ctx = step_context(flow, FINISH_TURN_CANCELLATION, {
        ("AgentState", ""): state, ("AgentToolCalls", "c1"): task,
        ("TurnCancellationRequest", ""): TurnCancellationRequest("turn-1", "2026-12-02T05:00:00.000Z"),
    })
    decision = await ControlSteps(runtime, TurnSteps(runtime)).finish_turn_cancellation(ctx, "turn-1")
    [movement] = decision.movements
    assert (movement.step_type, movement.input) == (CANCEL_TOOL_TASK, "c1")
    _assert_own_record_only(flow, movement)
