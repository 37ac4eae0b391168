"""The launcher's output: shard logs read from their pipes, and one progress line.

Every line is in the log format the router and the shards use too (engine/cli/logs.py): the
launcher's own lines are named `launcher`, and a child's line gets the child's tag (`[shard 0]`,
`[router]`) before its logger name, or as its name where the child printed it outside `logging`
(a warmup summary, a traceback)."""

from __future__ import annotations

import re
import shutil
import sys
import threading
import time
from collections import deque
from collections.abc import Callable

from engine.cli.logs import line as log_line
from engine.cli.logs import tagged

LINE_END = re.compile(rb"\r\n|\r|\n")
STATUS_EVERY_S = 5.0  # progress as plain log lines (not a terminal): one every few seconds
REDRAW_EVERY_S = 0.5  # progress on a terminal: one line, redrawn in place
CHILD_TAG = re.compile(
    r"(\[(?:shard \d+|router)\]) (.*)", re.DOTALL
)  # how the launcher forwards a child's line
LEVELS = {
    "error: ": "ERROR",
    "warning: ": "WARNING",
}  # the launcher's lines that say how serious they are


def formatted(text: str) -> str:
    """`text` as a log line: the launcher's own, or a child's (its tag, then the child's line)."""
    child = CHILD_TAG.fullmatch(text)
    if child is None:
        level = next((lvl for prefix, lvl in LEVELS.items() if text.startswith(prefix)), "INFO")
        return log_line("launcher", text, level)
    return tagged(*child.groups())


class Console:
    """stderr, shared by the launcher and the shard readers: a lock keeps lines whole, and on a
    terminal the progress line is wiped before a log line and redrawn after it."""

    def __init__(self, stream=None, format_lines: bool = True):
        self.stream = stream or sys.stderr
        self.format_lines = format_lines  # False: lines as given (tests of the progress line)
        self.tty = self.stream.isatty()
        self.lock = threading.Lock()
        self.status_text = ""
        self.status_at = 0.0

    def line(self, text: str) -> None:
        with self.lock:
            self._wipe()
            self.stream.write((formatted(text) if self.format_lines else text) + "\n")
            self._draw()
            self.stream.flush()

    def status(self, text: str) -> None:
        now = time.monotonic()
        with self.lock:
            if now - self.status_at < (REDRAW_EVERY_S if self.tty else STATUS_EVERY_S):
                return
            self.status_at = now
            if not self.tty:
                self.stream.write((formatted(text) if self.format_lines else text) + "\n")
            else:
                self._wipe()
                self.status_text = text[: shutil.get_terminal_size().columns - 1]
                self._draw()
            self.stream.flush()

    def clear_status(self) -> None:
        with self.lock:
            self._wipe()
            self.status_text, self.status_at = "", 0.0
            self.stream.flush()

    def _wipe(self) -> None:
        if self.tty and self.status_text:
            self.stream.write("\r\033[K")

    def _draw(self) -> None:
        if self.tty and self.status_text:
            self.stream.write(self.status_text)


class LogTail:
    """One shard's stdout+stderr, read by a thread so the pipe never fills and blocks the shard.

    Keeps the last lines for error reports. Lines ending in a carriage return are progress bars
    being redrawn (tqdm): they update `latest` but are not forwarded, or a bar would print one
    line per tick."""

    def __init__(self, stream, forward: Callable[[str], None], keep: int = 200):
        self.stream, self.forward = stream, forward
        self.lines: deque[str] = deque(maxlen=keep)
        self.latest = ""
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def tail(self, count: int) -> list[str]:
        return list(self.lines)[-count:]

    def finish(self, timeout: float = 2.0) -> None:
        """Wait for the last bytes of a shard that exited (its traceback), a bounded time."""
        self.thread.join(timeout)

    def _read(self) -> None:
        pending = b""
        while chunk := self.stream.read1(65536):
            pending = self._consume(pending + chunk)
        if pending.strip():
            self._complete(pending)
        self.stream.close()

    def _consume(self, data: bytes) -> bytes:
        """Handle every terminated piece of data; return the unterminated rest."""
        start = 0
        for end in LINE_END.finditer(data):
            if end.group() == b"\r" and end.end() == len(data):
                break  # may be the first half of a \r\n split across two reads
            piece = data[start : end.start()]
            if end.group() == b"\r":
                self._progress(piece)
            else:
                self._complete(piece)
            start = end.end()
        rest = data[start:]
        if rest.strip():
            self.latest = rest.decode(errors="replace").strip()
        return rest

    def _progress(self, piece: bytes) -> None:
        if piece.strip():
            self.latest = piece.decode(errors="replace").strip()

    def _complete(self, piece: bytes) -> None:
        text = piece.decode(errors="replace").rstrip()
        if text.strip():
            self.lines.append(text)
            self.latest = text.strip()
            self.forward(text)
