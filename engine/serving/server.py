"""The gRPC server of one shard: TGI's generate.v3 over a unix socket, a thin layer over `Shard`.

Every RPC translates protobuf to the engine's dataclasses (engine/wire/convert.py), runs the shard
method in a single-worker executor (the shard is synchronous and not thread-safe, and the event
loop must stay free to answer other RPCs meanwhile) and maps the shard's errors to gRPC status
codes (engine/wire/contract.py). An error never stops the server: the next RPC is served as usual.
Our extensions of generate.v3 are proto fields (proto/CONTRACT.md): resumed tokens on a Prefill's
requests, lookahead and trace contexts on the step requests, serving stats on the step responses.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from engine.errors import BucketserveError
from engine.serving.remote import caller_refusal, group_urls, tcp_target
from engine.wire import convert
from engine.wire import generate_pb2 as pb
from engine.wire import generate_pb2_grpc as pb_grpc
from engine.wire.contract import MAX_MESSAGE_BYTES, status_for

log = logging.getLogger(__name__)

DEFAULT_UDS_PATH = "/tmp/text-generation-server"
PARENT_POLL_S = 0.5


@dataclass(frozen=True)
class ServerConfig:
    uds_path: str = DEFAULT_UDS_PATH  # base path: rank r listens on f"{uds_path}-{r}"
    port: int | None = None  # also listen on this TCP port when given
    hostname: str = "127.0.0.1"  # the TCP port's address: loopback unless asked otherwise
    parent_pid: int | None = None  # stop when this process (the launcher) is gone
    rank: int = 0
    world_size: int = 1
    max_batch_size: int | None = (
        None  # Warmup's batch limit (TGI: MAX_BATCH_SIZE); None: the shard's config
    )
    max_message_bytes: int = MAX_MESSAGE_BYTES
    grace_seconds: float = 5.0  # in-flight RPCs may finish this long after SIGTERM
    otlp_endpoint: str | None = (
        None  # record step spans (engine/serving/tracing.py); None: no tracing
    )
    # Multi-node (engine/serving/remote.py): also listen on this address for the other nodes,
    # whose calls must carry `secret`; `node_rank`: which node this rank runs on.
    remote_address: str | None = None
    remote_port: int = 0  # 0: one the OS picks
    secret: str | None = None
    node_rank: int = 0

    def __post_init__(self):
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"rank {self.rank} is not in 0..world_size-1 (world_size={self.world_size})"
            )

    def socket_path(self, rank: int | None = None) -> str:
        return f"{self.uds_path}-{self.rank if rank is None else rank}"

    def urls(self) -> list[str]:
        return [f"unix://{self.socket_path(r)}" for r in range(self.world_size)]


def rpc(handler):
    """Log the RPC, and turn any exception into a gRPC status so the server keeps serving."""

    @functools.wraps(handler)
    async def wrapper(self, request, context):
        name, start = handler.__name__, time.perf_counter()
        refusal = caller_refusal(self.config.secret, context)
        if refusal is not None:
            log.warning("%s refused from %s: no valid shard secret", name, context.peer())
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, refusal)
        try:
            response = await handler(self, request, context)
        except Exception as error:  # noqa: BLE001 - every error becomes a status, none ends the server
            code, message = status_for(error)
            # A traceback only for INTERNAL: the others are the caller's mistake, not ours.
            log.warning(
                "%s failed with %s: %s",
                name,
                code.name,
                message,
                exc_info=code == grpc.StatusCode.INTERNAL,
            )
            await context.abort(code, message)
        log.debug("%s%s in %.1f ms", name, describe(request), (time.perf_counter() - start) * 1e3)
        return response

    return wrapper


def describe(request) -> str:
    """A short summary of a request for the per-RPC log line ("" when there is nothing to say)."""
    if isinstance(request, (pb.PrefillRequest, pb.WarmupRequest)):
        return f" batch={request.batch.id} requests={len(request.batch.requests)}"
    if isinstance(request, pb.DecodeRequest):
        return f" batches={[b.id for b in request.batches]}"
    if isinstance(request, pb.EmbedRequest):
        return f" inputs={len(request.inputs)}"
    if isinstance(request, pb.FilterBatchRequest):
        return f" batch={request.batch_id} keep={len(request.request_ids)}"
    return ""


class ShardServicer(pb_grpc.TextGenerationServiceServicer):
    def __init__(self, shard, config: ServerConfig, tracer=None):
        self.shard, self.config, self.tracer = shard, config, tracer
        # One worker: shard calls run one at a time, in arrival order, off the event loop. A
        # pipeline shard holds a step per stage at once (engine/pipeline/turns.py): a worker each,
        # and one call at a time runs shard code, the one that holds the turn.
        self.turns = getattr(shard, "turns", None)
        workers = 1 if self.turns is None else shard.pipe.stages + 2
        self.executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="shard")
        self.urls = config.urls()  # every rank's, as this one reaches it (multi-node: remote.py)

    async def call(self, fn, *args, order: int = 0, **kwargs):
        loop = asyncio.get_running_loop()
        work = functools.partial(fn, *args, **kwargs)
        if self.turns is not None:
            work = functools.partial(self._in_turn, order, work)
        return await loop.run_in_executor(self.executor, work)

    def _in_turn(self, order: int, work):
        with self.turns.turn(order):
            return work()

    async def step(self, fn, *args, request, batch_id: int = 0):
        """A prefill or decode on the shard's worker, with the timings the shard recorded for it
        and its serving stats after it; a span per traced request of `request` if tracing is on.
        A pipeline shard starts it in the router's order (`step_order`)."""

        def run():
            return fn(*args), self.shard.last_timings, self.shard.serving_stats()

        start = time.time_ns()
        result = await self.call(run, order=getattr(request, "step_order", 0))
        if self.tracer is not None:
            size = len(result[0][0])
            self.tracer.record(
                f"{fn.__name__}_step",
                convert.traceparents_from_pb(request),
                start,
                time.time_ns(),
                {"batch_id": batch_id, "generations": size, "forward_ns": result[1].forward_ns},
            )
        return result

    @rpc
    async def Info(self, request, context):
        return convert.info_to_pb(await self.call(self.shard.info))

    @rpc
    async def ServiceDiscovery(self, request, context):
        return pb.ServiceDiscoveryResponse(urls=self.urls)

    @rpc
    async def ClearCache(self, request, context):
        await self.call(self.shard.clear, convert.optional_field(request, "id"))
        return pb.ClearCacheResponse()

    @rpc
    async def FilterBatch(self, request, context):
        cached = await self.call(self.shard.filter, request.batch_id, list(request.request_ids))
        return pb.FilterBatchResponse(batch=convert.cached_batch_to_pb(cached))

    @rpc
    async def Warmup(self, request, context):
        limits = dict(
            max_input_tokens=convert.optional_field(request, "max_input_tokens"),
            # Not optional on the wire: 0 means the router gave no limit.
            max_prefill_tokens=request.max_prefill_tokens or None,
            max_total_tokens=convert.optional_field(request, "max_total_tokens"),
            max_batch_size=self.config.max_batch_size,
            # TGI's warmup batch switches on every logits processor: the shard runs it once.
            batch=convert.batch_from_pb(request.batch) if request.HasField("batch") else None,
        )
        return convert.warmup_to_pb(await self.call(self.shard.warmup, **limits))

    @rpc
    async def Prefill(self, request, context):
        batch = convert.batch_from_pb(request.batch)
        cached = (
            convert.cached_batch_from_pb(request.cached_batch)
            if request.HasField("cached_batch")
            else None
        )
        resume = convert.resume_from_pb(request)
        extra = (resume,) if resume else ()  # only resumes need the shard to know of them
        result, timings, stats = await self.step(
            self.shard.prefill, batch, cached, *extra, request=request, batch_id=batch.id
        )
        return step_response(pb.PrefillResponse, result, timings, stats)

    @rpc
    async def Decode(self, request, context):
        batches = [convert.cached_batch_from_pb(b) for b in request.batches]
        grown = convert.grown_from_pb(request)
        extra = (grown,) if grown else ()
        result, timings, stats = await self.step(
            self.shard.decode,
            batches,
            *extra,
            request=request,
            batch_id=batches[0].id if batches else 0,
        )
        cached = result[1]
        # A pipeline shard runs no lookahead: it would start out of the steps' order (the router
        # keeps a batch per stage in flight instead).
        if cached is not None and request.look_ahead and self.turns is None:
            self.executor.submit(
                self.shard.look_ahead, cached.id
            )  # queued before the answer leaves
        return step_response(pb.DecodeResponse, result, timings, stats)

    @rpc
    async def Health(self, request, context):
        await self.call(self.shard.health)
        return pb.HealthResponse()

    @rpc
    async def Embed(self, request, context):
        """Every rank runs the forward (its collectives need them all); rank 0 answers."""

        def run():
            return self.shard.embed(
                convert.embed_inputs_from_pb(request)
            ), self.shard.serving_stats()

        return convert.embeddings_to_pb(*await self.call(run))


