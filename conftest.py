"""Hooks for every test of the repository (engine/tests and agents/tests)."""

from __future__ import annotations

import os
from collections.abc import Generator
from typing import Any

import pytest

# Worker processes of `-n auto` (pyproject.toml's addopts): at most this many, however many cores.
# Each test may run Worker child processes and hold a dozen PostgreSQL connections (the test server
# allows 200), and the tests' deadlines assume a worker process has about a core to itself.
MOST_TEST_PROCESSES = 4


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """One test process per core, up to MOST_TEST_PROCESSES; PYTEST_XDIST_AUTO_NUM_WORKERS overrides."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # pytest-xdist's own hook reads it
    return max(1, min(len(os.sched_getaffinity(0)), MOST_TEST_PROCESSES))


def _utf8(text: str) -> str:
    """`text` with any lone surrogate written as a backslash escape."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    """Escape lone surrogates in a report's captured output and failure text.

    The bad-input tests store and log lone surrogates on purpose. pytest-xdist sends each report from
    its worker process as UTF-8, which a lone surrogate cannot be; unescaped, the worker dies and the
    whole run ends with an internal error instead of the test's result.
    """
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    report.sections = [(title, _utf8(content)) for title, content in report.sections]
    if report.longrepr is not None and not isinstance(report.longrepr, tuple):
        text = str(report.longrepr)
        escaped = _utf8(text)
        if escaped != text:  # else keep the structured form, which pytest prints with its traceback
            report.longrepr = escaped
