"""Step options, load options, durability and flow configuration."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal, TypeGuard

import msgspec

from ._errors import FlowDefinitionError, InvalidValueError, shown
from ._limits import MAX_TIMER_SECONDS
from ._retry import RetryPolicy
from ._schema import AttributeMap, AttributeRef


class StepDurability(StrEnum):
    """SYNC: a Step's commit is as durable as the database setting (FULL: survives power loss).
    ASYNC: the commit skips the fsync (synchronous=NORMAL); it survives any process crash but the
    last commits may be lost on power loss or an OS crash, and such a Step then runs again."""

    SYNC = "SYNC"
    ASYNC = "ASYNC"


def _as_step_durability(value: object) -> StepDurability | None:
    """`value` as the StepDurability it names, None when it names none. A member's text ("SYNC", as
    it is stored) names that member: callers passed the text before it was checked, and it worked."""
    if isinstance(value, StepDurability):
        return value
    if isinstance(value, str) and value in tuple(StepDurability):
        return StepDurability(value)
    return None


class LoadSpec(msgspec.Struct, frozen=True, omit_defaults=True):
    """Stored load options: which attributes a method's context holds."""

    mode: Literal["all", "none", "only"] = "all"
    names: tuple[str, ...] = ()  # whole attributes or whole maps
    instances: tuple[tuple[str, str], ...] = ()  # (map name, key)

    def loads(self, name: str, key: str) -> bool:
        """Whether attribute `name` (map instance `key`; "" for a plain attribute) is loaded."""
        if self.mode == "all":
            return True
        if self.mode == "none":
            return False
        return name in self.names or (name, key) in self.instances

    def loads_within(self, other: LoadSpec) -> bool:
        """Whether everything this spec loads is also loaded by `other`."""
        if self.mode == "none" or other.mode == "all":
            return True
        if self.mode == "all" or other.mode == "none":
            return False
        return all(n in other.names for n in self.names) and all(other.loads(n, k) for n, k in self.instances)


class LoadOptions:
    """Which attributes a Step method or RPC loads into its context."""

    @staticmethod
    def all() -> LoadSpec:
        return LoadSpec("all")

    @staticmethod
    def none() -> LoadSpec:
        return LoadSpec("none")

    @staticmethod
    def only(*items: AttributeRef[Any] | AttributeMap[Any]) -> LoadSpec:
        names: list[str] = []
        instances: list[tuple[str, str]] = []
        for item in items:
            if isinstance(item, AttributeMap):
                names.append(item.name)
            elif isinstance(item, AttributeRef):
                if item.key:
                    instances.append((item.name, item.key))
                else:
                    names.append(item.name)
            else:
                raise FlowDefinitionError(
                    f"load option {shown(item, None)} is not an Attribute, AttributeMap or map instance")
        return LoadSpec("only", tuple(names), tuple(instances))


LockItem = AttributeRef[Any] | AttributeMap[Any]


def lock_name(item: LockItem) -> str:
    """Locks are named after attributes; a map instance locks only that key."""
    if isinstance(item, AttributeMap):
        return item.name
    if isinstance(item, AttributeRef):
        return item.label
    raise FlowDefinitionError(f"lock {shown(item, None)} is not an Attribute, AttributeMap or map instance")


def lock_items(label: str, locks: object) -> tuple[LockItem, ...]:
    """`locks` (a lock set as given: any iterable of lock items) as a tuple, or FlowDefinitionError
    naming `label` and the value: iterated unchecked, one item given alone failed with a bare
    TypeError, or a map with a key error for key 0."""
    expected = f"{label} must be a collection of Attributes, AttributeMaps or map instances"
    if isinstance(locks, AttributeRef | AttributeMap):
        item = shown(locks, None)
        raise FlowDefinitionError(f"{expected}, got the single item {item}; give it as a tuple: ({item},)")
    if not isinstance(locks, Iterable) or isinstance(locks, str):
        raise FlowDefinitionError(f"{expected}, got {shown(locks, None)}")
    items = tuple(locks)
    for item in items:
        if not isinstance(item, AttributeRef | AttributeMap):
            raise FlowDefinitionError(
                f"{label} holds {shown(item, None)}, which is not an Attribute, AttributeMap or map instance")
    return items


def check_load(label: str, load: object, optional: bool) -> None:
    """Raise FlowDefinitionError naming `label` unless `load` is a LoadSpec (or None, if `optional`):
    anything else was accepted here and failed later, at start_flow or at a commit."""
    if isinstance(load, LoadSpec) or (optional and load is None):
        return
    choices = "LoadOptions.all(), LoadOptions.none() or LoadOptions.only(...)" + (" or None" if optional else "")
    raise FlowDefinitionError(f"{label} must be {choices}, got {shown(load, None)}")


