"""BuiltinLoopAgentRunner: one model call per RunModel, built from committed state only."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any, cast

import msgspec

from .._builtin_tools import BUILT_IN_TOOL_DEFINITIONS, BuiltInTool
from .._compaction import ContextSummaryRequest, ContextSummaryResult
from .._constants import MAX_CONSECUTIVE_TURN_CONTINUATIONS
from .._options import AgentSessionOptions
from .._plans import build_plan_note
from .._policy import (
    OUTCOME_UNKNOWN_TEXT,
    ToolPolicy,
    describe_tool_call_outcome,
    raised_text,
    shown,
    stricter_policy_problem,
)
from .._runner import (
    AgentTurnContext,
    AgentTurnOutcome,
    DeferredToolCall,
    DeferredToolExecution,
    FrameworkMessage,
    ModelCallMetadata,
    ToolCallsRequested,
    ToolCallStepOptions,
    ToolExecutionError,
    ToolExecutionResult,
    ToolOutcomeUnknownError,
    ToolTaskCancellation,
    ToolTaskPoll,
    ToolTaskPoller,
    ToolTaskPollOutcome,
    TurnCompleted,
    TurnContinued,
    polls_tool_tasks,
)
from .._runtime import resolved
from .._turn_logic import arguments_error, not_run_error
from .._wire import (
    AgentToolCall,
    AgentToolCallStatus,
    AgentUsage,
    InteractionMode,
    MessageRole,
    PlanStatus,
    ToolEffect,
)
from ._compaction import estimate_model_input, select_response_cutoff, summarize_with_model, with_summary_note
from ._definition import (
    AgentDefinition,
    ContinueTurn,
    InstructionContext,
    TurnContinuationContext,
    session_options_problems,
)
from ._function_tools import ToolCallContext
from ._items import (
    TOOL_RESULT,
    USER_TEXT,
    input_item,
    output_message,
    stored_output_item,
    stored_text,
    tool_result_message,
    user_message,
)
from ._model import (
    PROVIDER_TOOL_NAME_RULE,
    ModelClient,
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
    content_filter_finish_reason,
    is_provider_tool_name,
    returned_response,
    token_limit_finish_reason,
    unique_call_id,
)
from ._tool_sources import ToolSource, unwrap_source_reference, wrap_source_reference

log = logging.getLogger("dex_agents.builtin_loop")

TURN_CONTINUATION_LIMIT_ERROR = (
    f"the turn was continued more than {MAX_CONSECUTIVE_TURN_CONTINUATIONS} times in a row without a tool call"
)


class TurnContinuationError(ValueError):
    """decide_turn_continuation raised, or returned something other than a TurnContinuation."""


def model_call_limit_result(limit: int) -> str:
    return f"The tool call was not run: this turn reached its limit of {limit} model calls."


def unknown_tool_error(name: str) -> str:
    return f"unknown tool {name}"


def cut_tool_call_result(outcome: str, finish_reason: str) -> str:
    """The model-visible result of a call the session failed because the model's output was cut at
    its token limit mid-arguments: the plain "arguments must be a JSON object" told the model
    nothing it could fix, and it made the same call, cut again, until the turn's limits."""
    return (f"{outcome}; your output was cut at its token limit (finish_reason {finish_reason!r}) before this "
            "call's arguments were complete, so make the call again with shorter arguments, or split the work "
            "into smaller calls")


def filtered_answer_error(finish_reason: str) -> str:
    """The turn's error when the provider's content filter stopped the model's answer (kept as it is)."""
    return (f"the model provider's content filter stopped the model's output (finish_reason {finish_reason!r}), so "
            "its answer is incomplete or missing; rephrase the request, or review the provider's content filter "
            "settings")


def cut_answer_error(finish_reason: str) -> str:
    """The turn's error when the model's answer was cut at its token limit (the answer is stored)."""
    return (f"the model's output was cut at its token limit (finish_reason {finish_reason!r}), so its answer is "
            "incomplete or missing; raise the output token limit (max_output_tokens or max_tokens in the agent's "
            "model_settings), or ask for a shorter answer")


class _RunState(msgspec.Struct, frozen=True):
    """What the loop keeps between the Steps of a turn: everything else is in stored items."""

    model_calls: int = 0
    consecutive_continuations: int = 0
    # The calls of the last response that the model's token limit cut mid-arguments, and its finish
    # reason: their results, built in the next RunModel, say so (cut_tool_call_result).
    cut_tool_calls: tuple[str, ...] = ()
    cut_finish_reason: str | None = None


