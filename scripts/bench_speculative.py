"""A lone greedy request on an input-grounded rewrite: speculation against plain decoding.

    PYTHONPATH=. .venv/bin/python scripts/bench_speculative.py K [MAX_NEW [DTYPE [PROPOSER]]]

K 0: off. PROPOSER: ngram (default), or draft: the embedded model's int4 form drafting for the
target (the embedded model in DTYPE).

The rewrite prompt is scripts/bench_spec_client.py's (the one the llama-server comparison sends).
Prints the decode rate of three runs after one warm run (tokens after the first over the time
after the first), the median request time from prefill to the last token, the speculation
counters and the text.
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


spec = sys.argv[1]
PROPOSER = sys.argv[4] if len(sys.argv) > 4 else "ngram"
kw = dict(speculate=PROPOSER, num_speculative_tokens=int(spec)) if spec != "0" else {}
if spec != "0" and PROPOSER == "draft":
    from engine.config import default_cache_dir
    from engine.weights.loader import resolve_model_dir

    kw.update(draft_model=str(resolve_model_dir(None, default_cache_dir())), draft_quantize="int4")
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
text = chat_prompt(shard.tokenizer, PROMPT)
one(shard, text, 1)
rates, totals = [], []
for r in range(3):
    ids, rate, total = one(shard, text, 10 + r)
    rates.append(rate)
    totals.append(total)
print(
    f"K={spec} tokens={len(ids)} decode tok/s runs={[round(x, 1) for x in rates]} median={sorted(rates)[1]:.1f}"
    f" request ms (prefill included) median={sorted(totals)[1] * 1e3:.0f}"
)
if shard.speculator:
    print(shard.speculator.summary())
print(repr(shard.tokenizer.decode(ids))[:300])
