"""Warmup profiles: per-bucket compile time, step latency and memory, measured once and reused.

`python -m engine warmup-profile` warms every bucket of a plan, times each one, and writes
DIR/profile.json (and plots, engine/warmup/plots.py). `engine serve --warmup-profile
DIR/profile.json` then warms exactly those buckets, skipping planning, and picks buckets by
measured latency. Latencies hold only for the setup they were measured on, so a profile carries
a fingerprint of it and a shard refuses one measured elsewhere. A vision-language model's image
buckets (engine/buckets/images.py) are measured and reused likewise (entries of phase "image").
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

from engine.buckets.grid import BucketLimits, BucketPlan, DecodeBucket, PrefillBucket, VerifyBucket
from engine.buckets.images import ImageBucket

PROFILE_VERSION = 1


def fingerprint(
    model_path, adapter, dtype, world_size: int, block_size: int, quantize: str = "none"
) -> dict:
    """The model (its directory name and config.json digest), device, graph mode, dtype, ranks,
    block size, and the weight quantization when there is one (left out otherwise, so older profiles
    still match)."""
    config = Path(model_path) / "config.json"
    digest = hashlib.sha256(config.read_bytes()).hexdigest()[:16] if config.is_file() else None
    return {
        "model": Path(model_path).name,
        "model_config_sha256": digest,
        "device": adapter.name,
        "graph_mode": adapter.graph_mode,
        "dtype": str(dtype).removeprefix("torch."),
        "world_size": world_size,
        "block_size": block_size,
    } | ({} if quantize == "none" else {"quantize": quantize})


def read_profile(path: str | Path) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not a warmup profile (invalid JSON: {err.msg})") from None
    if (
        not isinstance(data, dict)
        or data.get("version") != PROFILE_VERSION
        or "buckets" not in data
    ):
        raise ValueError(
            f"{path}: not a warmup profile of version {PROFILE_VERSION} "
            "(write one with `python -m engine warmup-profile`)"
        )
    return data


def check_fingerprint(path, measured: dict, current: dict) -> None:
    differences = [
        f"{key}={measured.get(key)!r} (this shard: {current[key]!r})"
        for key in current
        if measured.get(key) != current[key]
    ]
    if differences:
        raise ValueError(
            f"{path}: the profile was measured on another setup: {'; '.join(differences)}. "
            "Its buckets and latencies do not apply here: run `python -m engine warmup-profile` "
            "for this setup, or serve without --warmup-profile"
        )


def bucket_of(entry: dict) -> PrefillBucket | DecodeBucket | VerifyBucket | ImageBucket:
    if entry["phase"] == "image":
        return ImageBucket(entry["batch_size"], entry["size"])
    if entry["phase"] == "verify":
        return VerifyBucket(entry["batch_size"], entry["width"], entry["context_blocks"])
    if entry["phase"] == "prefill":
        return PrefillBucket(entry["batch_size"], entry["seq_len"], entry.get("context_blocks", 0))
    return DecodeBucket(entry["batch_size"], entry["num_blocks"])


def plan_from_profile(
    path, limits: BucketLimits, current_fingerprint: dict, images=None
) -> BucketPlan:
    """Exactly the profile's buckets, choosing among them by measured latency; `images` (a vision
    tower's ImageLimits): its image buckets too (the grid's for a profile that has none)."""
    from engine.buckets.images import image_grid, image_problems
    from engine.buckets.plan import check_plan

    data = read_profile(path)
    check_fingerprint(path, data.get("fingerprint", {}), current_fingerprint)
    buckets = {bucket_of(entry): entry["latency_s"] for entry in data["buckets"]}
    plan = BucketPlan(
        tuple(b for b in buckets if isinstance(b, PrefillBucket)),
        tuple(b for b in buckets if isinstance(b, DecodeBucket)),
        latency=buckets,
        verify=tuple(b for b in buckets if isinstance(b, VerifyBucket)),
        images=tuple(b for b in buckets if isinstance(b, ImageBucket))
        if images is not None
        else (),
    )
    check_plan(plan, limits, f"{path} (the limits differ from the profile's)")
    if images is not None:
        plan = replace(plan, images=plan.images or image_grid(images))
        problems = image_problems(plan.images, images)
        if problems:
            raise ValueError(f"{path} (the profile's image buckets): {problems[0]}")
    return plan


def time_bucket(runner, bucket, runs: int) -> list[float]:
    """Seconds of `runs` served forwards (adapter.run: replays, not captures) at a warmed bucket.

    The dummy inputs are the ones runner.warm builds: its call to adapter.warm is intercepted for
    them, so the profile times exactly what warmup ran, LoRA inputs and all. `runner` may be a
    vision tower's ImageEncoder, for an image bucket: its warm_bucket is intercepted alike."""
    adapter, calls = runner.adapter, []
    adapter.warm = lambda shape, fn, *args, graph=True: calls.append((shape, fn, args))
    try:
        if isinstance(bucket, ImageBucket):
            runner.warm_bucket(bucket)
        else:
            runner.warm(bucket)
    finally:
        del adapter.warm  # back to the class's method
    shape, fn, args = calls[0]
    seconds = []
    for _ in range(runs):
        start = time.perf_counter()
        adapter.run(shape, fn, *args)
        adapter.synchronize()
        seconds.append(time.perf_counter() - start)
    return seconds


