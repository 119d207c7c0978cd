"""Seeded chaos: random client calls, Worker kills, stops and freezes against live sessions, then invariants.

For each seed, a session (sometimes two at once) of one of chaos_agent.py's Flows (a runner that
stores a turn's items when it ends, one that stores them as they appear, one whose approvals expire)
runs turns whose scripted model calls take a while and call tools of every effect: a read, an
idempotent write, a single-attempt write and a write that needs approval, some of which ask the user
first. A driver draws, from the seed, a schedule of send_user_message, steer_user_message (new text,
or a queued message by its ID), cancel_turn (the active turn, by its ID, or another),
resolve_interrupt (approve or reject, sometimes twice, sometimes an interrupt seen earlier),
answer_question and declines, delete_queued_message, and, for the Worker child: SIGKILL (a standby
becomes the next Worker), SIGTERM (a graceful stop while a new Worker starts) and SIGSTOP (frozen
until its leases expire and a new Worker takes over, after which it runs on beside that one);
sometimes a second Worker claims beside the first from the start. Every snapshot read meanwhile must
be consistent. Then the driver answers every approval and question until the session is idle, and
checks the transcript, the events, the Step history and the InvocationLog the runner writes in the
Worker (which survives the kills):

- every accepted user message is in the transcript exactly once (a deleted one never), and its turn
  ended once: completed with an answer, failed with an error (last_turn_error when it was the
  last), steered or cancelled; the turn-end events count the turn's messages;
- a single-attempt write ran at most once per call, and one cut short ends outcome_unknown; a
  succeeded call ran to the end; a rejected call never ran; a write that ran is never failed;
- an idempotent write runs again only with the same idempotency key, at most three times;
- a model call (turn, script step) runs again only when its Worker was killed, stopped or frozen,
  or its script makes it raise;
- AgentUsage.model_calls counts exactly the RunModel executions that committed a model call's
  result (the Step history, against the usage_recorded and turn-ending events of each execution);
- every tool_call_deferred (with its tool's effect) has exactly one tool_call_finished, and so does
  every tool_call_started; the final answer saw the statuses the events recorded; an unfinished turn
  leaves every final call to the next model call (the note, or the runner's tool results);
- every approval raised an interrupt; every interrupt was resolved once; every acknowledged
  resolve_interrupt, answer_question and decline is the one the session applied;
- the idle snapshot agrees with the transcript, and the session answers a new message afterwards.

The timing is real, so a seed fixes the schedule, not the interleaving. A fixed set of seeds runs
here on SQLite and on PostgreSQL (TEST_PG_DSN). Run many more locally with
DEX_AGENTS_CHAOS_SEEDS=1-300 (or a list: 4,9,17), which runs them all and reports every seed that
broke an invariant with the schedule the driver played (DEX_AGENTS_CHAOS_VERBOSE=1 prints every
seed's); DEX_AGENTS_CHAOS_WEIGHTS='{"freeze": 3}' changes how often the driver draws each action and
DEX_AGENTS_CHAOS_MAX_PAUSE (seconds, 0.4) how long it waits between two.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import random
import re
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from agents.tests.chaos_agent import (
    APPROVAL_TOOL,
    IDEMPOTENT_TOOL,
    INCREMENTAL_FLOW_TYPE,
    READ_TOOL,
    SINGLE_ATTEMPT_TOOL,
    TOOLS,
    build_flows,
)
from agents.tests.conftest import REPO_ROOT
from agents.tests.scripted_agent import INVOCATIONS, script_of
from agents.tests.session_driver import all_agent_events
from agents.tests.standby_workers import SharedStack
from engine.tests.conftest import db_url, pg_database, pg_databases  # noqa: F401 - the fixtures used here

from dex_agents import (
    AgentMessage,
    AgentSessionClient,
    AgentSnapshot,
    AgentStatus,
    MessageRole,
)
from dex_agents.testing import EXECUTE_COMPLETED_EVENT, AgentTestStack, InvocationLog, WorkerProcess

WORKER_MODULE = "agents.tests.chaos_worker"
SEEDS = (3, 4, 5)
ENV_SEEDS = "DEX_AGENTS_CHAOS_SEEDS"
# JSON overriding ACTION_WEIGHTS, to hunt in one area: '{"freeze": 3}'.
ENV_WEIGHTS = "DEX_AGENTS_CHAOS_WEIGHTS"
ACTIONS = (10, 18)
# Between two of the driver's actions (seconds).
PAUSE_SECONDS = (0.0, float(os.environ.get("DEX_AGENTS_CHAOS_MAX_PAUSE", "0.4")))
MAX_KILLS = 3
# Each model call and each tool takes this long (seconds, drawn per call).
MODEL_SECONDS = (0.05, 0.5)
TOOL_SECONDS = (0.05, 0.8)
# Every turn ends within this after the schedule: lease expiries, retries, the tools' time.
SETTLE_SECONDS = 90.0
TERMINAL_EVENTS = ("turn_completed", "turn_failed", "turn_steered", "turn_cancelled")
# Live events a cancelled attempt may still write late; session events are part of Step commits.
LIVE_EVENTS = ("text_delta", "reasoning_delta", "tool_call_started")
ACTION_WEIGHTS = {"send": 3.0, "steer": 2.0, "cancel": 1.2, "resolve": 4.0, "answer": 1.5, "delete": 0.6,
                  "kill": 0.8, "freeze": 0.4, "stop": 0.4}
# A frozen Worker (SIGSTOP) stays so long that its leases expire and a new Worker takes its Steps
# over; then it runs on (SIGCONT) beside the new one, as a Worker paused by the host would.
FREEZE_SECONDS = (2.5, 4.0)
TURN_ERROR = "scripted turn error"
NOTE_HEADERS = {"turn_failed": "[Dex] The previous turn failed after these tool calls ran:",
                "turn_steered": "[Dex] The user steered the conversation after these tool calls ran:",
                "turn_cancelled": "[Dex] The user stopped the previous turn after these tool calls ran:"}
# A note's line of one call: `- <tool_name> <arguments> -> <status>: <model-visible result>`.
NOTE_LINE = re.compile(r"^- (\S+) \{.*?\} -> (\w+): ", re.MULTILINE)
REJECTION = "no, not now"
EFFECTS = {READ_TOOL: ("read", False), IDEMPOTENT_TOOL: ("idempotent_write", False),
           SINGLE_ATTEMPT_TOOL: ("non_idempotent_write", False), APPROVAL_TOOL: ("non_idempotent_write", True)}


def seeds_to_run() -> list[int]:
    """SEEDS, or those DEX_AGENTS_CHAOS_SEEDS names: `a-b` ranges and single seeds, comma-separated."""
    spec = os.environ.get(ENV_SEEDS, "").strip()
    if not spec:
        return list(SEEDS)
    seeds: list[int] = []
    for part in spec.split(","):
        first, _, last = part.strip().partition("-")
        seeds.extend(range(int(first), int(last or first) + 1))
    return seeds


def make_script(rng: random.Random, tag: str) -> str:
    """A user message: plain text (an echo answer), or a script of tool calls of random effects."""
    if rng.random() < 0.15:
        return tag
    steps: list[dict[str, Any]] = []
    for s in range(rng.randint(1, 2)):
        tools = []
        for k in range(rng.randint(1, 3)):
            name = rng.choice(TOOLS)
            args: dict[str, Any] = {"sleep": round(rng.uniform(*TOOL_SECONDS), 3)}
            if name == READ_TOOL and rng.random() < 0.15:
                args["fail"] = "lookup failed"
            if rng.random() < 0.12:
                args["ask"] = "which one?"  # the tool asks the user first, taking no effect
            # IDs repeat across turns, as a model's do.
            tools.append({"id": f"c{s}{k}", "name": name, "args": args})
        steps.append({"tools": tools, "sleep": round(rng.uniform(*MODEL_SECONDS), 3)})
    if rng.random() < 0.08:
        # A model call that fails: once (its retry goes on), or on every attempt (the turn fails).
        steps[-1].update({"raise": "model unavailable", "attempts": rng.choice([1, 3])})
    if rng.random() < 0.1:
        steps.append({"turn_error": TURN_ERROR, "sleep": round(rng.uniform(*MODEL_SECONDS), 3)})
    else:
        steps.append({"answer": "{records}", "sleep": round(rng.uniform(*MODEL_SECONDS), 3)})
    return json.dumps({"tag": tag, "steps": steps})


@dataclass
class ChaosRun:
    seed: int
    session_id: str
    sessions: AgentSessionClient
    shared: SharedStack
    rng: random.Random
    started: float = field(default_factory=time.monotonic)
    sent: list[str] = field(default_factory=list)
    killed: set[int] = field(default_factory=set)
    kills: int = 0
    seen_interrupts: list[str] = field(default_factory=list)
    actions: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    restarting: asyncio.Task[Any] | None = None
    extra: WorkerProcess | None = None
    frozen: list[WorkerProcess] = field(default_factory=list)
    thawing: list[asyncio.Task[Any]] = field(default_factory=list)
    # (interrupt ID, approved) of every resolve_interrupt of an approval that returned True.
    resolved: collections.Counter[tuple[str, bool]] = field(default_factory=collections.Counter)
    # Interrupt IDs of the questions answer_question answered, and resolve_interrupt declined (True).
    answered: collections.Counter[str] = field(default_factory=collections.Counter)
    declined: collections.Counter[str] = field(default_factory=collections.Counter)
    kinds: dict[str, str] = field(default_factory=dict)
    messages: int = 0
    stats: collections.Counter[str] = field(default_factory=collections.Counter)

    def note(self, text: str) -> None:
        self.actions.append(f"{time.monotonic() - self.started:6.2f}s {text}")

    def violation(self, text: str) -> None:
        self.violations.append(text)

    def next_tag(self) -> str:
        self.messages += 1
        return f"{self.session_id}-m{self.messages}"

    async def call(self, what: str, coro: Any) -> Any:
        """Run one RPC; an exception is a violation (a user would see it), noted with the schedule."""
        try:
            result = await coro
        except Exception as exc:
            self.note(f"{what} -> {type(exc).__name__}: {exc}")
            self.violation(f"{what} raised {type(exc).__name__}: {exc}")
            return None
        self.note(f"{what} -> {result if isinstance(result, bool) else type(result).__name__}")
        if isinstance(result, AgentSnapshot):
            self.check_snapshot(result)
        return result

    def check_snapshot(self, snapshot: AgentSnapshot) -> None:
        """What any snapshot, one read of committed state, must hold, mid-turn too."""
        state = snapshot.state
        if state is None:
            return
        problems = []
        if state.active_turn_id is None and (state.status is not AgentStatus.WAITING_FOR_USER_MESSAGE
                                             or snapshot.tool_calls or snapshot.pending_interrupts):
            problems.append("no active turn, yet")
        if any(c.turn_id != state.active_turn_id for c in snapshot.tool_calls):
            problems.append("calls of another turn")
        waiting = {c.tool_call_id for c in snapshot.tool_calls
                   if c.status.value in ("awaiting_approval", "awaiting_answer")}
        if {i.tool_call_id for i in snapshot.pending_interrupts} - waiting:
            problems.append("an interrupt of a call that waits for none")
        if state.status is AgentStatus.RUNNING_TOOLS and not snapshot.tool_calls:
            problems.append("running tools without calls")
        sequences = [m.sequence for m in snapshot.messages]
        if sequences and sequences[-1] != state.next_message_sequence - 1:
            problems.append("messages up to another sequence")
        if problems:
            self.violation(f"inconsistent snapshot ({'; '.join(problems)}): {state}, calls "
                           f"{[(c.turn_id, c.tool_call_id, c.status.value) for c in snapshot.tool_calls]}, "
                           f"interrupts {[i.interrupt_id for i in snapshot.pending_interrupts]}")


async def drive(run: ChaosRun, *, processes: bool) -> None:
    """The seed's schedule of actions; Worker kills, stops and freezes only when `processes`."""
    rng = run.rng
    chosen = {**ACTION_WEIGHTS, **json.loads(os.environ.get(ENV_WEIGHTS) or "{}")}
    if not processes:
        chosen = {kind: weight for kind, weight in chosen.items() if kind not in ("kill", "freeze", "stop")}
    kinds, weights = list(chosen), list(chosen.values())
    for _ in range(rng.randint(*ACTIONS)):
        await asyncio.sleep(rng.uniform(*PAUSE_SECONDS))
        kind = rng.choices(kinds, weights)[0]
        if kind == "send":
            text = make_script(rng, run.next_tag())
            if await run.call(f"send {json.loads(text)['tag'] if text.startswith('{') else text}",
                              run.sessions.send_user_message(run.session_id, text)):
                run.sent.append(text)
        elif kind == "steer":
            await steer(run)
        elif kind == "cancel":
            await cancel(run)
        elif kind == "resolve":
            await resolve(run, final=False)
        elif kind == "answer":
            await answer(run, final=False)
        elif kind == "delete":
            await delete(run)
        elif run.kills < MAX_KILLS and (run.restarting is None or run.restarting.done()):
            await {"kill": kill, "freeze": freeze, "stop": stop}[kind](run)


