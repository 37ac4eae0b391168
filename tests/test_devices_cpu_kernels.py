"""The CPU adapter's fused C++ kernels (engine/devices/cpu/kernels), against the pure-torch path,
at each ISA level this CPU runs (tests/isa_levels.py): each test takes the level it is for, and is
skipped, with the reason, where the kernels are not built."""

import pytest
import torch
import torch.nn.functional as F

from engine.attention import windowed_metadata
from engine.attention.backend import TORCH
from engine.attention.flat import flat_attention, flat_block_tensors, flat_mask
from engine.devices.cpu import isa
from engine.devices.cpu import kernels as cpu_kernels
from engine.layers.norm import GemmaRMSNorm, RMSNorm
from engine.layers.rotary import RopeConfig, RotaryEmbedding, apply_rotary
from engine.serving.shard import Shard
from tests.conftest import tiny_config


def test_the_kernels_build_where_a_compiler_is():
    if cpu_kernels.missing_tool() is not None:
        pytest.skip(f"CPU kernels cannot be built here: {cpu_kernels.missing_tool()}")
    assert cpu_kernels.load() is not None


def test_each_level_builds_what_it_serves_and_nothing_above(isa_level):
    """The library of a level holds the products of that level and below (its compiler flags),
    and the classes chosen follow the level in force: what a CPU of that level would serve."""
    module = cpu_kernels.load()
    assert module.fma_linear_supported() == isa.at_least("avx2")
    assert module.dot_linear_supported() == isa.at_least("avx512_bf16")
    assert module.int4_linear_supported() == isa.at_least("avx512_bf16")
    assert not module.amx_supported() or isa.at_least("amx")
    expected = next((k for k in cpu_kernels.PROJECTIONS if isa.at_least(k.level)), None)
    if expected is cpu_kernels.AmxLinear and not module.amx_supported():
        expected = cpu_kernels.DotLinear  # AMX listed, tiles refused (a virtual machine)
    assert cpu_kernels.kernel_for(torch.ones(8, 32).bfloat16()) is expected


