"""Multi-LoRA serving: a mixed batch of base and adapter requests, in one forward, gives for every
request the greedy tokens of transformers + peft with that request's adapter merged."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.batch import Batch, Request
from engine.devices.cpu.adapter import CPUAdapter
from engine.errors import InvalidRequestError
from engine.serving.shard import Shard
from launcher.generate import run_requests
from tests.helpers import build_request, tiny_shard
from tests.test_equivalence import PROMPTS

NEW_TOKENS = 24  # > one block of 16: decode crosses a block boundary with adapters active
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (seed, rank, alpha, rsLoRA, targets). beta adapts a subset with another rank and rsLoRA
# scaling: its missing modules and its rank padded up to alpha's are exercised too.
ADAPTERS = {
    "alpha": (1, 8, 16, False, ALL_TARGETS),
    "beta": (2, 4, 8, True, ["q_proj", "v_proj", "down_proj"]),
}
MIX = [None, "alpha", "beta", "alpha", None, "beta"]  # the adapter of each of PROMPTS, one batch


def make_adapter(
    base_dir, out_dir, seed: int, rank: int, alpha: int, rslora: bool, targets: list[str]
):
    """A PEFT adapter with random, non-zero A and B (PEFT's default zero B would change nothing)."""
    from peft import LoraConfig, get_peft_model

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    config = LoraConfig(
        r=rank, lora_alpha=alpha, use_rslora=rslora, target_modules=targets, init_lora_weights=False
    )
    peft_model = get_peft_model(model, config)
    with (
        torch.no_grad()
    ):  # the default init of B is small next to the tiny model's 0.2-wide weights
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn_like(param) * 0.3)
    peft_model.save_pretrained(out_dir)
    return out_dir


def merged_reference(base_dir, adapter_dir, texts, max_new_tokens) -> list[list[int]]:
    """transformers' greedy generate with the adapter merged into the weights (None: the base model)."""
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    model.generation_config.eos_token_id = None
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    outputs = []
    for text in texts:
        ids = tokenizer(text, return_tensors="pt")["input_ids"]
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        outputs.append(out[0, ids.shape[1] :].tolist())
    return outputs


@pytest.fixture(scope="session")
def lora_dirs(tiny_model_dirs, tmp_path_factory):
    """name -> adapter directory, for the tiny Llama."""
    root = tmp_path_factory.mktemp("lora")
    return {
        name: make_adapter(tiny_model_dirs["llama"], root / name, *spec)
        for name, spec in ADAPTERS.items()
    }


@pytest.fixture(scope="session")
def lora_expected(tiny_model_dirs, lora_dirs):
    """(prompt index, adapter or None) -> the reference tokens."""
    base = tiny_model_dirs["llama"]
    expected = {}
    for adapter in (None, *ADAPTERS):
        tokens = merged_reference(base, lora_dirs.get(adapter), PROMPTS, NEW_TOKENS)
        expected.update({(i, adapter): t for i, t in enumerate(tokens)})
    return expected


def lora_shard(tiny_model_dirs, lora_dirs, **overrides) -> Shard:
    specs = tuple((name, str(path)) for name, path in lora_dirs.items())
    return tiny_shard(tiny_model_dirs["llama"], warmup=False, lora_adapters=specs, **overrides)


def request(i: int, adapter: str | None, max_new_tokens: int = NEW_TOKENS) -> Request:
    return build_request(i, max_new_tokens, adapter_id=adapter)


def test_every_adapter_changes_the_reference(lora_expected):
    """Otherwise the equality below could not tell an adapter from the base model."""
    for adapter in ADAPTERS:
        assert all(
            lora_expected[(i, adapter)] != lora_expected[(i, None)] for i in range(len(PROMPTS))
        )
    assert all(
        lora_expected[(i, "alpha")] != lora_expected[(i, "beta")] for i in range(len(PROMPTS))
    )


