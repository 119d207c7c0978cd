"""bench/agent_turn.py's `sqlite` row is a floor for any Python system's turn only while it writes
what the turn writes: four durable commits, and the session's messages, tool call record, usage,
state, events and history. These tests hold it to that."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from agent_turn import (
    ANSWER,
    TOOL_OUTPUT,
    USER_TEXT,
    CommitCounter,
    DirectTurns,
    direct_connection,
    direct_system,
    sequential_plan,
)

TURNS = 3


def test_a_counted_sequential_pass_commits_four_times_a_turn_each_with_an_fsync(tmp_path: Path) -> None:
    """Catches: a turn that folds its commits together, or commits without synchronous=FULL."""
    counter = CommitCounter()
    result = direct_system(tmp_path).run(sequential_plan(8), "seq-count", False, counter)
    assert result.turns == 8
    assert (result.commits, result.fsyncs) == (32, 32), (result.commits, result.fsyncs)


def test_a_sessions_turns_keep_every_message_in_order_and_leave_no_turn_state(tmp_path: Path) -> None:
    """Catches: messages written over one another instead of appended (their reads would stay
    short and cheap), events or history not appended, and a turn's tool call record left behind."""
    conn = direct_connection(tmp_path / "direct.db")
    try:
        assert conn.execute("PRAGMA synchronous").fetchone() == (2,)  # FULL
        turns = DirectTurns(conn)
        for _ in range(TURNS):
            assert turns.turn("s") > 0
        turns.turn("other")  # another session's rows stay its own
        messages = turns.read("s", "messages")
        assert [m["sequence"] for m in messages] == list(range(4 * TURNS))
        assert [m["role"] for m in messages[:4]] == ["user", "assistant", "tool", "assistant"]
        assert (messages[0]["text"], messages[2]["output"], messages[3]["text"]) == (USER_TEXT, TOOL_OUTPUT, ANSWER)
        assert turns.read("s", "tool_calls") == [] and turns.read("s", "run_state") == []
        assert turns.read("s", "state")[0]["status"] == "idle"
        assert conn.execute("SELECT count(*) FROM events WHERE session_id = 's'").fetchone() == (6 * TURNS,)
        assert conn.execute("SELECT count(*), max(seq) FROM history WHERE session_id = 's'").fetchone() == (
            4 * TURNS, 4 * TURNS)
        assert len(turns.read("other", "messages")) == 4
    finally:
        conn.close()
