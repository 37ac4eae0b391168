"""Quantized and bfloat16 serving against transformers: greedy tokens of a quantized model equal
transformers running its dequantized weights (float32); bfloat16 agrees with transformers in bfloat16."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.batch import Request, StoppingCriteriaParameters
from engine.serving.shard import Shard
from launcher.generate import generate, run_requests, warm_for  # noqa: F401
from router.offline import run_scheduled
from tests.conftest import tiny_config
from tests.test_equivalence import PROMPTS

NEW_TOKENS = 20


def dequantized_state(model) -> dict[str, torch.Tensor]:
    """Our model's weights as transformers names them, every quantized matrix dequantized."""

    def weight(module):
        return (
            module.weight.detach().float()
            if module.quantized is None
            else module.quantized.dequantize()
        )

    config, state = model.config, {}
    vocab = config.vocab_size
    state["model.embed_tokens.weight"] = weight(model.embed_tokens)[:vocab]
    state["lm_head.weight"] = weight(model.lm_head)[:vocab]
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        q, k, v = weight(attn.qkv_proj).split([attn.q_size, attn.kv_size, attn.kv_size])
        gate, up = weight(mlp.gate_up_proj).chunk(2)
        parts = dict(
            zip(
                [
                    "self_attn.q_proj",
                    "self_attn.k_proj",
                    "self_attn.v_proj",
                    "self_attn.o_proj",
                    "mlp.gate_proj",
                    "mlp.up_proj",
                    "mlp.down_proj",
                ],
                [q, k, v, weight(attn.o_proj), gate, up, weight(mlp.down_proj)],
            )
        )
        state.update({f"model.layers.{i}.{name}.weight": value for name, value in parts.items()})
    return state


def transformers_on(model_dir, state: dict | None, dtype) -> torch.nn.Module:
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if state is not None:
        missing = set(state) - set(reference.state_dict())
        assert not missing, missing
        reference.load_state_dict(state, strict=False)
    return reference.to(dtype)


def greedy(reference, tokenizer, prompt: str, new_tokens: int) -> list[int]:
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    reference.generation_config.eos_token_id = None
    with torch.inference_mode():
        out = reference.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, ids.shape[1] :].tolist()


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_tiny_model_matches_transformers_on_its_dequantized_weights(
    tiny_model_dirs, mode
):
    model_dir = tiny_model_dirs["llama"]
    shard = Shard(
        tiny_config(model_dir, quantize=mode), show_progress=False
    )  # float32 activations: exact
    assert shard.model.layers[0].mlp.down_proj.quantized.kind == mode
    ours = generate(shard, PROMPTS, NEW_TOKENS, ignore_eos=True)
    reference = transformers_on(model_dir, dequantized_state(shard.model), torch.float32)
    for completion, prompt in zip(ours, PROMPTS):
        assert completion.token_ids == greedy(reference, shard.tokenizer, prompt, NEW_TOKENS)
    assert shard.adapter.shapes.strict and not shard.adapter.shapes.unwarmed


def served_logprobs(shard, prompts, new_tokens) -> list[tuple[list[int], list[float]]]:
    """Our greedy tokens and their logprobs, through the scheduler (strict shapes)."""
    warm_for(shard, prompts, new_tokens, True)
    stopping = StoppingCriteriaParameters(max_new_tokens=new_tokens, ignore_eos_token=True)
    requests = [Request(i, p, stopping_parameters=stopping) for i, p in enumerate(prompts)]
    lengths = [len(shard.tokenizer(p)["input_ids"]) for p in prompts]
    outputs = run_scheduled(shard, requests, lengths, shard.runner.kv_cache.capacity_tokens, None)
    return [
        (
            [t for g in outputs[i] for t in g.tokens.ids],
            [lp for g in outputs[i] for lp in g.tokens.logprobs],
        )
        for i in range(len(prompts))
    ]


@pytest.mark.parametrize("mode", ["none", "int4"])
def test_bfloat16_serving_agrees_with_transformers_in_bfloat16(tiny_model_dirs, mode):
    """Teacher-forced on our tokens, transformers (bfloat16, same weights) picks the same top-1 almost
    everywhere and gives our tokens nearly the logprobs we report."""
    model_dir = tiny_model_dirs["llama"]
    shard = Shard(tiny_config(model_dir, dtype="bfloat16", quantize=mode), show_progress=False)
    assert shard.dtype == torch.bfloat16
    served = served_logprobs(shard, PROMPTS, NEW_TOKENS)
    state = dequantized_state(shard.model) if mode != "none" else None
    reference = transformers_on(model_dir, state, torch.bfloat16)
    agree, gaps, margins = 0, [], []
    for prompt, (tokens, logprobs) in zip(PROMPTS, served):
        ids = shard.tokenizer(prompt, return_tensors="pt")["input_ids"]
        full = torch.cat([ids[0], torch.tensor(tokens)]).unsqueeze(0)
        with torch.inference_mode():
            scores = reference(full).logits[0, ids.shape[1] - 1 : -1].float().log_softmax(-1)
        theirs = scores.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)
        agree += int((scores.argmax(-1) == torch.tensor(tokens)).sum())
        gaps += (theirs - torch.tensor(logprobs)).abs().tolist()
        margins += (
            scores.max(-1).values - theirs
        ).tolist()  # 0 where transformers picks our token too
    # Random tiny models have near ties that bfloat16 rounding may flip: every disagreement must be one.
    assert agree >= 0.9 * len(gaps) and max(margins) < 0.2, (
        f"top-1 agreement {agree}/{len(gaps)}, {max(margins)}"
    )
    assert max(gaps) < 0.25 and sum(gaps) / len(gaps) < 0.04, (max(gaps), sum(gaps) / len(gaps))
    assert shard.adapter.shapes.strict and not shard.adapter.shapes.unwarmed


