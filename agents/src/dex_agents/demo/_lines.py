"""Terminal lines for the chat, read ahead by a daemon thread so a running turn can be steered.

The chat's prompts take lines in order; while a turn runs, the chat looks at the next line without
taking it and applies it only when it is a turn control command (`/steer TEXT`, `/cancel`), so a
line typed for a later prompt (or piped ahead, as the tests do) is never taken for a steer.
"""

from __future__ import annotations

import asyncio
import collections
import os
import sys
import threading

STEER_COMMAND = "/steer"
CANCEL_COMMAND = "/cancel"
# Bytes a read of stdin takes at most: whatever is typed or piped, lines are split from these.
STDIN_READ_BYTES = 65536


class UndecodableLineError(ValueError):
    """A line typed or piped in that is not text in the terminal's encoding; it is dropped."""

    def __init__(self, line: bytes, encoding: str) -> None:
        super().__init__(f"the line {line!r:.60} is not {encoding} text, so it was not sent; type it again")
        self.line = line


def _decoded(raw: bytes, encoding: str) -> str | UndecodableLineError:
    try:
        return raw.decode(encoding)
    except UnicodeDecodeError:
        return UndecodableLineError(raw, encoding)


class TerminalLines:
    """Lines from a terminal (stdin unless `descriptor` names another) in order; None marks the end
    of input."""

    def __init__(self, descriptor: int | None = None, encoding: str | None = None) -> None:
        self._descriptor = sys.stdin.fileno() if descriptor is None else descriptor
        self._encoding = encoding or sys.stdin.encoding
        # An undecodable line is kept as its error, raised by next() in its turn; so is an input that
        # cannot be read (OSError), which ends the lines as None does.
        self._lines: collections.deque[str | UndecodableLineError | OSError | None] = collections.deque()
        self._ready = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        # A daemon thread, not asyncio.to_thread: a blocked input() must not keep the process alive.
        threading.Thread(target=self._read, name="chat-stdin", daemon=True).start()

    def _read(self) -> None:
        # Bytes from the descriptor, decoded here line by line. Not sys.stdin: its decoding either
        # raises in this thread (which then dies, and the chat waits for ever) or, with
        # surrogateescape, passes a line on as text no JSON can hold; and its buffer's lock, held
        # by this thread while it waits, aborts the interpreter as the chat exits.
        encoding = self._encoding
        pending = b""
        while True:
            try:
                chunk = os.read(self._descriptor, STDIN_READ_BYTES)
            except OSError as error:
                # stdin open for writing only (nohup's, for a terminal) or a terminal gone (EIO): no
                # line will come, and the chat must not wait for one for ever.
                unreadable = OSError(error.errno, f"cannot read standard input ({error.strerror}); the chat reads "
                                                  "what you type from it")
                self._loop.call_soon_threadsafe(self._push, unreadable)
                return
            if not chunk:
                if pending:  # a last line without its newline
                    self._loop.call_soon_threadsafe(self._push, _decoded(pending, encoding))
                self._loop.call_soon_threadsafe(self._push, None)
                return
            *lines, pending = (pending + chunk).split(b"\n")
            for raw in lines:
                self._loop.call_soon_threadsafe(self._push, _decoded(raw, encoding))

    def _push(self, line: str | UndecodableLineError | OSError | None) -> None:
        self._lines.append(line)
        self._ready.set()

    async def next(self) -> str | None:
        """The next line, waiting for it; None at end of input (Ctrl-D or a closed pipe).
        UndecodableLineError for a line that is not text; it is taken, and the next call goes on.
        OSError when the input cannot be read."""
        while not self._lines:
            self._ready.clear()
            await self._ready.wait()
        line = self._lines[0]
        if line is not None and not isinstance(line, OSError):  # the end stays, so every later read sees it too
            self._lines.popleft()
        if isinstance(line, (UndecodableLineError, OSError)):
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
