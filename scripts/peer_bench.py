"""One closed batch of concurrent streaming completions against an OpenAI-compatible server.

Used by scripts/bench_llamacpp.sh to put bucketserve and llama.cpp's llama-server through the very
same HTTP workload: request i asks for `16 + (i*37) % 113` tokens (or `--tokens N` each) with EOS
ignored, greedy, all sent at once. Prints one JSON line: tokens/s over the whole batch, p50/p99
latency and TTFT, and p50 time per output token after the first (TPOT).
Standard library only, so it runs with any Python.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import threading
import time
from urllib.parse import urlparse

SOURCE = (
    "The river rose slowly through the night, and by morning the low fields near the old mill were "
    "under water. Farmers moved their animals to the hills, children watched from the bridge, and the "
    "miller counted sacks of grain that he had carried upstairs before the rain began. "
).split()


FIXED_TOKENS: int | None = None  # --tokens: every request asks for this many
MODEL: str | None = None  # --model: the `model` field (bucketserve refuses names it does not serve)


def budget(i: int) -> int:
    return FIXED_TOKENS or 16 + (i * 37) % 113


def prompt(i: int) -> str:
    """Prompts of 8 to 55 words, each starting at its own offset, the same for both servers."""
    words = 8 + (i * 13) % 48
    start = (i * 7) % len(SOURCE)
    return " ".join((SOURCE * 3)[start : start + words])


def one_request(url: str, i: int, out: list, t0: float) -> None:
    body = {
        **({"model": MODEL} if MODEL else {}),
        "prompt": prompt(i),
        "max_tokens": budget(i),
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    parsed = urlparse(url)
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=600)
    start = time.perf_counter()
    ttft, chunks, usage, error = None, 0, None, None
    try:
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        response = conn.getresponse()
        if response.status != 200:
            error = f"http {response.status}: {response.read()[:200]!r}"
        while error is None and (line := response.readline()):
            line = line.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            if event.get("usage"):
                usage = event["usage"]
            if any(c.get("text") for c in event.get("choices") or []):
                chunks += 1
                ttft = ttft if ttft is not None else time.perf_counter() - start
    except OSError as err:
        error = f"{type(err).__name__}: {err}"
    finally:
        conn.close()
    tokens = usage["completion_tokens"] if usage else chunks
    latency = time.perf_counter() - start
    tpot = (latency - ttft) / (tokens - 1) if ttft is not None and tokens > 1 else None
    out[i] = {
        "latency": latency,
        "ttft": ttft,
        "tpot": tpot,
        "tokens": tokens,
        "error": error,
        "end": time.perf_counter() - t0,
    }


def percentile(values: list[float], q: float) -> float | None:
    """None when no request succeeded (a server that died): the record then says so in `errors`."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def busy_jiffies() -> tuple[int, int]:
    """(non-idle, all) CPU jiffies of the machine so far (Linux /proc/stat; zeros elsewhere)."""
    try:
        fields = [int(f) for f in open("/proc/stat").readline().split()[1:]]
    except OSError:
        return 0, 0
    idle = fields[3] + fields[4]  # idle, iowait
    return sum(fields) - idle, sum(fields)


def settle(quiet_cores: float = 0.15, window_s: float = 0.5, limit_s: float = 15.0) -> None:
    """Wait until the machine is quiet (under `quiet_cores` busy over `window_s`): a server that
    has just answered may still spin its threads for a moment (OpenMP's workers, an engine loop
    polling its model process), and the next run, on the other server, must not start beside it."""
    deadline = time.perf_counter() + limit_s
    while time.perf_counter() < deadline:
        busy0, all0 = busy_jiffies()
        time.sleep(window_s)
        busy1, all1 = busy_jiffies()
        if (os.cpu_count() or 1) * (busy1 - busy0) / max(all1 - all0, 1) < quiet_cores:
            return


