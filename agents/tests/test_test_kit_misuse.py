"""The test kit (seed 003 "Testing an adapter") used wrongly or under load: a stack used outside
`async with`, a mistyped database URL, a probe that hangs, a FileGate reached from two threads.
Each fails loudly and at once, naming what to fix, and leaves nothing behind."""

from __future__ import annotations

import asyncio
import math
import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
from agents.tests.conftest import REPO_ROOT, WORKER_MODULE
from agents.tests.scripted_agent import build_flow
from agents.tests.test_bad_inputs import _OversizedRunStateRunner, in_process, run_turn, script
from engine.tests.conftest import db_url, pg_database, pg_databases  # noqa: F401 - the fixtures used here
from engine.tests.schema_states import latest_version, migrate_to, pg_tables, stored_version

from dex_agents import AgentSessionClient, AgentSessionFlow, AgentSnapshot
from dex_agents.testing import (
    ENV_DATABASE_URL,
    AgentTestStack,
    FileGate,
    InvocationLog,
    executed_steps,
    read_step_history,
    run_agent_worker,
    wait_for_agent_snapshot,
    wait_until,
)
from dex_engine import FlowDefinitionError, FlowNotFoundError, StoreOpenError, open_store
from dex_engine._open import shown_url

# A probe hanging this long stands for a read that never returns; a wait bounded by its timeout
# ends long before.
HANGING_PROBE_SECONDS = 20.0
# Rounds of two threads marking one gate at once: the race lost in most rounds.
GATE_RACE_ROUNDS = 200


def new_stack(tmp_path: Path) -> AgentTestStack:
    return AgentTestStack(tmp_path, [build_flow(tmp_path)], WORKER_MODULE, worker_cwd=REPO_ROOT)


async def refused_start(stack: AgentTestStack) -> str:
    """start_worker()'s refusal, checked to have started no Worker (killing any it did)."""
    try:
        with pytest.raises(RuntimeError) as refusal:
            await stack.start_worker()
    finally:
        spawned = list(stack.workers)
        for worker in spawned:
            worker.kill()
    assert spawned == []
    return str(refusal.value)


async def test_start_worker_outside_async_with_is_refused_before_a_worker_starts(tmp_path: Path) -> None:
    """Only leaving the stack kills its Workers, so a Worker started before entering it or after
    leaving it would run on, orphaned."""
    stack = new_stack(tmp_path)
    assert "was not entered yet" in await refused_start(stack)
    async with stack:
        pass
    message = await refused_start(stack)
    assert "was exited" in message and repr(str(tmp_path)) in message
    assert "worker-1.log" not in os.listdir(tmp_path)  # no Worker was started, not even briefly


async def test_a_stack_is_entered_once(tmp_path: Path) -> None:
    """Leaving a stack closes its Client: entering it again would hand out a closed engine."""
    stack = new_stack(tmp_path)
    async with stack:
        with pytest.raises(RuntimeError, match="is open"):
            await stack.__aenter__()
    with pytest.raises(RuntimeError, match="was exited"):
        async with stack:
            pass


async def test_read_step_history_of_a_missing_database_file_creates_nothing(tmp_path: Path) -> None:
    """A mistyped path is named, instead of a new empty database that has "no flow with ID ..."."""
    missing = tmp_path / "tmp_pth" / "dex.db"
    with pytest.raises(FileNotFoundError, match=f"no database file {str(missing)!r}"):
        await read_step_history(f"sqlite:///{missing}", "s1")
    assert os.listdir(tmp_path) == []


def _named(url: str) -> str:
    """How a refusal names the database at `url`: a SQLite file by its path, a PostgreSQL URL without its password."""
    return repr(url.removeprefix("sqlite:///")) if url.startswith("sqlite:") else repr(shown_url(url))


async def test_read_step_history_creates_nothing_in_a_database_without_engine_tables(
    db_url: str, tmp_path: Path,  # noqa: F811 - the fixture
) -> None:
    """A URL naming a database that holds no engine tables (the application's own SQLite file, here
    one without tables yet; a mistyped PostgreSQL database name that exists, or the application's
    own database, here with one table of its own) is refused by name, and nothing is created there.
    Catches: every table of the engine created in that database, then "no flow with ID" as if it
    were the engine's."""
    sqlite = db_url.startswith("sqlite:")
    if sqlite:
        sqlite3.connect(tmp_path / "engine.db").close()  # an empty database file, as the application left it
    else:
        with psycopg.connect(db_url, autocommit=True) as pg:
            pg.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY)")
    with pytest.raises(StoreOpenError) as refusal:
        await read_step_history(db_url, "s1")
    message = str(refusal.value)
    assert _named(db_url) in message and "nothing was created" in message, message
    assert "pass the URL of the engine database the workers use" in message, message
    if sqlite:
        assert os.listdir(tmp_path) == ["engine.db"] and (tmp_path / "engine.db").stat().st_size == 0
    else:
        assert pg_tables(db_url) == ["orders"]


