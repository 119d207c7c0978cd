"""The `dex-engine` CLI against a real SQLite file prepared by running real flows.

A module fixture runs a few flows with an in-process worker and leaves them completed, failed or
waiting; read-only commands use that file, commands that change state get a private copy of it.
Bad input must exit with code 2 and print exactly one `Error: ...` line, never a traceback.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from click.testing import CliRunner, Result

from dex_engine import (
    Attribute,
    AttributeMap,
    Channel,
    Context,
    Flow,
    FlowInfo,
    Registry,
    RetryPolicy,
    RpcContext,
    Step,
    StepDecision,
    StepOptions,
    StoreOpenError,
    Stream,
    Timer,
    Wait,
    open_store,
    rpc,
)
from dex_engine import cli as cli_module
from dex_engine._migrate import migration_files
from dex_engine._open import shown_url
from dex_engine._records import EventPage
from dex_engine._store import Store
from dex_engine.cli import cli

from .conftest import engine_for, wait_until
from .schema_states import migrate_to, pg_tables, stored_version

Count: Attribute[int] = Attribute("Count", int)
Notes: AttributeMap[str] = AttributeMap("Notes", str)
Inbox: Channel[str] = Channel("Inbox", str)
Log: Stream[str] = Stream("Log", str)
Later: Stream[str] = Stream("Later", str)  # first written when Wait ends

# The installed console script (entry point dex_engine.cli:main), next to this interpreter.
DEX_ENGINE = str(Path(sys.executable).with_name("dex-engine"))
TIME = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z"


async def start(ctx: Context, n: int) -> StepDecision:
    if n < 0:
        return StepDecision.force_fail("n must be >= 0")
    if ctx.attempt == 1:
        raise RuntimeError("flaky")  # every flow's Start fails once, so history shows a retry
    ctx.set(Count, n)
    ctx.set(Notes["a"], "first")
    ctx.set(Notes["b"], "second")
    ctx.write_event(Log, "started")
    return StepDecision.go_to("Wait", None)


async def wait_wait(ctx: Context, _: None) -> Wait:
    # An hour-long timer: it fires only when skipped, so describe shows a due time.
    return Wait.any_of(Inbox.for_one(), Timer.by_duration(3600))


async def wait_execute(ctx: Context, _: None) -> StepDecision:
    assert ctx.wait_result is not None
    if ctx.wait_result.timer_fired:
        return StepDecision.graceful_complete("timer")
    (msg,) = ctx.wait_result.messages(Inbox)
    ctx.write_event(Log, f"got {msg}")
    ctx.write_event(Later, msg)
    return StepDecision.graceful_complete(msg)


@rpc(request_type=str)
async def say(ctx: RpcContext, text: str) -> None:
    ctx.publish(Inbox, text)


QUICK = StepOptions(execute_retry=RetryPolicy(max_attempts=3, initial_interval_seconds=0.05))
STEPS = [Step("Start", start, input_type=int, options=QUICK),
         Step("Wait", wait_execute, wait_for=wait_wait, input_type=type(None))]
CLI_FLOW = Flow("Cli", STEPS, start_step="Start", schema=[Count, Notes, Inbox, Log, Later], rpcs=[say])
# Another flow type with the same Step types: searches must tell the two apart by FlowType.
OTHER_FLOW = Flow("Other", STEPS, start_step="Start", schema=[Count, Notes, Inbox, Log, Later], rpcs=[say])
REGISTRY = Registry([CLI_FLOW, OTHER_FLOW])

# Started in this order (so `list`, newest first, shows them reversed).
FLOWS = [("done-1", "Cli", 3), ("failed-1", "Cli", -1), ("other-1", "Other", 1),
         ("waiting-1", "Cli", 1), ("waiting-2", "Cli", 2)]
WAITING_CLI = {"waiting-1", "waiting-2"}


async def _prepare(url: str) -> None:
    async with engine_for(url, REGISTRY) as eng:
        for flow_id, flow_type, n in FLOWS:
            await eng.client.start_flow(flow_type, flow_id, n)

            async def settled(flow_id: str = flow_id) -> bool:
                info = await eng.client.describe_flow(flow_id)
                return info.status != "running" or any(s.state == "waiting" for s in info.active_steps)

            await wait_until(f"{flow_id} waiting or closed", settled)
        await eng.client.rpc("done-1", "say", "hello")
        assert (await eng.client.wait_for_flow("done-1", 10)).status == "completed"


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A database file holding FLOWS: done-1 completed, failed-1 failed, the others waiting in Wait-1."""
    path = tmp_path_factory.mktemp("cli") / "prepared.db"
    asyncio.run(_prepare(f"sqlite:///{path}"))
    return path


@pytest.fixture
def db(prepared: Path) -> str:
    """URL of the shared prepared database (read-only commands)."""
    return f"sqlite:///{prepared}"


@pytest.fixture
def db_copy(prepared: Path, tmp_path: Path) -> str:
    """URL of a private copy of the prepared database (commands that change state)."""
    target = tmp_path / "copy.db"
    shutil.copy(prepared, target)  # the store closed cleanly, so the WAL was checkpointed into the file
    return f"sqlite:///{target}"


def run(*args: str, env: dict[str, str | None] | None = None) -> Result:
    return CliRunner().invoke(cli, list(args), env=env)


def ok(*args: str) -> str:
    result = run(*args)
    assert result.exit_code == 0, (result.output, result.exception)
    return result.stdout


