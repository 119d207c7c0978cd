"""Every durable state change of the engine, as functions over one open transaction.

Backend-neutral: SQL here uses `?` placeholders and syntax both SQLite and PostgreSQL accept; a
store runs each function inside one transaction (E1) and supplies `Db`. Functions raise the named
errors to roll their transaction (or savepoint) back.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, Protocol, TypeVar, cast

import msgspec

from ._attribute_cache import AttributeCache, KnownRows
from ._codec import decode_json, encode_json
from ._errors import (
    ChannelMessageNotFoundError,
    FlowAlreadyStartedError,
    FlowNotActiveError,
    FlowNotFoundError,
    FlowStillRunningError,
    RpcLockConflictError,
    StaleAttemptError,
    StepNotWaitingError,
    WorkerIdInUseError,
)
from ._limits import (
    ACTIVE_STEP_SEARCH_CANDIDATES,
    ACTIVE_STEP_SEARCH_CANDIDATES_PER_FLOW_WALKED,
    ACTIVE_STEP_SEARCH_COUNTED,
    ACTIVE_STEP_SEARCH_LOOKUPS_PG,
    CLAIM_ROWS_PER_SLOT,
    CLOSED_FLOWS_DELETED_PER_HOUSEKEEPING,
    HISTORY_CHAIN_TRIM_EVERY,
    HISTORY_TRIM_CHECK_EVERY,
    LATE_ATTEMPTS_NAMED,
    MAX_ERROR_TEXT_CHARS,
    MAX_HISTORY_EVENTS_PER_FLOW,
    MAX_MESSAGE_ID,
    MOST_PUBLISHED_INSTANCES_NAMED,
    ROWS_PER_STATEMENT,
    TIMERS_FIRED_PER_HOUSEKEEPING,
    TIMERS_FIRED_WHILE_BACKLOGGED,
)
from ._options import FlowConfig, LoadSpec, MethodOptions, TaskOptions
from ._records import (
    ActiveStep,
    AttemptProgress,
    ConsumedMessage,
    DecisionRecord,
    ErrorInfo,
    EventPage,
    FlowInfo,
    HistoryEntry,
    HousekeepingReport,
    Lease,
    MovementRecord,
    RecoveryError,
    RetryWaitEnding,
    RpcSnapshot,
    StartedFold,
    StartRequest,
    StoredEvent,
    WaitOutcome,
    WriteSet,
)
from ._retry import AskedDelay, decide_retry
from ._task_options import SharedOptions, is_reference, options_json
from ._wait import ConditionSpec, WaitSpec
from ._wait_selection import select_wait

Row = tuple[Any, ...]
R = TypeVar("R")
S = TypeVar("S")


HistoryRow = tuple[str, str, str, str, int, int, str]  # flow, step type, execution ID, event, attempt, at, detail
# The events of a history batch (SQLite, schema 7): a HistoryRow without its flow, each.
_HistoryBatch = list[tuple[str, str, str, int, int, str]]
AppendRow = tuple[str, str, int, str, int, bytes]  # flow, stream, capacity, execution ID, attempt, value


class Db(Protocol):
    """The few statements the transitions need from a backend, inside an open transaction.

    `history` buffers the operation's history events and `appends` its stream events; run_op
    writes each once at its end (one sequence update and one insert per flow and stream).
    `for_update` and `skip_locked` are the row-lock clauses a backend with concurrent writers needs
    ('' on SQLite, whose writers are serialized by BEGIN IMMEDIATE). `notify` tells other
    processes' workers that work may be ready, and `revoked` that a running attempt was cancelled,
    failed or taken from its worker (which must then stop it, E9). PostgreSQL's also has
    `dialect = "postgres"`, which lets a few hot statements use its syntax (one statement where
    SQLite needs two), and `send(sql, params)`: run a statement without waiting for its reply (see
    `_send`). A backend whose writers are all serialized may set `lazy_snapshots = True` (see
    LIVE_SNAPSHOT).
    """

    history: list[HistoryRow]
    appends: list[AppendRow]
    # On a backend whose flow rows hold their Step execution counters and stream positions (SQLite;
    # see _insert_task and append_events): each flow's as this operation leaves them, read once with
    # the flow row, and the flows whose counters or streams it changed, which flush_history writes
    # back. Emptied at the end of every operation (run_op).
    counters: dict[str, dict[str, int]]
    counted: set[str]
    streams: dict[str, dict[str, list[int]]]  # flow -> stream -> [next sequence, first sequence, bytes]
    streamed: set[str]
    # Attribute rows known without reading them (SQLite; see _attribute_cache): the store's cache,
    # and per operation the rows of each flow whose version it read (None: it wrote that flow's
    # attributes before, so its rows are not known), and each flow's version after the operation's
    # own bumps. run_op turns them into `cache_writes`, which the store applies once it committed.
    cache: AttributeCache | None
    known: dict[str, KnownRows | None]
    version_after: dict[str, int]
    cache_writes: list[tuple[str, KnownRows]]
    # SQLite: each flow's (history_seq, version) as this operation expects them, from its first read
    # of the flow row and its own updates since, so that flush_history need not read them back
    # (RETURNING buffers its rows, a cost of its own); its update checks them. Emptied by run_op.
    flow_rows: dict[str, tuple[int, int]]
    # A backend may also have `unstored`, a list of UnstoredMessage: the channel messages this
    # operation published and has not written yet (SQLite). A wait of the same operation may take
    # one at once, and then it is never written; run_op writes the rest (flush_messages).
    for_update: str
    skip_locked: str

    def notify(self) -> None: ...
    def revoked(self) -> None: ...

    def one(self, sql: str, params: Sequence[Any] = ()) -> Row | None: ...
    def all(self, sql: str, params: Sequence[Any] = ()) -> list[Row]: ...
    def run(self, sql: str, params: Sequence[Any] = ()) -> int: ...


@dataclass(frozen=True)
class PollResult:
    leases: list[Lease]
    epochs: dict[int, int]  # running task -> current lease epoch; missing: the task is gone
    next_due_ms: int | None
    housekeeping: HousekeepingReport | None
    # False when the polling worker has no row: declared dead, it claimed nothing (worker_registered).
    registered: bool = True


class RpcVersionChanged(Exception):
    """The flow changed between an RPC's read and its commit; the RPC runs again."""


class FlowTypeChanged(Exception):
    """The flow is of another type than the caller looked its names up in: its ID was deleted and
    started again with another type since the caller (a client that remembers types) read it."""


def _check_type(found: str, expected: str | None) -> None:
    if expected is not None and found != expected:
        raise FlowTypeChanged(found)


# History events (E13)
STEP_SCHEDULED = "step_scheduled"
WAIT_REGISTERED = "wait_registered"
WAIT_COMPLETED = "wait_completed"
EXECUTE_COMPLETED = "execute_completed"
ATTEMPT_FAILED = "attempt_failed"
STEP_FAILED = "step_failed"
STEP_CANCELLED = "step_cancelled"
FLOW_CLOSED = "flow_closed"

_SnapshotRows = list[tuple[str, str, msgspec.Raw]]

_UNSEEN: Any = object()

# Columns a claim reads, in Lease order.
_TASK_COLS = (
    "task_id, lease_epoch, flow_id, flow_type, step_type, step_execution_id, method, attempt, "
    "input, options, snapshot, checkpoint, wait_outcome, recovery_error, locks_held, "
    "method_first_at, any_started, attempt_started, last_error, wait_spec"
)

_TASK_COL_COUNT = len(_TASK_COLS.split(","))
# The same, of tasks aliased `t` (joined with their flows).
_CLAIM_COLS = ", ".join("t." + column.strip() for column in _TASK_COLS.split(","))


def _in(values: Sequence[Any]) -> str:
    return _placeholders(len(values))


@functools.lru_cache(maxsize=256)
def _placeholders(count: int) -> str:
    return ",".join("?" * count)


# Steps (flow type, Step type, method) that a worker's Registry lacks and so must not be claimed for
# it: a rolling deploy's newer Steps, which the worker once claimed and handed back (see
# Store.set_declined). Usually empty.
Declined = Collection[tuple[str, str, str]]


@functools.lru_cache(maxsize=1024)
def _rows_of(width: int, count: int) -> str:
    """`count` rows of `width` placeholders for a VALUES list: `(?, ?), (?, ?)`; built once per shape."""
    row = "(" + ", ".join("?" * width) + ")"
    return ", ".join([row] * count)


def _not_declined(declined: Declined, alias: str = "") -> tuple[str, tuple[str, ...]]:
    """A ready-task condition (` AND (...) NOT IN (VALUES ...)`, or '' for none) leaving out
    `declined`, with its parameters; `alias` prefixes the columns (`t.` in a join)."""
    if not declined:
        return "", ()
    columns = f"({alias}flow_type, {alias}step_type, {alias}method)"
    return (f" AND {columns} NOT IN (VALUES {_rows_of(3, len(declined))})",
            tuple(v for step in declined for v in step))


def _send(db: Db, sql: str, params: Sequence[Any] = ()) -> None:
    """Run a statement whose result nobody reads. A pipelining backend (PostgreSQL) sends it with
    the next statement that needs a reply, saving a round trip; its errors surface there, still
    inside the transaction. Backends without `send` run it at once."""
    send = getattr(db, "send", None)
    if send is None:
        db.run(sql, params)
    else:
        send(sql, params)


# Flows -------------------------------------------------------------------------------------


def existing_flow_type(db: Db, flow_id: str, expected: str | None = None) -> str:
    """The flow's type; FlowNotFoundError when there is no such flow, FlowTypeChanged when it is
    not `expected` (a type the caller remembers)."""
    return existing_flow(db, flow_id, expected)[0]


def existing_flow(db: Db, flow_id: str, expected: str | None = None) -> tuple[str, int, str]:
    """The flow's type, start time (ms), which tells a flow from an earlier one of its ID, and status."""
    if _on_postgres(db):
        row = db.one("SELECT flow_type, status, created_at FROM flows WHERE flow_id = ?", (flow_id,))
    else:
        row = db.one(f"SELECT flow_type, status, {_FLOW_STATE} FROM flows WHERE flow_id = ?", (flow_id,))
    if row is None:
        raise FlowNotFoundError(flow_id)
    if _on_postgres(db):
        created_at = int(row[2])
    else:
        _know_flow_row(db, flow_id, *row[2:])
        created_at = int(row[2 + _FLOW_STATE.split(", ").index("created_at")])
    _check_type(str(row[0]), expected)
    return str(row[0]), created_at, str(row[1])


# The columns of a flow row an SQLite operation keeps for its duration (_know_flow_row), read with it.
_FLOW_STATE = "step_counters, streams, version, created_at, history_seq"
_FLOW_STATE_OF_F = ", ".join("f." + c for c in _FLOW_STATE.split(", "))  # the same, of `flows f` in a join


def require_running(db: Db, flow_id: str, *, lock: bool = True) -> str:
    """The flow's type if it is running. With `lock`, this transaction now serializes the flow's
    changes (the flow row lock on PostgreSQL)."""
    row_state = "NULL" if _on_postgres(db) else _FLOW_STATE
    row = db.one(f"SELECT flow_type, status, {row_state} FROM flows WHERE flow_id = ?{db.for_update if lock else ''}",
                 (flow_id,))
    if row is None:
        raise FlowNotFoundError(flow_id)
    if row[1] != "running":
        raise FlowNotActiveError(flow_id, str(row[1]))
    if not _on_postgres(db):
        _know_flow_row(db, flow_id, *row[2:])
    return str(row[0])


def lock_flow(db: Db, flow_id: str) -> None:
    """Serialize this transaction with every other change to the flow (its row lock). A no-op on
    SQLite, whose BEGIN IMMEDIATE already serializes every writer."""
    if db.for_update:
        _send(db, f"SELECT 1 FROM flows WHERE flow_id = ?{db.for_update}", (flow_id,))


def bump(db: Db, flow_id: str) -> None:
    if _on_postgres(db):
        _send(db, "UPDATE flows SET version = version + 1 WHERE flow_id = ?", (flow_id,))
        return
    row = db.one("UPDATE flows SET version = version + 1 WHERE flow_id = ? RETURNING version", (flow_id,))
    if row is not None:
        db.version_after[flow_id] = int(row[0])  # see Db.known
        expected = db.flow_rows.get(flow_id)
        if expected is not None:
            db.flow_rows[flow_id] = (expected[0], int(row[0]))


def start_flow(db: Db, req: StartRequest, now: int) -> None:
    inserted = db.one(
        "INSERT INTO flows (flow_id, flow_type, status, input, config, version, created_at) "
        "VALUES (?, ?, 'running', ?, ?, 1, ?) ON CONFLICT (flow_id) DO NOTHING RETURNING flow_id",
        (req.flow_id, req.flow_type, req.input, encode_json(req.config), now),
    )
    if inserted is None:
        raise FlowAlreadyStartedError(req.flow_id)
    if req.start is not None:
        create_task(db, req.flow_id, req.flow_type, req.start, now)


def flow_config(db: Db, flow_id: str) -> FlowConfig:
    row = db.one("SELECT config FROM flows WHERE flow_id = ?", (flow_id,))
    if row is None:
        raise FlowNotFoundError(flow_id)
    return decode_json(row[0], FlowConfig)


def update_flow_config(db: Db, flow_id: str, config: FlowConfig) -> None:
    require_running(db, flow_id)
    _send(db, "UPDATE flows SET config = ? WHERE flow_id = ?", (encode_json(config), flow_id))


def close_flow(db: Db, flow_id: str, status: str, output: bytes | None, error: str | None, now: int) -> None:
    error = None if error is None else _error_text(error)
    for (task_id,) in db.all("SELECT task_id FROM tasks WHERE flow_id = ? ORDER BY task_id", (flow_id,)):
        _cancel_task(db, int(task_id), now, "flow closed")
    # Its history follows (flow_closed), whose update tells the version after both (Db.version_after).
    _send(
        db, "UPDATE flows SET status = ?, output = ?, error = ?, closed_at = ?, version = version + 1 "
        "WHERE flow_id = ?",
        (status, output, error, now, flow_id),
    )
    _history(db, flow_id, "", "", FLOW_CLOSED, 0, now, status if error is None else f"{status}: {error}")


def stop_flow(db: Db, flow_id: str, reason: str, now: int) -> None:
    require_running(db, flow_id)
    close_flow(db, flow_id, "stopped", None, reason or "stopped", now)


def delete_flow(db: Db, flow_id: str) -> bool:
    """Delete a closed flow and every row of it; False when there is no such flow. A running one is
    refused (FlowStillRunningError): its Steps would lose their state in the middle of their work."""
    row = db.one(f"SELECT status FROM flows WHERE flow_id = ?{db.for_update}", (flow_id,))
    if row is None:
        return False
    if row[0] == "running":
        raise FlowStillRunningError(flow_id)
    _delete_flow_rows(db, flow_id)
    return True


# The tables with rows of a flow besides `flows` and its history, each indexed by flow ID first. A
# closed flow has no tasks or locks left (close_flow cancels its Steps); they are named anyway, so
# that nothing of the flow can outlive it. PostgreSQL keeps Step counters and stream positions in
# tables of their own (SQLite: in the flow row).
_FLOW_TABLES = ("attributes", "channel_messages", "stream_events", "tasks", "locks")
_PG_FLOW_TABLES = ("history", "step_counters", "streams")


def _delete_flow_rows(db: Db, flow_id: str) -> None:
    """Inside the transaction that locked the flow: delete its rows from every table."""
    tables: tuple[str, ...] = _FLOW_TABLES
    if _on_postgres(db):
        tables += _PG_FLOW_TABLES
    else:
        db.run(_DELETE_BATCHES, (flow_id,))  # before the flow row, whose history_head starts the walk
    for table in tables:
        db.run(f"DELETE FROM {table} WHERE flow_id = ?", (flow_id,))
    db.run("DELETE FROM flows WHERE flow_id = ?", (flow_id,))
    # Nothing of it may reach the store's attribute cache: a flow started again under the ID starts
    # from no rows (the cache tells incarnations apart by creation time too, to the millisecond).
    db.known.pop(flow_id, None)
    if db.cache is not None:
        db.cache.drop(flow_id)


def delete_closed_flows(db: Db, closed_before: int) -> tuple[int, bool]:
    """Retention: delete flows closed before `closed_before` (ms), the longest closed first, at most
    CLOSED_FLOWS_DELETED_PER_HOUSEKEEPING; returns how many, and whether more are that old. Found
    through flows_closed (schema 8 on SQLite, 7 on PostgreSQL), so a pass reads only those it deletes."""
    due = db.all("SELECT flow_id FROM flows WHERE closed_at IS NOT NULL AND closed_at < ? ORDER BY closed_at LIMIT ?",
                 (closed_before, CLOSED_FLOWS_DELETED_PER_HOUSEKEEPING + 1))
    deleted = 0
    # In ID order (see _in_lock_order); one another housekeeper is deleting now is skipped (PostgreSQL).
    for flow_id in sorted(str(r[0]) for r in due[:CLOSED_FLOWS_DELETED_PER_HOUSEKEEPING]):
        row = db.one(f"SELECT closed_at FROM flows WHERE flow_id = ?{db.skip_locked}", (flow_id,))
        if row is None or row[0] is None or int(row[0]) >= closed_before:
            continue
        _delete_flow_rows(db, flow_id)
        deleted += 1
    return deleted, len(due) > CLOSED_FLOWS_DELETED_PER_HOUSEKEEPING


