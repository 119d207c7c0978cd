"""A scripted runner for the session tests: the user message is the script of the turn's model calls.

A plain-text message gets the answer `echo: <text>`. A JSON message `{"steps": [...]}` scripts one
model call per step, in order:

- `{"tools": [{"id": "c1", "name": "read_orders", "args": {...}}, ...]}` asks for tool calls
  (`"args_text"` instead of `"args"` sends raw argument text);
- `{"answer": "text"}` is the final answer; `{results}` in it becomes each final record's
  model-visible result (`id=<text>; ...`), `{records}` a JSON object of each record's status,
  output, error, cancellation_reason and task_id by call ID, and `{seen}` the number of stored
  messages the call saw; `{"answer_bytes": n}` answers n characters (over the value limit, say);
- `{"turn_error": "text"}` ends the turn as failed without a retry;
- `{"raise": "text"}` fails every attempt of the model call; with `"attempts": n`, only the first n
  (`{"raise_bytes": n}` fails every attempt with a text of n characters);
- `"gate": "name"` in any step waits at that FileGate before the model call returns, and
  `"sleep": seconds` then takes that long, as a slow model call does;
- `"heartbeat": true` in any step heartbeats first (before the gate), so the attempt counts as
  started, as a model call that already streamed output does: a Worker killed after it fails the
  attempt (the rerun is attempt 2) instead of handing the same attempt out again.

Tools (in the tool Step): args `{"gate": name}` wait at a FileGate first; `{"sleep": seconds}` then
take that long, as a call to a slow API does; `{"fail": text}` raises ToolExecutionError;
`{"unknown": text}` raises ToolOutcomeUnknownError (`{"fail_bytes": n}`, `{"unknown_bytes": n}`: with a
text of n characters); `{"crash": text}` raises RuntimeError (`{"crash_bytes": n}`: n characters);
`{"output_bytes": n}` returns n bytes, `{"output": text}` that text. Policies by name prefix: read_
READ, idem_ IDEMPOTENT_WRITE, write_ NON_IDEMPOTENT_WRITE; anything else gets the session default
(unclassified).

Tool tasks: args `{"task": {"id": text, "interval": seconds, "polls": [...]}}` start a task (after
any gate): the tool saves the task ID as its heartbeat checkpoint and returns
ToolTaskStarted(id, interval) (defaults: `task-<tool call ID>`, 1 s); a retried attempt returns the
saved one (`"start_gate": name` waits at that FileGate after the first attempt saved it, as
before the tool Step's commit). `id` and `interval` are passed as given, so a test can send a blank ID or a non-number.
poll_tool_task plays `polls` in order, keeping its position in the call's input_continuation
(`p<n>`: the next poll plays polls[n]), so a crashed poll replays the same step:
`{"pending": seconds}` returns ToolTaskPending (`"keep": text` returns that continuation instead);
`{"ask": question, "choices": [...]}` returns ToolInputRequested (`{"ask_bytes": n}`: a question of n
bytes); `{"result": text}` returns it, with
`{answers}` replaced by the JSON list of [resolution, answer] the task received (`{"result_bytes": n}`
returns n bytes); `{"fail": text}`
raises ToolExecutionError, `{"unknown": text}` ToolOutcomeUnknownError, `{"crash": text}` RuntimeError
(`"attempts": n`: only on the first n attempts); `"gate": name` in any poll step waits there first.
Every poll is logged (`poll`, with its position, attempt and pending_answer). cancel_tool_task logs
`task_cancel`; `"cancel_crash": text` in the task makes it raise RuntimeError.

Tool args `{"ask": question}` return ToolInputRequested(question) until the call has an answer
(a tool's question, `<id>-input-1`), then run on. SCRIPTED_BUILT_IN_TOOLS=ask_user,durable_wait
(or build_flow(built_in_tools=...)) enables those built-in tools, so a script can call them.

Every model call and tool run is recorded in the InvocationLog `invocations.log` of the state
directory (ENV_STATE_DIR), the ground truth across Worker kills. Set SCRIPTED_INCREMENTAL=1 for a
runner that stores items as they appear and builds unfinished-turn messages; `"unfinished_gate": name`
beside a turn's `"steps"` makes it wait at that FileGate first (its Worker's event loop blocked).

A Worker child whose environment sets SCRIPTED_WORKER_START_GATE=<name> waits at that FileGate in
build_flow, after its imports and before it registers with the engine: a test can start a standby
child ahead of time and let it become a Worker only when released (after a kill, say).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import msgspec

from dex_agents import (
    AgentMessage,
    AgentSessionFlow,
    AgentSessionOptions,
    AgentToolCall,
    AgentTurnContext,
    AgentTurnOutcome,
    AgentUsage,
    BuiltInTool,
    DeferredToolCall,
    DeferredToolExecution,
    FrameworkMessage,
    MessageRole,
    ToolCallsRequested,
    ToolEffect,
    ToolExecutionError,
    ToolExecutionResult,
    ToolInputRequested,
    ToolOutcomeUnknownError,
    ToolPolicy,
    ToolTaskCancellation,
    ToolTaskPending,
    ToolTaskPoll,
    ToolTaskPollOutcome,
    ToolTaskStarted,
    TurnCompleted,
    describe_tool_call_outcome,
)
from dex_agents.testing import ENV_PARENT_PID, ENV_STATE_DIR, FileGate, InvocationLog

FLOW_TYPE = "ScriptedAgent"
ENV_INCREMENTAL = "SCRIPTED_INCREMENTAL"
ENV_DEADLINE_SECONDS = "SCRIPTED_INTERRUPT_DEADLINE_SECONDS"
ENV_START_GATE = "SCRIPTED_WORKER_START_GATE"
ENV_BUILT_IN_TOOLS = "SCRIPTED_BUILT_IN_TOOLS"
INVOCATIONS = "invocations.log"
# How often a standby Worker child looks at its start gate, and whether the test process is alive.
START_GATE_POLL_SECONDS = 0.05

POLICIES = {"read_": ToolEffect.READ, "idem_": ToolEffect.IDEMPOTENT_WRITE, "write_": ToolEffect.NON_IDEMPOTENT_WRITE}

# Usage each scripted model call reports, so tests can check the session totals.
CALL_USAGE = AgentUsage(model_calls=1, input_tokens=10, output_tokens=5)


def messages_digest(messages: Sequence[AgentMessage]) -> str:
    """A digest of messages, every field: a model call's input logged without logging it whole."""
    return hashlib.sha256(msgspec.json.encode(list(messages))).hexdigest()


