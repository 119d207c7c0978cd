"""A deploy that changes the agent while a session's call waits: the Worker that started the turn runs
one AgentDefinition, the Worker that continues it (same database, same flow type) another.

Each test runs the first Worker until the call waits (an approval or a tool's question), stops it,
and goes on with a Worker of the changed definition, as a deploy does.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest
from agents.tests.builtin_agent import FAST_WORKER, InProcessEngine, lookup_order, refund_order, scripted_flow
from engine.tests.conftest import db_url, pg_database, pg_databases  # noqa: F401 - the fixtures used here

from dex_agents import (
    OUTCOME_UNKNOWN_TEXT,
    TOOL_CALL_NOT_RUN_ERROR_PREFIX,
    AgentSessionClient,
    AgentSessionFlow,
    AgentSessionOptions,
    AgentSnapshot,
    AgentToolCall,
    AgentToolCallStatus,
    InterruptKind,
    MessageRole,
    ToolEffect,
    ToolInputRequested,
    ToolPolicy,
)
from dex_agents._policy import stricter_policy_problem
from dex_agents.builtin_loop import (
    AgentDefinition,
    BuiltinLoopAgentRunner,
    FunctionTool,
    ModelRequest,
    ScriptedModelClient,
    ScriptedModelReply,
    ScriptedToolCall,
    ToolCallContext,
    builtin_agent_session_options,
    function_tool,
)
from dex_agents.testing import executed_steps, to_step_history, wait_for_agent_snapshot
from dex_engine import AsyncWorker, Registry, WorkerOptions

SKU = {"sku": "A-1"}


def _sync_stock(effect: ToolEffect, requires_approval: bool | None, ran: list[str], version: str) -> FunctionTool:
    """`sync_stock` of one agent version: it asks which warehouse, then records that it ran."""

    @function_tool(effect=effect, requires_approval=requires_approval, name="sync_stock")
    def sync_stock(sku: str, context: ToolCallContext) -> str | ToolInputRequested:
        """Sync the stock of a SKU."""
        if not context.input_answers:
            return ToolInputRequested(question="Which warehouse?")
        ran.append(f"{version} {context.effect.value}")
        return f"{version} synced {sku}"

    return sync_stock


def _call_sync_until_it_runs(request: ModelRequest) -> ScriptedModelReply:
    """Calls sync_stock; after a result that says to call it again, calls it again."""
    results = ScriptedModelClient.tool_results(request)
    if results and TOOL_CALL_NOT_RUN_ERROR_PREFIX in results[-1].output:
        return ScriptedModelReply(tool_calls=[ScriptedToolCall("sync_stock", SKU)])
    if results:
        return ScriptedModelReply(text=f"done: {results[-1].output}")
    return ScriptedModelReply(tool_calls=[ScriptedToolCall("sync_stock", SKU)])


async def _pending(sessions: AgentSessionClient, kind: InterruptKind, tool: str) -> str:
    """The ID of the session's pending `kind` interrupt for `tool`, once there is one."""
    def probe(snapshot: AgentSnapshot) -> str | None:
        return next((i.interrupt_id for i in snapshot.pending_interrupts
                     if i.kind is kind and i.tool_name == tool), None)
    found: str = await wait_for_agent_snapshot(sessions, "s", probe, description=f"a {kind.value} for {tool}")
    return found


async def _turn_ended(sessions: AgentSessionClient) -> AgentSnapshot:
    snapshot: AgentSnapshot = await wait_for_agent_snapshot(
        sessions, "s", lambda s: s if s.state is not None and s.state.turn_count >= 1 else None,
        description="the first turn to end")
    return snapshot


