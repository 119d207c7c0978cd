"""Durability modes (ENGINE.md section 3): which fsync level each commit gets, and crash survival."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from dex_engine import (
    AsyncClient,
    AsyncWorker,
    Channel,
    Context,
    Flow,
    FlowConfig,
    LoadOptions,
    MovementOptions,
    Registry,
    RpcContext,
    Step,
    StepDecision,
    StepDurability,
    StepOptions,
    Wait,
    WorkerOptions,
    open_store,
    rpc,
)
from dex_engine import _sqlite_store as sqlite_store
from dex_engine import _transitions as tx
from dex_engine._decision import Movement
from dex_engine._records import DecisionRecord, StartRequest, WriteSet
from dex_engine._scheduling import movement_record

from .conftest import wait_until


async def _noop(ctx: Context, _: Any) -> StepDecision:
    return StepDecision.dead_end()


FLOW = Flow(
    "Durability",
    [
        Step("Sync", _noop, options=StepOptions(durability=StepDurability.SYNC, load=LoadOptions.none())),
        Step("Async", _noop, options=StepOptions(durability=StepDurability.ASYNC, load=LoadOptions.none())),
        Step("Default", _noop, options=StepOptions(load=LoadOptions.none())),
    ],
    start_step="Default",
)

SYNC_LEVELS = {1: "NORMAL", 2: "FULL"}


def sync_level(db: tx.Db) -> str:
    """PRAGMA synchronous of the running transaction, by name."""
    row = db.one("PRAGMA synchronous")
    assert row is not None
    return SYNC_LEVELS[int(row[0])]


def record_operation_levels(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """From now on, for each operation the SQLite store runs: the qualified name of its function
    and the synchronous level it runs at."""
    ran: list[tuple[str, str]] = []
    original = sqlite_store.run_op

    def spying(fn: Any, db: tx.Db) -> Any:
        ran.append((fn.__qualname__, sync_level(db)))
        return original(fn, db)

    monkeypatch.setattr(sqlite_store, "run_op", spying)
    return ran


async def _commit_levels(url: str, config: FlowConfig, step_types: list[str],
                         monkeypatch: pytest.MonkeyPatch, overrides: dict[str, MovementOptions] | None = None
                         ) -> dict[str, str]:
    """Commit one Execute per Step type by hand and record PRAGMA synchronous inside each commit."""
    seen: dict[str, str] = {}
    original = tx.commit_execute

    def spying(db: tx.Db, lease: Any, writes: WriteSet, decision: DecisionRecord, now: int, *rest: Any) -> None:
        seen[lease.step_type] = sync_level(db)
        original(db, lease, writes, decision, now, *rest)

    monkeypatch.setattr(tx, "commit_execute", spying)
    store = open_store(url)
    try:
        await store.register_worker("w", "h", 1, 60_000)
        for i, step_type in enumerate(step_types):
            flow_id = f"f{i}"
            movement = movement_record(FLOW, Movement(step_type, None, (overrides or {}).get(step_type)))
            await store.start_flow(StartRequest(flow_id, "Durability", b"null", config, movement))
            (lease,) = await store.claim("w", ["Durability"], 1)
            await store.commit_execute(lease, WriteSet(), DecisionRecord("dead_end"))
    finally:
        await store.close()
    return seen


async def test_sync_steps_commit_with_fsync_and_async_steps_without(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SYNC Step's commit runs at synchronous=FULL, an ASYNC one at NORMAL; explicit Step
    durability beats the flow's default, and the default applies to Steps that set none."""
    url = f"sqlite:///{tmp_path / 'd.db'}"
    seen = await _commit_levels(url, FlowConfig(default_step_durability=StepDurability.ASYNC),
                                ["Sync", "Async", "Default"], monkeypatch)
    assert seen == {"Sync": "FULL", "Async": "NORMAL", "Default": "NORMAL"}


async def test_flow_default_sync_and_movement_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a SYNC flow default a Step without durability commits at FULL; a movement's
    override wins over the Step's own option."""
    url = f"sqlite:///{tmp_path / 'd.db'}"
    seen = await _commit_levels(
        url, FlowConfig(default_step_durability=StepDurability.SYNC), ["Default", "Sync"], monkeypatch,
        overrides={"Sync": MovementOptions(durability=StepDurability.ASYNC)},
    )
    assert seen == {"Default": "FULL", "Sync": "NORMAL"}


