"""Command line of the engine alone: `python -m engine serve|buckets|warmup-profile`.

The offline commands that drive the router's scheduler in process (`generate`, `bench`) sit a
layer above, in launcher/offline_cli.py (`bucketserve generate|bench`)."""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from engine.cli.logs import configure_logging
from engine.config import EngineConfig, env_int, env_lora_adapters, parse_lora_adapters
from engine.errors import BucketserveError


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    defaults = EngineConfig()
    parser.add_argument("--model-id", help="HF model directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "hpu", "xpu"],
                        help="auto (default): hpu, else cuda/rocm, else xpu, whichever is present; else cpu")
    parser.add_argument("--dtype", default="auto", help="auto (default: cpu: bfloat16 where it has AVX512-BF16 "
                        "or AMX, else float32; accelerators: their default), float32, bfloat16 or float16")
    parser.add_argument("--quantize", default=defaults.quantize, choices=["none", "int8", "int4", "fp8"],
                        help="weight-only int8 (per channel) or int4 (group 32; GGUF Q4_0/Q4_1 as stored) on CPU; "
                             "fp8: a pre-quantized FP8 checkpoint")
    parser.add_argument("--block-size", type=int, help="KV cache block size in tokens (default: the device's)")
    parser.add_argument("--max-batch-size", type=int, default=defaults.max_batch_size)
    parser.add_argument("--max-input-tokens", type=int, default=defaults.max_input_tokens)
    parser.add_argument("--max-total-tokens", type=int, default=defaults.max_total_tokens)
    parser.add_argument("--max-prefill-tokens", type=int, default=defaults.max_prefill_tokens)
    add_bucket_args(parser, defaults)
    parser.add_argument("--graph-mode", choices=["eager", "graphs", "lazy", "compile"],
                        help="default: the device's (hpu: graphs or lazy or compile; cuda: graphs or eager or "
                             "compile; xpu, cpu: eager or compile)")
    parser.add_argument("--cache-dir", type=Path, help="where converted models are cached (default: ~/.cache/bucketserve)")
    parser.add_argument("--lora-adapters", help="PEFT LoRA adapters to serve, name=dir[,name=dir...]; requests pick "
                        "one by adapter_id (default: $LORA_ADAPTERS)")
    parser.add_argument("--lora-impl", choices=["dense", "gather"], help="LoRA operations (default: the device's: "
                        "dense on CPU and HPU, static shapes; gather on CUDA)")
    parser.add_argument("--max-lora-rank", type=int, default=defaults.max_lora_rank,
                        help="adapters of a higher rank are refused at start")
    parser.add_argument("--implementation", choices=["auto", "native", "transformers"], default=defaults.implementation,
                        help="auto (default): our native model when the architecture has one, else the transformers "
                             "fallback on the paged KV cache; native or transformers: that one only")
    parser.add_argument("--moe-impl", choices=["dense", "gather"], help="MoE experts (default: the device's: dense, "
                        "every expert over every token, on CPU and HPU; gather on CUDA)")
    parser.add_argument("--prefix-caching", choices=["on", "off"], default="on",
                        help="on (default): prefills may continue KV already in the cache (cache_len: prefix-cache "
                             "hits, later chunks of a long prompt); warms the context buckets for them")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress at INFO level")