@pytest.mark.parametrize("before, waits_for", [
    # Recorded without approval (its question waits), now a write that needs one.
    (ToolPolicy(ToolEffect.READ), InterruptKind.QUESTION),
    # Approved as a read, so its Step repeats it; now a write that may not repeat.
    (ToolPolicy(ToolEffect.READ, requires_approval=True), InterruptKind.TOOL_APPROVAL),
    # The same write, which no longer runs without an approval.
    (ToolPolicy(ToolEffect.NON_IDEMPOTENT_WRITE, requires_approval=False), InterruptKind.QUESTION),
])
async def test_a_call_whose_tool_a_deploy_made_stricter_runs_only_when_called_again(
    tmp_path: Path, db_url: str, before: ToolPolicy, waits_for: InterruptKind  # noqa: F811 - the fixture
) -> None:
    """The call waits on the old Worker; the new Worker's tool needs an approval or may not repeat.
    The call is not run; the model sees why and calls again, and the new call waits for the approval
    the new definition asks for. Catches: the new write running without any approval (and, recorded
    as a read, in CallTool, which repeats it after a crash) while its context said `read`."""
    ran: list[str] = []
    old, _ = scripted_flow(_call_sync_until_it_runs, tools=[lookup_order, _sync_stock(
        before.effect, before.requires_approval, ran, "v1")])
    new, _ = scripted_flow(_call_sync_until_it_runs, tools=[lookup_order, _sync_stock(
        ToolEffect.NON_IDEMPOTENT_WRITE, None, ran, "v2")])
    first = InProcessEngine(tmp_path, [old], url=db_url)
    async with first.running():
        sessions = first.sessions()
        await sessions.start_session("s", "sync A-1")
        waiting = await _pending(sessions, waits_for, "sync_stock")
    second = InProcessEngine(tmp_path, [new], url=db_url)
    async with second.running():
        sessions = second.sessions()
        if waits_for is InterruptKind.QUESTION:
            assert await sessions.answer_question("s", waiting, "north")
        else:
            assert await sessions.resolve_interrupt("s", waiting, approved=True)
        approval = await _pending(sessions, InterruptKind.TOOL_APPROVAL, "sync_stock")
        assert ran == []
        snapshot = await sessions.get_agent_snapshot("s")
        refused = [m.tool_output for m in snapshot.messages if m.role is MessageRole.TOOL]
        assert refused == [
            f"The tool call failed: {TOOL_CALL_NOT_RUN_ERROR_PREFIX}: tool sync_stock changed after the model "
            f"called it: the call was recorded as {before.effect.value} "
            f"{'needing approval' if waits_for is InterruptKind.TOOL_APPROVAL else 'with no approval'}, and this "
            "Worker's agent defines it as non_idempotent_write needing approval; call it again to run it under "
            "the new definition"
        ]
        assert await sessions.resolve_interrupt("s", approval, approved=True)
        answer = await _pending(sessions, InterruptKind.QUESTION, "sync_stock")
        assert await sessions.answer_question("s", answer, "north")
        done = await _turn_ended(sessions)
        assert done.messages[-1].text == "done: v2 synced A-1"
        assert done.state is not None and done.state.last_turn_error is None
    assert ran == ["v2 non_idempotent_write"]


