"""The CPU adapter's prepacked bfloat16 projections (engine/devices/cpu/packed.py)."""

import pytest
import torch
import torch.nn.functional as F

from engine.devices.cpu.packed import PackedBf16Weight, packing_available
from engine.layers.embedding import VocabParallelEmbedding
from engine.layers.linear import ColumnParallelLinear, RowParallelLinear
from engine.serving.shard import Shard
from tests.conftest import tiny_config

pytestmark = pytest.mark.skipif(
    not packing_available(), reason="this torch has no oneDNN bfloat16 kernels"
)


@pytest.fixture(autouse=True)
def without_fused_kernels(monkeypatch):
    """Packing is the path of a CPU without the fused kernels (engine/devices/cpu/kernels), whose
    GEMV otherwise takes the projections first."""
    monkeypatch.setenv("BUCKETSERVE_CPU_KERNELS", "0")


@pytest.mark.parametrize("rows", [1, 3, 32, 100])
def test_a_packed_weight_multiplies_as_f_linear_does(rows):
    torch.manual_seed(rows)
    weight, x = torch.randn(96, 64).bfloat16(), torch.randn(2, rows, 64).bfloat16()
    out = PackedBf16Weight(weight).linear(x)
    assert out.shape == (2, rows, 96) and out.dtype == torch.bfloat16
    expected = F.linear(x, weight)
    if 2 * rows <= 32:  # decode-sized batches: the very same bits
        assert torch.equal(out, expected)
    torch.testing.assert_close(
        out.float(), F.linear(x.float(), weight.float()), atol=0.1, rtol=0.02
    )


def projections(shard) -> list:
    return [
        m for m in shard.model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
    ]


def test_an_eager_bfloat16_shard_packs_its_projections_and_leaves_the_vocabulary_plain(
    tiny_model_dirs,
):
    shard = Shard(tiny_config(tiny_model_dirs["llama"], dtype="bfloat16"), show_progress=False)
    layers = projections(shard)
    assert layers and all(
        isinstance(m.quantized, PackedBf16Weight) and m.weight is None for m in layers
    )
    vocabulary = [m for m in shard.model.modules() if isinstance(m, VocabParallelEmbedding)]
    assert vocabulary and all(
        m.quantized is None and m.weight.dtype == torch.bfloat16 for m in vocabulary
    )


@pytest.mark.parametrize(
    "overrides", [dict(dtype="float32"), dict(dtype="bfloat16", quantize="int8")]
)
def test_float32_and_quantized_weights_are_not_packed(tiny_model_dirs, overrides):
    shard = Shard(tiny_config(tiny_model_dirs["llama"], **overrides), show_progress=False)
    assert not any(isinstance(m.quantized, PackedBf16Weight) for m in projections(shard))
