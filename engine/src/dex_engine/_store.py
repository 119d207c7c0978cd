"""The store interface: every durable operation the worker, client and CLI need.

A backend supplies `_run`, which runs one function inside one transaction on its connection and
returns its result; everything else is shared, so SQLite and PostgreSQL behave the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar
from types import MappingProxyType
from typing import Any, Protocol, TypeVar

from . import _gates
from . import _transitions as tx
from ._limits import DEFAULT_READ_LIMIT, MAX_FOLDED_EXECUTES_PER_COMMIT
from ._open import shown_url
from ._options import FlowConfig, LoadSpec
from ._records import (
    DecisionRecord,
    ErrorInfo,
    EventPage,
    FlowInfo,
    HistoryEntry,
    HousekeepingReport,
    Lease,
    MovementRecord,
    RetryWaitEnding,
    RpcOutcome,
    RpcSnapshot,
    StartedFold,
    StartRequest,
    WriteSet,
)
from ._retry import AskedDelay
from ._transitions import Db
from ._wait import WaitSpec

R = TypeVar("R")

# Runs a claimed attempt's Execute now, inside the transaction that claimed it, when its Step is
# pure (Step.pure_execute, Step.pure_until_heartbeat) and this thread is its worker's event loop:
# its writes and decision; or, stopped at its first heartbeat, that heartbeat; or None when it must
# run as a usual attempt. The flag says whether that transaction is durable, so may record a
# heartbeat (E10); when not, a Step.pure_until_heartbeat handler is not run.
FoldExecute = Callable[[Lease, bool], tuple[WriteSet, DecisionRecord] | StartedFold | None]

# Said after "store ... is closed": a call on a client after its close (or a worker's store after its stop)
# names what to do.
CLOSED_STORE_ADVICE = (
    "the AsyncClient, AsyncWorker or open_store() call that opened it has closed it; open the database again"
    " (a new AsyncClient or AsyncWorker)"
)

# A claim older than this that its worker does not know of was lost in transit and is handed back;
# far longer than any reply takes to arrive.
LOST_CLAIM_MS = 10_000

# The commit listener of the worker whose task issued an operation: a worker is not woken by its
# own commits (it already holds what they claimed), only by everyone else's.
commit_origin: ContextVar[Callable[[], None] | None] = ContextVar("dex_commit_origin", default=None)

# Set by a worker for its own operations (polls, lease renewals, its registration's removal): a
# backend that tries an operation again after a lost connection gives it up once this returns True
# (the worker is stopping). Else a stop during a database outage waited for every try of the poll
# in flight (minutes on PostgreSQL) before its grace even began, and a service manager's stop
# timeout killed the process instead.
stop_retrying: ContextVar[Callable[[], bool] | None] = ContextVar("dex_stop_retrying", default=None)


def now_ms() -> int:
    return int(time.time() * 1000)


def _started_or_claimed(
    db: Db, handoff: tx.Handoff, readied: int | None, flow_types: Sequence[str], now: int, *, defer: bool,
    declined: tx.Declined,
) -> list[tx.Claimed]:
    """The attempts a commit hands its worker: the Steps it started went straight to it (`handoff`);
    otherwise claim ready work, and also when the commit made work ready (a backend that counts it,
    in `readied`). `defer`: the claims are not written yet (tx.claim_deferred), for the caller to
    fold their Executes or write them."""
    started = [tx.Claimed(lease, fresh=True) for lease in handoff.leases]
    if handoff.leases and (readied is None or getattr(db, "readied", None) == readied):
        return started
    if defer:
        return started + tx.claim_deferred(db, handoff.worker_id, flow_types, handoff.capacity, now, declined)
    return started + [tx.Claimed(lease) for lease in
                      tx.claim(db, handoff.worker_id, flow_types, handoff.capacity, now, declined)]


class LocalClaimer(Protocol):
    """A worker of this process that takes the Steps a client's commit makes ready, in that commit."""

    def local_claim(self) -> tuple[str, tuple[str, int], Sequence[str], int, int] | None:
        """On the caller's event loop, before the commit is sent: (worker ID, its holder (host, PID),
        flow types, free slots, a token for `local_claim_done`), or None when this worker cannot take
        work from this caller. The commit claims nothing when the ID's row is not the holder's."""

    def local_claim_done(self, token: int, leases: list[Lease] | None, capacity: int) -> None:
        """After the commit (or its failure): run the attempts it claimed; None: it claimed nothing."""

    def local_origin(self) -> Callable[[], None]:
        """The worker's commit listener: commits that claimed for it need not wake it."""

    def fold_execute(self, lease: Lease, durable: bool) -> tuple[WriteSet, DecisionRecord] | StartedFold | None:
        """Inside the commit that claimed `lease`: its pure Execute's result (see FoldExecute)."""


