"""AgentTestStack's Worker children (seed 003 "Testing an adapter"): each runs in its own process
group, kill() and stop() reach the whole group, and leaving the stack leaves no Worker running;
neither does a start_worker() that fails, nor a test process that dies without leaving the stack.

The Worker's own long-lived subprocess stands for what a real Worker may start (a tool's subprocess,
an MCP server): a kill that reached only the Worker would leave it running into the next test.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import textwrap
from pathlib import Path

import pytest
from agents.tests.conftest import REPO_ROOT, WORKER_MODULE
from agents.tests.scripted_agent import ENV_START_GATE, build_flow
from agents.tests.scripted_worker import ENV_STRAY_PID_FILE

from dex_agents.testing import (
    ENV_DATABASE_URL,
    ENV_PARENT_PID,
    ENV_STATE_DIR,
    AgentTestStack,
    FileGate,
    WorkerProcess,
    wait_until,
)

# A test process that starts a Worker (with a stray subprocess), prints both PIDs, and waits to
# be killed: it stands for a pytest run a CI timeout SIGKILLs in the middle of a test.
DOOMED_TEST_PROCESS = textwrap.dedent("""
    import asyncio, sys
    from pathlib import Path
    from agents.tests.conftest import REPO_ROOT, WORKER_MODULE
    from agents.tests.scripted_agent import build_flow
    from agents.tests.scripted_worker import ENV_STRAY_PID_FILE
    from dex_agents.testing import AgentTestStack

    async def main(state_dir: Path) -> None:
        async with AgentTestStack(state_dir, [build_flow(state_dir)], WORKER_MODULE, worker_cwd=REPO_ROOT) as stack:
            pid_file = state_dir / "stray.pid"
            worker = await stack.start_worker({ENV_STRAY_PID_FILE: str(pid_file)})
            print(worker.pid, pid_file.read_text(), flush=True)
            await asyncio.sleep(600)

    asyncio.run(main(Path(sys.argv[1])))
""")
# The same test process with its Worker frozen (SIGSTOP to the Worker's group, as a zombie test
# does) when it is killed: the Worker's watching thread cannot run until something resumes it.
FROZEN_DOOMED_TEST_PROCESS = DOOMED_TEST_PROCESS.replace(
    "        print(worker.pid,", "        os.killpg(worker.pid, signal.SIGSTOP)\n        print(worker.pid,",
).replace("import asyncio, sys", "import asyncio, os, signal, sys")
assert "SIGSTOP" in FROZEN_DOOMED_TEST_PROCESS and "import asyncio, os, signal, sys" in FROZEN_DOOMED_TEST_PROCESS
# The same with standby Worker children (standby_workers.py), which wait at their start gates,
# unregistered, when the test process is killed: it prints their PIDs once both reached the gate.
DOOMED_STANDBY_TEST_PROCESS = textwrap.dedent("""
    import asyncio, sys
    from pathlib import Path
    from agents.tests.conftest import REPO_ROOT, WORKER_MODULE
    from agents.tests.scripted_agent import build_flow
    from agents.tests.standby_workers import SharedStack
    from dex_agents.testing import AgentTestStack, wait_until

    async def main(state_dir: Path) -> None:
        async with AgentTestStack(state_dir, [build_flow(state_dir)], WORKER_MODULE, worker_cwd=REPO_ROOT) as stack:
            shared = SharedStack(stack, standbys=1)
            await wait_until("the standbys at their gates", lambda: all(g.reached for _, g in shared.standbys),
                             timeout=60)
            print(*(w.pid for w, _ in shared.standbys), flush=True)
            await asyncio.sleep(600)

    asyncio.run(main(Path(sys.argv[1])))
