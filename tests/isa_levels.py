"""The CPU kernels' tests at each ISA level this CPU runs (engine/devices/cpu/isa.py): a test caps
the kernels at a level through BUCKETSERVE_CPU_ISA, the way a user would, and gets that level's
library (built on first use, then cached). A level the CPU lacks, or one above the cap CI set, is
skipped with that reason: a test never runs instructions the CPU does not have."""

import pytest

from engine.devices.cpu import isa
from engine.devices.cpu import kernels as cpu_kernels


def use_level(monkeypatch, level: str):
    """Cap the kernels at `level` for the calling test; the built module at that level, or a skip
    that says why there is none."""
    if level not in isa.cpu_levels():
        pytest.skip(f"this CPU lacks {level} (it runs {', '.join(isa.cpu_levels())})")
    if not isa.at_least(level):
        pytest.skip(f"{isa.CAP_VARIABLE}={isa.cap()} caps the kernels below {level}")
    monkeypatch.setenv(isa.CAP_VARIABLE, level)
    module = cpu_kernels.load()
    if module is None:
        pytest.skip(f"CPU kernels not built: {cpu_kernels.PROBLEMS.get(level, 'turned off')}")
    return module


@pytest.fixture(params=isa.testable_levels())
def isa_level(request, monkeypatch) -> str:
    """Each level this CPU runs, up to the cap, as the level in force (its kernels built); a test
    of one level only parametrizes it indirectly with at_level."""
    use_level(monkeypatch, request.param)
    return request.param


def at_level(level: str) -> list:
    """The parameters of isa_level for a test of `level` alone: that level, or one skipped
    parameter that says why this machine cannot test it (one skip a test, not one a case)."""
    if level in isa.testable_levels():
        return [level]
    why = f"this CPU lacks {level}" if level not in isa.cpu_levels() else "capped below it"
    return [pytest.param(level, marks=pytest.mark.skip(reason=why))]


def skip_module_below(level: str) -> None:
    """Skip the calling test module, once, where this machine cannot test `level`."""
    if level not in isa.testable_levels():
        pytest.skip(f"no {level} to test here (the CPU or the cap)", allow_module_level=True)


@pytest.fixture
def kernels_at(monkeypatch):
    """use_level for the calling test: kernels_at("avx512_bf16") -> the module at that level."""
    return lambda level: use_level(monkeypatch, level)