class Store(ABC):
    """One database. Methods are coroutines; each is one transaction (E1)."""

    url: str
    # (event loop, callback) of each commit listener; backends create it and call the callbacks.
    _listeners: list[tuple[asyncio.AbstractEventLoop, Callable[[], None]]]
    # Whether commit_execute registers the waits of MovementRecord.wait: workers then evaluate the
    # WaitFor of a Step an Execute starts before that Execute's commit, when they can (see there).
    folds_waits: bool = False
    # Whether a poll that need not claim or housekeep may run as a read-only transaction.
    light_polls: bool = False
    # Whether a client's commit that makes Steps ready claims them for a worker of this process in
    # the same transaction (the backend's Db counts what a transition made ready, in `readied`).
    hands_off_locally: bool = False
    # Whether a commit that hands a worker Steps may run their pure Executes in its transaction
    # (Step.pure_execute): savepoints, and writers serialized so that the claim's snapshot holds.
    folds_executes: bool = False
    # Workers of this process that take such Steps (add_local_claimer); replaced, never mutated.
    _claimers: tuple[LocalClaimer, ...] = ()
    # By worker ID, the Steps its Registry lacks, which no claim for it takes (set_declined);
    # replaced under the lock, never mutated: its workers may run on several event loops.
    _declined: Mapping[str, frozenset[tuple[str, str, str]]] = MappingProxyType({})
    _declined_lock = threading.Lock()
    # The process that opened the store (each backend sets it): its threads and connections are
    # that process's alone.
    _opened_pid: int

    def _in_fork(self) -> bool:
        """Whether this process is a fork of the one that opened the store (gunicorn --preload)."""
        return os.getpid() != self._opened_pid

    def _refuse_in_fork(self) -> None:
        """RuntimeError in a fork of the process that opened the store: the store's threads did not
        pass to the fork, so an operation would wait for them for ever, and its connections are the
        parent's (SQLite forbids using one in a fork: it can corrupt the file)."""
        if self._in_fork():
            raise RuntimeError(
                f"store {shown_url(self.url)!r} was opened in process {self._opened_pid}, and this process "
                f"({os.getpid()}) is a fork of it, where the store's threads and connections cannot be used; open "
                "the database only after the fork, in each process (a new AsyncClient or AsyncWorker; with "
                "gunicorn --preload: in a post_fork hook, or on first use)")

    def watch_foreign_commits(self, interval_seconds: float) -> bool:
        """Call the commit listeners within about `interval_seconds` of another process's commit
        that makes work ready (SQLite: of any commit; PostgreSQL: of its NOTIFY).

        Returns whether this backend does: then a worker need not poll for such commits (nor for
        revocations of its running attempts, which PostgreSQL also NOTIFYs) and sleeps until its
        next due time or housekeeping instead.
        """
        return False

    @abstractmethod
    async def _run(
        self, fn: Callable[[Db], R], *, write: bool, durable: bool | None = None, inline: bool = True,
    ) -> R:
        """Run `fn` in one transaction. `durable` False allows skipping the fsync (ASYNC Steps).
        `inline` False: never on the caller's event loop's thread (a store that may run it there)."""

    @abstractmethod
    async def close(self) -> None: ...

    @abstractmethod
    def close_nowait(self) -> None:
        """Start closing the store from any thread, waiting for nothing: its own threads then run
        what was queued, end, and close its connections. For a finalizer (a dropped AsyncClient's),
        which may run on one of those threads, or where no event loop runs, so it must neither
        await, nor join them, nor block on a lock such a thread may hold. A later close() returns
        at once; in a fork of the process that opened the store it only marks it closed."""

    @abstractmethod
    async def changed(self) -> bool:
        """True when another connection committed since the last call (cheap poll)."""

    async def clock_skew_ms(self) -> int | None:
        """How far the database server's clock is ahead of this host's (ms, negative when behind),
        for a backend whose workers may run on several hosts; None when all share one clock."""
        return None

    def add_commit_listener(self, fn: Callable[[], None]) -> None:
        """Call `fn` on the current event loop after each local write commit."""
        self._listeners.append((asyncio.get_running_loop(), fn))

    def remove_commit_listener(self, fn: Callable[[], None]) -> None:
        # `!=`, not `is not`: a worker passes its bound method, a new object at each access.
        self._listeners = [(loop, f) for loop, f in self._listeners if f != fn]

    def add_local_claimer(self, claimer: LocalClaimer) -> None:
        """Let commits of clients on `claimer`'s event loop hand the Steps they make ready to it."""
        if self.hands_off_locally:
            self._claimers = (*self._claimers, claimer)

    def remove_local_claimer(self, claimer: LocalClaimer) -> None:
        self._claimers = tuple(c for c in self._claimers if c is not claimer)

    def set_declined(self, worker_id: str, steps: tx.Declined) -> None:
        """From now on claim for `worker_id` none of `steps` (flow type, Step type, method), which
        its Registry lacks, nor wake it for them (next_due); empty: forget the worker's."""
        with self._declined_lock:
            declined = {k: v for k, v in self._declined.items() if k != worker_id}
            if steps:
                declined[worker_id] = frozenset(steps)
            self._declined = declined

    def declined(self, worker_id: str) -> tx.Declined:
        """The Steps no claim for `worker_id` takes (set_declined)."""
        return self._declined.get(worker_id, ())

    async def _run_handing_off(self, fn: Callable[[Db], R]) -> R:
        """Run a client's write. When it makes Steps ready and a worker of this process on this
        event loop has free slots, that worker claims them in this same transaction, as a commit of
        its own would: no wake-up, poll and claim transaction after it. The commit runs as a task of
        its own, so the attempts it claimed start even when the caller is cancelled meanwhile."""
        for claimer in self._claimers:
            request = claimer.local_claim()
            if request is not None:
                break
        else:
            return await self._run(fn, write=True)
        worker_id, holder, flow_types, capacity, token = request
        declined = self.declined(worker_id)

        def op(db: Db) -> tuple[R, list[Lease] | None]:
            readied = getattr(db, "readied", 0)
            result = fn(db)
            if getattr(db, "readied", 0) == readied or not tx.worker_registered(db, worker_id, holder):
                # Nothing became ready, or the worker must claim nothing (declared dead, or its ID
                # another process's): it is woken as usual, and its poll finds out which.
                return result, None
            now = now_ms()
            if self.folds_executes:
                claimed = tx.claim_deferred(db, worker_id, flow_types, capacity, now, declined)
            else:
                claimed = [tx.Claimed(lease) for lease in tx.claim(db, worker_id, flow_types, capacity, now, declined)]
            return result, self._fold_executes(db, claimed, claimer.fold_execute, worker_id, flow_types, capacity,
                                               durable=True, now=now)

        # Its commit does not wake the worker it claimed for (see local_claim_done).
        origin = commit_origin.set(claimer.local_origin())
        try:
            commit = asyncio.ensure_future(self._run(op, write=True))  # the task copies the origin
        finally:
            commit_origin.reset(origin)

        def landed(done: asyncio.Future[tuple[R, list[Lease] | None]]) -> None:
            failed = done.cancelled() or done.exception() is not None
            claimer.local_claim_done(token, None if failed else done.result()[1], capacity)

        commit.add_done_callback(landed)  # before shield's: the attempts start before the caller resumes
        result, _ = await asyncio.shield(commit)
        return result

    # Flows
    async def start_flow(self, req: StartRequest) -> None:
        await self._run_handing_off(lambda db: tx.start_flow(db, req, now_ms()))

    async def stop_flow(self, flow_id: str, reason: str) -> None:
        await self._run(lambda db: tx.stop_flow(db, flow_id, reason, now_ms()), write=True)

    async def delete_flow(self, flow_id: str) -> bool:
        """Delete a closed flow and all its rows in one transaction; False when there is none."""

        def op(db: Db) -> bool:
            deleted = tx.delete_flow(db, flow_id)
            if deleted and _gates.ACTIVE:  # the transaction is open: a crash here must leave the flow whole
                _gates.gate(_gates.INSIDE_DELETE)
            return deleted

        return await self._run(op, write=True)

    async def update_flow_config(self, flow_id: str, config: FlowConfig) -> None:
        await self._run(lambda db: tx.update_flow_config(db, flow_id, config), write=True)

    async def flow_config(self, flow_id: str) -> FlowConfig:
        return await self._run(lambda db: tx.flow_config(db, flow_id), write=False)

    async def describe_flow(self, flow_id: str) -> FlowInfo:
        return await self._run(lambda db: tx.describe_flow(db, flow_id), write=False)

    async def search_flows(
        self, *, flow_type: str | None = None, status: str | None = None,
        active_step: str | None = None, limit: int = DEFAULT_READ_LIMIT,
    ) -> list[str]:
        return await self._run(lambda db: tx.search_flows(db, flow_type, status, active_step, limit), write=False)

    async def list_flows(
        self, *, flow_type: str | None = None, status: str | None = None, limit: int = 100,
    ) -> list[FlowInfo]:
        """The newest `limit` flows (optionally of one type and status), newest first."""
        return await self._run(lambda db: tx.list_flows(db, flow_type, status, limit), write=False)

    async def history(self, flow_id: str, limit: int = 100_000) -> list[HistoryEntry]:
        return await self._run(lambda db: tx.read_history(db, flow_id, limit), write=False)

    async def skip_timer(self, flow_id: str, step_execution_id: str) -> None:
        await self._run(lambda db: tx.skip_timer(db, flow_id, step_execution_id, now_ms()), write=True)

    # Worker side
    async def claim(self, worker_id: str, flow_types: Sequence[str], capacity: int) -> list[Lease]:
        declined = self.declined(worker_id)
        return await self._run(lambda db: tx.claim(db, worker_id, flow_types, capacity, now_ms(), declined),
                               write=True)

    async def commit_wait_for(
        self, lease: Lease, writes: WriteSet, spec: WaitSpec, claim: tuple[str, Sequence[str], int] | None = None,
    ) -> list[Lease]:
        def op(db: Db) -> list[Lease]:
            now = now_ms()
            tx.commit_wait_for(db, lease, writes, spec, now)
            if _gates.ACTIVE:  # the transaction is open: a crash here must roll it all back
                _gates.gate(_gates.INSIDE_COMMIT)
            return [] if claim is None else tx.claim(db, claim[0], claim[1], claim[2], now, declined)

        declined = () if claim is None else self.declined(claim[0])
        return await self._run(op, write=True, durable=lease.durable)

    async def commit_execute(
        self, lease: Lease, writes: WriteSet, decision: DecisionRecord,
        claim: tuple[str, Sequence[str], int] | None = None, fold: FoldExecute | None = None,
    ) -> list[Lease]:
        """Commit an Execute; with `claim`, hand out the next ready attempts in the same transaction,
        and with `fold`, run the pure Executes among them there too (see _fold_executes)."""

        def op(db: Db) -> list[Lease]:
            now = now_ms()
            handoff = None if claim is None else tx.Handoff(claim[0], claim[2], [])
            readied = getattr(db, "readied", None)
            tx.commit_execute(db, lease, writes, decision, now, handoff)
            if claim is None or handoff is None:
                if _gates.ACTIVE:  # the transaction is open: a crash here must roll it all back
                    _gates.gate(_gates.INSIDE_COMMIT)
                return []
            claimed = _started_or_claimed(db, handoff, readied, claim[1], now,
                                          defer=fold is not None and self.folds_executes,
                                          declined=self.declined(claim[0]))
            leases = self._fold_executes(db, claimed, fold, claim[0], claim[1], claim[2], durable=lease.durable,
                                         now=now)
            if _gates.ACTIVE:  # after the folded Executes too: a crash here rolls them all back
                _gates.gate(_gates.INSIDE_COMMIT)
            return leases

        return await self._run(op, write=True, durable=lease.durable)

    def _fold_executes(
        self, db: Db, claimed: list[tx.Claimed], fold: FoldExecute | None, worker_id: str, flow_types: Sequence[str],
        capacity: int, *, durable: bool, now: int,
    ) -> list[Lease]:
        """Inside the transaction that claimed these attempts: run each pure Execute among them
        through `fold` and commit it here, in a savepoint, handing on what it starts; the rest are
        returned to run as usual, their claims written (tx.write_claim). One that stopped at its
        first heartbeat has that heartbeat recorded here and is returned to be resumed. A commit
        that skips the fsync (ASYNC) folds no durable Step and records no heartbeat."""
        if fold is None or not self.folds_executes:
            return [tx.write_claim(db, c) for c in claimed]
        pending, out, folded = list(claimed), [], 0
        while pending:
            current = pending.pop(0)
            claimed_lease = current.lease
            result = None
            if folded < MAX_FOLDED_EXECUTES_PER_COMMIT and (durable or not claimed_lease.durable):
                result = fold(claimed_lease, durable)
            if result is None:
                out.append(tx.write_claim(db, current))
                continue
            if isinstance(result, StartedFold):
                tx.write_claim(db, current)
                # A heartbeat is durable once recorded (E10): not in a commit that skips the fsync.
                if durable and tx.heartbeat_folded(db, current, result, now):
                    folded += 1
                    out.append(dataclasses.replace(claimed_lease, started=result))
                else:
                    with contextlib.suppress(Exception):  # its usual attempt runs it again, and fails as it fails
                        result.close()
                    out.append(claimed_lease)
                continue
            # Its writes must preserve the snapshots of the other claims (E15): they are written
            # first, and from here on their tasks are checked rather than known (Claimed.fresh).
            for other in pending:
                tx.write_claim(db, other)
                other.fresh = False
            # Its slot is free again once it commits here.
            handoff = tx.Handoff(worker_id, capacity - len(out) - len(pending), [])
            readied = getattr(db, "readied", None)
            revokes = getattr(db, "revokes", None)
            if not tx.commit_folded(db, current, result[0], result[1], now, handoff):
                out.append(tx.write_claim(db, current))
                continue
            folded += 1
            if getattr(db, "revokes", None) != revokes:
                # It cancelled Steps or closed the flow: drop the attempts it took away, which the
                # worker would otherwise start (no running attempt of its own to revoke yet, E9).
                live = tx.task_epochs(db, [c.task_id for c in out] + [c.lease.task_id for c in pending])
                for gone in out:
                    if gone.started is not None and live.get(gone.task_id) != gone.lease_epoch:
                        with contextlib.suppress(Exception):
                            gone.started.close()
                out = [c for c in out if live.get(c.task_id) == c.lease_epoch]
                pending = [c for c in pending if live.get(c.lease.task_id) == c.lease.lease_epoch]
            pending += _started_or_claimed(db, handoff, readied, flow_types, now, defer=True,
                                           declined=self.declined(worker_id))
        return out

    async def fail_attempt(
        self, lease: Lease, error: ErrorInfo, *, no_retry: bool = False, asked: AskedDelay | None = None
    ) -> None:
        await self._run(lambda db: tx.fail_attempt(db, lease, error, no_retry, now_ms(), asked), write=True)

    async def abandon(self, lease: Lease) -> None:
        await self._run(lambda db: tx.abandon(db, lease), write=True)

    async def release_unstarted(self, lease: Lease) -> None:
        await self._run(lambda db: tx.release_unstarted(db, lease), write=True)

    async def heartbeat(
        self, lease: Lease, checkpoint: str | None, events: Sequence[tuple[str, int, bytes]] = (),
    ) -> None:
        """A durable heartbeat; `events` (stream, capacity, value) are appended with it, best effort."""
        await self._run(lambda db: tx.heartbeat(db, lease, checkpoint, now_ms(), events), write=True)

    async def append_best_effort(self, lease: Lease, stream: str, capacity: int, values: Sequence[bytes]) -> None:
        await self._run(lambda db: tx.append_best_effort(db, lease, stream, capacity, values), write=True,
                        durable=False)

    async def register_worker(self, worker_id: str, host: str, pid: int, ttl_ms: int) -> None:
        await self._run(lambda db: tx.register_worker(db, worker_id, host, pid, ttl_ms, now_ms()), write=True)

    async def renew_worker(self, worker_id: str, ttl_ms: int, *, holder: tuple[str, int] | None = None) -> bool:
        """False when the worker was declared dead, or its ID's row is not `holder`'s (host, PID)."""
        return await self._run(lambda db: tx.renew_worker(db, worker_id, ttl_ms, now_ms(), holder), write=True,
                               durable=False)

    async def shift_deadlines(self, worker_id: str, shift_ms: int, claimed_by: int) -> int:
        """See tx.shift_deadlines: the wall clock stepped forward `shift_ms` under the worker's attempts."""
        return await self._run(lambda db: tx.shift_deadlines(db, worker_id, shift_ms, claimed_by), write=True)

    async def unregister_worker(self, worker_id: str, *, holder: tuple[str, int] | None = None) -> None:
        """Remove the worker (with `holder`, only the row that host and PID hold)."""
        await self._run(lambda db: tx.unregister_worker(db, worker_id, now_ms(), holder), write=True)

    async def housekeeping(self) -> HousekeepingReport:
        return await self._run(lambda db: tx.housekeeping(db, now_ms()), write=True)

    async def poll(
        self, worker_id: str, flow_types: Sequence[str], capacity: int, running: Sequence[int],
        *, must_claim: bool, housekeep: bool, known: Sequence[int] | None = None,
        claimed_before: int | None = None, holder: tuple[str, int] | None = None, declare_dead: bool = True,
        timer_floor: bool = True, retention_ms: int | None = None,
    ) -> tuple[bool, tx.PollResult]:
        """One worker loop iteration in one transaction; returns (changed elsewhere, result).

        It claims when `must_claim`, when another connection committed since the last poll, or
        when housekeeping made work ready. With `known`, housekeeping hands back this worker's
        claims made before `claimed_before` (ms; default LOST_CLAIM_MS before this call) that are
        not in `known`: the caller takes both before the call, since the transaction may run much
        later, after commits handed the caller claims that `known` cannot list. With `holder` (host,
        PID), a worker whose ID's row that process does not hold claims nothing (see
        tx.worker_registered). With `declare_dead` False, housekeeping declares no worker dead (the
        caller saw the wall clock step; see tx.housekeeping). With `timer_floor` False, housekeeping
        fires timers only while few of `flow_types`' tasks are ready (see tx.housekeeping). With
        `retention_ms`, housekeeping deletes some flows closed longer ago than that (tx.delete_closed_flows).
        """
        if claimed_before is None:
            claimed_before = now_ms() - LOST_CLAIM_MS
        declined = self.declined(worker_id)
        if self.light_polls and not must_claim and not housekeep:
            # Most polls find nothing new: read the epochs and due times without taking the write
            # lock; only when another connection committed does a full poll follow, to claim.
            def light(db: Db) -> tx.PollResult | None:
                if self._changed_in(db):
                    return None
                return tx.PollResult([], tx.task_epochs(db, running), tx.next_due(db, flow_types, declined), None)

            quiet = await self._run(light, write=False)
            if quiet is not None:
                return False, quiet
            must_claim = True

        def op(db: Db) -> tuple[bool, tx.PollResult]:
            now = now_ms()
            changed = self._changed_in(db)
            if housekeep and known is not None:
                tx.release_lost_claims(db, worker_id, known, claimed_before, now)
            report = (tx.housekeeping(db, now, worker_id, declare_dead=declare_dead, flow_types=flow_types,
                                      timer_floor=timer_floor, retention_ms=retention_ms) if housekeep else None)
            woke = report is not None and bool(report.timers_fired or report.leases_expired or report.timeouts)
            claim_now = must_claim or changed or woke
            registered = not claim_now or tx.worker_registered(db, worker_id, holder)
            leases = tx.claim(db, worker_id, flow_types, capacity, now, declined) if claim_now and registered else []
            result = tx.PollResult(leases, tx.task_epochs(db, running), tx.next_due(db, flow_types, declined),
                                   report, registered)
            return changed, result

        return await self._run(op, write=True, durable=False)

    def _changed_in(self, db: Db) -> bool:
        """Inside a transaction: did another connection commit since the last call? Backends override."""
        return True

    async def next_due(self, flow_types: Sequence[str]) -> int | None:
        return await self._run(lambda db: tx.next_due(db, flow_types), write=False)

    async def list_workers(self) -> list[tuple[str, str, int, int, int]]:
        return await self._run(tx.list_workers, write=False)

    # RPCs and clients
    async def rpc_read(self, flow_id: str, load: LoadSpec, locks: Sequence[str]) -> RpcSnapshot:
        """RpcVersionChanged when the flow changed while it was read (see tx.rpc_read)."""
        snapshot = await self._run(lambda db: tx.rpc_read(db, flow_id, load, locks), write=False)
        if snapshot is None:
            raise tx.RpcVersionChanged()
        return snapshot

    async def rpc_load(self, flow_id: str, version: int, load: LoadSpec,
                       started_ms: int | None = None) -> dict[tuple[str, str], bytes]:
        """RpcVersionChanged when the flow is no longer at `version` (see tx.rpc_load)."""
        rows = await self._run(lambda db: tx.rpc_load(db, flow_id, version, load, started_ms), write=False)
        if rows is None:
            raise tx.RpcVersionChanged()
        return rows

    async def rpc_locked(
        self, flow_id: str, load: LoadSpec, locks: Sequence[str],
        decide: Callable[[RpcSnapshot, Callable[[LoadSpec], dict[tuple[str, str], bytes]]], RpcOutcome | None],
    ) -> RpcOutcome | None:
        """One RPC try that cannot lose a race: the flow's snapshot is read, `decide` runs the handler
        on it (the callable it is given loads more attributes in this transaction), and its outcome
        is committed, all in one transaction that holds the flow's write lock (its row lock on
        PostgreSQL, the file's on SQLite) so that nothing changes the flow in between. None, having
        committed nothing, when `decide` could not run the handler to its end in the transaction."""

        def op(db: Db) -> RpcOutcome | None:
            tx.lock_flow(db, flow_id)
            snapshot = tx.rpc_read(db, flow_id, load, locks)
            if snapshot is None:  # nothing changes the version under the row lock; were it to, this try lost
                return None
            outcome = decide(snapshot, lambda spec: tx.load_attributes(db, flow_id, spec))
            if outcome is None or outcome.writes_nothing():
                return outcome
            tx.rpc_commit(db, flow_id, snapshot.version, locks, outcome.writes, outcome.records, outcome.canceling,
                          now_ms(), ending=outcome.ending, started_ms=snapshot.started_ms)
            return outcome

        # Not handed off (see rpc_commit): the outcome is known only inside the transaction. Not
        # inline: on the loop's thread the handler's run holds the write lock (SQLite: the file's)
        # for as long as it blocks that loop; from another thread, _on_loop lets go of it after
        # RPC_LOCKED_LOOP_WAIT_SECONDS.
        return await self._run(op, write=True, inline=False)

    async def rpc_commit(
        self, flow_id: str, version: int | None, locks: Sequence[str], writes: WriteSet,
        next_steps: Sequence[MovementRecord], canceling: Sequence[str], flow_type: str | None = None,
        ending: RetryWaitEnding | None = None, started_ms: int | None = None,
    ) -> None:
        """`started_ms`: the flow's created_at the snapshot read (RpcSnapshot.started_ms), checked with
        `version` so that a flow deleted and started again at that version is not taken for it."""

        def op(db: Db) -> None:
            tx.rpc_commit(db, flow_id, version, locks, writes, next_steps, canceling, now_ms(), flow_type, ending,
                          started_ms)

        if canceling:  # an ending revokes nothing (it ends no running attempt), so it may hand off
            # It may revoke running attempts: the worker must be woken to see that (E9).
            await self._run(op, write=True)
        else:
            await self._run_handing_off(op)

    # `flow_type`, when given, is the type the caller checked the names against: another one stored
    # (the ID deleted and started again) raises FlowTypeChanged, reading and writing nothing.

    async def publish(self, flow_id: str, channel: str, key: str, value: bytes, flow_type: str | None = None) -> int:
        return await self._run_handing_off(
            lambda db: tx.publish(db, flow_id, channel, key, value, now_ms(), flow_type))

    async def read_attribute(self, flow_id: str, name: str, key: str, flow_type: str | None = None) -> bytes | None:
        return await self._run(lambda db: tx.read_attribute(db, flow_id, name, key, flow_type), write=False)

    async def read_attribute_map(self, flow_id: str, name: str, flow_type: str | None = None) -> dict[str, bytes]:
        return await self._run(lambda db: tx.read_attribute_map(db, flow_id, name, flow_type), write=False)

    async def read_all_attributes(self, flow_id: str) -> dict[tuple[str, str], bytes]:
        return await self._run(lambda db: tx.read_all_attributes(db, flow_id), write=False)

    async def read_events(self, flow_id: str, stream: str, after: int, limit: int,
                          flow_type: str | None = None) -> EventPage:
        return await self._run(lambda db: tx.read_events(db, flow_id, stream, after, limit, flow_type), write=False)

    async def newest_sequences(self, keys: Sequence[tuple[str, str]]) -> list[tuple[int, int] | None]:
        """The newest sequence (0: no event) of each (flow ID, stream) in `keys`, in their order, with
        the flow's start (ms); None for a flow closed or gone."""
        return await self._run(lambda db: tx.newest_sequences(db, keys), write=False)

    async def stream_names(self, flow_id: str) -> list[str]:
        """Names of the flow's streams that ever received an event."""
        return await self._run(lambda db: tx.stream_names(db, flow_id), write=False)

    async def stream_secret(self) -> bytes:
        """The database's key for signing stream resume tokens."""
        return await self._run(_secret, write=False)

    async def raw(self, fn: Callable[[Db], Any], *, write: bool = False) -> Any:
        """Run `fn` in one transaction (tests and the CLI)."""
        return await self._run(fn, write=write)


def _secret(db: Db) -> bytes:
    row = db.one("SELECT value FROM meta WHERE key = 'stream_token_secret'")
    assert row is not None, "the database has no stream token secret; was it migrated?"
    return bytes.fromhex(str(row[0]))
