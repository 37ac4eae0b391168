"""The launcher's configuration: a knob dataclass that holds the shards' and the router's, filled
from the command line (engine/cli/flags.py) and passed on to them field by field."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace

from engine.cli.flags import changed_flags, knob_environment_names, secret_environment
from engine.config import SHARD_SECRET_VARIABLE, EngineConfig, SharedKnobs, knob, nested
from router.config import RouterConfig

# TGI's router port: a `docker run -p 8080:3000` written for TGI works unchanged
DEFAULT_PORT = 3000
# The router's knobs that differ under the launcher, as TGI's launcher: reachable from outside a
# container on TGI's port. Every other knob has one default, the field's.
ROUTER_DEFAULTS = {"port": DEFAULT_PORT, "hostname": "0.0.0.0"}
# The router's knobs that the launcher sets itself (from its sockets, its start-up timeout and its
# pid), so they are not flags of its own.
ROUTER_SET_BY_LAUNCHER = ("master_url", "wait_for_shards", "parent_pid")


@dataclass(frozen=True, kw_only=True)
class LauncherConfig:
    """`python -m launcher`: the launcher's own knobs, and the configuration of every shard
    (`engine`) and of the router (`router`), which it passes on field by field: a knob the shards
    and the router share (engine/config.py SharedKnobs) is one flag that sets both."""

    engine: EngineConfig = nested(EngineConfig)
    router: RouterConfig = nested(RouterConfig, **ROUTER_DEFAULTS)
    num_shard: int = knob(1, "tensor-parallel ranks, one process each")
    uds_path: str | None = knob(
        None, "socket base: rank r listens on BASE-r (default: a unique path per launch)"
    )
    master_port: int | None = knob(
        None,
        "torch.distributed rendezvous port (default: one node: a free one; several: "
        "$MASTER_PORT, else 29500)",
    )
    shard_secret: str | None = knob(
        None,
        "the secret every shard RPC over TCP must carry (several nodes: the shards of other "
        "nodes listen on TCP; default: $BUCKETSERVE_SHARD_SECRET); passed on in the environment, "
        "never on a command line",
        env="BUCKETSERVE_SHARD_SECRET",
        secret=True,
    )
    nnodes: int | None = knob(
        None, "nodes in the group (default: $NNODES, else $LWS_GROUP_SIZE, else 1)"
    )
    node_rank: int | None = knob(
        None,
        "this node's place, 0..nnodes-1; node 0 runs the router, the others are headless "
        "(default: $NODE_RANK, else $LWS_WORKER_INDEX, else 0)",
    )
    master_addr: str | None = knob(
        None,
        "node 0's address, where rank 0 holds the rendezvous (default: $MASTER_ADDR, else "
        "$LWS_LEADER_ADDRESS, else 127.0.0.1)",
    )
    no_router: bool = knob(False, "start the shards only and print the master socket", switch=True)
    single_process: bool = knob(
        False,
        "run the one shard inside the router's process, called in place rather than over gRPC "
        "(one shard on one node; the shard and the router then stop and fail together): on a "
        "CPU it leaves the shard's OpenMP threads the cores the router took",
        switch=True,
    )
    restart_on_failure: bool = knob(
        False,
        "restart the whole group when a shard dies (at most "
        "--max-restarts times within --restart-window seconds)",
        switch=True,
    )
    max_restarts: int = knob(3, "restarts allowed within --restart-window seconds, then give up")
    restart_window: float = knob(300.0, "seconds over which --max-restarts counts")
    # loading a large model from a slow disk takes many minutes
    startup_timeout: float = knob(1800.0, "seconds until every shard answers Health")
    shutdown_timeout: float = knob(
        10.0, "seconds a shard may take to stop gracefully before it is killed"
    )

    @property
    def world_size(self) -> int:
        """Ranks in the whole group: this node's shards times the nodes."""
        return self.num_shard * (self.nnodes or 1)

    @property
    def first_rank(self) -> int:
        return self.num_shard * (self.node_rank or 0)

    def socket_path(self, rank: int) -> str:
        return f"{self.uds_path}-{rank}"

    def local_socket_path(self, local_rank: int) -> str:
        """Where this node's `local_rank`-th shard listens (a shard names its socket by its rank
        in the whole group)."""
        return self.socket_path(self.first_rank + local_rank)

    def shard_args(self) -> list[str]:
        """The `engine serve` arguments every rank gets (its rank comes from the environment): the
        socket base and every engine knob that differs from its default."""
        # --verbose: the launcher shows each shard's latest log line while it loads, so it should
        # say something.
        return ["--verbose", "--uds-path", str(self.uds_path), *changed_flags(self.engine)]

    def router_config(self) -> RouterConfig:
        """The router's configuration: the shared knobs as the shards', the master shard's socket,
        and a start-up wait as long as the shards' (the router starts with the shards: its imports
        overlap their model load)."""
        shared = {f.name: getattr(self.engine, f.name) for f in fields(SharedKnobs)}
        return replace(
            self.router,
            **shared,
            master_url=f"unix://{self.socket_path(0)}",
            wait_for_shards=self.startup_timeout,
        )

    def router_args(self) -> list[str]:
        """`python -m router` arguments: every router knob that differs from its default (the API
        key travels in the environment instead: router_environment)."""
        return changed_flags(self.router_config())

    def single_process_args(self) -> list[str]:
        """`python -m launcher.single_process` arguments: the router's flags (the shared knobs as
        the shard's, no shard socket to wait for), `--`, then the shard's."""
        shared = {f.name: getattr(self.engine, f.name) for f in fields(SharedKnobs)}
        router = replace(self.router, **shared)
        return [*changed_flags(router), "--", "--verbose", *changed_flags(self.engine)]

    def router_environment(self, environ) -> dict[str, str]:
        env = child_environment(environ, drop=tuple(knob_environment_names(RouterConfig)))
        env.update(secret_environment(self.router_config()))
        env.update(self.secret_environment())
        return env

    def secret_environment(self) -> dict[str, str]:
        """The shard secret, for the shards and the router (engine/config.py shard_secret)."""
        return {SHARD_SECRET_VARIABLE: self.shard_secret} if self.shard_secret else {}


def child_environment(environ, drop: tuple[str, ...] = ()) -> dict[str, str]:
    """The environment for a child Python that must import this same engine and launcher,
    wherever the launcher was started from (an installed package or a checkout)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in environ.items() if k not in drop}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, environ.get("PYTHONPATH")]))
    return env
