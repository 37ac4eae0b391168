"""`bucketserve loadtest`: drive a running TGI-compatible server open-loop and report its latencies.

Open-loop means requests leave at their scheduled arrival times whatever the server does, so an
overloaded server shows up as growing latencies and 429s instead of a load generator that slows
down with it (closed-loop clients hide overload: "coordinated omission").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

EXIT_CONFIG = 2  # as the other bucketserve commands: the command line is wrong, nothing was sent
# Texts to continue, not questions: sent raw (no chat template), an instruct model often answers a
# question with an immediate end of sequence, which would measure almost nothing.
DEFAULT_PROMPTS = (
    "Once upon a time",
    "The history of the Roman Empire began",
    "def fibonacci(n):",
    "Here is a simple recipe for pancakes:",
    "List three uses of a paper clip.",
    "The sea at night is",
    "A hash table is a data structure that",
    "The three most important inventions of the 20th century are",
)
PERCENTILES = (50, 90, 99)


@dataclass
class Result:
    """One request. Times are seconds; `sent` counts from the start of the run."""

    index: int
    sent: float
    outcome: str = "error"  # "ok" | "429" | "error": every request ends as exactly one of them
    latency: float | None = None
    ttft: float | None = None
    tpot: float | None = None
    tokens: int = 0
    error: str | None = None


# --- the workload ------------------------------------------------------------------------------


def arrival_times(n: int, rate: float, poisson: bool, seed: int) -> list[float]:
    """Send offsets from the start: exponential gaps (a Poisson process) or a fixed 1/rate
    interval."""
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate) if poisson else 1.0 / rate
    return out


def read_prompts(args: argparse.Namespace) -> list[str]:
    """`--prompt` texts plus `--prompts-file` lines: `{"prompt": ...}` as `bucketserve generate`, or
    raw text."""
    prompts = list(args.prompt or [])
    if args.prompts_file:
        for line in Path(args.prompts_file).read_text().splitlines():
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                value = line
            prompts.append(value["prompt"] if isinstance(value, dict) else str(value))
    return prompts or list(DEFAULT_PROMPTS)


def request_body(prompt: str, max_new_tokens: int) -> dict:
    # details: the generated token count for TPOT; /generate_stream sends it on the last event
    # anyway
    return {"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens, "details": True}}


# --- one request -------------------------------------------------------------------------------


def parse_event(line: str) -> dict | None:
    """One SSE line of TGI's `/generate_stream`: `data:{json}` (the space after the colon is
    optional)."""
    if not line.startswith("data:"):
        return None  # blank separators, comments (":...") and other fields carry nothing we use
    payload = line[len("data:") :].strip()
    return json.loads(payload) if payload and payload != "[DONE]" else None


def http_failure(result: Result, status: int, text: str) -> Result:
    result.outcome = "429" if status == 429 else "error"
    result.error = f"http {status}: {text[:200]}"
    return result


async def send_stream(client: httpx.AsyncClient, url: str, body: dict, result: Result) -> Result:
    start = time.perf_counter()
    async with client.stream("POST", f"{url}/generate_stream", json=body) as response:
        if response.status_code != 200:
            return http_failure(
                result, response.status_code, (await response.aread()).decode(errors="replace")
            )
        events, last = 0, None
        async for line in response.aiter_lines():
            event = parse_event(line)
            if event is None:
                continue
            if "error" in event:  # TGI reports a generation that failed mid-stream as a last event
                result.error = f"stream: {event['error']}"
                return result
            if events == 0:
                result.ttft = time.perf_counter() - start
            events, last = events + 1, event
    result.latency = time.perf_counter() - start
    if last is None or last.get("generated_text") is None:
        result.error = "stream ended before its last event"
        return result
    result.tokens = (last.get("details") or {}).get("generated_tokens") or events
    # the first token's time is TTFT; TPOT is the mean gap between the ones after it
    result.tpot = (
        (result.latency - result.ttft) / (result.tokens - 1) if result.tokens > 1 else None
    )
    result.outcome = "ok"
    return result


async def send_generate(client: httpx.AsyncClient, url: str, body: dict, result: Result) -> Result:
    start = time.perf_counter()
    response = await client.post(f"{url}/generate", json=body)
    result.latency = time.perf_counter() - start
    if response.status_code != 200:
        return http_failure(result, response.status_code, response.text)
    details = response.json().get("details") or {}
    result.tokens = details.get("generated_tokens") or 0
    # without a stream the first token arrives with the last: TTFT is the whole latency, and TPOT
    # spreads it (prefill included) over the generated tokens
    result.ttft = result.latency
    result.tpot = result.latency / result.tokens if result.tokens else None
    result.outcome = "ok"
    return result


async def one_request(
    client: httpx.AsyncClient, args: argparse.Namespace, body: dict, result: Result
) -> Result:
    send = send_stream if args.stream else send_generate
    try:
        return await asyncio.wait_for(send(client, args.url, body, result), args.timeout)
    except (asyncio.TimeoutError, httpx.TimeoutException):
        result.error = f"timeout after {args.timeout:g}s"
    except Exception as error:  # noqa: BLE001 - whatever happens, the request must end up counted
        result.error = f"{type(error).__name__}: {error}"
    result.outcome, result.latency, result.ttft, result.tpot = "error", None, None, None
    return result


# --- the run -----------------------------------------------------------------------------------


def progress_bar(n: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(
        total=n, desc="loadtest", unit="req", file=sys.stderr, disable=not enabled, mininterval=0.5
    )


async def run_load(args: argparse.Namespace, prompts: list[str]) -> tuple[list[Result], float]:
    """Send every request at its arrival time without waiting for earlier ones; (results,
    duration)."""
    offsets = arrival_times(args.requests, args.rate, args.arrivals == "poisson", args.seed)
    # no connection cap: httpx's default of 100 would queue requests client-side and close the loop
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    counts = {"ok": 0, "429": 0, "error": 0}
    bar = progress_bar(args.requests, args.progress)

    def done(task: asyncio.Task) -> None:
        if task.cancelled():  # Ctrl-C: asyncio.run cancels what is left
            return
        counts[task.result().outcome] += 1
        bar.set_postfix(ok=counts["ok"], r429=counts["429"], err=counts["error"], refresh=False)
        bar.update()

    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:
        start, tasks = time.perf_counter(), []
        for i, offset in enumerate(offsets):
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            result = Result(index=i, sent=time.perf_counter() - start)
            body = request_body(prompts[i % len(prompts)], args.max_new_tokens)
            tasks.append(asyncio.create_task(one_request(client, args, body, result)))
            tasks[-1].add_done_callback(done)
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()
    return list(results), duration


# --- the summary -------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default), None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def distribution(values: list[float | None]) -> dict:
    present = [v for v in values if v is not None]
    stats = {f"p{q}": percentile(present, q) for q in PERCENTILES}
    stats["mean"] = sum(present) / len(present) if present else None
    return stats


def sent_rate(results: list[Result]) -> float | None:
    """The rate actually achieved: far below --rate means this client, not the server, was the
    limit."""
    last = results[-1].sent if results else 0.0
    return (len(results) - 1) / last if len(results) > 1 and last > 0 else None


def summarize(args: argparse.Namespace, results: list[Result], duration: float) -> dict:
    ok = [r for r in results if r.outcome == "ok"]
    tokens = sum(r.tokens for r in ok)
    errors: dict[str, int] = {}
    for r in results:
        if r.outcome == "error":
            reason = (r.error or "unknown").split(":")[
                0
            ]  # "http 503", "timeout after 5s", "ConnectError"
            errors[reason] = errors.get(reason, 0) + 1
    return {
        "url": args.url,
        "requests": len(results),
        "rate": args.rate,
        "arrivals": args.arrivals,
        "stream": args.stream,
        "max_new_tokens": args.max_new_tokens,
        "ok": len(ok),
        "rejected_429": sum(r.outcome == "429" for r in results),
        "errors": sum(r.outcome == "error" for r in results),
        "error_reasons": errors,
        "duration_s": duration,
        "sent_rate": sent_rate(results),
        "throughput_rps": len(ok) / duration if duration > 0 else 0.0,
        "generated_tokens": tokens,
        "throughput_tokens_s": tokens / duration if duration > 0 else 0.0,
        "latency_s": distribution([r.latency for r in ok]),
        "ttft_s": distribution([r.ttft for r in ok]),
        "tpot_s": distribution([r.tpot for r in ok]),
    }


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def format_report(summary: dict, plot_path: Path | None) -> str:
    mode = "stream" if summary["stream"] else "generate"
    sent = f"{summary['sent_rate']:.2f}" if summary["sent_rate"] else "-"
    reasons = ", ".join(f"{k}: {v}" for k, v in sorted(summary["error_reasons"].items()))
    lines = [
        f"loadtest {summary['url']}  {summary['requests']} requests at {summary['rate']:g} req/s "
        f"({summary['arrivals']}, /{'generate_stream' if mode == 'stream' else 'generate'}, "
        f"max_new_tokens {summary['max_new_tokens']})",
        f"  outcomes     ok {summary['ok']}   429 {summary['rejected_429']}   errors "
        f"{summary['errors']}" + (f"   ({reasons})" if reasons else ""),
        f"  duration     {summary['duration_s']:.2f} s   (sent at {sent} req/s)",
        f"  throughput   {summary['throughput_rps']:.2f} req/s   "
        f"{summary['throughput_tokens_s']:.1f} tokens/s"
        f"   ({summary['generated_tokens']} tokens)",
        f"  {'':12} {'p50':>9} {'p90':>9} {'p99':>9} {'mean':>9}   (ms, successful requests)",
    ]
    for label, key in (("latency", "latency_s"), ("TTFT", "ttft_s"), ("TPOT", "tpot_s")):
        stats = summary[key]
        lines.append(
            f"  {label:12} " + " ".join(f"{ms(stats[k]):>9}" for k in ("p50", "p90", "p99", "mean"))
        )
    if not summary["stream"]:
        lines.append("  (no stream: TTFT is the whole latency, TPOT is latency / generated tokens)")
    if plot_path is not None:
        lines.append(f"  plot         {plot_path}")
    return "\n".join(lines)


def plot(results: list[Result], summary: dict, path: Path) -> None:
    """Latency and TTFT per request against its send time, TPOT below; 429s and errors as marks."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a server, and no GUI thread
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.outcome == "ok"]
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(10, 7))
    top.scatter([r.sent for r in ok], [r.latency for r in ok], s=10, label="end-to-end latency")
    top.scatter([r.sent for r in ok], [r.ttft for r in ok], s=10, label="time to first token")
    for outcome, marker, color in (("429", "x", "orange"), ("error", "x", "red")):
        failed = [r.sent for r in results if r.outcome == outcome]
        if failed:  # on the x axis: they have no latency worth plotting, only a time
            top.scatter(
                failed,
                [0] * len(failed),
                marker=marker,
                color=color,
                label=f"{outcome} ({len(failed)})",
            )
    top.set_ylabel("seconds")
    top.legend(loc="upper left")
    top.set_title(
        f"{summary['requests']} requests at {summary['rate']:g} req/s ({summary['arrivals']}) "
        f"to {summary['url']}"
    )
    with_tpot = [r for r in ok if r.tpot is not None]
    bottom.scatter(
        [r.sent for r in with_tpot], [r.tpot * 1000 for r in with_tpot], s=10, color="green"
    )
    bottom.set_ylabel("time per output token (ms)")
    bottom.set_xlabel("send time (s from start)")
    for axis in (top, bottom):
        axis.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --- the command -------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bucketserve loadtest",
        description="Open-loop load test of a running "
        "TGI-compatible server (/generate or /generate_stream).",
    )
    p.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8080")
    p.add_argument(
        "--rate", type=float, required=True, help="arrivals per second, whatever the server answers"
    )
    p.add_argument("--requests", type=int, required=True, help="how many requests to send")
    p.add_argument(
        "--stream", action="store_true", help="use /generate_stream (measures TTFT and TPOT)"
    )
    p.add_argument(
        "--arrivals",
        choices=("poisson", "uniform"),
        default="poisson",
        help="exponential gaps (default) or a fixed 1/rate interval",
    )
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument(
        "--prompt", action="append", help="a prompt (repeatable; requests cycle through them)"
    )
    p.add_argument("--prompts-file", help='JSON lines of {"prompt": "..."} (or plain text lines)')
    p.add_argument("--seed", type=int, default=0, help="seed of the Poisson arrivals")
    p.add_argument(
        "--timeout", type=float, default=120.0, help="seconds per request; a late one is an error"
    )
    p.add_argument("--out", help="directory for latency.png, summary.json and requests.jsonl")
    p.add_argument("--plot", help="the PNG path (default: OUT/latency.png, else ./loadtest.png)")
    p.add_argument(
        "--json", action="store_true", help="print the summary as JSON instead of the report"
    )
    p.add_argument(
        "--no-progress", dest="progress", action="store_false", help="no progress bar on stderr"
    )
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    problems = [
        f"{flag} must be > 0"
        for flag, value in (
            ("--rate", args.rate),
            ("--requests", args.requests),
            ("--max-new-tokens", args.max_new_tokens),
            ("--timeout", args.timeout),
        )
        if not value > 0
    ]
    if not args.url.startswith(("http://", "https://")):
        problems.append("--url must start with http:// or https://")
    if problems:
        p.error("; ".join(problems))
    args.url = args.url.rstrip("/")
    return args


def plot_path(args: argparse.Namespace) -> Path:
    if args.plot:
        return Path(args.plot)
    return Path(args.out) / "latency.png" if args.out else Path("loadtest.png")


def write_outputs(args: argparse.Namespace, results: list[Result], summary: dict) -> None:
    plot(results, summary, Path(summary["plot"]))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        (out / "requests.jsonl").write_text("".join(json.dumps(asdict(r)) + "\n" for r in results))


def main(argv: list[str] | None = None) -> int:
    """0 when at least one request succeeded, 1 when none did, 2 for a wrong command line."""
    try:
        args = parse_args(argv)
        prompts = read_prompts(args)
    except SystemExit as exit_:  # argparse exits; the dispatcher wants a status
        return int(exit_.code or 0)
    except (OSError, KeyError, TypeError) as error:
        print(f"error: --prompts-file: {error}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        results, duration = asyncio.run(run_load(args, prompts))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    summary = summarize(args, results, duration)
    summary["plot"] = str(plot_path(args))
    write_outputs(args, results, summary)
    print(json.dumps(summary) if args.json else format_report(summary, Path(summary["plot"])))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
