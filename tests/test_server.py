"""The gRPC shard server over real unix sockets: TGI's router sequence, errors, ranks, the CLI."""

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import pytest

from engine.cli.main import build_parser, server_config
from engine.errors import BucketserveError
from engine.serving.server import ServerConfig, ShardServer, remove_stale_socket
from engine.wire import convert
from engine.wire import generate_pb2 as pb
from engine.wire import generate_pb2_grpc as pb_grpc
from tests.helpers import reference_fixture, shard_fixture
from tests.test_equivalence import PROMPTS

REPO = Path(__file__).resolve().parents[1]
NEW_TOKENS = 20  # > one block of 16: decode crosses a block boundary
LIMITS = dict(max_input_tokens=64, max_total_tokens=128, max_prefill_tokens=128)
SERVE_ARGS = [
    "--dtype",
    "float32",
    "--block-size",
    "16",
    "--max-input-tokens",
    "64",
    "--max-total-tokens",
    "128",
    "--max-prefill-tokens",
    "128",
]
LIVENESS_ID = 2**64 - 1  # TGI's router probes health with this request and batch id


# --- helpers shared with test_wire_contract.py -----------------------------------------------


def short_socket_dir() -> Path:
    """A short folder under /tmp: a unix socket path must stay under ~107 bytes."""
    return Path(tempfile.mkdtemp(prefix="bs-", dir="/tmp"))


