"""Options, names and decisions of the wrong kind are refused when made, naming the field and value.

Each of these was accepted once and failed later, inside the engine, with an error that named
neither (or, for a retry policy that was not one, ran a Step again without end).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import pytest

from dex_engine import (
    AsyncWorker,
    Attribute,
    AttributeMap,
    Channel,
    ChannelMap,
    Context,
    Flow,
    FlowDefinitionError,
    InvalidIdError,
    InvalidValueError,
    LoadOptions,
    MovementOptions,
    Registry,
    RetryPolicy,
    Rpc,
    RpcContext,
    RPCResult,
    Step,
    StepDecision,
    StepOptions,
    Stream,
    WorkerOptions,
    rpc,
)
from dex_engine._decision import Movement
from dex_engine._limits import MAX_CONCURRENT_TASKS

from .conftest import engine_for
from .odd_values import NO_REPR_VALUES, UNSHOWABLE_SHOWN, Unshowable, assert_refused_naming
from .test_bad_inputs import refused

Note = Attribute("Note", str)
Tags = AttributeMap("Tags", str)


async def done(ctx: Context, _: None) -> StepDecision:
    return StepDecision.graceful_complete("done")


async def park(ctx: Context, _: None) -> StepDecision:
    return StepDecision.dead_end()


# A: StepOptions and MovementOptions ----------------------------------------------------------


@pytest.mark.parametrize("field_name", ["execute_retry", "wait_for_retry"])
@pytest.mark.parametrize("value", [None, 3, {"max_attempts": 2}], ids=["none", "int", "dict"])
def test_step_options_refuse_a_retry_that_is_not_a_retry_policy(field_name: str, value: Any) -> None:
    """Catches: StepOptions(execute_retry=None) (or 3) accepted; the first failed attempt then could
    not be ended (decide_retry on None), was handed back and ran again without end."""
    with pytest.raises(FlowDefinitionError) as caught:
        StepOptions(**{field_name: value})
    assert str(caught.value).startswith(f"{field_name} must be a RetryPolicy, got {value!r}")
    assert "RetryPolicy(max_attempts=1)" in str(caught.value)


@pytest.mark.parametrize("make", [StepOptions, MovementOptions])
@pytest.mark.parametrize("field_name", ["load", "execute_load", "wait_for_load"])
@pytest.mark.parametrize("value", ["all", [Note], Note], ids=["text", "list", "attribute"])
def test_options_refuse_a_load_that_is_not_a_load_spec(
    make: Callable[..., object], field_name: str, value: Any
) -> None:
    """Catches: load="all" or load=[attr] accepted, failing later with AttributeError or TypeError
    at start_flow or at a commit."""
    with pytest.raises(FlowDefinitionError) as caught:
        make(**{field_name: value})
    assert str(caught.value).startswith(f"{field_name} must be LoadOptions.all(), LoadOptions.none() or "
                                        "LoadOptions.only(...)")
    assert str(caught.value).endswith(f"got {value!r}")


def test_a_step_load_of_none_is_refused() -> None:
    """A Step's `load` has no "keep" to fall back on (only the overrides do), so None is refused as
    not a load spec. Catches: None taken, stored as the task's load, and failing at scheduling."""
    with pytest.raises(FlowDefinitionError, match=r"^load must be LoadOptions\.all\(\), LoadOptions\.none\(\) or "
                                                   r"LoadOptions\.only\(\.\.\.\), got None$"):
        StepOptions(load=None)  # type: ignore[arg-type]


def test_the_optional_loads_may_be_none_and_load_specs_are_taken() -> None:
    """None keeps the Step's own load for the optional fields; a LoadSpec is taken as given."""
    only = LoadOptions.only(Note)
    assert StepOptions(load=only, execute_load=None, wait_for_load=LoadOptions.none()).load == only
    assert MovementOptions(load=None, execute_load=only).execute_load == only


