"""A method's view of its loaded map instances (Context.items): order, writes on top, bad stored values.

Pure: the view is built from loaded bytes the way the worker builds it, with no store.
"""

from __future__ import annotations

import msgspec
import pytest

from dex_engine import (
    AttributeMap,
    ChannelMap,
    Context,
    Flow,
    InvalidValueError,
    LoadOptions,
    LoadSpec,
    NotLoadedError,
    StaleAttemptError,
    Step,
    StepDecision,
    Stream,
    UndeclaredNameError,
)
from dex_engine._codec import encode_value
from dex_engine._context import RpcContext, _StateView


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


Maybes: AttributeMap[int | None] = AttributeMap("Maybes", int | None)
MAYBE_FLOW = Flow("Maybe", [Step("S", _noop, input_type=type(None))], start_step="S", schema=[Maybes])


def test_an_instance_holding_null_is_listed_as_get_reads_it() -> None:
    """items() lists a map instance whose value is None (stored JSON null, or set now), as get()
    reads None for it and not the default; a deleted one is left out. Catches: items() dropping
    the instances holding None, so that keys() said an instance get() read did not exist."""
    v = _StateView(MAYBE_FLOW, "f1", {("Maybes", "a"): b"null", ("Maybes", "b"): b"1", ("Maybes", "c"): b"2"},
                   LoadOptions.all(), "Step S")
    assert v.items(Maybes) == {"a": None, "b": 1, "c": 2}
    assert v.get(Maybes["a"], 7) is None
    v.set(Maybes["b"], None)
    v.delete(Maybes["c"])
    assert v.items(Maybes) == {"a": None, "b": None}
    assert v.keys(Maybes) == ["a", "b"]


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


Inbox: ChannelMap[int] = ChannelMap("Inbox", int)
RPC_FLOW = Flow("Asked", [Step("S", _noop, input_type=type(None))], start_step="S", schema=[Points, Inbox])


def _queued(*values: tuple[int, int]) -> list[tuple[int, bytes]]:
    return [(mid, encode_value("Inbox", int, value)) for mid, value in values]


def test_an_rpc_reads_each_channel_instance_minus_only_what_it_deleted_there() -> None:
    """pending() and in_flight() read one channel instance and mark the RPC as having read them (its
    commit then checks they did not change); a message this RPC deleted on another instance, under
    the same ID, stays."""
    ctx = RpcContext(RPC_FLOW, "f1", {}, LoadOptions.all(),
                     {("Inbox", "a"): _queued((1, 10), (2, 20)), ("Inbox", "b"): _queued((1, 30))}, "ask",
                     in_flight={("Inbox", "a"): _queued((7, 70))})
    ctx.delete_message(Inbox["b"], 1)
    assert not ctx.pending_read
    assert [(m.message_id, m.value) for m in ctx.pending(Inbox["a"])] == [(1, 10), (2, 20)]
    assert ctx.pending(Inbox["b"]) == []
    assert ctx.pending_read
    flight = RpcContext(RPC_FLOW, "f1", {}, LoadOptions.all(), {}, "ask", in_flight={("Inbox", "a"): _queued((7, 70))})
    assert [(m.message_id, m.value) for m in flight.in_flight(Inbox["a"])] == [(7, 70)]
    assert flight.pending_read
    assert RpcContext(RPC_FLOW, "f1", {}, LoadOptions.all(), {}, "ask").in_flight(Inbox["a"]) == []


def test_an_rpc_naming_an_undeclared_channel_is_refused_by_name() -> None:
    ctx = RpcContext(RPC_FLOW, "f1", {}, LoadOptions.all(), {}, "ask")
    stray = ChannelMap("Stray", int)["k"]
    for read in (ctx.pending, ctx.in_flight, lambda ch: ctx.delete_message(ch, 1)):
        with pytest.raises(UndeclaredNameError, match="Stray"):
            read(stray)


async def test_a_heartbeats_checkpoint_is_the_attempts_checkpoint_from_then_on() -> None:
    """ctx.checkpoint follows the attempt's heartbeats: one with a checkpoint replaces it, one
    without leaves it, and each reaches the worker as given."""
    beats: list[str | None] = []

    async def heartbeat(checkpoint: str | None) -> None:
        beats.append(checkpoint)

    ctx = Context(flow=FLOW, flow_id="f1", step_type="S", step_execution_id="S-1", method="execute", attempt=2,
                  loaded={}, load=LoadOptions.all(), checkpoint="saved", recovery_error=None, wait_result=None,
                  heartbeat=heartbeat, write_event=lambda _name, _data: None)
    await ctx.heartbeat()
    assert ctx.checkpoint == "saved"
    await ctx.heartbeat("newer")
    assert ctx.checkpoint == "newer"
    assert beats == [None, "newer"]


async def test_an_rpc_loads_map_instances_into_its_view_once() -> None:
    """RpcContext.load adds instances to what get and items see, asks the store only for those not
    loaded yet, refuses an undeclared attribute by name, and, like every write, a call after the
    handler returned."""
    asked: list[tuple[tuple[str, str], ...]] = []
    stored = {("Points", k): encode_value("Points", Point, Point(x=n)) for n, k in enumerate("abc")}

    async def load_more(spec: LoadSpec) -> dict[tuple[str, str], bytes]:
        asked.append(spec.instances)
        return {ident: stored[ident] for ident in spec.instances if ident in stored}

    ctx = RpcContext(FLOW, "f1", {("Points", "a"): stored[("Points", "a")]}, LoadOptions.only(Points["a"]), {},
                     "page", load_more=load_more)
    assert ctx.items(Points) == {"a": Point(0)}
    with pytest.raises(NotLoadedError):
        ctx.get(Points["c"])
    await ctx.load(Points["a"], Points["c"], Points["z"])
    await ctx.load(Points["c"])
    assert asked == [(("Points", "c"), ("Points", "z"))]
    assert ctx.get(Points["c"]) == Point(2) and ctx.get(Points["z"]) is None
    assert ctx.items(Points) == {"a": Point(0), "c": Point(2)}
    with pytest.raises(UndeclaredNameError, match="Stray"):
        await ctx.load(AttributeMap("Stray", int)["k"])
    ctx.close("RPC 'page' returned")
    with pytest.raises(StaleAttemptError, match=r"ctx\.load after RPC 'page' returned"):
        await ctx.load(Points["b"])