def script_of(text: str) -> list[dict[str, Any]]:
    """The turn's script: JSON {"steps": [...]}, or one echo answer for plain text."""
    whole = _script_object(text)
    return list(whole["steps"]) if whole is not None else [{"answer": f"echo: {text}"}]


def _script_object(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) and isinstance(value.get("steps"), list) else None


def item(role: MessageRole, **fields: Any) -> FrameworkMessage:
    return FrameworkMessage(role=role, framework_item=json.dumps({"role": role.value, **fields}, sort_keys=True),
                            text=fields.get("text"), tool_call_id=fields.get("tool_call_id"),
                            tool_name=fields.get("tool_name"), tool_arguments=fields.get("arguments"),
                            tool_output=fields.get("output"))


class ScriptedRunner:
    """Plays the turn's script; keeps the script position and unstored items in the run state."""

    incremental = False

    def __init__(self, state_dir: Path | None = None) -> None:
        self.state_dir = state_dir
        self.log = InvocationLog(state_dir / INVOCATIONS) if state_dir is not None else None

    def build_user_message(self, text: str) -> FrameworkMessage:
        return item(MessageRole.USER, text=text)

    def _gate(self, name: str) -> FileGate:
        if self.state_dir is None:
            raise RuntimeError(f"gate {name!r} needs {ENV_STATE_DIR}")
        return FileGate(self.state_dir, name)

    async def run_model_step(self, turn: AgentTurnContext) -> AgentTurnOutcome:
        user = next(m for m in reversed(turn.messages) if m.role is MessageRole.USER and m.turn_id == turn.turn_id)
        script = script_of(user.text or "")
        run = json.loads(turn.framework_run_state) if turn.framework_run_state else {"step": 0, "items": []}
        index: int = run["step"]
        step = script[min(index, len(script) - 1)]
        if self.log is not None:
            self.log.record("model", flow_id=turn.flow_id, turn_id=turn.turn_id, attempt=turn.attempt, step=index,
                            seen=[m.sequence for m in turn.messages], seen_digest=messages_digest(turn.messages))
        turn.events.write_text_delta(f"step {index}")
        if step.get("heartbeat"):
            await turn.heartbeat()
        if "gate" in step:
            await self._gate(step["gate"]).wait_for_release()
        if "sleep" in step:
            await asyncio.sleep(float(step["sleep"]))
        if "raise" in step and turn.attempt <= step.get("attempts", 1_000_000):
            raise RuntimeError(step["raise"])
        if "raise_bytes" in step:
            raise RuntimeError("r" * int(step["raise_bytes"]))
        pending = [_restored(m) for m in run["items"]]
        # Results of the previous response's tool calls, now final.
        results = sorted(turn.tool_calls.values(), key=lambda r: r.deferral_order)
        new_results = [r for r in results if r.tool_call_id in run.get("asked", [])]
        for record in new_results:
            pending.append(item(MessageRole.TOOL, tool_call_id=record.tool_call_id, tool_name=record.tool_name,
                                output=describe_tool_call_outcome(record)))
        if "tools" in step:
            calls = [self._deferred(turn, spec) for spec in step["tools"]]
            ask = item(MessageRole.ASSISTANT, text=None,
                       calls=[{"id": c.tool_call_id, "name": c.tool_name, "arguments": c.arguments} for c in calls])
            stored_now: Sequence[FrameworkMessage] = ()
            if self.incremental:
                stored_now, pending = [*pending, ask], []
            else:
                pending.append(ask)
            state = {"step": index + 1, "items": [_plain(m) for m in pending],
                     "asked": [c.tool_call_id for c in calls]}
            return ToolCallsRequested(json.dumps(state), calls, CALL_USAGE, new_messages=stored_now)
        if "turn_error" in step:
            return TurnCompleted(pending, CALL_USAGE, turn_error=step["turn_error"])
        text = "a" * int(step["answer_bytes"]) if "answer_bytes" in step else str(step.get("answer", "done"))
        text = text.replace("{results}", "; ".join(f"{r.tool_call_id}={describe_tool_call_outcome(r)}"
                                                     for r in results))
        text = text.replace("{seen}", str(len(turn.messages)))
        text = text.replace("{records}", json.dumps({r.tool_call_id: _outcome(r) for r in results}))
        pending.append(item(MessageRole.ASSISTANT, text=text))
        return TurnCompleted(pending, CALL_USAGE)

    @staticmethod
    def _deferred(turn: AgentTurnContext, spec: dict[str, Any]) -> DeferredToolCall:
        name = str(spec["name"])
        arguments = spec["args_text"] if "args_text" in spec else json.dumps(spec.get("args", {}))
        # The name prefix plays the framework's tool metadata; an explicit ToolPolicy still wins.
        effect = next((e for prefix, e in POLICIES.items() if name.startswith(prefix)), None)
        return DeferredToolCall(spec["id"], name, arguments, turn.resolve_tool_policy(name, effect))

    def log_tool_start(self, call: DeferredToolExecution) -> None:
        """Record that a tool run started (the `tool_start` entry tests count runs by)."""
        record = call.tool_call
        if self.log is not None:
            self.log.record("tool_start", flow_id=call.flow_id, turn_id=record.turn_id,
                            tool_call_id=record.tool_call_id, tool_name=record.tool_name, attempt=call.attempt,
                            idempotency_key=call.idempotency_key)

    async def execute_deferred_tool_call(
        self, call: DeferredToolExecution
    ) -> ToolExecutionResult | ToolInputRequested | ToolTaskStarted:
        record = call.tool_call
        args = json.loads(record.arguments)
        self.log_tool_start(call)
        if "gate" in args:
            await self._gate(args["gate"]).wait_for_release()
        if "sleep" in args:
            await asyncio.sleep(float(args["sleep"]))
        if "fail" in args:
            raise ToolExecutionError(args["fail"])
        if "unknown" in args:
            raise ToolOutcomeUnknownError(args["unknown"])
        if "fail_bytes" in args:
            raise ToolExecutionError("f" * int(args["fail_bytes"]))
        if "unknown_bytes" in args:
            raise ToolOutcomeUnknownError("u" * int(args["unknown_bytes"]))
        if "crash" in args:
            raise RuntimeError(args["crash"])
        if "crash_bytes" in args:
            raise RuntimeError("c" * int(args["crash_bytes"]))
        if "ask" in args and not call.input_answers:
            return ToolInputRequested(question=str(args["ask"]))
        if "task" in args:
            return await self._start_task(call, args["task"])
        output = "x" * int(args["output_bytes"]) if "output_bytes" in args else f"{record.tool_name} done"
        output = str(args.get("output", output))
        if self.log is not None:
            self.log.record("tool_end", flow_id=call.flow_id, turn_id=record.turn_id,
                            tool_call_id=record.tool_call_id, attempt=call.attempt)
        return ToolExecutionResult(output)

    async def _start_task(self, call: DeferredToolExecution, task: dict[str, Any]) -> ToolTaskStarted:
        record = call.tool_call
        task_id = call.heartbeat_checkpoint
        if task_id is None:  # no earlier attempt started it
            task_id = task.get("id", f"task-{record.tool_call_id}")
            if self.log is not None:
                self.log.record("task_start", flow_id=call.flow_id, tool_call_id=record.tool_call_id,
                                attempt=call.attempt, task_id=task_id, supports_tool_tasks=call.supports_tool_tasks)
            if isinstance(task_id, str):
                await call.save_heartbeat_checkpoint(task_id)
            if "start_gate" in task:
                await self._gate(task["start_gate"]).wait_for_release()
        return ToolTaskStarted(task_id=task_id, poll_interval_seconds=task.get("interval", 1))

    async def poll_tool_task(self, poll: ToolTaskPoll) -> ToolTaskPollOutcome:
        record = poll.tool_call
        task = json.loads(record.arguments)["task"]
        continuation = record.input_continuation or "p0"
        position = int(continuation.removeprefix("p"))
        step: dict[str, Any] = task["polls"][position]
        answer = poll.pending_answer
        if self.log is not None:
            self.log.record("poll", flow_id=poll.flow_id, tool_call_id=record.tool_call_id, task_id=record.task_id,
                            position=position, attempt=poll.attempt, idempotency_key=poll.idempotency_key,
                            pending_answer=None if answer is None else [answer.resolution.value, answer.answer,
                                                                        answer.interrupt_id])
        if "gate" in step:
            await self._gate(step["gate"]).wait_for_release()
        following = f"p{position + 1}"
        if "pending" in step:
            return ToolTaskPending(poll_interval_seconds=step["pending"], continuation=step.get("keep", following))
        if "ask" in step or "ask_bytes" in step:
            choices = list(step.get("choices", []))
            question = step["ask"] if "ask" in step else "q" * step["ask_bytes"]
            return ToolInputRequested(question=question, choices=choices, allows_free_text=not choices,
                                      continuation=following)
        if "fail" in step:
            raise ToolExecutionError(step["fail"])
        if "unknown" in step:
            raise ToolOutcomeUnknownError(step["unknown"])
        if "crash" in step and poll.attempt <= step.get("attempts", 1_000_000):
            raise RuntimeError(step["crash"])
        if "result_bytes" in step:
            return ToolExecutionResult("x" * int(step["result_bytes"]))
        received = [[a.resolution.value, a.answer] for a in poll.input_answers]
        return ToolExecutionResult(str(step.get("result", "task done")).replace("{answers}", json.dumps(received)))

    async def cancel_tool_task(self, cancellation: ToolTaskCancellation) -> None:
        record = cancellation.tool_call
        task = json.loads(record.arguments)["task"]
        if self.log is not None:
            self.log.record("task_cancel", flow_id=cancellation.flow_id, tool_call_id=record.tool_call_id,
                            task_id=record.task_id, attempt=cancellation.attempt)
        if "cancel_crash" in task:
            raise RuntimeError(task["cancel_crash"])


