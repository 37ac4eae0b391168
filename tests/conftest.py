import pytest
import torch

from engine.config import default_cache_dir
from engine.weights.loader import resolve_model_dir
from tests.helpers import tiny_config, warmed_llama_shard  # noqa: F401 - re-exported
from tests.isa_levels import isa_level, kernels_at  # noqa: F401 - fixtures of every file
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


@pytest.fixture(scope="session")
def tiny_llava_dir(tmp_path_factory, smollm_dir):
    """A tiny random LLaVA sharing the embedded model's tokenizer (plus `<image>`)."""
    from tests.vision_models import build_tiny_llava

    return build_tiny_llava(tmp_path_factory.mktemp("llava"), smollm_dir)
