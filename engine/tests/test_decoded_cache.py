"""The per-process cache of decoded values (_codec.decode_value): what it shares, and its bounds.

Readers of the same stored bytes share one decoded value only where no reader can change what
another reads; lists are handed out as fresh copies.
"""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
import pytest

from dex_engine import InvalidValueError, _codec
from dex_engine._codec import decode_value, encode_value


class Item(msgspec.Struct, frozen=True):
    name: str
    size: int


class Chunk(msgspec.Struct, frozen=True):
    items: list[Item]
    label: str
    extra: list[str] | None = None


class Nested(msgspec.Struct, frozen=True):
    rows: list[list[int]]


class Loose(msgspec.Struct):
    name: str


class WithDict(msgspec.Struct, frozen=True):
    sizes: dict[str, int]


class Holder(msgspec.Struct, frozen=True):
    inner: Chunk


class HoldsLoose(msgspec.Struct, frozen=True):
    inner: Loose


class EitherIntOrDict(msgspec.Struct, frozen=True):
    value: int | dict[str, int]


class PairWithList(msgspec.Struct, frozen=True):
    pair: tuple[int, list[int]]


class OptionalDicts(msgspec.Struct, frozen=True):
    rows: list[dict[str, int]] | None


class Node(msgspec.Struct, frozen=True):
    name: str
    children: tuple[Node, ...] = ()


class Leaf(msgspec.Struct, frozen=True):
    back: Branch | None = None


class Branch(msgspec.Struct, frozen=True):
    leaf: Leaf


class Tree(msgspec.Struct, frozen=True):
    """Refers to a cycle of two other structs (Branch -> Leaf -> Branch), not to itself."""

    root: Branch


class Scalars(msgspec.Struct, frozen=True):
    maybe: int | None
    many: tuple[int, ...]
    unique: frozenset[str]