def bucket_entry(bucket, warm, seconds: list[float]) -> dict:
    if isinstance(bucket, ImageBucket):
        return {
            "phase": "image",
            "batch_size": bucket.count,
            "size": bucket.size,
            **_figures(warm, seconds),
        }
    if isinstance(bucket, VerifyBucket):
        phase, size = "verify", {"width": bucket.width, "context_blocks": bucket.context_blocks}
    elif isinstance(bucket, PrefillBucket):
        phase = "prefill"
        size = {"seq_len": bucket.seq_len, "context_blocks": bucket.context_blocks}
    else:
        phase, size = "decode", {"num_blocks": bucket.num_blocks}
    return {"phase": phase, "batch_size": bucket.batch_size, **size, **_figures(warm, seconds)}


def _figures(warm, seconds: list[float]) -> dict:
    return {
        "warm_s": warm.seconds,
        "latency_s": statistics.median(seconds),
        "latency_runs_s": seconds,
        "memory_bytes": warm.free_before - warm.free_after,
    }


def measure(shard, runs: int) -> list[dict]:
    """Per bucket of the warmed shard: warmup time, median latency over `runs`, memory."""
    import torch

    entries = []
    with torch.inference_mode():
        for warm in shard.warmup_log.buckets:
            owner = shard.vision if isinstance(warm.bucket, ImageBucket) else shard.runner
            entries.append(bucket_entry(warm.bucket, warm, time_bucket(owner, warm.bucket, runs)))
    return entries


def write_profile(out_dir: Path, shard, entries: list[dict], strategy: str, extra: dict) -> Path:
    limits = shard.limits
    data = {
        "version": PROFILE_VERSION,
        "fingerprint": shard.fingerprint(),
        "strategy": strategy,
        "limits": {
            "max_batch_size": limits.max_batch_size,
            "max_input_tokens": limits.max_input_tokens,
            "max_total_tokens": limits.max_total_tokens,
            "max_prefill_tokens": limits.max_prefill_tokens,
        },
        "prefill_buckets": [
            [e["batch_size"], e["seq_len"], e.get("context_blocks", 0)]
            for e in entries
            if e["phase"] == "prefill"
        ],
        "decode_buckets": [
            [e["batch_size"], e["num_blocks"]] for e in entries if e["phase"] == "decode"
        ],
        "image_buckets": [[e["batch_size"], e["size"]] for e in entries if e["phase"] == "image"],
        "buckets": entries,
        "warmup_phases": [
            {"phase": n, "seconds": s, "free_bytes": f} for n, s, f in shard.warmup_log.phases
        ],
        **extra,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "profile.json"
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def summary_table(entries: list[dict]) -> str:
    """One line per bucket. `ctx blocks`: a prefill bucket's context blocks (a prefill that
    continues cached context); without it, buckets that differ only there would look like
    duplicates."""
    lines = [
        f"{'phase':8} {'bs':>4} {'seq/blocks':>10} {'ctx blocks':>10} {'warm s':>8} "
        f"{'median ms':>10} {'memory MiB':>11}"
    ]
    for e in entries:
        size = e.get("seq_len", e.get("num_blocks", e.get("width", e.get("size"))))
        context = e.get("context_blocks", 0) if e["phase"] not in ("decode", "image") else "-"
        lines.append(
            f"{e['phase']:8} {e['batch_size']:>4} {size:>10} {context:>10} {e['warm_s']:>8.2f} "
            f"{e['latency_s'] * 1e3:>10.2f} {e['memory_bytes'] / 2**20:>11.1f}"
        )
    total_warm = sum(e["warm_s"] for e in entries)
    lines.append(f"{len(entries)} buckets, {total_warm:.1f}s warming in all")
    return "\n".join(lines)
