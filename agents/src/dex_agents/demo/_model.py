"""The demo model: a ScriptedModelClient that answers plain text and reads slash commands.

Commands (the last user text of the turn):
    /echo TEXT                 answers TEXT
    /tool NAME {json}          calls tool NAME with the JSON arguments, then reports its result
    /ask QUESTION              asks the user (the ask_user built-in), then reports the answer
    /choose QUESTION | A | B   asks with choices only
    /wait SECONDS REASON       waits on a durable Timer (the durable_wait built-in)
    /plan TASK; TASK; ...      writes a plan (write_todos); approved, it marks every task completed
    /task TOPIC                builds a report as a tool task the session polls (build_report)
    /help                      lists the commands
Anything else gets `Demo reply: <text>`. No model key is needed, and every reply is a pure
function of the request, so a RunModel that runs again answers the same.
"""

from __future__ import annotations

import json

from ..builtin_loop import ModelRequest, ScriptedModelClient, ScriptedModelReply, ScriptedToolCall

# The executing turn's user message, and the plan note the built-in loop shows before the turn.
PLAN_APPROVAL_PREFIX = "[Dex] The user approved plan revision"
PLAN_NOTE_PREFIX = "[Dex] The current plan, revision"

HELP_TEXT = (
    "Demo model commands:\n"
    "  /echo TEXT                 answer TEXT\n"
    "  /tool NAME {json}          call tool NAME with JSON arguments (lookup_order, refund_order)\n"
    "  /ask QUESTION              ask you a question\n"
    "  /choose QUESTION | A | B   ask you to choose\n"
    "  /wait SECONDS REASON       wait on a durable timer\n"
    "  /plan TASK; TASK; ...      write a plan for you to review and execute\n"
    "  /task TOPIC                build a report as a background task the session polls\n"
    "  /help                      this list\n"
    "Anything else gets a demo reply."
)


def demo_reply(request: ModelRequest) -> ScriptedModelReply:
    """The demo model's answer to one request."""
    results = ScriptedModelClient.tool_results(request)
    if results:
        lines = [f"{r.tool_name} returned: {r.output}" for r in results]
        return ScriptedModelReply(text="\n".join(lines))
    texts = ScriptedModelClient.user_texts(request)
    text = texts[-1].strip() if texts else ""
    if text.startswith(PLAN_APPROVAL_PREFIX):
        return _execute_plan(texts)
    command, _, rest = text.partition(" ")
    if command == "/plan":
        return _write_plan(rest)
    if command == "/echo":
        return ScriptedModelReply(text=rest or "(nothing to echo)")
    if command == "/help":
        return ScriptedModelReply(text=HELP_TEXT)
    if command == "/tool":
        return _tool_reply(rest.strip())
    if command == "/ask":
        return _built_in("ask_user", {"question": rest.strip() or "What should I do next?"})
    if command == "/choose":
        question, *choices = [part.strip() for part in rest.split("|")]
        return _built_in("ask_user", {"question": question or "Which one?", "choices": choices or ["yes", "no"],
                                      "allows_free_text": False})
    if command == "/wait":
        seconds, _, reason = rest.strip().partition(" ")
        count = _whole_number(seconds)
        if count is None:
            return ScriptedModelReply(text="Usage: /wait SECONDS REASON")
        return _built_in("durable_wait", {"duration_seconds": count, "reason": reason or "demo wait"})
    if command == "/task":
        topic = rest.strip() or "orders"
        return ScriptedModelReply(text=f"Building a report on {topic}.",
                                  tool_calls=[ScriptedToolCall("build_report", json.dumps({"topic": topic}))])
    return ScriptedModelReply(text=f"Demo reply: {text}")


def _whole_number(text: str) -> int | None:
    """`text` as a count of seconds, or None. isdecimal, not isdigit: "²" is a digit that int()
    refuses, and a ValueError here would fail the model call, and with it the turn."""
    if not text.isdecimal():
        return None
    try:
        return int(text)
    except ValueError:  # more digits than int() converts (sys.get_int_max_str_digits)
        return None


def _write_plan(rest: str) -> ScriptedModelReply:
    tasks = [task.strip() for task in rest.split(";") if task.strip()]
    if not tasks:
        return ScriptedModelReply(text="Usage: /plan TASK; TASK; ...")
    return ScriptedModelReply(
        text=f"Here is a plan with {len(tasks)} tasks for you to review.",
        tool_calls=[ScriptedToolCall("write_todos", json.dumps(
            {"todos": [{"content": task, "status": "pending"} for task in tasks]}))],
    )


def _execute_plan(texts: list[str]) -> ScriptedModelReply:
    """The executing turn: "do" every task of the plan the note shows and mark it completed."""
    note = next((t for t in reversed(texts) if t.startswith(PLAN_NOTE_PREFIX)), "")
    tasks = [line.split("] ", 1)[1] for line in note.splitlines()[1:] if line.startswith("- [") and "] " in line]
    if not tasks:
        return ScriptedModelReply(text="There is no plan to execute.")
    return ScriptedModelReply(
        text="Executing the plan: " + "; ".join(tasks) + ".",
        tool_calls=[ScriptedToolCall("write_todos", json.dumps(
            {"todos": [{"content": task, "status": "completed"} for task in tasks]}))],
    )


def _built_in(name: str, arguments: dict[str, object]) -> ScriptedModelReply:
    return ScriptedModelReply(tool_calls=[ScriptedToolCall(name, json.dumps(arguments))])


def _tool_reply(rest: str) -> ScriptedModelReply:
    name, _, arguments = rest.partition(" ")
    if not name:
        return ScriptedModelReply(text="Usage: /tool NAME {json arguments}")
    arguments = arguments.strip() or "{}"
    try:
        json.loads(arguments)
    except ValueError:
        return ScriptedModelReply(text=f"The arguments for {name} are not JSON: {arguments}")
    return ScriptedModelReply(text=f"Calling {name}.", tool_calls=[ScriptedToolCall(name, arguments)])


def demo_model() -> ScriptedModelClient:
    return ScriptedModelClient(demo_reply)