def assert_one_line_error(result: Result, *needles: str) -> None:
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert isinstance(result.exception, SystemExit)
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def table_rows(output: str) -> list[list[str]]:
    """Cells of a rich table's body rows (cells are separated by two or more spaces)."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    body = lines[2:]  # header, rule
    return [re.split(r"\s{2,}", line) for line in body]


# list / search ------------------------------------------------------------------------------


def test_list_shows_every_flow_newest_first_with_status_and_active_steps(db: str) -> None:
    """`list` is one row per flow, newest first: id, type, status, created, closed, active steps."""
    rows = table_rows(ok("list", "--db", db))
    assert [r[0] for r in rows] == [f for f, _, _ in reversed(FLOWS)]
    by_id = {r[0]: r for r in rows}
    assert by_id["done-1"][1:3] == ["Cli", "completed"]
    assert re.fullmatch(TIME, by_id["done-1"][3]) and re.fullmatch(TIME, by_id["done-1"][4])
    assert by_id["done-1"][5] == "-"
    assert by_id["failed-1"][2] == "failed"
    assert by_id["waiting-1"][1:3] == ["Cli", "running"]
    assert re.fullmatch(TIME, by_id["waiting-1"][3]) and by_id["waiting-1"][4] == "-"
    assert by_id["waiting-1"][5] == "Wait-1 (waiting)"
    assert by_id["other-1"][1] == "Other"


def test_list_filters_by_type_status_and_limit(db: str) -> None:
    """--type, --status and --limit narrow the table; no match says so."""
    assert [r[0] for r in table_rows(ok("list", "--type", "Other", "--db", db))] == ["other-1"]
    running = [r[0] for r in table_rows(ok("list", "--status", "running", "--db", db))]
    assert running == ["waiting-2", "waiting-1", "other-1"]
    assert [r[0] for r in table_rows(ok("list", "--status", "running", "--type", "Cli", "--limit", "1",
                                        "--db", db))] == ["waiting-2"]
    assert ok("list", "--type", "Nope", "--db", db).strip() == "No flows match."


def test_search_finds_flows_by_active_step_and_type(db: str) -> None:
    """`search` prints the IDs the query matches, one per line; AND narrows by flow type."""
    found = ok("search", 'ActiveStepTypes = "Wait" AND FlowType = "Cli"', "--db", db).split()
    assert set(found) == WAITING_CLI
    both_types = ok("search", 'ActiveStepTypes = "Wait"', "--db", db).split()
    assert set(both_types) == WAITING_CLI | {"other-1"}
    assert ok("search", 'FlowStatus = "completed"', "--db", db).split() == ["done-1"]
    result = run("search", 'FlowType = "Nope"', "--db", db)
    assert result.exit_code == 0 and result.stdout == ""


# describe -----------------------------------------------------------------------------------


def test_describe_running_flow_shows_its_waiting_step_and_timer(db: str) -> None:
    """A waiting flow: status, times, config and the active Step with state, method, attempt, timer due."""
    out = ok("describe", "waiting-1", "--db", db)
    assert re.search(r"^status\s+running\s*$", out, re.M)
    assert re.search(rf"^created\s+{TIME}\s*$", out, re.M)
    assert re.search(r"^closed\s+- \(running for [\d.]+ s\)", out, re.M)
    config = re.search(r"^config\s+(\{.*\})\s*$", out, re.M)
    assert config and json.loads(config.group(1)) == {"active_step_search": True, "default_step_durability": "SYNC"}
    # The hour-long timer of the wait is due in the future.
    assert re.search(rf"^Wait-1\s+Wait\s+waiting\s+execute\s+1\s+{TIME} \(in \d+\.\d s\)\s*$", out, re.M), out


def test_describe_shows_times_in_utc_whatever_the_hosts_time_zone(
    db: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a host whose local time is not UTC, describe shows the flow's start as the wire does, in
    UTC with milliseconds and Z. Catches: the host's local time, unmarked, 5:30 hours off here."""
    info = asyncio.run(_describe(db, "done-1"))
    monkeypatch.setenv("TZ", "Asia/Kolkata")
    time.tzset()
    try:
        out = ok("describe", "done-1", "--db", db)
    finally:
        monkeypatch.undo()
        time.tzset()
    created = datetime.fromtimestamp(info.created_at_ms / 1000, UTC).isoformat(timespec="milliseconds")
    assert re.search(rf"^created\s+{re.escape(created.replace('+00:00', 'Z'))}\s*$", out, re.M), out


async def _describe(db: str, flow_id: str) -> FlowInfo:
    store = open_store(db)
    try:
        return await store.describe_flow(flow_id)
    finally:
        await store.close()


def test_describe_closed_flows_show_output_or_error(db: str) -> None:
    """A completed flow shows its JSON output, a failed one its error; neither has active Steps."""
    done = ok("describe", "done-1", "--db", db)
    assert re.search(r"^status\s+completed", done, re.M)
    assert re.search(rf"^closed\s+{TIME} \(after [\d.]+ s\)", done, re.M)
    assert re.search(r'^output\s+"hello"', done, re.M)
    assert "No active Steps." in done
    failed = ok("describe", "failed-1", "--db", db)
    assert re.search(r"^status\s+failed", failed, re.M)
    assert re.search(r"^error\s+n must be >= 0", failed, re.M)


# history ------------------------------------------------------------------------------------

DONE_HISTORY = [
    ("step_scheduled", "Start", "Start-1", 0, ""),
    ("attempt_failed", "Start", "Start-1", 1, "execute: RuntimeError: flaky"),
    ("execute_completed", "Start", "Start-1", 2, "movements"),
    ("step_scheduled", "Wait", "Wait-1", 0, ""),
    ("wait_registered", "Wait", "Wait-1", 1, ""),
    ("wait_completed", "Wait", "Wait-1", 0, "satisfied [0]"),
    ("execute_completed", "Wait", "Wait-1", 1, "graceful_complete"),
    ("flow_closed", "", "", 0, "completed"),
]


def _history_pattern(event: str, step_type: str, seid: str, attempt: int, detail: str) -> str:
    cells = [c for c in (event, step_type, seid, str(attempt)) if c]
    return r"^" + r"\s+".join(map(re.escape, cells)) + rf"\s+{TIME}" + (rf"\s+{re.escape(detail)}" if detail else "")


def test_history_lists_every_step_event_in_order(db: str) -> None:
    """`history` shows each event's type, Step type, execution ID, attempt, time and detail, oldest first."""
    lines = [line.strip() for line in ok("history", "done-1", "--db", db).splitlines() if line.strip()]
    assert lines[0].split() == ["event_type", "step_type", "step_execution_id", "attempt", "time", "detail"]
    body = lines[2:]
    assert len(body) == len(DONE_HISTORY), body
    for line, expected in zip(body, DONE_HISTORY, strict=True):
        assert re.match(_history_pattern(*expected), line), (line, expected)


def test_history_limit_keeps_the_newest_events(db: str) -> None:
    """--limit N shows the last N events."""
    body = [line.strip() for line in ok("history", "done-1", "--limit", "2", "--db", db).splitlines()
            if line.strip()][2:]
    assert len(body) == 2
    assert re.match(_history_pattern(*DONE_HISTORY[-2]), body[0])
    assert re.match(_history_pattern(*DONE_HISTORY[-1]), body[1])


# attributes ---------------------------------------------------------------------------------


def test_attributes_prints_values_as_json_with_maps_by_key(db: str) -> None:
    """Plain attributes by name, attribute maps as an object by key; --name picks one."""
    assert json.loads(ok("attributes", "done-1", "--db", db)) == {"Count": 3, "Notes": {"a": "first", "b": "second"}}
    assert json.loads(ok("attributes", "done-1", "--name", "Notes", "--db", db)) == {"a": "first", "b": "second"}
    assert json.loads(ok("attributes", "done-1", "--name", "Count", "--db", db)) == 3
    assert json.loads(ok("attributes", "failed-1", "--db", db)) == {}


# stream -------------------------------------------------------------------------------------


def test_stream_prints_events_as_json_lines(db: str) -> None:
    """Each event is one JSON line with its sequence, Step execution ID and attempt; --after skips."""
    events = [json.loads(line) for line in ok("stream", "done-1", "Log", "--db", db).splitlines()]
    assert events == [
        {"sequence": 1, "step_execution_id": "Start-1", "attempt": 2, "value": "started"},
        {"sequence": 2, "step_execution_id": "Wait-1", "attempt": 1, "value": "got hello"},
    ]
    after = [json.loads(line) for line in ok("stream", "done-1", "Log", "--after", "1", "--db", db).splitlines()]
    assert [e["sequence"] for e in after] == [2]
    assert ok("stream", "done-1", "Log", "--after", "2", "--db", db) == ""
    # --follow on a closed flow prints what is there and returns.
    assert len(ok("stream", "done-1", "Log", "--follow", "--db", db).splitlines()) == 2


