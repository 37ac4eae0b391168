"""The conversion cache: each GGUF file is converted to safetensors once, under a key of its
content (its size, and a hash of its header, its tensor index and a sample of its data), so that
copies of one model at other paths, checkouts or virtual environments share one entry.
Reading the key costs the header's few megabytes, never the whole file.

An entry is a directory `CACHE/models/STEM-KEY` holding the converted model and SOURCES_FILE, the
GGUF paths it was converted from or reused for (what `bucketserve cache list` shows).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # `bucketserve cache` imports this module, and should not wait for torch
    from engine.weights.integrity import GgufIndex

MODELS_DIR = "models"
SOURCES_FILE = "bucketserve_sources.json"
DATA_SAMPLE = 1 << 20  # bytes hashed from each end of the tensor data
SCRATCH_PREFIX = ".convert-"


@dataclass(frozen=True)
class CacheEntry:
    path: Path
    sources: tuple[str, ...]  # empty for an entry written before sources were recorded
    size: int  # bytes on disk

    @property
    def name(self) -> str:
        return self.path.name


def content_key(index: GgufIndex) -> str:
    digest = hashlib.sha256(f"{index.size}:".encode())
    with open(index.path, "rb") as file:
        digest.update(file.read(index.data_offset))
        digest.update(file.read(DATA_SAMPLE))
        file.seek(max(index.data_offset, index.size - DATA_SAMPLE))
        digest.update(file.read(DATA_SAMPLE))
    return digest.hexdigest()[:16]


def models_dir(cache_dir: Path) -> Path:
    return Path(cache_dir) / MODELS_DIR


def find_entry(cache_dir: Path, key: str) -> Path | None:
    """The converted model with this content key, whatever file name it was converted from."""
    for path in sorted(models_dir(cache_dir).glob(f"*-{key}")):
        if (path / "config.json").is_file():
            return path
    return None


def entry_path(cache_dir: Path, gguf: Path, key: str) -> Path:
    return models_dir(cache_dir) / f"{gguf.stem}-{key}"


def record_source(entry: Path, gguf: Path) -> None:
    """Add `gguf`'s absolute path to the entry's sources (atomically; a read-only cache is left
    as it is)."""
    sources = _sources(entry)
    source = str(Path(gguf).resolve())
    if source in sources:
        return
    try:
        fd, scratch = tempfile.mkstemp(dir=entry, prefix=".sources-")
        with os.fdopen(fd, "w") as file:
            json.dump({"sources": [*sources, source]}, file, indent=1)
        os.replace(scratch, entry / SOURCES_FILE)
    except OSError:
        pass


def _sources(entry: Path) -> list[str]:
    try:
        return list(json.loads((entry / SOURCES_FILE).read_text())["sources"])
    except (OSError, ValueError, KeyError, TypeError):
        return []


def _disk_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def list_entries(cache_dir: Path) -> list[CacheEntry]:
    """Every converted model in the cache (unfinished conversions left by a crash included)."""
    root = models_dir(cache_dir)
    if not root.is_dir():
        return []
    return [
        CacheEntry(path, tuple(_sources(path)), _disk_size(path))
        for path in sorted(root.iterdir())
        if path.is_dir()
    ]


def matching(entries: list[CacheEntry], which: str) -> list[CacheEntry]:
    """The entries `which` names: by directory name, or by a source GGUF path."""
    source = str(Path(which).resolve())
    return [e for e in entries if which in (e.name, str(e.path)) or source in e.sources]


def remove(entry: CacheEntry) -> None:
    shutil.rmtree(entry.path)
