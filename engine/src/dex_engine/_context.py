"""The contexts handlers see: Context for WaitFor and Execute, RpcContext for RPCs."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from ._codec import decode_value, decoded_cache, encode_value
from ._errors import InvalidValueError, NotLoadedError, StaleAttemptError, ValueTooLargeError, shown
from ._limits import MAX_VALUE_BYTES
from ._options import LoadOptions, LoadSpec
from ._records import RecoveryError, WaitOutcome, WriteSet
from ._schema import AttributeMap, AttributeRef, ChannelRef, Stream
from ._wait import WaitSpec

if TYPE_CHECKING:
    from ._flow import Flow

T = TypeVar("T")

_MISSING: Any = object()


class _StateView:
    """Reads through the loaded attributes and buffers writes; reads see this method's own writes."""

    def __init__(
        self,
        flow: Flow,
        flow_id: str,
        loaded: dict[tuple[str, str], bytes],
        load: LoadSpec,
        owner: str,
    ) -> None:
        self.flow = flow
        self.flow_id = flow_id
        self._loaded = loaded
        self._load = load
        self._owner = owner
        self._writes = WriteSet()
        # Decoded values (and values this method set) by (name, key). Only a checked, loaded or
        # written attribute gets an entry, so a hit needs no check again.
        self._cache: dict[tuple[str, str], Any] = {}
        self._map_keys: dict[str, list[str]] | None = None  # loaded keys by map name, sorted
        self._items: dict[str, dict[str, Any]] = {}  # items() by map name, until a write to the map
        self._ended: str | None = None  # set by close(): what ended, for the error of a later write

    def close(self, ended: str) -> None:
        """Refuse writes from now on: the handler returned (`ended` says which), and its writes were
        taken for its commit or dropped with its failure. A write kept for later (a background task
        holding the context) would be lost without a word."""
        self._ended = ended

    def _refused(self, call: str) -> StaleAttemptError:
        return StaleAttemptError(f"ctx.{call} after {self._ended}: its writes were already committed or "
                                 "dropped; make every write before the handler returns")

    def _not_loaded(self, name: str) -> NotLoadedError:
        return NotLoadedError(name, self._owner)

    def _is_loaded(self, name: str, key: str) -> bool:
        return self._load.loads(name, key)

    def get(self, ref: AttributeRef[T], default: T | None = None) -> T | None:
        """The attribute's value, or `default` when it is unset."""
        given: object = ref  # typed; a handler may pass anything: named, not an AttributeError for ref.name
        if not isinstance(given, AttributeRef):
            self.flow.check_attribute(ref)
        ident = (ref.name, ref.key)
        cache = self._cache
        if ident in cache:
            cached: T = cache[ident]
            return cached
        self.flow.check_attribute(ref)
        writes = self._writes.attributes
        if ident in writes:
            data = writes[ident]
        else:
            if not self._load.loads(ref.name, ref.key):
                raise self._not_loaded(ref.label)
            data = self._loaded.get(ident)
        if data is None:
            return default
        value: T = decode_value(ref.name, ref.value_type, data, ref.key or None)
        cache[ident] = value
        return value

    def items(self, amap: AttributeMap[T]) -> dict[str, T]:
        """Every loaded instance of a map, by key, in key order, with this method's writes applied."""
        given: object = amap  # typed; a handler may pass anything: named, not an AttributeError or 'N[?]'
        if not isinstance(given, AttributeMap) or not isinstance(self.flow.attributes.get(given.name), AttributeMap):
            self.flow.check_attribute_map(amap)
        name = amap.name
        known = self._items.get(name)
        if known is not None:
            return dict(known)
        whole = self._load.mode == "all" or name in self._load.names
        if not whole and not any(n == name for n, _ in self._load.instances):
            raise self._not_loaded(name)
        if self._map_keys is None:
            index: dict[str, list[str]] = {}
            for n, k in self._loaded:
                index.setdefault(n, []).append(k)
            for listed in index.values():
                listed.sort()
            self._map_keys = index
        keys = self._map_keys.get(name, [])
        writes = self._writes.attributes
        written = [k for (n, k) in writes if n == name]
        if written:
            keys = sorted({*keys, *written})
        cache, loaded, value_type = self._cache, self._loaded, amap.value_type
        shared = decoded_cache(value_type)
        decoded, handout = shared if shared is not None else ({}, None)
        out: dict[str, T] = {}
        for key in keys:
            # Keys come from storage or from this method's checked writes: no need to check them again.
            ident = (name, key)
            value = cache.get(ident, _MISSING)
            if value is _MISSING:
                data = writes[ident] if written and ident in writes else loaded.get(ident)
                if data is None:
                    continue
                # The decoded cache looked up here, not through a call per instance (see decoded_cache).
                hit = decoded.get((value_type, data))
                if hit is None:
                    value = decode_value(name, value_type, data, key)
                else:
                    value = hit if handout is None else handout(hit)
                cache[ident] = value
            # A stored null is an instance (get returns it, not the default): listed too.
            out[key] = value
        self._items[name] = out
        return dict(out)

    def keys(self, amap: AttributeMap[T]) -> list[str]:
        return list(self.items(amap))

    def set(self, ref: AttributeRef[T], value: T) -> None:
        """Write an attribute; encoded and checked now, committed with the method's result."""
        if self._ended is not None:  # inline: every write of every handler passes here
            raise self._refused("set")
        self.flow.check_attribute(ref)
        data = encode_value(ref.label, ref.value_type, value)
        ident = (ref.name, ref.key)
        self._writes.attributes[ident] = data
        self._cache[ident] = value
        self._items.pop(ref.name, None)

    def delete(self, ref: AttributeRef[Any]) -> None:
        if self._ended is not None:  # inline: every write of every handler passes here
            raise self._refused("delete")
        self.flow.check_attribute(ref)
        ident = (ref.name, ref.key)
        self._writes.attributes[ident] = None
        self._cache.pop(ident, None)
        self._items.pop(ref.name, None)

    def publish(self, channel: ChannelRef[T], value: T) -> None:
        """Queue a message on a channel instance at this method's commit."""
        if self._ended is not None:  # inline: every write of every handler passes here
            raise self._refused("publish")
        self.flow.check_channel(channel)
        self._writes.publishes.append(
            (channel.name, channel.key, encode_value(channel.label, channel.value_type, value))
        )

    def append(self, stream: Stream[T], event: T) -> None:
        """Append an event to a stream at this method's commit (transactional)."""
        if self._ended is not None:  # inline: every write of every handler passes here
            raise self._refused("append")
        declared = self.flow.check_stream(stream)
        self._writes.appends.append(
            (declared.name, declared.capacity_bytes, encode_value(declared.name, declared.value_type, event))
        )

    @property
    def writes(self) -> WriteSet:
        return self._writes


