"""Wiring: connect to the shards, warm them up with the router's limits, then build the scheduler
and the app.

The same sequence as TGI's v3 router: ServiceDiscovery, ClearCache, Info, Warmup; the KV capacity in
the Warmup answer sizes the router's block allocator (one block more than the answer's tokens fill:
block 0 is reserved for padding).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from engine.batch import Batch, NextTokenChooserParameters, Request, StoppingCriteriaParameters
from engine.cli.flags import add_knob_flags
from engine.cli.flags import config_from_args as knobs_from_args
from engine.config import ServingLimits, default_cache_dir, shard_secret
from engine.errors import BucketserveError
from engine.weights.paths import resolve_model_dir
from router.client import GrpcShardClient, ShardClient, ShardError

# re-exported: the router's configuration, as before it had a module of its own
from router.config import DEFAULT_PAYLOAD_LIMIT, EMBEDDED_MODEL_NAME, AccessConfig, RouterConfig  # noqa: F401
from router.http import tracing
from router.http.access import install
from router.http.embeddings import embedding_routes
from router.http.errors import BodyLimit, install_error_handlers
from router.http.front_page import front_page_routes
from router.http.lifecycle import DrainGate, DrainingServer, Lifecycle
from router.http.messages_api import messages_routes
from router.http.metrics import RouterMetrics
from router.http.openai_api import openai_routes
from router.http.reasoning import parser_for
from router.http.response_store import ResponseStore
from router.http.responses_api import responses_routes
from router.http.state import RouterState
from router.http.tgi_api import service_routes, tgi_routes
from router.http.validation import MAX_TOP_N_TOKENS
from router.sched.admission import ShardsUnavailable
from router.sched.allocator import BlockAllocator
from router.sched.prefix_cache import PrefixCache
from router.sched.scheduler import Scheduler, lookahead_for

log = logging.getLogger(__name__)
VERSION = "0.1.0"
PARENT_POLL_S = 0.5


def warmup_batch(max_input: int, max_prefill: int, max_total: int, max_batch: int) -> Batch:
    """TGI's warmup: '_test ' prompts truncated to fill max_prefill_tokens, every logits processor
    on."""
    requests, tokens = [], 0
    while tokens < max_prefill and len(requests) < max_batch:
        truncate = min(max_input, max_prefill - tokens)
        params = NextTokenChooserParameters(
            temperature=0.9,
            top_k=10,
            top_p=0.9,
            typical_p=0.9,
            seed=1,
            repetition_penalty=1.2,
            frequency_penalty=0.1,
            watermark=True,
        )
        requests.append(
            Request(
                0,
                "_test " * max_input,
                truncate=truncate,
                parameters=params,
                stopping_parameters=StoppingCriteriaParameters(
                    max(max_total - truncate, 1), [], True
                ),
                prefill_logprobs=True,
                top_n_tokens=MAX_TOP_N_TOKENS,
            )
        )
        tokens += truncate
    return Batch(0, requests, size=len(requests), max_tokens=max_input)


async def warm_up(
    client: ShardClient, config: RouterConfig
) -> tuple[ServingLimits, BlockAllocator, dict]:
    await client.clear_cache(None)
    info = await client.info()
    result = await rewarm(client, config)
    if result.max_supported_total_tokens is None:
        raise RuntimeError("the shards did not report their KV cache capacity")
    blocks = result.max_supported_total_tokens // info.block_size + 1
    limits = ServingLimits(
        config.max_batch_size,
        config.max_prefill_tokens,
        result.max_input_tokens,
        result.max_total_tokens,
        config.max_concurrent_requests,
    )
    caching = config.prefix_caching and info.use_prefix_caching
    allocator = (PrefixCache if caching else BlockAllocator)(blocks, info.block_size)
    return (
        limits,
        allocator,
        {
            **info_dict(config, info, limits, result),
            "prefix_caching": caching,
            "support_chunking": info.support_chunking,
        },
    )


async def rewarm(client: ShardClient, config: RouterConfig):
    """Warmup with the router's limits: at start, and again after the shards restarted."""
    batch = warmup_batch(
        config.max_input_tokens,
        config.max_prefill_tokens,
        config.max_total_tokens,
        config.max_batch_size,
    )
    return await client.warmup(
        batch, config.max_input_tokens, config.max_prefill_tokens, config.max_total_tokens
    )


