"""`/v1/embeddings`: each input's final hidden state (after the final norm) at its last token, or
averaged (--pooling mean), L2-normalized, computed in the warmed prefill buckets without a KV
block (engine/layers/pooling.py, engine/serving/embed.py), and served over gRPC (a tiny random
Qwen3 that declares Matryoshka sizes) and in process (the embedded SmolLM2, `--single-process`),
each compared with transformers' hidden states in float32."""

from __future__ import annotations

import asyncio
import base64
import struct
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoTokenizer

from engine.batch import EmbedInput
from engine.errors import InvalidRequestError
from tests.helpers import PROMPTS, build_request, reference_tokens, tiny_shard
from tests.models import build_tiny_model

QWEN3 = {"qwen3": ("Qwen3Config", dict(tie_word_embeddings=False, matryoshka_dimensions=[16, 32]))}
TEXTS = [PROMPTS[0], PROMPTS[1], PROMPTS[3], PROMPTS[5]]  # 1 to 10 tokens: several buckets
COSINE = 0.999


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory, smollm_dir):
    """A tiny random Qwen3 (q/k norms, untied head) whose config.json allows `dimensions` 16, 32."""
    out = tmp_path_factory.mktemp("qwen3") / "qwen3"
    return build_tiny_model("qwen3", out, smollm_dir, variants=QWEN3, randomize_norms=True)


def reference(model_dir, ids: list[list[int]], pooling: str = "last") -> list[torch.Tensor]:
    """transformers' final hidden states (after the final norm), pooled and normalized."""
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    vectors = []
    with torch.no_grad():
        for item in ids:
            states = model(torch.tensor([item])).last_hidden_state[0]
            pooled = states[-1] if pooling == "last" else states.mean(dim=0)
            vectors.append(F.normalize(pooled, dim=-1))
    return vectors


def cosines(got: list[list[float]], expected: list[torch.Tensor]) -> list[float]:
    return [F.cosine_similarity(torch.tensor(g), e, dim=0).item() for g, e in zip(got, expected)]


def token_ids(model_dir, texts: list[str]) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [tokenizer(text)["input_ids"] for text in texts]


# --- the shard ------------------------------------------------------------------------------------


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_a_batch_of_different_lengths_equals_transformers(qwen3_dir, pooling):
    shard = tiny_shard(qwen3_dir, pooling=pooling, max_batch_size=4)
    ids = token_ids(qwen3_dir, TEXTS)
    embeddings = shard.embed([EmbedInput(i, item) for i, item in enumerate(ids)])
    assert [e.request_id for e in embeddings] == list(range(len(TEXTS)))
    assert min(cosines([e.values for e in embeddings], reference(qwen3_dir, ids, pooling))) > COSINE
    assert all(abs(sum(v * v for v in e.values) - 1) < 1e-5 for e in embeddings)


def test_an_embedding_holds_no_block_and_a_running_batch_goes_on_unharmed(tiny_model_dirs):
    model_dir = tiny_model_dirs["llama"]
    shard = tiny_shard(model_dir, max_batch_size=4)
    expected = reference_tokens(model_dir, [PROMPTS[1]], 8)[0]
    generations, cached = shard.prefill(_batch([build_request(1, 8)]))
    tokens, free = [generations[0].tokens.ids[0]], shard.allocator.num_free
    for _ in range(7):
        ids = token_ids(model_dir, TEXTS)
        shard.embed([EmbedInput(i, item) for i, item in enumerate(ids)])
        assert shard.allocator.num_free == free
        generations, cached = shard.decode([cached])
        tokens.append(generations[0].tokens.ids[0])
    assert tokens == expected
    assert shard.serving_stats()["unwarmed_shapes"] == 0


@pytest.mark.slow
def test_embeddings_compile_no_graph_while_serving_under_the_hpu_simulator(qwen3_dir):
    """The pooling variant is warmed with each plain prefill bucket: the lazy-graph simulator
    (which runs every warmed bucket) counts no compile and no break at serving time."""
    simulated = tiny_shard(qwen3_dir, simulate="hpu", max_batch_size=4)
    plain = tiny_shard(qwen3_dir, max_batch_size=4)
    inputs = [EmbedInput(i, item) for i, item in enumerate(token_ids(qwen3_dir, TEXTS))]
    got, expected = simulated.embed(inputs), plain.embed(inputs)
    stats = simulated.serving_stats()
    assert stats["graph_compiles_serving"] == 0 and stats["graph_breaks_serving"] == 0
    assert stats["prefill_forwards"] >= 1
    assert (
        min(cosines([g.values for g in got], [torch.tensor(e.values) for e in expected])) > COSINE
    )


