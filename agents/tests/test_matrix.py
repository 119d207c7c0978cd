"""The integration test matrix of seed 002 "Tests", through real Worker child processes.

Every test drives the scripted runner (agents/tests/scripted_agent.py) in a Worker child, asserts
the turn's Step shape from Flow history, and counts real model and tool calls in the InvocationLog,
which survives SIGKILL. Kill tests SIGKILL the Worker while a handler waits at a FileGate.
"""

from __future__ import annotations

import contextlib
import json
import re
import sqlite3
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, cast

import msgspec
import pytest
import pytest_asyncio
from agents.tests.conftest import REPO_ROOT, WORKER_MODULE
from agents.tests.scripted_agent import (
    CALL_USAGE,
    ENV_DEADLINE_SECONDS,
    ENV_INCREMENTAL,
    INVOCATIONS,
    build_flow,
    messages_digest,
)
from agents.tests.standby_workers import SharedStack

from dex_agents import (
    OUTCOME_UNKNOWN_TEXT,
    AgentSessionFlow,
    AgentSnapshot,
    AgentStatus,
    AgentToolCallStatus,
    AgentUsage,
    MessageRole,
)
from dex_agents.testing import (
    EXECUTE_COMPLETED_EVENT,
    AgentTestStack,
    FileGate,
    InvocationLog,
    StepHistoryEntry,
    executed_steps,
    wait_for_agent_snapshot,
    wait_until,
)
from dex_engine import MAX_VALUE_BYTES, StepDurability

# The approval deadline of test 7: long enough that the test sees the interrupt raised, short
# enough not to slow the file down. Only the Worker's Timer and the RPC's check read it.
DEADLINE_SECONDS = 2

# Every test and the module-scoped stacks share one event loop (the stacks' Clients live in it).
pytestmark = pytest.mark.asyncio(loop_scope="module")


# Shared stacks -------------------------------------------------------------------------------
#
# The tests of one Flow configuration share an engine and its live Worker (SharedStack), each
# test with its own session: the session ID names the test's FileGates and filters the
# InvocationLog and the history. The plain stack keeps two standbys, so a kill test rarely waits
# for a new Worker's imports.


