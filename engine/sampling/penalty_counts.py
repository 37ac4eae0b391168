"""Each sequence's token counts for the penalties, held on the device and updated in place.

The repetition and frequency penalties read how often each token occurs in a row's history
(prompt and generated tokens), the presence penalty whether a token was generated. Counting the
histories on the host every step means list work as long as the histories and a [rows, vocab] copy
to the device per step. Here each sequence with a penalty owns a slot of two [slots + 1, vocab]
float32 tables on the device (every token; generated tokens). The sampler's graph gathers its rows'
slots (an index of [rows]), and after choosing adds each row's new token to its slot (`index_put_`
with accumulate at [rows]): the same shapes every step, whatever the histories.

A slot is rebuilt from the host's history, one graph of one fixed shape per slot, only when its
occupant changes: a sequence new to the sampler (admitted, resumed after a preemption or a shard
restart, an `n` sibling), or one whose history grew other than by the sampler's own choice
(speculative tokens accepted by the rejection rule). Rows without a penalty and padding rows read
and write the last slot (scratch), whose counts no penalty reads: their penalties are neutral.
"""

from __future__ import annotations

import torch

from engine.devices.row_merge import mark_step

TABLE_DTYPE = torch.float32  # counts are small integers: exact in float32


def table_bytes(slots: int, vocab: int) -> int:
    """Device bytes of the two [slots + 1, vocab] tables (the memory profile reserves them)."""
    return 2 * (slots + 1) * vocab * torch.empty((), dtype=TABLE_DTYPE).element_size()


class PenaltyCounts:
    """The two count tables and who holds each slot. `slots`: the most rows a sampler runs on."""

    def __init__(self, adapter, slots: int, vocab: int):
        self.adapter, self.slots, self.vocab = adapter, slots, vocab
        self.scratch = slots
        self.every = adapter.zeros((slots + 1, vocab), TABLE_DTYPE)  # prompt and generated
        self.generated = adapter.zeros((slots + 1, vocab), TABLE_DTYPE)
        self._owner: list = [None] * slots  # the SamplingState whose counts a slot holds
        self._counted: list = [None] * slots  # (history length, last token) they are counts of
        self._used = [0] * slots  # when each slot was last read: the oldest is taken first
        self._clock = 0
        self.rebuilds = 0

    def slots_for(self, states, histories, prompt_lens, needed: list[bool]) -> list[int]:
        """Each row's slot (scratch where no penalty reads it), rebuilding every slot whose counts
        are not those of its row's history."""
        self._clock += 1
        rows, taken = [], set()
        for state, history, prompt_len, need in zip(
            states, histories, prompt_lens, needed, strict=True
        ):
            if not need:
                rows.append(self.scratch)
                continue
            slot = self._slot_of(state, taken)
            if self._counted[slot] != (len(history), history[-1]):
                self._rebuild(slot, state, history, prompt_len)
            taken.add(slot)
            self._used[slot] = self._clock
            rows.append(slot)
        return rows

    def counted(self, slots: list[int], histories, chosen: list[int]) -> None:
        """The sampler's graph added chosen[i] to slots[i]: its history is one token longer."""
        for slot, history, token in zip(slots, histories, chosen):
            if slot != self.scratch:
                self._counted[slot] = (len(history) + 1, token)

    def _slot_of(self, state, taken: set) -> int:
        for slot, owner in enumerate(self._owner):
            if owner is state:
                return slot
        free = [s for s in range(self.slots) if s not in taken]
        slot = min(free, key=lambda s: (self._owner[s] is not None, self._used[s]))
        self._owner[slot], self._counted[slot] = state, None
        return slot

    def _rebuild(self, slot: int, state, history: list[int], prompt_len: int) -> None:
        every = _counts(history, self.vocab)
        generated = _counts(history[prompt_len:], self.vocab)
        index = self.adapter.to_device(torch.tensor([slot], dtype=torch.long))
        self.every.index_copy_(0, index, self.adapter.to_device(every))
        self.generated.index_copy_(0, index, self.adapter.to_device(generated))
        mark_step(self.adapter)  # one graph per slot rebuilt, of one shape
        self._owner[slot], self._counted[slot] = state, (len(history), history[-1])
        self.rebuilds += 1

    def warm(self) -> None:
        """Compile the rebuild's graph (on the scratch slot, which nobody reads)."""
        index = self.adapter.to_device(torch.tensor([self.scratch], dtype=torch.long))
        row = self.adapter.to_device(torch.zeros(1, self.vocab))
        self.every.index_copy_(0, index, row)
        self.generated.index_copy_(0, index, row)
        mark_step(self.adapter)


def _counts(tokens: list[int], vocab: int) -> torch.Tensor:
    """[1, vocab] float32: how often each token id occurs (ids past the vocabulary are dropped)."""
    counts = torch.bincount(torch.tensor(tokens, dtype=torch.long), minlength=vocab)
    return counts[:vocab].float().unsqueeze(0)


def penalty_counts(runner, adapter, rows: int, vocab: int) -> PenaltyCounts:
    """The runner's tables, sized for its largest decode batch (made on first use, after the KV
    cache: engine/warmup/memory.py leaves them room); without a runner (a lone sampler call) a
    table for `rows` rows."""
    if runner is None:
        return PenaltyCounts(adapter, rows, vocab)
    slots = max(bucket.batch_size for bucket in runner.plan.decode)
    counts = getattr(runner, "penalty_counts", None)
    if counts is None or (counts.adapter, counts.slots, counts.vocab) != (adapter, slots, vocab):
        counts = runner.penalty_counts = PenaltyCounts(adapter, slots, vocab)  # a new plan
    return counts
