"""The shard group: one `engine serve` process per rank, started, health-checked, watched, stopped.

Each shard runs in its own session (process group): a Ctrl-C on the terminal reaches only the
launcher, which stops the shards in order, and killing a shard's group also ends any worker
process the shard started itself (torch.compile's compile workers, for one).
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from engine.cli.flags import knob_environment_names
from engine.config import SHARD_SECRET_VARIABLE, EngineConfig
from engine.devices.probe import DevicePlan
from engine.wire import generate_pb2 as pb
from engine.wire import generate_pb2_grpc as pb_grpc
from launcher.checks import pick_free_port
from launcher.cluster import LOOPBACK, wait_for_old_master_gone
from launcher.config import LauncherConfig, child_environment
from launcher.logs import Console, LogTail
from launcher.peers import PeerWatch
from launcher.router_process import RouterFailure, RouterProcess

POLL_S = 0.5  # how soon a dead shard is noticed
HEALTH_RPC_TIMEOUT_S = 2.0
ROUTER_EXIT_S = 5.0  # after its drain (--drain-timeout), for the router to close and exit
FAILURE_GRACE_S = 3.0  # survivors of a failed group: its requests are lost anyway, and a rank
# blocked in a collective with the dead one would never stop by itself
REPORT_LINES = 20
# Reconnect quickly: the socket appears the moment a shard has loaded, and gRPC's default backoff
# would otherwise leave a ready shard unasked for up to two minutes.
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
# The group's own variables, set per rank below, and the knobs' (MAX_BATCH_SIZE, LORA_ADAPTERS):
# a shard gets its knobs as flags only.
INHERITED_VARS_DROPPED = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    SHARD_SECRET_VARIABLE,
    *sorted(knob_environment_names(EngineConfig)),
)


class LaunchFailure(Exception):
    """A shard failed (or never became healthy); `lines` are the log lines that show why."""

    def __init__(self, message: str, lines: list[str] = ()):
        super().__init__(message)
        self.lines = list(lines)


@dataclass
class ShardProcess:
    rank: int
    process: subprocess.Popen
    log: LogTail

    def exit_description(self) -> str:
        code = self.process.returncode
        if code is not None and code < 0:
            return f"was killed by {signal.Signals(-code).name}"
        return f"exited with code {code}"

    def failure(self, when: str) -> LaunchFailure:
        self.log.finish()
        lines = self.log.tail(REPORT_LINES)
        heading = f"its last {len(lines)} log line(s):" if lines else "it logged nothing"
        return LaunchFailure(
            f"shard {self.rank} {self.exit_description()} {when}; {heading}", lines
        )


class ShardGroup:
    def __init__(self, config: LauncherConfig, device: DevicePlan, console: Console):
        self.config, self.device, self.console = config, device, console
        self.shards: list[ShardProcess] = []
        self.channels: dict[int, grpc.Channel] = {}
        self.master_port: int | None = None

    # --- start ---------------------------------------------------------------------------------

    def spawn(self) -> None:
        # A fresh rendezvous port per (re)start unless one was given: the dead group's store may
        # still hold the old one.
        self.master_port = self.config.master_port or pick_free_port(avoid=self.config.router.port)
        self.shards = [self._start(rank) for rank in range(self.config.num_shard)]
        pids = ", ".join(f"{s.rank}: pid {s.process.pid}" for s in self.shards)
        self.console.line(
            f"started {len(self.shards)} shard(s) on {self.device.name} ({pids}), "
            f"sockets {self.config.uds_path}-N, master port {self.master_port}"
        )

    def _start(self, rank: int) -> ShardProcess:
        command = [sys.executable, "-m", "engine", "serve", *self.config.shard_args()]
        process = subprocess.Popen(
            command,
            env=self._env(rank),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        label = self.config.first_rank + rank  # its rank in the whole group
        forward = lambda text, label=label: self.console.line(f"[shard {label}] {text}")  # noqa: E731
        return ShardProcess(rank, process, LogTail(process.stdout, forward))

    def _env(self, rank: int) -> dict[str, str]:
        env = child_environment(os.environ, drop=INHERITED_VARS_DROPPED)
        # BUCKETSERVE_PARENT_PID: a shard stops by itself once this launcher is gone (even
        # SIGKILLed). RANK: in the whole group (launcher/cluster.py); LOCAL_*, GROUP_RANK:
        # torchrun's names.
        env.update(
            RANK=str(self.config.first_rank + rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(self.config.world_size),
            LOCAL_WORLD_SIZE=str(self.config.num_shard),
            GROUP_RANK=str(self.config.node_rank or 0),
            BUCKETSERVE_PARENT_PID=str(os.getpid()),
            MASTER_ADDR=self.config.master_addr or LOOPBACK,
            MASTER_PORT=str(self.master_port),
        )
        env.update(self.config.secret_environment())  # the shard secret, never a flag
        env.update(self.device.env(rank))
        return env

    def wait_healthy(self, stop: threading.Event) -> bool:
        """Block until every shard answers Health (True), or a stop is requested (False).
        Raises LaunchFailure when a shard exits or the start-up timeout passes."""
        start, ready = time.monotonic(), set()
        while True:
            if stop.is_set():
                return False
            self._raise_if_exited("during start-up")
            ready |= {
                r for r in range(self.config.num_shard) if r not in ready and self._healthy(r)
            }
            elapsed = time.monotonic() - start
            if len(ready) == self.config.num_shard:
                self.console.clear_status()
                self.console.line(f"all {len(ready)} shard(s) answer Health after {elapsed:.1f}s")
                return True
            if elapsed > self.config.startup_timeout:
                raise self._timeout(ready)
            self.console.status(self._progress(ready, elapsed))
            stop.wait(POLL_S)

    def _healthy(self, rank: int) -> bool:
        path = self.config.local_socket_path(rank)
        if not os.path.exists(path):  # a shard binds its socket only once its model is loaded
            return False
        if rank not in self.channels:
            self.channels[rank] = grpc.insecure_channel(f"unix://{path}", options=CHANNEL_OPTIONS)
        try:
            stub = pb_grpc.TextGenerationServiceStub(self.channels[rank])
            stub.Health(pb.HealthRequest(), timeout=HEALTH_RPC_TIMEOUT_S)
            return True
        except grpc.RpcError:
            return False

    def warm_up(self) -> None:
        """Warm every shard for the launch's limits, all ranks at once (their forwards meet in
        collectives). A router warms shards once, at its start: after a restart the launcher
        must."""
        limits = self.config.engine
        request = pb.WarmupRequest(
            max_input_tokens=limits.max_input_tokens,
            max_prefill_tokens=limits.max_prefill_tokens,
            max_total_tokens=limits.max_total_tokens,
        )
        stubs = [
            pb_grpc.TextGenerationServiceStub(self.channels[r])
            for r in range(self.config.num_shard)
        ]
        with ThreadPoolExecutor(len(stubs)) as pool:
            list(
                pool.map(
                    lambda stub: stub.Warmup(request, timeout=self.config.startup_timeout), stubs
                )
            )
        self.console.line(f"all {len(stubs)} shard(s) warmed up again")

    def _progress(self, ready: set[int], elapsed: float) -> str:
        waiting = [s for s in self.shards if s.rank not in ready]
        latest = " | ".join(
            f"shard {s.rank}: {s.log.latest[-100:] or '(no output yet)'}" for s in waiting
        )
        return (
            f"waiting for shards: {len(ready)}/{len(self.shards)} ready {sorted(ready)}, "
            f"{elapsed:.0f}s; {latest}"
        )

    def _timeout(self, ready: set[int]) -> LaunchFailure:
        waiting = [s for s in self.shards if s.rank not in ready]
        lines = [f"shard {s.rank}: {line}" for s in waiting for line in s.log.tail(5)]
        heading = "their last log lines:" if lines else "they logged nothing"
        return LaunchFailure(
            f"shard(s) {[s.rank for s in waiting]} not healthy after "
            f"--startup-timeout {self.config.startup_timeout:g}s; {heading}",
            lines,
        )

    # --- watch ---------------------------------------------------------------------------------

    def poll(self) -> ShardProcess | None:
        """The first shard that has exited, if any."""
        return next((s for s in self.shards if s.process.poll() is not None), None)

    def _raise_if_exited(self, when: str) -> None:
        exited = self.poll()
        if exited is not None:
            raise exited.failure(when)

    def pids(self) -> list[int]:
        return [s.process.pid for s in self.shards]

    # --- stop ----------------------------------------------------------------------------------

    def stop(self, grace: float) -> None:
        """SIGTERM every shard, SIGKILL what is left after `grace` seconds, then remove the
        sockets."""
        for shard in self.shards:
            if shard.process.poll() is None:
                signal_group(shard.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for shard in self.shards:
            try:
                shard.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.console.line(f"shard {shard.rank} did not stop within {grace:g}s: killing it")
        for shard in self.shards:
            # Also the members of its group that outlived it; the group id cannot be reused
            # while any of them lives, so this reaches only the shard's own processes.
            signal_group(shard.process.pid, signal.SIGKILL)
            shard.process.wait()
            shard.log.finish()
        for channel in self.channels.values():
            channel.close()
        self.channels.clear()
        self._remove_sockets()
        self.shards = []

    def _remove_sockets(self) -> None:
        """A killed shard leaves its socket file behind; a later launch must not find it."""
        for rank in range(self.config.num_shard):
            path = self.config.local_socket_path(rank)
            try:
                if stat.S_ISSOCK(os.lstat(path).st_mode):
                    os.unlink(path)
            except FileNotFoundError:
                pass


def signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        pass


class RestartBudget:
    """At most `limit` restarts within any `window` seconds: a group that keeps dying is failing."""

    def __init__(self, limit: int, window: float):
        self.limit, self.window = limit, window
        self.times: deque[float] = deque()

    def take(self) -> bool:
        now = time.monotonic()
        while self.times and now - self.times[0] > self.window:
            self.times.popleft()
        if len(self.times) >= self.limit:
            return False
        self.times.append(now)
        return True


def announce(config: LauncherConfig, device: DevicePlan, router: RouterProcess | None) -> None:
    """The line a user needs (on stdout: the rest of the launcher's output goes to stderr)."""
    if router is not None:
        print(
            f"ready: {config.num_shard} shard(s) on {device.name}; the router serves {router.url} "
            f"(try: curl {router.url}/generate -X POST -H 'Content-Type: application/json' "
            """-d '{"inputs": "What is deep learning?", "parameters": {"max_new_tokens": 20}}')""",
            flush=True,
        )
        return
    if (config.node_rank or 0) > 0:
        first, last = config.first_rank, config.first_rank + config.num_shard - 1
        print(
            f"ready: node {config.node_rank} of {config.nnodes}: ranks {first}..{last} of "
            f"{config.world_size} on {device.name}, headless (node 0 runs the router)",
            flush=True,
        )
        return
    master = config.socket_path(0)
    print(
        f"ready: {config.num_shard} shard(s) on {device.name}; master shard socket unix://{master} "
        f"(for TGI's router: text-generation-router --master-shard-uds-path {master})",
        flush=True,
    )


def supervise(
    config: LauncherConfig, device: DevicePlan, console: Console, stop: threading.Event
) -> int:
    """Start the group (and the router) and watch them until a stop (0) or a failure that is not
    restarted (1)."""
    if config.single_process:
        return supervise_single(config, device, console, stop)
    group, routers = ShardGroup(config, device, console), []
    try:
        return _supervise(group, routers, config, device, console, stop)
    finally:
        grace = router_grace(config, console, stop, "the router and the shards")
        for router in routers:
            router.stop(grace)
        group.stop(config.shutdown_timeout if stop.is_set() else FAILURE_GRACE_S)


def router_grace(
    config: LauncherConfig, console: Console, stop: threading.Event, stopping: str
) -> float:
    """Seconds the router gets to stop; a requested stop is announced, and the router first drains
    its admitted requests."""
    if stop.is_set():
        console.line(
            f"{getattr(stop, 'reason', '') or 'stop requested'}: stopping {stopping} "
            f"(SIGTERM, SIGKILL after {config.shutdown_timeout:g}s)"
        )
    drain = config.router.drain_timeout + ROUTER_EXIT_S if stop.is_set() else 0.0
    return max(config.shutdown_timeout, drain)


def supervise_single(
    config: LauncherConfig, device: DevicePlan, console: Console, stop: threading.Event
) -> int:
    """--single-process: one child holds the router and the shard. It is watched like a router:
    when it exits the launcher does (a restart would reload the model; a balancer retries on
    another replica)."""
    router = RouterProcess(config, console, shard_env=device.env(0))
    console.line(
        f"started the router with its shard in process on {device.name} (pid {router.process.pid})"
    )
    try:
        if not router.wait_ready(stop, config.startup_timeout):
            return 0
        announce(config, device, router)
        while not stop.is_set():
            router.raise_if_exited("while serving")
            stop.wait(POLL_S)
        return 0
    except RouterFailure as failure:
        report(console, failure)
        return 1
    finally:
        router.stop(router_grace(config, console, stop, "the router and its shard"))


def _supervise(
    group: ShardGroup, routers: list, config, device, console: Console, stop: threading.Event
) -> int:
    budget, served = RestartBudget(config.max_restarts, config.restart_window), False
    while True:
        group.spawn()
        try:
            starting_router = not config.no_router and not routers
            if (
                starting_router
            ):  # now: its start-up overlaps the shards' (it waits for them to answer)
                routers.append(RouterProcess(config, console))
            if not group.wait_healthy(stop):
                return 0
            if starting_router:
                if not routers[0].wait_ready(stop, config.startup_timeout):
                    return 0
            elif served and config.no_router and config.world_size == config.num_shard:
                # with a router, the router re-warms the shards it finds restarted (the other
                # nodes' too)
                group.warm_up()
            announce(config, device, routers[0] if routers else None)
            served = True
            watch(group, routers[0] if routers else None, stop, PeerWatch.of(group))
            return 0
        except LaunchFailure as failure:
            report(console, failure)
            if not may_restart(config, served, budget, console):
                return 1
        except RouterFailure as failure:
            report(console, failure)
            return 1
        group.stop(FAILURE_GRACE_S)
        if (config.node_rank or 0) > 0:
            wait_for_old_master_gone(config, stop)
        console.line(
            f"restarting all {config.num_shard} shard(s) (restart {len(budget.times)} of at most "
            f"{config.max_restarts} within {config.restart_window:g}s)"
        )


def watch(
    group: ShardGroup,
    router: RouterProcess | None,
    stop: threading.Event,
    peers: PeerWatch | None = None,
) -> None:
    """Return on a stop; raise when a shard or the router exits, or another node's shard is gone."""
    try:
        while not stop.is_set():
            exited = group.poll()
            if exited is not None:
                raise exited.failure("while serving")
            if router is not None:
                router.raise_if_exited("while serving")
            gone = peers.gone() if peers is not None else None
            if gone is not None:
                raise LaunchFailure(gone)
            stop.wait(POLL_S)
    finally:
        if peers is not None:
            peers.close()


def may_restart(
    config: LauncherConfig, served: bool, budget: RestartBudget, console: Console
) -> bool:
    if not (config.restart_on_failure and served):
        return (
            False  # a group that never became healthy is misconfigured: a restart would fail alike
        )
    if budget.take():
        return True
    console.line(
        f"error: giving up: more than {config.max_restarts} restarts within "
        f"{config.restart_window:g}s"
    )
    return False


def report(console: Console, failure: LaunchFailure) -> None:
    console.clear_status()
    console.line(f"error: {failure}")
    for line in failure.lines:
        console.line(f"    {line}")
