"""Cores each process used over a window, by thread name, and the machine's busy cores (Linux).

    python scripts/cpu_shares.py SECONDS router=PID shard=PID ...

Prints JSON. docs/benchmarks.md's serving breakdown sampled a running server's router and shard
with it while scripts/peer_bench.py loaded them. Standard library only.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time


def thread_jiffies(pid: str) -> dict[str, tuple[str, int]]:
    """Thread id -> (name, user + system jiffies so far)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = open(f"/proc/{pid}/task/{tid}/stat").read()
        except OSError:  # the thread ended
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        out[tid] = (name, int(fields[11]) + int(fields[12]))
    return out


def machine_jiffies() -> tuple[int, int]:
    fields = [int(f) for f in open("/proc/stat").readline().split()[1:]]
    return sum(fields) - fields[3] - fields[4], sum(fields)


def main(seconds: float, labels: dict[str, str]) -> dict:
    before = {label: thread_jiffies(pid) for label, pid in labels.items()}
    machine0, start = machine_jiffies(), time.time()
    time.sleep(seconds)
    after = {label: thread_jiffies(pid) for label, pid in labels.items()}
    machine1, wall = machine_jiffies(), time.time() - start
    hz, cores = os.sysconf("SC_CLK_TCK"), os.cpu_count() or 1
    busy = cores * (machine1[0] - machine0[0]) / max(machine1[1] - machine0[1], 1)
    result: dict = {"wall_s": round(wall, 2), "machine_cores_busy": round(busy, 3)}
    for label in labels:
        by_name: collections.Counter = collections.Counter()
        for tid, (name, jiffies) in after[label].items():
            by_name[name] += jiffies - before[label].get(tid, (name, 0))[1]
        result[label] = {
            "cores": round(sum(by_name.values()) / hz / wall, 3),
            "threads": {n: round(j / hz / wall, 3) for n, j in by_name.most_common(8)},
        }
    return result


if __name__ == "__main__":
    pairs = dict(arg.split("=", 1) for arg in sys.argv[2:])
    print(json.dumps(main(float(sys.argv[1]), pairs), indent=1))
