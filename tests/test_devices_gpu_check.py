"""scripts/gpu_check.py's logic on CPU with a tiny model (the H200 run uses the same code at full size)."""

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.py"


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_cpu_path_matches_transformers_and_prints_one_summary_line(capsys):
    code = load_script().main(
        ["--device", "cpu", "--tiny", "--prompts", "6", "--new-tokens", "8", "--longest", "32"]
    )
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert code == 0 and last.startswith(
        "GPU_CHECK PASS device=cpu model=tiny fp32_greedy_equal=6/6 "
    ), last
    assert " unwarmed=0 " in last and "speedup=" in last


def test_the_id_tokenizer_maps_words_to_exactly_their_ids(tmp_path):
    from transformers import AutoTokenizer

    script = load_script()
    script.save_id_tokenizer(tmp_path, 300, bos=1, eos=2)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    ids = [17, 3, 10, 299, 100]
    assert tokenizer(script.as_text(ids), add_special_tokens=False)["input_ids"] == ids
    assert all(1 not in p and 2 not in p for p in script.prompt_ids(20, 1, 30, 300, seed=0))
