"""vllm-hpu-extension's flat_pa across its releases, chosen by the signature that is installed.

The op's contract changed between releases (see tests/fakes/vllm_hpu_extension.py for the commits):
- v1.21.0: the cache as [blocks, block_size, kv_heads, dim], no block_size; its ops.py imports vLLM.
- v1.21.3: the cache as [slots, kv_heads, dim] plus a required block_size (our own layout).
- Both v1.21 releases: flat_pa reads flags.enabled_flags(), which asserts on a missing model type
  and keeps its first answer: environment.set_model_config must come before the first call.
- v1.22.0 and main: also a required position_bias, and the ops read the extension's runtime config,
  which must be set (environment.set_vllm_config) before its first read, or it is frozen without
  the model type.
- vllm-gaudi's copy (vllm_gaudi.extension): also required sinks, k_scales and v_scales.
A release whose flat_pa needs an argument we do not know is refused, with the reason, rather than
called wrongly.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from types import ModuleType, SimpleNamespace

import torch

# vllm-gaudi's copy first: vllm-hpu-extension is end of life, and where vLLM (so vllm-gaudi) is
# installed next to it, the maintained one is what that vLLM itself calls.
PACKAGES = ("vllm_gaudi.extension", "vllm_hpu_extension")
ALWAYS = {
    "query",
    "key_cache",
    "value_cache",
    "block_list",
    "block_mapping",
    "block_bias",
    "block_groups",
    "scale",
    "matmul_qk_op",
    "matmul_av_op",
    "batch2block_matmul_op",
    "block2batch_matmul_op",
    "keys_fetch_func",
    "values_fetch_func",
}
OPTIONAL_NONE = (
    "position_bias",
    "sinks",
    "k_scales",
    "v_scales",
)  # passed as None: no ALiBi, sinks, fp8 scales


class UnsupportedRelease(Exception):
    """An installed extension whose flat_pa this engine cannot call correctly."""


@dataclass
class FlatPA:
    package: str
    op: object
    with_block_size: bool  # v1.21.3 on: 3-D cache and block_size
    extra: dict = field(default_factory=dict)
    environment: ModuleType | None = None  # its runtime config, set before the first call
    configured: bool = False
    _groups: tuple = ()  # (block_groups, block_mapping, groups with padding apart) of this forward

    @property
    def release(self) -> str:
        if not self.with_block_size:
            layout = "v1.21.0 layout"
        else:
            layout = "v1.22.0+ layout" if "position_bias" in self.extra else "v1.21.3 layout"
        return f"{self.package} {layout}"

    def configure(self, model_type: str) -> None:
        """Set the extension's runtime config once, before any op reads it (and outside any
        graph)."""
        if self.configured or self.environment is None:
            return
        model_config = SimpleNamespace(hf_config=SimpleNamespace(model_type=model_type))
        if hasattr(self.environment, "set_vllm_config"):  # v1.22.0 on, vllm-gaudi
            self.environment.set_vllm_config(
                SimpleNamespace(
                    model_config=SimpleNamespace(model_type=model_type),
                    cache_config=SimpleNamespace(enable_prefix_caching=False),
                )
            )
        else:  # v1.21.x: v1.21.0 reads cfg.hf_config.model_type, v1.21.3 either form
            self.environment.set_model_config(model_config)
        self.configured = True

    def __call__(
        self, q, key_cache, value_cache, block_list, block_mapping, block_groups, block_bias, scale
    ):
        batch, heads, dim = q.shape
        block_size, kv_heads = block_bias.shape[1], key_cache.shape[1]
        if self.with_block_size:
            sizes = {"block_size": block_size}
        else:
            sizes = {}
            key_cache = key_cache.view(-1, block_size, kv_heads, dim)
            value_cache = value_cache.view(-1, block_size, kv_heads, dim)
        groups = self.padding_apart(block_groups, block_mapping, batch)
        out = self.op(
            query=q.reshape(batch, 1, heads * dim),
            key_cache=key_cache,
            value_cache=value_cache,
            block_list=block_list,
            block_mapping=block_mapping,
            block_bias=block_bias,
            block_groups=groups,
            scale=scale,
            matmul_qk_op=torch.matmul,
            matmul_av_op=torch.matmul,
            batch2block_matmul_op=torch.matmul,
            block2batch_matmul_op=torch.matmul,
            keys_fetch_func=fetch_blocks,
            values_fetch_func=fetch_blocks,
            **sizes,
            **self.extra,
        )
        return out.reshape(batch, heads, dim)

    def new_forward(self) -> None:
        self._groups = ()

    def padding_apart(self, block_groups, block_mapping, batch: int) -> torch.Tensor:
        """Padding blocks (no owner) in a group of their own, index `batch`: the op's block merge
        divides by their zero weight otherwise, and 0/0 would spoil the row they were put in.
        Every layer of a forward passes the same metadata tensors: computed once per forward."""
        if self._groups and self._groups[0] is block_groups and self._groups[1] is block_mapping:
            return self._groups[2]
        groups = block_groups.masked_fill(block_mapping.sum(dim=1) == 0, batch)
        self._groups = (block_groups, block_mapping, groups)  # held: their ids stay unique
        return groups


def fetch_blocks(cache: torch.Tensor, blocks: torch.Tensor, **_scales) -> torch.Tensor:
    """The blocks of a [blocks, block_size, kv_heads, dim] cache (called positionally by the
    vllm-hpu-extension releases, with blocks= by vllm-gaudi)."""
    return cache.index_select(0, blocks)


def load_flat_pa() -> tuple[FlatPA | None, list[str]]:
    """The first usable flat_pa among PACKAGES, and why each one before it was not usable."""
    reasons, absent = [], []
    for package in PACKAGES:
        try:
            return from_package(package), reasons
        except (ImportError, UnsupportedRelease) as err:
            missing = isinstance(err, ImportError) and _is_absent(package, err)
            (absent if missing else reasons).append(f"{package}: {err}")
    return None, reasons or absent  # a package that is not installed at all says least


def _is_absent(package: str, err: ImportError) -> bool:
    """The package itself is not installed (not: it is, and something it imports is missing)."""
    name = getattr(err, "name", None) or ""
    return package == name or package.startswith(name + ".") or "is not a package" in str(err)


def from_package(package: str) -> FlatPA:
    ops = importlib.import_module(f"{package}.ops")
    params = inspect.signature(ops.flat_pa).parameters
    required = {
        name
        for name, p in params.items()
        if p.default is p.empty and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    }
    unknown = required - ALWAYS - {"block_size", *OPTIONAL_NONE}
    if unknown:
        raise UnsupportedRelease(
            f"its flat_pa requires {', '.join(sorted(unknown))}, which this engine does not pass"
        )
    extra = {name: None for name in OPTIONAL_NONE if name in params}
    environment = importlib.import_module(f"{package}.environment")
    if not hasattr(environment, "set_vllm_config") and not hasattr(environment, "set_model_config"):
        raise UnsupportedRelease(
            "its environment module has neither set_vllm_config nor set_model_config, so the "
            "model type its kernels read cannot be set"
        )
    return FlatPA(package, ops.flat_pa, "block_size" in params, extra, environment)
