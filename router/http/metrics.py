"""Prometheus metrics of the router: requests, queue, batches, latencies, KV blocks, and the shards'
padding waste and unwarmed shapes (sent by our shards in the `stats` field of every step's answer);
and the inference gateways' model-server gauges under vLLM's names (GatewayCollector).

Each router gets its own registry, so several routers in one process (tests) never share counters.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.batch import Generation

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OUTCOMES = (
    "success",
    "validation",
    "overloaded",
    "unavailable",
    "error",
    "cancelled",
    "not_found",
    "too_large",
)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class ShardStatsCollector:
    """The last serving stats a shard reported; nothing before the first step (or from TGI's
    shards)."""

    def __init__(self, client):
        self.client = client

    def collect(self):
        stats = self.client.serving_stats()
        if stats is None:
            return
        yield from padding_metrics(stats)
        yield counter(
            "bucketserve_shard_unwarmed_shapes",
            "forwards at a shape warmup did not run",
            stats["unwarmed_shapes"],
        )
        for key, text in OPTIONAL_COUNTERS:
            if key in stats:  # shards of older versions did not count them
                yield counter(f"bucketserve_shard_{key}", text, stats[key])
        yield from graph_counters(stats)
        yield from speculation_metrics(stats)
        if stats.get("images_encoded") or stats.get("image_cache_hits"):  # a VLM's shard
            for key, name, text, unit in IMAGE_COUNTERS:
                yield counter(f"bucketserve_shard_{name}", text, stats[key] / unit)


# A shard's counters that only newer shards send: the stats key (also the metric's name after
# bucketserve_shard_) and the help text.
OPTIONAL_COUNTERS = (
    ("prefill_forwards", "prefill bucket runs"),
    ("decode_forwards", "decode bucket runs"),
    (
        "copied_prompts",
        "prompts whose KV an `n`/`best_of` sibling copied instead of computing them",
    ),
    # chunked prefill: chunks per prompt is the ratio of these two
    ("chunked_prompts", "prompts computed in several chunks"),
    ("prefill_chunks", "chunks of those prompts"),
    # async scheduling: runs beyond steps are forwards thrown away
    ("lookahead_runs", "decode forwards run before their step was asked for"),
    ("lookahead_steps", "decode steps that used such a forward"),
)
# A vision-language model's shard's counters: the stats key, the metric's name after
# bucketserve_shard_, the help text, and what divides the value into the metric's unit.
IMAGE_COUNTERS = (
    ("images_encoded", "images_encoded", "images the vision tower encoded", 1),
    ("encoder_ns", "encoder_seconds", "the vision tower's time", 1e9),
    (
        "image_cache_hits",
        "image_cache_hits",
        "images whose features were kept from an earlier encode",
        1,
    ),
)


def padding_metrics(stats: dict):
    """Per phase, the real and padded work of the shard's buckets and the share that was padding."""
    for phase in ("prefill", "decode"):
        real, padded = stats[f"{phase}_real"], stats[f"{phase}_padded"]
        unit = "tokens" if phase == "prefill" else "rows"
        yield counter(
            f"bucketserve_shard_{phase}_real_{unit}", f"real {unit} the shard computed", real
        )
        yield counter(
            f"bucketserve_shard_{phase}_padded_{unit}", f"{unit} incl. bucket padding", padded
        )
        waste = GaugeMetricFamily(
            f"bucketserve_shard_{phase}_padding_waste_ratio",
            f"share of the {phase} bucket work that was padding",
        )
        waste.add_metric([], 1 - real / padded if padded else 0.0)
        yield waste


SPECULATION_COUNTERS = (
    ("steps", "decode steps that verified proposals (speculative decoding)"),
    ("proposed", "tokens proposed by speculative decoding"),
    ("accepted", "proposed tokens the target accepted"),
    ("emitted", "tokens emitted by verify steps (accepted, plus one per row and step)"),
)


def speculation_metrics(stats: dict):
    """--speculate's counters and ratios (engine/speculative/step.py); nothing from a shard without
    it."""
    if not stats.get("spec_k"):
        return
    for name, text in SPECULATION_COUNTERS:
        yield counter(f"bucketserve_shard_spec_{name}", text, stats[f"spec_{name}"])
    for name, text in (
        ("acceptance_rate", "accepted / proposed tokens"),
        ("mean_accepted_length", "accepted tokens per row and verify step"),
        ("k", "proposals per row the latest speculating step allowed"),
    ):
        yield GaugeMetricFamily(f"bucketserve_shard_spec_{name}", text, value=stats[f"spec_{name}"])


