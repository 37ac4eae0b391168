"""Traffic through the router's real scheduler to a shard under `--simulate hpu` (strict shapes,
after a warmup at the scheduler's limits): every sampling field, top-n tokens, prompt logprobs,
JSON, regex and tool grammars, `n` siblings, stop sequences and LoRA rows, next to shared prefixes
(prefix-cache hits), prompts longer than the longest prefill bucket (chunked prefill) and a KV
budget small enough to preempt (preemption and resume). No step compiles or breaks a graph, and
every greedy request gets the tokens of the same scheduler over a plain CPU shard. On the embedded
model (SmolLM2-135M) and on a tiny MoE model."""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.batch import (
    GrammarType,
    NextTokenChooserParameters,
    Request,
    StoppingCriteriaParameters,
)
from engine.config import ServingLimits
from engine.sampling.sampler import is_sampling
from router.client import InProcessClient
from router.http.tools import Tool, plan
from router.sched import fanout
from router.sched.prefix_cache import PrefixCache
from router.sched.scheduler import Scheduler
from tests.family_models import build_family_model
from tests.helpers import PROMPTS, shard_options, tiny_shard

pytestmark = pytest.mark.slow
BLOCK = 16
LIMITS = ServingLimits(
    max_batch_size=4, max_prefill_tokens=32, max_input_tokens=96, max_total_tokens=128
)
SHARD = shard_options(LIMITS, BLOCK)
ROUTER_BLOCKS = 10  # 9 usable blocks of 16: two long prompts and their growth do not fit at once
# Two prefixes of more than three blocks (prefix-cache hits), longer than the longest prefill
# bucket (32 tokens: chunked); the tails keep a prompt within max_input_tokens (not truncated).
PREFIXES = [
    "The moon landing was in 1969 and the crew came home safely after eight days. " * 3,
    PROMPTS[4],
]
TAILS = PROMPTS[:4] + PROMPTS[5:]
TOOL = Tool.model_validate(
    {
        "type": "function",
        "function": {
            "name": "weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 4}},
                "required": ["city"],
            },
        },
    }
)
GRAMMARS = {
    "regex": (GrammarType.REGEX, "[a-z ]+"),
    "json": (GrammarType.JSON, '{"type": "string", "maxLength": 6}'),
    "tools": (GrammarType.JSON, json.dumps(plan([TOOL], "required", True).grammar.value)),
}
SAMPLING = st.fixed_dictionaries(
    {"temperature": st.sampled_from([0.5, 1.3]), "seed": st.integers(0, 2**32)},
    optional={
        "top_k": st.sampled_from([1, 5, 40]),
        "top_p": st.sampled_from([0.5, 0.95]),
        "typical_p": st.just(0.6),
    },
)
PENALTIES = st.fixed_dictionaries(
    {},
    optional={
        "repetition_penalty": st.sampled_from([1.2, 0.8]),
        "frequency_penalty": st.just(0.3),
        "presence_penalty": st.just(0.5),
        "logit_bias": st.just({3: 2.0, 17: -5.0}),
        "watermark": st.just(True),
    },
)
# Greedy (penalties and bias still apply) or sampled: greedy requests are compared.
PARAMETERS = st.one_of(PENALTIES, st.builds(lambda a, b: {**a, **b}, SAMPLING, PENALTIES))
OPTIONS = {
    "top_n_tokens": st.integers(1, 5),
    "prefill_logprobs": st.just(True),
    "n": st.integers(2, 3),
    "stop": st.just(["the"]),
    "grammar": st.sampled_from(sorted(GRAMMARS)),
}


def records(adapters: tuple[str, ...] = ()):
    """Two waves of requests (each submitted at once, the second after the first finished)."""
    options = dict(OPTIONS, **({"adapter": st.sampled_from(adapters)} if adapters else {}))
    record = st.fixed_dictionaries(
        {
            "prefix": st.sampled_from([None, 0, 1]),
            "tail": st.sampled_from(TAILS),
            "max_new_tokens": st.integers(1, 8),
            "parameters": PARAMETERS,
        },
        optional=options,
    )
    wave = st.lists(record, min_size=2, max_size=4)
    return st.lists(wave, min_size=1, max_size=2)


TRAFFIC = settings(
    max_examples=3,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)


def _group(record: dict, first_id: int, tokenizer) -> tuple[list[Request], list[int]]:
    """The record's request and its `n` - 1 siblings, as the router's HTTP wing builds them."""
    prefix = PREFIXES[record["prefix"]] if record["prefix"] is not None else ""
    text = prefix + record["tail"]
    params = dict(record["parameters"])
    params.setdefault("seed", first_id)
    if "grammar" in record:
        params["grammar_type"], params["grammar"] = GRAMMARS[record["grammar"]]
    ids = tokenizer(text)["input_ids"]
    request = Request(
        first_id,
        text,
        truncate=len(ids),
        parameters=NextTokenChooserParameters(**params),
        stopping_parameters=StoppingCriteriaParameters(
            record["max_new_tokens"], stop_sequences=list(record.get("stop", []))
        ),
        # the shard refuses prompt logprobs over more than one prefill: only for short prompts
        prefill_logprobs=record.get("prefill_logprobs", False) and not prefix,
        top_n_tokens=record.get("top_n_tokens", 0),
        adapter_id=record.get("adapter"),
    )
    counter = iter(range(first_id + 1, first_id + 16))
    count = 1 if prefix else record.get("n", 1)  # siblings of a long prompt: more KV than held
    return fanout.siblings(request, count, lambda: next(counter)), ids


