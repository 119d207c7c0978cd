"""A client's read of one flow sees it as of one moment, on both backends: another connection's
commit (a delete) that lands while the read runs, after any of its statements, gives the flow as it
was before the commit or as it is after it, never part of each.

On PostgreSQL each statement of a transaction sees the latest commit (READ COMMITTED), where SQLite
reads one snapshot: a read of several statements could mix two states there.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from dex_engine import (
    Client,
    Context,
    Flow,
    FlowNotFoundError,
    HistoryEntry,
    LoadOptions,
    Registry,
    RpcContext,
    RpcNotFoundError,
    RPCResult,
    Step,
    StepDecision,
    UndeclaredNameError,
    Wait,
    rpc,
)

from .conftest import Engine, engine_for
from .racing_reads import commit_during_first_read
from .test_delete_flow import REGISTRY, Inbox, Note, Tags, closed_flow
from .test_reused_flow_ids import REGISTRY as REUSED


def _history(entries: list[HistoryEntry]) -> list[tuple[str, str]]:
    return [(e.event_type, e.step_execution_id) for e in entries]


# Each read: (the transition it runs, how the client calls it, what it returns for the flow as
# closed_flow leaves it, made comparable).
_READS: dict[str, tuple[str, Callable[[Engine], Awaitable[Any]], Callable[[Any], Any]]] = {
    "get_flow_history": ("read_history", lambda eng: eng.client.get_flow_history("f1"), _history),
    "get_attribute": ("read_attribute", lambda eng: eng.client.get_attribute("f1", Note), lambda v: v),
    "get_attribute_map": ("read_attribute_map", lambda eng: eng.client.get_attribute_map("f1", Tags), lambda v: v),
    # The CLI's `attributes` and `stream` commands.
    "read_all_attributes": ("read_all_attributes", lambda eng: eng.store.read_all_attributes("f1"), lambda v: v),
    "stream_names": ("stream_names", lambda eng: eng.store.stream_names("f1"), lambda v: v),
}


@pytest.mark.parametrize("read", sorted(_READS))
@pytest.mark.parametrize("delete_after", [1, 2])
async def test_a_read_racing_a_delete_sees_the_flow_before_or_after_it(
    db_url: str, monkeypatch: pytest.MonkeyPatch, read: str, delete_after: int,
) -> None:
    """A flow deleted by another connection while a read of it runs (after the read's first or
    second statement) reads as it was (the whole value) or as gone (FlowNotFoundError). Catches:
    PostgreSQL reading that the flow exists, then its rows, in two statements: the delete fell
    between them and get_flow_history returned [], get_attribute None, get_attribute_map {}, for a
    flow that always had them."""
    transition, call, shown = _READS[read]
    async with engine_for(db_url, REGISTRY) as eng:
        await closed_flow(eng, "f1", "completed")
        whole = shown(await call(eng))
        assert whole, whole  # the flow has rows of each read
        # Another process's client: a blocking Client runs on a loop of its own, so the read may
        # wait for it wherever it runs (on this loop, inline on SQLite; on a connection's thread).
        other = await asyncio.to_thread(Client, REGISTRY, db_url)
        deleted = commit_during_first_read(monkeypatch, transition, delete_after, lambda: other.delete_flow("f1"))
        try:
            try:
                seen = shown(await call(eng))
            except FlowNotFoundError:
                seen = FlowNotFoundError
        finally:
            await asyncio.to_thread(other.close)
        assert deleted == [True]
        assert seen in (whole, FlowNotFoundError), seen
        with pytest.raises(FlowNotFoundError):
            await call(eng)



@pytest.mark.parametrize("read", ["get_attribute", "get_attribute_map"])
async def test_an_attribute_read_racing_a_restart_with_another_type_reads_one_flow(
    db_url: str, monkeypatch: pytest.MonkeyPatch, read: str,
) -> None:
    """A flow deleted and started again under its ID, with another type, by another connection
    while a client's attribute read of it runs (after the read's first statement) reads as the old
    flow or as the new one, whose type does not declare the name (UndeclaredNameError). Catches:
    PostgreSQL checking the old flow's type, then reading the new flow's rows: None or {} for a
    name the new flow's type does not have."""
    transition, call, shown = _READS[read]
    async with engine_for(db_url, REUSED) as eng:
        await closed_flow(eng, "f1", "completed")
        whole = shown(await call(eng))  # the client remembers Keeper
        other = await asyncio.to_thread(Client, REUSED, db_url)

        def restart() -> bool:
            assert other.delete_flow("f1")
            other.start_flow("Other", "f1", 7)
            return True

        restarted = commit_during_first_read(monkeypatch, transition, 1, restart)
        try:
            try:
                seen = shown(await call(eng))
            except UndeclaredNameError as exc:
                assert "'Other'" in str(exc), exc
                seen = UndeclaredNameError
        finally:
            await asyncio.to_thread(other.close)
        assert restarted == [True]
        assert seen in (whole, UndeclaredNameError), seen


