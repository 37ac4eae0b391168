"""A speculative decode step: propose up to K tokens a row, verify them all in one forward of the
target, and accept token by token.

Acceptance runs the ordinary token choice (sampling.choose, with every penalty, bias, warper and
grammar mask) on the verify logits one position at a time, each position seeing the tokens
accepted before it, and keeps going while the chosen token is the proposed one. For greedy rows
that is "accept while the argmax agrees". For sampled rows it is the rejection-sampling rule for a
deterministic proposer: with q one-hot on the proposal x, accepting with min(1, p/q) = p(x) and
otherwise drawing from the normalized residual max(0, p - q) is the same as drawing y ~ p and
accepting iff y == x (y is then the emitted token either way). Each emitted token takes exactly the
draw plain decoding would have taken for it, so a seeded request yields the very same tokens with
and without speculation, and the output distribution is the target's.

With a draft model (draft.py) sampled rows propose draws from the draft's distribution q, and
acceptance is the standard rejection rule: a proposal x is accepted with min(1, p(x)/q(x)) (one
uniform from the request's generator), and a rejection draws from the normalized residual
max(0, p - q) instead, p being the target's processed distribution at that position. The emitted
tokens are then distributed as the target's; seeded requests stay reproducible run to run, though
their draws are no longer those of plain decoding. Greedy rows accept while the argmax agrees.

KV: the verify forward writes the latest token and every proposal into the row's own blocks; the
slots of rejected proposals lie past `computed` and are simply overwritten by later steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.batch import Generation, Tokens
from engine.devices.row_merge import gather_rows
from engine.kv_cache import blocks_needed
from engine.runner import PrefillInput
from engine.sampling.sampler import (
    Choice,
    _top_tokens,
    allowed_tokens,
    is_sampling,
    process_scores,
)
from engine.speculative.buckets import PROBE_INTERVAL, verify_cost
from engine.speculative.draft import draw, host_copy
from engine.speculative.ngram import NgramIndex

COUNTERS = ("spec_steps", "spec_proposed", "spec_accepted", "spec_emitted")
# What a shard that does not speculate reports: the wire carries every field, zeros included.
NO_SPECULATION = {
    **dict.fromkeys(COUNTERS, 0),
    "spec_acceptance_rate": 0.0,
    "spec_mean_accepted_length": 0.0,
    "spec_k": 0,
}
# Adaptive K: the proposals a row may make follow the recent acceptance (an exponential average
# over verify steps). Speculation is off on batches above SPECULATE_MAX_BATCH, and on smaller ones
# while the accepted tokens per row do not pay for a verify step (VERIFY_COST, PROBE_INTERVAL:
# engine/speculative/buckets.py, measured on the 2-core CPU).
SMOOTHING = 0.3


@dataclass
class Speculator:
    """The shard's speculation settings and counters since warmup."""

    method: str  # "ngram", "draft" or "eagle3"
    num_tokens: int  # K: the most tokens proposed per row and step
    max_batch: int  # larger decode batches do not speculate
    stats: dict = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    draft: object = None  # engine.speculative.draft.DraftModel with --speculate draft
    adaptive: bool = True
    recent_rate: float | None = None  # accepted / proposed, averaged over recent verify steps
    recent_length: float = 0.0  # accepted tokens per batch row and step, likewise
    k_in_use: int = 0  # the K the latest step allowed (0: off)
    plain_steps: int = 0  # steps decoded plainly since speculation last ran (the off-switch)
    rows_seen: frozenset = frozenset()  # the request ids of the latest step's batch

    def meet(self, request_ids) -> None:
        """A batch with a row new to it measures afresh (all of K next): the newcomer's text may
        be one whose proposals are accepted, whatever the others' were."""
        ids = frozenset(request_ids)
        if not ids <= self.rows_seen:
            self.reset_adaptive()
        self.rows_seen = ids

    def tokens_for(self, rows: int) -> int:
        """This step's K for a batch of `rows`: 0 (a plain step) while the recent acceptance does
        not pay for a verify step; a draft model or EAGLE-3 head then probes with all of K after
        every PROBE_INTERVAL plain steps (n-gram rows measure on plain steps: `note_shadows`).
        Otherwise all of K for n-gram rows (their proposals cost nothing, and fewer would only be
        measured as less acceptance), allowed_tokens() for a draft (fewer draft forwards)."""
        if self.adaptive and self.recent_rate is not None and not self.pays(rows):
            self.plain_steps += 1
            if self.draft is None or self.plain_steps <= PROBE_INTERVAL:
                self.k_in_use = 0
                return 0
            self.plain_steps = 0
            self.k_in_use = self.num_tokens
            return self.num_tokens
        self.plain_steps = 0
        if self.draft is None:  # n-gram proposals cost nothing and the verify width is K + 1
            self.k_in_use = self.num_tokens
            return self.num_tokens
        return self.allowed_tokens()

    def prime(self, sequences: list, batch_rows: int, block_size: int) -> None:
        """Prompts just prefilled, in a batch that will decode `batch_rows` rows: a draft model
        computes its KV of them now, where that batch is small enough to speculate."""
        if batch_rows > self.max_batch or not hasattr(self.draft, "prime"):
            return
        self.draft.prime([s for s in sequences if room(self, s, block_size) > 0])

    def pays(self, rows: int) -> bool:
        """Whether a verify step of `rows` rows emits more tokens per row than it costs in plain
        steps, at the recent acceptance: 1 + accepted per row > verify_cost(rows)."""
        return 1 + self.recent_length > verify_cost(rows)

    def allowed_tokens(self) -> int:
        """This step's K: all of it until acceptance is measured, then one more than the recent
        accepted length (a draft model then runs fewer forwards where its guesses fail)."""
        if not self.adaptive or self.recent_rate is None:
            k = self.num_tokens
        else:
            k = min(self.num_tokens, max(1, round(self.recent_length) + 1))
        self.k_in_use = k
        return k

    def observe(self, proposed: int, accepted: int, rows: int) -> None:
        """One verify step's outcome, into the recent averages."""
        if proposed == 0:
            return
        rate, length = accepted / proposed, accepted / max(1, rows)
        if self.recent_rate is None:
            self.recent_rate, self.recent_length = rate, length
        else:
            self.recent_rate += SMOOTHING * (rate - self.recent_rate)
            self.recent_length += SMOOTHING * (length - self.recent_length)

    def reset_stats(self) -> None:
        self.stats.update(dict.fromkeys(COUNTERS, 0))
        self.reset_adaptive()

    def reset_adaptive(self) -> None:
        """Forget the measured acceptance: the next steps propose all of K again."""
        self.recent_rate, self.recent_length = None, 0.0
        self.k_in_use, self.plain_steps = self.num_tokens, 0

    def summary(self) -> dict:
        """The counters, with the acceptance rate (accepted / proposed), the mean accepted length
        (accepted tokens per row and verify step) and the K in use, for ServingStats."""
        stats = self.stats
        rows = stats["spec_emitted"] - stats["spec_accepted"]  # each row's one unaccepted token
        return {
            **stats,
            "spec_acceptance_rate": stats["spec_accepted"] / max(1, stats["spec_proposed"]),
            "spec_mean_accepted_length": stats["spec_accepted"] / max(1, rows),
            "spec_k": self.k_in_use,
        }