@pytest.mark.parametrize("field_name", ["execute_locks", "wait_for_locks"])
@pytest.mark.parametrize(
    ("value", "named"),
    [
        pytest.param(Note, "got the single item Attribute(name='Note'", id="one-attribute"),
        pytest.param(Tags, "got the single item AttributeMap('Tags'); give it as a tuple", id="one-map"),
        pytest.param(Tags["k"], "got the single item AttributeRef(name='Tags', key='k'", id="one-instance"),
        pytest.param("Note", "must be a collection of Attributes, AttributeMaps or map instances, got 'Note'",
                     id="text"),
        pytest.param(5, "must be a collection of Attributes, AttributeMaps or map instances, got 5", id="int"),
        pytest.param(("Note",), "holds 'Note', which is not an Attribute, AttributeMap or map instance",
                     id="names"),
    ],
)
def test_step_options_refuse_a_lock_set_that_is_not_one(field_name: str, value: Any, named: str) -> None:
    """Catches: one Attribute given as execute_locks failing Flow() with a bare TypeError ('Attribute'
    object is not iterable), and a map given alone iterated by its keys 0, 1, ..."""
    with pytest.raises(FlowDefinitionError) as caught:
        StepOptions(**{field_name: value})
    assert str(caught.value).startswith(field_name)
    assert named in str(caught.value)


def test_a_lock_set_given_as_a_list_is_taken_as_a_tuple() -> None:
    """Any iterable of lock items is a lock set; it is kept as a tuple so the options stay hashable."""
    options = StepOptions(execute_locks=[Note, Tags["k"]])  # type: ignore[arg-type]
    assert options.execute_locks == (Note, Tags["k"])
    hash(options)
    Flow("Locks", [Step("S", done, options=options)], start_step="S", schema=[Note, Tags])


DONE_STEP = Step("S", done)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        pytest.param(lambda: Flow("F", DONE_STEP), "flow 'F' steps must be a collection of Steps, got the single "
                     "item Step('S'); give it in a list: [Step('S')]", id="one-step"),
        pytest.param(lambda: Flow("F", None), "flow 'F' steps must be a collection of Steps, got NoneType: None",
                     id="steps-none"),
        pytest.param(lambda: Flow("F", "S"), "flow 'F' steps must be a collection of Steps, got str: 'S'",
                     id="steps-text"),
        pytest.param(lambda: Flow("F", [DONE_STEP, 5]), "flow type 'F' has 1 problem(s): steps holds 5, which is "
                     "not a Step", id="steps-item"),
        pytest.param(lambda: Flow("F", [DONE_STEP], schema=Note), "flow 'F' schema must be a collection of "
                     "Attributes, AttributeMaps, Channels, ChannelMaps and Streams, got the single item "
                     "Attribute(name='Note'", id="one-schema-item"),
        pytest.param(lambda: Flow("F", [DONE_STEP], schema={"Note": Note}), "flow 'F' schema must be a collection "
                     "of Attributes, AttributeMaps, Channels, ChannelMaps and Streams, got dict: {'Note': ",
                     id="schema-dict"),
        pytest.param(lambda: Flow("F", [DONE_STEP], rpcs=None), "flow 'F' rpcs must be a collection of RPCs, got "
                     "NoneType: None", id="rpcs-none"),
        pytest.param(lambda: Registry(Flow("F", [DONE_STEP])), "invalid Registry: flows must be a collection of "
                     "Flows, got the single item", id="one-flow"),
        pytest.param(lambda: Registry(None), "invalid Registry: flows must be a collection of Flows, got "
                     "NoneType: None", id="registry-none"),
    ],
)
def test_a_definition_refuses_a_collection_that_is_not_one(make: Callable[[], object], message: str) -> None:
    """Catches: Flow("F", step), schema=Note or Registry(flow) failing with a bare TypeError ('Step'
    object is not iterable), a non-Step in steps with an AttributeError (no attribute 'step_type'),
    and text taken letter by letter."""
    with pytest.raises(FlowDefinitionError) as caught:
        make()
    assert str(caught.value).startswith(message)


async def _answer(ctx: RpcContext, _: None) -> str:
    return "ok"


