"""Hypothesis-generated generate.v3 calls against a live `engine serve` shard: random fields, random
blocks and slots, random batch ids, random call order. Every call is answered OK or with a status
naming the caller's mistake, never INTERNAL or UNKNOWN; the shard stays up; and after a ClearCache a
well-formed request still gives transformers' tokens. Bounded: a fixed number of call sequences."""

import shutil
from datetime import timedelta

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.wire import generate_pb2 as pb
from engine.wire import generate_pb2_grpc as pb_grpc
from tests.test_equivalence import PROMPTS, reference_tokens
from tests.test_server import (
    NEW_TOKENS,
    collect,
    drain,
    prompt_request,
    short_socket_dir,
    start_cli_server,
    stop_cli_server,
    tgi_warmup_request,
    wait_until_serving,
)

pytestmark = pytest.mark.slow  # end to end: a real shard process

EXAMPLES = 40
CALLS_PER_EXAMPLE = 8
ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,
}

u32 = st.one_of(st.integers(0, 40), st.integers(0, 2**32 - 1))
u64 = st.one_of(st.integers(0, 8), st.integers(0, 2**64 - 1))
f32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
texts = st.one_of(st.sampled_from(PROMPTS), st.text(max_size=30))
SANE = pb.NextTokenChooserParameters(
    temperature=1.0, top_p=1.0, typical_p=1.0, repetition_penalty=1.0
)

# Each part is either what a router would send or anything at all, so that sequences reach the
# shard's deeper states (live batches, router-assigned blocks) as well as its first checks.
random_parameters = st.builds(
    pb.NextTokenChooserParameters,
    temperature=f32,
    top_k=u32,
    top_p=f32,
    typical_p=f32,
    do_sample=st.booleans(),
    seed=u64,
    repetition_penalty=f32,
    watermark=st.booleans(),
    frequency_penalty=f32,
    grammar=st.sampled_from(["", "[a-z]+", "(unclosed", "[^\\s\\S]", '{"type": "object"}']),
    grammar_type=st.integers(0, 3),
)
parameters = st.one_of(st.just(SANE), random_parameters)
stopping = st.one_of(
    st.builds(
        lambda n: pb.StoppingCriteriaParameters(max_new_tokens=n, ignore_eos_token=True),
        st.integers(1, 20),
    ),
    st.builds(
        pb.StoppingCriteriaParameters,
        max_new_tokens=u32,
        stop_sequences=st.lists(st.text(max_size=5), max_size=2),
        ignore_eos_token=st.booleans(),
    ),
)


def block_lists(num_blocks: int):
    """Router-assigned blocks: none (the shard allocates), inside the cache, or around its ends."""
    inside = st.lists(st.integers(1, num_blocks - 1), min_size=3, max_size=6)
    edges = st.lists(
        st.sampled_from([0, 1, num_blocks - 1, num_blocks, num_blocks + 7, 2**32 - 1]),
        min_size=1,
        max_size=6,
    )
    return st.one_of(st.just([]), inside, edges)


def requests(num_blocks: int):
    """Half are a router's requests with random ids, blocks and slots; half are random in every field."""

    def build(i, text, truncate, params, stop, logprobs, top_n, b, slots, cache_len, chunk):
        return pb.Request(
            id=i,
            inputs=text,
            input_chunks=pb.Input(chunks=[pb.InputChunk(text=text)]),
            truncate=truncate,
            parameters=params,
            stopping_parameters=stop,
            prefill_logprobs=logprobs,
            top_n_tokens=top_n,
            blocks=b,
            slots=slots,
            cache_len=cache_len,
            chunk_len=chunk,
        )

    slots = st.one_of(st.just([]), st.lists(st.integers(0, 16 * num_blocks + 40), max_size=40))
    routers = st.builds(
        build,
        st.integers(0, 6),
        st.sampled_from(PROMPTS),
        st.just(0),
        st.just(SANE),
        stopping,
        st.booleans(),
        st.integers(0, 2),
        block_lists(num_blocks),
        slots,
        st.just(0),
        st.none(),
    )
    anything = st.builds(
        build,
        st.integers(0, 6),
        texts,
        u32,
        parameters,
        stopping,
        st.booleans(),
        u32,
        block_lists(num_blocks),
        slots,
        u32,
        st.one_of(st.none(), u32),
    )
    return st.one_of(routers, anything)


