"""AsyncClient and the blocking Client: start flows, call RPCs, publish, read state and streams."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import math
import os
import queue
import re
import sys
import threading
import time
import warnings
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Generator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, cast, get_args

from ._codec import decode_value, encode_value
from ._context import RpcContext
from ._decision import RPCResult
from ._errors import (
    DexError,
    FlowNotFoundError,
    InvalidValueError,
    RpcContentionError,
    RpcNotFoundError,
    StepNotWaitingError,
    UndeclaredNameError,
    shown,
)
from ._flow import Flow, Registry, Rpc
from ._ids import check_id
from ._limits import (
    CLIENT_FLOW_TYPE_CACHE_ENTRIES,
    CLIENT_SIGNAL_CHECK_SECONDS,
    DEFAULT_READ_LIMIT,
    MAX_READ_LIMIT,
    MAX_RPC_TRIES,
    MAX_STREAM_WAIT_SECONDS,
    RPC_LOCKED_AFTER_LOST_RACES,
    RPC_LOCKED_LOOP_WAIT_SECONDS,
    RPC_LOCKED_YIELDS,
    STREAM_WATCH_SECONDS,
)
from ._open import open_store, shown_url
from ._options import FlowConfig, LoadSpec, is_number
from ._records import (
    FlowInfo,
    FlowStatus,
    HistoryEntry,
    MovementRecord,
    RetryWaitEnding,
    RpcOutcome,
    RpcSnapshot,
    StartRequest,
)
from ._scheduling import movement_record, start_record
from ._schema import AttributeMap, AttributeRef, ChannelRef, Stream
from ._store import Store
from ._tokens import check_incarnation, check_not_rewound, event_digest, make_token, read_token
from ._transitions import FlowTypeChanged, RpcVersionChanged

T = TypeVar("T")
R = TypeVar("R")
N = TypeVar("N")  # what a name lookup found (an Rpc, a Stream; None for a check)


@dataclass(frozen=True)
class StreamEvent:
    """One stream event: its sequence, the Step execution and attempt that wrote it, its value."""

    sequence: int
    step_execution_id: str
    attempt: int
    value: Any


@dataclass(frozen=True)
class StreamRead:
    events: list[StreamEvent]
    resume_token: str  # pass it to the next read to get the events after these
    trimmed: bool  # events between the token and the first returned were trimmed (capacity)
    # The flow was closed (completed, failed or stopped) when read: its stream takes no more events,
    # so once a read returns none, there are none to wait for.
    flow_closed: bool


class SearchQueryError(DexError, ValueError):
    """A search_flows query that does not parse."""


_TERM = re.compile(r'\s*(FlowType|FlowStatus|ActiveStepTypes)\s*=\s*"([^"]*)"\s*')
# The values FlowStatus takes, read from its Literal so the two cannot drift apart.
_FLOW_STATUSES: tuple[str, ...] = get_args(FlowStatus)
# Between terms. Matched after a whole term, never split on first: a quoted name may hold "AND".
_AND = re.compile(r"AND\b")


def parse_search(query: str) -> dict[str, str]:
    """`FlowType = "X" AND FlowStatus = "running" AND ActiveStepTypes = "Y"` (each optional)."""
    terms: dict[str, str] = {}
    given: object = query
    if not isinstance(given, str):
        raise SearchQueryError(f"search query must be text, got {type(given).__name__}: {shown(given)}")
    if not query.strip():
        return terms
    at = 0
    while True:
        term = _TERM.match(query, at)
        if term is None:
            raise _unparsed(query, at)
        if term.group(1) in terms:
            raise SearchQueryError(f"{term.group(1)} appears twice in search query {query!r}")
        terms[term.group(1)] = _term_value(query, term.group(1), term.group(2))
        at = term.end()
        if at == len(query):
            return terms
        joint = _AND.match(query, at)
        if joint is None:
            raise _unparsed(query, at)
        at = joint.end()


def _term_value(query: str, name: str, value: str) -> str:
    """`value`, checked when `name` has a closed set of values: a misspelt status matched nothing."""
    if name == "FlowStatus" and value not in _FLOW_STATUSES:
        raise SearchQueryError(
            f"FlowStatus {value!r} in search query {query!r} is not a flow status; use one of "
            + ", ".join(f'"{status}"' for status in _FLOW_STATUSES)
        )
    return value


def _unparsed(query: str, at: int) -> SearchQueryError:
    return SearchQueryError(
        f"cannot parse {query[at:].strip()!r} in search query {query!r}; use "
        'FlowType = "...", FlowStatus = "...", ActiveStepTypes = "..." joined with AND'
    )


def known_flow_id(flow_id: object) -> str:
    """`flow_id`, to look up; FlowNotFoundError for one with a character no flow ID has (start_flow
    refuses control characters), among them two a database cannot even be asked about: NUL, which
    PostgreSQL's text cannot hold, and a lone surrogate, which has no UTF-8 encoding. One that is not
    a str gets the InvalidIdError start_flow gives it, naming its type."""
    if not isinstance(flow_id, str):
        return check_id("flow ID", flow_id)  # raises for any value that is not a str
    if not flow_id.isprintable():
        raise FlowNotFoundError(flow_id)
    return flow_id


@dataclass(frozen=True)
class _RpcCall:
    """One RPC call: its flow, handler and request (decoded into the declared type)."""

    flow: Flow
    flow_id: str
    handler: Rpc
    request: Any


class _Ready(Generic[R]):
    """An awaitable that computes its value when awaited, never suspending: what a stepped handler
    (AsyncClient._stepped) awaits for `ctx.load`."""

    def __init__(self, compute: Callable[[], R]) -> None:
        self._compute = compute

    def __await__(self) -> Generator[Any, None, R]:
        return self._compute()
        yield  # type: ignore[unreachable]  # a generator that returns before its first yield


def _retrieved(future: asyncio.Future[Any]) -> None:
    """Mark `future`'s error as seen, so that the loop does not log it as never retrieved."""
    if not future.cancelled():
        future.exception()


