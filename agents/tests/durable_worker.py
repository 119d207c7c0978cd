"""The Worker child of the durability tests: `python -m agents.tests.durable_worker`."""

from agents.tests.durable_agent import durable_flow

from dex_agents.testing import run_agent_worker

if __name__ == "__main__":
    run_agent_worker([durable_flow()])
