"""The SQLite store: one file, WAL, one connection per process, group commit on a dedicated thread.

Each process opens one connection, owned by its own thread. Operations queue to that thread; it
runs every queued operation in one `BEGIN IMMEDIATE` transaction, each inside its own savepoint, so
one failing operation rolls back alone while the batch shares a single commit (and fsync).

An operation that finds the thread idle and its event loop with nothing else to run (one session's
turn, one Step after another) runs on the loop instead (`_inline`): the two thread hand-offs it saves
cost more than its statements. It never waits there: when the connection, the write turn or SQLite's
write lock is taken, it goes to the thread, as it does whenever other work is queued, so the group
commit of busy processes is unchanged. The loop is blocked for one transaction, fsync included;
`?inline=off` in the URL keeps every operation on the thread (a loop that must answer within less
than a commit, on a slow disk).

A worker's quiet poll (nothing to claim, no housekeeping due) may not need the connection at all:
it reads PRAGMA data_version on a second, read-only connection on the caller's thread, and when no
connection (this process's writer included) has committed since its last quiet poll, its answer
stands without a trip to the store's thread. That trip (a hand-off to another thread and back)
costs more CPU than the statements, and a worker with claims in flight polls every poll_seconds.

Processes writing the file take turns through an flock on `<file>-dexlock` (_writer_turns) around
each write batch, so a process waiting for another's is woken when that batch commits instead of
sleeping in SQLite's busy handler.

Commits of other processes reach this process's commit listeners from the store's thread: while it
has nothing queued, it reads PRAGMA data_version every watch interval (the shortest poll_seconds of
the workers using it) and calls every listener when another connection has committed. A worker
therefore does not poll, whether or not it runs attempts (a commit that revokes one wakes it like
any other); it sleeps until a commit, its next due time or its housekeeping.

Durability (PRAGMA synchronous, WAL):
- FULL (default): every commit is fsynced before it is acknowledged; survives power loss.
- NORMAL: the WAL is fsynced only at checkpoints; survives any process crash, but the last
  commits before a power loss or OS crash may be lost. ASYNC Steps commit this way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import selectors
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any, Literal, TypeVar, get_args
from urllib.parse import parse_qs, urlparse

from ._attribute_cache import AttributeCache, KnownRows
from ._errors import DatabaseFileReplacedError, StoreOpenError
from ._limits import (
    INLINE_BUSY_TIMEOUT_MS,
    INLINE_LOCK_WAIT_SECONDS,
    INLINE_YIELDS,
    MAX_GROUP_COMMIT_OPS,
    SQLITE_BUSY_TIMEOUT_MS,
    SQLITE_FILE_CHECK_SECONDS,
    SQLITE_MIGRATION_WAIT_SECONDS,
    SQLITE_WRITER_BUSY_SECONDS,
    SQLITE_WRITER_YIELD_SECONDS,
    WAL_SWITCH_RETRY_SECONDS,
)
from ._migrate import apply_pending, migration_files, recorded_version
from ._open import shown_url
from ._store import CLOSED_STORE_ADVICE, Store, commit_origin
from ._task_options import SharedOptions
from ._transitions import AppendRow, Db, HistoryRow, PollResult, Row, UnstoredMessage, run_op
from ._writer_turns import WriterTurns

R = TypeVar("R")

log = logging.getLogger("dex_engine")

Synchronous = Literal["FULL", "NORMAL"]
_SYNCHRONOUS_LEVELS: tuple[Synchronous, ...] = get_args(Synchronous)


@dataclass(frozen=True)
class SqliteSettings:
    path: str
    synchronous: Synchronous = "FULL"
    inline: bool = True  # an idle event loop may run its operation itself (SqliteStore._inline)


_URL_PARAMETERS = ("synchronous", "inline")
_SWITCH = {"on": True, "off": False}


def parse_sqlite_url(url: str) -> SqliteSettings:
    """`sqlite:///relative.db`, `sqlite:////abs/path.db`; optional `synchronous=NORMAL` and `inline=off`.

    The path is taken as written (no %-decoding, no ~), so a URL whose parts a URL parser would drop
    (a host, a #fragment) is refused: opening the rest would open, and create, another file."""
    parsed = urlparse(url)
    shown = shown_url(url)  # named in every refusal: a password (user:password@, ?password=) is not
    if parsed.scheme != "sqlite":
        raise ValueError(f"not a sqlite URL: {shown!r}; expected sqlite:///path/to/file.db")
    if parsed.netloc:
        raise ValueError(f"sqlite URL {shown!r} has a host part ({urlparse(shown).netloc!r}); a sqlite URL names "
                         "a file on this machine: sqlite:///relative/path.db (three slashes) or "
                         "sqlite:////absolute/path.db (four)")
    if "#" in url:
        raise ValueError(f"sqlite URL {shown!r} has a '#', which would end its path; write the path without "
                         "'#' (rename the file or directory, or link to it from a path without one)")
    dropped = sorted({c for c in url if c in "\t\r\n"})
    if dropped:
        # urlparse removes them wherever they are: the rest would name, and create, another file.
        raise ValueError(f"sqlite URL {shown!r} has {' and '.join(repr(c) for c in dropped)}, which URL parsing "
                         "drops; name a file whose path has no tab or line break")
    path = parsed.path[1:] if parsed.path.startswith("/") else parsed.path
    if not path:
        raise ValueError(f"sqlite URL {shown!r} names no file; expected sqlite:///path/to/file.db")
    if path == ":memory:":
        # SQLite's name for a private in-memory database; the engine's connections, workers and
        # clients could not share one, so it would open (and create) a file of that name instead.
        raise ValueError(f"sqlite URL {shown!r} names an in-memory database, which the engine's connections "
                         "and processes cannot share; name a file (a temporary directory's, for tests)")
    query = parse_qs(parsed.query, keep_blank_values=True)
    unknown = sorted(set(query) - set(_URL_PARAMETERS))
    if unknown:
        raise ValueError(f"unknown parameter {unknown[0]!r} in {shown!r}; a sqlite URL takes "
                         f"{' and '.join(_URL_PARAMETERS)}")
    sync = query.get("synchronous", ["FULL"])[-1].upper()
    if sync not in _SYNCHRONOUS_LEVELS:
        raise ValueError(f"synchronous={sync!r} in {shown!r} is not FULL or NORMAL")
    inline = query.get("inline", ["on"])[-1].lower()
    if inline not in _SWITCH:
        raise ValueError(f"inline={inline!r} in {shown!r} is not on or off")
    return SqliteSettings(path=path, synchronous=sync, inline=_SWITCH[inline])


class _OpenFiles:
    """The SQLite files this process's stores have open, and those a process this one is a fork of
    had open as it forked. SQLite keeps each file's lock state per process, and a fork copies it: a
    store the fork opens on such a file takes the parent's locks for its own (a fork made mid-write
    then waited for a write lock nobody held, 30 s per try), and SQLite's documentation warns that
    this can corrupt the file."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: dict[str, int] = {}  # stores open, by realpath
        self.before_fork: set[str] = set()

    def note(self, path: str, change: int) -> None:
        with self.lock:
            left = self.counts.get(path, 0) + change
            if left > 0:
                self.counts[path] = left
            else:
                self.counts.pop(path, None)

    def after_fork_in_child(self) -> None:
        self.before_fork.update(self.counts)
        self.counts.clear()
        self.lock = threading.Lock()  # a thread of the parent may have held it as the process forked


_OPEN_FILES = _OpenFiles()
os.register_at_fork(after_in_child=_OPEN_FILES.after_fork_in_child)


class _SqliteDb:
    __slots__ = (
        "appends", "cache", "cache_writes", "conn", "counted", "counters", "cursor", "flow_rows", "history", "known",
        "readied", "revokes", "shared_options", "streamed", "streams", "unstored", "version_after",
    )

    # BEGIN IMMEDIATE serializes every writer of the file: no row locks needed.
    for_update = ""
    skip_locked = ""
    # Every write of the file is serialized, so a method's snapshot can stay the live rows until
    # something would change them (_transitions.LIVE_SNAPSHOT).
    lazy_snapshots = True

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        # Task options are stored once per distinct value (schema 6, _task_options).
        self.shared_options = SharedOptions()
        # One cursor for every statement: a new one per statement costs more than many statements.
        self.cursor = conn.cursor()
        self.cache: AttributeCache | None = AttributeCache()
        self.known: dict[str, KnownRows | None] = {}
        self.version_after: dict[str, int] = {}
        self.flow_rows: dict[str, tuple[int, int]] = {}
        self.cache_writes: list[tuple[str, KnownRows]] = []
        self.history: list[HistoryRow] = []
        self.appends: list[AppendRow] = []
        self.unstored: list[UnstoredMessage] = []
        self.counters: dict[str, dict[str, int]] = {}
        self.counted: set[str] = set()
        self.streams: dict[str, dict[str, list[int]]] = {}
        self.streamed: set[str] = set()
        self.readied = 0  # how often a transition made work ready (notify): commits claim it
        self.revokes = 0  # how often one revoked a running attempt: its own worker must be woken too

    def notify(self) -> None:
        """Other processes see commits through PRAGMA data_version; nothing to send."""
        self.readied += 1

    def revoked(self) -> None:
        """Other processes see commits through PRAGMA data_version; this one wakes every worker."""
        self.revokes += 1

    def one(self, sql: str, params: Sequence[Any] = ()) -> Row | None:
        # Read to the end, so that no statement stays open on the shared cursor.
        rows = self.cursor.execute(sql, params).fetchall()
        return rows[0] if rows else None

    def all(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        return self.cursor.execute(sql, params).fetchall()

    def run(self, sql: str, params: Sequence[Any] = ()) -> int:
        return self.cursor.execute(sql, params).rowcount

    def insert(self, sql: str, params: Sequence[Any] = ()) -> int:
        """Run an INSERT of one row; its rowid (cheaper than RETURNING, which buffers the row)."""
        cursor = self.cursor.execute(sql, params)
        assert cursor.lastrowid is not None
        return cursor.lastrowid


@dataclass
class _Op:
    fn: Callable[[Db], Any]
    write: bool
    durable: bool
    loop: asyncio.AbstractEventLoop | None  # None: `future` is a concurrent Future (run_sync)
    future: asyncio.Future[Any] | Future[Any]
    origin: Callable[[], None] | None = None


def _remember(db: _SqliteDb) -> None:
    """After a commit: the rows its operations left known go to the store's cache (_attribute_cache)."""
    if db.cache is not None:
        for flow_id, known in db.cache_writes:
            db.cache.put(flow_id, known)
    db.shared_options.committed()


def _timer_due(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether `loop` has a timer whose time has come (asyncio's heap of TimerHandles; a loop without
    one, uvloop, hands every operation off anyway). Such a timer reaches the ready queue only when
    the loop runs a round: a caller running one operation after another inline never suspends, so
    without this check its loop's sleeps, wait_for timeouts and lease renewals never fired while it
    went on (a client paging through a long transcript)."""
    scheduled: list[asyncio.TimerHandle] | None = getattr(loop, "_scheduled", None)
    return scheduled is not None and len(scheduled) > 0 and scheduled[0].when() <= loop.time()


def _io_ready(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether a file `loop` watches (a server's socket, a connection) has something for it, asked
    of its selector without waiting: like a due timer, that reaches the loop only when it runs a
    round, and a caller running one operation after another inline never let it (a server on that
    loop read nothing while a client paged through a long transcript). About 1 us a call. uvloop,
    without asyncio's ready queue, hands every operation off before this; Windows' proactor has no
    selector to ask (its `_selector` is the proactor, whose select consumes completions)."""
    selector = getattr(loop, "_selector", None)
    return isinstance(selector, selectors.BaseSelector) and len(selector.select(0)) > 0


def _is_busy(exc: BaseException) -> bool:
    """SQLite's lock was taken (SQLITE_BUSY or an extended form): the transaction was rolled back."""
    code = getattr(exc, "sqlite_errorcode", None)
    return isinstance(exc, sqlite3.OperationalError) and code is not None and code & 0xFF == sqlite3.SQLITE_BUSY


def _is_readonly(exc: BaseException) -> bool:
    """SQLite refused a write to a file it has open read-only (SQLITE_READONLY or an extended form, but
    for the file having been unlinked, which _check_file reports)."""
    code = getattr(exc, "sqlite_errorcode", None)
    return (isinstance(exc, sqlite3.OperationalError) and code is not None
            and code & 0xFF == sqlite3.SQLITE_READONLY and code != sqlite3.SQLITE_READONLY_DBMOVED)


def _euid() -> str:
    return str(os.geteuid()) if hasattr(os, "geteuid") else "unknown"  # Windows has no uids


def _deliver(items: list[tuple[asyncio.Future[Any], bool, Any]], listeners: list[Callable[[], None]]) -> None:
    """Runs on the caller's event loop: one wake-up resolves every result of a batch."""
    for future, ok, value in items:
        if future.cancelled():
            continue
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)
    for listener in listeners:
        listener()


_STOP = object()
_WATCH = object()  # queued when the watch interval changes: the thread may be waiting without one


def _file_identity(path: str) -> tuple[int, int] | None:
    """(device, inode) of the file at `path`, None when there is none."""
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        return None
    return stat.st_dev, stat.st_ino


# SQLite's files beside the database in WAL mode: while any connection has the file open they stay,
# so one gone or of another inode was deleted or replaced (the -wal with commits not yet copied into
# the database file; a new -shm splits the processes' views of the -wal).
_SIDE_FILES = ("-wal", "-shm")


def schema_version(conn: sqlite3.Connection, path: str) -> int:
    """The dex_engine schema version of the file `path` open on `conn`, read without changing anything:
    0 for a file holding nothing yet (new, or zero bytes). A file holding anything else (another
    application's tables, a `meta` table dex_engine did not write) is refused with StoreOpenError:
    migrating it would add the engine's tables to that application's data."""
    entries = conn.execute("SELECT type, name FROM sqlite_master").fetchall()
    if not entries:
        if _foreign_bytes(path):
            # SQLite reads a file of a few bytes as an empty database, and migrating would overwrite it.
            raise _not_dex_engine(path, "it holds bytes that are not a SQLite database's")
        # dex_engine sets neither: a file without tables that has one is another application's,
        # set up before it creates its tables.
        for mark in ("application_id", "user_version"):
            value = conn.execute(f"PRAGMA {mark}").fetchone()[0]
            if value:
                raise _not_dex_engine(path, f"it has no tables, but its {mark} is {value}, set by another "
                                            "application")
        return 0
    tables = {name for kind, name in entries if kind == "table"}
    if not {"meta", "flows"} <= tables:
        raise _not_dex_engine(path, "its tables do not include dex_engine's meta and flows")
    columns = {row[0] for row in conn.execute("SELECT name FROM pragma_table_info('meta')")}
    if not {"key", "value"} <= columns:
        raise _not_dex_engine(path, "its meta table has no key and value columns")
    row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    stored = row[0] if row else None
    version = recorded_version(stored)
    if version is None:
        raise _not_dex_engine(path, f"its meta table's schema_version is {stored!r}, not a dex_engine schema "
                                    "version")
    return version


def _foreign_bytes(path: str) -> bool:
    """Whether the file at `path` holds bytes but less than a SQLite page, which no database has.
    Empty (or missing) is not foreign: a new database's pages may still be only in its WAL.

    By size, never by reading it: closing any descriptor of the file drops every POSIX lock this
    process holds on it, SQLite's included, and other stores of the process may have it open."""
    try:
        size = os.stat(path).st_size
    except OSError:
        return False  # SQLite opened it; what it cannot read, it reports itself
    return 0 < size < _SMALLEST_DATABASE_BYTES


def _refuse_orphan_wal(path: str) -> None:
    """StoreOpenError when the file at `path` is missing or empty while a -wal with frames sits beside
    it: the -wal of a database file moved or deleted while processes had it open (mv leaves the -wal
    and -shm at the old names). SQLite would apply it to the new file, failing with `disk I/O error`
    or folding another file's pages into it. A WAL-mode file always holds its header page, written
    before its -wal is made, so a new database never looks like this."""
    real = os.path.realpath(path)  # SQLite keeps the -wal beside the file a symlink leads to
    try:
        wal_bytes = os.stat(real + "-wal").st_size
    except OSError:
        return
    try:
        size: int | None = os.stat(real).st_size
    except FileNotFoundError:
        size = None
    except OSError:
        return  # SQLite reports what it cannot open itself
    if wal_bytes and not size:
        raise StoreOpenError(
            f"cannot open {path!r}: it is {'missing' if size is None else 'empty'}, but {real + '-wal'!r} beside it "
            f"holds {wal_bytes} bytes, the -wal of a database file that was moved or deleted while processes had it "
            "open; opening would apply another file's pages to this one. Stop every process that has the old file "
            "open; then move the old file back (or move its -wal and -shm along with it), or, to start with a new "
            f"database, delete {real + '-wal'!r} and {real + '-shm'!r}")


_SMALLEST_DATABASE_BYTES = 512  # SQLite's smallest page size; a database file holds whole pages


def _not_dex_engine(path: str, why: str) -> StoreOpenError:
    return StoreOpenError(f"{path!r} is not a dex_engine database: {why}; name a new file, or one "
                          "dex_engine created")


def migrate(conn: sqlite3.Connection, path: str) -> None:
    """Apply numbered migrations not yet applied to the file `path` open on `conn`."""
    if _up_to_date(conn, path):
        return
    _begin_migration(conn, path)
    try:
        # Judged again under the write lock: the file may have changed since the judgement before
        # WAL (SqliteStore._connect), another store having migrated it meanwhile.
        apply_pending(conn.execute, "sqlite", schema_version(conn, path), "?", path)
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def _up_to_date(conn: sqlite3.Connection, path: str) -> bool:
    """Whether the file's committed schema is this engine's and has its stream token secret, read
    without the write lock: opening such a file writes nothing. Taking the lock anyway made every
    process that opened the file (a client, the command line) wait for any other process's write,
    and one that held it past the busy timeout (a long transaction, the sqlite3 shell) refused the
    open with `database is locked`, although WAL lets a reader in."""
    conn.execute("BEGIN")
    try:
        if schema_version(conn, path) != migration_files("sqlite")[-1][0]:
            return False
        return conn.execute("SELECT 1 FROM meta WHERE key = 'stream_token_secret'").fetchone() is not None
    finally:
        if conn.in_transaction:
            conn.execute("ROLLBACK")


def _begin_migration(conn: sqlite3.Connection, path: str) -> None:
    """BEGIN IMMEDIATE, waiting as long as another store migrates the file.

    Stores starting together on a file an older dex_engine made all find it behind, and one of them
    migrates it while the others wait for the write lock. A migration that rewrites a large file
    (schema 7 rewrote every history row: about a minute for 9 million) outlasts the busy timeout;
    so while the file's committed version, read before each try (WAL lets a reader see it), is
    older than this engine's, the lock is tried again, for up to SQLITE_MIGRATION_WAIT_SECONDS."""
    latest = migration_files("sqlite")[-1][0]
    deadline = time.monotonic() + SQLITE_MIGRATION_WAIT_SECONDS
    told = False
    while True:
        behind = _committed_version(conn, path) < latest
        try:
            conn.execute("BEGIN IMMEDIATE")
            return
        except sqlite3.OperationalError as exc:
            if not (_is_busy(exc) and behind) or time.monotonic() >= deadline:
                raise
        if not told:
            log.info("waiting for another process to migrate %r to dex_engine schema %d", path, latest)
            told = True
        time.sleep(WAL_SWITCH_RETRY_SECONDS)  # SQLite's busy handler waited; this only bounds a busy loop


def _committed_version(conn: sqlite3.Connection, path: str) -> int:
    conn.execute("BEGIN")
    try:
        return schema_version(conn, path)
    finally:
        if conn.in_transaction:
            conn.execute("ROLLBACK")


# What a quiet poll asked: the worker's flow types and its running attempts' task IDs.
_Asked = tuple[tuple[str, ...], tuple[int, ...]]


class _QuietPolls:
    """Each worker's last quiet-poll answer, valid while the file's data_version stays the same.

    The version is read on a connection of its own, so commits by this process's writer change it
    as well as other processes' commits. Thread-safe (workers of one store may run on several event
    loops); on any error it answers nothing and the poll takes the store's thread as before.
    """

    def __init__(self, path: str) -> None:
        self._path = path
        self._lock = threading.Lock()
        self._conn: sqlite3.Connection | None = None
        self._closed = False
        self._answers: dict[str, tuple[int, _Asked, PollResult]] = {}

    def _version(self) -> int | None:
        try:
            if self._conn is None:
                # busy_timeout 0: this runs on an event loop; when the file is busy, ask the store.
                self._conn = sqlite3.connect(self._path, isolation_level=None, check_same_thread=False,
                                             timeout=0)
            row = self._conn.execute("PRAGMA data_version").fetchone()
            return int(row[0])
        except sqlite3.Error:
            return None

    def answer(self, worker_id: str, asked: _Asked) -> tuple[int | None, PollResult | None]:
        """(the file's data_version now, the kept answer when it is still valid for `asked`)."""
        with self._lock:
            if self._closed:
                return None, None
            version = self._version()
            kept = self._answers.get(worker_id)
            if version is not None and kept is not None and kept[0] == version and kept[1] == asked:
                return version, kept[2]
            return version, None

    def forget(self, worker_id: str) -> None:
        """Drop `worker_id`'s kept answer: a store shared by workers started and stopped one after
        another (each with a new ID) kept one per worker it ever served until it closed."""
        with self._lock:
            self._answers.pop(worker_id, None)

    def keep(self, worker_id: str, version: int | None, asked: _Asked, result: PollResult | None) -> None:
        with self._lock:
            if version is None or result is None:
                self._answers.pop(worker_id, None)
            else:
                self._answers[worker_id] = (version, asked, result)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._answers.clear()
            if self._conn is not None:
                self._conn.close()
                self._conn = None


def _enter_wal(conn: sqlite3.Connection) -> str:
    """Put the file in WAL mode, or find it there; the journal mode it is in after.

    Stores opening a new file at once (a deploy of many workers) race to convert it, and a loser
    can get SQLITE_BUSY at once, its busy handler not called (waiting could deadlock). The winner
    is done within milliseconds: the switch is tried again, for up to the busy timeout."""
    deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT_MS / 1000
    while True:
        try:
            return str(conn.execute("PRAGMA journal_mode = WAL").fetchone()[0])
        except sqlite3.OperationalError as exc:
            if exc.sqlite_errorcode != sqlite3.SQLITE_BUSY or time.monotonic() >= deadline:
                raise
        time.sleep(WAL_SWITCH_RETRY_SECONDS)


class SqliteStore(Store):
    """A Store on one SQLite file; safe for several processes on one machine."""

    folds_waits = True
    folds_executes = True
    light_polls = True
    hands_off_locally = True

    def __init__(self, url: str) -> None:
        self.url = url
        self._opened_pid = os.getpid()  # its thread and connections belong to this process alone
        settings = parse_sqlite_url(url)
        # Resolved once, now: the quiet-poll connection and the write-turn file are opened later, and
        # a process that changed directory meanwhile would open (and create) files of that name there.
        self.settings = replace(settings, path=os.path.abspath(settings.path))
        self._real_path = os.path.realpath(self.settings.path)
        if self._real_path in _OPEN_FILES.before_fork:
            raise StoreOpenError(
                f"cannot open {shown_url(url)!r} in process {os.getpid()}: it is a fork of a process that had "
                "this SQLite file open as it forked (a Client, AsyncClient or AsyncWorker made before the fork, "
                "as with gunicorn --preload), and SQLite's locks cannot be used safely in such a fork (writes "
                "wait for locks nobody holds; the file can be corrupted); open the database only after the fork, "
                "in each process (in gunicorn's post_fork hook, or on first use), or close it before forking")
        self._queue: queue.SimpleQueue[_Op | object] = queue.SimpleQueue()
        self._listeners: list[tuple[asyncio.AbstractEventLoop, Callable[[], None]]] = []
        self._data_version = -1
        self._watch_seconds: float | None = None  # set by watch_foreign_commits
        self._quiet = _QuietPolls(self.settings.path)
        self._ready: Future[None] = Future()
        # The connection and what goes with it (its _SqliteDb, write turn, synchronous level and
        # busy timeout) are used by whoever holds _conn_lock: the store's thread for a batch, or an
        # event loop for one operation (_inline).
        self._conn_lock = threading.Lock()
        self._count_lock = threading.Lock()
        self._outstanding = 0  # operations queued and not yet completed: _inline must not overtake them
        # Operations letting their loop's ready callbacks run before they run inline (_run), by loop.
        self._yielding: dict[asyncio.AbstractEventLoop, int] = {}
        # Loops where an operation ran inline ahead of such a one since it last got its round (_yielders).
        self._overtaken: set[asyncio.AbstractEventLoop] = set()
        self._thread = threading.Thread(target=self._main, name=f"dex-sqlite:{self.settings.path}", daemon=True)
        self._closed = False
        _OPEN_FILES.note(self._real_path, 1)
        self._thread.start()
        try:
            self._ready.result()
        except BaseException:
            _OPEN_FILES.note(self._real_path, -1)
            raise

    def _connect(self) -> sqlite3.Connection:
        path = self.settings.path
        _refuse_orphan_wal(path)
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False,
                                   timeout=SQLITE_BUSY_TIMEOUT_MS / 1000)
        except (OSError, sqlite3.Error) as exc:
            raise self._open_error(exc) from exc
        try:
            conn.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
            # Before anything is changed, the journal mode included: a file that is not a dex_engine
            # database is refused as it was. One read transaction: its reads see one state of a file
            # another store may be migrating.
            conn.execute("BEGIN")
            try:
                schema_version(conn, path)
            finally:
                if conn.in_transaction:  # an error may have ended it
                    conn.execute("ROLLBACK")
            mode = _enter_wal(conn)
            if str(mode).lower() != "wal":
                raise StoreOpenError(f"could not put {path!r} in WAL mode (got {mode!r})")
            conn.execute(f"PRAGMA synchronous = {self.settings.synchronous}")
            conn.execute("PRAGMA foreign_keys = ON")
            migrate(conn, path)
        except (OSError, sqlite3.Error) as exc:
            conn.close()
            raise self._open_error(exc) from exc
        except BaseException:
            conn.close()
            raise
        return conn

    def _open_error(self, exc: BaseException) -> StoreOpenError:
        # SQLite's own texts ("unable to open database file") name no file.
        return StoreOpenError(
            f"cannot open {self.settings.path!r} (from {self.url!r}) as a dex_engine database: "
            f"{type(exc).__name__}: {exc}; the URL must name a new file, or one dex_engine created, "
            "in a directory this process may write"
        )

    def _main(self) -> None:
        try:
            conn = self._connect()
        except BaseException as exc:
            self._ready.set_exception(exc)
            return
        db = _SqliteDb(conn)
        # Beside the file the path resolves to, as SQLite's -wal and -shm are: processes naming one file
        # by different paths (a symlink to it) must take turns on one lock file.
        turns = WriterTurns(self._real_path)
        self._conn, self._db, self._turns = conn, db, turns
        self._file_identity = _file_identity(self.settings.path)
        # Those that exist now (a file system without shared memory has no -shm) are checked.
        self._side_identities = {suffix: identity for suffix in _SIDE_FILES
                                 if (identity := _file_identity(self._real_path + suffix)) is not None}
        self._next_file_check = time.monotonic() + SQLITE_FILE_CHECK_SECONDS
        self._level: str = self.settings.synchronous
        self._busy_timeout_ms = SQLITE_BUSY_TIMEOUT_MS
        self._ready.set_result(None)
        busy_since: float | None = None  # when this thread started writing back to back
        # When data_version is due to be read. A deadline, not an idle interval: operations that
        # wake no listener (reads, a worker's own event appends) may keep arriving more often than
        # the interval, and other processes' commits would then wake nobody until housekeeping.
        next_watch: float | None = None
        try:
            while True:
                watch = self._watch_seconds
                timeout = None
                if watch is not None:
                    now = time.monotonic()
                    if next_watch is None:
                        next_watch = now + watch
                    elif now >= next_watch:
                        with self._conn_lock:
                            self._tell_foreign_commits(db)
                        next_watch = now + watch
                    timeout = next_watch - now
                try:
                    first = self._queue.get() if timeout is None else self._queue.get(timeout=timeout)
                except queue.Empty:
                    continue  # the watch is due: read at the top of the loop
                if first is _STOP:
                    break
                if first is _WATCH:
                    next_watch = None
                    continue  # wait again, with the new interval
                batch: list[_Op] = [first]  # type: ignore[list-item]
                stop = False
                while len(batch) < MAX_GROUP_COMMIT_OPS:
                    try:
                        nxt = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if nxt is _STOP:
                        stop = True
                        break
                    if nxt is _WATCH:
                        continue
                    batch.append(nxt)  # type: ignore[arg-type]
                writes = any(op.write for op in batch)
                with self._conn_lock, turns if writes else contextlib.nullcontext():
                    self._set_busy_timeout(SQLITE_BUSY_TIMEOUT_MS)
                    self._level = self._run_batch(conn, db, batch, self._level)
                # Not kept while waiting for the next: a failed operation's error holds its caller's
                # frames, and with them kept the last client to use this thread from being collected.
                first = nxt = None
                batch = []
                if stop:
                    break
                if not writes or self._queue.empty():
                    busy_since = None  # the thread goes idle: the write lock is free
                    continue
                now = time.monotonic()
                busy_since = busy_since or now
                if now - busy_since >= SQLITE_WRITER_BUSY_SECONDS:
                    # Back-to-back write batches would hold the file's write lock all the time:
                    # this thread takes its turn again before a woken waiter runs, and a writer
                    # outside the turns (whose busy handler sleeps between tries) would starve.
                    time.sleep(SQLITE_WRITER_YIELD_SECONDS)
                    busy_since = None
        finally:
            # close_nowait queues _STOP without _count_lock: an operation let in just before may be
            # behind it. Once this holds the lock no other gets in, so those are all refused here.
            with self._count_lock:
                self._closed = True
                left: list[_Op] = []
                while True:
                    try:
                        item = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if isinstance(item, _Op):
                        left.append(item)
            closed = RuntimeError(f"store {shown_url(self.url)!r} is closed; {CLOSED_STORE_ADVICE}")
            self._complete(left, [(False, closed)] * len(left), False)
            with self._conn_lock:
                turns.close()
                conn.close()
            self._quiet.close()
            _OPEN_FILES.note(self._real_path, -1)  # its quiet-poll connection holds no lock between reads

    def _run_batch(self, conn: sqlite3.Connection, db: _SqliteDb, batch: list[_Op], level: str) -> str:
        level, results, writes, revoked = self._execute(conn, db, batch, level)
        if any(not ok and _is_busy(value) for ok, value in results) and any(op.write for op in batch):
            results = [(ok, self._busy_error(value) if not ok and _is_busy(value) else value) for ok, value in results]
        # Done before the callers hear of it: a caller that goes on at once (its next operation)
        # may then run that one on its loop, not queue it behind work that has already finished.
        with self._count_lock:
            self._outstanding -= len(batch)
        self._complete(batch, results, writes, wake_origins=revoked)
        return level

    def _execute(
        self, conn: sqlite3.Connection, db: _SqliteDb, batch: list[_Op], level: str
    ) -> tuple[str, list[tuple[bool, Any]], bool, bool]:
        """Run `batch` in one transaction: (synchronous level now, each result, committed writes,
        whether an operation revoked a running attempt)."""
        writes = any(op.write for op in batch)
        wanted: str = self.settings.synchronous
        if not writes:
            wanted = level  # a read commits nothing: leave the level as it is
        elif not any(op.durable for op in batch if op.write):
            wanted = "NORMAL"
        results: list[tuple[bool, Any]] = []
        revokes = db.revokes
        try:
            if wanted != level:
                conn.execute(f"PRAGMA synchronous = {wanted}")
                level = wanted
            db.shared_options.rolled_back()  # a transaction starts with no confirmations of its own
            self._check_file(writes)
            conn.execute("BEGIN IMMEDIATE" if writes else "BEGIN")
            if len(batch) == 1:
                try:
                    results.append((True, run_op(batch[0].fn, db)))
                    conn.execute("COMMIT")
                    _remember(db)
                except BaseException as exc:
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                    results = [(False, exc)]
            else:
                try:
                    # Optimistic: no savepoints (each costs statements); they are only needed
                    # when an operation fails, and then the batch runs again with them.
                    for op in batch:
                        results.append((True, run_op(op.fn, db)))
                    conn.execute("COMMIT")
                    _remember(db)
                except BaseException:
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                    results = self._run_isolated(conn, db, batch, writes)
        except BaseException as exc:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            results = [(False, exc)] * len(batch)
            writes = False
        finally:
            # Applied by _remember if it committed; a rolled-back transaction's rows are nobody's.
            db.cache_writes.clear()
        if any(not ok and _is_readonly(value) for ok, value in results):
            results = [(ok, self._readonly_error(value) if not ok and _is_readonly(value) else value)
                       for ok, value in results]
        # A rolled-back revocation still counts: one spurious wake-up costs a poll, a missed one a
        # running attempt that goes on until housekeeping.
        return level, results, writes, writes and db.revokes != revokes

    def _readonly_error(self, exc: sqlite3.OperationalError) -> sqlite3.OperationalError:
        """The error a write fails with on a file SQLite opened read-only, which it does, saying nothing,
        when this process may not write the file (its owner or mode changed, another user's process
        created it): SQLite's own `attempt to write a readonly database` names no file, nor the cause.
        Same text first, type and error code, so code that catches it still does."""
        path = self.settings.path
        try:
            stat = os.stat(path)
            now = f"owner uid {stat.st_uid}, mode {stat.st_mode & 0o777:o}"
        except OSError as stat_error:
            now = f"cannot stat it: {stat_error}"
        error = sqlite3.OperationalError(
            f"{exc}: {path!r} ({now}) cannot be written by this process (uid {_euid()}), so SQLite opened "
            "it read-only; nothing was written: let the user this process runs as write the file, its -wal and "
            "-shm and their directory (chown or chmod), or run the process as their owner, then restart it")
        error.sqlite_errorcode = exc.sqlite_errorcode
        error.sqlite_errorname = exc.sqlite_errorname
        error.__cause__ = exc
        return error

    def _busy_error(self, exc: sqlite3.OperationalError) -> sqlite3.OperationalError:
        """The error a write fails with when SQLite's write lock stayed taken past the busy timeout.
        SQLite's own text, `database is locked`, names no file and does not say that nothing was
        written, which a caller needs to know to call again. Same type and error code, so code that
        catches it still does."""
        error = sqlite3.OperationalError(
            f"database is locked: another connection held the write lock of {self.settings.path!r} for longer "
            f"than the busy timeout ({self._busy_timeout_ms / 1000:g} s): a long transaction, the sqlite3 shell, "
            "or a process frozen or stopped in a debugger; nothing was written, so the call can be made again")
        error.sqlite_errorcode = exc.sqlite_errorcode
        error.sqlite_errorname = exc.sqlite_errorname
        error.__cause__ = exc
        return error

    def _check_file(self, writes: bool) -> None:
        """Refuse to run when the database file, or its -wal or -shm, was deleted or replaced under
        this store: SQLite goes on using the open, unlinked files, so every write would be lost on
        reopen while other processes use the new file at that path, and every read would show a state
        nobody else sees (a client waiting for a flow would wait for ever). Every write checks the
        database file (one stat); reads, and the -wal and -shm, are checked every
        SQLITE_FILE_CHECK_SECONDS."""
        path = self.settings.path
        now = time.monotonic()
        full = now >= self._next_file_check
        if (writes or full) and _file_identity(path) != self._file_identity:
            raise DatabaseFileReplacedError(
                f"database file {path!r} was deleted or replaced while this process had it open; nothing was "
                "written (the writes would be lost) or read (it would be the old file's): restart this process "
                "to open the file now at that path")
        if not full:
            return
        for suffix, identity in self._side_identities.items():
            side = self._real_path + suffix  # SQLite keeps them beside the file a symlink leads to
            if _file_identity(side) != identity:
                raise DatabaseFileReplacedError(
                    f"{side!r}, SQLite's {suffix[1:]} file of database {path!r}, was deleted or replaced "
                    "while this process had the database open; nothing was written: SQLite's processes no longer "
                    "share one view of the file, and commits not yet copied from the -wal into the database file "
                    "may be lost. Stop every process using the database, check it (sqlite3 FILE 'PRAGMA "
                    "integrity_check'), then start them again")
        self._next_file_check = now + SQLITE_FILE_CHECK_SECONDS

    def _set_busy_timeout(self, ms: int) -> None:
        if ms != self._busy_timeout_ms:
            self._conn.execute(f"PRAGMA busy_timeout = {ms}")
            self._busy_timeout_ms = ms

    @staticmethod
    def _run_isolated(
        conn: sqlite3.Connection, db: _SqliteDb, batch: list[_Op], writes: bool,
    ) -> list[tuple[bool, Any]]:
        """Run the batch again, each operation in its own savepoint, so a failing one rolls back alone.
        A batch of reads takes no write lock for it: it has no writer turn, and would wait for writers."""
        results: list[tuple[bool, Any]] = []
        db.cache_writes.clear()
        db.shared_options.rolled_back()  # the batch's first run rolled back: its confirmations with it
        conn.execute("BEGIN IMMEDIATE" if writes else "BEGIN")
        for op in batch:
            conn.execute("SAVEPOINT op")
            try:
                results.append((True, run_op(op.fn, db)))
                conn.execute("RELEASE op")
            except BaseException as exc:
                conn.execute("ROLLBACK TO op")
                conn.execute("RELEASE op")
                db.shared_options.rolled_back()
                results.append((False, exc))
        conn.execute("COMMIT")
        _remember(db)
        return results

    def _complete(
        self, batch: list[_Op], results: list[tuple[bool, Any]], notify: bool, *, wake_origins: bool = False,
        on_loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        # GIL hand-offs between this thread and an event loop cost far more than the work, so each
        # loop is woken once per batch, with its commit listeners folded into the same wake-up. A
        # worker is not woken by a batch of only its own commits (they hand it what they claimed),
        # unless one revoked a running attempt (`wake_origins`): it may be that worker's own (E9).
        per_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[Any], bool, Any]]] = {}
        for op, (ok, value) in zip(batch, results, strict=True):
            if op.loop is None:
                assert isinstance(op.future, Future)
                if ok:
                    op.future.set_result(value)
                else:
                    op.future.set_exception(value)
            else:
                assert isinstance(op.future, asyncio.Future)
                per_loop.setdefault(op.loop, []).append((op.future, ok, value))
        listeners: dict[asyncio.AbstractEventLoop, list[Callable[[], None]]] = {}
        if notify:
            origins = {op.origin for op in batch if op.write}
            for loop, fn in list(self._listeners):
                if wake_origins or origins != {fn}:
                    listeners.setdefault(loop, []).append(fn)
        for loop in per_loop.keys() | listeners.keys():
            if loop is on_loop:
                # This is that loop's thread, inside the caller's own coroutine (_inline): its result
                # is set now, so its await returns at once instead of a loop iteration and a task
                # wake-up later; the listeners run soon, as for any commit.
                _deliver(per_loop.get(loop, []), [])
                if loop in listeners:
                    loop.call_soon(_deliver, [], listeners[loop])
            elif not loop.is_closed():
                with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                    loop.call_soon_threadsafe(_deliver, per_loop.get(loop, []), listeners.get(loop, []))

    def _refuse_if_closed(self) -> None:
        self._refuse_in_fork()
        if self._closed:
            raise RuntimeError(f"store {shown_url(self.url)!r} is closed; {CLOSED_STORE_ADVICE}")

    async def _run(
        self, fn: Callable[[Db], R], *, write: bool, durable: bool | None = None, inline: bool = True,
    ) -> R:
        self._refuse_if_closed()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[R] = loop.create_future()
        op = _Op(fn, write, True if durable is None else durable, loop, future, commit_origin.get())
        if not inline:
            self._enqueue(op)
        elif not self._inline(op, loop):
            for _ in range(INLINE_YIELDS):
                if not self._only_the_loop_is_busy(loop):
                    break
                # What is ready is mostly short, often the caller's own continuation (an RPC's
                # caller, an attempt's event flush and the wake-ups it causes). Run it first: an
                # operation then run inline costs less CPU and time than a hand-off, and only an
                # Execute's commit run inline can fold the Steps it readies. A loop still busy after
                # a few rounds hands off.
                self._yielding[loop] = self._yielding.get(loop, 0) + 1
                try:
                    await asyncio.sleep(0)
                finally:
                    self._unyield(loop)
                if self._inline(op, loop):
                    return await future
            self._enqueue(op)
        return await future

    def _only_the_loop_is_busy(self, loop: asyncio.AbstractEventLoop) -> bool:
        """Whether `loop` has callbacks ready while the store's thread is idle, so that an operation
        refused by `_inline` may run inline once they ran. A busy thread gets the operation at once,
        to share its next group commit."""
        ready = getattr(loop, "_ready", None)
        return (ready is not None and len(ready) > self._yielders(loop) and self.settings.inline
                and not self._outstanding and not self._closed)

    def _unyield(self, loop: asyncio.AbstractEventLoop) -> None:
        # The last one out drops the loop's entry: a store outlives many loops (asyncio.run per request
        # in a threaded app, a test framework's loop per test), and kept it kept every loop it served.
        self._overtaken.discard(loop)  # it got its round
        left = self._yielding[loop] - 1
        if left:
            self._yielding[loop] = left
        else:
            del self._yielding[loop]

    def _yielders(self, loop: asyncio.AbstractEventLoop) -> int:
        """Ready callbacks of `loop` that _inline may ignore: one of another operation letting the
        loop run before its own (_run), whose wait for this one would only hand both off. More
        operations waiting at once commit together on the store's thread (group commit). Only once
        until that operation got its round: a task running operations back to back inline never
        suspends, so it kept the waiting one from ever running again (a client's write beside a
        transcript export on one loop hung until the export ended)."""
        return 0 if loop in self._overtaken else min(self._yielding.get(loop, 0), 1)

    def _enqueue(self, op: _Op) -> None:
        # Under the lock close() takes: an operation is queued before _STOP, and so runs, or refused.
        with self._count_lock:
            self._refuse_if_closed()
            self._outstanding += 1
            self._queue.put(op)

    def _inline(self, op: _Op, loop: asyncio.AbstractEventLoop) -> bool:
        """Run `op` on `loop`, its caller's, when that loop has nothing else to run and nothing waits
        for the connection; False, having done nothing, when it must go to the store's thread."""
        # asyncio's queue of ready callbacks; a loop without one (uvloop) always hands off. That of
        # another operation letting the loop run before its own does not count (_yielders).
        ready = getattr(loop, "_ready", None)
        if (ready is None or len(ready) > self._yielders(loop) or not self.settings.inline
                or _timer_due(loop) or not self._take_connection()):
            return False
        try:
            # Asked last, when nothing else refuses: the syscall lets the store's thread run, and asked
            # of every operation of a busy process it split its group commits.
            if self._outstanding or self._closed or _io_ready(loop):
                return False
            if op.write and not self._turns.try_enter():
                return False  # another process writes: wait for its turn on the thread
            try:
                self._set_busy_timeout(INLINE_BUSY_TIMEOUT_MS)
                self._level, results, writes, revoked = self._execute(self._conn, self._db, [op], self._level)
            finally:
                if op.write:
                    self._turns.leave()
            ok, value = results[0]
            if not ok and _is_busy(value):
                return False  # rolled back: the thread waits for SQLite's lock instead
            if ready and loop in self._yielding:
                self._overtaken.add(loop)  # ahead of an operation letting the loop run (_yielders)
            self._complete([op], results, writes, wake_origins=revoked, on_loop=loop)
            return True
        finally:
            self._conn_lock.release()

    def _take_connection(self) -> bool:
        """Acquire the connection for an operation on its loop: at once, or, while the store's thread
        has nothing queued (it is finishing up), within INLINE_LOCK_WAIT_SECONDS."""
        if self._conn_lock.acquire(blocking=False):
            return True
        return not self._outstanding and self._conn_lock.acquire(timeout=INLINE_LOCK_WAIT_SECONDS)

    def run_sync(self, fn: Callable[[Db], R], *, write: bool) -> R:
        """Blocking form of `_run` that always queues `fn` for the store's thread, never inline: the
        tests use it to hold that thread busy, or to queue operations behind one, from any thread."""
        future: Future[R] = Future()
        self._enqueue(_Op(fn, write, True, None, future))
        return future.result()

    def watch_foreign_commits(self, interval_seconds: float) -> bool:
        current = self._watch_seconds
        self._watch_seconds = interval_seconds if current is None else min(current, interval_seconds)
        if self._watch_seconds != current:
            # With every operation run inline, nothing else might ever wake the thread to read it.
            self._queue.put(_WATCH)
        return True

    def _tell_foreign_commits(self, db: _SqliteDb) -> None:
        """On the store's thread, idle: call every commit listener if another connection committed."""
        try:
            changed = self._changed_in(db)
        except sqlite3.Error:
            changed = True  # cannot tell: a spurious wake-up costs one poll
        if changed:
            self._complete([], [], True)  # no operation of this process: every listener, one wake per loop

    async def unregister_worker(self, worker_id: str, *, holder: tuple[str, int] | None = None) -> None:
        self._quiet.forget(worker_id)
        await super().unregister_worker(worker_id, holder=holder)

    async def poll(
        self, worker_id: str, flow_types: Sequence[str], capacity: int, running: Sequence[int],
        *, must_claim: bool, housekeep: bool, known: Sequence[int] | None = None,
        claimed_before: int | None = None, holder: tuple[str, int] | None = None, declare_dead: bool = True,
        timer_floor: bool = True, retention_ms: int | None = None,
    ) -> tuple[bool, PollResult]:
        """Store.poll; a quiet poll of a file nobody committed to since this worker's last quiet
        poll (with the same running attempts) gets that poll's answer, read on this thread."""
        if must_claim or housekeep:
            return await super().poll(worker_id, flow_types, capacity, running, must_claim=must_claim,
                                      housekeep=housekeep, known=known, claimed_before=claimed_before,
                                      holder=holder, declare_dead=declare_dead, timer_floor=timer_floor,
                                      retention_ms=retention_ms)
        asked: _Asked = (tuple(flow_types), tuple(running))
        version, answer = self._quiet.answer(worker_id, asked)
        if answer is not None:
            return False, answer
        changed, result = await super().poll(worker_id, flow_types, capacity, running, must_claim=False,
                                             housekeep=False, known=known, claimed_before=claimed_before,
                                             holder=holder)
        # Only a light poll's answer is kept: nothing claimed, nothing changed elsewhere. `version`
        # was read before it ran, so a commit made meanwhile makes the next poll ask again.
        self._quiet.keep(worker_id, version, asked, None if changed or result.leases else result)
        return changed, result

    async def changed(self) -> bool:
        return await self._run(self._changed_in, write=False)

    def _changed_in(self, db: Db) -> bool:
        # data_version changes when another connection (process) commits to the file.
        row = db.one("PRAGMA data_version")
        version = int(row[0]) if row else 0
        changed = version != self._data_version
        self._data_version = version
        return changed

    async def close(self) -> None:
        if self._in_fork():
            # A fork's copy: the thread and connections are the parent's, which goes on using them
            # (and a thread of the parent may have held _count_lock as it forked).
            self._closed = True
            return
        with self._count_lock:
            first = not self._closed
            if first:
                self._closed = True
                self._queue.put(_STOP)
        if first:
            self._quiet.close()
        # A second close (another task's, at once) returns only once the first is done too: the
        # file's connections are closed when any close() returns, and the caller may delete it.
        await asyncio.to_thread(self._thread.join)

    def close_nowait(self) -> None:
        # Takes no lock: the collector may run this on a thread inside _enqueue (holding
        # _count_lock) or on the store's own thread; SimpleQueue.put is safe even there. The
        # thread refuses what got queued after _STOP, then closes the connections (_main).
        self._closed = True
        if not self._in_fork():
            self._queue.put(_STOP)
