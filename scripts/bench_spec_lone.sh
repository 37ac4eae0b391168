#!/usr/bin/env bash
# A lone greedy request, on free text and on an input-grounded rewrite: bucketserve with
# `--speculate ngram` against itself without, both servers up at once, requests alternating.
#
#   RUNS=3 scripts/bench_spec_lone.sh
#
# Renders scripts/bench_spec_client.py's two prompts through the model's chat template (the
# rewrite of scripts/bench_speculative.py, and a short story: nothing to copy), starts two servers
# (`--dtype bfloat16 --max-batch-size 4`, one with `--speculate ngram --num-speculative-tokens K`)
# and sends each prompt to each server in turn, one warm round and then RUNS rounds: greedy, EOS
# ends it, at most 128 tokens. Prints each run, the median decode rate per server and workload,
# and the ratios. Free text checks the off-switch (speculation must not lose there), the rewrite
# that it still pays.
# A benchmark, not a test: its figures go in docs/benchmarks.md.
#
# Environment: RUNS (3), K (4), WORKLOADS ("free rewrite"), PY.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-$ROOT/.venv/bin/python}
RUNS=${RUNS:-3}
K=${K:-4}
WORKLOADS=${WORKLOADS:-free rewrite}
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
CACHE=$("$PY" -c "from engine.config import default_cache_dir; print(default_cache_dir())")
OUT=$CACHE/spec-runs/lone-$(date -u +%Y%m%dT%H%M%S)
mkdir -p "$OUT"
# shellcheck source=scripts/bench_servers.sh
. "$ROOT/scripts/bench_servers.sh"

HF=$("$PY" -c "from engine.config import default_cache_dir as cache
from engine.weights.loader import resolve_model_dir; print(resolve_model_dir(None, cache()))")
"$PY" "$ROOT/scripts/bench_spec_client.py" --render "$HF" >"$OUT/rewrite.txt"
"$PY" "$ROOT/scripts/bench_spec_client.py" --render "$HF" --free >"$OUT/free.txt"

one() {  # $1: port, $2: label, $3: workload, $4: the run (0: the warm one)
    local into=$OUT/$3.jsonl
    [ "$4" -gt 0 ] || into=$OUT/$3-warm.jsonl
    "$PY" "$ROOT/scripts/bench_spec_client.py" --url "http://127.0.0.1:$1" \
        --prompt-file "$OUT/$3.txt" --label "$2" | tee -a "$into"
}

echo "machine load before: $(cut -d' ' -f1-3 /proc/loadavg)"
start_speculating 3971 "bucketserve-ngram-k$K" --speculate ngram --num-speculative-tokens "$K"
start_speculating 3972 bucketserve-off
for run in $(seq 0 "$RUNS"); do  # run 0 warms both servers up and is not counted
    for workload in $WORKLOADS; do
        one 3971 "bucketserve-ngram-k$K" "$workload" "$run"
        one 3972 bucketserve-off "$workload" "$run"
    done
done
echo "machine load after: $(cut -d' ' -f1-3 /proc/loadavg)"
curl -s http://127.0.0.1:3971/metrics | grep -E '^bucketserve_shard_spec' || true
for workload in $WORKLOADS; do
    echo "== $workload"
    "$PY" "$ROOT/scripts/bench_spec_client.py" --summarize "$OUT/$workload.jsonl" \
        | tee "$OUT/$workload-summary.txt"
done