@pytest.mark.parametrize("effect, result", [
    (ToolEffect.READ, "The tool call failed: tool sync_stock changed after the model called it: the call was "
     "recorded as read with no approval, and this Worker's agent defines it as non_idempotent_write needing "
     "approval; call it again to run it under the new definition"),
    (ToolEffect.IDEMPOTENT_WRITE, OUTCOME_UNKNOWN_TEXT),
])
async def test_a_call_cut_off_by_a_deploy_is_not_retried_under_a_stricter_tool(
    tmp_path: Path, db_url: str, effect: ToolEffect, result: str  # noqa: F811 - the fixture
) -> None:
    """The deploy stops the old Worker while its tool runs; the new Worker's tool is a write that needs
    an approval. The retry does not run it: a read fails (it took no effect, so the model may call
    again), an idempotent write that may have taken effect records outcome_unknown. Catches: the new
    write run by CallTool's retry, without approval, with `read` in its context."""
    ran: list[str] = []
    started = asyncio.Event()

    @function_tool(effect=effect, name="sync_stock")
    async def sync_v1(sku: str, context: ToolCallContext) -> str:
        """Sync the stock of a SKU (never returns: the deploy stops it)."""
        ran.append(f"v1 attempt {context.attempt}")
        started.set()
        await asyncio.Event().wait()
        return "never"

    def respond(request: ModelRequest) -> ScriptedModelReply:
        results = ScriptedModelClient.tool_results(request)
        if results:
            return ScriptedModelReply(text=f"done: {results[-1].output}")
        return ScriptedModelReply(tool_calls=[ScriptedToolCall("sync_stock", SKU)])

    @function_tool(effect=ToolEffect.NON_IDEMPOTENT_WRITE, name="sync_stock")
    def sync_v2(sku: str, context: ToolCallContext) -> str:
        """Sync the stock of a SKU, for real."""
        ran.append(f"v2 attempt {context.attempt} {context.effect.value}")
        return f"v2 synced {sku}"

    old, _ = scripted_flow(respond, tools=[lookup_order, sync_v1])
    new, _ = scripted_flow(respond, tools=[lookup_order, sync_v2])
    first = InProcessEngine(tmp_path, [old], url=db_url)
    # A deploy's stop: the running attempt is cancelled at once and fails as WorkerLost, so it is retried.
    first.worker = AsyncWorker(Registry([old]), WorkerOptions(database_url=first.url, shutdown_grace_seconds=0.01,
                                                              **FAST_WORKER))
    async with first.running():
        await first.sessions().start_session("s", "sync A-1")
        await started.wait()
    second = InProcessEngine(tmp_path, [new], url=db_url)
    async with second.running():
        done = await _turn_ended(second.sessions())
        assert [m.tool_output for m in done.messages if m.role is MessageRole.TOOL] == [result]
        assert done.messages[-1].text == f"done: {result}"
        steps = executed_steps(to_step_history(await second.client.get_flow_history("s")))
        assert steps == ["StartAgentSession", "RunModel", "CallTool", "ResumeTurn", "RunModel"]
    assert ran == ["v1 attempt 1"]


async def test_a_relaxed_tool_runs_a_waiting_call_as_it_was_recorded(tmp_path: Path) -> None:
    """A deploy that drops a tool's approval, or makes it a read, leaves the waiting approval in place:
    the call runs once approved, in the Step and with the effect it was recorded with."""
    ran: list[str] = []
    old, _ = scripted_flow(_call_sync_until_it_runs, tools=[lookup_order, _sync_stock(
        ToolEffect.NON_IDEMPOTENT_WRITE, None, ran, "v1")])
    new, _ = scripted_flow(_call_sync_until_it_runs, tools=[lookup_order, _sync_stock(
        ToolEffect.READ, None, ran, "v2")])
    first = InProcessEngine(tmp_path, [old])
    async with first.running():
        sessions = first.sessions()
        await sessions.start_session("s", "sync A-1")
        waiting = await _pending(sessions, InterruptKind.TOOL_APPROVAL, "sync_stock")
    second = InProcessEngine(tmp_path, [new])
    async with second.running():
        sessions = second.sessions()
        assert await sessions.resolve_interrupt("s", waiting, approved=True)
        answer = await _pending(sessions, InterruptKind.QUESTION, "sync_stock")
        assert await sessions.answer_question("s", answer, "north")
        done = await _turn_ended(sessions)
        assert done.messages[-1].text == "done: v2 synced A-1"
    assert ran == ["v2 non_idempotent_write"]


