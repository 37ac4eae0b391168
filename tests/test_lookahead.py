"""Decode lookahead (async scheduling: engine/serving/lookahead.py, router/sched/scheduler.py).

A step that takes its logits from a forward run early gives the tokens, and the seeded draws, it
would have given without one, and runs no forward of its own; rows that joined since run alone;
a row whose next position needs a block it does not hold yet is not looked ahead. The router asks
for a lookahead only while nothing waits, and then decodes the same batch before admitting anyone.
"""

import asyncio
import dataclasses
import logging

import pytest

from engine.batch import Batch, NextTokenChooserParameters, Request
from engine.errors import InvalidRequestError
from router.client import InProcessClient
from router.sched.allocator import BlockAllocator
from router.sched.scheduler import Scheduler
from tests.helpers import build_request, reference_fixture, shard_fixture
from tests.test_equivalence import PROMPTS
from tests.test_router_scheduler import (
    LIMITS,
    RecordingClient,
    consume,
    full_allocator,
    make_request,
)

NEW = 24
SEEDED = NextTokenChooserParameters(temperature=0.9, top_k=20, do_sample=True, seed=1234)


shard = shard_fixture(max_batch_size=4)
expected = reference_fixture(PROMPTS, NEW)


def request(i: int, new: int = NEW, sampled: bool = False, **blocks) -> Request:
    return build_request(i, new, parameters=SEEDED if sampled else None, **blocks)


def collect(tokens: dict, result):
    generations, cached = result
    for generation in generations:
        tokens.setdefault(generation.request_id, []).extend(generation.tokens.ids)
    return cached


def forwards(shard) -> int:
    return shard.serving_stats()["decode_forwards"]


def decode_all(shard, tokens: dict, cached, look_ahead: bool) -> list[int]:
    """Decode to the end; the decode forwards each step ran itself."""
    ran = []
    while cached is not None:
        before = forwards(shard)
        cached = collect(tokens, shard.decode([cached]))
        ran.append(forwards(shard) - before)
        timings = shard.last_timings  # an early forward counts as the step's: no negative remainder
        assert min(timings.forward_ns, timings.decode_ns, timings.total_ns) >= 0
        if look_ahead and cached is not None:
            shard.look_ahead(cached.id)
    return ran


def test_a_looked_ahead_step_gives_the_same_tokens_and_draws_without_a_forward(shard, expected):
    results = {}
    for look_ahead in (False, True):
        shard.clear()
        tokens = {}
        cached = collect(
            tokens, shard.prefill(Batch(1, [request(0), request(1), request(2, sampled=True)]))
        )
        steps_before = shard.serving_stats()["lookahead_steps"]
        ran = decode_all(shard, tokens, cached, look_ahead)
        results[look_ahead] = tokens, ran, shard.serving_stats()["lookahead_steps"] - steps_before
    (plain, plain_ran, _), (ahead, ahead_ran, used) = results[False], results[True]
    assert ahead == plain  # greedy rows and the seeded sampling row alike
    assert [plain[0], plain[1]] == [expected[0], expected[1]]
    assert plain_ran == [1] * (NEW - 1)
    assert ahead_ran == [1] + [0] * (NEW - 2)  # only the first step ran its own forward
    assert used == NEW - 2


def test_rows_that_joined_run_alone_and_a_filtered_row_is_skipped(shard, expected):
    """Prefill A, decode, look ahead; prefill B; drop a row of A; decode A+B to the end."""
    results = {}
    for look_ahead in (False, True):
        shard.clear()
        tokens = {}
        first = collect(tokens, shard.prefill(Batch(1, [request(0), request(1), request(2)])))
        first = collect(tokens, shard.decode([first]))
        if look_ahead:
            shard.look_ahead(first.id)
        second = collect(tokens, shard.prefill(Batch(2, [request(3)])))
        first = shard.filter(first.id, [0, 2])
        real_rows = shard.serving_stats()["decode_real"]
        cached = collect(tokens, shard.decode([first, second]))
        joined_rows = shard.serving_stats()["decode_real"] - real_rows
        decode_all(shard, tokens, cached, look_ahead)
        results[look_ahead] = tokens, joined_rows
    (plain, plain_rows), (ahead, ahead_rows) = results[False], results[True]
    assert ahead == plain
    assert [ahead[i] for i in (0, 2, 3)] == [expected[i] for i in (0, 2, 3)]
    assert (plain_rows, ahead_rows) == (3, 1)  # with the lookahead only B's row was computed
    assert len(ahead[1]) == 2  # dropped after its prefill token and one decode token


