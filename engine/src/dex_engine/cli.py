"""The `dex-engine` command line: look at and operate the flows stored in an engine database.

It has no Registry, so it works on stored data only: flows, Step history, attributes (JSON),
stream events, timers, workers. Every command takes `--db URL` (default: $DEX_ENGINE_DB, else
sqlite:///dex.db). Bad input prints one `Error: ...` line and exits with code 2.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from datetime import UTC, datetime
from typing import Any, TypeVar

import click
import msgspec
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ._client import known_flow_id, parse_search
from ._errors import DexError, FlowNotFoundError, FlowStillRunningError, StepNotWaitingError, StoreOpenError
from ._existing import Wording, check_existing
from ._limits import FOLLOW_REMEMBERED_EVENTS, MAX_READ_LIMIT
from ._open import open_store, shown_url
from ._records import FlowInfo
from ._sqlite_store import parse_sqlite_url
from ._store import Store
from ._tokens import event_digest

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])

DB_ENV = "DEX_ENGINE_DB"
DEFAULT_DB = "sqlite:///dex.db"
FLOW_STATUSES = ("running", "completed", "failed", "stopped")
# How often `stream --follow` looks for new events.
FOLLOW_POLL_SECONDS = 0.2
# Events per read of `stream`; it reads page after page.
STREAM_PAGE = 1000
# Largest --after: the largest sequence the database's 64-bit integers hold (more overflowed the read).
MAX_SEQUENCE = 2**63 - 1
# Output width when stdout is not a terminal (pipes, tests): wide enough that tables never wrap IDs.
PIPE_WIDTH = 200


class CliError(click.ClickException):
    """Bad input: printed as one `Error: ...` line, exit code 2 (like click's usage errors)."""

    exit_code = 2


def _console() -> Console:
    """A console on the current stdout (CliRunner swaps it), wide when not a terminal."""
    width = None if sys.stdout.isatty() else PIPE_WIDTH
    return Console(file=sys.stdout, width=width, highlight=False)


def _db_option(fn: F) -> F:
    return click.option(
        "--db", "db_url", envvar=DB_ENV, default=DEFAULT_DB, show_default=True, show_envvar=True,
        metavar="URL", help="Engine database, e.g. sqlite:///path/to/file.db.",
    )(fn)


# How the command's refusals of a database (engine/_existing.py) name the command and its options.
CLI_WORDING = Wording(
    reader="this dex-engine",
    pass_instead=f"pass --db or set {DB_ENV} to the URL the workers use",
    older_instead="use the dex-engine command of their version",
    foreign_file_advice="",
)


def _check_database(url: str, *, must_exist: bool) -> None:
    """Refuse a malformed URL, a file that is not an engine database, and, when `must_exist`, a
    database that is not there or has an older schema.

    Opening a store creates and migrates the database, so a mistyped path or URL must be caught
    before that, and so must a database that workers of an older dex_engine still use.
    """
    if url.startswith("sqlite:"):
        try:
            path = parse_sqlite_url(url).path
        except ValueError as exc:
            raise CliError(str(exc)) from None
        if must_exist and not os.path.exists(path):  # named here to name --db; the rest in check_existing
            # A relative path names a file in the working directory: say which, as a worker's start
            # log names its file by its absolute path, so the two can be compared.
            where = "" if os.path.isabs(path) else f", relative to the working directory {os.getcwd()!r}"
            raise CliError(f"no database file {os.path.abspath(path)!r} (from --db {shown_url(url)}{where}); "
                           f"pass --db or set {DB_ENV} to the URL the workers use")
    with _open_errors(url):
        check_existing(url, CLI_WORDING, must_exist=must_exist)


def _askable(*names: str | None) -> bool:
    """Whether the store may be asked about `names` (flow types, Step types, stream names): as for a
    flow ID (`known_flow_id`), no name has a character that is not printable, and one decoded from a
    command-line byte that is not UTF-8 (a lone surrogate) cannot even be encoded for the database."""
    return all(name is None or name.isprintable() for name in names)


@contextlib.contextmanager
def _open_errors(url: str) -> Iterator[None]:
    """Refusals to open the database at `url` (a bad URL, one that cannot be an engine database, a
    server that cannot be reached) as one-line CLI errors."""
    try:
        yield
    except ValueError as exc:
        raise CliError(f"cannot open database {shown_url(url)!r}: {exc}") from None
    except StoreOpenError as exc:
        raise CliError(str(exc)) from None


def _open(url: str) -> Store:
    """open_store, its refusals as one-line CLI errors."""
    with _open_errors(url):
        return open_store(url)


def _run(url: str, fn: Callable[[Store], Awaitable[T]]) -> T:
    """Open the database at `url`, run `fn` on it, close it; engine errors become one-line CLI errors."""
    _check_database(url, must_exist=True)

    async def go() -> T:
        store = _open(url)
        try:
            return await fn(store)
        finally:
            await store.close()

    try:
        return asyncio.run(go())
    except FlowNotFoundError as exc:
        raise CliError(f"{exc} in {shown_url(url)}") from None
    except DexError as exc:
        raise CliError(str(exc)) from None


def _time(ms: int | None) -> str:
    """A stored time as the wire writes times: UTC, milliseconds, Z. The host's local time, unmarked,
    read as UTC beside logs and JSON, hours off on any server not set to UTC."""
    if ms is None:
        return "-"
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _relative(ms: int, now_ms: float) -> str:
    seconds = (ms - now_ms) / 1000
    return f"in {seconds:.1f} s" if seconds >= 0 else f"{-seconds:.1f} s ago"


def _json(data: bytes | None) -> Any:
    return None if data is None else json.loads(data)


def _dumps(value: Any) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=False)


