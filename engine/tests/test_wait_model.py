"""Wait selection and channel consumption (E5) against a plain-Python reference model.

The model below is written from ENGINE.md E5 alone, not from the engine's code:
- any_of: a fired timer wins over every channel; otherwise channels are tried in argument order and
  the first one with enough messages wins; only the winner consumes.
- all_of: satisfied only when every condition is satisfied at one evaluation; then every channel
  condition consumes, conditions on the same instance sharing its queue in argument order.
- at_most(n) never blocks (an empty queue satisfies it) and takes up to n; at_least(n) takes all.
- for_one = exactly 1, for_n(n) = exactly n, for_range(a, b) = at least a, up to b.
- Queues are FIFO; ChannelMap instances are independent queues; a message goes to exactly one wait.

Part (a) checks the pure `select_wait` against the model. Part (b) drives the real store of each
backend (publish, register a wait, skip a timer, move the clock, evaluate, housekeeping) and
compares its tables with the model after every step. The model evaluates every wait of the flow at
each step; the store reads only the waits a step can have changed, so a wait it failed to read shows
as a difference.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar
from unittest import mock

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from dex_engine import (
    Channel,
    ChannelMap,
    Context,
    Flow,
    Movement,
    Step,
    StepDecision,
    StepNotWaitingError,
    Timer,
    Wait,
    open_store,
)
from dex_engine import _transitions as tx
from dex_engine._codec import encode_json
from dex_engine._context import WaitResult
from dex_engine._limits import MOST_PUBLISHED_INSTANCES_NAMED
from dex_engine._options import FlowConfig
from dex_engine._records import ConsumedMessage, StartRequest, WaitOutcome, WriteSet
from dex_engine._scheduling import movement_record, start_record
from dex_engine._store import now_ms
from dex_engine._wait import Condition, ConditionSpec, WaitSpec
from dex_engine._wait_selection import select_wait

T = TypeVar("T")

# Channel instances: a plain Channel and three instances of one ChannelMap. The third key starts
# with the first and holds what JSON escapes (a key holds no control character), as the store finds
# a wait's instances in its stored JSON (evaluate_waits).
Plain = Channel("Plain", int)
Keyed = ChannelMap("Keyed", int)
Ident = tuple[str, str]  # (channel name, key); key '' for a plain Channel
INSTANCES: tuple[Ident, ...] = (("Plain", ""), ("Keyed", "x"), ("Keyed", "y"), ("Keyed", 'x"\\\u00e9'))
HOUR = 3600  # a timer that never comes due during a test; only skip_timer fires it


# The reference model ------------------------------------------------------------------------


@dataclass(frozen=True)
class MCond:
    """One authored condition as the model sees it."""

    kind: str  # the authoring call: for_one, for_n, at_least, at_most, for_range, or timer
    args: tuple[int, ...]
    ident: Ident | None  # None: a timer
    at_least: int = 0
    at_most: int | None = None  # None: no upper bound (takes everything)
    seconds: int = 0


@dataclass(frozen=True)
class MWait:
    mode: Literal["any", "all", "skip"]
    conds: tuple[MCond, ...]


@dataclass(frozen=True)
class MOutcome:
    satisfied: tuple[int, ...]
    consumed: tuple[tuple[int, ...], ...]  # message IDs, aligned with the conditions
    fired_timers: tuple[int, ...]
    skipped: bool


def model_select(wait: MWait, queues: dict[Ident, list[int]], fired: set[int]) -> MOutcome | None:
    """What E5 says the wait takes now, or None when it keeps waiting."""
    n = len(wait.conds)
    nothing: list[tuple[int, ...]] = [() for _ in range(n)]
    if wait.mode == "skip":
        return MOutcome((), (), (), True)
    timers = [i for i, c in enumerate(wait.conds) if c.ident is None]
    fired_timers = tuple(i for i in timers if i in fired)
    if wait.mode == "any":
        if fired_timers:
            return MOutcome((fired_timers[0],), tuple(nothing), fired_timers, False)
        for i, c in enumerate(wait.conds):
            if c.ident is None:
                continue
            queue = queues.get(c.ident, [])
            if len(queue) >= c.at_least:
                taken = queue if c.at_most is None else queue[: c.at_most]
                nothing[i] = tuple(taken)
                return MOutcome((i,), tuple(nothing), (), False)
        return None
    # all_of: every timer fired and every channel condition satisfied from what is left of its
    # instance's queue after the earlier conditions on that instance took their share.
    if len(fired_timers) != len(timers):
        return None
    left = {ident: list(q) for ident, q in queues.items()}
    consumed: list[tuple[int, ...]] = []
    for c in wait.conds:
        if c.ident is None:
            consumed.append(())
            continue
        queue = left.setdefault(c.ident, [])
        if len(queue) < c.at_least:
            return None
        k = len(queue) if c.at_most is None else min(c.at_most, len(queue))
        consumed.append(tuple(queue[:k]))
        del queue[:k]
    return MOutcome(tuple(range(n)), tuple(consumed), fired_timers, False)


# Building the authored Wait from a model wait (through the public API) --------------------------


def _ref(ident: Ident) -> Any:
    return Plain if ident[0] == "Plain" else Keyed[ident[1]]


def authored(c: MCond) -> Condition:
    """The condition built with the public API call the model condition stands for."""
    if c.ident is None:
        return Timer.by_duration(c.seconds)
    result: Condition = getattr(_ref(c.ident), c.kind)(*c.args)
    return result


def authored_wait(w: MWait) -> Wait:
    if w.mode == "skip":
        return Wait.skip_immediately()
    conds = [authored(c) for c in w.conds]
    if w.mode == "all":
        return Wait.all_of(*conds)
    if len(conds) == 1:
        return Wait.until(conds[0])
    return Wait.any_of(*conds)


# Strategies -------------------------------------------------------------------------------


def _channel_cond(ident: Ident, kind: str, a: int, b: int) -> MCond:
    """The meaning of each authored channel condition, per ENGINE.md section 1 and E5."""
    if kind == "for_one":
        return MCond(kind, (), ident, 1, 1)
    if kind == "for_n":
        return MCond(kind, (b,), ident, b, b)
    if kind == "at_least":
        return MCond(kind, (a,), ident, a, None)
    if kind == "at_most":
        return MCond(kind, (b,), ident, 0, b)
    lo, hi = min(a, b), max(a, b)
    return MCond(kind, (lo, hi), ident, lo, hi)


channel_conds = st.builds(
    _channel_cond,
    st.sampled_from(INSTANCES),
    st.sampled_from(["for_one", "for_n", "at_least", "at_most", "for_range"]),
    st.integers(0, 3),
    st.integers(1, 3),
)


def timer_conds(seconds: st.SearchStrategy[int]) -> st.SearchStrategy[MCond]:
    return st.builds(lambda s: MCond("timer", (s,), None, seconds=s), seconds)


def model_waits(
    seconds: st.SearchStrategy[int], *, channel_weight: int = 2, max_conds: int = 4,
    mode_weights: tuple[int, int, int] = (1, 1, 1),
) -> st.SearchStrategy[MWait]:
    """Waits of any_of, all_of or skip_immediately, drawn with the given weights."""
    cond = st.one_of(*[channel_conds] * channel_weight, timer_conds(seconds))
    conds = st.lists(cond, min_size=1, max_size=max_conds).map(tuple)
    any_w, all_w, skip_w = mode_weights
    return st.one_of(
        *[st.builds(MWait, st.just("any"), conds)] * any_w,
        *[st.builds(MWait, st.just("all"), conds)] * all_w,
        *[st.just(MWait("skip", ()))] * skip_w,
    )


@st.composite
def queue_states(draw: st.DrawFn) -> dict[Ident, list[int]]:
    """Queued message IDs per instance: increasing IDs, interleaved across instances, with gaps."""
    owners = draw(st.lists(st.sampled_from(INSTANCES), max_size=10))
    gaps = draw(st.lists(st.integers(1, 3), min_size=len(owners), max_size=len(owners)))
    queues: dict[Ident, list[int]] = {}
    mid = 0
    for owner, gap in zip(owners, gaps, strict=True):
        mid += gap
        queues.setdefault(owner, []).append(mid)
    return queues


# (a) The pure selection function against the model ------------------------------------------


def _normalized(take: dict[int, list[int]]) -> dict[int, tuple[int, ...]]:
    # Whether a condition that took nothing appears in `take` is not part of the contract.
    return {i: tuple(ids) for i, ids in take.items() if ids}


@settings(max_examples=400, deadline=None)
@given(wait=model_waits(st.sampled_from([0, 5, HOUR])), queues=queue_states(), fired=st.sets(st.integers(0, 4)))
def test_select_wait_matches_model(wait: MWait, queues: dict[Ident, list[int]], fired: set[int]) -> None:
    """select_wait takes exactly what E5 says, for any wait, queue state and set of fired timers.

    `fired` may name channel conditions too; only timer indices may count.
    """
    spec = authored_wait(wait).spec()
    expected = model_select(wait, {k: list(v) for k, v in queues.items()}, fired)
    got = select_wait(spec, {k: tuple(v) for k, v in queues.items()}, frozenset(fired))
    context = f"wait {wait}, queues {queues}, fired {sorted(fired)}"
    if expected is None:
        assert got is None, f"{context}: engine selected {got}, model keeps waiting"
        return
    assert got is not None, f"{context}: engine keeps waiting, model selects {expected}"
    assert got.skipped == expected.skipped, context
    assert got.satisfied == expected.satisfied, context
    assert got.fired_timers == expected.fired_timers, context
    want_take = {i: ids for i, ids in enumerate(expected.consumed) if ids}
    assert _normalized(got.take) == want_take, context


def _spec(mode: Literal["any", "all"], *conds: MCond) -> MWait:
    return MWait(mode, conds)


TIMER = MCond("timer", (0,), None)
ONE_P = _channel_cond(("Plain", ""), "for_one", 0, 1)
ONE_X = _channel_cond(("Keyed", "x"), "for_one", 0, 1)
ALL_P = _channel_cond(("Plain", ""), "at_least", 1, 1)
MOST2_P = _channel_cond(("Plain", ""), "at_most", 0, 2)
TWO_P = _channel_cond(("Plain", ""), "for_n", 0, 2)


@pytest.mark.parametrize(
    ("wait", "queues", "fired", "expected"),
    [
        # A fired timer wins over a satisfiable channel named before it; nothing is consumed.
        (_spec("any", ONE_P, TIMER), {("Plain", ""): [1]}, {1}, MOutcome((1,), ((), ()), (1,), False)),
        # Channels in argument order: the first satisfiable one wins, only it consumes.
        (_spec("any", ONE_X, ONE_P), {("Plain", ""): [1], ("Keyed", "x"): [2]}, set(),
         MOutcome((0,), ((2,), ()), (), False)),
        # at_most never blocks: satisfied by an empty queue, taking nothing.
        (_spec("any", MOST2_P), {}, set(), MOutcome((0,), ((),), (), False)),
        # at_most(2) takes the two oldest of three.
        (_spec("any", MOST2_P), {("Plain", ""): [4, 7, 9]}, set(), MOutcome((0,), ((4, 7),), (), False)),
        # at_least(1) takes everything queued.
        (_spec("any", ALL_P), {("Plain", ""): [4, 7, 9]}, set(), MOutcome((0,), ((4, 7, 9),), (), False)),
        # all_of shares one instance's queue in argument order.
        (_spec("all", ONE_P, TWO_P), {("Plain", ""): [1, 2, 3]}, set(),
         MOutcome((0, 1), ((1,), (2, 3)), (), False)),
        # all_of needs every condition at once: two messages do not satisfy for_one + for_n(2).
        (_spec("all", ONE_P, TWO_P), {("Plain", ""): [1, 2]}, set(), None),
        # all_of: at_least(1) takes everything, so a later for_one on the same instance starves.
        (_spec("all", ALL_P, ONE_P), {("Plain", ""): [1, 2, 3]}, set(), None),
        # all_of waits for its timer even when the channels are satisfied.
        (_spec("all", ONE_P, TIMER), {("Plain", ""): [1]}, set(), None),
        # ChannelMap instances are independent: a message on x does not satisfy the plain channel.
        (_spec("any", ONE_P), {("Keyed", "x"): [1]}, set(), None),
    ],
)
def test_select_wait_examples(
    wait: MWait, queues: dict[Ident, list[int]], fired: set[int], expected: MOutcome | None
) -> None:
    """Pins the model and the engine on the E5 sentences, so both cannot share one misreading."""
    assert model_select(wait, queues, fired) == expected
    got = select_wait(authored_wait(wait).spec(), queues, frozenset(fired))
    if expected is None:
        assert got is None
        return
    assert got is not None
    assert (got.satisfied, got.fired_timers, got.skipped) == (expected.satisfied, expected.fired_timers, False)
    assert _normalized(got.take) == {i: ids for i, ids in enumerate(expected.consumed) if ids}


# (b) The real store against the model ---------------------------------------------------------


async def _never_called(ctx: Context, _: object) -> Any:
    raise AssertionError("no worker runs in this test")


FLOW = Flow(
    "WaitModel",
    [Step("W", _never_called, wait_for=_never_called)],
    start_step="W",
    schema=[Plain, Keyed],
)
FLOWS = ("f1", "f2")  # two flows: a flow's channels are its own
# Mostly f1, so that several waits of one flow compete for the same messages.
PICK_FLOW = st.sampled_from(("f1", "f1", "f1", "f2"))
WORKER = "model-worker"
# Timers: due at once, due after a step or two of the machine's clock, or never on their own.
TIMER_SECONDS = st.sampled_from([0, 1, HOUR])


@dataclass
class MTask:
    task_id: int
    flow_id: str
    seid: str
    wait: MWait
    registered_at: int  # ms on the machine's clock
    timers_skipped: bool = False
    outcome: MOutcome | None = None  # None: still waiting


@dataclass
class Model:
    queues: dict[tuple[str, Ident], list[int]] = field(default_factory=dict)
    values: dict[int, bytes] = field(default_factory=dict)
    tasks: list[MTask] = field(default_factory=list)  # in registration order

    def evaluate(self, flow_id: str, now: int) -> int:
        """One pass over the flow's waiting tasks, oldest registration first; how many it satisfied.

        E5 says only that a message goes to exactly one wait; which one is evaluate_waits' documented
        order (oldest first), which the model adopts so the two can be compared exactly.
        """
        count = 0
        for task in self.tasks:
            if task.flow_id != flow_id or task.outcome is not None:
                continue
            fired = {
                i for i, c in enumerate(task.wait.conds)
                if c.ident is None and (task.registered_at + c.seconds * 1000 <= now or task.timers_skipped)
            }
            queues = {ident: q for (f, ident), q in self.queues.items() if f == flow_id}
            outcome = model_select(task.wait, queues, fired)
            if outcome is None:
                continue
            task.outcome = outcome
            count += 1
            taken = {mid for ids in outcome.consumed for mid in ids}
            for key in self.queues:
                if key[0] == flow_id:
                    self.queues[key] = [m for m in self.queues[key] if m not in taken]
        return count


class WaitStoreMachine(RuleBasedStateMachine):
    """Drives a real store through its transitions and checks it against the model. Each run has
    flows of its own in the database the test gives (`url`), and its own clock."""

    url = ""

    def __init__(self) -> None:
        super().__init__()
        self.now = now_ms()
        # The store reads the wall clock (now_ms) at each call; the machine moves it (advance).
        self.clock = mock.patch.object(time, "time", lambda: (self.now + 0.5) / 1000)
        self.loop = asyncio.new_event_loop()
        self.store = open_store(self.url)
        self.model = Model()
        run = uuid.uuid4().hex[:8]
        self.flows = {name: f"{name}-{run}" for name in FLOWS}
        self.unregistered: dict[str, int] = {}  # flow -> its start task, not yet claimed
        self.clock.start()
        try:
            for flow_id in self.flows.values():
                self.run(self.store.start_flow(StartRequest(
                    flow_id=flow_id, flow_type=FLOW.flow_type, input=b"null", config=FlowConfig(),
                    start=start_record(FLOW, None),
                )))
                row = self.run(self.store.raw(
                    lambda db, f=flow_id: db.one("SELECT task_id FROM tasks WHERE flow_id = ?", (f,))
                ))
                self.unregistered[flow_id] = int(row[0])
        except BaseException:
            self.clock.stop()  # no teardown runs for a machine that was never made
            raise

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    def tick(self) -> None:
        """A millisecond passes before each step that changes the store: a step then never happens
        in the millisecond a wait was registered in, which the store treats as that wait's own."""
        self.now += 1

    def teardown(self) -> None:
        try:
            def gone(db: Any) -> None:
                # Runs after this one share the database; housekeeping would find these flows' timers.
                for flow_id in self.flows.values():
                    tx.stop_flow(db, flow_id, "the run ended", now_ms())
                    tx.delete_flow(db, flow_id)
            self.run(self.store.raw(gone, write=True))
            self.run(self.store.close())
            self.loop.close()
        finally:
            self.clock.stop()

    @rule(flow=PICK_FLOW, ident=st.sampled_from(INSTANCES), value=st.integers(-3, 3))
    def publish(self, flow: str, ident: Ident, value: int) -> None:
        self.tick()
        flow_id = self.flows[flow]
        data = msgspec.json.encode(value)
        mid = self.run(self.store.publish(flow_id, ident[0], ident[1], data))
        assert all(mid > m for m in self.model.values), "message IDs must grow (FIFO by ID)"
        self.model.values[mid] = data
        self.model.queues.setdefault((flow_id, ident), []).append(mid)
        self.model.evaluate(flow_id, self.now)

    @rule(flow=PICK_FLOW, ident=st.sampled_from(INSTANCES), value=st.integers(-3, 3))
    def publish_by_rpc(self, flow: str, ident: Ident, value: int) -> None:
        """A message published with an RPC's other writes (and numbered only when it is written
        or a wait takes it)."""
        self.tick()
        flow_id = self.flows[flow]
        data = msgspec.json.encode(value)
        self.run(self.store.rpc_commit(flow_id, None, (), WriteSet(publishes=[(*ident, data)]), (), ()))
        self._published(flow_id, ident, data)
        self.model.evaluate(flow_id, self.now)

    def _published(self, flow_id: str, ident: Ident, data: bytes) -> None:
        """Queue in the model the one message the last step published, by the ID the store gave it:
        the one ID queued or taken by a wait that the model does not know."""
        mine = tuple(self.flows.values())
        ids = {int(mid) for (mid,) in self.run(self.store.raw(lambda db: db.all(
            "SELECT message_id FROM channel_messages WHERE flow_id IN (?, ?)", mine)))}
        for (blob,) in self.run(self.store.raw(lambda db: db.all(
            "SELECT wait_outcome FROM tasks WHERE flow_id IN (?, ?) AND wait_outcome IS NOT NULL", mine,
        ))):
            ids |= {m.message_id for ms in msgspec.json.decode(blob, type=WaitOutcome).consumed for m in ms}
        new = ids - set(self.model.values)
        assert len(new) == 1, f"one message was published, but the store has new IDs {sorted(new)}"
        mid = new.pop()
        assert all(mid > m for m in self.model.values), "message IDs must grow (FIFO by ID)"
        self.model.values[mid] = data
        self.model.queues.setdefault((flow_id, ident), []).append(mid)

    # Mostly channel conditions and few skips, so that waits block and compete for messages. Some
    # commits of a wait also publish a message, which the wait itself may take.
    @rule(flow=PICK_FLOW, wait=model_waits(TIMER_SECONDS, channel_weight=4, max_conds=3, mode_weights=(3, 3, 1)),
          published=st.none() | st.sampled_from(INSTANCES))
    def register_wait(self, flow: str, wait: MWait, published: Ident | None) -> None:
        self.tick()
        flow_id = self.flows[flow]
        task_id = self.unregistered.pop(flow_id, None)
        if task_id is None:
            # A second, third... execution of the Step in the same flow, as a decision would make it.
            record = movement_record(FLOW, Movement("W", None))
            task_id = self.run(self.store.raw(
                lambda db: tx.create_task(db, flow_id, FLOW.flow_type, record, now_ms()), write=True
            ))
        leases = self.run(self.store.claim(WORKER, [FLOW.flow_type], 1000))
        mine = [lease for lease in leases if lease.task_id == task_id]
        assert len(mine) == 1, f"claim did not hand out task {task_id}: {leases}"
        for other in leases:
            # Satisfied waits are ready for Execute too; give them back untouched.
            if other.task_id != task_id:
                self.run(self.store.release_unstarted(other))
        lease = mine[0]
        assert lease.method == "wait_for"
        writes = WriteSet() if published is None else WriteSet(publishes=[(*published, b"7")])
        self.run(self.store.commit_wait_for(lease, writes, authored_wait(wait).spec()))
        if published is not None:
            self._published(flow_id, published, b"7")
        self.model.tasks.append(MTask(task_id, flow_id, lease.step_execution_id, wait, self.now))
        self.model.evaluate(flow_id, self.now)

    @precondition(lambda self: self.model.tasks)
    @rule(pick=st.integers(0, 1000))
    def skip_timer(self, pick: int) -> None:
        self.tick()
        task = self.model.tasks[pick % len(self.model.tasks)]
        if task.outcome is not None or not any(c.ident is None for c in task.wait.conds):
            # Satisfied, or waiting on no timer: there is nothing to skip.
            with pytest.raises(StepNotWaitingError, match=task.seid):
                self.run(self.store.skip_timer(task.flow_id, task.seid))
            return
        self.run(self.store.skip_timer(task.flow_id, task.seid))
        task.timers_skipped = True
        self.model.evaluate(task.flow_id, self.now)

    @rule(ms=st.sampled_from([300, 700, 1200]))
    def advance(self, ms: int) -> None:
        # Nothing evaluates waits now: a timer that came due is found by the next step of its flow
        # (which must also give it its turn, oldest first), an evaluation, or housekeeping.
        self.now += ms

    @rule(flow=PICK_FLOW)
    def evaluate(self, flow: str) -> None:
        self.tick()
        flow_id = self.flows[flow]
        n = self.run(self.store.raw(lambda db: tx.evaluate_waits(db, flow_id, now_ms()), write=True))
        expected = self.model.evaluate(flow_id, self.now)
        assert n == expected, f"evaluate_waits satisfied {n} wait(s); the model, {expected}"

    @rule()
    def housekeeping(self) -> None:
        self.tick()
        fired = self.run(self.store.housekeeping()).timers_fired
        expected = sum(self.model.evaluate(flow_id, self.now) for flow_id in self.flows.values())
        assert fired == expected, f"housekeeping satisfied {fired} wait(s); the model, {expected}"

    @invariant()
    def store_matches_model(self) -> None:
        mine = tuple(self.flows.values())
        rows = self.run(self.store.raw(lambda db: db.all(
            "SELECT message_id, flow_id, channel, key, value FROM channel_messages WHERE flow_id IN (?, ?) "
            "ORDER BY message_id", mine,
        )))
        queued: dict[tuple[str, Ident], list[int]] = {}
        for mid, flow_id, channel, key, value in rows:
            queued.setdefault((str(flow_id), (str(channel), str(key))), []).append(int(mid))
            assert bytes(value) == self.model.values[int(mid)]
        expected_queues = {k: v for k, v in self.model.queues.items() if v}
        assert queued == expected_queues, "queued messages (per flow and instance, FIFO) differ from the model"

        tasks = {
            int(r[0]): (str(r[1]), str(r[2]), r[3])
            for r in self.run(self.store.raw(lambda db: db.all(
                "SELECT task_id, state, method, wait_outcome FROM tasks WHERE flow_id IN (?, ?)", mine,
            )))
        }
        consumed_ids: list[int] = []
        for task in self.model.tasks:
            state, method, blob = tasks[task.task_id]
            label = f"{task.seid} of {task.flow_id} ({task.wait})"
            if task.outcome is None:
                assert state == "waiting", f"{label}: store says {state}, model says still waiting"
                continue
            assert (state, method) == ("ready", "execute"), f"{label}: store says {state}, model says satisfied"
            got = msgspec.json.decode(blob, type=WaitOutcome)
            want = task.outcome
            assert got.skipped == want.skipped, label
            assert got.satisfied == want.satisfied, label
            assert got.fired_timers == want.fired_timers, label
            got_ids = tuple(tuple(m.message_id for m in ms) for ms in got.consumed)
            assert got_ids == want.consumed, f"{label}: consumed {got_ids}, model {want.consumed}"
            for ms in got.consumed:
                for m in ms:
                    assert bytes(m.value) == self.model.values[m.message_id]
            consumed_ids.extend(mid for ids in got_ids for mid in ids)
        # A message goes to exactly one wait, and is either queued or consumed, never both or lost.
        assert len(consumed_ids) == len(set(consumed_ids)), "a message was consumed by two waits"
        still = {mid for q in queued.values() for mid in q}
        assert not still & set(consumed_ids), "a consumed message is still queued"
        assert still | set(consumed_ids) == set(self.model.values), "a published message was lost"


