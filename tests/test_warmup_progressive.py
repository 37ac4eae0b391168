"""Progressive warmup answers after a covering set and serves correct tokens while the rest warms."""

from __future__ import annotations

import threading

import engine.warmup.progressive
from engine.batch import Batch
from engine.serving.shard import Shard
from tests.conftest import tiny_config
from tests.helpers import reference_fixture
from tests.test_equivalence import PROMPTS
from tests.test_shard import drain, request

NEW_TOKENS = 20


expected = reference_fixture(PROMPTS, NEW_TOKENS)


def test_serves_reference_tokens_before_the_background_warmup_ends(
    tiny_model_dirs, expected, monkeypatch
):
    gate = threading.Event()
    real = engine.warmup.progressive.warm_buckets

    def gated(runner, buckets, *args, **kwargs):
        if args and args[2] == "background warmup":
            gate.wait(60)  # hold the background phase until the requests below are served
        return real(runner, buckets, *args, **kwargs)

    monkeypatch.setattr(engine.warmup.progressive, "warm_buckets", gated)
    shard = Shard(
        tiny_config(
            tiny_model_dirs["llama"],
            max_batch_size=4,
            warmup_mode="progressive",
            strict_shapes=True,
        ),
        show_progress=False,
    )
    shard.warmup()
    try:
        progress = shard.warmup_progress()
        # 3 covering buckets, and with prefix caching (the default) one for a chunk after the most context
        assert progress["warmed"] == 4 < progress["total"] and not progress["done"]
        tokens = {i: [] for i in range(4)}
        generations, cached = shard.prefill(Batch(1, [request(i, NEW_TOKENS) for i in range(4)]))
        for g in generations:
            tokens[g.request_id].append(g.tokens.ids[0])
        drain(shard, cached, tokens)
        assert [tokens[i] for i in range(4)] == expected[:4]
        assert shard.warmup_progress()["warmed"] == 4  # all of it served by the covering set
        assert not shard.adapter.shapes.unwarmed
    finally:
        gate.set()
        shard.background.join(120)
    assert shard.warmup_progress() == {
        "warmed": shard.runner.plan.graphs,
        "total": shard.runner.plan.graphs,
        "done": True,
    }
    assert set(shard.runner.plan.prefill + shard.runner.plan.decode) == {
        b.bucket for b in shard.warmup_log.buckets
    }


def test_covering_set_serves_any_batch_by_splitting():
    from engine.buckets.grid import BucketLimits, plan_buckets
    from engine.warmup.progressive import covering_set

    limits = BucketLimits(8, 128, 256, 512, 16, 100)
    plan = plan_buckets(limits, "exponential")
    cover = plan.subset(covering_set(plan, limits))
    assert cover.graphs == 3
    for lengths in ([128] * 8, [1, 64, 128, 7]):
        assert all(
            cover.prefill_bucket(len(g), max(lengths[i] for i in g))
            for g in cover.split_prefill(lengths)
        )
    for counts in ([16] * 6, [1] * 8, [16, 1, 3]):
        assert all(
            cover.decode_bucket(len(g), sum(counts[i] for i in g))
            for g in cover.split_decode(counts)
        )


def test_several_graph_shards_warm_in_full_before_answering(tiny_model_dirs, monkeypatch, caplog):
    """A background warmup forward on one rank would meet another rank's serving step in a
    collective, so with several ranks on a device whose warmup runs forwards, progressive warms
    everything first. The shard here is one process; the adapter is told it is one of two ranks."""
    shard = Shard(
        tiny_config(tiny_model_dirs["llama"], max_batch_size=2, warmup_mode="progressive"),
        show_progress=False,
    )
    monkeypatch.setattr(shard.adapter, "world_size", 2)
    monkeypatch.setattr(type(shard.adapter), "warm_runs_forward", property(lambda adapter: True))
    with caplog.at_level("WARNING", logger="engine.warmup.run"):
        shard.warmup()
    assert shard.background is None
    assert {b.bucket for b in shard.warmup_log.buckets} == set(
        shard.runner.plan.prefill + shard.runner.plan.decode
    )
    assert "out of step" in caplog.text


def test_progressive_stays_where_no_collective_is_at_stake():
    from types import SimpleNamespace

    from engine.warmup.run import lockstep_mode

    eager_pair = SimpleNamespace(world_size=2, warm_runs_forward=False)
    lone_graph = SimpleNamespace(world_size=1, warm_runs_forward=True)
    graph_pair = SimpleNamespace(
        world_size=2, warm_runs_forward=True, name="hpu", graph_mode="lazy"
    )
    assert lockstep_mode("progressive", eager_pair) == "progressive"
    assert lockstep_mode("progressive", lone_graph) == "progressive"
    assert lockstep_mode("progressive", graph_pair) == "full"
    assert lockstep_mode("none", graph_pair) == "none"


def test_a_waiting_step_goes_before_the_next_background_bucket():
    """The background thread holds the device lock one bucket at a time; a step that asks for it gets
    it after the bucket in progress, not after every remaining bucket (a plain lock is not fair: its
    releasing thread usually takes it again at once)."""
    import time

    from engine.warmup.progressive import BackgroundTurn, DeviceLock

    lock, turns, started = DeviceLock(), [], threading.Event()

    def background():
        for i in range(300):
            with BackgroundTurn(lock):
                turns.append(i)
                started.set()
                time.sleep(0.002)  # a bucket's compile, shortened

    thread = threading.Thread(target=background)
    thread.start()
    started.wait(10)
    asked = len(turns)
    with lock:
        waited = len(turns) - asked
    thread.join()
    assert waited <= 2, f"the step waited for {waited} background buckets"
