"""AsyncWorker: claims attempts, runs handlers, commits results, and keeps the engine healthy."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import dataclasses
import itertools
import logging
import os
import random
import socket
import threading
import time
import traceback
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, cast

import msgspec

from . import _gates
from ._clock import WallClockSteps
from ._codec import decode_value, encode_value
from ._context import Context, EventFn, FoldContext, HeartbeatFn, NotFoldable, WaitResult
from ._decision import StepDecision
from ._errors import (
    DatabaseFileReplacedError,
    InvalidIdError,
    InvalidValueError,
    NoRetryError,
    StaleAttemptError,
    UndeclaredNameError,
    WorkerIdInUseError,
    WorkerInvocationError,
    shown,
)
from ._flow import Flow, Registry
from ._ids import check_id
from ._limits import (
    CLOCK_SKEW_WARN_MS,
    CLOCK_STEP_SECONDS,
    DEFAULT_HOUSEKEEPING_SECONDS,
    DEFAULT_LEASE_RENEW_SECONDS,
    DEFAULT_LEASE_TTL_SECONDS,
    DEFAULT_MAX_CONCURRENT_TASKS,
    DEFAULT_POLL_SECONDS,
    DEFAULT_SHUTDOWN_GRACE_SECONDS,
    FAILURE_LOG_SECONDS,
    LATE_ATTEMPTS_NAMED,
    MAX_CONCURRENT_TASKS,
    MAX_ERROR_TEXT_CHARS,
    MAX_OPTION_SECONDS,
    MAX_RETENTION_SECONDS,
    MAX_WORKER_ERROR_ENTRIES,
    MAX_WORKER_ERRORS_PER_ATTEMPT,
    POLL_RETRY_MAX_SECONDS,
    RENEW_RETRY_SECONDS,
    RETENTION_BACKLOG_HOUSEKEEPING_SECONDS,
    TIMER_BURST_HOUSEKEEPING_SECONDS,
    WORKER_ERROR_STALE_SECONDS,
)
from ._open import open_store, shown_url, shown_url_value
from ._options import is_number
from ._parked import FoldFunctions, ParkedHandler
from ._records import DecisionRecord, ErrorInfo, HousekeepingReport, Lease, MovementRecord, StartedFold, WriteSet
from ._retry import AskedDelay, asked_delay
from ._scheduling import movement_record
from ._schema import ChannelRef
from ._store import LOST_CLAIM_MS, Store, commit_origin, stop_retrying
from ._wait import ChannelCondition, Wait, WaitSpec

log = logging.getLogger("dex_engine.worker")


@dataclass(frozen=True)
class WorkerOptions:
    """How a worker connects and paces itself. Defaults suit production; tests shorten the timings.

    A worker that stops renewing is declared dead after `lease_ttl_seconds`; its started attempts
    fail and its unstarted ones are handed out again, so takeover takes at most about
    lease_ttl + housekeeping seconds.

    With `closed_flow_retention_seconds`, housekeeping deletes flows closed (completed, failed or
    stopped) longer ago than that, as delete_flow does, a few at a time (CLOSED_FLOWS_DELETED_PER_HOUSEKEEPING
    per pass); None keeps them for ever. Any one worker with it set deletes them for the whole database.
    """

    database_url: str = "sqlite:///dex.db"
    max_concurrent_tasks: int = DEFAULT_MAX_CONCURRENT_TASKS
    lease_ttl_seconds: float = DEFAULT_LEASE_TTL_SECONDS
    lease_renew_seconds: float = DEFAULT_LEASE_RENEW_SECONDS
    housekeeping_seconds: float = DEFAULT_HOUSEKEEPING_SECONDS
    poll_seconds: float = DEFAULT_POLL_SECONDS
    shutdown_grace_seconds: float = DEFAULT_SHUTDOWN_GRACE_SECONDS
    worker_id: str | None = None
    closed_flow_retention_seconds: float | None = None

    def __post_init__(self) -> None:
        problems = []
        url: object = self.database_url  # typed str; checked for callers that pass anything
        if not isinstance(url, str):
            problems.append(f"database_url must be a str, got {type(url).__name__}: {shown_url_value(url)}; "
                            "pass its text, such as str(url) for a URL object")
        tasks = self.max_concurrent_tasks
        if isinstance(tasks, bool) or not isinstance(tasks, int) or not 1 <= tasks <= MAX_CONCURRENT_TASKS:
            problems.append(
                f"max_concurrent_tasks must be a whole number from 1 to {MAX_CONCURRENT_TASKS}, "
                f"got {shown(tasks, None)}")
        seconds = ("lease_ttl_seconds", "lease_renew_seconds", "housekeeping_seconds", "poll_seconds",
                   "shutdown_grace_seconds")
        bad = [name for name in seconds if not _seconds(getattr(self, name))]
        for name in bad:
            problems.append(
                f"{name} must be a number of seconds > 0 and at most {MAX_OPTION_SECONDS}, "
                f"got {shown(getattr(self, name), None)}")
        if not {"lease_ttl_seconds", "lease_renew_seconds"} & set(bad) and not (
                self.lease_renew_seconds < self.lease_ttl_seconds):
            problems.append(
                f"lease_renew_seconds ({self.lease_renew_seconds}) must be below "
                f"lease_ttl_seconds ({self.lease_ttl_seconds}), or leases expire between renewals"
            )
        retention = self.closed_flow_retention_seconds
        if retention is not None and not (is_number(retention) and 0 < retention <= MAX_RETENTION_SECONDS):
            problems.append(
                f"closed_flow_retention_seconds must be None (keep closed flows for ever) or a number of seconds "
                f"> 0 and at most {MAX_RETENTION_SECONDS}, got {shown(retention, None)}")
        if self.worker_id is not None and self.worker_id != "":  # none or empty: one is made up
            try:
                check_id("worker ID", self.worker_id)
            except InvalidIdError as exc:
                problems.append(str(exc))
        if problems:
            raise ValueError("invalid WorkerOptions: " + "; ".join(problems))

    def __repr__(self) -> str:
        # The dataclass's own repr would show the URL's password wherever options are logged or printed.
        fields = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                           if f.name != "database_url")
        return f"WorkerOptions(database_url={shown_url(self.database_url)!r}, {fields})"


def _seconds(value: object) -> bool:
    """A usable WorkerOptions duration: a real number (not a bool), > 0, at most MAX_OPTION_SECONDS."""
    return is_number(value) and 0 < value <= MAX_OPTION_SECONDS


# IDs of the workers running in this process (any thread, any event loop): a second worker under one
# of them shares its host and PID, so the database's check (register_worker) cannot tell it apart.
_ids_running_here: set[str] = set()
_ids_in_use_here = threading.Lock()


class _FailureStreak:
    """Failures in a row of one action a worker repeats (`what`: a poll, a lease renewal), logged
    with the traceback at the first, then once per FAILURE_LOG_SECONDS, and once it works again."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.count = 0
        self._said_at = 0.0  # time.monotonic() of the last line logged

    def failed(self, exc: Exception) -> int:
        """Count a failure (call it while handling `exc`); returns the failures in a row."""
        self.count += 1
        now = time.monotonic()
        if self.count == 1:
            log.exception("%s failed; will retry", self.what)
            self._said_at = now
        elif now - self._said_at >= FAILURE_LOG_SECONDS:
            log.error("%s failed %d times in a row; the last: %s: %s", self.what, self.count, type(exc).__name__, exc)
            self._said_at = now
        return self.count

    def succeeded(self) -> None:
        if self.count:
            log.warning("%s works again after %d failures in a row", self.what, self.count)
            self.count = 0


class _Running:
    """One attempt in flight on this worker."""

    def __init__(self, lease: Lease) -> None:
        self.lease = lease
        self.task: asyncio.Task[None] | None = None
        self.revoked = False  # the engine took the task away; discard whatever the handler returns
        # Set while the result is being committed: cancelling then could lose what the commit claimed.
        self.committing = False
        self.claimed_next = False  # the commit already claimed work for the freed slot
        self.events: list[tuple[str, int, bytes]] = []
        self.events_lock = threading.Lock()
        self.events_closed = False
        self.flush_task: asyncio.Task[None] | None = None
        self.entered = False  # its task began _run_attempt (a task cancelled before that never does)


