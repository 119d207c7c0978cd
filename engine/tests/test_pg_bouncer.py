"""The PostgreSQL store behind PgBouncer (docs/deployment.md, "Pool sizes"). In session mode, the
documented way, everything works: prepared statements, pipelines, and the LISTEN that wakes an
idle worker. In transaction mode (the default of many managed offerings) or statement mode the
store cannot work (its LISTEN hears nothing; psycopg's prepared statements fail with "prepared
statement "_pg3_0" does not exist" in the next transaction), so opening it is refused with a
StoreOpenError that names the pooler and what to do, rather than failing later with psycopg errors.

These tests need TEST_PG_DSN and the pgbouncer program (Debian's package `pgbouncer`); without it
they skip. Each starts a PgBouncer of its own on a free port of 127.0.0.1, in front of TEST_PG_DSN's
server, with auth_type = trust."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

from dex_engine import (
    AsyncClient,
    AsyncWorker,
    Context,
    Flow,
    Registry,
    Step,
    StepDecision,
    Store,
    StoreOpenError,
    WorkerOptions,
    open_store,
)

PGBOUNCER = shutil.which("pgbouncer") or next(
    (path for path in ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer") if os.access(path, os.X_OK)), None)

pytestmark = pytest.mark.skipif(PGBOUNCER is None, reason="pgbouncer is not installed (apt-get install "
                                "pgbouncer): the store behind PgBouncer not tested")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def pgbouncer(database_url: str, pool_mode: str, directory: Path) -> Iterator[str]:
    """A PgBouncer in `pool_mode` in front of `database_url`'s server; yields `database_url` through it."""
    assert PGBOUNCER is not None
    parts = urlsplit(database_url)
    user = parts.username or "postgres"
    port = _free_port()
    (directory / "users.txt").write_text(f'"{user}" ""\n')
    (directory / "pgbouncer.ini").write_text(
        "[databases]\n"
        f"* = host={parts.hostname} port={parts.port or 5432}\n"
        "[pgbouncer]\n"
        f"listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n"
        f"auth_type = trust\nauth_file = {directory / 'users.txt'}\npool_mode = {pool_mode}\n"
        "max_client_conn = 100\ndefault_pool_size = 20\n")
    command = [PGBOUNCER, str(directory / "pgbouncer.ini")]
    if os.geteuid() == 0:  # PgBouncer refuses to run as root; -u switches once it read its files
        command[1:1] = ["-u", _unprivileged_user()]
    log = (directory / "pgbouncer.log").open("w")
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"pgbouncer did not start: {(directory / 'pgbouncer.log').read_text()[-2000:]}")
            time.sleep(0.05)
        yield urlunsplit(parts._replace(netloc=f"{parts.netloc.rsplit('@', 1)[0]}@127.0.0.1:{port}"))
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


def _unprivileged_user() -> str:
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name).pw_name
    pytest.skip("pgbouncer must not run as root, and there is no postgres or nobody user to run it as")


@pytest.mark.parametrize("pool_mode", ["transaction", "statement"])
def test_a_store_behind_a_transaction_pooler_is_refused_at_open_saying_what_to_do(
    pg_database: str, tmp_path: Path, pool_mode: str,
) -> None:
    """Through PgBouncer in transaction mode the store opened, then its operations failed with
    psycopg's "prepared statement "_pg3_0" does not exist" (or "already exists") and its listener
    heard no notification; in statement mode the open failed advising to check that the server is
    running. Either is refused at open, naming the pooler and pool_mode = session."""
    with pgbouncer(pg_database, pool_mode, tmp_path) as url, \
            pytest.raises(StoreOpenError, match="PgBouncer") as refused:
        open_store(url)
    assert "pool_mode = session" in str(refused.value)
    assert "connect to PostgreSQL directly" in str(refused.value)


async def _go(ctx: Context, _: None) -> StepDecision:
    return StepDecision.force_complete("done")


REGISTRY = Registry([Flow("BouncerQuick", [Step("Go", _go, input_type=type(None))], start_step="Go")])


@contextlib.asynccontextmanager
async def _opened(url: str) -> AsyncIterator[Store]:
    store: Store = await asyncio.to_thread(open_store, url)
    try:
        yield store
    finally:
        await store.close()


async def test_a_store_behind_pgbouncer_in_session_mode_works_and_hears_notifications(
    pg_database: str, tmp_path: Path,
) -> None:
    """docs/deployment.md's way: PgBouncer with pool_mode = session. A worker, idle with its
    housekeeping a minute away, is woken by another process's start of a flow through its LISTEN
    (through the pooler), and the flows run: the lanes' prepared statements and pipelines work."""
    with pgbouncer(pg_database, "session", tmp_path) as url:
        quiet = WorkerOptions(database_url=url, poll_seconds=0.01, housekeeping_seconds=60.0,
                              lease_ttl_seconds=300.0, lease_renew_seconds=100.0)
        async with _opened(url) as worker_store, _opened(url) as client_store, \
                AsyncWorker(REGISTRY, quiet, store=worker_store):
            client = AsyncClient(REGISTRY, store=client_store)
            for n in range(8):  # past psycopg's prepare threshold (5) for every statement
                await client.start_flow("BouncerQuick", f"q{n}")
                info = await client.wait_for_flow(f"q{n}", 20)
                assert info.status == "completed", info
