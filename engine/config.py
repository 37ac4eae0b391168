"""Engine configuration: one frozen dataclass, filled from the CLI.

Environment variables are read here and nowhere else.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


def default_cache_dir() -> Path:
    """Where converted models are cached: $BUCKETSERVE_CACHE, else the user's cache dir."""
    if os.environ.get("BUCKETSERVE_CACHE"):
        return Path(os.environ["BUCKETSERVE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "bucketserve"


def env_int(name: str) -> int | None:
    """An integer from the environment (TGI's launcher sets e.g. MAX_BATCH_SIZE), or None."""
    value = os.environ.get(name)
    return int(value) if value else None


def distributed_address() -> tuple[str, int]:
    """Where rank 0 of a shard group listens: MASTER_ADDR and MASTER_PORT, as the launcher sets them."""
    return os.environ.get("MASTER_ADDR", "127.0.0.1"), env_int("MASTER_PORT") or 29500


def parse_lora_adapters(text: str | None) -> tuple[tuple[str, str], ...]:
    """`name=path[,name=path...]` (--lora-adapters, or TGI's LORA_ADAPTERS) as (name, path) pairs.
    A bare `path` is served under that same string, as TGI names an adapter by its id."""
    pairs = []
    for entry in filter(None, (part.strip() for part in (text or "").split(","))):
        name, _, path = entry.partition("=") if "=" in entry else (entry, "", entry)
        name, path = name.strip(), path.strip()
        if not name or not path:
            raise ValueError(f"LoRA adapter {entry!r}: expected name=path")
        if name in dict(pairs):
            raise ValueError(f"LoRA adapter name {name!r} is given twice")
        pairs.append((name, path))
    return tuple(pairs)


def env_lora_adapters() -> str | None:
    """TGI's LORA_ADAPTERS, the default of --lora-adapters."""
    return os.environ.get("LORA_ADAPTERS") or None


WARMUP_MODES = ("full", "progressive", "none")  # engine/warmup/run.py


@dataclass(frozen=True)
class ServingLimits:
    """What a batch may hold: the shard plans and warms its buckets for these, and the router's
    scheduler admits requests under the same ones."""
    max_batch_size: int
    max_prefill_tokens: int
    max_input_tokens: int
    max_total_tokens: int
    max_concurrent_requests: int = 128  # router only: queued + running; beyond it a submit is refused (HTTP 429)


@dataclass(frozen=True)
class EngineConfig:
    model_id: str | None = None          # None: the embedded SmolLM2-135M-Instruct
    device: str = "cpu"
    dtype: str | None = None             # None or "auto": the device's (cpu: bfloat16 where it has AVX512-BF16/AMX)
    quantize: str = "none"               # none | int8 | int4 | fp8 (engine/weights/quantize.py)
    block_size: int | None = None        # None: the device's preferred KV block size
    max_batch_size: int = 32
    max_input_tokens: int = 1024
    max_total_tokens: int = 2048
    max_prefill_tokens: int = 4096
    bucket_strategy: str = "exponential"  # linear | exponential | padding | file | fitted (engine/buckets/plan.py)
    bucket_shapes: str | None = None     # fitted: the JSONL trace of batch shapes to fit
    bucket_file: str | None = None       # file: JSON of the buckets
    max_graphs: int | None = None        # fitted: graph budget; None: the exponential plan's count
    warmup_mode: str = "full"            # full | progressive | none (engine/warmup/run.py)
    warmup_profile: str | None = None    # profile.json of `engine warmup-profile`: its buckets and latencies
    record_shapes: str | None = None     # append the batch shapes served to this JSONL file
    graph_mode: str | None = None        # None: the device's (graphs on hpu and cuda, eager elsewhere)
    strict_shapes: bool = True           # a forward at an unwarmed shape raises
    warmup_prompt_logprobs: bool = True  # also warm the prefill variant behind prefill_logprobs
    kv_cache_memory_fraction: float = 0.9
    graph_memory_fraction: float = 0.1   # of that, kept for device graphs where they are captured
    cache_dir: Path | None = None        # None: default_cache_dir()
    seed: int = 0
    lora_adapters: tuple[tuple[str, str], ...] = ()  # (name, directory) of each PEFT LoRA adapter served
    lora_impl: str | None = None         # "dense" or "gather"; None: the device's default_lora_impl
    max_lora_rank: int = 64              # adapters of a higher rank are refused at load
    implementation: str = "auto"         # auto, native or transformers (engine/models/fallback.py)
    moe_impl: str | None = None          # MoE experts, "dense" or "gather"; None: the device's default_moe_impl
    prefix_caching: bool = True          # serve prefills that continue cached KV (cache_len); warms context buckets

    @property
    def resolved_cache_dir(self) -> Path:
        return self.cache_dir or default_cache_dir()


DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}


def torch_dtype(name: str | None, default):
    """The torch dtype for a CLI name, or `default` (the device's automatic choice) for auto or none."""
    import torch

    if name is None or name == "auto":
        return default
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r} (choose from auto, float32, bfloat16, float16)")
    return getattr(torch, DTYPES[name])