""")
# The same with a Worker child held at a FileGate before it calls run_agent_worker (gated_worker.py):
# it prints the child's PID once the child waits there.
DOOMED_GATED_TEST_PROCESS = textwrap.dedent("""
    import asyncio, sys
    from pathlib import Path
    from agents.tests.conftest import REPO_ROOT
    from agents.tests.gated_worker import START_GATE
    from agents.tests.scripted_agent import build_flow
    from agents.tests.scripted_worker import ENV_STRAY_PID_FILE
    from dex_agents.testing import AgentTestStack, FileGate

    async def main(state_dir: Path) -> None:
        async with AgentTestStack(state_dir, [build_flow(state_dir)], "agents.tests.gated_worker",
                                  worker_cwd=REPO_ROOT) as stack:
            pid_file = state_dir / "stray.pid"
            starting = asyncio.create_task(stack.start_worker({ENV_STRAY_PID_FILE: str(pid_file)}))
            child = await FileGate(state_dir, START_GATE).wait_until_reached(timeout=60)
            print(child, pid_file.read_text(), flush=True)
            await starting

    asyncio.run(main(Path(sys.argv[1])))
""")
# The doomed test process imports, then starts and registers a Worker: seconds on a loaded machine.
DOOMED_START_SECONDS = 60.0


def alive(pid: int) -> bool:
    """Whether `pid` still runs. The stray's parent (the Worker) is gone by then, so init reaps it;
    a zombie awaiting that counts as ended."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def worker_with_stray(stack: AgentTestStack, name: str) -> tuple[WorkerProcess, int]:
    """A Worker that started a subprocess of its own, and that subprocess's PID."""
    pid_file = stack.state_dir / f"{name}.pid"
    worker = await stack.start_worker({ENV_STRAY_PID_FILE: str(pid_file)})
    stray = int(pid_file.read_text())
    assert alive(stray) and os.getpgid(stray) == worker.pid
    return worker, stray


async def ended(pid: int) -> None:
    try:
        await wait_until(f"process {pid} to end", lambda: not alive(pid))
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)  # never leave it behind, even when the test fails


async def test_each_worker_runs_in_its_own_process_group(stack: AgentTestStack) -> None:
    first, second = await stack.start_worker(), await stack.start_worker()
    groups = [os.getpgid(first.pid), os.getpgid(second.pid)]
    assert groups == [first.pid, second.pid]
    assert os.getpgrp() not in groups


async def test_kill_takes_down_the_workers_whole_process_group(stack: AgentTestStack) -> None:
    worker, stray = await worker_with_stray(stack, "killed")
    bystander, bystanders_stray = await worker_with_stray(stack, "bystander")
    worker.kill()
    assert worker.process.returncode == -signal.SIGKILL
    await ended(stray)
    # Another Worker's group is not touched.
    assert bystander.alive and alive(bystanders_stray)


async def test_stop_signals_the_whole_process_group(stack: AgentTestStack) -> None:
    """stop() is graceful for the Worker (it exits 0 on SIGTERM) and reaches its group too."""
    worker, stray = await worker_with_stray(stack, "stopped")
    assert await worker.stop() == 0
    await ended(stray)


async def test_leaving_the_stack_kills_every_worker(tmp_path: Path) -> None:
    async with AgentTestStack(tmp_path, [build_flow(tmp_path)], WORKER_MODULE, worker_cwd=REPO_ROOT) as stack:
        first, first_stray = await worker_with_stray(stack, "first")
        second, second_stray = await worker_with_stray(stack, "second")
    assert [first.process.poll(), second.process.poll()] == [-signal.SIGKILL, -signal.SIGKILL]
    await ended(first_stray)
    await ended(second_stray)


async def test_a_worker_that_never_registers_is_killed_when_start_worker_fails(stack: AgentTestStack) -> None:
    """A start_worker() cancelled (or timed out) while its Worker is still unregistered kills that
    Worker: the caller never got hold of it to kill it."""
    gate = FileGate(stack.state_dir, "never-released")  # the Worker waits there, before it registers
    starting = asyncio.create_task(stack.start_worker({ENV_START_GATE: gate.name}))
    try:
        await gate.wait_until_reached()
    finally:
        starting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await starting
    [worker] = stack.workers
    assert worker.process.returncode == -signal.SIGKILL


