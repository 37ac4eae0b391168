"""TGI's HTTP API over the scheduler: `/generate`, `/generate_stream`, `/` (the Python client's),
`/tokenize`, `/health`, `/info`, `/metrics`. Its peer router/http/openai_api.py serves the OpenAI
routes; both build on router/http/state.py, and router/app.py assembles them.

Bodies, events and errors follow text-generation-inference's documented schema, so TGI's own clients
work unchanged. The router tokenizes each prompt to count its tokens; the shard tokenizes it again
to run it.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict

from engine.batch import FinishReason, Generation
from router.http.metrics import CONTENT_TYPE
from router.http.state import (
    VALIDATION_WORKERS,
    RouterState,
    collect,
    collect_all,
    error_body,
    error_payload,
    error_response,
    events,
    finite,
    submit,
    submit_many,
)
from router.http.validation import (
    MAX_STOP_SEQUENCES,
    GenerateRequest,
    Parameters,
    check,
    check_text,
)
from router.sched import fanout

FINISH_REASONS = {
    FinishReason.LENGTH: "length",
    FinishReason.EOS_TOKEN: "eos_token",
    FinishReason.STOP_SEQUENCE: "stop_sequence",
}


def sse(payload: Any) -> str:
    return f"data:{json.dumps(payload)}\n\n"


# --- TGI's bodies ---------------------------------------------------------------------------------


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


def sequence_details(body: GenerateRequest, generations: list[Generation]) -> dict:
    last, p = generations[-1].generated_text, body.parameters
    prefill = generations[0].prefill_tokens
    details = {
        "finish_reason": FINISH_REASONS[last.finish_reason],
        "generated_tokens": last.generated_tokens,
        "seed": last.seed,
        "prefill": token_list(prefill, False) if prefill else [],
        "tokens": [t for g in generations for t in token_list(g.tokens)],
    }
    if p.top_n_tokens:
        details["top_tokens"] = [token_list(t) for g in generations for t in g.top_tokens]
    return details


def generate_response(
    body: GenerateRequest, generations: list[Generation], others: list[list[Generation]] = ()
) -> dict:
    """TGI's answer; `others`: the best_of sequences that lost, listed in details as TGI does."""
    response: dict = {"generated_text": full_text(body, generations[-1].generated_text.text)}
    p = body.parameters
    if p.details or p.decoder_input_details:
        response["details"] = sequence_details(body, generations)
        if others:
            response["details"]["best_of_sequences"] = [
                {
                    "generated_text": full_text(body, g[-1].generated_text.text),
                    **sequence_details(body, g),
                }
                for g in others
            ]
    return response


def max_best_of(state: RouterState) -> int:
    """The largest `best_of` check_best_of accepts (fanout.check_count's bound)."""
    return min(fanout.MAX_SIBLINGS, state.scheduler.limits.max_batch_size)


def info(state: RouterState) -> dict:
    """TGI's /info: what the wiring found (router/app.py), with the limits as the routes enforce
    them, so that a client reading them meets no other limit. `max_input_length` is the name
    TGI's routers before 2.0 gave `max_input_tokens`."""
    return {
        **state.info,
        "max_best_of": max_best_of(state),
        "max_stop_sequences": MAX_STOP_SEQUENCES,
        "max_input_length": state.info["max_input_tokens"],
        "max_batch_size": state.scheduler.limits.max_batch_size,
        "validation_workers": VALIDATION_WORKERS,
        "max_client_batch_size": 1,
    }  # `inputs` is one string: TGI's batched inputs are not accepted


def check_best_of(state: RouterState, p: Parameters, stream: bool) -> int:
    """TGI's rules for `best_of` > 1 (it samples several sequences and answers the likeliest)."""
    best_of = p.best_of or 1
    if best_of > 1:
        check(not stream, "`best_of` != 1 is not supported when streaming tokens")
        problem = fanout.check_count("best_of", best_of, state.scheduler.limits.max_batch_size)
        check(problem is None, problem)
        sampling = p.do_sample or any(
            v is not None for v in (p.temperature, p.top_k, p.top_p, p.typical_p)
        )
        check(sampling, "you must use sampling when `best_of` is > 1")
        check(p.seed is None, "`seed` must not be set when `best_of` > 1")
    return best_of


