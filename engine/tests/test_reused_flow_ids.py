"""A flow ID deleted (delete_flow, retention) and started again, seen by another client that read the
old flow: its resume tokens of the old flow are refused (E11), and the type it remembered is not used
to check names, decode values or run RPCs on the new flow.

Two clients, each on its own store, on one database of each backend: "us" deletes and starts, "them"
read before and after.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from dex_engine import (
    AsyncClient,
    Attribute,
    Channel,
    Context,
    Flow,
    FlowNotFoundError,
    InvalidResumeTokenError,
    LoadOptions,
    Registry,
    RpcContext,
    RpcNotFoundError,
    Step,
    StepDecision,
    Stream,
    UndeclaredNameError,
    Wait,
    rpc,
)
from dex_engine._open import open_store

from .conftest import Engine, engine_for, wait_until
from .test_delete_flow import KEEPER, Inbox, Log, Note, closed_flow, listening
from .test_stream_watch import count_calls, idle

Count = Attribute("Count", int)
Tally = Channel("Tally", int)
Numbers = Stream("Log", int)  # the name of Keeper's stream, with another value type


async def count(ctx: Context, n: int) -> StepDecision:
    ctx.set(Count, n)
    ctx.write_event(Numbers, n)
    return StepDecision.go_to("Hold", None)


async def hold_wait(ctx: Context, _: None) -> Wait:
    return Wait.until(Tally.for_one())


async def hold(ctx: Context, _: None) -> StepDecision:
    return StepDecision.force_complete(None)


@rpc(load=LoadOptions.none())
async def jot(ctx: RpcContext, text: str) -> None:
    """Decides from its request alone: committed with no snapshot read first."""
    ctx.set(Note, text)


# "reached": set by `remark` once it read its snapshot; "gate": what it then awaits, set by the test,
# which deletes the flow and starts it again meanwhile. Made per test (an Event belongs to one loop).
REMARK_GATE: dict[str, asyncio.Event] = {}


@rpc(load=LoadOptions.only(Note))
async def remark(ctx: RpcContext, text: str) -> str:
    """Decides from the flow's state: its writes belong to the flow whose Note it read."""
    seen = ctx.get(Note)
    REMARK_GATE["reached"].set()
    await REMARK_GATE["gate"].wait()
    ctx.set(Note, f"{seen} {text}")
    return f"{seen}"


@rpc(load=LoadOptions.only(Note))
async def glance(ctx: RpcContext, _: None) -> list[object]:
    """Reads only, loading more later: what it loads must be of the flow its snapshot read."""
    seen = ctx.get(Note)
    REMARK_GATE["reached"].set()
    await REMARK_GATE["gate"].wait()
    await ctx.load(Count)
    return [seen, ctx.get(Count)]


@rpc(load=LoadOptions.only(Note))
async def read_note(ctx: RpcContext, _: None) -> str | None:
    return ctx.get(Note)


JOTTER = Flow(
    "Jotter", [Step("Idle", hold, wait_for=hold_wait, input_type=type(None))], start_step="Idle",
    schema=[Note, Count, Tally], rpcs=[jot, remark, glance, read_note],
)


OTHER = Flow(
    "Other",
    [Step("Count", count, input_type=int), Step("Hold", hold, wait_for=hold_wait, input_type=type(None))],
    start_step="Count",
    schema=[Count, Tally, Numbers],
)
REGISTRY = Registry([KEEPER, OTHER, JOTTER])


@asynccontextmanager
async def other_client(db_url: str) -> AsyncIterator[AsyncClient]:
    """Another client of the database, on a store of its own (as another process would be)."""
    async with AsyncClient(REGISTRY, store=open_store(db_url)) as client:
        yield client


async def restarted_as_other(eng: Engine, flow_id: str, n: int) -> None:
    assert await eng.client.delete_flow(flow_id)
    await eng.client.start_flow("Other", flow_id, n)
    await wait_until(f"{flow_id} holding", lambda: eng.client.get_attribute(flow_id, Count))


async def test_a_resume_token_of_a_deleted_flow_is_refused_for_the_flow_started_again(db_url: str) -> None:
    """E11: a token bound to the old flow would skip the new one's events up to its sequence."""
    async with engine_for(db_url, REGISTRY) as eng, other_client(db_url) as them:
        await closed_flow(eng, "again", "completed")  # events 1 and 2
        old = await them.read_stream("again", Log)
        assert [e.sequence for e in old.events] == [1, 2]

        assert await eng.client.delete_flow("again")
        await eng.client.start_flow("Keeper", "again", "second life")
        await listening(eng, "again")
        await eng.client.publish("again", Inbox, "bye again")
        await eng.client.wait_for_flow("again", 10)

        with pytest.raises(InvalidResumeTokenError) as caught:
            await them.read_stream("again", Log, old.resume_token)
        assert str(caught.value) == (
            "resume token belongs to an earlier flow 'again', which was deleted and started again; "
            "its positions mean nothing in the new one: read from the start (resume_token=None)")
        # Long-polling with it is refused at once too, not after the wait.
        with pytest.raises(InvalidResumeTokenError):
            await asyncio.wait_for(them.read_stream("again", Log, old.resume_token, wait_seconds=30), 10)

        # Read from the start, the new flow's events all come; its tokens work as ever.
        fresh = await them.read_stream("again", Log, limit=1)
        assert [(e.sequence, e.value) for e in fresh.events] == [(1, "filled second life")]
        rest = await them.read_stream("again", Log, fresh.resume_token)
        assert [(e.sequence, e.value) for e in rest.events] == [(2, "got bye again")]
        assert (await them.read_stream("again", Log, rest.resume_token)).events == []


