"""SIGKILL a worker process at named crash gates, recover with replacement workers, check E1/E3/E4.

Each test runs flows in worker child processes (engine/tests/worker_child.py) on one SQLite file.
The child kills itself at DEX_ENGINE_CRASH_AT; the gate log proves the targeted gate was reached by
the process that died, on the crossing meant. Ground truth for "what ran" is the invocation log
(fsynced per line, outside the database); what was committed is the flow's history and attributes.

The Chain flow is A -> B -> C; B has a WaitFor and an Execute. In one worker, each gate is crossed
once per method in this order: A execute (1), B wait_for (2), B execute (3), C execute (4).
Replacement workers start on standby (imported, not yet running) to keep the tests short.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import pytest

from dex_engine import AsyncClient, HistoryEntry, Store

from .conftest import engine_for
from .proc_harness import (
    Invocation,
    ProcSet,
    WorkerProcess,
    assert_no_attempt_ran_twice,
    eventually,
)
from .worker_child import REGISTRY, Trail

pytestmark = pytest.mark.slow

CLAIMED = "worker.claimed"
BEFORE_COMMIT = "worker.before_commit"
INSIDE_COMMIT = "store.inside_commit"
HOUSEKEEPING = "worker.housekeeping"

Method = tuple[str, str]  # (step execution ID, "wait_for" | "execute")
A_EXEC, B_WAIT, B_EXEC, C_EXEC = ("A-1", "execute"), ("B-1", "wait_for"), ("B-1", "execute"), ("C-1", "execute")
CROSSING = {B_WAIT: 2, B_EXEC: 3}  # the k of DEX_ENGINE_CRASH_AT that lands on this method
COMMIT_EVENT = {"wait_for": "wait_registered", "execute": "execute_completed"}


def starts(entries: list[Invocation], method: Method) -> list[tuple[int, int]]:
    """(attempt, pid) of each heartbeat-backed start of one Step method, in log order."""
    seid, name = method
    return [(e.attempt, e.pid) for e in entries
            if e.step_execution_id == seid and e.method == name and e.phase == "start"]


def commits(history: list[HistoryEntry], method: Method) -> list[int]:
    """Attempt numbers of the method's commits in history."""
    seid, name = method
    return [h.attempt for h in history if h.step_execution_id == seid and h.event_type == COMMIT_EVENT[name]]


def failures(history: list[HistoryEntry], method: Method) -> list[HistoryEntry]:
    seid, name = method
    return [h for h in history if h.step_execution_id == seid and h.event_type == "attempt_failed"
            and h.detail.startswith(f"{name}:")]


def assert_chain_outcome(
    entries: list[Invocation], history: list[HistoryEntry], crashed: Method, crashed_starts: list[tuple[int, int]],
    others: dict[Method, int],
) -> None:
    """Only the crashed method repeats; every other method of the Chain ran and committed exactly once.

    `crashed_starts` is the exact (attempt, pid) list of the crashed method's starts; `others` maps
    every other method to the pid that must have run it.
    """
    assert_no_attempt_ran_twice(entries)
    assert set(others) | {crashed} == {A_EXEC, B_WAIT, B_EXEC, C_EXEC}
    for method, pid in others.items():
        assert starts(entries, method) == [(1, pid)], f"{method} must run exactly once, on pid {pid}: {entries}"
        assert commits(history, method) == [1], history
        assert not failures(history, method), history
    assert starts(entries, crashed) == crashed_starts, entries
    final_attempt = crashed_starts[-1][0]
    # Exactly one commit of the crashed method, by its last attempt; each earlier attempt failed once.
    assert commits(history, crashed) == [final_attempt], history
    failed = failures(history, crashed)
    assert [h.attempt for h in failed] == list(range(1, final_attempt)), history
    assert all("WorkerLost" in h.detail for h in failed), failed


