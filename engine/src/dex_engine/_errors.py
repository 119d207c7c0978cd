"""The engine's named errors.

DexError
 +-- FlowDefinitionError       a Flow, Step, RPC or Registry is declared wrongly
 +-- FlowAlreadyStartedError   start_flow with a flow ID that exists
 +-- FlowStillRunningError     delete_flow of a flow that still runs
 +-- FlowNotActiveOrNotFoundError  either of these two (seed 004's example catches it)
 |    +-- FlowNotFoundError    no flow with that ID
 |    +-- FlowNotActiveError   the flow is closed (completed, failed or stopped)
 +-- UnknownFlowTypeError      no Flow of that type in the Registry
 +-- RpcNotFoundError          the Flow has no RPC of that name
 +-- RpcLockConflictError      an RPC's lock is held; nothing changed
 +-- RpcContentionError        an RPC lost its optimistic validation too often
 +-- ChannelMessageNotFoundError  a pending message an RPC deletes is gone
 +-- InvalidResumeTokenError   a stream token is forged, foreign or malformed
 +-- InvalidValueError         a value is not of the declared type or not JSON
 |    +-- ValueTooLargeError   a value is larger than MAX_VALUE_BYTES
 +-- InvalidIdError            an ID or key is empty, too long or has reserved characters
 +-- UndeclaredNameError       an attribute, channel or stream the Flow does not declare
 +-- InvalidWaitError          a Wait that can never be valid
 +-- NotLoadedError            a Step reads an attribute its load options left out
 +-- StaleAttemptError         a write from an attempt that no longer owns its task (fencing)
 +-- StepNotWaitingError       skip_timer on a Step execution that is not waiting
 +-- WorkerInvocationError     a handler raised; carries the error type and detail
 +-- WorkerIdInUseError        a worker starts under an ID a live worker elsewhere holds
 +-- NoRetryError              raised by a handler to skip remaining retries
 +-- RetryAfterError           raised by a handler whose retry may start no sooner than a delay
"""

from __future__ import annotations

from ._limits import SHOWN_CHARS

__all__ = [
    "ChannelMessageNotFoundError",
    "CommitOutcomeUnknownError",
    "DexError",
    "FlowAlreadyStartedError",
    "FlowDefinitionError",
    "FlowNotActiveError",
    "FlowNotActiveOrNotFoundError",
    "FlowNotFoundError",
    "FlowStillRunningError",
    "InvalidIdError",
    "InvalidResumeTokenError",
    "InvalidValueError",
    "InvalidWaitError",
    "NoRetryError",
    "NotLoadedError",
    "RetryAfterError",
    "RpcContentionError",
    "RpcLockConflictError",
    "RpcNotFoundError",
    "StaleAttemptError",
    "StepNotWaitingError",
    "UndeclaredNameError",
    "UnknownFlowTypeError",
    "ValueTooLargeError",
    "WorkerIdInUseError",
    "WorkerInvocationError",
]


class DexError(Exception):
    """Base class of every error the engine raises on purpose."""


class FlowDefinitionError(DexError):
    """A Flow, Step, RPC or Registry is declared wrongly; the message lists every problem."""


class FlowAlreadyStartedError(DexError):
    def __init__(self, flow_id: str) -> None:
        super().__init__(f"flow {flow_id!r} already exists; choose another flow ID")
        self.flow_id = flow_id


class FlowStillRunningError(DexError):
    """delete_flow of a running flow: its Steps would lose their state in the middle of their work."""

    def __init__(self, flow_id: str) -> None:
        super().__init__(
            f"flow {flow_id!r} is still running; stop it first (stop_flow), then delete it (nothing was deleted)"
        )
        self.flow_id = flow_id


class FlowNotActiveOrNotFoundError(DexError):
    """A call named a flow that does not exist or no longer runs. Seed 004's example catches this one
    name for both, so code that only needs "the session is gone" need not tell them apart."""


class FlowNotFoundError(FlowNotActiveOrNotFoundError):
    def __init__(self, flow_id: str) -> None:
        super().__init__(f"no flow with ID {flow_id!r}")
        self.flow_id = flow_id


class FlowNotActiveError(FlowNotActiveOrNotFoundError):
    def __init__(self, flow_id: str, status: str) -> None:
        super().__init__(f"flow {flow_id!r} is {status}, not running; it accepts no more changes")
        self.flow_id = flow_id
        self.status = status


class UnknownFlowTypeError(DexError):
    def __init__(self, flow_type: str, known: list[str]) -> None:
        super().__init__(
            f"unknown flow type {shown(flow_type, None)}; the Registry has {sorted(known)!r}"
        )
        self.flow_type = flow_type


class RpcNotFoundError(DexError):
    def __init__(self, flow_type: str, name: str, known: list[str]) -> None:
        super().__init__(f"flow type {flow_type!r} has no RPC {shown(name, None)}; it has {sorted(known)!r}")
        self.name = name


class RpcLockConflictError(DexError):
    def __init__(self, flow_id: str, lock: str, holder: str) -> None:
        super().__init__(
            f"RPC on flow {flow_id!r} needs lock {lock!r}, held by {holder}; nothing changed, retry later"
        )
        self.flow_id = flow_id
        self.lock = lock
        self.holder = holder


