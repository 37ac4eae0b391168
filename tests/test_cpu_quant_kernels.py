"""--quantize's CPU products (engine/devices/cpu/kernels/int4_linear.cpp, int8_linear.cpp): the
codes multiplied in AVX512-BF16 dot products, against the exact product of the weight they stand
for, and their refusals."""

import pytest
import torch
import torch.nn.functional as F

from engine.devices.cpu import kernels as cpu_kernels
from engine.layers.quant import Int4Weight, int4_groupwise, int8_per_channel
from tests.isa_levels import skip_module_below

skip_module_below("avx512_bf16")  # their only level so far


@pytest.fixture(autouse=True)
def at_avx512_bf16(kernels_at):
    kernels_at("avx512_bf16")


def bfloat16_step(exact: torch.Tensor) -> torch.Tensor:
    """One bfloat16 step at each value's magnitude: the result's last rounding is half of it."""
    return torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(2**-100))) - 7)


def int4_weight(rows: int, cols: int, seed: int) -> Int4Weight:
    generator = torch.Generator().manual_seed(seed)
    return int4_groupwise(torch.randn(rows, cols, generator=generator), torch.bfloat16)


def int4_parts(weight: Int4Weight):
    """codes [N, K], scale and zero [N, K / 32] as float64."""
    kernel = cpu_kernels.Int4Linear.of(weight)
    assert kernel is not None
    from engine.layers.quant import unpack_int4

    codes = unpack_int4(weight.packed, weight.in_features, weight.layout)[: weight.out_features]
    scale, zero = (weight.scale_zero[..., i].t()[: weight.out_features] for i in (0, 1))
    return kernel, codes.double(), scale.double(), zero.double()


# Columns: a partial block alone, one whole block, a partial last block of many; rows: a lone
# decode, a partial and a whole tile of codes (6), past it, the last count read from the codes (32).
@pytest.mark.parametrize("rows", [1, 3, 6, 7, 32])
@pytest.mark.parametrize("out_features, in_features", [(24, 64), (32, 96), (100, 576)])
def test_int4_from_its_codes_is_the_exact_product_within_float32_sums(
    rows, out_features, in_features
):
    kernel, codes, scale, zero = int4_parts(int4_weight(out_features, in_features, seed=rows))
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(7)).bfloat16()
    out = kernel.linear(x.unsqueeze(1))
    assert out.shape == (rows, 1, out_features) and out.dtype == torch.bfloat16
    group_scale, group_zero = (t.repeat_interleave(32, dim=1) for t in (scale, zero))
    weight = (codes - 8) * group_scale + group_zero
    exact = F.linear(x.double(), weight)
    # The kernel sums x (128 + q) and, apart, x once per group (w = s (128 + q) + z - 136 s), so
    # float32's error bound runs over those terms, larger than x w's
    terms = F.linear(
        x.double().abs(), (codes + 128) * group_scale + (group_zero - 136 * group_scale).abs()
    )
    summing = 2 * in_features * 2**-24 * terms
    assert ((out[:, 0].double() - exact).abs() <= bfloat16_step(exact) + summing).all()