async def test_start_worker_waits_for_its_own_worker_though_another_is_registered(stack: AgentTestStack) -> None:
    """start_worker() returns once the Worker it started registered, not any Worker. Catches: a
    second start_worker() returning at once because the first Worker was registered, so a test
    that killed the first went on with no Worker serving its Steps."""
    await stack.start_worker()
    gate = FileGate(stack.state_dir, "second-starts")  # the second Worker waits there, unregistered
    starting = asyncio.create_task(stack.start_worker({ENV_START_GATE: gate.name}))
    try:
        await gate.wait_until_reached()
        assert not starting.done()
        gate.release()
        second = await starting
    finally:
        gate.release()
        starting.cancel()
    assert second.pid in [row[2] for row in await stack.client.store.list_workers()]


@pytest.mark.parametrize("frozen", [False, True], ids=["running", "frozen"])
async def test_workers_end_when_the_test_process_dies_without_leaving_the_stack(tmp_path: Path, frozen: bool) -> None:
    """A test process SIGKILLed inside `async with AgentTestStack` (a CI timeout) runs no cleanup; its
    Worker notices it was handed to another parent and SIGKILLs its process group, stray and all;
    also when the test had frozen the Worker's group with SIGSTOP. Catches: a frozen Worker, whose
    watching thread never ran again, left stopped for ever with its stray."""
    script = FROZEN_DOOMED_TEST_PROCESS if frozen else DOOMED_TEST_PROCESS
    doomed = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, str(tmp_path), cwd=REPO_ROOT, stdout=asyncio.subprocess.PIPE)
    worker = stray = 0
    try:
        assert doomed.stdout is not None
        line = await asyncio.wait_for(doomed.stdout.readline(), DOOMED_START_SECONDS)
        assert line, f"the test process exited with {await doomed.wait()} before its Worker registered"
        worker, stray = (int(pid) for pid in line.split())
        assert alive(worker) and alive(stray)
        doomed.kill()
        assert await doomed.wait() == -signal.SIGKILL
        await ended(worker)
        await ended(stray)
    finally:
        if doomed.returncode is None:
            doomed.kill()
            await doomed.wait()
        for pid in (worker, stray):
            if pid and alive(pid):
                os.kill(pid, signal.SIGKILL)  # never leave them behind, even when the test fails


async def test_standby_workers_end_when_the_test_process_dies_without_leaving_the_stack(tmp_path: Path) -> None:
    """A standby Worker child waits at its start gate before run_agent_worker watches its parent; a
    test process SIGKILLed meanwhile (a CI timeout) runs no cleanup, so the standby must notice by
    itself. Catches: standbys left waiting at their gates for ever, one per standby of every such run."""
    doomed = await asyncio.create_subprocess_exec(
        sys.executable, "-c", DOOMED_STANDBY_TEST_PROCESS, str(tmp_path), cwd=REPO_ROOT,
        stdout=asyncio.subprocess.PIPE)
    standbys: list[int] = []
    try:
        assert doomed.stdout is not None
        line = await asyncio.wait_for(doomed.stdout.readline(), DOOMED_START_SECONDS)
        assert line, f"the test process exited with {await doomed.wait()} before its standbys waited"
        standbys = [int(pid) for pid in line.split()]
        assert len(standbys) == 2 and all(alive(pid) for pid in standbys)
        doomed.kill()
        assert await doomed.wait() == -signal.SIGKILL
        for pid in standbys:
            await ended(pid)
    finally:
        if doomed.returncode is None:
            doomed.kill()
            await doomed.wait()
        for pid in standbys:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)  # never leave them behind, even when the test fails


