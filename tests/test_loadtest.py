"""`bucketserve loadtest` against real HTTP servers: a tiny TGI imitation (fast, with scripted 429s,
failures and hangs) and, end to end, the real router over a real shard on the tiny model."""

import asyncio
import json
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from launcher import loadtest
from tests.test_router_http import free_port, served  # noqa: F401 - `served` is a fixture used below

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class FakeTGI:
    """TGI's `/generate` and `/generate_stream` formats, one token per `delay` seconds. Scripted by prompt:
    "hang" never answers, "fail" fails (500, or an error event mid-stream); every `reject_every`-th
    request gets a 429; with `barrier` set, nothing answers until that many requests are in flight."""

    def __init__(self):
        self.delay, self.reject_every, self.barrier = 0.0, 0, 0
        self.seen = self.in_flight = self.peak = 0
        self.all_in = asyncio.Event()

    def reset(self, delay=0.0, reject_every=0, barrier=0):
        self.__init__()
        self.delay, self.reject_every, self.barrier = delay, reject_every, barrier

    async def admit(self, body: dict, stream: bool) -> JSONResponse | None:
        self.seen += 1
        if self.reject_every and self.seen % self.reject_every == 0:
            return JSONResponse(
                {"error": "Model is overloaded", "error_type": "overloaded"}, status_code=429
            )
        if "hang" in body["inputs"]:
            await asyncio.sleep(3600)
        if "fail" in body["inputs"] and not stream:
            return JSONResponse({"error": "boom", "error_type": "generation"}, status_code=500)
        return None

    async def tokens(self, n: int):
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        if self.barrier:  # only a client that does not wait for answers can ever fill it
            if self.in_flight >= self.barrier:
                self.all_in.set()
            await self.all_in.wait()
        try:
            for i in range(n):
                await asyncio.sleep(self.delay)
                yield i
        finally:
            self.in_flight -= 1

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/generate")
        async def generate(request: Request):
            body = await request.json()
            if (refused := await self.admit(body, stream=False)) is not None:
                return refused
            n = body["parameters"]["max_new_tokens"]
            text = "".join([f" t{i}" async for i in self.tokens(n)])
            return {
                "generated_text": text,
                "details": {"finish_reason": "length", "generated_tokens": n, "seed": None},
            }

        @app.post("/generate_stream")
        async def generate_stream(request: Request):
            body = await request.json()
            if (refused := await self.admit(body, stream=True)) is not None:
                return refused
            return StreamingResponse(self.events(body), media_type="text/event-stream")

        return app

    async def events(self, body: dict):
        n = body["parameters"]["max_new_tokens"]
        async for i in self.tokens(n):
            if "fail" in body["inputs"] and i == 1:
                yield f"data:{json.dumps({'error': 'boom', 'error_type': 'generation'})}\n\n"
                return
            last = i == n - 1
            event = {
                "index": i + 1,
                "token": {"id": i, "text": f" t{i}", "logprob": 0.0, "special": False},
                "top_tokens": [],
                "generated_text": " text" if last else None,
                "details": {"finish_reason": "length", "generated_tokens": n, "seed": None}
                if last
                else None,
            }
            yield f"data:{json.dumps(event)}\n\n"


