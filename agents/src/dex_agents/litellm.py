"""LiteLLMModelClient: a ModelClient for the built-in loop over LiteLLM (install `dex-agents[litellm]`).

OpenAI models use the Responses API (`litellm.aresponses`) with `store=False` and
`include=["reasoning.encrypted_content"]`, so no conversation state lives at the provider and encrypted
reasoning comes back to be replayed. Every other provider uses streaming Chat Completions
(`litellm.acompletion(stream=True)`), keeping Anthropic `thinking_blocks` with their `signature`.

Each output item's `api` is `litellm.responses:<provider>` or `litellm.chat:<provider>`. An item whose
`api` is this client's replays as the provider's own JSON, unchanged (but a Responses reasoning item that
no other item of its response follows, from a response cut off while reasoning, is left out: OpenAI refuses
it); an item of another provider or API replays as its text and tool calls, and its reasoning is dropped.
On Chat Completions, and for another API's calls, a past tool call's arguments that are not a JSON object
replay as `{}` (the session failed that call; some providers refuse such a request).

Credentials come from the Worker's environment, as LiteLLM reads it, or from `api_key_provider`; never
from the request. An error that quotes the key `api_key_provider` gave, or the value of an environment
variable named like a credential (`OPENAI_API_KEY`, `AWS_SECRET_ACCESS_KEY`, ...; one of at least 8
characters), of a LiteLLM key setting (`litellm.api_key`, `litellm.anthropic_key`, ...) or of a
credential header in `extra_headers` (`Authorization`, `x-api-key`, ...), is raised with *** for it.
A 429, 503 or 529 (Anthropic's overloaded) whose response has `retry-after-ms` or `Retry-After` is raised
with `retry_after_seconds` set on it (dex_engine's RetryAfterError protocol): the engine waits that long
before RunModel's next attempt.
LiteLLM fetches its model cost map over the network when imported, unless
`LITELLM_LOCAL_MODEL_COST_MAP=True` (or `LITELLM_OFFLINE_MODE=true`) is set in the environment.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import email.utils
import inspect
import json
import os
import re
import urllib.parse
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Final, cast

try:
    import litellm
except ImportError as error:  # pragma: no cover - exercised by a subprocess test
    raise ImportError(
        "dex_agents.litellm needs the LiteLLM package: install dex-agents[litellm] (pip install 'dex-agents[litellm]')"
    ) from error

from ._constants import MIN_HIDDEN_ENVIRONMENT_SECRET_CHARS
from ._policy import shown
from ._runner import ModelCallMetadata
from ._wire import AgentUsage
from .builtin_loop._model import (
    ModelInputItem,
    ModelOutputItem,
    ModelOutputWriter,
    ModelRequest,
    ModelResponse,
    ModelToolCall,
    ModelToolDefinition,
    OutputItemKind,
    ToolChoice,
    ToolResultInput,
    UserTextInput,
    content_filter_finish_reason,
    estimate_request_tokens,
    token_limit_finish_reason,
    unique_call_id,
)

__all__ = ["CHAT_API", "RESPONSES_API", "LiteLLMModelClient"]

RESPONSES_API: Final = "responses"
CHAT_API: Final = "chat"

# Parameters the client owns: settings may not replace them, and credentials never come with a request.
_RESERVED_OPTIONS: Final = frozenset({
    "model", "input", "messages", "instructions", "tools", "tool_choice", "stream", "stream_options", "store",
    "include", "previous_response_id", "conversation", "num_retries", "max_retries", "api_key", "api_base",
    "base_url", "custom_llm_provider", "azure_ad_token", "aws_access_key_id", "aws_secret_access_key",
    "aws_session_token", "vertex_credentials", "thought_signature_in_tool_call_id",
})

# The environment variables LiteLLM reads an openai/ model's base URL from when no api_base is given.
_OPENAI_BASE_VARIABLES: Final = ("OPENAI_BASE_URL", "OPENAI_API_BASE")

_RESPONSES_INCLUDE: Final = ("reasoning.encrypted_content",)
_TOOL_CHOICES: Final = {ToolChoice.AUTO: "auto", ToolChoice.REQUIRED: "required", ToolChoice.NONE: "none"}


def _dump(value: Mapping[str, Any]) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _get(value: object, name: str) -> Any:
    """A field of a LiteLLM object or of a plain dict (LiteLLM returns either, depending on the path)."""
    if isinstance(value, Mapping):
        return value.get(name)
    return getattr(value, name, None)


def _arguments_text(value: object) -> str:
    """A tool call's arguments as the JSON text the session stores: a provider that sends them as an
    object (some Responses API servers do) gets its JSON, not Python's repr, which no tool can parse."""
    if value is None or value == "":
        return "{}"
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"), ensure_ascii=False)


# The name a streamed tool call that never carries one gets until _chat_items stores it with none:
# stream_chunk_builder keeps only calls with a name. No provider accepts a tool name with spaces.
_NAMELESS: Final = " nameless call "


def _tool_call_fragments(chunks: list[Any]) -> Iterator[tuple[int, Any]]:
    """Each streamed tool call fragment the chunk builder reads, with its choice's index."""
    for chunk in chunks:
        for choice in _get(chunk, "choices") or []:
            for fragment in _get(_get(choice, "delta"), "tool_calls") or []:
                if _get(fragment, "function") is not None:  # the chunk builder skips one without
                    yield _get(choice, "index") or 0, fragment


