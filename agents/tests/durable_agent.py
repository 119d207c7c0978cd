"""The agent of the durability tests: the demo model (/wait, /ask, /tool) with both built-in tools.

Its Worker child is `python -m agents.tests.durable_worker`; refunds go to the ledger in the state dir.
"""

from __future__ import annotations

import os
from pathlib import Path

from dex_agents import AgentSessionFlow
from dex_agents.demo import build_demo_flow
from dex_agents.testing import ENV_STATE_DIR


def durable_flow(state_dir: Path | None = None) -> AgentSessionFlow:
    directory = state_dir or Path(os.environ[ENV_STATE_DIR])
    return build_demo_flow(directory / "ledger.jsonl")
