"""Records that cross the store interface: what a claim hands out and what a commit carries."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal

import msgspec

from ._options import FlowConfig, LoadSpec, TaskOptions
from ._wait import WaitSpec


class AttemptProgress(StrEnum):
    """How far a Step method's attempts got: NOT_STARTED when none ever started (E3)."""

    NOT_STARTED = "NOT_STARTED"
    NOT_COMPLETED = "NOT_COMPLETED"


class ErrorInfo(msgspec.Struct, frozen=True):
    error_type: str
    detail: str


class RecoveryError(msgspec.Struct, frozen=True):
    """What a failure-route Step receives about the Step that failed."""

    step_type: str
    step_execution_id: str
    method: Literal["wait_for", "execute"]
    attempts: int
    attempt_progress: AttemptProgress
    error_type: str
    detail: str


class ConsumedMessage(msgspec.Struct, frozen=True, array_like=True):
    message_id: int
    value: msgspec.Raw


class WaitOutcome(msgspec.Struct, frozen=True, omit_defaults=True):
    """Which conditions of a wait were satisfied, and the messages each consumed."""

    satisfied: tuple[int, ...] = ()
    consumed: tuple[tuple[ConsumedMessage, ...], ...] = ()  # aligned with the conditions
    fired_timers: tuple[int, ...] = ()
    skipped: bool = False


@dataclass
class WriteSet:
    """Buffered changes of one WaitFor, Execute or RPC, committed atomically (E1)."""

    attributes: dict[tuple[str, str], bytes | None] = field(default_factory=dict)
    publishes: list[tuple[str, str, bytes]] = field(default_factory=list)
    appends: list[tuple[str, int, bytes]] = field(default_factory=list)  # stream, capacity, value
    deleted_messages: list[tuple[str, str, int]] = field(default_factory=list)

    def empty(self) -> bool:
        return not (self.attributes or self.publishes or self.appends or self.deleted_messages)


class MovementRecord(msgspec.Struct, frozen=True):
    step_type: str
    input: bytes
    options: TaskOptions
    # The Step's wait, when the worker evaluated its WaitFor before the commit that starts it, on
    # `wait_loaded`: the attributes the WaitFor loads as that commit leaves them, worked out from
    # the committing method's snapshot and writes. The commit registers the wait only if the rows
    # it reads for the WaitFor's load options are exactly those; else the WaitFor runs as usual.
    wait: WaitSpec | None = None
    wait_loaded: tuple[tuple[str, str, bytes], ...] = ()


class RetryWaitEnding(msgspec.Struct, frozen=True):
    """Step types whose executions waiting for a retry an RPC ends now, and why (RPCResult)."""

    step_types: tuple[str, ...]
    reason: str


class DecisionRecord(msgspec.Struct, frozen=True):
    kind: Literal["movements", "dead_end", "graceful_complete", "force_complete", "force_fail"]
    movements: tuple[MovementRecord, ...] = ()
    output: bytes | None = None
    reason: str = ""
    canceling_steps: tuple[str, ...] = ()


@dataclass(frozen=True)
class Lease:
    """One claimed attempt of one Step method; every write under it is fenced by `lease_epoch`."""

    task_id: int
    lease_epoch: int
    flow_id: str
    flow_type: str
    step_type: str
    step_execution_id: str
    method: Literal["wait_for", "execute"]
    attempt: int
    input: bytes
    options: TaskOptions
    load: LoadSpec
    attributes: dict[tuple[str, str], bytes]
    checkpoint: str | None
    wait_spec: WaitSpec | None
    wait_outcome: WaitOutcome | None
    recovery_error: RecoveryError | None
    # Set when the claiming commit already ran the handler up to its first heartbeat and recorded
    # that heartbeat (Step.pure_until_heartbeat): the worker resumes the handler instead of calling it.
    started: StartedFold | None = field(default=None, compare=False)

    @property
    def durable(self) -> bool:
        return self.options.durability != "ASYNC"