async def test_normal_database_keeps_sync_steps_at_the_database_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a database opened with synchronous=NORMAL every commit is NORMAL (documented window)."""
    url = f"sqlite:///{tmp_path / 'd.db'}?synchronous=NORMAL"
    seen = await _commit_levels(url, FlowConfig(), ["Sync", "Async"], monkeypatch)
    assert seen == {"Sync": "NORMAL", "Async": "NORMAL"}


_INBOX: Channel[str] = Channel("Inbox", str)


@rpc(request_type=str)
async def note(ctx: RpcContext, text: str) -> None:
    ctx.publish(_INBOX, text)


async def _listen_wait(ctx: Context, _: Any) -> Wait:
    return Wait.until(_INBOX.for_one())


async def _listen(ctx: Context, _: Any) -> StepDecision:
    return StepDecision.go_to("Listen")


_NO_LOAD = StepOptions(load=LoadOptions.none())
_CLIENT_FLOW = Flow(
    "ClientWrites",
    [Step("Default", _listen, options=_NO_LOAD), Step("Listen", _listen, wait_for=_listen_wait, options=_NO_LOAD)],
    start_step="Default", schema=[_INBOX], rpcs=[note],
)


# The operations through which a client's writes reach the store, by the qualified name of the
# function the store runs: its own, or, when a worker of this process may take the Steps the write
# readies, the hand-off's (Store._run_handing_off), which claims them in the same transaction.
_HANDED_OFF = "Store._run_handing_off.<locals>.op"
_CLIENT_OPS = ("Store.start_flow.", "Store.rpc_commit.", "Store.publish.", "Store.stop_flow.", _HANDED_OFF)


@pytest.mark.parametrize("worker", [False, True], ids=["client alone", "worker of this process"])
async def test_client_writes_commit_with_fsync_whatever_the_flows_step_durability(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, worker: bool
) -> None:
    """Starting a flow, an RPC, a publish and a stop are acknowledged only once fsynced (FULL), even
    for a flow whose Steps default to ASYNC: a caller told "started" or "sent" must not lose it.
    With a worker of this process on the same store, a write that readies Steps also claims them
    for it in the same transaction, right after the worker's ASYNC commits: still fsynced."""
    registry = Registry([_CLIENT_FLOW])
    store = open_store(f"sqlite:///{tmp_path / 'd.db'}")
    client = AsyncClient(registry, store=store)
    running = AsyncWorker(registry, WorkerOptions(database_url=store.url, poll_seconds=0.01), store=store)

    async def settled(flow_ids: tuple[str, ...]) -> None:
        """Wait for every flow to wait on its inbox: the worker's ASYNC commits are done."""

        async def waiting() -> bool:
            infos = [await store.describe_flow(f) for f in flow_ids]
            return all([s.state for s in i.active_steps] == ["waiting"] for i in infos)

        await wait_until("the worker to finish its Steps", waiting)

    async def client_write(call: Callable[[], Awaitable[Any]], *settle: str) -> tuple[str, str]:
        if worker:
            await settled(settle)
        ran.clear()
        await call()
        (op,) = [(name, level) for name, level in ran if name.startswith(_CLIENT_OPS)]
        return op

    ran = record_operation_levels(monkeypatch)
    if worker:
        await running.__aenter__()
    async_config = FlowConfig(default_step_durability=StepDurability.ASYNC)
    seen: dict[str, tuple[str, str]] = {}
    try:
        seen["start"] = await client_write(
            lambda: client.start_flow("ClientWrites", "c1", config_override=async_config))
        seen["start another"] = await client_write(
            lambda: client.start_flow("ClientWrites", "c2", config_override=async_config), "c1")
        seen["rpc"] = await client_write(lambda: client.rpc("c1", "note", "by rpc"), "c1", "c2")
        seen["publish"] = await client_write(lambda: client.publish("c1", _INBOX, "published"), "c1", "c2")
        seen["stop"] = await client_write(lambda: client.stop_flow("c1", "done"), "c1", "c2")
        if worker:
            await settled(("c2",))
    finally:
        if worker:
            await running.stop()
        await store.close()
    assert {name: level for name, (_, level) in seen.items()} == dict.fromkeys(seen, "FULL"), seen
    handed_off = {name for name, (op, _) in seen.items() if op == _HANDED_OFF}
    # A stop may revoke running attempts, so it always commits by itself, waking the worker (E9).
    assert handed_off == ({"start", "start another", "rpc", "publish"} if worker else set()), seen


def test_async_commit_survives_sigkill_right_after_it_is_acknowledged(tmp_path: Path) -> None:
    """ASYNC (synchronous=NORMAL) loses nothing to a process crash: a child commits an ASYNC
    Step, prints the acknowledgement and SIGKILLs itself; the committed state is there after."""
    db = tmp_path / "crash.db"
    script = textwrap.dedent(f"""
        import asyncio, os, signal, sys
        sys.path.insert(0, {str(Path(__file__).parents[2])!r})
        from engine.tests.test_durability import FLOW
        from dex_engine import open_store, FlowConfig, StepDurability
        from dex_engine._decision import Movement
        from dex_engine._records import DecisionRecord, StartRequest, WriteSet
        from dex_engine._scheduling import movement_record

        async def main():
            store = open_store("sqlite:///{db}")
            await store.register_worker("w", "h", 1, 60_000)
            config = FlowConfig(default_step_durability=StepDurability.ASYNC)
            m = movement_record(FLOW, Movement("Async", None))
            await store.start_flow(StartRequest("crash-1", "Durability", b"null", config, m))
            (lease,) = await store.claim("w", ["Durability"], 1)
            writes = WriteSet()
            await store.commit_execute(lease, writes, DecisionRecord("force_complete", output=b"42"))
            print("acknowledged", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

        asyncio.run(main())
    """)
    proc = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=60)
    assert proc.returncode == -9, proc.stderr
    assert proc.stdout.strip() == "acknowledged"
    import sqlite3

    conn = sqlite3.connect(db)
    try:
        assert conn.execute("SELECT status, output FROM flows WHERE flow_id = 'crash-1'").fetchone() == (
            "completed", b"42")
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    finally:
        conn.close()