def _on_loop(
    loop: asyncio.AbstractEventLoop,
    loop_thread: int,
    run: Callable[[Callable[[LoadSpec], dict[tuple[str, str], bytes]]], RpcOutcome | None],
    load: Callable[[LoadSpec], dict[tuple[str, str], bytes]],
) -> RpcOutcome | None:
    """`run(load)` on `loop`'s thread, from a transaction on the store's thread (or inline on that
    loop): the handler belongs to its caller's loop, as in every usual run, and is not made to run
    on a thread beside it. `load` reads in the transaction, so it runs on the calling thread: the
    loop's thread asks for it and waits, while this thread waits for the loop and does its loads.
    None when the loop has not run `run` within RPC_LOCKED_LOOP_WAIT_SECONDS (blocked, or closed):
    the transaction holds the flow's write lock meanwhile."""
    # Store.rpc_locked runs its transaction off the loop (inline=False): from the loop's own thread,
    # the wait below would wait for itself.
    assert threading.get_ident() != loop_thread, "rpc_locked ran its transaction on the caller's event loop"
    asks: queue.SimpleQueue[tuple[LoadSpec, concurrent.futures.Future[dict[tuple[str, str], bytes]]]
                            | tuple[None, RpcOutcome | None]] = queue.SimpleQueue()
    lock = threading.Lock()
    abandoned = False

    def load_here(spec: LoadSpec) -> dict[tuple[str, str], bytes]:
        answer: concurrent.futures.Future[dict[tuple[str, str], bytes]] = concurrent.futures.Future()
        with lock:
            if abandoned:
                raise RuntimeError("the RPC's transaction stopped waiting for its event loop")
            asks.put((spec, answer))
        return answer.result()

    def on_loop() -> None:
        with lock:
            if abandoned:
                return
        outcome = None
        try:
            outcome = run(load_here)
        finally:
            asks.put((None, outcome))

    try:
        loop.call_soon_threadsafe(on_loop)
    except RuntimeError:
        return None  # the loop is closed
    deadline = time.monotonic() + RPC_LOCKED_LOOP_WAIT_SECONDS
    try:
        while True:
            try:
                spec, reply = asks.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return None
            if spec is None:
                return cast("RpcOutcome | None", reply)
            answer = cast("concurrent.futures.Future[dict[tuple[str, str], bytes]]", reply)
            try:
                answer.set_result(load(spec))
            except BaseException as exc:
                answer.set_exception(exc)
                raise
    finally:
        with lock:
            abandoned = True
        while True:  # a load asked just before: its asker must not wait for ever
            try:
                spec, reply = asks.get_nowait()
            except queue.Empty:
                break
            if spec is not None:
                cast("concurrent.futures.Future[Any]", reply).set_exception(
                    RuntimeError("the RPC's transaction stopped waiting for its event loop"))


@dataclass
class _Turn:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0  # RPCs holding or waiting for it; the turn is dropped when the last one leaves


class _RpcTurns:
    """Lets one client's RPCs on a flow retry one at a time.

    Every try of an RPC reads the flow's version and commits only if it is unchanged (E8). Concurrent
    RPCs of one client on one flow read the same version, so each round only one of them commits: n
    of them take up to n rounds, and with more than MAX_RPC_TRIES the rest failed with
    RpcContentionError. So an RPC that lost a race retries in its flow's turn, and an RPC that would
    write while the turn is taken (read a snapshot, or commit a blind run) waits for the turn instead.
    The holder then loses to this client at most once to a snapshot read before the turn was taken,
    and once to each blind commit already under way; otherwise only to writers outside this client
    (Steps, publishes, other clients and processes). An uncontended RPC never takes the turn: it
    costs a dict lookup.

    Keyed by event loop too: an asyncio.Lock belongs to one loop, and a client may be used from
    several. A turn lives only while an RPC holds or waits for it, so the table stays small. The
    holder's handler may call RPCs on the same flow itself: those run as if the turn were free (it
    is theirs), where waiting for it would wait for ever.
    """

    def __init__(self) -> None:
        self._turns: dict[tuple[asyncio.AbstractEventLoop, str], _Turn] = {}
        # The turns the running code holds: set in the holder's context, seen by what its handler calls.
        self._held: contextvars.ContextVar[frozenset[tuple[asyncio.AbstractEventLoop, str]]] = (
            contextvars.ContextVar("dex_rpc_turns_held", default=frozenset()))

    def taken(self, flow_id: str) -> bool:
        key = (asyncio.get_running_loop(), flow_id)
        return key in self._turns and key not in self._held.get()

    @asynccontextmanager
    async def turn(self, flow_id: str) -> AsyncIterator[None]:
        key = (asyncio.get_running_loop(), flow_id)
        held = self._held.get()
        if key in held:
            yield  # an RPC its holder's handler makes: the turn is already this code's
            return
        turn = self._turns.get(key)
        if turn is None:
            turn = self._turns[key] = _Turn()
        turn.users += 1
        try:
            async with turn.lock:
                token = self._held.set(held | {key})
                try:
                    yield
                finally:
                    self._held.reset(token)
        finally:
            turn.users -= 1
            if turn.users == 0:
                del self._turns[key]


class _StreamWatch:
    """The long-polling stream readers of one client on one event loop, and the one task that
    watches their streams for them.

    A reader that found no event registers (flow, stream, sequence it read up to, the flow's start)
    and waits. While any reader waits, every STREAM_WATCH_SECONDS the task reads the newest
    sequence of every watched stream and its flow's start in one operation
    (Store.newest_sequences) and wakes the readers whose stream went past theirs, or whose flow
    closed, was deleted, or was started again, which then read their events themselves: n idle
    readers cost one statement a tick, not n reads. When that operation fails, it wakes every
    reader, whose own read meets the error. The task ends once no reader waits.
    """

    def __init__(self, store: Store) -> None:
        self._store = store
        self._waiting: dict[asyncio.Future[None], tuple[str, str, int, int]] = {}
        self.task: asyncio.Task[None] | None = None

    async def wait(self, flow_id: str, stream: str, after: int, started_ms: int, timeout: float) -> None:
        """Until `stream` of `flow_id` (the flow started at `started_ms`) has an event after sequence
        `after`, the flow is no longer that running flow, the watcher's read failed, or `timeout`
        seconds passed."""
        woken: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting[woken] = (flow_id, stream, after, started_ms)
        if self.task is None:
            self.task = asyncio.create_task(self._watch(), name="dex-stream-watch")
        try:
            await asyncio.wait((woken,), timeout=timeout)
        finally:
            del self._waiting[woken]

    async def close(self) -> None:
        """End the task and wake every waiting reader."""
        if self.task is not None:
            self.task.cancel()
            await asyncio.wait((self.task,))  # raises nothing: a caller's own cancellation still does
        for woken in self._waiting:
            if not woken.done():
                woken.set_result(None)

    async def _watch(self) -> None:
        try:
            while True:
                await asyncio.sleep(STREAM_WATCH_SECONDS)
                if not self._waiting:
                    return
                waiting = list(self._waiting.items())
                keys = list(dict.fromkeys((flow_id, stream) for flow_id, stream, _, _ in self._waiting.values()))
                try:
                    newest = dict(zip(keys, await self._store.newest_sequences(keys), strict=True))
                except Exception:
                    # Each reader reads again and meets the error itself (or reads on, if it passed).
                    newest = None
                for woken, (flow_id, stream, after, started_ms) in waiting:
                    # Also woken when its flow closed (None: no event can come), or was deleted and
                    # maybe started again: its own read then returns flow_closed, or raises
                    # FlowNotFoundError or InvalidResumeTokenError, now, not once its wait ran out.
                    if not woken.done() and (newest is None or newest[flow_id, stream] != (after, started_ms)):
                        woken.set_result(None)
        finally:
            # Set when it ends however it ends (cancelled by close too): a reader that comes later
            # starts a new one.
            if self.task is asyncio.current_task():
                self.task = None


