"""The Worker child of test_adapter_author_journey.py: `python -m agents.tests.journey_worker`."""

from agents.tests.journey_agent import build_flows

from dex_agents.testing import run_agent_worker

if __name__ == "__main__":
    run_agent_worker(build_flows())
