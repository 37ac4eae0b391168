"""The fused decode step (engine/devices/cpu/kernels/decoder.cpp): every layer of a bfloat16 decode
step in one C++ call, bitwise the output of the modules that run the same kernels one by one."""

import shutil

import pytest
import torch

from engine.buckets.grid import PrefillBucket
from engine.devices.cpu import kernels as cpu_kernels
from engine.kv_cache import blocks_needed
from engine.runner import DecodeInput, PrefillInput
from engine.serving.shard import Shard
from tests.conftest import tiny_config
from tests.family_models import build_family_model

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")

CONTEXTS = [5, 17, 40, 1, 33]  # rows of different lengths; 5 rows pad a bucket of 8


def fused_shard(model_dir, **overrides) -> Shard:
    shard = Shard(tiny_config(model_dir, dtype="bfloat16", **overrides), show_progress=False)
    shard.warmup()
    if shard.model.fused_decode is None:
        pytest.skip("no packed product of these weights at this ISA level (the CPU's or the cap's)")
    # The modules take the rope and SiLU kernels the fused step runs, also on CPUs where the
    # adapter leaves them to torch (no AVX512-BF16), so that both paths run the same arithmetic.
    generator = torch.Generator().manual_seed(2)
    for layer in shard.model.layers:
        layer.self_attn.fused_rotary = cpu_kernels.rope
        layer.mlp.fused_act_and_mul = cpu_kernels.silu_and_mul
        bias = layer.self_attn.qkv_proj.bias
        if bias is not None:  # transformers starts biases at zero, which would hide a lost one
            bias.data.copy_(torch.randn(bias.shape, generator=generator))
    return shard