async def test_a_worker_child_waiting_at_a_gate_ends_when_the_test_process_dies(tmp_path: Path) -> None:
    """A Worker child held at a FileGate before it calls run_agent_worker (its module waits until
    the test has set something up), when the test process is SIGKILLed: no stack is left to kill it
    and run_agent_worker's watch has not started, so the gate's wait must notice by itself.
    The child's own subprocess (started before the gate) ends with it. Catches: the child waiting
    at its gate for ever, and one that ended alone, leaving its subprocess running."""
    doomed = await asyncio.create_subprocess_exec(
        sys.executable, "-c", DOOMED_GATED_TEST_PROCESS, str(tmp_path), cwd=REPO_ROOT,
        stdout=asyncio.subprocess.PIPE)
    child = stray = 0
    try:
        assert doomed.stdout is not None
        line = await asyncio.wait_for(doomed.stdout.readline(), DOOMED_START_SECONDS)
        assert line, f"the test process exited with {await doomed.wait()} before its Worker child waited"
        child, stray = map(int, line.split())
        assert alive(child) and alive(stray)
        doomed.kill()
        assert await doomed.wait() == -signal.SIGKILL
        await ended(child)
        await ended(stray)
    finally:
        if doomed.returncode is None:
            doomed.kill()
            await doomed.wait()
        for pid in (child, stray):
            if pid and alive(pid):
                os.kill(pid, signal.SIGKILL)  # never leave it behind, even when the test fails


@pytest.mark.parametrize("query", ["", "?synchronous=NORMAL"])
async def test_a_relative_sqlite_url_names_the_same_file_for_its_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, query: str,
) -> None:
    """A relative `database_url` names a file in the test's working directory; Worker children start
    in `worker_cwd` (the repository root), and must open that same file. Catches: each Worker
    creating a database of that name in the repository instead, never registering where the stack
    looks, and start_worker timing out after 30 s with nothing said about the path."""
    monkeypatch.chdir(tmp_path)
    state = tmp_path / "state"
    state.mkdir()
    stray = REPO_ROOT / "rel" / "dex.db"
    assert not stray.parent.exists()
    try:
        async with AgentTestStack(state, [build_flow(state)], WORKER_MODULE, worker_cwd=REPO_ROOT,
                                  database_url=f"sqlite:///rel/dex.db{query}") as stack:
            worker = await asyncio.wait_for(stack.start_worker(), 20)
            assert any(row[2] == worker.pid for row in await stack.client.store.list_workers())
            assert stack.database_url == f"sqlite:///{tmp_path / 'rel' / 'dex.db'}{query}"
        assert (tmp_path / "rel" / "dex.db").exists()
        assert not stray.parent.exists()
    finally:
        if stray.parent.exists():  # never leave the Worker's stray database in the repository
            shutil.rmtree(stray.parent)


async def test_a_state_directory_that_does_not_exist_yet_is_made(tmp_path: Path) -> None:
    """The state directory holds the Workers' logs and the gates' marks. With the database elsewhere
    (a PostgreSQL URL, or a SQLite file in another directory) nothing else creates it. Catches:
    start_worker failing with FileNotFoundError on the Worker's log."""
    state = tmp_path / "not-yet" / "state"
    async with AgentTestStack(state, [build_flow(state)], WORKER_MODULE, worker_cwd=REPO_ROOT,
                              database_url=f"sqlite:///{tmp_path / 'dex.db'}") as stack:
        worker = await asyncio.wait_for(stack.start_worker(), 20)
        assert any(row[2] == worker.pid for row in await stack.client.store.list_workers())
    assert (state / "worker-1.log").exists()


def test_an_in_memory_sqlite_url_is_refused_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers cannot share an in-memory database. Catches: the stack making ':memory:' an absolute
    path, which the engine then opened as a file of that name."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="names an in-memory database"):
        AgentTestStack(tmp_path, [build_flow(tmp_path)], WORKER_MODULE, database_url="sqlite:///:memory:")
    assert [p.name for p in tmp_path.iterdir()] == []


