"""dex_agents.testing: a private engine, Worker child processes, gates, Step history, and
ScriptedModelClient (the built-in loop's) for tests."""

from dex_agents.builtin_loop import ScriptedModelClient

from ._gates import FileGate, InvocationLog
from ._history import EXECUTE_COMPLETED_EVENT, StepHistoryEntry, executed_steps, read_step_history, to_step_history
from ._scenario import ContextWindowSessionReport, ContextWindowSessionScenario, default_scenario_message
from ._stack import (
    DEFAULT_TEST_LEASE_TTL_SECONDS,
    ENV_DATABASE_URL,
    ENV_PARENT_PID,
    ENV_STATE_DIR,
    AgentTestStack,
    WorkerProcess,
    run_agent_worker,
)
from ._waiting import wait_for_agent_snapshot, wait_until

__all__ = [
    "DEFAULT_TEST_LEASE_TTL_SECONDS",
    "ENV_DATABASE_URL",
    "ENV_PARENT_PID",
    "ENV_STATE_DIR",
    "EXECUTE_COMPLETED_EVENT",
    "AgentTestStack",
    "ContextWindowSessionReport",
    "ContextWindowSessionScenario",
    "FileGate",
    "InvocationLog",
    "ScriptedModelClient",
    "StepHistoryEntry",
    "WorkerProcess",
    "default_scenario_message",
    "executed_steps",
    "read_step_history",
    "run_agent_worker",
    "to_step_history",
    "wait_for_agent_snapshot",
    "wait_until",
]
