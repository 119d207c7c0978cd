"""The Worker child of the session tests: `python -m agents.tests.scripted_worker` from the repository root."""

from agents.tests.scripted_agent import build_flow

from dex_agents.testing import run_agent_worker

if __name__ == "__main__":
    run_agent_worker([build_flow()])
