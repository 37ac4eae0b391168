"""Host-side agreement between ranks (finding 4) on real gloo processes whose default group answers
as an accelerator backend would: it refuses CPU tensors (tests/fakes/distributed.py)."""

import pytest

from tests.fakes.distributed import run_ranks


def agree(rank: int, world_size: int, backend: str, port: int):
    """One rank: join the group as a shard does, then agree on the two host values shards share."""
    from engine.distributed import Parallel, broadcast_int, init_distributed, min_across_ranks

    parallel = Parallel(rank, world_size)
    init_distributed(parallel, backend, "127.0.0.1", port)
    return min_across_ranks(100 + rank, parallel), broadcast_int(7 + rank, parallel)


def refuse_cpu(rank: int, world_size: int, backend: str, port: int):
    """The fake itself: a CPU tensor on the device group is refused, as by hccl, nccl or xccl."""
    import torch
    import torch.distributed as dist

    dist.init_process_group(
        backend=backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    dist.all_reduce(torch.ones(1))


@pytest.mark.parametrize("backend", ["hccl", "nccl"])
def test_ranks_agree_on_host_values_over_an_accelerator_group(backend):
    results = run_ranks(agree, 2, backend)
    assert results == {0: ("ok", (100, 7)), 1: ("ok", (100, 7))}, results


def test_the_fake_group_refuses_cpu_tensors_like_an_accelerator_backend():
    results = run_ranks(refuse_cpu, 2, "hccl")
    assert all(
        status == "error" and "No backend type associated with device type cpu" in message
        for status, message in results.values()
    ), results
