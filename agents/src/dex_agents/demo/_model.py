"""The demo model: a ScriptedModelClient that answers plain text and reads slash commands.

Commands (the last user text of the turn):
    /echo TEXT            answers TEXT
    /tool NAME {json}     calls tool NAME with the JSON arguments, then reports its result
    /help                 lists the commands
Anything else gets `Demo reply: <text>`. No model key is needed, and every reply is a pure
function of the request, so a RunModel that runs again answers the same.
"""

from __future__ import annotations

import json

from ..builtin_loop import ModelRequest, ScriptedModelClient, ScriptedModelReply, ScriptedToolCall

HELP_TEXT = (
    "Demo model commands:\n"
    "  /echo TEXT          answer TEXT\n"
    "  /tool NAME {json}   call tool NAME with JSON arguments\n"
    "  /help               this list\n"
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
    command, _, rest = text.partition(" ")
    if command == "/echo":
        return ScriptedModelReply(text=rest or "(nothing to echo)")
    if command == "/help":
        return ScriptedModelReply(text=HELP_TEXT)
    if command == "/tool":
        return _tool_reply(rest.strip())
    return ScriptedModelReply(text=f"Demo reply: {text}")


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
