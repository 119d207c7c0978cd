"""The try an RPC makes after losing two races runs its handler stepped inside the transaction that
holds the flow's write lock (AsyncClient._rpc_locked). Each handler below runs once on the usual
path and once forced onto that try, on a fresh flow each time; the caller must not be able to tell
them apart: same output or error, same state after."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import gc
import sqlite3
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from dex_engine import (
    AsyncClient,
    Attribute,
    AttributeMap,
    Channel,
    Context,
    Flow,
    LoadOptions,
    Registry,
    RpcContext,
    RPCResult,
    Step,
    StepDecision,
    Wait,
    rpc,
)
from dex_engine._transitions import RpcVersionChanged

from .conftest import Engine, engine_for

Inbox = Channel("Inbox", int)
Count = Attribute("Count", int)
Notes = AttributeMap("Notes", int)
caller_var: contextvars.ContextVar[str] = contextvars.ContextVar("caller_var", default="unset")
peers: list[AsyncClient] = []  # the engine's own client, then the caller's, for a handler that calls them


async def wait_for_inbox(ctx: Context, _input: Any) -> Wait:
    return Wait.until(Inbox.for_one())


async def complete(ctx: Context, _input: Any) -> StepDecision:
    return StepDecision.graceful_complete(None)


@rpc()
async def read_count(ctx: RpcContext, _request: Any) -> Any:
    return ctx.get(Count), ctx.items(Notes)


@rpc(load=LoadOptions.none())
async def load_later(ctx: RpcContext, _request: Any) -> Any:
    await ctx.load(Count, Notes)
    await ctx.load(Notes["a"])
    return ctx.get(Count), ctx.items(Notes)


@rpc(load=LoadOptions.only(Count))
async def read_pending(ctx: RpcContext, _request: Any) -> Any:
    return [m.value for m in ctx.pending(Inbox)], ctx.get(Count)


@rpc()
async def take_pending(ctx: RpcContext, _request: Any) -> Any:
    pending = ctx.pending(Inbox)
    ctx.delete_message(Inbox, pending[0].message_id)
    return [m.value for m in pending]


@rpc()
async def publish_and_set(ctx: RpcContext, request: int) -> Any:
    ctx.publish(Inbox, request)
    ctx.set(Count, (ctx.get(Count) or 0) + request)
    ctx.delete(Notes["a"])
    ctx.set(Notes["z"], request)
    return ctx.get(Count)


@rpc(locks=[Count])
async def locked_set(ctx: RpcContext, _request: Any) -> None:
    ctx.set(Count, 99)


@rpc()
async def starts_a_step(ctx: RpcContext, _request: Any) -> RPCResult[str]:
    ctx.set(Count, 1)
    return RPCResult("started", next_steps=(("Extra", 5),))


@rpc()
async def cancels_listen(ctx: RpcContext, _request: Any) -> RPCResult[str]:
    return RPCResult("canceled", canceling_steps=("Listen",), ending_retry_waits=("Extra",))


@rpc()
async def bad_next_step(ctx: RpcContext, _request: Any) -> RPCResult[str]:
    ctx.set(Count, 1)
    return RPCResult("never", next_steps=(("NoSuchStep", 1),))


@rpc()
async def reads_contextvar(ctx: RpcContext, _request: Any) -> str:
    ctx.set(Count, 3)
    return caller_var.get()


@rpc()
async def raises(ctx: RpcContext, _request: Any) -> None:
    ctx.set(Count, 1)
    raise LookupError(f"refused with Count {ctx.get(Count)}")


@rpc()
async def yields_a_little(ctx: RpcContext, _request: Any) -> int:
    for _ in range(3):
        await asyncio.sleep(0)
    ctx.set(Count, 4)
    return 4


@rpc()
async def yields_a_lot(ctx: RpcContext, _request: Any) -> int:
    for _ in range(500):
        await asyncio.sleep(0)
    ctx.set(Count, 5)
    return 5


@rpc()
async def awaits_a_future(ctx: RpcContext, _request: Any) -> int:
    done = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().call_soon(done.set_result, 6)
    value: int = await done
    ctx.set(Count, value)
    return value


@rpc()
async def awaits_a_lock(ctx: RpcContext, _request: Any) -> int:
    async with asyncio.Lock():  # free: taken without waiting
        ctx.set(Count, 7)
    return 7


@rpc()
async def uses_a_timeout(ctx: RpcContext, _request: Any) -> int:
    async with asyncio.timeout(10):
        await ctx.load(Count)
    ctx.set(Count, 8)
    return 8


@rpc()
async def calls_the_client(ctx: RpcContext, _request: Any) -> Any:
    seen = await peers[0].get_attribute(ctx.flow_id, Count)
    ctx.set(Count, 9)
    return seen


@rpc()
async def calls_an_rpc_on_its_flow(ctx: RpcContext, _request: Any) -> Any:
    inner = await peers[0].rpc(ctx.flow_id, "read_count")
    ctx.set(Count, 10)
    return inner


@rpc()
async def calls_its_own_client(ctx: RpcContext, _request: Any) -> Any:
    seen = await peers[1].get_attribute(ctx.flow_id, Count)
    ctx.set(Count, 11)
    return seen


@rpc(load=LoadOptions.none())
async def loads_in_gather(ctx: RpcContext, _request: Any) -> Any:
    await asyncio.gather(ctx.load(Count), ctx.load(Notes))
    ctx.set(Count, 13)
    return ctx.items(Notes)


EQ = Flow(
    "Eq",
    [Step("Listen", complete, wait_for=wait_for_inbox), Step("Extra", complete)],
    start_step="Listen",
    schema=[Inbox, Count, Notes],
    rpcs=[read_count, load_later, read_pending, take_pending, publish_and_set, locked_set, starts_a_step,
          cancels_listen, bad_next_step, reads_contextvar, raises, yields_a_little, yields_a_lot, awaits_a_future,
          awaits_a_lock, uses_a_timeout, calls_the_client, calls_an_rpc_on_its_flow, calls_its_own_client,
          loads_in_gather],
)
@rpc(name="read_count")
async def other_read_count(ctx: RpcContext, _request: Any) -> str:
    return f"the other type's, Count {ctx.get(Count)}"


OTHER = Flow("Other", [Step("Listen", complete, wait_for=wait_for_inbox)], start_step="Listen",
             schema=[Inbox, Count], rpcs=[other_read_count])
REGISTRY = Registry([EQ, OTHER])


@dataclass(frozen=True)
class Case:
    rpc: str
    request: Any = None
    closed: bool = False  # the flow is stopped before the call
    step_holds_count: bool = False  # a Step holds the lock on Count (E7)
    deleted: bool = False  # the flow is stopped and deleted before the call
    retyped: bool = False  # ... and started again under its ID as another flow type

    @property
    def label(self) -> str:
        closed = " on a closed flow" if self.closed else ""
        closed += " on a deleted flow" if self.deleted else ""
        closed += " started again as another type" if self.retyped else ""
        return f"{self.rpc}{closed}{' while a Step holds its lock' if self.step_holds_count else ''}"


CASES = [
    Case("read_count"),
    Case("read_count", closed=True),
    Case("read_count", deleted=True),
    Case("publish_and_set", 2, deleted=True),
    Case("read_count", deleted=True, retyped=True),
    Case("load_later"),
    Case("read_pending"),
    Case("take_pending"),
    Case("publish_and_set", 2),
    Case("publish_and_set", 2, closed=True),
    Case("locked_set"),
    Case("locked_set", step_holds_count=True),
    Case("starts_a_step"),
    Case("cancels_listen"),
    Case("bad_next_step"),
    Case("reads_contextvar"),
    Case("raises"),
    Case("yields_a_little"),
    Case("yields_a_lot"),
    Case("awaits_a_future"),
    Case("awaits_a_lock"),
    Case("uses_a_timeout"),
    Case("calls_the_client"),
    Case("calls_an_rpc_on_its_flow"),
    Case("calls_its_own_client"),
    Case("loads_in_gather"),
]


def step_takes_count(flow_id: str) -> Callable[[Any], None]:
    def take(db: Any) -> None:  # as a claim of a Step locking Count does
        row = db.one("SELECT task_id FROM tasks WHERE flow_id = ?", (flow_id,))
        db.run("INSERT INTO locks (flow_id, lock_name, task_id) VALUES (?, ?, ?)", (flow_id, "Count", row[0]))
    return take


async def run_case(eng: Engine, caller: AsyncClient, case: Case, lose_first: int, flow_id: str) -> tuple[Any, ...]:
    """`case` on a fresh flow, called through `caller`, whose first `lose_first` snapshot reads lose
    their race. Its outcome (output, or error type and text), the flow's state after, and how many
    tries ran under the flow's write lock."""
    c = eng.client
    await c.start_flow("Eq", flow_id)
    await c.publish(flow_id, Inbox, 11)
    await c.publish(flow_id, Inbox, 12)
    await c.rpc(flow_id, "publish_and_set", 1)  # Count 1, Notes z
    if case.step_holds_count:
        await eng.store.raw(step_takes_count(flow_id), write=True)
    if case.closed or case.deleted:
        await c.stop_flow(flow_id)
    real_read, real_locked = caller.store.rpc_read, caller.store.rpc_locked
    reads: list[int] = []
    locked: list[int] = []

    async def read_or_lose(flow_id: str, load: Any, locks: Any) -> Any:
        reads.append(1)
        if len(reads) <= lose_first:
            raise RpcVersionChanged()
        return await real_read(flow_id, load, locks)

    async def counted_locked(*args: Any) -> Any:
        locked.append(1)
        return await real_locked(*args)

    setattr(caller.store, "rpc_read", read_or_lose)  # noqa: B010
    setattr(caller.store, "rpc_locked", counted_locked)  # noqa: B010
    if case.deleted:
        await caller.get_attribute(flow_id, Count)  # the caller knows its type, as after an earlier call
        await c.delete_flow(flow_id)
        if case.retyped:
            await c.start_flow("Other", flow_id)
    token = caller_var.set("the caller's")
    try:
        output: Any = ("returned", await caller.rpc(flow_id, case.rpc, case.request))
    except Exception as exc:  # compared, not handled
        output = ("raised", type(exc).__name__, str(exc).replace(repr(flow_id), "<flow>"))
    finally:
        caller_var.reset(token)
        setattr(caller.store, "rpc_read", real_read)  # noqa: B010
        setattr(caller.store, "rpc_locked", real_locked)  # noqa: B010
    if case.deleted:
        return output, (await c.exists(flow_id),), len(locked)
    info = await c.describe_flow(flow_id)
    state = (info.status, sorted(s.step_type for s in info.active_steps),
             await c.get_attribute(flow_id, Count), await c.get_attribute_map(flow_id, Notes),
             [e.event_type for e in await c.get_flow_history(flow_id)])
    return output, state, len(locked)