@pytest.mark.parametrize(
    ("made", "message"),
    [
        pytest.param(Rpc("", _answer), "RPC name is empty; give a non-empty RPC name", id="empty-name"),
        pytest.param(Rpc("ask me", _answer), "RPC name 'ask me' contains whitespace", id="spaced-name"),
        pytest.param(Rpc(None, _answer), "RPC name must be a string, got NoneType: None",  # type: ignore[arg-type]
                     id="no-name"),
        pytest.param(Rpc("ask", _answer, locks="Note"),  # type: ignore[arg-type]
                     "RPC 'ask' locks must be a tuple of attribute names; declare it with @rpc(locks=...), got 'Note'",
                     id="locks-text"),
    ],
)
def test_a_flow_refuses_an_rpc_made_without_the_decorator_that_cannot_work(made: Rpc, message: str) -> None:
    """Catches: an Rpc made directly with a name no client call can give accepted (the RPC never
    reachable), and its locks given as text checked letter by letter ("locks 'N', which is not a
    declared attribute")."""
    with pytest.raises(FlowDefinitionError) as caught:
        Flow("F", [DONE_STEP], schema=[Note], rpcs=[made])
    assert str(caught.value).startswith(f"flow type 'F' has 1 problem(s): {message}")


def test_a_definition_takes_any_iterable_of_its_items() -> None:
    """A tuple or a generator is as good as a list."""
    flow = Flow("F", (s for s in [DONE_STEP]), start_step="S", schema=(Note, Tags))
    assert list(flow.steps) == ["S"] and set(flow.attributes) == {"Note", "Tags"}
    assert list(Registry((flow,)).flows) == ["F"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param({"locks": Note}, "RPC 'handler' locks must be a collection of Attributes, AttributeMaps or map "
                     "instances, got the single item", id="one-lock"),
        pytest.param({"load": "all"}, "RPC 'handler' load must be LoadOptions.all(), LoadOptions.none() or "
                     "LoadOptions.only(...) or None, got 'all'", id="load-text"),
    ],
)
def test_rpc_refuses_a_lock_set_or_load_of_the_wrong_kind(kwargs: dict[str, Any], message: str) -> None:
    """Catches: @rpc(locks=Note) failing with a bare TypeError, and @rpc(load="all") accepted."""

    async def handler(ctx: RpcContext, _: None) -> None:
        return None

    with pytest.raises(FlowDefinitionError) as caught:
        rpc(**kwargs)(handler)
    assert str(caught.value).startswith(message)


# B: WorkerOptions.max_concurrent_tasks ---------------------------------------------------------


@pytest.mark.parametrize("tasks", [sys.maxsize, 2**63, 10**30, MAX_CONCURRENT_TASKS + 1])
def test_worker_options_refuse_more_concurrent_tasks_than_the_limit(tasks: int) -> None:
    """Catches: max_concurrent_tasks=sys.maxsize accepted; every poll then failed with OverflowError
    (the claim binds capacity * CLAIM_ROWS_PER_SLOT) and the worker never ran a Step."""
    with pytest.raises(ValueError) as caught:
        WorkerOptions(max_concurrent_tasks=tasks)
    assert (f"max_concurrent_tasks must be a whole number from 1 to {MAX_CONCURRENT_TASKS}, got {tasks!r}"
            in str(caught.value))


async def test_a_worker_at_the_concurrent_task_limit_runs_steps(db_url: str) -> None:
    """The largest capacity accepted is one a worker can claim with on either backend."""
    registry = Registry([Flow("Once", [Step("S", done)], start_step="S")])
    async with engine_for(db_url, registry, worker=False) as eng:
        await eng.start_worker(max_concurrent_tasks=MAX_CONCURRENT_TASKS)
        await eng.client.start_flow("Once", "f")
        assert (await eng.client.wait_for_flow("f", 10)).status == "completed"