async def test_crash_claimed_but_not_started_reruns_same_attempt(db_url: str, tmp_path: Path) -> None:
    """E3: a worker dying after the claim, before the handler ran, costs no attempt: B's Execute re-runs as 1."""
    async with engine_for(db_url, REGISTRY, worker=False) as eng:
        with ProcSet(db_url, tmp_path / "state") as procs:
            await eng.client.start_flow("Chain", "f")
            w1 = procs.start("w1", crash_at=f"{CLAIMED}:{CROSSING[B_EXEC]}")
            w2 = procs.start("w2", standby=True)
            await w1.wait_killed_by_gate()
            procs.gates.assert_died_at(w1.pid, CLAIMED, CROSSING[B_EXEC])
            w2.go()
            info = await eng.client.wait_for_flow("f", 30)
            await w2.stop()

            assert info.status == "completed"
            entries = procs.invocations.read()
            history = await eng.client.get_flow_history("f")
            assert not [e for e in entries if (e.step_execution_id, e.method) == B_EXEC and e.pid == w1.pid], (
                "the handler of B's Execute must not have been called before the crash"
            )
            assert_chain_outcome(entries, history, B_EXEC, [(1, w2.pid)],
                                 {A_EXEC: w1.pid, B_WAIT: w1.pid, C_EXEC: w2.pid})
            assert await eng.client.get_attribute("f", Trail) == ["A-1#1", "B-1#1", "C-1#1"]


@pytest.mark.parametrize(
    ("gate", "crashed"),
    [(BEFORE_COMMIT, B_EXEC), (INSIDE_COMMIT, B_EXEC), (INSIDE_COMMIT, B_WAIT)],
    ids=["before_commit-execute", "inside_commit-execute", "inside_commit-wait_for"],
)
async def test_crash_after_start_reruns_only_the_running_method(
    db_url: str, tmp_path: Path, gate: str, crashed: Method,
) -> None:
    """E1/E3: a worker dying after B's method started (heartbeat), before or inside its commit.

    Attempt 1's result is not committed (a kill inside the commit transaction rolls it all back),
    the attempt fails with WorkerLost, the method re-runs as attempt 2, and every other method of
    the flow runs exactly once.
    """
    async with engine_for(db_url, REGISTRY, worker=False) as eng:
        with ProcSet(db_url, tmp_path / "state") as procs:
            await eng.client.start_flow("Chain", "f")
            w1 = procs.start("w1", crash_at=f"{gate}:{CROSSING[crashed]}")
            w2 = procs.start("w2", standby=True)
            await w1.wait_killed_by_gate()
            procs.gates.assert_died_at(w1.pid, gate, CROSSING[crashed])
            w2.go()
            info = await eng.client.wait_for_flow("f", 30)
            await w2.stop()

            assert info.status == "completed"
            entries = procs.invocations.read()
            history = await eng.client.get_flow_history("f")
            # Attempt 1 ran to its end in w1 (the crash came after the handler returned).
            ends = [(e.attempt, e.pid) for e in entries if (e.step_execution_id, e.method) == crashed
                    and e.phase == "end"]
            assert ends == [(1, w1.pid), (2, w2.pid)], entries
            # History and what ran agree: attempt 1's commit is in history iff the method did not run
            # again. Killed before COMMIT, it must not be there.
            committed_1 = 1 in commits(history, crashed)
            reran = len(starts(entries, crashed)) > 1
            assert committed_1 != reran, (history, entries)
            assert not committed_1, "a commit killed before COMMIT must roll back"
            others = {A_EXEC: w1.pid, B_WAIT: w1.pid, B_EXEC: w2.pid, C_EXEC: w2.pid}
            del others[crashed]
            assert_chain_outcome(entries, history, crashed, [(1, w1.pid), (2, w2.pid)], others)
            # The state says the same: B's Execute contributed once, under the attempt that committed.
            trail = ["A-1#1", f"B-1#{2 if crashed == B_EXEC else 1}", "C-1#1"]
            assert await eng.client.get_attribute("f", Trail) == trail
            assert await eng.client.flow_output("f") == trail


async def kill_inside_a_folding_commit(
    client: AsyncClient, procs: ProcSet, flow_type: str, flow_id: str, crossing: int,
) -> tuple[WorkerProcess, WorkerProcess]:
    """Start a flow, kill worker w1 at its `crossing`-th store.inside_commit gate, let w2 finish the
    flow (which must complete), and return both. w1 housekeeps seldom, so that its store's thread is
    idle at the commit meant and the commit runs on the loop, where a handler can be stepped inside it."""
    await client.start_flow(flow_type, flow_id)
    w1 = procs.start("w1", crash_at=f"{INSIDE_COMMIT}:{crossing}", housekeeping=5.0)
    w2 = procs.start("w2", standby=True)
    await w1.wait_killed_by_gate()
    procs.gates.assert_died_at(w1.pid, INSIDE_COMMIT, crossing)
    w2.go()
    info = await client.wait_for_flow(flow_id, 30)
    await w2.stop()
    assert info.status == "completed"
    return w1, w2


