"""The Worker child of the session tests: `python -m agents.tests.scripted_worker` from the repository root.

With ENV_STRAY_PID_FILE set, it first starts a long-lived subprocess (as a tool's subprocess or an
MCP server would be started) and writes its PID there, for the process-group tests (test_test_stack.py).
"""

import os
import subprocess
import sys
from pathlib import Path

from agents.tests.scripted_agent import build_flow

from dex_agents.testing import run_agent_worker

ENV_STRAY_PID_FILE = "DEX_AGENTS_TEST_STRAY_PID_FILE"
# How long the stray subprocess would live if nothing killed it: far beyond any test.
STRAY_SECONDS = 600

if __name__ == "__main__":
    pid_file = os.environ.get(ENV_STRAY_PID_FILE)
    if pid_file:
        stray = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({STRAY_SECONDS})"])
        Path(pid_file).write_text(str(stray.pid))
    run_agent_worker([build_flow()])
