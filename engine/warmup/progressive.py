"""Progressive warmup: warm a covering set, answer healthy, warm the rest in the background.

The runner only ever chooses among warmed buckets: its plan is swapped for the warmed subset
after each bucket, under the lock that serving holds for a whole step. So a batch never reaches
the device at an unwarmed shape; before a better bucket is warmed it is split over the covering
ones (more forwards, same tokens).
"""

from __future__ import annotations

import threading
import time

from engine.buckets.grid import BucketLimits, BucketPlan, DecodeBucket
from engine.warmup.warm import PhaseLog, bucket_size, describe, report, warm_buckets


class DeviceLock:
    """The lock a serving step holds for its whole run, and the background warmup for one bucket.
    Steps come first: the background thread takes its turn only when no step waits. A plain lock
    is not fair: the thread that just released it usually takes it again, and a Warmup or Prefill
    RPC waited behind every remaining bucket (seen: 35 s, the whole background phase)."""

    def __init__(self):
        self._lock = threading.RLock()
        self._count = threading.Lock()
        self._waiting = 0

    def __enter__(self) -> DeviceLock:
        with self._count:
            self._waiting += 1
        self._lock.acquire()
        with self._count:
            self._waiting -= 1
        return self

    def __exit__(self, *exc) -> None:
        self._lock.release()

    def acquire_when_idle(self) -> None:
        while True:
            self._lock.acquire()
            if not self._waiting:
                return
            self._lock.release()
            time.sleep(0.001)  # a waiting step takes the lock now

    def release(self) -> None:
        self._lock.release()


class BackgroundTurn:
    """The device lock as the background warmup takes it: after any step that waits for it."""

    def __init__(self, lock: DeviceLock):
        self.lock = lock

    def __enter__(self) -> None:
        self.lock.acquire_when_idle()

    def __exit__(self, *exc) -> None:
        self.lock.release()


def covering_set(plan: BucketPlan, limits: BucketLimits) -> list:
    """Buckets enough to serve any batch within the limits, by splitting it:
    - the prefill bucket for one prompt of max_input_tokens (split_prefill can run every prompt
    alone);
    - the decode bucket for one sequence of max_total_tokens (split_decode can run every row alone);
    - the decode bucket for a full batch of full sequences, so that decoding, a forward per
      generated token, does not run one forward per row while the rest warms;
    - with context buckets (prefix caching), the one for a longest chunk after the most context."""
    top = min(limits.max_batch_size, limits.max_kv_blocks)
    wanted = [
        plan.prefill_bucket(1, limits.max_input_tokens),
        plan.decode_bucket(1, min(limits.blocks_per_sequence, limits.max_kv_blocks)),
        plan.decode_bucket(top, min(top * limits.blocks_per_sequence, limits.max_kv_blocks)),
    ]
    top_context = max((b.context_blocks for b in plan.prefill), default=0)
    if top_context:
        wanted.append(plan.prefill_bucket(1, limits.max_input_tokens, top_context))
    if None in wanted:
        raise ValueError(
            "the bucket plan does not cover the limits: progressive warmup has no covering set"
        )
    return list(dict.fromkeys(wanted))


def background_order(buckets) -> list:
    """Decode first (a decode forward per generated token: most forwards are decodes), smallest
    batches first within a phase (cheapest to warm, and light load uses them)."""
    return sorted(
        buckets, key=lambda b: (not isinstance(b, DecodeBucket), b.batch_size, bucket_size(b))
    )


class BackgroundWarmup:
    """The thread warming the buckets left after the covering set."""

    def __init__(
        self,
        runner,
        plan: BucketPlan,
        warmed: set,
        remaining: list,
        prompt_logprobs: bool,
        show_progress: bool,
        lock,
        phases: PhaseLog,
    ):
        self.runner, self.plan, self.warmed, self.remaining = runner, plan, warmed, remaining
        self.total = plan.graphs
        self._stop = threading.Event()
        # A plain lock (tests pass one) is taken as it is; the shard's DeviceLock lets steps go
        # first.
        turn = BackgroundTurn(lock) if isinstance(lock, DeviceLock) else lock
        self._args = (prompt_logprobs, show_progress, turn, phases)
        self.thread = threading.Thread(target=self._run, name="background-warmup", daemon=True)
        self.error: BaseException | None = None

    def _on_warmed(self, bucket) -> None:
        self.warmed.add(bucket)
        self.runner.plan = self.plan.subset(self.warmed)  # under the lock: no step is running

    def _run(self) -> None:
        prompt_logprobs, show_progress, lock, phases = self._args
        try:
            phases.buckets += warm_buckets(
                self.runner,
                self.remaining,
                prompt_logprobs,
                show_progress,
                "background warmup",
                lock,
                self._on_warmed,
                self._stop,
            )
        except BaseException as err:  # noqa: BLE001 - serving goes on with the buckets warmed so far
            self.error = err
            report(
                f"background warmup failed after {len(self.warmed)}/{self.total} buckets: {err}",
                True,
            )
            return
        if not self._stop.is_set():
            phases.mark("background buckets")
            report(
                f"warmup progressive: all {self.total} buckets warm in {phases.summary()}",
                show_progress,
            )

    @property
    def done(self) -> bool:
        return len(self.warmed) == self.total

    def progress(self) -> dict:
        return {"warmed": len(self.warmed), "total": self.total, "done": self.done}

    def stop(self) -> None:
        """Stop after the bucket being warmed (a re-warmup replaces the runner this one warms)."""
        self._stop.set()
        self.thread.join()

    def join(self, timeout: float | None = None) -> None:
        self.thread.join(timeout)


def start_progressive(
    runner,
    plan: BucketPlan,
    limits: BucketLimits,
    prompt_logprobs: bool,
    show_progress: bool,
    lock,
    phases: PhaseLog,
) -> BackgroundWarmup:
    cover = covering_set(plan, limits)
    warmed: set = set()
    runner.plan = plan.subset(warmed)
    phases.buckets += warm_buckets(
        runner,
        cover,
        prompt_logprobs,
        show_progress,
        "warmup (covering set)",
        lock,
        lambda bucket: (warmed.add(bucket), setattr(runner, "plan", plan.subset(warmed))),
    )
    phases.mark("covering buckets")
    remaining = background_order([b for b in plan.buckets if b not in warmed])
    report(
        f"warmup progressive: {len(cover)} covering buckets in {phases.summary()}; healthy, "
        f"{len(remaining)} more warming in the background: "
        + ", ".join(describe(b) for b in cover),
        show_progress,
    )
    background = BackgroundWarmup(
        runner, plan, warmed, remaining, prompt_logprobs, show_progress, lock, phases
    )
    background.thread.start()
    return background
