"""AgentSessionClient: start sessions and call the session RPCs through an engine AsyncClient."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from datetime import datetime
from enum import StrEnum
from typing import Any, TypeVar

from dex_engine import (
    DEFAULT_READ_LIMIT,
    AsyncClient,
    DexError,
    FlowConfig,
    RpcLockConflictError,
    StepDurability,
    StreamRead,
)

from ._constants import (
    LIST_MESSAGES_DEFAULT_LIMIT,
    RPC_LOCK_CONFLICT_FIRST_RETRY_INTERVAL,
    RPC_LOCK_CONFLICT_LONGEST_RETRY_INTERVAL,
    RPC_LOCK_CONFLICT_REFUSED_CHECK_AFTER,
    RPC_LOCK_CONFLICT_RETRY,
)
from ._policy import shown
from ._rpcs import answer_refused, resolve_refused
from ._runtime import now_utc
from ._session_flow import AgentSessionFlow
from ._session_settings import validate_session_settings
from ._turn_logic import storable_rejection_message
from ._wire import (
    AgentInterrupt,
    AgentMessagesPage,
    AgentSessionStartInput,
    AgentSnapshot,
    AgentUserMessage,
    AnswerQuestionRequest,
    CancelTurnRequest,
    DeleteQueuedMessageRequest,
    ExecutePlanRequest,
    JsonObject,
    ListAgentMessagesRequest,
    ResolveInterruptRequest,
    SteerUserMessageRequest,
    UpdateSessionSettingsRequest,
)

T = TypeVar("T")


class ActiveStepSearchMode(StrEnum):
    """Whether search_flows('ActiveStepTypes = "..."') finds a session by the Steps it waits in."""

    ENABLED = "enabled"
    DISABLED = "disabled"


# The mode AgentSessionClient.start_session uses, so sessions waiting for a person can be found.
AGENT_SESSION_ACTIVE_STEP_SEARCH_MODE = ActiveStepSearchMode.ENABLED


def agent_session_flow_config(
    mode: ActiveStepSearchMode = AGENT_SESSION_ACTIVE_STEP_SEARCH_MODE,
    step_durability: StepDurability = StepDurability.SYNC,
) -> FlowConfig:
    """The FlowConfig to pass to AsyncClient.start_flow(config_override=...) for a session."""
    if not isinstance(mode, ActiveStepSearchMode):
        raise ValueError(f"active_step_search_mode must be an ActiveStepSearchMode, got {shown(mode)}")
    if step_durability not in tuple(StepDurability):  # a member, or its text ("SYNC"), as FlowConfig takes
        raise ValueError(
            f"step_durability must be StepDurability.SYNC or StepDurability.ASYNC, got {shown(step_durability)}")
    return FlowConfig(active_step_search=mode is ActiveStepSearchMode.ENABLED, default_step_durability=step_durability)


def _check_text(name: str, value: object, *, optional: bool = False) -> None:
    """TypeError unless `value` is text (or None when `optional`). Checked here since the engine's
    JSON would take bytes as their base64 text: b"hi" would be sent as the message "aGk="."""
    if not isinstance(value, str) and not (optional and value is None):
        kind = "a str or None" if optional else "a str"
        raise TypeError(f"{name} must be {kind}, got {type(value).__name__}: {shown(value)}")


def _check_whole_number(name: str, value: object, *, optional: bool = False) -> None:
    """TypeError unless `value` is an int, not a bool (or None when `optional`). Checked here since
    the engine's JSON writes a NaN or an infinity as null: list_agent_messages(before_sequence=nan)
    was read as no before_sequence, and answered with the newest page."""
    if (not isinstance(value, int) or isinstance(value, bool)) and not (optional and value is None):
        kind = "a whole number (int) or None" if optional else "a whole number (int)"
        raise TypeError(f"{name} must be {kind}, got {type(value).__name__}: {shown(value)}")


def _check_flag(name: str, value: object) -> None:
    """TypeError unless `value` is a bool: the RPC would refuse anything else only after the call
    reached the session, naming a JSON path (`$.approved`) rather than this parameter."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool (True or False), got {type(value).__name__}: {shown(value)}")


