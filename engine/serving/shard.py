"""One shard: the generate.v3 operations (warmup, prefill, decode, filter, clear) in plain
Python."""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import secrets
import time
from contextlib import contextmanager, nullcontext

import torch

from engine.batch import (
    Batch,
    CachedBatch,
    Embedding,
    EmbedInput,
    Generation,
    InfoResponse,
    StepTimings,
    WarmupResult,
)
from engine.buckets.grid import PaddingStats, PrefillBucket, VerifyBucket
from engine.config import EngineConfig, ServingLimits, distributed_address, torch_dtype
from engine.devices import get_adapter
from engine.devices.simulate.counters import graph_counts, start_serving, start_warmup
from engine.distributed import Parallel, broadcast_int, init_distributed
from engine.errors import InvalidRequestError, ModelLoadError
from engine.kv_cache import BlockContents, ShardBlockPool
from engine.layers.pooling import can_pool
from engine.pipeline.grid import join_grid
from engine.pipeline.turns import StepTurns
from engine.runner import DecodeInput, ModelRunner, PrefillInput
from engine.sampling.static import uses_static_sampling, warm_sampler
from engine.serving.checks import check_decode, check_grown, check_prefill
from engine.serving.embed import check_inputs, embed_step
from engine.serving.lookahead import Ahead
from engine.serving.recompute import check_recompute_fits, recompute_position
from engine.serving.sequence import Sequence
from engine.serving.siblings import warm_prompt_copy
from engine.serving.steps import (
    StepContext,
    admit_requests,
    decode_step,
    look_ahead_step,
    prefill_step,
)
from engine.speculative.buckets import warm_verify_gathers
from engine.speculative.step import NO_SPECULATION
from engine.warmup.progressive import DeviceLock
from engine.warmup.run import ShardModel, start_up
from engine.warmup.warm import report
from engine.weights import loader
from engine.weights.identity import check_same_model
from engine.weights.lora import load_adapters
from engine.weights.placement import Placement

log = logging.getLogger(__name__)


def _exclusive(method):
    """Hold the device lock for a whole step: progressive warmup warms buckets from another thread.
    A pipeline shard's step also takes its turn first (engine/pipeline/turns.py), in the router's
    `order` (0: whenever the turn is free)."""

    @functools.wraps(method)
    def locked(self, *args, order: int = 0, **kwargs):
        turns = getattr(self, "turns", None)
        turn = turns.turn(order) if turns is not None else nullcontext()
        with turn, self.device_lock, self.adapter.device_scope():
            return method(self, *args, **kwargs)

    return locked


