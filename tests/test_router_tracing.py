"""OpenTelemetry tracing: an in-process router (real scheduler, real shard) with the SDK's in-memory exporter.
The openai client talks to the app through httpx's ASGI transport."""

import asyncio

import httpx
import openai
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from engine.serving.server import ServerConfig, ShardServer
from engine.serving.tracing import StepTracer
from router.app import RouterConfig, build_state, create_app
from router.client import GrpcShardClient, InProcessClient
from router.http import tracing
from router.http.access import AccessConfig
from tests.helpers import shard_fixture
from tests.test_server import BackgroundServer, short_socket_dir

shard = shard_fixture(max_batch_size=4)


async def serve_and_call(shard, model_dir, traces, calls, shard_client=None):
    config = RouterConfig(
        tokenizer=str(model_dir),
        model_id="tiny",
        max_input_tokens=64,
        max_total_tokens=128,
        max_prefill_tokens=128,
        max_batch_size=4,
    )
    state = await build_state(config, shard_client or InProcessClient(shard, max_batch_size=4))
    try:
        app = create_app(state, AccessConfig(), traces)
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router")
        client = openai.AsyncOpenAI(
            base_url="http://router/v1", api_key="x", http_client=http, max_retries=0
        )
        return await calls(client, app)
    finally:
        await state.scheduler.stop()


def test_request_span_has_queue_prefill_and_decode_children(shard, tiny_model_dirs):
    exporter = InMemorySpanExporter()
    traces = tracing.Tracing.with_processor(SimpleSpanProcessor(exporter))

    async def calls(client, app):
        response = await client.chat.completions.with_raw_response.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0
        )
        stream = await client.completions.create(
            model="tiny", prompt="Hello", max_tokens=4, stream=True
        )
        _ = [chunk async for chunk in stream]
        return response.headers["x-request-id"]

    request_id = asyncio.run(serve_and_call(shard, tiny_model_dirs["llama"], traces, calls))
    spans = exporter.get_finished_spans()
    roots = [s for s in spans if s.parent is None]
    assert sorted(s.name for s in roots) == ["POST /v1/chat/completions", "POST /v1/completions"]
    chat = next(s for s in roots if s.name == "POST /v1/chat/completions")
    assert (
        chat.attributes["request_id"] == request_id
        and chat.attributes["http.response.status_code"] == 200
    )
    for root in roots:
        children = sorted(
            (s for s in spans if s.parent is not None and s.parent.span_id == root.context.span_id),
            key=lambda s: s.start_time,
        )
        assert [s.name for s in children] == ["queue", "prefill", "decode"]
        assert all(s.context.trace_id == root.context.trace_id for s in children)
        assert root.start_time <= children[0].start_time and children[-1].end_time <= root.end_time
        assert (
            children[0].end_time <= children[1].start_time + 1000
            and children[1].end_time <= children[2].start_time + 1000
        )
        assert children[2].attributes["generated_tokens"] >= 1


def test_off_means_no_middleware_and_an_untouched_stream(shard, tiny_model_dirs):
    async def calls(client, app):
        assert "TracingMiddleware" not in [m.cls.__name__ for m in app.user_middleware]
        assert tracing.SPAN.get() is None
        stream = object()
        assert tracing.traced(stream, None, 0.0) is stream
        return (
            (await client.completions.create(model="tiny", prompt="Hi", max_tokens=2))
            .choices[0]
            .text
        )

    assert isinstance(
        asyncio.run(serve_and_call(shard, tiny_model_dirs["llama"], None, calls)), str
    )


class TracedShardServer(BackgroundServer):
    """The in-process gRPC shard server, recording its step spans with the router's exporter."""

    def __init__(self, shard, config, tracer):
        self.tracer = tracer
        super().__init__(shard, config)

    def _create(self, shard, config):
        async def create():
            return ShardServer(shard, config, self.tracer)

        return create()


