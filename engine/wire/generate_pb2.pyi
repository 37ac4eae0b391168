from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GrammarType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GRAMMAR_TYPE_NONE: _ClassVar[GrammarType]
    GRAMMAR_TYPE_JSON: _ClassVar[GrammarType]
    GRAMMAR_TYPE_REGEX: _ClassVar[GrammarType]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_EOS_TOKEN: _ClassVar[FinishReason]
    FINISH_REASON_STOP_SEQUENCE: _ClassVar[FinishReason]
GRAMMAR_TYPE_NONE: GrammarType
GRAMMAR_TYPE_JSON: GrammarType
GRAMMAR_TYPE_REGEX: GrammarType
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_EOS_TOKEN: FinishReason
FINISH_REASON_STOP_SEQUENCE: FinishReason

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("requires_padding", "dtype", "device_type", "window_size", "speculate", "support_chunking", "use_prefix_caching", "attention_impl", "block_size", "pipeline_stages")
    REQUIRES_PADDING_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_TYPE_FIELD_NUMBER: _ClassVar[int]
    WINDOW_SIZE_FIELD_NUMBER: _ClassVar[int]
    SPECULATE_FIELD_NUMBER: _ClassVar[int]
    SUPPORT_CHUNKING_FIELD_NUMBER: _ClassVar[int]
    USE_PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_IMPL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_STAGES_FIELD_NUMBER: _ClassVar[int]
    requires_padding: bool
    dtype: str
    device_type: str
    window_size: int
    speculate: int
    support_chunking: bool
    use_prefix_caching: bool
    attention_impl: str
    block_size: int
    pipeline_stages: int
    def __init__(self, requires_padding: _Optional[bool] = ..., dtype: _Optional[str] = ..., device_type: _Optional[str] = ..., window_size: _Optional[int] = ..., speculate: _Optional[int] = ..., support_chunking: _Optional[bool] = ..., use_prefix_caching: _Optional[bool] = ..., attention_impl: _Optional[str] = ..., block_size: _Optional[int] = ..., pipeline_stages: _Optional[int] = ...) -> None: ...

class ServiceDiscoveryRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServiceDiscoveryResponse(_message.Message):
    __slots__ = ("urls",)
    URLS_FIELD_NUMBER: _ClassVar[int]
    urls: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, urls: _Optional[_Iterable[str]] = ...) -> None: ...

class ClearCacheRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: int
    def __init__(self, id: _Optional[int] = ...) -> None: ...

class ClearCacheResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Image(_message.Message):
    __slots__ = ("data", "mimetype")
    DATA_FIELD_NUMBER: _ClassVar[int]
    MIMETYPE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    mimetype: str
    def __init__(self, data: _Optional[bytes] = ..., mimetype: _Optional[str] = ...) -> None: ...

class InputChunk(_message.Message):
    __slots__ = ("text", "image")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    text: str
    image: Image
    def __init__(self, text: _Optional[str] = ..., image: _Optional[_Union[Image, _Mapping]] = ...) -> None: ...

class Input(_message.Message):
    __slots__ = ("chunks",)
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[InputChunk]
    def __init__(self, chunks: _Optional[_Iterable[_Union[InputChunk, _Mapping]]] = ...) -> None: ...

class NextTokenChooserParameters(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "typical_p", "do_sample", "seed", "repetition_penalty", "watermark", "frequency_penalty", "grammar", "grammar_type", "presence_penalty", "logit_bias_ids", "logit_bias_values", "grammar_reasoning_start", "grammar_reasoning_end")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TYPICAL_P_FIELD_NUMBER: _ClassVar[int]
    DO_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    WATERMARK_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_TYPE_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_VALUES_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_REASONING_START_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_REASONING_END_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    typical_p: float
    do_sample: bool
    seed: int
    repetition_penalty: float
    watermark: bool
    frequency_penalty: float
    grammar: str
    grammar_type: GrammarType
    presence_penalty: float
    logit_bias_ids: _containers.RepeatedScalarFieldContainer[int]
    logit_bias_values: _containers.RepeatedScalarFieldContainer[float]
    grammar_reasoning_start: str
    grammar_reasoning_end: str
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., typical_p: _Optional[float] = ..., do_sample: _Optional[bool] = ..., seed: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., watermark: _Optional[bool] = ..., frequency_penalty: _Optional[float] = ..., grammar: _Optional[str] = ..., grammar_type: _Optional[_Union[GrammarType, str]] = ..., presence_penalty: _Optional[float] = ..., logit_bias_ids: _Optional[_Iterable[int]] = ..., logit_bias_values: _Optional[_Iterable[float]] = ..., grammar_reasoning_start: _Optional[str] = ..., grammar_reasoning_end: _Optional[str] = ...) -> None: ...