def paged_case(lengths, dtype, heads=6, kv_heads=2, dim=64, block_size=4, padding=(0, 0)):
    """q, caches and flat decode tensors for rows of `lengths` tokens over shuffled cache blocks;
    padding: (extra padding blocks, extra padding rows)."""
    generator = torch.Generator().manual_seed(sum(lengths) + dim)
    blocks_of = [-(-length // block_size) for length in lengths]
    order = (torch.randperm(sum(blocks_of) + 8, generator=generator) + 1).tolist()
    row_blocks, start = [], 0
    for count in blocks_of:
        row_blocks.append(order[start : start + count])
        start += count
    batch = len(lengths) + padding[1]
    slots = (len(order) + 2) * block_size
    block_list, groups, usage = flat_block_tensors(
        row_blocks, list(lengths), sum(blocks_of) + padding[0], block_size
    )
    mapping, owners, bias = flat_mask(groups, usage, batch, block_size, dtype)
    key_cache = torch.randn(slots, kv_heads, dim, generator=generator).to(dtype)
    value_cache = torch.randn(slots, kv_heads, dim, generator=generator).to(dtype)
    q = torch.randn(batch, heads, dim, generator=generator).to(dtype)
    return q, key_cache, value_cache, block_list, mapping, owners, bias


CASES = {
    "rows of different lengths": ([5, 17, 9, 1], (0, 0)),
    "odd block counts, padding blocks and rows": ([13, 3, 21], (3, 2)),
    "a single block": ([3], (0, 0)),
    "one row over many blocks": ([37], (1, 0)),
    "a lone long row (bfloat16: spans merged)": ([200], (0, 1)),
}


@pytest.mark.parametrize("dim", [64, 24])  # vectorized, and the plain loop for other head sizes
@pytest.mark.parametrize("case", CASES)
def test_decode_attention_reads_the_paged_cache_as_flat_attention_does(case, dim, isa_level):
    lengths, padding = CASES[case]
    args = paged_case(lengths, torch.float32, dim=dim, padding=padding)
    expected = flat_attention(*args, 0.125)
    out = cpu_kernels.decode_attention(*args, 0.125)
    torch.testing.assert_close(out[: len(lengths)], expected[: len(lengths)], atol=1e-5, rtol=1e-5)
    assert torch.equal(out[len(lengths) :], torch.zeros_like(out[len(lengths) :]))


@pytest.mark.parametrize("spread", [60, 1e15])
def test_decode_attention_keeps_scores_far_below_the_maximum(spread, isa_level):
    """Scores hundreds below their row's maximum: the vectorized exp must underflow to 0, not wrap.
    (float32 scores of that size carry errors of 1e-5 themselves: compared with float64.)"""
    q, *rest = paged_case([40, 23], torch.float32)
    args = (q * spread, *rest)
    exact = flat_attention(*(a.double() if a.is_floating_point() else a for a in args), 0.125)
    out = cpu_kernels.decode_attention(*args, 0.125)
    torch.testing.assert_close(out[:2].double(), exact[:2], atol=1e-4, rtol=1e-4)


# Query heads per kv head and head sizes: SmolLM2's 3 x 64, one group of 8 x 128, no grouping.
@pytest.mark.parametrize("heads, kv_heads, dim", [(6, 2, 64), (8, 1, 128), (4, 4, 64)])
@pytest.mark.parametrize("case", CASES)
def test_decode_attention_in_bfloat16_is_within_bfloat16s_rounding(
    case, heads, kv_heads, dim, isa_level
):
    lengths, padding = CASES[case]
    args = paged_case(lengths, torch.bfloat16, heads, kv_heads, dim, padding=padding)
    exact = flat_attention(*(a.double() if a.is_floating_point() else a for a in args), 0.125)
    out = cpu_kernels.decode_attention(*args, 0.125)
    rows = len(lengths)
    torch.testing.assert_close(out[:rows].double(), exact[:rows], atol=1e-2, rtol=1e-2)


def test_decode_attention_keeps_a_sliding_windows_mask(isa_level):
    lengths = [14, 9]
    args = paged_case(lengths, torch.float32)
    q, key_cache, value_cache, block_list, mapping, owners, bias = args
    from engine.attention import DecodeMetadata

    meta = DecodeMetadata(torch.zeros(2, dtype=torch.long), block_list, mapping, owners, bias)
    positions = torch.tensor([length - 1 for length in lengths])
    windowed = windowed_metadata(meta, positions, window=5, kv_heads=2)
    call = (q, key_cache, value_cache, block_list, mapping, owners, windowed.block_bias, 0.125)
    torch.testing.assert_close(
        cpu_kernels.decode_attention(*call), flat_attention(*call), atol=1e-5, rtol=1e-5
    )


def test_decode_attention_refuses_a_block_outside_the_cache(isa_level):
    q, key_cache, value_cache, block_list, mapping, owners, bias = paged_case([5], torch.float32)
    block_list = block_list.clone()
    block_list[0] = key_cache.shape[0]
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_kernels.decode_attention(
            q, key_cache, value_cache, block_list, mapping, owners, bias, 1
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7])
def test_rms_norm_matches_the_torch_module(dtype, rows, isa_level):
    torch.manual_seed(rows)
    norm = RMSNorm(40, 1e-5).to(dtype)
    norm.weight.data = torch.randn(40).to(dtype)
    x = (torch.randn(rows, 3, 40) * 4).to(dtype)
    expected = norm(x)
    out = cpu_kernels.rms_norm(x, norm.weight, norm.eps)
    assert out.dtype == dtype and out.shape == x.shape
    if dtype == torch.bfloat16:  # the same roundings: the same bits
        assert torch.equal(out, expected)
    else:
        torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)


NO_PROJECTION = pytest.param(None, marks=pytest.mark.skip(reason="no packed projection this low"))


@pytest.fixture(
    params=[k for k in cpu_kernels.PROJECTIONS if k.level in isa.testable_levels()]
    or [NO_PROJECTION],  # scalar: every product is torch's
    ids=lambda kernel: getattr(kernel, "kind", "none"),
)
def kernel(request, kernels_at):
    """Each packed projection at its own ISA level (the cap there): a CPU above it runs the code
    that a CPU of that level builds. AMX also needs Linux to grant the tiles."""
    kernels_at(request.param.level)
    if not cpu_kernels.serves(request.param):
        pytest.skip(f"{request.param.kind}: this CPU lists AMX but refuses its tiles")
    return request.param


def test_a_cpu_with_avx512_bf16_gets_a_packed_projection():
    """-march=native must have built the dot products where the CPU has them: a kernel that
    silently fell back to torch would pass every other test here."""
    if "avx512_bf16" not in cpu_kernels.cpu_identity().split():
        pytest.skip("this CPU has no AVX512-BF16")
    if cpu_kernels.load() is None or not isa.at_least("avx512_bf16"):
        pytest.skip("CPU kernels not built, or capped below avx512_bf16")
    assert cpu_kernels.load().dot_linear_supported()
    assert cpu_kernels.kernel_for(torch.ones(8, 32).bfloat16()) is not None