class Shard:
    def __init__(
        self, config: EngineConfig, rank: int = 0, world_size: int = 1, show_progress: bool = True
    ):
        self.config, self.rank, self.world_size = config, rank, world_size
        self.show_progress = show_progress
        self.adapter = get_adapter(
            config.device,
            config.graph_mode,
            config.strict_shapes,
            rank=rank,
            world_size=world_size,
            cache_dir=config.resolved_cache_dir,
            simulate=config.simulate,
        )
        self.dtype = self._choose_dtype(config)
        self.block_size = config.block_size or self.adapter.default_block_size
        self._join_group(config, rank, world_size)
        self._load_model(config)
        self._init_serving_state()
        self.speculator = self._speculator(
            self.config
        )  # --speculate (engine/speculative/); None: off

    def _join_group(self, config: EngineConfig, rank: int, world_size: int) -> None:
        """The whole group (host values agree across it), and this rank's tensor-parallel group
        and pipeline stage within it (engine/pipeline/grid.py)."""
        self.world = Parallel(rank, world_size)
        init_distributed(self.world, self.adapter.dist_backend, *distributed_address())
        self.parallel, self.pipe = join_grid(rank, world_size, config.pipeline_parallel_size)
        # Several steps in flight on a pipeline: who runs shard code when
        # (engine/pipeline/turns.py).
        self.turns = StepTurns() if self.pipe is not None else None
        check_same_model(config, self.world)
        # Requests without a seed get one derived from this, which rank 0 picks for the whole group.
        self.group_seed = broadcast_int(secrets.randbits(62), self.world)

    def _load_model(self, config: EngineConfig) -> None:
        """The model, its tokenizer, its LoRA adapters and its image encoder, prepared for the
        device; `self.config` loses prefix caching where the model cannot keep it sound."""
        placement = Placement(
            dtype=self.dtype,
            device=self.adapter.torch_device,
            parallel=self.parallel,
            moe_impl=config.moe_impl or self.adapter.default_moe_impl,
            quantize=config.quantize,
        )
        loaded = loader.load(
            config.model_id,
            config.resolved_cache_dir,
            placement,
            implementation=config.implementation,
            prepare_fallback=self.adapter.prepare_transformers,
            pipe=self.pipe,
        )
        self.model, self.model_config, self.tokenizer = (
            loaded.model,
            loaded.config,
            loaded.tokenizer,
        )
        self.model_path, self.eos_token_ids = loaded.path, loaded.eos_token_ids
        self.implementation = getattr(self.model, "implementation", "native")
        log.info(
            "serving %s with the %s implementation",
            self.model_config.architecture,
            self.implementation,
        )
        self.config = config = self._without_unsound_prefix_caching(config)
        if config.lora_adapters and self.implementation != "native":
            raise ModelLoadError(
                "LoRA adapters are served with native implementations only (not --implementation "
                "transformers)"
            )
        # LoRA adapters load before warmup, so that every bucket is warmed with them active.
        self.lora_set = load_adapters(
            self.model, config, self.adapter.default_lora_impl, self.parallel
        )
        # after the adapters: they read the plain weights' dtype
        self.adapter.prepare_model(self.model, self.dtype)
        if self.rank == 0:
            report(f"kernels: {self.adapter.serving_path()}", self.show_progress)
        self.special_token_ids = frozenset(self.tokenizer.all_special_ids)
        self.vision = self._image_encoder()  # a vision-language model's (engine/vision/)

    def _init_serving_state(self) -> None:
        """What warmup fills in (the runner, the block pool, the limits) and what serving counts."""
        self.limits: ServingLimits | None = None
        self.runner: ModelRunner | None = None
        self.allocator: ShardBlockPool | None = None
        # what each filled KV block holds (prefix caching)
        self.contents: BlockContents | None = None
        # chunked prefill, since warmup
        self.chunk_stats = {"chunked_prompts": 0, "prefill_chunks": 0}
        self.batches: dict[int, list[Sequence]] = {}
        # the next forward of a batch, run early (engine/serving/lookahead.py)
        self.ahead: Ahead | None = None
        # forwards run early; steps that used one
        self.lookahead_stats = {"lookahead_runs": 0, "lookahead_steps": 0}
        self._grammar_compiler = None
        self.last_timings: StepTimings | None = None  # of the latest prefill or decode
        self.device_lock = DeviceLock()  # a step, or one bucket of background warmup (steps first)
        self.background = None  # progressive warmup's BackgroundWarmup while it runs
        self.recorder = None  # ShapeRecorder of --record-shapes

    def _speculator(self, config: EngineConfig):
        if not config.speculate:
            return None
        if recompute_position(self.model) is not None:
            raise ModelLoadError(
                f"--speculate does not combine with {self.model_config.architecture}'s rope "
                "switch yet (its cache is recomputed at one position, engine/serving/recompute.py)"
            )
        if getattr(self.model, "takes_mrope", False):
            raise ModelLoadError(
                f"--speculate does not combine with {self.model_config.architecture}'s multimodal "
                "rope yet (verify and draft steps carry no 3-row positions)"
            )
        from engine.speculative.buckets import SPECULATE_MAX_BATCH
        from engine.speculative.step import Speculator

        draft = None
        if config.speculate == "draft":
            from engine.speculative.draft import load_draft

            draft = load_draft(config, self.model_config, self.tokenizer, self.adapter, self.dtype)
        elif config.speculate == "eagle3":
            from engine.speculative.eagle3 import load_eagle3

            draft = load_eagle3(config, self.model, self.model_config, self.adapter, self.dtype)
        elif config.draft_model:
            raise ModelLoadError("--draft-model is for --speculate draft or eagle3")
        return Speculator(
            config.speculate, config.num_speculative_tokens, SPECULATE_MAX_BATCH, draft=draft
        )

    def _image_encoder(self):
        if not getattr(self.model, "takes_images", False):
            return None
        from engine.vision.dynamic import DynamicResolutionEncoder
        from engine.vision.encoder import ImageEncoder
        from engine.vision.spec import image_spec, processor_config

        spec = image_spec(self.model_config.vision, processor_config(self.model_path))
        encoder = DynamicResolutionEncoder if spec.factor else ImageEncoder  # Qwen2.5-VL's grids
        return encoder(self.model, self.model_path, self.tokenizer, spec, self.adapter)

    def _without_unsound_prefix_caching(self, config: EngineConfig) -> EngineConfig:
        """A model whose keys' rotation depends on the sequence's final length (Phi-3's longrope:
        engine/serving/recompute.py) cannot share cached blocks between sequences of different
        lengths, nor compute a prompt in chunks: prefix caching (and chunking with it) goes off."""
        if not config.prefix_caching or recompute_position(self.model) is None:
            return config
        log.warning(
            "prefix caching and chunked prefill are off for %s: its rope tables switch with the "
            "sequence's length, so a cached block's keys hold for sequences of one side of the "
            "switch only",
            self.model_config.architecture,
        )
        return dataclasses.replace(config, prefix_caching=False)

    def _choose_dtype(self, config: EngineConfig) -> torch.dtype:
        """The serving dtype; with --dtype auto (the default) the device's choice, said at start."""
        automatic, why = self.adapter.auto_dtype()
        dtype = torch_dtype(config.dtype, automatic)
        if config.dtype in (None, "auto") and self.rank == 0:
            report(f"dtype auto: {str(dtype).removeprefix('torch.')} ({why})", self.show_progress)
        if config.quantize != "none" and config.lora_adapters:
            raise ModelLoadError(
                "--quantize does not combine with LoRA adapters yet (the adapters add to float "
                "weights)"
            )
        if config.quantize != "none" and config.quantize not in self.adapter.quantize_modes:
            raise ModelLoadError(
                f"--quantize {config.quantize} is not available on {self.adapter.name} "
                f"(choose from {', '.join(('none', *self.adapter.quantize_modes))})"
            )
        return dtype

    def info(self) -> InfoResponse:
        return InfoResponse(
            requires_padding=False,
            dtype=str(self.dtype).removeprefix("torch."),
            device_type=self.adapter.device_type,
            window_size=self.model_config.sliding_window,
            speculate=self.speculator.num_tokens if self.speculator is not None else 0,
            support_chunking=self.config.prefix_caching,
            use_prefix_caching=self.config.prefix_caching,
            block_size=self.block_size,
            attention_impl=self._attention_impl(),
            pipeline_stages=self.pipe.stages if self.pipe is not None else 1,
        )

    def _attention_impl(self) -> str:
        """The attention path, and the device kernels in use where they are not pure torch."""
        impl = "flat_paged" if self.implementation == "native" else "transformers+flat_paged"
        kernels = self.adapter.kernel_names()
        return f"{impl} ({kernels})" if kernels else impl

    def warmup(
        self,
        max_input_tokens: int | None = None,
        max_prefill_tokens: int | None = None,
        max_total_tokens: int | None = None,
        max_batch_size: int | None = None,
        batch: Batch | None = None,
    ) -> WarmupResult:
        """Size the KV cache, plan buckets and run every one of them (engine/warmup/run.py's
        start_up). Limits left None take the config's.

        A router's warmup `batch` (TGI sends one whose parameters exercise every logits processor)
        is then prefilled once and dropped, so the sampling paths have run before serving too; not
        where warming runs no forward (eager CPU), since there nothing compiles on a first run."""
        limits = self._limits(
            max_input_tokens, max_prefill_tokens, max_total_tokens, max_batch_size
        )
        check_recompute_fits(self.model, limits)
        self._drop_previous_warmup()
        parts = ShardModel(
            self.model,
            self.model_config,
            self.adapter,
            self.dtype,
            self.block_size,
            self.world,
            tower=self.vision,  # its image buckets are planned and warmed with the rest
        )
        with self.adapter.device_scope():
            warmed = start_up(
                parts, self.config, limits, self.fingerprint(), self.show_progress, self.device_lock
            )
        self.runner, self.background = warmed.runner, warmed.background
        self._warm_draft(limits, warmed.num_blocks)
        self.warmup_log = warmed.phases  # per-phase and per-bucket times and memory
        self.allocator, self.limits = ShardBlockPool(warmed.num_blocks), limits
        self.contents = BlockContents(self.block_size) if self.config.prefix_caching else None
        self._warm_serving_paths(batch)
        start_serving(self.adapter)
        self._start_recording()
        self._reset_stats()
        # The model, its cache and everything warmup made live as long as the shard: frozen, the
        # collector's older generations stop walking them, which it did in the middle of decode
        # steps (0.5 ms of an 11.5 ms lone-row step of the embedded model, 2026-12-04).
        gc.collect()
        gc.freeze()
        return WarmupResult(
            self.runner.kv_cache.capacity_tokens, limits.max_input_tokens, limits.max_total_tokens
        )

    def _drop_previous_warmup(self) -> None:
        """Everything a previous warmup made (its batches, runner, cache and background warming),
        released before this one measures free memory."""
        gc.unfreeze()  # what the last warmup froze may be garbage now (the old runner and cache)
        start_warmup(self.adapter)
        self.clear()
        if self.turns is not None:
            self.turns.reset()  # the router numbers its steps from 1 again
        self._stop_background_warmup()
        self.runner = None  # drop the previous cache before measuring free memory
        if self.speculator is not None and self.speculator.draft is not None:
            self.speculator.draft.release()
        self.adapter.release_memory(self.model)  # and what still holds it or caches its memory
        # new limits, new cache: only what this warmup runs counts as warm
        self.adapter.shapes.clear()

    def _warm_serving_paths(self, batch: Batch | None) -> None:
        """What serving runs beside the buckets: the router's warmup `batch` prefilled once and
        dropped (where warming runs forwards), the first forward (where it does not), the sampler
        and the verify gathers."""
        if batch is not None and batch.requests and self.adapter.warm_runs_forward:
            for request in batch.requests:  # TGI's warmup image is no real image: its text stays
                request.chunks = None
            self.prefill(batch)
            self.clear(batch.id)
        if self.config.warmup_mode == "none":
            return
        if not self.adapter.warm_runs_forward:
            self._first_forward()
        with self.device_lock, self.adapter.device_scope():
            warm_sampler(self.runner, self.model_config.vocab_size)
            if uses_static_sampling(self.runner):
                warm_prompt_copy(self.runner)  # `n` siblings' prompt KV
            warm_verify_gathers(self.runner, self.model_config.vocab_size)

    def _reset_stats(self) -> None:
        """serving_stats and the metrics count served traffic, not warmup."""
        self.runner.padding = PaddingStats()
        self.chunk_stats.update(chunked_prompts=0, prefill_chunks=0)
        self.lookahead_stats.update(lookahead_runs=0, lookahead_steps=0)
        if self.speculator is not None:
            self.speculator.reset_stats()

    def _first_forward(self) -> None:
        """A one-token prompt and one decode step through the model, in a block freed after: where
        warmup runs no bucket (eager CPU), a process's first forward pays one-time set-up that would
        otherwise fall on the first request (the embedded model's first prefill took 216-309 ms
        against 31-50 ms after, 2026-12-04). A pipeline stage's forward needs its peers':
        skipped."""
        if getattr(self.model, "stage", None) is not None:
            return
        blocks = self.allocator.allocate(1)
        first, second = blocks[0] * self.block_size, blocks[0] * self.block_size + 1
        try:
            with self.device_lock, self.adapter.device_scope():
                self.runner.prefill([PrefillInput([0], [first])])
                self.runner.decode([DecodeInput(0, 1, second, blocks)])
        finally:
            self.allocator.free(blocks)

    def _warm_draft(self, limits: ServingLimits, num_blocks: int) -> None:
        """--speculate draft: the draft's cache (the target's block ids) and buckets."""
        if self.speculator is None or self.speculator.draft is None:
            return
        from engine.warmup.run import bucket_limits

        planned = bucket_limits(
            limits, self.block_size, num_blocks, chunked=self.config.prefix_caching
        )
        with self.device_lock, self.adapter.device_scope():
            self.speculator.draft.warm(
                planned,
                num_blocks,
                self.block_size,
                self.speculator.num_tokens,
                graphless=not self.adapter.warm_runs_forward,
            )
        if hasattr(self.speculator.draft, "slot_states"):  # EAGLE-3: copied prompts carry them
            self.runner.kv_cache.extras = self.speculator.draft.slot_states()

    def fingerprint(self) -> dict:
        """What a warmup profile's latencies depend on (engine/warmup/profile.py)."""
        from engine.warmup.profile import fingerprint

        return fingerprint(
            self.model_path,
            self.adapter,
            self.dtype,
            self.world_size,
            self.block_size,
            self.config.quantize,
        )

    def warmup_progress(self) -> dict:
        """Buckets warmed so far: progressive warmup goes on after Warmup has answered."""
        if self.background is not None:
            return self.background.progress()
        if self.runner is None:
            return {"warmed": 0, "total": 0, "done": False}
        plan, warmed = self.runner.plan, self.adapter.shapes.warmed
        count = (
            sum(("prefill", b) in warmed for b in plan.prefill)
            + sum(("decode", b) in warmed for b in plan.decode)
            + sum(("verify", b) in warmed for b in plan.verify)
        )
        return {"warmed": count, "total": plan.graphs, "done": count == plan.graphs}

    def close(self) -> None:
        """Before the process exits: stop progressive warmup's thread (after its current bucket)."""
        if self.background is not None and not self.background.done:
            log.info("stopping the background warmup")
        self._stop_background_warmup()

    def _stop_background_warmup(self) -> None:
        if self.background is not None:
            self.background.stop()
            self.background = None

    def _start_recording(self) -> None:
        """--record-shapes: rank 0 only (every rank serves the same batches)."""
        if self.config.record_shapes and self.rank == 0:
            from engine.buckets.shapes import ShapeRecorder

            self.recorder = self.recorder or ShapeRecorder(self.config.record_shapes)
            self.runner.recorder = self.recorder
            if self.vision is not None:  # and the tower's runs
                self.vision.recorder = self.recorder

    def serving_stats(self) -> dict:
        """Padding and unwarmed-shape counts since warmup, for the router's metrics; and for its
        front page the plan's size, warmup progress, and the busiest buckets (bucket_counts)."""
        padding, unwarmed = self.runner.padding, sum(self.adapter.shapes.unwarmed.values())
        progress, plan = self.warmup_progress(), self.runner.plan
        return {
            "plan_buckets": [len(plan.prefill), len(plan.decode)],
            "warmup": [progress["warmed"], progress["total"]],
            "buckets": [bucket_counts(*entry) for entry in padding.busiest(REPORTED_BUCKETS)],
            "buckets_used": len(padding.by_bucket),
            "prefill_real": padding.real("prefill"),
            "prefill_padded": padding.padded("prefill"),
            "decode_real": padding.real("decode"),
            "decode_padded": padding.padded("decode"),
            "unwarmed_shapes": unwarmed,
            "prefill_forwards": padding.forwards("prefill"),
            "decode_forwards": padding.forwards("decode"),
            "copied_prompts": self.runner.kv_cache.copied_prompts,
            **self.chunk_stats,
            **self.lookahead_stats,
            **graph_counts(self.adapter),
            **(self.vision.stats if self.vision is not None else NO_IMAGES),
            **(self.speculator.summary() if self.speculator is not None else NO_SPECULATION),
        }

    @_exclusive
    def health(self) -> None:
        """Touch the device: a failed or hung device fails this instead of a user's request. Under
        the device lock: progressive warmup may be capturing a graph, which a stray device op would
        break."""
        probe = torch.ones(1, device=self.adapter.torch_device) + 1
        self.adapter.synchronize()
        if probe.item() != 2:
            raise RuntimeError(f"{self.adapter.name} device answered 1 + 1 = {probe.item()}")

    @_exclusive
    def prefill(
        self,
        batch: Batch,
        cached_batch: CachedBatch | None = None,
        resume: dict[int, list[int]] | None = None,
    ) -> tuple[list[Generation], CachedBatch | None]:
        """`resume`: request id -> tokens it generated before a shard restart; they are prefilled
        after its prompt and its generation goes on from there."""
        start, ctx = self._start_step()
        check_prefill(batch, cached_batch, self.batches, self.allocator.num_blocks, self.block_size)
        sequences = admit_requests(ctx, batch.requests, resume or {})
        running = len(self.batches.get(cached_batch.id, ())) if cached_batch else 0
        try:
            with self._overlap():
                generations = prefill_step(ctx, sequences, running + len(sequences))
        except Exception:
            self._release(sequences)
            raise
        joined = time.perf_counter_ns()
        previous = self._take([cached_batch.id]) if cached_batch else []
        concat_ns = time.perf_counter_ns() - joined if cached_batch else None
        result = self._store(batch.id, previous + sequences, generations)
        self._finish_step(start, concat_ns)
        return result

    @_exclusive
    def decode(
        self, batches: list[CachedBatch], grown: dict[int, list[int]] | None = None
    ) -> tuple[list[Generation], CachedBatch | None]:
        """`grown`: request id -> KV blocks the router added to it for this step (on-demand
        allocation)."""
        check_decode(batches)
        start, ctx = self._start_step()
        joined = time.perf_counter_ns()
        sequences = [seq for cached in batches for seq in self._get(cached.id)]
        concat_ns = time.perf_counter_ns() - joined if len(batches) > 1 else None
        if grown:
            self._grow(sequences, grown)
        ahead, self.ahead = self.ahead, None
        early_ns = ahead.forward_ns if ahead is not None and ahead.covers(sequences) else 0
        self.lookahead_stats["lookahead_steps"] += early_ns > 0
        with self._overlap(ahead is None and self._one_forward(sequences)):
            generations = decode_step(ctx, sequences, ahead)
        self._take([cached.id for cached in batches])  # only once the step succeeded
        result = self._store(batches[0].id, sequences, generations)
        self._finish_step(start, concat_ns, early_ns)
        return result

    @_exclusive
    def embed(self, inputs: list[EmbedInput]) -> list[Embedding]:
        """The inputs' pooled final hidden states (--pooling), in the warmed prefill buckets; the
        other batches are untouched and no KV block is taken. Every tensor-parallel rank runs the
        forward; rank 0 answers (the others return nothing)."""
        start, ctx = self._start_step()
        if self.runner.pooler is None:
            why = can_pool(self.model) or "the shard was started with --pooling none"
            raise InvalidRequestError(f"this model serves no embeddings: {why}")
        check_inputs(
            inputs,
            max_input_tokens=ctx.limits.max_input_tokens,
            vocab_size=self.model_config.vocab_size,
            hidden_size=self.model_config.hidden_size,
            matryoshka=self.model_config.matryoshka,
        )
        longest = max(b.seq_len for b in self.runner.plan.prefill if not b.context_blocks)
        embeddings = embed_step(self.runner, inputs, longest)
        self._finish_step(start, None)
        return embeddings if self.rank == 0 else []

    @_exclusive
    def look_ahead(self, batch_id: int) -> None:
        """Run batch `batch_id`'s next decode forward now, for its next step to use: called right
        after a step is answered, when the router said it will decode that batch next. A failure
        here is only logged: the step itself runs the forward again and reports it."""
        self.ahead = None
        sequences = self.batches.get(batch_id)
        if self.runner is None or not sequences:
            return
        try:
            self.ahead = look_ahead_step(self._context(), sequences)
            self.lookahead_stats["lookahead_runs"] += self.ahead is not None
        except Exception:  # noqa: BLE001 - the step repeats the work and answers the error
            log.exception("lookahead of batch %d failed", batch_id)

    def _overlap(self, pausing: bool = False):
        """A pipeline stage's step, labelled with its order; `pausing`: the step runs one forward,
        whose wait for the logits lets the router's next step in (engine/pipeline/turns.py)."""
        stage = getattr(self.model, "stage", None)
        turn = self.turns.current if self.turns is not None else None
        if stage is None or turn is None:
            return nullcontext()
        background = self.background is not None and not self.background.done
        pause = self._paused if pausing and turn.order and not background else None
        return stage.overlapping(turn.order, pause)

    def _one_forward(self, sequences: list[Sequence]) -> bool:
        """Whether decode_step runs exactly one forward: no row still prefilling, no speculation,
        no rope-switch recompute, and one decode bucket (engine/runner.py's split) for them all."""
        if self.speculator is not None or recompute_position(self.model) is not None:
            return False
        if any(seq.prefilling for seq in sequences):
            return False
        blocks = [len(seq.blocks_through(len(seq.token_ids) - 1)) for seq in sequences]
        return len(self.runner.plan.split_decode(blocks)) == 1

    @contextmanager
    def _paused(self):
        """The turn and the device lock go to the next step while this one waits."""
        self.device_lock.release()
        try:
            with self.turns.given_away():
                yield
        finally:
            self.device_lock.__enter__()

    def _grow(self, sequences: list[Sequence], grown: dict[int, list[int]]) -> None:
        check_grown(grown, sequences, self.batches, self.allocator.num_blocks)
        for seq in sequences:
            if seq.id in grown:
                seq.blocks = seq.blocks + list(grown[seq.id])
                if self.contents is not None:
                    self.contents.forget(grown[seq.id])

    def _start_step(self) -> tuple[int, StepContext]:
        ctx = self._context()
        self.runner.forward_ns = 0
        return time.perf_counter_ns(), ctx

    def _finish_step(self, start: int, concat_ns: int | None, early_ns: int = 0) -> None:
        """`early_ns`: the lookahead forward this step used; its time counts as the step's."""
        total = time.perf_counter_ns() - start + early_ns
        forward = self.runner.forward_ns + early_ns
        self.last_timings = StepTimings(
            forward, total - forward - (concat_ns or 0), total, concat_ns
        )

    def filter(self, batch_id: int, request_ids: list[int]) -> CachedBatch:
        sequences = self._get(batch_id)
        keep = set(request_ids)
        unknown = keep - {s.id for s in sequences}
        if unknown:
            raise KeyError(f"batch {batch_id} has no request {sorted(unknown)[0]}")
        self._release([s for s in sequences if s.id not in keep])
        self.batches[batch_id] = [s for s in sequences if s.id in keep]
        return self._cached(batch_id, self.batches[batch_id])

    def clear(self, batch_id: int | None = None) -> None:
        ids = list(self.batches) if batch_id is None else [batch_id]
        if batch_id is None:
            self.ahead = None
            if self.speculator is not None:  # adaptive K starts afresh with the traffic
                self.speculator.reset_adaptive()
        for sequence_list in (self.batches.pop(i, []) for i in ids):
            self._release(sequence_list)

    def _context(self) -> StepContext:
        if self.runner is None:
            raise InvalidRequestError("the shard has not been warmed up")
        return StepContext(
            runner=self.runner,
            tokenizer=self.tokenizer,
            allocator=self.allocator,
            limits=self.limits,
            eos_token_ids=self.eos_token_ids,
            special_token_ids=self.special_token_ids,
            block_size=self.block_size,
            grammars=self._grammars,
            unset_seed=self._unset_seed,
            rank=self.rank,
            world_size=self.world_size,
            lora_set=self.lora_set,
            vocab_size=self.model_config.vocab_size,
            contents=self.contents,
            chunk_stats=self.chunk_stats,
            speculator=self.speculator,
            vision=self.vision,
        )

    def _unset_seed(self, request_id: int) -> int:
        return (self.group_seed * 0x9E3779B97F4A7C15 + request_id) % 2**64 or 1

    def _grammars(self):
        """The grammar compiler, built on first use (its tokenizer index costs a moment)."""
        if self._grammar_compiler is None:
            try:
                from engine.grammar import GrammarCompiler
            except ImportError as err:
                raise InvalidRequestError(
                    f"parameters.grammar: grammar support is not installed ({err}); "
                    "install it with `pip install --no-deps xgrammar apache-tvm-ffi`"
                ) from None

            self._grammar_compiler = GrammarCompiler(
                self.tokenizer, self.model_config.vocab_size, self.eos_token_ids
            )
        return self._grammar_compiler

    def _get(self, batch_id: int) -> list[Sequence]:
        if batch_id not in self.batches:
            raise KeyError(f"batch {batch_id} not found")
        return self.batches[batch_id]

    def _take(self, batch_ids: list[int]) -> list[Sequence]:
        return [seq for batch_id in batch_ids for seq in self.batches.pop(batch_id, [])]

    def _store(
        self, batch_id: int, sequences: list[Sequence], generations
    ) -> tuple[list[Generation], CachedBatch | None]:
        finished = [s for s in sequences if s.finish_reason is not None]
        self._release(finished)
        running = [s for s in sequences if s.finish_reason is None]
        if not running:
            return generations, None
        self.batches[batch_id] = running
        return generations, self._cached(batch_id, running)

    def _release(self, sequences: list[Sequence]) -> None:
        for seq in sequences:
            if seq.owns_blocks and self.allocator is not None:
                self.allocator.free(seq.blocks)
                seq.blocks = []

    def _cached(self, batch_id: int, sequences: list[Sequence]) -> CachedBatch:
        tokens = sum(len(s.token_ids) for s in sequences)
        max_tokens = sum(s.prompt_len + s.max_new_tokens for s in sequences)
        return CachedBatch(batch_id, [s.id for s in sequences], len(sequences), max_tokens, tokens)

    def _prefill_budget(self, max_prefill: int | None, max_input: int | None) -> int:
        """Without chunked prefill (it needs prefix caching's context buckets) a whole prompt is one
        prefill, so the budget grows to max_input_tokens."""
        budget = max_prefill or self.config.max_prefill_tokens
        return (
            budget
            if self.config.prefix_caching
            else max(budget, max_input or self.config.max_input_tokens)
        )

    def _limits(self, max_input, max_prefill, max_total, max_batch) -> ServingLimits:
        limits = ServingLimits(
            max_batch_size=max_batch or self.config.max_batch_size,
            max_input_tokens=max_input or self.config.max_input_tokens,
            max_total_tokens=max_total or self.config.max_total_tokens,
            max_prefill_tokens=self._prefill_budget(max_prefill, max_input),
        )
        positions = self.model_config.max_position_embeddings
        if limits.max_total_tokens > positions:
            raise InvalidRequestError(
                f"max_total_tokens={limits.max_total_tokens} exceeds the model's {positions} "
                "positions"
            )
        return limits


# Buckets in the stats each step carries (gRPC trailing metadata, which a client caps at a few KiB).
REPORTED_BUCKETS = 32


NO_IMAGES = {"images_encoded": 0, "encoder_ns": 0, "image_cache_hits": 0}  # a text model's


def bucket_counts(bucket, forwards: int, real: int, padded: int) -> list:
    """One bucket's use, compact: ["prefill", batch, seq_len, context_blocks, forwards, real tokens,
    padded tokens] or ["decode", batch, num_blocks, forwards, real rows, padded rows]; a verify
    bucket (engine/speculative/) as ["verify", batch, width, context_blocks, forwards, real rows,
    padded rows]."""
    if isinstance(bucket, VerifyBucket):
        return [
            "verify",
            bucket.batch_size,
            bucket.width,
            bucket.context_blocks,
            forwards,
            real,
            padded,
        ]
    if isinstance(bucket, PrefillBucket):
        return [
            "prefill",
            bucket.batch_size,
            bucket.seq_len,
            bucket.context_blocks,
            forwards,
            real,
            padded,
        ]
    return ["decode", bucket.batch_size, bucket.num_blocks, forwards, real, padded]
