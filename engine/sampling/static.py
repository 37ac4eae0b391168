"""Next-token choice at static shapes, for devices that compile graphs (HPU, CUDA graphs, and the
`--simulate hpu` CPU simulator).

sampling.choose() runs each processor only when a row of the batch needs it, over the batch's real
rows, with index lists as long as each request's history: right on the CPU, where nothing compiles,
but on a lazy-graph device every new combination is a graph compile at serving time. Here every
processor runs on every step, over the bucket's padded rows, with inputs of fixed shapes:

- the penalties read each row's token counts from tables on the device that the sampler's own
  graph updates in place with each step's tokens (engine/sampling/penalty_counts.py);
- the logit bias is a sparse [rows, MAX_LOGIT_BIAS] pair of token ids and values (padding: id 0,
  value 0), added on the device by one scatter_add, however many entries a request has;
- watermarking adds its bonus where a [rows, vocab] bool green mask is set (a green list is half
  the vocabulary: ids would be twice the bytes of the mask); a grammar's mask is [rows, vocab]
  (all True: none);
- top-k keeps the scores tied with the k-th of a full sort (no `topk(max(k))`);
- the draw inverts a float32 CDF (Gaudi has no float64) at one host uniform per row;
- top-n tokens and logprobs come from a fixed-width topk; a row whose ties overflow that width
  (rare) is finished on the host from its logprobs, read after the step.

Rows with neutral parameters come out as the logits themselves, so a request gets the same tokens
here as from choose(), but for the float32 draw. Host work (rebuilding a slot's counts when its
occupant changes, the uniforms, grammar masks, detokenizing) stays on the host on purpose: it is
list work over histories, not device math.
"""

from __future__ import annotations

import math

import torch

from engine.devices.row_merge import gather_rows, mark_step, warm_merges
from engine.sampling.penalty_counts import PenaltyCounts, penalty_counts
from engine.sampling.sampler import (
    WATERMARK_DELTA,
    Choice,
    SamplingState,
    _check_batch,
    _green_list,
    _Rows,
    _top_tokens,
    choose,
)
from engine.wire.contract import MAX_LOGIT_BIAS

TOP_N_WIDTH = 16  # the router allows top_n <= 5; the rest holds the ties of the n-th
LOGIT_BIAS_WIDTH = MAX_LOGIT_BIAS  # bias entries per row, whatever a request has (padded)


def uses_static_sampling(runner) -> bool:
    """Where a forward is warmed by running it (graph devices), so is the sampler."""
    return runner.adapter.warm_runs_forward


def sampler_rows(runner, n: int) -> int:
    """The rows the sampler runs on: the smallest decode batch of the plan that holds n."""
    return runner.plan.sampler_rows(n)


def padded_logits(logits: torch.Tensor, row_index: list[int], rows: int, adapter) -> torch.Tensor:
    """[rows, vocab]: row i is logits[row_index[i]], then padding. `logits` is the first rows of a
    bucket's output or of a merge of several (the runner hands out such views): that output itself
    is used, so the shape is the plan's and not the batch's."""
    base = getattr(logits, "bucket_output", None)
    if base is None:
        base = logits  # not a bucket's output: a shape the plan does not fix
    if row_index == list(range(len(row_index))) and base.shape[0] == rows:
        return base
    return gather_rows(adapter, base, row_index, rows)


def choose_static(
    logits: torch.Tensor,
    row_index: list[int],
    states: list[SamplingState],
    histories: list[list[int]],
    prompt_lens: list[int],
    top_n: list[int],
    allowed: torch.Tensor | None,
    rows: int,
    adapter,
    counts: PenaltyCounts | None = None,
) -> Choice:
    """choose()'s result for rows `row_index` of `logits`, computed on `rows` padded rows.
    `counts`: the penalties' count tables (None: fresh ones, rebuilt for this call)."""
    n, vocab = len(row_index), logits.shape[1]
    if n == 0:
        return Choice([], [], [])
    _check_batch(torch.empty(n, vocab, device="meta"), states, histories, prompt_lens, top_n, None)
    counts = counts if counts is not None else penalty_counts(None, adapter, rows, vocab)
    needed = [s.params.repetition_penalty != 1.0 or bool(s.params.frequency_penalty)
              or bool(s.params.presence_penalty) for s in states]  # fmt: skip
    slots = counts.slots_for(states, histories, prompt_lens, needed)
    inputs = [
        adapter.to_device(t)
        for t in host_inputs(states, histories, top_n, allowed, rows, vocab, slots, counts.scratch)
    ]
    chosen, logprob, values, ids, top_counts, logprobs = static_choice(
        padded_logits(logits, row_index, rows, adapter), counts.every, counts.generated, *inputs
    )
    mark_step(adapter)  # the sampler's graph ends here: what follows reads finished results
    chosen, logprob = chosen.tolist()[:n], logprob.tolist()[:n]
    counts.counted(slots, histories, chosen)
    return Choice(chosen, logprob, _top_n(values, ids, top_counts, logprobs, top_n))