@pytest.mark.parametrize("impl", ["dense", "gather"])
def test_mixed_batch_matches_peft_merged_in_one_forward(
    tiny_model_dirs, lora_dirs, lora_expected, impl
):
    shard = lora_shard(tiny_model_dirs, lora_dirs, lora_impl=impl)
    assert shard.model.lora_set.ops.name == impl and shard.model.lora_set.rank == 8
    shard.warmup(
        max_input_tokens=64,
        max_total_tokens=64 + NEW_TOKENS,
        max_prefill_tokens=6 * 64,
        max_batch_size=6,
    )
    forwards = record_forwards(shard)
    done = run_requests(shard, [request(i, adapter) for i, adapter in enumerate(MIX)])
    decodes = [slots for kind, slots in forwards if kind == "decode"]
    assert len(decodes) == NEW_TOKENS - 1  # each decode step: one forward for all six requests
    assert all(
        slots[:6] == [-1, 0, 1, 0, -1, 1] for slots in decodes
    )  # base, alpha and beta side by side
    for i, adapter in enumerate(MIX):
        assert done[i].token_ids == lora_expected[(i, adapter)], (i, adapter)
    assert shard.adapter.shapes.strict and not shard.adapter.shapes.unwarmed


def record_forwards(shard) -> list:
    """(kind, adapter slot of every row) of each forward the runner runs from now on."""
    forwards, run = [], shard.runner._run

    def recording(shape, *inputs):
        forwards.append(
            (shape[0], inputs[-1].tolist())
        )  # the last input: each token's adapter slot
        return run(shape, *inputs)

    shard.runner._run = recording
    return forwards


@pytest.fixture(scope="module")
def warmed(tiny_model_dirs, lora_dirs):
    """A strict, fully warmed shard serving both adapters, with its warmup's LoRA calls counted. Its
    warmup runs every bucket, as on a graph device (an eager CPU only registers the shapes)."""
    shard = lora_shard(tiny_model_dirs, lora_dirs, max_batch_size=4)
    ops, calls = shard.model.lora_set.ops, []
    shrink = ops.shrink
    ops.shrink = lambda x, a, selector: (
        calls.append(int(selector.count_nonzero())) or shrink(x, a, selector)
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(CPUAdapter, "warm_runs_forward", True)
        shard.warmup()
    del ops.shrink
    return shard, calls


def test_warmup_runs_every_bucket_with_adapters_active(warmed):
    shard, calls = warmed
    projections_per_forward = 2 * 4  # 2 layers: qkv, o, gate_up, down
    # Every warmed shape ran with adapters (the memory profile's forward runs once more).
    assert len(calls) >= projections_per_forward * len(shard.adapter.shapes.warmed) > 0
    assert all(chosen > 0 for chosen in calls)  # some warmup token used an adapter in every forward


def test_serving_with_adapters_meets_no_unwarmed_shape(warmed, lora_expected):
    shard, _ = warmed
    mixed = [request(i, MIX[i], max_new_tokens=20) for i in range(len(PROMPTS))]
    done = run_requests(shard, mixed)  # waves of 4, then of 2: several buckets, every mix
    assert all(done[i].token_ids == lora_expected[(i, MIX[i])][:20] for i in range(len(PROMPTS)))
    assert shard.adapter.shapes.strict and not shard.adapter.shapes.unwarmed


def test_unknown_adapter_is_refused_naming_the_loaded_ones(warmed, lora_expected):
    shard, _ = warmed
    tokens = {0: []}
    generations, cached = shard.prefill(Batch(20, [request(0, "alpha")]))
    tokens[0] += generations[0].tokens.ids
    free = shard.allocator.num_free
    with pytest.raises(
        InvalidRequestError, match=r"unknown adapter_id 'gamma' \(loaded adapters: alpha, beta\)"
    ):
        shard.prefill(Batch(21, [request(1, None), request(2, "gamma")]))
    assert (
        shard.allocator.num_free == free and 21 not in shard.batches
    )  # nothing of the bad batch was kept
    while cached is not None:
        generations, cached = shard.decode([cached])
        tokens[0] += generations[0].tokens.ids
    assert tokens[0] == lora_expected[(0, "alpha")]  # the batch in flight carried on


def test_adapter_id_without_adapters_loaded_is_refused(tiny_model_dirs):
    from tests.conftest import warmed_llama_shard

    shard = warmed_llama_shard(tiny_model_dirs)
    with pytest.raises(
        InvalidRequestError, match=r"unknown adapter_id 'alpha' \(loaded adapters: none\)"
    ):
        shard.prefill(Batch(1, [request(0, "alpha")]))
    run_requests(
        shard, [request(0, "", max_new_tokens=2)]
    )  # "" is the base model, as no adapter_id
