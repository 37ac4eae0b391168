"""Siblings on the shard (engine/serving/siblings.py): a request naming another of its Prefill as
`prefill_source` copies that prompt's KV instead of computing it and then decodes exactly as if it had
computed it; a source missing from the Prefill means computing it; a source with another prompt is refused."""

import pytest

from engine.batch import Batch, NextTokenChooserParameters, Request, StoppingCriteriaParameters
from engine.errors import InvalidRequestError
from tests.helpers import shard_fixture

PROMPT = "The quick brown fox jumps over the lazy dog, and then"
STOP = StoppingCriteriaParameters(
    max_new_tokens=20, ignore_eos_token=True
)  # > 1 block: decode reads copied blocks


shard = shard_fixture(max_batch_size=4)


def run(shard, batch_id: int, requests: list[Request]) -> dict[int, list[int]]:
    generations, cached = shard.prefill(Batch(batch_id, requests, size=len(requests)))
    out = {g.request_id: list(g.tokens.ids) for g in generations}
    while cached is not None:
        generations, cached = shard.decode([cached])
        for g in generations:
            out[g.request_id] += g.tokens.ids
    return out


def sampled(seed: int) -> NextTokenChooserParameters:
    return NextTokenChooserParameters(do_sample=True, temperature=1.0, seed=seed)


def test_a_sibling_decodes_as_if_it_had_computed_its_prompt(shard):
    before = shard.serving_stats()
    shared = run(
        shard,
        1,
        [
            Request(1, PROMPT, parameters=sampled(5), stopping_parameters=STOP),
            Request(2, PROMPT, parameters=sampled(6), stopping_parameters=STOP, prefill_source=1),
        ],
    )
    after = shard.serving_stats()
    alone = run(shard, 2, [Request(3, PROMPT, parameters=sampled(6), stopping_parameters=STOP)])
    assert shared[2] == alone[3] and shared[1] != shared[2]
    assert after["copied_prompts"] - before["copied_prompts"] == 1
    assert after["prefill_real"] - before["prefill_real"] == len(
        shard.tokenizer(PROMPT)["input_ids"]
    )


def test_a_source_outside_the_prefill_means_computing_the_prompt(shard):
    before = shard.serving_stats()["copied_prompts"]
    out = run(shard, 3, [Request(4, PROMPT, stopping_parameters=STOP, prefill_source=99)])
    assert len(out[4]) == STOP.max_new_tokens and shard.serving_stats()["copied_prompts"] == before


def test_a_source_with_another_prompt_is_refused(shard):
    with pytest.raises(InvalidRequestError, match="prefill_source 5 has another prompt"):
        run(
            shard,
            4,
            [
                Request(5, PROMPT, stopping_parameters=STOP),
                Request(6, "Something else", stopping_parameters=STOP, prefill_source=5),
            ],
        )
    assert not shard.batches and shard.allocator.num_free == shard.allocator.num_blocks - 1