def decode_rows(shard: Shard, contexts: list[int]) -> list[DecodeInput]:
    rows = []
    for i, position in enumerate(contexts):
        blocks = shard.allocator.allocate(blocks_needed(position + 1, shard.block_size))
        slot = blocks[position // shard.block_size] * shard.block_size + position % shard.block_size
        rows.append(DecodeInput(token_id=300 + 11 * i, position=position, slot=slot, blocks=blocks))
    return rows


def fill_caches(shard: Shard) -> None:
    """Random keys and values everywhere, so attention reads real, distinct context."""
    generator = torch.Generator().manual_seed(3)
    for layer in shard.model.layers:
        for cache in layer.self_attn.kv_cache:
            cache.copy_(torch.randn(cache.shape, generator=generator).to(cache.dtype))


def decode_both_ways(shard: Shard, rows: list[DecodeInput]):
    """(logits, the rows' new cache entries) through the modules, then through the fused step
    and final logits."""
    model, results = shard.model, []
    fused, final = model.fused_decode, model.fused_final
    assert final is not None
    for hooks in ((None, None), (fused, final)):
        fill_caches(shard)
        model.fused_decode, model.fused_final = hooks
        logits = shard.runner.decode(rows)
        written = [
            torch.stack([cache[[row.slot for row in rows]] for cache in layer.self_attn.kv_cache])
            for layer in shard.model.layers
        ]
        results.append((logits, torch.stack(written)))
    model.fused_decode, model.fused_final = fused, final
    return results


@pytest.mark.parametrize("variant", ["llama", "qwen2"])  # llama3 rope; q/k/v biases, tied head
@pytest.mark.parametrize("contexts", [CONTEXTS, [9]], ids=["mixed batch", "lone row"])
def test_the_fused_step_equals_the_layers_bitwise(tiny_model_dirs, variant, contexts):
    shard = fused_shard(tiny_model_dirs[variant])
    (modules, modules_kv), (fused, fused_kv) = decode_both_ways(shard, decode_rows(shard, contexts))
    assert torch.equal(fused, modules)
    assert torch.equal(fused_kv, modules_kv)


@pytest.mark.parametrize("quantize, product", [("int4", "int4_linear"), ("int8", "int8_linear")])
def test_a_quantized_fused_step_equals_its_layers_bitwise(tiny_model_dirs, quantize, product):
    """--quantize's projections run in the fused step through their own products (and the int8
    LM head through int8_linear), the same kernels as the modules."""
    shard = fused_shard(tiny_model_dirs["qwen2"], quantize=quantize)
    assert shard.model.fused_decode.product == product
    assert isinstance(shard.model.lm_head.quantized, cpu_kernels.Int8Linear)
    (modules, modules_kv), (fused, fused_kv) = decode_both_ways(shard, decode_rows(shard, CONTEXTS))
    assert torch.equal(fused, modules)
    assert torch.equal(fused_kv, modules_kv)


def test_the_embedded_models_fused_step_equals_its_layers_bitwise(smollm_dir):
    shard = fused_shard(smollm_dir, max_total_tokens=512, block_size=16)
    (modules, modules_kv), (fused, fused_kv) = decode_both_ways(
        shard, decode_rows(shard, [160, 3, 77])
    )
    assert torch.equal(fused, modules)
    assert torch.equal(fused_kv, modules_kv)


def test_only_plain_bfloat16_decoders_get_the_fused_step(tiny_model_dirs, tmp_path, smollm_dir):
    plain = Shard(tiny_config(tiny_model_dirs["llama"]), show_progress=False)  # float32
    assert plain.model.fused_decode is None
    qwen3 = build_family_model("qwen3", tmp_path / "qwen3", smollm_dir)  # q/k norms, windows
    shard = Shard(tiny_config(qwen3, dtype="bfloat16"), show_progress=False)
    assert not shard.model.plain_decoder() and shard.model.fused_decode is None


def slots_of(shard: Shard, blocks: list[int], positions: range) -> list[int]:
    size = shard.block_size
    return [blocks[p // size] * size + p % size for p in positions]


def test_rows_of_several_new_tokens_equal_their_tokens_decoded_one_by_one(tiny_model_dirs):
    """A verify forward (each row's new tokens after its cached context) through extend_layers is,
    token for token, decode_layers run once per token: the same products row by row, and each
    token attends over the same slots in the same order, so the same bits."""
    shard = fused_shard(tiny_model_dirs["qwen2"])
    contexts, news = [20, 7, 33], [5, 3, 4]
    width, rows = max(news), []
    for i, (context, new) in enumerate(zip(contexts, news)):
        blocks = shard.allocator.allocate(blocks_needed(context + new, shard.block_size))
        token_ids = [400 + 17 * i + t for t in range(new)]
        rows.append((blocks, context, token_ids))
    seqs = [
        PrefillInput(
            ids,
            slots_of(shard, blocks, range(context, context + len(ids))),
            context_slots=slots_of(shard, blocks, range(context)),
        )
        for blocks, context, ids in rows
    ]
    span = max(-(-context // shard.block_size) for context in contexts)
    bucket = PrefillBucket(len(seqs), width, span)
    fill_caches(shard)
    ids, positions, meta, _ = shard.runner._prefill_tensors(bucket, seqs)
    everywhere = torch.arange(len(seqs) * width)
    extended = shard.model(ids, positions, meta, everywhere).view(len(seqs), width, -1)
    fill_caches(shard)  # the same context, new tokens' slots rewritten one by one
    for step in range(width):
        live = [i for i, (_, _, ids) in enumerate(rows) if step < len(ids)]
        decodes = [
            DecodeInput(rows[i][2][step], rows[i][1] + step, seqs[i].slots[step], rows[i][0])
            for i in live
        ]
        logits = shard.runner.decode(decodes)
        for row, i in enumerate(live):
            assert torch.equal(logits[row], extended[i, step]), (i, step)


def test_which_forwards_the_fused_step_takes(tiny_model_dirs):
    from engine.devices.cpu.kernels import EXTEND_WIDTH

    shard = fused_shard(
        tiny_model_dirs["llama"], max_input_tokens=300, max_total_tokens=320, max_prefill_tokens=512
    )
    calls, fused = [], shard.model.fused_decode
    shard.model.fused_decode = lambda *args: calls.append(fused(*args)) or calls[-1]
    rows = decode_rows(shard, [4, EXTEND_WIDTH + 8])
    short, wide = (
        PrefillInput(list(range(5, 5 + n)), slots_of(shard, row.blocks, range(n)))
        for n, row in zip((4, EXTEND_WIDTH + 1), rows)
    )
    shard.runner.prefill([short])
    shard.runner.prefill([wide])
    shard.runner.decode(rows)
    taken = [out is not None for out in calls]
    assert taken == [True, False, True]  # a short prompt, a wide one (the modules), a decode


def test_decode_layers_refuses_what_it_cannot_run(tiny_model_dirs):
    shard = fused_shard(tiny_model_dirs["llama"])
    fused, kernels = shard.model.fused_decode, cpu_kernels.load()
    rows = decode_rows(shard, [4, 9])
    bucket = shard.runner.plan.decode_bucket(2, sum(len(row.blocks) for row in rows))
    meta = shard.runner._decode_tensors(bucket, rows)[2]
    tensors = []
    for weights, layer in zip(fused.weights, shard.model.layers):
        tensors += [*weights, *layer.self_attn.kv_cache]
    hidden = torch.zeros(bucket.batch_size, 64, dtype=torch.bfloat16)
    rope = torch.zeros(bucket.batch_size, 1, 16, dtype=torch.bfloat16)

    def call(hidden=hidden, tensors=tensors, rope=rope, slots=meta.slots):
        tables = (meta.block_list, meta.block_groups, meta.block_bias)
        shapes = (4, 2, 128, 1e-5, 0.25, fused.product)
        return kernels.decode_layers(hidden, tensors, rope, rope, slots, *tables, *shapes)

    assert call().shape == hidden.shape  # the well-formed call runs
    with pytest.raises(RuntimeError, match="outside the cache"):
        call(slots=torch.full_like(meta.slots, tensors[7].shape[0]))
    with pytest.raises(RuntimeError, match="cos and sin"):
        call(rope=rope[:1])
    with pytest.raises(RuntimeError, match="tensors a layer"):
        call(tensors=tensors[:-1])
    with pytest.raises(RuntimeError, match="bfloat16 expected"):
        call(hidden=hidden.float())
    with pytest.raises(RuntimeError, match="q/k/v bias"):
        call(tensors=[tensors[0], tensors[1], torch.ones(5, dtype=torch.bfloat16), *tensors[3:]])
