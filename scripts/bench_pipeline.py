"""Pipeline stage utilization with one batch in flight, then two (docs/multinode.md).

Two pipeline stages of a tiny Llama on two local processes (gloo, CPU), each a `Shard` driven as
the router drives them: two batches are prefilled, then decoded step after step, either one step
at a time (1 in flight: each step ends on every stage before the next starts) or in two lanes
(2 in flight: each lane sends its next step without waiting for the other lane's answer; the
shards keep the steps' order, engine/pipeline/turns.py). Each stage's decode spans
(PipelineStage.spans, perf_counter_ns: one clock on one machine) give its utilization (busy time
over the decode phase's wall time) and how long both stages worked at once.

    python scripts/bench_pipeline.py [--steps 16] [--rows 4] [--layers 8] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: the engine and the tests' model builder
    sys.path.insert(0, str(REPO))

STAGES = 2
FIRST_DECODE_ORDER = 3  # the two prefills are steps 1 and 2


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def decode_orders(lane: int, steps: int) -> list[int]:
    """The router's numbering of lane `lane`'s decodes: the lanes take turns, step after step."""
    return [FIRST_DECODE_ORDER + STAGES * k + lane for k in range(steps)]


def _stage(rank, port, model_dir, lanes, steps, rows, texts, results) -> None:
    """One rank: warm up, prefill two batches, decode them `steps` times, report."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch

    torch.set_num_threads(1)  # one core per stage, as one device per stage
    from engine.batch import Batch
    from engine.config import EngineConfig
    from engine.serving.shard import Shard
    from tests.helpers import build_request

    config = EngineConfig(
        model_id=str(model_dir),
        device="cpu",
        dtype="float32",
        block_size=16,
        max_batch_size=rows,
        max_input_tokens=64,
        max_total_tokens=128,
        max_prefill_tokens=64 * rows,
        pipeline_parallel_size=STAGES,
    )
    shard = Shard(config, rank, STAGES, show_progress=False)
    shard.warmup()
    tokens: dict[int, list[int]] = defaultdict(list)

    def note(generations) -> None:
        for generation in generations:
            tokens[generation.request_id] += generation.tokens.ids

    cached = []
    for lane in range(STAGES):
        ids = range(lane * rows, (lane + 1) * rows)
        requests = [build_request(i, steps + 1, texts[i]) for i in ids]
        generations, batch = shard.prefill(Batch(lane + 1, requests, size=rows), order=lane + 1)
        note(generations)
        cached.append(batch)
    first_span = len(shard.model.stage.spans)

    def run_lane(lane: int, orders: list[int]) -> None:
        batch = cached[lane]
        for order in orders:
            generations, batch = shard.decode([batch], order=order)
            note(generations)

    start = time.perf_counter_ns()
    if lanes == 1:  # one step at a time, the lanes' batches in turn
        for k in range(steps):
            for lane in range(STAGES):
                order = decode_orders(lane, steps)[k]
                generations, cached[lane] = shard.decode([cached[lane]], order=order)
                note(generations)
    else:
        threads = [
            threading.Thread(target=run_lane, args=(lane, decode_orders(lane, steps)))
            for lane in range(STAGES)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    end = time.perf_counter_ns()
    spans = [tuple(span) for span in shard.model.stage.spans[first_span:]]
    results.put((rank, start, end, spans, dict(tokens)))


def run_pipeline(model_dir, lanes: int, steps: int, rows: int, texts: list[str]) -> dict:
    """Both stages' decode spans, the decode phase's window and every request's tokens."""
    from engine.pipeline.stage import Span

    assert len(texts) >= STAGES * rows, "a prompt per request"
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [
        context.Process(
            target=_stage, args=(rank, port, str(model_dir), lanes, steps, rows, texts, results)
        )
        for rank in range(STAGES)
    ]
    for process in processes:
        process.start()
    try:
        reports = sorted(results.get(timeout=300) for _ in processes)
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    tokens: dict[int, list[int]] = {}
    for report in reports:
        tokens.update(report[4])
    return {
        "spans": [[Span(*span) for span in report[3]] for report in reports],
        "start": min(report[1] for report in reports),
        "end": max(report[2] for report in reports),
        "tokens": [tokens[i] for i in sorted(tokens)],
    }


def summary(run: dict, rows: int, steps: int) -> dict:
    from engine.pipeline.measure import cross_step_overlaps, together_ns, utilization

    first, last = run["spans"]
    start, end = run["start"], run["end"]
    wall = end - start
    return {
        "stage0_utilization": round(utilization(first, start, end), 3),
        "stage1_utilization": round(utilization(last, start, end), 3),
        "both_busy": round(together_ns(first, last, start, end) / wall, 3),
        "cross_step_overlaps": len(cross_step_overlaps(first, last)),
        "decode_wall_ms": round(wall / 1e6, 1),
        "tokens_per_s": round(STAGES * rows * steps / (wall / 1e9), 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16, help="decode steps per batch")
    parser.add_argument("--rows", type=int, default=2, help="requests per batch")
    parser.add_argument("--layers", type=int, default=8, help="layers, split over the 2 stages")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    from engine.config import default_cache_dir
    from engine.weights.loader import resolve_model_dir
    from tests.helpers import PROMPTS
    from tests.models import build_tiny_model

    with tempfile.TemporaryDirectory() as folder:
        model = build_tiny_model(
            "llama",
            Path(folder) / "llama",
            resolve_model_dir(None, default_cache_dir()),  # the embedded model's tokenizer
            hidden_size=256,
            intermediate_size=2048,
            num_hidden_layers=args.layers,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=32,
        )
        texts = (PROMPTS * args.rows)[: STAGES * args.rows]
        runs = {lanes: run_pipeline(model, lanes, args.steps, args.rows, texts) for lanes in (1, 2)}
    assert runs[1]["tokens"] == runs[2]["tokens"], "the lanes changed the greedy tokens"
    figures = {
        f"{lanes} in flight": summary(run, args.rows, args.steps) for lanes, run in runs.items()
    }
    setup = (
        f"{args.layers} layers (hidden 256), {STAGES} batches of {args.rows}, {args.steps} steps"
    )
    print(f"pipeline of {STAGES} stages, gloo on CPU, one thread each; {setup}")
    print(f"{'':14}" + "".join(f"{k:>22}" for k in next(iter(figures.values()))))
    for name, row in figures.items():
        print(f"{name:14}" + "".join(f"{v:>22}" for v in row.values()))
    if args.json:
        Path(args.json).write_text(json.dumps({"setup": setup, **figures}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
