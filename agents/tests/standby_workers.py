"""Worker children for kill tests: one live Worker per AgentTestStack, and standbys for the next ones.

A Worker child needs seconds of CPU for its imports, which take many seconds of wall time on a
loaded machine. So the imports happen ahead of time, in a standby child that waits at a FileGate
before it registers (ENV_START_GATE): a kill test SIGKILLs the live Worker, then releases a
standby, which only then becomes a Worker (registers, claims Steps), and a new standby imports
meanwhile.
"""

from __future__ import annotations

import collections
import itertools
import os
import subprocess
import sys

from agents.tests.scripted_agent import ENV_START_GATE

from dex_agents.testing import (
    ENV_DATABASE_URL,
    ENV_PARENT_PID,
    ENV_STATE_DIR,
    AgentTestStack,
    FileGate,
    WorkerProcess,
    wait_until,
)

# A standby may still be importing when released; on a loaded machine that takes a while.
STANDBY_REGISTER_SECONDS = 90.0


class SharedStack:
    """An AgentTestStack, its one live Worker child, and standby children for the next Workers."""

    def __init__(self, stack: AgentTestStack, *, standbys: int) -> None:
        self.stack = stack
        self.pool_size = standbys
        self.current: WorkerProcess | None = None
        self.standbys: collections.deque[tuple[WorkerProcess, FileGate]] = collections.deque()
        self.numbers = itertools.count(1)
        # One more than the pool at first: that one becomes the first Worker.
        for _ in range(standbys + 1):
            self.spawn_standby()

    def spawn_standby(self) -> None:
        """Start a Worker child that imports and then waits at its start gate, unregistered.

        The environment is AgentTestStack.start_worker's (its lease TTL is the child's default).
        """
        stack = self.stack
        name = f"standby-{next(self.numbers)}"
        env = {**os.environ, ENV_DATABASE_URL: stack.database_url, ENV_STATE_DIR: str(stack.state_dir),
               ENV_PARENT_PID: str(os.getpid()), "PYTHONUNBUFFERED": "1", **stack.worker_env, ENV_START_GATE: name}
        log_path = stack.state_dir / f"{name}.log"
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", stack.worker_module], cwd=stack.worker_cwd, env=env,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        worker = WorkerProcess(process, log_path)
        stack.workers.append(worker)  # the stack SIGKILLs it on exit, released or not
        self.standbys.append((worker, FileGate(stack.state_dir, name)))

    async def worker(self) -> WorkerProcess:
        """The live Worker, started when there is none (first use, or a test killed it)."""
        if self.current is None or not self.current.alive:
            self.current = await self._next_worker()
        return self.current

    async def start_new_worker(self) -> WorkerProcess:
        """After a kill: a new Worker, registered with the engine only now."""
        assert self.current is not None and not self.current.alive, "kill the live Worker first"
        self.current = await self._next_worker()
        return self.current

    async def _next_worker(self) -> WorkerProcess:
        while self.standbys and not self.standbys[0][0].alive:
            self.standbys.popleft()  # a standby that died is no use; start_worker's error names why
        if not self.standbys:
            return await self.stack.start_worker()
        worker, start_gate = self.standbys.popleft()
        start_gate.release()

        async def registered() -> bool:
            if not worker.alive:
                raise AssertionError(f"standby worker {worker.pid} exited:\n{worker.log_tail()}")
            return any(row[2] == worker.pid for row in await self.stack.client.store.list_workers())

        # A standby released before its imports finished registers once they do.
        await wait_until(f"standby worker {worker.pid} to register", registered, timeout=STANDBY_REGISTER_SECONDS)
        while len(self.standbys) < self.pool_size:
            self.spawn_standby()  # for the next kill, importing while the tests go on
        return worker