@dataclass(frozen=True)
class WaitResult:
    """What Execute receives from its WaitFor: the consumed messages per condition, fired timers."""

    spec: WaitSpec | None
    outcome: WaitOutcome | None
    flow: Flow

    @property
    def skipped(self) -> bool:
        return self.outcome is None or self.outcome.skipped

    @property
    def satisfied(self) -> tuple[int, ...]:
        return () if self.outcome is None else self.outcome.satisfied

    @property
    def timer_fired(self) -> bool:
        return bool(self.outcome and self.outcome.fired_timers)

    @property
    def fired_timers(self) -> tuple[int, ...]:
        return () if self.outcome is None else self.outcome.fired_timers

    def messages_at(self, index: int) -> list[Any]:
        """Decoded messages the condition at `index` consumed."""
        if self.outcome is None or self.spec is None or index >= len(self.outcome.consumed):
            return []
        cond = self.spec.conditions[index]
        if cond.kind != "channel":
            return []  # a timer condition consumes no messages
        tp = self.flow.channel_type(cond.channel)
        return [decode_value(cond.channel, tp, m.value) for m in self.outcome.consumed[index]]

    def messages(self, channel: ChannelRef[T]) -> list[T]:
        """Decoded messages consumed from one channel instance, over every condition naming it."""
        self.flow.check_channel(channel)  # a channel the Flow lacks is a mistake, not "no messages"
        if self.outcome is None or self.spec is None:
            return []
        out: list[T] = []
        for i, cond in enumerate(self.spec.conditions):
            if cond.kind == "channel" and cond.channel == channel.name and cond.key == channel.key:
                out.extend(self.messages_at(i))
        return out

    def message_ids(self, index: int) -> list[int]:
        if self.outcome is None or index >= len(self.outcome.consumed):
            return []
        return [m.message_id for m in self.outcome.consumed[index]]


HeartbeatFn = Callable[[str | None], Awaitable[None]]
EventFn = Callable[[str, bytes], None]


