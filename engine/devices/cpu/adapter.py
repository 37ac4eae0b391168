import logging

import psutil
import torch

from engine.devices.base import DeviceAdapter
from engine.devices.cpu.memory import huge_page_zeros, keep_freed_memory
from engine.devices.dynamo import call_compiled

log = logging.getLogger(__name__)


class CompiledGraphs:
    """graph_for of an adapter whose graphs are torch.compile graphs (inductor): in compile mode one
    static-shape graph per bucket, in eager mode the function itself. Once serving, a call that
    would compile is refused by torch itself (engine/devices/dynamo.py)."""

    def forward(self, shape, fn, args, warming):
        graphed = (
            warming or shape in self.shapes.warmed
        ) and shape not in self.shapes.without_graph
        if self.graph_mode == "eager" or not graphed:
            return super().forward(shape, fn, args, warming)
        return call_compiled(self, shape, self.graph_for(shape, fn), fn, args, warming)

    def graph_for(self, shape, fn):
        if self.graph_mode == "eager":
            return fn
        compiled = self.__dict__.setdefault("_compiled", {})
        if fn not in compiled:
            compiled[fn] = compile_static(fn, backend="inductor")
        return compiled[fn]


class CPUAdapter(CompiledGraphs, DeviceAdapter):
    name = "cpu"
    dist_backend = "gloo"
    default_dtype = torch.float32
    default_block_size = 16
    own_memory = False  # system memory: what other processes do moves it more than this shard does
    graph_modes = ("eager", "compile")
    default_lora_impl = (
        "dense"  # one GEMM per projection for all adapters beats per-token gathers on CPU
    )
    # int8/int4: PyTorch's packed CPU kernels; fp8: loading and the dequantizing reference (tests)
    quantize_modes = ("int8", "int4", "fp8")

    def __init__(self, *args, **kwargs):
        from engine.devices.cpu import isa

        super().__init__(*args, **kwargs)
        isa.cap()  # a cap this CPU cannot run stops the start here, in one line (isa.IsaError)
        keep_freed_memory()  # before the model loads: every step's buffers reuse the heap

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cpu")

    def auto_dtype(self) -> tuple[torch.dtype, str]:
        """bfloat16 where the CPU multiplies it natively (AVX512-BF16 or AMX): about twice float32's
        GEMM rate and half its weight traffic. On other x86 CPUs bfloat16 where eager serving has
        bucketserve's AVX2 product (fma_linear), which beat float32 at every batch size on a Zen 3
        (docs/benchmarks.md). Elsewhere torch emulates bfloat16, slower than float32: float32.
        An ISA cap (BUCKETSERVE_CPU_ISA) below a feature chooses as a CPU without it would."""
        from engine.devices.cpu import isa

        capped = isa.cap()
        features = [
            name
            for name, has, level in (
                ("AVX512-BF16", torch.cpu._is_avx512_bf16_supported(), "avx512_bf16"),
                ("AMX", torch.cpu._is_amx_tile_supported(), "amx"),
            )
            if has and (capped is None or isa.at_least(level, capped))
        ]
        if features:
            # As torch reports it: a virtual machine may list AMX tiles that it does not run (this
            # repository's does); AVX512-BF16 alone already makes bfloat16 the faster choice.
            return torch.bfloat16, f"torch reports {' and '.join(features)} on this CPU"
        if self._has_avx2_bf16_product():
            return torch.bfloat16, "bucketserve's AVX2 bfloat16 kernels on this CPU"
        return torch.float32, "this CPU has neither AVX512-BF16 nor AMX"

    def serving_path(self) -> str:
        """What serves, with the ISA level of the CPU kernels (and whether a cap set it), or why
        they are not built."""
        import engine.devices.cpu.kernels as cpu_kernels
        from engine.devices.cpu import isa

        path = super().serving_path()
        if self.graph_mode != "eager" or not cpu_kernels.enabled():
            return path
        if cpu_kernels.load() is None:
            return f"{path} (CPU kernels not built, {cpu_kernels.PROBLEMS.get(isa.level(), '')})"
        if not self.kernel_names():  # float32: the kernels are not used
            return path
        capped = f", capped by {isa.CAP_VARIABLE}" if isa.cap() else ""
        return f"{path} (CPU kernels at ISA level {isa.level()}{capped})"

    def _has_avx2_bf16_product(self) -> bool:
        """Whether eager bfloat16 gets fma_linear: kernels built (not turned off) with AVX2 and
        FMA."""
        import engine.devices.cpu.kernels as cpu_kernels

        if getattr(self, "graph_mode", "eager") != "eager":  # inductor's graphs: torch's product
            return False
        return cpu_kernels.serves(cpu_kernels.FmaLinear)

    def prepare_model(self, model, dtype: torch.dtype) -> None:
        """Eager bfloat16: the fused C++ kernels (engine.devices.cpu.kernels) for decode attention,
        the norms, rope, SiLU and the projections (AMX tiles where the CPU runs them, else
        AVX512-BF16 dot products, else AVX2 FMA; what none takes, or all without the kernels,
        prepacked for oneDNN where it packs bfloat16). Compile mode
        leaves the weights to inductor; float32 keeps the pure-torch path, whose greedy output is
        exact."""
        self._prepare(model, dtype, draft=False)

    def prepare_draft(self, model, dtype: torch.dtype) -> None:
        """prepare_model, with an int8 LM head screened in int4 (cpu_kernels.ScreenedHead): a
        draft's lone-row steps stream the whole head every step. A float32 draft's int4 and int8
        weights go through the same kernels, their inputs rounded to bfloat16 (torch's int4 product
        with float32 inputs took 7 ms a projection here, the draft of the embedded model then
        slower than its float32 target). matmul_kernels stays the target's."""
        self._prepare(model, dtype, draft=True)

    def _prepare(self, model, dtype: torch.dtype, draft: bool) -> None:
        import engine.devices.cpu.kernels as cpu_kernels
        from engine.devices.cpu.packed import pack_linear_weights, packing_available

        if self.graph_mode != "eager":
            return
        if draft and dtype == torch.float32:
            self._prepare_float32_draft(model)
        if dtype != torch.bfloat16:
            return
        matmuls = []
        if cpu_kernels.load() is not None:
            count, kind = cpu_kernels.install_projections(model, draft)
            log.info("%d bfloat16 matrices through bucketserve's %s kernel", count, kind)
            matmuls += [f"bucketserve {kind}"] if count else []
        if packing_available():  # what the kernels above did not take
            packed = pack_linear_weights(model)
            log.info("packed %d bfloat16 projections for oneDNN", packed)
            matmuls += ["oneDNN packed"] if packed else []
        if not draft:
            self.matmul_kernels = " + ".join(matmuls) or "torch"
        if cpu_kernels.load() is not None:
            self.attention_backend = cpu_kernels.attention_backend()
            counts = cpu_kernels.install(model)
            log.info(
                "fused CPU kernels: decode attention, %s",
                ", ".join(f"{n} {k}" for k, n in counts.items()),
            )
            if cpu_kernels.install_decoder(model):
                log.info("decode steps run every layer in one fused call")

    def _prepare_float32_draft(self, model) -> None:
        """A float32 draft's int4 and int8 weights through the packed kernels (prepare_draft);
        its float32 ones stay on torch."""
        import engine.devices.cpu.kernels as cpu_kernels

        if cpu_kernels.load() is None:
            return
        count, kind = cpu_kernels.install_projections(model, draft=True)
        if count:
            log.info("%d quantized draft matrices through bucketserve's %s kernel", count, kind)

    @property
    def warm_runs_forward(self) -> bool:
        return self.graph_mode != "eager"  # eager CPU kernels need no first run: nothing compiles

    def memory_info(self) -> tuple[int, int]:
        memory = psutil.virtual_memory()
        return memory.available, memory.total

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Zeros in fresh anonymous memory (engine.devices.cpu.memory.huge_page_zeros): the 3 GiB
        KV cache costs nothing until blocks are used, where torch.zeros writes every byte at
        start-up (about 5 s on this machine when it is quiet, 15 s under load), and its blocks
        sit on huge pages where the kernel allows them."""
        return huge_page_zeros(shape, dtype)


def compile_static(fn, backend: str):
    """torch.compile with one static-shape graph per bucket."""
    import torch._dynamo

    # Dynamo's default limit of 8 graphs would fall back to eager after the eighth bucket.
    torch._dynamo.config.cache_size_limit = 4096
    torch._dynamo.config.accumulated_cache_size_limit = 4096
    return torch.compile(fn, backend=backend, dynamic=False)
