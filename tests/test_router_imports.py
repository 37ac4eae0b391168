"""The router process does not import the model stack: it finds its tokenizer through the torch-free
engine/weights/paths.py. Each check runs in a fresh interpreter, where nothing is imported yet."""

import subprocess
import sys
from pathlib import Path

import pytest

# Packages of the shard's model stack, each of which imports torch.
MODEL_STACK = (
    "engine.weights.loader",
    "engine.models",
    "engine.layers",
    "engine.attention",
    "engine.devices",
    "engine.serving.shard",
    "engine.runner",
)


def imported_after(module: str = "router.app") -> set[str]:
    check = f"import {module}, sys\nprint('\\n'.join(sys.modules))"
    result = subprocess.run(
        [sys.executable, "-c", check],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parent.parent,
    )
    return set(result.stdout.split())


def test_router_app_imports_none_of_the_model_stack():
    modules = imported_after()
    loaded = sorted(m for m in modules if m.startswith(MODEL_STACK))
    assert loaded == []
    assert "engine.weights.paths" in modules


@pytest.mark.parametrize("module", ["router.app", "router.__main__"])
def test_the_router_does_not_import_torch(module):
    # transformers 5 imports torch for AutoTokenizer (transformers/configuration_utils.py): the
    # router imports it only when it loads the tokenizer (router/app.py load_tokenizer).
    modules = imported_after(module)
    assert "torch" not in modules
    assert "transformers" not in modules
