"""Command line: `python -m launcher`, with TGI's launcher's flag names where they exist."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from dataclasses import replace

from engine.cli.flags import add_knob_flags
from engine.cli.flags import config_from_args as knobs_from_args
from engine.cli.main import EXIT_USAGE as EXIT_CONFIG
from engine.cli.main import OneLineParser
from engine.devices.probe import DeviceError, DevicePlan, resolve_device
from engine.errors import BucketserveError
from launcher.checks import (
    ConfigError,
    check_limits,
    check_placement,
    check_port,
    check_socket_base,
    check_split,
    check_stages,
    unique_socket_base,
)
from launcher.cluster import check_grid, resolve_cluster
from launcher.config import ROUTER_SET_BY_LAUNCHER, LauncherConfig
from launcher.logs import Console
from launcher.supervisor import supervise

# EXIT_CONFIG, as `python -m engine`: the command line or the host is wrong, nothing was started
ENGINE_COMMANDS = ("generate", "bench", "serve", "buckets", "warmup-profile", "check-shapes")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="python -m launcher",
        description="Start one `engine serve` shard per rank, wait until "
        "all answer Health, start the HTTP router over them, and supervise them all. SIGTERM or "
        "SIGINT stops them gracefully.",
        epilog=(
            "Other commands: `bucketserve generate|bench|serve|buckets|warmup-profile|loadtest "
            "...` (serve, buckets and warmup-profile are also `python -m engine ...`)."
        ),
    )
    # every knob of the shards and the router, each shared one once (engine/cli/flags.py)
    add_knob_flags(p, LauncherConfig, exclude=ROUTER_SET_BY_LAUNCHER)
    return p


def config_from_args(args: argparse.Namespace) -> LauncherConfig:
    return knobs_from_args(LauncherConfig, args)


def resolve(config: LauncherConfig, console: Console) -> tuple[LauncherConfig, DevicePlan]:
    """Check everything that can be checked before a shard starts; the concrete config and
    device."""
    config = resolve_cluster(config, os.environ)
    engine, router = config.engine, config.router
    check_limits(
        engine.max_input_tokens,
        engine.max_total_tokens,
        engine.max_prefill_tokens,
        config.num_shard,
        chunked=engine.prefix_caching,
    )
    if router.max_concurrent_requests < 1:
        raise ConfigError(
            f"--max-concurrent-requests must be at least 1, not {router.max_concurrent_requests}"
        )
    check_port("--port", router.port)
    check_single_process(config)
    if config.master_port is not None:
        if config.master_port == router.port:
            raise ConfigError(f"--master-port {config.master_port} is also the --port")
        if config.node_rank == 0:  # the other nodes' master is node 0's rank 0
            check_port("--master-port", config.master_port)
    stages = engine.pipeline_parallel_size
    if engine.device != "auto":  # a named device's conflicts need no probe
        check_placement(engine.quantize, engine.device, stages)
    device = resolve_device(
        engine.device,
        config.num_shard,
        os.environ,
        list_adapters,
        warn=lambda message: console.line(f"warning: {message}"),
        graph_mode=engine.graph_mode,
        world_size=config.world_size,
    )
    check_placement(engine.quantize, device.name, stages)
    if device.name == "cpu":
        from engine.devices.cpu.isa import cap

        cap()  # BUCKETSERVE_CPU_ISA at a level this CPU runs, else one line (isa.IsaError)
    check_grid(
        config.world_size, stages, lambda tp: check_split(engine.model_id, tp, tp_what(config, tp))
    )
    check_stages(engine.model_id, stages)
    base = config.uds_path or unique_socket_base()
    check_socket_base(base, config.num_shard)
    # The shards run the graph mode their environment was made for (HPU: the release's default).
    graph_mode = device.graph_mode or engine.graph_mode
    engine = replace(engine, device=device.name, graph_mode=graph_mode)
    return replace(config, engine=engine, uds_path=base), device


def check_single_process(config: LauncherConfig) -> None:
    """--single-process holds one whole shard in the router's process: no group to split a model
    over, no router-less launch, no shard restart apart from the router."""
    if not config.single_process:
        return
    conflicts = [
        (config.world_size > 1, f"{config.world_size} ranks (--num-shard, --nnodes)"),
        (config.engine.pipeline_parallel_size > 1, "--pipeline-parallel-size"),
        (config.no_router, "--no-router"),
        (config.restart_on_failure, "--restart-on-failure (shard and router are one process)"),
    ]
    for conflicting, what in conflicts:
        if conflicting:
            raise ConfigError(
                f"--single-process runs one shard in the router's process: not with {what}"
            )


def tp_what(config: LauncherConfig, tp: int) -> str:
    """How a launch's flags made `tp` tensor-parallel ranks per stage, for its error line."""
    if tp == config.num_shard and config.world_size == config.num_shard:
        return ""
    return (
        f"{tp} tensor-parallel ranks per stage (--num-shard {config.num_shard} x --nnodes "
        f"{config.nnodes} / --pipeline-parallel-size {config.engine.pipeline_parallel_size})"
    )


def list_adapters() -> list[str]:
    from engine.devices import available_devices  # imports torch: only when a device needs it

    return available_devices()


class StopRequest(threading.Event):
    """Set by SIGTERM / SIGINT. The handler only records: the main loop, polling, does the work."""

    def __init__(self):
        super().__init__()
        self.reason = ""

    def install(self) -> StopRequest:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.reason = self.reason or signal.Signals(signum).name
        self.set()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console, stop = Console(), StopRequest().install()
    try:
        config, device = resolve(config_from_args(args), console)
    except (ConfigError, DeviceError, BucketserveError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_CONFIG
    if stop.is_set():
        return 0
    code = supervise(config, device, console, stop)
    if stop.is_set():
        console.line(f"{stop.reason}: all shards stopped")
    return code


def bucketserve(argv: list[str] | None = None) -> int:
    """The `bucketserve` command: the launcher; with a first word of generate / bench / serve /
    buckets / warmup-profile, that command of the engine; with `loadtest`, the load generator; with
    `cache`, the conversion cache's list and clear."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "loadtest":
        from launcher.loadtest import main as loadtest_main

        return loadtest_main(argv[1:])
    if argv and argv[0] == "cache":
        from launcher.cache_cli import main as cache_main

        return cache_main(argv[1:])
    if argv and argv[0] in ENGINE_COMMANDS:
        from engine.cli.main import main as engine_main
        from launcher.offline_cli import add_offline_commands

        return engine_main(argv, prog="bucketserve", extra_commands=(add_offline_commands,))
    return main(argv)