async def test_stream_follow_waits_for_new_events_until_the_flow_closes(db_copy: str) -> None:
    """--follow (the installed `dex-engine` script) waits for a stream's first event and exits when the flow closes."""
    async with engine_for(db_copy, REGISTRY) as eng:
        proc = await asyncio.create_subprocess_exec(
            DEX_ENGINE, "stream", "waiting-1", "Later", "--follow", "--db", db_copy,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        try:
            assert proc.stderr is not None
            note = await asyncio.wait_for(proc.stderr.readline(), 30)
            assert b"no events yet; waiting" in note
            # The follower has looked and found nothing; only now does the flow write the event and close.
            await eng.client.rpc("waiting-1", "say", "bye")
            out, err = await asyncio.wait_for(proc.communicate(), 30)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    assert proc.returncode == 0, err
    assert [json.loads(line) for line in out.decode().splitlines()] == [
        {"sequence": 1, "step_execution_id": "Wait-1", "attempt": 1, "value": "bye"},
    ]


Burst: Stream[str] = Stream("Burst", str, capacity_bytes=50)  # each event below is 5 bytes as JSON: 10 kept


@rpc(request_type=list[str])
async def burst(ctx: RpcContext, values: list[str]) -> None:
    for value in values:
        ctx.append(Burst, value)


async def _idle(ctx: Context, _: None) -> StepDecision:
    return StepDecision.dead_end()


BURST_FLOW = Flow("Burst", [Step("Idle", _idle, input_type=type(None))], schema=[Burst], rpcs=[burst])


async def test_stream_follow_says_when_events_were_trimmed_while_it_followed(db_url: str) -> None:
    """--follow says which events it missed when a burst trims them between two of its reads, as it
    does for the first read: the printed sequences jump, and a reader piping the lines on must not
    take the jump for the stream's whole story. Catches: a gap reported only on the first read."""
    async with engine_for(db_url, Registry([BURST_FLOW])) as eng:
        await eng.client.start_flow("Burst", "b1")
        await eng.client.rpc("b1", "burst", ["e01", "e02"])
        proc = await asyncio.create_subprocess_exec(
            DEX_ENGINE, "stream", "b1", "Burst", "--follow", "--db", db_url,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        try:
            assert proc.stdout is not None
            for _ in range(2):
                await asyncio.wait_for(proc.stdout.readline(), 30)
            # The follower has printed 1 and 2; one commit appends 3..22 and trims 1..12 (capacity).
            await eng.client.rpc("b1", "burst", [f"e{i:02d}" for i in range(3, 23)])
            await eng.client.stop_flow("b1")
            out, err = await asyncio.wait_for(proc.communicate(), 30)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    assert proc.returncode == 0, err
    assert [json.loads(line)["sequence"] for line in out.decode().splitlines()] == list(range(13, 23))
    assert "events 3..12 were trimmed (stream capacity)" in err.decode(), err


async def test_stream_follow_prints_again_the_events_a_crash_renumbered(db_url: str) -> None:
    """--follow notices that events it printed are gone or other events now, as a database crash
    leaves them (best-effort events are written without fsync; the events written after the restart
    take their sequences; here the stored events are replaced by hand): it says so on stderr and
    prints on from the first one changed. Catches: a follower that reads on after its last sequence
    and silently skips the events that took the lost sequences."""
    async with engine_for(db_url, Registry([BURST_FLOW])) as eng:
        await eng.client.start_flow("Burst", "c1")
        await eng.client.rpc("c1", "burst", ["e01", "e02", "e03"])
        proc = await asyncio.create_subprocess_exec(
            DEX_ENGINE, "stream", "c1", "Burst", "--follow", "--db", db_url,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        try:
            assert proc.stdout is not None
            first = [await asyncio.wait_for(proc.stdout.readline(), 30) for _ in range(3)]

            def crash_renumbers(db: Any) -> None:
                for seq in (2, 3):
                    db.run("UPDATE stream_events SET value = ? WHERE flow_id = ? AND stream = ? AND seq = ?",
                           (json.dumps(f"n{seq:02d}").encode(), "c1", "Burst", seq))

            await eng.store.raw(crash_renumbers, write=True)
            await eng.client.rpc("c1", "burst", ["n04"])
            await eng.client.stop_flow("c1")
            out, err = await asyncio.wait_for(proc.communicate(), 30)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    assert proc.returncode == 0, err
    lines = [json.loads(line) for line in (b"".join(first) + out).decode().splitlines()]
    printed = [(line["sequence"], line["value"]) for line in lines]
    assert printed == [(1, "e01"), (2, "e02"), (3, "e03"), (2, "n02"), (3, "n03"), (4, "n04")], err
    assert ("events 2..3 this follower printed are gone or other events now: a database crash lost them"
            in err.decode()), err


@dataclass
class PausedFollower:
    """A `dex-engine stream --follow` whose waits between polls the test holds (pause_follower)."""

    polls: list[float]  # the delay of each wait between polls so far
    paused: threading.Event  # set when the follower waits at the held poll
    resume: threading.Event  # set by the test: the follower goes on polling


def pause_follower(monkeypatch: pytest.MonkeyPatch, at_poll: int = 1) -> PausedFollower:
    """Hold the follower's `at_poll`-th wait between polls until the test sets `resume`. The CLI's
    module sees this `asyncio` (its own run, this sleep): the test decides when it polls."""
    follower = PausedFollower([], threading.Event(), threading.Event())

    async def poll_pause(delay: float) -> None:
        follower.polls.append(delay)
        if len(follower.polls) >= at_poll and not follower.resume.is_set():
            follower.paused.set()
            await asyncio.get_running_loop().run_in_executor(None, follower.resume.wait)
        await asyncio.sleep(0.01)

    monkeypatch.setattr(cli_module, "asyncio", SimpleNamespace(run=asyncio.run, sleep=poll_pause))
    return follower


async def test_stream_follow_says_when_its_flow_was_deleted_and_started_again(
    db_url: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--follow whose flow is stopped, deleted and started again under its ID between two of its polls
    says so and stops, as it stops when its flow closes (the old one closed before it was deleted).
    Catches: a follower that took the new flow's events, whose sequences count from 1 again, for a
    database crash's renumbering of the old one's, or printed them on as the old flow's."""
    follower = pause_follower(monkeypatch)
    async with engine_for(db_url, Registry([BURST_FLOW])) as eng:
        await eng.client.start_flow("Burst", "r1")
        await eng.client.rpc("r1", "burst", ["old1", "old2", "old3"])
        following = asyncio.ensure_future(asyncio.to_thread(run, "stream", "r1", "Burst", "--follow", "--db", db_url))
        try:
            await asyncio.wait_for(asyncio.to_thread(follower.paused.wait), 30)
            await eng.client.stop_flow("r1", "replaced")
            assert await eng.client.delete_flow("r1")
            await eng.client.start_flow("Burst", "r1")
            await eng.client.rpc("r1", "burst", ["new1"])
        finally:
            follower.resume.set()
        # Ended, or polled again: one that reads on follows the new flow until it closes.
        await wait_until("the follower ended or polled again",
                         lambda: asyncio.sleep(0, following.done() or len(follower.polls) > 1))
        if not following.done():
            await eng.client.stop_flow("r1")
        result = await asyncio.wait_for(following, 30)
    printed = [json.loads(line)["value"] for line in result.stdout.splitlines()]
    assert printed == ["old1", "old2", "old3"], result.output
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("Error: flow 'r1' was deleted and started again while this follower read it ("), \
        result.output
    assert "run it again to follow the new flow" in result.stderr, result.output


# skip-timer / stop / workers ----------------------------------------------------------------


async def test_skip_timer_fires_the_waiting_steps_timer(db_copy: str) -> None:
    """skip-timer fires Wait-1's hour-long timer now; a worker then completes the flow through the timer branch."""
    result = await asyncio.to_thread(run, "skip-timer", "waiting-1", "Wait-1", "--db", db_copy)
    assert result.exit_code == 0, result.output
    assert "Wait-1" in result.stdout and "waiting-1" in result.stdout
    history = await asyncio.to_thread(ok, "history", "waiting-1", "--db", db_copy)
    assert re.search(r"^\s*wait_completed\s+Wait\s+Wait-1\s+0\s+.*satisfied \[1\]", history, re.M), history
    async with engine_for(db_copy, REGISTRY) as eng:
        info = await eng.client.wait_for_flow("waiting-1", 10)
        assert info.status == "completed"
        assert await eng.client.flow_output("waiting-1") == "timer"
    # The flow is closed now: skipping again is bad input.
    assert_one_line_error(await asyncio.to_thread(run, "skip-timer", "waiting-1", "Wait-1", "--db", db_copy),
                          "waiting-1", "completed")


def test_delete_removes_a_closed_flow_and_refuses_a_running_one(db_copy: str) -> None:
    """delete removes a closed flow (it is unknown afterwards); a running flow is refused and kept,
    an unknown one is an error naming it: each a one-line error."""
    out = ok("delete", "done-1", "--db", db_copy)
    assert out == "Deleted flow done-1.\n"
    assert_one_line_error(run("describe", "done-1", "--db", db_copy), "no flow with ID 'done-1'")
    assert_one_line_error(run("delete", "done-1", "--db", db_copy), "no flow with ID 'done-1' in sqlite:///")
    assert_one_line_error(run("delete", "waiting-1", "--db", db_copy),
                          "flow 'waiting-1' is still running; stop it first (dex-engine stop waiting-1 --db sqlite:///")
    assert re.search(r"^status\s+running", ok("describe", "waiting-1", "--db", db_copy), re.M)
    assert_one_line_error(run("delete", "bad\x01id", "--db", db_copy), "no flow with ID 'bad\\x01id'")


def test_stop_closes_a_running_flow(db_copy: str) -> None:
    """stop closes the flow as stopped with the reason, cancelling its Step; stopping it again is refused."""
    out = ok("stop", "waiting-2", "--reason", "testing the CLI", "--db", db_copy)
    assert "waiting-2" in out
    described = ok("describe", "waiting-2", "--db", db_copy)
    assert re.search(r"^status\s+stopped", described, re.M)
    assert re.search(r"^error\s+testing the CLI", described, re.M)
    assert "No active Steps." in described
    history = ok("history", "waiting-2", "--db", db_copy)
    assert re.search(r"^\s*step_cancelled\s+Wait\s+Wait-1\s", history, re.M)
    assert re.search(r"^\s*flow_closed\s+0\s+.*stopped: testing the CLI", history, re.M)
    assert_one_line_error(run("stop", "waiting-2", "--db", db_copy), "waiting-2", "stopped")


async def test_workers_lists_a_live_worker_and_its_lease(db_copy: str) -> None:
    """`workers` shows a running worker as live with its lease expiry; none once it stopped."""
    async with engine_for(db_copy, REGISTRY, worker=False) as eng:
        # A long lease, so a slow machine cannot let it lapse between a renewal and the CLI's read.
        worker = await eng.start_worker(lease_ttl_seconds=60.0, lease_renew_seconds=1.0)
        out = await asyncio.to_thread(ok, "workers", "--db", db_copy)
        row = next(line for line in out.splitlines() if worker.worker_id in line)
        assert re.search(rf"{TIME} \(in [\d.]+ s\)\s+live", row), row
    assert (await asyncio.to_thread(ok, "workers", "--db", db_copy)).strip() == "No workers registered."


# --db and bad input -------------------------------------------------------------------------


def test_db_comes_from_the_environment_then_the_default(
    db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without --db the CLI uses $DEX_ENGINE_DB, else sqlite:///dex.db (and never creates that file)."""
    result = run("search", 'FlowStatus = "completed"', env={"DEX_ENGINE_DB": db})
    assert result.exit_code == 0 and result.stdout.split() == ["done-1"]
    monkeypatch.chdir(tmp_path)
    # Relative, from the working directory: the error names that directory and the file's absolute
    # path (as a worker's start log does), so a command run from the wrong directory is told so.
    assert_one_line_error(run("list", env={"DEX_ENGINE_DB": None}),
                          f"no database file {str(tmp_path / 'dex.db')!r} (from --db sqlite:///dex.db, relative "
                          f"to the working directory {str(tmp_path)!r})", "DEX_ENGINE_DB")
    assert not (tmp_path / "dex.db").exists()


@pytest.mark.parametrize(("args", "needles"), [
    (["describe", "nope"], ["no flow with ID 'nope'"]),
    (["history", "nope"], ["no flow with ID 'nope'"]),
    (["attributes", "nope"], ["no flow with ID 'nope'"]),
    (["stream", "nope", "Log"], ["no flow with ID 'nope'"]),
    (["skip-timer", "nope", "Wait-1"], ["no flow with ID 'nope'"]),
    (["stop", "nope"], ["no flow with ID 'nope'"]),
    (["delete", "nope"], ["no flow with ID 'nope'"]),
    (["attributes", "done-1", "--name", "Missing"], ["'Missing'", "Count", "Notes"]),
    (["stream", "done-1", "Nope"], ["'Nope'", "Log"]),
    (["stream", "waiting-1", "Later"], ["'Later'", "Log"]),  # running, but no events yet and no --follow
    (["search", "FlowType = Cli"], ["cannot parse", "FlowType = Cli"]),
    (["search", 'FlowType = "a" AND FlowType = "b"'], ["FlowType appears twice"]),
    (["search", 'Owner = "me"'], ["Owner"]),
    (["skip-timer", "waiting-1", "Start-1"], ["Start-1"]),
    (["skip-timer", "done-1", "Wait-1"], ["done-1", "completed"]),
])
def test_bad_input_prints_one_error_line_and_exits_2(db: str, args: list[str], needles: list[str]) -> None:
    """Unknown flows, attributes and streams, malformed queries, Steps not waiting: one clear line, exit 2."""
    assert_one_line_error(run(*args, "--db", db), *needles)


# A command-line byte that is not UTF-8 (a Latin-1 terminal, a pasted byte), as Python decodes argv.
NOT_UTF8 = b"caf\xe9".decode("utf-8", "surrogateescape")


@pytest.mark.parametrize(("args", "needles"), [
    (["describe", NOT_UTF8], ["no flow with ID 'caf\\udce9' in sqlite:///"]),
    (["history", NOT_UTF8], ["no flow with ID 'caf\\udce9' in sqlite:///"]),
    (["attributes", NOT_UTF8], ["no flow with ID 'caf\\udce9' in sqlite:///"]),
    (["stream", NOT_UTF8, "Log"], ["no flow with ID 'caf\\udce9' in sqlite:///"]),
    (["skip-timer", NOT_UTF8, "Wait-1"], ["no flow with ID 'caf\\udce9' in sqlite:///"]),
    (["stop", NOT_UTF8], ["no flow with ID 'caf\\udce9' in sqlite:///"]),
    (["delete", NOT_UTF8], ["no flow with ID 'caf\\udce9' in sqlite:///"]),
    (["stream", "done-1", NOT_UTF8], ["no events in stream 'caf\\udce9'", "Log"]),
    (["stream", "waiting-1", NOT_UTF8, "--follow"], ["no events in stream 'caf\\udce9'", "Log"]),
    (["skip-timer", "waiting-1", NOT_UTF8], ["Step execution 'caf\\udce9' of flow 'waiting-1' is not waiting"]),
])
def test_names_that_are_not_utf8_are_unknown_like_any_other(db: str, args: list[str], needles: list[str]) -> None:
    """A flow ID, stream name or Step execution ID with a byte that is not UTF-8 is one no flow has:
    the one-line error of an unknown one, exit 2 (and `stream --follow` does not wait for a stream
    that can never be written). Catches: a UnicodeEncodeError traceback from the database driver."""
    assert_one_line_error(run(*args, "--db", db), *needles)


@pytest.mark.parametrize(("args", "stdout", "stderr"), [
    (["list", "--type", NOT_UTF8], "No flows match.\n", ""),
    (["search", f'FlowType = "{NOT_UTF8}"'], "", "no flows match\n"),
    (["search", f'ActiveStepTypes = "Wait" AND FlowType = "{NOT_UTF8}"'], "", "no flows match\n"),
])
def test_types_that_are_not_utf8_match_no_flows(db: str, args: list[str], stdout: str, stderr: str) -> None:
    """A flow or Step type with a byte that is not UTF-8 matches nothing, as any unknown type does.
    Catches: a UnicodeEncodeError traceback from the database driver."""
    result = run(*args, "--db", db)
    assert result.exit_code == 0, (result.output, result.exception)
    assert (result.stdout, result.stderr) == (stdout, stderr)


@pytest.mark.parametrize(("args", "error"), [
    (["list", "--limit", str(10**30)], f"Error: Invalid value for '--limit': {10**30} is not in the range "
                                       "1<=x<=1000000000."),
    (["search", 'FlowType = "Cli"', "--limit", str(10**30)], "Error: Invalid value for '--limit'"),
    (["history", "done-1", "--limit", str(10**30)], "Error: Invalid value for '--limit'"),
    (["stream", "done-1", "Log", "--after", str(10**30)], f"Error: Invalid value for '--after': {10**30} is not "
                                                           "in the range 0<=x<=9223372036854775807."),
])
def test_numbers_past_the_databases_integers_are_refused_as_usage_errors(db: str, args: list[str], error: str) -> None:
    """Catches: a limit or position past what the database's 64-bit integers hold reaching the
    query, which failed with an OverflowError's traceback."""
    result = run(*args, "--db", db)
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert result.output.strip().splitlines()[-1].startswith(error), result.output


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full, whose writes fail with ENOSPC")
@pytest.mark.parametrize("args", [["list"], ["describe", "done-1"], ["history", "done-1"], ["attributes", "done-1"],
                                  ["stream", "done-1", "Log"]])
def test_output_that_cannot_be_written_ends_with_one_error_line(db: str, args: list[str]) -> None:
    """Output redirected to a full disk (/dev/full here): one error line saying the output cannot be
    written, exit code 1. Catches: rich's or click's OSError as a traceback (click answers only EPIPE)."""
    with open("/dev/full", "w") as full:
        done = subprocess.run([DEX_ENGINE, *args, "--db", db], stdout=full, stderr=subprocess.PIPE, text=True,
                              check=False, timeout=60)
    assert done.returncode == 1, done.stderr
    assert done.stderr == "Error: cannot write the output: [Errno 28] No space left on device\n", done.stderr


def test_bad_database_urls_print_one_error_line_and_exit_2(tmp_path: Path) -> None:
    """Unsupported schemes, URLs without a file, missing files and non-database files are refused up front."""
    not_a_db = tmp_path / "notes.txt"
    not_a_db.write_text("hello")
    plain = tmp_path / "plain.db"
    plain.touch()
    cases = [
        ("mysql://host/db", ["unsupported database URL"]),
        ("sqlite://", ["names no file"]),
        (f"sqlite:///{tmp_path}/missing.db", ["missing.db"]),
        (f"sqlite:///{not_a_db}", ["notes.txt", "not a readable SQLite database"]),
        (f"sqlite:///{plain}", ["plain.db", "not a dex-engine database"]),
    ]
    for url, needles in cases:
        assert_one_line_error(run("list", "--db", url), *needles)
    assert not (tmp_path / "missing.db").exists()
    assert_one_line_error(run("demo", "--db", "mysql://host/db"), "unsupported database URL")
    # A PostgreSQL server that is not there (nothing listens on port 1): one line naming the URL and
    # the server's refusal, and never the URL's password.
    # A malformed URL, whose parser's message quotes it whole: the password is hidden there too.
    malformed = run("list", "--db", "postgresql://me:hunter2@[::1/db")
    assert_one_line_error(malformed, "malformed PostgreSQL URL 'postgresql://me:***@[::1/db'")
    assert "hunter2" not in malformed.output
    refused = run("list", "--db", "postgresql://me:hunter2@127.0.0.1:1/db")
    assert_one_line_error(refused, "cannot open 'postgresql://me:***@127.0.0.1:1/db' as a dex_engine database",
                          "OperationalError", "Connection refused")
    assert "hunter2" not in refused.output
    assert_one_line_error(run("demo", "--db", f"sqlite:///{not_a_db}"), "notes.txt")
    # A new file the store cannot create (its directory is a file): one line naming it, from the store.
    assert_one_line_error(run("demo", "--db", f"sqlite:///{not_a_db}/demo.db"),
                          "cannot open", "notes.txt/demo.db", "as a dex_engine database")


def test_open_store_of_an_existing_database_refuses_a_missing_or_foreign_sqlite_file(tmp_path: Path) -> None:
    """open_store(url, existing=True), as a reader of the workers' database does (read_step_history):
    a SQLite file that is not there raises FileNotFoundError naming it, and one without dex_engine
    tables StoreOpenError; neither is created or written. Catches `existing` ignored, which created an
    empty engine database at a mistyped path and read no flows from it."""
    missing = tmp_path / "missing.db"
    with pytest.raises(FileNotFoundError, match=re.escape(
        f"no database file {str(missing)!r} (from 'sqlite:///{missing}'); pass the URL of the engine database "
        "the workers use",
    )):
        open_store(f"sqlite:///{missing}", existing=True)
    assert not missing.exists()
    plain = tmp_path / "plain.db"
    plain.touch()
    with pytest.raises(StoreOpenError, match=re.escape(
        f"{str(plain)!r} is not a dex-engine database (it has no flows table); nothing was created in it: pass "
        "the URL of the engine database the workers use",
    )):
        open_store(f"sqlite:///{plain}", existing=True)
    assert plain.stat().st_size == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="chattr +i needs root (CAP_LINUX_IMMUTABLE)")
@pytest.mark.parametrize("immutable", ["directory", "file"])
def test_a_database_this_process_may_not_write_is_named_as_such(db_copy: str, immutable: str) -> None:
    """An engine database in a directory this process may not write (a read-only mount, a snapshot;
    here chattr +i, which binds root too), or a file it may not write: one line naming what may not
    be written and why the engine needs to. Catches: "not a readable SQLite database (unable to open
    database file)" for a healthy engine database, SQLite's text for its -shm file it may not create."""
    path = Path(db_copy.removeprefix("sqlite:///"))
    target = path.parent if immutable == "directory" else path
    what = f"its directory '{path.parent}'" if immutable == "directory" else "the file"
    subprocess.run(["chattr", "+i", str(target)], check=True)
    try:
        result = run("list", "--db", db_copy)
    finally:
        subprocess.run(["chattr", "-i", str(target)], check=True)
    assert_one_line_error(result, f"cannot use '{path}': this process may not write {what}",
                          "needs write access", "copy.db-wal, copy.db-shm and copy.db-dexlock")


@pytest.mark.parametrize(("url", "shown"), [
    ("postgresql://me:pw@db:5432/app", "postgresql://me:***@db:5432/app"),
    ("postgresql://me:p%40w@h1:1,h2:2/app", "postgresql://me:***@h1:1,h2:2/app"),
    ("postgresql://me:p@w@db/app", "postgresql://me:***@db/app"),  # an @ left unescaped in the password
    # A ?, # or / left unescaped: libpq takes the first two as part of the password, and the third
    # makes the URL name another host; either way the password must not be shown.
    ("postgresql://me:pa?ss@db/app", "postgresql://me:***@db/app"),
    ("postgresql://me:pa#ss@db/app?sslmode=require", "postgresql://me:***@db/app?sslmode=require"),
    ("postgresql://me:pa/ss@db/app", "postgresql://me:***@db/app"),
    ("postgresql://me:a?b#c/d@db/app?password=pw", "postgresql://me:***@db/app?password=***"),
    ("postgresql://db:5432/app?application_name=me@home", "postgresql://db:5432/app?application_name=me@home"),
    # libpq reads user:password up to the first '@' before any '/': this is user db, password
    # "5432?application_name=me", on host home.
    ("postgresql://db:5432?application_name=me@home", "postgresql://db:***@home"),
    ("postgresql://db:5432,db2:5433/app?application_name=me@home",
     "postgresql://db:5432,db2:5433/app?application_name=me@home"),
    # A password of digits, then a ?, #, , or / (as libpq reads the first three, the user meant the fourth).
    ("postgresql://me:123?ab@db/app", "postgresql://me:***@db/app"),
    ("postgresql://me:12#34@db/app", "postgresql://me:***@db/app"),
    ("postgresql://me:12,34@db/app", "postgresql://me:***@db/app"),
    ("postgresql://me:2024/x@db/app", "postgresql://me:***@db/app"),
    ("postgresql://me@db/app?sslmode=require&password=pw", "postgresql://me@db/app?sslmode=require&password=***"),
    ("postgresql://me@db/app?password=pw", "postgresql://me@db/app?password=***"),
    ("postgresql://me@db/app", "postgresql://me@db/app"),
    ("postgresql://me:pw@[::1/app?password=pw", "postgresql://me:***@[::1/app?password=***"),  # malformed
    # A libpq keyword string (refused, but named in the refusal), ?PASSWORD= (libpq refuses it, the
    # user meant a password), a URL read with a leading blank, one with a slash too few.
    ("host=db password=pw dbname=app", "host=db password=*** dbname=app"),
    ("host=db password='p w' dbname=app", "host=db password=*** dbname=app"),
    ("password = pw host=db", "password=*** host=db"),
    ("postgresql://me@db/app?PASSWORD=pw", "postgresql://me@db/app?password=***"),
    # sslpassword: the passphrase of the client certificate's key.
    ("postgresql://me@db/app?sslmode=verify-full&sslpassword=pw", "postgresql://me@db/app?sslmode=verify-full&sslpassword=***"),
    ("host=db sslpassword=pw", "host=db sslpassword=***"),
    ("  postgresql://me:pw@db/app", "  postgresql://me:***@db/app"),
    ("postgresql:/me:pw@db/app", "postgresql:/me:***@db/app"),
    ("sqlite://me:pw@db/app.db", "sqlite://me:***@db/app.db"),
    ("sqlite:////var/lib/app/dex.db", "sqlite:////var/lib/app/dex.db"),
    ("sqlite:///dex.db?synchronous=NORMAL", "sqlite:///dex.db?synchronous=NORMAL"),
])
def test_shown_url_hides_only_the_password(url: str, shown: str) -> None:
    assert shown_url(url) == shown


def test_messages_naming_a_postgresql_url_hide_its_password(pg_database: str) -> None:
    """A PostgreSQL URL with a password (here one the server's trust authentication ignores) is
    shown with *** for it: a flow that is not there is named with the URL, and the password is
    not. Catches: the password printed in errors, and so in terminals, logs and CI output."""
    with_password = pg_database.replace("://postgres@", "://postgres:hunter2@", 1)
    assert with_password != pg_database
    asyncio.run(open_store(pg_database).close())  # the engine's database, which has no such flow
    result = run("describe", "nope", "--db", with_password)
    assert_one_line_error(result, "no flow with ID 'nope' in ", "postgres:***@")
    assert "hunter2" not in result.output


# In the user:password part, or as ?password= (where an '@' is no more than a character). libpq
# takes a password's unescaped '@' for its end: it quotes a bad %-escape before it as the password's,
# and decodes a %-escape after it in what it takes for the host name, and quotes that.
@pytest.mark.parametrize("userinfo", [":hun%zzter2@", ":hun%00ter2@", ":p@hunter2@", ":hun%zzter2@p@",
                                      ":p@hun%41ter2@", "@"])
@pytest.mark.parametrize("existing", [False, True])
def test_a_password_libpq_quotes_on_its_own_is_not_shown(pg_database: str, userinfo: str, existing: bool) -> None:
    """A password with a bad %-escape, which libpq quotes whole in its refusal, or an unescaped '@',
    after which libpq takes the rest for the host name it cannot find, is shown as *** in what
    open_store raises, as in the URL. Catches: the password (or its tail) printed in the error."""
    url = pg_database.replace("://postgres@", f"://postgres{userinfo}", 1)
    if userinfo == "@":
        url += "?password=hun%zzter2"
    with pytest.raises((ValueError, StoreOpenError)) as refused:
        open_store(url, existing=existing)
    assert "ter2" not in "".join(traceback.format_exception(refused.value)), refused.value
    assert "***" in str(refused.value)


@pytest.mark.parametrize("url", ["host=127.0.0.1 password=hunter2 dbname=app", "sqlite://me:hunter2@db/app.db",
                                 " postgresql://me:hunter2@127.0.0.1/app", "sqlite:///app.db?password=hunter2",
                                 "sqlite:///app.db?synchronous=FAST&password=hunter2"])
def test_a_refused_url_is_named_without_its_password(url: str) -> None:
    """A URL open_store and the CLI refuse (a libpq keyword string, a sqlite URL with a host part, a
    leading blank) is named with *** for its password. Catches: the password in the refusal."""
    with pytest.raises(ValueError) as refused:
        open_store(url)
    assert "hunter2" not in str(refused.value) and "***" in str(refused.value), refused.value
    result = run("list", "--db", url)
    assert result.exit_code != 0 and "hunter2" not in result.output and "***" in result.output, result.output


@pytest.mark.parametrize("existing", [False, True])
def test_an_sslpassword_is_not_shown(pg_database: str, existing: bool) -> None:
    """The passphrase of the client certificate's key, given as ?sslpassword= (libpq reads it only
    with a client key, so the test server ignores it), is shown as *** in open_store's refusal of a
    database the server does not have. Catches: the passphrase printed in the error."""
    url = f"{pg_database}_missing?sslpassword=hunter2"
    with pytest.raises(StoreOpenError, match="does not exist") as refused:
        open_store(url, existing=existing)
    assert "hunter2" not in str(refused.value) and "sslpassword=***" in str(refused.value), refused.value


# Every command that reads or operates a database the workers use (all but demo).
DATABASE_COMMANDS = [["list"], ["search", 'FlowType = "Cli"'], ["describe", "done-1"], ["history", "done-1"],
                     ["attributes", "done-1"], ["stream", "done-1", "Log"], ["skip-timer", "waiting-1", "Wait-1"],
                     ["stop", "waiting-1"], ["delete", "done-1"], ["workers"]]


def test_commands_leave_a_database_of_an_older_schema_unmigrated(db_url: str) -> None:
    """A database an older dex_engine made, its workers still running on it, is refused by every
    command with one line naming both schema versions, and stays as it was. Catches: `dex-engine
    list`, which only reads, migrating the database under the older workers."""
    backend = "postgres" if db_url.startswith("postgres") else "sqlite"
    latest = migration_files(backend)[-1][0]
    migrate_to(db_url, latest - 1)
    named = db_url.removeprefix("sqlite:///") if backend == "sqlite" else shown_url(db_url)
    for args in DATABASE_COMMANDS:
        assert_one_line_error(run(*args, "--db", db_url),
                              f"{named!r} has dex_engine schema version {latest - 1}, older than the {latest}",
                              "nothing was changed")
        assert stored_version(db_url) == str(latest - 1), args
    # open_store(existing=True), the library's reader of the workers' database, refuses it too.
    with pytest.raises(StoreOpenError, match=re.escape(
        f"{named!r} has dex_engine schema version {latest - 1}, older than the {latest} this dex_engine uses",
    )) as refused:
        open_store(db_url, existing=True)
    assert "read it with the dex_engine of their version" in str(refused.value)
    assert stored_version(db_url) == str(latest - 1)


def test_commands_create_nothing_in_a_postgresql_database_without_flows(pg_database: str) -> None:
    """A PostgreSQL URL naming a database without dex_engine's tables (a typo, the application's own
    database) is refused with one line naming it, and nothing is created there, as a SQLite path
    naming no file is refused. Catches: every table of the engine created in that database, and
    `list` answering "No flows match." as if it were the engine's."""
    for args in DATABASE_COMMANDS:
        assert_one_line_error(run(*args, "--db", pg_database),
                              f"{shown_url(pg_database)!r} holds no dex_engine tables", "nothing was created")
    with pytest.raises(StoreOpenError, match=re.escape(
        f"{shown_url(pg_database)!r} holds no dex_engine tables, so no flows (nothing was created there); pass "
        "the URL of the engine database the workers use",
    )):
        open_store(pg_database, existing=True)
    assert pg_tables(pg_database) == []


# demo ---------------------------------------------------------------------------------------

DEMO_STEPS = ["Validate-1", "Reserve-1", "AwaitPayment-1", "Pack-1", "Invoice-1", "Ship-1", "Deliver-1"]


def test_demo_runs_the_order_flow_and_history_shows_its_steps(tmp_path: Path) -> None:
    """`demo --db` runs the order flow to completion, prints the next commands, and its history is readable."""
    url = f"sqlite:///{tmp_path}/demo.db"
    result = run("demo", "--db", url)
    assert result.exit_code == 0, (result.output, result.exception)
    assert "flow order-1 completed" in result.stdout
    for command in ("describe", "history", "attributes"):
        assert f"dex-engine {command} order-1 --db {url}" in result.stdout
    assert f"dex-engine stream order-1 Progress --db {url}" in result.stdout

    history = ok("history", "order-1", "--db", url)
    seids = {cells[2] for cells in (line.split() for line in history.splitlines()) if len(cells) > 2}
    assert set(DEMO_STEPS) <= seids
    # The Step that fails once, the payment wait, the join and the timer wait, then completion.
    assert re.search(r"^\s*attempt_failed\s+Reserve\s+Reserve-1\s+1\s.*InventoryUnavailable", history, re.M)
    assert re.search(r"^\s*execute_completed\s+Reserve\s+Reserve-1\s+2\s", history, re.M)
    for seid in ("AwaitPayment-1", "Ship-1", "Deliver-1"):
        assert re.search(rf"^\s*wait_completed\s+\w+\s+{seid}\s", history, re.M), seid
    assert re.search(r"^\s*flow_closed\s+0\s+.*completed", history, re.M)
    events = [json.loads(line) for line in ok("stream", "order-1", "Progress", "--db", url).splitlines()]
    assert {"Reserve-1"} <= {e["step_execution_id"] for e in events}
    assert any(e["step_execution_id"] == "Reserve-1" and e["attempt"] == 2 for e in events)
    assert json.loads(ok("attributes", "order-1", "--name", "Status", "--db", url)) == "delivered"

    # A second run on the same database starts a new flow instead of colliding with order-1.
    again = run("demo", "--db", url)
    assert again.exit_code == 0, again.output
    assert "flow order-2 completed" in again.stdout


def test_demo_without_arguments_uses_a_fresh_temporary_database(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Plain `dex-engine demo` needs no setup and ignores $DEX_ENGINE_DB: it writes a new file under the temp dir."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    result = run("demo", env={"DEX_ENGINE_DB": f"sqlite:///{tmp_path}/mine.db"})
    assert result.exit_code == 0, (result.output, result.exception)
    url = re.search(r"--db (sqlite:///\S+)", result.stdout)
    assert url is not None, result.stdout
    created = list(tmp_path.glob("dex-demo-*/demo.db"))
    assert len(created) == 1 and url.group(1) == f"sqlite:///{created[0]}"
    assert "flow order-1 completed" in result.stdout
    assert not (tmp_path / "mine.db").exists()



def test_demo_on_a_postgresql_url_with_a_password_does_not_print_it(pg_database: str) -> None:
    """`demo --db` with a password in the URL (one the test server's trust authentication ignores)
    runs, and its database line and next commands show *** for it. Catches: the password printed
    to the terminal, which is recorded, shared and pasted."""
    url = pg_database.replace("://postgres@", "://postgres:hunter2@", 1)
    result = run("demo", "--db", url)
    assert result.exit_code == 0, (result.output, result.exception)
    assert "hunter2" not in result.output
    assert f"dex-engine describe order-1 --db {shlex.quote(shown_url(url))}" in result.stdout
    assert "the password is written as ***" in result.stdout

# Runs the CLI with the PostgreSQL driver's import refused, as on a machine without the extra.
_WITHOUT_DRIVER = (
    "import sys\n"
    "sys.modules[sys.argv[1]] = None\n"
    "from dex_engine.cli import main\n"
    "sys.argv = ['dex-engine', *sys.argv[2:]]\n"
    "main()\n"
)


@pytest.mark.parametrize("module", ["psycopg", "psycopg_pool"])
def test_a_postgresql_url_without_the_driver_installed_names_the_extra_to_install(module: str) -> None:
    """Catches: `dex-engine list --db postgresql://...` (and open_store) without the postgres extra
    ending in a ModuleNotFoundError traceback that says nothing of the extra."""
    url = "postgresql://app:secret@db.example/app"
    done = subprocess.run([sys.executable, "-c", _WITHOUT_DRIVER, module, "list", "--db", url],
                          capture_output=True, text=True, check=False, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr == (
        "Error: cannot open 'postgresql://app:***@db.example/app': PostgreSQL needs the "
        f"{module} package, which is not installed; install the engine's postgres extra "
        "(dex-engine is not on PyPI: from a clone of dex, pip install './engine[postgres]')\n"
    ), done.stderr
    library = subprocess.run(
        [sys.executable, "-c", f"import sys; sys.modules[{module!r}] = None\n"
         "from dex_engine import open_store, StoreOpenError\n"
         f"try: open_store({url!r})\nexcept StoreOpenError as e: print(e)"],
        capture_output=True, text=True, check=False, timeout=60)
    assert library.returncode == 0 and f"needs the {module} package" in library.stdout, library.stderr


async def test_stream_follow_says_its_flow_was_replaced_while_it_rechecked_a_crash(
    db_url: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--follow finds an event it printed changed (as a database crash leaves it) and reads the
    printed ones again to see where the change starts; the flow is stopped, deleted and started
    again under its ID between those two reads. It says the flow was replaced and stops. Catches: a
    follower that took the new flow's events for the old one's renumbered by a crash, telling the
    user on stderr that a database crash lost events it printed."""
    gate: dict[int, tuple[threading.Event, threading.Event]] = {
        after: (threading.Event(), threading.Event()) for after in (3, 1)}
    real_open = cli_module._open

    def open_paused(url: str) -> Store:
        """The follower's store; its read after 3 (the poll after it printed 1..3) and its re-read
        after 1 (of the printed events) each wait until the test resumes them."""
        store = real_open(url)
        read_events = store.read_events

        async def paused(flow_id: str, stream: str, after: int, limit: int) -> EventPage:
            if after in gate and not gate[after][1].is_set():
                gate[after][0].set()
                await asyncio.get_running_loop().run_in_executor(None, gate[after][1].wait)
            return await read_events(flow_id, stream, after, limit)

        monkeypatch.setattr(store, "read_events", paused)
        return store

    async def reached(after: int) -> None:
        await asyncio.wait_for(asyncio.to_thread(gate[after][0].wait), 30)

    monkeypatch.setattr(cli_module, "_open", open_paused)
    async with engine_for(db_url, Registry([BURST_FLOW])) as eng:
        await eng.client.start_flow("Burst", "r2")
        await eng.client.rpc("r2", "burst", ["old1", "old2", "old3"])
        following = asyncio.ensure_future(asyncio.to_thread(run, "stream", "r2", "Burst", "--follow", "--db", db_url))
        try:
            await reached(3)

            def crash_renumbers(db: Any) -> None:
                db.run("UPDATE stream_events SET value = ? WHERE flow_id = ? AND stream = ? AND seq = ?",
                       (json.dumps("renumbered3").encode(), "r2", "Burst", 3))

            await eng.store.raw(crash_renumbers, write=True)
            gate[3][1].set()
            await reached(1)
            await eng.client.stop_flow("r2", "replaced")
            assert await eng.client.delete_flow("r2")
            await eng.client.start_flow("Burst", "r2")
            await eng.client.rpc("r2", "burst", ["new1", "new2", "new3"])
        finally:
            for _, resume in gate.values():
                resume.set()
        result = await asyncio.wait_for(following, 30)
    assert [json.loads(line)["value"] for line in result.stdout.splitlines()] == ["old1", "old2", "old3"], \
        result.output
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("Error: flow 'r2' was deleted and started again while this follower read it ("), \
        result.output


def test_stream_follow_of_a_closed_flow_refuses_a_stream_without_events(db: str) -> None:
    """--follow waits for a stream's first event only while the flow runs: a closed flow writes none,
    so a typo is an error (exit 2), not an empty success."""
    result = run("stream", "done-1", "Nowhere", "--follow", "--db", db)
    assert_one_line_error(result, "flow 'done-1' has no events in stream 'Nowhere'", "'Log'")


async def test_stream_reads_page_after_page_and_names_a_single_trimmed_event(
    db_url: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stream longer than a page is printed whole, in order; a gap of one trimmed event is noted
    like a longer one. Catches: only the first page printed; a gap reported only when over one."""
    async with engine_for(db_url, Registry([BURST_FLOW])) as eng:
        await eng.client.start_flow("Burst", "p1")
        await eng.client.rpc("p1", "burst", [f"e{i:02d}" for i in range(1, 12)])  # 11: event 1 trimmed
    monkeypatch.setattr(cli_module, "STREAM_PAGE", 3)
    result = await asyncio.to_thread(run, "stream", "p1", "Burst", "--db", db_url)
    assert result.exit_code == 0, (result.output, result.exception)
    assert [json.loads(line)["sequence"] for line in result.stdout.splitlines()] == list(range(2, 12))
    assert result.stderr == "events 1..1 were trimmed (stream capacity)\n"


async def test_workers_marks_a_lapsed_lease_as_expired(db_copy: str) -> None:
    """A worker whose lease lapsed (a crashed host) shows as expired, its expiry in the past."""
    store = open_store(db_copy)
    try:
        await store.register_worker("w-lapsed", "gone-host", 4242, ttl_ms=-60_000)
    finally:
        await store.close()
    out = await asyncio.to_thread(ok, "workers", "--db", db_copy)
    row = next(line for line in out.splitlines() if "w-lapsed" in line)
    assert re.search(rf"{TIME} \([\d.]+ s ago\)\s+expired \(not yet removed\)", row), row


@pytest.mark.parametrize(("remembered", "crashed", "caveat"), [(2, (3, 4), True), (100, (1, 2, 3, 4), False)])
async def test_stream_follow_says_when_it_may_have_missed_older_changes(
    db_url: str, monkeypatch: pytest.MonkeyPatch, remembered: int, crashed: tuple[int, ...], caveat: bool,
) -> None:
    """A follower remembers only its last FOLLOW_REMEMBERED_EVENTS printed events: when the oldest one
    it remembers changed, older ones may have too, and its note says so; when it still remembers
    every event it printed, the note has no such caveat. Catches: an unbounded memory of printed
    events; the caveat on every change at the first remembered event."""
    follower = pause_follower(monkeypatch)
    monkeypatch.setattr(cli_module, "FOLLOW_REMEMBERED_EVENTS", remembered)
    async with engine_for(db_url, Registry([BURST_FLOW])) as eng:
        await eng.client.start_flow("Burst", "m1")
        await eng.client.rpc("m1", "burst", ["e01", "e02", "e03", "e04"])
        following = asyncio.ensure_future(asyncio.to_thread(run, "stream", "m1", "Burst", "--follow", "--db", db_url))
        try:
            await asyncio.wait_for(asyncio.to_thread(follower.paused.wait), 30)

            def crash_renumbers(db: Any) -> None:
                for seq in crashed:
                    db.run("UPDATE stream_events SET value = ? WHERE flow_id = ? AND stream = ? AND seq = ?",
                           (json.dumps(f"n{seq:02d}").encode(), "m1", "Burst", seq))

            await eng.store.raw(crash_renumbers, write=True)
            await eng.client.stop_flow("m1")
        finally:
            follower.resume.set()
        result = await asyncio.wait_for(following, 30)
    assert result.exit_code == 0, result.output
    values = [json.loads(line)["value"] for line in result.stdout.splitlines()]
    assert values == ["e01", "e02", "e03", "e04", *(f"n{seq:02d}" for seq in crashed)], result.output
    assert f"events {crashed[0]}..4 this follower printed are gone" in result.stderr, result.stderr
    assert (f"it remembers only the last {remembered} events it printed" in result.stderr) == caveat, result.stderr


async def test_stream_follow_says_once_that_it_waits_for_a_streams_first_event(
    db_url: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The "no events yet; waiting" note is printed once, not at every poll, and the follow ends
    quietly when the flow closes. Catches: the note repeated at each poll (and then an error)."""
    follower = pause_follower(monkeypatch, at_poll=3)
    async with engine_for(db_url, Registry([BURST_FLOW])) as eng:
        await eng.client.start_flow("Burst", "q1")
        following = asyncio.ensure_future(asyncio.to_thread(run, "stream", "q1", "Burst", "--follow", "--db", db_url))
        try:
            await asyncio.wait_for(asyncio.to_thread(follower.paused.wait), 30)
            await eng.client.stop_flow("q1")
        finally:
            follower.resume.set()
        result = await asyncio.wait_for(following, 30)
    assert (result.exit_code, result.stdout) == (0, ""), result.output
    assert result.stderr.count("has no events yet; waiting") == 1, result.stderr