def _separate_reused_indexes(chunks: list[Any]) -> None:
    """Give a streamed tool call that reuses an earlier call's index an index of its own: one under
    its own new id, and one under the same id, or none, whose arguments start when the call there
    already holds a whole JSON object. The chunk builder joins fragments by index, and some
    OpenAI-compatible servers (Ollama, some proxies and gateways) send index 0, or none, for every
    call of a response, some with no ids or one id for all: two calls became one, with the second's
    id and both argument texts run together, so one call was lost and the other failed as not a
    JSON object."""
    fragments = list(_tool_call_fragments(chunks))
    free = {choice: -1 for choice, _ in fragments}
    for choice, fragment in fragments:
        free[choice] = max(free[choice], _get(fragment, "index") or 0)
    now_at: dict[tuple[int, int], int] = {}  # (choice, index sent) -> the index its fragments now go to
    ids: dict[tuple[int, int], str] = {}  # (choice, index now) -> the id of the call there
    texts: dict[tuple[int, int], list[str]] = {}  # (choice, index now) -> the argument texts of the call there
    # (choice, index now) -> a fragment with an id or name but no arguments after the call there was
    # whole: the start of the next call, if arguments follow
    heads: dict[tuple[int, int], Any] = {}
    for choice, fragment in fragments:
        sent = _get(fragment, "index") or 0
        index = now_at.get((choice, sent), sent)
        fragment_id = _str_or_none(_get(fragment, "id"))
        raw_text = _get(_get(fragment, "function"), "arguments")
        text = raw_text if isinstance(raw_text, str) else ""
        # A call starts with its id or name: arguments alone that run on after a whole object (a
        # server repeating a call's arguments) stay with it, failing it, rather than run it twice.
        starts = fragment_id is not None or bool(_get(_get(fragment, "function"), "name"))
        if fragment_id is not None and ids.setdefault((choice, index), fragment_id) != fragment_id:
            free[choice] += 1
            index = now_at[(choice, sent)] = free[choice]  # a new call: it and what follows go there
            ids[(choice, index)] = fragment_id
        elif (text.lstrip().startswith("{") and (starts or (choice, index) in heads)
              and _whole_object(texts.get((choice, index), []))):
            # Joined, the texts would be no JSON at all: this is the next call's, under the same id or none.
            head = heads.pop((choice, index), None)
            free[choice] += 1
            index = now_at[(choice, sent)] = free[choice]
            if fragment_id is not None:
                ids[(choice, index)] = fragment_id
            if head is not None:
                _put(head, "index", index)  # its id and name are the new call's
        elif not text and starts and _whole_object(texts.get((choice, index), [])):
            heads[(choice, index)] = fragment
        texts.setdefault((choice, index), []).append(text)
        if index != sent:
            _put(fragment, "index", index)


def _whole_object(parts: list[str]) -> bool:
    """Whether the texts `parts` make one whole JSON object; joined and parsed only when they end as
    one could, so a call streamed in thousands of fragments is not parsed again at each."""
    last = next((part for part in reversed(parts) if part.strip()), "")
    if not last.rstrip().endswith("}"):
        return False
    try:
        return isinstance(json.loads("".join(parts)), dict)
    except ValueError:
        return False


def _complete_streamed_tool_calls(chunks: list[Any]) -> None:
    """Give each streamed tool call that never carries an id one, and one that never carries a name
    _NAMELESS, on its first fragment: stream_chunk_builder keeps only tool calls with both, so a
    server that streams none (some OpenAI-compatible ones) would lose the model's call without a
    word. The id is the one _chat_items gives a call without one, `call_<response id>_<index>`, or
    with a random name (_unnamed_response) for a response without an ID."""
    _separate_reused_indexes(chunks)
    with_id: set[tuple[int, int]] = set()
    named: set[tuple[int, int]] = set()
    first: dict[tuple[int, int], Any] = {}
    functions: dict[tuple[int, int], list[Any]] = {}
    response_id: str | None = None
    for chunk in chunks:
        response_id = response_id or _str_or_none(_get(chunk, "id"))
        for choice in _get(chunk, "choices") or []:
            for fragment in _get(_get(choice, "delta"), "tool_calls") or []:
                if _get(fragment, "function") is None:
                    continue  # the chunk builder skips a fragment without a function, so must this
                key = (_get(choice, "index") or 0, _get(fragment, "index") or 0)
                first.setdefault(key, fragment)
                functions.setdefault(key, []).append(_get(fragment, "function"))
                _utf8_field(fragment, "id")
                _utf8_field(_get(fragment, "function"), "name")
                if _get(fragment, "id"):
                    with_id.add(key)
                if _get(_get(fragment, "function"), "name"):
                    named.add(key)
    response_name = response_id or _unnamed_response()
    for key, fragment in first.items():
        if key not in with_id:
            _put(fragment, "id", f"call_{response_name}_{key[1]}")
        if key not in named:
            _put(_get(fragment, "function"), "name", _NAMELESS)
    for parts in functions.values():
        _utf8_arguments(parts)


def _utf8_field(value: Any, name: str) -> None:
    """Make a tool call fragment's text field (`id`, a function's `name`) text UTF-8 can hold
    (_utf8): the chunk builder writes it as JSON too, and failed on a surrogate as on arguments."""
    text = _get(value, name)
    if isinstance(text, str) and (fixed := _utf8(text)) != text:
        _put(value, name, fixed)


def _utf8_arguments(functions: list[Any]) -> None:
    """Make the arguments one streamed tool call's `functions` fragments hold text UTF-8 can hold, as
    _utf8 does, joined first, so an emoji split between two fragments stays whole: the chunk builder
    writes each call as JSON, and a surrogate there failed it ("Error building chunks for
    logging/streaming usage calculation"), a server error that every attempt met again."""
    texts = [_get(function, "arguments") for function in functions]
    if all(not isinstance(text, str) or _utf8(text) == text for text in texts):
        return
    joined = _utf8("".join(text for text in texts if isinstance(text, str)))
    for function, text in zip(functions, texts, strict=True):
        if isinstance(text, str):
            _put(function, "arguments", joined)
            joined = ""  # all in the first: the chunk builder joins them


def _call_ids_in(entries: Sequence[ModelInputItem]) -> set[str]:
    """The tool call IDs the request's input holds, which a new call's ID must differ from."""
    taken: set[str] = set()
    for entry in entries:
        if isinstance(entry, ToolResultInput):
            taken.add(entry.tool_call_id)
        elif isinstance(entry, ModelOutputItem) and entry.tool_call is not None:
            taken.add(entry.tool_call.tool_call_id)
    return taken


def _unnamed_response() -> str:
    """A name for a response that came without an ID (some servers, such as Hugging Face TGI, send
    ""), for the IDs of its calls that came without one too: a fixed name gave every such call of
    a turn the same ID, which the session refuses, failing each turn with a second model call."""
    return f"response-{uuid.uuid4().hex[:16]}"


def _put(value: Any, name: str, field: object) -> None:
    """Set a field of a LiteLLM object or of a plain dict."""
    if isinstance(value, dict):
        value[name] = field
    else:
        setattr(value, name, field)


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _plain(value: object) -> Any:
    """A provider object as the JSON it was parsed from: set fields only, so provider nulls survive."""
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        return dump(mode="json", exclude_unset=True)
    return value


