"""EAGLE-3 heads: a one-layer draft that reads the target's own hidden states and proposes a row's
next K tokens, one head forward per token, before the target verifies them in one forward.

The checkpoint and the computation mirror vLLM's (vllm/model_executor/models/llama_eagle3.py at
commit 00bd1493b3e82d6c13c68ee8a0e1c5a96707e190, and how vllm/v1/spec_decode/eagle.py at commit
008603a39fff2a383a293c62eec0c752c42199f2 feeds it): a Hugging Face directory whose config.json
names `LlamaForCausalLMEagle3` (model_type llama, one hidden layer, `draft_vocab_size`,
optionally `target_hidden_size`, `norm_before_residual` and the aux layer ids) and whose weights
are `midlayer.*` (or `layers.0.*`: one Llama decoder layer whose q/k/v read 2 * hidden inputs, plus
`hidden_norm`), `fc` (3 * target hidden -> hidden), `norm`, `lm_head` over the draft vocabulary,
`d2t` (draft id -> target id offsets; `t2d` is ignored) and optionally `embed_tokens` (else the
target's are shared).

The target's side: its forwards store the residual stream entering three of its layers (low,
middle, high: vLLM's default (2, L // 2, L - 3), or `eagle_aux_hidden_state_layer_ids`, at the top
level of config.json or in `eagle_config`) at each token's KV slot (engine/models/llama.py's
`aux_cache`), in every prefill, decode and verify graph at the graph's own shape.

The head at position p reads the token at p + 1 and the target's fused hidden state at p
(`fc(aux_cache[slot(p)])`), writes its KV at slot(p) in its own one-layer cache indexed by the
target's block table, and predicts the token at p + 2; a proposal after the first reads the
head's own pre-norm output of the position before instead. Its KV is valid for the positions it
computed from the target's states (`valid`); the positions it computed from its own outputs are
recomputed from the target's once the target has verified them (they are simply overwritten).

Proposals are the head's argmax for every row, sampled rows included: a deterministic proposal,
which step.py accepts by the ordinary choice (exact for sampled rows, the same draws as plain
decoding, so seeded output is plain decoding's and resumes exactly).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import DecodeMetadata, prepare_metadata
from engine.buckets.grid import DecodeBucket, VerifyBucket
from engine.distributed import SINGLE
from engine.errors import ModelLoadError
from engine.kv_cache import RESERVED_BLOCK, blocks_needed
from engine.layers.linear import qkv_parallel
from engine.layers.norm import rms_norm
from engine.layers.rotary import RotaryEmbedding
from engine.models.config import ModelConfig
from engine.models.llama import LayerContext, LlamaAttention, LlamaForCausalLM, LlamaMLP
from engine.runner import DecodeInput, ModelRunner, PrefillInput, _dummy_decode_rows
from engine.speculative.draft import DraftAdapter, fed_at, host_copy, warmed_runner
from engine.speculative.eagle3_checkpoint import (
    AUX_STATES,
    Eagle3Config,
    load_weights,
    parse_config,
)


class Eagle3Layer(nn.Module):
    """vLLM's first (here: only) EAGLE-3 decoder layer: attention over the normed token embedding
    and the normed fused hidden state side by side (2 * hidden inputs), then the Llama MLP."""

    def __init__(self, config: ModelConfig, norm_before_residual: bool):
        super().__init__()
        self.self_attn = LlamaAttention(config, SINGLE)
        self.self_attn.qkv_proj = qkv_parallel(
            2 * config.hidden_size,
            config.head_dim,
            config.num_heads,
            config.num_kv_heads,
            config.qkv_bias,
            SINGLE,
        )
        self.mlp = LlamaMLP(config, SINGLE)
        eps = config.rms_norm_eps
        self.input_layernorm = rms_norm(config.hidden_size, eps, False)
        self.hidden_norm = rms_norm(config.hidden_size, eps, False)
        self.post_attention_layernorm = rms_norm(config.hidden_size, eps, False)
        self.norm_before_residual = norm_before_residual

    def forward(self, context: LayerContext, embeds, hidden):
        """(the MLP's output, the residual stream before it): vLLM's (hidden_states, residual)."""
        embeds = self.input_layernorm(embeds)
        if self.norm_before_residual:
            hidden = self.hidden_norm(hidden)
            residual = hidden
        else:
            residual, hidden = hidden, self.hidden_norm(hidden)
        attended = self.self_attn(context, torch.cat([embeds, hidden], dim=-1))
        residual = attended + residual
        return self.mlp(self.post_attention_layernorm(residual)), residual


class Eagle3Head(nn.Module):
    """The head. Its forward returns, at `logits_indices`, each row's proposal (a target token id)
    and its pre-norm hidden state (what the next proposal reads). `own`: the hidden state each
    token reads, for proposals after the first; None reads the target's (fused by `fc`)."""

    lora_set = None  # the head serves no adapters

    def __init__(self, config: Eagle3Config, target: LlamaForCausalLM, max_positions: int):
        super().__init__()
        layer = config.layer
        self.config, self.hidden_size = layer, layer.hidden_size
        self.target = [target]  # a list: the target's modules are not the head's parameters
        self.embed_tokens = None  # the target's, unless the checkpoint has its own
        self.fc = nn.Parameter(
            torch.empty(layer.hidden_size, AUX_STATES * config.target_hidden_size)
        )
        self.layers = nn.ModuleList([Eagle3Layer(layer, config.norm_before_residual)])
        self.norm = rms_norm(layer.hidden_size, layer.rms_norm_eps, False)
        self.lm_head = None  # [draft vocab, hidden], or the target's
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.rotary = RotaryEmbedding(layer.rope, layer.head_dim, max_positions)
        self.local_kv_heads = layer.num_kv_heads

    def embed(self, ids):
        if self.embed_tokens is not None:
            return self.embed_tokens(ids)
        return self.target[0].embed_tokens(ids)

    def forward(self, input_ids, positions, meta, logits_indices, own=None):
        embeds = self.embed(input_ids)
        if own is None:
            aux = self.target[0].aux_cache.index_select(0, meta.slots.reshape(-1))
            hidden = F.linear(aux.to(self.fc.dtype), self.fc).view(embeds.shape)
        else:
            hidden = own.view(embeds.shape)
        rope = self.rotary.cos_sin(positions, embeds.dtype, _last_positions(meta))
        context = LayerContext(rope, prepare_metadata(meta, self.local_kv_heads))
        out, residual = self.layers[0](context, embeds, hidden)
        prenorm = (out + residual).reshape(-1, self.hidden_size).index_select(0, logits_indices)
        chosen = self._logits(self.norm(prenorm)).argmax(dim=-1)
        return chosen + self.d2t.index_select(0, chosen), prenorm.float()

    def _logits(self, hidden):
        if self.lm_head is None:
            return self.target[0].lm_head.logits(hidden).float()
        return F.linear(hidden, self.lm_head).float()

    def bind_kv_cache(self, caches) -> None:
        self.layers[0].self_attn.kv_cache = caches[0]


def _last_positions(meta):
    if isinstance(meta, DecodeMetadata) or getattr(meta, "seq_lens", None) is None:
        return None
    return (meta.seq_lens - 1).unsqueeze(1)


class Eagle3Runner(ModelRunner):
    """The head's buckets: prefill (a fresh row's catch-up), verify-width (a row's newly verified
    tokens after its context) and decode (the proposals after the first), each one graph."""

    @torch.inference_mode()
    def catch_up(self, bucket, inputs: list[PrefillInput]):
        """(each row's proposal, its pre-norm hidden state on the host) after `inputs`."""
        kind = "verify" if isinstance(bucket, VerifyBucket) else "prefill"
        tokens, prenorm = self._run((kind, bucket), *self._catch_up_tensors(bucket, inputs))
        return tokens[: len(inputs)].tolist(), host_copy(prenorm)[: len(inputs)]

    @torch.inference_mode()
    def draft(self, bucket: DecodeBucket, inputs: list[DecodeInput], own: torch.Tensor):
        """One proposal per row after its latest one; `own`: [rows, hidden] host states."""
        tensors = self._draft_tensors(bucket, inputs, own)
        tokens, prenorm = self._run(("decode", bucket), *tensors)
        return tokens[: len(inputs)].tolist(), host_copy(prenorm)[: len(inputs)]

    def _catch_up_tensors(self, bucket, inputs):
        prefill = bucket.as_prefill if isinstance(bucket, VerifyBucket) else bucket
        ids, positions, meta, last, *_ = self._prefill_tensors(prefill, inputs)
        return ids, positions, meta, last

    def _draft_tensors(self, bucket: DecodeBucket, inputs, own):
        ids, positions, meta, indices, *_ = self._decode_tensors(bucket, inputs)
        padded = torch.zeros((bucket.batch_size, self.model.hidden_size), dtype=self.dtype)
        if own is not None:
            padded[: len(own)] = own.to(self.dtype)
        return ids, positions, meta, indices, self._to_device(padded)

    @torch.inference_mode()
    def warm(self, bucket, prompt_logprobs=False, graph=True, plain=True) -> None:
        if isinstance(bucket, DecodeBucket):
            tensors = self._draft_tensors(bucket, _dummy_decode_rows(bucket), None)
            self.adapter.warm(("decode", bucket), self.model, *tensors, graph=graph)
            return
        width = bucket.width if isinstance(bucket, VerifyBucket) else bucket.seq_len
        context = [RESERVED_BLOCK] * (bucket.context_blocks * self.block_size)
        dummy = [
            PrefillInput([0] * width, [RESERVED_BLOCK] * width, context_slots=context)
            for _ in range(bucket.batch_size)
        ]
        kind = "verify" if isinstance(bucket, VerifyBucket) else "prefill"
        tensors = self._catch_up_tensors(bucket, dummy)
        self.adapter.warm((kind, bucket), self.model, *tensors, graph=graph)


@dataclass
class Eagle3Row:
    """One sequence's head state: its KV holds positions 0..valid-1 computed from the target's
    hidden states."""

    valid: int = 0


class Eagle3Drafter:
    """The loaded head, and after warmup its runner (its KV cache and warmed buckets)."""

    def __init__(self, head: Eagle3Head, adapter, dtype):
        self.model, self.dtype = head, dtype
        self.adapter = DraftAdapter(adapter)
        self.runner: Eagle3Runner | None = None
        self.longest_prefill = 0
        self.width = 1

    def release(self) -> None:
        self.runner = None
        self.model.bind_kv_cache([None])

    def slot_states(self) -> list[torch.Tensor]:
        """The target's per-slot tensors a copied prompt must carry along (n > 1 siblings)."""
        aux = self.model.target[0].aux_cache
        return [] if aux is None else [aux]

    def warm(self, limits, num_blocks: int, block_size: int, num_tokens: int, graphless: bool):
        """Its one-layer cache (the target's block count: the block ids agree) and plan, warmed."""
        self.release()
        self.runner, self.longest_prefill = warmed_runner(
            Eagle3Runner,
            self.model,
            1,
            self.adapter,
            self.dtype,
            (limits, num_blocks, block_size, num_tokens, graphless),
        )
        self.width = num_tokens + 1

    @torch.inference_mode()
    def propose(self, sequences: list, rooms: list[int]):
        """Up to rooms[i] tokens for each row; no distributions (deterministic proposals)."""
        proposals: list[list[int]] = [[] for _ in sequences]
        none = [None] * len(sequences)
        rows = [i for i, room in enumerate(rooms) if room > 0]
        if not rows or self.runner is None:
            return proposals, none
        seqs = [sequences[i] for i in rows]
        firsts = self._catch_up(seqs, [_row_state(s) for s in seqs])
        live = [k for k, first in enumerate(firsts) if first is not None]
        own = {}
        for k in live:
            proposals[rows[k]].append(firsts[k][0])
            own[k] = firsts[k][1]
        while live := [k for k in live if len(proposals[rows[k]]) < rooms[rows[k]]]:
            inputs = [self._next_input(seqs[k], proposals[rows[k]]) for k in live]
            bucket = self.runner.plan.decode_bucket(len(inputs), sum(len(i.blocks) for i in inputs))
            if bucket is None:
                break
            tokens, states = self.runner.draft(bucket, inputs, torch.stack([own[k] for k in live]))
            for k, token, state in zip(live, tokens, states):
                proposals[rows[k]].append(token)
                own[k] = state
        return proposals, none

    def _next_input(self, seq, proposed: list[int]) -> DecodeInput:
        """The latest proposal at the position after the one that proposed it."""
        return fed_at(seq, proposed[-1], len(seq.token_ids) - 2 + len(proposed))

    def _catch_up(self, seqs: list, states: list[Eagle3Row]) -> list:
        """Feed each row's positions from its `valid` through its second-to-last (the latest
        token's own hidden state is not computed yet); per row (first proposal, pre-norm state),
        or None where no warmed bucket holds its catch-up (it proposes nothing)."""
        out: list = [None] * len(seqs)
        pending = [k for k, s in enumerate(seqs) if states[k].valid < len(s.token_ids) - 1]
        while pending:
            fresh = [k for k in pending if states[k].valid == 0]
            going = [k for k in pending if states[k].valid > 0]
            for group in (fresh, going):
                if group and not self._feed(group, seqs, states, out):
                    return [None] * len(seqs)
            pending = [k for k in pending if states[k].valid < len(seqs[k].token_ids) - 1]
        return [
            o if states[k].valid == len(seqs[k].token_ids) - 1 else None for k, o in enumerate(out)
        ]

    def _feed(self, group, seqs, states, out) -> bool:
        """One forward of the group's next positions: a prefill bucket for rows without head KV,
        a verify-width one after their context otherwise."""
        fresh = states[group[0]].valid == 0
        cap = self.longest_prefill if fresh else self.width
        inputs, ends = [], []
        for k in group:
            seq, start = seqs[k], states[k].valid
            end = min(len(seq.token_ids) - 1, start + cap)
            context = [] if fresh else seq.slots(0, start)
            inputs.append(
                PrefillInput(
                    seq.token_ids[start + 1 : end + 1], seq.slots(start, end), context_slots=context
                )
            )
            ends.append(end)
        longest = max(len(i.token_ids) for i in inputs)
        if fresh:
            bucket = self.runner.plan.prefill_bucket(len(inputs), longest)
        else:
            blocks = max(blocks_needed(states[k].valid, self.runner.block_size) for k in group)
            bucket = self.runner.plan.verify_bucket(len(inputs), longest, blocks)
        if bucket is None:
            return False
        tokens, prenorms = self.runner.catch_up(bucket, inputs)
        for k, end, token, prenorm in zip(group, ends, tokens, prenorms):
            states[k].valid = end
            out[k] = (token, prenorm)
        return True


def _row_state(seq) -> Eagle3Row:
    if seq.speculation is None:
        seq.speculation = Eagle3Row()
    return seq.speculation


def load_eagle3(config, target, target_config: ModelConfig, adapter, dtype) -> Eagle3Drafter:
    """--draft-model DIR, an EAGLE-3 head, loaded in the target's dtype and checked against the
    target; the target is told which layers' inputs to keep."""
    if not config.draft_model:
        raise ModelLoadError("--speculate eagle3 needs --draft-model DIR (an EAGLE-3 head)")
    if config.draft_quantize != "none":
        raise ModelLoadError("--draft-quantize does not apply to an EAGLE-3 head")
    if not isinstance(target, LlamaForCausalLM) or target.stage is not None:
        raise ModelLoadError(
            f"--speculate eagle3 needs a native {target_config.architecture} without pipeline "
            "stages (its forward keeps the aux hidden states)"
        )
    path = Path(config.draft_model)
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"--draft-model {path}: no readable config.json ({err})") from None
    eagle = parse_config(raw, target_config, path)
    head = Eagle3Head(eagle, target, target.rotary.cos.shape[1])
    load_weights(head, eagle, path)
    head = head.to(dtype=dtype, device=adapter.torch_device).eval()
    layer = eagle.layer  # the rope tables in float32, as the target's (rebuild_rotary)
    head.rotary = RotaryEmbedding(layer.rope, layer.head_dim, target.rotary.cos.shape[1]).to(
        adapter.torch_device
    )
    target.aux_layers = eagle.aux_layers
    return Eagle3Drafter(head, adapter, dtype)
