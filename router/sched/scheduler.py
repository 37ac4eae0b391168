"""Continuous batching: the router's loop (docs/architecture.md#the-life-of-a-request).

One background task owns the shard's batches. Each step it may admit new requests from the head of
a FIFO queue (`Prefill(new)`), then decodes everything running together (`Decode([running, new])`,
the shard concatenates), hands each generation to its request's stream, and drops finished or
cancelled requests (`FilterBatch`, or `ClearCache` when none remain). This is what TGI's v3 router
does, so the same loop drives our shards in process or over gRPC.

The scheduler owns KV blocks too (router/sched/kv_blocks.py): a request gets blocks for its prompt
and its new tokens at admission, reusing cached prefix blocks, and gives them back once no shard
batch lists it.

Shards of several pipeline stages (Info.pipeline_stages) get as many batches in flight, one per
lane, each lane running this loop on its own batch (router/sched/lanes.py).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from collections.abc import Awaitable, Callable

import grpc

from engine.batch import Batch, CachedBatch, Embedding, EmbedInput, Generation, Request
from engine.config import ServingLimits
from router.client import ShardClient, ShardError
from router.sched import batching, fanout, kv_blocks, preemption
from router.sched.admission import Overloaded, ShardsUnavailable  # noqa: F401 - raised by submit
from router.sched.allocator import BlockAllocator
from router.sched.embeds import EmbedQueue
from router.sched.lanes import Lane, Lanes
from router.sched.scheduler_stats import SchedulerStats
from router.sched.streams import Entry, RequestCancelled, RequestStream

log = logging.getLogger(__name__)
RECOVERY_POLL_S = 0.5


def lookahead_for(setting: str, device_type: str) -> bool:
    """--lookahead auto: on, on every device. On an accelerator the host is free to answer during
    the forward; on a 2-core CPU, where the forward takes both cores, it still never lost and won a
    lone request 8-13 % (make run's --single-process, docs/benchmarks.md#lookahead-on-cpu)."""
    return setting == "on" or setting == "auto"


class Scheduler:
    """`rewarm`, when given, runs once the shards answer Health again after they were unreachable
    (a restarted shard has lost its warmed graphs and batches) and answers their KV capacity in
    tokens; `on_step(phase, batch_size)` is called for every prefill and decode, for metrics."""

    def __init__(
        self,
        client: ShardClient,
        allocator: BlockAllocator,
        limits: ServingLimits,
        rewarm: Callable[[], Awaitable[int | None]] | None = None,
        on_step: Callable[[str, int], None] | None = None,
        chunking: bool = False,
        lookahead: bool = True,
    ):
        self.client, self.allocator, self.limits = client, allocator, limits
        # Async scheduling: a Decode sent while nothing waits asks the shards to run the batch's
        # next forward right after answering (engine/serving/lookahead.py); the next iteration then
        # decodes that batch before admitting anyone, so the early forward is used whole, not split.
        self.lookahead, self._ahead_pending = lookahead, False
        self.chunking = chunking  # the shards chunk long prompts (Info.support_chunking)
        self.rewarm, self.on_step = rewarm, on_step
        self.stats = SchedulerStats()
        self.available = (
            True  # False from a failed step whose shards were unreachable until they answer again
        )
        self._queue: deque[Entry] = deque()
        self._embeds = EmbedQueue()  # Embed calls, run between steps (router/sched/embeds.py)
        self._entries: dict[int, Entry] = {}  # submitted and not yet released, by request id
        self._lane = Lane(0)  # the running batch, when the shards have one stage
        self._batch_ids = itertools.count(1)
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._stopped: BaseException | None = None  # why a stopped scheduler refuses new requests
        # A batch in flight per pipeline stage (router/sched/lanes.py); None: one batch, as TGI.
        stages = getattr(client, "pipeline_stages", 1)
        self._lanes = Lanes(self, stages) if isinstance(stages, int) and stages > 1 else None
        if self._lanes is not None:
            self.lookahead = False  # the lanes keep the stages busy instead

    # --- the caller's side ------------------------------------------------------------------

    @property
    def queue_length(self) -> int:
        return len(self._queue)

    @property
    def running_count(self) -> int:
        if self._lanes is not None:
            return self._lanes.running_count
        return self._lane.size

    def adapters(self) -> tuple[set[str], set[str]]:
        """The LoRA adapters of the running requests, and of the queued ones."""
        queued = {entry.id for entry in self._queue}
        running, waiting = set(), set()
        for entry in self._entries.values():
            if entry.request.adapter_id:
                (waiting if entry.id in queued else running).add(entry.request.adapter_id)
        return running, waiting

    @property
    def outstanding(self) -> int:
        """Requests submitted and not yet released: queued or running."""
        return len(self._entries)

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="scheduler")

    async def stop(self, error: BaseException | None = None) -> None:
        """Stop the loop; requests still queued or running end with `error` (RequestCancelled when
        the server stops, ShardsUnavailable when the shards are gone for good)."""
        if self._task is None:
            return
        # A request submitted after this would wait for a loop that no longer runs.
        self._stopped = error or RequestCancelled("the scheduler stopped")
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        self._task = None
        await self._abandon_all(self._stopped)

    def submit(
        self, request: Request, input_length: int, token_ids: list[int] | None = None
    ) -> RequestStream:
        """Queue a request (without blocks: the scheduler allocates them) and return its stream.
        Raises ValueError for a request that can never run, Overloaded or ShardsUnavailable."""
        return self.submit_group([request], input_length, token_ids)[0]

    def submit_group(
        self, requests: list[Request], input_length: int, token_ids: list[int] | None = None
    ) -> list[RequestStream]:
        """Queue requests with one prompt, admitted together to share its prefill
        (router/sched/fanout.py)."""
        fanout.check_group(
            requests, input_length, self.limits, self.allocator, self._entries, self.chunking
        )
        self.check_admission(len(requests))
        group = requests[0].id if len(requests) > 1 else None
        entries = [Entry(r, input_length, token_ids=token_ids, group=group) for r in requests]
        self._entries.update((entry.id, entry) for entry in entries)
        self._queue.extend(entries)
        self._wake.set()
        return [RequestStream(self, entry) for entry in entries]

    def check_admission(self, count: int = 1) -> None:
        """Raise Overloaded or ShardsUnavailable now: callers ask before expensive work
        (tokenizing)."""
        if self._stopped is not None:
            raise ShardsUnavailable(f"the server is stopping ({self._stopped}): retry elsewhere")
        if not self.available:
            raise ShardsUnavailable("the shards are unavailable (restarting?): retry later")
        if len(self._entries) + count > self.limits.max_concurrent_requests:
            raise Overloaded(
                f"Model is overloaded: {len(self._entries)} requests are queued or running"
            )

    async def embed(self, inputs: list[EmbedInput]) -> list[Embedding]:
        """The inputs' embeddings, computed between two steps. Raises ValueError where the shards
        cannot serve them, ShardsUnavailable, or the shards' ShardError."""
        if self._lanes is not None:
            raise ValueError("embeddings are not served by pipeline-parallel shards yet")
        self.check_admission(1 + len(self._embeds))  # the waiting ones count as requests
        future = self._embeds.submit(inputs)
        self._wake.set()
        return await future

    def cancel(self, request_id: int) -> None:
        entry = self._entries.get(request_id)
        if entry is not None:
            self.cancel_entry(entry)

    def cancel_entry(self, entry: Entry) -> None:
        """Cancel by entry, not by id: a stream's caller may already have reused the id."""
        if not entry.live:
            return
        entry.cancelled = True
        entry.outbox.put_nowait(RequestCancelled(f"request {entry.id} was cancelled"))
        if entry in self._queue:  # never reached a shard: nothing to filter, no blocks held
            self._queue.remove(entry)
            self._entries.pop(entry.id, None)
        # A running one stays listed until the loop filters it out at its next step.
        self._wake.set()

    # --- the loop -----------------------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            try:
                await self._step()
            except asyncio.CancelledError:
                raise
            except Exception as error:  # noqa: BLE001 - a bug must not leave streams hanging forever
                log.exception("scheduler step failed")
                await self._abandon_running(error)

    async def _step(self) -> None:
        if not self.available:
            await self._recover()
            return
        if len(self._embeds):
            await self._embeds.run(self.client, self.on_step)
        if self._lanes is not None:
            await self._lanes.step()  # until the shards become unavailable
            return
        await self.step_lane(self._lane, self._admit_after_lookahead)

    def _admit_after_lookahead(self, lane: Lane) -> tuple[Batch, list[Entry]] | None:
        # A forward the shards ran ahead for the running batch is decoded whole before anyone joins.
        if self._ahead_pending and lane.running is not None:
            return None
        return self.next_batch()

    async def step_lane(
        self, lane: Lane, admit: Callable[[Lane], tuple[Batch, list[Entry]] | None]
    ) -> None:
        """One iteration of the loop on one lane's batch (the only lane, or a pipeline lane): drop
        its cancelled requests, prefill what `admit` takes from the queue, then decode."""
        if lane.running is not None:
            lane.running = await self._keep(lane.running, self._entries_of([lane.running]))
        if not self.available:
            return
        new = admit(lane)
        if new is not None:
            prefilled = await self._confined_prefill(*new)
            if lane.running is None and len(prefilled) <= 1:
                lane.running = prefilled[0] if prefilled else None
                return
            batches = ([lane.running] if lane.running is not None else []) + prefilled
        elif lane.running is not None:
            batches = [lane.running]
        else:
            await self._idle()
            return
        batches, grown = await self._grow(batches)
        lane.running = await self._decode(batches, grown) if batches else None

    async def _recover(self) -> None:
        """Hold the queue until every shard answers Health again, re-warm them, then serve on."""
        await self._abandon_running(
            ShardsUnavailable("the shards became unavailable during generation")
        )
        while True:
            try:
                await self.client.health()
                capacity = await self.rewarm() if self.rewarm is not None else None
                break
            except ShardError as error:
                log.debug("shards still unavailable: %s", error)
                await asyncio.sleep(RECOVERY_POLL_S)
        self._resize(
            capacity
            if capacity is not None
            else (self.allocator.num_blocks - 1) * self.allocator.block_size
        )
        log.warning("the shards answer again: serving the %d queued request(s)", len(self._queue))
        self.available = True

    def _resize(self, capacity_tokens: int) -> None:
        """New shards may have another KV capacity and hold no cached prefix. No request holds
        blocks now (all were requeued without them): the allocator is replaced."""
        size, blocks = self.allocator.block_size, capacity_tokens // self.allocator.block_size + 1
        assert self.allocator.idle, "resizing an allocator with blocks in use"
        if blocks != self.allocator.num_blocks:
            log.warning(
                "the shards' KV capacity is now %d blocks (was %d)",
                blocks,
                self.allocator.num_blocks,
            )
        fresh = type(self.allocator)(blocks, size)  # restarted shards hold no cached prefix either
        if getattr(self.allocator, "listener", None) is not None:
            fresh.listen(self.allocator.listener)  # the KV event subscribers start over too
        self.allocator = fresh

    async def _idle(self) -> None:
        # Nothing running and nothing admissible: sleep until a submit or a cancel changes that.
        self._wake.clear()
        await self._wake.wait()

    def wake(self) -> None:
        """Wake an idle loop (or lane) to look at the queue again."""
        self._wake.set()

    def next_batch(self, running: int | None = None) -> tuple[Batch, list[Entry]] | None:
        """`running`: the rows of the batch it joins (a lane's), else of the running batch."""
        running = self.running_count if running is None else running
        room = batching.Room(self.limits, running, self.chunking, self._longest_resume())
        taken = batching.next_batch(self._queue, self.allocator, room, self.stats)
        return (self._batch(taken), taken) if taken else None

    def _batch(self, entries: list[Entry]) -> Batch:
        return batching.make_batch(next(self._batch_ids), entries)

    async def _confined_prefill(self, batch: Batch, entries: list[Entry]) -> list[CachedBatch]:
        """Prefill new requests; whatever goes wrong there ends those requests only (the running
        batch decodes on). A batch the shard refuses is tried again one request at a time, so
        that only the request at fault fails."""
        self.stats.prefill_sizes[len(entries)] += 1
        self._notify("prefill", len(entries))
        self.stats.prefills_while_running += self.running_count > 0
        try:
            return await self._prefill(batch, entries, alone=len(entries) == 1)
        except Exception as error:  # noqa: BLE001 - not a ShardError: a bug, confined to these requests
            log.exception("prefill of batch %d failed", batch.id)
            await self._fail([batch.id], entries, error)
            return []

    async def _prefill(self, batch: Batch, entries: list[Entry], alone: bool) -> list[CachedBatch]:
        resume = {e.id: list(e.generated) for e in entries if e.generated}
        try:
            generations, cached = await (
                self.client.prefill(batch, resume=resume) if resume else self.client.prefill(batch)
            )
        except ShardError as error:
            if error.code == grpc.StatusCode.UNAVAILABLE:
                self._requeue(entries, error)
                return []
            if error.code == grpc.StatusCode.INVALID_ARGUMENT and not alone:
                return await self._prefill_one_by_one(batch, entries, error)
            await self._fail([batch.id], entries, error)  # only the new batch was touched
            return []
        kv_blocks.prefilled(self.allocator, entries)
        kept = await self._settle(generations, cached, entries)
        return [kept] if kept is not None else []

    async def _prefill_one_by_one(
        self, batch: Batch, entries: list[Entry], error: ShardError
    ) -> list[CachedBatch]:
        log.warning(
            "prefill of batch %d refused (%s): trying its %d requests one by one",
            batch.id,
            error,
            len(entries),
        )
        await self._clear([batch.id])
        prefilled = []
        for entry in entries:
            if not self.available:  # the shards went away meanwhile: the rest wait with the queue
                self._requeue([entry], error)
            elif entry.live:
                prefilled += await self._prefill(self._batch([entry]), [entry], alone=True)
            else:
                self._release(entry)
        return prefilled

    def requeue_batch(self, batch: CachedBatch, error: ShardError) -> None:
        """A batch the shards no longer hold: its requests wait in the queue (see _requeue)."""
        self._requeue(self._entries_of([batch]), error)

    def _requeue(self, entries: list[Entry], error: ShardError) -> None:
        """The shards went away: these requests wait at the head of the queue, in their order, for
        the shards to come back (nothing is lost in a restart). One that had generated tokens is
        resumed then: its prompt and those tokens are prefilled again, and its stream goes on."""
        started = sum(bool(e.generated) for e in entries if e.live)
        log.warning(
            "the shards are unavailable (%s): holding %d new request(s) and %d to resume",
            error,
            len(entries) - started,
            started,
        )
        self.available = False
        if self._lanes is not None:
            self._wake.set()  # an idle lane stops too
        for entry in reversed(entries):
            if entry.allocation is not None:
                self.allocator.free(entry.allocation)
                entry.allocation = None
            if entry.live and entry.generated and not self._resumable(entry):
                self._finish(entry, error)
            if entry.live:
                self._queue.appendleft(entry)
            else:
                self._release(entry)

    def _resumable(self, entry: Entry) -> bool:
        """Only shards that read the generated tokens resume (ours, not TGI's); they must fit a
        prefill."""
        longest = self._longest_resume()
        return longest is not None and entry.prefill_length <= longest

    def _longest_resume(self) -> int | None:
        """The longest prompt + generated tokens the shards can resume (None: they resume
        nothing)."""
        if not getattr(self.client, "resumes", False):
            return None
        return (
            self.limits.max_input_tokens
            if self.chunking
            else min(self.limits.max_input_tokens, self.limits.max_prefill_tokens)
        )

    async def _decode(
        self, batches: list[CachedBatch], grown: dict | None = None
    ) -> CachedBatch | None:
        entries = self._entries_of(batches)
        self.stats.decode_sizes[sum(b.size for b in batches)] += 1
        self._notify("decode", sum(b.size for b in batches))
        look_ahead = self.lookahead and not self._queue
        self._ahead_pending = False
        try:
            generations, cached = await self.client.decode(
                batches, *([grown] if grown else []), **({"look_ahead": True} if look_ahead else {})
            )
        except ShardError as error:
            await self._fail([b.id for b in batches], entries, error)
            return None
        self._ahead_pending = look_ahead and cached is not None
        return await self._settle(generations, cached, entries)

    async def _grow(self, batches: list[CachedBatch]) -> tuple[list[CachedBatch], dict]:
        """The batches to decode (preemption may drop requests) and the blocks each request
        gained (request id -> blocks)."""
        grown: dict[int, list[int]] = {}
        while victim := preemption.grow(self.allocator, self._entries_of(batches), grown):
            batches = await self._drop(victim, batches)
            grown.pop(victim.id, None)
            if preemption.park(self.allocator, victim, self.stats):
                self._queue.appendleft(victim)
            else:
                self._release(victim)
        return batches, grown

    async def _drop(self, victim: Entry, batches: list[CachedBatch]) -> list[CachedBatch]:
        """The batches without `victim`, which the shards drop (FilterBatch, or ClearCache)."""
        kept = []
        for cached in batches:
            if victim.id not in cached.request_ids:
                kept.append(cached)
                continue
            rest = [i for i in cached.request_ids if i != victim.id]
            try:
                if rest:
                    kept.append(await self.client.filter_batch(cached.id, rest))
                else:
                    await self.client.clear_cache(cached.id)
            except ShardError as error:
                await self._fail([cached.id], self._entries_of([cached]), error)
        return kept

    def _notify(self, phase: str, size: int) -> None:
        if self.on_step is not None:
            self.on_step(phase, size)

    def _entries_of(self, batches: list[CachedBatch]) -> list[Entry]:
        return [self._entries[i] for b in batches for i in b.request_ids if i in self._entries]

    # --- after a step ---------------------------------------------------------------------------

    async def _settle(
        self, generations: list[Generation], cached: CachedBatch | None, entries: list[Entry]
    ) -> CachedBatch | None:
        self._dispatch(generations)
        return await self._keep(cached, entries)

    def _dispatch(self, generations: list[Generation]) -> None:
        for generation in generations:
            entry = self._entries.get(generation.request_id)
            if entry is None or not entry.live:
                continue  # cancelled: its consumer is gone
            entry.outbox.put_nowait(generation)
            kv_blocks.first_token(self.allocator, entry)
            entry.generated.extend(generation.tokens.ids)
            entry.finished = generation.generated_text is not None

    async def _keep(self, cached: CachedBatch | None, entries: list[Entry]) -> CachedBatch | None:
        """The batch without its finished and cancelled requests; those that left give back
        blocks."""
        kept = await self._prune(cached, entries)
        listed = set(kept.request_ids) if kept is not None else set()
        for entry in entries:
            if entry.id not in listed:
                if entry.live:  # the shard dropped it without a last generation
                    self._finish(
                        entry,
                        ShardError(
                            grpc.StatusCode.INTERNAL,
                            f"the shard dropped request {entry.id} unfinished",
                        ),
                    )
                self._release(entry)
        return kept

    async def _prune(self, cached: CachedBatch | None, entries: list[Entry]) -> CachedBatch | None:
        if cached is None:
            return None
        keep = [i for i in cached.request_ids if i in self._entries and self._entries[i].live]
        if len(keep) == len(cached.request_ids):
            return cached
        try:
            if keep:
                return await self.client.filter_batch(cached.id, keep)
            await self.client.clear_cache(cached.id)
        except ShardError as error:
            await self._fail([cached.id], entries, error)
        return None

    async def _fail(self, batch_ids: list[int], entries: list[Entry], error: Exception) -> None:
        """A step failed: drop its batches on the shard, and every request in them gets the error;
        when the shards are gone, they wait for the restart instead (`_requeue`)."""
        self.stats.failed_steps += 1
        log.warning("shard step on batches %s failed: %s", batch_ids, error)
        if getattr(error, "code", None) == grpc.StatusCode.UNAVAILABLE:
            self._requeue(
                entries, error
            )  # the next iteration waits for them; queued requests wait too
            return
        await self._clear(batch_ids)
        for entry in entries:
            if entry.live:
                self._finish(entry, error)
            self._release(entry)

    async def _clear(self, batch_ids: list[int]) -> None:
        for batch_id in batch_ids:
            try:
                await self.client.clear_cache(batch_id)
            except ShardError as clear_error:
                log.warning("ClearCache(%d) failed too: %s", batch_id, clear_error)

    def _finish(self, entry: Entry, item: Generation | BaseException) -> None:
        entry.finished = True
        entry.outbox.put_nowait(item)

    def _release(self, entry: Entry) -> None:
        if entry.allocation is not None:
            kv_blocks.finished(self.allocator, entry)
            self.allocator.free(entry.allocation)
            entry.allocation = None
        if self._entries.get(entry.id) is entry:
            del self._entries[entry.id]

    # --- giving up --------------------------------------------------------------------------------

    async def _abandon_running(self, error: BaseException) -> None:
        """After an unexpected failure the shard's batches are unknown: clear them all."""
        in_flight = [e for e in self._entries.values() if e not in self._queue]
        if self._lane.running is not None or in_flight:  # an idle stop leaves the shard alone
            try:
                await self.client.clear_cache(None)
            except ShardError as clear_error:
                log.warning("ClearCache failed: %s", clear_error)
        self._lane.running = None
        if self._lanes is not None:
            self._lanes.forget()
        for entry in in_flight:
            if entry.live:
                self._finish(entry, error)
            self._release(entry)

    async def _abandon_all(self, error: BaseException) -> None:
        self._embeds.fail_all(error)
        for entry in list(self._queue):
            self._finish(entry, error)
            self._release(entry)
        self._queue.clear()
        await self._abandon_running(error)
