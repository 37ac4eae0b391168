"""`--simulate hpu`: the CPU adapter in the HPU adapter's shoes.

It plans, pads and marks steps as engine/devices/hpu/adapter.py does (its block size, dtype, graph
modes and the warmup that runs every bucket's forward, so the same bucket grid and the same padded
decode rows), runs the ops on the CPU, and keys them into lazy graphs (lazy.py). What it leaves out:
Habana's kernels (the attention is the pure-torch one) and its memory.
"""

from __future__ import annotations

import torch

from engine.devices.base import kind_of
from engine.devices.cpu.adapter import CPUAdapter
from engine.devices.graph_inputs import check_tensor_inputs
from engine.devices.hpu.adapter import HPUAdapter
from engine.devices.simulate.lazy import LazyGraphs, on_device

SIMULATED = ("hpu",)


class SimulatedHPUAdapter(CPUAdapter):
    simulating = "hpu"
    default_dtype = HPUAdapter.default_dtype
    default_block_size = HPUAdapter.default_block_size
    graph_modes = ("graphs", "lazy")  # HPU's lazy modes; its torch.compile mode is not simulated
    default_graph_mode = HPUAdapter.default_graph_mode
    default_lora_impl = HPUAdapter.default_lora_impl
    default_moe_impl = HPUAdapter.default_moe_impl
    quantize_modes = HPUAdapter.quantize_modes

    def __init__(self, graph_mode: str | None = None, strict_shapes: bool = True, **options):
        super().__init__(graph_mode, strict_shapes, **options)
        self.graphs = LazyGraphs(strict_shapes)
        self.step_marker = self.graphs.mark_step  # the model cuts a graph after each layer

    def auto_dtype(self) -> tuple[torch.dtype, str]:
        return self.default_dtype, "the hpu default (simulated)"

    @property
    def warm_runs_forward(self) -> bool:
        return True  # as on HPU: warmup runs every bucket, which compiles its graphs

    @property
    def captures_graphs(self) -> bool:
        return self.graph_mode == "graphs"

    def graph_for(self, shape, fn):
        return fn  # the graph is the simulator's key; the ops run eagerly on the CPU

    def prepare_model(self, model, dtype: torch.dtype) -> None:
        """The weights are device tensors (and stay unpacked, as on HPU)."""
        for tensor in list(model.parameters()) + list(model.buffers()):
            on_device(tensor)

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return on_device(super().zeros(shape, dtype))

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host-to-device copy: a graph input, not a graph op. A fresh tensor, as on a device (on
        the CPU `.to()` would hand back the host tensor itself)."""
        if tensor.dtype == torch.float64:
            from engine.devices.simulate.lazy import Float64Error, caller

            raise Float64Error(f"a float64 tensor copied to the device, from {caller()}")
        return on_device(tensor.detach().clone())

    def device_scope(self):
        return self.graphs.tracking()

    def mark_step(self) -> None:
        self.graphs.mark_step()

    def reset(self) -> None:
        super().reset()
        self.graphs.reset()

    def warm(self, shape, fn, *args, graph: bool = True):
        with self.graphs.tracking(warming=True):
            return super().warm(shape, fn, *args, graph=graph)

    def forward(self, shape, fn, args, warming):
        """As HPUAdapter.forward in its lazy modes: the inputs' copies before, a step after."""
        check_tensor_inputs(args)
        graphed = (
            warming or shape in self.shapes.warmed
        ) and shape not in self.shapes.without_graph
        with self.graphs.tracking(forward=True):
            self.mark_step()
            if self.graph_mode == "graphs":
                kind = ("capture" if warming else "replay") if graphed else "bypass"
            else:
                kind = "lazy" if graphed else "bypass"
            self.stats[(kind, kind_of(shape))] += 1
            out = fn(*args)
            self.mark_step()
        return out


def simulated_adapter(simulate: str, device: str, graph_mode, strict_shapes, **options):
    """The adapter that simulates `simulate` on `device`, which must be the CPU."""
    if simulate not in SIMULATED:
        raise ValueError(f"--simulate {simulate}: only {', '.join(SIMULATED)} can be simulated")
    if device != "cpu":
        raise ValueError(
            f"--simulate {simulate} runs on the CPU only (the device is {device}): add --device cpu"
        )
    return SimulatedHPUAdapter(graph_mode=graph_mode, strict_shapes=strict_shapes, **options)
