"""What Execute and RPCs decide: movements, completion, cancellations."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

from ._errors import InvalidValueError
from ._options import MovementOptions

if TYPE_CHECKING:
    from ._flow import Step

OutputT = TypeVar("OutputT")

# The arguments below are checked as a decision is made, each error naming the argument and value:
# unchecked, a wrong one failed later inside the engine with a TypeError or AttributeError that
# named neither, or (a str iterated as Step type names) named a Step "P" that nobody wrote.


def _step_name(label: str, step: object) -> str:
    """The Step type `step` (a Step or its type's name) names; InvalidValueError naming `label`."""
    if isinstance(step, str):
        return step
    name = getattr(step, "step_type", None)  # a Step, duck-typed: _flow imports this module
    if isinstance(name, str):
        return name
    raise InvalidValueError(f"{label} must be a Step or a Step type's name, got {type(step).__name__}: {step!r}")


def _step_names(label: str, steps: object) -> tuple[str, ...]:
    """Step types to cancel, as given: one Step or name (a str is taken whole, not as its characters)
    or any iterable of Steps and names."""
    if isinstance(steps, str) or isinstance(getattr(steps, "step_type", None), str):
        return (_step_name(label, steps),)
    if not isinstance(steps, Iterable):
        raise InvalidValueError(f"{label} must be Steps or Step type names, got {type(steps).__name__}: {steps!r}")
    return tuple(_step_name(label, step) for step in steps)


def _movements(label: str, movements: object) -> tuple[Movement, ...]:
    """Movements as given: each a Movement or a (step, input[, options]) tuple, as go_to_many takes."""
    if isinstance(movements, Movement) or not isinstance(movements, Iterable) or isinstance(movements, str):
        raise InvalidValueError(
            f"{label} must be a collection of Movements or (step, input) tuples, got {movements!r}")
    return tuple(_movement(label, m) for m in movements)


def _movement(label: str, movement: object) -> Movement:
    if isinstance(movement, Movement):
        return movement
    if isinstance(movement, tuple) and 1 <= len(movement) <= 3:
        return Movement(*movement)
    raise InvalidValueError(
        f"{label} holds {movement!r}, which is neither a Movement nor a (step, input) or (step, input, "
        "options) tuple")


@dataclass(frozen=True)
class Movement:
    """Start `step` with `input`; `options` override the Step's load options or durability."""

    step: Step[Any] | str
    input: Any = None
    options: MovementOptions | None = None

    def __post_init__(self) -> None:
        _step_name("a Movement's step", self.step)
        options: object = self.options
        if options is not None and not isinstance(options, MovementOptions):
            raise InvalidValueError(
                f"a Movement's options must be MovementOptions or None, got {type(options).__name__}: {options!r}")

    @property
    def step_type(self) -> str:
        return self.step if isinstance(self.step, str) else self.step.step_type


DecisionKind = Literal["movements", "dead_end", "graceful_complete", "force_complete", "force_fail"]


@dataclass(frozen=True)
class StepDecision:
    """The result of an Execute. Build it with the static constructors."""

    kind: DecisionKind
    movements: tuple[Movement, ...] = ()
    output: Any = None
    reason: str = ""
    canceling_steps: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        reason: object = self.reason
        if not isinstance(reason, str):
            raise InvalidValueError(
                f"a StepDecision's reason (force_fail's) must be a str, got {type(reason).__name__}: {reason!r}; "
                "give the reason as text")
        if not all(type(m) is Movement for m in self.movements):  # made by go_to and go_to_many: all are
            object.__setattr__(self, "movements", _movements("StepDecision movements", self.movements))
        if self.canceling_steps:
            object.__setattr__(self, "canceling_steps", _step_names("canceling_steps", self.canceling_steps))

    @staticmethod
    def go_to(step: Step[Any] | str, input: Any = None, options: MovementOptions | None = None) -> StepDecision:
        return StepDecision("movements", (Movement(step, input, options),))

    @staticmethod
    def go_to_many(*movements: Movement | tuple[Any, ...]) -> StepDecision:
        """Start several Steps at once, e.g. parallel tool calls; each item a Movement or (step, input)."""
        return StepDecision("movements", _movements("go_to_many", movements))

    go_to_multi = go_to_many

    @staticmethod
    def dead_end() -> StepDecision:
        """End this branch; the flow stays open for other Steps and RPCs."""
        return StepDecision("dead_end")

    @staticmethod
    def graceful_complete(output: Any = None) -> StepDecision:
        """Complete the flow once no other Step is queued, running or waiting."""
        return StepDecision("graceful_complete", output=output)

    @staticmethod
    def force_complete(output: Any = None) -> StepDecision:
        """Complete the flow now, cancelling every other Step."""
        return StepDecision("force_complete", output=output)

    @staticmethod
    def force_fail(reason: str) -> StepDecision:
        """Fail the flow now with `reason`, cancelling every other Step."""
        return StepDecision("force_fail", reason=reason)

    def with_canceling_steps(self, *step_types: Step[Any] | str) -> StepDecision:
        names = tuple(_step_name("with_canceling_steps", s) for s in step_types)
        return replace(self, canceling_steps=self.canceling_steps + names)


@dataclass(frozen=True)
class RPCResult(Generic[OutputT]):
    """An RPC's output plus Steps to start and Step types to cancel at its commit.

    `ending_retry_waits`: Step types whose executions waiting for a retry (a failed attempt's
    retry, not yet running) end at the commit as if their retries were spent: each goes to its
    failure route with `ending_reason` and its last error; a running attempt is left alone, but
    its execution makes no further retry: a failure that would retry ends it the same way.
    """

    output: OutputT
    next_steps: tuple[Movement, ...] = field(default=())
    canceling_steps: tuple[str, ...] = field(default=())
    ending_retry_waits: tuple[str, ...] = field(default=())
    ending_reason: str = "ended while waiting to retry"

    def __post_init__(self) -> None:
        # Taken as StepDecision takes them: (step, input) tuples as go_to_many does, one name whole.
        object.__setattr__(self, "next_steps", _movements("RPCResult next_steps", self.next_steps))
        object.__setattr__(self, "canceling_steps", _step_names("RPCResult canceling_steps", self.canceling_steps))
        object.__setattr__(self, "ending_retry_waits",
                           _step_names("RPCResult ending_retry_waits", self.ending_retry_waits))
        reason: object = self.ending_reason
        if not isinstance(reason, str):
            raise InvalidValueError(
                f"RPCResult ending_reason must be a str, got {type(reason).__name__}: {reason!r}; give it as text")
