"""LiteLLMModelClient against a fake provider on 127.0.0.1: wire bodies, streaming, usage, replay, no retries.

The fake provider is a real HTTP server (http.server in a thread) speaking the OpenAI Responses API, the
Chat Completions streaming API and the Anthropic Messages streaming API as SSE. LiteLLM reaches it through
`api_base`, so every assertion about a request is about the JSON body the server received.
"""

from __future__ import annotations

import base64
import dataclasses
import email.utils
import json
import os
import re
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

# LiteLLM would fetch its model cost map (and more) over the network when imported: stay offline.
os.environ.setdefault("LITELLM_OFFLINE_MODE", "true")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import litellm
import pytest
from agents.tests.builtin_agent import InProcessEngine, lookup_order, refund_order
from agents.tests.conftest import REPO_ROOT
from agents.tests.session_driver import turns_ended
from engine.tests.conftest import db_url, pg_database, pg_databases, wait_until  # noqa: F401 - the fixtures used here

from dex_agents import (
    AgentEvent,
    AgentEventWriter,
    AgentSessionFlow,
    AgentSnapshot,
    AgentUsage,
    CompactionPolicy,
    MessageRole,
    ModelCallMetadata,
    RunModelLimit,
    ToolEffect,
)
from dex_agents._constants import MIN_HIDDEN_ENVIRONMENT_SECRET_CHARS
from dex_agents.builtin_loop import (
    AgentDefinition,
    BuiltinLoopAgentRunner,
    ModelInputItem,
    ModelOutputItem,
    ModelOutputWriter,
    ModelRequest,
    ModelToolCall,
    ModelToolDefinition,
    OutputItemKind,
    ToolChoice,
    ToolResultInput,
    UserTextInput,
    builtin_agent_session_flow,
    builtin_agent_session_options,
    estimate_request_tokens,
    function_tool,
)
from dex_agents.litellm import LiteLLMModelClient
from dex_agents.testing import executed_steps, to_step_history, wait_for_agent_snapshot
from dex_engine import HistoryEntry

litellm.suppress_debug_info = True  # no "Provider List" banner on every expected error

# LiteLLM's own pydantic models warn about themselves; the warnings say nothing about this client.
pytestmark = [
    pytest.mark.filterwarnings(r"ignore::UserWarning:pydantic\..*"),
    pytest.mark.filterwarnings("ignore::pydantic.warnings.PydanticDeprecatedSince211"),
]

# The fake provider --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Received:
    path: str
    headers: Mapping[str, str]
    body: bytes
    at_ms: int = 0  # when it arrived, by the wall clock the engine's history uses

    @property
    def json(self) -> Any:
        return json.loads(self.body)


@dataclass(frozen=True)
class Reply:
    status: int
    body: bytes
    content_type: str
    headers: tuple[tuple[str, str], ...] = ()  # more response headers (Retry-After, ...)


class FakeProvider:
    """Records each POST and answers it with the next queued reply for its path (500 when none is queued)."""

    def __init__(self) -> None:
        self.received: list[Received] = []
        self._replies: dict[str, list[Reply]] = {}
        self._lock = threading.Lock()
        provider = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                reply = provider._take(Received(self.path, {k.lower(): v for k, v in self.headers.items()}, body,
                                                int(time.time() * 1000)))
                self.send_response(reply.status)
                self.send_header("Content-Type", reply.content_type)
                for name, value in reply.headers:
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(reply.body)))
                self.end_headers()
                self.wfile.write(reply.body)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        # A short poll interval: shutdown() waits for the server loop's next poll, 0.5 s by default, in every test.
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.01},
                                        daemon=True)
        self._thread.start()
        self.url = f"http://127.0.0.1:{self._server.server_port}"

    def _take(self, received: Received) -> Reply:
        with self._lock:
            self.received.append(received)
            queue = self._replies.get(received.path) or []
            if queue:
                return queue.pop(0)
        error = {"error": {"message": f"no reply queued for {received.path}", "type": "server_error"}}
        return Reply(500, json.dumps(error).encode(), "application/json")

    def queue(self, path: str, reply: Reply) -> None:
        with self._lock:
            self._replies.setdefault(path, []).append(reply)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)


def sse(events: list[dict[str, Any]], *, named: bool, done: bool = False) -> Reply:
    """A complete SSE body: `event:` lines for the Responses and Anthropic APIs, `[DONE]` for Chat Completions."""
    lines = [(f"event: {e['type']}\n" if named else "") + f"data: {json.dumps(e)}\n\n" for e in events]
    if done:
        lines.append("data: [DONE]\n\n")
    return Reply(200, "".join(lines).encode(), "text/event-stream")


def error_reply(status: int) -> Reply:
    return Reply(status, json.dumps({"error": {"message": "overloaded", "type": "server_error"}}).encode(),
                 "application/json")


@pytest.fixture
def provider() -> Iterator[FakeProvider]:
    fake = FakeProvider()
    try:
        yield fake
    finally:
        fake.close()


# Provider payloads --------------------------------------------------------------------------------

RESPONSES_PATH = "/v1/responses"
CHAT_PATH = "/v1/chat/completions"
MESSAGES_PATH = "/v1/messages"

ENCRYPTED = "gAAAAABpZ3Jhbnl0ZXN0LWVuY3J5cHRlZA+/=="
REASONING_ITEM = {"id": "rs_1", "type": "reasoning", "summary": [{"type": "summary_text", "text": "Check A-1."}],
                  "encrypted_content": ENCRYPTED}
MESSAGE_ITEM = {"id": "msg_1", "type": "message", "status": "completed", "role": "assistant",
                "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]}
CALL_ITEM = {"id": "fc_1", "type": "function_call", "status": "completed", "call_id": "call_1",
             "name": "lookup_order", "arguments": '{"order_id":"A-1"}'}
RESPONSES_USAGE = {"input_tokens": 100, "input_tokens_details": {"cached_tokens": 40}, "output_tokens": 20,
                   "output_tokens_details": {"reasoning_tokens": 7}, "total_tokens": 120}


def responses_stream(items: list[dict[str, Any]], *, response_id: str = "resp_1", incomplete: str | None = None,
                     listed: bool = True) -> Reply:
    """A Responses API stream: each item added, its deltas, done; then response.completed with usage
    (response.incomplete for the reason `incomplete`, such as "max_output_tokens"), whose output lists
    the items unless not `listed` (some servers send it empty)."""
    response = {"id": response_id, "object": "response", "created_at": 1767225600,
                "status": "incomplete" if incomplete else "completed",
                "model": "gpt-5-2026-01-01", "output": items if listed else [], "usage": RESPONSES_USAGE, "error": None,
                "incomplete_details": {"reason": incomplete} if incomplete else None, "instructions": None,
                "metadata": {}, "parallel_tool_calls": True,
                "tool_choice": "auto", "tools": [], "temperature": 1.0, "top_p": 1.0}
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": {**response, "status": "in_progress", "output": [], "usage": None}},
    ]
    for index, item in enumerate(items):
        events.append({"type": "response.output_item.added", "output_index": index, "item": item})
        if item["type"] == "reasoning" and item["summary"]:
            events.append({"type": "response.reasoning_summary_text.delta", "item_id": item["id"],
                           "output_index": index, "summary_index": 0, "delta": item["summary"][0]["text"]})
        elif item["type"] == "reasoning":  # an open-weight model's raw reasoning text, no summary
            events.append({"type": "response.reasoning_text.delta", "item_id": item["id"], "output_index": index,
                           "content_index": 0, "delta": item["content"][0]["text"]})
        if item["type"] == "message":
            content = item["content"][0]
            kind = "refusal" if content["type"] == "refusal" else "output_text"
            text = content[kind if kind == "refusal" else "text"]
            for part in (text[:4], text[4:]):
                events.append({"type": f"response.{kind}.delta", "item_id": item["id"], "output_index": index,
                               "content_index": 0, "delta": part, **({} if kind == "refusal" else {"logprobs": []})})
        events.append({"type": "response.output_item.done", "output_index": index, "item": item})
    events.append({"type": "response.incomplete" if incomplete else "response.completed", "response": response})
    for number, event in enumerate(events):
        event["sequence_number"] = number
    return sse(events, named=True)


CHAT_CALL = {"id": "call_7", "type": "function",
             "function": {"name": "lookup_order", "arguments": '{"order_id":"A-1"}'}}


def chat_stream(*, reasoning: str | None = None, text: str | None = None, call: dict[str, Any] | None = None,
                usage: dict[str, Any] | None = None, finish: str | None = None) -> Reply:
    """A Chat Completions stream: reasoning_content, content in two pieces, a tool call in two pieces, usage;
    finish_reason `finish`, else "tool_calls" or "stop"."""

    def chunk(delta: dict[str, Any] | None, finish: str | None = None) -> dict[str, Any]:
        return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1767225600, "model": "test-model",
                "choices": [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]}

    chunks = [chunk({"role": "assistant", "content": ""})]
    if reasoning:
        chunks += [chunk({"reasoning_content": reasoning[:5]}), chunk({"reasoning_content": reasoning[5:]})]
    if text:
        chunks += [chunk({"content": text[:3]}), chunk({"content": text[3:]})]
    if call:
        arguments = call["function"]["arguments"]
        first = {"index": 0, "type": "function", **({"id": call["id"]} if call.get("id") else {})}
        chunks.append(chunk({"tool_calls": [{**first, "function": {
            "name": call["function"]["name"], "arguments": arguments[:5]}}]}))
        chunks.append(chunk({"tool_calls": [{"index": 0, "function": {"arguments": arguments[5:]}}]}))
    chunks.append(chunk({}, finish or ("tool_calls" if call else "stop")))
    last = chunk(None)
    last["usage"] = usage or {"prompt_tokens": 50, "completion_tokens": 12, "total_tokens": 62,
                              "prompt_tokens_details": {"cached_tokens": 10},
                              "completion_tokens_details": {"reasoning_tokens": 3}}
    chunks.append(last)
    return sse(chunks, named=False, done=True)


SIGNATURE = "EqQBCkYIBxgCKkDsignature+/=="


def anthropic_stream(*, thinking: str, text: str) -> Reply:
    """An Anthropic Messages stream: a signed thinking block, then text."""
    events: list[dict[str, Any]] = [
        {"type": "message_start", "message": {
            "id": "msg_01", "type": "message", "role": "assistant", "model": "claude-sonnet-4-5-20250929",
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": 30, "output_tokens": 1, "cache_read_input_tokens": 5,
                      "cache_creation_input_tokens": 0}}},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": "",
                                                                     "signature": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": thinking}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "signature_delta", "signature": SIGNATURE}},
        {"type": "content_block_stop", "index": 0},
        {"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": text}},
        {"type": "content_block_stop", "index": 1},
        {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
         "usage": {"output_tokens": 25}},
        {"type": "message_stop"},
    ]
    return sse(events, named=True)


# Helpers ------------------------------------------------------------------------------------------

