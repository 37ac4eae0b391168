"""The version floors pyproject.toml states are the real minimums (finding 12)."""

import re
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parent.parent


def floors() -> dict[str, tuple[int, ...]]:
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    out = {}
    for spec in dependencies:
        found = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9.]+).*", spec.split(";")[0].strip())
        if found:
            out[found.group(1)] = tuple(int(p) for p in found.group(2).split("."))
    return out


def test_torch_floor_covers_enable_gqa():
    # engine/attention/prompt.py calls scaled_dot_product_attention(enable_gqa=...), new in torch 2.5.
    assert "enable_gqa" in (REPO / "engine" / "attention" / "prompt.py").read_text()
    assert floors()["torch"] >= (2, 5)


def test_transformers_floor_covers_the_dtype_argument():
    # scripts/gpu_check.py passes from_pretrained(dtype=...), accepted from transformers 4.56.
    assert "dtype=" in (REPO / "scripts" / "gpu_check.py").read_text()
    assert floors()["transformers"] >= (4, 56)
