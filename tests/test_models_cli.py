"""`bucketserve generate --model-id DIR --json` on a native family and on a fallback architecture
gives transformers' greedy tokens, as a user runs it."""

import json

import pytest

from launcher.cli import bucketserve
from tests.family_models import family_dirs  # noqa: F401 (a fixture)
from tests.test_equivalence import NEW_TOKENS, PROMPTS, reference_tokens
from tests.test_models_fallback import fallback_dirs, refused_model_dirs  # noqa: F401 (a fixture)


def generate_json(capsys, model_dir) -> list[dict]:
    args = [
        "generate",
        "--model-id",
        str(model_dir),
        "--max-new-tokens",
        str(NEW_TOKENS),
        "--json",
        "--block-size",
        "16",
        "--max-input-tokens",
        "128",
        "--max-total-tokens",
        "256",
        "--dtype",
        "float32",
    ]
    for prompt in PROMPTS:
        args += ["--prompt", prompt]
    capsys.readouterr()
    assert bucketserve(args) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]


@pytest.mark.slow
@pytest.mark.parametrize(
    "source, name", [("native", "gemma3"), ("native", "mixtral"), ("fallback", "starcoder2")]
)
def test_generate_json_matches_transformers(capsys, family_dirs, fallback_dirs, source, name):
    model_dir = (family_dirs if source == "native" else fallback_dirs)[name]
    answers = generate_json(capsys, model_dir)
    expected = reference_tokens(model_dir, PROMPTS, NEW_TOKENS, stop_on_eos=True)
    assert [a["prompt"] for a in answers] == PROMPTS
    assert [a["token_ids"] for a in answers] == expected


def test_launcher_passes_the_implementation_to_every_shard():
    from engine.cli.main import build_parser, engine_config
    from engine.config import EngineConfig
    from launcher.config import LauncherConfig

    engine = EngineConfig(implementation="transformers", moe_impl="gather")
    shard_args = LauncherConfig(engine=engine, uds_path="/tmp/s").shard_args()
    config = engine_config(build_parser().parse_args(["serve", *shard_args]))
    assert (config.implementation, config.moe_impl) == ("transformers", "gather")
    assert engine_config(build_parser().parse_args(["serve"])).implementation == "auto"


def test_models_we_cannot_serve_get_one_error_line(capsys, tmp_path):
    for model_dir, message in refused_model_dirs(tmp_path):
        capsys.readouterr()
        assert (
            bucketserve(
                ["generate", "--model-id", model_dir, "--prompt", "hi", "--max-new-tokens", "2"]
            )
            == 2
        )
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