def info_dict(config: RouterConfig, info, limits: ServingLimits, result) -> dict:
    return {
        "model_id": config.model_name,
        "model_sha": None,
        "model_dtype": info.dtype,
        "model_device_type": info.device_type,
        "model_pipeline_tag": "text-generation",
        "max_concurrent_requests": limits.max_concurrent_requests,
        "max_best_of": 1,
        "max_stop_sequences": 4,
        "max_input_tokens": limits.max_input_tokens,
        "max_total_tokens": limits.max_total_tokens,
        "max_batch_prefill_tokens": limits.max_prefill_tokens,
        "max_batch_size": limits.max_batch_size,
        "max_batch_total_tokens": result.max_supported_total_tokens,
        "block_size": info.block_size,
        # flat_paged (native model) or transformers+flat_paged
        "attention_impl": info.attention_impl,
        "validation_workers": 1,
        "max_client_batch_size": 1,
        "router": "bucketserve-router",
        "version": VERSION,
        "sha": None,
        "docker_label": None,
        "lora_adapters": list(config.adapter_names),
    }


def create_app(
    state: RouterState,
    access: AccessConfig = AccessConfig(),
    traces: tracing.Tracing | None = None,
    payload_limit: int = DEFAULT_PAYLOAD_LIMIT,
    lifecycle: Lifecycle | None = None,
    responses: ResponseStore | None = None,
) -> FastAPI:
    """The HTTP app: TGI's routes, OpenAI's, Anthropic's Messages, and the service routes, over one
    state; every error in the route's shape (router/http/errors.py). `responses`: the Responses
    API's store."""
    app = FastAPI(
        title="bucketserve router", docs_url=None, redoc_url=None
    )  # their assets come from a CDN
    lifecycle = lifecycle or Lifecycle()
    app.add_middleware(BodyLimit, limit=payload_limit, metrics=state.metrics)
    tracing.install(
        app, traces, state.scheduler
    )  # inside the access middleware, which names the request first
    install(app, access)
    install_error_handlers(app, state.metrics)
    tgi_routes(app, state)
    openai_routes(app, state)
    embedding_routes(app, state)
    responses_routes(app, state, responses)
    messages_routes(app, state)
    service_routes(app, state)
    front_page_routes(app, state)

    @app.get("/live")
    async def live_route():  # a liveness probe: green while the process serves, draining too
        return JSONResponse(None)

    # outermost: a draining server refuses before any other work
    app.add_middleware(DrainGate, lifecycle=lifecycle, metrics=state.metrics)
    return app


async def build_state(
    config: RouterConfig, client: ShardClient, tokenizer=None, **state_fields
) -> RouterState:
    """`tokenizer`: the one `load_tokenizer(config)` gives, when the caller loaded it already;
    `state_fields`: RouterState's optional fields (the single-process server's grammar check)."""
    tokenizer = load_tokenizer(config) if tokenizer is None else tokenizer
    limits, allocator, info = await warm_up(client, config)

    async def capacity_after_rewarm() -> int | None:
        return (await rewarm(client, config)).max_supported_total_tokens

    lookahead = lookahead_for(config.lookahead, info["model_device_type"])
    scheduler = Scheduler(
        client,
        allocator,
        limits,
        rewarm=capacity_after_rewarm,
        chunking=bool(info.get("support_chunking")),
        lookahead=lookahead,
    )
    metrics = RouterMetrics(scheduler, client, config.model_name, config.adapter_names)
    scheduler.on_step = metrics.on_step
    if config.kv_events_endpoint:
        publish_kv_events(allocator, config)
    await scheduler.start()
    state = RouterState(scheduler, tokenizer, client, info, metrics, **state_fields)
    state.images = image_policy(config, tokenizer)
    state.reasoning = parser_for(config.reasoning_parser, getattr(tokenizer, "chat_template", None))
    return state


def image_policy(config: RouterConfig, tokenizer):
    """What images the model takes (its config.json), and the limits the router's flags set."""
    from router.images.decode import ImageLimits
    from router.images.prompt import policy_for

    limits = ImageLimits(
        config.max_image_pixels,
        config.max_images_per_request,
        config.max_image_bytes,
        config.allow_image_urls,
        config.image_url_timeout,
    )
    model_dir = tokenizer_dir(config) if config.model_id or config.tokenizer else None
    return policy_for(model_dir, tokenizer, limits)


def publish_kv_events(allocator, config: RouterConfig) -> None:
    """The prefix cache tells a ZeroMQ publisher what it holds (router/events/kv_events.py)."""
    if not isinstance(allocator, PrefixCache):
        raise BucketserveError(
            "--kv-events-endpoint needs prefix caching, which is off (--prefix-caching, or the "
            "shards' attention does not support it)"
        )
    from router.events.kv_events import KvEventPublisher  # pyzmq: only where events are asked for

    try:
        publisher = KvEventPublisher(
            config.kv_events_endpoint, config.kv_events_topic, config.adapter_names
        )
    except Exception as error:  # zmq.ZMQError: a bad endpoint, an address in use
        raise BucketserveError(
            f"--kv-events-endpoint {config.kv_events_endpoint}: {error}"
        ) from error
    allocator.listen(publisher)
    log.info("KV events on %s (topic %r)", publisher.endpoint, config.kv_events_topic)


