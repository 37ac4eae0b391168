"""Speculative decoding with a draft model (engine/speculative/draft.py): greedy output is plain
decoding's token for token, sampled output keeps the target's distribution (the rejection rule),
and a draft that cannot serve the target is refused at start with one error line."""

import json
import shutil

import pytest
import torch

from engine.batch import Batch, NextTokenChooserParameters
from engine.devices.cpu import kernels as cpu_kernels
from engine.kv_cache import slots_for
from engine.runner import PrefillInput
from engine.speculative.draft import fed_at
from tests.helpers import build_request, shard_fixture, tiny_shard
from tests.models import build_tiny_model
from tests.test_equivalence import PROMPTS
from tests.test_speculative import WORDS, chi2_sf, dataclasses_replace, run

NEW = 40  # crosses block boundaries (blocks of 16)
K = 4

plain = shard_fixture(max_batch_size=4)


@pytest.fixture(scope="module")
def draft_dirs(tmp_path_factory, smollm_dir, tiny_model_dirs):
    """small: a one-layer random llama with the target's vocabulary (it mostly disagrees with the
    target); self: the target itself (it always agrees)."""
    root = tmp_path_factory.mktemp("drafts")
    small = build_tiny_model("llama", root / "small", smollm_dir, seed=7, num_hidden_layers=1)
    return {"small": small, "self": tiny_model_dirs["llama"]}


@pytest.fixture(scope="module")
def drafting(tiny_model_dirs, draft_dirs):
    """variant -> a shard on the tiny llama speculating with that draft."""
    shards = {}

    def get(variant):
        if variant not in shards:
            shards[variant] = tiny_shard(
                tiny_model_dirs["llama"],
                max_batch_size=4,
                speculate="draft",
                draft_model=str(draft_dirs[variant]),
                num_speculative_tokens=K,
            )
        return shards[variant]

    yield get
    for shard in shards.values():
        shard.clear()


SEEDED = NextTokenChooserParameters(temperature=0.9, top_k=20, do_sample=True, seed=99)


def requests_for(batch):
    """Greedy requests, but for request 1, which samples (seeded)."""
    return [build_request(i, NEW, parameters=SEEDED if i == 1 else None) for i in batch]


@pytest.mark.parametrize("variant", ["small", "self"])
def test_greedy_tokens_equal_plain_decoding_at_batch_1_and_mixed(plain, drafting, variant):
    """Batch 1, then a mixed batch (prompts of four lengths, one sampled row beside the greedy
    ones): every greedy row's tokens are plain decoding's."""
    shard = drafting(variant)
    for batch in ([4], [0, 1, 4, 5]):
        expected = run(plain, requests_for(batch))
        before = dict(shard.speculator.stats)
        got = run(shard, requests_for(batch))
        greedy = [i for i in batch if i != 1]
        assert {i: got[i] for i in greedy} == {i: expected[i] for i in greedy}
        assert all(len(t) == NEW for t in got.values())
        stats = shard.speculator.stats
        assert stats["spec_proposed"] > before["spec_proposed"]
        accepted = stats["spec_accepted"] - before["spec_accepted"]
        if variant == "self":  # the target as its own draft: greedy proposals all accepted
            assert accepted > (stats["spec_proposed"] - before["spec_proposed"]) // 2
    assert not shard.adapter.shapes.unwarmed
    assert any(shape[0] == "draft" for shape in shard.adapter.shapes.warmed)


def test_the_prefill_step_primes_the_draft_with_each_prompt(drafting, monkeypatch):
    """The step that prefills a prompt computes the draft's KV of it (all but the latest token),
    so the first speculative step feeds the draft one token, not the prompt again."""
    shard = drafting("self")
    shard.clear()
    _, cached = shard.prefill(Batch(1, [build_request(4, NEW), build_request(0, NEW)]))
    rows = shard.batches[cached.id]
    assert [seq.speculation.valid for seq in rows] == [seq.prompt_len for seq in rows]
    draft_prefills = []
    runner = shard.speculator.draft.runner
    monkeypatch.setattr(runner, "prefill", lambda inputs: draft_prefills.append(inputs))
    shard.decode([cached])
    assert draft_prefills == []
    assert shard.speculator.stats["spec_proposed"] > 0


def test_a_batch_too_large_to_speculate_primes_nothing(drafting, monkeypatch):
    shard = drafting("self")
    shard.clear()
    monkeypatch.setattr(shard.speculator, "max_batch", 1)
    _, cached = shard.prefill(Batch(1, [build_request(4, NEW), build_request(0, NEW)]))
    assert all(seq.speculation is None for seq in shard.batches[cached.id])


