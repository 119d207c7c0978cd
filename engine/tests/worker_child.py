"""A worker child process for the multi-process tests: `python -m engine.tests.worker_child`.

It builds the test Flows below and runs an AsyncWorker on DEX_TEST_DB_URL until SIGTERM (then it
drains and exits 0). Crash gates come from DEX_ENGINE_CRASH_AT / DEX_ENGINE_GATE_LOG, read by the
engine itself. Every handler records what it does in the invocation log of DEX_TEST_STATE_DIR; a
handler of a Step type listed in DEX_TEST_HOLD waits at a FileGate named
`<flow_id>.<step_execution_id>.<attempt>` after its first heartbeat (only the Zombie flow's Step holds),
blocking its event loop, or with DEX_TEST_HOLD_YIELDS=1 awaiting the gate while its worker runs on.
The worker's own log (INFO for dex_engine.worker: results it discards) goes to stderr.

The test process imports this module for REGISTRY (the client needs the same Flows); the
handlers only ever run in a child.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dex_engine import (
    AsyncWorker,
    Attribute,
    Channel,
    Context,
    Flow,
    Registry,
    RetryPolicy,
    StaleAttemptError,
    Step,
    StepDecision,
    StepOptions,
    Stream,
    Wait,
    WorkerOptions,
)

from .proc_harness import (
    ENV_DB_URL,
    ENV_HOLD,
    ENV_HOLD_YIELDS,
    ENV_HOUSEKEEPING,
    ENV_LEASE_RENEW,
    ENV_LEASE_TTL,
    ENV_LOG_FSYNC,
    ENV_MAX_TASKS,
    ENV_REGISTRY,
    ENV_START_GATE,
    ENV_STATE_DIR,
    INVOCATIONS_FILE,
    FileGate,
    InvocationLog,
)

# Fast retries: the tests wait for lease expiry, not for backoff.
FAST_RETRY = RetryPolicy(max_attempts=3, initial_interval_seconds=0.05, max_interval_seconds=0.05)
# The Step whose every attempt fails: two attempts, then its failure route.
SHORT_RETRY = RetryPolicy(max_attempts=2, initial_interval_seconds=0.05, max_interval_seconds=0.05)
COUNTER_STEPS = 10


@dataclass
class _Child:
    state_dir: Path
    log: InvocationLog
    hold: frozenset[str]
    hold_yields: bool


_CHILD: list[_Child] = []  # set by main(): handlers run only in a worker child


def _child() -> _Child:
    if not _CHILD:
        raise RuntimeError("test Step handlers run only in a worker child (python -m engine.tests.worker_child)")
    return _CHILD[0]


def _record(ctx: Context, phase: str, detail: str = "") -> None:
    _child().log.record(ctx.flow_id, ctx.step_execution_id, ctx.method, ctx.attempt, phase, detail)


async def _start(ctx: Context) -> None:
    """Heartbeat (the attempt now counts as started, E3/E10), then log the start."""
    await ctx.heartbeat()
    _record(ctx, "start")


async def _hold(ctx: Context) -> None:
    """If this child holds the Step type, wait at the FileGate `<flow_id>.<step_execution_id>.<attempt>`.

    By default the wait does not yield to the event loop: when the process resumes after its attempt
    was taken over, its worker has had no chance to notice, so the handler's late writes go out as if
    nothing happened and the store's fencing (E2) is what must refuse them. With hold_yields the
    worker keeps renewing its lease meanwhile: only losing the database (a cut network) loses it.
    """
    child = _child()
    if ctx.step_type in child.hold:
        gate = FileGate(child.state_dir, f"{ctx.flow_id}.{ctx.step_execution_id}.{ctx.attempt}")
        gate.mark_reached()
        if child.hold_yields:
            await gate.wait_released()
        else:
            gate.wait_released_blocking()


# Chain: A -> B -> C, each Step appends "<step execution>#<attempt>" to Trail ---------------------
# B also has a WaitFor (it heartbeats, then skips the wait), so B commits twice: its WaitFor, then its Execute.

Trail: Attribute[list[str]] = Attribute("Trail", list[str])


async def _skip_wait(ctx: Context, _: None) -> Wait:
    await _start(ctx)
    _record(ctx, "end")
    return Wait.skip_immediately()


def _chain_step(step_type: str, next_step: str | None, *, with_wait: bool = False) -> Step[None]:
    async def execute(ctx: Context, _: None) -> StepDecision:
        await _start(ctx)
        trail = [*(ctx.get(Trail) or []), f"{ctx.step_execution_id}#{ctx.attempt}"]
        ctx.set(Trail, trail)
        _record(ctx, "end")
        if next_step is None:
            return StepDecision.graceful_complete(trail)
        return StepDecision.go_to(next_step, None)

    return Step(step_type, execute, input_type=type(None), wait_for=_skip_wait if with_wait else None,
                options=StepOptions(execute_retry=FAST_RETRY, wait_for_retry=FAST_RETRY))


CHAIN = Flow("Chain", [_chain_step("A", "B"), _chain_step("B", "C", with_wait=True), _chain_step("C", None)],
             start_step="A", schema=[Trail])


# Fold: Arm -> (Waiter, Sender); Waiter's pure Execute runs inside Sender's commit ---------------
# Sender heartbeats, appends to Trail and publishes FoldGo; Waiter waits for it (no heartbeat, so
# its WaitFor folds into Arm's commit) and logs "end" with the task it ran in. In one worker the
# store.inside_commit gate is crossed by Arm's commit (1), then by Sender's with Waiter in it (2).

FoldGo: Channel[str] = Channel("FoldGo", str)


def _trail_step(step_type: str, decide: Any) -> Step[None]:
    async def execute(ctx: Context, _: None) -> StepDecision:
        await _start(ctx)
        trail = [*(ctx.get(Trail) or []), f"{ctx.step_execution_id}#{ctx.attempt}"]
        ctx.set(Trail, trail)
        _record(ctx, "end")
        decision: StepDecision = decide(ctx)
        return decision

    return Step(step_type, execute, input_type=type(None), options=StepOptions(execute_retry=FAST_RETRY))


def _send_go(ctx: Context) -> StepDecision:
    ctx.publish(FoldGo, "go")
    return StepDecision.dead_end()


async def _await_go(ctx: Context, _: None) -> Wait:
    return Wait.until(FoldGo.for_one())


async def _pure_waiter(ctx: Context, _: None) -> StepDecision:
    task = asyncio.current_task()
    _record(ctx, "end", "" if task is None else task.get_name())
    trail = [*(ctx.get(Trail) or []), f"{ctx.step_execution_id}#{ctx.attempt}"]
    ctx.set(Trail, trail)
    return StepDecision.graceful_complete(trail)


FOLD = Flow("Fold", [
    _trail_step("Arm", lambda _ctx: StepDecision.go_to_many(("Waiter", None), ("Sender", None))),
    _trail_step("Sender", _send_go),
    Step("Waiter", _pure_waiter, input_type=type(None), wait_for=_await_go, pure_execute=True,
         options=StepOptions(execute_retry=FAST_RETRY, wait_for_retry=FAST_RETRY)),
], start_step="Arm", schema=[Trail, FoldGo])


# Park: Arm -> Tool; Tool's code before its first heartbeat runs inside Arm's commit --------------
# Tool (Step.pure_until_heartbeat) logs "pre" with the task it runs in, heartbeats (recorded by Arm's
# commit when folded), logs "start", may hold, then appends to Trail. In one worker the
# store.inside_commit gate is crossed first by Arm's commit, with Tool's heartbeat in it.


async def _parked_tool(ctx: Context, _: None) -> StepDecision:
    task = asyncio.current_task()
    _record(ctx, "pre", "" if task is None else task.get_name())
    await _start(ctx)
    await _hold(ctx)
    trail = [*(ctx.get(Trail) or []), f"{ctx.step_execution_id}#{ctx.attempt}"]
    ctx.set(Trail, trail)
    _record(ctx, "end")
    return StepDecision.graceful_complete(trail)


PARK = Flow("Park", [
    _trail_step("Arm", lambda _ctx: StepDecision.go_to("Tool")),
    Step("Tool", _parked_tool, input_type=type(None), pure_until_heartbeat=True,
         options=StepOptions(execute_retry=FAST_RETRY)),
], start_step="Arm", schema=[Trail])


# Risky: a Step whose attempts all fail, and its failure route --------------------------------


async def risky(ctx: Context, mode: str) -> StepDecision:
    if mode == "raise":
        # Fails before any heartbeat: no attempt ever starts (NOT_STARTED).
        _record(ctx, "raise")
        raise RuntimeError(f"boom on attempt {ctx.attempt}")
    await _start(ctx)
    _record(ctx, "end")
    return StepDecision.graceful_complete("Risky committed")  # the crash test kills the worker before this commits


async def rescue(ctx: Context, mode: str) -> StepDecision:
    await _start(ctx)
    err = ctx.recovery_error
    _record(ctx, "end")
    if err is None:
        return StepDecision.graceful_complete(None)
    return StepDecision.graceful_complete({
        "mode": mode, "step_execution_id": err.step_execution_id, "method": err.method, "attempts": err.attempts,
        "attempt_progress": str(err.attempt_progress), "error_type": err.error_type, "detail": err.detail,
    })


RISKY = Flow(
    "Risky",
    [
        Step("Risky", risky, input_type=str,
             options=StepOptions(execute_retry=SHORT_RETRY, failure_route="Rescue")),
        Step("Rescue", rescue, input_type=str, options=StepOptions(execute_retry=FAST_RETRY)),
    ],
    start_step="Risky",
)


# Zombie: one slow Step that, after its hold, makes late writes --------------------------------

Owner: Attribute[dict[str, int]] = Attribute("Owner", dict[str, int])
Progress: Stream[str] = Stream("Progress", str)


async def slow(ctx: Context, mode: str) -> StepDecision:
    """mode "commit": return at once after the hold; mode "writes": first a stream event and a heartbeat."""
    await _start(ctx)
    await _hold(ctx)  # a held worker is frozen (SIGSTOP) or cut off in here and resumes as a zombie
    me = {"pid": os.getpid(), "attempt": ctx.attempt}
    if mode == "writes":
        ctx.write_event(Progress, f"{ctx.step_execution_id}#{ctx.attempt} pid {me['pid']}")
        try:
            await ctx.heartbeat("late")
            _record(ctx, "heartbeat_ok")
        except StaleAttemptError:
            _record(ctx, "heartbeat_rejected", "StaleAttemptError")
        except asyncio.CancelledError:
            # The worker learned (e.g. from the refused event) that the attempt is gone; a zombie
            # ignores that and still returns its result below.
            _record(ctx, "heartbeat_rejected", "cancelled")
    ctx.set(Owner, me)
    _record(ctx, "end")
    return StepDecision.graceful_complete(me)


ZOMBIE = Flow(
    "Zombie",
    [Step("Slow", slow, input_type=str, options=StepOptions(execute_retry=FAST_RETRY))],
    start_step="Slow",
    schema=[Owner, Progress],
)


# Counter: Inc-1 .. Inc-10, each adds one to Count --------------------------------------------

Count: Attribute[int] = Attribute("Count", int)


async def inc(ctx: Context, n: int) -> StepDecision:
    count = (ctx.get(Count) or 0) + 1
    ctx.set(Count, count)
    _record(ctx, "end")
    if n < COUNTER_STEPS:
        return StepDecision.go_to("Inc", n + 1)
    return StepDecision.graceful_complete(count)


COUNTER = Flow("Counter", [Step("Inc", inc, input_type=int)], start_step="Inc", schema=[Count])


REGISTRY = Registry([CHAIN, RISKY, ZOMBIE, COUNTER, FOLD, PARK])


# The child process ---------------------------------------------------------------------------


def _options() -> WorkerOptions:
    env = os.environ
    extra: dict[str, Any] = {}
    if env.get(ENV_MAX_TASKS):
        extra["max_concurrent_tasks"] = int(env[ENV_MAX_TASKS])
    return WorkerOptions(
        database_url=env[ENV_DB_URL],
        lease_ttl_seconds=float(env[ENV_LEASE_TTL]),
        lease_renew_seconds=float(env[ENV_LEASE_RENEW]),
        housekeeping_seconds=float(env[ENV_HOUSEKEEPING]),
        poll_seconds=0.01,
        shutdown_grace_seconds=5.0,
        **extra,
    )


def _registry() -> Registry:
    """REGISTRY, or the Registry named by DEX_TEST_REGISTRY ("<module>:<name>", e.g. another test file's Flows)."""
    spec = os.environ.get(ENV_REGISTRY)
    if not spec:
        return REGISTRY
    module, _, name = spec.partition(":")
    registry: Registry = getattr(importlib.import_module(module), name)
    return registry


async def _serve() -> None:
    worker = AsyncWorker(_registry(), _options())
    stopping: list[asyncio.Task[None]] = []
    asyncio.get_running_loop().add_signal_handler(
        signal.SIGTERM, lambda: stopping.append(asyncio.create_task(worker.stop()))
    )
    await worker.run()


def main() -> int:
    state_dir = Path(os.environ[ENV_STATE_DIR])
    _CHILD.append(_Child(
        state_dir=state_dir,
        log=InvocationLog(state_dir / INVOCATIONS_FILE, fsync=os.environ.get(ENV_LOG_FSYNC, "1") != "0"),
        hold=frozenset(filter(None, os.environ.get(ENV_HOLD, "").split(","))),
        hold_yields=os.environ.get(ENV_HOLD_YIELDS, "0") == "1",
    ))
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")
    logging.getLogger("dex_engine.worker").setLevel(logging.INFO)
    if os.environ.get(ENV_START_GATE):
        # Standby: imports are done (the slow part of starting); wait for the test's go.
        release = FileGate(state_dir, os.environ[ENV_START_GATE]).release_path
        while not release.exists():
            time.sleep(0.005)
    asyncio.run(_serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
