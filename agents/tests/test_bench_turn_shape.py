"""bench/agent_turn.py's dex-engine row stands for the engine's share of dex's turn only while it
runs the Steps, waits and commits dex's turn runs; these tests hold it to that, so that a change to
AgentSessionFlow's Step shape shows up here instead of as a quietly wrong benchmark figure. They
also run the sequential counting pass end to end: commits counted, statements recorded and replayed
on a copy whose WAL was grown like the original's."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import agent_turn  # bench/ is not a package; LangGraph and DBOS are imported lazily
from agent_turn import CommitCounter, DexTurn, TurnWatcher, bind_turn, dex_phase
from dex_engine import AsyncWorker, WorkerOptions, open_store
from engine_steps import reused_wal

TURNS = 3


async def _history(url: str, make: Callable[[TurnWatcher], DexTurn]) -> list[tuple[str, str]]:
    """Every history event of one session after TURNS turns, as (event type, Step execution ID)."""
    store = open_store(url)
    bound = bind_turn(store, make)
    watcher, calls = bound.watcher, bound.calls
    try:
        async with AsyncWorker(bound.registry, WorkerOptions(database_url=url), store=store):
            await calls.start("s")
            await asyncio.wait_for(watcher.wait_started("s"), 30)
            for done in range(TURNS):
                await calls.send("s")
                await asyncio.wait_for(watcher.wait_turn("s", done + 1), 30)
            history = await bound.client.get_flow_history("s")
    finally:
        bound.unbind()
        await store.close()
    return [(h.event_type, h.step_execution_id) for h in history]


async def test_the_engine_shape_runs_the_steps_and_waits_of_dexs_turn(tmp_path: Path) -> None:
    """Catches: a Step, wait or fold of the agent turn that the engine shape lacks or adds (an
    unfolded Execute, a wait registered in a commit of its own, a Step renamed)."""
    agent = await _history(f"sqlite:///{tmp_path / 'agent.db'}", agent_turn.scripted_runner_flow)
    shape = await _history(f"sqlite:///{tmp_path / 'shape.db'}", agent_turn.engine_shape_flow)
    assert ("execute_completed", f"RunModel-{2 * TURNS}") in agent
    assert shape == agent


@pytest.mark.parametrize("name", ["dex", "dex-engine"])
async def test_a_counted_sequential_pass_counts_dexs_four_commits_and_replays_its_statements(
    tmp_path: Path, name: str,
) -> None:
    """Catches: a shape that commits other than four times a turn, and a replay whose copy's WAL
    was not grown (its turns would all grow it, and none be timed). The worker renews its lease
    far less often than the pass lasts even on a loaded machine: a renewal commits too."""
    make, _note = agent_turn.DEX_SYSTEMS[name]
    counter = CommitCounter()
    result = await dex_phase(f"sqlite:///{tmp_path / 'count.db'}", [8], "t", False, make, counter,
                             lease_renew_seconds=3600.0)
    assert result.turns == 8
    # A turn that committed once more would add 8; a loaded machine (CI's) may add a commit or two
    # of the worker's own (a claim handed back that did not start in time), which is not the shape's.
    assert 4 * 8 <= result.commits <= 4 * 8 + 2 and result.fsyncs == result.commits, (result.commits, result.fsyncs)
    assert result.replayed is not None
    assert result.replayed.turns == 8 and result.replayed.timed >= 7, result.replayed
    assert result.replay_statements > 40


@pytest.mark.parametrize(("argv", "error"), [
    (["--session-turns", "0"], "--session-turns must be at least 1 (turns per session), got 0"),
    (["--replay", "--sessions", "4"], "--replay replays sequential turns: it needs --sessions 1, got --sessions 4"),
    (["--builtin", "--engine-shape"], "argument --engine-shape: not allowed with argument --builtin"),
])
def test_profile_turn_refuses_bad_arguments_before_running_anything(
    argv: list[str], error: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """Catches: a replay asked of concurrent sessions that records everything and prints nothing, a
    division by zero turns per session, a turn that is both the built-in loop and the bare engine."""
    import profile_turn

    monkeypatch.setattr(sys, "argv", ["profile_turn.py", *argv])
    with pytest.raises(SystemExit) as exited:
        profile_turn.main()
    assert exited.value.code == 2
    assert error in capsys.readouterr().err


def test_agent_turn_refuses_a_floor_of_no_commits_before_running_anything(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """Catches: `--floor-commits 0` ran the floor and then ended in a StatisticsError traceback (a
    median of no commits)."""
    monkeypatch.setattr(sys, "argv", ["agent_turn.py", "--floor-commits", "0"])
    with pytest.raises(SystemExit) as exited:
        agent_turn.main()
    assert exited.value.code == 2
    assert "--floor-commits must be at least 1, got 0" in capsys.readouterr().err


def test_a_replay_says_which_turns_its_median_is_over() -> None:
    """Catches: a median over WAL-growing turns reported as over reused ones."""
    assert reused_wal(31, 32) == "over the 31 of 32 turns that reused the copy's WAL"
    assert reused_wal(0, 32) == (
        "over all 32 turns, every one of which grew the copy's WAL (about twice a commit's cost)")


@pytest.mark.parametrize(("argv", "error"), [
    (["--sessions", "60", "--approvals", "0"],
     "must leave, beside --approvals (0), at least --probes + --midturn + 1 (71)"),
    (["--batch", "0"], "--batch at least 1"),
    (["--lease", "0"], "--lease and --deadline above 0, got 30.0, 0.0, 60.0"),
])
def test_idle_sessions_refuses_bad_arguments_before_running_anything(
    argv: list[str], error: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """Catches: too few idle sessions for its probes, which ran for seconds and then failed in
    random.sample with a ValueError; a batch of 0 sessions, which never started one."""
    import idle_sessions

    monkeypatch.setattr(sys, "argv", ["idle_sessions.py", *argv])
    with pytest.raises(SystemExit) as exited:
        idle_sessions.main()
    assert exited.value.code == 2
    assert error in capsys.readouterr().err
