"""The start-up log: one line format for the launcher, the router and the shards, warmup summaries
without figures that say nothing on the device, and progress lines without dangling separators."""

from __future__ import annotations

import io
import logging
import re
import threading

import pytest

from engine.devices.cpu.adapter import CPUAdapter
from engine.warmup.warm import PhaseLog
from launcher.logs import Console
from launcher.router_process import RouterProcess

# TIME LEVEL NAME: MESSAGE, where NAME may carry a child's tag before it and a request id after it.
ONE_FORMAT = re.compile(
    r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d (INFO|WARNING|ERROR|DEBUG) "
    r"(\[[a-z0-9 ]+\]( [\w.]+)?|[\w.]+)( \[[\w-]+\])?: \S"
)


@pytest.fixture
def root_logging():
    """Each test may reconfigure the root logger: put it back afterwards."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_the_shard_commands_log_in_the_shared_format(root_logging, capsys):
    from engine.cli.main import main

    assert (
        main(
            [
                "buckets",
                "--max-batch-size",
                "2",
                "--max-input-tokens",
                "32",
                "--max-total-tokens",
                "64",
                "--max-prefill-tokens",
                "64",
                "--block-size",
                "16",
            ]
        )
        == 0
    )
    logging.getLogger("engine.serving.server").warning("listening on unix:///tmp/x-0")
    lines = [line for line in capsys.readouterr().err.splitlines() if "listening" in line]
    assert len(lines) == 1 and ONE_FORMAT.match(lines[0]), lines
    assert lines[0].endswith(" WARNING engine.serving.server: listening on unix:///tmp/x-0")


def test_the_router_logs_in_the_shared_format_naming_the_request(root_logging, capsys):
    from router.__main__ import main
    from router.http.access import REQUEST_ID

    with pytest.raises(SystemExit):
        main(["--help"])  # logging is set up before the flags are read
    capsys.readouterr()
    logging.getLogger("router.app").info("serving on http://127.0.0.1:8080")
    token = REQUEST_ID.set("my-trace-42")
    try:
        logging.getLogger("router.http.access").info("POST /generate -> 200 in 0.010s")
    finally:
        REQUEST_ID.reset(token)
    outside, inside = capsys.readouterr().err.splitlines()
    assert ONE_FORMAT.match(outside) and outside.endswith(
        " INFO router.app: serving on http://127.0.0.1:8080"
    )
    assert (
        ONE_FORMAT.match(inside)
        and " INFO router.http.access [my-trace-42]: POST /generate" in inside
    )


def test_the_launcher_prints_its_own_and_its_childrens_lines_in_the_shared_format():
    from engine.cli.logs import LineFormatter

    def child_line(name: str) -> str:
        return LineFormatter().format(
            logging.LogRecord(name, logging.INFO, __file__, 1, "ready", None, None)
        )

    stream = io.StringIO()
    console = Console(stream)
    console.line("started 1 shard(s) on cpu (pid 1)")
    console.line("error: shard 0 exited with code 2 during start-up")
    console.line(f"[shard 0] {child_line('engine.serving.server')}")
    console.line(f"[router] {child_line('router.app')}")
    console.line(
        "[shard 0] warmup full: 4 prefill + 2 decode buckets (6 graphs) in 0.1s"
    )  # printed, not logged
    lines = stream.getvalue().splitlines()
    assert all(ONE_FORMAT.match(line) for line in lines), lines
    assert (
        " INFO launcher: started 1 shard(s)" in lines[0]
        and " ERROR launcher: error: shard 0" in lines[1]
    )
    assert " INFO [shard 0] engine.serving.server: ready" in lines[2]
    assert " INFO [router] router.app: ready" in lines[3]
    assert " INFO [shard 0]: warmup full" in lines[4]


class FakeAdapter:
    """Memory that falls by 1 GiB at each look, as a device's does while warmup allocates."""

    own_memory = True

    def __init__(self):
        self.free = 80 * 2**30

    def memory_info(self):
        self.free -= 2**30
        return self.free, 96 * 2**30

    def synchronize(self):
        pass


def phases_of(adapter) -> str:
    log = PhaseLog(adapter)
    for name in ("largest prefill", "kv cache", "buckets"):
        log.mark(name)
    return log.summary()


def test_a_cpu_warmup_summary_prints_no_memory_figures():
    summary = phases_of(CPUAdapter())
    assert "GiB" not in summary and "memory" not in summary, summary
    assert re.fullmatch(
        r"\d+\.\ds: largest prefill \d+\.\ds, kv cache \d+\.\ds, buckets \d+\.\ds", summary
    )


def test_a_device_warmup_summary_keeps_its_memory_figures():
    summary = phases_of(FakeAdapter())
    assert summary.count("GiB") == 4 and "free memory -3.00 GiB" in summary, summary


class QuietLog:
    latest = ""  # the router has printed nothing yet


def test_the_router_progress_line_has_no_dangling_separator():
    stream = io.StringIO()
    process = RouterProcess.__new__(RouterProcess)  # no subprocess: only the waiting loop runs
    answers = iter([False, True])
    process.console, process.log = Console(stream), QuietLog()
    process.raise_if_exited = lambda when: None
    process._healthy = lambda: next(answers)
    router = type("RouterConfig", (), {"hostname": "127.0.0.1", "port": 8080})()
    process.config = type("LauncherConfig", (), {"router": router})()
    assert process.wait_ready(threading.Event(), timeout=60)
    status = [line for line in stream.getvalue().splitlines() if "warming up" in line]
    assert len(status) == 1 and status[0].endswith(
        " launcher: router: warming up the shards, 0s"
    ), status