async def steer(run: ChaosRun) -> None:
    rng = run.rng
    if rng.random() < 0.3:
        snapshot = await run.call("snapshot", run.sessions.get_agent_snapshot(run.session_id))
        if snapshot is not None and snapshot.queued_messages:
            queued = rng.choice(snapshot.queued_messages)
            await run.call(f"steer queued {queued.message_id}",
                           run.sessions.steer_user_message(run.session_id, message_id=queued.message_id))
            return
    text = make_script(rng, run.next_tag())
    tag = json.loads(text)["tag"] if text.startswith("{") else text
    if await run.call(f"steer {tag}", run.sessions.steer_user_message(run.session_id, text=text)):
        run.sent.append(text)


async def cancel(run: ChaosRun) -> None:
    choice = run.rng.random()
    turn_id: str | None = None
    if choice < 0.3:
        snapshot = await run.call("snapshot", run.sessions.get_agent_snapshot(run.session_id))
        if snapshot is not None and snapshot.state is not None:
            turn_id = snapshot.state.active_turn_id
    elif choice < 0.4:
        turn_id = "turn-9999"
    await run.call(f"cancel {turn_id}", run.sessions.cancel_turn(run.session_id, turn_id))


async def resolve(run: ChaosRun, *, final: bool) -> int:
    """Resolve pending approvals (all of them when `final`); returns how many were pending."""
    rng = run.rng
    found = await pending_targets(run, "tool_approval", final=final)
    if found is None:
        return 0
    pending, targets = found
    if not final and (not targets or rng.random() < 0.2) and run.seen_interrupts:
        targets = [rng.choice(run.seen_interrupts)]  # late: one seen earlier, maybe resolved long ago
    for interrupt_id in targets:
        approved = rng.random() < (0.8 if final else 0.6)
        first = await resolve_once(run, interrupt_id, approved)
        if rng.random() < 0.25:
            again = await resolve_once(run, interrupt_id, not approved)
            if first and again:
                run.violation(f"resolve_interrupt {interrupt_id} returned True twice in a row")
    return len(pending)


