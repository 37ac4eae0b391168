"""Static-shape MoE: both expert implementations compute the routed mixture exactly, serve
token-exact against transformers, and random traffic never meets an unwarmed shape."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from engine.distributed import SINGLE
from engine.layers.moe import MOE_IMPLS, SparseMoeBlock, moe_ops
from engine.serving.shard import Shard
from launcher.generate import generate
from tests.conftest import tiny_config
from tests.family_models import family_dirs  # noqa: F401 (a fixture)
from tests.test_equivalence import NEW_TOKENS, PROMPTS, reference_tokens
from tests.test_warmup_invariant import LIMITS, TRAFFIC, serve_random_traffic


def looped_reference(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """The textbook loop: each token through each of its top-k experts, one at a time."""
    probs = torch.softmax(block.gate(x).float(), dim=-1)
    weights, ids = torch.topk(probs, block.top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True) if block.normalize else weights
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for weight, e in zip(weights[t], ids[t]):
            gate, up = (block.gate_up[e] @ x[t]).chunk(2)
            out[t] += weight * (block.down[e] @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("impl", list(MOE_IMPLS))
@pytest.mark.parametrize("normalize", [True, False])
def test_static_experts_equal_the_loop(impl, normalize):
    torch.manual_seed(0)
    block = SparseMoeBlock(16, 24, 5, 2, normalize, F.silu, SINGLE, moe_ops(impl))
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0, 0.5)
    x = torch.randn(7, 16)
    torch.testing.assert_close(block(x), looped_reference(block, x), rtol=1e-5, atol=1e-5)


def test_gather_chunks_give_the_same_result():
    torch.manual_seed(1)
    block = SparseMoeBlock(16, 24, 5, 2, True, F.silu, SINGLE, moe_ops("gather"))
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0, 0.5)
    x = torch.randn(9, 16)
    whole = block(x)
    block.ops.chunk_elements = (
        block.gate_up[0].numel() * 4
    )  # 4 pairs per chunk: 5 chunks for 18 pairs
    torch.testing.assert_close(block(x), whole)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_gather_experts_match_transformers(family_dirs, family):
    model_dir = family_dirs[family]
    shard = Shard(tiny_config(model_dir, moe_impl="gather"), show_progress=False)
    assert all(
        m.ops.name == "gather" for m in shard.model.modules() if isinstance(m, SparseMoeBlock)
    )
    ours = generate(shard, PROMPTS, NEW_TOKENS, ignore_eos=True)
    assert [c.token_ids for c in ours] == reference_tokens(model_dir, PROMPTS, NEW_TOKENS)
    assert not shard.adapter.shapes.unwarmed


@pytest.fixture(scope="module")
def moe_shards(family_dirs):
    built = {}

    def get(family, impl):
        if (family, impl) not in built:
            built[family, impl] = Shard(
                tiny_config(family_dirs[family], moe_impl=impl, **LIMITS), show_progress=False
            )
            built[family, impl].warmup()
        return built[family, impl]

    return get


@pytest.mark.parametrize("family, impl", [("qwen3_moe", "dense"), ("mixtral", "gather")])
@TRAFFIC
@given(data=st.data())
def test_moe_random_traffic_never_meets_an_unwarmed_shape(moe_shards, family, impl, data):
    shard = moe_shards(family, impl)
    assert serve_random_traffic(shard, data) > 0
    assert sum(shard.adapter.shapes.unwarmed.values()) == 0, shard.adapter.shapes.unwarmed


@pytest.mark.parametrize("impl", list(MOE_IMPLS))
def test_experts_have_no_data_dependent_shapes(impl):
    """Every intermediate of the exported graph has a concrete shape: a shape that depends on the
    routing (the usual loop over the experts that were hit) would show up as a symbolic size."""
    block = SparseMoeBlock(16, 24, 5, 2, True, F.silu, SINGLE, moe_ops(impl)).eval()
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0, 0.5)
    exported = torch.export.export(block, (torch.randn(6, 16),), strict=False)
    shapes = [
        node.meta["val"].shape
        for node in exported.graph.nodes
        if isinstance(node.meta.get("val"), torch.Tensor)
    ]
    assert shapes and all(isinstance(size, int) for shape in shapes for size in shape), shapes
    x = torch.randn(6, 16)
    torch.testing.assert_close(exported.module()(x), block(x))
