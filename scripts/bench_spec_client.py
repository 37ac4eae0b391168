"""One lone greedy request on an input-grounded rewrite, against any OpenAI-compatible server.

    python scripts/bench_spec_client.py --render MODEL_DIR > prompt.txt    (the chat-templated text)
    python scripts/bench_spec_client.py --render MODEL_DIR --free > free.txt    (free text instead)
    python scripts/bench_spec_client.py --url URL --prompt-file prompt.txt --label NAME

The rewrite prompt is scripts/bench_speculative.py's (it imports it from here), rendered once
through the model's chat template so that both servers get the very same text on
`/v1/completions`. The request is greedy, streams, stops at EOS or `--max-tokens` (128), and
prints one JSON line: the decode rate (tokens after the first over the time after the first,
the same definition as scripts/bench_speculative.py), TTFT, the token counts, llama-server's
draft counters where it sends them (`timings.draft_n`, `draft_n_accepted`) and the text's start.
`--summarize FILE` prints the median decode rate per label and the ratios. Used by
scripts/bench_spec_llamacpp.sh. Standard library only, except `--render` (transformers).
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import time
from urllib.parse import urlparse

TEXT = (
    "The quarterly report shows that revenue grew by twelve percent compared with the same "
    "period last year, driven mainly by strong sales in the northern region and the launch of "
    "two new products. Operating costs rose by four percent, largely because of higher "
    "shipping prices and the opening of a second warehouse. The board expects growth to "
    "continue next quarter, although it warns that currency changes could reduce profits."
)
PROMPT = "Rewrite the following text exactly, but in British English spelling:\n\n" + TEXT
# Free text (`--render MODEL_DIR --free`): nothing in the prompt to copy, speculation's worst case.
FREE_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def render(model_dir: str, prompt: str = PROMPT) -> str:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )


def request(url: str, prompt: str, max_tokens: int, model: str | None) -> dict:
    body = {
        **({"model": model} if model else {}),
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    parsed = urlparse(url)
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=300)
    start = time.perf_counter()
    first, text, usage, timings = None, [], None, {}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        sys.exit(f"{url}: http {response.status}: {response.read()[:300]!r}")
    while line := response.readline():
        line = line.decode().strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        event = json.loads(line[5:])
        usage = event.get("usage") or usage
        timings = event.get("timings") or timings
        for choice in event.get("choices") or []:
            if choice.get("text"):
                first = first if first is not None else time.perf_counter()
                text.append(choice["text"])
    end = time.perf_counter()
    conn.close()
    tokens = usage["completion_tokens"] if usage else len(text)
    return {
        "decode_tok_s": round((tokens - 1) / (end - first), 2),
        "ttft": round(first - start, 3),
        "tokens": tokens,
        "prompt_tokens": usage.get("prompt_tokens") if usage else None,
        "draft_n": timings.get("draft_n"),
        "draft_accepted": timings.get("draft_n_accepted"),
        "text": "".join(text)[:80],
    }


def summarize(path: str) -> None:
    runs: dict[str, list[dict]] = {}
    for line in open(path):
        record = json.loads(line)
        runs.setdefault(record["label"], []).append(record)
    medians = {k: statistics.median(r["decode_tok_s"] for r in v) for k, v in runs.items()}
    for label, rate in medians.items():
        each = ", ".join(f"{r['decode_tok_s']:.1f}" for r in runs[label])
        last = runs[label][-1]
        drafts = f", drafts {last['draft_accepted']}/{last['draft_n']}" if last["draft_n"] else ""
        print(f"{label:<44} {rate:7.1f} tok/s ({each}; {last['tokens']} tokens{drafts})")
    ours = {k: v for k, v in medians.items() if k.startswith("bucketserve")}
    peers = {k: v for k, v in medians.items() if not k.startswith("bucketserve")}
    plain = [v for k, v in ours.items() if "off" in k]
    for label, rate in ours.items():
        if plain and "off" not in label:
            print(f"ratio {label} / bucketserve off: {rate / plain[0]:.2f}x")
    if not ours or not peers:
        return
    best = max(peers, key=peers.get)
    print(f"llama-server's best: {best} ({peers[best]:.1f} tok/s)")
    for label, rate in ours.items():
        print(f"ratio {label} / {best}: {rate / peers[best]:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--render", metavar="MODEL_DIR", help="print the chat-templated prompt")
    parser.add_argument("--free", action="store_true", help="with --render: the free-text prompt")
    parser.add_argument("--url")
    parser.add_argument("--prompt-file")
    parser.add_argument("--label", default="server")
    parser.add_argument("--model", help="the requests' `model` field (default: none sent)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--summarize", metavar="FILE", help="JSON lines of earlier runs")
    args = parser.parse_args()
    if args.render:
        return print(render(args.render, FREE_PROMPT if args.free else PROMPT), end="")
    if args.summarize:
        return summarize(args.summarize)
    prompt = open(args.prompt_file).read()
    print(
        json.dumps({"label": args.label, **request(args.url, prompt, args.max_tokens, args.model)})
    )


if __name__ == "__main__":
    main()