async def pending_targets(run: ChaosRun, kind: str, *, final: bool) -> tuple[list[str], list[str]] | None:
    """The session's pending interrupts of `kind` and those to act on: all when `final`, else one
    drawn at random; None when the snapshot could not be read."""
    snapshot = await run.call("snapshot", run.sessions.get_agent_snapshot(run.session_id))
    if snapshot is None:
        return None
    seen(run, snapshot)
    pending = [i.interrupt_id for i in snapshot.pending_interrupts if i.kind.value == kind]
    return pending, pending if final else [run.rng.choice(pending)] if pending else []


def seen(run: ChaosRun, snapshot: AgentSnapshot) -> None:
    for interrupt in snapshot.pending_interrupts:
        if interrupt.interrupt_id not in run.seen_interrupts:
            run.seen_interrupts.append(interrupt.interrupt_id)
        run.kinds[interrupt.interrupt_id] = interrupt.kind.value


async def resolve_once(run: ChaosRun, interrupt_id: str, approved: bool) -> bool:
    """resolve_interrupt: an approval, or (approved=False) a declined question; recorded when True."""
    result = await run.call(f"resolve {interrupt_id} approved={approved}", run.sessions.resolve_interrupt(
        run.session_id, interrupt_id, approved, None if approved else REJECTION))
    if result and run.kinds.get(interrupt_id) == "question":
        if approved:
            run.violation(f"resolve_interrupt(approved=True) of question {interrupt_id} returned True")
        run.declined[interrupt_id] += 1
    elif result:
        run.resolved[(interrupt_id, approved)] += 1
    return bool(result)