# Rows: a lone decode, a partial tile, whole tiles (4 rows in FMA, 12 for dot products, 16 and 32
# in AMX),
# past them, past the 256 rows kept in cache. Columns: within one block, a partial last block,
# many blocks.
@pytest.mark.parametrize("rows", [1, 12, 17, 32, 45, 300])
@pytest.mark.parametrize("out_features, in_features", [(24, 64), (72, 96), (960, 576)])
def test_the_packed_projection_multiplies_as_f_linear_does(kernel, rows, out_features, in_features):
    torch.manual_seed(rows + out_features)
    weight = torch.randn(out_features, in_features).bfloat16()
    x = torch.randn(rows, in_features).bfloat16()
    out = kernel(weight).linear(x.unsqueeze(1))
    assert out.shape == (rows, 1, out_features) and out.dtype == torch.bfloat16
    exact = F.linear(x.double(), weight.double())
    # float32 sums, one rounding to bfloat16: within one bfloat16 step of the exact product plus
    # float32 summation's error bound (K * 2^-24 * sum |x w|). Half a step comes from the rounding;
    # the sums' error can tip a value on a midpoint either way (77.749995, summed to 77.75 and
    # rounded to 78, where oneDNN's gave 77.5) and dominates where terms cancel.
    step = torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(2**-100))) - 7)
    summing = in_features * 2**-24 * F.linear(x.double().abs(), weight.double().abs())
    assert ((out[:, 0].double() - exact).abs() <= step + summing).all()


def test_the_packed_projection_rounds_its_sums_to_nearest_even(kernel):
    """Small integers: every float32 sum is exact, so the one rounding to bfloat16 (8 significant
    bits, many ties among integers up to thousands) must be torch's, bit for bit."""
    generator = torch.Generator().manual_seed(5)
    weight = torch.randint(-8, 9, (70, 576), generator=generator).bfloat16()
    x = torch.randint(-8, 9, (5, 576), generator=generator).bfloat16()
    exact = F.linear(x.double(), weight.double())
    assert torch.equal(kernel(weight).linear(x), exact.bfloat16())


@pytest.mark.parametrize("product", ["amx_linear", "dot_linear", "fma_linear"])
def test_the_packed_projection_refuses_what_it_cannot_multiply(product, isa_level):
    kernels = cpu_kernels.load()
    multiply = getattr(kernels, product)
    supported, refusal = {
        "amx_linear": (kernels.amx_supported(), "AMX bfloat16 tiles are not available"),
        "dot_linear": (kernels.dot_linear_supported(), "built without AVX512-BF16"),
        "fma_linear": (kernels.fma_linear_supported(), "built without AVX2 and FMA"),
    }[product]
    if not supported:  # a product this CPU cannot run says so before it reads anything
        with pytest.raises(RuntimeError, match=refusal):
            multiply(torch.ones(2, 64).bfloat16(), torch.ones(2, 32, 32, 2), 40)
        return
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernels.pack_bf16(torch.ones(8, 40).bfloat16())
    packed = kernels.pack_bf16(torch.ones(40, 64).bfloat16())
    with pytest.raises(RuntimeError, match="x has 32 columns, the weight 64"):
        multiply(torch.ones(2, 32).bfloat16(), packed, 40)
    with pytest.raises(RuntimeError, match="does not match"):
        multiply(torch.ones(2, 64).bfloat16(), packed, 65)
    with pytest.raises(RuntimeError, match="bfloat16 expected"):
        multiply(torch.ones(2, 64), packed, 40)


def split_qk(lead, heads, kv_heads, dim, seed):
    """q and k as the model has them: strided views of one fused q/k/v product."""
    generator = torch.Generator().manual_seed(seed)
    width = (heads + 2 * kv_heads) * dim
    qkv = torch.randn(*lead, width, generator=generator).bfloat16()
    q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    return q.view(*lead, heads, dim), k.view(*lead, kv_heads, dim)


@pytest.mark.parametrize("lead", [(1,), (7,), (2, 5)])  # a lone decode, a batch, a prefill
@pytest.mark.parametrize("dim", [64, 24])  # vectorized halves, and the plain loop
def test_the_fused_rope_is_bitwise_apply_rotary(lead, dim, isa_level):
    q, k = split_qk(lead, 6, 2, dim, seed=dim)
    positions = torch.arange(int(torch.tensor(lead).prod())).view(lead) * 3 + 17
    cos, sin = RotaryEmbedding(RopeConfig(), dim, 512).cos_sin(positions, torch.bfloat16)
    expected_q, expected_k = apply_rotary(q, k, cos, sin)
    out_q, out_k = cpu_kernels.rope(q, k, cos, sin)
    assert torch.equal(out_q, expected_q) and torch.equal(out_k, expected_k)