def host_inputs(states, histories, top_n, allowed, rows: int, vocab: int, slots, scratch: int):
    """The sampler's inputs, every one [rows, ...] whatever the batch holds (padding: neutral).
    `slots`: each row's slot of the penalty counts (padding reads `scratch`)."""
    params = _Rows.of(states)
    n = len(states)
    pad = rows - n

    def column(values, neutral, dtype=torch.float32):
        return torch.tensor(list(values) + [neutral] * pad, dtype=dtype).unsqueeze(1)

    green = torch.zeros(rows, vocab, dtype=torch.bool)
    for i, (state, history) in enumerate(zip(states, histories, strict=True)):
        if state.params.watermark:
            green[i, _green_list(history[-1], vocab).long()] = True
    bias_ids, bias_values = sparse_logit_bias([s.params.logit_bias for s in states], rows, vocab)
    mask = torch.ones(rows, vocab, dtype=torch.bool)
    if allowed is not None:
        mask[:n] = allowed.cpu()
    uniforms = [
        float(torch.rand(1, generator=s.generator, dtype=torch.float64)) if draws else 0.5
        for s, draws in zip(states, params.sampling)
    ]
    return (
        torch.tensor(list(slots) + [scratch] * pad, dtype=torch.long),
        column([max(len(h), 1) for h in histories], 1.0),
        green,
        column(params.repetition_penalty, 1.0),
        column(params.frequency_penalty, 0.0),
        column(params.presence_penalty, 0.0),
        bias_ids,
        bias_values,
        mask,
        column(params.temperature, 1.0),
        column([min(k, vocab) for k in params.top_k], 0, torch.long),
        column(params.top_p, 1.0),
        column(params.typical_p, 1.0),
        column(params.sampling, False, torch.bool),
        column(uniforms, 0.5),
        column([min(max(k, 0), vocab) for k in top_n], 0, torch.long),
    )


def sparse_logit_bias(biases: list[dict[int, float]], rows: int, vocab: int):
    """Each row's logit bias as [rows, LOGIT_BIAS_WIDTH] token ids (long) and values (float32):
    the width is the cap, not the request's entry count, so the sampler's graph keeps one shape.
    Padding entries add 0 to token 0; ids past the logits' vocabulary are dropped, as choose()
    drops them."""
    ids = torch.zeros(rows, LOGIT_BIAS_WIDTH, dtype=torch.long)
    values = torch.zeros(rows, LOGIT_BIAS_WIDTH)
    for i, bias in enumerate(biases):
        entries = [(token, value) for token, value in bias.items() if 0 <= token < vocab]
        if len(entries) > LOGIT_BIAS_WIDTH:  # validate_parameters refuses such a request
            raise ValueError(
                f"row {i}: {len(entries)} logit_bias entries, at most {LOGIT_BIAS_WIDTH}"
            )
        if entries:
            tokens, added = zip(*entries)
            ids[i, : len(entries)] = torch.tensor(tokens, dtype=torch.long)
            values[i, : len(entries)] = torch.tensor(added, dtype=torch.float32)
    return ids, values


def static_choice(
    logits, every, generated, slots, lengths, green, repetition, frequency, presence, bias_ids,
    bias_values, mask, temperature, top_k, top_p, typical_p, sampling, uniforms, top_n,
):  # fmt: skip
    """The device graph: every processor, every row, in choose()'s order; then each row's token
    added to its slot of the penalty counts (`every`, `generated`: [slots + 1, vocab])."""
    counts = every.index_select(0, slots)
    scores = logits.float()
    scores = torch.where(green, scores + WATERMARK_DELTA, scores)
    penalized = torch.where(scores < 0, scores * repetition, scores / repetition)
    scores = torch.where((counts > 0) & (repetition != 1.0), penalized, scores)
    scores = scores - counts / lengths * frequency
    scores = scores - (generated.index_select(0, slots) > 0).float() * presence
    scores = scores.scatter_add(1, bias_ids, bias_values)  # padding adds 0.0 to token 0
    scores = scores.masked_fill(~mask, -math.inf) / temperature
    scores = _top_k(scores, top_k)
    scores = _top_p(scores, top_p)
    scores = _typical_p(scores, typical_p)
    greedy = scores.argmax(dim=1, keepdim=True)
    chosen = torch.where(sampling, _draw(scores, uniforms, greedy), greedy)
    ones = torch.ones(chosen.shape[0], dtype=every.dtype, device=every.device)
    every.index_put_((slots, chosen.squeeze(1)), ones, accumulate=True)
    generated.index_put_((slots, chosen.squeeze(1)), ones, accumulate=True)
    logprobs = torch.log_softmax(scores, dim=1)
    logprob = logprobs.gather(1, chosen)
    width = min(TOP_N_WIDTH, logprobs.shape[1])
    values, ids = logprobs.topk(width, dim=1)
    nth = values.gather(1, (top_n - 1).clamp(min=0, max=width - 1))
    candidates = (logprobs >= nth) & (logprobs > -math.inf)
    top_counts = torch.where(top_n > 0, candidates.sum(dim=1, keepdim=True), 0)
    return chosen.squeeze(1), logprob.squeeze(1), values, ids, top_counts.squeeze(1), logprobs


