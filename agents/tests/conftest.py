"""Shared fixtures of the dex_agents tests."""

from __future__ import annotations

import os
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from agents.tests.scripted_agent import build_flow

from dex_agents.testing import AgentTestStack

REPO_ROOT = Path(__file__).resolve().parents[2]
WORKER_MODULE = "agents.tests.scripted_worker"


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[AgentTestStack]:
    """A private engine in tmp_path with the scripted Flow; tests start (and kill) Workers."""
    async with AgentTestStack(tmp_path, [build_flow(tmp_path)], WORKER_MODULE, worker_cwd=REPO_ROOT) as s:
        yield s


# Room for the session's file and its WAL, little enough to fill in a moment.
TMPFS_SIZE = "4m"


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A TMPFS_SIZE tmpfs mounted in tmp_path, to fill; skipped unless root."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root, as CI runs (.ci/run installs PostgreSQL with apt)")
    mount = tmp_path / "small-disk"
    mount.mkdir()
    # As root the mount must work: a failure fails the test rather than skip it unnoticed in CI.
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE}", "tmpfs", str(mount)],
                          capture_output=True, text=True, check=False)
    assert made.returncode == 0, f"cannot mount a tmpfs as root: {made.stderr.strip()}"
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)
