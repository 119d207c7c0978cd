"""Crash gates (_gates): DEX_ENGINE_CRASH_AT kills on the k-th crossing, with or without a gate log,
and DEX_ENGINE_GATE_LOG alone logs every crossing and kills nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from .proc_harness import ENV_CRASH_AT, ENV_GATE_LOG

# Crosses gate "a" three times and "b" once, printing after each crossing.
CHILD = """
from dex_engine._gates import gate
for name in ("a", "b", "a", "a"):
    gate(name)
    print(name, flush=True)
"""


def _cross(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in (ENV_CRASH_AT, ENV_GATE_LOG)}
    return subprocess.run([sys.executable, "-c", CHILD], env={**base, **env}, capture_output=True,
                          text=True, timeout=60, check=False)


@pytest.mark.parametrize(("crash_at", "printed"), [("a", []), ("a:1", []), ("a:3", ["a", "b", "a"]),
                                                   ("b:1", ["a"]), ("c:1,a:2", ["a", "b"])])
def test_crash_at_alone_kills_on_the_kth_crossing(crash_at: str, printed: list[str]) -> None:
    """Without a gate log: k defaults to 1, counts are per gate, and a list names several gates."""
    done = _cross({ENV_CRASH_AT: crash_at})
    assert done.returncode == -signal.SIGKILL, (done.returncode, done.stderr)
    assert done.stdout.split() == printed


def test_a_gate_log_alone_logs_every_crossing_and_kills_nothing(tmp_path: Path) -> None:
    log = tmp_path / "gates.log"
    done = _cross({ENV_GATE_LOG: str(log)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["a", "b", "a", "a"]
    lines = [line.split() for line in log.read_text().splitlines()]
    assert [name for _, name in lines] == ["a", "b", "a", "a"]
    assert len({pid for pid, _ in lines}) == 1


def test_with_both_the_killing_crossing_is_logged_first(tmp_path: Path) -> None:
    log = tmp_path / "gates.log"
    done = _cross({ENV_CRASH_AT: "a:2", ENV_GATE_LOG: str(log)})
    assert done.returncode == -signal.SIGKILL
    assert [line.split()[1] for line in log.read_text().splitlines()] == ["a", "b", "a"]


def test_no_setting_crosses_every_gate_untouched() -> None:
    done = _cross({})
    assert (done.returncode, done.stdout.split()) == (0, ["a", "b", "a", "a"])
