"""PostgreSQL faults against a real server: connections killed or cut at the claim, commit and
locked-RPC points, a storm of pg_terminate_backend at random moments, and server crashes
(`pg_ctl stop -m immediate`, then start) every few seconds under a mixed workload.

What the engine promises, and what is checked after every fault:
- E1/E2: a transaction commits whole or not at all, and is never applied twice: a COMMIT whose
  reply was lost is neither repeated nor reported as failed when it did commit.
- E2/E3: no Step method ran twice under one attempt number once it started (its heartbeat was
  durable); an attempt whose claim rolled back is handed out again under the same number; a claim
  reported to a worker survives a server crash (else a second worker could get the same attempt).
- E5/E6/E8: every message is consumed exactly once, every timer fires exactly once, an RPC either
  commits fully (and returns) or raises (and committed nothing).

Ground truth for what ran is the invocation log (fsynced, outside the database): each handler
heartbeats first, then logs `start`, so a `start` line is an attempt the engine counts as started.

How faults are placed:
- `PgProxy`, a PostgreSQL wire-protocol proxy in the test process, sits between a worker child (or
  a client) and the server. It sees every statement of a transaction, so it can stop a chosen
  COMMIT before it reaches the server (the test then kills that backend with pg_terminate_backend:
  the transaction rolls back) or let the COMMIT through and drop the connection before its reply
  (the transaction committed, the client cannot know).
- The crash tests run on a private PostgreSQL instance (initdb into a temporary directory), never on
  the shared server other people's tests use.

These tests need PostgreSQL (TEST_PG_DSN); without it they skip, and the run ends with a warning.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar
from urllib.parse import quote, urlsplit, urlunsplit

import pytest

from dex_engine import (
    AsyncClient,
    AsyncWorker,
    Attribute,
    Channel,
    Context,
    Flow,
    FlowAlreadyStartedError,
    HistoryEntry,
    Movement,
    Registry,
    RetryPolicy,
    RpcContentionError,
    RpcContext,
    RpcLockConflictError,
    RPCResult,
    Step,
    StepDecision,
    StepDurability,
    StepOptions,
    Store,
    Timer,
    Wait,
    WorkerOptions,
    open_store,
    rpc,
)

from .conftest import NO_PG_REASON
from .proc_harness import (
    ENV_LOG_FSYNC,
    ENV_STATE_DIR,
    INVOCATIONS_FILE,
    FileGate,
    Invocation,
    InvocationLog,
    ProcSet,
    WorkerProcess,
    assert_no_attempt_ran_twice,
    eventually,
)

pytestmark = [pytest.mark.slow, pytest.mark.postgres]  # PostgreSQL only (docs/testing.md's -k postgres)

T = TypeVar("T")

# The Registry a worker child of this file runs (ProcSet.start(registry=...)).
REGISTRY_SPEC = "engine.tests.test_pg_faults:REGISTRY"

# Faults cost attempts (a worker cut off by a server restart loses its started attempts): allow many.
FAULT_RETRY = RetryPolicy(max_attempts=50, initial_interval_seconds=0.05, max_interval_seconds=0.2)
FAULT_OPTIONS = StepOptions(execute_retry=FAULT_RETRY, wait_for_retry=FAULT_RETRY)


# Child side: Flows and handlers (they run only in worker children) -------------------------------

_LOG: list[InvocationLog] = []


def _state_dir() -> Path:
    return Path(os.environ[ENV_STATE_DIR])


def _record(ctx: Context, phase: str, detail: str = "") -> None:
    if not _LOG:
        _LOG.append(InvocationLog(_state_dir() / INVOCATIONS_FILE, fsync=os.environ.get(ENV_LOG_FSYNC) != "0"))
    _LOG[0].record(ctx.flow_id, ctx.step_execution_id, ctx.method, ctx.attempt, phase, detail)


async def _started(ctx: Context) -> None:
    """Heartbeat (from now on the attempt counts as started, E3), then log the start."""
    await ctx.heartbeat()
    _record(ctx, "start")


async def _await_gate(gate: FileGate) -> None:
    """Mark `gate` reached and wait for its release, yielding: the worker keeps renewing meanwhile."""
    gate.mark_reached()
    await eventually(f"gate {gate.name} released", gate.release_path.exists, float("inf"), 0.01)


# Chain: A -> B -> C; B has a WaitFor that skips. Output: the execution IDs in order.
Trail: Attribute[list[str]] = Attribute("Trail", list[str])


async def _skip_wait(ctx: Context, _: None) -> Wait:
    _record(ctx, "enter")
    await _started(ctx)
    return Wait.skip_immediately()


def _chain_step(step_type: str, next_step: str | None, *, with_wait: bool = False) -> Step[None]:
    async def execute(ctx: Context, _: None) -> StepDecision:
        _record(ctx, "enter")  # before its first heartbeat: an attempt handed out by a claim that did not commit
        await _started(ctx)
        trail = [*(ctx.get(Trail) or []), ctx.step_execution_id]
        ctx.set(Trail, trail)
        return StepDecision.graceful_complete(trail) if next_step is None else StepDecision.go_to(next_step, None)

    return Step(step_type, execute, input_type=type(None), wait_for=_skip_wait if with_wait else None,
                options=FAULT_OPTIONS)


CHAIN = Flow("PgfChain", [_chain_step("A", "B"), _chain_step("B", "C", with_wait=True), _chain_step("C", None)],
             start_step="A", schema=[Trail])
CHAIN_OUTPUT = ["A-1", "B-1", "C-1"]


# Locks: Idle waits on Go, then starts Hold, which holds lock L at a gate until the test releases it.
# RPC `grab` (lock set L) counts, publishes a token on Box and starts Hold; `peek` lists Box.
Count: Attribute[int] = Attribute("Count", int)
L: Attribute[bool] = Attribute("L", bool)  # only a lock name
Go: Channel[str] = Channel("Go", str)
Box: Channel[str] = Channel("Box", str)


async def _idle_wait(ctx: Context, _: None) -> Wait:
    await _started(ctx)
    return Wait.until(Go.for_one())


async def _idle(ctx: Context, _: None) -> StepDecision:
    await _started(ctx)
    return StepDecision.go_to("Hold", None)


async def _hold(ctx: Context, _: None) -> StepDecision:
    await _started(ctx)
    await _await_gate(FileGate(_state_dir(), f"hold.{ctx.flow_id}.{ctx.step_execution_id}"))
    return StepDecision.force_complete({"count": ctx.get(Count)})


@rpc(request_type=str, locks=(L,))
async def grab(ctx: RpcContext, token: str) -> RPCResult[str]:
    ctx.set(Count, (ctx.get(Count) or 0) + 1)
    ctx.publish(Box, token)
    return RPCResult(f"granted {token}", next_steps=(Movement("Hold", None),))


@rpc(request_type=type(None))
async def peek(ctx: RpcContext, _: None) -> list[str]:
    return [str(m.value) for m in ctx.pending(Box)]


LOCKS = Flow(
    "PgfLocks",
    [
        Step("Idle", _idle, wait_for=_idle_wait, input_type=type(None), options=FAULT_OPTIONS),
        Step("Hold", _hold, input_type=type(None),
             options=StepOptions(execute_retry=FAULT_RETRY, execute_locks=(L,))),
    ],
    start_step="Idle", schema=[Count, L, Go, Box], rpcs=[grab, peek],
)


# Probe: one Step that stops before its first heartbeat, blocking its whole worker (no yield), so
# nothing the worker does after its claim reaches the server until the test releases it.
async def _grab_blocking(ctx: Context, _: None) -> StepDecision:
    gate = FileGate(_state_dir(), f"probe.{ctx.flow_id}")
    gate.mark_reached()
    gate.wait_released_blocking(0.005)
    await _started(ctx)
    return StepDecision.graceful_complete(os.getpid())


PROBE = Flow("PgfProbe", [Step("Grab", _grab_blocking, input_type=type(None), options=FAULT_OPTIONS)],
             start_step="Grab")


# The probe after an ASYNC Step, whose commit (synchronous_commit off) claims Grab-1 for its worker
# in the same transaction: handing out a claim must make that transaction durable all the same.
async def _hand_on(ctx: Context, _: None) -> StepDecision:
    return StepDecision.go_to("Grab", None)


PROBE_AFTER_ASYNC = Flow("PgfProbeAfterAsync", [
    Step("Quick", _hand_on, input_type=type(None),
         options=StepOptions(execute_retry=FAULT_RETRY, durability=StepDurability.ASYNC)),
    Step("Grab", _grab_blocking, input_type=type(None), options=FAULT_OPTIONS),
], start_step="Quick")


# Mix: Begin publishes two messages and starts two branches. Take consumes Box (at_least(1)) until it
# sees the end token, then completes with every token it consumed, in order. Tick-1..Tick-n each wait
# for a 1 s timer and record that it fired; their Execute holds lock Notes. RPC `note` (lock set
# Notes) appends a token to Notes and publishes it on MixBox, in one transaction.
Got: Attribute[list[str]] = Attribute("Got", list[str])
Fired: Attribute[list[str]] = Attribute("Fired", list[str])
Notes: Attribute[list[str]] = Attribute("Notes", list[str])
MixBox: Channel[str] = Channel("MixBox", str)
INTERNAL_MESSAGES = 2
END = "end"


async def _begin(ctx: Context, ticks: int) -> StepDecision:
    await _started(ctx)
    for i in range(1, INTERNAL_MESSAGES + 1):
        ctx.publish(MixBox, f"{ctx.flow_id}/in{i}")
    return StepDecision.go_to_many(("Take", None), ("Tick", [1, ticks]))


async def _take_wait(ctx: Context, _: None) -> Wait:
    await _started(ctx)
    return Wait.until(MixBox.at_least(1))


async def _take(ctx: Context, _: None) -> StepDecision:
    await _started(ctx)
    assert ctx.wait_result is not None
    got = [*(ctx.get(Got) or []), *ctx.wait_result.messages(MixBox)]
    ctx.set(Got, got)
    if any(token.endswith(f"/{END}") for token in got):
        return StepDecision.graceful_complete(got)
    return StepDecision.go_to("Take", None)


async def _tick_wait(ctx: Context, _: list[int]) -> Wait:
    await _started(ctx)
    return Wait.until(Timer.by_duration(1))


async def _tick(ctx: Context, position: list[int]) -> StepDecision:
    await _started(ctx)
    fired = ctx.wait_result is not None and ctx.wait_result.timer_fired
    ctx.set(Fired, [*(ctx.get(Fired) or []), ctx.step_execution_id if fired else f"{ctx.step_execution_id}?"])
    i, n = position
    return StepDecision.go_to("Tick", [i + 1, n]) if i < n else StepDecision.dead_end()


@rpc(request_type=str, locks=(Notes,))
async def note(ctx: RpcContext, token: str) -> int:
    notes = [*(ctx.get(Notes) or []), token]
    ctx.set(Notes, notes)
    ctx.publish(MixBox, token)
    return len(notes)


MIX = Flow(
    "PgfMix",
    [
        Step("Begin", _begin, input_type=int, options=FAULT_OPTIONS),
        Step("Take", _take, wait_for=_take_wait, input_type=type(None), options=FAULT_OPTIONS),
        Step("Tick", _tick, wait_for=_tick_wait, input_type=list[int],
             options=StepOptions(execute_retry=FAULT_RETRY, wait_for_retry=FAULT_RETRY, execute_locks=(Notes,))),
    ],
    start_step="Begin", schema=[Got, Fired, Notes, MixBox], rpcs=[note],
)

async def _go(ctx: Context, _: None) -> StepDecision:
    return StepDecision.graceful_complete(ctx.attempt)


QUICK = Flow("PgfQuick", [Step("Go", _go, input_type=type(None))], start_step="Go")

# PgfLong's handler runs until it is cancelled; the test process records each start and each
# cancellation here (lists, not an asyncio.Event: each test runs on an event loop of its own).
long_started: list[str] = []
long_cancelled: list[str] = []


async def _run_long(ctx: Context, _: None) -> StepDecision:
    long_started.append(ctx.flow_id)
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        long_cancelled.append(ctx.flow_id)
        raise
    return StepDecision.graceful_complete()  # not reached


LONG = Flow("PgfLong", [Step("Run", _run_long, input_type=type(None))], start_step="Run")


async def _slow_timer_wait(ctx: Context, _: None) -> Wait:
    await asyncio.sleep(0.3)  # quiet polls keep an answer taken before this Step's commit
    return Wait.until(Timer.by_duration(1))


TIMED = Flow("PgfTimed", [Step("Fire", _go, wait_for=_slow_timer_wait, input_type=type(None))], start_step="Fire")

REGISTRY = Registry([CHAIN, LOCKS, PROBE, PROBE_AFTER_ASYNC, MIX, QUICK, LONG, TIMED])


# A PostgreSQL wire-protocol proxy that can stop or cut a chosen COMMIT --------------------------

_SSL_REQUEST, _GSSENC_REQUEST = 80877103, 80877104


@dataclass(eq=False)
class CommitRule:
    """Matches the first COMMIT of a transaction that ran every `sql` fragment and bound `param`.

    "hold": the COMMIT waits in the proxy until `release()`; `hit` resolves when it arrives.
    "cut": the COMMIT goes through; its reply is dropped with the connection; `hit` resolves then.
    With `hold_new_after`, the proxy stops admitting new connections the moment the rule fires.
    """

    action: Literal["hold", "cut"]
    sql: tuple[str, ...]
    param: bytes | None
    hold_new_after: bool
    hit: asyncio.Future[ProxyConn]
    released: asyncio.Event = field(default_factory=asyncio.Event)
    fired: bool = False
    reply: bytes = b""  # for "cut": b"C" when the dropped reply said COMMIT, b"E" when it was an error

    def matches(self, statements: list[tuple[str, bytes]]) -> bool:
        if not all(any(part in sql for sql, _ in statements) for part in self.sql):
            return False
        return self.param is None or any(self.param in params for _, params in statements)

    def release(self) -> None:
        self.released.set()


class ProxyConn:
    """One proxied connection: tracks its backend pid and the statements of its open transaction."""

    def __init__(self, proxy: PgProxy, cr: asyncio.StreamReader, cw: asyncio.StreamWriter,
                 sr: asyncio.StreamReader, sw: asyncio.StreamWriter) -> None:
        self.proxy = proxy
        self.cr, self.cw, self.sr, self.sw = cr, cw, sr, sw
        self.backend_pid: int | None = None
        self.prepared: dict[bytes, str] = {}
        self.statements: list[tuple[str, bytes]] = []  # (SQL, Bind message) of the open transaction
        self.cutting: CommitRule | None = None

    def abort(self) -> None:
        for writer in (self.cw, self.sw):
            writer.transport.abort()

    async def run(self) -> None:
        up = asyncio.create_task(self._client_to_server())
        down = asyncio.create_task(self._server_to_client())
        try:
            await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.abort()
            for task in (up, down):
                task.cancel()
            await asyncio.gather(up, down, return_exceptions=True)

    async def _client_to_server(self) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            size = await self.cr.readexactly(4)
            startup = await self.cr.readexactly(int.from_bytes(size, "big") - 4)
            if int.from_bytes(startup[:4], "big") in (_SSL_REQUEST, _GSSENC_REQUEST):
                raise AssertionError("connect through PgProxy with sslmode=disable and gssencmode=disable")
            self.sw.write(size + startup)
            while True:
                header = await self.cr.readexactly(5)
                body = await self.cr.readexactly(int.from_bytes(header[1:], "big") - 4)
                kind = header[:1]
                # A statement runs from a simple Query, or from a Bind (extended protocol, pipelines).
                statement: tuple[str, bytes] | None = None
                if kind == b"Q":
                    statement = (body[:-1].decode(errors="replace"), b"")
                elif kind == b"P":  # Parse: statement name, SQL
                    name, rest = body.split(b"\0", 1)
                    self.prepared[name] = rest.split(b"\0", 1)[0].decode(errors="replace")
                elif kind == b"B":  # Bind: portal, statement name, parameter values
                    _portal, rest = body.split(b"\0", 1)
                    name, params = rest.split(b"\0", 1)
                    statement = (self.prepared.get(name, ""), params)
                if statement is not None:
                    head = statement[0].lstrip()[:8].upper()
                    if head.startswith("COMMIT"):
                        rule = self.proxy.match(self.statements)
                        self.statements = []
                        if rule is not None:
                            await self._apply(rule, header + body)
                            continue
                    elif head.startswith(("BEGIN", "ROLLBACK")):
                        self.statements = []
                    else:
                        self.statements.append(statement)
                self.sw.write(header + body)
                await self.sw.drain()

    async def _apply(self, rule: CommitRule, commit: bytes) -> None:
        if rule.action == "hold":
            rule.hit.set_result(self)
            await rule.released.wait()
        else:
            self.cutting = rule  # set before the COMMIT leaves: its reply is the next server message
        self.sw.write(commit)
        await self.sw.drain()

    async def _server_to_client(self) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                header = await self.sr.readexactly(5)
                body = await self.sr.readexactly(int.from_bytes(header[1:], "big") - 4)
                if header[:1] == b"K":  # BackendKeyData: the server process serving this connection
                    self.backend_pid = int.from_bytes(body[:4], "big")
                if self.cutting is not None:
                    # The reply to the COMMIT: drop it. Once the server is ready for the next query
                    # (it has processed the COMMIT), drop the connection too.
                    rule = self.cutting
                    if header[:1] == b"E" or (header[:1] == b"C" and body.startswith(b"COMMIT")):
                        rule.reply += header[:1]
                    if header[:1] != b"Z":
                        continue
                    self.cutting = None
                    if rule.hold_new_after:
                        self.proxy.admit.clear()
                    self.abort()
                    rule.hit.set_result(self)
                    return
                self.cw.write(header + body)
                await self.cw.drain()


class PgProxy:
    """A TCP proxy to one PostgreSQL server that places faults at chosen COMMITs."""

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.rules: list[CommitRule] = []
        self.conns: set[ProxyConn] = set()
        self.admit = asyncio.Event()  # cleared: new connections wait (they are not refused)
        self.admit.set()
        self.refusing = False  # set: new connections are closed at once, as by a server that is down
        self.port = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> PgProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        self.admit.set()
        for rule in self.rules:
            rule.release()
        for conn in list(self.conns):
            conn.abort()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    def url(self, db_url: str) -> str:
        """`db_url` reaching its database through this proxy."""
        parts = urlsplit(db_url)
        netloc = f"{parts.username}@127.0.0.1:{self.port}" if parts.username else f"127.0.0.1:{self.port}"
        query = "&".join(filter(None, [parts.query, "sslmode=disable", "gssencmode=disable"]))
        return urlunsplit(parts._replace(netloc=netloc, query=query))

    def arm(self, action: Literal["hold", "cut"], *sql: str, param: str | None = None,
            hold_new_after: bool = False) -> CommitRule:
        rule = CommitRule(action, sql, None if param is None else param.encode(), hold_new_after,
                          asyncio.get_running_loop().create_future())
        self.rules.append(rule)
        return rule

    def match(self, statements: list[tuple[str, bytes]]) -> CommitRule | None:
        for rule in self.rules:
            if not rule.fired and rule.matches(statements):
                rule.fired = True
                return rule
        return None

    async def _accept(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await self.admit.wait()
            if self.refusing:
                cw.transport.abort()
                return
            try:
                sr, sw = await asyncio.open_connection(*self.upstream)
            except OSError:
                cw.transport.abort()
                return
            conn = ProxyConn(self, cr, cw, sr, sw)
            self.conns.add(conn)
            try:
                await conn.run()
            finally:
                self.conns.discard(conn)
        finally:
            self._tasks.discard(task)


# SQL fragments that identify a transaction (the store's statements, as the server receives them).
CLAIM_SQL = ("SET state = 'running', lease_owner",)
WAIT_COMMIT_SQL = ("SELECT t.state, t.lease_epoch", "SET state = 'waiting'")
EXECUTE_COMMIT_SQL = ("dex_commit_execute(",)  # the batched Execute commit (_pg_store._commit_executes)
PUBLISH_SQL = ("INSERT INTO channel_messages",)
START_SQL = ("INSERT INTO flows",)


# Servers and databases ------------------------------------------------------------------------


def _require_pg() -> str:
    dsn = os.environ.get("TEST_PG_DSN")
    if not dsn:
        pytest.skip(NO_PG_REASON)
    return dsn


def _dbname(url: str) -> str:
    return urlsplit(url).path.lstrip("/")


def terminate_backends(admin_url: str, dbname: str) -> list[int]:
    """pg_terminate_backend every session on `dbname`; return the pids it terminated."""
    import psycopg

    with psycopg.connect(admin_url, autocommit=True) as admin:
        rows = admin.execute(
            "SELECT pid, pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = %s AND pid <> pg_backend_pid()",
            (dbname,),
        ).fetchall()
    return [int(pid) for pid, ok in rows if ok]


PG_BIN = Path("/usr/lib/postgresql/15/bin")


class PrivateServer:
    """A PostgreSQL instance of this test module alone, which it may crash and restart at will.

    Settings: fsync and synchronous_commit on (durability is under test); autovacuum, the
    background writer's LRU writes and the WAL writer's timed flushes (every 10 s) out of the way,
    so WAL reaches the OS only through the engine's own commits: a commit made with
    synchronous_commit = off and not yet flushed by a later synchronous one is lost in a crash, as
    PostgreSQL documents, instead of by luck of timing.
    """

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="dex-pgfault-", dir="/tmp"))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.restarts = 0
        if os.geteuid() == 0:
            # initdb and postgres refuse to run as root; the directory must belong to postgres.
            shutil.chown(self.root, "postgres", "postgres")

    def _run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        cmd = [*(["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []), *args]
        return subprocess.run(cmd, cwd="/", capture_output=True, text=True, check=check, timeout=120)

    def init(self) -> None:
        self._run(str(PG_BIN / "initdb"), "-D", str(self.data), "-U", "postgres", "-E", "UTF8", "--locale=C",
                  "--no-instructions", "--auth-local=trust", "--auth-host=trust", "--no-sync")
        conf = f"""
