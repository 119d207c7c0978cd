"""The AgentEvents contract (seed 002 "Events", seed 003 AgentTurnContext.events), on a real SQLite file.

- A runner's writer keeps what it writes during run_model_step or execute_deferred_tool_call and
  drops what it writes after the call returned, even while the attempt has not committed yet.
- Many threads write through one writer while the call returns and the Step closes it: each write
  made before the close is stored once, in its thread's order; none made after it is; none raises.
- interrupt_raised and interrupt_resolved carry exactly the seed's payload fields and values.
- tool_call_deferred, tool_call_started, tool_call_finished and usage_recorded carry exactly the
  seed's payload fields, each with its own call's values and the session's running usage total.
- Events of a retried attempt (SIGKILL at a FileGate, Worker child processes) carry attempt 2 and
  their Step execution's ID; the killed attempt's stored live events keep attempt 1.

The Worker children of the kill test run this module (`python -m agents.tests.test_event_contract`),
so they play the same EventProbeRunner as the test's Flow.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import msgspec
import pytest
from agents.tests.builtin_agent import InProcessEngine
from agents.tests.conftest import REPO_ROOT
from agents.tests.scripted_agent import CALL_USAGE, ScriptedRunner, build_flow, script_of, state_dir_from_env
from agents.tests.session_driver import all_agent_events, script, turns_ended

from dex_agents import (
    AgentEvent,
    AgentEventWriter,
    AgentInterrupt,
    AgentSessionClient,
    AgentSessionFlow,
    AgentSessionOptions,
    AgentTurnContext,
    AgentTurnOutcome,
    BuiltInTool,
    DeferredToolCall,
    DeferredToolExecution,
    MessageRole,
    ToolCallStepOptions,
    ToolExecutionResult,
    ToolInputRequested,
    ToolTaskStarted,
)
from dex_agents._timefmt import format_time, parse_time
from dex_agents.testing import (
    EXECUTE_COMPLETED_EVENT,
    AgentTestStack,
    FileGate,
    StepHistoryEntry,
    run_agent_worker,
    to_step_history,
    wait_for_agent_snapshot,
    wait_until,
)
from dex_engine import StreamEvent

FLOW_TYPE = "EventContract"
WORKER_MODULE = "agents.tests.test_event_contract"
SESSION = "s"
# An adapter-style event type (seed 002: "Adapter-specific types use an adapter prefix").
PROBE = "dex_test.probe"
# Bounds on waits that end at once when the code under test is right; they only keep a broken
# writer from hanging the test (and the stray write's wait is what lets a never-closed writer show).
THREAD_WAIT_SECONDS = 30.0
CLOSE_WAIT_SECONDS = 1.0
# Each race writer writes this many probes before the call may return, so the Step's close lands
# while every writer is mid-stream; the limit stops a writer that never sees the writer closed.
RACE_WARMUP_WRITES = 20
RACE_WRITE_LIMIT = 50_000
# Trials of the writer-level race; see test_nothing_is_emitted_once_close_returned.
RACE_TRIALS = 100


def current_step(turn: AgentTurnContext) -> dict[str, Any]:
    """The step of the turn's script this model call plays (as ScriptedRunner picks it)."""
    user = next(m for m in reversed(turn.messages) if m.role is MessageRole.USER and m.turn_id == turn.turn_id)
    steps = script_of(user.text or "")
    index: int = json.loads(turn.framework_run_state)["step"] if turn.framework_run_state else 0
    return steps[min(index, len(steps) - 1)]


class HeldPayload(Mapping[str, Any]):
    """A payload whose encoding waits, in the writing thread, until `released()`.

    The writer checks whether it is closed before it encodes a payload, so a write with this payload
    passes that check, and reaches the point where it would emit only after close(): the race of a
    write against close, made to happen every time instead of by chance.
    """

    def __init__(self, fields: dict[str, Any], entered: threading.Event, released: Callable[[], bool]) -> None:
        self._fields = fields
        self._entered = entered
        self._released = released

    def __getitem__(self, key: str) -> Any:
        return self._fields[key]

    def __len__(self) -> int:
        return len(self._fields)

    def __iter__(self) -> Iterator[str]:
        self._entered.set()
        deadline = time.monotonic() + THREAD_WAIT_SECONDS
        while not self._released() and time.monotonic() < deadline:
            time.sleep(0.001)
        return iter(self._fields)