def add_bucket_args(parser: argparse.ArgumentParser, defaults: EngineConfig) -> None:
    """Bucket planning and warmup (engine/buckets/plan.py, engine/warmup/)."""
    from engine.config import WARMUP_MODES
    from engine.buckets.plan import ALL_STRATEGIES

    parser.add_argument("--bucket-strategy", default=defaults.bucket_strategy, choices=ALL_STRATEGIES)
    parser.add_argument("--bucket-shapes", help="fitted: JSONL trace of batch shapes to fit (from --record-shapes)")
    parser.add_argument("--bucket-file", help='file: JSON {"prefill_buckets": [[bs, seq], ...], "decode_buckets": [...]}')
    parser.add_argument("--max-graphs", type=int, help="fitted: graph budget (default: the exponential plan's count)")
    parser.add_argument("--warmup", default=defaults.warmup_mode, choices=WARMUP_MODES,
                        help="full (default); progressive: healthy after a covering set, the rest in the "
                             "background; none: no warmup, every shape eager (debugging only)")
    parser.add_argument("--warmup-profile", help="profile.json of `warmup-profile`: warm exactly its buckets and "
                        "choose buckets by its measured latencies")
    parser.add_argument("--record-shapes", help="append the batch shapes served to this JSONL file (rank 0)")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model_id=args.model_id, device=args.device, dtype=args.dtype, block_size=args.block_size,
        max_batch_size=args.max_batch_size, max_input_tokens=args.max_input_tokens,
        max_total_tokens=args.max_total_tokens, max_prefill_tokens=args.max_prefill_tokens,
        bucket_strategy=args.bucket_strategy, graph_mode=args.graph_mode, cache_dir=args.cache_dir,
        bucket_shapes=args.bucket_shapes, bucket_file=args.bucket_file, max_graphs=args.max_graphs,
        warmup_mode=args.warmup, warmup_profile=args.warmup_profile, record_shapes=args.record_shapes,
        lora_adapters=parse_lora_adapters(args.lora_adapters or env_lora_adapters()),
        lora_impl=args.lora_impl, max_lora_rank=args.max_lora_rank, implementation=args.implementation,
        moe_impl=args.moe_impl, quantize=args.quantize, prefix_caching=args.prefix_caching == "on",
    )


def cmd_serve(args: argparse.Namespace) -> None:
    import asyncio
    from dataclasses import replace

    from engine.serving.server import serve
    from engine.serving.shard import Shard
    from engine.warmup.run import preflight

    if args.log_level:  # the engine's loggers only: the libraries' debug chatter stays off
        logging.getLogger("engine").setLevel(args.log_level.upper())
    settings = server_config(args)
    config = replace(engine_config(args), max_batch_size=settings.max_batch_size)
    # The model loads before the socket exists: a launcher that waits for the socket then finds a ready shard.
    shard = Shard(config, rank=settings.rank, world_size=settings.world_size, show_progress=args.verbose)
    preflight(config, shard.fingerprint())  # a bad profile or trace fails now, not at the router's Warmup
    asyncio.run(serve(shard, settings))


def server_config(args: argparse.Namespace):
    """Server settings: the flags, then what TGI's launcher puts in the environment, then defaults."""
    from engine.serving.server import ServerConfig

    rank, world_size = env_int("RANK"), env_int("WORLD_SIZE")
    max_batch_size = args.max_batch_size or env_int("MAX_BATCH_SIZE") or EngineConfig().max_batch_size
    return ServerConfig(uds_path=args.uds_path or ServerConfig.uds_path, port=args.port, rank=0 if rank is None else rank,
                        world_size=1 if world_size is None else world_size, max_batch_size=max_batch_size,
                        hostname=args.hostname, parent_pid=env_int("BUCKETSERVE_PARENT_PID"),
                        otlp_endpoint=args.otlp_endpoint)


def add_serve_command(commands) -> None:
    srv = commands.add_parser("serve", help="serve one shard over gRPC (TGI generate.v3)",
                              description="Serve one shard on unix://BASE-RANK. RANK and WORLD_SIZE come from the "
                                          "environment; --max-batch-size defaults to $MAX_BATCH_SIZE, else 32.")
    add_engine_args(srv)
    srv.set_defaults(max_batch_size=None)  # None: $MAX_BATCH_SIZE, as TGI's launcher sets it
    srv.add_argument("--uds-path", help="socket base path; rank r listens on BASE-r (default: /tmp/text-generation-server)")
    srv.add_argument("--port", type=int, help="also listen on this TCP port")
    srv.add_argument("--hostname", default="127.0.0.1", help="the TCP port's address (default: loopback only)")
    srv.add_argument("--log-level", choices=["debug", "info", "warning"], help="debug: one line per RPC")
    srv.add_argument("--otlp-endpoint", help="send the shard's step spans to this OTLP gRPC collector; they nest "
                                             "under a tracing router's request spans (default: no tracing)")
    srv.set_defaults(func=cmd_serve)


def build_parser(prog: str = "python -m engine", extra_commands=()) -> argparse.ArgumentParser:
    """The engine's commands; `extra_commands` (functions of the subparsers) let a higher layer add its
    own, such as the `bucketserve` command's generate and bench, without the engine importing it."""
    parser = argparse.ArgumentParser(prog=prog, description="bucketserve engine")
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
