"""The router process does not import the model stack: it finds its tokenizer through the torch-free
engine/weights/paths.py. Each check runs in a fresh interpreter, where nothing is imported yet."""

import subprocess
import sys
from pathlib import Path

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

# transformers 5 imports torch for AutoTokenizer (transformers/configuration_utils.py); a stand-in
# shows that nothing else the router imports does.
STUB_TRANSFORMERS = """
import sys, types
stub = types.ModuleType("transformers")
stub.AutoTokenizer = object
sys.modules["transformers"] = stub
"""


def imported_after(code: str) -> set[str]:
    check = code + "\nimport router.app, sys\nprint('\\n'.join(sys.modules))"
    result = subprocess.run(
        [sys.executable, "-c", check],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parent.parent,
    )
    return set(result.stdout.split())


def test_router_app_imports_none_of_the_model_stack():
    modules = imported_after("")
    loaded = sorted(m for m in modules if m.startswith(MODEL_STACK))
    assert loaded == []
    assert "engine.weights.paths" in modules


def test_router_app_imports_torch_only_through_transformers():
    assert "torch" not in imported_after(STUB_TRANSFORMERS)
