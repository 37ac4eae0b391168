"""How the fused CPU kernels are built and found: once by the set-up, then imported at every start
without the compiler; a build in a directory of its own, so that no lock file can hold a start."""

import os
import re
import shutil
import subprocess
import sys

import pytest
from torch.utils import cpp_extension

from engine.devices.cpu import isa
from engine.devices.cpu import kernels as cpu_kernels
from engine.devices.cpu.kernels import __main__ as build_command
from launcher.cli import main as launcher_main
from tests.test_multinode import pytest_signals  # noqa: F401 - a fixture
from tests.test_server import free_tcp_port


def refuse_to_compile(**kwargs):
    raise AssertionError("the compiler ran although the library was built")


def test_a_built_library_is_imported_without_the_compiler(tmp_path, monkeypatch):
    if shutil.which("c++") is None or cpu_kernels.load() is None:
        pytest.skip("no C++ compiler: nothing built to import")
    built = cpu_kernels.library_path()
    monkeypatch.setenv("BUCKETSERVE_CACHE", str(tmp_path))
    copy = cpu_kernels.library_path()
    copy.parent.mkdir(parents=True)
    shutil.copy(built, copy)
    monkeypatch.setattr(cpp_extension, "load", refuse_to_compile)
    module = cpu_kernels._build.__wrapped__(isa.level())
    assert module is not None and module.dot_linear_supported() in (True, False)


def fake_build(seen: list):
    """cpp_extension.load as far as the loader sees it: a library in the build directory."""

    def load(name, build_directory, **kwargs):
        seen.append(sorted(p.name for p in cpu_kernels.Path(build_directory).iterdir()))
        (cpu_kernels.Path(build_directory) / f"{name}.so").write_bytes(b"built")
        return "the module"

    return load


def test_a_stale_lock_file_does_not_hold_a_build_and_none_is_left(tmp_path, monkeypatch):
    monkeypatch.setenv("BUCKETSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_kernels, "missing_tool", lambda: None)  # the build is cpp_extension's
    library = cpu_kernels.library_path()
    library.parent.mkdir(parents=True)
    (library.parent / "lock").touch()  # what a killed cpp_extension build leaves behind
    seen: list = []
    monkeypatch.setattr(cpp_extension, "load", fake_build(seen))
    assert cpu_kernels._build.__wrapped__(isa.level()) == "the module"
    assert seen == [[]]  # it built in an empty directory, not beside the stale lock
    assert library.read_bytes() == b"built"
    assert sorted(p.name for p in library.parent.iterdir()) == sorted(["lock", library.name])


def test_a_failed_build_leaves_the_pure_torch_path_and_no_scratch(tmp_path, monkeypatch):
    monkeypatch.setenv("BUCKETSERVE_CACHE", str(tmp_path))

    def broken(**kwargs):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(cpp_extension, "load", broken)
    monkeypatch.setattr(cpu_kernels, "missing_tool", lambda: None)
    assert cpu_kernels._build.__wrapped__(isa.level()) is None
    assert list(cpu_kernels.library_path().parent.iterdir()) == []


def test_the_set_up_command_builds_once_and_then_finds_the_library(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("BUCKETSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", fake_build([]))
    monkeypatch.setattr(cpu_kernels, "missing_tool", lambda: None)
    monkeypatch.setattr(cpu_kernels, "load", lambda: cpu_kernels._build.__wrapped__(isa.level()))
    assert build_command.main() == 0
    assert "built in" in capsys.readouterr().out
    monkeypatch.setattr(cpu_kernels, "import_library", lambda path: "imported")
    assert build_command.main() == 0
    assert "already built" in capsys.readouterr().out


def test_the_set_up_command_succeeds_with_the_kernels_off(monkeypatch, capsys):
    monkeypatch.setenv("BUCKETSERVE_CPU_KERNELS", "0")
    assert build_command.main() == 0
    assert "off" in capsys.readouterr().out


def test_without_a_compiler_the_set_up_says_so_in_one_line(tmp_path):
    """The set-up command as `make` runs it, in a process of its own: another test's logging set-up
    must not decide how many lines it prints."""
    env = {**os.environ, "BUCKETSERVE_CACHE": str(tmp_path), "CXX": "no-such-compiler"}
    done = subprocess.run(
        [sys.executable, "-m", "engine.devices.cpu.kernels"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out, err = done.stdout, done.stderr
    assert done.returncode == 0
    assert err == "" and out.count("\n") == 1
    assert "no C++ compiler (no-such-compiler" in out and "pure-torch path" in out


def a_level_this_cpu_lacks() -> str:
    lacking = [level for level in isa.LEVELS if level not in isa.cpu_levels()]
    if not lacking:
        pytest.skip("this CPU runs every level")
    return lacking[0]


@pytest.mark.parametrize("cap", ["lacking", "avx1024"])
def test_a_cap_the_cpu_cannot_run_is_one_line_at_set_up_and_launch(
    cap, monkeypatch, capsys, pytest_signals
):
    cap = a_level_this_cpu_lacks() if cap == "lacking" else cap
    monkeypatch.setenv(isa.CAP_VARIABLE, cap)
    why = "this CPU does not run it" if cap in isa.LEVELS else "not a level; use one of scalar"
    with pytest.raises(isa.IsaError, match=why):
        cpu_kernels.load()
    assert build_command.main() == 2
    assert launcher_main(["--device", "cpu", "--port", str(free_tcp_port())]) == 2
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert out == "" and len(lines) == 2 and lines[0] == lines[1]
    assert lines[0].startswith(f"error: {isa.CAP_VARIABLE}={cap}: ") and why in lines[0]


def source_text(path) -> str:
    """A source with the text of the kernels' headers it includes, recursively."""
    text = path.read_text()
    included = re.findall(r'#include "([^"]+)"', text)
    return text + "".join(source_text(path.parent / name) for name in included)


# The macros of each level's code in the sources (the levels' #if blocks)
MACROS = {
    "avx2": ["__AVX2__"],
    "avx512": ["__AVX512F__"],
    "avx512_bf16": ["__AVX512BF16__"],
    "amx": ["__AMX_TILE__"],
}


def sources_above_this_cpu() -> list:
    """The sources with code of a level this CPU lacks (never built here), or one skipped
    parameter where the CPU runs them all (its builds compile every line)."""
    if not isa.x86():
        return [pytest.param(None, marks=pytest.mark.skip(reason="x86 levels only"))]
    above = [
        name for level in isa.LEVELS[1:] if level not in isa.cpu_levels() for name in MACROS[level]
    ]
    found = [path for path in cpu_kernels.SOURCES if any(m in source_text(path) for m in above)]
    skip = pytest.mark.skip(reason="this CPU runs every level: its builds compile all the code")
    return [pytest.param(p, id=p.name) for p in found] or [pytest.param(None, marks=skip)]


@pytest.mark.parametrize("source", sources_above_this_cpu())
def test_the_code_of_levels_this_cpu_lacks_compiles(source):
    """Code under AMX's or AVX-512's macros is built only on such CPUs: checked with the highest
    level's features switched on, compiling needs none of them."""
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler")
    done = cpu_kernels.compile_check("amx", source)
    assert done.returncode == 0, done.stderr[-4000:]
