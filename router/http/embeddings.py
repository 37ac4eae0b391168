"""OpenAI's `POST /v1/embeddings` over the shards' Embed extension (proto/CONTRACT.md).

`input` is a string, a list of strings, a list of token ids or a list of lists of them; strings
are tokenized here as a completion prompt is (special tokens added). The shards pool each input's
final hidden state (--pooling), L2-normalize it, and keep the first `dimensions` values where the
model allows (engine/serving/embed.py). Every refusal is a 400 in OpenAI's error body, as OpenAI
answers it (the other routes keep TGI's 422).
"""

from __future__ import annotations

import base64
import json
import struct
import time
from typing import Literal

import grpc
import pydantic
from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr

from engine.batch import Embedding, EmbedInput
from router.client import ShardError
from router.config import TGI_MODEL_ALIAS
from router.http.errors import error_json, schema_message
from router.http.state import RouterState, error_response
from router.http.tracing import child_span
from router.http.validation import ValidationError, check, check_text

MAX_INPUTS = 2048  # per request, as OpenAI's API
INPUT_TYPES = (
    "`input` must be a string, a list of strings, a list of token ids (integers) or a list of "
    "lists of token ids"
)


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    input: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None
    user: str | None = None  # accepted, and changes nothing


class BadEmbedding(Exception):
    """A 400 in OpenAI's error body."""


def check_fields(body: EmbeddingRequest) -> None:
    unknown = sorted(body.model_extra or {})
    check(not unknown, f"not implemented: {', '.join(f'`{name}`' for name in unknown)}")
    check(
        body.dimensions is None or body.dimensions >= 1,
        f"`dimensions` must be at least 1. Given: {body.dimensions}",
    )


def input_ids(state: RouterState, body: EmbeddingRequest) -> list[list[int]]:
    """Each input's token ids (on a validation thread: tokenizing is CPU work)."""
    given = body.input
    items = [given] if isinstance(given, str) or (given and isinstance(given[0], int)) else given
    check(len(items) > 0, "`input` cannot be empty")
    check(
        len(items) <= MAX_INPUTS,
        f"`input` may hold up to {MAX_INPUTS} inputs. Given: {len(items)}",
    )
    return [item_ids(state, index, item) for index, item in enumerate(items)]


def item_ids(state: RouterState, index: int, item: str | list[int]) -> list[int]:
    limits, where = state.limits, f"`input[{index}]`"
    if isinstance(item, str):
        check(item != "", f"{where} cannot be empty")
        check_text(where, item)
        if limits.token_chars:  # a surely too long text is refused before it is tokenized
            check(
                len(item) <= limits.max_input_tokens * limits.token_chars,
                f"{where} must have at most {limits.max_input_tokens} tokens",
            )
        item = state.tokenizer(item, add_special_tokens=True)["input_ids"]
    check(len(item) > 0, f"{where} cannot be empty")
    check(
        len(item) <= limits.max_input_tokens,
        f"{where} must have at most {limits.max_input_tokens} tokens. Given: {len(item)}",
    )
    vocabulary = len(state.tokenizer)
    bad = next((token for token in item if not 0 <= token < vocabulary), None)
    check(bad is None, f"{where}: token id {bad} is not in the vocabulary (0..{vocabulary - 1})")
    return item


def encoded(values: list[float], encoding_format: str) -> list[float] | str:
    """OpenAI's base64: the little-endian float32 bytes of the vector."""
    if encoding_format == "float":
        return values
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")


def reply(model: str, body: EmbeddingRequest, embeddings: list[Embedding], tokens: int) -> dict:
    data = [
        {
            "object": "embedding",
            "index": index,
            "embedding": encoded(e.values, body.encoding_format),
        }
        for index, e in enumerate(embeddings)
    ]
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


async def parsed(http_request: HttpRequest) -> EmbeddingRequest:
    try:
        return EmbeddingRequest.model_validate(json.loads(await http_request.body()))
    except json.JSONDecodeError:
        raise BadEmbedding("the body is not valid JSON") from None
    except pydantic.ValidationError as error:
        if any(e["loc"][:1] == ("input",) and e["type"] != "missing" for e in error.errors()):
            raise BadEmbedding(INPUT_TYPES) from None  # one line, not one per union member
        raise BadEmbedding(schema_message(error)) from None


def refusal(state: RouterState, error: Exception) -> JSONResponse:
    """A 400 for the request's own mistakes (the shard's INVALID_ARGUMENT, the scheduler's
    ValueError for shards that serve no embeddings); else the answer
    every route gives (429 overloaded, 503 unavailable, ...)."""
    invalid = isinstance(error, ShardError) and error.code == grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(error, BadEmbedding | ValidationError | ValueError) or invalid:
        message = error.message if invalid else str(error)
        return error_json(state.metrics, 400, message, "validation", "validation", openai=True)
    return error_response(state, error, openai=True)


async def embeddings(state: RouterState, http_request: HttpRequest) -> JSONResponse:
    try:
        body = await parsed(http_request)
        if body.model not in (None, state.info["model_id"], TGI_MODEL_ALIAS):
            message = f"The model `{body.model}` does not exist."
            return error_json(state.metrics, 404, message, "not_found", "not_found", openai=True)
        check_fields(body)
        state.scheduler.check_admission()  # before tokenizing
        ids = await state.offload(input_ids, state, body)
        inputs = [EmbedInput(i, item, body.dimensions or 0) for i, item in enumerate(ids)]
        tokens = sum(len(item) for item in ids)
        with child_span("embed", inputs=len(inputs), tokens=tokens):
            vectors = await state.scheduler.embed(inputs)
    except Exception as error:  # noqa: BLE001 - every failure gets an error body
        return refusal(state, error)
    state.metrics.outcome("success")
    state.metrics.embedded_inputs.inc(len(inputs))
    state.metrics.embedded_tokens.inc(tokens)
    return JSONResponse(reply(state.info["model_id"], body, vectors, tokens))


def embedding_routes(app: FastAPI, state: RouterState) -> None:
    # The body is parsed by the route (a bad one is OpenAI's 400, not FastAPI's 422); its schema
    # is declared for /openapi.json all the same.
    schema = {"content": {"application/json": {"schema": EmbeddingRequest.model_json_schema()}}}

    @app.post("/v1/embeddings", openapi_extra={"requestBody": {**schema, "required": True}})
    async def embeddings_route(http_request: HttpRequest):
        start = time.perf_counter()
        try:
            return await embeddings(state, http_request)
        finally:
            state.metrics.embedding_seconds.observe(time.perf_counter() - start)
