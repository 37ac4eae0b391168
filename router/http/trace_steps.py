"""A traced request's `prefill` and `decode` spans, opened and closed by the shard steps themselves,
and their context sent to the shards with each step so that the shards' own step spans nest under
them.

Installed only with `--otlp-endpoint` (router/http/tracing.py wraps the scheduler's client in
`TracedClient`). A step names, for each traced request it carries, that request's open phase span:
the step request's `traceparents` field holds `{request_id: W3C traceparent}`, and the gRPC metadata
`traceparent` (the standard header, what TGI's shards' OpenTelemetry interceptor reads) the first of
them (router/client.py sends both). A request's `prefill` span runs from the Prefill that admits it
to the step that answers its first token, its `decode` span from there to its last.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from engine.batch import Batch, CachedBatch
from router.client import STEP_TRACES

# Requests named per step: the shard records a span for each one in every step, so a large traced
# batch is capped; the rest of it goes without shard spans.
MAX_TRACED_PER_STEP = 64


@dataclass
class RequestTrace:
    """The spans of one traced request; what is still open when its stream ends is ended there."""

    parent: object  # the request's span
    prefill: object = None
    decode: object = None
    tokens: int = 0
    ended: set = field(default_factory=set)


class TracedClient:
    """The scheduler's shard client, with each traced request's phase spans around its steps."""

    def __init__(self, client, tracer):
        self.client, self.tracer = client, tracer
        self.requests: dict[
            int, RequestTrace
        ] = {}  # filled by router.http.tracing.traced, emptied by its stream

    def __getattr__(self, name):
        return getattr(self.client, name)

    async def prefill(self, batch: Batch, cached: CachedBatch | None = None, resume=None):
        traced = {r.id: self.requests[r.id] for r in batch.requests if r.id in self.requests}
        for trace in traced.values():
            trace.prefill = trace.prefill or self._start("prefill", trace.parent)
        extra = (resume,) if resume else ()
        result = await self._call(
            self.client.prefill, {i: t.prefill for i, t in traced.items()}, batch, cached, *extra
        )
        self._advance(traced, result[0])
        return result

    async def decode(self, batches: list[CachedBatch], grown=None, **options):
        """A decode step; a chunked prompt's later chunks run here too, under its still open
        `prefill`."""
        ids = [i for b in batches for i in b.request_ids]
        traced = {i: self.requests[i] for i in ids if i in self.requests}
        spans = {
            i: t.decode or t.prefill
            for i, t in traced.items()
            if (t.decode or t.prefill) is not None
        }
        extra = (grown,) if grown else ()
        result = await self._call(
            functools.partial(self.client.decode, **options), spans, batches, *extra
        )
        self._advance(traced, result[0])
        return result

    async def _call(self, method, spans: dict, *args):
        token = STEP_TRACES.set(step_traceparents(spans))
        try:
            return await method(*args)
        finally:
            STEP_TRACES.reset(token)

    def _advance(self, traced: dict[int, RequestTrace], generations) -> None:
        """The first token ends `prefill` and opens `decode`; the last ends `decode`."""
        for generation in generations:
            trace = traced.get(generation.request_id)
            if trace is None:
                continue
            trace.tokens += len(generation.tokens.ids)
            if trace.prefill is not None and "prefill" not in trace.ended:
                end(trace, "prefill")
                trace.decode = self._start("decode", trace.parent)
            if generation.generated_text is not None:
                end(trace, "decode")
                self.requests.pop(
                    generation.request_id, None
                )  # its stream may never be read to its end

    def _start(self, name: str, parent):
        from opentelemetry import trace

        return self.tracer.start_span(name, context=trace.set_span_in_context(parent))


def end(trace: RequestTrace, phase: str) -> None:
    span = getattr(trace, phase)
    if span is not None and phase not in trace.ended:
        if phase == "decode":
            span.set_attribute("generated_tokens", trace.tokens)
        span.end()
        trace.ended.add(phase)


def step_traceparents(spans: dict) -> dict[int, str]:
    """The W3C traceparent of each request's open phase span, for the shards."""
    if not spans:
        return {}
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    parents = {}
    for request_id, span in list(spans.items())[:MAX_TRACED_PER_STEP]:
        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(carrier, context=trace.set_span_in_context(span))
        parents[request_id] = carrier["traceparent"]
    return parents
