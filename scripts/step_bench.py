"""Milliseconds per decode step of the embedded model, at the given batch sizes.

    [STEP_THREADS=1] python scripts/step_bench.py --batches 1 2 4 8 32 128 --context 160 [--profile 1]
        [--dtype bfloat16] [--quantize int4]

Every row sits at about `--context` tokens of KV (rows differ a little, as in serving); the step is
the engine's own `ModelRunner.decode` (tensors built, forward, logits of the real rows). Prints the
median of `--steps` steps per batch; `--profile B` also prints torch.profiler's table for batch B.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine.config import EngineConfig
from engine.kv_cache import blocks_needed
from engine.runner import DecodeInput
from engine.serving.shard import Shard


def decode_rows(shard: Shard, batch: int, context: int) -> list[DecodeInput]:
    rows, block_size = [], shard.block_size
    for i in range(batch):
        position = context + (i * 7) % 32
        blocks = shard.allocator.allocate(blocks_needed(position + 1, block_size))
        slot = blocks[position // block_size] * block_size + position % block_size
        rows.append(DecodeInput(token_id=100 + i, position=position, slot=slot, blocks=blocks))
    return rows


def time_steps(shard: Shard, rows: list[DecodeInput], steps: int) -> tuple[float, float]:
    """Median wall and CPU (process time: all threads) milliseconds per step. On a shared machine
    the CPU time is the steadier figure; with one thread (STEP_THREADS=1) it is the work itself."""
    shard.runner.decode(rows)  # first call: allocator caches, lazy imports
    wall, cpu = [], []
    for _ in range(steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        shard.runner.decode(rows)
        wall.append((time.perf_counter() - start) * 1000)
        cpu.append((time.process_time() - start_cpu) * 1000)
    return statistics.median(wall), statistics.median(cpu)


class RecordedKernels:
    """engine.devices.cpu.kernels' module with every call wrapped in a profiler range: its C++
    functions are pybind calls, which torch.profiler does not see otherwise."""

    def __init__(self, module):
        self.module = module

    def __getattr__(self, name):
        from torch.profiler import record_function

        function = getattr(self.module, name)

        def recorded(*args, **kwargs):
            with record_function(f"bucketserve::{name}"):
                return function(*args, **kwargs)

        return recorded


def profile(shard: Shard, rows: list[DecodeInput]) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from engine.devices.cpu import kernels as cpu_kernels

    load, built = cpu_kernels.load, cpu_kernels.load()
    if built is not None:
        cpu_kernels.load = lambda: RecordedKernels(built)
    try:
        shard.runner.decode(rows)
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                shard.runner.decode(rows)
    finally:
        cpu_kernels.load = load
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def main() -> None:
    torch.set_num_threads(
        int(__import__("os").environ.get("STEP_THREADS", torch.get_num_threads()))
    )
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 32, 128])
    parser.add_argument("--context", type=int, default=160)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quantize", default="none", choices=["none", "int8", "int4"])
    parser.add_argument(
        "--profile", type=int, help="also print the profiler's table for this batch size"
    )
    args = parser.parse_args()
    top = max(args.batches)
    config = EngineConfig(
        device="cpu",
        dtype=args.dtype,
        max_batch_size=top,
        max_input_tokens=256,
        max_total_tokens=512,
        max_prefill_tokens=512,
        warmup_mode="full",
        quantize=args.quantize,
    )
    shard = Shard(config, show_progress=False)
    shard.warmup()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, quantize {args.quantize}, "
        f"context ~{args.context}"
    )
    for batch in args.batches:
        rows = decode_rows(shard, batch, args.context)
        wall, cpu = time_steps(shard, rows, args.steps)
        print(f"batch {batch:4d}: {wall:8.1f} ms/step wall, {cpu:8.1f} ms/step CPU")
        if batch == args.profile:
            profile(shard, rows)
        for row in rows:
            shard.allocator.free(row.blocks)


if __name__ == "__main__":
    main()