def test_the_drafts_catch_up_reads_the_logits_at_each_rows_last_token(drafting):
    """The draft's verify forward returns [rows, vocab] at each row's last fed token: with the
    target as its own draft, after two tokens fed they are the target's next-token logits."""
    shard = drafting("self")
    shard.clear()
    _, cached = shard.prefill(Batch(1, [build_request(4, NEW)]))
    seq = shard.batches[cached.id][0]
    n = len(seq.token_ids)
    runner = shard.speculator.draft.runner
    bucket = runner.plan.verify_bucket(1, 2, -(-(n - 2) // shard.block_size))
    fed = PrefillInput(seq.token_ids[-2:], seq.slots(n - 2, n), context_slots=seq.slots(0, n - 2))
    with torch.inference_mode():
        drafted = runner.verify(bucket, [fed])
        expected = shard.runner.decode([fed_at(seq, seq.token_ids[-1], n - 1)])
    assert drafted.shape == expected.shape == (1, shard.model_config.vocab_size)
    torch.testing.assert_close(drafted, expected, rtol=1e-4, atol=1e-4)


# A prompt of more than three blocks of 16, and one shorter than a block.
LONG = " ".join(WORDS * 20)
SHORT = " and so on"


def blocks_for(shard, text, first):
    """Enough blocks from `first` on for the prompt and its NEW tokens."""
    count = -(-(len(shard.tokenizer(text)["input_ids"]) + NEW) // shard.block_size)
    return list(range(first, first + count))


def prefix_request(shard, i, text, blocks, cache_len=0, new=NEW):
    count = len(shard.tokenizer(text)["input_ids"])
    slots = slots_for(blocks, 0, count, shard.block_size)
    return build_request(i, new, text, blocks=blocks, slots=slots, cache_len=cache_len)


def run_keeping_blocks(shard, batch_id, requests):
    """As run, without clearing the shard first: what its blocks hold stays on record."""
    tokens: dict[int, list[int]] = {}
    generations, cached = shard.prefill(Batch(batch_id, requests))
    while True:
        for generation in generations:
            tokens.setdefault(generation.request_id, []).extend(generation.tokens.ids)
        if cached is None:
            return tokens
        generations, cached = shard.decode([cached])


def draft_primes(shard, monkeypatch) -> list:
    """Every input of the draft's prefills from now on (the prefills still run)."""
    runner, seen = shard.speculator.draft.runner, []
    prefill = runner.prefill
    monkeypatch.setattr(runner, "prefill", lambda inputs: seen.extend(inputs) or prefill(inputs))
    return seen


def test_a_prefix_hit_primes_the_draft_after_the_blocks_it_already_holds(drafting, monkeypatch):
    """With prefix caching the draft records what its own blocks hold: a request whose first
    blocks an earlier one filled primes the draft with only the rest of its prompt, after them
    as context, and gets the same tokens and the same accepted proposals as the first time."""
    shard = drafting("small")
    shard.clear()
    owner = blocks_for(shard, LONG, 1)
    first = run_keeping_blocks(shard, 1, [prefix_request(shard, 0, LONG, owner)])
    accepted = shard.speculator.stats["spec_accepted"]
    primes = draft_primes(shard, monkeypatch)
    reused = owner[:3] + blocks_for(shard, LONG, 40)[3:]
    again = prefix_request(shard, 1, LONG, reused, cache_len=3 * shard.block_size)
    assert run_keeping_blocks(shard, 2, [again]) == {1: first[0]}
    assert shard.speculator.stats["spec_accepted"] - accepted == accepted
    prime = primes[0]  # the prefill step's (later ones: catch-ups after plain steps)
    assert len(prime.context_slots) == 3 * shard.block_size
    assert prime.slots[0] == reused[3] * shard.block_size  # the first position after them


def test_the_draft_forgets_a_block_it_overwrites(drafting):
    """A block the draft writes for other tokens, even in part, is no longer vouched for: here a
    request too short to fill the block (it is never recorded again) but primed all the same."""
    shard = drafting("small")
    shard.clear()
    draft = shard.speculator.draft
    owner = blocks_for(shard, LONG, 1)
    ids = shard.tokenizer(LONG)["input_ids"]
    run_keeping_blocks(shard, 1, [prefix_request(shard, 0, LONG, owner)])
    assert draft.contents.held(owner, ids, None, 3) == 3
    assert len(shard.tokenizer(SHORT)["input_ids"]) + 4 < shard.block_size
    run_keeping_blocks(shard, 2, [prefix_request(shard, 1, SHORT, [owner[1]], new=4)])
    assert draft.contents.held(owner, ids, None, 3) == 1  # block 1 now holds some of SHORT


def test_a_draft_far_behind_catches_up_in_one_prefill_after_its_kv(drafting, plain, monkeypatch):
    """A row whose draft fell more than a verify forward behind (plain steps in between: here a
    batch too large to speculate) catches up in one prefill after the draft's KV as context, not
    in verify-width forwards; its tokens are plain decoding's."""
    shard = drafting("self")
    expected = run(plain, [build_request(4, NEW)])[4]
    shard.clear()
    generations, cached = shard.prefill(Batch(1, [build_request(4, NEW)]))
    tokens = [t for g in generations for t in g.tokens.ids]

    def step():
        nonlocal cached
        generations, cached = shard.decode([cached])
        tokens.extend(t for g in generations for t in g.tokens.ids)

    step()  # speculative
    seq = shard.batches[cached.id][0]
    monkeypatch.setattr(shard.speculator, "max_batch", 0)
    for _ in range(K + 2):  # plain: the draft falls behind
        step()
    monkeypatch.undo()
    seq.speculation.settle(seq.token_ids)
    valid, behind = seq.speculation.valid, len(seq.token_ids) - seq.speculation.valid
    assert behind > K + 1
    primes = draft_primes(shard, monkeypatch)
    step()
    assert [(len(p.context_slots), len(p.token_ids)) for p in primes] == [(valid, behind)]
    while cached is not None:
        step()
    assert tokens == expected


def test_a_prompt_beyond_the_prefill_budget_primes_the_draft_chunk_by_chunk(
    tiny_model_dirs, draft_dirs, monkeypatch
):
    """A prompt computed in chunks (chunked prefill) primes the draft in chunks of its longest
    prefill bucket, each after the KV so far, all of it but the latest token before the first
    speculative step; its tokens are plain decoding's."""
    limits = dict(max_batch_size=4, max_prefill_tokens=32, max_input_tokens=192)
    text = " ".join([PROMPTS[4]] * 3)

    def request():
        return build_request(0, NEW, text)

    expected = run(tiny_shard(tiny_model_dirs["llama"], **limits), [request()])
    shard = tiny_shard(
        tiny_model_dirs["llama"],
        **limits,
        speculate="draft",
        draft_model=str(draft_dirs["self"]),
        num_speculative_tokens=K,
    )
    primes = draft_primes(shard, monkeypatch)
    assert run(shard, [request()]) == expected
    longest = shard.speculator.draft.longest_prefill
    fed = len(shard.tokenizer(text)["input_ids"])  # the prompt: all but the first token sampled
    assert fed > 3 * longest
    assert [len(p.context_slots) for p in primes] == list(range(0, fed, longest))
    assert sum(len(p.token_ids) for p in primes) == fed


def test_seeded_sampling_is_reproducible(drafting):
    shard = drafting("small")

    def requests():
        return [
            build_request(i, NEW, parameters=dataclasses_replace(SEEDED, seed=i)) for i in (1, 4)
        ]

    assert run(shard, requests()) == run(shard, requests())


def test_sampled_tokens_keep_the_targets_distribution(plain, drafting, monkeypatch):
    """The first speculated token over many seeds, drafted (one seed set) and plain (another): one
    distribution (chi-square). A logit bias on the prompt's words puts both models' mass there;
    the draft's q also leans to one of them, so that q and p differ: proposals are both accepted
    and rejected, and a rejection must draw from the residual max(0, p - q) to keep p."""
    from collections import Counter

    import engine.speculative.draft as draft_module

    shard = drafting("small")
    words = [plain.tokenizer(w, add_special_tokens=False)["input_ids"][0] for w in WORDS]
    warm = NextTokenChooserParameters(do_sample=True, logit_bias={token: 40.0 for token in words})
    position, seeds = 1, 240  # position 0 is the prefill's; 1 is the first verified

    def leaning(*args, **kwargs):
        scores = process_scores(*args, **kwargs).clone()
        scores[:, words[0]] += 2.0
        return scores

    process_scores = draft_module.process_scores
    monkeypatch.setattr(draft_module, "process_scores", leaning)

    def tokens_at(target, first_seed):
        found = Counter()
        for start in range(first_seed, first_seed + seeds, 4):
            requests = [build_request(i, position + 2, text="".join(WORDS * 6)) for i in range(4)]
            for i, request in enumerate(requests):
                request.parameters = dataclasses_replace(warm, seed=start + i)
            found.update(t[position] for t in run(target, requests).values())
        return found

    before = dict(shard.speculator.stats)
    with_draft, without = tokens_at(shard, 0), tokens_at(plain, 10_000)
    stats = shard.speculator.stats
    proposed = stats["spec_proposed"] - before["spec_proposed"]
    accepted = stats["spec_accepted"] - before["spec_accepted"]
    assert seeds // 4 < accepted < proposed - seeds // 4  # both accepted and rejected, often
    common = [t for t in set(with_draft) | set(without) if with_draft[t] + without[t] >= 10]
    table = [
        [c[t] for t in common] + [sum(c.values()) - sum(c[t] for t in common)]
        for c in (with_draft, without)
    ]
    columns = [j for j in range(len(table[0])) if table[0][j] + table[1][j] > 0]
    assert len(columns) >= 2
    statistic = 0.0
    for row in table:
        for j in columns:
            expected = sum(row) * (table[0][j] + table[1][j]) / (2 * seeds)
            statistic += (row[j] - expected) ** 2 / expected
    assert chi2_sf(statistic, len(columns) - 1) > 0.001


def other_tokenizer(source, out):
    """A copy of `source` whose tokenizer swaps two tokens' ids (the same vocabulary size)."""
    shutil.copytree(source, out)
    path = out / "tokenizer.json"
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    vocab["hello"], vocab["world"] = vocab["world"], vocab["hello"]
    path.write_text(json.dumps(data))
    return out


@pytest.mark.parametrize(
    "bad, message",
    [
        ("vocabulary", "its vocabulary has 49160 tokens, the target's 49152"),
        ("tokenizer", "its tokenizer differs from the target's"),
        ("missing", "--speculate draft needs --draft-model"),
    ],
)
def test_a_draft_that_cannot_serve_the_target_is_one_error_line(
    capsys, tmp_path, smollm_dir, tiny_model_dirs, draft_dirs, bad, message
):
    from engine.cli.main import main

    drafts = {
        "vocabulary": lambda: build_tiny_model(
            "llama", tmp_path / "v", smollm_dir, num_hidden_layers=1, vocab_size=49160
        ),
        "tokenizer": lambda: other_tokenizer(draft_dirs["small"], tmp_path / "t"),
        "missing": lambda: None,
    }
    draft = drafts[bad]()
    capsys.readouterr()  # building the draft's files writes a progress bar
    argv = ["serve", "--model-id", str(tiny_model_dirs["llama"]), "--device", "cpu", "--dtype"]
    argv += ["float32"]  # no packed-kernel build
    argv += ["--speculate", "draft"] + (["--draft-model", str(draft)] if draft else [])
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]


@pytest.mark.slow
def test_the_embedded_models_int4_form_drafts_for_its_float_form(smollm_dir):
    """The embedded model in fp32, its int4 form as the draft: greedy tokens are plain decoding's
    in a mixed batch, and most proposals are accepted. (A lone request is the self-draft tests'.)"""
    plain_shard = tiny_shard(smollm_dir, max_batch_size=4)
    shard = tiny_shard(
        smollm_dir,
        max_batch_size=4,
        speculate="draft",
        draft_model=str(smollm_dir),
        draft_quantize="int4",
        num_speculative_tokens=K,
    )
    expected = run(plain_shard, [build_request(i, 24) for i in (0, 2, 4)])
    assert run(shard, [build_request(i, 24) for i in (0, 2, 4)]) == expected
    stats = shard.speculator.stats
    assert stats["spec_accepted"] > stats["spec_proposed"] // 2
    assert not shard.adapter.shapes.unwarmed
    # the float32 draft's int4 layers and int8 head run in the packed kernels where the ISA level
    # in force has them (AVX512-BF16), else in torch's
    draft = shard.speculator.draft.runner.model
    kernels = {type(m.quantized).__name__ for m in draft.modules() if hasattr(m, "quantized")}
    packed = cpu_kernels.serves(cpu_kernels.Int4Linear)
    expected = {"Int4Linear", "ScreenedHead"} if packed else {"Int4Weight", "Int8Weight"}
    assert expected <= kernels, kernels


def test_counters_reach_serving_stats_the_wire_and_the_routers_metrics(drafting):
    from prometheus_client import CollectorRegistry, generate_latest

    from engine.wire.convert import stats_from_pb, stats_to_pb
    from router.http.metrics import ShardStatsCollector

    shard = drafting("self")
    run(shard, [build_request(4, NEW)])
    sent = shard.serving_stats()
    stats = stats_from_pb(stats_to_pb(sent))
    assert stats["spec_proposed"] == sent["spec_proposed"] > 0 and stats["spec_k"] == K
    accepted, proposed = stats["spec_accepted"], stats["spec_proposed"]
    assert stats["spec_acceptance_rate"] == pytest.approx(accepted / proposed)
    rows = stats["spec_emitted"] - accepted
    assert stats["spec_mean_accepted_length"] == pytest.approx(accepted / rows)

    class Client:
        def serving_stats(self):
            return stats

    registry = CollectorRegistry()
    registry.register(ShardStatsCollector(Client()))
    text = generate_latest(registry).decode()
    assert f"bucketserve_shard_spec_accepted_total {float(accepted)}" in text
    assert f"bucketserve_shard_spec_k {float(K)}" in text
    assert "bucketserve_shard_spec_mean_accepted_length" in text
