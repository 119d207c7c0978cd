"""Samples the docs and seeds show, run as written (or as close as this engine allows).

Seed 004's session Flow (the built-in loop's guide) is built with the names it uses; seed 003's
"Testing an adapter" test runs in a package of its own, with its Worker child. Every python block of
docs/agents.md runs too, with stand-ins for the names it leaves to the reader.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import re
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from agents.tests.builtin_agent import InProcessEngine, scripted_flow

import dex_engine
from dex_agents import AgentSessionClient, AgentSessionFlow, AgentSnapshot, BuiltInTool, CompactionPolicy, PlanStatus
from dex_agents.builtin_loop import (
    AgentDefinition,
    BuiltinLoopAgentRunner,
    ModelRequest,
    ScriptedModelClient,
    ScriptedModelReply,
    ScriptedToolCall,
    builtin_agent_session_flow,
    stepwise_agent_session_flow,
)
from dex_agents.testing import EXECUTE_COMPLETED_EVENT, AgentTestStack, wait_for_agent_snapshot, wait_until
from dex_engine import AsyncClient, FlowNotActiveOrNotFoundError, Registry


def _reply(request: ModelRequest) -> ScriptedModelReply:
    return ScriptedModelReply(text=f"Demo reply: {ScriptedModelClient.user_texts(request)[-1]}")


def build_ai_agent_session_flow(
    models: Sequence[str], system_prompt: str, context_window_tokens: int
) -> AgentSessionFlow:
    """Seed 004's build_ai_agent_session_flow, without the MCP and Slack tool sources (not built here)."""
    clients = {model: ScriptedModelClient(_reply) for model in models}
    definition = AgentDefinition(
        name="ai-agent",
        instructions=system_prompt,
        model=clients[models[0]],
        resolve_model=lambda settings: clients.get(str(settings.get("model")), clients[models[0]]),
        tool_sources=[],
        built_in_tools=frozenset(BuiltInTool),
        plan_mode_enabled=True,
        compaction=CompactionPolicy(context_window_tokens=context_window_tokens),
    )
    return stepwise_agent_session_flow(definition, flow_type="AIAgentSession")


async def test_seed_004_builds_its_session_flow_with_the_names_it_uses(tmp_path: Path) -> None:
    """Seed 004 builds its agent with stepwise_agent_session_flow, seed 003 with
    builtin_agent_session_flow: one function under both names. Catches: the seed's name did not exist,
    so its example failed to import; and its /events route catches FlowNotActiveOrNotFoundError."""
    assert stepwise_agent_session_flow is builtin_agent_session_flow
    flow = build_ai_agent_session_flow(["demo/dex", "demo/dex-mini"], "You help.", 128_000)
    engine = InProcessEngine(tmp_path, [flow])
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("ai-agent-1", "hello", session_settings={"model": "demo/dex-mini"})
        snapshot = await wait_for_agent_snapshot(
            sessions, "ai-agent-1", lambda s: s if len(s.messages) == 2 else None, description="the reply")
        assert snapshot.messages[-1].text == "Demo reply: hello"
        with pytest.raises(FlowNotActiveOrNotFoundError):
            await sessions.get_agent_snapshot("ai-agent-missing")
        await engine.client.stop_flow("ai-agent-1")
        with pytest.raises(FlowNotActiveOrNotFoundError):
            await sessions.send_user_message("ai-agent-1", "are you there?")


# Seed 003 "Testing an adapter": its two files and its test, as an adapter package would have them.

MY_AGENT = '''
from dex_agents import ToolEffect
from dex_agents.builtin_loop import (
    AgentDefinition, ModelRequest, ScriptedModelClient, ScriptedModelReply, ScriptedToolCall,
    builtin_agent_session_flow, function_tool,
)


@function_tool(effect=ToolEffect.NON_IDEMPOTENT_WRITE)
def refund_order(order_id: str) -> str:
    """Refund an order."""
    return f"refunded order {order_id}"


def _respond(request: ModelRequest) -> ScriptedModelReply:
    if ScriptedModelClient.tool_results(request):
        return ScriptedModelReply(text="done")
    return ScriptedModelReply(tool_calls=[ScriptedToolCall("refund_order", {"order_id": "7"})])


def build_flow():
    agent = AgentDefinition(name="my-agent", instructions="Refund what is asked.",
                            model=ScriptedModelClient(_respond), tools=[refund_order])
    return builtin_agent_session_flow(agent, "MyAgentSession")
'''

