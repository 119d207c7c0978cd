"""Built-in loop agents for the tests, and an in-process engine to run them on.

`scripted_flow` builds a builtin_loop Flow from a reply function; `InProcessEngine` runs a Worker
and a Client on a SQLite file in one process (for tests that need no kill). The Worker child of the
kill test (`python -m agents.tests.builtin_worker`) builds `gated_flow`, whose model waits at a
FileGate named by the user text `/gate NAME` and logs every model call to the InvocationLog.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

from dex_agents import AgentSessionClient, AgentSessionFlow, ToolEffect
from dex_agents.builtin_loop import (
    AgentDefinition,
    ModelRequest,
    ScriptedModelClient,
    ScriptedModelReply,
    ScriptedToolCall,
    builtin_agent_session_flow,
    function_tool,
)
from dex_agents.testing import ENV_STATE_DIR, FileGate, InvocationLog
from dex_engine import AsyncClient, AsyncWorker, Registry, WorkerOptions

FAST_WORKER = {"poll_seconds": 0.01, "housekeeping_seconds": 0.05}


class InProcessEngine:
    """An engine database in `tmp_path` (or at `url`), one in-process Worker, and a Client, for the Flows given."""

    def __init__(
        self, tmp_path: Path, flows: Sequence[AgentSessionFlow], url: str | None = None, **worker_options: Any
    ) -> None:
        self.url = url or f"sqlite:///{tmp_path / 'engine.db'}"  # `url`: another database, PostgreSQL's say
        registry = Registry(list(flows))
        self.client = AsyncClient(registry, self.url)
        self.worker = AsyncWorker(registry, WorkerOptions(database_url=self.url, **{**FAST_WORKER, **worker_options}))
        self.flows = list(flows)
        self._task: asyncio.Task[None] | None = None

    def sessions(self, flow: AgentSessionFlow | None = None) -> AgentSessionClient:
        return AgentSessionClient(self.client, flow or self.flows[0])

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[InProcessEngine]:
        self._task = asyncio.create_task(self.worker.run())
        try:
            yield self
        finally:
            await self.worker.stop()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            await self.client.close()


@function_tool(effect=ToolEffect.READ)
async def lookup_order(order_id: str) -> dict[str, str]:
    """Look up an order."""
    return {"order_id": order_id, "status": "shipped"}


@function_tool(effect=ToolEffect.NON_IDEMPOTENT_WRITE)
def refund_order(order_id: str, amount_cents: int) -> str:
    """Refund an order (sync: runs in a worker thread)."""
    return f"refunded {amount_cents} on {order_id}"


def scripted_flow(
    respond: Callable[[ModelRequest], ScriptedModelReply], flow_type: str = "BuiltinAgent", **definition: Any
) -> tuple[AgentSessionFlow, ScriptedModelClient]:
    model = ScriptedModelClient(respond)
    fields: dict[str, Any] = {"instructions": "You are a test agent.", "tools": [lookup_order, refund_order]}
    fields.update(definition)
    agent = AgentDefinition(name="test-agent", model=model, **fields)
    return builtin_agent_session_flow(agent, flow_type), model


def tool_then_answer(request: ModelRequest) -> ScriptedModelReply:
    """`/tool NAME {json}` calls the tool, then answers with its results; other text is echoed."""
    results = ScriptedModelClient.tool_results(request)
    if results:
        return ScriptedModelReply(text="results: " + "; ".join(f"{r.tool_name}={r.output}" for r in results))
    text = ScriptedModelClient.user_texts(request)[-1]
    if text.startswith("/tool "):
        _, name, arguments = text.split(" ", 2)
        return ScriptedModelReply(text="calling", tool_calls=[ScriptedToolCall(name, arguments)])
    return ScriptedModelReply(text=f"echo: {text}")


def gated_flow(state_dir: Path | None = None) -> AgentSessionFlow:
    """The kill test's agent: `/gate NAME` makes the model call wait at FileGate NAME, then answer;
    `/hang` calls `hang_write`, a sync write that reaches FileGate `hang` and then never returns."""
    directory = state_dir or Path(os.environ[ENV_STATE_DIR])
    log = InvocationLog(directory / "invocations.log")

    @function_tool(effect=ToolEffect.NON_IDEMPOTENT_WRITE, requires_approval=False)
    def hang_write() -> str:
        """A write that never returns (sync: it blocks its thread for good)."""
        log.record("hang_write")
        FileGate(directory, "hang").mark_reached()
        threading.Event().wait()
        return "never"

    async def respond(request: ModelRequest) -> ScriptedModelReply:
        text = ScriptedModelClient.user_texts(request)[-1]
        log.record("model_call", text=text, inputs=len(request.input))
        if ScriptedModelClient.tool_results(request):
            return ScriptedModelReply(text="after the tool")
        if text.startswith("/gate "):
            await FileGate(directory, text.split(" ", 1)[1]).wait_for_release()
            return ScriptedModelReply(text="released")
        if text == "/tool":
            return ScriptedModelReply(tool_calls=[ScriptedToolCall("lookup_order", {"order_id": "A-1"})])
        if text == "/hang":
            return ScriptedModelReply(tool_calls=[ScriptedToolCall("hang_write", {})])
        return ScriptedModelReply(text=f"echo: {text}")

    flow, _ = scripted_flow(respond, "GatedBuiltinAgent", tools=[lookup_order, refund_order, hang_write])
    return flow
