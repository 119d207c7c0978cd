"""Worker and store behaviour outside the numbered rules: failed attempts' events, skip_timer's target."""

from __future__ import annotations

import asyncio
import logging
import random
import re
import sqlite3
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from dex_engine import (
    AsyncClient,
    AsyncWorker,
    Attribute,
    Channel,
    Context,
    Flow,
    FlowAlreadyStartedError,
    FlowConfig,
    Movement,
    Registry,
    RetryPolicy,
    RpcContext,
    Step,
    StepDecision,
    StepNotWaitingError,
    StepOptions,
    Store,
    Stream,
    Timer,
    Wait,
    WorkerOptions,
    _client,
    _pg_store,
    _sqlite_store,
    _store,
    _transitions,
    _worker,
    open_store,
    rpc,
)
from dex_engine._clock import WallClockSteps
from dex_engine._open import shown_url
from dex_engine._records import DecisionRecord, StartRequest, WriteSet
from dex_engine._scheduling import movement_record

from .conftest import FAST, Engine, assert_paced, engine_for, stop_while_a_claim_lands, wait_until

Log = Stream("Log", str)
Inbox = Channel("Inbox", str)


async def _write_then_fail(ctx: Context, _: Any) -> StepDecision:
    ctx.write_event(Log, f"partial output of attempt {ctx.attempt}")
    if ctx.attempt == 1:
        raise RuntimeError("model call failed")
    return StepDecision.graceful_complete()


async def _wait_inbox(ctx: Context, _: Any) -> Wait:
    return Wait.until(Inbox.for_one())


async def _done(ctx: Context, _: Any) -> StepDecision:
    return StepDecision.graceful_complete()


FLOW = Flow(
    "Behaviour",
    [
        Step("Flaky", _write_then_fail,
             options=StepOptions(execute_retry=RetryPolicy(max_attempts=2, initial_interval_seconds=0.01))),
        Step("Listen", _done, wait_for=_wait_inbox),
    ],
    start_step="Flaky",
    schema=[Log, Inbox],
)


@pytest.mark.sqlite_only
async def test_entering_a_worker_returns_once_it_is_registered(db_url: str) -> None:
    """`async with AsyncWorker(...)` enters its block once the worker is listed as live, so another
    process (`dex-engine workers`) sees it at once. Read here on a plain sqlite3 connection with no
    await in between, which gives the worker's task no chance to catch up. Catches an __aenter__
    that returns before the registration commits, and an __aexit__ that leaves the worker running."""
    import sqlite3

    from dex_engine import AsyncWorker, WorkerOptions

    def listed() -> list[str]:
        conn = sqlite3.connect(db_url.removeprefix("sqlite:///"))
        try:
            return [r[0] for r in conn.execute("SELECT worker_id FROM workers")]
        finally:
            conn.close()

    async with AsyncWorker(Registry([FLOW]), WorkerOptions(database_url=db_url, worker_id="listed")) as worker:
        assert listed() == [worker.worker_id] == ["listed"], "not listed at once, or not under the ID it was given"
    assert listed() == [], "the worker was left running (registered) after its block"


async def test_a_started_worker_logs_its_flow_types_and_its_database(
    db_url: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """A worker logs, once registered, the flow types it runs and the database it runs them from: a
    SQLite URL with the absolute path of its file, a PostgreSQL URL with any password hidden.
    Catches the silent case a newcomer cannot tell apart from a hang: a session whose client writes
    to another database than the worker's (a relative path from another directory, the default
    sqlite:///dex.db) or whose flow type the worker's Registry leaves out, its Steps ready for ever."""
    from dex_engine import AsyncWorker, WorkerOptions

    other = Flow("Another", [Step("Done", _done, input_type=type(None))], start_step="Done")
    monkeypatch.chdir(tmp_path)
    relative = "sqlite:///relative.db"
    # The test server trusts its user, so a password in the URL is only there to be hidden.
    urls = [relative] if db_url.startswith("sqlite") else [re.sub(r"^(postgresql://[^:@/]+)@", r"\1:pw@", db_url)]
    for url in urls:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="dex_engine.worker"):
            async with AsyncWorker(Registry([FLOW, other]), WorkerOptions(database_url=url, worker_id="w1")):
                pass
        said = [r.getMessage() for r in caplog.records if "runs the Steps of" in r.getMessage()]
        where = (f"{relative} (file {tmp_path / 'relative.db'})" if url == relative
                 else shown_url(url))
        assert said == [f"worker w1 runs the Steps of flow types Another, Behaviour from {where}"]
        assert "pw" not in said[0] and (url == relative or ":pw@" in url)

    # A store given to the worker is where it runs, whatever its options' URL says.
    store = open_store(db_url)
    try:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="dex_engine.worker"):
            async with AsyncWorker(Registry([FLOW]), WorkerOptions(database_url=relative, worker_id="w2"),
                                   store=store):
                pass
    finally:
        await store.close()
    said = [r.getMessage() for r in caplog.records if "runs the Steps of" in r.getMessage()]
    where = f"{db_url} (file {db_url.removeprefix('sqlite:///')})" if db_url.startswith("sqlite") else shown_url(db_url)
    assert said == [f"worker w2 runs the Steps of flow types Behaviour from {where}"]


async def test_a_worker_id_in_use_by_a_live_worker_is_refused_at_start(db_url: str) -> None:
    """A worker starting under an ID that a live worker holds fails to start with WorkerIdInUseError
    naming it: one in this process (same host and PID, so only the process can tell), or one whose
    row in the database another process (host, PID) holds with a live lease. It leaves nothing
    behind, the live worker goes on, and the ID starts again once free. Catches: two workers under
    one ID, each handing back the other's running attempts as lost claims, and the first to stop
    failing every attempt of the other as a dead worker's, so that Steps (tool calls) ran twice."""
    from dex_engine import WorkerIdInUseError, WorkerOptions

    registry = Registry([FLOW])
    store = _sqlite_store.SqliteStore(db_url) if db_url.startswith("sqlite") else _pg_store.PostgresStore(db_url)
    try:
        options = WorkerOptions(database_url=db_url, worker_id="twin")
        async with AsyncWorker(registry, options, store=store):
            with pytest.raises(WorkerIdInUseError, match=r"^worker ID 'twin' is held by another worker running in "
                                                         r"this process; "):
                await AsyncWorker(registry, options, store=store).__aenter__()
            rows = await store.raw(lambda db: db.all("SELECT worker_id FROM workers"))
            assert [r[0] for r in rows] == ["twin"]
        async with AsyncWorker(registry, options, store=store) as again:  # free once the first stopped
            assert again.worker_id == "twin"

        await store.register_worker("elsewhere", "another-host", 4242, 600_000)
        with pytest.raises(WorkerIdInUseError, match=r"^worker ID 'elsewhere' is held by a live worker on host "
                                                     r"'another-host', PID 4242, "):
            await AsyncWorker(registry, WorkerOptions(database_url=db_url, worker_id="elsewhere")).__aenter__()
        await store.unregister_worker("elsewhere")
        async with AsyncWorker(registry, WorkerOptions(database_url=db_url, worker_id="elsewhere"), store=store):
            pass
    finally:
        await store.close()


@pytest.mark.parametrize("takeover", ["made-again", "taken-in-place"])
async def test_a_worker_whose_id_another_process_took_over_claims_nothing_and_leaves_its_row(
    db_url: str, takeover: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker whose ID another process took over claims nothing from then on, and at stop leaves
    the other process's row alone: when the row was removed and made again by that process (as
    when this one was declared dead while paused past its lease), which its next renewal finds;
    and when the row changed hands in place, which its very next poll or client commit finds, long
    before the next renewal. It says so in one log line, however often it tries to register again,
    which it does at the renewal pace (the other's lease may run out). Catches: two processes
    running under one ID, each taking the other's attempts for lost ones; polls that checked only
    that the ID had a row, so the paused worker claimed under the other's lease until its next
    renewal; the paused one's stop removing the other's row, whose running attempts housekeeping
    then failed as a dead worker's; a traceback logged at each try; and tries made as fast as the
    database answers them."""
    from dex_engine import AsyncClient, WorkerOptions

    ran: list[str] = []

    async def start(ctx: Context, _: Any) -> StepDecision:
        ran.append(ctx.flow_id)
        return StepDecision.graceful_complete()

    registry = Registry([Flow("TakenOver", [Step("Start", start)], start_step="Start")])
    store = _sqlite_store.SqliteStore(db_url) if db_url.startswith("sqlite") else _pg_store.PostgresStore(db_url)
    renew = 0.1 if takeover == "made-again" else 1800.0  # in place: no renewal within the test
    tries: list[float] = []  # the worker's registrations (the other process's are the test's)
    real_register = store.register_worker

    async def register_worker(worker_id: str, host: str, pid: int, ttl_ms: int) -> None:
        if host != "other-host":
            tries.append(time.monotonic())
        await real_register(worker_id, host, pid, ttl_ms)

    monkeypatch.setattr(store, "register_worker", register_worker)
    try:
        options = WorkerOptions(database_url=db_url, worker_id="paused", lease_ttl_seconds=3 * renew + 5,
                                lease_renew_seconds=renew, housekeeping_seconds=0.1, poll_seconds=0.01)
        async with AsyncWorker(registry, options, store=store) as worker:
            if takeover == "made-again":
                await store.unregister_worker("paused")  # declared dead, and the ID taken over:
                await store.register_worker("paused", "other-host", 9, 600_000)
                await wait_until("the worker to find its renewal refused", lambda: _true(worker._unregistered))
            else:
                await store.raw(lambda db: db.run("UPDATE workers SET host = 'other-host', pid = 9 "
                                                  "WHERE worker_id = 'paused'"), write=True)
            await AsyncClient(registry, store=store).start_flow("TakenOver", "f")
            await asyncio.sleep(0.5)  # polls, a notification and housekeeping: none may claim it
            assert ran == []
        if takeover == "made-again":
            assert len(tries) >= 3, tries  # at start, then again each renewal period
        assert_paced(tries[1:], renew)
        row = await store.raw(lambda db: db.one("SELECT host, pid FROM workers WHERE worker_id = 'paused'"))
        assert tuple(row) == ("other-host", 9)
        said = [r for r in caplog.records if r.name == "dex_engine.worker" and r.levelno >= logging.WARNING]
        messages = [r.getMessage() for r in said]
        held = [m for m in messages if "claims nothing until its ID is free again" in m]
        assert len(held) == 1 and held[0].startswith(
            "worker paused claims nothing until its ID is free again: worker ID 'paused' is held by a live worker "
            "on host 'other-host', PID 9, whose lease runs "), messages
        # Besides it, at most the warning that the worker was declared dead; no traceback.
        assert len(messages) <= 2 and all(r.exc_info is None for r in said), messages
    finally:
        await store.close()



async def test_a_worker_whose_polls_keep_failing_backs_off_and_logs_the_traceback_once(
    db_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """Polls that fail again and again (a corrupt file, a full disk) are retried after a pause that
    doubles up to POLL_RETRY_MAX_SECONDS; polls and lease renewals that keep failing each log one
    traceback for the run of failures and a line when they work again; then the worker claims work
    another process made ready. Catches: a failing database polled, and its traceback logged, every
    poll_seconds (a hundred times a second here), and renewals logging one at each retry."""
    from dex_engine import AsyncClient, WorkerOptions, open_store

    ran: list[str] = []

    async def start(ctx: Context, _: Any) -> StepDecision:
        ran.append(ctx.flow_id)
        return StepDecision.graceful_complete()

    registry = Registry([Flow("PollFails", [Step("Start", start)], start_step="Start")])
    store, other = open_store(db_url), open_store(db_url)  # `other`: a process whose commits only polls see
    failing = True

    def failing_while_asked(real: Callable[..., Awaitable[Any]], calls: list[float], error: str) -> Any:
        async def call(*args: Any, **kwargs: Any) -> Any:
            if failing:
                calls.append(time.monotonic())
                raise RuntimeError(error)
            return await real(*args, **kwargs)
        return call

    failed: list[float] = []
    renewals: list[float] = []
    monkeypatch.setattr(store, "poll", failing_while_asked(store.poll, failed, "database disk image is malformed"))
    monkeypatch.setattr(store, "renew_worker", failing_while_asked(store.renew_worker, renewals, "disk I/O error"))
    try:
        options = WorkerOptions(database_url=db_url, poll_seconds=0.01, housekeeping_seconds=0.1,
                                lease_renew_seconds=0.05, worker_id="failing")
        async with AsyncWorker(registry, options, store=store):
            await asyncio.sleep(1.5)
            failing = False
            await AsyncClient(registry, store=other).start_flow("PollFails", "f")
            await wait_until("the worker to claim the flow's Step", lambda: _true(ran == ["f"]))
            await wait_until("a renewal to work again", lambda: _true(any(
                "lease renewal works again" in r.getMessage() for r in caplog.records)))
    finally:
        await store.close()
        await other.close()
    # 0.01, 0.02, 0.04 ... 0.64, then 1 s apart: about 8 polls in 1.5 s, not 150.
    assert 4 <= len(failed) <= 12, len(failed)
    assert len(renewals) >= 5, renewals  # every 0.05 s: many failures, one traceback
    said = [r for r in caplog.records if r.name == "dex_engine.worker" and r.levelno >= logging.WARNING]
    assert sorted((r.getMessage(), r.exc_info is not None) for r in said) == [
        ("worker failing: lease renewal failed; will retry", True),
        (f"worker failing: lease renewal works again after {len(renewals)} failures in a row", False),
        ("worker failing: poll failed; will retry", True),
        (f"worker failing: poll works again after {len(failed)} failures in a row", False),
    ]


@pytest.mark.parametrize("offset_ms", [0, 10_000, -10_000])
async def test_a_worker_on_a_host_whose_clock_is_off_says_so_at_start(
    db_url: str, offset_ms: int, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """On PostgreSQL, where workers may run on several hosts, a worker whose host's clock is more
    than CLOCK_SKEW_WARN_MS from the database server's logs a warning at start naming the skew and
    what it breaks; one in step logs none. On SQLite every process shares the machine's clock, and
    nothing is compared. Catches: a host running ahead declaring the other hosts' workers dead
    early, failing their started Steps as lost, with nothing in the logs to say why."""
    from dex_engine import WorkerOptions, _pg_store

    real = _pg_store._local_clock_ms
    monkeypatch.setattr(_pg_store, "_local_clock_ms", lambda: real() + offset_ms)
    registry = Registry([Flow("Clocked", [Step("Start", _noop)], start_step="Start")])
    async with AsyncWorker(registry, WorkerOptions(database_url=db_url)):
        pass
    said = [r.getMessage() for r in caplog.records if "the database server's" in r.getMessage()]
    if db_url.startswith("sqlite") or offset_ms == 0:
        assert said == []
    else:
        direction = "ahead of" if offset_ms > 0 else "behind"
        assert len(said) == 1 and re.search(
            rf"this host's clock is (9\.\d|10\.\d) s {direction} the database server's; leases, deadlines and "
            r"timers are times each host's own clock writes and reads, so hosts running ahead declare others' "
            r"workers dead early and fire timers early: keep every host's clock synchronized \(NTP\)$",
            said[0]), said


async def _noop(ctx: Context, _: Any) -> StepDecision:
    return StepDecision.graceful_complete()

async def _true(value: bool) -> bool:
    return value


def test_a_worker_id_that_is_not_a_usable_id_is_refused() -> None:
    from dex_engine import WorkerOptions

    """WorkerOptions refuses a worker ID that is not a usable ID, naming the problem: it is stored
    and logged like a flow ID. An empty one, like None, has the worker make one up."""
    for bad, named in (("a/b", "reserved character '/'"), ("tab\there", "control character"),
                       ("x" * 256, "over 255")):
        with pytest.raises(ValueError, match=r"^invalid WorkerOptions: worker ID ") as caught:
            WorkerOptions(worker_id=bad)
        assert named in str(caught.value), (bad, str(caught.value))
    assert WorkerOptions(worker_id="").worker_id == ""


def test_a_worker_without_options_takes_the_defaults_and_an_id_of_its_own() -> None:
    """AsyncWorker(registry) runs with WorkerOptions' defaults, under an ID naming its host and
    process that no other worker shares."""
    import os
    import socket

    from dex_engine import AsyncWorker, WorkerOptions

    first, second = AsyncWorker(Registry([FLOW])), AsyncWorker(Registry([FLOW]))
    assert first.options == WorkerOptions()
    assert first.worker_id.startswith(f"{socket.gethostname()}-{os.getpid()}-")
    assert first.worker_id != second.worker_id


def test_the_documented_worker_timings_are_the_defaults() -> None:
    """docs/engine.md's table "Workers, leases and timings" gives each WorkerOptions default that
    the worker runs with. Catches a default changed in code (or in the docs) without the other."""
    from pathlib import Path

    from dex_engine import WorkerOptions

    text = (Path(__file__).parents[2] / "docs" / "engine.md").read_text(encoding="utf-8")
    table = text.split("| setting (`WorkerOptions`) | default | what it bounds |", 1)[1].split("\n\n", 1)[0]
    documented = {m[1]: float(m[2]) for m in re.finditer(r"^\| `(\w+)` \| ([\d.]+) \|", table, re.MULTILINE)}
    defaults = WorkerOptions()
    assert documented == {name: float(getattr(defaults, name)) for name in documented}
    assert set(documented) == {"lease_ttl_seconds", "lease_renew_seconds", "housekeeping_seconds", "poll_seconds",
                               "max_concurrent_tasks", "shutdown_grace_seconds"}


async def test_a_worker_that_cannot_start_raises_from_its_context(tmp_path: Any) -> None:
    """A worker whose database cannot be opened raises its error on entering its block, instead of
    entering it with nothing running."""
    from dex_engine import AsyncWorker, WorkerOptions

    entered = False
    with pytest.raises(Exception, match=r"unable to open|is a directory"):  # the path is a directory
        async with AsyncWorker(Registry([FLOW]), WorkerOptions(database_url=f"sqlite:///{tmp_path}")):
            entered = True
    assert not entered, "entered the block of a worker that never started"
    await asyncio.sleep(0)  # a task cancelled above has ended by now
    left = asyncio.all_tasks() - {asyncio.current_task()}
    assert not left, f"a worker that never started left tasks pending: {left}"


async def test_stop_ends_a_worker_run_directly_at_once(db_url: str) -> None:
    """`await worker.run()` in a task of its own ends when `await worker.stop()` is called, at
    once: not at the loop's next poll or housekeeping, nor at the end of its shutdown grace (each a
    minute away here), and with no background task of the worker's own to await (it was not
    entered with `async with`). A client's commit handed it work before: that claim is settled."""
    from dex_engine import AsyncWorker, WorkerOptions

    async with engine_for(db_url, Registry([FLOW]), worker=False) as eng:
        options = WorkerOptions(database_url=db_url, poll_seconds=60.0, housekeeping_seconds=60.0,
                                shutdown_grace_seconds=60.0)
        worker = AsyncWorker(Registry([FLOW]), options, store=eng.store)
        running = asyncio.create_task(worker.run())

        async def registered() -> bool:
            return worker.worker_id in [row[0] for row in await eng.store.list_workers()]

        await wait_until("the worker registers", registered)
        await eng.client.start_flow("Behaviour", "handed-off")  # claimed for the worker by the client's commit
        assert (await eng.client.wait_for_flow("handed-off", 10)).status == "completed"
        await asyncio.wait_for(worker.stop(), 10)
        assert running.done() and running.exception() is None