async def answer(run: ChaosRun, *, final: bool) -> int:
    """Answer or decline pending questions (all of them when `final`); returns how many were pending."""
    rng = run.rng
    found = await pending_targets(run, "question", final=final)
    if found is None:
        return 0
    pending, targets = found
    for interrupt_id in targets:
        for _ in range(2 if rng.random() < 0.2 else 1):
            if rng.random() < (0.8 if final else 0.7):
                if await run.call(f"answer {interrupt_id}", run.sessions.answer_question(
                        run.session_id, interrupt_id, "the first one")):
                    run.answered[interrupt_id] += 1
            else:
                await resolve_once(run, interrupt_id, False)
    return len(pending)


async def delete(run: ChaosRun) -> None:
    snapshot = await run.call("snapshot", run.sessions.get_agent_snapshot(run.session_id))
    if snapshot is None or not snapshot.queued_messages:
        return
    queued = run.rng.choice(snapshot.queued_messages)
    if await run.call(f"delete queued {queued.message_id}",
                      run.sessions.delete_queued_message(run.session_id, queued.message_id)):
        run.sent.remove(queued.message.text)


async def kill(run: ChaosRun) -> None:
    """SIGKILL the Worker (a standby takes over), or the second one when there is one."""
    if run.extra is not None and run.extra.alive and run.rng.random() < 0.5:
        run.extra.kill()
        run.killed.add(run.extra.pid)
        run.kills += 1
        run.note(f"SIGKILL second worker {run.extra.pid}")
        return
    worker = await run.shared.worker()
    worker.kill()
    run.killed.add(worker.pid)
    run.kills += 1
    run.note(f"SIGKILL worker {worker.pid}")
    run.restarting = asyncio.create_task(run.shared.start_new_worker())


async def stop(run: ChaosRun) -> None:
    """SIGTERM the Worker: it stops claiming and lets what runs finish (for its grace); a new one starts."""
    worker = await run.shared.worker()
    os.killpg(worker.pid, signal.SIGTERM)
    run.killed.add(worker.pid)  # what still runs at the grace's end is cut short
    run.frozen.append(worker)
    run.kills += 1
    run.note(f"SIGTERM worker {worker.pid}")
    run.shared.current = None  # the next worker() is a standby's
    run.restarting = asyncio.create_task(run.shared.worker())


async def freeze(run: ChaosRun) -> None:
    """SIGSTOP the Worker; a new one takes over; the frozen one goes on after FREEZE_SECONDS."""
    worker = await run.shared.worker()
    os.killpg(worker.pid, signal.SIGSTOP)
    run.killed.add(worker.pid)  # its runs may be cut short and run again, as a killed Worker's
    run.frozen.append(worker)
    run.kills += 1
    seconds = run.rng.uniform(*FREEZE_SECONDS)
    run.note(f"SIGSTOP worker {worker.pid} for {seconds:.1f} s")
    run.shared.current = None  # the next worker() is a standby's
    run.restarting = asyncio.create_task(run.shared.worker())

    async def thaw() -> None:
        await asyncio.sleep(seconds)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(worker.pid, signal.SIGCONT)
        run.note(f"SIGCONT worker {worker.pid}")

    run.thawing.append(asyncio.create_task(thaw()))


def idle(snapshot: AgentSnapshot) -> bool:
    state = snapshot.state
    return (state is not None and state.active_turn_id is None and state.status is AgentStatus.WAITING_FOR_USER_MESSAGE
            and snapshot.queued_message_count == 0 and not snapshot.steered_messages)


