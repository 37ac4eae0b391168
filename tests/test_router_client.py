"""The router's shard clients: in process and over gRPC to a tensor-parallel group, the same tokens."""

import asyncio
import shutil

import grpc
import pytest
from transformers import AutoTokenizer

from engine.batch import Batch, CachedBatch, Request, StoppingCriteriaParameters, WarmupResult
from engine.serving.shard import Shard
from engine.wire import generate_pb2 as pb
from engine.wire import generate_pb2_grpc as pb_grpc
from router.client import GrpcShardClient, InProcessClient, ShardError, minimum_warmup
from router.sched.allocator import BlockAllocator
from tests.conftest import tiny_config
from tests.helpers import build_request, reference_fixture
from tests.test_equivalence import PROMPTS
from tests.test_server import (
    short_socket_dir,
    start_cli_server,
    stop_cli_server,
    wait_until_serving,
)
from tests.test_tensor_parallel import free_port

NEW_TOKENS = 20  # > one block of 16: decode crosses a block boundary
LIMITS = dict(max_input_tokens=64, max_prefill_tokens=128, max_total_tokens=128)
DROPPED = 5  # filtered out after the first decode


def requests(ids, tokenizer, allocator: BlockAllocator) -> list[Request]:
    """Requests as a v3 router sends them: with blocks and slots for prompt and completion."""
    made = []
    for i in ids:
        prompt_len = len(tokenizer(PROMPTS[i])["input_ids"])
        taken = allocator.allocate(prompt_len + NEW_TOKENS)
        made.append(
            build_request(i, NEW_TOKENS, blocks=list(taken.blocks), slots=list(taken.slots))
        )
    return made


def collect(tokens: dict, result) -> CachedBatch | None:
    generations, cached = result
    for generation in generations:
        tokens.setdefault(generation.request_id, []).extend(generation.tokens.ids)
    return cached


async def run_sequence(client, tokenizer) -> tuple[dict, WarmupResult]:
    """Warmup, two Prefills, Decode of both, FilterBatch, Decode to the end (looking ahead), ClearCache."""
    await client.health()
    info = await client.info()
    warmup_batch = Batch(
        0, [Request(0, "_test " * 8, stopping_parameters=StoppingCriteriaParameters(4))], size=1
    )
    warmed = await client.warmup(warmup_batch, **LIMITS)
    allocator = BlockAllocator(
        warmed.max_supported_total_tokens // info.block_size + 1, info.block_size
    )
    tokens = {}
    first = collect(
        tokens, await client.prefill(Batch(1, requests(range(3), tokenizer, allocator), size=3))
    )
    second = collect(
        tokens, await client.prefill(Batch(2, requests(range(3, 6), tokenizer, allocator), size=3))
    )
    cached = collect(tokens, await client.decode([first, second]))
    assert cached.id == 1 and sorted(cached.request_ids) == list(range(6))
    kept = [i for i in cached.request_ids if i != DROPPED]
    cached = await client.filter_batch(cached.id, kept)
    assert cached.request_ids == kept and cached.size == 5
    while (
        cached is not None
    ):  # looking ahead: each rank runs the next forward as soon as it answers
        cached = collect(tokens, await client.decode([cached], look_ahead=True))
    assert client.serving_stats()["lookahead_steps"] >= NEW_TOKENS - 4
    await client.clear_cache()
    for rpc in (client.decode([CachedBatch(77, [0], 1, 10, 5)]), client.filter_batch(77, [])):
        with pytest.raises(ShardError) as caught:
            await rpc
        assert caught.value.code == grpc.StatusCode.NOT_FOUND and "batch 77" in caught.value.message
    return tokens, warmed


def check_tokens(tokens: dict, expected: list) -> None:
    assert [tokens[i] for i in range(6) if i != DROPPED] == [
        e for i, e in enumerate(expected) if i != DROPPED
    ]
    assert tokens[DROPPED] == expected[DROPPED][:2]  # its prefill token and one decode token


expected = reference_fixture(PROMPTS, NEW_TOKENS)


def test_in_process_client(tiny_model_dirs, expected):
    shard = Shard(tiny_config(tiny_model_dirs["llama"]), show_progress=False)

    async def main():
        client = InProcessClient(shard, max_batch_size=8)
        try:
            return await run_sequence(client, shard.tokenizer)
        finally:
            await client.close()

    tokens, warmed = asyncio.run(main())
    check_tokens(tokens, expected)
    assert (warmed.max_input_tokens, warmed.max_total_tokens) == (64, 128)


