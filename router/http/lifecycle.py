"""Readiness and drain, as fleets expect of a model server (Kubernetes probes, vllm-router, the
inference gateways).

The server listens only once the shards are warmed (router/app.py warms them before it serves), so
/health is green only when the warmed set can serve. On SIGTERM the router drains: /health answers
503 (the balancers take it out), every new request gets 503 with a Retry-After, the requests already
admitted finish, and the process exits 0 once they have, or once --drain-timeout has passed (then
the rest are cancelled). A second SIGTERM, or SIGINT, stops at once. /live answers 200 while the
process runs, for a liveness probe that must not fail during a drain.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal

import uvicorn

from router.http.errors import anthropic_error, is_anthropic

log = logging.getLogger(__name__)
RETRY_AFTER_S = 1  # another replica can take the request now: the balancer retries it there
PROBES = ("/health", "/metrics", "/live")
POLL_S = 0.05


class Lifecycle:
    """Whether the router drains, and how many admitted HTTP requests are still answering."""

    def __init__(self):
        self.draining = False
        self.in_flight = 0


class DrainGate:
    """ASGI middleware: while draining, 503 for every request but the probes' (and /health's is a
    503 too); otherwise it counts the requests in flight, streamed answers until their last byte."""

    def __init__(self, app, lifecycle: Lifecycle, metrics=None):
        self.app, self.lifecycle, self.metrics = app, lifecycle, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        if self.lifecycle.draining and (path == "/health" or path not in PROBES):
            return await self._refuse(path, send)
        if path in PROBES:
            return await self.app(scope, receive, send)
        self.lifecycle.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.lifecycle.in_flight -= 1

    async def _refuse(self, path: str, send) -> None:
        if self.metrics is not None and path != "/health":
            self.metrics.outcome("unavailable")
        message = "the server is draining (shutting down): retry on another replica"
        if is_anthropic(path):
            body = anthropic_error(503, message)[1]
        elif path.startswith("/v1/"):
            body = {"error": {"message": message, "type": "server_error", "code": "unavailable"}}
        else:
            body = {"error": message, "error_type": "unavailable"}
        payload = json.dumps(body).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode()),
            (b"retry-after", str(RETRY_AFTER_S).encode()),
            (b"connection", b"close"),
        ]
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": payload})


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose first SIGTERM drains instead of closing the listening socket (which
    would answer new requests with refused connections, not 503), and which then exits 0."""

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle, scheduler, timeout: float):
        super().__init__(config)
        self.lifecycle, self.scheduler, self.timeout = lifecycle, scheduler, timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        first = not self.lifecycle.draining and not self.should_exit
        if sig == signal.SIGTERM and first and self._loop is not None:
            self.lifecycle.draining = True
            self._loop.call_soon_threadsafe(self._start_drain)
            return
        super().handle_exit(sig, frame)

    def _start_drain(self) -> None:
        self._drain = asyncio.create_task(self.drain(), name="drain")

    async def drain(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        log.info(
            "SIGTERM: draining %d request(s) within %gs; new ones get 503",
            self.scheduler.outstanding,
            self.timeout,
        )
        while self.scheduler.outstanding or self.lifecycle.in_flight:
            if not self.scheduler.available:
                log.warning("the shards are unavailable: the queued requests cannot finish")
                break
            if loop.time() >= deadline:
                log.warning(
                    "the drain timeout (%gs) passed with %d request(s) unfinished: cancelling them",
                    self.timeout,
                    self.scheduler.outstanding,
                )
                break
            await asyncio.sleep(POLL_S)
        else:
            log.info("drained: stopping")
        self.should_exit = True
