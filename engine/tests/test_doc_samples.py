"""README.md's "A Flow in thirty lines", run verbatim (twice), then read with the command the README gives,
so the first code a reader copies keeps working."""

from __future__ import annotations

import ast
import os
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
    for _ in range(2):  # run again, as a reader trying it does: the flow ID of the first run is taken
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


TESTS = Path(__file__).resolve().parents[2]
PG_FIXTURES = {"pg_database", "pg_databases"}


def _postgresql_tests() -> dict[str, set[str]]:
    """Test functions that need PostgreSQL, by file: those that take a PostgreSQL database fixture,
    and every test of a module that skips with the conftest's no-server reason itself."""
    found: dict[str, set[str]] = {}
    for path in sorted([*TESTS.glob("engine/tests/test_*.py"), *TESTS.glob("agents/tests/test_*.py")]):
        source = path.read_text()
        tests = [node for node in ast.walk(ast.parse(source))
                 if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test_")]
        whole_module = re.search(r"^from \.conftest import .*\bNO_PG_REASON\b", source, flags=re.M) is not None
        names = {test.name for test in tests
                 if whole_module or PG_FIXTURES & {arg.arg for arg in test.args.args + test.args.kwonlyargs}}
        if names:
            found[str(path.relative_to(TESTS))] = names
    return found


def _collected(keyword: str, files: list[str]) -> set[tuple[str, str]]:
    """(file, test function) of every test `pytest -k keyword` collects from `files`."""
    env = {k: v for k, v in os.environ.items() if k != "TEST_PG_DSN"}
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "-k", keyword, *files], cwd=TESTS, env=env, capture_output=True, text=True,
                         timeout=240, check=False)
    assert run.returncode in (0, 5), run.stdout + run.stderr  # 5: every test deselected
    ids = [line for line in run.stdout.splitlines() if "::" in line]
    return {(node.split("::")[0], node.split("::")[-1].split("[")[0]) for node in ids}


def test_k_postgres_selects_every_postgresql_test_and_not_postgres_none() -> None:
    """docs/testing.md: `pytest -k "not postgres"` runs the SQLite cases only, with no skip warning,
    and `pytest -k postgres` the PostgreSQL cases only. Catches: a test that takes `pg_database`
    (or a module of PostgreSQL fault tests) had no "postgres" in its ID, so `-k "not postgres"`
    still ran it, skipped it and printed "WARNING: N PostgreSQL test(s) skipped", and `-k postgres`
    left it out."""
    needed = _postgresql_tests()
    assert "engine/tests/test_pg_faults.py" in needed and "engine/tests/test_worker_attempts.py" in needed
    files = sorted(needed)
    expected = {(file, name) for file, names in needed.items() for name in names}
    assert sorted(expected & _collected("not postgres", files)) == []
    assert sorted(expected - _collected("postgres", files)) == []