def _maybe_complete(db: Db, flow_id: str, now: int) -> None:
    row = db.one("SELECT completing, completion_output FROM flows WHERE flow_id = ?", (flow_id,))
    if row is None or not row[0]:
        return
    if db.one("SELECT 1 FROM tasks WHERE flow_id = ? LIMIT 1", (flow_id,)) is None:
        close_flow(db, flow_id, "completed", row[1], None, now)


# History -----------------------------------------------------------------------------------


def _history(
    db: Db, flow_id: str, step_type: str, seid: str, event: str, attempt: int, now: int, detail: str = ""
) -> None:
    db.history.append((flow_id, step_type, seid, event, attempt, now, _error_text(detail)))


def _with_note(text: str, note: str) -> str:
    """`text` (an error's, kept to MAX_ERROR_TEXT_CHARS) with `note` after it, the note kept whole:
    a long error would otherwise push it past the limit, where it is cut off."""
    return text[:max(0, MAX_ERROR_TEXT_CHARS - len(note))] + note


def _error_text(text: str) -> str:
    """`text` (an error's, a reason, a history detail) as kept: its first MAX_ERROR_TEXT_CHARS
    characters, storable. Cut before and after: a huge error is not copied whole, and its escapes
    do not pass the limit. A reason is checked to be text where it is given (StepDecision,
    AsyncClient.stop_flow): this runs for every history entry."""
    return _storable_text(text[:MAX_ERROR_TEXT_CHARS])[:MAX_ERROR_TEXT_CHARS]


def _storable_text(text: str) -> str:
    """`text` (an error's message, a reason) as both backends' text columns hold it: PostgreSQL's
    text cannot hold NUL, so each NUL is written as the four characters \\x00, and neither can
    encode a lone surrogate, written as its escape (\\ud800), so that the text is always stored."""
    text = text.replace("\x00", "\\x00")
    return text if text.isascii() else text.encode("utf-8", "backslashreplace").decode("utf-8")


def _on_postgres(db: Db) -> bool:
    """Whether `db` may take PostgreSQL's syntax for a hot statement (Db's `dialect`)."""
    return getattr(db, "dialect", None) == "postgres"


def flush_history(db: Db) -> None:
    """Write the buffered history events: per flow one sequence update and one insert. On SQLite
    that update also writes the flow's Step counters and stream positions when the operation changed
    them (a flow whose only change is its streams, a best-effort append, keeps its version)."""
    pending, db.history = db.history, []
    by_flow: dict[str, list[HistoryRow]] = {}
    for row in pending:
        by_flow.setdefault(row[0], []).append(row)
    if _on_postgres(db):
        for flow_id, rows in by_flow.items():
            _send_history(db, flow_id, rows)
        return
    for flow_id in (*db.counted, *db.streamed):
        by_flow.setdefault(flow_id, [])
    for flow_id, rows in by_flow.items():
        sets, params = [], []
        if flow_id in db.counted:
            sets.append("step_counters = ?")
            params.append(encode_json(db.counters[flow_id]).decode())
        if flow_id in db.streamed:
            sets.append("streams = ?")
            params.append(encode_json(db.streams[flow_id]).decode())
        if not rows:
            _send(db, f"UPDATE flows SET {', '.join(sets)} WHERE flow_id = ?", (*params, flow_id))
            continue
        # History marks state changes, so it also bumps the version RPCs validate against. The
        # flow's events go into one new batch, which becomes the head of its chain (schema 7).
        assignments = "".join(f", {column}" for column in sets)
        events = encode_json([row[1:] for row in rows])
        got: Row | None = None
        expected = db.flow_rows.get(flow_id)
        if expected is not None:
            after = (expected[0] + len(rows), expected[1] + 1)
            db.run(_INSERT_BATCH, (flow_id, expected[0] + 1, after[0], flow_id, events))
            if db.run(f"UPDATE flows SET history_seq = ?, version = ?, history_head = last_insert_rowid(){assignments} "
                      "WHERE flow_id = ? AND history_seq = ? AND version = ?", (*after, *params, flow_id, *expected)):
                got = after
            else:  # numbered from a row this operation did not follow: numbered again below
                db.run("DELETE FROM history_batches WHERE batch_id = last_insert_rowid()")
        if got is None:  # not read by this operation, or changed in a way it did not follow
            got = db.one(f"UPDATE flows SET history_seq = history_seq + ?, version = version + 1{assignments} "
                         "WHERE flow_id = ? RETURNING history_seq, version", (len(rows), *params, flow_id))
            if got is None:
                continue
            db.run(_INSERT_BATCH, (flow_id, int(got[0]) - len(rows) + 1, int(got[0]), flow_id, events))
            db.run("UPDATE flows SET history_head = last_insert_rowid() WHERE flow_id = ?", (flow_id,))
        db.version_after[flow_id] = int(got[1])
        last = int(got[0])
        first = last - len(rows) + 1
        if last // HISTORY_CHAIN_TRIM_EVERY != (first - 1) // HISTORY_CHAIN_TRIM_EVERY:
            # Trimmed in chunks so a Step pays no extra statement on most writes.
            _trim_batches(db, flow_id, last - MAX_HISTORY_EVENTS_PER_FLOW)


def _trim_batches(db: Db, flow_id: str, cutoff: int) -> None:
    """Delete a flow's history events up to sequence `cutoff`: the batches that hold only such
    events, and those at the start of the one batch that also holds later ones."""
    db.run(_TRIM_BATCHES, (flow_id, cutoff))
    row = db.one(_OLDEST_KEPT_BATCH, (flow_id, cutoff))
    if row is not None:
        batch_id, first_seq, blob = row
        kept = decode_json(bytes(blob), _HistoryBatch)[cutoff + 1 - int(first_seq):]
        db.run("UPDATE history_batches SET first_seq = ?, events = ? WHERE batch_id = ?",
               (cutoff + 1, encode_json(kept), batch_id))


# A flow's new history batch, after the flow's current head (schema 7 on SQLite).
_INSERT_BATCH = (
    "INSERT INTO history_batches (flow_id, first_seq, last_seq, prev, events) "
    "VALUES (?, ?, ?, (SELECT history_head FROM flows WHERE flow_id = ?), ?)"
)
# A flow's batches, newest first, walked back from its head (?1: the flow ID). A batch of another
# flow ends the walk: a prev naming a deleted batch whose number came back.
_CHAIN = (
    "WITH RECURSIVE chain(batch_id, prev, first_seq, last_seq, events, n) AS ("
    "SELECT batch_id, prev, first_seq, last_seq, events, last_seq - first_seq + 1 FROM history_batches "
    "WHERE batch_id = (SELECT history_head FROM flows WHERE flow_id = ?1) AND flow_id = ?1 "
    "UNION ALL SELECT b.batch_id, b.prev, b.first_seq, b.last_seq, b.events, c.n + b.last_seq - b.first_seq + 1 "
    "FROM history_batches b JOIN chain c ON b.batch_id = c.prev WHERE b.flow_id = ?1{more}) "
)
# Parameters: the flow ID and the last sequence to delete.
_TRIM_BATCHES = (_CHAIN.format(more="")
                 + "DELETE FROM history_batches WHERE batch_id IN (SELECT batch_id FROM chain WHERE last_seq <= ?2)")
# All of a flow's batches (delete_flow): they have no index by flow, so the flow's are its chain's.
_DELETE_BATCHES = _CHAIN.format(more="") + "DELETE FROM history_batches WHERE batch_id IN (SELECT batch_id FROM chain)"
# Parameters: the flow ID and how many of the newest events to cover.
_READ_BATCHES = _CHAIN.format(more=" AND c.n < ?2") + "SELECT first_seq, events FROM chain"
# The batch that holds sequence ?2 and later ones too, once _TRIM_BATCHES ran (the walk stops there).
_OLDEST_KEPT_BATCH = (_CHAIN.format(more=" AND c.first_seq > ?2")
                      + "SELECT batch_id, first_seq, events FROM chain WHERE first_seq <= ?2")


def _send_history(db: Db, flow_id: str, rows: list[HistoryRow]) -> None:
    """`flush_history` on PostgreSQL: one statement (data-modifying CTEs), no reply awaited. The
    server numbers the events from the updated sequence, and trims as above when the sequence
    crosses a multiple of HISTORY_TRIM_CHECK_EVERY (n events cross one when the new sequence modulo
    it is below n)."""
    n = len(rows)
    values = _rows_of(7, len(rows))
    params: list[Any] = [n, flow_id, HISTORY_TRIM_CHECK_EVERY, n, MAX_HISTORY_EVENTS_PER_FLOW, n]
    for i, (_f, step_type, seid, event, attempt, at, detail) in enumerate(rows, start=1):
        params += (i, step_type, seid, event, attempt, at, detail)
    _send(
        db,
        "WITH f AS (UPDATE flows SET history_seq = history_seq + ?, version = version + 1 WHERE flow_id = ? "
        "RETURNING flow_id, history_seq), "
        "trimmed AS (DELETE FROM history h USING f WHERE h.flow_id = f.flow_id "
        "AND f.history_seq % ? < ? AND h.seq <= f.history_seq - ?) "
        "INSERT INTO history (flow_id, seq, step_type, step_execution_id, event_type, attempt, at, detail) "
        "SELECT f.flow_id, f.history_seq - ? + v.i, v.step_type, v.seid, v.event, v.attempt, v.at, v.detail "
        f"FROM f, (VALUES {values}) AS v (i, step_type, seid, event, attempt, at, detail)",
        params,
    )


def run_op(fn: Callable[[Db], R], db: Db) -> R:
    """Run one operation inside the open transaction, then write its events and history; on error drop them."""
    try:
        result = fn(db)
        flush_messages(db)
        flush_appends(db)
        flush_history(db)
        for flow_id, known in db.known.items():
            if known is not None:
                # The rows as this operation leaves them, at the version it leaves: the cache's
                # once the transaction commits (the store applies cache_writes then).
                known.version = db.version_after.get(flow_id, known.version)
                db.cache_writes.append((flow_id, known))
    except BaseException:
        db.history.clear()
        db.appends.clear()
        unstored: list[UnstoredMessage] | None = getattr(db, "unstored", None)
        if unstored is not None:
            unstored.clear()
        raise
    finally:
        db.counters.clear()
        db.counted.clear()
        db.streams.clear()
        db.streamed.clear()
        db.known.clear()
        db.version_after.clear()
        db.flow_rows.clear()
    return result


def read_history(db: Db, flow_id: str, limit: int) -> list[HistoryEntry]:
    # A flow holds up to its trim interval more than MAX_HISTORY_EVENTS_PER_FLOW (HISTORY_TRIM_CHECK_EVERY
    # on PostgreSQL, HISTORY_CHAIN_TRIM_EVERY on SQLite): reading only the newest that many gives
    # the same history on both backends, whenever it is read.
    limit = min(limit, MAX_HISTORY_EVENTS_PER_FLOW)
    if not _on_postgres(db):
        existing_flow_type(db, flow_id)
        batches = sorted(db.all(_READ_BATCHES, (flow_id, limit)))
        events = [event for _first, blob in batches for event in decode_json(bytes(blob), _HistoryBatch)]
        return [HistoryEntry(event, step_type, seid, attempt, at, detail)
                for step_type, seid, event, attempt, at, detail in events[max(0, len(events) - limit):]]
    rows = _pg_rows_of_flow(
        db, flow_id, None, "event_type, step_type, step_execution_id, attempt, at, detail",
        "SELECT * FROM history WHERE flow_id = f.flow_id ORDER BY seq DESC LIMIT ?", (limit,), "j.seq")
    return [HistoryEntry(str(r[0]), str(r[1]), str(r[2]), int(r[3]), int(r[4]), str(r[5])) for r in rows]


# Tasks -------------------------------------------------------------------------------------


# PostgreSQL keeps the counters in a table of their own (its batched commit function writes them).
_COUNT_EXECUTION = ("INSERT INTO step_counters (flow_id, step_type, n) VALUES (?, ?, 1) "
                    "ON CONFLICT (flow_id, step_type) DO UPDATE SET n = step_counters.n + 1")


def _insert_task(db: Db, columns: str, values: str, params: Sequence[Any]) -> tuple[int, str]:
    """Insert a task under the next execution ID of its Step type, `<StepType>-<n>` (n counted per
    flow); returns its task ID and execution ID. `columns` start with flow_id, flow_type, step_type,
    step_execution_id; `values` holds `{id}` in the execution ID's place and `?` for `params`."""
    flow_id, step_type = params[0], params[2]
    if _on_postgres(db):
        # One statement: the counter's new value comes from a data-modifying CTE.
        execution_id = "CAST(? AS TEXT) || '-' || CAST(c.n AS TEXT)"
        sql = (f"WITH c AS ({_COUNT_EXECUTION} RETURNING n) INSERT INTO tasks ({columns}) "
               f"SELECT {values.format(id=execution_id)} FROM c RETURNING task_id, step_execution_id")
        row = db.one(sql, (flow_id, step_type, *params[:3], step_type, *params[3:]))
    else:
        # The flow row holds the counters (see Db.counters): no statement of their own.
        counters = step_counters(db, flow_id)
        n = counters[step_type] = counters.get(step_type, 0) + 1
        db.counted.add(flow_id)
        execution = f"{step_type}-{n}"
        task_id = cast(_InsertsRows, db).insert(f"INSERT INTO tasks ({columns}) VALUES ({values.format(id='?')})",
                                                 (*params[:3], execution, *params[3:]))
        return task_id, execution
    assert row is not None
    return int(row[0]), str(row[1])


class _InsertsRows(Protocol):
    """SQLite's Db: an INSERT that hands back the new row's rowid."""

    def insert(self, sql: str, params: Sequence[Any] = ()) -> int: ...


def step_counters(db: Db, flow_id: str) -> dict[str, int]:
    """The flow's Step execution counters, by Step type, as this operation leaves them."""
    if _on_postgres(db):
        return {str(t): int(n) for t, n in db.all("SELECT step_type, n FROM step_counters WHERE flow_id = ?",
                                                  (flow_id,))}
    known = db.counters.get(flow_id)
    if known is None:
        row = db.one("SELECT step_counters FROM flows WHERE flow_id = ?", (flow_id,))
        known = db.counters[flow_id] = _decode_counters(None if row is None else row[0])
    return known


def _decode_counters(text: str | bytes | None) -> dict[str, int]:
    return {} if text is None else dict(decode_json(text, dict[str, int]))


def _know_flow_row(
    db: Db, flow_id: str, counters: str | bytes | None, streams: str | bytes | None, version: int, created_at: int,
    history_seq: int,
) -> None:
    """What a read of the flow row (_FLOW_STATE) tells an SQLite operation, unless it already knows
    (and may have changed) it: the Step counters and stream positions (see Db.counters), its
    history sequence and version (Db.flow_rows), and, from its version, the attribute rows the
    store's cache holds for it (see Db.known)."""
    if flow_id not in db.flow_rows:
        db.flow_rows[flow_id] = (int(history_seq), int(version))
    if flow_id not in db.counters:
        db.counters[flow_id] = _decode_counters(counters)
    if flow_id not in db.streams:
        db.streams[flow_id] = _decode_streams(streams)
    if flow_id not in db.known and db.cache is not None:
        cached = db.cache.get(flow_id, int(version), int(created_at))
        db.known[flow_id] = KnownRows(int(version), int(created_at)) if cached is None else cached.copy()


def _decode_streams(text: str | bytes | None) -> dict[str, list[int]]:
    return {} if text is None else dict(decode_json(text, dict[str, list[int]]))


def stream_positions(db: Db, flow_id: str) -> dict[str, list[int]]:
    """The flow's streams as this operation leaves them: [next sequence, first sequence, bytes]
    by name (SQLite: its row's; see Db.streams)."""
    known = db.streams.get(flow_id)
    if known is None:
        row = db.one("SELECT streams FROM flows WHERE flow_id = ?", (flow_id,))
        known = db.streams[flow_id] = _decode_streams(None if row is None else row[0])
    return known


@dataclass
class Handoff:
    """Lets a commit hand the Steps it starts straight to the committing worker, already claimed,
    instead of inserting them ready and claiming them back (two statements fewer per Step)."""

    worker_id: str
    capacity: int
    leases: list[Lease]


