"""profile_turn --replay times a turn's own SQL statements alone, run again on a snapshot of the
database taken before them (bench/engine_steps.snapshot and replay). The figure means something only
if every replayed statement meets the state it met when recorded: these tests hold it to that.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from bench.engine_steps import (
    Recorded,
    RecordingConnection,
    ReplayDiverged,
    commit_split,
    replay,
    snapshot,
    warm_wal,
)

TURNS = 6


def _turns(path: Path, *setup: str) -> tuple[list[Recorded], list[int]]:
    """Turns of statements whose effects depend on the state they meet: an AUTOINCREMENT key read
    back through last_insert_rowid(), deletes by that key, and reads; `setup` statements first.
    Recorded by the benchmarks' own recorder, which skips what runs while it is off."""
    log: list[Recorded] = []
    ends: list[int] = []
    conn = RecordingConnection(sqlite3.connect(path, isolation_level=None), log)
    try:
        conn.execute("SELECT count(*) FROM t")  # not recorded: recording is off
        conn.recording = True
        for sql in setup:
            conn.execute(sql)
        for turn in range(TURNS):
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("INSERT INTO t (v) VALUES (?)", (f"turn {turn}",))
            conn.execute("INSERT INTO u (t_id) VALUES (last_insert_rowid())")
            conn.execute("DELETE FROM t WHERE id = (SELECT min(id) FROM t)")
            assert conn.cursor().execute("SELECT id, v FROM t ORDER BY id").fetchone() is not None
            conn.execute("COMMIT")
            ends.append(len(log))
    finally:
        conn.close()
    assert len(log) == len(setup) + 6 * TURNS
    return log, ends


def _database(path: Path) -> None:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("CREATE TABLE t (id INTEGER PRIMARY KEY AUTOINCREMENT, v TEXT NOT NULL)")
    conn.execute("CREATE TABLE u (t_id INTEGER NOT NULL)")
    conn.executemany("INSERT INTO t (v) VALUES (?)", [("before",)] * 3)
    conn.close()


def _dump(path: Path) -> list[str]:
    conn = sqlite3.connect(path)
    try:
        return list(conn.iterdump())
    finally:
        conn.close()


def test_the_replay_runs_each_statement_on_the_state_it_was_recorded_on(tmp_path: Path) -> None:
    original, copy = tmp_path / "original.db", tmp_path / "copy.db"
    _database(original)
    snapshot(original, copy)
    recorded, ends = _turns(original)
    replayed = replay(copy, recorded, ends)
    assert replayed.median > 0 and replayed.cpu > 0 and replayed.turns == TURNS
    # The copy went where the original went, key for key (the AUTOINCREMENT counter included).
    assert _dump(copy) == _dump(original)
    conn = sqlite3.connect(copy)
    try:
        assert conn.execute("SELECT journal_mode FROM pragma_journal_mode").fetchone() == ("wal",)
    finally:
        conn.close()


def test_a_replay_on_another_state_stops_at_the_first_statement_that_does_otherwise(tmp_path: Path) -> None:
    original, late = tmp_path / "original.db", tmp_path / "late.db"
    _database(original)
    recorded, ends = _turns(original)
    snapshot(original, late)  # after the statements ran: their deletes meet other rows
    with pytest.raises(ReplayDiverged, match=r"statement 4 .*when recorded"):
        replay(late, recorded, ends)


def test_turns_that_grew_the_copys_wal_are_left_out_of_the_median(tmp_path: Path) -> None:
    """A commit that grows the WAL file costs about twice one that reuses it: the copy's WAL starts
    empty, so the turns that grew it are not timed. Catches: a median over the growing turns."""
    original, copy = tmp_path / "original.db", tmp_path / "copy.db"
    _database(original)
    snapshot(original, copy)
    # A checkpoint after every commit: the WAL starts over at once, and later turns reuse it.
    recorded, ends = _turns(original, "PRAGMA wal_autocheckpoint = 1")
    replayed = replay(copy, recorded, ends)
    assert 0 < replayed.timed < replayed.turns == TURNS, replayed
    # Without checkpoints every turn grows it: then the median is over them all.
    snapshot(original, tmp_path / "again.db")
    grown = replay(tmp_path / "again.db", *_turns(tmp_path / "original.db", "PRAGMA wal_autocheckpoint = 0"))
    assert (grown.timed, grown.turns) == (0, TURNS), grown