def graph_counters(stats: dict):
    """Device graphs compiled and cut, by phase (engine/devices/simulate/counters.py)."""
    for kind, text in (
        ("compiles", "device graphs compiled (or captured)"),
        ("breaks", "device graphs cut by a host read or a data-dependent shape"),
        ("recompiles", "graphs torch compiled again for a frame (serving: refused, compile mode)"),
    ):
        if f"graph_{kind}_warmup" not in stats:  # a shard of an older version
            continue
        family = CounterMetricFamily(f"bucketserve_graph_{kind}", text, labels=["phase"])
        for phase in ("warmup", "serving"):
            family.add_metric([phase], stats[f"graph_{kind}_{phase}"])
        yield family


class KvCollector:
    """Prefix-cache hits, cached blocks, evictions (router/sched/prefix_cache.py), preemptions and
    chunked admissions (router/sched/preemption.py, router/sched/batching.py); read at each
    scrape."""

    def __init__(self, scheduler):
        self.scheduler = scheduler

    def collect(self):
        stats = self.scheduler.stats
        yield counter(
            "bucketserve_preemptions",
            "running requests requeued for lack of KV blocks",
            stats.preemptions,
        )
        yield counter(
            "bucketserve_chunked_admissions",
            "prompts admitted with a chunk_len",
            stats.chunked_prompts,
        )
        cache = getattr(self.scheduler.allocator, "stats", None)  # None: prefix caching is off
        if cache is None:
            return
        yield counter(
            "bucketserve_prefix_cache_lookups",
            "prompts looked up in the prefix cache",
            cache.requests,
        )
        yield counter(
            "bucketserve_prefix_cache_hit_requests",
            "prompts that reused cached blocks",
            cache.hit_requests,
        )
        yield counter(
            "bucketserve_prefix_cache_prompt_tokens",
            "tokens of the prompts looked up",
            cache.prompt_tokens,
        )
        yield counter(
            "bucketserve_prefix_cache_hit_tokens",
            "prompt tokens found cached, not computed",
            cache.hit_tokens,
        )
        yield counter(
            "bucketserve_prefix_cache_evictions",
            "cached blocks evicted for new ones",
            cache.evictions,
        )
        for name, hits, total in (
            ("tokens", cache.hit_tokens, cache.prompt_tokens),
            ("requests", cache.hit_requests, cache.requests),
        ):
            rate = GaugeMetricFamily(
                f"bucketserve_prefix_cache_hit_rate_{name}", f"share of {name} that hit"
            )
            rate.add_metric([], hits / total if total else 0.0)
            yield rate
        cached = GaugeMetricFamily(
            "bucketserve_prefix_cache_blocks", "KV blocks holding a findable prefix"
        )
        cached.add_metric([], self.scheduler.allocator.num_cached)
        yield cached


class GatewayCollector:
    """The model-server protocol of the Gateway API Inference Extension (its proposal 003), under
    vLLM's names, which the endpoint picker (and llm-d, KServe) scrape by default: queued and
    running requests, KV-cache use as a fraction of the usable blocks, the block size, and the LoRA
    state. Same types and meanings as vLLM's; `model_name` labels them as vLLM does."""

    def __init__(self, scheduler, model_name: str, adapters: tuple[str, ...]):
        self.scheduler, self.model_name, self.adapters = scheduler, model_name, adapters
        self.lora_updated = time.time()
        self._lora_state: tuple = ()

    def collect(self):
        scheduler, labels = self.scheduler, [self.model_name]
        for name, documentation, value in (
            ("vllm:num_requests_waiting", "requests waiting for admission", scheduler.queue_length),
            ("vllm:num_requests_running", "requests in the running batch", scheduler.running_count),
            ("vllm:kv_cache_usage_perc", "KV-cache use, 1 = full", kv_usage(scheduler.allocator)),
        ):
            family = GaugeMetricFamily(name, documentation, labels=["model_name"])
            family.add_metric(labels, value)
            yield family
        config = GaugeMetricFamily(
            "vllm:cache_config_info",
            "the KV cache's configuration (labels; the value is 1)",
            labels=["block_size", "num_gpu_blocks"],
        )
        allocator = scheduler.allocator
        config.add_metric([str(allocator.block_size), str(allocator.num_blocks - 1)], 1)
        yield config
        if self.adapters:
            yield self._lora_info()

    def _lora_info(self) -> GaugeMetricFamily:
        """One sample whose labels list the adapters; its value is when they last changed (the
        endpoint picker keeps the newest sample). Every adapter is loaded at start, so max_lora is
        their number."""
        running, waiting = self.scheduler.adapters()
        state = (sorted(running), sorted(waiting))
        if state != self._lora_state:
            self._lora_state, self.lora_updated = state, time.time()
        family = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "running and waiting LoRA adapters",
            labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )
        family.add_metric(
            [str(len(self.adapters)), ",".join(state[0]), ",".join(state[1])], self.lora_updated
        )
        return family


