"""AgentTestStack's Worker children (seed 003 "Testing an adapter"): each runs in its own process
group, kill() and stop() reach the whole group, and leaving the stack leaves no Worker running.

The Worker's own long-lived subprocess stands for what a real Worker may start (a tool's subprocess,
an MCP server): a kill that reached only the Worker would leave it running into the next test.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from agents.tests.conftest import REPO_ROOT, WORKER_MODULE
from agents.tests.scripted_agent import build_flow
from agents.tests.scripted_worker import ENV_STRAY_PID_FILE

from dex_agents.testing import AgentTestStack, WorkerProcess, wait_until


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