def step_response(kind, result, timings, stats: dict[str, int]):
    """A Prefill/DecodeResponse with the shard's own step timings, and its serving stats in the
    `stats` extension field (TGI's router skips it; ours reports it as metrics)."""
    generations, cached = result
    return kind(
        generations=[convert.generation_to_pb(g) for g in generations],
        batch=convert.cached_batch_to_pb(cached) if cached is not None else None,
        forward_ns=timings.forward_ns,
        decode_ns=timings.decode_ns,
        total_ns=timings.total_ns,
        concat_ns=timings.concat_ns,
        stats=convert.stats_to_pb(stats),
    )


class ShardServer:
    """A grpc.aio server for one shard: bound on start, its socket removed on stop."""

    def __init__(self, shard, config: ServerConfig, tracer=None):
        self.config, self.shard = config, shard
        if tracer is None and config.otlp_endpoint:
            from engine.serving.tracing import StepTracer

            tracer = StepTracer.to_otlp(config.otlp_endpoint, config.rank)
        self.servicer = ShardServicer(shard, config, tracer)
        limit = config.max_message_bytes
        self.server = grpc.aio.server(
            options=[
                ("grpc.max_send_message_length", limit),
                ("grpc.max_receive_message_length", limit),
            ]
        )
        pb_grpc.add_TextGenerationServiceServicer_to_server(self.servicer, self.server)

    async def start(self) -> None:
        path = self.config.socket_path()
        remove_stale_socket(path)
        self._listen(f"unix://{path}")
        if self.config.port is not None:
            host = self.config.hostname
            self._listen(
                f"[{host}]:{self.config.port}" if ":" in host else f"{host}:{self.config.port}"
            )
        if self.config.remote_address is not None:
            self._listen_for_other_nodes(f"unix://{path}")
        await self.server.start()
        log.info(
            "shard %d/%d serving generate.v3 on unix://%s%s",
            self.config.rank,
            self.config.world_size,
            path,
            f" and TCP {self.config.hostname}:{self.config.port}"
            if self.config.port is not None
            else "",
        )

    def _listen(self, address: str) -> int:
        try:
            bound = self.server.add_insecure_port(address)
        except RuntimeError as error:  # grpc raises on a failed bind; older versions returned 0
            raise BucketserveError(f"cannot listen on {address}: {error}") from None
        if not bound:
            raise BucketserveError(f"cannot listen on {address}")
        return bound

    def _listen_for_other_nodes(self, unix_url: str) -> None:
        """A TCP port of the OS's choosing, and every rank's URL learnt from the others (every
        rank of the group gets here once, after its model loaded)."""
        if not self.config.secret:
            raise BucketserveError(
                "a multi-node shard listens on TCP for the other nodes: give the group a "
                "--shard-secret (or $BUCKETSERVE_SHARD_SECRET)"
            )
        address = self.config.remote_address
        port = self._listen(tcp_target(address, self.config.remote_port))
        self.servicer.urls = group_urls(
            self.shard.world, self.config.node_rank, unix_url, tcp_target(address, port)
        )
        log.info("shard %d: the other nodes reach it on TCP %s", self.config.rank, port)

    async def stop(self) -> None:
        """Let in-flight RPCs finish (up to the grace period), then drop the socket file."""
        await self.server.stop(self.config.grace_seconds)
        self.servicer.executor.shutdown(wait=False, cancel_futures=True)
        # grpc removes it too in current versions;
        # a launcher watching the path must not depend on that
        try:
            os.unlink(self.config.socket_path())
        except FileNotFoundError:
            pass


