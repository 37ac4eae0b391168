"""Fakes of vllm-hpu-extension's attention ops, one per supported release, and of Habana's FusedSDPA.

Each `flat_pa` has the exact signature of the release it mirrors and reads its arguments the way
that release does, then computes attention naively from them, so a caller that passes another
release's layout fails or gets wrong numbers:
- v1.21.0 (HabanaAI/vllm-hpu-extension@058a49bb0d6d17a845ff950ef39dc51fc8929d27): a 4-D cache
  [blocks, block_size, kv_heads, dim], no block_size; prompt_attention impls 'fsdpa'/'naive'/'flex';
  ops.py imports vLLM at module level, so without vLLM `import vllm_hpu_extension.ops` fails.
- v1.21.3 (@6c4fe39ea63ead53ac618d00ca3084b0bc117630): a required block_size and a 3-D cache
  [slots, kv_heads, dim], unflattened to blocks before the fetch functions see it.
- Both v1.21 releases: flat_pa reads `flags.enabled_flags()` (vllm_hpu_extension/flags.py), which
  evaluates every feature test against `environment.get_environment()` once and keeps the result;
  a test whose parameter is None asserts `Missing values for parameters: {'model_type'}!`, so
  `environment.set_model_config(cfg)` must come first (v1.21.0 reads cfg.hf_config.model_type,
  v1.21.3 also takes cfg.model_type). "fp32_softmax" is on for qwen2 unless VLLM_FP32_SOFTMAX
  says otherwise.
- v1.22.0 (@8211e0ba420e976cca07be323328e41fa8a1a9da; main @7717587d178061aaab7498c077b41501944bb288
  has the same ops signatures): also a required position_bias, impls 'fsdpa_impl'/'naive_impl'/
  'flex_impl', and the ops read runtime.get_config(), which must come after
  environment.set_vllm_config() (it is computed once, from the model type set there).
- vllm-gaudi (vllm-project/vllm-gaudi@091bbadda10bee4fd3f6d0efc1844d2610dd2707,
  vllm_gaudi/extension/ops.py): also required sinks, k_scales, v_scales; fetch functions are called
  with `blocks=`.
Every release's block merge needs padding blocks (all-zero mapping rows) in a group of their own
(index `batch`): grouped with a real row, their 0/0 adjustment turns the row into NaN.

FusedSDPA mirrors habana_frameworks.torch.hpex.kernels.FusedSDPA.apply (positional arguments only,
an autograd Function): q, k, v [batch, heads, seq, dim] (k, v may have fewer heads), with
valid_sequence_lengths masking the keys past each row's length on the padding side. An attn_mask is
an additive bias [batch, 1, q, k], and keys may be longer than the queries (the past KV before the
new tokens), as vllm-hpu-extension's ops.py (@0073ab88ab4a7a73dc7e62f33e32bcf602ab4838)
`_get_context` and `_fsdpa_prompt_attention` call it for prefix caching; that wrapper drops
causality and the lengths whenever it passes a bias ("causal + attn_bias is not yet supported"), so
the fake refuses the combination, and lengths with past keys.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import _disable_current_modes

from tests.fakes.modules import fake_module, install, install_on_import

VERSIONS = ("v1.21.0", "v1.21.3", "v1.22.0", "vllm-gaudi")
IMPLS = {"v1.21.0": ("naive", "fsdpa", "flex"), "v1.21.3": ("naive", "fsdpa", "flex")}


class FakeExtension:
    def __init__(self, version: str = "v1.22.0", with_vllm: bool = False):
        assert version in VERSIONS, version
        self.version, self.with_vllm = version, with_vllm
        self.calls = {"flat_pa": 0, "prompt_attention": 0, "fused_sdpa": 0}
        self.fused_lengths: list = []  # valid_sequence_lengths of each FusedSDPA call
        self.model_type = None  # set by environment.set_vllm_config (v1.22.0 on)
        self.config_read = False
        self.runtime_params: dict = {}  # environment.runtime_params (v1.21.x)
        self.detected = None  # flags.enabled_flags()'s frozen result (v1.21.x)
        self.hw, self.build = "gaudi2", "1.21.3.57"  # what get_hw() and get_build() answer here

    # --- flat_pa, one signature per release --------------------------------------------------

    def ops_functions(self) -> dict:
        fake = self

        def flat_pa_v1_21_0(
            query,
            key_cache,
            value_cache,
            block_list,
            block_mapping,
            block_bias,
            block_groups,
            scale,
            matmul_qk_op,
            matmul_av_op,
            batch2block_matmul_op,
            block2batch_matmul_op,
            keys_fetch_func,
            values_fetch_func,
            **ignored_args,
        ):
            _, _, kv_heads, head_size = key_cache.shape  # 4-D, as this release unpacks it
            fake.enabled_flags()  # 'fp32_softmax' in enabled_flags()
            return fake._flat_pa(
                query,
                keys_fetch_func(key_cache, block_list),
                values_fetch_func(value_cache, block_list),
                block_mapping,
                block_bias,
                block_groups,
                scale,
                head_size,
            )

        def flat_pa_v1_21_3(
            query,
            key_cache,
            value_cache,
            block_list,
            block_mapping,
            block_bias,
            block_groups,
            block_size,
            scale,
            matmul_qk_op,
            matmul_av_op,
            batch2block_matmul_op,
            block2batch_matmul_op,
            keys_fetch_func,
            values_fetch_func,
            **ignored_args,
        ):
            _, kv_heads, head_size = key_cache.shape  # 3-D slots
            fake.enabled_flags()  # 'fp32_softmax' in enabled_flags()
            return fake._flat_pa(
                query,
                keys_fetch_func(key_cache.unflatten(0, (-1, block_size)), block_list),
                values_fetch_func(value_cache.unflatten(0, (-1, block_size)), block_list),
                block_mapping,
                block_bias,
                block_groups,
                scale,
                head_size,
            )

        def flat_pa_v1_22_0(
            query,
            key_cache,
            value_cache,
            block_list,
            block_mapping,
            block_bias,
            block_groups,
            block_size,
            scale,
            matmul_qk_op,
            position_bias,
            matmul_av_op,
            batch2block_matmul_op,
            block2batch_matmul_op,
            keys_fetch_func,
            values_fetch_func,
            **ignored_args,
        ):
            _, kv_heads, head_size = key_cache.shape
            fake.get_config()
            assert position_bias is None, "the fake computes no position bias (ALiBi)"
            return fake._flat_pa(
                query,
                keys_fetch_func(key_cache.unflatten(0, (-1, block_size)), block_list),
                values_fetch_func(value_cache.unflatten(0, (-1, block_size)), block_list),
                block_mapping,
                block_bias,
                block_groups,
                scale,
                head_size,
            )

        def flat_pa_vllm_gaudi(
            query,
            key_cache,
            value_cache,
            block_list,
            block_mapping,
            block_bias,
            block_groups,
            block_size,
            scale,
            matmul_qk_op,
            position_bias,
            matmul_av_op,
            batch2block_matmul_op,
            block2batch_matmul_op,
            keys_fetch_func,
            values_fetch_func,
            sinks,
            k_scales,
            v_scales,
            **ignored_args,
        ):
            _, kv_heads, head_size = key_cache.shape
            fake.get_config()
            assert position_bias is None and sinks is None and k_scales is None and v_scales is None
            return fake._flat_pa(
                query,
                keys_fetch_func(key_cache.unflatten(0, (-1, block_size)), blocks=block_list),
                values_fetch_func(value_cache.unflatten(0, (-1, block_size)), blocks=block_list),
                block_mapping,
                block_bias,
                block_groups,
                scale,
                head_size,
            )

        flat_pa = {
            "v1.21.0": flat_pa_v1_21_0,
            "v1.21.3": flat_pa_v1_21_3,
            "v1.22.0": flat_pa_v1_22_0,
            "vllm-gaudi": flat_pa_vllm_gaudi,
        }[self.version]
        return {"flat_pa": flat_pa, "prompt_attention": self.prompt_attention}

    def _flat_pa(
        self, query, keys, values, block_mapping, block_bias, block_groups, scale, head_size
    ):
        """query [batch, 1, heads * dim]; keys, values [blocks, block_size, kv_heads, dim] as fetched.
        Static shapes throughout, as the real op: it is captured in HPU graphs."""
        self.calls["flat_pa"] += 1
        batch, one, hidden = query.shape
        num_blocks, block_size, kv_heads, _ = keys.shape
        with _not_recorded():  # the contract, checked when the op is called (not on a graph replay)
            assert one == 1 and block_mapping.shape == (num_blocks, batch) == (
                len(block_groups),
                batch,
            )
            assert block_bias.shape == (num_blocks, block_size)
            padding = block_mapping.sum(1) == 0
            assert bool((block_groups[padding] == batch).all()), (
                "padding blocks share a real row's group: 0/0"
            )
            assert bool((block_groups[~padding] < batch).all())
        heads = hidden // head_size
        group = heads // kv_heads
        q = query.view(batch, heads, head_size) * scale
        k = keys.flatten(0, 1).repeat_interleave(group, 1)  # [tokens, heads, dim]
        v = values.flatten(0, 1).repeat_interleave(group, 1)
        scores = torch.einsum("bhd,thd->bht", q, k) + block_bias.flatten().to(q.dtype)
        owner = block_groups.repeat_interleave(block_size)
        mine = owner.view(1, 1, -1) == torch.arange(batch, device=owner.device).view(batch, 1, 1)
        probs = torch.softmax(scores.masked_fill(~mine, float("-inf")), dim=-1).nan_to_num(0.0)
        return torch.einsum(
            "bht,thd->bhd", probs, v
        )  # as block2batch(...).squeeze(-2).flatten(1, 2) leaves it

    def prompt_attention(self, impl, **args):
        self.calls["prompt_attention"] += 1
        names = IMPLS.get(self.version, ("naive_impl", "fsdpa_impl", "flex_impl"))
        assert impl in names, f"Unsupported implementation: {impl}"
        raise NotImplementedError("the adapter calls FusedSDPA directly for prefill")

    # --- the runtime parameters and flags (v1.21.x) -------------------------------------------

    def set_model_config(self, cfg) -> None:
        if self.version == "v1.21.0":
            self.runtime_params["model_type"] = cfg.hf_config.model_type
        elif hasattr(cfg, "hf_config"):
            self.runtime_params["model_type"] = cfg.hf_config.model_type
        else:
            self.runtime_params["model_type"] = cfg.model_type

    def get_environment(self, **overrides) -> dict:
        environment = {
            "build": self.build,
            "hw": self.hw,
            "model_type": self.runtime_params.get("model_type", None),
        }
        return environment | overrides

    def enabled_flags(self) -> set:
        """As flags.enabled_flags: computed once (kept even if the model type changes later)."""
        if self.detected:
            return self.detected
        environment = self.get_environment()
        features = {  # name -> (the parameters its test needs, the test)
            "gaudi2": ({"hw"}, lambda env: env["hw"] == "gaudi2"),
            "gaudi3": ({"hw"}, lambda env: env["hw"] == "gaudi3"),
            "fp32_softmax": (
                {"model_type"},
                lambda env: _env_flag("VLLM_FP32_SOFTMAX", env["model_type"] == "qwen2"),
            ),
        }
        enabled = set()
        for name, (needed, check) in features.items():
            missing = {k for k in needed if environment[k] is None}
            assert len(missing) == 0, f"Missing values for parameters: {missing}!"
            if check(environment):
                enabled.add(name)
        self.detected = enabled
        return enabled

    # --- the runtime configuration (v1.22.0 on) ----------------------------------------------

    def set_vllm_config(self, cfg) -> None:
        model_config = cfg.model_config
        self.model_type = (
            model_config.hf_config if hasattr(model_config, "hf_config") else model_config
        ).model_type
        assert isinstance(cfg.cache_config.enable_prefix_caching, bool)

    def get_config(self):
        # The real get_config() computes the configuration once and keeps it: read before
        # set_vllm_config, it keeps a missing model type (qwen2's fp32 softmax is then lost).
        if self.model_type is None:
            raise AssertionError(
                "runtime.get_config() read before environment.set_vllm_config(): "
                "the configuration would be frozen without a model type"
            )
        self.config_read = True

    # --- FusedSDPA ---------------------------------------------------------------------------

    def fused_sdpa(self, *args, **kwargs):
        assert not kwargs, "FusedSDPA.apply takes positional arguments only (an autograd Function)"
        defaults = [None, 0.0, False, None, "None", None, None, "left"]
        q, k, v, mask, dropout, is_causal, scale, softmax_mode, recompute, lengths, side = (
            list(args) + defaults[len(args) - 3 :]
        )[:11]
        self.calls["fused_sdpa"] += 1
        self.fused_lengths.append(None if lengths is None else lengths.tolist())
        assert (
            softmax_mode in ("None", "fast", "fp32")
            and side in ("left", "right")
            and dropout == 0.0
        )
        batch, _, seq, _ = q.shape
        kv = k.shape[2]  # past keys (prefix caching) come before the query's own
        assert not (is_causal and mask is not None), "causal with attn_bias: not supported"
        allowed = torch.ones(batch, 1, seq, kv, dtype=torch.bool)
        if is_causal:
            assert kv == seq, "causal FusedSDPA over keys longer than the queries"
            allowed = allowed.tril()
        if lengths is not None:
            assert lengths.shape == (batch,) and not lengths.is_floating_point()
            positions = torch.arange(seq)
            valid = (
                positions < lengths.view(batch, 1)
                if side == "right"
                else positions >= seq - lengths.view(batch, 1)
            )
            assert kv == seq, "valid_sequence_lengths with past keys"
            allowed = allowed & valid.view(batch, 1, 1, seq) & valid.view(batch, 1, seq, 1)
        bias = torch.zeros(allowed.shape, dtype=q.dtype).masked_fill(~allowed, -math.inf)
        if mask is not None:  # additive, as vllm-hpu-extension's attn_bias ([batch, 1, q, k])
            assert mask.is_floating_point() and mask.dim() == 4 and mask.shape[2:] == (seq, kv)
            bias = bias + mask
            allowed = allowed & (mask > -math.inf)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale, enable_gqa=True)
        return torch.where(
            allowed.any(-1, keepdim=True), out, torch.zeros_like(out)
        )  # empty rows: no NaN

    # --- installing ----------------------------------------------------------------------------

    def install(self, monkeypatch) -> None:
        fused = type("FusedSDPA", (), {"apply": staticmethod(self.fused_sdpa)})
        install(
            monkeypatch,
            {
                "habana_frameworks.torch.hpex": fake_module("habana_frameworks.torch.hpex"),
                "habana_frameworks.torch.hpex.kernels": fake_module(
                    "habana_frameworks.torch.hpex.kernels", FusedSDPA=fused
                ),
            },
        )
        package = "vllm_gaudi.extension" if self.version == "vllm-gaudi" else "vllm_hpu_extension"
        parents = {"vllm_gaudi": fake_module("vllm_gaudi")} if self.version == "vllm-gaudi" else {}
        modules = {**parents, package: fake_module(package)}
        if self.version not in ("v1.21.0", "v1.21.3"):
            modules[f"{package}.environment"] = fake_module(
                f"{package}.environment", set_vllm_config=self.set_vllm_config
            )
        else:  # no set_vllm_config in these releases: the model type goes in by set_model_config
            modules[f"{package}.environment"] = fake_module(
                f"{package}.environment",
                set_model_config=self.set_model_config,
                get_environment=self.get_environment,
                runtime_params=self.runtime_params,
            )
            modules[f"{package}.flags"] = fake_module(
                f"{package}.flags", enabled_flags=self.enabled_flags
            )
        install(monkeypatch, modules)
        install_on_import(monkeypatch, f"{package}.ops", self._exec_ops)

    def _exec_ops(self, module) -> None:
        needs_vllm = self.version in ("v1.21.0", "vllm-gaudi")
        if needs_vllm and not self.with_vllm:
            raise ModuleNotFoundError(
                "No module named 'vllm'", name="vllm"
            )  # ops.py: from vllm.logger import ...
        module.__dict__.update(self.ops_functions())


def _env_flag(flag: str, default: bool) -> bool:
    """As flags.EnvFlag: the variable if set, else the default, read as 'true'/'1'."""
    return os.environ.get(flag, str(default)).lower() in ["true", "1"]


def _not_recorded():
    """Host-side checks stay out of a graph capture (tests/fakes/recording.py refuses host syncs)."""
    return _disable_current_modes()