# C: '[' and ']' in schema names ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "kind"),
    [
        pytest.param(lambda name: Attribute(name, str), "attribute name", id="attribute"),
        pytest.param(lambda name: AttributeMap(name, str), "attribute map name", id="attribute-map"),
        pytest.param(lambda name: Channel(name, str), "channel name", id="channel"),
        pytest.param(lambda name: ChannelMap(name, str), "channel map name", id="channel-map"),
        pytest.param(lambda name: Stream(name, str), "stream name", id="stream"),
    ],
)
@pytest.mark.parametrize(("name", "char"), [("Cfg[v2]", "["), ("Cfg]", "]")])
def test_schema_names_refuse_the_brackets_of_a_map_instance(
    make: Callable[[str], object], kind: str, name: str, char: str
) -> None:
    """Catches: Attribute("Cfg[v2]", str) accepted, though locking it failed ("not a declared
    attribute") and its lock name was that of instance "v2" of a map "Cfg"."""
    with pytest.raises(InvalidIdError) as caught:
        make(name)
    assert str(caught.value) == (f"{kind} {name!r} contains reserved character {char!r}; it marks a map "
                                 "instance's key, as in 'Name[key]'")


def test_keys_step_types_and_flow_ids_may_still_hold_brackets() -> None:
    """Only schema names are set apart from keys by brackets: a key with them makes a label no plain
    name can have, and Step types, RPC names and flow IDs never share a label with a key."""
    assert Tags["a[b]"].label == "Tags[a[b]]"
    flow = Flow("Flow[1]", [Step("Step[1]", done, options=StepOptions(execute_locks=(Tags["a[b]"],)))],
                start_step="Step[1]", schema=[Tags])
    assert flow.steps["Step[1]"].options.execute_locks == (Tags["a[b]"],)


# D: decisions and RPC results ------------------------------------------------------------------


@pytest.mark.parametrize("reason", [42, None, {"a": 1}], ids=["int", "none", "dict"])
def test_force_fail_refuses_a_reason_that_is_not_text(reason: Any) -> None:
    """Catches: force_fail(42) failing its attempt with "'int' object is not subscriptable" (and
    force_fail(None) failing the flow with no error at all)."""
    with pytest.raises(InvalidValueError) as caught:
        StepDecision.force_fail(reason)
    assert str(caught.value) == (f"a StepDecision's reason (force_fail's) must be a str, got "
                                 f"{type(reason).__name__}: {reason!r}; give the reason as text")


@pytest.mark.parametrize(
    ("make", "message"),
    [
        pytest.param(lambda: StepDecision.dead_end().with_canceling_steps(5),  # type: ignore[arg-type]
                     "with_canceling_steps must be a Step or a Step type's name, got int: 5", id="cancel-int"),
        pytest.param(lambda: StepDecision.go_to_many(("End",), "End"),  # type: ignore[arg-type]
                     "go_to_many holds 'End', which is neither a Movement nor a (step, input)", id="many-text"),
        pytest.param(lambda: StepDecision.go_to("End", None, "fast"),  # type: ignore[arg-type]
                     "a Movement's options must be MovementOptions or None, got str: 'fast'", id="options-text"),
        pytest.param(lambda: StepDecision.go_to("End", None, StepOptions()),  # type: ignore[arg-type]
                     "a Movement's options must be MovementOptions or None, got StepOptions", id="options-step"),
        pytest.param(lambda: Movement(5),  # type: ignore[arg-type]
                     "a Movement's step must be a Step or a Step type's name, got int: 5", id="movement-step"),
        pytest.param(lambda: RPCResult("out", next_steps=Movement("End")),  # type: ignore[arg-type]
                     "RPCResult next_steps must be a collection of Movements or (step, input) tuples, got "
                     "Movement(step='End'", id="rpc-one-movement"),
        pytest.param(lambda: RPCResult("out", canceling_steps=(5,)),  # type: ignore[arg-type]
                     "RPCResult canceling_steps must be a Step or a Step type's name, got int: 5", id="rpc-cancel-int"),
        pytest.param(lambda: RPCResult("out", canceling_steps=5),  # type: ignore[arg-type]
                     "RPCResult canceling_steps must be Steps or Step type names, got int: 5", id="rpc-cancel-one-int"),
        pytest.param(lambda: RPCResult("out", next_steps="End"),  # type: ignore[arg-type]
                     "RPCResult next_steps must be a collection of Movements or (step, input) tuples, got 'End'",
                     id="rpc-next-text"),
        pytest.param(lambda: StepDecision.go_to_many(()),  # type: ignore[arg-type]
                     "go_to_many holds (), which is neither a Movement nor a (step, input)", id="many-empty-tuple"),
        pytest.param(lambda: StepDecision.go_to_many(("End", None, None, None)),  # type: ignore[arg-type]
                     "go_to_many holds ('End', None, None, None), which is neither", id="many-four-tuple"),
        pytest.param(lambda: StepDecision.go_to_many(["End", None]),  # type: ignore[arg-type]
                     "go_to_many holds ['End', None], which is neither", id="many-list"),
        pytest.param(lambda: StepDecision("movements", ("End",)),  # type: ignore[arg-type]
                     "StepDecision movements holds 'End', which is neither", id="decision-made-directly"),
    ],
)
def test_decisions_refuse_arguments_of_the_wrong_kind(make: Callable[[], object], message: str) -> None:
    """Catches: these failing later, inside the engine, with AttributeError ('int' object has no
    attribute 'step_type', 'str' object has no attribute 'load'), with a Step 'E' nobody declared
    (the text "End" taken as a (step, input, options) tuple), or StepOptions silently taken as a
    movement's options."""
    with pytest.raises(InvalidValueError) as caught:
        make()
    assert str(caught.value).startswith(message)


