"""The shard's own step spans, on only with `--otlp-endpoint` (TGI's shards trace their steps the same way).

A router that traces sends, with each Prefill or Decode, the span context of every traced request in the
step (metadata `bucketserve-traces`: `{request_id: W3C traceparent}`, router/http/trace_steps.py). The shard
records one `prefill_step` or `decode_step` span per such request, a child of that request's phase span,
covering the step as the shard ran it (attributes: batch id and size, forward time). Off, nothing of
OpenTelemetry is imported and the metadata is not read.
"""
from __future__ import annotations

import json
import logging

TRACES_METADATA_KEY = "bucketserve-traces"
log = logging.getLogger(__name__)


class StepTracer:
    def __init__(self, tracer, provider=None):
        self.tracer, self.provider = tracer, provider

    @classmethod
    def to_otlp(cls, endpoint: str, rank: int) -> StepTracer:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        provider = TracerProvider(resource=Resource.create({"service.name": "bucketserve-shard", "rank": rank}))
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True)))
        return cls(provider.get_tracer("bucketserve.shard"), provider)

    def record(self, name: str, metadata, start_ns: int, end_ns: int, attributes: dict) -> None:
        """One span per traced request of the step; malformed metadata is logged and ignored (tracing
        must never fail a step)."""
        parents = _parents(metadata)
        if not parents:
            return
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        for request_id, traceparent in parents.items():
            context = TraceContextTextMapPropagator().extract({"traceparent": traceparent})
            span = self.tracer.start_span(name, context=context, start_time=start_ns,
                                          attributes={**attributes, "request_id": request_id})
            span.end(end_time=end_ns)


def _parents(metadata) -> dict[str, str]:
    value = next((v for k, v in metadata or () if k == TRACES_METADATA_KEY), None)
    if value is None:
        return {}
    try:
        parents = json.loads(value)
        if isinstance(parents, dict) and all(isinstance(v, str) for v in parents.values()):
            return parents
    except ValueError:
        pass
    log.warning("ignoring malformed %s metadata", TRACES_METADATA_KEY)
    return {}