def _close_dropped_store(store: Store, pid: int, url: str) -> None:
    """Close the store of an AsyncClient collected unclosed. Without waiting: the collection may run
    on one of the store's own threads, or where no event loop runs."""
    if os.getpid() != pid:
        return  # a fork's copy: the store's threads and connections are the parent's
    store.close_nowait()
    # Last: under -W error the warning raises, and the store must be closed all the same.
    warnings.warn(f"an AsyncClient of {url!r} was never closed; await its close(), or use it in an async with "
                  "block", ResourceWarning, stacklevel=2)


class AsyncClient:
    """Talks to one database on behalf of the Registry's Flows. RPC handlers run in this process."""

    def __init__(self, registry: Registry, database_url: str | None = None, *, store: Store | None = None) -> None:
        _check_registry("AsyncClient", registry)
        if (database_url is None) == (store is None):
            raise ValueError(f"AsyncClient takes exactly one of database_url and store, got "
                             f"{'neither' if store is None else 'both'}; give the URL to have the client "
                             "open (and close) its own store, or a store you opened and close")
        self.registry = registry
        self._store = store if store is not None else open_store(database_url or "")
        self._owns_store = store is None
        self._secret: bytes | None = None
        # Flow type by flow ID: a flow's type never changes, so one lookup per flow serves every
        # later call. A flow deleted (delete_flow, retention) and started again under its ID may
        # have another type, and another client may have done it: so each call hands the remembered
        # type to the transaction that reads the flow row anyway, which refuses another
        # (FlowTypeChanged), and a name the remembered type does not declare is checked again
        # against the stored one (_by_stored_type). Bounded: cleared when full.
        self._flow_types: dict[str, str] = {}
        self._rpc_turns = _RpcTurns()
        # Long-polling stream readers, by event loop (a client may be used from several).
        # Weak keys: a loop that closed (asyncio.run after asyncio.run) leaves no entry behind.
        self._stream_watches: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _StreamWatch] = (
            weakref.WeakKeyDictionary())
        # A client dropped unclosed (one per web request, say) kept its store's threads and, on
        # PostgreSQL, its connections until the process exited: the threads keep the store alive,
        # so only the client's collection can tell. A store the caller gave is the caller's to close;
        # and nothing runs at exit, as for the blocking Client.
        self._dropped: weakref.finalize[[Store, int, str], AsyncClient] | None = None
        if self._owns_store:
            self._dropped = weakref.finalize(self, _close_dropped_store, self._store, os.getpid(),
                                             shown_url(database_url or ""))
            self._dropped.atexit = False

    @property
    def store(self) -> Store:
        return self._store

    async def close(self) -> None:
        if self._dropped is not None:
            self._dropped.detach()
        # The watcher must not outlive the client (an event loop stopped after close would find it
        # pending); readers still waiting read again, and meet the closed store's error.
        watch = self._stream_watches.pop(asyncio.get_running_loop(), None)
        if watch is not None:
            await watch.close()
        if self._owns_store:
            await self._store.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start_flow(
        self, flow_type: str, flow_id: str, input: Any = None, *, config_override: FlowConfig | None = None
    ) -> None:
        """Start a flow; raises FlowAlreadyStartedError when the ID exists."""
        flow = self.registry.flow(flow_type)
        check_id("flow ID", flow_id)
        config = FlowConfig() if config_override is None else _flow_config("config_override", config_override)
        await self._store.start_flow(StartRequest(
            flow_id=flow_id, flow_type=flow_type, input=encode_value("flow input", Any, input),
            config=config, start=start_record(flow, input),
        ))
        self._remember_flow_type(flow_id, flow_type)

    def _remember_flow_type(self, flow_id: str, flow_type: str) -> None:
        # A client that starts flows for days must not keep every ID: clearing is cheap, a miss is one read.
        if len(self._flow_types) >= CLIENT_FLOW_TYPE_CACHE_ENTRIES:
            self._flow_types.clear()
        self._flow_types[flow_id] = flow_type

    async def _flow_of(self, flow_id: str) -> Flow:
        flow_type = self._flow_types.get(known_flow_id(flow_id))  # checked first: an unhashable ID is no key
        if flow_type is None:
            flow_type = (await self._store.describe_flow(flow_id)).flow_type
            self._remember_flow_type(flow_id, flow_type)
        return self.registry.flow(flow_type)

    async def _by_stored_type(
        self, flow_id: str, lookup: Callable[[Flow], N], call: Callable[[Flow, N], Awaitable[R]],
    ) -> R:
        """`call(flow, lookup(flow))`, with the flow's Flow looked up by the type this client
        remembers, and `lookup` its check of the name the caller gave (an RPC, channel, attribute or
        stream). By the stored type when the flow's ID was deleted and started again with another
        one since: when the transaction saw it (FlowTypeChanged, raised before anything is written or
        returned), or when the remembered type does not declare the name (the type is read once
        more: a name the caller got wrong costs a read, a common call none)."""
        while True:
            remembered = self._flow_types.get(known_flow_id(flow_id)) is not None  # checked first: see _flow_of
            flow = await self._flow_of(flow_id)
            try:
                found = lookup(flow)
            except (UndeclaredNameError, RpcNotFoundError):
                if not remembered:
                    raise  # checked against the stored type
                self._flow_types.pop(flow_id, None)
                continue
            try:
                return await call(flow, found)
            except FlowTypeChanged:
                # Out here, not where it was seen: an RPC may hold the flow's turn, which is not reentrant.
                self._flow_types.pop(flow_id, None)

    async def rpc(self, flow_id: str, name: str, request: Any = None) -> Any:
        """Run RPC `name` on a flow in one transaction (E8); returns its output.

        A handler that raises commits nothing; its error reaches the caller.
        """
        # Never a handler of another type: a snapshot's or commit's type is checked.
        return await self._by_stored_type(flow_id, lambda flow: flow.rpc(name),
                                          lambda flow, handler: self._rpc(flow, flow_id, handler, request))

    async def _rpc(self, flow: Flow, flow_id: str, handler: Rpc, request: Any) -> Any:
        name = handler.name
        label = f"request of RPC {name}"
        data = encode_value(label, handler.request_type, request)
        if handler.request_type is not Any:
            # The handler sees the request as a worker would after a network hop: decoded into the
            # declared type, so a dict shaped like the request arrives as the request, never as a dict.
            request = decode_value(label, handler.request_type, data)
        return await self._run_rpc(_RpcCall(flow, flow_id, handler, request))

    async def _run_rpc(self, call: _RpcCall) -> Any:
        """First optimistically; after a lost race, or while another RPC of this client holds the
        flow's turn, in that turn (_RpcTurns). The handler runs at most 1 + MAX_RPC_TRIES times:
        once with no snapshot (_rpc_blind), then on snapshots."""
        blind = await self._rpc_blind(call)
        turns = self._rpc_turns
        tries = MAX_RPC_TRIES
        if not turns.taken(call.flow_id):  # checked after the blind run's awaits, right before writing
            if blind is not None:
                return await self._rpc_commit_blind(call, blind)
            settled, output = await self._rpc_on_snapshot(call)
            if settled:
                return output
            tries -= 1
        # Racing the turn's holder could make it lose again and again: queue behind it instead.
        async with turns.turn(call.flow_id):
            if blind is not None:
                return await self._rpc_commit_blind(call, blind)
            return await self._rpc_snapshots(call, tries)

    async def _rpc_blind(self, call: _RpcCall) -> RpcOutcome | None:
        """The outcome of a handler that loads nothing and reads no pending message: it decides from
        its request alone, so its writes need no snapshot to be checked against and commit in one
        transaction with no read before. None for any other handler, and when it raises or writes
        nothing: it then runs on a snapshot, where its error (or a missing flow) is reported as usual."""
        handler = call.handler
        if handler.load.mode != "none" or handler.locks:
            return None
        ctx = RpcContext(call.flow, call.flow_id, {}, handler.load, {}, handler.name)
        try:
            output, records, canceling, ending = await self._handled(call, ctx)
        except Exception:
            return None
        if ctx.pending_read or (ctx.writes.empty() and not records and not canceling and ending is None):
            return None
        return RpcOutcome(output, ctx.writes, records, canceling, ending)

    async def _rpc_commit_blind(self, call: _RpcCall, blind: RpcOutcome) -> Any:
        await self._store.rpc_commit(call.flow_id, None, call.handler.locks, blind.writes, blind.records,
                                     blind.canceling, call.flow.flow_type, blind.ending)
        return blind.output

    async def _rpc_snapshots(self, call: _RpcCall, tries: int) -> Any:
        """Up to `tries` tries on snapshots; RpcContentionError when the flow changed under each.

        The flow's turn orders only this client's RPCs: those of other clients and processes, and
        Steps, race it, and some RPC lost 64 races in a row to five other clients' bursts. So once
        it lost RPC_LOCKED_AFTER_LOST_RACES races, a try runs its handler inside the transaction
        that holds the flow's write lock (_rpc_locked), which nothing can overtake; only a handler
        that waits for something a transaction cannot wait for goes on racing."""
        lost = MAX_RPC_TRIES - tries  # one before the turn was taken
        lockable = True
        for _ in range(tries):
            if lockable and lost >= RPC_LOCKED_AFTER_LOST_RACES:
                settled, output = await self._rpc_locked(call)
                lockable = settled
            else:
                settled, output = await self._rpc_on_snapshot(call)
            if settled:
                return output
            lost += 1
        raise RpcContentionError(
            f"RPC {call.handler.name!r} on flow {call.flow_id!r} saw the flow change on each of {MAX_RPC_TRIES} "
            "tries (other writers to it: workers, other clients or processes), and no try could run it under the "
            "flow's write lock (its handler awaited something other than ctx.load, or its event loop was blocked); "
            "nothing committed, call it again, or make the handler await only ctx.load"
        )

    async def _rpc_on_snapshot(self, call: _RpcCall) -> tuple[bool, Any]:
        """One try on a snapshot: (True, output) once it committed or wrote nothing, (False, None)
        when the flow changed while it was read or before its commit."""
        handler = call.handler
        try:
            snap = await self._store.rpc_read(call.flow_id, handler.load, handler.locks)
        except RpcVersionChanged:
            return False, None  # the flow changed while it was read: no snapshot to run on
        if snap.flow_type != call.flow.flow_type:
            raise FlowTypeChanged(snap.flow_type)
        version = snap.version

        def load_more(spec: LoadSpec) -> Awaitable[dict[tuple[str, str], bytes]]:
            return self._store.rpc_load(call.flow_id, version, spec, snap.started_ms)

        ctx = RpcContext(call.flow, call.flow_id, snap.attributes, handler.load, snap.pending, handler.name,
                         snap.in_flight, load_more)
        try:
            output, records, canceling, ending = await self._handled(call, ctx)
        except RpcVersionChanged:
            return False, None  # ctx.load found the flow changed since the snapshot: run again on a new one
        if ctx.writes.empty() and not records and not canceling and ending is None:
            return True, output
        try:
            await self._store.rpc_commit(call.flow_id, snap.version, handler.locks, ctx.writes, records, canceling,
                                         ending=ending, started_ms=snap.started_ms)
        except RpcVersionChanged:
            return False, None
        return True, output

    async def _rpc_locked(self, call: _RpcCall) -> tuple[bool, Any]:
        """One try that cannot lose a race (Store.rpc_locked): (True, output) once it committed or
        wrote nothing; (False, None) when the handler did not finish without waiting (see
        _stepped), having committed nothing."""
        loop, loop_thread = asyncio.get_running_loop(), threading.get_ident()
        context = contextvars.copy_context()  # the caller's, as a usual run of the handler has
        handler = call.handler

        def decide(snap: RpcSnapshot, load: Callable[[LoadSpec], dict[tuple[str, str], bytes]]) -> RpcOutcome | None:
            if snap.flow_type != call.flow.flow_type:
                raise FlowTypeChanged(snap.flow_type)  # before anything is written
            return _on_loop(loop, loop_thread, lambda load_here: self._stepped(call, snap, load_here, context), load)

        outcome = await self._store.rpc_locked(call.flow_id, handler.load, handler.locks, decide)
        return (False, None) if outcome is None else (True, outcome.output)

    def _stepped(
        self, call: _RpcCall, snap: RpcSnapshot, load: Callable[[LoadSpec], dict[tuple[str, str], bytes]],
        context: contextvars.Context,
    ) -> RpcOutcome | None:
        """The handler run to its end on `snap` without an event loop's help, inside a transaction
        that cannot wait for the loop: its coroutine is stepped, not awaited, and `ctx.load` reads at
        once. None when it waits for anything else (a future: I/O, a lock, a timer), yields more than
        RPC_LOCKED_YIELDS times (`asyncio.sleep(0)` yields and wants only to be resumed), or raises:
        a usual run on a snapshot then raises the same error to the caller."""
        handler = call.handler
        ctx = RpcContext(call.flow, call.flow_id, snap.attributes, handler.load, snap.pending, handler.name,
                         snap.in_flight, lambda spec: _Ready(lambda: load(spec)))
        try:
            running = cast("Coroutine[Any, Any, Any]", handler.handler(ctx, call.request))
            try:
                awaited = None
                for _ in range(RPC_LOCKED_YIELDS + 1):
                    awaited = context.run(running.send, None)
                    if awaited is not None:
                        break  # a future: only the loop can wait for it
                context.run(running.close)
                if isinstance(awaited, asyncio.Future):
                    # Its outcome is the abandoned run's, which nothing awaits now: left alone, that of
                    # `asyncio.gather(ctx.load(a), ctx.load(b))` (its tasks' ctx.load run after the run
                    # ended) made the loop log "_GatheringFuture exception was never retrieved" with a
                    # StaleAttemptError for a handler that did nothing wrong. Not cancelled: what set
                    # it is not the engine's, and may not expect that.
                    awaited.add_done_callback(_retrieved)
                return None
            except StopIteration as done:
                result = done.value
            output, records, canceling, ending = self._rpc_outcome(call.flow, result)
            return RpcOutcome(output, ctx.writes, records, canceling, ending)
        except KeyboardInterrupt:
            raise
        except BaseException:
            # Its own CancelledError too: stepped, not awaited, nothing cancelled it.
            return None
        finally:
            ctx.close(f"RPC {handler.name!r} on flow {call.flow_id!r} returned")

    async def _handled(
        self, call: _RpcCall, ctx: RpcContext
    ) -> tuple[Any, list[MovementRecord], tuple[str, ...], RetryWaitEnding | None]:
        """One run of the handler on `ctx`, which then refuses writes: a task the handler left
        holding it would otherwise write into a commit that has already happened."""
        try:
            return self._rpc_outcome(call.flow, await call.handler.handler(ctx, call.request))
        finally:
            ctx.close(f"RPC {call.handler.name!r} on flow {call.flow_id!r} returned")

    @staticmethod
    def _rpc_outcome(
        flow: Flow, result: Any
    ) -> tuple[Any, list[MovementRecord], tuple[str, ...], RetryWaitEnding | None]:
        """An RPC handler's output, the Steps it starts (stored form), the Step types it cancels and
        the retry waits it ends."""
        ending = None
        if isinstance(result, RPCResult):
            output, next_steps, canceling = result.output, result.next_steps, tuple(result.canceling_steps)
            if result.ending_retry_waits:
                ending = RetryWaitEnding(tuple(result.ending_retry_waits), result.ending_reason)
        else:
            output, next_steps, canceling = result, (), ()
        for step_type in (*canceling, *(() if ending is None else ending.step_types)):
            flow.step(step_type)
        return output, [movement_record(flow, m) for m in next_steps], canceling, ending

    async def publish(self, flow_id: str, channel: ChannelRef[T], value: T) -> int:
        """Queue a message on a flow's channel; returns its message ID."""
        _check_ref("channel", channel, ChannelRef, "pass the Channel (or ChannelMap[key]) the Flow declares")
        data = encode_value(channel.label, channel.value_type, value)
        return await self._by_stored_type(
            flow_id, lambda flow: flow.check_channel(channel),
            lambda flow, _: self._store.publish(flow_id, channel.name, channel.key, data, flow.flow_type))

    async def get_attribute(self, flow_id: str, ref: AttributeRef[T]) -> T | None:
        _check_ref("ref", ref, AttributeRef, "pass the Attribute (or AttributeMap[key]) the Flow declares")
        data = await self._by_stored_type(
            flow_id, lambda flow: flow.check_attribute(ref),
            lambda flow, _: self._store.read_attribute(flow_id, ref.name, ref.key, flow.flow_type))
        return None if data is None else decode_value(ref.label, ref.value_type, data)

    async def get_attribute_map(self, flow_id: str, amap: AttributeMap[T]) -> dict[str, T]:
        _check_ref("amap", amap, AttributeMap, "pass the AttributeMap the Flow declares")
        rows = await self._by_stored_type(
            flow_id, lambda flow: flow.check_attribute(amap["?"]),
            lambda flow, _: self._store.read_attribute_map(flow_id, amap.name, flow.flow_type))
        return {k: decode_value(amap.name, amap.value_type, v, k) for k, v in rows.items()}

    async def read_stream(
        self, flow_id: str, stream: Stream[T] | str, resume_token: str | None = None, *,
        wait_seconds: float = 0.0, limit: int = DEFAULT_READ_LIMIT,
    ) -> StreamRead:
        """Events after `resume_token` (from the start when None), long-polling up to `wait_seconds`."""
        if not (is_number(wait_seconds) and 0 <= wait_seconds <= MAX_STREAM_WAIT_SECONDS):
            raise ValueError(
                f"wait_seconds must be between 0 and {MAX_STREAM_WAIT_SECONDS}, got {shown(wait_seconds, None)}")
        _check_limit(limit)
        if not isinstance(stream, str):
            _check_ref("stream", stream, Stream, "pass the Stream the Flow declares, or its name")
        return await self._by_stored_type(
            flow_id, lambda flow: flow.check_stream(stream),
            lambda flow, declared: self._read_stream(flow, flow_id, declared, resume_token, wait_seconds, limit))

    async def _read_stream(
        self, flow: Flow, flow_id: str, declared: Stream[Any], resume_token: str | None, wait_seconds: float,
        limit: int,
    ) -> StreamRead:
        if self._secret is None:
            self._secret = await self._store.stream_secret()
        position = None if resume_token is None else read_token(self._secret, resume_token, flow_id, declared.name)
        after = 0 if position is None else position.sequence
        deadline = time.monotonic() + wait_seconds
        while True:
            page = await self._store.read_events(flow_id, declared.name, after, limit, flow.flow_type)
            if position is not None:
                # Each page: the flow may be deleted and started again while this reader waits, or
                # the database crash and lose the events this reader saw last.
                check_incarnation(position, flow_id, page.flow_started_ms)
                check_not_rewound(position, flow_id, declared.name, page)
            if page.events or page.flow_closed or time.monotonic() >= deadline:
                break
            await self._stream_watch().wait(flow_id, declared.name, after, page.flow_started_ms,
                                            max(0.0, deadline - time.monotonic()))
        events = [
            StreamEvent(e.sequence, e.step_execution_id, e.attempt,
                        decode_value(declared.name, declared.value_type, e.value))
            for e in page.events
        ]
        last = events[-1].sequence if events else max(after, page.next_sequence - 1)
        trimmed = bool(events) and events[0].sequence > after + 1
        if page.events:
            digest: str | None = event_digest(page.events[-1])
        else:  # the same position (its event checked above), or past trimmed ones, where none is kept
            digest = position.digest if position is not None and last == after else None
        token = make_token(self._secret, flow_id, declared.name, last, page.flow_started_ms, digest)
        return StreamRead(events, token, trimmed, page.flow_closed)

    def _stream_watch(self) -> _StreamWatch:
        loop = asyncio.get_running_loop()
        watch = self._stream_watches.get(loop)
        if watch is None:
            watch = self._stream_watches[loop] = _StreamWatch(self._store)
        return watch

    async def stop_flow(self, flow_id: str, reason: str = "") -> None:
        given: object = reason  # typed str; checked for callers that pass anything (None, 0, b"")
        if not isinstance(given, str):
            raise InvalidValueError(f"stop_flow's reason must be a str, got {type(given).__name__}: "
                                    f"{shown(given, 200)}; "
                                    "give it as text")
        await self._store.stop_flow(known_flow_id(flow_id), reason)

    async def delete_flow(self, flow_id: str) -> bool:
        """Delete a closed (completed, failed or stopped) flow and everything stored of it, in one
        transaction; returns False when there is no such flow. A running flow is refused with
        FlowStillRunningError, deleting nothing: stop it first (stop_flow). Afterwards the flow ID is
        unknown everywhere, and start_flow may use it again for a new flow."""
        try:
            flow_id = known_flow_id(flow_id)
        except FlowNotFoundError:
            return False  # no flow has such an ID
        deleted = await self._store.delete_flow(flow_id)
        self._flow_types.pop(flow_id, None)
        return deleted

    async def skip_timer(self, flow_id: str, step_execution_id: str) -> None:
        """Fire the pending timers of a waiting Step execution now (E6)."""
        flow_id = known_flow_id(flow_id)
        checked: object = step_execution_id
        if not isinstance(checked, str):
            check_id("step execution ID", checked)  # raises, naming the type
        if not step_execution_id.isprintable():  # no Step execution ID has such a character (see known_flow_id)
            raise StepNotWaitingError(flow_id, step_execution_id)
        await self._store.skip_timer(flow_id, step_execution_id)

    async def update_flow_config(self, flow_id: str, config: FlowConfig) -> None:
        await self._store.update_flow_config(known_flow_id(flow_id), _flow_config("config", config))

    async def describe_flow(self, flow_id: str) -> FlowInfo:
        return await self._store.describe_flow(known_flow_id(flow_id))

    async def search_flows(self, query: str, limit: int = DEFAULT_READ_LIMIT) -> list[str]:
        """Flow IDs matching e.g. 'ActiveStepTypes = "AwaitToolApproval" AND FlowType = "Agent"'."""
        _check_limit(limit)
        terms = parse_search(query)
        if not all(value.isprintable() for value in terms.values()):
            return []  # no name has such a character (see known_flow_id), and a database may refuse it
        return await self._store.search_flows(
            flow_type=terms.get("FlowType"), status=terms.get("FlowStatus"),
            active_step=terms.get("ActiveStepTypes"), limit=limit,
        )

    async def get_flow_history(self, flow_id: str) -> list[HistoryEntry]:
        return await self._store.history(known_flow_id(flow_id))

    async def wait_for_flow(self, flow_id: str, timeout_seconds: float = 60.0) -> FlowInfo:
        """Poll until the flow is closed (`timeout_seconds` may be math.inf); raises TimeoutError with
        its active Steps otherwise."""
        if not (is_number(timeout_seconds) and timeout_seconds >= 0):  # NaN too: it never times out
            raise ValueError(f"timeout_seconds must be a number of seconds >= 0, got {shown(timeout_seconds, None)}")
        flow_id = known_flow_id(flow_id)
        # An int too large for a float (10**400) waits for ever, as math.inf does: added as it is, it
        # raised OverflowError.
        deadline = time.monotonic() + (math.inf if timeout_seconds > sys.float_info.max else timeout_seconds)
        while True:
            info = await self._store.describe_flow(flow_id)
            if info.status != "running":
                return info
            if time.monotonic() >= deadline:
                steps = [s.step_execution_id for s in info.active_steps]
                raise TimeoutError(f"flow {flow_id!r} still running after {timeout_seconds} s; active Steps {steps}")
            await asyncio.sleep(0.01)

    async def flow_output(self, flow_id: str) -> Any:
        info = await self._store.describe_flow(known_flow_id(flow_id))
        return None if info.output is None else decode_value("flow output", Any, info.output)

    async def exists(self, flow_id: str) -> bool:
        try:
            await self._store.describe_flow(known_flow_id(flow_id))
        except FlowNotFoundError:
            return False
        return True


