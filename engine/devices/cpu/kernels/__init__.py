"""Fused C++ kernels for eager CPU decode, built on first use with torch.utils.cpp_extension.

Eager PyTorch spends a decode step of the embedded model on hundreds of small aten calls, and its
decode attention first gathers every row's KV blocks into a copy. kernels.cpp holds what replaces
them: attention that reads the paged cache in place (the contract of
engine.attention.flat.flat_attention, without softcap) and RMS norm; elementwise.cpp the fused
rope and SiLU-and-product. The bfloat16 projections share one packed weight layout (pack_bf16, in
amx.cpp) and three products: AMX tiles where the CPU runs them (amx.cpp), else AVX512-BF16 dot
products (dot_linear.cpp), else AVX2 fused multiply-adds over weights widened in registers
(fma_linear.cpp), every batch size read from the packed weight (oneDNN's product
through F.linear reorders the plain weight on every call, which at decode batch
sizes costs more than the product). --quantize's int4 and int8 weights have their own layouts and
AVX512-BF16 products (int4_linear.cpp, int8_linear.cpp); a draft model's int8 LM head is screened
in int4 and its best rescored in int8 (screened_head.cpp). decoder.cpp runs a whole decode step, or
a prefill's packed rows, of a plain Llama-family decoder through these in one call, its threads held
for the whole call (crew.cpp) instead of forked per kernel; its greedy_steps runs several greedy
decode steps of one row (a draft model's proposals) with the final norm, LM head and argmax in the
same call, a forward feeding besides its token what prompt lookup guesses follows it. Each is
tested against the pure-torch path, which stays the reference, the fallback where the build fails
(no compiler), and the path of every graph device.

The README's set-up (`make`, or `python -m engine.devices.cpu.kernels`) builds them once, about a
minute on two cores, into bucketserve's cache dir, keyed by the source, the compiler flags,
torch's version and the CPU; a start then imports the built library and never runs the compiler. A
start that finds none builds it then (a cache dir cleared since set-up). Each build compiles in a
directory of its own and moves the library into place, so builders that meet (worktrees, test
workers) neither wait on each other's lock file nor leave one behind when killed.
BUCKETSERVE_CPU_KERNELS=0 turns the kernels off. Which of them a build holds and serves follows the
ISA level, the CPU's or the cap BUCKETSERVE_CPU_ISA sets (engine/devices/cpu/isa.py): a library of
its own per level, each class below naming the level it needs.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
from functools import cache
from pathlib import Path

import torch

from engine.devices.cpu import isa
from engine.devices.cpu.memory import on_huge_pages

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
# kernels.cpp binds the module
SOURCES = [
    HERE / name
    for name in (
        "kernels.cpp",
        "amx.cpp",
        "dot_linear.cpp",
        "fma_linear.cpp",
        "elementwise.cpp",
        "decoder.cpp",
        "int4_linear.cpp",
        "int8_linear.cpp",
        "screened_head.cpp",
        "crew.cpp",
    )
]
HEADERS = [
    HERE / name
    for name in ("packed.h", "int4_layout.h", "elementwise.h", "vec_math.h", "decoder.h", "crew.h")
]
LIBRARY_SUFFIX = ".so"


def flags(level: str) -> list[str]:
    """The compiler flags of the library at ISA `level` (isa.build_flags)."""
    return ["-O3", *isa.build_flags(level), "-fopenmp", "-ffp-contract=off"]


def enabled() -> bool:
    return os.environ.get("BUCKETSERVE_CPU_KERNELS", "1") != "0"


def load():
    """The compiled module of the ISA level in force, or None (disabled, or the build failed:
    logged once). An ISA cap this CPU cannot run raises isa.IsaError."""
    return _build(isa.level()) if enabled() else None


def library_path(level: str | None = None) -> Path:
    """Where the built library of this source, these flags and this torch lives (default: the
    ISA level in force)."""
    from engine.config import default_cache_dir

    key = hashlib.sha256(
        b"".join(path.read_bytes() for path in SOURCES + HEADERS)
        + " ".join(flags(level or isa.level())).encode()
        + torch.__version__.encode()
        + cpu_identity().encode()
    ).hexdigest()[:16]
    name = f"bucketserve_cpu_kernels_{key}"
    return Path(default_cache_dir()) / "cpu_kernels" / key / f"{name}{LIBRARY_SUFFIX}"


def cpu_identity() -> str:
    """The CPU's model and flags: -march=native builds for this CPU, so a cache dir carried to
    another (a copied home, a shared volume) must not hand it a library of illegal instructions."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        import platform

        return platform.processor()
    wanted = ("model name", "flags")
    return "\n".join(sorted({line for line in lines if line.startswith(wanted)}))


