import pytest
import torch

from engine.errors import CapacityError
from engine.kv_cache import RESERVED_BLOCK, KVCache, ShardBlockPool, blocks_needed, slots_for


def test_allocator_never_hands_out_the_reserved_block_and_prefers_low_ids():
    allocator = ShardBlockPool(6)
    assert allocator.num_free == 5
    first = allocator.allocate(3)
    assert first == [1, 2, 3] and RESERVED_BLOCK not in first
    allocator.free([2])
    assert allocator.allocate(2) == [2, 4]


def test_allocator_refuses_what_it_cannot_hold():
    allocator = ShardBlockPool(4)
    assert allocator.can_allocate(3) and not allocator.can_allocate(4)
    with pytest.raises(CapacityError, match="4 blocks needed, 3 free"):
        allocator.allocate(4)
    assert allocator.num_free == 3  # a refused allocation takes nothing


def test_slots_follow_blocks():
    assert slots_for([7, 2], 0, 6, 4) == [28, 29, 30, 31, 8, 9]
    assert slots_for([7, 2], 5, 6, 4) == [9]
    assert blocks_needed(9, 4) == 3 and blocks_needed(8, 4) == 2


def test_cache_layout_and_capacity():
    cache = KVCache(
        num_layers=3,
        num_blocks=5,
        block_size=4,
        kv_heads=2,
        head_dim=8,
        dtype=torch.float32,
        device="cpu",
    )
    assert len(cache.layers) == 3
    assert cache.layers[0][0].shape == (20, 2, 8)
    assert cache.capacity_tokens == 16
    assert KVCache.bytes_per_block(3, 4, 2, 8, torch.bfloat16) == 2 * 3 * 4 * 2 * 8 * 2
