"""The benchmarks' commit floor (bench/engine_steps.floor) times commits into a WAL they reuse.

A commit that grows the WAL file costs about twice one that overwrites checkpointed frames, and the
systems measured against the floor run with reused WALs: a floor that grew its WAL would halve every
ratio the benchmarks print.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from bench.engine_steps import floor

COMMITS = 200
FRAME = 24 + 4096  # a WAL frame: its header and one page


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
