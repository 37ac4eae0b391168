"""Embed calls (`/v1/embeddings`) waiting for the scheduler's loop, which runs them between its
steps: every tensor-parallel rank must meet an Embed in the same order as the steps around it
(their collectives pair up), and only the loop knows that order. An embedding takes no KV block
and joins no batch, so it never waits for room; it waits at most one step."""

from __future__ import annotations

import asyncio
from collections import deque

from engine.batch import EmbedInput


class EmbedQueue:
    def __init__(self):
        self._waiting: deque[tuple[list[EmbedInput], asyncio.Future]] = deque()

    def __len__(self) -> int:
        return len(self._waiting)

    def submit(self, inputs: list[EmbedInput]) -> asyncio.Future:
        """The future of the inputs' embeddings, set once the loop has run them."""
        future = asyncio.get_running_loop().create_future()
        self._waiting.append((inputs, future))
        return future

    async def run(self, client, on_step=None) -> None:
        """Run every waiting call, one Embed each; a failure ends its own call only."""
        while self._waiting:
            inputs, future = self._waiting.popleft()
            if future.done():  # its caller went away
                continue
            if on_step is not None:
                on_step("embed", len(inputs))
            try:
                embeddings = await client.embed(inputs)
            except Exception as error:  # noqa: BLE001 - the caller answers it (a 4xx or 5xx)
                if not future.done():
                    future.set_exception(error)
                continue
            if not future.done():
                future.set_result(embeddings)

    def fail_all(self, error: BaseException) -> None:
        while self._waiting:
            _, future = self._waiting.popleft()
            if not future.done():
                future.set_exception(error)
