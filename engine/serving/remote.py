"""Shards of a multi-node group: the ranks of other nodes reach a shard over TCP, and every such
call must carry the group's shared secret (the unix socket stays for this node's router and
launcher, which file permissions already guard).

Which address: the one this host reaches the master through (a pod's IP under Kubernetes,
127.0.0.1 when every node runs on loopback), on a port the OS picks; the ranks then exchange
their addresses over torch.distributed, so that every rank's ServiceDiscovery names them all."""

from __future__ import annotations

import hmac
import socket

from engine.distributed import Parallel, gather_objects
from engine.wire.contract import SHARD_SECRET_HEADER


def outbound_address(master_addr: str) -> str:
    """This host's address on the route to the master (no packet is sent: a UDP connect only
    picks the route)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((master_addr, 9))
        except OSError:
            return socket.gethostbyname(socket.gethostname())
        return probe.getsockname()[0]


def tcp_target(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def group_urls(world: Parallel, node_rank: int, unix_url: str, tcp_url: str) -> list[str]:
    """Every rank's URL as this rank reaches it: the unix socket on this node, TCP on others."""
    everyone = gather_objects((node_rank, unix_url, tcp_url), world)
    return [unix if node == node_rank else tcp for node, unix, tcp in everyone]


def caller_refusal(secret: str | None, context) -> str | None:
    """Why a call must be refused (None: it may proceed): a TCP caller without the secret."""
    if not secret or context.peer().startswith("unix:"):
        return None
    given = dict(context.invocation_metadata()).get(SHARD_SECRET_HEADER, "")
    if hmac.compare_digest(given.encode(), f"Bearer {secret}".encode()):
        return None
    return "this shard's TCP port takes calls that carry the group's shard secret only"