async def test_the_try_under_the_flows_write_lock_gives_what_a_usual_try_gives(db_url: str) -> None:
    """Each RpcContext feature (load, pending messages, publish, set and delete, locks, RPCResult's
    Steps, a closed flow, contextvars, a raising handler) and each handler that awaits what the
    transaction cannot wait for (many yields, a future, gather, a timeout, other client calls): the
    third try, run under the flow's write lock after two lost races, returns or raises and leaves the
    flow exactly as an uncontended call does, a handler that cannot be stepped going back to racing,
    and nothing the stepped run left behind is logged ("_GatheringFuture exception was never
    retrieved" for `asyncio.gather(ctx.load(a), ctx.load(b))`) or warned of."""
    loop = asyncio.get_running_loop()
    unhandled: list[tuple[str, dict[str, Any]]] = []
    differ: dict[str, tuple[Any, Any]] = {}
    case = CASES[0]
    loop.set_exception_handler(lambda _loop, context: unhandled.append((case.label, context)))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # 'coroutine ... was never awaited' and the like
            async with engine_for(db_url, REGISTRY, worker=False) as eng, AsyncClient(REGISTRY, db_url) as caller:
                peers[:] = [eng.client, caller]
                for i, case in enumerate(CASES):
                    usual = await run_case(eng, caller, case, 0, f"usual-{i}")
                    forced = await run_case(eng, caller, case, 2, f"forced-{i}")
                    for _ in range(10):  # what a stepped run left behind gets its turns
                        await asyncio.sleep(0)
                    gc.collect()
                    if usual[:2] != forced[:2] or usual[2] != 0 or forced[2] < 1:
                        differ[case.label] = (usual, forced)
    finally:
        loop.set_exception_handler(None)
    assert not unhandled
    assert not differ


