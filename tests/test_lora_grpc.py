"""LoRA over the wire: adapter_id (generate.v3 Request field 11) picks each request's adapter, an
unknown one is INVALID_ARGUMENT naming the loaded adapters, and two tensor-parallel shard processes
(gloo) give the tokens of transformers + peft, as one shard does."""

import shutil

import grpc
import pytest

from engine.serving.server import ServerConfig
from engine.serving.shard import Shard
from engine.wire import generate_pb2 as pb
from tests.conftest import tiny_config
from tests.test_lora import MIX, lora_dirs, lora_expected  # noqa: F401 - fixtures
from tests.test_server import (
    LIMITS,
    BackgroundServer,
    collect,
    drain,
    prompt_request,
    short_socket_dir,
    start_cli_server,
    stop_cli_server,
    tgi_warmup_request,
    wait_until_serving,
)
from tests.test_tensor_parallel import FanOut, free_port, two_batches_to_the_end

NEW_TOKENS = 20


def adapter_fields(i: int) -> dict:
    return {"adapter_id": MIX[i]} if MIX[i] else {}  # base requests leave the optional field unset


def lora_flag(lora_dirs) -> list[str]:
    return ["--lora-adapters", ",".join(f"{name}={path}" for name, path in lora_dirs.items())]


@pytest.fixture(scope="module")
def served(tiny_model_dirs, lora_dirs):
    folder = short_socket_dir()
    specs = tuple((name, str(path)) for name, path in lora_dirs.items())
    shard = Shard(
        tiny_config(tiny_model_dirs["llama"], lora_adapters=specs, **LIMITS), show_progress=False
    )
    server = BackgroundServer(shard, ServerConfig(uds_path=str(folder / "lora"), max_batch_size=4))
    yield server, shard
    server.close()
    shutil.rmtree(folder, ignore_errors=True)


def test_adapter_id_on_the_wire_selects_each_requests_adapter(served, lora_expected):
    server, shard = served
    stub, tokens = server.stub, {}
    stub.Warmup(
        tgi_warmup_request(
            LIMITS["max_input_tokens"], LIMITS["max_prefill_tokens"], LIMITS["max_total_tokens"], 4
        )
    )
    requests = [prompt_request(i, NEW_TOKENS, **adapter_fields(i)) for i in (0, 1, 2, 3)]
    cached = collect(
        tokens, stub.Prefill(pb.PrefillRequest(batch=pb.Batch(id=1, requests=requests, size=4)))
    )
    drain(stub, cached, tokens)
    assert {i: tokens[i] for i in (0, 1, 2, 3)} == {
        i: lora_expected[(i, MIX[i])][:NEW_TOKENS] for i in (0, 1, 2, 3)
    }
    assert not shard.adapter.shapes.unwarmed


def test_unknown_adapter_id_is_invalid_argument_naming_the_loaded_adapters(served):
    server, _ = served
    bad = pb.Batch(id=2, requests=[prompt_request(0, NEW_TOKENS, adapter_id="gamma")], size=1)
    with pytest.raises(grpc.RpcError) as failure:
        server.stub.Prefill(pb.PrefillRequest(batch=bad))
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "unknown adapter_id 'gamma' (loaded adapters: alpha, beta)" in failure.value.details()


def run_sharded_with_adapters(model_dir, lora_dirs, world_size: int) -> dict:
    folder, port = short_socket_dir(), free_port()
    base = folder / "tp"
    processes = [
        start_cli_server(
            model_dir,
            base,
            extra=lora_flag(lora_dirs),
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
        router = FanOut(
            [wait_until_serving(p, f"unix://{base}-{r}", base) for r, p in enumerate(processes)]
        )
        router.call("Warmup", tgi_warmup_request(64, 128, 128, 4))
        return two_batches_to_the_end(
            router, [prompt_request(i, NEW_TOKENS, **adapter_fields(i)) for i in range(len(MIX))]
        )
    finally:
        for process in processes:
            stop_cli_server(process)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.slow
def test_two_shards_with_adapters_give_the_tokens_of_one(tiny_model_dirs, lora_dirs, lora_expected):
    tokens = run_sharded_with_adapters(tiny_model_dirs["llama"], lora_dirs, 2)
    assert [tokens[i] for i in range(len(MIX))] == [
        lora_expected[(i, MIX[i])][:NEW_TOKENS] for i in range(len(MIX))
    ]