@dataclass(eq=False)
class StartedFold:
    """A handler run inside the commit that claimed its attempt, up to its first heartbeat
    (Step.pure_until_heartbeat). That commit records the heartbeat with `checkpoint` and, before it,
    the best-effort `events` (stream, capacity, value) the handler wrote; the worker then resumes
    the handler from `resume`. `close` drops the suspended handler when the commit does not record it."""

    checkpoint: str | None
    events: list[tuple[str, int, bytes]]
    resume: object
    close: Callable[[], None]


@dataclass(frozen=True)
class RpcSnapshot:
    flow_type: str
    version: int
    # The flow's created_at: versions count from the start again in a flow deleted and started
    # again under its ID, so the version alone does not tell the old flow from the new one.
    started_ms: int
    attributes: dict[tuple[str, str], bytes]
    pending: dict[tuple[str, str], list[tuple[int, bytes]]]
    # Messages a satisfied wait took whose Step's Execute has not committed, by channel instance.
    in_flight: dict[tuple[str, str], list[tuple[int, bytes]]] = field(default_factory=dict)


@dataclass(frozen=True)
class RpcOutcome:
    """What one run of an RPC handler returned and would commit."""

    output: Any
    writes: WriteSet
    records: list[MovementRecord]
    canceling: tuple[str, ...]
    ending: RetryWaitEnding | None

    def writes_nothing(self) -> bool:
        return self.writes.empty() and not self.records and not self.canceling and self.ending is None


@dataclass(frozen=True)
class StartRequest:
    flow_id: str
    flow_type: str
    input: bytes
    config: FlowConfig
    start: MovementRecord | None


FlowStatus = Literal["running", "completed", "failed", "stopped"]


@dataclass(frozen=True)
class FlowInfo:
    flow_id: str
    flow_type: str
    status: FlowStatus
    created_at_ms: int
    closed_at_ms: int | None
    output: bytes | None
    error: str | None
    config: FlowConfig
    active_steps: tuple[ActiveStep, ...]


@dataclass(frozen=True)
class ActiveStep:
    step_type: str
    step_execution_id: str
    state: str  # ready, running, waiting
    method: str
    attempt: int
    timer_due_at_ms: int | None


@dataclass(frozen=True)
class HistoryEntry:
    """One Step event of a flow's history (E13)."""

    event_type: str
    step_type: str
    step_execution_id: str
    attempt: int
    at_ms: int
    detail: str


@dataclass(frozen=True)
class StoredEvent:
    sequence: int
    step_execution_id: str
    attempt: int
    value: bytes


@dataclass(frozen=True)
class EventPage:
    events: list[StoredEvent]
    next_sequence: int  # the sequence a reader passes next
    first_sequence: int  # oldest sequence still stored (trimming)
    flow_started_ms: int  # the flow's created_at: tells it from an earlier flow of its ID (resume tokens)
    flow_closed: bool  # closed when read: a closed flow's streams take no more events (its tasks are gone)
    # The event at the sequence read after, when it is still stored: a resume token's holder saw it,
    # and another event there means a crash lost it and its sequence was handed out again.
    at_after: StoredEvent | None = None


@dataclass(frozen=True)
class HousekeepingReport:
    timers_fired: int = 0
    leases_expired: int = 0
    timeouts: int = 0
    workers_removed: int = 0
    # "flow/step execution attempt n" of the first LATE_ATTEMPTS_NAMED attempts the pass expired or
    # timed out, for the worker's warning: a dead worker's sessions must be findable from the log.
    attempts_named: tuple[str, ...] = ()
    # The pass fired as many timers as it could (_transitions._timer_budget) and more are due.
    timers_left: bool = False
    # Closed flows retention deleted (WorkerOptions.closed_flow_retention_seconds), and whether the
    # pass left more that are due (it deletes at most CLOSED_FLOWS_DELETED_PER_HOUSEKEEPING).
    flows_deleted: int = 0
    flows_left: bool = False
