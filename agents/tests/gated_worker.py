"""A Worker child that waits at the FileGate `start` (in its state directory) before it runs a
Worker, as a test's standby Worker or a Worker held until its test has set something up does:
`python -m agents.tests.gated_worker` from the repository root (test_test_stack.py). With
ENV_STRAY_PID_FILE set, it first starts a long-lived subprocess, as scripted_worker does."""

import os
import subprocess
import sys
from pathlib import Path

from agents.tests.scripted_agent import build_flow
from agents.tests.scripted_worker import ENV_STRAY_PID_FILE, STRAY_SECONDS

from dex_agents.testing import ENV_STATE_DIR, FileGate, run_agent_worker

START_GATE = "start"

if __name__ == "__main__":
    pid_file = os.environ.get(ENV_STRAY_PID_FILE)
    if pid_file:
        stray = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({STRAY_SECONDS})"])
        Path(pid_file).write_text(str(stray.pid))
    FileGate(os.environ[ENV_STATE_DIR], START_GATE).wait_for_release_blocking()
    run_agent_worker([build_flow()])