@pytest.mark.sqlite_only
async def test_crash_inside_a_commit_with_a_folded_execute_rolls_back_both(db_url: str, tmp_path: Path) -> None:
    """Step.pure_execute: Waiter's Execute runs inside Sender's commit; a kill inside that transaction
    loses both. Sender (started) re-runs as attempt 2, Waiter folds into its commit again, and Waiter
    commits once, as attempt 1, with no failure counted against it."""
    async with engine_for(db_url, REGISTRY, worker=False) as eng:
        with ProcSet(db_url, tmp_path / "state") as procs:
            w1, w2 = await kill_inside_a_folding_commit(eng.client, procs, "Fold", "f", 2)
            entries = procs.invocations.read()
            assert_no_attempt_ran_twice(entries)
            # Waiter ran inside Sender's commit in w1 (rolled back by the kill), then once more in w2:
            # folded again, or, if w2's store thread happened to be busy then, as a usual attempt 1.
            waiter = [(e.attempt, e.pid, e.detail) for e in entries
                      if e.step_execution_id == "Waiter-1" and e.phase == "end"]
            assert waiter[:1] == [(1, w1.pid, "Sender-1")], entries
            assert waiter[1:] in ([(1, w2.pid, "Sender-1")], [(1, w2.pid, "Waiter-1")]), entries
            assert starts(entries, ("Sender-1", "execute")) == [(1, w1.pid), (2, w2.pid)], entries
            history = await eng.client.get_flow_history("f")
            assert commits(history, ("Sender-1", "execute")) == [2], history
            assert commits(history, ("Waiter-1", "execute")) == [1], history
            assert not failures(history, ("Waiter-1", "execute")), history
            assert [h.attempt for h in failures(history, ("Sender-1", "execute"))] == [1], history
            trail = ["Arm-1#1", "Sender-1#2", "Waiter-1#1"]
            assert await eng.client.get_attribute("f", Trail) == trail
            assert await eng.client.flow_output("f") == trail


def parked_tool_runs(entries: list[Invocation]) -> list[tuple[str, int, int, str]]:
    """(phase, attempt, pid, detail) of the Park flow's Tool, in log order: "pre" (before its first
    heartbeat; detail is the task it ran in, "Arm-1" when inside Arm's commit), "start", "end"."""
    return [(e.phase, e.attempt, e.pid, e.detail) for e in entries if e.step_execution_id == "Tool-1"]


@pytest.mark.sqlite_only
async def test_crash_inside_a_commit_with_a_parked_heartbeat_runs_nothing_after_that_heartbeat(
    db_url: str, tmp_path: Path,
) -> None:
    """Step.pure_until_heartbeat: Tool runs inside Arm's commit up to its first heartbeat, which that
    commit records. A kill inside that transaction loses both, and the code after the heartbeat (a
    tool call) must not have run: the heartbeat returns only once durable (E10). Arm (started)
    re-runs as attempt 2, and Tool then runs once, as attempt 1, with no failure counted."""
    async with engine_for(db_url, REGISTRY, worker=False) as eng:
        with ProcSet(db_url, tmp_path / "state") as procs:
            w1, w2 = await kill_inside_a_folding_commit(eng.client, procs, "Park", "p", 1)
            entries = procs.invocations.read()
            assert_no_attempt_ran_twice(entries)
            runs = parked_tool_runs(entries)
            assert runs[0] == ("pre", 1, w1.pid, "Arm-1"), entries  # parked in the commit that was killed
            assert [r for r in runs if r[2] == w1.pid] == [runs[0]], "Tool went on past its heartbeat in w1"
            assert [(phase, attempt, pid) for phase, attempt, pid, _ in runs[1:]] == [
                ("pre", 1, w2.pid), ("start", 1, w2.pid), ("end", 1, w2.pid)], entries
            history = await eng.client.get_flow_history("p")
            assert commits(history, ("Arm-1", "execute")) == [2], history
            assert commits(history, ("Tool-1", "execute")) == [1], history
            assert not failures(history, ("Tool-1", "execute")), history
            assert await eng.client.flow_output("p") == ["Arm-1#2", "Tool-1#1"]