def test_an_rpc_result_takes_one_name_whole_and_step_input_tuples() -> None:
    """Catches: canceling_steps="Park" read as the Step types 'P', 'a', 'r', 'k', and next_steps of
    (step, input) tuples (which go_to_many takes) failing with "'tuple' object has no attribute
    'step_type'"."""
    result = RPCResult("out", next_steps=(("Park", None),), canceling_steps="Park")  # type: ignore[arg-type]
    assert result.next_steps == (Movement("Park", None),)
    assert result.canceling_steps == ("Park",)
    decision = StepDecision("dead_end", canceling_steps="Park")  # type: ignore[arg-type]
    assert decision.canceling_steps == ("Park",)


def test_decisions_take_step_objects_options_tuples_and_chained_cancellations() -> None:
    """Catches: a Step object read by any attribute but step_type (no other test passes one), a
    (step, input, options) tuple refused or its options dropped, a StepDecision made directly
    keeping its tuples, a second with_canceling_steps dropping the first's names, and
    ending_retry_waits given one name read as its characters."""
    parked = Step("Park", park)
    options = MovementOptions(execute_timeout_seconds=5.0)
    assert Movement(parked, 1).step_type == "Park"
    assert StepDecision.go_to(parked, 1, options).movements == (Movement(parked, 1, options),)
    assert StepDecision.go_to_many((parked, 1, options), ("End", 2)).movements == (
        Movement(parked, 1, options), Movement("End", 2))
    assert StepDecision("movements", (("End", 2),)).movements == (Movement("End", 2),)  # type: ignore[arg-type]
    decision = StepDecision.dead_end().with_canceling_steps("A").with_canceling_steps(parked, "B")
    assert decision.canceling_steps == ("A", "Park", "B")
    result = RPCResult("out", next_steps=[(parked, None, options)], canceling_steps=[parked],
                       ending_retry_waits="Park")  # type: ignore[arg-type]
    assert result.next_steps == (Movement(parked, None, options),)
    assert (result.canceling_steps, result.ending_retry_waits) == (("Park",), ("Park",))
    assert RPCResult("out", ending_retry_waits=[parked, "End"]).ending_retry_waits == ("Park", "End")
    # The failure route's error starts with it when the RPC gives none: never an empty reason.
    assert RPCResult("out").ending_reason == "ended while waiting to retry"


def test_one_step_given_alone_is_taken_whole_as_one_name_is() -> None:
    """Catches: canceling_steps=ParkStep (or ending_retry_waits) refused with "must be Steps or Step
    type names, got Step: Step('Park')", an error that names what it asks for, though the name
    "Park" given alone was taken."""
    parked = Step("Park", park)
    result = RPCResult("out", canceling_steps=parked, ending_retry_waits=parked)  # type: ignore[arg-type]
    assert (result.canceling_steps, result.ending_retry_waits) == (("Park",), ("Park",))
    assert StepDecision("dead_end", canceling_steps=parked).canceling_steps == ("Park",)  # type: ignore[arg-type]

