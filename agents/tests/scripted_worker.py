"""The Worker child of the session tests: `python -m agents.tests.scripted_worker` from the repository root."""

from dex_agents.testing import run_agent_worker

from agents.tests.scripted_agent import build_flow

if __name__ == "__main__":
    run_agent_worker([build_flow()])