def _flow_config(label: str, config: object) -> FlowConfig:
    """`config` if it is a FlowConfig: the store would write any struct or mapping given instead, and
    a flow whose stored config no reader decodes never runs another Step."""
    if not isinstance(config, FlowConfig):
        raise InvalidValueError(f"{label} must be a FlowConfig, got {type(config).__name__}: {shown(config)}")
    return config


def _check_ref(label: str, ref: object, kind: type, advice: str) -> None:
    """InvalidValueError unless `ref` is a `kind`: anything else (None, a name given as text) failed
    deep in the lookup with AttributeError or TypeError, naming neither the argument nor the fix."""
    if not isinstance(ref, kind):
        raise InvalidValueError(f"{label} must be of type {kind.__name__}, got {type(ref).__name__}: {shown(ref)}; "
                                f"{advice}")


def _check_limit(limit: object) -> None:
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_READ_LIMIT:
        raise ValueError(f"limit must be a whole number from 1 to {MAX_READ_LIMIT}, got {shown(limit, None)}")


def _serve(loop: asyncio.AbstractEventLoop, served: threading.RLock) -> None:
    """A blocking Client's loop thread: runs `loop` until stopped, then closes it, holding `served`
    until then (what close() waits for)."""
    with served:
        try:
            loop.run_forever()
        finally:
            loop.close()