class StoppingCriteriaParameters(_message.Message):
    __slots__ = ("max_new_tokens", "stop_sequences", "ignore_eos_token", "min_new_tokens")
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    MIN_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    stop_sequences: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos_token: bool
    min_new_tokens: int
    def __init__(self, max_new_tokens: _Optional[int] = ..., stop_sequences: _Optional[_Iterable[str]] = ..., ignore_eos_token: _Optional[bool] = ..., min_new_tokens: _Optional[int] = ...) -> None: ...

class Request(_message.Message):
    __slots__ = ("id", "inputs", "truncate", "parameters", "stopping_parameters", "prefill_logprobs", "top_n_tokens", "input_chunks", "blocks", "slots", "adapter_id", "cache_len", "add_special_tokens", "chunk_len", "prefill_source", "resume_tokens")
    ID_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    STOPPING_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_N_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INPUT_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_LEN_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_LEN_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SOURCE_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKENS_FIELD_NUMBER: _ClassVar[int]
    id: int
    inputs: str
    truncate: int
    parameters: NextTokenChooserParameters
    stopping_parameters: StoppingCriteriaParameters
    prefill_logprobs: bool
    top_n_tokens: int
    input_chunks: Input
    blocks: _containers.RepeatedScalarFieldContainer[int]
    slots: _containers.RepeatedScalarFieldContainer[int]
    adapter_id: str
    cache_len: int
    add_special_tokens: bool
    chunk_len: int
    prefill_source: int
    resume_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, id: _Optional[int] = ..., inputs: _Optional[str] = ..., truncate: _Optional[int] = ..., parameters: _Optional[_Union[NextTokenChooserParameters, _Mapping]] = ..., stopping_parameters: _Optional[_Union[StoppingCriteriaParameters, _Mapping]] = ..., prefill_logprobs: _Optional[bool] = ..., top_n_tokens: _Optional[int] = ..., input_chunks: _Optional[_Union[Input, _Mapping]] = ..., blocks: _Optional[_Iterable[int]] = ..., slots: _Optional[_Iterable[int]] = ..., adapter_id: _Optional[str] = ..., cache_len: _Optional[int] = ..., add_special_tokens: _Optional[bool] = ..., chunk_len: _Optional[int] = ..., prefill_source: _Optional[int] = ..., resume_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class Batch(_message.Message):
    __slots__ = ("id", "requests", "size", "max_tokens", "max_blocks")
    ID_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    id: int
    requests: _containers.RepeatedCompositeFieldContainer[Request]
    size: int
    max_tokens: int
    max_blocks: int
    def __init__(self, id: _Optional[int] = ..., requests: _Optional[_Iterable[_Union[Request, _Mapping]]] = ..., size: _Optional[int] = ..., max_tokens: _Optional[int] = ..., max_blocks: _Optional[int] = ...) -> None: ...

class CachedBatch(_message.Message):
    __slots__ = ("id", "request_ids", "size", "max_tokens", "current_tokens")
    ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CURRENT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    id: int
    request_ids: _containers.RepeatedScalarFieldContainer[int]
    size: int
    max_tokens: int
    current_tokens: int
    def __init__(self, id: _Optional[int] = ..., request_ids: _Optional[_Iterable[int]] = ..., size: _Optional[int] = ..., max_tokens: _Optional[int] = ..., current_tokens: _Optional[int] = ...) -> None: ...

class GeneratedText(_message.Message):
    __slots__ = ("text", "generated_tokens", "finish_reason", "seed")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    text: str
    generated_tokens: int
    finish_reason: FinishReason
    seed: int
    def __init__(self, text: _Optional[str] = ..., generated_tokens: _Optional[int] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., seed: _Optional[int] = ...) -> None: ...

class Tokens(_message.Message):
    __slots__ = ("ids", "logprobs", "texts", "is_special")
    IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    IS_SPECIAL_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    texts: _containers.RepeatedScalarFieldContainer[str]
    is_special: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., texts: _Optional[_Iterable[str]] = ..., is_special: _Optional[_Iterable[bool]] = ...) -> None: ...

