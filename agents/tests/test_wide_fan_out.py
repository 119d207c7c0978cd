"""One model response that asks for many tool calls at once, on a real in-process Worker on SQLite
and on PostgreSQL (TEST_PG_DSN): the built-in loop with a ScriptedModelClient at the model edge."""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import pytest
from agents.tests.built_context import step_context
from agents.tests.builtin_agent import InProcessEngine, scripted_flow
from engine.tests.conftest import db_url, pg_database, pg_databases  # noqa: F401 - the fixtures used here

from dex_agents import PENDING_INTERRUPTS, AgentInterrupt, AgentSnapshot, AgentToolCallStatus, InterruptKind, ToolEffect
from dex_agents._constants import RUN_MODEL
from dex_agents._turn_steps import _store_interrupts, _store_interrupts_one_by_one
from dex_agents.builtin_loop import (
    ModelRequest,
    ScriptedModelClient,
    ScriptedModelReply,
    ScriptedToolCall,
    function_tool,
)
from dex_agents.testing import wait_for_agent_snapshot
from dex_engine import MAX_VALUE_BYTES

# Runs of each tool call by its n, in this process (the Worker runs here).
RUNS: Counter[str] = Counter()


@function_tool(effect=ToolEffect.READ)
async def fan_read(n: int) -> str:
    """Read item n."""
    RUNS[f"read {n}"] += 1
    await asyncio.sleep(0)
    return f"read {n}"


@function_tool(effect=ToolEffect.NON_IDEMPOTENT_WRITE, requires_approval=True)
def fan_write(n: int, pad: str) -> str:
    """Write item n."""
    RUNS[f"write {n}"] += 1
    return f"wrote {n}"


def fan_out(request: ModelRequest) -> ScriptedModelReply:
    """`read N` or `write N PAD` asks for N calls in one response; then it lists the results it got."""
    results = ScriptedModelClient.tool_results(request)
    if results:
        return ScriptedModelReply(text=" ".join(f"{r.tool_call_id}:{r.output}" for r in results))
    text = ScriptedModelClient.user_texts(request)[-1]
    if not text.startswith(("read ", "write ")):
        return ScriptedModelReply(text=f"echo: {text}")
    kind, count, *pad = text.split()
    calls = [ScriptedToolCall(f"fan_{kind}", {"n": n, **({"pad": "p" * int(pad[0])} if pad else {})},
                              tool_call_id=f"c{n:03d}") for n in range(int(count))]
    return ScriptedModelReply(tool_calls=calls)


def _turns_ended(count: int):  # type: ignore[no-untyped-def]
    def probe(s: AgentSnapshot) -> AgentSnapshot | None:
        ended = s.state is not None and s.state.turn_count == count and s.state.active_turn_id is None
        return s if ended else None

    return probe


async def test_two_hundred_reads_of_one_response_each_run_once_and_return_in_model_order(
    tmp_path: Path, db_url: str  # noqa: F811
) -> None:
    """200 read calls in one response: all run, each once; the next model call gets every result,
    in the order the model asked (deferral_order), whatever order they finished in."""
    RUNS.clear()
    flow, _ = scripted_flow(fan_out, tools=[fan_read])
    engine = InProcessEngine(tmp_path, [flow], db_url)
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s", "read 200")
        snapshot = await wait_for_agent_snapshot(sessions, "s", _turns_ended(1), description="the turn to end")
        assert snapshot.state is not None and snapshot.state.last_turn_error is None
        assert Counter({f"read {n}": 1 for n in range(200)}) == RUNS
        assert snapshot.messages[-1].text == " ".join(f"c{n:03d}:read {n}" for n in range(200))


async def test_approvals_past_the_value_limit_fail_their_calls_and_the_rest_resolve_concurrently(
    tmp_path: Path, db_url: str  # noqa: F811
) -> None:
    """40 writes needing approval with 40 KB arguments each (1.6 MB, over the 1 MiB PendingInterrupts
    value): the approvals that fit are raised in model order; each call left out fails at once,
    never run, with an error the model sees. Approving all raised ones concurrently from as many
    tasks lands each once (RpcLockConflictError retried), every approved write runs once, the turn
    completes, and the session takes the next turn."""
    RUNS.clear()
    flow, _ = scripted_flow(fan_out, tools=[fan_write])
    engine = InProcessEngine(tmp_path, [flow], db_url)
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s", "write 40 40000")
        waiting = await wait_for_agent_snapshot(
            sessions, "s", lambda s: s if s.tool_calls and s.pending_interrupts else None, description="approvals")
        raised = [i.interrupt_id for i in waiting.pending_interrupts]
        calls = {c.tool_call_id: c for c in waiting.tool_calls}
        assert 0 < len(raised) < 40 and raised == [f"c{n:03d}" for n in range(len(raised))]
        left_out = [c for c in waiting.tool_calls if c.tool_call_id not in raised]
        assert {c.status for c in left_out} == {AgentToolCallStatus.FAILED}
        assert all(c.error is not None and c.error.startswith(
            "its approval request does not fit with the turn's other pending interrupts") and
            f"value limit of {MAX_VALUE_BYTES}); the call was not run" in c.error for c in left_out)
        assert {calls[i].status for i in raised} == {AgentToolCallStatus.AWAITING_APPROVAL}

        approved = await asyncio.gather(*(sessions.resolve_interrupt("s", i, approved=True) for i in raised))
        assert approved == [True] * len(raised)
        snapshot = await wait_for_agent_snapshot(sessions, "s", _turns_ended(1), description="the turn to end")
        assert Counter({f"write {int(i[1:])}": 1 for i in raised}) == RUNS
        results = re.split(r" (?=c\d{3}:)", snapshot.messages[-1].text or "")
        assert len(results) == 40
        assert all(f"wrote {n}" in results[n] for n in range(len(raised)))
        assert all("does not fit" in r for r in results[len(raised):])
        await sessions.send_user_message("s", "hello")
        after = await wait_for_agent_snapshot(sessions, "s", _turns_ended(2), description="the next turn")
        assert after.messages[-1].text == "echo: hello"


