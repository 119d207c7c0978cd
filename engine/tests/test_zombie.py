"""E2 fencing across processes: a worker frozen mid-Step (SIGSTOP) loses its attempt and, resumed
as a zombie, gets none of its late writes in.

The zombie's handler heartbeated (attempt 1 started), then holds at a FileGate without yielding to
its event loop, and the process is frozen with SIGSTOP. A second worker process declares it dead
after its lease expires, fails attempt 1 (WorkerLost) and runs the Step as attempt 2 (to its end,
or held mid-Step). Then the gate is released and the zombie resumed: its handler goes on before its
worker can learn anything, so its late writes reach the store, which must refuse them.

Two modes (the flow input): "commit" returns a decision right away (the late commit, sent to the
store for certain: the zombie crosses the before-commit gate); "writes" first appends a best-effort
stream event and heartbeats, then returns (the late heartbeat and event; the commit that follows may
be dropped by the worker itself once it learned the attempt is gone).

Each case runs on SQLite (one file, two processes) and on PostgreSQL (two processes, each with its
own connection pool and LISTEN connection).
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from .conftest import engine_for
from .proc_harness import ProcSet, assert_no_attempt_ran_twice, eventually
from .worker_child import REGISTRY, Owner, Progress

# Both backends: the harness freezes the zombie outside any transaction (SQLite: the file's write
# lock is free; PostgreSQL: its server sessions are idle), and the fencing checks are the same SQL.
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("mode", ["commit", "writes"])
@pytest.mark.parametrize("winner_state", ["completed", "running"])
async def test_zombie_late_writes_are_rejected(db_url: str, tmp_path: Path, mode: str, winner_state: str) -> None:
    """Nothing of the zombie's attempt lands: Owner, output, stream and history hold attempt 2 only.

    winner_state "completed": the zombie resumes after attempt 2 committed (its task is gone).
    winner_state "running": the zombie resumes while attempt 2 is held mid-Step (the task exists,
    owned by a newer lease epoch): only the epoch check can tell the zombie's writes apart.
    """
    winner_holds = winner_state == "running"
    async with engine_for(db_url, REGISTRY, worker=False) as eng:
        with ProcSet(db_url, tmp_path / "state") as procs:
            zombie = procs.start("zombie", hold=("Slow",))
            # A held winner blocks its own event loop too: give it a long lease so that it is not
            # declared dead meanwhile; its short housekeeping period still notices the zombie quickly.
            winner = procs.start("winner", standby=True, hold=("Slow",) if winner_holds else (),
                                 lease_ttl=30.0, lease_renew=1.0)
            await eng.client.start_flow("Zombie", "z", mode)
            zombie_gate = procs.gate("z.Slow-1.1")
            assert await zombie_gate.wait_reached() == zombie.pid

            await procs.stop_outside_write(zombie)
            winner.go()
            winner_result = {"pid": winner.pid, "attempt": 2}
            winner_gate = procs.gate("z.Slow-1.2")
            if winner_holds:
                assert await winner_gate.wait_reached() == winner.pid
            else:
                info = await eng.client.wait_for_flow("z", 30)
                assert info.status == "completed"
                assert await eng.client.flow_output("z") == winner_result

            zombie_gate.release()
            zombie.signal(signal.SIGCONT)

            def zombie_finished() -> bool:
                return any(e.pid == zombie.pid and e.phase == "end" for e in procs.invocations.read())

            await eventually("the zombie's handler to return", zombie_finished)
            # A graceful stop drains the zombie's attempt: whatever it would commit is settled after this.
            await zombie.stop()
            if winner_holds:
                # Attempt 2 is still open and the zombie is gone: nothing of attempt 1 got in meanwhile.
                info = await eng.client.describe_flow("z")
                assert info.status == "running"
                assert [(s.step_execution_id, s.state, s.attempt) for s in info.active_steps] == [
                    ("Slow-1", "running", 2)]
                assert await eng.client.get_attribute("z", Owner) is None
                assert (await eng.client.read_stream("z", Progress)).events == []
                winner_gate.release()
                info = await eng.client.wait_for_flow("z", 30)
                assert info.status == "completed"
            await winner.stop()

            # State: only the winner's attempt contributed.
            assert await eng.client.get_attribute("z", Owner) == winner_result
            assert await eng.client.flow_output("z") == winner_result
            stream = await eng.client.read_stream("z", Progress)
            expected_events = [("Slow-1", 2, f"Slow-1#2 pid {winner.pid}")] if mode == "writes" else []
            assert [(e.step_execution_id, e.attempt, e.value) for e in stream.events] == expected_events
            history = await eng.client.get_flow_history("z")
            assert [h.attempt for h in history if h.event_type == "execute_completed"] == [2], history
            failed = [h for h in history if h.event_type == "attempt_failed"]
            assert [h.attempt for h in failed] == [1] and "WorkerLost" in failed[0].detail, history

            # What ran: both attempts ran to their end, under different attempt numbers.
            entries = procs.invocations.read()
            assert_no_attempt_ran_twice(entries)
            zombie_log = [(e.attempt, e.phase) for e in entries if e.pid == zombie.pid]
            winner_log = [(e.attempt, e.phase) for e in entries if e.pid == winner.pid]
            if mode == "writes":
                assert winner_log == [(2, "start"), (2, "heartbeat_ok"), (2, "end")], entries
                assert zombie_log == [(1, "start"), (1, "heartbeat_rejected"), (1, "end")], (
                    f"the zombie's late heartbeat must be refused: {entries}"
                )
            else:
                assert winner_log == [(2, "start"), (2, "end")], entries
                assert zombie_log == [(1, "start"), (1, "end")], entries

            # The zombie never had a commit acknowledged; in "commit" mode its late commit provably
            # reached the store (it crossed the before-commit gate) and was refused there.
            zombie_gates = procs.gates.crossings(zombie.pid)
            assert "worker.after_commit" not in zombie_gates, zombie_gates
            if mode == "commit":
                assert "worker.before_commit" in zombie_gates, zombie_gates
                # ...refused by the fencing check, before the commit changed anything.
                assert "store.inside_commit" not in zombie_gates, zombie_gates
            assert "worker.after_commit" in procs.gates.crossings(winner.pid)
