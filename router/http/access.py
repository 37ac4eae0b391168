"""Who may call the router and how a request is named: API keys, CORS, and the `x-request-id`
header.

One ASGI middleware (not Starlette's BaseHTTPMiddleware: that one runs the route in another task and
hides a client's disconnect from streaming routes) gives every request an id, sends it back as
`x-request-id`, puts it in every log line written while the request runs (a logging filter reads a
context variable) and, when an API key is set, answers 401 to a request without `Authorization:
Bearer <key>` or `x-api-key: <key>` (the header Anthropic's API reads). `/health` and `/metrics`
stay open, so probes and Prometheus need no key. CORS is Starlette's middleware, outside this one,
so preflight requests (which carry no key) are answered and 401 answers carry the CORS headers a
browser needs to read them.
"""

from __future__ import annotations

import argparse
import contextvars
import hmac
import logging
import re
import time
import uuid

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.middleware.cors import CORSMiddleware

from engine.cli.flags import add_knob_flags, config_from_args
from router.config import AccessConfig
from router.http.errors import anthropic_error, is_anthropic

log = logging.getLogger(__name__)
OPEN_PATHS = frozenset({"/health", "/metrics", "/live"})  # probes need no key
REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")
# A caller's own id is kept when it is a plain token; anything else (a header injection attempt)
# gets a new one.
CALLER_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def add_access_args(parser: argparse.ArgumentParser) -> None:
    add_knob_flags(parser, AccessConfig)  # the fields of AccessConfig (router/config.py)


def access_from_args(args: argparse.Namespace) -> AccessConfig:
    return config_from_args(AccessConfig, args)


def unauthorized_body(path: str) -> dict:
    message = "a valid API key is required: send `Authorization: Bearer <key>`"
    if is_anthropic(path):
        return anthropic_error(401, f"{message} or `x-api-key: <key>`")[1]
    if path.startswith("/v1/"):  # OpenAI's error body, which its clients read
        return {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": None,
                "code": "invalid_api_key",
            }
        }
    return {"error": message, "error_type": "authentication"}


def bearer(headers: list[tuple[bytes, bytes]]) -> str | None:
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


def api_key_header(headers: list[tuple[bytes, bytes]]) -> str | None:
    for name, value in headers:
        if name == b"x-api-key":
            return value.decode("latin-1").strip()
    return None


def caller_request_id(headers: list[tuple[bytes, bytes]]) -> str | None:
    for name, value in headers:
        if name == b"x-request-id":
            text = value.decode("latin-1")
            return text if CALLER_ID.match(text) else None
    return None


class AccessMiddleware:
    def __init__(self, app, api_key: str | None):
        self.app, self.api_key = app, api_key

    def allowed(self, scope) -> bool:
        if self.api_key is None or scope["path"] in OPEN_PATHS or scope["method"] == "OPTIONS":
            return True
        given = (bearer(scope["headers"]), api_key_header(scope["headers"]))
        return any(
            key is not None and hmac.compare_digest(key.encode(), self.api_key.encode())
            for key in given
        )

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request_id = caller_request_id(scope["headers"]) or uuid.uuid4().hex
        token, start, status = REQUEST_ID.set(request_id), time.perf_counter(), [0]

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message = {
                    **message,
                    "headers": [
                        *message.get("headers", []),
                        (b"x-request-id", request_id.encode()),
                    ],
                }
            await send(message)

        try:
            if self.allowed(scope):
                await self.app(scope, receive, send_with_id)
            else:
                response = JSONResponse(
                    unauthorized_body(scope["path"]),
                    status_code=401,
                    headers={"www-authenticate": "Bearer"},
                )
                await response(scope, receive, send_with_id)
        finally:
            log.info(
                "%s %s -> %d in %.3fs",
                scope["method"],
                scope["path"],
                status[0],
                time.perf_counter() - start,
            )
            REQUEST_ID.reset(token)


class RequestIdFilter(logging.Filter):
    """Adds `request_id` to every record, so a format can print it ("-" outside a request)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = REQUEST_ID.get()
        return True


def install(app: FastAPI, config: AccessConfig) -> None:
    """Add the middlewares; the last added runs first, so CORS wraps the key check."""
    app.add_middleware(AccessMiddleware, api_key=config.api_key)
    if config.cors_allow_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.cors_allow_origins),
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=["x-request-id"],
        )


def log_request_ids(handler: logging.Handler) -> None:
    handler.addFilter(RequestIdFilter())
