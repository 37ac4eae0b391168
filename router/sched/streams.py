"""One request's life in the scheduler: its queue entry, and the stream its caller reads."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from engine.batch import Generation, Request, kv_tokens
from router.sched.allocator import Allocation


class RequestCancelled(Exception):
    """Raised by a stream whose request was cancelled by someone other than its own consumer."""


@dataclass(eq=False)
class Entry:
    """One submitted request, from submit until its blocks are back in the allocator."""

    request: Request
    input_length: int
    outbox: asyncio.Queue = field(default_factory=asyncio.Queue)
    allocation: Allocation | None = None
    finished: bool = False  # its last generation or its error has been handed to the stream
    cancelled: bool = False
    admitted: float | None = None  # perf_counter when it left the queue (for tracing)
    generated: list[int] = field(
        default_factory=list
    )  # token ids handed to the stream: what a resume re-prefills
    group: int | None = (
        None  # siblings sharing one prompt (router/sched/fanout.py): the first one's id
    )
    token_ids: list[int] | None = (
        None  # the prompt's, where the router tokenized it: prefix-cache lookups
    )
    chunk_len: int | None = (
        None  # its first prefill computes only this many tokens (chunked prefill)
    )

    @property
    def id(self) -> int:
        return self.request.id

    @property
    def tokens(self) -> int:
        """Its prompt and every token it may generate (a Batch's max_tokens counts these)."""
        return self.input_length + self.request.stopping_parameters.max_new_tokens

    @property
    def kv_tokens(self) -> int:
        """The KV-cache tokens it can fill, as the shard counts them (engine/batch.py)."""
        return kv_tokens(self.input_length, self.request.stopping_parameters.max_new_tokens)

    @property
    def prefill_length(self) -> int:
        """Tokens its next prefill computes: the prompt, and after a shard restart what it
        generated."""
        return self.input_length + len(self.generated)

    @property
    def live(self) -> bool:
        return not (self.finished or self.cancelled)


class RequestStream:
    """The generations of one request, as an async iterator. Closing it before the last generation
    (`aclose()`, `async with`, or dropping it) cancels the request."""

    def __init__(self, scheduler, entry: Entry):
        self._scheduler, self._entry, self._done = scheduler, entry, False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Generation:
        if self._done:
            raise StopAsyncIteration
        item = await self._entry.outbox.get()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        self._done = item.generated_text is not None
        return item

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        # By entry, not by id: the caller may already have reused the id for a new request.
        if not self._done:
            self._done = True
            self._scheduler.cancel_entry(self._entry)

    def __del__(self) -> None:
        # A consumer that went away without closing (an HTTP client disconnect) still frees its
        # blocks.
        try:
            self.close()
        except Exception:  # noqa: BLE001 - the loop may already be closed at interpreter exit
            pass