async def settle(run: ChaosRun) -> AgentSnapshot | None:
    """Answer approvals until the session is idle; None (a violation) when it never gets there."""
    if run.restarting is not None:
        await run.restarting
    for thawing in run.thawing:
        await thawing
    deadline = time.monotonic() + SETTLE_SECONDS
    while time.monotonic() < deadline:
        snapshot = await run.sessions.get_agent_snapshot(run.session_id)
        run.check_snapshot(snapshot)
        if idle(snapshot):
            return snapshot
        if snapshot.state is not None and snapshot.state.status is AgentStatus.FAILED:
            run.violation(f"the session failed: {snapshot.state.last_turn_error}")
            return None
        if snapshot.pending_interrupts:
            await resolve(run, final=True)
            await answer(run, final=True)
        await asyncio.sleep(0.1)
    run.violation(f"the session is not idle {SETTLE_SECONDS} s after the schedule: {snapshot.state}, "
                  f"{snapshot.queued_message_count} queued, interrupts {snapshot.pending_interrupts}, "
                  f"calls {[(c.tool_call_id, c.status.value) for c in snapshot.tool_calls]}")
    return None


async def all_messages(run: ChaosRun) -> list[AgentMessage]:
    messages: list[AgentMessage] = []
    before: int | None = None
    while True:
        page = await run.sessions.list_agent_messages(run.session_id, before, limit=200)
        messages[:0] = page.messages
        if page.next_before_sequence is None:
            return messages
        before = page.next_before_sequence


