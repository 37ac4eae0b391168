"""A group of several nodes, the Kubernetes way: every node runs the same launcher command, and
learns its place from the flags or, where they are not given, from LeaderWorkerSet's variables
(LWS_LEADER_ADDRESS, LWS_GROUP_SIZE, LWS_WORKER_INDEX) or torchrun's (MASTER_ADDR, MASTER_PORT,
NNODES, NODE_RANK). Node R's --num-shard local shards are ranks R * local .. R * local + local - 1
of one world; node 0 runs the router, the others are headless (docs/multinode.md)."""

from __future__ import annotations

import socket
import time
from dataclasses import replace

from launcher.checks import ConfigError

DEFAULT_MASTER_PORT = 29500  # torchrun's
LOOPBACK = "127.0.0.1"
MASTER_GONE_TIMEOUT_S = 30.0


def _first(environ, *names: str) -> str | None:
    return next((environ[n] for n in names if environ.get(n)), None)


def _int_from(environ, *names: str) -> int | None:
    text = _first(environ, *names)
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        raise ConfigError(
            f"${names[0]} (or {', '.join(names[1:])}) is not a number: {text!r}"
        ) from None


def resolve_cluster(config, environ):
    """The launcher's config with concrete nnodes, node_rank, master_addr and master_port: the
    flags, else the environment's; a one-node launch ignores the environment as before (the
    rendezvous then stays on loopback, on a free port)."""
    nnodes = config.nnodes or _int_from(environ, "NNODES", "LWS_GROUP_SIZE") or 1
    if nnodes < 1:
        raise ConfigError(f"--nnodes must be at least 1, not {nnodes}")
    if nnodes == 1:
        if config.node_rank not in (None, 0):
            raise ConfigError(f"--node-rank {config.node_rank} must be below --nnodes 1")
        return replace(config, nnodes=1, node_rank=0, master_addr=LOOPBACK)
    node_rank = config.node_rank
    if node_rank is None:
        node_rank = _int_from(environ, "NODE_RANK", "LWS_WORKER_INDEX") or 0
    if not 0 <= node_rank < nnodes:
        raise ConfigError(f"--node-rank {node_rank} must be in 0..{nnodes - 1} (--nnodes {nnodes})")
    master_addr = (
        config.master_addr or _first(environ, "MASTER_ADDR", "LWS_LEADER_ADDRESS") or LOOPBACK
    )
    master_port = config.master_port or _int_from(environ, "MASTER_PORT") or DEFAULT_MASTER_PORT
    if not config.shard_secret:
        raise ConfigError(
            f"--nnodes {nnodes}: the shards of other nodes call each other over TCP; give every "
            "node the same secret in $BUCKETSERVE_SHARD_SECRET (--shard-secret)"
        )
    return replace(
        config,
        nnodes=nnodes,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        # node 0 serves; the others only run their shards
        no_router=config.no_router or node_rank > 0,
    )


def check_grid(world_size: int, stages: int, tp_size_problem) -> None:
    """The world must split into the stages, each stage's ranks must split the heads."""
    from engine.pipeline.grid import grid_problem

    problem = grid_problem(world_size, stages)
    if problem:
        raise ConfigError(problem)
    tp_size_problem(world_size // stages)


def wait_for_old_master_gone(config, stop, timeout: float = MASTER_GONE_TIMEOUT_S) -> None:
    """Before a worker node re-forms the group: the old rank 0's rendezvous store must be gone,
    or this node's new shards would join the dead group's store and wait there forever. Node 0
    takes its old shards down within seconds of noticing the lost peer (launcher/peers.py)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not stop.is_set():
        try:
            socket.create_connection((config.master_addr, config.master_port), timeout=1).close()
        except OSError:
            return
        stop.wait(0.2)
