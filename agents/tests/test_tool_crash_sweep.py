"""SIGKILL at random instants while tools run (RELIABILITY.md T03, tool_at_most_once_under_crash).

Many sessions each run one approved non-idempotent write and one idempotent write, both of which
take a while, as calls to a slow API do. The Worker child is SIGKILLed several times at random
instants (a seeded RNG, printed on failure), each time replaced by a standby. Then every turn must
end, and the InvocationLog (written by the tools themselves, so it survives the kills) must agree
with each call's recorded outcome:

- a non-idempotent write started at most once; `succeeded` means it ran to the end once,
  `outcome_unknown` that it may have run, `failed` that it certainly never started;
- an idempotent write may run again, but every run carries the same idempotency key;
- at least one kill landed while a tool was running, so the sweep tested something.

On a private SQLite file and on a PostgreSQL database (TEST_PG_DSN).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from agents.tests.conftest import REPO_ROOT, WORKER_MODULE
from agents.tests.scripted_agent import INVOCATIONS, build_flow
from agents.tests.session_driver import first_turn_ended
from agents.tests.standby_workers import SharedStack
from engine.tests.conftest import db_url, pg_database, pg_databases  # noqa: F401 - the fixtures used here

from dex_agents import TOOL_CALL_NOT_RUN_ERROR_PREFIX, AgentSessionClient, AgentSessionFlow
from dex_agents.testing import AgentTestStack, InvocationLog

SEED = 20261130
SESSIONS = 12
KILLS = 4
# Each tool takes this long (seconds, drawn per call): long enough that a kill often lands inside one.
TOOL_SECONDS = (0.2, 0.9)
# Sessions start spread over the kills, so calls are cut at every stage: before they run, while they
# run, after they ran; between one session's start and the next:
START_GAP_SECONDS = (0.0, 0.5)
# Between a Worker's registration and its kill.
KILL_AFTER_SECONDS = (0.3, 1.2)
# Every turn ends within this after the last kill: a lease expiry (2 s), retries, the tools' time.
SETTLE_SECONDS = 120.0


def _script(rng: random.Random) -> str:
    write = {"id": "w", "name": "write_refund", "args": {"sleep": round(rng.uniform(*TOOL_SECONDS), 3)}}
    update = {"id": "i", "name": "idem_update", "args": {"sleep": round(rng.uniform(*TOOL_SECONDS), 3)}}
    return json.dumps({"steps": [{"tools": [write, update]}, {"answer": "{records}"}]})


async def _approve_writes(sessions: AgentSessionClient, session_ids: list[str]) -> None:
    """Approve each session's write as soon as its approval is pending (kills or not)."""
    waiting = set(session_ids)
    while waiting:
        for session_id in sorted(waiting):
            with contextlib.suppress(Exception):  # the client's store may be busy; try again next round
                if await sessions.resolve_interrupt(session_id, "w", approved=True):
                    waiting.discard(session_id)
        await asyncio.sleep(0.05)


def _check_call(log: InvocationLog, session_id: str, call_id: str, record: dict[str, Any], *, repeatable: bool
                ) -> int:
    """Assert what the ledger may hold for a call with this final record; returns runs cut short."""
    starts = log.entries("tool_start", flow_id=session_id, tool_call_id=call_id)
    ends = log.entries("tool_end", flow_id=session_id, tool_call_id=call_id)
    label = f"{session_id}/{call_id}: {record}, {len(starts)} start(s), {len(ends)} end(s)"
    status = record["status"]
    if repeatable:
        assert {e["idempotency_key"] for e in starts} <= {f"{session_id}/turn-1/{call_id}"}, label
        assert len(starts) <= 3, label  # CallTool's three attempts
    else:
        assert len(starts) <= 1, label  # INV-3: never run twice
        assert len(ends) <= len(starts), label
    if status == "succeeded":
        assert ends, label
    elif status == "outcome_unknown":
        assert record["error"], label
    elif status == "failed":
        assert record["error"].startswith(TOOL_CALL_NOT_RUN_ERROR_PREFIX + ": "), label
        assert not starts, label
    else:
        raise AssertionError(f"unexpected final status: {label}")
    return len(starts) - len(ends)


