"""Step history of a session, to assert the Step shape of a turn."""

from __future__ import annotations

from dataclasses import dataclass

from dex_engine import HistoryEntry, open_store

# The history event of a Step whose Execute committed.
EXECUTE_COMPLETED_EVENT = "execute_completed"


@dataclass(frozen=True)
class StepHistoryEntry:
    """One Step event: what happened, to which Step execution, at which attempt, and the engine's
    detail: for `attempt_failed` and `step_failed` the error (`execute: TypeError: ...`), the only
    place a test sees why a runner's call failed when the session records it `outcome_unknown`."""

    event_type: str
    step_type: str
    step_execution_id: str
    final_attempt: int
    detail: str = ""


def to_step_history(entries: list[HistoryEntry]) -> list[StepHistoryEntry]:
    return [
        StepHistoryEntry(e.event_type, e.step_type, e.step_execution_id, e.attempt, e.detail)
        for e in entries
        if e.step_type  # flow-level events (flow_closed) name no Step
    ]


async def read_step_history(database_url: str, flow_id: str) -> list[StepHistoryEntry]:
    """Every Step event of a flow, oldest first, read straight from the engine database.

    Only an engine database the workers use is read, never created or migrated: a mistyped path
    or database name would otherwise report the flow missing from a new empty database (and leave
    the engine's tables in whatever database it names), and a database of an older schema would be
    migrated under the older workers. Raises FileNotFoundError for a SQLite database file that does
    not exist, StoreOpenError for a database without dex_engine tables or of an older schema.
    """
    store = open_store(database_url, existing=True)
    try:
        return to_step_history(await store.history(flow_id))
    finally:
        await store.close()


def executed_steps(history: list[StepHistoryEntry]) -> list[str]:
    """Step types whose Execute committed, in commit order: the Step shape of a session."""
    return [e.step_type for e in history if e.event_type == EXECUTE_COMPLETED_EVENT]