def missing_tool() -> str | None:
    """What a build lacks that it cannot do without (the C++ compiler, ninja), in words, or None.
    The ninja of `pip install ninja` lives beside the interpreter, which need not be on PATH."""
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return f"no C++ compiler ({os.environ.get('CXX', 'c++')} is not on PATH)"
    if shutil.which("ninja", path=ninja_path()) is None:
        return "no ninja (pip install ninja)"
    return None


def ninja_path() -> str:
    """PATH with the directory of the `ninja` package's binary first, where it is installed."""
    try:
        import ninja

        first = [ninja.BIN_DIR]
    except ImportError:
        first = []
    return os.pathsep.join([*first, os.environ.get("PATH", "")])


PROBLEMS: dict[str, str] = {}  # why the library of a level was not built, in words


@cache
def _build(level: str):
    library = library_path(level)
    problem = None if library.exists() else missing_tool()
    try:
        if library.exists():
            return import_library(library)
        if problem is None:
            return compile_into(library, level)
    except Exception as error:  # no headers, a compiler error: the pure-torch path serves
        problem = f"the build failed: {str(error).strip().splitlines()[-1]}"
    PROBLEMS[level] = problem
    log.warning("CPU kernels not built, %s: serving the pure-torch path", problem)
    return None


def compile_into(library: Path, level: str):
    """torch.utils.cpp_extension's build (the module it imports is the answer) in a fresh
    directory, then the library moved into place. In a shared build directory cpp_extension's lock
    file makes every later builder wait forever once a build was killed, and a checkout whose
    source path differs from the one in build.ninja rebuilds."""
    import tempfile

    from torch.utils import cpp_extension

    library.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="build-", dir=library.parent))
    saved_path = os.environ.get("PATH", "")
    os.environ["PATH"] = ninja_path()  # cpp_extension runs `ninja` from PATH
    try:
        module = cpp_extension.load(
            name=library.stem,
            sources=[str(path) for path in SOURCES],
            extra_cflags=flags(level),
            extra_ldflags=["-fopenmp"],
            build_directory=str(scratch),
            verbose=False,
        )
        os.replace(scratch / library.name, library)  # atomic: a reader sees all of it or none
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        os.environ["PATH"] = saved_path
    return module


def compile_check(level: str, source: Path) -> subprocess.CompletedProcess:
    """Compile `source` at ISA `level` with the build's flags and the level's features switched
    on (isa.compile_flags), only to check it (-fsyntax-only: nothing is kept, nothing runs): the
    code of a level this CPU lacks (AMX, AVX-512 on an AVX2 machine) still compiles everywhere."""
    import sysconfig

    from torch.utils import cpp_extension

    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    command = [
        os.environ.get("CXX", "c++"),
        "-fsyntax-only",
        "-std=c++20",
        "-DTORCH_EXTENSION_NAME=compile_check",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        *(flag for path in includes for flag in ("-isystem", path)),
        *flags(isa.cpu_levels()[-1]),
        *isa.compile_flags(level),
        str(source),
    ]
    return subprocess.run(command, capture_output=True, text=True)


