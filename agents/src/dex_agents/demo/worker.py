"""The demo's Worker process: `python -m dex_agents.demo.worker DATABASE_URL` (the ledger path from the env)."""

from __future__ import annotations

import sys

from ..testing import run_agent_worker
from ._agent import build_demo_flow

if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m dex_agents.demo.worker DATABASE_URL")
    run_agent_worker([build_demo_flow()], database_url=sys.argv[1])