@pytest.mark.sqlite_only
async def test_a_parked_heartbeat_that_committed_counts_its_attempt_as_started(db_url: str, tmp_path: Path) -> None:
    """Tool's first heartbeat, recorded by Arm's commit, makes its attempt started: a worker killed
    after it, while Tool runs, fails that attempt (E3), and Tool retries as attempt 2 elsewhere. Were
    the heartbeat lost or not durable, attempt 1 would be handed out again as if it never ran (for a
    tool call: run twice, reported as not run)."""
    async with engine_for(db_url, REGISTRY, worker=False) as eng:
        with ProcSet(db_url, tmp_path / "state") as procs:
            w1 = procs.start("w1", hold=("Tool",), housekeeping=5.0)
            w2 = procs.start("w2", standby=True)
            await eng.client.start_flow("Park", "p")
            assert await procs.gate("p.Tool-1.1").wait_reached() == w1.pid
            w1.kill()
            await w1.wait_exit()
            w2.go()
            info = await eng.client.wait_for_flow("p", 30)
            await w2.stop()

            assert info.status == "completed"
            entries = procs.invocations.read()
            assert_no_attempt_ran_twice(entries)
            runs = parked_tool_runs(entries)
            assert runs[:2] == [("pre", 1, w1.pid, "Arm-1"), ("start", 1, w1.pid, "")], entries
            assert starts(entries, ("Tool-1", "execute")) == [(1, w1.pid), (2, w2.pid)], entries
            history = await eng.client.get_flow_history("p")
            assert commits(history, ("Tool-1", "execute")) == [2], history
            assert [h.attempt for h in failures(history, ("Tool-1", "execute"))] == [1], history
            assert await eng.client.flow_output("p") == ["Arm-1#1", "Tool-1#2"]


async def _wait_lease_expired(store: Store, pid: int) -> None:
    """Wait until the worker row of process `pid` has passed its expiry (so housekeeping will recover it)."""

    async def expired() -> bool:
        rows = await store.list_workers()
        mine = [r for r in rows if r[2] == pid]
        return bool(mine) and all(r[4] < time.time() * 1000 for r in mine)

    await eventually(f"the lease of worker pid {pid} to expire", expired, 10.0)


@pytest.mark.parametrize("second_dies_at", [HOUSEKEEPING, CLAIMED])
async def test_crash_during_recovery(db_url: str, tmp_path: Path, second_dies_at: str) -> None:
    """A crash during recovery from an earlier crash (SQLite's compound test).

    w1 dies at B's Execute before_commit (attempt 1 started). w2 dies either right after the
    housekeeping pass that recovered it (attempt 1 failed, attempt 2 scheduled), or on its first
    claim (attempt 2 claimed, not started). w3 finishes: attempt 2 commits, attempt 1 failed exactly
    once, attempt 2 was never counted as failed, and every other method ran once.
    """
    async with engine_for(db_url, REGISTRY, worker=False) as eng:
        with ProcSet(db_url, tmp_path / "state") as procs:
            await eng.client.start_flow("Chain", "f")
            w1 = procs.start("w1", crash_at=f"{BEFORE_COMMIT}:{CROSSING[B_EXEC]}")
            w2 = procs.start("w2", crash_at=f"{second_dies_at}:1", standby=True)
            w3 = procs.start("w3", standby=True)
            await w1.wait_killed_by_gate()
            procs.gates.assert_died_at(w1.pid, BEFORE_COMMIT, CROSSING[B_EXEC])

            if second_dies_at == HOUSEKEEPING:
                # So that w2's very first housekeeping pass is the one that recovers w1's attempt.
                await _wait_lease_expired(eng.store, w1.pid)
            w2.go()
            await w2.wait_killed_by_gate()
            procs.gates.assert_died_at(w2.pid, second_dies_at, 1)
            # w2 committed the recovery of attempt 1 before it died, and ran no handler.
            history = await eng.client.get_flow_history("f")
            assert [h.attempt for h in failures(history, B_EXEC)] == [1], history
            assert not [e for e in procs.invocations.read() if e.pid == w2.pid]

            w3.go()
            info = await eng.client.wait_for_flow("f", 30)
            await w3.stop()

            assert info.status == "completed"
            entries = procs.invocations.read()
            history = await eng.client.get_flow_history("f")
            assert_chain_outcome(entries, history, B_EXEC, [(1, w1.pid), (2, w3.pid)],
                                 {A_EXEC: w1.pid, B_WAIT: w1.pid, C_EXEC: w3.pid})
            assert await eng.client.get_attribute("f", Trail) == ["A-1#1", "B-1#2", "C-1#1"]


