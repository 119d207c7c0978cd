"""A client process of test_sqlite_deployment.py, as a web-server process would be: its own
AsyncClient on the shared SQLite file, calling the session RPCs of random sessions until the test
creates the stop file (or SIGKILLs it).

`python -m agents.tests.storm_client <number> <seed> <session id>...` from the repository root, with
ENV_DATABASE_URL and ENV_STATE_DIR set. Every call is recorded in the InvocationLog CALLS of the
state directory before it starts and after it returns (its result, or its exception's type and
text), so the test knows which calls were acknowledged, which failed, and which a kill cut short.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
from pathlib import Path
from typing import Any

from agents.tests.scripted_agent import build_flow

from dex_agents import AgentSessionClient
from dex_agents.testing import ENV_DATABASE_URL, ENV_STATE_DIR, InvocationLog
from dex_engine import AsyncClient, Registry

CALLS = "calls.log"
STOP_FILE = "storm.stop"
APPROVAL_SEARCH = 'ActiveStepTypes = "AwaitToolApproval"'
# The share of each call kind (send: an echo turn; tools: a turn with a read and an approved write).
CALL_WEIGHTS = {"send": 3, "tools": 2, "resolve": 4, "cancel": 0.5, "steer": 1, "snapshot": 2, "list": 1}
PAUSE_SECONDS = (0.0, 0.03)
APPROVE_SHARE = 0.7


def tools_script(tag: str) -> str:
    """A turn that reads, then asks for an approved non-idempotent write; its answer records both."""
    calls = [{"id": f"r-{tag}", "name": "read_orders", "args": {}},
             {"id": f"w-{tag}", "name": "write_refund", "args": {"sleep": 0.05}}]
    return json.dumps({"tag": tag, "steps": [{"tools": calls}, {"answer": "{records}"}]})


class Caller:
    def __init__(self, number: int, sessions: AgentSessionClient, log: InvocationLog) -> None:
        self.number = number
        self.sessions = sessions
        self.log = log
        self.calls = 0

    async def call(self, op: str, session_id: str, run: Any, **fields: Any) -> Any:
        self.calls += 1
        entry = {"client": self.number, "call": self.calls, "op": op, "session": session_id, **fields}
        self.log.record("start", **entry)
        try:
            result = await run
        except Exception as exc:  # recorded for the test to judge; the storm goes on
            self.log.record("end", **entry, error=f"{type(exc).__module__}.{type(exc).__name__}: {exc}")
            return None
        self.log.record("end", **entry, result=result if isinstance(result, (bool, int, str)) else None)
        return result


async def storm(number: int, seed: int, session_ids: list[str], state_dir: Path, url: str) -> None:
    rng = random.Random(seed)
    flow = build_flow(state_dir)
    client = AsyncClient(Registry([flow]), url)
    sessions = AgentSessionClient(client, flow)
    caller = Caller(number, sessions, InvocationLog(state_dir / CALLS))
    stop = state_dir / STOP_FILE
    kinds, weights = list(CALL_WEIGHTS), list(CALL_WEIGHTS.values())
    sent = 0
    try:
        while not stop.exists():
            kind = rng.choices(kinds, weights)[0]
            session_id = rng.choice(session_ids)
            if kind in ("send", "tools", "steer"):
                sent += 1
                tag = f"c{number}-{'s' if kind == 'steer' else 'm'}{sent}"
                text = tools_script(tag) if kind == "tools" else tag
                run = (sessions.steer_user_message(session_id, text=text) if kind == "steer"
                       else sessions.send_user_message(session_id, text))
                await caller.call(kind, session_id, run, tag=tag)
            elif kind == "resolve":
                found = await caller.call("search", "", client.search_flows(APPROVAL_SEARCH))
                if found:
                    target = rng.choice(found)
                    snapshot = await caller.call("snapshot", target, sessions.get_agent_snapshot(target))
                    if snapshot is not None and snapshot.pending_interrupts:
                        interrupt = rng.choice(snapshot.pending_interrupts)
                        approved = rng.random() < APPROVE_SHARE
                        await caller.call("resolve", target, sessions.resolve_interrupt(
                            target, interrupt.interrupt_id, approved, None if approved else "no"),
                            interrupt=interrupt.interrupt_id, tool_call=interrupt.tool_call_id, approved=approved)
            elif kind == "cancel":
                await caller.call("cancel", session_id, sessions.cancel_turn(session_id))
            elif kind == "snapshot":
                await caller.call("snapshot", session_id, sessions.get_agent_snapshot(session_id))
            else:
                await caller.call("list", session_id, sessions.list_agent_messages(session_id, limit=20))
            await asyncio.sleep(rng.uniform(*PAUSE_SECONDS))
    finally:
        await client.close()


if __name__ == "__main__":
    asyncio.run(storm(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:], Path(os.environ[ENV_STATE_DIR]),
                      os.environ[ENV_DATABASE_URL]))
