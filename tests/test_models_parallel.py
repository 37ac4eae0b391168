"""Tensor parallelism of the new native families with real shard processes on CPU (gloo):
two shards give transformers' tokens, as one shard does (MoE experts split on their intermediate
dimension; Gemma 2's soft-capped, sliding-window attention split by heads)."""
import pytest

from tests.family_models import family_dirs  # noqa: F401 (a fixture)
from tests.test_equivalence import PROMPTS, reference_tokens
from tests.test_tensor_parallel import NEW_TOKENS, run_sharded


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "gemma2"])
def test_two_shards_give_the_tokens_of_one(family_dirs, family):
    model_dir = family_dirs[family]
    expected = reference_tokens(model_dir, PROMPTS, NEW_TOKENS)
    tokens = run_sharded(model_dir, 2)
    assert [tokens[i] for i in range(6)] == expected


@pytest.mark.slow
@pytest.mark.parametrize("name", ["granite", "olmo2"])
def test_two_fallback_shards_give_the_tokens_of_one(tmp_path_factory, smollm_dir, name):
    """Granite's plan splits attention heads; Olmo2's gathers q/k/v (its norms span all heads)."""
    from tests.models import build_tiny_model
    from tests.test_models_fallback import FALLBACKS

    model_dir = build_tiny_model(name, tmp_path_factory.mktemp("tp") / name, smollm_dir, variants=FALLBACKS)
    expected = reference_tokens(model_dir, PROMPTS, NEW_TOKENS)
    tokens = run_sharded(model_dir, 2)
    assert [tokens[i] for i in range(6)] == expected
