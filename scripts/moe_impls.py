"""Time the two static-shape MoE implementations (engine/layers/moe.py) on this machine.

    python scripts/moe_impls.py [--hidden 1024 --intermediate 3584 --experts 8 --top-k 2]

Prints milliseconds per MoE block forward for a decode-sized and a prefill-sized token count.
"""

import argparse
import time

import torch
import torch.nn.functional as F

from engine.distributed import SINGLE
from engine.layers.moe import MOE_IMPLS, SparseMoeBlock, moe_ops


def time_block(block: SparseMoeBlock, tokens: int, repeat: int) -> float:
    device = block.gate_up.device
    x = torch.randn(tokens, block.hidden, dtype=block.gate_up.dtype, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with torch.inference_mode():
        block(x)  # first call allocates
        sync()
        start = time.perf_counter()
        for _ in range(repeat):
            block(x)
        sync()
    return (time.perf_counter() - start) / repeat * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=3584)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--tokens", type=int, nargs="+", default=[8, 512])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    torch.manual_seed(0)
    print(
        f"{args.experts} experts, top-{args.top_k}, hidden {args.hidden}, intermediate {args.intermediate}, "
        f"{args.device}, {args.dtype}, {torch.get_num_threads()} CPU threads"
    )
    for impl in MOE_IMPLS:
        block = SparseMoeBlock(
            args.hidden,
            args.intermediate,
            args.experts,
            args.top_k,
            True,
            F.silu,
            SINGLE,
            moe_ops(impl),
        ).to(args.device, getattr(torch, args.dtype))
        with torch.no_grad():
            for param in block.parameters():
                param.normal_(0, 0.02)
        times = ", ".join(
            f"{t} tokens {time_block(block, t, args.repeat):.1f} ms" for t in args.tokens
        )
        print(f"{impl:6s}: {times}")


if __name__ == "__main__":
    main()
