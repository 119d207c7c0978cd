"""Helpers for tests that run workers in child processes and kill, stop or resume them.

- `ProcSet.start(...)` runs `python -m engine.tests.worker_child` in its own process group (so a
  signal reaches the whole child and nothing else), with the database URL, crash gates and short
  lease timings in its environment.
- `FileGate`: a handler in the child marks the gate reached (a file) and polls for a release file;
  the test awaits "reached", then releases it, stops the child or kills it.
- `InvocationLog`: an append-only file (O_APPEND, fsync per line) where Step handlers record each
  invocation. It lives outside the database and survives SIGKILL: the ground truth of what ran.
- `GateLog`: reads the engine's DEX_ENGINE_GATE_LOG, to prove a targeted crash gate was reached.

The database is a `sqlite:///` file or a `postgresql://` database; the few places that look at the
database from outside the engine (freezing a child outside a write, the final integrity check) have
one branch per backend.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from dex_engine._limits import SQLITE_WRITER_TURN_SUFFIX

REPO_ROOT = Path(__file__).resolve().parents[2]
CHILD_MODULE = "engine.tests.worker_child"

# Environment of a worker child (read by worker_child.py).
ENV_DB_URL = "DEX_TEST_DB_URL"
ENV_STATE_DIR = "DEX_TEST_STATE_DIR"
ENV_LEASE_TTL = "DEX_TEST_LEASE_TTL"
ENV_LEASE_RENEW = "DEX_TEST_LEASE_RENEW"
ENV_HOUSEKEEPING = "DEX_TEST_HOUSEKEEPING"
ENV_MAX_TASKS = "DEX_TEST_MAX_TASKS"
ENV_HOLD = "DEX_TEST_HOLD"  # comma-separated Step types whose handlers wait at a FileGate
ENV_HOLD_YIELDS = "DEX_TEST_HOLD_YIELDS"  # "1": a held handler awaits its gate; the event loop runs on
ENV_LOG_FSYNC = "DEX_TEST_LOG_FSYNC"  # "0": do not fsync the invocation log (no crash in that test)
ENV_START_GATE = "DEX_TEST_START_GATE"  # a standby child imports everything, then waits for this FileGate
ENV_REGISTRY = "DEX_TEST_REGISTRY"  # "<module>:<name>" of a Registry the child runs instead of its own
ENV_CRASH_AT = "DEX_ENGINE_CRASH_AT"
ENV_GATE_LOG = "DEX_ENGINE_GATE_LOG"

INVOCATIONS_FILE = "invocations.log"
GATES_FILE = "gates.log"

# Lease timings of the crash tests: a dead worker is noticed within about 1 s plus a housekeeping pass.
SHORT_LEASE = {"lease_ttl": 1.0, "lease_renew": 0.25, "housekeeping": 0.1}


def is_sqlite(db_url: str) -> bool:
    return db_url.startswith("sqlite:")


def sqlite_path(db_url: str) -> str:
    """The file of a `sqlite:///...` URL (as the engine reads it)."""
    assert db_url.startswith("sqlite:///"), f"not a sqlite URL: {db_url}"
    return db_url[len("sqlite:///"):].split("?", 1)[0]


async def eventually(description: str, probe: Any, timeout: float = 20.0, interval: float = 0.02) -> Any:
    """Poll the synchronous or async `probe` until it returns a truthy value; fail naming `description`."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {description}; last value {value!r}")
        await asyncio.sleep(interval)


def _complete_lines(path: Path) -> list[str]:
    """The file's newline-terminated lines; a line still being written by a live child is left out."""
    if not path.exists():
        return []
    return [line for line in path.read_text().split("\n")[:-1] if line]


# Invocation log ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Invocation:
    """One line of the invocation log."""

    flow_id: str
    step_execution_id: str
    method: str
    attempt: int
    pid: int
    phase: str  # start (after a durable heartbeat), end (about to return), or a test-specific event
    detail: str = ""