def room(speculator: Speculator, seq, block_size: int, k: int | None = None) -> int:
    """How many tokens the row may propose: every emitted token must fit its max_new_tokens and
    every verified position needs a KV slot in a block it holds. Grammar-constrained rows: none."""
    if seq.grammar is not None:
        return 0
    return max(
        0,
        min(
            speculator.num_tokens if k is None else k,
            seq.max_new_tokens - seq.generated - 1,  # the step emits up to proposals + 1 tokens
            len(seq.blocks) * block_size - len(seq.token_ids),  # positions len-1 .. len-1+d
        ),
    )


def propose(speculator: Speculator, seq, block_size: int, k: int | None = None) -> list[int]:
    """The row's n-gram proposals (prompt lookup)."""
    count = room(speculator, seq, block_size, k)
    if count < 1:
        return []
    if seq.speculation is None:
        seq.speculation = NgramIndex()
    return seq.speculation.propose(seq.token_ids, count)


def settle_shadows(speculator: Speculator, sequences: list) -> None:
    """n-gram rows: what of the proposals noted on plain steps (`note_shadows`) the tokens chosen
    since then match goes into the recent acceptance, as a verify step's outcome would: for greedy
    and seeded rows alike a verify step accepts exactly the proposed tokens plain decoding
    chooses."""
    proposed = accepted = rows = 0
    for seq in sequences:
        if seq.speculation is not None:
            for count, matched in seq.speculation.settle_shadows(seq.token_ids):
                proposed, accepted, rows = proposed + count, accepted + matched, rows + 1
    speculator.observe(proposed, accepted, rows)


