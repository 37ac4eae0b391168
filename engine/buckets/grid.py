"""Shape buckets: the few (batch, length) shapes a graph-compiling accelerator is warmed on.

A graph compiler is only fast on shapes it has compiled before, so every batch is padded
up to one of a small set of "buckets" that warmup ran. A prefill bucket is
(batch_size, seq_len). A decode bucket is (batch_size, num_blocks) where num_blocks is
the TOTAL number of KV blocks of the whole batch, because flat paged attention
concatenates all sequences' blocks into one list.

Pure standard library on purpose: the scheduler and the CLI plan buckets without
importing torch.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property

from engine.buckets.ranges import (  # noqa: F401 - re-exported: the planner's public names live here
    STRATEGIES,
    _require_positive,
    exponential_range,
    linear_range,
    padding_range,
)

# ---------------------------------------------------------------------------------------
# Buckets and limits
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PrefillBucket:
    batch_size: int  # prompts (rows) in the padded batch
    seq_len: int  # every prompt's new tokens are padded to this length
    # KV blocks of cached context every row may read (prefix-cache hit, later chunk); 0: none
    context_blocks: int = 0

    def __post_init__(self) -> None:
        _require_positive("batch_size", self.batch_size)
        _require_positive("seq_len", self.seq_len)
        if not isinstance(self.context_blocks, int) or self.context_blocks < 0:
            raise ValueError(
                f"context_blocks must be a non-negative integer, got {self.context_blocks!r}"
            )

    @property
    def tokens(self) -> int:
        """Padded tokens the forward computes: what prefill cost and memory scale with."""
        return self.batch_size * self.seq_len


@dataclass(frozen=True)
class DecodeBucket:
    batch_size: int  # sequences (rows) in the padded batch
    num_blocks: int  # KV blocks of the whole batch (flat paged attention)

    def __post_init__(self) -> None:
        _require_positive("batch_size", self.batch_size)
        _require_positive("num_blocks", self.num_blocks)


@dataclass(frozen=True)
class VerifyBucket:
    """Speculative decoding's verify step (engine/speculative/): `width` query tokens per row (a
    row's latest token and its proposals, padded) over at most `context_blocks` cached KV blocks a
    row."""

    batch_size: int
    width: int
    context_blocks: int

    def __post_init__(self) -> None:
        for name in ("batch_size", "width", "context_blocks"):
            _require_positive(name, getattr(self, name))

    @property
    def as_prefill(self) -> PrefillBucket:
        """The prefill-with-context shape its tensors take (engine/attention/context.py)."""
        return PrefillBucket(self.batch_size, self.width, self.context_blocks)


@dataclass(frozen=True)
class BucketLimits:
    max_batch_size: int  # most sequences in one forward
    max_input_tokens: int  # longest prompt
    max_total_tokens: int  # prompt + generated, per sequence
    max_prefill_tokens: int  # budget: batch_size*seq_len of any prefill bucket <= this
    block_size: int  # tokens per KV block
    max_kv_blocks: int  # usable KV blocks (block 0 is reserved and not counted)
    # Chunked prefill: the longest prompt, computed in chunks of at most max_input_tokens (then the
    # longest chunk) each continuing the cached context; 0: prompts are not chunked.
    max_prompt_tokens: int = 0

    def __post_init__(self) -> None:
        for name in (
            "max_batch_size",
            "max_input_tokens",
            "max_total_tokens",
            "max_prefill_tokens",
            "block_size",
            "max_kv_blocks",
        ):
            _require_positive(name, getattr(self, name))
        # A prompt must leave room for at least one generated token.
        if self.max_input_tokens >= self.max_total_tokens:
            raise ValueError(
                f"max_input_tokens ({self.max_input_tokens}) must be < "
                f"max_total_tokens ({self.max_total_tokens})"
            )
        # Otherwise the longest allowed prompt could not be prefilled even alone.
        if self.max_input_tokens > self.max_prefill_tokens:
            raise ValueError(
                f"max_input_tokens ({self.max_input_tokens}) must be <= "
                f"max_prefill_tokens ({self.max_prefill_tokens})"
            )

    @property
    def blocks_per_sequence(self) -> int:
        """KV blocks one sequence of max_total_tokens needs."""
        return -(-self.max_total_tokens // self.block_size)


@dataclass(frozen=True)
class StrategySteps:
    """The step of each dimension; the min values are derived from the limits.

    The defaults are the linear strategy's published ones. The exponential strategy uses the step
    only to round its points, so default_steps() gives it fine steps.
    """

    prefill_batch_step: int = 32
    prefill_seq_step: int = 128
    decode_batch_step: int = 32
    decode_block_step: int = 128

    def __post_init__(self) -> None:
        for name in (
            "prefill_batch_step",
            "prefill_seq_step",
            "decode_batch_step",
            "decode_block_step",
        ):
            _require_positive(name, getattr(self, name))


# ---------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BucketPlan:
    prefill: tuple[PrefillBucket, ...]
    decode: tuple[DecodeBucket, ...]
    # Measured seconds per step of each bucket (a warmup profile). When given, bucket choice and
    # splitting minimise time instead of padded tokens: on a real device a bigger bucket can be as
    # fast as a smaller one (memory-bound decode), which token counts cannot see.
    latency: Mapping | None = field(default=None, compare=False, repr=False)
    # Speculative decoding's verify buckets (engine/speculative/buckets.py); none without
    # --speculate.
    verify: tuple[VerifyBucket, ...] = ()
    # A vision-language model's tower shapes (engine/buckets/images.py); none for a text model.
    # Warmed with the rest, but not among `buckets`: the tower runs them, not the runner.
    images: tuple = ()

    def __post_init__(self) -> None:
        # Tuples keep the frozen plan hashable and immune to a caller's list edits.
        object.__setattr__(self, "prefill", tuple(self.prefill))
        object.__setattr__(self, "decode", tuple(self.decode))
        object.__setattr__(self, "verify", tuple(self.verify))
        object.__setattr__(self, "images", tuple(self.images))

    @property
    def graphs(self) -> int:
        """Buckets to warm (one graph each, not counting the prompt-logprobs variant)."""
        return len(self.prefill) + len(self.decode) + len(self.verify)

    @property
    def buckets(self) -> tuple:
        """Every bucket warmup runs: prefill, decode and verify."""
        return self.prefill + self.decode + self.verify

    def subset(self, keep: Iterable) -> BucketPlan:
        """The plan restricted to the buckets in `keep` (e.g. those warmed so far), same
        latencies."""
        keep = set(keep)
        return BucketPlan(
            tuple(b for b in self.prefill if b in keep),
            tuple(b for b in self.decode if b in keep),
            self.latency,
            tuple(b for b in self.verify if b in keep),
            self.images,  # warmed before any other bucket (engine/warmup/run.py)
        )

    def sampler_rows(self, count: int) -> int:
        """The rows a static sampler runs `count` rows on: the smallest decode batch size that
        holds them (count itself beyond every decode bucket)."""
        sizes = sorted({bucket.batch_size for bucket in self.decode})
        return next((size for size in sizes if size >= count), count)

    def verify_bucket(self, batch_size: int, width: int, context_blocks: int):
        """The smallest verify bucket holding the rows (fewest padded rows, then tokens, then
        context), or None: the step then decodes without speculation."""
        holding = [
            b
            for b in self.verify
            if b.batch_size >= batch_size
            and b.width >= width
            and b.context_blocks >= context_blocks
        ]
        return min(
            holding,
            key=lambda b: (self._seconds(b), b.batch_size, b.width, b.context_blocks),
            default=None,
        )

    def _seconds(self, bucket) -> float:
        """The bucket's measured latency; 0 without a profile (choice falls to padding), and
        infinity for a bucket the profile did not measure (chosen only when nothing else holds)."""
        if self.latency is None:
            return 0.0
        return self.latency.get(bucket, float("inf"))

    def _cost(self, bucket: PrefillBucket) -> float:
        return self.latency[bucket] if self.latency and bucket in self.latency else bucket.tokens

    @property
    def max_prefill_batch(self) -> int:
        return max((b.batch_size for b in self.prefill), default=0)

    @property
    def max_prefill_seq_len(self) -> int:
        return max((b.seq_len for b in self.prefill), default=0)

    @property
    def max_decode_batch(self) -> int:
        return max((b.batch_size for b in self.decode), default=0)

    @property
    def max_decode_blocks(self) -> int:
        return max((b.num_blocks for b in self.decode), default=0)

    def prefill_bucket(
        self, batch_size: int, seq_len: int, context_blocks: int = 0
    ) -> PrefillBucket | None:
        """The bucket holding batch_size prompts of at most seq_len tokens with the fewest
        padded tokens (ties: smaller batch), or None if no bucket holds it. With latencies:
        the fastest holding bucket, ties broken the same way. `context_blocks`: the most cached
        context blocks of a row; only context buckets hold a batch with context, only plain ones
        a batch without (a plain one is cheaper)."""
        _require_positive("batch_size", batch_size)
        _require_positive("seq_len", seq_len)
        holding = [
            b
            for b in self.prefill
            if b.batch_size >= batch_size
            and b.seq_len >= seq_len
            and b.context_blocks >= context_blocks
            and (b.context_blocks > 0) == (context_blocks > 0)
        ]
        return min(
            holding,
            key=lambda b: (
                self._seconds(b),
                b.tokens,
                b.batch_size * b.context_blocks,
                b.batch_size,
            ),
            default=None,
        )

    def split_context(self, rows: list[tuple[int, int]]) -> list[list[int]]:
        """Partition (new tokens, context blocks) rows into groups that each fit a context bucket:
        rows sorted by context then length, a group grows while a bucket still holds it."""
        for i, (length, blocks) in enumerate(rows):
            if self.prefill_bucket(1, length, blocks) is None:
                raise ValueError(
                    f"prompt {i}: no prefill bucket holds {length} new tokens after "
                    f"{blocks} cached context blocks"
                )
        order = sorted(range(len(rows)), key=lambda i: (rows[i][1], rows[i][0], i))
        groups: list[list[int]] = []
        for i in order:
            group = groups[-1] if groups else []
            wider = group + [i]
            if (
                group
                and self.prefill_bucket(
                    len(wider), max(rows[j][0] for j in wider), max(rows[j][1] for j in wider)
                )
                is not None
            ):
                group.append(i)
            else:
                groups.append([i])
        return [sorted(g) for g in groups]

    def decode_bucket(self, batch_size: int, num_blocks: int) -> DecodeBucket | None:
        """The bucket holding batch_size sequences with num_blocks blocks in total: fewest
        padded rows first (every row costs a full forward row), then fewest padded blocks.
        With latencies: the fastest holding bucket, ties broken the same way."""
        _require_positive("batch_size", batch_size)
        _require_positive("num_blocks", num_blocks)
        if self.latency is not None:
            holding = [
                b for b in self.decode if b.batch_size >= batch_size and b.num_blocks >= num_blocks
            ]
            return min(
                holding, key=lambda b: (self._seconds(b), b.batch_size, b.num_blocks), default=None
            )
        # Without latencies the order is (batch size, blocks): the first batch size at or above
        # batch_size with a bucket of enough blocks. The runner asks this twice per row each step,
        # and an eager CPU plan has a bucket for every batch size: a scan cost milliseconds a step.
        sizes, blocks, buckets = self._decode_index
        for i in range(bisect_left(sizes, batch_size), len(sizes)):
            j = bisect_left(blocks[i], num_blocks)
            if j < len(blocks[i]):
                return buckets[i][j]
        return None

    @cached_property
    def _decode_index(self) -> tuple[list[int], list[list[int]], list[list[DecodeBucket]]]:
        """Decode batch sizes ascending; for each, its buckets' block counts and buckets,
        ascending."""
        by_size: dict[int, list[DecodeBucket]] = {}
        for bucket in sorted(set(self.decode), key=lambda b: (b.batch_size, b.num_blocks)):
            by_size.setdefault(bucket.batch_size, []).append(bucket)
        sizes = sorted(by_size)
        return (
            sizes,
            [[b.num_blocks for b in by_size[s]] for s in sizes],
            [by_size[s] for s in sizes],
        )

    def split_prefill(self, seq_lens: list[int]) -> list[list[int]]:
        """Partition prompt indices into groups that each fit a prefill bucket, with the fewest
        padded tokens (with latencies: the least time) in all (ties: fewer forwards). Indices
        inside a group are ascending.

        With prompts sorted by length, some optimal partition takes consecutive runs, so a
        dynamic program over run ends finds it: best[i] is the cheapest split of the i longest.
        """
        for i, length in enumerate(seq_lens):
            _require_positive("seq_len", length)
            if self.prefill_bucket(1, length) is None:
                raise ValueError(
                    f"prompt {i} has {length} tokens, more than the longest "
                    f"prefill bucket ({self.max_prefill_seq_len} tokens)"
                )
        order = sorted(range(len(seq_lens)), key=lambda i: (-seq_lens[i], i))
        best: list[tuple[float, int, int]] = [
            (0, 0, 0)
        ]  # (padded tokens or seconds, forwards, run start)
        for end in range(1, len(order) + 1):
            options = []
            for start in range(max(0, end - self.max_prefill_batch), end):
                # order[start] is the run's longest prompt: it fixes the padded length.
                bucket = self.prefill_bucket(end - start, seq_lens[order[start]])
                if bucket is not None:
                    options.append((best[start][0] + self._cost(bucket), best[start][1] + 1, start))
            best.append(min(options))
        groups, end = [], len(order)
        while end:
            start = best[end][2]
            groups.append(sorted(order[start:end]))
            end = start
        return groups[::-1]

    def split_decode(self, block_counts: list[int]) -> list[list[int]]:
        """Partition sequence indices, in their original order, into consecutive groups
        that each fit a decode bucket; a group grows while a bucket still holds it."""
        # Every sequence must fit alone: otherwise no split can run it, whatever its group.
        for i, count in enumerate(block_counts):
            _require_positive("block count", count)
            if self.decode_bucket(1, count) is None:
                raise ValueError(
                    f"sequence {i} holds {count} KV blocks, more than the largest "
                    f"decode bucket ({self.max_decode_blocks} blocks)"
                )
        groups: list[list[int]] = []
        total = 0
        for i, count in enumerate(block_counts):
            if groups and self.decode_bucket(len(groups[-1]) + 1, total + count) is not None:
                groups[-1].append(i)
                total += count
            else:
                groups.append([i])
                total = count
        return groups


SMALL_DECODE_BATCHES = (1, 2, 4)


def _strategy(name: str) -> Callable[[int, int, int], list[int]]:
    if name not in STRATEGIES:
        raise ValueError(
            f"unknown bucket strategy {name!r}; known: {', '.join(sorted(STRATEGIES))}"
        )
    return STRATEGIES[name]


def _prefill_buckets(
    limits: BucketLimits, strategy: Callable, steps: StrategySteps
) -> list[PrefillBucket]:
    batch_sizes = strategy(1, steps.prefill_batch_step, limits.max_batch_size)
    # Prompts shorter than a block still occupy one block, so start there.
    shortest = min(limits.block_size, limits.max_input_tokens)
    seq_lens = strategy(shortest, steps.prefill_seq_step, limits.max_input_tokens)
    # A batch whose rounded-up shape is over the budget is split by split_prefill instead:
    # adding a bucket for every budget corner would cost a warmup graph per batch size.
    return [
        PrefillBucket(bs, seq)
        for bs in batch_sizes
        for seq in seq_lens
        if bs * seq <= limits.max_prefill_tokens
    ]


def max_context_blocks(limits: BucketLimits) -> int:
    """Most blocks of cached context a prompt (or its last chunk) can continue: at least its last
    token is computed."""
    return -(-(max(limits.max_input_tokens, limits.max_prompt_tokens) - 1) // limits.block_size)


def context_buckets(
    limits: BucketLimits, plain: list[PrefillBucket], contexts: list[int]
) -> list[PrefillBucket]:
    """The third dimension: every plain (batch, seq) bucket again with each context size whose
    rows' context blocks all fit the KV cache (the same graph budget caps the count downstream)."""
    return [
        PrefillBucket(b.batch_size, b.seq_len, c)
        for b in plain
        for c in contexts
        if b.batch_size * c <= limits.max_kv_blocks
    ]