def _table(*columns: str) -> Table:
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for name in columns:
        # IDs and times never wrap; free text (detail, active steps) folds instead.
        free = name in ("detail", "active steps")
        table.add_column(name, no_wrap=not free, overflow="fold" if free else "ellipsis")
    return table


def _active_steps(info: FlowInfo) -> str:
    return ", ".join(f"{s.step_execution_id} ({s.state})" for s in info.active_steps) or "-"


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """Inspect and operate dex-engine flows stored in a database.

    Start with `dex-engine demo`, which runs a small flow and prints the commands to try next.
    """


@cli.command("list")
@click.option("--type", "flow_type", metavar="T", help="Only flows of this flow type.")
@click.option("--status", type=click.Choice(FLOW_STATUSES), help="Only flows with this status.")
@click.option("--limit", type=click.IntRange(min=1, max=MAX_READ_LIMIT), default=50, show_default=True,
              help="Newest N flows.")
@_db_option
def list_command(flow_type: str | None, status: str | None, limit: int, db_url: str) -> None:
    """Table of flows, newest first."""

    async def go(store: Store) -> list[FlowInfo]:
        if not _askable(flow_type):
            return []  # no flow has such a type
        return await store.list_flows(flow_type=flow_type, status=status, limit=limit)

    flows = _run(db_url, go)
    console = _console()
    if not flows:
        console.print("No flows match.")
        return
    table = _table("flow id", "type", "status", "created", "closed", "active steps")
    for info in flows:
        table.add_row(Text(info.flow_id), Text(info.flow_type), Text(info.status), _time(info.created_at_ms),
                      _time(info.closed_at_ms), Text(_active_steps(info)))
    console.print(table)


@cli.command()
@click.argument("query")
@click.option("--limit", type=click.IntRange(min=1, max=MAX_READ_LIMIT), default=1000, show_default=True)
@_db_option
def search(query: str, limit: int, db_url: str) -> None:
    """Flow IDs matching QUERY, one per line.

    QUERY joins terms with AND: FlowType = "X", FlowStatus = "running", ActiveStepTypes = "Y".
    """

    async def go(store: Store) -> list[str]:
        terms = parse_search(query)
        if not _askable(*terms.values()):
            return []  # no flow has such a type, status or Step type
        return await store.search_flows(flow_type=terms.get("FlowType"), status=terms.get("FlowStatus"),
                                        active_step=terms.get("ActiveStepTypes"), limit=limit)

    ids = _run(db_url, go)
    for flow_id in ids:
        click.echo(flow_id)
    if not ids:
        click.echo("no flows match", err=True)