class InvocationLog:
    """Append-only JSON lines; each line written with one O_APPEND write and (by default) fsynced."""

    def __init__(self, path: Path | str, *, fsync: bool = True) -> None:
        self.path = Path(path)
        self.fsync = fsync
        self._fd: int | None = None
        self._pid = -1

    def record(self, flow_id: str, step_execution_id: str, method: str, attempt: int, phase: str,
               detail: str = "") -> None:
        pid = os.getpid()
        if self._fd is None or self._pid != pid:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            self._pid = pid
        line = json.dumps(asdict(Invocation(flow_id, step_execution_id, method, attempt, pid, phase, detail)))
        # One write() per line: O_APPEND makes it atomic with respect to the other processes' lines.
        os.write(self._fd, (line + "\n").encode())
        if self.fsync:
            os.fsync(self._fd)

    def read(self) -> list[Invocation]:
        return [Invocation(**json.loads(line)) for line in _complete_lines(self.path)]

    def close(self) -> None:
        if self._fd is not None and self._pid == os.getpid():
            os.close(self._fd)
        self._fd = None


def starts_per_attempt(entries: list[Invocation]) -> Counter[tuple[str, str, str, int]]:
    """How many heartbeat-backed starts each (flow, step execution, method, attempt) logged."""
    return Counter((e.flow_id, e.step_execution_id, e.method, e.attempt) for e in entries if e.phase == "start")


def assert_no_attempt_ran_twice(entries: list[Invocation]) -> None:
    """INV-1: no started attempt ran twice under one attempt number."""
    twice = {k: n for k, n in starts_per_attempt(entries).items() if n > 1}
    assert not twice, f"attempts started more than once under one attempt number: {twice}"


# Gates --------------------------------------------------------------------------------------------


class FileGate:
    """A rendezvous between a handler in a child and the test, through two files in `state_dir`."""

    def __init__(self, state_dir: Path | str, name: str) -> None:
        self.name = name
        self.reached_path = Path(state_dir) / f"{name}.reached"
        self.release_path = Path(state_dir) / f"{name}.release"

    # Child side
    def mark_reached(self) -> None:
        # Write, then rename: the test must never see the file without the pid in it.
        tmp = self.reached_path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(str(os.getpid()))
        os.replace(tmp, self.reached_path)

    def wait_released_blocking(self, poll: float = 0.01) -> None:
        """Wait without yielding to the event loop: nothing else in the child's loop runs meanwhile."""
        while not self.release_path.exists():
            time.sleep(poll)

    async def wait_released(self, poll: float = 0.01) -> None:
        """Wait yielding to the event loop: the child's worker goes on renewing, polling and housekeeping."""
        # No deadline of its own: the test releases the gate or kills the child.
        await eventually(f"gate {self.name} released", self.release_path.exists, float("inf"), poll)

    # Test side
    async def wait_reached(self, timeout: float = 30.0) -> int:
        """Wait until a handler reached the gate; return the pid that reached it."""
        await eventually(f"gate {self.name} reached", self.reached_path.exists, timeout)
        return int(self.reached_path.read_text())

    def release(self) -> None:
        self.release_path.write_text("go")


