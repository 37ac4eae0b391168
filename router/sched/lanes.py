"""Pipeline lanes: as many batches in flight as the shards have pipeline stages.

With one batch, pipeline stages take turns: stage 0 runs its layers and waits while the last stage
runs its own. With `stages` lanes, each lane runs the scheduler's loop on a batch of its own, and
sends its Prefill or Decode without waiting for the other lanes' answers, so that while the last
stage computes lane A's step, stage 0 computes lane B's (the shards keep the steps' order:
engine/pipeline/turns.py; the client numbers them). vLLM's engine core does the same with a batch
queue of `pipeline_parallel_size` batches.

The lanes share the scheduler's queue, KV blocks and prefix cache: everything between two awaits
runs alone (one event loop), and a lane touches only its own shard batch. New requests go to the
lane with the fewest running requests. A lane's step is the scheduler's own (`step_lane`), without
decode lookahead, which the lanes replace. When the shards become unavailable every lane stops;
the requests of a lane whose step had still succeeded wait with the others for the restart."""

from __future__ import annotations

import asyncio

import grpc

from engine.batch import CachedBatch
from router.client import ShardError


class Lane:
    """A batch in flight: the running batch of its lane, None while the lane is empty."""

    def __init__(self, index: int):
        self.index = index
        self.running: CachedBatch | None = None

    @property
    def size(self) -> int:
        return self.running.size if self.running is not None else 0


class Lanes:
    def __init__(self, scheduler, count: int):
        self.scheduler = scheduler
        self.lanes = [Lane(i) for i in range(count)]

    @property
    def running_count(self) -> int:
        return sum(lane.size for lane in self.lanes)

    async def step(self) -> None:
        """Run every lane until the shards become unavailable (one lane failing with a bug
        cancels the others: the scheduler's loop then abandons what runs)."""
        async with asyncio.TaskGroup() as group:
            for lane in self.lanes:
                group.create_task(self._run(lane), name=f"lane-{lane.index}")
        self._hold_survivors()

    def forget(self) -> None:
        """The shards' batches are cleared (the scheduler abandons them)."""
        for lane in self.lanes:
            lane.running = None

    async def _run(self, lane: Lane) -> None:
        while self.scheduler.available:
            await self.scheduler.step_lane(lane, self._next_batch)

    def _next_batch(self, lane: Lane):
        """Admission into the lane with the fewest running requests; a busier lane that finds
        requests waiting wakes the others (one of them may be idle)."""
        s = self.scheduler
        if not s.queue_length:
            return None
        if lane.size > min(other.size for other in self.lanes):
            s.wake()
            return None
        return s.next_batch(running=lane.size)

    def _hold_survivors(self) -> None:
        """The lanes stopped because the shards went away: the requests of a lane whose last step
        succeeded go back to the queue too, to be resumed after the restart."""
        for lane in self.lanes:
            if lane.running is not None:
                gone = ShardError(grpc.StatusCode.UNAVAILABLE, "the shards became unavailable")
                self.scheduler.requeue_batch(lane.running, gone)
                lane.running = None
