"""The CPU device: its adapter (`adapter.py`), host-memory sizing (`memory.py`), weights packed for
the fused kernels (`packed.py`) and the C++ kernels themselves (`kernels/`)."""