@pytest.fixture(scope="module")
def fake():
    """(FakeTGI, its URL): a real uvicorn server in a thread on a free local port."""
    tgi, port = FakeTGI(), free_port()
    server = uvicorn.Server(
        uvicorn.Config(tgi.app(), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started
    yield tgi, f"http://127.0.0.1:{port}"
    server.should_exit = server.force_exit = True  # don't wait for the "hang" handlers
    thread.join(timeout=10)


def run(capsys, url, *extra, requests=20, rate=200.0):
    argv = [
        "--url",
        url,
        "--rate",
        str(rate),
        "--requests",
        str(requests),
        "--json",
        "--no-progress",
        *extra,
    ]
    status = loadtest.main(argv)
    return status, json.loads(capsys.readouterr().out)


def check_summary(summary: dict) -> None:
    assert summary["ok"] + summary["rejected_429"] + summary["errors"] == summary["requests"]
    assert sum(summary["error_reasons"].values()) == summary["errors"]
    for key in ("latency_s", "ttft_s", "tpot_s"):
        stats = summary[key]
        if stats["p50"] is not None:
            assert 0 <= stats["p50"] <= stats["p90"] <= stats["p99"], (key, stats)


def test_stream_counts_429s_apart(fake, capsys, tmp_path):
    tgi, url = fake
    tgi.reset(delay=0.002, reject_every=5)
    status, summary = run(
        capsys, url, "--stream", "--max-new-tokens", "6", "--plot", str(tmp_path / "p.png")
    )
    assert status == 0
    check_summary(summary)
    assert (summary["ok"], summary["rejected_429"], summary["errors"]) == (16, 4, 0)
    assert summary["generated_tokens"] == 16 * 6
    assert summary["throughput_tokens_s"] > 0 and summary["throughput_rps"] > 0
    assert summary["ttft_s"]["p50"] <= summary["latency_s"]["p50"]
    assert (tmp_path / "p.png").read_bytes().startswith(PNG_MAGIC)


def test_generate_ttft_is_the_latency(fake, capsys, tmp_path):
    tgi, url = fake
    tgi.reset(delay=0.001)
    status, summary = run(
        capsys, url, "--max-new-tokens", "4", "--arrivals", "uniform", "--out", str(tmp_path)
    )
    assert status == 0
    check_summary(summary)
    assert summary["ok"] == 20 and summary["generated_tokens"] == 80
    rows = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert [r["index"] for r in rows] == list(range(20))
    for r in rows:
        assert r["ttft"] == r["latency"] and r["tpot"] == pytest.approx(r["latency"] / 4)
    assert json.loads((tmp_path / "summary.json").read_text())["ok"] == 20
    assert (tmp_path / "latency.png").read_bytes().startswith(PNG_MAGIC)


@pytest.mark.parametrize("stream", [True, False])
def test_timeouts_and_failures_are_errors(fake, capsys, tmp_path, stream):
    tgi, url = fake
    tgi.reset()
    prompts = [
        "--prompt",
        "fine",
        "--prompt",
        "please hang",
        "--prompt",
        "then fail",
        "--prompt",
        "fine again",
    ]
    extra = ["--stream"] if stream else []
    status, summary = run(
        capsys,
        url,
        *prompts,
        *extra,
        "--timeout",
        "0.5",
        "--max-new-tokens",
        "3",
        "--plot",
        str(tmp_path / "p.png"),
        requests=8,
    )
    assert status == 0
    check_summary(summary)
    assert (summary["ok"], summary["rejected_429"], summary["errors"]) == (4, 0, 4)
    reasons = summary["error_reasons"]
    assert reasons["timeout after 0.5s"] == 2
    assert reasons["stream" if stream else "http 500"] == 2


def test_open_loop_sends_without_waiting(fake, capsys, tmp_path):
    """The server answers nobody until all 12 requests are in flight: a closed loop would time out."""
    tgi, url = fake
    tgi.reset(barrier=12)
    status, summary = run(
        capsys,
        url,
        "--stream",
        "--max-new-tokens",
        "2",
        "--timeout",
        "20",
        "--plot",
        str(tmp_path / "p.png"),
        requests=12,
        rate=100.0,
    )
    assert status == 0 and summary["ok"] == 12 and tgi.peak == 12


def test_nothing_answers(capsys, tmp_path):
    status, summary = run(
        capsys, f"http://127.0.0.1:{free_port()}", "--plot", str(tmp_path / "p.png"), requests=3
    )
    assert status == 1
    check_summary(summary)
    assert summary["errors"] == 3 and summary["latency_s"]["p50"] is None
    assert (tmp_path / "p.png").read_bytes().startswith(PNG_MAGIC)


def test_text_report(fake, capsys, tmp_path):
    tgi, url = fake
    tgi.reset(reject_every=2)
    argv = [
        "--url",
        url + "/",
        "--rate",
        "100",
        "--requests",
        "4",
        "--stream",
        "--no-progress",
        "--plot",
        str(tmp_path / "p.png"),
    ]
    assert loadtest.main(argv) == 0
    report = capsys.readouterr().out
    assert "ok 2   429 2   errors 0" in report and "TTFT" in report and "TPOT" in report
    assert str(tmp_path / "p.png") in report


@pytest.mark.parametrize(
    "bad",
    [
        ["--rate", "0"],
        ["--requests", "0"],
        ["--url", "localhost:8080"],
        ["--prompts-file", "/nonexistent.jsonl"],
    ],
)
def test_command_line_errors(bad, capsys):
    argv = {"--url": "http://127.0.0.1:1", "--rate": "1", "--requests": "1"}
    for flag, value in zip(bad[::2], bad[1::2]):
        argv[flag] = value
    assert loadtest.main([x for pair in argv.items() for x in pair]) == loadtest.EXIT_CONFIG
    assert "error" in capsys.readouterr().err


def test_arrivals_and_percentiles():
    uniform = loadtest.arrival_times(5, 4.0, poisson=False, seed=0)
    assert uniform == pytest.approx([0, 0.25, 0.5, 0.75, 1.0])
    poisson = loadtest.arrival_times(2000, 10.0, poisson=True, seed=3)
    assert poisson == loadtest.arrival_times(2000, 10.0, poisson=True, seed=3)
    assert all(a <= b for a, b in zip(poisson, poisson[1:]))
    assert 1900 / 10 * 0.9 < poisson[-1] < 1900 / 10 * 1.15  # mean gap 1/rate
    values = [float(v) for v in range(1, 101)]
    assert [loadtest.percentile(values, q) for q in (50, 90, 99)] == pytest.approx(
        [50.5, 90.1, 99.01]
    )
    assert loadtest.percentile([], 50) is None and loadtest.percentile([7.0], 99) == 7.0


def test_parse_event():
    assert loadtest.parse_event('data:{"a": 1}') == {"a": 1}
    assert loadtest.parse_event('data: {"a": 1}') == {"a": 1}
    assert loadtest.parse_event("") is None and loadtest.parse_event(": keepalive") is None
    assert loadtest.parse_event("data: [DONE]") is None


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.slow
def test_against_the_real_router(served, capsys, tmp_path, stream):  # noqa: F811 - the imported fixture
    extra = ["--stream"] if stream else []
    status, summary = run(
        capsys,
        served[0],
        *extra,
        "--max-new-tokens",
        "8",
        "--arrivals",
        "uniform",
        "--out",
        str(tmp_path),
        requests=10,
        rate=20.0,
    )
    assert status == 0
    check_summary(summary)
    assert summary["ok"] + summary["rejected_429"] == 10 and summary["ok"] > 0
    assert 0 < summary["generated_tokens"] <= 8 * summary["ok"]
    assert (tmp_path / "latency.png").read_bytes().startswith(PNG_MAGIC)
    assert json.loads((tmp_path / "summary.json").read_text())["requests"] == 10
