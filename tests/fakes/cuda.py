"""A fake CUDA graph that really records and replays, on CPU (tests/fakes/recording.py), as
torch.cuda.CUDAGraph does (pytorch/pytorch v2.7.1, torch/cuda/graphs.py): a replay computes from
whatever the static input buffers hold now, so a caller that forgets to copy fresh inputs in gets
stale results, and a host synchronisation during capture (`.item()`) fails.

And a fake caching allocator behind `mem_get_info` (pytorch/pytorch v2.7.1,
c10/cuda/CUDACachingAllocator.cpp and torch/cuda/memory.py): a freed tensor's memory stays
reserved by the process for reuse, and cudaMemGetInfo counts reserved memory as used, until
`torch.cuda.empty_cache()` releases the cached blocks that nothing holds. The tensors counted are
those made by torch.zeros and torch.empty (the weights' and the KV cache's allocations; on this CPU
build the "device" tensors live in host memory).
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch

from tests.fakes.recording import RecordedOps, recording


class FakeCUDAGraph(RecordedOps):
    instances: list[FakeCUDAGraph] = []

    def __init__(self):
        super().__init__()
        self.pool_used = None
        FakeCUDAGraph.instances.append(self)


@contextmanager
def fake_graph(graph: FakeCUDAGraph, pool=None):
    graph.pool_used = pool
    with recording(graph):
        yield


class CachingAllocator:
    """Reserved memory grows with the live tensors' high-water mark and shrinks only on
    empty_cache(), to what is still live; free = total - reserved - what other processes use,
    as cudaMemGetInfo reports it."""

    def __init__(self, total: int, elsewhere: int = 0):
        self.total, self.elsewhere, self.allocated, self.reserved = total, elsewhere, 0, 0

    def track(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()  # freed when the last tensor on it goes
        size = storage.nbytes()
        self.allocated += size
        self.reserved = max(self.reserved, self.allocated)
        weakref.finalize(storage, self._free, size)
        return tensor

    def _free(self, size: int) -> None:
        self.allocated -= size

    def empty_cache(self) -> None:
        self.reserved = self.allocated

    def mem_get_info(self, index=None) -> tuple[int, int]:
        return self.total - self.elsewhere - self.reserved, self.total


def _counted(allocate, allocator: CachingAllocator):
    def wrapper(*args, **kwargs):
        return allocator.track(allocate(*args, **kwargs))

    return wrapper


FP8_TYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def scaled_mm(
    mat1,
    mat2,
    scale_a,
    scale_b,
    bias=None,
    scale_result=None,
    out_dtype=None,
    use_fast_accum=False,
    *,
    capability=(9, 0),
):
    """torch._scaled_mm with the refusals of _scaled_mm_out_cuda (pytorch/pytorch
    aten/src/ATen/native/cuda/Blas.cpp @960a68465f6172d22bff1a58a61f942363ff0931) for
    tensor-wise and row-wise scaling, computed in float32 on CPU."""
    if capability < (8, 9):
        raise RuntimeError(
            "torch._scaled_mm is only supported on CUDA devices with compute capability >= 9.0 "
            "or 8.9, or ROCm MI300+"
        )
    if mat1.dim() != 2 or mat2.dim() != 2:
        raise RuntimeError("mat1 must be a matrix" if mat1.dim() != 2 else "mat2 must be a matrix")
    (m, k), (k2, n) = mat1.shape, mat2.shape
    if k != k2:
        raise RuntimeError(f"mat1 and mat2 shapes cannot be multiplied ({m}x{k} and {k2}x{n})")
    tensorwise = scale_a.numel() == 1 and scale_b.numel() == 1
    rowwise = (
        tuple(scale_a.shape) == (m, 1)
        and tuple(scale_b.shape) == (1, n)
        and scale_a.is_contiguous()
        and scale_b.is_contiguous()
    )
    floats = scale_a.dtype == torch.float32 and scale_b.dtype == torch.float32
    if not (floats and mat1.dtype in FP8_TYPES and mat2.dtype in FP8_TYPES) or not (
        tensorwise or rowwise
    ):
        raise RuntimeError(
            "Invalid scaling configuration.\n- For TensorWise scaling, a and b should be float8, "
            "scales should be float and singletons.\n- For RowWise scaling, a and b should be "
            f"float8, scales should be float, scale_a should be ({m}, 1) and scale_b should be "
            f"(1, {n}), and both should be contiguous.\nGot a.dtype()={mat1.dtype}, "
            f"scale_a.dtype()={scale_a.dtype}, scale_a.size()={list(scale_a.shape)}, "
            f"b.dtype()={mat2.dtype}, scale_b.dtype()={scale_b.dtype}, "
            f"scale_b.size()={list(scale_b.shape)}"
        )
    if bias is not None and bias.numel() != n:
        raise RuntimeError(f"Bias must be size {n} but got {bias.numel()}")
    if k % 16:
        raise RuntimeError(
            f"Expected trailing dimension of mat1 to be divisible by 16 but got mat1 shape: "
            f"({m}x{k})."
        )
    if k2 % 16 or n % 16:
        raise RuntimeError(f"mat2 shape ({k2}x{n}) must be divisible by 16")
    if mat1.dtype == torch.float8_e5m2 and mat2.dtype == torch.float8_e5m2:
        raise RuntimeError("Multiplication of two Float8_e5m2 matrices is not supported")
    out_dtype = out_dtype or mat1.dtype
    if rowwise and not tensorwise and out_dtype != torch.bfloat16:
        raise RuntimeError(
            "Only bf16 high precision output types are supported for row-wise scaling."
        )
    if not (mat1.stride(1) == 1 and mat2.stride(0) == 1):
        raise RuntimeError(
            "Only multiplication of row-major and column-major matrices is supported by cuBLASLt"
        )
    out = (mat1.float() * scale_a.float()) @ (mat2.float() * scale_b.float())
    return (out if bias is None else out + bias.float()).to(out_dtype)


def install(
    monkeypatch,
    devices: int = 2,
    hip: str | None = None,
    memory: int = 80 << 30,
    elsewhere: int = 40 << 30,
    capability: tuple[int, int] = (9, 0),
) -> dict:
    """Make this CPU build of torch look like a CUDA (or, with `hip`, a ROCm) build with `devices`
    GPUs of `memory` bytes, `elsewhere` of them used by other processes (calls["allocator"] is
    the caching allocator behind mem_get_info)."""
    allocator = CachingAllocator(memory, elsewhere)
    calls = {"set_device": [], "pool_handles": 0, "allocator": allocator}
    monkeypatch.setattr(torch, "zeros", _counted(torch.zeros, allocator))
    monkeypatch.setattr(torch, "empty", _counted(torch.empty, allocator))

    def pool_handle():
        calls["pool_handles"] += 1
        return ("pool", calls["pool_handles"])

    FakeCUDAGraph.instances.clear()
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.version, "hip", hip)
    for name, value in dict(
        is_available=lambda: True,
        device_count=lambda: devices,
        set_device=calls["set_device"].append,
        synchronize=lambda index=None: None,
        mem_get_info=allocator.mem_get_info,
        get_device_capability=lambda index=None: capability,
        empty_cache=allocator.empty_cache,
        CUDAGraph=FakeCUDAGraph,
        graph=fake_graph,
        graph_pool_handle=pool_handle,
    ).items():
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(
        torch, "_scaled_mm", lambda *a, **k: scaled_mm(*a, **k, capability=capability)
    )
    return calls
