"""A method's view of its loaded map instances (Context.items): order, writes on top, bad stored values.

Pure: the view is built from loaded bytes the way the worker builds it, with no store.
"""

from __future__ import annotations

import msgspec
import pytest

from dex_engine import AttributeMap, Flow, InvalidValueError, LoadOptions, Step, StepDecision, UndeclaredNameError
from dex_engine._codec import encode_value
from dex_engine._context import _StateView


class Point(msgspec.Struct, frozen=True):
    x: int


Points: AttributeMap[Point] = AttributeMap("Points", Point)
Names: AttributeMap[str] = AttributeMap("Names", str)


async def _noop(ctx: object, _: None) -> StepDecision:
    return StepDecision.graceful_complete()


FLOW = Flow("Viewed", [Step("S", _noop, input_type=type(None))], start_step="S", schema=[Points, Names])


def view(loaded: dict[tuple[str, str], bytes]) -> _StateView:
    return _StateView(FLOW, "f1", loaded, LoadOptions.all(), "Step S")


def stored(amap: AttributeMap[object], key: str, value: object) -> tuple[tuple[str, str], bytes]:
    return (amap.name, key), encode_value(amap.name, amap.value_type, value)


def test_items_are_in_key_order_with_this_methods_writes_and_deletes_on_top() -> None:
    v = view(dict([stored(Points, "b", Point(2)), stored(Points, "a", Point(1)), stored(Points, "d", Point(4)),
                   stored(Names, "a", "other map")]))
    assert v.items(Points) == {"a": Point(1), "b": Point(2), "d": Point(4)}
    v.set(Points["c"], Point(3))
    v.delete(Points["a"])
    v.set(Points["b"], Point(20))
    assert list(v.items(Points).items()) == [("b", Point(20)), ("c", Point(3)), ("d", Point(4))]
    assert v.keys(Points) == ["b", "c", "d"]
    assert v.items(Names) == {"a": "other map"}
    returned = v.items(Points)
    returned.clear()  # a caller's copy: the view's own answer is unchanged
    assert v.keys(Points) == ["b", "c", "d"]


def test_a_stored_value_of_another_type_names_the_instance() -> None:
    """Only the bad instance is named; the good ones stay readable."""
    v = view({("Points", "a"): b'{"x":1}', ("Points", "b"): b'{"x":"two"}', ("Points", "c"): b'{"x":3}'})
    with pytest.raises(InvalidValueError, match=r"stored value for 'Points\[b\]' is not a Point"):
        v.items(Points)
    assert v.get(Points["a"]) == Point(1)


def test_a_write_alone_after_items_shows_in_the_next_items() -> None:
    """items() remembers its answer until the map is written: a single set, or a single delete,
    after it shows in the next answer."""
    v = view(dict([stored(Points, "a", Point(1))]))
    assert v.items(Points) == {"a": Point(1)}
    v.set(Points["b"], Point(2))
    assert v.items(Points) == {"a": Point(1), "b": Point(2)}
    v.delete(Points["a"])
    assert v.items(Points) == {"b": Point(2)}


def test_deleting_an_undeclared_attribute_is_refused_by_name() -> None:
    v = view({})
    with pytest.raises(UndeclaredNameError, match="Nowhere"):
        v.delete(AttributeMap("Nowhere", str)["k"])


def test_get_refuses_an_undeclared_attribute_and_returns_the_default_for_an_unset_one() -> None:
    v = view(dict([stored(Points, "a", Point(1))]))
    with pytest.raises(UndeclaredNameError, match="Nowhere"):
        v.get(AttributeMap("Nowhere", str)["k"])
    assert v.get(Points["zz"], Point(0)) == Point(0)
    assert v.get(Points["zz"]) is None
    assert v.get(Points["a"], Point(0)) == Point(1)


def test_items_of_a_map_loaded_whole_by_name_are_in_key_order_without_writes() -> None:
    """A method whose load names the map (not every attribute) reads all its instances, in key order
    even when storage handed them over in another."""
    loaded = dict([stored(Points, "c", Point(3)), stored(Points, "a", Point(1)), stored(Points, "b", Point(2))])
    v = _StateView(FLOW, "f1", loaded, LoadOptions.only(Points), "Step S")
    assert list(v.items(Points)) == ["a", "b", "c"]