def _run_state(turn: AgentTurnContext) -> _RunState:
    if turn.framework_run_state is None:
        return _RunState()
    return msgspec.json.decode(turn.framework_run_state, type=_RunState)


def _encode(state: _RunState) -> str:
    return msgspec.json.encode(state).decode()


@dataclasses.dataclass(frozen=True)
class _Offered:
    """The tools one model call offers, and where each call of them goes."""

    definitions: tuple[ModelToolDefinition, ...]
    sources: dict[str, tuple[ToolSource, ModelToolDefinition]]


class BuiltinLoopAgentRunner:
    """The runner of the built-in loop: stores items as they appear, every tool call its own Step."""

    # A PlanModeRunner: a planning turn offers only write_todos, and every model call shows the plan note.
    supports_plan_mode = True

    def __init__(self, definition: AgentDefinition) -> None:
        if not isinstance(definition, AgentDefinition):
            raise TypeError(f"definition must be an AgentDefinition, got {type(definition).__name__}")
        self.definition = definition
        # What the synchronous estimate_input_tokens counts without I/O: the last instructions text
        # and each tool source's last listing.
        self._last_instructions: str | None = None
        self._listings: dict[str, tuple[ModelToolDefinition, ...]] = {}

    def session_options_problem(self, options: AgentSessionOptions) -> str | None:
        """What in `options` contradicts this runner's AgentDefinition, naming it first, or None
        (AgentSessionFlow asks when it is built)."""
        problems = session_options_problems(self.definition, options)
        return f"AgentDefinition {self.definition.name!r}: " + "; ".join(problems) if problems else None

    # The runner contract ------------------------------------------------------------------------

    def build_user_message(self, text: str) -> FrameworkMessage:
        return user_message(text)

    async def run_model_step(self, turn: AgentTurnContext) -> AgentTurnOutcome:
        definition = self.definition
        run = _run_state(turn)
        stored = [input_item(m) for m in turn.messages]
        pending = self._pending_results(turn, run)
        unstored: list[FrameworkMessage] = [tool_result_message(r) for r in pending]
        if pending:
            decision = await self._decide(turn, self._last_output(stored), pending)
            if decision == "end":
                return TurnCompleted(unstored, AgentUsage())
            if isinstance(decision, ContinueTurn):
                unstored.append(user_message(decision.message))
        model_input = _paired(with_summary_note(
            turn, _with_plan_note(turn, [*stored, *(input_item_of(m) for m in unstored)])))
        limit_reached = run.model_calls >= definition.max_model_calls_per_turn
        planning = turn.interaction_mode is InteractionMode.PLANNING
        if limit_reached:
            offered = _Offered((), {})
        elif planning:
            offered = _planning_tools(turn.enabled_built_in_tools)
        else:
            offered = await self._offered_tools(turn)
        request = ModelRequest(
            instructions=await self._instructions(turn), input=tuple(model_input), tools=offered.definitions,
            tool_choice=ToolChoice.NONE if limit_reached else self._tool_choice(turn, run, offered),
            model_settings=definition.model_settings, session_settings=turn.session_settings,
        )
        response = returned_response(await self._model(turn).call_model(request, ModelOutputWriter(turn.events)))
        outputs = _with_call_ids_unique_in_turn(list(response.output), turn)
        unstored.extend(output_message(item) for item in outputs)
        calls = [item.tool_call for item in outputs if item.kind is OutputItemKind.TOOL_CALL and item.tool_call]
        model_calls = run.model_calls + 1
        cut = token_limit_finish_reason(response.metadata)
        if calls and limit_reached:
            refused = model_call_limit_result(definition.max_model_calls_per_turn)
            unstored.extend(tool_result_message(ToolResultInput(c.tool_call_id, c.tool_name, refused)) for c in calls)
            return TurnCompleted(unstored, response.usage, response.metadata)
        if calls:
            deferred = [self._deferred(turn, call, offered) for call in calls]
            # The session fails a call whose arguments are not a JSON object; cut, its result says why.
            cut_calls = tuple(c.tool_call_id for c in calls if arguments_error(c.arguments) is not None) if cut else ()
            if cut_calls:
                log.warning("flow %s turn %s: the model's output was cut at its token limit (finish_reason %r) in "
                            "the arguments of tool call %s, which fails; raise max_output_tokens or max_tokens in "
                            "model_settings", turn.flow_id, turn.turn_id, cut, ", ".join(repr(c) for c in cut_calls))
            state = _encode(_RunState(model_calls=model_calls, cut_tool_calls=cut_calls,
                                      cut_finish_reason=cut if cut_calls else None))
            return ToolCallsRequested(state, deferred, response.usage, unstored, response.metadata)
        try:
            decision = await self._decide(turn, outputs, [])
        except TurnContinuationError as exc:
            # The answer is paid for: a retry would buy it again for the same broken hook, so the turn
            # fails here, with the answer stored.
            return TurnCompleted(unstored, response.usage, response.metadata, turn_error=str(exc))
        if isinstance(decision, ContinueTurn):
            if run.consecutive_continuations >= MAX_CONSECUTIVE_TURN_CONTINUATIONS:
                return TurnCompleted(unstored, response.usage, response.metadata,
                                     turn_error=TURN_CONTINUATION_LIMIT_ERROR)
            unstored.append(user_message(decision.message))
            state = _encode(_RunState(model_calls, run.consecutive_continuations + 1))
            return TurnContinued(state, unstored, response.usage, response.metadata)
        stopped = _stopped_answer_error(response.metadata)
        if stopped is not None:
            # Kept, as any paid answer is, but the turn fails so the user (and an operator's log) sees
            # it is incomplete: taken as a whole answer, it looked finished to everyone, and a retry
            # would be cut or filtered again, paid for again.
            log.warning("flow %s turn %s: %s", turn.flow_id, turn.turn_id, stopped)
            return TurnCompleted(unstored, response.usage, response.metadata, turn_error=stopped)
        return TurnCompleted(unstored, response.usage, response.metadata)

    def build_unfinished_turn_messages(self, turn: AgentTurnContext) -> Sequence[FrameworkMessage]:
        """A result for every stored tool call of the turn that has none yet (records, or unknown)."""
        answered = {m.tool_call_id for m in turn.messages if m.role is MessageRole.TOOL and m.turn_id == turn.turn_id}
        run = _run_state(turn)
        out: list[FrameworkMessage] = []
        for message in turn.messages:
            if message.turn_id != turn.turn_id or message.role is not MessageRole.ASSISTANT:
                continue
            call_id = message.tool_call_id
            if call_id is None or call_id in answered:
                continue
            record = turn.tool_calls.get(call_id)
            output = _model_visible_result(record, run) if record and record.status.is_final else OUTCOME_UNKNOWN_TEXT
            out.append(tool_result_message(ToolResultInput(call_id, message.tool_name or "", output)))
            answered.add(call_id)
        return out

    async def execute_deferred_tool_call(self, call: DeferredToolExecution) -> Any:
        record = call.tool_call
        source_ref = unwrap_source_reference(record.tool_source_reference)
        if source_ref is not None:
            source_name, reference = source_ref
            source = self.definition.tool_source(source_name)  # LookupError: the effect decides
            own = dataclasses.replace(call, tool_call=msgspec.structs.replace(record, tool_source_reference=reference),
                                      supports_tool_tasks=call.supports_tool_tasks and polls_tool_tasks(source))
            # resolved: a source's plain def has run the tool when it returns; awaiting its result would
            # fail the Step after the work, and a write would be recorded outcome_unknown.
            return await resolved(source.execute_deferred_tool_call(own))
        tool = self.definition.function_tool(record.tool_name)
        if tool is None:
            raise ToolExecutionError(unknown_tool_error(record.tool_name))
        # The call waited (an approval, a question) or was retried across a deploy that made its tool
        # stricter: not run, so the model calls it again and the new policy asks for what it needs.
        stricter = stricter_policy_problem(record, self.definition.function_tool_policy(record.tool_name))
        if stricter is not None:
            log.warning("flow %s turn %s: tool call %r was not run (attempt %d): %s", call.flow_id, record.turn_id,
                        record.tool_call_id, call.attempt, stricter)
            if call.attempt == 1:
                raise ToolExecutionError(not_run_error(stricter))
            # An earlier attempt ran the old tool: a read took no effect, an idempotent write may have.
            if record.effect is ToolEffect.IDEMPOTENT_WRITE:
                raise ToolOutcomeUnknownError(stricter)
            raise ToolExecutionError(stricter)
        context = ToolCallContext(
            idempotency_key=call.idempotency_key, attempt=call.attempt, flow_id=call.flow_id,
            turn_id=record.turn_id, tool_call_id=record.tool_call_id, events=call.events, heartbeat=call.heartbeat,
            input_answers=tuple(call.input_answers), input_continuation=record.input_continuation,
            effect=record.effect,
            heartbeat_checkpoint=call.heartbeat_checkpoint, save_heartbeat_checkpoint=call.save_heartbeat_checkpoint,
        )
        result = await tool.invoke(record.arguments, context)
        return ToolExecutionResult(result) if isinstance(result, str) else result

    # A source's calls: their tool tasks and tool Step options go to the source that built them ----

    async def poll_tool_task(self, poll: ToolTaskPoll) -> ToolTaskPollOutcome:
        """The source's poll_tool_task, with the call's own reference (seed 003 "Tool sources")."""
        found = self._source_of(poll.tool_call.tool_source_reference)
        if found is None or not polls_tool_tasks(found[0]):
            # The session asks _polls_tool_task_of first and records MISSING_TOOL_TASK_POLLER itself.
            raise LookupError(f"tool call {poll.tool_call.tool_call_id!r} ({poll.tool_call.tool_name}) "
                              "has no tool source that polls tasks")
        source, reference = found
        own = dataclasses.replace(poll, tool_call=msgspec.structs.replace(
            poll.tool_call, tool_source_reference=reference))
        outcome: ToolTaskPollOutcome = await resolved(cast(ToolTaskPoller, source).poll_tool_task(own))
        return outcome

    def _polls_tool_task_of(self, record: AgentToolCall) -> bool:
        """Whether poll_tool_task can poll `record`'s task (read by polls_tool_tasks): a subclass that
        overrides poll_tool_task polls its own tools' tasks; this class polls only for a source with
        poll_tool_task. A source this Worker lacks answers True, so the poll raises LookupError as
        its execution would, and the effect decides."""
        if type(self).poll_tool_task is not BuiltinLoopAgentRunner.poll_tool_task:
            return True
        try:
            found = self._source_of(record.tool_source_reference)
        except LookupError:
            return True
        return found is not None and polls_tool_tasks(found[0])

    async def cancel_tool_task(self, cancellation: ToolTaskCancellation) -> None:
        """The source's cancel_tool_task, when it has one; nothing else can stop the task."""
        found = self._source_of(cancellation.tool_call.tool_source_reference)
        cancel = None if found is None else getattr(found[0], "cancel_tool_task", None)
        if found is not None and callable(cancel):
            own = dataclasses.replace(cancellation, tool_call=msgspec.structs.replace(
                cancellation.tool_call, tool_source_reference=found[1]))
            await resolved(cancel(own))

    def tool_call_step_options(self, call: DeferredToolCall) -> ToolCallStepOptions | None:
        """The source's tool_call_step_options (an operation's timeout and retry, say), when it has one."""
        try:
            found = self._source_of(call.tool_source_reference)
        except LookupError:
            return None  # a source this Worker lacks: its tool Step raises LookupError, and the effect decides
        provide = None if found is None else getattr(found[0], "tool_call_step_options", None)
        if found is None or not callable(provide):
            return None
        chosen: ToolCallStepOptions | None = provide(dataclasses.replace(call, tool_source_reference=found[1]))
        return chosen

    def _source_of(self, stored_reference: str | None) -> tuple[ToolSource, str | None] | None:
        """The source a stored call's reference names, and the source's own reference; None for a
        call no source built. LookupError for a source this Worker does not have."""
        stored = unwrap_source_reference(stored_reference)
        if stored is None:
            return None
        return self.definition.tool_source(stored[0]), stored[1]

    # Compaction (ContextCompactionRunner; _compaction.py) ----------------------------------------

    def estimate_input_tokens(self, turn: AgentTurnContext) -> int:
        """The next model request as run_model_step builds it, estimated by the model client. Synchronous:
        an async instructions function counts its last text, a tool source its cached_tools() or last listing."""
        stored = [input_item(m) for m in turn.messages]
        pending = self._pending_results(turn, _run_state(turn))
        model_input = _paired(with_summary_note(turn, _with_plan_note(turn, [*stored, *pending])))
        request = ModelRequest(
            instructions=self._instructions_now(turn), input=tuple(model_input),
            tools=self._known_tools(turn.enabled_built_in_tools),
            model_settings=self.definition.model_settings, session_settings=turn.session_settings,
        )
        return estimate_model_input(self._model(turn), request)

    def select_compaction_cutoff(self, turn: AgentTurnContext, retained_token_budget: int) -> int | None:
        """Cuts only between model responses whose tool calls all have stored results."""
        return select_response_cutoff(turn, retained_token_budget)

    async def summarize_context(self, request: ContextSummaryRequest) -> ContextSummaryResult:
        """One model call with CONTEXT_SUMMARY_INSTRUCTIONS and no tools."""
        model = self._model_for(request.session_settings)
        return await summarize_with_model(request, self.definition.model_settings, model)

    def _instructions_now(self, turn: AgentTurnContext) -> str | None:
        instructions = self.definition.instructions
        if isinstance(instructions, str):
            return instructions or None
        value = instructions(InstructionContext(turn.flow_id, turn.turn_id, dict(turn.session_settings),
                                                turn.interaction_mode))
        if inspect.iscoroutine(value):
            value.close()  # cannot await here: count the last text it returned
            return self._last_instructions
        return value if isinstance(value, str) else self._last_instructions

    def _known_tools(self, built_ins: frozenset[str]) -> tuple[ModelToolDefinition, ...]:
        definitions = [t.definition() for t in self.definition.tools]
        for source in self.definition.tool_sources:
            cached = getattr(source, "cached_tools", None)
            listed = cached() if callable(cached) else None
            definitions.extend(self._listings.get(source.source_name, ()) if listed is None else listed)
        for built_in in BuiltInTool:
            if built_in.value in built_ins:
                built = BUILT_IN_TOOL_DEFINITIONS[built_in]
                definitions.append(ModelToolDefinition(built.name, built.description, built.parameters_schema))
        return tuple(definitions)

    # Helpers -----------------------------------------------------------------------------------

    def _model(self, turn: AgentTurnContext) -> ModelClient:
        return self._model_for(turn.session_settings)

    def _model_for(self, session_settings: Mapping[str, Any]) -> ModelClient:
        resolve = self.definition.resolve_model
        if resolve is None:
            return self.definition.model
        model = resolve(dict(session_settings))
        if not callable(getattr(model, "call_model", None)):
            raise TypeError(f"resolve_model returned {type(model).__name__}, not a ModelClient")
        return model

    async def _instructions(self, turn: AgentTurnContext) -> str | None:
        instructions = self.definition.instructions
        if isinstance(instructions, str):
            return instructions or None
        value = instructions(InstructionContext(turn.flow_id, turn.turn_id, dict(turn.session_settings),
                                                turn.interaction_mode))
        if inspect.isawaitable(value):
            value = await value
        if not isinstance(value, str):
            raise TypeError(f"the instructions function returned {type(value).__name__}, not text")
        self._last_instructions = value
        return value or None

    def _tool_choice(self, turn: AgentTurnContext, run: _RunState, offered: _Offered) -> ToolChoice:
        """auto, or required on a planning turn's first model call while no draft exists (planning_tool_choice)."""
        forced = (
            self.definition.planning_tool_choice == "required"
            and turn.interaction_mode is InteractionMode.PLANNING
            and run.model_calls == 0
            and not (turn.plan is not None and turn.plan.status is PlanStatus.DRAFT)
            and bool(offered.definitions)
        )
        return ToolChoice.REQUIRED if forced else ToolChoice.AUTO

    @staticmethod
    def _pending_results(turn: AgentTurnContext, run: _RunState) -> list[ToolResultInput]:
        """Results of the previous response's calls: final records whose results are not stored yet."""
        stored = {m.tool_call_id for m in turn.messages if m.role is MessageRole.TOOL and m.turn_id == turn.turn_id}
        records = sorted(turn.tool_calls.values(), key=lambda r: r.deferral_order)
        # After compaction, a call the summary holds has its result there too: only visible calls count.
        visible = None if turn.context_summary is None else {
            m.tool_call_id for m in turn.messages if m.role is MessageRole.ASSISTANT and m.turn_id == turn.turn_id
        }
        return [
            ToolResultInput(r.tool_call_id, r.tool_name, _model_visible_result(r, run))
            for r in records
            if r.tool_call_id not in stored and r.status.is_final and (visible is None or r.tool_call_id in visible)
        ]

    @staticmethod
    def _last_output(stored: list[ModelInputItem]) -> list[ModelOutputItem]:
        """The items of the last model response in the stored input."""
        out: list[ModelOutputItem] = []
        for entry in reversed(stored):
            if isinstance(entry, ModelOutputItem):
                out.append(entry)
            elif out:
                break
        return out[::-1]

    async def _decide(
        self, turn: AgentTurnContext, outputs: Sequence[ModelOutputItem], results: Sequence[ToolResultInput]
    ) -> str | ContinueTurn:
        hook = self.definition.decide_turn_continuation
        if hook is None:
            return "default"
        try:
            value: Any = hook(TurnContinuationContext(turn.flow_id, turn.turn_id, dict(turn.session_settings),
                                                      tuple(outputs), tuple(results)))
            if inspect.isawaitable(value):
                value = await value
        except Exception as exc:
            raise TurnContinuationError(f"decide_turn_continuation raised {raised_text(exc)}") from exc
        if isinstance(value, ContinueTurn):
            if not isinstance(value.message, str) or not value.message.strip():
                raise TurnContinuationError("decide_turn_continuation returned ContinueTurn with a blank message")
            return value
        if value in ("end", "default"):
            return str(value)
        raise TurnContinuationError(
            f"decide_turn_continuation returned {shown(value)}; return 'end', 'default' or ContinueTurn")

    async def _offered_tools(self, turn: AgentTurnContext) -> _Offered:
        """Function tools, then each source's listing, then the enabled built-in tools."""
        definition = self.definition
        built_ins = turn.enabled_built_in_tools
        definitions = [t.definition() for t in definition.tools]
        function_names = {d.name for d in definitions}
        for name in sorted(function_names & built_ins):
            # Only the session options enable it: AgentSessionFlow refuses the clash (session_options_problems);
            # this holds for a runner built into a Flow some other way.
            raise ValueError(f"tool {name} uses the name of an enabled built-in tool")
        sources: dict[str, tuple[ToolSource, ModelToolDefinition]] = {}
        timeout = definition.tool_source_listing_timeout.total_seconds()
        # All at once: a down server costs the call one listing timeout, not one per source. In a
        # TaskGroup, so that a listing raising past _listing (KeyboardInterrupt, say) or the Step's
        # cancellation ends the others too.
        listings: list[tuple[ModelToolDefinition, ...] | None] = []
        if definition.tool_sources:  # most agents have none: no task group per model call for them
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(_listing(source, timeout, turn)) for source in definition.tool_sources]
            listings = [task.result() for task in tasks]
        for source, listed in zip(definition.tool_sources, listings, strict=True):
            if listed is None:
                continue
            self._listings[source.source_name] = listed
            for tool in listed:
                if tool.name in function_names:
                    raise ValueError(f"tool {tool.name} of a tool source uses the name of a function tool")
                if tool.name in sources:
                    if sources[tool.name][0] is source:
                        raise ValueError(f"tool source {source.source_name!r} lists a tool named {tool.name} "
                                         "more than once")
                    raise ValueError(f"two tool sources list a tool named {tool.name}")
                if tool.name in built_ins:
                    raise ValueError(f"tool {tool.name} uses the name of an enabled built-in tool")
                sources[tool.name] = (source, tool)
                definitions.append(tool)
        for built_in in BuiltInTool:
            if built_in.value in built_ins:
                built = BUILT_IN_TOOL_DEFINITIONS[built_in]
                definitions.append(ModelToolDefinition(built.name, built.description, built.parameters_schema))
        return _Offered(tuple(definitions), sources)

    def _deferred(self, turn: AgentTurnContext, call: ModelToolCall, offered: _Offered) -> DeferredToolCall:
        listed = offered.sources.get(call.tool_name)
        if listed is not None:
            source, tool = listed
            built = _source_call(source, call, tool, turn)
            if built is not None:
                return dataclasses.replace(
                    built, tool_source_reference=wrap_source_reference(source.source_name, built.tool_source_reference)
                )
            # Like a tool no listing offered: it fails as unknown and never reaches the source.
            return DeferredToolCall(call.tool_call_id, call.tool_name, call.arguments,
                                    ToolPolicy(ToolEffect.UNCLASSIFIED, requires_approval=False))
        if call.tool_name in turn.enabled_built_in_tools:
            policy = ToolPolicy(ToolEffect.READ, requires_approval=False)  # the session routes it itself
        elif self.definition.function_tool(call.tool_name) is not None:
            policy = turn.resolve_tool_policy(call.tool_name)
        else:
            # A name no listing offered never reaches a source: it fails as unknown, without approval.
            policy = ToolPolicy(ToolEffect.UNCLASSIFIED, requires_approval=False)
        return DeferredToolCall(call.tool_call_id, call.tool_name, call.arguments, policy)


