"""`bucketserve check-shapes --trace FILE`: replay a `--record-shapes` trace or a JSONL of requests
through the lazy-graph simulator (`--simulate hpu`, engine/devices/simulate/) after a full warmup,
and print every step that would compile a device graph or break one, with the request features that
caused it. Exits non-zero when any step would. Runs on any CPU: a Gaudi user checks a workload
before deploying it."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from functools import partial
from pathlib import Path

from engine.batch import (
    Batch,
    GrammarType,
    NextTokenChooserParameters,
    Request,
    StoppingCriteriaParameters,
)
from engine.buckets.shapes import parse_shape
from engine.cli.main import add_engine_args, engine_config
from engine.errors import BucketserveError
from engine.kv_cache import RESERVED_BLOCK
from engine.runner import DecodeInput, PrefillInput

REQUEST_FIELDS = (
    "prompt", "max_new_tokens", "parameters", "top_n_tokens", "prefill_logprobs", "n", "adapter",
)  # fmt: skip
SIBLINGS = 16  # request ids: record i is i * SIBLINGS, its n - 1 siblings the ids after it
GRAMMARS = {"json": GrammarType.JSON, "regex": GrammarType.REGEX}


class ShapeProblems(BucketserveError):
    """Steps of the trace would compile or break a device graph after warmup."""


def add_check_shapes_command(commands) -> None:
    cmd = commands.add_parser(
        "check-shapes",
        help="replay a shape trace or JSONL requests through the HPU lazy-graph simulator",
    )
    add_engine_args(cmd, exclude=("otlp_endpoint", "simulate", "device", "strict_shapes"))
    cmd.add_argument(
        "--trace",
        required=True,
        help='a --record-shapes JSONL trace, or JSONL requests {"prompt": ..., '
        '"max_new_tokens": n, "parameters": {...}, "top_n_tokens": n, "prefill_logprobs": b, '
        '"n": siblings sharing the prompt, "adapter": a LoRA adapter\'s name}',
    )
    cmd.add_argument("--limit", type=int, help="replay only the first LIMIT records")
    cmd.set_defaults(func=cmd_check_shapes)


def cmd_check_shapes(args: argparse.Namespace) -> None:
    from engine.serving.shard import Shard

    records = read_trace(args.trace)[: args.limit]
    config = replace(engine_config(args), device="cpu", simulate="hpu", strict_shapes=False)
    shard = Shard(config, show_progress=args.verbose)
    shard.warmup()
    problems = check(shard, records)
    for line in problems:
        print(line)
    counts = {k: v for k, v in shard.serving_stats().items() if k.startswith("graph_")}
    print(" ".join(f"{k}={v}" for k, v in counts.items()))
    if problems:
        raise ShapeProblems(f"{len(problems)} steps of {args.trace} would compile or break a graph")
    print(f"{args.trace}: every step runs in warmed graphs")


def read_trace(path: str) -> list:
    """Shape records or request records, one kind per file."""
    records = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            records.append(parse_shape(line) if "phase" in record else request_record(record))
        except (ValueError, TypeError, KeyError) as err:
            raise BucketserveError(f"{path}:{number}: {err}") from None
    if not records:
        raise BucketserveError(f"{path}: no records")
    return records


def request_record(record: dict) -> dict:
    unknown = set(record) - set(REQUEST_FIELDS) - {"grammar", "stop"}
    if unknown or not isinstance(record.get("prompt"), str):
        raise ValueError(f"expected a shape or a request record, got keys {sorted(record)}")
    n = record.get("n", 1)
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= SIBLINGS:
        raise ValueError(f"'n' must be an integer from 1 to {SIBLINGS}, got {n!r}")
    return record


def check(shard, records: list) -> list[str]:
    if isinstance(records[0], dict):
        return replay_requests(shard, records)
    return replay_shapes(shard, records)


def _events(shard) -> list[dict]:
    """The simulator's compiles and breaks so far (none on a device that is not simulated)."""
    graphs = getattr(shard.adapter, "graphs", None)
    return graphs.events if graphs is not None else []


def _step(shard, what: str, features: str, run) -> list[str]:
    """Run one step; a line per compile or break it caused (or the refusal it met)."""
    since = len(_events(shard))
    unwarmed = sum(shard.adapter.shapes.unwarmed.values())
    try:
        with shard.adapter.device_scope():
            run()
    except (BucketserveError, ValueError) as err:
        return [f"{what} [{features}]: refused: {err}"]
    lines = [
        f"{what} [{features}]: {e['event']}: {e['cause']}"
        for e in _events(shard)[since:]
        if e["phase"] == "serving"
    ]
    if sum(shard.adapter.shapes.unwarmed.values()) > unwarmed:
        lines.append(f"{what} [{features}]: a bucket warmup did not run")
    return lines


