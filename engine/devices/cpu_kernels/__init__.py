"""Fused C++ kernels for eager CPU decode, built on first use with torch.utils.cpp_extension.

Eager PyTorch spends a decode step of the embedded model on hundreds of small aten calls, and its
decode attention first gathers every row's KV blocks into a copy. kernels.cpp holds what replaces
them: attention that reads the paged cache in place (the contract of
engine.attention.flat.flat_attention, without softcap), SiLU-and-multiply, and RMS norm. Each is
tested against the pure-torch path, which stays the reference, the fallback where the build fails
(no compiler), and the path of every graph device.

The build (about a minute on two cores) is cached under bucketserve's cache dir, keyed by the
source and torch's version; BUCKETSERVE_CPU_KERNELS=0 turns the kernels off.
"""

from __future__ import annotations

import hashlib
import logging
import os
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels.cpp")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]


def enabled() -> bool:
    return os.environ.get("BUCKETSERVE_CPU_KERNELS", "1") != "0"


@cache
def load():
    """The compiled module, or None (disabled, or the build failed: logged once)."""
    if not enabled():
        return None
    from torch.utils import cpp_extension

    from engine.config import default_cache_dir

    key = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode()).hexdigest()[:16]
    build = Path(default_cache_dir()) / "cpu_kernels" / key
    build.mkdir(parents=True, exist_ok=True)
    try:
        return cpp_extension.load(
            name=f"bucketserve_cpu_kernels_{key}",
            sources=[str(SOURCE)],
            extra_cflags=FLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(build),
            verbose=False,
        )
    except Exception as error:  # no compiler, no headers: the pure-torch path serves
        log.warning("CPU kernels unavailable, using pure torch: %s", error)
        return None


def decode_attention(
    q,
    key_cache,
    value_cache,
    block_list,
    block_mapping,
    block_groups,
    block_bias,
    scale,
    masked=None,
):
    """flat_attention's contract (block_mapping and masked are not needed: the bias says it all)."""
    return load().decode_attention(
        q, key_cache, value_cache, block_list, block_groups, block_bias, scale
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return load().rms_norm(x, weight, eps)


def attention_backend():
    """The attention kernels of a CPU forward: torch's prefill, the in-place paged decode."""
    from engine.attention.backend import AttentionBackend
    from engine.attention.prompt import prompt_attention

    return AttentionBackend("cpu-kernels", prompt_attention, decode_attention)


def install(model: torch.nn.Module) -> int:
    """Give every plain RMS norm of `model` the fused kernel; the number of norms."""
    from engine.layers.norm import RMSNorm

    norms = [module for module in model.modules() if type(module) is RMSNorm]
    for norm in norms:
        norm.fused = rms_norm
    return len(norms)