async def check(run: ChaosRun, stack: AgentTestStack, snapshot: AgentSnapshot, *, incremental: bool) -> None:
    sid = run.session_id
    messages = await all_messages(run)
    events = [(e.value, json.loads(e.value.payload)) for e in await all_agent_events(run.sessions, sid)]
    history = await stack.read_step_history(sid)
    log = InvocationLog(stack.state_dir / INVOCATIONS)
    v = run.violation

    # Every accepted message is stored once, as a user message; nothing else is (but the notes).
    users = collections.Counter(m.text for m in messages
                                if m.role is MessageRole.USER and not (m.text or "").startswith("[Dex]"))
    sent = collections.Counter(run.sent)
    if users != sent:
        v(f"user messages stored {dict(users - sent)} beyond those sent, sent but not stored {dict(sent - users)}")

    # Each turn: turn_started first and once, one end, nothing but live events after it.
    by_turn: dict[str, list[tuple[Any, dict[str, Any]]]] = collections.defaultdict(list)
    for event, payload in events:
        if event.turn_id:
            by_turn[event.turn_id].append((event, payload))
    ends: dict[str, tuple[str, dict[str, Any]]] = {}
    for turn_id, turn_events in by_turn.items():
        types = [e.type for e, _ in turn_events]
        terminal = [(i, t) for i, t in enumerate(types) if t in TERMINAL_EVENTS]
        if types.count("turn_started") != 1 or types[0] != "turn_started":
            v(f"{turn_id}: turn_started is not first and once: {types}")
        if len(terminal) != 1:
            v(f"{turn_id}: {len(terminal)} turn ends: {types}")
            continue
        index, end_type = terminal[0]
        ends[turn_id] = (end_type, turn_events[index][1])
        run.stats[end_type] += 1
        late = [t for t in types[index + 1:] if t not in LIVE_EVENTS]
        if late:
            v(f"{turn_id}: events after {end_type}: {late}")
    for m in messages:
        if m.turn_id not in ends:
            v(f"message {m.sequence} ({m.role.value} {m.text!r:.60}) is in turn {m.turn_id}, which never ended")
    state = snapshot.state
    assert state is not None
    if state.turn_count != len(ends):
        v(f"turn_count {state.turn_count}, but {len(ends)} turns ended in the events")
    last_end = next((ends[t] for t in sorted(ends, key=lambda t: int(t.removeprefix("turn-")), reverse=True)), None)
    expected_error = last_end[1]["error"] if last_end is not None and last_end[0] == "turn_failed" else None
    if state.last_turn_error != expected_error:
        v(f"last_turn_error {state.last_turn_error!r}, but the last turn ended {last_end}")

    # A completed turn answered; its messages are counted; the answer saw the recorded statuses.
    finished: dict[tuple[str, str], list[str]] = collections.defaultdict(list)
    deferred: dict[tuple[str, str], list[dict[str, Any]]] = collections.defaultdict(list)
    started: collections.Counter[tuple[str, str]] = collections.Counter()
    for event, payload in events:
        key = (event.turn_id or "", str(payload.get("tool_call_id")))
        if event.type == "tool_call_finished":
            finished[key].append(payload["status"])
        elif event.type == "tool_call_deferred":
            deferred[key].append(payload)
        elif event.type == "tool_call_started":
            started[key] += 1
    for turn_id, (end_type, payload) in ends.items():
        turn_messages = [m for m in messages if m.turn_id == turn_id]
        leading = 0
        while leading < len(turn_messages) and turn_messages[leading].role is MessageRole.USER and not (
                turn_messages[leading].text or "").startswith("[Dex]"):
            leading += 1  # the turn's own user messages; a note after them is one the turn appended
        if end_type == "turn_completed":
            answers = [m for m in turn_messages if m.role is MessageRole.ASSISTANT and m.text]
            if not answers:
                v(f"{turn_id} completed without an answer")
            elif answers[-1].text and answers[-1].text.startswith("{"):
                for call_id, record in json.loads(answers[-1].text).items():
                    if finished.get((turn_id, call_id)) != [record["status"]]:
                        v(f"{turn_id}/{call_id}: the model saw {record['status']}, the events say "
                          f"{finished.get((turn_id, call_id))}")
        if end_type == "turn_failed" and not payload.get("error"):
            v(f"{turn_id} failed without an error: {payload}")
        if "message_count" in payload and payload["message_count"] != len(turn_messages) - leading:
            v(f"{turn_id} {end_type} counts {payload['message_count']} messages; {len(turn_messages)} stored, "
              f"{leading} of them its user messages")

    # What the next model call learns of an unfinished turn's calls: every final call, in the note
    # (one line each) or, from the runner that stores items, as a tool result.
    for turn_id, (end_type, payload) in ends.items():
        calls = collections.Counter((d[0]["tool_name"], finished[k][-1]) for k, d in deferred.items()
                                    if k[0] == turn_id and d and finished.get(k))
        runner_error = end_type == "turn_failed" and payload.get("error") == TURN_ERROR
        if not calls or end_type == "turn_completed" or runner_error:
            continue  # the runner's own transcript holds the results
        turn_messages = [m for m in messages if m.turn_id == turn_id]
        run.stats["notes checked"] += 1
        if incremental:
            results = collections.Counter(m.tool_call_id for m in turn_messages if m.role is MessageRole.TOOL)
            if sum(results.values()) < sum(calls.values()):
                v(f"{turn_id} {end_type}: {dict(calls)} final, but tool results for {dict(results)} only")
            continue
        header = NOTE_HEADERS[end_type]
        notes = [m.text or "" for m in turn_messages if (m.text or "").startswith(header)]
        listed = collections.Counter(
            (match[0], match[1]) for note in notes for match in NOTE_LINE.findall(note))
        if len(notes) != 1 or listed != calls:
            v(f"{turn_id} {end_type}: final calls {dict(calls)}, {len(notes)} note(s) listing {dict(listed)}")

    # Tool calls: deferred once, finished once; started ones finished; the ledger agrees.
    for key, payloads in deferred.items():
        effect = EFFECTS.get(payloads[0]["tool_name"])
        if effect is not None and (payloads[0]["effect"], payloads[0]["requires_approval"]) != effect:
            v(f"{key} deferred as {payloads[0]}, expected {effect}")
    for key in set(deferred) | set(finished) | set(started):
        if len(deferred.get(key, [])) != 1 or len(finished.get(key, [])) != 1:
            v(f"{key}: deferred {len(deferred.get(key, []))}x, finished {finished.get(key)}, started {started[key]}x")
    scripts: dict[str, list[dict[str, Any]]] = {}
    for m in messages:
        if m.role is MessageRole.USER and not (m.text or "").startswith("[Dex]"):
            scripts[m.turn_id] = script_of(m.text or "")  # the last one plays, as the runner picks it
    for key, statuses in finished.items():
        turn_id, call_id = key
        status = statuses[-1]
        name = deferred[key][0]["tool_name"] if deferred.get(key) else "?"
        spec = next((t for step in scripts.get(turn_id, []) for t in step.get("tools", []) if t["id"] == call_id), {})
        asks = "ask" in spec.get("args", {})
        starts = log.entries("tool_start", flow_id=sid, turn_id=turn_id, tool_call_id=call_id)
        # A tool that asks runs once to ask, with no effect; only its runs with an answer take effect.
        runs = [e for e in starts if not asks or e.get("answers")]
        tool_ends = log.entries("tool_end", flow_id=sid, turn_id=turn_id, tool_call_id=call_id)
        run.stats[f"{name}:{status}"] += 1
        run.stats["cut short"] += len(runs) - len(tool_ends)
        label = (f"{turn_id}/{call_id} {name}{' (asks)' if asks else ''} {status}: {len(starts)} start(s) "
                 f"(pids {[e['pid'] for e in starts]}, answers {[e.get('answers') for e in starts]}), "
                 f"{len(tool_ends)} end(s)")
        if starts and not started[key]:
            v(f"{label}: ran without a tool_call_started event")
        if status == "rejected" and runs:
            v(f"{label}: rejected, but it ran")
        if status == "succeeded" and not tool_ends:
            v(f"{label}: succeeded, but it never ran to the end")
        if status == "failed" and runs and name != READ_TOOL:
            v(f"{label}: a write that ran is recorded failed")
        if name in (SINGLE_ATTEMPT_TOOL, APPROVAL_TOOL):
            if len(runs) > 1:
                v(f"{label}: a single-attempt write ran more than once")
            if runs and not tool_ends and status != "outcome_unknown":
                v(f"{label}: a kill cut the write short, yet it is not outcome_unknown")
        if name == IDEMPOTENT_TOOL:
            keys = {e["idempotency_key"] for e in runs}
            if keys - {f"{sid}/{turn_id}/{call_id}"} or len(runs) > 3:
                v(f"{label}: idempotency keys {keys}")
        for entry in runs[:-1]:
            if entry["pid"] not in run.killed:
                v(f"{label}: ran again after a run in a Worker that was not killed")
    for entry in log.entries("tool_start", flow_id=sid):
        if (entry["turn_id"], entry["tool_call_id"]) not in finished:
            v(f"{entry['turn_id']}/{entry['tool_call_id']} ran but has no tool_call_finished")

    # Approvals: one interrupt per approval call, resolved once; every acknowledged resolve_interrupt
    # reached its call (interrupt_resolved with the same answer), and no other answer did.
    raised = collections.Counter((e.turn_id, p["interrupt_id"]) for e, p in events if e.type == "interrupt_raised")
    approvals = collections.Counter((e.turn_id, p["interrupt_id"]) for e, p in events
                                    if e.type == "interrupt_raised" and p["kind"] == "tool_approval")
    resolutions = [(e.turn_id, p) for e, p in events if e.type == "interrupt_resolved"]
    needing = collections.Counter(k for k, d in deferred.items() if d and d[0]["requires_approval"])
    if approvals != needing:
        v(f"approvals raised {dict(approvals)}, calls needing approval {dict(needing)}")
    if collections.Counter((t, p["interrupt_id"]) for t, p in resolutions) != raised:
        v(f"interrupts resolved {[(t, p['interrupt_id']) for t, p in resolutions]}, raised {dict(raised)}")
    by_user = [p for _, p in resolutions if p["cancellation_reason"] is None]
    applied = collections.Counter((p["interrupt_id"], bool(p["approved"])) for p in by_user
                                  if p["kind"] == "tool_approval" and p["rejection_message"] in (None, REJECTION))
    if applied != run.resolved:
        v(f"resolve_interrupt acknowledged {dict(run.resolved)}, the session applied {dict(applied)}")
    answers = collections.Counter(p["interrupt_id"] for p in by_user if p["kind"] == "question" and p["answered"])
    if answers != run.answered:
        v(f"answer_question acknowledged {dict(run.answered)}, the session applied {dict(answers)}")
    declines = collections.Counter(p["interrupt_id"] for p in by_user if p["kind"] == "question"
                                   and not p["approved"] and p["rejection_message"] == REJECTION)
    if declines != run.declined:
        v(f"declines acknowledged {dict(run.declined)}, the session applied {dict(declines)}")
    run.stats["resolutions"] += len(resolutions)

    # Model calls: a (turn, script step) runs again only after a kill cut its run short, or when its
    # script makes it raise.
    model_runs: dict[tuple[str, int], list[dict[str, Any]]] = collections.defaultdict(list)
    for entry in log.entries("model", flow_id=sid):
        model_runs[(entry["turn_id"], entry["step"])].append(entry)
    for (turn_id, step), runs in model_runs.items():
        run.stats["model reruns"] += len(runs) - 1
        script = scripts.get(turn_id, [{}])
        raises = "raise" in script[min(step, len(script) - 1)]
        if len(runs) > 1:
            run.note(f"model call {turn_id} step {step}{' (raises)' if raises else ''} ran in pids "
                     f"{[e['pid'] for e in runs]}, attempts {[e['attempt'] for e in runs]}")
        if raises:
            continue
        for entry in runs[:-1]:
            if entry["pid"] not in run.killed:
                v(f"model call {turn_id} step {step} ran {len(runs)} times (pids {[e['pid'] for e in runs]}, "
                  f"attempts {[e['attempt'] for e in runs]}), not only after a kill")

    # Usage: every RunModel execution that committed a model call's result counted it, once.
    executions = {e.step_execution_id for e in history
                  if e.step_type == "RunModel" and e.event_type == EXECUTE_COMPLETED_EVENT}
    usage_events = [(e, p) for e, p in events if e.type == "usage_recorded"]
    recorded = collections.Counter(e.step_execution_id for e, _ in usage_events)
    without_call = {e.step_execution_id for e, _ in events
                    if e.type in ("turn_steered", "turn_cancelled") and e.step_execution_id in executions}
    if any(n > 1 for n in recorded.values()) or set(recorded) - executions:
        v(f"usage_recorded per execution {dict(recorded)}, RunModel executions {sorted(executions)}")
    if set(recorded) | without_call != executions or set(recorded) & without_call:
        v(f"RunModel executions {sorted(executions)}: with usage {sorted(recorded)}, ended before the model call "
          f"{sorted(without_call)}")
    calls = sum(p["recorded"]["model_calls"] for _, p in usage_events)
    if snapshot.usage.model_calls != calls or snapshot.usage.model_calls != len(executions) - len(without_call):
        v(f"AgentUsage.model_calls {snapshot.usage.model_calls}; usage_recorded {calls}; RunModel executions "
          f"{len(executions)}, {len(without_call)} of them before a model call")
    if usage_events and usage_events[-1][1]["session"]["model_calls"] != snapshot.usage.model_calls:
        v(f"AgentUsage {snapshot.usage} is not the last usage_recorded total {usage_events[-1][1]['session']}")

    # The snapshot agrees with the transcript.
    sequences = [m.sequence for m in messages]
    if sequences != list(range(1, len(messages) + 1)) or state.next_message_sequence != len(messages) + 1:
        v(f"message sequences {sequences[:3]}..{sequences[-3:]}, next_message_sequence {state.next_message_sequence}")
    tail = messages[-len(snapshot.messages):] if snapshot.messages else []
    if snapshot.messages != tail or len(snapshot.messages) != min(200, len(messages)):
        v("the snapshot's messages are not the transcript's last ones")
    if snapshot.tool_calls or snapshot.pending_interrupts:
        v(f"an idle session lists calls {snapshot.tool_calls} and interrupts {snapshot.pending_interrupts}")