@pytest.mark.parametrize("kind", ["bytes", "PostgresDsn"])
def test_a_database_url_that_is_not_a_str_is_refused_by_name_without_its_password(tmp_path: Path, kind: str) -> None:
    """A URL given as bytes or a pydantic PostgresDsn is refused naming database_url, with *** for
    its password. Catches: a bare AttributeError from urlparse for a PostgresDsn, and bytes blamed
    on lease_ttl_seconds."""
    url = "postgresql://app:Hunter2-pw@db.example:5432/app"
    if kind == "bytes":
        given: object = url.encode()
    else:
        pydantic = pytest.importorskip("pydantic")
        given = pydantic.TypeAdapter(pydantic.PostgresDsn).validate_python(url)
    with pytest.raises(ValueError) as caught:
        AgentTestStack(tmp_path, [build_flow(tmp_path)], WORKER_MODULE, database_url=given)  # type: ignore[arg-type]
    assert str(caught.value).startswith(f"AgentTestStack database_url must be a str, got {kind}: ")
    assert "postgresql://app:***@db.example:5432/app" in str(caught.value) and "Hunter2-pw" not in str(caught.value)


async def test_a_subprocess_of_a_worker_child_waits_at_a_gate_until_released(tmp_path: Path) -> None:
    """A subprocess the Worker module starts before run_agent_worker inherits the test process's
    PID in ENV_PARENT_PID, though its parent is the Worker. Catches: its gate's wait taking it for
    an orphaned Worker child and ending it (or its parent's group) while the test runs."""
    waiter = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "import sys; from dex_agents.testing import FileGate; "
        "FileGate(sys.argv[1], 'g').wait_for_release_blocking()", str(tmp_path),
        env={**os.environ, ENV_PARENT_PID: str(os.getppid())})  # a live process that is not its parent
    try:
        gate = FileGate(tmp_path, "g")
        await gate.wait_until_reached()
        gate.release()
        assert await asyncio.wait_for(waiter.wait(), DOOMED_START_SECONDS) == 0
    finally:
        if waiter.returncode is None:
            waiter.kill()
            await waiter.wait()


# A Worker child whose second thread, once the parent watch runs, prints what a subprocess started
# then would inherit as ENV_PARENT_PID, and ends the child.
INHERITED_PARENT_PID_REPORTER = textwrap.dedent("""
    import os, sys, threading, time
    from pathlib import Path
    from agents.tests.scripted_agent import build_flow
    from dex_agents.testing import ENV_PARENT_PID, run_agent_worker

    def report() -> None:
        while not any(t.name.startswith("dex-test-parent-watch:") for t in threading.enumerate()):
            time.sleep(0.01)
        print(os.environ.get(ENV_PARENT_PID, "unset"), flush=True)
        os._exit(0)

    threading.Thread(target=report, daemon=True).start()
    run_agent_worker([build_flow(Path(sys.argv[1]))], database_url=f"sqlite:///{Path(sys.argv[1]) / 'dex.db'}")
""")


async def test_a_worker_childs_subprocesses_do_not_inherit_the_test_process_pid(tmp_path: Path) -> None:
    """run_agent_worker takes ENV_PARENT_PID out of the Worker's environment. Catches: it left there,
    so a tool's subprocess started in a session of its own and waiting at a FileGate took the
    Worker for a dead test process and SIGKILLed itself."""
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", INHERITED_PARENT_PID_REPORTER, str(tmp_path), cwd=REPO_ROOT,
        env={**os.environ, ENV_PARENT_PID: str(os.getpid())}, stdout=asyncio.subprocess.PIPE,
        start_new_session=True)
    try:
        out, _ = await asyncio.wait_for(child.communicate(), DOOMED_START_SECONDS)  # a bound on a hang
    finally:
        if child.returncode is None:
            os.killpg(child.pid, signal.SIGKILL)
            await child.wait()
    assert (child.returncode, out.decode().strip()) == (0, "unset")


