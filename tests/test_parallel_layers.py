"""How the tensor-parallel layers split a model, and that each rank reads only its own slices."""

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import profile

from engine.distributed import Parallel
from engine.errors import ModelLoadError
from engine.layers.embedding import VocabParallelEmbedding
from engine.layers.linear import (
    RowParallelLinear,
    dense_linear,
    is_lone_reduced_row,
    kv_partition,
    qkv_parallel,
)
from engine.weights.loader import build_model, load_weights, read_config, weight_files
from engine.weights.placement import Placement


class RecordingSlice:
    """A checkpoint tensor that records which part of it was read (like a safetensors slice)."""

    def __init__(self, tensor):
        self.tensor, self.reads = tensor, []

    def get_shape(self):
        return list(self.tensor.shape)

    def __getitem__(self, index):
        self.reads.append(index)
        return self.tensor[index]


def test_kv_heads_split_or_replicate():
    assert [kv_partition(4, Parallel(r, 2)) for r in range(2)] == [(2, 0), (2, 2)]
    # one kv head for two ranks: both hold it; two kv heads over four ranks: pairs share one
    assert [kv_partition(1, Parallel(r, 2)) for r in range(2)] == [(1, 0), (1, 0)]
    assert [kv_partition(2, Parallel(r, 4)) for r in range(4)] == [(1, 0), (1, 0), (1, 1), (1, 1)]
    with pytest.raises(
        ValueError, match=r"key/value heads \(2\) cannot be replicated over 3 shards"
    ):
        kv_partition(2, Parallel(0, 3))


def test_rank_reads_only_its_rows_and_columns():
    torch.manual_seed(0)
    q = RecordingSlice(torch.randn(4 * 8, 16))
    layer = qkv_parallel(16, 8, heads=4, kv_heads=2, bias=False, parallel=Parallel(1, 2))
    layer.load("weight", "q", q, "q_proj.weight")
    assert q.reads == [slice(16, 32)]
    torch.testing.assert_close(layer.weight[:16], q.tensor[16:32])

    down = RecordingSlice(torch.randn(16, 64))
    row = RowParallelLinear(64, 16, bias=False, parallel=Parallel(1, 2))
    row.load("weight", None, down, "down_proj.weight")
    assert down.reads == [(slice(None), slice(32, 64))]
    torch.testing.assert_close(row.weight, down.tensor[:, 32:])

    embed = RecordingSlice(torch.randn(11, 4))  # 11 rows over 2 ranks: 6 + 5 and a zero pad row
    vocab = VocabParallelEmbedding(11, 4, Parallel(1, 2))
    vocab.load("weight", None, embed, "embed_tokens.weight")
    assert embed.reads == [slice(6, 11)]
    torch.testing.assert_close(vocab.weight[:5], embed.tensor[6:])
    assert not vocab.weight[5].any()


def test_sharded_rank_holds_its_part_of_the_checkpoint(tiny_model_dirs):
    from safetensors.torch import load_file

    model_dir = tiny_model_dirs["qwen2"]
    model = build_model(
        read_config(model_dir), Placement(torch.float32, torch.device("cpu"), Parallel(1, 2)), 64
    )
    load_weights(model, weight_files(model_dir))
    tensors = load_file(model_dir / "model.safetensors")
    attn = model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads) == (2, 1)
    k_rows = attn.qkv_proj.weight[attn.q_size : attn.q_size + attn.kv_size]
    torch.testing.assert_close(k_rows, tensors["model.layers.0.self_attn.k_proj.weight"][16:32])
    torch.testing.assert_close(
        attn.qkv_proj.bias[: attn.q_size], tensors["model.layers.0.self_attn.q_proj.bias"][32:64]
    )
    torch.testing.assert_close(
        model.layers[0].mlp.down_proj.weight, tensors["model.layers.0.mlp.down_proj.weight"][:, 64:]
    )
    assert model.lm_head.weight is model.embed_tokens.weight  # tied: one vocabulary shard for both


def test_a_model_that_cannot_be_split_is_a_clear_error(tiny_model_dirs):
    with pytest.raises(
        ModelLoadError,
        match=r"cannot be sharded 3 ways: attention heads \(4\) cannot be split over 3 shards",
    ):
        build_model(
            read_config(tiny_model_dirs["llama"]),
            Placement(torch.float32, torch.device("cpu"), Parallel(0, 3)),
            64,
        )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_a_lone_reduced_precision_row_takes_matrix_vector_and_equals_the_float32_product(
    dtype, with_bias
):
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(96, 64, generator=gen).to(dtype)
    bias = torch.randn(96, generator=gen).to(dtype) if with_bias else None
    x = torch.randn(1, 64, generator=gen).to(dtype)
    expected = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    with profile() as prof:
        out = dense_linear(x, weight, bias)
    assert "aten::mv" in {event.name for event in prof.events()}
    assert out.shape == (1, 96) and out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)
    assert (
        is_lone_reduced_row(x)
        and not is_lone_reduced_row(x.float())
        and not is_lone_reduced_row(x.repeat(2, 1))
    )
