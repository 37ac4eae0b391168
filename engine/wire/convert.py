"""Translation between generate.v3 protobuf messages and the engine's plain dataclasses.

Inbound: Request, Batch, CachedBatch, and the extensions of the step requests (resumed tokens,
lookahead, trace contexts). Outbound: Generation (with Tokens and GeneratedText), CachedBatch,
InfoResponse, WarmupResult, ServingStats. proto3 `optional` fields that are unset become None,
and None becomes an unset field. The router's side of each is at the end.
"""

from __future__ import annotations

from engine import batch as eb
from engine.errors import InvalidRequestError
from engine.wire import generate_pb2 as pb


def optional_field(message, name: str):
    """The value of a proto3 `optional` field, or None when the sender left it unset."""
    return getattr(message, name) if message.HasField(name) else None


# --- inbound --------------------------------------------------------------------------------


def parameters_from_pb(
    message: pb.NextTokenChooserParameters, request_id: int
) -> eb.NextTokenChooserParameters:
    try:
        grammar_type = eb.GrammarType(message.grammar_type)
    except ValueError:
        raise InvalidRequestError(
            f"request {request_id}: unknown grammar_type {message.grammar_type}"
        ) from None
    return eb.NextTokenChooserParameters(
        temperature=message.temperature,
        top_k=message.top_k,
        top_p=message.top_p,
        typical_p=message.typical_p,
        do_sample=message.do_sample,
        seed=message.seed,
        repetition_penalty=message.repetition_penalty,
        watermark=message.watermark,
        frequency_penalty=message.frequency_penalty,
        grammar=message.grammar,
        grammar_type=grammar_type,
        presence_penalty=message.presence_penalty,
        logit_bias=logit_bias_from_pb(message, request_id),
        grammar_reasoning_start=message.grammar_reasoning_start,
        grammar_reasoning_end=message.grammar_reasoning_end,
    )


def logit_bias_from_pb(message: pb.NextTokenChooserParameters, request_id: int) -> dict[int, float]:
    ids, values = list(message.logit_bias_ids), list(message.logit_bias_values)
    if len(ids) != len(values):
        raise InvalidRequestError(
            f"request {request_id}: {len(ids)} logit_bias_ids but {len(values)} values"
        )
    return dict(zip(ids, values))


def stopping_from_pb(message: pb.StoppingCriteriaParameters) -> eb.StoppingCriteriaParameters:
    return eb.StoppingCriteriaParameters(
        max_new_tokens=message.max_new_tokens,
        stop_sequences=list(message.stop_sequences),
        ignore_eos_token=message.ignore_eos_token,
        min_new_tokens=message.min_new_tokens,
    )


def request_text(message: pb.Request) -> str:
    """The prompt. TGI routers send it twice: as text chunks, and as `inputs` where images are
    inlined as markdown. The text chunks win, and image chunks are dropped, as TGI's own text models
    do: TGI's warmup adds an image to its first request whatever the model."""
    chunks = message.input_chunks.chunks if message.HasField("input_chunks") else []
    texts = [chunk.text for chunk in chunks if chunk.WhichOneof("chunk") == "text"]
    if texts:
        return "".join(texts)
    if not message.inputs and chunks:
        raise InvalidRequestError(
            f"request {message.id}: image inputs are not supported by this model"
        )
    return message.inputs


def request_chunks(message: pb.Request) -> list[str | eb.ImageInput] | None:
    """The prompt's text and image chunks in order, where it has an image (else None): a
    vision-language model reads these; a text model reads request_text alone."""
    chunks = message.input_chunks.chunks if message.HasField("input_chunks") else []
    if not any(chunk.WhichOneof("chunk") == "image" for chunk in chunks):
        return None
    return [
        chunk.text
        if chunk.WhichOneof("chunk") == "text"
        else eb.ImageInput(chunk.image.data, chunk.image.mimetype)
        for chunk in chunks
    ]


