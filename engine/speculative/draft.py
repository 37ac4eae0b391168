"""A draft model proposer: a smaller causal LM with the target's tokenizer guesses each row's next
K tokens, one draft forward per token, before the target verifies them in one forward.

The draft has its own paged KV cache, with as many blocks as the target's and indexed by the same
block table: a sequence's blocks hold its target KV in the target's cache and its draft KV in the
draft's, so the draft needs no allocator of its own. Its buckets (prefill, decode and verify
widths) are planned for at most SPECULATE_MAX_BATCH rows and warmed with the target's, under shape
keys of their own ("draft", kind, bucket), so that strict mode covers them too.

Catching up: the draft's KV is valid for a row's first `valid` tokens. The step that prefills a
prompt primes the draft with all of it but the latest token (`prime`, where the batch is small
enough to speculate). With prefix caching the draft's blocks are reused as the target's are: the
draft keeps its own record of what each full block holds (a BlockContents over token ids alone,
since the draft sees no adapter and no image), a block being forgotten before every draft forward
that may write it, so a row starts after the blocks the draft already holds of it; and its plan
has context prefill buckets, so a prompt longer than the longest prefill is primed chunk by chunk,
each after the KV so far. Before proposing, every token from `valid` to the row's latest is fed:
in prefills where the row is new, or (with prefix caching) more than a verify forward behind, as
after plain steps; otherwise (a step's accepted tokens, one or two usually) in a verify forward of
their own width, CATCH_UP_WIDTH. The last forward's logits give the first proposal. A lone greedy
row on the CPU kernels does its catch-up and all its proposals in one fused call
(DraftRunner.greedy_steps), where a forward also checks the tokens prompt lookup guesses come
next: each guess the draft chooses is a proposal without a forward of its own.
The draft's KV slots of rejected proposals are simply overwritten when the row catches up.

Proposals follow the row's own sampling: greedy rows take the draft's argmax (after the row's
penalties and biases), sampled rows draw from the draft's processed distribution q with a
generator of their own, seeded from the request's seed; step.py then accepts a draw with
min(1, p/q) and resamples a rejection from the normalized residual max(0, p - q).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from engine.errors import ModelLoadError
from engine.kv_cache import BlockContents, KVCache, blocks_needed
from engine.runner import DecodeInput, ModelRunner, PrefillInput
from engine.sampling.sampler import is_sampling, plain_greedy, process_scores
from engine.weights.placement import Placement

DRAFT_SEED_SALT = 0x5DEECE66D  # the draft's generator: the request's seed, salted
# The draft's catch-up verify width: a step's accepted tokens are one (a rejection) or two (all
# accepted) new tokens to feed; buckets of their own spare them K - 1 padded tokens.
CATCH_UP_WIDTH = 2


class DraftRunner(ModelRunner):
    """The draft's runner. Its verify forwards only catch the draft up, and the next proposal
    needs the logits at each row's last fed token alone: its verify buckets (warmed and run
    alike) return [rows, vocab] there, the LM head over one position a row instead of K + 1."""

    @torch.inference_mode()
    def verify(self, bucket, seqs: list[PrefillInput]) -> torch.Tensor:
        self.padding.record("decode", len(seqs), bucket.batch_size, bucket)
        return self._run(("verify", bucket), *self._verify_tensors(bucket, seqs))[: len(seqs)]

    def _verify_tensors(self, bucket, seqs: list[PrefillInput]) -> tuple:
        return self._prefill_tensors(bucket.as_prefill, seqs)  # its logits: each row's last token

    def greedy_steps(self, seq, fed: list[int], position: int, count: int) -> list[int] | None:
        """A lone greedy row's next `count` proposals in one call of the model's fused kernel
        (FusedDecoder.greedy_steps: every forward's layers, norm, LM head and argmax): the first
        forward feeds `fed` at `position` on, the others each proposal in turn. `fed` is either
        the row's own tokens the draft has not seen (its catch-up, ending at the row's latest) or
        its first proposal. The tokens the runner's forwards one by one would choose, without
        their Python between steps (0.7-0.9 ms a draft step, and 1.4 ms a catch-up, on the
        2-core VM). A forward also feeds what prompt lookup over the row's tokens guesses comes
        next (up to FusedDecoder.guess_rows() rows a forward): each guess the draft would have
        chosen saves the forward of its own (input-grounded text repeats its prompt). Each
        forward is still a bucket of the plan (one row a decode bucket, more a verify bucket),
        counted and checked as decode and verify would. None where the model has no such kernel
        or a bucket it may need was not warmed: the caller loops."""
        fused = self.model.fused_decode
        if fused is None or not getattr(fused, "takes_greedy_steps", lambda: False)():
            return None
        if not self._forwards_warmed(seq, fed, position, count):
            return None
        guesses = count - 1 if self._guesses_warmed(seq, position, len(fed), count) else 0
        last = position + len(fed) + count - 1  # the last proposal's position, exclusive
        history = seq.token_ids[:position]
        start = time.perf_counter_ns()
        tokens, forwards = fused.greedy_steps(
            fed, position, count, seq.slots(0, last), history, guesses
        )
        self.forward_ns += time.perf_counter_ns() - start
        self._record_forwards(seq, fed, position, forwards)
        return tokens

    def _forward_shape(self, seq, at: int, rows: int, catching_up: bool):
        """(kind, bucket, blocks) of a fused forward of `rows` tokens from position `at`: a
        catch-up (the row's own tokens, a verify bucket as DraftModel._continue picks it) or one
        with guesses a verify bucket of its rows, one token a decode bucket."""
        if rows > 1 or catching_up:
            context_blocks = blocks_needed(at, self.block_size)
            return "verify", self.plan.verify_bucket(1, rows, context_blocks), context_blocks
        blocks = len(seq.blocks_through(at))
        return "decode", self.plan.decode_bucket(1, blocks), blocks

    def _warmed(self, shapes) -> bool:
        return all(b is not None and self.adapter.warmed((kind, b)) for kind, b, _ in shapes)

    def _forwards_warmed(self, seq, fed: list[int], position: int, count: int) -> bool:
        """Whether every forward greedy_steps runs without guesses has a warmed bucket: the
        first feeds `fed` (a catch-up where it ends at the row's latest token), each other one
        token."""
        catching_up = position + len(fed) == len(seq.token_ids)
        after = position + len(fed)
        shapes = [self._forward_shape(seq, position, len(fed), catching_up)]
        shapes += [self._forward_shape(seq, at, 1, False) for at in range(after, after + count - 1)]
        return self._warmed(shapes)

    def _guesses_warmed(self, seq, position: int, fed: int, count: int) -> bool:
        """Whether a forward with guesses, at any position it may start from, has a warmed verify
        bucket of every width it may feed."""
        if count < 2:
            return False
        firsts = range(position, position + fed + count - 2)
        # one position for each context length: the buckets depend on nothing else
        by_context = {blocks_needed(at, self.block_size): at for at in firsts}.values()
        widths = range(2, self.model.fused_decode.guess_rows() + 1)
        return self._warmed(
            [self._forward_shape(seq, at, w, False) for at in by_context for w in widths]
        )

    def _record_forwards(self, seq, fed: list[int], position: int, forwards) -> None:
        """Count each forward of a greedy_steps call (rows fed, proposals made) in its bucket (a
        decode shape recorded as well). A forward starts where the one before fed its last kept
        guess."""
        at = position
        for index, (rows, made) in enumerate(forwards):
            catching_up = index == 0 and position + len(fed) == len(seq.token_ids)
            kind, bucket, blocks = self._forward_shape(seq, at, rows, catching_up)
            if kind == "decode" and self.recorder is not None:
                self.recorder.decode(1, blocks)
            self.padding.record("decode", 1, bucket.batch_size, bucket)
            at += (len(fed) if index == 0 else 1) + made - 1


class DraftAdapter:
    """The target's device adapter with the draft's shapes kept apart: ("draft", kind, bucket)."""

    def __init__(self, adapter):
        self._adapter = adapter

    def __getattr__(self, name):
        return getattr(self._adapter, name)

    def reset(self) -> None:
        """The target's runner resets the shared adapter; the draft's must not undo its warmup."""

    def run(self, shape, fn, *args):
        return self._adapter.run(("draft", *shape), fn, *args)

    def warm(self, shape, fn, *args, graph: bool = True):
        return self._adapter.warm(("draft", *shape), fn, *args, graph=graph)

    def warmed(self, shape) -> bool:
        return ("draft", *shape) in self._adapter.shapes.warmed


@dataclass
class DraftRow:
    """One sequence's draft state: how many of its tokens the draft's KV holds, the proposals it
    wrote beyond them, and the generator its sampled proposals draw from."""

    valid: int = 0
    written: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    recorded: int = 0  # full blocks below `valid` in the draft's block record

    def settle(self, token_ids: list[int]) -> None:
        """Proposals the target accepted are now the row's tokens: their draft KV holds."""
        for token in self.written:  # the latest token is always fed again: its logits propose
            if self.valid < len(token_ids) - 1 and token_ids[self.valid] == token:
                self.valid += 1
            else:
                break
        self.written = []


def check_compatible(target_config, target_tokenizer, draft_config, draft_tokenizer, path) -> None:
    """A draft proposes token ids: it must share the target's vocabulary and tokenizer."""
    if draft_config.vocab_size != target_config.vocab_size:
        raise ModelLoadError(
            f"--draft-model {path}: its vocabulary has {draft_config.vocab_size} tokens, the "
            f"target's {target_config.vocab_size} (a draft needs the target's tokenizer)"
        )
    if draft_tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise ModelLoadError(
            f"--draft-model {path}: its tokenizer differs from the target's (a draft must "
            "share the target's tokenizer)"
        )


class DraftModel:
    """The loaded draft, and after warmup its runner (its KV cache and warmed buckets)."""

    def __init__(self, model, model_config, adapter, dtype, prefix_caching: bool = False):
        self.model, self.model_config, self.dtype = model, model_config, dtype
        self.adapter = DraftAdapter(adapter)
        self.runner: ModelRunner | None = None
        self.longest_prefill = 0
        self.prefix_caching = prefix_caching  # the shard's: then the draft reuses blocks too
        self.contents: BlockContents | None = None  # with prefix caching: what its blocks hold

    def release(self) -> None:
        """Before a new warmup: let go of the old cache."""
        self.runner = None
        self.model.bind_kv_cache([None] * self.model_config.num_layers)

    def warm(self, limits, num_blocks: int, block_size: int, num_tokens: int, graphless: bool):
        """Its own cache (the target's block count, so that block ids agree) and plan, warmed.
        With prefix caching the plan has context prefill buckets, for primes after reused blocks."""
        self.release()
        self.runner, self.longest_prefill = warmed_runner(
            DraftRunner,
            self.model,
            self.model_config.num_layers,
            self.adapter,
            self.dtype,
            (limits, num_blocks, block_size, num_tokens, graphless),
            extra_widths=(CATCH_UP_WIDTH,),
            context=self.prefix_caching,
        )
        self.contents = BlockContents(block_size) if self.prefix_caching else None
        self.width = num_tokens + 1

    @torch.inference_mode()
    def prime(self, sequences: list) -> None:
        """In the step that prefills their prompts: the draft's KV of each prompt but its latest
        token, so that a row's first speculative step feeds the draft one token, not its whole
        prompt (the prompt's cost belongs to its prefill, not to the running batch's decode)."""
        primed = []
        for seq in sequences:
            state = _row_state(seq)
            if self.runner is None or state.valid > 0 or len(seq.token_ids) < 2:
                continue
            self._claim(seq, state)
            primed.append(seq)
        fed = [s for s in primed if s.speculation.valid < len(s.token_ids) - 1]
        if fed:
            self._prefill_rows(fed, [len(s.token_ids) - 1 for s in fed])
        for seq in primed:
            self._record(seq)

    def _claim(self, seq, state: DraftRow) -> None:
        """Before the draft's forwards of a row: a row not yet begun starts after the blocks the
        draft already holds of it (never past its latest token, which is fed to propose), and the
        row's blocks from its first unwritten position on are forgotten."""
        if state.valid == 0:
            state.valid = self._held(seq, len(seq.token_ids) - 1)
        self._forget_from(seq, state.valid)

    def _prefill_rows(self, seqs: list, ends: list[int]) -> list:
        """Each row's tokens from its `valid` to its end, in prefills of at most the longest
        prefill bucket, each after the row's KV so far as context; the logits at each row's end
        (a host copy). Without prefix caching the plan has no context buckets: one prefill from
        the start, as far as the longest bucket reaches (the catch-up feeds the rest)."""
        logits: list = [None] * len(seqs)
        pending = list(range(len(seqs)))
        while pending:
            chunks = {}
            for k in pending:
                seq, valid = seqs[k], seqs[k].speculation.valid
                end = min(ends[k], valid + self.longest_prefill)
                if not self._prefill_fits(valid, end - valid):
                    continue  # context past a prompt's (a resumed row): the catch-up feeds it
                chunks[k] = PrefillInput(
                    seq.token_ids[valid:end],
                    seq.slots(valid, end),
                    context_slots=seq.slots(0, valid),
                )
            pending, inputs = list(chunks), list(chunks.values())
            if not inputs:
                break
            out = host_copy(self.runner.prefill(inputs).logits)
            for row, (k, fed) in enumerate(zip(pending, inputs)):
                seqs[k].speculation.valid += len(fed.token_ids)
                logits[k] = out[row]
            pending = [
                k for k in pending if self.prefix_caching and seqs[k].speculation.valid < ends[k]
            ]
        return logits

    def _held(self, seq, last: int) -> int:
        """Tokens from the first whose draft KV the draft's blocks already hold (whole blocks of
        the row's tokens before `last`); 0 without prefix caching."""
        if self.contents is None:
            return 0
        blocks = last // self.runner.block_size
        return self.contents.held(seq.blocks, seq.token_ids, None, blocks) * self.runner.block_size

    def _forget_from(self, seq, position: int) -> None:
        """The row's blocks from the one holding `position` on are about to be written: the
        record no longer vouches for them (another row's tokens may have been there)."""
        if self.contents is not None:
            self.contents.forget(seq.blocks[position // self.runner.block_size :])

    def _record(self, seq) -> None:
        """The row's full blocks below its `valid` hold its tokens' draft KV."""
        state = seq.speculation
        full = state.valid // self.runner.block_size
        if self.contents is not None and full > state.recorded:
            self.contents.record(seq.blocks, seq.token_ids, None, state.valid)
            state.recorded = full

    @torch.inference_mode()
    def propose(self, sequences: list, rooms: list[int]):
        """Up to rooms[i] tokens for each row, and for sampled rows the draft's distribution q at
        each proposal ([vocab] each; None for greedy rows)."""
        proposals: list[list[int]] = [[] for _ in sequences]
        dists: list[list | None] = [None] * len(sequences)
        rows = [i for i, room in enumerate(rooms) if room > 0]
        if not rows or self.runner is None:
            return proposals, dists
        states = [_row_state(sequences[i]) for i in rows]
        for i, state in zip(rows, states):  # accepted proposals first: then what gets written
            state.settle(sequences[i].token_ids)
            self._claim(sequences[i], state)
        out = self._propose_rows(sequences, rooms, rows, states, proposals, dists)
        for i in rows:
            self._record(sequences[i])
        return out

    def _propose_rows(self, sequences, rooms, rows, states, proposals, dists):
        if len(rows) == 1 and plain_greedy(sequences[rows[0]].sampling):
            folded = self._propose_folded(sequences[rows[0]], states[0], rooms[rows[0]])
            if folded is not None:
                proposals[rows[0]] = folded
                states[0].written = folded[:-1]  # the last one was never fed to the draft
                return proposals, dists
        logits = self._catch_up([sequences[i] for i in rows], states)
        live = [k for k, row_logits in enumerate(logits) if row_logits is not None]
        if len(live) == 1 and plain_greedy(sequences[rows[live[0]]].sampling):
            live = self._propose_greedy(
                sequences[rows[live[0]]],
                logits[live[0]],
                proposals[rows[live[0]]],
                rooms[rows[live[0]]],
                live,
            )
        while live:
            seqs = [sequences[rows[k]] for k in live]
            chosen = self._choose(
                seqs,
                torch.stack([logits[k] for k in live]) if len(live) > 1 else logits[live[0]][None],
                [proposals[rows[k]] for k in live],
                [states[k] for k in live],
            )
            for k, (token, q) in zip(live, chosen):
                i = rows[k]
                proposals[i].append(token)
                if q is not None:
                    dists[i] = (dists[i] or []) + [q]
            live = [k for k in live if len(proposals[rows[k]]) < rooms[rows[k]]]
            if live:
                outs = self.runner.decode(
                    [self._next_input(sequences[rows[k]], proposals[rows[k]]) for k in live]
                )
                outs = host_copy(outs)  # proposals are chosen on the host (float64, row lists)
                logits = dict(zip(live, outs))
        for k, i in enumerate(rows):
            if proposals[i]:
                states[k].written = proposals[i][:-1]  # the last one was never fed to the draft
        return proposals, dists

    def _propose_folded(self, seq, state: DraftRow, room: int) -> list[int] | None:
        """A lone greedy row already in the draft's KV: its catch-up (the one or two tokens since
        the draft's last forward) and all its proposals in one fused call. None where that call
        does not run (no kernel, an unwarmed bucket, a longer catch-up): the caller catches up
        and proposes as usual. (`propose` settled the row.)"""
        pending = seq.token_ids[state.valid :]
        # Up to 2: the catch-up's verify bucket is then the width-2 one (warmed_runner), whose
        # products sum each row as the fused call's do, so the proposals are the loop's.
        if state.valid == 0 or not 1 <= len(pending) <= CATCH_UP_WIDTH:
            return None
        tokens = self.runner.greedy_steps(seq, pending, state.valid, room)
        if tokens is not None:
            state.valid = len(seq.token_ids)
        return tokens

    def _propose_greedy(self, seq, logits, proposed: list[int], room: int, live: list[int]):
        """A lone greedy row: its first proposal from the catch-up's logits, the rest in one
        fused call where the device has one (DraftRunner.greedy_steps). The rows left for the
        one-step loop: none where the call ran, else `live` as it was."""
        first = int(logits.float().argmax())  # the plain row's processed scores are its logits
        position = len(seq.token_ids)  # where the first proposal is fed
        rest = self.runner.greedy_steps(seq, [first], position, room - 1) if room > 1 else []
        if rest is None:
            return live
        proposed += [first, *rest]
        return []

    def _next_input(self, seq, proposed: list[int]) -> DecodeInput:
        return fed_at(seq, proposed[-1], len(seq.token_ids) - 1 + len(proposed))

    def _catch_up(self, sequences: list, states: list[DraftRow]) -> list:
        """Feed each row's tokens from its `valid` through its latest; each row's logits at its
        latest token (None where no warmed bucket holds its catch-up: it proposes nothing).
        (`propose` settled the rows.)"""
        logits: list = [None] * len(sequences)
        pending = list(range(len(sequences)))
        while pending:
            long = [k for k in pending if self._by_prefill(sequences[k], states[k])]
            going = [k for k in pending if k not in long]
            if long:
                seqs = [sequences[k] for k in long]
                filled = self._prefill_rows(seqs, [len(seq.token_ids) for seq in seqs])
                for k, row_logits in zip(long, filled):
                    logits[k] = row_logits
            if going and not self._continue(
                [sequences[k] for k in going], [states[k] for k in going], going, logits
            ):
                for k in going:
                    logits[k] = None
                break
            pending = [k for k in pending if states[k].valid < len(sequences[k].token_ids)]
        done = [s.valid == len(seq.token_ids) for seq, s in zip(sequences, states)]
        return [row if ok else None for row, ok in zip(logits, done)]

    def _by_prefill(self, seq, state: DraftRow) -> bool:
        """Whether a row catches up in prefills (_prefill_rows) rather than verify-width forwards:
        a row not begun; and, with prefix caching, one more than a verify forward behind whose
        catch-up a context bucket holds (a context bucket reaches a prompt's length, not a long
        generation's)."""
        if state.valid == 0:
            return True
        behind = len(seq.token_ids) - state.valid
        if not self.prefix_caching or not self.width < behind <= self.longest_prefill:
            return False
        return self._prefill_fits(state.valid, behind)

    def _prefill_fits(self, context: int, count: int) -> bool:
        """Whether a planned prefill bucket holds `count` new tokens after `context` of KV."""
        blocks = blocks_needed(context, self.runner.block_size)
        return self.runner.plan.prefill_bucket(1, count, blocks) is not None

    def _continue(self, seqs, states, indices, logits) -> bool:
        """One verify-width forward of each row's next pending tokens, after its draft context."""
        block_size = self.runner.block_size
        chunks = [seq.token_ids[s.valid : s.valid + self.width] for seq, s in zip(seqs, states)]
        context_blocks = max(blocks_needed(s.valid, block_size) for s in states)
        bucket = self.runner.plan.verify_bucket(
            len(seqs), max(len(c) for c in chunks), context_blocks
        )
        if bucket is None:
            return False
        inputs = [
            PrefillInput(
                chunk, seq.slots(s.valid, s.valid + len(chunk)), context_slots=seq.slots(0, s.valid)
            )
            for seq, s, chunk in zip(seqs, states, chunks)
        ]
        out = host_copy(self.runner.verify(bucket, inputs))
        for row, (k, s, chunk) in enumerate(zip(indices, states, chunks)):
            s.valid += len(chunk)
            logits[k] = out[row]
        return True

    def _choose(self, seqs, logits, proposed, states):
        """Each row's next proposal: the processed argmax for greedy rows, a draw from the
        processed distribution (returned as q) for sampled rows."""
        histories = [seq.token_ids + p for seq, p in zip(seqs, proposed)]
        scores = process_scores(logits, [s.sampling for s in seqs], histories)
        chosen = []
        for row, (seq, state) in enumerate(zip(seqs, states)):
            if not is_sampling(seq.sampling.params):
                chosen.append((int(scores[row].argmax()), None))
                continue
            q = scores[row].double().softmax(dim=0)
            chosen.append((draw(q, state.generator), q))
        return chosen


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A float32 device result as a host tensor of its own: per-row host work (float64 math, row
    lists) then builds no device graph. (`.cpu()` alone is no copy where the device is the CPU,
    as under --simulate hpu.)"""
    return torch.from_numpy(tensor.float().cpu().numpy())


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from `probs` (any non-negative weights) by inverting its CDF at one uniform."""
    cdf = probs.double().cumsum(dim=0)
    target = torch.rand(1, generator=generator, dtype=torch.float64).to(cdf.device) * cdf[-1]
    token = int(torch.searchsorted(cdf, target, right=True).clamp(max=len(cdf) - 1))
    return token if probs[token] > 0 else int(probs.argmax())


def _row_state(seq) -> DraftRow:
    if seq.speculation is None:
        generator = torch.Generator(device="cpu")
        generator.manual_seed((seq.sampling.seed ^ DRAFT_SEED_SALT) % 2**63)
        seq.speculation = DraftRow(generator=generator)
    return seq.speculation


def _with_batch(limits, max_batch_size: int):
    import dataclasses

    return dataclasses.replace(limits, max_batch_size=max_batch_size)


def load_draft(config, target_config, target_tokenizer, adapter, dtype) -> DraftModel:
    """--draft-model, loaded in the target's dtype (--draft-quantize like --quantize), checked
    against the target's vocabulary and tokenizer, prepared for the device."""
    from engine.weights import loader

    if not config.draft_model:
        raise ModelLoadError("--speculate draft needs --draft-model PATH (an HF directory or GGUF)")
    if config.draft_quantize != "none" and config.draft_quantize not in adapter.quantize_modes:
        raise ModelLoadError(
            f"--draft-quantize {config.draft_quantize} is not available on {adapter.name}"
        )
    try:
        placement = Placement(
            dtype=dtype, device=adapter.torch_device, quantize=config.draft_quantize
        )
        loaded = loader.load(
            config.draft_model, config.resolved_cache_dir, placement, implementation="native"
        )
    except ModelLoadError as err:
        raise ModelLoadError(f"--draft-model {config.draft_model}: {err}") from None
    check_compatible(
        target_config, target_tokenizer, loaded.config, loaded.tokenizer, config.draft_model
    )
    adapter.prepare_draft(loaded.model, dtype)
    return DraftModel(loaded.model, loaded.config, adapter, dtype, config.prefix_caching)


def warmed_runner(
    runner_class,
    model,
    num_layers: int,
    adapter,
    dtype,
    sizes: tuple,
    extra_widths=(),
    context: bool = False,
):
    """A proposer's runner over its own KV cache (`num_layers` layers, the target's block count so
    that block ids agree) and its plan: small batches, every decode batch where nothing compiles,
    the verify width (K + 1) and `extra_widths` below it, and with `context` prefill buckets after
    cached context; every bucket warmed. Returns it and its longest plain prefill."""
    from engine.buckets.plan import make_plan, with_context, with_every_decode_batch
    from engine.speculative.buckets import SPECULATE_MAX_BATCH, verify_buckets, with_verify

    limits, num_blocks, block_size, num_tokens, graphless = sizes
    config = model.config
    cache = KVCache(
        num_layers,
        num_blocks,
        block_size,
        model.local_kv_heads,
        config.head_dim,
        dtype,
        adapter.torch_device,
        adapter.zeros,
    )
    small = _with_batch(limits, min(SPECULATE_MAX_BATCH, limits.max_batch_size))
    plan = make_plan("exponential", small)
    plan = with_context(plan, small) if context else plan
    plan = with_every_decode_batch(plan, small.blocks_per_sequence) if graphless else plan
    widths = sorted({num_tokens + 1, *(w for w in extra_widths if w <= num_tokens)})
    plan = with_verify(plan, [b for w in widths for b in verify_buckets(small, w - 1)])
    runner = runner_class(model, adapter, cache, plan, dtype)
    for bucket in plan.buckets:
        runner.warm(bucket)
    return runner, max(b.seq_len for b in plan.prefill if not b.context_blocks)


def fed_at(seq, token: int, position: int) -> DecodeInput:
    """A proposer's one-token input: `token` at `position` of `seq`'s slots and blocks."""
    return DecodeInput(
        token, position, seq.slots(position, position + 1)[0], seq.blocks_through(position)
    )