def small_decode_batches(top_batch: int) -> list[int]:
    """The decode batch sizes every plan has (up to top_batch), so that a lone request or two are
    never padded to a batch of 8: at small batch a padded row costs as much as a real one."""
    return [b for b in SMALL_DECODE_BATCHES if b <= top_batch]


def _decode_buckets(
    limits: BucketLimits, strategy: Callable, steps: StrategySteps
) -> list[DecodeBucket]:
    # Every sequence holds at least one block, so a batch never has more rows than
    # blocks. Capping the batch range (rather than dropping batch sizes above the cap)
    # keeps a bucket for batches of up to max_kv_blocks sequences.
    top_batch = min(limits.max_batch_size, limits.max_kv_blocks)
    buckets = []
    for bs in sorted(
        set(strategy(1, steps.decode_batch_step, top_batch)) | set(small_decode_batches(top_batch))
    ):
        top = min(bs * limits.blocks_per_sequence, limits.max_kv_blocks)
        buckets += [DecodeBucket(bs, n) for n in strategy(bs, steps.decode_block_step, top)]
    return buckets


def default_steps(strategy: str, block_size: int) -> StrategySteps:
    if strategy in ("exponential", "padding"):
        # Powers of two for batch sizes and block counts, lengths aligned on whole KV blocks.
        return StrategySteps(
            prefill_batch_step=1,
            prefill_seq_step=block_size,
            decode_batch_step=1,
            decode_block_step=1,
        )
    return StrategySteps()