class WriterRace:
    """Threads writing through one writer while its call returns and the Step closes it.

    Each writer thread writes numbered probes until it sees the writer closed before a write, and
    notes for every write whether the writer was closed before it began and after it returned.
    Each straddler thread makes one write with a HeldPayload released by the close.
    """

    def __init__(self, writer: AgentEventWriter, writers: int, straddlers: int) -> None:
        self.writer = writer
        self.writes: dict[int, list[tuple[int, bool, bool]]] = {k: [] for k in range(writers)}
        self.errors: list[str] = []
        self._ready = [threading.Event() for _ in range(writers + straddlers)]
        self._threads = [threading.Thread(target=self._write_until_closed, args=(k,), daemon=True)
                         for k in range(writers)]
        self._threads += [threading.Thread(target=self._straddle, args=(k, self._ready[writers + k]), daemon=True)
                          for k in range(straddlers)]

    def start(self) -> None:
        """Start every thread; return once each writer wrote its warm-up and each straddler is held."""
        for thread in self._threads:
            thread.start()
        if not all(e.wait(THREAD_WAIT_SECONDS) for e in self._ready):
            self.errors.append("a thread never got going")

    def finish(self) -> None:
        """Join every thread (blocking: the attempt must not commit before their writes are done)."""
        for thread in self._threads:
            thread.join(THREAD_WAIT_SECONDS)
            if thread.is_alive():
                self.errors.append(f"{thread.name} still runs")

    def _write_until_closed(self, k: int) -> None:
        writer = self.writer
        noted = self.writes[k]
        for n in range(RACE_WRITE_LIMIT):
            closed_before = writer.closed
            try:
                writer.write_event(PROBE, {"thread": k, "n": n})
            except Exception as exc:
                self.errors.append(f"writer {k} write {n} raised {exc!r}")
                return
            noted.append((n, closed_before, writer.closed))
            if n + 1 == RACE_WARMUP_WRITES:
                self._ready[k].set()
            if closed_before:
                return  # one write after the close, which must be dropped
        self.errors.append(f"writer {k} never saw the writer closed")

    def _straddle(self, k: int, entered: threading.Event) -> None:
        payload = HeldPayload({"straddler": k}, entered, lambda: self.writer.closed)
        try:
            self.writer.write_event(PROBE, payload)
        except Exception as exc:
            self.errors.append(f"straddler {k} raised {exc!r}")


def check_race(race: WriterRace, stored: list[dict[str, Any]]) -> None:
    """What a WriterRace's writer stored (`stored`, in order) against what each thread saw."""
    assert race.errors == []
    # A straddler's write passed the closed check before the close and was still encoding after it.
    assert [p for p in stored if "straddler" in p] == []
    for k, writes in race.writes.items():
        numbers = [p["n"] for p in stored if p.get("thread") == k]
        assert numbers == list(range(len(numbers))), f"writer {k}: each write once, in order"
        before_close = {n for n, _, closed_after in writes if not closed_after}
        after_close = {n for n, closed_before, _ in writes if closed_before}
        assert len(before_close) >= RACE_WARMUP_WRITES and len(after_close) == 1
        assert before_close <= set(numbers), f"writer {k}: a write made before the close is missing"
        assert not after_close & set(numbers), f"writer {k}: a write made after the close was stored"


class StrayWrite:
    """A thread that keeps a tool call's writer and writes through it once the call returned."""

    def __init__(self, writer: AgentEventWriter) -> None:
        self.writer = writer
        self.returned = threading.Event()
        self.written = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.returned.wait(THREAD_WAIT_SECONDS)
        # A right Step closes the writer as the call returns, so this wait ends at once; the bound
        # ends it for a writer nobody closes, whose late write must be dropped all the same.
        deadline = time.monotonic() + CLOSE_WAIT_SECONDS
        while not self.writer.closed and time.monotonic() < deadline:
            time.sleep(0.001)
        self.writer.write_event(PROBE, {"at": "after the tool call"})
        self.written.set()


