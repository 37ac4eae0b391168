"""The router's configuration: knob dataclasses (engine/config.py `knob`), one field per flag of
`python -m router`. Light to import (no web framework, no torch): the launcher builds its own
command line from these fields before any shard starts."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.config import SharedKnobs, knob, nested
from router.http.reasoning import CHOICES as REASONING_PARSERS

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_PAYLOAD_LIMIT = 2_000_000  # bytes, TGI's default
DEFAULT_STORED_RESPONSES = 1024  # the Responses API's store (router/http/response_store.py)
TGI_MODEL_ALIAS = "tgi"  # the model name TGI's clients and docs send; always accepted


def shard_url(text: str) -> str:
    """A gRPC target; a bare socket path is a unix one."""
    if not text.startswith(("unix:", "dns:", "ipv4:", "ipv6:")) and "://" not in text:
        return f"unix://{text}"
    return text


@dataclass(frozen=True, kw_only=True)
class AccessConfig:
    """Who may call the router (router/http/access.py)."""

    api_key: str | None = knob(
        None,
        "require `Authorization: Bearer KEY` on every route but /health "
        "and /metrics (default: $BUCKETSERVE_API_KEY; unset: no key "
        "needed); a launcher passes it in the environment, never on a "
        "command line",
        env="BUCKETSERVE_API_KEY",
        secret=True,
    )
    cors_allow_origins: tuple[str, ...] = knob(
        (),
        "an origin browsers may call from (repeat, or `*`); default: none",
        flags=("--cors-allow-origin",),
        repeat=True,
    )


@dataclass(frozen=True, kw_only=True)
class RouterConfig(SharedKnobs):
    """`python -m router`: the shards to drive, the HTTP side, and the limits it schedules under
    (the shared ones, SharedKnobs, are the shards' own flags too)."""

    master_url: str = knob(
        "",
        "the rank-0 shard, e.g. unix:///tmp/x-0",
        flags=("--master-shard-uds-path",),
        parse=shard_url,
        required=True,
    )
    tokenizer: str | None = knob(
        None, "a directory with the model's tokenizer (default: --model-id's)"
    )
    served_model_name: str | None = knob(
        None,
        "the model's name in the OpenAI API: /v1/models lists it (and the LoRA adapters), "
        "a request that names another model gets 404; `tgi` is always accepted (default: the "
        "model directory's name)",
    )
    reasoning_parser: str = knob(
        "auto",
        "split a reasoning model's thinking (`<think>...</think>`) from its answer: chat "
        "completions return it as `reasoning_content`, and grammars (tools, json_schema) "
        "constrain the answer after it. qwen3: the block the reply opens with; deepseek_r1: all "
        "text before `</think>`; auto (default): from the chat template where it is plain (it "
        "writes `<think>`: qwen3, or DeepSeek's: deepseek_r1), else none; none: off",
        choices=REASONING_PARSERS,
    )
    hostname: str = knob("127.0.0.1", "the HTTP address")
    port: int = knob(8080, "the HTTP port")
    max_concurrent_requests: int = knob(
        128, "queued + running requests; beyond it a request gets HTTP 429"
    )
    access: AccessConfig = nested(AccessConfig)
    payload_limit: int = knob(
        DEFAULT_PAYLOAD_LIMIT,
        "largest request body in bytes; a larger one gets HTTP 413 (TGI's flag and default)",
    )
    lookahead: str = knob(
        "auto",
        "on: while nothing waits to be admitted, the shards run a batch's "
        "next forward as soon as they answer a step, overlapping the "
        "router's round trip; auto (default): on, on every device",
        choices=("auto", "on", "off"),
    )
    wait_for_shards: float = knob(
        0.0,
        "wait up to this many seconds for the shards to answer (the "
        "launcher starts the router while the shards load); default "
        "0: fail at once if they do not",
    )
    kv_events_endpoint: str | None = knob(
        None,
        "publish the prefix cache's KV events (BlockStored, BlockRemoved, AllBlocksCleared) in "
        "vLLM's format on this ZeroMQ endpoint, for KV-aware routers: tcp://*:5557 binds, an "
        "address without `*` is connected to (default: none)",
    )
    kv_events_topic: str = knob("", "the ZeroMQ topic of the KV events (vLLM's default: empty)")
    drain_timeout: float = knob(
        30.0,
        "on SIGTERM, seconds to finish the admitted requests (new ones get 503 with Retry-After, "
        "/health turns 503) before exiting 0; what is left is then cancelled",
    )
    allow_image_urls: bool = knob(
        False,
        "a vision-language model's images may be http(s) URLs, which the router fetches "
        "(never from a private or local address); off: data: URLs only",
        switch=True,
    )
    max_image_pixels: int = knob(
        4096 * 4096, "the most pixels (width x height) an image may have; more gets HTTP 422"
    )
    max_images_per_request: int = knob(8, "the most images a request may hold")
    max_image_bytes: int = knob(20 * 1024 * 1024, "the largest image file, in bytes")
    image_url_timeout: float = knob(10.0, "seconds an image URL may take, redirects included")
    max_stored_responses: int = knob(
        DEFAULT_STORED_RESPONSES,
        "the most responses of /v1/responses kept in memory for `previous_response_id` and "
        "GET /v1/responses/{id}; beyond it the least recently used is evicted (0: none kept)",
    )
    parent_pid: int | None = knob(
        None, "stop when this process is gone (the launcher sets it)", env="BUCKETSERVE_PARENT_PID"
    )

    @property
    def adapter_names(self) -> tuple[str, ...]:
        """The LoRA adapters' names, for `adapter_id` / OpenAI `model`."""
        return tuple(name for name, _ in self.lora_adapters)

    @property
    def model_name(self) -> str:
        """The model's name (OpenAI's `model`, TGI's /info model_id): --served-model-name, else
        the model directory's name (a GGUF file's without .gguf)."""
        if self.served_model_name:
            return self.served_model_name
        source = self.model_id or self.tokenizer
        if not source:
            return EMBEDDED_MODEL_NAME
        name = Path(source.rstrip("/")).name
        return name.removesuffix(".gguf") or source