def _stopped_answer_error(metadata: ModelCallMetadata | None) -> str | None:
    """The turn's error for an answer the token limit cut or the provider's content filter stopped,
    or None for a whole one."""
    cut = token_limit_finish_reason(metadata)
    if cut is not None:
        return cut_answer_error(cut)
    filtered = content_filter_finish_reason(metadata)
    return None if filtered is None else filtered_answer_error(filtered)


def _model_visible_result(record: AgentToolCall, run: _RunState) -> str:
    """describe_tool_call_outcome, saying so for a failed call that the token limit cut."""
    outcome = describe_tool_call_outcome(record)
    if (run.cut_finish_reason is not None and record.status is AgentToolCallStatus.FAILED
            and record.tool_call_id in run.cut_tool_calls):
        return cut_tool_call_result(outcome, run.cut_finish_reason)
    return outcome


def _source_call(
    source: ToolSource, call: ModelToolCall, listed_tool: ModelToolDefinition, turn: AgentTurnContext
) -> DeferredToolCall | None:
    """The source's DeferredToolCall for `call`; None, with a warning, when deferred_tool_call raises or
    returns something else, a reference that is not text, or another tool call ID. The model call is
    paid for already: an error here would fail the RunModel attempt and make it again on each retry,
    and a reference that is not text would reach the source as None at execution, perhaps naming
    another operation."""
    try:
        built: object = source.deferred_tool_call(call, listed_tool, turn)
    except Exception as exc:
        problem = f"deferred_tool_call raised {raised_text(exc)}"
    else:
        reference: object = getattr(built, "tool_source_reference", None)
        if not isinstance(built, DeferredToolCall):
            if inspect.iscoroutine(built):
                built.close()  # an async deferred_tool_call: never awaited, closed to avoid a warning
            problem = f"deferred_tool_call returned {shown(built)}, not a DeferredToolCall"
        elif reference is not None and not isinstance(reference, str):
            problem = f"deferred_tool_call returned tool_source_reference {shown(reference)}, not text"
        elif built.tool_call_id != call.tool_call_id:
            # Its result would be stored apart from the model's call, which would be told the outcome is unknown.
            problem = (f"deferred_tool_call returned tool_call_id {shown(built.tool_call_id)}, not the model's "
                       f"{shown(call.tool_call_id)}")
        else:
            return built
    log.warning("flow %s turn %s: tool source %r could not build tool call %r (%s), which fails as an unknown "
                "tool: %s", turn.flow_id, turn.turn_id, source.source_name, call.tool_call_id, call.tool_name, problem)
    return None