def chunks_to_pb(request: eb.Request) -> pb.Input:
    if request.chunks is None:
        return pb.Input(chunks=[pb.InputChunk(text=request.inputs)])
    return pb.Input(
        chunks=[
            pb.InputChunk(text=chunk)
            if isinstance(chunk, str)
            else pb.InputChunk(image=pb.Image(data=chunk.data, mimetype=chunk.mimetype))
            for chunk in request.chunks
        ]
    )


def request_from_pb(message: pb.Request) -> eb.Request:
    # A router that leaves a parameter message unset gets the engine's defaults, not proto zeros
    # (max_new_tokens=0 or temperature=0 would be refused or mean something else).
    parameters = (
        parameters_from_pb(message.parameters, message.id)
        if message.HasField("parameters")
        else eb.NextTokenChooserParameters()
    )
    stopping = (
        stopping_from_pb(message.stopping_parameters)
        if message.HasField("stopping_parameters")
        else eb.StoppingCriteriaParameters()
    )
    return eb.Request(
        id=message.id,
        inputs=request_text(message),
        truncate=message.truncate,
        parameters=parameters,
        stopping_parameters=stopping,
        prefill_logprobs=message.prefill_logprobs,
        top_n_tokens=message.top_n_tokens,
        blocks=list(message.blocks),
        slots=list(message.slots),
        adapter_id=optional_field(message, "adapter_id"),
        cache_len=message.cache_len,
        add_special_tokens=message.add_special_tokens,
        chunk_len=optional_field(message, "chunk_len"),
        prefill_source=optional_field(message, "prefill_source"),
        chunks=request_chunks(message),
    )


def batch_from_pb(message: pb.Batch) -> eb.Batch:
    return eb.Batch(
        id=message.id,
        requests=[request_from_pb(r) for r in message.requests],
        size=message.size,
        max_tokens=message.max_tokens,
        max_blocks=message.max_blocks,
    )


def cached_batch_from_pb(message: pb.CachedBatch) -> eb.CachedBatch:
    return eb.CachedBatch(
        id=message.id,
        request_ids=list(message.request_ids),
        size=message.size,
        max_tokens=message.max_tokens,
        current_tokens=message.current_tokens,
    )


def grown_from_pb(message: pb.DecodeRequest) -> dict[int, list[int]]:
    """The DecodeRequest extension: request id -> blocks it gets before the step (KV on demand)."""
    if len(message.grown_request_ids) != len(message.grown_blocks):
        raise InvalidRequestError(
            f"grown_request_ids has {len(message.grown_request_ids)} entries and grown_blocks "
            f"{len(message.grown_blocks)}: they are parallel lists"
        )
    grown: dict[int, list[int]] = {}
    for request_id, block in zip(message.grown_request_ids, message.grown_blocks):
        grown.setdefault(request_id, []).append(block)
    return grown


def resume_from_pb(message: pb.PrefillRequest) -> dict[int, list[int]]:
    """The Request extension: request id -> the tokens it generated before a shard restart."""
    return {r.id: list(r.resume_tokens) for r in message.batch.requests if r.resume_tokens}


def traceparents_from_pb(message: pb.PrefillRequest | pb.DecodeRequest) -> dict[int, str]:
    """The step requests' extension: request id -> the W3C traceparent of its open phase span."""
    return dict(message.traceparents)


def decode_request_to_pb(
    batches: list[eb.CachedBatch],
    grown: dict[int, list[int]] | None,
    look_ahead: bool = False,
    traceparents: dict[int, str] | None = None,
    step_order: int = 0,
) -> pb.DecodeRequest:
    pairs = [(i, b) for i, blocks in (grown or {}).items() for b in blocks]
    return pb.DecodeRequest(
        batches=[cached_batch_to_pb(b) for b in batches],
        grown_request_ids=[i for i, _ in pairs],
        grown_blocks=[b for _, b in pairs],
        look_ahead=look_ahead,
        traceparents=traceparents,
        step_order=step_order,
    )