# A bound on a long poll that must end within a tick or two: only a broken watcher reaches it.
LONG_POLL_BOUND_SECONDS = 20.0


@pytest.mark.parametrize("started_again", [False, True])
async def test_a_long_poll_ends_when_its_flow_is_deleted_meanwhile(
    db_url: str, monkeypatch: pytest.MonkeyPatch, started_again: bool
) -> None:
    """A reader long-polling a flow that is stopped and deleted between two looks of the watcher
    (retention, say) hears so at once: FlowNotFoundError, or InvalidResumeTokenError when the ID was
    started again, here with as many events as the token had read, not after its whole wait.
    Catches: a watcher that wakes a reader only when its stream's newest sequence moves, which the
    deleted flow's does not, nor that of one started again with as many events."""
    async with engine_for(db_url, REGISTRY) as eng, other_client(db_url) as them:
        await eng.client.start_flow("Keeper", "gone", "hello")
        await listening(eng, "gone")
        read = await them.read_stream("gone", Log)
        assert [e.sequence for e in read.events] == [1]
        # The watcher looks only once the flow is gone (and back): a look between would see it
        # stopped and wake the reader with flow_closed instead.
        look = asyncio.Event()
        real_newest = them.store.newest_sequences

        async def held(keys: list[tuple[str, str]]) -> list[tuple[int, int] | None]:
            await look.wait()
            return await real_newest(keys)

        monkeypatch.setattr(them.store, "newest_sequences", held)
        reads = count_calls(monkeypatch, them.store, "read_events")
        waiting = asyncio.create_task(them.read_stream("gone", Log, read.resume_token, wait_seconds=60))
        await idle(reads, [waiting])

        await eng.client.stop_flow("gone")
        assert await eng.client.delete_flow("gone")
        if started_again:
            await eng.client.start_flow("Keeper", "gone", "second life")  # event 1 only
            await listening(eng, "gone")
        look.set()
        expected = InvalidResumeTokenError if started_again else FlowNotFoundError
        with pytest.raises(expected):
            await asyncio.wait_for(waiting, LONG_POLL_BOUND_SECONDS)


def legacy_token(secret: bytes, flow_id: str, stream: str, sequence: int) -> str:
    """A token as made before tokens named the flow's start: a signed [flow, stream, sequence]."""
    body = base64.urlsafe_b64encode(json.dumps([flow_id, stream, sequence]).encode()).rstrip(b"=")
    mac = base64.urlsafe_b64encode(hmac.new(secret, body, hashlib.sha256).digest()[:16]).rstrip(b"=")
    return (body + b"." + mac).decode()


async def test_a_token_made_before_tokens_named_the_flows_start_reads_as_before(db_url: str) -> None:
    """A token of the earlier format (flow, stream, sequence) cannot be told from one of the current
    flow: it is accepted, and the token returned names the flow's start."""
    async with engine_for(db_url, REGISTRY) as eng:
        await closed_flow(eng, "legacy", "completed")
        legacy = legacy_token(await eng.store.stream_secret(), "legacy", "Log", 1)
        read = await eng.client.read_stream("legacy", Log, legacy)
        assert [e.value for e in read.events] == ["got bye"]
        assert len(read.resume_token) > len(legacy)


async def test_another_client_reads_a_flow_started_again_with_another_type(db_url: str) -> None:
    """Clients that read the old flow check names and decode values by the stored type, not the one
    they remembered."""
    async with engine_for(db_url, REGISTRY) as eng, other_client(db_url) as them, other_client(db_url) as others:
        await closed_flow(eng, "swap", "completed")
        for client in (them, others):  # both remember Keeper
            assert [e.value for e in (await client.read_stream("swap", "Log")).events] == ["filled hello", "got bye"]

        await restarted_as_other(eng, "swap", 7)

        # A stream both declare: decoded as Other's (int), not as Keeper's (str).
        assert [e.value for e in (await them.read_stream("swap", "Log")).events] == [7]
        # A name Keeper does not declare: checked against Other.
        assert await others.get_attribute("swap", Count) == 7


async def test_another_client_cannot_publish_by_the_old_type_to_a_flow_started_again(db_url: str) -> None:
    """A publish to a channel the new flow's type does not declare is refused, and queues nothing."""
    async with engine_for(db_url, REGISTRY) as eng, other_client(db_url) as them:
        await closed_flow(eng, "swap", "completed")
        assert await them.get_attribute("swap", Note) == "hello"  # remembers Keeper

        await restarted_as_other(eng, "swap", 7)

        with pytest.raises(UndeclaredNameError, match="channel 'Inbox' is not declared by flow type 'Other'"):
            await them.publish("swap", Inbox, "for Keeper")
        rows = await eng.store.raw(lambda db: db.all("SELECT channel FROM channel_messages WHERE flow_id = ?",
                                                     ("swap",)))
        assert rows == []
        await them.publish("swap", Tally, 1)  # Other's channel: it takes it and completes
        assert (await eng.client.wait_for_flow("swap", 10)).status == "completed"


