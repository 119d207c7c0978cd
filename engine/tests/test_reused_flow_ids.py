"""A flow ID deleted (delete_flow, retention) and started again, seen by another client that read the
old flow: its resume tokens of the old flow are refused (E11).

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

from dex_engine import AsyncClient, InvalidResumeTokenError, Registry
from dex_engine._open import open_store

from .conftest import engine_for
from .test_delete_flow import KEEPER, Inbox, Log, closed_flow, listening

REGISTRY = Registry([KEEPER])


@asynccontextmanager
async def other_client(db_url: str) -> AsyncIterator[AsyncClient]:
    """Another client of the database, on a store of its own (as another process would be)."""
    async with AsyncClient(REGISTRY, store=open_store(db_url)) as client:
        yield client


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
