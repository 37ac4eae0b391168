"""Multi-LoRA throughput against the base model, in the same run.

    python scripts/bench_lora.py [--model-id DIR] [--adapters 4] [--rank 16] [--lora-impl dense]

Makes `--adapters` random PEFT adapters (all seven projections, non-zero B) for the model, then
serves one batch of `--num-prompts` greedy requests per round twice: through a shard without
adapters, and through a shard with them all loaded, the requests spread round-robin over the
adapters (every forward mixes all of them). The two shards take their steps in turn, so a slow
spell of a shared machine hits both alike; the median of the rounds' ratios is reported.
Needs peft (a test dependency).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from engine.batch import Batch, Request, StoppingCriteriaParameters
from engine.config import EngineConfig
from engine.serving.shard import Shard
from engine.weights.loader import resolve_model_dir
from launcher.bench import Workload, make_prompts
from launcher.generate import warm_for

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(model_dir: Path, out: Path, count: int, rank: int) -> tuple[tuple[str, str], ...]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    specs = []
    for i in range(count):
        torch.manual_seed(i)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        config = LoraConfig(
            r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False
        )
        peft_model = get_peft_model(model, config)
        peft_model.save_pretrained(out / f"adapter{i}")
        specs.append((f"adapter{i}", str(out / f"adapter{i}")))
    return tuple(specs)


def requests_for(prompts: list[str], new_tokens: int, adapters: list[str | None]) -> list[Request]:
    stopping = StoppingCriteriaParameters(max_new_tokens=new_tokens, ignore_eos_token=True)
    return [
        Request(i, p, stopping_parameters=stopping, adapter_id=adapters[i % len(adapters)])
        for i, p in enumerate(prompts)
    ]


def lockstep_round(runs: list[tuple[Shard, list[Request]]]) -> list[dict]:
    """Serve each shard its batch (one Prefill, then Decode until done), taking one step on each shard
    in turn: on a shared machine a slow spell then hits every shard alike, not one whole run."""
    seconds, tokens, cached = [0.0] * len(runs), [0] * len(runs), [None] * len(runs)
    for i, (shard, requests) in enumerate(runs):
        start = time.perf_counter()
        generations, cached[i] = shard.prefill(Batch(0, requests))
        seconds[i] += time.perf_counter() - start
        tokens[i] += len(generations)
    while any(c is not None for c in cached):
        for i, (shard, _) in enumerate(runs):
            if cached[i] is not None:
                start = time.perf_counter()
                generations, cached[i] = shard.decode([cached[i]])
                seconds[i] += time.perf_counter() - start
                tokens[i] += len(generations)
    return [{"tokens": t, "seconds": s} for t, s in zip(tokens, seconds)]


def seconds(runs: list[dict]) -> str:
    return ", ".join(f"{run['seconds']:.2f}s" for run in runs)


def median_tps(runs: list[dict]) -> float:
    run = sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]
    return run["tokens"] / run["seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model-id", help="HF model directory (default: the embedded SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--lora-impl", choices=["dense", "gather"], help="default: the device's")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--min-tokens", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    base_config = EngineConfig(
        model_id=args.model_id, max_batch_size=args.num_prompts, warmup_prompt_logprobs=False
    )
    model_dir = resolve_model_dir(args.model_id, base_config.resolved_cache_dir)
    workload = Workload(args.num_prompts, args.min_tokens, args.max_tokens, args.new_tokens)
    with tempfile.TemporaryDirectory() as scratch:
        specs = make_adapters(model_dir, Path(scratch), args.adapters, args.rank)
        base = Shard(replace(base_config, model_id=str(model_dir)), show_progress=False)
        lora = Shard(
            replace(
                base_config, model_id=str(model_dir), lora_adapters=specs, lora_impl=args.lora_impl
            ),
            show_progress=False,
        )
    prompts = make_prompts(base.tokenizer, workload)
    for shard in (base, lora):
        warm_for(shard, prompts, args.new_tokens, add_special_tokens=True)
    names = [name for name, _ in specs]
    base_runs, lora_runs = [], []
    for _ in range(args.repeat):
        base_run, lora_run = lockstep_round(
            [
                (base, requests_for(prompts, args.new_tokens, [None])),
                (lora, requests_for(prompts, args.new_tokens, names)),
            ]
        )
        base_runs.append(base_run)
        lora_runs.append(lora_run)
    base_tps, lora_tps = median_tps(base_runs), median_tps(lora_runs)
    ratios = sorted(
        (lr["tokens"] / lr["seconds"]) / (br["tokens"] / br["seconds"])
        for br, lr in zip(base_runs, lora_runs)
    )
    print(
        f"workload: {len(prompts)} prompts of {args.min_tokens}-{args.max_tokens} tokens, {args.new_tokens} new "
        f"tokens each, greedy, {base.dtype}, {base.adapter.name}, torch threads {torch.get_num_threads()}; "
        f"median of {args.repeat} lockstep rounds"
    )
    print(f"base model:         {base_tps:.1f} tok/s (runs {seconds(base_runs)})")
    print(
        f"{args.adapters} adapters, rank {args.rank} ({lora.lora_set.ops.name}): {lora_tps:.1f} tok/s "
        f"(runs {seconds(lora_runs)})"
    )
    print(
        f"ratio: {ratios[len(ratios) // 2]:.2f} of the base model's throughput, median of the rounds' ratios "
        f"({', '.join(f'{r:.2f}' for r in ratios)}; target >= 0.70)"
    )
    print(
        f"unwarmed shapes: base {sum(base.adapter.shapes.unwarmed.values())}, "
        f"lora {sum(lora.adapter.shapes.unwarmed.values())}"
    )


if __name__ == "__main__":
    main()
