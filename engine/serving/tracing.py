"""The shard's own step spans, on only with `--otlp-endpoint` (TGI's shards trace their steps the
same way).

A router that traces sends, with each Prefill or Decode, the span context of every traced request
in the step (the step request's `traceparents` field: request id -> W3C traceparent,
router/http/trace_steps.py). The shard records one `prefill_step` or `decode_step` span per such
request, a child of that request's phase span, covering the step as the shard ran it (attributes:
batch id and size, forward time). Off, nothing of OpenTelemetry is imported and the field is not
read.
"""

from __future__ import annotations


class StepTracer:
    def __init__(self, tracer, provider=None):
        self.tracer, self.provider = tracer, provider

    @classmethod
    def to_otlp(cls, endpoint: str, rank: int) -> StepTracer:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        provider = TracerProvider(
            resource=Resource.create({"service.name": "bucketserve-shard", "rank": rank})
        )
        provider.add_span_processor(
            BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True))
        )
        return cls(provider.get_tracer("bucketserve.shard"), provider)

    def record(
        self, name: str, traceparents: dict[int, str], start_ns: int, end_ns: int, attributes: dict
    ) -> None:
        """One span per traced request of the step. A traceparent that does not parse gives a span
        without a parent: tracing must never fail a step."""
        if not traceparents:
            return
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        for request_id, traceparent in traceparents.items():
            context = TraceContextTextMapPropagator().extract({"traceparent": traceparent})
            span = self.tracer.start_span(
                name,
                context=context,
                start_time=start_ns,
                attributes={**attributes, "request_id": str(request_id)},
            )
            span.end(end_time=end_ns)