class EventProbeRunner(ScriptedRunner):
    """The scripted runner (agents/tests/scripted_agent.py), writing through its writers at chosen moments.

    Model step `"keep_writer": true` writes a probe during the call and keeps the turn's writer;
    tool_call_step_options, which RunModel's commit calls after run_model_step returned, writes
    through every kept writer again. Model step `"race": {"writers": n, "straddlers": m}` runs a
    WriterRace on the turn's writer; tool_call_step_options joins its threads, so all their writes
    are made before the attempt commits. Tool args `"delta": text` write a text delta first;
    `"stray": true` writes probes during the call (the last just before it returns) and leaves a
    StrayWrite behind.
    """

    def __init__(self, state_dir: Path | None = None) -> None:
        super().__init__(state_dir)
        self.kept: list[AgentEventWriter] = []
        self.races: list[WriterRace] = []
        self.strays: list[StrayWrite] = []

    async def run_model_step(self, turn: AgentTurnContext) -> AgentTurnOutcome:
        step = current_step(turn)
        if step.get("keep_writer"):
            turn.events.write_event(PROBE, {"at": "during the model call"})
            self.kept.append(turn.events)
        if "race" in step:
            race = WriterRace(turn.events, step["race"]["writers"], step["race"]["straddlers"])
            self.races.append(race)
            await asyncio.to_thread(race.start)
        return await super().run_model_step(turn)

    def tool_call_step_options(self, call: DeferredToolCall) -> ToolCallStepOptions | None:
        for writer in self.kept:
            writer.write_event(PROBE, {"at": "after the model call"})
        for race in self.races:
            race.finish()
        return None

    async def execute_deferred_tool_call(
        self, call: DeferredToolExecution
    ) -> ToolExecutionResult | ToolInputRequested | ToolTaskStarted:
        args = json.loads(call.tool_call.arguments)
        if "delta" in args:
            call.events.write_text_delta(args["delta"])
        if not args.get("stray"):
            return await super().execute_deferred_tool_call(call)
        call.events.write_event(PROBE, {"at": "during the tool call"})
        stray = StrayWrite(call.events)
        self.strays.append(stray)
        result = await super().execute_deferred_tool_call(call)
        # Not flushed yet when the call returns: the attempt's commit must first append it.
        call.events.write_event(PROBE, {"at": "as the tool call returns"})
        stray.returned.set()
        return result


def build_probe_flow(state_dir: Path | None) -> AgentSessionFlow:
    return AgentSessionFlow(EventProbeRunner(state_dir), FLOW_TYPE, AgentSessionOptions())


async def all_events(sessions: AgentSessionClient) -> list[StreamEvent]:
    return await all_agent_events(sessions, SESSION)


def payloads(events: list[StreamEvent], event_type: str) -> list[dict[str, Any]]:
    return [json.loads(e.value.payload) for e in events if e.value.type == event_type]


async def pending(sessions: AgentSessionClient, *interrupt_ids: str) -> list[AgentInterrupt]:
    want = set(interrupt_ids)
    found: list[AgentInterrupt] = await wait_for_agent_snapshot(
        sessions, SESSION, lambda s: s.pending_interrupts if {i.interrupt_id for i in s.pending_interrupts} == want
        else None, description=f"pending interrupts {sorted(want)}")
    return found


async def history(engine: InProcessEngine) -> list[StepHistoryEntry]:
    return to_step_history(await engine.client.get_flow_history(SESSION))


def executions(entries: list[StepHistoryEntry], step_type: str) -> list[str]:
    """The Step execution IDs of `step_type`, in the order they started."""
    return list(dict.fromkeys(e.step_execution_id for e in entries if e.step_type == step_type))


@contextlib.contextmanager
def sqlite_write_lock(database: Path) -> Iterator[None]:
    """Hold the SQLite file's write lock, as another writer process would: every commit of the
    engine, and every append of best-effort events, waits until the block ends."""
    conn = sqlite3.connect(database, isolation_level=None, timeout=THREAD_WAIT_SECONDS)
    try:
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        finally:
            conn.execute("ROLLBACK")
    finally:
        conn.close()


# Writes after the call returns -----------------------------------------------------------------


