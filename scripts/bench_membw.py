"""The machine's memory bandwidth as torch sees it: the floor under a batch-1 decode step.

    PYTHONPATH=. .venv/bin/python scripts/bench_membw.py [MIB [THREADS]]

A batch-1 step must read every weight once, so weight bytes / read bandwidth is the least time a
step can take. Times, on buffers far larger than the caches (default 1024 MiB, 2 threads): a copy
(`dst.copy_(src)`, counted as read + write), a read (a float32 `sum` over the same bytes) and a
bfloat16 matrix-vector product over a 576-column matrix (the model's hidden size, so the same
kernel shape as a decode projection). Best of 10 each, GB/s (10^9 bytes).
"""

import sys
import time

import torch

MIB = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 2)
n = MIB * 2**20 // 2  # bfloat16 elements
src = torch.ones(n, dtype=torch.bfloat16)
dst = torch.empty_like(src)
matrix = src[: n // 576 * 576].view(-1, 576)
vector = torch.ones(576, dtype=torch.bfloat16)


def best(fn, repeats=10):
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


nbytes = src.numel() * 2
copy = best(lambda: dst.copy_(src))
read = best(lambda: src.view(torch.float32).sum())
gemv = best(lambda: torch.mv(matrix, vector))
print(f"{MIB} MiB bf16, {torch.get_num_threads()} threads, best of 10:")
print(f"  copy  {2 * nbytes / copy / 1e9:6.1f} GB/s (read + write), {copy * 1e3:.1f} ms")
print(f"  read  {nbytes / read / 1e9:6.1f} GB/s (float32 sum), {read * 1e3:.1f} ms")
print(f"  mv    {matrix.numel() * 2 / gemv / 1e9:6.1f} GB/s (bf16 torch.mv, 576 columns)")
