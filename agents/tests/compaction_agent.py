"""The compaction tests' agent (agents/tests/test_compaction.py) and the Worker child of its kill test:
`python -m agents.tests.compaction_agent` from the repository root. Kept apart from the test module, so
the child imports no test framework and starts fast.

`compaction_flow` builds a built-in loop Flow with a CompactionPolicy and a scripted model; `answer` is its
usual script. `kill_test_flow` logs every model and summary call to the InvocationLog of the state
directory, and its first summary call waits at FileGate "summary", where the test kills the Worker.
"""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from agents.tests.builtin_agent import lookup_order

from dex_agents import AgentSessionFlow, CompactionPolicy
from dex_agents.builtin_loop import (
    AgentDefinition,
    BuiltinLoopAgentRunner,
    ModelRequest,
    ScriptedModelClient,
    ScriptedModelReply,
    ScriptedToolCall,
    builtin_agent_session_options,
)
from dex_agents.testing import ENV_STATE_DIR, FileGate, InvocationLog, run_agent_worker

FILLER = "please keep this in mind " * 4


def say(number: int) -> str:
    return f"turn {number}: {FILLER}"


def answer(request: ModelRequest) -> ScriptedModelReply:
    """Short answers; `/tools K` looks up K orders one response at a time (the count rides in the
    arguments, so it survives a compaction that summarized the user message)."""
    results = ScriptedModelClient.tool_results(request)
    if results:
        done, total = (int(part) for part in json.loads(results[-1].output)["order_id"].split("/"))
        if done < total:
            return ScriptedModelReply(tool_calls=[ScriptedToolCall(
                "lookup_order", {"order_id": f"{done + 1}/{total}"}, tool_call_id=f"c{done + 1}")])
        return ScriptedModelReply(text=f"looked up {total} orders")
    text = [t for t in ScriptedModelClient.user_texts(request) if not t.startswith("[Dex]")][-1]
    if text.startswith("/tools "):
        total = int(text.split()[1])
        return ScriptedModelReply(tool_calls=[ScriptedToolCall("lookup_order", {"order_id": f"1/{total}"},
                                                               tool_call_id="c1")])
    return ScriptedModelReply(text=f"noted {text.split(':')[0]}")


Summarize = Callable[[ModelRequest], str | Awaitable[str]]


def compaction_flow(
    flow_type: str, respond: Callable[[ModelRequest], Any], *, window: int, summarize: Summarize | None = None,
    runner: type[BuiltinLoopAgentRunner] = BuiltinLoopAgentRunner, **options: Any,
) -> tuple[AgentSessionFlow, ScriptedModelClient]:
    model = ScriptedModelClient(respond, summarize=summarize, max_recorded_requests=1000)
    definition = AgentDefinition(name="compaction-agent", model=model, instructions="You are a test agent.",
                                 tools=[lookup_order], compaction=CompactionPolicy(context_window_tokens=window))
    session_options = replace(builtin_agent_session_options(definition), **options)
    return AgentSessionFlow(runner(definition), flow_type, session_options), model


KILL_FLOW_TYPE = "KilledCompactionAgent"


def kill_test_flow(state_dir: Path | None = None) -> AgentSessionFlow:
    """The Worker child's agent: every model and summary call is logged; the first summary call waits at
    FileGate "summary", where the test kills the Worker."""
    directory = state_dir or Path(os.environ[ENV_STATE_DIR])
    log = InvocationLog(directory / "invocations.log")

    def respond(request: ModelRequest) -> ScriptedModelReply:
        text = [t for t in ScriptedModelClient.user_texts(request) if not t.startswith("[Dex]")][-1]
        log.record("model", text=text)
        return answer(request)

    async def summarize(request: ModelRequest) -> str:
        first = log.count("summary") == 0
        log.record("summary", inputs=len(request.input))
        if first:
            await FileGate(directory, "summary").wait_for_release()
        return ScriptedModelClient.default_summary(request)

    flow, _ = compaction_flow(KILL_FLOW_TYPE, respond, window=400, summarize=summarize)
    return flow


if __name__ == "__main__":
    run_agent_worker([kill_test_flow()])
