"""One error shape on every route, for every status: TGI's body on TGI's routes, OpenAI's on
`/v1/*`, Anthropic's (with its statuses) on `/v1/messages`.

Route handlers, FastAPI's own refusals (404, 405, a body that is not JSON or not the schema), the
request-size limit (413, 415) and unexpected exceptions (500) all answer through `error_json`, and
every answer is counted in the metrics by its outcome. Messages name the problem, never repeat the
request's content: a body may be megabytes, or text a log should not hold.
"""

from __future__ import annotations

import logging

import grpc
from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from router.client import ShardError
from router.config import DEFAULT_PAYLOAD_LIMIT  # noqa: F401 - the --payload-limit knob's default
from router.http.validation import ValidationError
from router.sched.admission import Overloaded, ShardsUnavailable
from router.sched.streams import RequestCancelled

log = logging.getLogger(__name__)

# (exception, HTTP status, TGI error_type, metrics outcome); checked in order.
ERRORS = [
    (ValidationError, 422, "validation", "validation"),
    (Overloaded, 429, "overloaded", "overloaded"),
    (ShardsUnavailable, 503, "unavailable", "unavailable"),
    (RequestCancelled, 499, "cancelled", "cancelled"),
]
# FastAPI's and the middleware's refusals: status -> (TGI error_type, metrics outcome).
HTTP_ERRORS = {
    400: ("validation", "validation"),
    404: ("not_found", "not_found"),
    405: ("method_not_allowed", "not_found"),
    413: ("payload_too_large", "too_large"),
    415: ("unsupported_media_type", "validation"),
    500: ("internal", "error"),
}
OPENAI_TYPES = {429: "rate_limit_error", 499: "cancelled"}
# Anthropic's clients read its statuses: 400 for any invalid request, 529 for an overloaded server.
ANTHROPIC_STATUSES = {415: 400, 422: 400, 424: 500, 429: 529}
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    529: "overloaded_error",
}


def classify(error: Exception) -> tuple[int, str, str]:
    if isinstance(error, ShardError):
        if (
            error.code == grpc.StatusCode.INVALID_ARGUMENT
        ):  # e.g. a grammar the shard cannot compile
            return 422, "validation", "validation"
        if error.code == grpc.StatusCode.UNAVAILABLE:
            return 503, "unavailable", "unavailable"
    for kind, status, error_type, outcome in ERRORS:
        if isinstance(error, kind):
            return status, error_type, outcome
    return 424, "generation", "error"  # TGI's status for a failed generation


