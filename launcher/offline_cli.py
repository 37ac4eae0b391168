"""`bucketserve generate|bench`: offline commands that run prompts through an in-process shard and
the router's scheduler (the same continuous batching as serving). They use both the engine and the
router, so they live above both."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from engine.cli.main import add_engine_args, engine_config
from engine.config import EngineConfig
from engine.errors import BucketserveError

DEFAULT_MAX_NEW_TOKENS = 64
SERVING_ONLY = ("otlp_endpoint",)  # offline commands trace nothing


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
                    raise BucketserveError(
                        f'{args.prompts_file}:{number}: expected {{"prompt": "..."}}'
                    ) from None
    if not prompts:
        raise BucketserveError("no prompt: give --prompt TEXT or --prompts-file F.jsonl")
    return prompts


def read_images(paths: list[str]) -> list:
    """Image files checked as the router checks images (format, pixels)."""
    from router.images.decode import ImageError, ImageLimits, checked

    images = []
    for path in paths:
        try:
            images.append(checked(Path(path).read_bytes(), ImageLimits()))
        except (OSError, ImageError) as error:
            raise BucketserveError(f"--image {path}: {error}") from None
    return images


def cmd_generate(args: argparse.Namespace) -> None:
    from engine.serving.shard import Shard
    from launcher.generate import generate

    prompts = read_prompts(args)
    images = read_images(args.image or [])
    shard = Shard(offline_config(args), show_progress=args.verbose)
    for completion in generate(shard, prompts, args.max_new_tokens, chat=args.chat, images=images):
        if args.json:
            print(
                json.dumps(
                    {
                        "prompt": completion.prompt,
                        "token_ids": completion.token_ids,
                        "text": completion.text,
                        "finish_reason": completion.finish_reason,
                    }
                )
            )
        else:
            print(
                completion.text
                if len(prompts) == 1
                else f"### {completion.prompt}\n{completion.text}\n"
            )


def cmd_bench(args: argparse.Namespace) -> None:
    from engine.serving.shard import Shard
    from launcher.bench import Workload, bench

    if not 1 <= args.min_new_tokens <= args.new_tokens:
        raise BucketserveError(
            f"need 1 <= --min-new-tokens ({args.min_new_tokens}) <= --new-tokens "
            f"({args.new_tokens})"
        )
    workload = Workload(
        args.num_prompts, args.min_tokens, args.max_tokens, args.new_tokens, args.min_new_tokens
    )
    shard = Shard(offline_config(args), show_progress=True)
    print(bench(shard, workload, args.compare, args.repeat))


def add_offline_commands(commands) -> None:
    gen = commands.add_parser("generate", help="generate text offline from prompts")
    add_engine_args(gen, exclude=SERVING_ONLY)
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    gen.add_argument("--prompts-file", help='JSON lines of {"prompt": "..."}')
    gen.add_argument(
        "--chat", action="store_true", help="wrap each prompt in the model's chat template"
    )
    gen.add_argument(
        "--max-new-tokens",
        type=int,
        default=DEFAULT_MAX_NEW_TOKENS,
        help=f"the most tokens each prompt may generate (default: {DEFAULT_MAX_NEW_TOKENS})",
    )
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt")
    gen.add_argument(
        "--image",
        action="append",
        metavar="FILE",
        help="an image each prompt gets before its text (repeatable; a vision-language model)",
    )
    gen.set_defaults(func=cmd_generate)
    ben = commands.add_parser("bench", help="throughput benchmark, optionally against transformers")
    add_engine_args(ben, exclude=SERVING_ONLY)
    ben.add_argument(
        "--compare", choices=["transformers"], help="run the same workload through this peer"
    )
    ben.add_argument("--num-prompts", type=int, default=32)
    ben.add_argument("--min-tokens", type=int, default=16)
    ben.add_argument("--max-tokens", type=int, default=256)
    ben.add_argument("--new-tokens", type=int, default=128, help="the longest output")
    ben.add_argument(
        "--min-new-tokens",
        type=int,
        default=16,
        help="the shortest output; each request's length is spread evenly in between",
    )
    ben.add_argument(
        "--repeat", type=int, default=3, help="timed runs per engine (the median is reported)"
    )
    ben.set_defaults(func=cmd_bench)
    from launcher.check_shapes import add_check_shapes_command

    add_check_shapes_command(commands)
