"""The Worker child of test_session_chaos.py: `python -m agents.tests.chaos_worker` from the repository root."""

from agents.tests.chaos_agent import build_flows

from dex_agents.testing import run_agent_worker

if __name__ == "__main__":
    run_agent_worker(build_flows())