def test_a_copy_whose_wal_is_grown_like_the_originals_reuses_it_in_every_turn(tmp_path: Path) -> None:
    """snapshot() counts the frames of the original's WAL, and replay() grows the copy's to as many
    and checkpoints it first, so no replayed turn pays for growing the file, and no row changes.
    Catches: a frame count of 0 for a WAL that has frames, warming that leaves the WAL uncheckpointed
    (the first turns would grow it), and warming that changes the database."""
    original, copy = tmp_path / "original.db", tmp_path / "copy.db"
    _database(original)
    holder = sqlite3.connect(original, isolation_level=None)  # keeps the WAL file when others close
    try:
        holder.execute("PRAGMA wal_autocheckpoint = 0")
        holder.execute("PRAGMA user_version = 7")
        for n in range(40):
            holder.execute("INSERT INTO u (t_id) VALUES (?)", (-n,))
        frames = snapshot(original, copy)
        assert frames >= 41, frames  # each commit wrote at least one frame
        recorded, ends = _turns(original)
    finally:
        holder.close()
    assert snapshot(tmp_path / "no-wal.db", tmp_path / "no-wal-copy.db") == 0
    replayed = replay(copy, recorded, ends, frames)
    assert (replayed.timed, replayed.turns) == (TURNS, TURNS), replayed
    assert _dump(copy) == _dump(original)
    conn = sqlite3.connect(copy)
    try:
        assert conn.execute("PRAGMA user_version").fetchone() == (7,)
    finally:
        conn.close()


def test_warming_a_database_not_in_wal_mode_is_refused(tmp_path: Path) -> None:
    """Its commits would never grow a WAL file: refused, rather than written to without end."""
    path = tmp_path / "rollback.db"
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("CREATE TABLE t (v TEXT)")
        with pytest.raises(ValueError, match=r"WAL mode; rollback.db is in journal mode 'delete'"):
            warm_wal(conn, Path(f"{path}-wal"), 10)
    finally:
        conn.close()


def test_a_replay_times_the_commits_of_transactions_that_wrote_apart_from_the_rest(tmp_path: Path) -> None:
    """Each turn: a transaction that writes, then one that only reads. Catches: counting a read-only
    transaction's COMMIT as a durable one, and a commit time that is the whole turn's."""
    original, copy = tmp_path / "original.db", tmp_path / "copy.db"
    _database(original)
    snapshot(original, copy)
    log: list[Recorded] = []
    ends: list[int] = []
    conn = RecordingConnection(sqlite3.connect(original, isolation_level=None), log)
    conn.recording = True
    try:
        for turn in range(TURNS):
            for sql, params in (("BEGIN IMMEDIATE", ()), ("INSERT INTO t (v) VALUES (?)", (f"turn {turn}",)),
                                ("COMMIT", ()), ("BEGIN", ()), ("SELECT count(*) FROM t", ()), ("COMMIT", ())):
                conn.execute(sql, params)
            ends.append(len(log))
    finally:
        conn.close()
    replayed = replay(copy, log, ends)
    assert replayed.commits == 1.0, replayed
    assert 0 < replayed.commit_median < replayed.median, replayed


def test_the_commit_split_reads_as_the_reports_print_it() -> None:
    """Catches: a split whose parts do not add up to the median, or a per-commit figure not divided."""
    assert commit_split(0.0012, 0.0008, 4.0, 0.0001) == (
        "its 4.0 data-changing COMMITs take 0.80 ms of it (0.200 ms each, 2.00x the floor's commit) and its other"
        " statements 0.40 ms (4.0 floors)")