async def test_an_approval_for_a_removed_tool_fails_as_unknown_and_the_session_goes_on(tmp_path: Path) -> None:
    """The approval waits across a deploy that removed the tool: approving it records the call failed
    as `unknown tool <name>` (it never ran), the turn ends with the model's answer, and the next turn
    runs. Catches: a Worker crash loop or a stuck turn on a call its runner does not know."""
    def respond(request: ModelRequest) -> ScriptedModelReply:
        results = ScriptedModelClient.tool_results(request)
        if results:
            return ScriptedModelReply(text=f"result: {results[-1].output}")
        text = ScriptedModelClient.user_texts(request)[-1]
        if text == "refund":
            refund = ScriptedToolCall("refund_order", {"order_id": "A", "amount_cents": 5})
            return ScriptedModelReply(tool_calls=[refund])
        return ScriptedModelReply(text=f"echo: {text}")

    old, _ = scripted_flow(respond, tools=[lookup_order, refund_order])
    new, _ = scripted_flow(respond, tools=[lookup_order])
    first = InProcessEngine(tmp_path, [old])
    async with first.running():
        sessions = first.sessions()
        await sessions.start_session("s", "refund")
        waiting = await _pending(sessions, InterruptKind.TOOL_APPROVAL, "refund_order")
    second = InProcessEngine(tmp_path, [new])
    async with second.running():
        sessions = second.sessions()
        assert await sessions.resolve_interrupt("s", waiting, approved=True)
        done = await _turn_ended(sessions)
        assert done.messages[-1].text == "result: The tool call failed: unknown tool refund_order"
        assert done.state is not None and done.state.last_turn_error is None
        await sessions.send_user_message("s", "hello")
        after = await wait_for_agent_snapshot(
            sessions, "s", lambda s: s if s.state is not None and s.state.turn_count >= 2 else None,
            description="the second turn to end")
        assert after.messages[-1].text == "echo: hello"


def _recorded(effect: ToolEffect, requires_approval: bool) -> AgentToolCall:
    return AgentToolCall(
        tool_call_id="c", turn_id="turn-1", tool_name="sync_stock", arguments="{}", effect=effect,
        requires_approval=requires_approval, status=AgentToolCallStatus.APPROVED, output=None, error=None,
        rejection_message=None, deferral_order=0, tool_source_reference=None, trace_context=None,
    )


R, IW, NW, U = (ToolEffect.READ, ToolEffect.IDEMPOTENT_WRITE, ToolEffect.NON_IDEMPOTENT_WRITE,
                ToolEffect.UNCLASSIFIED)


@pytest.mark.parametrize("recorded, approved, now, stricter", [
    (R, False, ToolPolicy(R), False),
    (NW, True, ToolPolicy(NW), False),
    (NW, True, ToolPolicy(U), False),  # both run once, with an approval
    (U, True, ToolPolicy(NW, requires_approval=False), False),
    (IW, False, ToolPolicy(R), False),
    (R, True, ToolPolicy(R, requires_approval=False), False),
    (R, False, ToolPolicy(IW), True),  # its failures would be recorded failed, not outcome_unknown
    (R, False, ToolPolicy(R, requires_approval=True), True),
    (IW, False, ToolPolicy(NW, requires_approval=False), True),
    (NW, False, ToolPolicy(NW), True),
])
def test_stricter_policy_problem_names_only_a_stricter_tool(
    recorded: ToolEffect, approved: bool, now: ToolPolicy, stricter: bool
) -> None:
    """A call runs as recorded unless its tool now asks for an approval it did not get or repeats less."""
    problem = stricter_policy_problem(_recorded(recorded, approved), now)
    assert (problem is not None) is stricter


def test_session_options_that_loosen_a_function_tool_are_refused_when_the_flow_is_built() -> None:
    """Options whose policy for a function tool differs from the definition's would record every call
    of it under one policy and then refuse to run it under the other: refused once, naming the tool."""
    definition = AgentDefinition(name="a", model=ScriptedModelClient(lambda _: ScriptedModelReply(text="ok")),
                                 instructions="x", tools=[lookup_order, refund_order])
    runner = BuiltinLoopAgentRunner(definition)
    loose = replace(builtin_agent_session_options(definition),
                    tool_policies={**definition.merged_tool_policies(), "refund_order": ToolPolicy(ToolEffect.READ)})
    with pytest.raises(ValueError) as raised:
        AgentSessionFlow(runner, "Loose", loose)
    text = str(raised.value)
    assert "refund_order (read with no approval in the options, non_idempotent_write needing approval in the " \
           "definition)" in text and "builtin_agent_session_options(definition)" in text
    assert "lookup_order" not in text
    with pytest.raises(ValueError, match=r"lookup_order \(unclassified needing approval in the options, read"):
        AgentSessionFlow(runner, "Defaults", AgentSessionOptions())
    # The options the definition implies, and any replace() of their other fields, are taken.
    AgentSessionFlow(runner, "Derived", replace(builtin_agent_session_options(definition), message_window_size=8))
