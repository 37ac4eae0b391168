"""Weights: model directories and their files (loader.py; paths.py is torch-free, for the router),
GGUF reading and int4 dequantization (gguf.py), weight-only quantization (quantize.py), LoRA
adapters (lora.py), and the transformers fallback's loading (fallback.py)."""
