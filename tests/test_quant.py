"""Weight-only quantized layers (engine/layers/quant.py) and GGUF blocks read as stored (engine/weights/gguf.py):
each equals a dequantize-then-matmul reference."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from engine.layers.quant import Int4Weight, Int8Weight, int4_groupwise, int8_per_channel
from engine.weights.gguf import decode_q4, unpermute_rows


def reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.double() @ weight.double().t()


def test_int8_linear_equals_dequantize_then_matmul():
    torch.manual_seed(1)
    codes, scale = torch.randint(-127, 128, (40, 64), dtype=torch.int8), torch.rand(40) + 0.05
    layer, x = Int8Weight(codes, scale), torch.randn(2, 3, 64)
    expected = codes.float() * scale.unsqueeze(1)
    assert torch.equal(layer.dequantize(), expected)
    torch.testing.assert_close(
        layer.linear(x).double(), reference(x, expected), rtol=1e-5, atol=1e-4
    )
    assert torch.equal(layer.rows(torch.tensor([[3, 0]])), expected[[3, 0]].unsqueeze(0))


@pytest.mark.parametrize("rows", [48, 40, 64])  # 40: padded to 48; 64: dequantized by unpacking
def test_int4_linear_equals_dequantize_then_matmul(rows):
    torch.manual_seed(2)
    codes = torch.randint(0, 16, (rows, 96), dtype=torch.uint8)
    scale, zero = torch.rand(rows, 3) + 0.05, torch.randn(rows, 3)
    layer, x = Int4Weight(codes, scale, zero, 32, torch.float32), torch.randn(5, 96)
    expected = (codes.float() - 8) * scale.repeat_interleave(32, 1) + zero.repeat_interleave(32, 1)
    torch.testing.assert_close(layer.dequantize(), expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(
        layer.linear(x).double(), reference(x, expected), rtol=1e-5, atol=1e-4
    )


@pytest.mark.parametrize("make", [int8_per_channel, int4_groupwise])
def test_bfloat16_activations_stay_close_to_the_reference(make):
    torch.manual_seed(3)
    weight, x = torch.randn(64, 128), torch.randn(4, 128)
    layer = make(weight, torch.bfloat16)
    out = layer.linear(x.bfloat16())
    assert out.dtype == torch.bfloat16
    expected = reference(x.bfloat16().float(), layer.dequantize())
    torch.testing.assert_close(out.double(), expected, rtol=0.02, atol=0.1)


@pytest.mark.parametrize("make, worst", [(int8_per_channel, 1 / 254), (int4_groupwise, 1 / 30)])
def test_quantizers_round_each_weight_to_its_nearest_code(make, worst):
    """Error of at most half a step: a step is max|w|/127 (int8) or a group's range / 15 (int4)."""
    torch.manual_seed(4)
    weight = torch.randn(32, 64)
    error = (make(weight, torch.float32).dequantize() - weight).abs()
    span = (
        weight.abs().amax(1, keepdim=True) * 2
    )  # bounds both the int8 scale and any group's range
    assert (error <= span * worst + 1e-6).all()


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1])
def test_gguf_q4_blocks_decode_to_the_gguf_reference_values(qtype):
    """Our codes/scales/zeros from raw Q4 blocks equal the `gguf` package's own dequantization."""
    rng = np.random.default_rng(5)
    values = rng.standard_normal((48, 96)).astype(np.float32)
    raw = quantize(values, qtype)
    ours = decode_q4(raw, 48, 96, with_min=qtype == Q.Q4_1)
    expected = torch.from_numpy(dequantize(raw, qtype).reshape(48, 96).astype(np.float32))
    torch.testing.assert_close(ours.dequantize(), expected, rtol=1e-6, atol=1e-6)
    layer = Int4Weight(ours.codes, ours.scale, ours.zero, 32, torch.float32)
    torch.testing.assert_close(layer.dequantize(), expected, rtol=1e-6, atol=1e-6)


def test_q_and_k_rows_are_permuted_back_as_transformers_does():
    """llama.cpp's converter interleaves each head's rotary halves; the inverse restores HF order."""
    heads, rows = 2, 12  # 3 row pairs a head: a transposed reshape would not be the identity
    hf = torch.arange(rows)
    permuted = (
        hf.reshape(heads, 2, rows // heads // 2).transpose(1, 2).reshape(rows)
    )  # llama.cpp's permute
    assert torch.equal(permuted[unpermute_rows(rows, heads)], hf)


@pytest.mark.parametrize("make", [int8_per_channel, int4_groupwise])
def test_many_rows_dequantize_once_and_match_the_kernel(make):
    """A prefill's rows take the dequantize-then-GEMM path; it computes the same product."""
    from engine.layers.quant import DEQUANTIZE_ROWS

    torch.manual_seed(6)
    layer = make(torch.randn(128, 64), torch.float32)
    assert getattr(layer, "unpackable", True)
    x = torch.randn(DEQUANTIZE_ROWS + 1, 64)
    expected = reference(x, layer.dequantize())
    torch.testing.assert_close(layer.linear(x).double(), expected, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(layer.linear(x[:4]).double(), expected[:4], rtol=1e-5, atol=1e-4)


UNPACK_CHECK = """
import torch
from engine.layers.quant import Int4Weight
torch.manual_seed(7)
for rows in (64, 144, 16):  # whole 64- and 32-row blocks, then a partial one; a lone partial block
    codes = torch.randint(0, 16, (rows, 64), dtype=torch.uint8)
    layer = Int4Weight(codes, torch.rand(rows, 2) + 0.05, torch.randn(rows, 2), 32, torch.float32)
    assert layer.unpackable, (torch.backends.cpu.get_cpu_capability(), rows)
    through_kernel = torch.ops.aten._weight_int4pack_mm_for_cpu(
        torch.eye(64), layer.packed, 32, layer.scale_zero
    ).t()[:rows]
    torch.testing.assert_close(layer.dequantize(), through_kernel, rtol=1e-6, atol=1e-6)
print(torch.backends.cpu.get_cpu_capability(), layer.layout)
"""


@pytest.mark.parametrize("capability", ["default", "avx2", "avx512"])
def test_int4_unpacks_every_layout_torch_packs(capability):
    """torch packs int4 weights in a layout of the CPU build it dispatched to (CI's machines differ):
    each of its builds that this CPU runs is read back to the codes the kernel multiplies by."""
    import os
    import subprocess
    import sys

    # torch takes ATEN_CPU_CAPABILITY at its word: a build this CPU lacks dies of SIGILL
    runs = {"default": True, "avx2": torch.cpu._is_avx2_supported()}
    runs["avx512"] = torch.cpu._is_avx512_supported()
    if not runs[capability]:
        pytest.skip(f"this CPU lacks {capability.upper()}: torch's {capability} build cannot run")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    done = subprocess.run(
        [sys.executable, "-c", UNPACK_CHECK], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    ran = done.stdout.split()[0].lower()
    if ran != capability:
        pytest.skip(f"this CPU does not run torch's {capability} build (it ran {ran})")
