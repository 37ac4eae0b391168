"""Prefill logprobs, chosen-token logprobs, top-n alternatives, stop sequences, truncation, warmup batch."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.batch import Batch, FinishReason, Request, StoppingCriteriaParameters
from engine.serving.shard import Shard
from tests.conftest import tiny_config
from tests.helpers import shard_fixture

PROMPT = "The lighthouse keeper counted the ships that passed in the night"


shard = shard_fixture(max_batch_size=4)


@pytest.fixture(scope="module")
def hf_model(tiny_model_dirs):
    return AutoModelForCausalLM.from_pretrained(
        tiny_model_dirs["llama"], dtype=torch.float32
    ).eval()


def run(shard, batch_id, request):
    """Every generation of one request, prefill then decode until it finishes."""
    generations, cached = shard.prefill(Batch(batch_id, [request]))
    out = list(generations)
    while cached is not None:
        generations, cached = shard.decode([cached])
        out += generations
    return out


def hf_log_softmax(hf_model, ids):
    with torch.inference_mode():
        return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_prefill_and_chosen_logprobs_equal_transformers_log_softmax(shard, hf_model):
    stopping = StoppingCriteriaParameters(max_new_tokens=12, ignore_eos_token=True)
    out = run(shard, 1, Request(1, PROMPT, stopping_parameters=stopping, prefill_logprobs=True))
    prompt = out[0].prefill_tokens
    assert prompt.ids == shard.tokenizer(PROMPT)["input_ids"]
    generated = [g.tokens.ids[0] for g in out]
    reference = hf_log_softmax(hf_model, prompt.ids + generated)
    assert math.isnan(prompt.logprobs[0])
    expected_prompt = [reference[t - 1, prompt.ids[t]].item() for t in range(1, len(prompt.ids))]
    assert prompt.logprobs[1:] == pytest.approx(expected_prompt, abs=1e-4)
    assert "".join(prompt.texts) == shard.tokenizer.decode(prompt.ids)
    n = len(prompt.ids)
    expected_chosen = [reference[n - 1 + i, token].item() for i, token in enumerate(generated)]
    assert [g.tokens.logprobs[0] for g in out] == pytest.approx(expected_chosen, abs=1e-4)
    assert generated == reference[n - 1 :].argmax(-1).tolist()[: len(generated)]


def test_top_n_tokens_are_the_most_likely_alternatives(shard, hf_model):
    stopping = StoppingCriteriaParameters(max_new_tokens=4, ignore_eos_token=True)
    out = run(shard, 2, Request(2, PROMPT, stopping_parameters=stopping, top_n_tokens=3))
    ids = shard.tokenizer(PROMPT)["input_ids"] + [g.tokens.ids[0] for g in out]
    reference = hf_log_softmax(hf_model, ids)
    for step, generation in enumerate(out):
        (top,) = generation.top_tokens
        expected = reference[len(ids) - len(out) - 1 + step].topk(3)
        assert top.ids == expected.indices.tolist()
        assert top.logprobs == pytest.approx(expected.values.tolist(), abs=1e-4)
        assert top.ids[0] == generation.tokens.ids[0]  # greedy takes the best alternative


def test_stop_sequence_split_across_tokens_ends_generation(shard):
    stopping = StoppingCriteriaParameters(max_new_tokens=30, ignore_eos_token=True)
    free_run = run(shard, 3, Request(3, PROMPT, stopping_parameters=stopping))
    texts = [g.tokens.texts[0] for g in free_run]
    # A stop sequence made of the end of one token's text and the start of the next one's.
    k = next(
        i
        for i in range(3, len(texts) - 1)
        if len(texts[i]) >= 2
        and len(texts[i + 1]) >= 2
        and texts[i][-2:] + texts[i + 1][:2] not in "".join(texts[: i + 1])
    )
    stop = texts[k][-2:] + texts[k + 1][:2]
    stopped = run(
        shard,
        4,
        Request(
            4,
            PROMPT,
            stopping_parameters=StoppingCriteriaParameters(
                max_new_tokens=30, ignore_eos_token=True, stop_sequences=["never appears", stop]
            ),
        ),
    )
    final = stopped[-1].generated_text
    assert final.finish_reason == FinishReason.STOP_SEQUENCE
    assert final.generated_tokens == k + 2
    assert final.text == shard.tokenizer.decode(
        [g.tokens.ids[0] for g in free_run[: k + 2]], skip_special_tokens=True
    )
    assert final.text.endswith(texts[k + 1]) and stop in final.text


def test_truncate_keeps_the_last_tokens(shard):
    stopping = StoppingCriteriaParameters(max_new_tokens=6, ignore_eos_token=True)
    ids = shard.tokenizer(PROMPT)["input_ids"]
    truncated = run(
        shard,
        5,
        Request(5, PROMPT, truncate=4, stopping_parameters=stopping, prefill_logprobs=True),
    )
    assert truncated[0].prefill_tokens.ids == ids[-4:]
    tail_text = shard.tokenizer.decode(ids[-4:])
    assert shard.tokenizer(tail_text)["input_ids"] == ids[-4:]  # the tail re-encodes to itself
    direct = run(shard, 6, Request(6, tail_text, stopping_parameters=stopping))
    assert [g.tokens.ids for g in truncated] == [g.tokens.ids for g in direct]


def test_warmup_runs_a_tgi_style_batch_and_leaves_the_cache_free(tiny_model_dirs):
    shard = Shard(
        tiny_config(
            tiny_model_dirs["qwen2"],
            max_batch_size=2,
            max_input_tokens=32,
            max_total_tokens=64,
            max_prefill_tokens=64,
        ),
        show_progress=False,
    )
    requests = [
        Request(
            i,
            "_test " * 10,
            truncate=32,
            stopping_parameters=StoppingCriteriaParameters(max_new_tokens=2),
        )
        for i in range(2)
    ]
    result = shard.warmup(batch=Batch(0, requests))
    assert result.max_input_tokens == 32 and result.max_total_tokens == 64
    assert result.max_supported_total_tokens == (shard.allocator.num_blocks - 1) * 16
    assert shard.allocator.num_free == shard.allocator.num_blocks - 1 and not shard.batches
    shard.health()


def constrained(shard, batch_id, grammar_type, grammar, **params):
    from engine.batch import NextTokenChooserParameters

    request = Request(
        batch_id,
        PROMPT,
        stopping_parameters=StoppingCriteriaParameters(max_new_tokens=60),
        parameters=NextTokenChooserParameters(grammar=grammar, grammar_type=grammar_type, **params),
    )
    return run(shard, batch_id, request)[-1].generated_text


@pytest.mark.parametrize("params", [{}, {"do_sample": True, "seed": 7, "temperature": 1.5}])
def test_json_grammar_output_parses_and_validates(shard, params):
    import json

    from engine.batch import GrammarType

    schema = {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "ok": {"type": "boolean"},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        },
        "required": ["color", "ok", "tags"],
    }
    final = constrained(shard, 20, GrammarType.JSON, json.dumps(schema), **params)
    assert (
        final.finish_reason == FinishReason.EOS_TOKEN
    )  # the grammar completed, then only EOS was allowed
    value = json.loads(final.text)
    assert set(value) == {"color", "ok", "tags"} and value["color"] in {"red", "green", "blue"}
    assert (
        isinstance(value["ok"], bool)
        and len(value["tags"]) <= 3
        and set(value["tags"]) <= {"a", "b"}
    )


def test_regex_grammar_output_matches(shard):
    import re

    from engine.batch import GrammarType

    final = constrained(shard, 21, GrammarType.REGEX, r"\d{3}-\d{4} (yes|no|maybe)")
    assert re.fullmatch(r"\d{3}-\d{4} (yes|no|maybe)", final.text)


def test_grammar_state_survives_filter_and_concatenation(shard):
    import re

    from engine.batch import GrammarType, NextTokenChooserParameters

    regex = r"[a-c]{4}-[x-z]{4}"
    stopping = StoppingCriteriaParameters(max_new_tokens=30)
    grammar = NextTokenChooserParameters(grammar=regex, grammar_type=GrammarType.REGEX)
    free = Request(
        31,
        PROMPT,
        stopping_parameters=StoppingCriteriaParameters(max_new_tokens=30, ignore_eos_token=True),
    )
    _, first = shard.prefill(
        Batch(30, [Request(30, PROMPT, stopping_parameters=stopping, parameters=grammar), free])
    )
    _, second = shard.prefill(
        Batch(32, [Request(32, "Hi", stopping_parameters=stopping, parameters=grammar)])
    )
    generations, cached = shard.decode([second, first])  # concatenated in the other order
    cached = shard.filter(cached.id, [30, 32])  # drop the unconstrained request
    texts = {}
    while cached is not None:
        generations, cached = shard.decode([cached])
        texts.update({g.request_id: g.generated_text.text for g in generations if g.generated_text})
    assert re.fullmatch(regex, texts[30]) and re.fullmatch(regex, texts[32])


def test_invalid_grammar_is_refused_naming_the_field(shard):
    from engine.batch import GrammarType
    from engine.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="parameters.grammar: invalid JSON schema"):
        constrained(shard, 40, GrammarType.JSON, '{"type": "nonsense"}')
    with pytest.raises(InvalidRequestError, match="parameters.grammar: invalid regex"):
        constrained(shard, 41, GrammarType.REGEX, "(unclosed")
    assert shard.allocator.num_free == shard.allocator.num_blocks - 1


def test_same_seed_same_tokens_and_the_seed_is_returned(shard):
    from engine.batch import NextTokenChooserParameters

    def sample(batch_id, seed):
        params = NextTokenChooserParameters(do_sample=True, seed=seed, temperature=1.3, top_k=50)
        stopping = StoppingCriteriaParameters(max_new_tokens=16, ignore_eos_token=True)
        out = run(
            shard,
            batch_id,
            Request(batch_id, PROMPT, parameters=params, stopping_parameters=stopping),
        )
        return [g.tokens.ids[0] for g in out], out[-1].generated_text.seed

    first, seed = sample(50, 1234)
    again, _ = sample(51, 1234)
    other, other_seed = sample(52, 99)
    assert seed == 1234 and other_seed == 99
    assert first == again and first != other
