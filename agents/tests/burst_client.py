"""A client process of test_rpc_bursts.py: its own AsyncClients on the shared database, calling the
RPCs of one session all at once, as several web-server processes would.

`python -m agents.tests.burst_client <plan file>` from the repository root, with ENV_DATABASE_URL
and ENV_STATE_DIR set. The plan is a JSON object {"session": id, "start": path, "clients": [[op,
...], ...]}: one AsyncClient per inner list, whose ops all run concurrently once the start file
exists; the process creates `<plan file>.ready` once its clients are made. An op is ["resolve",
interrupt_id, approved], ["send", text], ["steer", text], ["cancel"] or ["snapshot"] (its result:
the sequences of the snapshot's messages). Every op's result, or its exception's type and text, is
recorded in the InvocationLog BURST_LOG of the state directory.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from agents.tests.scripted_agent import build_flow

from dex_agents import AgentSessionClient, AgentSessionFlow
from dex_agents.testing import ENV_DATABASE_URL, ENV_STATE_DIR, InvocationLog, wait_until
from dex_engine import AsyncClient, Registry

BURST_LOG = "burst.log"
# How often a client looks for the start file: all processes start their bursts within this.
START_POLL_SECONDS = 0.005
# How long a process waits for the test to create the start file.
START_WAIT_SECONDS = 60.0


async def _op(sessions: AgentSessionClient, session_id: str, op: list[Any]) -> Any:
    kind = op[0]
    if kind == "resolve":
        return await sessions.resolve_interrupt(session_id, op[1], op[2], None if op[2] else f"no from {op[1]}")
    if kind == "send":
        return await sessions.send_user_message(session_id, op[1])
    if kind == "steer":
        return await sessions.steer_user_message(session_id, text=op[1])
    if kind == "cancel":
        return await sessions.cancel_turn(session_id)
    if kind == "snapshot":
        return [m.sequence for m in (await sessions.get_agent_snapshot(session_id)).messages]
    raise ValueError(f"unknown burst op {op!r}; use resolve, send, steer, cancel or snapshot")


async def _run_client(name: str, ops: list[list[Any]], session_id: str, client: AsyncClient,
                      flow: AgentSessionFlow, log: InvocationLog, start: Path) -> None:
    sessions = AgentSessionClient(client, flow)

    async def run(op: list[Any]) -> None:
        try:
            result = await _op(sessions, session_id, op)
        except Exception as exc:  # recorded for the test to judge
            log.record("op", client=name, op=op, error=f"{type(exc).__name__}: {exc}")
            return
        log.record("op", client=name, op=op, result=result)

    try:
        await wait_until("the burst's start file", start.exists, timeout=START_WAIT_SECONDS,
                         interval=START_POLL_SECONDS)
        await asyncio.gather(*(run(op) for op in ops))
    finally:
        await client.close()


async def main(plan_path: Path, plan: dict[str, Any]) -> None:
    state_dir = Path(os.environ[ENV_STATE_DIR])
    flow = build_flow(state_dir)
    log = InvocationLog(state_dir / BURST_LOG)
    clients = [AsyncClient(Registry([flow]), os.environ[ENV_DATABASE_URL]) for _ in plan["clients"]]
    await asyncio.to_thread(ready_path(plan_path).touch)
    await asyncio.gather(*(
        _run_client(f"{plan_path.stem}-{n}", ops, plan["session"], client, flow, log, Path(plan["start"]))
        for n, (ops, client) in enumerate(zip(plan["clients"], clients, strict=True))))


def ready_path(plan_path: Path) -> Path:
    return plan_path.with_name(plan_path.name + ".ready")


if __name__ == "__main__":
    path = Path(sys.argv[1])
    asyncio.run(main(path, json.loads(path.read_text())))
