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

KV: the verify forward writes the latest token and every proposal into the row's own blocks; the
slots of rejected proposals lie past `computed` and are simply overwritten by later steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from engine.batch import Generation, Tokens
from engine.runner import PrefillInput
from engine.spec.ngram import NgramIndex

COUNTERS = ("spec_steps", "spec_proposed", "spec_accepted", "spec_emitted")


@dataclass
class Speculator:
    """The shard's speculation settings and counters since warmup."""

    method: str  # "ngram"
    num_tokens: int  # K: the most tokens proposed per row and step
    max_batch: int  # larger decode batches do not speculate
    stats: dict = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))

    def reset_stats(self) -> None:
        self.stats.update(dict.fromkeys(COUNTERS, 0))


def propose(speculator: Speculator, seq, block_size: int) -> list[int]:
    """The row's proposals, capped so that every emitted token fits its max_new_tokens and every
    verified position has a KV slot in a block it holds. Grammar-constrained rows propose nothing."""
    if seq.grammar is not None:
        return []
    length = len(seq.token_ids)
    room = min(
        speculator.num_tokens,
        seq.max_new_tokens - seq.generated - 1,  # the step emits up to proposals + 1 tokens
        len(seq.blocks) * block_size - length,  # positions length-1 .. length-1+d need slots
    )
    if room < 1:
        return []
    if seq.speculation is None:
        seq.speculation = NgramIndex()
    return seq.speculation.propose(seq.token_ids, room)


def speculative_step(
    ctx, sequences: list, adapters: list[int], advance: Callable, record: Callable
) -> list[Generation] | None:
    """The step's generations, or None where it does not speculate (the caller decodes plainly):
    no row proposed anything, the batch is too large, or no warmed verify bucket holds it.
    `adapters`: each row's LoRA slot; `advance(ctx, sequences, logits)` chooses and appends one token per row (steps._advance);
    `record(ctx, sequences)` notes the KV blocks they filled (steps.record_contents)."""
    speculator, runner = ctx.speculator, ctx.runner
    if len(sequences) > speculator.max_batch:
        return None
    proposals = [propose(speculator, seq, ctx.block_size) for seq in sequences]
    if not any(proposals):
        return None
    context_blocks = max(-(-(len(s.token_ids) - 1) // ctx.block_size) for s in sequences)
    width = max(len(p) for p in proposals) + 1
    bucket = runner.plan.verify_bucket(len(sequences), width, context_blocks)
    if bucket is None:
        return None
    inputs = [_verify_input(*row) for row in zip(sequences, proposals, adapters)]
    logits = runner.verify(bucket, inputs)
    generations = _accept(ctx, sequences, proposals, logits, advance)
    filled = []
    for seq in sequences:
        before, seq.computed = seq.computed, len(seq.token_ids) - 1  # the latest is fed back next
        if seq.computed // ctx.block_size > before // ctx.block_size:
            filled.append(seq)
    record(ctx, filled)
    stats = speculator.stats
    stats["spec_steps"] += 1
    stats["spec_proposed"] += sum(len(p) for p in proposals)
    return generations


def _verify_input(seq, proposed: list[int], adapter: int) -> PrefillInput:
    last = len(seq.token_ids) - 1
    return PrefillInput(
        [seq.token_ids[-1], *proposed],
        seq.slots(last, last + 1 + len(proposed)),
        adapter=adapter,
        context_slots=seq.slots(0, last),
    )


def _accept(ctx, sequences, proposals, logits, advance) -> list[Generation]:
    """Position by position, choose the next token of every row still accepting; a row stops at
    its first token that differs from its proposal (that token is still emitted), or when it
    finishes (EOS, a stop sequence, max_new_tokens)."""
    stats = ctx.speculator.stats
    active = list(range(len(sequences)))
    emitted: dict[int, list[Generation]] = {}
    for position in range(logits.shape[1]):
        rows = [sequences[i] for i in active]
        for generation in advance(ctx, rows, logits[active, position]):
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
