"""The Flows of test_session_chaos.py: the scripted runner (scripted_agent.py) under two Flow types,
one storing nothing until a turn ends and one storing items as they appear, with a tool of each effect:

- `read_lookup`: READ (CallTool, retried);
- `idem_update`: IDEMPOTENT_WRITE (CallTool, retried with the same idempotency key);
- `write_direct`: NON_IDEMPOTENT_WRITE without approval (CallSingleAttemptTool);
- `write_refund`: NON_IDEMPOTENT_WRITE, approval required (its effect's default).

The test process and the Worker child (chaos_worker.py) build the same Flows.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

from agents.tests.scripted_agent import (
    ENV_START_GATE,
    IncrementalScriptedRunner,
    ScriptedRunner,
    state_dir_from_env,
    wait_for_start_gate,
)

from dex_agents import AgentSessionFlow, AgentSessionOptions, DeferredToolExecution, ToolEffect, ToolPolicy

FLOW_TYPE = "ChaosAgent"
INCREMENTAL_FLOW_TYPE = "ChaosAgentIncremental"
DEADLINE_FLOW_TYPE = "ChaosAgentDeadline"
# The approval deadline of DEADLINE_FLOW_TYPE's sessions: short, so it passes while the driver acts.
APPROVAL_DEADLINE = timedelta(seconds=2)
READ_TOOL = "read_lookup"
IDEMPOTENT_TOOL = "idem_update"
SINGLE_ATTEMPT_TOOL = "write_direct"
APPROVAL_TOOL = "write_refund"
TOOLS = (READ_TOOL, IDEMPOTENT_TOOL, SINGLE_ATTEMPT_TOOL, APPROVAL_TOOL)
TOOL_POLICIES = {SINGLE_ATTEMPT_TOOL: ToolPolicy(ToolEffect.NON_IDEMPOTENT_WRITE, requires_approval=False)}


class _AnswersLogged(ScriptedRunner):
    """Logs how many answers a tool run had: a tool that asks (`{"ask": ...}`) runs once to ask,
    taking no effect, and again with the answer."""

    def log_tool_start(self, call: DeferredToolExecution) -> None:
        record = call.tool_call
        if self.log is not None:
            self.log.record("tool_start", flow_id=call.flow_id, turn_id=record.turn_id,
                            tool_call_id=record.tool_call_id, tool_name=record.tool_name, attempt=call.attempt,
                            idempotency_key=call.idempotency_key, answers=len(call.input_answers))


class ChaosRunner(_AnswersLogged):
    pass


class IncrementalChaosRunner(_AnswersLogged, IncrementalScriptedRunner):
    pass


def build_flows(state_dir: Path | None = None) -> list[AgentSessionFlow]:
    """[the Flow that stores a turn's items when it ends, the one that stores them as they appear,
    the first with approvals that expire after APPROVAL_DEADLINE]."""
    state_dir = state_dir or state_dir_from_env()
    start_gate = os.environ.get(ENV_START_GATE)
    if start_gate:
        # A standby Worker child (standby_workers.py): imported, and registers only once released.
        if state_dir is None:
            raise RuntimeError(f"{ENV_START_GATE} needs the state directory")
        wait_for_start_gate(state_dir, start_gate)
    options = AgentSessionOptions(tool_policies=TOOL_POLICIES)
    deadline = AgentSessionOptions(tool_policies=TOOL_POLICIES, interrupt_deadline=APPROVAL_DEADLINE)
    return [AgentSessionFlow(ChaosRunner(state_dir), FLOW_TYPE, options),
            AgentSessionFlow(IncrementalChaosRunner(state_dir), INCREMENTAL_FLOW_TYPE, options),
            AgentSessionFlow(ChaosRunner(state_dir), DEADLINE_FLOW_TYPE, deadline)]
