"""The Responses API's stored responses: what `previous_response_id` continues and what
`GET /v1/responses/{id}` returns, kept in this router's memory only.

The store is bounded twice, by count (`--max-stored-responses`) and by size (a stored conversation
may hold images as data URLs), and evicts the least recently used response first: a continued or
fetched response is used again. A response that is evicted, deleted or kept by another router
replica is simply not found. Nothing survives a restart.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

from router.config import DEFAULT_STORED_RESPONSES

MAX_STORED_CHARS = 64 * 1024 * 1024  # about 64 MiB of JSON text for all of them together


@dataclass(frozen=True)
class StoredResponse:
    response: dict  # the response object, as the route returned it
    messages: list[dict]  # the conversation so far as chat messages, its reply last
    size: int  # characters of JSON the two take


class ResponseStore:
    """An LRU map from response id to StoredResponse, within `max_count` and `max_chars`."""

    def __init__(
        self, max_count: int = DEFAULT_STORED_RESPONSES, max_chars: int = MAX_STORED_CHARS
    ):
        self.max_count, self.max_chars = max_count, max_chars
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def put(self, response: dict, messages: list[dict]) -> None:
        size = len(json.dumps(response)) + len(json.dumps(messages))
        if size > self.max_chars:  # would evict everything and still not fit: not kept
            return
        with self._lock:
            self._discard(response["id"])
            self._items[response["id"]] = StoredResponse(response, messages, size)
            self._chars += size
            while self._items and (
                len(self._items) > self.max_count or self._chars > self.max_chars
            ):
                self._discard(next(iter(self._items)))

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            stored = self._items.get(response_id)
            if stored is not None:
                self._items.move_to_end(response_id)
            return stored

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._discard(response_id)

    def __len__(self) -> int:
        return len(self._items)

    def _discard(self, response_id: str) -> bool:
        stored = self._items.pop(response_id, None)
        if stored is None:
            return False
        self._chars -= stored.size
        return True