class AsyncWorker:
    """Runs the Steps of the Registry's Flows from one database.

    `await worker.run()` until `await worker.stop()`; or `async with worker:` to run it in the
    background of the block, which it enters once the worker is registered (listed as live).
    """

    def __init__(self, registry: Registry, options: WorkerOptions | None = None, *, store: Store | None = None) -> None:
        given: tuple[object, object] = (registry, options)  # typed; checked for callers that pass anything
        if not isinstance(given[0], Registry):
            raise TypeError(f"AsyncWorker takes a Registry of Flows, got {type(registry).__name__}: "
                            f"{shown(registry, 200)}; wrap the Flows: Registry([flow, ...])")
        if given[1] is not None and not isinstance(given[1], WorkerOptions):
            raise TypeError(f"AsyncWorker's options must be WorkerOptions, got {type(options).__name__}: "
                            f"{shown(options, 200)}; write WorkerOptions(database_url=..., ...)")
        self.registry = registry
        self.options = options or WorkerOptions()
        self._store = store
        self._owns_store = store is None
        self.worker_id = self.options.worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        # The process that holds the worker's row (register_worker): renewals and the removal at
        # stop touch only a row it holds, never one another process took the ID over with.
        self._holder = (socket.gethostname(), os.getpid())
        self._flow_types = sorted(registry.flows)
        retention = self.options.closed_flow_retention_seconds
        self._retention_ms = None if retention is None else int(retention * 1000)
        self._running: dict[int, _Running] = {}
        self._wake = asyncio.Event()
        self._claim_asked = False  # a wake-up came: the loop claims (a timeout alone does not)
        # The last poll found work due while every slot was taken: the next Execute commit that
        # starts Steps claims nothing (they go in ready) and the loop then claims by age, so the
        # slot it frees goes to the oldest ready Step, not on to the same chain of Steps for as
        # long as the chain goes on.
        self._due_while_full = False
        self._stopping = asyncio.Event()
        self._stop_asked_at: float | None = None  # time.monotonic() of the first stop()
        # Why the worker stopped by itself (its database file was replaced under it): run() raises it.
        self._fatal: DatabaseFileReplacedError | None = None
        self._stopped = asyncio.Event()
        self._registered = asyncio.Event()
        # Declared dead (a poll found no row of ours): claim nothing until the renewer registers again.
        self._unregistered = False
        self._id_held_elsewhere = False  # registering again found our ID another live process's (logged once)
        self._renew_now = asyncio.Event()
        # The wall clock stepped (see _watch_clock): until this monotonic time, declare no worker dead.
        self._clock = WallClockSteps()
        self._trust_leases_at = 0.0
        # Forward steps not yet taken out of our attempts' deadlines (ms, claimed by): see _watch_clock.
        self._deadline_shifts: list[tuple[int, int]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._background: asyncio.Task[None] | None = None
        # Starts (wall-clock ms) of commits in flight that may claim work: until a commit's reply is
        # in, the attempts it claimed are in no poll's `known` and must not be taken for lost claims.
        self._claiming: list[int] = []
        # The store calls our commit listener on other processes' commits (watch_foreign_commits):
        # the loop then sleeps until something is due instead of polling.
        self._watched = False
        # This worker's context (its commit origin): attempts that clients' commits claimed for it
        # run in a copy, not in the client's context, so their commits do not wake it.
        self._own_context: contextvars.Context | None = None
        self._drained = False  # set once stopping has waited out its grace: nothing more runs here
        # Set when a run gets as far as registering: its stop is final (the stopping flag stays set,
        # an owned store is closed), so a second run would claim nothing and leave sessions waiting.
        self._ran = False
        self._loop_thread: int | None = None  # the event loop's thread, where pure Executes may fold
        # Hand-backs of claims beyond max_concurrent_tasks still being committed (_spawn).
        self._handing_back: set[asyncio.Task[None]] = set()
        # Task ID -> (attempt, worker-side errors so far in ending it, monotonic time of the last),
        # for attempts this worker handed back: at MAX_WORKER_ERRORS_PER_ATTEMPT it fails the
        # attempt instead. In the order they were last counted (each count re-inserts its entry).
        self._worker_errors: dict[int, tuple[int, int, float]] = {}
        # (flow type, Step type, method) of ready Steps this worker's Registry cannot run, met once
        # each (_runs_here): said, and left out of its claims from then on (Store.set_declined). As
        # few as the Step types other versions of its Flows declare.
        self._declined: set[tuple[str, str, str]] = set()

    @property
    def store(self) -> Store:
        if self._store is None:
            raise RuntimeError("the worker has not started")
        return self._store

    def _check_first_run(self) -> None:
        if self._ran:
            raise RuntimeError(
                f"worker {self.worker_id!r} has already run, and a worker runs once; to run again, make a new "
                "AsyncWorker(registry, options)"
            )

    async def __aenter__(self) -> AsyncWorker:
        self._check_first_run()
        background = self._background = asyncio.create_task(self.run())
        registered = asyncio.create_task(self._registered.wait())
        try:
            await asyncio.wait({background, registered}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            background.cancel()  # no __aexit__ follows a failed __aenter__: leave nothing running
            raise
        finally:
            registered.cancel()
        if background.done():
            background.result()  # the worker could not start: its error (a bad database URL, say)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def stop(self) -> None:
        if not self._stopping.is_set():
            self._stop_asked_at = time.monotonic()  # the grace starts now, whatever is in flight
        self._stopping.set()
        self._notify()
        if self._background is not None:
            await self._background
        else:
            await self._stopped.wait()

    def _give_up(self, exc: DatabaseFileReplacedError) -> None:
        """Stop for good: retrying could never succeed, and a worker that went on running (its
        process alive, its errors only logged) would leave the flows of the new file at its path
        to nobody, where a supervisor restarts a process that exits."""
        if self._fatal is None:
            self._fatal = exc
            log.error("worker %s stops: %s", self.worker_id, exc)
        if not self._stopping.is_set():
            # Nothing its running attempts do can be stored: they are revoked at once, not after the grace.
            self._stop_asked_at = time.monotonic() - self.options.shutdown_grace_seconds
        self._stopping.set()
        self._notify()

    def _notify(self) -> None:
        """Wake the loop to claim (and poll); also the commit listener and commit origin."""
        self._claim_asked = True
        self._wake.set()

    async def run(self) -> None:
        self._check_first_run()
        self._loop = asyncio.get_running_loop()
        with _ids_in_use_here:
            if self.worker_id in _ids_running_here:
                raise WorkerIdInUseError(
                    f"worker ID {self.worker_id!r} is held by another worker running in this process; give "
                    "each worker its own ID (or none: one is made up)"
                )
            _ids_running_here.add(self.worker_id)
        try:
            await self._run()
        finally:
            with _ids_in_use_here:
                _ids_running_here.discard(self.worker_id)

    async def _run(self) -> None:
        self._stopped.clear()  # set by an earlier run that could not open the store
        if self._store is None:
            try:
                opened = await self._open_store()
            except BaseException:
                # As when registering fails below: a stop() after it (a SIGTERM handler's) returns,
                # where it waited for ever for a stop of a run that had ended.
                self._stopped.set()
                raise
            if opened is None:
                self._ran = True
                self._stopped.set()
                return  # stopped while the store opened
            self._store = opened
        store = self._store
        store.add_commit_listener(self._notify)
        store.add_local_claimer(self)
        self._watched = store.watch_foreign_commits(self.options.poll_seconds)
        commit_origin.set(self._notify)  # inherited by every task this worker starts
        self._own_context = contextvars.copy_context()
        self._loop_thread = threading.get_ident()
        ttl_ms = int(self.options.lease_ttl_seconds * 1000)
        self._ran = True
        try:
            await store.register_worker(self.worker_id, *self._holder, ttl_ms)
        except BaseException:  # its ID is in use, or the database refuses: leave nothing behind
            store.remove_local_claimer(self)
            store.remove_commit_listener(self._notify)
            if self._owns_store:
                await store.close()
            self._stopped.set()
            raise
        self._registered.set()
        log.info("worker %s runs the Steps of flow types %s from %s", self.worker_id,
                 ", ".join(self._flow_types), self._database_shown())
        # The worker's own operations (not its attempts', whose context was taken above) stop trying
        # again after a lost connection once it is stopping: its poll in flight must not hold up
        # the drain, nor its removal the end of the stop (left, its row expires as a dead worker's).
        retrying = stop_retrying.set(self._stopping.is_set)
        renewer = asyncio.create_task(self._renew_loop(ttl_ms))
        try:
            await self._check_clock(store)
            await self._main_loop()
        finally:
            store.remove_local_claimer(self)
            try:
                await self._drain()
            finally:
                # Renewed until the drain ends: attempts still running outlast a lease left to lapse,
                # and another worker's housekeeping would fail them as lost and run them again.
                renewer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await renewer
            store.remove_commit_listener(self._notify)
            store.set_declined(self.worker_id, ())
            with contextlib.suppress(Exception):
                await store.unregister_worker(self.worker_id, holder=self._holder)
            stop_retrying.reset(retrying)
            if self._owns_store:
                await store.close()
            self._stopped.set()
        if self._fatal is not None:
            raise self._fatal

    async def _open_store(self) -> Store | None:
        """The store of options.database_url, opened on a thread of its own; None if stop() came
        first, and then the store, once made, is closed. On PostgreSQL the open connects and
        migrates: against a server that does not answer it waits out the connect timeout (10 s an
        address), which on the event loop held up everything the loop runs, the SIGTERM handler
        that would stop the worker among them."""
        opening: concurrent.futures.Future[Store] = concurrent.futures.Future()
        url = self.options.database_url

        def open_it() -> None:
            # Running from here: a stop now no longer cancels it, and the store it makes is closed.
            if not opening.set_running_or_notify_cancel():
                return  # stopped before the open began
            try:
                opening.set_result(open_store(url))
            except BaseException as exc:  # handed to the worker, which raises it
                opening.set_exception(exc)

        # A daemon thread, not asyncio.to_thread: asyncio.run waits for its executor's threads as it
        # ends, so a stopped worker's process would still wait out the open.
        threading.Thread(target=open_it, name="dex-worker-open", daemon=True).start()
        opened = asyncio.wrap_future(opening)
        stopping = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait((opened, stopping), return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
            if not opened.done():  # stopped, or run() cancelled
                opened.cancel()  # the open too, if it has not begun; once begun it cannot be interrupted
                opening.add_done_callback(_close_opened)
        return opened.result() if not opened.cancelled() else None

    def _database_shown(self) -> str:
        """Where this worker runs Steps from, for its start log. A session nobody runs is most often
        on another database than its client's (a relative SQLite path names a file in the working
        directory; WorkerOptions defaults to sqlite:///dex.db) or of a flow type left out of the
        Registry: the log names both."""
        # A store given to the worker wins over options.database_url; one of its own making may have no URL.
        url: object = getattr(self.store, "url", None)
        if not isinstance(url, str):
            return f"a {type(self.store).__name__}"
        if url.startswith("sqlite:"):
            from ._sqlite_store import parse_sqlite_url

            return f"{shown_url(url)} (file {os.path.abspath(parse_sqlite_url(url).path)})"
        return shown_url(url)

    async def _check_clock(self, store: Store) -> None:
        """Warn when this host's clock is far from the database server's (see CLOCK_SKEW_WARN_MS)."""
        try:
            skew = await store.clock_skew_ms()
        except Exception:
            log.warning("could not compare this host's clock with the database server's", exc_info=True)
            return
        if skew is not None and abs(skew) > CLOCK_SKEW_WARN_MS:
            log.warning(
                "worker %s: this host's clock is %.1f s %s the database server's; leases, deadlines and timers "
                "are times each host's own clock writes and reads, so hosts running ahead declare others' "
                "workers dead early and fire timers early: keep every host's clock synchronized (NTP)",
                self.worker_id, abs(skew) / 1000, "behind" if skew > 0 else "ahead of")

    async def _main_loop(self) -> None:
        store = self.store
        opts = self.options
        next_housekeeping = 0.0
        next_timer_floor = 0.0  # when a housekeeping pass next fires timers however many tasks are ready
        must_claim = True
        polls = _FailureStreak(f"worker {self.worker_id}: poll")  # several may share a process's log
        while not self._stopping.is_set():
            housekeep = time.monotonic() >= next_housekeeping
            timer_floor = housekeep and time.monotonic() >= next_timer_floor
            # Unregistered (declared dead, or its ID another process's), it claims nothing, not even
            # work another connection's commit made ready, which a poll otherwise claims unasked.
            free = 0 if self._unregistered else opts.max_concurrent_tasks - len(self._running)
            claim = must_claim and free > 0
            # By attempt, not task: a reply that comes back after a watched attempt ended must not
            # revoke the task's next attempt, handed to this worker meanwhile (a retry, same task).
            watched = {tid: r for tid, r in self._running.items() if not r.committing}
            self._wake.clear()
            self._claim_asked = False
            self._watch_clock()
            try:
                _changed, result = await store.poll(
                    self.worker_id, self._flow_types, free, list(watched), must_claim=claim, housekeep=housekeep,
                    known=list(self._running), claimed_before=self._claimed_before(), holder=self._holder,
                    declare_dead=time.monotonic() >= self._trust_leases_at, timer_floor=timer_floor,
                    retention_ms=self._retention_ms,
                )
            except Exception as exc:
                if self._stopping.is_set():
                    break  # given up (stop_retrying), or failed anyway: nothing to retry for
                if isinstance(exc, DatabaseFileReplacedError):
                    self._give_up(exc)
                    break
                failed = polls.failed(exc)
                pause = max(opts.poll_seconds, min(opts.poll_seconds * 2 ** (failed - 1), POLL_RETRY_MAX_SECONDS))
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(pause):  # stop() does not wait out the pause
                        await self._stopping.wait()
                continue
            polls.succeeded()
            self._due_while_full = (free <= 0 and result.next_due_ms is not None
                                    and result.next_due_ms <= time.time() * 1000)
            if housekeep:
                if _gates.ACTIVE:
                    _gates.gate(_gates.HOUSEKEEPING)
                next_housekeeping = time.monotonic() + opts.housekeeping_seconds * (0.75 + random.random() / 2)
                if timer_floor:
                    next_timer_floor = next_housekeeping
                report = result.housekeeping
                if report is not None and (report.leases_expired or report.timeouts):
                    self._said_taken_over(report)
                if report is not None and report.flows_deleted:
                    log.info("worker %s deleted %d flows closed over %s s ago (closed_flow_retention_seconds)",
                             self.worker_id, report.flows_deleted, opts.closed_flow_retention_seconds)
                if report is not None and (report.timers_left or report.flows_left):
                    # A burst of due timers (fired a part at a time as the ready queue drains) or a
                    # retention backlog (deleted a part at a time): look again soon, not a whole
                    # interval on.
                    again = (TIMER_BURST_HOUSEKEEPING_SECONDS if report.timers_left
                             else RETENTION_BACKLOG_HOUSEKEEPING_SECONDS)
                    next_housekeeping = min(next_housekeeping, time.monotonic() + again)
            must_claim = False
            if not result.registered:
                self._unregistered = True
                self._renew_now.set()  # register again now, not at the next renewal
            for lease in result.leases:
                self._spawn(lease)
            self._revoke_changed(watched, result.epochs)
            # On a watched store every commit that could concern this worker wakes it (its own and
            # this process's clients' through the commit listeners, others' through the store's
            # watch), including one that revokes a running attempt: only due work and housekeeping
            # need a timeout, and a worker running long attempts (model calls) stays asleep. A
            # claim still in flight may lose its reply, which only polls find (_claimed_before).
            sleepy = self._watched and not self._claiming
            timeout = max(0.0, next_housekeeping - time.monotonic()) if sleepy else opts.poll_seconds
            if result.next_due_ms is not None:
                until_due = result.next_due_ms / 1000 - time.time()
                if until_due > 0:
                    timeout = min(timeout, until_due)
                elif housekeep and self._freed_meanwhile(free, len(result.leases)):
                    # Slots freed while the poll ran, by commits that claimed into them before its
                    # housekeeping made this work ready (they do not wake the loop): claim it now.
                    must_claim = True
                    continue
                elif not ((claim or free <= 0) and housekeep):
                    # Something is due (a retry, a timer, a deadline, a lease) and this poll did not
                    # both claim (when a slot was free) and housekeep: do both now. When it did and
                    # the item is still due (a lock-blocked Step, ready work with every slot taken),
                    # wait as usual instead of spinning: the commit that frees the lock or the slot
                    # wakes the loop.
                    must_claim = True
                    next_housekeeping = time.monotonic()
                    continue
            try:
                # asyncio.timeout, not wait_for: no task per wait (one per poll interval and wake-up).
                async with asyncio.timeout(timeout):
                    await self._wake.wait()
                must_claim = self._claim_asked
            except TimeoutError:
                # A wake that lands as the timeout fires is lost by the wait but stays asked: keep it.
                must_claim = self._claim_asked

    def _said_taken_over(self, report: HousekeepingReport) -> None:
        """Warn of the attempts a housekeeping pass took back from workers that died (or lost
        their lease) or failed past their deadline, naming their flows: without it, a worker's
        crash and its sessions' retries left no line in any surviving worker's log."""
        count = report.leases_expired + report.timeouts
        more = count - len(report.attempts_named)
        log.warning("worker %s: housekeeping took back %d attempts of workers that died or lost their lease "
                    "(%d declared dead now; a started attempt fails as WorkerLost through its retry policy, "
                    "others run again) and failed %d attempts past their deadline (HeartbeatTimeout, "
                    "MethodTimeout): %s%s", self.worker_id, report.leases_expired, report.workers_removed,
                    report.timeouts, ", ".join(report.attempts_named), f" and {more} more" if more > 0 else "")

    def _freed_meanwhile(self, asked: int, claimed: int) -> bool:
        """Whether more slots are free now than a poll sent for `asked` free slots, which claimed
        `claimed`, left unfilled: attempts ended while it ran, and their commits claimed into their
        slots before the poll's housekeeping made work ready."""
        free = 0 if self._unregistered else self.options.max_concurrent_tasks - len(self._running)
        return free > max(asked, 0) - claimed

    def _watch_clock(self) -> None:
        """After a step of the wall clock, declare no worker dead and fail no attempt past its
        deadline for one lease TTL, and move this worker's attempts' deadlines by a forward step.

        Forward, every lease written before it looks expired, this worker's own too; renewing its
        own first (the housekeeping guard sees only that one) would let it remove live peers whose
        renewals have not caught up yet, and their started Steps would run again. Within a TTL
        every live worker has renewed, and moved its attempts' heartbeat and method deadlines
        (durations the step did not take) as far forward: those claimed by the wall time less the
        step are the ones claimed before it. Back, a worker that died just before takes that much
        longer to be taken over: said, since nothing here can shorten a lease another process wrote."""
        stepped = self._clock.step()
        if abs(stepped) <= CLOCK_STEP_SECONDS:
            return
        if stepped > 0:
            self._trust_leases_at = time.monotonic() + self.options.lease_ttl_seconds
            shift_ms = int(stepped * 1000)
            self._deadline_shifts.append((shift_ms, int(time.time() * 1000) - shift_ms))
            self._renew_now.set()
            log.warning("worker %s: the wall clock stepped %.1f s forward; it declares no worker dead for the "
                        "next %.0f s (lease_ttl_seconds), while the others renew their leases, and moves its "
                        "running attempts' deadlines as far", self.worker_id, stepped, self.options.lease_ttl_seconds)
        else:
            log.warning("worker %s: the wall clock stepped %.1f s back; a worker that died just before is taken "
                        "over that much later", self.worker_id, -stepped)

    def _claimed_before(self) -> int:
        """Time (ms) before which a claim of ours that we do not hold counts as lost.

        LOST_CLAIM_MS before now, or before the oldest commit in flight: a commit that waited long
        on locks returns claims already that old, which the poll would otherwise hand back while
        they run. Taken before the poll is sent, never inside it: the poll may run long after,
        when commits made meanwhile have handed us claims its `known` list cannot name.
        """
        return min([int(time.time() * 1000), *self._claiming]) - LOST_CLAIM_MS

    # Steps made ready by clients' commits in this process (Store.LocalClaimer) -----------

    def local_claim(self) -> tuple[str, tuple[str, int], list[str], int, int] | None:
        if self._stopping.is_set() or self._unregistered or asyncio.get_running_loop() is not self._loop:
            return None  # a client on another event loop: its commit wakes us as usual
        free = self.options.max_concurrent_tasks - len(self._running)
        if free <= 0:
            return None
        # In flight like a commit's claims: no poll may take these for lost claims before they land.
        started = int(time.time() * 1000)
        self._claiming.append(started)
        return self.worker_id, self._holder, self._flow_types, free, started

    def local_claim_done(self, token: int, leases: list[Lease] | None, capacity: int) -> None:
        self._claiming.remove(token)
        for lease in leases or ():
            assert self._own_context is not None
            self._spawn(lease, self._own_context.copy())
        if leases is None or len(leases) >= capacity or self._stopping.is_set():
            # It claimed nothing (or failed), or more may be ready than it took; or, draining, it
            # was the last claim in flight that _drain waits for.
            self._notify()

    def local_origin(self) -> Callable[[], None]:
        return self._notify

    def _spawn(self, lease: Lease, context: contextvars.Context | None = None) -> None:
        """Run `lease`'s attempt in a task of its own, in `context` or a fresh copy of the worker's
        context variables: never the committing handler's, which a folded attempt never sees either."""
        if context is None:
            assert self._own_context is not None
            context = self._own_context.copy()
        if lease.started is not None:
            if self._drained:
                # Too late to run: unregistering fails it as this worker's lost attempt (E3).
                lease.started.close()
                return
            context = cast(ParkedHandler, lease.started.resume).variables
        elif self._stopping.is_set():
            # Draining: never started here, so give it back now (same attempt, E3) for another worker
            # to take at once; held until this worker unregisters, it would wait for the longest
            # running attempt, up to the whole grace. Once drained, unregistering hands it back.
            if not self._drained:
                self._hand_back_later(lease, context)
            return
        previous = self._running.get(lease.task_id)
        if previous is not None and previous.lease.lease_epoch >= lease.lease_epoch:
            # A reply that came late (a poll's, a commit's): this worker already runs the task's
            # newer attempt, handed over meanwhile. The older claim was taken back; E2 fences it.
            if lease.started is not None:
                with contextlib.suppress(Exception):
                    lease.started.close()
            return
        if previous is not None:
            # The task was handed out again (e.g. a timed-out attempt's retry): the older attempt
            # here has lost it and must not keep running.
            self._revoke(previous)
        elif len(self._running) >= self.options.max_concurrent_tasks and lease.started is None:
            # Claims in flight at once (a poll, commits, clients' hand-offs) each took up to the
            # slots free when they started, so together they may hold more than there are. An
            # attempt whose commit recorded its first heartbeat has started: it runs regardless.
            self._hand_back_later(lease, context)
            return
        if lease.started is None and not self._runs_here(lease):
            # Another version's Step (a rolling deploy added it): failing it would fail work a
            # worker that declares it runs. Back unstarted, same attempt (E3), for one to claim at
            # once: this worker claims no such Step again, so it cannot keep winning it from that one.
            self._hand_back_later(lease, context)
            return
        running = _Running(lease)
        self._running[lease.task_id] = running
        running.task = asyncio.create_task(self._run_attempt(running), name=lease.step_execution_id,
                                           context=context)
        running.task.add_done_callback(partial(self._never_ran, running))

    def _never_ran(self, running: _Running, _task: asyncio.Task[None]) -> None:
        """A task cancelled (revoked) before its first step never enters _run_attempt, whose end
        would free its slot and drop its parked handler: end it here instead."""
        if not running.entered:
            if running.lease.started is not None:
                with contextlib.suppress(Exception):
                    running.lease.started.close()  # in its own variables, which this callback is not
            self._end_attempt(running)

    def _hand_back_later(self, lease: Lease, context: contextvars.Context) -> None:
        """Hand `lease` back (_hand_back) in a task of its own, which a drain waits for."""
        task = asyncio.create_task(self._hand_back(lease), name=f"hand back {lease.step_execution_id}",
                                   context=context)
        self._handing_back.add(task)
        task.add_done_callback(self._handing_back.discard)

    async def _hand_back(self, lease: Lease) -> None:
        """Give back a claim this worker has no slot for, or cannot run: unstarted, same attempt
        (E3), for any worker to claim."""
        try:
            await self.store.release_unstarted(lease)
        except StaleAttemptError:
            return  # taken over meanwhile
        except Exception:
            log.exception("flow %s: could not hand back %s attempt %d; housekeeping hands it back as a lost claim",
                          lease.flow_id, lease.step_execution_id, lease.attempt)
            return
        # A slot may have freed meanwhile, or this claim's slot is free: claim (by age).
        self._notify()

    def _runs_here(self, lease: Lease) -> bool:
        """Whether this worker's Registry declares `lease`'s Step, and its WaitFor for a wait_for
        attempt; if not, leave that Step and method out of its claims and say so once, with what to do."""
        flow = self.registry.flows.get(lease.flow_type)
        step = None if flow is None else flow.steps.get(lease.step_type)
        if step is not None and (lease.method == "execute" or step.wait_for is not None):
            return True
        lacked = (lease.flow_type, lease.step_type, lease.method)
        if lacked not in self._declined:
            self._declined.add(lacked)
            self.store.set_declined(self.worker_id, self._declined)
            missing = (f"Step {lease.step_type!r}" if step is None
                       else f"a WaitFor for Step {lease.step_type!r}")
            log.warning("worker %s: its Registry declares no %s in flow type %r (stored by another version "
                        "of the Flow?): such Steps wait, ready, and are not failed; start a worker whose "
                        "Registry declares it (this one leaves them to such a worker)", self.worker_id,
                        missing, lease.flow_type)
        return False

    def _forget(self, running: _Running) -> None:
        if self._running.get(running.lease.task_id) is running:
            del self._running[running.lease.task_id]

    def _revoke(self, running: _Running) -> None:
        running.revoked = True
        with running.events_lock:
            running.events_closed = True
            running.events.clear()
        if running.task is not None and not running.committing:
            running.task.cancel()

    async def _renew_loop(self, ttl_ms: int) -> None:
        renewals = _FailureStreak(f"worker {self.worker_id}: lease renewal")
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.options.lease_renew_seconds):
                    await self._renew_now.wait()
            self._renew_now.clear()
            # Here too, not only before each poll: a worker asleep between polls (a watched store,
            # long attempts) must still move its deadlines before the others' TTL of trust ends.
            self._watch_clock()
            try:
                if not await self.store.renew_worker(self.worker_id, ttl_ms, holder=self._holder):
                    # Declared dead while we were paused or cut off: every attempt we hold is gone.
                    self._unregistered = True
                    if not self._id_held_elsewhere:  # said already, with the reason
                        log.warning("worker %s was declared dead; abandoning %d attempts%s", self.worker_id,
                                    len(self._running), _attempts_named(self._running.values()))
                    for running in list(self._running.values()):
                        self._revoke(running)
                    await self.store.register_worker(self.worker_id, *self._holder, ttl_ms)
                if self._unregistered:
                    self._unregistered = self._id_held_elsewhere = False
                    self._deadline_shifts.clear()  # the attempts they were for are gone
                    self._notify()  # claims were held back meanwhile
                while self._deadline_shifts:
                    await self.store.shift_deadlines(self.worker_id, *self._deadline_shifts[0])
                    del self._deadline_shifts[0]  # once done: a failure leaves it for the next try
                renewals.succeeded()
            except WorkerIdInUseError as exc:
                # Another live process took our ID over while we were paused: claim nothing, and try
                # again at the renewal pace (its lease may run out), saying so once, not every second.
                if not self._id_held_elsewhere:
                    self._id_held_elsewhere = True
                    log.error("worker %s claims nothing until its ID is free again: %s", self.worker_id, exc)
                await asyncio.sleep(self.options.lease_renew_seconds)
                self._renew_now.set()
            except DatabaseFileReplacedError as exc:
                self._give_up(exc)
                return
            except Exception as exc:
                # Renewing, or registering again, failed (the database is down?): try again after
                # this pause, and at that pace until it succeeds, whether or not a poll asks for it
                # meanwhile. A worker declared dead claims nothing until then, so nothing it starts
                # is failed as lost.
                renewals.failed(exc)
                await asyncio.sleep(min(RENEW_RETRY_SECONDS, self.options.lease_renew_seconds))
                self._renew_now.set()

    async def _drain(self) -> None:
        """Let what runs finish, for up to shutdown_grace_seconds, then revoke the rest.

        That includes attempts handed to this worker meanwhile: a commit in flight when stop()
        came (a client's, or one of these attempts') may return an attempt that has started,
        whose first heartbeat it recorded (Step.pure_until_heartbeat). It runs like the others; if
        the worker unregistered first, that would fail it as lost while its handler still ran.
        """
        # From the stop: a poll in flight then (one waiting out a database outage, say) may have
        # ended the main loop late.
        deadline = (self._stop_asked_at or time.monotonic()) + self.options.shutdown_grace_seconds
        while True:
            tasks = {r.task for r in self._running.values() if r.task is not None} | self._handing_back
            remaining = deadline - time.monotonic()
            if not (tasks or self._claiming) or remaining <= 0:
                break
            # A claim in flight ends in local_claim_done or in a task above, both of which wake us,
            # as does a commit that may cancel what runs (on an unwatched store, a poll's pace).
            self._wake.clear()
            woken = asyncio.ensure_future(self._wake.wait())
            wait = remaining if self._watched else min(remaining, self.options.poll_seconds)
            done, _ = await asyncio.wait({*tasks, woken}, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
            woken.cancel()
            if woken in done or not done:
                await self._revoke_cancelled(deadline)
        self._drained = True
        for task in self._handing_back:
            task.cancel()  # unregistering at the end hands these claims back too
        late = [r for r in self._running.values() if r.task is not None]
        if late:
            # Said here: otherwise the only trace is a WorkerLost in each flow's history, and the
            # attempts (a model call, a tool) run again elsewhere or, for writes, end outcome unknown.
            log.warning(
                "worker %s stops after its shutdown_grace_seconds (%s s) with %d attempts still running, now "
                "cancelled: %s; each runs again elsewhere, or, started, fails as WorkerLost through its retry "
                "policy (a write that may not repeat ends outcome unknown). To let such attempts finish, give "
                "WorkerOptions a shutdown_grace_seconds longer than they run, and the process supervisor a "
                "stop timeout longer than that", self.worker_id, self.options.shutdown_grace_seconds,
                len(late), _attempts_named(late)[2:])
        for running in late:
            self._revoke(running)
        if late or self._handing_back:
            await asyncio.wait([*(r.task for r in late if r.task is not None), *self._handing_back])

    def _revoke_changed(self, watched: dict[int, _Running], epochs: Mapping[int, int]) -> None:
        """Revoke each watched attempt whose task's epoch moved on (E9: cancelled, timed out or
        taken over), unless it ended, or its task went on to another attempt here, meanwhile."""
        for task_id, running in watched.items():
            if self._running.get(task_id) is running and epochs.get(task_id) != running.lease.lease_epoch:
                lease = running.lease
                if not running.committing:  # else its own commit, begun since the poll, ended the task
                    # INFO: a cancel (cancel_turn, stop_flow) is routine.
                    log.info("flow %s: %s attempt %d was cancelled, timed out or taken over; its handler is "
                             "cancelled", lease.flow_id, lease.step_execution_id, lease.attempt)
                self._revoke(running)

    async def _revoke_cancelled(self, deadline: float) -> None:
        """While draining (the main loop has ended): what a poll of the running attempts' epochs,
        claiming nothing, finds cancelled is revoked, so its handler stops now, not at the grace.
        The poll gives up at the drain's `deadline` (monotonic), which revokes what is left anyway."""
        watched = {tid: r for tid, r in self._running.items() if not r.committing}
        if not watched or time.monotonic() >= deadline:
            return
        try:
            async with asyncio.timeout(deadline - time.monotonic()):
                _changed, result = await self.store.poll(
                    self.worker_id, self._flow_types, 0, list(watched), must_claim=False, housekeep=False,
                    holder=self._holder,
                )
        except Exception:
            log.debug("worker %s: a poll while draining failed; the grace's end revokes what is left",
                      self.worker_id, exc_info=True)
            return
        self._revoke_changed(watched, result.epochs)

    # One attempt -------------------------------------------------------------------------

    async def _run_attempt(self, running: _Running) -> None:
        lease = running.lease
        running.entered = True
        try:
            await self._attempt(running)
        except asyncio.CancelledError:
            if not running.revoked:
                raise
        except StaleAttemptError:
            log.info("flow %s: %s attempt %d lost its task (taken over, or the flow ended); result discarded",
                     lease.flow_id, lease.step_execution_id, lease.attempt)
        except Exception as exc:
            await self._after_worker_error(lease, exc)
        else:
            if self._worker_errors:
                self._worker_errors.pop(lease.task_id, None)
        finally:
            if lease.started is not None:
                # Not resumed (revoked before it ran): drop the parked handler. This task runs in its
                # variables already, which StartedFold.close would enter again.
                cast(ParkedHandler, lease.started.resume).coroutine.close()
            self._end_attempt(running)

    async def _after_worker_error(self, lease: Lease, exc: Exception) -> None:
        """End an attempt the worker could not end itself (an error of its own, `exc`): hand it back,
        so that the next housekeeping fails it or hands it out again as it would a dead worker's;
        after MAX_WORKER_ERRORS_PER_ATTEMPT of them, fail it with a plain error, so that an error
        that recurs on each run cannot run an unstarted attempt again without end."""
        attempt, errors, _last = self._worker_errors.pop(lease.task_id, (lease.attempt, 0, 0.0))
        errors = errors + 1 if attempt == lease.attempt else 1
        try:
            if errors < MAX_WORKER_ERRORS_PER_ATTEMPT:
                log.exception("flow %s: worker error while running %s attempt %d; handing the attempt back",
                              lease.flow_id, lease.step_execution_id, lease.attempt)
                self._count_worker_error(lease, errors)
                # Left alone, the task would stay running until this worker dies.
                await self.store.abandon(lease)
                return
            log.exception("flow %s: worker error while running %s attempt %d, %d times in a row; failing the attempt",
                          lease.flow_id, lease.step_execution_id, lease.attempt, errors)
            detail = f"the worker could not end the attempt {errors} times; the last time: {type(exc).__name__}"
            await self.store.fail_attempt(lease, ErrorInfo("WorkerError", detail))
        except StaleAttemptError:
            pass
        except Exception:
            log.exception("flow %s: could not hand back or fail %s attempt %d; housekeeping hands it back as a lost "
                          "claim", lease.flow_id, lease.step_execution_id, lease.attempt)

    def _count_worker_error(self, lease: Lease, errors: int) -> None:
        """Keep `errors` as the count of `lease`'s attempt. With MAX_WORKER_ERROR_ENTRIES counted
        already, the least recently counted entry makes room if it is stale (its attempt went to
        another worker); else this one goes uncounted for now, and the counted ones, failed in
        turn, make room. Entries of attempts that went elsewhere would otherwise fill the table for
        good, and no recurring error be counted again."""
        entries, now = self._worker_errors, time.monotonic()
        if len(entries) >= MAX_WORKER_ERROR_ENTRIES:
            oldest = next(iter(entries))
            if now - entries[oldest][2] < WORKER_ERROR_STALE_SECONDS:
                return
            del entries[oldest]
        entries[lease.task_id] = (lease.attempt, errors, now)

    def _end_attempt(self, running: _Running) -> None:
        """Free the attempt's slot and close its events; its parked handler, if any, is closed."""
        with running.events_lock:
            running.events_closed = True
        if running.flush_task is not None:
            running.flush_task.cancel()
        self._forget(running)
        if not running.claimed_next:
            self._notify()  # a slot is free and nothing was claimed into it yet

    async def _attempt(self, running: _Running) -> None:
        lease = running.lease
        if _gates.ACTIVE and lease.started is None:  # a resumed handler passed this point in the commit
            _gates.gate(_gates.CLAIMED)
        try:
            ctx, call = self._handler_call(running)
        except Exception as exc:  # the handler is missing or takes other input: it cannot be called
            invocation = _error_info(exc)
            detail = str(WorkerInvocationError(invocation.error_type, invocation.detail))
            await self._fail(running, ErrorInfo("WorkerInvocationError", detail), False, exc)
            return
        timeout: asyncio.Timeout | None = None
        try:
            timeout_ms = (lease.options.wait_for if lease.method == "wait_for" and lease.options.wait_for
                          else lease.options.execute).timeout_ms
            if timeout_ms is None:
                result: Any = await call
            else:
                async with asyncio.timeout(timeout_ms / 1000) as timeout:
                    result = await call
        except asyncio.CancelledError as exc:
            if _cancel_requested():
                raise  # revoked, or the worker is stopping
            # The handler raised it without being cancelled (it awaited a future something else
            # cancelled): a failure like any other, retried by its policy. Let through, the attempt
            # would end with its task left running, handed back as a lost claim again and again.
            await self._fail(running, _error_info(exc), False, exc)
            return
        except TimeoutError as exc:
            # Only the method's own timeout is MethodTimeout; a TimeoutError the handler let out (its
            # own wait_for) is a failure like any other, and its recovery error says so (E3).
            if timeout is not None and timeout.expired():
                # No traceback logged: it is the cancel's.
                timed_out = ErrorInfo("MethodTimeout", f"{lease.method} passed its timeout")
                await self._fail(running, timed_out, False, None)
            else:
                await self._fail(running, _error_info(exc), False, exc, self._asked_delay(lease, exc))
            return
        except NoRetryError as exc:
            await self._fail(running, _error_info(exc), True, exc)
            return
        except KeyboardInterrupt:
            raise  # the process is asked to stop
        except BaseException as exc:
            # Exception, and what else a handler may let out: GeneratorExit, or SystemExit from a
            # library's sys.exit() (argparse's). A failure of the attempt like any other: let
            # through, it left the attempt's task running for ever, or ended the worker process.
            await self._fail(running, _error_info(exc), False, exc, self._asked_delay(lease, exc))
            return
        finally:
            ctx.close(f"{lease.method} of {lease.step_execution_id} (attempt {lease.attempt}) returned")
        await self._drain_events(running)
        if running.revoked:
            return
        running.committing = True
        try:
            if lease.method == "wait_for":
                spec = checked_wait(self.registry.flow(lease.flow_type), lease.step_type, result)
                if _gates.ACTIVE:
                    _gates.gate(_gates.BEFORE_COMMIT)
                await self.store.commit_wait_for(lease, ctx.writes, spec)
            else:
                decision = self._decision_record(lease, result)
                if self.store.folds_waits and decision.movements:
                    decision = self._fold_waits(lease, ctx.writes, decision)
                if _gates.ACTIVE:
                    _gates.gate(_gates.BEFORE_COMMIT)
                free = self.options.max_concurrent_tasks - len(self._running) + 1
                claims = not (self._stopping.is_set() or self._unregistered)
                # Only a commit that starts Steps would hand them over; one that starts none claims
                # by age in its own transaction as usual.
                yields = claims and self._due_while_full and bool(decision.movements)
                if yields:
                    self._due_while_full = False
                    claims = False
                claim = (self.worker_id, self._flow_types, free) if claims else None
                started = int(time.time() * 1000)
                self._claiming.append(started)
                try:
                    leases = await self.store.commit_execute(lease, ctx.writes, decision, claim, self.fold_execute)
                    running.claimed_next = claim is not None
                    self._forget(running)
                    for next_lease in leases:
                        self._spawn(next_lease)
                    if yields:
                        self._notify()  # claim by age now, in the slot this attempt freed
                finally:
                    self._claiming.remove(started)
        except (StaleAttemptError, asyncio.CancelledError):
            raise
        except Exception as exc:
            await self._fail(running, _error_info(exc), False, exc)
            return
        if _gates.ACTIVE:
            _gates.gate(_gates.AFTER_COMMIT)

    def _handler_call(self, running: _Running) -> tuple[Context, Awaitable[Any]]:
        """The attempt's context and what to await for its handler's result: the handler called
        now, or resumed where the commit that claimed it parked it (Lease.started)."""
        lease = running.lease
        if lease.started is not None:
            parked = cast(ParkedHandler, lease.started.resume)
            return parked.context, parked.resume(*self._attempt_functions(running))
        # A Step stored by another version of the Flow may be missing here or take another input.
        step = self.registry.flow(lease.flow_type).step(lease.step_type)
        handler = step.execute if lease.method == "execute" else step.wait_for
        if handler is None:
            raise UndeclaredNameError("WaitFor of Step", lease.step_type, lease.flow_type, [])
        ctx = self._context(running)
        input_value = decode_value(f"input of Step {step.step_type}", step.input_type, lease.input)
        return ctx, handler(ctx, input_value)

    def _decision_record(self, lease: Lease, result: object) -> DecisionRecord:
        if not isinstance(result, StepDecision):
            raise InvalidValueError(f"execute of Step {lease.step_type!r} returned {shown(result)}, not a StepDecision")
        flow = self.registry.flow(lease.flow_type)
        movements = tuple(movement_record(flow, m) for m in result.movements)
        for name in result.canceling_steps:
            flow.step(name)
        output = None
        if result.kind in ("graceful_complete", "force_complete"):
            output = encode_value("flow output", Any, result.output)
        return DecisionRecord(kind=result.kind, movements=movements, output=output, reason=result.reason,
                              canceling_steps=result.canceling_steps)

    def _fold_waits(self, lease: Lease, writes: WriteSet, decision: DecisionRecord) -> DecisionRecord:
        """Evaluate now the WaitFor of each Step the decision starts, where this Execute's snapshot
        and writes tell what that WaitFor would load, so that its wait is registered in this commit
        rather than in a commit of its own (one transaction and fsync fewer per wait)."""
        movements = list(decision.movements)
        folded = False
        for i, movement in enumerate(movements):
            early = self._evaluate_wait_early(lease, writes, movement)
            if early is not None:
                spec, loaded = early
                movements[i] = msgspec.structs.replace(
                    movement, wait=spec, wait_loaded=tuple((n, k, v) for (n, k), v in loaded.items()),
                )
                folded = True
        return msgspec.structs.replace(decision, movements=tuple(movements)) if folded else decision

    def _evaluate_wait_early(
        self, lease: Lease, writes: WriteSet, movement: MovementRecord,
    ) -> tuple[WaitSpec, dict[tuple[str, str], bytes]] | None:
        """The movement's wait and the attributes it was evaluated on, or None when its WaitFor must
        run as a normal attempt after the commit: it takes locks, loads what this Execute did not,
        raises, awaits anything, writes, or needs an attempt (execution ID, heartbeat, events)."""
        options = movement.options.wait_for
        if options is None or options.locks or not options.load.loads_within(lease.load):
            return None
        flow = self.registry.flow(lease.flow_type)
        step = flow.step(movement.step_type)
        if step.wait_for is None:
            return None
        load = options.load
        # What the WaitFor would load after this commit: this Execute's view of those attributes
        # with its own writes applied. The commit checks it against the rows (MovementRecord.wait).
        loaded: dict[tuple[str, str], bytes] = {}
        if load.mode != "none":
            names, instances = frozenset(load.names), frozenset(load.instances)
            every = load.mode == "all"
            loaded = {i: v for i, v in lease.attributes.items() if every or i[0] in names or i in instances}
            for ident, value in writes.attributes.items():
                if every or ident[0] in names or ident in instances:
                    if value is None:
                        loaded.pop(ident, None)
                    else:
                        loaded[ident] = value
        early: FoldContext | None = None
        try:
            input_value = decode_value(f"input of Step {step.step_type}", step.input_type, movement.input)
            ctx = early = FoldContext(
                flow=flow, flow_id=lease.flow_id, step_type=step.step_type, step_execution_id="",
                method="wait_for", attempt=1, loaded=loaded, load=load, checkpoint=None,
                recovery_error=None, wait_result=None, heartbeat=_no_heartbeat, write_event=_no_event,
            )
            # Stepped once, not awaited: the Execute's result is not durable until its commit, which
            # must not wait for a WaitFor that awaits anything (I/O, a sleep); that one runs as usual.
            running = cast("Coroutine[Any, Any, Wait]", step.wait_for(ctx, input_value))
            try:
                running.send(None)
            except StopIteration as done:
                result = done.value
            else:
                running.close()
                return None
            if ctx.touched or not ctx.writes.empty():
                return None
            return checked_wait(flow, step.step_type, result), loaded
        except (Exception, NotFoldable, asyncio.CancelledError):
            # Whatever went wrong happens again in the real attempt, with retries and failure routes.
            # That includes a CancelledError the WaitFor raised itself: stepped, nothing cancelled it.
            return None
        finally:
            if early is not None:
                early.close(f"wait_for of Step {step.step_type} (evaluated before its Step started) returned")

    def fold_execute(self, lease: Lease, durable: bool) -> tuple[WriteSet, DecisionRecord] | StartedFold | None:
        """Run a pure Execute now, inside the commit that claimed `lease`: its writes and decision
        when it finishes (Step.pure_execute, Step.pure_until_heartbeat); the heartbeat it stopped at,
        its first (Step.pure_until_heartbeat, in a `durable` commit), with the events written before it; or None when
        it must run as a usual attempt after that commit. Only on this worker's event loop thread
        (the handler is not thread-safe), and only when the handler neither raises nor suspends on
        anything else: it is not awaited, it is stepped once, since the open transaction cannot wait
        for the loop."""
        if lease.method != "execute" or threading.get_ident() != self._loop_thread or self._stopping.is_set():
            return None
        flow = self.registry.flows.get(lease.flow_type)
        step = None if flow is None else flow.steps.get(lease.step_type)
        # Parking records a heartbeat, which must be durable when recorded (E10).
        parks = step is not None and step.pure_until_heartbeat and durable
        if flow is None or step is None or not (step.pure_execute or parks):
            return None
        assert self._own_context is not None
        # The handler's own context variables, as its attempt's task would have them: none it sets
        # leaks into the committing task, and a parked handler's task goes on in them (_spawn).
        variables = self._own_context.copy()
        ctx: Context | None = None
        parked_handler = False  # a parked handler goes on with its context as a usual attempt
        try:
            input_value = decode_value(f"input of Step {step.step_type}", step.input_type, lease.input)
            functions = FoldFunctions(flow, parks=parks)
            ctx = _lease_context(flow, lease, functions.heartbeat, functions.write_event)
            # A coroutine: a Flow accepts only `async def` handlers (Flow._step_problems).
            running = cast("Coroutine[Any, Any, StepDecision]", step.execute(ctx, input_value))
            try:
                yielded = variables.run(running.send, None)
            except StopIteration as done:
                if functions.events:
                    return None  # events but no heartbeat: they go out as a usual attempt's would
                return ctx.writes, self._decision_record(lease, done.value)
            if functions.parked is None or yielded is not functions.parked:
                variables.run(running.close)  # it awaits something only a usual attempt can wait for
                return None
            parked = ParkedHandler(ctx, running, functions, variables)
            parked_handler = True
            return StartedFold(functions.checkpoint, functions.events, parked, partial(variables.run, running.close))
        except KeyboardInterrupt:
            raise
        except BaseException:
            # Whatever went wrong happens again in the usual attempt, with retries and failure routes
            # (a handler's SystemExit too: there it fails the attempt, as it would here the commit).
            # That includes a CancelledError the handler raised itself (it was stepped, not awaited,
            # so nothing cancelled it): let through, it would abort the commit that claimed it.
            return None
        finally:
            if ctx is not None and not parked_handler:  # as _attempt closes a usual attempt's
                ctx.close(f"execute of {lease.step_execution_id} (attempt {lease.attempt}) returned")

    async def _fail(
        self, running: _Running, error: ErrorInfo, no_retry: bool, exc: BaseException | None,
        asked: AskedDelay | None = None,
    ) -> None:
        # Events the attempt wrote before failing are kept: readers show a failed attempt's output.
        await self._drain_events(running)
        if running.revoked:
            return
        await self.store.fail_attempt(running.lease, error, no_retry=no_retry, asked=asked)
        _log_failed_attempt(running.lease, error, no_retry, exc)

    @staticmethod
    def _asked_delay(lease: Lease, exc: BaseException) -> AskedDelay | None:
        """The retry delay `exc` asks for (RetryAfterError); an unusable one is also logged, as a
        mistake of the handler's author, who may not read the flow's history."""
        asked = asked_delay(exc)
        if asked is not None and asked.delay_ms is None:
            log.warning("flow %s: %s of %s (attempt %d) raised %s: %s", lease.flow_id, lease.method,
                        lease.step_execution_id, lease.attempt, type(exc).__name__, asked.note)
        return asked

    def _context(self, running: _Running) -> Context:
        lease = running.lease
        return _lease_context(self.registry.flow(lease.flow_type), lease, *self._attempt_functions(running))

    def _attempt_functions(self, running: _Running) -> tuple[HeartbeatFn, EventFn]:
        """The attempt's heartbeat and best-effort event functions."""
        lease = running.lease
        flow = self.registry.flow(lease.flow_type)
        store = self.store
        loop = asyncio.get_running_loop()
        loop_thread = threading.get_ident()

        async def heartbeat(checkpoint: str | None) -> None:
            if running.revoked:
                raise StaleAttemptError(f"attempt {lease.attempt} of {lease.step_execution_id} was revoked")
            events: list[tuple[str, int, bytes]] = []
            if running.flush_task is None or running.flush_task.done():
                # Events written just before (a tool's tool_call_started) go out with the heartbeat,
                # one transaction instead of two; not while a flush runs, which keeps their order.
                with running.events_lock:
                    events = running.events[:]
                    running.events.clear()
            if not events:
                await store.heartbeat(lease, checkpoint, events)
                return
            # Carrying events, the heartbeat is the attempt's flush while it runs: an event written
            # meanwhile (by another task of the handler) waits for it, and is flushed after it, in
            # order; a store that lets one operation overtake another cannot reorder them.
            carrying = asyncio.ensure_future(store.heartbeat(lease, checkpoint, events))
            running.flush_task = carrying
            carrying.add_done_callback(lambda _: self._schedule_flush(running))
            await carrying

        def write_event(stream: str, data: bytes) -> None:
            with running.events_lock:
                if running.events_closed:
                    return
                capacity = flow.streams[stream].capacity_bytes
                running.events.append((stream, capacity, data))
            if threading.get_ident() == loop_thread:
                loop.call_soon(self._schedule_flush, running)  # no self-pipe wake-up from the loop's own thread
            else:
                loop.call_soon_threadsafe(self._schedule_flush, running)

        return heartbeat, write_event

    def _schedule_flush(self, running: _Running) -> None:
        if running.flush_task is None or running.flush_task.done():
            with running.events_lock:
                # A heartbeat may have taken the events meanwhile; a later write schedules again.
                pending = bool(running.events)
            if pending:
                running.flush_task = asyncio.create_task(self._flush_events(running))

    async def _drain_events(self, running: _Running) -> None:
        """Before an attempt's result commits: every best-effort event it wrote is appended, the
        flush in flight first. Awaiting that flush also frees the store's thread, so the commit
        can run on the loop, where the Steps it readies can fold into it, instead of queueing there."""
        flushing = running.flush_task
        if flushing is not None and not flushing.done():
            await asyncio.wait([flushing])
        await self._flush_events(running)

    async def _flush_events(self, running: _Running) -> None:
        while True:
            with running.events_lock:
                batch = running.events[:]
                running.events.clear()
            if not batch:
                return
            by_stream: dict[tuple[str, int], list[bytes]] = {}
            for stream, capacity, data in batch:
                by_stream.setdefault((stream, capacity), []).append(data)
            for (stream, capacity), values in by_stream.items():
                try:
                    await self.store.append_best_effort(running.lease, stream, capacity, values)
                except StaleAttemptError:
                    self._revoke(running)
                    return
                except Exception:
                    # Best effort (ENGINE.md E11): a write that fails drops its events; it must not
                    # fail the attempt, whose result commits on its own.
                    log.warning("flow %s: %d events of %s attempt %d could not be written and were dropped",
                                running.lease.flow_id, len(values), running.lease.step_execution_id,
                                running.lease.attempt, exc_info=True)


def _close_opened(opening: concurrent.futures.Future[Store]) -> None:
    """Close the store an open that nobody waits for any more made (its worker was stopped)."""
    if not opening.cancelled() and opening.exception() is None:
        opening.result().close_nowait()


def _lease_context(flow: Flow, lease: Lease, heartbeat: HeartbeatFn, write_event: EventFn) -> Context:
    """The context of the attempt `lease` hands out, with its heartbeat and event functions."""
    wait_result = None
    if lease.method == "execute" and lease.options.has_wait_for:
        wait_result = WaitResult(lease.wait_spec, lease.wait_outcome, flow)
    return Context(
        flow=flow, flow_id=lease.flow_id, step_type=lease.step_type,
        step_execution_id=lease.step_execution_id, method=lease.method, attempt=lease.attempt,
        loaded=lease.attributes, load=lease.load, checkpoint=lease.checkpoint,
        recovery_error=lease.recovery_error, wait_result=wait_result,
        heartbeat=heartbeat, write_event=write_event,
    )


async def _no_heartbeat(_checkpoint: str | None) -> None:
    raise NotFoldable("heartbeat")


def _no_event(_stream: str, _data: bytes) -> None:
    raise NotFoldable("write_event")


def _cancel_requested() -> bool:
    """Whether the running task was asked to cancel, rather than handed a CancelledError raised
    by something it awaited."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def checked_wait(flow: Flow, step_type: str, result: object) -> WaitSpec:
    """The WaitSpec of what a WaitFor returned. InvalidValueError when it is not a Wait, and
    UndeclaredNameError for a channel the Flow does not declare in that shape (plain or map): nothing
    can publish there, so the wait would hold the Step for ever."""
    if not isinstance(result, Wait):
        raise InvalidValueError(f"wait_for of Step {step_type!r} returned {shown(result)}, not a Wait")
    for condition in result.conditions:
        if isinstance(condition, ChannelCondition):
            flow.check_channel(ChannelRef(condition.channel, condition.key, None))
    return result.spec()


def _attempts_named(running: Iterable[_Running]) -> str:
    """": flow/step execution attempt n, ..." of the first LATE_ATTEMPTS_NAMED of `running` ("" for
    none), for a warning about them: the sessions they belong to must be findable from the log."""
    named = [f"{r.lease.flow_id}/{r.lease.step_execution_id} attempt {r.lease.attempt}"
             for r in itertools.islice(running, LATE_ATTEMPTS_NAMED)]
    return ": " + ", ".join(named) if named else ""


def _log_failed_attempt(lease: Lease, error: ErrorInfo, no_retry: bool, exc: BaseException | None) -> None:
    """Log the failure of `lease`'s attempt, which the store recorded, naming its flow: one line at
    INFO while its retry policy may run it again, and at WARNING with `exc`'s traceback once it
    counts as the last. Recorded only in the database, a Step's bug left no traceback anywhere,
    and an operator watching the worker saw nothing of a flow or a turn that failed."""
    options = lease.options.wait_for if lease.method == "wait_for" and lease.options.wait_for else lease.options.execute
    detail = error.detail[:MAX_ERROR_TEXT_CHARS]  # the stored text's cut: a huge error is not logged whole
    if not no_retry and lease.attempt < options.retry.max_attempts:
        # Its total_duration_seconds may still make this the last (the store decides): "as it allows".
        log.info("flow %s: %s of Step %s attempt %d failed, retried as its retry policy allows: %s: %s",
                 lease.flow_id, lease.method, lease.step_execution_id, lease.attempt, error.error_type, detail)
        return
    after = (f"its failure route {lease.options.failure_route} runs" if lease.options.failure_route is not None
             else "the flow fails")
    frames = ""
    if exc is not None and len(error.detail) > MAX_ERROR_TEXT_CHARS:
        # With exc_info, logging would print the error's text whole (a response body of megabytes):
        # the traceback's frames alone, after the text cut above.
        frames = "\nTraceback (most recent call last):\n" + "".join(traceback.format_tb(exc.__traceback__)).rstrip()
        exc = None
    log.warning("flow %s: %s of Step %s failed on attempt %d, its last: %s: %s; %s%s", lease.flow_id, lease.method,
                lease.step_execution_id, lease.attempt, error.error_type, detail, after, frames, exc_info=exc)


def _error_info(exc: BaseException) -> ErrorInfo:
    """What `exc` was, for the attempt's failure. Never raises: an exception whose text cannot be
    made would otherwise leave the failure unrecorded, the attempt handed back and run again."""
    try:
        return ErrorInfo(type(exc).__name__, str(exc) or repr(exc))
    except Exception as failed:
        return ErrorInfo(type(exc).__name__, f"(its text could not be made: {type(failed).__name__})")

