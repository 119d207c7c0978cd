"""README.md's "A Flow in thirty lines", run verbatim, then read with the command the README gives,
so the first code a reader copies keeps working."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from dex_engine.cli import cli

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_flow_sample_runs_and_its_history_command_reads_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (sample,) = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    (tmp_path / "greeter.py").write_text(sample)
    run = subprocess.run([sys.executable, "greeter.py"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=60, check=False)
    assert run.returncode == 0, run.stderr
    assert run.stdout == "hello, Ada\n"

    command = re.search(r"`uv run (dex-engine history [^`]+)`", README.read_text())
    assert command is not None
    _, *args = command.group(1).split()
    monkeypatch.chdir(tmp_path)
    history = CliRunner().invoke(cli, args)
    assert history.exit_code == 0, history.output
    assert "execute_completed" in history.output and "flow_closed" in history.output
