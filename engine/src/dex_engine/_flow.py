"""Flow definitions: Steps, RPCs, the Flow itself, and the Registry that validates them."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from ._codec import type_problem
from ._decision import RPCResult, StepDecision
from ._errors import (
    FlowDefinitionError,
    InvalidIdError,
    InvalidValueError,
    RpcNotFoundError,
    UndeclaredNameError,
    UnknownFlowTypeError,
    shown,
)
from ._ids import check_id
from ._options import LoadOptions, LoadSpec, LockItem, StepOptions, check_load, lock_items, lock_name
from ._schema import (
    Attribute,
    AttributeMap,
    AttributeRef,
    Channel,
    ChannelMap,
    ChannelRef,
    SchemaItem,
    Stream,
)
from ._wait import Wait

if TYPE_CHECKING:
    from ._context import Context, RpcContext

InputT = TypeVar("InputT")
# What a Flow's schema holds: an item given alone, outside a list, is refused naming it.
_SCHEMA_ITEMS = (Attribute, AttributeMap, Channel, ChannelMap, Stream)

ExecuteFn = Callable[["Context", Any], Awaitable[StepDecision]]
WaitForFn = Callable[["Context", Any], Awaitable[Wait]]
RpcFn = Callable[["RpcContext", Any], Awaitable[Any]]


class Step(Generic[InputT]):
    """A Step: an optional WaitFor, a required Execute, and options.

    Both handlers are `async def handler(ctx, input)`. WaitFor returns a Wait; Execute returns a
    StepDecision. `input_type` is the declared type of the Step's input (JSON via msgspec).

    A WaitFor decides a wait from its input and loaded attributes and has no side effects: on a
    store that supports it (SQLite), the worker evaluates the WaitFor of a Step that an Execute
    starts before that Execute commits, whenever that Execute loaded everything the WaitFor loads
    and the WaitFor takes no locks, and the commit registers the wait (attempt 1) when those
    attributes are unchanged by then; otherwise, or when the WaitFor needs its execution ID, a
    heartbeat or an event, raises or writes, it runs as usual after the commit.

    With `pure_execute`, the Execute promises to only read its context and return a decision: no
    I/O, no heartbeat or best-effort event, nothing awaited that suspends. On a store that supports
    it (SQLite), a worker whose own commit makes such a Step ready on its event loop then runs the
    Execute inside that commit's transaction, as attempt 1 with the same snapshot, writes, history
    and locks as a separate attempt would have: one transaction and fsync fewer. An Execute that
    suspends, raises, or cannot commit there runs as usual after the commit.

    With `pure_until_heartbeat`, the Execute promises the same of its code before its first
    heartbeat, except that it may write best-effort events there. Such a handler is stepped in the
    same way; when it stops at that heartbeat, the commit that claimed it records the heartbeat and
    the events before it, and the handler goes on from the heartbeat once that commit is durable, as
    the same attempt: one transaction and fsync fewer before, say, a tool call that must not run
    until its attempt counts as started. Context variables set before the heartbeat stay set after
    it; nothing bound to the current task (asyncio.timeout, a TaskGroup) may span the heartbeat.
    """

    def __init__(
        self,
        step_type: str,
        execute: ExecuteFn,
        *,
        input_type: Any = Any,
        wait_for: WaitForFn | None = None,
        options: StepOptions | None = None,
        pure_execute: bool = False,
        pure_until_heartbeat: bool = False,
    ) -> None:
        self.step_type = check_id("step type", step_type)
        self.execute = execute
        self.wait_for = wait_for
        self.input_type = input_type
        self.options = options or StepOptions()
        self.pure_execute = pure_execute
        self.pure_until_heartbeat = pure_until_heartbeat

    def __repr__(self) -> str:
        return f"Step({self.step_type!r})"


@dataclass(frozen=True)
class Rpc:
    """An RPC handler: runs inside one transaction, serialized with every change to its flow."""

    name: str
    handler: RpcFn
    request_type: Any = Any
    locks: tuple[str, ...] = ()
    load: LoadSpec = field(default_factory=LoadOptions.all)


def rpc(
    name: str | None = None,
    *,
    request_type: Any = Any,
    locks: Iterable[LockItem] = (),
    load: LoadSpec | None = None,
) -> Callable[[RpcFn], Rpc]:
    """Decorate `async def handler(ctx: RpcContext, request) -> output | RPCResult` as an RPC.

    With `locks`, the RPC fails at once with RpcLockConflictError while a Step holds any of them.
    """

    def wrap(fn: RpcFn) -> Rpc:
        label = f"RPC {shown(name or getattr(fn, '__name__', fn), None)}"
        if not callable(fn):  # named here: an RPC without a name takes its handler's __name__
            raise FlowDefinitionError(_handler_problems(label, fn)[0])
        check_load(f"{label} load", load, optional=True)
        return Rpc(
            name=check_id("RPC name", name or fn.__name__),
            handler=fn,
            request_type=request_type,
            locks=tuple(lock_name(x) for x in lock_items(f"{label} locks", locks)),
            load=load or LoadOptions.all(),
        )

    return wrap


def _handler_problems(label: str, handler: object) -> list[str]:
    """Why `handler` cannot be called as `await handler(ctx, input)`, if it cannot: found here, a
    mistake is named when the Flow is defined, where otherwise every attempt would fail with it."""
    if not inspect.iscoroutinefunction(handler):
        return [f"{label} must be an async function, got {shown(handler, None)}"]
    try:
        signature = inspect.signature(handler)
    except ValueError:  # no signature to read (some callables implemented in C): the call decides
        return []
    try:
        signature.bind(None, None)
    except TypeError as exc:
        return [f"{label} {getattr(handler, '__qualname__', handler)}{signature} cannot be called with "
                f"(ctx, input): {exc}"]
    return []


class Flow:
    """A Flow definition: its type, Steps (at most one start Step), schema and RPCs."""

    def __init__(
        self,
        flow_type: str,
        steps: Sequence[Step[Any]],
        *,
        start_step: Step[Any] | str | None = None,
        schema: Sequence[SchemaItem] = (),
        rpcs: Sequence[Rpc] = (),
    ) -> None:
        self.flow_type = check_id("flow type", flow_type)
        problems: list[str] = []
        self.steps: dict[str, Step[Any]] = {}
        for step in _definition_items(f"flow {flow_type!r} steps", steps, Step, "Steps"):
            if not isinstance(step, Step):
                problems.append(f"steps holds {shown(step, None)}, which is not a Step")
                continue
            if step.step_type in self.steps:
                problems.append(f"Step type {step.step_type!r} is declared twice")
            self.steps[step.step_type] = step
        given_start: object = start_step  # typed; checked for callers that pass anything
        if not isinstance(given_start, str | Step) and given_start is not None:
            raise FlowDefinitionError(f"flow {flow_type!r}: start_step must be a Step, its Step type (str) or None, "
                                      f"got {type(given_start).__name__}: {shown(given_start)}")
        start_name = start_step if isinstance(start_step, str) or start_step is None else start_step.step_type
        if start_name is not None and start_name not in self.steps:
            problems.append(f"start Step {start_name!r} is not one of the flow's Steps")
        self.start_step_type = start_name
        self.attributes: dict[str, Attribute[Any] | AttributeMap[Any]] = {}
        self.channels: dict[str, Channel[Any] | ChannelMap[Any]] = {}
        self.streams: dict[str, Stream[Any]] = {}
        seen: set[str] = set()
        for item in _definition_items(f"flow {flow_type!r} schema", schema, _SCHEMA_ITEMS,
                                       "Attributes, AttributeMaps, Channels, ChannelMaps and Streams"):
            if not isinstance(item, Attribute | AttributeMap | Channel | ChannelMap | Stream):
                problems.append(
                    f"schema item {shown(item, None)} is not an Attribute, AttributeMap, Channel, ChannelMap, Stream")
                continue
            if item.name in seen:
                problems.append(f"schema name {item.name!r} is declared twice")
            seen.add(item.name)
            problem = type_problem(f"{type(item).__name__} {item.name!r} value type", item.value_type)
            if problem is not None:
                problems.append(problem)
            if isinstance(item, Attribute | AttributeMap):
                self.attributes[item.name] = item
            elif isinstance(item, Channel | ChannelMap):
                self.channels[item.name] = item
            else:
                self.streams[item.name] = item
        self.rpcs: dict[str, Rpc] = {}
        for r in _definition_items(f"flow {flow_type!r} rpcs", rpcs, Rpc, "RPCs"):
            if not isinstance(r, Rpc):
                problems.append(f"RPC {shown(r, None)} is not decorated with @rpc")
                continue
            # An Rpc made directly, not by @rpc, was taken unchecked: a name no client call can
            # give (empty, with a space) left the RPC unreachable, and a lock name given as text
            # was taken letter by letter.
            try:
                check_id("RPC name", r.name)
            except InvalidIdError as exc:
                problems.append(str(exc))
                continue
            if not isinstance(r.locks, tuple | list) or not all(isinstance(lock, str) for lock in r.locks):
                problems.append(f"RPC {r.name!r} locks must be a tuple of attribute names; declare it with "
                                f"@rpc(locks=...), got {shown(r.locks, None)}")
                continue
            if r.name in self.rpcs:
                problems.append(f"RPC {r.name!r} is declared twice")
                continue  # the first declaration's own problems are listed already
            self.rpcs[r.name] = r
            problems.extend(_handler_problems(f"RPC {r.name!r}", r.handler))
            problem = type_problem(f"RPC {r.name!r} request type", r.request_type)
            if problem is not None:
                problems.append(problem)
            problems.extend(self._lock_problems(f"RPC {r.name!r}", r.locks))
            problems.extend(self._load_problems(f"RPC {r.name!r} load", r.load))
        for step in self.steps.values():
            problems.extend(self._step_problems(step))
        if problems:
            raise FlowDefinitionError(
                f"flow type {flow_type!r} has {len(problems)} problem(s): " + "; ".join(problems)
            )

    def _step_problems(self, step: Step[Any]) -> list[str]:
        out: list[str] = []
        label = f"Step {step.step_type!r}"
        options: object = step.options  # typed StepOptions; a caller without a type checker may pass anything
        if not isinstance(options, StepOptions):
            return [f"{label} options must be StepOptions, got {type(options).__name__}: {shown(options, 200)}"]
        out.extend(_handler_problems(f"{label} execute", step.execute))
        problem = type_problem(f"{label} input type", step.input_type)
        if problem is not None:
            out.append(problem)
        if step.wait_for is not None:
            out.extend(_handler_problems(f"{label} wait_for", step.wait_for))
        for flag in ("pure_execute", "pure_until_heartbeat"):
            pure: object = getattr(step, flag)  # typed bool, but a caller without a type checker may pass anything
            if not isinstance(pure, bool):
                out.append(f"{label} {flag} must be True or False, got {shown(pure, None)}")
        route = step.options.failure_route
        if route is not None and not (isinstance(route, str) and route in self.steps):  # a list is unhashable
            out.append(f"{label} failure route {shown(route, None)} is not one of the flow's Steps")
        out.extend(self._lock_problems(label, tuple(lock_name(x) for x in step.options.execute_locks)))
        out.extend(self._lock_problems(label, tuple(lock_name(x) for x in step.options.wait_for_locks)))
        for field_name in ("load", "execute_load", "wait_for_load"):
            out.extend(self._load_problems(f"{label} {field_name}", getattr(step.options, field_name)))
        return out

    def _load_problems(self, label: str, load: LoadSpec | None) -> list[str]:
        """Attributes a load names that the Flow does not declare: a typo there loaded nothing, and
        surfaced only as a NotLoadedError (or a missing value) when a handler read the real name."""
        if load is None or load.mode != "only":
            return []
        named = [*load.names, *(name for name, _ in load.instances)]
        return [f"{label} loads {name!r}, which is not a declared attribute"
                for name in dict.fromkeys(named) if name not in self.attributes]

    def _lock_problems(self, label: str, locks: tuple[str, ...]) -> list[str]:
        return [
            f"{label} locks {lock!r}, which is not a declared attribute"
            for lock in locks
            if lock.split("[", 1)[0] not in self.attributes
        ]

    # Lookups used by contexts and clients -----------------------------------------------

    def step(self, step_type: str) -> Step[Any]:
        try:
            return self.steps[step_type]
        except KeyError:
            raise UndeclaredNameError("Step", step_type, self.flow_type, list(self.steps)) from None

    def rpc(self, name: str) -> Rpc:
        try:
            return self.rpcs[name]
        except (KeyError, TypeError):  # TypeError: an unhashable name (a list from a request body) is none either
            raise RpcNotFoundError(self.flow_type, name, list(self.rpcs)) from None

    def check_attribute(self, ref: AttributeRef[Any]) -> None:
        given: object = ref  # typed; a handler may pass anything
        if not isinstance(given, AttributeRef):
            raise _not_one_instance(given, "attribute", AttributeMap, "read or written",
                                    "an attribute must be an Attribute or an AttributeMap[key]")
        declared = self.attributes.get(ref.name)
        keyed = isinstance(declared, AttributeMap)
        if declared is None or keyed != bool(ref.key):
            raise UndeclaredNameError("attribute", ref.label, self.flow_type, list(self.attributes))

    def check_attribute_map(self, amap: AttributeMap[Any]) -> None:
        """Raise unless `amap` is an AttributeMap the flow declares, naming what it is instead."""
        given: object = amap  # typed; a handler may pass anything
        if isinstance(given, AttributeRef) and isinstance(self.attributes.get(given.name), Attribute):
            raise InvalidValueError(f"attribute {given.name!r} is a plain Attribute, not an AttributeMap; read "
                                    "it with get")
        if not isinstance(given, AttributeMap):
            raise InvalidValueError(f"an attribute map must be an AttributeMap the flow declares, got "
                                    f"{type(given).__name__}: {shown(given)}")
        if not isinstance(self.attributes.get(given.name), AttributeMap):
            raise UndeclaredNameError("attribute", given.name, self.flow_type, list(self.attributes))

    def check_channel(self, ref: ChannelRef[Any]) -> None:
        given: object = ref  # typed; a handler may pass anything
        if not isinstance(given, ChannelRef):
            raise _not_one_instance(given, "channel", ChannelMap, "meant",
                                    "a channel must be a Channel or a ChannelMap[key]")
        declared = self.channels.get(ref.name)
        keyed = isinstance(declared, ChannelMap)
        if declared is None or keyed != bool(ref.key):
            raise UndeclaredNameError("channel", ref.label, self.flow_type, list(self.channels))

    def check_stream(self, stream: Stream[Any] | str) -> Stream[Any]:
        name = stream if isinstance(stream, str) else stream.name
        found = self.streams.get(name)
        if found is None:
            raise UndeclaredNameError("stream", name, self.flow_type, list(self.streams))
        return found

    def attribute_type(self, name: str) -> Any:
        declared = self.attributes.get(name)
        if declared is None:
            raise UndeclaredNameError("attribute", name, self.flow_type, list(self.attributes))
        return declared.value_type

    def channel_type(self, name: str) -> Any:
        declared = self.channels.get(name)
        if declared is None:
            raise UndeclaredNameError("channel", name, self.flow_type, list(self.channels))
        return declared.value_type


class Registry:
    """The validated set of Flows a Client and a Worker share."""

    def __init__(self, flows: Sequence[Flow], *, allow_async_handlers: bool = True) -> None:
        # allow_async_handlers is accepted for the Dex SDK's signature; every handler is async here.
        self.allow_async_handlers = allow_async_handlers
        self.flows: dict[str, Flow] = {}
        problems = []
        for flow in _definition_items("invalid Registry: flows", flows, Flow, "Flows"):
            if not isinstance(flow, Flow):
                problems.append(f"{shown(flow, None)} is not a Flow")
                continue
            if flow.flow_type in self.flows:
                problems.append(f"flow type {flow.flow_type!r} is registered twice")
            self.flows[flow.flow_type] = flow
        if not self.flows and not problems:
            problems.append("a Registry needs at least one Flow")
        if problems:
            raise FlowDefinitionError("invalid Registry: " + "; ".join(problems))

    def flow(self, flow_type: str) -> Flow:
        try:
            return self.flows[flow_type]
        except (KeyError, TypeError):  # TypeError: an unhashable type name (a list, a dict) is none either
            raise UnknownFlowTypeError(flow_type, list(self.flows)) from None


def _not_one_instance(given: object, kind: str, whole: type, use: str, expected: str) -> InvalidValueError:
    """The error for `given` where one attribute or channel (`kind`) is `use`d: a whole map of
    them (`whole`), or something else altogether (`expected` says what is)."""
    if isinstance(given, whole):
        name = getattr(given, "name", "?")
        return InvalidValueError(f"{kind} map {name!r} given whole where one {kind} is {use}; give one instance "
                                 f"of it, {name}[key]")
    return InvalidValueError(f"{expected} the flow declares, got {type(given).__name__}: {shown(given)}")


def _definition_items(label: str, items: object, single: type | tuple[type, ...], noun: str) -> list[object]:
    """`items` (a definition's collection as given: any iterable) as a list, or FlowDefinitionError
    naming `label` and the value: iterated unchecked, one item given alone (Flow("f", step)) failed
    with a bare TypeError ('Step' object is not iterable), and text was taken item by item."""
    expected = f"{label} must be a collection of {noun}"
    if isinstance(items, single):
        item = shown(items, None)
        raise FlowDefinitionError(f"{expected}, got the single item {item}; give it in a list: [{item}]")
    if not isinstance(items, Iterable) or isinstance(items, str | bytes | Mapping):
        raise FlowDefinitionError(f"{expected}, got {type(items).__name__}: {shown(items, None)}")
    return list(items)


__all__ = ["Flow", "RPCResult", "Registry", "Rpc", "Step", "rpc"]
