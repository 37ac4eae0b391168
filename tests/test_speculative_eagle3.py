"""Speculative decoding with EAGLE-3 heads (engine/speculative/eagle3.py): greedy and seeded output is plain
decoding's token for token on three architectures, a head that agrees with its target has its
proposals accepted, and a head that cannot serve the target is one error line at start."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.batch import NextTokenChooserParameters
from tests.helpers import build_request, tiny_shard
from tests.models import build_tiny_model
from tests.test_speculative import run

NEW = 40  # crosses block boundaries (blocks of 16)
K = 4
HIDDEN, HEADS, HEAD_DIM, VOCAB = 64, 4, 16, 49152
SEEDED = NextTokenChooserParameters(temperature=0.9, top_k=20, do_sample=True, seed=99)
# target variant -> (its layers, the head's aux layer ids: None takes vLLM's default 2, L/2, L-3)
TARGETS = {"llama": (7, None), "qwen2": (3, [0, 1, 2]), "mistral": (3, [2, 0, 1])}


def head_config(**overrides) -> dict:
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": 128,
        "num_attention_heads": HEADS,
        "num_key_value_heads": 2,
        "head_dim": HEAD_DIM,
        "num_hidden_layers": 1,
        "vocab_size": VOCAB,
        "draft_vocab_size": 1000,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
    }
    return {**config, **overrides}


def layer_weights(config: dict, generator) -> dict:
    """The decoder layer's tensors under vLLM's `midlayer.` names, random (std 0.2)."""
    q, kv = config["num_attention_heads"] * HEAD_DIM, config["num_key_value_heads"] * HEAD_DIM
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    shapes = {
        "self_attn.q_proj.weight": (q, 2 * hidden),
        "self_attn.k_proj.weight": (kv, 2 * hidden),
        "self_attn.v_proj.weight": (kv, 2 * hidden),
        "self_attn.o_proj.weight": (hidden, q),
        "mlp.gate_proj.weight": (inner, hidden),
        "mlp.up_proj.weight": (inner, hidden),
        "mlp.down_proj.weight": (hidden, inner),
    }
    weights = {
        f"midlayer.{n}": torch.randn(s, generator=generator) * 0.2 for n, s in shapes.items()
    }
    for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        weights[f"midlayer.{norm}.weight"] = 0.5 + torch.rand(hidden, generator=generator)
    return weights


def save_head(out, config: dict, weights: dict):
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config))
    save_file(
        {k: v.contiguous().clone() for k, v in weights.items()}, str(out / "model.safetensors")
    )
    return out


def random_head(out, aux, seed=0, **overrides):
    """A random head over a reduced draft vocabulary (d2t maps it into the target's)."""
    config = head_config(**overrides)
    if aux is not None:
        config["eagle_aux_hidden_state_layer_ids"] = aux
    generator = torch.Generator().manual_seed(seed)
    draft_vocab, hidden = config["draft_vocab_size"], config["hidden_size"]
    kept = torch.randperm(VOCAB, generator=generator)[:draft_vocab].sort().values
    weights = layer_weights(config, generator)
    weights["fc.weight"] = torch.randn(hidden, 3 * HIDDEN, generator=generator) * 0.2
    weights["norm.weight"] = torch.ones(hidden)
    weights["lm_head.weight"] = torch.randn(draft_vocab, hidden, generator=generator) * 0.2
    weights["d2t"] = kept - torch.arange(draft_vocab)
    weights["t2d"] = torch.zeros(VOCAB, dtype=torch.bool)
    return save_head(out, config, weights)


def bigram_target(out, smollm_dir):
    """A tiny llama whose layers add nothing (o_proj and down_proj zero): its next token follows
    from the latest token alone."""
    build_tiny_model("llama", out, smollm_dir, num_hidden_layers=3)
    weights = load_file(str(out / "model.safetensors"))
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = torch.zeros_like(weights[name])
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def agreeing_head(out, target_dir):
    """A head that predicts what the bigram target does: attention reads only its own position
    (constant q and k whose rope score peaks at distance 0), its values are the normed token
    embedding, the fused hidden state is normed to zero; the target's norm and lm_head follow,
    and its embeddings are shared (no embed_tokens, no lm_head: the full vocabulary)."""
    config = head_config(
        num_key_value_heads=HEADS,
        draft_vocab_size=VOCAB,
        attention_bias=True,
        norm_before_residual=True,
        eagle_aux_hidden_state_layer_ids=[0, 1, 2],
    )
    weights = layer_weights(config, torch.Generator().manual_seed(3))
    peak = torch.zeros(HEADS, HEAD_DIM)
    peak[:, : HEAD_DIM // 2] = 20.0  # rotary pairs (i, i + 8): q.k = 400 * sum cos(distance * f)
    for part in "qk":
        weights[f"midlayer.self_attn.{part}_proj.weight"].zero_()
        weights[f"midlayer.self_attn.{part}_proj.bias"] = peak.flatten()
    weights["midlayer.self_attn.v_proj.weight"] = torch.cat(
        [torch.eye(HIDDEN), torch.zeros(HIDDEN, HIDDEN)], dim=1
    )
    weights["midlayer.self_attn.v_proj.bias"] = torch.zeros(HIDDEN)
    weights["midlayer.self_attn.o_proj.weight"] = torch.eye(HIDDEN)
    weights["midlayer.self_attn.o_proj.bias"] = torch.zeros(HIDDEN)
    weights["midlayer.mlp.down_proj.weight"].zero_()
    weights["midlayer.input_layernorm.weight"] = torch.ones(HIDDEN)
    weights["midlayer.hidden_norm.weight"] = torch.zeros(HIDDEN)
    target = load_file(str(target_dir / "model.safetensors"))
    weights["norm.weight"] = target["model.norm.weight"]
    weights["fc.weight"] = torch.randn(HIDDEN, 3 * HIDDEN) * 0.2
    return save_head(out, config, weights)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, smollm_dir):
    root = tmp_path_factory.mktemp("eagle3")
    found = {}
    for variant, (layers, aux) in TARGETS.items():
        found[variant] = build_tiny_model(
            variant, root / variant, smollm_dir, num_hidden_layers=layers
        )
        found[f"{variant}-head"] = random_head(root / f"{variant}-head", aux)
    found["bigram"] = bigram_target(root / "bigram", smollm_dir)
    found["bigram-head"] = agreeing_head(root / "bigram-head", found["bigram"])
    return found


@pytest.fixture(scope="module")
def shards(dirs):
    """variant -> (a plain shard on its target, one speculating with its head)."""
    built = {}

    def get(variant):
        if variant not in built:
            plain = tiny_shard(dirs[variant], max_batch_size=4)
            speculating = tiny_shard(
                dirs[variant],
                max_batch_size=4,
                speculate="eagle3",
                draft_model=str(dirs[f"{variant}-head"]),
                num_speculative_tokens=K,
            )
            built[variant] = plain, speculating
        return built[variant]

    yield get
    for pair in built.values():
        for shard in pair:
            shard.clear()


def requests_for(batch):
    """Greedy requests, but for request 1, which samples (seeded)."""
    return [build_request(i, NEW, parameters=SEEDED if i == 1 else None) for i in batch]


@pytest.mark.parametrize("variant", list(TARGETS))
def test_tokens_equal_plain_decoding_at_batch_1_and_mixed(shards, variant):
    """Batch 1, then a mixed batch (four prompt lengths, one seeded sampled row): every row's
    tokens are plain decoding's (the head's proposals are deterministic)."""
    plain, shard = shards(variant)
    for batch in ([4], [0, 1, 4, 5]):
        before = dict(shard.speculator.stats)
        assert run(shard, requests_for(batch)) == run(plain, requests_for(batch))
        assert shard.speculator.stats["spec_proposed"] > before["spec_proposed"]
    assert not shard.adapter.shapes.unwarmed
    assert any(shape[0] == "draft" for shape in shard.adapter.shapes.warmed)


def test_a_head_that_agrees_with_its_target_has_its_proposals_accepted(shards):
    plain, shard = shards("bigram")
    for batch in ([4], [0, 2, 4]):
        before = dict(shard.speculator.stats)
        assert run(shard, requests_for(batch)) == run(plain, requests_for(batch))
        stats = shard.speculator.stats
        proposed = stats["spec_proposed"] - before["spec_proposed"]
        accepted = stats["spec_accepted"] - before["spec_accepted"]
        assert accepted > 0.9 * proposed > 0
    assert not shard.adapter.shapes.unwarmed


def test_the_target_keeps_the_residual_stream_entering_its_aux_layers(dirs, shards):
    """vLLM's default layers (2, L / 2, L - 3) of the 7-layer llama: at each prompt token's slot,
    the hidden states transformers reports entering those layers."""
    import transformers

    from engine.batch import Batch

    _, shard = shards("llama")
    shard.clear()
    _, cached = shard.prefill(Batch(1, [build_request(4, 2)]))
    seq = shard.batches[cached.id][0]
    prompt = seq.token_ids[:-1]
    stored = shard.model.aux_cache[seq.slots(0, len(prompt))]
    model = transformers.AutoModelForCausalLM.from_pretrained(dirs["llama"], dtype=torch.float32)
    with torch.no_grad():
        states = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    expected = torch.cat([states[layer][0] for layer in (2, 3, 4)], dim=-1)
    torch.testing.assert_close(stored, expected, atol=1e-4, rtol=1e-4)
    shard.clear()


@pytest.mark.parametrize(
    "bad, message",
    [
        ("hidden", "an EAGLE-3 head for hidden size 32, the target's is 64"),
        ("d2t", "d2t has 999 entries for a draft vocabulary of 1000"),
        ("layers", "aux hidden state layers [2, 3, 5] are not three distinct layers"),
        ("missing", "--speculate eagle3 needs --draft-model DIR"),
    ],
)
def test_a_head_that_cannot_serve_the_target_is_one_error_line(
    capsys, tmp_path, dirs, bad, message
):
    from engine.cli.main import main

    def short_d2t():
        head = random_head(tmp_path / "d", [0, 1, 2])
        weights = load_file(str(head / "model.safetensors"))
        weights["d2t"] = weights["d2t"][:-1]
        save_file(weights, str(head / "model.safetensors"))
        return head

    heads = {
        "hidden": lambda: random_head(tmp_path / "h", [0, 1, 2], hidden_size=32),
        "d2t": short_d2t,
        "layers": lambda: random_head(tmp_path / "l", [2, 3, 5]),
        "missing": lambda: None,
    }
    head = heads[bad]()
    argv = ["serve", "--model-id", str(dirs["qwen2"]), "--device", "cpu", "--dtype", "float32"]
    argv += ["--speculate", "eagle3"] + (["--draft-model", str(head)] if head else [])
    capsys.readouterr()
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]
