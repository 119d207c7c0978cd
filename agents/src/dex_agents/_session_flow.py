"""AgentSessionFlow: one durable agent session per Flow run, every model and tool call its own Step."""

from __future__ import annotations

import inspect
from typing import Any

from dex_engine import Flow, LoadOptions, RetryPolicy, Step, StepDurability, StepOptions

from ._builtin_steps import BuiltInSteps
from ._compaction_steps import RUN_MODEL_MOVEMENT_LOAD_EXTRA, CompactionSteps, check_compaction_runner
from ._constants import (
    APPLY_TURN_CONTROL,
    AWAIT_QUESTION_ANSWER,
    AWAIT_TIMER,
    AWAIT_TOOL_APPROVAL,
    AWAIT_USER_MESSAGE,
    CALL_SINGLE_ATTEMPT_TOOL,
    CALL_SINGLE_ATTEMPT_TOOL_MAX_ATTEMPTS,
    CALL_TOOL,
    CALL_TOOL_MAX_ATTEMPTS,
    CANCEL_TOOL_TASK,
    CANCEL_TOOL_TASK_MAX_ATTEMPTS,
    CANCEL_TOOL_TASK_RETRY_BUDGET,
    CANCEL_TOOL_TASK_TIMEOUT,
    COMPACT_CONTEXT,
    FINISH_TURN_CANCELLATION,
    POLL_TOOL_TASK,
    POLL_TOOL_TASK_MAX_ATTEMPTS,
    RECORD_TOOL_FAILURE,
    RECORD_TOOL_OUTCOME_UNKNOWN,
    RECORD_TURN_FAILURE,
    RESUME_TURN,
    RUN_MODEL,
    RUN_MODEL_HEARTBEAT_TIMEOUT,
    START_AGENT_SESSION,
)
from ._control_steps import ControlSteps, turn_control_rpcs
from ._options import AgentSessionOptions
from ._persistence import (
    AGENT_PLAN,
    AGENT_TOOL_CALLS,
    PENDING_INTERRUPTS,
    TURN_CANCELLATION_REQUEST,
    agent_events_stream,
    session_schema,
)
from ._plan_rpcs import check_plan_mode, plan_rpcs
from ._rpcs import session_rpcs
from ._runner import AgentFrameworkRunner
from ._runtime import TURN_CONTROL_LOAD_EXTRA, TURN_LOAD, WINDOW_LOAD, SessionRuntime
from ._task_steps import POLL_TOOL_TASK_STEP_LOAD, TaskSteps
from ._tool_steps import ToolSteps
from ._turn_steps import TurnSteps
from ._wire import AgentSessionStartInput, CompactContextInput

DEFAULT_FLOW_TYPE = "AgentSession"

# Failure routes and bookkeeping Steps must not give up on a passing database hiccup: a failed
# recording Step would fail the whole session.
RECOVERY_RETRY = RetryPolicy(max_attempts=20, initial_interval_seconds=0.5, max_interval_seconds=30.0)

_SYNC = StepDurability.SYNC
_RUNNER_METHODS = ("build_user_message", "run_model_step", "execute_deferred_tool_call")


# Runner methods the session calls inside a commit (StartAgentSession, AwaitUserMessage, the Steps
# that end a turn), where nothing can be awaited: an async def there returns an unawaited coroutine.
_PLAIN_RUNNER_METHODS = ("build_user_message", "build_unfinished_turn_messages")


def _check_runner(runner: object) -> None:
    if isinstance(runner, type):
        # A class has every method an instance has, so the check below passed it, and every turn then
        # failed calling build_user_message unbound ("missing 1 required positional argument").
        raise TypeError(
            f"the class {runner.__name__} is not an AgentFrameworkRunner: pass an instance, {runner.__name__}(...)"
        )
    missing = [name for name in _RUNNER_METHODS if not callable(getattr(runner, name, None))]
    if missing:
        raise TypeError(
            f"{type(runner).__name__} is not an AgentFrameworkRunner: it lacks {', '.join(missing)}"
        )
    for name in _PLAIN_RUNNER_METHODS:
        # Refused here, once: at run time an async build_user_message fails every turn with a coroutine
        # "not a FrameworkMessage", and an async builder drops its items from every unfinished turn.
        if inspect.iscoroutinefunction(getattr(runner, name, None)):
            raise TypeError(
                f"{type(runner).__name__}.{name} is async def, but the session calls it inside a commit, which "
                "cannot await it; make it a plain def (run_model_step, execute_deferred_tool_call and the "
                "tool task and compaction methods may be async)"
            )


def _check_runner_options(runner: object, options: AgentSessionOptions) -> None:
    """Ask a runner that has its own view of the options (the built-in loop's AgentDefinition, which
    checks itself only against the options builtin_agent_session_options derives from it) whether
    these contradict it: such a pair would fail every turn or call at run time, not once here."""
    problem_of = getattr(runner, "session_options_problem", None)
    problem = problem_of(options) if callable(problem_of) else None
    if problem is not None:
        # The runner names what they do not fit first ("AgentDefinition 'x': ...").
        raise ValueError(f"AgentSessionOptions that do not fit {problem}")


