"""The `bucketserve generate|bench` commands as a user runs them (`python -m launcher` is the same command)."""

import json
import subprocess
import sys

import pytest

from launcher.cli import bucketserve as main


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "launcher", *args], capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
def test_generate_chat_answers_from_the_embedded_model():
    result = run_cli(
        "generate",
        "--prompt",
        "What is the capital of France?",
        "--chat",
        "--max-new-tokens",
        "20",
        "--json",
    )
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout.strip())
    assert answer["prompt"] == "What is the capital of France?"
    assert "Paris" in answer["text"] and 0 < len(answer["token_ids"]) <= 20


@pytest.mark.slow
def test_prompt_over_the_input_limit_is_a_one_line_error():
    result = run_cli(
        "generate",
        "--prompt",
        ("word " * 100).strip(),
        "--max-input-tokens",
        "32",
        "--max-new-tokens",
        "4",
    )
    assert result.returncode == 2
    assert "error: a prompt of 100 tokens exceeds --max-input-tokens 32" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompt", "hi", "--max-new-tokens", "0"], "max_new_tokens must be at least 1, got 0"),
        (
            ["--prompt", "hi", "--max-new-tokens", "2", "--model-id", "/no/such/model"],
            "model '/no/such/model' not found",
        ),
        (["--max-new-tokens", "2"], "no prompt"),
        (
            ["--prompt", "hi", "--max-new-tokens", "2", "--dtype", "float8"],
            "unknown dtype 'float8'",
        ),
    ],
)
def test_bad_input_is_a_clear_error(capsys, args, message):
    assert exit_code(["generate", *args]) == 2
    assert message in capsys.readouterr().err


def exit_code(args: list[str]) -> int:
    """The command's exit status, whether it returned it or its flag parser exited with it."""
    try:
        return main(args)
    except SystemExit as stop:
        return stop.code


def test_unsupported_architecture_from_the_cli(capsys, tiny_model_dirs, tmp_path):
    import shutil

    model_dir = shutil.copytree(tiny_model_dirs["llama"], tmp_path / "m")
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["FalconForCausalLM"]
    (model_dir / "config.json").write_text(json.dumps(config))
    assert (
        main(
            [
                "generate",
                "--model-id",
                str(model_dir),
                "--prompt",
                "hi",
                "--max-new-tokens",
                "2",
                "--implementation",
                "native",
            ]
        )
        == 2
    )
    assert (
        "architecture 'FalconForCausalLM' is not supported (supported: Gemma2ForCausalLM"
        in capsys.readouterr().err
    )


def test_prompts_file_gives_one_json_line_per_prompt(capsys, tiny_model_dirs, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Hello there"}\n\n{"prompt": "The sky is"}\n')
    code = main(
        [
            "generate",
            "--model-id",
            str(tiny_model_dirs["qwen2"]),
            "--prompts-file",
            str(prompts),
            "--max-new-tokens",
            "3",
            "--json",
            "--block-size",
            "16",
        ]
    )
    assert code == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["prompt"] for line in lines] == ["Hello there", "The sky is"]
    assert all(len(line["token_ids"]) <= 3 and isinstance(line["text"], str) for line in lines)


def test_malformed_prompts_file_names_the_line(capsys, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "ok"}\n{"text": "wrong key"}\n')
    assert main(["generate", "--prompts-file", str(prompts), "--max-new-tokens", "2"]) == 2
    assert f"{prompts}:2: expected" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_runs_both_engines_and_prints_the_ratio():
    result = run_cli(
        "bench",
        "--compare",
        "transformers",
        "--num-prompts",
        "3",
        "--max-tokens",
        "24",
        "--new-tokens",
        "6",
        "--min-new-tokens",
        "2",
        "--repeat",
        "1",
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("workload: 3 prompts of 16-24 tokens")
    assert "2-6 new tokens each (12 in all)" in lines[0]
    assert lines[1].startswith("bucketserve:  12 tokens in ")  # 2 + 4 + 6 tokens, eos ignored
    assert lines[2].startswith("transformers: 12 tokens in ")
    assert lines[3].startswith("ratio: ") and lines[3].endswith("x transformers")


def test_bench_output_lengths_spread_evenly_and_mix_with_prompt_lengths():
    from launcher.bench import Workload

    lengths = Workload(num_prompts=32, new_tokens=128, min_new_tokens=16).output_lengths()
    assert sorted(lengths) == [16 + 112 * i // 31 for i in range(32)]
    assert lengths != sorted(lengths)  # not ordered like the prompts, which grow with i
    assert Workload(num_prompts=4, new_tokens=9, min_new_tokens=9).output_lengths() == [9] * 4


def test_generate_has_a_documented_max_new_tokens_default(capsys):
    from engine.cli.main import build_parser
    from launcher.offline_cli import DEFAULT_MAX_NEW_TOKENS, add_offline_commands

    args = build_parser(extra_commands=(add_offline_commands,)).parse_args(
        ["generate", "--prompt", "hi"]
    )
    assert args.max_new_tokens == DEFAULT_MAX_NEW_TOKENS == 64
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert "(default: 64)" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--prompt", "hi", "--max-new-tokens", "many"],
        ["generate", "--prompt", "hi", "--no-such-flag"],
        ["generate", "--prompt", "hi", "--device"],
        ["bench", "--num-prompts", "x"],
        ["bench", "--compare", "vllm"],
        ["serve", "--prefix-caching", "maybe"],
        ["buckets", "--max-batch-size", "-"],
        ["warmup-profile"],
    ],
    ids=[
        "generate-int",
        "generate-unknown",
        "generate-missing-value",
        "bench-int",
        "bench-choice",
        "serve-choice",
        "buckets-int",
        "warmup-profile-required",
    ],
)
def test_every_argument_error_is_one_error_line(capsys, argv):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err


def test_generate_without_max_new_tokens_generates_up_to_the_default(tiny_model_dirs):
    result = run_cli(
        "generate", "--model-id", str(tiny_model_dirs["llama"]), "--prompt", "hi", "--json"
    )
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    assert 0 < len(answer["token_ids"]) <= 64
    assert answer["finish_reason"] != "length" or len(answer["token_ids"]) == 64
