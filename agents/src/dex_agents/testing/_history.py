"""Step history of a session, to assert the Step shape of a turn."""

from __future__ import annotations

import os
from dataclasses import dataclass
from urllib.parse import urlparse

from dex_engine import HistoryEntry, open_store

# The history event of a Step whose Execute committed.
EXECUTE_COMPLETED_EVENT = "execute_completed"


@dataclass(frozen=True)
class StepHistoryEntry:
    """One Step event: what happened, to which Step execution, at which attempt."""

    event_type: str
    step_type: str
    step_execution_id: str
    final_attempt: int


def to_step_history(entries: list[HistoryEntry]) -> list[StepHistoryEntry]:
    return [
        StepHistoryEntry(e.event_type, e.step_type, e.step_execution_id, e.attempt)
        for e in entries
        if e.step_type  # flow-level events (flow_closed) name no Step
    ]


async def read_step_history(database_url: str, flow_id: str) -> list[StepHistoryEntry]:
    """Every Step event of a flow, oldest first, read straight from the engine database.

    Raises FileNotFoundError for a SQLite database file that does not exist.
    """
    _require_sqlite_file(database_url)
    store = open_store(database_url)
    try:
        return to_step_history(await store.history(flow_id))
    finally:
        await store.close()


def _require_sqlite_file(database_url: str) -> None:
    """Refuse a SQLite URL whose file does not exist: opening a store creates the file, its
    directories and the schema, so a mistyped path would read an empty new database and report
    the flow missing instead of the path."""
    parsed = urlparse(database_url)
    if not database_url.startswith("sqlite:") or parsed.netloc or "#" in database_url:
        return  # open_store judges other URLs, and refuses these malformed ones before creating anything
    # The engine's reading of a sqlite URL: the path after "sqlite:///" as written, relative to
    # the working directory unless it starts with a fourth slash.
    path = parsed.path[1:] if parsed.path.startswith("/") else parsed.path
    if path and not os.path.exists(path):
        raise FileNotFoundError(f"no database file {os.path.abspath(path)!r} (from {database_url!r}); pass the "
                                "URL the engine was started with, e.g. AgentTestStack.database_url")


def executed_steps(history: list[StepHistoryEntry]) -> list[str]:
    """Step types whose Execute committed, in commit order: the Step shape of a session."""
    return [e.step_type for e in history if e.event_type == EXECUTE_COMPLETED_EVENT]
