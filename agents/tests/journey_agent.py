"""An adapter written from docs/agents.md alone, for an invented framework (test_adapter_author_journey.py).

`ScriptBot` is the "framework": given its own message dicts and tool names it decides, from a script
keyed by the turn's user text, either a final answer or tool calls; no network. `ScriptBotRunner` is
the dex_agents adapter, using only `dex_agents` and `dex_agents.testing` public names. It stores
items as they appear (ToolCallsRequested.new_messages), so it implements
build_unfinished_turn_messages; it also compacts, polls tool tasks, and gives calls their own Step
options. The Worker child is agents/tests/journey_worker.py.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from dex_agents import (
    AgentFrameworkRunner,
    AgentSessionFlow,
    AgentSessionOptions,
    AgentTurnContext,
    AgentTurnOutcome,
    AgentUsage,
    CompactionPolicy,
    ContextSummaryRequest,
    ContextSummaryResult,
    DeferredToolCall,
    DeferredToolExecution,
    DeferredToolOutcome,
    FrameworkMessage,
    MessageRole,
    ToolCallsRequested,
    ToolCallStepOptions,
    ToolEffect,
    ToolExecutionError,
    ToolExecutionResult,
    ToolPolicy,
    ToolTaskCancellation,
    ToolTaskPending,
    ToolTaskPoll,
    ToolTaskPollOutcome,
    ToolTaskStarted,
    TurnCompleted,
    TurnContinued,
    build_context_summary_prompt,
    describe_tool_call_outcome,
    estimate_stored_input_tokens,
    select_turn_boundary_cutoff,
)
from dex_agents.testing import ENV_STATE_DIR, FileGate, InvocationLog

FLOW_TYPE = "JourneyAgent"
COMPACTING_FLOW_TYPE = "JourneyCompactingAgent"
AWAITED_ESTIMATE_FLOW_TYPE = "JourneyAwaitedEstimateAgent"
TOOLS: dict[str, ToolEffect] = {
    "lookup_order": ToolEffect.READ,
    "lookup_customer": ToolEffect.READ,
    "refund_order": ToolEffect.NON_IDEMPOTENT_WRITE,
    "build_report": ToolEffect.READ,
}
# Gate names a tool stops at when the test process created "<name>.armed" in the state dir.
REFUND_GATE = "refund"
LOOKUP_GATE = "lookup"
REPORT_TASK_SECONDS = 1.0
LOOKUP_TIMEOUT = timedelta(seconds=30)


def state_dir() -> Path:
    return Path(os.environ[ENV_STATE_DIR])


def log() -> InvocationLog:
    return InvocationLog(state_dir() / "invocations.jsonl")


async def gate_if_armed(name: str) -> None:
    if (state_dir() / f"{name}.armed").exists():
        await FileGate(state_dir(), name).wait_for_release()


# The framework ------------------------------------------------------------------------------------------


class ScriptBot:
    """The invented framework: one "model call" reads the conversation and decides the next step."""

    def decide(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        user = next(i["content"] for i in reversed(items) if i["type"] == "user")
        since_user = items[max(i for i, item in enumerate(items) if item["type"] == "user") + 1:]
        results = {i["call_id"]: i["output"] for i in since_user if i["type"] == "tool_result"}
        asked = [i for i in since_user if i["type"] == "tool_calls"]
        if user.startswith("refund "):
            if not asked:
                return {"calls": [{"id": "r1", "name": "refund_order", "args": {"order": user.split()[1]}}]}
            return {"answer": f"refund: {results['r1']}"}
        if user == "lookup":
            if not asked:
                return {"calls": [{"id": "a", "name": "lookup_order", "args": {"order": "7"}},
                                  {"id": "b", "name": "lookup_customer", "args": {"customer": "c9"}}]}
            return {"answer": f"order={results['a']} customer={results['b']}"}
        if user == "report":
            if not asked:
                return {"calls": [{"id": "t1", "name": "build_report", "args": {"topic": "q3"}}]}
            return {"answer": f"report: {results['t1']}"}
        if user == "think":
            if not any(i["type"] == "thought" for i in since_user):
                return {"thought": "let me think"}
            return {"answer": "thought it through"}
        return {"answer": f"echo: {user}"}


# The adapter --------------------------------------------------------------------------------------------


def _item(message_framework_item: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(message_framework_item)
    return loaded


def _usage() -> AgentUsage:
    return AgentUsage(model_calls=1, input_tokens=10, output_tokens=5)


class ScriptBotRunner(AgentFrameworkRunner[DeferredToolOutcome]):
    """The adapter: a pending tool-call step is the run state; tool results come from the records."""

    def __init__(self, bot: ScriptBot | None = None) -> None:
        self.bot = bot or ScriptBot()

    # Required ------------------------------------------------------------------------------------------

    def build_user_message(self, text: str) -> FrameworkMessage:
        return FrameworkMessage(MessageRole.USER, json.dumps({"type": "user", "content": text}), text=text)

    async def run_model_step(self, turn: AgentTurnContext) -> AgentTurnOutcome:
        items = self._framework_input(turn)
        unstored = self._pending_results(turn)  # tool results the session has not stored yet
        log().record("model", turn_id=turn.turn_id, attempt=turn.attempt)
        decision = self.bot.decide(items + [_item(m.framework_item) for m in unstored])
        if "calls" in decision:
            calls = [
                DeferredToolCall(c["id"], c["name"], json.dumps(c["args"]), turn.resolve_tool_policy(c["name"]))
                for c in decision["calls"]
            ]
            asked_item = json.dumps({"type": "tool_calls", "calls": decision["calls"]})
            asked = FrameworkMessage(MessageRole.ASSISTANT, asked_item)
            run_state = json.dumps({"pending": [c["id"] for c in decision["calls"]]})
            return ToolCallsRequested(run_state, calls, _usage(), new_messages=[*unstored, asked])
        if "thought" in decision:
            thought_item = json.dumps({"type": "thought", "text": decision["thought"]})
            thought = FrameworkMessage(MessageRole.ASSISTANT, thought_item, text=decision["thought"])
            return TurnContinued(json.dumps({"pending": []}), [*unstored, thought], _usage())
        answer = decision["answer"]
        final = FrameworkMessage(MessageRole.ASSISTANT, json.dumps({"type": "answer", "content": answer}), text=answer)
        return TurnCompleted([*unstored, final], _usage())

    async def execute_deferred_tool_call(self, call: DeferredToolExecution) -> DeferredToolOutcome:
        record = call.tool_call
        args = json.loads(record.arguments)
        log().record("tool", tool_call_id=record.tool_call_id, attempt=call.attempt, key=call.idempotency_key)
        if record.tool_name == "refund_order":
            await gate_if_armed(REFUND_GATE)
            return ToolExecutionResult(f"refunded order {args['order']}")
        if record.tool_name == "lookup_order":
            await gate_if_armed(LOOKUP_GATE)
            return ToolExecutionResult(f"order {args['order']} shipped")
        if record.tool_name == "lookup_customer":
            return ToolExecutionResult(f"customer {args['customer']} is gold")
        if record.tool_name == "build_report":
            saved = call.heartbeat_checkpoint
            if saved is None:
                saved = f"job-{time.time():.3f}"  # the remote job's handle: it is done REPORT_TASK_SECONDS later
                await call.save_heartbeat_checkpoint(saved)
            return ToolTaskStarted(task_id=saved, poll_interval_seconds=1)
        raise ToolExecutionError(f"unknown tool {record.tool_name!r}")

    # Optional ------------------------------------------------------------------------------------------

    def build_unfinished_turn_messages(self, turn: AgentTurnContext) -> Sequence[FrameworkMessage]:
        return self._pending_results(turn)

    def tool_call_step_options(self, call: DeferredToolCall) -> ToolCallStepOptions | None:
        return ToolCallStepOptions(timeout=LOOKUP_TIMEOUT) if call.tool_name.startswith("lookup_") else None

    async def poll_tool_task(self, poll: ToolTaskPoll) -> ToolTaskPollOutcome:
        task_id = poll.tool_call.task_id
        assert task_id is not None
        log().record("poll", tool_call_id=poll.tool_call.tool_call_id, attempt=poll.attempt)
        if time.time() < float(task_id.removeprefix("job-")) + REPORT_TASK_SECONDS:
            return ToolTaskPending(poll_interval_seconds=1)
        return ToolExecutionResult(f"{task_id} done")

    async def cancel_tool_task(self, cancellation: ToolTaskCancellation) -> None:
        log().record("cancel_task", task_id=cancellation.tool_call.task_id)

    def estimate_input_tokens(self, turn: AgentTurnContext) -> int:
        return estimate_stored_input_tokens(turn)

    def select_compaction_cutoff(self, turn: AgentTurnContext, retained_token_budget: int) -> int | None:
        return select_turn_boundary_cutoff(turn, retained_token_budget)

    async def summarize_context(self, request: ContextSummaryRequest) -> ContextSummaryResult:
        prompt = build_context_summary_prompt(request)
        log().record("summary", through=request.through_sequence)
        # The prompt holds the previous summary too, so its code words are kept without adding it again.
        words = dict.fromkeys(w.rstrip(".") for w in prompt.split() if w.startswith("ORCHID-"))
        return ContextSummaryResult(" ".join(words) or "nothing yet", _usage())

    # Helpers -------------------------------------------------------------------------------------------

    def _framework_input(self, turn: AgentTurnContext) -> list[dict[str, Any]]:
        items = [_item(m.framework_item) for m in turn.messages]
        if turn.context_summary is not None:
            items.insert(0, {"type": "summary", "content": turn.context_summary.text})
        return items

    def _pending_results(self, turn: AgentTurnContext) -> list[FrameworkMessage]:
        """The results of the calls the run state waits for, from their final records."""
        if turn.framework_run_state is None:
            return []
        out = []
        for call_id in json.loads(turn.framework_run_state)["pending"]:
            record = turn.recorded_tool_call(call_id)
            output = describe_tool_call_outcome(record)
            out.append(FrameworkMessage(
                MessageRole.TOOL, json.dumps({"type": "tool_result", "call_id": call_id, "output": output}),
                tool_call_id=call_id, tool_name=record.tool_name, tool_output=output,
            ))
        return out


class AwaitedEstimateRunner(ScriptBotRunner):
    """The same adapter with its compaction answers from coroutines (a framework whose token counter
    is async), which RunModel awaits."""

    async def estimate_input_tokens(self, turn: AgentTurnContext) -> int:  # type: ignore[override]
        return estimate_stored_input_tokens(turn)

    async def select_compaction_cutoff(  # type: ignore[override]
        self, turn: AgentTurnContext, retained_token_budget: int
    ) -> int | None:
        return select_turn_boundary_cutoff(turn, retained_token_budget)


def build_flow(*, compaction: CompactionPolicy | None = None, flow_type: str = FLOW_TYPE,
               runner: ScriptBotRunner | None = None) -> AgentSessionFlow:
    policies = {name: ToolPolicy(effect) for name, effect in TOOLS.items()}
    options = AgentSessionOptions(tool_policies=policies)
    if compaction is not None:
        options = AgentSessionOptions(tool_policies=policies, compaction=compaction, retained_message_limit=20,
                                      message_window_size=8, message_chunk_size=4)
    return AgentSessionFlow(runner or ScriptBotRunner(), flow_type=flow_type, options=options)


COMPACTION = CompactionPolicy(context_window_tokens=2_000)


def build_flows() -> list[AgentSessionFlow]:
    return [
        build_flow(),
        build_flow(compaction=COMPACTION, flow_type=COMPACTING_FLOW_TYPE),
        build_flow(compaction=COMPACTION, flow_type=AWAITED_ESTIMATE_FLOW_TYPE, runner=AwaitedEstimateRunner()),
    ]
