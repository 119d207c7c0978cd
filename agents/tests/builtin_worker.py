"""The Worker child of the built-in loop kill test: `python -m agents.tests.builtin_worker`."""

from agents.tests.builtin_agent import gated_flow

from dex_agents.testing import run_agent_worker

if __name__ == "__main__":
    run_agent_worker([gated_flow()])
