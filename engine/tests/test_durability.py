"""Durability modes (ENGINE.md section 3): which fsync level each commit gets, and crash survival."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from dex_engine import (
    AsyncClient,
    AsyncWorker,
    Attribute,
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
    Stream,
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
    conn = sqlite3.connect(db)
    try:
        assert conn.execute("SELECT status, output FROM flows WHERE flow_id = 'crash-1'").fetchone() == (
            "completed", b"42")
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    finally:
        conn.close()


# Application-crash images (RELIABILITY.md T05) -------------------------------------------------

IMAGE_COMMITS = 1000
IMAGES = 25

Tally = Attribute("Tally", int)
Mirror = Attribute("Mirror", int)
Tallies = Channel("Tallies", int)
TallyLog = Stream("TallyLog", int)


@rpc(request_type=int)
async def record_tally(ctx: RpcContext, n: int) -> None:
    """Commit n in four tables at once: two attributes, a channel message and a stream event."""
    ctx.set(Tally, n)
    ctx.set(Mirror, n)
    ctx.publish(Tallies, n)
    ctx.append(TallyLog, n)


async def _tally_wait(ctx: Context, _: Any) -> Wait:
    return Wait.until(Tallies.for_n(IMAGE_COMMITS + 1))  # never satisfied: the messages stay queued


TALLY_FLOW = Flow("Tally", [Step("Hold", _noop, wait_for=_tally_wait)], start_step="Hold",
                  schema=[Tally, Mirror, Tallies, TallyLog], rpcs=[record_tally])


def _image_state(path: Path) -> tuple[str, int | None, int | None, int, int]:
    """(integrity_check, Tally, Mirror, queued messages, stream events) of one image, read with sqlite3."""
    conn = sqlite3.connect(path)
    try:
        check = str(conn.execute("PRAGMA integrity_check").fetchone()[0])

        def attribute(name: str) -> int | None:
            row = conn.execute("SELECT value FROM attributes WHERE flow_id = 'tally' AND name = ?", (name,)).fetchone()
            return None if row is None else int(json.loads(bytes(row[0])))

        messages = conn.execute("SELECT count(*) FROM channel_messages WHERE flow_id = 'tally'").fetchone()[0]
        events = conn.execute("SELECT count(*) FROM stream_events WHERE flow_id = 'tally'").fetchone()[0]
        return check, attribute("Tally"), attribute("Mirror"), int(messages), int(events)
    finally:
        conn.close()


def _take_images(script: str, db: Path, acks: Path, rng: random.Random) -> tuple[list[tuple[Path, int]], int, str]:
    """Run `script` in a child, freeze it up to IMAGES times at random moments and copy `db` with its
    WAL and shared memory while it is frozen: (image directory, last acknowledged commit) each, then
    the child's exit code and stderr. The pauses between freezes pick the moments, not a wait."""
    proc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True)
    images: list[tuple[Path, int]] = []
    try:
        deadline = time.monotonic() + 60
        while proc.poll() is None and not acks.exists():  # its imports take a while: freeze commits only
            assert time.monotonic() < deadline, "the child made no commit within 60 s"
            time.sleep(0.01)
        while proc.poll() is None and len(images) < IMAGES:
            time.sleep(rng.uniform(0.0, 0.02))
            os.kill(proc.pid, signal.SIGSTOP)
            try:
                image = db.parent / f"image-{len(images)}"
                image.mkdir()
                for suffix in ("", "-wal", "-shm"):
                    if Path(f"{db}{suffix}").exists():
                        shutil.copyfile(f"{db}{suffix}", image / f"{db.name}{suffix}")
                lines = acks.read_text().split() if acks.exists() else []
                images.append((image, int(lines[-1]) if lines else 0))
            finally:
                os.kill(proc.pid, signal.SIGCONT)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return images, proc.returncode, stderr


@pytest.mark.slow
async def test_crash_images_hold_every_acknowledged_commit_whole(tmp_path: Path) -> None:
    """A client process commits RPCs one after another (each writes two attributes, a message and an
    event) and logs each acknowledgement; the test freezes it (SIGSTOP) at random moments, copies the
    database, WAL and shared-memory files (what an application crash leaves) and lets it go on. Every
    image must pass integrity_check, hold a whole prefix of the commits (all four writes of each, none
    of a later one), and hold every commit acknowledged before the freeze; the engine must open it
    and read the same state. Catches: an RPC acknowledged before its commit reached the WAL (group
    commit or a deferred write), or one commit split over several transactions."""
    db = tmp_path / "tally.db"
    acks = tmp_path / "acks"
    url = f"sqlite:///{db}"
    async with AsyncClient(Registry([TALLY_FLOW]), url) as client:
        await client.start_flow("Tally", "tally")
    script = textwrap.dedent(f"""
        import asyncio, os, sys
        sys.path.insert(0, {str(Path(__file__).parents[2])!r})
        from engine.tests.test_durability import TALLY_FLOW, IMAGE_COMMITS
        from dex_engine import AsyncClient, Registry

        async def main():
            fd = os.open({str(acks)!r}, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            async with AsyncClient(Registry([TALLY_FLOW]), {url!r}) as client:
                for n in range(1, IMAGE_COMMITS + 1):
                    await client.rpc("tally", "record_tally", n)
                    os.write(fd, b"%d\\n" % n)

        asyncio.run(main())
    """)
    seed = random.randrange(2**32)
    images, returncode, stderr = _take_images(script, db, acks, random.Random(seed))
    assert returncode == 0, stderr
    acked = [n for _, n in images]
    # Reachable: some images froze the child between two commits, not before or after them all.
    assert any(0 < n < IMAGE_COMMITS for n in acked), f"seed {seed}: images at acks {acked}"
    for image, acknowledged in images:
        check, tally, mirror, messages, events = _image_state(image / "tally.db")
        held = tally or 0
        where = f"seed {seed}, image {image.name} (frozen after ack {acknowledged})"
        assert check == "ok", where
        assert (tally or 0, mirror or 0, messages, events) == (held, held, held, held), where
        assert held >= acknowledged, f"{where}: acknowledged commits missing"
        async with AsyncClient(Registry([TALLY_FLOW]), f"sqlite:///{image / 'tally.db'}") as reader:
            assert await reader.get_attribute("tally", Tally) == tally, where
            assert len((await reader.read_stream("tally", TallyLog)).events) == held, where
