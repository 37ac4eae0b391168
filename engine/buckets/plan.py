"""One entry point for every bucket strategy, and the checks a plan from outside must pass.

Grid strategies (linear, exponential, padding) need only the limits; `file` reads the buckets from
a JSON file; `fitted` fits them to a recorded trace under a graph budget. A vision-language model's
image buckets (engine/buckets/images.py) are planned beside them by `image_plan`.
"""

from __future__ import annotations

import json
from pathlib import Path

from engine.buckets.grid import (
    STRATEGIES,
    BucketLimits,
    BucketPlan,
    DecodeBucket,
    PrefillBucket,
    context_buckets,
    exponential_range,
    max_context_blocks,
    plan_buckets,
)

ALL_STRATEGIES = (*sorted(STRATEGIES), "file", "fitted")


def make_plan(
    strategy: str,
    limits: BucketLimits,
    shapes=None,
    bucket_file: str | Path | None = None,
    max_graphs: int | None = None,
    prefix_caching: bool = False,
) -> BucketPlan:
    """The buckets of `strategy`. fitted needs `shapes` (a trace); max_graphs defaults to the
    exponential plan's graph count, so fitted costs the same warmup as the default. With
    `prefix_caching`, prefill buckets gain the context dimension (engine/buckets/grid.py); fitted
    then keeps context and plain buckets together within max_graphs."""
    fitted_context = prefix_caching and strategy == "fitted" and _recorded_contexts(shapes)
    if fitted_context:
        budget = (
            max_graphs if max_graphs is not None else plan_buckets(limits, "exponential").graphs
        )
        max_graphs = (
            budget - len(_recorded_contexts(shapes)) - 1
        )  # room for a bucket per context, and a cover
    plan = _make_plan(strategy, limits, shapes, bucket_file, max_graphs)
    if prefix_caching and not any(b.context_blocks for b in plan.prefill):
        plan = (
            fitted_context_plan(plan, limits, shapes)
            if fitted_context
            else with_context(plan, limits)
        )
    return plan


def with_every_decode_batch(plan: BucketPlan, blocks_per_sequence: int) -> BucketPlan:
    """The plan plus a decode bucket for every batch size below each planned one, offered that
    bucket's block counts: where a bucket costs no graph (eager CPU), a step of 17 sequences then
    runs 17 rows, not 32 (every padded row is a full row of every GEMM). Registration is all such a
    bucket costs at warmup, and strict mode still refuses any shape outside the plan. A block count
    is capped at what the smaller batch's sequences can hold, so the plan stays within the limits
    (a warmup profile of it is checked against them)."""
    batches = sorted({b.batch_size for b in plan.decode})
    below = {size: max((s for s in batches if s < size), default=0) for size in batches}
    extra = {
        DecodeBucket(n, min(bucket.num_blocks, n * blocks_per_sequence))
        for bucket in plan.decode
        for n in range(below[bucket.batch_size] + 1, bucket.batch_size)
    }
    decode = sorted(set(plan.decode) | extra, key=lambda b: (b.batch_size, b.num_blocks))
    return BucketPlan(plan.prefill, tuple(decode), plan.latency, plan.verify, plan.images)


def image_plan(strategy: str, images, shapes=None, bucket_file=None) -> tuple:
    """The image buckets of a tower of limits `images` (engine.buckets.images.ImageLimits; None:
    a text model, none): a bucket file's `image_buckets` when it has them, fitted to the trace's
    image records for fitted, else the grid. Checked against the tower's limits."""
    from engine.buckets.images import image_problems, plan_images

    if images is None:
        return ()
    planned = load_bucket_file(bucket_file).images if strategy == "file" and bucket_file else ()
    buckets = plan_images(strategy, images, shapes, planned)
    problems = image_problems(buckets, images)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ValueError(f"{bucket_file if planned else strategy + ' plan'}: {problems[0]}{more}")
    return buckets


def _recorded_contexts(shapes) -> set:
    return {
        (s.batch_size, s.size, s.context_blocks)
        for s in shapes or ()
        if s.phase == "prefill" and s.context_blocks
    }


def with_context(plan: BucketPlan, limits: BucketLimits) -> BucketPlan:
    """The plan plus context buckets over its plain prefill buckets, at the exponential context
    sizes (one block at the finest)."""
    top = max_context_blocks(limits)
    if top < 1:
        return plan
    plain = [b for b in plan.prefill if not b.context_blocks]
    return BucketPlan(
        plan.prefill + tuple(context_buckets(limits, plain, exponential_range(1, 1, top))),
        plan.decode,
        plan.latency,
    )


