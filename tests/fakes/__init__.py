"""Small fakes of vendor modules (Habana, CUDA graphs, vllm-hpu-extension) for CPU-only tests of the
device adapters. Each records what the adapter asked of it, so tests check the adapter's decisions."""
