"""How the router talks to shards: one async interface, over gRPC or over an in-process Shard.

Both return the engine's dataclasses (engine/batch.py), so the router's scheduler never sees
protobuf and can be tested without processes. Errors from either become a `ShardError` that carries
a gRPC status code, so the router handles a remote and a local failure the same way. What the two
sides agree on beyond the messages (status codes, limits) is engine/wire/contract.py.
"""

from __future__ import annotations

import asyncio
import contextvars
import copy
import functools
import time
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Protocol

import grpc

from engine.batch import (
    Batch,
    CachedBatch,
    Embedding,
    EmbedInput,
    Generation,
    InfoResponse,
    WarmupResult,
)
from engine.wire import convert
from engine.wire import generate_pb2 as pb
from engine.wire import generate_pb2_grpc as pb_grpc
from engine.wire.contract import (
    MAX_MESSAGE_BYTES,
    TRACEPARENT_METADATA_KEY,
    shard_secret_metadata,
    status_for,
)

StepResult = tuple[list[Generation], CachedBatch | None]
# The traced requests of the current step: request id -> the W3C traceparent of its open phase span
# (set by router/http/trace_steps.py around each step; empty when nothing is traced).
STEP_TRACES: contextvars.ContextVar[dict[int, str] | None] = contextvars.ContextVar(
    "step_traces", default=None
)


