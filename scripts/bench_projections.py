"""A bfloat16 decode step with bucketserve's projection kernel against the same step through torch's
F.linear, alternating step by step in one process (on a shared machine, outside load then moves
both sides alike).

    python scripts/bench_projections.py --batches 1 8 32 128 [--context 160] [--steps 12]

The shard is the embedded model's, as `engine serve` builds it in bfloat16 (with the fused
attention and norm kernels either way), its layers run as modules rather than the fused decode step,
which reads the packed weights itself; "torch" swaps every projection's kernel for F.linear over
its plain weight, unpacked from the kernel's layout. Prints the median milliseconds per step of
each and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from step_bench import decode_rows

from engine.config import EngineConfig
from engine.devices.cpu import kernels as cpu_kernels
from engine.serving.shard import Shard


class TorchLinear(torch.nn.Module):
    kind = "torch"

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = weight

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight)


def plain_weight(kernel) -> torch.Tensor:
    if isinstance(kernel, cpu_kernels.AmxLinear):  # [blocks, K/2, 32, 2] -> [N, K]
        blocks, pairs, width, _ = kernel.packed.shape
        full = kernel.packed.permute(0, 2, 1, 3).reshape(blocks * width, pairs * 2)
        return full[: kernel.out_features].contiguous()
    return kernel.weight


def swaps(shard: Shard) -> list[tuple[torch.nn.Module, object, TorchLinear]]:
    """(module, its kernel, the F.linear stand-in) for every projection the kernels took."""
    found = []
    for module in shard.model.modules():
        kernel = getattr(module, "quantized", None)
        if isinstance(kernel, cpu_kernels.AmxLinear):  # DotLinear is one too
            found.append((module, kernel, TorchLinear(plain_weight(kernel))))
    return found


def step_ms(shard: Shard, rows) -> float:
    start = time.perf_counter()
    shard.runner.decode(rows)
    return (time.perf_counter() - start) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--context", type=int, default=160)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    config = EngineConfig(
        device="cpu",
        dtype="bfloat16",
        max_batch_size=max(args.batches),
        max_input_tokens=256,
        max_total_tokens=512,
        max_prefill_tokens=512,
        warmup_mode="full",
    )
    shard = Shard(config, show_progress=False)
    shard.warmup()  # sizes the KV cache
    # Both sides run the layers as modules, whose projections the swap reaches (the fused decode
    # step reads the packed weights itself).
    shard.model.fused_decode = None
    pairs = swaps(shard)
    if not pairs:
        raise SystemExit("no projection went through bucketserve's kernels on this CPU")
    kind = pairs[0][1].kind
    print(f"{len(pairs)} projections, kernel {kind}, {torch.get_num_threads()} threads")
    for batch in args.batches:
        rows = decode_rows(shard, batch, args.context)
        times = {kind: [], "torch": []}
        for step in range(2 * args.steps + 2):
            side = kind if step % 2 == 0 else "torch"
            for module, kernel, plain in pairs:
                module.quantized = kernel if side == kind else plain
            elapsed = step_ms(shard, rows)
            if step >= 2:  # each side's first step warms its caches
                times[side].append(elapsed)
        ours, theirs = statistics.median(times[kind]), statistics.median(times["torch"])
        print(
            f"batch {batch:4d}: {kind} {ours:7.1f} ms, F.linear {theirs:7.1f} ms, "
            f"{theirs / ours:.2f}x"
        )
        for module, kernel, _ in pairs:
            module.quantized = kernel
        for row in rows:
            shard.allocator.free(row.blocks)


if __name__ == "__main__":
    main()