writer_of_the_file: list[Any] = []  # the database file; then what the writer beside the handler got


def write_the_file(path: str, done: threading.Event) -> None:
    """Take the SQLite file's write lock from a connection of its own, as another process does."""
    try:
        with contextlib.closing(sqlite3.connect(path, timeout=5, isolation_level=None)) as conn:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("ROLLBACK")
        writer_of_the_file.append("wrote")
    except sqlite3.Error as exc:
        writer_of_the_file.append(exc)
    finally:
        done.set()


@rpc()
async def blocks_its_loop(ctx: RpcContext, _request: Any) -> int:
    if len(writer_of_the_file) == 1:  # its first run: wait for a writer of the file, blocking the loop
        done = threading.Event()
        threading.Thread(target=write_the_file, args=(writer_of_the_file[0], done)).start()
        done.wait(30)
    ctx.set(Count, 20)
    return 20


BLOCKING = Flow("Blocking", [Step("Listen", complete, wait_for=wait_for_inbox)], start_step="Listen",
                schema=[Inbox, Count], rpcs=[blocks_its_loop])


@pytest.mark.sqlite_only
async def test_a_handler_that_blocks_its_loop_in_the_locked_try_holds_the_file_at_most_a_second(
    db_url: str, tmp_path: Path
) -> None:
    """The try under the flow's write lock holds it at most RPC_LOCKED_LOOP_WAIT_SECONDS while its
    handler runs: a handler that blocks its event loop (CPU work, a blocking call) longer makes it
    commit nothing and go back to racing, and every other writer of the SQLite file goes on. Catches:
    that try run inline on the caller's loop (the loop idle), where nothing bounded the handler's
    run, so the file stayed write-locked for as long as the handler blocked: here another
    connection's write waited its whole busy timeout and failed with 'database is locked'."""
    writer_of_the_file[:] = [str(tmp_path / "engine.db")]
    registry = Registry([BLOCKING])
    async with engine_for(db_url, registry, worker=False) as eng, AsyncClient(registry, db_url) as caller:
        await eng.client.start_flow("Blocking", "b")
        real_read = caller.store.rpc_read
        reads: list[int] = []

        async def read_or_lose(flow_id: str, load: Any, locks: Any) -> Any:
            reads.append(1)
            if len(reads) <= 2:
                raise RpcVersionChanged()
            return await real_read(flow_id, load, locks)

        setattr(caller.store, "rpc_read", read_or_lose)  # noqa: B010
        assert await caller.rpc("b", "blocks_its_loop") == 20
        assert writer_of_the_file[1:] == ["wrote"]
        assert await eng.client.get_attribute("b", Count) == 20
