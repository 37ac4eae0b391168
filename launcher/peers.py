"""A multi-node launcher watches the other nodes' shards as well as its own: a node that dies
leaves this node's shards waiting in a collective that never ends, so the launcher must notice
by itself and take its group down (or restart it, with --restart-on-failure).

A peer is probed with ServiceDiscovery, which a shard answers without its step worker (a long
step does not delay the answer); one that refuses connections for PEER_DEAD_S is gone. A peer
that is merely slow (DEADLINE_EXCEEDED) is not: a whole node lost without a word (its address
silent) is what the orchestrator sees and acts on (LeaderWorkerSet restarts the group)."""

from __future__ import annotations

import time

import grpc

from engine.wire import generate_pb2 as pb
from engine.wire import generate_pb2_grpc as pb_grpc
from engine.wire.contract import shard_secret_metadata

PROBE_EVERY_S = 1.0
PROBE_TIMEOUT_S = 1.0
PEER_DEAD_S = 2.0


class PeerWatch:
    def __init__(self, urls: dict[int, str], secret: str | None):
        self.urls = urls  # rank -> URL of the other nodes' shards
        self.metadata = shard_secret_metadata(secret)
        self.channels = {rank: grpc.insecure_channel(url) for rank, url in urls.items()}
        self.unreachable_since: dict[int, float] = {}
        self.next_probe = 0.0

    @classmethod
    def of(cls, group) -> PeerWatch | None:
        """The other nodes' shards of `group` (a launcher.supervisor.ShardGroup), found through
        its first shard; None for a one-node group."""
        config = group.config
        if config.world_size == config.num_shard:
            return None
        stub = pb_grpc.TextGenerationServiceStub(group.channels[0])
        urls = stub.ServiceDiscovery(pb.ServiceDiscoveryRequest(), timeout=10).urls
        remote = {rank: url for rank, url in enumerate(urls) if not url.startswith("unix:")}
        return cls(remote, config.shard_secret)

    def gone(self) -> str | None:
        """Why the group cannot go on (a peer refuses connections for PEER_DEAD_S), or None."""
        now = time.monotonic()
        if now < self.next_probe:
            return None
        self.next_probe = now + PROBE_EVERY_S
        for rank, channel in self.channels.items():
            if self._answers(channel):
                self.unreachable_since.pop(rank, None)
                continue
            since = self.unreachable_since.setdefault(rank, now)
            if now - since >= PEER_DEAD_S:
                return (
                    f"rank {rank} of another node ({self.urls[rank]}) has refused connections "
                    f"for {now - since:.1f}s: that node's shard is gone"
                )
        return None

    def _answers(self, channel) -> bool:
        stub = pb_grpc.TextGenerationServiceStub(channel)
        try:
            stub.ServiceDiscovery(
                pb.ServiceDiscoveryRequest(), timeout=PROBE_TIMEOUT_S, metadata=self.metadata
            )
            return True
        except grpc.RpcError as error:
            return error.code() != grpc.StatusCode.UNAVAILABLE

    def close(self) -> None:
        for channel in self.channels.values():
            channel.close()
