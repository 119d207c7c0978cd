"""A full disk under a session's SQLite file (RELIABILITY.md: crash, fault and bad-input tests).

The engine's file lives on a small tmpfs that the test fills while a model call runs, so the Step's
commit, the worker's hand-back and its lease renewals all fail with SQLITE_FULL, as they do when a
real disk fills. Mounting needs root, as CI has; run as another user the test is skipped, and as
root a mount that fails fails it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sqlite3
import subprocess
from pathlib import Path

import pytest
from agents.tests.scripted_agent import build_flow
from agents.tests.test_bad_inputs import InProcess, all_messages, assert_usable, started_session

from dex_agents import AgentStatus, MessageRole
from dex_agents.testing import FileGate, InvocationLog
from dex_engine import AsyncClient, Registry, WorkerOptions, open_store

FULL_SECONDS = 2.0  # how long the disk stays full while the turn's commit fails


def fill(disk: Path) -> Path:
    """Write a file until the disk has no room left; returns it (remove it to free the space)."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        with contextlib.suppress(OSError):  # ENOSPC: full
            while True:
                os.write(fd, b"\0" * 4096)
    finally:
        os.close(fd)
    return filler


async def test_a_turn_whose_commit_finds_the_disk_full_completes_once_space_returns(
    tmp_path: Path, small_disk: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """The disk fills while a model call runs: its commit fails, and so do the worker's hand-back
    and lease renewals. Nothing is half written: the session stays in its turn, readable, the
    messages before it unchanged. Once space returns the turn completes by itself (the worker's
    housekeeping hands the unstarted attempt back), its answer stored once, the file intact, the
    session usable; the log holds one traceback per failing action, not one per retry. Catches:
    a commit that failed part-way leaving rows behind, an attempt lost for good because its
    hand-back failed, and a worker that stopped renewing or logging sanely after a full disk."""
    caplog.set_level(logging.WARNING, logger="dex_engine")
    url = f"sqlite:///{small_disk / 'dex.db'}"
    flow = build_flow(tmp_path)  # gates and the invocation log outside the small disk
    options = WorkerOptions(database_url=url, lease_ttl_seconds=5.0, lease_renew_seconds=0.4,
                            housekeeping_seconds=0.1, poll_seconds=0.01, shutdown_grace_seconds=5.0)
    store = open_store(url)
    engine = InProcess(flow, AsyncClient(Registry([flow]), store=store), InvocationLog(tmp_path / "log"), options)
    await engine.start_worker()
    try:
        sessions = engine.sessions
        before = await started_session(sessions, "s")
        answer = "answered after the disk filled " + "w" * 3000  # more than the free pages hold
        script = json.dumps({"steps": [{"gate": "model", "answer": answer}]})
        await sessions.send_user_message("s", script)
        gate = FileGate(tmp_path, "model")
        await gate.wait_until_reached()
        filler = fill(small_disk)
        gate.release()
        await asyncio.sleep(FULL_SECONDS)
        snapshot = await sessions.get_agent_snapshot("s")
        assert snapshot.state is not None and snapshot.state.status is AgentStatus.RUNNING_MODEL, snapshot.state
        messages = await all_messages(sessions, "s")
        assert messages[:len(before)] == before
        assert [m.text for m in messages[len(before):]] == [script]  # the turn's user message alone

        filler.unlink()
        for _ in range(300):
            snapshot = await sessions.get_agent_snapshot("s")
            if snapshot.state is not None and snapshot.state.status is AgentStatus.WAITING_FOR_USER_MESSAGE:
                break
            await asyncio.sleep(0.1)
        assert snapshot.state is not None and snapshot.state.status is AgentStatus.WAITING_FOR_USER_MESSAGE
        assert snapshot.state.last_turn_error is None
        answers = [m for m in await all_messages(sessions, "s") if m.role is MessageRole.ASSISTANT]
        assert [m.text for m in answers] == ["echo: first", answer]
        conn = sqlite3.connect(small_disk / "dex.db")
        try:
            assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        finally:
            conn.close()
        await assert_usable(sessions, "s", await all_messages(sessions, "s"))
    finally:
        await engine.stop_worker()
        await store.close()
    tracebacks = [r.getMessage() for r in caplog.records if r.exc_info is not None]
    assert any(m.startswith("flow s: worker error while running RunModel-2 attempt 1") for m in tracebacks), tracebacks
    assert sum(": lease renewal failed" in m for m in tracebacks) <= 1, tracebacks
    assert len(tracebacks) <= 6, tracebacks


def test_the_chat_ends_with_a_one_line_error_when_the_disk_fills(small_disk: Path) -> None:
    """`dex-agents chat` whose next message finds the disk full ends with SQLite's reason on one
    line (exit code 1). Catches: a traceback ending in sqlite3.OperationalError."""
    from agents.tests.test_cli import CLI, CLI_TIMEOUT_SECONDS

    env = {**os.environ, "COLUMNS": "200", "PYTHONUNBUFFERED": "1"}
    chat = subprocess.Popen([*CLI, "chat", "--data-dir", str(small_disk / "chat")], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        assert chat.stdin is not None and chat.stdout is not None
        chat.stdin.write("/echo first\n")
        chat.stdin.flush()
        for line in chat.stdout:  # the first answer: the session's file is written
            if "agent>" in line:
                assert "first" in line, line
                break
        else:
            pytest.fail("the chat ended before it answered")
        fill(small_disk)
        chat.stdin.write("/echo " + "x" * 3000 + "\n")  # more than any free page can take
        chat.stdin.close()
        rest = chat.stdout.read()
        code = chat.wait(CLI_TIMEOUT_SECONDS)
    finally:
        chat.kill()
    assert code == 1, rest
    assert "Error: database or disk is full" in rest and "Traceback" not in rest, rest