def _check_checkpoint(checkpoint: str) -> None:
    """ValueTooLargeError for a `checkpoint` over MAX_VALUE_BYTES in UTF-8, as for a value (every
    later claim of the method loads it); InvalidValueError naming its first character a database
    cannot store as text: NUL (PostgreSQL's text cannot hold it) or a lone surrogate (no UTF-8
    encoding). Unlike an error's text it cannot be escaped: the next attempt must get back exactly
    what was saved."""
    given: object = checkpoint  # typed str; a number failed with "argument of type 'int' is not iterable"
    if not isinstance(given, str):
        raise InvalidValueError(f"a heartbeat checkpoint must be a str or None, got {type(given).__name__}: "
                                f"{shown(given)}; save its text, such as json.dumps(state)")
    if "\x00" in checkpoint:
        where, what = checkpoint.index("\x00"), "a NUL character"
    else:
        try:
            size = len(checkpoint) if checkpoint.isascii() else len(checkpoint.encode("utf-8"))
        except UnicodeEncodeError as exc:
            where, what = exc.start, "a lone surrogate"
        else:
            if size > MAX_VALUE_BYTES:
                raise ValueTooLargeError("heartbeat checkpoint", size, MAX_VALUE_BYTES)
            return
    raise InvalidValueError(
        f"heartbeat checkpoint {checkpoint[:40]!r} contains {what} at index {where}; "
        "a checkpoint is stored as text: encode it (JSON, base64) first"
    )


class Context(_StateView):
    """What a WaitFor or Execute handler sees: identity, loaded state, buffered writes, heartbeats."""

    def __init__(
        self,
        *,
        flow: Flow,
        flow_id: str,
        step_type: str,
        step_execution_id: str,
        method: str,
        attempt: int,
        loaded: dict[tuple[str, str], bytes],
        load: LoadSpec,
        checkpoint: str | None,
        recovery_error: RecoveryError | None,
        wait_result: WaitResult | None,
        heartbeat: HeartbeatFn,
        write_event: EventFn,
    ) -> None:
        super().__init__(flow, flow_id, loaded, load, step_type)
        self.flow_type = flow.flow_type
        self.step_type = step_type
        self.step_execution_id = step_execution_id
        self.method = method
        self.attempt = attempt
        self.checkpoint = checkpoint
        self.recovery_error = recovery_error
        self.wait_result = wait_result
        self._heartbeat = heartbeat
        self._write_event = write_event

    async def heartbeat(self, checkpoint: str | None = None) -> None:
        """Record that this attempt is alive; returns once durable (E10).

        From then on the attempt counts as started (E3). `checkpoint` replaces the saved one; a
        heartbeat without one repeats the last. Raises StaleAttemptError if the attempt lost its task,
        and InvalidValueError for a checkpoint with a NUL character (PostgreSQL's text cannot hold it)
        or a lone surrogate (no database can encode it).
        """
        if checkpoint is not None:
            _check_checkpoint(checkpoint)
        await self._heartbeat(checkpoint)
        if checkpoint is not None:
            self.checkpoint = checkpoint

    def write_event(self, stream: Stream[T], event: T) -> None:
        """Append a best-effort event now, before this attempt commits; safe from any thread.

        Readers see it at once. It is dropped when the attempt has lost its task (E2, E11).
        """
        declared = self.flow.check_stream(stream)
        self._write_event(declared.name, encode_value(declared.name, declared.value_type, event))


class NotFoldable(BaseException):
    """A WaitFor evaluated ahead of its Step's first commit, or a pure Execute run inside the commit
    that claimed it, did what only a separate attempt may do (heartbeat, best-effort event).

    A BaseException, so that a handler's `except Exception` does not swallow it.
    """


class FoldContext(Context):
    """The context of a WaitFor evaluated before the commit that starts its Step.

    Such a WaitFor loads nothing and takes no locks, so its result depends only on its input: the
    worker registers the wait in the same commit (MovementRecord.wait). The Step has no execution
    ID, lease or attempt yet, so anything that needs one (the execution ID, heartbeats, events)
    raises NotFoldable and the WaitFor then runs as usual, after the commit, as attempt 1.
    """

    touched = False

    @property
    def step_execution_id(self) -> str:
        self.touched = True
        raise NotFoldable("step_execution_id")

    @step_execution_id.setter
    def step_execution_id(self, _value: str) -> None:
        pass  # set by Context.__init__; not known yet

    async def heartbeat(self, checkpoint: str | None = None) -> None:
        self.touched = True
        raise NotFoldable("heartbeat")

    def write_event(self, stream: Stream[T], event: T) -> None:
        self.touched = True
        raise NotFoldable("write_event")


@dataclass(frozen=True)
class PendingMessage:
    """A message still queued on a channel, as an RPC sees it."""

    message_id: int
    value: Any


