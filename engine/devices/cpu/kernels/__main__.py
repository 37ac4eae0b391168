"""`python -m engine.devices.cpu.kernels`: build the fused CPU kernels now (the README's set-up
runs it), so that no bfloat16 start spends a minute compiling. Exits 0 without a compiler too: the
pure-torch path then serves, as it would at start."""

from __future__ import annotations

import logging
import sys
import time

from engine.devices.cpu import kernels as cpu_kernels


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if not cpu_kernels.enabled():
        print("CPU kernels: off (BUCKETSERVE_CPU_KERNELS=0)")
        return 0
    start = time.perf_counter()
    built = cpu_kernels.library_path().exists()
    module = cpu_kernels.load()
    if module is None:
        print("CPU kernels: not built (see the warning above); bucketserve uses pure torch")
        return 0
    how = "already built" if built else f"built in {time.perf_counter() - start:.0f}s"
    print(f"CPU kernels: {how}, {cpu_kernels.library_path()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