def plan_buckets(
    limits: BucketLimits,
    strategy: str = "exponential",
    steps: StrategySteps | None = None,
    prefix_caching: bool = False,
) -> BucketPlan:
    """All buckets to warm up. Guarantees: every prompt of L <= max_input_tokens has a bucket, and a
    batch of them whose rounded-up shape fits max_prefill_tokens too (others split_prefill);
    n <= max_batch_size sequences holding T blocks in total, n <= T <= min(n * blocks_per_sequence,
    max_kv_blocks), have a decode bucket."""
    range_of = _strategy(strategy)
    steps = steps or default_steps(strategy, limits.block_size)
    prefill = _prefill_buckets(limits, range_of, steps)
    top = max_context_blocks(limits)
    if (
        prefix_caching and top > 0
    ):  # context blocks range like decode blocks: one block is the finest step
        prefill += context_buckets(
            limits, prefill, range_of(1, max(1, steps.decode_block_step), top)
        )
    return BucketPlan(
        prefill=tuple(prefill), decode=tuple(_decode_buckets(limits, range_of, steps))
    )


# ---------------------------------------------------------------------------------------
# Padding accounting
# ---------------------------------------------------------------------------------------

PHASES = ("prefill", "decode")


class PaddingStats:
    """Real vs padded work per phase, to see what bucketing costs.

    Phase-agnostic about units: prefill callers record tokens, decode callers record
    rows (real sequences vs the bucket's batch_size).
    """

    def __init__(self) -> None:
        self._real = dict.fromkeys(PHASES, 0)
        self._padded = dict.fromkeys(PHASES, 0)
        self._forwards = dict.fromkeys(
            PHASES, 0
        )  # bucket runs: n > 1 siblings must cost one prefill
        # bucket -> [forwards, real, padded]: which buckets the traffic used
        self.by_bucket: dict = {}

    def _check_phase(self, phase: str) -> None:
        # A typo'd phase would silently start a third, never-reported account.
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; known: {', '.join(PHASES)}")

    def record(self, phase: str, real_tokens: int, padded_tokens: int, bucket=None) -> None:
        self._check_phase(phase)
        if not 0 <= real_tokens <= padded_tokens:
            raise ValueError(
                f"need 0 <= real ({real_tokens}) <= padded ({padded_tokens}) for {phase}"
            )
        self._real[phase] += real_tokens
        self._padded[phase] += padded_tokens
        self._forwards[phase] += 1
        if bucket is not None:
            counts = self.by_bucket.setdefault(bucket, [0, 0, 0])
            counts[0], counts[1], counts[2] = (
                counts[0] + 1,
                counts[1] + real_tokens,
                counts[2] + padded_tokens,
            )

    def busiest(self, count: int) -> list[tuple]:
        """The `count` buckets run most often: (bucket, forwards, real, padded), most used first."""
        ranked = sorted(self.by_bucket.items(), key=lambda item: -item[1][0])[:count]
        return [(bucket, *counts) for bucket, counts in ranked]

    def forwards(self, phase: str) -> int:
        self._check_phase(phase)
        return self._forwards[phase]

    def real(self, phase: str) -> int:
        self._check_phase(phase)
        return self._real[phase]

    def padded(self, phase: str) -> int:
        self._check_phase(phase)
        return self._padded[phase]

    def waste(self, phase: str) -> float:
        """Fraction of computed work that was padding; 0.0 before anything is recorded."""
        padded = self.padded(phase)
        return 1.0 - self._real[phase] / padded if padded else 0.0

    def as_dict(self) -> dict[str, dict[str, float]]:
        return {
            p: {"real": self._real[p], "padded": self._padded[p], "waste": self.waste(p)}
            for p in PHASES
        }