listen_addresses = '127.0.0.1'
port = {self.port}
unix_socket_directories = '{self.root}'
max_connections = 100
shared_buffers = 32MB
fsync = on
synchronous_commit = on
full_page_writes = on
recovery_init_sync_method = syncfs
autovacuum = off
bgwriter_lru_maxpages = 0
wal_writer_delay = 10000ms
"""
        self._run("sh", "-c", f"cat >> '{self.data}/postgresql.conf' <<'EOF'\n{conf}EOF\n")
        self.start()

    def start(self) -> None:
        try:
            self._run(str(PG_BIN / "pg_ctl"), "start", "-D", str(self.data), "-l", str(self.log), "-w", "-t", "60")
        except subprocess.CalledProcessError as exc:
            tail = self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""
            raise AssertionError(f"private PostgreSQL did not start: {exc.stderr}\n{tail}") from None

    def crash(self) -> None:
        """Stop at once, as a crash: no checkpoint, WAL buffers not written (pg_ctl stop -m immediate)."""
        self._run(str(PG_BIN / "pg_ctl"), "stop", "-D", str(self.data), "-m", "immediate", "-w", "-t", "60")

    def crash_and_restart(self) -> None:
        self.crash()
        self.start()
        self.restarts += 1

    def destroy(self) -> None:
        self._run(str(PG_BIN / "pg_ctl"), "stop", "-D", str(self.data), "-m", "immediate", "-w", check=False)
        shutil.rmtree(self.root, ignore_errors=True)

    def url(self, dbname: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}"

    def create_database(self) -> str:
        import psycopg

        name = f"dex_f_{os.urandom(4).hex()}"
        with psycopg.connect(self.url("postgres"), autocommit=True) as admin:
            admin.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)


@pytest.fixture(scope="module")
def private_pg() -> Iterator[PrivateServer]:
    """A private PostgreSQL 15 instance (initdb in /tmp), stopped and removed after the module."""
    _require_pg()
    if not (PG_BIN / "initdb").exists():
        pytest.fail(f"PostgreSQL 15 is not installed at {PG_BIN} (TEST_PG_DSN is set; .ci/pg-start installs it)")
    server = PrivateServer()
    try:
        server.init()
        yield server
    finally:
        server.destroy()


# Test-side helpers ----------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def client_for(url: str, *, pool_size: int | None = None) -> AsyncIterator[AsyncClient]:
    # Opened on a thread: it connects (and migrates) synchronously, and through a PgProxy that needs
    # this event loop to answer.
    if pool_size is None:
        store: Store = await asyncio.to_thread(open_store, url)
    else:
        from dex_engine._pg_store import PostgresStore

        store = await asyncio.to_thread(PostgresStore, url, pool_size=pool_size)
    try:
        yield AsyncClient(REGISTRY, store=store)
    finally:
        await store.close()


def start_worker(procs: ProcSet, name: str, **options: Any) -> WorkerProcess:
    """A worker child running this module's Flows on the ProcSet's database URL."""
    options = {"lease_ttl": 5.0, "lease_renew": 0.5, "housekeeping": 0.1, "gate_log": False, **options}
    return procs.start(name, registry=REGISTRY_SPEC, **options)


def proxy_to(db_url: str) -> PgProxy:
    parts = urlsplit(db_url)
    return PgProxy(parts.hostname or "127.0.0.1", parts.port or 5432)


def scheduled(history: list[HistoryEntry]) -> list[str]:
    return [h.step_execution_id for h in history if h.event_type == "step_scheduled"]


def starts(entries: list[Invocation], flow_id: str) -> list[tuple[str, str, int]]:
    """(step execution, method, attempt) of each logged start of a flow, in log order."""
    return [(e.step_execution_id, e.method, e.attempt) for e in entries if e.flow_id == flow_id and e.phase == "start"]


COMMIT_EVENTS = {"wait_registered": "wait_for", "execute_completed": "execute"}  # history event -> method


def assert_committed_attempts_started_once(entries: list[Invocation], flow_id: str,
                                           history: list[HistoryEntry]) -> None:
    """E2/E3: each committed method committed once, by an attempt that started exactly once."""
    committed = [(h.step_execution_id, COMMIT_EVENTS[h.event_type], h.attempt)
                 for h in history if h.event_type in COMMIT_EVENTS]
    twice = {k: n for k, n in Counter(m[:2] for m in committed).items() if n > 1}
    assert not twice, f"methods of {flow_id} committed more than once: {twice}"
    logged = Counter(starts(entries, flow_id))
    for key in committed:
        assert logged[key] == 1, f"{flow_id}: {key} committed; its logged starts: {logged[key]}"


# Worker connections killed or cut at the claim and commit points ------------------------------


POINTS = {
    "claim": CLAIM_SQL,  # the first claim of the flow: A's Execute
    "wait_for_commit": WAIT_COMMIT_SQL,  # B's WaitFor registering its wait
    "execute_commit": EXECUTE_COMMIT_SQL,  # A's Execute (it hands B to the same worker)
}


async def test_worker_connection_lost_at_claim_and_commit(pg_database: str, tmp_path: Path) -> None:
    """A worker's connection lost at each point of POINTS, once before its COMMIT, once after it.

    "terminate": the COMMIT is stopped in the proxy and the database's sessions killed with
    pg_terminate_backend (the worker's backend at that point among them): the transaction rolls
    back, the worker runs it again. "cut": the COMMIT reaches the server, the connection drops
    before its reply: the worker must learn that it committed. Each time the Chain completes with
    its exact output, every method committed once by an attempt that started once, and no attempt
    failed: a lost connection is not a failed attempt (E3: an attempt whose claim rolled back is
    handed out again as attempt 1).
    """
    dsn = _require_pg()
    async with proxy_to(pg_database) as proxy:
        with ProcSet(proxy.url(pg_database), tmp_path / "state") as procs:
            async with client_for(pg_database) as client:
                worker = start_worker(procs, "w1")
                for point, sql in POINTS.items():
                    for action in ("terminate", "cut"):
                        flow_id = f"{point}-{action}"
                        rule = proxy.arm("hold" if action == "terminate" else "cut", *sql, param=flow_id)
                        await client.start_flow("PgfChain", flow_id)
                        conn = await asyncio.wait_for(rule.hit, 60)
                        if action == "terminate":
                            assert conn.backend_pid is not None
                            killed = await asyncio.to_thread(terminate_backends, dsn, _dbname(pg_database))
                            assert conn.backend_pid in killed, (flow_id, conn.backend_pid, killed)
                            rule.release()  # the COMMIT now meets a dead backend
                        else:
                            assert rule.reply == b"C", f"{flow_id}: the cut COMMIT did not commit: {rule.reply!r}"
                        info = await client.wait_for_flow(flow_id, 60)
                        assert info.status == "completed", info
                        assert await client.flow_output(flow_id) == CHAIN_OUTPUT
                        history = await client.get_flow_history(flow_id)
                        assert not [h for h in history if h.event_type == "attempt_failed"], (flow_id, history)
                        entries = procs.invocations.read()
                        assert sorted(starts(entries, flow_id)) == [
                            ("A-1", "execute", 1), ("B-1", "execute", 1), ("B-1", "wait_for", 1),
                            ("C-1", "execute", 1),
                        ], (flow_id, entries)
                        assert_committed_attempts_started_once(entries, flow_id, history)
                        # A claim that rolled back was not taken for made: no attempt ran without it,
                        # which would have met the fencing only at its first heartbeat.
                        entered = [(e.step_execution_id, e.method, e.attempt) for e in entries
                                   if e.flow_id == flow_id and e.phase == "enter"]
                        assert sorted(entered) == sorted(starts(entries, flow_id)), (flow_id, entries)
                await worker.stop()


# RPCs and client operations whose COMMIT is killed or whose reply is lost --------------------


async def test_locked_rpc_faults_at_commit_while_a_step_takes_the_lock(pg_database: str, tmp_path: Path) -> None:
    """E7/E8: an RPC with lock set L reaches its COMMIT; before the client's store can try again or
    ask what happened, a Step takes L. The RPC commits fully and returns, or raises and commits
    nothing, never anything between.

    f1, reply lost: the COMMIT commits, its reply is lost, and the Step the RPC itself started
    takes L. The RPC must return its output (not raise RpcLockConflictError as if it had not
    committed), applied once. f2, backend killed: the COMMIT is stopped, the backend terminated
    (the transaction rolls back), and a Step started meanwhile takes L. The retry must validate
    again: RpcLockConflictError, and no count, no message, no Step of the RPC.
    """
    dsn = _require_pg()
    async with proxy_to(pg_database) as proxy:
        with ProcSet(pg_database, tmp_path / "state") as procs:
            # One connection in the proxied client's pool: after a lost connection it must open a new
            # one, which the proxy holds (`admit` cleared) until the Step has taken lock L.
            async with client_for(pg_database) as client, \
                    client_for(proxy.url(pg_database), pool_size=1) as proxied:
                worker = start_worker(procs, "w1")

                await client.start_flow("PgfLocks", "f1")
                rule = proxy.arm("cut", *PUBLISH_SQL, param="f1", hold_new_after=True)
                call = asyncio.create_task(proxied.rpc("f1", "grab", "t1"))
                await asyncio.wait_for(rule.hit, 60)
                assert rule.reply == b"C", f"the RPC's COMMIT did not commit: reply {rule.reply!r}"
                hold = procs.gate("hold.f1.Hold-1")
                await hold.wait_reached(60)  # Hold holds L now
                proxy.admit.set()
                assert await asyncio.wait_for(call, 60) == "granted t1"
                assert await client.get_attribute("f1", Count) == 1
                assert await client.rpc("f1", "peek") == ["t1"]
                with pytest.raises(RpcLockConflictError):
                    await client.rpc("f1", "grab", "t2")  # E7 still holds: L is held
                hold.release()
                assert (await client.wait_for_flow("f1", 60)).status == "completed"
                assert await client.flow_output("f1") == {"count": 1}
                assert scheduled(await client.get_flow_history("f1")) == ["Idle-1", "Hold-1"]

                await client.start_flow("PgfLocks", "f2")
                rule = proxy.arm("hold", *PUBLISH_SQL, param="f2")
                call = asyncio.create_task(proxied.rpc("f2", "grab", "t1"))
                conn = await asyncio.wait_for(rule.hit, 60)
                proxy.admit.clear()
                killed = await asyncio.to_thread(terminate_backends, dsn, _dbname(pg_database))
                assert conn.backend_pid in killed, (conn.backend_pid, killed)
                await client.publish("f2", Go, "go")  # Idle -> Hold, which takes L
                hold = procs.gate("hold.f2.Hold-1")
                await hold.wait_reached(60)
                proxy.admit.set()
                rule.release()
                with pytest.raises(RpcLockConflictError):
                    await asyncio.wait_for(call, 60)
                assert await client.get_attribute("f2", Count) is None
                assert await client.rpc("f2", "peek") == []
                hold.release()
                assert (await client.wait_for_flow("f2", 60)).status == "completed"
                assert await client.flow_output("f2") == {"count": None}
                assert scheduled(await client.get_flow_history("f2")) == ["Idle-1", "Hold-1"]

                assert_no_attempt_ran_twice(procs.invocations.read())
                await worker.stop()


@pytest.mark.parametrize("operation", ["start_flow", "publish", "rpc"])
async def test_client_commit_reply_lost_is_neither_repeated_nor_failed(
    pg_database: str, operation: str,
) -> None:
    """E1/E8: a client operation whose COMMIT reached the server but whose reply was lost returns
    normally, and its effect is there exactly once: one flow (no FlowAlreadyStartedError), one
    message, one RPC application."""
    async with proxy_to(pg_database) as proxy, client_for(pg_database) as client, \
            client_for(proxy.url(pg_database)) as proxied:
        if operation != "start_flow":
            await client.start_flow("PgfLocks", "f")
        rule = proxy.arm("cut", *(START_SQL if operation == "start_flow" else PUBLISH_SQL), param="f")
        if operation == "start_flow":
            await proxied.start_flow("PgfLocks", "f")
        elif operation == "publish":
            mid = await proxied.publish("f", Box, "t1")
            assert isinstance(mid, int)
        else:
            assert await proxied.rpc("f", "grab", "t1") == "granted t1"
        assert rule.hit.done() and rule.reply == b"C", f"no COMMIT was cut: {rule}"
        assert await client.exists("f")
        expected = {"start_flow": [], "publish": ["t1"], "rpc": ["t1"]}[operation]
        assert await client.rpc("f", "peek") == expected
        assert await client.get_attribute("f", Count) == (1 if operation == "rpc" else None)


# A claim lost in a server crash -------------------------------------------------------------


@pytest.mark.parametrize("flow_type", ["PgfProbe", "PgfProbeAfterAsync"])
async def test_claim_survives_server_crash(private_pg: PrivateServer, tmp_path: Path, flow_type: str) -> None:
    """A claim handed to a worker must be durable before the worker acts on it.

    The worker claims Grab-1 (by a poll, or in the commit of an ASYNC Step before it) and stops
    before its first heartbeat, so nothing after its claim reaches the server; the server then
    crashes (pg_ctl stop -m immediate) and restarts. The claim must still be there (Grab-1 running,
    not ready): a claim lost in the crash would let a second worker be handed Grab-1 attempt 1
    under the same lease epoch while the first still runs it, and both would pass fencing (E2) and
    run the same attempt (E3).
    """
    url = await asyncio.to_thread(private_pg.create_database)
    with ProcSet(url, tmp_path / "state") as procs:
        async with client_for(url) as client:
            await client.start_flow(flow_type, "p")
            w1 = start_worker(procs, "w1", lease_ttl=30.0, lease_renew=1.0)
            gate = procs.gate("probe.p")
            await gate.wait_reached(60)
            await asyncio.to_thread(private_pg.crash_and_restart)
            info = await client.describe_flow("p")
            steps = [(s.step_execution_id, s.state, s.attempt) for s in info.active_steps]
            assert steps == [("Grab-1", "running", 1)], f"the claim of Grab-1 did not survive the crash: {steps}"
            gate.release()
            info = await client.wait_for_flow("p", 60)
            assert info.status == "completed"
            assert await client.flow_output("p") == w1.pid
            assert starts(procs.invocations.read(), "p") == [("Grab-1", "execute", 1)]
            await w1.stop()


# A long outage ------------------------------------------------------------------------------

OUTAGE_SECONDS = 40.0  # psycopg_pool's tries after a failed connection: 0, 1, 3, 7, 15, 31, 63 s
RECONNECTED_WITHIN_SECONDS = 10.0  # the pool's next try would be about 23 s after this outage


async def test_the_store_is_back_within_seconds_of_a_long_outage(pg_database: str) -> None:
    """The server is unreachable for 40 s (every connection dropped, new ones refused), long enough
    for psycopg_pool's backoff between tries to reach 32 s. A publish asked during the outage
    waits it out, and completes within seconds of the server being reachable again, not at the
    pool's next try. Catches: a pool left to back off alone (an operation waited 55 s after a 70 s
    outage)."""
    async with proxy_to(pg_database) as proxy, client_for(pg_database) as client, \
            client_for(proxy.url(pg_database)) as proxied:
        await client.start_flow("PgfLocks", "f")
        assert await proxied.rpc("f", "peek") == []
        proxy.refusing = True
        for conn in list(proxy.conns):
            conn.abort()
        await asyncio.sleep(2)
        publish = asyncio.create_task(proxied.publish("f", Box, "t1"))
        await asyncio.sleep(OUTAGE_SECONDS - 2)
        assert not publish.done(), publish
        proxy.refusing = False
        back = time.monotonic()
        await asyncio.wait_for(publish, 120)
        waited = time.monotonic() - back
        assert waited < RECONNECTED_WITHIN_SECONDS, f"the publish completed {waited:.1f} s after the outage"
        assert await client.rpc("f", "peek") == ["t1"]


async def test_a_run_of_refused_transactions_leaves_the_store_working(pg_database: str) -> None:
    """The server refuses every transaction's first write for a while (a trigger here; a read-only
    switchover or a full disk in production), fifteen times in a row on the same connections: each
    publish fails with the server's error, and once writes are accepted again every publish works.
    Catches: BEGIN and ROLLBACK prepared by psycopg (after five uses) inside failing pipeline
    segments, its cache then out of step with the server, and a connection whose rollback failed
    given back as idle: every later operation of the process failed with InvalidSqlStatementName,
    for good."""
    import psycopg

    def sql(statement: str) -> None:
        with psycopg.connect(pg_database, autocommit=True) as conn:
            conn.execute(statement)

    async with client_for(pg_database) as client:
        await client.start_flow("PgfLocks", "f")
        await client.publish("f", Box, "before")
        sql("CREATE FUNCTION pgf_refuse() RETURNS trigger LANGUAGE plpgsql AS"
            " $$ BEGIN RAISE EXCEPTION 'refused for a moment'; END $$")
        sql("CREATE TRIGGER pgf_refuse BEFORE INSERT OR UPDATE ON commit_marks"
            " FOR EACH ROW EXECUTE FUNCTION pgf_refuse()")
        for attempt in range(15):
            with pytest.raises(psycopg.errors.RaiseException, match="refused for a moment"):
                await client.publish("f", Box, f"refused {attempt}")
        sql("DROP TRIGGER pgf_refuse ON commit_marks")
        for attempt in range(6):
            await client.publish("f", Box, f"after {attempt}")
        assert await client.rpc("f", "peek") == ["before", *(f"after {n}" for n in range(6))]


async def test_a_refusal_after_refusals_in_a_row_leaves_the_store_working(pg_database: str) -> None:
    """Two transactions refused in a row (the second rolled back with nothing prepared), writes
    accepted again for a while (statements prepared anew), then one more refusal: every write
    after it still works, on every connection of the pool. Catches: the lane's ROLLBACK and
    DEALLOCATE ALL seen by psycopg only the first time (its cache of statements to watch kept
    them), so that a later rollback deallocated every statement on the server while psycopg took
    them for prepared, and the connection failed each one with InvalidSqlStatementName for good
    (under contention on one flow, a batch's lock timeout followed by its ops' retries)."""
    import psycopg

    def sql(statement: str) -> None:
        with psycopg.connect(pg_database, autocommit=True) as conn:
            conn.execute(statement)

    async with client_for(pg_database, pool_size=1) as client:
        await client.start_flow("PgfLocks", "f")
        sql("CREATE FUNCTION pgf_refuse() RETURNS trigger LANGUAGE plpgsql AS"
            " $$ BEGIN RAISE EXCEPTION 'refused for a moment'; END $$")
        expected = []
        for refusals in (2, 1):
            sql("CREATE TRIGGER pgf_refuse BEFORE INSERT OR UPDATE ON commit_marks"
                " FOR EACH ROW EXECUTE FUNCTION pgf_refuse()")
            for attempt in range(refusals):
                with pytest.raises(psycopg.errors.RaiseException, match="refused for a moment"):
                    await client.publish("f", Box, f"refused {refusals} {attempt}")
            sql("DROP TRIGGER pgf_refuse ON commit_marks")
            for attempt in range(6):
                await client.publish("f", Box, f"after {refusals} {attempt}")
                expected.append(f"after {refusals} {attempt}")
        assert await client.rpc("f", "peek") == expected


async def test_an_operation_that_never_gets_a_connection_says_so(
    pg_database: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The server stays unreachable through every try of an operation: it fails with an error naming
    the database, the time waited and the tries, and what to check. Catches: the pool's own
    PoolTimeout ('couldn't get a connection after 1.99 sec') raised after minutes of waiting."""
    import psycopg_pool

    from dex_engine import _pg_store

    monkeypatch.setattr(_pg_store, "CONNECTION_WAIT_SECONDS", 1.0)
    monkeypatch.setattr(_pg_store, "MAX_OP_TRIES", 2)
    async with proxy_to(pg_database) as proxy, client_for(proxy.url(pg_database)) as client:
        await client.start_flow("PgfLocks", "f")
        proxy.refusing = True
        for conn in list(proxy.conns):
            conn.abort()
        with pytest.raises(psycopg_pool.PoolTimeout) as caught:
            await asyncio.wait_for(client.publish("f", Box, "t1"), 60)
        message = str(caught.value)
        assert message.startswith(f"no connection to {_pg_store.shown_url(proxy.url(pg_database))!r} in "), message
        assert "s (2 tries): the server refused or did not answer" in message, message
        assert "check that the server is running and reachable" in message, message


