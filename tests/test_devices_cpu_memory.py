"""Host memory for CPU serving (engine/devices/cpu/memory.py): glibc keeps freed memory for the next
step, so a buffer freed and asked for again comes back without the kernel faulting its pages in
anew; the packed weights and the KV cache sit in memory advised for huge pages."""

import subprocess
import sys

import pytest
import torch

# A 24 MiB buffer made, freed, and made again, as a step's activations are: the page faults of the
# second making, as the kernel counts them.
SECOND_ALLOCATION_FAULTS = """
import ctypes, resource, sys
if sys.argv[1] == "tuned":
    from engine.devices.cpu.memory import keep_freed_memory
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
    from engine.devices.cpu import adapter as cpu

    calls = []
    monkeypatch.setattr(cpu, "keep_freed_memory", lambda: calls.append(True))
    cpu.CPUAdapter()
    assert calls == [True]


def advised_for_huge_pages(tensor: torch.Tensor) -> bool:
    """Whether the mapping that holds `tensor` carries MADV_HUGEPAGE (smaps' "hg" flag): the advice
    itself, whether or not the kernel then had huge pages to give."""
    address, mapping = tensor.data_ptr(), None
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(part, 16) for part in head.split("-"))
            mapping = start <= address < end
        elif head == "VmFlags:" and mapping:
            return "hg" in line.split()
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's madvise")
def test_huge_page_memory_is_advised_aligned_and_zero():
    from engine.devices.cpu.memory import HUGE_PAGE, huge_page_zeros, on_huge_pages

    zeros = huge_page_zeros((3, 1000, 7), torch.bfloat16)
    assert zeros.shape == (3, 1000, 7) and not zeros.any()
    assert zeros.data_ptr() % HUGE_PAGE == 0 and advised_for_huge_pages(zeros)
    source = torch.randn(300, 64).bfloat16()
    copy = on_huge_pages(source)
    assert torch.equal(copy, source) and advised_for_huge_pages(copy)
    assert not advised_for_huge_pages(source)  # torch's own allocation, for contrast


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's madvise")
def test_the_kv_cache_and_the_packed_weights_sit_on_huge_page_memory():
    from engine.devices.cpu import kernels as cpu_kernels
    from engine.devices.cpu.adapter import CPUAdapter

    assert advised_for_huge_pages(CPUAdapter().zeros((4096, 3, 64), torch.bfloat16))
    kernel = cpu_kernels.kernel_for(torch.ones(64, 64).bfloat16())
    if kernel is None:
        pytest.skip("no packed bfloat16 kernel on this CPU")
    assert advised_for_huge_pages(kernel(torch.randn(64, 64).bfloat16()).packed)
