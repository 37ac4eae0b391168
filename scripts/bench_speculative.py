"""A lone greedy request on an input-grounded rewrite: speculation against plain decoding.

    PYTHONPATH=. .venv/bin/python scripts/bench_speculative.py K[,K...] [MAX_NEW [DTYPE [PROPOSER
    [RUNS]]]]

K 0: off. Several Ks (`0,8`): a shard each, in one process, their runs alternating (the VM's
speed drifts within minutes), and each K's ratio to the first. PROPOSER: ngram (default), or
draft: the embedded model's int4 form drafting for the target (the embedded model in DTYPE).

The rewrite prompt is scripts/bench_spec_client.py's (the one the llama-server comparison sends).
Prints, for each K, the decode rate of RUNS runs (3) after one warm run (tokens after the first
over the time after the first), the median request time from prefill to the last token, the
speculation counters and the text.
"""

import sys
import time

from bench_spec_client import PROMPT

from engine.batch import Batch, Request, StoppingCriteriaParameters
from engine.config import EngineConfig
from engine.serving.shard import Shard
from launcher.generate import chat_prompt

DTYPE = sys.argv[3] if len(sys.argv) > 3 else "auto"
NEW = int(sys.argv[2]) if len(sys.argv) > 2 else 128


def one(shard, text, rid):
    req = Request(
        rid,
        text,
        stopping_parameters=StoppingCriteriaParameters(max_new_tokens=NEW),
        add_special_tokens=False,
    )
    start = time.perf_counter()
    gens, cached = shard.prefill(Batch(rid, [req]))
    first = time.perf_counter()
    ids = [t for g in gens for t in g.tokens.ids]
    while cached is not None:
        gens, cached = shard.decode([cached])
        ids += [t for g in gens for t in g.tokens.ids]
    end = time.perf_counter()
    return ids, (len(ids) - 1) / (end - first), end - start


KS = sys.argv[1].split(",")
PROPOSER = sys.argv[4] if len(sys.argv) > 4 else "ngram"
RUNS = int(sys.argv[5]) if len(sys.argv) > 5 else 3


def make_shard(spec: str) -> Shard:
    kw = dict(speculate=PROPOSER, num_speculative_tokens=int(spec)) if spec != "0" else {}
    if spec != "0" and PROPOSER == "draft":
        from engine.config import default_cache_dir
        from engine.weights.loader import resolve_model_dir

        kw.update(
            draft_model=str(resolve_model_dir(None, default_cache_dir())), draft_quantize="int4"
        )
    shard = Shard(
        EngineConfig(
            max_batch_size=4,
            max_input_tokens=512,
            max_total_tokens=1024,
            max_prefill_tokens=1024,
            dtype=DTYPE,
            **kw,
        ),
        show_progress=False,
    )
    shard.warmup()
    return shard


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


shards = {spec: make_shard(spec) for spec in KS}
text = chat_prompt(shards[KS[0]].tokenizer, PROMPT)
for shard in shards.values():
    one(shard, text, 1)
rates = {spec: [] for spec in KS}
totals = {spec: [] for spec in KS}
outputs = {}
for r in range(RUNS):
    for spec in KS if r % 2 == 0 else KS[::-1]:
        outputs[spec], rate, total = one(shards[spec], text, 10 + r)
        rates[spec].append(rate)
        totals[spec].append(total)
for spec, shard in shards.items():
    print(
        f"K={spec} tokens={len(outputs[spec])} decode tok/s runs={[round(x, 1) for x in rates[spec]]}"
        f" median={median(rates[spec]):.1f}"
        f" request ms (prefill included) median={median(totals[spec]) * 1e3:.0f}"
    )
    if shard.speculator:
        print(shard.speculator.summary())
for spec in KS[1:]:
    print(f"ratio K={spec} / K={KS[0]}: {median(rates[spec]) / median(rates[KS[0]]):.2f}x")
print("the same tokens:", all(ids == outputs[KS[0]] for ids in outputs.values()))
print(repr(shards[KS[-1]].tokenizer.decode(outputs[KS[-1]]))[:300])
