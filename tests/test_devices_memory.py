"""Device memory for graphs (finding 8) and the health probe's place in the device lock (finding 7)."""

import logging
import threading

import torch

from engine.buckets.grid import DecodeBucket
from engine.serving.shard import Shard
from engine.warmup.warm import warm_buckets, warmup_order
from tests.fakes.tiny import PLAN, next_steps, prompts, runner_for, tiny_model
from tests.test_devices_hpu import habana, hpu, reference_logits  # noqa: F401 - the fixture

MIB = 1 << 20


def test_the_kv_cache_leaves_memory_for_graphs_only_where_they_are_captured():
    from engine.warmup.budget import split_free_memory

    assert split_free_memory(100 * MIB, 0.9, 0.1, captures_graphs=True) == (81 * MIB, 9 * MIB)
    assert split_free_memory(100 * MIB, 0.9, 0.1, captures_graphs=False) == (90 * MIB, 0)


def test_graphs_are_captured_within_their_budget_and_the_rest_run_without(habana, caplog):
    # Each graph holds 1 MiB; 3.5 MiB are free and 2.5 MiB of them are the graphs' budget. Without a
    # budget the fake runs out of device memory at the fourth capture, as the device would.
    from engine.warmup.budget import GraphBudget

    habana.graph_bytes, habana.memory = MIB, (int(3.5 * MIB), 96 << 30)
    adapter = hpu()
    runner = runner_for(tiny_model(), adapter)
    adapter.graph_budget = GraphBudget(adapter, int(2.5 * MIB))
    with caplog.at_level(logging.WARNING, logger="engine.warmup.budget"):
        warm_buckets(runner, warmup_order(PLAN.prefill + PLAN.decode), False, False)
    # The largest prefill's graph spends the prefill share (1.25 MiB); the first decode graph leaves
    # 1.5 MiB, and another would go below the 1 MiB that the budget must leave free.
    assert len(habana.captures) == 2 and habana.memory[0] == int(1.5 * MIB)
    dropped = [
        ("prefill", PLAN.prefill[0]),
        ("decode", DecodeBucket(2, 8)),
        ("decode", DecodeBucket(2, 4)),
    ]
    assert adapter.shapes.without_graph == set(dropped) and adapter.shapes.warmed >= set(dropped)
    assert caplog.records[-1].getMessage() == (
        "graph memory budget (2.5 MiB) spent: 3 bucket(s) run without a graph: prefill bs=1 seq=8, "
        "decode bs=2 blocks=8, decode bs=2 blocks=4"
    )
    prefill, decode = (
        runner.prefill(prompts()).logits,
        runner.decode(next_steps()),
    )  # without a graph
    assert habana.bypasses and len(habana.captures) == 2
    expected_prefill, expected_decode = reference_logits()
    torch.testing.assert_close(prefill, expected_prefill)
    torch.testing.assert_close(decode, expected_decode)


def test_health_waits_for_the_device_lock():
    # Finding 7: the probe's device op must not run in the middle of a graph capture.
    from engine.devices import get_adapter

    shard = Shard.__new__(Shard)
    shard.adapter, shard.device_lock = get_adapter("cpu"), threading.RLock()
    held = []
    shard.adapter.synchronize = lambda: held.append(shard.device_lock._is_owned())
    shard.health()
    assert held == [True]
