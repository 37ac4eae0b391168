"""The CPU adapter's KV cache memory: zeros that cost nothing until used (start-up in seconds,
issue 16), and that are still zeros and writable in every dtype."""

import psutil
import pytest
import torch

from engine.devices.cpu.adapter import CPUAdapter
from engine.kv_cache import KVCache

MIB = 2**20


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_zeros_are_zero_and_writable(dtype):
    tensor = CPUAdapter().zeros((64, 3, 8), dtype)
    assert tensor.shape == (64, 3, 8) and tensor.dtype == dtype and not tensor.any()
    tensor.index_copy_(0, torch.tensor([5]), torch.ones(1, 3, 8, dtype=dtype))
    assert tensor.sum().item() == 24


def test_cpu_kv_cache_touches_no_memory_until_blocks_are_written():
    """512 MiB of cache: resident memory grows by the pages written, not by the cache's size
    (torch.zeros writes every byte at allocation)."""
    process = psutil.Process()
    before = process.memory_info().rss
    cache = KVCache(8, 4096, 16, 4, 64, torch.float32, torch.device("cpu"), CPUAdapter().zeros)
    assert process.memory_info().rss - before < 64 * MIB
    key_cache, _ = cache.layers[0]
    assert key_cache.shape == (4096 * 16, 4, 64) and not key_cache[-16:].any()