class IncrementalScriptedRunner(ScriptedRunner):
    """Stores each response's items as they appear, and rebuilds the unstored ones on failure."""

    incremental = True

    def build_unfinished_turn_messages(self, turn: AgentTurnContext) -> Sequence[FrameworkMessage]:
        user = next((m for m in turn.messages if m.role is MessageRole.USER and m.turn_id == turn.turn_id), None)
        gate = (_script_object(user.text or "") or {}).get("unfinished_gate") if user is not None else None
        if gate:
            self._gate(gate).wait_for_release_blocking()  # a sync method: this Worker's loop stops here
        run = json.loads(turn.framework_run_state) if turn.framework_run_state else {"items": [], "asked": []}
        items = [_restored(m) for m in run["items"]]
        for record in sorted(turn.tool_calls.values(), key=lambda r: r.deferral_order):
            if record.status.is_final:
                items.append(item(MessageRole.TOOL, tool_call_id=record.tool_call_id, tool_name=record.tool_name,
                                  output=describe_tool_call_outcome(record)))
        return items


def _outcome(record: AgentToolCall) -> dict[str, Any]:
    return {"status": record.status.value, "output": record.output, "error": record.error,
            "rejection_message": record.rejection_message, "task_id": record.task_id,
            "cancellation_reason": None if record.cancellation_reason is None else record.cancellation_reason.value}


