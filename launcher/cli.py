"""Command line: `python -m launcher`, with TGI's launcher's flag names where they exist."""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from dataclasses import replace

from engine.config import env_lora_adapters
from engine.errors import BucketserveError
from launcher.checks import ConfigError, check_limits, check_port, check_socket_base, check_split, unique_socket_base
from engine.devices.probe import DEVICES, DeviceError, DevicePlan, resolve_device
from launcher.config import DEFAULT_PORT, LauncherConfig
from launcher.logs import Console
from launcher.supervisor import supervise

EXIT_CONFIG = 2  # as `python -m engine`: the command line or the host is wrong, nothing was started
ENGINE_COMMANDS = ("generate", "bench", "serve", "buckets", "warmup-profile")


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):  # argparse's usage block would bury the one line that matters
        self.exit(EXIT_CONFIG, f"error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    d = LauncherConfig()
    p = OneLineParser(prog="python -m launcher", description="Start one `engine serve` shard per rank, wait until "
                      "all answer Health, start the HTTP router over them, and supervise them all. SIGTERM or "
                      "SIGINT stops them gracefully.",
                      epilog="Other commands: `bucketserve generate|bench|serve|buckets|warmup-profile|loadtest ...` "
                             "(serve, buckets and warmup-profile are also `python -m engine ...`).")
    p.add_argument("--model-id", help="HF model directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--num-shard", type=int, default=d.num_shard, help="tensor-parallel ranks, one process each")
    p.add_argument("--device", default=d.device, help=f"{'|'.join(DEVICES)} (auto: an accelerator when one is "
                   "usable and supported, else cpu)")
    p.add_argument("--dtype", help="auto (default: bfloat16 on CPUs with AVX512-BF16 or AMX, else float32; "
                   "accelerators: their default), float32, bfloat16 or float16")
    p.add_argument("--quantize", choices=["none", "int8", "int4", "fp8"],
                   help="weights: none (default), int8 or int4 (CPU; GGUF Q4_0/Q4_1 kept as stored), fp8 checkpoints")
    p.add_argument("--max-batch-size", type=int, default=d.max_batch_size)
    p.add_argument("--max-input-tokens", type=int, default=d.max_input_tokens)
    p.add_argument("--max-total-tokens", type=int, default=d.max_total_tokens)
    p.add_argument("--max-batch-prefill-tokens", dest="max_prefill_tokens", type=int, default=d.max_prefill_tokens,
                   help="passed to each shard as --max-prefill-tokens")
    p.add_argument("--block-size", type=int, help="KV cache block size in tokens (default: the device's)")
    p.add_argument("--warmup", choices=["full", "progressive", "none"],
                   help="each shard's warmup: full (default), progressive (healthy sooner), none")
    p.add_argument("--warmup-profile", help="profile.json of `python -m engine warmup-profile`: warm exactly its buckets")
    p.add_argument("--record-shapes", help="JSONL file the shards append their served batch shapes to")
    p.add_argument("--lora-adapters", help="PEFT LoRA adapters every shard serves, name=dir[,name=dir...] "
                   "(default: $LORA_ADAPTERS)")
    p.add_argument("--lora-impl", choices=["dense", "gather"], help="LoRA operations (default: the device's)")
    p.add_argument("--implementation", choices=["auto", "native", "transformers"],
                   help="auto (default): native when the architecture has one, else the transformers fallback")
    p.add_argument("--moe-impl", choices=["dense", "gather"], help="MoE experts (default: the device's)")
    p.add_argument("--prefix-caching", choices=["on", "off"], default=d.prefix_caching,
                   help="on (default): requests reuse the KV blocks of cached prompt prefixes (shards and router)")
    p.add_argument("--lookahead", choices=["auto", "on", "off"], default=d.lookahead,
                   help="on: while nothing waits to be admitted, the shards run a batch's next forward as soon as "
                        "they answer a step (async scheduling); auto (default): on unless the shards run on CPU")
    p.add_argument("--uds-path", help="socket base: rank r listens on BASE-r (default: a unique path per launch)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT,
                   help="the router's HTTP port (checked even with --no-router)")
    p.add_argument("--master-port", type=int, help="torch.distributed rendezvous port (default: a free one)")
    p.add_argument("--hostname", default=d.hostname, help="the router's HTTP address")
    p.add_argument("--payload-limit", type=int, default=d.payload_limit,
                   help="largest request body in bytes; a larger one gets HTTP 413 (TGI's flag and default)")
    p.add_argument("--max-concurrent-requests", type=int, default=d.max_concurrent_requests,
                   help="queued + running requests the router holds; beyond it a request gets HTTP 429")
    p.add_argument("--api-key", help="the router requires `Authorization: Bearer KEY` (default: $BUCKETSERVE_API_KEY); "
                   "passed to it in its environment, not on its command line")
    p.add_argument("--cors-allow-origin", action="append", default=[], help="an origin browsers may call from")
    p.add_argument("--otlp-endpoint", help="the OpenTelemetry collector of the router and the shards (default: no tracing)")
    p.add_argument("--no-router", action="store_true", help="start the shards only and print the master socket")
    p.add_argument("--restart-on-failure", action="store_true",
                   help=f"restart the whole group when a shard dies (at most {d.max_restarts} times "
                        f"within {d.restart_window:g}s)")
    p.add_argument("--startup-timeout", type=float, default=d.startup_timeout,
                   help="seconds until every shard answers Health")
    p.add_argument("--shutdown-timeout", type=float, default=d.shutdown_timeout,
                   help="seconds a shard may take to stop gracefully before it is killed")
    return p


def config_from_args(args: argparse.Namespace) -> LauncherConfig:
    return LauncherConfig(
        model_id=args.model_id, num_shard=args.num_shard, device=args.device, dtype=args.dtype, quantize=args.quantize,
        max_batch_size=args.max_batch_size, max_input_tokens=args.max_input_tokens,
        max_total_tokens=args.max_total_tokens, max_prefill_tokens=args.max_prefill_tokens,
        block_size=args.block_size, warmup=args.warmup, warmup_profile=args.warmup_profile,
        record_shapes=args.record_shapes, lora_adapters=args.lora_adapters or env_lora_adapters(),
        lora_impl=args.lora_impl, implementation=args.implementation, moe_impl=args.moe_impl, prefix_caching=args.prefix_caching,
        lookahead=args.lookahead, uds_path=args.uds_path, port=args.port, master_port=args.master_port,
        hostname=args.hostname, max_concurrent_requests=args.max_concurrent_requests, payload_limit=args.payload_limit,
        no_router=args.no_router, restart_on_failure=args.restart_on_failure,
        startup_timeout=args.startup_timeout, shutdown_timeout=args.shutdown_timeout, api_key=args.api_key,
        cors_allow_origins=tuple(args.cors_allow_origin), otlp_endpoint=args.otlp_endpoint,
    )


def resolve(config: LauncherConfig, console: Console) -> tuple[LauncherConfig, DevicePlan]:
    """Check everything that can be checked before a shard starts; the concrete config and device."""
    check_limits(config.max_input_tokens, config.max_total_tokens, config.max_prefill_tokens, config.num_shard,
                 chunked=config.prefix_caching == "on")
    if config.max_concurrent_requests < 1:
        raise ConfigError(f"--max-concurrent-requests must be at least 1, not {config.max_concurrent_requests}")
    check_port("--port", config.port)
    if config.master_port is not None:
        if config.master_port == config.port:
            raise ConfigError(f"--master-port {config.master_port} is also the --port")
        check_port("--master-port", config.master_port)
    device = resolve_device(config.device, config.num_shard, os.environ, list_adapters,
                            warn=lambda message: console.line(f"warning: {message}"))
    check_split(config.model_id, config.num_shard)
    base = config.uds_path or unique_socket_base()
    check_socket_base(base, config.num_shard)
    return replace(config, device=device.name, uds_path=base), device


def list_adapters() -> list[str]:
    from engine.devices import available_devices  # imports torch: only when a device needs it

    return available_devices()


class StopRequest(threading.Event):
    """Set by SIGTERM / SIGINT. The handler only records: the main loop, polling, does the work."""

    def __init__(self):
        super().__init__()
        self.reason = ""

    def install(self) -> "StopRequest":
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
