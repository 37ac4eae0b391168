"""The router as a child of the launcher: started once the shards answer, watched, stopped first.

The router outlives shard restarts: when the shards go away it answers 503 for new requests, holds
the queued ones, and re-warms the shards once they answer again (router/sched/scheduler.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

from engine.cli.flags import knob_environment_names
from engine.config import EngineConfig
from launcher.config import LauncherConfig
from launcher.logs import Console, LogTail

POLL_S = 0.5
REPORT_LINES = 20


class RouterFailure(Exception):
    def __init__(self, message: str, lines: list[str] = ()):
        super().__init__(message)
        self.lines = list(lines)


def warming_status(seconds: float, latest: str) -> str:
    """The progress line while the router warms the shards up; its last log line, once it has
    one."""
    latest = latest[-100:].strip()
    return f"router: warming up the shards, {seconds:.0f}s" + (f"; {latest}" if latest else "")


class RouterProcess:
    """`python -m router` over the shard group's sockets; with `shard_env` (--single-process),
    `python -m launcher.single_process`, which holds the shard itself and gets its environment."""

    def __init__(self, config: LauncherConfig, console: Console, shard_env: dict | None = None):
        self.config, self.console = config, console
        if shard_env is None:
            command = [sys.executable, "-m", "router", *config.router_args()]
        else:
            command = [
                sys.executable,
                "-m",
                "launcher.single_process",
                *config.single_process_args(),
            ]
        env = {
            **config.router_environment(os.environ),
            **(shard_env or {}),
            "BUCKETSERVE_PARENT_PID": str(os.getpid()),
        }  # it stops without us
        if shard_env is not None:  # the shard's knobs come as its flags only, as a shard's do
            for name in knob_environment_names(EngineConfig):
                env.pop(name, None)
        self.process = subprocess.Popen(
            command,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.log = LogTail(self.process.stdout, lambda text: console.line(f"[router] {text}"))

    @property
    def url(self) -> str:
        router = self.config.router
        host = router.hostname if router.hostname not in ("0.0.0.0", "::") else "127.0.0.1"
        return f"http://{host}:{router.port}"

    def wait_ready(self, stop: threading.Event, timeout: float) -> bool:
        """Block until the router answers /health (True) or a stop is requested (False); the router
        warms the shards up first, which takes a while on a large model."""
        start = time.monotonic()
        while not stop.is_set():
            self.raise_if_exited("during start-up")
            if self._healthy():
                self.console.clear_status()
                self.console.line(
                    f"the router answers on {self.url} after {time.monotonic() - start:.1f}s"
                )
                return True
            if time.monotonic() - start > timeout:
                raise self.failure(f"did not answer /health within --startup-timeout {timeout:g}s")
            self.console.status(warming_status(time.monotonic() - start, self.log.latest))
            stop.wait(POLL_S)
        return False

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def exited(self) -> bool:
        return self.process.poll() is not None

    def raise_if_exited(self, when: str) -> None:
        if self.exited():
            raise self.failure(f"exited with code {self.process.returncode} {when}")

    def failure(self, message: str) -> RouterFailure:
        self.log.finish()
        lines = self.log.tail(REPORT_LINES)
        return RouterFailure(f"the router {message}; its last {len(lines)} log line(s):", lines)

    def stop(self, grace: float) -> None:
        """SIGTERM, then SIGKILL after `grace` seconds: before the shards, so no request meets a
        dead one."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.console.line(f"the router did not stop within {grace:g}s: killing it")
                self.process.kill()
                self.process.wait()
        self.log.finish()
