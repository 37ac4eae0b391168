"""Models, built on engine/layers and engine/attention: the native architectures, the transformers
fallback, and the registry that maps a Hugging Face architecture name to its native model class."""

from engine.errors import ModelLoadError
from engine.models.gemma import GemmaForCausalLM
from engine.models.gemma3_vl import Gemma3ForConditionalGeneration
from engine.models.llama import LlamaForCausalLM
from engine.models.llava import LlavaForConditionalGeneration
from engine.models.llava_next import LlavaNextForConditionalGeneration
from engine.models.moe import MixtralForCausalLM, Qwen3MoeForCausalLM
from engine.models.phi3 import Phi3ForCausalLM
from engine.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,  # per-head q/k norms: a ModelConfig switch
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "LlavaForConditionalGeneration": LlavaForConditionalGeneration,  # engine/models/llava.py
    "LlavaNextForConditionalGeneration": LlavaNextForConditionalGeneration,
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,  # M-RoPE
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,  # engine/models/gemma3_vl.py
}


def has_native(architecture: str) -> bool:
    return architecture in MODEL_REGISTRY


def model_class(architecture: str):
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        supported = ", ".join(sorted(MODEL_REGISTRY))
        raise ModelLoadError(
            f"architecture {architecture!r} is not supported (supported: {supported})"
        ) from None