def remove_stale_socket(path: str) -> None:
    """Replace the socket of a shard that died (explicitly: not every grpc version unlinks it before
    binding); anything else at that path is not ours to delete."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise BucketserveError(f"{path} exists and is not a socket: refusing to replace it")
    os.unlink(path)


async def serve(shard, config: ServerConfig) -> None:
    """Serve until SIGTERM or SIGINT (or the launcher is gone), then stop gracefully."""
    server = ShardServer(shard, config)
    await server.start()
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopping.set)
    watcher = (
        loop.create_task(watch_parent(config.parent_pid, stopping)) if config.parent_pid else None
    )
    try:
        await stopping.wait()
        log.info("shard %d: stopping", config.rank)
    finally:
        if watcher is not None:
            watcher.cancel()
        await server.stop()
        # Progressive warmup's thread must end before the interpreter does: a thread still inside
        # a torch kernel at exit aborts the process ("terminate called without an active
        # exception").
        await loop.run_in_executor(None, shard.close)


async def watch_parent(parent_pid: int, stopping: asyncio.Event) -> None:
    """A launcher that was SIGKILLed cannot stop its shards: each notices it has a new parent."""
    while os.getppid() == parent_pid:
        await asyncio.sleep(PARENT_POLL_S)
    log.warning("the launcher (pid %d) is gone: stopping", parent_pid)
    stopping.set()