def _close_dropped(loop: asyncio.AbstractEventLoop, client: AsyncClient, pid: int, url: str) -> None:
    """Close the store of a blocking Client collected unclosed, then end its loop thread. Waits for
    neither: the collection may run on that very thread."""
    if os.getpid() != pid:
        return  # a fork's copy: the loop and the store are the parent's

    async def close() -> None:
        try:
            await client.close()
        finally:
            loop.stop()

    with contextlib.suppress(RuntimeError):  # the loop closed already
        asyncio.run_coroutine_threadsafe(close(), loop)
    # Last: under -W error the warning raises, and the client must be closed all the same.
    warnings.warn(f"a blocking Client of {url!r} was never closed; call its close(), or use it in a with "
                  "block", ResourceWarning, stacklevel=2)


def _check_registry(owner: str, registry: object) -> None:
    """Refuse what is not a Registry (None, a list of Flows) where it is given: taken as it was,
    it failed at the first call with an AttributeError ('NoneType' object has no attribute 'flow')."""
    if not isinstance(registry, Registry):
        raise TypeError(f"{owner} takes a Registry of Flows, got {type(registry).__name__}: "
                        f"{shown(registry, 200)}; wrap the Flows: Registry([flow, ...])")


def _open_into(opening: concurrent.futures.Future[AsyncClient], registry: Registry, url: str) -> None:
    """Open a blocking Client's AsyncClient on its loop into `opening`, unless its caller gave up
    (Ctrl-C) before the open began."""
    if not opening.set_running_or_notify_cancel():
        return
    try:
        opening.set_result(AsyncClient(registry, url))
    except BaseException as exc:  # the caller's result() raises it
        opening.set_exception(exc)