class AgentSessionClient:
    """Typed calls to the sessions of one agent Flow type."""

    def __init__(self, client: AsyncClient, flow: AgentSessionFlow) -> None:
        # The blocking Client has the same method names, but its calls return results, not
        # awaitables: each call would commit, then fail, and a retry would commit it again. Checked
        # by the calls, not the class, so an async test double of AsyncClient still serves.
        if not inspect.iscoroutinefunction(getattr(client, "rpc", None)):
            raise TypeError(f"client must be a dex_engine.AsyncClient, got {type(client).__name__}, whose rpc "
                            "cannot be awaited; pass a dex_engine.AsyncClient")
        if not isinstance(flow, AgentSessionFlow):
            raise TypeError(f"flow must be an AgentSessionFlow, got {type(flow).__name__}")
        self.client = client
        self.flow = flow

    async def start_session(
        self,
        session_id: str,
        initial_message: str | None = None,
        *,
        session_settings: JsonObject | None = None,
        active_step_search_mode: ActiveStepSearchMode = AGENT_SESSION_ACTIVE_STEP_SEARCH_MODE,
        step_durability: StepDurability = StepDurability.SYNC,
    ) -> None:
        """Start a session; raises FlowAlreadyStartedError when the ID is taken.

        Settings the session would refuse are refused here, before anything is stored.
        """
        _check_text("initial_message", initial_message, optional=True)
        if session_settings is not None:
            validate_session_settings(session_settings)
        await self.client.start_flow(
            self.flow.flow_type, session_id,
            AgentSessionStartInput(initial_message=initial_message, session_settings=session_settings),
            config_override=agent_session_flow_config(active_step_search_mode, step_durability),
        )

    async def send_user_message(self, session_id: str, text: str, *, plan_mode: bool = False) -> bool:
        """Queue a message; False when blank, or for a plan_mode message while plan mode is off."""
        _check_text("text", text)
        _check_flag("plan_mode", plan_mode)
        result = await self.client.rpc(session_id, "send_user_message", AgentUserMessage(text, plan_mode))
        return bool(result)

    async def execute_plan(self, session_id: str, revision: int) -> bool:
        """Approve plan `revision` for execution. A concurrent approval's lock is retried for up to 5 s;
        once it commits, this approval finds an execution pending and returns False."""
        _check_whole_number("revision", revision)
        request = ExecutePlanRequest(revision)
        result = await self._retry_lock_conflicts(lambda: self.client.rpc(session_id, "execute_plan", request))
        return bool(result)

    async def update_session_settings(self, session_id: str, session_settings: JsonObject) -> bool:
        """Replace the settings the next turn starts with ({} clears); checked here before sending."""
        validate_session_settings(session_settings)
        result = await self.client.rpc(
            session_id, "update_session_settings", UpdateSessionSettingsRequest(session_settings)
        )
        return bool(result)

    async def resolve_interrupt(
        self, session_id: str, interrupt_id: str, approved: bool, rejection_message: str | None = None
    ) -> bool:
        """Approve or reject a pending interrupt; retries a lock held by a short Step for 5 s."""
        _check_text("interrupt_id", interrupt_id)
        _check_flag("approved", approved)
        _check_text("rejection_message", rejection_message, optional=True)
        # Cut here as the RPC would store it (dropped on approval): a reason over the engine's value
        # limit would otherwise make the request itself too large, and the rejection never reach the
        # session, although a longer message is documented to be kept cut.
        kept = None if approved is True else storable_rejection_message(rejection_message)
        request = ResolveInterruptRequest(interrupt_id, approved, kept)

        async def refused() -> bool:
            # Asked once the lock conflicts have lasted RPC_LOCK_CONFLICT_REFUSED_CHECK_AFTER, never on
            # the uncontended path: a resolve that can only return False (the interrupt resolved,
            # expired or unknown) need not wait out a fan-out's train of Steps holding PendingInterrupts.
            # get_agent_snapshot takes no lock. An interrupt's removal from PendingInterrupts is final
            # (its ID is never raised again), and a deadline once passed stays passed, so "refused" read
            # here is what the locked RPC would answer; "pending" proves nothing, so the locked RPC is
            # tried again.
            return await self._refused_now(session_id, interrupt_id,
                                           lambda interrupt, now: resolve_refused(interrupt, approved, now))

        result = await self._retry_lock_conflicts(
            lambda: self.client.rpc(session_id, "resolve_interrupt", request), refused=refused)
        return bool(result)

    async def answer_question(self, session_id: str, interrupt_id: str, answer: str) -> bool:
        """Answer a pending question; False when it is not pending, past its deadline, blank, or not one
        of its choices while it allows no free text. Retries a lock held by a short Step for 5 s."""
        _check_text("interrupt_id", interrupt_id)
        _check_text("answer", answer)
        request = AnswerQuestionRequest(interrupt_id, answer)

        async def refused() -> bool:
            # As resolve_interrupt's check, once only: an answer that can only
            # return False (the question answered, declined, expired or unknown, or the answer one it
            # refuses) need not wait out a fan-out's train of Steps holding PendingInterrupts. A
            # question's kind, choices and deadline never change while it is pending, so "refused"
            # read here is what the locked RPC would answer; "pending" proves nothing.
            return await self._refused_now(session_id, interrupt_id,
                                           lambda interrupt, now: answer_refused(interrupt, answer, now))

        result = await self._retry_lock_conflicts(
            lambda: self.client.rpc(session_id, "answer_question", request), refused=refused)
        return bool(result)

    async def steer_user_message(
        self, session_id: str, *, text: str | None = None, message_id: str | None = None
    ) -> bool:
        """Steer the running turn with new `text` or a queued message (`message_id` from
        AgentSnapshot.queued_messages); exactly one of the two.

        With no turn running, text is queued and a queued message stays queued (True). False for
        both or neither, blank text, a message no longer queued (also one the session consumed while
        the RPC ran: the engine reruns an RPC whose reads changed), or a turn that cannot be steered.
        """
        _check_text("text", text, optional=True)
        _check_text("message_id", message_id, optional=True)
        request = SteerUserMessageRequest(message_id=message_id, text=text)
        result = await self._retry_lock_conflicts(lambda: self.client.rpc(session_id, "steer_user_message", request))
        return bool(result)

    async def delete_queued_message(self, session_id: str, message_id: str) -> bool:
        """Delete a queued message (`message_id` from AgentSnapshot.queued_messages); False when it is
        no longer queued."""
        _check_text("message_id", message_id)
        request = DeleteQueuedMessageRequest(message_id)
        result = await self._retry_lock_conflicts(
            lambda: self.client.rpc(session_id, "delete_queued_message", request)
        )
        return bool(result)

    async def cancel_turn(self, session_id: str, turn_id: str | None = None) -> bool:
        """Stop the running turn (`turn_id` None: the active one) with no new turn.

        True when the request is recorded (again for a turn already cancelled); False when no turn
        is active, `turn_id` names another turn, or the turn cannot be cancelled. A model call that
        committed its final answer first still completes the turn. Retries a lock held by a short
        Step for 5 s.
        """
        _check_text("turn_id", turn_id, optional=True)
        request = CancelTurnRequest(turn_id)
        result = await self._retry_lock_conflicts(lambda: self.client.rpc(session_id, "cancel_turn", request))
        return bool(result)

    async def get_agent_snapshot(self, session_id: str) -> AgentSnapshot:
        snapshot: AgentSnapshot = await self.client.rpc(session_id, "get_agent_snapshot", None)
        return snapshot

    async def list_agent_messages(
        self, session_id: str, before_sequence: int | None = None, limit: int = LIST_MESSAGES_DEFAULT_LIMIT
    ) -> AgentMessagesPage:
        """A page of stored messages before `before_sequence` (None: the newest); the session clamps
        `limit` to 1..200."""
        _check_whole_number("before_sequence", before_sequence, optional=True)
        _check_whole_number("limit", limit)
        page: AgentMessagesPage = await self.client.rpc(
            session_id, "list_agent_messages", ListAgentMessagesRequest(before_sequence, limit)
        )
        return page

    async def read_agent_events(
        self, session_id: str, resume_token: str | None = None, *, wait_seconds: float = 0.0,
        limit: int = DEFAULT_READ_LIMIT,
    ) -> StreamRead:
        """AgentEvents after `resume_token`, long-polling up to `wait_seconds`."""
        return await self.client.read_stream(
            session_id, self.flow.agent_events, resume_token, wait_seconds=wait_seconds, limit=limit
        )

    async def _refused_now(
        self, session_id: str, interrupt_id: str, refused: Callable[[AgentInterrupt | None, datetime], bool],
    ) -> bool:
        """Whether `refused` (the RPC's own rule) says no for the interrupt as a lock-free snapshot shows
        it now (None: not pending); False when the snapshot cannot be read: the locked RPC reports its
        own errors."""
        try:
            snapshot = await self.get_agent_snapshot(session_id)
        except DexError:
            return False
        interrupt = next((i for i in snapshot.pending_interrupts if i.interrupt_id == interrupt_id), None)
        return refused(interrupt, now_utc())

    @staticmethod
    async def _retry_lock_conflicts(
        call: Callable[[], Awaitable[Any]], *, refused: Callable[[], Awaitable[bool]] | None = None
    ) -> Any:
        # The budget is per holder: approving a wide fan-out wakes a train of short Steps that take
        # the lock one after another (AwaitToolApproval-1, -2, ...), for longer in all than the
        # budget. A new holder is progress; only one holder that keeps the lock (a killed Worker's
        # claim) exhausts it.
        # `refused`, asked once the conflicts have lasted RPC_LOCK_CONFLICT_REFUSED_CHECK_AFTER, says
        # the call would return False without a change: it returns False without waiting for the
        # lock. Asked once only: in a wide fan-out, asking at each new holder read a whole snapshot
        # per holder for every pending resolve, whose answer ("pending") a later holder seldom changes.
        holder: str | None = None  # a conflict always names one: None only before the first
        tries = 0  # conflicts with this holder
        first_conflict = deadline = 0.0  # both set at the first conflict
        check = refused  # None once asked
        while True:
            try:
                return await call()
            except RpcLockConflictError as exc:
                now = time.monotonic()
                if holder is None:
                    first_conflict = now
                if exc.holder != holder:
                    holder, deadline, tries = exc.holder, now + RPC_LOCK_CONFLICT_RETRY.total_seconds(), 0
                elif now >= deadline:
                    raise
                if check is not None and refused_check_due(now - first_conflict):
                    ask, check = check, None
                    if await ask():
                        return False
                await asyncio.sleep(lock_retry_interval(tries))
                tries += 1


def lock_retry_interval(tries: int) -> float:
    """Seconds to wait before trying again after the `tries`-th (from 0) conflict with one holder:
    RPC_LOCK_CONFLICT_FIRST_RETRY_INTERVAL, doubled at each try up to the longest interval."""
    first = RPC_LOCK_CONFLICT_FIRST_RETRY_INTERVAL.total_seconds()
    longest = RPC_LOCK_CONFLICT_LONGEST_RETRY_INTERVAL.total_seconds()
    # Doubled at most 32 times: a bound no holder reaches in its 5 s, so a float never overflows.
    return min(first * (1 << min(tries, 32)), longest)


def refused_check_due(waited: float) -> bool:
    """Whether a call whose lock conflicts began `waited` seconds ago reads the lock-free snapshot."""
    return waited >= RPC_LOCK_CONFLICT_REFUSED_CHECK_AFTER.total_seconds()