def _interrupt(n: int, arguments_chars: int) -> AgentInterrupt:
    return AgentInterrupt(interrupt_id=f"c{n:04d}", kind=InterruptKind.TOOL_APPROVAL, tool_call_id=f"c{n:04d}",
                          tool_name="fan_write", arguments="a" * arguments_chars, created_at="2026-01-01T00:00:00Z",
                          deadline=None)


def test_raising_thousands_of_approvals_encodes_pending_interrupts_a_few_times_not_once_each() -> None:
    """Every set of PendingInterrupts encodes and checks the whole list: RunModel's commit set it once
    per interrupt, so 3,000 approvals of one response took seconds of the Worker's event loop (every
    session of that Worker stalled). Catches: a set per interrupt, whether or not all fit."""
    flow, _ = scripted_flow(fan_out, tools=[fan_write])
    for count, chars in ((3000, 10), (3000, 600)):  # all fit; then the last ~1,400 do not
        ctx = step_context(flow, RUN_MODEL, {("PendingInterrupts", ""): [_interrupt(9999, 10)]})
        sets: list[int] = []
        original = ctx.set

        def counting_set(ref: Any, value: Any, original: Any = original, sets: list[int] = sets) -> None:
            sets.append(len(value))
            original(ref, value)

        ctx.set = counting_set  # type: ignore[method-assign]
        raised, unfit = _store_interrupts(ctx, [_interrupt(n, chars) for n in range(count)])
        assert len(sets) <= 2
        stored = ctx.get(PENDING_INTERRUPTS)
        assert stored is not None and stored[1:] == raised and len(raised) + len(unfit) == count


def _sized(n: int, size: int) -> AgentInterrupt:
    """Interrupt n whose JSON is exactly `size` bytes."""
    return _interrupt(n, size - len(msgspec.json.encode(_interrupt(n, 0))))


@pytest.mark.parametrize("over", [0, 1])
def test_interrupts_raised_on_an_empty_list_count_its_brackets_and_commas_to_the_byte(over: int) -> None:
    """With none pending, the sum of sizes counts the brackets once and a comma between each two: a
    list of exactly MAX_VALUE_BYTES is raised whole, and one byte over leaves out the call that does
    not fit, found in two sets of PendingInterrupts (no set per interrupt). Catches: the fit decided
    a byte off at the limit, or the commas missed until the store falls back to a set per interrupt."""
    flow, _ = scripted_flow(fan_out, tools=[fan_write])
    third = (MAX_VALUE_BYTES - 4) // 3  # three interrupts: 2 brackets and 2 commas
    first, second = _sized(0, third), _sized(1, third)
    last = _sized(2, MAX_VALUE_BYTES - 4 - 2 * third + over)
    small = _sized(3, 1000)  # fits beside the first two, never beside all three: the first set fails
    ctx = step_context(flow, RUN_MODEL, {("PendingInterrupts", ""): []})
    sets: list[int] = []
    original = ctx.set

    def counting_set(ref: Any, value: Any) -> None:
        sets.append(len(value))
        original(ref, value)

    ctx.set = counting_set  # type: ignore[method-assign]
    raised, unfit = _store_interrupts(ctx, [first, second, last, small])
    expected, left_out = ([first, second, last], small) if over == 0 else ([first, second, small], last)
    assert (raised, list(unfit)) == (expected, [left_out.tool_call_id])
    assert ctx.get(PENDING_INTERRUPTS) == expected and len(sets) == 2
    if over == 0:
        assert len(msgspec.json.encode(expected)) == MAX_VALUE_BYTES


def test_the_approvals_raised_past_the_value_limit_are_those_the_engine_check_keeps() -> None:
    """Interrupts of mixed sizes, some over what is left: the ones raised and each left-out call's
    error (its size and the limit) are the same as setting the list one interrupt at a time, as the
    engine checks it, and the stored list is the largest that fits."""
    flow, _ = scripted_flow(fan_out, tools=[fan_write])
    existing = [_interrupt(9999, 300_000)]
    interrupts = [_interrupt(n, [150_000, 20, 400_000, 90_000][n % 4]) for n in range(24)]
    fast = step_context(flow, RUN_MODEL, {("PendingInterrupts", ""): existing})
    slow = step_context(flow, RUN_MODEL, {("PendingInterrupts", ""): existing})
    assert _store_interrupts(fast, interrupts) == _store_interrupts_one_by_one(slow, existing, interrupts)
    assert fast.get(PENDING_INTERRUPTS) == slow.get(PENDING_INTERRUPTS)
    raised, unfit = _store_interrupts(step_context(flow, RUN_MODEL, {("PendingInterrupts", ""): existing}),
                                      interrupts)
    assert 0 < len(raised) < len(interrupts) and unfit
    assert len(msgspec.json.encode([*existing, *raised])) <= MAX_VALUE_BYTES