MY_WORKER = '''
# tests/my_worker.py: the Worker child.
from dex_agents.testing import run_agent_worker
from tests.my_agent import build_flow

if __name__ == "__main__":
    run_agent_worker([build_flow()])
'''


async def test_seed_003_testing_an_adapter_sample_runs_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seed 003's "Testing an adapter" test, as written, in a package of its own (tests/my_agent.py,
    tests/my_worker.py): the kit's names and arguments an adapter's own tests call (AgentTestStack's
    positional module name, worker_cwd and worker_env, start_worker, kill, sessions,
    wait_for_agent_snapshot's description, read_step_history, EXECUTE_COMPLETED_EVENT). The seed's
    test ends at reading the history; here the turn then ends with the write run once, after the kill.
    Catches: a renamed or reordered argument or name of the kit, which every adapter's tests would hit."""
    package_dir = tmp_path / "package"
    (package_dir / "tests").mkdir(parents=True)
    (package_dir / "tests" / "my_agent.py").write_text(MY_AGENT)
    (package_dir / "tests" / "my_worker.py").write_text(MY_WORKER)
    monkeypatch.syspath_prepend(str(package_dir))
    for name in [m for m in sys.modules if m == "tests" or m.startswith("tests.")]:
        monkeypatch.delitem(sys.modules, name)
    from tests.my_agent import build_flow  # type: ignore[import-not-found]  # written above

    PACKAGE_DIR = package_dir  # the seed's name for it

    # The seed's test body, as written.
    flow = build_flow()
    async with AgentTestStack(tmp_path, [flow], "tests.my_worker",
                              worker_cwd=PACKAGE_DIR,
                              worker_env={"MY_STATE_DIR": str(tmp_path)}) as stack:
        sessions = stack.sessions(flow)
        worker = await stack.start_worker()
        await sessions.start_session("session-1", "refund order 7")
        interrupt = await wait_for_agent_snapshot(
            sessions, "session-1",
            lambda snapshot: next(iter(snapshot.pending_interrupts), None),
            description="a pending approval")
        worker.kill()                    # SIGKILL while the session waits
        await stack.start_worker()       # replacement Worker
        assert await sessions.resolve_interrupt(
            "session-1", interrupt.interrupt_id, approved=True)
        history = await stack.read_step_history("session-1")
        executed = [entry.step_type for entry in history
                    if entry.event_type == EXECUTE_COMPLETED_EVENT]

        # What the seed's test leads up to: the approved write runs once and the turn ends.
        assert executed[:2] == ["StartAgentSession", "RunModel"]
        snapshot = await wait_for_agent_snapshot(
            sessions, "session-1",
            lambda s: s if s.state is not None and s.state.turn_count == 1 and s.state.active_turn_id is None
            else None,
            description="the turn's end")
        assert snapshot.messages[-1].text == "done"
        history = await stack.read_step_history("session-1")
        executed = [entry.step_type for entry in history if entry.event_type == EXECUTE_COMPLETED_EVENT]
        assert executed == ["StartAgentSession", "RunModel", "AwaitToolApproval", "CallSingleAttemptTool",
                            "ResumeTurn", "RunModel"]
        tool_messages = [m.tool_output for m in snapshot.messages if m.tool_call_id is not None and m.tool_output]
        assert tool_messages == ["refunded order 7"]


# docs/agents.md's samples, run as written; the names they leave to the reader (a runner, a model,
# the application's services, a session client) are given to them as stand-ins.

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "agents.md"


def guide_samples(heading: str) -> list[str]:
    """The python blocks of the docs/agents.md section `## heading`, in order."""
    sections = re.split(r"^## ", GUIDE.read_text(), flags=re.M)
    (section,) = [s for s in sections if s.startswith(heading + "\n")]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


async def run_sample(code: str, namespace: dict[str, Any]) -> None:
    """Run `code` in `namespace` as a notebook would: top-level awaits allowed."""
    compiled = compile(code, str(GUIDE), "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    result = eval(compiled, namespace)
    if inspect.iscoroutine(result):
        await result


def _echo(request: ModelRequest) -> ScriptedModelReply:
    return ScriptedModelReply(text=f"echo: {ScriptedModelClient.user_texts(request)[-1]}")


async def test_running_an_agent_sample_runs_its_worker_and_its_session_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/agents.md "Running an agent". Catches: the sample made an AsyncWorker and never ran it,
    so a reader's session never left StartAgentSession."""
    ran: list[str] = []

    class RecordingWorker(dex_engine.AsyncWorker):
        async def run(self) -> None:
            ran.append(self.worker_id)
            await super().run()

    monkeypatch.setattr(dex_engine, "AsyncWorker", RecordingWorker)  # the sample imports it from there
    monkeypatch.chdir(tmp_path)  # the sample's relative sqlite:///agents.db
    agent = AgentDefinition(name="triage", instructions="You triage tickets.", model=ScriptedModelClient(_echo))
    namespace: dict[str, Any] = {"MyFrameworkRunner": BuiltinLoopAgentRunner, "agent": agent}
    (sample,) = guide_samples("Running an agent")
    try:
        await run_sample(sample, namespace)
    finally:
        if "sessions" in namespace:
            await namespace["sessions"].client.close()
    assert len(ran) == 1, "the sample's worker never ran"
    assert isinstance(namespace["snapshot"], AgentSnapshot)

    engine = InProcessEngine(tmp_path, [namespace["flow"]], url="sqlite:///agents.db")
    async with engine.running():
        snapshot = await wait_for_agent_snapshot(
            engine.sessions(), "session-42", lambda s: s if len(s.messages) == 2 else None, description="the reply")
    assert [m.text for m in snapshot.messages] == ["Find my open tickets", "echo: Find my open tickets"]


async def test_built_in_loop_sample_reads_and_refunds_with_the_documented_idempotency_key(tmp_path: Path) -> None:
    """docs/agents.md "The built-in loop": the two function tools as written, with stand-in order and
    payment services; the refund waits for approval and gets `<session>/<turn>/<tool call>` as its
    idempotency key, as "Effects, approvals and what a crash does" says."""
    refunds: list[tuple[str, int, str]] = []

    class Orders:
        async def get(self, order_id: str) -> dict[str, str]:
            return {"order_id": order_id, "status": "shipped"}

    class Payments:
        async def refund(self, order_id: str, amount_cents: int, *, idempotency_key: str) -> str:
            refunds.append((order_id, amount_cents, idempotency_key))
            return f"refunded {amount_cents} on {order_id}"

    def respond(request: ModelRequest) -> ScriptedModelReply:
        results = ScriptedModelClient.tool_results(request)
        if not results:
            return ScriptedModelReply(tool_calls=[ScriptedToolCall("lookup_order", {"order_id": "A-1"}, "c1")])
        if results[-1].tool_name == "lookup_order":
            return ScriptedModelReply(
                tool_calls=[ScriptedToolCall("refund_order", {"order_id": "A-1", "amount_cents": 150}, "c2")])
        return ScriptedModelReply(text=results[-1].output)

    namespace: dict[str, Any] = {"orders": Orders(), "payments": Payments(), "model": ScriptedModelClient(respond)}
    (sample,) = guide_samples("The built-in loop")
    await run_sample(sample, namespace)
    engine = InProcessEngine(tmp_path, [namespace["flow"]])
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s-1", "refund A-1")
        interrupt = await wait_for_agent_snapshot(
            sessions, "s-1", lambda s: next(iter(s.pending_interrupts), None), description="the refund's approval")
        assert await sessions.resolve_interrupt("s-1", interrupt.interrupt_id, approved=True)
        snapshot = await wait_for_agent_snapshot(
            sessions, "s-1", lambda s: s if s.messages[-1].text else None, description="the answer")
    assert snapshot.messages[-1].text == "refunded 150 on A-1"
    assert refunds == [("A-1", 150, "s-1/turn-1/c2")]


class TurnWaitingSessions:
    """A session client whose send_user_message returns once the turn it starts has ended, so a
    sample that reads the snapshot right after sending reads that turn's result."""

    def __init__(self, sessions: AgentSessionClient) -> None:
        self._sessions = sessions

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sessions, name)

    async def send_user_message(self, session_id: str, text: str, *, plan_mode: bool = False) -> bool:
        before = (await self._sessions.get_agent_snapshot(session_id)).state
        turns = before.turn_count if before is not None else 0
        sent = await self._sessions.send_user_message(session_id, text, plan_mode=plan_mode)
        await wait_for_agent_snapshot(
            self._sessions, session_id,
            lambda s: s if s.state is not None and s.state.turn_count > turns and s.state.active_turn_id is None
            else None,
            description="the turn's end")
        return sent


def _plan_then_answer(request: ModelRequest) -> ScriptedModelReply:
    if ScriptedModelClient.tool_results(request):
        return ScriptedModelReply(text="planned")
    todos = [{"content": "copy the tables", "status": "pending"}]
    return ScriptedModelReply(tool_calls=[ScriptedToolCall("write_todos", {"todos": todos})])


async def test_plan_mode_sample_drafts_and_executes_a_plan(tmp_path: Path) -> None:
    """docs/agents.md "Plans and plan mode": the sample's calls draft a plan and approve it, which
    starts the executing turn with the documented note; its comment's False when plan mode is off."""
    planner, _ = scripted_flow(_plan_then_answer, "Planner", plan_mode_enabled=True)
    chat, _ = scripted_flow(_echo, "Chat")
    engine = InProcessEngine(tmp_path, [planner, chat])
    async with engine.running():
        sessions = engine.sessions(planner)
        await sessions.start_session("s-42")
        (sample,) = guide_samples("Plans and plan mode")
        await run_sample(sample, {"sessions": TurnWaitingSessions(sessions)})
        snapshot = await wait_for_agent_snapshot(
            sessions, "s-42",
            lambda s: s if s.state is not None and s.state.turn_count == 2 and s.state.active_turn_id is None else None,
            description="the executing turn's end")
        assert snapshot.plan is not None and snapshot.plan.status is PlanStatus.ACTIVE
        approved = ("[Dex] The user approved plan revision 1. Execute it and keep the task statuses current "
                    "with write_todos.")
        assert approved in [m.text for m in snapshot.messages]

        chat_sessions = engine.sessions(chat)
        await chat_sessions.start_session("s-43")
        assert await chat_sessions.send_user_message("s-43", "Plan the migration", plan_mode=True) is False


async def test_steering_sample_steers_deletes_and_cancels_as_described(tmp_path: Path) -> None:
    """docs/agents.md "Steering and cancellation": during a model call with two queued messages, the
    sample steers with the first and with new text, deletes the second, and cancels the turn; the
    steered messages then start the next turn and the deleted one is gone."""
    entered = asyncio.Event()
    release = asyncio.Event()

    async def respond(request: ModelRequest) -> ScriptedModelReply:
        entered.set()
        await release.wait()
        return _echo(request)

    flow, _ = scripted_flow(respond, "Steered")
    engine = InProcessEngine(tmp_path, [flow])
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s-42", "first")
        await asyncio.wait_for(entered.wait(), 30)
        assert await sessions.send_user_message("s-42", "queued one")
        assert await sessions.send_user_message("s-42", "queued two")
        (sample,) = guide_samples("Steering and cancellation")
        await run_sample(sample, {"sessions": sessions})
        release.set()
        snapshot = await wait_for_agent_snapshot(
            sessions, "s-42", lambda s: s if s.messages[-1].text and s.messages[-1].text.startswith("echo") else None,
            description="the steered turn's answer")
    assert [m.text for m in snapshot.messages] == [
        "first", "queued one", "Use the staging account instead", "echo: Use the staging account instead"]
    assert snapshot.queued_messages == []


async def test_testing_an_adapter_sample_runs_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/agents.md "Testing an adapter": its Worker module and its test, in a package of their
    own beside seed 003's tests/my_agent.py (MY_AGENT above)."""
    worker_module, test_module = guide_samples("Testing an adapter")
    package_dir = tmp_path / "package"
    (package_dir / "tests").mkdir(parents=True)
    (package_dir / "tests" / "my_agent.py").write_text(MY_AGENT)
    (package_dir / "tests" / "my_worker.py").write_text(worker_module)
    monkeypatch.syspath_prepend(str(package_dir))
    monkeypatch.chdir(package_dir)  # the Worker child runs `python -m tests.my_worker` from here
    for name in [m for m in sys.modules if m == "tests" or m.startswith("tests.")]:
        monkeypatch.delitem(sys.modules, name)
    namespace: dict[str, Any] = {}
    await run_sample(test_module, namespace)
    await namespace["test_write_survives_a_worker_kill"](tmp_path / "state")


# "A Worker process and its clients": its worker.py, as written, run as a process of its own beside a
# myapp/agent.py whose refund runs until the test releases it; its client sample in this process.

MYAPP_AGENT = '''
import time
from pathlib import Path

from dex_agents import ToolEffect
from dex_agents.builtin_loop import (
    AgentDefinition, ModelRequest, ScriptedModelClient, ScriptedModelReply, ScriptedToolCall,
    builtin_agent_session_flow, function_tool,
)


@function_tool(effect=ToolEffect.NON_IDEMPOTENT_WRITE)
def refund_order(order_id: str) -> str:
    """Refund an order: marks its start, then runs until the test releases it."""
    with open("refunds.log", "a") as log:
        log.write(order_id + "\\n")
    while not Path("release").exists():
        time.sleep(0.05)
    return f"refunded order {order_id}"


def _respond(request: ModelRequest) -> ScriptedModelReply:
    if results := ScriptedModelClient.tool_results(request):
        return ScriptedModelReply(text=results[0].output)
    order_id = ScriptedModelClient.user_texts(request)[-1].split()[-1]
    return ScriptedModelReply(tool_calls=[ScriptedToolCall("refund_order", {"order_id": order_id})])


flow = builtin_agent_session_flow(
    AgentDefinition(name="refunds", instructions="Refund what is asked.", model=ScriptedModelClient(_respond),
                    tools=[refund_order]),
    flow_type="RefundAgent",
)
'''


def _write_worker_app(app_dir: Path, worker_sample: str) -> None:
    (app_dir / "worker.py").write_text(worker_sample)
    (app_dir / "myapp").mkdir()
    (app_dir / "myapp" / "__init__.py").write_text("")
    (app_dir / "myapp" / "agent.py").write_text(MYAPP_AGENT)


@pytest.mark.slow
@pytest.mark.sqlite_only
async def test_worker_process_sample_stops_on_sigterm_after_its_running_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The guide's worker.py, run as `python worker.py`, and its client sample, which finds the session
    waiting for approval with search_flows and approves it. SIGTERM while that approved write runs
    lets the write finish and the process exit 0, so a deploy's stop records the write `succeeded`
    (Python's default SIGTERM ends the process at once and leaves it `outcome_unknown`); a second
    Worker started the same way ends the turn. Catches: a sample that never ran its Worker, or whose
    stop left a running write to the lease's expiry."""
    worker_sample, client_sample = guide_samples("A Worker process and its clients")
    assert worker_sample.startswith("# worker.py\n")
    _write_worker_app(tmp_path, worker_sample)
    monkeypatch.chdir(tmp_path)  # the samples' relative sqlite:///agents.db, and the refund's files
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "myapp" or m.startswith("myapp.")]:
        monkeypatch.delitem(sys.modules, name)
    from myapp.agent import flow  # type: ignore[import-not-found]  # written above

    def start_worker() -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, "worker.py"], cwd=tmp_path, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    sessions = AgentSessionClient(AsyncClient(Registry([flow]), "sqlite:///agents.db"), flow)
    namespace: dict[str, Any] = {"AgentSessionClient": AgentSessionClient, "AsyncClient": AsyncClient,
                                 "Registry": Registry, "flow": flow}
    workers = [start_worker()]
    try:
        await sessions.start_session("session-42", "Refund order 7")
        await wait_for_agent_snapshot(
            sessions, "session-42", lambda s: next(iter(s.pending_interrupts), None), description="the approval")
        await run_sample(client_sample, namespace)  # approves it; its own message waits in the queue
        assert namespace["events"].events and namespace["resume_token"] == namespace["events"].resume_token
        await wait_until("the refund to start", lambda: (tmp_path / "refunds.log").exists() or None)

        workers[0].send_signal(signal.SIGTERM)
        await asyncio.sleep(0.5)
        assert workers[0].poll() is None, "the Worker left while its write ran"
        (tmp_path / "release").touch()
        output, _ = await asyncio.to_thread(workers[0].communicate, timeout=30)
        assert workers[0].returncode == 0, output

        workers.append(start_worker())
        snapshot = await wait_for_agent_snapshot(
            sessions, "session-42", lambda s: s if "refunded order 7" in [m.text for m in s.messages] else None,
            description="the first turn's answer")
        outputs = [m.tool_output for m in snapshot.messages if m.tool_name == "refund_order" and m.tool_output]
        assert outputs == ["refunded order 7"]
        workers[1].send_signal(signal.SIGTERM)
        output, _ = await asyncio.to_thread(workers[1].communicate, timeout=30)
        assert workers[1].returncode == 0, output
        assert (tmp_path / "refunds.log").read_text().splitlines()[0] == "7"
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
        await sessions.client.close()
        if "sessions" in namespace:
            await namespace["sessions"].client.close()


def test_every_python_sample_of_the_agents_guide_is_run_above() -> None:
    """A python block added to docs/agents.md outside these sections would go untested."""
    tested = ["Running an agent", "The built-in loop", "A Worker process and its clients", "Plans and plan mode",
              "Steering and cancellation", "Testing an adapter"]
    every = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S)
    assert [sample for heading in tested for sample in guide_samples(heading)] == every
