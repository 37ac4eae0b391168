"""Weights: model directories and their files (loader.py; paths.py is torch-free, for the router),
GGUF reading and int4 dequantization (gguf.py), weight-only quantization (quantize.py), LoRA
adapters (lora.py), the transformers fallback's loading (fallback.py), torch-free checks that a
GGUF or safetensors file is whole (integrity.py), and the conversion cache keyed by a GGUF file's
content (convert_cache.py)."""
