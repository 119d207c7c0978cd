"""The Worker child of the rollover kill tests (agents/tests/test_rollover_kills.py):
`python -m agents.tests.rollover_agent` from the repository root.

A built-in loop agent whose every commit that stores messages rolls the window over (window 4, chunks
of 2), that compacts (context window 400 tokens) and deletes summarized chunks (retained_message_limit
4). Every model and summary call is logged to the state directory's InvocationLog. The first summary
call waits at FileGate "summary"; a model call for a user message starting with "/gate" waits at
FileGate "model" until released (the test kills the Worker there instead).
"""

from __future__ import annotations

import os
from pathlib import Path

from agents.tests.compaction_agent import answer, compaction_flow

from dex_agents import AgentSessionFlow
from dex_agents.builtin_loop import ModelRequest, ScriptedModelClient, ScriptedModelReply
from dex_agents.testing import ENV_STATE_DIR, FileGate, InvocationLog, run_agent_worker

ROLLOVER_FLOW_TYPE = "RolloverAgent"
ROLLOVER_OPTIONS = {"message_window_size": 4, "message_chunk_size": 2, "retained_message_limit": 4}


def rollover_flow(state_dir: Path | None = None) -> AgentSessionFlow:
    directory = state_dir or Path(os.environ[ENV_STATE_DIR])
    log = InvocationLog(directory / "invocations.log")

    async def respond(request: ModelRequest) -> ScriptedModelReply:
        text = [t for t in ScriptedModelClient.user_texts(request) if not t.startswith("[Dex]")][-1]
        log.record("model", text=text)
        if text.startswith("/gate") and not ScriptedModelClient.tool_results(request):
            await FileGate(directory, "model").wait_for_release()
        return answer(request)

    async def summarize(request: ModelRequest) -> str:
        first = log.count("summary") == 0
        log.record("summary", inputs=len(request.input))
        if first:
            await FileGate(directory, "summary").wait_for_release()
        return ScriptedModelClient.default_summary(request)

    flow, _ = compaction_flow(ROLLOVER_FLOW_TYPE, respond, window=400, summarize=summarize, **ROLLOVER_OPTIONS)
    return flow


if __name__ == "__main__":
    run_agent_worker([rollover_flow()])