async def test_read_step_history_leaves_a_database_of_an_older_schema_unmigrated(db_url: str) -> None:  # noqa: F811
    """A database an older dex_engine made, its workers still running on it, is refused with both
    schema versions named, and keeps its version. Catches: a read that migrates the database under
    the older workers."""
    latest = latest_version(db_url)
    migrate_to(db_url, latest - 1)
    with pytest.raises(StoreOpenError) as refusal:
        await read_step_history(db_url, "s1")
    message = str(refusal.value)
    assert f"{_named(db_url)} has dex_engine schema version {latest - 1}, older than the {latest}" in message, message
    assert "nothing was changed" in message, message
    assert stored_version(db_url) == str(latest - 1)


async def test_read_step_history_reads_an_engine_database_of_this_schema(db_url: str) -> None:  # noqa: F811
    """The refusals above leave an engine database of this dex_engine's schema to be read: a flow it
    does not hold is named as such."""
    await open_store(db_url).close()
    with pytest.raises(FlowNotFoundError, match="'s1'"):
        await read_step_history(db_url, "s1")


async def test_wait_until_cuts_off_an_async_probe_at_the_timeout() -> None:
    calls: list[str] = []

    async def hanging() -> bool:
        calls.append("started")
        await asyncio.sleep(0 if len(calls) == 1 else HANGING_PROBE_SECONDS)
        calls.append("returned")
        return False

    started = time.monotonic()
    with pytest.raises(AssertionError, match=r"^timed out after 0.5 s waiting for an answer; last value: False$"):
        await wait_until("an answer", hanging, timeout=0.5)
    assert time.monotonic() - started < HANGING_PROBE_SECONDS / 2
    assert calls == ["started", "returned", "started"]  # the second call was cancelled


async def test_wait_until_passes_on_a_probes_own_timeout_error() -> None:
    async def failing() -> bool:
        raise TimeoutError("the probe's own")

    with pytest.raises(TimeoutError, match="the probe's own"):
        await wait_until("an answer", failing, timeout=5)


def test_a_file_gate_reached_by_two_threads_at_once(tmp_path: Path) -> None:
    """Two parallel calls of a sync tool in one Worker reach one gate at the same moment."""
    failures: list[BaseException] = []
    for round_number in range(GATE_RACE_ROUNDS):
        gate = FileGate(tmp_path, f"lookup-{round_number}")
        together = threading.Barrier(2)

        def reach(gate: FileGate = gate, together: threading.Barrier = together) -> None:
            together.wait()
            try:
                gate.mark_reached()
            except BaseException as exc:
                failures.append(exc)

        threads = [threading.Thread(target=reach) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert gate.reached_path.read_text() == str(os.getpid())
    assert failures == []
    # Every temporary file became a gate's reached file.
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"lookup-{n}.reached" for n in range(GATE_RACE_ROUNDS))


async def test_wait_until_with_no_time_left_still_asks_an_async_probe_once() -> None:
    """Catches: the probe cut off the moment it started, so timeout=0 never saw an answer that
    was already there (a sync probe always got one look)."""

    async def ready() -> str:
        await asyncio.sleep(0)
        return "ready"

    assert await wait_until("an answer", ready, timeout=0) == "ready"


async def test_a_file_gate_after_a_kill_waits_for_the_retrys_process(tmp_path: Path) -> None:
    """A Worker killed at a gate leaves its pid there; the retry in the next Worker marks the gate
    again, and wait_until_reached(other_than=...) waits for it; reset() makes the gate stop the
    next handler again. Catches: the dead Worker's pid returned at once after a restart, before
    the retry had reached the gate."""
    gate = FileGate(tmp_path, "refund")
    killed = os.getpid() + 100_000  # no such process here: the Worker killed at the gate
    gate.reached_path.write_text(str(killed))
    assert await gate.wait_until_reached() == killed
    with pytest.raises(AssertionError, match=f"gate refund reached by a process other than {killed}"):
        await gate.wait_until_reached(timeout=0.2, other_than=killed)
    gate.release()
    await gate.wait_for_release()  # the retry passes the released gate, marking it as its own
    assert await gate.wait_until_reached(other_than=killed) == os.getpid()
    gate.reset()
    assert not gate.reached and not gate.release_path.exists()


