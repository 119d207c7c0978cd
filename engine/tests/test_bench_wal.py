"""The benchmarks measure commits into reused WALs: the floor (bench/engine_steps.floor) and the
Steps and turns timed against it, whose warm-up goes on until the phase's WAL stops growing.

A commit that grows the WAL file costs about twice one that overwrites checkpointed frames: a floor
that grew its WAL, or systems timed while theirs still grew, would skew every ratio printed.
"""

from __future__ import annotations

import sqlite3
import sys
from pathlib import Path

import pytest
from bench import engine_steps
from bench.engine_steps import WalWarmth, floor

LEAST = 3  # agent_turn's warm-up turns at the least

COMMITS = 200
FRAME = 24 + 4096  # a WAL frame: its header and one page
HEAVY_COMMITS = 40  # 40 commits of about 16 pages stay below the automatic checkpoint's 1000


def test_the_timed_commits_reuse_the_wal_the_untimed_ones_grew(tmp_path: Path) -> None:
    path = tmp_path / "floor.db"
    # An idle connection keeps the WAL file when the floor's own connection closes, so its size tells
    # how far the commits wrote into it.
    watcher = sqlite3.connect(path)
    watcher.execute("PRAGMA journal_mode = WAL")
    watcher.execute("SELECT count(*) FROM sqlite_schema").fetchall()  # opens, and keeps, the WAL index
    try:
        growing: list[float] = []
        cpu: list[float] = []
        timed = floor(str(path), "FULL", COMMITS, growing, cpu)
        frames = Path(f"{path}-wal").stat().st_size // FRAME
    finally:
        watcher.close()
    assert len(timed) == COMMITS and len(growing) == COMMITS and len(cpu) == 1
    # The untimed commits wrote at least one frame each; the timed ones, had they appended rather
    # than started the WAL over, would have doubled that.
    assert COMMITS <= frames < 1.5 * COMMITS, frames


def _frames_per_commit(path: Path, rewrite_pages: int) -> float:
    """WAL frames per commit of floor() with `rewrite_pages`, over commits too few to reach SQLite's
    automatic checkpoint (1000 pages), which would start the WAL over."""
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("SELECT count(*) FROM sqlite_schema").fetchall()  # keeps the WAL when floor's connection closes
    try:
        floor(str(path), "OFF", HEAVY_COMMITS, rewrite_pages=rewrite_pages)
        # The timed commits started the WAL over after the checkpoint: its frames are the untimed
        # commits', as many as the timed ones wrote.
        return Path(f"{path}-wal").stat().st_size // FRAME / HEAVY_COMMITS
    finally:
        conn.close()


def test_the_heavy_floor_rewrites_about_as_many_pages_as_asked(tmp_path: Path) -> None:
    bare = _frames_per_commit(tmp_path / "bare.db", 0)
    heavy = _frames_per_commit(tmp_path / "heavy.db", 15)
    assert bare < 3, bare
    # Every page of the rewritten row changes at every commit (the contents alternate): a row
    # rewritten with the same bytes would write only the pages that differ.
    assert 14 <= heavy - bare <= 17, (bare, heavy)


def test_warm_up_goes_on_until_a_turn_leaves_the_wal_as_large_as_it_was(tmp_path: Path) -> None:
    path = tmp_path / "phase.db"
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA wal_autocheckpoint = 50")  # a WAL that wraps after a few turns
    conn.execute("CREATE TABLE t (v BLOB)")

    def turn() -> None:  # about 8 pages, like a Step commit or two
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("INSERT INTO t (v) VALUES (randomblob(30000))")
        conn.execute("COMMIT")

    try:
        warmed = 0
        for _ in WalWarmth(path).rounds(LEAST):
            turn()
            warmed += 1
        assert LEAST < warmed < 20, warmed  # past the minimum: the WAL grew for 50 pages
        growing = WalWarmth(path)
        grown = 0
        for _ in range(30):
            turn()
            grown += growing.grew()
        # Only a commit that crosses the checkpoint threshold further than any before grows it again.
        assert grown <= 2, grown
    finally:
        conn.close()


def test_a_file_without_a_wal_gets_the_minimum_warm_up(tmp_path: Path) -> None:
    assert list(WalWarmth(tmp_path / "rollback-journal.db").rounds(LEAST)) == list(range(LEAST))
    assert not WalWarmth(None).grew()
    assert WalWarmth.of("postgresql://db/x").wal is None
    assert WalWarmth.of(f"sqlite:///{tmp_path}/a.db?synchronous=NORMAL").wal == tmp_path / "a.db-wal"


@pytest.mark.parametrize(("argv", "named"), [
    (["--floor-commits", "0"], "--floor-commits must be at least 1, got 0"),
    (["--chain-steps", "1"], "--chain-steps must be 0 (by concurrency) or at least 2, got 1"),
    (["--backend", "postgres", "--workers", "0"], "--workers must be counts of at least 1, got 0"),
    (["--backend", "postgres", "--commits", "batch"], "--commits takes batched, each, generic, got batch"),
])
def test_numbers_no_run_can_use_are_refused_by_name(
    argv: list[str], named: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`uv run python bench/engine_steps.py` (README) with such a number ends with one line naming it.
    Catches: --floor-commits 0 and --chain-steps 1 ran for seconds, then ended in a StatisticsError
    traceback (a median of no samples); --commits batch ran every configuration as 'batched'."""
    monkeypatch.setattr(sys, "argv", ["engine_steps.py", *argv])
    with pytest.raises(SystemExit) as exit_:
        engine_steps.main()
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"engine_steps.py: error: {named}"