def run(url: str, n: int) -> dict:
    settle()
    results: list = [None] * n
    busy0, all0 = busy_jiffies()
    t0 = time.perf_counter()
    threads = [threading.Thread(target=one_request, args=(url, i, results, t0)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - t0
    busy1, all1 = busy_jiffies()
    cores = (os.cpu_count() or 1) * (busy1 - busy0) / max(all1 - all0, 1)
    errors = [r["error"] for r in results if r["error"]]
    short = sum(1 for i, r in enumerate(results) if not r["error"] and r["tokens"] != budget(i))
    tokens = sum(r["tokens"] for r in results)
    lat = [r["latency"] for r in results if not r["error"]]
    ttft = [r["ttft"] for r in results if r["ttft"] is not None]
    tpot = [r["tpot"] * 1000 for r in results if r["tpot"] is not None]
    return {
        "requests": n,
        "tokens": tokens,
        "seconds": round(wall, 3),
        "tok_s": round(tokens / wall, 2),
        "p50_latency": rounded(percentile(lat, 50)),
        "p99_latency": rounded(percentile(lat, 99)),
        "p50_ttft": rounded(percentile(ttft, 50)),
        "p99_ttft": rounded(percentile(ttft, 99)),
        "p50_tpot_ms": rounded(percentile(tpot, 50)),
        "p99_tpot_ms": rounded(percentile(tpot, 99)),
        "cores_busy": round(cores, 2),  # the whole machine's, both servers and the client
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "wrong_token_counts": short,
    }


def summarize(lines: list[str]) -> None:
    """Medians of the runs per (server, concurrency), and bucketserve / llama.cpp ratios."""
    runs: dict = {}
    for line in lines:
        record = json.loads(line)
        if (
            record["p50_latency"] is None
        ):  # not one request answered: the server is broken, not slow
            print(
                f"{record['server']} at {record['requests']}: every request failed ({record['first_error']})"
            )
            continue
        runs.setdefault((record["server"], record["requests"]), []).append(record)
    keys = ("tok_s", "p50_latency", "p99_latency", "p50_ttft", "p99_ttft", "p50_tpot_ms")
    keys += ("p99_tpot_ms", "cores_busy")
    medians = {
        k: {f: statistics.median(r.get(f) or 0.0 for r in v) for f in keys} for k, v in runs.items()
    }
    print(
        f"{'server':<24}{'conc':>5}{'tok/s':>9}{'p50 lat':>9}{'p99 lat':>9}{'p50 ttft':>10}{'p99 ttft':>10}"
        f"{'tpot ms':>9}{'p99 tpot':>9}{'cores':>6}  runs(tok/s)"
    )
    for (server, n), m in sorted(medians.items()):
        each = ", ".join(f"{r['tok_s']:.1f}" for r in runs[(server, n)])
        print(
            f"{server:<24}{n:>5}{m['tok_s']:>9.1f}{m['p50_latency']:>9.2f}{m['p99_latency']:>9.2f}"
            f"{m['p50_ttft']:>10.2f}{m['p99_ttft']:>10.2f}{m['p50_tpot_ms']:>9.1f}"
            f"{m['p99_tpot_ms']:>9.1f}{m['cores_busy']:>6.2f}  {each}"
        )
    for n in sorted({n for _, n in medians}):
        ours = [m for (s, c), m in medians.items() if c == n and s.startswith("bucketserve")]
        peers = [(s, m) for (s, c), m in medians.items() if c == n and not s.startswith("bucket")]
        if ours and peers:
            (name, p), o = peers[0], ours[0]
            print(
                f"ratio bucketserve/{name.split('-')[0]} at {n}: throughput {o['tok_s'] / p['tok_s']:.2f}x, "
                f"p50 latency {o['p50_latency'] / p['p50_latency']:.2f}x, p50 TTFT {o['p50_ttft'] / p['p50_ttft']:.2f}x, "
                f"p50 time per output token {o['p50_tpot_ms']:.1f} vs {p['p50_tpot_ms']:.1f} ms "
                f"({o['p50_tpot_ms'] / p['p50_tpot_ms']:.2f}x)"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", help="server base URL, e.g. http://127.0.0.1:8080")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--label", default="server", help="name written into the JSON line")
    parser.add_argument(
        "--tokens",
        type=int,
        help="every request asks for this many tokens (default: 16-128 by index)",
    )
    parser.add_argument("--model", help="the requests' `model` field (default: none sent)")
    parser.add_argument(
        "--summarize", help="a file of JSON lines from earlier runs: print medians and ratios"
    )
    args = parser.parse_args()
    if args.summarize:
        return summarize(open(args.summarize).read().splitlines())
    global FIXED_TOKENS, MODEL
    FIXED_TOKENS, MODEL = args.tokens, args.model
    record = {"server": args.label, **run(args.url, args.concurrency)}
    print(json.dumps(record))
    sys.exit(1 if record["errors"] else 0)


if __name__ == "__main__":
    main()
