"""The `dex-agents` command: `demo` (what durability means, in one run) and `chat` (a terminal chat)."""

from __future__ import annotations

import asyncio
import errno
import os
import signal
import sqlite3
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import click
from rich.console import Console

from dex_engine import DexError

# Where `dex-agents chat` keeps its session by default, relative to the working directory.
DEFAULT_CHAT_DIR = Path(".dex")
DEFAULT_CHAT_SESSION = "chat"
# Signals that end a command as Ctrl-C does, its Workers stopped (SIGHUP: the terminal closed).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
# Characters a sqlite URL cannot carry in its path: '?' starts the parameters, '#' a fragment, and
# URL parsing drops a tab, CR or LF wherever it is (the database would land in another directory).
URL_UNSAFE_PATH_CHARACTERS = "?#\t\r\n"


class _Console(Console):
    """A rich Console whose standard output, closed by its reader (`| head -1`), ends the command
    with one error line (exit code 1)."""

    def on_broken_pipe(self) -> None:
        # rich's own raises SystemExit, which asyncio prints with a traceback when the chat's task
        # raises it. What is printed from now on (the Workers' stop, the session saved) goes nowhere.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        raise BrokenPipeError(errno.EPIPE, "standard output was closed by its reader; the command stopped")


def _data_dir(ctx: click.Context, param: click.Parameter, value: Path | None) -> Path | None:
    """--data-dir as the database URL can name it."""
    if value is not None:
        unsafe = sorted({c for c in str(value) if c in URL_UNSAFE_PATH_CHARACTERS})
        if unsafe:
            raise click.BadParameter(f"{str(value)!r} contains {' and '.join(repr(c) for c in unsafe)}, which a "
                                     "sqlite URL cannot hold in its path; name a directory without them")
    return value


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Durable agent sessions on dex-engine. Start with `dex-agents demo`."""


@main.command()
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path), default=None, callback=_data_dir,
              help="Keep the demo's database here, a new or empty directory (default: a temporary directory, "
                   "removed afterwards).")
def demo(data_dir: Path | None) -> None:
    """Start a session, kill its Worker while it waits for an approval, approve, show the record."""
    from .demo._run import DemoError, data_dir_problem, run_demo

    problem = None if data_dir is None else data_dir_problem(data_dir)
    if problem is not None:
        raise click.BadParameter(problem, param_hint="'--data-dir'")
    try:
        raise SystemExit(_run(lambda: run_demo(_Console(), data_dir)))
    except DemoError as exc:
        raise click.ClickException(str(exc)) from None


@main.command()
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path), default=DEFAULT_CHAT_DIR,
              show_default=True, callback=_data_dir, help="Directory of the chat's SQLite database.")
@click.option("--session", "session_id", default=DEFAULT_CHAT_SESSION, show_default=True,
              help="Session ID; the same ID resumes the same conversation.")
def chat(data_dir: Path, session_id: str) -> None:
    """Chat with the demo agent in the terminal; approvals are asked inline."""
    from .demo._chat import run_chat

    if sys.stdin is None:
        raise click.ClickException("standard input is closed; the chat reads what you type from it")

    def start() -> Coroutine[Any, Any, int]:
        data_dir.mkdir(parents=True, exist_ok=True)
        # No highlighting: rich's highlighter takes minutes over a long unbroken word (a pasted token).
        return run_chat(_Console(highlight=False), data_dir, session_id)

    try:
        raise SystemExit(_run(start))
    except KeyboardInterrupt:
        raise SystemExit(130) from None


def _run(start: Callable[[], Coroutine[Any, Any, int]]) -> int:
    """Run a command's coroutine; a database that cannot be opened or written (a full disk), a
    directory that cannot be made, or a bad ID ends the command with its message (exit code 1), not
    a traceback. A STOP_SIGNALS signal cancels it, so its Workers stop (exit code 128 + the signal)."""
    try:
        return asyncio.run(_until_stopped(start))
    except (DexError, OSError, sqlite3.Error) as exc:
        raise click.ClickException(str(exc)) from None


async def _until_stopped(start: Callable[[], Coroutine[Any, Any, int]]) -> int:
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    received: list[int] = []

    def stop(signum: int) -> None:
        received.append(signum)
        task.cancel()

    # A signal the caller ignores stays ignored (nohup's SIGHUP); the others' handlers come back after.
    previous = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    handled = [signum for signum, handler in previous.items() if handler is not signal.SIG_IGN]
    for signum in handled:
        loop.add_signal_handler(signum, stop, signum)
    try:
        return await start()
    except asyncio.CancelledError:
        if not received:
            raise
        return 128 + received[0]
    finally:
        for signum in handled:
            loop.remove_signal_handler(signum)
            signal.signal(signum, previous[signum])
