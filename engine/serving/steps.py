"""One prefill or decode step over a list of sequences: validate, run, choose, stop, report."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engine.batch import (
    FinishReason,
    GeneratedText,
    Generation,
    GrammarType,
    Request,
    Tokens,
    kv_tokens,
)
from engine.config import ServingLimits
from engine.errors import InvalidRequestError
from engine.kv_cache import BlockContents, ShardBlockPool, blocks_needed
from engine.layers.lora import NO_ADAPTER, LoraSet
from engine.runner import DecodeInput, ModelRunner, PrefillInput
from engine.sampling.sampler import (
    allowed_tokens,
    is_sampling,
    new_sampling_state,
    validate_parameters,
)
from engine.sampling.static import choose_next
from engine.serving import siblings
from engine.serving.chunks import check_chunking, chunk_cap, plan_chunks
from engine.serving.detokenize import decode_next
from engine.serving.lookahead import Ahead, logits_using, run_ahead
from engine.serving.prefix import check_cache_len, check_prefix
from engine.serving.resume import check_resumed, replay
from engine.serving.sequence import Sequence
from engine.speculative.step import speculative_step


@dataclass(kw_only=True)
class StepContext:
    runner: ModelRunner
    tokenizer: object
    allocator: ShardBlockPool
    limits: ServingLimits
    eos_token_ids: frozenset[int]
    special_token_ids: frozenset[int]
    block_size: int
    grammars: Callable = None  # () -> GrammarCompiler, built by the shard on first use
    unset_seed: Callable = (
        None  # request id -> the seed of a request that set none, equal on every rank
    )
    rank: int = 0
    world_size: int = 1
    lora_set: LoraSet | None = None  # the LoRA adapters requests may name in adapter_id
    vocab_size: int = 0  # the model's: token ids a resumed request may carry
    contents: BlockContents | None = (
        None  # what each filled KV block holds; None: no prefix caching
    )
    chunk_stats: dict | None = (
        None  # "chunked_prompts", "prefill_chunks": counted for the router's metrics
    )
    speculator: object = None  # engine.speculative.step.Speculator with --speculate; None: off
    vision: object = None  # a vision-language model's ImageEncoder (engine/vision/encoder.py)


def adapter_slot(ctx: StepContext, request: Request) -> int:
    """The slot of the request's LoRA adapter; no adapter_id (or "") is the base model."""
    if not request.adapter_id:
        return NO_ADAPTER
    names = ctx.lora_set.names if ctx.lora_set else ()
    if request.adapter_id not in names:
        raise InvalidRequestError(
            f"request {request.id}: unknown adapter_id {request.adapter_id!r} "
            f"(loaded adapters: {', '.join(names) or 'none'})"
        )
    return ctx.lora_set.slot(request.adapter_id)