def import_library(library: Path):
    """The built extension as a module, without the compiler (as cpp_extension imports it)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(library.stem, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def serves(kernel) -> bool:
    """Whether `kernel` (a class below) serves here: the kernels are built, the ISA level in force
    includes the kernel's level, and the built module holds its product (`supported`: AMX also
    asks Linux for the tiles)."""
    module = load()
    return module is not None and isa.at_least(kernel.level) and getattr(module, kernel.supported)()


def decode_attention(
    q,
    key_cache,
    value_cache,
    block_list,
    block_mapping,
    block_groups,
    block_bias,
    scale,
    masked=None,
):
    """flat_attention's contract (block_mapping and masked are not needed: the bias says it all)."""
    return load().decode_attention(
        q, key_cache, value_cache, block_list, block_groups, block_bias, scale
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return load().rms_norm(x, weight, eps)


def attention_backend():
    """The attention kernels of a CPU forward: torch's prefill, the in-place paged decode."""
    from engine.attention.backend import AttentionBackend
    from engine.attention.prompt import prompt_attention

    return AttentionBackend("cpu-kernels", prompt_attention, decode_attention)


class AmxLinear(torch.nn.Module):
    """A bfloat16 projection whose weight is packed once into AMX's tile layout (pack_bf16) and
    multiplied there at every batch size (amx_linear). oneDNN's product through F.linear reorders
    the plain weight on each call: the 120 decoder matrices of SmolLM2 at 32 rows took 19-21 ms
    here against 32-42 ms there, at one row 11-13 against 26-35 ms (2 threads, this repository's
    2-core VM, 2026-12-02)."""

    kind = "amx-bf16"
    product = "amx_linear"  # the module's function that multiplies the packed weight
    level, supported = "amx", "amx_supported"  # the ISA level it needs; the module's check

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # streamed once a step: on huge pages its reads miss the TLB far less often
        self.register_buffer("packed", on_huge_pages(load().pack_bf16(weight.detach())))

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        multiply = getattr(load(), self.product)
        out = multiply(flat.to(torch.bfloat16), self.packed, self.out_features)
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


class DotLinear(AmxLinear):
    """AmxLinear's packed weight multiplied in AVX512-BF16 dot products (dot_linear), for CPUs
    without AMX tiles. Against F.linear at every batch size, see docs/benchmarks.md."""

    kind = "avx512-bf16"
    product = "dot_linear"
    level, supported = "avx512_bf16", "dot_linear_supported"


class FmaLinear(AmxLinear):
    """AmxLinear's packed weight widened to float32 in registers and multiplied in AVX2 FMA
    (fma_linear), for x86 CPUs with neither AMX nor AVX512-BF16, where torch emulates bfloat16
    products. Against F.linear, see docs/benchmarks.md."""

    kind = "avx2-bf16"
    product = "fma_linear"
    level, supported = "avx2", "fma_linear_supported"


class Int4Linear(torch.nn.Module):
    """An int4 projection (engine.layers.quant.Int4Weight: groups of 32 inputs, a bfloat16 scale
    and zero each) repacked by block of 32 columns and multiplied straight from the codes in
    AVX512-BF16 dot products (int4_linear); torch's int4 kernel reads its own layout at about a
    third of this speed in a decode step. A prefill of over 32 rows widens each block to bfloat16
    once."""

    kind = "avx512-bf16-int4"
    product = "int4_linear"
    level, supported = "avx512_bf16", "int4_linear_supported"

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor):
        super().__init__()
        self.out_features, self.in_features = codes.shape
        packed = load().pack_int4(codes.to(torch.uint8).contiguous(), scale, zero)
        self.register_buffer("packed", on_huge_pages(packed))

    @classmethod
    def of(cls, weight, draft: bool = False) -> Int4Linear | None:
        """The same weight from an Int4Weight, or None where it does not fit (another group or
        dtype, or a packed layout this torch build's reading does not reproduce). A `draft`'s
        float32 scales and zeros are rounded to bfloat16: its arithmetic moves only how much of
        it the target accepts."""
        fits = (
            serves(cls)
            and weight.group == 32
            and weight.unpackable
            and (weight.scale_zero.dtype == torch.bfloat16 or draft)
        )
        if not fits:
            return None
        from engine.layers.quant import unpack_int4

        rows = weight.out_features
        codes = unpack_int4(weight.packed, weight.in_features, weight.layout)[:rows]
        scale, zero = (
            weight.scale_zero[..., i].t()[:rows].to(torch.bfloat16).contiguous() for i in (0, 1)
        )
        return cls(codes, scale, zero)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        out = load().int4_linear(flat, self.packed, self.out_features)
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] read back from pack_int4's layout."""
        blocks, groups, _ = self.packed.shape
        lanes = self.packed[..., :512].contiguous().view(torch.int32)  # [b, g, chunk, half, col]
        lanes = lanes.view(blocks, groups, 4, 2, 16, 1)
        shifts = torch.tensor([0, 16, 4, 20, 8, 24, 12, 28])  # inputs 0..7 of a chunk's lane
        codes = (lanes >> shifts) & 0xF  # [b, g, chunk, half, col, input]
        codes = codes.permute(0, 3, 4, 1, 2, 5).reshape(blocks * 32, groups, 32).float()
        scale, zero = (
            self.packed[..., start : start + 64].contiguous().view(torch.bfloat16).float()
            for start in (512, 576)
        )  # [b, g, col]
        scale, zero = (t.permute(0, 2, 1).reshape(blocks * 32, groups, 1) for t in (scale, zero))
        weight = ((codes - 8) * scale + zero).reshape(blocks * 32, -1)
        return weight[: self.out_features].contiguous()