async def test_a_worker_stopped_during_an_outage_ends_within_its_grace(
    pg_database: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The server becomes unreachable while a worker runs a long attempt, and the worker is then
    stopped (SIGTERM from systemd or Kubernetes, which SIGKILL it after their own timeout): it must
    end about its shutdown grace after the stop, the attempt revoked at the grace as usual, not
    once the poll in flight and its removal from the workers table have waited out every try of a
    lost connection (here 4 tries of 4 s each; by default 8 of up to 30 s). A stopping worker's
    own operations give up at their next ask for a connection (every CONNECTION_ASK_SECONDS); its
    row, left, expires as a dead worker's. Catches: a stop whose grace starts only after the poll
    in flight gave up, and then waits for every try of the worker's removal (29 s here); and a
    store that, closed after it (as a worker closes a store it opened), waits for those tries."""
    from dex_engine import _pg_store

    monkeypatch.setattr(_pg_store, "CONNECTION_WAIT_SECONDS", 4.0)
    monkeypatch.setattr(_pg_store, "MAX_OP_TRIES", 4)
    asks = 2 * _pg_store.CONNECTION_ASK_SECONDS  # the poll's (within the grace) and the removal's
    grace = 1.0
    long_started.clear()
    long_cancelled.clear()
    async with proxy_to(pg_database) as proxy, client_for(pg_database) as client:
        url = proxy.url(pg_database)
        store: Store = await asyncio.to_thread(open_store, url)
        worker = AsyncWorker(REGISTRY, WorkerOptions(
            database_url=url, poll_seconds=0.01, housekeeping_seconds=0.1, lease_ttl_seconds=300.0,
            lease_renew_seconds=100.0, shutdown_grace_seconds=grace), store=store)
        polls = count_polls(monkeypatch)
        try:
            await worker.__aenter__()
            await client.start_flow("PgfLong", "long")
            await eventually("the long attempt started", lambda: long_started == ["long"])
            proxy.refusing = True
            for conn in list(proxy.conns):
                conn.abort()
            sent = len(polls)
            await eventually("a poll sent during the outage", lambda: len(polls) > sent)
            await asyncio.sleep(0.5)  # it meets the refused connections and retries
            stopped_at = time.monotonic()
            await asyncio.wait_for(worker.stop(), 60)
            took = time.monotonic() - stopped_at
            assert long_cancelled == ["long"], "the running attempt was not revoked at the grace"
            assert took < grace + asks + 2.0, f"the worker ended {took:.1f} s after its stop; its grace is {grace} s"
            closed_at = time.monotonic()
            await asyncio.wait_for(store.close(), 60)
            took = time.monotonic() - closed_at
            assert took < asks + 2.0, f"the worker's store took {took:.1f} s to close"
        finally:
            await worker.stop()
            proxy.refusing = False
            await store.close()



@pytest.mark.parametrize("caller", ["cancelled", "waiting"])
async def test_a_client_closed_during_an_outage_ends_within_one_ask_for_a_connection(
    pg_database: str, monkeypatch: pytest.MonkeyPatch, caller: str,
) -> None:
    """The server becomes unreachable while a client's call is in flight; the call is cancelled
    (asyncio.timeout, a web request whose client left) or still waits, and the client is then
    closed (the app shuts down): the close ends within about one ask for a connection, and a call
    still waiting fails with the connection error (it did not take effect). Catches: the close
    waiting for the call's every try of a lost connection (here 4 tries of 4 s each; by default 8
    of up to 30 s, minutes), though nobody waited for it, so a service manager's stop timeout
    killed the process instead."""
    import psycopg

    from dex_engine import _pg_store

    monkeypatch.setattr(_pg_store, "CONNECTION_WAIT_SECONDS", 4.0)
    monkeypatch.setattr(_pg_store, "MAX_OP_TRIES", 4)
    async with proxy_to(pg_database) as proxy:
        # Opened on a thread: it connects through the proxy, which needs this event loop to answer.
        client = await asyncio.to_thread(AsyncClient, REGISTRY, proxy.url(pg_database))
        try:
            assert not await client.exists("before")
            proxy.refusing = True
            for conn in list(proxy.conns):
                conn.abort()
            call = asyncio.ensure_future(client.exists("during"))
            await asyncio.sleep(0.5)  # it meets the refused connections and retries
            if caller == "cancelled":
                call.cancel()
            closed_at = time.monotonic()
            await asyncio.wait_for(client.close(), 60)
            took = time.monotonic() - closed_at
            assert took < _pg_store.CONNECTION_ASK_SECONDS + 2.0, f"the client took {took:.1f} s to close"
            outcome = (await asyncio.gather(call, return_exceptions=True))[0]
            if caller == "waiting":
                assert isinstance(outcome, psycopg.OperationalError), outcome
        finally:
            proxy.refusing = False
            await client.close()


# Lock waits cut short by the server's lock_timeout ---------------------------------------------

LOCK_TIMEOUT_MS = 100  # set in the test's URL, as a DBA may set it for the database or its users


def _with_lock_timeout(url: str) -> str:
    return f"{url}?options={quote(f'-c lock_timeout={LOCK_TIMEOUT_MS}')}"


@contextlib.contextmanager
def flow_row_locked(url: str, flow_id: str) -> Iterator[None]:
    """Another session holds the flow's row lock (a stuck transaction, a DBA's query) meanwhile."""
    import psycopg

    with psycopg.connect(url) as conn:
        conn.execute("SELECT 1 FROM flows WHERE flow_id = %s FOR UPDATE", (flow_id,))
        yield
        conn.rollback()


async def test_an_operation_whose_lock_wait_timed_out_is_tried_again(pg_database: str) -> None:
    """An operation whose wait for a row lock the server's lock_timeout cut short runs again, after
    a backoff, and completes once the lock is free; after MAX_OP_TRIES it fails with the server's
    error and changed nothing. Catches: the first LockNotAvailable of a lone operation raised to
    the caller, tries without a pause between them, and a lone operation tried again without end."""
    import psycopg

    from dex_engine._pg_store import MAX_OP_TRIES

    async with client_for(pg_database) as client, client_for(_with_lock_timeout(pg_database)) as limited:
        await client.start_flow("PgfLocks", "f")
        with flow_row_locked(pg_database, "f"):
            publish = asyncio.create_task(limited.publish("f", Box, "t1"))
            # Longer than MAX_OP_TRIES lock waits back to back, shorter than them with the backoff.
            await asyncio.sleep((MAX_OP_TRIES + 4) * LOCK_TIMEOUT_MS / 1000)
            assert not publish.done(), publish
        await asyncio.wait_for(publish, 60)
        assert await client.rpc("f", "peek") == ["t1"]

        with flow_row_locked(pg_database, "f"), pytest.raises(psycopg.errors.LockNotAvailable, match="lock timeout"):
            await asyncio.wait_for(limited.publish("f", Box, "t2"), 60)
        assert await client.rpc("f", "peek") == ["t1"]


async def test_an_operation_waiting_for_a_row_lock_does_not_hold_up_other_flows(pg_database: str) -> None:
    """While one operation of a process waits for a flow's row lock, that process's operations on
    other flows go on in another of its connections, one after another, more of them than it has
    connections. Catches: a lane that stays asleep while the first one is stuck, so that every
    commit, heartbeat and poll of the process waits for the lock; and lanes that stop after one
    batch taken over, which leaves the operations after the first few waiting for the lock too."""
    from dex_engine._pg_store import DEFAULT_POOL_SIZE

    async with client_for(pg_database) as client:
        for flow_id in ("f", "g"):
            await client.start_flow("PgfLocks", flow_id)
        with flow_row_locked(pg_database, "f"):
            stuck = asyncio.create_task(client.publish("f", Box, "t1"))
            await asyncio.sleep(0.5)
            assert not stuck.done(), stuck
            sent = [f"g{n}" for n in range(DEFAULT_POOL_SIZE + 1)]
            for token in sent:
                await asyncio.wait_for(client.publish("g", Box, token), 30)
            assert await asyncio.wait_for(client.rpc("g", "peek"), 30) == sent
            assert not stuck.done(), stuck
        await asyncio.wait_for(stuck, 30)
        assert await client.rpc("f", "peek") == ["t1"]


async def test_a_batch_waiting_for_a_row_lock_lets_its_other_flows_operations_go_on(pg_database: str) -> None:
    """Operations queued at once on one connection go in one batch, which waits for a row lock only
    BATCH_LOCK_TIMEOUT_MS: when one of them needs a flow another session holds, the batch is run
    again one by one, so the operations on other flows complete while that one still waits. Catches:
    a batch that waits for the lock as long as it is held (no lock timeout in force, as when its
    statements run outside BEGIN, where SET LOCAL does nothing), holding up every operation in it."""
    async with client_for(pg_database) as client:
        for flow_id in ("f", "g"):
            await client.start_flow("PgfLocks", flow_id)
        with flow_row_locked(pg_database, "f"):
            # Queued in one go behind the first (which the lane may take alone): a batch with f's.
            others = [asyncio.create_task(client.publish("g", Box, f"g{n}")) for n in range(5)]
            stuck = asyncio.create_task(client.publish("f", Box, "t1"))
            more = [asyncio.create_task(client.publish("g", Box, f"g{n}")) for n in range(5, 10)]
            others += more
            done, _ = await asyncio.wait(others, timeout=3.0)
            assert len(done) == len(others), f"operations on g waited with the one on the locked flow: {len(done)} done"
            assert not stuck.done(), stuck
        await asyncio.wait_for(stuck, 30)
        assert sorted(await client.rpc("g", "peek")) == sorted(f"g{n}" for n in range(10))
        assert await client.rpc("f", "peek") == ["t1"]


async def test_a_lone_operation_waits_for_a_row_lock_as_long_as_it_is_held(pg_database: str) -> None:
    """A lone operation waits for a flow's row lock without a lock timeout of its own, however long
    another session holds it: here longer than MAX_OP_TRIES waits of the batch lock timeout and
    the backoff between them (about 2.1 s). Catches: the batch lock timeout (meant to break waits
    between batches) set for a lone operation too, which then fails with LockNotAvailable."""
    from dex_engine._pg_store import BATCH_LOCK_TIMEOUT_MS, MAX_OP_TRIES

    backoff = 1.3  # seconds slept between MAX_OP_TRIES tries: 0.01, 0.02, ... 0.64
    held = MAX_OP_TRIES * BATCH_LOCK_TIMEOUT_MS / 1000 + backoff + 1.0
    async with client_for(pg_database) as client:
        await client.start_flow("PgfLocks", "f")
        with flow_row_locked(pg_database, "f"):
            publish = asyncio.create_task(client.publish("f", Box, "t1"))
            await asyncio.sleep(held)
            assert not publish.done(), publish
        await asyncio.wait_for(publish, 30)
        assert await client.rpc("f", "peek") == ["t1"]


# A commit lost in a server crash, its transaction ID handed to another -----------------------


def _backend_xid(url: str, pid: int | None) -> int:
    """The transaction ID held by the server process `pid` (a fresh cluster: epoch 0)."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT backend_xid::text::bigint FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
    assert row is not None and row[0] is not None, f"server process {pid} holds no transaction ID"
    return int(row[0])