def spy_on_steps(grpc_client, seen: list) -> None:
    """Append (RPC, its metadata, its traceparents field) of each Prefill and Decode it sends."""
    original = grpc_client._all

    async def spy(method, request, metadata=None):
        if method in ("Prefill", "Decode"):
            seen.append((method, metadata, dict(request.traceparents)))
        return await original(method, request, metadata)

    grpc_client._all = spy


def test_shard_step_spans_nest_under_the_router_phases_through_the_step_requests(
    shard, tiny_model_dirs
):
    exporter = InMemorySpanExporter()
    traces = tracing.Tracing.with_processor(SimpleSpanProcessor(exporter))
    config = ServerConfig(uds_path=str(short_socket_dir() / "tr"))
    server = TracedShardServer(
        shard, config, StepTracer(traces.provider.get_tracer("bucketserve.shard"))
    )

    async def calls(client, app):
        await asyncio.gather(
            *(
                client.completions.create(model="tiny", prompt=p, max_tokens=4, temperature=0)
                for p in ("Hello", "The quick brown fox")
            )
        )

    async def over_grpc():
        grpc_client = GrpcShardClient(config.urls())
        spy_on_steps(grpc_client, seen)
        try:
            return await serve_and_call(shard, tiny_model_dirs["llama"], traces, calls, grpc_client)
        finally:
            await grpc_client.close()

    seen = []
    try:
        asyncio.run(over_grpc())
    finally:
        server.close()
    # Each traced step names its requests' contexts in the field (ours read it), and the first of
    # them in the standard `traceparent` header (TGI's shards read that).
    assert {"Prefill", "Decode"} <= {method for method, _, _ in seen}
    for _method, metadata, traceparents in seen:
        assert traceparents and metadata == (("traceparent", next(iter(traceparents.values()))),)
    spans = exporter.get_finished_spans()
    by_id = {s.context.span_id: s for s in spans}
    roots = [s for s in spans if s.parent is None]
    assert len(roots) == 2
    for root in roots:
        phases = {
            s.name: s
            for s in spans
            if s.parent is not None and s.parent.span_id == root.context.span_id
        }
        assert set(phases) == {"queue", "prefill", "decode"}
        steps = [
            s
            for s in spans
            if s.name.endswith("_step") and by_id.get(s.parent.span_id) in phases.values()
        ]
        under = {
            name: [s for s in steps if s.parent.span_id == phases[name].context.span_id]
            for name in ("prefill", "decode")
        }
        assert [s.name for s in under["prefill"]] == ["prefill_step"]
        assert len(under["decode"]) == 3 and {s.name for s in under["decode"]} == {
            "decode_step"
        }  # 4 tokens: 3 decodes
        assert all(s.context.trace_id == root.context.trace_id for s in steps)
        assert all(
            phases[name].start_time <= s.start_time and s.end_time <= phases[name].end_time
            for name in under
            for s in under[name]
        )


def test_off_sends_no_trace_context_and_the_shard_records_nothing(shard, tiny_model_dirs):
    config = ServerConfig(uds_path=str(short_socket_dir() / "off"))
    server = BackgroundServer(shard, config)
    assert server.server.servicer.tracer is None
    seen = []

    async def calls(client, app):
        spy_on_steps(grpc_client, seen)
        return await client.completions.create(model="tiny", prompt="Hi", max_tokens=3)

    async def over_grpc():
        nonlocal grpc_client
        grpc_client = GrpcShardClient(config.urls())
        try:
            return await serve_and_call(shard, tiny_model_dirs["llama"], None, calls, grpc_client)
        finally:
            await grpc_client.close()

    grpc_client = None
    try:
        asyncio.run(over_grpc())
    finally:
        server.close()
    assert {"Prefill", "Decode"} <= {m for m, _, _ in seen}
    assert all(metadata is None and traceparents == {} for _, metadata, traceparents in seen)