async def test_a_stack_in_a_relative_directory_shares_it_with_a_worker_started_elsewhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A relative tmp_path and a worker_cwd elsewhere (seed 003's PACKAGE_DIR). Catches: the Worker
    reading the relative path from its own directory, serving another database the test never saw
    (start_worker timed out waiting for it to register)."""
    monkeypatch.chdir(tmp_path)
    async with AgentTestStack(Path("state"), [build_flow(tmp_path / "state")], WORKER_MODULE,
                              worker_cwd=REPO_ROOT) as stack:
        worker = await stack.start_worker()
        assert stack.state_dir == tmp_path / "state"
        assert worker.alive
    assert not (REPO_ROOT / "state").exists()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"timeout": math.nan}, "timeout must be a number of seconds (math.inf waits for ever), got nan"),
    ({"timeout": True}, "timeout must be a number of seconds (math.inf waits for ever), got True"),
    ({"timeout": "5"}, "timeout must be a number of seconds (math.inf waits for ever), got '5'"),
    ({"timeout": 0.2, "interval": math.nan}, "interval must be a finite number of seconds above 0, got nan"),
    ({"timeout": 0.2, "interval": 0}, "interval must be a finite number of seconds above 0, got 0"),
    ({"timeout": 0.2, "interval": -1}, "interval must be a finite number of seconds above 0, got -1"),
    # With timeout=math.inf it would sleep for ever after the first probe.
    ({"timeout": 0.2, "interval": math.inf}, "interval must be a finite number of seconds above 0, got inf"),
], ids=["nan-timeout", "bool-timeout", "text-timeout", "nan-interval", "zero-interval", "negative-interval",
        "infinite-interval"])
async def test_wait_until_refuses_a_timeout_or_interval_it_cannot_keep(kwargs: dict[str, Any], message: str) -> None:
    """Before the first probe: ValueError naming the parameter and the value. Catches: a NaN
    timeout, whose deadline no comparison ever reaches, and a NaN interval, slept for ever, each
    holding the test for good instead of failing it; a text timeout failing with a bare TypeError."""
    probes: list[int] = []

    def never() -> bool:
        probes.append(1)
        return False

    with pytest.raises(ValueError) as caught:
        await asyncio.wait_for(wait_until("an answer", never, **kwargs), HANGING_PROBE_SECONDS)
    assert str(caught.value) == message
    assert probes == []


@pytest.mark.parametrize(("ttl", "error"), [
    (math.nan, ValueError), (0, ValueError), (-1.0, ValueError), (1e6, ValueError), (True, TypeError),
    ("5", TypeError),
])
def test_a_lease_ttl_no_worker_can_use_is_refused_by_the_stack(tmp_path: Path, ttl: object, error: type) -> None:
    """Refused when the stack is made, naming it, with nothing created; not by each Worker child
    later, which start_worker reports only as a Worker that exited before registering."""
    state = tmp_path / "state"
    with pytest.raises(error, match="lease_ttl_seconds"):
        AgentTestStack(state, [build_flow(tmp_path)], WORKER_MODULE, worker_cwd=REPO_ROOT,
                       lease_ttl_seconds=ttl)  # type: ignore[arg-type]
    assert not state.exists()


def a_second_turn(snapshot: AgentSnapshot) -> bool:
    return snapshot.state is not None and snapshot.state.turn_count >= 2


async def test_wait_for_agent_snapshot_fails_at_once_on_a_stopped_session(
    tmp_path: Path, db_url: str  # noqa: F811 - the fixture
) -> None:
    """A stopped session never changes again: the wait says so and how it ended, instead of
    polling it for the whole timeout and then reporting only a timeout."""
    async with in_process(tmp_path, build_flow(tmp_path), database_url=db_url) as engine:
        await engine.sessions.start_session("s", "")
        await wait_for_agent_snapshot(engine.sessions, "s", lambda s: s.state, description="the session's state")
        await engine.client.stop_flow("s", "the test is done")
        with pytest.raises(AssertionError) as caught:
            await wait_for_agent_snapshot(engine.sessions, "s", a_second_turn, description="a second turn",
                                          timeout=HANGING_PROBE_SECONDS)
    assert str(caught.value).startswith(
        "session 's' is stopped with error 'the test is done', so it will never show a second turn; last snapshot")


async def test_read_step_history_of_a_closed_session_holds_only_step_events(
    tmp_path: Path, db_url: str  # noqa: F811 - the fixture
) -> None:
    """A stopped session's engine history ends with flow_closed, which names no Step: read_step_history
    leaves it out, so every entry it returns has a Step type and execution ID to assert on.
    Catches: flow-level events kept as entries with a blank step_type."""
    async with in_process(tmp_path, build_flow(tmp_path), database_url=db_url) as engine:
        await engine.sessions.start_session("s", "")
        await wait_for_agent_snapshot(engine.sessions, "s", lambda s: s.state, description="the session's state")
        await engine.client.stop_flow("s")
        history = await read_step_history(db_url, "s")
    assert [e for e in history if not (e.step_type and e.step_execution_id)] == []
    assert executed_steps(history) == ["StartAgentSession"]
    assert history[-1].step_execution_id == "AwaitUserMessage-1"  # its wait was the last Step event


async def test_wait_for_agent_snapshot_fails_at_once_on_a_failed_session(
    tmp_path: Path, db_url: str  # noqa: F811 - the fixture
) -> None:
    """A session its failure route ended (a run state too large to store) names its error."""
    flow = AgentSessionFlow(_OversizedRunStateRunner(), "Fails")
    async with in_process(tmp_path, flow, database_url=db_url) as engine:
        await engine.sessions.start_session("s", "hello")
        with pytest.raises(AssertionError) as caught:
            await wait_for_agent_snapshot(engine.sessions, "s", a_second_turn, description="a second turn",
                                          timeout=HANGING_PROBE_SECONDS)
    assert str(caught.value).startswith(
        "session 's' is failed with error \"the framework run state of turn turn-1 is too large to store: ")
    assert "so it will never show a second turn; last snapshot of 's': AgentSnapshot(" in str(caught.value)


async def test_wait_for_agent_snapshot_returns_what_a_closed_session_shows(
    tmp_path: Path, db_url: str  # noqa: F811 - the fixture
) -> None:
    """A probe a closed session passes still returns its value: only a wait it can never end fails."""
    async with in_process(tmp_path, build_flow(tmp_path), database_url=db_url) as engine:
        await engine.sessions.start_session("s", "")
        await wait_for_agent_snapshot(engine.sessions, "s", lambda s: s.state, description="the session's state")
        await engine.client.stop_flow("s")
        state = await wait_for_agent_snapshot(engine.sessions, "s", lambda s: s.state, description="its state")
    assert state.turn_count == 0


async def test_read_step_history_says_why_a_runners_call_failed(
    tmp_path: Path, db_url: str  # noqa: F811 - the fixture
) -> None:
    """A tool that raises a plain exception (an adapter's bug) is recorded by its effect, and the
    model sees only that the call failed: the Step history's failures carry the exception, so an
    adapter's test can see what went wrong without opening the engine's own history."""
    async with in_process(tmp_path, build_flow(tmp_path), database_url=db_url) as engine:
        await engine.sessions.start_session("s", "")
        await wait_for_agent_snapshot(engine.sessions, "s", lambda s: s.state, description="the session's state")
        await run_turn(engine.sessions, "s", script(
            {"tools": [{"id": "c1", "name": "read_x", "args": {"crash": "the adapter's bug"}}]}, {"answer": "done"}))
        history = await read_step_history(db_url, "s")
    failures = [(e.event_type, e.final_attempt, e.detail) for e in history
                if e.step_type == "CallTool" and e.event_type in ("attempt_failed", "step_failed")]
    assert failures[0] == ("attempt_failed", 1, "execute: RuntimeError: the adapter's bug")
    assert failures[-1][0] == "step_failed" and failures[-1][2].endswith("RuntimeError: the adapter's bug")


async def test_start_worker_names_a_worker_module_that_starts_no_worker(tmp_path: Path) -> None:
    """A worker module without its `if __name__ == "__main__": run_agent_worker(...)` exits at once
    with 0 and prints nothing: start_worker says what the module lacks, not only that it exited."""
    module = "agents.tests.scripted_agent"  # importable, and it starts nothing
    async with AgentTestStack(tmp_path, [build_flow(tmp_path)], module, worker_cwd=REPO_ROOT) as stack:
        with pytest.raises(AssertionError) as caught:
            await stack.start_worker()
    assert str(caught.value).endswith(
        f"(python -m {module} in {str(REPO_ROOT)!r}) exited with 0 before registering, printing nothing: the module "
        'started no Worker; call run_agent_worker(flows) in it under `if __name__ == "__main__":`')


async def test_start_worker_names_the_module_of_a_worker_that_crashed_at_import(tmp_path: Path) -> None:
    """A Worker child that fails at import shows its traceback, and which module in which directory."""
    module = "agents.tests.no_such_worker"
    async with AgentTestStack(tmp_path, [build_flow(tmp_path)], module, worker_cwd=REPO_ROOT) as stack:
        with pytest.raises(AssertionError) as caught:
            await stack.start_worker()
    message = str(caught.value)
    assert f"(python -m {module} in {str(REPO_ROOT)!r}) exited with 1 before registering:\n" in message
    assert "No module named agents.tests.no_such_worker" in message


async def test_start_worker_shows_the_end_of_a_long_output_of_a_worker_that_exited(tmp_path: Path) -> None:
    """A Worker child that printed more than the 40 lines start_worker shows before it failed: the
    last 40, with its error. Catches: the first 40 shown, without the error."""
    (tmp_path / "chatty_worker.py").write_text(
        "print('\\n'.join(f'line {n}' for n in range(100)))\nraise SystemExit('the last word')\n")
    async with AgentTestStack(tmp_path, [build_flow(tmp_path)], "chatty_worker", worker_cwd=tmp_path) as stack:
        with pytest.raises(AssertionError) as caught:
            await stack.start_worker()
    output = str(caught.value).split("exited with 1 before registering:\n", 1)[1]
    assert output.splitlines() == [f"line {n}" for n in range(61, 100)] + ["the last word"]


async def test_wait_for_agent_snapshot_names_a_step_no_worker_runs(tmp_path: Path) -> None:
    """A session whose Steps no Worker serves (the Worker child registers other flows, or none
    runs): the timeout names the Step left ready and the flow type to serve, not only the snapshot
    without state."""
    async with in_process(tmp_path, build_flow(tmp_path), worker=False) as engine:
        await engine.sessions.start_session("s", "hello")
        with pytest.raises(AssertionError) as caught:
            await wait_for_agent_snapshot(engine.sessions, "s", lambda s: s.state, description="its state", timeout=0.2)
    assert str(caught.value).startswith(
        "timed out after 0.2 s waiting for its state; last value: None; its active Steps: StartAgentSession-1 ready "
        "(a Step that stays ready has no Worker to run it: does the Worker child's Registry serve flow type "
        f"{engine.flow.flow_type!r}, and is it running on this database?); last snapshot of 's': "
        "AgentSnapshot(state=None")


async def test_a_second_stack_on_the_same_directory_keeps_the_first_stacks_worker_logs(tmp_path: Path) -> None:
    """Two stacks on one state directory (a second stack on the same database, as a restart test
    opens) number their Workers from 1 alike. Catches: the second stack's first Worker opening
    `worker-1.log` for writing, wiping the output of the first stack's Worker (the traceback kept
    in a failed test's tmp_path) or, with both stacks open, writing over a live Worker's log."""
    crashing = "agents.tests.no_such_worker"
    async with AgentTestStack(tmp_path, [build_flow(tmp_path)], crashing, worker_cwd=REPO_ROOT) as first:
        with pytest.raises(AssertionError):
            await first.start_worker()
        async with new_stack(tmp_path) as second:
            worker = await second.start_worker()
            assert worker.log_path != first.workers[0].log_path
    assert "No module named agents.tests.no_such_worker" in first.workers[0].log_tail()


async def test_a_gate_released_then_reset_at_once_lets_its_waiting_handler_go(tmp_path: Path) -> None:
    """release() then reset() right away, to stop the next handler at the same gate: the handler
    waiting there was released and goes on; the next one stops. Catches: the waiter, which polls
    for the release file, never seeing it (reset() deleted it first) and waiting for ever."""
    gate = FileGate(tmp_path, "g")
    waiting = asyncio.create_task(gate.wait_for_release())
    await gate.wait_until_reached(timeout=10)
    gate.release()
    gate.reset()  # no await in between: the waiter cannot look before the release file is gone
    await asyncio.wait_for(waiting, timeout=10)  # a bound on a hang, not a timing assertion
    following = asyncio.create_task(gate.wait_for_release())
    try:
        await gate.wait_until_reached(timeout=10)
        assert not following.done()
    finally:
        following.cancel()


async def test_a_gate_released_and_reset_the_moment_it_is_marked_lets_its_handler_go(tmp_path: Path) -> None:
    """The test sees the gate reached and calls release() then reset() before the handler does
    anything more: the handler goes on. Catches: the waiting token made after the reached mark,
    so release() found no token to delete and the handler waited for ever."""
    gate = FileGate(tmp_path, "g")
    mark = gate.mark_reached

    def marked_then_released_and_reset() -> None:
        mark()
        gate.release()  # what the test does the moment wait_until_reached() returns
        gate.reset()

    gate.mark_reached = marked_then_released_and_reset  # type: ignore[method-assign]
    await asyncio.wait_for(gate.wait_for_release(), timeout=10)  # a bound on a hang, not a timing assertion


async def test_a_gate_never_reached_names_the_file_it_looked_for(tmp_path: Path) -> None:
    """A handler that marks its gate in another directory (a Worker child given another state
    directory) never reaches the test's gate. Catches: a timeout saying only the gate's name, with
    nothing pointing at the directory the test looked in."""
    gate = FileGate(tmp_path, "g")
    FileGate(tmp_path / "elsewhere", "g").reached_path.parent.mkdir()
    FileGate(tmp_path / "elsewhere", "g").mark_reached()
    with pytest.raises(AssertionError) as caught:
        await gate.wait_until_reached(timeout=0.1)
    looked_for = str(tmp_path / "g.reached")
    assert f"waiting for gate g reached (its mark {looked_for!r}); last value: None" in str(caught.value)


async def test_a_worker_that_runs_on_another_database_is_named_when_start_worker_times_out(tmp_path: Path) -> None:
    """A Worker child that runs but registers in another database (its module passes
    run_agent_worker a database_url of its own, or worker_env overrides the URL): start_worker's
    timeout says where the stack looked and what to check, and kills the Worker. Catches: only
    "timed out waiting for worker N to register; last value: False"."""
    other = f"sqlite:///{tmp_path / 'other.db'}"
    stack = AgentTestStack(tmp_path, [build_flow(tmp_path)], WORKER_MODULE, worker_cwd=REPO_ROOT,
                           worker_env={ENV_DATABASE_URL: other})
    async with stack:
        with pytest.raises(AssertionError) as caught:
            await stack.start_worker(timeout=2)
        [worker] = stack.workers
        assert not worker.alive
    message = str(caught.value)
    assert f"it ran (python -m {WORKER_MODULE}) but did not register in {stack.database_url}, where the stack " \
           f"looks; does it run a Worker on another database (run_agent_worker's database_url, or " \
           f"{ENV_DATABASE_URL} in worker_env)" in message


def test_an_invocation_record_written_in_short_writes_is_read_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A record whose write the kernel takes only part of at a time (a signal, a nearly full disk)
    is still written whole, and read back as written. Catches: record() ignored what os.write
    returned, leaving a torn line that entries() then failed to parse, or dropped."""
    log = InvocationLog(tmp_path / "calls.jsonl")
    real_write = os.write

    def short_write(fd: int, data: bytes) -> int:
        return real_write(fd, data[:7])

    monkeypatch.setattr(os, "write", short_write)
    log.record("tool", name="write_x", arguments={"text": "é" * 40})
    log.record("model", call=2)
    monkeypatch.undo()
    assert log.entries() == [
        {"kind": "tool", "pid": os.getpid(), "name": "write_x", "arguments": {"text": "é" * 40}},
        {"kind": "model", "pid": os.getpid(), "call": 2},
    ]


def test_an_invocation_log_line_that_is_not_a_record_is_named(tmp_path: Path) -> None:
    """A line of the log that is not JSON (something else wrote to the file) fails entries() naming
    the file and the line, not with a bare JSONDecodeError."""
    log = InvocationLog(tmp_path / "calls.jsonl")
    log.record("tool", name="a")
    with log.path.open("a") as file:
        file.write("not json\n")
    with pytest.raises(ValueError, match=r"line 2 of the invocation log .*calls\.jsonl.* is not a JSON record"):
        log.entries()


@pytest.mark.parametrize("name", ["", "a/b", "/g"])
def test_a_file_gate_name_that_is_not_one_file_name_is_refused(tmp_path: Path, name: str) -> None:
    """A gate's name becomes its file names in the state directory: an empty one, or one with a '/'
    (a directory that may not exist, or a path out of the directory), is refused by name."""
    with pytest.raises(ValueError) as caught:
        FileGate(tmp_path, name)
    assert str(caught.value) == f"gate name {name!r} must be non-empty and contain no '/'"


def test_a_file_gate_name_that_is_not_text_is_refused_naming_it(tmp_path: Path) -> None:
    """Catches: FileGate(dir, 5) refused with "argument of type 'int' is not iterable"."""
    with pytest.raises(ValueError) as caught:
        FileGate(tmp_path, 5)  # type: ignore[arg-type]
    assert str(caught.value) == "gate name must be a str, got int: 5; give it as text"


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        pytest.param({"flows": "one"}, "AgentTestStack flows must be a list of Flows, got the single Flow "
                     "'ScriptedAgent'; give it as [flow]", id="one-flow"),
        pytest.param({"flows": None}, "AgentTestStack flows must be a list of Flows, got None", id="no-flows"),
        # Text is iterable too: without its own check it became a list of letters.
        pytest.param({"flows": "ScriptedAgent"}, "AgentTestStack flows must be a list of Flows, got 'ScriptedAgent'",
                     id="flow-name"),
        pytest.param({"worker_module": ""}, "AgentTestStack worker_module must be the name of the module a Worker "
                     "child runs (python -m <worker_module>), got ''", id="empty-module"),
        pytest.param({"worker_module": 5}, "AgentTestStack worker_module must be the name of the module a Worker "
                     "child runs (python -m <worker_module>), got 5", id="module-number"),
        pytest.param({"worker_env": {"DEX_SLOW": 1}}, "AgentTestStack worker_env must map str to str, got "
                     "'DEX_SLOW': 1; give each value as text, such as str(value)", id="env-number"),
        pytest.param({"worker_env": 5}, "AgentTestStack worker_env must be a dict of environment variables (str to "
                     "str), got 5", id="env-not-a-dict"),
    ],
)
def test_a_stack_refuses_flows_module_or_env_it_cannot_start_a_worker_with(
    tmp_path: Path, arguments: dict[str, Any], message: str
) -> None:
    """Refused when the stack is made, with nothing created. Catches: one Flow given alone failing with a
    bare TypeError ('AgentSessionFlow' object is not iterable), and a worker_module or an environment
    value that is not text accepted, to fail only in start_worker with subprocess's TypeError."""
    flow = build_flow(tmp_path)
    given = {"flows": [flow], "worker_module": WORKER_MODULE, **arguments}
    if given["flows"] == "one":
        given["flows"] = flow
    state = tmp_path / "state"
    with pytest.raises(ValueError) as caught:
        AgentTestStack(state, given["flows"], given["worker_module"], worker_cwd=REPO_ROOT,
                       worker_env=given.get("worker_env"))
    assert str(caught.value) == message
    assert not state.exists()


