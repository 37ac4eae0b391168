"""What every HTTP route shares: the router's state, and submitting a request to the scheduler and
collecting or streaming what comes back. The TGI routes (tgi_api.py) and the OpenAI routes
(openai_api.py) are peers built on this; router/http/errors.py gives every failure its answer."""

from __future__ import annotations

import asyncio
import functools
import itertools
import math
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse

from engine.batch import Generation, Request
from router.http import errors
from router.http.errors import classify, error_body, error_payload  # noqa: F401 - the routes' error helpers
from router.http.grammar_check import GrammarCheck
from router.http.metrics import RouterMetrics
from router.http.reasoning import Parser
from router.http.tracing import traced
from router.http.validation import (
    Limits,
    Parameters,
    ValidationError,
    build_request,
    longest_token_chars,
)
from router.images.prompt import ImagePolicy, keyed_prompt_ids
from router.sched import fanout
from router.sched.scheduler import Scheduler

# How often a stream asks whether its client is still there. Uvicorn's own listener cancels a
# stream whose client left; the question is for servers that do not, and costs too much to ask at
# every token (anyio's cancel scope: 60 of 220 streaming samples of a lone request in py-spy).
DISCONNECT_CHECK_S = 0.25
# Tokenizing and chat templating run here, off the event loop: a long prompt must not stall streams.
VALIDATION_WORKERS = 2


@dataclass
class RouterState:
    scheduler: Scheduler
    tokenizer: Any
    client: Any
    info: dict
    metrics: RouterMetrics
    ids: itertools.count = field(default_factory=lambda: itertools.count(1))
    executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(
            VALIDATION_WORKERS, thread_name_prefix="validation"
        )
    )
    grammar_check: GrammarCheck | None = None
    token_chars: int | None = (
        None  # the longest token's length in characters: bounds a prompt's token count
    )
    images: ImagePolicy | None = None  # the model's images (None, or spec None: a text model)
    reasoning: Parser | None = None  # --reasoning-parser's, for this model's chat template

    def __post_init__(self):
        if self.grammar_check is None:
            self.grammar_check = GrammarCheck(self.tokenizer)
        if self.token_chars is None:
            self.token_chars = longest_token_chars(self.tokenizer)

    @property
    def limits(self) -> Limits:
        return Limits(
            self.info["max_input_tokens"],
            self.info["max_total_tokens"],
            tuple(self.info.get("lora_adapters") or ()),
            self.token_chars,
        )

    async def offload(self, fn, *args, **kwargs):
        """Run `fn` on a validation thread (a CPU-bound call must not block the event loop)."""
        return await asyncio.get_running_loop().run_in_executor(
            self.executor, functools.partial(fn, *args, **kwargs)
        )


def error_response(state: RouterState, error: Exception, openai: bool = False) -> JSONResponse:
    return errors.error_response(state.metrics, error, openai)


# --- running a request
# ------------------------------------------------------------------------------


async def submit(
    state: RouterState, inputs: str, parameters: Parameters, add_special_tokens: bool = True
) -> tuple[AsyncIterator[Generation], int, Any]:
    """Validate and queue; the stream of generations (timed for metrics), the prompt length, and the
    scheduler's stream (to close on a disconnect). An overloaded router refuses before
    tokenizing."""
    state.scheduler.check_admission()
    request, ids = await validated(state, inputs, parameters, add_special_tokens)
    return queue(state, request, len(ids), lookup_ids(state, ids, request))


async def validated(
    state: RouterState, inputs: str, parameters: Parameters, add_special_tokens: bool
) -> tuple[Request, list[int]]:
    """The protocol request and its prompt ids, tokenized once, off the event loop."""
    return await state.offload(
        build_request,
        next(state.ids),
        state.tokenizer,
        state.limits,
        inputs,
        parameters,
        add_special_tokens,
        state.grammar_check,
        state.images,
    )


def lookup_ids(state: RouterState, ids: list[int], request: Request) -> list[int] | None:
    """The prompt's ids for prefix-cache lookups, where the shards cache prefixes (else None).
    A prompt with images has its image tokens keyed by their image (router/images/prompt.py)."""
    if not state.info.get("prefix_caching"):
        return None
    if request.chunks is not None:
        return keyed_prompt_ids(ids, request.chunks, state.images)
    return ids


def queue(state: RouterState, request: Request, length: int, token_ids: list[int] | None = None):
    arrival = time.perf_counter()
    try:
        stream = state.scheduler.submit(request, length, token_ids)
    except ValueError as error:
        raise ValidationError(str(error)) from None
    return traced(state.metrics.timed(stream, arrival), stream, arrival), length, stream


async def submit_many(
    state: RouterState,
    inputs: str,
    parameters: Parameters,
    count: int,
    name: str,
    add_special_tokens: bool = True,
) -> tuple[list[AsyncIterator[Generation]], int, Any]:
    """`count` sequences for one prompt that share its prefill (router/sched/fanout.py): their
    generation streams, the prompt length, and one handle that closes them all. `name` is the field
    asking."""
    problem = fanout.check_count(name, count, state.scheduler.limits.max_batch_size)
    if problem:
        raise ValidationError(problem)
    state.scheduler.check_admission(count)
    request, ids = await validated(state, inputs, parameters, add_special_tokens)
    length = len(ids)
    group = fanout.siblings(request, count, lambda: next(state.ids))
    arrival = time.perf_counter()
    try:
        streams = state.scheduler.submit_group(group, length, lookup_ids(state, ids, request))
    except ValueError as error:
        raise ValidationError(str(error)) from None
    timed = [traced(state.metrics.timed(stream, arrival), stream, arrival) for stream in streams]
    return timed, length, fanout.Streams(streams)


async def collect_all(
    state: RouterState, generations: list[AsyncIterator[Generation]], streams
) -> list[list[Generation]]:
    """Every sequence's generations, read concurrently; one failure closes all of them."""

    async def read(iterator):
        return [g async for g in iterator]

    try:
        result = await asyncio.gather(*(read(iterator) for iterator in generations))
    finally:
        streams.close()
    state.metrics.outcome("success")
    return list(result)


async def collect(
    state: RouterState, generations: AsyncIterator[Generation], stream
) -> list[Generation]:
    try:
        result = [g async for g in generations]
    finally:
        stream.close()
    state.metrics.outcome("success")
    return result


async def events(
    state: RouterState, http_request: HttpRequest, generations, stream, render, on_error
):
    """Server-sent events: `render(generation)` gives each generation's events. A client that goes
    away cancels its request and frees its blocks; a failure becomes a last error event."""
    outcome = "cancelled"  # unless the stream reaches its end: the client went away
    asked = time.monotonic()
    try:
        async for generation in generations:
            if time.monotonic() - asked >= DISCONNECT_CHECK_S:
                asked = time.monotonic()
                if await http_request.is_disconnected():
                    # for servers whose send() ignores a closed connection instead of raising
                    return
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
