"""Write a realistic, reproducible batch-shape trace, as `engine serve --record-shapes` records one.

A small simulation of a continuous-batching router in front of one shard, seeded:
- load rises and falls (a slow wave plus bursts), so batch sizes range from 1 to the maximum;
- prompts mix short chat turns and long documents (log-normal lengths, a long tail clipped at
  max_input_tokens); outputs are log-normal too;
- a step prefills the waiting requests that fit the batch and prefill-token budgets (one
  prefill shape: count and longest prompt), then decodes every running sequence (one decode shape:
  count and KV blocks of the whole batch, growing a token per step). Like TGI's router, it
  interrupts decoding for new requests only when enough of them wait.

    python examples/make_shapes.py --out examples/shapes_chat_mixed.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import random
from dataclasses import dataclass


@dataclass
class Limits:
    max_batch_size: int = 32
    max_input_tokens: int = 1024
    max_total_tokens: int = 2048
    max_prefill_tokens: int = 4096
    block_size: int = 16


def prompt_length(rng: random.Random, limit: int) -> int:
    """Chat turns (median ~180 tokens) and retrieved documents (median ~700), tail clipped."""
    median, sigma = (180, 0.9) if rng.random() < 0.75 else (700, 0.45)
    return max(1, min(limit, int(rng.lognormvariate(math.log(median), sigma))))


def output_length(rng: random.Random, room: int) -> int:
    return max(1, min(room, int(rng.lognormvariate(math.log(150), 0.8))))


def arrivals(rng: random.Random, step: int) -> int:
    """Poisson arrivals whose rate follows a slow wave (quiet to busy) with occasional bursts."""
    rate = 0.06 * (1.1 + math.sin(2 * math.pi * step / 2000))
    if rng.random() < 0.004:
        rate += 12  # a client sends a batch of requests at once
    count, threshold, p = 0, math.exp(-rate), rng.random()
    while p > threshold:
        count += 1
        p *= rng.random()
    return count


def admit(waiting: list, running: list, limits: Limits) -> list:
    """FIFO admission under the batch-size and prefill-token budgets."""
    new, tokens = [], 0
    while waiting and len(running) + len(new) < limits.max_batch_size:
        prompt, _ = waiting[0]
        if new and tokens + prompt > limits.max_prefill_tokens:
            break
        new.append(waiting.pop(0))
        tokens += prompt
    return new


def worth_prefilling(waiting: list, running: list, idle_steps: int) -> bool:
    """Like TGI's router: interrupt decoding for new requests when nothing runs, when enough wait
    compared to those running, or when they have waited max_waiting_tokens (20) steps."""
    return bool(waiting) and (not running or len(waiting) >= 0.3 * len(running) or idle_steps >= 20)


def simulate(seed: int, steps: int, limits: Limits):
    rng = random.Random(seed)
    waiting, running = [], []  # running: [tokens so far, tokens still to generate]
    idle_steps = 0
    for step in range(steps):
        for _ in range(arrivals(rng, step)):
            prompt = prompt_length(rng, limits.max_input_tokens)
            waiting.append((prompt, output_length(rng, limits.max_total_tokens - prompt)))
        new = (
            admit(waiting, running, limits)
            if worth_prefilling(waiting, running, idle_steps)
            else []
        )
        idle_steps = 0 if new else idle_steps + 1
        if new:
            yield {"phase": "prefill", "batch_size": len(new), "seq_len": max(p for p, _ in new)}
            running += [[p + 1, out - 1] for p, out in new]  # prefill makes the first token
            running = [r for r in running if r[1] > 0]
        if running:
            blocks = sum(-(-r[0] // limits.block_size) for r in running)
            yield {"phase": "decode", "batch_size": len(running), "num_blocks": blocks}
            for r in running:
                r[0], r[1] = r[0] + 1, r[1] - 1
            running = [r for r in running if r[1] > 0]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=8000)
    parser.add_argument("--out", default="examples/shapes_chat_mixed.jsonl")
    args = parser.parse_args()
    with open(args.out, "w", encoding="utf-8") as out:
        for record in simulate(args.seed, args.steps, Limits()):
            out.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