def create_task(
    db: Db, flow_id: str, flow_type: str, movement: MovementRecord, now: int,
    recovery_error: RecoveryError | None = None, config: FlowConfig | None = None,
    handoff: Handoff | None = None,
) -> int:
    step_type = movement.step_type
    options = movement.options
    if options.durability is None:
        config = config or flow_config(db, flow_id)
        options = msgspec.structs.replace(options, durability=config.default_step_durability)
    method: Literal["wait_for", "execute"] = "wait_for" if options.has_wait_for else "execute"
    mopts = _method_options(options, method)
    recovery_blob = None if recovery_error is None else encode_json(recovery_error)
    options_blob = _stored_options(db, options, now)
    wait_options = options.wait_for
    if movement.wait is not None and wait_options is not None and _wait_state_holds(
        db, flow_id, wait_options, movement.wait_loaded
    ):
        # The WaitFor already ran (see MovementRecord.wait): register its wait as its commit would,
        # in this transaction; the caller evaluates the flow's waits once its movements are in.
        task_id, seid = _insert_task(
            db,
            "flow_id, flow_type, step_type, step_execution_id, input, options, method, state, attempt, run_at, "
            "recovery_error, created_at, wait_spec, wait_registered_at, timer_due_at",
            "?, ?, ?, {id}, ?, ?, 'execute', 'waiting', 1, ?, ?, ?, ?, ?, ?",
            (flow_id, flow_type, step_type, movement.input, options_blob, now, recovery_blob, now,
             encode_json(movement.wait), now, _first_timer_due(movement.wait, now)),
        )
        _history(db, flow_id, step_type, seid, STEP_SCHEDULED, 0, now)
        _history(db, flow_id, step_type, seid, WAIT_REGISTERED, 1, now)
        return task_id
    if handoff is None or handoff.capacity <= 0 or mopts.locks:
        task_id, seid = _insert_task(
            db,
            "flow_id, flow_type, step_type, step_execution_id, input, options, method, state, attempt, run_at, "
            "recovery_error, created_at",
            "?, ?, ?, {id}, ?, ?, ?, 'ready', 1, ?, ?, ?",
            (flow_id, flow_type, step_type, movement.input, options_blob, method, now, recovery_blob, now),
        )
        _history(db, flow_id, step_type, seid, STEP_SCHEDULED, 0, now)
        db.notify()
        return task_id
    start = _attempt_start(db, flow_id, options, mopts, None, now)
    task_id, seid = _insert_task(
        db,
        "flow_id, flow_type, step_type, step_execution_id, input, options, method, state, attempt, run_at, "
        "recovery_error, created_at, lease_owner, lease_epoch, claimed_at, method_first_at, deadline_at, "
        "method_deadline_at, snapshot",
        "?, ?, ?, {id}, ?, ?, ?, 'running', 1, ?, ?, ?, ?, 1, ?, ?, ?, ?, ?",
        (flow_id, flow_type, step_type, movement.input, options_blob, method, now, recovery_blob, now,
         handoff.worker_id, now, now, start.deadline, start.method_deadline, start.snapshot),
    )
    _history(db, flow_id, step_type, seid, STEP_SCHEDULED, 0, now)
    handoff.capacity -= 1
    handoff.leases.append(Lease(
        task_id=task_id, lease_epoch=1, flow_id=flow_id, flow_type=flow_type, step_type=movement.step_type,
        step_execution_id=seid, method=method, attempt=1, input=movement.input, options=options,
        load=mopts.load, attributes=start.attributes, checkpoint=None, wait_spec=None, wait_outcome=None,
        recovery_error=recovery_error,
    ))
    return task_id


def _stored_options(db: Db, options: TaskOptions, now: int) -> bytes:
    """What a new task row holds for its options: their JSON, or on a store that shares them
    (SQLite, see _task_options) a reference to their row, which this transaction writes if needed.
    Options that name map instances stay in the row (see _names_instances)."""
    data = encode_json(options)
    shared: SharedOptions | None = getattr(db, "shared_options", None)
    if shared is not None and not _names_instances(options):
        data = shared.reference(db, data, now)
    _decode_options.remember(data, options)
    return data


def _names_instances(options: TaskOptions) -> bool:
    """Whether a method loads map instances by key: such options are one entity's (an agent's tool
    Step loads its own call's record), never repeated, so they stay in their task's row."""
    return bool(options.execute.load.instances or (options.wait_for and options.wait_for.load.instances))


def stored_task_options(db: Db, stored: bytes) -> TaskOptions:
    """A task's options from its `options` column: their JSON, or a reference to their row."""
    if not is_reference(stored):
        return _decode_options(stored)
    options = _decode_options.known(stored)
    if options is None:
        options = _decode_options(options_json(db, stored))
        _decode_options.remember(stored, options)  # a reference names one value for good
    return options


def stored_options_json(db: Db, stored: bytes) -> bytes:
    """The JSON of a task's options from its `options` column (a reference read from its row)."""
    return options_json(db, stored) if is_reference(stored) else stored


def _wait_state_holds(db: Db, flow_id: str, options: MethodOptions, loaded: Sequence[tuple[str, str, bytes]]) -> bool:
    """Whether a WaitFor evaluated ahead of this commit saw the attributes it loads as they are now."""
    if options.locks:
        return False
    if options.load.mode == "none":
        return True
    return load_attributes(db, flow_id, options.load) == {(n, k): v for n, k, v in loaded}


@dataclass(frozen=True)
class _AttemptStart:
    attributes: dict[tuple[str, str], bytes]
    snapshot: bytes | None
    deadline: int | None
    method_deadline: int | None


# E15 on a backend with `lazy_snapshots` (SQLite): the snapshot column holds this marker while the
# live attribute rows still are the method's snapshot; the first write that would change a row the
# method loaded copies the rows into the column first (`_preserve_snapshots`). Most methods end
# before anything else writes what they loaded, so their snapshot is never written at all.
LIVE_SNAPSHOT = b"live"


def _encode_snapshot(attrs: dict[tuple[str, str], bytes]) -> bytes:
    return encode_json([(n, k, msgspec.Raw(v)) for (n, k), v in attrs.items()])


def _attempt_start(
    db: Db, flow_id: str, options: TaskOptions, mopts: MethodOptions, snapshot: bytes | None, now: int
) -> _AttemptStart:
    """What an attempt is handed: its method's snapshot (E15) and its deadlines."""
    if mopts.load.mode == "none":
        attrs: dict[tuple[str, str], bytes] = {}
    elif snapshot is None or snapshot == LIVE_SNAPSHOT:
        # E15: the state loaded for the method's first attempt is what every retry sees.
        attrs = load_attributes(db, flow_id, mopts.load)
        if snapshot is None:
            snapshot = LIVE_SNAPSHOT if getattr(db, "lazy_snapshots", False) else _encode_snapshot(attrs)
    else:
        attrs = {(n, k): bytes(v) for n, k, v in decode_json(snapshot, _SnapshotRows)}
    method_deadline = None if mopts.timeout_ms is None else now + mopts.timeout_ms
    hb_deadline = None if options.heartbeat_timeout_ms is None else now + options.heartbeat_timeout_ms
    deadlines = [d for d in (method_deadline, hb_deadline) if d is not None]
    return _AttemptStart(attrs, snapshot, min(deadlines) if deadlines else None, method_deadline)


class _DecodedBlobs(Generic[S]):
    """Frozen values decoded from their stored JSON bytes, remembered by those bytes: a database
    holds few distinct ones (a flow's Steps share a few option sets, flows a few configs, waits a
    few shapes), and decoding them was a visible part of every claim and commit. At most
    _DECODED_BLOBS_MAX are kept; a full cache starts over."""

    def __init__(self, value_type: type[S]) -> None:
        self._type = value_type
        self._by_blob: dict[bytes, S] = {}

    def known(self, blob: bytes) -> S | None:
        return self._by_blob.get(blob)

    def __call__(self, blob: bytes) -> S:
        value = self._by_blob.get(blob)
        if value is None:
            value = decode_json(blob, self._type)
            self.remember(blob, value)
        return value

    def remember(self, blob: bytes, value: S) -> None:
        if len(self._by_blob) >= _DECODED_BLOBS_MAX:
            self._by_blob.clear()
        self._by_blob[blob] = value


_DECODED_BLOBS_MAX = 4096
_decode_options = _DecodedBlobs(TaskOptions)
_decode_config = _DecodedBlobs(FlowConfig)
_decode_wait_spec = _DecodedBlobs(WaitSpec)


def _method_options(options: TaskOptions, method: str) -> MethodOptions:
    if method == "wait_for" and options.wait_for is not None:
        return options.wait_for
    return options.execute


def _release_locks(db: Db, task_id: int) -> None:
    if _on_postgres(db):
        # Queued without a round trip; a Step that waited for these locks is claimed by a poll.
        _send(db, "DELETE FROM locks WHERE task_id = ?", (task_id,))
        return
    released = db.all("DELETE FROM locks WHERE task_id = ? RETURNING flow_id", (task_id,))
    if released and db.one("SELECT 1 FROM tasks WHERE flow_id = ? AND state = 'ready' LIMIT 1", (released[0][0],)):
        # A ready Step of the flow may have waited for these locks: this commit claims it for its
        # worker, as it would a Step it made ready, instead of leaving it to the next housekeeping.
        db.notify()


def _locks_conflict(held: str, wanted: str) -> bool:
    """Whether two lock names exclude each other: the same lock, or a whole map's ("Tags") and one
    of its instances' ("Tags[k]"). Schema names hold no '[', so "Tags[" starts only Tags' instances."""
    return held == wanted or held.startswith(wanted + "[") or wanted.startswith(held + "[")


def _conflicting_locks_sql(column: str, names: Sequence[str]) -> tuple[str, tuple[object, ...]]:
    """A condition on the lock name `column` matching every lock that conflicts with one of `names`
    (_locks_conflict), and its parameters."""
    exact = sorted({*names, *(n.split("[", 1)[0] for n in names if "[" in n)})
    wholes = [n for n in names if "[" not in n]  # a map's instances are locked under "name[key]"
    condition = f"{column} IN ({_in(exact)})" + f" OR substr({column}, 1, ?) = ?" * len(wholes)
    return f"({condition})", (*exact, *(part for n in wholes for part in (len(n) + 1, n + "[")))


def _locks_taken(db: Db, flow_id: str, task_id: int, names: tuple[str, ...]) -> bool:
    """Whether another task holds one of these locks of the flow, or one that conflicts with it."""
    condition, params = _conflicting_locks_sql("lock_name", names)
    return bool(db.all(
        f"SELECT lock_name FROM locks WHERE flow_id = ? AND {condition} AND task_id <> ?",
        (flow_id, *params, task_id),
    ))


def load_attributes(db: Db, flow_id: str, spec: LoadSpec) -> dict[tuple[str, str], bytes]:
    """The rows `spec` names, as this transaction sees them: those this operation knows (Db.known)
    from there, the rest read (and known from then on)."""
    if spec.mode == "none":
        return {}
    known = db.known.get(flow_id)
    if known is None:
        return _read_attributes(db, flow_id, spec)
    rows, rest = known.split(spec)
    if rest is not None:
        read = _read_attributes(db, flow_id, rest)
        known.learn(rest, read)
        rows.update(read)
    return rows


def _read_attributes(db: Db, flow_id: str, spec: LoadSpec) -> dict[tuple[str, str], bytes]:
    if spec.mode == "none":
        return {}
    if spec.mode == "all":
        rows = db.all("SELECT name, key, value FROM attributes WHERE flow_id = ?", (flow_id,))
    else:
        rows = []
        if spec.names:
            rows += db.all(
                f"SELECT name, key, value FROM attributes WHERE flow_id = ? AND name IN ({_in(spec.names)})",
                (flow_id, *spec.names),
            )
        for name, key in spec.instances:
            rows += db.all(
                "SELECT name, key, value FROM attributes WHERE flow_id = ? AND name = ? AND key = ?",
                (flow_id, name, key),
            )
    return {(str(r[0]), str(r[1])): bytes(r[2]) for r in rows}


def claim(
    db: Db, worker_id: str, flow_types: Sequence[str], capacity: int, now: int, declined: Declined = (),
) -> list[Lease]:
    """Hand up to `capacity` ready attempts to `worker_id`, taking method locks and snapshots; none
    of the `declined` Steps."""
    return [write_claim(db, c) for c in claim_deferred(db, worker_id, flow_types, capacity, now, declined)]


@dataclass
class Claimed:
    """An attempt a transaction hands its worker (see claim_deferred and Handoff)."""

    lease: Lease
    # The claim is not written yet (claim_deferred): write_claim writes it, unless its Execute is
    # folded into this transaction, which then deletes the task without ever marking it running.
    deferred: _ClaimWrites | None = None
    # Created or claimed by this transaction, and no Execute folded into it since: nothing else has
    # changed its task (E2 holds without reading it back).
    fresh: bool = False


@dataclass
class _ClaimWrites:
    """What marking a claimed task running writes: its lease, deadlines, snapshot and method locks."""

    worker_id: str
    now: int
    start: _AttemptStart
    locks: tuple[str, ...]  # locks to take now ('' when the task already holds its method's locks)
    held_locks: bool  # the task already held its method's locks (a retry): commit_execute releases them
    # A row this claim skipped because it wanted one of these locks: folding this Execute (which
    # never writes them) must still let a later claim of the transaction take that row.
    blocks_others: bool = False


def claim_deferred(
    db: Db, worker_id: str, flow_types: Sequence[str], capacity: int, now: int, declined: Declined = (),
) -> list[Claimed]:
    """claim, with nothing written yet: each Claimed's `deferred` is written by write_claim, so an
    Execute folded into the claiming transaction (Step.pure_execute) never marks its task running,
    takes its locks or releases them. Locks are still checked, against the locks held and those
    the earlier claims of this call will take."""
    if capacity <= 0 or not flow_types:
        return []
    if _on_postgres(db):
        skip, skipped = _not_declined(declined)
        sql = (f"SELECT {_TASK_COLS} FROM tasks WHERE state = 'ready' AND run_at <= ? "
               f"AND flow_type IN ({_in(flow_types)}){skip} ORDER BY run_at, task_id LIMIT ?{db.skip_locked}")
    else:
        # With the flow row's state, as every SQLite operation keeps it (_know_flow_row).
        skip, skipped = _not_declined(declined, "t.")
        sql = (f"SELECT {_CLAIM_COLS}, {_FLOW_STATE_OF_F} "
               "FROM tasks t JOIN flows f ON f.flow_id = t.flow_id WHERE t.state = 'ready' AND t.run_at <= ? "
               f"AND t.flow_type IN ({_in(flow_types)}){skip} ORDER BY t.run_at, t.task_id LIMIT ?")
    rows = db.all(sql, (now, *flow_types, *skipped, capacity * CLAIM_ROWS_PER_SLOT))
    claimed: list[Claimed] = []
    taking: dict[str, dict[str, _ClaimWrites]] = {}  # by flow, the locks the claims so far will take
    for r in rows:
        if len(claimed) >= capacity:
            break
        got = _claim_row(db, r, worker_id, now, taking)
        if got is not None:
            claimed.append(got)
    return claimed


def _claim_row(
    db: Db, r: Row, worker_id: str, now: int, taking: dict[str, dict[str, _ClaimWrites]]
) -> Claimed | None:
    task_id, epoch, flow_id, flow_type, step_type, seid, method, attempt = r[:8]
    if db.skip_locked and db.one(f"SELECT 1 FROM flows WHERE flow_id = ?{db.skip_locked}", (flow_id,)) is None:
        return None  # another transaction is changing this flow: claim the task on a later poll
    if len(r) > _TASK_COL_COUNT:
        _know_flow_row(db, str(flow_id), *r[_TASK_COL_COUNT:])
    options = stored_task_options(db, bytes(r[9]))
    mopts = _method_options(options, str(method))
    locks: tuple[str, ...] = ()
    if not r[14] and mopts.locks:
        taken = taking.get(str(flow_id), {})  # this flow's alone: the scan stays short however big the claim
        blocker = next((w for held, w in taken.items() if any(_locks_conflict(held, n) for n in mopts.locks)), None)
        if blocker is not None:
            blocker.blocks_others = True
            return None
        if _locks_taken(db, str(flow_id), int(task_id), mopts.locks):
            return None
        locks = mopts.locks
    start = _attempt_start(db, str(flow_id), options, mopts, None if r[10] is None else bytes(r[10]), now)
    writes = _ClaimWrites(worker_id, now, start, locks, bool(r[14]) and bool(mopts.locks))
    for name in locks:
        taking.setdefault(str(flow_id), {})[name] = writes
    lease = Lease(
        task_id=int(task_id), lease_epoch=int(epoch) + 1, flow_id=str(flow_id), flow_type=str(flow_type),
        step_type=str(step_type), step_execution_id=str(seid),
        method="wait_for" if method == "wait_for" else "execute", attempt=int(attempt),
        input=bytes(r[8]), options=options, load=mopts.load, attributes=start.attributes,
        checkpoint=None if r[11] is None else str(r[11]),
        wait_spec=None if r[19] is None else _decode_wait_spec(bytes(r[19])),
        wait_outcome=None if r[12] is None else decode_json(r[12], WaitOutcome),
        recovery_error=None if r[13] is None else decode_json(r[13], RecoveryError),
    )
    return Claimed(lease, writes, fresh=True)


def write_claim(db: Db, claimed: Claimed) -> Lease:
    """Write a deferred claim (claim_deferred): the task runs under the lease, with its locks."""
    writes, lease = claimed.deferred, claimed.lease
    if writes is None:
        return lease
    claimed.deferred = None
    if writes.locks:
        for name in writes.locks:
            _send(db, "INSERT INTO locks (flow_id, lock_name, task_id) VALUES (?, ?, ?) ON CONFLICT DO NOTHING",
                  (lease.flow_id, name, lease.task_id))
    start = writes.start
    _send(
        db, "UPDATE tasks SET state = 'running', lease_owner = ?, lease_epoch = ?, claimed_at = ?, "
        "attempt_started = 0, method_first_at = COALESCE(method_first_at, ?), deadline_at = ?, "
        "method_deadline_at = ?, snapshot = ?" + (", locks_held = 1" if writes.locks else "") + " WHERE task_id = ?",
        (writes.worker_id, lease.lease_epoch, writes.now, writes.now, start.deadline, start.method_deadline,
         start.snapshot, lease.task_id),
    )
    return lease


def check_lease(db: Db, lease: Lease) -> None:
    """E2: only the attempt that owns the task may write (StaleAttemptError, FlowNotActiveError).

    The read also takes the flow's lock (and the task row's) on PostgreSQL: a read that waited
    for the lock re-reads both rows at their newest versions, so the epoch it checks is current."""
    _check_lease(db, lease, False)


