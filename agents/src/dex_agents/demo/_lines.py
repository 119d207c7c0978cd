"""Terminal lines for the chat, read ahead by a daemon thread so a running turn can be steered.

The chat's prompts take lines in order; while a turn runs, the chat looks at the next line without
taking it and applies it only when it is a turn control command (`/steer TEXT`, `/cancel`), so a
line typed for a later prompt (or piped ahead, as the tests do) is never taken for a steer.
"""

from __future__ import annotations

import asyncio
import collections
import sys
import threading

STEER_COMMAND = "/steer"
CANCEL_COMMAND = "/cancel"


class TerminalLines:
    """Lines from stdin in order; None marks the end of input."""

    def __init__(self) -> None:
        self._lines: collections.deque[str | None] = collections.deque()
        self._ready = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        # A daemon thread, not asyncio.to_thread: a blocked input() must not keep the process alive.
        threading.Thread(target=self._read, name="chat-stdin", daemon=True).start()

    def _read(self) -> None:
        while True:
            line = sys.stdin.readline()
            self._loop.call_soon_threadsafe(self._push, line.rstrip("\n") if line else None)
            if not line:
                return

    def _push(self, line: str | None) -> None:
        self._lines.append(line)
        self._ready.set()

    async def next(self) -> str | None:
        """The next line, waiting for it; None at end of input (Ctrl-D or a closed pipe)."""
        while not self._lines:
            self._ready.clear()
            await self._ready.wait()
        line = self._lines[0]
        if line is not None:  # the end of input stays, so every later read sees it too
            self._lines.popleft()
        return line

    def take_control(self) -> str | None:
        """The next line when it is already typed and is a turn control command; it is taken."""
        if self._lines and is_control(self._lines[0]):
            return self._lines.popleft()
        return None


def is_control(line: str | None) -> bool:
    """`/cancel`, or `/steer` followed by text."""
    if line is None:
        return False
    text = line.strip()
    return text == CANCEL_COMMAND or text.startswith(STEER_COMMAND + " ")