def serve(shard, waves: list[list[dict]]) -> tuple[dict, dict, Scheduler]:
    """Every wave through a real Scheduler over `shard`: request id -> (sampled, its token ids),
    request id -> the error its stream ended with, and the scheduler (its stats)."""

    async def run():
        client = InProcessClient(shard, max_batch_size=LIMITS.max_batch_size)
        scheduler = Scheduler(client, PrefixCache(ROUTER_BLOCKS, BLOCK), LIMITS, chunking=True)
        await scheduler.start()
        tokens, errors = {}, {}
        try:
            for number, wave in enumerate(waves):
                streams = []
                for k, record in enumerate(wave):
                    group, ids = _group(record, (number * 8 + k) * 16, shard.tokenizer)
                    try:
                        submitted = scheduler.submit_group(group, len(ids), ids)
                    except ValueError:  # more KV than the cache holds: refused (HTTP 422)
                        continue
                    streams += zip(group, submitted, strict=True)
                for request, stream in streams:
                    try:
                        got = [g async for g in stream]
                    except Exception as error:  # noqa: BLE001 - reported by the test
                        errors[request.id] = repr(error)
                        continue
                    ids = [t for g in got for t in g.tokens.ids]
                    tokens[request.id] = (is_sampling(request.parameters), ids)
        finally:
            await scheduler.stop()
            await client.close()
        return tokens, errors, scheduler

    return asyncio.run(run())


def check_traffic(simulated, plain, waves) -> Scheduler:
    before = simulated.serving_stats()
    tokens, errors, scheduler = serve(simulated, waves)
    after = simulated.serving_stats()
    assert errors == {}
    for kind in ("compiles", "breaks"):
        assert after[f"graph_{kind}_serving"] == before[f"graph_{kind}_serving"] == 0
    expected, plain_errors, _ = serve(plain, waves)
    assert plain_errors == {}
    greedy = {i: ids for i, (sampled, ids) in expected.items() if not sampled}
    assert {i: tokens[i][1] for i in greedy} == greedy
    return scheduler


def _shards(model_dir, **overrides):
    simulated = tiny_shard(model_dir, warmup=LIMITS, simulate="hpu", **SHARD, **overrides)
    plain = tiny_shard(model_dir, warmup=LIMITS, **SHARD, **overrides)
    return simulated, plain


@pytest.fixture(scope="module")
def embedded(smollm_dir, tmp_path_factory):
    """The embedded model with one LoRA adapter, simulated and plain."""
    from tests.test_lora import make_adapter

    adapter = make_adapter(
        smollm_dir, tmp_path_factory.mktemp("lora") / "alpha", 1, 4, 8, False, ["q_proj", "v_proj"]
    )
    return _shards(smollm_dir, lora_adapters=(("alpha", str(adapter)),))


@pytest.fixture(scope="module")
def moe(smollm_dir, tmp_path_factory):
    model_dir = build_family_model("qwen3_moe", tmp_path_factory.mktemp("moe"), smollm_dir)
    return _shards(model_dir)


# Every feature at once, and the three that need a router: two long prompts sharing a prefix
# (a cache hit for the second, both chunked), and more KV than the router's blocks hold.
EVERYTHING = [
    [
        {"prefix": 0, "tail": TAILS[2], "max_new_tokens": 16, "parameters": {},
         "top_n_tokens": 3},
        {"prefix": 0, "tail": TAILS[1], "max_new_tokens": 8, "stop": ["the"],
         "parameters": {"repetition_penalty": 1.2, "frequency_penalty": 0.3,
                        "presence_penalty": 0.5, "logit_bias": {3: 2.0}}},
        {"prefix": 1, "tail": TAILS[2], "max_new_tokens": 8, "grammar": "tools",
         "parameters": {"temperature": 1.3, "top_k": 40, "top_p": 0.95, "typical_p": 0.6,
                        "seed": 7, "watermark": True}},
        {"prefix": None, "tail": TAILS[2], "max_new_tokens": 6, "n": 2, "grammar": "json",
         "prefill_logprobs": True, "parameters": {"repetition_penalty": 1.2}},
    ],
    [
        {"prefix": 1, "tail": TAILS[3], "max_new_tokens": 6, "grammar": "regex",
         "parameters": {"repetition_penalty": 0.8}},
        {"prefix": None, "tail": TAILS[4], "max_new_tokens": 4, "n": 3,
         "parameters": {"temperature": 0.5, "seed": 3, "top_k": 5}},
    ],
]  # fmt: skip


def _with_adapter(waves, adapter):
    return [[dict(r, adapter=adapter) if i % 2 else r for i, r in enumerate(w)] for w in waves]


@pytest.mark.parametrize("model", ["embedded", "moe"])
def test_every_feature_with_prefix_hits_chunks_and_preemption(model, request):
    simulated, plain = request.getfixturevalue(model)
    waves = _with_adapter(EVERYTHING, "alpha") if model == "embedded" else EVERYTHING
    scheduler = check_traffic(simulated, plain, waves)
    stats = scheduler.stats
    assert stats.chunked_prompts > 0 and stats.preemptions > 0, stats
    assert scheduler.allocator.stats.hit_requests > 0


@TRAFFIC
@given(waves=records())
def test_random_traffic_compiles_nothing_and_keeps_greedy_tokens(moe, waves):
    """Hypothesis' traffic on the tiny MoE model."""
    check_traffic(*moe, waves)


@settings(TRAFFIC, max_examples=2)
@given(waves=records(("alpha",)))
def test_random_traffic_on_the_embedded_model_with_an_adapter(embedded, waves):
    """Hypothesis' traffic on the embedded model (its rows may take the LoRA adapter): fewer
    examples than on the tiny MoE model, each a real 135M-parameter model twice."""
    check_traffic(*embedded, waves)
