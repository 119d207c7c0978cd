"""A private engine in a temporary SQLite file, a Client, and Worker child processes to kill."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import BinaryIO, Literal
from urllib.parse import urlparse

from dex_engine import AsyncClient, AsyncWorker, Flow, Registry, WorkerOptions
from dex_engine._open import shown_url, shown_url_value

from .._client import AgentSessionClient
from .._policy import shown
from .._session_flow import AgentSessionFlow
from ._history import StepHistoryEntry, to_step_history
from ._waiting import DEFAULT_WAIT_SECONDS, wait_until

# What a Worker child reads from its environment (set by AgentTestStack.start_worker).
ENV_DATABASE_URL = "DEX_AGENTS_TEST_DATABASE_URL"
ENV_STATE_DIR = "DEX_AGENTS_TEST_STATE_DIR"
ENV_LEASE_TTL = "DEX_AGENTS_TEST_LEASE_TTL"
# The PID of the test process, set by start_worker: a Worker child ends (with its process group)
# once that process is gone. A helper that starts Worker children itself sets it the same way.
ENV_PARENT_PID = "DEX_AGENTS_TEST_PARENT_PID"

# A killed Worker's lease expires after this long and its Steps are taken over. Short, so kill
# tests run fast, but well above a loaded 2-core CI machine's scheduling hiccups.
DEFAULT_TEST_LEASE_TTL_SECONDS = 2.0
# Parallel tool Steps of one response need slots of their own.
TEST_WORKER_MAX_CONCURRENT_TASKS = 64
# How often a Worker child looks whether the test process is still its parent: a test process
# killed without leaving its stack leaves no Worker running for more than about this long.
PARENT_WATCH_SECONDS = 0.2
# prctl's option for the signal sent when the parent dies (<linux/prctl.h>).
PR_SET_PDEATHSIG = 1


def test_worker_options(database_url: str, lease_ttl_seconds: float) -> WorkerOptions:
    return WorkerOptions(
        database_url=database_url, max_concurrent_tasks=TEST_WORKER_MAX_CONCURRENT_TASKS,
        lease_ttl_seconds=lease_ttl_seconds, lease_renew_seconds=lease_ttl_seconds / 5,
        housekeeping_seconds=min(0.1, lease_ttl_seconds / 10), poll_seconds=0.01, shutdown_grace_seconds=5.0,
    )


def _stack_arguments_problem(flows: object, worker_module: object, worker_env: object) -> str | None:
    """What AgentTestStack cannot use, or None. Checked when the stack is made: one Flow given alone
    failed with a bare TypeError ('AgentSessionFlow' object is not iterable), and a worker_module or an
    environment value that is not text only at start_worker, in subprocess, naming neither."""
    if isinstance(flows, Flow):
        return f"flows must be a list of Flows, got the single Flow {flows.flow_type!r}; give it as [flow]"
    if not isinstance(flows, Iterable) or isinstance(flows, str | bytes | Mapping):
        return f"flows must be a list of Flows, got {shown(flows, None)}"
    if not isinstance(worker_module, str) or not worker_module.strip():
        return (f"worker_module must be the name of the module a Worker child runs (python -m <worker_module>), "
                f"got {shown(worker_module, None)}")
    return _env_problem("worker_env", worker_env)


def _env_problem(label: str, env: object) -> str | None:
    """What keeps `env` (a Worker child's added environment) from being one, or None."""
    if env is None:
        return None
    try:
        given = dict(env)  # type: ignore[call-overload]  # what the stack makes of it: pairs are taken too
    except (TypeError, ValueError):
        return f"{label} must be a dict of environment variables (str to str), got {shown(env, None)}"
    odd = [(key, value) for key, value in given.items() if not isinstance(key, str) or not isinstance(value, str)]
    if odd:
        key, value = odd[0]
        return (f"{label} must map str to str, got {shown(key, None)}: {shown(value, None)}; give each value as "
                "text, such as str(value)")
    return None


def _check_lease_ttl(database_url: str, lease_ttl_seconds: object) -> None:
    """Refuse a lease TTL no Worker child can use, here: its WorkerOptions would refuse it only in
    the child, which start_worker then reports as a Worker that exited before registering."""
    if isinstance(lease_ttl_seconds, bool) or not isinstance(lease_ttl_seconds, int | float):
        raise TypeError(f"AgentTestStack lease_ttl_seconds must be a number of seconds, got "
                        f"{type(lease_ttl_seconds).__name__}: {lease_ttl_seconds!r}")
    try:
        test_worker_options(database_url, lease_ttl_seconds)
    except ValueError as exc:
        raise ValueError(f"AgentTestStack lease_ttl_seconds={lease_ttl_seconds!r} gives its Workers {exc}") from None


def run_agent_worker(flows: Sequence[Flow], *, database_url: str | None = None) -> None:
    """Run a Worker for `flows` until SIGTERM or SIGINT: the body of a Worker child process.

    The database URL and lease timing come from the environment AgentTestStack sets. Started by
    AgentTestStack, the Worker SIGKILLs its own process group once the test process that started
    it is gone (killed, say, by a CI timeout before it could leave the stack).
    """
    url = database_url or os.environ.get(ENV_DATABASE_URL)
    if not url:
        raise SystemExit(f"run_agent_worker: set {ENV_DATABASE_URL} or pass database_url")
    ttl = float(os.environ.get(ENV_LEASE_TTL, DEFAULT_TEST_LEASE_TTL_SECONDS))
    # Taken out of the environment, so that no subprocess of this Worker takes the test process
    # for its own parent.
    parent = os.environ.pop(ENV_PARENT_PID, None)
    if parent is not None:
        _watch_parent(int(parent))
    # Registry checks `flows` itself: list(flows) of one Flow given alone failed with a bare TypeError.
    asyncio.run(_serve(Registry(flows), test_worker_options(url, ttl)))


def _watch_parent(parent_pid: int) -> None:
    """SIGKILL this Worker's process group, as WorkerProcess.kill() would, once `parent_pid` is no
    longer this process's parent: the test process died and the Worker was handed to init.

    A thread polling getppid(), not PR_SET_PDEATHSIG alone: that fires when the parent *thread* that
    spawned the child ends (an event loop in a thread of a live test process, say), it is Linux
    only, and it would kill the Worker but not the subprocesses in its group. A thread, not a task,
    so that a handler blocking the Worker's event loop cannot hold it up. A Worker the test froze
    (SIGSTOP) runs no thread, though: on Linux the parent's death also sends it SIGCONT
    (_resume_when_orphaned), and the thread then sees the new parent.
    """
    if os.getpgrp() != os.getpid():
        # AgentTestStack starts each Worker as the leader of a new process group; killing any
        # other group could reach processes that are not the Worker's.
        raise SystemExit(f"run_agent_worker: {ENV_PARENT_PID} is set, but process {os.getpid()} does not lead "
                         f"its process group {os.getpgrp()}; start Workers with AgentTestStack.start_worker")

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_WATCH_SECONDS)
        os.killpg(os.getpid(), signal.SIGKILL)

    _resume_when_orphaned()
    threading.Thread(target=watch, name=f"dex-test-parent-watch:{parent_pid}", daemon=True).start()


