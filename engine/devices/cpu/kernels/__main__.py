"""`python -m engine.devices.cpu.kernels`: build the fused CPU kernels now (the README's set-up
runs it), so that no bfloat16 start spends a minute compiling. Exits 0 without a compiler too: the
pure-torch path then serves, as it would at start."""

from __future__ import annotations

import logging
import sys
import time

from engine.devices.cpu import isa
from engine.devices.cpu import kernels as cpu_kernels


def main() -> int:
    logging.basicConfig(level=logging.ERROR, format="%(message)s")
    if not cpu_kernels.enabled():
        print("CPU kernels: off (BUCKETSERVE_CPU_KERNELS=0)")
        return 0
    try:
        level = isa.level()
    except isa.IsaError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    built = cpu_kernels.library_path().exists()
    if cpu_kernels.load() is None:  # one line: why, and what serves instead
        why = cpu_kernels.PROBLEMS.get(level, "")
        print(f"CPU kernels: not built, {why}; bucketserve serves the pure-torch path")
        return 0
    how = "already built" if built else f"built in {time.perf_counter() - start:.0f}s"
    print(f"CPU kernels: {how} at ISA level {level}, {cpu_kernels.library_path()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