async def test_writes_after_the_call_returned_are_dropped(tmp_path: Path) -> None:
    """What a runner writes through a turn's or a tool call's writer during the call is stored; what
    it writes through the same writer after the call returned is dropped, though the attempt that
    owns the writer has not committed yet (seed 003: "writes after the call returns are dropped")."""
    runner = EventProbeRunner(tmp_path)
    engine = InProcessEngine(tmp_path, [AgentSessionFlow(runner, FLOW_TYPE, AgentSessionOptions())])
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session(SESSION, script(
            {"keep_writer": True,
             "tools": [{"id": "c1", "name": "read_orders", "args": {"stray": True, "gate": "tool"}}]},
            {"answer": "done"},
        ))
        gate = FileGate(tmp_path, "tool")
        await gate.wait_until_reached()
        [stray] = runner.strays
        # With the write lock held, the tool Step's attempt cannot append its last probe, so it
        # cannot commit: the stray thread writes after the call returned but while the attempt
        # still runs, where only the writer's own close can drop the write.
        with sqlite_write_lock(tmp_path / "engine.db"):
            gate.release()
            assert await asyncio.to_thread(stray.written.wait, THREAD_WAIT_SECONDS)
        await turns_ended(sessions, SESSION, 1)
        events = await all_events(sessions)
        entries = await history(engine)

    [run_model, _] = executions(entries, "RunModel")
    [call_tool] = executions(entries, "CallTool")
    probes = [(json.loads(e.value.payload)["at"], e.value.step_execution_id, e.value.attempt)
              for e in events if e.value.type == PROBE]
    assert probes == [
        ("during the model call", run_model, 1),
        ("during the tool call", call_tool, 1),
        ("as the tool call returns", call_tool, 1),
    ]


# Many threads, one writer ------------------------------------------------------------------------


async def test_writes_from_many_threads_racing_the_close(tmp_path: Path) -> None:
    """Threads write through the turn's writer while run_model_step returns: every write made before
    the close is stored exactly once, in its thread's order, none made after it is, and no write
    raises (seed 002: "The event writer is safe to call from any thread")."""
    runner = EventProbeRunner(tmp_path)
    engine = InProcessEngine(tmp_path, [AgentSessionFlow(runner, FLOW_TYPE, AgentSessionOptions())])
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session(SESSION, script(
            {"race": {"writers": 8, "straddlers": 4}, "tools": [{"id": "c1", "name": "read_orders", "args": {}}]},
            {"answer": "done"},
        ))
        await turns_ended(sessions, SESSION, 1)
        events = await all_events(sessions)
        entries = await history(engine)

    [race] = runner.races
    [run_model, _] = executions(entries, "RunModel")
    probes = [e.value for e in events if e.value.type == PROBE]
    assert {(p.turn_id, p.step_execution_id, p.attempt) for p in probes} == {("turn-1", run_model, 1)}
    check_race(race, [json.loads(p.payload) for p in probes])


def race_a_bare_writer() -> tuple[WriterRace, list[tuple[dict[str, Any], bool]]]:
    """A WriterRace on a writer whose sink notes each payload and whether the writer was closed then."""
    emitted: list[tuple[dict[str, Any], bool]] = []

    def emit(event: AgentEvent) -> None:
        emitted.append((json.loads(event.payload), writer.closed))

    writer = AgentEventWriter(emit, "turn-1", "RunModel-1", 1)
    race = WriterRace(writer, writers=8, straddlers=2)
    race.start()
    writer.close()
    race.finish()
    return race, emitted


def test_nothing_is_emitted_once_close_returned() -> None:
    """close() waits for a write that is emitting, and every later write is dropped, so the writer
    never emits once it is closed.

    The writer's sink here is a plain function because only the writer's own emit call shows when an
    emit happens relative to close(): through a session, an emit that slipped in just after close()
    is stored all the same. A writer whose re-check under the lock is gone fails every trial (its
    straddlers); one that re-checks without holding the lock loses only a narrow race, which the
    short switch interval makes it lose in about half of the trials (measured on 2 cores), so a run
    of RACE_TRIALS trials passes such a writer with a chance far below one in a billion.
    """
    switch_interval = sys.getswitchinterval()
    # Threads hand over the GIL every 10 us instead of every 5 ms: they interleave inside write_event.
    sys.setswitchinterval(1e-5)
    try:
        for trial in range(RACE_TRIALS):
            race, emitted = race_a_bare_writer()
            assert [p for p, closed in emitted if closed] == [], f"trial {trial}: emitted after the close"
            check_race(race, [p for p, _ in emitted])
    finally:
        sys.setswitchinterval(switch_interval)



