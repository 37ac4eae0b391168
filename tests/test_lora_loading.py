"""LoRA adapters: the two implementations agree, tensor-parallel slices add up to the whole, bad
adapters are refused at load with a clear message, and the flags reach the config and the shards."""

import json
import shutil

import pytest
import torch

from engine.config import parse_lora_adapters
from engine.distributed import Parallel
from engine.errors import ModelLoadError
from engine.layers.lora import DenseLora, GatherLora, LoraSet, LoraWeights, lora_ops
from engine.weights.loader import build_model, load_weights, read_config, weight_files
from engine.weights.lora import attach_adapters, read_adapter
from engine.weights.placement import Placement
from tests.models import build_tiny_model
from tests.test_lora import ADAPTERS, lora_dirs, make_adapter  # noqa: F401 - lora_dirs is a fixture


def test_dense_and_gather_agree_on_a_fused_projection_with_mixed_tokens():
    torch.manual_seed(0)
    adapters, rank, width, outs = 3, 4, 16, [8, 4, 4]  # q, k, v of different widths
    a = torch.randn(adapters, len(outs), rank, width)
    b = [torch.randn(adapters, out, rank) for out in outs]
    index = torch.tensor([-1, 0, 2, 1, 2, -1, 0])
    x, base = torch.randn(len(index), width), torch.randn(len(index), sum(outs))
    results = {}
    for ops in (DenseLora(), GatherLora()):
        weights = LoraWeights(ops, a, b, offsets=[0, 8, 12])
        selector = LoraSet(("x", "y", "z"), rank, ops).selector(index, torch.float32)
        results[ops.name] = weights.add_to(base.clone(), x, selector)
    expected = base.clone()
    for t, slot in enumerate(index.tolist()):
        if slot >= 0:  # each token: its own adapter's x·Aᵀ·Bᵀ, added into each part's columns
            expected[t] += torch.cat([b[p][slot] @ (a[slot, p] @ x[t]) for p in range(len(outs))])
    torch.testing.assert_close(results["dense"], expected)
    torch.testing.assert_close(results["gather"], expected)


def tiny_model(model_dir, parallel=Parallel()):
    model = build_model(
        read_config(model_dir), Placement(torch.float32, torch.device("cpu"), parallel), 64
    )
    load_weights(model, weight_files(model_dir))
    return model


def specs(lora_dirs):
    return tuple((name, str(path)) for name, path in lora_dirs.items())


def lora_delta(model, module: str, x, index):
    layer = model.get_submodule(module)
    selector = model.lora_set.selector(index, torch.float32)
    return layer.lora.add_to(torch.zeros(x.shape[0], layer.weight.shape[0]), x, selector)


def test_tensor_parallel_slices_add_up_to_the_whole_adapter(tiny_model_dirs, lora_dirs):
    model_dir = tiny_model_dirs["llama"]
    whole = tiny_model(model_dir)
    attach_adapters(whole, specs(lora_dirs), 64, DenseLora())
    ranks = [tiny_model(model_dir, Parallel(r, 2)) for r in range(2)]
    for model in ranks:
        attach_adapters(model, specs(lora_dirs), 64, DenseLora(), model.parallel)
    torch.manual_seed(0)
    index = torch.tensor([0, 1, -1, 1])
    # Row-parallel down_proj: each rank adapts its input columns; the partial deltas sum to the whole.
    x = torch.randn(4, 128)
    halves = [
        lora_delta(m, "layers.1.mlp.down_proj", x[:, 64 * r : 64 * (r + 1)], index)
        for r, m in enumerate(ranks)
    ]
    torch.testing.assert_close(
        halves[0] + halves[1], lora_delta(whole, "layers.1.mlp.down_proj", x, index)
    )
    # Column-parallel q/k/v: each rank holds its heads' rows of B (q: 64 rows in halves, k and v: 32).
    x = torch.randn(4, 64)
    full = lora_delta(whole, "layers.0.self_attn.qkv_proj", x, index)
    parts = [lora_delta(m, "layers.0.self_attn.qkv_proj", x, index) for m in ranks]
    for start, size, local in ((0, 64, 32), (64, 32, 16), (96, 32, 16)):
        local_start = start // 2
        joined = torch.cat([p[:, local_start : local_start + local] for p in parts], dim=1)
        torch.testing.assert_close(joined, full[:, start : start + size])
    assert full[2].abs().sum() == 0 and full[0].abs().sum() > 0  # the base token gets no delta


def test_missing_directory_is_refused(tmp_path):
    with pytest.raises(ModelLoadError, match=r"LoRA adapter 'x': directory .*nowhere not found"):
        read_adapter("x", tmp_path / "nowhere", 64)


