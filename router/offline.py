"""The router's scheduler driving an in-process shard: `generate` and `bench` batch exactly as the
server does (continuous batching, router-assigned KV blocks), without sockets or HTTP.

The shard's steps run on the calling thread, the one that built and warmed it, while the
scheduler's event loop runs on a thread of its own: a second thread running torch would keep a
second OpenMP pool, and with more OpenMP threads than cores each pool sleeps between parallel
regions instead of spinning (engine/cli/main.py on_a_passing_thread).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from concurrent.futures import Executor, Future

from engine.batch import Generation, Request
from engine.config import ServingLimits
from router.client import InProcessClient
from router.sched.allocator import BlockAllocator
from router.sched.scheduler import Scheduler, lookahead_for


def limits_of(shard, requests: int) -> ServingLimits:
    """What the warmed shard serves; every request of the run may wait in the queue at once."""
    warmed = shard.limits
    return ServingLimits(
        warmed.max_batch_size,
        warmed.max_prefill_tokens,
        warmed.max_input_tokens,
        warmed.max_total_tokens,
        max_concurrent_requests=max(requests, 1),
    )


class CallerThread(Executor):
    """An executor whose calls run on the thread that calls `serve()`, in order, until `stop()`."""

    def __init__(self):
        self._work: queue.SimpleQueue = queue.SimpleQueue()

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()
        self._work.put((future, fn, args, kwargs))
        return future

    def stop(self) -> None:
        self._work.put(None)

    def serve(self) -> None:
        while (item := self._work.get()) is not None:
            future, fn, args, kwargs = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as error:  # noqa: BLE001 - the caller's future holds it
                    future.set_exception(error)


def run_scheduled(
    shard,
    requests: list[Request],
    lengths: list[int],
    capacity_tokens: int,
    seconds: dict | None = None,
) -> dict[int, list[Generation]]:
    """Every request's generations. `lengths` are the prompts' token counts; `capacity_tokens` is
    the KV capacity the shard's warmup reported. `seconds`, when given, accumulates the time the
    shard spent in "prefill" and "decode"."""
    shard_thread, outcome = CallerThread(), Future()

    def schedule():
        try:
            outcome.set_result(
                asyncio.run(_run(shard, requests, lengths, capacity_tokens, seconds, shard_thread))
            )
        except BaseException as error:  # noqa: BLE001 - re-raised on the calling thread
            outcome.set_exception(error)
        finally:
            shard_thread.stop()

    threading.Thread(target=schedule, name="offline-scheduler", daemon=True).start()
    shard_thread.serve()
    return outcome.result()


async def _run(
    shard, requests, lengths, capacity_tokens, seconds, executor
) -> dict[int, list[Generation]]:
    client = InProcessClient(shard, max_batch_size=shard.limits.max_batch_size, executor=executor)
    allocator = BlockAllocator(capacity_tokens // shard.block_size + 1, shard.block_size)
    lookahead = lookahead_for("auto", shard.adapter.device_type)
    scheduler = Scheduler(client, allocator, limits_of(shard, len(requests)), lookahead=lookahead)
    await scheduler.start()
    try:
        streams = [scheduler.submit(request, length) for request, length in zip(requests, lengths)]
        outputs = await asyncio.gather(*(_collect(stream) for stream in streams))
    finally:
        await scheduler.stop()
        await client.close()
    if seconds is not None:
        for phase in ("prefill", "decode"):
            seconds[phase] = seconds.get(phase, 0.0) + client.seconds[phase]
    return {request.id: output for request, output in zip(requests, outputs)}


async def _collect(stream) -> list[Generation]:
    async with stream:
        return [generation async for generation in stream]
