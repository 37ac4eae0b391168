#!/usr/bin/env bash
# Speculation under load: 32 concurrent requests on the compass workload, bucketserve with
# `--speculate ngram` against itself without, both servers up at once, requests alternating.
#
#   scripts/bench_spec_concurrent.sh
#
# The workload is scripts/peer_bench.py's (request i asks for 16 + (i*37) % 113 tokens, greedy,
# EOS ignored, all sent at once), as in scripts/bench_llamacpp.sh and scripts/bench_vllm_cpu.sh.
# Prints each run, the medians and the ratio (speculating / plain). A benchmark, not a test.
#
# Environment: RUNS (3), CONCURRENCY (32), K (4), DTYPE (bfloat16), PY, OURS_EXTRA.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-$ROOT/.venv/bin/python}
RUNS=${RUNS:-3}
N=${CONCURRENCY:-32}
K=${K:-4}
DTYPE=${DTYPE:-bfloat16}
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
CACHE=$("$PY" -c "from engine.config import default_cache_dir; print(default_cache_dir())")
OUT=$CACHE/spec-runs/$(date -u +%Y%m%dT%H%M%S)
mkdir -p "$OUT"
# shellcheck source=scripts/bench_servers.sh
. "$ROOT/scripts/bench_servers.sh"

start_ours() {  # $1: port, $2: label; the rest: extra flags
    local port=$1 label=$2 start pid
    shift 2
    start=$(now)
    # shellcheck disable=SC2086
    "$PY" -m launcher --device cpu --port "$port" --hostname 127.0.0.1 --max-batch-size "$N" \
        --max-concurrent-requests "$N" --dtype "$DTYPE" "$@" ${OURS_EXTRA:-} \
        >"$OUT/$label.log" 2>&1 &
    pid=$!; PIDS+=("$pid")
    echo "$label ready after $(wait_ready "http://127.0.0.1:$port" "$start" "$pid") s"
}

echo "machine load before: $(cut -d' ' -f1-3 /proc/loadavg)"
start_ours 3961 bucketserve-ngram --speculate ngram --num-speculative-tokens "$K"
start_ours 3962 off-bucketserve
for run in $(seq "$RUNS"); do
    "$PY" "$ROOT/scripts/peer_bench.py" --url http://127.0.0.1:3961 --concurrency "$N" \
        --label "bucketserve-ngram-k$K" | tee -a "$OUT/runs.jsonl"
    "$PY" "$ROOT/scripts/peer_bench.py" --url http://127.0.0.1:3962 --concurrency "$N" \
        --label off-bucketserve | tee -a "$OUT/runs.jsonl"
done
echo "machine load after: $(cut -d' ' -f1-3 /proc/loadavg)"
curl -s http://127.0.0.1:3961/metrics | grep -E '^bucketserve_.*spec' | head -20 || true
"$PY" "$ROOT/scripts/peer_bench.py" --summarize "$OUT/runs.jsonl" | tee "$OUT/summary.txt"