@dataclass(frozen=True)
class _LeaseChecked:
    config: FlowConfig
    completing: bool  # graceful_complete was asked: the flow closes when its last Step ends
    # Another method of the flow may still have the live attribute rows as its snapshot
    # (LIVE_SNAPSHOT): when not, this method's writes need not preserve snapshots.
    others_live: bool


def check_lease_for_writes(db: Db, lease: Lease, deferred: bool = False) -> _LeaseChecked:
    """check_lease, and whether other methods of the flow still have the live attribute rows as
    their snapshots (see _LeaseChecked); the same statement answers both. `deferred`: the lease's
    claim is not written (claim_deferred), so its task is still ready, one epoch back."""
    return _check_lease(db, lease, getattr(db, "lazy_snapshots", False), deferred)


def _check_lease(db: Db, lease: Lease, live: bool, deferred: bool = False) -> _LeaseChecked:
    others_live = ("EXISTS (SELECT 1 FROM tasks s WHERE s.flow_id = f.flow_id AND s.snapshot = ? "
                   "AND s.task_id <> t.task_id)" if live else "1")
    postgres = _on_postgres(db)
    row_state = "" if postgres else ", " + _FLOW_STATE_OF_F
    row = db.one(
        f"SELECT t.state, t.lease_epoch, f.status, f.config, f.completing, {others_live}{row_state} FROM flows f "
        f"JOIN tasks t ON t.flow_id = f.flow_id WHERE f.flow_id = ? AND t.task_id = ?{db.for_update}",
        (LIVE_SNAPSHOT, lease.flow_id, lease.task_id) if live else (lease.flow_id, lease.task_id),
    )
    state, epoch = ("ready", lease.lease_epoch - 1) if deferred else ("running", lease.lease_epoch)
    if row is None or row[0] != state or int(row[1]) != epoch:
        raise StaleAttemptError(
            f"attempt {lease.attempt} of {lease.step_execution_id} in flow {lease.flow_id!r} "
            "no longer owns its task (cancelled, timed out, lease lost or superseded); its write was rejected"
        )
    if row[2] != "running":
        raise FlowNotActiveError(lease.flow_id, str(row[2]))
    if not postgres:
        _know_flow_row(db, lease.flow_id, *row[6:])
    return _LeaseChecked(_decode_config(bytes(row[3])), bool(row[4]), bool(row[5]))


def _release_method_locks(db: Db, lease: Lease) -> None:
    if _method_options(lease.options, lease.method).locks:
        _release_locks(db, lease.task_id)


def _mark_started(db: Db, lease: Lease) -> None:
    _send(
        db, "UPDATE tasks SET attempt_started = 1, any_started = 1 WHERE task_id = ? AND attempt_started = 0",
        (lease.task_id,),
    )


# Writes ------------------------------------------------------------------------------------


def _preserve_snapshots(db: Db, flow_id: str, written: Iterable[tuple[str, str]], own_task: int | None) -> None:
    """Before attributes change: copy the rows into the snapshot of each method whose snapshot is
    still the live rows (LIVE_SNAPSHOT) and that loaded one of them (E15). `own_task` is the task
    whose method commits these writes: its method ends with them, so its snapshot is not needed."""
    rows = db.all("SELECT task_id, method, options FROM tasks WHERE flow_id = ? AND snapshot = ?",
                  (flow_id, LIVE_SNAPSHOT))
    if not rows:
        return
    names = list(written)
    for task_id, method, options_blob in rows:
        if own_task is not None and int(task_id) == own_task:
            continue
        load = _method_options(stored_task_options(db, bytes(options_blob)), str(method)).load
        if any(load.loads(name, key) for name, key in names):
            attrs = load_attributes(db, flow_id, load)
            _send(db, "UPDATE tasks SET snapshot = ? WHERE task_id = ?", (_encode_snapshot(attrs), task_id))


def apply_writes(
    db: Db, flow_id: str, writes: WriteSet, seid: str, attempt: int, now: int, task_id: int | None = None,
    others_live: bool = True,
) -> None:
    """Apply a method's or RPC's buffered writes; `task_id` is the committing task, if any.
    `others_live` False: no other method has the live rows as its snapshot (check_lease_for_writes)."""
    if writes.attributes and others_live and getattr(db, "lazy_snapshots", False):
        _preserve_snapshots(db, flow_id, writes.attributes, task_id)
    if writes.attributes:
        known = db.known.get(flow_id, _UNSEEN)
        if known is _UNSEEN:
            db.known[flow_id] = None  # written before its version was read: its rows are not known
        elif known is not None:
            known.apply(writes.attributes)
    # A few statements for all of them: sets in multi-row upserts, deletes in multi-row deletes.
    sets = [(name, key, value) for (name, key), value in writes.attributes.items() if value is not None]
    deletes = [(name, key) for (name, key), value in writes.attributes.items() if value is None]
    for i in range(0, len(deletes), ROWS_PER_STATEMENT):
        gone = deletes[i:i + ROWS_PER_STATEMENT]
        _send(db, "DELETE FROM attributes WHERE flow_id = ? AND (name, key) IN (VALUES "
              + _rows_of(2, len(gone)) + ")", [flow_id, *(x for row in gone for x in row)])
    for i in range(0, len(sets), ROWS_PER_STATEMENT):
        part = sets[i:i + ROWS_PER_STATEMENT]
        params: list[Any] = []
        for name, key, value in part:
            params += (flow_id, name, key, value)
        _send(
            db, "INSERT INTO attributes (flow_id, name, key, value) VALUES "
            + _rows_of(4, len(part))
            + " ON CONFLICT (flow_id, name, key) DO UPDATE SET value = excluded.value",
            params,
        )
    for channel, key, message_id in writes.deleted_messages:
        # An ID no message can have is not looked up: SQLite would raise OverflowError where
        # PostgreSQL finds nothing (RpcContext.delete_message took only whole numbers).
        if not 0 < message_id <= MAX_MESSAGE_ID or not db.run(
            "DELETE FROM channel_messages WHERE message_id = ? AND flow_id = ? AND channel = ? AND key = ?",
            (message_id, flow_id, channel, key),
        ):
            raise ChannelMessageNotFoundError(channel if not key else f"{channel}[{key}]", message_id)
    unstored: list[UnstoredMessage] | None = getattr(db, "unstored", None)
    for channel, key, value in writes.publishes:
        if unstored is not None:
            unstored.append(UnstoredMessage(flow_id, channel, key, value, now))
            continue
        _send(
            db, "INSERT INTO channel_messages (flow_id, channel, key, value, created_at) VALUES (?, ?, ?, ?, ?)",
            (flow_id, channel, key, value, now),
        )
    append_writes(db, flow_id, writes.appends, seid, attempt)


@dataclass
class UnstoredMessage:
    """A channel message an operation published and has not written yet (Db.unstored). Its ID is
    taken from the channel_messages sequence when a wait of the operation first looks at it, so it
    sorts after every message stored before it and before every one published after it."""

    flow_id: str
    channel: str
    key: str
    value: bytes
    created_at: int
    message_id: int | None = None


def _number_unstored(db: Db, unstored: list[UnstoredMessage]) -> None:
    """Give IDs, in publish order, to the unstored messages without one, from the sequence an
    insert into channel_messages would take them from (AUTOINCREMENT: never one used before)."""
    fresh = [m for m in unstored if m.message_id is None]
    if not fresh:
        return
    row = db.one("UPDATE sqlite_sequence SET seq = seq + ? WHERE name = 'channel_messages' RETURNING seq",
                 (len(fresh),))
    if row is None:  # no message was ever stored: the table is empty and has no sequence yet
        db.run("INSERT INTO sqlite_sequence (name, seq) VALUES ('channel_messages', ?)", (len(fresh),))
        row = (len(fresh),)
    for message_id, message in enumerate(fresh, start=int(row[0]) - len(fresh) + 1):
        message.message_id = message_id


def flush_messages(db: Db) -> None:
    """Write the messages of this operation that no wait of it took (Db.unstored), in publish order,
    each with the ID a wait saw, if one looked at it."""
    unstored: list[UnstoredMessage] | None = getattr(db, "unstored", None)
    if not unstored:
        return
    pending = list(unstored)
    unstored.clear()
    for m in pending:
        db.run("INSERT INTO channel_messages (message_id, flow_id, channel, key, value, created_at) "
               "VALUES (?, ?, ?, ?, ?, ?)", (m.message_id, m.flow_id, m.channel, m.key, m.value, m.created_at))


def append_writes(
    db: Db, flow_id: str, appends: Sequence[tuple[str, int, bytes]], seid: str, attempt: int
) -> None:
    """Queue a method's events (stream, capacity, value) for this operation's end (flush_appends)."""
    db.appends.extend((flow_id, stream, capacity, seid, attempt, value) for stream, capacity, value in appends)


def flush_appends(db: Db) -> None:
    """Write the queued stream events: per flow and stream, in queue order, one sequence update
    and one insert. A commit that folds several Steps (each appending) thus appends once."""
    if not db.appends:
        return
    pending, db.appends = db.appends, []
    by_stream: dict[tuple[str, str], tuple[int, list[tuple[str, int, bytes]]]] = {}
    for flow_id, stream, capacity, seid, attempt, value in pending:
        known = by_stream.get((flow_id, stream))
        if known is None:
            by_stream[(flow_id, stream)] = (capacity, [(seid, attempt, value)])
        else:
            known[1].append((seid, attempt, value))
    for (flow_id, stream), (capacity, events) in by_stream.items():
        append_events(db, flow_id, stream, capacity, events)


def append_events(
    db: Db, flow_id: str, stream: str, capacity: int, events: Iterable[tuple[str, int, bytes]]
) -> None:
    rows = list(events)
    if not rows:
        return
    size = sum(len(value) for _seid, _attempt, value in rows)
    if _on_postgres(db):
        # One statement both reserves the sequences and reads where the stream stands.
        row = db.one(
            "UPDATE streams SET next_seq = next_seq + ?, total_bytes = total_bytes + ? "
            "WHERE flow_id = ? AND stream = ? RETURNING next_seq, first_seq, total_bytes",
            (len(rows), size, flow_id, stream),
        )
        if row is None:
            next_seq, first_seq, total = 1 + len(rows), 1, size
            _send(db, "INSERT INTO streams (flow_id, stream, next_seq, first_seq, total_bytes) VALUES (?, ?, ?, 1, ?)",
                  (flow_id, stream, next_seq, total))
        else:
            next_seq, first_seq, total = int(row[0]), int(row[1]), int(row[2])
    else:
        # The flow row holds the positions (see Db.streams): no statement of their own.
        positions = stream_positions(db, flow_id)
        next_seq, first_seq, total = positions.get(stream, (1, 1, 0))
        next_seq, total = next_seq + len(rows), total + size
    first_new = next_seq - len(rows)
    for start in range(0, len(rows), ROWS_PER_STATEMENT):  # a burst of events: over a statement's parameter limit
        part = rows[start:start + ROWS_PER_STATEMENT]
        params: list[Any] = []
        for seq, (seid, attempt, value) in enumerate(part, start=first_new + start):
            params += (flow_id, stream, seq, seid, attempt, value)
        _send(
            db, "INSERT INTO stream_events (flow_id, stream, seq, step_execution_id, attempt, value) VALUES "
            + _rows_of(6, len(part)),
            params,
        )
    trimmed = total > capacity
    if trimmed:
        cut = _trim_stream(db, flow_id, stream, total - capacity, next_seq - 1)
        if cut is not None:
            first_seq, total = cut[0] + 1, total - cut[1]
    if not _on_postgres(db):
        db.streams[flow_id][stream] = [next_seq, first_seq, total]
        db.streamed.add(flow_id)
    elif trimmed:
        _send(db, "UPDATE streams SET next_seq = ?, first_seq = ?, total_bytes = ? WHERE flow_id = ? AND stream = ?",
              (next_seq, first_seq, total, flow_id, stream))


def _trim_stream(db: Db, flow_id: str, stream: str, excess: int, newest: int) -> tuple[int, int] | None:
    """E11: delete a stream's oldest events whose bytes add up to at least `excess`, never the newest
    (sequence `newest`). Returns (the last sequence deleted, the bytes deleted); None: nothing to delete.

    One statement finds the cut, one range delete makes it, however many events go."""
    # The running total over the oldest events crosses `excess` at exactly one event (sizes are
    # positive), so LIMIT 1 needs no ORDER BY, which would sort every event first: read oldest first
    # through the key, the window stops at that event.
    row = db.one(
        "SELECT seq, freed FROM (SELECT seq, LENGTH(value) AS size, SUM(LENGTH(value)) OVER (ORDER BY seq ROWS "
        "UNBOUNDED PRECEDING) AS freed FROM stream_events WHERE flow_id = ? AND stream = ? AND seq < ?) AS oldest "
        "WHERE freed >= ? AND freed - size < ? LIMIT 1",
        (flow_id, stream, newest, excess, excess),
    )
    if row is None:
        # The events before the newest hold fewer bytes than that: all of them go.
        row = db.one("SELECT MAX(seq), SUM(LENGTH(value)) FROM stream_events WHERE flow_id = ? AND stream = ? "
                     "AND seq < ?", (flow_id, stream, newest))
        if row is None or row[0] is None:
            return None
    cut, freed = int(row[0]), int(row[1])
    _send(db, "DELETE FROM stream_events WHERE flow_id = ? AND stream = ? AND seq <= ?", (flow_id, stream, cut))
    return cut, freed


# PostgreSQL's read of a stream page, in one statement: the flow (type, status, start), where the
# stream starts (NULL: it never had an event) and its events from the reader's last one on, each row
# holding the first three. One statement because each of PostgreSQL's statements sees the latest
# commit: read apart, an append that trimmed the reader's last event away between the read of the
# stream's start and that of its events made the event look lost (not trimmed), as after a database
# crash. SQLite reads one snapshot (BEGIN) whatever the statements.
_PG_EVENT_PAGE = (
    "SELECT f.flow_type, f.status, f.created_at, s.first_seq, e.seq, e.step_execution_id, e.attempt, e.value "
    "FROM flows f LEFT JOIN streams s ON s.flow_id = f.flow_id AND s.stream = ? "
    "LEFT JOIN LATERAL (SELECT seq, step_execution_id, attempt, value FROM stream_events "
    "WHERE flow_id = s.flow_id AND stream = s.stream AND seq >= ? ORDER BY seq LIMIT ?) e ON TRUE "
    "WHERE f.flow_id = ? ORDER BY e.seq"
)


def read_events(db: Db, flow_id: str, stream: str, after: int, limit: int,
                flow_type: str | None = None) -> EventPage:
    # From `after` itself, in the same statement: the reader's last event, to tell it is still there.
    if _on_postgres(db):
        rows = db.all(_PG_EVENT_PAGE, (stream, after, limit + 1, flow_id))
        if not rows:
            raise FlowNotFoundError(flow_id)
        head = rows[0]
        _check_type(str(head[0]), flow_type)
        started, closed = int(head[2]), head[1] != "running"
        if head[3] is None:
            return EventPage([], 1, 1, started, closed)
        first = int(head[3])
        events = [StoredEvent(int(r[4]), str(r[5]), int(r[6]), bytes(r[7])) for r in rows if r[4] is not None]
    else:
        _, started, status = existing_flow(db, flow_id, flow_type)
        closed = status != "running"
        # The flow row holds the positions (see Db.streams): no statement of their own.
        known = stream_positions(db, flow_id).get(stream)
        if known is None:
            return EventPage([], 1, 1, started, closed)
        first = known[1]
        rows = db.all(
            "SELECT seq, step_execution_id, attempt, value FROM stream_events "
            "WHERE flow_id = ? AND stream = ? AND seq >= ? ORDER BY seq LIMIT ?",
            (flow_id, stream, after, limit + 1),
        )
        events = [StoredEvent(int(r[0]), str(r[1]), int(r[2]), bytes(r[3])) for r in rows]
    at_after = events.pop(0) if events and events[0].sequence == after else None
    events = events[:limit]
    next_seq = events[-1].sequence + 1 if events else max(after + 1, first)
    return EventPage(events, next_seq, first, started, closed, at_after)


# The newest sequence of each (flow, stream) of a JSON array of [flow, stream] pairs, by its index
# there, and the flow's start: primary key lookups per pair (no such event: a NULL sequence; no
# such flow, or one not running: no row).
_NEWEST_SEQUENCES = (
    "SELECT k.key, (SELECT MAX(seq) FROM stream_events e WHERE e.flow_id = f.flow_id "
    "AND e.stream = json_extract(k.value, '$[1]')), f.created_at FROM json_each(?) k "
    "JOIN flows f ON f.flow_id = json_extract(k.value, '$[0]') AND f.status = 'running'"
)
# PostgreSQL's: the pairs as two text arrays, numbered from 1.
_PG_NEWEST_SEQUENCES = (
    "SELECT k.i - 1, (SELECT MAX(seq) FROM stream_events e WHERE e.flow_id = k.flow_id AND e.stream = k.stream), "
    "f.created_at FROM unnest(?::text[], ?::text[]) WITH ORDINALITY AS k(flow_id, stream, i) "
    "JOIN flows f ON f.flow_id = k.flow_id AND f.status = 'running'"
)