def test_the_fused_rope_leaves_a_partial_rotation_to_torch(isa_level):
    q, k = split_qk((3,), 4, 2, 64, seed=1)
    rope = RotaryEmbedding(RopeConfig(partial_rotary_factor=0.5), 64, 64)
    cos, sin = rope.cos_sin(torch.tensor([1, 2, 3]), torch.bfloat16)
    out_q, out_k = cpu_kernels.rope(q, k, cos, sin)
    expected_q, expected_k = apply_rotary(q, k, cos, sin)
    assert torch.equal(out_q, expected_q) and torch.equal(out_k, expected_k)


@pytest.mark.parametrize("rows, width", [(1, 1536), (5, 40)])  # vectorized; a plain-loop tail
def test_the_fused_silu_and_product_matches_torch(rows, width, isa_level):
    torch.manual_seed(width)
    gate_up = (torch.randn(rows, 2 * width) * 4).bfloat16()
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    out = cpu_kernels.silu_and_mul(gate_up)
    assert out.shape == expected.shape and out.dtype == torch.bfloat16
    # torch's exp and ours may round a SiLU to neighbouring bfloat16 values; nothing further
    torch.testing.assert_close(out, expected, atol=0, rtol=2 * 2**-8)


def test_an_eager_bfloat16_shard_uses_the_kernels_and_float32_keeps_pure_torch(
    tiny_model_dirs, isa_level
):
    model = tiny_model_dirs["llama"]
    shard = Shard(tiny_config(model, dtype="bfloat16"), show_progress=False)
    kernel = cpu_kernels.kernel_for(torch.ones(8, 32).bfloat16())
    if kernel is not None:
        lm_head = shard.model.lm_head
        assert isinstance(lm_head.quantized, kernel)
        assert isinstance(shard.model.layers[0].mlp.down_proj.quantized, kernel)
        assert lm_head.weight is not None  # a tied embedding still looks rows up in it
    norms = [m for m in shard.model.modules() if isinstance(m, RMSNorm)]
    assert shard.adapter.attention_backend.name == "cpu-kernels"
    assert norms and all(
        m.fused is cpu_kernels.rms_norm for m in norms if not isinstance(m, GemmaRMSNorm)
    )
    if isa.at_least("avx512_bf16"):
        layer = shard.model.layers[0]
        assert layer.self_attn.fused_rotary is cpu_kernels.rope
        assert layer.mlp.fused_act_and_mul is cpu_kernels.silu_and_mul
    plain = Shard(tiny_config(model), show_progress=False)
    assert plain.adapter.attention_backend in (None, TORCH)
    assert all(m.fused is None for m in plain.model.modules() if isinstance(m, RMSNorm))
    assert plain.model.layers[0].self_attn.fused_rotary is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_row_by_row_equals_head_by_head(dtype, isa_level):
    """A batch of two rows a thread or more reads each row's kv heads together, chunk by chunk;
    fewer rows split further (float32 by kv head, bfloat16 by spans of 64 positions, merged after).
    Both run the same arithmetic in the same order (in bfloat16 the scores are bfloat16 dot
    products, 16 positions summed at once, and every row goes span by span on either path): the
    same bits, whatever the thread count. A row of 150 positions has three spans."""
    case = paged_case([40, 3, 150, 33], dtype, heads=6, kv_heads=2, dim=64, padding=(2, 1))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # 5 rows, 1 thread: row by row
        by_row = cpu_kernels.decode_attention(*case, 0.125)
        torch.set_num_threads(4)  # 5 rows, 4 threads: by kv head
        by_head = cpu_kernels.decode_attention(*case, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(by_row, by_head)
    reference = flat_attention(*case, 0.125)
    torch.testing.assert_close(by_row.float(), reference.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_crew_hands_every_item_to_one_member(threads, isa_level):
    """The fused step's crew (crew.h): one parallel_for's items in contiguous parts, one a member,
    each item done once; a parallel_for inside a part runs there, whole."""
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        members = cpu_kernels.load().crew_members(10, 1, -1)
        few = cpu_kernels.load().crew_members(10, 8, -1)  # grain 8: two parts at most
    finally:
        torch.set_num_threads(previous)
    assert members.tolist() == sorted(members.tolist())  # contiguous parts, in member order
    assert set(members.tolist()) == set(range(threads))
    assert set(few.tolist()) == set(range(min(threads, 2)))


@pytest.mark.parametrize("failing_item", [0, 9])  # the driver's part, then the last member's
def test_an_error_in_a_crews_part_reaches_the_caller_and_the_crew_ends(failing_item, isa_level):
    with pytest.raises(RuntimeError, match=f"item {failing_item} failed"):
        cpu_kernels.load().crew_members(10, 1, failing_item)
    assert (cpu_kernels.load().crew_members(10, 1, -1) >= 0).all()  # the next crew runs
