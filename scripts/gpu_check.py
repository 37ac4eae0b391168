"""One prepared check of bucketserve on an NVIDIA GPU, against transformers on the same GPU.

Nothing is downloaded: a random-weight model of Llama-3.2-1B's shape is built from its config here,
with a word-level tokenizer whose words are token ids ("t17" is token 17), so prompts are exact id
sequences on both sides. Three checks, then one summary line:
1. exactness: greedy tokens equal transformers' (fp32) for a mixed batch of prompt lengths;
2. graphs: in bf16, every decode forward after warmup is a CUDA-graph replay, and no forward ran
   at a shape warmup did not run;
3. throughput: 64 prompts x 128 new tokens, bucketserve vs transformers' batched generate.
`--device cpu --tiny` runs the same logic on a tiny model on CPU (the test suite does).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

LLAMA_3_2_1B = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    bos_token_id=128000,
    eos_token_id=128001,
    rope_theta=500000.0,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
)
TINY = dict(
    LLAMA_3_2_1B,
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    bos_token_id=1,
    eos_token_id=2,
    rope_scaling=dict(LLAMA_3_2_1B["rope_scaling"], original_max_position_embeddings=256),
)


def build_model_dir(out: Path, shape: dict, device: str) -> Path:
    """Random weights (saved in bf16, so fp32 loads on both sides hold identical values) and a tokenizer."""
    import transformers

    # A wider init than 0.02 keeps the top two logits apart: greedy choices are the model's, not rounding's.
    config = transformers.LlamaConfig(initializer_range=0.05, **shape)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(out)
    del model
    save_id_tokenizer(out, shape["vocab_size"], shape["bos_token_id"], shape["eos_token_id"])
    return out


def save_id_tokenizer(out: Path, vocab_size: int, bos: int, eos: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # Special tokens get names that are no prefix of a word: "t1" as bos would split "t17" in two.
    names = {0: "<unk>", bos: "<s>", eos: "</s>"}
    tokenizer = Tokenizer(
        models.WordLevel({names.get(i, f"t{i}"): i for i in range(vocab_size)}, unk_token="<unk>")
    )
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(out)


def prompt_ids(count: int, shortest: int, longest: int, vocab: int, seed: int) -> list[list[int]]:
    """Random ordinary tokens (not unk, bos or eos: Llama 3's specials sit at 128000 and up)."""
    rng = random.Random(seed)
    top = min(vocab, 128000)
    return [
        [rng.randrange(3, top) for _ in range(rng.randint(shortest, longest))] for _ in range(count)
    ]


def as_text(ids: list[int]) -> str:
    return " ".join(f"t{i}" for i in ids)


def shard_for(model_dir: Path, device: str, dtype: str, batch: int, longest: int, new_tokens: int):
    from engine.config import EngineConfig
    from engine.serving.shard import Shard

    config = EngineConfig(
        model_id=str(model_dir),
        device=device,
        dtype=dtype,
        max_batch_size=batch,
        max_input_tokens=longest,
        max_total_tokens=longest + new_tokens,
        max_prefill_tokens=max(longest, 8192),
        warmup_prompt_logprobs=False,
        cache_dir=model_dir / "cache",
    )
    return Shard(config, show_progress=False)


def ours(
    shard, prompts: list[list[int]], new_tokens: int, ignore_eos: bool
) -> tuple[list[list[int]], float, float]:
    """Generated ids per prompt, seconds of generation and seconds of warmup before it."""
    from engine.batch import Request, StoppingCriteriaParameters
    from launcher.generate import run_requests, warm_for

    texts = [as_text(p) for p in prompts]
    warm_start = time.perf_counter()
    warm_for(shard, texts, new_tokens, add_special_tokens=False)
    warm_seconds = time.perf_counter() - warm_start
    stopping = StoppingCriteriaParameters(max_new_tokens=new_tokens, ignore_eos_token=ignore_eos)
    requests = [
        Request(i, t, stopping_parameters=stopping, add_special_tokens=False)
        for i, t in enumerate(texts)
    ]
    shard.adapter.stats.clear()
    start = time.perf_counter()
    done = run_requests(shard, requests)
    _sync(shard.adapter.torch_device)
    return (
        [done[i].token_ids for i in range(len(prompts))],
        time.perf_counter() - start,
        warm_seconds,
    )


def reference(model, prompts: list[list[int]], new_tokens: int, device) -> list[list[int]]:
    """transformers' greedy tokens, one prompt at a time (no padding to blur the comparison)."""
    out = []
    for ids in prompts:
        generated = model.generate(
            torch.tensor([ids], device=device),
            max_new_tokens=new_tokens,
            do_sample=False,
            attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=device),
        )
        out.append(generated[0, len(ids) :].tolist())
    return out


