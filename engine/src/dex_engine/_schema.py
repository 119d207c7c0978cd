"""A Flow's persistence schema: attributes, attribute maps, channels, channel maps, streams."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from ._errors import shown
from ._ids import check_key, check_name
from ._limits import DEFAULT_STREAM_CAPACITY_BYTES, MAX_WHOLE_NUMBER
from ._wait import ChannelCondition

T = TypeVar("T")


@dataclass(frozen=True)
class AttributeRef(Generic[T]):
    """One stored value: a plain Attribute (key '') or one instance of an AttributeMap."""

    name: str
    key: str
    value_type: Any

    @property
    def label(self) -> str:
        return self.name if not self.key else f"{self.name}[{self.key}]"


class Attribute(AttributeRef[T]):
    """A typed durable value of a flow."""

    def __init__(self, name: str, value_type: Any) -> None:
        super().__init__(check_name("attribute name", name), "", value_type)


class AttributeMap(Generic[T]):
    """A keyed family of typed values; each key is stored, loaded and locked on its own."""

    def __init__(self, name: str, value_type: Any) -> None:
        self.name = check_name("attribute map name", name)
        self.value_type = value_type

    def __getitem__(self, key: str) -> AttributeRef[T]:
        return AttributeRef(self.name, check_key(f"key of attribute map {self.name!r}", key), self.value_type)

    def __repr__(self) -> str:
        return f"AttributeMap({self.name!r})"


@dataclass(frozen=True)
class ChannelRef(Generic[T]):
    """One FIFO queue: a plain Channel (key '') or one instance of a ChannelMap."""

    name: str
    key: str
    value_type: Any

    @property
    def label(self) -> str:
        return self.name if not self.key else f"{self.name}[{self.key}]"

    def for_one(self) -> ChannelCondition:
        return ChannelCondition(self.name, self.key, 1, 1)

    def for_n(self, n: int) -> ChannelCondition:
        return ChannelCondition(self.name, self.key, n, n)

    def at_least(self, n: int) -> ChannelCondition:
        """Satisfied by n queued messages; takes everything queued."""
        return ChannelCondition(self.name, self.key, n, None)

    def at_most(self, n: int) -> ChannelCondition:
        """Never blocks: satisfied by an empty queue; takes up to n."""
        return ChannelCondition(self.name, self.key, 0, n)

    def for_range(self, at_least: int, at_most: int) -> ChannelCondition:
        return ChannelCondition(self.name, self.key, at_least, at_most)


class Channel(ChannelRef[T]):
    """A durable FIFO of typed messages per flow."""

    def __init__(self, name: str, value_type: Any) -> None:
        super().__init__(check_name("channel name", name), "", value_type)


class ChannelMap(Generic[T]):
    """A keyed family of independent FIFOs."""

    def __init__(self, name: str, value_type: Any) -> None:
        self.name = check_name("channel map name", name)
        self.value_type = value_type

    def __getitem__(self, key: str) -> ChannelRef[T]:
        return ChannelRef(self.name, check_key(f"key of channel map {self.name!r}", key), self.value_type)

    def __repr__(self) -> str:
        return f"ChannelMap({self.name!r})"


class Stream(Generic[T]):
    """An append-only event log per flow, trimmed oldest-first beyond `capacity_bytes`."""

    def __init__(self, name: str, value_type: Any, capacity_bytes: int = DEFAULT_STREAM_CAPACITY_BYTES) -> None:
        self.name = check_name("stream name", name)
        self.value_type = value_type
        capacity: object = capacity_bytes  # typed int; checked for callers that pass anything
        if isinstance(capacity, bool) or not isinstance(capacity, int) or not 0 < capacity <= MAX_WHOLE_NUMBER:
            raise ValueError(f"stream {name!r} capacity must be a positive whole number of bytes, at most "
                             f"{MAX_WHOLE_NUMBER}, got {shown(capacity, None)}")
        self.capacity_bytes = capacity_bytes

    def __repr__(self) -> str:
        return f"Stream({self.name!r})"


SchemaItem = Attribute[Any] | AttributeMap[Any] | Channel[Any] | ChannelMap[Any] | Stream[Any]