class GateLog:
    """The engine's crash-gate log: one '<pid> <gate>' line per crossing (DEX_ENGINE_GATE_LOG)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def crossings(self, pid: int | None = None) -> list[str]:
        out = []
        for line in _complete_lines(self.path):
            p, _, gate = line.partition(" ")
            if pid is None or int(p) == pid:
                out.append(gate)
        return out

    def assert_died_at(self, pid: int, gate: str, k: int) -> None:
        """The process `pid` crossed `gate` exactly k times and that crossing was its last act."""
        seen = self.crossings(pid)
        assert seen.count(gate) == k and seen[-1] == gate, (
            f"pid {pid} was to die on crossing {k} of {gate}; its gate log is {seen}"
        )


# Worker children ----------------------------------------------------------------------------------


class WorkerProcess:
    """One worker child; signals go to its whole process group."""

    def __init__(self, proc: subprocess.Popen[bytes], name: str, output: Path, start_gate: FileGate | None) -> None:
        self.proc = proc
        self.name = name
        self.output = output
        self.start_gate = start_gate

    def go(self) -> None:
        """Let a standby child start its worker."""
        assert self.start_gate is not None, f"worker {self.name} was not started on standby"
        self.start_gate.release()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)

    def output_text(self) -> str:
        return self.output.read_text(errors="replace") if self.output.exists() else ""

    async def wait_exit(self, timeout: float = 30.0) -> int:
        """Wait for the child to exit; return its return code (negative: killed by that signal)."""
        try:
            await eventually(f"worker {self.name} (pid {self.pid}) to exit", lambda: self.proc.poll() is not None,
                             timeout)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n--- output of {self.name} ---\n{self.output_text()[-4000:]}") from None
        rc = self.proc.returncode
        assert rc is not None
        return rc

    async def wait_killed_by_gate(self, timeout: float = 30.0) -> None:
        """The child must die of SIGKILL (sent by itself at a crash gate)."""
        rc = await self.wait_exit(timeout)
        assert rc == -signal.SIGKILL, (
            f"worker {self.name} exited with {rc}, not SIGKILL\n{self.output_text()[-4000:]}"
        )

    async def stop(self, timeout: float = 20.0) -> None:
        """Graceful stop (SIGTERM); the child drains its handlers and must exit with 0."""
        self.signal(signal.SIGTERM)
        rc = await self.wait_exit(timeout)
        assert rc == 0, f"worker {self.name} exited with {rc} after SIGTERM\n{self.output_text()[-4000:]}"

    def stopped(self) -> bool:
        """True when the process is in the stopped state (after SIGSTOP)."""
        try:
            stat = Path(f"/proc/{self.pid}/stat").read_text()
        except FileNotFoundError:
            return False
        return stat.rsplit(")", 1)[1].split()[0] == "T"


class ProcSet:
    """The worker children of one test, in one state directory; all are killed when the block ends."""

    def __init__(self, db_url: str, state_dir: Path) -> None:
        self.db_url = db_url  # each child's database URL unless start() is given another
        self.state_dir = state_dir
        state_dir.mkdir(parents=True, exist_ok=True)
        self.invocations = InvocationLog(state_dir / INVOCATIONS_FILE)
        self.gates = GateLog(state_dir / GATES_FILE)
        self.children: list[WorkerProcess] = []

    def __enter__(self) -> ProcSet:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for child in self.children:
            child.kill()  # SIGKILL ends a stopped (SIGSTOP) child too
        for child in self.children:
            child.proc.wait(timeout=10)

    def gate(self, name: str) -> FileGate:
        return FileGate(self.state_dir, name)

    def start(
        self,
        name: str,
        *,
        crash_at: str | None = None,
        hold: tuple[str, ...] = (),
        hold_yields: bool = False,
        lease_ttl: float = SHORT_LEASE["lease_ttl"],
        lease_renew: float = SHORT_LEASE["lease_renew"],
        housekeeping: float = SHORT_LEASE["housekeeping"],
        max_tasks: int | None = None,
        gate_log: bool = True,
        log_fsync: bool = True,
        standby: bool = False,
        registry: str | None = None,
        db_url: str | None = None,
        command_prefix: Sequence[str] = (),
    ) -> WorkerProcess:
        """Start a worker child named `name`; `crash_at` is DEX_ENGINE_CRASH_AT ('<gate>:<k>').

        With `standby`, the child imports and then waits for `go()` before it starts its worker, so a
        replacement worker can be warmed up while the one before it is still running. With
        `hold_yields`, a held handler awaits its gate (the worker keeps renewing its lease) instead of
        blocking its event loop. `db_url` replaces the set's URL for this child (another address of
        the same database); `command_prefix` runs the child under a wrapper that execs it in place,
        e.g. `ip netns exec <ns>` (the child keeps the wrapper's pid).
        """
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DEX_TEST_", "DEX_ENGINE_"))}
        env.update({
            ENV_DB_URL: db_url or self.db_url,
            ENV_STATE_DIR: str(self.state_dir),
            ENV_LEASE_TTL: str(lease_ttl),
            ENV_LEASE_RENEW: str(lease_renew),
            ENV_HOUSEKEEPING: str(housekeeping),
            ENV_HOLD: ",".join(hold),
            ENV_HOLD_YIELDS: "1" if hold_yields else "0",
            ENV_LOG_FSYNC: "1" if log_fsync else "0",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")])),
            "PYTHONUNBUFFERED": "1",
        })
        if max_tasks is not None:
            env[ENV_MAX_TASKS] = str(max_tasks)
        if registry is not None:
            env[ENV_REGISTRY] = registry
        if crash_at is not None:
            env[ENV_CRASH_AT] = crash_at
        if gate_log:
            env[ENV_GATE_LOG] = str(self.gates.path)
        start_gate = FileGate(self.state_dir, f"start-{name}") if standby else None
        if start_gate is not None:
            env[ENV_START_GATE] = start_gate.name
        output = self.state_dir / f"{name}.out"
        with output.open("wb") as out:
            proc = subprocess.Popen(
                [*command_prefix, sys.executable, "-m", CHILD_MODULE], cwd=REPO_ROOT, env=env,
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: killpg reaches it and only it
            )
        child = WorkerProcess(proc, name, output, start_gate)
        self.children.append(child)
        return child

    async def stop_outside_write(self, child: WorkerProcess, timeout: float = 20.0) -> None:
        """SIGSTOP `child` at a moment it is inside no database transaction.

        A child frozen inside a write transaction would block other processes: on SQLite every one
        (the file's write lock; the busy timeout is 30 s), on PostgreSQL every one that needs a row
        it locked (no lock timeout). That is not the zombie we mean to test. So stop it, check from
        here that it holds nothing, and if it does, resume it and try again.
        """
        held = self._sqlite_write_held if is_sqlite(self.db_url) else self._pg_transaction_open
        deadline = time.monotonic() + timeout
        while True:
            child.signal(signal.SIGSTOP)
            await eventually(f"{child.name} stopped", child.stopped, 5.0, 0.001)
            if not held(child):
                return
            child.signal(signal.SIGCONT)
            if time.monotonic() > deadline:
                raise AssertionError(f"could not stop {child.name} outside a write transaction")
            await asyncio.sleep(0.005)

    def _sqlite_write_held(self, child: WorkerProcess) -> bool:
        """Someone holds the file's write lock or its writers' turn (the stopped child is the only
        other writer): frozen holding the turn, it would hold up the others' writes too."""
        fd = os.open(sqlite_path(self.db_url) + SQLITE_WRITER_TURN_SUFFIX, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        conn = sqlite3.connect(sqlite_path(self.db_url), timeout=0.5, isolation_level=None)
        try:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("ROLLBACK")
            return False
        except sqlite3.OperationalError:
            return True
        finally:
            conn.close()

    def _pg_transaction_open(self, child: WorkerProcess) -> bool:
        """A server session of `child` is in a transaction or running a statement.

        The child's sessions are the ones whose client port is one of its TCP sockets. A session
        of a stopped child that is still "active" finishes its statement and then sits "idle in
        transaction", holding its locks: any state but "idle" counts.
        """
        import psycopg

        ports = _tcp_ports(child.pid)
        with psycopg.connect(self.db_url, autocommit=True) as conn:
            rows = conn.execute(
                "SELECT client_port, state FROM pg_stat_activity WHERE pid <> pg_backend_pid()"
                " AND client_port = ANY(%s)",
                (sorted(ports),),
            ).fetchall()
        return any(state != "idle" for _port, state in rows)


def _tcp_ports(pid: int) -> set[int]:
    """Local ports of the TCP sockets process `pid` has open (read from /proc)."""
    inodes = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in fd_dir.iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        path = Path(f"/proc/{pid}/net/{table}")
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            # fields: sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode ...
            if fields[9] in inodes:
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def integrity_check(db_url: str) -> str:
    """`PRAGMA integrity_check` on the database file, through a fresh sqlite3 connection."""
    conn = sqlite3.connect(sqlite_path(db_url))
    try:
        rows = conn.execute("PRAGMA integrity_check").fetchall()
    finally:
        conn.close()
    return "\n".join(str(r[0]) for r in rows)


# What must hold in the engine's tables once every flow is closed and every worker has stopped,
# whatever interleaving of processes wrote them: each query returns the rows that break it.
_PG_CLOSED_STATE_PROBES = {
    "closed flow without closed_at": "SELECT flow_id FROM flows WHERE status <> 'running' AND closed_at IS NULL",
    # Trimming drops the oldest events, so a flow's history is the run of seqs ending at history_seq.
    "history seqs not a gapless run ending at the flow's history_seq":
        "SELECT f.flow_id FROM flows f LEFT JOIN history h ON h.flow_id = f.flow_id GROUP BY f.flow_id, f.history_seq"
        " HAVING count(h.seq) <> coalesce(max(h.seq) - min(h.seq) + 1, 0) OR coalesce(max(h.seq), 0) <> f.history_seq",
    "history of a flow that does not exist":
        "SELECT h.flow_id FROM history h LEFT JOIN flows f USING (flow_id) WHERE f.flow_id IS NULL",
    "attribute of a flow that does not exist":
        "SELECT a.flow_id FROM attributes a LEFT JOIN flows f USING (flow_id) WHERE f.flow_id IS NULL",
    "task of a closed flow (closing a flow deletes its tasks)":
        "SELECT t.task_id FROM tasks t JOIN flows f USING (flow_id) WHERE f.status <> 'running'",
    "task leased to a worker": "SELECT task_id FROM tasks WHERE state = 'running'",
    "lock still held": "SELECT flow_id, lock_name FROM locks",
    "worker still registered": "SELECT worker_id FROM workers",
}


def pg_integrity_check(db_url: str) -> str:
    """PostgreSQL's counterpart of `integrity_check`: "ok", or what is wrong.

    Physical: amcheck's `bt_index_check(index, heapallindexed => true)` on every index of the
    engine's tables (each B-tree is well formed and holds every heap row). Logical: the probes
    above, which hold once every flow is closed and every worker has stopped. The extension is
    created for the check and dropped after it, so the database is left as the engine made it.
    """
    import psycopg

    problems: list[str] = []
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS amcheck")
        try:
            indexes = conn.execute(
                "SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid"
                " JOIN pg_namespace n ON n.oid = c.relnamespace JOIN pg_am a ON a.oid = c.relam"
                " WHERE n.nspname = 'public' AND a.amname = 'btree' ORDER BY 1"
            ).fetchall()
            assert indexes, "no B-tree index found: not an engine database?"
            for (index,) in indexes:
                try:
                    conn.execute("SELECT bt_index_check(%s::regclass, true)", (index,))
                except psycopg.Error as exc:
                    problems.append(f"index {index}: {exc}")
        finally:
            conn.execute("DROP EXTENSION amcheck")
        for what, sql in _PG_CLOSED_STATE_PROBES.items():
            rows = conn.execute(sql).fetchall()
            if rows:
                problems.append(f"{what}: {rows[:5]}")
    return "\n".join(problems) or "ok"


def database_check(db_url: str) -> str:
    """Return "ok" when the database is sound: `integrity_check` on SQLite, `pg_integrity_check` on PostgreSQL."""
    return integrity_check(db_url) if is_sqlite(db_url) else pg_integrity_check(db_url)