def kv_usage(allocator) -> float:
    usable = allocator.num_blocks - 1  # block 0 is reserved
    return allocator.num_used / usable if usable > 0 else 0.0


def counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(name, documentation)
    family.add_metric([], value)
    return family


class RouterMetrics:
    def __init__(self, scheduler, client, model_name: str = "", adapters: tuple[str, ...] = ()):
        self.registry = registry = CollectorRegistry()
        self.requests = Counter(
            "bucketserve_requests", "requests by outcome", ["outcome"], registry=registry
        )
        for outcome in OUTCOMES:
            self.requests.labels(outcome)  # every outcome shows from the start, at 0
        self.batch_size = Histogram(
            "bucketserve_batch_size",
            "requests per shard step",
            ["phase"],
            buckets=BATCH_BUCKETS,
            registry=registry,
        )
        self.ttft = Histogram(
            "bucketserve_time_to_first_token_seconds",
            "from arrival to the first token",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.tpot = Histogram(
            "bucketserve_time_per_output_token_seconds",
            "after the first token, per token",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.duration = Histogram(
            "bucketserve_request_duration_seconds",
            "from arrival to the last token",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.generated = Counter(
            "bucketserve_generated_tokens", "tokens generated", registry=registry
        )
        self.embedded_inputs = Counter(
            "bucketserve_embedding_inputs", "inputs embedded (/v1/embeddings)", registry=registry
        )
        self.embedded_tokens = Counter(
            "bucketserve_embedding_tokens", "tokens of the inputs embedded", registry=registry
        )
        self.embedding_seconds = Histogram(
            "bucketserve_embedding_request_duration_seconds",
            "a /v1/embeddings request from arrival to its answer",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.invalid_replies = Counter(
            "bucketserve_invalid_replies",
            "finished response_format replies that do not match their schema (returned as they "
            "are)",
            registry=registry,
        )
        self._gauges(scheduler)
        registry.register(ShardStatsCollector(client))
        registry.register(KvCollector(scheduler))
        registry.register(GatewayCollector(scheduler, model_name, adapters))

    def _gauges(self, scheduler) -> None:
        registry = self.registry  # scheduler.allocator is read each time: a recovery may replace it
        Gauge(
            "bucketserve_queue_size", "requests waiting for admission", registry=registry
        ).set_function(lambda: scheduler.queue_length)
        Gauge(
            "bucketserve_running_requests", "requests in the shards' batch", registry=registry
        ).set_function(lambda: scheduler.running_count)
        Gauge(
            "bucketserve_kv_blocks_in_use", "KV cache blocks held by requests", registry=registry
        ).set_function(lambda: scheduler.allocator.num_used)
        Gauge(
            "bucketserve_kv_blocks_total",
            "usable KV cache blocks (block 0 is reserved)",
            registry=registry,
        ).set_function(lambda: scheduler.allocator.num_blocks - 1)
        Gauge(
            "bucketserve_shards_available", "1 while the shards answer", registry=registry
        ).set_function(lambda: float(scheduler.available))

    def on_step(self, phase: str, size: int) -> None:
        self.batch_size.labels(phase).observe(size)

    def outcome(self, outcome: str) -> None:
        self.requests.labels(outcome).inc()

    async def timed(
        self, generations: AsyncIterator[Generation], arrival: float
    ) -> AsyncIterator[Generation]:
        """Pass generations through, timing the first token and the ones after it."""
        first, tokens = None, 0
        async for generation in generations:
            now = time.perf_counter()
            if first is None:
                first = now
                self.ttft.observe(now - arrival)
            tokens += len(generation.tokens.ids)
            self.generated.inc(
                len(generation.tokens.ids)
            )  # as they come: a cancelled request's count too
            if generation.generated_text is not None:
                self.duration.observe(now - arrival)
                if tokens > 1:
                    self.tpot.observe((now - first) / (tokens - 1))
            yield generation

    def render(self) -> bytes:
        return generate_latest(self.registry)
