"""The shard refuses what a router must never send (blocks, slots, batch ids it does not own), with
INVALID_ARGUMENT naming the field, and the batch in flight beside it still gives transformers' tokens."""

import shutil

import grpc
import psutil
import pytest

from engine.wire import generate_pb2 as pb
from tests.test_server import (  # noqa: F401 - fixtures
    collect,
    drain,
    expected,
    free_tcp_port,
    prompt_request,
    router_blocks,
    served,
    shard,
    short_socket_dir,
    socket_dir,
    start_cli_server,
    stop_cli_server,
    wait_until_serving,
    warm,
)

RUNNING_BATCH = 10


def prefill(stub, batch_id: int, *requests):
    return stub.Prefill(
        pb.PrefillRequest(batch=pb.Batch(id=batch_id, requests=list(requests), size=len(requests)))
    )


def block_past_the_cache(stub, shard, running):
    return prefill(
        stub, 20, prompt_request(2, **router_blocks(2, 3, shard.allocator.num_blocks + 5))
    )


def block_of_a_live_request(stub, shard, running):
    taken = running.blocks[0]
    return prefill(stub, 21, prompt_request(2, blocks=[taken, taken + 1, taken + 2]))


def block_listed_twice(stub, shard, running):
    top = shard.allocator.num_blocks - 1
    return prefill(stub, 22, prompt_request(2, blocks=[top, top, top - 1]))


def reserved_block(stub, shard, running):
    top = shard.allocator.num_blocks - 1
    return prefill(stub, 23, prompt_request(2, blocks=[0, top, top - 1]))


def slot_outside_its_blocks(stub, shard, running):
    top = shard.allocator.num_blocks - 1
    blocks = [top, top - 1, top - 2]
    slots = [b * 16 + o for b in blocks for o in range(16)]
    slots[3] = running.blocks[0] * 16  # the running request's first slot
    return prefill(stub, 24, prompt_request(2, blocks=blocks, slots=slots))


def live_batch_id(stub, shard, running):
    return prefill(stub, RUNNING_BATCH, prompt_request(2))


def same_batch_twice_in_decode(stub, shard, running):
    cached = pb.CachedBatch(id=RUNNING_BATCH, request_ids=[1], size=1)
    return stub.Decode(pb.DecodeRequest(batches=[cached, cached]))


@pytest.mark.parametrize(
    "bad_call, message",
    [
        (block_past_the_cache, "blocks: block"),
        (block_of_a_live_request, "is in use by live request 1"),
        (block_listed_twice, "is listed twice"),
        (reserved_block, "block 0 is reserved"),
        (slot_outside_its_blocks, "slots: slot"),
        (live_batch_id, f"batch.id: batch {RUNNING_BATCH} is already live"),
        (same_batch_twice_in_decode, "batches: a batch is listed twice"),
    ],
)
def test_bad_assignments_are_refused_and_the_running_batch_is_exact(
    served, shard, expected, bad_call, message
):
    stub, tokens = served.stub, {}
    warm(stub)
    cached = collect(tokens, prefill(stub, RUNNING_BATCH, prompt_request(1)))
    running = shard.batches[RUNNING_BATCH][0]
    free = shard.allocator.num_free
    with pytest.raises(grpc.RpcError) as refused:
        bad_call(stub, shard, running)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
    assert message in refused.value.details()
    assert shard.allocator.num_free == free and list(shard.batches) == [RUNNING_BATCH]
    drain(stub, cached, tokens)
    assert tokens == {1: expected[1]}


@pytest.mark.slow
def test_the_tcp_port_listens_on_loopback_unless_a_hostname_is_given(tiny_model_dirs):
    base, port = short_socket_dir(), free_tcp_port()
    process = start_cli_server(tiny_model_dirs["llama"], base / "s", extra=["--port", str(port)])
    try:
        wait_until_serving(process, f"unix://{base}/s-0", base / "s").close()
        # gRPC may bind an IPv6 socket to the v4-mapped loopback; all interfaces would read "::" or "0.0.0.0".
        listening = {
            c.laddr.ip.removeprefix("::ffff:")
            for c in psutil.Process(process.pid).net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port
        }
    finally:
        stop_cli_server(process)
        shutil.rmtree(base, ignore_errors=True)
    assert listening == {"127.0.0.1"}