def newest_sequences(db: Db, keys: Sequence[tuple[str, str]]) -> list[tuple[int, int] | None]:
    """For each (flow, stream) in `keys`, in their order: the stream's newest sequence (0: no event)
    and the flow's start (ms), or None when the flow is closed or gone, so no event can come. One
    statement however many keys: long-polling readers share it."""
    if not keys:
        return []
    if _on_postgres(db):
        rows = db.all(_PG_NEWEST_SEQUENCES, ([f for f, _ in keys], [s for _, s in keys]))
    else:
        rows = db.all(_NEWEST_SEQUENCES, (encode_json([list(key) for key in keys]).decode(),))
    newest: list[tuple[int, int] | None] = [None] * len(keys)
    for index, seq, created_at in rows:
        newest[int(index)] = (0 if seq is None else int(seq), int(created_at))
    return newest


# Waits (E5, E6) ------------------------------------------------------------------------------


# PostgreSQL reads a flow's waiting tasks and the queued messages their channel conditions name in
# one round trip: the server takes the channel instances out of the stored wait specs (JSON, with
# an empty key omitted). Waits come first, oldest first; then messages, oldest first.
_PG_WAITS_AND_MESSAGES = (
    "WITH w AS MATERIALIZED (SELECT task_id, step_type, step_execution_id, wait_spec, wait_registered_at, "
    "timers_skipped, timer_due_at FROM tasks WHERE flow_id = ? AND state = 'waiting'{only}), "
    "c AS (SELECT DISTINCT e ->> 'channel' AS channel, coalesce(e ->> 'key', '') AS key "
    "FROM w, jsonb_array_elements(convert_from(w.wait_spec, 'UTF8')::jsonb -> 'conditions') e "
    "WHERE e ->> 'kind' = 'channel') "
    "SELECT 0, task_id, step_type, step_execution_id, wait_spec, wait_registered_at, timers_skipped, timer_due_at "
    "FROM w UNION ALL "
    "SELECT 1, m.message_id, m.channel, m.key, m.value, NULL, NULL, NULL FROM channel_messages m "
    "JOIN c ON m.channel = c.channel AND m.key = c.key WHERE m.flow_id = ? ORDER BY 1, 6, 2"
)


def _channel_needle(channel: str, key: str) -> bytes:
    """Bytes every stored condition on the instance (channel, key) contains (with an empty key, every
    condition on the channel does): its encoding up to its key, as the fields after it are omitted
    or come later. The test of evaluate_waits checks this against encoded conditions."""
    return encode_json(ConditionSpec(kind="channel", channel=channel, key=key))[:-1]


def _only_changed(
    db: Db, published: Collection[tuple[str, str]] | None, now: int,
) -> tuple[str, list[object]]:
    """The SQL condition (with its parameters) that keeps the waits an operation may have made
    satisfiable: those naming an instance it published to, those it registered (at `now`; one
    registered later, after a clock step back, is kept too), and those with a timer due. The rest
    stay unsatisfiable: each wait was evaluated when it was registered and after each message to
    what it names, and taking messages satisfies none. None or too many instances: no condition."""
    if published is None or len(published) > MOST_PUBLISHED_INSTANCES_NAMED:
        return "", []
    found = "position(? in wait_spec) > 0" if _on_postgres(db) else "instr(wait_spec, ?) > 0"
    terms = ["timer_due_at <= ?", "wait_registered_at >= ?", *(found for _ in published)]
    return " AND (" + " OR ".join(terms) + ")", [now, now, *(_channel_needle(c, k) for c, k in published)]


def _waits_and_messages(
    db: Db, flow_id: str, now: int, published: Collection[tuple[str, str]] | None,
) -> tuple[list[Row], list[Row] | None]:
    """The flow's waiting tasks that `published` may have made satisfiable (_only_changed; None: all),
    oldest first, and on PostgreSQL also the queued messages their channel conditions name, as
    (channel, key, message_id, value) in message order (None elsewhere: evaluate_waits reads them
    once it knows the channel instances)."""
    only, params = _only_changed(db, published, now)
    if not _on_postgres(db):
        return db.all(
            "SELECT task_id, step_type, step_execution_id, wait_spec, wait_registered_at, timers_skipped, "
            f"timer_due_at FROM tasks WHERE flow_id = ? AND state = 'waiting'{only} "
            "ORDER BY wait_registered_at, task_id",
            (flow_id, *params),
        ), None
    rows = db.all(_PG_WAITS_AND_MESSAGES.format(only=only), (flow_id, *params, flow_id))
    return ([tuple(r[1:]) for r in rows if r[0] == 0],
            [(r[2], r[3], r[1], r[4]) for r in rows if r[0] == 1])


def evaluate_waits(db: Db, flow_id: str, now: int, published: Collection[tuple[str, str]] | None = None) -> int:
    """Satisfy every waiting task of the flow that can be, oldest first; return how many.
    `published`, the channel instances this operation published to, reads only the waits it can have
    made satisfiable (_only_changed), so that a wide fan-out's commits do not each read every wait;
    an operation that changes waits otherwise than by publishing and registering them (at `now`)
    passes None, and every wait is read."""
    count = 0
    rows, messages = _waits_and_messages(db, flow_id, now, published)
    if not rows:
        return 0
    waits = [(row, _decode_wait_spec(bytes(row[3]))) for row in rows]
    # Every channel instance any of the waits names, read in one statement (per 200 instances; on
    # PostgreSQL already read with the waits); each wait that consumes takes its messages out of
    # these queues for the waits after it.
    idents = sorted({(c.channel, c.key) for _row, spec in waits for c in spec.conditions if c.kind == "channel"})
    queued: dict[tuple[str, str], list[int]] = {ident: [] for ident in idents}
    bodies: dict[int, bytes] = {}
    if messages is None:
        messages = []
        for i in range(0, len(idents), ROWS_PER_STATEMENT):
            part = idents[i:i + ROWS_PER_STATEMENT]
            messages += db.all(
                "SELECT channel, key, message_id, value FROM channel_messages WHERE flow_id = ? AND (channel, key) "
                "IN (VALUES " + _rows_of(2, len(part)) + ") ORDER BY message_id",
                [flow_id, *(x for ident in part for x in ident)],
            )
    for channel, key, mid, value in messages:
        queued[(str(channel), str(key))].append(int(mid))
        bodies[int(mid)] = bytes(value)
    # This operation's own messages come after the stored ones; one a wait takes is never written.
    unstored: list[UnstoredMessage] | None = getattr(db, "unstored", None)
    mine = [m for m in unstored if m.flow_id == flow_id and (m.channel, m.key) in queued] if unstored else []
    if mine:
        assert unstored is not None
        _number_unstored(db, unstored)
        for m in mine:
            assert m.message_id is not None
            queued[(m.channel, m.key)].append(m.message_id)
            bodies[m.message_id] = m.value
    unstored_ids = {m.message_id for m in mine}
    for (task_id, step_type, seid, _blob, registered_at, skipped, due_at), spec in waits:
        fired = {
            i for i, c in enumerate(spec.conditions)
            if c.kind == "timer" and (skipped or int(registered_at) + c.seconds * 1000 <= now)
        }
        selection = select_wait(spec, queued, fired)
        if selection is None:
            # An all_of wait whose first timers fired waits on the rest: point the timer index at
            # the next one, so housekeeping does not re-evaluate this wait until then.
            pending = [int(registered_at) + c.seconds * 1000 for i, c in enumerate(spec.conditions)
                       if c.kind == "timer" and i not in fired]
            next_due = min(pending) if pending else None
            if next_due != due_at:
                _send(db, "UPDATE tasks SET timer_due_at = ? WHERE task_id = ?", (next_due, task_id))
            continue
        consumed: list[tuple[ConsumedMessage, ...]] = []
        for i, cond in enumerate(spec.conditions):
            ids = selection.take.get(i, [])
            consumed.append(tuple(ConsumedMessage(mid, msgspec.Raw(bodies[mid])) for mid in ids))
            if ids:
                stored = [mid for mid in ids if mid not in unstored_ids]
                # ROWS_PER_STATEMENT at a time: a wait for "all queued" (at_most(n)) may take more
                # messages than a statement takes parameters.
                for at in range(0, len(stored), ROWS_PER_STATEMENT):
                    taken_part = stored[at:at + ROWS_PER_STATEMENT]
                    _send(db, f"DELETE FROM channel_messages WHERE message_id IN ({_in(taken_part)})", taken_part)
                if unstored is not None and len(stored) < len(ids):
                    unstored[:] = [m for m in unstored if m.message_id not in ids]
                taken = set(ids)
                ident = (cond.channel, cond.key)
                queued[ident] = [mid for mid in queued[ident] if mid not in taken]
        outcome = WaitOutcome(
            satisfied=selection.satisfied, consumed=tuple(consumed),
            fired_timers=selection.fired_timers, skipped=selection.skipped,
        )
        _send(
            db, "UPDATE tasks SET state = 'ready', method = 'execute', attempt = 1, attempt_started = 0, "
            "any_started = 0, method_first_at = NULL, snapshot = NULL, checkpoint = NULL, run_at = ?, "
            "wait_outcome = ?, timer_due_at = NULL, last_error = NULL WHERE task_id = ?",
            (now, encode_json(outcome), task_id),
        )
        _history(db, flow_id, str(step_type), str(seid), WAIT_COMPLETED, 0, now,
                 "skipped" if selection.skipped else f"satisfied {list(selection.satisfied)}")
        db.notify()
        count += 1
    return count


def skip_timer(db: Db, flow_id: str, step_execution_id: str, now: int) -> None:
    require_running(db, flow_id)
    row = db.one(
        "SELECT task_id, wait_spec FROM tasks WHERE flow_id = ? AND step_execution_id = ? AND state = 'waiting'",
        (flow_id, step_execution_id),
    )
    if row is None:
        raise StepNotWaitingError(flow_id, step_execution_id)
    if not any(c.kind == "timer" for c in decode_json(row[1], WaitSpec).conditions):
        raise StepNotWaitingError(flow_id, step_execution_id, "waits on no timer")
    _send(db, "UPDATE tasks SET timers_skipped = 1 WHERE task_id = ?", (row[0],))
    evaluate_waits(db, flow_id, now)
    bump(db, flow_id)


# Commits of Step methods -------------------------------------------------------------------


def _first_timer_due(spec: WaitSpec, registered_at: int) -> int | None:
    """When a wait registered at `registered_at` (ms) is first due: at its earliest timer; None without one."""
    timers = [c.seconds for c in spec.conditions if c.kind == "timer"]
    return registered_at + min(timers) * 1000 if timers else None


def _instances(writes: WriteSet) -> set[tuple[str, str]]:
    """The channel instances `writes` publishes to (evaluate_waits)."""
    return {(channel, key) for channel, key, _value in writes.publishes}


def commit_wait_for(db: Db, lease: Lease, writes: WriteSet, spec: WaitSpec, now: int) -> None:
    checked = check_lease_for_writes(db, lease)
    apply_writes(db, lease.flow_id, writes, lease.step_execution_id, lease.attempt, now, lease.task_id,
                 checked.others_live)
    _release_method_locks(db, lease)
    _send(
        db, "UPDATE tasks SET state = 'waiting', method = 'execute', lease_owner = NULL, locks_held = 0, "
        "wait_spec = ?, wait_registered_at = ?, timer_due_at = ?, deadline_at = NULL, snapshot = NULL, "
        "checkpoint = NULL WHERE task_id = ?",
        (encode_json(spec), now, _first_timer_due(spec, now), lease.task_id),
    )
    _history(db, lease.flow_id, lease.step_type, lease.step_execution_id, WAIT_REGISTERED, lease.attempt, now)
    evaluate_waits(db, lease.flow_id, now, _instances(writes))


def commit_execute(
    db: Db, lease: Lease, writes: WriteSet, decision: DecisionRecord, now: int, handoff: Handoff | None = None,
    claimed: Claimed | None = None,
) -> None:
    """Commit an Execute's writes and decision. `claimed`: how this transaction claimed the lease,
    when it did (an Execute folded into it, Step.pure_execute)."""
    deferred = None if claimed is None else claimed.deferred
    checked = check_lease_for_writes(db, lease, deferred is not None)
    apply_writes(db, lease.flow_id, writes, lease.step_execution_id, lease.attempt, now, lease.task_id,
                 checked.others_live)
    if deferred is None:
        _release_method_locks(db, lease)
    else:
        if deferred.held_locks:
            _release_locks(db, lease.task_id)
        if deferred.blocks_others:
            db.notify()  # a ready Step this claim kept from its locks can be claimed now
    _send(db, "DELETE FROM tasks WHERE task_id = ?", (lease.task_id,))
    _history(db, lease.flow_id, lease.step_type, lease.step_execution_id, EXECUTE_COMPLETED, lease.attempt, now,
             decision.kind)
    apply_decision(db, lease.flow_id, lease.flow_type, decision, now, checked.config, handoff)
    if decision.kind in ("force_complete", "force_fail"):
        return
    if writes.publishes or any(m.wait is not None for m in decision.movements):
        evaluate_waits(db, lease.flow_id, now, _instances(writes))
    if checked.completing or decision.kind == "graceful_complete":
        _maybe_complete(db, lease.flow_id, now)


def commit_folded(
    db: Db, claimed: Claimed, writes: WriteSet, decision: DecisionRecord, now: int, handoff: Handoff
) -> bool:
    """commit_execute for an Execute run inside the transaction that claimed it (Step.pure_execute),
    in a savepoint: when it fails, nothing of it stays and False says the Step runs as usual."""
    if _in_savepoint(db, lambda: commit_execute(db, claimed.lease, writes, decision, now, handoff, claimed)):
        return True
    handoff.leases.clear()
    return False


def heartbeat_folded(db: Db, claimed: Claimed, started: StartedFold, now: int) -> bool:
    """The first heartbeat of a handler run inside the transaction that claimed it, up to that
    heartbeat (Step.pure_until_heartbeat): False when it fails, and nothing of it stays. Its claim
    must be written (write_claim)."""
    lease = claimed.lease
    if not claimed.fresh:
        return _in_savepoint(db, lambda: heartbeat(db, lease, started.checkpoint, now, started.events))
    # Its task is as this transaction made it (E2 holds unread), its events are queued (undone
    # below) and its one statement is atomic: no savepoint needed.
    history, appends = len(db.history), len(db.appends)
    try:
        heartbeat(db, lease, started.checkpoint, now, started.events, checked=True)
    except Exception:
        del db.history[history:]
        del db.appends[appends:]
        return False
    return True


def _in_savepoint(db: Db, fn: Callable[[], object]) -> bool:
    """Run `fn` in a savepoint of the open transaction: False, with its statements, events and
    history undone, when it raises."""
    history, appends = len(db.history), len(db.appends)
    counters, counted = {f: dict(c) for f, c in db.counters.items()}, set(db.counted)
    streams = {f: {name: list(at) for name, at in by_name.items()} for f, by_name in db.streams.items()}
    streamed = set(db.streamed)
    # The messages as they were, IDs too: the rollback also undoes the sequence the IDs came from.
    unstored: list[UnstoredMessage] | None = getattr(db, "unstored", None)
    kept = None if unstored is None else [dataclasses.replace(m) for m in unstored]
    db.run("SAVEPOINT fold_execute")
    try:
        fn()
    except Exception:
        db.run("ROLLBACK TO fold_execute")
        db.run("RELEASE fold_execute")
        if unstored is not None and kept is not None:
            unstored[:] = kept
        shared: SharedOptions | None = getattr(db, "shared_options", None)
        if shared is not None:
            shared.rolled_back()  # the task_options rows it wrote are gone with it
        del db.history[history:]
        del db.appends[appends:]
        db.counters, db.counted = counters, counted
        db.streams, db.streamed = streams, streamed
        # Its writes were applied to the known rows: this operation no longer knows them (Db.known).
        for flow_id in db.known:
            db.known[flow_id] = None
        return False
    db.run("RELEASE fold_execute")
    return True


def apply_decision(
    db: Db, flow_id: str, flow_type: str, decision: DecisionRecord, now: int, config: FlowConfig | None = None,
    handoff: Handoff | None = None,
) -> None:
    if decision.kind == "force_complete":
        close_flow(db, flow_id, "completed", decision.output, None, now)
        return
    if decision.kind == "force_fail":
        close_flow(db, flow_id, "failed", None, decision.reason, now)
        return
    # E9: cancel first, so Steps this decision starts are not affected.
    if decision.canceling_steps:
        cancel_step_types(db, flow_id, decision.canceling_steps, now)
    for movement in decision.movements:
        create_task(db, flow_id, flow_type, movement, now, config=config, handoff=handoff)
    if decision.kind == "graceful_complete":
        _send(db, "UPDATE flows SET completing = 1, completion_output = ? WHERE flow_id = ?",
               (decision.output, flow_id))


def cancel_step_types(db: Db, flow_id: str, step_types: Sequence[str], now: int) -> None:
    rows = db.all(
        f"SELECT task_id FROM tasks WHERE flow_id = ? AND step_type IN ({_in(step_types)}) ORDER BY task_id",
        (flow_id, *step_types),
    )
    for (task_id,) in rows:
        _cancel_task(db, int(task_id), now, "cancelled")


def _cancel_task(db: Db, task_id: int, now: int, detail: str) -> None:
    row = db.one("SELECT flow_id, step_type, step_execution_id, attempt, state FROM tasks WHERE task_id = ?",
                 (task_id,))
    if row is None:
        return
    _release_locks(db, task_id)
    _send(db, "DELETE FROM tasks WHERE task_id = ?", (task_id,))
    if row[4] == "running":
        db.revoked()
    _history(db, str(row[0]), str(row[1]), str(row[2]), STEP_CANCELLED, int(row[3]), now, detail)


