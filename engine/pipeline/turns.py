"""Several steps in flight on one pipeline shard: whose turn it is to run shard code.

A pipeline shard holds up to one step per stage at once (the router keeps that many batches in
flight, docs/multinode.md). Each step runs on a thread of its own, but only the thread holding
the turn runs shard code, so the shard stays as single-threaded as it was. A pipelined decode
gives the turn away while it waits for its logits from the last stage (PipelineStage.forward):
the next step then launches its own forward, so that stage 0 runs batch B's layers while the last
stage runs batch A's.

Every rank must issue its torch.distributed operations in the same order, so steps take their
first turn in the order the router issued them (`order`, from 1 since Warmup; the router sends
it in each Prefill and Decode): step n + 1 starts once step n has given its turn away or ended,
on every rank alike. A step gives its turn away at most once, at its only forward: what follows
(sampling, stopping) issues no collective, so it may run whenever the turn comes back.
Calls without an order (0: FilterBatch, ClearCache, Info, or a router that sends one step at a
time) take the turn whenever it is free."""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

log = logging.getLogger(__name__)

# A step whose predecessor never comes (its RPC was lost on the way) starts after this long: the
# ranks have diverged then anyway, and the router's failure handling takes over.
MISSING_STEP_WAIT_S = 30.0


@dataclass
class Turn:
    order: int  # the step's place in the router's order; 0: unordered
    released: bool = False  # it gave its turn to the next step (its forward is launched)


class StepTurns:
    def __init__(self, missing_step_wait_s: float = MISSING_STEP_WAIT_S):
        self._cond = threading.Condition()
        self._holder: int | None = None  # the thread that runs shard code now
        self._next = 1  # the order of the next step to start
        self._mine = threading.local()  # the Turn of the calling thread's step
        self.missing_step_wait_s = missing_step_wait_s

    def reset(self) -> None:
        """After Warmup the router numbers its steps from 1 again."""
        with self._cond:
            self._next = 1
            self._cond.notify_all()

    @property
    def current(self) -> Turn | None:
        """The calling thread's step (None outside one)."""
        return getattr(self._mine, "turn", None)

    @contextmanager
    def turn(self, order: int = 0):
        """Run the body holding the turn; re-entered by a thread that holds it already (a step
        run by Warmup, the device lock's methods called by a servicer that took the turn)."""
        if self._holder == threading.get_ident():
            yield
            return
        turn = self._acquire(order)
        try:
            yield
        finally:
            self._release(turn)

    @contextmanager
    def given_away(self):
        """While the body waits (for another stage's result), the next step may run: the caller's
        turn goes to it, and comes back when free once the body is done."""
        turn = self.current
        with self._cond:
            turn.released = True
            self._advance(turn.order)
            self._holder = None
            self._cond.notify_all()
        try:
            yield
        finally:
            with self._cond:
                while self._holder is not None:
                    self._cond.wait()
                self._holder = threading.get_ident()

    def _acquire(self, order: int) -> Turn:
        deadline = time.monotonic() + self.missing_step_wait_s
        with self._cond:
            while self._holder is not None or (order > self._next and time.monotonic() < deadline):
                self._cond.wait(timeout=max(deadline - time.monotonic(), 0.05))
            if order > self._next:
                log.warning("step %d starts without step %d, which never came", order, self._next)
            self._holder = threading.get_ident()
        turn = Turn(order)
        self._mine.turn = turn
        return turn

    def _release(self, turn: Turn) -> None:
        self._mine.turn = None
        with self._cond:
            if not turn.released:
                self._advance(turn.order)
            self._holder = None
            self._cond.notify_all()

    def _advance(self, order: int) -> None:
        if order:
            self._next = max(self._next, order + 1)
