"""The launcher's configuration: one frozen dataclass, filled from the command line."""
from __future__ import annotations

import os
from dataclasses import dataclass

from engine.config import EngineConfig

DEFAULT_PORT = 3000  # TGI's router port: a `docker run -p 8080:3000` written for TGI works unchanged

_ENGINE = EngineConfig()  # the shard's defaults, so a launched shard behaves like `engine serve`


@dataclass(frozen=True)
class LauncherConfig:
    model_id: str | None = None          # None: the embedded model, as `engine serve`
    num_shard: int = 1
    device: str = "auto"                 # after resolve(): a concrete device, never "auto"
    dtype: str | None = None             # None: the engine's default (auto)
    quantize: str | None = None          # engine serve --quantize; None: its default (none)
    max_batch_size: int = _ENGINE.max_batch_size
    max_input_tokens: int = _ENGINE.max_input_tokens
    max_total_tokens: int = _ENGINE.max_total_tokens
    max_prefill_tokens: int = _ENGINE.max_prefill_tokens  # --max-batch-prefill-tokens, TGI's name
    block_size: int | None = None
    warmup: str | None = None            # engine serve --warmup (full | progressive | none); None: its default
    warmup_profile: str | None = None    # engine serve --warmup-profile: a profile.json to warm from
    record_shapes: str | None = None     # engine serve --record-shapes: rank 0 appends served shapes here
    lora_adapters: str | None = None     # name=dir[,name=dir...], passed to every shard as --lora-adapters
    lora_impl: str | None = None         # dense or gather; None: the device's default
    implementation: str | None = None    # auto, native or transformers; None: the engine's default (auto)
    moe_impl: str | None = None          # MoE experts, dense or gather; None: the device's default
    prefix_caching: str = "on"           # on | off: passed to the shards (context buckets) and the router
    lookahead: str = "auto"              # auto | on | off: the router's async scheduling (router/sched/scheduler.py)
    uds_path: str | None = None          # socket base; None: a unique one is picked per launch
    port: int = DEFAULT_PORT             # the router's HTTP port
    hostname: str = "0.0.0.0"            # the router's HTTP address (TGI's default: reachable from outside a container)
    max_concurrent_requests: int = 128   # the router answers 429 beyond it
    payload_limit: int = 2_000_000       # request body bytes; the router answers 413 beyond it (TGI's default)
    master_port: int | None = None       # torch.distributed rendezvous; None: a free port per launch
    no_router: bool = False
    restart_on_failure: bool = False
    startup_timeout: float = 1800.0      # loading a large model from a slow disk takes many minutes
    shutdown_timeout: float = 10.0
    max_restarts: int = 3                # restarts allowed within restart_window seconds, then give up
    restart_window: float = 300.0
    api_key: str | None = None           # given to the router as $BUCKETSERVE_API_KEY (never on a command line)
    cors_allow_origins: tuple[str, ...] = ()
    otlp_endpoint: str | None = None

    def socket_path(self, rank: int) -> str:
        return f"{self.uds_path}-{rank}"

    def shard_args(self) -> list[str]:
        """The `engine serve` arguments every rank gets (its rank comes from the environment)."""
        # --verbose: the launcher shows each shard's latest log line while it loads, so it should say something.
        args = ["--verbose", "--device", self.device, "--uds-path", str(self.uds_path),
                "--max-batch-size", str(self.max_batch_size),
                "--max-input-tokens", str(self.max_input_tokens), "--max-total-tokens", str(self.max_total_tokens),
                "--max-prefill-tokens", str(self.max_prefill_tokens), "--prefix-caching", self.prefix_caching]
        if self.model_id is not None:
            args += ["--model-id", self.model_id]
        if self.dtype is not None:
            args += ["--dtype", self.dtype]
        if self.block_size is not None:
            args += ["--block-size", str(self.block_size)]
        if self.lora_adapters:
            args += ["--lora-adapters", self.lora_adapters]
        if self.lora_impl is not None:
            args += ["--lora-impl", self.lora_impl]
        for flag, value in (("--warmup", self.warmup), ("--warmup-profile", self.warmup_profile),
                            ("--record-shapes", self.record_shapes), ("--implementation", self.implementation),
                            ("--moe-impl", self.moe_impl), ("--otlp-endpoint", self.otlp_endpoint),
                            ("--quantize", self.quantize)):
            if value is not None:
                args += [flag, value]
        return args


    def router_args(self) -> list[str]:
        """`python -m router` arguments: the master shard, the same model and limits as the shards."""
        args = ["--master-shard-uds-path", f"unix://{self.socket_path(0)}", "--hostname", self.hostname,
                "--port", str(self.port), "--max-input-tokens", str(self.max_input_tokens),
                "--max-total-tokens", str(self.max_total_tokens),
                "--max-batch-prefill-tokens", str(self.max_prefill_tokens),
                "--max-batch-size", str(self.max_batch_size),
                "--max-concurrent-requests", str(self.max_concurrent_requests),
                "--payload-limit", str(self.payload_limit), "--prefix-caching", self.prefix_caching,
                "--lookahead", self.lookahead,
                # the router starts with the shards (its imports overlap their model load) and waits for them
                "--wait-for-shards", str(self.startup_timeout)]
        if self.model_id is not None:
            args += ["--model-id", self.model_id]
        if self.lora_adapters:  # the router checks adapter_id against these names
            args += ["--lora-adapters", self.lora_adapters]
        for origin in self.cors_allow_origins:
            args += ["--cors-allow-origin", origin]
        if self.otlp_endpoint:
            args += ["--otlp-endpoint", self.otlp_endpoint]
        return args

    def router_environment(self, environ) -> dict[str, str]:
        env = child_environment(environ)
        if self.api_key:
            env["BUCKETSERVE_API_KEY"] = self.api_key
        return env


def child_environment(environ, drop: tuple[str, ...] = ()) -> dict[str, str]:
    """The environment for a child Python that must import this same engine and launcher,
    wherever the launcher was started from (an installed package or a checkout)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in environ.items() if k not in drop}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, environ.get("PYTHONPATH")]))
    return env
