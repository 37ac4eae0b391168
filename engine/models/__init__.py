"""Models, built on engine/layers and engine/attention: the native architectures and the registry
that maps a Hugging Face architecture name to its model class."""
from engine.errors import ModelLoadError
from engine.models.llama import LlamaForCausalLM

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}


def model_class(architecture: str):
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        supported = ", ".join(sorted(MODEL_REGISTRY))
        raise ModelLoadError(f"architecture {architecture!r} is not supported (supported: {supported})") from None