class Int8Linear(torch.nn.Module):
    """An int8 projection (engine.layers.quant.Int8Weight: a scale per output row) repacked by
    block of 32 columns and multiplied from the codes in AVX512-BF16 dot products (int8_linear):
    --quantize's vocabulary, the LM head, where torch's int8 kernel took half a lone-row int4 step.
    The tied embedding keeps its Int8Weight for lookups."""

    kind = "avx512-bf16-int8"
    product = "int8_linear"
    level, supported = "avx512_bf16", "dot_linear_supported"
    input_multiple = 2  # the layout's pairs of inputs

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.register_buffer("packed", on_huge_pages(self.pack(codes, scale)))

    @staticmethod
    def pack(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return load().pack_int8(codes, scale)

    @classmethod
    def of(cls, weight, draft: bool = False) -> Int8Linear | None:
        """The same weight from an Int8Weight, or None where this CPU lacks the product, the
        activations are not bfloat16 (a `draft`'s may be float32, rounded to bfloat16 for it) or
        the inputs do not fill the layout."""
        fits = (
            serves(cls)
            and (weight.scale.dtype == torch.bfloat16 or draft)
            and weight.in_features % cls.input_multiple == 0
        )
        return cls(weight.codes, weight.scale) if fits else None

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        out = getattr(load(), self.product)(flat, self.packed, self.out_features)
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] read back from pack_int8's layout."""
        blocks, K = self.packed.shape[0], self.in_features
        codes = self.packed[:, : K * 32].contiguous().view(torch.int8).view(blocks, K // 2, 32, 2)
        codes = codes.permute(0, 2, 1, 3).reshape(blocks * 32, K).float()
        scale = self.packed[:, K * 32 :].contiguous().view(torch.float32).reshape(-1, 1)
        return (codes * scale)[: self.out_features].contiguous()


class ScreenedHead(Int8Linear):
    """A draft model's int8 LM head (engine.layers.quant.Int8Weight) screened in int4
    (screened_head.cpp): every logit from int4 codes of the same weight, then each row's 16 largest
    recomputed from the int8 codes. A lone-row draft step streams its head whole, and the int8 head
    of the embedded model is 28 of the step's 94 MB; the screen is 18. The argmax is the int8
    head's wherever that token ranks among the screen's 16 best; the other logits are the
    screen's. Only for a draft: the target checks what it proposes."""

    kind = "int4-screened-int8"
    product = "screened_linear"
    level, supported = "avx512_bf16", "int4_linear_supported"
    input_multiple = 32  # the screen's groups

    @staticmethod
    def pack(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        from engine.layers.quant import int4_codes

        screen_codes, screen_scale, screen_zero = int4_codes(
            codes.float() * scale.float().unsqueeze(1), torch.bfloat16
        )
        return load().pack_screened(
            codes,
            scale,
            screen_codes.to(torch.uint8),
            screen_scale.to(torch.bfloat16),
            screen_zero.to(torch.bfloat16),
        )

    def dequantize(self) -> torch.Tensor:
        """The float32 int8 weight [N, K] that the screen stands for, read back from its part of
        pack_screened's layout (after the screen: the codes row by row, then the scales)."""
        vocab, width = self.out_features, self.in_features
        codes_end = self.packed.numel() - 4 * vocab
        codes = self.packed[codes_end - vocab * width : codes_end].view(torch.int8)
        scale = self.packed[codes_end:].view(torch.float32)
        return codes.view(vocab, width).float() * scale.unsqueeze(1)


PROJECTIONS = (AmxLinear, DotLinear, FmaLinear)  # the bfloat16 products, fastest first


def kernel_for(weight: torch.Tensor | None):
    """The module class that multiplies `weight` on this CPU, or None (torch's path)."""
    fits = (
        weight is not None
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and weight.shape[1] % 32 == 0
        and load() is not None
    )
    return next((kind for kind in PROJECTIONS if serves(kind)), None) if fits else None


def install_projections(model: torch.nn.Module, draft: bool = False) -> tuple[int, str]:
    """Every plain bfloat16 decoder projection and the LM head of `model` through this CPU's kernel
    (AmxLinear, else DotLinear, else FmaLinear), every int4 one through Int4Linear and every int8
    one through Int8Linear (a `draft` model's int8 LM head: ScreenedHead); the decoder weights move
    into it, the LM head keeps its weight, which a tied embedding shares. In a float32 `draft`
    only the int4 and int8 weights move (their inputs rounded to bfloat16). The number of matrices
    and the kernels' kinds."""
    from engine.layers.embedding import ParallelLMHead
    from engine.layers.linear import ColumnParallelLinear, RowParallelLinear
    from engine.layers.quant import Int4Weight, Int8Weight

    count, kinds = 0, set()
    for module in model.modules():
        projection = isinstance(module, (ColumnParallelLinear, RowParallelLinear))
        if not (projection or isinstance(module, ParallelLMHead)):
            continue
        if isinstance(module.quantized, Int4Weight):
            kernel = Int4Linear.of(module.quantized, draft)
        elif isinstance(module.quantized, Int8Weight) and draft and not projection:
            kernel = ScreenedHead.of(module.quantized, draft)
        elif isinstance(module.quantized, Int8Weight):
            kernel = Int8Linear.of(module.quantized, draft)
        elif module.quantized is None and (kind := kernel_for(module.weight)) is not None:
            kernel = kind(module.weight)
        else:
            kernel = None
        if kernel is None:
            continue
        module.quantized = kernel
        kinds.add(kernel.kind)
        if projection:
            module.register_parameter("weight", None)
        count += 1
    return count, " + ".join(sorted(kinds))


def rope(q, k, cos, sin):
    """engine.layers.rotary.apply_rotary in one pass per tensor (bfloat16, full-width rotation);
    the torch function elsewhere."""
    from engine.layers.rotary import apply_rotary

    lead = q.shape[:-2]
    fits = (
        q.dtype == k.dtype == cos.dtype == sin.dtype == torch.bfloat16
        and q.dim() >= 3
        and cos.shape[-1] == q.shape[-1]
        and cos.shape[:-2] == lead == k.shape[:-2]
    )
    if not fits:
        return apply_rotary(q, k, cos, sin)
    q_out, k_out = load().rope_bf16(*(t.flatten(0, -3) for t in (q, k, cos, sin)))
    return q_out.view(q.shape), k_out.view(k.shape)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return load().silu_and_mul(gate_up)


def install(model: torch.nn.Module) -> dict[str, int]:
    """Give every plain RMS norm of `model` the fused kernel, and with AVX512-BF16 every module
    that offers the hooks (the Llama family's attention and SiLU MLPs: `fused_rotary`,
    `fused_act_and_mul`) the fused rope and SiLU-and-product; how many of each. The hooks are found
    by name, so the device layer imports no model."""
    import torch.nn.functional as F

    from engine.layers.norm import RMSNorm

    counts = {"norms": 0, "ropes": 0, "silu MLPs": 0}
    vectors = serves(DotLinear)  # built with AVX512-BF16, and the level in force has it
    for module in model.modules():
        if type(module) is RMSNorm:
            module.fused = rms_norm
            counts["norms"] += 1
        elif hasattr(module, "fused_rotary") and vectors:
            module.fused_rotary = rope
            counts["ropes"] += 1
        elif hasattr(module, "fused_act_and_mul") and module.act is F.silu and vectors:
            module.fused_act_and_mul = silu_and_mul
            counts["silu MLPs"] += 1
    return counts


# The widest rows (new tokens a row) of a prefill or verify forward that the fused call takes.
# Each new token attends on its own over the paged cache (the decode kernel), whose work grows
# with the square of a row's tokens: at 256 it is still a small part of the step beside the
# products; wider rows run the modules (SDPA's tiled attention).
EXTEND_WIDTH = 256


class FusedDecoder:
    """Every layer of a bfloat16 decode step in one C++ call (decoder.cpp's decode_layers), for a
    model whose layers are all plain (its plain_decoder()) and whose projections one packed
    product multiplies. The call runs the kernels the layers would, with the same roundings, so its
    output is the layers' own bits; what it saves is the Python and the dispatch between a step's
    ~400 kernel calls (docs/benchmarks.md). Set as the model's `fused_decode` hook, found by name so
    that the device layer imports no model."""

    def __init__(self, model: torch.nn.Module, product: str):
        first = model.layers[0]
        self.model, self.product = model, product
        self.heads, self.kv_heads = first.self_attn.num_heads, first.self_attn.num_kv_heads
        self.scale = first.self_attn.scale
        self.eps = first.input_layernorm.eps
        self.intermediate = first.mlp.down_proj.quantized.in_features
        self.attentions = [layer.self_attn for layer in model.layers]
        none = torch.empty(0, dtype=torch.bfloat16)
        self.weights = [
            [
                layer.input_layernorm.weight,
                layer.self_attn.qkv_proj.quantized.packed,
                none if layer.self_attn.qkv_proj.bias is None else layer.self_attn.qkv_proj.bias,
                layer.self_attn.o_proj.quantized.packed,
                layer.post_attention_layernorm.weight,
                layer.mlp.gate_up_proj.quantized.packed,
                layer.mlp.down_proj.quantized.packed,
            ]
            for layer in model.layers
        ]

    def _layer_tensors(self) -> list[torch.Tensor]:
        """Every layer's weights and KV cache, in decode_layers' order. Read at every call: the
        caches are bound after load and again at each warmup, and a list kept between calls
        would hold a replaced cache's memory (the attention modules are listed once: looking
        them up through the model's modules cost 0.1 ms a step)."""
        return [t for w, a in zip(self.weights, self.attentions) for t in (*w, *a.kv_cache)]

    def takes_final_logits(self) -> bool:
        """Whether final_logits runs this model's: an RMS norm of the fused kernel, a packed LM
        head of the whole vocabulary (one shard) and nothing after it (no final soft cap)."""
        from engine.layers.norm import RMSNorm

        model, head = self.model, self.model.lm_head.quantized
        return (
            type(model.norm) is RMSNorm
            and model.norm.fused is not None
            and model.config.final_softcap is None
            and getattr(head, "product", None) is not None
            and head.out_features == model.config.vocab_size
        )

    def takes_greedy_steps(self) -> bool:
        """Whether greedy_steps runs this model: final_logits does, its embedding is a bfloat16 or
        int8 table of one shard and its rope one table (no longrope switch)."""
        from engine.layers.quant import Int8Weight

        model, table = self.model, self.model.embed_tokens.quantized
        int8_table = type(table) is Int8Weight and table.scale.dtype == torch.bfloat16
        return (
            self.takes_final_logits()
            and getattr(model.rotary, "long_from", None) is None
            and (table is None or int8_table)
        )

    def final_logits(self, hidden: torch.Tensor, indices: torch.Tensor) -> torch.Tensor | None:
        """The model's final_logits (norm, LM head, float32) in one call, or None where it does
        not take them (takes_final_logits, bfloat16 hidden states)."""
        if hidden.dtype != torch.bfloat16 or not self.takes_final_logits():
            return None
        return load().final_logits(hidden, indices, *self._final_tensors())

    def _final_tensors(self) -> tuple:
        """The final norm's and the packed LM head's arguments, as final_logits and greedy_steps
        take them: norm weight and eps, head, vocabulary, the head's product."""
        norm, head = self.model.norm, self.model.lm_head.quantized
        return norm.weight, norm.eps, head.packed, head.out_features, head.product

    @staticmethod
    def guess_rows() -> int:
        """The most rows a forward of greedy_steps feeds with guesses (decoder.h)."""
        return load().GUESS_ROWS

    def greedy_steps(
        self,
        fed: list[int],
        position: int,
        count: int,
        slots: list[int],
        history: list[int] = (),
        guesses: int = 0,
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """`count` greedy proposals of one row in one call: the first forward feeds every token
        of `fed` from `position` on in one pass (as an extend forward), each later one the token
        chosen last; each takes the argmax of its logits at its last fed token. The tokens the
        row's forwards one by one through the model and torch.argmax choose. With `history` (the
        row's tokens before `position`) a forward also feeds up to `guesses` tokens that prompt
        lookup expects next, and every guess its forward chose stands, its own row choosing the
        next proposal (decoder.h). `slots`: the row's cache slots of positions 0 through the last
        proposal's. Returns the proposals and, for each forward, its rows fed and its proposals."""
        model = self.model
        table = model.embed_tokens.quantized
        embedding, table_scale = (
            (model.embed_tokens.weight, torch.empty(0))
            if table is None
            else (table.codes, table.scale)
        )
        positions = torch.arange(position, position + len(fed) + count - 1)
        cos, sin = model.rotary.cos_sin(positions, torch.bfloat16)
        tokens, forwards = load().greedy_steps(
            torch.tensor(fed, dtype=torch.long), position, count,
            torch.tensor(history, dtype=torch.long), guesses, self._layer_tensors(),
            embedding, table_scale, *self._final_tensors(),
            cos, sin, torch.tensor(slots, dtype=torch.long),
            self.heads, self.kv_heads, self.intermediate, self.eps, self.scale, self.product,
        )  # fmt: skip
        return tokens.tolist(), [tuple(pair) for pair in forwards.tolist()]

    def __call__(self, hidden: torch.Tensor, rope: tuple, meta) -> torch.Tensor | None:
        """The hidden states after every layer, or None where the step is not one this call takes
        (a prefill of more than EXTEND_WIDTH tokens a row, or with image tokens): the modules run
        it."""
        from engine.attention import DecodeMetadata

        tensors = self._layer_tensors()
        cos, sin = rope
        shapes = (self.heads, self.kv_heads, self.intermediate, self.eps, self.scale, self.product)
        if isinstance(meta, DecodeMetadata):
            tables = (meta.block_list, meta.block_groups, meta.block_bias)
            return load().decode_layers(hidden, tensors, cos, sin, meta.slots, *tables, *shapes)
        rows, width = hidden.shape[:2]
        if width > EXTEND_WIDTH or meta.image_groups is not None or meta.seq_lens is None:
            return None
        context = (meta.context_slots, meta.context_lens)
        if meta.context_slots is None:  # prompts of their own: no context
            context = (torch.zeros(rows, 0, dtype=torch.long), torch.zeros(rows, dtype=torch.long))
        # The rows' real tokens only, packed: no product or attention runs on padding.
        real = (torch.arange(width) < meta.seq_lens.unsqueeze(1)).flatten().nonzero().squeeze(1)
        packed = [t.reshape(rows * width, -1).index_select(0, real) for t in (hidden, cos, sin)]
        out = load().extend_layers(
            packed[0],
            tensors,
            packed[1],
            packed[2],
            meta.slots.index_select(0, real),
            *context,
            meta.seq_lens,
            *shapes,
        )
        full = hidden.new_zeros(rows * width, hidden.shape[-1]).index_copy_(0, real, out)
        return full.view(hidden.shape)


def install_decoder(model: torch.nn.Module) -> bool:
    """Give `model` the fused decode step (FusedDecoder) where its layers are plain and every
    decoder projection is packed for one product (bfloat16 or int4); whether it did."""
    if not (hasattr(model, "fused_decode") and model.plain_decoder()):
        return False
    projections = [
        module
        for layer in model.layers
        for module in (
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
        )
    ]
    products = {getattr(p.quantized, "product", None) for p in projections}
    if len(products) != 1 or None in products:
        return False  # torch's quantized kernels, or unpacked weights: the layers run as modules
    model.fused_decode = FusedDecoder(model, projections[0].quantized.product)
    if hasattr(model, "fused_final"):
        model.fused_final = model.fused_decode.final_logits
    return True
