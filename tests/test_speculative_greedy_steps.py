"""A draft model's greedy proposals in one fused call (DraftRunner.greedy_steps, the CPU kernels'
greedy_steps): a lone greedy row's proposals are the one-step loop's token for token, with or
without prompt lookup's guesses fed along, the target's output stays plain decoding's, and every
other row (sampled, in a batch, at an unwarmed bucket) takes the loop. bfloat16, where the fused
decoder runs."""

import random

import pytest

from engine.devices.cpu.kernels import (
    FmaLinear,
    FusedDecoder,
    Int4Linear,
    ScreenedHead,
    load,
    serves,
)
from engine.speculative.draft import DraftModel, DraftRunner
from engine.speculative.ngram import NgramIndex
from tests.helpers import build_request, tiny_shard
from tests.test_speculative import run
from tests.test_speculative_draft import SEEDED


@pytest.fixture(autouse=True, scope="module")
def fused_decoder_here():
    """The fused decoder multiplies packed weights: AVX2's product at the least (the ISA level in
    force, tests/isa_levels.py); int4 drafts need AVX512-BF16's (int4_draft_here)."""
    if not serves(FmaLinear):
        pytest.skip("no packed bfloat16 product at this ISA level (or the kernels not built)")


def int4_draft_here(quantize: str = "int4") -> None:
    if quantize == "int4" and not serves(Int4Linear):
        pytest.skip("an int4 draft's packed products need AVX512-BF16 (the CPU or the cap)")


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
    """Each request's tokens, every propose() call's proposals, and the fused calls made: (tokens
    fed first, proposals asked, each forward's (rows, proposals))."""
    proposals, calls = [], []
    propose, steps = DraftModel.propose, FusedDecoder.greedy_steps

    def recording_propose(self, sequences, rooms):
        out = propose(self, sequences, rooms)
        proposals.append(out[0])
        return out

    def counting_steps(self, fed, position, count, slots, *guessing):
        tokens, forwards = steps(self, fed, position, count, slots, *guessing)
        calls.append((len(fed), count, forwards))
        return tokens, forwards

    with monkeypatch.context() as patch:
        patch.setattr(DraftModel, "propose", recording_propose)
        patch.setattr(FusedDecoder, "greedy_steps", counting_steps)
        tokens = run(shard, requests)
    return tokens, proposals, calls


def the_loop_only(patch):
    patch.setattr(DraftRunner, "greedy_steps", lambda self, seq, fed, position, count: None)


@pytest.mark.parametrize("quantize", ["none", "int4"])
def test_a_lone_greedy_rows_proposals_are_the_one_step_loops(shards, quantize, monkeypatch):
    int4_draft_here(quantize)
    shard = shards(quantize)
    draft = shard.speculator.draft.model
    assert draft.fused_decode.takes_greedy_steps()
    # an int8 draft head is screened in int4 (ScreenedHead); a bfloat16 one stays as it is
    assert isinstance(draft.lm_head.quantized, ScreenedHead) == (quantize == "int4")
    tokens, fused, calls = recorded(shard, [build_request(0, NEW)], monkeypatch)
    # every call but the last few (fewer tokens left to propose) catches up and proposes all of K
    assert calls and max(count for _, count, _ in calls) == K
    with monkeypatch.context() as patch:
        the_loop_only(patch)
        loop_tokens, looped, loop_calls = recorded(shard, [build_request(0, NEW)], monkeypatch)
    assert not loop_calls
    assert fused == looped and any(any(p) for p in fused)
    assert tokens == loop_tokens == run(shards("plain"), [build_request(0, NEW)])
    assert not shard.adapter.shapes.unwarmed


def guesses_of(calls) -> tuple[int, int]:
    """How many guessed tokens the calls' forwards fed, and how many of them stood."""
    guessed = kept = 0
    for fed, _, forwards in calls:
        for index, (rows, made) in enumerate(forwards):
            guessed += rows - (fed if index == 0 else 1)
            kept += made - 1
    return guessed, kept


def a_real_call(shard, monkeypatch):
    """The arguments of the latest fused call a real request made, all of K asked for (adaptive K
    off): fed tokens, position, count, slots."""
    calls, steps = [], FusedDecoder.greedy_steps

    def keeping(self, fed, position, count, slots, *guessing):
        calls.append((list(fed), position, count, list(slots)))
        return steps(self, fed, position, count, slots, *guessing)

    with monkeypatch.context() as patch:
        patch.setattr(FusedDecoder, "greedy_steps", keeping)
        patch.setattr(shard.speculator, "adaptive", False)
        run(shard, [build_request(0, NEW)])
    return max(calls, key=lambda call: (call[2], call[1]))