def replay_shapes(shard, shapes) -> list[str]:
    """Each recorded batch shape, on dummy rows in the reserved block, then the sampler."""
    from engine.sampling.penalty_counts import penalty_counts
    from engine.sampling.sampler import new_sampling_state
    from engine.sampling.static import choose_static, sampler_rows

    runner, problems = shard.runner, []
    for number, shape in enumerate(shapes, 1):
        rows = shape.batch_size
        if shape.phase == "image":  # a vision tower's run
            run = partial(_replay_image, shard, shape)
            problems += _step(shard, f"line {number}", json.dumps(shape.as_json()), run)
            continue

        def run(shape=shape, rows=rows):
            if shape.phase == "prefill":
                context = [RESERVED_BLOCK] * (shape.context_blocks * runner.block_size)
                seqs = [
                    PrefillInput(
                        [0] * shape.size, [RESERVED_BLOCK] * shape.size, context_slots=context
                    )
                    for _ in range(rows)
                ]
                logits = runner.prefill(seqs).logits
            else:
                per_row = [shape.size // rows + (i < shape.size % rows) for i in range(rows)]
                seqs = [DecodeInput(0, 0, RESERVED_BLOCK, [RESERVED_BLOCK] * k) for k in per_row]
                logits = runner.decode(seqs)
            states = [new_sampling_state(NextTokenChooserParameters(), 0, 0) for _ in range(rows)]
            size = sampler_rows(runner, rows)
            choose_static(
                logits, list(range(rows)), states, [[0]] * rows, [1] * rows, [0] * rows, None,
                size, shard.adapter, penalty_counts(runner, shard.adapter, size, logits.shape[1]),
            )  # fmt: skip

        problems += _step(shard, f"line {number}", json.dumps(shape.as_json()), run)
    return problems


def _replay_image(shard, shape) -> None:
    """The tower at the image buckets a run of that many inputs of that size uses."""
    from engine.buckets.images import ImageBucket, split_run

    if shard.vision is None:
        raise ValueError("an image record, for a model that takes no images")
    tower = shard.vision
    for _, bucket in split_run(tower.planned, shape.batch_size, shape.size) or [
        (shape.batch_size, ImageBucket(shape.batch_size, shape.size))
    ]:
        tower.replay(bucket)


def _requests(i: int, record: dict) -> list[Request]:
    """Record i's request and its n - 1 siblings, which copy its prompt (OpenAI `n`)."""
    first = _request(i * SIBLINGS, record)
    siblings = [
        replace(first, id=first.id + k, prefill_source=first.id)
        for k in range(1, record.get("n", 1))
    ]
    return [first] + siblings


def _request(i: int, record: dict) -> Request:
    params = dict(record.get("parameters") or {})
    grammar = record.get("grammar")
    if grammar:
        params.update(grammar_type=GRAMMARS[grammar["type"]], grammar=grammar["value"])
    if "logit_bias" in params:
        params["logit_bias"] = {int(k): float(v) for k, v in params["logit_bias"].items()}
    stopping = StoppingCriteriaParameters(
        max_new_tokens=int(record.get("max_new_tokens", 16)),
        stop_sequences=list(record.get("stop") or []),
    )
    return Request(
        i,
        record["prompt"],
        parameters=NextTokenChooserParameters(**params),
        stopping_parameters=stopping,
        prefill_logprobs=bool(record.get("prefill_logprobs")),
        top_n_tokens=int(record.get("top_n_tokens", 0)),
        adapter_id=record.get("adapter"),
    )


def features(record: dict, tokens: int) -> str:
    """What of a request can change a step's shapes, in words."""
    parts = [f"prompt of {tokens} tokens"]
    parts += [f"{k}={v}" for k, v in (record.get("parameters") or {}).items()]
    for name in ("top_n_tokens", "prefill_logprobs", "stop", "n", "adapter"):
        if record.get(name):
            parts.append(f"{name}={record[name]}")
    if record.get("grammar"):
        parts.append(f"grammar={record['grammar']['type']}")
    return ", ".join(parts)


def replay_requests(shard, records: list[dict]) -> list[str]:
    """Admit one request a step next to the running batch (as a router does when requests arrive
    one by one), decoding the batch between admissions until every request finished."""
    problems, running, described = [], None, {}
    pending = list(enumerate(records))
    while pending or running is not None:
        size = 0 if running is None else len(running.request_ids)
        fits = pending and size + pending[0][1].get("n", 1) <= shard.limits.max_batch_size
        if pending and (fits or running is None):
            i, record = pending.pop(0)
            tokens = len(shard.tokenizer(record["prompt"])["input_ids"])
            requests = _requests(i, record)
            described.update({r.id: features(record, tokens) for r in requests})
            state = {}

            def run(i=i, requests=requests, state=state, running=running):
                batch = Batch(i, requests, len(requests), 0)
                state["result"] = shard.prefill(batch, running)

            problems += _step(shard, f"request {i} prefill", described[i * SIBLINGS], run)
            running = state.get("result", (None, running))[1]
            continue
        state = {}

        def run(state=state, running=running):
            state["result"] = shard.decode([running])

        ids = running.request_ids
        problems += _step(shard, "decode", "; ".join(described[r] for r in ids), run)
        running = state["result"][1] if "result" in state else None
    return problems