async def test_a_worker_that_does_not_lead_its_process_group_is_refused(tmp_path: Path) -> None:
    """run_agent_worker with ENV_PARENT_PID set in a process that shares its parent's group (started
    otherwise than by start_worker) exits naming the cause and the fix, before it runs a Worker.
    Catches: the refusal dropped, and the Worker run with a watch whose SIGKILL of 'its' process group
    (os.killpg of its own PID) names a group it does not lead."""
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "import sys; from dex_agents.testing import run_agent_worker; "
        "run_agent_worker([], database_url=sys.argv[1])", f"sqlite:///{tmp_path / 'dex.db'}",
        env={**os.environ, ENV_PARENT_PID: str(os.getpid())}, stderr=asyncio.subprocess.PIPE)
    try:
        _, err = await asyncio.wait_for(child.communicate(), DOOMED_START_SECONDS)  # a bound on a hang
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()
    assert child.returncode == 1
    assert err.decode().strip().endswith(
        f"run_agent_worker: {ENV_PARENT_PID} is set, but process {child.pid} does not lead its process group "
        f"{os.getpgrp()}; start Workers with AgentTestStack.start_worker")


def test_a_sqlite_url_with_a_host_is_left_for_the_engine_to_refuse(tmp_path: Path) -> None:
    """sqlite://host/dex.db (two slashes: 'host' is a host part) is not made into a file path: the
    engine refuses it by name, saying how many slashes to write. Catches: the stack dropping the
    host and opening ./dex.db, a file the caller never named."""
    with pytest.raises(ValueError, match=r"sqlite URL 'sqlite://host/dex\.db' has a host part \('host'\)"):
        AgentTestStack(tmp_path, [build_flow(tmp_path)], WORKER_MODULE, database_url="sqlite://host/dex.db")


async def test_a_worker_child_takes_the_stacks_lease_ttl(tmp_path: Path) -> None:
    """A stack's lease_ttl_seconds reaches its Worker children: the lease they register with is
    that long. Catches: the children keeping the default 2 s lease whatever the stack was given."""
    ttl = 60.0
    async with AgentTestStack(tmp_path, [build_flow(tmp_path)], WORKER_MODULE, worker_cwd=REPO_ROOT,
                              lease_ttl_seconds=ttl) as stack:
        worker = await stack.start_worker()
        [(started_ms, expires_ms)] = [(row[3], row[4]) for row in await stack.client.store.list_workers()
                                      if row[2] == worker.pid]
    assert expires_ms - started_ms >= ttl * 1000


async def test_run_agent_worker_serves_the_database_url_it_is_given(tmp_path: Path) -> None:
    """run_agent_worker's database_url wins over ENV_DATABASE_URL: a Worker module that names its
    database serves that one. Catches: the environment's URL taken first, the Worker registering
    in a database other than the one its module named."""
    async with AgentTestStack(tmp_path, [build_flow(tmp_path)], WORKER_MODULE, worker_cwd=REPO_ROOT) as stack:
        worker = await asyncio.create_subprocess_exec(
            sys.executable, "-c", "import sys; from agents.tests.scripted_agent import build_flow; "
            "from dex_agents.testing import run_agent_worker; "
            "run_agent_worker([build_flow()], database_url=sys.argv[1])",
            stack.database_url, cwd=REPO_ROOT, start_new_session=True,
            env={**os.environ, ENV_STATE_DIR: str(tmp_path), ENV_DATABASE_URL: f"sqlite:///{tmp_path / 'other.db'}"})
        try:
            await wait_until(f"worker {worker.pid} to register",
                             lambda: registered(stack, worker.pid), timeout=DOOMED_START_SECONDS)
        finally:
            os.killpg(worker.pid, signal.SIGKILL)
            await worker.wait()


async def registered(stack: AgentTestStack, pid: int) -> bool:
    return any(row[2] == pid for row in await stack.client.store.list_workers())
