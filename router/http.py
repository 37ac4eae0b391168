"""TGI's HTTP API over the scheduler: `/generate`, `/generate_stream`, `/` (the Python client's), `/health`, `/info`.

Bodies, events and errors follow text-generation-inference's documented schema, so TGI's own clients work
unchanged. The router tokenizes each prompt to count its tokens; the shard tokenizes it again to run it.
"""
from __future__ import annotations

import itertools
import json
import math
import secrets
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict

from engine.batch import FinishReason, Generation, NextTokenChooserParameters, Request, StoppingCriteriaParameters
from router.scheduler import Scheduler

MAX_STOP_SEQUENCES = 4
MAX_TOP_N_TOKENS = 5
FINISH_REASONS = {FinishReason.LENGTH: "length", FinishReason.EOS_TOKEN: "eos_token",
                  FinishReason.STOP_SEQUENCE: "stop_sequence"}


class Parameters(BaseModel):
    model_config = ConfigDict(extra="ignore")
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    typical_p: float | None = None
    do_sample: bool = False
    seed: int | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: list[str] = []
    truncate: int | None = None
    return_full_text: bool | None = False
    details: bool = False
    decoder_input_details: bool = False
    top_n_tokens: int | None = None
    watermark: bool = False
    best_of: int | None = None


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    inputs: str
    parameters: Parameters = Parameters()
    stream: bool = False


class ValidationError(Exception):
    pass


@dataclass
class RouterState:
    scheduler: Scheduler
    tokenizer: Any
    client: Any
    info: dict
    ids: itertools.count = field(default_factory=lambda: itertools.count(1))


def error_body(message: str, error_type: str) -> dict:
    return {"error": message, "error_type": error_type}


# --- validation: TGI's checks and messages --------------------------------------------------------


def check(condition: bool, message: str) -> None:
    if not condition:
        raise ValidationError(message)


def check_sampling(p: Parameters) -> None:
    check(p.best_of is None or p.best_of == 1, "`best_of` > 1 is not supported")
    check(p.temperature is None or p.temperature > 0, "`temperature` must be strictly positive")
    check(p.repetition_penalty is None or p.repetition_penalty > 0, "`repetition_penalty` must be strictly positive")
    check(p.frequency_penalty is None or -2 <= p.frequency_penalty <= 2, "`frequency_penalty` must be >= -2.0 and <= 2.0")
    check(p.top_p is None or 0 < p.top_p <= 1, "`top_p` must be > 0.0 and <= 1.0")
    check(p.typical_p is None or 0 < p.typical_p <= 1, "`typical_p` must be > 0.0 and <= 1.0")
    check(p.top_k is None or p.top_k > 0, "`top_k` must be strictly positive")
    check(p.seed is None or 0 <= p.seed < 2**64, "`seed` must be in [0, 2**64)")
    check(len(p.stop) <= MAX_STOP_SEQUENCES, f"`stop` supports up to {MAX_STOP_SEQUENCES} stop sequences. Given: {len(p.stop)}")
    top_n = p.top_n_tokens or 0
    check(0 <= top_n <= MAX_TOP_N_TOKENS, f"`top_n_tokens` must be >= 0 and <= {MAX_TOP_N_TOKENS}. Given: {top_n}")


def input_length(state: RouterState, inputs: str, truncate: int | None) -> int:
    max_input = state.info["max_input_tokens"]
    check(inputs != "", "`inputs` cannot be empty")
    check(truncate is None or 0 < truncate <= max_input,
          f"`truncate` must be strictly positive and less than {max_input}. Given: {truncate}")
    length = len(state.tokenizer(inputs, add_special_tokens=True)["input_ids"])
    if truncate is not None:
        length = min(length, truncate)
    check(length <= max_input, f"`inputs` tokens must be <= {max_input}. Given: {length}")
    return length


def max_new_tokens(state: RouterState, p: Parameters, length: int) -> int:
    max_total = state.info["max_total_tokens"]
    new = p.max_new_tokens if p.max_new_tokens is not None else max_total - length
    check(new > 0, "`max_new_tokens` must be strictly positive")
    check(length + new <= max_total, f"`inputs` tokens + `max_new_tokens` must be <= {max_total}. "
                                     f"Given: {length} `inputs` tokens and {new} `max_new_tokens`")
    return new


def build_request(state: RouterState, body: GenerateRequest) -> tuple[Request, int]:
    p = body.parameters
    check_sampling(p)
    length = input_length(state, body.inputs, p.truncate)
    new = max_new_tokens(state, p, length)
    params = NextTokenChooserParameters(
        temperature=p.temperature or 1.0, top_k=p.top_k or 0, top_p=p.top_p or 1.0, typical_p=p.typical_p or 1.0,
        do_sample=p.do_sample, seed=p.seed if p.seed is not None else secrets.randbits(64) or 1,
        repetition_penalty=p.repetition_penalty or 1.0, watermark=p.watermark,
        frequency_penalty=p.frequency_penalty or 0.0)
    request = Request(next(state.ids), body.inputs, truncate=p.truncate or 0, parameters=params,
                      stopping_parameters=StoppingCriteriaParameters(new, list(p.stop)),
                      prefill_logprobs=p.decoder_input_details, top_n_tokens=p.top_n_tokens or 0)
    return request, length


