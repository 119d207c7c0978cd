"""How a PostgreSQL store's connections show in pg_stat_activity, where operators look for them
(docs/deployment.md, "Pool sizes"): the lanes under the URL's application_name, else dex_engine, and
the listener under the same name with _listen appended; and what the lanes do with operations as
the store closes. These tests need TEST_PG_DSN."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import Counter

import psycopg
import pytest

from dex_engine import (
    AsyncClient,
    AttributeMap,
    Context,
    Flow,
    FlowNotFoundError,
    Registry,
    RpcContext,
    Step,
    StepDecision,
    Timer,
    Wait,
    open_store,
    rpc,
)

from .conftest import close_twice, engine_for, wait_until


async def _done(ctx: Context, _: None) -> StepDecision:
    return StepDecision.force_complete("done")


REGISTRY = Registry([Flow("Once", [Step("Run", _done)], start_step="Run")])


async def _names_seen(admin_url: str, url: str) -> Counter[str]:
    """Run one flow on an engine whose store is opened on `url`; the application names of the
    database's sessions once its listener is connected."""

    def names() -> Counter[str]:
        with psycopg.connect(admin_url, autocommit=True) as conn:
            rows = conn.execute(
                "SELECT application_name FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            ).fetchall()
        return Counter(row[0] for row in rows)

    async def listening() -> Counter[str] | None:
        seen = await asyncio.to_thread(names)
        return seen if any(name.endswith("_listen") for name in seen) else None

    async with engine_for(url, REGISTRY) as eng:
        await eng.client.start_flow("Once", "o")
        assert (await eng.client.wait_for_flow("o", 10)).status == "completed"
        seen: Counter[str] = await wait_until("the store's listener to connect", listening)
        return seen


async def test_a_store_names_its_connections_dex_engine(pg_database: str) -> None:
    """Catches: connections left unnamed (or named "None") when the URL names none."""
    seen = await _names_seen(pg_database, pg_database)
    assert set(seen) == {"dex_engine", "dex_engine_listen"}, seen
    assert seen["dex_engine_listen"] == 1, seen


async def test_a_store_names_its_connections_as_its_url_says(pg_database: str) -> None:
    """Catches: the URL's application_name overridden by the default."""
    seen = await _names_seen(pg_database, f"{pg_database}?application_name=billing")
    assert set(seen) == {"billing", "billing_listen"}, seen
    assert seen["billing_listen"] == 1, seen


async def test_operations_queued_as_the_store_closes_run_and_later_ones_are_refused(
    pg_database: str,
) -> None:
    """Catches: operations queued just before close() dropped or left waiting, and one queued after
    the lanes stopped (a caller on another loop past the closed check) waiting for ever."""
    store = open_store(pg_database)
    pending = [asyncio.ensure_future(store.describe_flow(f"none-{i}")) for i in range(50)]
    await asyncio.sleep(0)  # each call is queued to the lanes before the store closes
    await store.close()
    results = await asyncio.wait_for(asyncio.gather(*pending, return_exceptions=True), 10)
    assert all(isinstance(r, FlowNotFoundError) for r in results), results  # every one ran

    store._closed = False  # type: ignore[attr-defined]  # as if its closed check ran just before close()
    with pytest.raises(RuntimeError, match="is closed"):
        await asyncio.wait_for(store.describe_flow("late"), 10)


async def test_a_close_whose_caller_is_cancelled_still_closes_every_connection(pg_database: str) -> None:
    """A client's close cancelled as it waits (asyncio.timeout around it, a cancelled shutdown) still
    ends with no session of the store left on the server. Catches: the pool closed only once the
    caller resumed after the lanes stopped, so a cancel there left its connections (and threads)
    open until the process exited; a second close returned at once, the store being closed."""
    url = f"{pg_database}?application_name=cancelled_close"
    client = AsyncClient(REGISTRY, url)
    await client.start_flow("Once", "o")
    closing = asyncio.ensure_future(client.close())
    await asyncio.sleep(0)  # the lanes are told to stop; the caller waits for them
    closing.cancel()
    await asyncio.gather(closing, return_exceptions=True)
    await client.close()

    def sessions() -> int:
        with psycopg.connect(pg_database, autocommit=True) as conn:
            row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE "
                               "'cancelled_close%'").fetchone()
        return int(row[0]) if row else 0

    async def none_left() -> bool:
        return await asyncio.to_thread(sessions) == 0

    await wait_until("the store's sessions to end", none_left)