def start_cli_server(model_dir, base: Path, env: dict | None = None, extra=()) -> subprocess.Popen:
    """`python -m engine serve` as a user runs it; its log goes to BASE.log."""
    clean = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MAX_BATCH_SIZE")
    }
    clean["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), clean.get("PYTHONPATH")]))
    command = [
        sys.executable,
        "-m",
        "engine",
        "serve",
        "--model-id",
        str(model_dir),
        "--uds-path",
        str(base),
        "--log-level",
        "debug",
        *SERVE_ARGS,
        *extra,
    ]
    with open(f"{base}.log", "w") as log:
        return subprocess.Popen(
            command, cwd=REPO, env={**clean, **(env or {})}, stdout=log, stderr=subprocess.STDOUT
        )


def wait_until_serving(
    process: subprocess.Popen, url: str, base: Path, timeout: float = 180
) -> grpc.Channel:
    channel = grpc.insecure_channel(url)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(
                f"the server exited with {process.returncode}:\n{Path(f'{base}.log').read_text()}"
            )
        try:
            grpc.channel_ready_future(channel).result(timeout=0.5)
            return channel
        except grpc.FutureTimeoutError:
            pass
    pytest.fail(f"no server on {url} after {timeout}s:\n{Path(f'{base}.log').read_text()}")


def stop_cli_server(process: subprocess.Popen) -> int:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            return process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
    return process.wait()


def text_request(
    request_id: int, text: str, max_new_tokens: int = NEW_TOKENS, **fields
) -> pb.Request:
    """A request as TGI's router writes it: the text twice (inputs and one chunk), neutral parameters."""
    return pb.Request(
        id=request_id,
        inputs=text,
        input_chunks=pb.Input(chunks=[pb.InputChunk(text=text)]),
        parameters=pb.NextTokenChooserParameters(
            temperature=1.0, top_p=1.0, typical_p=1.0, repetition_penalty=1.0
        ),
        stopping_parameters=pb.StoppingCriteriaParameters(
            max_new_tokens=max_new_tokens, ignore_eos_token=True
        ),
        add_special_tokens=True,
        **fields,
    )


def prompt_request(i: int, max_new_tokens: int = NEW_TOKENS, **fields) -> pb.Request:
    return text_request(i, PROMPTS[i], max_new_tokens, **fields)


def tgi_warmup_request(
    max_input: int, max_prefill: int, max_total: int, max_batch: int | None
) -> pb.WarmupRequest:
    """The warmup TGI's v3 router sends: '_test ' prompts truncated to fill max_prefill_tokens, an image
    on the first, every logits processor switched on, no blocks or slots."""
    requests, tokens = [], 0
    while tokens < max_prefill:
        truncate = min(max_input, max_prefill - tokens)
        text = "_test " * max_input
        chunks = [pb.InputChunk(text=text)]
        if not requests:
            chunks.append(
                pb.InputChunk(
                    image=pb.Image(
                        data=b"\xff\xd8\xff\xe0 not a real jpeg", mimetype="image/jpeg;base64"
                    )
                )
            )
            text += "![](data:image/jpeg;base64,/9j/4AAQ)"
        requests.append(
            pb.Request(
                id=0,
                inputs=text,
                input_chunks=pb.Input(chunks=chunks),
                truncate=truncate,
                add_special_tokens=True,
                parameters=pb.NextTokenChooserParameters(
                    temperature=0.9,
                    top_k=10,
                    top_p=0.9,
                    typical_p=0.9,
                    do_sample=False,
                    seed=0,
                    repetition_penalty=1.2,
                    frequency_penalty=0.1,
                    watermark=True,
                ),
                stopping_parameters=pb.StoppingCriteriaParameters(
                    max_new_tokens=max(max_total - truncate, 1), ignore_eos_token=True
                ),
                prefill_logprobs=True,
                top_n_tokens=20,
            )
        )
        tokens += truncate
        if len(requests) == max_batch:
            break
    batch = pb.Batch(id=0, requests=requests, size=len(requests), max_tokens=max_input)
    return pb.WarmupRequest(
        batch=batch,
        max_input_tokens=max_input,
        max_prefill_tokens=max_prefill,
        max_total_tokens=max_total,
    )


def collect(tokens: dict, response) -> pb.CachedBatch | None:
    """Append every generation's token; the response's batch, None when all requests finished."""
    for generation in response.generations:
        tokens.setdefault(generation.request_id, []).extend(generation.tokens.ids)
    return response.batch if response.HasField("batch") else None


def drain(stub, cached, tokens: dict) -> None:
    while cached is not None:
        cached = collect(tokens, stub.Decode(pb.DecodeRequest(batches=[cached])))


# --- an in-process server on a background event loop -----------------------------------------


class BackgroundServer:
    """A ShardServer on an event loop of its own thread, the way `serve` runs it in a process."""

    def __init__(self, shard, config: ServerConfig):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = self.run(self._create(shard, config))
        self.run(self.server.start())
        self.channel = grpc.insecure_channel(f"unix://{config.socket_path()}")
        self.stub = pb_grpc.TextGenerationServiceStub(self.channel)

    @staticmethod
    async def _create(shard, config):
        return ShardServer(shard, config)  # grpc.aio binds the server to the loop it is created on

    def run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=120)

    def close(self) -> None:
        self.channel.close()
        self.run(self.server.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@pytest.fixture(scope="module")
def socket_dir():
    path = short_socket_dir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


# The engine's own batch limit (8) differs from the server's (4): Warmup must use the server's.
shard = shard_fixture(warmup=False, max_batch_size=8, **LIMITS)


@pytest.fixture(scope="module")
def served(shard, socket_dir):
    server = BackgroundServer(
        shard, ServerConfig(uds_path=str(socket_dir / "shard"), max_batch_size=4)
    )
    yield server
    server.close()
    assert not (socket_dir / "shard-0").exists()  # the socket goes with the server


expected = reference_fixture(PROMPTS, NEW_TOKENS)  # ignore_eos requests: no EOS stop


def warm(stub) -> pb.WarmupResponse:
    return stub.Warmup(
        tgi_warmup_request(
            LIMITS["max_input_tokens"], LIMITS["max_prefill_tokens"], LIMITS["max_total_tokens"], 4
        )
    )


# --- TGI's router sequence on the tiny Llama ----------------------------------------------------


def test_tgi_router_sequence_matches_transformers(served, shard, expected):
    stub, tokens = served.stub, {}
    stub.ClearCache(pb.ClearCacheRequest())
    info = stub.Info(pb.InfoRequest())
    assert (info.block_size, info.device_type, info.dtype) == (16, "cpu", "float32")
    assert not info.HasField("window_size")  # the tiny Llama has no sliding window
    warmed = warm(stub)
    assert (warmed.max_input_tokens, warmed.max_total_tokens) == (
        64,
        128,
    )  # the router's limits, echoed
    assert warmed.max_supported_total_tokens >= 4 * 128
    assert shard.limits.max_batch_size == 4  # from the server's MAX_BATCH_SIZE, not the engine's 8

    first = stub.Prefill(
        pb.PrefillRequest(
            batch=pb.Batch(id=1, requests=[prompt_request(0), prompt_request(1)], size=2)
        )
    )
    second = stub.Prefill(
        pb.PrefillRequest(
            batch=pb.Batch(id=2, requests=[prompt_request(2), prompt_request(3, 5)], size=2)
        )
    )
    assert [g.request_id for g in first.generations] == [0, 1] and [
        g.request_id for g in second.generations
    ] == [2, 3]
    cached_a, cached_b = collect(tokens, first), collect(tokens, second)
    assert {i: t[0] for i, t in tokens.items()} == {i: expected[i][0] for i in range(4)}
    assert (
        first.total_ns > 0
        and first.forward_ns > 0
        and first.forward_ns + first.decode_ns == first.total_ns
    )

    merged = stub.Decode(pb.DecodeRequest(batches=[cached_a, cached_b]))
    assert merged.batch.id == 1 and list(merged.batch.request_ids) == [0, 1, 2, 3]
    assert (
        merged.HasField("concat_ns")
        and merged.forward_ns > 0
        and merged.total_ns >= merged.forward_ns
    )
    collect(tokens, merged)

    # The client of request 1 went away: the router filters it out of the running batch.
    kept = stub.FilterBatch(pb.FilterBatchRequest(batch_id=1, request_ids=[0, 2, 3])).batch
    assert list(kept.request_ids) == [0, 2, 3] and kept.size == 3
    finished = run_router_loop(stub, kept, tokens)

    assert tokens[1] == expected[1][:2]  # prefill + one decode, then filtered
    assert tokens[3] == expected[3][:5] and all(tokens[i] == expected[i] for i in (0, 2))
    assert (
        finished[3].generated_tokens == 5 and finished[3].finish_reason == pb.FINISH_REASON_LENGTH
    )
    assert finished[0].text == shard.tokenizer.decode(expected[0], skip_special_tokens=True)
    stub.ClearCache(pb.ClearCacheRequest())
    assert not shard.batches and shard.allocator.num_free == shard.allocator.num_blocks - 1


def run_router_loop(stub, cached, tokens) -> dict:
    """Decode, and FilterBatch away the requests that finished, as TGI's router does."""
    finished = {}
    while cached is not None:
        response = stub.Decode(pb.DecodeRequest(batches=[cached]))
        finished.update(
            {
                g.request_id: g.generated_text
                for g in response.generations
                if g.HasField("generated_text")
            }
        )
        cached = collect(tokens, response)
        if cached is not None and any(g.HasField("generated_text") for g in response.generations):
            alive = [i for i in cached.request_ids if i not in finished]
            cached = stub.FilterBatch(
                pb.FilterBatchRequest(batch_id=cached.id, request_ids=alive)
            ).batch
    return finished


def router_blocks(request_id: int, needed: int, first: int) -> dict:
    """Blocks from the top of the cache, every other one and descending (block 0 never), with their slots."""
    blocks = [first - 2 * k for k in range(needed)]
    return dict(blocks=blocks, slots=[b * 16 + offset for b in blocks for offset in range(16)])


def test_router_assigned_blocks_give_the_same_tokens(served, shard, expected):
    stub, tokens = served.stub, {}
    warm(stub)
    top = shard.allocator.num_blocks - 1
    free = shard.allocator.num_free
    requests = [
        prompt_request(2, **router_blocks(2, 3, top)),
        prompt_request(4, **router_blocks(4, 5, top - 1)),
    ]
    cached = collect(
        tokens, stub.Prefill(pb.PrefillRequest(batch=pb.Batch(id=7, requests=requests, size=2)))
    )
    assert (
        shard.allocator.num_free == free
    )  # the shard allocated nothing: it used the router's blocks
    drain(stub, cached, tokens)
    assert tokens == {2: expected[2], 4: expected[4]}


# --- bucketserve's extensions: proto fields numbered from 1000 (proto/CONTRACT.md) ----------------


def test_resumed_tokens_in_the_request_continue_its_generation(served, shard, expected):
    stub, tokens, done = served.stub, {}, 5
    warm(stub)
    resumed = prompt_request(0, resume_tokens=expected[0][:done])
    prefilled = stub.Prefill(pb.PrefillRequest(batch=pb.Batch(id=20, requests=[resumed])))
    cached = collect(tokens, prefilled)
    drain(stub, cached, tokens)
    assert tokens == {0: expected[0][done:]}  # the next token first, none repeated, none lost
    beyond = prompt_request(1, resume_tokens=[shard.model_config.vocab_size])
    with pytest.raises(grpc.RpcError) as refused:
        stub.Prefill(pb.PrefillRequest(batch=pb.Batch(id=21, requests=[beyond])))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "request 1: resumed tokens: token id" in refused.value.details()


def test_every_step_answers_with_the_shards_serving_stats(served, shard):
    stub = served.stub
    warm(stub)
    prefilled = stub.Prefill(pb.PrefillRequest(batch=pb.Batch(id=22, requests=[prompt_request(1)])))
    assert prefilled.HasField("stats")
    assert convert.stats_from_pb(prefilled.stats) == shard.serving_stats()
    decoded = stub.Decode(pb.DecodeRequest(batches=[prefilled.batch]))
    assert decoded.HasField("stats")
    assert convert.stats_from_pb(decoded.stats) == shard.serving_stats()
    assert decoded.stats.decode_real == prefilled.stats.decode_real + 1
    stub.ClearCache(pb.ClearCacheRequest())


def test_look_ahead_runs_the_next_forward_only_when_asked(served, shard, expected):
    stub, tokens = served.stub, {}
    warm(stub)
    batch = pb.Batch(id=23, requests=[prompt_request(2)])
    cached = collect(tokens, stub.Prefill(pb.PrefillRequest(batch=batch)))
    used = []
    for look_ahead in (False, True, False, True, False):
        response = stub.Decode(pb.DecodeRequest(batches=[cached], look_ahead=look_ahead))
        used.append(response.stats.lookahead_steps)
        cached = collect(tokens, response)
    assert [b - a for a, b in zip(used, used[1:])] == [0, 1, 0, 1]  # the step after each asking
    drain(stub, cached, tokens)
    assert tokens == {2: expected[2]}  # a lookahead changes no token


# --- bad input never kills the shard -----------------------------------------------------------


def unknown_batch_decode(stub):
    return stub.Decode(pb.DecodeRequest(batches=[pb.CachedBatch(id=999, request_ids=[5], size=1)]))


def unknown_batch_filter(stub):
    return stub.FilterBatch(pb.FilterBatchRequest(batch_id=999, request_ids=[5]))


def prompt_over_the_input_limit(stub):
    return stub.Prefill(
        pb.PrefillRequest(batch=pb.Batch(id=11, requests=[text_request(5, "word " * 100)]))
    )


def too_few_blocks(stub):
    request = prompt_request(
        2, **router_blocks(2, 1, 20)
    )  # 23 prompt tokens need 2 blocks (more come on demand)
    return stub.Prefill(pb.PrefillRequest(batch=pb.Batch(id=12, requests=[request])))


def decode_of_nothing(stub):
    return stub.Decode(pb.DecodeRequest())


@pytest.mark.parametrize(
    "bad_call, code, message",
    [
        (unknown_batch_decode, grpc.StatusCode.NOT_FOUND, "batch 999 not found"),
        (unknown_batch_filter, grpc.StatusCode.NOT_FOUND, "batch 999 not found"),
        (
            prompt_over_the_input_limit,
            grpc.StatusCode.INVALID_ARGUMENT,
            "exceeds max_input_tokens=64",
        ),
        (
            too_few_blocks,
            grpc.StatusCode.INVALID_ARGUMENT,
            "1 blocks hold fewer than its 23 prompt tokens",
        ),
        (decode_of_nothing, grpc.StatusCode.INVALID_ARGUMENT, "decode needs at least one batch"),
    ],
)
def test_bad_input_is_refused_and_the_batch_in_flight_carries_on(
    served, shard, expected, bad_call, code, message
):
    stub, tokens = served.stub, {}
    warm(stub)
    cached = collect(
        tokens, stub.Prefill(pb.PrefillRequest(batch=pb.Batch(id=10, requests=[prompt_request(1)])))
    )
    with pytest.raises(grpc.RpcError) as refused:
        bad_call(stub)
    assert refused.value.code() == code and message in refused.value.details()
    stub.Health(pb.HealthRequest())
    liveness_probe(stub)
    drain(stub, cached, tokens)
    assert tokens == {1: expected[1]}


def liveness_probe(stub) -> None:
    """What TGI's router runs after an error: one token for a request on the reserved block 0."""
    request = text_request(
        LIVENESS_ID, "liveness", max_new_tokens=1, truncate=10, blocks=[0], slots=list(range(16))
    )
    request.stopping_parameters.ignore_eos_token = False
    response = stub.Prefill(
        pb.PrefillRequest(
            batch=pb.Batch(id=LIVENESS_ID, requests=[request], size=1, max_tokens=2, max_blocks=1)
        )
    )
    assert [g.request_id for g in response.generations] == [LIVENESS_ID] and not response.HasField(
        "batch"
    )
    stub.ClearCache(pb.ClearCacheRequest(id=LIVENESS_ID))


# --- `python -m engine serve` as a user runs it ------------------------------------------------


@pytest.mark.slow
def test_cli_server_replaces_a_stale_socket_and_also_serves_tcp(tiny_model_dirs, expected):
    # Rank filtering across a real two-process group is tested in test_tensor_parallel.py.
    base = short_socket_dir()
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(f"{base}/shard-0")  # a socket left by a shard that died: the new one must replace it
    stale.close()
    port = free_tcp_port()
    process = start_cli_server(
        tiny_model_dirs["llama"],
        base / "shard",
        env=dict(RANK="0", WORLD_SIZE="1", MAX_BATCH_SIZE="4"),
        extra=["--port", str(port)],
    )
    try:
        channel = wait_until_serving(process, f"unix://{base}/shard-0", base / "shard")
        stub, tokens = pb_grpc.TextGenerationServiceStub(channel), {}
        urls = stub.ServiceDiscovery(pb.ServiceDiscoveryRequest()).urls
        assert list(urls) == [f"unix://{base}/shard-0"]
        warm(stub)
        response = stub.Prefill(
            pb.PrefillRequest(batch=pb.Batch(id=3, requests=[prompt_request(i) for i in range(4)]))
        )
        assert [g.request_id for g in response.generations] == [0, 1, 2, 3]
        drain(stub, collect(tokens, response), tokens)
        assert tokens == {i: expected[i] for i in range(4)}
        channel.close()
        with grpc.insecure_channel(f"localhost:{port}") as tcp:  # the same shard over TCP
            assert (
                pb_grpc.TextGenerationServiceStub(tcp).Info(pb.InfoRequest(), timeout=30).block_size
                == 16
            )
    finally:
        code = stop_cli_server(process)
    log = Path(f"{base}/shard.log").read_text()
    shutil.rmtree(base, ignore_errors=True)
    assert code == 0, log
    assert (
        "DEBUG engine.serving.server: Prefill batch=3 requests=4 in" in log
    )  # one line per RPC at debug level
    assert not (base / "shard-0").exists()


def free_tcp_port() -> int:
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        return probe.getsockname()[1]


def test_serve_settings_come_from_flags_then_tgi_environment(monkeypatch):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("MAX_BATCH_SIZE", "6")
    settings = server_config(
        build_parser().parse_args(["serve", "--uds-path", "/tmp/x", "--port", "8001"])
    )
    assert (settings.rank, settings.world_size, settings.max_batch_size, settings.port) == (
        2,
        4,
        6,
        8001,
    )
    assert (
        settings.urls() == [f"unix:///tmp/x-{r}" for r in range(4)]
        and settings.socket_path() == "/tmp/x-2"
    )
    assert (
        server_config(build_parser().parse_args(["serve", "--max-batch-size", "3"])).max_batch_size
        == 3
    )
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("MAX_BATCH_SIZE")
    defaults = server_config(build_parser().parse_args(["serve"]))
    assert (defaults.rank, defaults.world_size, defaults.max_batch_size) == (0, 1, 32)
    assert defaults.socket_path() == "/tmp/text-generation-server-0"
    with pytest.raises(ValueError, match="rank 2 is not in 0..world_size-1"):
        ServerConfig(rank=2, world_size=2)


def test_only_a_stale_socket_is_removed_before_binding(tmp_path):
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(tmp_path / "s-0"))
    stale.close()
    remove_stale_socket(str(tmp_path / "s-0"))
    assert not (tmp_path / "s-0").exists()
    (tmp_path / "s-1").write_text("someone's data")
    with pytest.raises(BucketserveError, match="exists and is not a socket"):
        remove_stale_socket(str(tmp_path / "s-1"))
    assert (tmp_path / "s-1").read_text() == "someone's data"
