"""Tensor parallelism with real shard processes on CPU (gloo): two shards give one shard's tokens."""

import shutil
import socket
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine.wire import generate_pb2 as pb
from engine.wire import generate_pb2_grpc as pb_grpc
from tests.models import build_tiny_model
from tests.test_equivalence import PROMPTS, reference_tokens
from tests.test_server import (
    collect,
    short_socket_dir,
    start_cli_server,
    stop_cli_server,
    text_request,
    tgi_warmup_request,
    wait_until_serving,
)

pytestmark = pytest.mark.slow  # end to end: tensor-parallel shard processes

NEW_TOKENS = 20


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class FanOut:
    """What TGI's router does: every RPC goes to every shard at once; generations are concatenated."""

    def __init__(self, channels):
        self.stubs = [pb_grpc.TextGenerationServiceStub(c) for c in channels]
        self.pool = ThreadPoolExecutor(len(self.stubs))

    def call(self, method: str, request):
        return list(
            self.pool.map(lambda stub: getattr(stub, method)(request, timeout=300), self.stubs)
        )

    def step(self, method: str, request, tokens: dict):
        responses = self.call(method, request)
        for rank, response in enumerate(responses):  # a rank reports only its own requests
            assert all(g.request_id % len(responses) == rank for g in response.generations)
        for response in responses:
            collect(tokens, response)
        batches = [r.batch for r in responses if r.HasField("batch")]
        assert len({b.SerializeToString() for b in batches}) <= 1  # the ranks agree on the batch
        return batches[0] if batches else None


def two_batches_to_the_end(router: FanOut, requests: list) -> dict[int, list[int]]:
    """Prefill the first and second halves as two batches, then decode them together until done."""
    tokens, half = {}, len(requests) // 2
    first = router.step(
        "Prefill",
        pb.PrefillRequest(batch=pb.Batch(id=1, requests=requests[:half], size=half)),
        tokens,
    )
    second = router.step(
        "Prefill",
        pb.PrefillRequest(
            batch=pb.Batch(id=2, requests=requests[half:], size=len(requests) - half)
        ),
        tokens,
    )
    cached = router.step("Decode", pb.DecodeRequest(batches=[first, second]), tokens)
    while cached is not None:
        cached = router.step("Decode", pb.DecodeRequest(batches=[cached]), tokens)
    return tokens


def prefix_hits_to_the_end(router: FanOut, requests: list) -> dict[int, list[int]]:
    """Request 0 fills blocks 1..6; then 1 and 2 (one per rank) reuse its first two blocks (cache_len 32)."""
    tokens = {}

    def run(batch_id, batch_requests):
        cached = router.step(
            "Prefill",
            pb.PrefillRequest(batch=pb.Batch(id=batch_id, requests=batch_requests)),
            tokens,
        )
        while cached is not None:
            cached = router.step("Decode", pb.DecodeRequest(batches=[cached]), tokens)

    def with_blocks(request, blocks, cache_len=0):
        request.blocks[:] = blocks
        request.slots[:] = [b * 16 + o for b in blocks for o in range(16)]
        request.cache_len = cache_len
        return request

    run(1, [with_blocks(requests[0], list(range(1, 7)))])
    run(
        2,
        [
            with_blocks(requests[1], [1, 2, 10, 11, 12, 13], 32),
            with_blocks(requests[2], [1, 2, 20, 21, 22, 23], 32),
        ],
    )
    return tokens


def run_sharded(model_dir, world_size: int, body=two_batches_to_the_end, prompts=range(6)) -> dict:
    folder, port = short_socket_dir(), free_port()
    base = folder / "tp"
    processes = [
        start_cli_server(
            model_dir,
            base,
            env={
                "RANK": str(r),
                "WORLD_SIZE": str(world_size),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            },
        )
        for r in range(world_size)
    ]
    try:
        channels = [
            wait_until_serving(p, f"unix://{base}-{r}", base) for r, p in enumerate(processes)
        ]
        urls = (
            pb_grpc.TextGenerationServiceStub(channels[0])
            .ServiceDiscovery(pb.ServiceDiscoveryRequest())
            .urls
        )
        assert list(urls) == [f"unix://{base}-{r}" for r in range(world_size)]
        router = FanOut(channels)
        warmed = router.call("Warmup", tgi_warmup_request(64, 128, 128, 4))
        assert (
            len({w.SerializeToString() for w in warmed}) == 1
        )  # every rank reports the same capacity
        return body(router, [text_request(k, PROMPTS[p]) for k, p in enumerate(prompts)])
    finally:
        for process in processes:
            stop_cli_server(process)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def one_kv_head_dir(tmp_path_factory, smollm_dir):
    return build_tiny_model(
        "llama", tmp_path_factory.mktemp("kv1") / "llama", smollm_dir, seed=3, num_key_value_heads=1
    )


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["split kv heads", "replicated kv head"])
def test_two_shards_give_the_tokens_of_one(tiny_model_dirs, one_kv_head_dir, variant):
    model_dir = tiny_model_dirs["llama"] if variant == "split kv heads" else one_kv_head_dir
    expected = reference_tokens(model_dir, PROMPTS, NEW_TOKENS)
    tokens = run_sharded(model_dir, 2)
    assert [tokens[i] for i in range(6)] == expected


@pytest.mark.slow
def test_two_shards_give_the_tokens_of_one_with_prefix_hits(tiny_model_dirs):
    expected = reference_tokens(tiny_model_dirs["llama"], [PROMPTS[4]], NEW_TOKENS)[0]
    tokens = run_sharded(tiny_model_dirs["llama"], 2, prefix_hits_to_the_end, prompts=[4, 4, 4])
    assert tokens == {0: expected, 1: expected, 2: expected}
