"""Benchmark: one agent turn (user message, tool-asking model call, READ tool, answering model call).

Runs the same turn, with instant scripted model and tool calls, on three systems (and two
reference rows) in one run on one disk, and prints them side by side with the raw commit floor:

- dex: an AgentSessionFlow (in-process AsyncWorker and AsyncClient on one SQLite file), with a
  scripted runner (dex) and through the built-in loop (dex-builtin);
- dex-engine, not an agent: the turn's Steps, waits, commits and client calls on the bare engine,
  with none of the agent layer's work (engine_shape_flow), to tell the engine's share of dex's turn
  from the agent layer's;
- sqlite, not a durable-execution system: the turn's four commits and rows written straight with
  sqlite3 (DirectTurns), what any Python system's turn costs at least;
- LangGraph: a StateGraph compiled with SqliteSaver, invoked with durability="sync";
- DBOS: a workflow of three steps on a SQLite system database.

Each system runs N turns one after another (sequential, a new session every 25 turns), then the
same number of turns spread over 16 sessions at once, each phase on a new file after untimed warm-up
turns: at least 3, and on until one leaves the file's WAL as large as it was (engine_steps.WalWarmth). The
sequential turns run in --rounds rounds (default 4), each running every system's share in turn
after a floor slice, so that this VM's changing speed falls on every system and the floor alike
(measure_systems). Reported:
per-turn latency (median, p95), turns/s with 16 sessions, the median's ratio to the floor, the
data-changing commits and fsyncs each turn took, and the process CPU time per turn. Commits are
counted in a separate, untimed pass of --count-turns turns per phase on a new file, through the
SQLite connections' trace callback: Python's sqlite3 hands that callback every statement with its
parameters expanded (blobs as hex), which costs each system CPU in proportion to what it writes,
so the timed passes run without it. The floor is engine_steps.py's bare `BEGIN IMMEDIATE; INSERT; COMMIT`
with synchronous=FULL in WAL mode, in the same directory, into a WAL it reuses as the systems do after
their first turns (a commit that grows the WAL costs about twice as much; printed too), measured in
slices of --floor-commits commits before each round and each concurrent phase and after the last,
pooled (FloorSlices).

Every database file is in WAL mode with synchronous=FULL (one fsync per commit), so the systems
differ in what they commit, not in how SQLite is set up; DBOS alone would otherwise use SQLite's
rollback journal (--dbos-journal default runs it that way).

dex's 16 sessions also run spread over --processes worker processes (default 2) on one SQLite
file, each process with its own client, worker and flow type (so each observes its own sessions'
turn ends locally); printed below the table as one figure: turns/s over all processes, between the
first process starting its clock and the last one stopping it.

With --pg-dsn, dex's turn also runs on that PostgreSQL server (a fresh database per phase, the
worker in this process), printed apart against a bare PostgreSQL commit on one connection, with
the transactions, round trips and statements psycopg sent per turn (counted in the timed pass:
the counters are cheap next to a round trip).

Run: uv run --group bench python bench/agent_turn.py [--turns N] [--sessions N] [--rounds N]
     [--skip-builtin] [--skip-engine] [--skip-sqlite] [--skip-langgraph] [--skip-dbos] [--dbos-journal wal|default]
     [--processes N] [--pg-dsn DSN] [--json]
(`uv sync` without the group removes LangGraph and DBOS again; where others share the .venv, set
UV_PROJECT_ENVIRONMENT to a private one.)

Goal (issue 4): a dex median turn at most 15x the floor, and at least 200 turns/s with 16 sessions.
bench/profile_turn.py breaks one dex turn down (CPU per thread, store operations, SQL statements,
cProfile), in the quantities that stay meaningful on a loaded machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import json
import operator
import os
import queue
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, TypedDict, cast

import msgspec

from dex_agents import (
    AGENT_STATE,
    AgentSessionClient,
    AgentSessionFlow,
    AgentTurnContext,
    AgentTurnOutcome,
    DeferredToolCall,
    DeferredToolExecution,
    FrameworkMessage,
    MessageRole,
    RunModelLimit,
    ToolCallsRequested,
    ToolEffect,
    ToolExecutionResult,
    ToolPolicy,
    TurnCompleted,
    describe_tool_call_outcome,
)
from dex_agents._constants import RUN_MODEL_HEARTBEAT_TIMEOUT
from dex_agents.builtin_loop import (
    AgentDefinition,
    InstructionContext,
    ModelRequest,
    ScriptedModelClient,
    ScriptedModelReply,
    ScriptedToolCall,
    builtin_agent_session_flow,
    function_tool,
)
from dex_engine import (
    AsyncClient,
    AsyncWorker,
    Attribute,
    Channel,
    Context,
    Flow,
    LoadOptions,
    Registry,
    RetryPolicy,
    RpcContext,
    Step,
    StepDecision,
    StepDurability,
    StepOptions,
    Wait,
    WorkerOptions,
    open_store,
    rpc,
)
from dex_engine._limits import DEFAULT_LEASE_RENEW_SECONDS, DEFAULT_LEASE_TTL_SECONDS
from dex_engine._sqlite_store import SqliteStore
from dex_engine._store import Store

# The floors are engine_steps.py's measurements, so both benchmarks compare against the same thing.
from engine_steps import (
    Recorded,
    RecordingConnection,
    Replayed,
    WalWarmth,
    _count_statements,
    commit_split,
    drop_pg_database,
    floor,
    fresh_pg_database,
    pct,
    pg_floor,
    replay,
    reused_wal,
    snapshot,
)
from engine_steps import counts as pg_counts

USER_TEXT = "How many open orders do I have?"
TOOL_NAME = "read_orders"
TOOL_OUTPUT = "3 open orders"
ANSWER = "You have 3 open orders."
# Sequential turns go to a fresh session every this many turns, so no system's history (which dex
# and LangGraph load on every model call) grows without bound over a long run.
TURNS_PER_SEQUENTIAL_SESSION = 25
WARMUP_TURNS = 3


@dataclass
class PhaseResult:
    latencies: list[float]
    wall: float
    cpu: float  # CPU seconds of this process (every thread) over the phase
    commits: int = 0  # commits that changed data, over counted_turns (a counting pass)
    fsyncs: int = 0  # those of them at synchronous=FULL: one WAL fsync each
    counted_turns: int = 0
    # dex on SQLite, sequential counting pass: its statements replayed alone (engine_steps.replay).
    replayed: Replayed | None = None
    replay_statements: float = 0.0  # a turn
    # PostgreSQL only, over the timed turns: what psycopg sent (engine_steps' counters).
    transactions: int = 0
    round_trips: int = 0
    statements: int = 0
    started: float = 0.0  # time.perf_counter() when the clock started (CLOCK_MONOTONIC: any process)

    @property
    def turns(self) -> int:
        return len(self.latencies)


# One phase of one system: (turns per session, session ID prefix, sessions at once, commit counter
# or None for a timed pass without one).
PhaseRun = Callable[[Sequence[int], str, bool, "CommitCounter | None"], PhaseResult]


@dataclass
class System:
    """One system the benchmark runs: how it runs a phase, and what the report notes about it."""

    name: str
    run: PhaseRun
    notes: list[str]


def _counted(system: System, timed: PhaseResult, plan: Sequence[int], prefix: str, concurrent: bool) -> PhaseResult:
    """`timed`, with the commits and fsyncs of an untimed pass of `plan` on a new file (a counter's
    trace callback costs CPU, so timed passes run without one)."""
    counter = CommitCounter()
    counted = system.run(plan, f"{prefix}-count", concurrent, counter)
    timed.commits, timed.fsyncs, timed.counted_turns = counted.commits, counted.fsyncs, counted.turns
    timed.replayed, timed.replay_statements = counted.replayed, counted.replay_statements
    return timed


def _joined(parts: Sequence[PhaseResult]) -> PhaseResult:
    """The rounds of one system's sequential phase as one phase: every latency, the walls and CPU summed."""
    return PhaseResult([x for part in parts for x in part.latencies], sum(p.wall for p in parts),
                       sum(p.cpu for p in parts), started=parts[0].started)


