"""What every HTTP route shares: the router's state, one error mapping for every route and
stream, and submitting a request to the scheduler and collecting or streaming what comes back.
The TGI routes (tgi_api.py) and the OpenAI routes (openai_api.py) are peers built on this."""
from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import grpc
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse

from engine.batch import Generation, Request
from router.client import ShardError
from router.metrics import RouterMetrics
from router.scheduler import Overloaded, RequestCancelled, Scheduler, ShardsUnavailable
from router.tracing import traced
from router.validation import Limits, Parameters, ValidationError, build_request


@dataclass
class RouterState:
    scheduler: Scheduler
    tokenizer: Any
    client: Any
    info: dict
    metrics: RouterMetrics
    ids: itertools.count = field(default_factory=lambda: itertools.count(1))

    @property
    def limits(self) -> Limits:
        return Limits(self.info["max_input_tokens"], self.info["max_total_tokens"],
                      tuple(self.info.get("lora_adapters") or ()))


# --- errors: one mapping for every route ----------------------------------------------------------

# (exception, HTTP status, TGI error_type, metrics outcome); checked in order.
ERRORS = [(ValidationError, 422, "validation", "validation"), (Overloaded, 429, "overloaded", "overloaded"),
          (ShardsUnavailable, 503, "unavailable", "unavailable"),
          (RequestCancelled, 499, "cancelled", "cancelled")]


def classify(error: Exception) -> tuple[int, str, str]:
    if isinstance(error, ShardError):
        if error.code == grpc.StatusCode.INVALID_ARGUMENT:  # e.g. a grammar the shard cannot compile
            return 422, "validation", "validation"
        if error.code == grpc.StatusCode.UNAVAILABLE:
            return 503, "unavailable", "unavailable"
    for kind, status, error_type, outcome in ERRORS:
        if isinstance(error, kind):
            return status, error_type, outcome
    return 424, "generation", "error"  # TGI's status for a failed generation


def error_body(message: str, error_type: str) -> dict:
    return {"error": message, "error_type": error_type}


def error_payload(error: Exception) -> dict:
    """TGI's error body for `error`: a shard's own message (without the status name), else the text."""
    message = error.message if isinstance(error, ShardError) else str(error)
    return error_body(message, classify(error)[1])


def error_response(state: RouterState, error: Exception) -> JSONResponse:
    status, _, outcome = classify(error)
    state.metrics.outcome(outcome)
    return JSONResponse(error_payload(error), status_code=status)


# --- running a request ------------------------------------------------------------------------------


def submit(state: RouterState, inputs: str, parameters: Parameters, add_special_tokens: bool = True
           ) -> tuple[AsyncIterator[Generation], int, Any]:
    """Validate and queue; the stream of generations (timed for metrics), the prompt length, and the
    scheduler's stream (to close on a disconnect)."""
    request, length = build_request(next(state.ids), state.tokenizer, state.limits, inputs, parameters,
                                    add_special_tokens)
    return queue(state, request, length)


def queue(state: RouterState, request: Request, length: int):
    arrival = time.perf_counter()
    try:
        stream = state.scheduler.submit(request, length)
    except ValueError as error:
        raise ValidationError(str(error)) from None
    return traced(state.metrics.timed(stream, arrival), stream, arrival), length, stream


async def collect(state: RouterState, generations: AsyncIterator[Generation], stream) -> list[Generation]:
    try:
        result = [g async for g in generations]
    finally:
        stream.close()
    state.metrics.outcome("success")
    return result


async def events(state: RouterState, http_request: HttpRequest, generations, stream, render, on_error):
    """Server-sent events: `render(generation)` gives each generation's events. A client that goes
    away cancels its request and frees its blocks; a failure becomes a last error event."""
    outcome = "cancelled"  # unless the stream reaches its end: the client went away
    try:
        async for generation in generations:
            if await http_request.is_disconnected():
                return  # also for servers whose send() ignores a closed connection instead of raising
            for event in render(generation):
                yield event
        outcome = "success"
    except Exception as error:  # noqa: BLE001 - reported in the stream: the status line is already sent
        outcome = classify(error)[2]
        yield on_error(error)
    finally:
        state.metrics.outcome(outcome)
        stream.close()


def finite(logprob: float | None) -> float | None:
    return logprob if logprob is not None and math.isfinite(logprob) else None