@pytest.mark.parametrize("store_given", [False, True])
async def test_a_worker_that_has_run_refuses_to_run_again(db_url: str, store_given: bool) -> None:
    """A worker runs once: entering it again, or `run()` after it stopped, raises RuntimeError saying
    to make a new AsyncWorker, while the new one runs the flow. Catches: a second run that found its
    stop still set and returned at once, claiming nothing, so with a store the caller gave it (which
    stays open) the block ran with no worker and the flow it started waited for ever; with its own
    store, a bare `store ... is closed`."""
    registry = Registry([FLOW])
    async with engine_for(db_url, registry, worker=False) as eng:
        store = eng.store if store_given else None
        options = WorkerOptions(database_url=db_url, poll_seconds=0.01, housekeeping_seconds=0.1)
        worker = AsyncWorker(registry, options, store=store)
        async with worker:
            pass
        again = rf"^worker {re.escape(repr(worker.worker_id))} has already run, and a worker runs once; to run again, "
        with pytest.raises(RuntimeError, match=again + r"make a new AsyncWorker\(registry, options\)$"):
            async with worker:
                pass
        with pytest.raises(RuntimeError, match=again):
            await worker.run()
        async with AsyncWorker(registry, options, store=store):
            await eng.client.start_flow("Behaviour", "after")
            assert (await eng.client.wait_for_flow("after", 10)).status == "completed"


def _one_step(flow_type: str, handler: Callable[[Context, Any], Awaitable[StepDecision]]) -> Registry:
    return Registry([Flow(flow_type, [Step("Hold", handler)], start_step="Hold")])


async def _holding(eng: Engine, flow_type: str, flow_id: str, log: list[str], **options: Any) -> AsyncWorker:
    """A worker with `options`, once it runs `flow_id`'s first attempt (whose handler logs to `log`)."""
    worker = await eng.start_worker(**options)
    await eng.client.start_flow(flow_type, flow_id)
    await wait_until(f"{flow_id}'s first attempt to run", lambda: asyncio.sleep(0, log))
    return worker


async def test_a_stopping_worker_takes_no_new_work_from_its_processs_clients(db_url: str) -> None:
    """While a worker stops (its one running attempt finishing within the grace), a client sharing
    its store readies a Step: the stopping worker must not run it (it takes no claim, or hands an
    unstarted one back at once), or each such commit would keep the stop waiting for yet
    another attempt. The Step waits for the next worker. Catches a stopping worker that runs new work."""
    entered: list[str] = []
    release = asyncio.Event()

    async def hold(ctx: Context, _: Any) -> StepDecision:
        entered.append(ctx.flow_id)
        await release.wait()
        return StepDecision.graceful_complete()

    async with engine_for(db_url, _one_step("Draining", hold), worker=False) as eng:
        worker = await _holding(eng, "Draining", "first", entered, shutdown_grace_seconds=30.0)
        stopping = asyncio.create_task(worker.stop())
        await asyncio.sleep(0.05)
        await eng.client.start_flow("Draining", "second")
        await asyncio.sleep(0.2)
        release.set()
        await asyncio.wait_for(stopping, 10)
        assert entered == ["first"]
        await eng.start_worker()
        assert (await eng.client.wait_for_flow("second", 10)).status == "completed"
        assert entered == ["first", "second"]


async def test_a_stop_returns_after_the_handlers_it_cancels_have_ended(db_url: str) -> None:
    """An attempt still running when the grace runs out is cancelled, and stop() returns only
    once its handler has ended, cleanup included: after stop() no handler of the worker runs (its
    caller may close what the handlers use). Catches a stop that cancels and does not wait."""
    log: list[str] = []

    async def hold(ctx: Context, _: Any) -> StepDecision:
        log.append("running")
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await asyncio.sleep(0.2)  # a handler's cleanup that takes a while (closing a connection)
            log.append("cleaned up")
            raise
        return StepDecision.graceful_complete()

    async with engine_for(db_url, _one_step("Held", hold), worker=False) as eng:
        worker = await _holding(eng, "Held", "h", log, shutdown_grace_seconds=0.1)
        await asyncio.wait_for(worker.stop(), 10)
        assert log == ["running", "cleaned up"]