@rpc()
async def cancel_as_text(ctx: RpcContext, _: None) -> RPCResult[str]:
    return RPCResult("out", canceling_steps="Park")  # type: ignore[arg-type]


@rpc()
async def next_as_tuple(ctx: RpcContext, _: None) -> RPCResult[str]:
    return RPCResult("out", next_steps=(("Park", None),))  # type: ignore[arg-type]


RPC_FLOW = Flow("Rpcs", [Step("Start", park), Step("Park", park)], start_step="Start",
                rpcs=[cancel_as_text, next_as_tuple])


async def test_an_rpc_result_with_a_name_or_a_tuple_starts_and_cancels_those_steps(db_url: str) -> None:
    """End to end, with no worker: the (step, input) tuple schedules Park; the name "Park" given
    alone cancels it (not Steps 'P', 'a', 'r', 'k', which failed the RPC as undeclared)."""
    async with engine_for(db_url, Registry([RPC_FLOW]), worker=False) as eng:
        c = eng.client
        await c.start_flow("Rpcs", "f")
        assert await c.rpc("f", "next_as_tuple") == "out"
        active = [s.step_execution_id for s in (await c.describe_flow("f")).active_steps]
        assert sorted(active) == ["Park-1", "Start-1"]
        assert await c.rpc("f", "cancel_as_text") == "out"
        assert [s.step_execution_id for s in (await c.describe_flow("f")).active_steps] == ["Start-1"]


@pytest.mark.parametrize("reason", [42, b"stop"], ids=["int", "bytes"])
async def test_stop_flow_refuses_a_reason_that_is_not_text(db_url: str, reason: Any) -> None:
    """Catches: stop_flow(flow_id, 42) refused with "'int' object is not subscriptable", which named
    neither the reason nor its value. The flow is left as it was."""
    async with engine_for(db_url, Registry([RPC_FLOW]), worker=False) as eng:
        await eng.client.start_flow("Rpcs", "f")
        await refused(eng.store, lambda: eng.client.stop_flow("f", reason), InvalidValueError,
                      "stop_flow's reason", f"got {type(reason).__name__}: {reason!r}")
        assert (await eng.client.describe_flow("f")).status == "running"


# Loads of undeclared attributes, and Step options that are not StepOptions -----------------------


def test_a_flow_refuses_a_load_of_an_attribute_it_does_not_declare() -> None:
    """Catches: a typo in LoadOptions.only accepted, loading nothing, and seen only when a handler
    read the real name (NotLoadedError, or a value that seemed unset)."""

    @rpc(load=LoadOptions.only(Attribute("Nope", str)))
    async def reads(ctx: RpcContext, _: None) -> None:
        return None

    with pytest.raises(FlowDefinitionError) as refused_flow:
        Flow("Loads", [
            Step("S", done, options=StepOptions(load=LoadOptions.only(Note, Attribute("Notes", str)))),
            Step("T", done, options=StepOptions(
                wait_for_load=LoadOptions.only(AttributeMap("Tag", str)["k"], AttributeMap("Tag", str)["j"]))),
        ], start_step="S", schema=[Note, Tags], rpcs=[reads])
    text = str(refused_flow.value)
    assert "Step 'S' load loads 'Notes', which is not a declared attribute" in text
    assert "Step 'T' wait_for_load loads 'Tag', which is not a declared attribute" in text
    assert text.count("loads 'Tag'") == 1  # two instances of one undeclared map: named once
    assert "RPC 'reads' load loads 'Nope', which is not a declared attribute" in text
    Flow("Loads", [Step("S", done, options=StepOptions(load=LoadOptions.only(Note, Tags["k"])))],
         start_step="S", schema=[Note, Tags])


