"""Two builds of the CPU kernels alternated call by call in one process, on the K 8 int4 draft's
captured calls of one real request (the rewrite of scripts/bench_spec_client.py, bfloat16).

    PYTHONPATH=.:scripts .venv/bin/python scripts/ab_kernel_builds.py BEFORE.so AFTER.so [CALLS]

A build's library: `python -m engine.devices.cpu.kernels` in a checkout of that commit (a git
worktree) prints where it put it. Both builds must share the packed layouts: the shard packs its
weights once, with AFTER, and each call runs through the build whose turn it is. The VM's speed
drifts by tens of percent within minutes, so each pair of calls alternates its order and only the
medians of many pairs mean anything. Prints each build's median and first-quartile time of the
draft's 8-step fused call and of the 9-row verify forward, and whether the request's tokens were
the same under both builds.
"""

import statistics
import sys
import time
from pathlib import Path

import torch
from bench_spec_client import PROMPT

import engine.devices.cpu.kernels as cpu_kernels
from engine.batch import Batch, Request, StoppingCriteriaParameters
from engine.config import EngineConfig, default_cache_dir
from engine.serving.shard import Shard
from engine.weights.loader import resolve_model_dir
from launcher.generate import chat_prompt

BUILDS = [cpu_kernels.import_library(Path(path)) for path in sys.argv[1:3]]
CALLS = int(sys.argv[3]) if len(sys.argv) > 3 else 150
turn = [1]  # the build load() hands out now
cpu_kernels._build = lambda: BUILDS[turn[0]]


def drafting_shard() -> Shard:
    config = EngineConfig(
        max_batch_size=4,
        max_input_tokens=512,
        max_total_tokens=1024,
        max_prefill_tokens=1024,
        dtype="bfloat16",
        speculate="draft",
        num_speculative_tokens=8,
        draft_model=str(resolve_model_dir(None, default_cache_dir())),
        draft_quantize="int4",
    )
    shard = Shard(config, show_progress=False)
    shard.warmup()
    return shard


def generate(shard: Shard, text: str, rid: int) -> list[int]:
    stop = StoppingCriteriaParameters(max_new_tokens=128)
    request = Request(rid, text, stopping_parameters=stop, add_special_tokens=False)
    _, cached = shard.prefill(Batch(rid, [request]))
    ids = []
    while cached is not None:
        generations, cached = shard.decode([cached])
        ids += [t for g in generations for t in g.tokens.ids]
    return ids


def capture(shard: Shard):
    """Wraps the draft's fused call and the target's forward to keep every call's arguments."""
    fused = shard.speculator.draft.runner.model.fused_decode
    runner = shard.runner
    draft_calls, verify_calls = [], []
    greedy_steps, run = fused.greedy_steps, runner._run

    def keep_draft(fed, position, count, slots, *guessing):
        draft_calls.append((list(fed), position, count, list(slots), *guessing))
        return greedy_steps(fed, position, count, slots, *guessing)

    def keep_verify(shape, *inputs, fn=None):
        if shape[0] == "verify":
            verify_calls.append((shape, inputs, fn))
        return run(shape, *inputs, fn=fn)

    fused.greedy_steps, runner._run = keep_draft, keep_verify
    return greedy_steps, draft_calls, verify_calls


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def main():
    shard = drafting_shard()
    greedy_steps, draft_calls, verify_calls = capture(shard)
    text = chat_prompt(shard.tokenizer, PROMPT)
    tokens = []
    for build in (0, 1):
        turn[0] = build
        tokens.append(generate(shard, text, 10 + build))
    print(f"the same tokens under both builds: {tokens[0] == tokens[1]} ({len(tokens[0])})")
    draft = draft_calls[len(draft_calls) // 2]  # a call from mid-request: typical context
    shape, inputs, fn = verify_calls[len(verify_calls) // 2]
    runner = shard.runner

    @torch.inference_mode()
    def verify():
        runner.adapter.run(shape, fn or runner.model, *inputs)

    times = {build: {"draft call": [], "verify forward": []} for build in (0, 1)}
    for pair in range(CALLS):
        for build in (0, 1) if pair % 2 == 0 else (1, 0):
            turn[0] = build
            times[build]["draft call"].append(timed(lambda: greedy_steps(*draft)))
            times[build]["verify forward"].append(timed(verify))
    for build, name in ((0, "before"), (1, "after")):
        parts = [
            f"{part} {statistics.median(t):.2f} ms (p25 {statistics.quantiles(t, n=4)[0]:.2f})"
            for part, t in times[build].items()
        ]
        print(f"{name}: " + ", ".join(parts))


if __name__ == "__main__":
    main()
