"""Engine configuration: frozen dataclasses whose fields are the knobs, each with its flag, default
and help (`knob`); engine/cli/flags.py builds the command lines from them.

Environment variables are read here (and, for the knobs that name one, in engine/cli/flags.py)
and nowhere else.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any


def default_cache_dir() -> Path:
    """Where converted models are cached: $BUCKETSERVE_CACHE, else the user's cache dir."""
    if os.environ.get("BUCKETSERVE_CACHE"):
        return Path(os.environ["BUCKETSERVE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "bucketserve"


def env_int(name: str) -> int | None:
    """An integer from the environment (TGI's launcher sets e.g. RANK, WORLD_SIZE), or None."""
    value = os.environ.get(name)
    return int(value) if value else None


def distributed_address() -> tuple[str, int]:
    """Where rank 0 of a shard group listens: MASTER_ADDR and MASTER_PORT, as the launcher sets
    them."""
    return os.environ.get("MASTER_ADDR", "127.0.0.1"), env_int("MASTER_PORT") or 29500


def node_environment() -> dict[str, int | None]:
    """This process's place in a multi-node group, as the launcher sets it (torchrun's names)."""
    return {
        "local_rank": env_int("LOCAL_RANK"),
        "local_world_size": env_int("LOCAL_WORLD_SIZE"),
        "node_rank": env_int("GROUP_RANK"),
    }


SHARD_SECRET_VARIABLE = "BUCKETSERVE_SHARD_SECRET"


def shard_secret() -> str | None:
    """A multi-node group's shard secret (docs/multinode.md): the launcher's --shard-secret,
    passed to its shards and router in the environment, never on a command line."""
    return os.environ.get(SHARD_SECRET_VARIABLE) or None


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


def format_lora_adapters(pairs: tuple[tuple[str, str], ...]) -> str:
    """The inverse of parse_lora_adapters: what the launcher gives each shard and the router."""
    return ",".join(name if name == path else f"{name}={path}" for name, path in pairs)


# --- knobs: one dataclass field each --------------------------------------------------------------


def knob(
    default: Any = MISSING,
    help: str = "",
    *,
    flags: tuple[str, ...] = (),
    choices: tuple | Callable[[], tuple] | None = None,
    env: str | None = None,
    parse: Callable[[str], Any] | None = None,
    text: Callable[[Any], str] | None = None,
    switch: bool = False,
    repeat: bool = False,
    secret: bool = False,
    required: bool = False,
    metavar: str | None = None,
):
    """A configuration field that carries its own command-line flag (engine/cli/flags.py builds the
    parsers of the engine, the router and the launcher from these, and passes them on).

    flags: the flag's spellings, the first one canonical (default: --field-name); choices: the
    values allowed (a function, to import them lazily); env: a variable (TGI's) whose value is the
    default when it is set; parse / text: the flag's text to the value and back (bool fields are
    `on|off`, or with `switch` a flag without a value); repeat: the flag may be given several times
    (each may hold a comma-separated list) into a tuple; secret: never passed on a command line,
    only in `env`; required: the command line must give it."""
    meta = {
        "help": help,
        "flags": tuple(flags),
        "choices": choices,
        "env": env,
        "parse": parse,
        "text": text,
        "switch": switch,
        "repeat": repeat,
        "secret": secret,
        "required": required,
        "metavar": metavar,
    }
    return field(default=default, metadata={"knob": meta})


def nested(cls, **defaults):
    """A field that holds another knob dataclass (its flags are flattened into the parent's);
    `defaults` override some of its fields' defaults in this place."""
    factory = (lambda: cls(**defaults)) if defaults else cls
    return field(default_factory=factory, metadata={"nested": cls})


def _strategies() -> tuple[str, ...]:
    from engine.buckets.plan import ALL_STRATEGIES  # the planner owns its names

    return ALL_STRATEGIES


WARMUP_MODES = ("full", "progressive", "none")  # engine/warmup/run.py
SPECULATORS = ("ngram", "draft", "eagle3")  # engine/speculative/: the proposers built so far
MAX_SPECULATIVE_TOKENS = 16


def speculative_tokens(text: str) -> int:
    """--num-speculative-tokens: 1..16 proposed tokens per row and step (each is a verify width)."""

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not 1 <= value <= MAX_SPECULATIVE_TOKENS:
        raise argparse.ArgumentTypeError(
            f"must be between 1 and {MAX_SPECULATIVE_TOKENS}, got {value}"
        )
    return value


QUANTIZE_MODES = ("none", "int8", "int4", "fp8")
DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
}


def dtype_name(text: str) -> str:
    """--dtype's value, checked where the flag is parsed: a bad one is one line at launch."""
    if text != "auto" and text not in DTYPES:
        raise argparse.ArgumentTypeError(
            f"unknown dtype {text!r} (choose from auto, float32, bfloat16, float16)"
        )
    return text


@dataclass(frozen=True)
class ServingLimits:
    """What a batch may hold: the shard plans and warms its buckets for these, and the router's
    scheduler admits requests under the same ones."""

    max_batch_size: int
    max_prefill_tokens: int
    max_input_tokens: int
    max_total_tokens: int
    # router only: queued + running; beyond it a submit is refused (HTTP 429)
    max_concurrent_requests: int = 128


@dataclass(frozen=True, kw_only=True)
class SharedKnobs:
    """The knobs that the shards and the router both read: one field each, so `engine serve`,
    `python -m router` and the launcher (which passes it to both) have one flag, one default and
    one help for it."""

    model_id: str | None = knob(
        None, "HF model directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)"
    )
    cache_dir: Path | None = knob(
        None,
        "where converted models are cached (default: "
        "$BUCKETSERVE_CACHE, else ~/.cache/bucketserve)",
        parse=Path,
    )
    max_batch_size: int = knob(
        32,
        "the most requests in one batch (default: $MAX_BATCH_SIZE, as "
        "TGI's launcher sets it, else 32)",
        env="MAX_BATCH_SIZE",
    )
    max_input_tokens: int = knob(1024, "the longest prompt in tokens")
    max_total_tokens: int = knob(2048, "the longest prompt plus generation in tokens")
    max_prefill_tokens: int = knob(
        4096,
        "the most prompt tokens one prefill batch holds",
        flags=("--max-batch-prefill-tokens", "--max-prefill-tokens"),
    )
    prefix_caching: bool = knob(
        True,
        "on (default): prefills may continue KV already in the cache "
        "(prefix-cache hits, later chunks of a long prompt): the shards "
        "warm context buckets for them and the router reuses the KV "
        "blocks of cached prompt prefixes",
    )
    lora_adapters: tuple[tuple[str, str], ...] = knob(
        (),
        "PEFT LoRA adapters to serve, name=dir[,name=dir...]; a request picks one by "
        "adapter_id or OpenAI `model` (default: $LORA_ADAPTERS)",
        env="LORA_ADAPTERS",
        parse=parse_lora_adapters,
        text=format_lora_adapters,
    )
    speculate: str | None = knob(
        None,
        "speculative decoding: ngram proposes the tokens that followed the latest "
        "n-gram earlier in the prompt or output, draft a smaller model's guesses "
        "(--draft-model), eagle3 an EAGLE-3 head's over the target's hidden states "
        "(--draft-model DIR), verified in one forward (default: off)",
        choices=SPECULATORS,
    )
    num_speculative_tokens: int = knob(
        4,
        f"with --speculate: the most tokens proposed per sequence and step (1 to "
        f"{MAX_SPECULATIVE_TOKENS}; the verify buckets are K + 1 tokens wide)",
        parse=speculative_tokens,
        metavar="K",
    )
    otlp_endpoint: str | None = knob(
        None,
        "send OpenTelemetry spans to this OTLP gRPC collector, "
        "e.g. http://localhost:4317: the router's request spans "
        "and, nested under them, the shards' step spans (default: "
        "no tracing)",
    )


@dataclass(frozen=True, kw_only=True)
class EngineConfig(SharedKnobs):
    """One shard's configuration (`engine serve`, and the offline `generate` / `bench`)."""

    device: str = knob(
        "auto",
        "auto (default): hpu, else cuda/rocm, else xpu, whichever is present "
        "and supported; else cpu; or cpu, cuda, hpu, xpu",
        metavar="DEVICE",
    )
    dtype: str = knob(
        "auto",
        "auto (default: cpu: bfloat16 where it has AVX512-BF16 or AMX, else "
        "float32; accelerators: their default), float32, bfloat16 or float16",
        parse=dtype_name,
    )
    quantize: str = knob(
        "none",
        "weight-only int8 (per channel) or int4 (group 32; GGUF Q4_0/Q4_1 as "
        "stored) on CPU; fp8: a pre-quantized FP8 checkpoint (engine/weights/"
        "quantize.py)",
        choices=QUANTIZE_MODES,
    )
    draft_model: str | None = knob(
        None,
        "with --speculate draft: the draft model, a smaller causal LM with the target's "
        "tokenizer (HF directory or .gguf file; the target's dtype); with --speculate "
        "eagle3: the EAGLE-3 head's HF directory",
    )
    draft_quantize: str = knob(
        "none", "the draft model's weights, as --quantize for the target", choices=QUANTIZE_MODES
    )
    block_size: int | None = knob(None, "KV cache block size in tokens (default: the device's)")
    bucket_strategy: str = knob(
        "exponential", "how buckets are planned (engine/buckets/plan.py)", choices=_strategies
    )
    bucket_shapes: str | None = knob(
        None, "fitted: JSONL trace of batch shapes to fit (from --record-shapes)"
    )
    bucket_file: str | None = knob(
        None, 'file: JSON {"prefill_buckets": [[bs, seq], ...], "decode_buckets": [...]}'
    )
    max_graphs: int | None = knob(
        None, "fitted: graph budget (default: the exponential plan's count)"
    )
    warmup_mode: str = knob(
        "full",
        "full (default); progressive: healthy after a covering set, the "
        "rest in the background; none: no warmup, every shape eager "
        "(debugging only)",
        flags=("--warmup",),
        choices=WARMUP_MODES,
    )
    warmup_profile: str | None = knob(
        None,
        "profile.json of `warmup-profile`: warm exactly its "
        "buckets and choose buckets by its measured latencies",
    )
    record_shapes: str | None = knob(
        None, "append the batch shapes served to this JSONL file (rank 0)"
    )
    graph_mode: str | None = knob(
        None,
        "default: the device's (hpu: graphs or lazy or compile; cuda: "
        "graphs or eager or compile; xpu, cpu: eager or compile)",
        choices=("eager", "graphs", "lazy", "compile"),
    )
    strict_shapes: bool = knob(
        True,
        "on (default): a forward at an unwarmed shape raises (with --simulate: also a step that "
        "would compile a new device graph)",
    )
    simulate: str | None = knob(
        None,
        "hpu: on the CPU, plan and pad as the HPU adapter does and count the lazy-mode graph "
        "compiles and breaks each step would cause; float64 is refused (docs/devices.md)",
        choices=("hpu",),
    )
    warmup_prompt_logprobs: bool = knob(
        True, "on (default): also warm the prefill variant behind prefill_logprobs"
    )
    pooling: str = knob(
        "last",
        "how /v1/embeddings pools the final hidden states (after the final norm; L2-normalized): "
        "last (default, vLLM's for decoder models): the last token's; mean: the average over the "
        "prompt; none: embeddings are refused and no pooling variant of the prefill buckets is "
        "warmed",
        choices=("last", "mean", "none"),
    )
    kv_cache_memory_fraction: float = knob(
        0.9, "the share of free device memory the KV cache takes"
    )
    graph_memory_fraction: float = knob(
        0.1, "of that, the share kept for device graphs where they are captured"
    )
    lora_impl: str | None = knob(
        None,
        "LoRA operations (default: the device's: dense on CPU and HPU, "
        "static shapes; gather on CUDA)",
        choices=("dense", "gather"),
    )
    max_lora_rank: int = knob(64, "adapters of a higher rank are refused at start")
    implementation: str = knob(
        "auto",
        "auto (default): our native model when the architecture has "
        "one, else the transformers fallback on the paged KV cache; "
        "native or transformers: that one only (engine/models/"
        "fallback.py)",
        choices=("auto", "native", "transformers"),
    )
    moe_impl: str | None = knob(
        None,
        "MoE experts (default: the device's: dense, every expert over "
        "every token, on CPU and HPU; gather on CUDA)",
        choices=("dense", "gather"),
    )

    pipeline_parallel_size: int = knob(
        1,
        "pipeline stages: the world's ranks split into this many stages of consecutive "
        "layers, each stage tensor-parallel over world size / stages ranks (docs/multinode.md)",
    )

    @property
    def resolved_cache_dir(self) -> Path:
        return self.cache_dir or default_cache_dir()


def torch_dtype(name: str | None, default):
    """The torch dtype for a CLI name, or `default` (the device's automatic choice) for auto or
    none."""
    import torch

    if name is None or name == "auto":
        return default
    try:
        return getattr(torch, DTYPES[dtype_name(name)])
    except argparse.ArgumentTypeError as error:
        raise ValueError(str(error)) from None