@pytest.mark.parametrize("rows", [33, 40, 300])
def test_int4_for_many_rows_widens_each_block_to_the_bfloat16_weight(rows):
    """Past 32 rows each block becomes bfloat16 weights w = q s + (z - 8 s), each rounded once from
    float32, then dot_linear's tiles run over it: bitwise DotLinear on that weight."""
    kernel, codes, scale, zero = int4_parts(int4_weight(100, 576, seed=rows))
    s, z = (t.float().repeat_interleave(32, dim=1) for t in (scale, zero))
    widened = (codes.float() * s + (z - 8 * s)).bfloat16()
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(8)).bfloat16()
    assert torch.equal(kernel.linear(x), cpu_kernels.DotLinear(widened).linear(x))


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_int4_rounds_exact_sums_to_nearest_even(rows):
    """Scale 1 and zero 8 make w = q; with small integer inputs every float32 sum is exact, so
    the one rounding to bfloat16 must be torch's, bit for bit."""
    generator = torch.Generator().manual_seed(rows)
    codes = torch.randint(0, 16, (70, 576), generator=generator)
    ones = torch.ones(70, 576 // 32)
    weight = Int4Weight(codes, ones, 8 * ones, 32, torch.bfloat16)
    x = torch.randint(-8, 9, (rows, 576), generator=generator).bfloat16()
    exact = F.linear(x.double(), codes.double())
    assert torch.equal(cpu_kernels.Int4Linear.of(weight).linear(x), exact.bfloat16())


def test_the_packed_weights_read_back_as_the_weights_they_hold():
    int4 = int4_weight(100, 576, seed=1)
    assert torch.equal(cpu_kernels.Int4Linear.of(int4).dequantize(), int4.dequantize())
    int8 = int8_per_channel(torch.randn(100, 576), torch.bfloat16)
    assert torch.equal(cpu_kernels.Int8Linear.of(int8).dequantize(), int8.dequantize())


def test_int4_refuses_what_it_cannot_multiply():
    codes, half = torch.zeros(40, 64, dtype=torch.uint8), torch.ones(40, 2).bfloat16()
    with pytest.raises(RuntimeError, match="multiple of 32 inputs"):
        cpu_kernels.load().pack_int4(torch.zeros(40, 48, dtype=torch.uint8), half, half)
    with pytest.raises(RuntimeError, match="codes must be 0 to 15"):
        cpu_kernels.load().pack_int4(codes + 16, half, half)
    with pytest.raises(RuntimeError, match="scale and zero"):
        cpu_kernels.load().pack_int4(codes, half[:, :1], half)
    packed = cpu_kernels.load().pack_int4(codes, half, half)
    with pytest.raises(RuntimeError, match="x has 32 columns, the weight 64"):
        cpu_kernels.load().int4_linear(torch.ones(2, 32).bfloat16(), packed, 40)
    with pytest.raises(RuntimeError, match="does not match"):
        cpu_kernels.load().int4_linear(torch.ones(2, 64).bfloat16(), packed, 65)
    with pytest.raises(RuntimeError, match="bfloat16 expected"):
        cpu_kernels.load().int4_linear(torch.ones(2, 64), packed, 40)
    with pytest.raises(RuntimeError, match="packed by pack_int4"):
        cpu_kernels.load().int4_linear(torch.ones(2, 64).bfloat16(), packed[..., :-1], 40)


# Rows: a lone decode, a whole tile (12), past it, past the 256 rows kept in cache.
@pytest.mark.parametrize("rows", [1, 12, 13, 300])
@pytest.mark.parametrize("out_features, in_features", [(24, 64), (100, 576)])
def test_int8_from_its_codes_is_the_exact_product_within_float32_sums(
    rows, out_features, in_features
):
    generator = torch.Generator().manual_seed(rows)
    weight = int8_per_channel(
        torch.randn(out_features, in_features, generator=generator), torch.bfloat16
    )
    kernel = cpu_kernels.Int8Linear.of(weight)
    x = torch.randn(rows, in_features, generator=generator).bfloat16()
    out = kernel.linear(x.unsqueeze(1))
    assert out.shape == (rows, 1, out_features) and out.dtype == torch.bfloat16
    exact = F.linear(x.double(), weight.codes.double() * weight.scale.double().unsqueeze(1))
    magnitude = F.linear(x.double().abs(), weight.codes.double().abs()) * weight.scale.double()
    summing = (in_features + 1) * 2**-24 * magnitude  # the sums, then the scale's product
    assert ((out[:, 0].double() - exact).abs() <= bfloat16_step(exact) + summing).all()


def test_int8_rounds_exact_sums_to_nearest_even():
    generator = torch.Generator().manual_seed(5)
    codes = torch.randint(-127, 128, (70, 576), generator=generator).to(torch.int8)
    scale = torch.full((70,), 0.25).bfloat16()  # a power of two keeps the product exact
    from engine.layers.quant import Int8Weight

    weight = Int8Weight(codes, scale)
    x = torch.randint(-8, 9, (5, 576), generator=generator).bfloat16()
    exact = F.linear(x.double(), codes.double() * 0.25)
    assert torch.equal(cpu_kernels.Int8Linear.of(weight).linear(x), exact.bfloat16())


def test_int8_refuses_what_it_cannot_multiply():
    codes, scale = torch.zeros(40, 64, dtype=torch.int8), torch.ones(40)
    with pytest.raises(RuntimeError, match="even number of inputs"):
        cpu_kernels.load().pack_int8(torch.zeros(40, 63, dtype=torch.int8), scale)
    with pytest.raises(RuntimeError, match="int8 expected"):
        cpu_kernels.load().pack_int8(codes.to(torch.uint8), scale)
    with pytest.raises(RuntimeError, match=r"scale \[N\]"):
        cpu_kernels.load().pack_int8(codes, scale[:5])
    packed = cpu_kernels.load().pack_int8(codes, scale)
    with pytest.raises(RuntimeError, match="packed by pack_int8 for 32 inputs"):
        cpu_kernels.load().int8_linear(torch.ones(2, 32).bfloat16(), packed, 40)
    with pytest.raises(RuntimeError, match="does not match"):
        cpu_kernels.load().int8_linear(torch.ones(2, 64).bfloat16(), packed, 65)
    with pytest.raises(RuntimeError, match="bfloat16 expected"):
        cpu_kernels.load().int8_linear(torch.ones(2, 64), packed, 40)


def test_float32_scales_keep_torchs_quantized_kernels():
    """The products take bfloat16 activations; a float32 model's weights stay on torch's cpu_kernels.load()."""
    assert cpu_kernels.Int8Linear.of(int8_per_channel(torch.randn(8, 64), torch.float32)) is None
    assert cpu_kernels.Int4Linear.of(int4_groupwise(torch.randn(32, 64), torch.float32)) is None


@pytest.mark.parametrize("rows", [1, 9, 40])
def test_a_float32_drafts_weights_take_the_products_within_bfloat16s_rounding(rows):
    """A draft's float32 int4 and int8 weights do take the products (its scales, zeros and inputs
    rounded to bfloat16): torch's float32 product of the same weights, within what those roundings
    move (one bfloat16 step of the sum of the |x w| terms; seen: a fifth of that)."""
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=generator)
    for weight in (
        int4_groupwise(torch.randn(100, 576, generator=generator), torch.float32),
        int8_per_channel(torch.randn(100, 576, generator=generator), torch.float32),
    ):
        kind = cpu_kernels.Int4Linear if isinstance(weight, Int4Weight) else cpu_kernels.Int8Linear
        kernel = kind.of(weight, draft=True)
        assert kernel is not None
        out = kernel.linear(x)
        assert out.dtype == torch.float32 and out.shape == (rows, 100)
        exact = weight.linear(x)
        scale = F.linear(x.abs(), weight.dequantize().abs())
        assert ((out - exact).abs() <= 2**-8 * scale).all()