def is_openai(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/")


def is_anthropic(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def anthropic_error(status: int, message: str) -> tuple[int, dict]:
    """Anthropic's status for one of ours, and its error body `{"type": "error", "error": ...}`."""
    status = ANTHROPIC_STATUSES.get(status, status)
    kind = ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return status, {"type": "error", "error": {"type": kind, "message": message}}


def error_body(message: str, error_type: str, status: int = 422, openai: bool = False) -> dict:
    """TGI's `{"error", "error_type"}`, or OpenAI's error object (our error_type is its `code`)."""
    if not openai:
        return {"error": message, "error_type": error_type}
    kind = OPENAI_TYPES.get(
        status, "server_error" if status >= 500 or status == 424 else "invalid_request_error"
    )
    return {"error": {"message": message, "type": kind, "param": None, "code": error_type}}


def error_message(error: Exception) -> str:
    return error.message if isinstance(error, ShardError) else str(error)


def error_payload(error: Exception, openai: bool = False) -> dict:
    status, error_type, _ = classify(error)
    return error_body(error_message(error), error_type, status, openai)


def error_response(
    metrics, error: Exception, openai: bool = False, anthropic: bool = False
) -> JSONResponse:
    """The answer to a request that failed with `error`, counted by its outcome."""
    status, error_type, outcome = classify(error)
    return error_json(metrics, status, error_message(error), error_type, outcome, openai, anthropic)


def error_json(
    metrics,
    status: int,
    message: str,
    error_type: str,
    outcome: str,
    openai: bool,
    anthropic: bool = False,
) -> JSONResponse:
    metrics.outcome(outcome)
    if anthropic:
        status, body = anthropic_error(status, message)
        return JSONResponse(body, status_code=status)
    return JSONResponse(error_body(message, error_type, status, openai), status_code=status)


def schema_message(error: RequestValidationError) -> str:
    """FastAPI's validation errors without their `input` (which echoes the body back)."""
    parts = []
    for item in error.errors()[:5]:
        if item.get("type") == "json_invalid":
            parts.append("the body is not valid JSON")
            continue
        where = ".".join(str(p) for p in item.get("loc", ()) if p != "body") or "body"
        parts.append(f"`{where}`: {item.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request body"


def install_error_handlers(app: FastAPI, metrics) -> None:
    @app.exception_handler(RequestValidationError)
    async def bad_body(request: HttpRequest, error: RequestValidationError):
        return error_json(
            metrics,
            422,
            schema_message(error),
            "validation",
            "validation",
            is_openai(request.url.path),
            is_anthropic(request.url.path),
        )

    @app.exception_handler(HTTPException)
    async def refused(request: HttpRequest, error: HTTPException):
        error_type, outcome = HTTP_ERRORS.get(error.status_code, ("http", "error"))
        message = error.detail if isinstance(error.detail, str) else "request refused"
        path = request.url.path
        return error_json(
            metrics,
            error.status_code,
            message,
            error_type,
            outcome,
            is_openai(path),
            is_anthropic(path),
        )

    @app.exception_handler(Exception)
    async def crashed(request: HttpRequest, error: Exception):
        log.exception("unexpected error on %s", request.url.path)
        return error_json(
            metrics,
            500,
            f"internal error ({type(error).__name__})",
            "internal",
            "error",
            is_openai(request.url.path),
            is_anthropic(request.url.path),
        )


# --- the request-body limit (TGI's --payload-limit)
# ------------------------------------------------

BODY_METHODS = ("POST", "PUT", "PATCH")
GONE = object()


def is_json(content_type: bytes) -> bool:
    kind = content_type.split(b";", 1)[0].strip().lower()
    return kind == b"application/json" or kind.endswith(b"+json")


class BodyLimit:
    """An ASGI middleware that reads a request body whole, up to `limit` bytes, before any handler
    or JSON parser sees it: a larger body gets 413 and a body declared as something other than JSON
    gets 415, both in the route's error shape. The buffered body is then replayed to the app, and
    later `receive` calls (disconnect detection in streams) go to the server as before."""

    def __init__(self, app, limit: int, metrics):
        self.app, self.limit, self.metrics = app, limit, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] not in BODY_METHODS:
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        content_type, declared = headers.get(b"content-type"), headers.get(b"content-length", b"")
        if content_type is not None and not is_json(content_type):
            await self._refuse(
                scope, receive, send, 415, "the body must be JSON (Content-Type: application/json)"
            )
            return
        if declared.isdigit() and int(declared) > self.limit:
            await self._refuse(scope, receive, send, 413, self._too_large())
            return
        body = await self._read(receive)
        if body is GONE:
            return
        if body is None:
            await self._refuse(scope, receive, send, 413, self._too_large())
            return
        await self.app(scope, replaying(body, receive), send)

    async def _read(self, receive):
        """The whole body; None once it exceeds the limit; GONE if the client went away."""
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return GONE
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                return None
            chunks.append(chunk)
            more = message.get("more_body", False)
        return b"".join(chunks)

    def _too_large(self) -> str:
        return f"the request body exceeds the payload limit of {self.limit} bytes"

    async def _refuse(self, scope, receive, send, status: int, message: str) -> None:
        error_type, outcome = HTTP_ERRORS[status]
        path = scope["path"]
        response = error_json(
            self.metrics, status, message, error_type, outcome, is_openai(path), is_anthropic(path)
        )
        await response(scope, receive, send)


def replaying(body: bytes, receive):
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