# Failures, retries, failure routes (E3, E4) --------------------------------------------------


def fail_attempt(
    db: Db, lease: Lease, error: ErrorInfo, no_retry: bool, now: int, asked: AskedDelay | None = None
) -> None:
    check_lease(db, lease)
    _fail_task(db, lease.task_id, error, no_retry, now, asked)


def _fail_task(
    db: Db, task_id: int, error: ErrorInfo, no_retry: bool, now: int, asked: AskedDelay | None = None
) -> None:
    """Fail the task's running attempt: its retry, or its failure route, or the flow fails (E4).
    `asked`: the delay its error asked for before the retry (RetryAfterError), told in its history."""
    error = ErrorInfo(error.error_type, _error_text(error.detail))  # kept for the retry and failure route too
    row = db.one(
        "SELECT flow_id, flow_type, step_type, step_execution_id, method, attempt, options, input, "
        "method_first_at, any_started, attempt_started, retry_ending FROM tasks WHERE task_id = ?",
        (task_id,),
    )
    assert row is not None
    flow_id, flow_type, step_type, seid, method, attempt = (str(row[0]), str(row[1]), str(row[2]),
                                                            str(row[3]), str(row[4]), int(row[5]))
    options = stored_task_options(db, bytes(row[6]))
    started = bool(row[9]) or bool(row[10])
    # An RPC ended this execution's retries while this attempt ran or waited to run (end_retry_waits).
    retry_ended_by = None if row[11] is None else str(row[11])
    db.revoked()  # a running attempt fails: its own worker's, or one timed out or orphaned
    policy = _method_options(options, method).retry
    decision = decide_retry(policy, attempt=attempt, first_started_ms=int(row[8] or now), now_ms=now,
                            no_retry=no_retry, asked_delay_ms=None if asked is None else asked.delay_ms)
    failed = f"{method}: {error.error_type}: {error.detail}"
    if asked is not None:
        # Operators read here why the retry waited longer than the policy's interval (or did not).
        retries = decision.retry and retry_ended_by is None
        waits = f": the next attempt is due in {(decision.run_at_ms - now) / 1000:g} s" if retries else ""
        failed = _with_note(failed, f" ({asked.note}{waits})")
    _history(db, flow_id, step_type, seid, ATTEMPT_FAILED, attempt, now, failed)
    if decision.asked_past_budget:
        assert asked is not None and policy.total_duration_seconds is not None
        # Failed now, and saying why: the error asked for a wait that ends past the budget.
        error = ErrorInfo(error.error_type, _with_note(error.detail, (
            f" ({asked.note}, past the end of the retry policy's total duration of "
            f"{policy.total_duration_seconds:g} s from the first attempt's start, so no retry was made)")))
    if decision.retry and retry_ended_by is not None:
        # It ends as one that waited for its retry at that RPC's commit would have.
        error = _retry_wait_ended(retry_ended_by, error)
    elif decision.retry:
        _send(
            db, "UPDATE tasks SET state = 'ready', attempt = attempt + 1, attempt_started = 0, run_at = ?, "
            "lease_owner = NULL, deadline_at = NULL, last_error = ? WHERE task_id = ?",
            (decision.run_at_ms, encode_json(error), task_id),
        )
        return  # its attempt_failed entry bumps the version (flush_history)
    _end_failed_task(db, task_id, (flow_id, flow_type, step_type, seid, method), attempt, started, options,
                     bytes(row[7]), error, now)


def _end_failed_task(
    db: Db, task_id: int, names: tuple[str, str, str, str, str], attempts: int, started: bool,
    options: TaskOptions, input_value: bytes, error: ErrorInfo, now: int,
) -> bool:
    """A Step method failed for good after `attempts` attempts: its failure route starts with the
    recovery error, else the flow fails (E4); True in that case. `names`: flow ID, flow type, Step
    type, execution, method."""
    flow_id, flow_type, step_type, seid, method = names
    _release_locks(db, task_id)
    _send(db, "DELETE FROM tasks WHERE task_id = ?", (task_id,))
    recovery = RecoveryError(
        step_type=step_type, step_execution_id=seid,
        method="wait_for" if method == "wait_for" else "execute", attempts=attempts,
        attempt_progress=AttemptProgress.NOT_COMPLETED if started else AttemptProgress.NOT_STARTED,
        error_type=error.error_type, detail=error.detail,
    )
    _history(db, flow_id, step_type, seid, STEP_FAILED, attempts, now,
             f"{recovery.attempt_progress}: {error.error_type}: {error.detail}")
    if options.failure_route is not None and options.failure_route_options is not None:
        route = MovementRecord(options.failure_route, input_value, options.failure_route_options)
        create_task(db, flow_id, flow_type, route, now, recovery)
        return False  # its step_failed entry bumps the version (flush_history)
    close_flow(db, flow_id, "failed", None,
               f"Step {seid} failed after {attempts} attempt(s): {error.error_type}: {error.detail}", now)
    return True


def end_retry_waits(db: Db, flow_id: str, ending: RetryWaitEnding, now: int) -> bool:
    """End now, as if their retries were spent, the executions of `ending`'s Step types that wait
    for a retry (ready after a failed attempt, none running): each goes to its failure route with its
    last attempt's error after `ending.reason`. A running attempt is left alone: it may be taking
    effect, and it decides its own end. True when one without a failure route failed the flow: the
    flow is closed, its other Steps cancelled with it, and nothing more may start in it."""
    step_types = ending.step_types
    rows = db.all(
        "SELECT task_id, flow_type, step_type, step_execution_id, method, attempt, options, input, any_started, "
        f"last_error FROM tasks WHERE flow_id = ? AND state = 'ready' AND attempt > 1 "
        f"AND step_type IN ({_in(step_types)}) ORDER BY task_id",
        (flow_id, *step_types),
    )
    for row in rows:
        last = None if row[9] is None else decode_json(bytes(row[9]), ErrorInfo)
        error = (ErrorInfo("RetryWaitEnded", _error_text(ending.reason)) if last is None
                 else _retry_wait_ended(ending.reason, last))
        if _end_failed_task(db, int(row[0]), (flow_id, str(row[1]), str(row[2]), str(row[3]), str(row[4])),
                            int(row[5]) - 1, bool(row[8]), stored_task_options(db, bytes(row[6])), bytes(row[7]),
                            error, now):
            # The flow failed with this execution: the ones after it were cancelled with the flow,
            # and failing them too would close it again, under another Step's error.
            return True
    # The executions left (an attempt running, or yet to run) make no retry either: a failure that
    # would retry ends them with this reason (_fail_task). The first ending's reason stays.
    _send(
        db, f"UPDATE tasks SET retry_ending = ? WHERE flow_id = ? AND step_type IN ({_in(step_types)}) "
        "AND retry_ending IS NULL",
        (_error_text(ending.reason), flow_id, *step_types),
    )
    return False


def _retry_wait_ended(reason: str, last: ErrorInfo) -> ErrorInfo:
    """The error an execution whose retry an RPC ended fails with: `reason`, then its last error."""
    failed = f"; its last attempt failed: {last.error_type}: {last.detail}"
    return ErrorInfo(last.error_type, _error_text(reason + failed))


def abandon(db: Db, lease: Lease) -> None:
    """Drop this worker's claim on an attempt it cannot finish (a worker-side error): the next
    housekeeping treats it as a dead worker's attempt, so retries and failure routes still apply."""
    check_lease(db, lease)
    _send(db, "UPDATE tasks SET lease_owner = NULL WHERE task_id = ?", (lease.task_id,))


def release_unstarted(db: Db, lease: Lease) -> None:
    """Give back an attempt that never started (a claim beyond the worker's slots, a Step the
    worker's Registry lacks): same attempt number, no retry used; other workers are told it is
    ready, in its place in the queue."""
    check_lease(db, lease)
    _ready_again(db, lease.task_id)
    db.notify()


def _ready_again(db: Db, task_id: int) -> None:
    """Make a claimed attempt that never started ready again: the same attempt (E3). It keeps the
    run_at it was claimed with, so its place in the queue: claims take the oldest first, and a
    claim handed back as the newest went behind all work readied meanwhile, each time a worker's
    claims in flight took more than its slots (a message's Step waited behind a whole burst of
    timers, handed back again and again).

    A method none of whose attempts started gives back its locks too, as it was before its claim,
    which takes them again: E7 holds them from the first attempt that runs, and held by a Step no
    worker runs (its worker stopped, or died, or declares no such Step) they refused every RPC
    taking one for as long as no worker ran it."""
    row = db.one("SELECT any_started, locks_held FROM tasks WHERE task_id = ? AND attempt_started = 0", (task_id,))
    if row is None:
        return
    give_back = not row[0] and bool(row[1])
    _send(
        db, "UPDATE tasks SET state = 'ready', lease_owner = NULL, deadline_at = NULL"
        + (", locks_held = 0" if give_back else "") + " WHERE task_id = ?",
        (task_id,),
    )
    if give_back:
        _release_locks(db, task_id)


# Heartbeats and best-effort events (E10, E11) ------------------------------------------------


def heartbeat(
    db: Db, lease: Lease, checkpoint: str | None, now: int,
    events: Sequence[tuple[str, int, bytes]] = (), *, checked: bool = False,
) -> None:
    """Record a heartbeat (E10); `events` are best-effort events (stream, capacity, value) the
    attempt wrote just before it, appended in the same transaction. `checked`: the caller knows
    the lease owns its task (it was handed out by this transaction)."""
    if not checked:
        check_lease(db, lease)
    append_writes(db, lease.flow_id, events, lease.step_execution_id, lease.attempt)
    hb_ms = lease.options.heartbeat_timeout_ms
    # Without a checkpoint the last one stays; a heartbeat timeout moves the deadline forward
    # (never past the method's own deadline).
    sets = ["attempt_started = 1", "any_started = 1"]
    params: list[Any] = []
    if checkpoint is not None:
        sets.append("checkpoint = ?")
        params.append(checkpoint)
    if hb_ms is not None:
        sets.append("deadline_at = CASE WHEN method_deadline_at IS NULL OR method_deadline_at > ? "
                    "THEN ? ELSE method_deadline_at END")
        params += (now + hb_ms, now + hb_ms)
    _send(db, f"UPDATE tasks SET {', '.join(sets)} WHERE task_id = ?", (*params, lease.task_id))


def append_best_effort(db: Db, lease: Lease, stream: str, capacity: int, values: Sequence[bytes]) -> None:
    check_lease(db, lease)
    _mark_started(db, lease)
    append_writes(db, lease.flow_id, [(stream, capacity, v) for v in values], lease.step_execution_id, lease.attempt)


def task_epochs(db: Db, task_ids: Sequence[int]) -> dict[int, int]:
    """The lease epochs of those of `task_ids` still running. Read ROWS_PER_STATEMENT IDs at a time:
    a worker may run up to MAX_CONCURRENT_TASKS attempts, more than a statement takes parameters
    (PostgreSQL 65,535, SQLite 32,766 unless built otherwise), and every poll would fail."""
    epochs: dict[int, int] = {}
    for i in range(0, len(task_ids), ROWS_PER_STATEMENT):
        part = task_ids[i:i + ROWS_PER_STATEMENT]
        rows = db.all(
            f"SELECT task_id, lease_epoch FROM tasks WHERE state = 'running' AND task_id IN ({_in(part)})",
            tuple(part),
        )
        epochs.update((int(r[0]), int(r[1])) for r in rows)
    return epochs


# Workers and housekeeping ------------------------------------------------------------------


def register_worker(db: Db, worker_id: str, host: str, pid: int, ttl_ms: int, now: int) -> None:
    """Give the worker a live lease. One that had no row (declared dead, or an earlier process
    under the same ID), or takes over the expired row of another process (host, PID), first sees
    the attempts still held under the ID failed or handed back as a dead worker's: no process runs
    them any longer (the other one, paused or gone, is fenced off by it), and the new row would
    hide them until lost-claim recovery."""
    row = db.one("SELECT host, pid, expires_at FROM workers WHERE worker_id = ?", (worker_id,))
    if row is not None and (str(row[0]), int(row[1])) != (host, pid):
        if int(row[2]) > now:
            raise WorkerIdInUseError(
                f"worker ID {worker_id!r} is held by a live worker on host {row[0]!r}, PID {row[1]}, whose "
                f"lease runs {int(row[2]) - now} ms more; give each worker its own ID (or none: one is made "
                "up), or, for a process restarted under its ID, start it once that lease has run out"
            )
        _send(db, "DELETE FROM workers WHERE worker_id = ?", (worker_id,))
        row = None
    if row is None:
        _expire_orphans(db, now)
    _send(
        db, "INSERT INTO workers (worker_id, host, pid, started_at, expires_at) VALUES (?, ?, ?, ?, ?) "
        # Of two processes taking over one expired ID at once, the later makes the row its own (the
        # other finds its next renewal refused and claims nothing).
        "ON CONFLICT (worker_id) DO UPDATE SET expires_at = excluded.expires_at, host = excluded.host, "
        "pid = excluded.pid, started_at = CASE WHEN workers.host = excluded.host AND workers.pid = excluded.pid "
        "THEN workers.started_at ELSE excluded.started_at END",
        (worker_id, host, pid, now, now + ttl_ms),
    )


def renew_worker(db: Db, worker_id: str, ttl_ms: int, now: int, holder: tuple[str, int] | None = None) -> bool:
    """Extend the worker's lease; False when it was declared dead (its attempts are gone), or, with
    `holder` (host, PID), when the ID's row is another process's: one that took the ID over while
    this one was paused past its lease, whose row this one must neither renew nor remove."""
    where, params = _worker_row(worker_id, holder)
    return bool(db.run(f"UPDATE workers SET expires_at = ? WHERE {where}", (now + ttl_ms, *params)))


def shift_deadlines(db: Db, worker_id: str, shift_ms: int, claimed_by: int) -> int:
    """Move the heartbeat and method deadlines of `worker_id`'s running attempts claimed by
    `claimed_by` (ms) `shift_ms` later: the wall clock stepped forward that much under them, and
    a deadline is a duration from the attempt's claim or last heartbeat, which the step must not
    shorten (every live attempt would fail as HeartbeatTimeout or MethodTimeout at once). Taken
    under each flow's lock, in the order every transaction locks flows. Returns the attempts moved."""
    moved = 0
    for flow_id, task_id in _in_lock_order(db.all(
        "SELECT flow_id, task_id FROM tasks WHERE state = 'running' AND lease_owner = ? AND claimed_at <= ? "
        "AND deadline_at IS NOT NULL", (worker_id, claimed_by),
    ), 0, 1):
        lock_flow(db, str(flow_id))
        moved += db.run(
            "UPDATE tasks SET deadline_at = deadline_at + ?, method_deadline_at = method_deadline_at + ? "
            "WHERE task_id = ? AND state = 'running' AND lease_owner = ? AND claimed_at <= ?",
            (shift_ms, shift_ms, task_id, worker_id, claimed_by))
    return moved


def unregister_worker(db: Db, worker_id: str, now: int, holder: tuple[str, int] | None = None) -> None:
    """Remove the worker's row (with `holder`, only if that process holds it, see renew_worker);
    its attempts left in the database are failed or handed back as a dead worker's."""
    where, params = _worker_row(worker_id, holder)
    _send(db, f"DELETE FROM workers WHERE {where}", params)
    _expire_orphans(db, now, stopped_worker=worker_id)
    # The leaving worker may be the only one that knew a due time (a timer it registered, a retry
    # it scheduled: such commits send no notification): wake the others to learn it.
    db.notify()


def worker_registered(db: Db, worker_id: str, holder: tuple[str, int] | None = None) -> bool:
    """Whether the worker has a row (with `holder`, one that host and PID hold). One without
    (declared dead, or its ID taken over by another process) must claim nothing until it registers
    again: its claims would be failed as a dead worker's, or run under another process's lease."""
    where, params = _worker_row(worker_id, holder)
    return db.one(f"SELECT 1 FROM workers WHERE {where}", params) is not None


def _worker_row(worker_id: str, holder: tuple[str, int] | None) -> tuple[str, tuple[Any, ...]]:
    """The WHERE clause and parameters of the worker's row: any, or with `holder` (host, PID) only
    the row that process holds."""
    if holder is None:
        return "worker_id = ?", (worker_id,)
    return "worker_id = ? AND host = ? AND pid = ?", (worker_id, *holder)