@rpc(load=LoadOptions.only(Note))
async def peek(ctx: RpcContext, _: None) -> str | None:
    return ctx.get(Note)


async def noted(ctx: Context, text: str) -> StepDecision:
    ctx.set(Note, text)
    return StepDecision.force_complete(None)


PEEKER = Flow("Peeker", [Step("Note", noted, input_type=str)], start_step="Note", schema=[Note], rpcs=[peek])
PEEKERS = Registry([PEEKER, *(REUSED.flow(t) for t in ("Keeper", "Other", "Jotter"))])


async def test_an_rpc_racing_a_restart_with_another_type_runs_on_one_flow(
    db_url: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A flow deleted and started again under its ID, with another type, by another connection
    while an RPC's snapshot of it is read (after the read's first statement) gives the handler the
    old flow, or the RPC is run by the new flow's type (which has no such RPC: RpcNotFoundError).
    Catches: PostgreSQL reading the flow's type, then its version and rows, in two statements: the
    old type's handler ran on the new flow's state (and a writing one would have committed into
    it, its version being the new flow's)."""
    async with engine_for(db_url, PEEKERS) as eng:
        await eng.client.start_flow("Peeker", "f1", "old")
        await eng.client.wait_for_flow("f1", 10)
        assert await eng.client.rpc("f1", "peek") == "old"  # the client remembers Peeker
        other = await asyncio.to_thread(Client, PEEKERS, db_url)

        def restart() -> bool:
            assert other.delete_flow("f1")
            other.start_flow("Jotter", "f1")
            other.rpc("f1", "jot", "new")  # the new flow's Note
            return True

        restarted = commit_during_first_read(monkeypatch, "rpc_read", 1, restart)
        try:
            try:
                seen = await eng.client.rpc("f1", "peek")
            except RpcNotFoundError as exc:
                assert "'Jotter'" in str(exc), exc
                seen = RpcNotFoundError
        finally:
            await asyncio.to_thread(other.close)
        assert restarted == [True]
        assert seen in ("old", RpcNotFoundError), seen


async def ask_wait(ctx: Context, _: None) -> Wait:
    return Wait.until(Inbox.for_one())


async def answered(ctx: Context, _: None) -> StepDecision:
    return StepDecision.force_complete(None)


@rpc(load=LoadOptions.none())
async def move(ctx: RpcContext, _: None) -> RPCResult[None]:
    return RPCResult(None, next_steps=(("Hold", None),), canceling_steps=("Ask",))


MOVER = Flow(
    "Mover",
    [Step("Ask", answered, wait_for=ask_wait, input_type=type(None)),
     Step("Hold", answered, wait_for=ask_wait, input_type=type(None))],
    start_step="Ask", schema=[Inbox], rpcs=[move],
)
MOVERS = Registry([MOVER])


async def test_an_active_step_search_racing_changes_lists_the_flows_of_one_moment(
    db_url: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two flows in Step Ask; while a search for it runs (after its first statement), another
    connection moves one on to another Step (it stays running) and stops the other. The search
    lists both (before) or neither (after). Catches: PostgreSQL reading the flows with the Step,
    then those flows (running?) in another statement: it listed only the one that moved on, a
    list no moment had."""
    async with engine_for(db_url, MOVERS, worker=False) as eng:
        for flow_id in ("x", "z"):
            await eng.client.start_flow("Mover", flow_id)
        query = 'ActiveStepTypes = "Ask"'
        assert await eng.client.search_flows(query) == ["x", "z"]
        other = await asyncio.to_thread(Client, MOVERS, db_url)

        def change() -> bool:
            other.rpc("x", "move")
            other.stop_flow("z", "racing a search")
            return True

        changed = commit_during_first_read(monkeypatch, "search_flows", 1, change)
        try:
            seen = await eng.client.search_flows(query)
        finally:
            await asyncio.to_thread(other.close)
        assert changed == [True]
        assert seen in (["x", "z"], []), seen
        assert await eng.client.search_flows(query) == []
