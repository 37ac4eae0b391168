#!/usr/bin/env bash
# A py-spy profile of vLLM's CPU build serving 32 concurrent requests, for the side-by-side with
# bucketserve's own (docs/benchmarks.md).
#
#   scripts/bench_vllm_profile.sh
#
# Starts vLLM as scripts/bench_vllm_cpu.sh does (its functions: the same venv, threads binding and
# preloads; bf16, --max-num-seqs N), sends one warm batch of scripts/peer_bench.py's workload, then
# records the API server and its engine-core process with py-spy (`record --subprocesses
# --nonblocking -f raw`, RATE samples a second, PROFILE_SECONDS long) while batches run, and
# prints the processes' busy shares and top functions (scripts/bench_pyspy_top.py). A benchmark,
# not a test.
#
# Environment: CONCURRENCY (32), RATE (50), PROFILE_SECONDS (20), VLLM_EAGER (1: --enforce-eager,
# ready in under a minute; 0: vLLM's compiled default, 2-3 minutes), PY, PYSPY (the venv's
# py-spy).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
N=${CONCURRENCY:-32}
RATE=${RATE:-50}
PROFILE_SECONDS=${PROFILE_SECONDS:-20}
export VLLM_EAGER=${VLLM_EAGER:-1}
PYSPY=${PYSPY:-$ROOT/.venv/bin/py-spy}
# shellcheck source=scripts/bench_vllm_cpu.sh
VLLM_FUNCTIONS_ONLY=1 . "$ROOT/scripts/bench_vllm_cpu.sh"
OUT=$OUT-profile
mkdir -p "$OUT"

install_vllm
MODEL=$("$PY" -c "from engine.config import default_cache_dir as cache
from engine.weights.loader import resolve_model_dir; print(resolve_model_dir(None, cache()))")
echo "machine load before: $(cut -d' ' -f1-3 /proc/loadavg)"
start=$(now)
start_vllm "$MODEL" 3971 "$N" >"$OUT/vllm.log" 2>&1
pid=$!; PIDS+=("$pid")
ready=$(wait_ready http://127.0.0.1:3971 "$start" "$pid")
echo "vLLM CPU $VERSION (batch $N, eager $VLLM_EAGER) ready after $ready s"
bench() {
    "$PY" "$ROOT/scripts/peer_bench.py" --url http://127.0.0.1:3971 --concurrency "$N" \
        --model bench --label vllm-cpu-bf16
}
bench | tee -a "$OUT/runs.jsonl"  # warm
"$PYSPY" record --subprocesses --nonblocking -r "$RATE" -d "$PROFILE_SECONDS" -f raw \
    -o "$OUT/vllm.raw" -p "$pid" >"$OUT/py-spy.log" 2>&1 &
spy=$!
while kill -0 "$spy" 2>/dev/null; do bench | tee -a "$OUT/runs.jsonl"; done
echo "machine load after: $(cut -d' ' -f1-3 /proc/loadavg)"
"$PY" "$ROOT/scripts/bench_pyspy_top.py" "$OUT/vllm.raw" "$RATE" "$PROFILE_SECONDS" 25 |
    tee "$OUT/profile.txt"
