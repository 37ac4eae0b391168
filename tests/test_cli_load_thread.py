"""The shard loads its model on a thread that ends (engine.cli.main.on_a_passing_thread), so that
its worker is the process's only OpenMP master: libgomp keeps a pool of workers for each thread
that ran a parallel region, and with more of them than CPUs its idle workers stop spinning."""

import subprocess
import sys
import textwrap

import pytest

from engine.cli.main import on_a_passing_thread

# Threads of a fresh process before and after one parallel torch op (2 OpenMP threads), run on the
# main thread or on a passing one. Python's join() returns before the ended thread's thread-local
# destructors run, and libgomp releases that thread's pool in one of them, so the passing case
# waits (up to 10 s) for the count to come back down before it reports.
PROBE = textwrap.dedent(
    """
    import os, sys, time
    import torch
    from engine.cli.main import on_a_passing_thread
    torch.set_num_threads(2)
    threads = lambda: len(os.listdir("/proc/self/task"))
    before = threads()
    work = lambda: (torch.ones(4_000_000) * 2).sum()
    if sys.argv[1] == "passing":
        on_a_passing_thread(work)
        deadline = time.monotonic() + 10
        while threads() > before and time.monotonic() < deadline:
            time.sleep(0.01)
    else:
        work()
    print(threads() - before)
    """
)


def extra_threads(where: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, where], capture_output=True, text=True, check=True
    )
    return int(out.stdout.split()[-1])


def test_a_parallel_op_on_the_main_thread_leaves_an_openmp_worker_behind():
    """The premise: without the passing thread, the main thread keeps a pool."""
    assert extra_threads("main") >= 1


def test_a_passing_thread_leaves_no_openmp_worker_behind():
    assert extra_threads("passing") == 0


def test_the_result_and_the_error_come_back_to_the_caller():
    import threading

    assert on_a_passing_thread(lambda: threading.current_thread().name) == "shard-load"
    with pytest.raises(ValueError, match="bad model"):
        on_a_passing_thread(lambda: (_ for _ in ()).throw(ValueError("bad model")))
