"""The router's HTTP API (TGI's schema) over a real `engine serve` shard, both as subprocesses."""

import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from text_generation import Client

from tests.test_equivalence import PROMPTS, reference_tokens
from tests.test_server import (
    REPO,
    short_socket_dir,
    start_cli_server,
    stop_cli_server,
    wait_until_serving,
)

pytestmark = pytest.mark.slow  # end to end: real shard and router processes

NEW_TOKENS = 20
ROUTER_LIMITS = [
    "--max-input-tokens",
    "64",
    "--max-total-tokens",
    "128",
    "--max-batch-prefill-tokens",
    "128",
    "--max-batch-size",
    "4",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


WAIT_FOR_SHARD = ["--wait-for-shards", "180"]  # as long as wait_until_serving waits


def start_router(model_dir, base: Path, port: int, limits=ROUTER_LIMITS) -> subprocess.Popen:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    command = [
        sys.executable,
        "-m",
        "router",
        "--master-shard-uds-path",
        f"unix://{base}-0",
        "--tokenizer",
        str(model_dir),
        "--port",
        str(port),
        "--hostname",
        "127.0.0.1",
        *limits,
    ]
    with open(f"{base}.router.log", "w") as log:
        return subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def wait_for_router(process: subprocess.Popen, url: str, base: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(
                f"the router exited with {process.returncode}:\n{Path(f'{base}.router.log').read_text()}"
            )
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)
    pytest.fail(f"no router on {url}:\n{Path(f'{base}.router.log').read_text()}")


@contextmanager
def shard_and_router(model_dir, base: Path, shard_args: list[str], router_limits=ROUTER_LIMITS):
    """A real shard process and a real router over it: (router URL, the shard's socket base).

    The router starts beside the shard and waits for it, as the launcher starts them: its imports
    and its tokenizer load on the second core while the shard loads the model."""
    shard = start_cli_server(model_dir, base, extra=shard_args)
    router = None
    try:
        port = free_port()
        router = start_router(model_dir, base, port, [*router_limits, *WAIT_FOR_SHARD])
        wait_until_serving(shard, f"unix://{base}-0", base).close()
        wait_for_router(router, f"http://127.0.0.1:{port}", base)
        yield f"http://127.0.0.1:{port}", base
    finally:
        if router is not None:
            stop_cli_server(router)
        stop_cli_server(shard)


@pytest.fixture(scope="module")
def served(tiny_model_dirs):
    """(router URL, the shard's socket base: its debug log, one line per RPC, is BASE.log)."""
    with shard_and_router(
        tiny_model_dirs["llama"], short_socket_dir() / "s", ["--max-batch-size", "4"]
    ) as served:
        yield served


@pytest.fixture(scope="module")
def router_url(served):
    return served[0]


def generate(url: str, prompt: str, **parameters) -> dict:
    body = {
        "inputs": prompt,
        "parameters": {"max_new_tokens": NEW_TOKENS, "details": True, **parameters},
    }
    response = httpx.post(f"{url}/generate", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def token_ids(response: dict) -> list[int]:
    return [t["id"] for t in response["details"]["tokens"]]


def test_generate_greedy_matches_transformers(router_url, tiny_model_dirs):
    prompts = PROMPTS[:3]
    expected = reference_tokens(tiny_model_dirs["llama"], prompts, NEW_TOKENS, stop_on_eos=True)
    for prompt, reference in zip(prompts, expected):
        response = generate(router_url, prompt, decoder_input_details=True)
        details = response["details"]
        assert token_ids(response) == reference
        assert details["generated_tokens"] == len(reference)
        assert details["finish_reason"] == (
            "length" if len(reference) == NEW_TOKENS else "eos_token"
        )
        assert len(details["prefill"]) > 0 and details["prefill"][0]["logprob"] is None
        assert isinstance(response["generated_text"], str)


def stream_events(url: str, prompt: str) -> list[dict]:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": NEW_TOKENS}}
    with httpx.stream("POST", f"{url}/generate_stream", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        return [
            json.loads(line[len("data:") :])
            for line in response.iter_lines()
            if line.startswith("data:")
        ]


def while_streaming(url: str, body: dict, during) -> list[int]:
    """The token ids of `body` streamed from /generate_stream; `during()` runs once its first
    token came, while the request is still running."""
    ids = []
    with httpx.stream("POST", f"{url}/generate_stream", json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data:"):
                ids.append(json.loads(line[len("data:") :])["token"]["id"])
                if len(ids) == 1:
                    during()
    return ids


def test_an_image_to_a_text_model_is_refused_while_a_request_stays_exact(
    router_url, tiny_model_dirs
):
    parts = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]
    image = {"messages": [{"role": "user", "content": parts}], "max_tokens": 2}
    answers = []

    def refuse():
        answers.append(httpx.post(f"{router_url}/v1/chat/completions", json=image, timeout=60))

    body = {"inputs": PROMPTS[2], "parameters": {"max_new_tokens": NEW_TOKENS}}
    ids = while_streaming(router_url, body, refuse)
    assert (
        ids
        == reference_tokens(tiny_model_dirs["llama"], [PROMPTS[2]], NEW_TOKENS, stop_on_eos=True)[0]
    )
    assert answers[0].status_code == 422
    assert "this model does not take images" in answers[0].json()["error"]["message"]


def test_generate_stream_equals_generate(router_url):
    events = stream_events(router_url, PROMPTS[1])
    whole = generate(router_url, PROMPTS[1])
    assert [e["token"]["id"] for e in events] == token_ids(whole)
    assert [e["index"] for e in events] == list(range(1, len(events) + 1))
    assert all(e["generated_text"] is None and e["details"] is None for e in events[:-1])
    assert events[-1]["generated_text"] == whole["generated_text"]
    assert events[-1]["details"]["finish_reason"] == whole["details"]["finish_reason"]
    assert events[-1]["details"]["generated_tokens"] == len(events)


def test_tgi_python_client(router_url):
    client = Client(router_url, timeout=60)
    whole = generate(router_url, PROMPTS[3])
    response = client.generate(PROMPTS[3], max_new_tokens=NEW_TOKENS)
    assert response.generated_text == whole["generated_text"]
    assert [t.id for t in response.details.tokens] == token_ids(whole)
    streamed = list(client.generate_stream(PROMPTS[3], max_new_tokens=NEW_TOKENS))
    assert [r.token.id for r in streamed] == token_ids(whole)
    assert streamed[-1].generated_text == whole["generated_text"]
    sampled = client.generate(
        PROMPTS[0], max_new_tokens=5, do_sample=True, temperature=0.7, top_p=0.9, seed=7
    )
    assert sampled.details.seed == 7 and sampled.details.generated_tokens <= 5


@pytest.mark.parametrize(
    "parameters",
    [
        {"max_new_tokens": 0},
        {"max_new_tokens": 500},
        {"top_p": 1.5},
        {"temperature": -1.0},
        {"truncate": 1000},
    ],
)
def test_validation_errors_are_422(router_url, parameters):
    response = httpx.post(
        f"{router_url}/generate", json={"inputs": "Hi", "parameters": parameters}, timeout=30
    )
    assert response.status_code == 422
    assert response.json()["error_type"] == "validation"


def test_input_too_long_and_truncate(router_url):
    long = "word " * 200
    response = httpx.post(f"{router_url}/generate", json={"inputs": long}, timeout=30)
    assert response.status_code == 422 and response.json()["error_type"] == "validation"
    assert "inputs" in response.json()["error"]
    truncated = generate(router_url, long, truncate=10, max_new_tokens=3)
    assert truncated["details"]["generated_tokens"] <= 3


def test_health_and_info(router_url):
    assert httpx.get(f"{router_url}/health", timeout=30).status_code == 200
    info = httpx.get(f"{router_url}/info", timeout=30).json()
    assert info["max_input_tokens"] == 64 and info["max_total_tokens"] == 128
    assert info["max_batch_size"] == 4 and info["version"] and info["model_id"]
    assert info["attention_impl"] == "flat_paged"  # the native model, not the transformers fallback


def test_concurrent_requests_equal_alone(router_url):
    cases = [(PROMPTS[i % len(PROMPTS)], 8 + 3 * i) for i in range(8)]
    alone = [token_ids(generate(router_url, p, max_new_tokens=n)) for p, n in cases]
    with ThreadPoolExecutor(8) as pool:
        together = list(
            pool.map(lambda c: token_ids(generate(router_url, c[0], max_new_tokens=c[1])), cases)
        )
    assert together == alone


def rpc_lines(base: Path) -> list[str]:
    return Path(f"{base}.log").read_text().splitlines()


def test_disconnect_mid_stream_cancels_the_request(served):
    url, base = served
    body = {"inputs": PROMPTS[2], "parameters": {"max_new_tokens": 100}}
    with httpx.stream("POST", f"{url}/generate_stream", json=body, timeout=60) as response:
        next(response.iter_lines())
        seen = len(rpc_lines(base))
    deadline = time.monotonic() + 10
    while not any(
        " DEBUG engine.serving.server: ClearCache" in line for line in rpc_lines(base)[seen:]
    ):
        assert time.monotonic() < deadline, "the shard never dropped the abandoned request"
        time.sleep(0.05)
    decodes = [line for line in rpc_lines(base)[seen:] if "Decode" in line]
    assert len(decodes) < 90  # dropped long before its 100 tokens
    assert generate(url, PROMPTS[0], max_new_tokens=5)["details"]["generated_tokens"] <= 5