@pytest.mark.parametrize("client", ["same store", "another store", "another store, unwatched"])
async def test_a_stopping_worker_still_cancels_an_attempt_a_commit_cancels(
    db_url: str, client: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """stop_flow while the worker drains: the running handler is cancelled at once (E9), as it is
    while the worker runs, not left running until the shutdown grace ends; on a store that cannot
    watch other processes' commits, at the poll pace. Catches: only the main loop, which a stop
    ends, polling the running attempts' epochs."""
    log: list[str] = []

    async def hold(ctx: Context, _: Any) -> StepDecision:
        log.append("running")
        try:
            await asyncio.Event().wait()  # a model call: no heartbeat, nothing to notice a cancel by
        except asyncio.CancelledError:
            log.append("cancelled")
            raise
        return StepDecision.graceful_complete()

    registry = _one_step("Held", hold)
    async with engine_for(db_url, registry, worker=False) as eng:
        if client.endswith("unwatched"):
            monkeypatch.setattr(eng.store, "watch_foreign_commits", lambda interval_seconds: False)
        worker = await _holding(eng, "Held", "h", log, shutdown_grace_seconds=30, lease_ttl_seconds=300.0,
                                lease_renew_seconds=60.0)  # no renewal to wake the drain meanwhile
        stopping = asyncio.create_task(worker.stop())
        await wait_until("the worker to start draining", lambda: asyncio.sleep(0, worker._stopping.is_set()))
        other = open_store(db_url) if client.startswith("another store") else eng.store
        try:
            await AsyncClient(registry, store=other).stop_flow("h", "the user left")
            await wait_until("the handler to be cancelled", lambda: asyncio.sleep(0, log == ["running", "cancelled"]))
            await asyncio.wait_for(stopping, 30)
        finally:
            if other is not eng.store:
                await other.close()
        assert (await eng.client.describe_flow("h")).status == "stopped"


async def test_a_stop_lets_a_commit_in_flight_land_whatever_its_grace(
    db_url: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An attempt whose handler has returned, its result still committing when the grace runs
    out, is not cancelled: stop() waits for that commit, so the result stands and the Step does
    not run again (a model or tool call repeated). Catches a stop that cancels an attempt mid-commit."""
    ran: list[int] = []

    async def quick(ctx: Context, _: Any) -> StepDecision:
        ran.append(ctx.attempt)
        return StepDecision.graceful_complete("done")

    async with engine_for(db_url, _one_step("Committing", quick), worker=False) as eng:
        real_commit = type(eng.store).commit_execute
        committing = asyncio.Event()

        async def slow_commit(self: Store, *args: Any, **kwargs: Any) -> Any:
            committing.set()
            await asyncio.sleep(0.5)  # a commit waiting on the database, longer than the grace
            return await real_commit(self, *args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(type(eng.store), "commit_execute", slow_commit)
        worker = await eng.start_worker(shutdown_grace_seconds=0.1)
        await eng.client.start_flow("Committing", "c")
        await asyncio.wait_for(committing.wait(), 10)
        await asyncio.wait_for(worker.stop(), 10)
        assert ran == [1]
        history = await eng.client.get_flow_history("c")
        ends = [(h.event_type, h.attempt) for h in history if h.event_type in ("execute_completed", "attempt_failed")]
        assert ends == [("execute_completed", 1)]
        assert (await eng.client.describe_flow("c")).status == "completed"


@pytest.mark.sqlite_only
async def test_a_stop_waits_for_a_claim_in_flight_and_not_for_its_grace(
    db_url: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """stop() comes while a client's commit is still handing the worker a Step it claimed for it;
    nothing else runs. The stop waits for that claim to land (it takes no new work: the claim goes
    back as the worker unregisters), then ends at once, not when its 60 s grace runs out. The next
    worker runs the Step. Catches a landing claim that does not wake the draining worker."""
    async with engine_for(db_url, Registry([FLOW]), worker=False) as eng:
        worker = await eng.start_worker(shutdown_grace_seconds=60.0)
        stopped = stop_while_a_claim_lands(worker, monkeypatch, 0.2, lambda leases: True)
        await eng.client.start_flow("Behaviour", "landing")
        assert stopped, "the client's commit claimed nothing for the worker"
        await asyncio.wait_for(stopped[0][1], 10)
        await eng.start_worker()
        assert (await eng.client.wait_for_flow("landing", 10)).status == "completed"


async def test_a_stopping_worker_hands_back_at_once_a_step_a_commit_in_flight_claimed(
    db_url: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """stop() comes while an attempt's commit is in flight, the commit handing its worker the
    flow's next Step; another attempt of the worker runs on within its 30 s grace. The stopping
    worker does not run the Step it was handed, and gives it back at once: another worker (another
    process's) runs it within seconds, not once the longest running attempt ends. Catches: the
    claim kept until the worker unregistered at the end of its drain, so the session stalled for
    up to the whole grace."""
    entered: list[str] = []
    release = asyncio.Event()

    async def hold(ctx: Context, _: Any) -> StepDecision:
        entered.append(ctx.flow_id)
        await release.wait()
        return StepDecision.graceful_complete()

    async def first(ctx: Context, _: Any) -> StepDecision:
        return StepDecision.go_to("Second")

    async def second(ctx: Context, _: Any) -> StepDecision:
        # Whether the stopping worker runs it: it holds an attempt of Second's task if so.
        second_in_stopping.append(any(r.lease.step_type == "Second" for r in worker._running.values()))
        return StepDecision.graceful_complete("second ran")

    second_in_stopping: list[bool] = []
    registry = Registry([
        Flow("Held", [Step("Hold", hold)], start_step="Hold"),
        Flow("Pair", [Step("First", first), Step("Second", second)], start_step="First"),
    ])
    async with engine_for(db_url, registry, worker=False) as eng:
        worker = await _holding(eng, "Held", "held", entered, shutdown_grace_seconds=30.0)
        real_commit = type(eng.store).commit_execute
        stopping: list[asyncio.Task[None]] = []

        async def commit_in_flight_at_stop(self: Store, lease: Any, *args: Any, **kwargs: Any) -> Any:
            if lease.step_type == "First":
                assert self is eng.store and args[2] is not None, "the stopping worker's commit claims for it"
                stopping.append(asyncio.create_task(worker.stop()))
                await asyncio.sleep(0.1)  # the stop is in: the worker drains
            return await real_commit(self, lease, *args, **kwargs)

        monkeypatch.setattr(type(eng.store), "commit_execute", commit_in_flight_at_stop)
        await eng.client.start_flow("Pair", "pair")  # no other worker yet: this one runs First
        await wait_until("First's commit", lambda: asyncio.sleep(0, stopping))
        other = open_store(db_url)
        try:
            async with AsyncWorker(registry, WorkerOptions(**{**FAST.__dict__, "database_url": db_url}),
                                   store=other):
                info = await eng.client.wait_for_flow("pair", 5)
                assert info.status == "completed"
                assert not stopping[0].done(), "the held attempt still runs in the stopping worker"
                release.set()
                await asyncio.wait_for(stopping[0], 10)
        finally:
            release.set()
            await other.close()
        assert entered == ["held"]
        assert second_in_stopping == [False], "the stopping worker ran the Step its commit was handed"


async def test_a_worker_closes_the_store_it_opened(db_url: str) -> None:
    """A worker given a database URL opens its own store and closes it when it stops: no thread or
    connection of it outlives the worker (a process starting and stopping workers would leak them)."""
    import threading

    from dex_engine import AsyncWorker, WorkerOptions

    async with engine_for(db_url, Registry([FLOW]), worker=False) as eng:
        # Started first, so that the test's own store only reads once the worker runs: a write of
        # it contending with the worker's could start a thread of its own (the SQLite writer-turn
        # waiter), which would outlive the worker.
        await eng.client.start_flow("Behaviour", "f")
        before = set(threading.enumerate())
        async with AsyncWorker(Registry([FLOW]), WorkerOptions(database_url=db_url)) as worker:
            assert (await eng.client.wait_for_flow("f", 10)).status == "completed"
            opened = {t.name for t in set(threading.enumerate()) - before if t.name.startswith("dex-")}
        assert opened, f"the worker opened no store of its own: {worker.store!r}"

        async def closed() -> bool:
            # Some end just after close() returns (the writer-turn thread is told to stop, not joined).
            return not {t for t in set(threading.enumerate()) - before if t.name.startswith("dex-")}

        await wait_until("the threads of the worker's store to end", closed)


async def test_a_stopped_worker_leaves_nothing_of_it_on_a_shared_store(db_url: str) -> None:
    """A worker given a store (shared with clients that outlive it) withdraws from it when it stops:
    the store keeps no commit listener or local claimer of it, so a process that starts and stops
    workers on one store neither keeps every one of them alive nor calls them all at each commit.
    Catches a stop that leaves either."""
    from dex_engine import AsyncWorker, WorkerOptions

    async with engine_for(db_url, Registry([FLOW]), worker=False) as eng:
        store = eng.store
        listeners, claimers = list(store._listeners), store._claimers
        worker = AsyncWorker(Registry([FLOW]), WorkerOptions(database_url=db_url), store=store)
        async with worker:
            await eng.client.start_flow("Behaviour", "f")
            assert (await eng.client.wait_for_flow("f", 10)).status == "completed"
            assert len(store._listeners) == len(listeners) + 1
            assert store._claimers == ((*claimers, worker) if store.hands_off_locally else claimers)
        assert (store._listeners, store._claimers) == (listeners, claimers)


async def test_a_client_closes_only_the_store_it_opened(db_url: str) -> None:
    """A client given a database URL opens its own store and closes it with itself (a process making
    clients would otherwise leak their threads and connections). A client given a store (shared with
    a worker) leaves that store open."""
    from dex_engine import AsyncClient

    async with engine_for(db_url, Registry([FLOW])) as eng:
        async with AsyncClient(Registry([FLOW]), db_url) as own:
            assert own.store is not eng.store
            await own.start_flow("Behaviour", "own")
            assert (await own.wait_for_flow("own", 10)).status == "completed"
        with pytest.raises(RuntimeError, match="is closed"):
            await own.store.describe_flow("own")
        async with AsyncClient(Registry([FLOW]), store=eng.store) as shared:
            await shared.start_flow("Behaviour", "shared")
        # The shared store still serves its other client and the worker.
        await eng.client.start_flow("Behaviour", "after")
        assert (await eng.client.wait_for_flow("after", 10)).status == "completed"


async def _foreign_client_runs_a_flow(db_url: str, flow_id: str) -> None:
    """Start `flow_id` from a client with a store of its own, as another process would: no commit
    listener or hand-off reaches the worker, only its poll, woken by the store's watch."""
    from dex_engine import AsyncClient

    async with AsyncClient(Registry([FLOW]), db_url) as foreign:
        await foreign.start_flow("Behaviour", flow_id)
        info = await foreign.wait_for_flow(flow_id, 10)
    assert info.status == "completed", info


async def test_a_worker_with_one_slot_claims_work_another_process_made_ready(db_url: str) -> None:
    """A worker with max_concurrent_tasks=1 and its slot free claims, by its poll, a Step another
    process's commit made ready. Catches a claim that asks for a free slot more than it has."""
    async with engine_for(db_url, Registry([FLOW]), worker=False) as eng:
        await eng.start_worker(max_concurrent_tasks=1)
        await _foreign_client_runs_a_flow(db_url, "one-slot")


@pytest.mark.sqlite_only  # only the SQLite store hands a client's readied Steps to its workers
async def test_a_full_worker_leaves_a_clients_readied_step_to_the_next_worker_of_the_process(
    db_url: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two workers share a process's store, each with one slot; the first asked holds its slot. A
    client's start is claimed in its own commit by the second, not offered to the full one (which
    would claim nothing and leave the Step to a poll). Catches a full worker accepting the hand-off,
    and a worker declining it with one slot free."""
    gauge = _HeldSteps()
    async with engine_for(db_url, Registry([gauge.flow()]), worker=False) as eng:
        full = await eng.start_worker(max_concurrent_tasks=1)
        try:
            await eng.client.start_flow("Held", "holding")
            await wait_until("the first worker's slot to fill", lambda: asyncio.sleep(0, gauge.running))
            free = await eng.start_worker(max_concurrent_tasks=1)  # its one free slot is enough
            handed: list[str] = []
            real = free.local_claim_done

            def landed(token: int, leases: list[Any] | None, capacity: int) -> None:
                handed.extend(lease.flow_id for lease in leases or ())
                real(token, leases, capacity)

            monkeypatch.setattr(free, "local_claim_done", landed)
            await eng.client.start_flow("Held", "handed")
            assert handed == ["handed"]  # landed before start_flow returned: claimed in its commit
            gauge.release.set()
            assert (await eng.client.wait_for_flow("handed", 10)).status == "completed"
        finally:
            gauge.release.set()
            await full.stop()


@pytest.mark.sqlite_only  # PostgreSQL's listener connection wakes the worker whatever the store says
async def test_a_worker_on_a_store_that_does_not_watch_polls_every_poll_seconds(
    db_url: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A store that cannot watch other processes' commits (Store.watch_foreign_commits is False)
    leaves the worker to find their work by polling every poll_seconds. Catches a worker that
    sleeps until its next housekeeping (a minute here) on such a store too."""
    async with engine_for(db_url, Registry([FLOW]), worker=False) as eng:
        monkeypatch.setattr(eng.store, "watch_foreign_commits", lambda interval_seconds: False)
        # Renewals rare too: the store tells its listeners of other connections' commits it notices.
        await eng.start_worker(poll_seconds=0.05, housekeeping_seconds=60.0, lease_ttl_seconds=300.0,
                               lease_renew_seconds=60.0)
        await _foreign_client_runs_a_flow(db_url, "unwatched")


async def test_a_worker_goes_on_after_a_failed_poll(db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A poll that fails (the database briefly unreachable) is logged and tried again: the worker
    keeps running and claims what another process makes ready after it. Catches a worker that
    quietly stops at its first failed poll."""
    failures: list[str] = []
    async with engine_for(db_url, Registry([FLOW]), worker=False) as eng:
        real_poll = type(eng.store).poll

        async def failing_once(self: Store, *args: Any, **kwargs: Any) -> Any:
            if not failures:
                failures.append("poll")
                raise OSError("database unreachable")
            return await real_poll(self, *args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(type(eng.store), "poll", failing_once)
        await eng.start_worker()
        await wait_until("a poll to fail", lambda: asyncio.sleep(0, failures))
        await _foreign_client_runs_a_flow(db_url, "after-failure")


async def test_a_client_on_another_event_loop_hands_its_work_to_the_worker_on_its_own(db_url: str) -> None:
    """A client sharing the worker's store from another thread's event loop starts a flow: the
    worker runs its Steps on its own loop (woken by the commit), never on the client's, which would
    run the handler in the wrong thread and drop it when that loop ends. Catches a hand-off of the
    client's ready Steps that does not check which loop it was asked from."""
    import threading

    from dex_engine import AsyncClient

    ran_on: list[int] = []

    async def record(ctx: Context, _: None) -> StepDecision:
        ran_on.append(threading.get_ident())
        return StepDecision.graceful_complete()

    where = Flow("Where", [Step("Record", record, input_type=type(None))], start_step="Record")
    async with engine_for(db_url, Registry([where])) as eng:

        async def start_from_elsewhere() -> None:
            await AsyncClient(Registry([where]), store=eng.store).start_flow("Where", "w")

        await asyncio.to_thread(asyncio.run, start_from_elsewhere())
        info = await eng.client.wait_for_flow("w", 10)
        assert info.status == "completed", info
        assert ran_on == [threading.get_ident()], "the Step ran outside the worker's event loop"


async def test_client_writes_that_ready_nothing_or_fail_leave_the_worker_sound(db_url: str) -> None:
    """A client's write offered to the worker's free slots may ready nothing (a message nobody
    waits for) or fail (a flow ID taken): the worker gets its slots back, no error escapes into its
    event loop, and the next flow runs. Catches a hand-off that takes 'nothing claimed' for a list."""
    loop = asyncio.get_running_loop()
    escaped: list[str] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: escaped.append(str(context.get("exception") or context)))
    release = asyncio.Event()

    async def hold(ctx: Context, _: None) -> StepDecision:
        await release.wait()
        return StepDecision.graceful_complete()

    holding = Flow("Held", [Step("Hold", hold, input_type=type(None))], start_step="Hold", schema=[Inbox])
    try:
        async with engine_for(db_url, Registry([holding])) as eng:
            await eng.client.start_flow("Held", "h")
            await eng.client.publish("h", Inbox, "nobody waits for this")
            with pytest.raises(FlowAlreadyStartedError, match="'h' already exists"):
                await eng.client.start_flow("Held", "h")
            release.set()
            assert (await eng.client.wait_for_flow("h", 10)).status == "completed"
            await eng.client.start_flow("Held", "next")
            assert (await eng.client.wait_for_flow("next", 10)).status == "completed"
    finally:
        loop.set_exception_handler(previous)
    assert escaped == [], escaped


async def test_a_write_handed_to_the_worker_leaves_the_callers_commit_origin_as_it_was(db_url: str) -> None:
    """A client's write that hands the Steps it readies to a worker of this process marks its own
    commit as the worker's (the worker need not be woken by it), and only that commit: the caller's
    later writes, a stop that must revoke a running attempt say, must wake the worker. Catches the
    marking left behind in the caller's context."""
    from dex_engine._store import commit_origin

    release = asyncio.Event()

    async def hold(ctx: Context, _: None) -> StepDecision:
        await release.wait()
        return StepDecision.graceful_complete()

    holding = Flow("Held", [Step("Hold", hold, input_type=type(None))], start_step="Hold")
    async with engine_for(db_url, Registry([holding])) as eng:
        before = commit_origin.get()
        await eng.client.start_flow("Held", "h")
        assert commit_origin.get() is before
        release.set()
        assert (await eng.client.wait_for_flow("h", 10)).status == "completed"


@pytest.mark.parametrize("writes", [True, False])
async def test_a_wait_for_that_writes_keeps_its_writes_when_a_commit_starts_its_step(db_url: str, writes: bool) -> None:
    """A WaitFor that writes an attribute, in a Step started by an Execute's commit, keeps its
    write: the commit may evaluate a WaitFor ahead and register its wait at once only when it
    writes nothing, since that commit records the wait alone. Either way it sees itself as attempt
    1. Catches a WaitFor's writes dropped because its wait was registered early."""
    seen = Attribute("Seen", str)

    async def begin(ctx: Context, writes: bool) -> StepDecision:
        return StepDecision.go_to("Mark", writes)

    async def mark_wait(ctx: Context, writes: bool) -> Wait:
        attempts.append(ctx.attempt)
        if writes:
            ctx.set(seen, "the WaitFor ran")
        return Wait.until(Inbox.for_one())

    async def mark(ctx: Context, _: bool) -> StepDecision:
        return StepDecision.graceful_complete(ctx.get(seen))

    marking = Flow(
        "Marking",
        [Step("Begin", begin, input_type=bool), Step("Mark", mark, wait_for=mark_wait, input_type=bool)],
        start_step="Begin", schema=[seen, Inbox],
    )
    attempts: list[int] = []
    async with engine_for(db_url, Registry([marking])) as eng:
        await eng.client.start_flow("Marking", "m", writes)

        async def waiting() -> bool:
            return any(s.state == "waiting" for s in (await eng.client.describe_flow("m")).active_steps)

        await wait_until("Mark waiting", waiting)
        # Evaluated ahead, the WaitFor runs again as its attempt if it wrote: each run is attempt 1.
        assert attempts and set(attempts) == {1}, attempts
        expected = "the WaitFor ran" if writes else None
        assert await eng.client.get_attribute("m", seen) == expected
        await eng.client.publish("m", Inbox, "go")
        assert (await eng.client.wait_for_flow("m", 10)).status == "completed"
        assert await eng.client.flow_output("m") == expected


async def test_a_cancelled_entry_leaves_no_worker_running(db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Entering `async with worker:` cancelled before the worker registered (a timeout around the
    block, say) must stop the worker it started: no __aexit__ follows to do it, and the worker
    would go on to register and claim work nobody stops."""
    from dex_engine import AsyncWorker, WorkerOptions

    registering = asyncio.Event()

    async def stuck_register(self: Store, *args: Any) -> None:
        registering.set()
        await asyncio.Event().wait()

    async with engine_for(db_url, Registry([FLOW]), worker=False) as eng:
        monkeypatch.setattr(type(eng.store), "register_worker", stuck_register)
        worker = AsyncWorker(Registry([FLOW]), WorkerOptions(database_url=db_url), store=eng.store)
        entering = asyncio.create_task(worker.__aenter__())
        await asyncio.wait_for(registering.wait(), 10)
        entering.cancel()
        with pytest.raises(asyncio.CancelledError):
            await entering
        background = worker._background
        assert background is not None
        await asyncio.wait([background], timeout=10)
        assert background.cancelled(), "the worker's task still runs after its entry was cancelled"


async def test_events_of_a_failed_attempt_are_kept(db_url: str) -> None:
    """Best-effort events written before a handler raised reach readers, tagged with their attempt
    (a UI shows a failed attempt's partial output, then replaces it by the next attempt's)."""
    async with engine_for(db_url, Registry([FLOW])) as eng:
        await eng.client.start_flow("Behaviour", "f1")
        assert (await eng.client.wait_for_flow("f1", 10)).status == "completed"
        read = await eng.client.read_stream("f1", Log)
        assert [(e.step_execution_id, e.attempt, e.value) for e in read.events] == [
            ("Flaky-1", 1, "partial output of attempt 1"),
            ("Flaky-1", 2, "partial output of attempt 2"),
        ]


async def test_skip_timer_refuses_a_wait_without_a_timer(db_url: str) -> None:
    """skip_timer on a Step waiting only on channels names the problem and changes nothing."""
    async with engine_for(db_url, Registry([FLOW])) as eng:
        # Start the flow directly in its Listen Step, which waits on a channel only.
        start = movement_record(FLOW, Movement("Listen", None))
        await eng.store.start_flow(StartRequest("f2", "Behaviour", b"null", FlowConfig(), start))

        async def waiting() -> bool:
            info = await eng.client.describe_flow("f2")
            return any(s.state == "waiting" for s in info.active_steps)

        await wait_until("Listen waiting", waiting)
        before = await eng.client.get_flow_history("f2")
        with pytest.raises(StepNotWaitingError, match="'Listen-1' of flow 'f2' waits on no timer"):
            await eng.client.skip_timer("f2", "Listen-1")
        assert await eng.client.get_flow_history("f2") == before
        with pytest.raises(StepNotWaitingError, match="'Nope-1'"):
            await eng.client.skip_timer("f2", "Nope-1")


calls: list[int] = []


async def _fails_first(ctx: Context, _: Any) -> StepDecision:
    calls.append(ctx.attempt)
    if len(calls) == 1:
        raise RuntimeError("first run fails")
    return StepDecision.graceful_complete("done")


HANDBACK = Flow("Handback", [Step("Work", _fails_first)], start_step="Work")


async def test_a_worker_side_error_hands_the_attempt_back(db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """When recording an attempt's outcome fails inside the worker (a store error, a bug), the
    attempt is handed back instead of staying `running` until the worker dies; housekeeping then
    re-runs it. Breaks if the worker only logs the error (the flow would never finish)."""
    calls.clear()
    async with engine_for(db_url, Registry([HANDBACK]), worker=False) as eng:
        real = eng.store.fail_attempt
        broken = [True]

        async def flaky_fail_attempt(*args: Any, **kwargs: Any) -> None:
            if broken:
                broken.clear()
                raise OSError("disk went away while recording the failure")
            await real(*args, **kwargs)

        monkeypatch.setattr(eng.store, "fail_attempt", flaky_fail_attempt)
        await eng.start_worker()
        await eng.client.start_flow("Handback", "h1")
        info = await eng.client.wait_for_flow("h1", 20)
        assert info.status == "completed"
        # The handed-back attempt had not started (no heartbeat), so it ran again as attempt 1.
        assert calls == [1, 1]


async def _first(ctx: Context, _: Any) -> StepDecision:
    return StepDecision.go_to("Renamed", 7)


OLD = Flow("Versioned", [Step("First", _first), Step("Renamed", _done, input_type=int)], start_step="First")
NEW = Flow("Versioned", [Step("First", _first)], start_step="First")


async def test_a_step_no_worker_declares_waits_unfailed_until_the_flow_is_stopped(
    db_url: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """A stored Step that the worker's Flow no longer defines (another deploy) is neither lost nor
    failed, nor claimed again and again: it waits, ready, under its first attempt, for a worker
    that declares it, and the worker says so once, naming it. With none (the Step was removed while
    flows still had it ready), stopping the flow ends it."""
    caplog.set_level(logging.WARNING, logger="dex_engine.worker")
    async with engine_for(db_url, Registry([OLD]), worker=False) as eng:
        # Schedule Renamed with the old definition, then serve the flow with the new one.
        await eng.client.start_flow("Versioned", "v1")
        await eng.store.register_worker("w-old", "h", 1, 60_000)
        (lease,) = await eng.store.claim("w-old", ["Versioned"], 1)
        await eng.store.commit_execute(lease, WriteSet(), DecisionRecord(
            "movements", (movement_record(OLD, Movement("Renamed", 7)),)))
        eng.registry = Registry([NEW])
        worker = await eng.start_worker()
        assert worker.registry.flow("Versioned") is NEW

        async def renamed() -> Any:
            return await eng.store.raw(lambda db: db.one(
                "SELECT state, attempt, lease_epoch FROM tasks WHERE flow_id = 'v1' AND step_type = 'Renamed'"))

        async def handed_back() -> bool:
            row = await renamed()
            return tuple(row[:2]) == ("ready", 1) and row[2] > 0  # claimed, then handed back unstarted

        await wait_until("the worker to claim Renamed and hand it back", handed_back)
        _state, _attempt, epoch = await renamed()
        await asyncio.sleep(0.5)  # the worker polls many times meanwhile (FAST): none claims it again
        assert await renamed() == ("ready", 1, epoch)
        assert (await eng.client.describe_flow("v1")).status == "running"
        assert [h for h in await eng.client.get_flow_history("v1") if h.event_type == "attempt_failed"] == []
        warned = [r.getMessage() for r in caplog.records if "'Renamed'" in r.getMessage()]
        assert len(warned) == 1 and "'Versioned'" in warned[0], warned
        await eng.client.stop_flow("v1", "Renamed was removed")
        assert (await eng.client.wait_for_flow("v1", 10)).status != "running"


async def test_a_commit_that_claims_a_step_this_worker_cannot_invoke_still_lands(db_url: str) -> None:
    """During a deploy, a worker's commit may claim as its next work a ready Step that its Flow no
    longer defines. That commit lands as usual, and the claimed Step is handed back unstarted for a
    worker that declares it: neither the commit nor the Step fails for it."""
    release = asyncio.Event()

    async def hold(ctx: Context, _: None) -> StepDecision:
        await release.wait()
        return StepDecision.graceful_complete()

    holding = Flow("Holding", [Step("Hold", hold, input_type=type(None))], start_step="Hold")
    async with engine_for(db_url, Registry([NEW, holding]), worker=False) as eng:
        worker = await eng.start_worker(max_concurrent_tasks=1)
        await eng.client.start_flow("Holding", "h")
        await wait_until("Hold to fill the worker's only slot", lambda: asyncio.sleep(0, len(worker._running) == 1))
        # Renamed made ready by a worker still running the old definition, while the slot is taken.
        await eng.client.start_flow("Versioned", "v1")
        await eng.store.register_worker("w-old", "h", 1, 60_000)
        (lease,) = await eng.store.claim("w-old", ["Versioned"], 1)
        await eng.store.commit_execute(lease, WriteSet(), DecisionRecord(
            "movements", (movement_record(OLD, Movement("Renamed", 7)),)))
        release.set()  # Hold's commit claims the ready Renamed into the slot it frees
        assert (await eng.client.wait_for_flow("h", 10)).status == "completed"
        assert [h for h in await eng.client.get_flow_history("h") if h.event_type == "attempt_failed"] == []

        async def renamed_handed_back() -> bool:
            row = await eng.store.raw(lambda db: db.one(
                "SELECT state, attempt, lease_epoch FROM tasks WHERE flow_id = 'v1' AND step_type = 'Renamed'"))
            return tuple(row[:2]) == ("ready", 1) and row[2] > 0  # claimed, then handed back unstarted

        await wait_until("Renamed handed back, not failed", renamed_handed_back)
        assert [h for h in await eng.client.get_flow_history("v1") if h.event_type == "attempt_failed"] == []


CHAIN_STEPS = 8
chain_runs: list[tuple[str, str, int]] = []


async def _slow_link(ctx: Context, n: int) -> StepDecision:
    chain_runs.append((ctx.flow_id, ctx.step_execution_id, ctx.attempt))
    # Long enough that claims made while a poll waits are still running when it reaches the store.
    await asyncio.sleep(random.uniform(0.05, 0.4))
    return StepDecision.go_to("Link", n + 1) if n < CHAIN_STEPS else StepDecision.graceful_complete()


CHAIN = Flow("SlowChain", [Step("Link", _slow_link, input_type=int)], start_step="Link")


async def test_a_late_housekeeping_poll_hands_back_no_claim_made_while_it_waited(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A poll's transaction may run long after the worker sent it (a deep queue on a loaded
    machine); meanwhile commits hand the worker claims that the poll's list of held tasks cannot
    name. Here every housekeeping poll reaches the store 0.3 s late and a claim counts as lost
    after 0.1 s: still every Step of 16 chains runs once, as attempt 1, and no attempt fails.
    Catches: the lost-claim cutoff taken when the transaction runs instead of before the poll is
    sent (seen as attempt 1 of a Step running twice in the two-process test under load)."""
    chain_runs.clear()
    monkeypatch.setattr(_worker, "LOST_CLAIM_MS", 100)
    async with engine_for(db_url, Registry([CHAIN]), worker=False) as eng:
        store_type = type(eng.store)
        real_poll = store_type.poll
        late = [0]

        async def late_poll(self: Store, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("housekeep") and kwargs.get("known") is not None:
                late[0] += 1
                await asyncio.sleep(0.3)
            return await real_poll(self, *args, **kwargs)

        monkeypatch.setattr(store_type, "poll", late_poll)
        await eng.start_worker(lease_ttl_seconds=5.0, lease_renew_seconds=0.5)
        flow_ids = [f"chain-{i}" for i in range(16)]
        for flow_id in flow_ids:
            await eng.client.start_flow("SlowChain", flow_id, 1)
        for flow_id in flow_ids:
            assert (await eng.client.wait_for_flow(flow_id, 60)).status == "completed"
        histories = {f: await eng.client.get_flow_history(f) for f in flow_ids}
    assert late[0] >= 3, f"only {late[0]} late housekeeping polls: the test did not exercise the race"
    runs = Counter((f, seid) for f, seid, _ in chain_runs)
    assert sorted(runs.values()) == [1] * (16 * CHAIN_STEPS), [k for k, n in runs.items() if n != 1]
    assert {attempt for _, _, attempt in chain_runs} == {1}
    failed = [(f, h.step_execution_id) for f, hs in histories.items() for h in hs
              if h.event_type in ("attempt_failed", "step_failed")]
    assert failed == []


class _HeldSteps:
    """Flow "Held": its one Step runs until `release` is set, keeping count of the attempts
    running at once (`running`, their flow IDs) and the most there were (`peak`); it completes with
    its attempt number."""

    def __init__(self) -> None:
        self.running: list[str] = []
        self.peak = 0
        self.release = asyncio.Event()

    def flow(self) -> Flow:
        return Flow("Held", [Step("Hold", self._hold)], start_step="Hold")

    async def _hold(self, ctx: Context, _: None) -> StepDecision:
        self.running.append(ctx.flow_id)
        self.peak = max(self.peak, len(self.running))
        try:
            await self.release.wait()
        finally:
            self.running.remove(ctx.flow_id)
        return StepDecision.graceful_complete(ctx.attempt)


async def test_claims_made_at_once_never_run_more_attempts_than_max_concurrent_tasks(db_url: str) -> None:
    """A poll, a commit and a client's hand-off each claim up to the slots free when they start, so
    together they may claim more: the worker runs at most max_concurrent_tasks attempts and hands
    the rest back unstarted (same attempt), to be claimed as slots free. Catches: running every
    lease a claim returns."""
    limit, flows = 2, 16
    gauge = _HeldSteps()
    running, go = gauge.running, gauge.release
    held = gauge.flow()
    async with engine_for(db_url, Registry([held]), worker=False) as eng:
        await eng.start_worker(max_concurrent_tasks=limit)
        for n in range(3):  # client hand-offs and polls racing, started all at once
            ids = [f"h{n}-{i}" for i in range(flows)]
            await asyncio.gather(*(eng.client.start_flow("Held", f) for f in ids))
            async def filled() -> bool:
                return len(running) >= limit

            await wait_until("the slots filled", filled)
            await asyncio.sleep(0.2)  # excess claims, had there been any, would be running by now
            assert gauge.peak <= limit, f"{gauge.peak} attempts ran at once, max_concurrent_tasks is {limit}"
            go.set()
            for f in ids:
                info = await eng.client.wait_for_flow(f, 30)
                assert info.status == "completed", info
                assert await eng.client.flow_output(f) == 1  # handed back unstarted: no attempt used
            go.clear()


async def _instant(ctx: Context, _: None) -> StepDecision:
    return StepDecision.graceful_complete(ctx.attempt)


async def test_claims_handed_back_are_claimed_again_without_waiting_for_a_poll(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Claims beyond max_concurrent_tasks go back to the store unstarted; the slots may be free
    by the time they are back (the attempts that held them ended and their commits found nothing
    ready), so the worker must claim again as soon as a hand-back is done. Polls, housekeeping,
    lease renewal and PostgreSQL's fallback poll are a minute apart here, so only that wake-up can
    finish the flows within the wait. Catches: a hand-back that leaves the Step for the next poll
    (on SQLite, where clients' local hand-offs make the excess claims; seen as a 20 s time-out)."""
    if db_url.startswith("postgresql"):
        from dex_engine import _pg_store

        monkeypatch.setattr(_pg_store, "FALLBACK_POLL_SECONDS", 60.0)
    instant = Flow("Instant", [Step("Go", _instant)], start_step="Go")
    async with engine_for(db_url, Registry([instant]), worker=False) as eng:
        await eng.start_worker(max_concurrent_tasks=2, poll_seconds=60.0, housekeeping_seconds=60.0,
                               lease_ttl_seconds=300.0, lease_renew_seconds=100.0)
        for n in range(3):
            ids = [f"i{n}-{i}" for i in range(16)]
            await asyncio.gather(*(eng.client.start_flow("Instant", f) for f in ids))
            for f in ids:
                info = await eng.client.wait_for_flow(f, 20)
                assert info.status == "completed", info
                assert await eng.client.flow_output(f) == 1  # handed back unstarted: no attempt used


async def test_a_poll_that_claims_while_a_commit_fills_its_slot_hands_the_excess_back(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A poll claims up to the slots free when it was sent; a commit that lands meanwhile claims
    into the same slot (a committing attempt claims for its own slot and the free ones). Forced
    here on both backends: the worker's claiming poll is held until the running attempt's commit
    has claimed and started two Steps in a worker with two slots, so the poll's claim is one too
    many. The worker must run at most two attempts, hand the third back unstarted (attempt 1 still)
    and run it once a slot frees. The Steps are started through another store, so no client
    hand-off claims them for the worker: only the poll and the commit do, which is all PostgreSQL
    has. Catches: running every lease a claim returns (three at once), and a hand-back that uses
    up the attempt (output 2)."""
    slow_go, all_started = asyncio.Event(), asyncio.Event()
    gauge = _HeldSteps()
    running = gauge.running

    async def slow(ctx: Context, _: None) -> StepDecision:
        await slow_go.wait()
        return StepDecision.graceful_complete(ctx.attempt)

    registry = Registry([Flow("Slow", [Step("Wait", slow)], start_step="Wait"), gauge.flow()])
    async with engine_for(db_url, registry, worker=False) as eng, engine_for(db_url, registry, worker=False) as other:
        worker = await eng.start_worker(max_concurrent_tasks=2)
        held_polls = 0
        original = eng.store.poll

        async def poll(worker_id: str, flow_types: Any, capacity: int, running_ids: Any, **kw: Any) -> Any:
            nonlocal held_polls
            if kw["must_claim"] and capacity == 1 and not slow_go.is_set():
                await all_started.wait()  # the first start woke this poll: let the others land
                slow_go.set()  # the slow attempt ends and its commit claims two Held Steps ...

                async def two_running() -> bool:
                    return len(running) == 2

                await wait_until("the slow attempt's commit to start two Steps", two_running)
                held_polls += 1  # ... before this poll, sent for one free slot, claims a third
            return await original(worker_id, flow_types, capacity, running_ids, **kw)

        monkeypatch.setattr(eng.store, "poll", poll)
        await other.client.start_flow("Slow", "slow")

        async def slow_running() -> bool:
            return len(worker._running) == 1

        await wait_until("the slow attempt to run", slow_running)
        ids = [f"held-{i}" for i in range(4)]
        await asyncio.gather(*(other.client.start_flow("Held", f) for f in ids))
        all_started.set()

        async def forced() -> bool:
            return held_polls > 0

        await wait_until("the worker's poll for the free slot", forced)
        await asyncio.sleep(0.3)  # a third attempt, were the excess claim run, would be running by now
        assert gauge.peak == 2, f"{gauge.peak} attempts ran at once, max_concurrent_tasks is 2"
        gauge.release.set()
        for f in ["slow", *ids]:
            info = await other.client.wait_for_flow(f, 30)
            assert info.status == "completed", info
            assert await other.client.flow_output(f) == 1, f"{f} did not complete on its first attempt"


@pytest.mark.parametrize("ending", ["returns", "revoked"])
async def test_a_full_worker_with_ready_work_waiting_sleeps_until_a_slot_frees(
    db_url: str, monkeypatch: pytest.MonkeyPatch, ending: str
) -> None:
    """A worker whose slots are all taken, with more of its Steps ready (an overloaded worker),
    must not poll for work it cannot claim: the ready Step is due, and the loop, which claims and
    housekeeps when something is due, used to go round again at once, about 1,500 housekeeping
    transactions a second taking CPU and the write lock from the attempts. It sleeps instead, and
    claims the waiting Step as soon as the running one ends: by returning, or revoked when its flow
    is stopped (no commit of its own then claims into its slot). Catches the spin, and a full worker
    that then misses the freed slot (housekeeping and PostgreSQL's fallback poll are a minute away)."""
    if db_url.startswith("postgresql"):
        from dex_engine import _pg_store

        monkeypatch.setattr(_pg_store, "FALLBACK_POLL_SECONDS", 60.0)
    release = asyncio.Event()
    started: list[str] = []

    async def hold(ctx: Context, _: None) -> StepDecision:
        started.append(ctx.flow_id)
        if ctx.flow_id == "first":
            await release.wait()
        return StepDecision.graceful_complete()

    holding = Flow("Holding", [Step("Hold", hold, input_type=type(None))], start_step="Hold")
    async with engine_for(db_url, Registry([holding]), worker=False) as eng:
        worker = await eng.start_worker(max_concurrent_tasks=1, poll_seconds=0.01, housekeeping_seconds=60.0,
                                        lease_ttl_seconds=300.0, lease_renew_seconds=100.0)
        await eng.client.start_flow("Holding", "first")

        async def first_runs() -> bool:
            return started == ["first"]

        await wait_until("the first attempt runs", first_runs)
        await eng.client.start_flow("Holding", "second")
        await asyncio.sleep(0.3)
        polls: list[bool] = []
        real_poll = type(eng.store).poll

        async def counting_poll(self: Store, *args: Any, **kwargs: Any) -> Any:
            polls.append(kwargs["housekeep"])
            return await real_poll(self, *args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(type(eng.store), "poll", counting_poll)
        await asyncio.sleep(0.5)  # 50 poll intervals
        assert len(polls) <= 2, f"a full worker polled {len(polls)} times in 0.5 s ({sum(polls)} housekeeping)"
        assert started == ["first"], "a worker with max_concurrent_tasks=1 ran two attempts at once"
        assert len(worker._running) == 1
        if ending == "returns":
            release.set()
        else:
            await eng.client.stop_flow("first", "no longer needed")
        info = await eng.client.wait_for_flow("second", 10)
        assert info.status == "completed", info
        assert started == ["first", "second"]


# Many sessions waiting ---------------------------------------------------------------------------

# Waiting tasks in the scan test: enough that PostgreSQL's planner, given statistics, prefers an
# index to a sequential scan wherever one serves.
WAITING_TASKS = 20_000
# Tables that grow with the flows stored, which no statement of a worker's polls may read whole.
GROWING_TABLES = {"tasks", "flows"}
_TASK_COLUMNS = (
    "flow_id, flow_type, step_type, step_execution_id, input, options, method, state, attempt, attempt_started, "
    "any_started, method_first_at, run_at, lease_owner, lease_epoch, claimed_at, deadline_at, method_deadline_at, "
    "checkpoint, snapshot, locks_held, wait_spec, wait_registered_at, timer_due_at, timers_skipped, wait_outcome, "
    "last_error, recovery_error, created_at"
)
_FLOW_COLUMNS = ("flow_type, status, input, output, error, config, version, completing, completion_output, "
                 "history_seq, created_at, closed_at")


async def _await_inbox(ctx: Context, _: None) -> Wait:
    return Wait.until(Inbox.for_one())


async def _complete(ctx: Context, _: None) -> StepDecision:
    return StepDecision.graceful_complete("done")


def _full_scans(backend: str, sql: str, plan: list[Any], partial_indexes: set[str]) -> list[str]:
    """The lines of `plan` (EXPLAIN QUERY PLAN rows on SQLite, EXPLAIN lines on PostgreSQL) that
    read a growing table whole. On SQLite a SCAN through one of `partial_indexes` (tasks_running and
    the like: ready or running rows only) reads only those and is allowed; a SEARCH with no index is
    not."""
    if backend == "postgres":
        return [str(row[0]) for row in plan if any(f"Seq Scan on {t} " in str(row[0]) for t in GROWING_TABLES)]
    aliases = {alias or table: table for table, alias in
               re.findall(r"(?:FROM|JOIN)\s+(\w+)(?:\s+(?:AS\s+)?(?!WHERE|ON|JOIN|LEFT|ORDER|GROUP|USING)(\w+))?",
                          sql, flags=re.IGNORECASE)}
    bad = []
    for row in plan:
        # SEARCH without USING is a full scan too (MIN() of a column no usable index holds).
        step = re.fullmatch(r"(SCAN|SEARCH) (\w+)(?: USING (?:COVERING )?INDEX (\w+).*| USING .*)?", str(row[3]))
        if step is None or aliases.get(step[2], step[2]) not in GROWING_TABLES:
            continue
        using = str(row[3]).partition(" USING ")[2]
        if (step[1] == "SCAN" and step[3] not in partial_indexes) or (step[1] == "SEARCH" and not using):
            bad.append(str(row[3]))
    return bad


async def test_a_workers_polls_and_housekeeping_never_read_every_task(db_url: str) -> None:
    """Tasks grow with the sessions waiting for a message, an approval or a timer, which may be
    many and wait for days; every worker polls and housekeeps every second, so none of those
    statements may read every task. With 20,000 flows waiting on a channel, each statement that a
    worker's polls and housekeeping ran, and a message waking one of the flows (the client's
    commit, the wait's evaluation, the Step and its commit) and a search for the one flow waiting
    in another Step, is EXPLAINed: no full scan of tasks or flows (on
    PostgreSQL after ANALYZE, as autovacuum would run; on SQLite without statistics, as a new file
    has them, and again with). Catches: the orphan and lost-claim queries without migration 2/5's
    index on running tasks (about 260 ms a pass with 100,000 waiting on SQLite), DISTINCT or
    ORDER BY flow_id, for which SQLite walks all of tasks_flow instead of the few rows an index on
    running tasks or due timers holds, and the active Step search without the index on waiting
    tasks."""
    backend = "postgres" if db_url.startswith("postgresql") else "sqlite"
    db_class = _pg_store._PgDb if backend == "postgres" else _sqlite_store._SqliteDb
    waiting = Flow("Waiting", [Step("Idle", _complete, wait_for=_await_inbox)], start_step="Idle", schema=[Inbox])
    asking = Flow("Asking", [Step("Ask", _complete, wait_for=_await_inbox)], start_step="Ask", schema=[Inbox])
    async with engine_for(db_url, Registry([waiting, asking])) as eng:
        store = eng.store
        await eng.client.start_flow("Waiting", "w-0")
        await eng.client.start_flow("Asking", "asking")  # the one flow a search for "Ask" must find

        async def registered() -> bool:
            rows = await store._run(lambda db: db.all("SELECT state FROM tasks WHERE flow_id IN ('w-0', 'asking')"),
                                    write=False)
            return [row[0] for row in rows] == ["waiting", "waiting"]

        await wait_until("the first flows to wait on their channel", registered)

        def clone(db: Any) -> None:  # 20,000 more flows exactly like it
            numbers = "WITH RECURSIVE n (i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?) "
            db.run(f"{numbers}INSERT INTO flows (flow_id, {_FLOW_COLUMNS}) SELECT 'w-' || n.i, {_FLOW_COLUMNS} "
                   "FROM flows, n WHERE flow_id = 'w-0'", (WAITING_TASKS,))
            columns = _TASK_COLUMNS.replace("flow_id, ", "", 1)
            db.run(f"{numbers}INSERT INTO tasks ({_TASK_COLUMNS}) SELECT 'w-' || n.i, {columns} "
                   "FROM tasks, n WHERE flow_id = 'w-0'", (WAITING_TASKS,))
            if backend == "postgres":
                db.run("ANALYZE")

        await store._run(clone, write=True)
        # Partial indexes of the states that stay small (attempts ready or in flight), not of waiting
        # tasks, which are the many.
        partial_indexes = set() if backend == "postgres" else {str(row[0]) for row in await store._run(
            lambda db: db.all("SELECT name FROM sqlite_master WHERE type = 'index' AND "
                              "(sql LIKE '% WHERE state = ''running''%' OR sql LIKE '% WHERE state = ''ready''%')"),
            write=False)}
        assert partial_indexes in ({"tasks_ready", "tasks_running"}, set()), partial_indexes
        for analyzed in ([False, True] if backend == "sqlite" else [True]):
            if analyzed and backend == "sqlite":
                await store._run(lambda db: db.run("ANALYZE"), write=True)
            async def wake_one(woken: str = f"w-{1 + analyzed}") -> None:
                # A message, the Step it wakes, that Step's commit, the flow's end; and a search
                # for the flows waiting in a rare Step, as a page of sessions needing a person runs.
                await eng.client.publish(woken, Inbox, "hello")
                assert (await eng.client.wait_for_flow(woken, 30)).status == "completed"
                assert await eng.client.search_flows('ActiveStepTypes = "Ask"') == ["asking"]
                assert await eng.client.search_flows('ActiveStepTypes = "Ask" AND FlowType = "Asking"') == ["asking"]

            statements = await _statements_of_housekeeping(db_class, wake_one)
            bad = {}
            for sql, params in statements.items():
                plan = await store._run(lambda db, s=sql, p=params: db.all(_EXPLAIN[backend] + s, p), write=False)
                if scans := _full_scans(backend, sql, plan, partial_indexes):
                    bad[sql] = scans
            assert bad == {}, f"full scans with {WAITING_TASKS} waiting tasks (statistics: {analyzed}): {bad}"
            assert any("timer_due_at" in sql for sql in statements), sorted(statements)
            assert any("lease_owner" in sql and "claimed_at" in sql for sql in statements), sorted(statements)


_EXPLAIN = {"postgres": "EXPLAIN ", "sqlite": "EXPLAIN QUERY PLAN "}


async def _statements_of_housekeeping(
    db_class: Any, meanwhile: Callable[[], Awaitable[None]],
) -> dict[str, tuple[Any, ...]]:
    """The distinct reading and writing statements (with the parameters of their first run) that
    the store ran over two whole housekeeping passes of its worker and `meanwhile`."""
    seen: dict[str, tuple[Any, ...]] = {}
    passes = 0

    async def two_passes() -> bool:
        return passes >= 3  # the first may have begun before recording: two more are whole

    with pytest.MonkeyPatch.context() as patch:
        for method in ("one", "all", "run"):
            original = getattr(db_class, method)

            def recording(self: Any, sql: str, params: Any = (), _original: Any = original) -> Any:
                nonlocal passes
                passes += sql.startswith("DELETE FROM workers WHERE expires_at")  # a pass's first statement
                seen.setdefault(sql, tuple(params))
                return _original(self, sql, params)

            patch.setattr(db_class, method, recording)
        await meanwhile()
        await wait_until("three housekeeping passes", two_passes)
    return {sql: params for sql, params in seen.items()
            if re.match(r"\s*(SELECT|UPDATE|DELETE|WITH)\b", sql, flags=re.IGNORECASE)}


HIDDEN_FLOWS = 3000


def _rows_read(db_url: str, table: str, sql: str, params: tuple[Any, ...], *, pg_settings: tuple[str, ...] = ()) -> int:
    """How much of `table` `sql` reads, on a connection of its own: PostgreSQL's count of the
    `table` rows its scans returned or filtered out (EXPLAIN ANALYZE, after `pg_settings`), SQLite's
    virtual machine steps (about ten per row a scan visits)."""
    if db_url.startswith("postgresql"):
        import psycopg

        with psycopg.connect(db_url, autocommit=True) as conn:
            for setting in pg_settings:
                conn.execute(setting)
            plan = conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + _pg_store._to_pg(sql), params).fetchone()
        assert plan is not None
        read, nodes = 0, [plan[0][0]["Plan"]]
        while nodes:
            node = nodes.pop()
            nodes += node.get("Plans", [])
            if node.get("Relation Name") == table:
                read += (node["Actual Rows"] + node.get("Rows Removed by Filter", 0)) * node["Actual Loops"]
        return read
    steps = [0]

    def step() -> int:
        steps[0] += 1
        return 0  # go on

    conn = sqlite3.connect(db_url.removeprefix("sqlite:///"))
    try:
        conn.set_progress_handler(step, 1)
        conn.execute(sql, params).fetchall()
    finally:
        conn.close()
    return steps[0]


# The plan PostgreSQL takes when it expects many flows after a search's page (statistics that lag
# behind the newest flows): the running flows in created_at order, not a bitmap of the few it would
# pick by exact estimates.
_LAGGING_STATISTICS_PLAN = ("SET enable_bitmapscan = off", "SET enable_seqscan = off")


async def test_an_active_step_search_reads_on_after_hidden_flows_without_reading_them_again(
    db_url: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """E13/E16: a search by active Step with more candidates than it reads one by one pages through
    the running flows; flows whose config hides them take places in a page, and it reads on after
    the page. Each page must start where the last one ended, through the index on (status,
    created_at). Catches: the page's bound was only `created_at > ? OR (created_at = ? AND flow_id >
    ?)`, which no index range serves, so each page read the running flows from the first one again:
    quadratic in hidden flows (a search with limit 1 past 5,000 hidden sessions took 36 s on
    PostgreSQL, holding its connection and transaction all along)."""
    async with engine_for(db_url, Registry([FLOW]), worker=False) as eng:
        store = eng.store
        monkeypatch.setattr(_store, "now_ms", lambda: 1_700_000_000_000)
        await eng.client.start_flow("Behaviour", "hidden-0", config_override=FlowConfig(active_step_search=False))

        def clone(db: Any) -> None:  # HIDDEN_FLOWS more like it, each a millisecond younger
            numbers = "WITH RECURSIVE n (i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?) "
            columns = _FLOW_COLUMNS.replace(", created_at", "")
            db.run(f"{numbers}INSERT INTO flows (flow_id, created_at, {columns}) SELECT 'hidden-' || n.i, "
                   f"created_at + n.i, {columns} FROM flows, n WHERE flow_id = 'hidden-0'", (HIDDEN_FLOWS,))
            task_columns = _TASK_COLUMNS.replace("flow_id, ", "", 1)
            db.run(f"{numbers}INSERT INTO tasks ({_TASK_COLUMNS}) SELECT 'hidden-' || n.i, {task_columns} "
                   "FROM tasks, n WHERE flow_id = 'hidden-0'", (HIDDEN_FLOWS,))

        await store._run(clone, write=True)
        monkeypatch.setattr(_store, "now_ms", lambda: 1_700_000_000_000 + HIDDEN_FLOWS + 1)
        await eng.client.start_flow("Behaviour", "shown")
        monkeypatch.setattr(_transitions, "ACTIVE_STEP_SEARCH_CANDIDATES", 0)  # page through running flows,
        monkeypatch.setattr(_transitions, "ACTIVE_STEP_SEARCH_CANDIDATES_PER_FLOW_WALKED", 1)  # all of them
        pages: list[tuple[str, tuple[Any, ...]]] = []
        real = _transitions.search_flows

        def recorded(db: Any, *args: Any) -> Any:
            class Recording:
                def __getattr__(self, name: str) -> Any:
                    return getattr(db, name)

                def all(self, sql: str, params: Any = ()) -> Any:
                    pages.append((sql, tuple(params)))
                    return db.all(sql, params)

            return real(Recording(), *args)

        monkeypatch.setattr(_transitions, "search_flows", recorded)
        assert await eng.client.search_flows('ActiveStepTypes = "Flaky"', limit=10) == ["shown"]
        assert len(pages) > HIDDEN_FLOWS // 10  # a page of ten after another
        last_sql, last_params = pages[-1]  # the page after all but the last few hidden flows
        read = _rows_read(db_url, "flows", last_sql, last_params, pg_settings=_LAGGING_STATISTICS_PLAN)
        assert read < HIDDEN_FLOWS, f"the last page read {read} (rows or steps) past {HIDDEN_FLOWS} hidden flows"


READY_TASKS = 3000


async def test_a_claim_reads_only_the_ready_tasks_it_takes_when_many_are_due_at_one_time(db_url: str) -> None:
    """A housekeeping pass that fires many timers (approval deadlines falling due while no worker
    ran) makes every woken task ready at the same run_at, and a claim takes the oldest few by
    (run_at, task_id). Each claim, and each Step commit that claims for its freed slot, must read
    only those few. Catches: on PostgreSQL the index on ready tasks held run_at alone, so every
    claim read and sorted all the tasks of that run_at: 5,000 fired deadlines took 18 s to be
    claimed once each, and a message sent meanwhile waited as long."""
    async with engine_for(db_url, Registry([FLOW]), worker=False) as eng:
        store = eng.store
        await eng.client.start_flow("Behaviour", "ready-0")

        def clone(db: Any) -> None:  # READY_TASKS more flows, each with its ready task at the same run_at
            numbers = "WITH RECURSIVE n (i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?) "
            db.run(f"{numbers}INSERT INTO flows (flow_id, {_FLOW_COLUMNS}) SELECT 'ready-' || n.i, {_FLOW_COLUMNS} "
                   "FROM flows, n WHERE flow_id = 'ready-0'", (READY_TASKS,))
            columns = _TASK_COLUMNS.replace("flow_id, ", "", 1)
            db.run(f"{numbers}INSERT INTO tasks ({_TASK_COLUMNS}) SELECT 'ready-' || n.i, {columns} "
                   "FROM tasks, n WHERE flow_id = 'ready-0'", (READY_TASKS,))
            if db_url.startswith("postgresql"):
                db.run("ANALYZE")

        await store._run(clone, write=True)
        await store.register_worker("claimer", "test-host", 1, 3_600_000)
        db_class = _pg_store._PgDb if db_url.startswith("postgresql") else _sqlite_store._SqliteDb
        claims: list[tuple[str, tuple[Any, ...]]] = []
        with pytest.MonkeyPatch.context() as patch:
            original = db_class.all

            def recording(self: Any, sql: str, params: Any = ()) -> Any:
                if "state = 'ready' AND" in sql and "ORDER BY" in sql:
                    claims.append((sql, tuple(params)))
                return original(self, sql, params)

            patch.setattr(db_class, "all", recording)
            leases = await store.claim("claimer", ["Behaviour"], 1)
        assert [lease.flow_id for lease in leases] == ["ready-0"]
        assert len(claims) == 1, claims
        read = _rows_read(db_url, "tasks", *claims[0])
        assert read < READY_TASKS, f"a claim of one task read {read} (rows or steps) of {READY_TASKS} ready tasks"


async def test_a_client_that_starts_flows_for_days_remembers_only_so_many(
    db_url: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The client keeps each started flow's type for its RPCs, within CLIENT_FLOW_TYPE_CACHE_ENTRIES;
    without the bound a long-lived client leaks one entry per flow it ever started."""
    monkeypatch.setattr(_client, "CLIENT_FLOW_TYPE_CACHE_ENTRIES", 3)
    async with engine_for(db_url, Registry([FLOW]), worker=False) as eng:
        for n in range(7):
            await eng.client.start_flow("Behaviour", f"many-{n}")
            assert 1 <= len(eng.client._flow_types) <= 3
        assert eng.client._flow_types["many-6"] == "Behaviour"


# In-flight messages: taken by a satisfied wait, not yet handled by its Step's Execute ------------

Mail = Channel("Mail", str)
handled: list[str] = []
release: list[asyncio.Event] = []  # attempt 2 of ReadMail waits for it; made in each test's own loop


async def _wait_mail(ctx: Context, _: Any) -> Wait:
    return Wait.until(Mail.for_one())


async def _read_mail(ctx: Context, _: Any) -> StepDecision:
    assert ctx.wait_result is not None
    if ctx.attempt == 1:
        raise RuntimeError("the first attempt fails: the message stays in flight for the retry")
    await release[0].wait()
    handled.extend(ctx.wait_result.messages(Mail))
    return StepDecision.dead_end()


@rpc(name="mail_view")
async def _mail_view(ctx: RpcContext, _: None = None) -> dict[str, list[str]]:
    return {"pending": [m.value for m in ctx.pending(Mail)], "in_flight": [m.value for m in ctx.in_flight(Mail)]}


MAIL_FLOW = Flow(
    "MailFlow",
    [Step("ReadMail", _read_mail, wait_for=_wait_mail,
          options=StepOptions(execute_retry=RetryPolicy(max_attempts=3, initial_interval_seconds=0.01)))],
    start_step="ReadMail",
    schema=[Mail],
    rpcs=[_mail_view],
)


async def test_rpcs_see_messages_a_wait_took_until_its_execute_commits(db_url: str) -> None:
    """A message published to a registered wait leaves the queue at once (E5) but is not handled
    until the Step's Execute commits. An RPC sees it through in_flight() meanwhile: while no worker
    runs, and across a failed attempt; pending() never shows it, and after the commit neither does.
    Breaks if rpc_read drops wait outcomes or keeps a committed Step's."""
    handled.clear()
    release[:] = [asyncio.Event()]
    async with engine_for(db_url, Registry([MAIL_FLOW]), worker=False) as eng:
        await eng.client.start_flow("MailFlow", "m1")
        assert await eng.client.rpc("m1", "mail_view") == {"pending": [], "in_flight": []}
        await eng.client.publish("m1", Mail, "early")  # no wait registered yet: queued
        assert await eng.client.rpc("m1", "mail_view") == {"pending": ["early"], "in_flight": []}
        await eng.start_worker()

        async def view_is(expected: dict[str, list[str]]) -> bool:
            return bool(await eng.client.rpc("m1", "mail_view") == expected)

        await wait_until("the wait took the queued message", lambda: view_is({"pending": [], "in_flight": ["early"]}))
        await eng.client.publish("m1", Mail, "later")  # the wait is satisfied: this one stays queued
        await asyncio.sleep(0.3)  # attempt 1 failed by now; attempt 2 waits to be released
        assert await eng.client.rpc("m1", "mail_view") == {"pending": ["later"], "in_flight": ["early"]}
        release[0].set()
        await wait_until("the Execute committed", lambda: view_is({"pending": ["later"], "in_flight": []}))
        assert handled == ["early"]


@pytest.mark.parametrize("operation", ["poll", "renew_worker"])
async def test_a_worker_whose_poll_or_renewal_fails_waits_before_it_tries_again(
    db_url: str, monkeypatch: pytest.MonkeyPatch, operation: str
) -> None:
    """A database that refuses the worker's polls or lease renewals (down, overloaded) is tried
    again after a pause (poll_seconds; for a renewal the shorter of RENEW_RETRY_SECONDS and
    lease_renew_seconds), not in a tight loop that spins the CPU and floods the log; once it
    answers, the worker goes on. Catches a retry without its pause."""
    pause = 0.2
    failing = 3
    tried: list[float] = []

    async with engine_for(db_url, Registry([FLOW]), worker=False) as eng:
        real = getattr(eng.store, operation)

        async def refusing(*args: Any, **kwargs: Any) -> Any:
            tried.append(time.monotonic())
            if len(tried) <= failing:
                raise RuntimeError("the database is down")
            return await real(*args, **kwargs)

        monkeypatch.setattr(eng.store, operation, refusing)
        await eng.start_worker(poll_seconds=pause, lease_renew_seconds=pause, lease_ttl_seconds=10.0)
        await eng.client.start_flow("Behaviour", "f")
        assert (await eng.client.wait_for_flow("f", 10)).status == "completed"

        async def answered() -> bool:
            return len(tried) > failing

        await wait_until(f"the worker to try {operation} again after the failures", answered)
    assert_paced(tried[: failing + 1], pause)


_escapes: list[tuple[str, int]] = []
_ESCAPING: dict[str, type[BaseException]] = {"GeneratorExit": GeneratorExit, "SystemExit": SystemExit}


async def _lets_out(ctx: Context, kind: str) -> StepDecision:
    _escapes.append((kind, ctx.attempt))
    raise _ESCAPING[kind]()


async def _to_pure(ctx: Context, kind: str) -> StepDecision:
    return StepDecision.go_to("Run", kind)  # Run, pure, is first stepped inside this commit


async def _routed(ctx: Context, _: str) -> StepDecision:
    assert ctx.recovery_error is not None
    return StepDecision.graceful_complete(ctx.recovery_error.error_type)


_TWO_QUICK = RetryPolicy(max_attempts=2, initial_interval_seconds=0.01, max_interval_seconds=0.01)


def _escapes_flow(*, pure: bool) -> Flow:
    run = Step("Run", _lets_out, input_type=str, pure_execute=pure,
               options=StepOptions(execute_retry=_TWO_QUICK, failure_route="Route"))
    steps = [run, Step("Route", _routed, input_type=str)]  # a failure route gets the failed Step's input
    if pure:
        steps.append(Step("Go", _to_pure, input_type=str))
    return Flow("EscapesPure" if pure else "Escapes", steps, start_step="Go" if pure else "Run")


@pytest.mark.parametrize("kind", sorted(_ESCAPING))
@pytest.mark.parametrize("pure", [False, True], ids=["usual", "pure"])
async def test_a_handler_letting_out_a_base_exception_fails_its_attempt(db_url: str, kind: str, pure: bool) -> None:
    """A handler that lets out GeneratorExit, or SystemExit (a library's sys.exit(), argparse's),
    fails its attempt like any other error: retried, then its failure route; the worker goes on.
    Catches: the exception escaping the attempt's task, its Step left running for ever while the
    worker renewed its lease (GeneratorExit), or the worker process ended (SystemExit); for a pure
    Step, the exception aborting the commit that stepped it."""
    _escapes.clear()
    flow = _escapes_flow(pure=pure)
    async with engine_for(db_url, Registry([flow])) as eng:
        await eng.client.start_flow(flow.flow_type, "e", kind)
        assert (await eng.client.wait_for_flow("e", 20)).status == "completed"
        assert await eng.client.flow_output("e") == kind
        assert _escapes[-2:] == [(kind, 1), (kind, 2)]


# A chain of Steps and a due Step of another flow on a worker with one slot.
_TIMER_RAN = asyncio.Event()
_MAX_LOOPS = 3000  # far more than the chain needs once the other flow's Step runs (about a second)


async def _loop_until_timer_ran(ctx: Context, loops: int) -> StepDecision:
    if _TIMER_RAN.is_set():
        return StepDecision.graceful_complete(f"saw it after {loops} loops")
    if loops >= _MAX_LOOPS:
        return StepDecision.graceful_complete("starved")
    await asyncio.sleep(0.001)  # some I/O, as a poll of another service does
    return StepDecision.go_to("Loop", loops + 1)


async def _after_a_moment(ctx: Context, _: None) -> Wait:
    return Wait.until(Timer.by_duration(0.3))


async def _mark_timer_ran(ctx: Context, _: None) -> StepDecision:
    _TIMER_RAN.set()
    return StepDecision.graceful_complete("ran")


LOOPING = Flow("Looping", [Step("Loop", _loop_until_timer_ran, input_type=int)], start_step="Loop")
TIMED = Flow("Timed", [Step("Fire", _mark_timer_ran, wait_for=_after_a_moment, input_type=type(None))],
             start_step="Fire")


async def test_a_chain_of_steps_does_not_keep_a_due_step_of_another_flow_waiting(db_url: str) -> None:
    """A worker with one slot runs a flow whose Step moves to itself until another flow's Step, due
    after a 0.3 s timer, has run: that Step gets the slot as soon as it is due, and the chain ends.
    Catches: each commit of the chain handing its next Step straight back to the worker, which then
    never claimed the due Step: the chain looped until it gave up ('starved'), and one that waited
    for ever would have deadlocked the two flows."""
    _TIMER_RAN.clear()
    async with engine_for(db_url, Registry([LOOPING, TIMED]), worker=False) as eng:
        await eng.start_worker(max_concurrent_tasks=1)
        await eng.client.start_flow("Timed", "t")
        await eng.client.start_flow("Looping", "c", 0)
        assert (await eng.client.wait_for_flow("c", 60)).status == "completed"
        assert str(await eng.client.flow_output("c")).startswith("saw it after ")
        assert await eng.client.flow_output("t") == "ran"


# More events than one INSERT of either backend can carry (250,000 parameters in this SQLite build, PostgreSQL's
# 65,535, six to an event).
BURST_EVENTS = 45_000
Burst = Stream("Burst", int)


def _burst_flow(then: str) -> Flow:
    async def burst(ctx: Context, _: Any) -> StepDecision:
        for i in range(BURST_EVENTS):  # no await between: a synchronous loop, as a plain-def callback writes
            ctx.write_event(Burst, i)
        if then == "yield":
            await asyncio.sleep(0.05)  # the flush runs meanwhile
        elif then == "heartbeat":
            await ctx.heartbeat()  # the heartbeat carries the pending events
        return StepDecision.graceful_complete()

    return Flow("Bursting", [Step("Burst", burst)], start_step="Burst", schema=[Burst])


@pytest.mark.parametrize("then", ["return", "yield", "heartbeat"])
async def test_a_burst_of_events_is_stored_whole_in_the_one_attempt(db_url: str, then: str) -> None:
    """Thousands of events written without an await. Catches: the flush putting them all in one
    INSERT over the backend's parameter limit, so the attempt failed and was run again (a model
    call paid for each time) with none of its events kept, or the events dropped silently."""
    async with engine_for(db_url, Registry([_burst_flow(then)])) as eng:
        await eng.client.start_flow("Bursting", "b1")
        assert (await eng.client.wait_for_flow("b1", 60)).status == "completed"
        read = await eng.client.read_stream("b1", Burst, limit=BURST_EVENTS + 1)
        assert [e.value for e in read.events] == list(range(BURST_EVENTS))
        assert {e.attempt for e in read.events} == {1}
        history = await eng.client.get_flow_history("b1")
        assert [h.event_type for h in history if h.event_type == "attempt_failed"] == []


async def test_events_that_cannot_be_written_are_dropped_and_the_attempt_commits(
    db_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """A store error on the best-effort append (not a lost lease) drops that batch with a warning.
    Catches: the error escaping the flush into the attempt's end, so the Worker handed the attempt
    back and ran it again, three times, for events that are best effort."""
    async with engine_for(db_url, Registry([_burst_flow("return")])) as eng:
        async def failing(*_args: Any) -> None:
            raise RuntimeError("disk I/O error")

        monkeypatch.setattr(eng.store, "append_best_effort", failing)
        with caplog.at_level(logging.WARNING, logger="dex_engine.worker"):
            await eng.client.start_flow("Bursting", "b1")
            assert (await eng.client.wait_for_flow("b1", 60)).status == "completed"
        history = await eng.client.get_flow_history("b1")
        assert [h.attempt for h in history if h.event_type == "execute_completed"] == [1]
        dropped = f"flow b1: {BURST_EVENTS} events of Burst-1 attempt 1 could not be written and were dropped"
        assert dropped in caplog.text


def test_wall_clock_steps_are_told_from_time_passing() -> None:
    """Both clocks moving together is time passing (a paused process included); the wall clock
    moving alone is a step, forward or back."""
    wall, monotonic = [1_000.0], [5.0]
    steps = WallClockSteps(lambda: wall[0], lambda: monotonic[0])
    wall[0] += 30.0
    monotonic[0] += 30.0
    assert steps.step() == 0.0  # 30 s passed (or the process was stopped for 30 s)
    wall[0] += 3_600.5
    monotonic[0] += 0.5
    assert steps.step() == 3_600.0  # NTP set the time an hour forward
    wall[0] -= 25.0
    monotonic[0] += 1.0
    assert steps.step() == -26.0
    assert steps.step() == 0.0  # measured from the last look, not from the start


async def test_a_forward_step_of_the_wall_clock_declares_no_live_worker_dead(
    db_url: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The wall clock steps forward past the lease TTL under two live workers. Catches: the first
    to renew its own lease then declaring the other dead before it renewed, so that worker's
    started Step failed as WorkerLost and ran a second time while its first run went on."""
    runs: list[int] = []

    async def tool(ctx: Context, _: Any) -> StepDecision:
        runs.append(ctx.attempt)
        for _ in range(30):  # a started attempt (it heartbeats) that outlives the step
            await ctx.heartbeat()
            await asyncio.sleep(0.1)
        return StepDecision.graceful_complete()

    offset = [0.0]
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + offset[0])
    timings = {"lease_ttl_seconds": 3.0, "lease_renew_seconds": 1.0, "housekeeping_seconds": 0.1}
    async with engine_for(db_url, _one_step("Tools", tool), worker=False) as eng, \
            engine_for(db_url, _one_step("Other", _done), worker=False) as other:
        await other.start_worker(worker_id="other", **timings)
        await asyncio.sleep(0.5)  # their renewals out of phase, as two processes' are
        await eng.start_worker(worker_id="tools", **timings)
        await eng.client.start_flow("Tools", "t")
        await wait_until("the tool to start", lambda: asyncio.sleep(0, runs))
        offset[0] = 20.0  # NTP steps the machine's clock, which every worker reads
        assert (await eng.client.wait_for_flow("t", 30)).status == "completed"
        history = await eng.client.get_flow_history("t")
        assert [h.detail for h in history if h.event_type == "attempt_failed"] == []
        assert runs == [1]


async def test_a_drain_gives_up_a_slow_poll_at_its_grace(db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The drain's poll for cancelled attempts stops at the end of the grace, which then revokes
    what runs. Catches: a poll hanging on a slow database holding stop() past its grace."""
    log: list[str] = []

    async def hold(ctx: Context, _: Any) -> StepDecision:
        log.append("running")
        await asyncio.Event().wait()
        return StepDecision.graceful_complete()

    async with engine_for(db_url, _one_step("Held", hold), worker=False) as eng:
        worker = await _holding(eng, "Held", "h", log, shutdown_grace_seconds=1.0)
        polling = eng.store.poll

        async def slow_while_draining(*args: Any, **kwargs: Any) -> Any:
            if worker._stopping.is_set():
                await asyncio.sleep(600)  # a database that stopped answering
            return await polling(*args, **kwargs)

        monkeypatch.setattr(eng.store, "poll", slow_while_draining)
        stopping = asyncio.create_task(worker.stop())
        await wait_until("the worker to start draining", lambda: asyncio.sleep(0, worker._stopping.is_set()))
        worker._notify()  # a wake-up while draining, as a commit's
        await asyncio.wait_for(stopping, 30)


async def test_a_stream_that_cannot_be_written_drops_only_its_own_events(
    db_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """One attempt writes to two streams and the append to one fails: the other's events are kept,
    and the warning counts only the events dropped. Catches: the whole batch given up (and counted)
    for one stream's error."""
    kept, lost = Stream("Kept", str), Stream("Lost", str)

    async def both(ctx: Context, _: Any) -> StepDecision:
        ctx.write_event(lost, "a")
        ctx.write_event(lost, "b")
        ctx.write_event(kept, "c")
        return StepDecision.graceful_complete()

    registry = Registry([Flow("Two", [Step("Both", both)], start_step="Both", schema=[kept, lost])])
    async with engine_for(db_url, registry) as eng:
        appending = eng.store.append_best_effort

        async def failing_for_lost(lease: Any, stream: str, *rest: Any) -> Any:
            if stream == "Lost":
                raise RuntimeError("disk I/O error")
            return await appending(lease, stream, *rest)

        monkeypatch.setattr(eng.store, "append_best_effort", failing_for_lost)
        with caplog.at_level(logging.WARNING, logger="dex_engine.worker"):
            await eng.client.start_flow("Two", "t")
            assert (await eng.client.wait_for_flow("t", 30)).status == "completed"
        assert [e.value for e in (await eng.client.read_stream("t", kept)).events] == ["c"]
        assert "flow t: 2 events of Both-1 attempt 1 could not be written and were dropped" in caplog.text


def test_a_worker_trusts_no_lease_for_a_ttl_after_the_clock_steps_forward_and_warns_of_a_step_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Forward past CLOCK_STEP_SECONDS: no worker declared dead for one lease TTL, the renewal at
    once, and a warning; back: a warning only; within it: nothing. Catches: a step back taken for
    a forward one (holding takeovers off for nothing), or drift taken for a step."""
    wall, monotonic = [1_000.0], [5.0]
    worker = AsyncWorker(Registry([FLOW]), WorkerOptions(database_url="sqlite:///unused.db", lease_ttl_seconds=30.0))
    worker._clock = WallClockSteps(lambda: wall[0], lambda: monotonic[0])
    with caplog.at_level(logging.WARNING, logger="dex_engine.worker"):
        wall[0] += 1.5  # drift within CLOCK_STEP_SECONDS
        worker._watch_clock()
        assert (worker._trust_leases_at, worker._renew_now.is_set(), caplog.text) == (0.0, False, "")
        wall[0] -= 60.0
        worker._watch_clock()
        assert (worker._trust_leases_at, worker._renew_now.is_set()) == (0.0, False)
        assert "the wall clock stepped 60.0 s back" in caplog.text
        wall[0] += 3_600.0
        before = time.monotonic()
        worker._watch_clock()
        assert before + 30.0 <= worker._trust_leases_at <= time.monotonic() + 30.0
        assert worker._renew_now.is_set()
        assert "the wall clock stepped 3600.0 s forward; it declares no worker dead for the next 30 s" in caplog.text


async def test_an_older_worker_leaves_a_step_its_registry_lacks_for_a_worker_that_declares_it(
    db_url: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """A rolling deploy adds Step D to flow type Chain. A worker of the older version, whose Chain
    has no D, never runs nor fails it: it hands the ready D back (unstarted: same attempt, E3),
    claims it no more, says once what is missing and what to do, and a worker that declares D runs
    it as soon as it comes. It used to claim D and fail it on every attempt (WorkerInvocationError:
    UndeclaredNameError), and the flow ended failed for good; then to claim it again after each
    back-off, when it could win it from the newer worker many times in a row."""

    async def to_d(ctx: Context, _: Any) -> StepDecision:
        return StepDecision.go_to("D")

    async def to_b(ctx: Context, _: Any) -> StepDecision:
        return StepDecision.go_to("B")

    async def one_second(ctx: Context, _: Any) -> Wait:
        return Wait.until(Timer.by_duration(1))

    async def finish(ctx: Context, _: Any) -> StepDecision:
        return StepDecision.graceful_complete(f"{ctx.step_execution_id} ran")

    async def to_p2(ctx: Context, _: Any) -> StepDecision:
        return StepDecision.go_to("P2")

    newer = Registry([Flow("Chain", [Step("A", to_d), Step("D", finish, wait_for=one_second)], start_step="A")])
    older = Registry([Flow("Chain", [Step("A", to_b), Step("B", finish)], start_step="A"),
                      Flow("Pure", [Step("P1", to_p2), Step("P2", finish, pure_execute=True)], start_step="P1")])

    def worker(registry: Registry, worker_id: str, store: Store) -> AsyncWorker:
        return AsyncWorker(registry, WorkerOptions(**{**FAST.__dict__, "database_url": db_url,
                                                      "worker_id": worker_id}), store=store)

    async with engine_for(db_url, newer, worker=False) as eng:
        async def d_row() -> Any:
            return await eng.store.raw(lambda db: db.one(
                "SELECT state, method, attempt, lease_epoch FROM tasks WHERE flow_id = 'f' AND step_type = 'D'"))

        async with worker(newer, "v2", eng.store):
            await eng.client.start_flow("Chain", "f")
            await wait_until("D waiting on its timer", lambda: _is(d_row(), "waiting"))
        waited_epoch = (await d_row())[3]  # 0 when D's WaitFor ran in the commit of A (folded waits)
        caplog.set_level(logging.WARNING, logger="dex_engine.worker")
        old_store = open_store(db_url)
        try:
            async with worker(older, "v1", old_store):
                async def handed_back() -> bool:
                    row = await d_row()
                    return tuple(row[:3]) == ("ready", "execute", 1) and row[3] > 0  # claimed, then handed back

                await wait_until("v1 to claim D and hand it back", handed_back)
                claimed = await d_row()
                assert claimed[3] == waited_epoch + 1, claimed  # claimed once
                await asyncio.sleep(1)  # v1 polls many times meanwhile (FAST): it claims D no more
                assert await d_row() == claimed, "v1 ran, failed or claimed D again"
                # Nor do v1's own commits claim it: P1's commit (SQLite) runs the pure P2 it starts
                # in its transaction, which ends the flow and frees the slot that commit claims into.
                pure = AsyncClient(older, store=old_store)
                await pure.start_flow("Pure", "p")
                assert (await pure.wait_for_flow("p", 10)).status == "completed"
                assert await d_row() == claimed, "v1's commit claimed D"
                assert (await eng.client.describe_flow("f")).status == "running"
                warned = [r.getMessage() for r in caplog.records if "'D'" in r.getMessage()]
                assert len(warned) == 1, warned
                assert all(w in warned[0] for w in ("'Chain'", "v1", "start a worker whose Registry declares"))
                async with worker(newer, "v2b", eng.store):
                    info = await eng.client.wait_for_flow("f", 10)
                assert info.status == "completed", info
        finally:
            await old_store.close()
        ran = [(h.event_type, h.attempt) for h in await eng.client.get_flow_history("f") if h.step_type == "D"]
        assert ("execute_completed", 1) in ran and {a for _, a in ran if a} == {1}, ran


async def test_an_older_worker_leaves_a_wait_for_its_registry_lacks_for_a_worker_that_declares_it(
    db_url: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """The same when the newer version gave a Step a WaitFor: an older worker, whose Step has none,
    hands the ready WaitFor back unstarted, and claims it no more, instead of failing it (it did, as
    an UndeclaredNameError)."""

    async def finish(ctx: Context, _: Any) -> StepDecision:
        return StepDecision.graceful_complete("done")

    async def at_once(ctx: Context, _: Any) -> Wait:
        return Wait.until(Timer.by_duration(0))

    newer = Registry([Flow("Waits", [Step("S", finish, wait_for=at_once)], start_step="S")])
    older = Registry([Flow("Waits", [Step("S", finish)], start_step="S")])
    caplog.set_level(logging.WARNING, logger="dex_engine.worker")
    async with engine_for(db_url, newer, worker=False) as eng:
        old_store = open_store(db_url)
        try:
            async with AsyncWorker(older, WorkerOptions(**{**FAST.__dict__, "database_url": db_url}), store=old_store):
                await eng.client.start_flow("Waits", "w")

                async def s_row(flow_id: str = "w") -> Any:
                    return await eng.store.raw(lambda db: db.one(
                        "SELECT state, method, attempt, lease_epoch FROM tasks WHERE flow_id = ?", (flow_id,)))

                await wait_until("the older worker to claim S's WaitFor and hand it back",
                                 lambda: _is(s_row(), "ready", "wait_for", 1, 1))
                await asyncio.sleep(1)  # it polls many times meanwhile (FAST): it claims S no more
                assert await s_row() == ("ready", "wait_for", 1, 1)
                # Nor does a client's commit on its store claim an S for it (SQLite hands the Steps
                # such a commit makes ready to a worker of the process, in that commit).
                await AsyncClient(newer, store=old_store).start_flow("Waits", "w2")
                await asyncio.sleep(0.3)
                assert await s_row() == ("ready", "wait_for", 1, 1)
                assert await s_row("w2") == ("ready", "wait_for", 1, 0)
                warned = [r.getMessage() for r in caplog.records if "a WaitFor for Step 'S'" in r.getMessage()]
                assert len(warned) == 1 and "'Waits'" in warned[0], warned
                await eng.start_worker()
                assert (await eng.client.wait_for_flow("w", 10)).status == "completed"
        finally:
            await old_store.close()
        attempts = {h.attempt for h in await eng.client.get_flow_history("w") if h.attempt}
        assert attempts == {1}, attempts


async def _is(row: Awaitable[Any], *prefix: object) -> bool:
    got = await row
    return got is not None and tuple(got[:len(prefix)]) == prefix


async def test_work_a_full_workers_housekeeping_readies_as_its_slot_frees_is_claimed_at_once(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A housekeeping poll sent while every slot was taken claims nothing (it asks for no slot);
    when the running attempt commits meanwhile, its commit claims into its freed slot what is
    ready then, which is nothing, and so does not wake the loop; and when that poll's housekeeping
    then fires a timer, the Step it readies must still be claimed at once, not at the next
    housekeeping or poll. Forced here on both backends: the worker's one slot is held by an attempt
    that commits while the housekeeping poll that fires a timer is held before its transaction;
    polls, housekeeping and PostgreSQL's fallback poll are a minute apart. Catches the loop going
    back to sleep after that poll, the timed Step left ready for up to a housekeeping interval."""
    if db_url.startswith("postgresql"):
        monkeypatch.setattr(_pg_store, "FALLBACK_POLL_SECONDS", 60.0)
    release = asyncio.Event()
    ran: list[str] = []

    async def hold(ctx: Context, _: None) -> StepDecision:
        ran.append(ctx.flow_id)
        await release.wait()
        return StepDecision.graceful_complete()

    async def after_a_second(ctx: Context, _: None) -> Wait:
        return Wait.until(Timer.by_duration(1))

    async def timed(ctx: Context, _: None) -> StepDecision:
        ran.append(ctx.flow_id)
        return StepDecision.graceful_complete()

    registry = Registry([
        Flow("HoldSlot", [Step("Hold", hold, input_type=type(None))], start_step="Hold"),
        Flow("Timed", [Step("Fire", timed, input_type=type(None), wait_for=after_a_second)], start_step="Fire"),
    ])
    async with engine_for(db_url, registry, worker=False) as eng:
        worker = await eng.start_worker(max_concurrent_tasks=1, poll_seconds=60.0, housekeeping_seconds=60.0,
                                        lease_ttl_seconds=300.0, lease_renew_seconds=100.0)
        real_poll = eng.store.poll
        forced: list[bool] = []

        async def poll(worker_id: str, flow_types: Any, capacity: int, running_ids: Any, **kw: Any) -> Any:
            if kw["housekeep"] and capacity == 0 and not forced:
                forced.append(True)
                release.set()  # the held attempt commits, claiming nothing: its timer has not fired yet

                async def committed() -> bool:
                    return not worker._running

                await wait_until("the held attempt's commit", committed)
            return await real_poll(worker_id, flow_types, capacity, running_ids, **kw)

        monkeypatch.setattr(eng.store, "poll", poll)
        await eng.client.start_flow("Timed", "timed")
        await eng.client.start_flow("HoldSlot", "held")

        async def held() -> bool:
            return ran == ["held"]

        await wait_until("the held attempt to run", held)
        info = await eng.client.wait_for_flow("timed", 15)
        assert forced, "no housekeeping poll was sent while the slot was held: the test did not force the race"
        assert info.status == "completed", f"the fired timer's Step was not claimed at once: {info}"
        assert ran == ["held", "timed"]


@pytest.mark.parametrize("timeout", ["heartbeat", "execute"])
async def test_a_forward_step_of_the_wall_clock_fails_no_live_attempt_as_timed_out(
    db_url: str, timeout: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The wall clock steps forward 20 s under a live worker whose started Step heartbeats every
    second with a 5 s heartbeat timeout (or has a 10 s execute timeout) and ends in 3 s. Catches:
    housekeeping failing it as HeartbeatTimeout or MethodTimeout at once, by deadlines written
    before the step, while it runs on: its write done, the attempt recorded failed (for an agent's
    single-attempt write, outcome_unknown) and, with retries, run a second time."""
    runs: list[int] = []

    async def tool(ctx: Context, _: Any) -> StepDecision:
        for _ in range(3):
            await ctx.heartbeat()
            if not runs or runs[-1] != ctx.attempt:
                runs.append(ctx.attempt)  # after a heartbeat: the step must come after a deadline written
            await asyncio.sleep(1.0)
        return StepDecision.graceful_complete()

    options = (StepOptions(heartbeat_timeout_seconds=5.0) if timeout == "heartbeat"
               else StepOptions(execute_timeout_seconds=10.0))
    registry = Registry([Flow("Tools", [Step("Hold", tool, options=options)], start_step="Hold")])
    offset = [0.0]
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + offset[0])
    # A TTL shorter than what is left of the Step: the trust after the step ends while it runs.
    timings = {"lease_ttl_seconds": 1.2, "lease_renew_seconds": 0.4, "housekeeping_seconds": 0.1}
    async with engine_for(db_url, registry, worker=False) as eng:
        await eng.start_worker(worker_id="tools", **timings)
        await eng.client.start_flow("Tools", "t")
        await wait_until("the tool to start", lambda: asyncio.sleep(0, runs))
        offset[0] = 20.0  # NTP steps the machine's clock forward
        assert (await eng.client.wait_for_flow("t", 30)).status == "completed"
        history = await eng.client.get_flow_history("t")
        assert [h.detail for h in history if h.event_type == "attempt_failed"] == []
        assert runs == [1]