class Generation(_message.Message):
    __slots__ = ("request_id", "prefill_tokens", "tokens", "generated_text", "top_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TEXT_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    prefill_tokens: Tokens
    tokens: Tokens
    generated_text: GeneratedText
    top_tokens: _containers.RepeatedCompositeFieldContainer[Tokens]
    def __init__(self, request_id: _Optional[int] = ..., prefill_tokens: _Optional[_Union[Tokens, _Mapping]] = ..., tokens: _Optional[_Union[Tokens, _Mapping]] = ..., generated_text: _Optional[_Union[GeneratedText, _Mapping]] = ..., top_tokens: _Optional[_Iterable[_Union[Tokens, _Mapping]]] = ...) -> None: ...

class FilterBatchRequest(_message.Message):
    __slots__ = ("batch_id", "request_ids")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    request_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, batch_id: _Optional[int] = ..., request_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class FilterBatchResponse(_message.Message):
    __slots__ = ("batch",)
    BATCH_FIELD_NUMBER: _ClassVar[int]
    batch: CachedBatch
    def __init__(self, batch: _Optional[_Union[CachedBatch, _Mapping]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("batch", "cached_batch", "traceparents", "step_order")
    class TraceparentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: str
        def __init__(self, key: _Optional[int] = ..., value: _Optional[str] = ...) -> None: ...
    BATCH_FIELD_NUMBER: _ClassVar[int]
    CACHED_BATCH_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENTS_FIELD_NUMBER: _ClassVar[int]
    STEP_ORDER_FIELD_NUMBER: _ClassVar[int]
    batch: Batch
    cached_batch: CachedBatch
    traceparents: _containers.ScalarMap[int, str]
    step_order: int
    def __init__(self, batch: _Optional[_Union[Batch, _Mapping]] = ..., cached_batch: _Optional[_Union[CachedBatch, _Mapping]] = ..., traceparents: _Optional[_Mapping[int, str]] = ..., step_order: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("generations", "batch", "forward_ns", "decode_ns", "total_ns", "concat_ns", "stats")
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    FORWARD_NS_FIELD_NUMBER: _ClassVar[int]
    DECODE_NS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NS_FIELD_NUMBER: _ClassVar[int]
    CONCAT_NS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    generations: _containers.RepeatedCompositeFieldContainer[Generation]
    batch: CachedBatch
    forward_ns: int
    decode_ns: int
    total_ns: int
    concat_ns: int
    stats: ServingStats
    def __init__(self, generations: _Optional[_Iterable[_Union[Generation, _Mapping]]] = ..., batch: _Optional[_Union[CachedBatch, _Mapping]] = ..., forward_ns: _Optional[int] = ..., decode_ns: _Optional[int] = ..., total_ns: _Optional[int] = ..., concat_ns: _Optional[int] = ..., stats: _Optional[_Union[ServingStats, _Mapping]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("batches", "grown_request_ids", "grown_blocks", "look_ahead", "traceparents", "step_order")
    class TraceparentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: str
        def __init__(self, key: _Optional[int] = ..., value: _Optional[str] = ...) -> None: ...
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    GROWN_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    GROWN_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOOK_AHEAD_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENTS_FIELD_NUMBER: _ClassVar[int]
    STEP_ORDER_FIELD_NUMBER: _ClassVar[int]
    batches: _containers.RepeatedCompositeFieldContainer[CachedBatch]
    grown_request_ids: _containers.RepeatedScalarFieldContainer[int]
    grown_blocks: _containers.RepeatedScalarFieldContainer[int]
    look_ahead: bool
    traceparents: _containers.ScalarMap[int, str]
    step_order: int
    def __init__(self, batches: _Optional[_Iterable[_Union[CachedBatch, _Mapping]]] = ..., grown_request_ids: _Optional[_Iterable[int]] = ..., grown_blocks: _Optional[_Iterable[int]] = ..., look_ahead: _Optional[bool] = ..., traceparents: _Optional[_Mapping[int, str]] = ..., step_order: _Optional[int] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("generations", "batch", "forward_ns", "decode_ns", "total_ns", "concat_ns", "stats")
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    FORWARD_NS_FIELD_NUMBER: _ClassVar[int]
    DECODE_NS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NS_FIELD_NUMBER: _ClassVar[int]
    CONCAT_NS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    generations: _containers.RepeatedCompositeFieldContainer[Generation]
    batch: CachedBatch
    forward_ns: int
    decode_ns: int
    total_ns: int
    concat_ns: int
    stats: ServingStats
    def __init__(self, generations: _Optional[_Iterable[_Union[Generation, _Mapping]]] = ..., batch: _Optional[_Union[CachedBatch, _Mapping]] = ..., forward_ns: _Optional[int] = ..., decode_ns: _Optional[int] = ..., total_ns: _Optional[int] = ..., concat_ns: _Optional[int] = ..., stats: _Optional[_Union[ServingStats, _Mapping]] = ...) -> None: ...

class ServingStats(_message.Message):
    __slots__ = ("prefill_real", "prefill_padded", "decode_real", "decode_padded", "unwarmed_shapes", "prefill_forwards", "decode_forwards", "copied_prompts", "chunked_prompts", "prefill_chunks", "lookahead_runs", "lookahead_steps", "plan_prefill_buckets", "plan_decode_buckets", "warmed_buckets", "warmup_buckets", "buckets_used", "buckets", "images_encoded", "encoder_ns", "image_cache_hits", "graph_compiles_warmup", "graph_compiles_serving", "graph_breaks_warmup", "graph_breaks_serving", "graph_recompiles_warmup", "graph_recompiles_serving", "spec_steps", "spec_proposed", "spec_accepted", "spec_emitted", "spec_acceptance_rate", "spec_mean_accepted_length", "spec_k")
    PREFILL_REAL_FIELD_NUMBER: _ClassVar[int]
    PREFILL_PADDED_FIELD_NUMBER: _ClassVar[int]
    DECODE_REAL_FIELD_NUMBER: _ClassVar[int]
    DECODE_PADDED_FIELD_NUMBER: _ClassVar[int]
    UNWARMED_SHAPES_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FORWARDS_FIELD_NUMBER: _ClassVar[int]
    DECODE_FORWARDS_FIELD_NUMBER: _ClassVar[int]
    COPIED_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    CHUNKED_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_RUNS_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_STEPS_FIELD_NUMBER: _ClassVar[int]
    PLAN_PREFILL_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    PLAN_DECODE_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    WARMED_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    WARMUP_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_USED_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_ENCODED_FIELD_NUMBER: _ClassVar[int]
    ENCODER_NS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    GRAPH_COMPILES_WARMUP_FIELD_NUMBER: _ClassVar[int]
    GRAPH_COMPILES_SERVING_FIELD_NUMBER: _ClassVar[int]
    GRAPH_BREAKS_WARMUP_FIELD_NUMBER: _ClassVar[int]
    GRAPH_BREAKS_SERVING_FIELD_NUMBER: _ClassVar[int]
    GRAPH_RECOMPILES_WARMUP_FIELD_NUMBER: _ClassVar[int]
    GRAPH_RECOMPILES_SERVING_FIELD_NUMBER: _ClassVar[int]
    SPEC_STEPS_FIELD_NUMBER: _ClassVar[int]
    SPEC_PROPOSED_FIELD_NUMBER: _ClassVar[int]
    SPEC_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    SPEC_EMITTED_FIELD_NUMBER: _ClassVar[int]
    SPEC_ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    SPEC_MEAN_ACCEPTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    SPEC_K_FIELD_NUMBER: _ClassVar[int]
    prefill_real: int
    prefill_padded: int
    decode_real: int
    decode_padded: int
    unwarmed_shapes: int
    prefill_forwards: int
    decode_forwards: int
    copied_prompts: int
    chunked_prompts: int
    prefill_chunks: int
    lookahead_runs: int
    lookahead_steps: int
    plan_prefill_buckets: int
    plan_decode_buckets: int
    warmed_buckets: int
    warmup_buckets: int
    buckets_used: int
    buckets: _containers.RepeatedCompositeFieldContainer[BucketUse]
    images_encoded: int
    encoder_ns: int
    image_cache_hits: int
    graph_compiles_warmup: int
    graph_compiles_serving: int
    graph_breaks_warmup: int
    graph_breaks_serving: int
    graph_recompiles_warmup: int
    graph_recompiles_serving: int
    spec_steps: int
    spec_proposed: int
    spec_accepted: int
    spec_emitted: int
    spec_acceptance_rate: float
    spec_mean_accepted_length: float
    spec_k: int
    def __init__(self, prefill_real: _Optional[int] = ..., prefill_padded: _Optional[int] = ..., decode_real: _Optional[int] = ..., decode_padded: _Optional[int] = ..., unwarmed_shapes: _Optional[int] = ..., prefill_forwards: _Optional[int] = ..., decode_forwards: _Optional[int] = ..., copied_prompts: _Optional[int] = ..., chunked_prompts: _Optional[int] = ..., prefill_chunks: _Optional[int] = ..., lookahead_runs: _Optional[int] = ..., lookahead_steps: _Optional[int] = ..., plan_prefill_buckets: _Optional[int] = ..., plan_decode_buckets: _Optional[int] = ..., warmed_buckets: _Optional[int] = ..., warmup_buckets: _Optional[int] = ..., buckets_used: _Optional[int] = ..., buckets: _Optional[_Iterable[_Union[BucketUse, _Mapping]]] = ..., images_encoded: _Optional[int] = ..., encoder_ns: _Optional[int] = ..., image_cache_hits: _Optional[int] = ..., graph_compiles_warmup: _Optional[int] = ..., graph_compiles_serving: _Optional[int] = ..., graph_breaks_warmup: _Optional[int] = ..., graph_breaks_serving: _Optional[int] = ..., graph_recompiles_warmup: _Optional[int] = ..., graph_recompiles_serving: _Optional[int] = ..., spec_steps: _Optional[int] = ..., spec_proposed: _Optional[int] = ..., spec_accepted: _Optional[int] = ..., spec_emitted: _Optional[int] = ..., spec_acceptance_rate: _Optional[float] = ..., spec_mean_accepted_length: _Optional[float] = ..., spec_k: _Optional[int] = ...) -> None: ...

class BucketUse(_message.Message):
    __slots__ = ("phase", "batch_size", "length", "context_blocks", "forwards", "real", "padded")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FORWARDS_FIELD_NUMBER: _ClassVar[int]
    REAL_FIELD_NUMBER: _ClassVar[int]
    PADDED_FIELD_NUMBER: _ClassVar[int]
    phase: str
    batch_size: int
    length: int
    context_blocks: int
    forwards: int
    real: int
    padded: int
    def __init__(self, phase: _Optional[str] = ..., batch_size: _Optional[int] = ..., length: _Optional[int] = ..., context_blocks: _Optional[int] = ..., forwards: _Optional[int] = ..., real: _Optional[int] = ..., padded: _Optional[int] = ...) -> None: ...

class WarmupRequest(_message.Message):
    __slots__ = ("batch", "max_input_tokens", "max_prefill_tokens", "max_total_tokens")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    MAX_INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    batch: Batch
    max_input_tokens: int
    max_prefill_tokens: int
    max_total_tokens: int
    def __init__(self, batch: _Optional[_Union[Batch, _Mapping]] = ..., max_input_tokens: _Optional[int] = ..., max_prefill_tokens: _Optional[int] = ..., max_total_tokens: _Optional[int] = ...) -> None: ...

class WarmupResponse(_message.Message):
    __slots__ = ("max_supported_total_tokens", "max_input_tokens", "max_total_tokens")
    MAX_SUPPORTED_TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    max_supported_total_tokens: int
    max_input_tokens: int
    max_total_tokens: int
    def __init__(self, max_supported_total_tokens: _Optional[int] = ..., max_input_tokens: _Optional[int] = ..., max_total_tokens: _Optional[int] = ...) -> None: ...

class EmbedRequest(_message.Message):
    __slots__ = ("inputs",)
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    inputs: _containers.RepeatedCompositeFieldContainer[EmbedInput]
    def __init__(self, inputs: _Optional[_Iterable[_Union[EmbedInput, _Mapping]]] = ...) -> None: ...

class EmbedInput(_message.Message):
    __slots__ = ("id", "token_ids", "dimensions")
    ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    dimensions: int
    def __init__(self, id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., dimensions: _Optional[int] = ...) -> None: ...

class EmbedResponse(_message.Message):
    __slots__ = ("embeddings", "stats")
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    embeddings: _containers.RepeatedCompositeFieldContainer[Embedding]
    stats: ServingStats
    def __init__(self, embeddings: _Optional[_Iterable[_Union[Embedding, _Mapping]]] = ..., stats: _Optional[_Union[ServingStats, _Mapping]] = ...) -> None: ...

class Embedding(_message.Message):
    __slots__ = ("request_id", "values")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, request_id: _Optional[int] = ..., values: _Optional[_Iterable[float]] = ...) -> None: ...
