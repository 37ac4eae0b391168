"""Start-up in seconds (issue 16): the launcher imports no torch before it starts the shards, and the
router, started alongside the shards, waits for the master shard to come up instead of failing."""

import asyncio
import subprocess
import sys

import grpc
import pytest

from engine.wire import generate_pb2 as pb
from engine.wire import generate_pb2_grpc as pb_grpc
from router.client import GrpcShardClient, ShardError
from tests.test_server import short_socket_dir


def test_launcher_imports_no_torch():
    code = "import sys, launcher.cli; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.split() == ["False", "False"]


class Discovery(pb_grpc.TextGenerationServiceServicer):
    async def ServiceDiscovery(self, request, context):
        return pb.ServiceDiscoveryResponse(urls=["unix:///shard-0"])


async def serve_later(path: str, started: asyncio.Event) -> grpc.aio.Server:
    await started.wait()  # the client is already waiting for the socket
    server = grpc.aio.server()
    pb_grpc.add_TextGenerationServiceServicer_to_server(Discovery(), server)
    server.add_insecure_port(f"unix://{path}")
    await server.start()
    return server


def test_router_waits_for_a_shard_that_starts_after_it():
    url = f"unix://{short_socket_dir() / 'late-0'}"

    async def main():
        started = asyncio.Event()
        connecting = asyncio.create_task(GrpcShardClient.connect(url, wait=60))
        await asyncio.sleep(0.5)
        assert not connecting.done()  # no shard yet: still waiting, not failed
        started.set()
        server = await serve_later(url.removeprefix("unix://"), started)
        try:
            client = await connecting
            assert client.urls == ["unix:///shard-0"]
            await client.close()
        finally:
            await server.stop(None)

    asyncio.run(main())


def test_router_without_wait_fails_at_once_when_no_shard_answers():
    url = f"unix://{short_socket_dir() / 'absent-0'}"
    with pytest.raises(ShardError, match="ServiceDiscovery"):
        asyncio.run(GrpcShardClient.connect(url))
