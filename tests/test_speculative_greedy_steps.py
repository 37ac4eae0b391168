"""A draft model's greedy proposals in one fused call (DraftRunner.greedy_steps, the CPU kernels'
greedy_steps): a lone greedy row's proposals are the one-step loop's token for token, the target's
output stays plain decoding's, and every other row (sampled, in a batch, at an unwarmed bucket)
takes the loop. bfloat16, where the fused decoder runs."""

import pytest

from engine.devices.cpu_kernels import FusedDecoder, ScreenedHead, load
from engine.spec.draft import DraftModel, DraftRunner
from tests.helpers import build_request, tiny_shard
from tests.test_speculative import run
from tests.test_speculative_draft import SEEDED

pytestmark = pytest.mark.skipif(
    load() is None or not load().dot_linear_supported(),
    reason="the fused decoder needs the CPU kernels with AVX512-BF16",
)

NEW = 40  # crosses block boundaries (blocks of 16) inside one fused call
K = 6


@pytest.fixture(scope="module")
def shards(tiny_model_dirs):
    """quantize -> a bfloat16 shard on the tiny llama drafting with its own weights in that form
    ("none": a bfloat16 embedding and packed bfloat16 LM head; "int4": an int8 embedding and an
    int8 head screened in int4); "plain": no speculation."""
    built = {}

    def get(quantize):
        if quantize not in built:
            spec = (
                {}
                if quantize == "plain"
                else dict(
                    speculate="draft",
                    draft_model=str(tiny_model_dirs["llama"]),
                    draft_quantize=quantize,
                    num_speculative_tokens=K,
                )
            )
            built[quantize] = tiny_shard(
                tiny_model_dirs["llama"], max_batch_size=4, dtype="bfloat16", **spec
            )
        return built[quantize]

    yield get
    for shard in built.values():
        shard.clear()


def recorded(shard, requests, monkeypatch):
    """Each request's tokens, every propose() call's proposals, and the fused calls made."""
    proposals, calls = [], []
    propose, steps = DraftModel.propose, FusedDecoder.greedy_steps

    def recording_propose(self, sequences, rooms):
        out = propose(self, sequences, rooms)
        proposals.append(out[0])
        return out

    def counting_steps(self, fed, position, count, slots):
        calls.append((len(fed), count))
        return steps(self, fed, position, count, slots)

    with monkeypatch.context() as patch:
        patch.setattr(DraftModel, "propose", recording_propose)
        patch.setattr(FusedDecoder, "greedy_steps", counting_steps)
        tokens = run(shard, requests)
    return tokens, proposals, calls


def the_loop_only(patch):
    patch.setattr(DraftRunner, "greedy_steps", lambda self, seq, fed, position, count: None)


@pytest.mark.parametrize("quantize", ["none", "int4"])
def test_a_lone_greedy_rows_proposals_are_the_one_step_loops(shards, quantize, monkeypatch):
    shard = shards(quantize)
    draft = shard.speculator.draft.model
    assert draft.fused_decode.takes_greedy_steps()
    # an int8 draft head is screened in int4 (ScreenedHead); a bfloat16 one stays as it is
    assert isinstance(draft.lm_head.quantized, ScreenedHead) == (quantize == "int4")
    tokens, fused, calls = recorded(shard, [build_request(0, NEW)], monkeypatch)
    # every call but the last few (fewer tokens left to propose) catches up and proposes all of K
    assert calls and max(count for _, count in calls) == K
    with monkeypatch.context() as patch:
        the_loop_only(patch)
        loop_tokens, looped, loop_calls = recorded(shard, [build_request(0, NEW)], monkeypatch)
    assert not loop_calls
    assert fused == looped and any(any(p) for p in fused)
    assert tokens == loop_tokens == run(shards("plain"), [build_request(0, NEW)])
    assert not shard.adapter.shapes.unwarmed


