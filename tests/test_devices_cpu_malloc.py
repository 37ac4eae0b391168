"""glibc keeps freed memory for the next step on CPU (engine/devices/cpu_malloc.py): a buffer freed
and asked for again comes back without the kernel faulting its pages in anew."""

import subprocess
import sys

import pytest

# A 24 MiB buffer made, freed, and made again, as a step's activations are: the page faults of the
# second making, as the kernel counts them.
SECOND_ALLOCATION_FAULTS = """
import ctypes, resource, sys
if sys.argv[1] == "tuned":
    from engine.devices.cpu_malloc import keep_freed_memory
    assert keep_freed_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
size = 24 << 20
def touch(pointer):
    ctypes.memset(pointer, 1, size)
first = libc.malloc(size); touch(first); libc.free(first)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
second = libc.malloc(size); touch(second)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def second_allocation_faults(mode: str) -> int:
    done = subprocess.run(
        [sys.executable, "-c", SECOND_ALLOCATION_FAULTS, mode],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return int(done.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_a_freed_buffer_comes_back_without_page_faults():
    pages = (24 << 20) // 4096
    assert second_allocation_faults("default") > pages // 2  # glibc's own policy: faulted anew
    assert second_allocation_faults("tuned") < pages // 20


def test_the_cpu_adapter_keeps_freed_memory(monkeypatch):
    from engine.devices import cpu

    calls = []
    monkeypatch.setattr(cpu, "keep_freed_memory", lambda: calls.append(True))
    cpu.CPUAdapter()
    assert calls == [True]
