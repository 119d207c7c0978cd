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


class UndecodableLineError(ValueError):
    """A line typed or piped in that is not text in the terminal's encoding; it is dropped."""

    def __init__(self, line: bytes, encoding: str) -> None:
        super().__init__(f"the line {line!r:.60} is not {encoding} text, so it was not sent; type it again")
        self.line = line


class TerminalLines:
    """Lines from stdin in order; None marks the end of input."""

    def __init__(self) -> None:
        # An undecodable line is kept as its error, raised by next() in its turn.
        self._lines: collections.deque[str | UndecodableLineError | None] = collections.deque()
        self._ready = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        # A daemon thread, not asyncio.to_thread: a blocked input() must not keep the process alive.
        threading.Thread(target=self._read, name="chat-stdin", daemon=True).start()

    def _read(self) -> None:
        # Bytes, decoded here line by line: stdin's own decoding either raises in this thread (which
        # then dies, and the chat waits for ever) or, with surrogateescape, passes the line on as
        # text no JSON can hold. Either way one bad line must not end the chat.
        encoding = sys.stdin.encoding
        while True:
            raw = sys.stdin.buffer.readline()
            if not raw:
                self._loop.call_soon_threadsafe(self._push, None)
                return
            text = raw.rstrip(b"\n")
            try:
                line: str | UndecodableLineError = text.decode(encoding)
            except UnicodeDecodeError:
                line = UndecodableLineError(text, encoding)
            self._loop.call_soon_threadsafe(self._push, line)

    def _push(self, line: str | UndecodableLineError | None) -> None:
        self._lines.append(line)
        self._ready.set()

    async def next(self) -> str | None:
        """The next line, waiting for it; None at end of input (Ctrl-D or a closed pipe).
        UndecodableLineError for a line that is not text; it is taken, and the next call goes on."""
        while not self._lines:
            self._ready.clear()
            await self._ready.wait()
        line = self._lines[0]
        if line is not None:  # the end of input stays, so every later read sees it too
            self._lines.popleft()
        if isinstance(line, UndecodableLineError):
            raise line
        return line

    def take_control(self) -> str | None:
        """The next line when it is already typed and is a turn control command; it is taken."""
        line = self._lines[0] if self._lines else None
        if isinstance(line, str) and is_control(line):
            self._lines.popleft()
            return line
        return None


def is_control(line: str | None) -> bool:
    """`/cancel`, or `/steer` followed by text."""
    if line is None:
        return False
    text = line.strip()
    return text == CANCEL_COMMAND or text.startswith(STEER_COMMAND + " ")