async def _listing(
    source: ToolSource, timeout: float, turn: AgentTurnContext
) -> tuple[ModelToolDefinition, ...] | None:
    """The source's tools, each one that is not a well-formed definition left out; None when the
    listing raised or timed out: a down or broken server offers no tools, it never fails the turn.
    Each warning names `turn`'s flow: the model call of which session went without the tools."""
    try:
        # resolved: a source's plain def list_tools returns the listing itself.
        listed = list(await asyncio.wait_for(resolved(source.list_tools()), timeout))
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise  # the Step itself is cancelled
        # A client library's own cancellation (an MCP client whose server died, say) is a failure.
        log.warning("flow %s turn %s: tool source %r was cancelled while listing; it offers no tools in this "
                    "model call", turn.flow_id, turn.turn_id, source.source_name, exc_info=True)
        return None
    except Exception:
        log.warning("flow %s turn %s: tool source %r could not be listed; it offers no tools in this model call",
                    turn.flow_id, turn.turn_id, source.source_name, exc_info=True)
        return None
    kept: list[ModelToolDefinition] = []
    for tool in listed:
        problem = listed_tool_problem(tool)
        if problem is None:
            kept.append(tool)
        else:
            log.warning("flow %s turn %s: tool source %r listed a tool the model cannot be offered, left out: %s",
                        turn.flow_id, turn.turn_id, source.source_name, problem)
    return tuple(kept)


