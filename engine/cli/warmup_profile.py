"""`python -m engine warmup-profile`: warm every bucket, time each, write profile.json and plots."""

from __future__ import annotations

import argparse
import datetime
import sys
from dataclasses import replace
from pathlib import Path

from engine.cli.buckets import add_limit_args, add_plan_args, report
from engine.cli.flags import add_knob_flags, config_from_args
from engine.config import EngineConfig

COMPARED = ("linear", "exponential", "padding", "fitted")


MODEL_KNOBS = ("model_id", "device", "dtype", "quantize", "graph_mode", "cache_dir", "block_size")


def profile_config(args: argparse.Namespace) -> EngineConfig:
    # --max-graphs and --bucket-file are the knobs' own flags; the plan's strategy and trace are
    # named as in `engine buckets`
    return replace(
        config_from_args(EngineConfig, args),
        bucket_strategy=args.strategy,
        bucket_shapes=args.shapes,
        warmup_mode="full",
    )


def strategy_reports(shard, shapes) -> list[dict]:
    """Each strategy's padding on the trace, under this shard's limits and KV cache."""
    from engine.buckets.plan import make_plan
    from engine.warmup.run import bucket_limits

    limits = bucket_limits(
        shard.limits,
        shard.block_size,
        shard.runner.kv_cache.num_blocks,
        shard.config.prefix_caching,
    )
    return [report(make_plan(name, limits, shapes), name, limits, shapes) for name in COMPARED]


def write_plots(out_dir: Path, entries: list[dict], reports: list[dict]) -> list[Path]:
    from engine.warmup.plots import latency_plot, waste_plot

    paths = [
        latency_plot(entries, "prefill", "seq_len", out_dir / "prefill_latency.png"),
        latency_plot(entries, "decode", "num_blocks", out_dir / "decode_latency.png"),
    ]
    if reports:
        paths.append(waste_plot(reports, out_dir / "strategy_waste.png"))
    return [p for p in paths if p is not None]


def cmd_warmup_profile(args: argparse.Namespace) -> None:
    from engine.buckets.shapes import load_shapes
    from engine.serving.shard import Shard
    from engine.warmup.profile import measure, summary_table, write_profile

    if args.runs < 1:
        raise ValueError(f"--runs must be at least 1, got {args.runs}")
    shapes = (
        load_shapes(args.shapes) if args.shapes else None
    )  # a bad trace fails before the model loads
    shard = Shard(profile_config(args), show_progress=True)
    shard.warmup()
    print(f"timing {len(shard.warmup_log.buckets)} buckets, {args.runs} runs each", file=sys.stderr)
    entries = measure(shard, args.runs)
    reports = strategy_reports(shard, shapes) if shapes else []
    extra = {
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "runs": args.runs,
        "shapes": args.shapes,
        "strategy_waste": reports,
    }
    out_dir = Path(args.out)
    path = write_profile(out_dir, shard, entries, args.strategy, extra)
    plots = write_plots(out_dir, entries, reports)
    print(summary_table(entries))
    for r in reports:
        print(
            f"on the trace: {r['strategy']:12} {r['graphs']:4} graphs, waste prefill "
            f"{r['prefill']['waste']:.1%}, decode rows {r['decode']['waste']:.1%}, blocks "
            f"{r['decode']['block_waste']:.1%}"
        )
    print(f"wrote {path}" + "".join(f", {p}" for p in plots))
    print(
        f"serve with it: python -m engine serve --warmup-profile {path} (same model, device, "
        "dtype, block size)"
    )


def add_profile_command(commands) -> None:
    defaults = EngineConfig()
    p = commands.add_parser(
        "warmup-profile",
        help="warm every bucket, measure each, write profile.json and plots",
        description="Warm every bucket of a plan and measure, per bucket, the warmup (compile or "
        "capture) time, the median step latency and the memory; write DIR/profile.json "
        "and PNG plots. `engine serve --warmup-profile DIR/profile.json` reuses it.",
    )
    add_knob_flags(p, EngineConfig, only=MODEL_KNOBS)
    add_limit_args(p, block_size_default=None)
    add_plan_args(p, defaults.bucket_strategy)
    p.add_argument("--runs", type=int, default=5, help="timed runs per bucket (the median is kept)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("-v", "--verbose", action="store_true", help="log progress at INFO level")
    p.set_defaults(func=cmd_warmup_profile)