def note_shadows(speculator: Speculator, sequences: list, block_size: int) -> None:
    """n-gram rows on a plain step: note what each would propose now (a few dictionary lookups)."""
    for seq in sequences:
        count = room(speculator, seq, block_size)
        if count > 0:
            if seq.speculation is None:
                seq.speculation = NgramIndex()
            seq.speculation.shadow(seq.token_ids, count)


def proposals_for(speculator: Speculator, sequences: list, block_size: int, k: int):
    """Every row's proposals (at most k each), and per row the proposer's distributions (draft
    model, sampled rows) or None (a deterministic proposal)."""
    if speculator.draft is None:
        return [propose(speculator, s, block_size, k) for s in sequences], [None] * len(sequences)
    rooms = [room(speculator, s, block_size, k) for s in sequences]
    return speculator.draft.propose(sequences, rooms)


def speculative_step(
    ctx, sequences: list, adapters: list[int], advance: Callable, record: Callable
) -> list[Generation] | None:
    """The step's generations, or None where it does not speculate (the caller decodes plainly):
    the recent acceptance does not pay for a verify step (Speculator.tokens_for), no row proposed
    anything, the batch is too large, or no warmed verify bucket holds it.
    `adapters`: each row's LoRA slot; `advance(ctx, sequences, logits)` chooses and appends one
    token per row (steps._advance); `record(ctx, sequences)` notes the KV blocks they filled
    (steps.record_contents)."""
    speculator, runner = ctx.speculator, ctx.runner
    if len(sequences) > speculator.max_batch:
        return None
    if speculator.draft is None:
        settle_shadows(speculator, sequences)
    speculator.meet(s.id for s in sequences)
    k = speculator.tokens_for(len(sequences))
    if k == 0:  # the off-switch: this step decodes plainly
        if speculator.draft is None:
            note_shadows(speculator, sequences, ctx.block_size)
        return None
    proposals, dists = proposals_for(speculator, sequences, ctx.block_size, k)
    if not any(proposals):
        return None
    context_blocks = max(blocks_needed(len(s.token_ids) - 1, ctx.block_size) for s in sequences)
    width = max(len(p) for p in proposals) + 1
    bucket = runner.plan.verify_bucket(len(sequences), width, context_blocks)
    if bucket is None:
        return None
    inputs = [_verify_input(*row) for row in zip(sequences, proposals, adapters)]
    logits = runner.verify(bucket, inputs)
    accepted = speculator.stats["spec_accepted"]
    generations = _accept(ctx, sequences, proposals, dists, logits, advance)
    filled = []
    for seq in sequences:
        before, seq.computed = seq.computed, len(seq.token_ids) - 1  # the latest is fed back next
        if seq.computed // ctx.block_size > before // ctx.block_size:
            filled.append(seq)
    record(ctx, filled)
    stats = speculator.stats
    proposed = sum(len(p) for p in proposals)
    stats["spec_steps"] += 1
    stats["spec_proposed"] += proposed
    speculator.observe(proposed, stats["spec_accepted"] - accepted, len(sequences))
    return generations


def _verify_input(seq, proposed: list[int], adapter: int) -> PrefillInput:
    last = len(seq.token_ids) - 1
    return PrefillInput(
        [seq.token_ids[-1], *proposed],
        seq.slots(last, last + 1 + len(proposed)),
        adapter=adapter,
        context_slots=seq.slots(0, last),
    )