def _commit_transactions_until(url: str, xid: int) -> list[int]:
    """Commit transactions that each take an ID, until one has taken `xid`; their IDs."""
    import psycopg

    taken: list[int] = []
    with psycopg.connect(url, autocommit=True) as conn:
        while not taken or taken[-1] < xid:
            with conn.transaction():
                row = conn.execute("SELECT pg_current_xact_id()::text::bigint").fetchone()
                assert row is not None
                taken.append(int(row[0]))
    return taken


async def test_a_commit_lost_in_a_server_crash_is_not_mistaken_for_a_later_one(
    private_pg: PrivateServer,
) -> None:
    """E1/E8: the server crashes while a client's COMMIT is on its way, so the transaction is lost,
    and with it its transaction ID, which the restarted server hands to the next transaction. That
    one commits before the client asks about its own: the client must not report its publish done
    (the message would be lost), but publish again, so that the message is there exactly once."""
    url = await asyncio.to_thread(private_pg.create_database)
    async with proxy_to(url) as proxy, client_for(url) as client, client_for(proxy.url(url)) as proxied:
        await client.start_flow("PgfLocks", "f")
        rule = proxy.arm("hold", *PUBLISH_SQL, param="f")
        publish = asyncio.create_task(proxied.publish("f", Box, "t1"))
        held = await asyncio.wait_for(rule.hit, 30)
        xid = await asyncio.to_thread(_backend_xid, url, held.backend_pid)
        proxy.admit.clear()  # the client asks about its commit only once the ID was taken again
        await asyncio.to_thread(private_pg.crash_and_restart)
        taken = await asyncio.to_thread(_commit_transactions_until, url, xid)
        assert xid in taken, f"the restarted server did not hand out {xid} again: {taken}"
        proxy.admit.set()
        mid = await asyncio.wait_for(publish, 60)
        assert isinstance(mid, int)
        assert await client.rpc("f", "peek") == ["t1"]


