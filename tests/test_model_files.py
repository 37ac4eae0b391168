"""The conversion cache keyed by a GGUF file's content (one copy per model, `bucketserve cache
list|clear`), and the one clear error for a truncated or corrupt GGUF or safetensors file."""

import shutil

import pytest
import torch

from engine.errors import CorruptFileError
from engine.weights import loader, paths
from engine.weights.integrity import read_gguf_index as read_index
from engine.weights.placement import Placement
from launcher.cli import bucketserve

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def remove_model_copies(tmp_path):
    """The copies of the 98 MB embedded GGUF go when each test ends (pytest keeps its tmp_paths)."""
    yield
    for copy in tmp_path.rglob("*.gguf"):
        copy.unlink()


@pytest.fixture
def fake_conversion(monkeypatch):
    """Conversions without transformers (seconds each): a config.json; the GGUF files converted."""
    converted = []

    def write(gguf, out):
        converted.append(gguf)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(paths, "_write_hf_dir", write)
    return converted


def gguf_copy(tmp_path, name: str, edit=None):
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(loader.embedded_gguf_path(), path)
    if edit:
        data = bytearray(path.read_bytes())
        edit(data)
        path.write_bytes(data)
    return path


def run_cache(capsys, *argv) -> tuple[int, str, str]:
    code = bucketserve(["cache", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_copies_of_one_gguf_share_one_cache_entry(tmp_path, fake_conversion):
    cache = tmp_path / "cache"
    first, second = gguf_copy(tmp_path, "a/model.gguf"), gguf_copy(tmp_path, "b/other-name.gguf")
    entry = loader.resolve_model_dir(str(first), cache)
    assert loader.resolve_model_dir(str(second), cache) == entry
    assert fake_conversion == [first] and len(list((cache / "models").iterdir())) == 1


def test_a_changed_file_gets_a_new_entry_and_its_old_content_the_old_one(tmp_path, fake_conversion):
    cache = tmp_path / "cache"
    original = loader.resolve_model_dir(str(gguf_copy(tmp_path, "a/model.gguf")), cache)

    def rename_model(data):  # same size, one metadata value (general.name) changed
        at = data.index(b"Smollm2 135M")
        data[at : at + 7] = b"Smollm3"

    changed = gguf_copy(tmp_path, "a/model.gguf", rename_model)  # the same path, new content
    assert loader.resolve_model_dir(str(changed), cache) != original
    assert len(fake_conversion) == 2 and len(list((cache / "models").iterdir())) == 2
    restored = gguf_copy(tmp_path, "a/model.gguf")  # the first content again, written anew
    assert loader.resolve_model_dir(str(restored), cache) == original and len(fake_conversion) == 2


def test_an_unchanged_file_is_read_once_per_process(tmp_path, fake_conversion, monkeypatch):
    """Its header and tensor index are read again only when the file changes (size, times, inode)."""
    reads = []
    monkeypatch.setattr(paths, "_content_keys", {})
    monkeypatch.setattr(paths, "read_gguf_index", lambda p: reads.append(p) or read_index(p))
    cache, gguf = tmp_path / "cache", gguf_copy(tmp_path, "a/model.gguf")
    entry = loader.resolve_model_dir(str(gguf), cache)
    assert loader.resolve_model_dir(str(gguf), cache) == entry and len(reads) == 1
    rewritten = gguf_copy(tmp_path, "a/model.gguf")  # the same content, written anew
    assert loader.resolve_model_dir(str(rewritten), cache) == entry and len(reads) == 2


def test_cache_list_and_clear(tmp_path, fake_conversion, capsys):
    cache = tmp_path / "cache"
    first, second = gguf_copy(tmp_path, "a/model.gguf"), gguf_copy(tmp_path, "b/model.gguf")
    shared = loader.resolve_model_dir(str(first), cache)
    loader.resolve_model_dir(str(second), cache)
    other = loader.resolve_model_dir(
        str(gguf_copy(tmp_path, "c/model.gguf", lambda d: d.extend(b"\0" * 32))), cache
    )
    code, out, _ = run_cache(capsys, "list", "--cache-dir", str(cache))
    lines = out.splitlines()
    assert code == 0 and len(lines) == 3 and lines[-1].startswith("2 cached")
    listed = next(line for line in lines if line.startswith(shared.name))
    assert f"{first}, {second}" in listed and " MB " in listed

    code, out, _ = run_cache(
        capsys, "clear", str(second), "--cache-dir", str(cache)
    )  # one, by a source
    assert (
        code == 0
        and out.startswith(f"removed {shared.name}")
        and not shared.exists()
        and other.exists()
    )
    code, _, err = run_cache(capsys, "clear", "no-such-entry", "--cache-dir", str(cache))
    assert (
        code == 2
        and err == "error: no cached model 'no-such-entry' (see `bucketserve cache list`)\n"
    )
    code, out, _ = run_cache(capsys, "clear", "--cache-dir", str(cache))  # all
    assert code == 0 and out.startswith(f"removed {other.name}") and not other.exists()
    code, out, _ = run_cache(capsys, "list", "--cache-dir", str(cache))
    assert code == 0 and out.startswith("no cached models")


def truncated(tmp_path, source, name, keep):
    data = source.read_bytes()
    path = tmp_path / name
    path.write_bytes(data[: keep(len(data))])
    return path


@pytest.mark.parametrize(
    "keep",
    [lambda n: 100_000, lambda n: n // 2, lambda n: n - 1],
    ids=["in the header", "half", "one byte short"],
)
def test_a_truncated_gguf_names_the_file(tmp_path, keep):
    bad = truncated(tmp_path, loader.embedded_gguf_path(), "model.gguf", keep)
    with pytest.raises(
        CorruptFileError, match=f"^cannot read GGUF file {bad}: it is truncated or corrupt"
    ):
        loader.load(str(bad), tmp_path / "cache", Placement(torch.float32, CPU))
    assert not (tmp_path / "cache" / "models").exists() or not any(
        (tmp_path / "cache" / "models").iterdir()
    )


def test_a_garbage_gguf_names_the_file(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a model at all\n" * 1000)
    with pytest.raises(
        CorruptFileError,
        match=f"^cannot read GGUF file {bad}: .*does not start with the GGUF magic",
    ):
        loader.resolve_model_dir(str(bad), tmp_path / "cache")


def model_dir_with(tiny_model_dirs, tmp_path, weights: bytes):
    model_dir = shutil.copytree(tiny_model_dirs["llama"], tmp_path / "m")
    (model_dir / "model.safetensors").write_bytes(weights)
    return model_dir


@pytest.mark.parametrize("implementation", ["native", "transformers"])
def test_a_truncated_safetensors_file_names_the_file(tiny_model_dirs, tmp_path, implementation):
    whole = (tiny_model_dirs["llama"] / "model.safetensors").read_bytes()
    model_dir = model_dir_with(tiny_model_dirs, tmp_path, whole[: len(whole) // 2])
    with pytest.raises(
        CorruptFileError,
        match=f"^weight file {model_dir / 'model.safetensors'} is corrupt or "
        "unreadable: truncated: its header places tensor data up to byte",
    ):
        loader.load(
            str(model_dir), tmp_path, Placement(torch.float32, CPU), implementation=implementation
        )


def test_a_garbage_safetensors_file_names_the_file(tiny_model_dirs, tmp_path):
    model_dir = model_dir_with(tiny_model_dirs, tmp_path, b"\x89PNG not weights" * 100)
    with pytest.raises(
        CorruptFileError,
        match=f"^weight file {model_dir / 'model.safetensors'} is corrupt or "
        "unreadable: not a safetensors file",
    ):
        loader.load(str(model_dir), tmp_path, Placement(torch.float32, CPU))


def test_the_command_line_prints_one_error_line(tmp_path, capsys):
    bad = truncated(tmp_path, loader.embedded_gguf_path(), "model.gguf", lambda n: n // 2)
    code = bucketserve(
        [
            "generate",
            "--model-id",
            str(bad),
            "--cache-dir",
            str(tmp_path / "cache"),
            "--prompt",
            "Hi",
            "--max-new-tokens",
            "2",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(
        f"error: cannot read GGUF file {bad}: it is truncated or corrupt (its tensor index"
    )
