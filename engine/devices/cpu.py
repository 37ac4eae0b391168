import psutil
import torch

from engine.devices.base import DeviceAdapter


class CPUAdapter(DeviceAdapter):
    name = "cpu"
    dist_backend = "gloo"
    default_dtype = torch.float32
    default_block_size = 16
    graph_modes = ("eager", "compile")

    def __init__(self, graph_mode: str = "eager", strict_shapes: bool = True):
        super().__init__(graph_mode, strict_shapes)
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
            import torch._dynamo

            # One static-shape graph per bucket; dynamo's default limit of 8 would fall back to
            # eager after the eighth bucket.
            torch._dynamo.config.cache_size_limit = 4096
            torch._dynamo.config.accumulated_cache_size_limit = 4096
            self._compiled[fn] = torch.compile(fn, dynamic=False)
        return self._compiled[fn]
