"""Shared fixtures: a private database file per test, an in-process worker with short timings."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from dex_engine import AsyncClient, AsyncWorker, Registry, Store, WorkerOptions, open_store

# Test timings: leases expire in 1 s, housekeeping runs about every 0.1 s.
FAST = WorkerOptions(
    database_url="unused",
    lease_ttl_seconds=1.0,
    lease_renew_seconds=0.25,
    housekeeping_seconds=0.1,
    poll_seconds=0.01,
    shutdown_grace_seconds=1.0,
)


def backend_urls(tmp_path: Path) -> list[str]:
    return [f"sqlite:///{tmp_path / 'engine.db'}"]


@pytest.fixture(params=["sqlite"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'engine.db'}"
    dsn = os.environ.get("TEST_PG_DSN")
    if not dsn:
        pytest.skip("TEST_PG_DSN is not set: PostgreSQL backend not tested")
    return dsn


class Engine:
    """A store, a client and (optionally) an in-process worker on one database."""

    def __init__(self, store: Store, registry: Registry) -> None:
        self.store = store
        self.registry = registry
        self.client = AsyncClient(registry, store=store)
        self.worker: AsyncWorker | None = None

    async def start_worker(self, **overrides: Any) -> AsyncWorker:
        opts = WorkerOptions(**{**FAST.__dict__, "database_url": self.store.url, **overrides})
        worker = AsyncWorker(self.registry, opts, store=self.store)
        await worker.__aenter__()
        self.worker = worker
        return worker


@asynccontextmanager
async def engine_for(db_url: str, registry: Registry, *, worker: bool = True) -> AsyncIterator[Engine]:
    store = open_store(db_url)
    eng = Engine(store, registry)
    try:
        if worker:
            await eng.start_worker()
        yield eng
    finally:
        if eng.worker is not None:
            await eng.worker.stop()
        await store.close()


async def wait_until(description: str, probe: Callable[[], Awaitable[Any]], timeout: float = 10.0) -> Any:
    """Poll `probe` until it returns a truthy value; fail naming `description` after `timeout`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = await probe()
        if value:
            return value
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {description}; last value {value!r}")
        await asyncio.sleep(0.01)