class RaisingPayload(Mapping[str, Any]):
    """A payload that raises an error no encoder failure raises as soon as it is read."""

    def __getitem__(self, key: str) -> Any:
        raise RuntimeError("payload read")

    def __len__(self) -> int:
        raise RuntimeError("payload read")

    def __iter__(self) -> Iterator[str]:
        raise RuntimeError("payload read")


def test_a_write_after_close_is_dropped_unread(caplog: pytest.LogCaptureFixture) -> None:
    """A stray write to a closed writer is dropped before its payload is read: it neither raises
    (whatever its payload does) nor logs a dropped-event warning for output nobody wants.
    Catches: the closed check before encoding gone (only the one under the lock left), and a typed
    event's text check warning about a late write."""
    emitted: list[AgentEvent] = []
    writer = AgentEventWriter(emitted.append, "turn-1", "RunModel-1", 1, flow_id="s")
    writer.close()
    with caplog.at_level("WARNING", logger="dex_agents.session"):
        writer.write_event("probe", RaisingPayload())
        writer.write_event("probe", {"x": float("nan")})
        writer.write_event("", {})
        writer.write_text_delta(None)  # type: ignore[arg-type]  # a typed event's check logs nothing either
    assert emitted == []
    assert caplog.records == []


def test_a_payload_nested_too_deeply_is_dropped_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """A payload nested deeper than the JSON encoder can go is dropped with a warning naming it, as
    any payload that cannot be written as JSON: the write does not raise RecursionError into the
    model call or tool that wrote it. Catches: RecursionError not caught by write_event."""
    deep: list[Any] = []
    for _ in range(sys.getrecursionlimit() * 2):
        deep = [deep]
    emitted: list[AgentEvent] = []
    writer = AgentEventWriter(emitted.append, "turn-1", "RunModel-1", 1, flow_id="s")
    with caplog.at_level("WARNING", logger="dex_agents.session"):
        writer.write_event("probe", {"deep": deep})
        writer.write_event("probe", {"ok": 1})
    assert [e.payload for e in emitted] == ['{"ok":1}']
    [warning] = [r.getMessage() for r in caplog.records]
    assert warning.startswith("flow s: dropped a 'probe' event of RunModel-1 attempt 1: it cannot be written as JSON: ")


def test_a_typed_event_whose_text_is_not_text_is_dropped_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """text_delta and reasoning_delta carry {"text"} and the tool call events their ID and name as
    text (seed 003's payloads): a client's delta of None or a number is dropped with a warning naming
    the field and value, and the write does not raise. Catches: {"text":null} or {"text":5} written
    to the stream, for every client joining the deltas' texts to meet."""
    emitted: list[AgentEvent] = []
    writer = AgentEventWriter(emitted.append, "turn-1", "RunModel-1", 1, flow_id="s")
    with caplog.at_level("WARNING", logger="dex_agents.session"):
        writer.write_text_delta(None)  # type: ignore[arg-type]
        writer.write_reasoning_delta(5)  # type: ignore[arg-type]
        writer.write_tool_call_started(None, "lookup")  # type: ignore[arg-type]
        writer.write_tool_call_finished("c1", b"lookup", "succeeded")  # type: ignore[arg-type]
        writer.write_text_delta("kept")
    assert [(e.type, e.payload) for e in emitted] == [("text_delta", '{"text":"kept"}')]
    assert [r.getMessage() for r in caplog.records] == [
        "flow s: dropped a text_delta event of RunModel-1 attempt 1: text must be a str, got NoneType: None",
        "flow s: dropped a reasoning_delta event of RunModel-1 attempt 1: text must be a str, got int: 5",
        "flow s: dropped a tool_call_started event of RunModel-1 attempt 1: tool_call_id must be a str, got "
        "NoneType: None",
        "flow s: dropped a tool_call_finished event of RunModel-1 attempt 1: tool_name must be a str, got bytes: "
        "b'lookup'",
    ]