def mean_logprob(generations: list[Generation]) -> float:
    """TGI's ranking of best_of sequences: the mean logprob of their generated tokens."""
    logprobs = [finite(lp) for g in generations for lp in g.tokens.logprobs]
    return sum(lp if lp is not None else float("-inf") for lp in logprobs) / max(len(logprobs), 1)


class TgiEvents:
    """Renders generations as TGI's stream events, numbering tokens from 1."""

    def __init__(self, body: GenerateRequest):
        self.body, self.index = body, 0

    def __call__(self, generation: Generation) -> list[str]:
        out, tokens, last = [], token_list(generation.tokens), generation.generated_text
        for i, token in enumerate(tokens):
            self.index += 1
            final = last is not None and i == len(tokens) - 1
            top = token_list(generation.top_tokens[i]) if i < len(generation.top_tokens) else []
            event = {
                "index": self.index,
                "token": token,
                "top_tokens": top,
                "generated_text": None,
                "details": None,
            }
            if final:
                event["generated_text"] = full_text(self.body, last.text)
                event["details"] = {
                    "finish_reason": FINISH_REASONS[last.finish_reason],
                    "generated_tokens": last.generated_tokens,
                    "seed": last.seed,
                }
            out.append(sse(event))
        return out


def tgi_error_event(error: Exception) -> str:
    return sse(error_payload(error))


# --- TGI's routes ---------------------------------------------------------------------------------


async def generate(state: RouterState, body: GenerateRequest) -> JSONResponse:
    try:
        best_of = check_best_of(state, body.parameters, stream=False)
        if best_of > 1:
            sequences, _, streams = await submit_many(
                state, body.inputs, body.parameters, best_of, "best_of"
            )
            done = await collect_all(state, sequences, streams)
            best = max(
                range(best_of), key=lambda i: mean_logprob(done[i])
            )  # the first of equals, as TGI
            return JSONResponse(
                generate_response(body, done[best], [g for i, g in enumerate(done) if i != best])
            )
        generations, _, stream = await submit(state, body.inputs, body.parameters)
        return JSONResponse(generate_response(body, await collect(state, generations, stream)))
    except Exception as error:  # noqa: BLE001 - every failure gets TGI's error body
        return error_response(state, error)


async def generate_stream(state: RouterState, body: GenerateRequest, http_request: HttpRequest):
    try:
        check_best_of(state, body.parameters, stream=True)
        generations, _, stream = await submit(state, body.inputs, body.parameters)
    except Exception as error:  # noqa: BLE001
        return error_response(state, error)
    return StreamingResponse(
        events(state, http_request, generations, stream, TgiEvents(body), tgi_error_event),
        media_type="text/event-stream",
    )


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    inputs: str
    parameters: Parameters = Parameters()


async def tokenize(state: RouterState, body: TokenizeRequest) -> JSONResponse:
    """TGI's /tokenize: each token's id, text and character span in `inputs` (tokenized off the
    event loop)."""
    try:
        check(body.inputs != "", "`inputs` cannot be empty")
        check_text("inputs", body.inputs)
        return JSONResponse(await state.offload(token_spans, state.tokenizer, body.inputs))
    except Exception as error:  # noqa: BLE001 - every failure gets TGI's error body
        return error_response(state, error)


def token_spans(tokenizer, text: str) -> list[dict]:
    encoding = tokenizer(text, add_special_tokens=True, return_offsets_mapping=True)
    return [
        {"id": token_id, "text": text[start:stop], "start": start, "stop": stop}
        for token_id, (start, stop) in zip(encoding["input_ids"], encoding["offset_mapping"])
    ]


def tgi_routes(app: FastAPI, state: RouterState) -> None:
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

    @app.post("/tokenize")
    async def tokenize_route(body: TokenizeRequest):
        return await tokenize(state, body)


def service_routes(app: FastAPI, state: RouterState) -> None:
    @app.get("/health")
    async def health_route():
        try:
            if not state.scheduler.available:
                raise RuntimeError("the shards are unavailable")
            await state.client.health()
        except Exception as error:  # noqa: BLE001
            state.metrics.outcome("unavailable")
            return JSONResponse(error_body(f"unhealthy: {error}", "healthcheck"), status_code=503)
        return JSONResponse(None)

    @app.get("/info")
    async def info_route():
        return info(state)

    @app.get("/metrics")
    async def metrics_route():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)
