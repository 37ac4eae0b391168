"""The penalties' token counts live on the device and the static sampler's graph adds each step's
tokens to them in place (engine/sampling/penalty_counts.py): tokens equal choose()'s, which counts
the whole histories on the host, step after step while rows come and go; a slot is rebuilt only
when its occupant changes; and the simulator sees no new graph after warmup."""

from __future__ import annotations

import torch

from engine.batch import NextTokenChooserParameters
from engine.devices.simulate.adapter import SimulatedHPUAdapter
from engine.runner import first_rows
from engine.sampling.penalty_counts import PenaltyCounts
from engine.sampling.sampler import choose, new_sampling_state
from engine.sampling.static import choose_static

VOCAB, ROWS = 48, 4
BASE = torch.randn(ROWS, VOCAB, generator=torch.Generator().manual_seed(5)) * 2
PENALIZED = [
    NextTokenChooserParameters(repetition_penalty=1.8, frequency_penalty=0.7),
    NextTokenChooserParameters(presence_penalty=1.5, logit_bias={5: 1.0}),
    NextTokenChooserParameters(repetition_penalty=0.6, presence_penalty=0.4),
    NextTokenChooserParameters(),  # no penalty: the scratch slot
]


class Row:
    """One sequence: its prompt and history, and a state for each sampler (their generators)."""

    def __init__(self, request_id: int, params, history: list[int]):
        self.prompt_len, self.history = len(history), list(history)
        self.static = new_sampling_state(params, request_id, 0)
        self.eager = new_sampling_state(params, request_id, 0)


def _step(adapter, counts, rows: list[Row], generator) -> list[int]:
    """One step of both samplers on the same logits; returns the tokens, after checking them."""
    # the same favourites every step: without its penalty a row would repeat its last token
    logits = BASE + torch.randn(ROWS, VOCAB, generator=generator) * 0.1
    histories = [r.history for r in rows]
    prompt_lens = [r.prompt_len for r in rows]
    bucket = adapter.to_device(logits)  # a decode bucket's output: its real rows first
    with adapter.graphs.tracking():
        static = choose_static(
            first_rows(bucket, len(rows)), list(range(len(rows))), [r.static for r in rows],
            histories, prompt_lens, [0] * len(rows), None, ROWS, adapter, counts,
        )  # fmt: skip
    eager = choose(
        logits[: len(rows)], [r.eager for r in rows], histories, prompt_lens, [0] * len(rows)
    )
    assert static.token_ids == eager.token_ids
    for row, token in zip(rows, static.token_ids):
        row.history.append(token)
    return static.token_ids


def _warmed():
    adapter = SimulatedHPUAdapter()
    counts = PenaltyCounts(adapter, ROWS, VOCAB)
    with adapter.graphs.tracking():
        counts.warm()
    _step(adapter, counts, [Row(99, PENALIZED[0], [1, 2])], torch.Generator().manual_seed(9))
    adapter.graphs.serving = True  # strict: a new graph from here raises
    return adapter, counts


def test_counts_follow_the_rows_in_place_and_match_the_host_count():
    adapter, counts = _warmed()
    rebuilt = counts.rebuilds
    generator = torch.Generator().manual_seed(0)
    a, b = Row(1, PENALIZED[0], [3, 3, 4, 7]), Row(2, PENALIZED[1], [8, 9])
    plain = Row(3, PENALIZED[3], [5])
    for _ in range(4):
        _step(adapter, counts, [a, b, plain], generator)
    assert counts.rebuilds - rebuilt == 2  # a and b once, at their first step
    c = Row(4, PENALIZED[2], [11, 12, 13, 11, 11, 2])  # admitted next to them
    for _ in range(3):
        _step(adapter, counts, [c, a, b], generator)
    assert counts.rebuilds - rebuilt == 3
    resumed = Row(5, PENALIZED[1], b.history)  # b preempted and resumed: a new occupant
    resumed.prompt_len = b.prompt_len
    a.history.append(17)  # a token the sampler did not choose (a speculative acceptance)
    for _ in range(3):
        _step(adapter, counts, [resumed, a, c], generator)
    assert counts.rebuilds - rebuilt == 5  # the resumed row, and a recounted
    assert adapter.graphs.counts()["graph_compiles_serving"] == 0
    assert adapter.graphs.counts()["graph_breaks_serving"] == 0


def test_more_sequences_than_slots_take_the_oldest_slot():
    adapter, counts = _warmed()
    generator = torch.Generator().manual_seed(1)
    rows = [Row(10 + i, PENALIZED[i % 3], [i, i + 1, i]) for i in range(6)]
    for step in range(6):  # four of six rows a step, in turns: slots are reused and rebuilt
        _step(adapter, counts, [rows[(step + k) % 6] for k in range(ROWS)], generator)
    assert adapter.graphs.counts()["graph_compiles_serving"] == 0


def test_the_memory_profile_leaves_room_for_the_tables(monkeypatch):
    """The KV cache is sized from the profile's free memory; the tables come after it, so the
    profile reserves their bytes (two [max_batch_size + 1, vocab] float32 tables)."""
    from engine.warmup.memory import profile_free_memory
    from tests.fakes.tiny import BLOCK, CONFIG, LIMITS, tiny_model

    adapter, free = SimulatedHPUAdapter(), 10**9
    monkeypatch.setattr(adapter, "memory_info", lambda: (free, 2 * free))
    left = profile_free_memory(tiny_model(), adapter, torch.float32, BLOCK, LIMITS)
    tables = PenaltyCounts(adapter, LIMITS.max_batch_size, CONFIG.vocab_size)
    assert free - left == tables.every.nbytes + tables.generated.nbytes
