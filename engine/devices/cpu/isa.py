"""The x86 instruction-set levels of the CPU kernels, and the one setting that caps them.

The kernels are built with -march=native, so what a build contains follows the CPU: each level
below compiles more of their code (the sources' #if blocks on the compiler's macros) and serves
more of the Python-side classes (engine/devices/cpu/kernels: each names its level):

- scalar: decode attention and RMS norm in plain loops; every product is torch's.
- avx2 (AVX2, FMA, F16C): bfloat16 projections in FMA (FmaLinear); int8/int4 stay torch's
  (Int8Weight, Int4Weight).
- avx512 (F, BW, VL, DQ): the same products, attention and norms in 512-bit vectors.
- avx512_bf16: bfloat16 dot products (DotLinear), int4 and int8 products (Int4Linear,
  Int8Linear), a draft's screened head (ScreenedHead), the fused rope and SiLU.
- amx (AMX-TILE, AMX-BF16): bfloat16 projections in AMX tiles (AmxLinear).

BUCKETSERVE_CPU_ISA caps the level (read here only): an AVX-512 machine then builds and runs the
AVX2 and scalar paths, each level a library of its own in the cache. A cap the CPU cannot run is
refused in one line (IsaError), never built: its instructions would kill the process.
"""

from __future__ import annotations

import os
import platform
from functools import cache

from engine.errors import BucketserveError

LEVELS = ("scalar", "avx2", "avx512", "avx512_bf16", "amx")
CAP_VARIABLE = "BUCKETSERVE_CPU_ISA"

# The compiler's switches of each level's own features (the levels below it included), for
# compiling a level this CPU lacks (compile_flags): compiling needs none of them to run.
ENABLE = {
    "scalar": [],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"],
    "avx512_bf16": ["-mavx512bf16"],
    "amx": ["-mamx-tile", "-mamx-bf16"],
}
# What turns a level off with every level above it (GCC's and Clang's feature dependencies: no
# AVX, no AVX2 or AVX-512), AMX's tiles besides, which depend on no vector feature.
DISABLE = {
    "avx2": ["-mno-avx"],
    "avx512": ["-mno-avx512f"],
    "avx512_bf16": ["-mno-avx512bf16"],
    "amx": [],
}
NO_AMX = ["-mno-amx-tile"]


class IsaError(BucketserveError, ValueError):
    """A cap that names no level, or one this CPU cannot run."""


def x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


@cache
def cpu_levels() -> tuple[str, ...]:
    """The levels this CPU runs, lowest first, as torch's cpuinfo reports its features (an x86
    level needs every one below it; other architectures: scalar)."""
    import torch

    if not x86():
        return ("scalar",)
    checks = {
        "avx2": torch.cpu._is_avx2_supported,
        "avx512": torch.cpu._is_avx512_supported,
        "avx512_bf16": torch.cpu._is_avx512_bf16_supported,
        "amx": torch.cpu._is_amx_tile_supported,
    }
    levels = ["scalar"]
    for name, has in checks.items():
        if not has():
            break
        levels.append(name)
    return tuple(levels)


def check_cap(cap: str) -> str:
    """`cap` if this CPU runs it, else IsaError with the one line to show."""
    if cap not in LEVELS:
        raise IsaError(f"{CAP_VARIABLE}={cap}: not a level; use one of {', '.join(LEVELS)}")
    if cap not in cpu_levels():
        raise IsaError(
            f"{CAP_VARIABLE}={cap}: this CPU does not run it (it runs {', '.join(cpu_levels())})"
        )
    return cap


def cap() -> str | None:
    """The cap that the environment sets (checked), or None."""
    return _cap_of(os.environ.get(CAP_VARIABLE, ""))


@cache  # every kernel call asks (cpu_kernels.load): a lookup, not a check (an error is not kept)
def _cap_of(text: str) -> str | None:
    value = text.strip().lower()
    return check_cap(value) if value else None


def level() -> str:
    """The level the kernels are built and chosen for: the cap, else the CPU's highest."""
    return cap() or cpu_levels()[-1]


def at_least(name: str, of: str | None = None) -> bool:
    """Whether level `of` (default: level()) includes level `name`."""
    return LEVELS.index(of or level()) >= LEVELS.index(name)


def testable_levels() -> tuple[str, ...]:
    """The levels whose kernels this machine can test: the CPU's, up to the cap."""
    return tuple(name for name in cpu_levels() if at_least(name))


def build_flags(name: str) -> list[str]:
    """The compiler flags of a library at level `name`, which this CPU runs: -march=native (the
    CPU's own tuning and features), the features above `name` turned off where it is a cap."""
    flags = ["-march=native"]
    if name == cpu_levels()[-1] or not x86():
        return flags  # the uncapped build: the flags it always had
    above = LEVELS[LEVELS.index(name) + 1]
    return flags + DISABLE[above] + NO_AMX


def compile_flags(name: str) -> list[str]:
    """The flags that compile level `name`'s code on any x86 compiler, whatever this CPU runs
    (its features switched on explicitly): for a compile-only check, never to run."""
    wanted = LEVELS[: LEVELS.index(name) + 1]
    return [flag for level_name in wanted for flag in ENABLE[level_name]]
