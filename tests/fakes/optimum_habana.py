"""A fake optimum-habana, as strict as huggingface/optimum-habana v1.19.1 (commit
1aa991e4bee53652a62ec34c4d5bd2397e5736c6, the release for Gaudi software 1.22 / torch 2.7.1) where
bucketserve depends on it: optimum/habana/transformers/modeling_utils.py's
`adapt_transformers_to_gaudi()` takes no argument, returns None and replaces, in place and for the
whole process, transformers' generation methods and, per supported architecture, the classes of its
modeling module (here Llama's, as upstream: `LlamaForCausalLM = GaudiLlamaForCausalLM`, `LlamaAttention
= GaudiLlamaAttention`; tests/fakes/optimum_habana_llama.py). Architectures it has no variant of (e.g.
Olmo2, Granite in v1.19.1) keep their classes. It registers nothing with transformers' attention
interface (v1.19.1 does not). Calling it twice patches again (upstream has no guard).

`importable=False` mirrors what v1.19.1 does under transformers 5: its import fails on a module that
transformers removed (`transformers.modeling_attn_mask_utils`).
"""

from __future__ import annotations

import sys

import transformers
from transformers.generation import GenerationMixin

from tests.fakes import optimum_habana_llama
from tests.fakes.modules import fake_module, install, install_on_import

UPSTREAM_LLAMA = "optimum.habana.transformers.models.llama.modeling_llama"


class FakeOptimumHabana:
    def __init__(self, monkeypatch):
        self.monkeypatch, self.calls = monkeypatch, 0

    def install(self, importable: bool = True) -> None:
        name = "optimum.habana.transformers.modeling_utils"
        if not importable:

            def fail(module):
                raise ModuleNotFoundError(
                    "No module named 'transformers.modeling_attn_mask_utils'",
                    name="transformers.modeling_attn_mask_utils",
                )

            install(
                self.monkeypatch,
                {
                    "optimum": fake_module("optimum"),
                    "optimum.habana": fake_module("optimum.habana"),
                    "optimum.habana.transformers": fake_module("optimum.habana.transformers"),
                },
            )
            install_on_import(self.monkeypatch, name, fail)
            return
        for cls in (
            optimum_habana_llama.GaudiLlamaAttention,
            optimum_habana_llama.GaudiLlamaForCausalLM,
            optimum_habana_llama.KVCache,
        ):
            self.monkeypatch.setattr(cls, "__module__", UPSTREAM_LLAMA)
        install(
            self.monkeypatch,
            {
                "optimum": fake_module("optimum"),
                "optimum.habana": fake_module("optimum.habana"),
                "optimum.habana.transformers": fake_module("optimum.habana.transformers"),
                name: fake_module(
                    name, adapt_transformers_to_gaudi=self.adapt_transformers_to_gaudi
                ),
            },
        )
        self.monkeypatch.setitem(sys.modules, UPSTREAM_LLAMA, optimum_habana_llama)

    def adapt_transformers_to_gaudi(self):
        """In place, process-wide (undone here only by the test's monkeypatch)."""
        self.calls += 1
        patch = self.monkeypatch.setattr
        patch(GenerationMixin, "generate", _gaudi_generate)
        llama = transformers.models.llama.modeling_llama
        patch(llama, "LlamaForCausalLM", optimum_habana_llama.GaudiLlamaForCausalLM)
        patch(llama, "LlamaAttention", optimum_habana_llama.GaudiLlamaAttention)


def _gaudi_generate(self, *args, **kwargs):
    """Stands for GaudiGenerationMixin.generate (its lazy-mode loop); never run by bucketserve."""
    raise AssertionError("bucketserve must not run transformers' generation loop")


_gaudi_generate.__module__ = "optimum.habana.transformers.generation.utils"
