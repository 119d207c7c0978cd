"""Rendezvous and ground truth across Worker processes: FileGate and InvocationLog."""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from .._policy import shown
from ._stack import exit_if_test_process_gone
from ._waiting import DEFAULT_WAIT_SECONDS, wait_until


class FileGate:
    """A point in a Worker child where a handler stops until the test releases it (or kills the child).

    The child calls `mark_reached()` then awaits `wait_for_release()`; the test awaits
    `wait_until_reached()` and then calls `release()` or kills the Worker at that exact point.
    """

    def __init__(self, state_dir: Path | str, name: str) -> None:
        given: object = name  # typed str; a number was refused with "argument of type 'int' is not iterable"
        if not isinstance(given, str):
            raise ValueError(f"gate name must be a str, got {type(given).__name__}: {shown(given)}; give it as text")
        if not name or "/" in name:
            raise ValueError(f"gate name {name!r} must be non-empty and contain no '/'")
        self.name = name
        self.reached_path = Path(state_dir) / f"{name}.reached"
        self.release_path = Path(state_dir) / f"{name}.release"
        # One file per handler waiting at the gate; release() deletes them all. A waiter polls,
        # so a release() the test follows at once with reset() (to stop the next handler) removes
        # the release file before the waiter looks: the missing token still lets it through.
        self.waiting_dir = Path(state_dir) / f"{name}.waiting"

    def mark_reached(self) -> None:
        """Record that this process reached the gate; safe to call again, and from several threads
        at once (parallel calls of a sync tool): each call writes a temporary file of its own."""
        tmp = self.reached_path.with_name(f"{self.reached_path.name}.tmp{os.getpid()}-{threading.get_ident()}")
        tmp.write_text(str(os.getpid()))
        os.replace(tmp, self.reached_path)  # the test never sees the file without the pid

    async def wait_for_release(self) -> None:
        """Mark the gate reached by this process and wait, yielding, until the test releases it.
        Marked again on every call: a retry in a new Worker, after the first was killed here,
        replaces the dead Worker's pid."""
        token = self._start_waiting()
        await wait_until(f"gate {self.name} released", lambda: self._released(token), timeout=float("inf"))

    def wait_for_release_blocking(self, poll: float = 0.01) -> None:
        """The same from a thread (e.g. a sync tool run in a worker thread)."""
        token = self._start_waiting()
        while not self._released(token):
            time.sleep(poll)

    def _start_waiting(self) -> Path:
        """This handler's waiting token, made before it marks the gate reached: a release() that
        follows wait_until_reached() then always finds (and deletes) it."""
        self.waiting_dir.mkdir(exist_ok=True)
        # One per call: parallel async handlers of one Worker share its process and thread.
        token = self.waiting_dir / f"{os.getpid()}-{uuid.uuid4().hex}"
        token.touch()
        self.mark_reached()
        return token

    def _released(self, token: Path) -> bool:
        # A Worker child may wait here before run_agent_worker watches the test process.
        exit_if_test_process_gone()
        if self.release_path.exists() or not token.exists():
            token.unlink(missing_ok=True)
            return True
        return False

    @property
    def reached(self) -> bool:
        return self.reached_path.exists()

    async def wait_until_reached(self, timeout: float = DEFAULT_WAIT_SECONDS, *, other_than: int | None = None) -> int:
        """Wait until a handler reached the gate; return the pid of the process that reached it.
        With `other_than` (the pid of a Worker killed at the gate), wait until another process
        reached it: the retry in the Worker that took over."""

        def reached_by() -> int | None:
            try:
                pid = int(self.reached_path.read_text())
            except FileNotFoundError:
                return None
            return None if pid == other_than else pid

        # The file it looks for: a handler that marks its gates in another directory (a state_dir
        # other than the Worker child's ENV_STATE_DIR) never reaches this one.
        waited_for = (f"gate {self.name} reached" + (f" by a process other than {other_than}" if other_than else "")
                      + f" (its mark {str(self.reached_path)!r})")
        found: int = await wait_until(waited_for, reached_by, timeout=timeout)
        return found

    def release(self) -> None:
        """Let every handler waiting at the gate go on, and any that reaches it until reset()."""
        self.release_path.write_text("go")
        if self.waiting_dir.is_dir():
            for token in self.waiting_dir.iterdir():
                token.unlink(missing_ok=True)

    def reset(self) -> None:
        """Neither reached nor released: the gate stops the next handler again (a second kill at
        the same point, say). A handler released before stays released, even one that has not
        looked yet."""
        self.reached_path.unlink(missing_ok=True)
        self.release_path.unlink(missing_ok=True)


class InvocationLog:
    """Append-only JSON lines, one fsynced O_APPEND write each, shared by every Worker process.

    Records survive SIGKILL, so tests count real tool and model calls across Worker restarts.
    """

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)

    def record(self, kind: str, **fields: Any) -> None:
        line = json.dumps({"kind": kind, "pid": os.getpid(), **fields}, sort_keys=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            data = (line + "\n").encode()
            while data:  # a short write (a signal, a nearly full disk) left the rest unwritten: a torn line
                data = data[os.write(fd, data):]
            os.fsync(fd)
        finally:
            os.close(fd)

    def entries(self, kind: str | None = None, **match: Any) -> list[dict[str, Any]]:
        """Complete lines (a line a live child is still writing is left out), filtered."""
        if not self.path.exists():
            return []
        out = []
        for number, line in enumerate(self.path.read_text().split("\n")[:-1], start=1):
            if not line:
                continue
            try:
                entry: dict[str, Any] = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"line {number} of the invocation log {str(self.path)!r} is not a JSON record "
                                 f"({exc}): {line[:200]!r}; record() writes whole lines, so something else wrote "
                                 "to the file") from None
            if kind is not None and entry.get("kind") != kind:
                continue
            if all(entry.get(k) == v for k, v in match.items()):
                out.append(entry)
        return out

    def count(self, kind: str | None = None, **match: Any) -> int:
        return len(self.entries(kind, **match))