def exit_if_test_process_gone() -> None:
    """In a Worker child before run_agent_worker watches its parent (waiting at a FileGate, say):
    SIGKILL the child's process group, as WorkerProcess.kill() would, if the test process that
    started it is gone. Nothing else would: the test process SIGKILLed (a CI timeout) left no stack.

    Does nothing once run_agent_worker has taken ENV_PARENT_PID, nor in a process that does not lead
    its group: a subprocess the Worker module started first inherits the variable, but its parent
    is the Worker, not the test process."""
    parent = os.environ.get(ENV_PARENT_PID)
    if parent is None or os.getpgrp() != os.getpid() or os.getppid() == int(parent):
        return
    os.killpg(os.getpid(), signal.SIGKILL)


def _resume_when_orphaned() -> None:
    """On Linux, have the kernel send this process SIGCONT when the thread that started it ends.

    A Worker frozen with SIGSTOP when the test process dies would otherwise stay stopped for ever,
    with every subprocess of its group. SIGCONT, not SIGKILL: that thread may end while the test
    process lives on (see _watch_parent), and a resumed Worker only goes on running. Best effort:
    where prctl is missing or refuses, a frozen Worker stays as it was before.
    """
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGCONT, 0, 0, 0)


async def _serve(registry: Registry, options: WorkerOptions) -> None:
    worker = AsyncWorker(registry, options)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: asyncio.ensure_future(worker.stop()))
    await worker.run()


