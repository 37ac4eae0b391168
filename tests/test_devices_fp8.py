"""FP8 checkpoints on HPU (fp8_gemm_v2, Gaudi 2's +-240 range) and CUDA (torch._scaled_mm), against
fakes as strict as the upstream ops (tests/fakes/habana.py, tests/fakes/cuda.py)."""

import pytest
import torch
from torch import nn

from engine.devices import get_adapter
from engine.devices.cuda.adapter import CUDAAdapter
from engine.devices.fp8 import CUDAFp8Weight, HPUFp8Weight
from engine.layers.fp8 import FP8, Fp8Weight
from tests.fakes import cuda as fake_cuda
from tests.test_devices_hpu import habana, start_bridge  # noqa: F401 - the fixture


def checkpoint_layer(out_features=32, in_features=64, peak=448.0, seed=0):
    """An FP8 checkpoint's layer whose codes reach e4m3fn's +-448, as llm-compressor writes them."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator)
    scale = weight.abs().amax(dim=1) / peak
    codes = (weight / scale.unsqueeze(1)).to(FP8)
    return Fp8Weight(codes, scale)


def model_of(*layers):
    model = nn.Module()
    model.layers = nn.ModuleList(layers)
    return model


def inputs(rows=5, features=64):
    return torch.randn(rows, features, generator=torch.Generator().manual_seed(1))


def assert_near(out, reference):
    """Activations quantized to FP8 per token as well: about 3% relative error."""
    error = (out.float() - reference.float()).norm() / reference.float().norm()
    assert error < 0.06, f"relative error {error:.3f}"


def test_fp8_is_a_quantize_mode_on_hpu_and_cuda(habana, monkeypatch):
    fake_cuda.install(monkeypatch)
    assert "fp8" in get_adapter("hpu").quantize_modes
    assert "fp8" in get_adapter("cuda").quantize_modes


@pytest.mark.parametrize("hardware", ["gaudi2", "gaudi3"])
def test_hpu_multiplies_fp8_through_fp8_gemm_v2_within_the_hardware_range(monkeypatch, hardware):
    from engine.devices.hpu.adapter import HPUAdapter

    monkeypatch.setattr(HPUAdapter, "torch_device_type", "cpu")
    fake = start_bridge(monkeypatch, hardware=hardware)
    layer = checkpoint_layer()
    reference = layer.linear(inputs())
    get_adapter("hpu").prepare_model(model_of(layer), torch.bfloat16)
    assert type(layer) is HPUFp8Weight and layer.weight.dtype == FP8
    limit = 240.0 if hardware == "gaudi2" else 448.0
    assert float(layer.weight.float().abs().max()) <= limit
    out = layer.linear(inputs())
    assert fake.fp8_gemms == 1
    assert_near(out, reference)


def test_the_gaudi2_fake_refuses_e4m3fn_codes_past_240(monkeypatch):
    fake = start_bridge(monkeypatch, hardware="gaudi2")
    layer = checkpoint_layer()
    x = fake.cast_to_fp8_v2(inputs(), torch.tensor(1.0), False, False, FP8)[0]
    with pytest.raises(RuntimeError, match=r"past gaudi2's fp8 range of \+-240"):
        torch.ops.hpu.fp8_gemm_v2(
            A=x,
            trans_A=False,
            B=layer.weight,
            trans_B=True,
            D=None,
            out_dtype=torch.bfloat16,
            A_scale_inv=torch.ones(5, 1),
            B_scale_inv=layer.scale,
            bias=None,
            accumulate=False,
        )


@pytest.fixture
def gpus(monkeypatch):
    calls = fake_cuda.install(monkeypatch)
    monkeypatch.setattr(CUDAAdapter, "torch_device_type", "cpu")
    return calls


def test_cuda_multiplies_fp8_through_scaled_mm_with_row_scales(gpus):
    layer = checkpoint_layer()
    reference = layer.linear(inputs())
    get_adapter("cuda").prepare_model(model_of(layer), torch.bfloat16)
    assert type(layer) is CUDAFp8Weight and layer.native
    assert_near(layer.linear(inputs()), reference)


def test_cuda_layers_scaled_mm_refuses_dequantize_instead(gpus, monkeypatch):
    odd = checkpoint_layer(out_features=24)  # 24 is not a multiple of 16
    reference = odd.linear(inputs())
    get_adapter("cuda").prepare_model(model_of(odd), torch.bfloat16)
    assert not odd.native
    torch.testing.assert_close(odd.linear(inputs()), reference)


def test_the_scaled_mm_fake_keeps_upstreams_refusals():
    a = torch.randn(4, 32).to(FP8)
    b = torch.randn(16, 32).to(FP8)
    ones_a, ones_b = torch.ones(4, 1), torch.ones(1, 16)
    with pytest.raises(RuntimeError, match="row-major and column-major"):
        fake_cuda.scaled_mm(a, b.t().contiguous(), ones_a, ones_b, out_dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="Only bf16 high precision output types"):
        fake_cuda.scaled_mm(a, b.t(), ones_a, ones_b, out_dtype=torch.float32)
    with pytest.raises(RuntimeError, match="Invalid scaling configuration"):
        fake_cuda.scaled_mm(a, b.t(), ones_a.double(), ones_b, out_dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="compute capability"):
        fake_cuda.scaled_mm(a, b.t(), ones_a, ones_b, capability=(8, 0))
    out = fake_cuda.scaled_mm(a, b.t(), ones_a, ones_b, out_dtype=torch.bfloat16)
    assert out.shape == (4, 16) and out.dtype == torch.bfloat16
