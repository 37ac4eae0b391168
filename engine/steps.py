"""One prefill or decode step over a list of sequences: validate, run, choose, stop, report."""
from __future__ import annotations

from dataclasses import dataclass

from engine.batch import FinishReason, GeneratedText, Generation, Request, Tokens
from engine.detokenize import decode_next
from engine.errors import InvalidRequestError
from engine.kv_cache import BlockAllocator, blocks_needed
from engine.runner import DecodeInput, ModelRunner, PrefillInput
from engine.sampling import choose_greedy, validate_parameters
from engine.sequence import Sequence
from engine.warmup import WarmupLimits


@dataclass
class StepContext:
    runner: ModelRunner
    tokenizer: object
    allocator: BlockAllocator
    limits: WarmupLimits
    eos_token_ids: frozenset[int]
    special_token_ids: frozenset[int]
    block_size: int
    rank: int = 0
    world_size: int = 1


def admit_requests(ctx: StepContext, requests: list[Request]) -> list[Sequence]:
    """Sequences for new requests; every request is checked before any block is allocated."""
    tokenized = [_tokenize(ctx, request) for request in requests]
    needed = sum(blocks_needed(kv_tokens(len(ids), r.stopping_parameters.max_new_tokens), ctx.block_size)
                 for r, ids in zip(requests, tokenized) if not r.blocks)
    if not ctx.allocator.can_allocate(needed):
        raise InvalidRequestError(f"KV cache full: the batch needs {needed} blocks, {ctx.allocator.num_free} are free")
    return [_new_sequence(ctx, r, ids) for r, ids in zip(requests, tokenized)]


def _tokenize(ctx: StepContext, request: Request) -> list[int]:
    validate_parameters(request.id, request.parameters)
    ids = ctx.tokenizer(request.inputs, add_special_tokens=request.add_special_tokens)["input_ids"]
    if request.truncate:
        ids = ids[-request.truncate :]
    max_new, limits = request.stopping_parameters.max_new_tokens, ctx.limits
    if not ids:
        raise InvalidRequestError(f"request {request.id}: the prompt is empty")
    if len(ids) > limits.max_input_tokens:
        raise InvalidRequestError(f"request {request.id}: prompt of {len(ids)} tokens exceeds max_input_tokens={limits.max_input_tokens}")
    if max_new < 1:
        raise InvalidRequestError(f"request {request.id}: max_new_tokens must be at least 1, got {max_new}")
    if len(ids) + max_new > limits.max_total_tokens:
        raise InvalidRequestError(f"request {request.id}: {len(ids)} prompt tokens + max_new_tokens={max_new} exceed max_total_tokens={limits.max_total_tokens}")
    if request.blocks and len(request.blocks) * ctx.block_size < kv_tokens(len(ids), max_new):
        raise InvalidRequestError(f"request {request.id}: {len(request.blocks)} blocks hold fewer than the "
                                  f"{kv_tokens(len(ids), max_new)} tokens its prompt and max_new_tokens need")
    if request.slots and len(request.slots) < len(ids):
        raise InvalidRequestError(f"request {request.id}: {len(request.slots)} slots for {len(ids)} prompt tokens")
    return ids


def kv_tokens(prompt_len: int, max_new_tokens: int) -> int:
    """Tokens a request writes to the KV cache: the last generated token is never fed back."""
    return prompt_len + max_new_tokens - 1


def _new_sequence(ctx: StepContext, request: Request, ids: list[int]) -> Sequence:
    owns = not request.blocks
    needed = blocks_needed(kv_tokens(len(ids), request.stopping_parameters.max_new_tokens), ctx.block_size)
    blocks = list(request.blocks) or ctx.allocator.allocate(needed)
    return Sequence(request, list(ids), len(ids), blocks, ctx.block_size, owns, list(request.slots),
                    prefix_offset=max(len(ids) - 5, 0), read_offset=len(ids))


def prefill_step(ctx: StepContext, sequences: list[Sequence]) -> list[Generation]:
    inputs = [PrefillInput(s.token_ids, s.slots(0, len(s.token_ids))) for s in sequences]
    return _advance(ctx, sequences, ctx.runner.prefill(inputs))


def decode_step(ctx: StepContext, sequences: list[Sequence]) -> list[Generation]:
    inputs = []
    for seq in sequences:
        position = len(seq.token_ids) - 1
        if blocks_needed(position + 1, ctx.block_size) > len(seq.blocks):
            raise InvalidRequestError(f"request {seq.id}: its KV blocks are full at position {position}")
        inputs.append(DecodeInput(seq.token_ids[-1], position, seq.slots(position, position + 1)[0], seq.blocks_through(position)))
    return _advance(ctx, sequences, ctx.runner.decode(inputs))


def _advance(ctx: StepContext, sequences: list[Sequence], logits) -> list[Generation]:
    """Append the chosen token to every sequence; generations for this rank's requests."""
    tokens, logprobs = choose_greedy(logits)
    generations = []
    for seq, token, logprob in zip(sequences, tokens, logprobs):
        seq.token_ids.append(token)
        text, seq.prefix_offset, seq.read_offset = decode_next(ctx.tokenizer, seq.token_ids, seq.prefix_offset, seq.read_offset)
        seq.finish_reason = _finish_reason(ctx, seq, token)
        if seq.id % ctx.world_size == ctx.rank:
            generations.append(_generation(ctx, seq, token, logprob, text))
    return generations


def _finish_reason(ctx: StepContext, seq: Sequence, token: int) -> FinishReason | None:
    if token in ctx.eos_token_ids and not seq.request.stopping_parameters.ignore_eos_token:
        return FinishReason.EOS_TOKEN
    if seq.generated >= seq.max_new_tokens:
        return FinishReason.LENGTH
    return None


def _generation(ctx: StepContext, seq: Sequence, token: int, logprob: float, text: str) -> Generation:
    special = token in ctx.special_token_ids
    finished = None
    if seq.finish_reason is not None:
        output = ctx.tokenizer.decode(seq.generated_ids, skip_special_tokens=True)
        finished = GeneratedText(output, seq.generated, seq.finish_reason)
    return Generation(seq.id, None, Tokens([token], [logprob], [text], [special]), finished)