def test_run_agent_worker_names_a_single_flow_not_in_a_list(tmp_path: Path) -> None:
    """Catches: run_agent_worker(flow) in a Worker child failing with a bare TypeError ('AgentSessionFlow'
    object is not iterable), which start_worker showed as the child's output."""
    with pytest.raises(FlowDefinitionError, match=r"flows must be a collection of Flows, got the single item"):
        run_agent_worker(build_flow(tmp_path), database_url=f"sqlite:///{tmp_path / 'dex.db'}")  # type: ignore[arg-type]


async def test_start_worker_refuses_an_env_value_that_is_not_text(tmp_path: Path) -> None:
    """Catches: start_worker(env={"X": 1}) failing inside subprocess with "expected str, bytes or
    os.PathLike object, not int", naming neither the argument nor the variable."""
    async with new_stack(tmp_path) as stack:
        with pytest.raises(ValueError) as caught:
            await stack.start_worker({"DEX_SLOW": 1})  # type: ignore[dict-item]
        assert str(caught.value) == ("start_worker env must map str to str, got 'DEX_SLOW': 1; give each value as "
                                     "text, such as str(value)")
        assert stack.workers == []


async def test_a_released_handler_goes_on_though_another_of_its_process_reaches_the_reset_gate(
    tmp_path: Path,
) -> None:
    """release() then reset() at once, and the next handler of the same Worker (a parallel call of
    a sync tool, in a thread) reaches the gate before the released one looks: the released one goes
    on, the next one stops. Catches: one waiting token per process, which the next handler made
    again, holding the released handler at the gate for ever."""
    gate = FileGate(tmp_path, "g")
    waiting = asyncio.create_task(gate.wait_for_release())
    await gate.wait_until_reached(timeout=10)
    gate.release()
    gate.reset()
    following = threading.Thread(target=gate.wait_for_release_blocking)
    following.start()
    # The event loop is held until the next handler is at the gate: the released one cannot look first.
    while not gate.reached:
        time.sleep(0.001)  # noqa: ASYNC251 - holding the loop is the point
    try:
        await asyncio.wait_for(waiting, timeout=10)  # a bound on a hang, not a timing assertion
        assert following.is_alive()
    finally:
        gate.release()
        following.join()


