"""The demo agent: the demo model, an order lookup (a read) and a refund (a write that needs approval)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from .._builtin_tools import BuiltInTool
from .._runner import ToolExecutionError
from .._session_flow import AgentSessionFlow
from .._wire import ToolEffect
from ..builtin_loop import AgentDefinition, ToolCallContext, builtin_agent_session_flow, function_tool
from ._model import demo_model

DEMO_FLOW_TYPE = "DemoAgent"
# Where refunds are written: a JSON-lines ledger outside the engine, the demo's "payment provider".
ENV_LEDGER = "DEX_AGENTS_DEMO_LEDGER"

ORDERS = {
    "A-1001": {"order_id": "A-1001", "item": "espresso grinder", "total_cents": 8900, "status": "delivered"},
    "A-1002": {"order_id": "A-1002", "item": "paper filters", "total_cents": 350, "status": "shipped"},
}


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
        tools=[lookup_order, refund_order],
        built_in_tools=frozenset({BuiltInTool.ASK_USER, BuiltInTool.DURABLE_WAIT}),
    )
    return builtin_agent_session_flow(definition, DEMO_FLOW_TYPE)