class RpcContentionError(DexError):
    """The flow changed under the RPC on every try, and no try could run it under the flow's write
    lock (its handler awaited something other than `ctx.load`); nothing was committed."""


class ChannelMessageNotFoundError(DexError):
    def __init__(self, channel: str, message_id: int) -> None:
        super().__init__(
            f"message {message_id} is no longer pending on channel {channel!r}; nothing changed"
        )
        self.channel = channel
        self.message_id = message_id


class InvalidResumeTokenError(DexError):
    """A stream resume token was forged, belongs to another flow or stream, or is malformed."""


class InvalidValueError(DexError, ValueError):
    """A value does not match its declared type, or cannot be encoded as JSON."""


class ValueTooLargeError(InvalidValueError):
    def __init__(self, name: str, size: int, limit: int) -> None:
        super().__init__(
            f"value for {name!r} is {size} bytes encoded, over MAX_VALUE_BYTES ({limit}); "
            "store it in pieces or outside the flow"
        )
        self.name = name
        self.size = size
        self.limit = limit


class InvalidIdError(DexError, ValueError):
    """An ID or key is empty, too long, or contains reserved characters."""


class UndeclaredNameError(DexError, KeyError):
    def __init__(self, kind: str, name: str, flow_type: str, declared: list[str]) -> None:
        msg = (
            f"{kind} {name!r} is not declared by flow type {flow_type!r}; "
            f"declared {kind}s: {sorted(declared)!r}"
        )
        super().__init__(msg)
        self.msg = msg

    def __str__(self) -> str:  # KeyError would quote the message
        return self.msg


class InvalidWaitError(DexError, ValueError):
    """A Wait or condition that can never be valid (e.g. at_most < at_least, negative timer)."""


class NotLoadedError(DexError, KeyError):
    def __init__(self, name: str, owner: str, *, rpc: bool = False) -> None:
        """`owner` is the Step type whose method read `name`, or with `rpc` the RPC's name."""
        if not rpc:
            msg = f"attribute {name!r} was not loaded for Step {owner!r}; add it to the Step's load options"
        else:  # an RPC has its own load options, and can load more while it runs
            msg = (f"attribute {name!r} was not loaded for RPC {owner!r}; add it to the RPC's load options "
                   "(rpc(load=...)) or load it first with `await ctx.load(...)`")
        super().__init__(msg)
        self.msg = msg

    def __str__(self) -> str:
        return self.msg


class StaleAttemptError(DexError):
    """The attempt lost its task (lease expired, cancelled or superseded); its write was rejected."""


class StepNotWaitingError(DexError):
    def __init__(self, flow_id: str, step_execution_id: str, problem: str = "is not waiting") -> None:
        super().__init__(
            f"Step execution {step_execution_id!r} of flow {flow_id!r} {problem}; "
            f"see `dex-engine describe {flow_id}` for its active Steps"
        )


class WorkerInvocationError(DexError):
    """A Step handler failed; `error_type` and `detail` describe what it raised."""

    def __init__(self, error_type: str, detail: str) -> None:
        super().__init__(f"{error_type}: {detail}")
        self.error_type = error_type
        self.detail = detail


class WorkerIdInUseError(DexError, RuntimeError):
    """A worker registering under an ID whose live lease another process (host and PID) holds: two
    workers under one ID would take each other's attempts for lost ones and run them again."""


class CommitOutcomeUnknownError(DexError, ConnectionError):
    """The connection to the database was lost during an operation's COMMIT, and the server could
    not say whether that transaction committed: it may have. Read its effect before doing it again."""


class StoreOpenError(DexError, RuntimeError):
    """A database could not be opened or migrated; the message names the file and the reason."""


class DatabaseFileReplacedError(StoreOpenError):
    """An SQLite database file, or its -wal or -shm file, was deleted or replaced while a store had it
    open: what the store reads is no longer what other processes see at that path, and what it
    wrote would be lost. The store refuses every operation, and a worker on it stops with this error."""


class NoRetryError(DexError):
    """Raise from a handler to fail the method now, skipping its remaining retries."""


class RetryAfterError(DexError):
    """Raise from a handler to fail the attempt with its retry no sooner than `delay_seconds` from now
    (a provider's Retry-After), and within the method's retry policy: the retry starts after the
    longer of this delay and the policy's interval; one past the policy's total duration is not made.

    The engine reads the `retry_after_seconds` attribute, so any exception that has one asks the same,
    keeping its own type (a library's rate-limit error with the attribute set on it).
    """

    def __init__(self, delay_seconds: float, message: str) -> None:
        super().__init__(message)
        self.retry_after_seconds = delay_seconds


def shown(value: object, chars: int | None = SHOWN_CHARS) -> str:
    """repr(value), at most `chars` characters (None: all), for an error that names a caller's value. Never
    raises: an int of over 4,300 digits has no repr (ValueError), nor has an object whose __repr__
    raises, and the error about the value must still be the one raised."""
    try:
        text = repr(value)
    except Exception as exc:
        return f"(a {type(value).__name__} whose repr could not be made: {type(exc).__name__})"
    return text if chars is None else text[:chars]