LOOKUP_TOOL = ModelToolDefinition("lookup_order", "Look up an order.", {
    "type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]})


def collecting_writer() -> tuple[ModelOutputWriter, list[AgentEvent]]:
    events: list[AgentEvent] = []
    return ModelOutputWriter(AgentEventWriter(events.append, "turn-1", "exec-1", 1)), events


def deltas(events: list[AgentEvent]) -> list[tuple[str, str]]:
    return [(event.type, json.loads(event.payload)["text"]) for event in events]


def openai_client(provider: FakeProvider) -> LiteLLMModelClient:
    return LiteLLMModelClient("openai/gpt-5", api_base=provider.url + "/v1", api_key_provider=lambda: "sk-provided")


def chat_client(provider: FakeProvider) -> LiteLLMModelClient:
    return LiteLLMModelClient("hosted_vllm/test-model", api_base=provider.url + "/v1")


# The Responses API --------------------------------------------------------------------------------


async def test_responses_call_streams_items_usage_and_metadata(provider: FakeProvider) -> None:
    """OpenAI goes to the Responses API with store=False and include; items, deltas, usage, metadata map."""
    client = openai_client(provider)
    assert client.api_label == "litellm.responses:openai"
    provider.queue(RESPONSES_PATH, responses_stream([REASONING_ITEM, MESSAGE_ITEM, CALL_ITEM]))
    writer, events = collecting_writer()
    request = ModelRequest("Be brief.", (UserTextInput("Where is A-1?"),), (LOOKUP_TOOL,), ToolChoice.REQUIRED)

    response = await client.call_model(request, writer)

    assert [item.kind for item in response.output] == [
        OutputItemKind.REASONING, OutputItemKind.TEXT, OutputItemKind.TOOL_CALL]
    assert {item.api for item in response.output} == {"litellm.responses:openai"}
    assert [json.loads(item.item) for item in response.output] == [REASONING_ITEM, MESSAGE_ITEM, CALL_ITEM]
    assert response.output[0].text == "Check A-1."
    assert response.output[1].text == "Let me look."
    assert response.output[2].tool_call == ModelToolCall("call_1", "lookup_order", '{"order_id":"A-1"}')
    assert deltas(events) == [("reasoning_delta", "Check A-1."), ("text_delta", "Let "), ("text_delta", "me look.")]
    assert response.usage == AgentUsage(model_calls=1, input_tokens=100, output_tokens=20, cached_input_tokens=40,
                                        reasoning_tokens=7)
    assert response.metadata == ModelCallMetadata("openai/gpt-5", "gpt-5-2026-01-01", "openai", "resp_1",
                                                  ("completed",))

    [sent] = provider.received
    assert sent.path == RESPONSES_PATH
    assert sent.headers["authorization"] == "Bearer sk-provided"  # the key came from api_key_provider
    body = sent.json
    assert body["store"] is False
    assert body["include"] == ["reasoning.encrypted_content"]
    assert body["stream"] is True
    assert body["instructions"] == "Be brief."
    assert body["input"] == [{"role": "user", "content": "Where is A-1?"}]
    assert body["tools"] == [{"type": "function", "name": "lookup_order", "description": "Look up an order.",
                              "parameters": dict(LOOKUP_TOOL.parameters_schema), "strict": False}]
    assert body["tool_choice"] == "required"
    assert "previous_response_id" not in body


async def test_responses_replay_is_exact_to_the_same_api_and_text_only_elsewhere(provider: FakeProvider) -> None:
    """The second request carries the first response's items unchanged; Chat Completions gets text and calls."""
    client = openai_client(provider)
    provider.queue(RESPONSES_PATH, responses_stream([REASONING_ITEM, MESSAGE_ITEM, CALL_ITEM]))
    first = await client.call_model(ModelRequest(None, (UserTextInput("Where is A-1?"),)), collecting_writer()[0])
    history = (UserTextInput("Where is A-1?"), *first.output, ToolResultInput("call_1", "lookup_order", "shipped"))
    assert "tool_choice" not in provider.received[-1].json  # without tools: OpenAI refuses one alone

    provider.queue(RESPONSES_PATH, responses_stream([MESSAGE_ITEM], response_id="resp_2"))
    await client.call_model(ModelRequest(None, history, (LOOKUP_TOOL,)), collecting_writer()[0])
    replayed = provider.received[-1]
    assert replayed.json["input"] == [
        {"role": "user", "content": "Where is A-1?"},
        REASONING_ITEM, MESSAGE_ITEM, CALL_ITEM,
        {"type": "function_call_output", "call_id": "call_1", "output": "shipped"},
    ]
    assert f'"encrypted_content": "{ENCRYPTED}"'.encode() in replayed.body or (
        f'"encrypted_content":"{ENCRYPTED}"'.encode() in replayed.body)

    # Another provider and API: the reasoning is dropped, the text and the call replay in its own shape.
    provider.queue(CHAT_PATH, chat_stream(text="It shipped."))
    await chat_client(provider).call_model(ModelRequest("Be brief.", history), collecting_writer()[0])
    other = provider.received[-1]
    assert other.path == CHAT_PATH
    assert other.json["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Where is A-1?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "lookup_order", "arguments": '{"order_id":"A-1"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "shipped"},
    ]
    assert b"encrypted_content" not in other.body and b"Check A-1." not in other.body


async def test_a_response_cut_off_while_reasoning_replays_without_its_reasoning(provider: FakeProvider) -> None:
    """A response that reached max_output_tokens while reasoning has only a reasoning item; later
    requests leave it out, and keep the reasoning of complete responses. Catches: the lone item
    replayed, which OpenAI refuses ("of type 'reasoning' was provided without its required
    following item"), so every later turn of the session failed."""
    client = openai_client(provider)
    provider.queue(RESPONSES_PATH, responses_stream([REASONING_ITEM], incomplete="max_output_tokens"))
    cut = await client.call_model(ModelRequest(None, (UserTextInput("Think hard."),)), collecting_writer()[0])
    assert [item.kind for item in cut.output] == [OutputItemKind.REASONING]
    assert cut.metadata is not None and cut.metadata.finish_reasons == ("max_output_tokens",)

    provider.queue(RESPONSES_PATH, responses_stream([REASONING_ITEM, MESSAGE_ITEM, CALL_ITEM], response_id="resp_2"))
    history = (UserTextInput("Think hard."), *cut.output, UserTextInput("Where is A-1?"))
    full = await client.call_model(ModelRequest(None, history), collecting_writer()[0])
    assert provider.received[-1].json["input"] == [
        {"role": "user", "content": "Think hard."}, {"role": "user", "content": "Where is A-1?"}]
    provider.queue(CHAT_PATH, chat_stream(text="Fine."))
    await chat_client(provider).call_model(ModelRequest(None, history), collecting_writer()[0])
    # Another API: no assistant message at all, rather than one with neither content nor tool calls.
    assert provider.received[-1].json["messages"] == [
        {"role": "user", "content": "Think hard."}, {"role": "user", "content": "Where is A-1?"}]

    provider.queue(RESPONSES_PATH, responses_stream([MESSAGE_ITEM], response_id="resp_3"))
    history = (*history, *full.output, ToolResultInput("call_1", "lookup_order", "shipped"))
    await client.call_model(ModelRequest(None, history), collecting_writer()[0])
    assert provider.received[-1].json["input"] == [
        {"role": "user", "content": "Think hard."}, {"role": "user", "content": "Where is A-1?"},
        REASONING_ITEM, MESSAGE_ITEM, CALL_ITEM,
        {"type": "function_call_output", "call_id": "call_1", "output": "shipped"},
    ]


async def test_a_provider_tools_record_that_ends_a_cut_response_is_replayed(provider: FakeProvider) -> None:
    """Only reasoning items that end a cut-off response are left out: a record of a provider-side
    tool (a web search's) there is replayed as the provider sent it. Catches: every item of the
    response's end taken for reasoning, the provider's state of its own tool lost."""
    record = {"id": "ws_1", "type": "web_search_call", "status": "completed",
              "action": {"type": "search", "query": "order A-1"}}
    client = openai_client(provider)
    provider.queue(RESPONSES_PATH, responses_stream([record], incomplete="max_output_tokens"))
    cut = await client.call_model(ModelRequest(None, (UserTextInput("Search A-1."),)), collecting_writer()[0])
    provider.queue(RESPONSES_PATH, responses_stream([MESSAGE_ITEM], response_id="resp_2"))
    await client.call_model(ModelRequest(None, (UserTextInput("Search A-1."), *cut.output, UserTextInput("And?"))),
                            collecting_writer()[0])
    assert provider.received[-1].json["input"] == [
        {"role": "user", "content": "Search A-1."}, record, {"role": "user", "content": "And?"}]


# Chat Completions ---------------------------------------------------------------------------------


async def test_chat_stream_items_usage_metadata_and_replay(provider: FakeProvider) -> None:
    """Other providers stream Chat Completions; the items replay as one assistant message, and elsewhere without
    reasoning."""
    client = chat_client(provider)
    assert client.api_label == "litellm.chat:hosted_vllm"
    provider.queue(CHAT_PATH, chat_stream(reasoning="Let me think.", text="Hello", call=CHAT_CALL))
    writer, events = collecting_writer()
    request = ModelRequest("Be brief.", (UserTextInput("Where is A-1?"),), (LOOKUP_TOOL,), ToolChoice.AUTO)

    response = await client.call_model(request, writer)

    assert [item.kind for item in response.output] == [
        OutputItemKind.REASONING, OutputItemKind.TEXT, OutputItemKind.TOOL_CALL]
    assert response.output[0].text == "Let me think."
    assert response.output[1].text == "Hello"
    assert response.output[2].tool_call == ModelToolCall("call_7", "lookup_order", '{"order_id":"A-1"}')
    assert json.loads(response.output[2].item) == {"role": "assistant", "tool_calls": [CHAT_CALL]}
    assert deltas(events) == [("reasoning_delta", "Let m"), ("reasoning_delta", "e think."),
                              ("text_delta", "Hel"), ("text_delta", "lo")]
    assert response.usage == AgentUsage(model_calls=1, input_tokens=50, output_tokens=12, cached_input_tokens=10,
                                        reasoning_tokens=3)
    assert response.metadata is not None
    assert response.metadata.request_model == "hosted_vllm/test-model"
    assert response.metadata.provider_name == "hosted_vllm"
    assert response.metadata.finish_reasons == ("tool_calls",)
    sent = provider.received[-1].json
    assert sent["stream"] is True
    assert sent["messages"] == [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "Where is A-1?"}]
    assert sent["tools"] == [{"type": "function", "function": {
        "name": "lookup_order", "description": "Look up an order.", "parameters": dict(LOOKUP_TOOL.parameters_schema)}}]
    assert sent["tool_choice"] == "auto"

    history = (UserTextInput("Where is A-1?"), *response.output, ToolResultInput("call_7", "lookup_order", "shipped"))
    provider.queue(CHAT_PATH, chat_stream(text="It shipped."))
    await client.call_model(ModelRequest(None, history), collecting_writer()[0])
    assistant = provider.received[-1].json["messages"][1]
    assert assistant["tool_calls"] == [CHAT_CALL]
    assert assistant["content"] == "Hello"
    assert provider.received[-1].json["messages"][2] == {"role": "tool", "tool_call_id": "call_7", "content": "shipped"}

    # To the Responses API the same items are foreign: text and the call, no reasoning.
    provider.queue(RESPONSES_PATH, responses_stream([MESSAGE_ITEM]))
    await openai_client(provider).call_model(ModelRequest(None, history), collecting_writer()[0])
    assert provider.received[-1].json["input"] == [
        {"role": "user", "content": "Where is A-1?"},
        {"role": "assistant", "content": "Hello"},
        {"type": "function_call", "call_id": "call_7", "name": "lookup_order", "arguments": '{"order_id":"A-1"}'},
        {"type": "function_call_output", "call_id": "call_7", "output": "shipped"},
    ]
    assert b"Let me think." not in provider.received[-1].body


async def test_a_streamed_tool_call_without_an_id_gets_one(provider: FakeProvider) -> None:
    """A Chat Completions stream whose tool call carries no id (some OpenAI-compatible servers send
    none) gives the call an id, `call_<response id>_<index>`, and keeps it. Catches: LiteLLM's chunk
    builder dropping every call without an id, the model's call lost without a word."""
    provider.queue(CHAT_PATH, chat_stream(call={key: value for key, value in CHAT_CALL.items() if key != "id"}))
    response = await chat_client(provider).call_model(
        ModelRequest(None, (UserTextInput("Where is A-1?"),), (LOOKUP_TOOL,)), collecting_writer()[0])
    assert [item.tool_call for item in response.output] == [
        ModelToolCall("call_chatcmpl-1_0", "lookup_order", '{"order_id":"A-1"}')]


async def test_a_streamed_tool_call_without_a_name_is_kept_with_none(provider: FakeProvider) -> None:
    """A Chat Completions stream whose tool call carries no name gives a call named "" (the session
    then records it failed with TOOL_NAME_MISSING, as on the Responses API), stored with no name.
    Catches: LiteLLM's chunk builder dropping every call without a name, so the turn ended as if
    the model had asked for nothing."""
    nameless = {**CHAT_CALL, "function": {"name": None, "arguments": '{"order_id":"A-1"}'}}
    provider.queue(CHAT_PATH, chat_stream(call=nameless))
    response = await chat_client(provider).call_model(
        ModelRequest(None, (UserTextInput("Where is A-1?"),), (LOOKUP_TOOL,)), collecting_writer()[0])
    assert [item.tool_call for item in response.output] == [ModelToolCall("call_7", "", '{"order_id":"A-1"}')]
    (stored,) = json.loads(response.output[0].item)["tool_calls"]
    assert stored["function"] == {"name": "", "arguments": '{"order_id":"A-1"}'}


def chat_chunks(deltas: list[dict[str, Any]], finish: str) -> Reply:
    """A Chat Completions stream of these deltas, then `finish`, then [DONE]."""
    chunks = [{"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1767225600, "model": "test-model",
               "choices": [{"index": 0, "delta": delta, "finish_reason": None}]} for delta in deltas]
    chunks.append({**chunks[0], "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
    return sse(chunks, named=False, done=True)


def call_fragment(index: int | None, arguments: str, call_id: str | None = None) -> dict[str, Any]:
    """A streamed tool call fragment; the first of a call carries its id and name; index None sends none."""
    fragment: dict[str, Any] = {} if index is None else {"index": index}
    if call_id is not None:
        fragment.update(id=call_id, type="function", function={"name": "lookup_order", "arguments": arguments})
    else:
        fragment["function"] = {"arguments": arguments}
    return {"tool_calls": [fragment]}


async def test_streamed_tool_calls_that_share_an_index_stay_apart(provider: FakeProvider) -> None:
    """Calls that a server streams under one index (Ollama and some gateways send 0, or none, for
    every call) stay separate calls, each with its own id and arguments; calls interleaved under
    their own indexes assemble as before. Catches: the chunk builder joining them by index into one
    call with the last id and the argument texts run together, so one call was lost and the other
    failed as not a JSON object."""
    shared = [call_fragment(0, '{"order_', "call_a"), call_fragment(0, 'id":"A-1"}'),
              call_fragment(0, '{"order_', "call_b"), call_fragment(0, 'id":"B-2"}'),
              call_fragment(None, '{"order_id":"C-3"}', "call_c")]
    provider.queue(CHAT_PATH, chat_chunks(shared, "tool_calls"))
    response = await chat_client(provider).call_model(
        ModelRequest(None, (UserTextInput("Where are my orders?"),), (LOOKUP_TOOL,)), collecting_writer()[0])
    assert [item.tool_call for item in response.output] == [
        ModelToolCall("call_a", "lookup_order", '{"order_id":"A-1"}'),
        ModelToolCall("call_b", "lookup_order", '{"order_id":"B-2"}'),
        ModelToolCall("call_c", "lookup_order", '{"order_id":"C-3"}')]
    assert [json.loads(item.item)["tool_calls"][0]["id"] for item in response.output] == ["call_a", "call_b", "call_c"]

    interleaved = [call_fragment(0, '{"order_', "call_a"), call_fragment(1, '{"order_', "call_b"),
                   call_fragment(1, 'id":"B-2"}'), call_fragment(0, 'id":"A-1"}')]
    provider.queue(CHAT_PATH, chat_chunks(interleaved, "tool_calls"))
    response = await chat_client(provider).call_model(
        ModelRequest(None, (UserTextInput("Where are my orders?"),), (LOOKUP_TOOL,)), collecting_writer()[0])
    assert [item.tool_call for item in response.output] == [
        ModelToolCall("call_a", "lookup_order", '{"order_id":"A-1"}'),
        ModelToolCall("call_b", "lookup_order", '{"order_id":"B-2"}')]


def call_head(call_id: str | None, name: str) -> dict[str, Any]:
    """The first fragment of a streamed call as OpenAI sends it: its id (unless None) and name, no arguments."""
    return {"tool_calls": [{"index": 0, "type": "function", **({"id": call_id} if call_id else {}),
                            "function": {"name": name, "arguments": ""}}]}


@pytest.mark.parametrize("shape", ["one id, whole calls", "no ids, heads first", "no ids, spaced arguments"])
async def test_streamed_calls_under_one_index_and_one_id_or_none_stay_apart(provider: FakeProvider, shape: str) -> None:
    """Calls a server streams all under index 0 and one id (call_0), or under index 0 and no id,
    stay separate calls, each with its own arguments, name and id, stored as returned. Catches: the
    chunk builder joining them into one call whose arguments ran together (not a JSON object, so it
    failed) and the other call lost without a word; a second call whose arguments start with a
    space (as some servers' templates write them) joined to the first."""
    spaced = " " if shape == "no ids, spaced arguments" else ""
    if shape == "one id, whole calls":
        fragments = [numbered_call(0, "call_0", "A-1"), numbered_call(0, "call_0", "B-2", "refund_order")]
        ids = ["call_0", "call_0_1"]
    else:
        fragments = [call_head(None, "lookup_order"), call_fragment(0, '{"order_id"'), call_fragment(0, ':"A-1"}'),
                     call_head(None, "refund_order"), call_fragment(0, spaced + '{"order_id":"B-2",'),
                     call_fragment(0, '"amount_cents":250}')]
        ids = ["call_chatcmpl-1_0", "call_chatcmpl-1_1"]
    provider.queue(CHAT_PATH, chat_chunks(fragments, "tool_calls"))
    response = await chat_client(provider).call_model(
        ModelRequest(None, (UserTextInput("Refund B-2 if A-1 shipped."),), (LOOKUP_TOOL,)), collecting_writer()[0])
    calls = [item.tool_call for item in response.output if item.tool_call is not None]
    assert [(c.tool_call_id, c.tool_name, json.loads(c.arguments)) for c in calls] == [
        (ids[0], "lookup_order", {"order_id": "A-1"}),
        (ids[1], "refund_order", {"order_id": "B-2", "amount_cents": 250})]
    assert [json.loads(item.item)["tool_calls"][0]["id"] for item in response.output] == ids


async def test_calls_under_one_index_with_their_own_ids_stay_apart_after_arguments_no_object(
    provider: FakeProvider,
) -> None:
    """A call under the index of an earlier call and an id of its own is a call of its own even when
    the earlier call's arguments are no whole JSON object (a server that streams none for a tool
    without parameters). Catches: the two joined by index, the first call's id kept and the second
    call lost."""
    fragments = [{"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                                  "function": {"name": "lookup_order", "arguments": ""}}]},
                 numbered_call(0, "call_b", "B-2", "refund_order")]
    provider.queue(CHAT_PATH, chat_chunks(fragments, "tool_calls"))
    response = await chat_client(provider).call_model(
        ModelRequest(None, (UserTextInput("Refund B-2."),), (LOOKUP_TOOL,)), collecting_writer()[0])
    assert [item.tool_call for item in response.output] == [
        ModelToolCall("call_a", "lookup_order", "{}"),
        ModelToolCall("call_b", "refund_order", '{"order_id": "B-2", "amount_cents": 250}')]


@pytest.mark.parametrize("head", [False, True], ids=["arguments first", "head first"])
async def test_arguments_a_server_repeats_after_a_whole_call_stay_with_it(provider: FakeProvider, head: bool) -> None:
    """Arguments that run on after a call's whole JSON object, without an id or a name to start a
    call (a server repeating the arguments), stay that call's: it fails as not a JSON object, as
    before; also when the call began, as OpenAI streams one, with its id and name and no arguments.
    Catches: splitting them off as a second call, which would run the tool twice, and with a head
    first, the call's id and name moved to the split-off arguments."""
    start = [call_head("call_a", "lookup_order"), call_fragment(0, '{"order_')] if head else [
        call_fragment(0, '{"order_', "call_a")]
    repeated = [*start, call_fragment(0, 'id":"A-1"}'), call_fragment(0, '{"order_id":"A-1"}')]
    provider.queue(CHAT_PATH, chat_chunks(repeated, "tool_calls"))
    response = await chat_client(provider).call_model(
        ModelRequest(None, (UserTextInput("Where is A-1?"),), (LOOKUP_TOOL,)), collecting_writer()[0])
    assert [item.tool_call for item in response.output] == [
        ModelToolCall("call_a", "lookup_order", '{"order_id":"A-1"}{"order_id":"A-1"}')]


async def test_calls_without_ids_of_a_response_without_an_id_get_ids_unique_in_the_turn(
    provider: FakeProvider, tmp_path: Path, db_url: str  # noqa: F811
) -> None:
    """A server that sends "" as the response ID and no tool call IDs (Hugging Face TGI does the
    first) gets call IDs that differ between the model calls of one turn. Catches: both calls named
    call_response_0, so the turn's second tool-calling response failed it ("repeats within this
    turn")."""
    unnamed = [{"tool_calls": [{"index": 0, "type": "function", "function": {
        "name": "lookup_order", "arguments": '{"order_id":"A-1"}'}}]}]

    def without_ids(reply: Reply) -> Reply:
        return Reply(reply.status, reply.body.replace(b'"id": "chatcmpl-1"', b'"id": ""'), reply.content_type)

    model = chat_client(provider)
    agent = AgentDefinition(name="litellm-agent", model=model, instructions="", tools=[lookup_order])
    flow = builtin_agent_session_flow(agent, "LiteLLMAgent")
    provider.queue(CHAT_PATH, without_ids(chat_chunks(unnamed, "tool_calls")))
    provider.queue(CHAT_PATH, without_ids(chat_chunks(unnamed, "tool_calls")))
    provider.queue(CHAT_PATH, without_ids(chat_stream(text="A-1 has shipped.")))
    engine = InProcessEngine(tmp_path, [flow], db_url)
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s", "Where is A-1?")
        done = await turns_ended(sessions, "s", 1)
    assert done.state is not None and done.state.last_turn_error is None
    assert done.messages[-1].text == "A-1 has shipped."
    call_ids = [m.tool_call_id for m in done.messages if m.role is MessageRole.ASSISTANT and m.tool_call_id]
    assert len(call_ids) == 2 and len(set(call_ids)) == 2, call_ids


def numbered_call(index: int, call_id: str, order_id: str, name: str = "lookup_order") -> dict[str, Any]:
    """A whole streamed tool call in one fragment, under the id a server gave it."""
    arguments = json.dumps({"order_id": order_id, **({"amount_cents": 250} if name == "refund_order" else {})})
    return {"tool_calls": [{"index": index, "id": call_id, "type": "function",
                            "function": {"name": name, "arguments": arguments}}]}


async def test_call_ids_a_server_repeats_are_made_unique_and_replayed_as_stored(
    provider: FakeProvider, tmp_path: Path, db_url: str  # noqa: F811
) -> None:
    """A server that numbers each response's calls afresh (vLLM, llama.cpp and Ollama with some
    templates) or gives two calls of one response one ID runs the turn: each call gets an ID of its
    own, its result goes to it, and the next request sends each call and its result under that ID.
    Catches: the turn failing at its second response with tools ("repeats within this turn ...
    prefixing len(turn.tool_calls)", advice for a runner the built-in loop's user cannot follow),
    and at once for two calls with one ID."""
    model = chat_client(provider)
    agent = AgentDefinition(name="litellm-agent", model=model, instructions="", tools=[lookup_order])
    flow = builtin_agent_session_flow(agent, "LiteLLMAgent")
    provider.queue(CHAT_PATH, chat_chunks([numbered_call(0, "call_0", "A-1")], "tool_calls"))
    provider.queue(CHAT_PATH, chat_chunks([numbered_call(0, "call_0", "B-2"), numbered_call(1, "call_0", "C-3")],
                                          "tool_calls"))
    provider.queue(CHAT_PATH, chat_stream(text="All shipped."))
    engine = InProcessEngine(tmp_path, [flow], db_url)
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s", "Where are A-1, B-2 and C-3?")
        done = await turns_ended(sessions, "s", 1)
    assert done.state is not None and done.state.last_turn_error is None, done.state.last_turn_error
    assert done.messages[-1].text == "All shipped."
    calls = [(m.tool_call_id, json.loads(m.tool_arguments or "{}")["order_id"])
             for m in done.messages if m.role is MessageRole.ASSISTANT and m.tool_call_id]
    assert calls == [("call_0", "A-1"), ("call_0_1", "B-2"), ("call_0_2", "C-3")]
    results = {m.tool_call_id: json.loads(m.tool_output or "{}")["order_id"]
               for m in done.messages if m.role is MessageRole.TOOL}
    assert results == {"call_0": "A-1", "call_0_1": "B-2", "call_0_2": "C-3"}
    sent = provider.received[-1].json["messages"]
    sent_calls = [(c["id"], json.loads(c["function"]["arguments"])["order_id"])
                  for m in sent if m["role"] == "assistant" for c in m.get("tool_calls") or []]
    assert sent_calls == calls
    sent_results = {m["tool_call_id"]: json.loads(m["content"])["order_id"] for m in sent if m["role"] == "tool"}
    assert sent_results == results


COUNTED_STEPS = 12


@function_tool(effect=ToolEffect.READ, name="count")
def count_step(step: int, pad: str = "") -> int:
    """Count one step."""
    return step


async def test_call_ids_a_server_repeats_stay_unique_when_the_turn_compacts(
    provider: FakeProvider, tmp_path: Path, db_url: str  # noqa: F811
) -> None:
    """A turn of twelve calls, each under call_0, that compacts as it runs: the calls a summary took
    out of the model's input are no longer there for the client to tell a repeat by, and the turn
    still gives each call an ID of its own, and every request sends each call and its result under
    one ID. Catches: the turn failing at the first call after a compaction ("tool call ID 'call_0'
    repeats within this turn")."""

    def take(received: Received) -> Reply:
        provider.received.append(received)
        body = received.json
        if not body.get("tools"):
            return chat_stream(text="Counted some steps.")  # the summary call
        results = [m for m in body["messages"] if m["role"] == "tool"]
        step = int(results[-1]["content"]) + 1 if results else 1
        if step > COUNTED_STEPS:
            return chat_stream(text=f"counted {COUNTED_STEPS}")
        return chat_chunks([{"tool_calls": [{"index": 0, "id": "call_0", "type": "function", "function": {
            "name": "count", "arguments": json.dumps({"step": step, "pad": "x" * 400})}}]}], "tool_calls")

    provider._take = take  # type: ignore[method-assign]
    agent = AgentDefinition(name="litellm-agent", model=chat_client(provider), instructions="", tools=[count_step],
                            compaction=CompactionPolicy(context_window_tokens=1000))
    engine = InProcessEngine(tmp_path, [builtin_agent_session_flow(agent, "LiteLLMAgent")], db_url)
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s", "Count to twelve.")
        done = await turns_ended(sessions, "s", 1)
    assert done.state is not None and done.state.last_turn_error is None, done.state.last_turn_error
    assert done.context_summary is not None  # compacted within the turn
    assert done.messages[-1].text == f"counted {COUNTED_STEPS}"
    for request in provider.received:
        messages = request.json["messages"]
        calls = [c["id"] for m in messages if m["role"] == "assistant" for c in m.get("tool_calls") or []]
        results = [m["tool_call_id"] for m in messages if m["role"] == "tool"]
        assert calls == results and len(set(calls)) == len(calls), (calls, results)


async def test_a_call_id_reused_in_a_later_turn_is_not_approved_by_the_earlier_turns_approval(
    provider: FakeProvider, tmp_path: Path, db_url: str  # noqa: F811
) -> None:
    """A write that needs approval, under call_0 in turn 1 (cancelled while it waited) and again
    under call_0 in turn 2 (the server numbers every response's calls from 0): turn 2's approval has
    an interrupt ID of its own, so a late approval of turn 1's call (the person clicked what turn 1
    showed) approves nothing, and the write runs once, when its own interrupt is approved. Catches:
    resolve_interrupt("call_0") approving turn 2's refund, which the person never saw."""
    model = chat_client(provider)
    agent = AgentDefinition(name="litellm-agent", model=model, instructions="", tools=[refund_order])
    flow = builtin_agent_session_flow(agent, "LiteLLMAgent")
    provider.queue(CHAT_PATH, chat_chunks([numbered_call(0, "call_0", "A-1", "refund_order")], "tool_calls"))
    provider.queue(CHAT_PATH, chat_chunks([numbered_call(0, "call_0", "B-2", "refund_order")], "tool_calls"))
    provider.queue(CHAT_PATH, chat_stream(text="Refunded B-2."))
    engine = InProcessEngine(tmp_path, [flow], db_url)

    def pending(snapshot: AgentSnapshot) -> AgentSnapshot | None:
        return snapshot if snapshot.pending_interrupts else None

    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s", "Refund A-1.")
        first = await wait_for_agent_snapshot(sessions, "s", pending, description="turn 1's approval")
        assert [i.interrupt_id for i in first.pending_interrupts] == ["call_0"]
        assert await sessions.cancel_turn("s")
        await turns_ended(sessions, "s", 1)
        assert await sessions.send_user_message("s", "Refund B-2 instead.")
        second = await wait_for_agent_snapshot(sessions, "s", pending, description="turn 2's approval")
        [interrupt] = second.pending_interrupts
        assert interrupt.interrupt_id != "call_0" and '"B-2"' in interrupt.arguments
        assert not await sessions.resolve_interrupt("s", "call_0", approved=True)  # turn 1's, late
        assert (await sessions.get_agent_snapshot("s")).pending_interrupts == second.pending_interrupts
        assert await sessions.resolve_interrupt("s", interrupt.interrupt_id, approved=True)
        done = await turns_ended(sessions, "s", 2)
    assert done.state is not None and done.state.last_turn_error is None, done.state.last_turn_error
    outputs = [m.tool_output for m in done.messages if m.role is MessageRole.TOOL and m.turn_id == "turn-2"]
    assert outputs == ["refunded 250 on B-2"]
    assert done.messages[-1].text == "Refunded B-2."


@pytest.mark.parametrize(("item", "call_id"), [
    ({k: v for k, v in CALL_ITEM.items() if k not in ("call_id", "id")}, "call_resp_1_1"),
    ({**CALL_ITEM, "call_id": "", "id": ""}, "call_resp_1_1"),
    ({k: v for k, v in CALL_ITEM.items() if k != "call_id"}, "fc_1"),
], ids=["none", "empty", "item id only"])
async def test_a_responses_call_without_a_call_id_gets_one(
    provider: FakeProvider, item: dict[str, Any], call_id: str
) -> None:
    """A Responses API server's function call with no call_id, or an empty one, gets its item's id,
    or without one `call_<the provider's response ID>_<index>`, stored in its item too, as a Chat
    Completions call without an id does. Catches: the turn failing with "tool call ID '' is empty",
    which its user could not fix."""
    provider.queue(RESPONSES_PATH, responses_stream([MESSAGE_ITEM, item]))
    response = await openai_client(provider).call_model(
        ModelRequest(None, (UserTextInput("Where is A-1?"),), (LOOKUP_TOOL,)), collecting_writer()[0])
    [call] = [i for i in response.output if i.tool_call is not None]
    assert call.tool_call == ModelToolCall(call_id, "lookup_order", '{"order_id":"A-1"}')
    assert json.loads(call.item)["call_id"] == call_id


async def test_a_responses_call_id_the_input_holds_gets_one_of_its_own(provider: FakeProvider) -> None:
    """On the Responses API too, a call whose call_id the request's input already holds is stored
    and returned under a new one, so its replayed call and output agree; and a stored call replays
    under its ModelToolCall's ID. Catches: the repeated call_id kept, and a call replayed under the
    provider's ID while its output went under the session's."""
    earlier = ModelOutputItem("litellm.responses:openai", OutputItemKind.TOOL_CALL, json.dumps(CALL_ITEM),
                              tool_call=ModelToolCall("call_1", "lookup_order", '{"order_id":"A-1"}'))
    history = (UserTextInput("Where is A-1?"), earlier, ToolResultInput("call_1", "lookup_order", "shipped"))
    provider.queue(RESPONSES_PATH, responses_stream([CALL_ITEM]))
    response = await openai_client(provider).call_model(ModelRequest(None, history, (LOOKUP_TOOL,)),
                                                        collecting_writer()[0])
    [item] = response.output
    assert item.tool_call == ModelToolCall("call_1_1", "lookup_order", '{"order_id":"A-1"}')
    assert json.loads(item.item) == {**CALL_ITEM, "call_id": "call_1_1"}

    # A call the loop gave an ID of its own (its item keeps the provider's) replays under that ID.
    renamed = ModelOutputItem(earlier.api, earlier.kind, earlier.item,
                              tool_call=ModelToolCall("call_1_2", "lookup_order", '{"order_id":"A-1"}'))
    provider.queue(RESPONSES_PATH, responses_stream([MESSAGE_ITEM]))
    await openai_client(provider).call_model(ModelRequest(None, (
        UserTextInput("Where is A-1?"), renamed, ToolResultInput("call_1_2", "lookup_order", "shipped"))),
        collecting_writer()[0])
    sent = provider.received[-1].json["input"]
    assert [(i["type"], i["call_id"]) for i in sent if "call_id" in i] == [
        ("function_call", "call_1_2"), ("function_call_output", "call_1_2")]


@pytest.mark.parametrize("holder", ["a tool result", "a call"])
async def test_a_call_id_the_input_holds_in_a_result_or_a_call_alone_gets_one_of_its_own(
    provider: FakeProvider, holder: str
) -> None:
    """A call ID the request's input holds only in a tool result (its call compacted away), or only
    in a call (another client's), is not a new call's either. Catches: either kind of item left out
    of the IDs taken, the new call stored under the held ID, so its result answered the earlier call."""
    held: ModelInputItem = ToolResultInput("call_7", "lookup_order", "shipped") if holder == "a tool result" else (
        ModelOutputItem("scripted", OutputItemKind.TOOL_CALL, "{}",
                        tool_call=ModelToolCall("call_7", "lookup_order", '{"order_id":"A-1"}')))
    provider.queue(CHAT_PATH, chat_stream(call=CHAT_CALL))
    response = await chat_client(provider).call_model(
        ModelRequest(None, (UserTextInput("Where is A-1?"), held), (LOOKUP_TOOL,)), collecting_writer()[0])
    assert [item.tool_call for item in response.output] == [
        ModelToolCall("call_7_1", "lookup_order", '{"order_id":"A-1"}')]


async def test_text_with_lone_surrogates_is_stored_as_utf8(
    provider: FakeProvider, tmp_path: Path, db_url: str  # noqa: F811
) -> None:
    """A server that sends an emoji's two UTF-16 halves as JSON escapes in two chunks, and a lone
    one, gets a stored answer with the emoji joined and U+FFFD for the lone one, in a turn that
    completes; the live deltas show U+FFFD. Catches: the text stored with the surrogates, which no
    stored value can hold, so the turn failed after the paid model call and the answer was lost."""
    model = chat_client(provider)
    agent = AgentDefinition(name="litellm-agent", model=model, instructions="")
    flow = builtin_agent_session_flow(agent, "LiteLLMAgent")
    provider.queue(CHAT_PATH, chat_chunks(
        [{"role": "assistant", "content": "Done \ud83d"}, {"content": "\ude00, bad byte \udcaf."}], "stop"))
    engine = InProcessEngine(tmp_path, [flow], db_url)
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s", "Go")
        done = await turns_ended(sessions, "s", 1)
        events = await sessions.read_agent_events("s")
    assert done.state is not None and done.state.last_turn_error is None
    assert done.messages[-1].text == "Done \U0001f600, bad byte \ufffd."
    assert [json.loads(e.value.payload)["text"] for e in events.events if e.value.type == "text_delta"] == [
        "Done \ufffd", "\ufffd, bad byte \ufffd."]


async def test_a_tool_call_with_lone_surrogates_is_stored_as_utf8(provider: FakeProvider) -> None:
    """A server that sends an emoji's two UTF-16 halves as JSON escapes in two fragments of a tool
    call's arguments, and a lone one, gets the call with the emoji joined and U+FFFD for the lone
    one. Catches: LiteLLM's chunk builder failing on the surrogates ("APIError: Error building
    chunks for logging/streaming usage calculation"), a server error RunModel tried again, each
    attempt paid and failed alike."""
    provider.queue(CHAT_PATH, chat_chunks([call_fragment(0, '{"order_id":"A-1 \ud83d', "call_7"),
                                           call_fragment(0, '\ude00 \udcaf"}')], "tool_calls"))
    response = await chat_client(provider).call_model(
        ModelRequest(None, (UserTextInput("Where is A-1?"),), (LOOKUP_TOOL,)), collecting_writer()[0])
    assert [item.tool_call for item in response.output] == [
        ModelToolCall("call_7", "lookup_order", '{"order_id":"A-1 \U0001f600 \ufffd"}')]
    assert json.loads(response.output[0].item)["tool_calls"][0]["function"]["arguments"] == (
        '{"order_id":"A-1 \U0001f600 \ufffd"}')


async def test_a_tool_call_name_and_id_with_lone_surrogates_are_stored_as_utf8(provider: FakeProvider) -> None:
    """The same for a streamed call's name and ID: a lone surrogate in either becomes U+FFFD, and the
    call reaches the session (which answers an unknown tool name to the model). Catches: the chunk
    builder failing on them as on arguments, every attempt paid and failed alike."""
    first = call_fragment(0, '{"order_id":', "call_7 \ud83d")
    first["tool_calls"][0]["function"]["name"] = "lookup_\udcaf"
    provider.queue(CHAT_PATH, chat_chunks([first, call_fragment(0, '"A-1"}')], "tool_calls"))
    response = await chat_client(provider).call_model(
        ModelRequest(None, (UserTextInput("Where is A-1?"),), (LOOKUP_TOOL,)), collecting_writer()[0])
    assert [item.tool_call for item in response.output] == [
        ModelToolCall("call_7 \ufffd", "lookup_\ufffd", '{"order_id":"A-1"}')]
    stored = json.loads(response.output[0].item)["tool_calls"][0]
    assert (stored["id"], stored["function"]["name"]) == ("call_7 \ufffd", "lookup_\ufffd")


GEMINI_PATH = "/models/gemini-3-pro-preview:streamGenerateContent?alt=sse"
# Gemini's thought signatures are opaque base64, often hundreds of characters, '/' and '+' included.
THOUGHT_SIGNATURE = base64.b64encode(bytes(range(256))).decode()


def gemini_stream(parts: list[dict[str, Any]]) -> Reply:
    return sse([{"candidates": [{"content": {"role": "model", "parts": parts}, "finishReason": "STOP", "index": 0}],
                 "usageMetadata": {"promptTokenCount": 10, "candidatesTokenCount": 5, "totalTokenCount": 15},
                 "modelVersion": "gemini-3-pro-preview", "responseId": "r1"}], named=False)


async def test_gemini_thought_signature_stays_out_of_the_tool_call_id(provider: FakeProvider) -> None:
    """A Gemini tool call with a thought signature gets a plain tool call ID; the signature comes back
    on replay. Catches: LiteLLM's default of putting the signature in the ID (`call_..__thought__<base64>`),
    which the session refuses (over 255 characters, '/'), failing every such Gemini turn."""
    client = LiteLLMModelClient("gemini/gemini-3-pro-preview", api_base=provider.url, api_key_provider=lambda: "k")
    provider.queue(GEMINI_PATH, gemini_stream([{"functionCall": {"name": "lookup_order", "args": {"order_id": "A-1"}},
                                                "thoughtSignature": THOUGHT_SIGNATURE}]))
    response = await client.call_model(
        ModelRequest(None, (UserTextInput("Where is A-1?"),), (LOOKUP_TOOL,)), collecting_writer()[0])
    (item,) = response.output
    assert item.tool_call is not None
    call_id = item.tool_call.tool_call_id
    assert "/" not in call_id and len(call_id) < 100 and THOUGHT_SIGNATURE not in call_id, call_id
    assert "thought_signature_in_tool_call_id" not in provider.received[-1].json

    provider.queue(GEMINI_PATH, gemini_stream([{"text": "It shipped."}]))
    history = (UserTextInput("Where is A-1?"), item, ToolResultInput(call_id, "lookup_order", '{"status":"shipped"}'))
    await client.call_model(ModelRequest(None, history, (LOOKUP_TOOL,)), collecting_writer()[0])
    (model_turn,) = [c for c in provider.received[-1].json["contents"] if c["role"] == "model"]
    assert model_turn["parts"][0]["thoughtSignature"] == THOUGHT_SIGNATURE


@pytest.mark.parametrize("cut", ['{"order_id": "A-', '["A-1"]'])
async def test_arguments_that_are_not_a_json_object_replay_as_an_empty_object(provider: FakeProvider, cut: str
                                                                             ) -> None:
    """A past call whose arguments are not a JSON object (a response cut off mid-call, or JSON of
    another kind; the session failed the call) is replayed with "{}", to its own API and to another,
    and its stored item keeps what the model sent. Catches: the text replayed as it was, which
    LiteLLM's Anthropic request refuses before sending, failing every later model call of the session."""
    provider.queue(CHAT_PATH, chat_stream(call={**CHAT_CALL, "function": {"name": "lookup_order", "arguments": cut}}))
    response = await chat_client(provider).call_model(
        ModelRequest(None, (UserTextInput("Where is A-1?"),), (LOOKUP_TOOL,)), collecting_writer()[0])
    (item,) = response.output
    assert item.tool_call == ModelToolCall("call_7", "lookup_order", cut)
    history = (UserTextInput("Where is A-1?"), item,
               ToolResultInput("call_7", "lookup_order", "The tool call failed: arguments must be a JSON object"))

    provider.queue(CHAT_PATH, chat_stream(text="Sorry."))
    await chat_client(provider).call_model(ModelRequest(None, history, (LOOKUP_TOOL,)), collecting_writer()[0])
    assert provider.received[-1].json["messages"][1]["tool_calls"][0]["function"]["arguments"] == "{}"
    assert json.loads(item.item)["tool_calls"][0]["function"]["arguments"] == cut

    provider.queue(RESPONSES_PATH, responses_stream([MESSAGE_ITEM]))
    await openai_client(provider).call_model(ModelRequest(None, history), collecting_writer()[0])
    assert provider.received[-1].json["input"][1]["arguments"] == "{}"

    # A Responses API call with such arguments, replayed to Chat Completions.
    foreign = ModelOutputItem("litellm.responses:openai", OutputItemKind.TOOL_CALL,
                              json.dumps({**CALL_ITEM, "arguments": cut}), tool_call=item.tool_call)
    provider.queue(CHAT_PATH, chat_stream(text="Sorry."))
    await chat_client(provider).call_model(
        ModelRequest(None, (history[0], foreign, history[2]), (LOOKUP_TOOL,)), collecting_writer()[0])
    assert provider.received[-1].json["messages"][1]["tool_calls"][0]["function"]["arguments"] == "{}"

    anthropic = LiteLLMModelClient("anthropic/claude-sonnet-4-5", api_base=provider.url,
                                   api_key_provider=lambda: "k", request_options={"max_tokens": 1024})
    provider.queue(MESSAGES_PATH, anthropic_stream(thinking="Again.", text="Sorry."))
    answer = await anthropic.call_model(ModelRequest(None, history, (LOOKUP_TOOL,)), collecting_writer()[0])
    assert answer.output[-1].text == "Sorry."
    (tool_use,) = [c for c in provider.received[-1].json["messages"][1]["content"] if c["type"] == "tool_use"]
    assert tool_use["input"] == {}


async def test_responses_arguments_sent_as_an_object_are_stored_as_json(provider: FakeProvider) -> None:
    """A Responses API function call whose arguments are a JSON object, not its text, is stored with
    the object's JSON. Catches: Python's repr ({'order_id': 'A-1'}), which the tool refused as not JSON."""
    provider.queue(RESPONSES_PATH, responses_stream([{**CALL_ITEM, "arguments": {"order_id": "A-1"}}]))
    response = await openai_client(provider).call_model(
        ModelRequest(None, (UserTextInput("Where is A-1?"),), (LOOKUP_TOOL,)), collecting_writer()[0])
    assert [item.tool_call for item in response.output] == [
        ModelToolCall("call_1", "lookup_order", '{"order_id":"A-1"}')]


@pytest.mark.parametrize("api", ["responses", "chat"])
async def test_a_call_whose_arguments_come_empty_is_stored_with_an_empty_object(provider: FakeProvider, api: str
                                                                              ) -> None:
    """A call of a tool without parameters whose arguments come as "" (some servers send none) is
    stored with "{}". Catches: "" stored, which the session fails as not a JSON object, so such a
    tool never ran."""
    if api == "responses":
        client, path = openai_client(provider), RESPONSES_PATH
        reply = responses_stream([{**CALL_ITEM, "arguments": ""}])
    else:
        client, path = chat_client(provider), CHAT_PATH
        reply = chat_stream(call={**CHAT_CALL, "function": {"name": "lookup_order", "arguments": ""}})
    provider.queue(path, reply)
    response = await client.call_model(ModelRequest(None, (UserTextInput("Any orders?"),), (LOOKUP_TOOL,)),
                                       collecting_writer()[0])
    assert [item.tool_call.arguments for item in response.output if item.tool_call] == ["{}"]


async def test_a_refusal_streams_and_is_stored_as_the_answer_text(provider: FakeProvider) -> None:
    """A Responses API refusal (content part "refusal", streamed as response.refusal.delta) is
    streamed as text deltas and stored as the answer's text. Catches: the refusal left out, so the
    user saw nothing stream and the call failed as "no output", paid again on each retry."""
    refusal = {**MESSAGE_ITEM, "content": [{"type": "refusal", "refusal": "I can't help with that."}]}
    provider.queue(RESPONSES_PATH, responses_stream([refusal]))
    writer, events = collecting_writer()
    response = await openai_client(provider).call_model(ModelRequest(None, (UserTextInput("hi"),)), writer)
    assert [(item.kind, item.text) for item in response.output] == [(OutputItemKind.TEXT, "I can't help with that.")]
    assert deltas(events) == [("text_delta", "I ca"), ("text_delta", "n't help with that.")]


async def test_raw_reasoning_text_without_a_summary_streams_and_is_stored(provider: FakeProvider) -> None:
    """A reasoning item with reasoning_text content and no summary (open-weight models behind a
    Responses API server), streamed as response.reasoning_text.delta, streams as reasoning deltas
    and is stored with that text. Catches: only summaries read, the model's reasoning never shown."""
    raw = {"id": "rs_2", "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Think."}]}
    provider.queue(RESPONSES_PATH, responses_stream([raw, MESSAGE_ITEM]))
    writer, events = collecting_writer()
    response = await openai_client(provider).call_model(ModelRequest(None, (UserTextInput("hi"),)), writer)
    assert [(item.kind, item.text) for item in response.output] == [
        (OutputItemKind.REASONING, "Think."), (OutputItemKind.TEXT, "Let me look.")]
    assert deltas(events)[0] == ("reasoning_delta", "Think.")


async def test_items_of_a_completed_response_without_its_output_come_from_their_done_events(
    provider: FakeProvider,
) -> None:
    """A server whose response.completed lists no output (the items came in output_item.done events)
    gives those items, in order. Catches: the answer and its call lost, the call failing as "no output"."""
    provider.queue(RESPONSES_PATH, responses_stream([MESSAGE_ITEM, CALL_ITEM], listed=False))
    response = await openai_client(provider).call_model(
        ModelRequest(None, (UserTextInput("Where is A-1?"),), (LOOKUP_TOOL,)), collecting_writer()[0])
    assert [json.loads(item.item) for item in response.output] == [MESSAGE_ITEM, CALL_ITEM]


async def test_anthropic_thinking_blocks_replay_with_their_signature(provider: FakeProvider) -> None:
    """Anthropic's signed thinking block is kept in the item and comes back first in the assistant message."""
    thinking = {"type": "enabled", "budget_tokens": 1024}
    client = LiteLLMModelClient("anthropic/claude-sonnet-4-5", api_base=provider.url,
                                api_key_provider=lambda: "sk-ant-provided", request_options={"max_tokens": 4096})
    assert client.api_label == "litellm.chat:anthropic"
    provider.queue(MESSAGES_PATH, anthropic_stream(thinking="Pondering deeply.", text="Answer"))
    writer, events = collecting_writer()
    response = await client.call_model(
        ModelRequest(None, (UserTextInput("hi"),), model_settings={"thinking": thinking}), writer)

    block = {"type": "thinking", "thinking": "Pondering deeply.", "signature": SIGNATURE}
    assert [item.kind for item in response.output] == [OutputItemKind.REASONING, OutputItemKind.TEXT]
    assert json.loads(response.output[0].item)["thinking_blocks"] == [block]
    assert response.output[0].text == "Pondering deeply."  # the reasoning text, from the block
    assert deltas(events) == [("reasoning_delta", "Pondering deeply."), ("text_delta", "Answer")]
    assert response.usage.model_calls == 1 and response.usage.cached_input_tokens == 5
    first = provider.received[-1]
    assert first.headers["x-api-key"] == "sk-ant-provided"
    assert first.json["thinking"] == thinking

    provider.queue(MESSAGES_PATH, anthropic_stream(thinking="More.", text="Done"))
    history = (UserTextInput("hi"), *response.output, UserTextInput("and now?"))
    await client.call_model(ModelRequest(None, history, model_settings={"thinking": thinking}), collecting_writer()[0])
    assistant = provider.received[-1].json["messages"][1]
    assert assistant == {"role": "assistant", "content": [block, {"type": "text", "text": "Answer"}]}

    # Forced tool choice is refused with extended thinking on, and only for Anthropic.
    assert client.supports_forced_tool_choice({"thinking": thinking}) is False
    assert client.supports_forced_tool_choice({"reasoning_effort": "high"}) is False
    assert client.supports_forced_tool_choice({}) is True
    assert client.supports_forced_tool_choice({"thinking": {"type": "disabled"}}) is True
    assert chat_client(provider).supports_forced_tool_choice({"thinking": thinking}) is True


def test_litellm_forced_tool_choice_follows_the_seed_rule() -> None:
    """Claude Opus/Sonnet 5.5 refuse; Anthropic (also on Bedrock, Vertex) with thinking refuses; others accept."""
    for model in ("anthropic/claude-opus-5-5", "anthropic/claude-sonnet-5-5-20261101",
                  "bedrock/anthropic.claude-opus-5-5-v1:0", "vertex_ai/claude-sonnet-5-5"):
        assert LiteLLMModelClient(model).supports_forced_tool_choice({}) is False, model
    for model in ("anthropic/claude-sonnet-4-5", "bedrock/anthropic.claude-sonnet-4-5-v1:0",
                  "vertex_ai/claude-opus-4-1"):
        client = LiteLLMModelClient(model)
        assert client.supports_forced_tool_choice({}) is True, model
        assert client.supports_forced_tool_choice({"thinking": {"type": "enabled", "budget_tokens": 1024}}) is False
        assert client.supports_forced_tool_choice({"reasoning_effort": "low"}) is False, model
        assert client.supports_forced_tool_choice({"reasoning_effort": "none"}) is True, model
        assert client.supports_forced_tool_choice({"thinking": {"type": "disabled"}}) is True, model
        assert client.supports_forced_tool_choice({"thinking": False}) is True, model
    thinking = LiteLLMModelClient("anthropic/claude-sonnet-4-5", request_options={"reasoning_effort": "high"})
    assert thinking.supports_forced_tool_choice({}) is False  # request_options count too
    # A setting replaces the option of its name, as it does in the request.
    assert thinking.supports_forced_tool_choice({"reasoning_effort": "none"}) is True
    for model in ("gemini/gemini-2.5-pro", "openai/gpt-5"):
        client = LiteLLMModelClient(model)
        assert client.supports_forced_tool_choice({"reasoning_effort": "high"}) is True, model
        assert client.supports_forced_tool_choice({"thinking": {"type": "enabled"}}) is True, model


# Failures, credentials, packaging -----------------------------------------------------------------


@pytest.mark.parametrize("api", ["responses", "chat"])
async def test_a_server_error_is_one_request_and_raises(
    provider: FakeProvider, api: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No retries of the client's own: a 500 is one request and an error, though a success is queued next."""
    # A Worker's global LiteLLM retry setting must not apply either: RunModel owns the retries.
    monkeypatch.setattr(litellm, "num_retries", 2)
    if api == "responses":
        client, path, success = openai_client(provider), RESPONSES_PATH, responses_stream([MESSAGE_ITEM])
    else:
        client, path, success = chat_client(provider), CHAT_PATH, chat_stream(text="fine")
    provider.queue(path, error_reply(500))
    provider.queue(path, success)  # a retry would get this and succeed
    with pytest.raises(Exception, match="overloaded") as raised:
        await client.call_model(ModelRequest(None, (UserTextInput("hi"),)), collecting_writer()[0])
    assert [r.path for r in provider.received] == [path]
    assert "api='chat'" not in str(raised.value)  # the hint is for a server without the Responses API: a 404


def rate_limited(status: int, *headers: tuple[str, str]) -> Reply:
    """A 429 saying so, or another status's error_reply ("overloaded": LiteLLM takes any error that
    mentions a rate limit for a RateLimitError), with `headers`."""
    if status != 429:
        return dataclasses.replace(error_reply(status), headers=headers)
    body = {"error": {"message": "Rate limit reached for requests; try again later", "type": "rate_limit_error"}}
    return Reply(status, json.dumps(body).encode(), "application/json", headers)


def in_seconds(seconds: int) -> str:
    """An HTTP date `seconds` from now, as a Retry-After may give one."""
    return email.utils.formatdate(time.time() + seconds, usegmt=True)


@pytest.mark.parametrize(("status", "headers", "asked"), [
    (429, [("Retry-After", "3")], 3.0),
    (429, [("Retry-After", "3"), ("retry-after-ms", "2500")], 2.5),  # OpenAI's, in ms, taken first
    (503, [("Retry-After", "7")], 7.0),
    (429, [("Retry-After", "in 120")], "date"),
    (429, [("Retry-After", "in 120 without a zone")], "date"),  # read as GMT
    (429, [], None),
    (429, [("Retry-After", "soon")], None),
    (429, [("Retry-After", "nan")], None),
    (429, [("Retry-After", "3 seconds")], None),
    (429, [("Retry-After", "120 s ago")], None),  # a date passed: no wait (the engine refuses one below 0)
    (500, [("Retry-After", "3")], None),  # a server error's Retry-After is no rate limit's
])
@pytest.mark.parametrize("api", ["responses", "chat"])
async def test_a_rate_limit_with_retry_after_asks_the_engine_to_wait(
    provider: FakeProvider, api: str, status: int, headers: list[tuple[str, str]], asked: float | str | None
) -> None:
    """A 429 or 503 whose response has Retry-After (seconds or an HTTP date) or retry-after-ms raises
    the provider's error, its type kept, with retry_after_seconds set (dex_engine's RetryAfterError
    protocol), so RunModel's next attempt waits that long; no header, an unreadable one, or another
    status sets none. Catches: the header ignored, the engine retrying after its own 1 s and 2 s."""
    headers = [(name, in_seconds(120) if value == "in 120" else
                in_seconds(120).removesuffix(" GMT") if value == "in 120 without a zone" else
                in_seconds(-120) if value == "120 s ago" else value)
               for name, value in headers]
    client = openai_client(provider) if api == "responses" else chat_client(provider)
    path = RESPONSES_PATH if api == "responses" else CHAT_PATH
    provider.queue(path, rate_limited(status, *headers))
    expected = {429: litellm.RateLimitError, 503: litellm.ServiceUnavailableError, 500: litellm.InternalServerError}
    with pytest.raises(expected[status]) as raised:
        await client.call_model(ModelRequest(None, (UserTextInput("hi"),)), collecting_writer()[0])
    got = getattr(raised.value, "retry_after_seconds", None)
    if asked == "date":
        assert isinstance(got, float) and 60 < got <= 120, got  # whole seconds, less the time the call took
    else:
        assert got == asked
    assert len(provider.received) == 1  # one request: the wait is the engine's, not the client's


@pytest.mark.parametrize(("status", "error_type", "asked"), [
    (529, "overloaded_error", 7.0), (503, "overloaded_error", 7.0), (500, "api_error", None),
])
async def test_anthropic_overloaded_with_retry_after_asks_the_engine_to_wait(
    provider: FakeProvider, status: int, error_type: str, asked: float | None
) -> None:
    """Anthropic's overloaded answer (529, or a 503, with an overloaded_error body) and Retry-After: 7,
    which LiteLLM raises as an InternalServerError whose status_code is 500, is raised with
    retry_after_seconds=7 as a 429's is; a 500 api_error's Retry-After still sets none. Catches: the
    overload's Retry-After ignored, so RunModel's retries came after the policy's 1 s and 2 s, into
    the same overload, and the turn failed in 3 s."""
    client = LiteLLMModelClient("anthropic/claude-sonnet-4-5", api_base=provider.url,
                                api_key_provider=lambda: "sk-ant-provided", request_options={"max_tokens": 64})
    body = {"type": "error", "error": {"type": error_type, "message": "Overloaded" if asked else "Internal error"}}
    provider.queue(MESSAGES_PATH, Reply(status, json.dumps(body).encode(), "application/json", (("Retry-After", "7"),)))
    with pytest.raises(litellm.InternalServerError) as raised:
        await client.call_model(ModelRequest(None, (UserTextInput("hi"),)), collecting_writer()[0])
    assert getattr(raised.value, "retry_after_seconds", None) == asked
    assert len(provider.received) == 1


def engine_history_of(history: list[HistoryEntry], step_type: str, event_type: str) -> list[HistoryEntry]:
    return [h for h in history if h.step_type == step_type and h.event_type == event_type]


async def test_a_rate_limited_turn_waits_for_retry_after_in_the_engine_and_succeeds(
    provider: FakeProvider, tmp_path: Path, db_url: str  # noqa: F811
) -> None:
    """A provider answering RunModel's first call 429 with Retry-After: 3, then the answer: the turn
    succeeds; the second call arrives no sooner than 3 s after the engine recorded the first
    attempt's failure (the history says the retry was asked for 3 s); and on a Worker with one slot,
    another session's whole turn runs meanwhile. Catches: the retries after the policy's 1 s and
    2 s that failed the turn in 3 s, or a wait inside the attempt that holds the Worker."""
    agent = AgentDefinition(name="litellm-agent", model=chat_client(provider), instructions="")
    flow = builtin_agent_session_flow(agent, "LiteLLMAgent")
    provider.queue(CHAT_PATH, rate_limited(429, ("Retry-After", "3")))
    provider.queue(CHAT_PATH, chat_stream(text="fine"))
    provider.queue(CHAT_PATH, chat_stream(text="fine"))
    engine = InProcessEngine(tmp_path, [flow], db_url, max_concurrent_tasks=1)
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("a", "hello from a")

        async def a_failed() -> list[HistoryEntry]:
            return engine_history_of(await engine.client.get_flow_history("a"), "RunModel", "attempt_failed")

        (failed,) = await wait_until("RunModel of a failed once", a_failed)
        await sessions.start_session("b", "hello from b")
        await turns_ended(sessions, "b", 1)
        done = await turns_ended(sessions, "a", 1)
        b_done = engine_history_of(await engine.client.get_flow_history("b"), "RunModel", "execute_completed")
        a_history = await engine.client.get_flow_history("a")
    assert done.state is not None and done.state.last_turn_error is None and done.messages[-1].text == "fine"
    assert [r.json["messages"][-1]["content"] for r in provider.received] == ["hello from a", "hello from b",
                                                                              "hello from a"]
    retried = provider.received[2].at_ms
    assert retried >= failed.at_ms + 3000, "the retry came before the provider's Retry-After"
    assert b_done[0].at_ms < retried, "the other session's turn waited for the slot the waiting retry held"
    assert "RateLimitError" in failed.detail and "no sooner than 3 s from now" in failed.detail
    assert [h.attempt for h in engine_history_of(a_history, "RunModel", "execute_completed")] == [2]


async def test_a_retry_after_past_the_retry_budget_fails_the_turn_at_once_naming_it(
    provider: FakeProvider, tmp_path: Path, db_url: str  # noqa: F811
) -> None:
    """A 429 asking for an hour, under RunModel's 3 attempts within 30 min, fails the turn at once:
    last_turn_error keeps the provider's error and names the asked 3600 s and the 1800 s budget; no
    second call is made. Catches: a retry scheduled past the budget (the turn stuck for an hour), or
    retries after 1 s and 2 s the provider refuses again, ending with its error alone."""
    agent = AgentDefinition(name="litellm-agent", model=chat_client(provider), instructions="")
    flow = builtin_agent_session_flow(agent, "LiteLLMAgent")
    provider.queue(CHAT_PATH, rate_limited(429, ("Retry-After", "3600")))
    provider.queue(CHAT_PATH, chat_stream(text="too soon"))  # a retry would get this
    engine = InProcessEngine(tmp_path, [flow], db_url)
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s", "hi")
        done = await turns_ended(sessions, "s", 1)
    assert done.state is not None and done.state.last_turn_error is not None
    error = done.state.last_turn_error
    assert "RateLimitError" in error and "Rate limit reached for requests" in error
    assert ("it asked for its retry no sooner than 3600 s from now, past the end of the retry policy's total "
            "duration of 1800 s from the first attempt's start, so no retry was made") in error
    assert len(provider.received) == 1


async def test_a_server_without_the_responses_api_is_told_to_use_chat(provider: FakeProvider) -> None:
    """An openai/ model with an api_base (LiteLLM's way to reach an OpenAI-compatible server) whose
    server answers /responses with 404 fails saying to pass api='chat'; the same client with
    api='chat' then works. Catches: a bare "NotFoundError: OpenAIException - Not Found", which
    named neither the Responses API nor the option, on every turn."""
    client = LiteLLMModelClient("openai/local-model", api_base=provider.url + "/v1",
                                api_key_provider=lambda: "sk-local")
    provider.queue(RESPONSES_PATH, Reply(404, b'{"detail":"Not Found"}', "application/json"))
    with pytest.raises(litellm.NotFoundError, match=r"Not Found.*pass api='chat' to LiteLLMModelClient"):
        await client.call_model(ModelRequest(None, (UserTextInput("hi"),)), collecting_writer()[0])
    chat = LiteLLMModelClient("openai/local-model", api="chat", api_base=provider.url + "/v1",
                              api_key_provider=lambda: "sk-local")
    provider.queue(CHAT_PATH, chat_stream(text="Hello."))
    response = await chat.call_model(ModelRequest(None, (UserTextInput("hi"),)), collecting_writer()[0])
    assert [item.text for item in response.output] == ["Hello."]


@pytest.mark.parametrize("variable", ["OPENAI_BASE_URL", "OPENAI_API_BASE", "litellm.api_base"])
async def test_a_server_set_in_the_environment_without_the_responses_api_is_told_to_use_chat(
    provider: FakeProvider, monkeypatch: pytest.MonkeyPatch, variable: str,
) -> None:
    """As with api_base: an openai/ model whose server comes from OPENAI_BASE_URL or OPENAI_API_BASE
    (LiteLLM reads them when no api_base is passed), answering /responses with 404, fails saying to
    pass api='chat' and naming the variable. Catches: the bare "Not Found" for a server set the
    way the OpenAI SDK's users set one. LiteLLM's own api_base setting is named alike."""
    if variable == "litellm.api_base":
        monkeypatch.setattr(litellm, "api_base", provider.url + "/v1")
    else:
        monkeypatch.setenv(variable, provider.url + "/v1")
    client = LiteLLMModelClient("openai/local-model", api_key_provider=lambda: "sk-local")
    provider.queue(RESPONSES_PATH, Reply(404, b'{"detail":"Not Found"}', "application/json"))
    with pytest.raises(litellm.NotFoundError, match=rf"Not Found.*{variable}.*pass api='chat' to LiteLLMModelClient"):
        await client.call_model(ModelRequest(None, (UserTextInput("hi"),)), collecting_writer()[0])
    assert [r.path for r in provider.received] == [RESPONSES_PATH]


@pytest.mark.parametrize("source", ["api_key_provider", "environment", "extra_headers"])
@pytest.mark.parametrize("api", ["responses", "chat"])
async def test_a_provider_error_echoing_the_api_key_is_kept_without_it(
    provider: FakeProvider, api: str, source: str, tmp_path: Path, db_url: str,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A provider whose 401 quotes the key (and the Authorization header), whether api_key_provider
    gave it, LiteLLM read it from the provider's environment variable or request_options set it as
    a header (a gateway's key), fails the turn with *** for it in the turn's error, the turn_failed
    event and the flow's history, the error's type kept. Catches: the key stored in the database,
    for anyone who reads it; a key from the environment, the way most Workers set one, or from a
    header, was kept whole."""
    key = "sk-live-hunter2-0123456789"
    path = RESPONSES_PATH if api == "responses" else CHAT_PATH
    model_name = "openai/gpt-5" if api == "responses" else "hosted_vllm/test-model"
    if source == "environment":
        monkeypatch.setenv("OPENAI_API_KEY" if api == "responses" else "HOSTED_VLLM_API_KEY", key)
        model = LiteLLMModelClient(model_name, api_base=provider.url + "/v1")
    elif source == "extra_headers":
        model = LiteLLMModelClient(model_name, api_base=provider.url + "/v1",
                                   request_options={"extra_headers": {"x-api-key": key}})
    else:
        model = LiteLLMModelClient(model_name, api_base=provider.url + "/v1", api_key_provider=lambda: key)
    echo = {"error": {"message": f"Incorrect API key provided: {key}; Authorization: Bearer {key}",
                      "type": "invalid_request_error"}}
    provider.queue(path, Reply(401, json.dumps(echo).encode(), "application/json"))
    with pytest.raises(litellm.AuthenticationError) as raised:
        await model.call_model(ModelRequest(None, (UserTextInput("hi"),)), collecting_writer()[0])
    assert key not in str(raised.value) and "Incorrect API key provided: ***" in str(raised.value)
    assert key not in "".join(traceback.format_exception(raised.value))  # as a Worker's log would print it
    sent = provider.received[0].headers
    assert (sent["x-api-key"] if source == "extra_headers" else sent["authorization"].removeprefix("Bearer ")) == key

    provider.queue(path, Reply(401, json.dumps(echo).encode(), "application/json"))
    agent = AgentDefinition(name="litellm-agent", model=model, instructions="")
    options = dataclasses.replace(builtin_agent_session_options(agent), run_model_limit=RunModelLimit(max_attempts=1))
    flow = AgentSessionFlow(BuiltinLoopAgentRunner(agent), "LiteLLMAgent", options)
    engine = InProcessEngine(tmp_path, [flow], db_url)
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s", "hi")
        done = await turns_ended(sessions, "s", 1)
        events = await sessions.read_agent_events("s")
        history = await engine.client.get_flow_history("s")
    assert done.state is not None and done.state.last_turn_error is not None
    assert "AuthenticationError" in done.state.last_turn_error and "***" in done.state.last_turn_error
    stored = [done.state.last_turn_error, *(e.value.payload for e in events.events), *(h.detail for h in history)]
    assert not [text for text in stored if key in text or "hunter2" in text]


@pytest.mark.parametrize("source", ["environment", "bearer header", "headers option", "litellm.api_key"])
async def test_a_shortest_hidden_key_and_a_bearer_token_echoed_alone_are_hidden(
    provider: FakeProvider, source: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An environment key of exactly MIN_HIDDEN_ENVIRONMENT_SECRET_CHARS characters (docs: "at least"),
    and the token of an `Authorization: Bearer <token>` extra header that the error quotes without
    "Bearer", are raised as ***; so are such a token in LiteLLM's `headers` option and a key in its
    `litellm.api_key` setting. Catches: any of them kept whole in the turn's error and history."""
    key = "gw-token-0123456789"
    if source == "environment":
        key = "k" * MIN_HIDDEN_ENVIRONMENT_SECRET_CHARS
        monkeypatch.setenv("HOSTED_VLLM_API_KEY", key)
        model = chat_client(provider)
    elif source == "litellm.api_key":
        monkeypatch.setattr(litellm, "api_key", key)
        model = chat_client(provider)
    else:
        option = "extra_headers" if source == "bearer header" else "headers"
        model = LiteLLMModelClient("hosted_vllm/test-model", api_base=provider.url + "/v1",
                                   request_options={option: {"Authorization": f"Bearer {key}"}})
    echo = {"error": {"message": f"Unknown credential {key}.", "type": "invalid_request_error"}}
    provider.queue(CHAT_PATH, Reply(401, json.dumps(echo).encode(), "application/json"))
    with pytest.raises(litellm.AuthenticationError) as raised:
        await model.call_model(ModelRequest(None, (UserTextInput("hi"),)), collecting_writer()[0])
    assert key not in str(raised.value) and "Unknown credential ***." in str(raised.value)


async def test_an_api_key_provider_returning_no_text_is_refused_naming_what_it_returned(
    provider: FakeProvider,
) -> None:
    """An async api_key_provider (its coroutine closed, so no "never awaited" warning follows), one
    returning bytes, and one returning "" are refused naming what came back, the key's bytes never
    shown. Catches: "api_key_provider returned no API key" for a function that does return one, async."""
    async def fetch_key() -> str:
        return "sk-live-0123456789"

    made: list[Any] = []

    def async_provider() -> Any:
        made.append(fetch_key())
        return made[-1]

    cases: list[tuple[Any, type[Exception], str]] = [
        (async_provider, TypeError, "returned an awaitable (an async function?); it must be a plain function"),
        (lambda: b"sk-live-0123456789", ValueError, "returned a value of type bytes; it must return the API key text"),
        (lambda: "", ValueError, "returned empty text; it must return the API key text"),
    ]
    for key_provider, error_type, message in cases:
        client = LiteLLMModelClient("hosted_vllm/test-model", api_base=provider.url + "/v1",
                                    api_key_provider=key_provider)
        with pytest.raises(error_type, match=re.escape(message)) as refused:
            await client.call_model(ModelRequest(None, (UserTextInput("hi"),)), collecting_writer()[0])
        assert "0123456789" not in str(refused.value)
    assert made[0].cr_frame is None  # closed: never started, and nothing left to warn about
    assert provider.received == []


@pytest.mark.parametrize("key", ["sk-live-0123456789\n", "sk-live-0123456789\r\n"])
async def test_a_key_with_a_line_break_is_refused_naming_the_cause(provider: FakeProvider, key: str) -> None:
    """A key from api_key_provider with a newline (read whole from a file or a secret store) is
    refused before any request, saying what to do. Catches: the HTTP client refusing the header as
    an injection attempt, raised as the provider's InternalServerError, which names neither the key
    nor a fix, on every attempt."""
    for model in (chat_client(provider), openai_client(provider)):
        keyed = LiteLLMModelClient(model.model, api_base=model.api_base, api_key_provider=lambda: key)
        with pytest.raises(ValueError, match=r"api_key_provider returned an API key with whitespace.*\.strip\(\)"
                           ) as refused:
            await keyed.call_model(ModelRequest(None, (UserTextInput("hi"),)), collecting_writer()[0])
        assert "0123456789" not in str(refused.value)
    assert provider.received == []


async def test_credentials_and_owned_parameters_are_refused_in_settings(provider: FakeProvider) -> None:
    """model_settings and request_options cannot carry credentials or replace what the client sets."""
    client = chat_client(provider)
    for settings in ({"api_key": "sk-smuggled"}, {"api_base": "http://elsewhere"}, {"num_retries": 3},
                     {"stream": False}):
        with pytest.raises(ValueError, match="may not set"):
            await client.call_model(ModelRequest(None, (UserTextInput("hi"),), model_settings=settings),
                                    collecting_writer()[0])
    with pytest.raises(ValueError, match="may not set api_key"):
        LiteLLMModelClient("openai/gpt-5", request_options={"api_key": "sk-inline"})
    with pytest.raises(ValueError, match="api must be"):
        LiteLLMModelClient("openai/gpt-5", api="completions")
    with pytest.raises(ValueError, match="cannot tell the provider"):
        LiteLLMModelClient("no-such-model-anywhere")
    assert provider.received == []
    request = ModelRequest("Be brief.", (UserTextInput("x" * 300),), (LOOKUP_TOOL,))
    assert client.estimate_input_tokens(request) == estimate_request_tokens(request) >= 100
    assert LiteLLMModelClient("openai/gpt-5", api="chat").api_label == "litellm.chat:openai"


@pytest.mark.parametrize(("where", "value", "message"), [
    ("request_options", {1: 2}, "request_options keys must be option names (text), got 1"),
    ("request_options", {"": 2}, "request_options keys must be option names (text), got ''"),
    ("request_options", "fast", "request_options must be a dict of LiteLLM options, got 'fast'"),
    ("request_options", {"stream": False}, "request_options may not set stream"),
    ("model_settings", {"model": "openai/gpt-5-mini"}, "invalid AgentDefinition: model_settings may not set model"),
    ("model_settings", {"api_key": "sk-inline", "temperature": 0}, "invalid AgentDefinition: model_settings may "
     "not set api_key"),
    ("model_settings", {1: 2}, "invalid AgentDefinition: model_settings key 1 is not a setting name"),
])
def test_a_bad_option_is_refused_where_it_is_written(where: str, value: object, message: str) -> None:
    """request_options when the client is built, model_settings when the AgentDefinition is. Catches:
    either taken, then every model call of every turn failing in a Worker (a bare TypeError on a
    name that is not text, or "may not set"), and text request_options failing in dict()."""
    with pytest.raises(ValueError, match=re.escape(message)) as refused:
        if where == "request_options":
            LiteLLMModelClient("openai/gpt-5", request_options=value)  # type: ignore[arg-type]
        else:
            AgentDefinition(name="a", instructions="", model=LiteLLMModelClient("openai/gpt-5"),
                            model_settings=value)  # type: ignore[arg-type]
    assert str(refused.value).count("model_settings key") <= 1  # not once by the definition, again by the client


_URL_WANTED = ("api_base must be an http:// or https:// URL, such as 'http://127.0.0.1:8000/v1', or None for "
               "the provider's own server, got ")


@pytest.mark.parametrize(("arguments", "error_type", "message"), [
    ({"api_base": ""}, ValueError, _URL_WANTED + "''"),
    ({"api_base": "127.0.0.1:8000/v1"}, ValueError, _URL_WANTED + "'127.0.0.1:8000/v1'"),
    ({"api_base": "http://"}, ValueError, _URL_WANTED + "'http://'"),
    ({"api_base": "ws://127.0.0.1:8000/v1"}, ValueError, _URL_WANTED + "'ws://127.0.0.1:8000/v1'"),
    ({"api_base": "http://127.0.0.1:80OO/v1"}, ValueError, _URL_WANTED + "'http://127.0.0.1:80OO/v1'"),
    ({"api_base": " http://127.0.0.1:8000/v1"}, ValueError, _URL_WANTED + "' http://127.0.0.1:8000/v1'"),
    ({"api_base": "http://127.0.0.1:8000/v1\n"}, ValueError, _URL_WANTED + "'http://127.0.0.1:8000/v1\\n'"),
    ({"api_base": "https://gw:hunter2@gw.example/v1 "}, ValueError, _URL_WANTED + "'https://***@gw.example/v1 '"),
    ({"api_base": b"http://127.0.0.1:8000/v1"}, TypeError,
     "api_base must be a str or None, got bytes: b'http://127.0.0.1:8000/v1'"),
    ({"model": "hosted_vllm/test-model "}, ValueError,
     "model must be a LiteLLM model name such as 'openai/gpt-5', got 'hosted_vllm/test-model '"),
    ({"api_key_provider": "sk-live-0123456789"}, TypeError,
     "api_key_provider must be a function returning the API key (such as lambda: key), got a str"),
    ({"request_options": []}, ValueError, "request_options must be a dict of LiteLLM options, got []"),
    ({"request_options": ""}, ValueError, "request_options must be a dict of LiteLLM options, got ''"),
])
def test_a_bad_argument_is_refused_when_the_client_is_made(
    arguments: dict[str, Any], error_type: type[Exception], message: str
) -> None:
    """LiteLLMModelClient refuses, naming the argument and its value, what LiteLLM takes and fails on
    only at the call: api_base "" sent a hosted_vllm/ model's requests to api.openai.com, and a URL
    without http:// or with a space or a newline around it failed every attempt with an
    InternalServerError naming only a path ("/127.0.0.1:8000/v1/chat/completions"). Catches those,
    bytes failing as "LiteLLM cannot tell the provider of model", a request_options of the wrong kind
    that is empty ([], "") taken as none, and a model name with a space around it sent as it is. A
    password in the URL, or a key given in place of api_key_provider, is not shown."""
    with pytest.raises(error_type, match=re.escape(message)) as refused:
        LiteLLMModelClient(**{"model": "hosted_vllm/test-model", **arguments})
    assert "hunter2" not in str(refused.value) and "0123456789" not in str(refused.value)


def test_an_api_base_of_either_scheme_is_taken() -> None:
    """https:// and http:// in any case, with a port, a path or none, as LiteLLM calls them."""
    for url in ("https://gateway.example", "HTTP://127.0.0.1:8000/v1", "https://[::1]:8443/v1/"):
        assert LiteLLMModelClient("hosted_vllm/test-model", api_base=url).api_base == url


def test_without_litellm_the_import_names_the_extra() -> None:
    """`import dex_agents` never imports LiteLLM; dex_agents.litellm without it names dex-agents[litellm]."""
    script = (
        "import sys\n"
        "import dex_agents, dex_agents.builtin_loop, dex_agents.testing\n"
        "assert 'litellm' not in sys.modules, 'dex_agents imported litellm'\n"
        "sys.modules['litellm'] = None\n"
        "try:\n"
        "    import dex_agents.litellm\n"
        "except ImportError as error:\n"
        "    print('IMPORT ERROR:', error)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "IMPORT ERROR:" in done.stdout and "dex-agents[litellm]" in done.stdout


# End to end ---------------------------------------------------------------------------------------


async def test_session_turn_with_a_tool_call_through_litellm(provider: FakeProvider, tmp_path: Path) -> None:
    """A builtin_loop agent on LiteLLMModelClient runs a real session: a tool call, then the final answer."""
    model = chat_client(provider)
    agent = AgentDefinition(name="litellm-agent", model=model, instructions="You look up orders.",
                            tools=[lookup_order])
    flow = builtin_agent_session_flow(agent, "LiteLLMAgent")
    provider.queue(CHAT_PATH, chat_stream(text="Checking.", call=CHAT_CALL))
    provider.queue(CHAT_PATH, chat_stream(text="A-1 has shipped."))
    engine = InProcessEngine(tmp_path, [flow])
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s", "Where is A-1?")
        done = await turns_ended(sessions, "s", 1)
        assert done.state is not None and done.state.last_turn_error is None
        assert done.messages[-1].role is MessageRole.ASSISTANT and done.messages[-1].text == "A-1 has shipped."
        steps = executed_steps(to_step_history(await engine.client.get_flow_history("s")))
    assert steps == ["StartAgentSession", "RunModel", "CallTool", "ResumeTurn", "RunModel"]
    assert lookup_order.policy.effect is ToolEffect.READ  # a read runs in CallTool without an approval
    assert len(provider.received) == 2
    second = provider.received[1].json["messages"]
    assert second[0] == {"role": "system", "content": "You look up orders."}
    assert second[1] == {"role": "user", "content": "Where is A-1?"}
    assert second[2] == {"role": "assistant", "content": "Checking.", "tool_calls": [CHAT_CALL]}
    assert second[3]["role"] == "tool" and second[3]["tool_call_id"] == "call_7"
    assert "shipped" in second[3]["content"]


async def test_a_long_answer_and_long_arguments_are_stored_and_replayed(
    provider: FakeProvider, tmp_path: Path, db_url: str  # noqa: F811
) -> None:
    """A model's answer and a tool call's arguments of about 400,000 characters each (some 100,000
    tokens, within what models may write) are stored, and the next request replays them. Catches:
    each stored three times in its message (the provider's item, the framework item's own copy,
    the message field), over the engine's value limit, so the paid answer was lost and the turn
    failed with "too large to store"."""
    model = chat_client(provider)
    agent = AgentDefinition(name="litellm-agent", model=model, instructions="You look up orders.",
                            tools=[lookup_order])
    flow = builtin_agent_session_flow(agent, "LiteLLMAgent")
    order_id = "A-" + "1" * 400_000
    call = {**CHAT_CALL, "function": {"name": "lookup_order", "arguments": json.dumps({"order_id": order_id})}}
    answer = "All orders shipped. " * 20_000
    provider.queue(CHAT_PATH, chat_stream(call=call))
    provider.queue(CHAT_PATH, chat_stream(text=answer))
    provider.queue(CHAT_PATH, chat_stream(text="Yes."))
    engine = InProcessEngine(tmp_path, [flow], db_url)
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s", "Where is my order?")
        done = await turns_ended(sessions, "s", 1)
        assert done.state is not None and done.state.last_turn_error is None
        assert [m.role for m in done.messages] == [
            MessageRole.USER, MessageRole.ASSISTANT, MessageRole.TOOL, MessageRole.ASSISTANT]
        assert done.messages[1].tool_arguments == call["function"]["arguments"]
        assert done.messages[-1].text == answer
        await sessions.send_user_message("s", "Sure?")
        await turns_ended(sessions, "s", 2)
    replayed = provider.received[-1].json["messages"]
    assert replayed[2]["tool_calls"] == [call]
    assert replayed[4] == {"role": "assistant", "content": answer}


# Output cut at the token limit, or none at all ----------------------------------------------------


def _chat_chunk(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"id": "chatcmpl-9", "object": "chat.completion.chunk", "created": 1767225600, "model": "test-model",
            "choices": choices, **extra}


EMPTY_REPLIES = {
    "only [DONE]": (CHAT_PATH, Reply(200, b"data: [DONE]\n\n", "text/event-stream")),
    "no choices": (CHAT_PATH, sse([_chat_chunk([]), _chat_chunk([], usage={
        "prompt_tokens": 5, "completion_tokens": 0, "total_tokens": 5})], named=False, done=True)),
    "an empty message": (CHAT_PATH, sse([
        _chat_chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]),
        _chat_chunk([{"index": 0, "delta": {}, "finish_reason": "stop"}])], named=False, done=True)),
    "only reasoning": (CHAT_PATH, chat_stream(reasoning="Let me think.")),
    "a response without items": (RESPONSES_PATH, responses_stream([])),
}


@pytest.mark.parametrize("case", list(EMPTY_REPLIES))
async def test_a_response_with_no_text_and_no_tool_call_raises(provider: FakeProvider, case: str) -> None:
    """A stream with no choices, only [DONE], an empty message, only reasoning, or a completed
    Responses API response without items raises, so RunModel tries the call again. Catches: an
    empty ModelResponse (LiteLLM fills in finish_reason "stop"), which ended the turn as answered,
    with nothing to show the user and no error."""
    path, reply = EMPTY_REPLIES[case]
    provider.queue(path, reply)
    client = chat_client(provider) if path == CHAT_PATH else openai_client(provider)
    with pytest.raises(RuntimeError, match=r"the model returned no output: no text and no tool call \(finish_reason"):
        await client.call_model(ModelRequest(None, (UserTextInput("hi"),)), collecting_writer()[0])


async def test_an_empty_response_is_tried_again_in_a_session(
    provider: FakeProvider, tmp_path: Path, db_url: str  # noqa: F811
) -> None:
    """RunModel's retry makes the call again after an empty stream, and the turn gets the answer."""
    agent = AgentDefinition(name="litellm-agent", model=chat_client(provider), instructions="")
    provider.queue(CHAT_PATH, Reply(200, b"data: [DONE]\n\n", "text/event-stream"))
    provider.queue(CHAT_PATH, chat_stream(text="Hello."))
    engine = InProcessEngine(tmp_path, [builtin_agent_session_flow(agent, "LiteLLMAgent")], db_url)
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s", "hi")
        done = await turns_ended(sessions, "s", 1)
    assert done.state is not None and done.state.last_turn_error is None
    assert [(m.role, m.text) for m in done.messages] == [(MessageRole.USER, "hi"), (MessageRole.ASSISTANT, "Hello.")]
    assert len(provider.received) == 2


@pytest.mark.parametrize("api", ["responses", "chat"])
async def test_a_tool_call_cut_at_the_token_limit_tells_the_model_so(
    provider: FakeProvider, api: str, tmp_path: Path, db_url: str  # noqa: F811
) -> None:
    """A response cut at the token limit in a tool call's arguments (finish_reason "length", or an
    incomplete Responses API response at max_output_tokens) fails the call, and its result tells
    the model its output was cut, naming the finish reason, so it can shorten the call. Catches:
    only "arguments must be a JSON object", which told the model nothing it could fix, so it made
    the same call again, cut again."""
    cut = '{"order_id": "A-'
    if api == "chat":
        model, path, reason = chat_client(provider), CHAT_PATH, "length"
        provider.queue(path, chat_stream(call={**CHAT_CALL, "function": {"name": "lookup_order", "arguments": cut}},
                                         finish="length"))
        provider.queue(path, chat_stream(text="Sorry."))
    else:
        model, path, reason = openai_client(provider), RESPONSES_PATH, "max_output_tokens"
        provider.queue(path, responses_stream([{**CALL_ITEM, "status": "incomplete", "arguments": cut}],
                                              incomplete="max_output_tokens"))
        provider.queue(path, responses_stream([MESSAGE_ITEM], response_id="resp_2"))
    agent = AgentDefinition(name="litellm-agent", model=model, instructions="", tools=[lookup_order])
    engine = InProcessEngine(tmp_path, [builtin_agent_session_flow(agent, "LiteLLMAgent")], db_url)
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s", "Where is A-1?")
        done = await turns_ended(sessions, "s", 1)
    assert done.state is not None and done.state.last_turn_error is None
    (result,) = [m for m in done.messages if m.role is MessageRole.TOOL]
    expected = (f"The tool call failed: arguments must be a JSON object; your output was cut at its token limit "
                f"(finish_reason '{reason}') before this call's arguments were complete, so make the call again "
                "with shorter arguments, or split the work into smaller calls")
    assert result.tool_output == expected
    sent = provider.received[-1].json
    if api == "chat":
        assert sent["messages"][-1] == {"role": "tool", "tool_call_id": "call_7", "content": expected}
    else:
        assert sent["input"][-1] == {"type": "function_call_output", "call_id": "call_1", "output": expected}


# The two ways a provider stops an answer before its end, with the finish reason each API reports
# and the turn error the built-in loop records.
_STOPPED_ANSWERS = {
    "token_limit": ({"chat": "length", "responses": "max_output_tokens"},
                    "the model's output was cut at its token limit (finish_reason '{reason}'), so its answer is "
                    "incomplete or missing; raise the output token limit (max_output_tokens or max_tokens in the "
                    "agent's model_settings), or ask for a shorter answer"),
    "content_filter": ({"chat": "content_filter", "responses": "content_filter"},
                       "the model provider's content filter stopped the model's output (finish_reason '{reason}'), "
                       "so its answer is incomplete or missing; rephrase the request, or review the provider's "
                       "content filter settings"),
}


@pytest.mark.parametrize("stop", sorted(_STOPPED_ANSWERS))
@pytest.mark.parametrize("api", ["responses", "chat"])
async def test_an_answer_stopped_before_its_end_is_kept_and_the_turn_fails_saying_so(
    provider: FakeProvider, api: str, stop: str, tmp_path: Path, db_url: str  # noqa: F811
) -> None:
    """An answer cut at the token limit, or stopped by the provider's content filter, is stored, and
    the turn fails with an error naming the finish reason and what to do, without a retry; so does
    a response stopped before any answer (only reasoning). Catches: the stopped answer (or none)
    taken as the turn's whole answer, with nothing telling the user or an operator, or an empty one
    tried again (the same stop, paid again)."""
    reasons, template = _STOPPED_ANSWERS[stop]
    reason = reasons[api]
    if api == "chat":
        model = chat_client(provider)
        provider.queue(CHAT_PATH, chat_stream(text="The three steps are: 1. Open", finish=reason))
        provider.queue(CHAT_PATH, chat_stream(reasoning="Thinking hard about it", finish=reason))
    else:
        model = openai_client(provider)
        provider.queue(RESPONSES_PATH, responses_stream([MESSAGE_ITEM], incomplete=reason))
        provider.queue(RESPONSES_PATH, responses_stream([REASONING_ITEM], incomplete=reason))
    error = template.format(reason=reason)
    agent = AgentDefinition(name="litellm-agent", model=model, instructions="")
    engine = InProcessEngine(tmp_path, [builtin_agent_session_flow(agent, "LiteLLMAgent")], db_url)
    async with engine.running():
        sessions = engine.sessions()
        await sessions.start_session("s", "How do I start?")
        first = await turns_ended(sessions, "s", 1)
        await sessions.send_user_message("s", "Think about it.")
        second = await turns_ended(sessions, "s", 2)
        failures = [json.loads(e.value.payload) for e in (await sessions.read_agent_events("s")).events
                    if e.value.type == "turn_failed"]
    assert first.state is not None and first.state.last_turn_error == error
    assert first.messages[-1].role is MessageRole.ASSISTANT
    assert first.messages[-1].text == ("The three steps are: 1. Open" if api == "chat" else "Let me look.")
    assert second.state is not None and second.state.last_turn_error == error
    assert [f["error"] for f in failures] == [error, error]
    assert len(provider.received) == 2  # not tried again: the same limit or filter would stop it again


@pytest.mark.parametrize("variable", ["OPENAI_API_KEY", "HOSTED_VLLM_API_KEY"])
@pytest.mark.parametrize("value", ["sk-live-0123456789\n", " sk-live-0123456789", "sk-live-01234\r\n56789"])
async def test_an_environment_key_with_a_line_break_is_refused_naming_the_variable(
    provider: FakeProvider, variable: str, value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A provider key from the environment with a newline (a Kubernetes secret or a file read into
    the variable) is refused before any request, naming the variable and never its value; an
    unrelated credential variable with one changes nothing. Catches: "InternalServerError: ...
    Forbidden control character detected in headers", which named neither the key nor a fix, on
    every attempt; an api_key_provider's key was already refused so."""
    monkeypatch.setenv(variable, value)
    monkeypatch.setenv("GITHUB_TOKEN", "ghp-0123456789\n")
    if variable == "OPENAI_API_KEY":
        client, provider_name = LiteLLMModelClient("openai/gpt-5", api_base=provider.url + "/v1"), "openai"
    else:
        client, provider_name = chat_client(provider), "hosted_vllm"
    with pytest.raises(ValueError, match=re.escape(
            f"environment variable {variable}, which LiteLLM reads the {provider_name} API key from, has whitespace "
            "around its value or a control character in it")) as refused:
        await client.call_model(ModelRequest(None, (UserTextInput("hi"),)), collecting_writer()[0])
    assert "0123" not in str(refused.value) and "GITHUB_TOKEN" not in str(refused.value)
    assert provider.received == []

    # With api_key_provider the variable is not read, so not refused.
    keyed = LiteLLMModelClient(client.model, api_base=client.api_base, api_key_provider=lambda: "sk-provided")
    provider.queue(CHAT_PATH if provider_name == "hosted_vllm" else RESPONSES_PATH,
                   chat_stream(text="Hello.") if provider_name == "hosted_vllm" else responses_stream([MESSAGE_ITEM]))
    assert (await keyed.call_model(ModelRequest(None, (UserTextInput("hi"),)), collecting_writer()[0])).output

    monkeypatch.setenv(variable, value.strip().replace("\r\n", ""))
    provider.queue(CHAT_PATH, chat_stream(text="Hello."))
    provider.queue(RESPONSES_PATH, responses_stream([MESSAGE_ITEM]))
    response = await client.call_model(ModelRequest(None, (UserTextInput("hi"),)), collecting_writer()[0])
    assert response.output[-1].text in ("Hello.", "Let me look.")