# --- outbound -------------------------------------------------------------------------------


def cached_batch_to_pb(cached: eb.CachedBatch) -> pb.CachedBatch:
    return pb.CachedBatch(
        id=cached.id,
        request_ids=cached.request_ids,
        size=cached.size,
        max_tokens=cached.max_tokens,
        current_tokens=cached.current_tokens,
    )


def tokens_to_pb(tokens: eb.Tokens) -> pb.Tokens:
    return pb.Tokens(
        ids=tokens.ids, logprobs=tokens.logprobs, texts=tokens.texts, is_special=tokens.is_special
    )


def generated_text_to_pb(done: eb.GeneratedText) -> pb.GeneratedText:
    return pb.GeneratedText(
        text=done.text,
        generated_tokens=done.generated_tokens,
        finish_reason=int(done.finish_reason),
        seed=done.seed,
    )


def generation_to_pb(generation: eb.Generation) -> pb.Generation:
    message = pb.Generation(
        request_id=generation.request_id,
        tokens=tokens_to_pb(generation.tokens),
        top_tokens=[tokens_to_pb(t) for t in generation.top_tokens],
    )
    if generation.prefill_tokens is not None:
        message.prefill_tokens.CopyFrom(tokens_to_pb(generation.prefill_tokens))
    if generation.generated_text is not None:
        message.generated_text.CopyFrom(generated_text_to_pb(generation.generated_text))
    return message


def info_to_pb(info: eb.InfoResponse) -> pb.InfoResponse:
    return pb.InfoResponse(
        requires_padding=info.requires_padding,
        dtype=info.dtype,
        device_type=info.device_type,
        window_size=info.window_size,
        speculate=info.speculate,
        support_chunking=info.support_chunking,
        use_prefix_caching=info.use_prefix_caching,
        attention_impl=info.attention_impl,
        block_size=info.block_size,
        pipeline_stages=info.pipeline_stages,
    )


def warmup_to_pb(result: eb.WarmupResult) -> pb.WarmupResponse:
    return pb.WarmupResponse(
        max_supported_total_tokens=result.max_supported_total_tokens,
        max_input_tokens=result.max_input_tokens,
        max_total_tokens=result.max_total_tokens,
    )


def stats_to_pb(stats: dict) -> pb.ServingStats:
    """A counter the message lacks raises ValueError: a new counter needs its field in the proto.
    The plan, warmup and bucket figures (Shard.serving_stats) travel in their own fields."""
    counters = dict(stats)
    plan, warmup = counters.pop("plan_buckets", (0, 0)), counters.pop("warmup", (0, 0))
    buckets = [bucket_use_to_pb(entry) for entry in counters.pop("buckets", ())]
    return pb.ServingStats(
        **counters,
        plan_prefill_buckets=plan[0],
        plan_decode_buckets=plan[1],
        warmed_buckets=warmup[0],
        warmup_buckets=warmup[1],
        buckets=buckets,
    )


def bucket_use_to_pb(entry: list) -> pb.BucketUse:
    """Shard.bucket_counts' compact row: a prefill row names its context blocks, a decode row
    not."""
    if entry[0] in ("prefill", "verify"):  # verify: its width is the length
        phase, batch, length, context, forwards, real, padded = entry
    else:
        (phase, batch, length, forwards, real, padded), context = entry, 0
    return pb.BucketUse(
        phase=phase,
        batch_size=batch,
        length=length,
        context_blocks=context,
        forwards=forwards,
        real=real,
        padded=padded,
    )


# --- router side: what a router sends and what it reads back ----------------------------------


