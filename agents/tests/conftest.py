"""Shared fixtures of the dex_agents tests."""

from __future__ import annotations

from collections.abc import AsyncIterator
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