def listed_tool_problem(tool: object) -> str | None:
    """What makes a listed tool unfit to offer a model, or None."""
    if not isinstance(tool, ModelToolDefinition):
        return f"{shown(tool)} is not a ModelToolDefinition"
    name: object = tool.name
    if not is_provider_tool_name(name):
        # Offered, it would make the provider refuse every request of the turn.
        return f"tool name {shown(name)} is not one providers accept: {PROVIDER_TOOL_NAME_RULE}"
    description: object = tool.description
    if not isinstance(description, str):
        return f"tool {name}'s description is {shown(description)}, not text"
    schema: object = tool.parameters_schema
    if not isinstance(schema, Mapping):
        return f"tool {name}'s parameters_schema is {shown(schema)}, not a JSON Schema object"
    return None


def _planning_tools(built_ins: frozenset[str]) -> _Offered:
    """A planning turn offers only write_todos (when enabled; plan mode needs it)."""
    if BuiltInTool.WRITE_TODOS.value not in built_ins:
        return _Offered((), {})
    built = BUILT_IN_TOOL_DEFINITIONS[BuiltInTool.WRITE_TODOS]
    return _Offered((ModelToolDefinition(built.name, built.description, built.parameters_schema),), {})


def _with_plan_note(turn: AgentTurnContext, items: list[ModelInputItem]) -> list[ModelInputItem]:
    """The input with build_plan_note as user text right before the turn's items (its first stored
    message), so every model call of the turn sees the latest committed plan."""
    note = build_plan_note(turn.plan, turn.interaction_mode)
    if note is None:
        return items
    at = next((i for i, m in enumerate(turn.messages) if m.turn_id == turn.turn_id), len(turn.messages))
    return [*items[:at], UserTextInput(note), *items[at:]]