async def test_a_commit_still_in_progress_when_asked_about_is_waited_for(pg_database: str) -> None:
    """E1: a client's connection drops while its COMMIT is still on its way (held in the proxy), so
    the server, asked about the transaction, reports it in progress. The client waits until it is
    over: here the COMMIT then arrives and commits, the publish returns, and its message is there
    once. Catches: an in-progress transaction taken for over, its commit mark not yet visible, so
    the client publishes again and the message is there twice."""
    import psycopg

    async with _publish_with_commit_held(pg_database) as (client, rule, held, publish):
        xid = await asyncio.to_thread(_backend_xid, pg_database, held.backend_pid)
        held.cw.transport.abort()  # the client's side only: the server's session stays in its transaction
        await asyncio.sleep(1.0)  # meanwhile the client asks about its transaction: in progress
        assert not publish.done(), publish
        rule.release()  # the COMMIT, and the rest of the pipeline the proxy had read, reach the server
        await asyncio.wait_for(publish, 60)
        with psycopg.connect(pg_database, autocommit=True) as conn:  # a test server's epoch is 0
            row = conn.execute("SELECT pg_xact_status(%s::text::xid8)", (str(xid),)).fetchone()
        assert row == ("committed",), f"the held transaction did not commit: {row}"
        assert await client.rpc("f", "peek") == ["t1"]