def test_items_of_a_map_the_method_did_not_load_is_refused_by_name() -> None:
    """A map the load options leave out is NotLoadedError, not an empty map (which would read as "no
    instances" and let a handler act on it); one loaded by instance is readable."""
    v = _StateView(FLOW, "f1", dict([stored(Names, "a", "x")]), LoadOptions.only(Names["a"]), "S")
    with pytest.raises(NotLoadedError, match=r"'Points' was not loaded for Step 'S'"):
        v.items(Points)
    assert v.items(Names) == {"a": "x"}


async def test_an_rpc_that_loaded_everything_loads_nothing_more() -> None:
    """ctx.load in an RPC whose snapshot has every attribute asks the store for nothing: its
    snapshot already holds them (and a second read could see a later state)."""
    asked: list[LoadSpec] = []

    async def load_more(spec: LoadSpec) -> dict[tuple[str, str], bytes]:
        asked.append(spec)
        return {}

    ctx = RpcContext(FLOW, "f1", dict([stored(Points, "a", Point(1))]), LoadOptions.all(), {}, "page",
                     load_more=load_more)
    await ctx.load(Points["a"], Points["b"], Names)
    assert asked == []
    assert ctx.items(Points) == {"a": Point(1)} and ctx.items(Names) == {}


@pytest.mark.parametrize("message_id", [True, "1", 1.0, None])
def test_delete_message_refuses_an_id_that_is_no_whole_number(message_id: object) -> None:
    """True is an int to Python but would delete message 1 on SQLite only; each is refused by value."""
    ctx = RpcContext(RPC_FLOW, "f1", {}, LoadOptions.all(), {("Inbox", "a"): _queued((1, 10))}, "ask")
    with pytest.raises(InvalidValueError, match=rf"must be a whole number .*got {type(message_id).__name__}: "):
        ctx.delete_message(Inbox["a"], message_id)  # type: ignore[arg-type]
    assert ctx.writes.deleted_messages == []


def test_an_rpc_deleting_a_message_after_it_returned_is_refused() -> None:
    ctx = RpcContext(RPC_FLOW, "f1", {}, LoadOptions.all(), {("Inbox", "a"): _queued((1, 10))}, "ask")
    ctx.close("RPC 'ask' returned")
    with pytest.raises(StaleAttemptError, match=r"ctx\.delete_message after RPC 'ask' returned"):
        ctx.delete_message(Inbox["a"], 1)
    assert ctx.writes.deleted_messages == []


def test_an_event_or_append_to_an_undeclared_stream_is_refused_by_name() -> None:
    """Neither reaches the store: a best-effort event would otherwise land in a stream no reader knows."""
    events: list[tuple[str, bytes]] = []
    ctx = Context(flow=FLOW, flow_id="f1", step_type="S", step_execution_id="S-1", method="execute", attempt=1,
                  loaded={}, load=LoadOptions.all(), checkpoint=None, recovery_error=None, wait_result=None,
                  heartbeat=_no_heartbeat, write_event=lambda name, data: events.append((name, data)))
    for write in (ctx.write_event, ctx.append):
        with pytest.raises(UndeclaredNameError, match="Nowhere"):
            write(Stream("Nowhere", int), 1)
    assert events == [] and ctx.writes.appends == []


async def _no_heartbeat(_checkpoint: str | None) -> None:
    pass


def test_an_rpc_reading_what_it_did_not_load_is_told_to_load_it_for_the_rpc() -> None:
    """The advice names the RPC's own load options and ctx.load, not a Step's load options (an RPC
    is no Step; its Flow's Steps' options do not change what it loads)."""
    ctx = RpcContext(FLOW, "f1", {}, LoadOptions.only(Names["a"]), {}, "page")
    advice = r"was not loaded for RPC 'page'; add it to the RPC's load options \(rpc\(load=\.\.\.\)\) or load it first"
    with pytest.raises(NotLoadedError, match=r"attribute 'Points\[b\]' " + advice):
        ctx.get(Points["b"])
    with pytest.raises(NotLoadedError, match=r"attribute 'Points' " + advice):
        ctx.items(Points)


async def test_a_read_after_a_delete_sees_the_delete_and_a_load_of_a_loaded_map_asks_nothing() -> None:
    """get after this method's delete is unset (not the stored value); ctx.load of a map the RPC
    loaded whole by name reads nothing again (a second read could see a later state)."""
    asked: list[LoadSpec] = []

    async def load_more(spec: LoadSpec) -> dict[tuple[str, str], bytes]:
        asked.append(spec)
        return {}

    ctx = RpcContext(FLOW, "f1", dict([stored(Points, "a", Point(1))]), LoadOptions.only(Points), {}, "page",
                     load_more=load_more)
    ctx.delete(Points["a"])
    assert ctx.get(Points["a"]) is None and ctx.get(Points["a"], Point(0)) == Point(0)
    await ctx.load(Points, Points["b"])
    assert asked == []