def _absolute_sqlite_url(url: str) -> str:
    """`url`, with a relative SQLite path made absolute against this process's working directory.

    The test process opens the database here, and Worker children start in worker_cwd, where the
    relative path would name (and create) another database: they would never register where the
    stack looks. The engine's reading of the path: as written after "sqlite:///", relative unless
    it starts with a fourth slash. A URL the engine refuses (a host, a '#', a tab or line break that
    URL parsing drops) is left as given for it to refuse.
    """
    parsed = urlparse(url)
    if parsed.scheme != "sqlite" or parsed.netloc or any(c in url for c in "#\t\r\n"):
        return url
    path = parsed.path[1:] if parsed.path.startswith("/") else parsed.path
    if not path or path == ":memory:" or os.path.isabs(path):  # the engine refuses the first two by name
        return url
    return f"sqlite:///{os.path.abspath(path)}" + (f"?{parsed.query}" if parsed.query else "")


def _new_worker_log(state_dir: Path) -> tuple[Path, BinaryIO]:
    """The lowest-numbered `worker-<n>.log` in `state_dir` that does not exist yet, created.

    Created exclusively, never truncated: another AgentTestStack on the same directory (a second
    stack on the same database, at once or after the first) numbers its Workers from 1 too, and
    opening its `worker-1.log` for writing would wipe the first stack's Worker output (the
    traceback of a failed test, kept in its tmp_path) or mix two live Workers' output in one file.
    """
    for number in itertools.count(1):
        path = state_dir / f"worker-{number}.log"
        with contextlib.suppress(FileExistsError):
            return path, path.open("xb")
    raise AssertionError("unreachable: itertools.count never ends")