@pytest.mark.parametrize("quantize", ["none", "int4"])
def test_guesses_that_stand_save_forwards_and_keep_the_proposals(shards, quantize, monkeypatch):
    int4_draft_here(quantize)
    """Replaying a real call with a history whose lookup guesses the call's own proposals but the
    fourth: a forward feeds its token and the guesses after it, each guess the draft chose stands
    (its row chooses next), the wrong one does not, and the proposals are those of one token a
    forward."""
    shard = shards(quantize)
    fused = shard.speculator.draft.model.fused_decode
    fed, position, count, slots = a_real_call(shard, monkeypatch)
    alone, forwards = fused.greedy_steps(fed, position, count, slots)
    assert count == K and len(forwards) == K
    a, b, filler = [t for t in range(1, 100) if t not in fed + alone][:3]
    planted = [a, b, *fed, *alone[:3], filler, *alone[4:]]  # after [.., a, b, *fed]: alone's
    assert position >= len(planted) + 2
    history = planted + [filler] * (position - len(planted) - 2) + [a, b]
    tokens, forwards = fused.greedy_steps(fed, position, count, slots, history, count - 1)
    assert tokens == alone
    guessed, kept = guesses_of([(len(fed), count, forwards)])
    assert 0 < kept < guessed  # the fourth guess fell
    assert len(forwards) < count
    assert max(rows for rows, _ in forwards) == FusedDecoder.guess_rows()


def test_no_guesses_without_their_warmed_verify_buckets(shards, monkeypatch):
    """A forward with guesses counts as a verify bucket of its rows: where those were not warmed,
    the call feeds no guess (one token a forward after the first) and proposes the same."""
    int4_draft_here()
    shard = shards("int4")
    request = [build_request(0, NEW)]
    _, guessing, _ = recorded(shard, request, monkeypatch)
    warmed = shard.adapter.shapes.warmed
    monkeypatch.setattr(
        shard.adapter.shapes,
        "warmed",
        {s for s in warmed if not (s[:2] == ("draft", "verify") and s[2].width > 2)},
    )
    _, plain, calls = recorded(shard, request, monkeypatch)
    assert calls and guesses_of(calls) == (0, 0)
    assert plain == guessing


def test_the_kernels_prompt_lookup_is_the_ngram_index_on_three_tokens():
    """greedy_steps guesses what followed the latest earlier occurrence of a row's last three
    tokens, as NgramIndex.propose does where it finds them; nothing on shorter matches."""
    lookup = load().prompt_lookup
    rng = random.Random(0)
    found = 0
    for _ in range(400):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        count = rng.randrange(0, 6)
        suffix = tokens[-3:]
        ends = [e for e in range(3, len(tokens)) if tokens[e - 3 : e] == suffix]
        expected = NgramIndex().propose(tokens, count) if ends else []
        assert lookup(tokens, count) == expected, (tokens, count)
        found += bool(expected)
    assert found > 50  # 81 of the 400 draws find their three tokens
    assert lookup([7, 1, 2, 9, 5, 1, 2, 9], 3) == [5, 1, 2]
    assert lookup([7, 1, 2, 9, 5, 2, 9], 3) == []  # only two tokens match


def test_sampled_rows_and_batches_take_the_one_step_loop(shards, monkeypatch):
    int4_draft_here()
    shard = shards("int4")
    _, proposals, calls = recorded(shard, [build_request(1, 24, parameters=SEEDED)], monkeypatch)
    assert any(any(p) for p in proposals) and not calls  # a sampled row proposes draws from q
    tokens, _, calls = recorded(shard, [build_request(i, 24) for i in (0, 2)], monkeypatch)
    assert not calls
    assert tokens == run(shards("plain"), [build_request(i, 24) for i in (0, 2)])


def test_a_step_at_an_unwarmed_bucket_leaves_the_row_to_the_loop(shards, monkeypatch):
    """The fused call runs only where every one of its steps' decode buckets was warmed (strict
    mode and the shape counters then see the same buckets the loop would run)."""
    int4_draft_here()
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
    assert {width for width, _, _ in calls} == {1, 2}
    with monkeypatch.context() as patch:
        the_loop_only(patch)
        loop_tokens, looped, _ = recorded(shard, [build_request(0, NEW)], monkeypatch)
    assert catch_ups and set(catch_ups) == {2}
    assert fused == looped
    assert tokens == loop_tokens == run(shards("plain"), [build_request(0, NEW)])


@pytest.mark.slow
def test_the_embedded_models_int4_draft_for_its_bfloat16_form(smollm_dir, monkeypatch):
    """The benchmarks' pairing: SmolLM2 in bfloat16, its int4 form drafting (int4 layers, int8
    embedding and LM head). Fused proposals are the loop's, the output plain decoding's; on text
    that repeats its prompt, prompt lookup's guesses stand and save forwards."""
    int4_draft_here()
    shard = tiny_shard(
        smollm_dir,
        max_batch_size=4,
        dtype="bfloat16",
        speculate="draft",
        draft_model=str(smollm_dir),
        draft_quantize="int4",
        num_speculative_tokens=8,
    )
    plain = tiny_shard(smollm_dir, max_batch_size=4, dtype="bfloat16")
    counting = "one, two, three, four, five, six, seven, eight, nine, ten, one, two, three,"
    request = [build_request(0, 48, counting)]
    tokens, fused, calls = recorded(shard, request, monkeypatch)
    assert calls
    with monkeypatch.context() as patch:
        the_loop_only(patch)
        loop_tokens, looped, _ = recorded(shard, request, monkeypatch)
    assert fused == looped
    assert tokens == loop_tokens == run(plain, request)
    guessed, kept = guesses_of(calls)
    assert kept > guessed / 2
    for built in (shard, plain):
        built.clear()
