"""On an eager CPU nothing compiles: warmup registers every planned shape without running it, so a
shard is ready in seconds, and strict mode still refuses any shape the plan does not have."""

import pytest

from engine.batch import Batch, Request, StoppingCriteriaParameters
from engine.devices.cpu.adapter import CPUAdapter
from engine.errors import UnwarmedShapeError
from engine.kv_cache import ShardBlockPool
from engine.serving.shard import Shard
from tests.conftest import tiny_config


def count_forwards(model) -> list:
    calls = []
    model.register_forward_hook(lambda module, args, out: calls.append(tuple(args[0].shape)))
    return calls


def test_eager_cpu_warmup_registers_every_bucket_and_runs_one_first_forward(tiny_model_dirs):
    """No bucket runs, but a one-token prompt and one decode step do, in a block freed after: a
    process's first forward pays one-time set-up that would otherwise fall on the first request."""
    shard = Shard(tiny_config(tiny_model_dirs["llama"], max_batch_size=4), show_progress=False)
    calls = count_forwards(shard.model)
    request = Request(
        1, "_test " * 8, stopping_parameters=StoppingCriteriaParameters(max_new_tokens=2)
    )
    shard.warmup(batch=Batch(7, [request], 1, 10))  # a router's warmup batch, as TGI sends one
    plan, warmed = shard.runner.plan, shard.adapter.shapes.warmed
    assert {("prefill", b) for b in plan.prefill} | {("decode", b) for b in plan.decode} <= warmed
    # no memory-profiling prefill, no bucket, no warmup batch: the first prompt and decode only
    assert len(calls) == 2
    assert shard.allocator.num_free == ShardBlockPool(shard.runner.kv_cache.num_blocks).num_free
    assert {b.batch_size for b in plan.decode} == {
        1,
        2,
        3,
        4,
    }  # nothing compiles: no step pads a row
    with pytest.raises(UnwarmedShapeError):
        shard.adapter.run(("decode", "a shape outside the plan"), shard.model)


def test_graph_modes_still_run_every_bucket():
    assert not CPUAdapter().warm_runs_forward
    assert CPUAdapter(graph_mode="compile").warm_runs_forward


def test_warmup_freezes_what_lives_as_long_as_the_shard(tiny_model_dirs):
    """The model, its cache and the warmed runner leave the collector's walks (gc.freeze): its older
    generations had walked them in the middle of decode steps. A new warmup unfreezes first, so
    what it replaces can still be collected."""
    import gc
    import weakref

    shard = Shard(tiny_config(tiny_model_dirs["llama"], max_batch_size=4), show_progress=False)
    gc.unfreeze()
    shard.warmup()
    frozen = gc.get_freeze_count()
    assert frozen > 0
    first = weakref.ref(shard.runner)
    shard.runner.cycle = shard.runner  # only the collector frees a cycle, and only unfrozen
    shard.warmup()
    gc.collect()
    assert first() is None
    gc.unfreeze()
