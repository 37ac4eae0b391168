"""Command line: `python -m engine generate|bench|serve`."""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from engine.config import EngineConfig, env_int, env_lora_adapters, parse_lora_adapters
from engine.errors import BucketserveError


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    defaults = EngineConfig()
    parser.add_argument("--model-id", help="HF model directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "hpu", "xpu"],
                        help="auto (default): hpu, else cuda/rocm, else xpu, whichever is present; else cpu")
    parser.add_argument("--dtype", help="float32, bfloat16 or float16 (default: the device's)")
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
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress at INFO level")


def add_bucket_args(parser: argparse.ArgumentParser, defaults: EngineConfig) -> None:
    """Bucket planning and warmup (engine/plans.py, engine/warmup.py)."""
    from engine.config import WARMUP_MODES
    from engine.plans import ALL_STRATEGIES

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
        lora_impl=args.lora_impl, max_lora_rank=args.max_lora_rank,
    )


def offline_config(args: argparse.Namespace) -> EngineConfig:
    """generate and bench never ask for prompt logprobs, so they skip warming that variant."""
    from dataclasses import replace

    return replace(engine_config(args), warmup_prompt_logprobs=False)


def read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompts_file:
        for number, line in enumerate(Path(args.prompts_file).read_text().splitlines(), 1):
            if line.strip():
                try:
                    prompts.append(json.loads(line)["prompt"])
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise BucketserveError(f'{args.prompts_file}:{number}: expected {{"prompt": "..."}}') from None
    if not prompts:
        raise BucketserveError("no prompt: give --prompt TEXT or --prompts-file F.jsonl")
    return prompts


def cmd_generate(args: argparse.Namespace) -> None:
    from engine.generate import generate
    from engine.shard import Shard

    prompts = read_prompts(args)
    shard = Shard(offline_config(args), show_progress=args.verbose)
    for completion in generate(shard, prompts, args.max_new_tokens, chat=args.chat):
        if args.json:
            print(json.dumps({"prompt": completion.prompt, "token_ids": completion.token_ids,
                              "text": completion.text, "finish_reason": completion.finish_reason}))
        else:
            print(completion.text if len(prompts) == 1 else f"### {completion.prompt}\n{completion.text}\n")


def cmd_bench(args: argparse.Namespace) -> None:
    from engine.bench import Workload, bench
    from engine.shard import Shard

    if not 1 <= args.min_new_tokens <= args.new_tokens:
        raise BucketserveError(f"need 1 <= --min-new-tokens ({args.min_new_tokens}) <= --new-tokens ({args.new_tokens})")
    workload = Workload(args.num_prompts, args.min_tokens, args.max_tokens, args.new_tokens, args.min_new_tokens)
    shard = Shard(offline_config(args), show_progress=True)
    print(bench(shard, workload, args.compare, args.repeat))


def cmd_serve(args: argparse.Namespace) -> None:
    import asyncio
    from dataclasses import replace

    from engine.server import serve
    from engine.shard import Shard
    from engine.warmup import preflight

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
    from engine.server import ServerConfig

    rank, world_size = env_int("RANK"), env_int("WORLD_SIZE")
    max_batch_size = args.max_batch_size or env_int("MAX_BATCH_SIZE") or EngineConfig().max_batch_size
    return ServerConfig(uds_path=args.uds_path or ServerConfig.uds_path, port=args.port, rank=0 if rank is None else rank,
                        world_size=1 if world_size is None else world_size, max_batch_size=max_batch_size)


def add_serve_command(commands) -> None:
    srv = commands.add_parser("serve", help="serve one shard over gRPC (TGI generate.v3)",
                              description="Serve one shard on unix://BASE-RANK. RANK and WORLD_SIZE come from the "
                                          "environment; --max-batch-size defaults to $MAX_BATCH_SIZE, else 32.")
    add_engine_args(srv)
    srv.set_defaults(max_batch_size=None)  # None: $MAX_BATCH_SIZE, as TGI's launcher sets it
    srv.add_argument("--uds-path", help="socket base path; rank r listens on BASE-r (default: /tmp/text-generation-server)")
    srv.add_argument("--port", type=int, help="also listen on this TCP port")
    srv.add_argument("--log-level", choices=["debug", "info", "warning"], help="debug: one line per RPC")
    srv.set_defaults(func=cmd_serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine", description="bucketserve engine")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="generate text offline from prompts")
    add_engine_args(gen)
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    gen.add_argument("--prompts-file", help='JSON lines of {"prompt": "..."}')
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    gen.add_argument("--max-new-tokens", type=int, required=True)
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt")
    gen.set_defaults(func=cmd_generate)
    ben = commands.add_parser("bench", help="throughput benchmark, optionally against transformers")
    add_engine_args(ben)
    ben.add_argument("--compare", choices=["transformers"], help="run the same workload through this peer")
    ben.add_argument("--num-prompts", type=int, default=32)
    ben.add_argument("--min-tokens", type=int, default=16)
    ben.add_argument("--max-tokens", type=int, default=256)
    ben.add_argument("--new-tokens", type=int, default=128, help="the longest output")
    ben.add_argument("--min-new-tokens", type=int, default=16,
                     help="the shortest output; each request's length is spread evenly in between")
    ben.add_argument("--repeat", type=int, default=3, help="timed runs per engine (the median is reported)")
    ben.set_defaults(func=cmd_bench)
    add_serve_command(commands)
    from engine.cli_buckets import add_buckets_command
    from engine.cli_profile import add_profile_command

    add_buckets_command(commands)
    add_profile_command(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        args.func(args)
    except (BucketserveError, ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0
