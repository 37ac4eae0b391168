"""--record-shapes: the shard appends the unpadded shapes it serves, and the planner can read them back."""

from __future__ import annotations

from engine.batch import Batch
from engine.buckets.shapes import Shape, load_shapes
from engine.serving.shard import Shard
from launcher.generate import prompt_lengths
from tests.conftest import tiny_config
from tests.test_equivalence import PROMPTS
from tests.test_shard import drain, request


def test_recorded_shapes_are_the_batches_served(tiny_model_dirs, tmp_path):
    path = tmp_path / "shapes.jsonl"
    shard = Shard(
        tiny_config(
            tiny_model_dirs["llama"],
            max_batch_size=4,
            warmup_prompt_logprobs=False,
            record_shapes=str(path),
        ),
        show_progress=False,
    )
    shard.warmup()
    assert not path.exists() or path.read_text() == ""  # warmup itself is not traffic
    _, cached = shard.prefill(Batch(1, [request(0, 3), request(4, 3)]))
    drain(shard, cached, {0: [], 4: []})
    lengths = prompt_lengths(shard, [PROMPTS[0], PROMPTS[4]], add_special_tokens=True)
    shapes = load_shapes(path)
    assert shapes[0] == Shape("prefill", 2, max(lengths))
    # Two decode steps of both rows (3 tokens: 1 from prefill, 2 decoded); blocks of 16 tokens.
    blocks = [sum(-(-(n + step) // 16) for n in lengths) for step in (1, 2)]
    assert shapes[1:] == [Shape("decode", 2, k) for k in blocks]
