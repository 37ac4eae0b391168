"""How the fused CPU kernels are built and found: once by the set-up, then imported at every start
without the compiler; a build in a directory of its own, so that no lock file can hold a start."""

import shutil

import pytest
from torch.utils import cpp_extension

from engine.devices.cpu import kernels as cpu_kernels
from engine.devices.cpu.kernels import __main__ as build_command


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
    module = cpu_kernels._build.__wrapped__()
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
    library = cpu_kernels.library_path()
    library.parent.mkdir(parents=True)
    (library.parent / "lock").touch()  # what a killed cpp_extension build leaves behind
    seen: list = []
    monkeypatch.setattr(cpp_extension, "load", fake_build(seen))
    assert cpu_kernels._build.__wrapped__() == "the module"
    assert seen == [[]]  # it built in an empty directory, not beside the stale lock
    assert library.read_bytes() == b"built"
    assert sorted(p.name for p in library.parent.iterdir()) == sorted(["lock", library.name])


def test_a_failed_build_leaves_the_pure_torch_path_and_no_scratch(tmp_path, monkeypatch):
    monkeypatch.setenv("BUCKETSERVE_CACHE", str(tmp_path))

    def broken(**kwargs):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(cpp_extension, "load", broken)
    assert cpu_kernels._build.__wrapped__() is None
    assert list(cpu_kernels.library_path().parent.iterdir()) == []


def test_the_set_up_command_builds_once_and_then_finds_the_library(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("BUCKETSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", fake_build([]))
    monkeypatch.setattr(cpu_kernels, "load", cpu_kernels._build.__wrapped__)
    assert build_command.main() == 0
    assert "built in" in capsys.readouterr().out
    monkeypatch.setattr(cpu_kernels, "import_library", lambda path: "imported")
    assert build_command.main() == 0
    assert "already built" in capsys.readouterr().out


def test_the_set_up_command_succeeds_with_the_kernels_off(monkeypatch, capsys):
    monkeypatch.setenv("BUCKETSERVE_CPU_KERNELS", "0")
    assert build_command.main() == 0
    assert "off" in capsys.readouterr().out