def _machine_on(url: str) -> type[WaitStoreMachine]:
    """The machine, on the database at `url`."""
    return type("Machine", (WaitStoreMachine,), {"url": url})


def test_the_store_satisfies_waits_as_the_model_does(db_url: str) -> None:
    """Every sequence of steps leaves the store's queues and waits as the model's, on each backend."""
    run_state_machine_as_test(_machine_on(db_url), settings=settings(
        max_examples=40, stateful_step_count=20, deadline=None, suppress_health_check=[HealthCheck.too_slow],
    ))


def _raw(value: int) -> msgspec.Raw:
    return msgspec.Raw(msgspec.json.encode(value))


def test_a_wait_result_hands_each_channel_instance_only_its_own_messages() -> None:
    """WaitResult's readers over a wait on Keyed["x"], Keyed["y"], a timer and Plain: each instance
    gets the messages its conditions consumed and no other key's, a timer consumes none, and an index
    past the conditions, or a result with no outcome, reads as nothing consumed."""
    flow = Flow("Readers", [Step("S", _readers_step)], start_step="S", schema=[Plain, Keyed])
    wait = Wait.all_of(Keyed["x"].at_least(1), Keyed["y"].at_least(1), Timer.by_duration(0), Plain.at_least(1))
    outcome = WaitOutcome(satisfied=(0, 1, 2, 3), consumed=(
        (ConsumedMessage(1, _raw(10)), ConsumedMessage(2, _raw(11))), (ConsumedMessage(3, _raw(20)),), (),
        (ConsumedMessage(4, _raw(30)),)), fired_timers=(2,))
    result = WaitResult(wait.spec(), outcome, flow)
    assert result.messages(Keyed["x"]) == [10, 11]
    assert result.messages(Keyed["y"]) == [20]
    assert result.messages(Plain) == [30]
    assert result.messages_at(2) == [] and result.message_ids(2) == []
    assert result.message_ids(0) == [1, 2]
    assert result.messages_at(4) == [] and result.message_ids(4) == [] and result.message_ids(9) == []
    assert (result.timer_fired, result.fired_timers, result.skipped) == (True, (2,), False)
    nothing = WaitResult(wait.spec(), None, flow)
    assert nothing.messages(Keyed["x"]) == [] and nothing.messages_at(0) == [] and nothing.message_ids(0) == []
    assert (nothing.timer_fired, nothing.fired_timers, nothing.skipped, nothing.satisfied) == (False, (), True, ())
    no_spec = WaitResult(None, outcome, flow)
    assert no_spec.messages(Keyed["x"]) == [] and no_spec.messages_at(0) == []