@cli.command()
@click.argument("flow_id")
@_db_option
def describe(flow_id: str, db_url: str) -> None:
    """Status, type, times, config, output or error, and active Steps of a flow."""
    info = _run(db_url, lambda store: store.describe_flow(known_flow_id(flow_id)))
    now_ms = time.time() * 1000
    console = _console()
    fields = Table.grid(padding=(0, 2))
    fields.add_column(style="bold")
    fields.add_column()
    fields.add_row("flow", Text(info.flow_id))
    fields.add_row("type", Text(info.flow_type))
    fields.add_row("status", Text(info.status))
    fields.add_row("created", _time(info.created_at_ms))
    if info.closed_at_ms is not None:
        took = (info.closed_at_ms - info.created_at_ms) / 1000
        fields.add_row("closed", f"{_time(info.closed_at_ms)} (after {took:.3f} s)")
    else:
        fields.add_row("closed", f"- (running for {(now_ms - info.created_at_ms) / 1000:.1f} s)")
    fields.add_row("config", Text(json.dumps(msgspec.structs.asdict(info.config))))
    if info.output is not None:
        fields.add_row("output", Text(_dumps(_json(info.output))))
    if info.error is not None:
        fields.add_row("error", Text(info.error))
    console.print(fields)
    if not info.active_steps:
        console.print("\nNo active Steps.")
        return
    table = _table("step execution", "step type", "state", "method", "attempt", "timer due")
    for s in info.active_steps:
        due = "-"
        if s.timer_due_at_ms is not None:
            due = f"{_time(s.timer_due_at_ms)} ({_relative(s.timer_due_at_ms, now_ms)})"
        table.add_row(Text(s.step_execution_id), Text(s.step_type), s.state, s.method, str(s.attempt), due)
    console.print()
    console.print(table)


@cli.command()
@click.argument("flow_id")
@click.option("--limit", type=click.IntRange(min=1, max=MAX_READ_LIMIT), default=1000, show_default=True,
              help="Last N events.")
@_db_option
def history(flow_id: str, limit: int, db_url: str) -> None:
    """Step history of a flow, oldest first."""
    entries = _run(db_url, lambda store: store.history(known_flow_id(flow_id), limit))
    table = _table("event_type", "step_type", "step_execution_id", "attempt", "time", "detail")
    for e in entries:
        table.add_row(e.event_type, Text(e.step_type), Text(e.step_execution_id), str(e.attempt), _time(e.at_ms),
                      Text(e.detail))
    _console().print(table)


@cli.command()
@click.argument("flow_id")
@click.option("--name", help="Only this attribute (or attribute map).")
@_db_option
def attributes(flow_id: str, name: str | None, db_url: str) -> None:
    """Stored attributes as JSON; an attribute map is an object by key."""
    stored = _run(db_url, lambda store: store.read_all_attributes(known_flow_id(flow_id)))
    tree: dict[str, Any] = {}
    for (attr, key), data in sorted(stored.items()):
        value = json.loads(data)
        if key:
            tree.setdefault(attr, {})[key] = value
        else:
            tree[attr] = value
    if name is None:
        click.echo(_dumps(tree))
        return
    if name not in tree:
        raise CliError(f"flow {flow_id!r} has no stored attribute {name!r}; stored: {sorted(tree)}")
    click.echo(_dumps(tree[name]))


@cli.command()
@click.argument("flow_id")
@click.argument("stream_name", metavar="STREAM")
@click.option("--after", type=click.IntRange(min=0, max=MAX_SEQUENCE), default=0, show_default=True,
              help="Only events with a sequence above SEQ.", metavar="SEQ")