def test_no_lookahead_into_a_block_the_row_does_not_hold(shard, expected, caplog):
    """The router adds blocks on demand: at a block's end the lookahead waits for the step's grown block."""
    shard.clear()
    caplog.set_level(logging.WARNING)
    allocator = BlockAllocator(shard.allocator.num_blocks, shard.block_size)
    prompt_len = len(shard.tokenizer(PROMPTS[1])["input_ids"])
    held = allocator.allocate(prompt_len + 1)
    blocks = list(held.blocks)
    tokens = {}
    cached = collect(tokens, shard.prefill(Batch(1, [request(1, blocks=blocks, slots=[])])))
    while len(shard.batches[cached.id][0].token_ids) <= len(blocks) * shard.block_size:
        cached = collect(tokens, shard.decode([cached]))
        shard.look_ahead(cached.id)
    assert (
        shard.ahead is None
    )  # its next position is in a block it does not hold yet: not even tried
    assert "lookahead" not in caplog.text
    with pytest.raises(InvalidRequestError, match="KV blocks are full"):
        shard.decode([cached])
    grown = allocator.allocate(2 * shard.block_size)  # room for the rest of its tokens
    cached = collect(tokens, shard.decode([cached], {1: list(grown.blocks)}))
    shard.look_ahead(cached.id)
    assert shard.ahead is not None
    decode_all(shard, tokens, cached, look_ahead=True)
    assert tokens[1] == expected[1]


def test_a_lookahead_holds_for_the_sequence_and_length_it_ran_at(shard):
    shard.clear()
    shard.prefill(Batch(1, [request(0), request(1)]))
    sequences = shard.batches[1]
    shard.look_ahead(1)
    ahead = shard.ahead
    assert [ahead.row_of(s) for s in sequences] == [0, 1] and ahead.covers(sequences)
    sequences[1].token_ids.append(7)  # a longer sequence: the early logits are not its next ones
    twin = dataclasses.replace(sequences[0])  # the same request id in another sequence
    assert ahead.row_of(sequences[1]) is None and ahead.row_of(twin) is None
    assert not ahead.covers([sequences[1], twin])


class FlagRecordingClient(RecordingClient):
    async def decode(self, batches, *grown, **options):
        self.calls.append(("look_ahead", options.get("look_ahead", False)))
        return await super().decode(batches, *grown, **options)


def test_the_router_asks_only_while_nothing_waits_and_then_decodes_that_batch(shard, expected):
    """Requests 0-1 run alone for a while; 2-3 arrive mid-way: no lookahead while they wait, and
    none is split by their admission."""
    allocator = full_allocator(shard.runner.kv_cache.capacity_tokens)
    lengths = [len(shard.tokenizer(p)["input_ids"]) for p in PROMPTS]

    async def run():
        client = FlagRecordingClient(InProcessClient(shard, max_batch_size=LIMITS.max_batch_size))
        scheduler = Scheduler(client, allocator, LIMITS, lookahead=True)
        await scheduler.start()
        try:
            early = [scheduler.submit(make_request(i, NEW), lengths[i]) for i in (0, 1)]
            while len(client.named("decode")) < 5:
                await asyncio.sleep(0.001)
            late = [scheduler.submit(make_request(i, NEW), lengths[i]) for i in (2, 3)]
            return await asyncio.gather(*(consume(s) for s in early + late)), client
        finally:
            await scheduler.stop()
            await client.inner.close()

    shard.clear()
    before = shard.serving_stats()
    results, client = asyncio.run(run())
    after = shard.serving_stats()
    assert results == [expected[i] for i in range(4)]
    calls = [c for c in client.calls if c[0] in ("look_ahead", "prefill")]
    for previous, call in zip(calls, calls[1:]):
        assert not (previous == ("look_ahead", True) and call[0] == "prefill"), (
            calls
        )  # admitted only after
    asked = sum(c == ("look_ahead", True) for c in calls)
    assert asked >= NEW  # most steps looked ahead
    assert ("look_ahead", False) in calls  # not while 2-3 waited (nor at the very end)
    runs, used = (after[k] - before[k] for k in ("lookahead_runs", "lookahead_steps"))
    assert (
        runs == used >= asked // 2
    )  # none thrown away; skipped only where a row needed a new block or all ended


@pytest.mark.parametrize("setting", ["auto", "on", "off"])
def test_the_setting_reaches_the_router_and_auto_looks_ahead_everywhere(setting):
    from launcher.cli import build_parser, config_from_args
    from router.app import build_parser as router_parser
    from router.app import config_from_args as router_config
    from router.sched.scheduler import lookahead_for

    argv = [] if setting == "auto" else ["--lookahead", setting]  # auto is the default
    launched = config_from_args(build_parser().parse_args(argv))
    assert router_config(router_parser().parse_args(launched.router_args())).lookahead == setting
    chosen = {device: lookahead_for(setting, device) for device in ("cpu", "cuda", "hpu")}
    assert (
        chosen
        == {
            "auto": dict.fromkeys(chosen, True),  # CPU included: docs/benchmarks.md
            "on": dict.fromkeys(chosen, True),
            "off": dict.fromkeys(chosen, False),
        }[setting]
    )