@pytest.mark.slow
def test_grpc_client_on_two_tensor_parallel_shards(tiny_model_dirs, expected):
    model_dir = tiny_model_dirs["llama"]
    folder, port = short_socket_dir(), free_port()
    base = folder / "tp"
    env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    processes = [start_cli_server(model_dir, base, env={**env, "RANK": str(r)}) for r in range(2)]

    async def main():
        client = await GrpcShardClient.connect(f"unix://{base}-0", timeout=300)
        try:
            assert client.urls == [f"unix://{base}-{r}" for r in range(2)]
            return await run_sequence(client, AutoTokenizer.from_pretrained(model_dir))
        finally:
            await client.close()

    try:
        for rank, process in enumerate(processes):
            wait_until_serving(process, f"unix://{base}-{rank}", base).close()
        tokens, warmed = asyncio.run(main())
    finally:
        for process in processes:
            stop_cli_server(process)
        shutil.rmtree(folder, ignore_errors=True)
    check_tokens(tokens, expected)
    assert (warmed.max_input_tokens, warmed.max_total_tokens) == (64, 128)


# --- fan-out rules against fake shards ---------------------------------------------------------


class FakeShard(pb_grpc.TextGenerationServiceServicer):
    """A v3 shard that only answers Warmup (with fixed numbers) and fails Decode."""

    def __init__(self, capacity: int | None, max_input: int, max_total: int):
        self.answer = pb.WarmupResponse(
            max_supported_total_tokens=capacity,
            max_input_tokens=max_input,
            max_total_tokens=max_total,
        )

    async def Warmup(self, request, context):
        return self.answer

    async def Decode(self, request, context):
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "out of blocks")


async def fake_group(folder, answers) -> tuple[list, GrpcShardClient]:
    servers, urls = [], []
    for rank, answer in enumerate(answers):
        server = grpc.aio.server()
        pb_grpc.add_TextGenerationServiceServicer_to_server(FakeShard(*answer), server)
        urls.append(f"unix://{folder}/fake-{rank}")
        server.add_insecure_port(urls[-1])
        await server.start()
        servers.append(server)
    return servers, GrpcShardClient(urls, timeout=10)


def test_grpc_warmup_is_the_minimum_and_errors_name_the_shard():
    folder = short_socket_dir()

    async def main():
        servers, client = await fake_group(
            folder, [(4096, 100, 300), (2048, 200, 250), (None, 150, 400)]
        )
        try:
            warmed = await client.warmup(None, None, 512, None)
            with pytest.raises(ShardError) as caught:
                await client.decode([CachedBatch(1, [0], 1, 10, 5)])
            return warmed, caught.value, client.urls
        finally:
            await client.close()
            await asyncio.gather(*(s.stop(None) for s in servers))

    try:
        warmed, error, urls = asyncio.run(main())
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    assert warmed == WarmupResult(2048, 100, 250)
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (
        "Decode" in error.message and urls[0] in error.message and "out of blocks" in error.message
    )


def test_minimum_warmup_without_any_capacity():
    assert minimum_warmup([WarmupResult(None, 5, 9), WarmupResult(None, 7, 8)]) == WarmupResult(
        None, 5, 8
    )


class RecordingShard(pb_grpc.TextGenerationServiceServicer):
    """A v3 shard that records each step request and its metadata; with `stats`, it answers like
    ours (the ServingStats extension field), without, like TGI's."""

    def __init__(self, stats: pb.ServingStats | None):
        self.stats, self.seen = stats, []

    async def Prefill(self, request, context):
        self.seen.append((request, tuple(context.invocation_metadata())))
        return pb.PrefillResponse(stats=self.stats)

    async def Decode(self, request, context):
        self.seen.append((request, tuple(context.invocation_metadata())))
        return pb.DecodeResponse(stats=self.stats)


def steps_against(shard: RecordingShard, steps) -> GrpcShardClient:
    folder = short_socket_dir()

    async def main():
        server = grpc.aio.server()
        pb_grpc.add_TextGenerationServiceServicer_to_server(shard, server)
        server.add_insecure_port(f"unix://{folder}/rec-0")
        await server.start()
        client = GrpcShardClient([f"unix://{folder}/rec-0"], timeout=10)
        try:
            await steps(client)
            return client
        finally:
            await client.close()
            await server.stop(None)

    try:
        return asyncio.run(main())
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_the_router_sends_its_extensions_as_fields_and_reads_stats_from_a_field():
    async def steps(client):
        batch = Batch(3, [Request(7, "a"), Request(8, "b")], size=2)
        await client.prefill(batch, resume={7: [11, 12]})
        await client.decode([CachedBatch(3, [7, 8], 2, 10, 5)], look_ahead=True)
        await client.decode([CachedBatch(3, [7, 8], 2, 10, 6)])

    ours = RecordingShard(pb.ServingStats(prefill_real=5, lookahead_steps=2))
    client = steps_against(ours, steps)
    (prefill, _), (ahead, _), (plain, _) = ours.seen
    assert [list(r.resume_tokens) for r in prefill.batch.requests] == [[11, 12], []]
    assert (ahead.look_ahead, plain.look_ahead) == (True, False)
    assert all(
        not [k for k, _ in metadata if k.startswith("bucketserve")] for _, metadata in ours.seen
    )
    assert client.resumes and client.serving_stats()["prefill_real"] == 5
    assert client.serving_stats()["lookahead_steps"] == 2

    tgi = RecordingShard(None)  # answers without the stats field: no resume, no stats
    client = steps_against(tgi, steps)
    assert not client.resumes and client.serving_stats() is None
