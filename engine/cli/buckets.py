"""`python -m engine buckets`: plan buckets with a strategy and measure their padding on a trace.

Standard library only (numpy for fitted): no model, no device, no torch.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

from engine.buckets.grid import BucketLimits, BucketPlan
from engine.cli.flags import add_knob_flags
from engine.config import EngineConfig

DEFAULT_BLOCK_SIZE = 16  # the CPU adapter's; HPU uses 128
LIMIT_KNOBS = ("max_batch_size", "max_input_tokens", "max_total_tokens", "max_prefill_tokens")


def add_limit_args(
    parser: argparse.ArgumentParser, block_size_default: int | None = DEFAULT_BLOCK_SIZE
) -> None:
    add_knob_flags(parser, EngineConfig, only=LIMIT_KNOBS)
    if block_size_default is not None:
        parser.add_argument(
            "--block-size",
            type=int,
            default=block_size_default,
            help=(
                f"KV block size in tokens (default {block_size_default}, the CPU adapter's; "
                "HPU: 128)"
            ),
        )


def add_plan_args(parser: argparse.ArgumentParser, strategy_default: str | None) -> None:
    from engine.buckets.plan import ALL_STRATEGIES

    parser.add_argument(
        "--shapes", help="JSONL trace of batch shapes (from `engine serve --record-shapes`)"
    )
    parser.add_argument("--strategy", default=strategy_default, choices=ALL_STRATEGIES)
    parser.add_argument(
        "--max-graphs",
        type=int,
        help="fitted: graph budget (default: the exponential plan's count)",
    )
    parser.add_argument(
        "--bucket-file",
        help='file: JSON {"prefill_buckets": [[bs, seq], ...], "decode_buckets": [...]}',
    )


def limits_from_args(args, block_size: int, max_kv_blocks: int | None = None) -> BucketLimits:
    """The limits; without a KV size, the blocks max_batch_size sequences of max_total_tokens
    need."""
    per_sequence = -(-args.max_total_tokens // block_size)
    return BucketLimits(
        args.max_batch_size,
        args.max_input_tokens,
        args.max_total_tokens,
        max(args.max_prefill_tokens, args.max_input_tokens),
        block_size,
        max_kv_blocks or args.max_batch_size * per_sequence,
    )


def report(plan: BucketPlan, strategy: str, limits: BucketLimits, shapes) -> dict:
    from engine.buckets.shapes import count_shapes
    from engine.buckets.trace_cost import decode_cost, prefill_cost

    out = {
        "strategy": strategy,
        "prefill_buckets": [[b.batch_size, b.seq_len] for b in plan.prefill],
        "decode_buckets": [[b.batch_size, b.num_blocks] for b in plan.decode],
        "graphs": plan.graphs,
    }
    if shapes is not None:
        out["prefill"] = prefill_cost(plan, limits, count_shapes(shapes, "prefill")).as_dict(
            decode=False
        )
        out["decode"] = decode_cost(plan, limits, count_shapes(shapes, "decode")).as_dict(
            decode=True
        )
    return out


def _grouped(pairs: list[list[int]], label: str) -> list[str]:
    by_batch = defaultdict(list)
    for bs, size in pairs:
        by_batch[bs].append(size)
    return [
        f"  bs={bs:<4} {label}: {' '.join(map(str, sorted(sizes)))}"
        for bs, sizes in sorted(by_batch.items())
    ]


def _outside(phase: str, figures: dict) -> list[str]:
    if not figures["outside_limits"]:
        return []
    reasons = "; ".join(f"{why}: {n}" for why, n in figures["outside_reasons"].items())
    return [
        f"outside the limits, not counted above: {figures['outside_limits']} {phase} shapes "
        f"({reasons})"
    ]


def format_report(out: dict) -> str:
    lines = [
        f"strategy: {out['strategy']}: {out['graphs']} graphs ({len(out['prefill_buckets'])} "
        f"prefill + {len(out['decode_buckets'])} decode)",
        "prefill buckets:",
    ]
    lines += (
        _grouped(out["prefill_buckets"], "seq")
        + ["decode buckets:"]
        + _grouped(out["decode_buckets"], "blocks")
    )
    if "prefill" in out:
        p, d = out["prefill"], out["decode"]
        lines.append(
            f"prefill: real {p['real']} tokens, padded {p['padded']} tokens, waste {p['waste']:.1%}"
        )
        lines.append(
            f"decode:  real {d['real']} rows, padded {d['padded']} rows, waste {d['waste']:.1%}; "
            f"real {d['real_blocks']} blocks, padded {d['padded_blocks']} blocks, waste "
            f"{d['block_waste']:.1%}"
        )
        lines += _outside("prefill", p) + _outside("decode", d)
    return "\n".join(lines)


def cmd_buckets(args: argparse.Namespace) -> None:
    from engine.buckets.plan import make_plan
    from engine.buckets.shapes import load_shapes

    limits = limits_from_args(args, args.block_size, args.max_kv_blocks)
    shapes = load_shapes(args.shapes) if args.shapes else None
    plan = make_plan(args.strategy, limits, shapes, args.bucket_file, args.max_graphs)
    out = report(plan, args.strategy, limits, shapes)
    print(json.dumps(out) if args.json else format_report(out))


def add_buckets_command(commands) -> None:
    p = commands.add_parser(
        "buckets",
        help="plan buckets and measure their padding on a shape trace",
        description="Print the buckets a strategy plans for the limits, and with --shapes the "
        "real and padded work of replaying that trace through them.",
    )
    add_plan_args(p, "exponential")
    add_limit_args(p)
    p.add_argument(
        "--max-kv-blocks",
        type=int,
        help="KV blocks of the cache (default: what max-batch-size longest sequences need)",
    )
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.set_defaults(func=cmd_buckets, verbose=False)