# interrupt_raised and interrupt_resolved ---------------------------------------------------------


@pytest.mark.parametrize(("resolution", "approved", "rejection_message"), [
    ("approve", True, None), ("reject", False, "too risky"), ("deadline", False, "approval deadline passed"),
])
async def test_interrupt_resolved_payload_of_a_tool_approval(
    tmp_path: Path, resolution: str, approved: bool, rejection_message: str | None
) -> None:
    """interrupt_resolved of an approval, whole: resolve_interrupt's approval drops the rejection
    message, a rejection keeps it, an expired deadline says approval deadline passed."""
    deadline = timedelta(seconds=1) if resolution == "deadline" else None
    engine = InProcessEngine(tmp_path, [build_flow(tmp_path, interrupt_deadline=deadline)])
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session(SESSION, script(
            {"tools": [{"id": "w1", "name": "write_refund", "args": {}}]}, {"answer": "{results}"},
        ))
        await pending(sessions, "w1")
        if resolution != "deadline":
            # An approval carries a rejection message too, which the session must not pass on.
            assert await sessions.resolve_interrupt(SESSION, "w1", resolution == "approve", "too risky")
        await turns_ended(sessions, SESSION, 1)
        events = await all_events(sessions)
        entries = await history(engine)

    assert payloads(events, "interrupt_resolved") == [{
        "interrupt_id": "w1", "approved": approved, "rejection_message": rejection_message, "kind": "tool_approval",
        "answered": False, "cancellation_reason": None,
    }]
    [resolved] = [e.value for e in events if e.value.type == "interrupt_resolved"]
    assert (resolved.turn_id, resolved.attempt) == ("turn-1", 1)
    assert resolved.step_execution_id in executions(entries, "AwaitToolApproval")


async def test_interrupt_raised_payloads_of_an_approval_and_an_ask_user_question(tmp_path: Path) -> None:
    """interrupt_raised, whole, for a tool approval and for the built-in ask_user, both raised by
    RunModel with the session's interrupt deadline; then the question's interrupt_resolved."""
    deadline = timedelta(hours=1)
    flow = build_flow(tmp_path, interrupt_deadline=deadline, built_in_tools=frozenset({BuiltInTool.ASK_USER}))
    engine = InProcessEngine(tmp_path, [flow])
    async with engine.running():
        sessions = engine.sessions()
        ask = {"question": "Which colour?", "choices": ["red", "blue"], "allows_free_text": False}
        await sessions.start_session(SESSION, script(
            {"tools": [{"id": "w1", "name": "write_refund", "args": {"amount": 5}},
                       {"id": "q1", "name": "ask_user", "args": ask}]},
            {"answer": "{results}"},
        ))
        interrupts = {i.interrupt_id: i for i in await pending(sessions, "w1", "q1")}
        raised_events = [e.value for e in await all_events(sessions) if e.value.type == "interrupt_raised"]
        assert await sessions.answer_question(SESSION, "q1", "blue")
        assert await sessions.resolve_interrupt(SESSION, "w1", approved=True)
        await turns_ended(sessions, SESSION, 1)
        events = await all_events(sessions)
        entries = await history(engine)

    # The deadline is the session's interrupt deadline after the interrupt was created.
    deadlines = {i: format_time(parse_time(interrupts[i].created_at) + deadline) for i in ("w1", "q1")}
    assert {i: interrupts[i].deadline for i in deadlines} == deadlines
    assert [json.loads(e.payload) for e in raised_events] == [
        {"interrupt_id": "w1", "tool_call_id": "w1", "tool_name": "write_refund", "deadline": deadlines["w1"],
         "kind": "tool_approval", "question": None, "choices": [], "allows_free_text": True},
        {"interrupt_id": "q1", "tool_call_id": "q1", "tool_name": "ask_user", "deadline": deadlines["q1"],
         "kind": "question", "question": "Which colour?", "choices": ["red", "blue"], "allows_free_text": False},
    ]
    [run_model, _] = executions(entries, "RunModel")
    assert {(e.turn_id, e.step_execution_id, e.attempt) for e in raised_events} == {("turn-1", run_model, 1)}
    assert payloads(events, "interrupt_raised") == [json.loads(e.payload) for e in raised_events]
    resolved = {p["interrupt_id"]: p for p in payloads(events, "interrupt_resolved")}
    assert resolved["q1"] == {"interrupt_id": "q1", "approved": True, "rejection_message": None, "kind": "question",
                              "answered": True, "cancellation_reason": None}


