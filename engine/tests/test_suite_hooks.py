"""The root conftest.py's hooks, which every test run goes through: how many test processes
`-n auto` starts, and reports with lone surrogates (which pytest-xdist could not send)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT_CONFTEST = Path(__file__).resolve().parents[2] / "conftest.py"


def _root_conftest() -> ModuleType:
    spec = importlib.util.spec_from_file_location("dex_root_conftest", ROOT_CONFTEST)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_auto_starts_one_process_per_core_up_to_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    hooks = _root_conftest()
    monkeypatch.delenv("PYTEST_XDIST_AUTO_NUM_WORKERS", raising=False)
    for cores, expected in ((1, 1), (2, 2), (hooks.MOST_TEST_PROCESSES, hooks.MOST_TEST_PROCESSES),
                            (64, hooks.MOST_TEST_PROCESSES)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda _pid, n=cores: set(range(n)))
        assert hooks.pytest_xdist_auto_num_workers(None) == expected, cores
    # The variable is pytest-xdist's own: the hook steps aside for it.
    monkeypatch.setenv("PYTEST_XDIST_AUTO_NUM_WORKERS", "3")
    assert hooks.pytest_xdist_auto_num_workers(None) is None


def test_the_suite_runs_with_auto_through_the_root_hook(
    pytestconfig: pytest.Config, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Catches: `-n auto` dropped from pyproject.toml's addopts (the suite back in one process, CI
    twice as long), or the root conftest not loaded, so `auto` is no longer capped."""
    addopts = pytestconfig.getini("addopts")
    assert any(addopts[i:i + 2] == ["-n", "auto"] for i in range(len(addopts))), addopts
    assert any(addopts[i:i + 2] == ["--dist", "worksteal"] for i in range(len(addopts))), addopts
    monkeypatch.delenv("PYTEST_XDIST_AUTO_NUM_WORKERS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(64)))
    cap = _root_conftest().MOST_TEST_PROCESSES
    assert pytestconfig.hook.pytest_xdist_auto_num_workers(config=pytestconfig) == cap


class _Outcome:
    def __init__(self, report: pytest.TestReport) -> None:
        self.report = report

    def get_result(self) -> pytest.TestReport:
        return self.report


def _made(report: pytest.TestReport) -> pytest.TestReport:
    """`report` after the root conftest's makereport hook wrapped the call that made it."""
    wrapper = _root_conftest().pytest_runtest_makereport(None, None)
    next(wrapper)
    with pytest.raises(StopIteration):
        wrapper.send(_Outcome(report))
    return report


def test_lone_surrogates_in_a_report_are_escaped_and_other_text_is_kept() -> None:
    sections = [("Captured log call", "WARNING bad text 'caf\udce9' and 'é'"), ("Captured stdout call", "plain")]
    longrepr: Any = "AssertionError: '\ud800' != 'x'"
    report = pytest.TestReport("t.py::t", ("t.py", 1, "t"), {}, "failed", longrepr, "call", sections)
    _made(report)
    assert report.sections == [("Captured log call", "WARNING bad text 'caf\\udce9' and 'é'"),
                               ("Captured stdout call", "plain")]
    assert report.longrepr == "AssertionError: '\\ud800' != 'x'"
    for _title, content in report.sections:
        content.encode("utf-8")  # what pytest-xdist does to send it: no UnicodeEncodeError
    # A failure without a surrogate keeps its structured form (pytest prints it with its traceback).
    kept = ("t.py", 1, "skipped: why")
    skipped = pytest.TestReport("t.py::u", ("t.py", 1, "u"), {}, "skipped", kept, "call", [])
    assert _made(skipped).longrepr == kept
