"""The top functions of a `py-spy record -f raw` profile, with their shares of the samples.

    python scripts/bench_pyspy_top.py PROFILE.txt [RATE SECONDS [TOP]]

For each process (py-spy's `--subprocesses` starts each stack with `process PID:"command"`
frames, the process's parents' first): its samples, and with RATE and SECONDS how many of the wall's samples its Python threads
were busy in (py-spy skips idle threads unless told `--idle`); then the TOP (20) functions by
self samples (the innermost Python frame: with native code off, a torch op's time is charged to
the line that called it) and by inclusive samples. Used by scripts/bench_vllm_profile.sh.
"""

import collections
import sys


def frames_of(line: str) -> tuple[list[str], int]:
    stack, _, count = line.rstrip().rpartition(" ")
    return stack.split(";"), int(count)


def short(frame: str) -> str:
    """`function (path/to/file.py:123)` -> `function (file.py:123)`."""
    name, _, where = frame.partition(" (")
    return f"{name} ({where.rsplit('/', 1)[-1]}" if where else name


def main() -> None:
    path = sys.argv[1]
    rate, seconds = (float(sys.argv[2]), float(sys.argv[3])) if len(sys.argv) > 3 else (0, 0)
    top = int(sys.argv[4]) if len(sys.argv) > 4 else 20
    per_process: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    inclusive: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    totals: collections.Counter = collections.Counter()
    for line in open(path):
        if not line.strip():
            continue
        frames, count = frames_of(line)
        # a child's stack starts with its parents' process frames: the innermost one names it
        processes = [f for f in frames if f.startswith("process ")]
        process = processes[-1] if processes else "process ?"
        body = [f for f in frames if not f.startswith(("process ", "thread "))]
        totals[process] += count
        if body:
            per_process[process][short(body[-1])] += count
        for frame in set(map(short, body)):
            inclusive[process][frame] += count
    for process, samples in totals.most_common():
        busy = f", busy {samples / (rate * seconds):.2f} of a thread's wall" if rate else ""
        print(f"{process[:100]}: {samples} samples{busy}")
        print("  self:")
        for frame, count in per_process[process].most_common(top):
            print(f"    {100 * count / samples:5.1f}%  {frame}")
        print("  inclusive:")
        for frame, count in inclusive[process].most_common(top):
            print(f"    {100 * count / samples:5.1f}%  {frame}")


if __name__ == "__main__":
    main()
