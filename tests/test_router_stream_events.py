"""A stream's server-sent events (router/http/state.py events): every generation rendered in order,
and the client asked whether it is still there at most every DISCONNECT_CHECK_S, not at every
token (anyio's cancel scope made that question a quarter of a lone stream's router time)."""

import asyncio
from types import SimpleNamespace

from router.http import state as state_module


class CountingRequest:
    def __init__(self, gone_after: int | None = None):
        self.asked, self.gone_after = 0, gone_after

    async def is_disconnected(self) -> bool:
        self.asked += 1
        return self.gone_after is not None and self.asked > self.gone_after


async def generations(count: int, pause: float = 0.0):
    for i in range(count):
        if pause:
            await asyncio.sleep(pause)
        yield i


def run_events(request, count: int, pause: float = 0.0) -> tuple[list, list]:
    outcomes, closed = [], []
    state = SimpleNamespace(metrics=SimpleNamespace(outcome=outcomes.append))
    stream = SimpleNamespace(close=lambda: closed.append(True))

    async def collect():
        events = state_module.events(
            state, request, generations(count, pause), stream, lambda g: [f"data: {g}"], str
        )
        return [event async for event in events]

    return asyncio.run(collect()), outcomes + closed


def test_a_fast_stream_is_not_asked_at_every_token():
    request = CountingRequest()
    events, ends = run_events(request, 200)
    assert events == [f"data: {i}" for i in range(200)] and ends == ["success", True]
    assert request.asked <= 1


def test_a_client_gone_is_still_noticed(monkeypatch):
    monkeypatch.setattr(state_module, "DISCONNECT_CHECK_S", 0.01)
    request = CountingRequest(gone_after=0)
    events, ends = run_events(request, 50, pause=0.005)
    assert len(events) < 50 and ends == ["cancelled", True]
