"""Attempts of a tool Step (seed 003, "`execute_deferred_tool_call(call)`"), through Worker children.

- ToolOutcomeUnknownError records outcome_unknown after a single run, for CallTool and
  CallSingleAttemptTool alike, and the session goes on;
- a CallTool attempt killed after save_heartbeat_checkpoint is retried with that checkpoint as
  heartbeat_checkpoint, and both attempts get the same idempotency key.

The Worker children run this module (`python -m agents.tests.test_tool_step_attempts`), so they
play the same CheckpointRunner as the test's Flow: the scripted runner plus a tool that saves a
heartbeat checkpoint before it waits at a FileGate.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from agents.tests.conftest import REPO_ROOT
from agents.tests.scripted_agent import FLOW_TYPE, INVOCATIONS, ScriptedRunner, state_dir_from_env
from agents.tests.session_driver import script, turns_ended

from dex_agents import (
    AgentSessionClient,
    AgentSessionFlow,
    AgentSessionOptions,
    DeferredToolExecution,
    MessageRole,
    ToolExecutionResult,
    ToolInputRequested,
    ToolTaskStarted,
)
from dex_agents.testing import (
    EXECUTE_COMPLETED_EVENT,
    AgentTestStack,
    FileGate,
    InvocationLog,
    executed_steps,
    run_agent_worker,
    wait_for_agent_snapshot,
)

WORKER_MODULE = "agents.tests.test_tool_step_attempts"
SESSION = "s"

# Seed 002, "Model-visible results": what the model reads for an outcome_unknown record.
OUTCOME_UNKNOWN_RESULT = (
    "The tool call's outcome is unknown: it stopped without returning a result, so it may or may not "
    "have taken effect. It will not be retried automatically."
)


class CheckpointRunner(ScriptedRunner):
    """Tool args `{"checkpoint": text, "gate": name}` start a job: log what the attempt was given,
    resume a job an earlier attempt saved, or else save `text` as the checkpoint and wait at the gate."""

    async def execute_deferred_tool_call(
        self, call: DeferredToolExecution
    ) -> ToolExecutionResult | ToolInputRequested | ToolTaskStarted:
        args = json.loads(call.tool_call.arguments)
        if "checkpoint" not in args:
            return await super().execute_deferred_tool_call(call)
        assert self.log is not None
        self.log.record("job", flow_id=call.flow_id, attempt=call.attempt, idempotency_key=call.idempotency_key,
                        heartbeat_checkpoint=call.heartbeat_checkpoint)
        if call.heartbeat_checkpoint is not None:
            return ToolExecutionResult(f"resumed {call.heartbeat_checkpoint}")
        await call.save_heartbeat_checkpoint(args["checkpoint"])
        await self._gate(args["gate"]).wait_for_release()
        return ToolExecutionResult(f"started {args['checkpoint']}")


def build_flow(state_dir: Path | None) -> AgentSessionFlow:
    return AgentSessionFlow(CheckpointRunner(state_dir), FLOW_TYPE, AgentSessionOptions())


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[AgentTestStack]:
    """conftest's stack, with CheckpointRunner on both sides: in this process and in the Worker children."""
    async with AgentTestStack(tmp_path, [build_flow(tmp_path)], WORKER_MODULE, worker_cwd=REPO_ROOT) as s:
        yield s


def sessions_of(stack: AgentTestStack) -> AgentSessionClient:
    return stack.sessions(build_flow(stack.state_dir))


@pytest.mark.parametrize(("tool_name", "tool_step"), [
    ("read_orders", "CallTool"), ("idem_update", "CallTool"), ("write_refund", "CallSingleAttemptTool"),
])
async def test_outcome_unknown_error_is_recorded_after_one_run(
    stack: AgentTestStack, tool_name: str, tool_step: str
) -> None:
    """A tool that cannot tell whether its write took effect runs once, and the model is told so."""
    sessions = sessions_of(stack)
    await stack.start_worker()
    message = "sent the update; no reply from the ledger"
    await sessions.start_session(SESSION, script(
        {"tools": [{"id": "c1", "name": tool_name, "args": {"unknown": message}}]}, {"answer": "{records}"},
    ))
    if tool_step == "CallSingleAttemptTool":  # writes need approval by default
        await wait_for_agent_snapshot(sessions, SESSION, lambda s: s.pending_interrupts, description="approval")
        assert await sessions.resolve_interrupt(SESSION, "c1", approved=True)
    snapshot = await turns_ended(sessions, SESSION, 1)

    record = json.loads(snapshot.messages[-1].text or "")["c1"]
    assert (record["status"], record["error"]) == ("outcome_unknown", message)
    tool_message = next(m for m in snapshot.messages if m.role is MessageRole.TOOL)
    assert tool_message.tool_output == OUTCOME_UNKNOWN_RESULT
    log = InvocationLog(stack.state_dir / INVOCATIONS)
    assert log.count("tool_start", flow_id=SESSION, tool_call_id="c1") == 1
    history = await stack.read_step_history(SESSION)
    approval = ["AwaitToolApproval"] if tool_step == "CallSingleAttemptTool" else []
    assert executed_steps(history) == ["StartAgentSession", "RunModel", *approval, tool_step, "ResumeTurn", "RunModel"]
    # Not a Step failure: the tool Step's one attempt completed, and none failed.
    assert [(e.event_type, e.final_attempt) for e in history if e.step_type == tool_step
            and e.event_type in {EXECUTE_COMPLETED_EVENT, "attempt_failed"}] == [(EXECUTE_COMPLETED_EVENT, 1)]

    assert await sessions.send_user_message(SESSION, "hello")
    after = await turns_ended(sessions, SESSION, 2)
    assert after.state is not None and after.state.last_turn_error is None
    assert after.messages[-1].text == "echo: hello"


async def test_a_killed_call_tool_attempt_is_retried_with_its_checkpoint_and_key(stack: AgentTestStack) -> None:
    """A retried CallTool attempt resumes from the killed attempt's saved checkpoint, under the same idempotency key."""
    sessions = sessions_of(stack)
    worker = await stack.start_worker()
    await sessions.start_session(SESSION, script(
        {"tools": [{"id": "c1", "name": "idem_export", "args": {"checkpoint": "job-7", "gate": "export"}}]},
        {"answer": "{results}"},
    ))
    gate = FileGate(stack.state_dir, "export")
    assert await gate.wait_until_reached() == worker.pid  # the checkpoint was saved just before
    worker.kill()
    await stack.start_worker()
    gate.release()  # a retry that missed the checkpoint would start the job again and finish it
    snapshot = await turns_ended(sessions, SESSION, 1)

    jobs = InvocationLog(stack.state_dir / INVOCATIONS).entries("job", flow_id=SESSION)
    assert [(j["attempt"], j["heartbeat_checkpoint"]) for j in jobs] == [(1, None), (2, "job-7")]
    assert [j["idempotency_key"] for j in jobs] == [f"{SESSION}/turn-1/c1"] * 2
    assert snapshot.messages[-1].text == "c1=resumed job-7"
    history = await stack.read_step_history(SESSION)
    assert [(e.event_type, e.final_attempt) for e in history if e.step_type == "CallTool"
            and e.event_type in {EXECUTE_COMPLETED_EVENT, "attempt_failed"}] == [
        ("attempt_failed", 1), (EXECUTE_COMPLETED_EVENT, 2),
    ]


if __name__ == "__main__":
    run_agent_worker([build_flow(state_dir_from_env())])