def _close_unused(opening: concurrent.futures.Future[AsyncClient], loop: asyncio.AbstractEventLoop) -> None:
    """Once the open of a blocking Client that failed, or whose caller gave up on it (Ctrl-C), is
    done: close the client it made, if any, then stop the client's loop. Runs on the loop thread, or
    on the caller's when the open was done before."""

    async def close_and_stop() -> None:
        try:
            if not opening.cancelled() and opening.exception() is None:
                await opening.result().close()
        finally:
            loop.stop()

    asyncio.run_coroutine_threadsafe(close_and_stop(), loop)


class _Call(Generic[T]):
    """A blocking Client's call, handed to its loop thread, which runs `coro` as `task`. Its caller
    waits by taking `done`, taken from the start; the loop thread releases it once the task is done,
    or close() does first."""

    __slots__ = ("abandoned", "coro", "done", "task")

    def __init__(self, coro: Coroutine[Any, Any, T]) -> None:
        self.coro = coro
        self.done = threading.Lock()
        self.done.acquire()
        self.task: asyncio.Task[T] | None = None  # set on the loop thread
        self.abandoned = False  # the caller stopped waiting before it started (set on the loop thread)

    def release(self) -> None:
        """Let the caller go on. Whoever comes second (the loop thread or close()) does nothing: its
        caller takes `done` once only."""
        with contextlib.suppress(RuntimeError):  # released already
            self.done.release()


