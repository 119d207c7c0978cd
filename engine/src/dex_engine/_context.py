"""The contexts handlers see: Context for WaitFor and Execute, RpcContext for RPCs."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from ._codec import decode_value, encode_value
from ._errors import NotLoadedError
from ._options import LoadSpec
from ._records import RecoveryError, WaitOutcome, WriteSet
from ._schema import AttributeMap, AttributeRef, ChannelRef, Stream
from ._wait import WaitSpec

if TYPE_CHECKING:
    from ._flow import Flow

T = TypeVar("T")


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
        self._cache: dict[tuple[str, str], Any] = {}

    def _is_loaded(self, name: str, key: str) -> bool:
        if self._load.mode == "all":
            return True
        if self._load.mode == "none":
            return False
        return name in self._load.names or (name, key) in self._load.instances

    def get(self, ref: AttributeRef[T], default: T | None = None) -> T | None:
        """The attribute's value, or `default` when it is unset."""
        self.flow.check_attribute(ref)
        ident = (ref.name, ref.key)
        if ident in self._writes.attributes:
            data = self._writes.attributes[ident]
        else:
            if not self._is_loaded(ref.name, ref.key):
                raise NotLoadedError(ref.label, self._owner)
            data = self._loaded.get(ident)
        if data is None:
            return default
        if ident not in self._cache:
            self._cache[ident] = decode_value(ref.label, ref.value_type, data)
        value: T = self._cache[ident]
        return value

    def items(self, amap: AttributeMap[T]) -> dict[str, T]:
        """Every loaded instance of a map, by key, in key order, with this method's writes applied."""
        if not isinstance(self.flow.attributes.get(amap.name), AttributeMap):
            self.flow.check_attribute(AttributeRef(amap.name, "?", amap.value_type))
        keys = {k for (n, k) in self._loaded if n == amap.name}
        keys |= {k for (n, k) in self._writes.attributes if n == amap.name}
        whole = self._load.mode == "all" or amap.name in self._load.names
        if not whole and not any(n == amap.name for n, _ in self._load.instances):
            raise NotLoadedError(amap.name, self._owner)
        out: dict[str, T] = {}
        for key in sorted(keys):
            # Keys come from storage or from this method's checked writes: no need to check them again.
            ref: AttributeRef[T] = AttributeRef(amap.name, key, amap.value_type)
            value = self.get(ref)
            if value is not None:
                out[key] = value
        return out

    def keys(self, amap: AttributeMap[T]) -> list[str]:
        return list(self.items(amap))

    def set(self, ref: AttributeRef[T], value: T) -> None:
        """Write an attribute; encoded and checked now, committed with the method's result."""
        self.flow.check_attribute(ref)
        data = encode_value(ref.label, ref.value_type, value)
        ident = (ref.name, ref.key)
        self._writes.attributes[ident] = data
        self._cache[ident] = value

    def delete(self, ref: AttributeRef[Any]) -> None:
        self.flow.check_attribute(ref)
        ident = (ref.name, ref.key)
        self._writes.attributes[ident] = None
        self._cache.pop(ident, None)

    def publish(self, channel: ChannelRef[T], value: T) -> None:
        """Queue a message on a channel instance at this method's commit."""
        self.flow.check_channel(channel)
        self._writes.publishes.append(
            (channel.name, channel.key, encode_value(channel.label, channel.value_type, value))
        )

    def append(self, stream: Stream[T], event: T) -> None:
        """Append an event to a stream at this method's commit (transactional)."""
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
        heartbeat without one repeats the last. Raises StaleAttemptError if the attempt lost its task.
        """
        await self._heartbeat(checkpoint)
        if checkpoint is not None:
            self.checkpoint = checkpoint

    def write_event(self, stream: Stream[T], event: T) -> None:
        """Append a best-effort event now, before this attempt commits; safe from any thread.

        Readers see it at once. It is dropped when the attempt has lost its task (E2, E11).
        """
        declared = self.flow.check_stream(stream)
        self._write_event(declared.name, encode_value(declared.name, declared.value_type, event))


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
    ) -> None:
        super().__init__(flow, flow_id, loaded, load, f"RPC {rpc_name}")
        self._pending = pending

    def pending(self, channel: ChannelRef[T]) -> list[PendingMessage]:
        """Messages queued on a channel instance, oldest first, minus those this RPC deleted."""
        self.flow.check_channel(channel)
        deleted = {m for (n, k, m) in self._writes.deleted_messages if (n, k) == (channel.name, channel.key)}
        return [
            PendingMessage(mid, decode_value(channel.label, channel.value_type, data))
            for mid, data in self._pending.get((channel.name, channel.key), [])
            if mid not in deleted
        ]

    def delete_message(self, channel: ChannelRef[Any], message_id: int) -> None:
        """Delete a pending message at commit; the RPC fails with ChannelMessageNotFoundError if it is gone."""
        self.flow.check_channel(channel)
        self._writes.deleted_messages.append((channel.name, channel.key, message_id))
