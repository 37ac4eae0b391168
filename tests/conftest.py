import pytest
import torch

from engine.config import EngineConfig, default_cache_dir
from engine.weights.loader import resolve_model_dir
from tests.models import build_tiny_model

torch.manual_seed(0)


@pytest.fixture(scope="session")
def smollm_dir():
    """The embedded model, converted to safetensors once (cached like a user's first run)."""
    return resolve_model_dir(None, default_cache_dir())


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory, smollm_dir):
    """variant -> directory of a tiny random model that shares the embedded model's tokenizer."""
    root = tmp_path_factory.mktemp("tiny")
    return {v: build_tiny_model(v, root / v, smollm_dir) for v in ("llama", "mistral", "qwen2")}


def tiny_config(model_dir, **overrides) -> EngineConfig:
    # float32: these shards are compared with transformers in float32 (--dtype auto may pick bfloat16)
    settings = dict(model_id=str(model_dir), device="cpu", dtype="float32", block_size=16, max_batch_size=8, max_input_tokens=128,
                    max_total_tokens=256, max_prefill_tokens=512, strict_shapes=True)
    return EngineConfig(**{**settings, **overrides})


def warmed_llama_shard(tiny_model_dirs) -> "Shard":
    """A warmed shard on the tiny Llama, batch size 4 (each test module builds its own)."""
    from engine.serving.shard import Shard

    shard = Shard(tiny_config(tiny_model_dirs["llama"], max_batch_size=4), show_progress=False)
    shard.warmup()
    return shard