@click.option("--follow", is_flag=True, help="Keep printing new events until the flow closes.")
@_db_option
def stream(flow_id: str, stream_name: str, after: int, follow: bool, db_url: str) -> None:
    """Events of a stream as JSON lines (sequence, step_execution_id, attempt, value)."""

    def no_events(names: list[str]) -> CliError:
        return CliError(f"flow {flow_id!r} has no events in stream {stream_name!r}; streams with events: {names}")

    # The digests of the last events printed, oldest first, by sequence: whether the stream still
    # holds them as printed. `forgot`: older printed events were dropped from it.
    printed: dict[int, str] = {}
    forgot = False

    async def rewind(store: Store, newest: int, first_kept: int, started: int) -> int:
        """The sequence to read on after, once the printed event `newest` is gone or another now:
        the one before the oldest remembered event that changed (a crash loses the newest commits)."""
        oldest = min(seq for seq in printed if seq >= first_kept)
        page = await store.read_events(flow_id, stream_name, oldest, newest - oldest)
        # Replaced since the read that sent here: the new flow's events differ from the printed ones
        # because they are another flow's, not because a crash renumbered them.
        check_same_flow(started, page.flow_started_ms)
        stored = {e.sequence: event_digest(e) for e in page.events}
        if page.at_after is not None:
            stored[page.at_after.sequence] = event_digest(page.at_after)
        # Not the ones trimmed since (capacity): they are gone, not changed, and the gap is noted.
        kept = [seq for seq in printed if seq >= page.first_sequence]
        changed = next((seq for seq in kept if stored.get(seq) != printed[seq]), None)
        if changed is None:
            return newest
        note = (f"events {changed}..{newest} this follower printed are gone or other events now: a database crash "
                "lost them (best-effort events are written without fsync) and later events took their sequences; "
                f"printing on from {changed}")
        if changed == kept[0] and forgot:
            note += (f" (it remembers only the last {FOLLOW_REMEMBERED_EVENTS} events it printed, so earlier ones may "
                     f"have changed too: run it again without --after to see the stream as stored)")
        click.echo(note, err=True)
        for seq in kept:
            if seq >= changed:
                del printed[seq]
        return changed - 1

    def check_same_flow(started: int, now_started: int) -> None:
        """The flow printed from must still be the one read: a flow ID may be deleted and started again
        (between two polls), and the new flow's sequences count from 1 again, so reading on would take
        its events for the old one's, or its renumbering for a crash. The old flow closed before it was
        deleted, which ends a follow; the events it wrote after the last read are gone with it."""
        if now_started != started:
            raise CliError(
                f"flow {flow_id!r} was deleted and started again while this follower read it (the flow printed "
                f"from started at {_time(started)}, the one now at {_time(now_started)}): the events above are the "
                "old flow's, and any it wrote after the last read are gone; run it again to follow the new flow")

    async def go(store: Store) -> None:
        nonlocal forgot
        position = after
        waiting = False
        started: int | None = None  # the followed flow's created_at
        while True:
            # Read the status before the events: once closed, no event can follow the read.
            info = await store.describe_flow(known_flow_id(flow_id))
            started = info.created_at_ms if started is None else started
            check_same_flow(started, info.created_at_ms)
            running = info.status == "running"
            if not _askable(stream_name):
                # No stream has such a name, nor ever will: refused even with --follow, which would wait for ever.
                raise no_events(await store.stream_names(flow_id))
            page = await store.read_events(flow_id, stream_name, position, STREAM_PAGE)
            check_same_flow(started, page.flow_started_ms)  # replaced between the two reads
            if position in printed and position >= page.first_sequence and (
                    page.at_after is None or event_digest(page.at_after) != printed[position]):
                # A database crash lost events this follower printed (best-effort ones are written
                # without fsync) and later events took their sequences: reading on after `position`
                # would skip those silently (a turn's end, say). Print on from the first one changed.
                position = await rewind(store, position, page.first_sequence, started)
                continue
            if not page.events and position == after and not waiting:
                names = await store.stream_names(flow_id)
                if stream_name not in names:
                    if not (follow and running):
                        raise no_events(names)
                    # Without a Registry a typo looks like a stream not written yet: say so, then wait.
                    click.echo(f"stream {stream_name!r} of flow {flow_id!r} has no events yet; waiting "
                               f"(streams with events: {names})", err=True)
                    waiting = True
            # Sequences have no gaps but trimmed ones: a follower that falls behind a burst sees one too.
            if page.events and page.events[0].sequence > position + 1:
                click.echo(f"events {position + 1}..{page.events[0].sequence - 1} were trimmed (stream capacity)",
                           err=True)
            for e in page.events:
                click.echo(json.dumps({"sequence": e.sequence, "step_execution_id": e.step_execution_id,
                                       "attempt": e.attempt, "value": json.loads(e.value)}, ensure_ascii=False))
                position = e.sequence
                printed[position] = event_digest(e)
                if len(printed) > FOLLOW_REMEMBERED_EVENTS:
                    del printed[next(iter(printed))]
                    forgot = True
            if len(page.events) == STREAM_PAGE:
                continue
            if not follow or not running:
                return
            await asyncio.sleep(FOLLOW_POLL_SECONDS)

    _run(db_url, go)


