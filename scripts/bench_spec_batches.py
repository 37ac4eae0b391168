"""Where speculation stops paying: decode tokens/s with and without n-gram speculation at batch B.

    PYTHONPATH=. .venv/bin/python scripts/bench_spec_batches.py [BATCHES [RUNS [DTYPE [WORKLOADS]]]]

BATCHES: comma-separated (default 1,2,4,8), RUNS (3), DTYPE (bfloat16), WORKLOADS (rewrite,compass). Two in-process shards of
the embedded model, one plain and one with `--speculate ngram --num-speculative-tokens 4`, with
verify buckets planned at every batch asked for (for this process only: engine.speculative.buckets'
SPECULATE_MAX_BATCH is raised to the largest, and its verify batches are BATCHES rather than the
small decode batches 1, 2 and 4). Two workloads, each a closed batch of B
requests sent as one prefill and then decoded to the end:

- rewrite: B copies of scripts/bench_speculative.py's rewrite prompt (input-grounded, greedy, EOS
  ends it): speculation's best case;
- compass: scripts/peer_bench.py's prompts 0..B-1 (free text), 64 tokens each, EOS ignored:
  proposals are rarely accepted, speculation's worst case short of none.

Plain and speculating runs alternate; prints the median decode rate (tokens after each row's first
over the time after the prefill) of each, the ratio, and the acceptance counters.
"""

import statistics
import sys
import time

from bench_spec_client import PROMPT
from peer_bench import prompt as compass_prompt

import engine.speculative.buckets as spec_buckets
from engine.batch import Batch, Request, StoppingCriteriaParameters
from engine.config import EngineConfig
from engine.serving.shard import Shard
from launcher.generate import chat_prompt

BATCHES = [int(b) for b in (sys.argv[1] if len(sys.argv) > 1 else "1,2,4,8").split(",")]
RUNS = int(sys.argv[2]) if len(sys.argv) > 2 else 3
DTYPE = sys.argv[3] if len(sys.argv) > 3 else "bfloat16"
WORKLOADS = (sys.argv[4] if len(sys.argv) > 4 else "rewrite,compass").split(",")
K = 4


def make_shard(speculate: bool) -> Shard:
    kw = dict(speculate="ngram", num_speculative_tokens=K) if speculate else {}
    shard = Shard(
        EngineConfig(
            max_batch_size=max(BATCHES),
            max_input_tokens=512,
            max_total_tokens=1024,
            max_prefill_tokens=1024 * max(BATCHES),
            dtype=DTYPE,
            **kw,
        ),
        show_progress=False,
    )
    shard.warmup()
    return shard


def requests(shard: Shard, workload: str, batch: int, first_id: int) -> list[Request]:
    if workload == "rewrite":
        texts = [chat_prompt(shard.tokenizer, PROMPT)] * batch
        stop = dict(max_new_tokens=128)
    else:
        texts = [compass_prompt(i) for i in range(batch)]
        stop = dict(max_new_tokens=64, ignore_eos_token=True)
    return [
        Request(
            first_id + i,
            text,
            stopping_parameters=StoppingCriteriaParameters(**stop),
            add_special_tokens=False,
        )
        for i, text in enumerate(texts)
    ]


def decode_rate(shard: Shard, batch_requests: list[Request], batch_id: int) -> float:
    gens, cached = shard.prefill(Batch(batch_id, batch_requests))
    start = time.perf_counter()
    tokens = 0
    while cached is not None:
        gens, cached = shard.decode([cached])
        tokens += sum(len(g.tokens.ids) for g in gens)
    return tokens / (time.perf_counter() - start)


def main() -> None:
    spec_buckets.SPECULATE_MAX_BATCH = max(BATCHES)
    spec_buckets.small_decode_batches = lambda top: [b for b in sorted(BATCHES) if b <= top]
    shards = {"off": make_shard(False), "ngram": make_shard(True)}
    next_id = 1
    for workload in WORKLOADS:
        for batch in BATCHES:
            rates: dict[str, list[float]] = {"off": [], "ngram": []}
            before = dict(shards["ngram"].speculator.stats)
            for run in range(RUNS + 1):  # the first is a warm run, not counted
                for mode, shard in shards.items():
                    rate = decode_rate(shard, requests(shard, workload, batch, next_id), next_id)
                    next_id += batch
                    if run:
                        rates[mode].append(rate)
            after = shards["ngram"].speculator.stats
            counts = {k: after[k] - before[k] for k in after}
            off, on = (statistics.median(rates[m]) for m in ("off", "ngram"))
            print(
                f"{workload:<8} batch {batch}: off {off:6.1f} tok/s, ngram K={K} {on:6.1f} tok/s, "
                f"ratio {on / off:.2f}x (runs off {[round(r, 1) for r in rates['off']]}, "
                f"ngram {[round(r, 1) for r in rates['ngram']]}; proposed/accepted/emitted "
                f"{counts['spec_proposed']}/{counts['spec_accepted']}/{counts['spec_emitted']} "
                f"in {counts['spec_steps']} verify steps)",
                flush=True,
            )


if __name__ == "__main__":
    main()
