"""Turning authored movements into stored ones: target Step, encoded input, resolved options."""

from __future__ import annotations

import threading
from typing import Any

from ._codec import encode_value
from ._decision import Movement
from ._flow import Flow
from ._limits import SCHEDULING_OPTIONS_CACHE_ENTRIES
from ._options import MovementOptions, TaskOptions, resolve_task_options
from ._records import MovementRecord

# Oldest entries go first. Locked: RPC clients schedule movements on their own threads.
_cache: dict[tuple[int, str, MovementOptions | None], tuple[Flow, TaskOptions]] = {}
_cache_lock = threading.Lock()


def task_options(
    flow: Flow, step_type: str, movement: MovementOptions | None, _seen: frozenset[str] = frozenset(),
) -> TaskOptions:
    """The stored options of a movement into `step_type` (cached: definitions are immutable)."""
    key = (id(flow), step_type, movement)
    hit = _cache.get(key) if not _seen else None
    if hit is not None and hit[0] is flow:
        return hit[1]
    options = _resolve(flow, step_type, movement, _seen)
    if not _seen:
        with _cache_lock:
            _cache[key] = (flow, options)
            while len(_cache) > SCHEDULING_OPTIONS_CACHE_ENTRIES:
                del _cache[next(iter(_cache))]
    return options


def _resolve(flow: Flow, step_type: str, movement: MovementOptions | None, _seen: frozenset[str]) -> TaskOptions:
    step = flow.step(step_type)
    options = resolve_task_options(step.options, step.wait_for is not None, movement)
    route = step.options.failure_route
    if movement is not None and movement.failure_route is not None:
        route = flow.step(movement.failure_route).step_type  # UndeclaredNameError for an unknown Step
    if route is not None and route not in _seen:
        # A cycle of failure routes ends where it repeats: that route's own failure fails the flow.
        nested = task_options(flow, route, None, _seen | {step_type})
        options = TaskOptions(
            has_wait_for=options.has_wait_for, execute=options.execute, wait_for=options.wait_for,
            heartbeat_timeout_ms=options.heartbeat_timeout_ms, failure_route=route,
            failure_route_options=nested, durability=options.durability,
        )
    return options


def movement_record(flow: Flow, movement: Movement) -> MovementRecord:
    step = flow.step(movement.step_type)
    data = encode_value(f"input of Step {step.step_type}", step.input_type, movement.input)
    return MovementRecord(step.step_type, data, task_options(flow, step.step_type, movement.options))


def start_record(flow: Flow, input: Any) -> MovementRecord | None:
    if flow.start_step_type is None:
        return None
    return movement_record(flow, Movement(flow.start_step_type, input))