def _plain(message: FrameworkMessage) -> dict[str, Any]:
    return {"role": message.role, "framework_item": message.framework_item, "text": message.text,
            "tool_call_id": message.tool_call_id, "tool_name": message.tool_name,
            "tool_arguments": message.tool_arguments, "tool_output": message.tool_output}


def _restored(fields: dict[str, Any]) -> FrameworkMessage:
    return FrameworkMessage(**{**fields, "role": MessageRole(fields["role"])})


def state_dir_from_env() -> Path | None:
    value = os.environ.get(ENV_STATE_DIR)
    return Path(value) if value else None


def wait_for_start_gate(state_dir: Path, name: str) -> None:
    """A standby Worker child's wait at its start gate (ENV_START_GATE), until the test releases it.

    run_agent_worker watches the test process only once it runs, after this wait: a standby whose
    test process is gone (SIGKILLed, so it left no stack to kill the standby) exits here instead of
    waiting for ever.
    """
    gate = FileGate(state_dir, name)
    gate.mark_reached()
    parent = os.environ.get(ENV_PARENT_PID)
    while not gate.release_path.exists():
        if parent is not None and os.getppid() != int(parent):
            raise SystemExit(f"standby Worker {os.getpid()}: test process {parent} is gone; not starting")
        time.sleep(START_GATE_POLL_SECONDS)