def _event_type(event: object) -> str:
    kind = _get(event, "type")
    value = getattr(kind, "value", kind)  # LiteLLM's event types are str Enums
    return value if isinstance(value, str) else ""


class LiteLLMModelClient:
    """A ModelClient over LiteLLM: one request per call, no retries of its own, the whole input every time."""

    def __init__(
        self,
        model: str,
        api: str | None = None,
        api_base: str | None = None,
        api_key_provider: Callable[[], str] | None = None,
        request_options: Mapping[str, Any] | None = None,
    ) -> None:
        # A name with a space around it was sent as it is, and the provider's "no such model" named no space.
        if not isinstance(model, str) or not model.strip() or model != model.strip():
            raise ValueError(f"model must be a LiteLLM model name such as 'openai/gpt-5', got {model!r}")
        if api not in (None, RESPONSES_API, CHAT_API):
            raise ValueError(f"api must be {RESPONSES_API!r}, {CHAT_API!r} or None, got {api!r}")
        if api_base is not None and not isinstance(api_base, str):
            raise TypeError(f"api_base must be a str or None, got {type(api_base).__name__}: {shown(api_base)}")
        if api_base is not None and not _is_server_url(api_base):
            raise ValueError(f"api_base must be an http:// or https:// URL, such as 'http://127.0.0.1:8000/v1', or "
                             f"None for the provider's own server, got {shown(_without_password(api_base))}")
        if api_key_provider is not None and not callable(api_key_provider):
            # Its type only: the key itself, passed here, would be shown whole.
            raise TypeError("api_key_provider must be a function returning the API key (such as lambda: key), "
                            f"got a {type(api_key_provider).__name__}")
        # `is None`, not `or {}`: a [] or "" passed here is refused as the wrong kind, not taken as none.
        problem = _options_problem({} if request_options is None else request_options, "request_options")
        if problem is not None:
            raise ValueError(problem)
        options = dict(request_options or {})
        try:
            resolved = cast(
                "tuple[str, str, str | None, str | None]", litellm.get_llm_provider(model=model, api_base=api_base)
            )
        except Exception as error:  # LiteLLM raises its BadRequestError for a model it cannot place
            raise ValueError(f"LiteLLM cannot tell the provider of model {model!r}: {error}") from error
        self.model: Final = model
        self.provider: Final = resolved[1]
        self.api: Final[str] = api or (RESPONSES_API if self.provider == "openai" else CHAT_API)
        self.api_base: Final = api_base
        self.request_options: Final[Mapping[str, Any]] = options
        self._api_key_provider = api_key_provider
        # A stable label: replay knows from it whether an item came from this provider and API.
        self.api_label: Final = f"litellm.{self.api}:{self.provider}"

    # The ModelClient contract ------------------------------------------------------------------

    def estimate_input_tokens(self, request: ModelRequest) -> int:
        return estimate_request_tokens(request)

    def supports_forced_tool_choice(self, settings: Mapping[str, Any]) -> bool:
        """False for Claude Opus 5.5 and Sonnet 5.5, and when Anthropic extended thinking is on.

        Both refuse a forced tool choice. For a model routed to Anthropic, or Claude on Bedrock or
        Vertex AI, a `thinking` option that is not disabled, or a `reasoning_effort` other than
        "none", counts as extended thinking. Gemini and OpenAI models accept a forced tool choice.
        """
        if not self._is_anthropic():
            return True
        if _REFUSES_FORCED_TOOL_CHOICE.search(self.model.lower()):
            return False
        merged = {**self.request_options, **dict(settings or {})}
        return not _thinking_enabled(merged)

    def model_settings_problem(self, settings: Mapping[str, Any]) -> str | None:
        """What call_model would refuse in these model settings on every call, or None; AgentDefinition
        asks when it is built, so that a bad setting is refused there and not in every turn."""
        return _options_problem(settings, "model_settings")

    async def call_model(self, request: ModelRequest, output: ModelOutputWriter) -> ModelResponse:
        problem = _options_problem(request.model_settings, "model_settings")
        if problem is not None:
            raise ValueError(problem)
        settings = dict(request.model_settings)
        kwargs: dict[str, Any] = {**self.request_options, **settings}
        kwargs.update(model=self.model, stream=True, num_retries=0, max_retries=0)
        if self.api_base is not None:
            kwargs["api_base"] = self.api_base
        key: str | None = None
        if self._api_key_provider is not None:
            returned: object = self._api_key_provider()
            if inspect.isawaitable(returned):
                if inspect.iscoroutine(returned):
                    returned.close()  # never awaited: closed, so no "never awaited" warning follows
                raise TypeError("api_key_provider returned an awaitable (an async function?); it must be a plain "
                                "function returning the API key text")
            if not isinstance(returned, str) or not returned:
                # Its type only: a key given as bytes would be shown whole.
                shown_type = "empty text" if returned == "" else f"a value of type {type(returned).__name__}"
                raise ValueError(f"api_key_provider returned {shown_type}; it must return the API key text")
            key = returned
            if _padded(key):
                # A key read whole from a file or a secret store often ends with a newline: sent, the HTTP
                # client refused the header as an injection attempt, which LiteLLM raised as the
                # provider's InternalServerError, on every attempt.
                raise ValueError("api_key_provider returned an API key with whitespace around it or a control "
                                 "character in it (a newline read with it from a file?); return the key alone, "
                                 "such as with .strip()")
            kwargs["api_key"] = key
        else:
            padded = _padded_environment_keys(self.provider)
            if padded:
                # As for api_key_provider's key: a Kubernetes secret or a file read into the variable
                # often ends with a newline, and every attempt failed with a misleading
                # "Forbidden control character detected in headers" InternalServerError.
                raise ValueError(f"environment variable {' and '.join(padded)}, which LiteLLM reads the "
                                 f"{self.provider} API key from, has whitespace around its value or a control "
                                 "character in it (a newline read with it from a file or secret?); set it to the "
                                 "key alone")
        try:
            if self.api == RESPONSES_API:
                return await self._call_responses(request, output, kwargs)
            return await self._call_chat(request, output, kwargs)
        except Exception as error:
            base = self._responses_base_setting() if self.api == RESPONSES_API else None
            if base is not None and isinstance(error, litellm.NotFoundError):
                # LiteLLM reaches an OpenAI-compatible server as an openai/ model with an api_base (or
                # OPENAI_BASE_URL), and many such servers serve Chat Completions only: their bare
                # "Not Found" named no way out.
                _append_to_text(error, f"; if the server at {base} has no Responses API (/responses), "
                                       "pass api='chat' to LiteLLMModelClient to use Chat Completions")
            # A provider may echo the key (or the Authorization header) in its error, and the error's
            # text is kept in the flow's history and the turn's failure, and logged. The key may be
            # one LiteLLM read from the environment or its own settings, not api_key_provider's.
            secrets = _secrets(key, kwargs)
            delay = _retry_after_seconds(error)
            if secrets:
                _hide_secrets(error, secrets)
                text = _text_of(error)
                if any(secret in text for secret in secrets):  # an exception whose text comes from elsewhere
                    hidden = RuntimeError(f"{type(error).__name__}: {_hidden(text, secrets)}")
                    _ask_retry_after(hidden, delay)
                    raise hidden from None
            _ask_retry_after(error, delay)
            raise

    def _responses_base_setting(self) -> str | None:
        """The setting that sends Responses API calls to a server other than OpenAI's, or None: api_base,
        else what LiteLLM reads for an openai/ model without one, in its order."""
        if self.api_base is not None:
            return "api_base"
        if self.provider != "openai":
            return None
        if getattr(litellm, "api_base", None):
            return "litellm.api_base"
        return next((name for name in _OPENAI_BASE_VARIABLES if os.environ.get(name)), None)

    # The Responses API -------------------------------------------------------------------------

    async def _call_responses(
        self, request: ModelRequest, output: ModelOutputWriter, kwargs: dict[str, Any]
    ) -> ModelResponse:
        kwargs.update(input=self._responses_input(request.input), store=False, include=list(_RESPONSES_INCLUDE))
        if request.instructions:
            kwargs["instructions"] = request.instructions
        if request.tools:
            kwargs["tools"] = [_responses_tool(tool) for tool in request.tools]
            kwargs["tool_choice"] = _TOOL_CHOICES[request.tool_choice]
        stream: Any = await litellm.aresponses(**kwargs)
        final: Any = None
        done: dict[int, Any] = {}
        if _get(stream, "output") is not None:  # a provider path that answered without streaming
            final = stream
        else:
            async for event in stream:
                kind = _event_type(event)
                if kind in ("response.output_text.delta", "response.refusal.delta"):
                    output.write_text_delta(_utf8(str(_get(event, "delta") or "")))
                elif kind in ("response.reasoning_summary_text.delta", "response.reasoning_text.delta"):
                    output.write_reasoning_delta(_utf8(str(_get(event, "delta") or "")))
                elif kind == "response.output_item.done":
                    index = _get(event, "output_index")
                    done[index if isinstance(index, int) else len(done)] = _get(event, "item")
                elif kind in ("response.completed", "response.incomplete"):
                    final = _get(event, "response")
                elif kind in ("response.failed", "error"):
                    raise RuntimeError(f"the model call failed: {_failure_text(event)}")
        if final is None:
            raise RuntimeError("the Responses stream ended without response.completed")
        # The completed response lists every item; output_item.done events are the fallback.
        raw_items = list(_get(final, "output") or []) or [done[i] for i in sorted(done)]
        taken = _call_ids_in(request.input)
        # One name for the response's calls that come without an ID, as on Chat Completions.
        # (The provider's own ID: LiteLLM's wrapped one is base64, which may hold '/', refused in an ID.)
        response_name = _provider_response_id(_str_or_none(_get(final, "id"))) or _unnamed_response()
        items = tuple(_utf8_item(self._responses_item(_plain(raw), taken, f"call_{response_name}_{index}"))
                      for index, raw in enumerate(raw_items))
        usage = _get(final, "usage")
        details_in, details_out = _get(usage, "input_tokens_details"), _get(usage, "output_tokens_details")
        status = _get(final, "status")
        reason = _get(_get(final, "incomplete_details"), "reason")
        finish = reason if status == "incomplete" and isinstance(reason, str) else status
        return _with_an_answer(ModelResponse(
            items,
            AgentUsage(
                model_calls=1,
                input_tokens=_count(_get(usage, "input_tokens")),
                output_tokens=_count(_get(usage, "output_tokens")),
                cached_input_tokens=_count(_get(details_in, "cached_tokens")),
                reasoning_tokens=_count(_get(details_out, "reasoning_tokens")),
            ),
            ModelCallMetadata(
                request_model=self.model,
                response_model=_str_or_none(_get(final, "model")),
                provider_name=self.provider,
                response_id=_provider_response_id(_str_or_none(_get(final, "id"))),
                finish_reasons=(finish,) if isinstance(finish, str) else None,
            ),
        ))

    def _responses_input(self, entries: Sequence[ModelInputItem]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        unfollowed = self._unfollowed_reasoning(entries)
        for index, entry in enumerate(entries):
            if index in unfollowed:
                continue
            if isinstance(entry, UserTextInput):
                out.append({"role": "user", "content": entry.text})
            elif isinstance(entry, ToolResultInput):
                out.append({"type": "function_call_output", "call_id": entry.tool_call_id, "output": entry.output})
            elif entry.api == self.api_label:
                own = cast("dict[str, Any]", json.loads(entry.item))  # the provider's own item, unchanged
                if entry.tool_call is not None and own.get("type") == "function_call":
                    # Under the session's ID, which its output is sent under (the loop may have made it unique).
                    own["call_id"] = entry.tool_call.tool_call_id
                out.append(own)
            elif entry.kind is OutputItemKind.TOOL_CALL and entry.tool_call is not None:
                call = entry.tool_call
                out.append({"type": "function_call", "call_id": call.tool_call_id, "name": call.tool_name,
                            "arguments": _replayable_arguments(call.arguments)})
            elif entry.kind is OutputItemKind.TEXT and entry.text:
                out.append({"role": "assistant", "content": entry.text})
            # Reasoning of another provider or API is dropped: it cannot be verified here.
        return out

    def _unfollowed_reasoning(self, entries: Sequence[ModelInputItem]) -> set[int]:
        """The indexes of this API's reasoning items that no other output item of their response
        follows: a response cut off while reasoning (incomplete at max_output_tokens) has only
        those. OpenAI refuses a reasoning item without its following item, so replayed they failed
        every later model call of the session; they are left out, as another API's reasoning is."""
        unfollowed: set[int] = set()
        followed = False
        for index in range(len(entries) - 1, -1, -1):
            entry = entries[index]
            if not isinstance(entry, ModelOutputItem):
                followed = False  # a user text or tool result: the response before it ended there
            elif followed:
                continue
            elif entry.api == self.api_label and entry.kind is OutputItemKind.REASONING and _is_reasoning(entry.item):
                unfollowed.add(index)  # parsed only here, at a response's end: most items are not
            else:
                followed = True
        return unfollowed

    def _responses_item(self, raw: Any, taken: set[str], unnamed_call_id: str) -> ModelOutputItem:
        """One output item; a function call's ID made one `taken` does not hold (unique_call_id), and
        `unnamed_call_id` for a call that came without one (a server's empty call_id failed the turn)."""
        if not isinstance(raw, dict):
            raise TypeError(f"the provider returned an output item that is not an object: {raw!r}")
        kind = raw.get("type")
        if kind == "function_call":
            call_id = str(raw.get("call_id") or "")
            fresh = unique_call_id(call_id or str(raw.get("id") or "") or unnamed_call_id, taken)
            if fresh != call_id:
                raw = {**raw, "call_id": fresh}  # stored under it, so the replayed call and its output agree
            call = ModelToolCall(fresh, str(raw.get("name") or ""), _arguments_text(raw.get("arguments")))
            return ModelOutputItem(self.api_label, OutputItemKind.TOOL_CALL, _dump(raw), tool_call=call)
        text_json = _dump(raw)
        if kind == "message":
            parts = [p for p in raw.get("content") or [] if isinstance(p, dict)]
            text = "".join(str(p.get("text") or p.get("refusal") or "") for p in parts)
            return ModelOutputItem(self.api_label, OutputItemKind.TEXT, text_json, text=text)
        if kind == "reasoning":
            summary = [s.get("text") for s in raw.get("summary") or [] if isinstance(s, dict)]
            content = [c.get("text") for c in raw.get("content") or [] if isinstance(c, dict)]
            reasoning = "\n\n".join(str(t) for t in (summary or content) if t) or None
            return ModelOutputItem(self.api_label, OutputItemKind.REASONING, text_json, text=reasoning)
        # Any other item (a provider-side tool's record) is provider state like reasoning: replayed to the same
        # API, dropped for another.
        return ModelOutputItem(self.api_label, OutputItemKind.REASONING, text_json)

    # Chat Completions --------------------------------------------------------------------------

    async def _call_chat(
        self, request: ModelRequest, output: ModelOutputWriter, kwargs: dict[str, Any]
    ) -> ModelResponse:
        messages = self._chat_messages(request)
        # LiteLLM would put Gemini's thought signature (long base64, often with '/') into the tool call
        # ID, which the session refuses; off, the signature rides in provider_specific_fields, which the
        # stored item keeps and replays.
        kwargs.update(messages=messages, stream_options={"include_usage": True},
                      thought_signature_in_tool_call_id=False)
        if request.tools:
            kwargs["tools"] = [_chat_tool(tool) for tool in request.tools]
            kwargs["tool_choice"] = _TOOL_CHOICES[request.tool_choice]
        stream: Any = await litellm.acompletion(**kwargs)
        if _get(stream, "choices") is not None and not hasattr(stream, "__aiter__"):
            built: Any = stream  # a provider path that answered without streaming
        else:
            chunks: list[Any] = []
            async for chunk in stream:
                chunks.append(chunk)
                for choice in _get(chunk, "choices") or []:
                    delta = _get(choice, "delta")
                    reasoning = _get(delta, "reasoning_content")
                    if isinstance(reasoning, str):
                        output.write_reasoning_delta(_utf8(reasoning))
                    content = _get(delta, "content")
                    if isinstance(content, str):
                        output.write_text_delta(_utf8(content))
            _complete_streamed_tool_calls(chunks)
            built = litellm.stream_chunk_builder(chunks, messages=messages) if chunks else None
        if built is None or not _get(built, "choices"):
            raise RuntimeError("the Chat Completions stream ended without a response")
        choices = list(_get(built, "choices"))
        items = tuple(_utf8_item(item) for item in self._chat_items(_get(choices[0], "message"),
                                                                    _str_or_none(_get(built, "id")),
                                                                    _call_ids_in(request.input)))
        usage = _get(built, "usage")
        details_in, details_out = _get(usage, "prompt_tokens_details"), _get(usage, "completion_tokens_details")
        reasons = tuple(str(r) for r in (_get(c, "finish_reason") for c in choices) if r)
        return _with_an_answer(ModelResponse(
            items,
            AgentUsage(
                model_calls=1,
                input_tokens=_count(_get(usage, "prompt_tokens")),
                output_tokens=_count(_get(usage, "completion_tokens")),
                cached_input_tokens=_count(_get(details_in, "cached_tokens")),
                reasoning_tokens=_count(_get(details_out, "reasoning_tokens")),
            ),
            ModelCallMetadata(
                request_model=self.model,
                response_model=_str_or_none(_get(built, "model")),
                provider_name=self.provider,
                response_id=_str_or_none(_get(built, "id")),
                finish_reasons=reasons or None,
            ),
        ))

    def _chat_items(self, message: Any, response_id: str | None, taken: set[str]) -> tuple[ModelOutputItem, ...]:
        """The assistant message split into items: each item is the part of the message it stands for;
        each tool call's ID made one `taken` does not hold (unique_call_id)."""
        items: list[ModelOutputItem] = []
        reasoning: dict[str, Any] = {}
        blocks = _get(message, "thinking_blocks")
        if blocks:
            # Thinking blocks stay as the provider sent them, signature included, for an unchanged replay.
            reasoning["thinking_blocks"] = [_plain(block) for block in blocks]
        reasoning_text = _get(message, "reasoning_content")
        if isinstance(reasoning_text, str) and reasoning_text:
            reasoning["reasoning_content"] = reasoning_text
        if reasoning:
            text = reasoning_text if isinstance(reasoning_text, str) and reasoning_text else "".join(
                str(_get(b, "thinking") or "") for b in reasoning.get("thinking_blocks", [])
            )
            items.append(ModelOutputItem(self.api_label, OutputItemKind.REASONING,
                                         _dump({"role": "assistant", **reasoning}), text=text or None))
        content = _get(message, "content")
        if isinstance(content, str) and content:
            items.append(ModelOutputItem(self.api_label, OutputItemKind.TEXT,
                                         _dump({"role": "assistant", "content": content}), text=content))
        for index, raw_call in enumerate(_get(message, "tool_calls") or []):
            call = cast("dict[str, Any]", _plain(raw_call))
            call = {key: value for key, value in call.items() if value is not None}
            if not call.get("id"):
                response_id = response_id or _unnamed_response()  # one name for the response's calls
                call["id"] = f"call_{response_id}_{index}"
            call["id"] = unique_call_id(str(call["id"]), taken)  # stored under it, as the tool result is sent
            raw_function = call.get("function")
            function: dict[str, Any] = raw_function if isinstance(raw_function, dict) else {}
            if function.get("name") == _NAMELESS:
                function = call["function"] = {**function, "name": ""}  # stored as the provider sent it
            tool_call = ModelToolCall(str(call["id"]), str(function.get("name") or ""),
                                      _arguments_text(function.get("arguments")))
            items.append(ModelOutputItem(self.api_label, OutputItemKind.TOOL_CALL,
                                         _dump({"role": "assistant", "tool_calls": [call]}), tool_call=tool_call))
        return tuple(items)

    def _chat_messages(self, request: ModelRequest) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if request.instructions:
            messages.append({"role": "system", "content": request.instructions})
        group: list[ModelOutputItem] = []
        for entry in request.input:
            if isinstance(entry, ModelOutputItem):
                group.append(entry)
                continue
            self._flush_assistant(group, messages)
            if isinstance(entry, UserTextInput):
                messages.append({"role": "user", "content": entry.text})
            else:
                messages.append({"role": "tool", "tool_call_id": entry.tool_call_id, "content": entry.output})
        self._flush_assistant(group, messages)
        return messages

    def _flush_assistant(self, group: list[ModelOutputItem], messages: list[dict[str, Any]]) -> None:
        """One assistant message from consecutive output items: this API's as stored, others' text and calls."""
        if not group:
            return
        texts: list[str] = []
        calls: list[Any] = []
        blocks: list[Any] = []
        reasoning: list[str] = []
        extra: dict[str, Any] = {}
        for item in group:
            if item.api == self.api_label:
                raw = cast("dict[str, Any]", json.loads(item.item))
                for key, value in raw.items():
                    if key == "content" and isinstance(value, str):
                        texts.append(value)
                    elif key == "tool_calls" and isinstance(value, list):
                        own_calls = value
                        if item.tool_call is not None and len(value) == 1 and isinstance(value[0], dict):
                            # Under the session's ID, which its result is sent under (the loop may have
                            # made it unique).
                            own_calls = [{**value[0], "id": item.tool_call.tool_call_id}]
                        calls.extend(_with_replayable_arguments(call) for call in own_calls)
                    elif key == "thinking_blocks" and isinstance(value, list):
                        blocks.extend(value)
                    elif key == "reasoning_content" and isinstance(value, str):
                        reasoning.append(value)
                    elif key != "role":
                        extra.setdefault(key, value)
            elif item.kind is OutputItemKind.TOOL_CALL and item.tool_call is not None:
                call = item.tool_call
                calls.append({"id": call.tool_call_id, "type": "function", "function": {
                    "name": call.tool_name, "arguments": _replayable_arguments(call.arguments)}})
            elif item.kind is OutputItemKind.TEXT and item.text:
                texts.append(item.text)
        group.clear()
        if not texts and not calls and not blocks:
            return  # only reasoning of another provider: nothing to replay
        message: dict[str, Any] = {"role": "assistant", **extra, "content": "".join(texts) or None}
        if blocks:
            message["thinking_blocks"] = blocks
        if reasoning:
            message["reasoning_content"] = "".join(reasoning)
        if calls:
            message["tool_calls"] = calls
        messages.append(message)

    def _is_anthropic(self) -> bool:
        return self.provider == "anthropic" or "claude" in self.model.lower()


def _with_an_answer(response: ModelResponse) -> ModelResponse:
    """`response`, unless it holds no text and no tool call: then an error, so RunModel tries the call
    again. A stream with no choices, or only [DONE], or an empty message, ended the turn as answered
    with nothing to show and no error (LiteLLM fills in finish_reason "stop"). A response the token
    limit cut, or the provider's content filter stopped, is returned as it is: the runner tells the
    user about it, where a retry would pay for the same stop."""
    if token_limit_finish_reason(response.metadata) is not None or content_filter_finish_reason(response.metadata):
        return response
    if any(item.tool_call is not None or (item.kind is OutputItemKind.TEXT and item.text) for item in response.output):
        return response
    reasons = response.metadata.finish_reasons if response.metadata is not None else None
    said = f"finish_reason {', '.join(repr(r) for r in reasons)}" if reasons else "no finish_reason"
    only = f", only {len(response.output)} reasoning items" if response.output else ""
    raise RuntimeError(f"the model returned no output: no text and no tool call ({said}{only}); the model "
                       "call is tried again")


def _replayable_arguments(arguments: str) -> str:
    """A past call's arguments as a later request may carry them: "{}" for text that is not a JSON
    object (a response cut off mid-call). The session failed that call and the model has its result;
    LiteLLM's Anthropic, Bedrock and Gemini requests parse every past call's arguments and would
    refuse every later model call of the session."""
    try:
        parsed = json.loads(arguments)
    except (TypeError, ValueError):
        return "{}"
    return arguments if isinstance(parsed, dict) else "{}"


def _with_replayable_arguments(call: Any) -> Any:
    """A stored Chat Completions tool call with _replayable_arguments; anything else as it is."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or "arguments" not in function:
        return call
    arguments = function["arguments"]
    replayable = _replayable_arguments(arguments) if isinstance(arguments, str) else arguments
    return call if replayable is arguments else {**call, "function": {**function, "arguments": replayable}}


def _is_reasoning(item: str) -> bool:
    """Whether a stored Responses API item is a reasoning item (not a provider-side tool's record)."""
    try:
        raw = json.loads(item)
    except ValueError:
        return False
    return isinstance(raw, dict) and raw.get("type") == "reasoning"


# An environment variable whose name says it holds a credential: LiteLLM reads provider keys from
# such variables (OPENAI_API_KEY, ANTHROPIC_AUTH_TOKEN, AWS_SECRET_ACCESS_KEY, AZURE_AD_TOKEN, ...).
_SECRET_NAME: Final = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|CREDENTIAL", re.IGNORECASE)
# A request header that carries a credential (Authorization, x-api-key, Ocp-Apim-Subscription-Key, ...).
_SECRET_HEADER: Final = re.compile(r"AUTH|KEY|TOKEN|SECRET|PASSWORD|CREDENTIAL", re.IGNORECASE)
# A LiteLLM module setting that holds a key (litellm.api_key, litellm.openai_key, ...); its
# constants are upper case.
_LITELLM_SECRET_SETTING: Final = re.compile(r"[a-z0-9_]*(?:key|token|secret|password|credentials?)")


def _padded(key: str) -> bool:
    """Whether an API key has whitespace around it or a control character in it: sent, the HTTP
    client refuses the header."""
    return key != key.strip() or not key.isprintable()


def _name_letters(name: str) -> str:
    return re.sub(r"[^A-Z0-9]", "", name.upper())


def _padded_environment_keys(provider: str) -> list[str]:
    """The names of the credential variables LiteLLM may read `provider`'s key from (named for it:
    OPENAI_API_KEY, HOSTED_VLLM_API_KEY, ANTHROPIC_AUTH_TOKEN, TOGETHERAI_API_KEY, ...) whose value
    _padded; only names, never values, leave here."""
    prefix = _name_letters(provider)
    if not prefix:
        return []
    return sorted(name for name, value in os.environ.items()
                  if _SECRET_NAME.search(name) and _name_letters(name).startswith(prefix) and _padded(value))


def _secrets(key: str | None, kwargs: Mapping[str, Any]) -> list[str]:
    """Every credential the call may have sent, longest first (one may hold another): `key`, and the
    values LiteLLM may have read one from, and the credentials of the call's extra headers (a
    gateway's key), those of MIN_HIDDEN_ENVIRONMENT_SECRET_CHARS or more."""
    found = {key} if key else set()
    candidates = [value for name, value in os.environ.items() if _SECRET_NAME.search(name)]
    candidates += [value for name, value in list(vars(litellm).items())  # a copy: other threads set settings
                   if isinstance(value, str) and _LITELLM_SECRET_SETTING.fullmatch(name)]
    for option in ("extra_headers", "headers"):
        headers = kwargs.get(option)
        if not isinstance(headers, Mapping):
            continue
        for name, value in headers.items():
            if isinstance(name, str) and isinstance(value, str) and _SECRET_HEADER.search(name):
                # "Bearer <token>": a server may echo the token alone.
                candidates += [value, value.rsplit(" ", 1)[-1]]
    found.update(value for value in candidates if len(value) >= MIN_HIDDEN_ENVIRONMENT_SECRET_CHARS)
    return sorted(found, key=len, reverse=True)


def _hidden(text: str, secrets: Sequence[str]) -> str:
    for secret in secrets:
        text = text.replace(secret, "***")
    return text


def _hide_secrets(error: BaseException, secrets: Sequence[str]) -> None:
    """Write each of `secrets` as *** in the text of `error` and of the errors it was raised from: its
    args and the message attributes LiteLLM's and the OpenAI SDK's exceptions build their text from."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        current.args = tuple(_hidden(arg, secrets) if isinstance(arg, str) else arg for arg in current.args)
        for name in ("message", "litellm_debug_info"):
            value = getattr(current, name, None)
            if isinstance(value, str):
                hidden = _hidden(value, secrets)
                if hidden != value:
                    with contextlib.suppress(AttributeError, TypeError):
                        setattr(current, name, hidden)
        current = current.__cause__ or current.__context__


def _append_to_text(error: BaseException, addition: str) -> None:
    """Add `addition` to the text of `error`: its first arg and the message attribute LiteLLM's
    exceptions build their text from."""
    message = getattr(error, "message", None)
    if isinstance(message, str):
        with contextlib.suppress(AttributeError, TypeError):
            setattr(error, "message", message + addition)  # noqa: B010 - BaseException declares no message
    if error.args and isinstance(error.args[0], str):
        error.args = (error.args[0] + addition, *error.args[1:])


# Statuses whose Retry-After a rate-limited or overloaded provider sends for when to call again
# (RFC 9110 gives it to 503; 429 is a rate limit's own; 529 is Anthropic's "overloaded_error").
_RETRY_AFTER_STATUSES: Final = frozenset({429, 503, 529})
# A Retry-After (or retry-after-ms) in seconds, not an HTTP date: digits, perhaps a fraction. float()
# would also take "nan", "inf" and "1e9", which no provider means.
_DELAY_NUMBER: Final = re.compile(r"\d{1,12}(?:\.\d{1,6})?")


def _retry_after_seconds(error: BaseException) -> float | None:
    """How long a 429, 503 or 529 `error` asks to wait before the next call, from its response's
    `retry-after-ms` (OpenAI's, in milliseconds; taken first, as the OpenAI SDK does) or
    `Retry-After` (seconds, or an HTTP date), or None when it asks nothing readable."""
    # LiteLLM raises Anthropic's overloaded answer (529, or a 503 or 500 saying overloaded_error) as an
    # InternalServerError whose status_code is 500; the provider's status is its provider_status_code.
    status = getattr(error, "provider_status_code", None) or getattr(error, "status_code", None)
    if status not in _RETRY_AFTER_STATUSES and not isinstance(
            error, litellm.RateLimitError | litellm.ServiceUnavailableError):
        return None
    headers = _response_headers(error)
    milliseconds = headers.get("retry-after-ms", "").strip()
    if _DELAY_NUMBER.fullmatch(milliseconds):
        return float(milliseconds) / 1000
    text = headers.get("retry-after", "").strip()
    if _DELAY_NUMBER.fullmatch(text):
        return float(text)
    if not text:
        return None
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, OverflowError, IndexError):  # neither seconds nor a date: the policy applies
        return None
    if when.tzinfo is None:  # an HTTP date is in GMT; one written without a zone is read so
        when = when.replace(tzinfo=datetime.UTC)
    return max(0.0, (when - datetime.datetime.now(datetime.UTC)).total_seconds())


def _response_headers(error: BaseException) -> dict[str, str]:
    """The provider response's headers, names in lower case. LiteLLM keeps them on the error as
    `litellm_response_headers` (the response it attaches has none); else the response's own."""
    for found in (getattr(error, "litellm_response_headers", None),
                  getattr(getattr(error, "response", None), "headers", None), getattr(error, "headers", None)):
        items = getattr(found, "items", None)
        if not callable(items):
            continue
        headers = {str(name).lower(): value for name, value in items() if isinstance(value, str)}
        if headers:
            return headers
    return {}


def _ask_retry_after(error: BaseException, delay: float | None) -> None:
    """Have the engine start RunModel's next attempt no sooner than `delay` seconds from now: it
    reads `retry_after_seconds` on the raised error (as on dex_engine.RetryAfterError), which keeps
    its own type, so code that catches litellm.RateLimitError still does."""
    if delay:
        with contextlib.suppress(AttributeError, TypeError):
            setattr(error, "retry_after_seconds", delay)  # noqa: B010 - an attribute the error does not declare


def _text_of(error: BaseException) -> str:
    try:
        return f"{error} {error!r}"
    except Exception:  # an exception whose text cannot be made holds no key to show
        return ""


def _is_server_url(text: str) -> bool:
    """Whether `text` is an http:// or https:// URL with a host and nothing around it. LiteLLM takes
    any text as api_base and fails only at the call: "" sent a request to the provider's default
    server (api.openai.com for a hosted_vllm/ model), and a URL without its scheme, or with a space
    or a newline around it, failed every attempt with an InternalServerError naming only a path."""
    if _padded(text):
        return False
    try:
        parts = urllib.parse.urlsplit(text)
        host = parts.hostname
        _ = parts.port  # ValueError for a port that is not a number ("http://host:80OO")
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(host)


def _without_password(url: str) -> str:
    """`url` with *** for what comes before an @ in its host part (a gateway's user and password)."""
    return re.sub(r"^([^/]*//)?[^/@]*@", r"\1***@", url)


def _options_problem(options: object, where: str) -> str | None:
    """What is wrong with request options or model settings, or None. They become keyword arguments
    of every LiteLLM call: a name that is not text would fail each one with a bare TypeError."""
    if not isinstance(options, Mapping):
        return f"{where} must be a dict of LiteLLM options, got {shown(options, None)}"
    odd = [key for key in options if not isinstance(key, str) or not key]
    if odd:
        return f"{where} keys must be option names (text), got {', '.join(shown(key, None) for key in odd)}"
    reserved = sorted(key for key in options if key in _RESERVED_OPTIONS)
    if reserved:
        return (f"{where} may not set {', '.join(reserved)}: LiteLLMModelClient sets these itself, and "
                "credentials come from the environment or api_key_provider")
    return None


# Claude models that refuse a forced tool choice whatever the settings: Opus 5.5 and Sonnet 5.5, as
# Anthropic, Bedrock and Vertex AI name them (claude-opus-5-5..., anthropic.claude-sonnet-5-5..., 5.5).
_REFUSES_FORCED_TOOL_CHOICE = re.compile(r"claude-(?:opus|sonnet)-5[-.]5(?!\d)")


def _thinking_enabled(settings: Mapping[str, Any]) -> bool:
    """A `thinking` option that is not disabled, or a `reasoning_effort` other than "none"."""
    thinking = settings.get("thinking")
    disabled = thinking is None or thinking is False or (
        isinstance(thinking, Mapping) and thinking.get("type") == "disabled"
    )
    if not disabled:
        return True
    effort = settings.get("reasoning_effort")
    return effort is not None and effort != "none"


def _responses_tool(tool: ModelToolDefinition) -> dict[str, Any]:
    # strict=False: the Responses API would otherwise demand strict-mode schemas of every tool.
    return {"type": "function", "name": tool.name, "description": tool.description,
            "parameters": dict(tool.parameters_schema), "strict": False}


def _chat_tool(tool: ModelToolDefinition) -> dict[str, Any]:
    return {"type": "function", "function": {"name": tool.name, "description": tool.description,
                                             "parameters": dict(tool.parameters_schema)}}


def _utf8(text: str) -> str:
    """`text` as UTF-8 can hold it: a surrogate pair joined into its character, a lone surrogate as
    U+FFFD. Some servers send JSON escapes of lone surrogates (an emoji split between two chunks, or
    bytes they could not decode); stored, such text failed the turn after the model call was paid."""
    if text.isascii():
        return text
    try:
        text.encode()
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return text


def _utf8_item(item: ModelOutputItem) -> ModelOutputItem:
    """The item with its texts as _utf8 makes them (a joined text's pairs join as its parts' do)."""
    call = item.tool_call
    fixed_call = call if call is None else ModelToolCall(
        _utf8(call.tool_call_id), _utf8(call.tool_name), _utf8(call.arguments))
    fixed = ModelOutputItem(item.api, item.kind, _utf8(item.item), None if item.text is None else _utf8(item.text),
                            fixed_call)
    return item if fixed == item else fixed


def _str_or_none(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def _provider_response_id(response_id: str | None) -> str | None:
    """The provider's own response ID: LiteLLM wraps it as resp_<base64 of "litellm:...;response_id:<id>">."""
    if response_id is None or not response_id.startswith("resp_"):
        return response_id
    try:
        decoded = base64.b64decode(response_id.removeprefix("resp_"), validate=True).decode()
    except ValueError:  # binascii.Error and UnicodeDecodeError are ValueErrors: a provider's own ID
        return response_id
    marker = ";response_id:"
    if decoded.startswith("litellm:") and marker in decoded:
        return decoded.split(marker, 1)[1] or response_id
    return response_id


def _failure_text(event: object) -> str:
    error = _get(_get(event, "response"), "error") or event
    message = _get(error, "message")
    return str(message) if message else str(_plain(error))