class ShardError(Exception):
    """An RPC failed on a shard: its status code, and a message naming the RPC and the shard."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code, self.message = code, message


class ShardClient(Protocol):
    async def info(self) -> InfoResponse: ...

    async def warmup(
        self,
        batch: Batch | None,
        max_input_tokens: int | None,
        max_prefill_tokens: int,
        max_total_tokens: int | None,
    ) -> WarmupResult: ...

    async def prefill(
        self,
        batch: Batch,
        cached: CachedBatch | None = None,
        resume: dict[int, list[int]] | None = None,
    ) -> StepResult:
        """`resume`: request id -> the tokens it generated before the shards restarted; only
        clients whose `resumes` is true accept it."""

    async def decode(
        self,
        batches: list[CachedBatch],
        grown: dict[int, list[int]] | None = None,
        look_ahead: bool = False,
    ) -> StepResult:
        """`grown`: request id -> KV blocks added to it before this step (on-demand allocation).
        `look_ahead`: the next call decodes the answered batch again, so the shards may start that
        step's forward at once (our shards do; TGI's ignore it)."""

    async def filter_batch(self, batch_id: int, request_ids: list[int]) -> CachedBatch: ...

    async def embed(self, inputs: list[EmbedInput]) -> list[Embedding]:
        """The inputs' embeddings (the Embed extension RPC; TGI's shards do not have it). The
        scheduler calls it between its steps (router/sched/embeds.py)."""

    async def clear_cache(self, batch_id: int | None = None) -> None: ...

    async def health(self) -> None: ...

    async def close(self) -> None: ...

    def serving_stats(self) -> dict[str, int] | None:
        """The first shard's padding and unwarmed-shape counts as of its last step (None:
        unknown)."""


def minimum_warmup(results: list[WarmupResult]) -> WarmupResult:
    """What every shard can do. A shard that left its capacity unset (None) does not limit it."""
    capacities = [
        r.max_supported_total_tokens for r in results if r.max_supported_total_tokens is not None
    ]
    return WarmupResult(
        min(capacities) if capacities else None,
        min(r.max_input_tokens for r in results),
        min(r.max_total_tokens for r in results),
    )


# --- gRPC: every RPC to every shard -----------------------------------------------------------


# Reconnect quickly: a restarted shard binds the same socket again, and gRPC's default backoff would
# leave it unasked for up to two minutes.
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class GrpcShardClient:
    """The shards of one model behind a generate.v3 server, found through ServiceDiscovery.

    Every RPC goes to all shards at once: tensor-parallel ranks meet in collectives inside each
    step, so a shard that got the RPC waits for the ones that did not. Each request's generation
    comes from exactly one rank, so the generations of all shards are concatenated."""

    def __init__(self, urls: list[str], timeout: float | None = None, secret: str | None = None):
        self.urls, self.timeout = list(urls), timeout
        # A multi-node group's shards of other nodes take calls with its secret only.
        self.secret_metadata = shard_secret_metadata(secret)
        self.channels = [
            grpc.aio.insecure_channel(url, options=CHANNEL_OPTIONS) for url in self.urls
        ]
        self.stubs = [pb_grpc.TextGenerationServiceStub(channel) for channel in self.channels]
        self._stats: dict[str, int] | None = None
        # Our shards answer each step with stats and read resumed tokens; TGI's do neither.
        self.resumes = False
        # Pipeline stages (Info): each Prefill and Decode then carries its place in the order of
        # steps since Warmup, which the stages keep (engine/pipeline/turns.py).
        self.pipeline_stages, self._steps = 1, 0

    @classmethod
    async def connect(
        cls,
        master_url: str,
        timeout: float | None = None,
        wait: float | None = None,
        secret: str | None = None,
    ) -> GrpcShardClient:
        """`wait`: seconds to wait for the master shard to come up (gRPC's wait_for_ready retries
        the connection), as when the router starts while the shards are still loading the model."""
        async with grpc.aio.insecure_channel(master_url, options=CHANNEL_OPTIONS) as channel:
            stub = pb_grpc.TextGenerationServiceStub(channel)
            try:
                response = await stub.ServiceDiscovery(
                    pb.ServiceDiscoveryRequest(),
                    timeout=wait or timeout,
                    wait_for_ready=wait is not None,
                )
            except grpc.aio.AioRpcError as error:
                raise ShardError(
                    error.code(), f"ServiceDiscovery on {master_url}: {error.details()}"
                ) from None
        return cls(list(response.urls), timeout, secret)

    async def wait_for_every_shard(self, wait: float) -> None:
        """The master answers discovery before the other ranks may be listening: wait for each."""
        calls = [
            stub.Health(
                pb.HealthRequest(),
                timeout=wait,
                wait_for_ready=True,
                metadata=self.secret_metadata or None,
            )
            for stub in self.stubs
        ]
        for url, outcome in zip(self.urls, await asyncio.gather(*calls, return_exceptions=True)):
            if isinstance(outcome, grpc.aio.AioRpcError):
                await self.close()
                raise ShardError(outcome.code(), f"Health on {url}: {outcome.details()}")

    async def _all(self, method: str, request, metadata=None) -> list:
        """The responses of every shard, in rank order; the first shard's error if any failed.

        All calls run to their end before an error is raised, so no RPC is left in flight."""
        metadata = (*(metadata or ()), *self.secret_metadata) or None
        calls = [
            getattr(stub, method)(request, timeout=self.timeout, metadata=metadata)
            for stub in self.stubs
        ]
        responses = await asyncio.gather(*calls, return_exceptions=True)
        # A dead rank first: the others then fail in their collectives, which says less.
        order = sorted(zip(self.urls, responses), key=lambda pair: not is_unavailable(pair[1]))
        for url, response in order:
            if isinstance(response, grpc.aio.AioRpcError):
                raise ShardError(response.code(), f"{method} on {url}: {response.details()}")
            if isinstance(response, BaseException):
                raise response
        if method in ("Prefill", "Decode", "Embed"):
            self._read_stats(responses[0])
        return responses

    def _read_stats(self, response) -> None:
        # Our shards fill the stats extension field; other v3 shards (TGI's) leave it unset.
        if response.HasField("stats"):
            self._stats, self.resumes = convert.stats_from_pb(response.stats), True

    def serving_stats(self) -> dict[str, int] | None:
        return self._stats

    async def info(self) -> InfoResponse:
        info = convert.info_from_pb((await self._all("Info", pb.InfoRequest()))[0])
        self.pipeline_stages = info.pipeline_stages
        return info

    def _step_order(self) -> int:
        if self.pipeline_stages == 1:
            return 0
        self._steps += 1
        return self._steps

    async def warmup(
        self,
        batch: Batch | None,
        max_input_tokens: int | None,
        max_prefill_tokens: int,
        max_total_tokens: int | None,
    ) -> WarmupResult:
        request = convert.warmup_request_to_pb(
            batch, max_input_tokens, max_prefill_tokens, max_total_tokens
        )
        self._steps = 0  # the shards number steps from 1 again after Warmup
        return minimum_warmup(
            [convert.warmup_from_pb(r) for r in await self._all("Warmup", request)]
        )

    async def prefill(
        self,
        batch: Batch,
        cached: CachedBatch | None = None,
        resume: dict[int, list[int]] | None = None,
    ) -> StepResult:
        traces = STEP_TRACES.get() or {}
        request = convert.prefill_request_to_pb(batch, cached, resume, traces, self._step_order())
        return step_result(await self._all("Prefill", request, traceparent_metadata(traces)))

    async def decode(
        self,
        batches: list[CachedBatch],
        grown: dict[int, list[int]] | None = None,
        look_ahead: bool = False,
    ) -> StepResult:
        traces = STEP_TRACES.get() or {}
        request = convert.decode_request_to_pb(
            batches, grown, look_ahead, traces, self._step_order()
        )
        return step_result(await self._all("Decode", request, traceparent_metadata(traces)))

    async def filter_batch(self, batch_id: int, request_ids: list[int]) -> CachedBatch:
        request = pb.FilterBatchRequest(batch_id=batch_id, request_ids=request_ids)
        return convert.cached_batch_from_pb((await self._all("FilterBatch", request))[0].batch)

    async def embed(self, inputs: list[EmbedInput]) -> list[Embedding]:
        """All ranks run the forward; rank 0 answers (the others' answers are empty)."""
        responses = await self._all("Embed", convert.embed_request_to_pb(inputs))
        return convert.embeddings_from_pb(responses[0])

    async def clear_cache(self, batch_id: int | None = None) -> None:
        await self._all("ClearCache", pb.ClearCacheRequest(id=batch_id))

    async def health(self) -> None:
        await self._all("Health", pb.HealthRequest())

    async def close(self) -> None:
        await asyncio.gather(*(channel.close() for channel in self.channels))


def traceparent_metadata(traces: dict[int, str]) -> tuple[tuple[str, str], ...] | None:
    """The first traced request's context as the standard W3C header, for shards that read only
    that (TGI's, through OpenTelemetry's gRPC instrumentation); ours read the `traceparents`
    field."""
    first = next(iter(traces.values()), None)
    return None if first is None else ((TRACEPARENT_METADATA_KEY, first),)


def is_unavailable(response) -> bool:
    return (
        isinstance(response, grpc.aio.AioRpcError)
        and response.code() == grpc.StatusCode.UNAVAILABLE
    )


def step_result(responses: list) -> StepResult:
    """Prefill/Decode answers of all ranks: their generations, and the batch as the first rank has
    it."""
    generations = [convert.generation_from_pb(g) for r in responses for g in r.generations]
    first = responses[0]
    return generations, convert.cached_batch_from_pb(first.batch) if first.HasField(
        "batch"
    ) else None


# --- in process: the same interface over an engine.serving.shard.Shard
# ---------------------------------


class InProcessClient:
    """A Shard in this process. Its methods are synchronous and not thread-safe: they run one at a
    time on a single worker thread, which keeps the event loop free while a step computes."""

    resumes = True

    def __init__(self, shard, max_batch_size: int | None = None, executor: Executor | None = None):
        """`executor`: where the shard's calls run, one at a time (default: a worker thread of
        its own; router/offline.py gives the thread that built the shard)."""
        self.shard, self.max_batch_size = shard, max_batch_size
        self.executor = executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard")
        self.seconds = {"prefill": 0.0, "decode": 0.0}  # time in the shard's steps, for the bench

    def on_shard_thread(self, fn):
        """fn() run on the shard's worker thread, between its steps (from any other thread but
        the event loop's, which it blocks)."""
        return self.executor.submit(fn).result()

    async def _call(self, name: str, fn, *args, **kwargs):
        loop = asyncio.get_running_loop()
        call = functools.partial(self._timed, name.lower(), fn, *args, **kwargs)
        try:
            return await loop.run_in_executor(self.executor, call)
        except Exception as error:  # noqa: BLE001 - the same ShardError the gRPC client raises
            code, message = status_for(error)
            raise ShardError(code, f"{name} on the in-process shard: {message}") from error

    def _timed(self, phase: str, fn, *args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            if phase in self.seconds:
                self.seconds[phase] += time.perf_counter() - start

    async def info(self) -> InfoResponse:
        return await self._call("Info", self.shard.info)

    async def warmup(
        self,
        batch: Batch | None,
        max_input_tokens: int | None,
        max_prefill_tokens: int,
        max_total_tokens: int | None,
    ) -> WarmupResult:
        # 0 means "no limit" on the wire; the shard wants None for that.
        return await self._call(
            "Warmup",
            self.shard.warmup,
            max_input_tokens,
            max_prefill_tokens or None,
            max_total_tokens,
            self.max_batch_size,
            copy.deepcopy(batch),
        )

    # The shard keeps the requests it was given: copies keep the router's later edits away from it,
    # as the wire would.
    async def prefill(
        self,
        batch: Batch,
        cached: CachedBatch | None = None,
        resume: dict[int, list[int]] | None = None,
    ) -> StepResult:
        return await self._call(
            "Prefill",
            self.shard.prefill,
            copy.deepcopy(batch),
            copy.deepcopy(cached),
            copy.deepcopy(resume),
        )

    async def decode(
        self,
        batches: list[CachedBatch],
        grown: dict[int, list[int]] | None = None,
        look_ahead: bool = False,
    ) -> StepResult:
        extra = (copy.deepcopy(grown),) if grown else ()
        result = await self._call("Decode", self.shard.decode, copy.deepcopy(batches), *extra)
        if look_ahead and result[1] is not None:  # the same worker: the next call waits for it
            self.executor.submit(self._timed, "decode", self.shard.look_ahead, result[1].id)
        return result

    async def filter_batch(self, batch_id: int, request_ids: list[int]) -> CachedBatch:
        return await self._call("FilterBatch", self.shard.filter, batch_id, list(request_ids))

    async def embed(self, inputs: list[EmbedInput]) -> list[Embedding]:
        return await self._call("Embed", self.shard.embed, copy.deepcopy(inputs))

    async def clear_cache(self, batch_id: int | None = None) -> None:
        await self._call("ClearCache", self.shard.clear, batch_id)

    async def health(self) -> None:
        await self._call("Health", self.shard.health)

    def serving_stats(self) -> dict[str, int] | None:
        return self.shard.serving_stats() if self.shard.runner is not None else None

    async def close(self) -> None:
        # Waits for a step in flight, off the event loop.
        await asyncio.get_running_loop().run_in_executor(None, self.executor.shutdown)