def admit_requests(
    ctx: StepContext, requests: list[Request], resume: dict[int, list[int]]
) -> list[Sequence]:
    """Sequences for new requests; every request is checked before any block is allocated.
    `resume`: request id -> the tokens it generated before a shard restart
    (engine/serving/resume.py)."""
    tokenized = [_tokenize(ctx, request) for request in requests]
    for request, ids in zip(requests, tokenized):
        _check_admission(ctx, request, ids, resume.get(request.id))
    grammars = [_compile_grammar(ctx, request) for request in requests]
    _check_room(ctx, requests, tokenized)
    # Images are encoded before any block is allocated: an unreadable one refuses the batch.
    # `n` siblings copy their source's prompt KV, so only the source encodes its images.
    features = [
        ctx.vision.encode(r, ids)
        if r.chunks is not None and ctx.vision and r.prefill_source is None
        else None
        for r, ids in zip(requests, tokenized)
    ]
    sequences = [_new_sequence(ctx, r, ids, g) for r, ids, g in zip(requests, tokenized, grammars)]
    for seq, image_features in zip(sequences, features):
        seq.image_features = image_features
        if seq.request.chunks is not None and ctx.vision is not None:
            _place_images(ctx, seq)
        if seq.id in resume:
            replay(ctx.tokenizer, seq, resume[seq.id])
        seq.computed, seq.prefill_end = seq.cache_len, len(seq.token_ids)
        if ctx.contents is not None:  # the blocks it writes no longer hold what they held
            ctx.contents.forget(seq.blocks[seq.cache_len // ctx.block_size :])
    return sequences


def _check_admission(
    ctx: StepContext, request: Request, ids: list[int], resumed: list[int] | None
) -> None:
    """Refuses a request whose prompt (with the tokens it `resumed`) does not fit its blocks, its
    cached prefix, its chunks or its images."""
    if resumed is not None:
        check_resumed(
            request.id,
            len(ids),
            resumed,
            request.stopping_parameters.max_new_tokens,
            ctx.limits.max_input_tokens,
            ctx.vocab_size,
        )
    full = ids + (resumed or [])
    if request.blocks and len(request.blocks) * ctx.block_size < len(full):
        raise InvalidRequestError(
            f"request {request.id}: {len(request.blocks)} blocks hold fewer than the "
            f"{len(full)} tokens it prefills"
        )
    check_cache_len(request, len(full), ctx.block_size, ctx.contents is not None)
    check_chunking(request, len(full) - request.cache_len, _cap(ctx))
    if request.chunks is not None and ctx.vision is not None:
        ctx.vision.check_whole(request, min(_cap(ctx), ctx.limits.max_prefill_tokens))
    if request.cache_len:
        check_prefix(ctx.contents, request, _keyed(ctx, request, full))


def _check_room(ctx: StepContext, requests: list[Request], tokenized: list[list[int]]) -> None:
    """Refuses a batch whose requests without blocks of their own need more than are free."""
    needed = sum(
        blocks_needed(kv_tokens(len(ids), r.stopping_parameters.max_new_tokens), ctx.block_size)
        for r, ids in zip(requests, tokenized)
        if not r.blocks
    )
    if not ctx.allocator.can_allocate(needed):
        raise InvalidRequestError(
            f"KV cache full: the batch needs {needed} blocks, {ctx.allocator.num_free} are free"
        )


def _place_images(ctx: StepContext, seq: Sequence) -> None:
    """Where a sequence's images sit among its tokens, its prompt as prefix caching keys it, and
    its M-RoPE positions where the model has them (engine/vision/grids.py)."""
    seq.image_spans = ctx.vision.spans(seq.request, seq.token_ids)
    seq.keyed_prompt = ctx.vision.keyed(seq.request, seq.token_ids)
    if hasattr(ctx.vision, "rope_index"):
        seq.rope_positions, seq.rope_delta = ctx.vision.rope_index(seq.request, seq.token_ids)


def _compile_grammar(ctx: StepContext, request: Request):
    grammar_type = GrammarType(request.parameters.grammar_type)
    if grammar_type == GrammarType.NONE:
        return None
    parameters = request.parameters
    compiled = ctx.grammars().compile(
        grammar_type,
        parameters.grammar,
        reasoning=(parameters.grammar_reasoning_start, parameters.grammar_reasoning_end),
    )
    if (
        not ctx.grammars().new_state(compiled).allowed_mask().any()
    ):  # `[^\s\S]`: nothing could be sampled
        raise InvalidRequestError(
            f"request {request.id}: parameters.grammar allows no token at all"
        )
    return compiled


def _tokenize(ctx: StepContext, request: Request) -> list[int]:
    validate_parameters(request.id, request.parameters)
    adapter_slot(ctx, request)
    if request.chunks is not None and ctx.vision is not None:  # text and images
        ids = ctx.vision.prompt_ids(request)
    else:  # a text model reads a prompt's text chunks alone, as TGI's do
        ids = ctx.tokenizer(request.inputs, add_special_tokens=request.add_special_tokens)[
            "input_ids"
        ]
    if request.truncate:
        ids = ids[-request.truncate :]
    if ctx.vision is not None and request.chunks is None and ctx.vision.spec.image_token_id in ids:
        raise InvalidRequestError(
            f"request {request.id}: the prompt holds the image token but no image"
        )
    max_new, limits = request.stopping_parameters.max_new_tokens, ctx.limits
    if not ids:
        raise InvalidRequestError(f"request {request.id}: the prompt is empty")
    if len(ids) > limits.max_input_tokens:
        raise InvalidRequestError(
            f"request {request.id}: prompt of {len(ids)} tokens exceeds "
            f"max_input_tokens={limits.max_input_tokens}"
        )
    if max_new < 1:
        raise InvalidRequestError(
            f"request {request.id}: max_new_tokens must be at least 1, got {max_new}"
        )
    if len(ids) + max_new > limits.max_total_tokens:
        raise InvalidRequestError(
            f"request {request.id}: {len(ids)} prompt tokens + max_new_tokens={max_new} exceed "
            f"max_total_tokens={limits.max_total_tokens}"
        )
    if request.blocks and len(request.blocks) * ctx.block_size < len(
        ids
    ):  # more may come with each Decode
        raise InvalidRequestError(
            f"request {request.id}: {len(request.blocks)} blocks hold fewer than its "
            f"{len(ids)} prompt tokens"
        )
    if request.slots and len(request.slots) < len(ids):
        raise InvalidRequestError(
            f"request {request.id}: {len(request.slots)} slots for {len(ids)} prompt tokens"
        )
    return ids


def _new_sequence(ctx: StepContext, request: Request, ids: list[int], grammar) -> Sequence:
    owns = not request.blocks
    needed = blocks_needed(
        kv_tokens(len(ids), request.stopping_parameters.max_new_tokens), ctx.block_size
    )
    blocks = list(request.blocks) or ctx.allocator.allocate(needed)
    return Sequence(
        request,
        list(ids),
        len(ids),
        blocks,
        ctx.block_size,
        owns,
        list(request.slots),
        sampling=new_sampling_state(request.parameters, request.id, ctx.unset_seed(request.id)),
        grammar=None if grammar is None else ctx.grammars().new_state(grammar),
        prefix_offset=max(len(ids) - 5, 0),
        read_offset=len(ids),
        cache_len=request.cache_len,
    )


def _cap(ctx: StepContext) -> int:
    """Most new tokens of a sequence in one forward. Without prefix caching nothing is chunked (no
    context buckets): a prompt is computed whole, up to the longest prefill bucket."""
    longest = ctx.runner.plan.max_prefill_seq_len
    return chunk_cap(longest, ctx.block_size) if ctx.contents is not None else longest


def prefill_step(
    ctx: StepContext, sequences: list[Sequence], batch_rows: int | None = None
) -> list[Generation]:
    """The next chunk of each prefilling sequence (all of a prompt that fits); a sequence whose
    prompt is then computed samples its first token (engine/serving/chunks.py). `n`/`best_of`
    siblings compute nothing: once their source's prompt is computed they copy it and sample
    from its logits (engine/serving/siblings.py). `batch_rows`: how many rows the batch these
    join will decode (a draft model computes its KV of the prompts only where it speculates)."""
    shared = siblings.sources(sequences)
    planned = plan_chunks(
        [s for i, s in enumerate(sequences) if i not in shared],
        ctx.limits.max_prefill_tokens,
        _cap(ctx),
        uncut=ctx.vision is not None and ctx.vision.spec.bidirectional,
    )
    if not planned:
        return []
    output = ctx.runner.prefill([_prefill_input(ctx, s, a, b) for s, a, b in planned])
    for seq, start, end in planned:
        seq.computed = end
        _count_chunk(ctx, seq, start, end)
    finished = {seq.id: row for row, (seq, _, _) in enumerate(planned) if not seq.prefilling}
    copies = {i: j for i, j in shared.items() if sequences[j].id in finished}
    siblings.copy_prompts(ctx.runner, sequences, copies, ctx.limits.max_input_tokens)
    for i in copies:
        sequences[i].computed = sequences[i].prefill_end
    record_contents(ctx, [s for s, _, _ in planned] + [sequences[i] for i in copies])
    rows = [(planned[row][0], row) for row in finished.values()]
    rows += [(sequences[i], finished[sequences[j].id]) for i, j in copies.items()]
    generations = (
        _advance(ctx, [s for s, _ in rows], output.logits, [r for _, r in rows]) if rows else []
    )
    if ctx.speculator is not None:
        ctx.speculator.prime(
            [s for s, _ in rows if s.finish_reason is None],
            len(sequences) if batch_rows is None else batch_rows,
            ctx.block_size,
        )
    _attach_prompt_logprobs(ctx, rows, output.prompt_logprobs, generations)
    return generations


def _prefill_input(ctx: StepContext, seq: Sequence, start: int, end: int) -> PrefillInput:
    """The runner's input for prompt positions [start, end) of `seq`, after its first `start`."""
    return PrefillInput(
        seq.token_ids[start:end],
        seq.slots(start, end),
        seq.request.prefill_logprobs and start == 0,
        adapter_slot(ctx, seq.request),
        seq.slots(0, start),
        _image_features(ctx, seq, start, end),
        _rope_positions(seq, start, end),
    )


def _count_chunk(ctx: StepContext, seq: Sequence, start: int, end: int) -> None:
    """chunk_stats counts a prefill of a part of a prompt, and each prompt so cut once."""
    if ctx.chunk_stats is not None and (start, end) != (seq.cache_len, seq.prefill_end):
        ctx.chunk_stats["prefill_chunks"] += 1
        ctx.chunk_stats["chunked_prompts"] += start == seq.cache_len


def _attach_prompt_logprobs(ctx: StepContext, rows, prompt_logprobs, generations) -> None:
    """Each first generation of a request that asked for its prompt's logprobs gets them:
    `rows` pairs each sequence with its row of the prefill output."""
    by_id = {g.request_id: g for g in generations}
    for seq, row in rows:
        logprobs = prompt_logprobs.get(row)
        if logprobs is not None and seq.request.prefill_logprobs and seq.id in by_id:
            by_id[seq.id].prefill_tokens = _scored_tokens(
                ctx, seq.token_ids[: seq.prompt_len], logprobs
            )


def _image_features(ctx: StepContext, seq: Sequence, start: int, end: int):
    """The features of the image tokens among positions [start, end) of the prompt."""
    if seq.image_features is None:
        return None
    token = ctx.vision.spec.image_token_id
    before = seq.token_ids[:start].count(token)
    return seq.image_features[before : before + seq.token_ids[start:end].count(token)]


def _rope_positions(seq: Sequence, start: int, end: int):
    """M-RoPE positions of tokens [start, end) of a prompt with images (None: plain positions)."""
    if seq.rope_positions is None:
        return None
    from engine.vision.grids import chunk_positions

    return chunk_positions(seq.rope_positions, seq.rope_delta, start, end)


def decode_step(
    ctx: StepContext, sequences: list[Sequence], ahead: Ahead | None = None
) -> list[Generation]:
    """One token for every decoding sequence; the next chunk for those still prefilling. `ahead`: a
    lookahead's logits (engine/serving/lookahead.py), used for the rows it computed."""
    prefilling = {
        s.id for s in sequences if s.prefilling
    }  # before the chunk: a finished one decodes next step
    generations = (
        prefill_step(ctx, [s for s in sequences if s.id in prefilling], len(sequences))
        if prefilling
        else []
    )
    sequences = [s for s in sequences if s.id not in prefilling]
    if not sequences:
        return generations
    for seq in sequences:
        if not _has_next_slot(ctx, seq):
            raise InvalidRequestError(
                f"request {seq.id}: its KV blocks are full at position {len(seq.token_ids) - 1}"
            )
    if ctx.speculator is not None and not (ahead is not None and ahead.covers(sequences)):
        speculated = speculative_step(
            ctx,
            sequences,
            [adapter_slot(ctx, s.request) for s in sequences],
            _advance,
            record_contents,
        )
        if speculated is not None:  # None: this step decodes plainly (engine/speculative/step.py)
            return generations + speculated
    # Phi-3 recomputes at its rope switch (decode_logits, under logits_using).
    logits = logits_using(ahead, ctx.runner, sequences, _decode_inputs(ctx, sequences))
    for seq in sequences:
        seq.computed = len(seq.token_ids)
    record_contents(
        ctx, [s for s in sequences if len(s.token_ids) % ctx.block_size == 0]
    )  # a block just filled
    return generations + _advance(ctx, sequences, logits)


def look_ahead_step(ctx: StepContext, sequences: list[Sequence]) -> Ahead | None:
    """The next step's forward of these sequences, run now; None where it cannot run yet: a row
    still prefilling, or one whose next position needs a KV block the router has not added."""
    if not sequences or any(s.prefilling or not _has_next_slot(ctx, s) for s in sequences):
        return None
    if ctx.speculator is not None and len(sequences) <= ctx.speculator.max_batch:
        return None  # the step speculates: its forward is a verify, run at the step itself
    return run_ahead(ctx.runner, sequences, _decode_inputs(ctx, sequences))


def _has_next_slot(ctx: StepContext, seq: Sequence) -> bool:
    return blocks_needed(len(seq.token_ids), ctx.block_size) <= len(seq.blocks)


def _decode_inputs(ctx: StepContext, sequences: list[Sequence]) -> list[DecodeInput]:
    """Each row's latest token at its position, the slot its KV goes to and the blocks it reads."""
    inputs = []
    for seq in sequences:
        position = len(seq.token_ids) - 1
        inputs.append(
            DecodeInput(
                seq.token_ids[-1],
                position,
                seq.slots(position, position + 1)[0],
                seq.blocks_through(position),
                adapter_slot(ctx, seq.request),
                seq.rope_delta,
            )
        )
    return inputs


def record_contents(ctx: StepContext, sequences: list[Sequence]) -> None:
    """After a forward, every token of each sequence is in the cache: note the blocks they fill."""
    if ctx.contents is not None:
        for seq in sequences:
            ids = seq.token_ids
            if seq.keyed_prompt is not None:  # image tokens' ids do not say which image
                ids = seq.keyed_prompt + ids[len(seq.keyed_prompt) :]
            ctx.contents.record(seq.blocks, ids, seq.request.adapter_id, seq.computed)


def _keyed(ctx: StepContext, request: Request, ids: list[int]) -> list[int]:
    """The ids its KV blocks are hashed over: a VLM prompt's image tokens keyed by their image."""
    if request.chunks is None or ctx.vision is None:
        return ids
    return ctx.vision.keyed(request, ids)


def _advance(
    ctx: StepContext, sequences: list[Sequence], logits, rows: list[int] | None = None, choice=None
) -> list[Generation]:
    """Choose and append the next token of every sequence (from logits[rows[i]]: rows None, the
    first ones); generations for this rank's requests. `choice`: tokens already chosen
    (speculative decoding's rejection rule, engine/speculative/step.py)."""
    choice = choice or choose_next(
        ctx.runner,
        logits,
        rows or list(range(len(sequences))),
        sequences,
        allowed_tokens(ctx, sequences, logits),
    )
    generations = []
    for row, seq in enumerate(sequences):
        token = choice.token_ids[row]
        seq.token_ids.append(token)
        if seq.grammar is not None:
            seq.grammar.advance(token)
        text, seq.prefix_offset, seq.read_offset = decode_next(
            ctx.tokenizer, seq.token_ids, seq.prefix_offset, seq.read_offset
        )
        seq.output_text += text
        seq.finish_reason = _finish_reason(ctx, seq, token, text)
        if seq.id % ctx.world_size == ctx.rank:
            top = _top_tokens(ctx, choice.top_tokens[row])
            generations.append(_generation(ctx, seq, token, choice.logprobs[row], text, top))
    return generations


def _finish_reason(ctx: StepContext, seq: Sequence, token: int, text: str) -> FinishReason | None:
    stopping = seq.request.stopping_parameters
    if token in ctx.eos_token_ids and not stopping.ignore_eos_token:
        return FinishReason.EOS_TOKEN
    if text and _hits_stop_sequence(seq.output_text, len(text), stopping.stop_sequences):
        return FinishReason.STOP_SEQUENCE
    if seq.generated >= seq.max_new_tokens:
        return FinishReason.LENGTH
    return None


def _hits_stop_sequence(output: str, new_chars: int, stop_sequences: list[str]) -> bool:
    """Whether a stop sequence ends inside the newest text; it may have begun in earlier tokens."""
    for stop in stop_sequences:
        if stop and stop in output[-(len(stop) + new_chars - 1) :]:
            return True
    return False


def _scored_tokens(ctx: StepContext, ids: list[int], logprobs: list[float]) -> Tokens:
    """Tokens with each id's own text and whether it is a special token."""
    texts = [ctx.tokenizer.decode([token], skip_special_tokens=False) for token in ids]
    return Tokens(list(ids), list(logprobs), texts, [t in ctx.special_token_ids for t in ids])


def _top_tokens(ctx: StepContext, pairs: list[tuple[int, float]]) -> list[Tokens]:
    if not pairs:
        return []
    return [_scored_tokens(ctx, [token for token, _ in pairs], [logprob for _, logprob in pairs])]


def _generation(
    ctx: StepContext, seq: Sequence, token: int, logprob: float, text: str, top: list[Tokens]
) -> Generation:
    finished = None
    if seq.finish_reason is not None:
        output = ctx.tokenizer.decode(seq.generated_ids, skip_special_tokens=True)
        seed = seq.sampling.seed if is_sampling(seq.request.parameters) else None
        finished = GeneratedText(output, seq.generated, seq.finish_reason, seed)
    tokens = Tokens([token], [logprob], [text], [token in ctx.special_token_ids])
    return Generation(seq.id, None, tokens, finished, top)
