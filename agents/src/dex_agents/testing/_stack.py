"""A private engine in a temporary SQLite file, a Client, and Worker child processes to kill."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from dex_engine import AsyncClient, AsyncWorker, Flow, Registry, WorkerOptions

from .._client import AgentSessionClient
from .._session_flow import AgentSessionFlow
from ._history import StepHistoryEntry, to_step_history
from ._waiting import DEFAULT_WAIT_SECONDS, wait_until

# What a Worker child reads from its environment (set by AgentTestStack.start_worker).
ENV_DATABASE_URL = "DEX_AGENTS_TEST_DATABASE_URL"
ENV_STATE_DIR = "DEX_AGENTS_TEST_STATE_DIR"
ENV_LEASE_TTL = "DEX_AGENTS_TEST_LEASE_TTL"

# A killed Worker's lease expires after this long and its Steps are taken over. Short, so kill
# tests run fast, but well above a loaded 2-core CI machine's scheduling hiccups.
DEFAULT_TEST_LEASE_TTL_SECONDS = 2.0
# Parallel tool Steps of one response need slots of their own.
TEST_WORKER_MAX_CONCURRENT_TASKS = 64


def test_worker_options(database_url: str, lease_ttl_seconds: float) -> WorkerOptions:
    return WorkerOptions(
        database_url=database_url, max_concurrent_tasks=TEST_WORKER_MAX_CONCURRENT_TASKS,
        lease_ttl_seconds=lease_ttl_seconds, lease_renew_seconds=lease_ttl_seconds / 5,
        housekeeping_seconds=min(0.1, lease_ttl_seconds / 10), poll_seconds=0.01, shutdown_grace_seconds=5.0,
    )


def run_agent_worker(flows: Sequence[Flow], *, database_url: str | None = None) -> None:
    """Run a Worker for `flows` until SIGTERM or SIGINT: the body of a Worker child process.

    The database URL and lease timing come from the environment AgentTestStack sets.
    """
    url = database_url or os.environ.get(ENV_DATABASE_URL)
    if not url:
        raise SystemExit(f"run_agent_worker: set {ENV_DATABASE_URL} or pass database_url")
    ttl = float(os.environ.get(ENV_LEASE_TTL, DEFAULT_TEST_LEASE_TTL_SECONDS))
    asyncio.run(_serve(Registry(list(flows)), test_worker_options(url, ttl)))


async def _serve(registry: Registry, options: WorkerOptions) -> None:
    worker = AsyncWorker(registry, options)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: asyncio.ensure_future(worker.stop()))
    await worker.run()


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
        self.state_dir = Path(tmp_path)
        self.flows = list(flows)
        self.worker_module = worker_module
        self.worker_cwd = Path(worker_cwd) if worker_cwd is not None else Path.cwd()
        self.worker_env = dict(worker_env or {})
        self.database_url = database_url or f"sqlite:///{self.state_dir / 'dex.db'}"
        self.lease_ttl_seconds = lease_ttl_seconds
        self.client = AsyncClient(Registry(self.flows), self.database_url)
        self.workers: list[WorkerProcess] = []

    async def __aenter__(self) -> AgentTestStack:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for worker in self.workers:
            worker.kill()
        await self.client.close()

    def sessions(self, flow: AgentSessionFlow) -> AgentSessionClient:
        return AgentSessionClient(self.client, flow)

    async def start_worker(self, env: dict[str, str] | None = None) -> WorkerProcess:
        """Start a Worker child and wait until it has registered with the engine."""
        number = len(self.workers) + 1
        log_path = self.state_dir / f"worker-{number}.log"
        child_env = dict(os.environ)
        child_env.update({
            ENV_DATABASE_URL: self.database_url,
            ENV_STATE_DIR: str(self.state_dir),
            ENV_LEASE_TTL: str(self.lease_ttl_seconds),
            "PYTHONUNBUFFERED": "1",
        })
        child_env.update(self.worker_env)
        child_env.update(env or {})
        worker = self._spawn(child_env, log_path)
        process = worker.process
        self.workers.append(worker)

        async def registered() -> bool:
            if not worker.alive:
                raise AssertionError(
                    f"worker {worker.pid} exited with {process.returncode} before registering:\n{worker.log_tail()}"
                )
            return any(row[2] == worker.pid for row in await self.client.store.list_workers())

        await wait_until(f"worker {worker.pid} to register", registered)
        return worker

    def _spawn(self, env: dict[str, str], log_path: Path) -> WorkerProcess:
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", self.worker_module], cwd=self.worker_cwd, env=env,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        return WorkerProcess(process, log_path)

    async def read_step_history(self, flow_id: str) -> list[StepHistoryEntry]:
        return to_step_history(await self.client.get_flow_history(flow_id))
