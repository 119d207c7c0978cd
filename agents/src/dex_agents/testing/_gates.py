"""Rendezvous and ground truth across Worker processes: FileGate and InvocationLog."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from ._waiting import DEFAULT_WAIT_SECONDS, wait_until


class FileGate:
    """A point in a Worker child where a handler stops until the test releases it (or kills the child).

    The child calls `mark_reached()` then awaits `wait_for_release()`; the test awaits
    `wait_until_reached()` and then calls `release()` or kills the Worker at that exact point.
    """

    def __init__(self, state_dir: Path | str, name: str) -> None:
        if not name or "/" in name:
            raise ValueError(f"gate name {name!r} must be non-empty and contain no '/'")
        self.name = name
        self.reached_path = Path(state_dir) / f"{name}.reached"
        self.release_path = Path(state_dir) / f"{name}.release"

    def mark_reached(self) -> None:
        """Record that this process reached the gate; safe to call again, and from several threads
        at once (parallel calls of a sync tool): each call writes a temporary file of its own."""
        tmp = self.reached_path.with_name(f"{self.reached_path.name}.tmp{os.getpid()}-{threading.get_ident()}")
        tmp.write_text(str(os.getpid()))
        os.replace(tmp, self.reached_path)  # the test never sees the file without the pid

    async def wait_for_release(self) -> None:
        """Mark the gate reached (if not yet) and wait, yielding, until the test releases it."""
        if not self.reached_path.exists():
            self.mark_reached()
        await wait_until(f"gate {self.name} released", self.release_path.exists, timeout=float("inf"))

    def wait_for_release_blocking(self, poll: float = 0.01) -> None:
        """The same from a thread (e.g. a sync tool run in a worker thread)."""
        if not self.reached_path.exists():
            self.mark_reached()
        while not self.release_path.exists():
            time.sleep(poll)

    @property
    def reached(self) -> bool:
        return self.reached_path.exists()

    async def wait_until_reached(self, timeout: float = DEFAULT_WAIT_SECONDS) -> int:
        """Wait until a handler reached the gate; return the pid of the process that reached it."""
        await wait_until(f"gate {self.name} reached", self.reached_path.exists, timeout=timeout)
        return int(self.reached_path.read_text())

    def release(self) -> None:
        self.release_path.write_text("go")


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
            os.write(fd, (line + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)

    def entries(self, kind: str | None = None, **match: Any) -> list[dict[str, Any]]:
        """Complete lines (a line a live child is still writing is left out), filtered."""
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_text().split("\n")[:-1]:
            if not line:
                continue
            entry: dict[str, Any] = json.loads(line)
            if kind is not None and entry.get("kind") != kind:
                continue
            if all(entry.get(k) == v for k, v in match.items()):
                out.append(entry)
        return out

    def count(self, kind: str | None = None, **match: Any) -> int:
        return len(self.entries(kind, **match))


