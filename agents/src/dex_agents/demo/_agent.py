"""The demo agent: the demo model, an order lookup (a read), a refund (a write that needs approval), and
a report built as a tool task that the session polls (build_report).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .._builtin_tools import BuiltInTool
from .._runner import (
    DeferredToolExecution,
    ToolExecutionError,
    ToolExecutionResult,
    ToolTaskPending,
    ToolTaskPoll,
    ToolTaskPollOutcome,
    ToolTaskStarted,
)
from .._session_flow import AgentSessionFlow
from .._wire import ToolEffect
from ..builtin_loop import (
    AgentDefinition,
    BuiltinLoopAgentRunner,
    ToolCallContext,
    builtin_agent_session_options,
    function_tool,
)
from ._model import demo_model

DEMO_FLOW_TYPE = "DemoAgent"
# Where refunds are written: a JSON-lines ledger outside the engine, the demo's "payment provider".
ENV_LEDGER = "DEX_AGENTS_DEMO_LEDGER"

ORDERS = {
    "A-1001": {"order_id": "A-1001", "item": "espresso grinder", "total_cents": 8900, "status": "delivered"},
    "A-1002": {"order_id": "A-1002", "item": "paper filters", "total_cents": 350, "status": "shipped"},
}


# build_report's task is ready on this poll; the polls count in the call's input_continuation.
REPORT_READY_AFTER_POLLS = 2
REPORT_POLL_INTERVAL_SECONDS = 1


@function_tool(effect=ToolEffect.READ)
def build_report(topic: str) -> str:
    """Build a short report on a topic (orders, refunds, ...). It runs as a background task."""
    return _report(topic)


def _report(topic: str) -> str:
    return f"report on {topic}: {len(ORDERS)} orders, {sum(int(str(o['total_cents'])) for o in ORDERS.values())} cents"


class DemoAgentRunner(BuiltinLoopAgentRunner):
    """The built-in loop plus the demo's task: build_report starts a task the session polls (a tool
    task, PollToolTask), ready after REPORT_READY_AFTER_POLLS polls. Stateless: the task ID is the
    call's idempotency key, and the polls so far are the call's input_continuation."""

    async def execute_deferred_tool_call(self, call: DeferredToolExecution) -> Any:
        if call.tool_call.tool_name != build_report.name or not call.supports_tool_tasks:
            return await super().execute_deferred_tool_call(call)
        topic = json.loads(call.tool_call.arguments).get("topic")
        if not isinstance(topic, str) or not topic.strip():
            raise ToolExecutionError("invalid arguments for build_report: topic must be non-empty text")
        return ToolTaskStarted(task_id=f"report:{call.idempotency_key}",
                               poll_interval_seconds=REPORT_POLL_INTERVAL_SECONDS)

    async def poll_tool_task(self, poll: ToolTaskPoll) -> ToolTaskPollOutcome:
        if poll.tool_call.tool_name != build_report.name:
            return await super().poll_tool_task(poll)  # a tool source's task
        polls = int(poll.tool_call.input_continuation or "0") + 1
        if polls < REPORT_READY_AFTER_POLLS:
            return ToolTaskPending(poll_interval_seconds=REPORT_POLL_INTERVAL_SECONDS, continuation=str(polls))
        topic = json.loads(poll.tool_call.arguments)["topic"]
        return ToolExecutionResult(f"{_report(topic)} (ready after {polls} polls)")


def read_ledger(path: Path) -> list[dict[str, object]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def build_demo_flow(ledger_path: Path | None = None) -> AgentSessionFlow:
    """The demo agent's session Flow; refunds go to `ledger_path` (or $DEX_AGENTS_DEMO_LEDGER)."""
    ledger = ledger_path or Path(os.environ.get(ENV_LEDGER, ".dex/demo-ledger.jsonl"))

    @function_tool(effect=ToolEffect.READ)
    async def lookup_order(order_id: str) -> dict[str, object]:
        """Look up an order by its ID, e.g. A-1001."""
        order = ORDERS.get(order_id)
        if order is None:
            raise ToolExecutionError(f"there is no order {order_id}; known orders: {', '.join(ORDERS)}")
        return order

    @function_tool(effect=ToolEffect.NON_IDEMPOTENT_WRITE)
    def refund_order(order_id: str, amount_cents: int, context: ToolCallContext) -> str:
        """Refund part of an order. Runs at most once, after a person approves it."""
        if order_id not in ORDERS:
            raise ToolExecutionError(f"there is no order {order_id}")
        if amount_cents <= 0:
            raise ToolExecutionError(f"amount_cents must be positive, got {amount_cents}")
        entry = {"order_id": order_id, "amount_cents": amount_cents, "idempotency_key": context.idempotency_key}
        ledger.parent.mkdir(parents=True, exist_ok=True)
        with ledger.open("a") as f:
            f.write(json.dumps(entry) + "\n")
            f.flush()
            os.fsync(f.fileno())
        return f"refunded {amount_cents} cents on order {order_id}"

    definition = AgentDefinition(
        name="demo",
        instructions="You are the Dex demo agent. You look up orders and refund them.",
        model=demo_model(),
        tools=[lookup_order, refund_order, build_report],
        built_in_tools=frozenset({BuiltInTool.ASK_USER, BuiltInTool.DURABLE_WAIT}),
        plan_mode_enabled=True,  # /plan writes a draft (write_todos) that the chat offers to execute
    )
    return AgentSessionFlow(DemoAgentRunner(definition), DEMO_FLOW_TYPE, builtin_agent_session_options(definition))