class WorkerProcess:
    """A Worker child in its own process group, so a signal reaches it and nothing else."""

    def __init__(self, process: subprocess.Popen[bytes], log_path: Path) -> None:
        self.process = process
        self.log_path = log_path

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL the whole process group now: no cleanup, no graceful shutdown."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    async def stop(self, timeout: float = DEFAULT_WAIT_SECONDS) -> int:
        """SIGTERM (graceful: running Steps finish), then wait for the exit code."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        await wait_until(f"worker {self.pid} to exit", lambda: self.process.poll() is not None, timeout=timeout)
        return self.process.returncode

    def log_tail(self, lines: int = 40) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


class AgentTestStack:
    """A private engine (a SQLite file under `tmp_path`), a Client, and Worker processes.

    `worker_module` is run as `python -m <worker_module>` in `worker_cwd`; it calls
    run_agent_worker with the same Flows. `worker_env` is added to each Worker's environment;
    ENV_STATE_DIR names `tmp_path`, where FileGates and InvocationLogs live.
    """

    def __init__(
        self,
        tmp_path: Path | str,
        flows: Sequence[Flow],
        worker_module: str,
        *,
        worker_cwd: Path | str | None = None,
        worker_env: dict[str, str] | None = None,
        database_url: str | None = None,
        lease_ttl_seconds: float = DEFAULT_TEST_LEASE_TTL_SECONDS,
    ) -> None:
        given: object = database_url  # typed str; a pydantic PostgresDsn passed as is failed in urlparse
        if given is not None and not isinstance(given, str):
            raise ValueError(f"AgentTestStack database_url must be a str, got {type(given).__name__}: "
                             f"{shown_url_value(given)}; pass its text, such as str(url) for a URL object")
        # Absolute: the Worker starts in worker_cwd, where a relative path names another database.
        self.state_dir = Path(tmp_path).resolve()
        self.database_url = _absolute_sqlite_url(database_url) if database_url else (
            f"sqlite:///{self.state_dir / 'dex.db'}")
        _check_lease_ttl(self.database_url, lease_ttl_seconds)
        problem = _stack_arguments_problem(flows, worker_module, worker_env)
        if problem is not None:
            raise ValueError(f"AgentTestStack {problem}")
        # It holds the Workers' logs and the gates' marks; with the database elsewhere (PostgreSQL,
        # or a SQLite file in another directory) nothing else would make it.
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.flows = list(flows)
        self.worker_module = worker_module
        self.worker_cwd = Path(worker_cwd) if worker_cwd is not None else Path.cwd()
        self.worker_env = dict(worker_env or {})
        self.lease_ttl_seconds = lease_ttl_seconds
        self.client = AsyncClient(Registry(self.flows), self.database_url)
        self.workers: list[WorkerProcess] = []
        # Workers start only inside `async with`: only leaving the stack kills them.
        self._state: Literal["new", "open", "exited"] = "new"

    async def __aenter__(self) -> AgentTestStack:
        if self._state != "new":
            when = "is open" if self._state == "open" else "was exited"
            raise RuntimeError(f"the AgentTestStack in {str(self.state_dir)!r} {when}; enter a stack once: create "
                               "a new AgentTestStack for each `async with`")
        self._state = "open"
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._state = "exited"
        for worker in self.workers:
            worker.kill()
        await self.client.close()

    def sessions(self, flow: AgentSessionFlow) -> AgentSessionClient:
        return AgentSessionClient(self.client, flow)

    async def start_worker(
        self, env: dict[str, str] | None = None, *, timeout: float = DEFAULT_WAIT_SECONDS,
    ) -> WorkerProcess:
        """Start a Worker child and wait until it has registered with the engine, at most `timeout`
        seconds (its imports may take longer on a loaded machine).

        Only inside `async with` the stack: leaving it kills the Worker. Should the Worker not
        register (it exits, the wait times out or is cancelled), it is killed before this raises.
        """
        if self._state != "open":
            when = "was not entered yet" if self._state == "new" else "was exited"
            raise RuntimeError(f"start_worker: the AgentTestStack in {str(self.state_dir)!r} {when}; start Workers "
                               "inside `async with AgentTestStack(...) as stack:`, which kills them when it is left")
        child_env = dict(os.environ)
        child_env.update({
            ENV_DATABASE_URL: self.database_url,
            ENV_STATE_DIR: str(self.state_dir),
            ENV_LEASE_TTL: str(self.lease_ttl_seconds),
            ENV_PARENT_PID: str(os.getpid()),
            "PYTHONUNBUFFERED": "1",
        })
        child_env.update(self.worker_env)
        problem = _env_problem("start_worker env", env)
        if problem is not None:
            raise ValueError(problem)
        child_env.update(env or {})
        worker = self._spawn(child_env)
        process = worker.process
        self.workers.append(worker)

        async def registered() -> bool:
            if not worker.alive:
                started = f"worker {worker.pid} (python -m {self.worker_module} in {str(self.worker_cwd)!r})"
                output = worker.log_tail()
                if process.returncode == 0 and not output.strip():
                    # An exit without a word: the module ran to its end and started no Worker.
                    raise AssertionError(
                        f"{started} exited with 0 before registering, printing nothing: the module started no "
                        "Worker; call run_agent_worker(flows) in it under `if __name__ == \"__main__\":`"
                    )
                raise AssertionError(f"{started} exited with {process.returncode} before registering:\n{output}")
            return any(row[2] == worker.pid for row in await self.client.store.list_workers())

        try:
            await wait_until(f"worker {worker.pid} to register", registered, timeout=timeout)
        except AssertionError as exc:
            running = worker.alive
            worker.kill()  # nothing else would: the caller never gets hold of it
            if not running:
                raise
            # Alive but never seen: it registers elsewhere or never gets to run_agent_worker.
            raise AssertionError(
                f"{exc}: it ran (python -m {self.worker_module}) but did not register in "
                f"{shown_url(self.database_url)}, where the stack looks; does it run a Worker on another "
                f"database (run_agent_worker's database_url, or {ENV_DATABASE_URL} in worker_env), or wait "
                f"before run_agent_worker? Its output:\n{worker.log_tail()}"
            ) from None
        except BaseException:
            worker.kill()  # nothing else would: the caller never gets hold of it
            raise
        return worker

    def _spawn(self, env: dict[str, str]) -> WorkerProcess:
        log_path, log = _new_worker_log(self.state_dir)
        with log:
            process = subprocess.Popen(
                [sys.executable, "-m", self.worker_module], cwd=self.worker_cwd, env=env,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        return WorkerProcess(process, log_path)

    async def read_step_history(self, flow_id: str) -> list[StepHistoryEntry]:
        return to_step_history(await self.client.get_flow_history(flow_id))
