"""OpenTelemetry tracing of requests, on only with `--otlp-endpoint`.

One span per HTTP request (named like the route, with the request id), and under it one span each
for the time it waited in the queue, its prefill (the Prefill step that admits it to its first
token) and its decode (first token to the last). The phase spans are opened and closed by the shard
steps themselves (router/http/trace_steps.py), whose step requests carry their context: the shards'
own step spans nest under them, as TGI's do.

Off, it costs nothing: opentelemetry is not imported, no middleware is installed, the scheduler's
client is not wrapped, and `traced` hands the stream back untouched after one context-variable read.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import AsyncIterator

from router.http.access import REQUEST_ID

# (the request's span, the Tracing) while a traced request runs
SPAN: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("request_span", default=None)


class Tracing:
    def __init__(self, tracer, provider):
        self.tracer, self.provider = tracer, provider
        self.client = None  # the scheduler's TracedClient, once installed

    @classmethod
    def to_otlp(cls, endpoint: str) -> Tracing:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        return cls.with_processor(
            BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True))
        )

    @classmethod
    def with_processor(cls, processor) -> Tracing:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider

        provider = TracerProvider(resource=Resource.create({"service.name": "bucketserve-router"}))
        provider.add_span_processor(processor)
        return cls(provider.get_tracer("bucketserve.router"), provider)


class TracingMiddleware:
    """The request's span, current (and in SPAN) while the route and its stream run."""

    def __init__(self, app, tracing: Tracing):
        self.app, self.tracing = app, tracing

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        from opentelemetry import trace

        name = f"{scope['method']} {scope['path']}"
        with self.tracing.tracer.start_as_current_span(name, kind=trace.SpanKind.SERVER) as span:
            span.set_attribute("http.request.method", scope["method"])
            span.set_attribute("url.path", scope["path"])
            span.set_attribute("request_id", REQUEST_ID.get())
            token = SPAN.set((span, self.tracing))

            async def send_status(message):
                if message["type"] == "http.response.start":
                    span.set_attribute("http.response.status_code", message["status"])
                await send(message)

            try:
                await self.app(scope, receive, send_status)
            finally:
                SPAN.reset(token)


@contextlib.contextmanager
def child_span(name: str, **attributes):
    """A span of `name` under the traced request's span; nothing when the request is not traced."""
    current = SPAN.get()
    if current is None:
        yield
        return
    with current[1].tracer.start_as_current_span(name) as span:
        for key, value in attributes.items():
            span.set_attribute(key, value)
        yield


def install(app, tracing: Tracing | None, scheduler=None) -> None:
    if tracing is not None:
        app.add_middleware(TracingMiddleware, tracing=tracing)
        if scheduler is not None:
            from router.http.trace_steps import TracedClient

            tracing.client = scheduler.client = TracedClient(scheduler.client, tracing.tracer)


def traced(generations: AsyncIterator, stream, arrival: float) -> AsyncIterator:
    """`generations`, recording the queue, prefill and decode spans of the request when it is
    traced."""
    current = SPAN.get()
    if current is None:
        return generations
    from router.http.trace_steps import RequestTrace

    parent, tracing = current
    trace = RequestTrace(parent)
    if (
        tracing.client is not None
    ):  # its steps open and close the prefill and decode spans; registered now,
        tracing.client.requests[stream._entry.id] = (
            trace  # before the scheduler can admit the request
        )
    return _phases(generations, stream, arrival, trace, tracing)


async def _phases(
    generations: AsyncIterator, stream, arrival: float, trace, tracing: Tracing
) -> AsyncIterator:
    from router.http.trace_steps import end

    parent = trace.parent
    try:
        async for generation in generations:
            yield generation
    finally:
        if tracing.client is not None:
            tracing.client.requests.pop(stream._entry.id, None)
        admitted = getattr(stream._entry, "admitted", None)
        if admitted is not None:
            _queue_span(parent, tracing.tracer, arrival, admitted)
        for phase in (
            "prefill",
            "decode",
        ):  # a cancelled or failed request's open span ends with it
            end(trace, phase)


def _queue_span(parent, tracer, arrival: float, admitted: float) -> None:
    from opentelemetry import trace

    span = tracer.start_span(
        "queue", context=trace.set_span_in_context(parent), start_time=_epoch_ns(arrival)
    )
    span.end(end_time=_epoch_ns(admitted))


def _epoch_ns(perf: float) -> int:
    """A perf_counter reading as wall-clock nanoseconds, which spans carry."""
    return time.time_ns() - int((time.perf_counter() - perf) * 1e9)
