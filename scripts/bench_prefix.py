"""Benchmarks (not tests) of prefix caching, multi-turn chat and KV allocated on demand.

    PYTHONPATH=. python scripts/bench_prefix.py [--model-id DIR] [--only shared|chat|demand]

Each runs the router's scheduler over an in-process shard (the embedded SmolLM2-135M-Instruct by
default) and prints one JSON line:
  shared  a ~1.5k-token system prompt, 5 sequential requests: time to first token of each;
  chat    a multi-turn chat replayed (each turn resends the history): prefill tokens the shard
          computed with prefix caching on and off;
  demand  16 chat requests with max_new_tokens=512 whose answers end (EOS) after a few dozen
          tokens: most requests decoding at once, and throughput, with blocks on demand vs reserved
          up front (a shard client that cannot resume gets the up-front reservation).
The machine's load average is printed with the figures: on a shared machine they move with it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

from engine.batch import Request, StoppingCriteriaParameters
from engine.config import EngineConfig, ServingLimits
from engine.serving.shard import Shard
from router.client import InProcessClient
from router.sched.allocator import BlockAllocator
from router.sched.prefix_cache import PrefixCache
from router.sched.scheduler import Scheduler

LIMITS = ServingLimits(
    max_batch_size=16, max_prefill_tokens=2048, max_input_tokens=2048, max_total_tokens=2600
)
SYSTEM = (
    "You are a meticulous assistant for a logistics company. Follow the policies below exactly. "
    + " ".join(
        f"Policy {i}: shipments of category {i} must be inspected within {i % 7 + 1} days, logged "
        f"with the code LX-{i:03d}, and escalated to the duty manager when delayed."
        for i in range(48)
    )
)
QUESTIONS = [
    "What is policy 3?",
    "Summarise policy 10.",
    "Which code does policy 7 use?",
    "How fast is category 12 inspected?",
    "Who handles delays?",
]


class UpFrontClient(InProcessClient):
    resumes = False  # as TGI's shards: the scheduler reserves max_new_tokens of blocks at admission


def build_shard(model_id, caching: bool) -> Shard:
    config = EngineConfig(
        model_id=model_id,
        max_batch_size=LIMITS.max_batch_size,
        max_input_tokens=LIMITS.max_input_tokens,
        max_total_tokens=LIMITS.max_total_tokens,
        max_prefill_tokens=LIMITS.max_prefill_tokens,
        prefix_caching=caching,
        warmup_prompt_logprobs=False,
    )
    shard = Shard(config, show_progress=False)
    shard.warmup(
        LIMITS.max_input_tokens,
        LIMITS.max_prefill_tokens,
        LIMITS.max_total_tokens,
        LIMITS.max_batch_size,
    )
    return shard


def chat(shard, messages) -> str:
    return shard.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


async def serve(
    shard,
    allocator,
    prompts,
    max_new,
    client_type=InProcessClient,
    sequential=False,
    stop_on_eos=False,
):
    """[(ttft_s, tokens, text)] per prompt, and the scheduler's stats."""
    client = client_type(shard, max_batch_size=LIMITS.max_batch_size)
    scheduler = Scheduler(client, allocator, LIMITS)
    await scheduler.start()

    async def one(i, text):
        ids = shard.tokenizer(text, add_special_tokens=False)["input_ids"]
        stopping = StoppingCriteriaParameters(
            max_new_tokens=max_new, ignore_eos_token=not stop_on_eos
        )
        request = Request(i, text, stopping_parameters=stopping, add_special_tokens=False)
        start, first, tokens = time.perf_counter(), None, []
        async for generation in scheduler.submit(request, len(ids), ids):
            first = first or time.perf_counter() - start
            tokens += generation.tokens.ids
        return first, tokens, shard.tokenizer.decode(tokens, skip_special_tokens=True)

    try:
        if sequential:
            results = [await one(i, text) for i, text in enumerate(prompts)]
        else:
            results = await asyncio.gather(*(one(i, text) for i, text in enumerate(prompts)))
    finally:
        await scheduler.stop()
        await client.close()
    return results, scheduler.stats


def blocks(shard) -> int:
    return shard.runner.kv_cache.num_blocks


def bench_shared(model_id) -> dict:
    shard = build_shard(model_id, True)
    prompts = [
        chat(shard, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
        for q in QUESTIONS
    ]
    results, _ = asyncio.run(
        serve(shard, PrefixCache(blocks(shard), shard.block_size), prompts, 4, sequential=True)
    )
    ttft = [r[0] for r in results]
    return {
        "bench": "shared_system_prompt",
        "prompt_tokens": len(shard.tokenizer(prompts[0])["input_ids"]),
        "ttft_s": [round(t, 3) for t in ttft],
        "speedup_2_to_5_vs_1": round(ttft[0] / max(ttft[1:]), 1),
    }


def bench_chat(model_id, turns: int = 6) -> dict:
    computed = {}
    for caching in (True, False):
        shard = build_shard(model_id, caching)
        allocator = (PrefixCache if caching else BlockAllocator)(blocks(shard), shard.block_size)
        messages = [{"role": "system", "content": SYSTEM[:1200]}]
        before = shard.runner.padding.real("prefill")
        for turn in range(turns):
            messages.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
            (result,), _ = asyncio.run(serve(shard, allocator, [chat(shard, messages)], 24))
            messages.append({"role": "assistant", "content": result[2]})
        computed["on" if caching else "off"] = shard.runner.padding.real("prefill") - before
    return {
        "bench": "multi_turn_chat",
        "turns": turns,
        "prefill_tokens_computed": computed,
        "saved": round(1 - computed["on"] / computed["off"], 3),
    }


def bench_demand(model_id, requests: int = 16) -> dict:
    shard = build_shard(model_id, True)
    prompts = [
        chat(
            shard,
            [
                {
                    "role": "user",
                    "content": f"In one sentence: why is the sky blue? (asked by user {i})",
                }
            ],
        )
        for i in range(requests)
    ]
    budget = (
        4 * -(-(len(shard.tokenizer(prompts[0])["input_ids"]) + 512) // shard.block_size) + 1
    )  # 4 reserved up front
    out = {
        "bench": "kv_on_demand",
        "requests": requests,
        "max_new_tokens": 512,
        "router_kv_blocks": budget - 1,
    }
    for name, client in (("up_front", UpFrontClient), ("on_demand", InProcessClient)):
        start = time.perf_counter()
        results, stats = asyncio.run(
            serve(
                shard,
                BlockAllocator(budget, shard.block_size),
                prompts,
                512,
                client,
                stop_on_eos=True,
            )
        )
        seconds = time.perf_counter() - start
        generated = sum(len(r[1]) for r in results)
        out[name] = {
            "max_decoding_at_once": max(stats.decode_sizes),
            "preemptions": stats.preemptions,
            "mean_output_tokens": round(generated / requests, 1),
            "tokens_per_s": round(generated / seconds, 1),
            "seconds": round(seconds, 1),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model-id",
        help="HF model directory or .gguf (default: the embedded SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--only", choices=["shared", "chat", "demand"])
    args = parser.parse_args()
    for name, bench in (("shared", bench_shared), ("chat", bench_chat), ("demand", bench_demand)):
        if args.only in (None, name):
            result = bench(args.model_id)
            print(
                json.dumps({**result, "load_average": os.getloadavg(), "cpus": os.cpu_count()}),
                flush=True,
            )


if __name__ == "__main__":
    main()