def build_flow(state_dir: Path | None = None, *, incremental: bool | None = None,
               interrupt_deadline: timedelta | None = None,
               tool_policies: dict[str, ToolPolicy] | None = None,
               built_in_tools: frozenset[BuiltInTool] | None = None) -> AgentSessionFlow:
    """The Flow both the test process and the Worker child build (options from the environment too)."""
    start_gate = os.environ.get(ENV_START_GATE)
    if start_gate:
        # A standby Worker child: imported, and registers only once the test releases it.
        gate_dir = state_dir or state_dir_from_env()
        if gate_dir is None:
            raise RuntimeError(f"{ENV_START_GATE} needs {ENV_STATE_DIR}")
        wait_for_start_gate(gate_dir, start_gate)
    if incremental is None:
        incremental = os.environ.get(ENV_INCREMENTAL) == "1"
    if interrupt_deadline is None and os.environ.get(ENV_DEADLINE_SECONDS):
        interrupt_deadline = timedelta(seconds=float(os.environ[ENV_DEADLINE_SECONDS]))
    if built_in_tools is None:
        names = os.environ.get(ENV_BUILT_IN_TOOLS, "")
        built_in_tools = frozenset(BuiltInTool(n) for n in names.split(",") if n)
    runner = (IncrementalScriptedRunner if incremental else ScriptedRunner)(state_dir or state_dir_from_env())
    return AgentSessionFlow(runner, FLOW_TYPE, AgentSessionOptions(
        tool_policies=tool_policies or {}, interrupt_deadline=interrupt_deadline, built_in_tools=built_in_tools,
    ))