def test_dimensions_truncate_and_renormalize_where_the_config_allows(qwen3_dir, tiny_model_dirs):
    shard = tiny_shard(qwen3_dir)
    ids = token_ids(qwen3_dir, [PROMPTS[1]])[0]
    whole, short = shard.embed([EmbedInput(0, ids), EmbedInput(1, ids, dimensions=16)])
    assert len(short.values) == 16
    expected = F.normalize(torch.tensor(whole.values[:16]), dim=-1)
    assert torch.allclose(torch.tensor(short.values), expected, atol=1e-6)
    with pytest.raises(InvalidRequestError, match="allowed: 16, 32"):
        shard.embed([EmbedInput(0, ids, dimensions=20)])
    llama = tiny_shard(tiny_model_dirs["llama"])
    with pytest.raises(InvalidRequestError, match="declares no Matryoshka"):
        llama.embed([EmbedInput(0, ids, dimensions=16)])


def test_bad_inputs_are_refused_naming_them(qwen3_dir):
    shard = tiny_shard(qwen3_dir, max_input_tokens=32, max_total_tokens=64)
    for inputs, named in (
        ([], "at least one input"),
        ([EmbedInput(3, [])], "input 3: no tokens"),
        ([EmbedInput(0, [1] * 33)], "exceed max_input_tokens=32"),
        ([EmbedInput(0, [1]), EmbedInput(1, [10**9])], "input 1: token id 1000000000"),
    ):
        with pytest.raises(InvalidRequestError, match=named):
            shard.embed(inputs)


def test_pooling_none_serves_no_embeddings(qwen3_dir):
    shard = tiny_shard(qwen3_dir, pooling="none")
    with pytest.raises(InvalidRequestError, match="--pooling none"):
        shard.embed([EmbedInput(0, [1, 2])])


class CallsInFlight:
    """The in-process client, counting its calls in flight (over gRPC nothing else serializes
    them: an Embed beside a Decode would meet the ranks' collectives in different orders)."""

    def __init__(self, inner):
        self.inner, self.in_flight, self.most, self.names = inner, 0, 0, []

    def __getattr__(self, name):
        attribute = getattr(self.inner, name)
        if not asyncio.iscoroutinefunction(attribute):
            return attribute

        async def counted(*args, **kwargs):
            self.in_flight += 1
            self.most, self.names = max(self.most, self.in_flight), [*self.names, name]
            try:
                return await attribute(*args, **kwargs)
            finally:
                self.in_flight -= 1

        return counted