def housekeeping(
    db: Db, now: int, worker_id: str | None = None, *, declare_dead: bool = True,
    flow_types: Sequence[str] | None = None, timer_floor: bool = True, retention_ms: int | None = None,
) -> HousekeepingReport:
    """Dead workers, expired leases, timeouts, due timers, and with `retention_ms` flows closed longer
    ago than that (delete_closed_flows). Idempotent; any worker may run it.

    It fires the timers of at most TIMERS_FIRED_PER_HOUSEKEEPING flows, the earliest due first;
    later passes fire the rest (the report's `timers_left`). Run by a worker of `flow_types`, fewer
    while their ready tasks queue (see _timer_budget); `timer_floor` True (once a housekeeping
    interval) fires TIMERS_FIRED_WHILE_BACKLOGGED even then.

    Run by `worker_id`, it declares no worker dead while that worker's own lease has run out or
    is gone: a live worker that finds its own lease expired has seen the wall clock step forward
    (or was paused), so the others' expired leases prove nothing either until the renewals catch up.
    Nor with `declare_dead` False: the caller saw the wall clock step, and its own lease may have
    been renewed since, while the others' renewals have not caught up yet. In both cases it fails
    no attempt past its deadline either (see shift_deadlines).
    """
    removed = 0
    own = None if worker_id is None else db.one("SELECT expires_at FROM workers WHERE worker_id = ?", (worker_id,))
    # The same holds for deadlines: after a forward step every one written before it looks passed,
    # until each worker has moved its own attempts' (shift_deadlines) at its next renewal.
    trusted = declare_dead and (worker_id is None or (own is not None and int(own[0]) >= now))
    if trusted:
        removed = db.run("DELETE FROM workers WHERE expires_at < ?", (now,))
    named: list[str] = []
    expired = _expire_orphans(db, now, named=named)
    timeouts = 0
    # Candidates are found without locks, then each is re-checked under its flow's lock, flows
    # taken in ID order so that concurrent housekeepers cannot deadlock.
    for flow_id, task_id in _in_lock_order(db.all(
        "SELECT flow_id, task_id FROM tasks WHERE state = 'running' AND deadline_at < ?", (now,)
    ) if trusted else [], 0, 1):
        lock_flow(db, str(flow_id))
        row = db.one("SELECT method_deadline_at FROM tasks WHERE task_id = ? AND state = 'running' "
                     "AND deadline_at < ?", (task_id, now))
        if row is None:
            continue
        kind = "MethodTimeout" if row[0] is not None and int(row[0]) < now else "HeartbeatTimeout"
        _name_attempt(db, int(task_id), named)
        _fail_task(db, int(task_id), ErrorInfo(kind, "the attempt passed its deadline"), False, now)
        timeouts += 1
    fired = 0
    # Deduplicated and sorted here (see _in_lock_order): for DISTINCT ... ORDER BY flow_id SQLite
    # reads every task in flow order (tasks_flow) instead of the due timers (tasks_timer). A flow
    # with several due waits counts once per wait against the limit, which only fires fewer.
    budget = _timer_budget(db, now, flow_types, timer_floor)
    due = db.all("SELECT flow_id FROM tasks WHERE state = 'waiting' AND timer_due_at <= ? "
                 "ORDER BY timer_due_at LIMIT ?", (now, budget + 1))
    for flow_id in sorted({str(flow_id) for (flow_id,) in due[:budget]}):
        lock_flow(db, flow_id)
        n = evaluate_waits(db, flow_id, now)
        if n:
            bump(db, flow_id)
        fired += n
    shared: SharedOptions | None = getattr(db, "shared_options", None)
    if shared is not None:
        shared.collect(db, now)
    flows_deleted, flows_left = (0, False) if retention_ms is None else delete_closed_flows(db, now - retention_ms)
    return HousekeepingReport(timers_fired=fired, leases_expired=expired, timeouts=timeouts,
                              workers_removed=removed, attempts_named=tuple(named), timers_left=len(due) > budget,
                              flows_deleted=flows_deleted, flows_left=flows_left)


def _timer_budget(db: Db, now: int, flow_types: Sequence[str] | None, floor: bool) -> int:
    """How many waits' due timers one housekeeping pass fires. Claims take the oldest ready task
    first, and a fired timer's task is ready from when it fired: a whole burst fired at once would
    queue every message that arrives after it behind the burst. So a worker's pass fires only what
    keeps its flow types' ready tasks under TIMERS_FIRED_PER_HOUSEKEEPING; with `floor` (once a
    housekeeping interval) at least TIMERS_FIRED_WHILE_BACKLOGGED, so timers move on however long
    ready work queues, while the extra passes a burst asks for (timers_left) add nothing to a queue."""
    if not flow_types:
        return TIMERS_FIRED_PER_HOUSEKEEPING
    row = db.one(
        f"SELECT COUNT(*) FROM (SELECT 1 FROM tasks WHERE state = 'ready' AND run_at <= ? "
        f"AND flow_type IN ({_in(flow_types)}) LIMIT ?) r",
        (now, *flow_types, TIMERS_FIRED_PER_HOUSEKEEPING),
    )
    ready = int(row[0]) if row is not None else 0
    return max(TIMERS_FIRED_WHILE_BACKLOGGED if floor else 0, TIMERS_FIRED_PER_HOUSEKEEPING - ready)


def _in_lock_order(rows: list[Row], flow: int, task: int) -> list[Row]:
    """`rows` in the order every transaction locks flows: flow ID as Python orders strings, then
    task ID. Not by ORDER BY: PostgreSQL would follow the database's collation, which need not agree
    (a transaction locking in another order may deadlock with a batch of commits), and for
    ORDER BY flow_id SQLite reads every task in tasks_flow's order rather than the few candidates."""
    return sorted(rows, key=lambda r: (str(r[flow]), int(r[task])))


# The error of a started attempt whose worker is gone. A worker that stops leaves in the database
# only what outlasted its grace (its drain revoked it): "died" there sends an operator looking for
# a crash, where the cause is the grace (the stopping worker's warning says what to change). Kept
# free of advice: an agent's tool record carries this text to the model.
WORKER_DIED = ErrorInfo("WorkerLost", "the worker running the attempt died")
WORKER_STOPPED = ErrorInfo("WorkerLost", "the worker running the attempt stopped before the attempt ended "
                                         "(its shutdown_grace_seconds ran out)")


def _expire_orphans(db: Db, now: int, *, stopped_worker: str | None = None, named: list[str] | None = None) -> int:
    """Fail or hand back the running attempts of workers that have no row; those of `stopped_worker`,
    which is unregistering, fail as stopped rather than died. Each is added to `named` (see
    _name_attempt)."""
    orphan = ("SELECT t.task_id, t.attempt_started, t.flow_id, t.lease_owner FROM tasks t LEFT JOIN workers w "
              "ON w.worker_id = t.lease_owner WHERE t.state = 'running' AND w.worker_id IS NULL")
    count = 0
    for candidate, _started, candidate_flow, _owner in _in_lock_order(db.all(orphan), 2, 0):
        lock_flow(db, str(candidate_flow))
        row = db.one(orphan + " AND t.task_id = ?", (candidate,))
        if row is None:
            continue  # renewed, committed or handled meanwhile
        task_id, started, flow_id, owner = row
        count += 1
        if named is not None:
            _name_attempt(db, int(task_id), named)
        if started:
            error = WORKER_STOPPED if stopped_worker is not None and owner == stopped_worker else WORKER_DIED
            _fail_task(db, int(task_id), error, False, now)
        else:
            # E3: never started: hand the same attempt out again, consuming no retry.
            _ready_again(db, int(task_id))
            bump(db, str(flow_id))
            db.notify()
            db.revoked()  # a worker that still runs it (not dead, only late to renew) must stop
    return count


def _name_attempt(db: Db, task_id: int, named: list[str]) -> None:
    """Add "flow/step execution attempt n" of the running task to `named`, up to LATE_ATTEMPTS_NAMED."""
    if len(named) < LATE_ATTEMPTS_NAMED:
        row = db.one("SELECT flow_id, step_execution_id, attempt FROM tasks WHERE task_id = ?", (task_id,))
        if row is not None:
            named.append(f"{row[0]}/{row[1]} attempt {row[2]}")


def release_lost_claims(db: Db, worker_id: str, known: Sequence[int], claimed_before: int, now: int) -> None:
    """Hand back attempts this worker holds in the database but not in memory.

    That happens when a claim or a commit that claimed committed but its reply was lost (a dropped
    connection): the worker never ran them, and as it is alive nothing else would recover them.
    Only claims older than `claimed_before` count, so replies still in flight are left alone.
    """
    rows = _in_lock_order(db.all(
        "SELECT flow_id, task_id FROM tasks WHERE state = 'running' AND lease_owner = ? AND claimed_at < ?",
        (worker_id, claimed_before),
    ), 0, 1)
    held = set(known)
    count = 0
    for flow_id, task_id in rows:
        if int(task_id) in held:
            continue
        lock_flow(db, str(flow_id))
        # Orphaned, they take the dead-worker path: same attempt if unstarted, else WorkerLost.
        # Re-checked under the lock, which may have been waited for: the claim found may have ended
        # meanwhile and the task been claimed again, by this worker, as a claim still in flight.
        if db.run("UPDATE tasks SET lease_owner = NULL WHERE task_id = ? AND state = 'running' AND lease_owner = ? "
                  "AND claimed_at < ?", (task_id, worker_id, claimed_before)):
            count += 1
    if count:
        _expire_orphans(db, now)


def next_due(db: Db, flow_types: Sequence[str], declined: Declined = ()) -> int | None:
    """Earliest time something becomes due: a ready task's run_at (not a `declined` Step's, which
    would wake its worker in a loop), a timer, a deadline, a lease."""
    skip, skipped = _not_declined(declined)
    ready = (f"(SELECT MIN(run_at) FROM tasks WHERE state = 'ready' AND flow_type IN ({_in(flow_types)}){skip})"
             if flow_types else "NULL")
    row = db.one(
        f"SELECT {ready}, (SELECT MIN(timer_due_at) FROM tasks WHERE state = 'waiting' AND timer_due_at IS NOT NULL), "
        "(SELECT MIN(deadline_at) FROM tasks WHERE state = 'running'), (SELECT MIN(expires_at) FROM workers)",
        (*flow_types, *skipped) if flow_types else (),
    )
    values = [int(v) for v in row or () if v is not None]
    return min(values) if values else None


# RPCs (E7, E8) ------------------------------------------------------------------------------


def _check_rpc_locks(db: Db, flow_id: str, locks: Sequence[str]) -> None:
    if not locks:
        return
    condition, params = _conflicting_locks_sql("l.lock_name", locks)
    row = db.one(
        f"SELECT l.lock_name, t.step_execution_id FROM locks l LEFT JOIN tasks t ON t.task_id = l.task_id "
        f"WHERE l.flow_id = ? AND {condition} LIMIT 1",
        (flow_id, *params),
    )
    if row is not None:
        raise RpcLockConflictError(flow_id, str(row[0]), f"Step {row[1]}")


def rpc_read(db: Db, flow_id: str, load: LoadSpec, locks: Sequence[str]) -> RpcSnapshot | None:
    """What an RPC handler sees; None when the flow changed while it was read. A closed flow is
    read too: its state stays readable (E12), so an RPC that changes nothing answers from it;
    rpc_commit refuses one that would change it."""
    if _on_postgres(db):
        # The type and the version in one statement: read apart (each statement sees the latest
        # commit), a flow deleted and started again with another type between them gave the old
        # type's handler the new flow's state, at the new flow's version, which its commit checks.
        flow_row = db.one("SELECT flow_type, version, created_at FROM flows WHERE flow_id = ?", (flow_id,))
        if flow_row is None:
            raise FlowNotFoundError(flow_id)
        flow_type, version, started = str(flow_row[0]), int(flow_row[1]), int(flow_row[2])
    else:
        flow_type = existing_flow_type(db, flow_id)
        known = db.known.get(flow_id)
        # Nothing of this transaction changed the flow since existing_flow_type read it.
        version_row = (known.version, known.created_at) if known is not None else db.one(
            "SELECT version, created_at FROM flows WHERE flow_id = ?", (flow_id,))
        assert version_row is not None
        version, started = int(version_row[0]), int(version_row[1])
    snapshot = _rpc_rows(db, flow_id, flow_type, version, started, load)
    # After the reads, not before: a claim takes its locks without changing the version, so on
    # PostgreSQL a Step that took a lock after an earlier check, then any commit, would give the
    # handler a state that existed only while the lock was held (E7). Checked here, the version
    # check below vouches that the state read is the one the locks were found free in.
    _check_rpc_locks(db, flow_id, locks)
    if _on_postgres(db):
        # PostgreSQL reads each statement as of its own start (READ COMMITTED): a commit between
        # them (a worker's) would show the handler attributes after it and messages before it. A
        # writing RPC's commit finds such a change by the version; an RPC that only reads must
        # find it here. (SQLite reads in one snapshot.) Not raised: that would roll back the batch.
        row = db.one("SELECT version, created_at FROM flows WHERE flow_id = ?", (flow_id,))
        if not _at_version(row, snapshot.version, snapshot.started_ms):
            return None
    return snapshot


def _at_version(row: Row | None, version: int, started_ms: int | None) -> bool:
    """Whether `row` (a flow's version and created_at, None: no flow) is that flow at `version`. The
    start too when given: a flow deleted and started again counts its versions from 1 again, so an
    RPC that read the old flow would otherwise commit what it decided from it into the new one."""
    return row is not None and int(row[0]) == version and (started_ms is None or int(row[1]) == started_ms)


def _rpc_rows(
    db: Db, flow_id: str, flow_type: str, version: int, started_ms: int, load: LoadSpec,
) -> RpcSnapshot:
    """rpc_read's reads after the version: the pending messages, those in flight, the attributes."""
    pending: dict[tuple[str, str], list[tuple[int, bytes]]] = {}
    for channel, key, mid, value in db.all(
        "SELECT channel, key, message_id, value FROM channel_messages WHERE flow_id = ? ORDER BY message_id",
        (flow_id,),
    ):
        pending.setdefault((str(channel), str(key)), []).append((int(mid), bytes(value)))
    in_flight: dict[tuple[str, str], list[tuple[int, bytes]]] = {}
    for spec_blob, outcome_blob in db.all(
        "SELECT wait_spec, wait_outcome FROM tasks WHERE flow_id = ? AND wait_outcome IS NOT NULL",
        (flow_id,),
    ):
        spec = _decode_wait_spec(bytes(spec_blob))  # a hashable key, as in evaluate_waits
        outcome = decode_json(outcome_blob, WaitOutcome)
        for condition, consumed in zip(spec.conditions, outcome.consumed, strict=False):
            for message in consumed:
                in_flight.setdefault((condition.channel, condition.key), []).append(
                    (message.message_id, bytes(message.value)))
    for messages in in_flight.values():
        messages.sort()
    return RpcSnapshot(flow_type, version, started_ms, load_attributes(db, flow_id, load), pending, in_flight)


def rpc_load(
    db: Db, flow_id: str, version: int, load: LoadSpec, started_ms: int | None = None,
) -> dict[tuple[str, str], bytes] | None:
    """More attributes for an RPC handler that read its snapshot at `version` (RpcContext.load):
    the rows `load` names, or None when the flow changed since (or is gone), so that what the
    handler sees stays one state. The version is checked after the reads, as rpc_read does on
    PostgreSQL; on SQLite the reads and the check see one snapshot anyway."""
    existing_flow_type(db, flow_id)  # FlowNotFoundError for a flow deleted since; on SQLite, its cached rows
    rows = load_attributes(db, flow_id, load)
    row = db.one("SELECT version, created_at FROM flows WHERE flow_id = ?", (flow_id,))
    if not _at_version(row, version, started_ms):
        return None
    return rows


def rpc_commit(
    db: Db, flow_id: str, version: int | None, locks: Sequence[str], writes: WriteSet,
    next_steps: Sequence[MovementRecord], canceling: Sequence[str], now: int, expected_type: str | None = None,
    ending: RetryWaitEnding | None = None, started_ms: int | None = None,
) -> None:
    """Commit an RPC's result if the flow is still at `version` (and, given `started_ms`, is the
    flow that started then, not one started again under its ID); None: the handler read no state
    (and `expected_type`, its handler's flow type, is checked: no snapshot did). `ending`: the
    retry waits it ends (end_retry_waits)."""
    flow_type = require_running(db, flow_id)
    _check_type(flow_type, expected_type)
    if version is not None:
        row = db.one("SELECT version, created_at FROM flows WHERE flow_id = ?", (flow_id,))
        if not _at_version(row, version, started_ms):
            raise RpcVersionChanged()
    _check_rpc_locks(db, flow_id, locks)
    apply_writes(db, flow_id, writes, "", 0, now)
    if canceling:
        cancel_step_types(db, flow_id, canceling, now)
    if ending is not None and ending.step_types and end_retry_waits(db, flow_id, ending, now):
        return  # the flow failed (an ended execution had no failure route): its next_steps may not start
    for movement in next_steps:
        create_task(db, flow_id, flow_type, movement, now)
    if writes.publishes:
        evaluate_waits(db, flow_id, now, _instances(writes))
    if canceling:
        # A completing flow closes when its last task ends; an RPC ends tasks only by cancelling.
        _maybe_complete(db, flow_id, now)
    if not any(h[0] == flow_id for h in db.history):
        bump(db, flow_id)  # else writing the history bumps the version (flush_history)


def publish(db: Db, flow_id: str, channel: str, key: str, value: bytes, now: int,
            flow_type: str | None = None) -> int:
    _check_type(require_running(db, flow_id), flow_type)
    row = db.one(
        "INSERT INTO channel_messages (flow_id, channel, key, value, created_at) VALUES (?, ?, ?, ?, ?) "
        "RETURNING message_id",
        (flow_id, channel, key, value, now),
    )
    assert row is not None
    evaluate_waits(db, flow_id, now, ((channel, key),))
    bump(db, flow_id)
    return int(row[0])


# Reads for clients and the CLI ---------------------------------------------------------------


