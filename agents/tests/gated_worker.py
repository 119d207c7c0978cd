"""A Worker child that waits at the FileGate `start` (in its state directory) before it runs a
Worker, as a test's standby Worker or a Worker held until its test has set something up does:
`python -m agents.tests.gated_worker` from the repository root (test_test_stack.py)."""

import os

from agents.tests.scripted_agent import build_flow

from dex_agents.testing import ENV_STATE_DIR, FileGate, run_agent_worker

START_GATE = "start"

if __name__ == "__main__":
    FileGate(os.environ[ENV_STATE_DIR], START_GATE).wait_for_release_blocking()
    run_agent_worker([build_flow()])