def test_invocation_log_entries_filter_by_kind_and_every_field(tmp_path: Path) -> None:
    """entries() and count() keep the records of the kind given whose fields all match; a log no
    child wrote yet is empty, and a last line a live child is still writing is left out (not
    read as a broken record)."""
    log = InvocationLog(tmp_path / "calls.jsonl")
    assert log.entries() == [] and log.count("tool") == 0
    log.record("tool", name="refund", attempt=1)
    log.record("tool", name="lookup", attempt=1)
    log.record("model", name="refund", attempt=1)
    with log.path.open("a") as file:
        file.write('{"kind": "tool", "name": "ref')  # a record another child is writing now
    me = os.getpid()
    assert log.entries("tool", name="refund") == [{"kind": "tool", "pid": me, "name": "refund", "attempt": 1}]
    assert log.count("tool", name="refund", attempt=2) == 0
    assert log.count(name="refund") == 2
    assert log.count("tool") == 2
    assert log.count() == 3


async def test_wait_until_sleeps_no_further_than_its_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """An interval longer than the time left: the last probe runs at the deadline, not an interval
    later. Catches: sleeping the whole interval, so a wait of 0.5 s with interval=20 ran 20 s."""
    slept: list[float] = []
    real_sleep = asyncio.sleep

    async def recorded_sleep(seconds: float) -> None:
        slept.append(seconds)
        await real_sleep(0)

    answers = iter([False, "ready"])
    monkeypatch.setattr(asyncio, "sleep", recorded_sleep)
    assert await wait_until("an answer", lambda: next(answers), timeout=0.5, interval=HANGING_PROBE_SECONDS) == "ready"
    monkeypatch.undo()
    assert len(slept) == 1 and 0 < slept[0] <= 0.5