batch_ids = st.integers(0, 4)
cached_batches = st.builds(
    lambda i, ids, size: pb.CachedBatch(id=i, request_ids=ids, size=size),
    batch_ids,
    st.lists(st.integers(0, 6), max_size=3),
    u32,
)


def calls(num_blocks: int):
    return st.one_of(
        st.builds(
            lambda i, rs, c: (
                "Prefill",
                pb.PrefillRequest(batch=pb.Batch(id=i, requests=rs, size=len(rs)), cached_batch=c),
            ),
            batch_ids,
            st.lists(requests(num_blocks), min_size=1, max_size=3),
            st.one_of(st.none(), cached_batches),
        ),
        st.builds(
            lambda bs: ("Decode", pb.DecodeRequest(batches=bs)),
            st.lists(cached_batches, max_size=3),
        ),
        st.builds(
            lambda i, ids: ("FilterBatch", pb.FilterBatchRequest(batch_id=i, request_ids=ids)),
            batch_ids,
            st.lists(st.integers(0, 6), max_size=3),
        ),
        st.builds(
            lambda i: (
                "ClearCache",
                pb.ClearCacheRequest(id=i) if i is not None else pb.ClearCacheRequest(),
            ),
            st.one_of(st.none(), batch_ids),
        ),
    )


@pytest.fixture(scope="module")
def shard_stub(tiny_model_dirs):
    base = short_socket_dir()
    process = start_cli_server(
        tiny_model_dirs["llama"], base / "s", extra=["--max-batch-size", "4"]
    )
    try:
        channel = wait_until_serving(process, f"unix://{base}/s-0", base / "s")
        stub = pb_grpc.TextGenerationServiceStub(channel)
        capacity = stub.Warmup(tgi_warmup_request(64, 128, 128, 4)).max_supported_total_tokens
        yield stub, process, capacity // 16 + 1
        channel.close()
    finally:
        stop_cli_server(process)
        shutil.rmtree(base, ignore_errors=True)


def test_random_calls_never_break_the_shard(shard_stub, tiny_model_dirs, capsys):
    stub, process, num_blocks = shard_stub
    counts: dict[str, int] = {}

    @settings(
        max_examples=EXAMPLES,
        deadline=timedelta(seconds=30),
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(sequence=st.lists(calls(num_blocks), min_size=1, max_size=CALLS_PER_EXAMPLE))
    def one(sequence):
        stub.ClearCache(pb.ClearCacheRequest(), timeout=30)
        for method, request in sequence:
            try:
                getattr(stub, method)(request, timeout=30)
                code = grpc.StatusCode.OK
            except grpc.RpcError as error:
                code = error.code()
                assert code in ALLOWED, f"{method} answered {code.name}: {error.details()}"
            counts[code.name] = counts.get(code.name, 0) + 1
        assert process.poll() is None, "the shard died"

    one()
    stub.ClearCache(pb.ClearCacheRequest(), timeout=30)
    tokens = {}
    response = stub.Prefill(
        pb.PrefillRequest(batch=pb.Batch(id=1, requests=[prompt_request(1)], size=1))
    )
    drain(stub, collect(tokens, response), tokens)
    assert tokens == {1: reference_tokens(tiny_model_dirs["llama"], PROMPTS[1:2], NEW_TOKENS)[0]}
    with capsys.disabled():
        print(
            f"\nwire fuzz: {EXAMPLES} sequences, {sum(counts.values())} calls, by status {counts}"
        )