# These reads are of a flow and rows of it. On PostgreSQL they are one statement each
# (_pg_rows_of_flow), as each statement sees the latest commit (READ COMMITTED): read apart, a flow
# deleted between the two read as one without rows (no history, no attributes), and one deleted and
# started again with another type (reused IDs are allowed) passed the check of the caller's type and
# gave the new flow's rows to be read as the old type's. SQLite reads one snapshot (BEGIN).


def _pg_rows_of_flow(
    db: Db, flow_id: str, flow_type: str | None, columns: str, rows: str, params: Sequence[Any], order: str = "",
) -> list[Row]:
    """PostgreSQL: `columns` of the rows `rows` selects (a statement over `f`, the flow's row, with
    `params`), as `j`, read in one statement with the flow (FlowNotFoundError when there is none,
    FlowTypeChanged when it is not of `flow_type`), in `order`; the first column is never NULL."""
    found = db.all(f"SELECT f.flow_type, {', '.join('j.' + c for c in columns.split(', '))} FROM flows f "
                   f"LEFT JOIN LATERAL ({rows}) j ON TRUE WHERE f.flow_id = ?{' ORDER BY ' + order if order else ''}",
                   (*params, flow_id))
    if not found:
        raise FlowNotFoundError(flow_id)
    _check_type(str(found[0][0]), flow_type)
    return [r[1:] for r in found if r[1] is not None]


def read_attribute(db: Db, flow_id: str, name: str, key: str, flow_type: str | None = None) -> bytes | None:
    if _on_postgres(db):
        rows = _pg_rows_of_flow(db, flow_id, flow_type, "value",
                                "SELECT value FROM attributes WHERE flow_id = f.flow_id AND name = ? AND key = ?",
                                (name, key))
        return bytes(rows[0][0]) if rows else None
    existing_flow_type(db, flow_id, flow_type)
    known = db.known.get(flow_id)
    if known is not None and known.covers(name):
        return known.rows.get((name, key))
    row = db.one("SELECT value FROM attributes WHERE flow_id = ? AND name = ? AND key = ?", (flow_id, name, key))
    return None if row is None else bytes(row[0])


def read_attribute_map(db: Db, flow_id: str, name: str, flow_type: str | None = None) -> dict[str, bytes]:
    if _on_postgres(db):
        return {str(key): bytes(value) for key, value in sorted(_pg_rows_of_flow(
            db, flow_id, flow_type, "key, value",
            "SELECT key, value FROM attributes WHERE flow_id = f.flow_id AND name = ?", (name,)))}
    existing_flow_type(db, flow_id, flow_type)
    rows = load_attributes(db, flow_id, LoadSpec("only", (name,)))
    return {key: rows[(n, key)] for n, key in sorted(rows)}


def read_all_attributes(db: Db, flow_id: str) -> dict[tuple[str, str], bytes]:
    if _on_postgres(db):
        return {(str(name), str(key)): bytes(value) for name, key, value in _pg_rows_of_flow(
            db, flow_id, None, "name, key, value", "SELECT name, key, value FROM attributes WHERE flow_id = f.flow_id",
            ())}
    existing_flow_type(db, flow_id)
    return load_attributes(db, flow_id, LoadSpec("all"))


# A flow with its active Steps, one row per Step (one row of NULL Step columns when it has none).
# One statement, not the flow's row and then its tasks: on PostgreSQL each statement sees the
# commits made before it (READ COMMITTED), so a flow closed between the two read as running with
# no active Steps, and list_flows(status=...) listed it with another status.
_FLOW_INFO_COLUMNS = "flow_id, flow_type, status, created_at, closed_at, output, error, config"
_FLOW_INFO = (
    "SELECT f.flow_id, f.flow_type, f.status, f.created_at, f.closed_at, f.output, f.error, f.config, "
    "t.step_type, t.step_execution_id, t.state, t.method, t.attempt, t.timer_due_at "
    "FROM {flows} f LEFT JOIN tasks t ON t.flow_id = f.flow_id"
)


def describe_flow(db: Db, flow_id: str) -> FlowInfo:
    rows = db.all(_FLOW_INFO.format(flows="flows") + " WHERE f.flow_id = ? ORDER BY t.task_id", (flow_id,))
    if not rows:
        raise FlowNotFoundError(flow_id)
    return _flow_info(rows)


def _flow_info(rows: Sequence[Row]) -> FlowInfo:
    """The FlowInfo of one flow's rows of _FLOW_INFO, its Steps in task order."""
    row = rows[0]
    return FlowInfo(
        flow_id=str(row[0]), flow_type=str(row[1]), status=row[2], created_at_ms=int(row[3]),
        closed_at_ms=None if row[4] is None else int(row[4]),
        output=None if row[5] is None else bytes(row[5]), error=row[6],
        config=decode_json(row[7], FlowConfig),
        active_steps=tuple(
            ActiveStep(str(s[8]), str(s[9]), str(s[10]), str(s[11]), int(s[12]),
                       None if s[13] is None else int(s[13])) for s in rows if s[9] is not None
        ),
    )


def _by_code_point(db: Db, column: str) -> str:
    """`column` compared as Python compares text (by code point), for ORDER BY and the comparisons
    that page through one: SQLite's BINARY collation does, while PostgreSQL follows the database's
    collation, which need not (en_US puts "_x" before "1", "a" before "B"): flows started in one
    millisecond were listed, and cut at a limit, in another order on each backend."""
    return f'{column} COLLATE "C"' if _on_postgres(db) else column


def _flow_filter(prefix: str, flow_type: str | None, status: str | None) -> tuple[list[str], list[Any]]:
    """WHERE clauses and parameters selecting flows of a type and status (each optional)."""
    clauses: list[str] = []
    params: list[Any] = []
    for column, value in (("flow_type", flow_type), ("status", status)):
        if value is not None:
            clauses.append(f"{prefix}{column} = ?")
            params.append(value)
    return clauses, params


# The flows with an active Step of a type: ?s are the type, three times. UNION ALL, deduplicated by
# the reader: SQLite would build all of a UNION before applying a LIMIT.
_ACTIVE_STEP_TASKS = (
    "SELECT flow_id FROM tasks WHERE state = 'waiting' AND step_type = ? UNION ALL "
    "SELECT flow_id FROM tasks WHERE state = 'ready' AND step_type = ? UNION ALL "
    "SELECT flow_id FROM tasks WHERE state = 'running' AND step_type = ?"
)


# PostgreSQL's read of the flows with an active Step of a type, when they are few: how many of its
# tasks there are (up to the LIMIT ?), and, when at most the second ?, their flows (a row of NULL
# flow columns when none). A SELECT, not WITH: the store takes any other statement for a write. The
# CASE, not a condition of its own: PostgreSQL then read every candidate's flow to drop it.
_PG_ACTIVE_STEP_FLOWS = (
    "SELECT k.n, f.flow_id, f.flow_type, f.status, f.config, f.created_at FROM "
    f"(SELECT count(*) AS n, array_agg(c.flow_id) AS ids FROM ({_ACTIVE_STEP_TASKS} LIMIT ?) c) k "
    "LEFT JOIN flows f ON f.flow_id = ANY(CASE WHEN k.n <= ? THEN k.ids END)"
)


def search_flows(
    db: Db, flow_type: str | None, status: str | None, active_step: str | None, limit: int
) -> list[str]:
    clauses, params = _flow_filter("f.", flow_type, status)
    if active_step is None:
        where = " AND ".join(clauses) or "1 = 1"
        rows = db.all(f"SELECT f.flow_id FROM flows f WHERE {where} "
                      f"ORDER BY f.created_at, {_by_code_point(db, 'f.flow_id')} LIMIT ?", (*params, limit))
        return [str(r[0]) for r in rows]
    # E13/E16: running flows with an active Step of this type, whose config enables this search.
    clauses.append("f.status = 'running'")
    # The flows that have the Step, through the indexes of each active state, when they are few.
    # Each by its key, filtered and ordered here: given the type and status too, SQLite would read
    # every running flow of the type through flows_type_status instead.
    if _on_postgres(db):
        # In the statement that reads the Steps: read apart (each statement sees the latest commit),
        # a flow whose Step ended between the two, still running, was listed, and one that closed
        # was not, a list of flows no moment had.
        both = db.all(_PG_ACTIVE_STEP_FLOWS, (active_step, active_step, active_step,
                                              ACTIVE_STEP_SEARCH_CANDIDATES + 1, ACTIVE_STEP_SEARCH_CANDIDATES))
        few = int(both[0][0]) <= ACTIVE_STEP_SEARCH_CANDIDATES
        rows = [r[1:] for r in both if r[1] is not None]
    else:
        candidates = db.all(_ACTIVE_STEP_TASKS + " LIMIT ?",
                            (active_step, active_step, active_step, ACTIVE_STEP_SEARCH_CANDIDATES + 1))
        few = len(candidates) <= ACTIVE_STEP_SEARCH_CANDIDATES
        ids = list({str(r[0]) for r in candidates}) if few else []
        rows = db.all(f"SELECT flow_id, flow_type, status, config, created_at FROM flows WHERE flow_id IN ({_in(ids)})",
                      ids) if ids else []
    if few:
        found = sorted((int(created_at), str(flow_id)) for flow_id, ftype, fstatus, config, created_at in rows
                       if fstatus == "running" and flow_type in (None, ftype) and status in (None, fstatus)
                       and decode_json(config, FlowConfig).active_step_search)
        return [flow_id for _, flow_id in found[:limit]]
    # Many: the oldest running flows may hold the first `limit` of them (most sessions wait in this
    # Step), or none (it is rare, or only young sessions reached it). Read the running flows in
    # order, first as many as ACTIVE_STEP_SEARCH_CANDIDATES, then on to one per
    # ACTIVE_STEP_SEARCH_CANDIDATES_PER_FLOW_WALKED candidates; whatever those windows lack comes from
    # all the candidates, each flow read by its key and ordered by the database. Either way the
    # search costs about as much as reading the candidates, wherever in the order they are, and far
    # less when the oldest flows hold the page.
    out, window_end = _walk_running_flows(db, clauses, params, active_step, None, ACTIVE_STEP_SEARCH_CANDIDATES, limit)
    if len(out) >= limit or window_end is None:  # the page, or every running flow read
        return out
    counted = db.one(f"SELECT count(*) FROM ({_ACTIVE_STEP_TASKS} LIMIT ?) c",
                     (active_step, active_step, active_step, ACTIVE_STEP_SEARCH_COUNTED))
    candidate_count = int(counted[0]) if counted else 0
    walked = candidate_count // ACTIVE_STEP_SEARCH_CANDIDATES_PER_FLOW_WALKED
    if walked > ACTIVE_STEP_SEARCH_CANDIDATES:
        more, window_end = _walk_running_flows(db, clauses, params, active_step, window_end, walked, limit - len(out))
        out += more
        if len(out) >= limit or window_end is None:
            return out
    return out + _active_step_flows_after(db, clauses, params, active_step, window_end, candidate_count,
                                          limit - len(out))


def _walk_running_flows(
    db: Db, clauses: list[str], params: list[Any], active_step: str, after: int | None, flows: int, limit: int,
) -> tuple[list[str], int | None]:
    """Up to `limit` flows passing `clauses` with an active Step `active_step` and searchable, in
    order, read through the running flows in order: those created after `after` (None: any time),
    as far as the `flows`-th of them. Returns them and that flow's created_at, the end of the window
    read (all the flows of that millisecond), or None when fewer running flows are left."""
    since, since_params = ("", ()) if after is None else (" AND f.created_at > ?", (after,))
    window = db.one(f"SELECT f.created_at FROM flows f WHERE f.status = 'running'{since} "
                    "ORDER BY f.created_at LIMIT 1 OFFSET ?", (*since_params, max(0, flows - 1)))
    window_end = None if window is None else int(window[0])
    clauses = [*clauses, "EXISTS (SELECT 1 FROM tasks t WHERE t.flow_id = f.flow_id AND t.step_type = ?)"]
    params = [*params, active_step]
    if window_end is not None:
        clauses.append("f.created_at <= ?")
        params.append(window_end)
    select = f"SELECT f.flow_id, f.config, f.created_at FROM flows f WHERE {' AND '.join(clauses)}"
    flow_id = _by_code_point(db, "f.flow_id")
    order = f" ORDER BY f.created_at, {flow_id} LIMIT ?"
    out: list[str] = []
    rows = db.all(select + since + order, (*params, *since_params, limit))
    while True:
        out += [str(flow_id) for flow_id, config, _ in rows if decode_json(config, FlowConfig).active_step_search]
        if len(out) >= limit or len(rows) < limit:
            return out[:limit], window_end
        # Flows whose config hides them from this search took places in the page: read on after it.
        # `created_at >= ?` on its own too: an index range starts there, where the OR alone made
        # each page read the running flows from the first one again (quadratic in hidden flows).
        # Not `after` too: SQLite may start the range there instead.
        last_id, _, last_at = rows[-1]
        rows = db.all(select + f" AND f.created_at >= ? AND (f.created_at > ? OR {flow_id} > ?)" + order,
                      (*params, last_at, last_at, last_id, limit))


def _active_step_flows_after(
    db: Db, clauses: list[str], params: list[Any], active_step: str, after: int, candidates: int, limit: int,
) -> list[str]:
    """Up to `limit` flows passing `clauses` with an active Step `active_step` and searchable, in
    order, created after `after`: each of the `candidates` (about) tasks' flow read by its key, all
    ordered by the database (SQLite sorts them in a temporary b-tree, far faster than here)."""
    flow_id = _by_code_point(db, "f.flow_id")
    order = f" ORDER BY f.created_at, {flow_id} LIMIT ?"
    params = [active_step, active_step, active_step, *params, after]

    def select(where: str) -> str:
        where = f"f.flow_id = c.flow_id AND {' AND '.join(clauses)} AND f.created_at > ?{where}"
        if not _on_postgres(db):
            # CROSS JOIN: SQLite reads the candidates first, where it would read every running flow
            # through flows_status and look each up among them.
            flows = f"({_ACTIVE_STEP_TASKS}) c CROSS JOIN flows f WHERE {where}"
        elif candidates <= ACTIVE_STEP_SEARCH_LOOKUPS_PG:
            # Each candidate's flow by its key (OFFSET 0 keeps the subquery apart, so the join cannot
            # be planned otherwise): PostgreSQL's default costs (pages read from disk) made it read
            # and hash every flow instead, five times slower with 2,000 candidates among 100,000.
            flows = (f"({_ACTIVE_STEP_TASKS}) c CROSS JOIN LATERAL (SELECT f.flow_id, f.config, f.created_at "
                     f"FROM flows f WHERE {where} OFFSET 0) f")
        else:
            # More: PostgreSQL plans the join. Forcing the lookups, its estimate of their cost would
            # pass jit_above_cost and compile the statement first (100 ms with 50,000 candidates),
            # and hashing the flows, in parallel, is then about as fast.
            flows = f"({_ACTIVE_STEP_TASKS}) c JOIN flows f ON {where}"
        return f"SELECT f.flow_id, f.config, f.created_at FROM {flows}{order}"

    out: list[str] = []
    page = limit
    rows = db.all(select(""), (*params, page))
    while True:
        # A flow with two tasks of the Step comes twice, one row after the other.
        for flow_id_, config, _ in rows:
            if (not out or out[-1] != flow_id_) and decode_json(config, FlowConfig).active_step_search:
                out.append(str(flow_id_))
        if len(out) >= limit or len(rows) < page:
            return out[:limit]
        # Hidden flows or repeated ones took places in the page: read on after it, in pages twice
        # as long each time, as each reads every candidate again.
        last_id, _, last_at = rows[-1]
        page *= 2
        rows = db.all(select(f" AND (f.created_at > ? OR (f.created_at = ? AND {flow_id} > ?))"),
                      (*params, last_at, last_at, last_id, page))


def list_flows(db: Db, flow_type: str | None, status: str | None, limit: int) -> list[FlowInfo]:
    """The newest `limit` flows, optionally of one type and status, newest first (the CLI's `list`).
    One statement, as describe_flow: each flow listed as it was when the list was read."""
    clauses, params = _flow_filter("", flow_type, status)
    where = " AND ".join(clauses) or "1 = 1"
    newest = (f"(SELECT {_FLOW_INFO_COLUMNS} FROM flows WHERE {where} "
              f"ORDER BY created_at DESC, {_by_code_point(db, 'flow_id')} DESC LIMIT ?)")
    rows = db.all(_FLOW_INFO.format(flows=newest)
                  + f" ORDER BY f.created_at DESC, {_by_code_point(db, 'f.flow_id')} DESC, t.task_id",
                  (*params, limit))
    by_flow: dict[str, list[Row]] = {}
    for row in rows:
        by_flow.setdefault(str(row[0]), []).append(row)
    return [_flow_info(flow_rows) for flow_rows in by_flow.values()]


def stream_names(db: Db, flow_id: str) -> list[str]:
    """Names of the flow's streams that ever received an event, sorted."""
    if not _on_postgres(db):
        existing_flow_type(db, flow_id)
        return sorted(stream_positions(db, flow_id))
    return [str(r[0]) for r in _pg_rows_of_flow(db, flow_id, None, "stream",
                                                "SELECT stream FROM streams WHERE flow_id = f.flow_id", (),
                                                _by_code_point(db, "j.stream"))]


def list_workers(db: Db) -> list[tuple[str, str, int, int, int]]:
    return [(str(r[0]), str(r[1]), int(r[2]), int(r[3]), int(r[4]))
            for r in db.all("SELECT worker_id, host, pid, started_at, expires_at FROM workers ORDER BY started_at")]