class Client:
    """Blocking twin of AsyncClient; runs an event loop on a private thread."""

    def __init__(self, registry: Registry, database_url: str) -> None:
        _check_registry("Client", registry)  # before its thread starts
        self._url = database_url
        self._loop = asyncio.new_event_loop()
        # Held by the loop thread until it closed the loop: what close() waits for (see there).
        self._served = threading.RLock()
        self._joining: set[int] = set()  # the threads in close()'s join of the loop thread (see there)
        self._thread = threading.Thread(target=_serve, args=(self._loop, self._served), name="dex-client",
                                        daemon=True)
        # Orders the hand-over of calls with close(): a call handed over before close() marked the client
        # closed is started on the loop before the close, which cancels it; one after is refused.
        # Reentrant: a signal handler (a script's SIGTERM handler) that calls close() runs in the main
        # thread between two bytecodes, maybe while that very thread holds the lock in a call or in
        # close(), and with a plain Lock waited for it for ever.
        self._lock = threading.RLock()
        # Calls other threads wait in: close() lets their callers go (they raise), even while the loop
        # is busy (an RPC handler that blocks it).
        self._in_flight: set[_Call[Any]] = set()
        # The calls' tasks, which the close cancels on the loop: a close a signal handler runs while its
        # thread was handing a call to the loop finds the call in neither _in_flight nor done. Used on
        # the loop thread only.
        self._call_tasks: set[asyncio.Task[Any]] = set()
        self._closed = False
        # The thread of the first close(), and the close it handed to the loop once the loop is sure
        # to stop after it: a close() a signal handler runs while that thread's own close() has not
        # got so far must not wait for the loop thread to end (see close()).
        self._closer: int | None = None
        self._closing: concurrent.futures.Future[None] | None = None
        # Its thread lives only in this process: a fork's copy (gunicorn --preload) would queue
        # calls to a loop that no thread runs, and wait for ever.
        self._pid = os.getpid()
        self._thread.start()
        # Made here, before the open is handed to the loop: a Ctrl-C while the hand-off ran (the loop
        # thread may already be opening, and connected) left no future to stop the loop by, and
        # the loop thread ran until the process exited.
        opening: concurrent.futures.Future[AsyncClient] = concurrent.futures.Future()
        try:
            self._loop.call_soon_threadsafe(_open_into, opening, registry, database_url)
            self._async = opening.result()
        except BaseException:
            loop = self._loop
            opening.cancel()  # an open not begun never begins; one begun runs on (see below)
            opening.add_done_callback(lambda done: _close_unused(done, loop))
            if opening.done():
                self._thread.join()  # e.g. a bad database URL: leave no thread behind
            # Else Ctrl-C while the loop thread still opens the store (a PostgreSQL server that
            # does not answer, for up to its connect timeout): waiting for it here held the
            # interrupt back until then; the thread ends on its own once the open does.
            raise
        # A client dropped unclosed (made per web request, say) kept its loop thread, the store's
        # threads and, on PostgreSQL, its connections until the process exited. Not at exit: the
        # daemon threads end with the process anyway, and a client kept for the process's whole
        # life is no mistake.
        self._dropped = weakref.finalize(self, _close_dropped, self._loop, self._async, self._pid,
                                         shown_url(database_url))
        self._dropped.atexit = False

    def _on_own_loop(self, what: str, advice: str) -> RuntimeError:
        """The error for `what` asked by code this client's own loop runs (an RPC handler it called):
        waiting for the result would block the loop that makes it, and with it every other thread's
        call and close(), for ever."""
        return RuntimeError(f"{what} of the blocking Client of {shown_url(self._url)!r} from code its own event "
                            f"loop runs (an RPC handler it called) would wait for ever; {advice}")

    def _forked(self) -> bool:
        return os.getpid() != self._pid

    def _fork_error(self) -> RuntimeError:
        return RuntimeError(f"the blocking Client of {shown_url(self._url)!r} was made in process {self._pid}, and "
                            f"this process ({os.getpid()}) is a fork of it, to which its event-loop thread did not "
                            "pass; make Clients only after the fork, in each process (with gunicorn --preload: in "
                            "a post_fork hook, or on first use)")

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._forked():
            # Before taking _lock: a thread of the parent may have held it when the process forked.
            coro.close()
            raise self._fork_error()
        if threading.current_thread() is self._thread:
            coro.close()
            raise self._on_own_loop("a call", "in an RPC handler, await an AsyncClient's calls instead")
        call = _Call(coro)
        try:
            with self._lock:
                if self._closed:
                    coro.close()
                    raise self._closed_error()
                try:
                    self._loop.call_soon_threadsafe(self._start, call)
                except RuntimeError:
                    coro.close()
                    if not self._closed_now():
                        raise
                    # A signal handler's close() ran in this thread since the check above (the lock is
                    # reentrant), and the loop it stopped is closed ("Event loop is closed").
                    raise self._closed_error() from None
                self._in_flight.add(call)
                # Checked again once the call is in _in_flight: a signal handler's close() that ran in this
                # thread since the check above did not see it, and may have stopped the loop before it
                # started, where it would wait for ever.
                if self._closed_now():
                    call.release()
            # Waited for on a plain lock, which the loop thread (and close()) only release: a signal
            # handler run in this wait holds nothing, so its close() can wait for the loop thread to end.
            # (Future.result() of concurrent.futures holds the future's lock but in its inner wait; the
            # loop thread, needing that lock to hand the call over or its result back, never ended.)
            # In pieces: a signal that lands just before the wait blocks does not wake it, nor does one
            # that only sets Python's flag (_thread.interrupt_main), so Ctrl-C's KeyboardInterrupt
            # waited for the call's end (for ever in a wait_for_flow(id, math.inf)).
            while not call.done.acquire(timeout=CLIENT_SIGNAL_CHECK_SECONDS):
                pass
        except BaseException:
            # The caller's wait was interrupted (Ctrl-C: KeyboardInterrupt): end the call too, or it went on
            # without a caller (a wait_for_flow(id, math.inf) polled the database until close()). From the
            # hand-over on, not only in the wait: a Ctrl-C just after call_soon_threadsafe returned left
            # the call running for ever. One not handed over is closed there (_abandon).
            with contextlib.suppress(RuntimeError):  # the loop is closed: the call ended with it
                self._loop.call_soon_threadsafe(self._abandon, call)
            raise
        finally:
            with self._lock:
                self._in_flight.discard(call)
        task = call.task
        if task is None or not task.done():  # close() let the caller go
            if self._loop.is_closed() and call.task is None:
                coro.close()  # the loop thread ended without starting it
            raise RuntimeError(f"client of {shown_url(self._url)!r} was closed while the call waited")
        if task.cancelled():
            if self._closed:
                raise RuntimeError(f"client of {shown_url(self._url)!r} was closed while the call waited")
            raise concurrent.futures.CancelledError()
        return task.result()

    def _start(self, call: _Call[Any]) -> None:
        """On the loop: run `call` as a task the close cancels, which lets its caller go once done."""
        if call.abandoned:
            call.coro.close()
            return
        task = self._loop.create_task(call.coro)
        call.task = task
        self._call_tasks.add(task)
        task.add_done_callback(lambda _: self._finished(call, task))

    def _finished(self, call: _Call[Any], task: asyncio.Task[Any]) -> None:
        self._call_tasks.discard(task)
        if not task.cancelled():
            # Marks its error as seen: a caller that stopped waiting (Ctrl-C, or close() let it go) never
            # reads it, and asyncio logged "Task exception was never retrieved" with its traceback.
            task.exception()
        call.release()

    @staticmethod
    def _abandon(call: _Call[Any]) -> None:
        """On the loop: end `call`, whose caller stopped waiting, or keep it from starting."""
        if call.task is None:
            call.abandoned = True
            call.coro.close()  # "never awaited" otherwise, should _start never come (not handed over)
        else:
            call.task.cancel()  # nothing once done

    async def _close_on_loop(self) -> None:
        for task in self._call_tasks:
            task.cancel()
        await self._async.close()

    def _closed_now(self) -> bool:
        """_closed, read again: a signal handler's close() may have set it since the last read, in this
        very thread, which a type checker's narrowing does not know."""
        return self._closed

    def _closed_error(self) -> RuntimeError:
        return RuntimeError(f"client of {shown_url(self._url)!r} is closed; its close() was called (by this or "
                            "another thread): open the database again with a new Client")

    def start_flow(self, flow_type: str, flow_id: str, input: Any = None, *,
                   config_override: FlowConfig | None = None) -> None:
        self._call(self._async.start_flow(flow_type, flow_id, input, config_override=config_override))

    def rpc(self, flow_id: str, name: str, request: Any = None) -> Any:
        return self._call(self._async.rpc(flow_id, name, request))

    def publish(self, flow_id: str, channel: ChannelRef[T], value: T) -> int:
        return self._call(self._async.publish(flow_id, channel, value))

    def get_attribute(self, flow_id: str, ref: AttributeRef[T]) -> T | None:
        coro = self._async.get_attribute(flow_id, ref)
        return self._call(coro)

    def get_attribute_map(self, flow_id: str, amap: AttributeMap[T]) -> dict[str, T]:
        return self._call(self._async.get_attribute_map(flow_id, amap))

    def read_stream(self, flow_id: str, stream: Stream[T] | str, resume_token: str | None = None, *,
                    wait_seconds: float = 0.0, limit: int = DEFAULT_READ_LIMIT) -> StreamRead:
        return self._call(self._async.read_stream(flow_id, stream, resume_token,
                                                  wait_seconds=wait_seconds, limit=limit))

    def stop_flow(self, flow_id: str, reason: str = "") -> None:
        self._call(self._async.stop_flow(flow_id, reason))

    def delete_flow(self, flow_id: str) -> bool:
        return self._call(self._async.delete_flow(flow_id))

    def skip_timer(self, flow_id: str, step_execution_id: str) -> None:
        self._call(self._async.skip_timer(flow_id, step_execution_id))

    def update_flow_config(self, flow_id: str, config: FlowConfig) -> None:
        self._call(self._async.update_flow_config(flow_id, config))

    def describe_flow(self, flow_id: str) -> FlowInfo:
        return self._call(self._async.describe_flow(flow_id))

    def search_flows(self, query: str, limit: int = DEFAULT_READ_LIMIT) -> list[str]:
        return self._call(self._async.search_flows(query, limit=limit))

    def get_flow_history(self, flow_id: str) -> list[HistoryEntry]:
        return self._call(self._async.get_flow_history(flow_id))

    def wait_for_flow(self, flow_id: str, timeout_seconds: float = 60.0) -> FlowInfo:
        return self._call(self._async.wait_for_flow(flow_id, timeout_seconds))

    def flow_output(self, flow_id: str) -> Any:
        return self._call(self._async.flow_output(flow_id))

    def exists(self, flow_id: str) -> bool:
        return self._call(self._async.exists(flow_id))

    def close(self) -> None:
        """Close the store; calls other threads wait in raise RuntimeError. A second close (another
        thread's, or one after a Ctrl-C in the first) closes nothing more: it returns once the first is done.
        A signal handler may call it, even one that interrupted a call or close() of this client in its
        thread: a close() interrupted before it told the loop to close returns once the handler does.

        In a fork of the process that made the client it only marks the client closed: the
        loop thread and the store belong to the parent, which goes on using them."""
        if self._forked():
            self._closed = True
            self._dropped.detach()
            return
        if threading.current_thread() is self._thread:
            raise self._on_own_loop("close()", "close it from another thread")
        me = threading.get_ident()
        with self._lock:
            self._closed = True
            # No call between the test and the set: a signal handler's close() cannot run between them.
            first = self._closer is None
            if first:
                self._closer = me
            waiting = list(self._in_flight)
        if first:
            try:
                self._dropped.detach()
                for call in waiting:
                    call.release()  # its caller raises; _close_on_loop cancels its task
                # The loop stops itself once the close is done, whatever becomes of this caller: stopped
                # from here after a Ctrl-C in the wait, it stopped before the close ran, and the store
                # stayed open until the process exited.
                closing = asyncio.run_coroutine_threadsafe(self._close_on_loop(), self._loop)
                loop = self._loop
                closing.add_done_callback(lambda _: loop.call_soon_threadsafe(loop.stop))
                self._closing = closing
            except BaseException:
                if self._closing is None:
                    self._closer = None  # interrupted (Ctrl-C) before the loop was told: the next close() does it
                raise
        elif self._closing is None and self._closer == me:
            # A signal handler's close() that interrupted this thread's own first close() before that
            # told the loop to close and stop: the loop thread ends only once that close goes on,
            # after this returns, so waiting for it here waited for ever.
            return
        # A second close (another thread's, or a retry after Ctrl-C) returns once the first is done
        # too: the store is closed when any close() returns.
        # The loop stops, and closes (_serve), then the thread ends. A signal handler's close() (a second
        # SIGTERM's) may run in this thread anywhere in these waits, and wait again inside them: so the
        # wait is taking the lock the loop thread holds until then, which is reentrant (a future's wait
        # lost the wake-up its inner wait took when interrupted between its test and its wait), and the
        # inner close does not join (Thread.join() waited for ever for the lock the interrupted join held).
        self._served.acquire()
        self._served.release()
        if me not in self._joining:
            self._joining.add(me)
            try:
                self._thread.join()
            finally:
                self._joining.discard(me)
        if first:
            closing.result()  # the close's own error, if it failed

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