class AgentSessionFlow(Flow):
    """The shared session Flow with a framework runner. Register one per agent, each with its flow_type.

    Every Step sets SYNC durability explicitly, so a Flow started with an ASYNC default never
    replays a Step result, and a single-attempt write never runs twice.
    """

    def __init__(
        self,
        runner: AgentFrameworkRunner[Any],
        flow_type: str = DEFAULT_FLOW_TYPE,
        options: AgentSessionOptions | None = None,
    ) -> None:
        _check_runner(runner)
        options = options or AgentSessionOptions()
        if not isinstance(options, AgentSessionOptions):
            raise TypeError(f"options must be AgentSessionOptions, got {type(options).__name__}")
        check_plan_mode(runner, options.plan_mode_enabled, options.built_in_tools)
        _check_runner_options(runner, options)
        check_compaction_runner(runner, options.compaction)
        self.runner = runner
        self.options = options
        self.agent_events = agent_events_stream(options.agent_events_capacity_bytes)
        runtime = SessionRuntime(runner, options, self.agent_events)
        turn = TurnSteps(runtime)
        tools = ToolSteps(runtime)
        built_ins = BuiltInSteps(runtime)
        tasks = TaskSteps(runtime, tools)
        control = ControlSteps(runtime, turn)
        limit = options.run_model_limit
        turn_input = CompactContextInput | None
        tool_records = LoadOptions.only(AGENT_TOOL_CALLS)
        steps: list[Step[Any]] = [
            Step(START_AGENT_SESSION, turn.start_agent_session, input_type=AgentSessionStartInput | None,
                 options=StepOptions(durability=_SYNC, execute_retry=RECOVERY_RETRY, load=WINDOW_LOAD)),
            # AwaitUserMessage and ResumeTurn only decide from their snapshot (pure_execute): a
            # Worker on the event loop of the commit that makes one ready (send_user_message's, the
            # last tool result's) runs it in that commit, one fsync fewer each per turn.
            Step(AWAIT_USER_MESSAGE, turn.await_user_message, input_type=None,
                 wait_for=turn.await_user_message_wait,
                 options=StepOptions(durability=_SYNC, execute_retry=RECOVERY_RETRY, wait_for_retry=RECOVERY_RETRY,
                                     wait_for_load=LoadOptions.only(AGENT_PLAN), execute_load=WINDOW_LOAD,
                                     execute_locks=(TURN_CANCELLATION_REQUEST,)),
                 pure_execute=True),
            Step(RUN_MODEL, turn.run_model, input_type=turn_input,
                 options=StepOptions(
                     durability=_SYNC, load=TURN_LOAD, failure_route=RECORD_TURN_FAILURE,
                     execute_timeout_seconds=limit.timeout.total_seconds(),
                     heartbeat_timeout_seconds=RUN_MODEL_HEARTBEAT_TIMEOUT.total_seconds(),
                     execute_retry=RetryPolicy(max_attempts=limit.max_attempts,
                                               total_duration_seconds=limit.retry_budget.total_seconds()),
                 )),
            # RunModel's options and failure route; its movements list only the chunks it summarizes.
            Step(COMPACT_CONTEXT, CompactionSteps(runtime).compact_context, input_type=turn_input,
                 options=StepOptions(
                     durability=_SYNC, load=TURN_LOAD, failure_route=RECORD_TURN_FAILURE,
                     execute_timeout_seconds=limit.timeout.total_seconds(),
                     heartbeat_timeout_seconds=RUN_MODEL_HEARTBEAT_TIMEOUT.total_seconds(),
                     execute_retry=RetryPolicy(max_attempts=limit.max_attempts,
                                               total_duration_seconds=limit.retry_budget.total_seconds()),
                 )),
            Step(RECORD_TURN_FAILURE, turn.record_turn_failure, input_type=turn_input,
                 options=StepOptions(durability=_SYNC, load=TURN_LOAD, execute_retry=RECOVERY_RETRY)),
            Step(AWAIT_TOOL_APPROVAL, tools.await_tool_approval, input_type=str,
                 wait_for=tools.await_tool_approval_wait,
                 options=StepOptions(durability=_SYNC, load=LoadOptions.none(), execute_retry=RECOVERY_RETRY,
                                     wait_for_retry=RECOVERY_RETRY, execute_locks=(PENDING_INTERRUPTS,))),
            # A tool Step only reads its record and writes tool_call_started before the heartbeat
            # that must be durable before the tool runs (pure_until_heartbeat): the commit that
            # makes it ready, RunModel's, records that heartbeat too, one fsync fewer per tool turn.
            Step(CALL_TOOL, tools.call_tool, input_type=str,
                 options=StepOptions(durability=_SYNC, load=LoadOptions.none(), failure_route=RECORD_TOOL_FAILURE,
                                     execute_retry=RetryPolicy(max_attempts=CALL_TOOL_MAX_ATTEMPTS)),
                 pure_until_heartbeat=True),
            Step(CALL_SINGLE_ATTEMPT_TOOL, tools.call_single_attempt_tool, input_type=str,
                 options=StepOptions(durability=_SYNC, load=LoadOptions.none(),
                                     failure_route=RECORD_TOOL_OUTCOME_UNKNOWN,
                                     execute_retry=RetryPolicy(max_attempts=CALL_SINGLE_ATTEMPT_TOOL_MAX_ATTEMPTS)),
                 pure_until_heartbeat=True),
            Step(RECORD_TOOL_FAILURE, tools.record_tool_failure, input_type=str,
                 options=StepOptions(durability=_SYNC, load=tool_records, execute_retry=RECOVERY_RETRY)),
            Step(RECORD_TOOL_OUTCOME_UNKNOWN, tools.record_tool_outcome_unknown, input_type=str,
                 options=StepOptions(durability=_SYNC, load=tool_records, execute_retry=RECOVERY_RETRY)),
            # PollToolTask's movements narrow the load to the call's record and set the failure route
            # by effect (poll_tool_task_options); these are the fallbacks.
            Step(POLL_TOOL_TASK, tasks.poll_tool_task, input_type=str, wait_for=tasks.poll_tool_task_wait,
                 options=StepOptions(durability=_SYNC, load=POLL_TOOL_TASK_STEP_LOAD, failure_route=RECORD_TOOL_FAILURE,
                                     execute_retry=RetryPolicy(max_attempts=POLL_TOOL_TASK_MAX_ATTEMPTS),
                                     wait_for_retry=RECOVERY_RETRY)),
            Step(CANCEL_TOOL_TASK, tasks.cancel_tool_task, input_type=str,
                 options=StepOptions(durability=_SYNC, load=tool_records, failure_route=RECORD_TOOL_OUTCOME_UNKNOWN,
                                     execute_timeout_seconds=CANCEL_TOOL_TASK_TIMEOUT.total_seconds(),
                                     execute_retry=RetryPolicy(
                                         max_attempts=CANCEL_TOOL_TASK_MAX_ATTEMPTS,
                                         total_duration_seconds=CANCEL_TOOL_TASK_RETRY_BUDGET.total_seconds()))),
            Step(AWAIT_QUESTION_ANSWER, built_ins.await_question_answer, input_type=str,
                 wait_for=built_ins.await_question_answer_wait,
                 options=StepOptions(durability=_SYNC, load=LoadOptions.none(), execute_retry=RECOVERY_RETRY,
                                     wait_for_retry=RECOVERY_RETRY, execute_locks=(PENDING_INTERRUPTS,))),
            Step(AWAIT_TIMER, built_ins.await_timer, input_type=str, wait_for=built_ins.await_timer_wait,
                 options=StepOptions(durability=_SYNC, load=LoadOptions.none(), execute_retry=RECOVERY_RETRY,
                                     wait_for_retry=RECOVERY_RETRY)),
            Step(RESUME_TURN, tools.resume_turn, input_type=int, wait_for=tools.resume_turn_wait,
                 options=StepOptions(durability=_SYNC, wait_for_load=LoadOptions.none(),
                                     execute_load=LoadOptions.only(AGENT_TOOL_CALLS, PENDING_INTERRUPTS,
                                                                   *TURN_CONTROL_LOAD_EXTRA,
                                                                   *RUN_MODEL_MOVEMENT_LOAD_EXTRA),
                                     execute_retry=RECOVERY_RETRY, wait_for_retry=RECOVERY_RETRY,
                                     execute_locks=(PENDING_INTERRUPTS,)),
                 pure_execute=True),
            # Steering and cancel_turn (_control_steps.py). Both lock TurnCancellationRequest, so no
            # turn starts or ends while cancel_turn decides.
            Step(APPLY_TURN_CONTROL, control.apply_turn_control, input_type=None,
                 wait_for=control.apply_turn_control_wait,
                 options=StepOptions(durability=_SYNC, wait_for_load=LoadOptions.none(), execute_load=TURN_LOAD,
                                     execute_retry=RECOVERY_RETRY, wait_for_retry=RECOVERY_RETRY,
                                     execute_locks=(TURN_CANCELLATION_REQUEST,))),
            # FinishTurnCancellation loads the index and summary so that, after a cancelled model call,
            # its movement into ApplyTurnControl lists only the chunks after the summary.
            Step(FINISH_TURN_CANCELLATION, control.finish_turn_cancellation, input_type=str,
                 options=StepOptions(durability=_SYNC, execute_retry=RECOVERY_RETRY,
                                     load=LoadOptions.only(AGENT_TOOL_CALLS, PENDING_INTERRUPTS,
                                                           *TURN_CONTROL_LOAD_EXTRA,
                                                           *RUN_MODEL_MOVEMENT_LOAD_EXTRA),
                                     execute_locks=(TURN_CANCELLATION_REQUEST, PENDING_INTERRUPTS))),
        ]
        super().__init__(
            flow_type, steps, start_step=START_AGENT_SESSION, schema=session_schema(self.agent_events),
            rpcs=[*session_rpcs(plan_mode_enabled=options.plan_mode_enabled), *plan_rpcs(), *turn_control_rpcs()],
        )
