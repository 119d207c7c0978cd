"""dex_engine: durable Flows of Steps on SQLite (embedded) or PostgreSQL.

A Flow is made of Steps, each an optional WaitFor and an Execute, with typed Attributes,
Channels, Timers, RPCs and Streams. Workers run the Steps; clients start flows and call RPCs.
"""

from ._client import AsyncClient, Client, SearchQueryError, StreamEvent, StreamRead
from ._context import Context, PendingMessage, RpcContext, WaitResult
from ._decision import Movement, RPCResult, StepDecision
from ._errors import (
    ChannelMessageNotFoundError,
    CommitOutcomeUnknownError,
    DexError,
    FlowAlreadyStartedError,
    FlowDefinitionError,
    FlowNotActiveError,
    FlowNotFoundError,
    InvalidIdError,
    InvalidResumeTokenError,
    InvalidValueError,
    InvalidWaitError,
    NoRetryError,
    NotLoadedError,
    RpcContentionError,
    RpcLockConflictError,
    RpcNotFoundError,
    StaleAttemptError,
    StepNotWaitingError,
    StoreOpenError,
    UndeclaredNameError,
    UnknownFlowTypeError,
    ValueTooLargeError,
    WorkerIdInUseError,
    WorkerInvocationError,
)
from ._flow import Flow, Registry, Rpc, Step, rpc
from ._limits import DEFAULT_READ_LIMIT, MAX_ERROR_TEXT_CHARS, MAX_TIMER_SECONDS, MAX_VALUE_BYTES
from ._open import open_store
from ._options import FlowConfig, LoadOptions, LoadSpec, MovementOptions, StepDurability, StepOptions
from ._records import AttemptProgress, FlowInfo, HistoryEntry, RecoveryError
from ._retry import RetryPolicy
from ._schema import Attribute, AttributeMap, AttributeRef, Channel, ChannelMap, ChannelRef, Stream
from ._store import Store
from ._wait import ChannelCondition, Timer, TimerCondition, Wait
from ._worker import AsyncWorker, WorkerOptions

__all__ = [
    "DEFAULT_READ_LIMIT",
    "MAX_ERROR_TEXT_CHARS",
    "MAX_TIMER_SECONDS",
    "MAX_VALUE_BYTES",
    "AsyncClient",
    "AsyncWorker",
    "AttemptProgress",
    "Attribute",
    "AttributeMap",
    "AttributeRef",
    "Channel",
    "ChannelCondition",
    "ChannelMap",
    "ChannelMessageNotFoundError",
    "ChannelRef",
    "Client",
    "CommitOutcomeUnknownError",
    "Context",
    "DexError",
    "Flow",
    "FlowAlreadyStartedError",
    "FlowConfig",
    "FlowDefinitionError",
    "FlowInfo",
    "FlowNotActiveError",
    "FlowNotFoundError",
    "HistoryEntry",
    "InvalidIdError",
    "InvalidResumeTokenError",
    "InvalidValueError",
    "InvalidWaitError",
    "LoadOptions",
    "LoadSpec",
    "Movement",
    "MovementOptions",
    "NoRetryError",
    "NotLoadedError",
    "PendingMessage",
    "RPCResult",
    "RecoveryError",
    "Registry",
    "RetryPolicy",
    "Rpc",
    "RpcContentionError",
    "RpcContext",
    "RpcLockConflictError",
    "RpcNotFoundError",
    "SearchQueryError",
    "StaleAttemptError",
    "Step",
    "StepDecision",
    "StepDurability",
    "StepNotWaitingError",
    "StepOptions",
    "Store",
    "StoreOpenError",
    "Stream",
    "StreamEvent",
    "StreamRead",
    "Timer",
    "TimerCondition",
    "UndeclaredNameError",
    "UnknownFlowTypeError",
    "ValueTooLargeError",
    "Wait",
    "WaitResult",
    "WorkerIdInUseError",
    "WorkerInvocationError",
    "WorkerOptions",
    "open_store",
    "rpc",
]