async def test_a_second_close_at_once_returns_only_once_the_connections_are_closed(
    pg_database: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two tasks close one store at once (a client's shutdown and its owner's) while the first is
    still stopping its threads: the second returns only once the first has closed the pool, since
    its caller may then drop the database. Catches: a second close that returns at once, the store
    being marked closed."""
    store = open_store(pg_database)
    release = threading.Event()
    join_threads = store._join_threads  # type: ignore[attr-defined]

    def held_join() -> None:  # the first close's thread stops here until the second close was asked
        release.wait(10)
        join_threads()

    monkeypatch.setattr(store, "_join_threads", held_join)
    try:
        first, second = await close_twice(store, "the first was still closing the store")
    finally:
        release.set()
    await asyncio.gather(first, second)
    assert store._pool.closed  # type: ignore[attr-defined]


def _wide(n: int) -> str:
    """n characters of four UTF-8 bytes each (CJK Extension B)."""
    return "".join(chr(0x20000 + i) for i in range(n))


WIDE = AttributeMap(_wide(200), str)


@rpc(request_type=str)
async def put_wide(ctx: RpcContext, key: str) -> None:
    ctx.set(WIDE[key], "v")


async def _wait(ctx: Context, _: None) -> Wait:
    return Wait.until(Timer.by_duration(3600))


WIDE_REGISTRY = Registry([Flow("Wide", [Step("Idle", _done, wait_for=_wait)], start_step="Idle",
                               schema=[WIDE], rpcs=[put_wide])])


async def test_a_row_past_an_index_limit_fails_at_once_not_as_a_lost_connection(
    pg_database: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """A write whose index row is past PostgreSQL's size limit (a flow ID, map name and key of 4-byte
    characters) fails with the server's error on its one try. Catches: that error (an
    OperationalError by its SQLSTATE class) taken for a lost connection, tried eight times over
    seconds with a "connection lost" warning each, and its COMMIT's outcome looked up."""
    client = AsyncClient(WIDE_REGISTRY, pg_database)
    try:
        flow_id = _wide(255)
        await client.start_flow("Wide", flow_id)
        with caplog.at_level(logging.WARNING, logger="dex_engine"), pytest.raises(psycopg.errors.ProgramLimitExceeded):
            await client.rpc(flow_id, "put_wide", _wide(255))
        assert [r.getMessage() for r in caplog.records if "connection lost" in r.getMessage()] == []
        assert await client.rpc(flow_id, "put_wide", "short") is None  # the store goes on
    finally:
        await client.close()


async def test_a_statement_cut_by_the_urls_statement_timeout_is_not_reported_as_a_lost_connection(
    pg_database: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """A statement the server cancels (here by a statement_timeout set in the URL, as an operator
    may set one) is tried again, as a lock wait it cut may pass next time, and each retry's warning
    names the server's error; the last one's error is raised. Catches: every retry logged as
    "database connection lost", which sends whoever reads the log after the network, not the
    timeout (or the full disk, or whatever else the server refused)."""
    store = open_store(f"{pg_database}?options=-c%20statement_timeout%3D50")
    try:
        with caplog.at_level(logging.WARNING, logger="dex_engine"), pytest.raises(psycopg.errors.QueryCanceled):
            await store.raw(lambda db: db.one("SELECT pg_sleep(1)"))
        warnings = [r.getMessage() for r in caplog.records if r.name == "dex_engine.postgres"]
        assert len(warnings) == 7, warnings  # MAX_OP_TRIES - 1 retries
        assert all("connection lost" not in w and "QueryCanceled: canceling statement due to statement timeout" in w
                   for w in warnings), warnings
        assert await store.raw(lambda db: db.one("SELECT 1")) == (1,)  # the store goes on
    finally:
        await store.close()


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(pytest.main([__file__]))
