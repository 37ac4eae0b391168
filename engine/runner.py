"""Builds bucket-padded tensors for a batch, runs the model through the device adapter, and
returns logits for the real rows only."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from engine.attention import DecodeMetadata, PrefillMetadata
from engine.attention.flat import flat_block_tensors, flat_mask
from engine.attention.rows import row_block_tensors
from engine.buckets.grid import (
    BucketPlan,
    DecodeBucket,
    PaddingStats,
    PrefillBucket,
    VerifyBucket,
)
from engine.devices.base import DeviceAdapter
from engine.devices.row_merge import merge_rows, stack_rows
from engine.kv_cache import RESERVED_BLOCK, KVCache
from engine.layers.lora import NO_ADAPTER
from engine.layers.pooling import Pooler


@dataclass
class PrefillInput:
    token_ids: list[int]
    slots: list[int]  # one cache slot per token
    prompt_logprobs: bool = False  # also score every prompt token (TGI's prefill_logprobs)
    adapter: int = NO_ADAPTER  # LoRA adapter slot (engine/layers/lora.py); -1: the base model
    # Prefill with context: token_ids continue `context_slots`, the cache slots of the tokens before
    # them (whole blocks: a prefix-cache hit or the earlier chunks of the prompt).
    context_slots: list[int] = field(default_factory=list)
    # A vision-language model's image features for the image tokens among token_ids, in order
    image_features: torch.Tensor | None = None
    # M-RoPE (Qwen2.5-VL): the [3, len(token_ids)] positions of a prompt with images; None: text
    rope_positions: torch.Tensor | None = None


@dataclass
class PrefillOutput:
    logits: torch.Tensor  # [sequences, vocab] at each sequence's last token
    prompt_logprobs: dict[
        int, list[float]
    ]  # sequence index -> logprob of each prompt token (first: nan)


@dataclass
class DecodeInput:
    token_id: int  # the last generated token, not yet in the cache
    position: int  # its position in the sequence
    slot: int  # where its K/V go
    blocks: list[int]  # the blocks covering positions 0..position
    adapter: int = NO_ADAPTER  # LoRA adapter slot; -1: the base model
    rope_delta: int = 0  # M-RoPE: the rope turns at position + delta (a prompt with images)


class ModelRunner:
    def __init__(
        self, model, adapter: DeviceAdapter, kv_cache: KVCache, plan: BucketPlan, dtype: torch.dtype
    ):
        self.model, self.adapter, self.kv_cache, self.plan, self.dtype = (
            model,
            adapter,
            kv_cache,
            plan,
            dtype,
        )
        self.block_size = kv_cache.block_size
        self.padding = PaddingStats()
        # Device time of the forwards since the caller last reset it, per thread: a pipeline
        # shard runs a step per thread, several at once (engine/pipeline/turns.py).
        self._forward_time = threading.local()
        # engine.buckets.shapes.ShapeRecorder (--record-shapes): the shapes served, unpadded
        self.recorder = None
        self.scorer = PromptScorer(model)  # one object: graphs are kept per callable
        # --pooling's variant of the plain prefill buckets (engine/layers/pooling.py); None: off
        self.pooler: Pooler | None = None
        model.bind_kv_cache(kv_cache.layers)
        adapter.reset()  # graphs captured on a previous cache would write into freed memory

    @property
    def forward_ns(self) -> int:
        return getattr(self._forward_time, "ns", 0)

    @forward_ns.setter
    def forward_ns(self, value: int) -> None:
        self._forward_time.ns = value

    @torch.inference_mode()
    def prefill(self, seqs: list[PrefillInput]) -> PrefillOutput:
        """Logits at each sequence's last token, and prompt logprobs for the sequences that ask."""
        output = PrefillOutput([None] * len(seqs), {})
        if self.recorder is not None:
            self.recorder.prefill(
                len(seqs),
                max(len(s.token_ids) for s in seqs),
                max(self._context_blocks(s) for s in seqs),
            )
        parts = []  # (a bucket's output, the sequence index of each of its real rows)
        with_context = [i for i, s in enumerate(seqs) if s.context_slots]
        if with_context:
            self._prefill_with_context(seqs, with_context, parts)
        plain = [i for i, s in enumerate(seqs) if not s.context_slots]
        for split in (
            self.plan.split_prefill([len(seqs[i].token_ids) for i in plain]) if plain else []
        ):
            group = [plain[i] for i in split]
            members = [seqs[i] for i in group]
            bucket = self.plan.prefill_bucket(len(members), max(len(s.token_ids) for s in members))
            self.padding.record(
                "prefill", sum(len(s.token_ids) for s in members), bucket.tokens, bucket
            )
            if any(s.prompt_logprobs for s in members):
                parts.append((self._prefill_scoring_prompts(bucket, group, members, output), group))
                continue
            logits = self._run(("prefill", bucket), *self._prefill_tensors(bucket, members))
            parts.append((logits, group))
        output.logits = self._rows_of(parts, len(seqs))
        return output

    @torch.inference_mode()
    def embed(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        """Each prompt's pooled, normalized final hidden state (float32, on the host), run in the
        plain prefill buckets. Every token's K/V goes to the reserved block: a prompt without
        context attends to its own keys only, so an embedding holds no KV block at all."""
        vectors: list[torch.Tensor | None] = [None] * len(prompts)
        for split in self.plan.split_prefill([len(ids) for ids in prompts]):
            members = [PrefillInput(prompts[i], [RESERVED_BLOCK] * len(prompts[i])) for i in split]
            bucket = self.plan.prefill_bucket(len(members), max(len(s.token_ids) for s in members))
            self.padding.record(
                "prefill", sum(len(s.token_ids) for s in members), bucket.tokens, bucket
            )
            pooled = self._run(
                ("embed", bucket), *self._prefill_tensors(bucket, members), fn=self.pooler
            )
            host = pooled.cpu()  # one read of the bucket's rows
            for row, index in enumerate(split):
                vectors[index] = host[row]
        return vectors

    def _rows_of(self, parts: list, count: int) -> torch.Tensor:
        """[count, vocab] from the buckets' outputs: one bucket's real rows as a view of it; rows
        of several merged at a shape the plan fixes where graphs compile (row_merge.py)."""
        if len(parts) == 1 and parts[0][1] == list(range(count)):
            return first_rows(parts[0][0], count)
        if self.adapter.warm_runs_forward:
            return merge_rows(self.adapter, parts, count, self.plan.sampler_rows(count))
        return stack_rows(parts, count)

    def _context_blocks(self, seq: PrefillInput) -> int:
        """Blocks the context spans: a later chunk may continue a context that ends inside a
        block."""
        return -(-len(seq.context_slots) // self.block_size)

    def _prefill_with_context(
        self, seqs: list[PrefillInput], indices: list[int], parts: list
    ) -> None:
        """Rows that continue cached context run in (batch, new tokens, context blocks) buckets."""
        rows = [(len(seqs[i].token_ids), self._context_blocks(seqs[i])) for i in indices]
        for split in self.plan.split_context(rows):
            group = [indices[i] for i in split]
            members = [seqs[i] for i in group]
            bucket = self.plan.prefill_bucket(
                len(members),
                max(len(s.token_ids) for s in members),
                max(self._context_blocks(s) for s in members),
            )
            self.padding.record(
                "prefill", sum(len(s.token_ids) for s in members), bucket.tokens, bucket
            )
            logits = self._run(("prefill", bucket), *self._prefill_tensors(bucket, members))
            parts.append((logits, group))

    def _prefill_scoring_prompts(
        self, bucket: PrefillBucket, group, members, output: PrefillOutput
    ) -> torch.Tensor:
        """The bucket's variant that also scores every prompt token, in its graph (PromptScorer):
        its outputs are the bucket's last-token logits [rows, vocab] and one logprob per token."""
        ids, positions, meta, last, *rest = self._prefill_tensors(bucket, members)
        targets = self._prompt_targets(bucket, [s.token_ids for s in members])
        shape = ("prefill_logprobs", bucket)
        logits, scores = self._run(
            shape, ids, positions, meta, last, targets, *rest, fn=self.scorer
        )
        scores = scores.view(bucket.batch_size, bucket.seq_len).tolist()  # read after the step
        for row, (index, seq) in enumerate(zip(group, members)):
            if seq.prompt_logprobs:
                output.prompt_logprobs[index] = [float("nan")] + scores[row][
                    : len(seq.token_ids) - 1
                ]
        return logits

    def _prompt_targets(self, bucket: PrefillBucket, prompts: list[list[int]]) -> torch.Tensor:
        """[tokens]: the token each position predicts (the next of its row; padding: token 0)."""
        width = bucket.seq_len
        rows = [ids[1:] + [0] * (width - len(ids) + 1) for ids in prompts]
        rows += [[0] * width] * (bucket.batch_size - len(prompts))
        return self._tensor([token for row in rows for token in row])

    @torch.inference_mode()
    def decode(self, seqs: list[DecodeInput]) -> torch.Tensor:
        """Logits [len(seqs), vocab] for the next token of every sequence."""
        parts = []
        if self.recorder is not None:
            self.recorder.decode(len(seqs), sum(len(s.blocks) for s in seqs))
        for group in self.plan.split_decode([len(s.blocks) for s in seqs]):
            members = [seqs[i] for i in group]
            bucket = self.plan.decode_bucket(len(members), sum(len(s.blocks) for s in members))
            self.padding.record("decode", len(members), bucket.batch_size, bucket)
            parts.append(
                (self._run(("decode", bucket), *self._decode_tensors(bucket, members)), group)
            )
        return self._rows_of(parts, len(seqs))

    @torch.inference_mode()
    def verify(self, bucket: VerifyBucket, seqs: list[PrefillInput]) -> torch.Tensor:
        """Speculative decoding's verify forward (engine/speculative/): each row's latest token and
        its proposals after its cached context, padded to the bucket; logits [rows, width, vocab] at
        every position of every real row."""
        if self.recorder is not None:
            self.recorder.verify(
                len(seqs),
                max(len(s.token_ids) for s in seqs),
                max(self._context_blocks(s) for s in seqs),
            )
        self.padding.record("decode", len(seqs), bucket.batch_size, bucket)
        logits = self._run(("verify", bucket), *self._verify_tensors(bucket, seqs))
        rows = logits.view(bucket.batch_size, bucket.width, -1)[: len(seqs)]
        rows.bucket_output = logits  # [batch * width, vocab]: per-position gathers read it whole
        return rows

    def _verify_tensors(self, bucket: VerifyBucket, seqs: list[PrefillInput]) -> tuple:
        """A verify forward's inputs: a prefill's, with logits at every position of every row."""
        ids, positions, meta, _, *lora = self._prefill_tensors(bucket.as_prefill, seqs)
        everywhere = self._to_device(torch.arange(bucket.batch_size * bucket.width))
        return ids, positions, meta, everywhere, *lora

    def _warm_verify(self, bucket: VerifyBucket, graph: bool) -> None:
        context = [RESERVED_BLOCK] * (bucket.context_blocks * self.block_size)
        dummy = [
            PrefillInput(
                [0] * bucket.width,
                [RESERVED_BLOCK] * bucket.width,
                adapter=self._warm_adapter(row),
                context_slots=context,
            )
            for row in range(bucket.batch_size)
        ]
        self.adapter.warm(
            ("verify", bucket), self.model, *self._verify_tensors(bucket, dummy), graph=graph
        )

    def _run(self, shape, *inputs, fn=None) -> torch.Tensor:
        """One forward at a bucket shape, timed to its end (asynchronous devices are
        synchronized)."""
        start = time.perf_counter_ns()
        out = self.adapter.run(shape, fn or self.model, *inputs)
        self.adapter.synchronize()
        self.forward_ns += time.perf_counter_ns() - start
        return out

    @torch.inference_mode()
    def warm(
        self,
        bucket: PrefillBucket | DecodeBucket | VerifyBucket,
        prompt_logprobs: bool = False,
        graph: bool = True,
        plain: bool = True,
    ) -> None:
        """Run one bucket on dummy rows that read and write only the reserved block (graph=False:
        warmed to run without a device graph, as when the graph memory budget is spent; plain=False:
        a prefill bucket's prompt-logprobs variant alone, which takes all the plain one's
        memory)."""
        if isinstance(bucket, VerifyBucket):
            self._warm_verify(bucket, graph)
        elif isinstance(bucket, PrefillBucket):
            context = [RESERVED_BLOCK] * (bucket.context_blocks * self.block_size)
            dummy = [
                PrefillInput(
                    [0] * bucket.seq_len,
                    [RESERVED_BLOCK] * bucket.seq_len,
                    adapter=self._warm_adapter(row),
                    context_slots=context,
                )
                for row in range(bucket.batch_size)
            ]
            ids, positions, meta, last, *lora = self._prefill_tensors(bucket, dummy)
            if plain:
                self.adapter.warm(
                    ("prefill", bucket), self.model, ids, positions, meta, last, *lora, graph=graph
                )
            if plain and self.pooler is not None and not bucket.context_blocks:
                self.adapter.warm(
                    ("embed", bucket), self.pooler, ids, positions, meta, last, *lora, graph=graph
                )
            if prompt_logprobs and not bucket.context_blocks:  # they need the whole prompt
                targets = self._prompt_targets(bucket, [])
                self.adapter.warm(
                    ("prefill_logprobs", bucket),
                    self.scorer,
                    ids,
                    positions,
                    meta,
                    last,
                    targets,
                    *lora,
                    graph=graph,
                )
        else:
            dummy = _dummy_decode_rows(bucket)
            for row, seq in enumerate(dummy):
                seq.adapter = self._warm_adapter(row)
            self.adapter.warm(
                ("decode", bucket), self.model, *self._decode_tensors(bucket, dummy), graph=graph
            )

    def _prefill_tensors(self, bucket: PrefillBucket, seqs: list[PrefillInput]):
        rows, width = bucket.batch_size, bucket.seq_len
        ids, slots, last = [], [], []
        for row, seq in enumerate(seqs):
            pad = width - len(seq.token_ids)
            ids += seq.token_ids + [0] * pad
            slots += seq.slots + [RESERVED_BLOCK] * pad
            last.append(row * width + len(seq.token_ids) - 1)
        padding_rows = rows - len(seqs)
        ids += [0] * (padding_rows * width)
        slots += [RESERVED_BLOCK] * (padding_rows * width)
        last += [0] * padding_rows
        contexts = [len(seq.context_slots) for seq in seqs] + [0] * padding_rows
        positions = torch.arange(width).expand(rows, width) + torch.tensor(contexts).unsqueeze(1)
        seq_lens = [len(seq.token_ids) for seq in seqs] + [1] * padding_rows
        meta = PrefillMetadata(slots=self._tensor(slots), seq_lens=self._tensor(seq_lens))
        if bucket.context_blocks:
            span = (
                bucket.context_blocks * self.block_size
            )  # padding: slots of the reserved block, masked
            table = [
                seq.context_slots + [RESERVED_BLOCK] * (span - len(seq.context_slots))
                for seq in seqs
            ]
            table += [[RESERVED_BLOCK] * span] * padding_rows
            meta = meta._replace(
                context_slots=self._tensor(table), context_lens=self._tensor(contexts)
            )
        lora = self._lora_index([s.adapter for s in seqs], rows, width)
        images = self._image_embeds(seqs, rows, width)
        return (
            self._tensor(ids).view(rows, width),
            self._to_device(positions),
            meta,
            self._tensor(last),
            *lora,
            *images,
            *self._mrope_positions(seqs, positions),
        )

    def _mrope_positions(self, seqs: list[PrefillInput], positions: torch.Tensor) -> tuple:
        """An M-RoPE model's last prefill input: [3, rows, width] positions, a text row's (and
        padding's) its sequence positions on all three rows, in every prefill bucket."""
        if not getattr(self.model, "takes_mrope", False):
            return ()
        table = positions.unsqueeze(0).repeat(3, 1, 1)
        for row, seq in enumerate(seqs):
            if seq.rope_positions is not None:
                table[:, row, : len(seq.token_ids)] = seq.rope_positions
        return (self._to_device(table),)

    def _image_embeds(self, seqs: list[PrefillInput], rows: int, width: int) -> tuple:
        """A vision-language model's last prefill input: [rows, width, hidden] image features at
        the image tokens' places (zeros elsewhere, read nowhere), in every prefill bucket, so a
        bucket's one graph serves prompts with and without images."""
        if not getattr(self.model, "takes_images", False):
            return ()
        embeds = torch.zeros((rows, width, self.model.config.hidden_size), dtype=self.dtype)
        token = self.model.image_token_id
        for row, seq in enumerate(seqs):
            places = [i for i, t in enumerate(seq.token_ids) if t == token]
            count = 0 if seq.image_features is None else len(seq.image_features)
            if len(places) != count:
                raise ValueError(f"{len(places)} image tokens but {count} image features")
            if places:
                embeds[row, places] = seq.image_features.to(self.dtype).cpu()
        return (self._to_device(embeds),)

    def _decode_tensors(self, bucket: DecodeBucket, seqs: list[DecodeInput]):
        padding_rows = bucket.batch_size - len(seqs)
        block_list, groups, usage = flat_block_tensors(
            [s.blocks for s in seqs],
            [s.position + 1 for s in seqs],
            bucket.num_blocks,
            self.block_size,
        )
        mapping, owners, bias = flat_mask(
            groups, usage, bucket.batch_size, self.block_size, self.dtype
        )
        meta = DecodeMetadata(
            slots=self._tensor([s.slot for s in seqs] + [RESERVED_BLOCK] * padding_rows),
            block_list=self._to_device(block_list),
            block_mapping=self._to_device(mapping),
            block_groups=self._to_device(owners),
            block_bias=self._to_device(bias),
        )
        # Where nothing is compiled, a step's shapes may follow its rows: padded per-row blocks
        # (rows.py).
        rows = (
            None
            if self.adapter.warm_runs_forward
            else row_block_tensors(
                [s.blocks for s in seqs],
                [s.position + 1 for s in seqs],
                bucket.batch_size,
                self.block_size,
                self.dtype,
            )
        )
        if rows is not None:
            meta = meta._replace(
                row_table=self._to_device(rows[0]), row_bias=self._to_device(rows[1])
            )
        ids = [s.token_id for s in seqs] + [0] * padding_rows
        positions = [s.position for s in seqs] + [0] * padding_rows
        lora = self._lora_index([s.adapter for s in seqs], bucket.batch_size)
        # M-RoPE: each row's position delta, a tensor of the bucket's rows (padding: 0)
        deltas = [s.rope_delta for s in seqs] + [0] * padding_rows
        mrope = (self._tensor(deltas),) if getattr(self.model, "takes_mrope", False) else ()
        return (
            self._tensor(ids),
            self._tensor(positions),
            meta,
            self._tensor(list(range(bucket.batch_size))),
            *lora,
            *mrope,
        )

    def _lora_index(self, adapters: list[int], rows: int, width: int = 1) -> tuple:
        """The model's last input when LoRA adapters are loaded: every token's adapter slot
        (padding: none). Its shape is the bucket's whatever the mix of adapters, so the warmed graph
        serves every mix."""
        if self.model.lora_set is None:
            return ()
        per_row = adapters + [NO_ADAPTER] * (rows - len(adapters))
        return (self._to_device(torch.tensor(per_row, dtype=torch.long).repeat_interleave(width)),)

    def _warm_adapter(self, row: int) -> int:
        """Warmup rows cycle through every adapter, then none: even one-row buckets run an
        adapter."""
        count = len(self.model.lora_set.names) if self.model.lora_set is not None else 0
        slot = row % (count + 1)
        return NO_ADAPTER if slot == count else slot

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return self._to_device(torch.tensor(values, dtype=torch.long))

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.adapter.to_device(tensor)


def first_rows(out: torch.Tensor, count: int) -> torch.Tensor:
    """The real rows of a bucket's output, as a view that keeps the whole padded output at hand
    (`bucket_output`): a static sampler runs on the bucket's rows (engine/sampling/static.py)."""
    rows = out[:count]
    rows.bucket_output = out
    return rows


def _dummy_decode_rows(bucket: DecodeBucket) -> list[DecodeInput]:
    """bucket.batch_size rows sharing bucket.num_blocks reserved blocks, each row at least one."""
    per_row, extra = divmod(bucket.num_blocks, bucket.batch_size)
    rows = []
    for row in range(bucket.batch_size):
        count = per_row + (row < extra)
        rows.append(DecodeInput(0, 0, RESERVED_BLOCK, [RESERVED_BLOCK] * count))
    return rows


class PromptScorer(torch.nn.Module):
    """The prefill forward that also scores the prompt: each position's log-probability of the
    token after it, gathered inside the graph, so the graph's output is [tokens] and not the float32
    [tokens, vocab] logits (2 GB at 4,096 tokens and a 128k vocabulary), with the logits of each
    row's last token, as the plain forward returns them."""

    def __init__(self, model):
        super().__init__()
        self.scored = model

    def forward(self, input_ids, positions, meta, last, targets, *rest):
        everywhere = torch.arange(input_ids.numel(), device=input_ids.device)
        logits = self.scored(input_ids, positions, meta, everywhere, *rest)
        scores = torch.log_softmax(logits, dim=-1).gather(1, targets.unsqueeze(1)).squeeze(1)
        return logits.index_select(0, last), scores
