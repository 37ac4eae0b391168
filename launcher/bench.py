"""`bucketserve bench --compare transformers`: one workload through bucketserve and through
transformers' batched generate, in the same process, on the same weights."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.batch import Request, StoppingCriteriaParameters
from engine.buckets.grid import PaddingStats
from engine.serving.shard import Shard
from launcher.generate import run_requests, warm_for

# Any text works: it is only cut into prompts of the wanted token lengths.
SOURCE_TEXT = (
    "The river rose slowly through the night, and by morning the low fields near the old mill were "
    "under water. Farmers moved their animals to the hills, children watched from the bridge, and "
    "the miller counted sacks of grain that he had carried upstairs before the rain began. "
)


@dataclass(frozen=True)
class Workload:
    num_prompts: int = 32
    min_tokens: int = 16
    max_tokens: int = 256
    new_tokens: int = 128  # the longest output
    min_new_tokens: int = 16  # the shortest output; outputs spread evenly in between

    def output_lengths(self) -> list[int]:
        """Each request's number of new tokens, spread over [min_new_tokens, new_tokens] and mixed
        with the prompt lengths (a stride coprime with most counts), so long and short meet."""
        n, span = self.num_prompts, self.new_tokens - self.min_new_tokens
        stride = 7 if n % 7 else 5
        return [self.min_new_tokens + span * ((stride * i) % n) // max(n - 1, 1) for i in range(n)]


def make_prompts(tokenizer, workload: Workload) -> list[str]:
    """Prompts whose lengths are spread evenly over [min_tokens, max_tokens], each cut at its own
    offset."""
    ids = tokenizer(SOURCE_TEXT * (workload.max_tokens // 40 + 2), add_special_tokens=False)[
        "input_ids"
    ]
    span = workload.max_tokens - workload.min_tokens
    prompts = []
    for i in range(workload.num_prompts):
        length = workload.min_tokens + span * i // max(workload.num_prompts - 1, 1)
        offset = (7 * i) % 40
        prompts.append(tokenizer.decode(ids[offset : offset + length]))
    return prompts


def bucketserve_runner(shard: Shard, prompts: list[str], workload: Workload):
    """Warm the shard for the workload; returns (a function running it once, warmup seconds)."""
    start = time.perf_counter()
    warm_for(shard, prompts, workload.new_tokens, add_special_tokens=True)
    warmup_s = time.perf_counter() - start
    shard.runner.padding = PaddingStats()  # count serving only, not warmup
    if shard.speculator is not None:
        shard.speculator.reset_stats()

    def run_once() -> dict:
        requests = [
            Request(i, p, stopping_parameters=StoppingCriteriaParameters(n, ignore_eos_token=True))
            for i, (p, n) in enumerate(zip(prompts, workload.output_lengths()))
        ]
        phases = {"prefill": 0.0, "decode": 0.0}
        began = time.perf_counter()
        done = run_requests(shard, requests, phases)
        seconds = time.perf_counter() - began  # wall time: the scheduler's own work counts too
        return {
            "tokens": sum(len(c.token_ids) for c in done.values()),
            "seconds": seconds,
            "phases": phases,
        }

    return run_once, warmup_s


def _weights(shard) -> str:
    return (
        "" if shard.config.quantize == "none" else f" activations, {shard.config.quantize} weights"
    )


def transformers_runner(model_path, prompts: list[str], workload: Workload, dtype):
    """transformers' batched generate on the same weights (left padding, as it requires)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    kwargs = dict(do_sample=False, pad_token_id=tokenizer.pad_token_id)
    with torch.inference_mode():  # its first call pays one-time set-up costs
        model.generate(
            **tokenizer(prompts[:2], return_tensors="pt", padding=True), max_new_tokens=2, **kwargs
        )

    @torch.inference_mode()
    def run_once() -> dict:
        start = time.perf_counter()
        # One batch runs until its longest request is done (min_new_tokens keeps every row going,
        # like ignore_eos_token on our side); each request wanted only its own length, which is what
        # counts.
        longest = max(workload.output_lengths())
        model.generate(**batch, max_new_tokens=longest, min_new_tokens=longest, **kwargs)
        seconds = time.perf_counter() - start
        return {"tokens": sum(workload.output_lengths()), "seconds": seconds}

    return run_once


def _seconds(runs: list[dict]) -> str:
    return ", ".join(f"{run['seconds']:.1f}s" for run in runs)


def median_run(runs: list[dict]) -> dict:
    return sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]


def report(
    shard: Shard,
    prompts: list[str],
    workload: Workload,
    ours: list[dict],
    peer: list[dict],
    warmup_s: float,
) -> str:
    prompt_tokens = sum(len(shard.tokenizer(p)["input_ids"]) for p in prompts)
    best = median_run(ours)
    ours_tps = best["tokens"] / best["seconds"]
    pad, plan = shard.runner.padding.as_dict(), shard.runner.plan
    lines = [
        f"workload: {len(prompts)} prompts of {workload.min_tokens}-{workload.max_tokens} tokens "
        f"({prompt_tokens} in all), {workload.min_new_tokens}-{workload.new_tokens} new tokens "
        f"each ({sum(workload.output_lengths())} in all), greedy, "
        f"{shard.dtype}{_weights(shard)}, {shard.adapter.name}; median of {len(ours)} runs",
        f"bucketserve:  {best['tokens']} tokens in {best['seconds']:.2f}s = {ours_tps:.1f} tok/s "
        f"(prefill {best['phases']['prefill']:.2f}s, decode {best['phases']['decode']:.2f}s; "
        f"runs {_seconds(ours)}; warmup {warmup_s:.1f}s, {len(plan.prefill) + len(plan.decode)} "
        f"buckets; padding waste prefill {pad['prefill']['waste']:.1%}, decode "
        f"{pad['decode']['waste']:.1%})",
    ]
    if shard.speculator is not None:
        lines.append(speculation_line(shard.speculator))
    if peer:
        other = median_run(peer)
        peer_tps = other["tokens"] / other["seconds"]
        lines.append(
            f"transformers: {other['tokens']} tokens in {other['seconds']:.2f}s = {peer_tps:.1f} "
            f"tok/s (runs {_seconds(peer)})"
        )
        lines.append(f"ratio: {ours_tps / peer_tps:.2f}x transformers")
    return "\n".join(lines)


def speculation_line(speculator) -> str:
    """--speculate's counters over every run (engine/speculative/step.py)."""
    s = speculator.summary()
    return (
        f"speculation:  {speculator.method} K={speculator.num_tokens}: {s['spec_proposed']} "
        f"proposed, {s['spec_accepted']} accepted ({s['spec_acceptance_rate']:.1%}), "
        f"{s['spec_emitted']} emitted in {s['spec_steps']} verify steps; mean accepted length "
        f"{s['spec_mean_accepted_length']:.2f}"
    )


def bench(shard: Shard, workload: Workload, compare: str | None, repeat: int = 3) -> str:
    """Runs alternate between the engines, so a slow spell of the machine hits both alike."""
    prompts = make_prompts(shard.tokenizer, workload)
    run_ours, warmup_s = bucketserve_runner(shard, prompts, workload)
    run_peer = (
        transformers_runner(shard.model_path, prompts, workload, shard.dtype) if compare else None
    )
    ours, peer = [], []
    for _ in range(repeat):
        ours.append(run_ours())
        if run_peer:
            peer.append(run_peer())
    return report(shard, prompts, workload, ours, peer, warmup_s)