def test_sampled_rows_and_batches_take_the_one_step_loop(shards, monkeypatch):
    shard = shards("int4")
    _, proposals, calls = recorded(shard, [build_request(1, 24, parameters=SEEDED)], monkeypatch)
    assert any(any(p) for p in proposals) and not calls  # a sampled row proposes draws from q
    tokens, _, calls = recorded(shard, [build_request(i, 24) for i in (0, 2)], monkeypatch)
    assert not calls
    assert tokens == run(shards("plain"), [build_request(i, 24) for i in (0, 2)])


def test_a_step_at_an_unwarmed_bucket_leaves_the_row_to_the_loop(shards, monkeypatch):
    """The fused call runs only where every one of its steps' decode buckets was warmed (strict
    mode and the shape counters then see the same buckets the loop would run)."""
    shard = shards("int4")
    runner = shard.speculator.draft.runner
    warmed = shard.adapter.shapes.warmed
    monkeypatch.setattr(
        shard.adapter.shapes,
        "warmed",
        {s for s in warmed if not (s[:2] == ("draft", "decode") and s[2].num_blocks > 1)},
    )

    class Row:  # a sequence of 20 tokens (blocks of 16): its next steps need two blocks
        token_ids = list(range(20))
        blocks = [1, 2, 3]

        def blocks_through(self, position):
            return self.blocks[: position // runner.block_size + 1]

        def slots(self, start, end):
            size = runner.block_size
            return [self.blocks[p // size] * size + p % size for p in range(start, end)]

    assert runner.greedy_steps(Row(), [5], 20, 3) is None  # proposals at positions 20-22
    assert runner.greedy_steps(Row(), [18, 19], 18, 3) is None  # a catch-up, then 21 and 22
    assert runner.greedy_steps(Row(), [13, 14], 13, 2) is not None  # positions 13-15: one block


def test_the_catch_up_and_the_proposals_are_one_call(shards, monkeypatch):
    """After the prompt's prefill primed the draft, a lone greedy row's catch-up (its latest
    token, then each verify's last proposal and bonus token: the bfloat16 draft has every proposal
    accepted) runs inside the fused call, not through the draft runner's verify forward, and the
    proposals are still the loop's (whose catch-up runs in the width-2 verify bucket)."""
    shard = shards("none")
    verify, catch_ups = DraftRunner.verify, []

    def counting_verify(self, bucket, seqs):
        catch_ups.append(bucket.width)
        return verify(self, bucket, seqs)

    monkeypatch.setattr(DraftRunner, "verify", counting_verify)
    tokens, fused, calls = recorded(shard, [build_request(0, NEW)], monkeypatch)
    assert not catch_ups
    assert {width for width, _ in calls} == {1, 2}
    with monkeypatch.context() as patch:
        the_loop_only(patch)
        loop_tokens, looped, _ = recorded(shard, [build_request(0, NEW)], monkeypatch)
    assert catch_ups and set(catch_ups) == {2}
    assert fused == looped
    assert tokens == loop_tokens == run(shards("plain"), [build_request(0, NEW)])


@pytest.mark.slow
def test_the_embedded_models_int4_draft_for_its_bfloat16_form(smollm_dir, monkeypatch):
    """The benchmarks' pairing: SmolLM2 in bfloat16, its int4 form drafting (int4 layers, int8
    embedding and LM head). Fused proposals are the loop's, the output plain decoding's."""
    shard = tiny_shard(
        smollm_dir,
        max_batch_size=4,
        dtype="bfloat16",
        speculate="draft",
        draft_model=str(smollm_dir),
        draft_quantize="int4",
        num_speculative_tokens=8,
    )
    request = [build_request(0, 48)]
    tokens, fused, calls = recorded(shard, request, monkeypatch)
    assert calls
    with monkeypatch.context() as patch:
        the_loop_only(patch)
        loop_tokens, looped, _ = recorded(shard, request, monkeypatch)
    assert fused == looped
    plain = tiny_shard(smollm_dir, max_batch_size=4, dtype="bfloat16")
    assert tokens == loop_tokens == run(plain, request)
    for built in (shard, plain):
        built.clear()