class _SnapshotReadBeforeTheClose:
    """A session client whose first snapshot read answers with `stale`, as a read that ran just
    before the session's last Step and close did."""

    def __init__(self, sessions: AgentSessionClient, stale: AgentSnapshot) -> None:
        self.client = sessions.client
        self._sessions = sessions
        self._stale: list[AgentSnapshot] = [stale]

    async def get_agent_snapshot(self, session_id: str) -> AgentSnapshot:
        if self._stale:
            return self._stale.pop()
        return await self._sessions.get_agent_snapshot(session_id)


async def test_wait_for_agent_snapshot_probes_a_closed_session_again_before_failing(
    tmp_path: Path, db_url: str  # noqa: F811 - the fixture
) -> None:
    """The snapshot a wait read may predate the session's close: on finding the session closed, the
    wait probes it as it ended once more, and returns what that shows. Catches: failing with 'will
    never show' a turn the closed session did show."""
    async with in_process(tmp_path, build_flow(tmp_path), database_url=db_url) as engine:
        await engine.sessions.start_session("s", "")
        before = await wait_for_agent_snapshot(engine.sessions, "s", lambda s: s if s.state else None,
                                               description="the session's state")
        await run_turn(engine.sessions, "s", script({"answer": "done"}))
        await engine.client.stop_flow("s")
        stale: Any = _SnapshotReadBeforeTheClose(engine.sessions, before)
        ended = await wait_for_agent_snapshot(stale, "s", lambda s: s if s.state and s.state.turn_count else None,
                                              description="the first turn", timeout=HANGING_PROBE_SECONDS)
    assert ended.state is not None and ended.state.turn_count == 1