async def _readers_step(ctx: Context, _: None) -> StepDecision:
    return StepDecision.dead_end()


ONE_SECOND = MCond("timer", (1,), None, seconds=1)


@pytest.mark.parametrize("step", ["register", "publish_elsewhere"])
def test_a_timer_that_came_due_gets_its_turn_at_the_next_step_of_its_flow(db_url: str, step: str) -> None:
    """A wait whose timer came due since the last step is read by the next step of its flow, even one
    that registers or publishes nothing it names, before housekeeping finds it: an older all_of(timer,
    Plain) takes the queued message before a newer wait on Plain does, and an any_of(timer, Keyed x)
    is satisfied by its timer when Keyed y gets a message."""
    machine = _machine_on(db_url)()
    try:
        if step == "register":
            machine.register_wait("f1", _spec("all", ONE_SECOND, ONE_P), None)
            machine.publish("f1", ("Plain", ""), 1)
            machine.advance(1200)
            machine.register_wait("f1", _spec("any", ONE_P), None)
            older, newer = machine.model.tasks
            assert older.outcome is not None and older.outcome.consumed[1] != ()
            assert newer.outcome is None
        else:
            machine.register_wait("f1", _spec("any", ONE_SECOND, ONE_X), None)
            machine.advance(1200)
            machine.publish("f1", ("Keyed", "y"), 1)
            assert machine.model.tasks[0].outcome is not None
        machine.store_matches_model()
    finally:
        machine.teardown()


