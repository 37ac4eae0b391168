"""CUDA and ROCm: the adapter (`adapter.py`) and its CUDA-graph capture and replay (`graphs.py`)."""