def batched_throughput(model, prompts: list[list[int]], new_tokens: int, device, pad: int) -> float:
    """Seconds for transformers' batched generate of every prompt (left-padded), exactly new_tokens each."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    model.generate(
        ids[:2, -8:],
        attention_mask=mask[:2, -8:],
        max_new_tokens=2,
        do_sample=False,
        pad_token_id=pad,
    )
    _sync(device)
    start = time.perf_counter()
    model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=pad,
    )
    _sync(device)
    return time.perf_counter() - start


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def hf_model(model_dir: Path, dtype, device):
    import transformers

    return transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()


def check_exactness(model_dir: Path, device: str, vocab: int, new_tokens: int) -> tuple[int, int]:
    """(prompts whose greedy tokens equal transformers', prompts) in fp32, for a mixed batch."""
    prompts = prompt_ids(6, 3, 60, vocab, seed=1)
    shard = shard_for(
        model_dir, device, "float32", len(prompts), max(map(len, prompts)), new_tokens
    )
    got, _, _ = ours(shard, prompts, new_tokens, ignore_eos=False)
    del shard
    model = hf_model(model_dir, torch.float32, device)
    expected = reference(model, prompts, new_tokens, device)
    del model
    return sum(g == e for g, e in zip(got, expected)), len(prompts)


def check_graphs_and_speed(
    model_dir: Path, device: str, vocab: int, count: int, longest: int, new_tokens: int
) -> dict:
    """bf16: decode forwards vs CUDA-graph replays after warmup, unwarmed shapes, and both engines' seconds."""
    prompts = prompt_ids(count, 16, longest, vocab, seed=2)
    shard = shard_for(model_dir, device, "bfloat16", count, max(map(len, prompts)), new_tokens)
    got, seconds, warm_seconds = ours(shard, prompts, new_tokens, ignore_eos=True)
    stats = shard.adapter.stats  # cleared after warmup: what serving did
    decode_forwards = sum(n for (what, kind), n in stats.items() if kind == "decode")
    captured = getattr(getattr(shard.adapter, "graphs", None), "captured", {})
    result = dict(
        replays=stats[("replay", "decode")],
        decode_forwards=decode_forwards,
        unwarmed=sum(shard.adapter.shapes.unwarmed.values()),
        ours_s=seconds,
        warmup_s=warm_seconds,
        tokens=sum(map(len, got)),
        graphs=len(captured),
    )
    del shard
    model = hf_model(model_dir, torch.bfloat16, device)
    result["hf_s"] = batched_throughput(model, prompts, new_tokens, device, pad=0)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument(
        "--tiny", action="store_true", help="a tiny model (for CPU runs of this script's logic)"
    )
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument(
        "--longest", type=int, default=256, help="prompt lengths are drawn from 16..LONGEST"
    )
    args = parser.parse_args(argv)
    shape = TINY if args.tiny else LLAMA_3_2_1B
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as folder:
        model_dir = build_model_dir(Path(folder) / "model", shape, args.device)
        equal, total = check_exactness(model_dir, args.device, shape["vocab_size"], 16)
        run = check_graphs_and_speed(
            model_dir, args.device, shape["vocab_size"], args.prompts, args.longest, args.new_tokens
        )
    # On CUDA every decode forward must be a replay; on CPU (no graphs) none can be.
    graphs_ok = (
        run["replays"] == run["decode_forwards"] > 0
        if args.device == "cuda"
        else run["replays"] == 0
    )
    ok = equal == total and graphs_ok and run["unwarmed"] == 0
    print(
        f"GPU_CHECK {'PASS' if ok else 'FAIL'} device={args.device} model={'tiny' if args.tiny else 'llama-3.2-1b-shape'} "
        f"fp32_greedy_equal={equal}/{total} decode_replays={run['replays']}/{run['decode_forwards']} "
        f"unwarmed={run['unwarmed']} decode_graphs={run['graphs']} warmup_s={run['warmup_s']:.1f} "
        f"ours={run['tokens'] / run['ours_s']:.0f}tok/s transformers={run['tokens'] / run['hf_s']:.0f}tok/s "
        f"speedup={run['hf_s'] / run['ours_s']:.2f}x total_s={time.perf_counter() - began:.0f}",
        flush=True,
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