# Tool call and usage payloads ----------------------------------------------------------------------


async def test_tool_call_and_usage_payloads_of_a_turn(tmp_path: Path) -> None:
    """tool_call_deferred, tool_call_started, tool_call_finished and usage_recorded, whole, for a
    turn that asks for a read, an idempotent write and two approval-gated writes (one approved, one
    rejected) over two model calls: each payload names its own call, effect, approval and status,
    and usage_recorded's session is the running total, not the call's own usage."""
    engine = InProcessEngine(tmp_path, [build_flow(tmp_path)])
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session(SESSION, script(
            {"tools": [{"id": "c1", "name": "read_orders", "args": {}},
                       {"id": "i1", "name": "idem_sync", "args": {}},
                       {"id": "w1", "name": "write_refund", "args": {}},
                       {"id": "w2", "name": "write_email", "args": {}}]},
            {"answer": "{results}"},
        ))
        await pending(sessions, "w1", "w2")
        assert await sessions.resolve_interrupt(SESSION, "w1", approved=True)
        assert await sessions.resolve_interrupt(SESSION, "w2", approved=False, rejection_message="no")
        await turns_ended(sessions, SESSION, 1)
        events = await all_events(sessions)

    names = {"c1": "read_orders", "i1": "idem_sync", "w1": "write_refund", "w2": "write_email"}
    assert payloads(events, "tool_call_deferred") == [
        {"tool_call_id": "c1", "tool_name": "read_orders", "effect": "read", "requires_approval": False},
        {"tool_call_id": "i1", "tool_name": "idem_sync", "effect": "idempotent_write", "requires_approval": False},
        {"tool_call_id": "w1", "tool_name": "write_refund", "effect": "non_idempotent_write",
         "requires_approval": True},
        {"tool_call_id": "w2", "tool_name": "write_email", "effect": "non_idempotent_write",
         "requires_approval": True},
    ]
    # The rejected call never starts; the others start once each, in any order.
    started = payloads(events, "tool_call_started")
    assert sorted(started, key=lambda p: p["tool_call_id"]) == [
        {"tool_call_id": i, "tool_name": names[i]} for i in ("c1", "i1", "w1")
    ]
    finished = {p["tool_call_id"]: p for p in payloads(events, "tool_call_finished")}
    assert finished == {
        i: {"tool_call_id": i, "tool_name": names[i], "status": "rejected" if i == "w2" else "succeeded"}
        for i in names
    }
    call = msgspec.to_builtins(CALL_USAGE)
    assert payloads(events, "usage_recorded") == [
        {"recorded": call, "session": call},
        {"recorded": call, "session": msgspec.to_builtins(CALL_USAGE.plus(CALL_USAGE))},
    ]


# A small capacity that one turn's events overrun (each event is roughly 150-250 bytes).
SMALL_EVENTS_CAPACITY = 600


async def test_the_sessions_event_stream_keeps_its_configured_capacity(tmp_path: Path) -> None:
    """AgentSessionOptions.agent_events_capacity_bytes is the AgentEvents Stream's capacity: a turn
    whose events overrun it keeps only the newest (the turn's last event among them), within the
    capacity, and a read from the start says the oldest were trimmed."""
    runner = ScriptedRunner(tmp_path)
    flow = AgentSessionFlow(runner, FLOW_TYPE, AgentSessionOptions(agent_events_capacity_bytes=SMALL_EVENTS_CAPACITY))
    engine = InProcessEngine(tmp_path, [flow])
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session(SESSION, script(
            {"tools": [{"id": "c1", "name": "read_orders", "args": {}}]}, {"answer": "{results}"}))
        await turns_ended(sessions, SESSION, 1)
        read = await sessions.read_agent_events(SESSION)
    assert read.trimmed
    kept = [e.value.type for e in read.events]
    assert kept and kept[-1] == "turn_completed" and "turn_started" not in kept
    assert sum(len(msgspec.json.encode(e.value)) for e in read.events) <= SMALL_EVENTS_CAPACITY