# --- responses ----------------------------------------------------------------------------------


def finite(logprob: float | None) -> float | None:
    return logprob if logprob is not None and math.isfinite(logprob) else None


def token_list(tokens, with_special: bool = True) -> list[dict]:
    out = []
    for i, token_id in enumerate(tokens.ids):
        entry = {"id": token_id, "text": tokens.texts[i], "logprob": finite(tokens.logprobs[i])}
        if with_special:
            entry["special"] = tokens.is_special[i]
        out.append(entry)
    return out


def full_text(body: GenerateRequest, text: str) -> str:
    return body.inputs + text if body.parameters.return_full_text else text


def generate_response(body: GenerateRequest, generations: list[Generation]) -> dict:
    last = generations[-1].generated_text
    response: dict = {"generated_text": full_text(body, last.text)}
    p = body.parameters
    if p.details or p.decoder_input_details:
        prefill = generations[0].prefill_tokens
        details = {"finish_reason": FINISH_REASONS[last.finish_reason], "generated_tokens": last.generated_tokens,
                   "seed": last.seed, "prefill": token_list(prefill, False) if prefill else [],
                   "tokens": [t for g in generations for t in token_list(g.tokens)]}
        if p.top_n_tokens:
            details["top_tokens"] = [token_list(t) for g in generations for t in g.top_tokens]
        response["details"] = details
    return response


def stream_events(body: GenerateRequest, generation: Generation, index: int) -> tuple[list[str], int]:
    events, tokens, last = [], token_list(generation.tokens), generation.generated_text
    for i, token in enumerate(tokens):
        index += 1
        final = last is not None and i == len(tokens) - 1
        top = token_list(generation.top_tokens[i]) if i < len(generation.top_tokens) else []
        event = {"index": index, "token": token, "top_tokens": top, "generated_text": None, "details": None}
        if final:
            event["generated_text"] = full_text(body, last.text)
            event["details"] = {"finish_reason": FINISH_REASONS[last.finish_reason],
                                "generated_tokens": last.generated_tokens, "seed": last.seed}
        events.append(f"data:{json.dumps(event)}\n\n")
    return events, index


# --- the app -----------------------------------------------------------------------------------


def validation_response(message: str) -> JSONResponse:
    return JSONResponse(error_body(message, "validation"), status_code=422)


async def submit(state: RouterState, body: GenerateRequest):
    request, length = build_request(state, body)
    try:
        return state.scheduler.submit(request, length)
    except ValueError as error:
        raise ValidationError(str(error)) from None


async def run_generate(state: RouterState, body: GenerateRequest) -> dict:
    async with await submit(state, body) as stream:
        return generate_response(body, [g async for g in stream])


async def sse(http_request: HttpRequest, body: GenerateRequest, stream):
    index = 0
    try:
        async for generation in stream:
            if await http_request.is_disconnected():
                break  # also for servers whose send() ignores a closed connection instead of raising
            events, index = stream_events(body, generation, index)
            for event in events:
                yield event
    except Exception as error:  # noqa: BLE001 - TGI reports a failed generation as a last event
        yield f"data:{json.dumps(error_body(str(error), 'generation'))}\n\n"
    finally:
        stream.close()  # a client that went away cancels its request and frees its blocks


async def generate(state: RouterState, body: GenerateRequest):
    try:
        return JSONResponse(await run_generate(state, body))
    except ValidationError as error:
        return validation_response(str(error))
    except Exception as error:  # noqa: BLE001
        return JSONResponse(error_body(str(error), "generation"), status_code=424)


async def generate_stream(state: RouterState, body: GenerateRequest, http_request: HttpRequest):
    try:
        stream = await submit(state, body)
    except ValidationError as error:
        return validation_response(str(error))
    return StreamingResponse(sse(http_request, body, stream), media_type="text/event-stream")


def create_app(state: RouterState) -> FastAPI:
    app = FastAPI(title="bucketserve router")

    @app.exception_handler(RequestValidationError)
    async def bad_body(_: HttpRequest, error: RequestValidationError):
        return validation_response(str(error.errors()))

    @app.post("/generate")
    async def generate_route(body: GenerateRequest):
        return await generate(state, body)

    @app.post("/generate_stream")
    async def generate_stream_route(body: GenerateRequest, http_request: HttpRequest):
        return await generate_stream(state, body, http_request)

    @app.post("/")
    async def compat_route(body: GenerateRequest, http_request: HttpRequest):
        if body.stream:
            return await generate_stream(state, body, http_request)
        response = await generate(state, body)
        if response.status_code != 200:
            return response
        return JSONResponse([json.loads(response.body)])

    @app.get("/health")
    async def health_route():
        try:
            await state.client.health()
        except Exception as error:  # noqa: BLE001
            return JSONResponse(error_body(f"unhealthy: {error}", "healthcheck"), status_code=503)
        return JSONResponse(None)

    @app.get("/info")
    async def info_route():
        return state.info

    return app