async def test_a_commit_whose_outcome_the_server_cannot_tell_is_reported_unknown_and_not_repeated(
    pg_database: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """E1: a client's connection drops while its COMMIT is on its way (held in the proxy), and the
    server reports the transaction in progress every time it is asked (fewer tries here). The
    publish raises CommitOutcomeUnknownError, saying it may have committed, and is not run again:
    once the COMMIT arrives the message is there once. Catches: the server's connection error
    raised as such (callers retry those, which would publish twice), or the operation run again."""
    import psycopg

    from dex_engine import CommitOutcomeUnknownError, _pg_store

    monkeypatch.setattr(_pg_store, "MAX_OP_TRIES", 2)  # the server is asked 4 times, over 0.15 s
    async with _publish_with_commit_held(pg_database) as (client, rule, held, publish):
        held.cw.transport.abort()
        with pytest.raises(CommitOutcomeUnknownError, match=r"^the connection to postgresql://.* was lost during "
                           r"COMMIT \(\w+: .*\) and the server could not say whether the transaction "
                           r"committed: it may have; read its effect before doing it again$") as raised:
            await asyncio.wait_for(publish, 30)
        assert isinstance(raised.value.__cause__, psycopg.OperationalError)
        assert not isinstance(raised.value, psycopg.Error)
        rule.release()
        for _ in range(100):
            if await client.rpc("f", "peek") == ["t1"]:
                break
            await asyncio.sleep(0.05)
        assert await client.rpc("f", "peek") == ["t1"]
        await asyncio.sleep(0.3)  # an operation run again would add its message by now
        assert await client.rpc("f", "peek") == ["t1"]



async def test_an_operation_whose_every_try_loses_its_connection_raises_and_writes_nothing(
    pg_database: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """E1: a client's connection drops, both ways, while its COMMIT is on its way (so the server
    rolls the transaction back), on the last try the store allows (MAX_OP_TRIES, one here). The
    publish raises the server's connection error, which callers may retry: the server said the
    transaction did not commit, and nothing of it is there; the next publish works. Catches: an
    operation reported failed that committed, or one reported done that did not."""
    import psycopg

    from dex_engine import CommitOutcomeUnknownError, _pg_store

    monkeypatch.setattr(_pg_store, "MAX_OP_TRIES", 1)
    async with _publish_with_commit_held(pg_database) as (client, _rule, held, publish):
        held.abort()  # the server's side too: the transaction never commits
        with pytest.raises(psycopg.OperationalError) as raised:
            await asyncio.wait_for(publish, 60)
        assert not isinstance(raised.value, CommitOutcomeUnknownError)
        assert await client.rpc("f", "peek") == []
        await client.publish("f", Box, "t2")
        assert await client.rpc("f", "peek") == ["t2"]

@contextlib.asynccontextmanager
async def _publish_with_commit_held(url: str) -> AsyncIterator[tuple[AsyncClient, CommitRule, Any, asyncio.Task[Any]]]:
    """Flow 'f' started; a publish of 't1' to it, through the proxy, whose COMMIT the proxy holds
    (the rule, and the held connection as `rule.hit` gives it); and a client that goes around."""
    async with proxy_to(url) as proxy, client_for(url) as client, client_for(proxy.url(url)) as proxied:
        await client.start_flow("PgfLocks", "f")
        rule = proxy.arm("hold", *PUBLISH_SQL, param="f")
        publish = asyncio.create_task(proxied.publish("f", Box, "t1"))
        held = await asyncio.wait_for(rule.hit, 30)
        yield client, rule, held, publish


# Mixed workload under random pg_terminate_backend and under server crashes -------------------


FLOWS = 4
TICKS = 2
CLIENT_MESSAGES = 3
CLIENT_NOTES = 2


@dataclass
class FlowLedger:
    """What the client knows it did to one flow: acknowledged and unknown-outcome tokens, in order."""

    flow_id: str
    acknowledged: list[str] = field(default_factory=list)  # publishes and RPCs that returned, in order
    noted: list[str] = field(default_factory=list)  # the RPCs among them
    unknown: list[str] = field(default_factory=list)  # the call raised a connection error: outcome unknown


def _is_connection_error(exc: BaseException) -> bool:
    import psycopg

    return isinstance(exc, psycopg.OperationalError)


async def _with_reconnects(what: str, op: Callable[[], Awaitable[T]], timeout: float = 90.0) -> T:
    """Run an idempotent operation (a read), again after connection errors, until `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await op()
        except Exception as exc:
            if not _is_connection_error(exc) or time.monotonic() > deadline:
                raise AssertionError(f"{what} failed: {exc!r}") from exc
            await asyncio.sleep(0.1)


async def _drive_flow(client: AsyncClient, ledger: FlowLedger, may_end: asyncio.Event) -> None:
    """Start the flow, publish messages and call RPCs at random moments, then send the end token."""
    f = ledger.flow_id
    retried_start = False
    while True:
        try:
            await client.start_flow("PgfMix", f, TICKS)
            break
        except FlowAlreadyStartedError:
            assert retried_start, f"{f} was started twice"
            break  # an earlier try committed, its reply was lost with the connection
        except Exception as exc:
            if not _is_connection_error(exc):
                raise
            retried_start = True
    actions = ["msg"] * CLIENT_MESSAGES + ["note"] * CLIENT_NOTES
    random.shuffle(actions)
    serial = 0
    for action in [*actions, "end"]:
        if action == "end":
            await may_end.wait()
        await asyncio.sleep(random.uniform(0.0, 0.8))
        while True:
            serial += 1
            token = f"{f}/{END}" if action == "end" else f"{f}/{action}{serial}"
            try:
                if action == "note":
                    await client.rpc(f, "note", token)
                    ledger.noted.append(token)
                else:
                    await client.publish(f, MixBox, token)
                ledger.acknowledged.append(token)
                break
            except (RpcLockConflictError, RpcContentionError):
                serial -= 1  # nothing committed (E7/E8): call again with the same token
                await asyncio.sleep(0.05)
            except Exception as exc:
                if not _is_connection_error(exc):
                    raise
                # The store could not learn whether it committed (that takes many lost connections in
                # a row). Try again under a fresh token; the unknown one may arrive at most once.
                assert action != "end", f"{f}: the end token's publish has an unknown outcome: {exc!r}"
                ledger.unknown.append(token)


async def _check_mixed_results(client: AsyncClient, ledgers: list[FlowLedger], entries: list[Invocation]) -> None:
    """Every flow's exact results, every message once, every timer once, every attempt once."""
    assert_no_attempt_ran_twice(entries)
    for ledger in ledgers:
        history = await client.get_flow_history(ledger.flow_id)
        try:
            await _check_mixed_flow(client, ledger, entries, history)
        except AssertionError as exc:
            events = "\n".join(f"  {h.step_execution_id} {h.event_type} #{h.attempt} {h.detail}" for h in history)
            raise AssertionError(f"{exc}\n{ledger}\nhistory:\n{events}") from None


async def _check_mixed_flow(client: AsyncClient, ledger: FlowLedger, entries: list[Invocation],
                            history: list[HistoryEntry]) -> None:
    f = ledger.flow_id
    info = await client.describe_flow(f)
    assert info.status == "completed", info
    got = await client.flow_output(f)
    assert got == await client.get_attribute(f, Got)
    counts = Counter(got)
    assert not [t for t, n in counts.items() if n > 1], f"{f}: messages consumed twice: {counts}"
    internal = [f"{f}/in{i}" for i in range(1, INTERNAL_MESSAGES + 1)]
    expected = set(internal) | set(ledger.acknowledged)
    assert expected <= set(got), f"{f}: messages never consumed: {expected - set(got)}"
    assert set(got) - expected <= set(ledger.unknown), f"{f}: unexpected messages {set(got) - expected}"
    # FIFO (E5): the client's tokens, sent one after another, and Begin's are each consumed in order.
    assert [t for t in got if t in set(ledger.acknowledged)] == ledger.acknowledged, f"{f}: {got}"
    assert [t for t in got if t in internal] == internal
    assert got[-1] == f"{f}/{END}"
    notes = await client.get_attribute(f, Notes) or []
    assert [t for t in notes if t not in ledger.unknown] == ledger.noted, f"{f}: RPC notes {notes}"
    assert set(notes) <= set(got), f"{f}: an RPC's note committed without its message: {notes}"
    assert await client.get_attribute(f, Fired) == [f"Tick-{i}" for i in range(1, TICKS + 1)]
    waits = Counter(h.step_execution_id for h in history if h.event_type == "wait_completed")
    assert all(waits[f"Tick-{i}"] == 1 for i in range(1, TICKS + 1)), f"{f}: timers fired {waits}"
    assert all(n == 1 for n in waits.values()), f"{f}: waits completed twice: {waits}"
    assert_committed_attempts_started_once(entries, f, history)


async def _mixed_workload(url: str, procs: ProcSet, inject: Callable[[asyncio.Event], Awaitable[None]],
                          enough_faults: Callable[[], bool]) -> None:
    """Two workers run FLOWS mixed flows while `inject` injects faults, until `enough_faults`; then
    the flows finish without faults and their results are checked."""
    workers = [start_worker(procs, f"w{i}", lease_ttl=3.0, lease_renew=0.5) for i in (1, 2)]

    def workers_alive() -> None:
        for worker in workers:
            assert worker.proc.poll() is None, f"{worker.name} died:\n{worker.output_text()[-4000:]}"

    async with client_for(url) as client:

        async def registered() -> bool:
            workers_alive()
            return len(await client.store.list_workers()) == len(workers)

        # Faults start once the workers run (opening a store is not retried: a worker that cannot
        # connect at startup exits, for its supervisor to restart it).
        await eventually("both workers registered", registered, 120)
        ledgers = [FlowLedger(f"mix{i}") for i in range(FLOWS)]
        may_end = asyncio.Event()
        stop = asyncio.Event()
        faults = asyncio.create_task(inject(stop))
        try:
            drivers = asyncio.gather(*(_drive_flow(client, ledger, may_end) for ledger in ledgers))

            def enough() -> bool:
                workers_alive()
                return enough_faults()

            await eventually("enough faults injected", enough, 120, 0.1)
            may_end.set()  # the end tokens go out as the last fault ends
        finally:
            stop.set()
            await faults  # a restart under way completes: the server is up from here on
        # A storm of lost connections can hold an operation back for a while (psycopg's pool waits
        # longer after each dead connection it finds); once it is over, every call completes.
        await asyncio.wait_for(drivers, 120)

        async def all_closed() -> bool:
            workers_alive()
            infos = [await client.describe_flow(ledger.flow_id) for ledger in ledgers]
            return all(i.status != "running" for i in infos)

        # The faults are over: every flow must now finish (the engine recovers by itself).
        try:
            await eventually("every flow closed", lambda: _with_reconnects("describe", all_closed), 120, 0.2)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{await _describe_open_flows(client, ledgers)}") from None
        for worker in workers:
            await worker.stop(60)  # a worker survives the faults and stops cleanly
        await _check_mixed_results(client, ledgers, procs.invocations.read())


async def _describe_open_flows(client: AsyncClient, ledgers: list[FlowLedger]) -> str:
    """The active Steps and last history events of each flow still open: why it did not finish."""
    lines = []
    for ledger in ledgers:
        info = await client.describe_flow(ledger.flow_id)
        if info.status == "running":
            history = await client.get_flow_history(ledger.flow_id)
            lines.append(f"{ledger}: active {info.active_steps}; last events {history[-6:]}")
    return "\n".join(lines)


async def _stopped(stop: asyncio.Event, pause: float) -> bool:
    """Wait `pause` seconds (the random moment of the next fault) or until `stop`; True once stopped."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), pause)
    return stop.is_set()


async def test_mixed_workload_under_random_backend_terminations(pg_database: str, tmp_path: Path) -> None:
    """pg_terminate_backend of every session of the database at random moments (every 0.3-1.2 s)
    while two workers run multi-Step flows, channel messages, timers and RPCs: every result exact,
    every message consumed once, every timer fired once, no attempt ran twice."""
    dsn = _require_pg()
    rounds: list[int] = []

    async def storm(stop: asyncio.Event) -> None:
        while not await _stopped(stop, random.uniform(0.3, 1.2)):
            killed = await asyncio.to_thread(terminate_backends, dsn, _dbname(pg_database))
            if killed:
                rounds.append(len(killed))

    with ProcSet(pg_database, tmp_path / "state") as procs:
        await _mixed_workload(pg_database, procs, storm, lambda: len(rounds) >= 10)


async def test_mixed_workload_under_server_crashes(private_pg: PrivateServer, tmp_path: Path) -> None:
    """The private server crashes (pg_ctl stop -m immediate) and restarts every 1-2.5 s while two
    workers run multi-Step flows, channel messages, timers and RPCs: every result exact, every
    message consumed once, every timer fired once (timers survive restarts, E6), no attempt ran
    twice, and both workers stop cleanly afterwards."""
    url = await asyncio.to_thread(private_pg.create_database)
    first = private_pg.restarts

    async def crashes(stop: asyncio.Event) -> None:
        while not await _stopped(stop, random.uniform(1.0, 2.5)):
            await asyncio.to_thread(private_pg.crash_and_restart)

    with ProcSet(url, tmp_path / "state") as procs:
        await _mixed_workload(url, procs, crashes, lambda: private_pg.restarts - first >= 3)


# An idle worker sleeps until a notification -------------------------------------------------

# Polls, housekeeping and renewal this far apart: only a notification (or the listener's call after
# it reconnects) can wake an idle worker within a test's wait.
QUIET_WORKER = {"poll_seconds": 0.01, "housekeeping_seconds": 60.0, "lease_ttl_seconds": 300.0,
                "lease_renew_seconds": 100.0}


@contextlib.asynccontextmanager
async def quick_worker(url: str, *flows: Flow) -> AsyncIterator[AsyncWorker]:
    store: Store = await asyncio.to_thread(open_store, url)
    worker = AsyncWorker(Registry(list(flows or (QUICK,))), WorkerOptions(database_url=url, **QUIET_WORKER),
                         store=store)
    try:
        async with worker:
            yield worker
    finally:
        await store.close()


def count_polls(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Every PostgresStore.poll from now on, as its must_claim flag."""
    from dex_engine._pg_store import PostgresStore

    polls: list[bool] = []
    real_poll = PostgresStore.poll

    async def counting_poll(self: PostgresStore, *args: Any, **kwargs: Any) -> Any:
        polls.append(kwargs["must_claim"])
        return await real_poll(self, *args, **kwargs)

    monkeypatch.setattr(PostgresStore, "poll", counting_poll)
    return polls


async def test_an_idle_worker_does_not_poll_and_wakes_on_a_notification(
    pg_database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With nothing running, a worker on PostgreSQL sends no polls (every poll_seconds they cost
    both sides CPU: about 16% of a core for the worker and 5% for its server process on this
    project's VM); another process's start of a flow wakes it through NOTIFY and the flow runs.
    Catches: an idle worker that still polls, and one that sleeps through the notification."""
    polls = count_polls(monkeypatch)
    async with quick_worker(pg_database), client_for(pg_database) as client:
        await asyncio.sleep(0.3)
        polls.clear()
        await asyncio.sleep(0.5)  # 50 poll intervals
        assert len(polls) <= 1, f"an idle worker polled {len(polls)} times in 0.5 s"
        for n in range(3):
            await client.start_flow("PgfQuick", f"q{n}")
            info = await client.wait_for_flow(f"q{n}", 20)
            assert info.status == "completed", info


async def test_an_idle_worker_is_woken_when_its_listener_reconnects(pg_database: str) -> None:
    """A flow started while the worker's listening connection is down sends a NOTIFY nobody hears;
    the listener, once connected again, wakes the worker, which claims it. Catches: a reconnected
    listener that only sets its flag, leaving an idle worker asleep until housekeeping (60 s)."""
    async with proxy_to(pg_database) as proxy, quick_worker(proxy.url(pg_database)), \
            client_for(pg_database) as client:
        await asyncio.sleep(0.3)
        proxy.refusing = True
        for conn in list(proxy.conns):
            conn.abort()
        await client.start_flow("PgfQuick", "missed")
        await asyncio.sleep(1.0)  # the listener's tries to reconnect are refused meanwhile
        assert (await client.describe_flow("missed")).status == "running"
        proxy.refusing = False
        info = await client.wait_for_flow("missed", 20)
        assert info.status == "completed", info


async def test_a_timer_of_a_worker_that_stops_is_fired_by_another_without_housekeeping(
    pg_database: str,
) -> None:
    """Process A registers a 1 s Timer and stops at once. Commits that register timers send no
    notification (the registering worker learns its own due times), so B, asleep since before the
    Timer existed, must hear of A's departure to learn it. B is full (max_concurrent_tasks=1, a long
    attempt running), so A is the one that runs the Step's WaitFor; housekeeping is a minute away.
    Catches a graceful stop that leaves another process's idle workers asleep past the Timer."""
    long_started.clear()
    a_store: Store = await asyncio.to_thread(open_store, pg_database)
    b_store: Store = await asyncio.to_thread(open_store, pg_database)
    b = AsyncWorker(REGISTRY, WorkerOptions(database_url=pg_database, max_concurrent_tasks=1, **QUIET_WORKER),
                    store=b_store)
    try:
        async with b, client_for(pg_database) as client:
            await client.start_flow("PgfLong", "long")
            await eventually("B runs the long attempt", lambda: long_started == ["long"])
            a = AsyncWorker(REGISTRY, WorkerOptions(database_url=pg_database, **QUIET_WORKER), store=a_store)
            async with a:
                await client.start_flow("PgfTimed", "timed")

                async def registered() -> bool:
                    return any(h.event_type == "wait_registered" for h in await client.get_flow_history("timed"))

                await eventually("A registered the Timer", registered)
            # A has stopped; only B is left, asleep with its long attempt.

            async def fired() -> bool:
                return any(h.event_type == "wait_completed" for h in await client.get_flow_history("timed"))

            await eventually("B fired A's Timer", fired, timeout=10.0)
            await client.stop_flow("long", "done")
            await client.stop_flow("timed", "done")
    finally:
        await a_store.close()
        await b_store.close()


async def test_a_worker_running_an_attempt_sleeps_until_a_revocation_wakes_it(
    pg_database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker running one long attempt (a model call) does not poll for its revocation: each poll
    every poll_seconds cost about 17% of a core for the worker and 6% for its server process on
    this project's VM as a statement, and still 7% answered without one. Another process's stop
    of the flow NOTIFYs dex_engine_revoked, which wakes it, and the attempt is cancelled at once; the
    fallback poll and housekeeping are a minute away here, so only that notification can do it.
    Catches a running worker that polls, and a revocation notification that wakes nobody."""
    from dex_engine import _pg_store

    monkeypatch.setattr(_pg_store, "FALLBACK_POLL_SECONDS", 60.0)
    polls = count_polls(monkeypatch)
    long_cancelled.clear()
    long_started.clear()
    async with quick_worker(pg_database, LONG), client_for(pg_database) as client:
        await client.start_flow("PgfLong", "long")
        await eventually("the long attempt started", lambda: long_started == ["long"])
        await asyncio.sleep(0.3)
        polls.clear()
        await asyncio.sleep(0.5)  # 50 poll intervals
        assert len(polls) <= 1, f"a worker running an attempt polled {len(polls)} times in 0.5 s"
        await client.stop_flow("long", "stopped by another process")

        async def cancelled() -> bool:
            return long_cancelled == ["long"]

        await eventually("the running attempt cancelled", cancelled)