def test_rank_above_the_maximum_is_refused(lora_dirs):
    with pytest.raises(
        ModelLoadError, match=r"LoRA adapter 'alpha': rank 8 exceeds --max-lora-rank 4"
    ):
        read_adapter("alpha", lora_dirs["alpha"], max_rank=4)


@pytest.fixture(scope="module")
def wider_base(tmp_path_factory, smollm_dir):
    """A tiny Llama with a narrower MLP (96, not 128): its adapters do not fit the tiny Llama."""
    return build_tiny_model(
        "llama", tmp_path_factory.mktemp("wider") / "llama", smollm_dir, intermediate_size=96
    )


def test_adapter_of_another_base_model_is_refused_naming_the_module(
    tiny_model_dirs, wider_base, tmp_path
):
    adapter = make_adapter(wider_base, tmp_path / "wide", 5, 4, 8, False, ["up_proj"])
    model = tiny_model(tiny_model_dirs["llama"])
    with pytest.raises(
        ModelLoadError,
        match=r"LoRA adapter 'wide'.*lora_B.weight has shape \(96, 4\), but module "
        r"layers.0.mlp.up_proj of the base model needs \(128, 4\); was it trained "
        r"for another base model",
    ):
        attach_adapters(model, (("wide", str(adapter)),), 64, DenseLora())


def test_adapter_of_a_deeper_model_is_refused(tiny_model_dirs, smollm_dir, tmp_path):
    deeper = build_tiny_model("llama", tmp_path / "deep", smollm_dir, num_hidden_layers=3)
    adapter = make_adapter(deeper, tmp_path / "deep-lora", 5, 4, 8, False, ["o_proj"])
    with pytest.raises(
        ModelLoadError,
        match=r"module layers.2.self_attn.o_proj is not in the base model \(2 layers\)",
    ):
        attach_adapters(
            tiny_model(tiny_model_dirs["llama"]), (("deep", str(adapter)),), 64, DenseLora()
        )


def test_unsupported_target_and_features_are_refused(tiny_model_dirs, lora_dirs, tmp_path):
    adapter = make_adapter(
        tiny_model_dirs["llama"], tmp_path / "head", 5, 4, 8, False, ["q_proj", "lm_head"]
    )
    with pytest.raises(
        ModelLoadError, match=r"tensor '[^']*lm_head[^']*' adapts a module that is not supported"
    ):
        read_adapter("head", adapter, 64)
    dora = shutil.copytree(lora_dirs["beta"], tmp_path / "dora")
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ModelLoadError, match="LoRA adapter 'dora': DoRA is not supported"):
        read_adapter("dora", dora, 64)


def test_adapter_specs_parse_and_reach_the_config(monkeypatch):
    assert parse_lora_adapters(" a=/x/a, b=rel/b ,") == (("a", "/x/a"), ("b", "rel/b"))
    assert parse_lora_adapters("org/adapter") == (
        ("org/adapter", "org/adapter"),
    )  # TGI names it by its id
    assert parse_lora_adapters(None) == ()
    with pytest.raises(ValueError, match="'a' is given twice"):
        parse_lora_adapters("a=/x,a=/y")
    with pytest.raises(ValueError, match="expected name=path"):
        parse_lora_adapters("=/x")
    with pytest.raises(ValueError, match="unknown LoRA implementation 'fast'"):
        lora_ops("fast")
    from engine.cli.main import build_parser, engine_config
    from launcher.offline_cli import add_offline_commands

    monkeypatch.setenv("LORA_ADAPTERS", "env=/e")
    args = build_parser(extra_commands=(add_offline_commands,)).parse_args(
        ["generate", "--max-new-tokens", "1"]
    )
    assert (
        engine_config(args).lora_adapters == (("env", "/e"),)
        and engine_config(args).lora_impl is None
    )
    args = build_parser().parse_args(
        ["serve", "--lora-adapters", "a=/a", "--lora-impl", "gather", "--max-lora-rank", "16"]
    )
    config = engine_config(args)
    assert (config.lora_adapters, config.lora_impl, config.max_lora_rank) == (
        (("a", "/a"),),
        "gather",
        16,
    )


def test_launcher_passes_the_adapters_to_every_shard(monkeypatch):
    from launcher.cli import build_parser, config_from_args

    args = build_parser().parse_args(["--lora-adapters", "a=/a,b=/b", "--lora-impl", "dense"])
    shard_args = config_from_args(args).shard_args()
    assert shard_args[shard_args.index("--lora-adapters") + 1] == "a=/a,b=/b"
    assert shard_args[shard_args.index("--lora-impl") + 1] == "dense"
    monkeypatch.setenv("LORA_ADAPTERS", "c=/c")
    assert "c=/c" in config_from_args(build_parser().parse_args([])).shard_args()
    monkeypatch.delenv("LORA_ADAPTERS")
    assert "--lora-adapters" not in config_from_args(build_parser().parse_args([])).shard_args()
