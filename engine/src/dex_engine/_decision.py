"""What Execute and RPCs decide: movements, completion, cancellations."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

from ._options import MovementOptions

if TYPE_CHECKING:
    from ._flow import Step

OutputT = TypeVar("OutputT")



@dataclass(frozen=True)
class Movement:
    """Start `step` with `input`; `options` override the Step's load options or durability."""

    step: Step[Any] | str
    input: Any = None
    options: MovementOptions | None = None

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

    @staticmethod
    def go_to(step: Step[Any] | str, input: Any = None, options: MovementOptions | None = None) -> StepDecision:
        return StepDecision("movements", (Movement(step, input, options),))

    @staticmethod
    def go_to_many(*movements: Movement | tuple[Any, ...]) -> StepDecision:
        """Start several Steps at once, e.g. parallel tool calls; each item a Movement or (step, input)."""
        built = tuple(m if isinstance(m, Movement) else Movement(*m) for m in movements)
        return StepDecision("movements", built)

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
        names = tuple(s if isinstance(s, str) else s.step_type for s in step_types)
        return replace(self, canceling_steps=self.canceling_steps + names)


@dataclass(frozen=True)
class RPCResult(Generic[OutputT]):
    """An RPC's output plus Steps to start and Step types to cancel at its commit."""

    output: OutputT
    next_steps: tuple[Movement, ...] = field(default=())
    canceling_steps: tuple[str, ...] = field(default=())