pytestmark = pytest.mark.slow


async def test_random_kills_never_repeat_a_write_and_every_turn_ends(tmp_path: Path, db_url: str) -> None:  # noqa: F811
    await _sweep(tmp_path, db_url, SEED, steady_workers=0)


async def test_random_kills_with_a_second_worker_claiming_beside(tmp_path: Path, db_url: str) -> None:  # noqa: F811
    """The same sweep while a second Worker child, never killed, claims the sessions' Steps too:
    two processes race for every claim (the SQLite file's writer turns, PostgreSQL's SKIP LOCKED),
    and the survivor takes over each dead Worker's attempts."""
    await _sweep(tmp_path, db_url, SEED + 1, steady_workers=1)


async def _sweep(tmp_path: Path, url: str, seed: int, *, steady_workers: int) -> None:
    # Every random choice is drawn up front, so the seed alone fixes the schedule.
    rng = random.Random(seed)
    session_ids = [f"sweep-{n}" for n in range(SESSIONS)]
    scripts = [_script(rng) for _ in session_ids]
    start_gaps = [round(rng.uniform(*START_GAP_SECONDS), 3) for _ in session_ids]
    kill_gaps = [round(rng.uniform(*KILL_AFTER_SECONDS), 3) for _ in range(KILLS)]
    context = (f"seed {seed}, {steady_workers} Worker(s) never killed: sessions started {start_gaps} s apart, "
               f"kills {kill_gaps} s after each Worker began")
    flow: AgentSessionFlow = build_flow(tmp_path)
    async with AgentTestStack(tmp_path, [flow], WORKER_MODULE, worker_cwd=REPO_ROOT, database_url=url) as stack:
        shared = SharedStack(stack, standbys=2)
        sessions = stack.sessions(flow)
        steady = {(await stack.start_worker()).pid for _ in range(steady_workers)}
        worker = await shared.worker()

        async def start_sessions() -> None:
            for session_id, script, gap in zip(session_ids, scripts, start_gaps, strict=True):
                await asyncio.sleep(gap)
                await sessions.start_session(session_id, script)

        starting = asyncio.create_task(start_sessions())
        approving = asyncio.create_task(_approve_writes(sessions, session_ids))
        for gap in kill_gaps:
            await asyncio.sleep(gap)
            worker.kill()
            worker = await shared.start_new_worker()
        await asyncio.wait_for(starting, SETTLE_SECONDS)
        snapshots = [await first_turn_ended(sessions, session_id, timeout=SETTLE_SECONDS) for session_id in session_ids]
        await asyncio.wait_for(approving, SETTLE_SECONDS)

        log = InvocationLog(stack.state_dir / INVOCATIONS)
        cut_short = 0
        for session_id, snapshot in zip(session_ids, snapshots, strict=True):
            assert snapshot.state is not None and snapshot.state.last_turn_error is None, (context, snapshot.state)
            last = snapshot.messages[-1]
            records = json.loads(last.text or "{}")
            assert set(records) == {"w", "i"}, (context, last)
            cut_short += _check_call(log, session_id, "w", records["w"], repeatable=False)
            cut_short += _check_call(log, session_id, "i", records["i"], repeatable=True)
        assert cut_short >= 1, f"no kill landed while a tool ran ({context}): the sweep tested nothing"
        if steady:
            ran_in = {e["pid"] for e in log.entries("tool_start")}
            assert ran_in & steady and ran_in - steady, (context, "both kinds of Worker should have run tools", ran_in)

    if url.startswith("sqlite:///"):
        with contextlib.closing(sqlite3.connect(url.removeprefix("sqlite:///"))) as db:
            assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
