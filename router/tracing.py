"""OpenTelemetry tracing of requests, on only with `--otlp-endpoint`.

One span per HTTP request (named like the route, with the request id), and under it, once the request's
generations are done, one span each for the time it waited in the queue, its prefill (admission to the first
token) and its decode (first token to the last), from timestamps the scheduler and the stream already keep.

Off, it costs nothing: opentelemetry is not imported, no middleware is installed, and `traced` hands the
stream back untouched after one context-variable read.
"""
from __future__ import annotations

import contextvars
import time
from typing import AsyncIterator

from router.access import REQUEST_ID

# (the request's span, its tracer) while a traced request runs
SPAN: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("request_span", default=None)


class Tracing:
    def __init__(self, tracer, provider):
        self.tracer, self.provider = tracer, provider

    @classmethod
    def to_otlp(cls, endpoint: str) -> Tracing:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        return cls.with_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True)))

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
            token = SPAN.set((span, self.tracing.tracer))

            async def send_status(message):
                if message["type"] == "http.response.start":
                    span.set_attribute("http.response.status_code", message["status"])
                await send(message)

            try:
                await self.app(scope, receive, send_status)
            finally:
                SPAN.reset(token)


def install(app, tracing: Tracing | None) -> None:
    if tracing is not None:
        app.add_middleware(TracingMiddleware, tracing=tracing)


def traced(generations: AsyncIterator, stream, arrival: float) -> AsyncIterator:
    """`generations`, recording the queue, prefill and decode spans of the request when it is traced."""
    current = SPAN.get()
    if current is None:
        return generations
    return _phases(generations, stream, arrival, *current)


async def _phases(generations: AsyncIterator, stream, arrival: float, parent, tracer) -> AsyncIterator:
    first = last = None
    tokens = 0
    try:
        async for generation in generations:
            last = time.perf_counter()
            first = first or last
            tokens += len(generation.tokens.ids)
            yield generation
    finally:
        admitted = getattr(stream._entry, "admitted", None)
        _children(parent, tracer, arrival, admitted, first, last, tokens)


def _children(parent, tracer, arrival: float, admitted: float | None, first: float | None, last: float | None,
              tokens: int) -> None:
    from opentelemetry import trace

    context = trace.set_span_in_context(parent)
    phases = [("queue", arrival, admitted), ("prefill", admitted, first), ("decode", first, last)]
    for name, start, end in phases:
        if start is not None and end is not None:
            span = tracer.start_span(name, context=context, start_time=_epoch_ns(start))
            if name == "decode":
                span.set_attribute("generated_tokens", tokens)
            span.end(end_time=_epoch_ns(end))


def _epoch_ns(perf: float) -> int:
    """A perf_counter reading as wall-clock nanoseconds, which spans carry."""
    return time.time_ns() - int((time.perf_counter() - perf) * 1e9)