def measure_systems(systems: Sequence[System], turns: int, sessions: int, count_turns: int, rounds: int,
                    floors: FloorSlices) -> list[SystemResult]:
    """Every system's sequential phase, in `rounds` rounds that each run every system's share of the
    turns in turn after a floor slice; then each system's concurrent phase after a slice of its own;
    then a last slice. This VM's speed changes by up to half within minutes: run one system after
    another, one could take a slow minute alone, and its ratio to a floor measured in other minutes
    would carry it. Interleaved, every system and the floor share the same minutes."""
    shares = [turns // rounds + (1 if i < turns % rounds else 0) for i in range(rounds)]
    parts: dict[str, list[PhaseResult]] = {system.name: [] for system in systems}
    for index, share in enumerate(shares):
        floors.measure()
        for system in systems:
            parts[system.name].append(system.run(sequential_plan(share), f"seq{index}", False, None))
    results: list[SystemResult] = []
    for system in systems:
        seq = _counted(system, _joined(parts[system.name]), sequential_plan(count_turns), "seq", False)
        floors.measure()
        conc = system.run(session_plan(turns, sessions), "conc", True, None)
        conc = _counted(system, conc, session_plan(count_turns, sessions), "conc", True)
        results.append(SystemResult(system.name, seq, conc, sessions, system.notes))
    floors.measure()
    return results


@dataclass
class SystemResult:
    system: str
    sequential: PhaseResult
    concurrent: PhaseResult
    sessions: int
    notes: list[str] = field(default_factory=list)


def session_plan(turns: int, sessions: int) -> list[int]:
    """Turns per session: `turns` spread as evenly as possible over `sessions`."""
    base, extra = divmod(turns, sessions)
    return [base + (1 if i < extra else 0) for i in range(sessions)]


def sequential_plan(turns: int, per_session: int = TURNS_PER_SEQUENTIAL_SESSION) -> list[int]:
    """Turns per session for `turns` one after another: a fresh session every `per_session` turns."""
    full, rest = divmod(turns, per_session)
    return [per_session] * full + ([rest] if rest else [])


def wal_file(path: Path) -> None:
    """Put a new database file in WAL mode (persistent: every later connection uses it)."""
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.close()


class CommitCounter:
    """Counts the COMMITs that changed data on sqlite3 connections, through their trace callback.

    A COMMIT of a transaction that changed nothing writes no WAL frame and syncs nothing, so only
    commits after which the connection's total_changes moved count. `synced` counts those made
    while the connection was at synchronous=FULL: one fsync of the WAL each (the engine drops to
    NORMAL for commits that need no fsync). WAL checkpoints add a few fsyncs that are not counted.
    """

    def __init__(self) -> None:
        self.count = 0
        self.synced = 0
        self._lock = threading.Lock()

    def totals(self) -> tuple[int, int]:
        with self._lock:
            return self.count, self.synced

    def attach(self, conn: sqlite3.Connection) -> None:
        seen = conn.total_changes
        level = int(conn.execute("PRAGMA synchronous").fetchone()[0])
        full = level >= 2  # 2 is FULL, 3 EXTRA

        def trace(statement: str) -> None:
            nonlocal seen, full
            # The callback runs on the connection's own thread, before the statement runs, for
            # every statement: most are neither COMMIT nor PRAGMA, so it looks at one letter first.
            if statement[:1] not in "CcPp \t\n":
                return
            head = statement.lstrip()[:6].upper()
            if head == "COMMIT" and conn.total_changes != seen:
                seen = conn.total_changes
                with self._lock:
                    self.count += 1
                    self.synced += full
            elif head == "PRAGMA" and "SYNCHRONOUS" in statement.upper() and "=" in statement:
                value = statement.split("=", 1)[1].strip().strip(";").upper()
                full = value in ("FULL", "EXTRA", "2", "3")

        conn.set_trace_callback(trace)


# dex ------------------------------------------------------------------------------------------


class TurnWatcher:
    """Tells when a session's turn has ended, from commit notifications, with one read per check.

    The runner marks a session once its answering model call has returned; from then on each
    local commit wakes that session's waiter, which reads the session's ended turns once (`ended`,
    set by the phase once its client exists). So a turn costs one or two small reads to observe,
    instead of a poll loop (read_agent_events and get_agent_snapshot polling both sleep 20 ms
    between reads, far above a turn's cost here).
    """

    def __init__(self) -> None:
        self.ended: Callable[[str], Awaitable[int]] | None = None
        self.answered: set[str] = set()
        self.wakes: dict[str, asyncio.Event] = {}

    def on_commit(self) -> None:
        for session_id in self.answered:
            self.wakes[session_id].set()

    def answer_returned(self, session_id: str) -> None:
        self.answered.add(session_id)

    async def wait_turn(self, session_id: str, turn_count: int) -> None:
        """Until the session has ended `turn_count` turns; the first read waits for a wake-up."""
        wake = self.wakes.setdefault(session_id, asyncio.Event())
        assert self.ended is not None
        while True:
            await wake.wait()
            wake.clear()
            if await self.ended(session_id) >= turn_count:
                self.answered.discard(session_id)
                return

    async def wait_started(self, session_id: str) -> None:
        """Until the session's start has committed what `ended` reads."""
        self.wakes.setdefault(session_id, asyncio.Event()).set()  # read once before waiting
        self.answered.add(session_id)
        await self.wait_turn(session_id, 0)


@dataclass(frozen=True)
class TurnCalls:
    """A dex turn's three client calls, bound to one client: start a session, send a turn's user
    message, read how many turns a session has ended (-1 before it has started)."""

    start: Callable[[str], Awaitable[None]]
    send: Callable[[str], Awaitable[None]]
    ended: Callable[[str], Awaitable[int]]


@dataclass(frozen=True)
class DexTurn:
    """What a dex phase runs: a Flow, and its calls once a client for it exists."""

    flow: Flow
    bind: Callable[[AsyncClient], TurnCalls]


@dataclass(frozen=True)
class BoundTurn:
    """A dex turn wired to a store: its registry and client, its calls, and the watcher that the
    store's commits wake (until unbind())."""

    store: Store
    registry: Registry
    client: AsyncClient
    calls: TurnCalls
    watcher: TurnWatcher

    def unbind(self) -> None:
        self.store.remove_commit_listener(self.watcher.on_commit)


def bind_turn(store: Store, make: Callable[[TurnWatcher], DexTurn]) -> BoundTurn:
    """The turn `make` builds, with a client on `store` and a watcher of its commits."""
    watcher = TurnWatcher()
    turn = make(watcher)
    registry = Registry([turn.flow])
    client = AsyncClient(registry, store=store)
    calls = turn.bind(client)
    watcher.ended = calls.ended
    store.add_commit_listener(watcher.on_commit)
    return BoundTurn(store, registry, client, calls, watcher)


def agent_calls(flow: AgentSessionFlow) -> Callable[[AsyncClient], TurnCalls]:
    """An agent session's calls: start_session, send_user_message, AgentState.turn_count."""

    def bind(client: AsyncClient) -> TurnCalls:
        sessions = AgentSessionClient(client, flow)

        async def start(session_id: str) -> None:
            await sessions.start_session(session_id)

        async def send(session_id: str) -> None:
            await sessions.send_user_message(session_id, USER_TEXT)

        async def ended(session_id: str) -> int:
            state = await client.get_attribute(session_id, AGENT_STATE)
            return -1 if state is None else state.turn_count

        return TurnCalls(start, send, ended)

    return bind


class CountingSqliteStore(SqliteStore):
    """The engine's SQLite store with the commit counter on its connection (a bench-only peek)."""

    def __init__(self, url: str, counter: CommitCounter) -> None:
        self.counter = counter
        self.recorded: list[Recorded] = []
        self.recording: RecordingConnection | None = None
        super().__init__(url)

    def _connect(self) -> sqlite3.Connection:
        conn = super()._connect()
        self.counter.attach(conn)
        # Its statements, for replay (engine_steps.replay); recorded only while `recording.recording`.
        self.recording = RecordingConnection(conn, self.recorded)
        return cast(sqlite3.Connection, self.recording)


class BenchRunner:
    """The scripted turn: first call asks for one READ tool, the second answers."""

    def __init__(self) -> None:
        self.watcher: TurnWatcher | None = None

    def build_user_message(self, text: str) -> FrameworkMessage:
        return FrameworkMessage(MessageRole.USER, json.dumps({"role": "user", "text": text}), text=text)

    async def run_model_step(self, turn: AgentTurnContext) -> AgentTurnOutcome:
        if turn.framework_run_state is None:
            call = DeferredToolCall("c1", TOOL_NAME, "{}", ToolPolicy(ToolEffect.READ))
            return ToolCallsRequested(json.dumps({"asked": ["c1"]}), [call])
        record = turn.recorded_tool_call("c1")
        items = [
            FrameworkMessage(MessageRole.ASSISTANT, json.dumps({"role": "assistant", "calls": ["c1"]})),
            FrameworkMessage(MessageRole.TOOL, json.dumps({"role": "tool", "id": "c1"}), tool_call_id="c1",
                             tool_name=TOOL_NAME, tool_output=describe_tool_call_outcome(record)),
            FrameworkMessage(MessageRole.ASSISTANT, json.dumps({"role": "assistant", "text": ANSWER}), text=ANSWER),
        ]
        if self.watcher is not None:
            self.watcher.answer_returned(turn.flow_id)
        return TurnCompleted(items)

    async def execute_deferred_tool_call(self, call: DeferredToolExecution) -> ToolExecutionResult:
        return ToolExecutionResult(TOOL_OUTPUT)


def scripted_runner_flow(watcher: TurnWatcher, flow_type: str = "BenchTurn") -> DexTurn:
    runner = BenchRunner()
    runner.watcher = watcher
    flow = AgentSessionFlow(runner, flow_type=flow_type)
    return DexTurn(flow, agent_calls(flow))


# The session whose model call is running; set by the instructions function, read by the model.
_CURRENT_SESSION: contextvars.ContextVar[str] = contextvars.ContextVar("bench_session")


def builtin_loop_flow(watcher: TurnWatcher) -> DexTurn:
    """The same turn through the built-in loop: a function tool and a ScriptedModelClient."""

    @function_tool(effect=ToolEffect.READ, name=TOOL_NAME)
    async def read_orders() -> str:
        """Read the orders."""
        return TOOL_OUTPUT

    def respond(request: ModelRequest) -> ScriptedModelReply:
        if ScriptedModelClient.tool_results(request):
            watcher.answer_returned(_CURRENT_SESSION.get())
            return ScriptedModelReply(text=ANSWER)
        return ScriptedModelReply(tool_calls=[ScriptedToolCall(TOOL_NAME, {})])

    def instructions(context: InstructionContext) -> str:
        _CURRENT_SESSION.set(context.flow_id)  # the model call that follows runs in this task
        return "You read orders."

    definition = AgentDefinition(name="bench", instructions=instructions,
                                 model=ScriptedModelClient(respond, max_recorded_requests=0), tools=[read_orders])
    flow = builtin_agent_session_flow(definition, "BenchLoopTurn")
    return DexTurn(flow, agent_calls(flow))


# The turn's Step shape on the bare engine: the Steps of an agent turn with the options that shape
# its commits (pure Executes and folded waits, locks, durability, RunModel's deadlines, CallTool's
# heartbeat), its waits, channels and client calls, and none of the agent layer's work (messages,
# tool call records, events, usage, snapshots). What it costs is the engine's share of a turn.
SHAPE_USER_MESSAGES: Channel[str] = Channel("ShapeUserMessages", str)
SHAPE_TOOL_RESULTS: Channel[str] = Channel("ShapeToolResults", str)
SHAPE_TURNS: Attribute[int] = Attribute("ShapeTurns", int)
SHAPE_TURN_LOCK: Attribute[int] = Attribute("ShapeTurnLock", int)  # AwaitUserMessage's lock
SHAPE_INTERRUPT_LOCK: Attribute[int] = Attribute("ShapeInterruptLock", int)  # ResumeTurn's lock
_SHAPE_SYNC = StepDurability.SYNC
_SHAPE_NOTHING = StepOptions(durability=_SHAPE_SYNC, load=LoadOptions.none())


def engine_shape_flow(watcher: TurnWatcher, flow_type: str = "BenchShape") -> DexTurn:
    """StartAgentSession, then per turn: an RPC queues the user message; AwaitUserMessage takes it;
    RunModel starts CallTool and a ResumeTurn waiting for its result; CallTool heartbeats and
    publishes it; ResumeTurn takes it; RunModel counts the turn and goes back to AwaitUserMessage."""

    async def start_session(ctx: Context, _: None) -> StepDecision:
        ctx.set(SHAPE_TURNS, 0)
        return StepDecision.go_to("AwaitUserMessage")

    async def await_user_message_wait(ctx: Context, _: None) -> Wait:
        return Wait.until(SHAPE_USER_MESSAGES.for_one())

    async def await_user_message(ctx: Context, _: None) -> StepDecision:
        return StepDecision.go_to("RunModel", 1)

    async def run_model(ctx: Context, call: int) -> StepDecision:
        if call == 1:
            return StepDecision.go_to_many(("CallTool", TOOL_NAME), ("ResumeTurn", None))
        ctx.set(SHAPE_TURNS, (ctx.get(SHAPE_TURNS) or 0) + 1)
        watcher.answer_returned(ctx.flow_id)
        return StepDecision.go_to("AwaitUserMessage")

    async def call_tool(ctx: Context, _: str) -> StepDecision:
        await ctx.heartbeat()  # durable before the tool runs, as dex's CallTool
        ctx.publish(SHAPE_TOOL_RESULTS, TOOL_OUTPUT)
        return StepDecision.dead_end()

    async def resume_turn_wait(ctx: Context, _: None) -> Wait:
        return Wait.until(SHAPE_TOOL_RESULTS.for_one())

    async def resume_turn(ctx: Context, _: None) -> StepDecision:
        return StepDecision.go_to("RunModel", 2)

    @rpc("send_user_message", request_type=str, load=LoadOptions.none())
    async def send_user_message(ctx: RpcContext, text: str) -> None:
        ctx.publish(SHAPE_USER_MESSAGES, text)

    def waiting(lock: Attribute[int]) -> StepOptions:
        return StepOptions(durability=_SHAPE_SYNC, wait_for_load=LoadOptions.none(),
                           execute_load=LoadOptions.none(), execute_locks=(lock,))

    limit = RunModelLimit()  # dex's RunModel options by default (AgentSessionFlow)
    run_model_options = StepOptions(
        durability=_SHAPE_SYNC, load=LoadOptions.only(SHAPE_TURNS),
        execute_timeout_seconds=limit.timeout.total_seconds(),
        heartbeat_timeout_seconds=RUN_MODEL_HEARTBEAT_TIMEOUT.total_seconds(),
        execute_retry=RetryPolicy(max_attempts=limit.max_attempts,
                                  total_duration_seconds=limit.retry_budget.total_seconds()))
    flow = Flow(flow_type, [
        Step("StartAgentSession", start_session, input_type=type(None), options=_SHAPE_NOTHING),
        Step("AwaitUserMessage", await_user_message, wait_for=await_user_message_wait, input_type=type(None),
             options=waiting(SHAPE_TURN_LOCK), pure_execute=True),
        Step("RunModel", run_model, input_type=int, options=run_model_options),
        Step("CallTool", call_tool, input_type=str, options=_SHAPE_NOTHING, pure_until_heartbeat=True),
        Step("ResumeTurn", resume_turn, wait_for=resume_turn_wait, input_type=type(None),
             options=waiting(SHAPE_INTERRUPT_LOCK), pure_execute=True),
    ], start_step="StartAgentSession",
        schema=[SHAPE_USER_MESSAGES, SHAPE_TOOL_RESULTS, SHAPE_TURNS, SHAPE_TURN_LOCK, SHAPE_INTERRUPT_LOCK],
        rpcs=[send_user_message])

    def bind(client: AsyncClient) -> TurnCalls:
        async def start(session_id: str) -> None:
            await client.start_flow(flow_type, session_id)

        async def send(session_id: str) -> None:
            await client.rpc(session_id, "send_user_message", USER_TEXT)

        async def ended(session_id: str) -> int:
            turns = await client.get_attribute(session_id, SHAPE_TURNS)
            return -1 if turns is None else turns

        return TurnCalls(start, send, ended)

    return DexTurn(flow, bind)


async def dex_phase(url: str, plan: Sequence[int], prefix: str, concurrent: bool,
                    make_turn: Callable[[TurnWatcher], DexTurn] = scripted_runner_flow,
                    counter: CommitCounter | None = None,
                    before_clock: Callable[[], Any] | None = None,
                    lease_renew_seconds: float = DEFAULT_LEASE_RENEW_SECONDS) -> PhaseResult:
    postgres = url.startswith("postgresql")
    store = (open_store(url) if postgres else
             SqliteStore(url) if counter is None else CountingSqliteStore(url, counter))
    bound = bind_turn(store, make_turn)
    watcher, registry, calls = bound.watcher, bound.registry, bound.calls
    # Each session has at most one Step running at a time; leave headroom as the tests do.
    options = WorkerOptions(database_url=url, max_concurrent_tasks=max(64, 4 * len(plan)),
                            lease_renew_seconds=lease_renew_seconds,
                            lease_ttl_seconds=max(DEFAULT_LEASE_TTL_SECONDS, 3 * lease_renew_seconds))
    latencies: list[float] = []

    async def start(session_id: str) -> None:
        await calls.start(session_id)
        await watcher.wait_started(session_id)

    # The sequential counting pass on SQLite also records its statements, to replay them alone.
    recording = store.recording if isinstance(store, CountingSqliteStore) and not concurrent else None
    replay_copy: Path | None = None  # the database as the recorded turns found it
    replay_wal = 0  # frames in the original's WAL then (snapshot())
    turn_ends: list[int] = []  # statements recorded when each turn ended

    async def turns(session_id: str, count: int, record: bool, first: int = 0) -> None:
        for done in range(first, first + count):
            t = time.perf_counter()
            await calls.send(session_id)
            await watcher.wait_turn(session_id, done + 1)
            if record:
                latencies.append(time.perf_counter() - t)
                if recording is not None:
                    turn_ends.append(len(recording.recorded))

    ids = [f"{prefix}-{i}" for i in range(len(plan))]
    try:
        async with AsyncWorker(registry, options, store=store):
            await start(f"{prefix}-warmup")
            for n in WalWarmth.of(url).rounds(WARMUP_TURNS):
                await turns(f"{prefix}-warmup", 1, record=False, first=n)
            # Sessions start before the clock: only turns are timed and their commits counted.
            await asyncio.gather(*(start(session_id) for session_id in ids))
            if before_clock is not None:
                await asyncio.to_thread(before_clock)
            if isinstance(store, CountingSqliteStore) and recording is not None:
                replay_copy = Path(f"{store.settings.path}.replay")
                replay_wal = snapshot(Path(store.settings.path), replay_copy)
                recording.recording = True
            before = (0, 0) if counter is None else counter.totals()
            sent0 = dict(pg_counts)
            cpu0, t0 = time.process_time(), time.perf_counter()
            if concurrent:
                await asyncio.gather(*(turns(sid, count, True) for sid, count in zip(ids, plan, strict=True)))
            else:
                for session_id, count in zip(ids, plan, strict=True):
                    await turns(session_id, count, record=True)
            wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            if recording is not None:
                recording.recording = False
            after = (0, 0) if counter is None else counter.totals()
            sent = {k: v - sent0.get(k, 0) for k, v in pg_counts.items()}
    finally:
        bound.unbind()
        await store.close()
    result = PhaseResult(latencies, wall, cpu, after[0] - before[0], after[1] - before[1],
                         transactions=sent.get("commit", 0), round_trips=sent.get("round_trips", 0),
                         statements=sent.get("statements", 0), started=t0)
    if recording is not None and replay_copy is not None and turn_ends:
        result.replayed = replay(replay_copy, recording.recorded, turn_ends, replay_wal)
        result.replay_statements = turn_ends[-1] / len(turn_ends)
    return result


def dex_system(tmp: Path, name: str, make: Callable[[TurnWatcher], DexTurn], note: str) -> System:
    def run(plan: Sequence[int], prefix: str, concurrent: bool, counter: CommitCounter | None) -> PhaseResult:
        url = f"sqlite:///{tmp / f'{name}-{prefix}.db'}"
        return asyncio.run(dex_phase(url, plan, prefix, concurrent, make, counter))

    return System(name, run, [note])


DEX_SYSTEMS: dict[str, tuple[Callable[[TurnWatcher], DexTurn], str]] = {
    "dex": (scripted_runner_flow,
            "turn end observed by one AgentState read after each commit once the answer is returned"),
    "dex-builtin": (builtin_loop_flow, "the same turn through the built-in loop (function tool, scripted model)"),
    "dex-engine": (engine_shape_flow,
                   "not an agent: the turn's Steps, waits and commits on the bare engine, no agent layer work"),
}


@dataclass
class ProcessesResult:
    """dex's concurrent phase spread over worker processes on one SQLite file."""

    processes: int
    sessions: int
    phases: list[PhaseResult]

    @property
    def wall(self) -> float:
        return max(p.started + p.wall for p in self.phases) - min(p.started for p in self.phases)

    def summary(self) -> dict[str, Any]:
        latencies = [x for p in self.phases for x in p.latencies]
        turns = len(latencies)
        return {
            "processes": self.processes, "sessions": self.sessions, "turns": turns,
            "turns_per_s": turns / self.wall, "median_ms": statistics.median(latencies) * 1e3,
            "p95_ms": pct(latencies, 0.95) * 1e3,
            "cpu_ms_per_turn": sum(p.cpu for p in self.phases) / turns * 1e3,
        }


def _process_phase(url: str, plan: list[int], index: int, barrier: Any, results: Any) -> None:
    """One worker process of run_dex_processes: its own flow type and sessions, clock at the barrier."""
    def make(watcher: TurnWatcher) -> DexTurn:
        return scripted_runner_flow(watcher, f"BenchTurn{index}")

    results.put((index, asyncio.run(dex_phase(url, plan, f"p{index}", True, make, before_clock=barrier.wait))))


def run_dex_processes(tmp: Path, turns: int, sessions: int, processes: int) -> ProcessesResult:
    """The 16 sessions' turns spread over `processes` processes (spawned: no state forked from here)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    url = f"sqlite:///{tmp / 'dex-processes.db'}"
    wal_file(tmp / "dex-processes.db")
    plan = session_plan(turns, sessions)
    barrier, results = ctx.Barrier(processes), ctx.Queue()
    procs = [ctx.Process(target=_process_phase, args=(url, plan[i::processes], i, barrier, results))
             for i in range(processes)]
    for proc in procs:
        proc.start()
    phases: list[tuple[int, PhaseResult]] = []
    while len(phases) < processes:
        try:
            phases.append(results.get(timeout=1))
        except queue.Empty:
            for proc in procs:
                if proc.exitcode not in (None, 0):
                    for other in procs:
                        other.kill()
                    raise RuntimeError(f"bench worker process {proc.name} exited with code {proc.exitcode} "
                                       "before reporting its phase (a negative code is the signal that ended "
                                       "it; a Python error printed its traceback above)") from None
    for proc in procs:
        proc.join()
    return ProcessesResult(processes, sessions, [phase for _, phase in sorted(phases, key=lambda r: r[0])])


def run_dex_postgres(dsn: str, turns: int, sessions: int) -> SystemResult:
    """dex's turn on PostgreSQL: each phase in a database of its own, dropped afterwards."""
    _count_statements()

    def run(plan: Sequence[int], prefix: str, concurrent: bool) -> PhaseResult:
        name = f"dex_agent_bench_{prefix}"
        url = fresh_pg_database(dsn, name)
        try:
            return asyncio.run(dex_phase(url, plan, prefix, concurrent))
        finally:
            drop_pg_database(dsn, name)

    seq = run(sequential_plan(turns), "seq", False)
    conc = run(session_plan(turns, sessions), "conc", True)
    return SystemResult("dex", seq, conc, sessions, [
        "worker and client in this process; cpu ms leaves out the server's processes",
    ])


# Threaded competitors -------------------------------------------------------------------------


def threaded_phase(turn: Callable[[str], float], plan: Sequence[int], prefix: str, concurrent: bool,
                   counter: CommitCounter | None, db: Path) -> PhaseResult:
    """Warm up (WalWarmth.rounds, with `db`'s WAL), then run `plan` turns per session, the sessions one
    after another or each on a thread."""

    def session(session_id: str, count: int) -> list[float]:
        return [turn(session_id) for _ in range(count)]

    for _ in WalWarmth(db).rounds(WARMUP_TURNS):
        turn(f"{prefix}-warmup")
    ids = [f"{prefix}-{i}" for i in range(len(plan))]
    before = (0, 0) if counter is None else counter.totals()
    cpu0, t0 = time.process_time(), time.perf_counter()
    if concurrent:
        with ThreadPoolExecutor(len(plan)) as pool:
            results = list(pool.map(session, ids, plan))
    else:
        results = [session(session_id, count) for session_id, count in zip(ids, plan, strict=True)]
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    after = (0, 0) if counter is None else counter.totals()
    return PhaseResult([x for r in results for x in r], wall, cpu, after[0] - before[0], after[1] - before[1])


# The turn's writes, straight on sqlite3 -------------------------------------------------------

# A careful hand-written layout for one session's rows: each table clustered by session, so a
# commit touches a leaf or two of each.
_DIRECT_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (session_id TEXT PRIMARY KEY, version INTEGER NOT NULL, state BLOB NOT NULL)
    WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS items (session_id TEXT NOT NULL, name TEXT NOT NULL, key TEXT NOT NULL, value BLOB NOT NULL,
    PRIMARY KEY (session_id, name, key)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS events (session_id TEXT NOT NULL, seq INTEGER NOT NULL, value BLOB NOT NULL,
    PRIMARY KEY (session_id, seq)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS history (session_id TEXT NOT NULL, seq INTEGER NOT NULL, value BLOB NOT NULL,
    PRIMARY KEY (session_id, seq)) WITHOUT ROWID;
"""


class DirectTurns:
    """The turn's four durable commits and its rows, written with sqlite3 and nothing else: no
    engine, no leases, waits, locks or recovery. What any Python system's turn costs at least.

    One connection behind a lock (as SqliteSaver's), one transaction at a time. Each commit first
    reads the session row (the version a real system would check), then writes what dex's commit
    at that point writes: messages, the tool call record, usage, the run state, events, a history
    entry and the session row; each model call reads every message of the session first.
    """

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn
        self._lock = threading.Lock()
        self._encode = msgspec.json.Encoder().encode
        self._decode = msgspec.json.Decoder(dict[str, Any]).decode

    def _commit(self, session_id: str, messages: list[dict[str, Any]], items: list[tuple[str, str, Any]],
                deleted: list[tuple[str, str]], events: list[dict[str, Any]], step: str) -> None:
        """One durable commit: `messages` appended under the session's next sequences, `items` set,
        `deleted` removed, `events` appended, a history entry and the session row written."""
        encode, conn = self._encode, self._conn
        with self._lock:
            conn.execute("BEGIN IMMEDIATE")
            try:
                row = conn.execute("SELECT version, state FROM sessions WHERE session_id = ?", (session_id,)).fetchone()
                version, state = (0, {"next": 0, "seq": 0}) if row is None else (row[0], self._decode(row[1]))
                first, seq = state["next"], state["seq"]
                rows = [("messages", f"{first + i:012d}", {"sequence": first + i, **m}) for i, m in enumerate(messages)]
                for name, key in deleted:
                    conn.execute("DELETE FROM items WHERE session_id = ? AND name = ? AND key = ?",
                                 (session_id, name, key))
                conn.executemany(
                    "INSERT INTO items VALUES (?, ?, ?, ?) ON CONFLICT (session_id, name, key) DO UPDATE SET"
                    " value = excluded.value",
                    [(session_id, name, key, encode(value)) for name, key, value in [*rows, *items]])
                conn.executemany("INSERT INTO events VALUES (?, ?, ?)",
                                 [(session_id, seq + i + 1, encode(e)) for i, e in enumerate(events)])
                state["next"], state["seq"] = first + len(messages), seq + len(events)
                conn.execute("INSERT INTO history VALUES (?, ?, ?)",
                             (session_id, version + 1, encode({"step": step, "completed": True})))
                conn.execute(
                    "INSERT INTO sessions VALUES (?, ?, ?) ON CONFLICT (session_id) DO UPDATE SET version ="
                    " excluded.version, state = excluded.state", (session_id, version + 1, encode(state)))
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise

    def read(self, session_id: str, name: str) -> list[dict[str, Any]]:
        """Every stored item of `name` of the session, in key order."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT value FROM items WHERE session_id = ? AND name = ? ORDER BY key", (session_id, name)
            ).fetchall()
        return [self._decode(r[0]) for r in rows]

    def turn(self, session_id: str) -> float:
        t = time.perf_counter()
        turn_id = f"turn-{time.perf_counter_ns()}"
        self._commit(session_id, [{"role": "user", "text": USER_TEXT}],
                     [("turn", "", {"turn_id": turn_id}), ("state", "", {"status": "running", "turn_id": turn_id})],
                     [], [{"type": "turn_started", "turn_id": turn_id}], "AwaitUserMessage")
        seen = self.read(session_id, "messages")  # the model call sees the whole conversation
        call = {"id": "c1", "name": TOOL_NAME, "args": {}}
        self._commit(session_id, [{"role": "assistant", "calls": [call]}],
                     [("usage", "", {"input_tokens": 10 * len(seen), "output_tokens": 5}),
                      ("run_state", "", {"turn_id": turn_id, "messages": len(seen)}),
                      ("tool_calls", "c1", {"turn_id": turn_id, "status": "pending", **call})],
                     [], [{"type": "usage_recorded"}, {"type": "tool_call_started", "tool_call_id": "c1"}],
                     "RunModel")
        self._commit(session_id, [],
                     [("tool_calls", "c1", {"turn_id": turn_id, "status": "completed", "output": TOOL_OUTPUT, **call})],
                     [], [{"type": "tool_call_finished", "tool_call_id": "c1"}], "CallTool")
        seen = self.read(session_id, "messages")
        self._commit(session_id, [{"role": "tool", "id": "c1", "output": TOOL_OUTPUT},
                                  {"role": "assistant", "text": ANSWER}],
                     [("usage", "", {"input_tokens": 10 * len(seen), "output_tokens": 9}),
                      ("state", "", {"status": "idle", "last_turn_id": turn_id})],
                     [("tool_calls", "c1"), ("run_state", "")],
                     [{"type": "usage_recorded"}, {"type": "turn_completed", "turn_id": turn_id}], "RunModel")
        state = self.read(session_id, "state")  # the caller learns the turn ended, as dex's client does: one read
        elapsed = time.perf_counter() - t
        if state != [{"status": "idle", "last_turn_id": turn_id}]:
            raise RuntimeError(f"the direct turn of {session_id} did not end idle: {state!r}")
        return elapsed


def direct_connection(path: Path) -> sqlite3.Connection:
    """A connection to a new file for DirectTurns: WAL, synchronous=FULL, the tables made."""
    wal_file(path)
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA synchronous = FULL")
    conn.executescript(_DIRECT_SCHEMA)
    return conn


def direct_system(tmp: Path) -> System:
    def phase(plan: Sequence[int], prefix: str, concurrent: bool, counter: CommitCounter | None) -> PhaseResult:
        path = tmp / f"sqlite-{prefix}.db"
        conn = direct_connection(path)
        try:
            if counter is not None:
                counter.attach(conn)
            return threaded_phase(DirectTurns(conn).turn, plan, prefix, concurrent, counter, path)
        finally:
            conn.close()

    return System("sqlite", phase, [
        "not a durable-execution system: the turn's four commits and rows (messages, tool call record, usage,"
        " state, events, history, the session row) written straight with sqlite3 on one connection behind a lock,"
        " one thread per session; no engine, leases, waits or recovery: what a Python system's turn costs at least",
    ])


# LangGraph ------------------------------------------------------------------------------------


class TurnState(TypedDict, total=False):
    """The LangGraph turn's state: the thread's messages (appended) and the tool the model asked for."""

    messages: Annotated[list[dict[str, Any]], operator.add]
    pending_tool: str | None


def langgraph_system(tmp: Path) -> System:
    from langchain_core.runnables import RunnableConfig
    from langgraph.checkpoint.sqlite import SqliteSaver
    from langgraph.graph import END, START, StateGraph

    def model(state: TurnState) -> TurnState:
        last = state["messages"][-1]
        if last["role"] == "user":
            call = {"role": "assistant", "calls": [{"id": "c1", "name": TOOL_NAME, "args": {}}]}
            return {"messages": [call], "pending_tool": TOOL_NAME}
        return {"messages": [{"role": "assistant", "text": ANSWER}], "pending_tool": None}

    def tool(state: TurnState) -> TurnState:
        return {"messages": [{"role": "tool", "id": "c1", "output": TOOL_OUTPUT}], "pending_tool": None}

    def route(state: TurnState) -> str:
        return "tool" if state.get("pending_tool") else END

    builder = StateGraph(TurnState)
    builder.add_node("model", model)
    builder.add_node("tool", tool)
    builder.add_edge(START, "model")
    builder.add_conditional_edges("model", route, ["tool", END])
    builder.add_edge("tool", "model")

    def phase(plan: Sequence[int], prefix: str, concurrent: bool, counter: CommitCounter | None) -> PhaseResult:
        # SqliteSaver shares one connection behind a lock, so its commits are serialized, one
        # fsync each; 16 sessions run on 16 threads calling the sync API. AsyncSqliteSaver would
        # not help: it also funnels every write through one aiosqlite connection (one thread) behind
        # a lock, with the same one commit per write and no group commit, plus a thread hop per call.
        path = tmp / f"langgraph-{prefix}.db"
        wal_file(path)
        conn = sqlite3.connect(path, check_same_thread=False)
        conn.execute("PRAGMA synchronous = FULL")
        if counter is not None:
            counter.attach(conn)
        saver = SqliteSaver(conn)
        saver.setup()
        graph = builder.compile(checkpointer=saver)

        def turn(session_id: str) -> float:
            t = time.perf_counter()
            config: RunnableConfig = {"configurable": {"thread_id": session_id}}
            out = graph.invoke({"messages": [{"role": "user", "text": USER_TEXT}]}, config, durability="sync")
            elapsed = time.perf_counter() - t
            if out["messages"][-1].get("text") != ANSWER:
                raise RuntimeError(f"LangGraph turn ended without the answer: {out['messages'][-1]!r}")
            return elapsed

        try:
            return threaded_phase(turn, plan, prefix, concurrent, counter, path)
        finally:
            conn.close()

    return System("langgraph", phase, [
        "SqliteSaver on one connection behind a lock, durability='sync', one thread per session",
    ])


# DBOS -----------------------------------------------------------------------------------------


def dbos_system(tmp: Path, sessions: int, journal: str) -> System:
    import logging

    import sqlalchemy as sa
    from dbos import DBOS

    def phase(plan: Sequence[int], prefix: str, concurrent: bool, counter: CommitCounter | None) -> PhaseResult:
        # DBOS is a process-wide singleton: each pass launches it on its own system database.
        def on_connect(dbapi_conn: Any, _record: Any) -> None:
            if counter is not None and isinstance(dbapi_conn, sqlite3.Connection):
                counter.attach(dbapi_conn)  # every connection the system database's engine opens

        sa.event.listen(sa.engine.Engine, "connect", on_connect)
        path = tmp / f"dbos-{prefix}.sqlite"
        if journal == "wal":
            wal_file(path)
        DBOS(config={
            "name": "agent-turn-bench",
            "system_database_url": f"sqlite:///{path}",
            "sys_db_pool_size": max(20, sessions + 4),
            "log_level": "WARNING",
        })

        @DBOS.step()
        def model_step(messages: list[dict[str, Any]]) -> dict[str, Any]:
            if messages[-1]["role"] == "user":
                return {"role": "assistant", "calls": [{"id": "c1", "name": TOOL_NAME, "args": {}}]}
            return {"role": "assistant", "text": ANSWER}

        @DBOS.step()
        def tool_step(call_id: str) -> dict[str, Any]:
            return {"role": "tool", "id": call_id, "output": TOOL_OUTPUT}

        @DBOS.workflow()
        def agent_turn(session_id: str, text: str) -> str:
            messages: list[dict[str, Any]] = [{"role": "user", "text": text}]
            ask = model_step(messages)
            messages += [ask, tool_step(ask["calls"][0]["id"])]
            answer = model_step(messages)
            return str(answer["text"])

        def turn(session_id: str) -> float:
            t = time.perf_counter()
            # Called directly: the workflow runs in this thread and returns its result, with no
            # queue or result polling in the way.
            answer = agent_turn(session_id, USER_TEXT)
            elapsed = time.perf_counter() - t
            if answer != ANSWER:
                raise RuntimeError(f"DBOS turn returned {answer!r}")
            return elapsed

        try:
            DBOS.launch()
            logging.getLogger("dbos").setLevel(logging.WARNING)
            return threaded_phase(turn, plan, prefix, concurrent, counter, path)
        finally:
            DBOS.destroy(destroy_registry=True)
            sa.event.remove(sa.engine.Engine, "connect", on_connect)

    mode = "WAL" if journal == "wal" else "its default rollback journal (several fsyncs per commit, not one)"
    return System("dbos", phase, [
        f"SQLite system database in {mode}, synchronous=FULL, one pooled connection per thread; "
        "one workflow per turn, called directly, one thread per session",
    ])


# Report ---------------------------------------------------------------------------------------


def timings(result: SystemResult, floor_median: float) -> dict[str, Any]:
    """A system's latencies, rates and CPU, both phases (the keys summary() and postgres_summary() share)."""
    seq, conc = result.sequential, result.concurrent
    seq_median = statistics.median(seq.latencies)
    return {
        "system": result.system,
        "sequential_turns": seq.turns,
        "sequential_median_ms": seq_median * 1e3,
        "sequential_p95_ms": pct(seq.latencies, 0.95) * 1e3,
        "x_floor": seq_median / floor_median,
        "sequential_turns_per_s": seq.turns / seq.wall,
        "sequential_cpu_ms_per_turn": seq.cpu / seq.turns * 1e3,
        "sessions": result.sessions,
        "concurrent_turns": conc.turns,
        "concurrent_turns_per_s": conc.turns / conc.wall,
        "concurrent_median_ms": statistics.median(conc.latencies) * 1e3,
        "concurrent_p95_ms": pct(conc.latencies, 0.95) * 1e3,
        "concurrent_cpu_ms_per_turn": conc.cpu / conc.turns * 1e3,
        "notes": result.notes,
    }


def summary(result: SystemResult, floor_median: float) -> dict[str, Any]:
    """timings(), with the commits and fsyncs per turn of the counting passes."""
    seq, conc = result.sequential, result.concurrent
    return {
        **timings(result, floor_median),
        "sequential_commits_per_turn": seq.commits / seq.counted_turns,
        "sequential_fsyncs_per_turn": seq.fsyncs / seq.counted_turns,
        "concurrent_commits_per_turn": conc.commits / conc.counted_turns,
        "concurrent_fsyncs_per_turn": conc.fsyncs / conc.counted_turns,
        "counted_turns": seq.counted_turns,
        "replay_median_ms": None if seq.replayed is None else seq.replayed.median * 1e3,
        "replay_x_floor": None if seq.replayed is None else seq.replayed.median / floor_median,
        "replay_turns": None if seq.replayed is None else [seq.replayed.timed, seq.replayed.turns],
        "replay_commit_ms": None if seq.replayed is None else seq.replayed.commit_median * 1e3,
        "replay_commits_per_turn": None if seq.replayed is None else seq.replayed.commits,
        "replay_statements_per_turn": seq.replay_statements,
    }


def postgres_summary(result: SystemResult, floor_latencies: list[float]) -> dict[str, Any]:
    """The PostgreSQL run as JSON: timings() against its own floor, and what psycopg sent per turn."""
    row = timings(result, statistics.median(floor_latencies))
    for phase, part in (("sequential", result.sequential), ("concurrent", result.concurrent)):
        row[f"{phase}_transactions_per_turn"] = part.transactions / part.turns
        row[f"{phase}_round_trips_per_turn"] = part.round_trips / part.turns
        row[f"{phase}_statements_per_turn"] = part.statements / part.turns
    row["floor_median_ms"] = statistics.median(floor_latencies) * 1e3
    row["floor_p95_ms"] = pct(floor_latencies, 0.95) * 1e3
    return row


@dataclass
class FloorSlices:
    """The floor, measured in slices spread over the run (measure_systems): one slice of `commits`
    commits before each round of the sequential phases and before each system's concurrent phase,
    and one after the last, pooled. The bare commit's median moves by 10-20% from one second to the
    next on this VM; a single slice at the start made every ratio carry that one moment's error, and
    the slices' spread, printed, shows how far the moment matters."""

    path: Path
    commits: int
    latencies: list[float] = field(default_factory=list)
    slice_medians: list[float] = field(default_factory=list)
    growing: list[float] = field(default_factory=list)  # each slice's untimed commits (see floor())

    def measure(self) -> None:
        sample = floor(str(self.path), "FULL", self.commits, self.growing)
        self.latencies.extend(sample)
        self.slice_medians.append(statistics.median(sample))

    @property
    def median(self) -> float:
        return statistics.median(self.latencies)


def print_head(sessions: int, counts: tuple[str, str]) -> None:
    """The column heads of a table: each phase's latencies, `counts` (two columns) and CPU."""
    conc = f"{sessions} sessions"
    print(f"\n{'':<10}|{'sequential':^57}|{conc:^57}")
    first, second = counts
    head = (f"{'system':<10}|{'median ms':>10}{'p95 ms':>9}{'x floor':>9}{first:>9}{second:>9}{'cpu ms':>9} |"
            f"{'turns/s':>9}{'median ms':>11}{'p95 ms':>10}{first:>9}{second:>9}{'cpu ms':>9}")
    print(head)
    print("-" * len(head))


def print_table(rows: list[dict[str, Any]], floors: FloorSlices, sessions: int,
                skipped: dict[str, str], spread: dict[str, Any] | None) -> None:
    slices = floors.slice_medians
    print(f"\nfloor: bare commit (WAL, synchronous=FULL) on a dedicated thread, into a WAL it reuses: median"
          f" {floors.median * 1e3:.3f} ms  p95 {pct(floors.latencies, 0.95) * 1e3:.3f} ms, over {len(slices)} slices of"
          f" {floors.commits} commits (one before each round of the sequential phases and each concurrent phase, one"
          f" after the last; slice medians {min(slices) * 1e3:.3f}-{max(slices) * 1e3:.3f} ms); the same commit into"
          f" a growing WAL, each slice's untimed start: median {statistics.median(floors.growing) * 1e3:.3f} ms")
    print_head(sessions, ("commits", "fsyncs"))
    for r in rows:
        print(f"{r['system']:<10}|{r['sequential_median_ms']:>10.2f}{r['sequential_p95_ms']:>9.2f}"
              f"{r['x_floor']:>9.1f}{r['sequential_commits_per_turn']:>9.2f}{r['sequential_fsyncs_per_turn']:>9.2f}"
              f"{r['sequential_cpu_ms_per_turn']:>9.2f} |"
              f"{r['concurrent_turns_per_s']:>9.1f}{r['concurrent_median_ms']:>11.2f}{r['concurrent_p95_ms']:>10.2f}"
              f"{r['concurrent_commits_per_turn']:>9.2f}{r['concurrent_fsyncs_per_turn']:>9.2f}"
              f"{r['concurrent_cpu_ms_per_turn']:>9.2f}")
    for system, reason in skipped.items():
        print(f"{system:<10}| skipped: {reason}")
    counted = rows[0]["counted_turns"] if rows else 0
    print(f"\ncommits: data-changing SQLite commits per turn; fsyncs: those at synchronous=FULL (one WAL fsync"
          f" each);\n  both counted in a separate untimed pass of {counted} turns per phase (the trace callback"
          " that counts them costs CPU)\ncpu ms: this process's CPU time per turn, all threads (less sensitive to a"
          " loaded machine)")
    for r in rows:
        for note in r["notes"]:
            print(f"{r['system']}: {note}")
    if spread is not None:
        print(f"\ndex, {spread['sessions']} sessions over {spread['processes']} worker processes on one file (each"
              f" its own client, worker and flow type): {spread['turns_per_s']:.1f} turns/s,"
              f" median {spread['median_ms']:.2f} ms, p95 {spread['p95_ms']:.2f} ms,"
              f" cpu {spread['cpu_ms_per_turn']:.2f} ms per turn (all processes)")
    by_name = {r["system"]: r for r in rows}
    dex, engine = by_name.get("dex"), by_name.get("dex-engine")
    for name, what in (("dex", "dex's own SQL"), ("dex-engine", "the bare engine's SQL for the turn's Steps")):
        row = by_name.get(name)
        if row is None or row["replay_median_ms"] is None:
            continue
        print(f"\n{what}, replayed alone: the {row['replay_statements_per_turn']:.1f} statements of a sequential"
              " turn (the counting pass's, run again on a copy of its database taken before it, on one connection"
              f" with no engine or agent code): median {row['replay_median_ms']:.2f} ms a turn,"
              f" {row['replay_x_floor']:.1f}x floor, {reused_wal(*row['replay_turns'])}; "
              + commit_split(row["replay_median_ms"] / 1e3, row["replay_commit_ms"] / 1e3,
                             row["replay_commits_per_turn"], floors.median))
    if dex is not None and engine is not None:
        agent_ms = dex["sequential_median_ms"] - engine["sequential_median_ms"]
        print(f"\nof dex's sequential median, the bare engine's Steps (dex-engine) take {engine['x_floor']:.1f} floors"
              f" and the agent layer the other {agent_ms / floors.median / 1e3:.1f} ({agent_ms:.2f} ms)")
        direct = by_name.get("sqlite")
        if direct is not None:
            print(f"the turn's writes straight on sqlite3 (sqlite) take {direct['x_floor']:.1f} floors: the engine"
                  f" adds {engine['x_floor'] - direct['x_floor']:.1f} to them, the agent layer the"
                  f" {dex['x_floor'] - engine['x_floor']:.1f} above")
    if dex is not None:
        ok_ratio = dex["x_floor"] <= 15
        ok_rate = dex["concurrent_turns_per_s"] >= 200
        rate = (f">= 200 turns/s with {sessions} sessions: in one process {'met' if ok_rate else 'NOT met'} "
                f"({dex['concurrent_turns_per_s']:.0f}/s)")
        if spread is not None:
            ok_spread = spread["turns_per_s"] >= 200
            rate += (f", over {spread['processes']} processes {'met' if ok_spread else 'NOT met'}"
                     f" ({spread['turns_per_s']:.0f}/s)")
        print(f"\ngoal: dex median <= 15x floor: {'met' if ok_ratio else 'NOT met'} ({dex['x_floor']:.1f}x); {rate}")


def print_postgres(row: dict[str, Any]) -> None:
    """dex's turn on PostgreSQL (a postgres_summary() row), apart from the SQLite table: its own
    floor, and what psycopg sent."""
    print(f"\nPostgreSQL floor: bare commit on one connection: median {row['floor_median_ms']:.3f} ms"
          f"  p95 {row['floor_p95_ms']:.3f} ms")
    print_head(row["sessions"], ("txns", "trips"))
    print(f"{'dex (pg)':<10}|{row['sequential_median_ms']:>10.2f}{row['sequential_p95_ms']:>9.2f}"
          f"{row['x_floor']:>9.1f}{row['sequential_transactions_per_turn']:>9.2f}"
          f"{row['sequential_round_trips_per_turn']:>9.2f}{row['sequential_cpu_ms_per_turn']:>9.2f} |"
          f"{row['concurrent_turns_per_s']:>9.1f}{row['concurrent_median_ms']:>11.2f}{row['concurrent_p95_ms']:>10.2f}"
          f"{row['concurrent_transactions_per_turn']:>9.2f}{row['concurrent_round_trips_per_turn']:>9.2f}"
          f"{row['concurrent_cpu_ms_per_turn']:>9.2f}")
    print(f"\ntxns, trips: transactions committed and round trips waited for per turn, as psycopg sent them "
          f"(statements: {row['sequential_statements_per_turn']:.1f} and {row['concurrent_statements_per_turn']:.1f}"
          " per turn)")
    for note in row["notes"]:
        print(f"dex (pg): {note}")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--turns", type=int, default=200, help="turns per phase and system (default 200)")
    parser.add_argument("--sessions", type=int, default=16, help="sessions at once in the concurrent phase")
    parser.add_argument("--count-turns", type=int, default=32,
                        help="turns per phase of the untimed pass that counts commits (default 32)")
    parser.add_argument("--floor-commits", type=int, default=500,
                        help="commits per floor slice; a slice runs before each round and each concurrent phase, "
                             "and one after the last")
    parser.add_argument("--rounds", type=int, default=4,
                        help="rounds the sequential phases run in, each running every system's share in turn "
                             "(default 4)")
    parser.add_argument("--skip-builtin", action="store_true", help="leave out the built-in loop's run of the turn")
    parser.add_argument("--skip-engine", action="store_true",
                        help="leave out the turn's Step shape on the bare engine (dex-engine)")
    parser.add_argument("--skip-sqlite", action="store_true",
                        help="leave out the turn's writes straight on sqlite3 (sqlite)")
    parser.add_argument("--skip-langgraph", action="store_true")
    parser.add_argument("--skip-dbos", action="store_true")
    parser.add_argument("--dbos-journal", choices=["wal", "default"], default="wal",
                        help="DBOS's SQLite journal: WAL like the others (default), or as DBOS leaves it")
    parser.add_argument("--processes", type=int, default=2,
                        help="also run dex's sessions spread over this many worker processes (1: not)")
    parser.add_argument("--pg-dsn", default="",
                        help="also run dex's turn on this PostgreSQL server (creates and drops a database per phase)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args()
    if min(args.turns, args.count_turns) < args.sessions or args.sessions < 1:
        parser.error("--turns and --count-turns must be at least --sessions, and --sessions at least 1")
    if not 1 <= args.rounds <= args.turns:
        parser.error(f"--rounds must be from 1 to --turns ({args.turns}), got {args.rounds}")
    if not 1 <= args.processes <= args.sessions:
        parser.error(f"--processes must be from 1 to --sessions ({args.sessions}), got {args.processes}")
    if args.floor_commits < 1:  # each floor slice's median needs a commit
        parser.error(f"--floor-commits must be at least 1, got {args.floor_commits}")

    tmp = Path(tempfile.mkdtemp(prefix="dex-agent-bench-"))
    log: Callable[[str], None] = (lambda s: print(s, file=sys.stderr)) if args.json else print
    log(f"agent turn benchmark: {args.turns} turns per phase, {args.sessions} sessions at once, "
        f"{os.cpu_count()} cores, files in {tmp}")
    floors = FloorSlices(tmp / "floor.db", args.floor_commits)

    left_out = {"dex-builtin": args.skip_builtin, "dex-engine": args.skip_engine}
    systems = [dex_system(tmp, name, *made) for name, made in DEX_SYSTEMS.items() if not left_out.get(name)]
    skipped: dict[str, str] = {}
    competitors: list[tuple[str, bool, Callable[[], System]]] = [
        ("sqlite", args.skip_sqlite, lambda: direct_system(tmp)),
        ("langgraph", args.skip_langgraph, lambda: langgraph_system(tmp)),
        ("dbos", args.skip_dbos, lambda: dbos_system(tmp, args.sessions, args.dbos_journal)),
    ]
    for name, skip, make in competitors:
        if skip:
            skipped[name] = "--skip-" + name
            continue
        try:
            systems.append(make())
        except ImportError as exc:
            skipped[name] = f"not installed ({exc}); run with `uv run --group bench`"
    log(f"running {', '.join(system.name for system in systems)} in {args.rounds} rounds, then 16 sessions each ...")
    results = measure_systems(systems, args.turns, args.sessions, args.count_turns, args.rounds, floors)
    spread: dict[str, Any] | None = None
    if args.processes > 1:
        log(f"running dex on {args.processes} processes ...")
        spread = run_dex_processes(tmp, args.turns, args.sessions, args.processes).summary()
    floor_median, floor_p95 = floors.median, pct(floors.latencies, 0.95)
    postgres: dict[str, Any] | None = None
    if args.pg_dsn:
        log("running dex on PostgreSQL ...")
        pg_latencies = pg_floor(args.pg_dsn, args.floor_commits)
        postgres = postgres_summary(run_dex_postgres(args.pg_dsn, args.turns, args.sessions), pg_latencies)
    rows = [summary(r, floor_median) for r in results]
    if args.json:
        print(json.dumps({
            "floor_median_ms": floor_median * 1e3, "floor_p95_ms": floor_p95 * 1e3,
            "floor_slice_medians_ms": [m * 1e3 for m in floors.slice_medians], "turns": args.turns,
            "sessions": args.sessions, "cores": os.cpu_count(), "systems": rows, "skipped": skipped,
            "postgres": postgres, "processes": spread,
        }, indent=2))
        return
    print_table(rows, floors, args.sessions, skipped, spread)
    if postgres is not None:
        print_postgres(postgres)


if __name__ == "__main__":
    main()