@cli.command("skip-timer")
@click.argument("flow_id")
@click.argument("step_execution_id")
@_db_option
def skip_timer(flow_id: str, step_execution_id: str, db_url: str) -> None:
    """Fire the pending timers of a waiting Step execution now."""

    async def go(store: Store) -> None:
        known = known_flow_id(flow_id)
        if not _askable(step_execution_id):  # as AsyncClient.skip_timer: no Step execution ID has one
            raise StepNotWaitingError(flow_id, step_execution_id)
        await store.skip_timer(known, step_execution_id)

    _run(db_url, go)
    click.echo(f"Fired the timers of {step_execution_id} in flow {flow_id}.")


@cli.command()
@click.argument("flow_id")
@click.option("--reason", default="stopped with dex-engine stop", show_default=True)
@_db_option
def stop(flow_id: str, reason: str, db_url: str) -> None:
    """Stop a running flow now, cancelling its active Steps."""
    _run(db_url, lambda store: store.stop_flow(known_flow_id(flow_id), reason))
    click.echo(f"Stopped flow {flow_id}: {reason}")


@cli.command()
@click.argument("flow_id")
@_db_option
def delete(flow_id: str, db_url: str) -> None:
    """Delete a closed flow and everything stored of it (attributes, messages, streams, history)."""

    async def go(store: Store) -> bool:
        try:
            return _askable(flow_id) and await store.delete_flow(known_flow_id(flow_id))
        except FlowStillRunningError:
            # The error's advice names the client's stop_flow; here the command that stops it.
            raise CliError(f"flow {flow_id!r} is still running; stop it first (dex-engine stop {flow_id} "
                           f"--db {shown_url(db_url)}), then delete it (nothing was deleted)") from None

    if not _run(db_url, go):
        raise CliError(f"{FlowNotFoundError(flow_id)} in {shown_url(db_url)}")
    click.echo(f"Deleted flow {flow_id}.")


@cli.command()
@_db_option
def workers(db_url: str) -> None:
    """Registered workers and when their lease expires."""
    rows = _run(db_url, lambda store: store.list_workers())
    now_ms = time.time() * 1000
    console = _console()
    if not rows:
        console.print("No workers registered.")
        return
    table = _table("worker id", "host", "pid", "started", "lease expires", "state")
    for worker_id, host, pid, started, expires in rows:
        state = "live" if expires >= now_ms else "expired (not yet removed)"
        table.add_row(Text(worker_id), Text(host), str(pid), _time(started),
                      f"{_time(expires)} ({_relative(expires, now_ms)})", state)
    console.print(table)


@cli.command()
@click.option("--db", "db_url", metavar="URL",
              help="Database for the demo (default: a fresh file in a new temporary directory; "
                   f"${DB_ENV} is not used, so the demo never writes into your database).")
def demo(db_url: str | None) -> None:
    """Run a small order flow with an in-process worker and show what the engine does."""
    from .demo import DemoError, DemoResult, print_summary, run_demo

    if db_url is None:
        path = os.path.join(tempfile.mkdtemp(prefix="dex-demo-"), "demo.db")
        db_url = f"sqlite:///{path}"
    _check_database(db_url, must_exist=False)
    console = _console()
    url = db_url

    async def go() -> DemoResult:
        store = _open(url)
        try:
            console.print(Text("dex-engine demo: an order flow, run by the engine in this process", style="bold"))
            console.print(Text.assemble(("database ", "dim"), shown_url(url)), soft_wrap=True)
            return await run_demo(store, console)
        finally:
            await store.close()

    try:
        result = asyncio.run(go())
    except DemoError as exc:
        raise click.ClickException(f"the demo failed: {exc}") from None
    print_summary(console, db_url, result)


def main() -> None:
    """Entry point of the `dex-engine` script."""
    try:
        cli(prog_name="dex-engine")
    except OSError as exc:  # click answers only a closed pipe (EPIPE) itself
        raise SystemExit(_os_error(exc)) from None


def _os_error(exc: OSError) -> str:
    """The one-line message of `exc`, which ended a command. One without a file name failed a write
    of the output (a full disk under `> file`): the output goes nowhere from now on, so that the
    interpreter's last flush fails no more."""
    if exc.filename is not None:
        return f"Error: {exc}"
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return f"Error: cannot write the output: {exc}"


if __name__ == "__main__":
    main()