def test_a_flow_refuses_step_options_that_are_not_step_options() -> None:
    """Catches: an AttributeError ('dict' object has no attribute 'failure_route') naming neither."""
    with pytest.raises(FlowDefinitionError, match=r"Step 'S' options must be StepOptions, got dict: \{'load'"):
        Flow("Opts", [Step("S", done, options={"load": None})], start_step="S")  # type: ignore[arg-type]


# A value with no repr -------------------------------------------------------------------------


def _flow_with(*steps: Step[Any], schema: tuple[Any, ...] = (), rpcs: tuple[Any, ...] = ()) -> Flow:
    return Flow("F", [Step("a", done), *steps], schema=schema, rpcs=rpcs)


async def _handle(ctx: RpcContext, _: None) -> None:
    return None


# (label, build with the bad value, the error raised, text the message holds). Where any whole
# number is taken (max_attempts, capacity_bytes), `huge` is made negative to be refused.
_NO_REPR_DECLARATIONS: list[tuple[str, Callable[[Any], object], type[Exception], str]] = [
    *((f"StepOptions.{name}", lambda bad, name=name: StepOptions(**{name: bad}), FlowDefinitionError, name)
      for name in ("execute_retry", "wait_for_retry", "load", "execute_load", "wait_for_load", "execute_locks",
                   "wait_for_locks", "execute_timeout_seconds", "wait_for_timeout_seconds",
                   "heartbeat_timeout_seconds", "durability")),
    ("StepOptions.execute_locks item", lambda bad: StepOptions(execute_locks=(bad,)), FlowDefinitionError,
     "execute_locks holds"),
    *((f"MovementOptions.{name}", lambda bad, name=name: MovementOptions(**{name: bad}), FlowDefinitionError, name)
      for name in ("execute_retry", "load", "execute_timeout_seconds", "durability")),
    ("LoadOptions.only", LoadOptions.only, FlowDefinitionError, "load option"),
    ("RetryPolicy.max_attempts", lambda bad: RetryPolicy(max_attempts=-abs(bad) if isinstance(bad, int) else bad),
     FlowDefinitionError, "max_attempts"),
    *((f"RetryPolicy.{name}", lambda bad, name=name: RetryPolicy(**{name: bad}), FlowDefinitionError, name)
      for name in ("initial_interval_seconds", "backoff_coefficient", "max_interval_seconds",
                   "total_duration_seconds")),
    ("Stream capacity", lambda bad: Stream("s", str, -abs(bad) if isinstance(bad, int) else bad), ValueError,
     "capacity"),
    ("Attribute value type", lambda bad: _flow_with(schema=(Attribute("n", bad),)), FlowDefinitionError,
     "Attribute 'n' value type"),
    ("schema item", lambda bad: _flow_with(schema=(bad,)), FlowDefinitionError, "schema item"),
    ("Step input type", lambda bad: _flow_with(Step("b", done, input_type=bad)), FlowDefinitionError,
     "Step 'b' input type"),
    ("Step execute", lambda bad: _flow_with(Step("b", bad)), FlowDefinitionError, "Step 'b' execute"),
    ("Step wait_for", lambda bad: _flow_with(Step("b", done, wait_for=bad)), FlowDefinitionError,
     "Step 'b' wait_for"),
    ("Step options", lambda bad: _flow_with(Step("b", done, options=bad)), FlowDefinitionError,
     "Step 'b' options"),
    ("Step pure_execute", lambda bad: _flow_with(Step("b", done, pure_execute=bad)), FlowDefinitionError,
     "Step 'b' pure_execute"),
    ("Step pure_until_heartbeat", lambda bad: _flow_with(Step("b", done, pure_until_heartbeat=bad)),
     FlowDefinitionError, "Step 'b' pure_until_heartbeat"),
    ("Step failure route", lambda bad: _flow_with(Step("b", done, options=StepOptions(failure_route=bad))),
     FlowDefinitionError, "Step 'b' failure route"),
    ("rpc name", lambda bad: rpc(bad)(_handle), InvalidIdError, "RPC name"),
    ("rpc load", lambda bad: rpc("r", load=bad)(_handle), FlowDefinitionError, "RPC 'r' load"),
    ("rpc locks", lambda bad: rpc("r", locks=bad)(_handle), FlowDefinitionError, "RPC 'r' locks"),
    ("rpc handler", lambda bad: _flow_with(rpcs=(rpc("r")(bad),)), FlowDefinitionError, "RPC 'r' must be"),
    ("rpc request type", lambda bad: _flow_with(rpcs=(rpc("r", request_type=bad)(_handle),)),
     FlowDefinitionError, "RPC 'r' request type"),
    ("Flow rpcs item", lambda bad: _flow_with(rpcs=(bad,)), FlowDefinitionError, "is not decorated with @rpc"),
    ("Registry item", lambda bad: Registry([bad]), FlowDefinitionError, "is not a Flow"),
    *((f"WorkerOptions.{name}", lambda bad, name=name: WorkerOptions(**{name: bad}), ValueError, name)
      for name in ("database_url", "max_concurrent_tasks", "lease_ttl_seconds", "lease_renew_seconds",
                   "housekeeping_seconds", "poll_seconds", "shutdown_grace_seconds",
                   "closed_flow_retention_seconds")),
    ("WorkerOptions.worker_id", lambda bad: WorkerOptions(worker_id=bad), ValueError, "worker ID"),
    ("AsyncWorker registry", AsyncWorker, TypeError, "AsyncWorker takes a Registry"),
    ("AsyncWorker options", lambda bad: AsyncWorker(Registry([_flow_with()]), bad), TypeError,
     "AsyncWorker's options must be WorkerOptions"),
]


