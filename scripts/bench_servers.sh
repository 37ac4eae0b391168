# Shared by the peer benchmarks (sourced, not run): waiting for a server, the clock, and stopping
# every server started, whatever way the script ends. Needs $PY and $OUT.

wait_ready() {  # seconds from $2 (epoch, fractional) until $1/health answers 200; $3: its pid
    until curl -sf "$1/health" >/dev/null 2>&1; do
        kill -0 "$3" 2>/dev/null || { echo "server died; see $OUT" >&2; kill $$; exit 1; }
        sleep 0.2
    done
    "$PY" -c "import time,sys; print(f'{time.time() - float(sys.argv[1]):.1f}')" "$2"
}

now() { "$PY" -c "import time; print(time.time())"; }

PIDS=()
cleanup() { for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

start_speculating() {  # bucketserve as the speculation benchmarks run it; $1: port, $2: label;
    local port=$1 label=$2 start pid  # the rest: extra flags (--speculate ...); then OURS_EXTRA
    shift 2
    start=$(now)
    "$PY" -m launcher --device cpu --port "$port" --hostname 127.0.0.1 --max-batch-size 4 \
        --dtype bfloat16 "$@" ${OURS_EXTRA:-} >"$OUT/$label.log" 2>&1 &
    pid=$!; PIDS+=("$pid")
    echo "$label ready after $(wait_ready "http://127.0.0.1:$port" "$start" "$pid") s"
}