@settings(max_examples=300, deadline=None)
@given(channel=st.text(min_size=1).filter(str.isprintable), key=st.text().filter(str.isprintable),
       at_least=st.integers(0, 5), at_most=st.none() | st.integers(0, 5), before=st.booleans())
def test_a_stored_wait_holds_the_bytes_the_store_finds_its_channel_instances_by(
    channel: str, key: str, at_least: int, at_most: int | None, before: bool,
) -> None:
    """The store reads only the waits whose stored JSON holds the bytes it looks for (evaluate_waits):
    for any channel name and key, any bounds and place among other conditions, the condition's
    instance's bytes are there, and so are its channel's with no key (a plain Channel's)."""
    cond = ConditionSpec(kind="channel", channel=channel, key=key, at_least=at_least, at_most=at_most)
    others = (ConditionSpec(kind="timer", seconds=3), ConditionSpec(kind="channel", channel="other", key="k"))
    stored = encode_json(WaitSpec(mode="all", conditions=(cond, *others) if before else (*others, cond)))
    assert tx._channel_needle(channel, key) in stored
    assert tx._channel_needle(channel, "") in stored


@pytest.mark.parametrize("instances", [1, 65])  # within and past MOST_PUBLISHED_INSTANCES_NAMED
def test_a_publish_evaluates_only_the_waits_naming_what_it_published(db_url: str, instances: int) -> None:
    """With 80 waits on 80 instances of a ChannelMap, an RPC publishing to `instances` of them
    evaluates only those waits (each approval of a wide fan-out read every wait), or, past the limit
    on instances named in one statement, every wait; either way it satisfies exactly those."""
    machine = _machine_on(db_url)()
    keys = [f"k{i}" for i in range(80)]
    try:
        for key in keys:
            machine.register_wait("f1", _spec("any", _channel_cond(("Keyed", key), "for_one", 0, 1)), None)
        flow_id = machine.flows["f1"]
        machine.tick()
        writes = WriteSet(publishes=[("Keyed", key, b"1") for key in keys[:instances]])
        evaluated: list[WaitSpec] = []

        def counted(spec: WaitSpec, *args: Any) -> Any:
            evaluated.append(spec)
            return select_wait(spec, *args)

        with mock.patch.object(tx, "select_wait", counted):
            machine.run(machine.store.rpc_commit(flow_id, None, (), writes, (), ()))
        assert len(evaluated) == (instances if instances <= MOST_PUBLISHED_INSTANCES_NAMED else len(keys))
        states = machine.run(machine.store.raw(lambda db: db.all(
            "SELECT state FROM tasks WHERE flow_id = ? ORDER BY task_id", (flow_id,))))
        assert [str(state) for (state,) in states] == ["ready"] * instances + ["waiting"] * (len(keys) - instances)
    finally:
        machine.teardown()