def parameters_to_pb(parameters: eb.NextTokenChooserParameters) -> pb.NextTokenChooserParameters:
    return pb.NextTokenChooserParameters(
        temperature=parameters.temperature,
        top_k=parameters.top_k,
        top_p=parameters.top_p,
        typical_p=parameters.typical_p,
        do_sample=parameters.do_sample,
        seed=parameters.seed,
        repetition_penalty=parameters.repetition_penalty,
        watermark=parameters.watermark,
        frequency_penalty=parameters.frequency_penalty,
        grammar=parameters.grammar,
        grammar_type=int(parameters.grammar_type),
        presence_penalty=parameters.presence_penalty,
        logit_bias_ids=list(parameters.logit_bias),
        logit_bias_values=list(parameters.logit_bias.values()),
        grammar_reasoning_start=parameters.grammar_reasoning_start,
        grammar_reasoning_end=parameters.grammar_reasoning_end,
    )


def stopping_to_pb(stopping: eb.StoppingCriteriaParameters) -> pb.StoppingCriteriaParameters:
    return pb.StoppingCriteriaParameters(
        max_new_tokens=stopping.max_new_tokens,
        stop_sequences=stopping.stop_sequences,
        ignore_eos_token=stopping.ignore_eos_token,
        min_new_tokens=stopping.min_new_tokens,
    )


def request_to_pb(request: eb.Request, resume_tokens: list[int] | None = None) -> pb.Request:
    """`resume_tokens`: what the request generated before the shards restarted (none: a new one)."""
    # The text goes both as `inputs` and as text chunks (with the image chunks between them), as
    # TGI's router sends it: v3 shards differ in which of the two they read.
    return pb.Request(
        id=request.id,
        inputs=request.inputs,
        input_chunks=chunks_to_pb(request),
        truncate=request.truncate,
        parameters=parameters_to_pb(request.parameters),
        stopping_parameters=stopping_to_pb(request.stopping_parameters),
        prefill_logprobs=request.prefill_logprobs,
        top_n_tokens=request.top_n_tokens,
        blocks=request.blocks,
        slots=request.slots,
        adapter_id=request.adapter_id,
        cache_len=request.cache_len,
        add_special_tokens=request.add_special_tokens,
        chunk_len=request.chunk_len,
        prefill_source=request.prefill_source,
        resume_tokens=resume_tokens,
    )


def batch_to_pb(batch: eb.Batch, resume: dict[int, list[int]] | None = None) -> pb.Batch:
    """`resume`: request id -> its tokens generated before a restart, for the resumed requests."""
    requests = [request_to_pb(r, (resume or {}).get(r.id)) for r in batch.requests]
    return pb.Batch(
        id=batch.id,
        requests=requests,
        size=batch.size,
        max_tokens=batch.max_tokens,
        max_blocks=batch.max_blocks,
    )


def prefill_request_to_pb(
    batch: eb.Batch,
    cached: eb.CachedBatch | None = None,
    resume: dict[int, list[int]] | None = None,
    traceparents: dict[int, str] | None = None,
    step_order: int = 0,
) -> pb.PrefillRequest:
    return pb.PrefillRequest(
        batch=batch_to_pb(batch, resume),
        cached_batch=cached_batch_to_pb(cached) if cached else None,
        traceparents=traceparents,
        step_order=step_order,
    )


def tokens_from_pb(message: pb.Tokens) -> eb.Tokens:
    return eb.Tokens(
        ids=list(message.ids),
        logprobs=list(message.logprobs),
        texts=list(message.texts),
        is_special=list(message.is_special),
    )


def generated_text_from_pb(message: pb.GeneratedText) -> eb.GeneratedText:
    return eb.GeneratedText(
        text=message.text,
        generated_tokens=message.generated_tokens,
        finish_reason=eb.FinishReason(message.finish_reason),
        seed=optional_field(message, "seed"),
    )