@dataclass(frozen=True)
class StepOptions:
    """Per-Step options. Timeouts are seconds; None means no limit."""

    execute_retry: RetryPolicy = field(default_factory=RetryPolicy)
    wait_for_retry: RetryPolicy = field(default_factory=RetryPolicy)
    execute_timeout_seconds: float | None = None
    wait_for_timeout_seconds: float | None = None
    heartbeat_timeout_seconds: float | None = None
    failure_route: str | None = None
    durability: StepDurability | None = None  # None: the flow config's default
    execute_locks: tuple[LockItem, ...] = ()
    wait_for_locks: tuple[LockItem, ...] = ()
    load: LoadSpec = field(default_factory=LoadOptions.all)
    execute_load: LoadSpec | None = None  # overrides `load` for Execute only
    wait_for_load: LoadSpec | None = None  # overrides `load` for WaitFor only

    def __post_init__(self) -> None:
        _check_retries(self, optional=False)
        _check_loads(self, optional=False)
        # Normalized to tuples: a list given is taken, and the options stay hashable.
        object.__setattr__(self, "execute_locks", lock_items("execute_locks", self.execute_locks))
        object.__setattr__(self, "wait_for_locks", lock_items("wait_for_locks", self.wait_for_locks))
        _check_timeouts(self)
        _check_durability(self)


@dataclass(frozen=True)
class MovementOptions:
    """Overrides for one movement into a Step; unset (None) fields keep the Step's options.

    The retry policies and timeouts are stored with the scheduled Step, so every attempt, on any
    worker, runs with them. Overrides of a WaitFor are ignored for a Step without one.
    """

    load: LoadSpec | None = None
    execute_load: LoadSpec | None = None
    wait_for_load: LoadSpec | None = None
    durability: StepDurability | None = None
    # Another of the flow's Steps as this movement's failure route (e.g. chosen by the call's effect).
    failure_route: str | None = None
    execute_retry: RetryPolicy | None = None
    wait_for_retry: RetryPolicy | None = None
    execute_timeout_seconds: float | None = None
    wait_for_timeout_seconds: float | None = None
    heartbeat_timeout_seconds: float | None = None

    def __post_init__(self) -> None:
        _check_retries(self, optional=True)
        _check_loads(self, optional=True)
        _check_timeouts(self)
        _check_durability(self)
        route: object = self.failure_route  # a Step's is checked by its Flow, which can name the Step
        if route is not None and not isinstance(route, str):
            # Looked up by name when the movement is scheduled, where a list raised "unhashable type".
            raise FlowDefinitionError(f"MovementOptions failure_route must be a Step type (str) or None, "
                                      f"got {type(route).__name__}: {shown(route)}")