def test_the_scheduler_runs_embed_calls_between_its_steps_never_beside_one(tiny_model_dirs):
    from router.client import InProcessClient
    from router.sched.allocator import BlockAllocator
    from router.sched.scheduler import Scheduler
    from tests.test_router_scheduler import LIMITS, make_request

    model_dir = tiny_model_dirs["llama"]
    shard = tiny_shard(model_dir, warmup=LIMITS, max_batch_size=4)
    expected = reference_tokens(model_dir, PROMPTS[:2], 12)
    lengths = [len(item) for item in token_ids(model_dir, PROMPTS[:2])]
    ids = token_ids(model_dir, TEXTS)

    async def run():
        client = CallsInFlight(InProcessClient(shard, max_batch_size=4))
        capacity = shard.runner.kv_cache.capacity_tokens
        scheduler = Scheduler(client, BlockAllocator(capacity // 16 + 1, 16), LIMITS)
        await scheduler.start()
        try:
            streams = [scheduler.submit(make_request(i, 12), lengths[i]) for i in range(2)]
            firsts = [(await anext(stream)).tokens.ids for stream in streams]  # both running
            embeds = [scheduler.embed([EmbedInput(0, ids[k % 4])]) for k in range(6)]
            results = await asyncio.gather(*(rest(stream) for stream in streams), *embeds)
            results[:2] = [first + tokens for first, tokens in zip(firsts, results)]
        finally:
            await scheduler.stop()
            await client.inner.close()
        return client, results

    async def rest(stream) -> list[int]:
        return [token async for generation in stream for token in generation.tokens.ids]

    client, results = asyncio.run(run())
    assert results[:2] == expected  # the generations went on unharmed
    assert all(len(result) == 1 for result in results[2:])
    assert client.most == 1, "an Embed ran beside another shard call"
    assert "embed" in client.names and "decode" in client.names[client.names.index("embed") :]


def _batch(requests):
    from engine.batch import Batch

    return Batch(1, requests, len(requests), sum(len(r.inputs) for r in requests))


# --- through the router: gRPC (tiny Qwen3) --------------------------------------------------------


@pytest.fixture(scope="module")
def grpc_url(qwen3_dir):
    from tests.test_router_http import shard_and_router
    from tests.test_server import short_socket_dir

    with shard_and_router(qwen3_dir, short_socket_dir() / "e", ["--max-batch-size", "4"]) as served:
        yield served[0]


def openai_client(url: str, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=120)


@pytest.mark.slow
def test_the_openai_client_gets_transformers_embeddings_over_grpc(grpc_url, qwen3_dir):
    client = openai_client(grpc_url)
    ids = token_ids(qwen3_dir, TEXTS)
    answer = client.embeddings.create(model="qwen3", input=TEXTS)
    got = [d.embedding for d in sorted(answer.data, key=lambda d: d.index)]
    assert min(cosines(got, reference(qwen3_dir, ids))) > COSINE
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == sum(map(len, ids))
    by_ids = client.embeddings.create(model="qwen3", input=ids, encoding_format="float")
    assert [d.embedding for d in by_ids.data] == got  # the same tokens, the same forward
    one = client.embeddings.create(model="qwen3", input=ids[1], encoding_format="float")
    assert one.data[0].embedding == got[1]
    short = client.embeddings.create(model="qwen3", input=TEXTS[1], dimensions=32)
    expected = F.normalize(torch.tensor(got[1][:32]), dim=-1)
    assert torch.allclose(torch.tensor(short.data[0].embedding), expected, atol=1e-6)


@pytest.mark.slow
def test_base64_is_the_float_vector_as_little_endian_float32(grpc_url):
    body = {"input": TEXTS[:2], "encoding_format": "base64"}
    packed = httpx.post(f"{grpc_url}/v1/embeddings", json=body, timeout=60).json()["data"]
    floats = httpx.post(
        f"{grpc_url}/v1/embeddings", json={**body, "encoding_format": "float"}, timeout=60
    ).json()["data"]
    for raw, plain in zip(packed, floats):
        data = base64.b64decode(raw["embedding"])
        values = struct.unpack(f"<{len(data) // 4}f", data)
        assert list(values) == [
            struct.unpack("<f", struct.pack("<f", v))[0] for v in plain["embedding"]
        ]


BAD_BODIES = [
    ({"input": ""}, "`input[0]` cannot be empty"),
    ({"input": []}, "`input` cannot be empty"),
    ({"input": [[]]}, "`input[0]` cannot be empty"),
    ({"input": ["fine", ""]}, "`input[1]` cannot be empty"),
    ({"input": 5}, "`input`"),
    ({"input": [1.5, 2]}, "`input`"),
    ({"input": ["a", 1]}, "`input`"),
    ({"input": [True]}, "`input`"),
    ({}, "`input`"),
    ({"input": "hi", "encoding_format": "hex"}, "`encoding_format`"),
    ({"input": "hi", "dimensions": 0}, "`dimensions` must be at least 1"),
    ({"input": "hi", "dimensions": 20}, "`dimensions` 20 is not supported (allowed: 16, 32)"),
    ({"input": "hi", "dimensions": "16"}, "`dimensions`"),
    ({"input": "hi " * 80}, "must have at most 64 tokens"),
    ({"input": [[1] * 65]}, "must have at most 64 tokens"),
    ({"input": [[49152]]}, "token id 49152 is not in the vocabulary"),
    ({"input": "hi", "suffix": "x"}, "not implemented: `suffix`"),
]


@pytest.mark.slow
def test_bad_input_is_a_400_in_openais_shape_and_a_generation_beside_it_is_unharmed(grpc_url):
    completion = {"prompt": PROMPTS[2], "max_tokens": 16, "temperature": 0}
    alone = httpx.post(f"{grpc_url}/v1/completions", json=completion, timeout=120).json()
    with ThreadPoolExecutor(2) as pool:
        beside = pool.submit(httpx.post, f"{grpc_url}/v1/completions", json=completion, timeout=120)
        for body, named in BAD_BODIES:
            response = httpx.post(f"{grpc_url}/v1/embeddings", json=body, timeout=60)
            assert response.status_code == 400, (body, response.text)
            error = response.json()["error"]
            assert error["type"] == "invalid_request_error" and named in error["message"], body
        good = httpx.post(f"{grpc_url}/v1/embeddings", json={"input": "still fine"}, timeout=60)
        assert good.status_code == 200
        assert beside.result().json()["choices"] == alone["choices"]
    with pytest.raises(openai.BadRequestError):
        openai_client(grpc_url).embeddings.create(model="qwen3", input="hi", dimensions=20)


@pytest.mark.slow
def test_embeddings_are_counted_and_described(grpc_url):
    before = httpx.get(f"{grpc_url}/metrics", timeout=30).text
    httpx.post(f"{grpc_url}/v1/embeddings", json={"input": ["a b", "c"]}, timeout=60)
    after = httpx.get(f"{grpc_url}/metrics", timeout=30).text
    assert _metric(after, "bucketserve_embedding_inputs_total") == (
        _metric(before, "bucketserve_embedding_inputs_total") + 2
    )
    assert _metric(after, 'bucketserve_batch_size_count{phase="embed"}') >= 1
    paths = httpx.get(f"{grpc_url}/openapi.json", timeout=30).json()["paths"]
    schema = paths["/v1/embeddings"]["post"]["requestBody"]["content"]["application/json"]
    assert {"input", "encoding_format", "dimensions"} <= set(schema["schema"]["properties"])


def _metric(text: str, name: str) -> float:
    line = next((line for line in text.splitlines() if line.startswith(name + " ")), None)
    return float(line.split()[-1]) if line else 0.0


# --- in process: the embedded model behind `--single-process`, with an API key -------------------


@pytest.mark.slow
def test_the_embedded_model_in_process_equals_transformers_behind_its_api_key(smollm_dir):
    from tests.test_launcher import Launch
    from tests.test_launcher_router import wait_served
    from tests.test_server import short_socket_dir

    launch = Launch(
        smollm_dir, "--single-process", "--device", "cpu", "--hostname", "127.0.0.1",
        "--api-key", "sesame", folder=short_socket_dir(),
    )  # fmt: skip
    try:
        url = wait_served(launch)
        refused = httpx.post(f"{url}/v1/embeddings", json={"input": "hi"}, timeout=60)
        assert refused.status_code == 401
        answer = openai_client(url, "sesame").embeddings.create(model="tgi", input=TEXTS)
        got = [d.embedding for d in answer.data]
        assert min(cosines(got, reference(smollm_dir, token_ids(smollm_dir, TEXTS)))) > COSINE
        with pytest.raises(openai.BadRequestError, match="declares no Matryoshka"):
            openai_client(url, "sesame").embeddings.create(model="tgi", input="hi", dimensions=8)
    finally:
        launch.clean_up()


# --- tensor parallelism: two shard processes ------------------------------------------------------


@pytest.mark.slow
def test_two_tensor_parallel_ranks_run_the_forward_and_rank_0_answers(qwen3_dir):
    from engine.wire import generate_pb2 as pb
    from tests.test_tensor_parallel import run_sharded

    ids = token_ids(qwen3_dir, TEXTS)

    def embed(router, _requests):
        inputs = [pb.EmbedInput(id=i, token_ids=item) for i, item in enumerate(ids)]
        return router.call("Embed", pb.EmbedRequest(inputs=inputs))

    first, second = run_sharded(qwen3_dir, 2, body=embed)
    assert len(second.embeddings) == 0 and [e.request_id for e in first.embeddings] == [0, 1, 2, 3]
    got = [list(e.values) for e in first.embeddings]
    assert min(cosines(got, reference(qwen3_dir, ids))) > COSINE


# --- tracing: an in-process router with the SDK's in-memory exporter ------------------------------


def test_an_embeddings_request_span_has_an_embed_child(tiny_model_dirs):
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from router.http import tracing
    from tests.test_router_tracing import serve_and_call

    exporter = InMemorySpanExporter()
    traces = tracing.Tracing.with_processor(SimpleSpanProcessor(exporter))
    shard = tiny_shard(tiny_model_dirs["llama"], warmup=False, max_batch_size=4)

    async def calls(client, app):
        answer = await client.embeddings.create(model="tiny", input=["Hi", "Water boils at"])
        return answer.usage.prompt_tokens

    tokens = asyncio.run(serve_and_call(shard, tiny_model_dirs["llama"], traces, calls))
    spans = exporter.get_finished_spans()
    (root,) = [s for s in spans if s.name == "POST /v1/embeddings"]
    (embed,) = [s for s in spans if s.name == "embed"]
    assert embed.parent.span_id == root.context.span_id
    assert dict(embed.attributes) == {"inputs": 2, "tokens": tokens}
    assert root.attributes["http.response.status_code"] == 200