async def accepts_a_new_message(run: ChaosRun, turn_count: int) -> None:
    text = f"final-{run.session_id}"
    if not await run.call("send final", run.sessions.send_user_message(run.session_id, text)):
        run.violation("the idle session refused a new message")
        return
    deadline = time.monotonic() + SETTLE_SECONDS
    while time.monotonic() < deadline:
        snapshot = await run.sessions.get_agent_snapshot(run.session_id)
        state = snapshot.state
        if state is not None and state.turn_count > turn_count and state.active_turn_id is None:
            if snapshot.messages[-1].text != f"echo: {text}":
                run.violation(f"the new message got {snapshot.messages[-1].text!r}")
            return
        await asyncio.sleep(0.1)
    run.violation("the session never answered a new message")


async def run_seed(stack: AgentTestStack, shared: SharedStack, seed: int) -> ChaosRun:
    """The seed's session, and sometimes a second one driven at once (its driver sends, steers,
    cancels and answers; the first one's also kills); returns the first, holding both's findings."""
    rng = random.Random(seed)
    flows = stack.flows
    run = ChaosRun(seed, f"chaos-{seed}", stack.sessions(flows[rng.randrange(len(flows))]), shared, rng)  # type: ignore[arg-type]
    await shared.worker()
    if rng.random() < 0.25:
        # A second Worker claims beside the first: two processes race for every Step.
        run.extra = await stack.start_worker()
        run.note(f"second worker {run.extra.pid}")
    runs = [run]
    if rng.random() < 0.3:
        flow = flows[rng.randrange(len(flows))]
        runs.append(ChaosRun(seed, f"chaos-{seed}-b", stack.sessions(flow), shared,  # type: ignore[arg-type]
                             random.Random(f"{seed}-b"), started=run.started, killed=run.killed))
    await asyncio.gather(*(run_session(r, stack, processes=r is run) for r in runs))
    run.stats["sessions"] += 1
    for other in runs[1:]:
        run.stats["sessions"] += 1
        run.violations.extend(f"{other.session_id}: {text}" for text in other.violations)
        run.actions.extend(f"[{other.session_id}] {text}" for text in other.actions)
        run.stats.update(other.stats)
        run.sent.extend(other.sent)
    for worker in [run.extra, *run.frozen]:
        if worker is not None and worker.alive:
            worker.kill()  # idle now: the next seed starts with one Worker
    return run