def is_number(value: object) -> TypeGuard[int | float]:
    """A real number given where one is expected: an int or a float, not a bool (which is an int)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_retries(options: StepOptions | MovementOptions, optional: bool) -> None:
    # Checked when built: a retry that is not a RetryPolicy was stored with the task, and the first
    # failed attempt then could not be ended, so it was handed back and run again without end.
    for label in ("execute_retry", "wait_for_retry"):
        retry: object = getattr(options, label)
        if isinstance(retry, RetryPolicy) or (optional and retry is None):
            continue
        expected = "a RetryPolicy or None" if optional else "a RetryPolicy"
        raise FlowDefinitionError(
            f"{label} must be {expected}, got {shown(retry, None)}; for one attempt, no retries, give "
            "RetryPolicy(max_attempts=1)")


def _check_loads(options: StepOptions | MovementOptions, optional: bool) -> None:
    check_load("load", options.load, optional)
    check_load("execute_load", options.execute_load, optional=True)
    check_load("wait_for_load", options.wait_for_load, optional=True)


def _check_timeouts(options: StepOptions | MovementOptions) -> None:
    for label, value in (
        ("execute_timeout_seconds", options.execute_timeout_seconds),
        ("wait_for_timeout_seconds", options.wait_for_timeout_seconds),
        ("heartbeat_timeout_seconds", options.heartbeat_timeout_seconds),
    ):
        if value is None:
            continue
        if not (is_number(value) and 0 < value <= MAX_TIMER_SECONDS):
            # Past the cap, a deadline (ms) would not fit the database's 64-bit integers either.
            raise FlowDefinitionError(
                f"{label} must be a positive number of seconds, at most {MAX_TIMER_SECONDS}, got {shown(value, None)}")


def _check_durability(options: StepOptions | MovementOptions) -> None:
    # Stored with each task it resolves to: a value no reader can decode would stall the flow.
    if options.durability is None:
        return
    durability = _as_step_durability(options.durability)
    if durability is None:
        raise FlowDefinitionError(
            "durability must be StepDurability.SYNC, StepDurability.ASYNC or None (the flow config's "
            f"default), got {shown(options.durability, None)}")
    if durability is not options.durability:
        object.__setattr__(options, "durability", durability)  # the member, not its text


class FlowConfig(msgspec.Struct, frozen=True, omit_defaults=True):
    """Per-flow configuration: set at start_flow, changed with update_flow_config (later Steps only)."""

    active_step_search: bool = True
    default_step_durability: StepDurability = StepDurability.SYNC

    def __post_init__(self) -> None:
        # Checked when built: a config no reader can decode, once stored, stops its flow for good.
        # msgspec runs this on every decode too, where both values are right: two type tests.
        search: object = self.active_step_search
        if not isinstance(search, bool):
            raise InvalidValueError(f"FlowConfig active_step_search must be a bool, got {shown(search, None)}")
        durability = _as_step_durability(self.default_step_durability)
        if durability is None:
            raise InvalidValueError(
                "FlowConfig default_step_durability must be StepDurability.SYNC or StepDurability.ASYNC, "
                f"got {shown(self.default_step_durability, None)}")
        if durability is not self.default_step_durability:
            msgspec.structs.force_setattr(self, "default_step_durability", durability)  # the member, not its text


class MethodOptions(msgspec.Struct, frozen=True, omit_defaults=True):
    """Stored options of one method (WaitFor or Execute) of a scheduled Step."""

    retry: RetryPolicy
    timeout_ms: int | None = None
    locks: tuple[str, ...] = ()
    load: LoadSpec = LoadSpec("all")


class TaskOptions(msgspec.Struct, frozen=True, omit_defaults=True):
    """A scheduled Step's resolved options, fixed by the worker that scheduled it."""

    has_wait_for: bool
    execute: MethodOptions
    wait_for: MethodOptions | None = None
    heartbeat_timeout_ms: int | None = None
    failure_route: str | None = None
    # The failure route's own options, resolved when this Step is scheduled so that any process
    # (housekeeping included) can start the route without the Registry.
    failure_route_options: TaskOptions | None = None
    # None until the task is created: then the flow config's default at that moment (E16).
    durability: StepDurability | None = None


def _ms(seconds: float | None) -> int | None:
    return None if seconds is None else max(1, int(seconds * 1000))


def resolve_task_options(
    options: StepOptions, has_wait_for: bool, movement: MovementOptions | None
) -> TaskOptions:
    load = options.load
    execute_load = options.execute_load or load
    wait_for_load = options.wait_for_load or load
    durability = options.durability
    execute_retry, wait_for_retry = options.execute_retry, options.wait_for_retry
    execute_timeout, wait_for_timeout = options.execute_timeout_seconds, options.wait_for_timeout_seconds
    heartbeat_timeout = options.heartbeat_timeout_seconds
    if movement is not None:
        if movement.load is not None:
            execute_load = wait_for_load = movement.load
        execute_load = movement.execute_load or execute_load
        wait_for_load = movement.wait_for_load or wait_for_load
        durability = movement.durability or durability
        execute_retry = movement.execute_retry or execute_retry
        wait_for_retry = movement.wait_for_retry or wait_for_retry
        execute_timeout = movement.execute_timeout_seconds or execute_timeout
        wait_for_timeout = movement.wait_for_timeout_seconds or wait_for_timeout
        heartbeat_timeout = movement.heartbeat_timeout_seconds or heartbeat_timeout
    return TaskOptions(
        has_wait_for=has_wait_for,
        execute=MethodOptions(
            retry=execute_retry,
            timeout_ms=_ms(execute_timeout),
            locks=tuple(lock_name(x) for x in options.execute_locks),
            load=execute_load,
        ),
        wait_for=MethodOptions(
            retry=wait_for_retry,
            timeout_ms=_ms(wait_for_timeout),
            locks=tuple(lock_name(x) for x in options.wait_for_locks),
            load=wait_for_load,
        ) if has_wait_for else None,
        heartbeat_timeout_ms=_ms(heartbeat_timeout),
        failure_route=options.failure_route,
        durability=durability,
    )