async def test_another_client_runs_no_rpc_of_the_old_type_on_a_flow_started_again(db_url: str) -> None:
    """An RPC that reads nothing commits without a snapshot: its commit checks the type, so the old
    type's handler writes nothing into the new flow."""
    async with engine_for(db_url, REGISTRY) as eng, other_client(db_url) as them:
        await eng.client.start_flow("Jotter", "swap")
        await them.rpc("swap", "jot", "first")  # remembers Jotter
        assert await eng.client.get_attribute("swap", Note) == "first"
        await eng.client.publish("swap", Tally, 1)
        await eng.client.wait_for_flow("swap", 10)

        await restarted_as_other(eng, "swap", 7)

        with pytest.raises(RpcNotFoundError, match="'Other'"):
            await them.rpc("swap", "jot", "into Other")
        rows = await eng.store.raw(lambda db: db.all("SELECT name FROM attributes WHERE flow_id = ?", ("swap",)))
        assert rows == [("Count",)]


async def flow_version(eng: Engine, flow_id: str) -> int:
    row = await eng.store.raw(lambda db: db.one("SELECT version FROM flows WHERE flow_id = ?", (flow_id,)))
    assert row is not None
    return int(row[0])


@pytest.mark.parametrize(("name", "request_", "answer", "note"), [
    ("remark", "seen", "new", "new seen"),  # its commit
    ("glance", None, ["new", None], "new"),  # its ctx.load, in an RPC that writes nothing
])
async def test_an_rpc_decided_on_the_old_flow_does_not_commit_into_the_flow_started_again(
    db_url: str, name: str, request_: object, answer: object, note: str,
) -> None:
    """E8: an RPC that read the old flow, and whose handler still ran when the flow was stopped,
    deleted and started again, and the new flow reached the version it read, commits nothing decided
    from the old flow's state (nor loads the new flow's rows into the old one's snapshot): the
    version alone matched (it counts from the start again), so its writes landed in the new flow.
    It runs again on the new flow's state, as after a lost race."""
    REMARK_GATE["reached"] = reached = asyncio.Event()
    REMARK_GATE["gate"] = gate = asyncio.Event()
    # No worker: only the test's calls change the versions.
    async with engine_for(db_url, REGISTRY, worker=False) as eng, other_client(db_url) as them:
        await eng.client.start_flow("Jotter", "reborn")
        for n in range(6):  # the old flow's version well above where the new one starts
            await eng.client.rpc("reborn", "jot", f"old {n}")
        await eng.client.rpc("reborn", "jot", "old")
        read_at = await flow_version(eng, "reborn")
        remarking = asyncio.create_task(them.rpc("reborn", name, request_))
        await asyncio.wait_for(reached.wait(), 10)

        await eng.client.stop_flow("reborn", "replaced")
        assert await eng.client.delete_flow("reborn")
        await eng.client.start_flow("Jotter", "reborn")
        await eng.client.rpc("reborn", "jot", "new")
        while await flow_version(eng, "reborn") < read_at:
            await eng.client.rpc("reborn", "jot", "new")
        assert await flow_version(eng, "reborn") == read_at  # the stale commit's check passes on the version

        gate.set()
        assert await asyncio.wait_for(remarking, 10) == answer
        assert await eng.client.get_attribute("reborn", Note) == note


@pytest.mark.sqlite_only  # the attribute cache is SQLite's
async def test_a_flow_deleted_and_started_again_in_its_millisecond_is_not_read_from_the_old_ones_rows(
    db_url: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A store keeps the attribute rows it read, by flow, for the flow's version and start time (ms).
    Here the flow is deleted and another client starts it again in the same millisecond and brings
    it to the version the old one was deleted at: the store that deleted it must read the new flow's
    rows. Catches the deleted flow's rows left in that store's cache (found by version and start
    time, both matching)."""
    monkeypatch.setattr("dex_engine._store.now_ms", lambda: 1_700_000_000_000)  # one millisecond throughout
    async with engine_for(db_url, REGISTRY, worker=False) as eng, other_client(db_url) as them:
        await eng.client.start_flow("Jotter", "again")
        await eng.client.rpc("again", "jot", "old")
        assert await eng.client.rpc("again", "read_note", None) == "old"  # our store now keeps Note's rows
        await eng.client.stop_flow("again", "replaced")
        old_version = await flow_version(eng, "again")
        assert await eng.client.delete_flow("again")

        await them.start_flow("Jotter", "again")
        await them.rpc("again", "jot", "new")
        await them.stop_flow("again", "replaced")
        assert await flow_version(eng, "again") == old_version
        assert await eng.client.get_attribute("again", Note) == "new"