@pytest.fixture(autouse=True)
def _empty_cache(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(_codec, "_decoded", _codec._DecodedCache(8, 1000))
    yield


def _decode_twice(tp: object, value: object) -> tuple[object, object]:
    data = encode_value("v", tp, value)
    return decode_value("v", tp, bytes(data)), decode_value("v", tp, bytes(data))


def test_an_immutable_struct_is_decoded_once_and_shared() -> None:
    first, second = _decode_twice(Item, Item("a", 1))
    assert first == Item("a", 1)
    assert second is first


def test_a_struct_of_immutable_lists_shares_its_items_and_copies_its_lists() -> None:
    chunk = Chunk([Item("a", 1), Item("b", 2)], "c", extra=["x"])
    first, second = _decode_twice(Chunk, chunk)
    assert first == second == chunk
    assert isinstance(first, Chunk) and isinstance(second, Chunk)
    assert first.items is not second.items and first.extra is not second.extra
    assert first.items[0] is second.items[0]  # decoded once
    first.items.append(Item("mine", 0))
    assert first.extra is not None
    first.extra.clear()
    third = decode_value("v", Chunk, bytes(encode_value("v", Chunk, chunk)))
    assert third == chunk, "a reader's change to its lists reached the next reader"


def test_an_optional_list_left_out_stays_none() -> None:
    _, second = _decode_twice(Chunk, Chunk([], "c"))
    assert isinstance(second, Chunk) and second.extra is None and second.items == []


def test_a_list_of_immutable_values_is_handed_out_as_a_fresh_list() -> None:
    first, second = _decode_twice(list[Item], [Item("a", 1)])
    assert first == second == [Item("a", 1)]
    assert first is not second
    assert isinstance(first, list)
    first.clear()
    assert decode_value("v", list[Item], bytes(encode_value("v", list[Item], [Item("a", 1)]))) == [Item("a", 1)]


@pytest.mark.parametrize(("tp", "value"), [
    (Nested, Nested([[1, 2]])),
    (Loose, Loose("a")),
    (WithDict, WithDict({"a": 1})),
    (Holder, Holder(Chunk([Item("a", 1)], "c"))),
    (list[list[int]], [[1]]),
    (dict[str, int], {"a": 1}),
])
def test_values_with_deeper_mutable_parts_are_decoded_for_each_reader(tp: object, value: object) -> None:
    first, second = _decode_twice(tp, value)
    assert first == second == value
    assert first is not second
    assert not _codec._decoded.values, "a value with mutable parts below the top was cached"


def test_the_cache_keeps_at_most_its_entries_and_drops_the_oldest() -> None:
    for n in range(20):
        decode_value("v", Item, encode_value("v", Item, Item("a", n)))
    assert len(_codec._decoded.values) == 8
    sizes = [key[1] for key in _codec._decoded.values]
    assert sizes[0] == encode_value("v", Item, Item("a", 12)), "not the oldest entries dropped"
    assert _codec._decoded.stored_bytes == sum(len(s) for s in sizes)


def test_the_cache_keeps_at_most_its_stored_bytes() -> None:
    big = Item("x" * 300, 0)
    for n in range(5):
        decode_value("v", Item, encode_value("v", Item, Item(big.name, n)))
    assert _codec._decoded.stored_bytes <= 1000
    assert len(_codec._decoded.values) == 3
    assert _codec._decoded.stored_bytes == sum(len(key[1]) for key in _codec._decoded.values)


def test_a_value_larger_than_the_byte_bound_is_decoded_but_not_kept() -> None:
    big = Item("x" * 2000, 0)
    assert decode_value("v", Item, encode_value("v", Item, big)) == big
    assert not _codec._decoded.values and _codec._decoded.stored_bytes == 0


def test_bad_stored_bytes_name_the_value_and_are_not_cached() -> None:
    with pytest.raises(_codec.InvalidValueError, match=r"stored value for 'v' is not a Chunk"):
        decode_value("v", Chunk, b'{"items": [{"name": 1, "size": 1}], "label": "c"}')
    assert not _codec._decoded.values


@pytest.mark.parametrize(("tp", "value"), [
    (HoldsLoose, HoldsLoose(Loose("a"))),
    (EitherIntOrDict, EitherIntOrDict({"a": 1})),
    (PairWithList, PairWithList((1, [2]))),
    (OptionalDicts, OptionalDicts([{"a": 1}])),
])
def test_a_mutable_part_anywhere_below_a_frozen_struct_keeps_it_out_of_the_cache(tp: object, value: object) -> None:
    """A mutable struct, a union, a tuple or an optional list that can hold something mutable: each
    reader decodes its own, and a change to one never reaches another."""
    first, second = _decode_twice(tp, value)
    assert first == second == value and first is not second
    assert not _codec._decoded.values, f"{tp!r} was cached"


@pytest.mark.parametrize(("tp", "value"), [
    (Node, Node("root", (Node("leaf"),))),
    (Tree, Tree(Branch(Leaf(Branch(Leaf()))))),
    (Scalars, Scalars(None, (1, 2), frozenset({"a"}))),
])
def test_recursive_and_immutable_container_fields_are_shared(tp: object, value: object) -> None:
    """A frozen struct that refers to itself or to a cycle of others, and one of optional scalars,
    tuples and frozensets, are immutable all the way down: decoded once, shared."""
    first, second = _decode_twice(tp, value)
    assert first == value and second is first


def test_a_value_of_a_union_type_is_refused_naming_the_union() -> None:
    with pytest.raises(InvalidValueError, match=r"value for 'N' is not a int \| None"):
        encode_value("N", int | None, "x")


def test_stored_bytes_decoded_twice_are_decoded_once() -> None:
    """A Step that reads bytes no writer of this process encoded (another process wrote them) still
    shares what the first read decoded; bytes given as text are decoded each time, not cached."""
    data = msgspec.json.encode(Item("a", 1))
    first = decode_value("v", Item, data)
    assert decode_value("v", Item, data) is first
    assert list(_codec._decoded.values) == [(Item, data)]
    text = data.decode()
    assert decode_value("v", Item, text) == first and (Item, text) not in _codec._decoded.values