@pytest.mark.parametrize(
    "dtype, mode", [("bfloat16", "none"), ("bfloat16", "int4"), ("bfloat16", "int8")]
)
def test_strict_shapes_refuse_an_unwarmed_decode_in_bfloat16_and_quantized(
    tiny_model_dirs, dtype, mode
):
    from engine.errors import UnwarmedShapeError
    from engine.runner import DecodeInput

    shard = Shard(
        tiny_config(tiny_model_dirs["llama"], dtype=dtype, quantize=mode, max_batch_size=2),
        show_progress=False,
    )
    shard.warmup()
    plan, row = shard.runner.plan, DecodeInput(token_id=5, position=0, slot=16, blocks=[1])
    bucket = plan.decode_bucket(1, 1)
    shard.runner.decode([row])  # warmed: runs
    shard.adapter.shapes.warmed.discard(("decode", bucket))
    with pytest.raises(UnwarmedShapeError, match="warmup did not run"):
        shard.runner.decode([row])
    assert shard.adapter.shapes.unwarmed[("decode", bucket)] == 1


def test_dtype_auto_picks_the_cpus_bfloat16_and_says_so(tiny_model_dirs, capsys):
    from engine.devices.cpu import isa
    from engine.devices.cpu import kernels as cpu_kernels
    from engine.devices.cpu.adapter import CPUAdapter

    native = isa.at_least("avx512_bf16")  # the CPU's level, or the cap's (BUCKETSERVE_CPU_ISA)
    avx2_product = cpu_kernels.serves(cpu_kernels.FmaLinear)
    expected = torch.bfloat16 if native or avx2_product else torch.float32
    assert CPUAdapter().auto_dtype()[0] == expected
    shard = Shard(tiny_config(tiny_model_dirs["llama"], dtype="auto"), show_progress=True)
    assert shard.dtype == CPUAdapter().auto_dtype()[0] and shard.info().dtype == str(
        shard.dtype
    ).removeprefix("torch.")
    said = capsys.readouterr().err
    assert f"dtype auto: {shard.info().dtype} ({CPUAdapter().auto_dtype()[1]})" in said


def test_dtype_auto_without_native_bfloat16_takes_it_only_with_the_avx2_product(monkeypatch):
    """Without AVX512-BF16 and AMX, bfloat16 is faster than float32 only through fma_linear: with
    the kernels turned off (or not built, or a compiled graph mode) torch emulates it."""
    from engine.devices.cpu import kernels as cpu_kernels
    from engine.devices.cpu.adapter import CPUAdapter

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    if cpu_kernels.serves(cpu_kernels.FmaLinear):
        assert CPUAdapter().auto_dtype() == (
            torch.bfloat16,
            "bucketserve's AVX2 bfloat16 kernels on this CPU",
        )
        assert CPUAdapter(graph_mode="compile").auto_dtype()[0] == torch.float32
    monkeypatch.setenv("BUCKETSERVE_CPU_KERNELS", "0")
    assert CPUAdapter().auto_dtype() == (torch.float32, "this CPU has neither AVX512-BF16 nor AMX")


def test_quantize_and_dtype_flags_reach_the_shard_config():
    from engine.cli.main import build_parser, engine_config
    from engine.config import EngineConfig
    from launcher.config import LauncherConfig

    config = engine_config(build_parser().parse_args(["serve", "--quantize", "int4"]))
    assert (config.quantize, config.dtype) == ("int4", "auto")
    assert engine_config(build_parser().parse_args(["serve"])).quantize == "none"
    args = LauncherConfig(engine=EngineConfig(quantize="int8")).shard_args()
    assert args[args.index("--quantize") + 1] == "int8"
    assert "--quantize" not in LauncherConfig().shard_args()


def test_quantize_with_lora_adapters_is_refused(tiny_model_dirs):
    from engine.errors import ModelLoadError

    config = tiny_config(tiny_model_dirs["llama"], quantize="int4", lora_adapters=(("a", "/a"),))
    with pytest.raises(ModelLoadError, match="--quantize does not combine with LoRA adapters yet"):
        Shard(config, show_progress=False)