def _accept(ctx, sequences, proposals, dists, logits, advance) -> list[Generation]:
    """Position by position, choose the next token of every row still accepting; a row stops at
    its first token that differs from its proposal (that token is still emitted), or when it
    finishes (EOS, a stop sequence, max_new_tokens). Rows with a proposer's distribution at the
    position take the rejection rule (`_rejection_choice`), the others the ordinary choice."""
    stats = ctx.speculator.stats
    active = list(range(len(sequences)))
    emitted: dict[int, list[Generation]] = {}
    for position in range(logits.shape[1]):
        rejecting = [i for i in active if _has_dist(dists[i], position, sequences[i])]
        choosing = [i for i in active if i not in rejecting]
        out = []
        if choosing:
            rows = [sequences[i] for i in choosing]
            out += advance(ctx, rows, _at_position(ctx.runner, logits, choosing, position))
        if rejecting:
            rows = [sequences[i] for i in rejecting]
            scores = _at_position(ctx.runner, logits, rejecting, position)
            scores = host_copy(scores)[: len(rejecting)]  # the rule's float64 math: on the host
            drafted = [(proposals[i][position], dists[i][position]) for i in rejecting]
            choice = _rejection_choice(ctx, rows, scores, drafted)
            out += advance(ctx, rows, scores, choice=choice)
        for generation in out:
            emitted.setdefault(generation.request_id, []).append(generation)
        stats["spec_emitted"] += len(active)
        still = []
        for i in active:
            seq, proposed = sequences[i], proposals[i]
            if (
                position < len(proposed)
                and seq.token_ids[-1] == proposed[position]
                and seq.finish_reason is None
            ):
                stats["spec_accepted"] += 1
                still.append(i)
        active = still
        if not active:
            break
    return [_merged(emitted[seq.id]) for seq in sequences if seq.id in emitted]


def _at_position(runner, logits, indices: list[int], position: int) -> torch.Tensor:
    """The verify logits of rows `indices` at `position`. Where graphs compile, a gather from the
    verify bucket's whole output into the sampler's padded rows: its own warmed graph
    (engine/speculative/buckets.py's warm_verify_gathers), so the sampler meets its warmed shape."""
    if not runner.adapter.warm_runs_forward:
        if indices == list(range(logits.shape[0])):  # every row: a view, no gather
            return logits[:, position]
        return logits[indices, position]
    width = logits.shape[1]
    rows = runner.plan.sampler_rows(len(indices))
    flat = [i * width + position for i in indices]
    return gather_rows(runner.adapter, logits.bucket_output, flat, rows)


def _has_dist(dists, position: int, seq) -> bool:
    return dists is not None and position < len(dists) and is_sampling(seq.sampling.params)


def _rejection_choice(ctx, rows, logits, drafted) -> Choice:
    """Each row's token at one verified position under the rejection rule: the draft's x ~ q is
    kept with probability min(1, p(x)/q(x)); otherwise a draw from max(0, p - q), normalized. p is
    the target's processed distribution (penalties, bias, warpers, min_new_tokens' EOS mask)."""
    scores = process_scores(
        logits,
        [s.sampling for s in rows],
        [s.token_ids for s in rows],
        allowed_tokens(ctx, rows, logits),
        [s.prompt_len for s in rows],
    )
    logprobs = torch.log_softmax(scores, dim=1)
    tokens = []
    for row, (seq, (proposed, q)) in enumerate(zip(rows, drafted)):
        p = scores[row].double().softmax(dim=0)
        q = q.to(p.device)
        generator = seq.sampling.generator
        uniform = float(torch.rand(1, generator=generator, dtype=torch.float64))
        if uniform * float(q[proposed]) < float(p[proposed]):
            tokens.append(proposed)
            continue
        residual = (p - q).clamp(min=0)
        tokens.append(draw(residual if float(residual.sum()) > 0 else p, generator))
    chosen = torch.tensor(tokens, device=logprobs.device)
    picked = logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1)
    top = _top_tokens(logprobs, [s.request.top_n_tokens for s in rows])
    return Choice(tokens, picked.tolist(), top)


def _merged(generations: list[Generation]) -> Generation:
    """One Generation carrying a row's tokens of this step in order (TGI's multi-token form)."""
    if len(generations) == 1:
        return generations[0]
    tokens = Tokens(
        [t for g in generations for t in g.tokens.ids],
        [t for g in generations for t in g.tokens.logprobs],
        [t for g in generations for t in g.tokens.texts],
        [t for g in generations for t in g.tokens.is_special],
    )
    top = [t for g in generations for t in g.top_tokens]
    return Generation(generations[0].request_id, None, tokens, generations[-1].generated_text, top)