def _top_k(scores, top_k):
    kth = scores.sort(dim=1, descending=True).values.gather(1, (top_k - 1).clamp(min=0))
    kth = kth.masked_fill(top_k == 0, -math.inf)
    return scores.masked_fill(scores < kth, -math.inf)


def _top_p(scores, top_p):
    ascending, order = scores.sort(dim=1)
    tail_mass = ascending.softmax(dim=1).cumsum(dim=1)
    drop = tail_mass <= 1 - top_p
    drop[:, -1] = False
    drop &= top_p < 1.0
    return scores.masked_fill(torch.zeros_like(drop).scatter_(1, order, drop), -math.inf)


def _typical_p(scores, typical_p):
    log_probs = scores.log_softmax(dim=1)
    entropy = -(log_probs * log_probs.exp()).nansum(dim=1, keepdim=True)
    distance = (-log_probs - entropy).abs()
    nearest, order = distance.sort(dim=1)
    mass = scores.gather(1, order).softmax(dim=1).cumsum(dim=1)
    last_kept = (mass < typical_p).sum(dim=1, keepdim=True).clamp(max=scores.shape[1] - 1)
    drop = nearest > nearest.gather(1, last_kept)
    drop &= typical_p < 1.0
    return scores.masked_fill(torch.zeros_like(drop).scatter_(1, order, drop), -math.inf)


def _draw(scores, uniforms, greedy):
    """sampling._draw's CDF inversion in float32."""
    probs = scores.softmax(dim=1)
    cdf = probs.cumsum(dim=1)
    total = cdf[:, -1:]
    target = torch.minimum(uniforms * total, torch.nextafter(total, torch.zeros_like(total)))
    drawn = torch.searchsorted(cdf, target, right=True).clamp(max=scores.shape[1] - 1)
    has_mass = probs.gather(1, drawn) > 0
    return torch.where(has_mass, drawn, greedy)


def _top_n(values, ids, counts, logprobs, top_n: list[int]) -> list[list[tuple[int, float]]]:
    """Each real row's top_n pairs, ties included; a row whose ties overflow the width is done on
    the host from its logprobs (read after the step: a copy, not a graph break)."""
    if max(top_n, default=0) == 0:
        return [[] for _ in top_n]
    counts = counts.tolist()
    values, ids = values.tolist(), ids.tolist()
    result = []
    for row, n in enumerate(top_n):
        if counts[row] > len(ids[row]):
            result += _top_tokens(logprobs[row : row + 1].cpu().clone(), [n])
        else:
            result.append(list(zip(ids[row][: counts[row]], values[row][: counts[row]])))
    return result


def choose_next(runner, logits, rows: list[int], sequences, allowed) -> Choice:
    """The next token of each sequence from logits[rows[i]]: at static shapes on graph devices,
    else by sampling.choose() over the real rows (the CPU's fastest)."""
    states = [s.sampling for s in sequences]
    histories = [s.token_ids for s in sequences]
    prompt_lens = [s.prompt_len for s in sequences]
    top_n = [s.request.top_n_tokens for s in sequences]
    if uses_static_sampling(runner):
        size, adapter = sampler_rows(runner, len(rows)), runner.adapter
        counts = penalty_counts(runner, adapter, size, logits.shape[1])
        return choose_static(
            logits, rows, states, histories, prompt_lens, top_n, allowed, size, adapter, counts
        )
    if rows != list(range(logits.shape[0])):
        logits = logits[rows]
    return choose(logits, states, histories, prompt_lens, top_n, allowed)


def warm_sampler(runner, vocab_size: int) -> None:
    """Run the sampler once for every row count it may meet (each decode batch of the plan), the
    merges and gathers of rows it reads, and the siblings' prompt copy, so that serving compiles
    nothing new. Nothing to do where the sampler is not static."""
    if runner is None or not uses_static_sampling(runner):
        return
    adapter, plan = runner.adapter, runner.plan
    sizes = sorted({bucket.batch_size for bucket in plan.decode})
    counts = penalty_counts(runner, adapter, sizes[-1], vocab_size)
    counts.warm()  # a slot's rebuild
    for rows in sizes:
        logits = adapter.to_device(torch.zeros(rows, vocab_size))  # the models' logits: float32
        inputs = host_inputs([], [], [], None, rows, vocab_size, [], counts.scratch)
        static_choice(
            logits, counts.every, counts.generated, *[adapter.to_device(t) for t in inputs]
        )
        mark_step(adapter)
    outputs = {bucket.batch_size for bucket in plan.prefill + plan.decode}
    warm_merges(adapter, sizes, outputs, vocab_size)  # rows of several buckets, or some rows
