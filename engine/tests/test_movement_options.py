"""Per-movement Step options (ENGINE.md: StepOptions overridable per movement) and their bounded cache."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest

from dex_engine import (
    AttributeMap,
    Context,
    Flow,
    FlowDefinitionError,
    LoadOptions,
    MovementOptions,
    Registry,
    RetryPolicy,
    Step,
    StepDecision,
    StepDurability,
    StepOptions,
    _scheduling,
)
from dex_engine._decision import Movement
from dex_engine._limits import MAX_TIMER_SECONDS, SCHEDULING_OPTIONS_CACHE_ENTRIES
from dex_engine._options import LoadSpec, resolve_task_options
from dex_engine._scheduling import movement_record, task_options

from .conftest import engine_for

QUICK = RetryPolicy(max_attempts=3, initial_interval_seconds=0.01, max_interval_seconds=0.01)
ONE_ATTEMPT = RetryPolicy(max_attempts=1)

# What each movement into Work overrides, by the flow's input.
OVERRIDES: dict[str, MovementOptions | None] = {
    "none": None,
    "one_attempt": MovementOptions(execute_retry=ONE_ATTEMPT),
    "timeout": MovementOptions(execute_timeout_seconds=0.2, execute_retry=ONE_ATTEMPT),
    "heartbeat": MovementOptions(heartbeat_timeout_seconds=0.3, execute_retry=ONE_ATTEMPT),
    "rerouted": MovementOptions(execute_retry=ONE_ATTEMPT, failure_route="Elsewhere"),
}

Calls = AttributeMap("Calls", str)
attempts: dict[str, list[int]] = {}
recovered: dict[str, Any] = {}
rerouted: dict[str, Any] = {}


async def _pick(ctx: Context, mode: str) -> StepDecision:
    return StepDecision.go_to("Work", mode, OVERRIDES[mode])


async def _work(ctx: Context, mode: str) -> StepDecision:
    attempts.setdefault(ctx.flow_id, []).append(ctx.attempt)
    if mode in ("timeout", "heartbeat"):
        await asyncio.sleep(30)  # no heartbeat: only the movement's timeouts can end this attempt
    raise RuntimeError(f"attempt {ctx.attempt} failed")


async def _recover(ctx: Context, _: Any) -> StepDecision:
    assert ctx.recovery_error is not None
    recovered[ctx.flow_id] = ctx.recovery_error
    return StepDecision.graceful_complete()


async def _elsewhere(ctx: Context, _: Any) -> StepDecision:
    assert ctx.recovery_error is not None
    rerouted[ctx.flow_id] = ctx.recovery_error
    return StepDecision.graceful_complete()


FLOW = Flow(
    "Moves",
    [
        Step("Pick", _pick, input_type=str, options=StepOptions(load=LoadOptions.none())),
        # The Step's own options: three quick attempts, no timeout, then Recover.
        Step("Work", _work, input_type=str,
             options=StepOptions(load=LoadOptions.none(), execute_retry=QUICK, failure_route="Recover")),
        Step("Recover", _recover, options=StepOptions(load=LoadOptions.none())),
        Step("Elsewhere", _elsewhere, options=StepOptions(load=LoadOptions.none())),
    ],
    start_step="Pick",
    schema=[Calls],
)


@pytest.mark.parametrize("mode, expected_attempts, error_type", [
    ("none", [1, 2, 3], "RuntimeError"),
    ("one_attempt", [1], "RuntimeError"),
    ("timeout", [1], "MethodTimeout"),
    ("heartbeat", [1], "HeartbeatTimeout"),
])
async def test_a_movement_overrides_retry_and_timeouts(
    db_url: str, mode: str, expected_attempts: list[int], error_type: str,
) -> None:
    """The movement's retry policy and timeouts replace the Step's for that scheduled Step: one
    attempt instead of three, and an attempt the Step would let run for ever ends at the movement's
    method or heartbeat timeout. Breaks if resolve_task_options ignores any of these fields."""
    flow_id = f"moves-{mode}"
    attempts.pop(flow_id, None)
    async with engine_for(db_url, Registry([FLOW])) as eng:
        await eng.client.start_flow("Moves", flow_id, mode)
        info = await eng.client.wait_for_flow(flow_id, 20)
    assert info.status == "completed"
    assert attempts[flow_id] == expected_attempts
    error = recovered[flow_id]
    assert (error.step_type, error.attempts, error.error_type) == ("Work", len(expected_attempts), error_type)


async def test_a_movement_sends_its_step_to_the_failure_route_it_names(db_url: str) -> None:
    """A movement's failure_route replaces the Step's for that scheduled Step (a tool poll's route
    depends on the call's effect, docs/deviations.md): Work, whose own route is Recover, fails its
    one attempt and Elsewhere gets the recovery error. Catches the movement's route ignored."""
    flow_id = "moves-rerouted"
    recovered.pop(flow_id, None)
    rerouted.pop(flow_id, None)
    async with engine_for(db_url, Registry([FLOW])) as eng:
        await eng.client.start_flow("Moves", flow_id, "rerouted")
        info = await eng.client.wait_for_flow(flow_id, 20)
    assert info.status == "completed"
    assert flow_id not in recovered
    error = rerouted[flow_id]
    assert (error.step_type, error.attempts, error.error_type) == ("Work", 1, "RuntimeError")


def test_stored_options_take_the_overrides_and_keep_the_rest() -> None:
    """Only the fields a movement sets change; the failure route and load stay the Step's."""
    plain = movement_record(FLOW, Movement("Work", "none")).options
    moved = movement_record(FLOW, Movement("Work", "timeout", OVERRIDES["timeout"])).options
    assert plain.execute.retry == QUICK and plain.execute.timeout_ms is None
    assert moved.execute.retry == ONE_ATTEMPT and moved.execute.timeout_ms == 200
    assert moved.heartbeat_timeout_ms is None
    assert (moved.failure_route, moved.execute.load) == (plain.failure_route, plain.execute.load)
    assert moved.failure_route_options == plain.failure_route_options


@pytest.mark.parametrize("kwargs, message", [
    ({"execute_timeout_seconds": 0}, "execute_timeout_seconds must be a positive number of seconds, at most "
                                     f"{MAX_TIMER_SECONDS}, got 0"),
    ({"wait_for_timeout_seconds": float("inf")}, "wait_for_timeout_seconds must be a positive number"),
    ({"heartbeat_timeout_seconds": "30"}, "heartbeat_timeout_seconds must be a positive number of seconds, "
                                          f"at most {MAX_TIMER_SECONDS}, got '30'"),
    # Accepted once: the flow failed at run time, its previous Step's commit unable to store the
    # deadline (an int too large for SQLite, a bigint out of range on PostgreSQL).
    ({"execute_timeout_seconds": 1e300}, f"execute_timeout_seconds must be a positive number of seconds, at most "
                                         f"{MAX_TIMER_SECONDS}, got 1e+300"),
    ({"heartbeat_timeout_seconds": MAX_TIMER_SECONDS + 1}, "heartbeat_timeout_seconds must be a positive number"),
    ({"execute_retry": 3}, "execute_retry must be a RetryPolicy or None, got 3"),
    ({"wait_for_retry": {"max_attempts": 2}}, "wait_for_retry must be a RetryPolicy or None"),
])
def test_bad_movement_options_are_refused_by_name(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(FlowDefinitionError, match=re.escape(message)):
        MovementOptions(**kwargs)


def test_the_options_cache_stays_bounded_with_unique_movements() -> None:
    """Movements unique to one Step (an agent's tool Step loads its own call's record) must not grow
    the cache without bound; evicted entries resolve again to the same options."""
    first = MovementOptions(load=LoadOptions.only(Calls["call-0"]))
    kept = task_options(FLOW, "Work", first)
    for n in range(1, SCHEDULING_OPTIONS_CACHE_ENTRIES * 2):
        newest = MovementOptions(load=LoadOptions.only(Calls[f"call-{n}"]))
        resolved = task_options(FLOW, "Work", newest)
    assert len(_scheduling._cache) == SCHEDULING_OPTIONS_CACHE_ENTRIES  # full, and no fuller
    # The oldest entries went, not the newest: the movement just resolved is served from the cache.
    assert task_options(FLOW, "Work", newest) is resolved
    assert task_options(FLOW, "Work", first) == kept


def _cycle_flow() -> Flow:
    """Ping fails over to Pong and Pong back to Ping: a cycle of failure routes."""
    return Flow("Cycle", [
        Step("Ping", _recover, options=StepOptions(load=LoadOptions.none(), failure_route="Pong")),
        Step("Pong", _recover, options=StepOptions(load=LoadOptions.none(), failure_route="Ping")),
    ], start_step="Ping")


def test_a_cycle_of_failure_routes_resolves_alike_whatever_was_resolved_before() -> None:
    """A route's options nested in another Step's end where the cycle repeats (Ping's route Pong
    carries none of its own), even when Pong's options were resolved on their own first and cached
    with Ping's nested in them: the nested resolution must not take those."""
    fresh = task_options(_cycle_flow(), "Ping", None)
    flow = _cycle_flow()
    pong = task_options(flow, "Pong", None)
    assert pong.failure_route_options is not None and pong.failure_route_options.failure_route == "Pong"
    ping = task_options(flow, "Ping", None)
    assert ping == fresh
    assert ping.failure_route_options is not None
    assert (ping.failure_route, ping.failure_route_options.failure_route) == ("Pong", "Ping")
    assert ping.failure_route_options.failure_route_options is None


def test_a_step_routed_to_itself_takes_its_route_once() -> None:
    """A Step whose failure route is itself: its failure starts it again as its route, whose own
    failure fails the flow (a cycle of routes ends where it repeats). Catches a route to itself
    dropped as if the cycle had repeated already."""
    flow = Flow("Again", [
        Step("Again", _recover, options=StepOptions(load=LoadOptions.none(), failure_route="Again")),
    ], start_step="Again")
    options = task_options(flow, "Again", None)
    assert options.failure_route == "Again"
    assert options.failure_route_options is not None  # its failure takes the route...
    assert options.failure_route_options.failure_route_options is None  # ...and the route's fails the flow


async def _fails(ctx: Context, _: Any) -> StepDecision:
    raise RuntimeError(f"{ctx.step_execution_id} fails")


async def test_a_step_routed_to_itself_that_keeps_failing_fails_the_flow_after_its_route(db_url: str) -> None:
    """Again-1 fails and takes its route, Again-2, whose own failure then fails the flow: a cycle
    of failure routes ends where it repeats. Catches the route's failure taking the route again
    (with no options to schedule it by), which never ends the flow as failed."""
    flow = Flow("Again", [
        Step("Again", _fails, options=StepOptions(load=LoadOptions.none(), execute_retry=ONE_ATTEMPT,
                                                  failure_route="Again")),
    ], start_step="Again")
    async with engine_for(db_url, Registry([flow])) as eng:
        await eng.client.start_flow("Again", "again")
        info = await eng.client.wait_for_flow("again", 20)
    assert info.status == "failed"
    assert info.error is not None and info.error.startswith("Step Again-2 failed after 1 attempt(s)"), info.error


def test_a_repeated_movement_reuses_its_resolved_options() -> None:
    """Each Step's options are resolved once per Flow and movement options, not at every movement."""
    assert task_options(FLOW, "Work", None) is task_options(FLOW, "Work", None)
    overrides = OVERRIDES["timeout"]
    assert task_options(FLOW, "Work", overrides) is task_options(FLOW, "Work", overrides)


def test_a_cached_entry_of_another_flow_under_the_same_id_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cache is keyed by id(flow); a Flow that was collected can leave its id to a new one, whose
    Steps then must not get the old Flow's options."""
    other = Flow("Other", [Step("Work", _recover, options=StepOptions(execute_retry=ONE_ATTEMPT))], start_step="Work")
    stale = task_options(other, "Work", None)
    monkeypatch.setattr(_scheduling, "_cache", {(id(FLOW), "Work", None): (other, stale)})
    own = task_options(FLOW, "Work", None)
    assert own.execute.retry == QUICK and own.failure_route == "Recover"


def _resolved(step: StepOptions, movement: MovementOptions | None) -> dict[str, Any]:
    """What resolve_task_options made of every field a movement may override."""
    options = resolve_task_options(step, True, movement)
    assert options.wait_for is not None
    return {
        "execute_load": options.execute.load, "wait_for_load": options.wait_for.load,
        "durability": options.durability, "execute_retry": options.execute.retry,
        "wait_for_retry": options.wait_for.retry, "execute_timeout_ms": options.execute.timeout_ms,
        "wait_for_timeout_ms": options.wait_for.timeout_ms, "heartbeat_timeout_ms": options.heartbeat_timeout_ms,
    }


R1, R2, R3, R4 = (RetryPolicy(max_attempts=n) for n in (1, 2, 4, 5))
OWN = StepOptions(
    load=LoadOptions.none(), execute_load=LoadSpec("only", ("X",)), wait_for_load=LoadSpec("only", ("W",)),
    durability=StepDurability.ASYNC, execute_retry=R1, wait_for_retry=R2, execute_timeout_seconds=1.0,
    wait_for_timeout_seconds=2.0, heartbeat_timeout_seconds=3.0,
)
OWN_RESOLVED = {
    "execute_load": LoadSpec("only", ("X",)), "wait_for_load": LoadSpec("only", ("W",)),
    "durability": StepDurability.ASYNC, "execute_retry": R1, "wait_for_retry": R2,
    "execute_timeout_ms": 1_000, "wait_for_timeout_ms": 2_000, "heartbeat_timeout_ms": 3_000,
}
MOVED = MovementOptions(
    execute_load=LoadSpec("only", ("Y",)), wait_for_load=LoadSpec("only", ("V",)), durability=StepDurability.SYNC,
    execute_retry=R3, wait_for_retry=R4, execute_timeout_seconds=4.0, wait_for_timeout_seconds=5.0,
    heartbeat_timeout_seconds=6.0,
)
MOVED_RESOLVED = {
    "execute_load": LoadSpec("only", ("Y",)), "wait_for_load": LoadSpec("only", ("V",)),
    "durability": StepDurability.SYNC, "execute_retry": R3, "wait_for_retry": R4,
    "execute_timeout_ms": 4_000, "wait_for_timeout_ms": 5_000, "heartbeat_timeout_ms": 6_000,
}


def test_each_option_a_movement_sets_overrides_the_steps_and_each_it_leaves_keeps_it() -> None:
    """Field by field: the Step's own value, unless the movement sets one; the movement's `load`
    sets both methods' loads, and its execute_load or wait_for_load then override that one method's."""
    assert _resolved(OWN, None) == OWN_RESOLVED
    assert _resolved(OWN, MovementOptions()) == OWN_RESOLVED
    assert _resolved(OWN, MOVED) == MOVED_RESOLVED
    assert _resolved(StepOptions(), MOVED) == MOVED_RESOLVED
    both = _resolved(OWN, MovementOptions(load=LoadSpec("only", ("B",)), wait_for_load=LoadSpec("only", ("V",))))
    assert (both["execute_load"], both["wait_for_load"]) == (LoadSpec("only", ("B",)), LoadSpec("only", ("V",)))
    moved_load = _resolved(OWN, MovementOptions(load=LoadSpec("only", ("B",))))
    assert (moved_load["execute_load"], moved_load["wait_for_load"]) == (LoadSpec("only", ("B",)),) * 2
    plain = _resolved(StepOptions(load=LoadSpec("only", ("L",))), None)
    assert (plain["execute_load"], plain["wait_for_load"]) == (LoadSpec("only", ("L",)), LoadSpec("only", ("L",)))


def test_a_timeout_under_a_millisecond_is_stored_as_one() -> None:
    """Stored timeouts are whole milliseconds; a positive one never rounds down to 0 (no timeout)."""
    options = resolve_task_options(StepOptions(execute_timeout_seconds=0.0004), False, None)
    assert options.execute.timeout_ms == 1


@pytest.mark.parametrize(("spec", "other", "within"), [
    (LoadSpec("none"), LoadSpec("none"), True),
    (LoadSpec("all"), LoadSpec("all"), True),
    (LoadSpec("all"), LoadSpec("only", ("A",)), False),
    (LoadSpec("only", ("A",)), LoadSpec("none"), False),
    (LoadSpec("only", ("A",)), LoadSpec("only", ("A", "B")), True),
    (LoadSpec("only", ("A", "C")), LoadSpec("only", ("A", "B")), False),
    (LoadSpec("only", (), (("A", "k"),)), LoadSpec("only", ("A",)), True),
    (LoadSpec("only", (), (("A", "k"),)), LoadSpec("only", (), (("A", "k"), ("B", "j"))), True),
    (LoadSpec("only", (), (("A", "k"),)), LoadSpec("only", (), (("A", "j"),)), False),
    (LoadSpec("only", ("A",), (("B", "k"),)), LoadSpec("only", ("A",)), False),
    (LoadSpec("only", ("A",)), LoadSpec("only", (), (("A", "k"),)), False),
])
def test_loads_within(spec: LoadSpec, other: LoadSpec, within: bool) -> None:
    """Whether a method loading `spec` sees nothing `other` does not load (a WaitFor evaluated
    early, on its Step's rows, must not read more than they hold)."""
    assert spec.loads_within(other) is within