def custom_stack(tmp_path: Path, *, incremental: bool = False, deadline_seconds: int | None = None) -> AgentTestStack:
    """A stack whose test-side Flow and Worker children build the same options (via the environment)."""
    env: dict[str, str] = {}
    if incremental:
        env[ENV_INCREMENTAL] = "1"
    deadline = None
    if deadline_seconds is not None:
        env[ENV_DEADLINE_SECONDS] = str(deadline_seconds)
        deadline = timedelta(seconds=deadline_seconds)
    flow = build_flow(tmp_path, incremental=incremental, interrupt_deadline=deadline)
    return AgentTestStack(tmp_path, [flow], WORKER_MODULE, worker_cwd=REPO_ROOT, worker_env=env)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def plain_shared(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[SharedStack]:
    """The scripted Flow with the plain runner, which stores a turn's items when the turn ends."""
    async with custom_stack(tmp_path_factory.mktemp("plain")) as stack:
        yield SharedStack(stack, standbys=2)  # the kill tests need one new Worker after another


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def incremental_shared(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[SharedStack]:
    """The incremental runner (SCRIPTED_INCREMENTAL=1 in the Worker, incremental=True here)."""
    async with custom_stack(tmp_path_factory.mktemp("incremental"), incremental=True) as stack:
        yield SharedStack(stack, standbys=0)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def deadline_shared(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[SharedStack]:
    """Approvals with a deadline (SCRIPTED_INTERRUPT_DEADLINE_SECONDS in the Worker, the same here)."""
    async with custom_stack(tmp_path_factory.mktemp("deadline"), deadline_seconds=DEADLINE_SECONDS) as stack:
        yield SharedStack(stack, standbys=0)


@pytest.fixture(scope="module", autouse=True)
def standbys_import_at_once(
    plain_shared: SharedStack, incremental_shared: SharedStack, deadline_shared: SharedStack
) -> None:
    """Create every shared stack when the module starts, so their first Workers import side by side."""


# One test's session ----------------------------------------------------------------------------


class Run:
    """One test's session on a shared stack, and what the test reads about it."""

    def __init__(self, shared: SharedStack, session_id: str, *, incremental: bool = False) -> None:
        self.shared = shared
        self.session_id = session_id
        self.incremental = incremental
        self.stack = shared.stack
        self.sessions = self.stack.sessions(cast(AgentSessionFlow, self.stack.flows[0]))
        self.log = InvocationLog(self.stack.state_dir / INVOCATIONS)

    def gate_name(self, name: str) -> str:
        return f"{self.session_id}.{name}"

    def gate(self, name: str) -> FileGate:
        return FileGate(self.stack.state_dir, self.gate_name(name))

    async def start(self, text: str, *, step_durability: StepDurability = StepDurability.SYNC) -> None:
        await self.sessions.start_session(self.session_id, text, step_durability=step_durability)

    def model_calls(self, turn_id: str) -> list[tuple[int, int]]:
        """(script step, attempt) of every model call of a turn, in call order."""
        entries = self.log.entries("model", flow_id=self.session_id, turn_id=turn_id)
        return [(e["step"], e["attempt"]) for e in entries]

    def seen_by(self, turn_id: str, step: int) -> list[list[int]]:
        """The stored message sequences each model call of (turn, script step) was given."""
        entries = self.log.entries("model", flow_id=self.session_id, turn_id=turn_id, step=step)
        return [e["seen"] for e in entries]

    def seen_digests(self, turn_id: str, step: int) -> list[str]:
        """The digest (messages_digest) of the messages each model call of (turn, script step) was given."""
        entries = self.log.entries("model", flow_id=self.session_id, turn_id=turn_id, step=step)
        return [e["seen_digest"] for e in entries]

    def tool_starts(self, tool_call_id: str | None = None) -> int:
        match = {} if tool_call_id is None else {"tool_call_id": tool_call_id}
        return self.log.count("tool_start", flow_id=self.session_id, **match)

    def tool_ends(self) -> int:
        return self.log.count("tool_end", flow_id=self.session_id)

    async def snapshot(self) -> AgentSnapshot:
        return await self.sessions.get_agent_snapshot(self.session_id)

    async def resolve(self, interrupt_id: str, approved: bool, rejection_message: str | None = None) -> bool:
        return await self.sessions.resolve_interrupt(self.session_id, interrupt_id, approved, rejection_message)

    async def wait_for(self, probe: Callable[[AgentSnapshot], Any], description: str) -> Any:
        return await wait_for_agent_snapshot(self.sessions, self.session_id, probe, description=description)

    async def turns_ended(self, count: int) -> AgentSnapshot:
        """The snapshot once `count` turns ended and no turn is active."""

        def probe(s: AgentSnapshot) -> AgentSnapshot | None:
            ok = s.state is not None and s.state.turn_count == count and s.state.active_turn_id is None
            return s if ok else None

        found: AgentSnapshot = await self.wait_for(probe, f"{count} turn(s) to end")
        return found

    async def interrupt_pending(self, interrupt_id: str) -> AgentSnapshot:
        def probe(s: AgentSnapshot) -> AgentSnapshot | None:
            return s if any(i.interrupt_id == interrupt_id for i in s.pending_interrupts) else None

        found: AgentSnapshot = await self.wait_for(probe, f"interrupt {interrupt_id}")
        return found

    async def history(self) -> list[StepHistoryEntry]:
        return await self.stack.read_step_history(self.session_id)

    def scheduled_durabilities(self) -> dict[str, str]:
        """The resolved durability of each Step the session has scheduled now, read from the engine's
        tasks table: the only place that shows whether the flow's default reached a Step."""
        path = self.stack.database_url.removeprefix("sqlite:///")
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
            # A task row names its options' row in task_options (or, written before schema 6, holds them).
            rows = db.execute(
                "SELECT t.step_type, coalesce(o.options, t.options) FROM tasks t LEFT JOIN task_options o "
                "ON substr(t.options, 1, 1) = X'23' AND o.digest = substr(t.options, 2) WHERE t.flow_id = ?",
                (self.session_id,),
            ).fetchall()
        return {str(step_type): str(json.loads(options)["durability"]) for step_type, options in rows}


def session_id_of(request: pytest.FixtureRequest) -> str:
    """The test's own session ID (also its FileGates' prefix): its node name, '/'-free."""
    return re.sub(r"[^A-Za-z0-9_.-]", "-", request.node.name)


@pytest.fixture
def run(request: pytest.FixtureRequest, plain_shared: SharedStack) -> Run:
    return Run(plain_shared, session_id_of(request))


@pytest.fixture(params=["plain", "incremental"])
def runner_run(request: pytest.FixtureRequest) -> Run:
    """The test's session with the plain runner, then with the incremental one."""
    shared: SharedStack = request.getfixturevalue(f"{request.param}_shared")
    return Run(shared, session_id_of(request), incremental=request.param == "incremental")


@pytest.fixture
def deadline_run(request: pytest.FixtureRequest, deadline_shared: SharedStack) -> Run:
    return Run(deadline_shared, session_id_of(request))


# Helpers -------------------------------------------------------------------------------------


def script(*steps: dict[str, Any]) -> str:
    """A user message that scripts the turn's model calls (see scripted_agent's docstring)."""
    return json.dumps({"steps": list(steps)})


def final_answer(snapshot: AgentSnapshot) -> str | None:
    last = snapshot.messages[-1]
    assert last.role is MessageRole.ASSISTANT, last
    return last.text


def events_of(entries: list[StepHistoryEntry], step_type: str, event_type: str) -> list[StepHistoryEntry]:
    return [e for e in entries if e.step_type == step_type and e.event_type == event_type]


# 1 and 11. Two model calls and a READ tool; the snapshot; the history replays next turn -----


async def test_1_and_11_read_tool_turn_snapshot_and_history_replay(runner_run: Run) -> None:
    """RunModel -> CallTool -> ResumeTurn -> RunModel; get_agent_snapshot then returns the conversation
    (item 11); turn 2's model call is given every stored message of turn 1 (item 1's replay)."""
    r = runner_run
    await r.shared.worker()
    first_text = script(
        {"tools": [{"id": "c1", "name": "read_orders", "args": {"gate": r.gate_name("read")}}]},
        {"answer": "orders: {results}"},
    )
    await r.start(first_text)
    await r.gate("read").wait_until_reached()
    # While the tool runs, the plain runner keeps the response in run state; the incremental one stored it.
    mid = await r.snapshot()
    assert [m.role for m in mid.messages] == (
        [MessageRole.USER, MessageRole.ASSISTANT] if r.incremental else [MessageRole.USER]
    )
    assert mid.state is not None and mid.state.status is AgentStatus.RUNNING_TOOLS
    assert [(c.tool_call_id, c.status) for c in mid.tool_calls] == [("c1", AgentToolCallStatus.APPROVED)]
    r.gate("read").release()
    first = await r.turns_ended(1)

    # Item 11: the snapshot after the turn.
    state = first.state
    assert state is not None and state.status is AgentStatus.WAITING_FOR_USER_MESSAGE
    assert (state.turn_count, state.active_turn_id, state.next_message_sequence, state.last_turn_error) == (
        1, None, 5, None,
    )
    assert [(m.sequence, m.turn_id, m.role) for m in first.messages] == [
        (1, "turn-1", MessageRole.USER), (2, "turn-1", MessageRole.ASSISTANT),
        (3, "turn-1", MessageRole.TOOL), (4, "turn-1", MessageRole.ASSISTANT),
    ]
    assert first.messages[0].text == first_text
    tool_message = first.messages[2]
    assert (tool_message.tool_call_id, tool_message.tool_name, tool_message.tool_output) == (
        "c1", "read_orders", "read_orders done",
    )
    assert first.messages[3].text == "orders: c1=read_orders done"
    assert all(m.framework_item and m.created_at for m in first.messages)
    # Two scripted model calls, each reporting 1 call, 10 input and 5 output tokens.
    assert first.usage == AgentUsage(model_calls=2, input_tokens=20, output_tokens=10)
    assert (first.tool_calls, first.pending_interrupts, first.queued_message_count) == ([], [], 0)
    assert (await r.sessions.list_agent_messages(r.session_id)).messages == first.messages

    # Item 1's replay: the next turn's model call is given turn 1's stored messages.
    assert await r.sessions.send_user_message(r.session_id, script({"answer": "saw {seen}"}))
    second = await r.turns_ended(2)
    assert final_answer(second) == "saw 5"
    assert second.messages[:4] == first.messages
    assert [(m.sequence, m.turn_id) for m in second.messages[4:]] == [(5, "turn-2"), (6, "turn-2")]

    assert executed_steps(await r.history()) == [
        "StartAgentSession", "RunModel", "CallTool", "ResumeTurn", "RunModel", "AwaitUserMessage", "RunModel",
    ]
    # One model call per script step; the first call saw the user message, the second also what
    # the incremental runner stored; turn 2's call was given every stored message.
    assert r.model_calls("turn-1") == [(0, 1), (1, 1)]
    assert r.seen_by("turn-1", 0) == [[1]]
    assert r.seen_by("turn-1", 1) == [[1, 2] if r.incremental else [1]]
    assert r.seen_by("turn-2", 0) == [[1, 2, 3, 4, 5]]
    # ... as they are stored, every field: the replay is the history, not just its sequences.
    assert r.seen_digests("turn-2", 0) == [messages_digest(second.messages[:5])]
    assert r.tool_starts("c1") == 1


# 2. Parallel tool calls run as parallel Steps -----------------------------------------------


async def test_2_parallel_tool_calls_run_as_parallel_steps(run: Run) -> None:
    """Two tools of one response are both inside their tool Steps at once, each its own Step execution."""
    await run.shared.worker()
    await run.start(script(
        {"tools": [{"id": "a", "name": "read_a", "args": {"gate": run.gate_name("tool-a")}},
                   {"id": "b", "name": "read_b", "args": {"gate": run.gate_name("tool-b")}}]},
        {"answer": "{results}"},
    ))
    # Neither gate is released until both are reached: only parallel Steps can get here.
    await run.gate("tool-a").wait_until_reached()
    await run.gate("tool-b").wait_until_reached()
    assert run.tool_ends() == 0
    run.gate("tool-a").release()
    run.gate("tool-b").release()
    snapshot = await run.turns_ended(1)
    assert final_answer(snapshot) == "a=read_a done; b=read_b done"

    entries = await run.history()
    assert executed_steps(entries) == ["StartAgentSession", "RunModel", "CallTool", "CallTool", "ResumeTurn",
                                       "RunModel"]
    call_tools = events_of(entries, "CallTool", EXECUTE_COMPLETED_EVENT)
    assert len({e.step_execution_id for e in call_tools}) == 2
    assert run.tool_starts("a") == 1 and run.tool_starts("b") == 1


# 3. An approval waits beside a READ tool, survives a Worker restart, runs once --------------


async def test_3_approval_waits_beside_read_survives_restart_and_runs_once(run: Run) -> None:
    """The write's approval is pending while the READ tool runs; after a SIGKILL and a new Worker, the
    approved write runs exactly once and its result reaches the model."""
    worker = await run.shared.worker()
    await run.start(script(
        {"tools": [{"id": "c1", "name": "read_orders", "args": {"gate": run.gate_name("read")}},
                   {"id": "c2", "name": "write_refund", "args": {"amount": 5}}]},
        {"answer": "done {results}"},
    ))
    await run.gate("read").wait_until_reached()
    waiting = await run.interrupt_pending("c2")
    statuses = {c.tool_call_id: c.status for c in waiting.tool_calls}
    assert statuses == {"c1": AgentToolCallStatus.APPROVED, "c2": AgentToolCallStatus.AWAITING_APPROVAL}
    run.gate("read").release()

    def read_done(s: AgentSnapshot) -> bool:
        return any(c.tool_call_id == "c1" and c.status is AgentToolCallStatus.SUCCEEDED for c in s.tool_calls)

    await run.wait_for(read_done, "the read to finish")
    worker.kill()  # the approval is still pending: it must survive the Worker
    await run.shared.start_new_worker()
    await run.interrupt_pending("c2")
    assert await run.resolve("c2", approved=True)
    snapshot = await run.turns_ended(1)
    assert final_answer(snapshot) == "done c1=read_orders done; c2=write_refund done"
    assert run.tool_starts("c2") == 1
    assert run.tool_starts("c1") == 1
    assert executed_steps(await run.history()) == [
        "StartAgentSession", "RunModel", "CallTool", "AwaitToolApproval", "CallSingleAttemptTool", "ResumeTurn",
        "RunModel",
    ]


# 4 and 7 (first half). A rejected write never runs; a second resolution is refused -------


async def test_4_rejected_writes_never_run_and_7_second_resolution_is_refused(run: Run) -> None:
    """A custom rejection_message and the default text (None) both reach the model and neither tool
    runs (item 4); resolve_interrupt on an interrupt already resolved returns False, either way, and
    the first resolution stands (item 7)."""
    await run.shared.worker()
    await run.start(script(
        {"tools": [{"id": "w1", "name": "write_refund", "args": {}}, {"id": "w2", "name": "write_email", "args": {}}]},
        {"answer": "{results}"},
    ))
    await run.interrupt_pending("w1")
    await run.interrupt_pending("w2")
    assert await run.resolve("w1", approved=False, rejection_message="not today") is True
    assert await run.resolve("w1", approved=False, rejection_message="again") is False
    assert await run.resolve("w1", approved=True) is False
    assert await run.resolve("w2", approved=False, rejection_message=None) is True
    snapshot = await run.turns_ended(1)
    assert final_answer(snapshot) == "w1=not today; w2=The user rejected this tool call."
    tool_messages = [m for m in snapshot.messages if m.role is MessageRole.TOOL]
    assert [(m.tool_call_id, m.tool_output) for m in tool_messages] == [
        ("w1", "not today"), ("w2", "The user rejected this tool call."),
    ]
    assert await run.resolve("w2", approved=True) is False
    assert run.tool_starts() == 0
    assert executed_steps(await run.history()) == [
        "StartAgentSession", "RunModel", "AwaitToolApproval", "AwaitToolApproval", "ResumeTurn", "RunModel",
    ]


# 5 and 9. SIGKILL during CallSingleAttemptTool records outcome_unknown, never reruns ---------


async def kill_during_single_attempt_write(run: Run, durability: StepDurability) -> None:
    """Approve a write, SIGKILL the Worker inside the tool, and check nothing runs it again."""
    worker = await run.shared.worker()
    await run.start(script(
        {"tools": [{"id": "w1", "name": "write_refund", "args": {"gate": run.gate_name("write")}}]},
        {"answer": "{results}"},
    ), step_durability=durability)
    await run.interrupt_pending("w1")
    assert await run.resolve("w1", approved=True)
    assert await run.gate("write").wait_until_reached() == worker.pid
    # Every Step sets SYNC itself, so the flow's default never reaches a scheduled Step.
    assert run.scheduled_durabilities() == {"CallSingleAttemptTool": "SYNC", "ResumeTurn": "SYNC"}
    worker.kill()
    await run.shared.start_new_worker()
    # Released at once: a rerun would now finish and log a second tool_start and a success.
    run.gate("write").release()
    snapshot = await run.turns_ended(1)
    assert final_answer(snapshot) == f"w1={OUTCOME_UNKNOWN_TEXT}"
    tool_message = next(m for m in snapshot.messages if m.role is MessageRole.TOOL)
    assert tool_message.tool_output == OUTCOME_UNKNOWN_TEXT
    assert run.tool_starts("w1") == 1
    assert run.tool_ends() == 0

    entries = await run.history()
    assert executed_steps(entries) == ["StartAgentSession", "RunModel", "AwaitToolApproval",
                                       "RecordToolOutcomeUnknown", "ResumeTurn", "RunModel"]
    # The killed attempt was the only one: the Step failed after attempt 1 and never completed.
    assert [e.final_attempt for e in events_of(entries, "CallSingleAttemptTool", "attempt_failed")] == [1]
    assert len(events_of(entries, "CallSingleAttemptTool", "step_failed")) == 1
    assert events_of(entries, "CallSingleAttemptTool", EXECUTE_COMPLETED_EVENT) == []


async def test_5_kill_during_single_attempt_tool_records_outcome_unknown(run: Run) -> None:
    """SIGKILL inside CallSingleAttemptTool: RecordToolOutcomeUnknown, one tool_start, the model sees it."""
    await kill_during_single_attempt_write(run, StepDurability.SYNC)


async def test_9_async_durability_session_never_reruns_single_attempt_write(run: Run) -> None:
    """A session started with an ASYNC Step durability default still runs a single-attempt write at most once."""
    await kill_during_single_attempt_write(run, StepDurability.ASYNC)
    info = await run.stack.client.describe_flow(run.session_id)
    assert info.config.default_step_durability is StepDurability.ASYNC


# 6. SIGKILL during RunModel reruns only that model call ------------------------------------


async def test_6_kill_during_run_model_reruns_only_that_call(run: Run) -> None:
    """The killed model call runs again (attempt 2); the first model call and the tool run once."""
    worker = await run.shared.worker()
    await run.start(script(
        {"tools": [{"id": "c1", "name": "read_orders", "args": {}}]},
        # Heartbeat first: the killed attempt counts as started, so its rerun is attempt 2.
        {"answer": "orders: {results}", "gate": run.gate_name("model"), "heartbeat": True},
    ))
    assert await run.gate("model").wait_until_reached() == worker.pid
    worker.kill()
    await run.shared.start_new_worker()
    run.gate("model").release()
    snapshot = await run.turns_ended(1)
    assert final_answer(snapshot) == "orders: c1=read_orders done"
    assert run.model_calls("turn-1") == [(0, 1), (1, 1), (1, 2)]
    assert run.tool_starts("c1") == 1
    # The killed attempt committed nothing, so its usage is not counted: each committed model call once,
    # and the session total is the sum of the usage_recorded events.
    assert snapshot.usage == AgentUsage(model_calls=2, input_tokens=20, output_tokens=10)
    recorded = [json.loads(e.value.payload) for e in (await run.sessions.read_agent_events(run.session_id)).events
                if e.value.type == "usage_recorded"]
    assert [r["recorded"]["model_calls"] for r in recorded] == [1, 1]
    assert recorded[-1]["session"] == msgspec.to_builtins(snapshot.usage)

    entries = await run.history()
    assert executed_steps(entries) == ["StartAgentSession", "RunModel", "CallTool", "ResumeTurn", "RunModel"]
    run_models = events_of(entries, "RunModel", EXECUTE_COMPLETED_EVENT)
    assert [e.final_attempt for e in run_models] == [1, 2]
    failed = events_of(entries, "RunModel", "attempt_failed")
    assert [(e.step_execution_id, e.final_attempt) for e in failed] == [(run_models[1].step_execution_id, 1)]


async def test_kill_in_record_turn_failure_counts_an_answer_too_large_to_store_once(
    request: pytest.FixtureRequest,
) -> None:
    """An answer over the value limit fails RunModel's commit, and the call's usage with it;
    RecordTurnFailure records that usage. A Worker killed inside RecordTurnFailure (in the runner's
    build_unfinished_turn_messages) commits nothing, and the next Worker's attempt records it: the
    model call is counted once, neither lost nor twice, and not made again."""
    run = Run(request.getfixturevalue("incremental_shared"), session_id_of(request), incremental=True)
    worker = await run.shared.worker()
    await run.start(json.dumps({"steps": [{"answer_bytes": MAX_VALUE_BYTES}],
                                "unfinished_gate": run.gate_name("failure")}))
    assert await run.gate("failure").wait_until_reached() == worker.pid
    worker.kill()
    await run.shared.start_new_worker()
    run.gate("failure").release()
    snapshot = await run.turns_ended(1)
    assert snapshot.state is not None
    assert (snapshot.state.last_turn_error or "").startswith("message 2 (assistant) of turn turn-1 is too large")
    assert run.model_calls("turn-1") == [(0, 1)]
    assert snapshot.usage == CALL_USAGE
    recorded = [json.loads(e.value.payload) for e in (await run.sessions.read_agent_events(run.session_id)).events
                if e.value.type == "usage_recorded"]
    assert recorded == [{"recorded": msgspec.to_builtins(CALL_USAGE), "session": msgspec.to_builtins(CALL_USAGE)}]
    entries = await run.history()
    assert executed_steps(entries) == ["StartAgentSession", "RecordTurnFailure"]
    assert len(events_of(entries, "RunModel", "step_failed")) == 1


# 7 (second half). The approval deadline rejects the call ---------------------------------


async def test_7_approval_deadline_rejects_the_call(deadline_run: Run) -> None:
    """An approval nobody answers is rejected with "approval deadline passed" at its deadline, and
    resolve_interrupt after the deadline returns False (the second-resolution half of item 7 is in test 4)."""
    r = deadline_run
    await r.shared.worker()
    await r.start(script({"tools": [{"id": "w1", "name": "write_refund", "args": {}}]}, {"answer": "{results}"}))

    # The deadline from the interrupt_raised event: it is there even when the Timer already fired.
    async def raised_deadline() -> str | None:
        read = await r.sessions.read_agent_events(r.session_id)
        for event in read.events:
            if event.value.type == "interrupt_raised":
                deadline: str | None = json.loads(event.value.payload)["deadline"]
                return deadline
        return None

    deadline_text = await wait_until("interrupt_raised", raised_deadline)
    deadline = datetime.fromisoformat(deadline_text.replace("Z", "+00:00"))
    await wait_until("the approval deadline", lambda: datetime.now(UTC) >= deadline)
    assert await r.resolve("w1", approved=True) is False
    snapshot = await r.turns_ended(1)
    assert final_answer(snapshot) == "w1=approval deadline passed"
    assert await r.resolve("w1", approved=True) is False
    assert r.tool_starts() == 0
    assert executed_steps(await r.history()) == [
        "StartAgentSession", "RunModel", "AwaitToolApproval", "ResumeTurn", "RunModel",
    ]


# 8. A turn that fails after a write ran leaves the note; the write is not repeated ----------


async def test_8_failed_turn_after_write_leaves_note_and_write_is_not_repeated(runner_run: Run) -> None:
    """RecordTurnFailure stores the unfinished-turn messages (incremental runner) and then the note in
    the seed's exact format; last_turn_error is set; the next turn works and the write ran once."""
    r = runner_run
    await r.shared.worker()
    await r.start(script(
        {"tools": [{"id": "w1", "name": "write_refund", "args": {"amount": 5}}]},
        {"raise": "model provider down"},
    ))
    await r.interrupt_pending("w1")
    assert await r.resolve("w1", approved=True)
    failed = await r.turns_ended(1)
    assert failed.state is not None
    assert failed.state.status is AgentStatus.WAITING_FOR_USER_MESSAGE
    assert failed.state.last_turn_error is not None and "model provider down" in failed.state.last_turn_error
    note = (
        "[Dex] The previous turn failed after these tool calls ran:\n"
        '- write_refund {"amount": 5} -> succeeded: write_refund done\n'
        "Do not repeat these tool calls unless the user asks again."
    )
    stored = [(m.sequence, m.role, m.turn_id) for m in failed.messages]
    if r.incremental:
        # The ask was stored with the tool calls; the builder adds the tool result before the note.
        assert stored == [(1, MessageRole.USER, "turn-1"), (2, MessageRole.ASSISTANT, "turn-1"),
                          (3, MessageRole.TOOL, "turn-1"), (4, MessageRole.USER, "turn-1")]
        assert failed.messages[2].tool_call_id == "w1" and failed.messages[2].tool_output == "write_refund done"
    else:
        assert stored == [(1, MessageRole.USER, "turn-1"), (2, MessageRole.USER, "turn-1")]
    assert failed.messages[-1].text == note
    assert r.model_calls("turn-1") == [(0, 1), (1, 1), (1, 2), (1, 3)]  # every attempt raised

    assert await r.sessions.send_user_message(r.session_id, "hello")
    after = await r.turns_ended(2)
    assert after.state is not None and after.state.last_turn_error is None
    assert final_answer(after) == "echo: hello"
    # The next model call is given the note; the write was not run again.
    note_sequence = failed.messages[-1].sequence
    assert r.seen_by("turn-2", 0) == [list(range(1, note_sequence + 2))]
    assert r.tool_starts("w1") == 1

    entries = await r.history()
    assert executed_steps(entries) == ["StartAgentSession", "RunModel", "AwaitToolApproval", "CallSingleAttemptTool",
                                       "ResumeTurn", "RecordTurnFailure", "AwaitUserMessage", "RunModel"]
    assert [e.final_attempt for e in events_of(entries, "RunModel", "attempt_failed")] == [1, 2, 3]


# 10. A message sent during a turn is queued and handled after it ---------------------------


async def test_10_message_sent_during_turn_is_queued_then_handled(run: Run) -> None:
    """While a tool holds turn 1, send_user_message queues; the queued message starts turn 2 afterwards."""
    await run.shared.worker()
    await run.start(script(
        {"tools": [{"id": "c1", "name": "read_orders", "args": {"gate": run.gate_name("hold")}}]},
        {"answer": "first"},
    ))
    await run.gate("hold").wait_until_reached()
    assert await run.sessions.send_user_message(run.session_id, "next please")
    during = await run.snapshot()
    assert during.state is not None and during.state.active_turn_id == "turn-1"
    assert during.queued_message_count == 1
    assert [q.message.text for q in during.queued_messages] == ["next please"]

    run.gate("hold").release()
    snapshot = await run.turns_ended(2)
    assert snapshot.queued_message_count == 0 and snapshot.queued_messages == []
    assert [(m.turn_id, m.role, m.text) for m in snapshot.messages[-3:]] == [
        ("turn-1", MessageRole.ASSISTANT, "first"),
        ("turn-2", MessageRole.USER, "next please"),
        ("turn-2", MessageRole.ASSISTANT, "echo: next please"),
    ]
    assert executed_steps(await run.history()) == [
        "StartAgentSession", "RunModel", "CallTool", "ResumeTurn", "RunModel", "AwaitUserMessage", "RunModel",
    ]
