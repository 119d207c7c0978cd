"""Pure wait selection (E5): which conditions a wait satisfies and which messages it consumes.

State in, decision out: the store passes the queued message IDs of every channel instance the wait
names and the indices of its timers that are due or skipped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ._wait import WaitSpec


@dataclass(frozen=True)
class Selection:
    satisfied: tuple[int, ...]
    take: dict[int, list[int]] = field(default_factory=dict)  # condition index -> message IDs
    fired_timers: tuple[int, ...] = ()
    skipped: bool = False


def select_wait(
    spec: WaitSpec,
    queued: Mapping[tuple[str, str], Sequence[int]],
    fired: frozenset[int] | set[int],
) -> Selection | None:
    """Return what the wait takes now, or None when it stays waiting.

    any_of: a fired timer wins over channels; else channels in argument order; only the winner
    consumes. all_of: every condition at once, consuming for all of them, each instance's queue
    shared in argument order. at_most(n) is satisfied by an empty queue; at_least(n) takes all.
    """
    if spec.mode == "skip":
        return Selection(satisfied=(), skipped=True)
    fired_timers = tuple(
        i for i, c in enumerate(spec.conditions) if c.kind == "timer" and i in fired
    )
    if spec.mode == "any":
        if fired_timers:
            return Selection(satisfied=(fired_timers[0],), fired_timers=fired_timers)
        for i, cond in enumerate(spec.conditions):
            if cond.kind != "channel":
                continue
            queue = queued.get((cond.channel, cond.key), ())
            if len(queue) >= cond.at_least:
                end = len(queue) if cond.at_most is None else cond.at_most
                return Selection(satisfied=(i,), take={i: list(queue[:end])})
        return None
    # all_of
    offsets: dict[tuple[str, str], int] = {}
    take: dict[int, list[int]] = {}
    for i, cond in enumerate(spec.conditions):
        if cond.kind == "timer":
            if i not in fired:
                return None
            continue
        ident = (cond.channel, cond.key)
        start = offsets.get(ident, 0)
        available = list(queued.get(ident, ()))[start:]
        if len(available) < cond.at_least:
            return None
        chosen = available if cond.at_most is None else available[: cond.at_most]
        take[i] = chosen
        offsets[ident] = start + len(chosen)
    return Selection(
        satisfied=tuple(range(len(spec.conditions))), take=take, fired_timers=fired_timers
    )
