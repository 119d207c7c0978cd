"""The `dex-agents` command: `demo` (what durability means, in one run) and `chat` (a terminal chat)."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import click
from rich.console import Console

from dex_engine import DexError

# Where `dex-agents chat` keeps its session by default, relative to the working directory.
DEFAULT_CHAT_DIR = Path(".dex")
DEFAULT_CHAT_SESSION = "chat"


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Durable agent sessions on dex-engine. Start with `dex-agents demo`."""


@main.command()
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Keep the demo's database here (default: a temporary directory, removed afterwards).")
def demo(data_dir: Path | None) -> None:
    """Start a session, kill its Worker while it waits for an approval, approve, show the record."""
    from .demo._run import run_demo

    raise SystemExit(_run(lambda: run_demo(Console(), data_dir)))


@main.command()
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path), default=DEFAULT_CHAT_DIR,
              show_default=True, help="Directory of the chat's SQLite database.")
@click.option("--session", "session_id", default=DEFAULT_CHAT_SESSION, show_default=True,
              help="Session ID; the same ID resumes the same conversation.")
def chat(data_dir: Path, session_id: str) -> None:
    """Chat with the demo agent in the terminal; approvals are asked inline."""
    from .demo._chat import run_chat

    def start() -> Coroutine[Any, Any, int]:
        data_dir.mkdir(parents=True, exist_ok=True)
        # No highlighting: rich's highlighter takes minutes over a long unbroken word (a pasted token).
        return run_chat(Console(highlight=False), data_dir, session_id)

    try:
        raise SystemExit(_run(start))
    except KeyboardInterrupt:
        raise SystemExit(130) from None


def _run(start: Callable[[], Coroutine[Any, Any, int]]) -> int:
    """Run a command's coroutine; a database that cannot be opened or written (a full disk), a
    directory that cannot be made, or a bad ID ends the command with its message (exit code 1), not
    a traceback."""
    try:
        return asyncio.run(start())
    except (DexError, OSError, sqlite3.Error) as exc:
        raise click.ClickException(str(exc)) from None