def input_item_of(message: FrameworkMessage) -> ModelInputItem:
    """The model input item of a message not stored yet."""
    raw = json.loads(message.framework_item)
    if raw["type"] == TOOL_RESULT:
        return ToolResultInput(raw["tool_call_id"], raw["tool_name"], stored_text(raw, "output", message.tool_output))
    if raw["type"] == USER_TEXT:
        return UserTextInput(stored_text(raw, "text", message.text))
    return stored_output_item(raw, message.text, message.tool_arguments)


def _with_call_ids_unique_in_turn(outputs: list[ModelOutputItem], turn: AgentTurnContext) -> list[ModelOutputItem]:
    """`outputs`, with a tool call whose ID a call of this turn, or an earlier call of the response,
    already has under its own (unique_call_id); its item keeps the provider's JSON. A client sees
    only the request's input, which lacks the turn's calls a compaction within the turn summarized,
    so a server numbering each response's calls from call_0 failed a long turn once it compacted
    ("repeats within this turn"), however its client made IDs unique. A client that replays its own
    items must send a call under its ModelToolCall's ID, as LiteLLMModelClient does."""
    taken = {r.tool_call_id for r in turn.tool_calls.values() if r.turn_id == turn.turn_id}
    out: list[ModelOutputItem] = []
    for item in outputs:
        call = item.tool_call if isinstance(item, ModelOutputItem) else None
        fresh = None
        if call is not None and isinstance(call.tool_call_id, str) and call.tool_call_id:
            fresh = unique_call_id(call.tool_call_id, taken)
        if call is None or fresh is None or fresh == call.tool_call_id:
            out.append(item)
        else:
            out.append(dataclasses.replace(item, tool_call=dataclasses.replace(call, tool_call_id=fresh)))
    return out


def _paired(items: list[ModelInputItem]) -> list[ModelInputItem]:
    """Every tool call followed by a result: a missing one becomes the outcome-unknown text."""
    out: list[ModelInputItem] = []
    open_calls: dict[str, str] = {}

    def close() -> None:
        for call_id, name in open_calls.items():
            out.append(ToolResultInput(call_id, name, OUTCOME_UNKNOWN_TEXT))
        open_calls.clear()

    for index, entry in enumerate(items):
        if isinstance(entry, ModelOutputItem):
            previous = items[index - 1] if index else None
            if not isinstance(previous, ModelOutputItem):
                close()
            if entry.tool_call is not None:
                open_calls[entry.tool_call.tool_call_id] = entry.tool_call.tool_name
        elif isinstance(entry, ToolResultInput):
            if entry.tool_call_id not in open_calls:
                continue  # a result without its call would be refused by providers
            del open_calls[entry.tool_call_id]
        else:
            close()
        out.append(entry)
    close()
    return out

