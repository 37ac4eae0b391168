"""Command line of the engine alone: `python -m engine serve|buckets|warmup-profile`.

The offline commands that drive the router's scheduler in process (`generate`, `bench`) sit a
layer above, in launcher/offline_cli.py (`bucketserve generate|bench`)."""

from __future__ import annotations

import argparse
import logging
import sys

from engine.cli.flags import add_knob_flags, config_from_args
from engine.cli.logs import configure_logging
from engine.config import (
    EngineConfig,
    distributed_address,
    env_int,
    node_environment,
    shard_secret,
)
from engine.errors import BucketserveError

EXIT_USAGE = 2


class OneLineParser(argparse.ArgumentParser):
    """A command-line mistake is one `error:` line (exit 2): argparse's usage block would bury
    it."""

    def error(self, message):
        self.exit(EXIT_USAGE, f"error: {message} (see --help)\n")


def add_engine_args(parser: argparse.ArgumentParser, exclude=()) -> None:
    """A flag for every EngineConfig knob (engine/config.py), but those in `exclude`."""
    add_knob_flags(parser, EngineConfig, exclude=exclude)
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress at INFO level")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return config_from_args(EngineConfig, args)


def cmd_serve(args: argparse.Namespace) -> None:
    import asyncio

    from engine.serving.server import serve
    from engine.serving.shard import Shard
    from engine.warmup.run import preflight

    if args.log_level:  # the engine's loggers only: the libraries' debug chatter stays off
        logging.getLogger("engine").setLevel(args.log_level.upper())
    settings = server_config(args)
    config = engine_config(args)
    # The model loads before the socket exists: a launcher that waits for the socket then finds a
    # ready shard.
    shard = on_a_passing_thread(
        lambda: Shard(
            config, rank=settings.rank, world_size=settings.world_size, show_progress=args.verbose
        )
    )
    preflight(
        config, shard.fingerprint()
    )  # a bad profile or trace fails now, not at the router's Warmup
    asyncio.run(serve(shard, settings))


def on_a_passing_thread(build):
    """build()'s result, built on a thread that ends with it, so that the shard's worker thread is
    the process's only OpenMP master. Every thread that runs a parallel region keeps a pool of
    OpenMP workers until it exits, and libgomp lets idle workers spin only while it manages no more
    threads than there are CPUs: a model loaded on the main thread left a second pool there, and
    the worker's pool then slept and was woken at each of a decode step's ~200 parallel regions (on
    2 cores a 576x576 projection took 14-41 us instead of 5 us; a lone request's step, 21 ms)."""
    import threading

    built: list = []
    errors: list[BaseException] = []

    def run():
        try:
            built.append(build())
        except BaseException as error:  # re-raised on the calling thread
            errors.append(error)

    thread = threading.Thread(target=run, name="shard-load")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return built[0]


def server_config(args: argparse.Namespace):
    """Server settings: the flags, then what TGI's launcher puts in the environment (RANK,
    WORLD_SIZE; MAX_BATCH_SIZE is the --max-batch-size knob's), then defaults."""
    from engine.serving.remote import outbound_address
    from engine.serving.server import ServerConfig

    rank, world_size = env_int("RANK"), env_int("WORLD_SIZE")
    config = engine_config(args)
    node = node_environment()
    world_size = 1 if world_size is None else world_size
    # More ranks than this node runs: the other nodes' ranks call this one over TCP.
    multi_node = world_size > (node["local_world_size"] or world_size)
    return ServerConfig(
        uds_path=args.uds_path or ServerConfig.uds_path,
        port=args.port,
        rank=0 if rank is None else rank,
        world_size=world_size,
        max_batch_size=config.max_batch_size,
        hostname=args.hostname,
        parent_pid=env_int("BUCKETSERVE_PARENT_PID"),
        otlp_endpoint=config.otlp_endpoint,
        remote_address=outbound_address(distributed_address()[0]) if multi_node else None,
        # stable across restarts (a router keeps the URLs it found), distinct on one host
        remote_port=distributed_address()[1] + 1 + (rank or 0) if multi_node else 0,
        secret=shard_secret(),
        node_rank=node["node_rank"] or 0,
    )


def add_serve_command(commands) -> None:
    srv = commands.add_parser(
        "serve",
        help="serve one shard over gRPC (TGI generate.v3)",
        description="Serve one shard on unix://BASE-RANK. RANK and WORLD_SIZE come from the "
        "environment; --max-batch-size defaults to $MAX_BATCH_SIZE, else 32.",
    )
    add_engine_args(srv)
    srv.add_argument(
        "--uds-path",
        help="socket base path; rank r listens on BASE-r (default: /tmp/text-generation-server)",
    )
    srv.add_argument("--port", type=int, help="also listen on this TCP port")
    srv.add_argument(
        "--hostname", default="127.0.0.1", help="the TCP port's address (default: loopback only)"
    )
    srv.add_argument(
        "--log-level", choices=["debug", "info", "warning"], help="debug: one line per RPC"
    )
    srv.set_defaults(func=cmd_serve)


def build_parser(prog: str = "python -m engine", extra_commands=()) -> argparse.ArgumentParser:
    """The engine's commands; `extra_commands` (functions of the subparsers) let a higher layer add
    its own, such as the `bucketserve` command's generate and bench, without the engine importing
    it."""
    parser = OneLineParser(prog=prog, description="bucketserve engine")
    commands = parser.add_subparsers(dest="command", required=True)
    for add in extra_commands:
        add(commands)
    add_serve_command(commands)
    from engine.cli.buckets import add_buckets_command
    from engine.cli.warmup_profile import add_profile_command

    add_buckets_command(commands)
    add_profile_command(commands)
    return parser


def main(argv: list[str] | None = None, prog: str = "python -m engine", extra_commands=()) -> int:
    args = build_parser(prog, extra_commands).parse_args(argv)
    configure_logging(logging.INFO if args.verbose else logging.WARNING)
    try:
        args.func(args)
    except (BucketserveError, ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0