def generation_from_pb(message: pb.Generation) -> eb.Generation:
    prefill = tokens_from_pb(message.prefill_tokens) if message.HasField("prefill_tokens") else None
    done = (
        generated_text_from_pb(message.generated_text)
        if message.HasField("generated_text")
        else None
    )
    return eb.Generation(
        request_id=message.request_id,
        prefill_tokens=prefill,
        tokens=tokens_from_pb(message.tokens),
        generated_text=done,
        top_tokens=[tokens_from_pb(t) for t in message.top_tokens],
    )


def info_from_pb(message: pb.InfoResponse) -> eb.InfoResponse:
    return eb.InfoResponse(
        requires_padding=message.requires_padding,
        dtype=message.dtype,
        device_type=message.device_type,
        window_size=optional_field(message, "window_size"),
        speculate=message.speculate,
        support_chunking=message.support_chunking,
        use_prefix_caching=message.use_prefix_caching,
        attention_impl=message.attention_impl,
        block_size=message.block_size,
        pipeline_stages=max(message.pipeline_stages, 1),  # 0: a shard that has no stages (TGI's)
    )


def warmup_from_pb(message: pb.WarmupResponse) -> eb.WarmupResult:
    # max_supported_total_tokens is optional on the wire: a shard that does not know its capacity
    # leaves it unset, and the router then gets None there.
    return eb.WarmupResult(
        max_supported_total_tokens=optional_field(message, "max_supported_total_tokens"),
        max_input_tokens=message.max_input_tokens,
        max_total_tokens=message.max_total_tokens,
    )


PLAN_FIELDS = (
    "plan_prefill_buckets",
    "plan_decode_buckets",
    "warmed_buckets",
    "warmup_buckets",
    "buckets",
)


def stats_from_pb(message: pb.ServingStats) -> dict:
    """The same dict as Shard.serving_stats returns, so an in-process shard and a gRPC one read
    alike."""
    stats = {
        f.name: getattr(message, f.name)
        for f in message.DESCRIPTOR.fields
        if f.name not in PLAN_FIELDS
    }
    stats["plan_buckets"] = [message.plan_prefill_buckets, message.plan_decode_buckets]
    stats["warmup"] = [message.warmed_buckets, message.warmup_buckets]
    stats["buckets"] = [bucket_use_from_pb(b) for b in message.buckets]
    return stats


def bucket_use_from_pb(use: pb.BucketUse) -> list:
    head = [use.phase, use.batch_size, use.length]
    if use.phase == "prefill":
        head.append(use.context_blocks)
    return [*head, use.forwards, use.real, use.padded]


def warmup_request_to_pb(
    batch: eb.Batch | None,
    max_input_tokens: int | None,
    max_prefill_tokens: int,
    max_total_tokens: int | None,
) -> pb.WarmupRequest:
    return pb.WarmupRequest(
        batch=batch_to_pb(batch) if batch is not None else None,
        max_input_tokens=max_input_tokens,
        max_prefill_tokens=max_prefill_tokens,
        max_total_tokens=max_total_tokens,
    )


# --- Embed (a bucketserve extension RPC, proto/CONTRACT.md section 4) -----------------------------


def embed_request_to_pb(inputs: list[eb.EmbedInput]) -> pb.EmbedRequest:
    return pb.EmbedRequest(
        inputs=[
            pb.EmbedInput(id=i.id, token_ids=i.token_ids, dimensions=i.dimensions) for i in inputs
        ]
    )


def embed_inputs_from_pb(message: pb.EmbedRequest) -> list[eb.EmbedInput]:
    return [eb.EmbedInput(i.id, list(i.token_ids), i.dimensions) for i in message.inputs]


def embeddings_to_pb(embeddings: list[eb.Embedding], stats: dict) -> pb.EmbedResponse:
    return pb.EmbedResponse(
        embeddings=[pb.Embedding(request_id=e.request_id, values=e.values) for e in embeddings],
        stats=stats_to_pb(stats),
    )


def embeddings_from_pb(message: pb.EmbedResponse) -> list[eb.Embedding]:
    return [eb.Embedding(e.request_id, list(e.values)) for e in message.embeddings]