# The attempt of a retried Step -------------------------------------------------------------------


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[AgentTestStack]:
    """A private engine in tmp_path whose Worker children run EventProbeRunner (this module)."""
    async with AgentTestStack(tmp_path, [build_probe_flow(tmp_path)], WORKER_MODULE, worker_cwd=REPO_ROOT) as s:
        yield s


async def test_events_of_a_retried_attempt_carry_its_attempt(stack: AgentTestStack) -> None:
    """A CallTool and then a RunModel attempt are SIGKILLed at a FileGate and retried: what the
    retried attempts write, the Steps' own events and the runner's, carries attempt 2 and the Step
    execution's ID; the killed attempts' events that were stored keep attempt 1."""
    sessions = stack.sessions(build_probe_flow(stack.state_dir))
    tool_gate, model_gate = FileGate(stack.state_dir, "tool"), FileGate(stack.state_dir, "model")
    worker = await stack.start_worker()
    await sessions.start_session(SESSION, script(
        {"tools": [{"id": "c1", "name": "read_orders", "args": {"delta": "reading", "gate": "tool"}}]},
        # Heartbeat first: the killed model call counts as started, so its rerun is attempt 2.
        {"answer": "orders: {results}", "gate": "model", "heartbeat": True},
    ))

    async def stored(text: str) -> bool:
        return any(e.value.type == "text_delta" and json.loads(e.value.payload) == {"text": text}
                   for e in await all_events(sessions))

    assert await tool_gate.wait_until_reached() == worker.pid
    await wait_until("the killed tool attempt's text delta", lambda: stored("reading"))
    worker.kill()
    worker = await stack.start_worker()
    tool_gate.release()
    assert await model_gate.wait_until_reached() == worker.pid
    await wait_until("the killed model attempt's text delta", lambda: stored("step 1"))
    worker.kill()
    await stack.start_worker()
    model_gate.release()
    snapshot = await turns_ended(sessions, SESSION, 1)
    assert snapshot.messages[-1].text == "orders: c1=read_orders done"
    events = await all_events(sessions)
    entries = await stack.read_step_history(SESSION)

    [first_model, retried_model] = executions(entries, "RunModel")
    [call_tool] = executions(entries, "CallTool")
    for execution in (call_tool, retried_model):
        assert [(e.event_type, e.final_attempt) for e in entries if e.step_execution_id == execution
                and e.event_type in {EXECUTE_COMPLETED_EVENT, "attempt_failed"}] == [
            ("attempt_failed", 1), (EXECUTE_COMPLETED_EVENT, 2),
        ]
    # The AgentEvent's own fields match the engine's record of the attempt that appended it.
    assert [(e.value.step_execution_id, e.value.attempt) for e in events] == [
        (e.step_execution_id, e.attempt) for e in events
    ]
    assert {e.value.turn_id for e in events} == {"turn-1"}

    def written_by(execution: str) -> list[tuple[str, str | None, int]]:
        return [(e.value.type, json.loads(e.value.payload).get("text"), e.value.attempt)
                for e in events if e.value.step_execution_id == execution]

    assert written_by(first_model) == [
        ("text_delta", "step 0", 1), ("usage_recorded", None, 1), ("tool_call_deferred", None, 1),
    ]
    assert written_by(call_tool) == [
        ("tool_call_started", None, 1), ("text_delta", "reading", 1),
        ("tool_call_started", None, 2), ("text_delta", "reading", 2), ("tool_call_finished", None, 2),
    ]
    assert written_by(retried_model) == [
        ("text_delta", "step 1", 1),
        ("text_delta", "step 1", 2), ("usage_recorded", None, 2), ("turn_completed", None, 2),
    ]


if __name__ == "__main__":
    run_agent_worker([build_probe_flow(state_dir_from_env())])
