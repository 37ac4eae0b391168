import psutil
import torch

from engine.devices.base import DeviceAdapter


class CPUAdapter(DeviceAdapter):
    name = "cpu"
    dist_backend = "gloo"
    default_dtype = torch.float32
    default_block_size = 16
    graph_modes = ("eager", "compile")
    default_lora_impl = "dense"  # one GEMM per projection for all adapters beats per-token gathers on CPU

    def __init__(self, graph_mode: str | None = None, strict_shapes: bool = True, **options):
        super().__init__(graph_mode, strict_shapes, **options)
        self._compiled: dict = {}

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cpu")

    def memory_info(self) -> tuple[int, int]:
        memory = psutil.virtual_memory()
        return memory.available, memory.total

    def graph_for(self, shape, fn):
        if self.graph_mode == "eager":
            return fn
        if fn not in self._compiled:
            self._compiled[fn] = compile_static(fn, backend="inductor")
        return self._compiled[fn]


def compile_static(fn, backend: str):
    """torch.compile with one static-shape graph per bucket."""
    import torch._dynamo

    # Dynamo's default limit of 8 graphs would fall back to eager after the eighth bucket.
    torch._dynamo.config.cache_size_limit = 4096
    torch._dynamo.config.accumulated_cache_size_limit = 4096
    return torch.compile(fn, backend=backend, dynamic=False)
