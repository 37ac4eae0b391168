"""The router's block allocator: no block twice, never block 0, free gives everything back."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.errors import CapacityError
from router.sched.allocator import Allocation, BlockAllocator


def test_lowest_blocks_first_and_slots_follow_blocks():
    allocator = BlockAllocator(num_blocks=8, block_size=4)
    first = allocator.allocate(6)
    assert first == Allocation(blocks=(1, 2), slots=(4, 5, 6, 7, 8, 9))
    second = allocator.allocate(1)
    assert second.blocks == (3,) and second.slots == (12,)
    allocator.free(first)
    assert allocator.allocate(4).blocks == (1,)  # a freed low block is reused before higher ones


def test_counts_capacity_and_idle():
    allocator = BlockAllocator(num_blocks=4, block_size=16)
    assert allocator.idle and allocator.num_free == 3 and allocator.num_used == 0
    assert allocator.can_allocate(48) and not allocator.can_allocate(49)
    with pytest.raises(CapacityError):
        allocator.allocate(49)
    assert allocator.idle  # a refused allocation takes nothing
    taken = allocator.allocate(17)
    assert (allocator.num_free, allocator.num_used, allocator.idle) == (1, 2, False)
    allocator.free(taken)
    assert allocator.idle and allocator.num_free == 3


def test_zero_tokens_get_no_blocks():
    allocator = BlockAllocator(num_blocks=2, block_size=16)
    assert allocator.allocate(0) == Allocation((), ())
    assert allocator.idle


def test_double_free_and_foreign_blocks_are_refused():
    allocator = BlockAllocator(num_blocks=4, block_size=2)
    taken = allocator.allocate(3)
    allocator.free(taken)
    with pytest.raises(ValueError, match="not allocated"):
        allocator.free(taken)
    with pytest.raises(ValueError):
        allocator.free(Allocation((0,), (0,)))  # the reserved block was never handed out
    assert allocator.num_free == 3


@settings(max_examples=200, deadline=None)
@given(
    num_blocks=st.integers(1, 12),
    block_size=st.integers(1, 5),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 30)), max_size=40),
)
def test_random_allocate_and_free(num_blocks, block_size, ops):
    allocator = BlockAllocator(num_blocks, block_size)
    live: list[Allocation] = []
    for do_allocate, n in ops:
        if do_allocate:
            if not allocator.can_allocate(n):
                with pytest.raises(CapacityError):
                    allocator.allocate(n)
                continue
            got = allocator.allocate(n)
            assert len(got.slots) == n and len(got.blocks) == -(-n // block_size)
            assert all(
                slot // block_size == got.blocks[i // block_size]
                for i, slot in enumerate(got.slots)
            )
            assert all(slot % block_size == i % block_size for i, slot in enumerate(got.slots))
            live.append(got)
        elif live:
            allocator.free(live.pop(n % len(live)))
        held = [b for a in live for b in a.blocks]
        assert len(held) == len(set(held)) and 0 not in held
        assert allocator.num_used == len(held) and allocator.num_free == num_blocks - 1 - len(held)
    for allocation in live:
        allocator.free(allocation)
    assert allocator.idle and allocator.num_free == num_blocks - 1
