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
    Attribute,
    AttributeMap,
    Channel,
    ChannelMap,
    Context,
    Flow,
    FlowDefinitionError,
    InvalidIdError,
    LoadOptions,
    MovementOptions,
    Registry,
    RpcContext,
    Step,
    StepDecision,
    StepOptions,
    Stream,
    WorkerOptions,
    rpc,
)
from dex_engine._limits import MAX_CONCURRENT_TASKS

from .conftest import engine_for

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