async def serve(config: RouterConfig) -> None:
    """Serve over the gRPC shards at --master-shard-uds-path."""
    # The tokenizer (seconds: transformers' imports) loads while the shards come up.
    tokenizer = asyncio.get_running_loop().run_in_executor(None, load_tokenizer, config)
    try:
        client = await GrpcShardClient.connect(
            config.master_url, wait=config.wait_for_shards or None, secret=shard_secret()
        )
        if config.wait_for_shards:
            await client.wait_for_every_shard(config.wait_for_shards)
    except BaseException:
        tokenizer.add_done_callback(lambda done: done.exception())  # its error, if any, is moot
        raise
    await serve_over(config, client, tokenizer)


async def serve_over(config: RouterConfig, client: ShardClient, tokenizer, **state_fields) -> None:
    """Warm `client`'s shards up and serve HTTP over them until SIGTERM (drained) or the launcher
    is gone. `tokenizer`: a future of load_tokenizer's; `state_fields`: as build_state's."""
    try:
        state = await build_state(config, client, await tokenizer, **state_fields)
    except BaseException:  # a model file that cannot be read, the shards gone during warmup
        await client.close()
        raise
    traces = tracing.Tracing.to_otlp(config.otlp_endpoint) if config.otlp_endpoint else None
    lifecycle = Lifecycle()
    app: FastAPI = create_app(
        state,
        config.access,
        traces,
        config.payload_limit,
        lifecycle,
        responses=ResponseStore(config.max_stored_responses),
    )
    server = DrainingServer(
        uvicorn.Config(app, host=config.hostname, port=config.port, log_level="warning"),
        lifecycle,
        state.scheduler,
        config.drain_timeout,
    )
    log.info("serving on http://%s:%d", config.hostname, config.port)
    watcher = (
        asyncio.create_task(watch_parent(config.parent_pid, server, state.scheduler))
        if config.parent_pid
        else None
    )
    try:
        await server.serve()
    finally:
        if watcher is not None:
            watcher.cancel()
        await state.scheduler.stop()
        await client.close()
        if getattr(state.scheduler.allocator, "listener", None) is not None:
            state.scheduler.allocator.listener.close()
        state.executor.shutdown(wait=False, cancel_futures=True)


def run_server(serving) -> int:
    """Run the `serving` coroutine to its end: 0, or 2 after one `error:` line, as the engine's and
    the launcher's commands print (a corrupt model file, the shards unreachable): the launcher
    shows it beside the shard's own. Ctrl-C ends it quietly."""
    try:
        asyncio.run(serving)
    except KeyboardInterrupt:
        pass
    except (BucketserveError, ShardError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


async def watch_parent(parent_pid: int, server: uvicorn.Server, scheduler: Scheduler) -> None:
    """A launcher that was SIGKILLed cannot stop its router: it notices it has a new parent.
    Its shards stop too and nothing restarts them, so the requests held for a restart would wait
    forever (and uvicorn with them): each ends now with a 503, which a balancer retries on
    another replica."""
    while os.getppid() == parent_pid:
        await asyncio.sleep(PARENT_POLL_S)
    log.warning("the launcher (pid %d) is gone: stopping", parent_pid)
    gone = ShardsUnavailable("the launcher is gone: this replica is stopping")
    try:
        await asyncio.wait_for(scheduler.stop(gone), PARENT_POLL_S * 10)
    finally:
        server.should_exit = True


def load_tokenizer(config: RouterConfig):
    """The model's tokenizer. transformers is imported here, not at the top: it imports torch,
    which the router never needs (a test keeps torch out of `import router.app`)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir(config))


def tokenizer_dir(config: RouterConfig) -> str:
    """--tokenizer, else the directory of --model-id; a GGUF file, either way, gives its converted
    directory (a file that cannot be read raises ModelLoadError, naming it)."""
    if config.tokenizer and not config.tokenizer.endswith(".gguf"):
        return config.tokenizer
    model = config.tokenizer or config.model_id
    return str(resolve_model_dir(model, config.cache_dir or default_cache_dir()))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m router", description="bucketserve HTTP router (TGI's API)"
    )
    add_knob_flags(parser, RouterConfig)
    return parser


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    return knobs_from_args(RouterConfig, args)
