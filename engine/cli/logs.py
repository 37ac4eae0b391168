"""One log line format for the launcher, the router and the shards: `TIME LEVEL NAME: MESSAGE`.

The three run as separate processes and the launcher interleaves their output on one stderr, so
they share this format, and the launcher gives its own lines (and a child's lines that are not log
records, such as a traceback) the same shape with `line()`. A router record about an HTTP request
names it: `NAME [REQUEST_ID]: MESSAGE`.
"""

from __future__ import annotations

import logging
import re
import sys
import time

DATE_FORMAT = "%Y-%m-%d %H:%M:%S"
# A line already in the format: (time and level, name and message).
LOG_LINE = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d [A-Z]+) ([^:]+: .*)", re.DOTALL)


class LineFormatter(logging.Formatter):
    """`TIME LEVEL NAME: MESSAGE`, with ` [REQUEST_ID]` after the name on a request's records."""

    def __init__(self):
        super().__init__("%(asctime)s %(levelname)s %(source)s: %(message)s", DATE_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        request_id = getattr(record, "request_id", None)
        record.source = (
            record.name if request_id in (None, "-") else f"{record.name} [{request_id}]"
        )
        return super().format(record)


class StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time (a test's capture, a redirected stream)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ assigns it
        pass


def configure_logging(level: int | str = logging.INFO) -> logging.Handler:
    """The process's root handler on stderr in the shared format: replaces one an earlier call
    added, leaves any other (a test runner's) in place."""
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, StderrHandler)]:
        root.removeHandler(old)
    handler = StderrHandler()
    handler.setFormatter(LineFormatter())
    root.addHandler(handler)
    root.setLevel(level)
    return handler


def line(name: str, message: str, level: str = "INFO") -> str:
    """A line that does not go through `logging`, in the same format."""
    return f"{time.strftime(DATE_FORMAT)} {level} {name}: {message}"


def tagged(tag: str, text: str) -> str:
    """A child process's line as its parent prints it: `tag` before the logger's name, or as the
    name of a line the child printed outside `logging`."""
    record = LOG_LINE.fullmatch(text)
    if record is None:
        return line(tag, text)
    head, rest = record.groups()
    return f"{head} {tag} {rest}"