async def run_session(run: ChaosRun, stack: AgentTestStack, *, processes: bool) -> None:
    flow_type = run.sessions.flow.flow_type
    run.note(f"{run.session_id}: flow {flow_type}")
    initial = make_script(run.rng, run.next_tag())
    await run.sessions.start_session(run.session_id, initial)
    run.sent.append(initial)
    await drive(run, processes=processes)
    snapshot = await settle(run)
    if snapshot is not None:
        await check(run, stack, snapshot, incremental=flow_type == INCREMENTAL_FLOW_TYPE)
        assert snapshot.state is not None
        await accepts_a_new_message(run, snapshot.state.turn_count)


# pytest-timeout's limit, for as many seeds as run (each well under a minute, kills included).
@pytest.mark.timeout(max(300, 60 * len(seeds_to_run())))
async def test_chaos_seeds(tmp_path: Path, db_url: str) -> None:  # noqa: F811
    seeds = seeds_to_run()
    flows = build_flows(tmp_path)
    failures: list[str] = []
    async with AgentTestStack(tmp_path, flows, WORKER_MODULE, worker_cwd=REPO_ROOT, database_url=db_url) as stack:
        shared = SharedStack(stack, standbys=1)
        for seed in seeds:
            begun = time.monotonic()
            run = await run_seed(stack, shared, seed)
            took = time.monotonic() - begun
            print(f"seed {seed}: {len(run.sent)} messages, {run.kills} kills, {len(run.violations)} violations, "
                  f"{took:.1f} s; {dict(sorted(run.stats.items()))}", flush=True)
            if os.environ.get("DEX_AGENTS_CHAOS_VERBOSE"):
                print("\n".join(run.actions))
            if run.violations:
                failures.append(f"seed {seed} ({run.session_id}):\n  " + "\n  ".join(run.violations)
                                + "\n schedule:\n  " + "\n  ".join(run.actions))
                with contextlib.suppress(OSError):
                    (tmp_path / f"seed-{seed}.txt").write_text(failures[-1])
    assert not failures, f"{len(failures)} of {len(seeds)} seeds broke invariants:\n" + "\n".join(failures)