def fitted_context_plan(plan: BucketPlan, limits: BucketLimits, shapes) -> BucketPlan:
    """Context buckets fitted to a trace's recorded contexts: each one's rows, its new tokens
    rounded up to whole blocks and its context to an exponential point; and one cover bucket (one
    row, the longest chunk, the most context) so that every context within the limits runs."""
    top = max_context_blocks(limits)
    points = exponential_range(1, 1, top)
    buckets = {PrefillBucket(1, plan.max_prefill_seq_len, top)}
    longest, size = plan.max_prefill_seq_len, limits.block_size
    for batch, seq, context in _recorded_contexts(shapes):
        point = min(p for p in points if p >= min(context, top))
        buckets.add(
            PrefillBucket(
                min(batch, limits.max_batch_size), min(-(-seq // size) * size, longest), point
            )
        )
    return BucketPlan(
        plan.prefill
        + tuple(sorted(buckets, key=lambda b: (b.batch_size, b.seq_len, b.context_blocks))),
        plan.decode,
        plan.latency,
    )


def _make_plan(strategy: str, limits: BucketLimits, shapes, bucket_file, max_graphs) -> BucketPlan:
    if strategy not in ALL_STRATEGIES:
        raise ValueError(
            f"unknown bucket strategy {strategy!r}; known: {', '.join(ALL_STRATEGIES)}"
        )
    if max_graphs is not None and strategy != "fitted":
        raise ValueError("--max-graphs applies to the fitted strategy only")
    if strategy == "file":
        if bucket_file is None:
            raise ValueError("the file strategy needs a bucket file (--bucket-file)")
        plan = load_bucket_file(bucket_file)
        check_plan(plan, limits, str(bucket_file))
        return plan
    if strategy == "fitted":
        return _fitted(limits, shapes, max_graphs)
    return plan_buckets(limits, strategy)


def _fitted(limits: BucketLimits, shapes, max_graphs: int | None) -> BucketPlan:
    from engine.buckets.fitted import SEQ_STEP, fit_plan  # numpy only when fitting

    if not shapes:
        raise ValueError(
            "the fitted strategy needs a trace of batch shapes (--shapes FILE.jsonl, "
            "recorded with `engine serve --record-shapes`)"
        )
    budget = max_graphs if max_graphs is not None else plan_buckets(limits, "exponential").graphs
    plan = fit_plan(limits, shapes, budget, SEQ_STEP)
    check_plan(
        plan, limits, "fitted plan"
    )  # the planner's own guarantees, checked where they matter
    return plan


def load_bucket_file(path: str | Path) -> BucketPlan:
    """{"prefill_buckets": [[bs, seq], ...], "decode_buckets": [[bs, blocks], ...]}: the shape
    `engine buckets --json` prints and profile.json holds, so either can be passed back in; and,
    for a vision-language model, optionally "image_buckets": [[inputs, size], ...]."""
    from engine.buckets.images import ImageBucket

    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not JSON ({err.msg} at line {err.lineno})") from None
    if not isinstance(data, dict) or not {"prefill_buckets", "decode_buckets"} <= set(data):
        raise ValueError(
            f'{path}: expected {{"prefill_buckets": [[bs, seq], ...], '
            f'"decode_buckets": [[bs, blocks], ...]}}'
        )
    return BucketPlan(
        tuple(_buckets(path, data["prefill_buckets"], PrefillBucket)),
        tuple(_buckets(path, data["decode_buckets"], DecodeBucket)),
        images=tuple(_buckets(path, data.get("image_buckets", ()), ImageBucket)),
    )


def _buckets(path, pairs, kind) -> list:
    out = []
    for pair in pairs:
        try:
            bucket = kind(*pair)
        except (TypeError, ValueError):
            raise ValueError(
                f"{path}: {kind.__name__} {pair!r} is not two positive integers "
                "(a prefill bucket may add its context blocks as a third)"
            ) from None
        if bucket not in out:
            out.append(bucket)
    return out


def plan_problems(plan: BucketPlan, limits: BucketLimits) -> list[str]:
    """What makes a plan unusable under the limits: buckets beyond them, or shapes within them that
    no bucket (or split) could run."""
    problems = [
        f"prefill bucket {_shape(b)} is beyond the limits" + why
        for b in plan.prefill
        for why in [_prefill_beyond(b, limits)]
        if why
    ]
    problems += [
        f"decode bucket [{b.batch_size}, {b.num_blocks}] is beyond the limits" + why
        for b in plan.decode
        for why in [_decode_beyond(b, limits)]
        if why
    ]
    if plan.prefill_bucket(1, limits.max_input_tokens) is None:
        problems.append(
            f"no prefill bucket holds a prompt of max_input_tokens={limits.max_input_tokens}"
        )
    bps, kv = limits.blocks_per_sequence, limits.max_kv_blocks
    for n in range(1, min(limits.max_batch_size, kv) + 1):
        if plan.decode_bucket(n, min(n * bps, kv)) is None:
            problems.append(
                f"no decode bucket holds {n} sequences of {min(n * bps, kv)} blocks in all"
            )
            break
    return problems


def _shape(b: PrefillBucket) -> str:
    return f"[{b.batch_size}, {b.seq_len}{f', {b.context_blocks}' if b.context_blocks else ''}]"


def _prefill_beyond(b: PrefillBucket, limits: BucketLimits) -> str:
    if b.batch_size > limits.max_batch_size:
        return f": batch_size > max_batch_size={limits.max_batch_size}"
    if b.seq_len > limits.max_input_tokens:
        return f": seq_len > max_input_tokens={limits.max_input_tokens}"
    if b.tokens > limits.max_prefill_tokens:
        return f": {b.tokens} tokens > max_prefill_tokens={limits.max_prefill_tokens}"
    if b.context_blocks > max_context_blocks(limits):
        return (
            f": context_blocks > {max_context_blocks(limits)} (a prompt of "
            f"max_input_tokens={limits.max_input_tokens})"
        )
    return ""


def _decode_beyond(b: DecodeBucket, limits: BucketLimits) -> str:
    # Blocks are checked against what max_batch_size sequences can hold, not against this device's
    # KV cache: a bucket bigger than the cache is never needed but harmless to warm (dummy rows
    # read only the reserved block), so a plan stays valid on a device with a little less memory.
    if b.batch_size > limits.max_batch_size:
        return f": batch_size > max_batch_size={limits.max_batch_size}"
    if not b.batch_size <= b.num_blocks <= b.batch_size * limits.blocks_per_sequence:
        return (
            f": num_blocks outside batch_size..batch_size x {limits.blocks_per_sequence} "
            "blocks per sequence"
        )
    return ""


def check_plan(plan: BucketPlan, limits: BucketLimits, source: str) -> None:
    problems = plan_problems(plan, limits)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ValueError(f"{source}: {problems[0]}{more}")