@pytest.mark.parametrize("bad", NO_REPR_VALUES)
@pytest.mark.parametrize(("build", "error", "text"), [case[1:] for case in _NO_REPR_DECLARATIONS],
                         ids=[case[0] for case in _NO_REPR_DECLARATIONS])
def test_a_declaration_given_a_value_with_no_repr_raises_its_own_error(
    bad: Any, build: Callable[[Any], object], error: type[Exception], text: str
) -> None:
    """A declaration given a value whose repr cannot be made (an int of over 4,300 digits, an object
    whose __repr__ raises) in a checked field raises its own error naming the field, with the value
    shown as far as it can be. Catches: building that error's text raising Python's ValueError
    ("Exceeds the limit (4300 digits) for integer string conversion") or the object's own error."""
    message = assert_refused_naming(build, bad, error, text)
    if isinstance(bad, Unshowable):
        assert UNSHOWABLE_SHOWN in message, message


@pytest.mark.parametrize(("build", "message"), [
    (lambda: Flow("F", [Step("a", done)], start_step=1),  # type: ignore[arg-type]
     r"flow 'F': start_step must be a Step, its Step type \(str\) or None, got int: 1"),
    (lambda: rpc()(1),  # type: ignore[arg-type]
     r"RPC 1 must be an async function, got 1"),
    (lambda: Flow("F", [Step("a", done, options=StepOptions(failure_route=["x"]))],  # type: ignore[arg-type]
                  start_step="a"),
     r"Step 'a' failure route \['x'\] is not one of the flow's Steps"),
    (lambda: MovementOptions(failure_route=["x"]),  # type: ignore[arg-type]
     r"MovementOptions failure_route must be a Step type \(str\) or None, got list: \['x'\]"),
    (lambda: RetryPolicy(max_attempts=2**64),
     r"max_attempts must be a whole number from 1 to 9223372036854775807, got 18446744073709551616"),
])
def test_a_declaration_of_the_wrong_kind_is_refused_naming_it(build: Callable[[], object], message: str) -> None:
    """Catches: AttributeError ('int' object has no attribute 'step_type' / '__name__'), a bare
    'unhashable type: list', and a retry policy too large to store accepted, then failing every commit
    that schedules its Step."""
    with pytest.raises(FlowDefinitionError, match=message):
        build()


def test_a_stream_capacity_too_large_to_store_is_refused() -> None:
    """Catches: a capacity bound to every append's statement that neither backend takes."""
    with pytest.raises(ValueError, match=r"stream 's' capacity must be .* at most 9223372036854775807, "
                                         r"got 18446744073709551616"):
        Stream("s", str, 2**64)