class RpcContext(_StateView):
    """What an RPC handler sees: loaded attributes, pending channel messages, buffered writes."""

    def __init__(
        self,
        flow: Flow,
        flow_id: str,
        loaded: dict[tuple[str, str], bytes],
        load: LoadSpec,
        pending: dict[tuple[str, str], list[tuple[int, bytes]]],
        rpc_name: str,
        in_flight: dict[tuple[str, str], list[tuple[int, bytes]]] | None = None,
        load_more: Callable[[LoadSpec], Awaitable[dict[tuple[str, str], bytes]]] | None = None,
    ) -> None:
        super().__init__(flow, flow_id, loaded, load, f"RPC {rpc_name}")
        self._rpc_name = rpc_name
        self._load_more = load_more
        self._pending = pending
        self._in_flight = in_flight or {}
        self.pending_read = False  # whether the handler asked for pending or in-flight messages

    def _not_loaded(self, name: str) -> NotLoadedError:
        return NotLoadedError(name, self._rpc_name, rpc=True)

    async def load(self, *items: AttributeRef[Any] | AttributeMap[Any]) -> None:
        """Load more attributes or map instances into this RPC's snapshot, as `LoadOptions.only(*items)`
        names them, for a handler that learns from what it loaded which instances it needs (a page
        of a long map): loading the whole map up front would read every instance to use a few.

        What it loads belongs to the same state as the rest of the snapshot: when the flow changed
        since the snapshot was read, the handler's run ends here (let the exception propagate) and
        the RPC runs again on a new snapshot, as after a lost race at its commit (E8).
        """
        if self._ended is not None:
            raise self._refused("load")
        wanted = LoadOptions.only(*items)  # FlowDefinitionError for an item that is no attribute
        for item in items:
            self.flow.check_attribute(item if isinstance(item, AttributeRef) else item["?"])
        current = self._load
        if current.mode == "all":
            return
        names = tuple(n for n in wanted.names if n not in current.names)
        instances = tuple((n, k) for n, k in wanted.instances if not current.loads(n, k))
        if not names and not instances:
            return  # all loaded already
        if self._load_more is None:
            raise RuntimeError(f"{self._owner} has no snapshot to load into")
        rows = await self._load_more(LoadSpec("only", names, instances))
        self._loaded = {**self._loaded, **rows}
        self._load = LoadSpec("only", (*current.names, *names), (*current.instances, *instances))
        self._map_keys = None  # the loaded keys by map, rebuilt with the new rows
        for name in {*names, *(n for n, _ in instances)}:
            self._items.pop(name, None)

    def pending(self, channel: ChannelRef[T]) -> list[PendingMessage]:
        """Messages queued on a channel instance, oldest first, minus those this RPC deleted."""
        self.pending_read = True
        self.flow.check_channel(channel)
        deleted = {m for (n, k, m) in self._writes.deleted_messages if (n, k) == (channel.name, channel.key)}
        return [
            PendingMessage(mid, decode_value(channel.label, channel.value_type, data))
            for mid, data in self._pending.get((channel.name, channel.key), [])
            if mid not in deleted
        ]

    def in_flight(self, channel: ChannelRef[T]) -> list[PendingMessage]:
        """Messages a satisfied wait took from a channel instance whose Step has not committed its
        Execute yet, oldest first: no longer queued (delete_message cannot reach them), not yet
        handled. A failed attempt keeps them for its retry; the Execute's commit ends them."""
        self.pending_read = True
        self.flow.check_channel(channel)
        return [
            PendingMessage(mid, decode_value(channel.label, channel.value_type, data))
            for mid, data in self._in_flight.get((channel.name, channel.key), [])
        ]

    def delete_message(self, channel: ChannelRef[Any], message_id: int) -> None:
        """Delete a pending message at commit; the RPC fails with ChannelMessageNotFoundError if it is gone."""
        if self._ended is not None:  # inline: every write of every handler passes here
            raise self._refused("delete_message")
        self.flow.check_channel(channel)
        given: object = message_id  # typed int; checked for handlers that pass a request's value as it came
        if isinstance(given, bool) or not isinstance(given, int):
            # Each database would compare it its own way: True deleted message 1 on SQLite, "1" on
            # PostgreSQL, and a list failed with a driver error.
            raise InvalidValueError(
                f"delete_message's message_id must be a whole number (a PendingMessage's message_id), got "
                f"{type(given).__name__}: {given!r:.60}")
        self._writes.deleted_messages.append((channel.name, channel.key, message_id))