async def _run_risky_until_rescued(
    procs: ProcSet, client: AsyncClient, mode: str, crashing_workers: int,
) -> tuple[list[WorkerProcess], object]:
    """Run flow 'r' of type Risky: `crashing_workers` workers die at before_commit, then one finishes."""
    await client.start_flow("Risky", "r", mode)
    dying = [procs.start(f"w{i + 1}", crash_at=f"{BEFORE_COMMIT}:1", standby=True) for i in range(crashing_workers)]
    last = procs.start(f"w{crashing_workers + 1}", standby=True)
    for w in dying:
        w.go()
        await w.wait_killed_by_gate()
        procs.gates.assert_died_at(w.pid, BEFORE_COMMIT, 1)
    last.go()
    info = await client.wait_for_flow("r", 30)
    await last.stop()
    assert info.status == "completed", info
    return [*dying, last], await client.flow_output("r")


async def test_every_attempt_dies_after_start_routes_not_completed(db_url: str, tmp_path: Path) -> None:
    """E3/E4: each of Risky's 2 attempts heartbeats, then its worker dies before the commit.

    The failure route Rescue runs once, and its ctx.recovery_error says NOT_COMPLETED, 2 attempts,
    WorkerLost.
    """
    async with engine_for(db_url, REGISTRY, worker=False) as eng:
        with ProcSet(db_url, tmp_path / "state") as procs:
            (w1, w2, w3), output = await _run_risky_until_rescued(procs, eng.client, "crash", 2)
            assert output == {
                "mode": "crash", "step_execution_id": "Risky-1", "method": "execute", "attempts": 2,
                "attempt_progress": "NOT_COMPLETED", "error_type": "WorkerLost",
                "detail": "the worker running the attempt died",
            }
            entries = procs.invocations.read()
            assert_no_attempt_ran_twice(entries)
            assert starts(entries, ("Risky-1", "execute")) == [(1, w1.pid), (2, w2.pid)]
            assert starts(entries, ("Rescue-1", "execute")) == [(1, w3.pid)]
            history = await eng.client.get_flow_history("r")
            assert not commits(history, ("Risky-1", "execute")), history
            assert [h.attempt for h in failures(history, ("Risky-1", "execute"))] == [1, 2], history
            (failed,) = [h for h in history if h.event_type == "step_failed"]
            assert failed.step_execution_id == "Risky-1" and failed.detail.startswith("NOT_COMPLETED"), failed
            assert commits(history, ("Rescue-1", "execute")) == [1], history


async def test_every_attempt_fails_before_start_routes_not_started(db_url: str, tmp_path: Path) -> None:
    """E3/E4: Risky raises on each of its 2 attempts before any heartbeat: recovery_error NOT_STARTED."""
    async with engine_for(db_url, REGISTRY, worker=False) as eng:
        with ProcSet(db_url, tmp_path / "state") as procs:
            (w1,), output = await _run_risky_until_rescued(procs, eng.client, "raise", 0)
            assert output == {
                "mode": "raise", "step_execution_id": "Risky-1", "method": "execute", "attempts": 2,
                "attempt_progress": "NOT_STARTED", "error_type": "RuntimeError", "detail": "boom on attempt 2",
            }
            entries = procs.invocations.read()
            assert Counter((e.step_execution_id, e.attempt, e.phase) for e in entries) == {
                ("Risky-1", 1, "raise"): 1, ("Risky-1", 2, "raise"): 1,
                ("Rescue-1", 1, "start"): 1, ("Rescue-1", 1, "end"): 1,
            }
            assert {e.pid for e in entries} == {w1.pid}
            history = await eng.client.get_flow_history("r")
            (failed,) = [h for h in history if h.event_type == "step_failed"]
            assert failed.step_execution_id == "Risky-1" and failed.detail.startswith("NOT_STARTED"), failed
